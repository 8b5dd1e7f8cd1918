/*
 * model.c — architectures (hyper-parameters, tensor binding) and the CPU
 * forward pass: llama, qwen2, qwen3 and qwen3moe as ARCH.md §3.0-3.4 state
 * them, with the reference engine's numerics (ARCH.md §0). At the end, the
 * small public wrapper strata_* bundles model, tokenizer and sampler.
 *
 * Weights stay in the GGUF mapping and are read through quant.c; 1-D tensors
 * (norms, biases) that are not F32 are converted once at load. A context
 * allocates everything it needs in model_ctx_new: evaluation never allocates.
 * Matrix products are split over the pool by weight rows, so decode streams
 * each matrix once at memory bandwidth; with a prompt, each input is
 * quantised and packed for quant_gemm_packed once and read by every matrix
 * that takes it (Q, K, V; gate, up). Attention lives behind attn_forward,
 * over a contiguous per-layer KV cache (F16 or F32 cells).
 *
 * Shapes: T tokens of a chunk, D model width, H query heads, K kv heads,
 * E head dim, F feed-forward width, X experts, U experts used, V vocab, C cells.
 */
#include "strata.h"

#include <inttypes.h>
#include <math.h>
#include <stdatomic.h>
#include <stdlib.h>
#include <string.h>
#include <unistd.h>

#if defined(__AVX512F__) || defined(__AVX2__) || defined(__F16C__)
#include <immintrin.h>
#endif

#define MODEL_CHUNK 512   /* tokens per forward chunk: bounds the scratch buffers */
#define MM_ROWS 16        /* weight rows per work unit (prompts; decode takes more) */
#define MM_MIN_ELEMS 8192 /* element count below which a row loop stays on the caller */
#define ATTN_QB 8         /* query rows per attention task in a batch */

/* ==== the model: weights bound to tensors of the mapping ==== */

struct model {
    struct gguf g;
    struct model_hp hp;
    struct tok *tok;              /* NULL when the file has no tokenizer */
    struct model_mat tok_embd;          /* (V, D) */
    struct model_mat output;            /* (V, D): tok_embd when tied */
    const float *output_norm;     /* (D) */
    const float *output_b;        /* (V) optional */
    const float *rope_freqs;      /* (n_rot/2) optional frequency divisors */
    float freq_scale;             /* 1 / rope.scaling.factor for linear scaling */
    struct model_layer *layers;         /* (n_layer) */
    float *vecs;                  /* F32 copies of the non-F32 1-D tensors */
    size_t vecs_used, vecs_cap;   /* floats */
    size_t max_act_row;           /* bytes of the widest activation row in any dot type */
    size_t max_pack16;            /* bytes of the largest packed input of 16 tokens */
    size_t max_gemm_scratch;      /* bytes of the largest quant_gemm_packed scratch */
};

/* ==== loading ==== */

struct loader {
    struct model *m;
    const char *arch;
    char *err;
    size_t errlen;
};

static int ld_key_int(struct loader *L, const char *suffix, int64_t def, int required, int64_t *out)
{
    char key[128];
    snprintf(key, sizeof key, "%s.%s", L->arch, suffix);
    const struct gguf_kv *kv = gguf_find(&L->m->g, key);
    if (!kv) {
        if (required)
            return strata_errf(L->err, L->errlen, "missing metadata key '%s'", key);
        *out = def;
        return 0;
    }
    if (kv->type == GGUF_ARR) {
        /* per-layer values: accepted only when every layer has the same one */
        if (kv->n == 0)
            return strata_errf(L->err, L->errlen, "metadata key '%s' is an empty array", key);
        int64_t v0 = gguf_arr_int(kv, 0);
        for (uint64_t i = 1; i < kv->n; i++)
            if (gguf_arr_int(kv, i) != v0)
                return strata_errf(L->err, L->errlen,
                                  "metadata key '%s': per-layer values differ (not supported)", key);
        *out = v0;
        return 0;
    }
    if (gguf_get_int(&L->m->g, key, out) != 0)
        return strata_errf(L->err, L->errlen, "metadata key '%s' is not an integer", key);
    return 0;
}

static int ld_key_f32(struct loader *L, const char *suffix, float def, int required, float *out)
{
    char key[128];
    snprintf(key, sizeof key, "%s.%s", L->arch, suffix);
    if (!gguf_find(&L->m->g, key)) {
        if (required)
            return strata_errf(L->err, L->errlen, "missing metadata key '%s'", key);
        *out = def;
        return 0;
    }
    if (gguf_get_f32(&L->m->g, key, out) != 0)
        return strata_errf(L->err, L->errlen, "metadata key '%s' is not a number", key);
    return 0;
}

static void shape_str(char *buf, size_t cap, const int64_t *ne, int nd)
{
    size_t o = (size_t)snprintf(buf, cap, "[");
    for (int i = 0; i < nd && o < cap; i++)
        o += (size_t)snprintf(buf + o, cap - o, i ? ", %" PRId64 : "%" PRId64, ne[i]);
    if (o < cap)
        snprintf(buf + o, cap - o, "]");
}

/* Finds `name` and checks it has exactly the dims ne[0..nd) (the rest 1). */
static const struct gguf_tensor *ld_tensor(struct loader *L, const char *name, const int64_t *ne,
                                           int nd, int required, int *failed)
{
    const struct gguf_tensor *t = gguf_tensor(&L->m->g, name);
    if (!t) {
        if (required) {
            strata_errf(L->err, L->errlen, "missing tensor '%s'", name);
            *failed = 1;
        }
        return NULL;
    }
    for (int i = 0; i < GGUF_MAX_DIMS; i++) {
        if (t->ne[i] != (i < nd ? ne[i] : 1)) {
            char want[96], got[96];
            shape_str(want, sizeof want, ne, nd);
            shape_str(got, sizeof got, t->ne, t->n_dims);
            strata_errf(L->err, L->errlen, "tensor '%s' has shape %s, expected %s", name, got, want);
            *failed = 1;
            return NULL;
        }
    }
    const struct quant_type *qt = quant_type(t->type);
    if (!qt || !qt->to_f32) {
        strata_errf(L->err, L->errlen, "tensor '%s' has unsupported type %s (%d)", name,
                   gguf_type_name(t->type), t->type);
        *failed = 1;
        return NULL;
    }
    return t;
}

/* Binds a matrix {n, rows} (n_exp > 0: {n, rows, n_exp}). Returns 0 when
 * bound, 1 when optional and absent, -1 on error. */
static int ld_mat(struct loader *L, struct model_mat *w, const char *name, int64_t n, int64_t rows,
                  int64_t n_exp, int required)
{
    int failed = 0;
    int64_t ne[3] = {n, rows, n_exp};
    const struct gguf_tensor *t = ld_tensor(L, name, ne, n_exp > 0 ? 3 : 2, required, &failed);
    if (!t)
        return failed ? -1 : 1;
    const struct quant_type *qt = quant_type(t->type);
    const struct quant_type *dt = quant_type(qt->dot_type);
    if (!qt->dot || !dt || (qt->dot_type != QT_F32 && !dt->from_f32) || n % qt->blck != 0)
        return strata_errf(L->err, L->errlen, "tensor '%s': type %s cannot be multiplied here",
                          name, gguf_type_name(t->type));
    w->data = t->data;
    w->type = t->type;
    w->n = (int)n;
    w->rows = (int)rows;
    w->ldw = quant_row_bytes(t->type, n);
    w->stride = w->ldw * (size_t)rows;
    return 0;
}

/* Binds a vector of n floats, converting it when it is not F32. */
static int ld_vec(struct loader *L, const float **v, const char *name, int64_t n, int required)
{
    int failed = 0;
    const struct gguf_tensor *t = ld_tensor(L, name, &n, 1, required, &failed);
    if (!t) {
        *v = NULL;
        return failed ? -1 : 0;
    }
    struct model *m = L->m;
    if (t->type == QT_F32 && ((uintptr_t)t->data & 3) == 0) {
        *v = t->data;
        return 0;
    }
    const struct quant_type *qt = quant_type(t->type);
    if (n % qt->blck != 0 || m->vecs_used + (size_t)n > m->vecs_cap)
        return strata_errf(L->err, L->errlen, "tensor '%s': cannot convert %s vector", name,
                          gguf_type_name(t->type));
    float *dst = m->vecs + m->vecs_used;
    qt->to_f32(t->data, dst, n);
    m->vecs_used += (size_t)n;
    *v = dst;
    return 0;
}

static int ld_hparams(struct loader *L)
{
    struct model *m = L->m;
    struct model_hp *hp = &m->hp;
    int64_t v;
    struct gguf_str s;
    if (gguf_get_str(&m->g, "general.architecture", &s) != 0)
        return strata_errf(L->err, L->errlen, "missing metadata key 'general.architecture'");
    static const struct { const char *name; int arch; } archs[] = {
        {"llama", ARCH_LLAMA}, {"qwen2", ARCH_QWEN2}, {"qwen3", ARCH_QWEN3}, {"qwen3moe", ARCH_QWEN3MOE},
    };
    hp->arch = -1;
    for (size_t i = 0; i < sizeof archs / sizeof archs[0]; i++)
        if (s.len == strlen(archs[i].name) && memcmp(s.ptr, archs[i].name, s.len) == 0) {
            hp->arch = archs[i].arch;
            L->arch = archs[i].name;
        }
    if (hp->arch < 0)
        return strata_errf(L->err, L->errlen, "unsupported architecture '%.*s'",
                          (int)(s.len < 64 ? s.len : 64), s.ptr);

    if (ld_key_int(L, "embedding_length", 0, 1, &v)) return -1;
    hp->n_embd = (int)v;
    if (ld_key_int(L, "block_count", 0, 1, &v)) return -1;
    hp->n_layer = (int)v;
    if (ld_key_int(L, "attention.head_count", 0, 1, &v)) return -1;
    hp->n_head = (int)v;
    if (ld_key_int(L, "attention.head_count_kv", hp->n_head, 0, &v)) return -1;
    hp->n_head_kv = (int)v;
    if (hp->n_embd <= 0 || hp->n_layer <= 0 || hp->n_head <= 0 || hp->n_head_kv <= 0 ||
        hp->n_embd > (1 << 20) || hp->n_layer > 4096 || hp->n_head > 4096 ||
        hp->n_head % hp->n_head_kv != 0)
        return strata_errf(L->err, L->errlen, "bad shape: n_embd %d, n_layer %d, n_head %d, n_head_kv %d",
                          hp->n_embd, hp->n_layer, hp->n_head, hp->n_head_kv);
    if (ld_key_int(L, "attention.key_length", hp->n_embd / hp->n_head, 0, &v)) return -1;
    hp->head_dim = (int)v;
    if (ld_key_int(L, "attention.value_length", hp->head_dim, 0, &v)) return -1;
    if (v != hp->head_dim)
        return strata_errf(L->err, L->errlen, "%s.attention.value_length %" PRId64
                          " differs from key_length %d (not supported)", L->arch, v, hp->head_dim);
    if (ld_key_int(L, "feed_forward_length", 0, 0, &v)) return -1;
    hp->n_ff = (int)v;
    if (ld_key_int(L, "expert_count", 0, 0, &v)) return -1;
    hp->n_expert = (int)v;
    if (ld_key_int(L, "expert_used_count", 0, 0, &v)) return -1;
    hp->n_expert_used = (int)v;
    if (ld_key_int(L, "expert_feed_forward_length",
                   hp->n_expert_used > 0 ? hp->n_ff / hp->n_expert_used : 0, 0, &v)) return -1;
    hp->n_ff_exp = (int)v;
    if (ld_key_int(L, "context_length", 2048, 0, &v)) return -1;
    hp->n_ctx_train = (int)v;
    if (ld_key_int(L, "rope.dimension_count", hp->head_dim, 0, &v)) return -1;
    hp->n_rot = (int)v;
    hp->rope_neox = hp->arch != ARCH_LLAMA;
    if (ld_key_f32(L, "rope.freq_base", 10000.0f, 0, &hp->rope_base)) return -1;
    if (ld_key_f32(L, "attention.layer_norm_rms_epsilon", 0, 1, &hp->rms_eps)) return -1;
    if (hp->head_dim <= 0 || hp->head_dim % 2 || hp->head_dim > 1024 || hp->n_rot <= 0 ||
        hp->n_rot % 2 || hp->n_rot > hp->head_dim || hp->n_ff < 0 || hp->n_ctx_train <= 0)
        return strata_errf(L->err, L->errlen, "bad shape: head_dim %d, n_rot %d, n_ff %d",
                          hp->head_dim, hp->n_rot, hp->n_ff);
    if (hp->n_expert < 0 || hp->n_expert > 4096 || hp->n_expert_used < 0 ||
        hp->n_expert_used > hp->n_expert || (hp->n_expert > 0 && hp->n_expert_used == 0) ||
        hp->n_ff_exp < 0)
        return strata_errf(L->err, L->errlen, "bad expert counts: %d experts, %d used, width %d",
                          hp->n_expert, hp->n_expert_used, hp->n_ff_exp);

    /* RoPE scaling: none or linear; the others change the frequencies in ways
     * this engine does not reproduce yet */
    m->freq_scale = 1.0f;
    char key[128];
    snprintf(key, sizeof key, "%s.rope.scaling.type", L->arch);
    if (gguf_get_str(&m->g, key, &s) == 0 && !(s.len == 4 && memcmp(s.ptr, "none", 4) == 0)) {
        if (!(s.len == 6 && memcmp(s.ptr, "linear", 6) == 0))
            return strata_errf(L->err, L->errlen, "%s '%.*s' is not supported", key,
                              (int)(s.len < 32 ? s.len : 32), s.ptr);
        float factor;
        if (ld_key_f32(L, "rope.scaling.factor", 1.0f, 0, &factor)) return -1;
        if (!(factor > 0))
            return strata_errf(L->err, L->errlen, "%s.rope.scaling.factor must be positive", L->arch);
        m->freq_scale = 1.0f / factor;
    }
    return 0;
}

/* Room for F32 copies of every non-F32 1-D tensor. */
static int ld_vec_arena(struct model *m, char *err, size_t errlen)
{
    size_t n = 0;
    for (uint64_t i = 0; i < m->g.n_tensors; i++) {
        const struct gguf_tensor *t = &m->g.tensors[i];
        if (t->n_dims == 1 && (t->type != QT_F32 || ((uintptr_t)t->data & 3)))
            n += (size_t)t->ne[0];
    }
    m->vecs_cap = n;
    if (n && !(m->vecs = malloc(n * sizeof(float))))
        return strata_errf(err, errlen, "out of memory for %zu norm weights", n);
    return 0;
}

static void note_act(struct model *m, const struct model_mat *w, int width)
{
    if (!w->data)
        return;
    int dt = quant_type(w->type)->dot_type;
    size_t rb = dt == QT_F32 ? (size_t)width * 4 : quant_row_bytes(dt, width);
    if (rb == 0) /* width not a multiple of the block: the F32 fallback bound */
        rb = (size_t)width * 4;
    if (rb > m->max_act_row)
        m->max_act_row = rb;
    size_t pb = quant_pack_bytes(dt, width, 16), gs = quant_gemm_scratch(w->type, width);
    if (pb > m->max_pack16)
        m->max_pack16 = pb;
    if (gs > m->max_gemm_scratch)
        m->max_gemm_scratch = gs;
}

static int ld_layer(struct loader *L, int il)
{
    struct model *m = L->m;
    const struct model_hp *hp = &m->hp;
    struct model_layer *ly = &m->layers[il];
    int64_t D = hp->n_embd, E = hp->head_dim, HE = (int64_t)hp->n_head * E, KE = (int64_t)hp->n_head_kv * E;
    char n[GGUF_NAME_MAX + 32];
#define NAME(s) (snprintf(n, sizeof n, "blk.%d." s, il), n)
    if (ld_vec(L, &ly->attn_norm, NAME("attn_norm.weight"), D, 1)) return -1;
    int r = ld_mat(L, &ly->wq, NAME("attn_q.weight"), D, HE, 0, 0);
    if (r < 0) return -1;
    if (r == 1) {
        /* fused Q|K|V rows: three row ranges of one matrix */
        struct model_mat qkv;
        if (ld_mat(L, &qkv, NAME("attn_qkv.weight"), D, HE + 2 * KE, 0, 1)) {
            if (!gguf_tensor(&m->g, n))
                strata_errf(L->err, L->errlen, "missing tensor 'blk.%d.attn_q.weight'", il);
            return -1;
        }
        ly->wq = ly->wk = ly->wv = qkv;
        ly->wq.rows = (int)HE;
        ly->wk.rows = ly->wv.rows = (int)KE;
        ly->wk.data = qkv.data + qkv.ldw * (size_t)HE;
        ly->wv.data = qkv.data + qkv.ldw * (size_t)(HE + KE);
    } else {
        if (ld_mat(L, &ly->wk, NAME("attn_k.weight"), D, KE, 0, 1)) return -1;
        if (ld_mat(L, &ly->wv, NAME("attn_v.weight"), D, KE, 0, 1)) return -1;
    }
    if (ld_mat(L, &ly->wo, NAME("attn_output.weight"), HE, D, 0, 1)) return -1;
    if (ld_vec(L, &ly->bq, NAME("attn_q.bias"), HE, 0)) return -1;
    if (ld_vec(L, &ly->bk, NAME("attn_k.bias"), KE, 0)) return -1;
    if (ld_vec(L, &ly->bv, NAME("attn_v.bias"), KE, 0)) return -1;
    if (ld_vec(L, &ly->bo, NAME("attn_output.bias"), D, 0)) return -1;
    int qk_norm = hp->arch == ARCH_QWEN3 || hp->arch == ARCH_QWEN3MOE;
    if (ld_vec(L, &ly->q_norm, NAME("attn_q_norm.weight"), E, qk_norm)) return -1;
    if (ld_vec(L, &ly->k_norm, NAME("attn_k_norm.weight"), E, qk_norm)) return -1;
    if ((ly->q_norm != NULL) != (ly->k_norm != NULL))
        return strata_errf(L->err, L->errlen, "layer %d has only one of attn_q_norm/attn_k_norm", il);
    if (ld_vec(L, &ly->ffn_norm, NAME("ffn_norm.weight"), D, 1)) return -1;

    int X = hp->n_expert;
    ly->moe = hp->arch == ARCH_QWEN3MOE || gguf_tensor(&m->g, NAME("ffn_gate_inp.weight")) != NULL;
    if (ly->moe) {
        int64_t Fe = hp->n_ff_exp;
        if (X <= 0 || Fe <= 0)
            return strata_errf(L->err, L->errlen, "layer %d is MoE but %s.expert_count/"
                              "expert_feed_forward_length are missing", il, L->arch);
        if (ld_mat(L, &ly->gate_inp, NAME("ffn_gate_inp.weight"), D, X, 0, 1)) return -1;
        if (ld_mat(L, &ly->gate_exps, NAME("ffn_gate_exps.weight"), D, Fe, X, 1)) return -1;
        if (ld_mat(L, &ly->up_exps, NAME("ffn_up_exps.weight"), D, Fe, X, 1)) return -1;
        if (ld_mat(L, &ly->down_exps, NAME("ffn_down_exps.weight"), Fe, D, X, 1)) return -1;
        note_act(m, &ly->gate_inp, (int)D);
        note_act(m, &ly->gate_exps, (int)D);
        note_act(m, &ly->up_exps, (int)D);
        note_act(m, &ly->down_exps, (int)Fe);
    } else {
        int64_t F = hp->n_ff;
        if (F <= 0)
            return strata_errf(L->err, L->errlen, "missing metadata key '%s.feed_forward_length'", L->arch);
        if (ld_mat(L, &ly->gate, NAME("ffn_gate.weight"), D, F, 0, 1)) return -1;
        if (ld_mat(L, &ly->up, NAME("ffn_up.weight"), D, F, 0, 1)) return -1;
        if (ld_mat(L, &ly->down, NAME("ffn_down.weight"), F, D, 0, 1)) return -1;
        note_act(m, &ly->gate, (int)D);
        note_act(m, &ly->up, (int)D);
        note_act(m, &ly->down, (int)F);
    }
#undef NAME
    note_act(m, &ly->wq, (int)D);
    note_act(m, &ly->wk, (int)D);
    note_act(m, &ly->wv, (int)D);
    note_act(m, &ly->wo, (int)HE);
    return 0;
}

int model_load(struct model **out, const char *path, char *err, size_t errlen)
{
    *out = NULL;
    struct model *m = calloc(1, sizeof *m);
    if (!m)
        return strata_errf(err, errlen, "out of memory");
    if (gguf_open(&m->g, path, err, errlen) != 0) {
        free(m);
        return -1;
    }
    struct loader L = {m, NULL, err, errlen};
    struct model_hp *hp = &m->hp;
    if (ld_hparams(&L) || ld_vec_arena(m, err, errlen))
        goto fail;

    const struct gguf_tensor *te = gguf_tensor(&m->g, "token_embd.weight");
    if (!te) {
        strata_errf(err, errlen, "missing tensor 'token_embd.weight'");
        goto fail;
    }
    hp->n_vocab = (int)te->ne[1];
    if (te->ne[1] <= 0 || te->ne[1] > (1 << 24)) {
        strata_errf(err, errlen, "tensor 'token_embd.weight' has %" PRId64 " rows", te->ne[1]);
        goto fail;
    }
    int64_t D = hp->n_embd, V = hp->n_vocab;
    if (ld_mat(&L, &m->tok_embd, "token_embd.weight", D, V, 0, 1))
        goto fail;
    int r = ld_mat(&L, &m->output, "output.weight", D, V, 0, 0);
    if (r < 0)
        goto fail;
    if (r == 1)
        m->output = m->tok_embd;   /* tied LM head */
    note_act(m, &m->output, (int)D);
    if (ld_vec(&L, &m->output_norm, "output_norm.weight", D, 1) ||
        ld_vec(&L, &m->output_b, "output.bias", V, 0) ||
        ld_vec(&L, &m->rope_freqs, "rope_freqs.weight", hp->n_rot / 2, 0))
        goto fail;

    m->layers = calloc((size_t)hp->n_layer, sizeof *m->layers);
    if (!m->layers) {
        strata_errf(err, errlen, "out of memory");
        goto fail;
    }
    for (int il = 0; il < hp->n_layer; il++)
        if (ld_layer(&L, il))
            goto fail;
    if (gguf_find(&m->g, "tokenizer.ggml.model") && tok_load(&m->tok, &m->g, err, errlen) != 0)
        goto fail;
    *out = m;
    return 0;
fail:
    model_free(m);
    return -1;
}

void model_free(struct model *m)
{
    if (!m)
        return;
    if (m->tok)
        tok_free(m->tok);
    free(m->layers);
    free(m->vecs);
    gguf_close(&m->g);
    free(m);
}

const struct model_hp *model_hp(const struct model *m) { return &m->hp; }

void model_weights(const struct model *m, struct model_weights *w)
{
    w->tok_embd = m->tok_embd;
    w->output = m->output;
    w->output_norm = m->output_norm;
    w->output_b = m->output_b;
    w->rope_freqs = m->rope_freqs;
    w->freq_scale = m->freq_scale;
    w->layers = m->layers;
}
const struct tok *model_tok(const struct model *m) { return m->tok; }
const struct gguf *model_gguf(const struct model *m) { return &m->g; }

size_t model_weight_bytes(const struct model *m)
{
    size_t n = 0;
    for (uint64_t i = 0; i < m->g.n_tensors; i++)
        n += m->g.tensors[i].nbytes;
    return n;
}

static size_t mat_bytes(const struct model_mat *w) { return w->data ? w->stride : 0; }

size_t model_decode_bytes(const struct model *m)
{
    const struct model_hp *hp = &m->hp;
    size_t n = mat_bytes(&m->output) + m->tok_embd.ldw;
    for (int il = 0; il < hp->n_layer; il++) {
        const struct model_layer *ly = &m->layers[il];
        n += mat_bytes(&ly->wq) + mat_bytes(&ly->wk) + mat_bytes(&ly->wv) + mat_bytes(&ly->wo);
        if (ly->moe)
            n += mat_bytes(&ly->gate_inp) + (size_t)hp->n_expert_used *
                 (mat_bytes(&ly->gate_exps) + mat_bytes(&ly->up_exps) + mat_bytes(&ly->down_exps));
        else
            n += mat_bytes(&ly->gate) + mat_bytes(&ly->up) + mat_bytes(&ly->down);
    }
    return n;
}

/* ==== a context: KV cache and scratch ==== */

/* y[t*ldy + r] = row r of w · row t of a, for r < rows, t < na. */
struct mm_job {
    const uint8_t *w;
    int type, n, rows;
    size_t ldw;
    const void *a;
    size_t lda;
    int na;
    float *y;
    size_t ldy;
    const void *pack;     /* a packed for the tiled kernel, or NULL */
};

/* The jobs' rows are cut into units (mm_unit_rows). Each thread owns a
 * contiguous run of units of about equal cost (rows x activation rows) and
 * takes them in order through its cursor, so decode streams each slice of a
 * matrix once; a thread that runs out takes from the others' cursors, so the
 * work of one that falls behind (another program on its core) is finished
 * by the rest. Every unit is taken once: all takes are fetch-adds. */
struct mm_cursor {
    atomic_int next;   /* the next unit of the run */
    int end;           /* one past the run's last unit */
    char pad[56];      /* one cache line per thread */
};

struct model_ctx {
    struct model *m;
    struct pool *pool;
    int n_threads;
    int n_ctx, kv_type, f32ref;
    int n_past;                   /* cells holding valid K/V */
    int t_max;                    /* tokens per chunk */
    size_t kv_elt;                /* bytes per cache element */
    void *arena;                  /* the one allocation every buffer below lives in */
    uint8_t *k_cache, *v_cache;   /* (n_layer, K, C, E) */
    float *x;                     /* (T, D) residual stream */
    float *xn;                    /* (T, D) normed input / block output */
    float *q;                     /* (T, H*E) */
    float *k, *v;                 /* (T, K*E) */
    float *ao;                    /* (T, H*E) attention output */
    float *g, *u;                 /* (T*U, max(F, Fe)) gate and up products */
    float *eo;                    /* (T*U, D) expert outputs, grouped by expert */
    float *rope;                  /* (T, n_rot) cos/sin pairs per position */
    float *router;                /* (T, X) router logits, then probabilities */
    int *sel;                     /* (T, U) chosen experts, best first */
    float *selw;                  /* (T, U) their renormalised weights */
    int *selrow;                  /* (T, U) row of each choice in g/u/eo */
    int *ecount, *eoff;           /* (X) tokens per expert and their first row */
    struct mm_job *jobs;          /* (2X) expert products of one batch */
    struct mm_cursor *cursors;    /* (threads) work cursors of mm_run */
    uint8_t *gath;                /* (T*U, act row) activations gathered per expert */
    uint8_t *actbuf[2];           /* (T*U, act row) quantised activation slots */
    size_t act_row;               /* bytes per slot row */
    uint8_t *packbuf[2];          /* (pack_bytes) each slot's rows packed for quant_gemm_packed */
    size_t pack_bytes;
    float *tscratch;              /* (threads, tscratch_n) per-thread scratch */
    size_t tscratch_n;
    /* the input whose quantised copies the slots hold */
    const float *act_x;
    int act_T, act_n;
    int slot_type[2];             /* dot type held, -1 when empty */
    size_t slot_lda[2];
    int slot_packed[2];           /* packbuf[s] holds the slot's rows */
    int slot_next;
};

struct arena {
    uint8_t *base;
    size_t used;
};

static void *carve(struct arena *a, size_t bytes)
{
    size_t off = a->used;
    a->used += (bytes + 63) & ~(size_t)63;
    return a->base ? a->base + off : NULL;
}

/* Lays the context's buffers out in a (only sizes them when a->base is NULL). */
static void ctx_layout(struct model_ctx *c, struct arena *a)
{
    const struct model_hp *hp = &c->m->hp;
    size_t T = (size_t)c->t_max, D = (size_t)hp->n_embd, E = (size_t)hp->head_dim;
    size_t HE = (size_t)hp->n_head * E, KE = (size_t)hp->n_head_kv * E;
    size_t U = hp->n_expert_used > 0 ? (size_t)hp->n_expert_used : 1;
    size_t X = hp->n_expert > 0 ? (size_t)hp->n_expert : 1;
    size_t F = (size_t)(hp->n_ff > hp->n_ff_exp ? hp->n_ff : hp->n_ff_exp);
    size_t gu = T * F > T * U * (size_t)hp->n_ff_exp ? T * F : T * U * (size_t)hp->n_ff_exp;
    size_t cells = (size_t)hp->n_layer * (size_t)c->n_ctx * KE;
    c->k_cache = carve(a, cells * c->kv_elt);
    c->v_cache = carve(a, cells * c->kv_elt);
    c->x = carve(a, T * D * 4);
    c->xn = carve(a, T * D * 4);
    c->q = carve(a, T * HE * 4);
    c->k = carve(a, T * KE * 4);
    c->v = carve(a, T * KE * 4);
    c->ao = carve(a, T * HE * 4);
    c->g = carve(a, gu * 4);
    c->u = carve(a, gu * 4);
    c->rope = carve(a, T * (size_t)hp->n_rot * 4);
    if (hp->n_expert > 0) {
        c->eo = carve(a, T * U * D * 4);
        c->router = carve(a, T * X * 4);
        c->sel = carve(a, T * U * sizeof(int));
        c->selw = carve(a, T * U * 4);
        c->selrow = carve(a, T * U * sizeof(int));
        c->ecount = carve(a, X * sizeof(int));
        c->eoff = carve(a, X * sizeof(int));
        c->gath = carve(a, T * U * c->act_row);
        c->jobs = carve(a, 2 * X * sizeof(struct mm_job));
    }
    c->actbuf[0] = carve(a, T * U * c->act_row);
    c->actbuf[1] = carve(a, T * U * c->act_row);
    c->packbuf[0] = carve(a, c->pack_bytes);
    c->packbuf[1] = carve(a, c->pack_bytes);
    c->tscratch = carve(a, (size_t)c->n_threads * c->tscratch_n * 4);
    c->cursors = carve(a, (size_t)c->n_threads * sizeof(struct mm_cursor));
}

int model_ctx_new(struct model_ctx **out, struct model *m, int n_ctx, int kv_type,
                  struct pool *pool, char *err, size_t errlen)
{
    *out = NULL;
    const struct model_hp *hp = &m->hp;
    if (n_ctx <= 0 || n_ctx > (1 << 24))
        return strata_errf(err, errlen, "context size %d out of range", n_ctx);
    if (kv_type != KV_F16 && kv_type != KV_F32)
        return strata_errf(err, errlen, "unknown KV cache type %d", kv_type);
    struct model_ctx *c = calloc(1, sizeof *c);
    if (!c)
        return strata_errf(err, errlen, "out of memory");
    c->m = m;
    c->pool = pool;
    c->n_threads = pool_size(pool);
    c->n_ctx = n_ctx;
    c->kv_type = kv_type;
    c->kv_elt = kv_type == KV_F16 ? 2 : 4;
    c->t_max = n_ctx < MODEL_CHUNK ? n_ctx : MODEL_CHUNK;
    size_t width = (size_t)hp->n_embd;
    size_t HE = (size_t)hp->n_head * (size_t)hp->head_dim;
    if (HE > width) width = HE;
    if ((size_t)hp->n_ff > width) width = (size_t)hp->n_ff;
    if ((size_t)hp->n_ff_exp > width) width = (size_t)hp->n_ff_exp;
    /* F32 rows serve the float-reference mode and F32-weight matrices */
    c->act_row = m->max_act_row > width * 4 ? m->max_act_row : width * 4;
    /* per thread, for R = ATTN_QB x G (row, head) pairs: a double tail
     * (R, E), scores (R, C), queries (R, E), one K/V row (ES) and the lane
     * sums of two rows of up to 64 lanes (2, 64, ES), which first hold a block
     * of K rows (16, E); or a tile of dequantised weight rows (MM_ROWS,
     * width), or quant_gemm_packed's scratch */
    size_t R = (size_t)ATTN_QB * (size_t)(hp->n_head / hp->n_head_kv), E = (size_t)hp->head_dim;
    size_t ES = (E + 15) & ~(size_t)15;
    size_t attn = 2 * R * E + R * (size_t)n_ctx + R * E + ES + 2 * 64 * ES;
    size_t tile = (size_t)MM_ROWS * width, gemm = (m->max_gemm_scratch + 3) / 4;
    if (gemm > tile)
        tile = gemm;
    c->tscratch_n = ((attn > tile ? attn : tile) + 15) & ~(size_t)15;
    c->pack_bytes = (size_t)(c->t_max + 15) / 16 * m->max_pack16;
    struct arena a = {NULL, 0};
    ctx_layout(c, &a);
    a.base = calloc(1, a.used);
    if (!a.base) {
        free(c);
        return strata_errf(err, errlen, "out of memory for a context of %d cells (%zu MiB)",
                          n_ctx, a.used >> 20);
    }
    a.used = 0;
    ctx_layout(c, &a);
    c->arena = a.base;
    c->slot_type[0] = c->slot_type[1] = -1;
    *out = c;
    return 0;
}

void model_ctx_free(struct model_ctx *c)
{
    if (!c)
        return;
    free(c->arena);
    free(c);
}

void model_ctx_set_f32ref(struct model_ctx *c, int on)
{
    c->f32ref = on != 0;
    c->slot_type[0] = c->slot_type[1] = -1;
}

/* ==== running work on the pool ==== */

/* Runs fn(c, arg, r0, r1) over [0, n) split in contiguous ranges, on the
 * caller alone when the work is small. */
struct rows_job {
    struct model_ctx *c;
    void (*fn)(struct model_ctx *c, const void *arg, int r0, int r1, int ith);
    const void *arg;
    int n;
};

static void rows_worker(void *p, int ith, int nth)
{
    const struct rows_job *j = p;
    int r0 = (int)((int64_t)j->n * ith / nth), r1 = (int)((int64_t)j->n * (ith + 1) / nth);
    if (r0 < r1)
        j->fn(j->c, j->arg, r0, r1, ith);
}

static void rows_run(struct model_ctx *c, void (*fn)(struct model_ctx *, const void *, int, int, int),
                     const void *arg, int n, size_t elems_per_row)
{
    if (n <= 0)
        return;
    if (c->n_threads == 1 || n == 1 || (size_t)n * elems_per_row < MM_MIN_ELEMS) {
        fn(c, arg, 0, n, 0);
        return;
    }
    struct rows_job j = {c, fn, arg, n};
    pool_run(c->pool, rows_worker, &j);
}

/* ---- activation quantisation, cached per input and dot type ---- */

struct quant_arg {
    const float *x;
    int n, type;
    uint8_t *q;
    size_t lda;
};

static void quant_rows(struct model_ctx *c, const void *p, int r0, int r1, int ith)
{
    (void)c, (void)ith;
    const struct quant_arg *a = p;
    const struct quant_type *qt = quant_type(a->type);
    for (int r = r0; r < r1; r++)
        qt->from_f32(a->x + (size_t)r * a->n, a->q + (size_t)r * a->lda, a->n);
}

/* The matrices multiplied next read these T rows of n floats. */
static void act_begin(struct model_ctx *c, const float *x, int T, int n)
{
    c->act_x = x;
    c->act_T = T;
    c->act_n = n;
    c->slot_type[0] = c->slot_type[1] = -1;
}

/* The slot holding the current input in dot type dt (quantised once per
 * input and type). */
static int act_slot(struct model_ctx *c, int dt)
{
    for (int s = 0; s < 2; s++)
        if (c->slot_type[s] == dt)
            return s;
    int s = c->slot_next;
    c->slot_next ^= 1;
    struct quant_arg a = {c->act_x, c->act_n, dt, c->actbuf[s], quant_row_bytes(dt, c->act_n)};
    rows_run(c, quant_rows, &a, c->act_T, (size_t)c->act_n);
    c->slot_type[s] = dt;
    c->slot_lda[s] = a.lda;
    c->slot_packed[s] = 0;
    return s;
}

static const void *act_get(struct model_ctx *c, int dt, size_t *lda)
{
    if (dt == QT_F32 || c->f32ref) {
        *lda = (size_t)c->act_n * 4;
        return c->act_x;
    }
    int s = act_slot(c, dt);
    *lda = c->slot_lda[s];
    return c->actbuf[s];
}

struct pack_arg {
    int dt, s;
};

static void pack_rows(struct model_ctx *c, const void *p, int g0, int g1, int ith)
{
    (void)ith;
    const struct pack_arg *a = p;
    quant_pack(a->dt, c->act_n, c->actbuf[a->s], c->slot_lda[a->s], c->act_T, g0, g1, c->packbuf[a->s]);
}

/* The current input in dot type dt packed for quant_gemm_packed: once per
 * input and type, shared by every matrix that reads it (Q, K and V; gate and
 * up). */
static const void *act_packed(struct model_ctx *c, int dt)
{
    int s = act_slot(c, dt);
    if (!c->slot_packed[s]) {
        struct pack_arg a = {dt, s};
        rows_run(c, pack_rows, &a, (c->act_T + 15) / 16, (size_t)c->act_n * 16);
        c->slot_packed[s] = 1;
    }
    return c->packbuf[s];
}

/* ---- matrix products ---- */

struct mm_batch {
    struct model_ctx *c;
    const struct mm_job *jobs;
    int n_jobs;
    struct mm_cursor *cur;  /* (threads) */
};

static void mm_slice(struct model_ctx *c, const struct mm_job *j, int r0, int r1, int ith)
{
    if (j->pack) {
        void *scratch = c->tscratch + (size_t)ith * c->tscratch_n;
        quant_gemm_packed(j->type, j->n, j->w + (size_t)r0 * j->ldw, j->ldw, r1 - r0, j->pack, j->na,
                          j->y + r0, j->ldy, scratch);
        return;
    }
    if (!c->f32ref || j->type == QT_F32) {
        quant_gemm(j->type, j->n, j->w + (size_t)r0 * j->ldw, j->ldw, r1 - r0, j->a, j->lda, j->na,
                   j->y + r0, j->ldy);
        return;
    }
    /* float reference: dequantise a tile of rows, multiply F32 by F32 */
    const struct quant_type *qt = quant_type(j->type);
    float *tile = c->tscratch + (size_t)ith * c->tscratch_n;   /* (MM_ROWS, n) */
    for (int r = r0; r < r1; r += MM_ROWS) {
        int nr = r1 - r < MM_ROWS ? r1 - r : MM_ROWS;
        for (int i = 0; i < nr; i++)
            qt->to_f32(j->w + (size_t)(r + i) * j->ldw, tile + (size_t)i * j->n, j->n);
        quant_gemm(QT_F32, j->n, tile, (size_t)j->n * 4, nr, j->a, j->lda, j->na, j->y + r, j->ldy);
    }
}

/* Rows per unit: MM_ROWS with 16 or more activation rows, more with fewer
 * (256 for decode), so that a unit is always worth a call. */
static int mm_unit_rows(const struct mm_job *j)
{
    return MM_ROWS * (j->na >= 16 ? 1 : (16 + j->na - 1) / j->na);
}

static int mm_units(const struct mm_job *j)
{
    return j->na > 0 ? (j->rows + mm_unit_rows(j) - 1) / mm_unit_rows(j) : 0;
}

/* Runs unit u; (*i, *first) is a job at or before u's and its first unit. */
static void mm_unit(struct mm_batch *b, int u, int ith, int *i, int *first)
{
    if (u < *first)
        *i = *first = 0;
    while (u >= *first + mm_units(&b->jobs[*i])) {
        *first += mm_units(&b->jobs[*i]);
        ++*i;
    }
    const struct mm_job *j = &b->jobs[*i];
    int r0 = (u - *first) * mm_unit_rows(j), r1 = r0 + mm_unit_rows(j);
    mm_slice(b->c, j, r0, r1 < j->rows ? r1 : j->rows, ith);
}

static int mm_take(struct mm_cursor *cu)
{
    int u = atomic_fetch_add_explicit(&cu->next, 1, memory_order_relaxed);
    return u < cu->end ? u : -1;
}

static void mm_worker(void *p, int ith, int nth)
{
    struct mm_batch *b = p;
    int i = 0, first = 0, u;
    for (int k = 0; k < nth; k++) /* its own run first, then the others' */
        while ((u = mm_take(&b->cur[(ith + k) % nth])) >= 0)
            mm_unit(b, u, ith, &i, &first);
}

static void mm_run(struct model_ctx *c, const struct mm_job *jobs, int n_jobs)
{
    int nth = c->n_threads, units = 0, t = 1;
    int64_t total = 0, cum = 0;
    for (int i = 0; i < n_jobs; i++)
        total += (int64_t)mm_units(&jobs[i]) * jobs[i].na;
    if (total == 0)
        return;
    struct mm_batch b = {c, jobs, n_jobs, c->cursors};
    /* thread t's run starts at the unit where cost total * t / nth is reached */
    atomic_store_explicit(&b.cur[0].next, 0, memory_order_relaxed);
    for (int i = 0; i < n_jobs; i++) {
        int nu = mm_units(&jobs[i]);
        int64_t cj = jobs[i].na;
        for (; t < nth && total * t / nth < cum + nu * cj; t++) {
            int start = units + (int)((total * t / nth - cum + cj - 1) / cj);
            atomic_store_explicit(&b.cur[t].next, start, memory_order_relaxed);
            b.cur[t - 1].end = start;
        }
        cum += nu * cj;
        units += nu;
    }
    for (; t < nth; t++) {
        atomic_store_explicit(&b.cur[t].next, units, memory_order_relaxed);
        b.cur[t - 1].end = units;
    }
    b.cur[nth - 1].end = units;
    pool_run(c->pool, mm_worker, &b);
}

/* A job multiplying expert e of w by the current input (act_begin). */
static struct mm_job mm_job(struct model_ctx *c, const struct model_mat *w, int e, float *y, size_t ldy)
{
    struct mm_job j = {w->data + (size_t)e * w->stride, w->type, w->n, w->rows, w->ldw,
                       NULL, 0, c->act_T, y, ldy, NULL};
    int dt = quant_type(w->type)->dot_type;
    if (!c->f32ref && quant_gemm_tiled(w->type, w->n, c->act_T) &&
        quant_pack_bytes(dt, w->n, c->act_T) <= c->pack_bytes)
        j.pack = act_packed(c, dt);
    else
        j.a = act_get(c, dt, &j.lda);
    return j;
}

/* ==== the reference's summation orders and exp ====
 * The test models amplify the last bit of every value that is later rounded
 * to F16 (Q, K, V, probabilities), so the attention sums follow the exact
 * association of the reference's AVX-512 kernels. Two shapes occur: "lane"
 * sums with 16 accumulators (its tiled GEMM, used when a batch has two or
 * more tokens) and "row" dot products with 4x16 accumulators and a double
 * tail (its vector dot product, used for a single token). Each lane is an
 * independent FMA chain, so the SIMD paths and the portable loops below give
 * the same bits. */

/* The horizontal sum of 16 lanes in the order of GCC's _mm512_reduce_add_ps. */
static inline float red16(const float *a)
{
    float t[8], u[4];
    for (int i = 0; i < 8; i++)
        t[i] = a[i + 8] + a[i];
    for (int i = 0; i < 4; i++)
        u[i] = t[i + 4] + t[i];
    return (u[0] + u[2]) + (u[1] + u[3]);
}

/* Σ a·b as the tiled GEMM forms it (n a multiple of 16). */
static inline float dot_lanes(const float *a, const float *b, int n)
{
    float acc[16];
#if defined(__AVX512F__)
    __m512 v = _mm512_setzero_ps();
    for (int c = 0; c < n; c += 16)
        v = _mm512_fmadd_ps(_mm512_loadu_ps(a + c), _mm512_loadu_ps(b + c), v);
    _mm512_storeu_ps(acc, v);
#elif defined(__AVX2__) && defined(__FMA__)
    __m256 lo = _mm256_setzero_ps(), hi = _mm256_setzero_ps();
    for (int c = 0; c < n; c += 16) {
        lo = _mm256_fmadd_ps(_mm256_loadu_ps(a + c), _mm256_loadu_ps(b + c), lo);
        hi = _mm256_fmadd_ps(_mm256_loadu_ps(a + c + 8), _mm256_loadu_ps(b + c + 8), hi);
    }
    _mm256_storeu_ps(acc, lo);
    _mm256_storeu_ps(acc + 8, hi);
#else
    for (int l = 0; l < 16; l++)
        acc[l] = 0.0f;
    for (int c = 0; c < n; c += 16)
        for (int l = 0; l < 16; l++)
            acc[l] = fmaf(a[c + l], b[c + l], acc[l]);
#endif
    return red16(acc);
}

/* Σ a·b as the vector dot product forms it: 4x16 lanes over whole blocks of
 * 64, the lanes folded (0+2)+(1+3), then the tail added in double. */
static inline float dot_rows(const float *a, const float *b, int n)
{
    float f[16];
    int np = n & ~63;
#if defined(__AVX512F__)
    __m512 s0 = _mm512_setzero_ps(), s1 = s0, s2 = s0, s3 = s0;
    for (int i = 0; i < np; i += 64) {
        s0 = _mm512_fmadd_ps(_mm512_loadu_ps(a + i), _mm512_loadu_ps(b + i), s0);
        s1 = _mm512_fmadd_ps(_mm512_loadu_ps(a + i + 16), _mm512_loadu_ps(b + i + 16), s1);
        s2 = _mm512_fmadd_ps(_mm512_loadu_ps(a + i + 32), _mm512_loadu_ps(b + i + 32), s2);
        s3 = _mm512_fmadd_ps(_mm512_loadu_ps(a + i + 48), _mm512_loadu_ps(b + i + 48), s3);
    }
    _mm512_storeu_ps(f, _mm512_add_ps(_mm512_add_ps(s0, s2), _mm512_add_ps(s1, s3)));
#else
    float acc[4][16] = {{0}};
    for (int i = 0; i < np; i += 64)
        for (int j = 0; j < 4; j++)
            for (int l = 0; l < 16; l++)
                acc[j][l] = fmaf(a[i + 16 * j + l], b[i + 16 * j + l], acc[j][l]);
    for (int l = 0; l < 16; l++)
        f[l] = (acc[0][l] + acc[2][l]) + (acc[1][l] + acc[3][l]);
#endif
    double r = red16(f);
    for (int i = np; i < n; i++)
        r += (double)(a[i] * b[i]);
    return (float)r;
}

/* y[i] = fma(x[i], a, y[i]): lane-wise, so any vector width gives the same. */
static inline void fma_row(float *restrict y, const float *restrict x, float a, int n)
{
    int i = 0;
#if defined(__AVX512F__)
    __m512 va = _mm512_set1_ps(a);
    for (; i + 16 <= n; i += 16)
        _mm512_storeu_ps(y + i, _mm512_fmadd_ps(_mm512_loadu_ps(x + i), va, _mm512_loadu_ps(y + i)));
#elif defined(__AVX2__) && defined(__FMA__)
    __m256 va = _mm256_set1_ps(a);
    for (; i + 8 <= n; i += 8)
        _mm256_storeu_ps(y + i, _mm256_fmadd_ps(_mm256_loadu_ps(x + i), va, _mm256_loadu_ps(y + i)));
#endif
    for (; i < n; i++)
        y[i] = fmaf(x[i], a, y[i]);
}

/* expf as the reference's vector softmax and SiLU compute it: a degree-5
 * polynomial on the reduced argument, scaled by 2^n (max error ~1.5 ulp). */
static inline float exp_ref(float x)
{
    const float r = 0x1.8p23f;
    float z = fmaf(x, 0x1.715476p+0f, r);
    float n = z - r;
    float b = fmaf(-n, 0x1.7f7d1cp-20f, fmaf(-n, 0x1.62e4p-1f, x));
    float u = b * b;
    float j = fmaf(fmaf(fmaf(0x1.0e4020p-7f, b, 0x1.573e2ep-5f), u,
                        fmaf(0x1.555e66p-3f, b, 0x1.fffdb6p-2f)),
                   u, fmaf(0x1.ffffecp-1f, b, 1.0f));
    if (fabsf(n) > 192.0f)
        return n <= 0.0f ? 0.0f : INFINITY;
    if (n > -126.0f && n < 128.0f) {
        /* a normal result: scaling by the power of two is exact */
        uint32_t bits = (uint32_t)((int)n + 127) << 23;
        float p2;
        memcpy(&p2, &bits, 4);
        return j * p2;
    }
    return ldexpf(j, (int)n);
}

/* y[0..16) = exp_ref(x[0..16)), sixteen at once where AVX-512 exists (its
 * scalef performs the same exact scaling by 2^n, subnormals included). */
static inline void exp_ref16(const float *x, float *y)
{
#if defined(__AVX512F__)
    const __m512 r = _mm512_set1_ps(0x1.8p23f);
    __m512 v = _mm512_loadu_ps(x);
    __m512 z = _mm512_fmadd_ps(v, _mm512_set1_ps(0x1.715476p+0f), r);
    __m512 n = _mm512_sub_ps(z, r);
    __m512 b = _mm512_fnmadd_ps(n, _mm512_set1_ps(0x1.7f7d1cp-20f),
                                _mm512_fnmadd_ps(n, _mm512_set1_ps(0x1.62e4p-1f), v));
    __m512 u = _mm512_mul_ps(b, b);
    __m512 hi = _mm512_fmadd_ps(_mm512_fmadd_ps(_mm512_set1_ps(0x1.0e4020p-7f), b,
                                                _mm512_set1_ps(0x1.573e2ep-5f)),
                                u, _mm512_fmadd_ps(_mm512_set1_ps(0x1.555e66p-3f), b,
                                                   _mm512_set1_ps(0x1.fffdb6p-2f)));
    __m512 j = _mm512_fmadd_ps(hi, u, _mm512_fmadd_ps(_mm512_set1_ps(0x1.ffffecp-1f), b,
                                                       _mm512_set1_ps(1.0f)));
    __m512 res = _mm512_scalef_ps(j, n);
    __mmask16 big = _mm512_cmp_ps_mask(_mm512_abs_ps(n), _mm512_set1_ps(192.0f), _CMP_GT_OQ);
    if (big) {
        __mmask16 neg = _mm512_cmp_ps_mask(n, _mm512_setzero_ps(), _CMP_LE_OQ);
        __m512 alt = _mm512_mask_blend_ps(neg, _mm512_set1_ps(INFINITY), _mm512_setzero_ps());
        res = _mm512_mask_blend_ps(big, res, alt);
    }
    _mm512_storeu_ps(y, res);
#else
    for (int k = 0; k < 16; k++)
        y[k] = exp_ref(x[k]);
#endif
}

/* In place: x[0..n) ← softmax(x), as the reference's soft_max row: exps of
 * whole groups of 16 by exp_ref summed per group in float then in double,
 * the rest by expf; 1/sum applied as a float. n16 is where the groups end
 * (the reference's row is padded; entries past n are zero). */
static void softmax_ref(float *x, int n, int n16)
{
    float mx = -INFINITY;
    int j = 0;
#if defined(__AVX512F__)
    /* max_ps(x, m) is x > m ? x : m lane by lane, NaN included; the max of
     * the lanes is the max of the row */
    __m512 mv = _mm512_set1_ps(-INFINITY);
    for (; j + 16 <= n; j += 16)
        mv = _mm512_max_ps(_mm512_loadu_ps(x + j), mv);
    mx = _mm512_reduce_max_ps(mv);
#endif
    for (; j < n; j++)
        mx = x[j] > mx ? x[j] : mx;
    double sum = 0.0;
    j = 0;
    for (; j < n && j + 16 <= n16; j += 16) {
        /* cells past n are masked (-inf) in the reference: their exp is 0 */
        float d[16], e[16];
        for (int l = 0; l < 16; l++)
            d[l] = j + l < n ? x[j + l] - mx : -INFINITY;
        exp_ref16(d, e);
        for (int l = 0; l < 16 && j + l < n; l++)
            x[j + l] = e[l];
        sum += (double)red16(e);
    }
    for (; j < n; j++) {
        x[j] = expf(x[j] - mx);
        sum += (double)x[j];
    }
    float inv = (float)(1.0 / sum);
    for (j = 0; j < n; j++)
        x[j] *= inv;
}

/* ==== elementwise steps ==== */

/* RMSNorm with the reference's bit-level steps: squares in f32 summed in
 * double, mean rounded to f32, scale = 1/sqrtf(mean + eps), then two
 * separate f32 multiplications (the norm and the weight are two ops). */
static void rms_norm(float *y, const float *x, const float *w, int n, float eps)
{
    double sum = 0.0;
    for (int i = 0; i < n; i++)
        sum += (double)(x[i] * x[i]);
    float mean = (float)(sum / n);
    float scale = 1.0f / sqrtf(mean + eps);
    for (int i = 0; i < n; i++)
        y[i] = (x[i] * scale) * w[i];
}

/* rms_norm of count consecutive rows of n (y may be x). Eight rows at a time
 * interleave their sums: each is still one double add after another, as in
 * rms_norm, but eight chains of them run side by side. */
static void rms_norm_rows(float *y, const float *x, const float *w, int n, float eps, int count)
{
    int r = 0;
    for (; r + 8 <= count; r += 8) {
        const float *xr = x + (size_t)r * n;
        double sum[8] = {0};
        for (int i = 0; i < n; i++)
#pragma GCC unroll 8
            for (int k = 0; k < 8; k++)
                sum[k] += (double)(xr[(size_t)k * n + i] * xr[(size_t)k * n + i]);
        for (int k = 0; k < 8; k++) {
            float scale = 1.0f / sqrtf((float)(sum[k] / n) + eps);
            float *yk = y + (size_t)(r + k) * n;
            const float *xk = xr + (size_t)k * n;
            int i = 0;
#if defined(__AVX512F__)
            /* y may be x: the compiler would not vectorise this itself */
            for (; i + 16 <= n; i += 16)
                _mm512_storeu_ps(yk + i, _mm512_mul_ps(_mm512_mul_ps(_mm512_loadu_ps(xk + i), _mm512_set1_ps(scale)),
                                                       _mm512_loadu_ps(w + i)));
#endif
            for (; i < n; i++)
                yk[i] = (xk[i] * scale) * w[i];
        }
    }
    for (; r < count; r++)
        rms_norm(y + (size_t)r * n, x + (size_t)r * n, w, n, eps);
}

struct norm_arg {
    const float *x;
    float *y;
    const float *w;
};

static void norm_rows(struct model_ctx *c, const void *p, int r0, int r1, int ith)
{
    (void)ith;
    const struct norm_arg *a = p;
    int D = c->m->hp.n_embd;
    rms_norm_rows(a->y + (size_t)r0 * D, a->x + (size_t)r0 * D, a->w, D, c->m->hp.rms_eps, r1 - r0);
}

/* cos/sin for every rotated pair at every position of the chunk. ggml forms
 * θ step by step in f32 (θ₀ = p, θᵢ₊₁ = θᵢ·powf(base, −2/n_rot)) and divides
 * by the frequency factor before scaling; the same steps give the same bits. */
static void rope_rows(struct model_ctx *c, const void *p, int r0, int r1, int ith)
{
    (void)ith;
    const int *pos = p;
    const struct model *m = c->m;
    int nr = m->hp.n_rot;
    float theta_scale = powf(m->hp.rope_base, -2.0f / (float)nr);
    for (int t = r0; t < r1; t++) {
        float *cs = c->rope + (size_t)t * nr;
        float theta = (float)(*pos + t);
        for (int i = 0; i < nr / 2; i++) {
            float th = m->rope_freqs ? theta / m->rope_freqs[i] : theta;
            th = m->freq_scale * th;
            cs[2 * i] = cosf(th);
            cs[2 * i + 1] = sinf(th);
            theta *= theta_scale;
        }
    }
}

/* Rotates the first n_rot dims of each E-wide head of x (n_heads heads). */
static void rope_apply(const struct model_ctx *c, float *x, int n_heads, const float *cs)
{
    const struct model_hp *hp = &c->m->hp;
    int E = hp->head_dim, half = hp->n_rot / 2;
    for (int h = 0; h < n_heads; h++) {
        float *v = x + (size_t)h * E;
        for (int i = 0; i < half; i++) {
            int i0 = hp->rope_neox ? i : 2 * i, i1 = hp->rope_neox ? i + half : 2 * i + 1;
            float a = v[i0], b = v[i1], co = cs[2 * i], si = cs[2 * i + 1];
            /* the reference's compiler contracts a·c − b·s and a·s + b·c into
             * one fused multiply-add each, keeping the first product exact */
            v[i0] = fmaf(a, co, -(b * si));
            v[i1] = fmaf(a, si, b * co);
        }
    }
}

/* After the Q/K/V products: biases, per-head Q/K norms, RoPE. */
static void qkv_rows(struct model_ctx *c, const void *p, int r0, int r1, int ith)
{
    (void)ith;
    const struct model_layer *ly = p;
    const struct model_hp *hp = &c->m->hp;
    int E = hp->head_dim, H = hp->n_head, K = hp->n_head_kv;
    for (int t = r0; t < r1; t++) {
        float *q = c->q + (size_t)t * H * E, *k = c->k + (size_t)t * K * E, *v = c->v + (size_t)t * K * E;
        if (ly->bq)
            for (int i = 0; i < H * E; i++) q[i] += ly->bq[i];
        if (ly->bk)
            for (int i = 0; i < K * E; i++) k[i] += ly->bk[i];
        if (ly->bv)
            for (int i = 0; i < K * E; i++) v[i] += ly->bv[i];
        if (ly->q_norm) {
            rms_norm_rows(q, q, ly->q_norm, E, hp->rms_eps, H);
            rms_norm_rows(k, k, ly->k_norm, E, hp->rms_eps, K);
        }
        const float *cs = c->rope + (size_t)t * hp->n_rot;
        rope_apply(c, q, H, cs);
        rope_apply(c, k, K, cs);
    }
}

/* x += y (+ b): the block output joins the residual stream. */
struct resid_arg {
    float *x;
    const float *y, *b;
};

static void resid_rows(struct model_ctx *c, const void *p, int r0, int r1, int ith)
{
    (void)ith;
    const struct resid_arg *a = p;
    int D = c->m->hp.n_embd;
    for (int t = r0; t < r1; t++) {
        float *x = a->x + (size_t)t * D;
        const float *y = a->y + (size_t)t * D;
        int i = 0;
#if defined(__AVX512F__)
        for (; i + 16 <= D; i += 16) {
            __m512 v = _mm512_loadu_ps(y + i);
            if (a->b)
                v = _mm512_add_ps(v, _mm512_loadu_ps(a->b + i));
            _mm512_storeu_ps(x + i, _mm512_add_ps(v, _mm512_loadu_ps(x + i)));
        }
#endif
        if (a->b)
            for (; i < D; i++) x[i] = (y[i] + a->b[i]) + x[i];
        else
            for (; i < D; i++) x[i] = y[i] + x[i];
    }
}

/* g = silu(g) ⊙ u over rows of width n: whole groups of 16 with exp_ref
 * (the reference's vector SiLU), the rest with expf. */
static void swiglu_rows(struct model_ctx *c, const void *p, int r0, int r1, int ith)
{
    (void)ith;
    int n = *(const int *)p;
    for (int r = r0; r < r1; r++) {
        float *g = c->g + (size_t)r * n;
        const float *u = c->u + (size_t)r * n;
        int i = 0;
        for (; i < (n & ~15); i += 16) {
            float m[16], e[16];
#if defined(__AVX512F__)
            __m512 gv = _mm512_loadu_ps(g + i);
            _mm512_storeu_ps(m, _mm512_sub_ps(_mm512_setzero_ps(), gv));
            exp_ref16(m, e);
            __m512 den = _mm512_add_ps(_mm512_set1_ps(1.0f), _mm512_loadu_ps(e));
            _mm512_storeu_ps(g + i, _mm512_mul_ps(_mm512_div_ps(gv, den), _mm512_loadu_ps(u + i)));
#else
            for (int k = 0; k < 16; k++)
                m[k] = 0.0f - g[i + k];
            exp_ref16(m, e);
            for (int k = 0; k < 16; k++)
                g[i + k] = (g[i + k] / (1.0f + e[k])) * u[i + k];
#endif
        }
        for (; i < n; i++)
            g[i] = (g[i] / (1.0f + expf(-g[i]))) * u[i];
    }
}

/* ==== attention: contiguous KV cache, causal, GQA ==== */

static inline void f16_to_f32_row(const uint16_t *x, float *y, int n)
{
    int i = 0;
#if defined(__F16C__) && defined(__AVX2__)
    for (; i + 8 <= n; i += 8)
        _mm256_storeu_ps(y + i, _mm256_cvtph_ps(_mm_loadu_si128((const __m128i *)(x + i))));
#endif
    for (; i < n; i++)
        y[i] = quant_f16_to_f32(x[i]);
}

static inline void f32_to_f16_row(const float *x, uint16_t *y, int n)
{
    int i = 0;
#if defined(__F16C__) && defined(__AVX2__)
    for (; i + 8 <= n; i += 8)
        _mm_storeu_si128((__m128i *)(y + i),
                         _mm256_cvtps_ph(_mm256_loadu_ps(x + i), _MM_FROUND_TO_NEAREST_INT));
#endif
    for (; i < n; i++)
        y[i] = quant_f32_to_f16(x[i]);
}

/* y = x rounded to F16 and back (y may be x). */
static inline void round_f16_row(const float *x, float *y, int n)
{
    int i = 0;
#if defined(__F16C__) && defined(__AVX2__)
    for (; i + 8 <= n; i += 8)
        _mm256_storeu_ps(y + i, _mm256_cvtph_ps(_mm256_cvtps_ph(_mm256_loadu_ps(x + i),
                                                                 _MM_FROUND_TO_NEAREST_INT)));
#endif
    for (; i < n; i++)
        y[i] = quant_f16_to_f32(quant_f32_to_f16(x[i]));
}

/* out[e] (E) from the lane sums acc (n_acc, ES) of which the first nl were
 * written (ES = E rounded up to 16): 16 lanes are summed in red16's order; 64
 * lanes are first folded (l + l+32) + (l+16 + l+48), summed, and the double
 * tail (E, or NULL) added. Sixteen values of e at a time, each step
 * lane-wise, so the loops vectorise. */
static void fold_lanes(const float *acc, int nl, int n_acc, int E, const double *tail, float *out)
{
    static const float zero[16];
    size_t ES = (size_t)(E + 15) & ~(size_t)15;
#if defined(__AVX512F__)
    if (E % 16 == 0) {
        for (int e0 = 0; e0 < E; e0 += 16) {
            __m512 f[16], t[8], u[4];
#define LVEC(l) ((l) < nl ? _mm512_loadu_ps(acc + (size_t)(l) * ES + e0) : _mm512_setzero_ps())
#pragma GCC unroll 16
            for (int l = 0; l < 16; l++)
                f[l] = n_acc == 16 ? LVEC(l)
                                   : _mm512_add_ps(_mm512_add_ps(LVEC(l), LVEC(32 + l)),
                                                   _mm512_add_ps(LVEC(16 + l), LVEC(48 + l)));
#undef LVEC
#pragma GCC unroll 16
            for (int i = 0; i < 8; i++)
                t[i] = _mm512_add_ps(f[i + 8], f[i]);
#pragma GCC unroll 16
            for (int i = 0; i < 4; i++)
                u[i] = _mm512_add_ps(t[i + 4], t[i]);
            __m512 r = _mm512_add_ps(_mm512_add_ps(u[0], u[2]), _mm512_add_ps(u[1], u[3]));
            if (tail) {
                __m256 lo = _mm512_cvtpd_ps(_mm512_add_pd(_mm512_cvtps_pd(_mm512_castps512_ps256(r)),
                                                          _mm512_loadu_pd(tail + e0)));
                __m256 hi = _mm512_cvtpd_ps(_mm512_add_pd(_mm512_cvtps_pd(_mm512_extractf32x8_ps(r, 1)),
                                                          _mm512_loadu_pd(tail + e0 + 8)));
                r = _mm512_insertf32x8(_mm512_castps256_ps512(lo), hi, 1);
            }
            _mm512_storeu_ps(out + e0, r);
        }
        return;
    }
#endif
    for (int e0 = 0; e0 < E; e0 += 16) {
        float f[16][16], t[8][16], u[4][16], r[16];
#define LROW(l) ((l) < nl ? acc + (size_t)(l) * ES + e0 : zero)
        for (int l = 0; l < 16; l++) {
            const float *p0 = LROW(l);
            if (n_acc == 16) {
                for (int k = 0; k < 16; k++)
                    f[l][k] = p0[k];
            } else {
                const float *p1 = LROW(32 + l), *p2 = LROW(16 + l), *p3 = LROW(48 + l);
                for (int k = 0; k < 16; k++)
                    f[l][k] = (p0[k] + p1[k]) + (p2[k] + p3[k]);
            }
        }
#undef LROW
        for (int i = 0; i < 8; i++)
            for (int k = 0; k < 16; k++)
                t[i][k] = f[i + 8][k] + f[i][k];
        for (int i = 0; i < 4; i++)
            for (int k = 0; k < 16; k++)
                u[i][k] = t[i + 4][k] + t[i][k];
        for (int k = 0; k < 16; k++)
            r[k] = (u[0][k] + u[2][k]) + (u[1][k] + u[3][k]);
        for (int k = 0; k < 16 && e0 + k < E; k++)
            out[e0 + k] = tail ? (float)((double)r[k] + tail[e0 + k]) : r[k];
    }
}

#if defined(__AVX512F__)
/* Lane i = the sum of the 16 lanes of a[i], each in red16's order: the pairs
 * at distance 8, 4, 2, 1 are added as butterflies across the 16 vectors. */
static inline __m512 red16x16(const __m512 *a)
{
    __m512 t[8], u[4], v[2];
#pragma GCC unroll 16
    for (int k = 0; k < 8; k++) /* t[k]: a[2k] then a[2k+1], lanes l + (l+8) */
        t[k] = _mm512_add_ps(_mm512_shuffle_f32x4(a[2 * k], a[2 * k + 1], _MM_SHUFFLE(1, 0, 1, 0)),
                             _mm512_shuffle_f32x4(a[2 * k], a[2 * k + 1], _MM_SHUFFLE(3, 2, 3, 2)));
#pragma GCC unroll 16
    for (int k = 0; k < 4; k++) /* u[k]: quarter q holds vector 4k+q, its t_i + t_(i+4) */
        u[k] = _mm512_add_ps(_mm512_shuffle_f32x4(t[2 * k], t[2 * k + 1], _MM_SHUFFLE(2, 0, 2, 0)),
                             _mm512_shuffle_f32x4(t[2 * k], t[2 * k + 1], _MM_SHUFFLE(3, 1, 3, 1)));
#pragma GCC unroll 16
    for (int k = 0; k < 2; k++) /* v[k]: u0+u2, u1+u3 of vectors 8k+q and 8k+4+q */
        v[k] = _mm512_add_ps(_mm512_shuffle_ps(u[2 * k], u[2 * k + 1], _MM_SHUFFLE(1, 0, 1, 0)),
                             _mm512_shuffle_ps(u[2 * k], u[2 * k + 1], _MM_SHUFFLE(3, 2, 3, 2)));
    __m512 w = _mm512_add_ps(_mm512_shuffle_ps(v[0], v[1], _MM_SHUFFLE(2, 0, 2, 0)),
                             _mm512_shuffle_ps(v[0], v[1], _MM_SHUFFLE(3, 1, 3, 1)));
    /* lane 4q + e holds vector 4e + q */
    return _mm512_permutexvar_ps(_mm512_setr_epi32(0, 4, 8, 12, 1, 5, 9, 13, 2, 6, 10, 14, 3, 7, 11, 15), w);
}
#endif

/* s[l] = dot_lanes(row l of k, q) for the 16 rows of k (E floats apart). */
static void kq16_lanes(const float *k, const float *q, int E, float *s)
{
#if defined(__AVX512F__)
    __m512 acc[16];
#pragma GCC unroll 16
    for (int l = 0; l < 16; l++)
        acc[l] = _mm512_setzero_ps();
    for (int c = 0; c < E; c += 16) {
        __m512 qv = _mm512_loadu_ps(q + c);
#pragma GCC unroll 16
        for (int l = 0; l < 16; l++)
            acc[l] = _mm512_fmadd_ps(_mm512_loadu_ps(k + (size_t)l * E + c), qv, acc[l]);
    }
    _mm512_storeu_ps(s, red16x16(acc));
#else
    for (int l = 0; l < 16; l++)
        s[l] = dot_lanes(k + (size_t)l * E, q, E);
#endif
}

/* The lane sums of P·V for nr (1 or 2) rows that see the same cells: lane l
 * (< nl) of row k accumulates fma(v_j, p[k][j]) over the cells j = l,
 * l + n_acc, ... below jlim, in that order, into acc (nr, n_acc, ES). V rows
 * are cached rows of E elements (F16 or F32), row_bytes apart; row (E) is
 * scratch for the portable path. */
static void pv_lane_sums(const uint8_t *vc, size_t row_bytes, int f16, int E, const float *const *p,
                         int nr, int nl, int n_acc, int jlim, float *acc, size_t ES, float *row)
{
#if defined(__AVX512F__)
    if (E % 16 == 0) {
        /* up to 128 elements per pass: 2 x 8 accumulators in registers */
        for (int e0 = 0; e0 < E; e0 += 128) {
            int nc = (E - e0) / 16 < 8 ? (E - e0) / 16 : 8;
            for (int l = 0; l < nl; l++) {
                __m512 a0[8], a1[8];
                for (int c = 0; c < 8; c++)
                    a0[c] = a1[c] = _mm512_setzero_ps();
                for (int j = l; j < jlim; j += n_acc) {
                    const uint8_t *vr = vc + (size_t)j * row_bytes;
                    __m512 p0 = _mm512_set1_ps(p[0][j]), p1 = _mm512_set1_ps(p[nr - 1][j]);
#pragma GCC unroll 8
                    for (int c = 0; c < 8; c++) {
                        if (c >= nc)
                            break;
                        __m512 v = f16 ? _mm512_cvtph_ps(_mm256_loadu_si256((const __m256i *)vr + (e0 / 16 + c)))
                                       : _mm512_loadu_ps((const float *)vr + e0 + 16 * c);
                        a0[c] = _mm512_fmadd_ps(v, p0, a0[c]);
                        if (nr == 2)
                            a1[c] = _mm512_fmadd_ps(v, p1, a1[c]);
                    }
                }
                for (int c = 0; c < nc; c++) {
                    _mm512_storeu_ps(acc + (size_t)l * ES + e0 + 16 * c, a0[c]);
                    if (nr == 2)
                        _mm512_storeu_ps(acc + ((size_t)n_acc + l) * ES + e0 + 16 * c, a1[c]);
                }
            }
        }
        return;
    }
#endif
    for (int k = 0; k < nr; k++)
        for (int l = 0; l < nl; l++)
            memset(acc + ((size_t)k * n_acc + l) * ES, 0, ES * sizeof(float));
    for (int l = 0; l < nl; l++)
        for (int j = l; j < jlim; j += n_acc) {
            const uint8_t *vr = vc + (size_t)j * row_bytes;
            const float *vf = (const float *)vr;
            if (f16) {
                f16_to_f32_row((const uint16_t *)vr, row, E);
                vf = row;
            }
            for (int k = 0; k < nr; k++)
                fma_row(acc + ((size_t)k * n_acc + l) * ES, vf, p[k][j], E);
        }
}

#if defined(__AVX512F__)
/* out (E) = fold_lanes of the 16-lane sums of P·V for one row that sees the
 * cells below jlim, sixteen elements at a time with the lane sums in
 * registers: the same operations as pv_lane_sums then fold_lanes with
 * n_acc = 16, without the trip through memory (a lane that takes no cell
 * is a zero in both). */
static inline __attribute__((always_inline)) void
pv16_row_of(const uint8_t *vc, size_t row_bytes, int f16, int E, const float *pr, int jlim, float *out)
{
#define PV_LOAD(vr) (f16 ? _mm512_cvtph_ps(_mm256_loadu_si256((const __m256i *)(vr))) \
                         : _mm512_loadu_ps((const float *)(vr)))
    for (int e0 = 0; e0 < E; e0 += 16) {
        __m512 f[16], t[8], u[4];
#pragma GCC unroll 16
        for (int l = 0; l < 16; l++)
            f[l] = _mm512_setzero_ps();
        const uint8_t *vr = vc + (size_t)e0 * (f16 ? 2 : 4);
        int j = 0;
        for (; j + 16 <= jlim; j += 16)
#pragma GCC unroll 16
            for (int l = 0; l < 16; l++, vr += row_bytes)
                f[l] = _mm512_fmadd_ps(PV_LOAD(vr), _mm512_set1_ps(pr[j + l]), f[l]);
#pragma GCC unroll 16
        for (int l = 0; l < 16; l++, vr += row_bytes)
            if (j + l < jlim)
                f[l] = _mm512_fmadd_ps(PV_LOAD(vr), _mm512_set1_ps(pr[j + l]), f[l]);
#pragma GCC unroll 16
        for (int i = 0; i < 8; i++)
            t[i] = _mm512_add_ps(f[i + 8], f[i]);
#pragma GCC unroll 16
        for (int i = 0; i < 4; i++)
            u[i] = _mm512_add_ps(t[i + 4], t[i]);
        _mm512_storeu_ps(out + e0, _mm512_add_ps(_mm512_add_ps(u[0], u[2]), _mm512_add_ps(u[1], u[3])));
    }
#undef PV_LOAD
}

static void pv16_row(const uint8_t *vc, size_t row_bytes, int f16, int E, const float *pr, int jlim,
                     float *out)
{
    if (f16)
        pv16_row_of(vc, row_bytes, 1, E, pr, jlim, out);
    else
        pv16_row_of(vc, row_bytes, 0, E, pr, jlim, out);
}
#endif

struct attn_arg {
    struct model_ctx *c;
    int layer, T, pos, q0;
    atomic_int next;   /* tasks taken */
};

/* One task = one kv head and a block of up to ATTN_QB query rows: the G
 * query heads sharing the kv head and the rows of the block are done together,
 * so each cached K/V row is converted once per task. The reference's
 * non-flash path: Q rounded to F16 (F16 cache) for K·Q, scores scaled in F32,
 * softmax as softmax_ref over its padded row of cells, probabilities rounded
 * to F16 for P·V. Which summation order each product takes depends on the
 * batch size and the padded cell count, as in the reference. */
static void attn_worker(void *p, int ith, int nth)
{
    struct attn_arg *a = p;
    struct model_ctx *c = a->c;
    const struct model_hp *hp = &c->m->hp;
    int E = hp->head_dim, H = hp->n_head, K = hp->n_head_kv, G = H / K;
    int f16 = c->kv_type == KV_F16;
    size_t C = (size_t)c->n_ctx, row_bytes = (size_t)E * c->kv_elt;
    size_t ES = (size_t)(E + 15) & ~(size_t)15;  /* lane row stride */
    float kq_scale = 1.0f / sqrtf((float)E);
    /* the reference attends over cells padded to 256 (at most the cache) */
    int used = a->pos + a->T, nkv = (used + 255) & ~255;
    nkv = nkv < c->n_ctx ? nkv : c->n_ctx;
    int kq_lanes = f16 && a->T >= 2 && E % 16 == 0 && nkv % 4 == 0;
    int pv_lanes = a->T >= 2 && nkv % 16 == 0 && E % 4 == 0;
    int n_acc = pv_lanes ? 16 : 64, np = pv_lanes ? used : nkv & ~63;
    int qb = pv_lanes ? ATTN_QB : 1, nq = a->T - a->q0, nb = (nq + qb - 1) / qb;
    int R = qb * G;                                          /* (row, head) pairs */
    double *tail = (double *)(c->tscratch + (size_t)ith * c->tscratch_n); /* (R, E) */
    float *s = (float *)(tail + (size_t)R * E);              /* (R, C) scores */
    float *qf = s + (size_t)R * C;                           /* (R, E) */
    float *row = qf + (size_t)R * E;                         /* (E) */
    float *acc = row + ES; /* (2, n_acc, ES) lane sums of a row pair; before them (16, E) K rows */
    (void)nth;
    /* tasks taken in turn, the later blocks (more cells) first */
    for (int n; (n = atomic_fetch_add_explicit(&a->next, 1, memory_order_relaxed)) < nb * K;) {
        int task = nb * K - 1 - n;
        int t0 = a->q0 + (task / K) * qb, kh = task % K;
        int nt = a->T - t0 < qb ? a->T - t0 : qb, n_kv = a->pos + t0 + nt;
        const uint8_t *kc = c->k_cache + ((size_t)a->layer * K + kh) * C * row_bytes;
        const uint8_t *vc = c->v_cache + ((size_t)a->layer * K + kh) * C * row_bytes;
        for (int r = 0; r < nt * G; r++) {
            const float *q = c->q + (size_t)(t0 + r / G) * H * E + (size_t)(kh * G + r % G) * E;
            if (f16)
                round_f16_row(q, qf + (size_t)r * E, E);
            else
                memcpy(qf + (size_t)r * E, q, (size_t)E * 4);
        }
        if (kq_lanes) {
            /* blocks of 16 cells: 16 independent dot products per row */
            float *kb = acc, d[16]; /* (16, E) the block's K rows */
            for (int j0 = 0; j0 < n_kv; j0 += 16) {
                int nj = n_kv - j0 < 16 ? n_kv - j0 : 16;
                for (int jj = 0; jj < 16; jj++)
                    if (jj < nj)
                        f16_to_f32_row((const uint16_t *)(kc + (size_t)(j0 + jj) * row_bytes),
                                       kb + (size_t)jj * E, E);
                    else
                        memset(kb + (size_t)jj * E, 0, (size_t)E * sizeof(float));
                for (int r = (j0 > a->pos + t0 ? j0 - a->pos - t0 : 0) * G; r < nt * G; r++) {
                    int jend = a->pos + t0 + r / G + 1; /* causal: row t sees cells up to pos + t */
                    jend = jend < j0 + nj ? jend : j0 + nj;
                    kq16_lanes(kb, qf + (size_t)r * E, E, d);
                    for (int j = j0; j < jend; j++)
                        s[(size_t)r * C + j] = d[j - j0] * kq_scale;
                }
            }
        } else {
            for (int j = 0; j < n_kv; j++) {
                const uint8_t *kr = kc + (size_t)j * row_bytes;
                const float *kf = (const float *)kr;
                if (f16) {
                    f16_to_f32_row((const uint16_t *)kr, row, E);
                    kf = row;
                }
                for (int r = (j > a->pos + t0 ? j - a->pos - t0 : 0) * G; r < nt * G; r++)
                    s[(size_t)r * C + j] = dot_rows(kf, qf + (size_t)r * E, E) * kq_scale;
            }
        }
        for (int r = 0; r < nt * G; r++) {
            int nr = a->pos + t0 + r / G + 1;
            softmax_ref(s + (size_t)r * C, nr, nkv & ~15);
            if (f16)
                round_f16_row(s + (size_t)r * C, s + (size_t)r * C, nr);
        }
        /* out[e] = Σ_j p_j·v_j[e]: cell j feeds lane j mod n_acc (below np),
         * the rest is the double tail of the row-dot form. The rows of one
         * query (its G heads) see the same cells and go in pairs. */
        int nl = n_kv < np ? n_kv : np;
        nl = nl < n_acc ? nl : n_acc;
        int has_tail = n_kv > np;
#if defined(__AVX512F__)
        if (n_acc == 16 && E % 16 == 0 && !has_tail) {
            for (int r = 0; r < nt * G; r++) {
                int t = t0 + r / G, seen = a->pos + t + 1;
                pv16_row(vc, row_bytes, f16, E, s + (size_t)r * C, seen < np ? seen : np,
                         c->ao + (size_t)t * H * E + (size_t)(kh * G + r % G) * E);
            }
            continue;
        }
#endif
        for (int r = 0; r < nt * G;) {
            int t = t0 + r / G, nr = r + 1 < nt * G && (r + 1) / G == r / G ? 2 : 1;
            int seen = a->pos + t + 1; /* cells 0..seen-1 */
            const float *pr[2] = {s + (size_t)r * C, s + (size_t)(r + nr - 1) * C};
            pv_lane_sums(vc, row_bytes, f16, E, pr, nr, nl, n_acc, seen < np ? seen : np, acc, ES, row);
            for (int k = 0; k < nr; k++) {
                if (has_tail) {
                    memset(tail, 0, (size_t)E * sizeof(double));
                    for (int j = np; j < seen; j++) {
                        const uint8_t *vr = vc + (size_t)j * row_bytes;
                        const float *vf = (const float *)vr;
                        if (f16) {
                            f16_to_f32_row((const uint16_t *)vr, row, E);
                            vf = row;
                        }
                        for (int e = 0; e < E; e++)
                            tail[e] += (double)(vf[e] * pr[k][j]);
                    }
                }
                fold_lanes(acc + (size_t)k * n_acc * ES, nl, n_acc, E, has_tail ? tail : NULL,
                           c->ao + (size_t)t * H * E + (size_t)(kh * G + (r + k) % G) * E);
            }
            r += nr;
        }
    }
}

/* Stores rows r0..r1-1 of the chunk's K/V (T, K*E) in their cells; the
 * cache is head-major (layer, kv head, cell, E) so that attention reads
 * each head's cells as one contiguous stream. */
static void kv_rows(struct model_ctx *c, const void *p, int r0, int r1, int ith)
{
    (void)ith;
    const struct attn_arg *a = p;
    const struct model_hp *hp = &c->m->hp;
    int E = hp->head_dim, K = hp->n_head_kv;
    for (int t = r0; t < r1; t++)
        for (int h = 0; h < K; h++) {
            size_t off = ((((size_t)a->layer * K + h) * c->n_ctx) + (size_t)(a->pos + t)) * E * c->kv_elt;
            const float *k = c->k + ((size_t)t * K + h) * E, *v = c->v + ((size_t)t * K + h) * E;
            if (c->kv_type == KV_F16) {
                f32_to_f16_row(k, (uint16_t *)(c->k_cache + off), E);
                f32_to_f16_row(v, (uint16_t *)(c->v_cache + off), E);
            } else {
                memcpy(c->k_cache + off, k, (size_t)E * 4);
                memcpy(c->v_cache + off, v, (size_t)E * 4);
            }
        }
}

/* The attention of one layer for the chunk: stores its K/V rows (T, K*E) in
 * cells pos..pos+T-1, then for query rows q0..T-1 of c->q (T, H*E) writes
 * c->ao (T, H*E) from cells 0..pos+t. This is the one place that knows the
 * cache layout. */
static void attn_forward(struct model_ctx *c, int layer, int T, int pos, int q0)
{
    struct attn_arg arg = {c, layer, T, pos, q0, 0};
    const struct model_hp *hp = &c->m->hp;
    rows_run(c, kv_rows, &arg, T, (size_t)hp->n_head_kv * hp->head_dim);
    if (q0 < T)
        pool_run(c->pool, attn_worker, &arg);
}

/* ==== one forward pass over a chunk ==== */

/* c->xn (n, D) ← SwiGLU FFN of the normed rows c->xn. */
static void ffn_dense(struct model_ctx *c, const struct model_layer *ly, int n)
{
    const struct model_hp *hp = &c->m->hp;
    int F = hp->n_ff;
    act_begin(c, c->xn, n, hp->n_embd);
    struct mm_job jobs[2] = {mm_job(c, &ly->gate, 0, c->g, F), mm_job(c, &ly->up, 0, c->u, F)};
    mm_run(c, jobs, 2);
    rows_run(c, swiglu_rows, &F, n, (size_t)F);
    act_begin(c, c->g, n, F);
    struct mm_job down = mm_job(c, &ly->down, 0, c->xn, hp->n_embd);
    mm_run(c, &down, 1);
}

/* Router: softmax over the experts (the reference's soft_max row), top-U by
 * probability (ties to the lower id), weights renormalised over the chosen
 * ones (their sum in double, clamped below at 2^-14). */
static void route_rows(struct model_ctx *c, const void *p, int r0, int r1, int ith)
{
    (void)p, (void)ith;
    const struct model_hp *hp = &c->m->hp;
    int X = hp->n_expert, U = hp->n_expert_used;
    for (int t = r0; t < r1; t++) {
        float *pr = c->router + (size_t)t * X;
        softmax_ref(pr, X, X & ~15);
        int *sel = c->sel + (size_t)t * U;
        float *w = c->selw + (size_t)t * U;
        double wsum = 0.0;
        for (int k = 0; k < U; k++) {
            int best = -1;
            for (int e = 0; e < X; e++) {
                int taken = 0;
                for (int i = 0; i < k; i++)
                    taken |= sel[i] == e;
                if (!taken && (best < 0 || pr[e] > pr[best]))
                    best = e;
            }
            sel[k] = best;
            w[k] = pr[best];
            wsum += (double)w[k];
        }
        float ws = (float)wsum;
        if (ws < 6.103515625e-5f)
            ws = 6.103515625e-5f;
        for (int k = 0; k < U; k++)
            w[k] = w[k] / ws;
    }
}

/* out[t] = Σ_k w[t][k]·eo[row(t,k)] summed in the order chosen, then the
 * residual: the reference multiplies each expert's output by its weight and
 * adds the U results one after another. */
static void moe_sum_rows(struct model_ctx *c, const void *p, int r0, int r1, int ith)
{
    (void)ith;
    float *x0 = (float *)p;   /* (n, D) the residual rows */
    const struct model_hp *hp = &c->m->hp;
    int D = hp->n_embd, U = hp->n_expert_used;
    for (int t = r0; t < r1; t++) {
        float *x = x0 + (size_t)t * D;
        const int *rows = c->selrow + (size_t)t * U;
        const float *w = c->selw + (size_t)t * U;
        for (int i = 0; i < D; i++) {
            float acc = c->eo[(size_t)rows[0] * D + i] * w[0];
            for (int k = 1; k < U; k++)
                acc = acc + c->eo[(size_t)rows[k] * D + i] * w[k];
            x[i] = acc + x[i];
        }
    }
}

/* Copies each token's activation row (in the gate/up dot type) to the rows
 * of the experts it chose, so each expert multiplies one contiguous block. */
static const void *moe_gather(struct model_ctx *c, int n, int dt, size_t *lda)
{
    const struct model_hp *hp = &c->m->hp;
    int U = hp->n_expert_used;
    size_t rb;
    const uint8_t *src = act_get(c, dt, &rb);
    for (int t = 0; t < n; t++)
        for (int k = 0; k < U; k++)
            memcpy(c->gath + (size_t)c->selrow[(size_t)t * U + k] * rb, src + (size_t)t * rb, rb);
    *lda = rb;
    return c->gath;
}

/* Jobs multiplying each used expert of w by its gathered rows of a. */
static int moe_jobs(struct model_ctx *c, const struct model_mat *w, const uint8_t *a, size_t lda,
                    float *y, size_t ldy, struct mm_job *jobs)
{
    int nj = 0;
    for (int e = 0; e < c->m->hp.n_expert; e++) {
        if (!c->ecount[e])
            continue;
        struct mm_job j = {w->data + (size_t)e * w->stride, w->type, w->n, w->rows, w->ldw,
                           a + (size_t)c->eoff[e] * lda, lda, c->ecount[e],
                           y + (size_t)c->eoff[e] * ldy, ldy, NULL};
        jobs[nj++] = j;
    }
    return nj;
}

/* x (n, D) += MoE FFN of the normed rows c->xn. */
static void ffn_moe(struct model_ctx *c, const struct model_layer *ly, float *x, int n)
{
    const struct model_hp *hp = &c->m->hp;
    int D = hp->n_embd, X = hp->n_expert, U = hp->n_expert_used, Fe = hp->n_ff_exp;
    act_begin(c, c->xn, n, D);
    struct mm_job r = mm_job(c, &ly->gate_inp, 0, c->router, X);
    mm_run(c, &r, 1);
    rows_run(c, route_rows, NULL, n, (size_t)X * 8);

    /* group the (token, choice) pairs by expert: row selrow[t*U+k] */
    memset(c->ecount, 0, (size_t)X * sizeof(int));
    for (int i = 0; i < n * U; i++)
        c->ecount[c->sel[i]]++;
    for (int e = 0, off = 0; e < X; e++) {
        c->eoff[e] = off;
        off += c->ecount[e];
        c->ecount[e] = 0;
    }
    for (int i = 0; i < n * U; i++) {
        int e = c->sel[i];
        c->selrow[i] = c->eoff[e] + c->ecount[e]++;
    }

    /* gate and up of every chosen expert in one batch (two when their
     * activation types differ, as the gathered rows serve both) */
    int dtg = quant_type(ly->gate_exps.type)->dot_type, dtu = quant_type(ly->up_exps.type)->dot_type;
    size_t lda;
    const uint8_t *a = moe_gather(c, n, dtg, &lda);
    int nj = moe_jobs(c, &ly->gate_exps, a, lda, c->g, (size_t)Fe, c->jobs);
    if (dtu != dtg && !c->f32ref) {
        mm_run(c, c->jobs, nj);
        nj = 0;
        a = moe_gather(c, n, dtu, &lda);
    }
    nj += moe_jobs(c, &ly->up_exps, a, lda, c->u, (size_t)Fe, c->jobs + nj);
    mm_run(c, c->jobs, nj);
    rows_run(c, swiglu_rows, &Fe, n * U, (size_t)Fe);

    act_begin(c, c->g, n * U, Fe);
    a = act_get(c, quant_type(ly->down_exps.type)->dot_type, &lda);
    nj = moe_jobs(c, &ly->down_exps, a, lda, c->eo, (size_t)D, c->jobs);
    mm_run(c, c->jobs, nj);
    rows_run(c, moe_sum_rows, x, n, (size_t)D * U);
}

/* Token embeddings of the chunk into c->x (dequantised rows). */
static void embed_rows(struct model_ctx *c, const void *p, int r0, int r1, int ith)
{
    (void)ith;
    const int32_t *tokens = p;
    const struct model_mat *w = &c->m->tok_embd;
    const struct quant_type *qt = quant_type(w->type);
    for (int t = r0; t < r1; t++)
        qt->to_f32(w->data + (size_t)tokens[t] * w->ldw, c->x + (size_t)t * w->n, w->n);
}

/* One block over the chunk's T rows; the part after attention runs only for
 * rows r0..T-1 (the last layer computes just the rows whose logits are asked). */
static void layer_forward(struct model_ctx *c, int il, int T, int pos, int r0)
{
    const struct model_hp *hp = &c->m->hp;
    const struct model_layer *ly = &c->m->layers[il];
    int D = hp->n_embd, HE = hp->n_head * hp->head_dim, KE = hp->n_head_kv * hp->head_dim;

    struct norm_arg na = {c->x, c->xn, ly->attn_norm};
    rows_run(c, norm_rows, &na, T, (size_t)D);
    act_begin(c, c->xn, T, D);
    struct mm_job qkv[3] = {mm_job(c, &ly->wq, 0, c->q, HE), mm_job(c, &ly->wk, 0, c->k, KE),
                            mm_job(c, &ly->wv, 0, c->v, KE)};
    mm_run(c, qkv, 3);
    rows_run(c, qkv_rows, ly, T, (size_t)(HE + 2 * KE));
    attn_forward(c, il, T, pos, r0);
    int n = T - r0;
    if (n <= 0)
        return;

    float *x = c->x + (size_t)r0 * D;
    act_begin(c, c->ao + (size_t)r0 * HE, n, HE);
    struct mm_job wo = mm_job(c, &ly->wo, 0, c->xn, D);
    mm_run(c, &wo, 1);
    struct resid_arg ra = {x, c->xn, ly->bo};
    rows_run(c, resid_rows, &ra, n, (size_t)D);

    struct norm_arg nf = {x, c->xn, ly->ffn_norm};
    rows_run(c, norm_rows, &nf, n, (size_t)D);
    if (ly->moe) {
        ffn_moe(c, ly, x, n);
    } else {
        ffn_dense(c, ly, n);
        struct resid_arg rf = {x, c->xn, NULL};
        rows_run(c, resid_rows, &rf, n, (size_t)D);
    }
}

/* Runs tokens[0..T) at positions pos.. and writes the logits of rows
 * out0..T-1 to logits (rows of V); out0 = T asks for none. */
static void forward_chunk(struct model_ctx *c, const int32_t *tokens, int T, int pos, int out0,
                          float *logits)
{
    const struct model *m = c->m;
    const struct model_hp *hp = &m->hp;
    int D = hp->n_embd, V = hp->n_vocab;
    rows_run(c, embed_rows, tokens, T, (size_t)D);
    rows_run(c, rope_rows, &pos, T, (size_t)hp->n_rot * 8);
    for (int il = 0; il < hp->n_layer; il++)
        layer_forward(c, il, T, pos, il == hp->n_layer - 1 ? out0 : 0);
    int n = T - out0;
    if (n <= 0)
        return;
    struct norm_arg na = {c->x + (size_t)out0 * D, c->xn, m->output_norm};
    rows_run(c, norm_rows, &na, n, (size_t)D);
    act_begin(c, c->xn, n, D);
    struct mm_job head = mm_job(c, &m->output, 0, logits, (size_t)V);
    mm_run(c, &head, 1);
    if (m->output_b)
        for (int t = 0; t < n; t++)
            for (int i = 0; i < V; i++)
                logits[(size_t)t * V + i] += m->output_b[i];
}

int model_eval(struct model_ctx *c, const int32_t *tokens, int n, int pos, float *logits,
               int all_logits, char *err, size_t errlen)
{
    const struct model_hp *hp = &c->m->hp;
    if (n <= 0)
        return strata_errf(err, errlen, "nothing to evaluate (%d tokens)", n);
    if (pos < 0 || pos > c->n_past)
        return strata_errf(err, errlen, "position %d is past the %d cells in use", pos, c->n_past);
    if (n > c->n_ctx - pos)
        return strata_errf(err, errlen, "context full: %d tokens at position %d exceed %d cells",
                          n, pos, c->n_ctx);
    for (int i = 0; i < n; i++)
        if (tokens[i] < 0 || tokens[i] >= hp->n_vocab)
            return strata_errf(err, errlen, "token id %" PRId32 " out of range (vocabulary of %d)",
                              tokens[i], hp->n_vocab);
    c->n_past = pos;
    for (int done = 0; done < n;) {
        int T = n - done < c->t_max ? n - done : c->t_max;
        int last = done + T == n;
        int out0 = !logits ? T : all_logits ? 0 : last ? T - 1 : T;
        float *lg = logits && all_logits ? logits + (size_t)done * hp->n_vocab : logits;
        forward_chunk(c, tokens + done, T, pos + done, out0, lg);
        done += T;
        c->n_past = pos + done;
    }
    return 0;
}

/* ==== Public API: one sequence, one sampler ==== */

struct strata {
    struct model *m;
    struct model_ctx *c;
    struct pool *pool;
    struct sampler *smp;
    struct sample_params sp;  /* what smp was made with */
    float *logits;            /* (V) of the last token evaluated */
    int32_t *hist;            /* (C) the tokens of the sequence */
    int n_past, have_logits;
    char err[256];
};

struct strata *strata_open(const char *model_path, int n_ctx, int n_threads, char *err, size_t errlen)
{
    struct strata *s = calloc(1, sizeof *s);
    if (!s) {
        strata_errf(err, errlen, "out of memory");
        return NULL;
    }
    if (model_load(&s->m, model_path, err, errlen) != 0)
        goto fail;
    if (!s->m->tok) {
        strata_errf(err, errlen, "%s has no tokenizer", model_path);
        goto fail;
    }
    if (n_ctx <= 0)
        n_ctx = s->m->hp.n_ctx_train < 4096 ? s->m->hp.n_ctx_train : 4096;
    if (n_threads <= 0) {
        long nc = sysconf(_SC_NPROCESSORS_ONLN);
        n_threads = nc > 0 ? (int)nc : 1;
    }
    s->pool = pool_new(n_threads);
    s->logits = malloc((size_t)s->m->hp.n_vocab * sizeof(float));
    s->hist = malloc((size_t)n_ctx * sizeof(int32_t));
    if (!s->pool || !s->logits || !s->hist) {
        strata_errf(err, errlen, "out of memory");
        goto fail;
    }
    if (model_ctx_new(&s->c, s->m, n_ctx, KV_F16, s->pool, err, errlen) != 0)
        goto fail;
    return s;
fail:
    strata_free(s);
    return NULL;
}

int32_t *strata_tokenize(struct strata *s, const char *text, int *n)
{
    const struct tok *t = s->m->tok;
    return tok_encode(t, text, strlen(text), 1, 1, n, s->err, sizeof s->err);
}

const float *strata_eval(struct strata *s, const int32_t *tokens, int n)
{
    if (model_eval(s->c, tokens, n, s->n_past, s->logits, 0, s->err, sizeof s->err) != 0)
        return NULL;
    for (int i = 0; i < n; i++) {
        s->hist[s->n_past + i] = tokens[i];
        if (s->smp)
            sample_accept(s->smp, tokens[i]);
    }
    s->n_past += n;
    s->have_logits = 1;
    return s->logits;
}

static int same_params(const struct sample_params *a, const struct sample_params *b)
{
    return a->temp == b->temp && a->top_k == b->top_k && a->top_p == b->top_p &&
           a->min_p == b->min_p && a->repeat_penalty == b->repeat_penalty &&
           a->presence_penalty == b->presence_penalty &&
           a->frequency_penalty == b->frequency_penalty && a->repeat_last_n == b->repeat_last_n &&
           a->seed == b->seed;
}

int32_t strata_sample(struct strata *s, const struct sample_params *p)
{
    if (!s->have_logits) {
        snprintf(s->err, sizeof s->err, "strata_sample: nothing evaluated yet");
        return -1;
    }
    if (!s->smp || !same_params(&s->sp, p)) {
        /* a new sampler sees the sequence so far as its penalty history */
        if (s->smp)
            sample_free(s->smp);
        s->smp = sample_new(p, s->m->hp.n_vocab);
        if (!s->smp) {
            snprintf(s->err, sizeof s->err, "out of memory");
            return -1;
        }
        s->sp = *p;
        for (int i = 0; i < s->n_past; i++)
            sample_accept(s->smp, s->hist[i]);
    }
    return sample_next(s->smp, s->logits);
}

const char *strata_error(const struct strata *s)
{
    return s->err;
}

void strata_free(struct strata *s)
{
    if (!s)
        return;
    if (s->smp)
        sample_free(s->smp);
    model_ctx_free(s->c);
    pool_free(s->pool);
    model_free(s->m);
    free(s->logits);
    free(s->hist);
    free(s);
}
