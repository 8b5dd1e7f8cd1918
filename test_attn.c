/*
 * test_attn.c — tests of attn.c against an FP64 reference: every path
 * (dense prompt, dense decode split, QSA prompt, QSA decode split) on every
 * KV cell format, head dims 128 and 256, GQA 8:1 and 12:1, reporting the
 * max abs and RMS error of the fast path next to a textbook float path (the
 * unsplit one-pass softmax over the same dequantised cells); the exact
 * identities (decode S = 1 and QSA over every cell equal the prompt path bit
 * for bit); the reference-engine rounding mode against a model of it; the
 * top-k selection against a sort. attn/bench (STRATA_BENCH=1) times decode.
 * Defines test_attn.h's harness (inputs, cache, FP64 row, bounds), which the
 * GPU attention tests share.
 */
#include "strata.h"
#include "test.h"
#include "test_attn.h"

#include <math.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <time.h>

/* ---- the shared harness (test_attn.h) ---- */

void test_attn_make(struct test_attn_data *d, int E, int G, int K, int C, int T, int topk, int local,
                    unsigned seed, float mag_lo, int grid)
{
    memset(d, 0, sizeof *d);
    d->E = E, d->G = G, d->K = K, d->H = G * K, d->C = C, d->T = T;
    unsigned st = seed;
    d->k = malloc((size_t)C * K * E * sizeof(float));
    d->v = malloc((size_t)C * K * E * sizeof(float));
    d->q = malloc((size_t)T * d->H * E * sizeof(float));
    for (size_t r = 0; r < (size_t)C * K; r++) {
        float mag = mag_lo + (1.0f - mag_lo) * (test_randf(&st) + 1.0f);
        for (int e = 0; e < E; e++) {
            d->k[r * E + e] = test_randf(&st) * mag;
            d->v[r * E + e] = test_randf(&st);
        }
    }
    for (int t = 0; t < T; t++)
        for (int h = 0; h < d->H; h++) {
            float gain = 1.0f + (float)(h % 8);
            for (int e = 0; e < E; e++)
                d->q[((size_t)t * d->H + h) * E + e] = test_randf(&st) * gain;
        }
    d->off = malloc((size_t)(T + 1) * sizeof *d->off);
    d->sel = malloc((size_t)T * (topk + local < C ? topk + local : C) * sizeof *d->sel);
    float *score = malloc((size_t)C * sizeof *score);
    d->off[0] = 0;
    for (int t = 0; t < T; t++) {
        int n = C - T + t + 1;
        for (int c = 0; c < n; c++)
            score[c] = (float)(int)(test_randf(&st) * grid) / grid;
        d->off[t + 1] = d->off[t] + attn_topk(score, n, topk, local, d->sel + d->off[t]);
    }
    free(score);
}

void test_attn_free(struct test_attn_data *d)
{
    free(d->q);
    free(d->k);
    free(d->v);
    free(d->sel);
    free(d->off);
}

struct kv *test_attn_kv(const struct test_attn_data *d, int cell, int P, int interleave, int *seq)
{
    struct kv_config cfg = {2, d->K, d->E, cell, P, interleave ? 2 : 1, d->C, 0, NULL};
    struct kv *kv;
    char err[256];
    if (!CHECK(kv_new(&kv, &cfg, err, sizeof err) == 0, "%s", err))
        return NULL;
    int other = interleave ? kv_seq_new(kv, err, sizeof err) : -1, s = kv_seq_new(kv, err, sizeof err);
    size_t row = (size_t)d->K * d->E;
    float *neg = malloc(2 * row * 600 * sizeof *neg);
    int ok = 1;
    for (int c0 = 0; c0 < d->C;) {
        int n = 600 - (c0 % 5) * 97;
        n = n < d->C - c0 ? n : d->C - c0;
        if (interleave && kv_seq_len(kv, other) + P <= d->C)
            ok &= kv_append(kv, other, NULL, P, err, sizeof err) == 0;
        ok &= kv_append(kv, s, NULL, n, err, sizeof err) == 0;
        for (size_t i = 0; i < (size_t)n * row; i++) {
            neg[i] = -d->k[c0 * row + i];
            neg[n * row + i] = -d->v[c0 * row + i];
        }
        ok &= kv_store(kv, s, 0, c0, n, neg, neg + n * row, err, sizeof err) == 0;
        ok &= kv_store(kv, s, 1, c0, n, d->k + c0 * row, d->v + c0 * row, err, sizeof err) == 0;
        c0 += n;
    }
    free(neg);
    if (!CHECK(ok, "building the cache: %s", err)) {
        kv_free(kv);
        return NULL;
    }
    if (seq)
        *seq = s;
    return kv;
}

/* Scores, max, e^(s - max), the weighted sum of V over the sum, in double. */
void test_attn_ref_row(const struct test_attn_data *d, int t, int h, const int32_t *cells, int n, double *s,
                       double *out)
{
    int E = d->E, kh = h / d->G;
    const float *q = d->q + ((size_t)t * d->H + h) * E;
    double scale = 1.0 / sqrt((double)E), m = -INFINITY, sum = 0;
    for (int i = 0; i < n; i++) {
        const float *k = d->k + ((size_t)(cells ? cells[i] : i) * d->K + kh) * E;
        double a = 0;
        for (int e = 0; e < E; e++)
            a += (double)q[e] * k[e];
        s[i] = a * scale;
        m = s[i] > m ? s[i] : m;
    }
    for (int e = 0; e < E; e++)
        out[e] = 0;
    for (int i = 0; i < n; i++) {
        double p = exp(s[i] - m);
        const float *v = d->v + ((size_t)(cells ? cells[i] : i) * d->K + kh) * E;
        sum += p;
        for (int e = 0; e < E; e++)
            out[e] += p * v[e];
    }
    for (int e = 0; e < E; e++)
        out[e] /= sum;
}

/* Per format (f32 f16 int8 q4 k8v4): f16 values and keys rounded to 11
 * bits; int8 steps of absmax/127; Q4_0 steps of absmax/8 on V and on K,
 * where a score error of ~0.2 moves the weights of a sharp head. f32 has
 * only rounding, which float sums over C cells grow like sqrt(C):
 * 2e-6 x sqrt(C/256). */
double test_attn_bound(int cell, int C)
{
    static const double max_bound[KV_CELL_COUNT] = {2e-6, 3e-3, 4e-2, 5e-1, 2e-1};
    return cell == KV_CELL_F32 ? max_bound[cell] * sqrt(C / 256.0) : max_bound[cell];
}

/* This file's inputs: keys of magnitude 0.5..1.5 per row, scores on a 1/64 grid. */
static void make_data(struct test_attn_data *d, int E, int G, int K, int C, int T, int topk, int local, unsigned seed)
{
    test_attn_make(d, E, G, K, C, T, topk, local, seed, 0.5f, 64);
}

/* ---- the textbook path ---- */

/* The textbook float path over the dequantised cells kd, vd (C, E) of one
 * kv head: every score, the max, expf, the sum, then P·V — unsplit, one
 * pass over a whole row of scores. */
static void simple_row(const float *q, const float *kd, const float *vd, int E, const int32_t *cells, int n,
                       float *s, float *out)
{
    float scale = 1.0f / sqrtf((float)E), m = -INFINITY, sum = 0;
    for (int i = 0; i < n; i++) {
        const float *k = kd + (size_t)(cells ? cells[i] : i) * E;
        float a[8] = {0};
        for (int e = 0; e < E; e += 8)
            for (int l = 0; l < 8; l++)
                a[l] += q[e + l] * k[e + l];
        s[i] = (((a[0] + a[1]) + (a[2] + a[3])) + ((a[4] + a[5]) + (a[6] + a[7]))) * scale;
        m = fmaxf(m, s[i]);
    }
    for (int e = 0; e < E; e++)
        out[e] = 0;
    for (int i = 0; i < n; i++) {
        s[i] = expf(s[i] - m);
        sum += s[i];
        const float *v = vd + (size_t)(cells ? cells[i] : i) * E;
        for (int e = 0; e < E; e++)
            out[e] += s[i] * v[e];
    }
    for (int e = 0; e < E; e++)
        out[e] *= 1.0f / sum;
}

/* ---- the matrix of paths x formats ---- */

struct acfg {
    int E, G, K, C, T, W, P;  /* shapes; W decode window; P cells per page */
    int topk, local;          /* QSA */
    int n_split;              /* decode partitions (0: attn_split's choice) */
    int every;                /* reference rows: every `every`-th query and the last W */
};

static int ref_wanted(const struct acfg *cf, int t)
{
    return t % cf->every == 0 || t >= cf->T - cf->W;
}

static const char *const path_names[4] = {"dense prompt", "dense decode", "QSA prompt", "QSA decode"};

static void run_config(const struct acfg *cf, struct pool *pool, unsigned seed)
{
    struct test_attn_data d;
    make_data(&d, cf->E, cf->G, cf->K, cf->C, cf->T, cf->topk, cf->local, seed);
    int E = d.E, H = d.H, T = d.T, pos0 = d.C - T;
    size_t HE = (size_t)H * E;
    /* FP64 rows, dense and QSA, shared by every format */
    double *ref[2], *sd = malloc((size_t)d.C * sizeof *sd);
    for (int w = 0; w < 2; w++) {
        ref[w] = calloc((size_t)T * HE, sizeof(double));
        for (int t = 0; t < T; t++)
            for (int h = 0; ref_wanted(cf, t) && h < H; h++) {
                const int32_t *cells = w ? d.sel + d.off[t] : NULL;
                int n = w ? (int)(d.off[t + 1] - d.off[t]) : pos0 + t + 1;
                test_attn_ref_row(&d, t, h, cells, n, sd, ref[w] + t * HE + (size_t)h * E);
            }
    }
    float *simple = malloc((size_t)T * HE * sizeof *simple), *fast = malloc((size_t)T * HE * sizeof *fast);
    float *one = malloc((size_t)T * HE * sizeof *one), *ss = malloc((size_t)d.C * sizeof *ss);
    float *kd = malloc((size_t)d.C * E * sizeof *kd), *vd = malloc((size_t)d.C * E * sizeof *vd);
    struct attn *a;
    char err[256], name[96];
    if (!CHECK(attn_new(&a, H, d.K, E, cf->W, pool_size(pool), err, sizeof err) == 0, "%s", err))
        return;
    for (int cell = 0; cell < KV_CELL_COUNT; cell++) {
        snprintf(name, sizeof name, "attn/E%d-G%d-K%d-C%d-T%d/%s", E, cf->G, d.K, d.C, T, kv_cell_name(cell));
        if (!test_begin(name))
            continue;
        struct kv *kv = test_attn_kv(&d, cell, cf->P, 0, NULL);
        if (!kv)
            continue;
        for (int w = 0; w < 2; w++) {
            const int32_t *sel = w ? d.sel : NULL;
            const int64_t *off = w ? d.off : NULL;
            /* the textbook path on the dequantised cells */
            for (int kh = 0; kh < d.K; kh++) {
                kv_read(kv, 0, 1, kh, 0, d.C, kd, vd);
                for (int t = 0; t < T; t++)
                    for (int g = 0; ref_wanted(cf, t) && g < cf->G; g++) {
                        size_t o = t * HE + (size_t)(kh * cf->G + g) * E;
                        int n = w ? (int)(off[t + 1] - off[t]) : pos0 + t + 1;
                        simple_row(d.q + o, kd, vd, E, w ? sel + off[t] : NULL, n, ss, simple + o);
                    }
            }
            /* prompt path over all T queries */
            struct attn_job j = {kv, 0, 1, d.q, fast, T, pos0, 0, 0, 0, sel, off};
            test_poison(fast, (size_t)T * HE);
            int rc = w ? attn_qsa_prompt(a, pool, &j, err, sizeof err) : attn_prompt(a, pool, &j, err, sizeof err);
            CHECK(rc == 0, "%s", err);
            struct test_err es = {0}, ef = {0};
            for (int t = 0; t < T; t++)
                if (ref_wanted(cf, t)) {
                    test_err_add(&es, simple + t * HE, ref[w] + t * HE, HE);
                    test_err_add(&ef, fast + t * HE, ref[w] + t * HE, HE);
                }
            printf("     %-5s %-12s simple max %.2e rms %.2e | fast max %.2e rms %.2e\n", kv_cell_name(cell),
                   path_names[2 * w], es.max, test_err_rms(&es), ef.max, test_err_rms(&ef));
            CHECK(test_err_rms(&ef) <= 1.25 * test_err_rms(&es), "%s: rms %.3e above 1.25 x %.3e", path_names[2 * w],
                  test_err_rms(&ef), test_err_rms(&es));
            CHECK(ef.max <= test_attn_bound(cell, d.C), "%s: max %.3e above %.1e", path_names[2 * w], ef.max,
                  test_attn_bound(cell, d.C));
            /* decode: the last W queries, unsplit (S = 1) and split */
            int W = cf->W, t0 = T - W;
            struct attn_job jd = {kv, 0, 1, d.q + t0 * HE, one, W, pos0 + t0, 0, 0, 1,
                                  sel ? sel + off[t0] : NULL, NULL};
            int64_t offw[64];
            for (int t = 0; w && t <= W; t++)
                offw[t] = off[t0 + t] - off[t0];
            if (w)
                jd.sel_off = offw;
            test_poison(one, (size_t)W * HE);
            rc = w ? attn_qsa_decode(a, pool, &jd, err, sizeof err) : attn_decode(a, pool, &jd, err, sizeof err);
            CHECK(rc == 0, "%s", err);
            CHECK(memcmp(one, fast + t0 * HE, (size_t)W * HE * sizeof(float)) == 0,
                  "%s with S = 1 differs from the unsplit prompt path", path_names[2 * w + 1]);
            int n_cells = w ? 0 : pos0 + T;
            for (int t = 0; w && t < W; t++)
                n_cells = offw[t + 1] - offw[t] > n_cells ? (int)(offw[t + 1] - offw[t]) : n_cells;
            jd.n_split = cf->n_split;
            jd.out = fast + t0 * HE;
            test_poison(jd.out, (size_t)W * HE);
            rc = w ? attn_qsa_decode(a, pool, &jd, err, sizeof err) : attn_decode(a, pool, &jd, err, sizeof err);
            CHECK(rc == 0, "%s", err);
            struct test_err ds = {0}, d1 = {0}, dx = {0};
            test_err_add(&ds, simple + t0 * HE, ref[w] + t0 * HE, W * HE);
            test_err_add(&d1, one, ref[w] + t0 * HE, W * HE);
            test_err_add(&dx, jd.out, ref[w] + t0 * HE, W * HE);
            int S = cf->n_split ? cf->n_split : attn_split(n_cells, d.K, pool_size(pool));
            printf("     %-5s %-12s simple max %.2e rms %.2e | S=1 max %.2e rms %.2e | S=%d max %.2e rms %.2e\n",
                   kv_cell_name(cell), path_names[2 * w + 1], ds.max, test_err_rms(&ds), d1.max, test_err_rms(&d1), S,
                   dx.max, test_err_rms(&dx));
            CHECK(S > 1, "the split path was not exercised (S = %d)", S);
            CHECK(test_err_rms(&dx) <= 1.25 * test_err_rms(&ds), "%s: rms %.3e above 1.25 x %.3e",
                  path_names[2 * w + 1], test_err_rms(&dx), test_err_rms(&ds));
            CHECK(dx.max <= test_attn_bound(cell, d.C), "%s: max %.3e above %.1e", path_names[2 * w + 1], dx.max,
                  test_attn_bound(cell, d.C));
        }
        kv_free(kv);
    }
    attn_free(a);
    free(ref[0]);
    free(ref[1]);
    free(sd);
    free(simple);
    free(fast);
    free(one);
    free(ss);
    free(kd);
    free(vd);
    test_attn_free(&d);
}

/* ---- exact identities at the QSA edge ---- */

/* Context of k+1 cells: the first queries see <= k cells (all selected: the
 * QSA paths equal the dense ones bit for bit), the last sees k+1 and loses
 * one cell (it must differ, and match FP64 over its selection). */
static void case_qsa_edge(struct pool *pool)
{
    enum { E = 128, G = 4, K = 2, TOPK = 700, T = 4 };
    for (int cell = KV_CELL_F16; cell <= KV_CELL_Q4; cell += KV_CELL_Q4 - KV_CELL_F16) {
        char err[256], name[64];
        snprintf(name, sizeof name, "attn/qsa-edge/%s", kv_cell_name(cell));
        if (!test_begin(name))
            continue;
        for (int C = TOPK; C <= TOPK + 1; C++) {
            struct test_attn_data d;
            make_data(&d, E, G, K, C, T, TOPK, 0, 99);
            struct kv *kv = test_attn_kv(&d, cell, 32, 0, NULL);
            struct attn *a;
            if (!kv || !CHECK(attn_new(&a, d.H, K, E, T, pool_size(pool), err, sizeof err) == 0, "%s", err))
                return;
            size_t HE = (size_t)d.H * E, N = T * HE;
            float *dense = malloc(N * 4), *qsa = malloc(N * 4), *dd = malloc(N * 4), *qd = malloc(N * 4);
            struct attn_job j = {kv, 0, 1, d.q, dense, T, C - T, 0, 0, 0, d.sel, d.off};
            test_poison(dense, N);
            test_poison(qsa, N);
            CHECK(attn_prompt(a, pool, &j, err, sizeof err) == 0, "%s", err);
            j.out = qsa;
            CHECK(attn_qsa_prompt(a, pool, &j, err, sizeof err) == 0, "%s", err);
            for (int split = 1; split <= 3; split += 2) {
                j.n_split = split;
                j.out = dd;
                test_poison(dd, N);
                test_poison(qd, N);
                CHECK(attn_decode(a, pool, &j, err, sizeof err) == 0, "%s", err);
                j.out = qd;
                CHECK(attn_qsa_decode(a, pool, &j, err, sizeof err) == 0, "%s", err);
                /* all selected everywhere: QSA decode equals dense decode; at
                 * C = k+1 the partitions of the two differ, S = 1 excepted */
                int rows = C == TOPK || split == 1 ? T - (C > TOPK) : 0;
                CHECK(memcmp(dd, qd, rows * HE * 4) == 0, "C=%d S=%d: QSA decode differs from dense", C, split);
                if (C > TOPK)
                    CHECK(memcmp(dd + (T - 1) * HE, qd + (T - 1) * HE, HE * 4) != 0,
                          "C=%d S=%d: dropping a cell changed nothing", C, split);
            }
            int full = C == TOPK ? T : T - 1;
            CHECK(memcmp(dense, qsa, full * HE * 4) == 0, "C=%d: QSA prompt differs from dense where all selected",
                  C);
            for (int t = 0; t < T; t++)
                CHECK((d.off[t + 1] - d.off[t]) == (C - T + t + 1 <= TOPK ? C - T + t + 1 : TOPK),
                      "query %d selected %lld cells", t, (long long)(d.off[t + 1] - d.off[t]));
            if (C > TOPK) {
                double *sd = malloc(C * sizeof *sd), *ref = malloc(HE * sizeof *ref);
                struct test_err e = {0};
                for (int h = 0; h < d.H; h++)
                    test_attn_ref_row(&d, T - 1, h, d.sel + d.off[T - 1], (int)(d.off[T] - d.off[T - 1]), sd,
                                      ref + h * E);
                test_err_add(&e, qsa + (T - 1) * HE, ref, HE);
                CHECK(memcmp(dense + (T - 1) * HE, qsa + (T - 1) * HE, HE * 4) != 0, "one cell dropped, same output");
                CHECK(e.max <= test_attn_bound(cell, C), "C=k+1: max %.3e vs FP64 of the selection", e.max);
                printf("     %-5s C=k+1: the dropped cell's query vs FP64 max %.2e rms %.2e\n", kv_cell_name(cell),
                       e.max, test_err_rms(&e));
                free(sd);
                free(ref);
            }
            free(dense);
            free(qsa);
            free(dd);
            free(qd);
            attn_free(a);
            kv_free(kv);
            test_attn_free(&d);
        }
    }
}

/* ---- the reference engine's rounding points ---- */

/* Its non-flash path with an F16 cache, modelled in plain code: Q rounded
 * to F16, scores in float, softmax with a double sum, probabilities
 * normalised then rounded to F16, P·V summed. */
static void f16ref_row(const float *q, const float *kd, const float *vd, int E, int n, float *s, float *out)
{
    float scale = 1.0f / sqrtf((float)E), m = -INFINITY, qr[256];
    for (int e = 0; e < E; e++)
        qr[e] = quant_f16_to_f32(quant_f32_to_f16(q[e]));
    for (int i = 0; i < n; i++) {
        double a = 0;
        for (int e = 0; e < E; e++)
            a += (double)qr[e] * kd[(size_t)i * E + e];
        s[i] = (float)a * scale;
        m = fmaxf(m, s[i]);
    }
    double sum = 0;
    for (int i = 0; i < n; i++) {
        s[i] = expf(s[i] - m);
        sum += s[i];
    }
    float inv = (float)(1.0 / sum);
    double acc[256] = {0};
    for (int i = 0; i < n; i++) {
        float p = quant_f16_to_f32(quant_f32_to_f16(s[i] * inv));
        for (int e = 0; e < E; e++)
            acc[e] += (double)p * vd[(size_t)i * E + e];
    }
    for (int e = 0; e < E; e++)
        out[e] = (float)acc[e];
}

static void case_f16_ref(struct pool *pool)
{
    if (!test_begin("attn/f16-reference-rounding"))
        return;
    enum { E = 128, G = 2, K = 2, C = 900, T = 32, W = 4 };
    struct test_attn_data d;
    make_data(&d, E, G, K, C, T, C, 0, 5);
    struct kv *kv = test_attn_kv(&d, KV_CELL_F16, 64, 0, NULL);
    struct attn *a;
    char err[256];
    if (!kv || !CHECK(attn_new(&a, d.H, K, E, W, pool_size(pool), err, sizeof err) == 0, "%s", err))
        return;
    size_t HE = (size_t)d.H * E, N = T * HE;
    float *model = malloc(N * 4), *refm = malloc(N * 4), *norm = malloc(N * 4), *dec = malloc(W * HE * 4);
    float *kd = malloc((size_t)C * E * 4), *vd = malloc((size_t)C * E * 4), *s = malloc(C * 4);
    for (int kh = 0; kh < K; kh++) {
        kv_read(kv, 0, 1, kh, 0, C, kd, vd);
        for (int t = 0; t < T; t++)
            for (int g = 0; g < G; g++) {
                size_t o = t * HE + (size_t)(kh * G + g) * E;
                f16ref_row(d.q + o, kd, vd, E, C - T + t + 1, s, model + o);
            }
    }
    struct attn_job j = {kv, 0, 1, d.q, refm, T, C - T, 0, ATTN_F16_REF, 0, NULL, NULL};
    test_poison(refm, N);
    CHECK(attn_prompt(a, pool, &j, err, sizeof err) == 0, "%s", err);
    j.flags = 0;
    j.out = norm;
    test_poison(norm, N);
    CHECK(attn_prompt(a, pool, &j, err, sizeof err) == 0, "%s", err);
    struct test_err er = {0}, en = {0};
    double *md = malloc(N * sizeof *md);
    for (size_t i = 0; i < N; i++)
        md[i] = model[i];
    test_err_add(&er, refm, md, N);
    test_err_add(&en, norm, md, N);
    printf("     vs the model of the reference: ATTN_F16_REF max %.2e rms %.2e | default max %.2e rms %.2e\n",
           er.max, test_err_rms(&er), en.max, test_err_rms(&en));
    /* the flag reproduces the rounding points: a tenth of the default's
     * distance, the rest being float sums and a rare probability rounded
     * to the neighbouring half */
    CHECK(test_err_rms(&er) <= 0.1 * test_err_rms(&en), "rms %.3e vs default %.3e", test_err_rms(&er),
          test_err_rms(&en));
    CHECK(er.max <= 1e-3, "max %.3e", er.max);
    /* decode in this mode: S = 1 is the prompt path exactly; split close */
    struct attn_job jd = {kv, 0, 1, d.q + (T - W) * HE, dec, W, C - W, 0, ATTN_F16_REF, 1, NULL, NULL};
    test_poison(dec, W * HE);
    CHECK(attn_decode(a, pool, &jd, err, sizeof err) == 0, "%s", err);
    CHECK(memcmp(dec, refm + (T - W) * HE, W * HE * 4) == 0, "reference-mode decode S = 1 differs");
    jd.n_split = 5;
    test_poison(dec, W * HE);
    CHECK(attn_decode(a, pool, &jd, err, sizeof err) == 0, "%s", err);
    struct test_err es = {0};
    test_err_add(&es, dec, md + (T - W) * HE, W * HE);
    CHECK(es.max <= 1e-3, "reference-mode split decode: max %.3e vs the model", es.max);
    free(md);
    free(model);
    free(refm);
    free(norm);
    free(dec);
    free(kd);
    free(vd);
    free(s);
    attn_free(a);
    kv_free(kv);
    test_attn_free(&d);
}

/* ---- top-k against a sort ---- */

static const float *cmp_score;

static int cmp_desc(const void *pa, const void *pb)
{
    int a = *(const int *)pa, b = *(const int *)pb;
    float x = cmp_score[a], y = cmp_score[b];
    int xn = x != x, yn = y != y;
    if (xn != yn)
        return xn - yn; /* NaN last */
    if (!xn && x != y)
        return x > y ? -1 : 1;
    return a - b;
}

static int cmp_int(const void *pa, const void *pb)
{
    return *(const int32_t *)pa - *(const int32_t *)pb;
}

static void case_topk(void)
{
    if (!test_begin("attn/topk"))
        return;
    unsigned st = 3;
    enum { N = 3000 };
    static float sc[N];
    static int idx[N];
    static int32_t got[N], want[N];
    int trials = 0, bad = 0;
    for (int round = 0; round < 40; round++) {
        int n = 1 + (int)(test_rand(&st) % N), k = (int)(test_rand(&st) % (n + 5)), local = (int)(test_rand(&st) % 70);
        int levels = round % 3 == 0 ? 4 : round % 3 == 1 ? 1000 : 0; /* many ties, some, none */
        for (int i = 0; i < n; i++) {
            float x = test_randf(&st);
            sc[i] = levels ? (float)(int)(x * levels) / levels : x * 100;
            unsigned r = test_rand(&st) % 97;
            if (r == 0)
                sc[i] = NAN;
            else if (r == 1)
                sc[i] = -INFINITY;
            else if (r == 2)
                sc[i] = INFINITY;
            else if (r == 3)
                sc[i] = -0.0f;
        }
        for (int i = 0; i < n; i++)
            idx[i] = i;
        cmp_score = sc;
        qsort(idx, (size_t)n, sizeof *idx, cmp_desc);
        int m = 0;
        static char picked[N];
        memset(picked, 0, (size_t)n);
        for (int i = 0; i < (k < n ? k : n); i++)
            picked[idx[i]] = 1;
        for (int i = n - local > 0 ? n - local : 0; i < n; i++)
            picked[i] = 1;
        for (int i = 0; i < n; i++)
            if (picked[i])
                want[m++] = i;
        int g = attn_topk(sc, n, k, local, got);
        qsort(want, (size_t)m, sizeof *want, cmp_int);
        trials++;
        bad += g != m || memcmp(got, want, (size_t)m * 4) != 0;
    }
    CHECK(bad == 0, "%d of %d selections differ from the sorted reference", bad, trials);
    for (int i = 0; i < 100; i++)
        sc[i] = (float)(i % 10);
    CHECK(attn_topk(sc, 100, 100, 0, got) == 100 && got[99] == 99, "n <= k selects all");
    CHECK(attn_topk(sc, 100, 10, 0, got) == 10 && got[0] == 9 && got[9] == 99, "ties to the lower cell");
}

/* ---- refusals ---- */

static void case_errors(struct pool *pool)
{
    if (!test_begin("attn/errors"))
        return;
    struct test_attn_data d;
    make_data(&d, 64, 2, 2, 100, 4, 50, 0, 7);
    struct kv *kv = test_attn_kv(&d, KV_CELL_F16, 16, 0, NULL);
    struct attn *a;
    char err[256] = "";
    if (!kv)
        return;
    CHECK(attn_new(&a, 6, 4, 64, 4, 2, err, sizeof err) != 0 && strstr(err, "evenly"), "'%s'", err);
    CHECK(attn_new(&a, 4, 2, 72, 4, 2, err, sizeof err) != 0 && strstr(err, "multiple of 16"), "'%s'", err);
    if (!CHECK(attn_new(&a, d.H, 2, 64, 2, pool_size(pool), err, sizeof err) == 0, "%s", err))
        return;
    float out[4 * 4 * 64];
    struct attn_job j = {kv, 0, 1, d.q, out, 4, 96, 0, 0, 0, d.sel, d.off};
    err[0] = 0;
    CHECK(attn_decode(a, pool, &j, err, sizeof err) != 0 && strstr(err, "window"), "'%s'", err);
    j.pos0 = 97;
    CHECK(attn_prompt(a, pool, &j, err, sizeof err) != 0 && strstr(err, "holds"), "'%s'", err);
    j.pos0 = 96;
    j.layer = 2;
    CHECK(attn_prompt(a, pool, &j, err, sizeof err) != 0 && strstr(err, "layer"), "'%s'", err);
    j.layer = 1;
    int32_t keep = d.sel[d.off[1] + 3];
    d.sel[d.off[1] + 3] = d.sel[d.off[1] + 2];
    CHECK(attn_qsa_prompt(a, pool, &j, err, sizeof err) != 0 && strstr(err, "ascending"), "'%s'", err);
    d.sel[d.off[1] + 3] = keep;
    int64_t o = d.off[1];
    d.off[1] = d.off[0];
    CHECK(attn_qsa_prompt(a, pool, &j, err, sizeof err) != 0 && strstr(err, "selects 0"), "'%s'", err);
    d.off[1] = o;
    CHECK(attn_qsa_prompt(a, pool, &j, err, sizeof err) == 0, "a good selection: %s", err);
    attn_free(a);
    CHECK(attn_new(&a, 8, 4, 64, 2, 1, err, sizeof err) == 0, "%s", err);
    CHECK(attn_prompt(a, pool, &j, err, sizeof err) != 0 && strstr(err, "kv heads"), "'%s'", err);
    attn_free(a);
    kv_free(kv);
    test_attn_free(&d);
}

/* ---- micro-benchmark: decode attention, not a test ---- */

static double now_s(void)
{
    struct timespec ts;
    clock_gettime(CLOCK_MONOTONIC, &ts);
    return ts.tv_sec + ts.tv_nsec * 1e-9;
}

/* One layer of decode attention for the Qwen3-0.6B shape (16 query heads,
 * 8 kv heads, E = 128) at 512, 4K and 32K cells, S = 1 against the split,
 * on the pool's threads. Prints ms per call and the KV bytes it streams. */
static void attn_bench(struct pool *pool)
{
    enum { E = 128, K = 8, H = 16 };
    const int ctx[3] = {512, 4096, 32768}, cells[3] = {KV_CELL_F16, KV_CELL_INT8, KV_CELL_Q4};
    char err[256];
    struct attn *a;
    if (!CHECK(attn_new(&a, H, K, E, 1, pool_size(pool), err, sizeof err) == 0, "%s", err))
        return;
    unsigned st = 1;
    float *q = malloc(H * E * 4), *out = malloc(H * E * 4);
    for (int i = 0; i < H * E; i++)
        q[i] = test_randf(&st);
    size_t rows = 4096;
    float *k = malloc(rows * K * E * 4);
    for (size_t i = 0; i < rows * K * E; i++)
        k[i] = test_randf(&st);
    printf("     decode attention, one layer, H=%d K=%d E=%d, %d threads (ms per call)\n", H, K, E,
           pool_size(pool));
    for (int f = 0; f < 3; f++)
        for (int c = 0; c < 3; c++) {
            struct kv_config cfg = {1, K, E, cells[f], 0, 1, ctx[c], 0, NULL};
            struct kv *kv;
            if (kv_new(&kv, &cfg, err, sizeof err) != 0)
                continue;
            int s = kv_seq_new(kv, err, sizeof err);
            for (int c0 = 0; c0 < ctx[c]; c0 += (int)rows) {
                int n = ctx[c] - c0 < (int)rows ? ctx[c] - c0 : (int)rows;
                kv_append(kv, s, NULL, n, err, sizeof err);
                kv_store(kv, s, 0, c0, n, k, k, err, sizeof err);
            }
            double best[2] = {1e9, 1e9};
            int S = attn_split(ctx[c], K, pool_size(pool));
            int splits[2] = {1, S > 1 ? S : 4};
            for (int rep = 0; rep < 5; rep++)
                for (int v = 0; v < 2; v++) {
                    struct attn_job j = {kv, 0, 0, q, out, 1, ctx[c] - 1, 0, 0, splits[v], NULL, NULL};
                    int iters = ctx[c] <= 4096 ? 20 : 3;
                    double t0 = now_s();
                    for (int it = 0; it < iters; it++)
                        attn_decode(a, pool, &j, err, sizeof err);
                    double dt = (now_s() - t0) / iters;
                    best[v] = dt < best[v] ? dt : best[v];
                }
            struct kv_stats ks;
            kv_stats(kv, &ks);
            double mb = (double)ks.cell_bytes * ctx[c] / 1e6;
            printf("     %-5s %6d cells  %7.1f MB  S=1 %8.3f ms (%5.1f GB/s)  S=%d %8.3f ms (%5.1f GB/s)\n",
                   kv_cell_name(cells[f]), ctx[c], mb, best[0] * 1e3, mb / 1e3 / best[0], splits[1],
                   best[1] * 1e3, mb / 1e3 / best[1]);
            kv_free(kv);
        }
    /* one kv head (MQA, MLA): the heads give one task, only the split feeds both threads */
    {
        struct attn *a1;
        struct kv_config cfg = {1, 1, E, KV_CELL_F16, 0, 1, 32768, 0, NULL};
        struct kv *kv;
        if (attn_new(&a1, 8, 1, E, 1, pool_size(pool), err, sizeof err) == 0 &&
            kv_new(&kv, &cfg, err, sizeof err) == 0) {
            int s = kv_seq_new(kv, err, sizeof err);
            kv_append(kv, s, NULL, 32768, err, sizeof err);
            for (int c0 = 0; c0 < 32768; c0 += (int)rows * K)
                kv_store(kv, s, 0, c0, (int)rows * K, k, k, err, sizeof err);
            int S = attn_split(32768, 1, pool_size(pool)), splits[2] = {1, S};
            double best[2] = {1e9, 1e9};
            for (int rep = 0; rep < 5; rep++)
                for (int v = 0; v < 2; v++) {
                    struct attn_job j = {kv, 0, 0, q, out, 1, 32767, 0, 0, splits[v], NULL, NULL};
                    double t0 = now_s();
                    for (int it = 0; it < 5; it++)
                        attn_decode(a1, pool, &j, err, sizeof err);
                    double dt = (now_s() - t0) / 5;
                    best[v] = dt < best[v] ? dt : best[v];
                }
            printf("     f16   32768 cells, H=8 K=1: S=1 %8.3f ms  S=%d %8.3f ms\n", best[0] * 1e3, S, best[1] * 1e3);
            kv_free(kv);
            attn_free(a1);
        }
    }
    /* prompt: a chunk of 512 queries after 0 and 3,584 earlier cells */
    float *qp = malloc((size_t)512 * H * E * 4), *op = malloc((size_t)512 * H * E * 4);
    for (size_t i = 0; i < (size_t)512 * H * E; i++)
        qp[i] = test_randf(&st);
    printf("     prompt attention, one layer, a chunk of 512 queries (ms per call, GFLOP/s)\n");
    for (int f = 0; f < 3; f++)
        for (int c = 0; c < 2; c++) {
            int n = c ? 4096 : 512;
            struct kv_config cfg = {1, K, E, cells[f], 0, 1, n, 0, NULL};
            struct kv *kv;
            if (kv_new(&kv, &cfg, err, sizeof err) != 0)
                continue;
            int s = kv_seq_new(kv, err, sizeof err);
            for (int c0 = 0; c0 < n; c0 += (int)rows) {
                int m = n - c0 < (int)rows ? n - c0 : (int)rows;
                kv_append(kv, s, NULL, m, err, sizeof err);
                kv_store(kv, s, 0, c0, m, k, k, err, sizeof err);
            }
            struct attn_job j = {kv, 0, 0, qp, op, 512, n - 512, 0, 0, 0, NULL, NULL};
            double best = 1e9;
            for (int rep = 0; rep < 3; rep++) {
                double t0 = now_s();
                attn_prompt(a, pool, &j, err, sizeof err);
                double dt = now_s() - t0;
                best = dt < best ? dt : best;
            }
            /* K·Q and P·V over the visible cells: 4·E flops per (query head, cell) */
            double flops = 4.0 * E * H * (512.0 * (n - 512) + 512.0 * 513 / 2);
            printf("     %-5s %5d cells  %8.2f ms  %6.1f GFLOP/s\n", kv_cell_name(cells[f]), n, best * 1e3,
                   flops / best / 1e9);
            kv_free(kv);
        }
    free(qp);
    free(op);
    free(q);
    free(out);
    free(k);
    attn_free(a);
}

void test_attn(void)
{
    struct pool *pool = pool_new(2);
    /* head dims 128/256, GQA 8:1/12:1, contexts 1,500/2,100; pages of
     * 32..128 cells, auto and forced splits */
    static const struct acfg fast[] = {
        {128, 8, 1, 1500, 256, 4, 64, 512, 64, 0, 1},
        {256, 12, 1, 2100, 64, 2, 64, 512, 64, 0, 1},
        {128, 12, 2, 2100, 48, 8, 32, 256, 32, 7, 1},
        {256, 8, 1, 1500, 32, 1, 128, 1024, 0, 3, 1},
        /* an odd group (rows of two queries share score tiles), pages of 16 */
        {64, 3, 2, 300, 40, 4, 16, 100, 8, 3, 1},
    };
    for (size_t i = 0; i < sizeof fast / sizeof *fast; i++)
        run_config(&fast[i], pool, 11 + (unsigned)i);
    if (test_slow()) {
        static const struct acfg slow = {128, 8, 1, 32768, 2048, 4, 64, 2048, 128, 0, 64};
        run_config(&slow, pool, 77);
    }
    case_qsa_edge(pool);
    case_f16_ref(pool);
    case_topk();
    case_errors(pool);
    const char *b = getenv("STRATA_BENCH");
    if (b && *b && strcmp(b, "0") != 0 && test_begin("attn/bench"))
        attn_bench(pool);
    pool_free(pool);
}
