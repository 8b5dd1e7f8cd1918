/*
 * test.h — the test runner's checks, shared by test.c and the test_*.c files.
 *
 * A case starts with test_begin(name) and ends at the next test_begin or at
 * the end of the run; it passes when none of its checks failed, and counts as
 * skipped when it called test_skip (a missing ../shared, no GPU). Each test_*.c
 * file exports one test_<subsystem>() that runs its cases.
 */
#ifndef STRATA_TEST_H
#define STRATA_TEST_H

#include <stddef.h>

/* Returns 0 when the case is filtered out (`build/test NAME…`): skip its work. */
int test_begin(const char *name);
void test_skip(const char *why);
/* test_begin for a case that needs a GPU: also 0, after test_skip, when the
 * machine has none ("no GPU") or the build has no GPU backend. */
int test_begin_gpu(const char *name);
/* Records a failure of the current case with a message; returns 0. */
int test_failf(const char *file, int line, const char *fmt, ...)
    __attribute__((format(printf, 3, 4)));
#define CHECK(cond, ...) ((cond) ? 1 : test_failf(__FILE__, __LINE__, __VA_ARGS__))

/* ../shared/testdata (or $STRATA_TESTDATA) joined with rel into buf; NULL,
 * after test_skip, when the folder is absent. */
const char *test_data(const char *rel, char *buf, size_t cap);
/* Whole file into a malloc'd NUL-terminated buffer; NULL if unreadable. */
char *test_read_file(const char *path, size_t *len);
/* Nonzero when STRATA_SLOW is set (make test-slow). */
int test_slow(void);
/* The host's online cores, at least 1 and at most most: the threads of a
 * case's host-side references. */
int test_cores(int most);
/* A deterministic random stream for test inputs. */
/* log Σ exp(lg[0..V)) in double: log-probabilities from logits. */
double test_lse(const float *lg, int V);
unsigned test_rand(unsigned *state);
float test_randf(unsigned *state); /* uniform in [-1, 1) */
/* A random weight row of n elements of a block type: n values uniform in
 * ±amax (test_randf) quantised, or for the IQ2/IQ3 lattices, which have no
 * quantiser, random codes of that width (quant_lattice_row). */
void test_weight_row(int qtype, void *row, int n, float amax, unsigned *state);

/* Max abs and RMS error of computed values against a reference; a NaN or
 * infinite value counts as an infinite error. Zero-initialise, then add. */
struct test_err {
    double max, ss;
    long n;
};
void test_err_add(struct test_err *e, const float *got, const double *ref, size_t n);
double test_err_rms(const struct test_err *e);
/* Fills x with NaN (0xFF bytes), so that an output left unwritten shows. */
void test_poison(float *x, size_t n);

void test_gguf(void);
void test_quant(void);
void test_tok(void);
void test_json(void);
void test_sample(void);
void test_model(void);
void test_cli(void);
void test_synth(void);
void test_kv(void);
void test_attn(void);
void test_demo(void);
void test_http(void);
void test_gpu(void);
void test_gpu_gemm(void);
void test_gpu_attn(void);
void test_gpu_rdna2(void);

#endif
