/*
 * strata.h — Strata's public C API and the types shared between its files.
 *
 * A program that vendors Strata includes this header and compiles the .c files
 * beside it (all but strata.c and the test files; for a GPU build the .cu/.hip
 * files in place of gpu_none.c, as the Makefile does). The public calls are at the bottom
 * ("Public API"); the sections above them are the internal interfaces between
 * subsystems, one section per file, each with the prefix of the file that
 * defines it (gguf_, quant_, tok_, pool_, model_, sample_, json_, synth_,
 * chat_, sched_, http_, kv_, attn_, gpu_). The GPU files share gpu.h too.
 *
 * Shape letters used in comments: T tokens, D model width, H query heads,
 * K kv heads, E head dim, F feed-forward width, X experts, V vocab, C cells.
 * Error convention: functions that can fail return 0 on success and -1 on
 * error, writing a one-line message to (err, errlen); they never print or exit.
 */
#ifndef STRATA_H
#define STRATA_H

#include <stdarg.h>
#include <stddef.h>
#include <stdint.h>
#include <stdio.h>

#ifdef __cplusplus
extern "C" { /* the GPU files (.cu, .hip) are compiled as C++ */
#endif

/* The error convention in one place: formats a one-line message into
 * (err, errlen), when given, and returns -1. */
static inline int strata_errf(char *err, size_t errlen, const char *fmt, ...)
    __attribute__((format(printf, 3, 4)));
static inline int strata_errf(char *err, size_t errlen, const char *fmt, ...)
{
    if (err && errlen) {
        va_list ap;
        va_start(ap, fmt);
        vsnprintf(err, errlen, fmt, ap);
        va_end(ap);
    }
    return -1;
}

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

/* Maps and validates `path`. On error nothing stays open; the message does
 * not repeat the path (the caller names the file). */
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
float quant_f16_to_f32(uint16_t h);
uint16_t quant_f32_to_f16(float f);   /* round to nearest even */
/* The IQ2/IQ3 lattice types have no quantiser: quant_lattice_row makes a
 * row of n elements of one from random codes (row holds quant_row_bytes
 * random bytes on entry; every block's scale is set so that the row's
 * largest magnitude is about amax), for synthetic models and tests; -1 for
 * another type or a bad n. */
int quant_lattice(int qtype);
int quant_lattice_row(int qtype, void *row, int64_t n, float amax);
float quant_bf16_to_f32(uint16_t h);
const char *quant_simd_name(void);    /* "avx512-vnni", "avx2", "neon", "scalar" */

/* Weight rows as the tiled matrix kernel (quant_gemm.c) reads them: unsigned
 * levels u, a float scale per sub-block of sb elements, and for some types an
 * offset per sub-block. Element k of a row is
 *   sc[k/sb] * (u[k] - bias) + off[k/sb] * (what the offset meets)
 * where the offset meets the activations' sum over the sub-block
 * (QUANT_MINS_SUB: K-quant mins) or Q8_1's stored s (QUANT_MINS_Q8_1). */
enum quant_mins { QUANT_MINS_NONE, QUANT_MINS_SUB, QUANT_MINS_Q8_1 };
struct quant_levels {
    int sb;    /* elements per weight scale: 16 or 32 */
    int unit;  /* elements per activation scale: 32 (Q8_0, Q8_1) or 256 (Q8_K) */
    int bias;  /* level offset: 0 or a power of two */
    int mins;  /* enum quant_mins */
    /* one row of n elements: u (n), sc (n/sb), off (n/sb, written with mins) */
    void (*unpack)(const void *row, int n, uint8_t *u, float *sc, float *off);
};
/* NULL for a type (or a build) without a tiled kernel. */
const struct quant_levels *quant_levels(int qtype);
/* One activation row of n elements (Q8_0, Q8_1 or Q8_K) in parts: qs (n)
 * values, d (n/32 or n/256) scales, s16 (n/16) sums of 16 values, and for
 * Q8_1 only s (n/32) its stored sums. */
void quant_act_parts(int dot_type, const void *row, int n, int8_t *qs, float *d, int32_t *s16, float *s);

/* ==== quant_gemm.c: the matrix kernel ==== */

/* y[j*ldy + i] = dot(row i of w, row j of a) for i < nw, j < na; rows of n
 * elements, strides in bytes for w and a, in floats for y. Thread-safe (no
 * shared state): callers split nw between threads. Few activation rows go row
 * by row (decode); more are tiled, packing a into a malloc'd scratch. Results
 * equal the dots up to float summation order. */
void quant_gemm(int qtype, int n, const void *w, size_t ldw, int nw,
                const void *a, size_t lda, int na, float *y, size_t ldy);
/* The same in two steps, for callers that multiply several matrices by one
 * input on several threads: pack the activations once (any split of the 16-
 * token groups between threads), then multiply row slices of each matrix.
 * quant_gemm_tiled says whether weight type qtype with na rows of n elements
 * takes the tiled path; otherwise quant_gemm's row dots are the way. */
int quant_gemm_tiled(int qtype, int n, int na);
size_t quant_pack_bytes(int dot_type, int n, int na);    /* 0 when nothing tiles */
/* Packs groups g0..g1-1 (tokens 16 g0 .. min(16 g1, na) - 1) of the na rows
 * of a (dot type, strides lda bytes) into pack (quant_pack_bytes, 64-aligned). */
void quant_pack(int dot_type, int n, const void *a, size_t lda, int na, int g0, int g1, void *pack);
size_t quant_gemm_scratch(int qtype, int n);            /* bytes of scratch a call needs */
/* quant_gemm for a tiled shape, reading a finished pack of the na rows;
 * scratch: quant_gemm_scratch bytes, 64-aligned, private to the thread. */
void quant_gemm_packed(int qtype, int n, const void *w, size_t ldw, int nw, const void *pack,
                       int na, float *y, size_t ldy, void *scratch);

/* ==== pool.c: the pthread pool ==== */

struct pool;
struct pool *pool_new(int n_threads);        /* n_threads includes the caller */
void pool_free(struct pool *p);
int pool_size(const struct pool *p);
/* Runs fn(arg, i, n) once for each i in [0, n), n = pool_size, on the pool's
 * threads (the caller included; any thread may run any i, one i at a time
 * per thread) and waits. */
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
/* Appends v with printf format fmt; JSON has no infinities or NaN, so those
 * become null. */
void json_put_num(FILE *f, double v, const char *fmt);

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

/* A weight matrix (or a stack of X expert matrices): rows of n elements. */
struct model_mat {
    const uint8_t *data;  /* (X, rows, ldw bytes) */
    int type;             /* enum qtype */
    int n, rows;
    size_t ldw;           /* bytes per row */
    size_t stride;        /* bytes per expert matrix */
};

struct model_layer {
    const float *attn_norm;           /* (D) */
    struct model_mat wq, wk, wv, wo;  /* D→H*E, D→K*E, D→K*E, H*E→D */
    const float *bq, *bk, *bv, *bo;   /* (H*E), (K*E), (K*E), (D); optional */
    const float *q_norm, *k_norm;     /* (E) per-head RMSNorm weights (qwen3) */
    const float *ffn_norm;            /* (D) */
    struct model_mat gate, up, down;  /* dense SwiGLU: D→F, D→F, F→D */
    struct model_mat gate_inp;        /* MoE router: D→X */
    struct model_mat gate_exps, up_exps, down_exps; /* X × (D→Fe), X × (D→Fe), X × (Fe→D) */
    int moe;
};

/* The weights as loaded, for backends that copy them (gpu.cu): matrices
 * point into the file's mapping; 1-D vectors are F32. */
struct model_weights {
    struct model_mat tok_embd;    /* (V, D) */
    struct model_mat output;      /* (V, D): tok_embd when tied */
    const float *output_norm;     /* (D) */
    const float *output_b;        /* (V) optional */
    const float *rope_freqs;      /* (n_rot/2) optional frequency divisors */
    float freq_scale;             /* 1 / rope.scaling.factor for linear scaling */
    const struct model_layer *layers; /* (n_layer) */
};

struct model;        /* weights (pointing into the mapping), tokenizer, hyper-parameters */
struct model_ctx;    /* a KV pool of sequences (kv.c), attention (attn.c), scratch buffers */
struct kv;

enum model_device { MODEL_DEV_AUTO, MODEL_DEV_CPU, MODEL_DEV_GPU };

#define MODEL_CHUNK 512      /* default prompt tokens per forward chunk (--prefill-chunk) */
#define MODEL_CHUNK_GPU 2048 /* the same on a GPU: its matrix units want wide tiles (BENCH.md) */

/* What a context is made of; model_opts_default() fills it. */
struct model_opts {
    int n_ctx;           /* cells one sequence holds (<= 0 with kv_mem_mib: the whole pool) */
    int kv_cell;         /* enum kv_cell */
    int kv_mem_mib;      /* > 0: a pool of this many MiB; 0: n_seq sequences of n_ctx cells */
    int n_seq;           /* sequence slots; sequence 0 exists from model_ctx_new */
    int prefill_chunk;   /* prompt tokens per forward chunk; 0: the device's default */
    int device;          /* enum model_device: AUTO is the GPU when one is usable */
    int attn_split;      /* CPU decode attention: KV partitions (0: attn_split's choice) */
    int f32ref;          /* float-reference mode (CPU only): weights dequantised to F32 on
                            the fly, activations F32, as the reference engine computes on
                            an F32 copy of the model (the *.f32ref goldens pair it with
                            KV_CELL_F32) */
};

/* Maps the file, reads the {arch}.* hyper-parameters and binds every tensor
 * by name with its shape checked; a file without tokenizer.ggml.* metadata
 * loads with model_tok() == NULL (token ids only). */
int model_load(struct model **m, const char *path, char *err, size_t errlen);
void model_free(struct model *m);   /* after every context of it */
const struct model_hp *model_hp(const struct model *m);
void model_weights(const struct model *m, struct model_weights *w);
const struct tok *model_tok(const struct model *m);
const struct gguf *model_gguf(const struct model *m);
size_t model_weight_bytes(const struct model *m);        /* all tensors' bytes */
size_t model_decode_bytes(const struct model *m);        /* bytes one decode step reads */
/* n_ctx 0, F16 cells, one sequence, the device's chunk, MODEL_DEV_AUTO,
 * the automatic split, f32ref off. */
struct model_opts model_opts_default(void);
/* "auto", "cpu", "gpu" ("cuda" and "hip" too) → enum model_device; -1 if unknown. */
int model_device_parse(const char *name);
/* A context: the KV pool (kv_new with the model's shape and o's cells,
 * memory and sequences) and, on the CPU, every buffer evaluation needs
 * (nothing is allocated afterwards); on the GPU the model's weights are
 * uploaded at the first GPU context and the pages live in device memory.
 * pool (NULL: the caller's thread only) may be shared by several contexts
 * that do not evaluate at the same time. */
int model_ctx_new(struct model_ctx **c, struct model *m, const struct model_opts *o,
                  struct pool *pool, char *err, size_t errlen);
void model_ctx_free(struct model_ctx *c);
int model_ctx_device(const struct model_ctx *c);   /* MODEL_DEV_CPU or MODEL_DEV_GPU */
int model_ctx_chunk(const struct model_ctx *c);    /* prompt tokens per forward chunk */
/* The context's pool of sequences: kv_seq_new/fork/free/len and kv_stats
 * on it make and inspect the sequences that model_eval takes. */
struct kv *model_kv(struct model_ctx *c);
/* Evaluates tokens[0..n) of sequence seq at positions pos..pos+n-1: the
 * sequence is first cut to pos cells (pos <= its length), then grows by n,
 * in chunks of prefill_chunk tokens. logits: (n, V) if all_logits, else (V)
 * for the last token; NULL to skip the head. An empty sequence started at
 * position 0 without all_logits first shares the cached pages that hold
 * its leading tokens (kv_prefix) and evaluates only the rest; the logits
 * are the same. On error (the pool exhausted, the context full) the
 * sequence is left at pos cells and no other sequence is touched. */
int model_eval(struct model_ctx *c, int seq, const int32_t *tokens, int n, int pos,
               float *logits, int all_logits, char *err, size_t errlen);
/* A row of V floats the context owns, for model_eval's logits of one row:
 * on the GPU page-locked memory the device writes into directly, where a
 * row of the caller's costs a copy (~25 µs a token on the H200's host
 * for a 152K vocabulary). Valid while the context lives; each model_eval
 * into it overwrites it. */
float *model_ctx_logits(struct model_ctx *c);
/* The same for model_decode_batch: *rows rows of V (16 on the GPU; on the
 * CPU the context's sequences, 16 at most), for batches of up to *rows
 * sequences. Apart from model_ctx_logits's row: a model_eval leaves them as
 * they are. */
float *model_ctx_batch_logits(struct model_ctx *c, int *rows);
/* Cells the last model_eval took from the prefix cache instead of computing. */
int model_last_reused(const struct model_ctx *c);
/* One token for each of n distinct sequences, each at its sequence's end,
 * in one forward pass (each weight matrix read once for all n rows);
 * logits (n, V). On error no sequence has changed. */
int model_decode_batch(struct model_ctx *c, const int *seqs, const int32_t *tokens, int n,
                       float *logits, char *err, size_t errlen);

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
/* log Σ e^logits (NaN logits count as -inf), in double: logits[id] - it is
 * sample_logprob's value before rounding. */
double sample_lse(const float *logits, int n_vocab);

/* ==== synth.c: random-weight models of real shapes ==== */

/* args: "--arch A", "--shape S", "--set K=V", "--type T", "--vocab F", "-o F". */
int synth_main(int argc, char **argv, char *err, size_t errlen);

/* ==== chat.c: chat templates and reasoning blocks ==== */

enum chat_family { CHAT_CHATML, CHAT_LLAMA3, CHAT_LLAMA2 };

struct chat_template {
    int family;              /* enum chat_family */
    int known;               /* recognised (0: no or unknown template, ChatML used) */
    int thinking_switch;     /* the template reads enable_thinking (Qwen3) */
    int think_tags;          /* the template mentions <think> */
    char system_default[512]; /* the system message written when none is given ("" none) */
};

struct chat_msg {
    const char *role;        /* "system", "user" or "assistant" (NUL-terminated) */
    const char *content;     /* (len) bytes */
    size_t len;
};

/* Recognises the family from the template text (tmpl NULL: none). */
void chat_detect(struct chat_template *ct, const char *tmpl, size_t len);
const char *chat_family_name(int family);
/* The prompt text for msgs followed by the assistant's generation prompt;
 * malloc'd (length in *len), NULL when out of memory. */
char *chat_render(const struct chat_template *ct, const struct chat_msg *msgs, int n,
                  int enable_thinking, size_t *len);
/* The text that ends an assistant turn (a stop string for chat requests). */
const char *chat_end_marker(const struct chat_template *ct);

/* Generated text split into reasoning (between <think> and </think>) and
 * content, as spans of the text. Not final: the spans cover only what is
 * settled (a partial tag or trailing reasoning whitespace is held back), so
 * they only grow as text is appended. Text not starting with <think> is all
 * content. */
struct chat_split { size_t r_off, r_len, c_off, c_len; };
void chat_split(const char *text, size_t len, int final, struct chat_split *out);

/* ==== sched.c: generation slots and their scheduler ==== */

/* How a job ended (SCHED_RUNNING until it does). SCHED_REFUSED: not served
 * for want of resources (shutting down, the KV pool exhausted); its err
 * says which. */
enum sched_end { SCHED_RUNNING, SCHED_EOS, SCHED_LIMIT, SCHED_WORD, SCHED_CANCEL, SCHED_ERROR, SCHED_REFUSED };

#define SCHED_MAX_STOPS 17

struct sched_req {
    const int32_t *prompt;       /* (n_prompt) ids, the caller's until the job is freed */
    int n_prompt;
    struct sample_params sp;
    int n_predict;               /* < 0: until EOG or the context is full */
    int want_lp, n_top;          /* log-probability of each token; top entries per token */
    int cache_prompt;            /* share the cached KV pages of the prompt's longest prefix */
    const char *stop[SCHED_MAX_STOPS]; /* stop strings (the caller's), not part of the text */
    size_t stop_len[SCHED_MAX_STOPS];
    int n_stop;
};

/* One generation. Results below a sched_view's n_ids (ids, lp, top) and
 * ready (text) never change once seen; everything is final once the view's
 * end is not SCHED_RUNNING. */
struct sched_job {
    struct sched_req req;
    int cap;                     /* tokens at most */
    int32_t *ids;                /* (cap) sampled ids, a final EOG included */
    float *lp;                   /* (cap) their log-probabilities (want_lp) */
    struct sample_top *top;      /* (cap, n_top) */
    char *text;                  /* the generated text (no special tokens, no stop string) */
    int n_ids, end, stop_word;   /* stop_word: the stop string that ended it (SCHED_WORD) */
    size_t text_len, ready;      /* ready: bytes that can be shown (complete UTF-8, no partial stop) */
    char err[256];               /* SCHED_ERROR / SCHED_REFUSED */
    int slot, n_cached, n_past;  /* its slot; prompt ids shared from the prefix cache; ids in its sequence */
    double t_start, t_prompt, t_end; /* monotonic seconds: first step, prompt evaluated, end */
    struct sched_job_priv *priv; /* sched.c's: sampler, queue link, wake-up */
};

struct sched_view { int n_ids; size_t ready; int end, slot; };

struct sched_stats {
    uint64_t prompt_tokens, gen_tokens;  /* prompt ids evaluated (cached ones not), ids generated */
    uint64_t n_steps, busy_slot_steps, n_tokens_max;
    uint64_t decode_batches, decode_rows; /* batched decode passes; the tokens they evaluated */
    double prompt_s, decode_s;           /* seconds: prompt evaluation, generation */
    double prompt_rate, gen_rate;        /* tokens/s over the last 16 jobs */
    int processing, queued;
    long kv_used, kv_cached, kv_total;   /* cells: of running jobs, of idle cached pages, the pool's */
};

struct sched_opts {
    int n_slots;                 /* jobs generated at once (--parallel) */
    int n_ctx;                   /* cells one job's sequence holds (-c) */
    int kv_cell;                 /* enum kv_cell (--kv) */
    int kv_mem_mib;              /* > 0: a pool of this many MiB shared by the slots (--kv-mem);
                                    0: n_slots sequences of n_ctx cells */
    int n_threads;
    int prefill_chunk;           /* prompt tokens per step when no slot decodes; 0: the device's */
    int device;                  /* enum model_device */
};

struct sched;
/* One context on m (which must have a tokenizer) whose KV pool holds a
 * sequence per slot, a pool of n_threads, and the scheduler thread. */
int sched_new(struct sched **s, struct model *m, const struct sched_opts *o, char *err, size_t errlen);
/* Cells one job's sequence holds: o->n_ctx, or less when --kv-mem's pool is smaller. */
int sched_n_ctx(const struct sched *s);
/* Stops the thread and frees the context; no job may be queued or running. */
void sched_free(struct sched *s);
/* A job for req (copied; its prompt and stop strings stay the caller's);
 * NULL when out of memory. Free it only before submitting or once ended. */
struct sched_job *sched_job_new(struct sched *s, const struct sched_req *req);
void sched_job_free(struct sched_job *j);
/* Queues j; -1 after sched_close. */
int sched_submit(struct sched *s, struct sched_job *j);
/* Waits up to timeout_ms for progress beyond v (more ids or ready bytes) or
 * the end; then v holds the job's state. */
void sched_wait(struct sched *s, struct sched_job *j, struct sched_view *v, int timeout_ms);
/* Ends j as SCHED_CANCEL: at once when queued, at the next step when running. */
void sched_cancel(struct sched *s, struct sched_job *j);
/* Shutdown: queued and new jobs are refused (SCHED_REFUSED); with
 * cancel_running, running jobs end at the next step. */
void sched_close(struct sched *s, int cancel_running);
void sched_stats(struct sched *s, struct sched_stats *out);

/* ==== http.c: `strata serve`, an OpenAI-compatible HTTP/1.1 server ==== */

#define HTTP_MAX_HEADERS 64
enum { HTTP_PARTIAL = -2, HTTP_BAD = -1, HTTP_TOO_MANY = -3 };

struct http_header {
    const char *name, *value;  /* into the request buffer; not NUL-terminated */
    size_t name_len, value_len;
};

struct http_request {
    const char *method, *target;
    size_t method_len, target_len;
    int minor;                 /* HTTP/1.minor */
    struct http_header headers[HTTP_MAX_HEADERS];
    int n_headers;
};

/* Parses the request line and headers at buf[0..len) without allocating:
 * returns the bytes they take (through the empty line), HTTP_PARTIAL when
 * buf is a valid but incomplete prefix, HTTP_BAD when it cannot become a
 * valid request, HTTP_TOO_MANY past HTTP_MAX_HEADERS headers. LF alone is
 * accepted as a line end. len is capped at INT_MAX. */
int http_parse_request(const char *buf, size_t len, struct http_request *req);
/* The value of the first header named name (case-insensitive); NULL if absent. */
const struct http_header *http_header(const struct http_request *req, const char *name);
/* "8388608", "512K", "8M" (binary units) into *out; -1 if malformed or > 1 GiB. */
int http_parse_size(const char *s, size_t *out);
/* `strata serve` (argv[0] is "serve"); returns the exit status. */
int http_serve_main(int argc, char **argv);

/* ==== kv.c: the paged KV cache ==== */

/* Cell formats (--kv): how one cell's K and V rows (E values per KV head)
 * are stored. int8: E codes and one f32 scale per row (symmetric absmax);
 * q4: Q4_0 blocks of 32 along E; k8v4: int8 K, Q4_0 V. */
enum kv_cell { KV_CELL_F32, KV_CELL_F16, KV_CELL_INT8, KV_CELL_Q4, KV_CELL_K8V4, KV_CELL_COUNT };

#define KV_PAGE_CELLS 64 /* default cells per page (kv.c says why) */

struct kv_config {
    int n_layer, n_head_kv, head_dim; /* L, K, E */
    int cell;                         /* enum kv_cell */
    int page_cells;                   /* P: a power of two in [16, 256]; 0: KV_PAGE_CELLS */
    int n_seq;                        /* sequence slots */
    int n_ctx;                        /* most cells one sequence holds (<= 0 with mem_mib: the pool) */
    int mem_mib;                      /* 0: pages for n_seq sequences of n_ctx cells;
                                         > 0: as many pages as fit in this many MiB */
    const struct kv_mem *mem;         /* where the page bytes live; NULL: host memory */
};

/* Page storage elsewhere (a GPU's memory): alloc returns bytes 64-aligned or
 * NULL, copy copies a page within them (copy-on-write). With such storage
 * kv.c only keeps the tables; the owner of the memory writes and reads the
 * rows itself (kv_store, kv_read, kv_gather and kv_prefetch must not be
 * called). */
struct kv_mem {
    void *(*alloc)(void *user, size_t bytes);
    void (*copy)(void *user, void *dst, const void *src, size_t bytes);
    void (*free)(void *user, void *p);
    void *user;
};

/* The byte layout of the pages, for code that reads them without kv.c (GPU
 * kernels): page p starts at data + p*page_bytes and holds, for each layer l
 * and kv head h in that order, a block of P K rows then P V rows:
 *   K row of cell i:  ((l*K + h) * P * (kbytes + vbytes)) + i*kbytes
 *   V row of cell i:  ((l*K + h) * P * (kbytes + vbytes)) + P*kbytes + i*vbytes
 * Rows: f32/f16 E values; int8: an f32 scale, then E int8 codes; q4: E/32
 * Q4_0 blocks (an f16 scale, 16 bytes of nibbles). */
struct kv_layout {
    uint8_t *data;
    size_t page_bytes, kbytes, vbytes;
    int P, n_pages, max_pages;
};

struct kv_stats {
    int pages, free;       /* pool pages; pages on the free list */
    int cached, idle;      /* pages in the prefix table; of those, held by no sequence */
    size_t cell_bytes;     /* one cell, every layer, K and V */
    size_t page_bytes;     /* one page */
    size_t total_bytes;    /* everything kv_new allocated */
};

struct kv;

int kv_cell_parse(const char *name);   /* "f32" "f16" "int8" "q4" "k8v4"; -1 if unknown */
const char *kv_cell_name(int cell);
/* Bytes of one cell over all layers, K and V, scales included (what
 * --kv-mem buys); 0 when the format cannot hold the head dim. */
size_t kv_cell_bytes(const struct kv_config *cfg);
/* Allocates the whole pool; nothing is allocated afterwards. */
int kv_new(struct kv **kv, const struct kv_config *cfg, char *err, size_t errlen);
void kv_free(struct kv *kv);
const struct kv_config *kv_cfg(const struct kv *kv); /* page_cells and n_ctx filled in */
void kv_layout(const struct kv *kv, struct kv_layout *lo);
/* The sequence's page table: (max_pages) page ids, the first
 * ceil(len / P) valid. Changes only in kv_append and kv_prefix (a new page,
 * or a copied one) and kv_truncate. */
const int32_t *kv_page_table(const struct kv *kv, int seq);
void kv_stats(const struct kv *kv, struct kv_stats *s);

/* Sequences. A sequence is cells 0..n-1 (cell i = position i), held in
 * pages through its page table. Contract: the cells kv_append adds are
 * written (kv_store, every layer) before the next kv_append, kv_seq_fork or
 * kv_seq_free of that sequence; cells that will not be written are removed
 * with kv_truncate first. */
int kv_seq_new(struct kv *kv, char *err, size_t errlen);          /* an empty sequence's id, or -1 */
/* A new sequence holding all of src's cells: pages shared (reference
 * counted), copied at the first write into a shared page. */
int kv_seq_fork(struct kv *kv, int src, char *err, size_t errlen);
/* Ends the sequence; its whole pages with known tokens stay in the prefix
 * cache until their pages are needed (least recently used first). */
void kv_seq_free(struct kv *kv, int seq);
int kv_seq_len(const struct kv *kv, int seq);
/* 0 when seqs[0..n) are n different sequences with at least min_cells
 * cells each, else -1 and a message (beginning with who) naming the first
 * that is not: the check of a step over several sequences at once. */
int kv_seqs_check(const struct kv *kv, const int *seqs, int n, int min_cells, const char *who, char *err,
                  size_t errlen);
/* Offers the sequence's whole pages of known tokens to the prefix cache now
 * (kv_append and kv_seq_free do it too), so that a later prompt shares them
 * even if this sequence is cut back first. Its cells must all be written. */
void kv_seq_publish(struct kv *kv, int seq);
/* Adds n cells (tokens: their ids for prefix reuse, or NULL). Fails with a
 * message, leaving the sequence as it was, when it would pass n_ctx or the
 * pool has too few free or evictable pages; other sequences are never
 * touched. Copies the partial last page first if it is shared. */
int kv_append(struct kv *kv, int seq, const int32_t *tokens, int n, char *err, size_t errlen);
void kv_truncate(struct kv *kv, int seq, int n);   /* drops the last n cells (all if n >= len) */
/* On an empty sequence: shares the cached pages holding the longest
 * page-aligned prefix of tokens[0..n) and returns the cells reused (a
 * multiple of P; pass n-1 to keep a token to evaluate). */
int kv_prefix(struct kv *kv, int seq, const int32_t *tokens, int n);
/* Writes layer's K and V rows of cells pos..pos+n-1: k, v (n, K*E) f32,
 * converted to the cell format. The cells must exist and be unshared.
 * Calls on disjoint cells may run in parallel. */
int kv_store(struct kv *kv, int seq, int layer, int pos, int n, const float *k, const float *v,
             char *err, size_t errlen);
/* Dequantised rows of one (layer, kv head) for the attention kernels:
 * cells c0..c0+n-1, or the listed cells; k, v (n, E) (either may be NULL).
 * No checks: the caller keeps the cells within the sequence. */
void kv_read(const struct kv *kv, int seq, int layer, int head, int c0, int n, float *k, float *v);
void kv_gather(const struct kv *kv, int seq, int layer, int head, const int32_t *cells, int n,
               float *k, float *v);
/* Starts loading the rows kv_read (cells NULL: c0..c0+n-1) or kv_gather
 * (cells[0..n)) would read. */
void kv_prefetch(const struct kv *kv, int seq, int layer, int head, const int32_t *cells, int c0, int n);
/* Introspection for tests: the page holding a cell (-1 if none) and its
 * reference count (sequences holding it, +1 while in the prefix table). */
int kv_page_of(const struct kv *kv, int seq, int cell);
int kv_page_refs(const struct kv *kv, int page);

/* ==== attn.c: CPU attention kernels ==== */

/* Softmax(scale · q·k) · v over a sequence's cells in kv.c's pages, causal
 * (query t sees cells 0..pos0+t), GQA (query head h reads kv head h/(H/K)).
 * Online softmax over blocks of ATTN_BLOCK cells; no T×C score buffer. */

#define ATTN_BLOCK 64      /* cells per online-softmax step */
#define ATTN_MAX_SPLIT 32  /* most decode partitions */

enum attn_flag {
    /* the reference engine's rounding points with an F16 cache: Q rounded to
     * F16 before K·Q (K F16), and the normalised probabilities rounded to
     * F16 before they multiply V (V F16); costs a second pass over K */
    ATTN_F16_REF = 1
};

struct attn_job {
    const struct kv *kv;
    int seq, layer;
    const float *q;         /* (T, H*E) queries, RoPE applied */
    float *out;             /* (T, H*E) */
    int T;                  /* queries */
    int pos0;               /* query t is cell pos0+t; cells 0..pos0+T-1 are stored */
    float scale;            /* 0: 1/sqrt(E) */
    int flags;              /* enum attn_flag */
    int n_split;            /* decode: partitions S (0: attn_split's choice) */
    /* QSA: query t attends to cells sel[sel_off[t] .. sel_off[t+1]),
     * ascending, each <= pos0+t (attn_topk makes such lists) */
    const int32_t *sel;
    const int64_t *sel_off; /* (T+1) */
};

struct attn;
/* Scratch for kernels on H query heads, K kv heads, head dim E (a multiple
 * of 16), decode windows of up to max_window queries, pools of up to
 * n_threads threads; allocated once. One call at a time per struct attn. */
int attn_new(struct attn **a, int n_head, int n_head_kv, int head_dim, int max_window,
             int n_threads, char *err, size_t errlen);
void attn_free(struct attn *a);
/* Prompt: tasks of (kv head, query tile) walking all visible cells. */
int attn_prompt(struct attn *a, struct pool *p, const struct attn_job *j, char *err, size_t errlen);
/* Decode (T <= max_window): the cells cut into S partitions run in
 * parallel, each giving (max, sum, accumulator) per row, merged by
 * log-sum-exp; S = 1 gives attn_prompt's result bit for bit. */
int attn_decode(struct attn *a, struct pool *p, const struct attn_job *j, char *err, size_t errlen);
/* QSA prompt: one online softmax per (query, kv head) over its selected
 * cells; with every cell selected it equals attn_prompt bit for bit. */
int attn_qsa_prompt(struct attn *a, struct pool *p, const struct attn_job *j, char *err, size_t errlen);
/* QSA decode: each query's selected cells split into partitions and merged. */
int attn_qsa_decode(struct attn *a, struct pool *p, const struct attn_job *j, char *err, size_t errlen);
/* The decode partition count for n cells, K kv heads and n_threads. */
int attn_split(int n_cells, int n_head_kv, int n_threads);
/* QSA selection over cells 0..n-1: the k highest scores (ties to the lower
 * cell; NaN lowest) and the last `local` cells, ascending into out
 * (room for min(n, k + local)); returns the count. n <= k selects all. */
int attn_topk(const float *score, int n, int k, int local, int32_t *out);

/* ==== gpu.cu: the GPU backend (make cuda, make hip; gpu_none.c otherwise) ==== */

/* A model's weights on the device: uploaded once, kept quantised, shared by
 * every context of the model. */
struct gpu_model;
/* One context's device state: activations, scratch, the captured decode
 * graph. Its KV pages are a kv.c pool whose bytes gpu_kv_mem places on the
 * device, with kv.c's layout (struct kv_layout). */
struct gpu_ctx;

const char *gpu_backend(void);            /* "cuda", "hip", or "none" in a CPU build */
/* Usable devices: 0 in a CPU build, without a driver or without a device
 * (never an error); name (may be NULL) gets the first one's name. */
int gpu_devices(char *name, size_t cap);
/* The first device's memory bandwidth in bytes/s: a device-to-device copy of
 * `bytes`, counting each byte read and written (what decode's bound uses);
 * 0 when there is no device or a call fails. */
double gpu_copy_bandwidth(size_t bytes);
/* Whether prompts of 64 tokens or more go to cuBLAS (gpu_gemm.cu: opened at
 * run time where the toolkit's library is on the loader's path, and not
 * turned off by STRATA_GEMM_BLAS=0); 0 in a CPU or HIP build. */
int gpu_gemm_blas(void);
int gpu_model_new(struct gpu_model **g, const struct model *m, char *err, size_t errlen);
void gpu_model_free(struct gpu_model *g);
size_t gpu_model_bytes(const struct gpu_model *g);   /* device memory the weights take */
/* Page storage in device memory, for kv_config.mem; valid while g lives. */
const struct kv_mem *gpu_kv_mem(struct gpu_model *g);
/* Buffers for chunks of up to max_tokens tokens over kv (made with
 * gpu_kv_mem(g)); allocated once. */
int gpu_ctx_new(struct gpu_ctx **c, struct gpu_model *g, struct kv *kv, int max_tokens,
                char *err, size_t errlen);
void gpu_ctx_free(struct gpu_ctx *c);
/* The context's pinned rows of V logits: one row (model_ctx_logits), then
 * *batch (NULL: not asked) for a batch step (model_ctx_batch_logits). */
float *gpu_ctx_logits(struct gpu_ctx *c, int *batch);
/* model_eval on the device: tokens[0..n) (n <= max_tokens) of sequence seq
 * at cells pos..pos+n-1, which the caller has made the sequence's last
 * cells (kv_truncate, kv_append). logits (host): (n, V) if all_logits, else
 * (V) for the last token; NULL to skip the head. */
int gpu_eval(struct gpu_ctx *c, int seq, const int32_t *tokens, int n, int pos, float *logits,
             int all_logits, char *err, size_t errlen);
/* One decode step for each of n distinct sequences: tokens[i] at the last
 * cell of seqs[i] (the caller appended it), logits (n, V) (host). Up to 16
 * sequences (at most max_tokens) share each pass: their matrix products
 * read the weights once, each attends over its own cells. */
int gpu_eval_batch(struct gpu_ctx *c, const int *seqs, const int32_t *tokens, int n, float *logits, char *err,
                   size_t errlen);

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

#ifdef __cplusplus
}
#endif
#endif
