/*
 * kv.c — the paged KV cache: a pool of pages, per-sequence page tables,
 * f32/f16/int8/Q4_0 cells, fork with copy-on-write, truncation for
 * speculative rollback, and a prefix cache of whole pages keyed by tokens.
 *
 * Owns the bytes of every cached K/V row and who may write them. Must not:
 * know about models or attention (attn.c reads rows through kv_read), print,
 * or allocate after kv_new. Shapes: L layers, K kv heads, E head dim,
 * P cells per page, C cells of a sequence.
 *
 * Why 64 cells per page: a page is one step of attn.c's online softmax
 * (ATTN_BLOCK), whose dequantised K and V (64 x E f32) stay in L1/L2; a 32K
 * context needs a page table of only 512 entries; prefix reuse and the tail
 * of each sequence waste under 64 cells (3% of a 2K context); and a GPU
 * kernel gets whole 16-wide matrix tiles and its usual 64-key step.
 */
#include "strata.h"

#include <math.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#if !defined(STRATA_PORTABLE) && defined(__AVX2__) && defined(__F16C__)
#include <immintrin.h>
#define KV_F16C 1
#endif

enum kv_row { ROW_F32, ROW_F16, ROW_I8, ROW_Q4 };

#define Q4_BLCK 32    /* Q4_0: elements per block */
#define Q4_BYTES 18   /* Q4_0: f16 scale + 16 bytes of nibbles */

struct kv_page {
    int32_t refs;        /* sequences holding it, +1 while in the prefix table */
    int32_t parent;      /* prefix table: the page before it (-1: first page) */
    uint32_t parent_gen; /* that page's gen when this one entered the table */
    uint32_t gen;        /* bumped every time the page is handed out */
    uint64_t hash;       /* prefix table key: hash(parent, parent_gen, tokens) */
    int32_t prev, next;  /* idle list (doubly) or free list (next only) */
    uint8_t cached;      /* in the prefix table */
};

struct kv_seq {
    int used;            /* slot taken */
    int n;               /* cells */
    int n_tok;           /* leading cells whose token ids are known */
    int n_pub;           /* leading pages already offered to the prefix table */
    int32_t *pt;         /* (max_pages) page of cells [i*P, (i+1)*P) */
};

struct kv {
    struct kv_config cfg;
    int P, L, K, E;
    int krow, vrow;              /* enum kv_row of K and V */
    size_t kbytes, vbytes;       /* bytes of one K / V row */
    size_t page_bytes;
    int n_pages, max_pages;      /* pool; pages one sequence may hold */
    uint8_t *data;               /* (n_pages, L, K, [P K rows | P V rows]) */
    struct kv_page *page;        /* (n_pages) */
    int32_t *tok;                /* (n_pages, P) token id of each cell */
    int32_t free_head;           /* free list */
    int n_free;
    int32_t idle_head, idle_tail; /* cached pages no sequence holds, oldest first */
    int n_idle, n_cached;
    int32_t *table;              /* (table_cap) prefix table: page ids, -1 empty */
    uint32_t table_cap;          /* a power of two >= 2 * n_pages */
    struct kv_seq *seq;          /* (n_seq) */
    void *meta;                  /* the one allocation behind page/tok/table/seq/pt */
    size_t meta_bytes;
    const struct quant_type *q4, *f16; /* Q4_0 and F16 from quant.c */
};

/* ==== cell formats ==== */

static const char *const kv_names[KV_CELL_COUNT] = {"f32", "f16", "int8", "q4", "k8v4"};

int kv_cell_parse(const char *name)
{
    for (int i = 0; i < KV_CELL_COUNT; i++)
        if (name && strcmp(name, kv_names[i]) == 0)
            return i;
    return -1;
}

const char *kv_cell_name(int cell)
{
    return cell >= 0 && cell < KV_CELL_COUNT ? kv_names[cell] : "?";
}

static void kv_rows_of(int cell, int *krow, int *vrow)
{
    static const int k[KV_CELL_COUNT] = {ROW_F32, ROW_F16, ROW_I8, ROW_Q4, ROW_I8};
    static const int v[KV_CELL_COUNT] = {ROW_F32, ROW_F16, ROW_I8, ROW_Q4, ROW_Q4};
    *krow = k[cell];
    *vrow = v[cell];
}

/* Bytes of one row of E values; 0 when E does not fit the encoding. */
static size_t kv_row_bytes(int row, int E)
{
    switch (row) {
    case ROW_F32: return (size_t)E * 4;
    case ROW_F16: return (size_t)E * 2;
    case ROW_I8: return 4 + (size_t)E;  /* f32 scale, then E codes */
    case ROW_Q4: return E % Q4_BLCK ? 0 : (size_t)(E / Q4_BLCK) * Q4_BYTES;
    }
    return 0;
}

size_t kv_cell_bytes(const struct kv_config *cfg)
{
    if (!cfg || cfg->cell < 0 || cfg->cell >= KV_CELL_COUNT || cfg->head_dim <= 0)
        return 0;
    int kr, vr;
    kv_rows_of(cfg->cell, &kr, &vr);
    size_t kb = kv_row_bytes(kr, cfg->head_dim), vb = kv_row_bytes(vr, cfg->head_dim);
    if (!kb || !vb)
        return 0;
    return (size_t)cfg->n_layer * (size_t)cfg->n_head_kv * (kb + vb);
}

static void kv_f16_to_f32(const uint16_t *x, float *y, size_t n)
{
    size_t i = 0;
#ifdef KV_F16C
#ifdef __AVX512F__
    for (; i + 16 <= n; i += 16)
        _mm512_storeu_ps(y + i, _mm512_cvtph_ps(_mm256_loadu_si256((const __m256i *)(x + i))));
#endif
    for (; i + 8 <= n; i += 8)
        _mm256_storeu_ps(y + i, _mm256_cvtph_ps(_mm_loadu_si128((const __m128i *)(x + i))));
#endif
    for (; i < n; i++)
        y[i] = quant_f16_to_f32(x[i]);
}

/* int8 row: scale d = absmax/127, codes round(x/d) (ties to even), so the
 * largest magnitude is exact and every error is at most d/2. */
static void kv_i8_encode(const float *x, uint8_t *dst, int E)
{
    float amax = 0.0f;
    for (int i = 0; i < E; i++)
        amax = fmaxf(amax, fabsf(x[i]));
    float d = amax / 127.0f, id = d > 0.0f ? 127.0f / amax : 0.0f;
    memcpy(dst, &d, 4);
    int8_t *q = (int8_t *)(dst + 4);
    for (int i = 0; i < E; i++) {
        float r = nearbyintf(x[i] * id);
        q[i] = (int8_t)(r > 127.0f ? 127 : r < -127.0f ? -127 : (int)r);
    }
}

static void kv_i8_decode(const uint8_t *src, float *y, int E)
{
    float d;
    memcpy(&d, src, 4);
    const int8_t *q = (const int8_t *)(src + 4);
    int i = 0;
#if defined(KV_F16C) && defined(__AVX512F__)
    __m512 vd = _mm512_set1_ps(d);
    for (; i + 16 <= E; i += 16) {
        __m512i w = _mm512_cvtepi8_epi32(_mm_loadu_si128((const __m128i *)(q + i)));
        _mm512_storeu_ps(y + i, _mm512_mul_ps(_mm512_cvtepi32_ps(w), vd));
    }
#endif
    for (; i < E; i++)
        y[i] = (float)q[i] * d;
}

/* Q4_0 rows: quant.c's layout and quantiser (the reference's); decoded here
 * with SIMD where it exists, to the same values (d * (nibble - 8)). */
static void kv_q4_decode(const struct kv *kv, const uint8_t *src, float *y, size_t n)
{
#if defined(KV_F16C) && defined(__AVX512F__)
    (void)kv;
    const __m128i lo_mask = _mm_set1_epi8(15);
    const __m512 eight = _mm512_set1_ps(8.0f);
    for (size_t b = 0; b < n / Q4_BLCK; b++, src += Q4_BYTES, y += Q4_BLCK) {
        uint16_t dh;
        memcpy(&dh, src, 2);
        __m512 d = _mm512_set1_ps(_cvtsh_ss(dh));
        __m128i qs = _mm_loadu_si128((const __m128i *)(src + 2));
        __m128i lo = _mm_and_si128(qs, lo_mask), hi = _mm_and_si128(_mm_srli_epi16(qs, 4), lo_mask);
        __m512 flo = _mm512_sub_ps(_mm512_cvtepi32_ps(_mm512_cvtepu8_epi32(lo)), eight);
        __m512 fhi = _mm512_sub_ps(_mm512_cvtepi32_ps(_mm512_cvtepu8_epi32(hi)), eight);
        _mm512_storeu_ps(y, _mm512_mul_ps(flo, d));
        _mm512_storeu_ps(y + 16, _mm512_mul_ps(fhi, d));
    }
#else
    kv->q4->to_f32(src, y, (int64_t)n);
#endif
}

static void kv_encode(const struct kv *kv, int row, const float *x, uint8_t *dst)
{
    switch (row) {
    case ROW_F32: memcpy(dst, x, (size_t)kv->E * 4); break;
    case ROW_F16: kv->f16->from_f32(x, dst, kv->E); break;
    case ROW_I8: kv_i8_encode(x, dst, kv->E); break;
    case ROW_Q4: kv->q4->from_f32(x, dst, kv->E); break;
    }
}

/* n consecutive rows of one page block → (n, E) f32. */
static void kv_decode(const struct kv *kv, int row, const uint8_t *src, float *y, int n)
{
    size_t ne = (size_t)n * (size_t)kv->E;
    switch (row) {
    case ROW_F32: memcpy(y, src, ne * 4); break;
    case ROW_F16: kv_f16_to_f32((const uint16_t *)src, y, ne); break;
    case ROW_I8:
        for (int i = 0; i < n; i++)
            kv_i8_decode(src + (size_t)i * (4 + (size_t)kv->E), y + (size_t)i * kv->E, kv->E);
        break;
    case ROW_Q4: kv_q4_decode(kv, src, y, ne); break;
    }
}

/* ==== pool and page lists ==== */

/* K rows of (layer, head) in a page; the V rows follow the P K rows. */
static inline uint8_t *kv_block(const struct kv *kv, int page, int layer, int head)
{
    return kv->data + (size_t)page * kv->page_bytes +
           ((size_t)layer * kv->K + (size_t)head) * (size_t)kv->P * (kv->kbytes + kv->vbytes);
}

static void kv_idle_remove(struct kv *kv, int p)
{
    struct kv_page *g = &kv->page[p];
    if (g->prev >= 0)
        kv->page[g->prev].next = g->next;
    else
        kv->idle_head = g->next;
    if (g->next >= 0)
        kv->page[g->next].prev = g->prev;
    else
        kv->idle_tail = g->prev;
    g->prev = g->next = -1;
    kv->n_idle--;
}

static void kv_idle_push(struct kv *kv, int p)
{
    struct kv_page *g = &kv->page[p];
    g->prev = kv->idle_tail;
    g->next = -1;
    if (kv->idle_tail >= 0)
        kv->page[kv->idle_tail].next = p;
    else
        kv->idle_head = p;
    kv->idle_tail = p;
    kv->n_idle++;
}

static void kv_free_push(struct kv *kv, int p)
{
    kv->page[p].next = kv->free_head;
    kv->page[p].prev = -1;
    kv->free_head = p;
    kv->n_free++;
}

/* ---- prefix table: open addressing, linear probing ---- */

static uint64_t kv_mix(uint64_t x)
{
    x ^= x >> 30;
    x *= 0xbf58476d1ce4e5b9ull;
    x ^= x >> 27;
    x *= 0x94d049bb133111ebull;
    return x ^ (x >> 31);
}

static uint64_t kv_hash(int parent, uint32_t parent_gen, const int32_t *tok, int P)
{
    uint64_t h = kv_mix(((uint64_t)(uint32_t)parent << 32) ^ parent_gen ^ 0x5bd1e995u);
    for (int i = 0; i < P; i++)
        h = kv_mix(h ^ (uint32_t)tok[i]);
    return h;
}

static void kv_table_remove(struct kv *kv, int p)
{
    uint32_t mask = kv->table_cap - 1, i = (uint32_t)kv->page[p].hash & mask;
    while (kv->table[i] != p)
        i = (i + 1) & mask;
    /* backward-shift deletion: pull later entries of the probe run into the
     * hole when their home slot does not lie after it */
    for (uint32_t j = (i + 1) & mask; kv->table[j] >= 0; j = (j + 1) & mask) {
        uint32_t home = (uint32_t)kv->page[kv->table[j]].hash & mask;
        if (((j - home) & mask) >= ((j - i) & mask)) {
            kv->table[i] = kv->table[j];
            i = j;
        }
    }
    kv->table[i] = -1;
    kv->page[p].cached = 0;
    kv->n_cached--;
}

/* The cached page with this parent and these tokens, or -1. */
static int kv_table_find(const struct kv *kv, int parent, uint32_t parent_gen, const int32_t *tok)
{
    uint64_t h = kv_hash(parent, parent_gen, tok, kv->P);
    uint32_t mask = kv->table_cap - 1;
    for (uint32_t i = (uint32_t)h & mask; kv->table[i] >= 0; i = (i + 1) & mask) {
        int p = kv->table[i];
        const struct kv_page *g = &kv->page[p];
        if (g->hash == h && g->parent == parent && g->parent_gen == parent_gen &&
            memcmp(kv->tok + (size_t)p * kv->P, tok, (size_t)kv->P * 4) == 0)
            return p;
    }
    return -1;
}

/* ---- references ---- */

static void kv_ref(struct kv *kv, int p)
{
    struct kv_page *g = &kv->page[p];
    if (g->cached && g->refs == 1)
        kv_idle_remove(kv, p);
    g->refs++;
}

static void kv_unref(struct kv *kv, int p)
{
    struct kv_page *g = &kv->page[p];
    if (--g->refs == 0)
        kv_free_push(kv, p);
    else if (g->refs == 1 && g->cached)
        kv_idle_push(kv, p);
}

/* A page for exclusive use (refs 1): from the free list, else the least
 * recently used idle cached page. The caller checked that one exists. */
static int kv_take(struct kv *kv)
{
    int p;
    if (kv->free_head >= 0) {
        p = kv->free_head;
        kv->free_head = kv->page[p].next;
        kv->n_free--;
    } else {
        p = kv->idle_head;
        kv_idle_remove(kv, p);
        kv_table_remove(kv, p);
    }
    struct kv_page *g = &kv->page[p];
    g->refs = 1;
    g->gen++;
    g->prev = g->next = -1;
    return p;
}

/* Offers the sequence's whole, written pages with known tokens to the
 * prefix table, in order; stops at the first that cannot join (an equal
 * page is already cached, or the page before it is not). */
static void kv_publish(struct kv *kv, struct kv_seq *s)
{
    int full = s->n / kv->P, known = s->n_tok / kv->P;
    int lim = full < known ? full : known;
    while (s->n_pub < lim) {
        int i = s->n_pub, p = s->pt[i];
        struct kv_page *g = &kv->page[p];
        if (g->cached) {        /* shared from the table already */
            s->n_pub++;
            continue;
        }
        int parent = i ? s->pt[i - 1] : -1;
        if (parent >= 0 && !kv->page[parent].cached)
            return;
        uint32_t pgen = parent >= 0 ? kv->page[parent].gen : 0;
        const int32_t *tok = kv->tok + (size_t)p * kv->P;
        if (kv_table_find(kv, parent, pgen, tok) >= 0)
            return;
        g->parent = parent;
        g->parent_gen = pgen;
        g->hash = kv_hash(parent, pgen, tok, kv->P);
        uint32_t mask = kv->table_cap - 1, j = (uint32_t)g->hash & mask;
        while (kv->table[j] >= 0)
            j = (j + 1) & mask;
        kv->table[j] = p;
        g->cached = 1;
        g->refs++;              /* the table's reference; the sequence holds one */
        kv->n_cached++;
        s->n_pub++;
    }
}

/* ==== creation ==== */

int kv_new(struct kv **out, const struct kv_config *cfg_in, char *err, size_t errlen)
{
    *out = NULL;
    struct kv_config cfg = *cfg_in;
    if (cfg.n_layer <= 0 || cfg.n_head_kv <= 0 || cfg.head_dim <= 0)
        return strata_errf(err, errlen, "KV cache: bad shape (layers %d, kv heads %d, head dim %d)",
                       cfg.n_layer, cfg.n_head_kv, cfg.head_dim);
    if (cfg.cell < 0 || cfg.cell >= KV_CELL_COUNT)
        return strata_errf(err, errlen, "KV cache: unknown cell format %d", cfg.cell);
    if (cfg.page_cells == 0)
        cfg.page_cells = KV_PAGE_CELLS;
    int P = cfg.page_cells;
    if (P < 16 || P > 256 || (P & (P - 1)))
        return strata_errf(err, errlen, "KV cache: %d cells per page; use a power of two in [16, 256]", P);
    if (cfg.n_seq <= 0)
        return strata_errf(err, errlen, "KV cache: %d sequences; need at least one", cfg.n_seq);
    size_t cell_bytes = kv_cell_bytes(&cfg);
    if (!cell_bytes)
        return strata_errf(err, errlen,
                       "KV cache: head dim %d is not a multiple of 32, which --kv %s needs "
                       "(Q4_0 blocks of 32)", cfg.head_dim, kv_cell_name(cfg.cell));
    size_t page_bytes = (cell_bytes * (size_t)P + 63) & ~(size_t)63;
    long long n_pages;
    if (cfg.mem_mib > 0) {
        n_pages = (long long)(((size_t)cfg.mem_mib << 20) / page_bytes);
        if (n_pages < 1)
            return strata_errf(err, errlen, "KV cache: --kv-mem %d MiB holds no page (one page of %d cells is %.1f MiB)",
                           cfg.mem_mib, P, (double)page_bytes / (1 << 20));
        if (cfg.n_ctx <= 0 || (long long)cfg.n_ctx > n_pages * P)
            cfg.n_ctx = (int)(n_pages * P < 0x40000000 ? n_pages * P : 0x40000000);
    } else {
        if (cfg.n_ctx <= 0)
            return strata_errf(err, errlen, "KV cache: give a context size or a memory budget");
        n_pages = (long long)((cfg.n_ctx + P - 1) / P) * cfg.n_seq;
    }
    if (n_pages > 0x3fffffff || (size_t)n_pages > SIZE_MAX / page_bytes)
        return strata_errf(err, errlen, "KV cache: %lld pages is too many", n_pages);
    int max_pages = (cfg.n_ctx + P - 1) / P;

    struct kv *kv = calloc(1, sizeof *kv);
    if (!kv)
        return strata_errf(err, errlen, "KV cache: out of memory");
    kv->cfg = cfg;
    kv->P = P;
    kv->L = cfg.n_layer;
    kv->K = cfg.n_head_kv;
    kv->E = cfg.head_dim;
    kv_rows_of(cfg.cell, &kv->krow, &kv->vrow);
    kv->kbytes = kv_row_bytes(kv->krow, kv->E);
    kv->vbytes = kv_row_bytes(kv->vrow, kv->E);
    kv->page_bytes = page_bytes;
    kv->n_pages = (int)n_pages;
    kv->max_pages = max_pages;
    kv->q4 = quant_type(QT_Q4_0);
    kv->f16 = quant_type(QT_F16);
    uint32_t cap = 16;
    while (cap < 2u * (uint32_t)n_pages)
        cap <<= 1;
    kv->table_cap = cap;

    /* one allocation for the tables: pages, tokens, prefix table, slots, page tables */
    size_t o_page = 0;
    size_t o_tok = o_page + (size_t)n_pages * sizeof(struct kv_page);
    size_t o_tab = o_tok + (size_t)n_pages * P * sizeof(int32_t);
    size_t o_seq = o_tab + (size_t)cap * sizeof(int32_t);
    size_t o_pt = (o_seq + (size_t)cfg.n_seq * sizeof(struct kv_seq) + 7) & ~(size_t)7;
    size_t meta_bytes = o_pt + (size_t)cfg.n_seq * max_pages * sizeof(int32_t);
    kv->meta = calloc(1, meta_bytes);
    kv->data = cfg.mem ? cfg.mem->alloc(cfg.mem->user, page_bytes * (size_t)n_pages)
                       : aligned_alloc(64, page_bytes * (size_t)n_pages);
    if (!kv->meta || !kv->data) {
        kv_free(kv);
        return strata_errf(err, errlen, "KV cache: cannot allocate %.1f MiB for %lld pages",
                       (double)(page_bytes * (size_t)n_pages + meta_bytes) / (1 << 20), n_pages);
    }
    kv->meta_bytes = meta_bytes;
    uint8_t *m = kv->meta;
    kv->page = (struct kv_page *)(m + o_page);
    kv->tok = (int32_t *)(m + o_tok);
    kv->table = (int32_t *)(m + o_tab);
    kv->seq = (struct kv_seq *)(m + o_seq);
    for (uint32_t i = 0; i < cap; i++)
        kv->table[i] = -1;
    for (int i = 0; i < cfg.n_seq; i++)
        kv->seq[i].pt = (int32_t *)(m + o_pt) + (size_t)i * max_pages;
    kv->free_head = kv->idle_head = kv->idle_tail = -1;
    for (int p = kv->n_pages - 1; p >= 0; p--)
        kv_free_push(kv, p);
    *out = kv;
    return 0;
}

void kv_free(struct kv *kv)
{
    if (!kv)
        return;
    if (kv->cfg.mem && kv->data)
        kv->cfg.mem->free(kv->cfg.mem->user, kv->data);
    else
        free(kv->data);
    free(kv->meta);
    free(kv);
}

const struct kv_config *kv_cfg(const struct kv *kv)
{
    return &kv->cfg;
}

void kv_layout(const struct kv *kv, struct kv_layout *lo)
{
    lo->data = kv->data;
    lo->page_bytes = kv->page_bytes;
    lo->kbytes = kv->kbytes;
    lo->vbytes = kv->vbytes;
    lo->P = kv->P;
    lo->n_pages = kv->n_pages;
    lo->max_pages = kv->max_pages;
}

const int32_t *kv_page_table(const struct kv *kv, int seq)
{
    return kv->seq[seq].pt;
}

void kv_stats(const struct kv *kv, struct kv_stats *s)
{
    s->pages = kv->n_pages;
    s->free = kv->n_free;
    s->cached = kv->n_cached;
    s->idle = kv->n_idle;
    s->cell_bytes = kv_cell_bytes(&kv->cfg);
    s->page_bytes = kv->page_bytes;
    s->total_bytes = kv->page_bytes * (size_t)kv->n_pages + kv->meta_bytes + sizeof *kv;
}

/* ==== sequences ==== */

static struct kv_seq *kv_seq_get(const struct kv *kv, int seq)
{
    if (seq < 0 || seq >= kv->cfg.n_seq || !kv->seq[seq].used)
        return NULL;
    return &kv->seq[seq];
}

int kv_seq_new(struct kv *kv, char *err, size_t errlen)
{
    for (int i = 0; i < kv->cfg.n_seq; i++)
        if (!kv->seq[i].used) {
            struct kv_seq *s = &kv->seq[i];
            s->used = 1;
            s->n = s->n_tok = s->n_pub = 0;
            return i;
        }
    return strata_errf(err, errlen, "KV cache: all %d sequence slots are in use", kv->cfg.n_seq);
}

int kv_seq_fork(struct kv *kv, int src, char *err, size_t errlen)
{
    struct kv_seq *s = kv_seq_get(kv, src);
    if (!s)
        return strata_errf(err, errlen, "KV cache: no sequence %d to fork", src);
    int id = kv_seq_new(kv, err, errlen);
    if (id < 0)
        return -1;
    struct kv_seq *d = &kv->seq[id];
    int np = (s->n + kv->P - 1) / kv->P;
    for (int i = 0; i < np; i++) {
        d->pt[i] = s->pt[i];
        kv_ref(kv, s->pt[i]);
    }
    d->n = s->n;
    d->n_tok = s->n_tok;
    d->n_pub = s->n_pub;
    return id;
}

void kv_seq_publish(struct kv *kv, int seq)
{
    struct kv_seq *s = kv_seq_get(kv, seq);
    if (s)
        kv_publish(kv, s);
}

void kv_seq_free(struct kv *kv, int seq)
{
    struct kv_seq *s = kv_seq_get(kv, seq);
    if (!s)
        return;
    kv_publish(kv, s);
    /* last page first, so that a prefix's later pages are evicted before
     * the pages they extend (an evicted parent orphans its children) */
    for (int i = (s->n + kv->P - 1) / kv->P - 1; i >= 0; i--)
        kv_unref(kv, s->pt[i]);
    s->used = 0;
    s->n = s->n_tok = s->n_pub = 0;
}

int kv_seq_len(const struct kv *kv, int seq)
{
    const struct kv_seq *s = kv_seq_get(kv, seq);
    return s ? s->n : -1;
}

int kv_seqs_check(const struct kv *kv, const int *seqs, int n, int min_cells, const char *who, char *err,
                  size_t errlen)
{
    for (int i = 0; i < n; i++) {
        int len = kv_seq_len(kv, seqs[i]);
        if (len < 0)
            return strata_errf(err, errlen, "%s: no sequence %d in this context", who, seqs[i]);
        if (len < min_cells)
            return strata_errf(err, errlen, "%s: sequence %d has %d cells, fewer than %d", who, seqs[i], len,
                               min_cells);
        for (int k = 0; k < i; k++)
            if (seqs[k] == seqs[i])
                return strata_errf(err, errlen, "%s: sequence %d appears twice", who, seqs[i]);
    }
    return 0;
}

int kv_append(struct kv *kv, int seq, const int32_t *tokens, int n, char *err, size_t errlen)
{
    struct kv_seq *s = kv_seq_get(kv, seq);
    if (!s)
        return strata_errf(err, errlen, "KV cache: no sequence %d", seq);
    if (n < 0)
        return strata_errf(err, errlen, "KV cache: cannot append %d cells", n);
    if (n > kv->cfg.n_ctx - s->n)
        return strata_errf(err, errlen, "KV cache: sequence %d would hold %lld cells, more than its %d (-c)",
                       seq, (long long)s->n + n, kv->cfg.n_ctx);
    kv_publish(kv, s);
    int P = kv->P, have = (s->n + P - 1) / P, want = (s->n + n + P - 1) / P;
    int cow = n > 0 && s->n % P && kv->page[s->pt[have - 1]].refs > 1;
    int need = want - have + cow;
    if (need > kv->n_free + kv->n_idle)
        return strata_errf(err, errlen,
                       "KV cache exhausted: sequence %d needs %d more pages of %d cells, %d free "
                       "(pool of %d pages; raise --kv-mem or -c)",
                       seq, need, P, kv->n_free + kv->n_idle, kv->n_pages);
    if (cow) {
        /* the first write into a shared page: this sequence gets its own copy */
        int old = s->pt[have - 1], p = kv_take(kv);
        uint8_t *dst = kv->data + (size_t)p * kv->page_bytes, *src = kv->data + (size_t)old * kv->page_bytes;
        if (kv->cfg.mem)
            kv->cfg.mem->copy(kv->cfg.mem->user, dst, src, kv->page_bytes);
        else
            memcpy(dst, src, kv->page_bytes);
        memcpy(kv->tok + (size_t)p * P, kv->tok + (size_t)old * P, (size_t)P * 4);
        s->pt[have - 1] = p;
        kv_unref(kv, old);
        if (s->n_pub > have - 1)
            s->n_pub = have - 1;
    }
    for (int i = have; i < want; i++)
        s->pt[i] = kv_take(kv);
    for (int i = 0; tokens && i < n; i++) {
        int c = s->n + i;
        kv->tok[(size_t)s->pt[c / P] * P + c % P] = tokens[i];
    }
    if (tokens && s->n_tok == s->n)
        s->n_tok = s->n + n;
    s->n += n;
    return 0;
}

void kv_truncate(struct kv *kv, int seq, int n)
{
    struct kv_seq *s = kv_seq_get(kv, seq);
    if (!s || n <= 0)
        return;
    int len = n >= s->n ? 0 : s->n - n, P = kv->P;
    for (int i = (s->n + P - 1) / P - 1; i >= (len + P - 1) / P; i--)
        kv_unref(kv, s->pt[i]);
    s->n = len;
    if (s->n_tok > len)
        s->n_tok = len;
    if (s->n_pub > len / P)
        s->n_pub = len / P;
}

int kv_prefix(struct kv *kv, int seq, const int32_t *tokens, int n)
{
    struct kv_seq *s = kv_seq_get(kv, seq);
    if (!s || s->n || !tokens)
        return 0;
    int P = kv->P, parent = -1, got = 0;
    uint32_t pgen = 0;
    while ((got + 1) * P <= n && got < kv->max_pages) {
        int p = kv_table_find(kv, parent, pgen, tokens + (size_t)got * P);
        if (p < 0)
            break;
        kv_ref(kv, p);
        s->pt[got++] = p;
        parent = p;
        pgen = kv->page[p].gen;
    }
    s->n = s->n_tok = got * P;
    s->n_pub = got;
    return s->n;
}

int kv_store(struct kv *kv, int seq, int layer, int pos, int n, const float *k, const float *v,
             char *err, size_t errlen)
{
    struct kv_seq *s = kv_seq_get(kv, seq);
    if (!s)
        return strata_errf(err, errlen, "KV cache: no sequence %d", seq);
    if (layer < 0 || layer >= kv->L || pos < 0 || n < 0 || pos > s->n - n)
        return strata_errf(err, errlen, "KV cache: cannot store layer %d cells %d..%d of sequence %d (%d cells)",
                       layer, pos, pos + n - 1, seq, s->n);
    int P = kv->P, K = kv->K, E = kv->E;
    for (int c0 = pos; c0 < pos + n;) {
        int page = s->pt[c0 / P], slot = c0 % P, cnt = P - slot;
        cnt = cnt < pos + n - c0 ? cnt : pos + n - c0;
        if (kv->page[page].refs != 1)
            return strata_errf(err, errlen, "KV cache: cell %d of sequence %d is in a shared page "
                           "(append before writing)", c0, seq);
        for (int h = 0; h < K; h++) {
            uint8_t *kb = kv_block(kv, page, layer, h), *vb = kb + (size_t)P * kv->kbytes;
            for (int i = 0; i < cnt; i++) {
                size_t row = ((size_t)(c0 - pos + i) * K + h) * E;
                kv_encode(kv, kv->krow, k + row, kb + (size_t)(slot + i) * kv->kbytes);
                kv_encode(kv, kv->vrow, v + row, vb + (size_t)(slot + i) * kv->vbytes);
            }
        }
        c0 += cnt;
    }
    return 0;
}

/* ==== reading ==== */

void kv_read(const struct kv *kv, int seq, int layer, int head, int c0, int n, float *k, float *v)
{
    const struct kv_seq *s = &kv->seq[seq];
    int P = kv->P, E = kv->E;
    for (int c = c0; c < c0 + n;) {
        int slot = c % P, cnt = P - slot;
        cnt = cnt < c0 + n - c ? cnt : c0 + n - c;
        const uint8_t *kb = kv_block(kv, s->pt[c / P], layer, head), *vb = kb + (size_t)P * kv->kbytes;
        size_t o = (size_t)(c - c0) * E;
        if (k)
            kv_decode(kv, kv->krow, kb + (size_t)slot * kv->kbytes, k + o, cnt);
        if (v)
            kv_decode(kv, kv->vrow, vb + (size_t)slot * kv->vbytes, v + o, cnt);
        c += cnt;
    }
}

void kv_prefetch(const struct kv *kv, int seq, int layer, int head, const int32_t *cells, int c0, int n)
{
    const struct kv_seq *s = &kv->seq[seq];
    int P = kv->P;
    for (int i = 0; i < n;) {
        /* a run of consecutive cells in one page: one K span, one V span */
        int c = cells ? cells[i] : c0 + i, run = 1;
        while (i + run < n && (cells ? cells[i + run] : c0 + i + run) == c + run && (c + run) % P)
            run++;
        const uint8_t *kb = kv_block(kv, s->pt[c / P], layer, head);
        const uint8_t *k = kb + (size_t)(c % P) * kv->kbytes;
        const uint8_t *v = kb + (size_t)P * kv->kbytes + (size_t)(c % P) * kv->vbytes;
        for (size_t o = 0; o < (size_t)run * kv->kbytes; o += 64)
            __builtin_prefetch(k + o);
        for (size_t o = 0; o < (size_t)run * kv->vbytes; o += 64)
            __builtin_prefetch(v + o);
        i += run;
    }
}

void kv_gather(const struct kv *kv, int seq, int layer, int head, const int32_t *cells, int n,
               float *k, float *v)
{
    const struct kv_seq *s = &kv->seq[seq];
    int P = kv->P, E = kv->E;
    for (int i = 0; i < n;) {
        /* a run of consecutive cells in one page decodes as one */
        int c = cells[i], run = 1;
        while (i + run < n && cells[i + run] == c + run && (c + run) % P)
            run++;
        const uint8_t *kb = kv_block(kv, s->pt[c / P], layer, head), *vb = kb + (size_t)P * kv->kbytes;
        size_t o = (size_t)i * E;
        if (k)
            kv_decode(kv, kv->krow, kb + (size_t)(c % P) * kv->kbytes, k + o, run);
        if (v)
            kv_decode(kv, kv->vrow, vb + (size_t)(c % P) * kv->vbytes, v + o, run);
        i += run;
    }
}

int kv_page_of(const struct kv *kv, int seq, int cell)
{
    const struct kv_seq *s = kv_seq_get(kv, seq);
    if (!s || cell < 0 || cell >= s->n)
        return -1;
    return s->pt[cell / kv->P];
}

int kv_page_refs(const struct kv *kv, int page)
{
    return page >= 0 && page < kv->n_pages ? kv->page[page].refs : -1;
}
