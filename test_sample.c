/*
 * test_sample.c — tests of sample.c against an FP64 reference written here:
 * draw frequencies against the filtered, renormalised distribution (chi-square
 * and the largest deviation in standard deviations), each filter's kept set,
 * the penalties and their window, greedy ties, seeding, and the
 * log-probabilities and their top-N order.
 */
#include "strata.h"
#include "test.h"

#include <math.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

/* ---- the FP64 reference of the chain ---- */

static const double *sort_key;

static int by_logit_desc(const void *a, const void *b)
{
    int i = *(const int *)a, j = *(const int *)b;
    if (sort_key[i] != sort_key[j])
        return sort_key[i] > sort_key[j] ? -1 : 1;
    return i - j;
}

/* prob[0..V): the distribution the sampler must draw from, given the ids
 * accepted so far (hist, n_hist; the window is the last repeat_last_n). */
static void ref_dist(const float *logits, int V, const struct sample_params *p,
                     const int32_t *hist, int n_hist, double *prob)
{
    double *l = malloc((size_t)V * sizeof *l);
    int *order = malloc((size_t)V * sizeof *order), *count = calloc((size_t)V, sizeof *count);
    for (int i = 0; i < V; i++)
        l[i] = logits[i];
    for (int k = n_hist - p->repeat_last_n; k < n_hist; k++)
        if (k >= 0)
            count[hist[k]]++;
    for (int i = 0; i < V; i++) {
        if (!count[i])
            continue;
        l[i] = l[i] <= 0 ? l[i] * p->repeat_penalty : l[i] / p->repeat_penalty;
        l[i] -= count[i] * (double)p->frequency_penalty + p->presence_penalty;
    }
    for (int i = 0; i < V; i++)
        order[i] = i;
    sort_key = l;
    qsort(order, (size_t)V, sizeof *order, by_logit_desc);
    int n = V;
    if (p->top_k > 0 && p->top_k < n)
        n = p->top_k;
    double max = l[order[0]];
    if (p->top_p < 1) {
        double z = 0, cum = 0;
        for (int i = 0; i < n; i++)
            z += exp(l[order[i]] - max);
        for (int i = 0; i < n; i++) {
            cum += exp(l[order[i]] - max) / z;
            if (cum >= p->top_p) {
                n = i + 1;
                break;
            }
        }
    }
    if (p->min_p > 0) {
        int m = 1;
        while (m < n && l[order[m]] >= max + log(p->min_p))
            m++;
        n = m;
    }
    double z = 0;
    for (int i = 0; i < V; i++)
        prob[i] = 0;
    for (int i = 0; i < n; i++)
        z += prob[order[i]] = exp((l[order[i]] - max) / p->temp);
    for (int i = 0; i < n; i++)
        prob[order[i]] /= z;
    free(l);
    free(order);
    free(count);
}

static struct sample_params base_params(void)
{
    struct sample_params p = { .temp = 1, .top_k = 0, .top_p = 1, .min_p = 0, .repeat_penalty = 1,
                               .repeat_last_n = 64, .seed = 42 };
    return p;
}

/* Draws n ids and compares their frequencies to ref_dist's. */
static void check_draws(const char *name, const float *logits, int V, struct sample_params p,
                        const int32_t *hist, int n_hist, int n_draws)
{
    if (!test_begin(name))
        return;
    double *prob = malloc((size_t)V * sizeof *prob);
    long *seen = calloc((size_t)V, sizeof *seen);
    ref_dist(logits, V, &p, hist, n_hist, prob);
    struct sampler *s = sample_new(&p, V);
    for (int k = 0; k < n_hist; k++)
        sample_accept(s, hist[k]);
    for (int d = 0; d < n_draws; d++) {
        int32_t id = sample_next(s, logits);
        if (!CHECK(id >= 0 && id < V, "id %d out of range", id))
            break;
        seen[id]++;
    }
    sample_free(s);

    double chi2 = 0, worst = 0;
    int df = -1, kept = 0, outside = 0, missing = 0;
    for (int i = 0; i < V; i++) {
        double e = prob[i] * n_draws;
        if (prob[i] == 0) {
            outside += seen[i] > 0;
            continue;
        }
        kept++;
        if (e > 20 && seen[i] == 0)
            missing++;
        double sd = sqrt(e * (1 - prob[i])) + 1e-9, dev = fabs(seen[i] - e) / sd;
        if (dev > worst)
            worst = dev;
        if (e >= 5) {
            chi2 += (seen[i] - e) * (seen[i] - e) / e;
            df++;
        }
    }
    /* df + 6·sqrt(2·df) is far in the tail (p < 1e-6 for these df): a
     * correct sampler passes, a wrong filter or normalisation does not */
    double bound = df + 6 * sqrt(2.0 * (df > 0 ? df : 1));
    printf("  %s: kept %d of %d, chi2 %.1f (df %d, bound %.1f), max dev %.2f sd\n",
           name, kept, V, chi2, df, bound, worst);
    CHECK(outside == 0, "%d ids drawn outside the kept set", outside);
    CHECK(missing == 0, "%d kept ids (expected > 20 times) never drawn", missing);
    CHECK(chi2 <= bound, "chi2 %.1f above %.1f", chi2, bound);
    CHECK(worst < 6, "an id deviates by %.2f standard deviations", worst);
    free(prob);
    free(seen);
}

static float *random_logits(int V, float scale, unsigned seed)
{
    float *l = malloc((size_t)V * sizeof *l);
    for (int i = 0; i < V; i++)
        l[i] = scale * test_randf(&seed) + 0.5f * scale * test_randf(&seed);
    return l;
}

static void check_filters(void)
{
    enum { V = 64, BIG = 2000, N = 200000 };
    float *l = random_logits(V, 4, 3);
    float *big = random_logits(BIG, 6, 5);
    struct sample_params p = base_params();
    check_draws("sample/draws-softmax-temp1", l, V, p, NULL, 0, N);
    p.temp = 0.6f;
    check_draws("sample/draws-temp-0.6", l, V, p, NULL, 0, N);
    p = base_params();
    p.top_k = 7;
    check_draws("sample/draws-top-k", l, V, p, NULL, 0, N);
    p = base_params();
    p.top_p = 0.7f;
    check_draws("sample/draws-top-p", l, V, p, NULL, 0, N);
    p = base_params();
    p.min_p = 0.08f;
    check_draws("sample/draws-min-p", l, V, p, NULL, 0, N);
    p = base_params();
    p.top_k = 20;
    p.top_p = 0.9f;
    p.min_p = 0.02f;
    p.temp = 1.7f;
    check_draws("sample/draws-chain-k-p-minp-temp", l, V, p, NULL, 0, N);
    /* the CLI defaults on a larger vocabulary */
    p = base_params();
    p.temp = 0.8f;
    p.top_k = 40;
    p.top_p = 0.95f;
    p.min_p = 0.05f;
    check_draws("sample/draws-defaults-v2000", big, BIG, p, NULL, 0, N);
    p.top_k = 0; /* no top-k: top-p and min-p over the whole vocabulary */
    check_draws("sample/draws-no-top-k-v2000", big, BIG, p, NULL, 0, N);

    /* a flat distribution: the nucleus outgrows top-p's first sorted slice */
    float *flat = random_logits(1200, 0.3f, 13);
    p = base_params();
    p.top_p = 0.9f;
    check_draws("sample/draws-top-p-wide-nucleus", flat, 1200, p, NULL, 0, 40000);
    free(flat);

    /* penalties: ids 0..9 repeated, some beyond the window */
    int32_t hist[40];
    for (int k = 0; k < 40; k++)
        hist[k] = (int32_t)((k * 7) % 13);
    p = base_params();
    p.repeat_penalty = 1.3f;
    p.frequency_penalty = 0.4f;
    p.presence_penalty = 0.5f;
    p.repeat_last_n = 16;
    check_draws("sample/draws-penalties", l, V, p, hist, 40, N);
    p.top_k = 10;
    p.min_p = 0.05f;
    check_draws("sample/draws-penalties-then-filters", l, V, p, hist, 40, N);
    /* more of top-k than ids outside the window (sample.c's long way) */
    p.top_k = 55;
    p.min_p = 0;
    p.repeat_last_n = 40;
    check_draws("sample/draws-top-k-past-the-window", l, V, p, hist, 40, N);
    /* penalties that raise logits: ids of the window among the lowest of
     * 2,000 climb into the top 40 (scanned in blocks of 64, the window's ids
     * after) */
    int32_t low[24];
    for (int k = 0, i = 0; k < 24; i++)
        if (big[i] < -2.5f)
            low[k++] = i;
    p = base_params();
    p.top_k = 40;
    p.repeat_penalty = 0.25f;
    p.presence_penalty = -10;
    p.repeat_last_n = 24;
    check_draws("sample/draws-penalties-raise-v2000", big, BIG, p, low, 24, N);
    free(l);
    free(big);
}

/* kept sets with hand-made margins: the boundaries are far from rounding */
static void check_kept_sets(void)
{
    if (!test_begin("sample/kept-sets"))
        return;
    /* probabilities ~ 0.50, 0.25, 0.15, 0.07, 0.03 at temperature 1 */
    float l[5] = { logf(0.50f), logf(0.25f), logf(0.15f), logf(0.07f), logf(0.03f) };
    static const struct { int top_k; float top_p, min_p; int kept; } cases[] = {
        { 2, 1, 0, 2 },      /* top-k 2 */
        { 0, 0.70f, 0, 2 },  /* 0.50 + 0.25 >= 0.70 */
        { 0, 0.80f, 0, 3 },  /* needs the third */
        { 0, 0.10f, 0, 1 },  /* the first alone reaches it */
        { 0, 1, 0.20f, 3 },  /* p >= 0.1: 0.50, 0.25, 0.15 */
        { 0, 1, 0.55f, 1 },  /* p >= 0.275 */
        { 0, 0.95f, 0.12f, 4 }, /* top-p keeps 4, min-p (>= 0.06) keeps 4 */
        { 3, 0.99f, 0, 3 },  /* top-k first */
        { 0, 1, 2.0f, 1 },   /* min-p above 1 still keeps the best */
    };
    for (size_t c = 0; c < sizeof cases / sizeof *cases; c++) {
        struct sample_params p = base_params();
        p.top_k = cases[c].top_k;
        p.top_p = cases[c].top_p;
        p.min_p = cases[c].min_p;
        p.seed = 1000 + c;
        struct sampler *s = sample_new(&p, 5);
        int seen[5] = { 0 };
        for (int d = 0; d < 20000; d++)
            seen[sample_next(s, l)]++;
        sample_free(s);
        int kept = 0;
        for (int i = 0; i < 5; i++)
            kept += seen[i] > 0;
        CHECK(kept == cases[c].kept && seen[cases[c].kept - 1] > 0, "case %zu: %d ids drawn, want the first %d",
              c, kept, cases[c].kept);
    }
}

static void check_greedy(void)
{
    if (!test_begin("sample/greedy"))
        return;
    float l[8] = { 1, 3, -2, 3, 0.5f, 3, NAN, -INFINITY };
    struct sample_params p = base_params();
    p.temp = 0;
    for (uint64_t seed = 0; seed < 5; seed++) {
        p.seed = seed;
        struct sampler *s = sample_new(&p, 8);
        CHECK(sample_next(s, l) == 1, "ties go to the lowest id");
        sample_free(s);
    }
    p.temp = -1;
    float flat[4] = { 0, 0, 0, 0 }, nan_first[3] = { NAN, -5, -4 };
    struct sampler *s = sample_new(&p, 4);
    CHECK(sample_next(s, flat) == 0, "all equal: id 0");
    sample_free(s);
    s = sample_new(&p, 3);
    CHECK(sample_next(s, nan_first) == 2, "a NaN logit never wins");
    sample_free(s);
    /* top-k/top-p/min-p keep the maximum, so a sampler at a tiny temperature
     * agrees with greedy */
    float *r = random_logits(500, 3, 9);
    int best = 0;
    for (int i = 1; i < 500; i++)
        if (r[i] > r[best])
            best = i;
    p = base_params();
    p.temp = 0;
    p.top_k = 5;
    s = sample_new(&p, 500);
    CHECK(sample_next(s, r) == best, "greedy with filters on is the argmax");
    sample_free(s);
    free(r);
}

/* Greedy against an argmax written here (NaN as -inf, ties to the lowest
 * id), on vocabularies around sample.c's blocks of 64 logits, with NaNs,
 * infinities, ties and windows whose penalties lower or raise logits (by
 * powers of two: the float and double penalties agree exactly). */
static void check_greedy_scan(void)
{
    if (!test_begin("sample/greedy-vs-argmax"))
        return;
    static const int sizes[] = { 1, 7, 63, 64, 65, 130, 2000, 5003 };
    unsigned seed = 77;
    int checked = 0;
    for (size_t z = 0; z < sizeof sizes / sizeof *sizes; z++) {
        int V = sizes[z];
        float *l = malloc((size_t)V * sizeof *l);
        double *pl = malloc((size_t)V * sizeof *pl);
        int *count = malloc((size_t)V * sizeof *count);
        for (int trial = 0; trial < 40; trial++) {
            for (int i = 0; i < V; i++) {
                float u = test_randf(&seed);
                /* multiples of 1/8 in [-4, 4): many ties */
                l[i] = floorf(u * 32) / 8;
                if (test_randf(&seed) > 0.98f)
                    l[i] = test_randf(&seed) > 0 ? NAN : -INFINITY;
            }
            if (trial % 5 == 0)
                for (int i = 0; i < V; i++)
                    l[i] = -INFINITY; /* nothing has any probability: id 0 */
            struct sample_params p = base_params();
            p.temp = 0;
            p.top_k = trial % 3 ? 40 : 0;
            p.repeat_penalty = trial % 2 ? 2.0f : 0.5f;
            p.frequency_penalty = trial % 4 < 2 ? 0.25f : -0.25f;
            p.presence_penalty = trial % 3 == 1 ? -1.0f : 0.5f;
            p.repeat_last_n = 16;
            int n_hist = trial % 4 == 3 ? 0 : 1 + trial % 24;
            int32_t hist[24];
            struct sampler *s = sample_new(&p, V);
            for (int i = 0; i < V; i++)
                count[i] = 0;
            for (int k = 0; k < n_hist; k++) {
                hist[k] = (int32_t)((unsigned)(test_randf(&seed) * 1e6f + 1e6f) % (unsigned)V);
                sample_accept(s, hist[k]);
            }
            for (int k = n_hist > 16 ? n_hist - 16 : 0; k < n_hist; k++)
                count[hist[k]]++;
            int want = 0;
            for (int i = 0; i < V; i++) {
                pl[i] = l[i] == l[i] ? l[i] : -INFINITY;
                if (count[i])
                    pl[i] = (pl[i] <= 0 ? pl[i] * p.repeat_penalty : pl[i] / p.repeat_penalty) -
                            (count[i] * (double)p.frequency_penalty + p.presence_penalty);
                if (pl[i] > pl[want])
                    want = i;
            }
            int32_t got = sample_next(s, l);
            sample_free(s);
            checked++;
            if (!CHECK(got == want, "V %d, trial %d: greedy took %d (%.3f), the argmax is %d (%.3f)", V, trial,
                       (int)got, got >= 0 && got < V ? pl[got] : 0.0, want, pl[want]))
                break;
        }
        free(l);
        free(pl);
        free(count);
    }
    printf("  %d greedy picks, each the argmax\n", checked);
}

static void check_penalties(void)
{
    if (!test_begin("sample/penalties-exact"))
        return;
    struct sample_params p = base_params();
    p.temp = 0;
    p.repeat_penalty = 1.5f;
    p.repeat_last_n = 3;
    /* id 0: 2.0 / 1.5 = 1.33 < 1.9, so id 1 wins once 0 is in the window */
    float l[4] = { 2.0f, 1.9f, -1.0f, -1.2f };
    struct sampler *s = sample_new(&p, 4);
    CHECK(sample_next(s, l) == 0, "no history: the raw argmax");
    sample_accept(s, 0);
    CHECK(sample_next(s, l) == 1, "repeat penalty divides a positive logit");
    sample_accept(s, 2);
    sample_accept(s, 3);
    sample_accept(s, 3);
    CHECK(sample_next(s, l) == 0, "id 0 left the window of 3");
    sample_free(s);

    /* a negative logit is multiplied: -1.0 * 1.5 = -1.5 < -1.2 */
    float neg[2] = { -1.0f, -1.2f };
    s = sample_new(&p, 2);
    sample_accept(s, 0);
    CHECK(sample_next(s, neg) == 1, "repeat penalty multiplies a negative logit");
    sample_free(s);

    /* frequency (per count) and presence (once) */
    p.repeat_penalty = 1;
    p.repeat_last_n = 64;
    p.frequency_penalty = 0.3f;
    p.presence_penalty = 0.25f;
    float f[2] = { 1.0f, 0.0f };
    s = sample_new(&p, 2);
    sample_accept(s, 0);
    sample_accept(s, 0);
    CHECK(sample_next(s, f) == 0, "1 - 2*0.3 - 0.25 = 0.15 > 0");
    sample_accept(s, 0);
    CHECK(sample_next(s, f) == 1, "1 - 3*0.3 - 0.25 < 0");
    sample_free(s);

    /* off: repeat_last_n 0 ignores the history */
    p.repeat_last_n = 0;
    s = sample_new(&p, 2);
    for (int k = 0; k < 10; k++)
        sample_accept(s, 0);
    CHECK(sample_next(s, f) == 0, "repeat_last_n 0: no penalty");
    sample_free(s);
}

static void check_seeding(void)
{
    if (!test_begin("sample/seeding"))
        return;
    float *l = random_logits(1000, 3, 11);
    struct sample_params p = base_params();
    p.seed = 123456789;
    struct sampler *a = sample_new(&p, 1000), *b = sample_new(&p, 1000);
    p.seed = 123456790;
    struct sampler *c = sample_new(&p, 1000);
    int same_ab = 1, same_ac = 1;
    for (int d = 0; d < 500; d++) {
        int32_t x = sample_next(a, l), y = sample_next(b, l), z = sample_next(c, l);
        same_ab &= x == y;
        same_ac &= x == z;
    }
    CHECK(same_ab, "the same seed gives the same draws");
    CHECK(!same_ac, "another seed gives other draws");
    sample_free(a);
    sample_free(b);
    sample_free(c);
    free(l);
}

static void check_logprob(void)
{
    if (!test_begin("sample/logprob"))
        return;
    enum { V = 32000, NT = 12 };
    float *l = random_logits(V, 5, 21);
    l[100] = l[200] = l[300] = 9.5f; /* a three-way tie at the top */
    l[7] = -INFINITY;
    long double z = 0, max = -INFINITY;
    for (int i = 0; i < V; i++)
        if (l[i] > max)
            max = l[i];
    for (int i = 0; i < V; i++)
        z += expl((long double)l[i] - max);
    long double lse = max + logl(z);
    double err = 0, sq = 0;
    struct sample_top top[NT];
    for (int k = 0; k < 50; k++) {
        int id = k * 611 % V;
        float lp = sample_logprob(l, V, id, NULL, 0);
        double e = fabs((double)(lp - ((long double)l[id] - lse)));
        err = e > err ? e : err;
        sq += e * e;
    }
    printf("  logprob vs long double: max abs %.3g, rms %.3g\n", err, sqrt(sq / 50));
    CHECK(err < 2e-6, "logprob error %.3g", err);
    CHECK(sample_logprob(l, V, 7, NULL, 0) == -INFINITY, "a -inf logit has logprob -inf");

    sample_logprob(l, V, 0, top, NT);
    int *order = malloc(V * sizeof *order);
    double *key = malloc(V * sizeof *key);
    for (int i = 0; i < V; i++) {
        order[i] = i;
        key[i] = l[i];
    }
    sort_key = key;
    qsort(order, V, sizeof *order, by_logit_desc);
    for (int k = 0; k < NT; k++) {
        CHECK(top[k].id == order[k], "top[%d] = %d, want %d", k, top[k].id, order[k]);
        CHECK(fabs(top[k].logprob - (double)((long double)l[order[k]] - lse)) < 2e-6, "top[%d] logprob", k);
    }
    CHECK(top[0].id == 100 && top[1].id == 200 && top[2].id == 300, "ties by lower id");
    struct sample_top all[5];
    float tiny[3] = { 0, 1, 0 };
    float lp = sample_logprob(tiny, 3, 0, all, 5);
    CHECK(all[0].id == 1 && all[1].id == 0 && all[2].id == 2, "n_top above V: the V ids in order");
    CHECK(fabsf(lp - (float)(0 - log(2 + exp(1.0)))) < 1e-6f, "3-token logprob");
    /* sample.c's own e^x, through {0, x}: logprob(0) = -log(1 + e^x) is
     * ~-e^x for x well below 0, so down to x = -20 (where double's 1 + e^x
     * still holds e^x to ~1e-7) its relative error is e^x's; below, where a
     * term weighs under 2e-9 of the sum, the logprob's absolute error */
    double worst = 0;
    for (int k = 0; k <= 330; k++) {
        float two[2] = { 0, -0.3f * k - 0.01f * (k % 7) };
        double want = -log1p(exp((double)two[1])), got = sample_logprob(two, 2, 0, NULL, 0);
        if (two[1] >= -20) {
            double rel = fabs(got - want) / fabs(want);
            worst = rel > worst ? rel : worst;
        } else {
            CHECK(fabs(got - want) < 1e-12, "x = %g: logprob %g, want %g", two[1], got, want);
        }
    }
    printf("  e^x through logprob, x in [-20, 0]: max relative error %.3g\n", worst);
    CHECK(worst < 5e-7, "e^x relative error %.3g", worst);
    /* NaN logits weigh nothing, as -inf */
    float odd[5] = { 0, NAN, -50, 1, -100 };
    double z5 = 1 + exp(-50.0) + exp(1.0) + exp(-100.0);
    CHECK(fabs(sample_logprob(odd, 5, 3, NULL, 0) - (1 - log(z5))) < 1e-6, "a NaN logit counts as -inf");
    free(order);
    free(key);
    free(l);
}

void test_sample(void)
{
    check_greedy();
    check_greedy_scan();
    check_penalties();
    check_kept_sets();
    check_seeding();
    check_logprob();
    check_filters();
}
