/*
 * test_demo.c — end-to-end checks of the bundled demo model against PyTorch.
 *
 * demo/strata-demo-Q8_0.gguf is a trained llama-architecture model (see
 * demo/README.md); demo/reference.json holds PyTorch's float32 figures for it,
 * computed from the trained weights by demo_train.py with token ids that came
 * from `strata tokenize`. Random weights cannot catch what these catch: a
 * numerical bug anywhere in the forward pass inflates the perplexity of real
 * text. Two cases, both through the C API (model_load → tok_encode →
 * model_eval) on the CPU with the default F16 KV cache:
 *   - perplexity of demo/heldout.txt with 256-token windows (ARCH.md §5b)
 *     within 1% of PyTorch's;
 *   - free-running greedy continuation of the reference prompt under the
 *     parity rule, mean |Δ log-probability| over PyTorch's top-10 ≤ 0.03.
 * The files live in the repository, so these cases never skip. V is the vocabulary.
 */
#include "strata.h"
#include "test.h"

#include <math.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#define DEMO_MODEL "demo/strata-demo-Q8_0.gguf"
#define DEMO_REF "demo/reference.json"
#define DEMO_TEXT "demo/heldout.txt"
#define DEMO_THREADS 2
#define DEMO_PPL_TOL 0.01   /* relative, Strata's Q8_0 run against PyTorch float32 */
#define DEMO_LP_TOL 0.03    /* mean |Δ logprob| over the reference's top-10 */
#define DEMO_MARGIN 0.05    /* a divergence is allowed where top-1 − top-2 ≤ this */

static int demo_int(const struct json *j) { return j && j->kind == JSON_NUM ? (int)j->num : -1; }

static double demo_num(const struct json *j) { return j && j->kind == JSON_NUM ? j->num : NAN; }

/* log-softmax of logits (V) at id, the sum in double as the reference does. */
static double demo_logprob(const float *lg, int V, int id)
{
    float mx = lg[0];
    for (int i = 1; i < V; i++)
        mx = lg[i] > mx ? lg[i] : mx;
    double s = 0;
    for (int i = 0; i < V; i++)
        s += exp((double)lg[i] - mx);
    return (double)lg[id] - mx - log(s);
}

static int demo_argmax(const float *lg, int V)
{
    int b = 0;
    for (int i = 1; i < V; i++)
        if (lg[i] > lg[b])
            b = i;
    return b;
}

struct demo {
    struct model *m;
    struct model_ctx *ctx;
    struct pool *pool;
    struct json ref;
    char *ref_text;
};

static int demo_open(struct demo *d, int n_ctx)
{
    char err[256];
    size_t len = 0;
    memset(d, 0, sizeof *d);
    d->ref_text = test_read_file(DEMO_REF, &len);
    if (!CHECK(d->ref_text, "cannot read %s (run from the repository root)", DEMO_REF) ||
        !CHECK(json_parse(&d->ref, d->ref_text, len, err, sizeof err) == 0, "%s: %s", DEMO_REF, err) ||
        !CHECK(model_load(&d->m, DEMO_MODEL, err, sizeof err) == 0, "%s: %s", DEMO_MODEL, err))
        return -1;
    d->pool = pool_new(DEMO_THREADS);
    return CHECK(model_ctx_new(&d->ctx, d->m, n_ctx, KV_F16, d->pool, err, sizeof err) == 0,
                 "context: %s", err) ? 0 : -1;
}

static void demo_close(struct demo *d)
{
    model_ctx_free(d->ctx);
    pool_free(d->pool);
    model_free(d->m);
    json_free(&d->ref);
    free(d->ref_text);
}

/* ---- perplexity of the held-out excerpt ---- */

static void test_demo_ppl(void)
{
    if (!test_begin("demo/perplexity of demo/heldout.txt within 1% of PyTorch fp32"))
        return;
    struct demo d;
    char err[256];
    int32_t *ids = NULL;
    float *lg = NULL;
    char *text = NULL;
    const struct json *pj = NULL;
    if (demo_open(&d, 512) != 0)
        goto done;
    pj = json_get(&d.ref, "perplexity");
    int n_ctx = demo_int(json_get(pj, "n_ctx"));
    double ref_ppl = demo_num(json_get(pj, "ppl"));
    if (!CHECK(n_ctx >= 4 && n_ctx <= 512 && ref_ppl > 1, "%s: perplexity block incomplete", DEMO_REF))
        goto done;
    size_t len = 0;
    text = test_read_file(DEMO_TEXT, &len);
    if (!CHECK(text, "cannot read %s", DEMO_TEXT))
        goto done;
    const struct tok *tk = model_tok(d.m);
    int n = 0, V = model_hp(d.m)->n_vocab;
    /* as the perplexity tool: add_special (BOS), special text not parsed */
    ids = tok_encode(tk, text, len, 1, 0, &n, err, sizeof err);
    if (!CHECK(ids, "tokenize: %s", err) ||
        !CHECK(n == demo_int(json_get(pj, "tokens")), "%s: %d tokens, PyTorch's run had %d",
               DEMO_TEXT, n, demo_int(json_get(pj, "tokens"))))
        goto done;
    int chunks = n / n_ctx, first = n_ctx / 2, scored = 0;
    lg = malloc((size_t)(n_ctx - first) * V * sizeof *lg);   /* (n_ctx/2, V) */
    double nll = 0;
    for (int c = 0; c < chunks; c++) {
        int32_t *chunk = ids + (size_t)c * n_ctx;
        if (tok_add_bos(tk))
            chunk[0] = tok_bos(tk);   /* the tool overwrites each chunk's first token */
        /* The first half only fills the cache; its logits are never scored. */
        if (!CHECK(model_eval(d.ctx, chunk, first, 0, NULL, 0, err, sizeof err) == 0, "eval: %s", err) ||
            !CHECK(model_eval(d.ctx, chunk + first, n_ctx - first, first, lg, 1, err, sizeof err) == 0,
                   "eval: %s", err))
            goto done;
        for (int j = 0; j < n_ctx - 1 - first; j++, scored++)
            nll -= demo_logprob(lg + (size_t)j * V, V, chunk[first + j + 1]);
    }
    double ppl = exp(nll / scored), rel = ppl / ref_ppl - 1;
    printf("  demo ppl (c=%d, %d chunks, %d scored): strata %.4f, pytorch %.4f, rel diff %+.4f%%\n",
           n_ctx, chunks, scored, ppl, ref_ppl, 100 * rel);
    CHECK(scored == demo_int(json_get(pj, "scored")), "scored %d positions, PyTorch %d", scored,
          demo_int(json_get(pj, "scored")));
    CHECK(fabs(rel) <= DEMO_PPL_TOL, "perplexity %.4f is %.3f%% from PyTorch's %.4f", ppl,
          100 * rel, ref_ppl);
done:
    free(lg);
    free(ids);
    free(text);
    demo_close(&d);
}

/* ---- greedy continuation of the reference prompt ---- */

static void test_demo_greedy(void)
{
    if (!test_begin("demo/greedy parity with PyTorch fp32 (top-10 logprobs, bound 0.03)"))
        return;
    struct demo d;
    char err[256];
    int32_t *ids = NULL, *prompt = NULL;
    float *lg = NULL;
    if (demo_open(&d, 512) != 0)
        goto done;
    const struct json *gen = json_get(&d.ref, "generation");
    const struct json *ptext = json_get(gen, "prompt"), *pt = json_get(gen, "prompt_tokens");
    const struct json *steps = json_get(gen, "steps");
    if (!CHECK(ptext && ptext->kind == JSON_STR && pt && pt->kind == JSON_ARR && steps &&
               steps->kind == JSON_ARR && steps->len > 0, "%s: generation block incomplete", DEMO_REF))
        goto done;
    int np = 0, V = model_hp(d.m)->n_vocab;
    /* as `strata generate`: BOS per the metadata, special text parsed */
    prompt = tok_encode(model_tok(d.m), ptext->str, ptext->len, 1, 1, &np, err, sizeof err);
    if (!CHECK(prompt, "tokenize: %s", err) ||
        !CHECK(np == (int)pt->len, "prompt: %d tokens, reference %zu", np, pt->len))
        goto done;
    for (int i = 0; i < np; i++)
        if (!CHECK(prompt[i] == demo_int(&pt->items[i]), "prompt token %d: %d, reference %d", i,
                   prompt[i], demo_int(&pt->items[i])))
            goto done;
    int n = (int)steps->len;
    ids = malloc((size_t)(np + n) * sizeof *ids);
    lg = malloc((size_t)V * sizeof *lg);
    memcpy(ids, prompt, (size_t)np * sizeof *ids);
    if (!CHECK(model_eval(d.ctx, ids, np, 0, lg, 0, err, sizeof err) == 0, "eval: %s", err))
        goto done;
    double sum = 0, worst = 0;
    int n_d = 0, compared = 0, diverged = -1;
    for (int i = 0; i < n; i++) {
        const struct json *st = &steps->items[i], *top = json_get(st, "top");
        for (size_t k = 0; top && k < top->len; k++) {
            int id = demo_int(json_get(&top->items[k], "id"));
            if (!CHECK(id >= 0 && id < V, "step %d: bad reference id", i))
                goto done;
            double dl = fabs(demo_logprob(lg, V, id) - demo_num(json_get(&top->items[k], "logprob")));
            sum += dl;
            worst = dl > worst ? dl : worst;
            n_d++;
        }
        compared++;
        int got = demo_argmax(lg, V), want = demo_int(json_get(st, "id"));
        if (got != want) {
            double margin = demo_num(json_get(st, "margin"));
            diverged = i;
            CHECK(margin <= DEMO_MARGIN, "step %d: strata chose %d, PyTorch %d with margin %.4f",
                  i, got, want, margin);
            break;
        }
        ids[np + i] = got;
        if (i + 1 < n && !CHECK(model_eval(d.ctx, &ids[np + i], 1, np + i, lg, 0, err, sizeof err) == 0,
                                "decode: %s", err))
            goto done;
    }
    double mean = n_d ? sum / n_d : NAN;
    printf("  demo greedy: %d/%d steps compared%s, |dlogprob| mean %.5f max %.5f\n", compared, n,
           diverged >= 0 ? " (stopped at an allowed divergence)" : "", mean, worst);
    CHECK(n_d > 0 && mean <= DEMO_LP_TOL, "mean |dlogprob| %.5f over %d values exceeds %.2f", mean,
          n_d, DEMO_LP_TOL);
done:
    free(lg);
    free(ids);
    free(prompt);
    demo_close(&d);
}

void test_demo(void)
{
    test_demo_ppl();
    test_demo_greedy();
}
