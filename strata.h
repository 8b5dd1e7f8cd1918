/*
 * strata.h — Strata's public C API and the types shared between its files.
 *
 * A program that vendors Strata includes this header and compiles the .c files
 * beside it (all but strata.c and test.c). The public calls are at the bottom
 * ("Public API"); the sections above them are the internal interfaces between
 * subsystems, one section per file, each with the prefix of the file that
 * defines it (gguf_, quant_, tok_, pool_, model_, sample_, json_, synth_).
 *
 * Shape letters used in comments: T tokens, D model width, H query heads,
 * K kv heads, E head dim, F feed-forward width, X experts, V vocab, C cells.
 * Error convention: functions that can fail return 0 on success and -1 on
 * error, writing a one-line message to (err, errlen); they never print or exit.
 */
#ifndef STRATA_H
#define STRATA_H

#include <stddef.h>
#include <stdint.h>
#include <stdio.h>

/* ==== tensor types (the ggml type ids stored in GGUF tensor infos) ==== */

enum qtype {
    QT_F32 = 0, QT_F16 = 1, QT_Q4_0 = 2, QT_Q4_1 = 3, QT_Q5_0 = 6, QT_Q5_1 = 7,
    QT_Q8_0 = 8, QT_Q8_1 = 9, QT_Q2_K = 10, QT_Q3_K = 11, QT_Q4_K = 12,
    QT_Q5_K = 13, QT_Q6_K = 14, QT_Q8_K = 15, QT_IQ2_XXS = 16, QT_IQ2_XS = 17,
    QT_IQ3_XXS = 18, QT_IQ1_S = 19, QT_IQ4_NL = 20, QT_IQ3_S = 21, QT_IQ2_S = 22,
    QT_IQ4_XS = 23, QT_I8 = 24, QT_I16 = 25, QT_I32 = 26, QT_I64 = 27,
    QT_F64 = 28, QT_IQ1_M = 29, QT_BF16 = 30,
    QT_COUNT = 41 /* ids at or above this are rejected by the reader */
};

/* ==== gguf.c: GGUF v2/v3 reader over mmap, and a writer ==== */

enum gguf_vtype {
    GGUF_U8 = 0, GGUF_I8 = 1, GGUF_U16 = 2, GGUF_I16 = 3, GGUF_U32 = 4,
    GGUF_I32 = 5, GGUF_F32 = 6, GGUF_BOOL = 7, GGUF_STR = 8, GGUF_ARR = 9,
    GGUF_U64 = 10, GGUF_I64 = 11, GGUF_F64 = 12, GGUF_NVTYPE
};

/* A string inside the mapped file: not NUL-terminated. */
struct gguf_str {
    uint64_t len;
    const char *ptr;
};

struct gguf_kv {
    struct gguf_str key;
    int type;            /* enum gguf_vtype */
    int arr_type;        /* element type when type == GGUF_ARR */
    uint64_t n;          /* element count (1 for scalars) */
    const uint8_t *data; /* the value's bytes in the file (may be unaligned) */
    size_t nbytes;       /* size of those bytes */
};

#define GGUF_MAX_DIMS 4
#define GGUF_NAME_MAX 64 /* tensor names are at most 63 bytes */

struct gguf_tensor {
    char name[GGUF_NAME_MAX];
    int type;                 /* enum qtype */
    int n_dims;
    int64_t ne[GGUF_MAX_DIMS]; /* ne[0] contiguous; missing dims are 1 */
    uint64_t offset;          /* from the start of the data section */
    size_t nbytes;
    const void *data;         /* points into the mapping */
};

struct gguf {
    uint32_t version;
    uint64_t n_kv;
    struct gguf_kv *kv;           /* (n_kv) */
    uint64_t n_tensors;
    struct gguf_tensor *tensors;  /* (n_tensors) */
    uint32_t alignment;
    size_t data_offset;           /* start of the data section in the file */
    const uint8_t *base;          /* the whole file */
    size_t size;
    int mapped;                   /* base is an mmap owned by this struct */
};

/* Maps and validates `path`. On error nothing stays open. */
int gguf_open(struct gguf *g, const char *path, char *err, size_t errlen);
/* Validates a GGUF image in memory; g borrows buf (the caller keeps it alive). */
int gguf_parse(struct gguf *g, const void *buf, size_t size, char *err, size_t errlen);
/* Frees the tables and unmaps; safe on a zeroed struct. */
void gguf_close(struct gguf *g);

const struct gguf_kv *gguf_find(const struct gguf *g, const char *key);
const struct gguf_tensor *gguf_tensor(const struct gguf *g, const char *name);
/* Scalar getters: 0 when the key exists and converts, -1 otherwise (out untouched). */
int gguf_get_int(const struct gguf *g, const char *key, int64_t *out);   /* any integer or bool */
int gguf_get_f32(const struct gguf *g, const char *key, float *out);     /* any number */
int gguf_get_str(const struct gguf *g, const char *key, struct gguf_str *out);
/* Array elements (kv must be an array; i < kv->n): numbers convert; strings
 * are found by walking, so fill a table once with gguf_arr_strs. */
int64_t gguf_arr_int(const struct gguf_kv *kv, uint64_t i);
float gguf_arr_f32(const struct gguf_kv *kv, uint64_t i);
void gguf_arr_strs(const struct gguf_kv *kv, struct gguf_str *out);     /* out: (kv->n) */
const char *gguf_type_name(int qtype);                                  /* "Q4_K", or "?" */
size_t gguf_vtype_size(int vtype);                                      /* 0 for STR/ARR */

/* Writer: declare metadata and tensors, then stream the tensor bytes in
 * declaration order; padding is inserted automatically. */
struct gguf_writer;
struct gguf_writer *gguf_w_new(void);
void gguf_w_u32(struct gguf_writer *w, const char *key, uint32_t v);
void gguf_w_i32(struct gguf_writer *w, const char *key, int32_t v);
void gguf_w_f32(struct gguf_writer *w, const char *key, float v);
void gguf_w_bool(struct gguf_writer *w, const char *key, int v);
void gguf_w_str(struct gguf_writer *w, const char *key, const char *v);
void gguf_w_arr(struct gguf_writer *w, const char *key, int elem_vtype, uint64_t n, const void *data);
void gguf_w_arr_str(struct gguf_writer *w, const char *key, uint64_t n, const char *const *v);
void gguf_w_copy(struct gguf_writer *w, const struct gguf_kv *kv); /* a kv from another file, as is */
void gguf_w_tensor(struct gguf_writer *w, const char *name, int qtype, int n_dims, const int64_t *ne);
/* Writes header, metadata and tensor infos to path; then gguf_w_data streams. */
int gguf_w_begin(struct gguf_writer *w, const char *path, char *err, size_t errlen);
int gguf_w_data(struct gguf_writer *w, const void *data, size_t n);
/* Closes the file (checking every tensor got its bytes) and frees w. */
int gguf_w_end(struct gguf_writer *w, char *err, size_t errlen);

/* ==== quant.c: block formats ==== */

struct quant_type {
    const char *name;
    int blck;          /* elements per block */
    size_t size;       /* bytes per block */
    int dot_type;      /* the activation type its dot product takes */
    /* dequantise n elements (a multiple of blck) */
    void (*to_f32)(const void *x, float *y, int64_t n);
    /* quantise n elements: activation types follow the reference's x86 SIMD
     * numerics exactly; weight types the reference quantiser; NULL if absent */
    void (*from_f32)(const float *x, void *y, int64_t n);
    /* *s = dot of n elements of a weight row (this type) and an activation row
     * (dot_type); dot is the fastest built, dot_scalar the portable one */
    void (*dot)(int n, float *s, const void *w, const void *a);
    void (*dot_scalar)(int n, float *s, const void *w, const void *a);
};

/* NULL for an id this build does not support. */
const struct quant_type *quant_type(int qtype);
size_t quant_row_bytes(int qtype, int64_t n); /* 0 if n is not a multiple of blck */
/* y[j*ldy + i] = dot(row i of w, row j of a) for i < nw, j < na; rows of n
 * elements, strides in bytes for w and a, in floats for y. */
void quant_gemm(int qtype, int n, const void *w, size_t ldw, int nw,
                const void *a, size_t lda, int na, float *y, size_t ldy);
float quant_f16_to_f32(uint16_t h);
uint16_t quant_f32_to_f16(float f);   /* round to nearest even */
float quant_bf16_to_f32(uint16_t h);
const char *quant_simd_name(void);    /* "avx512-vnni", "avx2", "neon", "scalar" */

/* ==== pool.c: the pthread pool ==== */

struct pool;
struct pool *pool_new(int n_threads);        /* n_threads includes the caller */
void pool_free(struct pool *p);
int pool_size(const struct pool *p);
/* Runs fn(arg, i, n) for i in [0, n) on every thread (caller included) and waits. */
void pool_run(struct pool *p, void (*fn)(void *arg, int i, int n), void *arg);

/* ==== json.c: a small JSON reader and writer ==== */

enum json_kind { JSON_NULL, JSON_BOOL, JSON_NUM, JSON_STR, JSON_ARR, JSON_OBJ };

struct json {
    int kind;
    double num;           /* JSON_NUM; JSON_BOOL as 0/1 */
    char *str;            /* JSON_STR: NUL-terminated (may hold NULs; see len) */
    size_t len;           /* string length, or element count of ARR/OBJ */
    char **keys;          /* JSON_OBJ: (len) */
    struct json *items;   /* ARR/OBJ: (len) */
};

/* Parses text (strict RFC 8259, nesting <= 64) into a tree owned by *out,
 * held in one allocation; errors name the byte offset and leave *out zeroed. */
int json_parse(struct json *out, const char *text, size_t len, char *err, size_t errlen);
void json_free(struct json *j); /* the root from json_parse only; zeroes it */
const struct json *json_get(const struct json *obj, const char *key); /* NULL if absent */
/* Appends s as a JSON string literal (quotes, escapes; invalid UTF-8 → U+FFFD). */
void json_put_str(FILE *f, const char *s, size_t len);

/* ==== tok.c: tokenizers ==== */

struct tok;
/* Builds the tokenizer from a file's tokenizer.ggml.* metadata: model "llama"
 * (SPM) or "gpt2" (byte-level BPE; pre-tokenizers default, llama3/llama-bpe,
 * qwen2, qwen35, gpt-2 and a few more). Copies what it keeps: g may be
 * closed afterwards. */
int tok_load(struct tok **t, const struct gguf *g, char *err, size_t errlen);
void tok_free(struct tok *t);
/* Returns a malloc'd array of ids (count in *n; not NULL even for 0 ids),
 * NULL with err set on failure. add_special: BOS/EOS as the vocabulary says;
 * parse_special: control tokens written in the text become their ids
 * (USER_DEFINED tokens always do). */
int32_t *tok_encode(const struct tok *t, const char *text, size_t len, int add_special,
                    int parse_special, int *n, char *err, size_t errlen);
/* The bytes a token contributes to output (special tokens only if `special`);
 * returns the full length, writing at most cap bytes. */
size_t tok_piece(const struct tok *t, int32_t id, char *buf, size_t cap, int special);
/* Detokenises a sequence as the reference's llama_detokenize does (SPM: the
 * first piece loses one leading space; BPE vocabularies with clean-up drop
 * the space in " ," " ." " !" " ?" " 's" ...); returns the full length,
 * writing at most cap bytes. The pieces concatenated keep every byte. */
size_t tok_decode(const struct tok *t, const int32_t *ids, int n, char *buf, size_t cap, int special);
/* How many leading bytes of buf form complete UTF-8 characters (for streaming:
 * hold back a character split across tokens until its last byte arrives). */
size_t tok_utf8_complete(const char *buf, size_t n);
int tok_n_vocab(const struct tok *t);
int32_t tok_bos(const struct tok *t);   /* -1 if the vocabulary has none */
int32_t tok_eos(const struct tok *t);   /* -1 if the vocabulary has none */
int tok_add_bos(const struct tok *t);
int tok_is_eog(const struct tok *t, int32_t id);  /* generation stops on it */
const char *tok_text(const struct tok *t, int32_t id); /* the vocabulary string; NULL if out of range */

/* ==== model.c: architectures and the CPU forward pass ==== */

enum model_arch { ARCH_LLAMA, ARCH_QWEN2, ARCH_QWEN3, ARCH_QWEN3MOE };

struct model_hp {
    int arch;            /* enum model_arch */
    int n_vocab, n_embd, n_layer, n_head, n_head_kv, head_dim, n_ff;
    int n_expert, n_expert_used, n_ff_exp;
    int n_ctx_train, n_rot;
    int rope_neox;       /* NEOX pairing (halves) rather than adjacent pairs */
    float rope_base, rms_eps;
};

struct model;        /* weights (pointing into the mapping), tokenizer, hyper-parameters */
struct model_ctx;    /* one sequence: KV cache, scratch buffers */

enum kv_type { KV_F16 = 0, KV_F32 = 1 };

/* Maps the file, reads the {arch}.* hyper-parameters and binds every tensor
 * by name with its shape checked; a file without tokenizer.ggml.* metadata
 * loads with model_tok() == NULL (token ids only). */
int model_load(struct model **m, const char *path, char *err, size_t errlen);
void model_free(struct model *m);
const struct model_hp *model_hp(const struct model *m);
const struct tok *model_tok(const struct model *m);
const struct gguf *model_gguf(const struct model *m);
size_t model_weight_bytes(const struct model *m);        /* all tensors' bytes */
size_t model_decode_bytes(const struct model *m);        /* bytes one decode step reads */
/* n_ctx cells of KV (kv_type); every buffer evaluation needs is allocated
 * here. pool (NULL: the caller's thread only) may be shared by several
 * contexts that do not evaluate at the same time. */
int model_ctx_new(struct model_ctx **c, struct model *m, int n_ctx, int kv_type,
                  struct pool *pool, char *err, size_t errlen);
void model_ctx_free(struct model_ctx *c);
/* Evaluates tokens[0..n) at positions pos..pos+n-1 (earlier cells are kept,
 * later ones forgotten; pos <= the cells in use), in chunks of up to 512
 * tokens. logits: (n, V) if all_logits, else (V) for the last token; NULL to
 * skip the head. */
int model_eval(struct model_ctx *c, const int32_t *tokens, int n, int pos,
               float *logits, int all_logits, char *err, size_t errlen);
/* Float-reference mode (off by default): weights are dequantised to F32 on
 * the fly and activations stay F32, as the reference engine computes on an
 * F32 copy of the model (the *.f32ref goldens pair it with KV_F32). */
void model_ctx_set_f32ref(struct model_ctx *c, int on);

/* ==== sample.c: samplers and log-probabilities ==== */

struct sample_params {
    float temp;          /* <= 0: greedy: the highest logit after the
                            penalties, ties to the lowest id */
    int top_k;           /* <= 0: off */
    float top_p;         /* >= 1: off */
    float min_p;         /* <= 0: off */
    float repeat_penalty;    /* 1: off */
    float presence_penalty;  /* 0: off */
    float frequency_penalty; /* 0: off */
    int repeat_last_n;       /* history window for the penalties */
    uint64_t seed;
};

struct sample_top { int32_t id; float logprob; };

struct sampler;
struct sampler *sample_new(const struct sample_params *p, int n_vocab);
void sample_free(struct sampler *s);
/* Picks the next id from raw logits (not modified). */
int32_t sample_next(struct sampler *s, const float *logits);
/* Records an id in the penalty history (prompt tokens too, as the caller wishes). */
void sample_accept(struct sampler *s, int32_t id);
/* log-softmax of the raw logits at id; fills top[0..n_top) highest first. */
float sample_logprob(const float *logits, int n_vocab, int32_t id, struct sample_top *top, int n_top);

/* ==== synth.c: random-weight models of real shapes ==== */

/* args: "--arch A", "--shape S", "--set K=V", "--type T", "--vocab F", "-o F". */
int synth_main(int argc, char **argv, char *err, size_t errlen);

/* ==== Public API: what a program embedding Strata calls ==== */

/* The calls above are the API: model_load → model_tok/tok_encode →
 * model_ctx_new → model_eval → sample_new/sample_next → *_free. This small
 * wrapper bundles them for the common single-sequence case. */
struct strata;
/* n_ctx <= 0: the model's training context (at most 4096); n_threads <= 0:
 * one per online CPU. F16 KV cache. NULL with err set on failure. */
struct strata *strata_open(const char *model_path, int n_ctx, int n_threads, char *err, size_t errlen);
/* malloc'd ids (count in *n): BOS per metadata, special tokens parsed; NULL on error. */
int32_t *strata_tokenize(struct strata *s, const char *text, int *n);
/* Appends tokens to the sequence; returns the logits of the last one (V),
 * valid until the next call, NULL on error. */
const float *strata_eval(struct strata *s, const int32_t *tokens, int n);
/* The next id from the last logits (-1 on error); the sampler sees every
 * evaluated token as penalty history. */
int32_t strata_sample(struct strata *s, const struct sample_params *p);
/* The message of the last failed call (strata_tokenize/eval/sample). */
const char *strata_error(const struct strata *s);
void strata_free(struct strata *s);

#endif
