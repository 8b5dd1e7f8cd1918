/*
 * sample.c — samplers (the reference engine's default chain) and
 * log-probabilities.
 *
 * Chain, in llama.cpp's default order: penalties → top-k → top-p → min-p →
 * temperature → a seeded draw. temp <= 0 is greedy: the highest (penalised)
 * logit, ties to the lowest id. Owns its buffers (allocated once in
 * sample_new); never touches the caller's logits; no model code, no I/O.
 * Greedy, top-k and the log-probabilities read the logits in blocks of 64
 * tested at once (vectorised loops): on a GPU a token's sampling is host
 * time the device waits for. V is the vocabulary size.
 */
#include "strata.h"

#include <math.h>
#include <stdlib.h>
#include <string.h>

#define TOP_P_FIRST 256 /* candidates sorted on top-p's first try */

struct cand {
    int32_t id;
    float logit;
};

struct sampler {
    struct sample_params p;
    int n_vocab;
    uint64_t rng[4];     /* xoshiro256** state */
    int32_t *hist;       /* (repeat_last_n) ring of the last accepted ids */
    int n_hist, hist_at;
    int *count;          /* (V) occurrences of each id in hist */
    int32_t *seen;       /* (repeat_last_n) the distinct ids of hist (distinct_seen) */
    struct cand *cand;   /* (V) the candidates of one call */
};

/* ==== the generator: xoshiro256**, seeded through splitmix64 ==== */

static uint64_t splitmix64(uint64_t *x)
{
    uint64_t z = (*x += 0x9E3779B97F4A7C15ull);
    z = (z ^ (z >> 30)) * 0xBF58476D1CE4E5B9ull;
    z = (z ^ (z >> 27)) * 0x94D049BB133111EBull;
    return z ^ (z >> 31);
}

static uint64_t rotl(uint64_t x, int k)
{
    return (x << k) | (x >> (64 - k));
}

static uint64_t rng_next(uint64_t *s)
{
    uint64_t out = rotl(s[1] * 5, 7) * 9, t = s[1] << 17;
    s[2] ^= s[0];
    s[3] ^= s[1];
    s[1] ^= s[2];
    s[0] ^= s[3];
    s[2] ^= t;
    s[3] = rotl(s[3], 45);
    return out;
}

/* uniform in [0, 1) with 53 random bits */
static double rng_uniform(uint64_t *s)
{
    return (double)(rng_next(s) >> 11) * 0x1.0p-53;
}

/* ==== the sampler ==== */

struct sampler *sample_new(const struct sample_params *p, int n_vocab)
{
    if (n_vocab <= 0)
        return NULL;
    struct sampler *s = calloc(1, sizeof *s);
    if (!s)
        return NULL;
    s->p = *p;
    s->n_vocab = n_vocab;
    if (s->p.repeat_last_n < 0)
        s->p.repeat_last_n = 0;
    uint64_t x = p->seed;
    for (int i = 0; i < 4; i++)
        s->rng[i] = splitmix64(&x);
    s->count = calloc((size_t)n_vocab, sizeof *s->count);
    s->cand = malloc((size_t)n_vocab * sizeof *s->cand);
    s->hist = malloc((size_t)(s->p.repeat_last_n ? s->p.repeat_last_n : 1) * sizeof *s->hist);
    s->seen = malloc((size_t)(s->p.repeat_last_n ? s->p.repeat_last_n : 1) * sizeof *s->seen);
    if (!s->count || !s->cand || !s->hist || !s->seen) {
        sample_free(s);
        return NULL;
    }
    return s;
}

void sample_free(struct sampler *s)
{
    if (!s)
        return;
    free(s->count);
    free(s->cand);
    free(s->hist);
    free(s->seen);
    free(s);
}

void sample_accept(struct sampler *s, int32_t id)
{
    int w = s->p.repeat_last_n;
    if (w == 0 || id < 0 || id >= s->n_vocab)
        return;
    if (s->n_hist == w)
        s->count[s->hist[s->hist_at]]--; /* the oldest id leaves the window */
    else
        s->n_hist++;
    s->hist[s->hist_at] = id;
    s->count[id]++;
    s->hist_at = (s->hist_at + 1) % w;
}

static int penalties_on(const struct sample_params *p)
{
    return p->repeat_penalty != 1.0f || p->frequency_penalty != 0.0f || p->presence_penalty != 0.0f;
}

/* The distinct ids of the window into s->seen, when any penalty is on
 * (else none); returns how many. */
static int distinct_seen(struct sampler *s)
{
    if (!penalties_on(&s->p))
        return 0;
    int n = 0;
    for (int k = 0; k < s->n_hist; k++) {
        int32_t id = s->hist[k];
        if (s->count[id] > 0) {
            s->seen[n++] = id;
            s->count[id] = -s->count[id]; /* done: restored below */
        }
    }
    for (int k = 0; k < n; k++)
        s->count[s->seen[k]] = -s->count[s->seen[k]];
    return n;
}

/* Whether id's logit is the raw one: no penalty on (n_seen = 0; the counts
 * are kept all the same), or id not in the window. */
static int unpenalised(const struct sampler *s, int n_seen, int32_t id)
{
    return n_seen == 0 || s->count[id] == 0;
}

/* A logit as the chain sees it: NaN never wins; an id of the window
 * penalised once (repetition penalty: divides a positive logit, multiplies
 * the others; then frequency and presence). */
static float chain_logit(const struct sampler *s, const float *logits, int32_t id)
{
    const struct sample_params *p = &s->p;
    float l = logits[id] == logits[id] ? logits[id] : -INFINITY;
    int c = s->count[id];
    if (c == 0 || !penalties_on(p))
        return l;
    l = l <= 0 ? l * p->repeat_penalty : l / p->repeat_penalty;
    return l - ((float)c * p->frequency_penalty + p->presence_penalty);
}

/* the candidate order: higher logit first, then lower id */
static int better(const struct cand *a, const struct cand *b)
{
    return a->logit > b->logit || (a->logit == b->logit && a->id < b->id);
}

static int cmp_cand(const void *a, const void *b)
{
    return better(a, b) ? -1 : better(b, a) ? 1 : 0;
}

/* Restores the heap below `at` in c[0..k): its root is the worst entry. */
static void sift_down(struct cand *c, int k, int at)
{
    for (;;) {
        int l = 2 * at + 1, w = at;
        if (l < k && better(&c[w], &c[l]))
            w = l;
        if (l + 1 < k && better(&c[w], &c[l + 1]))
            w = l + 1;
        if (w == at)
            return;
        struct cand t = c[at];
        c[at] = c[w];
        c[w] = t;
        at = w;
    }
}

/* Moves the k best of c[0..n) into c[0..k) (unordered), keeping c[0..n) a
 * permutation: a heap of the k best so far whose root, the worst of them,
 * each newcomer must beat. O(n log k). */
static void select_top_k(struct cand *c, int n, int k)
{
    for (int i = k / 2 - 1; i >= 0; i--)
        sift_down(c, k, i);
    for (int i = k; i < n; i++) {
        if (better(&c[i], &c[0])) {
            struct cand t = c[0];
            c[0] = c[i];
            c[i] = t;
            sift_down(c, k, 0);
        }
    }
}

/* The scans below take the logits SCAN at a time and look at each one
 * only in a block that beats their threshold: how many of the block at
 * l[i0] to look at, 0 when none of them is > t (NaN never). A loop of
 * fixed length tests a whole block: the compiler vectorises it. */
#define SCAN 64
static int block_to_scan(const float *l, int V, int i0, float t)
{
    if (V - i0 < SCAN)
        return V - i0;
    int any = 0;
    for (int i = i0; i < i0 + SCAN; i++)
        any |= l[i] > t;
    return any ? SCAN : 0;
}

/* Greedy: the best id by the chain's logits, ties to the lowest. The ids
 * outside the window are scanned on their raw logits (a block whose
 * largest does not beat the best so far is skipped whole), then the
 * window's ids with their penalties. */
static int32_t best_id(struct sampler *s, const float *logits)
{
    int V = s->n_vocab, n_seen = distinct_seen(s);
    int32_t best = 0;
    float bl = -INFINITY;
    for (int i0 = 0; i0 < V; i0 += SCAN)
        for (int i = i0, n = block_to_scan(logits, V, i0, bl); i < i0 + n; i++)
            if (logits[i] > bl && unpenalised(s, n_seen, i)) {
                bl = logits[i];
                best = i;
            }
    for (int k = 0; k < n_seen; k++) {
        int32_t id = s->seen[k];
        float l = chain_logit(s, logits, id);
        if (l > bl || (l == bl && id < best)) {
            bl = l;
            best = id;
        }
    }
    return best;
}

/* top-k straight from the logits: c[0..k) the k best ids by the chain's
 * order (unordered), as select_top_k leaves them, without writing all V
 * candidates first. A heap of the first k ids outside the window, then
 * every later one that beats its root (a block of logits none of which
 * does is skipped whole; an id ahead of the heap's never wins a tie), then
 * the window's ids with their penalties. Returns 0 where fewer than k ids
 * lie outside the window (the caller takes the long way). */
static int top_k_direct(struct sampler *s, const float *logits, int k)
{
    int V = s->n_vocab, n_seen = distinct_seen(s), m = 0, i = 0;
    struct cand *c = s->cand;
    for (; i < V && m < k; i++)
        if (unpenalised(s, n_seen, i))
            c[m++] = (struct cand){i, chain_logit(s, logits, i)};
    if (m < k)
        return 0;
    for (int j = k / 2 - 1; j >= 0; j--)
        sift_down(c, k, j);
    for (int i0 = i; i0 < V; i0 += SCAN)
        for (int j = i0, n = block_to_scan(logits, V, i0, c[0].logit); j < i0 + n; j++)
            if (logits[j] > c[0].logit && unpenalised(s, n_seen, j)) {
                c[0] = (struct cand){j, logits[j]};
                sift_down(c, k, 0);
            }
    for (int j = 0; j < n_seen; j++) {
        struct cand x = {s->seen[j], chain_logit(s, logits, s->seen[j])};
        if (better(&x, &c[0])) {
            c[0] = x;
            sift_down(c, k, 0);
        }
    }
    return 1;
}

int32_t sample_next(struct sampler *s, const float *logits)
{
    const struct sample_params *p = &s->p;
    struct cand *c = s->cand;
    int n = s->n_vocab;
    if (p->temp <= 0)
        return best_id(s, logits);

    if (p->top_k > 0 && p->top_k < n && top_k_direct(s, logits, p->top_k)) {
        n = p->top_k;
    } else {
        for (int i = 0; i < n; i++)
            c[i] = (struct cand){i, chain_logit(s, logits, i)};
        if (p->top_k > 0 && p->top_k < n) {
            select_top_k(c, n, p->top_k);
            n = p->top_k;
        }
    }
    int arg = 0;
    for (int i = 1; i < n; i++)
        if (better(&c[i], &c[arg]))
            arg = i;
    float max = c[arg].logit;
    if (max == -INFINITY)
        return c[arg].id; /* nothing has any probability: the lowest id */

    /* top-p's probabilities are over every candidate left by top-k */
    double sum = 0;
    if (p->top_p < 1.0f)
        for (int i = 0; i < n; i++)
            sum += exp((double)c[i].logit - max);

    /* min-p keeps logits >= max + ln(min_p). Both it and top-p keep a prefix
     * of the sorted order, and min-p runs after top-p, so the result is the
     * shorter prefix: dropping min-p's losers first changes nothing and
     * leaves only a few candidates to sort. */
    if (p->min_p > 0) {
        float thr = fminf(max + logf(p->min_p), max); /* the best always stays */
        int m = 0;
        for (int i = 0; i < n; i++)
            if (c[i].logit >= thr)
                c[m++] = c[i];
        n = m;
    }
    if (p->top_p < 1.0f) {
        /* the nucleus is usually small: sort the best k, and widen k only
         * while their mass falls short of top_p */
        for (int k = n < TOP_P_FIRST ? n : TOP_P_FIRST;; k = n / 8 > k ? 8 * k : n) {
            if (k < n)
                select_top_k(c, n, k);
            qsort(c, (size_t)k, sizeof *c, cmp_cand);
            double cum = 0;
            int i = 0;
            while (i < k && (cum += exp((double)c[i].logit - max) / sum) < p->top_p)
                i++;
            if (i < k) {
                n = i + 1;
                break;
            }
            if (k == n)
                break; /* what min-p left holds less than top_p: keep it all */
        }
    }

    /* temperature, then a draw from the softmax of what is left */
    double total = 0;
    for (int i = 0; i < n; i++) {
        c[i].logit /= p->temp;
        total += exp((double)c[i].logit - max / p->temp);
    }
    double target = total * rng_uniform(s->rng), run = 0;
    for (int i = 0; i < n; i++) {
        run += exp((double)c[i].logit - max / p->temp);
        if (run > target)
            return c[i].id;
    }
    return c[n - 1].id; /* only reached through rounding of the last sum */
}

/* e^x for x <= 0 (NaN: 0) to a few float roundings: n = round(x·log2 e),
 * r = x - n·ln 2 in two parts (the first's product exact, |r| <= 0.35),
 * e^r by its Taylor series to r^7 (truncation ~5e-9), 2^n put in the
 * exponent's bits; 0 below -87, where e^x leaves float's normal range.
 * Integer masks, no branch, no call: a loop over it vectorises. */
static inline float exp_le0(float x)
{
    union { float f; uint32_t u; } a = {x}, lim = {87.0f}, r;
    uint32_t mag = a.u & 0x7fffffffu;
    a.u = 0x80000000u | (mag < lim.u ? mag : lim.u); /* -min(|x|, 87): finite below */
    int32_t n = (int32_t)(a.f * 1.44269504f - 0.5f); /* <= 0: truncation rounds up */
    float e = (a.f - (float)n * 0.693359375f) - (float)n * -2.12194440e-4f, p = 1.0f / 5040;
    p = p * e + 1.0f / 720;
    p = p * e + 1.0f / 120;
    p = p * e + 1.0f / 24;
    p = p * e + 1.0f / 6;
    p = p * e + 0.5f;
    p = p * e + 1.0f;
    p = p * e + 1.0f;
    union { uint32_t u; float f; } scale = {(uint32_t)(n + 127) << 23};
    r.f = p * scale.f;
    r.u &= -(uint32_t)(x >= -87.0f);
    return r.f;
}

/* The sum of y[0..SCAN), pairwise (six roundings deep), y overwritten:
 * loops of fixed length the compiler vectorises. */
static float block_sum(float *y)
{
    for (int i = 0; i < 32; i++)
        y[i] += y[i + 32];
    for (int i = 0; i < 16; i++)
        y[i] += y[i + 16];
    for (int i = 0; i < 8; i++)
        y[i] += y[i + 8];
    return ((y[0] + y[4]) + (y[1] + y[5])) + ((y[2] + y[6]) + (y[3] + y[7]));
}

double sample_lse(const float *logits, int n_vocab)
{
    /* the largest logit (NaN never): a block is looked at one by one only
     * where it beats the largest so far */
    float max = -INFINITY;
    for (int i0 = 0; i0 < n_vocab; i0 += SCAN)
        for (int i = i0, n = block_to_scan(logits, n_vocab, i0, max); i < i0 + n; i++)
            max = logits[i] > max ? logits[i] : max;
    /* Σ e^(l - max) (NaN logits as -inf): each block's terms summed in float,
     * pairwise, the blocks' sums in double (one float sum of V ~ 1e5 terms
     * would lose ~1e-3 relative) */
    double sum = 0;
    float y[SCAN];
    int i0 = 0;
    for (; i0 + SCAN <= n_vocab; i0 += SCAN) {
        for (int i = 0; i < SCAN; i++)
            y[i] = exp_le0(logits[i0 + i] - max);
        sum += block_sum(y);
    }
    for (int i = i0; i < n_vocab; i++)
        sum += exp_le0(logits[i] - max);
    return max + log(sum);
}

float sample_logprob(const float *logits, int n_vocab, int32_t id, struct sample_top *top, int n_top)
{
    double lse = sample_lse(logits, n_vocab);
    if (n_top > n_vocab)
        n_top = n_vocab;
    int have = 0;
    /* a full list skips each block none of whose logits beats its last */
    for (int i0 = 0; i0 < n_vocab && n_top > 0; i0 += SCAN)
        for (int i = i0, n = have < n_top ? SCAN : block_to_scan(logits, n_vocab, i0, top[have - 1].logprob);
             i < i0 + n && i < n_vocab; i++) {
            float l = logits[i];
            /* ids arrive in increasing order, so a tie never displaces an entry */
            if (have == n_top && !(l > top[have - 1].logprob))
                continue;
            int at = have < n_top ? have++ : n_top - 1;
            while (at > 0 && l > top[at - 1].logprob) {
                top[at] = top[at - 1];
                at--;
            }
            top[at].id = i;
            top[at].logprob = l;
        }
    for (int k = 0; k < have; k++)
        top[k].logprob = (float)(top[k].logprob - lse);
    return (float)((double)logits[id] - lse);
}
