/*
 * test_quant.c — tests of quant.c against independent references: the half
 * conversions against a double-precision model on every half value and on
 * every rounding midpoint; each block format against the reference engine's
 * goldens (dequantisation and activation quantisation bit-exact, dot products
 * to float rounding); the SIMD dots against the scalar ones; the quantisers'
 * round-trip error against FP64; quant_gemm against a loop of scalar dots.
 */
#include "strata.h"
#include "test.h"

#include <math.h>
#include <stdlib.h>
#include <string.h>

/* ---- helpers ---- */

static uint32_t bits_of(float f)
{
    uint32_t u;
    memcpy(&u, &f, 4);
    return u;
}

static float float_of(uint32_t u)
{
    float f;
    memcpy(&f, &u, 4);
    return f;
}

/* A normal-ish random value: the sum of four uniforms, scaled. */
static float randn(unsigned *st)
{
    return (test_randf(st) + test_randf(st) + test_randf(st) + test_randf(st)) * 0.866f;
}

/* The value of a half, in double, straight from the definition. */
static double half_value(uint16_t h)
{
    int sign = h >> 15, e = (h >> 10) & 31, m = h & 1023;
    double v = e == 0 ? ldexp(m, -24) : e == 31 ? (m ? NAN : INFINITY) : ldexp(1024 + m, e - 25);
    return sign ? -v : v;
}

/* Nearest half to a finite float, ties to even, by search over the ordered
 * positive halves 0x0000..0x7c00 (0x7c00, inf, stands for "beyond 65520"). */
static uint16_t half_ref(float f)
{
    double x = fabs((double)f);
    uint16_t sign = f < 0 || (f == 0 && signbit(f)) ? 0x8000 : 0;
    if (x >= 65520.0)
        return sign | 0x7c00;
    int lo = 0, hi = 0x7c00; /* value(lo) <= x < value(hi) */
    while (hi - lo > 1) {
        int mid = (lo + hi) / 2;
        if (half_value((uint16_t)mid) <= x)
            lo = mid;
        else
            hi = mid;
    }
    double dlo = x - half_value((uint16_t)lo), dhi = half_value((uint16_t)hi) - x;
    int pick = dlo < dhi ? lo : dhi < dlo ? hi : (lo % 2 == 0 ? lo : hi);
    return sign | (uint16_t)pick;
}

/* Nearest bfloat16 to a finite float, ties to even, in double. */
static uint16_t bf16_ref(float f)
{
    uint32_t u = bits_of(f);
    uint32_t down = u & 0xffff0000u, up = down + 0x10000u;
    double x = f, vd = float_of(down), vu = (double)float_of(up & 0x7fffffffu) * (f < 0 ? -1 : 1);
    if ((up & 0x7f800000u) == 0x7f800000u && (down & 0x7f800000u) != 0x7f800000u)
        vu = f < 0 ? -INFINITY : INFINITY;
    double dd = fabs(x - vd), du = fabs(vu - x);
    uint32_t pick = dd < du ? down : du < dd ? up : ((down >> 16) % 2 == 0 ? down : up);
    return (uint16_t)(pick >> 16);
}

/* ---- half and bfloat16 conversions ---- */

static void case_f16(void)
{
    if (!test_begin("quant/f16-conversions"))
        return;
    const struct quant_type *f16 = quant_type(QT_F16);
    int bad_to = 0, bad_back = 0, bad_mid = 0, bad_rand = 0, bad_vec = 0;

    /* every half value to float and back */
    for (int h = 0; h < 65536; h++) {
        float f = quant_f16_to_f32((uint16_t)h);
        double ref = half_value((uint16_t)h);
        if (isnan(ref)) {
            /* NaN stays NaN; a quiet NaN keeps its payload both ways */
            if (!isnan(f) || ((h & 0x200) && quant_f32_to_f16(f) != h))
                bad_to++;
            continue;
        }
        if (bits_of(f) != bits_of((float)ref))
            bad_to++;
        if (quant_f32_to_f16(f) != h)
            bad_back++;
    }
    CHECK(bad_to == 0, "%d halves convert wrongly to float", bad_to);
    CHECK(bad_back == 0, "%d halves do not round-trip", bad_back);

    /* every midpoint between neighbouring finite halves, and one float ulp to
     * either side: ties go to the even half */
    float *batch = malloc(3 * 2 * 0x7c00 * sizeof *batch);
    uint16_t *want = malloc(3 * 2 * 0x7c00 * sizeof *want);
    uint16_t *got = malloc(3 * 2 * 0x7c00 * sizeof *got);
    int nb = 0;
    for (int h = 0; h < 0x7c00; h++) {
        double lo = half_value((uint16_t)h);
        double hi = h + 1 < 0x7c00 ? half_value((uint16_t)(h + 1)) : 65536.0;
        float mid = (float)((lo + hi) / 2); /* exact: halves have 11 bits */
        float around[3] = {mid, nextafterf(mid, 0), nextafterf(mid, INFINITY)};
        for (int k = 0; k < 3; k++)
            for (int sg = 0; sg < 2; sg++) {
                float v = sg ? -around[k] : around[k];
                batch[nb] = v;
                want[nb] = half_ref(v);
                if (quant_f32_to_f16(v) != want[nb])
                    bad_mid++;
                nb++;
            }
    }
    f16->from_f32(batch, got, nb);
    for (int i = 0; i < nb; i++)
        bad_vec += got[i] != want[i];
    CHECK(bad_mid == 0, "%d midpoint roundings wrong (of %d)", bad_mid, nb);
    CHECK(bad_vec == 0, "%d midpoint roundings wrong in the row converter", bad_vec);

    /* random floats over the whole exponent range of interest */
    unsigned st = 12345;
    nb = 0;
    for (int i = 0; i < 3 * 2 * 0x7c00; i++) {
        uint32_t u = (test_rand(&st) & 0x807fffffu) | (uint32_t)(100 + test_rand(&st) % 50) << 23;
        batch[nb] = float_of(u);
        want[nb] = half_ref(batch[nb]);
        bad_rand += quant_f32_to_f16(batch[nb]) != want[nb];
        nb++;
    }
    f16->from_f32(batch, got, nb);
    bad_vec = 0;
    for (int i = 0; i < nb; i++)
        bad_vec += got[i] != want[i];
    CHECK(bad_rand == 0, "%d random floats rounded wrongly", bad_rand);
    CHECK(bad_vec == 0, "%d random floats rounded wrongly by the row converter", bad_vec);
    free(batch);
    free(want);
    free(got);

    CHECK(quant_f32_to_f16(INFINITY) == 0x7c00 && quant_f32_to_f16(-INFINITY) == 0xfc00, "inf");
    CHECK(quant_f32_to_f16(1e10f) == 0x7c00 && quant_f32_to_f16(65504.f) == 0x7bff, "overflow");
    uint16_t hn = quant_f32_to_f16(NAN);
    CHECK((hn & 0x7c00) == 0x7c00 && (hn & 0x3ff), "NaN -> %#x", hn);

    /* bfloat16: widening is exact; narrowing rounds to nearest even */
    int bad_bf = 0;
    for (int h = 0; h < 65536; h++) {
        float f = quant_bf16_to_f32((uint16_t)h);
        if (bits_of(f) != (uint32_t)h << 16)
            bad_bf++;
    }
    const struct quant_type *bf = quant_type(QT_BF16);
    for (int i = 0; i < 100000; i++) {
        uint32_t u = (test_rand(&st) & 0x807fffffu) | (uint32_t)(1 + test_rand(&st) % 253) << 23;
        if (i % 4 == 0)
            u = (u & 0xffff0000u) | 0x8000u; /* an exact tie */
        float f = float_of(u);
        uint16_t b;
        bf->from_f32(&f, &b, 1);
        bad_bf += b != bf16_ref(f);
    }
    CHECK(bad_bf == 0, "%d bfloat16 conversions wrong", bad_bf);
}

/* ---- the reference engine's block goldens ---- */

static const char *const golden_files[] = {
    "f16", "bf16", "q4_0", "q4_1", "q5_0", "q5_1", "q8_0", "q2_K", "q3_K", "q4_K",
    "q5_K", "q6_K", "iq2_xxs", "iq2_xs", "iq2_s", "iq3_xxs", "iq3_s", "iq4_nl", "iq4_xs",
};

/* Sum of |w_k * a_k| over a row pair in double: the scale of a dot's rounding. */
static double dot_magnitude(const struct quant_type *t, const void *w, const void *a, int n)
{
    const struct quant_type *at = quant_type(t->dot_type);
    float *wf = malloc((size_t)n * sizeof *wf), *af = malloc((size_t)n * sizeof *af);
    t->to_f32(w, wf, n);
    at->to_f32(a, af, n);
    double m = 0;
    for (int i = 0; i < n; i++)
        m += fabs((double)wf[i] * af[i]);
    free(wf);
    free(af);
    return m;
}

static void golden_one(const char *name, char *cname, size_t cap)
{
    char rel[128], path[512], err[256];
    snprintf(cname, cap, "quant/golden-%s", name); /* the runner keeps the pointer */
    if (!test_begin(cname))
        return;
    snprintf(rel, sizeof rel, "quant/%s.gguf", name);
    if (!test_data(rel, path, sizeof path))
        return;
    struct gguf g;
    if (!CHECK(gguf_open(&g, path, err, sizeof err) == 0, "%s: %s", path, err))
        return;
    const struct gguf_tensor *w = gguf_tensor(&g, "w"), *wd = gguf_tensor(&g, "w_deq"),
                             *x = gguf_tensor(&g, "x"), *xq = gguf_tensor(&g, "xq"),
                             *dot = gguf_tensor(&g, "dot");
    if (!CHECK(w && wd && x && xq && dot, "missing tensors")) {
        gguf_close(&g);
        return;
    }
    const struct quant_type *t = quant_type(w->type);
    if (!CHECK(t && t->dot, "type %d unsupported", w->type)) {
        gguf_close(&g);
        return;
    }
    int n = (int)w->ne[0], rows = (int)w->ne[1];
    const struct quant_type *at = quant_type(t->dot_type);
    CHECK(xq->type == t->dot_type, "xq is type %d, expected %d", xq->type, t->dot_type);

    /* dequantisation: bit for bit */
    float *deq = malloc((size_t)n * rows * sizeof *deq);
    t->to_f32(w->data, deq, (int64_t)n * rows);
    const float *want = wd->data;
    int bad = 0, first = -1;
    for (int i = 0; i < n * rows; i++)
        if (bits_of(deq[i]) != bits_of(want[i]) && bad++ == 0)
            first = i;
    CHECK(bad == 0, "%s: %d of %d dequantised values differ (first at %d: %.9g vs %.9g)", name,
          bad, n * rows, first, first >= 0 ? deq[first] : 0, first >= 0 ? want[first] : 0);

    /* activation quantisation: byte for byte */
    size_t qbytes = quant_row_bytes(t->dot_type, n);
    uint8_t *aq = calloc(1, qbytes);
    at->from_f32(x->data, aq, n);
    size_t diff = 0;
    while (diff < qbytes && aq[diff] == ((const uint8_t *)xq->data)[diff])
        diff++;
    CHECK(diff == qbytes, "%s: quantised activation differs at byte %zu of %zu", name, diff, qbytes);

    /* Dot products against the golden xq, to float rounding. The integer parts
     * are exact, so the only difference is the order of float additions: its
     * error scales with sum|w*a|, not with the (possibly cancelled) result.
     * Pass: within 1e-5 of the result, or within 1e-6 of sum|w*a|. */
    double max_rel = 0, max_mag = 0;
    size_t rb = quant_row_bytes(w->type, n);
    for (int r = 0; r < rows; r++) {
        const void *wr = (const uint8_t *)w->data + r * rb;
        float s[2] = {0, 0}, ref = ((const float *)dot->data)[r];
        t->dot(n, &s[0], wr, xq->data);
        t->dot_scalar(n, &s[1], wr, xq->data);
        double m = dot_magnitude(t, wr, xq->data, n);
        for (int k = 0; k < 2; k++) {
            double e = fabs((double)s[k] - ref), rel = e / fmax(fabs(ref), 1e-30);
            max_rel = fmax(max_rel, rel);
            max_mag = fmax(max_mag, e / m);
            CHECK(rel <= 1e-5 || e <= 1e-6 * m, "%s row %d %s: %.9g vs %.9g", name, r,
                  k ? "dot_scalar" : "dot", s[k], ref);
        }
    }
    printf("     %-8s dot: max err %.2e of |dot|, %.2e of sum|w*a|\n", name, max_rel, max_mag);

    /* the matrix kernel on the same rows, with xq repeated as 16 tokens (the
     * tiled path where one exists) */
    const int na = 16;
    uint8_t *a16 = malloc(qbytes * na);
    float *y = malloc(sizeof *y * rows * na);
    for (int j = 0; j < na; j++)
        memcpy(a16 + j * qbytes, xq->data, qbytes);
    quant_gemm(w->type, n, w->data, rb, rows, a16, qbytes, na, y, rows);
    for (int j = 0; j < na; j++)
        for (int r = 0; r < rows; r++) {
            float ref = ((const float *)dot->data)[r], got = y[j * rows + r];
            double e = fabs((double)got - ref);
            double m = dot_magnitude(t, (const uint8_t *)w->data + r * rb, xq->data, n);
            CHECK(e <= 1e-5 * fabs(ref) || e <= 1e-6 * m, "%s gemm row %d token %d: %.9g vs %.9g",
                  name, r, j, got, ref);
        }
    free(a16);
    free(y);
    free(deq);
    free(aq);
    gguf_close(&g);
}

static void case_goldens(void)
{
    static char names[sizeof golden_files / sizeof *golden_files][40];
    for (size_t i = 0; i < sizeof golden_files / sizeof *golden_files; i++)
        golden_one(golden_files[i], names[i], sizeof names[i]);
}

/* ---- SIMD against scalar, on random blocks ---- */

static const int dot_types[] = {
    QT_F32, QT_F16, QT_BF16, QT_Q4_0, QT_Q4_1, QT_Q5_0, QT_Q5_1, QT_Q8_0, QT_Q2_K, QT_Q3_K,
    QT_Q4_K, QT_Q5_K, QT_Q6_K, QT_IQ2_XXS, QT_IQ2_XS, QT_IQ2_S, QT_IQ3_XXS, QT_IQ3_S,
    QT_IQ4_NL, QT_IQ4_XS,
};
#define N_DOT_TYPES ((int)(sizeof dot_types / sizeof *dot_types))

/* A random weight row of n elements: quantised random values where the type
 * has a quantiser, else random codes (the IQ2/IQ3 lattices). */
static void *random_row(int qtype, int n, unsigned *st)
{
    const struct quant_type *t = quant_type(qtype);
    size_t rb = quant_row_bytes(qtype, n);
    uint8_t *row = malloc(rb);
    if (t->from_f32) {
        float *x = malloc((size_t)n * sizeof *x);
        for (int i = 0; i < n; i++)
            x[i] = randn(st) * (i % 97 == 0 ? 4.f : 1.f);
        t->from_f32(x, row, n);
        free(x);
        return row;
    }
    test_weight_row(qtype, row, n, 4.0f, st);
    return row;
}

static void *random_act(int qtype, int n, unsigned *st)
{
    const struct quant_type *at = quant_type(quant_type(qtype)->dot_type);
    float *x = malloc((size_t)n * sizeof *x);
    for (int i = 0; i < n; i++)
        x[i] = randn(st);
    void *q = malloc(quant_row_bytes(quant_type(qtype)->dot_type, n));
    at->from_f32(x, q, n);
    free(x);
    return q;
}

/* rows random weight rows (act: activation rows in qtype's dot type) of n
 * elements, ld bytes apart, in one malloc'd buffer. */
static uint8_t *random_rows(int act, int qtype, int n, int rows, size_t ld, unsigned *st)
{
    size_t rb = quant_row_bytes(act ? quant_type(qtype)->dot_type : qtype, n);
    uint8_t *m = malloc(ld * (size_t)rows);
    for (int i = 0; i < rows; i++) {
        void *r = act ? random_act(qtype, n, st) : random_row(qtype, n, st);
        memcpy(m + (size_t)i * ld, r, rb);
        free(r);
    }
    return m;
}

static void case_simd(void)
{
    if (!test_begin("quant/simd-vs-scalar"))
        return;
    printf("     simd: %s\n", quant_simd_name());
    unsigned st = 777;
    const int n = 4096;
    double worst = 0;
    for (int ti = 0; ti < N_DOT_TYPES; ti++) {
        const struct quant_type *t = quant_type(dot_types[ti]);
        double max_rel = 0;
        for (int trial = 0; trial < 8; trial++) {
            void *w = random_row(dot_types[ti], n, &st), *a = random_act(dot_types[ti], n, &st);
            float s = 0, ss = 0;
            t->dot(n, &s, w, a);
            t->dot_scalar(n, &ss, w, a);
            double m = dot_magnitude(t, w, a, n);
            max_rel = fmax(max_rel, fabs((double)s - ss) / fmax(m, 1e-30));
            free(w);
            free(a);
        }
        /* integer parts are exact; only float summation order differs */
        CHECK(max_rel <= 1e-6, "%s: simd dot differs from scalar by %.3g of sum|w*a|", t->name,
              max_rel);
        worst = fmax(worst, max_rel);
    }
    printf("     max |simd - scalar| / sum|w*a| = %.2e over %d types\n", worst, N_DOT_TYPES);
}

/* ---- quantiser round trips against FP64 ---- */

struct rt_case {
    int qtype;
    double bound; /* RMS error / RMS value for unit normal data */
};

/* Bounds are about 1.2x the errors these quantisers give (and the reference's). */
static const struct rt_case rt_cases[] = {
    {QT_F16, 0.0004}, {QT_BF16, 0.003}, {QT_Q8_0, 0.006}, {QT_Q8_1, 0.006},
    {QT_Q8_K, 0.0095}, {QT_Q4_0, 0.11}, {QT_Q4_1, 0.10}, {QT_Q5_0, 0.055},
    {QT_Q5_1, 0.05}, {QT_Q2_K, 0.40}, {QT_Q3_K, 0.20}, {QT_Q4_K, 0.10},
    {QT_Q5_K, 0.05}, {QT_Q6_K, 0.025}, {QT_IQ4_NL, 0.10}, {QT_IQ4_XS, 0.10},
};

static void case_roundtrip(void)
{
    if (!test_begin("quant/quantiser-roundtrip"))
        return;
    unsigned st = 4242;
    const int n = 256 * 64;
    float *x = malloc(n * sizeof *x), *y = malloc(n * sizeof *y);
    for (int i = 0; i < n; i++)
        x[i] = randn(&st) * (i % 1000 == 0 ? 5.f : 1.f);
    for (size_t c = 0; c < sizeof rt_cases / sizeof *rt_cases; c++) {
        const struct quant_type *t = quant_type(rt_cases[c].qtype);
        void *q = malloc(quant_row_bytes(rt_cases[c].qtype, n));
        t->from_f32(x, q, n);
        t->to_f32(q, y, n);
        double se = 0, sx = 0, maxe = 0;
        for (int i = 0; i < n; i++) {
            double e = (double)y[i] - x[i];
            se += e * e;
            sx += (double)x[i] * x[i];
            maxe = fmax(maxe, fabs(e));
        }
        double rel = sqrt(se / sx);
        printf("     %-7s rms err %.4f (bound %.4f), max abs %.4f\n", t->name, rel,
               rt_cases[c].bound, maxe);
        CHECK(rel <= rt_cases[c].bound, "%s: round-trip rms error %.4f > %.4f", t->name, rel,
              rt_cases[c].bound);
        free(q);
    }
    free(x);
    free(y);
}

/* ---- quant_gemm against a loop of scalar dots ---- */

static void case_gemm(void)
{
    if (!test_begin("quant/gemm-vs-dot"))
        return;
    static const int nws[] = {1, 5, 16, 19, 64};
    static const int nas[] = {1, 2, 3, 8, 16, 17, 33, 64};
    unsigned st = 99;
    double worst = 0;
    for (int ti = 0; ti < N_DOT_TYPES; ti++) {
        int qt = dot_types[ti];
        const struct quant_type *t = quant_type(qt);
        int n = t->blck == 256 ? 512 : 96 * (1 + ti % 3) + (t->blck == 1 ? 7 : 0);
        size_t rbw = quant_row_bytes(qt, n), rba = quant_row_bytes(t->dot_type, n);
        size_t ldw = rbw + (ti % 2) * 2, lda = rba + 4; /* odd strides on purpose */
        int maxw = 64, maxa = 64;
        uint8_t *w = random_rows(0, qt, n, maxw, ldw, &st), *a = random_rows(1, qt, n, maxa, lda, &st);
        for (size_t iw = 0; iw < sizeof nws / sizeof *nws; iw++)
            for (size_t ia = 0; ia < sizeof nas / sizeof *nas; ia++) {
                int nw = nws[iw], na = nas[ia];
                size_t ldy = (size_t)nw + 3;
                float *y = malloc(ldy * na * sizeof *y);
                for (size_t k = 0; k < ldy * na; k++)
                    y[k] = -12345.f;
                quant_gemm(qt, n, w, ldw, nw, a, lda, na, y, ldy);
                for (int j = 0; j < na; j++)
                    for (int i = 0; i < (int)ldy; i++) {
                        float got = y[j * ldy + i];
                        if (i >= nw) {
                            CHECK(got == -12345.f, "%s: gemm wrote outside the output", t->name);
                            continue;
                        }
                        float ref;
                        t->dot_scalar(n, &ref, w + i * ldw, a + j * lda);
                        double m = dot_magnitude(t, w + i * ldw, a + j * lda, n);
                        double rel = fabs((double)got - ref) / fmax(m, 1e-30);
                        worst = fmax(worst, rel);
                        if (!CHECK(rel <= 1e-6, "%s nw=%d na=%d (%d,%d): %g vs %g", t->name,
                                   nw, na, i, j, got, ref)) {
                            free(y);
                            goto next_type;
                        }
                    }
                free(y);
            }
    next_type:
        free(w);
        free(a);
    }
    printf("     max |gemm - dot| / sum|w*a| = %.2e\n", worst);

    /* long rows: the tiled kernel packs tokens in several chunks */
    if (!test_begin("quant/gemm-chunks"))
        return;
    static const int long_types[] = {QT_Q8_0, QT_Q4_1, QT_Q4_K, QT_Q6_K, QT_Q2_K, QT_IQ4_XS};
    const int n = 8192, nw = 5, na = 40;
    worst = 0;
    for (size_t ti = 0; ti < sizeof long_types / sizeof *long_types; ti++) {
        int qt = long_types[ti];
        const struct quant_type *t = quant_type(qt);
        size_t rbw = quant_row_bytes(qt, n), rba = quant_row_bytes(t->dot_type, n);
        uint8_t *w = random_rows(0, qt, n, nw, rbw, &st), *a = random_rows(1, qt, n, na, rba, &st);
        float *y = malloc(sizeof *y * nw * na);
        quant_gemm(qt, n, w, rbw, nw, a, rba, na, y, nw);
        int bad = 0;
        for (int j = 0; j < na; j++)
            for (int i = 0; i < nw; i++) {
                float ref;
                t->dot_scalar(n, &ref, w + i * rbw, a + j * rba);
                double rel = fabs((double)y[j * nw + i] - ref) /
                             fmax(dot_magnitude(t, w + i * rbw, a + j * rba, n), 1e-30);
                worst = fmax(worst, rel);
                bad += rel > 1e-6;
            }
        CHECK(bad == 0, "%s: %d of %d long-row outputs differ", t->name, bad, nw * na);
        free(w);
        free(a);
        free(y);
    }
    printf("     max |gemm - dot| / sum|w*a| = %.2e (n = %d)\n", worst, n);
}

/* The two-step form the model uses: activations packed in two separate group
 * ranges (as two threads would), then row slices multiplied one by one, each
 * element checked against the scalar dot. */
static void case_gemm_packed(void)
{
    if (!test_begin("quant/gemm-packed-slices"))
        return;
    static const int types[] = {QT_Q8_0, QT_Q4_0, QT_Q4_1, QT_Q5_0, QT_Q4_K, QT_Q6_K, QT_IQ4_XS};
    const int nw = 23, na = 37, cut = 9; /* odd sizes: tile remainders everywhere */
    unsigned st = 7;
    double worst = 0;
    int tiled = 0;
    for (size_t ti = 0; ti < sizeof types / sizeof *types; ti++) {
        int qt = types[ti];
        const struct quant_type *t = quant_type(qt);
        int n = t->blck == 256 ? 512 : 256;
        if (!quant_gemm_tiled(qt, n, na))
            continue;
        tiled++;
        size_t rbw = quant_row_bytes(qt, n), rba = quant_row_bytes(t->dot_type, n);
        uint8_t *w = random_rows(0, qt, n, nw, rbw, &st), *a = random_rows(1, qt, n, na, rba, &st);
        size_t pb = quant_pack_bytes(t->dot_type, n, na), sb = quant_gemm_scratch(qt, n);
        void *pack = aligned_alloc(64, (pb + 63) / 64 * 64), *scratch = aligned_alloc(64, (sb + 63) / 64 * 64 + 64);
        float *y = malloc(sizeof *y * nw * na);
        for (int k = 0; k < nw * na; k++)
            y[k] = -12345.f;
        int groups = (na + 15) / 16;
        quant_pack(t->dot_type, n, a, rba, na, 0, 1, pack);
        quant_pack(t->dot_type, n, a, rba, na, 1, groups, pack);
        quant_gemm_packed(qt, n, w, rbw, cut, pack, na, y, nw, scratch);
        quant_gemm_packed(qt, n, w + cut * rbw, rbw, nw - cut, pack, na, y + cut, nw, scratch);
        for (int j = 0; j < na; j++)
            for (int i = 0; i < nw; i++) {
                float ref, got = y[j * nw + i];
                t->dot_scalar(n, &ref, w + i * rbw, a + j * rba);
                double rel = fabs((double)got - ref) / fmax(dot_magnitude(t, w + i * rbw, a + j * rba, n), 1e-30);
                worst = fmax(worst, rel);
                if (!CHECK(rel <= 1e-6, "%s (%d,%d): %g vs %g", t->name, i, j, got, ref))
                    goto next;
            }
    next:
        free(w), free(a), free(pack), free(scratch), free(y);
    }
    /* the tiled kernel is the AVX-512 VNNI build's (an AVX2 build, e.g. MARCH=x86-64-v3, has none) */
    CHECK(tiled >= 1 || strcmp(quant_simd_name(), "avx512-vnni") != 0, "no type took the tiled path");
    printf("     %d tiled types, max |packed - dot| / sum|w*a| = %.2e\n", tiled, worst);
}

void test_quant(void)
{
    case_f16();
    case_goldens();
    case_simd();
    case_roundtrip();
    case_gemm();
    case_gemm_packed();
}
