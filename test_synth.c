/*
 * test_synth.c — tests of synth.c: a written model has exactly the declared
 * shape (metadata and tensor table checked key by key against the request),
 * its tokenizer is the vocabulary file's, every weight dequantises into the
 * range it was drawn from (the IQ2/IQ3 lattices' random codes too), and bad
 * requests are refused with a message.
 */
#include "strata.h"
#include "test.h"

#include <math.h>
#include <stdlib.h>
#include <string.h>

#define TMP_SYNTH "/tmp/strata-test-synth.gguf"

static int run_synth(const char *const *args, int n, char *err, size_t errlen)
{
    char *argv[32];
    argv[0] = "synth";
    for (int i = 0; i < n; i++)
        argv[i + 1] = (char *)args[i];
    return synth_main(n + 1, argv, err, errlen);
}

/* Runs synth with args (writing TMP_SYNTH) and opens its file as g and the
 * file `other` as o: 0, or -1 after a failed CHECK with nothing open. */
static int synth_open(const char *const *args, int n, const char *other, struct gguf *g, struct gguf *o)
{
    char err[512];
    if (!CHECK(run_synth(args, n, err, sizeof err) == 0, "synth: %s", err) ||
        !CHECK(gguf_open(g, TMP_SYNTH, err, sizeof err) == 0, "%s", err))
        return -1;
    if (!CHECK(gguf_open(o, other, err, sizeof err) == 0, "%s", err)) {
        gguf_close(g);
        return -1;
    }
    return 0;
}

static int64_t get_int(const struct gguf *g, const char *key)
{
    int64_t v = -1;
    gguf_get_int(g, key, &v);
    return v;
}

static void case_moe_shape(void)
{
    if (!test_begin("synth/qwen3moe-shape"))
        return;
    char vocab[512];
    if (!test_data("vocab/ggml-vocab-qwen2.gguf", vocab, sizeof vocab))
        return;
    const char *args[] = {"--arch", "qwen3moe", "--set", "n_embd=64", "--set", "n_layer=2",
                          "--set", "n_head=4", "--set", "n_head_kv=2", "--set", "head_dim=32",
                          "--set", "n_ff=128", "--set", "n_expert=4", "--set", "n_expert_used=2",
                          "--set", "n_ff_exp=32", "--type", "Q8_0", "--vocab", vocab,
                          "-o", TMP_SYNTH};
    struct gguf g, v;
    if (synth_open(args, 26, vocab, &g, &v) != 0)
        return;
    CHECK(get_int(&g, "qwen3moe.embedding_length") == 64 && get_int(&g, "qwen3moe.block_count") == 2 &&
              get_int(&g, "qwen3moe.attention.head_count") == 4 &&
              get_int(&g, "qwen3moe.attention.head_count_kv") == 2 &&
              get_int(&g, "qwen3moe.attention.key_length") == 32 &&
              get_int(&g, "qwen3moe.expert_count") == 4 &&
              get_int(&g, "qwen3moe.expert_used_count") == 2 &&
              get_int(&g, "qwen3moe.expert_feed_forward_length") == 32,
          "hyper-parameters differ from the request");
    /* the tokenizer is copied byte for byte */
    const struct gguf_kv *a = gguf_find(&g, "tokenizer.ggml.merges"),
                         *b = gguf_find(&v, "tokenizer.ggml.merges");
    CHECK(a && b && a->nbytes == b->nbytes && memcmp(a->data, b->data, a->nbytes) == 0,
          "merges not copied");
    const struct gguf_kv *toks = gguf_find(&v, "tokenizer.ggml.tokens");
    struct { const char *name; int type; int64_t ne0, ne1, ne2; } want[] = {
        {"token_embd.weight", QT_Q8_0, 64, toks ? (int64_t)toks->n : -1, 1},
        {"output.weight", QT_Q8_0, 64, toks ? (int64_t)toks->n : -1, 1},
        {"output_norm.weight", QT_F32, 64, 1, 1},
        {"blk.1.attn_q.weight", QT_Q8_0, 64, 128, 1},
        {"blk.1.attn_k.weight", QT_Q8_0, 64, 64, 1},
        {"blk.1.attn_output.weight", QT_Q8_0, 128, 64, 1},
        {"blk.1.attn_q_norm.weight", QT_F32, 32, 1, 1},
        {"blk.0.ffn_gate_inp.weight", QT_F32, 64, 4, 1},
        {"blk.0.ffn_gate_exps.weight", QT_Q8_0, 64, 32, 4},
        {"blk.0.ffn_down_exps.weight", QT_Q8_0, 32, 64, 4},
    };
    for (size_t i = 0; i < sizeof want / sizeof want[0]; i++) {
        const struct gguf_tensor *t = gguf_tensor(&g, want[i].name);
        CHECK(t && t->type == want[i].type && t->ne[0] == want[i].ne0 && t->ne[1] == want[i].ne1 &&
                  t->ne[2] == want[i].ne2, "tensor %s missing or mis-shaped", want[i].name);
    }
    CHECK(g.n_tensors == 3 + 2 * 12, "%llu tensors", (unsigned long long)g.n_tensors);
    /* every weight of a layer matrix lies within the uniform range it was drawn
     * from (half-width 1.7/sqrt(64)) plus the Q8_0 rounding of that range */
    const struct gguf_tensor *t = gguf_tensor(&g, "blk.0.attn_q.weight");
    const struct quant_type *qt = quant_type(QT_Q8_0);
    if (t && qt) {
        int64_t n = t->ne[0] * t->ne[1];
        float *f = malloc((size_t)n * sizeof *f);
        qt->to_f32(t->data, f, n);
        double lim = 1.7 / 8 * (1 + 1.0 / 127) + 1e-6, sum2 = 0;
        float worst = 0;
        for (int64_t i = 0; i < n; i++) {
            worst = fmaxf(worst, fabsf(f[i]));
            sum2 += (double)f[i] * f[i];
        }
        double rms = sqrt(sum2 / (double)n);
        /* a uniform(-h, h) sample has rms h/sqrt(3) */
        CHECK(worst <= lim && fabs(rms - 1.7 / 8 / sqrt(3.0)) < 0.01, "max %g (limit %g), rms %g",
              worst, lim, rms);
        free(f);
    }
    gguf_close(&g);
    gguf_close(&v);
}

static void case_bad_requests(void)
{
    if (!test_begin("synth/bad-requests"))
        return;
    char err[512];
    const char *unknown_shape[] = {"--shape", "gpt5", "--type", "Q8_0", "-o", TMP_SYNTH};
    CHECK(run_synth(unknown_shape, 6, err, sizeof err) != 0 && strstr(err, "unknown shape"),
          "unknown shape: %s", err);
    const char *bad_type[] = {"--shape", "qwen3-0.6b", "--type", "Q9_9", "-o", TMP_SYNTH};
    CHECK(run_synth(bad_type, 6, err, sizeof err) != 0 && strstr(err, "weight type"),
          "bad type: %s", err);
    const char *bad_arch[] = {"--arch", "mamba", "--set", "n_embd=64", "--type", "Q8_0", "-o", TMP_SYNTH};
    CHECK(run_synth(bad_arch, 8, err, sizeof err) != 0 && strstr(err, "unsupported architecture"),
          "bad arch: %s", err);
    const char *bad_rows[] = {"--arch", "llama", "--set", "n_embd=96", "--set", "n_layer=1",
                              "--set", "n_head=2", "--set", "n_ff=96", "--type", "Q4_K",
                              "-o", TMP_SYNTH};
    CHECK(run_synth(bad_rows, 14, err, sizeof err) != 0 && strstr(err, "not a multiple"),
          "rows not a block multiple: %s", err);
    const char *bad_set[] = {"--arch", "llama", "--set", "colour=blue", "--type", "Q8_0", "-o", TMP_SYNTH};
    CHECK(run_synth(bad_set, 8, err, sizeof err) != 0 && strstr(err, "unknown --set key"),
          "unknown key: %s", err);
}

/* --type q4_k_m and q5_k_m: the mixes of Q4_K_M and Q5_K_M files (the
 * reference's one rule for both). The reference's tiny Q4_K_M model (4
 * layers) says which layers take more bits: its ffn_down is Q6_K there (its
 * attn_v rows, 64 wide, fit no 256 block); the synth model of 4 layers must
 * give attn_v and ffn_down Q6_K in exactly those layers, the head Q6_K, and
 * every other matrix the mix's Q4_K or Q5_K. */
static void case_k_m(const char *mix, int wt)
{
    char name[GGUF_NAME_MAX], ref[512];
    snprintf(name, sizeof name, "synth/%s mix against the reference's Q4_K_M file", mix);
    if (!test_begin(name) || !test_data("tiny-qwen3-Q4_K_M.gguf", ref, sizeof ref))
        return;
    const char *args[] = {"--arch", "qwen3", "--set", "n_embd=256", "--set", "n_layer=4", "--set", "n_head=2",
                          "--set", "head_dim=128", "--set", "n_ff=512", "--set", "n_vocab=512", "--type",
                          mix, "-o", TMP_SYNTH};
    struct gguf g, r;
    if (synth_open(args, 18, ref, &g, &r) != 0)
        return;
    int more = 0;
    for (int l = 0; l < 4; l++) {
        snprintf(name, sizeof name, "blk.%d.ffn_down.weight", l);
        const struct gguf_tensor *rd = gguf_tensor(&r, name), *d = gguf_tensor(&g, name);
        snprintf(name, sizeof name, "blk.%d.attn_v.weight", l);
        const struct gguf_tensor *v = gguf_tensor(&g, name);
        snprintf(name, sizeof name, "blk.%d.attn_q.weight", l);
        const struct gguf_tensor *q = gguf_tensor(&g, name);
        if (!CHECK(rd && d && v && q, "layer %d: tensors missing", l))
            break;
        int want = rd->type == QT_Q6_K ? QT_Q6_K : wt;
        more += want == QT_Q6_K;
        CHECK(d->type == want && v->type == want && q->type == wt,
              "layer %d: ffn_down %s, attn_v %s, attn_q %s; the reference's ffn_down is %s", l,
              gguf_type_name(d->type), gguf_type_name(v->type), gguf_type_name(q->type), gguf_type_name(rd->type));
    }
    const struct gguf_tensor *out = gguf_tensor(&g, "output.weight"), *emb = gguf_tensor(&g, "token_embd.weight");
    CHECK(more > 0 && more < 4, "the reference has %d layers of more bits of 4", more);
    CHECK(out && out->type == QT_Q6_K && emb && emb->type == wt, "head %s, embedding %s",
          out ? gguf_type_name(out->type) : "missing", emb ? gguf_type_name(emb->type) : "missing");
    gguf_close(&g);
    gguf_close(&r);
}

/* The IQ2/IQ3 lattices have no quantiser: synth writes them from random
 * codes (quant_lattice_row), each row's largest magnitude the half-width
 * it asks for (to f16's rounding of the block scale), and the model runs. */
static void case_lattice(void)
{
    if (!test_begin("synth/lattice IQ2/IQ3 models from random codes: widths, and a CPU eval"))
        return;
    static const int types[] = {QT_IQ2_XXS, QT_IQ2_XS, QT_IQ2_S, QT_IQ3_XXS, QT_IQ3_S};
    char err[512];
    uint8_t blk[110] = {0};
    CHECK(quant_lattice_row(QT_Q4_K, blk, 256, 1.0f) == -1 && quant_lattice_row(QT_IQ2_S, blk, 100, 1.0f) == -1,
          "quant_lattice_row took a type with a quantiser, or a width not of 256s");
    for (size_t i = 0; i < sizeof types / sizeof *types; i++) {
        const char *name = quant_type(types[i])->name;
        const char *args[] = {"--arch", "qwen3", "--set", "n_embd=256", "--set", "n_layer=1", "--set", "n_head=2",
                              "--set", "head_dim=128", "--set", "n_ff=512", "--set", "n_vocab=300", "--type",
                              name, "-o", TMP_SYNTH};
        if (!CHECK(run_synth(args, 18, err, sizeof err) == 0, "synth %s: %s", name, err))
            continue;
        struct model *m = NULL;
        if (!CHECK(model_load(&m, TMP_SYNTH, err, sizeof err) == 0, "%s: %s", name, err))
            continue;
        /* attn_q: rows of 256 drawn at half-width 1.7/sqrt(256) */
        const struct gguf_tensor *t = gguf_tensor(model_gguf(m), "blk.0.attn_q.weight");
        if (CHECK(t && t->type == types[i], "%s: attn_q missing or of another type", name)) {
            int64_t n = t->ne[0], rows = t->ne[1];
            float *f = malloc((size_t)n * sizeof *f), h = 1.7f / 16, lo = h, hi = 0;
            for (int64_t r = 0; r < rows; r++) {
                quant_type(t->type)->to_f32((const uint8_t *)t->data + r * quant_row_bytes(t->type, n), f, n);
                float mx = 0;
                for (int64_t k = 0; k < n; k++)
                    mx = fmaxf(mx, fabsf(f[k]));
                lo = fminf(lo, mx), hi = fmaxf(hi, mx);
            }
            free(f);
            CHECK(lo >= h * 0.999f && hi <= h * 1.001f, "%s: row maxima %g..%g, asked %g", name, lo, hi, h);
        }
        struct model_opts o = model_opts_default();
        o.n_ctx = 64, o.device = MODEL_DEV_CPU;
        struct model_ctx *c = NULL;
        int32_t ids[4] = {1, 2, 3, 4};
        float *lg = malloc(sizeof(float) * 300);
        if (CHECK(model_ctx_new(&c, m, &o, NULL, err, sizeof err) == 0, "%s: %s", name, err)) {
            int ok = model_eval(c, 0, ids, 4, 0, lg, 0, err, sizeof err) == 0;
            for (int k = 0; ok && k < 300; k++)
                ok = isfinite(lg[k]);
            CHECK(ok, "%s: eval %s", name, err);
        }
        free(lg);
        model_ctx_free(c);
        model_free(m);
    }
    remove(TMP_SYNTH);
}

void test_synth(void)
{
    case_k_m("q4_k_m", QT_Q4_K);
    case_k_m("q5_k_m", QT_Q5_K);
    case_lattice();
    case_moe_shape();
    case_bad_requests();
}
