/*
 * test_gpu.c — the GPU forward pass against the CPU path: each product kernel per
 * block format against FP64 (and quant.c's dot), gpu_kv_store byte for byte
 * against kv_store, and whole models GPU against CPU (the trained demo model
 * by perplexity and top-10 log-probabilities; random-weight models, a MoE
 * among them, teacher-forced). GPU builds only; without a device every case
 * is skipped. STRATA_GPU_BENCH=1 adds a timing of the Qwen3-8B shape at Q4_K
 * (synthesised into /tmp, 4.8 GB): pp512, tg128 (graph / no graph, f16 /
 * int8 KV) and per-stage profiles of one decode step and of prompts of 8,
 * 512 and 2048 tokens; STRATA_GPU_BENCH=moe
 * also the Qwen3-30B-A3B shape cut to 12 of its 48 layers;
 * STRATA_GPU_BENCH=mv times the decode matrix-vector kernels alone.
 */
#include "strata.h"
#include "test.h"

#include <math.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <time.h>

#ifdef STRATA_GPU
#include "gpu.h"

/* ---- matrix-vector kernels ---- */

/* The errors of a matrix-vector test's outputs, gathered by tg_check_dot */
struct tg_err {
    double worst, worst_cpu, rms;
    int n, bad, nonfinite;
};

/* the formats with gf_mvq_kernel's and gf_mvx_kernel's units (a batch
 * step's and a prompt's experts' products on tensor cores, widths of 256s) */
static int tg_mma_type(int type)
{
    static const int t[] = {QT_Q4_0, QT_Q4_1, QT_Q5_0, QT_Q5_1, QT_Q8_0, QT_Q2_K,
                            QT_Q3_K, QT_Q4_K, QT_Q5_K, QT_Q6_K, QT_IQ4_NL, QT_IQ4_XS,
                            QT_IQ2_XXS, QT_IQ2_XS, QT_IQ2_S, QT_IQ3_XXS, QT_IQ3_S};
    for (size_t i = 0; i < sizeof t / sizeof *t; i++)
        if (t[i] == type)
            return 1;
    return 0;
}

/* Output g of weight row wq (type, dequantised wr) against activation xt
 * (N wide; aq: xt in quant.c's activation type for qt->dot), into e: the
 * FP64 dot of the dequantised weights with the f32 activation (x, or
 * RMSNorm(x)·gw or silu(x)·u as the pass forms them; float weights: or
 * with aq's). The GPU quantises the activation per 32 values with
 * d = amax/127 stored as f16, so an element
 * moves by at most d/2 + 127·d·2^-11 < 0.57·amax/127; the bound is that
 * times Σ|w| per block, plus 1e-5·Σ|w·x| for f32 summation. quant.c's dot
 * (its own activation type: Q8_K blocks of 256 for K-quants, Q8_0/Q8_1
 * otherwise) is held to the sum of both bounds. */
static void tg_check_dot(const struct quant_type *qt, int type, const uint8_t *wq, const float *wr, const float *xt,
                         const void *aq, const float *amax, const float *amax256, int N, float g, struct tg_err *e)
{
    double ref = 0, mag = 0, bound = 0, bound_cpu = 0;
    for (int b = 0; b < N / 32; b++) {
        double sw = 0;
        for (int i = 32 * b; i < 32 * b + 32; i++) {
            ref += (double)wr[i] * xt[i];
            mag += fabs((double)wr[i] * xt[i]);
            sw += fabs(wr[i]);
        }
        if (!qt->dot_type || qt->blck == 1)
            continue;
        bound += sw * 0.57 * amax[b] / 127;
        bound_cpu += sw * 0.57 * (qt->blck == 256 ? amax256[b] : amax[b]) / 127;
    }
    bound += 1e-5 * mag + 1e-30;
    /* quant.c's float dots round the activation to the weight's type */
    bound_cpu += (type == QT_F16 ? 4.9e-4 : type == QT_BF16 ? 3.9e-3 : 1e-5) * mag;
    float cpu;
    qt->dot(N, &cpu, wq, aq);
    e->n++;
    if (!isfinite(g)) {
        e->nonfinite++;
        return;
    }
    double d = fabs(g - ref);
    if (type == QT_F16 || type == QT_BF16) {
        /* the one-row kernels meet float weights with the f32 activation,
         * the batched one (gf_mvh_kernel) with it rounded as quant.c rounds
         * it (aq, 16-bit): the FP64 dot of either activation, to the same bound */
        const uint16_t *xr = aq;
        double refr = 0;
        for (int i = 0; i < N; i++)
            refr += (double)wr[i] * (type == QT_F16 ? quant_f16_to_f32(xr[i]) : quant_bf16_to_f32(xr[i]));
        d = fmin(d, fabs(g - refr));
    }
    e->rms += d * d / (mag * mag + 1e-30);
    e->worst = fmax(e->worst, d / bound);
    e->worst_cpu = fmax(e->worst_cpu, fabs(g - cpu) / (bound + bound_cpu));
    e->bad += d > bound || fabs(g - cpu) > bound + bound_cpu;
}

/* tg_err's line and checks for one run */
static void tg_err_report(const struct quant_type *qt, int N, int T, const char *what, const struct tg_err *e)
{
    printf("  %-5s n=%-5d T=%-2d %-6s max err/bound vs FP64 %.3f, vs quant.c %.3f; RMS err/sum|wx| %.2e\n", qt->name,
           N, T, what, e->worst, e->worst_cpu, sqrt(e->rms / (e->n ? e->n : 1)));
    CHECK(e->nonfinite == 0, "%s T=%d %s: %d outputs not finite (unwritten rows stay NaN)", qt->name, T, what,
          e->nonfinite);
    CHECK(e->bad == 0, "%s T=%d %s: %d outputs past the bound (worst %.3f of it)", qt->name, T, what, e->bad,
          fmax(e->worst, e->worst_cpu));
}

#define TG_THREADS 16   /* the most threads tg_check_rows shares its rows among */

/* tg_check_rows' work, each thread's errors apart */
struct tg_rows {
    const struct quant_type *qt;
    int type, N, ROWS, shift;
    const uint8_t *w;
    size_t ldw;
    const float *wf, *xt, *y;
    const void *aq;
    float *amax, *amax256;   /* (N/32) each block's max |x|, and its 256's */
    struct tg_err e[TG_THREADS];
};

static void tg_rows_run(void *arg, int i, int n)
{
    struct tg_rows *t = arg;
    for (int r = i; r < t->ROWS; r += n) {
        size_t wr = (size_t)((r + t->shift) % t->ROWS);
        tg_check_dot(t->qt, t->type, t->w + wr * t->ldw, t->wf + wr * t->N, t->xt, t->aq, t->amax, t->amax256, t->N,
                     t->y[r], &t->e[i]);
    }
}

/* One activation row's outputs against ROWS weight rows (output r is row
 * (r + shift) % ROWS of w, wf), into e: the row's block maxima formed once,
 * the rows shared out among the threads of p (at most TG_THREADS: these
 * FP64 sums are the suite's longest host work), their errors then added. */
static void tg_check_rows(struct pool *p, const struct quant_type *qt, int type, const uint8_t *w, size_t ldw,
                          const float *wf, int N, int ROWS, int shift, const float *xt, const void *aq, const float *y,
                          struct tg_err *e)
{
    struct tg_rows t = {.qt = qt, .type = type, .N = N, .ROWS = ROWS, .shift = shift, .w = w, .ldw = ldw, .wf = wf,
                        .xt = xt, .y = y, .aq = aq, .amax = malloc(sizeof(float) * N / 32),
                        .amax256 = malloc(sizeof(float) * N / 32)};
    for (int b = 0; b < N / 32; b++) {
        float m = 0;
        for (int i = 32 * b; i < 32 * b + 32; i++)
            m = fmaxf(m, fabsf(xt[i]));
        t.amax[b] = m;
    }
    for (int b = 0; b < N / 32; b++) {
        float m = 0;
        for (int c = b / 8 * 8; c < b / 8 * 8 + 8 && c < N / 32; c++)
            m = fmaxf(m, t.amax[c]);
        t.amax256[b] = m;
    }
    pool_run(p, tg_rows_run, &t);
    for (int i = 0; i < pool_size(p); i++) {
        e->worst = fmax(e->worst, t.e[i].worst);
        e->worst_cpu = fmax(e->worst_cpu, t.e[i].worst_cpu);
        e->rms += t.e[i].rms;
        e->n += t.e[i].n, e->bad += t.e[i].bad, e->nonfinite += t.e[i].nonfinite;
    }
    free(t.amax), free(t.amax256);
}

/* the matrix-vector cases' pool (test_gpu's, the host's cores up to TG_THREADS) */
static struct pool *tg_rows_pool;

/* A prompt's MoE experts (gf_mvx_kernel; Q4_K and Q8_0 gf_mvxh_kernel, in f16)
 * against the same reference: X experts whose row r is the matrix's row
 * (r + 7e) % ROWS, over the sorted activation rows offs[e] .. offs[e+1] -
 * 1 of x (N wide) */
static void tg_experts_run(const struct quant_type *qt, int type, const uint8_t *w, const float *wf, size_t ldw, int N,
                           int ROWS, int X, const int32_t *offs, const float *x, void *aq, const char *what)
{
    const struct quant_type *at = quant_type(qt->dot_type);
    int P = offs[X];
    uint8_t *we = malloc(ldw * ROWS * X);
    float *y = malloc(sizeof(float) * ROWS * P);
    for (int e = 0; e < X; e++)
        for (int r = 0; r < ROWS; r++)
            memcpy(we + ((size_t)e * ROWS + r) * ldw, w + (size_t)((r + 7 * e) % ROWS) * ldw, ldw);
    char err[256];
    int rc = gpu_test_experts(type, we, ldw, N, ROWS, X, x, offs, y, err, sizeof err);
    if (rc > 0)
        printf("  %-5s n=%-5d %s: not on this device (%s)\n", qt->name, N, what, err);
    else if (CHECK(rc == 0, "%s", err)) {
        struct tg_err e = {0};
        for (int ex = 0; ex < X; ex++)
            for (int p = offs[ex]; p < offs[ex + 1]; p++) {
                at->from_f32(x + (size_t)p * N, aq, N);
                tg_check_rows(tg_rows_pool, qt, type, w, ldw, wf, N, ROWS, 7 * ex, x + (size_t)p * N, aq,
                              y + (size_t)p * ROWS, &e);
            }
        tg_err_report(qt, N, P, what, &e);
    }
    free(we), free(y);
}

static void tg_matvec_type(int type, int N, int ROWS)
{
    const struct quant_type *qt = quant_type(type);
    char name[128];
    snprintf(name, sizeof name, "gpu/matvec %s n=%d rows=%d vs FP64 and quant.c (bound: activation rounding)",
             qt->name, N, ROWS);
    if (!test_begin_gpu(name))
        return;
    enum { TMAX = 11 };
    unsigned seed = 1234u + (unsigned)type;
    size_t ldw = quant_row_bytes(type, N);
    uint8_t *w = malloc(ldw * ROWS);
    float *wf = malloc(sizeof(float) * N * ROWS), *x = malloc(sizeof(float) * N * TMAX);
    float *y = malloc(sizeof(float) * ROWS * TMAX);
    const struct quant_type *at = quant_type(qt->dot_type);
    void *aq = malloc(quant_row_bytes(qt->dot_type, N) + 64);
    for (int r = 0; r < ROWS; r++) {
        test_weight_row(type, w + (size_t)r * ldw, N, 0.5f + (r % 5), &seed);
        qt->to_f32(w + (size_t)r * ldw, wf + (size_t)r * N, N);
    }
    for (int t = 0; t < TMAX; t++)
        for (int i = 0; i < N; i++) /* blocks of different magnitudes, one all zero */
            x[(size_t)t * N + i] = (i / 32) % 7 == 3 ? 0.0f : test_randf(&seed) * (0.1f + (float)((i / 32) % 5));
    /* the activation as the pass forms it: x, RMSNorm(x)·gw, silu(x)·u */
    float *gw = malloc(sizeof(float) * N), *u = malloc(sizeof(float) * N * TMAX);
    float *act = malloc(sizeof(float) * N * TMAX);
    for (int i = 0; i < N; i++)
        gw[i] = 0.5f + test_randf(&seed) * 0.5f;
    for (int i = 0; i < N * TMAX; i++)
        u[i] = test_randf(&seed);
    /* T = 2 and TMAX: a batch step's products (gf_mvq_kernel for the
     * formats of tg_mma_type at widths of 256s, in both layouts of the
     * activation, Q4_0..Q5_1 and IQ4_NL through gf_mvqs_kernel's stage,
     * Q2_K, Q3_K, IQ2_XS and IQ3_S from 3 rows, IQ2_S from 4; one-row
     * groups or 8-row blocks for the others) */
    static const struct { int T, mode; const char *what; } runs[] = {
        {1, GPU_TEST_PLAIN, "x"},
        {2, GPU_TEST_PLAIN, "x"},
        {TMAX, GPU_TEST_PLAIN, "x"},
        {TMAX, GPU_TEST_PLAIN | GPU_TEST_ROWS, "x, rows in turn"},
        {1, GPU_TEST_NORM, "norm"},
        {1, GPU_TEST_SWIGLU, "swiglu"},
        {1, GPU_TEST_PLAIN | GPU_TEST_SHIFT8, "x, rows 8 bytes past 16-aligned"},
        {1, GPU_TEST_PLAIN | GPU_TEST_SHIFT4, "x, rows 4 bytes past 16-aligned"}};
    /* (the shifted rows: the staged kernel's Q4_1 and Q5_1 at widths of
     * 256s, which load a block pair as its alignment allows; no upload
     * leaves a matrix so) */
    int shifts = (type == QT_Q4_1 || type == QT_Q5_1) && N % 256 == 0;
    for (size_t k = 0; k < sizeof runs / sizeof *runs; k++) {
        if (!shifts && runs[k].mode & (GPU_TEST_SHIFT4 | GPU_TEST_SHIFT8))
            continue;
        int T = runs[k].T, mode = runs[k].mode & (GPU_TEST_NORM | GPU_TEST_SWIGLU);
        char err[256];
        for (int t = 0; t < T; t++) {
            const float *xt = x + (size_t)t * N;
            double ss = 0;
            for (int i = 0; i < N; i++)
                ss += (double)xt[i] * xt[i];
            float scale = 1.0f / sqrtf((float)(ss / N) + 1e-6f);
            for (int i = 0; i < N; i++) {
                float v = xt[i];
                act[(size_t)t * N + i] = mode == GPU_TEST_NORM     ? v * scale * gw[i]
                                         : mode == GPU_TEST_SWIGLU ? v / (1.0f + expf(-v)) * u[(size_t)t * N + i]
                                                                   : v;
            }
        }
        if (!CHECK(gpu_test_matvec(type, w, ldw, N, ROWS, x, T, runs[k].mode, mode == GPU_TEST_NORM ? gw : u, y, err,
                                   sizeof err) == 0, "%s", err))
            break;
        struct tg_err e = {0};
        for (int t = 0; t < T; t++) {
            const float *xt = act + (size_t)t * N;
            at->from_f32(xt, aq, N);
            tg_check_rows(tg_rows_pool, qt, type, w, ldw, wf, N, ROWS, 0, xt, aq, y + (size_t)t * ROWS, &e);
        }
        tg_err_report(qt, N, T, runs[k].what, &e);
    }
    /* a prompt's experts on tensor cores (tg_mma_type's formats at widths
     * of 256s): an expert without rows, one tile, two; 32-row tiles
     * (experts of 14 rows on average), then 16-row ones (4) */
    if (tg_mma_type(type) && N % 256 == 0) {
        static const int32_t offs3[] = {0, 0, 5, 40}, offs6[] = {0, 0, 3, 3, 20, 21, 24};
        float *xe = malloc(sizeof(float) * N * 40);
        for (int i = 0; i < N * 40; i++)
            xe[i] = (i % N / 32) % 7 == 3 ? 0.0f : test_randf(&seed) * (0.1f + (float)((i % N / 32) % 5));
        tg_experts_run(qt, type, w, wf, ldw, N, ROWS, 3, offs3, xe, aq, "experts, 32-row tiles");
        tg_experts_run(qt, type, w, wf, ldw, N, ROWS, 6, offs6, xe, aq, "experts, 16-row tiles");
        free(xe);
    }
    free(w), free(wf), free(x), free(y), free(aq), free(gw), free(u), free(act);
}

/* ---- gpu_kv_store against kv_store ---- */

static void tg_kv_store(void)
{
    if (!test_begin_gpu("gpu/kv_store byte-equal to kv_store for f32 f16 int8 q4 k8v4"))
        return;
    enum { L = 2, K = 2, E = 128, NC = 40 };
    unsigned seed = 99;
    float *k = malloc(sizeof(float) * NC * K * E), *v = malloc(sizeof(float) * NC * K * E);
    for (int i = 0; i < NC * K * E; i++) {
        k[i] = test_randf(&seed) * (1 + (i / E) % 7);
        v[i] = test_randf(&seed) * 0.01f;
    }
    for (int i = 0; i < E; i++) { /* a zero row, and rows whose extremes tie (±, twice) */
        k[i] = 0;
        v[E + i] = (i % 32 == 5 || i % 32 == 9) ? 0.5f : (i % 32 == 7 ? -0.5f : v[E + i]);
        k[2 * E + i] = (i % 32 == 3) ? -2.0f : (i % 32 == 20 ? 2.0f : k[2 * E + i]);
    }
    float *dk = gpu_test_alloc(sizeof(float) * NC * K * E), *dv = gpu_test_alloc(sizeof(float) * NC * K * E);
    int32_t *dmisc = gpu_test_alloc(sizeof(int32_t) * 64);
    gpu_test_copy(dk, k, sizeof(float) * NC * K * E, 0);
    gpu_test_copy(dv, v, sizeof(float) * NC * K * E, 0);
    for (int cell = 0; cell < KV_CELL_COUNT; cell++) {
        char err[256];
        struct kv_config cfg = {.n_layer = L, .n_head_kv = K, .head_dim = E, .cell = cell, .page_cells = 16,
                                .n_seq = 1, .n_ctx = 64};
        struct kv *hk = NULL, *gk = NULL;
        if (!CHECK(kv_new(&hk, &cfg, err, sizeof err) == 0, "host kv: %s", err))
            break;
        cfg.mem = gpu_kv_mem(NULL);
        if (!CHECK(kv_new(&gk, &cfg, err, sizeof err) == 0, "device kv: %s", err)) {
            kv_free(hk);
            break;
        }
        int hs = kv_seq_new(hk, err, sizeof err), gs = kv_seq_new(gk, err, sizeof err);
        CHECK(kv_append(hk, hs, NULL, NC, err, sizeof err) == 0, "%s", err);
        CHECK(kv_append(gk, gs, NULL, NC, err, sizeof err) == 0, "%s", err);
        CHECK(kv_store(hk, hs, 1, 0, NC, k, v, err, sizeof err) == 0, "%s", err);
        struct kv_layout hl, gl;
        kv_layout(hk, &hl);
        kv_layout(gk, &gl);
        struct gpu_kv d = {gl.data, gl.page_bytes, gl.kbytes, gl.vbytes, cell, L, K, E, gl.P, dmisc + 1};
        int32_t pos[2] = {0, 30};
        gpu_test_copy(dmisc + 1, kv_page_table(gk, gs), sizeof(int32_t) * 3, 0);
        /* two calls: cells 0..29, then 30..39 across a page boundary */
        gpu_test_copy(dmisc, &pos[0], 4, 0);
        int rc = gpu_kv_store(&d, 1, dmisc, 30, dk, dv, NULL, err, sizeof err);
        gpu_test_copy(dmisc + 40, &pos[1], 4, 0);
        if (!rc)
            rc = gpu_kv_store(&d, 1, dmisc + 40, NC - 30, dk + 30 * K * E, dv + 30 * K * E, NULL, err, sizeof err);
        CHECK(rc == 0, "gpu_kv_store: %s", err);
        uint8_t *got = malloc((size_t)gl.n_pages * gl.page_bytes);
        memset(got, 0, (size_t)gl.n_pages * gl.page_bytes);
        CHECK(gpu_test_copy(got, gl.data, (size_t)gl.n_pages * gl.page_bytes, 1) == 0, "copy back");
        int diff = 0;
        const int32_t *hpt = kv_page_table(hk, hs), *gpt = kv_page_table(gk, gs);
        for (int c = 0; c < NC; c++)
            for (int h = 0; h < K; h++) {
                size_t blk = ((size_t)1 * K + h) * hl.P * (hl.kbytes + hl.vbytes);
                size_t ko = blk + (size_t)(c % hl.P) * hl.kbytes;
                size_t vo = blk + (size_t)hl.P * hl.kbytes + (size_t)(c % hl.P) * hl.vbytes;
                const uint8_t *hp = hl.data + (size_t)hpt[c / hl.P] * hl.page_bytes;
                const uint8_t *gp = got + (size_t)gpt[c / gl.P] * gl.page_bytes;
                for (int kv2 = 0; kv2 < 2; kv2++) {
                    size_t o = kv2 ? vo : ko, nb = kv2 ? hl.vbytes : hl.kbytes;
                    if (memcmp(hp + o, gp + o, nb) == 0)
                        continue;
                    if (!diff++) { /* the first difference, for the log */
                        printf("  %s: cell %d head %d %s first bytes, kv_store vs gpu:", kv_cell_name(cell), c, h,
                               kv2 ? "V" : "K");
                        for (size_t b = 0; b < 20 && b < nb; b++)
                            printf(" %02x/%02x", hp[o + b], gp[o + b]);
                        printf("\n");
                    }
                }
            }
        printf("  %-5s %d of %d rows differ\n", kv_cell_name(cell), diff, 2 * NC * K);
        CHECK(diff == 0, "%s: %d rows differ from kv_store's", kv_cell_name(cell), diff);
        free(got);
        kv_free(gk);
        kv_free(hk);
    }
    gpu_test_free(dk), gpu_test_free(dv), gpu_test_free(dmisc);
    free(k), free(v);
}

/* ---- whole models ---- */

/* mean over ref's top-10 ids of |logprob(got) − logprob(ref)|; the log-sum-exps given */
static double tg_top10_diff(const float *ref, double lse_ref, const float *got, double lse_got, int V)
{
    int top[10], nt = 0;
    for (int i = 0; i < V; i++) { /* insertion into the sorted top (ties: the lower id first) */
        if (nt == 10 && !(ref[i] > ref[top[9]]))
            continue;
        int k = nt < 10 ? nt++ : 9;
        while (k > 0 && ref[i] > ref[top[k - 1]]) {
            top[k] = top[k - 1];
            k--;
        }
        top[k] = i;
    }
    double s = 0;
    for (int k = 0; k < nt; k++)
        s += fabs(((double)got[top[k]] - lse_got) - ((double)ref[top[k]] - lse_ref));
    return s / nt;
}

static int tg_argmax(const float *x, int V)
{
    int b = 0;
    for (int i = 1; i < V; i++)
        b = x[i] > x[b] ? i : b;
    return b;
}

struct tg_gpu {
    struct gpu_model *g;
    struct kv *kv;
    struct gpu_ctx *c;
    int seq;
};

static int tg_gpu_open(struct tg_gpu *t, struct model *m, int cell, int n_ctx, int max_tokens)
{
    char err[256];
    const struct model_hp *hp = model_hp(m);
    memset(t, 0, sizeof *t);
    if (!CHECK(gpu_model_new(&t->g, m, err, sizeof err) == 0, "gpu_model_new: %s", err))
        return -1;
    struct kv_config cfg = {.n_layer = hp->n_layer, .n_head_kv = hp->n_head_kv, .head_dim = hp->head_dim,
                            .cell = cell, .n_seq = 1, .n_ctx = n_ctx, .mem = gpu_kv_mem(t->g)};
    if (!CHECK(kv_new(&t->kv, &cfg, err, sizeof err) == 0, "kv_new: %s", err))
        return -1;
    t->seq = kv_seq_new(t->kv, err, sizeof err);
    return CHECK(t->seq >= 0, "kv_seq_new: %s", err) &&
           CHECK(gpu_ctx_new(&t->c, t->g, t->kv, max_tokens, err, sizeof err) == 0, "gpu_ctx_new: %s", err)
               ? 0 : -1;
}

static void tg_gpu_close(struct tg_gpu *t)   /* (again: nothing) */
{
    gpu_ctx_free(t->c);
    kv_free(t->kv);
    gpu_model_free(t->g);
    memset(t, 0, sizeof *t);
}

/* Evaluates ids[0..n) from an empty sequence: the first n_prompt as one
 * chunk (logits of all rows), the rest one token at a time (the decode
 * graph); lg (n, V). */
static int tg_gpu_run(struct tg_gpu *t, const int32_t *ids, int n, int n_prompt, float *lg, int V)
{
    char err[256];
    kv_truncate(t->kv, t->seq, kv_seq_len(t->kv, t->seq));
    if (n_prompt > 0 && (!CHECK(kv_append(t->kv, t->seq, ids, n_prompt, err, sizeof err) == 0, "%s", err) ||
                         !CHECK(gpu_eval(t->c, t->seq, ids, n_prompt, 0, lg, 1, err, sizeof err) == 0,
                                "gpu_eval: %s", err)))
        return -1;
    for (int i = n_prompt; i < n; i++)
        if (!CHECK(kv_append(t->kv, t->seq, ids + i, 1, err, sizeof err) == 0, "%s", err) ||
            !CHECK(gpu_eval(t->c, t->seq, ids + i, 1, i, lg + (size_t)i * V, 0, err, sizeof err) == 0,
                   "gpu_eval (decode): %s", err))
            return -1;
    return 0;
}

/* CPU logits (n, V) of ids as one evaluation; f32ref: the float-reference mode. */
static int tg_cpu_run(struct model *m, struct pool *pool, const int32_t *ids, int n, int f32ref, float *lg)
{
    char err[256];
    struct model_opts o = model_opts_default();
    o.n_ctx = n < 512 ? 512 : n;
    o.device = MODEL_DEV_CPU;
    o.f32ref = f32ref;
    o.kv_cell = f32ref ? KV_CELL_F32 : KV_CELL_F16;
    struct model_ctx *c = NULL;
    int ok = CHECK(model_ctx_new(&c, m, &o, pool, err, sizeof err) == 0, "model_ctx_new: %s", err) &&
             CHECK(model_eval(c, 0, ids, n, 0, lg, 1, err, sizeof err) == 0, "model_eval: %s", err);
    model_ctx_free(c);
    return ok ? 0 : -1;
}

static struct pool *tg_pool(void)
{
    return pool_new(8);
}

/* The demo model: perplexity of demo/heldout.txt in 256-token windows (as
 * test_demo.c: BOS first, the first half only fills the cache, the second
 * scored), the GPU's prompt path against the CPU; the decode path over the
 * scored half of the first windows; mean |Δ logprob| over the CPU's top-10. */
static void tg_demo(void)
{
    if (!test_begin_gpu("gpu/demo model GPU vs CPU: NLL within 0.2%, top-10 |dlogprob| <= 0.02"))
        return;
    char err[256];
    struct model *m = NULL;
    struct tg_gpu t = {0};
    struct pool *pool = tg_pool();
    int32_t *ids = NULL;
    float *lc = NULL, *lgp = NULL;
    char *text = NULL;
    if (!CHECK(model_load(&m, "demo/strata-demo-Q8_0.gguf", err, sizeof err) == 0, "%s", err))
        goto done;
    size_t len = 0;
    text = test_read_file("demo/heldout.txt", &len);
    int n = 0, V = model_hp(m)->n_vocab, W = 256, first = W / 2;
    ids = tok_encode(model_tok(m), text, len, 1, 0, &n, err, sizeof err);
    if (!CHECK(ids, "tokenize: %s", err) || tg_gpu_open(&t, m, KV_CELL_F16, 512, 256) != 0)
        goto done;
    lc = malloc(sizeof(float) * W * V);
    lgp = malloc(sizeof(float) * W * V);
    double nll_c = 0, nll_g = 0, dsum = 0, dmax = 0, dsum_dec = 0;
    int scored = 0, nd = 0, nd_dec = 0, agree = 0;
    int chunks = n / W;
    for (int ch = 0; ch < chunks; ch++) {
        int32_t *w = ids + (size_t)ch * W;
        w[0] = tok_bos(model_tok(m));
        if (tg_cpu_run(m, pool, w, W, 0, lc) != 0 || tg_gpu_run(&t, w, W, W, lgp, V) != 0)
            goto done;
        for (int j = first; j < W - 1; j++, scored++) {
            const float *a = lc + (size_t)j * V, *b = lgp + (size_t)j * V;
            double la = test_lse(a, V), lb = test_lse(b, V);
            nll_c -= a[w[j + 1]] - la;
            nll_g -= b[w[j + 1]] - lb;
            double d = tg_top10_diff(a, la, b, lb, V);
            dsum += d, nd++;
            dmax = d > dmax ? d : dmax;
        }
        if (ch < 4) { /* the decode path: the second half one token at a time */
            if (tg_gpu_run(&t, w, W, first, lgp, V) != 0)
                goto done;
            for (int j = first; j < W; j++) {
                const float *a = lc + (size_t)j * V, *b = lgp + (size_t)j * V;
                dsum_dec += tg_top10_diff(a, test_lse(a, V), b, test_lse(b, V), V), nd_dec++;
                agree += tg_argmax(a, V) == tg_argmax(b, V);
            }
        }
    }
    double rel = nll_g / nll_c - 1;
    printf("  demo: %d windows, %d scored: mean NLL cpu %.5f gpu %.5f (rel %+.4f%%); top-10 |dlp| prompt mean %.5f "
           "max %.5f; decode mean %.5f, argmax agree %d/%d\n", chunks, scored, nll_c / scored, nll_g / scored,
           100 * rel, dsum / nd, dmax, dsum_dec / nd_dec, agree, nd_dec);
    CHECK(scored > 0 && fabs(rel) <= 0.002, "mean NLL %.5f vs CPU %.5f: %.3f%% apart (bound 0.2%%)", nll_g / scored,
          nll_c / scored, 100 * rel);
    CHECK(dsum / nd <= 0.02, "prompt: mean top-10 |dlogprob| %.5f > 0.02", dsum / nd);
    CHECK(dsum_dec / nd_dec <= 0.02, "decode: mean top-10 |dlogprob| %.5f > 0.02", dsum_dec / nd_dec);
    /* the other cell formats: the same windows' perplexity, printed, and finite */
    for (int cell = KV_CELL_INT8; cell <= KV_CELL_K8V4; cell++) {
        struct tg_gpu t2;
        if (tg_gpu_open(&t2, m, cell, 512, 256) != 0) {
            tg_gpu_close(&t2);
            break;
        }
        double nll = 0;
        int sc = 0;
        for (int ch = 0; ch < chunks && ch < 8; ch++) {
            int32_t *w = ids + (size_t)ch * W;
            if (tg_gpu_run(&t2, w, W, first, lgp, V) != 0)
                break;
            for (int j = first; j < W - 1; j++, sc++)
                nll -= lgp[(size_t)j * V + w[j + 1]] - test_lse(lgp + (size_t)j * V, V);
        }
        printf("  demo decode with %s KV: mean NLL %.5f over %d\n", kv_cell_name(cell), nll / sc, sc);
        CHECK(sc > 0 && isfinite(nll), "%s KV: NLL not finite", kv_cell_name(cell));
        tg_gpu_close(&t2);
    }
done:
    tg_gpu_close(&t);
    free(lc), free(lgp), free(ids), free(text);
    model_free(m);
    pool_free(pool);
}

/* Decode of several sequences in one pass (gpu_eval_batch): the demo model
 * (trained, so the parity rule's bound of 0.02 holds), four sequences from
 * different places of demo/heldout.txt with prompts of 5 to 90 tokens (one
 * chunk each), then 24 steps of all four together, teacher-forced: the
 * first step captures the graph of four rows, the others replay it at new
 * positions, across pages. Each row against the CPU's logits for its own
 * sequence, mean top-10 |Δ logprob|, with attention in one call for the
 * four (where the kernel takes it) and a call a row (STRATA_GPU_BATCH_ROWS=1);
 * a sequence named twice is refused. */
enum { TB_NS = 4, TB_STEPS = 24 };
static const int tb_plen[TB_NS] = {37, 90, 5, 61};

/* The four sequences' prompts, then the steps; lg (STEPS, NS, V). */
static int tb_run(struct model *m, const int32_t *const *sid, float *lg)
{
    char err[256];
    const struct model_hp *hp = model_hp(m);
    struct tg_gpu t = {0};
    int ok = CHECK(gpu_model_new(&t.g, m, err, sizeof err) == 0, "gpu_model_new: %s", err);
    struct kv_config cfg = {.n_layer = hp->n_layer, .n_head_kv = hp->n_head_kv, .head_dim = hp->head_dim,
                            .cell = KV_CELL_F16, .n_seq = TB_NS, .n_ctx = 256, .mem = ok ? gpu_kv_mem(t.g) : NULL};
    ok = ok && CHECK(kv_new(&t.kv, &cfg, err, sizeof err) == 0, "kv_new: %s", err) &&
         CHECK(gpu_ctx_new(&t.c, t.g, t.kv, 128, err, sizeof err) == 0, "gpu_ctx_new: %s", err);
    int seqs[TB_NS];
    for (int i = 0; ok && i < TB_NS; i++) {
        seqs[i] = kv_seq_new(t.kv, err, sizeof err);
        ok = CHECK(seqs[i] >= 0, "kv_seq_new: %s", err) &&
             CHECK(kv_append(t.kv, seqs[i], sid[i], tb_plen[i], err, sizeof err) == 0, "%s", err) &&
             CHECK(gpu_eval(t.c, seqs[i], sid[i], tb_plen[i], 0, NULL, 0, err, sizeof err) == 0, "prompt: %s", err);
    }
    for (int s = 0; ok && s < TB_STEPS; s++) {
        int32_t tok[TB_NS];
        for (int i = 0; ok && i < TB_NS; i++) {
            tok[i] = sid[i][tb_plen[i] + s];
            ok = CHECK(kv_append(t.kv, seqs[i], tok + i, 1, err, sizeof err) == 0, "%s", err);
        }
        ok = ok && CHECK(gpu_eval_batch(t.c, seqs, tok, TB_NS, lg + (size_t)s * TB_NS * hp->n_vocab, err,
                                        sizeof err) == 0, "gpu_eval_batch: %s", err);
    }
    if (ok) {
        int twice[2] = {seqs[0], seqs[0]};
        err[0] = 0;
        CHECK(gpu_eval_batch(t.c, twice, sid[0], 2, lg, err, sizeof err) != 0 && strstr(err, "twice"),
              "a sequence named twice: got \"%s\"", err);
    }
    tg_gpu_close(&t);
    return ok ? 0 : -1;
}

static void tg_batch(void)
{
    if (!test_begin_gpu("gpu/batch decode of 4 sequences in one pass vs CPU: top-10 |dlogprob| <= 0.02"))
        return;
    char err[256];
    struct model *m = NULL;
    struct pool *pool = tg_pool();
    int32_t *ids = NULL;
    char *text = NULL;
    float *lg[2] = {NULL, NULL}, *lc = NULL;
    size_t len = 0;
    int n = 0;
    if (!CHECK(model_load(&m, "demo/strata-demo-Q8_0.gguf", err, sizeof err) == 0, "%s", err))
        goto done;
    int V = model_hp(m)->n_vocab;
    text = test_read_file("demo/heldout.txt", &len);
    ids = tok_encode(model_tok(m), text, len, 1, 0, &n, err, sizeof err);
    if (!CHECK(ids && n >= 400 * TB_NS, "tokenize: %s (%d tokens)", err, n))
        goto done;
    const int32_t *sid[TB_NS];
    for (int i = 0; i < TB_NS; i++)
        sid[i] = ids + 400 * i;
    for (int rows = 0; rows < 2; rows++) {
        lg[rows] = malloc(sizeof(float) * TB_STEPS * TB_NS * V);
        if (rows)
            setenv("STRATA_GPU_BATCH_ROWS", "1", 1);
        int rc = tb_run(m, sid, lg[rows]);
        unsetenv("STRATA_GPU_BATCH_ROWS");
        if (rc)
            goto done;
    }
    lc = malloc(sizeof(float) * (tb_plen[1] + TB_STEPS) * V);
    double dsum[2] = {0, 0}, dmode = 0;
    int agree = 0, nonfinite = 0;
    for (int i = 0; i < TB_NS; i++) {
        if (tg_cpu_run(m, pool, sid[i], tb_plen[i] + TB_STEPS, 0, lc) != 0)
            goto done;
        for (int s = 0; s < TB_STEPS; s++) {
            const float *a = lc + (size_t)(tb_plen[i] + s) * V;
            double la = test_lse(a, V);
            for (int rows = 0; rows < 2; rows++) {
                const float *b = lg[rows] + ((size_t)s * TB_NS + i) * V;
                for (int j = 0; j < V; j++)
                    nonfinite += !isfinite(b[j]);
                dsum[rows] += tg_top10_diff(a, la, b, test_lse(b, V), V);
                agree += !rows && tg_argmax(a, V) == tg_argmax(b, V);
            }
            for (int j = 0; j < V; j++)
                dmode = fmax(dmode, fabs((double)lg[0][((size_t)s * TB_NS + i) * V + j] -
                                         lg[1][((size_t)s * TB_NS + i) * V + j]));
        }
    }
    int N = TB_NS * TB_STEPS;
    printf("  %d sequences x %d steps in one pass each: top-10 |dlp| vs CPU mean %.5f (attention in one call), "
           "%.5f (a call a row), max |d| between the two %.2g; argmax agree %d/%d\n", TB_NS, TB_STEPS,
           dsum[0] / N, dsum[1] / N, dmode, agree, N);
    CHECK(nonfinite == 0, "%d logits not finite", nonfinite);
    CHECK(dsum[0] / N <= 0.02 && dsum[1] / N <= 0.02, "mean top-10 |dlogprob| %.5f / %.5f > 0.02", dsum[0] / N,
          dsum[1] / N);
done:
    free(lg[0]), free(lg[1]), free(lc), free(ids), free(text);
    model_free(m);
    pool_free(pool);
}

/* A random-weight model, teacher-forced on 96 fixed ids (BOS first): the
 * first np as a prompt (up to 16 take the decode kernels), the rest decoded
 * one by one. Random weights amplify every rounding difference
 * (../shared/testdata/README.md: the reference's two numerics differ by ~1
 * logit), so the bound is calibrated on the model:
 * the GPU (int8 activations per 32 values, f16 KV) must be no further from
 * the CPU than 1.5x the distance between the CPU and its own float
 * reference mode (plus 0.05), in mean |Δ logprob| over the CPU's top-10. */
static void tg_random_model(const char *label, const char *path, int np)
{
    char err[256];
    struct model *m = NULL;
    struct tg_gpu t = {0};
    struct pool *pool = tg_pool();
    float *lc = NULL, *lf = NULL, *lgp = NULL;
    enum { N = 96 };
    if (!CHECK(model_load(&m, path, err, sizeof err) == 0, "%s: %s", path, err))
        goto done;
    int V = model_hp(m)->n_vocab;
    int32_t ids[N];
    unsigned seed = 7;
    const struct tok *tk = model_tok(m);
    for (int i = 0; i < N; i++)
        ids[i] = (int32_t)(test_rand(&seed) % (unsigned)(V < 5000 ? V : 5000));
    if (tk && tok_bos(tk) >= 0)
        ids[0] = tok_bos(tk);
    lc = malloc(sizeof(float) * N * V), lf = malloc(sizeof(float) * N * V), lgp = malloc(sizeof(float) * N * V);
    if (tg_cpu_run(m, pool, ids, N, 0, lc) || tg_cpu_run(m, pool, ids, N, 1, lf) ||
        tg_gpu_open(&t, m, KV_CELL_F16, 512, 64) || tg_gpu_run(&t, ids, N, np, lgp, V))
        goto done;
    double dg = 0, df = 0, dgp = 0, dgd = 0;
    int agree = 0, nonfinite = 0;
    for (int i = 0; i < N; i++) {
        const float *a = lc + (size_t)i * V, *b = lgp + (size_t)i * V;
        for (int j = 0; j < V; j++)
            nonfinite += !isfinite(b[j]);
        double la = test_lse(a, V), d = tg_top10_diff(a, la, b, test_lse(b, V), V);
        dg += d;
        if (i < np)
            dgp += d;
        else
            dgd += d;
        df += tg_top10_diff(a, la, lf + (size_t)i * V, test_lse(lf + (size_t)i * V, V), V);
        agree += tg_argmax(a, V) == tg_argmax(b, V);
    }
    dg /= N, df /= N;
    double bound = 1.5 * df + 0.05;
    printf("  %s: top-10 |dlp| GPU vs CPU %.4f (prompt of %d %.4f, decode %.4f), CPU f32ref vs CPU %.4f, bound "
           "%.4f; argmax agree %d/%d\n", label, dg, np, dgp / np, dgd / (N - np), df, bound, agree, N);
    CHECK(nonfinite == 0, "%d logits not finite", nonfinite);
    CHECK(dg <= bound, "GPU vs CPU %.4f > bound %.4f", dg, bound);
done:
    tg_gpu_close(&t);
    free(lc), free(lf), free(lgp);
    model_free(m);
    pool_free(pool);
}

static void tg_testdata(const char *file)
{
    char path[512], label[96];
    snprintf(label, sizeof label, "%s", file);
    char name[256];
    snprintf(name, sizeof name, "gpu/%s GPU vs CPU teacher-forced (bound: 1.5x CPU vs f32ref + 0.05)", label);
    if (!test_begin_gpu(name) || !test_data(file, path, sizeof path))
        return;
    tg_random_model(label, path, 48);
}

/* Decode logits on fresh contexts, after a prompt of np tokens, with and
 * without the switch env: equal bit for bit where the switch's path must
 * compute the same sums in the same order (same), else not equal (the path
 * ran: its sums differ in rounding; each path's distance from the CPU is
 * tg_random_model's check). */
static void tg_same_or_not(const char *label, const char *path, const char *env, int same, int np)
{
    char err[256];
    struct model *m = NULL;
    struct tg_gpu t = {0};
    enum { N = 40 };
    int chunk = np > 16 ? np : 16;
    if (!CHECK(model_load(&m, path, err, sizeof err) == 0, "%s: %s", path, err))
        return;
    int V = model_hp(m)->n_vocab;
    int32_t ids[N];
    unsigned seed = 11;
    for (int i = 0; i < N; i++)
        ids[i] = (int32_t)(test_rand(&seed) % (unsigned)V);
    float *a = malloc(sizeof(float) * N * V), *b = malloc(sizeof(float) * N * V);
    int rc = tg_gpu_open(&t, m, KV_CELL_F16, 64, chunk) || tg_gpu_run(&t, ids, N, np, a, V);
    tg_gpu_close(&t);
    setenv(env, "1", 1);
    rc = rc || tg_gpu_open(&t, m, KV_CELL_F16, 64, chunk) || tg_gpu_run(&t, ids, N, np, b, V);
    unsetenv(env);
    if (!rc) {
        int differ = 0, nonfinite = 0;
        double worst = 0;
        for (size_t i = (size_t)np * V; i < (size_t)N * V; i++) {
            differ += a[i] != b[i];
            nonfinite += !isfinite(a[i]);
            worst = fmax(worst, fabs((double)a[i] - b[i]));
        }
        printf("  %s: decode logits against %s=1: %d of %d differ (max |d| %.3g)\n", label, env, differ,
               (N - np) * V, worst);
        CHECK(nonfinite == 0, "%d not finite", nonfinite);
        CHECK(same ? differ == 0 : differ > 0, "%d differ", differ);
    }
    tg_gpu_close(&t);
    free(a), free(b);
    model_free(m);
}

static void tg_same(const char *label, const char *path, const char *env)
{
    tg_same_or_not(label, path, env, 1, 8);
}

/* Logits the head writes straight into the pinned rows the host reads
 * (one row; a batch step's rows), read in place (model_ctx_logits,
 * model_ctx_batch_logits), against a context that copies them back after
 * the step (STRATA_GPU_COPY_LOGITS=1) into rows of the caller's: the same
 * kernels' values, so bit for bit, step by step (never a stale row). */
static void tg_logits_row(void)
{
    char path[512], err[256];
    if (!test_begin_gpu("gpu/logits rows written in place by the head = copied back, bit for bit") ||
        !test_data("tiny-qwen3-Q4_K_M.gguf", path, sizeof path))
        return;
    enum { NS = 3, STEPS = 4 };
    struct model *m = NULL;
    struct model_ctx *c[2] = {NULL, NULL};
    float *own = NULL;
    if (!CHECK(model_load(&m, path, err, sizeof err) == 0, "%s", err))
        return;
    int V = model_hp(m)->n_vocab, rows = 0;
    struct model_opts o = model_opts_default();
    o.n_ctx = 64, o.n_seq = NS, o.device = MODEL_DEV_GPU;
    own = malloc(sizeof(float) * NS * V);
    setenv("STRATA_GPU_COPY_LOGITS", "1", 1);
    int ok = CHECK(model_ctx_new(&c[0], m, &o, NULL, err, sizeof err) == 0, "model_ctx_new: %s", err);
    unsetenv("STRATA_GPU_COPY_LOGITS");
    ok = ok && CHECK(model_ctx_new(&c[1], m, &o, NULL, err, sizeof err) == 0, "model_ctx_new: %s", err);
    float *row = ok ? model_ctx_logits(c[1]) : NULL, *brows = ok ? model_ctx_batch_logits(c[1], &rows) : NULL;
    ok = ok && CHECK(row && brows && rows >= NS, "the context's rows: %d", rows);
    int32_t ids[NS][16];
    unsigned seed = 5;
    for (int i = 0; i < NS; i++)
        for (int j = 0; j < 16; j++)
            ids[i][j] = (int32_t)(test_rand(&seed) % (unsigned)V);
    int differ = 0, seqs[NS] = {0};
    /* each sequence: a prompt of 8, then (sequence 0) one-row steps */
    for (int i = 0; ok && i < NS; i++)
        for (int st = 0; ok && st < (i ? 1 : 1 + STEPS); st++)
            for (int k = 0; ok && k < 2; k++) {
                if (i && !st && (seqs[i] = kv_seq_new(model_kv(c[k]), err, sizeof err)) < 0)
                    ok = CHECK(0, "kv_seq_new: %s", err);
                int n = st ? 1 : 8, pos = st ? 7 + st : 0;
                ok = ok && CHECK(model_eval(c[k], seqs[i], ids[i] + pos, n, pos, k ? row : own, 0, err,
                                            sizeof err) == 0, "eval: %s", err);
                differ += ok && k && memcmp(own, row, sizeof(float) * V) != 0;
            }
    CHECK(differ == 0, "%d one-row evaluations differ between the context's row and the caller's", differ);
    /* then all NS a step, each at its own end */
    differ = 0;
    for (int st = 0; ok && st < STEPS; st++) {
        int32_t tok[NS];
        for (int i = 0; i < NS; i++)
            tok[i] = ids[i][(st + 3 * i) % 16];
        for (int k = 0; ok && k < 2; k++)
            ok = CHECK(model_decode_batch(c[k], seqs, tok, NS, k ? brows : own, err, sizeof err) == 0,
                       "batch: %s", err);
        differ += ok && memcmp(own, brows, sizeof(float) * NS * V) != 0;
    }
    CHECK(differ == 0, "%d of %d batch steps differ between the context's rows and the caller's", differ, STEPS);
    /* more sequences than the rows hold: refused before anything runs */
    int32_t many[17] = {0};
    int sq[17] = {0};
    err[0] = 0;
    CHECK(!ok || rows > 16 ||
              (model_decode_batch(c[1], sq, many, rows + 1, brows, err, sizeof err) != 0 &&
               strstr(err, "rows of logits")),
          "a batch past the context's rows: got \"%s\"", err);
    for (int i = 0; i < 2; i++)
        model_ctx_free(c[i]);
    free(own);
    model_free(m);
}

/* A small qwen3moe written by synth (F32 router, the experts of `type`),
 * n_embd wide, experts n_ff_exp wide: the decode step's experts side by
 * side take the Q4_K kernel (Q4_K) or the staged one (Q6_K, Q8_0: a run of
 * the staged rows an expert, one superblock long at 256 columns, three at
 * 768, ten at 2560, a warp's runs cut at its slice's ends), handing the
 * next norm on; the Q8_0 gate/up stacks at 2304 take gf_mvs_kernel; a
 * 48-token prompt's experts take gf_mvxh_kernel (Q4_K) or gf_mvx_kernel
 * (Q6_K, Q8_0; checked against gpu_gemm's path too) or gpu_gemm. Returns
 * its path, or NULL. */
static const char *tg_moe_model(const char *type, const char *n_embd, const char *n_ff_exp)
{
    static char path[64];
    char err[256], label[64];
    snprintf(path, sizeof path, "/tmp/strata-test-gpu-moe-%s.gguf", type);
    snprintf(label, sizeof label, "qwen3moe-synth-%s n_embd=%s n_ff_exp=%s", type, n_embd + 7, n_ff_exp + 9);
    char *argv[] = {"synth", "--arch", "qwen3moe", "--set", (char *)n_embd, "--set", "n_layer=3", "--set",
                    "n_head=4", "--set", "n_head_kv=2", "--set", "head_dim=64", "--set", "n_ff=768",
                    "--set", "n_expert=16", "--set", "n_expert_used=4", "--set", (char *)n_ff_exp, "--set",
                    "n_vocab=2000", "--type", (char *)type, "-o", path};
    if (!CHECK(synth_main((int)(sizeof argv / sizeof argv[0]), argv, err, sizeof err) == 0, "synth: %s", err))
        return NULL;
    tg_random_model(label, path, 48);
    /* the formats of gf_mvx_kernel: the prompt's experts through gpu_gemm
     * instead, as close to the CPU, and another path (the decode's logits
     * after a 24-token prompt differ) */
    if (!strcmp(type, "Q4_K") || !strcmp(type, "Q6_K") || !strcmp(type, "Q8_0")) {
        char gemm[96];
        snprintf(gemm, sizeof gemm, "%s, STRATA_GPU_MOE_GEMM=1", label);
        setenv("STRATA_GPU_MOE_GEMM", "1", 1);
        tg_random_model(gemm, path, 48);
        unsetenv("STRATA_GPU_MOE_GEMM");
        tg_same_or_not(label, path, "STRATA_GPU_MOE_GEMM", 0, 24);
    }
    return path;
}

static void tg_moe(void)
{
    char err[256];
    if (!test_begin_gpu("gpu/qwen3moe GPU vs CPU teacher-forced, Q4_K, Q6_K and Q8_0 experts (bound: 1.5x CPU vs "
                        "f32ref + 0.05)"))
        return;
    const char *path = tg_moe_model("Q6_K", "n_embd=256", "n_ff_exp=768");
    if (path)
        remove(path);
    /* four experts of 2560 side by side: two units a lane, three slices, a
     * stage of exactly 48 KB (the shape of a Qwen3-235B-A22B's experts' down) */
    if ((path = tg_moe_model("Q6_K", "n_embd=256", "n_ff_exp=2560")) != NULL)
        remove(path);
    if ((path = tg_moe_model("Q8_0", "n_embd=2304", "n_ff_exp=256")) != NULL) {
        /* the norm and router kernel: the two kernels' logits */
        tg_same("qwen3moe-synth-Q8_0 n_embd=2304", path, "STRATA_GPU_NO_NORM_ROUTER");
        remove(path);
    }
    if ((path = tg_moe_model("Q4_K", "n_embd=256", "n_ff_exp=256")) == NULL)
        return;
    tg_same("qwen3moe-synth-Q4_K n_embd=256", path, "STRATA_GPU_NO_NORM_ROUTER");
    /* its experts' down in pairs of blocks (sm_90), as one block a group */
    tg_same("qwen3moe-synth-Q4_K n_embd=256", path, "STRATA_GPU_NO_PAIRS");
    /* a 12-token prompt: the decode kernels with T = 12 */
    tg_random_model("qwen3moe-synth-Q4_K n_embd=256", path, 12);
    /* a prompt chunk whose T·U expert groups exceed one launch: a clear error naming the option */
    struct model *m = NULL;
    struct tg_gpu t = {0};
    if (CHECK(model_load(&m, path, err, sizeof err) == 0, "%s", err) &&
        CHECK(gpu_model_new(&t.g, m, err, sizeof err) == 0, "gpu_model_new: %s", err)) {
        struct kv_config cfg = {.n_layer = 3, .n_head_kv = 2, .head_dim = 64, .cell = KV_CELL_F16, .n_seq = 1,
                                .n_ctx = 64, .mem = gpu_kv_mem(t.g)};
        if (CHECK(kv_new(&t.kv, &cfg, err, sizeof err) == 0, "kv_new: %s", err)) {
            err[0] = 0;
            CHECK(gpu_ctx_new(&t.c, t.g, t.kv, 65535 / 4 + 1, err, sizeof err) != 0 &&
                      strstr(err, "--prefill-chunk 16383") != NULL,
                  "16,384-token chunks x 4 experts: got \"%s\"", err);
        }
    }
    tg_gpu_close(&t);
    model_free(m);
    remove(path);
}

/* ---- timing (STRATA_GPU_BENCH=1) ---- */

static double tg_now(void)
{
    struct timespec ts;
    clock_gettime(CLOCK_MONOTONIC, &ts);
    return ts.tv_sec + ts.tv_nsec * 1e-9;
}

/* tg128 after a 16-token prompt on a fresh context (the environment as
 * set now: STRATA_GPU_NO_GRAPH); the median of 3. */
static double tg_bench_tg(struct gpu_model *g, const struct model_hp *hp, int cell, const int32_t *ids, float *lg)
{
    char err[256];
    struct kv *kv = NULL;
    struct gpu_ctx *c = NULL;
    struct kv_config cfg = {.n_layer = hp->n_layer, .n_head_kv = hp->n_head_kv, .head_dim = hp->head_dim,
                            .cell = cell, .n_seq = 1, .n_ctx = 1024, .mem = gpu_kv_mem(g)};
    double reps[3] = {0, 0, 0}, med = -1;
    int seq;
    if (!CHECK(kv_new(&kv, &cfg, err, sizeof err) == 0, "kv_new: %s", err) ||
        !CHECK((seq = kv_seq_new(kv, err, sizeof err)) >= 0, "%s", err) ||
        !CHECK(gpu_ctx_new(&c, g, kv, 512, err, sizeof err) == 0, "gpu_ctx_new: %s", err))
        goto done;
    for (int rep = 0; rep < 3; rep++) {
        kv_truncate(kv, seq, kv_seq_len(kv, seq));
        if (!CHECK(kv_append(kv, seq, ids, 16, err, sizeof err) == 0, "%s", err) ||
            !CHECK(gpu_eval(c, seq, ids, 16, 0, lg, 0, err, sizeof err) == 0, "%s", err))
            goto done;
        double t0 = tg_now();
        for (int i = 16; i < 16 + 128; i++)
            if (!CHECK(kv_append(kv, seq, ids + i, 1, err, sizeof err) == 0, "%s", err) ||
                !CHECK(gpu_eval(c, seq, ids + i, 1, i, lg, 0, err, sizeof err) == 0, "%s", err))
                goto done;
        reps[rep] = tg_now() - t0;
    }
    double a = reps[0], b = reps[1], d = reps[2];
    med = a > b ? (b > d ? b : (a > d ? d : a)) : (a > d ? a : (b > d ? d : b));
done:
    gpu_ctx_free(c);
    kv_free(kv);
    return med > 0 ? 128 / med : -1;
}

/* STRATA_GPU_BENCH=mv: the decode matrix-vector kernels alone on the
 * Qwen3-8B shapes (gate+up as one matrix of 2 x 12288 rows, down, Q+K+V,
 * wo, the head) and Qwen3-30B-A3B's expert and attention shapes, the
 * current kernels against STRATA_GPU_MV_OLD=1: with one activation row
 * (decode: gf_mvk_kernel against the staged kernel) and with 2..16 (a step
 * of that many sequences: gf_mvq_kernel against gf_mv_kernel); then the
 * Q6_K matrices of a Q4_K_M file (attn_v, ffn_down and the head of half the
 * layers, `strata synth --type q4_k_m`) and Q8_0's, one row; and a
 * Qwen3-32B's down (25,600 wide) in each of the three. */
static void tg_bench_mv(void)
{
    static const struct { const char *what; int type, n, rows, tmax; } sh[] = {
        {"8b gate+up", QT_Q4_K, 4096, 24576, 16}, {"8b down", QT_Q4_K, 12288, 4096, 16},
        {"8b qkv", QT_Q4_K, 4096, 6144, 16}, {"8b wo", QT_Q4_K, 4096, 4096, 16},
        {"8b head", QT_Q4_K, 4096, 151936, 16}, {"30b q", QT_Q4_K, 2048, 4096, 16},
        {"30b expert gate", QT_Q4_K, 2048, 768, 16}, {"30b expert down", QT_Q4_K, 768, 2048, 16},
        {"8b v", QT_Q6_K, 4096, 1024, 1}, {"8b down", QT_Q6_K, 12288, 4096, 1},
        {"8b head", QT_Q6_K, 4096, 151936, 1}, {"8b gate+up", QT_Q8_0, 4096, 24576, 1},
        {"8b down", QT_Q8_0, 12288, 4096, 1}, {"8b head", QT_Q8_0, 4096, 151936, 1},
        {"32b down", QT_Q4_K, 25600, 5120, 1}, {"32b down", QT_Q6_K, 25600, 5120, 1},
        {"32b down", QT_Q8_0, 25600, 5120, 1}, {"8b gate+up", QT_F16, 4096, 24576, 16},
        {"8b down", QT_F16, 12288, 4096, 1}, {"8b wo", QT_F16, 4096, 4096, 1}, {"8b head", QT_F16, 4096, 151936, 1},
        {"8b gate+up", QT_BF16, 4096, 24576, 1}, {"32b down", QT_BF16, 25600, 5120, 1}};
    if (!test_begin_gpu("gpu/mv/bench decode matrix-vector kernels (Q4_K, Q6_K, Q8_0, F16, BF16)"))
        return;
    /* T = 1 as a decode step multiplies; 2..16 as a step of that many sequences */
    static const int Ts[] = {1, 2, 4, 8, 16};
    for (size_t i = 0; i < sizeof sh / sizeof *sh; i++)
        for (size_t k = 0; k < sizeof Ts / sizeof *Ts && Ts[k] <= sh[i].tmax; k++) {
            char err[256];
            double bytes = (double)quant_row_bytes(sh[i].type, sh[i].n) * sh[i].rows, us[2];
            for (int old = 0; old < 2; old++) {
                setenv("STRATA_GPU_MV_OLD", old ? "1" : "0", 1);
                us[old] = gpu_test_mv_us(sh[i].type, sh[i].n, sh[i].rows, Ts[k], 20, err, sizeof err);
                CHECK(us[old] > 0, "%s", err);
            }
            printf("  %-5s %-16s %5d x %6d T=%-2d %6.2f MB  old %6.1f us %.2f TB/s | new %6.1f us %.2f TB/s\n",
                   gguf_type_name(sh[i].type), sh[i].what, sh[i].n, sh[i].rows, Ts[k], bytes / 1e6, us[1],
                   bytes / us[1] / 1e6, us[0], bytes / us[0] / 1e6);
        }
    unsetenv("STRATA_GPU_MV_OLD");
}

/* set: extra synth arguments ("--set", "n_layer=12") or NULL */
static void tg_bench_one(const char *shape, const char *type, const char *set)
{
    char path[512], err[256], name[256];
    snprintf(name, sizeof name, "gpu/bench %s %s%s%s", shape, type, set ? " " : "", set ? set : "");
    if (!test_begin_gpu(name))
        return;
    snprintf(path, sizeof path, "/tmp/strata-bench-%s-%s%s.gguf", shape, type, set ? "-cut" : "");
    FILE *f = fopen(path, "rb");
    if (f) {
        fclose(f);
    } else {
        char *argv[] = {"synth", "--shape", (char *)shape, "--type", (char *)type, "-o", path, "--set", (char *)set};
        double t0 = tg_now();
        if (!CHECK(synth_main(set ? 9 : 7, argv, err, sizeof err) == 0, "synth: %s", err))
            return;
        printf("  synth %s %s: %.1f s\n", shape, type, tg_now() - t0);
    }
    struct model *m = NULL;
    struct tg_gpu t = {0};
    float *lg = NULL;
    if (!CHECK(model_load(&m, path, err, sizeof err) == 0, "%s", err))
        return;
    double t0 = tg_now();
    if (tg_gpu_open(&t, m, KV_CELL_F16, 1024, 512) != 0)
        goto done;
    const struct model_hp *hp = model_hp(m);
    printf("  upload %.2f GB: %.1f s\n", gpu_model_bytes(t.g) / 1e9, tg_now() - t0);
    int V = hp->n_vocab;
    lg = malloc(sizeof(float) * V);
    int32_t ids[640];
    for (int i = 0; i < 640; i++)
        ids[i] = 100 + i * 7;
    double best_pp = 1e9;
    for (int rep = 0; rep < 3; rep++) {
        kv_truncate(t.kv, t.seq, kv_seq_len(t.kv, t.seq));
        if (!CHECK(kv_append(t.kv, t.seq, ids, 512, err, sizeof err) == 0, "%s", err))
            goto done;
        t0 = tg_now();
        if (!CHECK(gpu_eval(t.c, t.seq, ids, 512, 0, lg, 0, err, sizeof err) == 0, "%s", err))
            goto done;
        double dt = tg_now() - t0;
        best_pp = dt < best_pp ? dt : best_pp;
    }
    double bound = 4.3e12 / (double)model_decode_bytes(m);
    printf("  %s %s%s: %d layers, %.2f GB read per token, bound %.0f tok/s at 4.3 TB/s; pp512 %.0f tok/s\n", shape,
           type, set ? " (cut)" : "", hp->n_layer, model_decode_bytes(m) / 1e9, bound, 512 / best_pp);
    static const struct { const char *what, *graph; int cell; } cfgs[] = {
        {"graph, f16 KV", "0", KV_CELL_F16},
        {"graph, int8 KV", "0", KV_CELL_INT8},
        {"no graph, f16 KV", "1", KV_CELL_F16},
    };
    for (size_t k = 0; k < sizeof cfgs / sizeof cfgs[0]; k++) {
        setenv("STRATA_GPU_NO_GRAPH", cfgs[k].graph, 1);
        double tps = tg_bench_tg(t.g, hp, cfgs[k].cell, ids, lg);
        printf("  tg128 %-20s %7.1f tok/s = %5.1f%% of the bound\n", cfgs[k].what, tps, 100 * tps / bound);
    }
    unsetenv("STRATA_GPU_NO_GRAPH");
    { /* where one decode step's time goes (after the pp512 runs: at cell 512), then a 512-token prompt's */
        char prof[1024];
        int pos = kv_seq_len(t.kv, t.seq);
        if (CHECK(kv_append(t.kv, t.seq, ids, 1, err, sizeof err) == 0, "%s", err) &&
            CHECK(gpu_test_profile(t.c, t.seq, ids, 1, pos, prof, sizeof prof, err, sizeof err) == 0, "%s", err))
            printf("  profile at cell %d: %s\n", pos, prof);
        kv_truncate(t.kv, t.seq, kv_seq_len(t.kv, t.seq));
        if (CHECK(kv_append(t.kv, t.seq, ids, 512, err, sizeof err) == 0, "%s", err) &&
            CHECK(gpu_test_profile(t.c, t.seq, ids, 512, 0, prof, sizeof prof, err, sizeof err) == 0, "%s", err))
            printf("  profile of a 512-token prompt: %s\n", prof);
        /* an 8-token prompt: the products of a step of 8 sequences (gpu_eval_batch) */
        kv_truncate(t.kv, t.seq, kv_seq_len(t.kv, t.seq));
        if (CHECK(kv_append(t.kv, t.seq, ids, 8, err, sizeof err) == 0, "%s", err) &&
            CHECK(gpu_test_profile(t.c, t.seq, ids, 8, 0, prof, sizeof prof, err, sizeof err) == 0, "%s", err))
            printf("  profile of an 8-token prompt: %s\n", prof);
    }
    CHECK(isfinite(lg[0]), "logits not finite");
    { /* a 2048-token prompt, pp4096's chunk (a context of its own: the decode figures above keep theirs) */
        tg_gpu_close(&t);
        enum { LONG = 2048 };
        int32_t *lids = malloc(sizeof(int32_t) * LONG);
        char prof[1024];
        for (int i = 0; i < LONG; i++)
            lids[i] = 100 + i * 7 % (V - 100);
        if (lids && tg_gpu_open(&t, m, KV_CELL_F16, LONG, LONG) == 0)
            for (int rep = 0; rep < 2; rep++) {   /* the first warms up */
                kv_truncate(t.kv, t.seq, kv_seq_len(t.kv, t.seq));
                if (CHECK(kv_append(t.kv, t.seq, lids, LONG, err, sizeof err) == 0, "%s", err) &&
                    CHECK(gpu_test_profile(t.c, t.seq, lids, LONG, 0, prof, sizeof prof, err, sizeof err) == 0, "%s",
                          err) && rep)
                    printf("  profile of a %d-token prompt: %s\n", LONG, prof);
            }
        free(lids);
    }
done:
    free(lg);
    tg_gpu_close(&t);
    model_free(m);
}

/* a dense qwen3 model of this shape (vocabulary 2000) written by synth to
 * path; its label ("qwen3-synth-TYPE n_embd=.. n_ff=..") in label */
struct tg_dense { const char *type; int n_embd, n_layer, n_head, n_head_kv, head_dim, n_ff; };

static int tg_dense_model(const struct tg_dense *d, const char *path, char *label, size_t cap)
{
    char err[256], set[6][24];
    snprintf(set[0], sizeof set[0], "n_embd=%d", d->n_embd);
    snprintf(set[1], sizeof set[1], "n_layer=%d", d->n_layer);
    snprintf(set[2], sizeof set[2], "n_head=%d", d->n_head);
    snprintf(set[3], sizeof set[3], "n_head_kv=%d", d->n_head_kv);
    snprintf(set[4], sizeof set[4], "head_dim=%d", d->head_dim);
    snprintf(set[5], sizeof set[5], "n_ff=%d", d->n_ff);
    char *argv[] = {"synth", "--arch", "qwen3", "--set", set[0], "--set", set[1], "--set", set[2], "--set", set[3],
                    "--set", set[4], "--set", set[5], "--set", "n_vocab=2000", "--type", (char *)d->type,
                    "-o", (char *)path};
    snprintf(label, cap, "qwen3-synth-%s %s %s", d->type, set[0], set[5]);
    return CHECK(synth_main((int)(sizeof argv / sizeof argv[0]), argv, err, sizeof err) == 0, "synth: %s", err);
}

/* Q4_0, Q5_0, Q4_1, Q5_1, Q2_K, Q3_K, Q5_K, IQ4_NL, IQ4_XS and the IQ2/IQ3 lattices
 * (their one-row products: gf_mvs_kernel), F16 and BF16 (gf_mvf_kernel;
 * their 12-token prompts gf_mvh_kernel) through a whole small qwen3 in
 * each (embedding rows, every product, the head): a 12-token
 * prompt through the decode kernels with T = 12, a 48-token one through
 * gpu_gemm, then one-token steps; and qwen3moe models whose decode steps
 * take the experts side by side in F16 (the float path), Q3_K, IQ4_XS and
 * IQ2_XS (the block-a-row and staged kernels), Q4_0, Q5_K and Q5_1
 * (gf_mvs_kernel's experts, the next norm handed on). */
static void tg_formats(void)
{
    if (!test_begin_gpu("gpu/formats GPU vs CPU teacher-forced, Q4_0, Q5_0, Q4_1, Q5_1, Q2_K, Q3_K, Q5_K, IQ4_NL, "
                        "IQ4_XS, IQ2_XXS, IQ2_XS, IQ2_S, IQ3_XXS, IQ3_S, F16 and BF16 models, F16, Q3_K, IQ4_XS, "
                        "IQ2_XS, Q4_0, Q5_K and Q5_1 experts (bound: 1.5x CPU vs f32ref + 0.05)"))
        return;
    static const char *const types[] = {"Q4_0",    "Q5_0",   "Q4_1",  "Q5_1",    "Q2_K",  "Q3_K", "Q5_K", "IQ4_NL",
                                        "IQ4_XS",  "IQ2_XXS", "IQ2_XS", "IQ2_S", "IQ3_XXS", "IQ3_S", "F16",  "BF16"};
    for (size_t i = 0; i < sizeof types / sizeof *types; i++) {
        char path[64], label[64];
        snprintf(path, sizeof path, "/tmp/strata-test-gpu-%s.gguf", types[i]);
        struct tg_dense d = {types[i], 256, 2, 4, 2, 64, 768};
        if (!tg_dense_model(&d, path, label, sizeof label))
            continue;
        tg_random_model(label, path, 12);
        tg_random_model(label, path, 48);
        remove(path);
    }
    /* experts side by side: the float path, the block-a-row and staged kernels, gf_mvs_kernel */
    static const char *const moe[][2] = {
        {"F16", "n_embd=256"},    {"Q3_K", "n_embd=256"}, {"IQ4_XS", "n_embd=2304"},
        {"IQ2_XS", "n_embd=256"}, {"Q4_0", "n_embd=256"}, {"Q5_K", "n_embd=256"}, {"Q5_1", "n_embd=256"}};
    for (size_t i = 0; i < sizeof moe / sizeof *moe; i++) {
        const char *path = tg_moe_model(moe[i][0], moe[i][1], "n_ff_exp=256");
        if (path)
            remove(path);
    }
}

/* Dense qwen3 models whose layers hand their norms from the products into
 * x to the products after them (gf_hand_begin, one-token steps: down to
 * the next q/k/v, wo to gate/up): GPU vs CPU with the handoff and with
 * STRATA_GPU_NO_HANDOFF=1 (the activation kernels between them), and the
 * two not equal bit for bit (the handoff ran: it scales each row's sum,
 * not each block's codes). Q4_K (gf_mvk_kernel); Q8_0 (gf_mvs_kernel
 * alone), with 32 heads of 128 so that wo is 4,096 wide (its norm-handing
 * form at one unit a lane, two slices: gf_hand_slices); Q4_K_M of 4 layers,
 * whose layers 2 and 3 hold a Q6_K v and down (synth's rule for the layers
 * of more bits): a Q4_K down hands to a q/k/v of two products in one
 * launch (gf_mv2_kernel: the logits bit for bit with STRATA_GPU_NO_MV2=1's
 * launch each), a Q6_K down to the next. On sm_90 these products' few
 * blocks (16 groups of 32 rows) run in pairs (gf_pair_meet): the logits bit
 * for bit with STRATA_GPU_NO_PAIRS=1's block a group. And a Q4_K_M model
 * whose down is 25,600 wide (a Qwen3-32B's), past 16,384 columns: slices
 * of two warps (gf_mvk_sub), its Q4_K and Q6_K downs handing their norms;
 * a Q5_K_M (Q5_K and Q6_K products in gf_mvs_kernel) and a Q4_0.
 * Last, a model whose x has more blocks of 32 than the device has SMs:
 * no norm handed on (the logits bit for bit with STRATA_GPU_NO_HANDOFF=1's). */
static void tg_handoff(void)
{
    if (!test_begin_gpu("gpu/handoff dense Q4_K, Q8_0, Q4_K_M, Q5_K_M and Q4_0 models, their norms handed from "
                        "products into x to the next and not: GPU vs CPU teacher-forced (bound: 1.5x CPU vs f32ref "
                        "+ 0.05)"))
        return;
    static const struct tg_dense ms[] = {
        {"Q4_K", 512, 3, 8, 2, 64, 1536},   {"Q8_0", 512, 3, 32, 8, 128, 1536}, {"Q4_K_M", 512, 4, 8, 2, 64, 1536},
        {"Q4_K_M", 256, 4, 4, 2, 64, 25600}, {"Q5_K_M", 512, 4, 8, 2, 64, 1536}, {"Q4_0", 512, 3, 8, 2, 64, 1536}};
    const char *path = "/tmp/strata-test-gpu-handoff.gguf";
    char model[64], label[96];
    for (size_t i = 0; i < sizeof ms / sizeof *ms; i++) {
        if (!tg_dense_model(&ms[i], path, model, sizeof model))
            return;
        snprintf(label, sizeof label, "%s, handoff", model);
        tg_random_model(label, path, 8);
        setenv("STRATA_GPU_NO_HANDOFF", "1", 1);
        snprintf(label, sizeof label, "%s, STRATA_GPU_NO_HANDOFF=1", model);
        tg_random_model(label, path, 8);
        unsetenv("STRATA_GPU_NO_HANDOFF");
        tg_same_or_not(model, path, "STRATA_GPU_NO_HANDOFF", 0, 8);
        tg_same(model, path, "STRATA_GPU_NO_PAIRS");
        if (!strcmp(ms[i].type, "Q4_K_M"))
            tg_same(model, path, "STRATA_GPU_NO_MV2");
        remove(path);
    }
    int D = (gpu_test_sms() * 32 / 256 + 1) * 256;   /* the fewest 256s past 32 an SM */
    struct tg_dense wide = {"Q4_K", D, 2, D / 128, 2, 128, 512};
    if (tg_dense_model(&wide, path, model, sizeof model)) {
        tg_same(model, path, "STRATA_GPU_NO_HANDOFF");
        remove(path);
    }
}

/* --device auto takes the GPU only for a model it can hold: one it refuses
 * (n_embd 40, not a multiple of 16) gets a context on the CPU that runs,
 * and --device gpu an error that names the shape. */
static void tg_auto(void)
{
    if (!test_begin_gpu("gpu/auto a model the GPU refuses (n_embd 40) runs on the CPU under auto; gpu names why"))
        return;
    char err[256];
    const char *path = "/tmp/strata-test-gpu-odd.gguf";
    char *argv[] = {"synth", "--arch", "qwen3", "--set", "n_embd=40", "--set", "n_layer=2", "--set", "n_head=2",
                    "--set", "n_head_kv=1", "--set", "head_dim=32", "--set", "n_ff=64", "--set", "n_vocab=300",
                    "--type", "F32", "-o", (char *)path};
    struct model *m = NULL;
    if (!CHECK(synth_main((int)(sizeof argv / sizeof argv[0]), argv, err, sizeof err) == 0, "synth: %s", err) ||
        !CHECK(model_load(&m, path, err, sizeof err) == 0, "%s", err))
        goto done;
    struct model_opts o = model_opts_default();
    o.n_ctx = 64, o.device = MODEL_DEV_GPU;
    struct model_ctx *c = NULL;
    err[0] = 0;
    CHECK(model_ctx_new(&c, m, &o, NULL, err, sizeof err) != 0 && strstr(err, "n_embd 40"),
          "--device gpu: got \"%s\"", err);
    model_ctx_free(c), c = NULL;
    o.device = MODEL_DEV_AUTO;
    int32_t ids[4] = {1, 2, 3, 4};
    float *lg = malloc(sizeof(float) * 300);
    if (CHECK(model_ctx_new(&c, m, &o, NULL, err, sizeof err) == 0, "--device auto: %s", err)) {
        CHECK(model_ctx_device(c) == MODEL_DEV_CPU, "auto took device %d", model_ctx_device(c));
        CHECK(model_eval(c, 0, ids, 4, 0, lg, 0, err, sizeof err) == 0 && isfinite(lg[0]), "eval: %s", err);
    }
    free(lg);
    model_ctx_free(c);
done:
    model_free(m);
    remove(path);
}

void test_gpu(void)
{
    static const int types[] = {QT_F32, QT_F16, QT_BF16, QT_Q4_0, QT_Q4_1, QT_Q5_0, QT_Q5_1, QT_Q8_0,
                                QT_Q2_K, QT_Q3_K, QT_Q4_K, QT_Q5_K, QT_Q6_K, QT_IQ4_NL, QT_IQ4_XS,
                                QT_IQ2_XXS, QT_IQ2_XS, QT_IQ2_S, QT_IQ3_XXS, QT_IQ3_S};
    /* rows of several chunks of the decode kernels (161 blocks of 32 start
     * rows off 16-byte boundaries); K-quants also at the widths that take
     * one, two and three column slices of the Q4_K kernel, and at 25,600 (a
     * Qwen3-32B's down: seven slices of two warps, gf_mvk_sub; 300 rows are
     * two rounds on some blocks). 67 rows take the block-a-row decode kernel
     * (too few rows for the SMs), 2240 the staged one (on up to 140 SMs),
     * where no one-row kernel of the type's own (gf_mvk_kernel,
     * gf_mvs_kernel) takes the width. */
    tg_rows_pool = pool_new(test_cores(TG_THREADS));
    for (size_t i = 0; i < sizeof types / sizeof types[0]; i++) {
        int k = quant_type(types[i])->blck == 256;
        tg_matvec_type(types[i], k ? 5120 : 5152, 67);
        tg_matvec_type(types[i], k ? 5120 : 5152, 2240);
        int wide = types[i] == QT_Q4_K || types[i] == QT_Q6_K || types[i] == QT_Q8_0 ? 300 : 67;
        if (k) {
            tg_matvec_type(types[i], 2048, 67);
            tg_matvec_type(types[i], 12288, 67);
            tg_matvec_type(types[i], 25600, wide);
        }
        if (quant_type(types[i])->blck == 1) {   /* gf_mvf_kernel: the activation row 48 and 100 KB of shared memory */
            tg_matvec_type(types[i], 12288, 300);
            tg_matvec_type(types[i], 25600, 300);
        }
        /* widths of 256s: gf_mvs_kernel (one row; 12288: a stage over 48 KB) */
        if (types[i] == QT_Q4_0 || types[i] == QT_Q5_0 || types[i] == QT_Q4_1 || types[i] == QT_Q5_1 ||
            types[i] == QT_Q8_0 || types[i] == QT_IQ4_NL) {
            tg_matvec_type(types[i], 5120, 67);   /* and gf_mvq_kernel (batches) */
            tg_matvec_type(types[i], 12288, 67);
            tg_matvec_type(types[i], 25600, wide);
        }
    }
    pool_free(tg_rows_pool);
    tg_rows_pool = NULL;
    tg_kv_store();
    tg_demo();
    tg_batch();
    tg_testdata("tiny-qwen3-Q4_K_M.gguf");
    tg_testdata("tiny-llama-spm-Q8_0.gguf");
    tg_moe();
    tg_formats();
    tg_handoff();
    tg_logits_row();
    tg_auto();
    const char *bench = getenv("STRATA_GPU_BENCH");
    if (bench && strcmp(bench, "mv") == 0)
        tg_bench_mv();
    else if (bench && *bench && strcmp(bench, "0") != 0) {
        tg_bench_one("qwen3-8b", "Q4_K", NULL);
        if (strcmp(bench, "moe") == 0) /* 12 of the 48 layers: the full file (17 GB) takes minutes to write */
            tg_bench_one("qwen3-30b-a3b", "Q4_K", "n_layer=12");
    }
}

#else

void test_gpu(void)
{
    test_begin_gpu("gpu/backend"); /* skips: no GPU backend */
}

#endif
