/*
 * model.c — architectures (hyper-parameters, tensor binding), contexts and
 * the forward pass: llama, qwen2, qwen3 and qwen3moe as ARCH.md §3.0-3.4
 * state them, with the reference engine's numerics (ARCH.md §0). At the end,
 * the small public wrapper strata_* bundles model, tokenizer and sampler.
 *
 * Weights stay in the GGUF mapping and are read through quant.c; 1-D tensors
 * (norms, biases) that are not F32 are converted once at load. A context
 * owns a kv.c pool of sequences and, on the CPU, allocates everything it
 * needs in model_ctx_new: evaluation never allocates. Matrix products are
 * split over the pool by weight rows, so decode streams each matrix once at
 * memory bandwidth; with a prompt, each input is quantised and packed for
 * quant_gemm_packed once and read by every matrix that takes it (Q, K, V;
 * gate, up). Each layer writes its K/V rows into the pages (kv_store) and
 * attends through attn.c: the online-softmax prompt kernel for a chunk, the
 * split-KV decode kernel for a few queries. On the GPU (gpu.cu) this file
 * keeps the sequences' bookkeeping and hands each chunk to gpu_eval.
 *
 * The chunked prompt path (issue 4 calls it prefill.c) stays here: a prompt
 * chunk, one decode step and a decode batch are one forward over rows
 * (forward, struct pass) sharing the layer code, the matrix scheduling and
 * the scratch buffers; a separate file would need all of them exported
 * through an internal header.
 *
 * Must not: know cell formats or page layouts (kv.c), do attention
 * arithmetic (attn.c), print. Shapes: T rows of a pass, D model width,
 * H query heads, K kv heads, E head dim, F feed-forward width, X experts,
 * U experts used, V vocab, C cells.
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

#define MM_ROWS 16        /* weight rows per work unit (prompts; decode takes more) */
#define MM_MIN_ELEMS 8192 /* element count below which a row loop stays on the caller */
#define MODEL_WINDOW 16   /* queries up to which attention takes attn_decode (split KV) */

/* ==== the model: weights bound to tensors of the mapping ==== */

struct model {
    struct gguf g;
    struct model_hp hp;
    struct tok *tok;              /* NULL when the file has no tokenizer */
    struct model_weights w;       /* w.layers is layers, read-only */
    struct model_layer *layers;   /* (n_layer) */
    float *vecs;                  /* F32 copies of the non-F32 1-D tensors */
    size_t vecs_used, vecs_cap;   /* floats */
    size_t max_act_row;           /* bytes of the widest activation row in any dot type */
    size_t max_pack16;            /* bytes of the largest packed input of 16 tokens */
    size_t max_gemm_scratch;      /* bytes of the largest quant_gemm_packed scratch */
    struct gpu_model *gpu;        /* the weights on the device, made by the first GPU context */
    int gpu_refused;              /* the device could not take them: --device auto runs on the CPU */
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
    m->w.freq_scale = 1.0f;
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
        m->w.freq_scale = 1.0f / factor;
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
    if (ld_mat(&L, &m->w.tok_embd, "token_embd.weight", D, V, 0, 1))
        goto fail;
    int r = ld_mat(&L, &m->w.output, "output.weight", D, V, 0, 0);
    if (r < 0)
        goto fail;
    if (r == 1)
        m->w.output = m->w.tok_embd;   /* tied LM head */
    note_act(m, &m->w.output, (int)D);
    if (ld_vec(&L, &m->w.output_norm, "output_norm.weight", D, 1) ||
        ld_vec(&L, &m->w.output_b, "output.bias", V, 0) ||
        ld_vec(&L, &m->w.rope_freqs, "rope_freqs.weight", hp->n_rot / 2, 0))
        goto fail;

    m->layers = calloc((size_t)hp->n_layer, sizeof *m->layers);
    m->w.layers = m->layers;
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
    if (m->gpu)
        gpu_model_free(m->gpu);
    free(m->layers);
    free(m->vecs);
    gguf_close(&m->g);
    free(m);
}

const struct model_hp *model_hp(const struct model *m) { return &m->hp; }

void model_weights(const struct model *m, struct model_weights *w)
{
    *w = m->w;
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
    size_t n = mat_bytes(&m->w.output) + m->w.tok_embd.ldw;
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

#define CTX_BATCH_ROWS 16 /* model_ctx_batch_logits's rows on the CPU at most (the GPU's: 16) */

struct model_ctx {
    struct model *m;
    struct pool *pool;
    int n_threads;
    int f32ref;
    int n_split;                  /* decode attention partitions (0: attn_split's choice) */
    int device;                   /* MODEL_DEV_CPU or MODEL_DEV_GPU */
    int t_max;                    /* tokens per chunk (rows of every buffer) */
    int reused;                   /* cells the last model_eval shared from the prefix cache */
    atomic_int fail;              /* a kv_store of this pass failed */
    struct kv *kv;                /* the sequences' cells */
    struct attn *attn;            /* CPU attention scratch */
    struct gpu_ctx *gpu;          /* the device's buffers (MODEL_DEV_GPU) */
    char kv_err[160];             /* the failed kv_store's message */
    void *arena;                  /* the one allocation every buffer below lives in */
    int *rpos;                    /* (T) position of each row */
    int *rseq;                    /* (T) sequence of each row */
    float *lrow;                  /* (1 + batch_rows, V) on the CPU: model_ctx_logits's
                                     row, then model_ctx_batch_logits's */
    int batch_rows;               /* on the CPU: the sequences, at most CTX_BATCH_ROWS */
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
    c->rpos = carve(a, T * sizeof(int));
    c->rseq = carve(a, T * sizeof(int));
    c->lrow = carve(a, (1 + (size_t)c->batch_rows) * hp->n_vocab * 4);
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

struct model_opts model_opts_default(void)
{
    struct model_opts o = {0};
    o.kv_cell = KV_CELL_F16;
    o.n_seq = 1;
    o.device = MODEL_DEV_AUTO;
    return o;
}

int model_device_parse(const char *name)
{
    static const struct { const char *name; int dev; } names[] = {
        {"auto", MODEL_DEV_AUTO}, {"cpu", MODEL_DEV_CPU}, {"gpu", MODEL_DEV_GPU},
        {"cuda", MODEL_DEV_GPU}, {"hip", MODEL_DEV_GPU},
    };
    for (size_t i = 0; name && i < sizeof names / sizeof names[0]; i++)
        if (strcmp(name, names[i].name) == 0)
            return names[i].dev;
    return -1;
}

/* The device a context runs on, and on the GPU the model's weights there
 * (uploaded by the first GPU context, shared by the later ones). */
static int ctx_device(struct model_ctx *c, const struct model_opts *o, char *err, size_t errlen)
{
    if (o->device != MODEL_DEV_AUTO && o->device != MODEL_DEV_CPU && o->device != MODEL_DEV_GPU)
        return strata_errf(err, errlen, "unknown device %d", o->device);
    c->device = o->device;
    if (c->device == MODEL_DEV_AUTO)
        c->device = !o->f32ref && !c->m->gpu_refused && gpu_devices(NULL, 0) > 0 ? MODEL_DEV_GPU : MODEL_DEV_CPU;
    if (c->device == MODEL_DEV_CPU)
        return 0;
    if (o->f32ref)
        return strata_errf(err, errlen, "the float-reference mode runs on the CPU only (use the CPU device)");
    if (!c->m->gpu && gpu_model_new(&c->m->gpu, c->m, err, errlen) != 0) {
        if (o->device != MODEL_DEV_AUTO)
            return -1;
        /* auto: a model the device cannot take (a format it lacks, too
         * little memory) runs on the CPU, said once */
        fprintf(stderr, "strata: not on the GPU: %s; running on the CPU\n", err);
        c->m->gpu_refused = 1, c->device = MODEL_DEV_CPU;
    }
    return 0;
}

/* The CPU buffers: sized from the model's widest rows, one allocation. */
static int ctx_buffers(struct model_ctx *c, char *err, size_t errlen)
{
    const struct model *m = c->m;
    const struct model_hp *hp = &m->hp;
    size_t width = (size_t)hp->n_embd;
    size_t HE = (size_t)hp->n_head * (size_t)hp->head_dim;
    if (HE > width) width = HE;
    if ((size_t)hp->n_ff > width) width = (size_t)hp->n_ff;
    if ((size_t)hp->n_ff_exp > width) width = (size_t)hp->n_ff_exp;
    /* F32 rows serve the float-reference mode and F32-weight matrices */
    c->act_row = m->max_act_row > width * 4 ? m->max_act_row : width * 4;
    /* per thread: a tile of dequantised weight rows (MM_ROWS, width), or
     * quant_gemm_packed's scratch */
    size_t tile = (size_t)MM_ROWS * width, gemm = (m->max_gemm_scratch + 3) / 4;
    c->tscratch_n = ((tile > gemm ? tile : gemm) + 15) & ~(size_t)15;
    c->pack_bytes = (size_t)(c->t_max + 15) / 16 * m->max_pack16;
    int n_seq = kv_cfg(c->kv)->n_seq;
    c->batch_rows = n_seq < CTX_BATCH_ROWS ? n_seq : CTX_BATCH_ROWS;
    struct arena a = {NULL, 0};
    ctx_layout(c, &a);
    a.base = calloc(1, a.used);
    if (!a.base)
        return strata_errf(err, errlen, "out of memory for buffers of %d-token chunks (%zu MiB)", c->t_max,
                           a.used >> 20);
    a.used = 0;
    ctx_layout(c, &a);
    c->arena = a.base;
    c->slot_type[0] = c->slot_type[1] = -1;
    return attn_new(&c->attn, hp->n_head, hp->n_head_kv, hp->head_dim, MODEL_WINDOW, c->n_threads, err,
                    errlen);
}

int model_ctx_new(struct model_ctx **out, struct model *m, const struct model_opts *o,
                  struct pool *pool, char *err, size_t errlen)
{
    *out = NULL;
    const struct model_hp *hp = &m->hp;
    if (o->n_ctx > (1 << 24) || (o->n_ctx <= 0 && o->kv_mem_mib <= 0))
        return strata_errf(err, errlen, "context size %d out of range", o->n_ctx);
    if (o->prefill_chunk < 0 || o->prefill_chunk > (1 << 16))
        return strata_errf(err, errlen, "prefill chunk of %d tokens out of range", o->prefill_chunk);
    if (o->attn_split < 0 || o->attn_split > ATTN_MAX_SPLIT)
        return strata_errf(err, errlen, "attention split %d out of range [0, %d]", o->attn_split,
                           ATTN_MAX_SPLIT);
    struct model_ctx *c = calloc(1, sizeof *c);
    if (!c)
        return strata_errf(err, errlen, "out of memory");
    c->m = m;
    c->pool = pool;
    c->n_threads = pool_size(pool);
    c->f32ref = o->f32ref != 0;
    c->n_split = o->attn_split;
    if (ctx_device(c, o, err, errlen) != 0)
        goto fail;
    struct kv_config kc = {hp->n_layer, hp->n_head_kv, hp->head_dim, o->kv_cell, 0,
                           o->n_seq > 0 ? o->n_seq : 1, o->n_ctx, o->kv_mem_mib, NULL};
    if (c->device == MODEL_DEV_GPU)
        kc.mem = gpu_kv_mem(c->m->gpu);
    if (kv_new(&c->kv, &kc, err, errlen) != 0 || kv_seq_new(c->kv, err, errlen) != 0)
        goto fail;
    int n_ctx = kv_cfg(c->kv)->n_ctx, chunk = o->prefill_chunk > 0             ? o->prefill_chunk
                                              : c->device == MODEL_DEV_GPU ? MODEL_CHUNK_GPU
                                                                           : MODEL_CHUNK;
    c->t_max = n_ctx < chunk ? n_ctx : chunk;
    if (c->device == MODEL_DEV_GPU ? gpu_ctx_new(&c->gpu, m->gpu, c->kv, c->t_max, err, errlen)
                                   : ctx_buffers(c, err, errlen))
        goto fail;
    *out = c;
    return 0;
fail:
    model_ctx_free(c);
    return -1;
}

void model_ctx_free(struct model_ctx *c)
{
    if (!c)
        return;
    if (c->gpu)
        gpu_ctx_free(c->gpu);
    attn_free(c->attn);
    kv_free(c->kv);
    free(c->arena);
    free(c);
}

int model_ctx_device(const struct model_ctx *c) { return c->device; }
int model_ctx_chunk(const struct model_ctx *c) { return c->t_max; }
float *model_ctx_logits(struct model_ctx *c) { return c->gpu ? gpu_ctx_logits(c->gpu, NULL) : c->lrow; }

float *model_ctx_batch_logits(struct model_ctx *c, int *rows)
{
    if (c->gpu)
        return gpu_ctx_logits(c->gpu, rows) + c->m->hp.n_vocab;
    *rows = c->batch_rows;
    return c->lrow + c->m->hp.n_vocab;
}
struct kv *model_kv(struct model_ctx *c) { return c->kv; }
int model_last_reused(const struct model_ctx *c) { return c->reused; }

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

/* ==== the reference's softmax and exp ====
 * The router's softmax and SiLU follow the reference's vector kernels bit
 * for bit (the test models amplify the last bit of their inputs). */

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

/* cos/sin for every rotated pair at every row's position. ggml forms
 * θ step by step in f32 (θ₀ = p, θᵢ₊₁ = θᵢ·powf(base, −2/n_rot)) and divides
 * by the frequency factor before scaling; the same steps give the same bits. */
static void rope_rows(struct model_ctx *c, const void *p, int r0, int r1, int ith)
{
    (void)p, (void)ith;
    const struct model *m = c->m;
    int nr = m->hp.n_rot;
    float theta_scale = powf(m->hp.rope_base, -2.0f / (float)nr);
    for (int t = r0; t < r1; t++) {
        float *cs = c->rope + (size_t)t * nr;
        float theta = (float)c->rpos[t];
        for (int i = 0; i < nr / 2; i++) {
            float th = m->w.rope_freqs ? theta / m->w.rope_freqs[i] : theta;
            th = m->w.freq_scale * th;
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
    const struct model_mat *w = &c->m->w.tok_embd;
    const struct quant_type *qt = quant_type(w->type);
    for (int t = r0; t < r1; t++)
        qt->to_f32(w->data + (size_t)tokens[t] * w->ldw, c->x + (size_t)t * w->n, w->n);
}

/* ==== attention over the KV pages ==== */

/* A forward pass over T rows: T consecutive tokens of sequence seq from
 * position pos (a prompt chunk or one decode step), or, with seq < 0, one
 * token of each sequence c->rseq[t] at c->rpos[t] (a decode batch). The
 * logits of rows out0..T-1 are computed (out0 = T: none). */
struct pass {
    int T, seq, pos, out0;
};

/* Writes rows r0..r1-1 of the pass's K/V (T, K*E) into their cells. */
static void store_rows(struct model_ctx *c, const void *p, int r0, int r1, int ith)
{
    (void)ith;
    const int *layer = p;
    size_t KE = (size_t)c->m->hp.n_head_kv * (size_t)c->m->hp.head_dim;
    char err[sizeof c->kv_err];
    /* consecutive rows of one sequence go in one call */
    for (int t = r0; t < r1;) {
        int n = 1;
        while (t + n < r1 && c->rseq[t + n] == c->rseq[t] && c->rpos[t + n] == c->rpos[t] + n)
            n++;
        if (kv_store(c->kv, c->rseq[t], *layer, c->rpos[t], n, c->k + t * KE, c->v + t * KE, err,
                     sizeof err) != 0 && !atomic_exchange(&c->fail, 1))
            memcpy(c->kv_err, err, sizeof err);
        t += n;
    }
}

/* Layer il's attention: the pass's K/V rows into the pages, then c->ao
 * (T, H*E) for query rows r0..T-1 of c->q (T, H*E). A run of up to
 * MODEL_WINDOW queries of one sequence takes the split-KV decode kernel,
 * a longer one the prompt kernel. With F16 cells both keep the reference
 * engine's rounding points (Q and the probabilities rounded to F16). */
static int attn_layer(struct model_ctx *c, const struct pass *ps, int il, int r0, char *err, size_t errlen)
{
    const struct model_hp *hp = &c->m->hp;
    size_t HE = (size_t)hp->n_head * (size_t)hp->head_dim;
    rows_run(c, store_rows, &il, ps->T, (size_t)hp->n_head_kv * (size_t)hp->head_dim * 4);
    if (atomic_load(&c->fail))
        return strata_errf(err, errlen, "%s", c->kv_err);
    struct attn_job j = {c->kv, ps->seq, il, c->q + (size_t)r0 * HE, c->ao + (size_t)r0 * HE, ps->T - r0,
                         ps->pos + r0, 0.0f, kv_cfg(c->kv)->cell == KV_CELL_F16 ? ATTN_F16_REF : 0,
                         c->n_split, NULL, NULL};
    if (j.T <= 0)
        return 0;
    if (ps->seq >= 0)
        return j.T <= MODEL_WINDOW ? attn_decode(c->attn, c->pool, &j, err, errlen)
                                   : attn_prompt(c->attn, c->pool, &j, err, errlen);
    for (int t = r0; t < ps->T; t++) {
        j.seq = c->rseq[t];
        j.q = c->q + (size_t)t * HE;
        j.out = c->ao + (size_t)t * HE;
        j.T = 1;
        j.pos0 = c->rpos[t];
        if (attn_decode(c->attn, c->pool, &j, err, errlen) != 0)
            return -1;
    }
    return 0;
}

/* ==== one forward pass ==== */

/* One block over the pass's T rows; the part after attention runs only for
 * rows r0..T-1 (the last layer computes just the rows whose logits are asked). */
static int layer_forward(struct model_ctx *c, const struct pass *ps, int il, int r0, char *err, size_t errlen)
{
    const struct model_hp *hp = &c->m->hp;
    const struct model_layer *ly = &c->m->layers[il];
    int T = ps->T, D = hp->n_embd, HE = hp->n_head * hp->head_dim, KE = hp->n_head_kv * hp->head_dim;

    struct norm_arg na = {c->x, c->xn, ly->attn_norm};
    rows_run(c, norm_rows, &na, T, (size_t)D);
    act_begin(c, c->xn, T, D);
    struct mm_job qkv[3] = {mm_job(c, &ly->wq, 0, c->q, HE), mm_job(c, &ly->wk, 0, c->k, KE),
                            mm_job(c, &ly->wv, 0, c->v, KE)};
    mm_run(c, qkv, 3);
    rows_run(c, qkv_rows, ly, T, (size_t)(HE + 2 * KE));
    if (attn_layer(c, ps, il, r0, err, errlen) != 0)
        return -1;
    int n = T - r0;
    if (n <= 0)
        return 0;

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
    return 0;
}

/* Runs the pass over tokens[0..T) (c->rseq, c->rpos filled) and writes the
 * logits of rows out0..T-1 to logits (rows of V). */
static int forward(struct model_ctx *c, const struct pass *ps, const int32_t *tokens, float *logits,
                   char *err, size_t errlen)
{
    const struct model *m = c->m;
    const struct model_hp *hp = &m->hp;
    int T = ps->T, D = hp->n_embd, V = hp->n_vocab;
    atomic_store(&c->fail, 0);
    rows_run(c, embed_rows, tokens, T, (size_t)D);
    rows_run(c, rope_rows, NULL, T, (size_t)hp->n_rot * 8);
    for (int il = 0; il < hp->n_layer; il++)
        if (layer_forward(c, ps, il, il == hp->n_layer - 1 ? ps->out0 : 0, err, errlen) != 0)
            return -1;
    int n = T - ps->out0;
    if (n <= 0)
        return 0;
    struct norm_arg na = {c->x + (size_t)ps->out0 * D, c->xn, m->w.output_norm};
    rows_run(c, norm_rows, &na, n, (size_t)D);
    act_begin(c, c->xn, n, D);
    struct mm_job head = mm_job(c, &m->w.output, 0, logits, (size_t)V);
    mm_run(c, &head, 1);
    if (m->w.output_b)
        for (int t = 0; t < n; t++)
            for (int i = 0; i < V; i++)
                logits[(size_t)t * V + i] += m->w.output_b[i];
    return 0;
}

static int check_tokens(const struct model_ctx *c, const int32_t *tokens, int n, char *err, size_t errlen)
{
    for (int i = 0; i < n; i++)
        if (tokens[i] < 0 || tokens[i] >= c->m->hp.n_vocab)
            return strata_errf(err, errlen, "token id %" PRId32 " out of range (vocabulary of %d)", tokens[i],
                               c->m->hp.n_vocab);
    return 0;
}

/* One chunk of model_eval: its cells are the sequence's last. */
static int eval_chunk(struct model_ctx *c, int seq, const int32_t *tokens, int T, int pos, float *logits,
                      int all_logits, char *err, size_t errlen)
{
    if (c->device == MODEL_DEV_GPU)
        return gpu_eval(c->gpu, seq, tokens, T, pos, logits, all_logits, err, errlen);
    struct pass ps = {T, seq, pos, !logits ? T : all_logits ? 0 : T - 1};
    for (int t = 0; t < T; t++) {
        c->rseq[t] = seq;
        c->rpos[t] = pos + t;
    }
    return forward(c, &ps, tokens, logits, err, errlen);
}

int model_eval(struct model_ctx *c, int seq, const int32_t *tokens, int n, int pos, float *logits,
               int all_logits, char *err, size_t errlen)
{
    int V = c->m->hp.n_vocab, len = kv_seq_len(c->kv, seq), n_ctx = kv_cfg(c->kv)->n_ctx;
    c->reused = 0;
    if (n <= 0)
        return strata_errf(err, errlen, "nothing to evaluate (%d tokens)", n);
    if (len < 0)
        return strata_errf(err, errlen, "no sequence %d in this context", seq);
    if (pos < 0 || pos > len)
        return strata_errf(err, errlen, "position %d is past the %d cells of sequence %d", pos, len, seq);
    if (n > n_ctx - pos)
        return strata_errf(err, errlen, "context full: %d tokens at position %d exceed %d cells", n, pos, n_ctx);
    if (check_tokens(c, tokens, n, err, errlen) != 0)
        return -1;
    kv_truncate(c->kv, seq, len - pos);
    int done = 0;
    if (pos == 0 && !all_logits)
        done = c->reused = kv_prefix(c->kv, seq, tokens, n - 1);
    while (done < n) {
        int T = n - done < c->t_max ? n - done : c->t_max, last = done + T == n;
        float *lg = !logits ? NULL : all_logits ? logits + (size_t)done * V : last ? logits : NULL;
        if (kv_append(c->kv, seq, tokens + done, T, err, errlen) != 0 ||
            eval_chunk(c, seq, tokens + done, T, pos + done, lg, all_logits, err, errlen) != 0) {
            kv_truncate(c->kv, seq, kv_seq_len(c->kv, seq) - pos);
            c->reused = 0;
            return -1;
        }
        done += T;
    }
    /* the finished whole pages go to the prefix cache now, so that the next
     * prompt starting with these tokens shares them even if this sequence
     * is cut back first */
    kv_seq_publish(c->kv, seq);
    return 0;
}

int model_decode_batch(struct model_ctx *c, const int *seqs, const int32_t *tokens, int n, float *logits,
                       char *err, size_t errlen)
{
    int V = c->m->hp.n_vocab;
    if (n <= 0 || !logits)
        return strata_errf(err, errlen, "decode batch: %d sequences%s", n, logits ? "" : ", no logits buffer");
    int rows;
    if (logits == model_ctx_batch_logits(c, &rows) && n > rows)
        return strata_errf(err, errlen, "decode batch: %d sequences; the context's rows of logits hold %d", n, rows);
    if (check_tokens(c, tokens, n, err, errlen) != 0)
        return -1;
    if (kv_seqs_check(c->kv, seqs, n, 0, "decode batch", err, errlen) != 0)
        return -1;
    /* one cell for each first, so that a full pool fails before any work */
    int added = 0;
    for (; added < n; added++)
        if (kv_append(c->kv, seqs[added], tokens + added, 1, err, errlen) != 0)
            break;
    int rc = added < n ? -1 : 0;
    if (rc == 0 && c->device == MODEL_DEV_GPU)
        rc = gpu_eval_batch(c->gpu, seqs, tokens, n, logits, err, errlen);
    else
        for (int done = 0; rc == 0 && done < n;) {
            int T = n - done < c->t_max ? n - done : c->t_max;
            struct pass ps = {T, -1, 0, 0};
            for (int t = 0; t < T; t++) {
                c->rseq[t] = seqs[done + t];
                c->rpos[t] = kv_seq_len(c->kv, seqs[done + t]) - 1;
            }
            rc = forward(c, &ps, tokens + done, logits + (size_t)done * V, err, errlen);
            done += T;
        }
    if (rc != 0)
        for (int i = 0; i < added; i++)
            kv_truncate(c->kv, seqs[i], 1);
    return rc;
}

/* ==== Public API: one sequence, one sampler ==== */

struct strata {
    struct model *m;
    struct model_ctx *c;
    struct pool *pool;
    struct sampler *smp;
    struct sample_params sp;  /* what smp was made with */
    float *logits;            /* (V) of the last token evaluated: the context's row */
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
    s->hist = malloc((size_t)n_ctx * sizeof(int32_t));
    if (!s->pool || !s->hist) {
        strata_errf(err, errlen, "out of memory");
        goto fail;
    }
    struct model_opts o = model_opts_default();
    o.n_ctx = n_ctx;
    if (model_ctx_new(&s->c, s->m, &o, s->pool, err, errlen) != 0)
        goto fail;
    s->logits = model_ctx_logits(s->c);
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
    if (model_eval(s->c, 0, tokens, n, s->n_past, s->logits, 0, s->err, sizeof s->err) != 0)
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
    free(s->hist);
    free(s);
}
