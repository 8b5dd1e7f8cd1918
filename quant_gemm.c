/*
 * quant_gemm.c — the matrix kernel: quantised weight rows times many
 * quantised activation rows, in AVX-512 VNNI register tiles.
 *
 * Owns the packed activation layout (16 tokens in the lanes of a vector), the
 * tiles and the loops around them: quant_gemm for one matrix, and quant_pack
 * + quant_gemm_packed for a caller that packs an input once and multiplies
 * several matrices by it on several threads. Weight rows reach the tiles
 * through quant.c's levels form (struct quant_levels); activation rows
 * through quant_act_parts: block byte layouts stay in quant.c.
 * Must not: know about models or threads (callers split the rows), print, or
 * allocate outside quant_gemm's scratch. Without AVX-512 VNNI (or with
 * STRATA_PORTABLE) nothing tiles and quant_gemm multiplies row by row with
 * quant.c's dots.
 * Shapes: n elements per row; nw weight rows; na activation rows (tokens) in
 * groups of 16; a sub-block is sb elements under one weight scale, a unit
 * `unit` elements under one activation scale.
 */
#include "strata.h"

#include <stdlib.h>
#include <string.h>

#if !defined(STRATA_PORTABLE) && defined(__AVX512F__) && defined(__AVX512BW__) && \
    defined(__AVX512VL__) && defined(__AVX512VNNI__) && defined(__FMA__)
#define GEMM_AVX512 1
#include <immintrin.h>
#endif

static size_t align64(size_t x) { return (x + 63) & ~(size_t)63; }

#ifdef GEMM_AVX512

#define TR 4  /* weight rows per tile */
#define TG 3  /* token groups (of 16) per tile: TR x TG = 12 independent
                 dpbusd chains, enough to hide the instruction's latency */
#define CHUNK_BYTES (256 << 10) /* packed activations one pass keeps in L2 */
#define PIECE 1024 /* elements of a row taken apart at a time while packing */

/* ---- the packed activations ----
 * Group g (tokens 16g..16g+15) holds, lane l for token 16g+l:
 *   qa  (n/4, 16, 4) int8: 4 consecutive values of each token per 64 bytes
 *   d   (n/unit, 16) float: the activation scales
 *   s16 (n/16, 16), s32 (n/32, 16) int32: sums of 16 and of 32 values
 *   s   (n/32, 16) float: Q8_1's stored sums (Q8_1 only)
 * Tokens past na are zeros, which add nothing. Each array is group-major so
 * that threads can pack disjoint groups. */
struct pack_map {
    int n, ng, unit, q81;
    size_t qa, d, s16, s32, s; /* byte offsets of the arrays */
    size_t bytes;
};

static int pack_map(int dot_type, int n, int na, struct pack_map *m)
{
    if (dot_type != QT_Q8_0 && dot_type != QT_Q8_1 && dot_type != QT_Q8_K)
        return -1;
    m->unit = dot_type == QT_Q8_K ? 256 : 32;
    if (n <= 0 || n % m->unit || na <= 0)
        return -1;
    m->n = n;
    m->ng = (na + 15) / 16;
    m->q81 = dot_type == QT_Q8_1;
    size_t G = (size_t)m->ng, N = (size_t)n;
    m->qa = 0;
    m->d = align64(G * N * 16);
    m->s16 = m->d + align64(G * (N / m->unit) * 64);
    m->s32 = m->s16 + align64(G * (N / 16) * 64);
    m->s = m->s32 + align64(G * (N / 32) * 64);
    m->bytes = m->s + (m->q81 ? align64(G * (N / 32) * 64) : 0);
    return 0;
}

size_t quant_pack_bytes(int dot_type, int n, int na)
{
    struct pack_map m;
    return pack_map(dot_type, n, na, &m) == 0 ? m.bytes : 0;
}

void quant_pack(int dot_type, int n, const void *a, size_t lda, int na, int g0, int g1, void *pack)
{
    struct pack_map m;
    if (pack_map(dot_type, n, na, &m) != 0)
        return;
    uint8_t *base = pack;
    const size_t N = (size_t)n, nunit = N / m.unit;
    int8_t qs[PIECE];
    float d[PIECE / 32], s[PIECE / 32];
    int32_t s16[PIECE / 16];
    for (int g = g0; g < g1 && g < m.ng; g++) {
        int8_t *qa = (int8_t *)(base + m.qa) + (size_t)g * N * 16;
        float *dg = (float *)(base + m.d) + (size_t)g * nunit * 16;
        int32_t *s16g = (int32_t *)(base + m.s16) + (size_t)g * (N / 16) * 16;
        int32_t *s32g = (int32_t *)(base + m.s32) + (size_t)g * (N / 32) * 16;
        float *sg = (float *)(base + m.s) + (size_t)g * (N / 32) * 16;
        if (16 * g + 16 > na) { /* a partial group: its empty lanes stay zero */
            memset(qa, 0, N * 16);
            memset(dg, 0, nunit * 64);
            memset(s16g, 0, N / 16 * 64);
            memset(s32g, 0, N / 32 * 64);
            if (m.q81)
                memset(sg, 0, N / 32 * 64);
        }
        for (int l = 0; l < 16 && 16 * g + l < na; l++) {
            const uint8_t *row = (const uint8_t *)a + (size_t)(16 * g + l) * lda;
            for (int k0 = 0; k0 < n; k0 += PIECE) {
                int len = n - k0 < PIECE ? n - k0 : PIECE;
                quant_act_parts(dot_type, row + quant_row_bytes(dot_type, k0), len, qs, d, s16, s);
                for (int c = 0; c < len / 4; c++)
                    memcpy(qa + ((size_t)(k0 / 4 + c) * 16 + l) * 4, qs + 4 * c, 4);
                for (int b = 0; b < len / m.unit; b++)
                    dg[(size_t)(k0 / m.unit + b) * 16 + l] = d[b];
                for (int j = 0; j < len / 16; j++)
                    s16g[(size_t)(k0 / 16 + j) * 16 + l] = s16[j];
                for (int j = 0; j < len / 32; j++) {
                    s32g[(size_t)(k0 / 32 + j) * 16 + l] = s16[2 * j] + s16[2 * j + 1];
                    if (m.q81)
                        sg[(size_t)(k0 / 32 + j) * 16 + l] = s[j];
                }
            }
        }
    }
}

/* ---- the tiles ----
 * A weight row contributes 4 levels at a time as a 32-bit broadcast; one
 * vpdpbusd adds their products with 4 values of 16 tokens into 16 per-token
 * sums. A sub-block's steps finish in integers before its scale is applied
 * once, in float. A tile is R weight rows by G token groups with every
 * accumulator in a register; each packed vector is loaded once per tile. */

/* What a tile reads: the packed groups from its first one, and R unpacked
 * rows (levels at u + r * rs, scales at sc + r * rs bytes, offsets likewise). */
struct tile_in {
    const int8_t *qa;
    const float *d;
    const int32_t *sums; /* s16 or s32: the sums over the kind's sub-blocks */
    const float *s;      /* Q8_1's sums */
    size_t qs, ds, ss;   /* bytes between groups: qa, d, sums and s */
    int nunit;
    const uint8_t *u;
    const float *sc, *off;
    size_t rs;           /* bytes between unpacked rows */
    int shift;           /* log2 of the level bias (kinds with a bias only) */
};

#define AT(ptr, i, stride) ((const void *)((const uint8_t *)(ptr) + (size_t)(i) * (stride)))

static inline __m512i bcast32(const void *p)
{
    int32_t v;
    memcpy(&v, p, 4);
    return _mm512_set1_epi32(v);
}

/* out (R, TG, 16) = the dots of R rows with G token groups. sb, per (sub-
 * blocks per unit), bias (whether the kind has one) and mins are constants
 * in every instance, so the loops unroll and the accumulators stay in
 * registers. A tile of 8 or fewer (row, group) pairs alternates two sets
 * of integer sums between the steps: fewer independent chains than about 12
 * leave vpdpbusd waiting on its own latency. */
static inline __attribute__((always_inline)) void
tile(const struct tile_in *t, int sb, int per, int bias, int mins, int R, int G, float *out)
{
    const int shift = t->shift;
    const int8_t *qa = t->qa;
    const float *d = t->d, *s = t->s;
    const int32_t *sums = t->sums;
    const uint8_t *u = t->u;
    const float *sc = t->sc, *off = t->off;
    const size_t rs = t->rs, qs = t->qs, ds = t->ds, ss = t->ss;
    __m512 facc[TR][TG];
#pragma GCC unroll 4
    for (int r = 0; r < R; r++)
#pragma GCC unroll 4
        for (int g = 0; g < G; g++) {
            facc[r][g] = _mm512_setzero_ps();
            if (per > 1)
                _mm512_storeu_ps(out + (r * TG + g) * 16, facc[r][g]);
        }
    for (int un = 0; un < t->nunit; un++) {
        __m512 fsb[TR][TG];
#pragma GCC unroll 4
        for (int r = 0; r < R; r++)
#pragma GCC unroll 4
            for (int g = 0; g < G; g++)
                fsb[r][g] = _mm512_setzero_ps();
        for (int sub = 0; sub < per; sub++) {
            const int split = R * G <= 8 ? 2 : 1;
            __m512i acc[2][TR][TG];
#pragma GCC unroll 4
            for (int g = 0; g < G; g++) {
                /* the bias of the unsigned levels, taken out up front:
                 * -bias * sum(a), exact in int32 (|sum| <= 32 * 128) */
                __m512i iv = _mm512_setzero_si512();
                if (bias)
                    iv = _mm512_sub_epi32(iv, _mm512_slli_epi32(_mm512_loadu_si512(AT(sums, g, ss)), shift));
#pragma GCC unroll 4
                for (int r = 0; r < R; r++) {
                    acc[0][r][g] = iv;
                    acc[1][r][g] = _mm512_setzero_si512();
                }
            }
#pragma GCC unroll 8
            for (int st = 0; st < sb / 4; st++) {
                __m512i A[TG];
#pragma GCC unroll 4
                for (int g = 0; g < G; g++) {
                    A[g] = _mm512_loadu_si512(AT(qa + 64 * st, g, qs));
                    /* one load per vector: folded into each vpdpbusd, the
                     * loads (R per vector) would outrun the multiplies */
                    __asm__("" : "+v"(A[g]));
                }
#pragma GCC unroll 4
                for (int r = 0; r < R; r++) {
                    __m512i B = bcast32(AT(u + 4 * st, r, rs));
#pragma GCC unroll 4
                    for (int g = 0; g < G; g++)
                        acc[st % split][r][g] = _mm512_dpbusd_epi32(acc[st % split][r][g], B, A[g]);
                }
            }
            if (split == 2)
#pragma GCC unroll 4
                for (int r = 0; r < R; r++)
#pragma GCC unroll 4
                    for (int g = 0; g < G; g++)
                        acc[0][r][g] = _mm512_add_epi32(acc[0][r][g], acc[1][r][g]);
#pragma GCC unroll 4
            for (int r = 0; r < R; r++) {
                __m512 scv = _mm512_set1_ps(*(const float *)AT(sc, r, rs));
#pragma GCC unroll 4
                for (int g = 0; g < G; g++)
                    fsb[r][g] = _mm512_fmadd_ps(_mm512_cvtepi32_ps(acc[0][r][g]), scv, fsb[r][g]);
            }
            if (mins == QUANT_MINS_SUB)
#pragma GCC unroll 4
                for (int g = 0; g < G; g++) {
                    __m512 av = _mm512_cvtepi32_ps(_mm512_loadu_si512(AT(sums, g, ss)));
#pragma GCC unroll 4
                    for (int r = 0; r < R; r++)
                        fsb[r][g] = _mm512_fmadd_ps(av, _mm512_set1_ps(*(const float *)AT(off, r, rs)),
                                                    fsb[r][g]);
                }
            qa += 16 * sb;
            u += sb;
            sums += 16;
            sc++;
            if (mins == QUANT_MINS_SUB)
                off++;
        }
#pragma GCC unroll 4
        for (int g = 0; g < G; g++) {
            __m512 dv = _mm512_loadu_ps(AT(d, g, ds));
            /* super-blocks: the running sums live in out (once per 256
             * elements), as 3 x 12 accumulators would not fit in registers */
#pragma GCC unroll 4
            for (int r = 0; r < R; r++)
                if (per > 1)
                    _mm512_storeu_ps(out + (r * TG + g) * 16,
                                     _mm512_fmadd_ps(fsb[r][g], dv, _mm512_loadu_ps(out + (r * TG + g) * 16)));
                else
                    facc[r][g] = _mm512_fmadd_ps(fsb[r][g], dv, facc[r][g]);
            if (mins == QUANT_MINS_Q8_1) {
                __m512 sv = _mm512_loadu_ps(AT(s, g, ss));
#pragma GCC unroll 4
                for (int r = 0; r < R; r++)
                    facc[r][g] = _mm512_fmadd_ps(sv, _mm512_set1_ps(*(const float *)AT(off, r, rs)),
                                                 facc[r][g]);
            }
        }
        d += 16;
        if (mins == QUANT_MINS_Q8_1) {
            s += 16;
            off++;
        }
    }
#pragma GCC unroll 4
    for (int r = 0; r < R; r++)
#pragma GCC unroll 4
        for (int g = 0; g < G; g++)
            if (per == 1)
                _mm512_storeu_ps(out + (r * TG + g) * 16, facc[r][g]);
}

typedef void (*tile_fn)(const struct tile_in *t, float *out);

/* One instance per (kind, tile shape). */
#define TILE(name, SB, PER, BIAS, MINS, R, G)                                   \
    static void name(const struct tile_in *t, float *out)                       \
    {                                                                           \
        tile(t, SB, PER, BIAS, MINS, R, G, out);                                \
    }
#define TILES(kind, SB, PER, BIAS, MINS)                                                      \
    TILE(kind##_43, SB, PER, BIAS, MINS, 4, 3) TILE(kind##_42, SB, PER, BIAS, MINS, 4, 2)     \
    TILE(kind##_41, SB, PER, BIAS, MINS, 4, 1) TILE(kind##_13, SB, PER, BIAS, MINS, 1, 3)     \
    TILE(kind##_12, SB, PER, BIAS, MINS, 1, 2) TILE(kind##_11, SB, PER, BIAS, MINS, 1, 1)     \
    static const tile_fn kind[2][TG] = {{kind##_41, kind##_42, kind##_43},                \
                                            {kind##_11, kind##_12, kind##_13}};
TILES(legacy_bias, 32, 1, 1, QUANT_MINS_NONE)
TILES(legacy_q8_1, 32, 1, 0, QUANT_MINS_Q8_1)
TILES(k32_min, 32, 8, 0, QUANT_MINS_SUB)
TILES(k16_min, 16, 16, 0, QUANT_MINS_SUB)
TILES(k32_bias, 32, 8, 1, QUANT_MINS_NONE)
TILES(k16_bias, 16, 16, 1, QUANT_MINS_NONE)

/* tiles[full ? 0 : 1][G - 1]: full = TR rows */
static const tile_fn (*kind_tiles(const struct quant_levels *k))[TG]
{
    if (k->unit == 32)
        return k->mins == QUANT_MINS_Q8_1 ? legacy_q8_1 : legacy_bias;
    if (k->mins == QUANT_MINS_SUB)
        return k->sb == 32 ? k32_min : k16_min;
    return k->sb == 32 ? k32_bias : k16_bias;
}

/* ---- the loops around the tiles ---- */

/* y[l * ldy + r] = out[r * TG * 16 + l] for r < nr, l < nt: one group's
 * results, transposed from lanes = tokens to rows of y. */
_Static_assert(TR == 4, "scatter transposes tiles of 4 rows");
static void scatter(const float *out, int nr, int nt, float *y, size_t ldy)
{
    if (nr == TR) {
        const float *o = out;
        __m512 v0 = _mm512_loadu_ps(o), v1 = _mm512_loadu_ps(o + TG * 16);
        __m512 v2 = _mm512_loadu_ps(o + 2 * TG * 16), v3 = _mm512_loadu_ps(o + 3 * TG * 16);
        __m512 lo01 = _mm512_unpacklo_ps(v0, v1), hi01 = _mm512_unpackhi_ps(v0, v1);
        __m512 lo23 = _mm512_unpacklo_ps(v2, v3), hi23 = _mm512_unpackhi_ps(v2, v3);
        /* q[k]: quarter c holds the 4 rows of token 4c + k */
        __m512 q[4] = {
            _mm512_castpd_ps(_mm512_unpacklo_pd(_mm512_castps_pd(lo01), _mm512_castps_pd(lo23))),
            _mm512_castpd_ps(_mm512_unpackhi_pd(_mm512_castps_pd(lo01), _mm512_castps_pd(lo23))),
            _mm512_castpd_ps(_mm512_unpacklo_pd(_mm512_castps_pd(hi01), _mm512_castps_pd(hi23))),
            _mm512_castpd_ps(_mm512_unpackhi_pd(_mm512_castps_pd(hi01), _mm512_castps_pd(hi23)))};
#define QUARTER(c)                                                                   \
    for (int k = 0; k < 4 && 4 * (c) + k < nt; k++)                                  \
        _mm_storeu_ps(y + (size_t)(4 * (c) + k) * ldy, _mm512_extractf32x4_ps(q[k], c));
        QUARTER(0)
        QUARTER(1)
        QUARTER(2)
        QUARTER(3)
#undef QUARTER
        return;
    }
    for (int l = 0; l < nt; l++)
        for (int r = 0; r < nr; r++)
            y[(size_t)l * ldy + r] = out[r * TG * 16 + l];
}

/* One unpacked row: n levels, then n/sb scales, then n/sb offsets. */
static size_t unpacked_bytes(const struct quant_levels *k, int n)
{
    return align64((size_t)n + 2 * (size_t)(n / k->sb) * sizeof(float));
}

int quant_gemm_tiled(int qtype, int n, int na)
{
    const struct quant_levels *k = quant_levels(qtype);
    /* below these counts the row dots win: unpacking a row costs about as
     * much as a few tokens of tiled work (measured on Zen 5) */
    return k && n > 0 && n % k->unit == 0 && na >= (k->unit == 32 ? 5 : 12);
}

size_t quant_gemm_scratch(int qtype, int n)
{
    const struct quant_levels *k = quant_levels(qtype);
    return k ? TR * unpacked_bytes(k, n) + TR * TG * 16 * sizeof(float) : 0;
}

void quant_gemm_packed(int qtype, int n, const void *w, size_t ldw, int nw, const void *pack,
                       int na, float *y, size_t ldy, void *scratch)
{
    const struct quant_levels *k = quant_levels(qtype);
    struct pack_map m;
    if (!k || pack_map(quant_type(qtype)->dot_type, n, na, &m) != 0)
        return;
    const tile_fn(*tiles)[TG] = kind_tiles(k);
    const int nsub = n / k->sb;
    const size_t rb = unpacked_bytes(k, n);
    uint8_t *rows = scratch;
    float *out = (float *)(rows + TR * rb); /* (TR, TG, 16) */
    const uint8_t *base = pack;
    struct tile_in in;
    in.shift = k->bias ? __builtin_ctz((unsigned)k->bias) : 0;
    in.qs = (size_t)n * 16;
    in.ds = (size_t)(n / m.unit) * 64;
    in.ss = (size_t)nsub * 64;
    in.nunit = n / m.unit;
    in.rs = rb;
    /* token groups per pass: each weight row is unpacked once per pass */
    int chunk = CHUNK_BYTES / (n * 16);
    chunk = chunk < 1 ? 1 : chunk;
    for (int c0 = 0; c0 < m.ng; c0 += chunk) {
        int c1 = c0 + chunk < m.ng ? c0 + chunk : m.ng;
        for (int i0 = 0; i0 < nw; i0 += TR) {
            int nr = nw - i0 < TR ? nw - i0 : TR;
            for (int r = 0; r < nr; r++) {
                uint8_t *ur = rows + r * rb;
                float *scr = (float *)(ur + n);
                k->unpack((const uint8_t *)w + (size_t)(i0 + r) * ldw, n, ur, scr, scr + nsub);
            }
            /* the next TR rows come from memory while this tile computes, a
             * share before each group pass (past nw too: a caller's next
             * slice usually starts there, and a prefetch never faults; the
             * address is formed as an integer, not as a pointer past w) */
            uintptr_t next = (uintptr_t)w + (uintptr_t)(i0 + TR) * ldw;
            size_t lines = (TR * ldw + 63) / 64, passes = (size_t)(c1 - c0 + TG - 1) / TG;
            size_t share = (lines + passes - 1) / passes, pf = 0;
            for (int g0 = c0; g0 < c1; g0 += TG) {
                for (size_t e = pf + share < lines ? pf + share : lines; pf < e; pf++)
                    _mm_prefetch((const char *)(next + 64 * pf), _MM_HINT_T0);
                int gg = c1 - g0 < TG ? c1 - g0 : TG;
                in.qa = (const int8_t *)(base + m.qa) + (size_t)g0 * in.qs;
                in.d = (const float *)(base + m.d) + (size_t)g0 * in.ds / 4;
                in.sums = (const int32_t *)(base + (k->sb == 16 ? m.s16 : m.s32)) + (size_t)g0 * in.ss / 4;
                in.s = (const float *)(base + m.s) + (size_t)g0 * in.ss / 4;
                for (int r = 0; r < nr; r += nr == TR ? TR : 1) {
                    in.u = rows + r * rb;
                    in.sc = (const float *)(in.u + n);
                    in.off = in.sc + nsub;
                    tiles[nr == TR ? 0 : 1][gg - 1](&in, out + r * TG * 16);
                }
                for (int g = 0; g < gg; g++) {
                    int nt = na - (g0 + g) * 16 < 16 ? na - (g0 + g) * 16 : 16;
                    scatter(out + g * 16, nr, nt, y + (size_t)(g0 + g) * 16 * ldy + i0, ldy);
                }
            }
        }
    }
}

#else /* no tiled kernel in this build */

int quant_gemm_tiled(int qtype, int n, int na)
{
    (void)qtype, (void)n, (void)na;
    return 0;
}

size_t quant_pack_bytes(int dot_type, int n, int na)
{
    (void)dot_type, (void)n, (void)na;
    return 0;
}

size_t quant_gemm_scratch(int qtype, int n)
{
    (void)qtype, (void)n;
    return 0;
}

/* Never called: quant_gemm_tiled is 0 here. */
void quant_pack(int dot_type, int n, const void *a, size_t lda, int na, int g0, int g1, void *pack)
{
    (void)dot_type, (void)n, (void)a, (void)lda, (void)na, (void)g0, (void)g1, (void)pack;
}

void quant_gemm_packed(int qtype, int n, const void *w, size_t ldw, int nw, const void *pack,
                       int na, float *y, size_t ldy, void *scratch)
{
    (void)qtype, (void)n, (void)w, (void)ldw, (void)nw, (void)pack, (void)na, (void)y, (void)ldy,
        (void)scratch;
}
#endif

void quant_gemm(int qtype, int n, const void *w, size_t ldw, int nw,
                const void *a, size_t lda, int na, float *y, size_t ldy)
{
    const struct quant_type *t = quant_type(qtype);
    if (!t || !t->dot) /* an activation-only type: nothing to multiply */
        return;
    if (quant_gemm_tiled(qtype, n, na)) {
        size_t pb = align64(quant_pack_bytes(t->dot_type, n, na));
        uint8_t *mem = malloc(pb + quant_gemm_scratch(qtype, n) + 64);
        if (mem) {
            uint8_t *pack = mem + (-(uintptr_t)mem & 63);
            quant_pack(t->dot_type, n, a, lda, na, 0, (na + 15) / 16, pack);
            quant_gemm_packed(qtype, n, w, ldw, nw, pack, na, y, ldy, pack + pb);
            free(mem);
            return;
        }
    }
    /* row by row: each weight row stays in cache across the activation rows */
    for (int i = 0; i < nw; i++)
        for (int j = 0; j < na; j++)
            t->dot(n, &y[(size_t)j * ldy + i], (const char *)w + i * ldw,
                   (const char *)a + j * lda);
}
