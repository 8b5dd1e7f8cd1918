/*
 * test_gpu_rdna2.c — attn_hip.hip's kernels without matrix cores, run
 * through the CUDA build (GPU builds with a device; skipped otherwise): kv.c
 * pages built on the host and copied to the device, each kernel against an
 * FP64 reference over the original f32 K/V and against attn.c's CPU path
 * over the same pages (its RMS error is the yardstick: the GPU's may be at
 * most 1.25x it), outputs poisoned first, time per chunk from events.
 * Cases: every cell a query (C 1,500, T 1,500), the QSA identity-to-sparse
 * edge (C 2,100, T 256, k 2048), the long context (C 32,768, T 2,048, with
 * STRATA_SLOW), and the default table byte-identical with
 * STRATA_PROMPT_ATTN_RDNA2 set where it does not apply.
 */
#include "strata.h"
#include "test.h"
#include "test_attn.h"

#include <math.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#ifdef STRATA_GPU
#include "gpu.h"

/* ---- references and statistics ---- */

/* Max abs bounds against FP64 per format: attn.c's (test_attn_bound), but a
 * flat 1e-4 for f32 cells. */
static double rd_bound(int cell, int C)
{
    return cell == KV_CELL_F32 ? 1e-4 : test_attn_bound(cell, C);
}

/* FP64 rows: every `every`-th query and the last 4 (the decode window). */
#define RD_W 4
static int rd_wanted(int t, int T, int every)
{
    return t % every == 0 || t >= T - RD_W;
}

static double *rd_ref(const struct test_attn_data *d, int qsa, int every)
{
    size_t HE = (size_t)d->H * d->E;
    double *ref = calloc((size_t)d->T * HE, sizeof *ref), *s = malloc((size_t)d->C * sizeof *s);
    for (int t = 0; t < d->T; t++)
        for (int h = 0; rd_wanted(t, d->T, every) && h < d->H; h++) {
            const int32_t *cells = qsa ? d->sel + d->off[t] : NULL;
            int n = qsa ? (int)(d->off[t + 1] - d->off[t]) : d->C - d->T + t + 1;
            test_attn_ref_row(d, t, h, cells, n, s, ref + t * HE + (size_t)h * d->E);
        }
    free(s);
    return ref;
}

static void rd_err(const struct test_attn_data *d, const float *got, const double *ref, int t0, int T, int every,
                   struct test_err *e)
{
    size_t HE = (size_t)d->H * d->E;
    for (int t = t0; t < t0 + T; t++)
        if (rd_wanted(t, d->T, every))
            test_err_add(e, got + (t - t0) * HE, ref + t * HE, HE);
}

/* ---- one GPU call ---- */

struct rcall {
    struct gpu_attn a;
    int n_pages, max_pages;
};

/* Queries t0..t0+T-1 of d (their lists when qsa) over layer 1 of kv. */
static struct rcall rd_call(const struct test_attn_data *d, struct kv *kv, int t0, int T, int qsa, int64_t *off_buf)
{
    struct kv_layout lo;
    kv_layout(kv, &lo);
    struct rcall c;
    memset(&c, 0, sizeof c);
    c.n_pages = lo.n_pages;
    c.max_pages = lo.max_pages;
    c.a.kv = (struct gpu_kv){lo.data, lo.page_bytes, lo.kbytes, lo.vbytes, kv_cfg(kv)->cell, 2, d->K, d->E, lo.P,
                             kv_page_table(kv, 0)};
    c.a.layer = 1;
    c.a.q = d->q + (size_t)t0 * d->H * d->E;
    c.a.H = d->H;
    c.a.T = T;
    c.a.max_cells = d->C;
    c.a.scale = 1.0f / sqrtf((float)d->E);
    if (qsa) {
        for (int t = 0; t <= T; t++)
            off_buf[t] = d->off[t0 + t] - d->off[t0];
        c.a.sel = d->sel + d->off[t0];
        c.a.sel_off = off_buf;
    }
    return c;
}

static const char *const rd_entry_names[8] = {"prompt_rdna2", "decode_rdna2", "qsa_prompt_rdna2",
                                              "qsa_decode_rdna2", "table prompt", "table decode",
                                              "table qsa_prompt", "table qsa_decode"};

/* Runs entry `which` into out (host); the time per call in *ms. */
static int rd_run(struct rcall *c, int pos0, int which, int reps, float *out, float *ms)
{
    char err[256];
    c->a.out = out;
    c->a.pos0 = &pos0;
    int rc = gpu_attn_rdna2_test(&c->a, c->n_pages, c->max_pages, which, reps, ms, err, sizeof err);
    CHECK(rc == 0, "%s: %s", rd_entry_names[which], err);
    return rc;
}

/* ---- the cases ---- */

struct rcase {
    int E, G, K, C, T, P, topk, local, every, reps;
    unsigned cells;           /* bit per enum kv_cell */
};

/* GPU (out) and CPU (cpu) against FP64 on the wanted rows of queries
 * t0..t0+T-1; checks the bound and the RMS ratio; prints one line. */
static void rd_report(const struct test_attn_data *d, const char *what, int cell, const float *out, const float *cpu,
                      const double *ref, int t0, int T, int every, float ms)
{
    struct test_err eg = {0}, ec = {0}, gc = {0};
    rd_err(d, out, ref, t0, T, every, &eg);
    rd_err(d, cpu, ref, t0, T, every, &ec);
    size_t HE = (size_t)d->H * d->E;
    for (size_t i = 0; i < (size_t)T * HE; i++) {
        double x = fabs((double)out[i] - cpu[i]);
        x = x == x ? x : INFINITY;
        gc.max = x > gc.max ? x : gc.max;
    }
    double ratio = test_err_rms(&ec) > 0 ? test_err_rms(&eg) / test_err_rms(&ec) : 0;
    printf("     %-5s %-18s vs FP64 max %.2e rms %.2e | CPU rms %.2e, ratio %.3f | vs CPU max %.2e | %8.3f ms/chunk\n",
           kv_cell_name(cell), what, eg.max, test_err_rms(&eg), test_err_rms(&ec), ratio, gc.max, ms);
    CHECK(eg.max <= rd_bound(cell, d->C), "%s: max %.3e above %.1e", what, eg.max, rd_bound(cell, d->C));
    CHECK(test_err_rms(&eg) <= 1.25 * test_err_rms(&ec) + 1e-7, "%s: rms %.3e above 1.25 x the CPU's %.3e", what,
          test_err_rms(&eg), test_err_rms(&ec));
}

static void rd_case(const struct rcase *cf, struct pool *pool)
{
    char err[256], name[96];
    if (gpu_devices(NULL, 0) == 0) {
        for (int cell = 0; cell < KV_CELL_COUNT; cell++) {
            snprintf(name, sizeof name, "gpu/rdna2/E%d-G%d-C%d-T%d/%s", cf->E, cf->G, cf->C, cf->T,
                     kv_cell_name(cell));
            if (cf->cells >> cell & 1 && test_begin(name))
                test_skip("no GPU");
        }
        return;
    }
    struct test_attn_data d;
    test_attn_make(&d, cf->E, cf->G, cf->K, cf->C, cf->T, cf->topk, cf->local, 7u + (unsigned)cf->C, 0.5f, 64);
    int T = d.T, pos0 = d.C - T, H = d.H, E = d.E, W = RD_W;
    size_t HE = (size_t)H * E, n_out = (size_t)T * HE;
    double *ref = rd_ref(&d, 0, cf->every), *refq = rd_ref(&d, 1, cf->every);
    float *out = malloc(n_out * 4), *out2 = malloc(n_out * 4), *cpu = malloc(n_out * 4);
    int64_t *offb = malloc((size_t)(T + 1) * sizeof *offb);
    struct attn *at;
    if (!CHECK(attn_new(&at, H, d.K, E, W, pool_size(pool), err, sizeof err) == 0, "%s", err))
        return;
    for (int cell = 0; cell < KV_CELL_COUNT; cell++) {
        if (!(cf->cells >> cell & 1))
            continue;
        snprintf(name, sizeof name, "gpu/rdna2/E%d-G%d-C%d-T%d/%s", E, d.G, d.C, T, kv_cell_name(cell));
        if (!test_begin(name))
            continue;
        struct kv *kv = test_attn_kv(&d, cell, cf->P, 0, NULL);
        if (!kv)
            continue;
        float ms;
        /* dense prompt over all T queries */
        struct attn_job j = {kv, 0, 1, d.q, cpu, T, pos0, 0, 0, 0, NULL, NULL};
        test_poison(cpu, n_out);
        CHECK(attn_prompt(at, pool, &j, err, sizeof err) == 0, "%s", err);
        struct rcall c = rd_call(&d, kv, 0, T, 0, offb);
        if (rd_run(&c, pos0, 0, cf->reps, out, &ms) == 0)
            rd_report(&d, "dense prompt", cell, out, cpu, ref, 0, T, cf->every, ms);
        /* decode: the last W queries, split and merged, against attn.c's split */
        struct attn_job jd = {kv, 0, 1, d.q + (size_t)(T - W) * HE, cpu, W, d.C - W, 0, 0, 0, NULL, NULL};
        CHECK(attn_decode(at, pool, &jd, err, sizeof err) == 0, "%s", err);
        c = rd_call(&d, kv, T - W, W, 0, offb);
        if (rd_run(&c, d.C - W, 1, cf->reps, out, &ms) == 0)
            rd_report(&d, "dense decode W=4", cell, out, cpu, ref, T - W, W, cf->every, ms);
        /* QSA prompt: without split (rdna2) and split + merge (HIP's default) */
        j.sel = d.sel;
        j.sel_off = d.off;
        test_poison(cpu, n_out);
        CHECK(attn_qsa_prompt(at, pool, &j, err, sizeof err) == 0, "%s", err);
        c = rd_call(&d, kv, 0, T, 1, offb);
        if (rd_run(&c, pos0, 2, cf->reps, out, &ms) == 0)
            rd_report(&d, cell == KV_CELL_INT8 ? "QSA prompt (int8)" : "QSA prompt", cell, out, cpu, refq, 0, T,
                      cf->every, ms);
        if (rd_run(&c, pos0, 3, cf->reps, out2, &ms) == 0)
            rd_report(&d, "QSA split prompt", cell, out2, cpu, refq, 0, T, cf->every, ms);
        /* queries that select every cell: QSA equals dense attention (the
         * staged kernels bit for bit, int8's 4-byte value phase to rounding) */
        int full = 0;
        while (full < T && d.off[full + 1] - d.off[full] == pos0 + full + 1)
            full++;
        if (full > 0 && full < T) {
            float *dense = cpu;
            rd_run(&c, pos0, 0, 0, dense, &ms);
            int same = memcmp(dense, out, (size_t)full * HE * 4) == 0;
            double dmax = 0;
            for (size_t i = 0; i < (size_t)full * HE; i++)
                dmax = fmax(dmax, fabs((double)dense[i] - out[i]));
            printf("     %-5s %d queries select every cell: QSA vs dense %s (max %.2e)\n", kv_cell_name(cell),
                   full, same ? "bit-identical" : "differ", dmax);
            CHECK(cell == KV_CELL_INT8 ? dmax <= 1e-5 : same, "QSA over every cell differs from dense: %.3e", dmax);
            CHECK(memcmp(dense + (size_t)(T - 1) * HE, out + (size_t)(T - 1) * HE, HE * 4) != 0,
                  "the last query dropped cells and still equals dense");
        }
        /* QSA decode: the last W queries' lists, split */
        struct attn_job jq = {kv, 0, 1, d.q + (size_t)(T - W) * HE, cpu, W, d.C - W, 0, 0, 0, NULL, offb};
        c = rd_call(&d, kv, T - W, W, 1, offb);
        jq.sel = c.a.sel;
        CHECK(attn_qsa_decode(at, pool, &jq, err, sizeof err) == 0, "%s", err);
        if (rd_run(&c, d.C - W, 3, cf->reps, out, &ms) == 0)
            rd_report(&d, "QSA decode W=4", cell, out, cpu, refq, T - W, W, cf->every, ms);
        kv_free(kv);
    }
    attn_free(at);
    test_attn_free(&d);
    free(ref);
    free(refq);
    free(out);
    free(out2);
    free(cpu);
    free(offb);
}

/* STRATA_PROMPT_ATTN_RDNA2=1 must leave the table's QSA prompt
 * byte-identical wherever it does not apply: f16 KV on any card, and int8
 * KV off gfx103x (any NVIDIA card: a CUDA build's table is attn_cuda.cu's,
 * which the switch must not touch). Where it applies (int8 on gfx103x) the
 * kernel name changes and the RDNA2 cases above cover its numerics. */
static void rd_case_default(void)
{
    if (!test_begin_gpu("gpu/rdna2/default-identical"))
        return;
    struct test_attn_data d;
    test_attn_make(&d, 128, 4, 2, 2100, 64, 2048, 64, 11u, 0.5f, 64);
    size_t n = (size_t)d.T * d.H * d.E;
    float *a = malloc(n * 4), *b = malloc(n * 4), ms;
    int64_t *offb = malloc((size_t)(d.T + 1) * sizeof *offb);
    char err[256];
    const char *was = getenv("STRATA_PROMPT_ATTN_RDNA2");
    char *saved = was ? strdup(was) : NULL;
    static const int cells[2] = {KV_CELL_F16, KV_CELL_INT8};
    for (int i = 0; i < 2; i++) {
        struct kv *kv = test_attn_kv(&d, cells[i], 64, 0, NULL);
        if (!kv)
            break;
        struct rcall c = rd_call(&d, kv, 0, d.T, 1, offb);
        unsetenv("STRATA_PROMPT_ATTN_RDNA2");
        const char *n0 = gpu_attn_kernel_name(&c.a, 0, 1);
        c.a.out = a;
        int rc = gpu_attn_rdna2_test(&c.a, c.n_pages, c.max_pages, 6, 0, &ms, err, sizeof err);
        setenv("STRATA_PROMPT_ATTN_RDNA2", "1", 1);
        const char *n1 = gpu_attn_kernel_name(&c.a, 0, 1);
        c.a.out = b;
        if (rc == 0)
            rc = gpu_attn_rdna2_test(&c.a, c.n_pages, c.max_pages, 6, 0, &ms, err, sizeof err);
        kv_free(kv);
        if (rc) {
            /* the table (attn_cuda.cu under CUDA) does not serve this call */
            test_skip(err);
            break;
        }
        int same = memcmp(a, b, n * 4) == 0;
        double dmax = 0;
        for (size_t k = 0; k < n; k++)
            dmax = fmax(dmax, fabs((double)a[k] - b[k]));
        printf("     %-5s QSA prompt kernel: unset %s, STRATA_PROMPT_ATTN_RDNA2=1 %s: output %s (max %.2e)\n",
               kv_cell_name(cells[i]), n0, n1, same ? "byte-identical" : "differs", dmax);
        CHECK(cells[i] == KV_CELL_INT8 || strcmp(n0, n1) == 0, "the switch changed the f16 kernel");
        CHECK(strcmp(n0, n1) != 0 || same, "the switch changed the output where it does not apply");
        /* where it applies: another summation order of the same cells */
        CHECK(dmax <= 1e-5, "the switch moved the output by %.3e", dmax);
    }
    if (saved)
        setenv("STRATA_PROMPT_ATTN_RDNA2", saved, 1);
    else
        unsetenv("STRATA_PROMPT_ATTN_RDNA2");
    free(saved);
    test_attn_free(&d);
    free(a);
    free(b);
    free(offb);
}

void test_gpu_rdna2(void)
{
    static const struct rcase cases[] = {
        /* every cell a query; pages of 32 cells, so a chunk spans two */
        {128, 4, 2, 1500, 1500, 32, 512, 64, 8, 3, 0x1f},
        /* QSA k = 2048 on 2,100 cells: the first queries select all, the last do not */
        {256, 8, 1, 2100, 256, 64, 2048, 64, 4, 3, 0x1f},
        /* long context (STRATA_SLOW) */
        {128, 8, 2, 32768, 2048, 64, 2048, 64, 128, 3, 1u << KV_CELL_F16 | 1u << KV_CELL_INT8},
    };
    int n_cases = test_slow() ? 3 : 2;
    struct pool *pool = pool_new(test_cores(64));
    for (int i = 0; i < n_cases; i++)
        rd_case(&cases[i], pool);
    pool_free(pool);
    rd_case_default();
}

#else

void test_gpu_rdna2(void)
{
    test_begin_gpu("gpu/rdna2"); /* skips: no GPU backend */
}

#endif
