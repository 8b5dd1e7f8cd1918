/*
 * test.c — Strata's test runner: runs every subsystem's cases and prints
 * `N passed, N failed, N skipped`; exits non-zero on any failure.
 *
 * Each case compares against something independent (an FP64 reference, the
 * reference engine's golden outputs, exact token ids). Cases that need
 * ../shared/testdata skip cleanly without it. `build/test NAME…` runs only
 * the cases whose names contain one of the arguments.
 */
#include "strata.h"
#include "test.h"

#include <math.h>
#include <stdarg.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/stat.h>
#include <unistd.h>

/* ---- the runner ---- */

static int n_pass, n_fail, n_skip;
static const char *cur;      /* current case name (cur_name), NULL between cases */
static char cur_name[256];
static int cur_failed, cur_skipped, cur_on;
static char **filters;
static int n_filters;

static void end_case(void)
{
    if (!cur)
        return;
    if (!cur_on) {
    } else if (cur_failed) {
        n_fail++;
        printf("FAIL %s\n", cur);
    } else if (cur_skipped) {
        n_skip++;
    } else {
        n_pass++;
        printf("ok   %s\n", cur);
    }
    fflush(stdout);
    cur = NULL;
}

static int selected(const char *name)
{
    if (n_filters == 0)
        return 1;
    for (int i = 0; i < n_filters; i++)
        if (strstr(name, filters[i]))
            return 1;
    return 0;
}

int test_begin(const char *name)
{
    end_case();
    snprintf(cur_name, sizeof cur_name, "%s", name);
    cur = cur_name;
    cur_failed = cur_skipped = 0;
    cur_on = selected(name);
    return cur_on;
}

void test_skip(const char *why)
{
    if (cur && cur_on && !cur_skipped) {
        cur_skipped = 1;
        printf("skip %s (%s)\n", cur, why);
    }
}

int test_begin_gpu(const char *name)
{
    if (!test_begin(name))
        return 0;
    if (gpu_devices(NULL, 0) == 0) {
#ifdef STRATA_GPU
        test_skip("no GPU");
#else
        test_skip("no GPU backend in this build");
#endif
        return 0;
    }
    return 1;
}

int test_failf(const char *file, int line, const char *fmt, ...)
{
    cur_failed = 1;
    fprintf(stdout, "  %s:%d: ", file, line);
    va_list ap;
    va_start(ap, fmt);
    vfprintf(stdout, fmt, ap);
    va_end(ap);
    fputc('\n', stdout);
    return 0;
}

/* ---- helpers for the cases ---- */

const char *test_data(const char *rel, char *buf, size_t cap)
{
    const char *dir = getenv("STRATA_TESTDATA");
    if (!dir)
        dir = "../shared/testdata";
    struct stat st;
    if (stat(dir, &st) != 0 || !S_ISDIR(st.st_mode)) {
        test_skip("no ../shared/testdata");
        return NULL;
    }
    snprintf(buf, cap, "%s/%s", dir, rel);
    return buf;
}

char *test_read_file(const char *path, size_t *len)
{
    FILE *f = fopen(path, "rb");
    if (!f)
        return NULL;
    size_t cap = 1 << 16, n = 0;
    char *buf = malloc(cap + 1);
    size_t got;
    while (buf && (got = fread(buf + n, 1, cap - n, f)) > 0) {
        n += got;
        if (n == cap) {
            char *nb = realloc(buf, 2 * cap + 1);
            if (!nb) {
                free(buf);
                buf = NULL;
                break;
            }
            buf = nb;
            cap *= 2;
        }
    }
    fclose(f);
    if (buf) {
        buf[n] = 0;
        if (len)
            *len = n;
    }
    return buf;
}

int test_slow(void)
{
    const char *s = getenv("STRATA_SLOW");
    return s && *s && strcmp(s, "0") != 0;
}

int test_cores(int most)
{
    long n = sysconf(_SC_NPROCESSORS_ONLN);
    return n < 1 ? 1 : n > most ? most : (int)n;
}

double test_lse(const float *lg, int V)
{
    float mx = lg[0];
    for (int i = 1; i < V; i++)
        mx = lg[i] > mx ? lg[i] : mx;
    double s = 0;
    for (int i = 0; i < V; i++)
        s += exp((double)lg[i] - mx);
    return mx + log(s);
}

unsigned test_rand(unsigned *state)
{
    /* xorshift32: enough for test inputs, the same on every machine */
    unsigned x = *state ? *state : 2463534242u;
    x ^= x << 13;
    x ^= x >> 17;
    x ^= x << 5;
    return *state = x;
}

float test_randf(unsigned *state)
{
    return (float)((test_rand(state) >> 8) * (2.0 / 16777216.0) - 1.0);
}

void test_weight_row(int qtype, void *row, int n, float amax, unsigned *state)
{
    const struct quant_type *qt = quant_type(qtype);
    if (!qt->from_f32) {
        size_t rb = quant_row_bytes(qtype, n);
        for (size_t i = 0; i < rb; i++)
            ((uint8_t *)row)[i] = (uint8_t)(test_rand(state) >> 24);
        quant_lattice_row(qtype, row, n, amax);
        return;
    }
    float *v = malloc((size_t)n * sizeof *v);
    for (int i = 0; i < n; i++)
        v[i] = test_randf(state) * amax;
    qt->from_f32(v, row, n);
    free(v);
}

void test_err_add(struct test_err *e, const float *got, const double *ref, size_t n)
{
    for (size_t i = 0; i < n; i++) {
        double d = fabs((double)got[i] - ref[i]);
        if (d != d)
            d = INFINITY; /* NaN: an output not written, or a bad weight */
        e->max = d > e->max ? d : e->max;
        e->ss += d * d;
        e->n++;
    }
}

double test_err_rms(const struct test_err *e)
{
    return e->n ? sqrt(e->ss / (double)e->n) : 0;
}

void test_poison(float *x, size_t n)
{
    memset(x, 0xff, n * sizeof *x);
}

int main(int argc, char **argv)
{
    filters = argv + 1;
    n_filters = argc - 1;
    test_gguf();
    test_quant();
    test_tok();
    test_json();
    test_sample();
    test_model();
    test_synth();
    test_kv();
    test_attn();
    test_cli();
    test_demo();
    test_http();
    test_gpu();
    test_gpu_gemm();
    test_gpu_attn();
    test_gpu_rdna2();
    end_case();
    printf("%d passed, %d failed, %d skipped\n", n_pass, n_fail, n_skip);
    return n_fail ? 1 : 0;
}
