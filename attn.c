/*
 * attn.c — the CPU attention kernels over kv.c's pages: prompt (chunked
 * online softmax), decode split-KV with a log-sum-exp merge, QSA sparse
 * attention (prompt and decode) and its exact top-k cell selection.
 *
 * Owns the arithmetic of attention and its work split across the pool. Must
 * not: know cell formats (kv_read/kv_gather dequantise), know models, print,
 * or allocate after attn_new. Shapes: T queries, H query heads, K kv heads,
 * G = H/K query heads per kv head, E head dim, C cells, B = ATTN_BLOCK,
 * R rows = (query, head) pairs of one task, S decode partitions.
 *
 * One rule makes the paths agree bit for bit: a row's result depends only
 * on the cells it sees and their order, never on which task, tile or thread
 * computed it. Every score is the same 16-lane dot (fixed lane order and
 * fixed reduction tree), blocks are aligned to multiples of B counted from
 * the first cell (or the first list entry), and every accumulator is a
 * per-element chain of fmas in cell order.
 */
#include "strata.h"

#include <math.h>
#include <stdatomic.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#if !defined(STRATA_PORTABLE) && defined(__AVX512F__)
#include <immintrin.h>
#define ATTN_AVX512 1
#elif !defined(STRATA_PORTABLE) && defined(__AVX2__) && defined(__FMA__) && defined(__F16C__)
#include <immintrin.h>
#define ATTN_AVX2 1
#endif

#define B ATTN_BLOCK

/* ==== 16-lane vectors: one definition of every operation per ISA ==== */

#if defined(ATTN_AVX512)
typedef __m512 v16;
static inline v16 v_load(const float *p) { return _mm512_loadu_ps(p); }
static inline void v_store(float *p, v16 a) { _mm512_storeu_ps(p, a); }
static inline v16 v_set1(float x) { return _mm512_set1_ps(x); }
static inline v16 v_fma(v16 a, v16 b, v16 c) { return _mm512_fmadd_ps(a, b, c); }
static inline v16 v_mul(v16 a, v16 b) { return _mm512_mul_ps(a, b); }
static inline v16 v_add(v16 a, v16 b) { return _mm512_add_ps(a, b); }
static inline v16 v_sub(v16 a, v16 b) { return _mm512_sub_ps(a, b); }
static inline v16 v_max(v16 a, v16 b) { return _mm512_max_ps(a, b); }
/* lanes l and l+8, then l and l+4, l and l+2, l and l+1 */
static inline float v_hsum(v16 a)
{
    __m256 t = _mm256_add_ps(_mm512_castps512_ps256(a), _mm512_extractf32x8_ps(a, 1));
    __m128 u = _mm_add_ps(_mm256_castps256_ps128(t), _mm256_extractf128_ps(t, 1));
    __m128 v = _mm_add_ps(u, _mm_movehl_ps(u, u));
    return _mm_cvtss_f32(_mm_add_ss(v, _mm_shuffle_ps(v, v, 1)));
}
static inline float v_hmax(v16 a) { return _mm512_reduce_max_ps(a); }
static inline v16 v_round16(v16 a)
{
    return _mm512_cvtph_ps(_mm512_cvtps_ph(a, _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC));
}
#elif defined(ATTN_AVX2)
typedef struct { __m256 a, b; } v16;
static inline v16 v_load(const float *p) { return (v16){_mm256_loadu_ps(p), _mm256_loadu_ps(p + 8)}; }
static inline void v_store(float *p, v16 x) { _mm256_storeu_ps(p, x.a); _mm256_storeu_ps(p + 8, x.b); }
static inline v16 v_set1(float x) { return (v16){_mm256_set1_ps(x), _mm256_set1_ps(x)}; }
static inline v16 v_fma(v16 x, v16 y, v16 z) { return (v16){_mm256_fmadd_ps(x.a, y.a, z.a), _mm256_fmadd_ps(x.b, y.b, z.b)}; }
static inline v16 v_mul(v16 x, v16 y) { return (v16){_mm256_mul_ps(x.a, y.a), _mm256_mul_ps(x.b, y.b)}; }
static inline v16 v_add(v16 x, v16 y) { return (v16){_mm256_add_ps(x.a, y.a), _mm256_add_ps(x.b, y.b)}; }
static inline v16 v_sub(v16 x, v16 y) { return (v16){_mm256_sub_ps(x.a, y.a), _mm256_sub_ps(x.b, y.b)}; }
static inline v16 v_max(v16 x, v16 y) { return (v16){_mm256_max_ps(x.a, y.a), _mm256_max_ps(x.b, y.b)}; }
static inline float v_hsum(v16 x)
{
    __m256 t = _mm256_add_ps(x.a, x.b);
    __m128 u = _mm_add_ps(_mm256_castps256_ps128(t), _mm256_extractf128_ps(t, 1));
    __m128 v = _mm_add_ps(u, _mm_movehl_ps(u, u));
    return _mm_cvtss_f32(_mm_add_ss(v, _mm_shuffle_ps(v, v, 1)));
}
static inline float v_hmax(v16 x)
{
    float f[16];
    v_store(f, x);
    float m = f[0];
    for (int i = 1; i < 16; i++)
        m = fmaxf(m, f[i]);
    return m;
}
static inline v16 v_round16(v16 x)
{
    return (v16){_mm256_cvtph_ps(_mm256_cvtps_ph(x.a, _MM_FROUND_TO_NEAREST_INT)),
                 _mm256_cvtph_ps(_mm256_cvtps_ph(x.b, _MM_FROUND_TO_NEAREST_INT))};
}
#else
typedef struct { float f[16]; } v16;
static inline v16 v_load(const float *p) { v16 r; memcpy(r.f, p, sizeof r.f); return r; }
static inline void v_store(float *p, v16 a) { memcpy(p, a.f, sizeof a.f); }
static inline v16 v_set1(float x) { v16 r; for (int i = 0; i < 16; i++) r.f[i] = x; return r; }
static inline v16 v_fma(v16 a, v16 b, v16 c) { for (int i = 0; i < 16; i++) c.f[i] = fmaf(a.f[i], b.f[i], c.f[i]); return c; }
static inline v16 v_mul(v16 a, v16 b) { for (int i = 0; i < 16; i++) a.f[i] *= b.f[i]; return a; }
static inline v16 v_add(v16 a, v16 b) { for (int i = 0; i < 16; i++) a.f[i] += b.f[i]; return a; }
static inline v16 v_sub(v16 a, v16 b) { for (int i = 0; i < 16; i++) a.f[i] -= b.f[i]; return a; }
static inline v16 v_max(v16 a, v16 b) { for (int i = 0; i < 16; i++) a.f[i] = a.f[i] > b.f[i] ? a.f[i] : b.f[i]; return a; }
static inline float v_hsum(v16 a)
{
    float t[8], u[4], v[2];
    for (int i = 0; i < 8; i++) t[i] = a.f[i] + a.f[i + 8];
    for (int i = 0; i < 4; i++) u[i] = t[i] + t[i + 4];
    for (int i = 0; i < 2; i++) v[i] = u[i] + u[i + 2];
    return v[0] + v[1];
}
static inline float v_hmax(v16 a) { float m = a.f[0]; for (int i = 1; i < 16; i++) m = fmaxf(m, a.f[i]); return m; }
static inline v16 v_round16(v16 a) { for (int i = 0; i < 16; i++) a.f[i] = quant_f16_to_f32(quant_f32_to_f16(a.f[i])); return a; }
#endif

/* ---- exp ---- */

/* e^x for x <= 0 (a score minus a running max): 2^n · poly(r) with
 * n = round(x·log2 e), r = x - n·ln 2 in two fma steps (|r| <= 0.347), poly
 * the degree-7 Taylor series (truncation 5e-9, under half an ulp). Below
 * -87 the result would leave the normal range: it is 0, a weight under
 * 2^-125 next to the max cell's 1. Every ISA computes the same bits. */
#define EXP_LOG2E 0x1.715476p+0f
#define EXP_LN2_HI 0x1.62e430p-1f   /* ln 2 rounded to float */
#define EXP_LN2_LO -0x1.05c610p-29f /* ln 2 - EXP_LN2_HI */
#define EXP_ROUND 0x1.8p23f         /* adding it rounds to an integer */
#define EXP_MIN -87.0f

static const float exp_c[8] = {0x1p+0f, 0x1p+0f, 0x1p-1f, 0x1.555556p-3f,
                               0x1.555556p-5f, 0x1.111112p-7f, 0x1.6c16c2p-10f, 0x1.a01a02p-13f};

static inline float attn_exp1(float x)
{
    if (x < EXP_MIN)
        return 0.0f;
    float n = fmaf(x, EXP_LOG2E, EXP_ROUND) - EXP_ROUND;
    float r = fmaf(-n, EXP_LN2_HI, x);
    r = fmaf(-n, EXP_LN2_LO, r);
    float p = exp_c[7];
    for (int i = 6; i >= 0; i--)
        p = fmaf(p, r, exp_c[i]);
    uint32_t bits = (uint32_t)((int)n + 127) << 23;
    float s;
    memcpy(&s, &bits, 4);
    return p * s; /* exact: 2^n is a normal float */
}

static inline v16 v_exp(v16 x)
{
#if defined(ATTN_AVX512)
    __mmask16 low = _mm512_cmp_ps_mask(x, _mm512_set1_ps(EXP_MIN), _CMP_LT_OQ);
    __m512 n = _mm512_sub_ps(_mm512_fmadd_ps(x, _mm512_set1_ps(EXP_LOG2E), _mm512_set1_ps(EXP_ROUND)),
                             _mm512_set1_ps(EXP_ROUND));
    __m512 r = _mm512_fnmadd_ps(n, _mm512_set1_ps(EXP_LN2_HI), x);
    r = _mm512_fnmadd_ps(n, _mm512_set1_ps(EXP_LN2_LO), r);
    __m512 p = _mm512_set1_ps(exp_c[7]);
    for (int i = 6; i >= 0; i--)
        p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(exp_c[i]));
    /* scalef is the exact product p · 2^n, as the scalar path's */
    return _mm512_maskz_mov_ps(~low, _mm512_scalef_ps(p, n));
#elif defined(ATTN_AVX2)
    __m256 h[2] = {x.a, x.b};
    for (int k = 0; k < 2; k++) {
        __m256 low = _mm256_cmp_ps(h[k], _mm256_set1_ps(EXP_MIN), _CMP_LT_OQ);
        __m256 n = _mm256_sub_ps(_mm256_fmadd_ps(h[k], _mm256_set1_ps(EXP_LOG2E), _mm256_set1_ps(EXP_ROUND)),
                                 _mm256_set1_ps(EXP_ROUND));
        __m256 r = _mm256_fnmadd_ps(n, _mm256_set1_ps(EXP_LN2_HI), h[k]);
        r = _mm256_fnmadd_ps(n, _mm256_set1_ps(EXP_LN2_LO), r);
        __m256 p = _mm256_set1_ps(exp_c[7]);
        for (int i = 6; i >= 0; i--)
            p = _mm256_fmadd_ps(p, r, _mm256_set1_ps(exp_c[i]));
        __m256i e = _mm256_slli_epi32(_mm256_add_epi32(_mm256_cvtps_epi32(n), _mm256_set1_epi32(127)), 23);
        h[k] = _mm256_andnot_ps(low, _mm256_mul_ps(p, _mm256_castsi256_ps(e)));
    }
    return (v16){h[0], h[1]};
#else
    for (int i = 0; i < 16; i++)
        x.f[i] = attn_exp1(x.f[i]);
    return x;
#endif
}

/* ==== the block kernels ==== */

/* s[0..4) = scale · the sums of a0..a3, each by v_hsum's tree. */
static inline void v_hsum4(v16 a0, v16 a1, v16 a2, v16 a3, float scale, float *s)
{
#if defined(ATTN_AVX512)
    /* the same pairings as v_hsum, four accumulators side by side:
     * [a_i lanes l + l+8] → [.. l + l+4] → [.. l + l+2] → [.. l + l+1] */
    __m512 x01 = _mm512_add_ps(_mm512_shuffle_f32x4(a0, a1, 0x44), _mm512_shuffle_f32x4(a0, a1, 0xee));
    __m512 x23 = _mm512_add_ps(_mm512_shuffle_f32x4(a2, a3, 0x44), _mm512_shuffle_f32x4(a2, a3, 0xee));
    __m512 u = _mm512_add_ps(_mm512_shuffle_f32x4(x01, x23, 0x88), _mm512_shuffle_f32x4(x01, x23, 0xdd));
    __m512 v = _mm512_add_ps(u, _mm512_shuffle_ps(u, u, _MM_SHUFFLE(1, 0, 3, 2)));
    __m512 w = _mm512_add_ps(v, _mm512_shuffle_ps(v, v, _MM_SHUFFLE(0, 0, 0, 1)));
    _mm512_mask_compressstoreu_ps(s, 0x1111, _mm512_mul_ps(w, _mm512_set1_ps(scale)));
#else
    s[0] = v_hsum(a0) * scale;
    s[1] = v_hsum(a1) * scale;
    s[2] = v_hsum(a2) * scale;
    s[3] = v_hsum(a3) * scale;
#endif
}

/* s[j] = scale · q·k_j for j < n: per cell one 16-lane chain over E and
 * v_hsum's tree, however many cells or rows are done together. */
static void attn_scores(const float *q, const float *kb, int n, int E, float scale, float *s)
{
    int j = 0;
    for (; j + 4 <= n; j += 4) {
        const float *k0 = kb + (size_t)j * E, *k1 = k0 + E, *k2 = k1 + E, *k3 = k2 + E;
        v16 a0 = v_set1(0.0f), a1 = a0, a2 = a0, a3 = a0;
        for (int e = 0; e < E; e += 16) {
            v16 qv = v_load(q + e);
            a0 = v_fma(qv, v_load(k0 + e), a0);
            a1 = v_fma(qv, v_load(k1 + e), a1);
            a2 = v_fma(qv, v_load(k2 + e), a2);
            a3 = v_fma(qv, v_load(k3 + e), a3);
        }
        v_hsum4(a0, a1, a2, a3, scale, s + j);
    }
    for (; j < n; j++) {
        const float *k0 = kb + (size_t)j * E;
        v16 a0 = v_set1(0.0f);
        for (int e = 0; e < E; e += 16)
            a0 = v_fma(v_load(q + e), v_load(k0 + e), a0);
        s[j] = v_hsum(a0) * scale;
    }
}

/* Two rows against the same cells (n each), sharing every load of K. */
static void attn_scores2(const float *q0, const float *q1, const float *kb, int n, int E, float scale,
                         float *s0, float *s1)
{
#if defined(ATTN_AVX512)
    int j = 0;
    for (; j + 4 <= n; j += 4) {
        const float *k0 = kb + (size_t)j * E, *k1 = k0 + E, *k2 = k1 + E, *k3 = k2 + E;
        v16 a0 = v_set1(0.0f), a1 = a0, a2 = a0, a3 = a0, b0 = a0, b1 = a0, b2 = a0, b3 = a0;
        for (int e = 0; e < E; e += 16) {
            v16 qa = v_load(q0 + e), qb = v_load(q1 + e), k;
            k = v_load(k0 + e);
            a0 = v_fma(qa, k, a0);
            b0 = v_fma(qb, k, b0);
            k = v_load(k1 + e);
            a1 = v_fma(qa, k, a1);
            b1 = v_fma(qb, k, b1);
            k = v_load(k2 + e);
            a2 = v_fma(qa, k, a2);
            b2 = v_fma(qb, k, b2);
            k = v_load(k3 + e);
            a3 = v_fma(qa, k, a3);
            b3 = v_fma(qb, k, b3);
        }
        v_hsum4(a0, a1, a2, a3, scale, s0 + j);
        v_hsum4(b0, b1, b2, b3, scale, s1 + j);
    }
    if (j < n) {
        attn_scores(q0, kb + (size_t)j * E, n - j, E, scale, s0 + j);
        attn_scores(q1, kb + (size_t)j * E, n - j, E, scale, s1 + j);
    }
#else
    attn_scores(q0, kb, n, E, scale, s0);
    attn_scores(q1, kb, n, E, scale, s1);
#endif
}

/* acc (E) += Σ_{j<n} p[j]·v_j, per element a chain of fmas in cell order;
 * eight vectors of acc stay in registers while the cells stream past (the
 * loops over them unrolled, or the compiler keeps them in memory). */
static void attn_pv(float *acc, const float *p, const float *vb, int n, int E)
{
    int e = 0;
    for (; e + 128 <= E; e += 128) {
        v16 a[8];
        #pragma GCC unroll 8
        for (int i = 0; i < 8; i++)
            a[i] = v_load(acc + e + 16 * i);
        for (int j = 0; j < n; j++) {
            v16 pj = v_set1(p[j]);
            const float *v = vb + (size_t)j * E + e;
            #pragma GCC unroll 8
            for (int i = 0; i < 8; i++)
                a[i] = v_fma(pj, v_load(v + 16 * i), a[i]);
        }
        #pragma GCC unroll 8
        for (int i = 0; i < 8; i++)
            v_store(acc + e + 16 * i, a[i]);
    }
    for (; e < E; e += 16) {
        v16 a = v_load(acc + e);
        for (int j = 0; j < n; j++)
            a = v_fma(v_set1(p[j]), v_load(vb + (size_t)j * E + e), a);
        v_store(acc + e, a);
    }
}

/* Two rows: cells below both counts share each load of V; the longer row
 * then finishes alone. Each element's chain is attn_pv's. */
static void attn_pv2(float *acc0, float *acc1, const float *p0, const float *p1, const float *vb, int n0,
                     int n1, int E)
{
#if defined(ATTN_AVX512)
    int n = n0 < n1 ? n0 : n1, e = 0;
    for (; e + 128 <= E; e += 128) {
        v16 a[8], b[8];
        #pragma GCC unroll 8
        for (int i = 0; i < 8; i++) {
            a[i] = v_load(acc0 + e + 16 * i);
            b[i] = v_load(acc1 + e + 16 * i);
        }
        for (int j = 0; j < n; j++) {
            v16 pa = v_set1(p0[j]), pb = v_set1(p1[j]);
            const float *v = vb + (size_t)j * E + e;
            #pragma GCC unroll 8
            for (int i = 0; i < 8; i++) {
                v16 vv = v_load(v + 16 * i);
                a[i] = v_fma(pa, vv, a[i]);
                b[i] = v_fma(pb, vv, b[i]);
            }
        }
        #pragma GCC unroll 8
        for (int i = 0; i < 8; i++) {
            v_store(acc0 + e + 16 * i, a[i]);
            v_store(acc1 + e + 16 * i, b[i]);
        }
    }
    for (; e < E; e += 16) {
        v16 a = v_load(acc0 + e), b = v_load(acc1 + e);
        for (int j = 0; j < n; j++) {
            v16 vv = v_load(vb + (size_t)j * E + e);
            a = v_fma(v_set1(p0[j]), vv, a);
            b = v_fma(v_set1(p1[j]), vv, b);
        }
        v_store(acc0 + e, a);
        v_store(acc1 + e, b);
    }
    /* the longer row's remaining cells, continuing its chains */
    if (n0 != n1) {
        float *acc = n0 > n1 ? acc0 : acc1;
        const float *p = n0 > n1 ? p0 : p1;
        for (int ee = 0; ee < E; ee += 16) {
            v16 a = v_load(acc + ee);
            for (int j = n; j < (n0 > n1 ? n0 : n1); j++)
                a = v_fma(v_set1(p[j]), v_load(vb + (size_t)j * E + ee), a);
            v_store(acc + ee, a);
        }
    }
#else
    attn_pv(acc0, p0, vb, n0, E);
    attn_pv(acc1, p1, vb, n1, E);
#endif
}

static void attn_scale_row(float *x, float a, int E)
{
    v16 va = v_set1(a);
    for (int e = 0; e < E; e += 16)
        v_store(x + e, v_mul(v_load(x + e), va));
}

/* ==== workspace ==== */

struct attn {
    int H, K, E, G, W, n_threads;
    int qt;             /* prompt: queries per task */
    int R;              /* most rows of one task */
    size_t thr_n;       /* floats of one thread's scratch */
    float *scratch;     /* (n_threads, thr_n) */
    float *part;        /* (K, ATTN_MAX_SPLIT, W*G, PE) decode partials */
    float *ref_ml;      /* (W*H, 2) reference mode: global max, 1/sum per row */
};

/* A partial: m, l, 14 floats of padding, then acc (E) aligned to 64 bytes. */
#define PART_HDR 16

/* Rows of one prompt task: enough to spread the cost of dequantising a
 * block over many rows, few enough for a balanced split of a chunk. */
#define ATTN_PROMPT_ROWS 64

int attn_new(struct attn **out, int n_head, int n_head_kv, int head_dim, int max_window,
             int n_threads, char *err, size_t errlen)
{
    *out = NULL;
    if (n_head <= 0 || n_head_kv <= 0 || n_head % n_head_kv)
        return strata_errf(err, errlen, "attention: %d query heads do not share %d kv heads evenly",
                         n_head, n_head_kv);
    if (head_dim <= 0 || head_dim % 16)
        return strata_errf(err, errlen, "attention: head dim %d is not a multiple of 16", head_dim);
    if (max_window < 1)
        max_window = 1;
    if (n_threads < 1)
        n_threads = 1;
    struct attn *a = calloc(1, sizeof *a);
    if (!a)
        return strata_errf(err, errlen, "attention: out of memory");
    a->H = n_head;
    a->K = n_head_kv;
    a->E = head_dim;
    a->G = n_head / n_head_kv;
    a->W = max_window;
    a->n_threads = n_threads;
    a->qt = a->G >= ATTN_PROMPT_ROWS ? 1 : ATTN_PROMPT_ROWS / a->G;
    int R = a->qt * a->G;
    if (R < a->W * a->G)
        R = a->W * a->G;
    a->R = R;
    size_t E = (size_t)head_dim;
    /* q, acc (R, E); m, l, cnt (R); s (R, B); k, v blocks (B, E); rounded up to 16 */
    a->thr_n = (2 * (size_t)R * E + 3 * ((size_t)R + 16) + (size_t)R * B + 2 * (size_t)B * E + 15) & ~(size_t)15;
    size_t part_n = (size_t)a->K * ATTN_MAX_SPLIT * (size_t)a->W * a->G * (PART_HDR + E);
    a->scratch = aligned_alloc(64, (a->thr_n * (size_t)n_threads) * sizeof(float));
    a->part = aligned_alloc(64, part_n * sizeof(float));
    a->ref_ml = malloc((size_t)a->W * a->H * 2 * sizeof(float));
    if (!a->scratch || !a->part || !a->ref_ml) {
        double mib = (double)((a->thr_n * n_threads + part_n) * 4) / (1 << 20);
        attn_free(a);
        return strata_errf(err, errlen, "attention: cannot allocate %.1f MiB of scratch", mib);
    }
    *out = a;
    return 0;
}

void attn_free(struct attn *a)
{
    if (!a)
        return;
    free(a->scratch);
    free(a->part);
    free(a->ref_ml);
    free(a);
}

/* ==== one call's shared state ==== */

enum attn_kind { K_PROMPT, K_DECODE, K_QSA_PROMPT, K_QSA_DECODE };

/* PASS_ONLINE: running (m, l, acc). The reference mode's two passes:
 * PASS_SUM finds (m, l) only; PASS_PV forms the normalised probabilities
 * from the global (m, 1/l) and accumulates them into acc. */
enum attn_pass { PASS_ONLINE, PASS_SUM, PASS_PV };

struct attn_ctx {
    struct attn *a;
    const struct attn_job *j;
    int kind, pass;
    int ref_q, ref_p;      /* round Q / probabilities to F16 */
    float scale;
    int n_tasks;
    int S, plen;           /* decode: partitions, entries per partition */
    int Rd;                /* decode: rows per kv head (T*G) */
    int n_tiles;           /* prompt: query tiles */
    atomic_int next;
};

/* Per-thread views into the scratch. */
struct attn_ws {
    float *q, *acc, *m, *l, *s, *kb, *vb;
    int *cnt;               /* (R) cells of the block each row takes */
};

static struct attn_ws attn_ws_of(const struct attn *a, int ith)
{
    struct attn_ws w;
    size_t R = (size_t)a->R, E = (size_t)a->E;
    float *p = a->scratch + (size_t)ith * a->thr_n;
    w.q = p;
    w.acc = w.q + R * E;
    w.kb = w.acc + R * E;
    w.vb = w.kb + (size_t)B * E;
    w.s = w.vb + (size_t)B * E;
    w.m = w.s + R * B;
    w.l = w.m + R + 16;
    w.cnt = (int *)(w.l + R + 16);
    return w;
}

/* The j->q rows of queries t0..t0+nt-1 for kv head h, (nt*G, E) into w->q,
 * rounded to F16 in reference mode with an F16 cache. */
static void attn_load_q(const struct attn_ctx *x, struct attn_ws *w, int t0, int nt, int h)
{
    const struct attn *a = x->a;
    int E = a->E, G = a->G;
    for (int r = 0; r < nt * G; r++) {
        const float *src = x->j->q + ((size_t)(t0 + r / G) * a->H + (size_t)h * G + r % G) * E;
        float *dst = w->q + (size_t)r * E;
        if (x->ref_q)
            for (int e = 0; e < E; e += 16)
                v_store(dst + e, v_round16(v_load(src + e)));
        else
            memcpy(dst, src, (size_t)E * 4);
    }
}

static void attn_init_rows(const struct attn_ctx *x, struct attn_ws *w, int R)
{
    int E = x->a->E;
    if (x->pass != PASS_PV)
        for (int r = 0; r < R; r++) {
            w->m[r] = -INFINITY;
            w->l[r] = 0.0f;
        }
    if (x->pass != PASS_SUM)
        memset(w->acc, 0, (size_t)R * E * sizeof(float));
}

/* Walks entries [e0, e1) for rows 0..R-1 of kv head h. Entries are cells
 * (list NULL: row r sees cells up to lim0 + r/G, rows in ascending order)
 * or the cells list[e] (all visible). e0 is a multiple of B. */
static void attn_walk(const struct attn_ctx *x, struct attn_ws *w, int h, int R, int lim0,
                      const int32_t *list, int e0, int e1)
{
    const struct attn *a = x->a;
    const struct attn_job *j = x->j;
    int E = a->E, G = a->G;
    int *cnt = w->cnt;
    for (int b0 = e0; b0 < e1; b0 += B) {
        int nb = e1 - b0 < B ? e1 - b0 : B;
        int r0 = 0, nmax = nb;
        if (!list) {
            /* causal: rows whose last cell lies before the block see none of it */
            int last = lim0 + (R - 1) / G - b0 + 1;
            if (last <= 0)
                break;
            nmax = last < nb ? last : nb;
            int first = b0 - lim0;
            r0 = first > 0 ? first * G : 0;
        }
        for (int r = r0; r < R; r++) {
            int vis = list ? nb : lim0 + r / G - b0 + 1;
            cnt[r] = vis < nb ? vis : nb;
        }
        float *kb = w->kb, *vb = x->pass == PASS_SUM ? NULL : w->vb;
        /* the next block's rows start their way from memory meanwhile */
        if (b0 + B < e1)
            kv_prefetch(j->kv, j->seq, j->layer, h, list ? list + b0 + B : NULL, b0 + B,
                        e1 - b0 - B < B ? e1 - b0 - B : B);
        if (list)
            kv_gather(j->kv, j->seq, j->layer, h, list + b0, nb, kb, vb);
        else
            kv_read(j->kv, j->seq, j->layer, h, b0, nmax, kb, vb);
        /* scores, two rows at a time (the second sees at least as many cells) */
        for (int r = r0; r < R; r += 2) {
            float *s = w->s + (size_t)r * B;
            if (r + 1 < R)
                attn_scores2(w->q + (size_t)r * E, w->q + (size_t)(r + 1) * E, kb, cnt[r + 1], E, x->scale,
                             s, s + B);
            else
                attn_scores(w->q + (size_t)r * E, kb, cnt[r], E, x->scale, s);
        }
        /* per row: probabilities into s, the running max, sum and rescale;
         * cnt becomes the cells to accumulate (0: none) */
        for (int r = r0; r < R; r++) {
            float *s = w->s + (size_t)r * B;
            for (int i = cnt[r]; i < B; i++)
                s[i] = -INFINITY;
            v16 s0 = v_load(s), s1 = v_load(s + 16), s2 = v_load(s + 32), s3 = v_load(s + 48);
            if (x->pass == PASS_PV) {
                /* m, l hold the global max and 1/sum: p is final, then
                 * rounded to F16 where the reference multiplies F16 V */
                float M = w->m[r];
                if (M == -INFINITY) {
                    cnt[r] = 0;
                    continue;
                }
                v16 vm = v_set1(M), vi = v_set1(w->l[r]);
                v16 p[4] = {v_mul(v_exp(v_sub(s0, vm)), vi), v_mul(v_exp(v_sub(s1, vm)), vi),
                            v_mul(v_exp(v_sub(s2, vm)), vi), v_mul(v_exp(v_sub(s3, vm)), vi)};
                for (int i = 0; i < 4; i++)
                    v_store(s + 16 * i, x->ref_p ? v_round16(p[i]) : p[i]);
                continue;
            }
            float mx = v_hmax(v_max(v_max(s0, s1), v_max(s2, s3)));
            float m_old = w->m[r], m_new = fmaxf(m_old, mx);
            /* Every score so far is -inf (only infinite inputs do that):
             * no weight yet, and exp(-inf - -inf) would be NaN. */
            if (m_new == -INFINITY) {
                cnt[r] = 0;
                continue;
            }
            /* The online-softmax rescale: sums and accumulators so far are
             * relative to m_old; multiplying by e^(m_old - m_new) <= 1 moves
             * them to the new max, so no exp ever overflows. The first block
             * (m_old = -inf) has nothing to rescale: alpha = 0 on zeros. */
            float alpha = m_old == -INFINITY ? 0.0f : attn_exp1(m_old - m_new);
            v16 vm = v_set1(m_new);
            v16 p0 = v_exp(v_sub(s0, vm)), p1 = v_exp(v_sub(s1, vm));
            v16 p2 = v_exp(v_sub(s2, vm)), p3 = v_exp(v_sub(s3, vm));
            w->l[r] = w->l[r] * alpha + v_hsum(v_add(v_add(p0, p1), v_add(p2, p3)));
            w->m[r] = m_new;
            if (x->pass == PASS_SUM)
                continue;
            v_store(s, p0);
            v_store(s + 16, p1);
            v_store(s + 32, p2);
            v_store(s + 48, p3);
            if (alpha != 1.0f && m_old != -INFINITY)
                attn_scale_row(w->acc + (size_t)r * E, alpha, E);
        }
        if (x->pass == PASS_SUM)
            continue;
        for (int r = r0; r < R; r += 2) {
            float *acc = w->acc + (size_t)r * E, *s = w->s + (size_t)r * B;
            if (r + 1 < R)
                attn_pv2(acc, acc + E, s, s + B, vb, cnt[r], cnt[r + 1], E);
            else
                attn_pv(acc, s, vb, cnt[r], E);
        }
    }
}

/* out rows of a finished prompt task: acc/l (online) or acc (reference,
 * whose probabilities were normalised already). */
static void attn_finish(const struct attn_ctx *x, struct attn_ws *w, int t0, int nt, int h)
{
    const struct attn *a = x->a;
    int E = a->E, G = a->G;
    for (int r = 0; r < nt * G; r++) {
        float *dst = x->j->out + ((size_t)(t0 + r / G) * a->H + (size_t)h * G + r % G) * E;
        const float *acc = w->acc + (size_t)r * E;
        float inv = x->pass == PASS_ONLINE ? 1.0f / w->l[r] : 1.0f;
        for (int e = 0; e < E; e += 16)
            v_store(dst + e, v_mul(v_load(acc + e), v_set1(inv)));
    }
}

/* Reference mode between the passes: l becomes 1/l. */
static void attn_invert(struct attn_ws *w, int R)
{
    for (int r = 0; r < R; r++)
        w->l[r] = 1.0f / w->l[r];
}

static float *attn_part(const struct attn_ctx *x, int h, int s, int r)
{
    const struct attn *a = x->a;
    return a->part + (((size_t)h * x->S + s) * x->Rd + r) * (PART_HDR + (size_t)a->E);
}

static void attn_save_part(const struct attn_ctx *x, struct attn_ws *w, int h, int s, int r0, int R)
{
    int E = x->a->E;
    for (int r = 0; r < R; r++) {
        float *p = attn_part(x, h, s, r0 + r);
        if (x->pass != PASS_PV) {
            p[0] = w->m[r];
            p[1] = w->l[r];
        }
        if (x->pass != PASS_SUM)
            memcpy(p + PART_HDR, w->acc + (size_t)r * E, (size_t)E * 4);
    }
}

/* Reference mode, second pass: each row's global (max, 1/sum). */
static void attn_load_ml(const struct attn_ctx *x, struct attn_ws *w, int h, int r0, int R)
{
    const struct attn *a = x->a;
    for (int r = 0; r < R; r++) {
        int t = (r0 + r) / a->G, g = (r0 + r) % a->G;
        const float *ml = a->ref_ml + ((size_t)t * a->H + (size_t)h * a->G + g) * 2;
        w->m[r] = ml[0];
        w->l[r] = ml[1];
    }
}

static void attn_task(struct attn_ctx *x, struct attn_ws *w, int task)
{
    const struct attn *a = x->a;
    const struct attn_job *j = x->j;
    int K = a->K, G = a->G;
    switch (x->kind) {
    case K_PROMPT: {
        /* the longest tiles (last queries) first, for balance */
        int tile = x->n_tiles - 1 - task / K, h = task % K;
        int t0 = tile * a->qt, nt = j->T - t0 < a->qt ? j->T - t0 : a->qt, R = nt * G;
        int lim0 = j->pos0 + t0, end = lim0 + nt;
        attn_load_q(x, w, t0, nt, h);
        if (x->pass == PASS_ONLINE) {
            attn_init_rows(x, w, R);
            attn_walk(x, w, h, R, lim0, NULL, 0, end);
        } else {
            struct attn_ctx y = *x;
            y.pass = PASS_SUM;
            attn_init_rows(&y, w, R);
            attn_walk(&y, w, h, R, lim0, NULL, 0, end);
            attn_invert(w, R);
            y.pass = PASS_PV;
            attn_init_rows(&y, w, R);
            attn_walk(&y, w, h, R, lim0, NULL, 0, end);
        }
        attn_finish(x, w, t0, nt, h);
        break;
    }
    case K_QSA_PROMPT: {
        int t = task / K, h = task % K;
        const int32_t *list = j->sel + j->sel_off[t];
        int n = (int)(j->sel_off[t + 1] - j->sel_off[t]);
        attn_load_q(x, w, t, 1, h);
        if (x->pass == PASS_ONLINE) {
            attn_init_rows(x, w, G);
            attn_walk(x, w, h, G, 0, list, 0, n);
        } else {
            struct attn_ctx y = *x;
            y.pass = PASS_SUM;
            attn_init_rows(&y, w, G);
            attn_walk(&y, w, h, G, 0, list, 0, n);
            attn_invert(w, G);
            y.pass = PASS_PV;
            attn_init_rows(&y, w, G);
            attn_walk(&y, w, h, G, 0, list, 0, n);
        }
        attn_finish(x, w, t, 1, h);
        break;
    }
    case K_DECODE: {
        int h = task % K, s = task / K, R = j->T * G;
        int e0 = s * x->plen, e1 = j->pos0 + j->T;
        e1 = e1 < e0 + x->plen ? e1 : e0 + x->plen;
        attn_load_q(x, w, 0, j->T, h);
        if (x->pass == PASS_PV)
            attn_load_ml(x, w, h, 0, R);
        attn_init_rows(x, w, R);
        attn_walk(x, w, h, R, j->pos0, NULL, e0, e1);
        attn_save_part(x, w, h, s, 0, R);
        break;
    }
    case K_QSA_DECODE: {
        int h = task % K, s = (task / K) % x->S, t = task / K / x->S;
        const int32_t *list = j->sel + j->sel_off[t];
        int n = (int)(j->sel_off[t + 1] - j->sel_off[t]);
        int e0 = s * x->plen, e1 = n < e0 + x->plen ? n : e0 + x->plen;
        attn_load_q(x, w, t, 1, h);
        if (x->pass == PASS_PV)
            attn_load_ml(x, w, h, t * G, G);
        attn_init_rows(x, w, G);
        if (e0 < e1)
            attn_walk(x, w, h, G, 0, list, e0, e1);
        attn_save_part(x, w, h, s, t * G, G);
        break;
    }
    }
}

static void attn_worker(void *arg, int ith, int nth)
{
    (void)nth;
    struct attn_ctx *x = arg;
    struct attn_ws w = attn_ws_of(x->a, ith);
    for (;;) {
        int task = atomic_fetch_add_explicit(&x->next, 1, memory_order_relaxed);
        if (task >= x->n_tasks)
            break;
        attn_task(x, &w, task);
    }
}

/* The log-sum-exp merge of each row's S partials, rows split by thread.
 * PASS_ONLINE: out = Σ w_s·acc_s / Σ w_s·l_s with w_s = e^(m_s - M);
 * PASS_SUM: the global (M, 1/L) for the second pass; PASS_PV: out = Σ acc_s. */
static void attn_merge(void *arg, int ith, int nth)
{
    struct attn_ctx *x = arg;
    const struct attn *a = x->a;
    int E = a->E, G = a->G, rows = a->K * x->Rd;
    for (int i = rows * ith / nth; i < rows * (ith + 1) / nth; i++) {
        int h = i / x->Rd, r = i % x->Rd, t = r / G, g = r % G;
        size_t orow = (size_t)t * a->H + (size_t)h * G + g;
        float *dst = x->j->out + orow * E;
        if (x->pass == PASS_PV) {
            memcpy(dst, attn_part(x, h, 0, r) + PART_HDR, (size_t)E * 4);
            for (int s = 1; s < x->S; s++) {
                const float *acc = attn_part(x, h, s, r) + PART_HDR;
                for (int e = 0; e < E; e += 16)
                    v_store(dst + e, v_add(v_load(dst + e), v_load(acc + e)));
            }
            continue;
        }
        float M = -INFINITY;
        for (int s = 0; s < x->S; s++)
            M = fmaxf(M, attn_part(x, h, s, r)[0]);
        float L = 0.0f;
        for (int s = 0; s < x->S; s++) {
            const float *p = attn_part(x, h, s, r);
            /* a partition that saw no cell of this row has m = -inf and
             * weight 0 (not exp(-inf - M), which is NaN when M is -inf too) */
            float wgt = p[0] == -INFINITY ? 0.0f : attn_exp1(p[0] - M);
            /* the first term is a product, not 0 + product: with S = 1,
             * wgt = 1 and every value passes through unchanged */
            L = s ? fmaf(wgt, p[1], L) : wgt * p[1];
            if (x->pass == PASS_SUM)
                continue;
            const float *acc = p + PART_HDR;
            v16 vw = v_set1(wgt);
            for (int e = 0; e < E; e += 16)
                v_store(dst + e, s ? v_fma(vw, v_load(acc + e), v_load(dst + e)) : v_mul(vw, v_load(acc + e)));
        }
        if (x->pass == PASS_SUM) {
            float *ml = a->ref_ml + orow * 2;
            ml[0] = M;
            ml[1] = 1.0f / L;
            continue;
        }
        v16 inv = v_set1(1.0f / L);
        for (int e = 0; e < E; e += 16)
            v_store(dst + e, v_mul(v_load(dst + e), inv));
    }
}

/* ==== entry points ==== */

static int attn_check(const struct attn *a, struct pool *p, const struct attn_job *j, int decode,
                      int qsa, char *err, size_t errlen)
{
    if (!j->kv || !j->q || !j->out)
        return strata_errf(err, errlen, "attention: missing kv, q or out");
    const struct kv_config *c = kv_cfg(j->kv);
    if (c->n_head_kv != a->K || c->head_dim != a->E)
        return strata_errf(err, errlen, "attention: cache has %d kv heads of %d, kernels were made for %d of %d",
                         c->n_head_kv, c->head_dim, a->K, a->E);
    if (j->layer < 0 || j->layer >= c->n_layer)
        return strata_errf(err, errlen, "attention: layer %d of %d", j->layer, c->n_layer);
    int len = kv_seq_len(j->kv, j->seq);
    if (len < 0)
        return strata_errf(err, errlen, "attention: no sequence %d", j->seq);
    if (j->T < 0 || j->pos0 < 0 || j->pos0 > len - j->T)
        return strata_errf(err, errlen, "attention: queries at cells %d..%d, sequence %d holds %d",
                         j->pos0, j->pos0 + j->T - 1, j->seq, len);
    if (pool_size(p) > a->n_threads)
        return strata_errf(err, errlen, "attention: pool of %d threads, scratch for %d", pool_size(p),
                         a->n_threads);
    if (decode && j->T > a->W)
        return strata_errf(err, errlen, "attention: decode window of %d queries, at most %d", j->T, a->W);
    if (j->n_split > ATTN_MAX_SPLIT)
        return strata_errf(err, errlen, "attention: %d partitions, at most %d", j->n_split, ATTN_MAX_SPLIT);
    if (!qsa)
        return 0;
    if (!j->sel || !j->sel_off)
        return strata_errf(err, errlen, "attention: QSA without a cell selection");
    for (int t = 0; t < j->T; t++) {
        int64_t o0 = j->sel_off[t], o1 = j->sel_off[t + 1];
        if (o0 < 0 || o1 <= o0 || o1 - o0 > (int64_t)j->pos0 + t + 1)
            return strata_errf(err, errlen, "attention: query %d selects %lld cells", t, (long long)(o1 - o0));
        for (int64_t i = o0; i < o1; i++) {
            int32_t c0 = j->sel[i];
            if (c0 < 0 || c0 > j->pos0 + t || (i > o0 && c0 <= j->sel[i - 1]))
                return strata_errf(err, errlen,
                                 "attention: query %d's selection is not ascending cells 0..%d (cell %d)", t,
                                 j->pos0 + t, c0);
        }
    }
    return 0;
}

static void attn_setup(struct attn_ctx *x, struct attn *a, const struct attn_job *j, int kind)
{
    memset(x, 0, sizeof *x);
    x->a = a;
    x->j = j;
    x->kind = kind;
    int f16 = kv_cfg(j->kv)->cell == KV_CELL_F16, ref = (j->flags & ATTN_F16_REF) != 0;
    x->pass = ref ? PASS_SUM : PASS_ONLINE;
    x->ref_q = x->ref_p = ref && f16;
    x->scale = j->scale != 0.0f ? j->scale : 1.0f / sqrtf((float)a->E);
}

static void attn_go(struct attn_ctx *x, struct pool *p)
{
    atomic_store_explicit(&x->next, 0, memory_order_relaxed);
    pool_run(p, attn_worker, x);
}

static int attn_prompt_kind(struct attn *a, struct pool *p, const struct attn_job *j, int qsa, char *err,
                            size_t errlen)
{
    if (attn_check(a, p, j, 0, qsa, err, errlen))
        return -1;
    if (j->T == 0)
        return 0;
    struct attn_ctx x;
    attn_setup(&x, a, j, qsa ? K_QSA_PROMPT : K_PROMPT);
    x.n_tiles = (j->T + a->qt - 1) / a->qt;
    x.n_tasks = qsa ? j->T * a->K : x.n_tiles * a->K;
    attn_go(&x, p);
    return 0;
}

int attn_prompt(struct attn *a, struct pool *p, const struct attn_job *j, char *err, size_t errlen)
{
    return attn_prompt_kind(a, p, j, 0, err, errlen);
}

int attn_qsa_prompt(struct attn *a, struct pool *p, const struct attn_job *j, char *err, size_t errlen)
{
    return attn_prompt_kind(a, p, j, 1, err, errlen);
}

int attn_split(int n_cells, int n_head_kv, int n_threads)
{
    int blocks = (n_cells + B - 1) / B;
    /* two tasks per thread keep every thread busy to the end ... */
    int S = (2 * n_threads + n_head_kv - 1) / (n_head_kv > 0 ? n_head_kv : 1);
    /* ... but each partition keeps >= 4 blocks, so the merge (E+2 floats
     * per row per partition) stays small next to the cells it read */
    if (S > blocks / 4)
        S = blocks / 4;
    return S < 1 ? 1 : S > ATTN_MAX_SPLIT ? ATTN_MAX_SPLIT : S;
}

static int attn_decode_kind(struct attn *a, struct pool *p, const struct attn_job *j, int qsa, char *err,
                            size_t errlen)
{
    if (attn_check(a, p, j, 1, qsa, err, errlen))
        return -1;
    if (j->T == 0)
        return 0;
    struct attn_ctx x;
    attn_setup(&x, a, j, qsa ? K_QSA_DECODE : K_DECODE);
    int n = j->pos0 + j->T;
    if (qsa) {
        n = 0;
        for (int t = 0; t < j->T; t++)
            if (j->sel_off[t + 1] - j->sel_off[t] > n)
                n = (int)(j->sel_off[t + 1] - j->sel_off[t]);
    }
    int S = j->n_split > 0 ? j->n_split : attn_split(n, a->K, pool_size(p));
    /* whole blocks per partition, so that partition s starts where the
     * unsplit walk starts a block: S = 1 is the prompt path's walk */
    int blocks = (n + B - 1) / B, per = (blocks + S - 1) / S;
    x.plen = per * B;
    x.S = (blocks + per - 1) / per;
    x.Rd = j->T * a->G;
    x.n_tasks = a->K * x.S * (qsa ? j->T : 1);
    attn_go(&x, p);
    pool_run(p, attn_merge, &x);
    if (x.pass == PASS_SUM) {
        x.pass = PASS_PV;
        attn_go(&x, p);
        pool_run(p, attn_merge, &x);
    }
    return 0;
}

int attn_decode(struct attn *a, struct pool *p, const struct attn_job *j, char *err, size_t errlen)
{
    return attn_decode_kind(a, p, j, 0, err, errlen);
}

int attn_qsa_decode(struct attn *a, struct pool *p, const struct attn_job *j, char *err, size_t errlen)
{
    return attn_decode_kind(a, p, j, 1, err, errlen);
}

/* ==== QSA cell selection ==== */

/* Scores as unsigned keys in the same order (NaN lowest of all). */
static inline uint32_t attn_key(float f)
{
    if (f != f)
        return 0;
    if (f == 0.0f)
        f = 0.0f; /* -0 ties with +0 */
    uint32_t u;
    memcpy(&u, &f, 4);
    return u & 0x80000000u ? ~u : u | 0x80000000u;
}

int attn_topk(const float *score, int n, int k, int local, int32_t *out)
{
    if (n <= 0)
        return 0;
    if (k >= n) {
        for (int i = 0; i < n; i++)
            out[i] = i;
        return n;
    }
    if (local < 0)
        local = 0;
    /* radix select of the k-th largest key, 11 + 11 + 10 bits: thr is its
     * value and need_eq how many cells equal to it (lowest first) join */
    uint32_t thr = 0, prefix_mask = 0;
    int need = k, need_eq = 0;
    if (k > 0) {
        static const int shift[3] = {21, 10, 0}, width[3] = {11, 11, 10};
        for (int pass = 0; pass < 3; pass++) {
            int nb = 1 << width[pass];
            int hist[2048] = {0};
            for (int i = 0; i < n; i++) {
                uint32_t key = attn_key(score[i]);
                if ((key & prefix_mask) == thr)
                    hist[(key >> shift[pass]) & (uint32_t)(nb - 1)]++;
            }
            int b = nb - 1;
            while (hist[b] < need) {
                need -= hist[b];
                b--;
            }
            thr |= (uint32_t)b << shift[pass];
            prefix_mask |= (uint32_t)(nb - 1) << shift[pass];
        }
        need_eq = need;
    }
    int m = 0, taken_eq = 0;
    for (int i = 0; i < n; i++) {
        uint32_t key = attn_key(score[i]);
        int pick = i >= n - local;
        if (k > 0 && key > thr)
            pick = 1;
        else if (k > 0 && key == thr && taken_eq < need_eq) {
            taken_eq++;
            pick = 1;
        }
        if (pick)
            out[m++] = i;
    }
    return m;
}
