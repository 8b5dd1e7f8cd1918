/*
 * test_gpu_gemm.c — gpu_gemm.cu against the CPU (GPU builds; skipped otherwise):
 * gpu_quant.h's decoding (through gpu_dequant) bit for bit against quant.c's
 * to_f32, on the reference's golden blocks and on fresh quantiser output;
 * gpu_gemm for every supported type, both kernels, against an FP64 product of
 * the dequantised weights and the f32 activations; timings of the Qwen3-8B
 * shapes. Shapes: T tokens, n the shared dimension, rows the weight rows.
 */
#include "strata.h"
#include "test.h"

#ifdef STRATA_GPU
#include <math.h>
#include <pthread.h>
#include <stdlib.h>
#include <string.h>

#include "gpu.h"

/* Normalised error bounds, sqrt(sum (y - ref)^2 / sum ref^2). The tensor-core
 * kernel rounds x and W to f16 (unit roundoff 2^-11 = 4.9e-4 on each factor;
 * random signs leave the sum near that, so 2e-3 is 4x headroom); the tiled
 * kernel sums f32 products (n <= 4096: ~1e-6). */
#define TG_BOUND_MMA 2e-3
#define TG_BOUND_F32 1e-5

static const int tg_types[] = {
    QT_F32, QT_F16, QT_BF16, QT_Q4_0, QT_Q4_1, QT_Q5_0, QT_Q5_1, QT_Q8_0, QT_Q8_1,
    QT_Q2_K, QT_Q3_K, QT_Q4_K, QT_Q5_K, QT_Q6_K, QT_Q8_K, QT_IQ4_NL, QT_IQ4_XS,
    QT_IQ2_XXS, QT_IQ2_XS, QT_IQ2_S, QT_IQ3_XXS, QT_IQ3_S,
};
#define TG_NTYPES ((int)(sizeof tg_types / sizeof tg_types[0]))

/* ---- a parallel for over [0, n): the FP64 references and quantisers are
 * the slow part of these cases ---- */

struct tg_par {
    void (*fn)(void *ctx, int i);
    void *ctx;
    int n, next;
    pthread_mutex_t mu;
};

static void *tg_worker(void *arg)
{
    struct tg_par *p = arg;
    for (;;) {
        pthread_mutex_lock(&p->mu);
        int i = p->next++;
        pthread_mutex_unlock(&p->mu);
        if (i >= p->n)
            return NULL;
        p->fn(p->ctx, i);
    }
}

static void tg_parallel(int n, void (*fn)(void *ctx, int i), void *ctx)
{
    struct tg_par p = {fn, ctx, n, 0, PTHREAD_MUTEX_INITIALIZER};
    int nt = test_cores(32);
    pthread_t th[32];
    int started = 0;
    for (int i = 1; i < nt; i++)
        if (pthread_create(&th[started], NULL, tg_worker, &p) == 0)
            started++;
    tg_worker(&p);
    for (int i = 0; i < started; i++)
        pthread_join(th[i], NULL);
}

/* ---- weights: rows of random values through the type's quantiser ---- */

struct tg_wjob {
    const struct quant_type *qt;
    int type, n;
    size_t ldw;
    unsigned seed;
    uint8_t *w;  /* (rows, ldw) */
    float *deq;  /* (rows, n) */
};

static void tg_wrow(void *ctx, int r)
{
    struct tg_wjob *j = ctx;
    float *v = j->deq + (size_t)r * j->n;
    unsigned st = j->seed * 7919u + (unsigned)r * 104729u + 1;
    /* row scales from 1e-2 to 1e1: every block's scale exponent varies */
    float scale = 0.01f * powf(10.f, 3.f * (test_rand(&st) % 1000) / 1000.f);
    test_weight_row(j->type, j->w + (size_t)r * j->ldw, j->n, scale, &st);
    j->qt->to_f32(j->w + (size_t)r * j->ldw, v, j->n); /* the values the GPU must reproduce */
}

/* w (rows, ldw bytes) and its CPU dequantisation deq (rows, n); 0 on success. */
static int tg_weights(int type, int n, int rows, unsigned seed, uint8_t **w, size_t *ldw, float **deq)
{
    struct tg_wjob j = {quant_type(type), type, n, quant_row_bytes(type, n), seed, NULL, NULL};
    if (!j.qt || !j.ldw)
        return -1;
    j.w = malloc(j.ldw * rows);
    j.deq = malloc((size_t)rows * n * sizeof(float));
    if (!j.w || !j.deq) {
        free(j.w);
        free(j.deq);
        return -1;
    }
    tg_parallel(rows, tg_wrow, &j);
    *w = j.w;
    *ldw = j.ldw;
    *deq = j.deq;
    return 0;
}

/* ---- device buffers ---- */

static void *tg_upload(const void *host, size_t bytes)
{
    void *d = gpu_test_alloc(bytes);
    if (d && gpu_test_copy(d, host, bytes, 0)) {
        gpu_test_free(d);
        d = NULL;
    }
    return d;
}

static uint32_t tg_bits(float f)
{
    uint32_t u;
    memcpy(&u, &f, 4);
    return u;
}

/* ==== gq_dequant16 through gpu_dequant: bit for bit ==== */

/* 0 when the device's dequantisation of w (rows, n) equals want bit for bit;
 * the device copy of w starts `off` bytes into an allocation (off = 2: every
 * load width of gq_ld16), the output rows are strided (ldy = n + 3) and
 * poisoned, the gap must stay. */
static int tg_deq_check(const char *what, int type, const uint8_t *w, size_t ldw, int n, int rows,
                        const float *want, int off)
{
    char err[256] = "";
    size_t ldy = (size_t)n + 3, ybytes = ldy * rows * sizeof(float);
    uint8_t *dw = gpu_test_alloc(ldw * rows + 16);
    float *dy = gpu_test_alloc(ybytes), *y = malloc(ybytes);
    int ok = CHECK(dw && dy && y, "%s: out of memory", what) &&
             CHECK(gpu_test_copy(dw + off, w, ldw * rows, 0) == 0, "%s: upload failed", what);
    if (ok)
        ok = CHECK(gpu_gemm_test_fill(dy, 0xff, ybytes) == 0, "%s: fill failed", what) &&
             CHECK(gpu_dequant(type, dw + off, ldw, n, rows, dy, ldy, NULL, err, sizeof err) == 0, "%s: %s",
                   what, err) &&
             CHECK(gpu_test_copy(y, dy, ybytes, 1) == 0, "%s: copy back failed", what);
    if (ok) {
        long bad = 0, first = -1, gap = 0;
        for (int r = 0; r < rows; r++) {
            for (int k = 0; k < n; k++)
                if (tg_bits(y[r * ldy + k]) != tg_bits(want[(size_t)r * n + k]) && bad++ == 0)
                    first = (long)r * n + k;
            for (size_t k = (size_t)n; k < ldy; k++)
                gap += tg_bits(y[r * ldy + k]) != 0xffffffffu;
        }
        ok = CHECK(bad == 0, "%s: %ld of %d values differ (first %ld: %.9g vs %.9g)", what, bad, n * rows,
                   first, first >= 0 ? y[first / n * ldy + first % n] : 0, first >= 0 ? want[first] : 0) &&
             CHECK(gap == 0, "%s: %ld values written outside the rows", what, gap);
    }
    gpu_test_free(dw);
    gpu_test_free(dy);
    free(y);
    return ok ? 0 : -1;
}

static void tg_dequant(void)
{
    if (!test_begin_gpu("gpu/gemm/dequant-exact"))
        return;
    int golden = 0, fresh = 0;
    char what[96];
    for (int i = 0; i < TG_NTYPES; i++) {
        int type = tg_types[i];
        const struct quant_type *qt = quant_type(type);
        /* the reference's blocks and dequantisation, where the folder has them */
        char name[32], rel[64], path[512], err[256];
        snprintf(name, sizeof name, "%s", qt->name);
        for (char *c = name; *c; c++)
            if (*c >= 'A' && *c <= 'Z' && !(c > name && c[-1] == '_' && *c == 'K'))
                *c = (char)(*c - 'A' + 'a');
        snprintf(rel, sizeof rel, "quant/%s.gguf", name);
        if (test_data(rel, path, sizeof path)) {
            struct gguf g;
            if (gguf_open(&g, path, err, sizeof err) == 0) {
                const struct gguf_tensor *w = gguf_tensor(&g, "w"), *wd = gguf_tensor(&g, "w_deq");
                if (CHECK(w && wd && w->type == type, "%s: tensors w, w_deq", path)) {
                    int n = (int)w->ne[0], rows = (int)w->ne[1];
                    snprintf(what, sizeof what, "%s golden", qt->name);
                    golden += tg_deq_check(what, type, w->data, quant_row_bytes(type, n), n, rows,
                                           wd->data, 0) == 0;
                }
                gguf_close(&g);
            }
        }
        /* fresh blocks (quant.c's quantiser; random codes for the lattices), odd row count */
        uint8_t *w;
        size_t ldw;
        float *deq;
        unsigned seed = 1000u + (unsigned)i;
        if (!CHECK(tg_weights(type, 1024, 37, seed, &w, &ldw, &deq) == 0, "%s: weights", qt->name))
            continue;
        snprintf(what, sizeof what, "%s fresh", qt->name);
        int ok = tg_deq_check(what, type, w, ldw, 1024, 37, deq, 0) == 0;
        if (type != QT_F32) { /* 2 bytes off: halves and bytes (F32 needs 4-byte alignment) */
            snprintf(what, sizeof what, "%s fresh, 2 bytes off", qt->name);
            ok &= tg_deq_check(what, type, w, ldw, 1024, 37, deq, 2) == 0;
        }
        fresh += ok;
        free(w);
        free(deq);
    }
    printf("  gq_dequant16 bit-exact: %d/%d types on fresh blocks, %d golden files\n", fresh,
           TG_NTYPES, golden);
}

/* ==== gpu_gemm against FP64 ==== */

struct tg_ref {
    const float *x, *deq; /* (T, n), (rows, n) */
    int n, rows;
    double *ref;          /* (T, rows) */
};

static void tg_ref_token(void *ctx, int t)
{
    struct tg_ref *r = ctx;
    const float *xt = r->x + (size_t)t * r->n;
    for (int i = 0; i < r->rows; i++) {
        const float *wi = r->deq + (size_t)i * r->n;
        double s = 0;
        for (int k = 0; k < r->n; k++)
            s += (double)xt[k] * wi[k];
        r->ref[(size_t)t * r->rows + i] = s;
    }
}

/* Worst results of one kernel over a type's shapes. */
struct tg_worst {
    double nerr, maxabs;
};

/* The kernels a case runs: gpu_gemm's own choice (cuBLAS from 64 tokens
 * where it is loaded; these small grids take split-K where n has two
 * supersteps or more); the choice among Strata's own kernels
 * (STRATA_GEMM_BLAS=0, as all the rest); the tiled f32 kernel
 * (STRATA_GEMM_PORTABLE=1); and on sm_80+ the 256-token tile that the
 * choice takes above 1024 tokens or for small grids (STRATA_GEMM_BM=256),
 * and the choice without split-K (STRATA_GEMM_SPLIT=1), as large grids run. */
enum { TG_DEFAULT, TG_OWN, TG_TILED, TG_BM256, TG_NOSPLIT, TG_KERNELS };
static const char *const tg_kname[TG_KERNELS] = {"default", "own", "tiled", "bm256", "nosplit"};

static void tg_kernel_env(int kernel)
{
    unsetenv("STRATA_GEMM_BLAS");
    unsetenv("STRATA_GEMM_PORTABLE");
    unsetenv("STRATA_GEMM_BM");
    unsetenv("STRATA_GEMM_SPLIT");
    if (kernel != TG_DEFAULT)
        setenv("STRATA_GEMM_BLAS", "0", 1);
    if (kernel == TG_NOSPLIT)
        setenv("STRATA_GEMM_SPLIT", "1", 1);
    if (kernel == TG_TILED)
        setenv("STRATA_GEMM_PORTABLE", "1", 1);
    if (kernel == TG_BM256)
        setenv("STRATA_GEMM_BM", "256", 1);
}

/* One call's outputs y (T rows of ldy floats, poisoned with 0xff bytes
 * before the call) against ref (rows values a row): the first `valid` rows'
 * first `rows` values are scored, every other value must still be poison. */
struct tg_score {
    double nerr, maxabs;
    long nonfinite, touched;
};

static struct tg_score tg_score_of(const float *y, size_t ldy, int T, int valid, int rows, const double *ref)
{
    struct tg_score s = {0, 0, 0, 0};
    double se = 0, sr = 0;
    for (int t = 0; t < T; t++)
        for (size_t i = 0; i < ldy; i++) {
            float v = y[t * ldy + i];
            if (t >= valid || i >= (size_t)rows) {
                s.touched += tg_bits(v) != 0xffffffffu;
                continue;
            }
            double r = ref[(size_t)t * rows + i], d = v - r;
            if (!isfinite(v)) {
                s.nonfinite++;
                continue;
            }
            se += d * d;
            sr += r * r;
            if (fabs(d) > s.maxabs)
                s.maxabs = fabs(d);
        }
    s.nerr = sr > 0 ? sqrt(se / sr) : sqrt(se);
    return s;
}

/* One gpu_gemm call into a poisoned y with ldy = rows + 4 or + 5 (even T:
 * even ldy, where the mma kernel stores pairs); checks every output finite,
 * the gap untouched and the normalised error within bound. */
static void tg_one(const char *tname, int kernel, int type, const void *dw, size_t ldw, int n, int rows,
                   const float *dx, int T, const double *ref, void *dy, void *scratch, float *y,
                   struct tg_worst *worst)
{
    char err[256] = "";
    size_t ldy = (size_t)rows + (T % 2 ? 5 : 4), ybytes = ldy * T * sizeof(float);
    const char *kname = tg_kname[kernel];
    tg_kernel_env(kernel);
    int ok = CHECK(gpu_gemm_test_fill(dy, 0xff, ybytes) == 0, "fill failed") &&
             CHECK(gpu_gemm(type, dw, ldw, n, rows, dx, T, dy, ldy, scratch, NULL, err, sizeof err) == 0,
                   "%s %s T=%d n=%d rows=%d: %s", tname, kname, T, n, rows, err) &&
             CHECK(gpu_test_copy(y, dy, ybytes, 1) == 0, "%s %s T=%d n=%d rows=%d: copy back failed "
                   "(a kernel fault)", tname, kname, T, n, rows);
    tg_kernel_env(TG_DEFAULT);
    if (!ok)
        return;
    struct tg_score sc = tg_score_of(y, ldy, T, T, rows, ref);
    double bound = kernel == TG_TILED ? TG_BOUND_F32 : TG_BOUND_MMA;
    CHECK(sc.nonfinite == 0, "%s %s T=%d n=%d rows=%d: %ld outputs not finite (unwritten or NaN)", tname, kname,
          T, n, rows, sc.nonfinite);
    CHECK(sc.touched == 0, "%s %s T=%d n=%d rows=%d: %ld values written past rows", tname, kname, T, n, rows,
          sc.touched);
    CHECK(sc.nerr <= bound, "%s %s T=%d n=%d rows=%d: normalised error %.3g > %.3g (max abs %.3g)", tname, kname,
          T, n, rows, sc.nerr, bound, sc.maxabs);
    if (sc.nerr > worst->nerr)
        worst->nerr = sc.nerr;
    if (sc.maxabs > worst->maxabs)
        worst->maxabs = sc.maxabs;
}

static void tg_gemm_type(int ti)
{
    static char names[TG_NTYPES][48]; /* the runner keeps the name pointer */
    int type = tg_types[ti];
    const struct quant_type *qt = quant_type(type);
    snprintf(names[ti], sizeof names[ti], "gpu/gemm/%s", qt->name);
    if (!test_begin_gpu(names[ti]))
        return;
    if (!CHECK(gpu_gemm_supports(type), "%s: gpu_gemm_supports says no", qt->name))
        return;
    /* n = 768: rows of 3 super-blocks, every other one 2 bytes off a word in the 210-, 110-byte types */
    static const int Ts[] = {1, 7, 16, 50, 100, 512}, ns[] = {256, 768, 4096}, rowss[] = {64, 1000};
    const int maxT = 512, maxrows = 1000;
    struct tg_worst worst[TG_KERNELS] = {{0, 0}, {0, 0}, {0, 0}, {0, 0}, {0, 0}};
    unsigned st = 77u + 31u * (unsigned)ti;
    for (int ni = 0; ni < 3; ni++) {
        int n = ns[ni];
        uint8_t *w;
        size_t ldw;
        float *deq;
        if (!CHECK(tg_weights(type, n, maxrows, test_rand(&st), &w, &ldw, &deq) == 0, "weights"))
            return;
        size_t sbytes = gpu_gemm_scratch_bytes(type, n, maxrows, maxT);
        void *dw = tg_upload(w, ldw * maxrows), *dx = gpu_test_alloc((size_t)maxT * n * sizeof(float));
        void *dy = gpu_test_alloc((size_t)maxT * (maxrows + 5) * sizeof(float));
        void *scratch = gpu_test_alloc(sbytes ? sbytes : 16);
        float *x = malloc((size_t)maxT * n * sizeof(float));
        float *y = malloc((size_t)maxT * (maxrows + 5) * sizeof(float));
        double *ref = malloc((size_t)maxT * maxrows * sizeof(double));
        if (CHECK(dw && dx && dy && scratch && x && y && ref, "out of memory")) {
            for (int ri = 0; ri < 2; ri++)
                for (int tt = 0; tt < 6; tt++) {
                    int rows = rowss[ri], T = Ts[tt];
                    for (int k = 0; k < T * n; k++) /* fresh activations for every shape */
                        x[k] = 2.f * test_randf(&st);
                    if (!CHECK(gpu_test_copy(dx, x, (size_t)T * n * sizeof(float), 0) == 0, "upload"))
                        continue;
                    struct tg_ref rj = {x, deq, n, rows, ref};
                    tg_parallel(T, tg_ref_token, &rj);
                    for (int kernel = 0; kernel < TG_KERNELS; kernel++)
                        if ((kernel != TG_BM256 && kernel != TG_NOSPLIT && kernel != TG_OWN) || T >= 100)
                            tg_one(qt->name, kernel, type, dw, ldw, n, rows, dx, T, ref, dy, scratch, y,
                                   &worst[kernel]);
                }
        }
        gpu_test_free(dw);
        gpu_test_free(dx);
        gpu_test_free(dy);
        gpu_test_free(scratch);
        free(x);
        free(y);
        free(ref);
        free(w);
        free(deq);
    }
    printf("  %-7s nerr (max abs): default%s %.2e (%.1e), own %.2e (%.1e), bm256 %.2e (%.1e), nosplit %.2e (%.1e) "
           "[bound %.0e]; tiled %.2e (%.1e) [bound %.0e]\n", qt->name, gpu_gemm_blas() ? " (cuBLAS from 64 tokens)" :
           " (no cuBLAS)", worst[TG_DEFAULT].nerr, worst[TG_DEFAULT].maxabs, worst[TG_OWN].nerr,
           worst[TG_OWN].maxabs, worst[TG_BM256].nerr, worst[TG_BM256].maxabs, worst[TG_NOSPLIT].nerr,
           worst[TG_NOSPLIT].maxabs, TG_BOUND_MMA, worst[TG_TILED].nerr, worst[TG_TILED].maxabs, TG_BOUND_F32);
}

/* ==== timings: the Qwen3-8B matrices ==== */

/* Normalised difference of two device outputs (T, rows), ldy = rows. */
static double tg_devdiff(const void *da, const void *db, size_t count)
{
    float *a = malloc(count * sizeof(float)), *b = malloc(count * sizeof(float));
    double se = 0, sr = 0;
    if (a && b && gpu_test_copy(a, da, count * sizeof(float), 1) == 0 &&
        gpu_test_copy(b, db, count * sizeof(float), 1) == 0)
        for (size_t i = 0; i < count; i++) {
            double d = (double)a[i] - b[i];
            se += isfinite(d) ? d * d : INFINITY;
            sr += (double)b[i] * b[i];
        }
    else
        se = INFINITY;
    free(a);
    free(b);
    return sr > 0 ? sqrt(se / sr) : INFINITY;
}

/* Median of 7 event-timed calls per shape, for gpu_gemm's choice (cuBLAS
 * where loaded), and with STRATA_GEMM_BLAS=0 its choice among Strata's own
 * kernels, the other block height (STRATA_GEMM_BM) and no split-K
 * (STRATA_GEMM_SPLIT=1);
 * 790 TFLOP/s: cuBLAS bf16 measured on the same card. The weight rows are 64 fresh
 * quantised rows repeated (the values do not change the work); x is random.
 * At T = 4096 on the largest shape the default output is checked against
 * the tiled f32 kernel's. 990 TFLOP/s: the H200's dense f16 peak
 * (datasheet). Per Qwen3-8B layer: q, o (4096 -> 4096), k, v (-> 1024),
 * gate, up (-> 12288), down (12288 -> 4096); 36 layers. */
#define TG_NV 4

static void tg_bench(void)
{
    if (!test_begin_gpu("gpu/gemm/bench-8b"))
        return;
    /* F16: the same kernel with the least decoding; Q5_K and Q6_K: a Q4_K_M or Q5_K_M file's others */
    static const int btypes[] = {QT_Q4_K, QT_Q8_0, QT_F16, QT_Q5_K, QT_Q6_K};
    static const int shapes[][3] = {{4096, 12288, 2}, {12288, 4096, 1}, {4096, 4096, 2}, {4096, 1024, 2}};
    static const int Ts[] = {512, 4096};
    const double peak = 990e12;
    char err[256] = "";
    unsigned st = 4242u;
    for (int bi = 0; bi < (int)(sizeof btypes / sizeof *btypes); bi++) {
        int type = btypes[bi];
        const char *tn = quant_type(type)->name;
        double layer_ms[2] = {0, 0}, layer_own[2] = {0, 0}, layer_best[2] = {0, 0};
        for (int si = 0; si < 4; si++) {
            int n = shapes[si][0], rows = shapes[si][1];
            uint8_t *w0, *w;
            size_t ldw;
            float *deq;
            if (!CHECK(tg_weights(type, n, 64, test_rand(&st), &w0, &ldw, &deq) == 0, "weights"))
                return;
            w = malloc(ldw * rows);
            float *x = malloc((size_t)4096 * n * sizeof(float));
            for (int r = 0; w && r < rows; r++)
                memcpy(w + ldw * r, w0 + ldw * (r % 64), ldw);
            for (size_t k = 0; x && k < (size_t)4096 * n; k++)
                x[k] = 2.f * test_randf(&st);
            void *dw = w ? tg_upload(w, ldw * rows) : NULL, *dx = x ? tg_upload(x, (size_t)4096 * n * 4) : NULL;
            void *dy = gpu_test_alloc((size_t)4096 * rows * sizeof(float));
            void *dy2 = gpu_test_alloc((size_t)4096 * rows * sizeof(float));
            void *scratch = gpu_test_alloc(gpu_gemm_scratch_bytes(type, n, rows, 4096));
            if (CHECK(dw && dx && dy && dy2 && scratch, "out of memory"))
                for (int ti = 0; ti < 2; ti++) {
                    int T = Ts[ti];
                    /* gpu_gemm's choice; its choice among Strata's kernels; the other block height;
                     * split-K off */
                    static const char *const vname[TG_NV] = {"default", "own", "own alt bm", "own nosplit"};
                    double ms[TG_NV];
                    for (int v = 0; v < TG_NV; v++) {
                        if (v > 0)
                            setenv("STRATA_GEMM_BLAS", "0", 1);
                        if (v == 2)
                            setenv("STRATA_GEMM_BM", T > 1024 ? "128" : "256", 1);
                        if (v == 3)
                            setenv("STRATA_GEMM_SPLIT", "1", 1);
                        ms[v] = gpu_gemm_test_ms(type, dw, ldw, n, rows, dx, T, dy, rows, scratch, 7, err,
                                                 sizeof err);
                        unsetenv("STRATA_GEMM_BLAS");
                        unsetenv("STRATA_GEMM_BM");
                        unsetenv("STRATA_GEMM_SPLIT");
                        if (!CHECK(ms[v] > 0, "%s timing: %s", tn, err))
                            break;
                        double tf = 2.0 * T * n * rows / (ms[v] * 1e-3) / 1e12;
                        printf("  bench %-4s T=%-4d n=%-5d rows=%-5d %-11s %8.3f ms %6.1f TFLOP/s (%4.1f%% of 990, "
                               "%4.1f%% of 790)\n", tn, T, n, rows, vname[v], ms[v], tf, 100 * tf * 1e12 / peak,
                               100 * tf / 790);
                    }
                    if (ms[0] > 0 && ms[1] > 0 && ms[2] > 0 && ms[3] > 0) {
                        double best = ms[1];
                        for (int v = 2; v < TG_NV; v++)
                            best = ms[v] < best ? ms[v] : best;
                        layer_ms[ti] += shapes[si][2] * ms[0];
                        layer_own[ti] += shapes[si][2] * ms[1];
                        layer_best[ti] += shapes[si][2] * best;
                    }
                    if (si == 0 && T == 4096) { /* the default result at scale against the f32 kernel */
                        int ok = gpu_gemm(type, dw, ldw, n, rows, dx, T, dy, rows, scratch, NULL, err, sizeof err) == 0;
                        setenv("STRATA_GEMM_PORTABLE", "1", 1);
                        double tms = ok ? gpu_gemm_test_ms(type, dw, ldw, n, rows, dx, T, dy2, rows, scratch, 1, err,
                                                           sizeof err) : -1;
                        unsetenv("STRATA_GEMM_PORTABLE");
                        double d = tms > 0 ? tg_devdiff(dy, dy2, (size_t)T * rows) : INFINITY;
                        printf("  bench %-4s T=4096 n=%d rows=%d tiled f32 kernel %.1f ms (%.1f TFLOP/s); default vs "
                               "tiled nerr %.2e\n", tn, n, rows, tms, 2.0 * T * n * rows / (tms * 1e-3) / 1e12, d);
                        CHECK(d <= TG_BOUND_MMA, "%s at scale: default vs tiled nerr %.3g > %.0e (%s)", tn, d,
                              TG_BOUND_MMA, err);
                    }
                }
            gpu_test_free(dw);
            gpu_test_free(dx);
            gpu_test_free(dy);
            gpu_test_free(dy2);
            gpu_test_free(scratch);
            free(w0);
            free(w);
            free(deq);
            free(x);
        }
        for (int ti = 0; ti < 2; ti++)
            if (layer_ms[ti] > 0)
                printf("  bench %-4s T=%-4d 36 Qwen3-8B layers' matrices: %.1f ms -> %.0f tok/s (own kernels: %.0f "
                       "tok/s, best own variant per shape: %.0f tok/s; matrices only)\n", tn, Ts[ti],
                       36 * layer_ms[ti], Ts[ti] / (36 * layer_ms[ti] * 1e-3), Ts[ti] / (36 * layer_own[ti] * 1e-3),
                       Ts[ti] / (36 * layer_best[ti] * 1e-3));
    }
}

/* ==== gpu_gemm_experts: groups against FP64 ====
 * Seven matrices of 200 rows (row tiles clamp at the end) over groups of 0,
 * 37, 1, 132, 130, 1 and 259 rows, 9 rows after the last group that must
 * stay untouched, as must the row gaps; each group's rows against the FP64
 * product with its own matrix, by the gemm bounds above. Kernels: the
 * tensor-core choice (128-row tiles at this mean: 259 rows take two whole
 * and a partial one), the 256-row tile (one whole and a partial), and the
 * tiled f32 kernel. */
static void tg_experts(void)
{
    if (!test_begin_gpu("gpu/gemm/experts"))
        return;
    static const int types[] = {QT_Q4_K, QT_Q8_0, QT_F16, QT_Q6_K};
    static const int32_t offs[] = {0, 0, 37, 38, 170, 300, 301, 560};
    enum { X = 7, ROWS = 200, N = 768, T = 569 }; /* (N: Q6_K rows of 630 bytes, as the 30B-A3B's down) */
    const int kernels[] = {TG_OWN, TG_BM256, TG_TILED};
    size_t ldy = ROWS + 4, ybytes = ldy * T * sizeof(float);
    unsigned st = 4242u;
    float *x = malloc((size_t)T * N * sizeof(float)), *y = malloc(ybytes);
    double *ref = malloc((size_t)T * ROWS * sizeof(double));
    void *dx = gpu_test_alloc((size_t)T * N * sizeof(float)), *dy = gpu_test_alloc(ybytes);
    void *doffs = tg_upload(offs, sizeof offs);
    size_t sbytes = gpu_gemm_experts_scratch_bytes(N, T);
    void *scratch = gpu_test_alloc(sbytes ? sbytes : 16);
    if (!CHECK(x && y && ref && dx && dy && doffs && scratch, "out of memory"))
        goto done;
    for (int k = 0; k < T * N; k++)
        x[k] = 2.f * test_randf(&st);
    if (!CHECK(gpu_test_copy(dx, x, (size_t)T * N * sizeof(float), 0) == 0, "upload"))
        goto done;
    for (size_t ti = 0; ti < sizeof types / sizeof *types; ti++) {
        int type = types[ti];
        const char *tname = quant_type(type)->name;
        uint8_t *w;
        size_t ldw;
        float *deq;
        if (!CHECK(tg_weights(type, N, X * ROWS, 900u + (unsigned)ti, &w, &ldw, &deq) == 0, "weights"))
            continue;
        void *dw = tg_upload(w, ldw * X * ROWS);
        for (int e = 0; e < X; e++) { /* the reference: group e's rows times matrix e */
            struct tg_ref rj = {x + (size_t)offs[e] * N, deq + (size_t)e * ROWS * N, N, ROWS,
                                ref + (size_t)offs[e] * ROWS};
            tg_parallel(offs[e + 1] - offs[e], tg_ref_token, &rj);
        }
        double worst[3] = {0, 0, 0};
        for (int ki = 0; ki < 3 && dw; ki++) {
            char err[256] = "";
            const char *kname = tg_kname[kernels[ki]];
            tg_kernel_env(kernels[ki]);
            int ok = CHECK(gpu_gemm_test_fill(dy, 0xff, ybytes) == 0, "fill failed") &&
                     CHECK(gpu_gemm_experts(type, dw, ldw, ldw * ROWS, N, ROWS, dx, T, doffs, X, dy, ldy, scratch,
                                            NULL, err, sizeof err) == 0, "%s %s: %s", tname, kname, err) &&
                     CHECK(gpu_test_copy(y, dy, ybytes, 1) == 0, "%s %s: copy back failed (a kernel fault)", tname,
                           kname);
            tg_kernel_env(TG_DEFAULT);
            if (!ok)
                continue;
            struct tg_score sc = tg_score_of(y, ldy, T, offs[X], ROWS, ref);
            double bound = kernels[ki] == TG_TILED ? TG_BOUND_F32 : TG_BOUND_MMA;
            worst[ki] = sc.nerr;
            CHECK(sc.nonfinite == 0, "%s %s: %ld outputs not finite (unwritten or NaN)", tname, kname, sc.nonfinite);
            CHECK(sc.touched == 0, "%s %s: %ld values written outside the groups' rows", tname, kname, sc.touched);
            CHECK(sc.nerr <= bound, "%s %s: normalised error %.3g > %.3g", tname, kname, sc.nerr, bound);
        }
        printf("  experts %-5s nerr: own %.2e, bm256 %.2e [bound %.0e]; tiled %.2e [bound %.0e]\n", tname,
               worst[0], worst[1], TG_BOUND_MMA, worst[2], TG_BOUND_F32);
        gpu_test_free(dw);
        free(w);
        free(deq);
    }
done:
    gpu_test_free(dx);
    gpu_test_free(dy);
    gpu_test_free(doffs);
    gpu_test_free(scratch);
    free(x);
    free(y);
    free(ref);
}

void test_gpu_gemm(void)
{
    tg_dequant();
    for (int i = 0; i < TG_NTYPES; i++)
        tg_gemm_type(i);
    tg_experts();
    tg_bench();
}

#else

void test_gpu_gemm(void)
{
    test_begin_gpu("gpu/gemm"); /* skips: no GPU backend */
}

#endif
