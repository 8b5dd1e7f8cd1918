/*
 * gpu.h — what Strata's GPU files share: the launchers that gpu.cu's forward
 * pass calls in attn_cuda.cu / attn_hip.hip (attention) and gpu_gemm.cu
 * (prompt matrix products), and gpu.cu's KV writer. Plain C declarations, included by
 * the .cu/.hip files and by test_gpu.c; every launcher is asynchronous on
 * the given stream (a cudaStream_t / hipStream_t passed as void *), returns
 * 0 or -1 with a message, and never synchronises, so gpu.cu can capture it
 * in a graph. Device pointers are marked "dev".
 */
#ifndef STRATA_GPU_H
#define STRATA_GPU_H

#include "strata.h"

#ifdef __cplusplus
extern "C" {
#endif

/* A sequence's KV pages on the device, as kv.c lays them out (struct
 * kv_layout in strata.h says where each row is). */
struct gpu_kv {
    uint8_t *pages;             /* dev: kv_layout.data */
    size_t page_bytes, kbytes, vbytes;
    int cell;                   /* enum kv_cell */
    int L, K, E, P;             /* layers, kv heads, head dim, cells per page (a power of two, as kv.c's) */
    const int32_t *page_table;  /* dev: (max_pages) the sequence's pages */
};

/* One attention call: query t (of T) is cell pos0 + t and sees cells
 * 0..pos0+t (causal), GQA (query head h reads kv head h / (H/K)). pos0 is read
 * from device memory so that a captured graph replays at any position;
 * max_cells bounds pos0 + T and sizes the grid of the split kernels. */
struct gpu_attn {
    struct gpu_kv kv;
    int layer;
    const float *q;             /* dev: (T, H*E), RoPE applied */
    float *out;                 /* dev: (T, H*E) */
    int H, T;
    const int32_t *pos0;        /* dev: one int */
    int max_cells;
    float scale;                /* softmax scale (1/sqrt(E) for our models) */
    /* QSA only: query t attends to cells sel[sel_off[t] .. sel_off[t+1]),
     * ascending, each <= pos0 + t (dev) */
    const int32_t *sel;
    const int64_t *sel_off;
    void *scratch;              /* dev: gpu_attn_scratch_bytes() bytes (split partials) */
    /* decode, optional: the output rows also as the decode products read
     * an activation (int8 blocks of 32, gpu_quant.h's gq_q8_act): codes
     * (T, H*E) and the blocks' scales (T*H*E/32, 4) (dev) */
    int8_t *out_q;
    float *out_ds;
    /* decode, optional: 1 when pos0, the page table and the cells before
     * pos0 were written by work that finished before the call's stream
     * reaches it (copies, or kernels the stream completed before a copy):
     * the kernel may read them before the kernel ahead of it finishes */
    int settled;
    /* decode, optional (gpu_attn_takes_multi): the T queries of T
     * sequences, query t the last cell pos0[t] of its own sequence, whose
     * page table is kv.page_table + t·pt_stride (gpu_eval_batch) */
    int multi, pt_stride;
    /* with out_q: its layout, gpu_quant.h's gq_act_at (0: row after row) */
    int out_bt;
};

/* Device scratch one call needs at most, for H query heads, T queries,
 * max_cells cells, head dim E. */
size_t gpu_attn_scratch_bytes(int H, int T, int max_cells, int E);
/* gpu.cu: K and V rows (T, K*E) f32 of cells pos0..pos0+T-1 of `layer`,
 * converted to the cell format exactly as kv.c's kv_store converts them and
 * written to the pages (the cells exist: kv_append). */
int gpu_kv_store(const struct gpu_kv *kv, int layer, const int32_t *pos0, int T, const float *k,
                 const float *v, void *stream, char *err, size_t errlen);
/* Dense prompt attention: chunked online softmax over each query's cells. */
int gpu_attn_prompt(const struct gpu_attn *a, void *stream, char *err, size_t errlen);
/* Decode attention (T a few queries): cells split across blocks, merged by
 * log-sum-exp. Returns 1 where it wrote out_q too (a->out_q set and the
 * path can: dec16 on sm_80+), 0 where only out, -1 on error; so do the
 * QSA calls. */
int gpu_attn_decode(const struct gpu_attn *a, void *stream, char *err, size_t errlen);
/* QSA: the same over each query's selected cells. */
int gpu_attn_qsa_prompt(const struct gpu_attn *a, void *stream, char *err, size_t errlen);
int gpu_attn_qsa_decode(const struct gpu_attn *a, void *stream, char *err, size_t errlen);
/* Whether gpu_attn_decode takes a's T queries as one query of each of T
 * sequences (multi) in one call: sm_80+ with f16 or int8 cells. */
int gpu_attn_takes_multi(const struct gpu_attn *a);
/* The kernel the dispatch table picks for a call (for logs and tests). */
const char *gpu_attn_kernel_name(const struct gpu_attn *a, int decode, int qsa);
/* attn_cuda.cu, for test_gpu_attn.c (device memory: gpu_test_alloc below):
 * a device synchronisation (0 or -1), and ms per call of fn(arg) over reps
 * calls after one warm-up call, by events (< 0 on failure): the calls are
 * captured into a graph and replayed, as in a decode step (CUDA; on the
 * stream itself with STRATA_ATTN_BENCH_STREAM=1 and under HIP). */
int gpu_attn_test_sync(void);
double gpu_attn_test_time(int (*fn)(void *), void *arg, int reps);
#ifdef STRATA_TRACE
/* A measuring build's timeline (gpu_compat.h, GPU_TRACE): attn_cuda.cu's
 * ring of block records, read back (0 or the runtime's error). */
int gpu_attn_trace_copy(void *dst);
#endif

/* attn_hip.hip: the kernels without matrix cores, written for RDNA2 (wave32
 * warps, 128-thread blocks) and compiled by both toolchains. Under CUDA,
 * attn_cuda.cu's table picks them below sm_80 and on any card with
 * STRATA_ATTN_PRE75=1; under HIP, attn_hip.hip's own table (the gpu_attn_*
 * entry points above) picks them on gfx103x. */
int gpu_attn_prompt_rdna2(const struct gpu_attn *a, void *stream, char *err, size_t errlen);
int gpu_attn_decode_rdna2(const struct gpu_attn *a, void *stream, char *err, size_t errlen);
int gpu_attn_qsa_prompt_rdna2(const struct gpu_attn *a, void *stream, char *err, size_t errlen);
int gpu_attn_qsa_decode_rdna2(const struct gpu_attn *a, void *stream, char *err, size_t errlen);
/* The scratch the two split launchers above need (partials of up to 32
 * partitions, fewer for long T): gpu_attn_scratch_bytes must return at
 * least this. The other two need none. */
size_t gpu_attn_rdna2_scratch_bytes(int H, int T, int max_cells, int E);
/* For test_gpu_rdna2.c: a call whose pointers are HOST arrays (n_pages pages,
 * a table of max_pages, q and out (T, H*E), one pos0, sel (sel_off[T]) and
 * sel_off (T+1) or NULL; scratch ignored) copied to the device; runs entry
 * `which` (0..3: the four launchers above; 4..7: gpu_attn_prompt, _decode,
 * _qsa_prompt, _qsa_decode) once on a poisoned (NaN) output, copies it to
 * host->out, then times reps more calls: *ms per call (events). */
int gpu_attn_rdna2_test(const struct gpu_attn *host, int n_pages, int max_pages, int which, int reps, float *ms,
                        char *err, size_t errlen);

/* Prompt matrix product: y (T, rows) f32, row stride ldy floats, =
 * x (T, n) f32 · Wᵀ, W `rows` rows of n elements of block type `type`, ldw
 * bytes each (dev, as in the GGUF file). scratch: gpu_gemm_scratch_bytes. */
size_t gpu_gemm_scratch_bytes(int type, int n, int rows, int T);
int gpu_gemm(int type, const void *w, size_t ldw, int n, int rows, const float *x, int T, float *y,
             size_t ldy, void *scratch, void *stream, char *err, size_t errlen);
/* Grouped products (a prompt's MoE experts), one launch: rows offs[e] ..
 * offs[e+1] - 1 of x (T, n) times matrix e, at w + e·estride bytes (X
 * matrices of `rows` rows), into the same rows of y. offs (X + 1 entries,
 * offs[X] <= T) lives on the device and may come from a kernel ahead on the
 * stream: the host never waits for it. Rows from offs[X] are not written.
 * Numerics as gpu_gemm's own kernels (no vendor gemm). scratch:
 * gpu_gemm_experts_scratch_bytes. */
int gpu_gemm_experts(int type, const void *w, size_t ldw, size_t estride, int n, int rows, const float *x, int T,
                     const int32_t *offs, int X, float *y, size_t ldy, void *scratch, void *stream, char *err,
                     size_t errlen);
size_t gpu_gemm_experts_scratch_bytes(int n, int T);
/* Whether gpu_gemm takes this block type (the others stay on gpu_mv.cu's
 * matrix-vector kernels). */
int gpu_gemm_supports(int type);
/* gpu_gemm.cu: y (rows, n) f32, row stride ldy floats, = W's rows dequantised
 * by gpu_quant.h (bit-equal to quant.c's to_f32; e.g. embedding lookups). */
int gpu_dequant(int type, const void *w, size_t ldw, int n, int rows, float *y, size_t ldy,
                void *stream, char *err, size_t errlen);
/* gpu_gemm.cu, for tests and benchmarks (synchronous, current device; memory
 * from gpu_test_alloc below): a byte fill (-1 on failure), and the median
 * milliseconds of reps gpu_gemm calls on the default stream, each timed by
 * events (< 0: error). */
int gpu_gemm_test_fill(void *dev, int byte, size_t bytes);
double gpu_gemm_test_ms(int type, const void *w, size_t ldw, int n, int rows, const float *x, int T,
                        float *y, size_t ldy, void *scratch, int reps, char *err, size_t errlen);

/* gpu.cu, for the GPU tests (C files that see no runtime API): device
 * memory and synchronous copies (to_host: device→host, else host→device). */
void *gpu_test_alloc(size_t bytes);
void gpu_test_free(void *p);
int gpu_test_copy(void *dst, const void *src, size_t bytes, int to_host);
/* the device's SMs (compute units) */
int gpu_test_sms(void);
/* y (T, rows) = rows of w (host: `type` blocks, ldw bytes each) · a (T, n),
 * through the forward pass's matrix-vector kernels (T == 1: the decode
 * kernel; more: the batched one), the activations formed and quantised on
 * the device as the pass does: a = x (PLAIN), RMSNorm(x, eps 1e-6)·b with b
 * n weights (NORM), silu(x)·b with b (T, n) (SWIGLU). Host buffers. With
 * GPU_TEST_ROWS added to the mode the batch kernel reads the activation
 * row after row, as it does beside a product of another type, rather than
 * in the layout the pass gives it alone. GPU_TEST_SHIFT4 / SHIFT8 place
 * the matrix 4 / 8 bytes past a 16-aligned address (as no upload does: a
 * kernel's paths for less aligned rows). */
enum { GPU_TEST_PLAIN, GPU_TEST_NORM, GPU_TEST_SWIGLU, GPU_TEST_ROWS = 8, GPU_TEST_SHIFT4 = 16, GPU_TEST_SHIFT8 = 32 };
int gpu_test_matvec(int type, const void *w, size_t ldw, int n, int rows, const float *x, int T, int mode,
                    const float *b, float *y, char *err, size_t errlen);
/* y (P, rows) = a prompt's experts as the pass runs them in gf_mvx_kernel:
 * the activation rows offs[e] .. offs[e+1] - 1 of x (P = offs[X] rows, n
 * wide, quantised on the device) against matrix e of w (host: X matrices
 * of `rows` rows, ldw bytes each, one after another). Host buffers. 1 (err
 * says why) where the kernel does not take the type or the device. */
int gpu_test_experts(int type, const void *w, size_t ldw, int n, int rows, int X, const float *x, const int32_t *offs,
                     float *y, char *err, size_t errlen);
/* Microseconds per product of `rows` rows of n columns of a quantised type
 * (hashed bytes) with T activation rows (1: a decode step; up to 16: a
 * batch step), as the pass runs it (the activation quantised too): the
 * median of 5 batches of reps calls queued back to back, the weights
 * rotated through copies larger than L2 (< 0: error). */
double gpu_test_mv_us(int type, int n, int rows, int T, int reps, char *err, size_t errlen);
/* One pass over the n tokens at cells pos .. pos + n - 1 (the sequence's
 * last; n = 1: a decode step) run without the graph after a pause that lets
 * every launch queue up, with an event after each stage: out gets "step N
 * us: stage us ..." summed over the layers. */
int gpu_test_profile(struct gpu_ctx *c, int seq, const int32_t *tokens, int n, int pos, char *out, size_t cap,
                     char *err, size_t errlen);

#ifdef __cplusplus
}
#endif
#endif
