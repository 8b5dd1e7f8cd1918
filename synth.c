/*
 * synth.c — `strata synth`: writes random-weight models of real shapes
 * (Qwen3-0.6B/8B/32B, Qwen3-30B-A3B, Llama-3-8B, or any shape given by --set) for
 * benchmarks and tests, with the tokenizer copied from a vocabulary GGUF.
 *
 * Weights are quantised by quant.c's own quantisers (the IQ2/IQ3 lattice
 * types, which have none, get random codes: quant_lattice_row) and streamed
 * to the file one row at a time: no float copy of a tensor is ever held. To
 * keep writing a 30 GB model fast, each tensor quantises a bank of random
 * rows (at most SYNTH_BANK rows and SYNTH_BANK_ELEMS elements, at least 16
 * rows: the K-quant quantisers search scales and cost ~100 ns an element)
 * and writes its rows by drawing from that bank (every byte is still a real
 * block of the type; the values only matter for speed measurements).
 * The numbers it writes are meaningless: never use these files for quality.
 */
#include "strata.h"

#include <math.h>
#include <stdlib.h>
#include <string.h>

#define SYNTH_BANK 256
#define SYNTH_BANK_ELEMS (1 << 18)

struct shape {
    const char *name, *arch;
    int n_vocab, n_embd, n_layer, n_head, n_head_kv, head_dim, n_ff;
    int n_expert, n_expert_used, n_ff_exp, n_ctx, tied;
    float rope_base, rms_eps;
};

/* Published configurations (ARCH.md §3.8; Qwen3-0.6B from its config.json). */
static const struct shape shapes[] = {
    {"qwen3-0.6b", "qwen3", 151936, 1024, 28, 16, 8, 128, 3072, 0, 0, 0, 40960, 0, 1e6f, 1e-6f},
    {"qwen3-8b", "qwen3", 151936, 4096, 36, 32, 8, 128, 12288, 0, 0, 0, 40960, 0, 1e6f, 1e-6f},
    {"qwen3-30b-a3b", "qwen3moe", 151936, 2048, 48, 32, 4, 128, 6144, 128, 8, 768, 40960, 0,
     1e6f, 1e-6f},
    {"llama3-8b", "llama", 128256, 4096, 32, 32, 8, 128, 14336, 0, 0, 0, 131072, 0, 5e5f, 1e-5f},
    /* Qwen3-32B (its config.json): ffn_down 25,600 columns wide */
    {"qwen3-32b", "qwen3", 151936, 5120, 64, 64, 8, 128, 25600, 0, 0, 0, 40960, 0, 1e6f, 1e-6f},
};

/* ---- random numbers: xorshift64*, enough for weights ---- */

static uint64_t rng_next(uint64_t *s)
{
    *s ^= *s >> 12;
    *s ^= *s << 25;
    *s ^= *s >> 27;
    return *s * 0x2545F4914F6CDD1Dull;
}

static float rng_uniform(uint64_t *s) /* in [-1, 1) */
{
    return (float)((rng_next(s) >> 40) * (2.0 / 16777216.0) - 1.0);
}

/* ---- one tensor ---- */

struct out {
    struct gguf_writer *w;
    uint64_t rng;
    char *err;
    size_t errlen;
};

/* One tensor to write: `scale` is the half-width of the uniform
 * distribution; `fill` >= 0 writes that constant instead (norm weights). */
struct tdesc {
    char name[GGUF_NAME_MAX];
    int type, n_dims;
    int64_t ne[3];
    float scale, fill;
};

static int write_tensor(struct out *o, const struct tdesc *t)
{
    int type = t->type;
    const struct quant_type *qt = quant_type(type);
    int64_t k = t->ne[0], rows = 1;
    for (int d = 1; d < t->n_dims; d++)
        rows *= t->ne[d];
    size_t rb = quant_row_bytes(type, k);
    int64_t cap = SYNTH_BANK_ELEMS / k;
    cap = cap < 16 ? 16 : cap > SYNTH_BANK ? SYNTH_BANK : cap;
    int bank = rows < cap ? (int)rows : (int)cap;
    float *f = malloc((size_t)k * sizeof *f);
    uint8_t *q = malloc(rb * (size_t)bank);
    if (!f || !q) {
        free(f);
        free(q);
        snprintf(o->err, o->errlen, "synth: out of memory for tensor %s", t->name);
        return -1;
    }
    for (int b = 0; b < bank; b++) {
        uint8_t *qb = q + (size_t)b * rb;
        if (!qt->from_f32) {   /* a lattice type: random codes of that width */
            for (size_t i = 0; i < rb; i++)
                qb[i] = (uint8_t)(rng_next(&o->rng) >> 56);
            quant_lattice_row(type, qb, k, t->scale);
            continue;
        }
        for (int64_t i = 0; i < k; i++)
            f[i] = t->fill >= 0 ? t->fill : t->scale * rng_uniform(&o->rng);
        qt->from_f32(f, qb, k);
    }
    int rc = 0;
    for (int64_t r = 0; r < rows && rc == 0; r++) {
        int b = rows <= bank ? (int)r : (int)(rng_next(&o->rng) % (uint64_t)bank);
        rc = gguf_w_data(o->w, q + (size_t)b * rb, rb);
    }
    free(f);
    free(q);
    if (rc != 0)
        snprintf(o->err, o->errlen, "synth: write failed in tensor %s", t->name);
    return rc;
}

/* ---- the model's tensor list ---- */

static int add(struct tdesc *list, int n, const char *name, int type, int n_dims, int64_t a,
               int64_t b, int64_t c, float scale, float fill)
{
    struct tdesc *t = &list[n];
    snprintf(t->name, sizeof t->name, "%s", name);
    t->type = type;
    t->n_dims = n_dims;
    t->ne[0] = a;
    t->ne[1] = b;
    t->ne[2] = c;
    t->scale = scale;
    t->fill = fill;
    return n + 1;
}

/* Q4_K_M's and Q5_K_M's layers of more bits: the reference quantiser's
 * rule for attn_v and ffn_down (the first and last eighth of the layers,
 * and every third in between), which give those tensors Q6_K (and the head
 * Q6_K) in a Q4_K_M or Q5_K_M file; ../shared/testdata's tiny-qwen3-Q4_K_M
 * has it (layers 2 and 3 of 4). */
static int more_bits(int l, int n) { return l < n / 8 || l >= 7 * n / 8 || (l - n / 8) % 3 == 2; }

/* Fills list (capacity: 16 per layer + 3) in the order the reference writes:
 * matrices in the weight type wt (m: a _K_M mix, wt Q4_K or Q5_K), vectors and
 * the MoE router in F32 (as the reference's converter keeps them). */
static int tensor_list(const struct shape *s, int wt, int m, struct tdesc *list)
{
    int n = 0, qwen3 = strncmp(s->arch, "qwen3", 5) == 0, moe = s->n_expert > 0;
    int64_t d = s->n_embd, q = (int64_t)s->n_head * s->head_dim,
            kv = (int64_t)s->n_head_kv * s->head_dim;
    float sd = 1.7f / sqrtf((float)d); /* uniform half-width for std ≈ 1/sqrt(D) */
    n = add(list, n, "token_embd.weight", wt, 2, d, s->n_vocab, 1, 1.7f * 0.05f, -1);
    n = add(list, n, "output_norm.weight", QT_F32, 1, d, 1, 1, 0, 1.0f);
    if (!s->tied)
        n = add(list, n, "output.weight", m ? QT_Q6_K : wt, 2, d, s->n_vocab, 1, sd, -1);
    for (int l = 0; l < s->n_layer; l++) {
        char name[GGUF_NAME_MAX];
        int vt = m && more_bits(l, s->n_layer) ? QT_Q6_K : wt;   /* attn_v and ffn_down */
#define T(suffix, ...) (snprintf(name, sizeof name, "blk.%d." suffix, l), n = add(list, n, name, __VA_ARGS__))
        T("attn_norm.weight", QT_F32, 1, d, 1, 1, 0, 1.0f);
        T("attn_q.weight", wt, 2, d, q, 1, sd, -1);
        T("attn_k.weight", wt, 2, d, kv, 1, sd, -1);
        T("attn_v.weight", vt, 2, d, kv, 1, sd, -1);
        if (strcmp(s->arch, "qwen2") == 0) {
            T("attn_q.bias", QT_F32, 1, q, 1, 1, 0.1f, -1);
            T("attn_k.bias", QT_F32, 1, kv, 1, 1, 0.1f, -1);
            T("attn_v.bias", QT_F32, 1, kv, 1, 1, 0.1f, -1);
        }
        if (qwen3) {
            T("attn_q_norm.weight", QT_F32, 1, s->head_dim, 1, 1, 0, 1.0f);
            T("attn_k_norm.weight", QT_F32, 1, s->head_dim, 1, 1, 0, 1.0f);
        }
        T("attn_output.weight", wt, 2, q, d, 1, 1.7f / sqrtf((float)q), -1);
        T("ffn_norm.weight", QT_F32, 1, d, 1, 1, 0, 1.0f);
        if (moe) {
            float se = 1.7f / sqrtf((float)s->n_ff_exp);
            T("ffn_gate_inp.weight", QT_F32, 2, d, s->n_expert, 1, sd, -1);
            T("ffn_gate_exps.weight", wt, 3, d, s->n_ff_exp, s->n_expert, sd, -1);
            T("ffn_up_exps.weight", wt, 3, d, s->n_ff_exp, s->n_expert, sd, -1);
            T("ffn_down_exps.weight", vt, 3, s->n_ff_exp, d, s->n_expert, se, -1);
        } else {
            T("ffn_gate.weight", wt, 2, d, s->n_ff, 1, sd, -1);
            T("ffn_up.weight", wt, 2, d, s->n_ff, 1, sd, -1);
            T("ffn_down.weight", vt, 2, s->n_ff, d, 1, 1.7f / sqrtf((float)s->n_ff), -1);
        }
#undef T
    }
    return n;
}

/* ---- metadata ---- */

static void write_hparams(struct gguf_writer *w, const struct shape *s)
{
    char key[128], name[96];
    snprintf(name, sizeof name, "strata-synth %s (random weights)", s->name);
    gguf_w_str(w, "general.architecture", s->arch);
    gguf_w_str(w, "general.name", name);
    gguf_w_u32(w, "general.quantization_version", 2);
#define K(suffix) (snprintf(key, sizeof key, "%s." suffix, s->arch), key)
    gguf_w_u32(w, K("context_length"), (uint32_t)s->n_ctx);
    gguf_w_u32(w, K("embedding_length"), (uint32_t)s->n_embd);
    gguf_w_u32(w, K("block_count"), (uint32_t)s->n_layer);
    gguf_w_u32(w, K("feed_forward_length"), (uint32_t)s->n_ff);
    gguf_w_u32(w, K("attention.head_count"), (uint32_t)s->n_head);
    gguf_w_u32(w, K("attention.head_count_kv"), (uint32_t)s->n_head_kv);
    gguf_w_u32(w, K("attention.key_length"), (uint32_t)s->head_dim);
    gguf_w_u32(w, K("attention.value_length"), (uint32_t)s->head_dim);
    gguf_w_f32(w, K("attention.layer_norm_rms_epsilon"), s->rms_eps);
    gguf_w_f32(w, K("rope.freq_base"), s->rope_base);
    gguf_w_u32(w, K("rope.dimension_count"), (uint32_t)s->head_dim);
    if (s->n_expert > 0) {
        gguf_w_u32(w, K("expert_count"), (uint32_t)s->n_expert);
        gguf_w_u32(w, K("expert_used_count"), (uint32_t)s->n_expert_used);
        gguf_w_u32(w, K("expert_feed_forward_length"), (uint32_t)s->n_ff_exp);
    }
#undef K
}

/* A byte-fallback SPM vocabulary of n tokens for files made without --vocab:
 * <unk>, <s>, </s>, the 256 byte tokens, then "▁t<i>" pieces. */
static void write_plain_vocab(struct gguf_writer *w, int n)
{
    char **tok = malloc((size_t)n * sizeof *tok);
    float *score = malloc((size_t)n * sizeof *score);
    int32_t *type = malloc((size_t)n * sizeof *type);
    if (!tok || !score || !type) {
        free(tok);
        free(score);
        free(type);
        return;
    }
    for (int i = 0; i < n; i++) {
        char buf[32];
        if (i < 3)
            snprintf(buf, sizeof buf, "%s", i == 0 ? "<unk>" : i == 1 ? "<s>" : "</s>");
        else if (i < 259)
            snprintf(buf, sizeof buf, "<0x%02X>", i - 3);
        else
            snprintf(buf, sizeof buf, "\xe2\x96\x81t%d", i);
        tok[i] = strdup(buf);
        score[i] = i < 259 ? 0.0f : -(float)i;
        type[i] = i == 0 ? 2 : i < 3 ? 3 : i < 259 ? 6 : 1;
    }
    gguf_w_str(w, "tokenizer.ggml.model", "llama");
    gguf_w_arr_str(w, "tokenizer.ggml.tokens", (uint64_t)n, (const char *const *)tok);
    gguf_w_arr(w, "tokenizer.ggml.scores", GGUF_F32, (uint64_t)n, score);
    gguf_w_arr(w, "tokenizer.ggml.token_type", GGUF_I32, (uint64_t)n, type);
    gguf_w_u32(w, "tokenizer.ggml.bos_token_id", 1);
    gguf_w_u32(w, "tokenizer.ggml.eos_token_id", 2);
    for (int i = 0; i < n; i++)
        free(tok[i]);
    free(tok);
    free(score);
    free(type);
}

/* ---- the command ---- */

static int set_field(struct shape *s, const char *kv, char *err, size_t errlen)
{
    static const struct { const char *key; size_t off; } fields[] = {
#define F(x) {#x, offsetof(struct shape, x)}
        F(n_vocab), F(n_embd), F(n_layer), F(n_head), F(n_head_kv), F(head_dim), F(n_ff),
        F(n_expert), F(n_expert_used), F(n_ff_exp), F(n_ctx), F(tied),
#undef F
    };
    const char *eq = strchr(kv, '=');
    if (!eq) {
        snprintf(err, errlen, "synth: --set wants KEY=VALUE, got '%s'", kv);
        return -1;
    }
    size_t n = (size_t)(eq - kv);
    char *end;
    if (n == 9 && strncmp(kv, "rope_base", 9) == 0) {
        s->rope_base = strtof(eq + 1, &end);
        return *end ? (snprintf(err, errlen, "synth: bad number in '%s'", kv), -1) : 0;
    }
    if (n == 7 && strncmp(kv, "rms_eps", 7) == 0) {
        s->rms_eps = strtof(eq + 1, &end);
        return *end ? (snprintf(err, errlen, "synth: bad number in '%s'", kv), -1) : 0;
    }
    for (size_t i = 0; i < sizeof fields / sizeof fields[0]; i++)
        if (strlen(fields[i].key) == n && strncmp(kv, fields[i].key, n) == 0) {
            long v = strtol(eq + 1, &end, 10);
            if (*end || eq[1] == 0 || v < 0 || v > (1L << 30)) {
                snprintf(err, errlen, "synth: bad value in '%s'", kv);
                return -1;
            }
            *(int *)((char *)s + fields[i].off) = (int)v;
            return 0;
        }
    snprintf(err, errlen, "synth: unknown --set key '%.*s' (n_vocab n_embd n_layer n_head "
             "n_head_kv head_dim n_ff n_expert n_expert_used n_ff_exp n_ctx tied rope_base rms_eps)",
             (int)n, kv);
    return -1;
}

static int type_by_name(const char *name)
{
    for (int t = 0; t < QT_COUNT; t++)
        if (strcasecmp(gguf_type_name(t), name) == 0)
            return t;
    return -1;
}

int synth_main(int argc, char **argv, char *err, size_t errlen)
{
    struct shape s = {"custom", NULL, 32000, 0, 0, 0, 0, 0, 0, 0, 0, 0, 4096, 0, 1e4f, 1e-5f};
    const char *arch = NULL, *vocab = NULL, *outp = NULL, *tname = NULL;
    uint64_t seed = 1;
    int have_shape = 0;
    for (int i = 1; i < argc; i++) {
        const char *a = argv[i], *v = i + 1 < argc ? argv[i + 1] : NULL;
        if (!v) {
            snprintf(err, errlen, "synth: %s needs a value", a);
            return -1;
        }
        i++;
        if (strcmp(a, "--arch") == 0) {
            arch = v;
        } else if (strcmp(a, "--shape") == 0) {
            size_t k = 0;
            while (k < sizeof shapes / sizeof shapes[0] && strcmp(shapes[k].name, v) != 0)
                k++;
            if (k == sizeof shapes / sizeof shapes[0]) {
                snprintf(err, errlen, "synth: unknown shape '%s' (qwen3-0.6b qwen3-8b qwen3-32b "
                         "qwen3-30b-a3b llama3-8b)", v);
                return -1;
            }
            s = shapes[k];
            have_shape = 1;
        } else if (strcmp(a, "--set") == 0) {
            if (set_field(&s, v, err, errlen) != 0)
                return -1;
        } else if (strcmp(a, "--type") == 0) {
            tname = v;
        } else if (strcmp(a, "--vocab") == 0) {
            vocab = v;
        } else if (strcmp(a, "-o") == 0) {
            outp = v;
        } else if (strcmp(a, "--seed") == 0) {
            seed = strtoull(v, NULL, 10) | 1;
        } else {
            snprintf(err, errlen, "synth: unknown option '%s'", a);
            return -1;
        }
    }
    if (arch)
        s.arch = arch;
    if (!s.arch || !outp || !tname) {
        snprintf(err, errlen, "synth: needs --arch (or --shape), --type and -o");
        return -1;
    }
    if (strcmp(s.arch, "llama") && strcmp(s.arch, "qwen2") && strcmp(s.arch, "qwen3") &&
        strcmp(s.arch, "qwen3moe")) {
        snprintf(err, errlen, "synth: unsupported architecture '%s' (llama qwen2 qwen3 qwen3moe)",
                 s.arch);
        return -1;
    }
    if (!have_shape && s.head_dim == 0 && s.n_head > 0)
        s.head_dim = s.n_embd / s.n_head;
    if (s.n_head_kv == 0)
        s.n_head_kv = s.n_head;
    if (s.n_embd <= 0 || s.n_layer <= 0 || s.n_head <= 0 || s.head_dim <= 0 ||
        s.n_head % s.n_head_kv != 0 || (s.n_expert == 0 && s.n_ff <= 0) ||
        (strcmp(s.arch, "qwen3moe") == 0 && (s.n_expert <= 0 || s.n_ff_exp <= 0 ||
                                             s.n_expert_used <= 0 || s.n_expert_used > s.n_expert))) {
        snprintf(err, errlen, "synth: incomplete or inconsistent shape (give --shape or --set "
                 "n_embd, n_layer, n_head, n_ff; qwen3moe also n_expert, n_expert_used, n_ff_exp)");
        return -1;
    }
    struct out o = {NULL, seed * 0x9E3779B97F4A7C15ull, err, errlen};
    int mix = strcasecmp(tname, "q4_k_m") == 0 || strcasecmp(tname, "q5_k_m") == 0;
    int wt = !mix ? type_by_name(tname) : tname[1] == '4' ? QT_Q4_K : QT_Q5_K;
    const struct quant_type *qt = wt >= 0 ? quant_type(wt) : NULL;
    if (!qt || (!qt->from_f32 && !quant_lattice(wt)) || wt == QT_Q8_1 || wt == QT_Q8_K) {
        snprintf(err, errlen, "synth: no quantiser for weight type '%s'", tname);
        return -1;
    }

    struct gguf voc;
    memset(&voc, 0, sizeof voc);
    if (vocab) {
        char msg[256];
        if (gguf_open(&voc, vocab, msg, sizeof msg) != 0) {
            snprintf(err, errlen, "synth: vocabulary %s: %s", vocab, msg);
            return -1;
        }
        const struct gguf_kv *toks = gguf_find(&voc, "tokenizer.ggml.tokens");
        if (!toks || toks->type != GGUF_ARR) {
            snprintf(err, errlen, "synth: %s has no tokenizer.ggml.tokens", vocab);
            gguf_close(&voc);
            return -1;
        }
        s.n_vocab = (int)toks->n;
    }

    int cap = 16 * s.n_layer + 3;
    struct tdesc *list = calloc((size_t)cap, sizeof *list);
    if (!list) {
        gguf_close(&voc);
        snprintf(err, errlen, "synth: out of memory");
        return -1;
    }
    int n = tensor_list(&s, wt, mix, list);
    int rc = 0;
    for (int i = 0; i < n && rc == 0; i++) {
        const struct quant_type *tt = quant_type(list[i].type);
        if (list[i].ne[0] % tt->blck != 0) {
            snprintf(err, errlen, "synth: tensor %s has rows of %lld, not a multiple of the %s "
                     "block (%d); choose another --type", list[i].name, (long long)list[i].ne[0],
                     tt->name, tt->blck);
            rc = -1;
        }
    }
    o.w = rc == 0 ? gguf_w_new() : NULL;
    if (o.w) {
        write_hparams(o.w, &s);
        if (vocab) {
            for (uint64_t i = 0; i < voc.n_kv; i++)
                if (voc.kv[i].key.len > 10 && memcmp(voc.kv[i].key.ptr, "tokenizer.", 10) == 0)
                    gguf_w_copy(o.w, &voc.kv[i]);
        } else {
            write_plain_vocab(o.w, s.n_vocab);
        }
        for (int i = 0; i < n; i++)
            gguf_w_tensor(o.w, list[i].name, list[i].type, list[i].n_dims, list[i].ne);
        rc = gguf_w_begin(o.w, outp, err, errlen);
        for (int i = 0; i < n && rc == 0; i++)
            rc = write_tensor(&o, &list[i]);
        char msg[256];
        if (gguf_w_end(o.w, msg, sizeof msg) != 0 && rc == 0) {
            snprintf(err, errlen, "synth: %s", msg);
            rc = -1;
        }
    } else if (rc == 0) {
        snprintf(err, errlen, "synth: out of memory");
        rc = -1;
    }
    free(list);
    gguf_close(&voc);
    return rc;
}
