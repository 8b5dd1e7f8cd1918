/*
 * test_attn.h — the attention tests' shared harness, defined in test_attn.c
 * (which every build compiles) and used by test_gpu_attn.c and
 * test_gpu_rdna2.c: random K/V/queries with QSA selections, a kv.c cache
 * holding them, the FP64 reference row, the max abs error bounds per cell
 * format. Test code only; the engine never includes it.
 */
#ifndef STRATA_TEST_ATTN_H
#define STRATA_TEST_ATTN_H

#include "strata.h"

/* One attended layer of K/V, its queries and their QSA selections. */
struct test_attn_data {
    int E, G, K, H, C, T;   /* T queries at cells C-T..C-1 */
    float *q;               /* (T, H, E) */
    float *k, *v;           /* (C, K, E) the attended layer's rows */
    int32_t *sel;           /* QSA: the T queries' cell lists */
    int64_t *off;           /* (T+1) */
};

/* Keys with a random magnitude per row in [mag_lo, 2 - mag_lo) (int8/q4
 * scales differ by row), values in [-1, 1], queries with a gain of 1..8 by
 * head so that some heads attend broadly and some sharply. Selection scores
 * on a grid of 1/grid make ties, which attn_topk breaks by cell index. */
void test_attn_make(struct test_attn_data *d, int E, int G, int K, int C, int T, int topk, int local,
                    unsigned seed, float mag_lo, int grid);
void test_attn_free(struct test_attn_data *d);
/* A two-layer cache of P-cell pages: layer 1 holds the data, layer 0 its
 * negation (a layer mix-up shows), appended and stored in uneven pieces.
 * interleave: a second sequence takes a page between the pieces (the page
 * table is not the identity). *seq (seq may be NULL): the data's
 * sequence, 0 without interleave. NULL after a failed CHECK. */
struct kv *test_attn_kv(const struct test_attn_data *d, int cell, int P, int interleave, int *seq);
/* FP64 attention of row (t, h) over its cells (the list, or 0..n-1) of the
 * original f32 K/V. s: (n) scratch; out: (E). */
void test_attn_ref_row(const struct test_attn_data *d, int t, int h, const int32_t *cells, int n, double *s,
                       double *out);
/* Max abs error bound against FP64 of attn.c's paths over C cells of the
 * format, for outputs of magnitude <= 1. */
double test_attn_bound(int cell, int C);

#endif
