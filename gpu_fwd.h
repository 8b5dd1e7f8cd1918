/*
 * gpu_fwd.h — what the GPU forward pass's three files share (gf_*: gpu.cu,
 * the pass and its small kernels; gpu_mv.cu, the weight products of one
 * row and their dispatch; gpu_mma.cu, the tensor-core products of 2..16
 * rows and of a prompt's MoE experts): the device helpers every kernel
 * uses, a product's launch record (gf_mv), the model and context structs,
 * the launch helpers, and the functions one file calls in another. Not a
 * public interface: gpu.h is that. Compiled by nvcc and hipcc.
 */
#ifndef STRATA_GPU_FWD_H
#define STRATA_GPU_FWD_H

#include "gpu.h"
#include "gpu_compat.h"
#include "gpu_quant.h"

#include <math.h>
#include <stdlib.h>
#include <string.h>
#include <type_traits>

#define GF_AB 32          /* activation block: int8 codes with one scale */
#define GF_ACT_SLACK 32   /* rows past c->aq's and c->ads's last (gf_act_alloc; gf_act_src reads them) */
#define GF_DECODE_T 16    /* up to this many tokens take the decode attention */
#define GF_MMA_T 16       /* gf_matmul_n's nt for the tensor-core products (gpu_mma.cu): up to 16 rows, one group */

/* One activation block's scales: x = d (the f16-rounded scale, as quant.c's
 * Q8_0/Q8_1 store it), y = Q8_1's s (f16 of d·Σq), z = Σq. */
typedef float4 gf_ads;

/* ==== device helpers ==== */

/* Every kernel of the forward pass is launched with programmatic dependent
 * launch (gf_launch) and starts here: it lets the next kernel launch, then
 * waits until the kernel ahead has finished and its writes show (before any
 * load or store: the one ahead may still read what this one overwrites).
 * The next kernel's wait still waits for this one to finish, and this one
 * for the one ahead, so letting it launch first is safe; its blocks then
 * take SMs as the kernel ahead's retire, and a matrix-vector kernel's weight
 * loads, which wait for nothing, fill the tail of the one ahead and the
 * small kernels between (+1.5% in decode against waiting first, BENCH.md). */
static __device__ __forceinline__ void gf_pdl_begin()
{
    gpu_grid_launch_dependents();
    gpu_grid_wait();
}

static __device__ __forceinline__ float gf_h2f(uint16_t h) { return __half2float(__ushort_as_half(h)); }
static __device__ __forceinline__ uint16_t gf_f2h(float f) { return __half_as_ushort(__float2half_rn(f)); }
static __device__ __forceinline__ uint16_t gf_ld16(const uint8_t *p) { return *(const uint16_t *)p; }
/* 4 bytes at a 2-aligned address (the blocks of 18, 22, 34, 210 bytes) */
static __device__ __forceinline__ int gf_ld32h(const uint8_t *p)
{
    const uint16_t *q = (const uint16_t *)p;
    return (int)((uint32_t)q[0] | (uint32_t)q[1] << 16);
}
/* bits 0..3 of h to bit 4 of bytes 0..3 */
static __device__ __forceinline__ int gf_bit4(uint32_t h)
{
    return (int)(((h & 1) << 4) | ((h & 2) << 11) | ((h & 4) << 18) | ((h & 8) << 25));
}

/* Sub-block j's 6-bit scale and min of a K-quant block (quant.c's
 * get_scale_min_k4) from its 12 scale bytes, byte k as s(k): read from
 * memory, or from the bytes in registers (gf_mvxh_kernel) */
template <class S>
static __device__ __forceinline__ void gf_k4_sm(int j, S s, int *sc, int *m)
{
    if (j < 4) {
        *sc = s(j) & 63;
        *m = s(j + 4) & 63;
    } else {
        *sc = (s(j + 4) & 15) | (s(j - 4) >> 6) << 4;
        *m = (s(j + 4) >> 4) | (s(j) >> 6) << 4;
    }
}

static __device__ __forceinline__ void gf_k4_scale_min(int j, const uint8_t *s, int *sc, int *m)
{
    gf_k4_sm(j, [s](int k) { return (int)s[k]; }, sc, m);
}

/* a weight byte read once: evict it first (the activation stays in L1) */
static __device__ __forceinline__ int4 gf_ld_stream(const int4 *p)
{
#ifdef GPU_CUDA
    return __ldcs(p);
#else
    return *p;
#endif
}

/* Q4_K: unit p (of 4) is the sub-block pair 2p, 2p+1: 32 bytes of nibbles,
 * low for sub-block 2p, high for 2p+1. The header h (d, dmin, twelve 6-bit
 * scale bytes) is read as four words and the pair's two scales and mins are
 * cut out of them with shifts and masks, the same for every p (selects, no
 * branch that splits a warp; quant.c's get_scale_min_k4). The product of a
 * unit's scales (low byte sub-block 2p, high byte 2p+1) and mins: */
static __device__ __forceinline__ void gf_q4k_scales(int4 h, int p, uint32_t *sc, uint32_t *mn)
{
    int sh = 16 * (p & 1);
    uint32_t a0 = (uint32_t)h.y >> sh, a1 = (uint32_t)h.z >> sh, a2 = (uint32_t)h.w >> sh;
    *sc = p >= 2 ? (a2 & 0x0f0f) | ((a0 >> 2) & 0x3030) : a0 & 0x3f3f;
    *mn = p >= 2 ? ((a2 >> 4) & 0x0f0f) | ((a1 >> 2) & 0x3030) : a1 & 0x3f3f;
}

/* four IQ4 codes (the low nibbles of v's bytes) as the grid's signed values
 * (quant.c's kvalues_iq4nl), packed: entries 0..7 and 8..15 each picked by a
 * byte permute, then chosen by the code's top bit */
static __device__ __forceinline__ int gf_iq4_vals(unsigned v)
{
    unsigned sel = (v & 7) | (v >> 4 & 0x70) | (v >> 8 & 0x700) | (v >> 12 & 0x7000);
    unsigned lo = __byte_perm(0xBFAD9881u, 0xF6EADDCFu, sel), hi = __byte_perm(0x26190D01u, 0x71594535u, sel);
    unsigned m = (v >> 3 & 0x01010101u) * 0xFFu;
    return (int)((lo & ~m) | (hi & m));
}

/* the few-rows kernel's block (gf_mvrow_kernel; gf_norm_router_kernel sums a
 * logit in its layout) */
#define GF_ROW_THREADS 256

/* The sum of acc over a block of THREADS threads, each warp's sum added
 * in warp order, for every thread (all call it, once a kernel: part is
 * not guarded for reuse). */
template <int THREADS>
static __device__ __forceinline__ float gf_block_sumf(float acc)
{
    __shared__ float part[THREADS / GPU_WARP];
    acc = warp_sum(acc);
    if (threadIdx.x % GPU_WARP == 0)
        part[threadIdx.x / GPU_WARP] = acc;
    __syncthreads();
    float sum = part[0];
    for (int i = 1; i < THREADS / GPU_WARP; i++)
        sum += part[i];
    return sum;
}

/* RMSNorm's arithmetic, one definition for the kernels that form it, so
 * that they agree bit for bit: a float4's squares in double, added in this
 * order (the reference's steps); the row's scale from their sum; elements
 * times scale, times weight. */
static __device__ __forceinline__ double gf_sq4(float4 v)
{
    return (double)__fmul_rn(v.x, v.x) + (double)__fmul_rn(v.y, v.y) + (double)__fmul_rn(v.z, v.z) +
           (double)__fmul_rn(v.w, v.w);
}

static __device__ __forceinline__ float gf_rms_scale(double ss, int n, float eps)
{
    return 1.0f / sqrtf((float)(ss / n) + eps);
}

/* ==== a product's launch record ==== */

/* y = W · a for groups of activation rows: group g (blockIdx.y) multiplies
 * matrix ids[g] of a stack (ids NULL: the one matrix) by activation rows
 * (g / a_div) * a_g + t for t < min(NT, t_total - g*NT), writing
 * y[g*y_g + t*y_t + r] (+ bias[r]) (+ the old y[...] when accumulate).
 * Up to GF_PARTS matrices of one type and width (Q, K and V; gate and up)
 * share a launch: rows [end[i-1], end[i]) are matrix i's, each with its own
 * weights, output, strides and bias. */
#define GF_PARTS 3
struct gf_mv {
    const uint8_t *w[GF_PARTS];
    int end[GF_PARTS];
    float *y[GF_PARTS];
    size_t y_g[GF_PARTS], y_t[GF_PARTS];
    const float *bias[GF_PARTS];
    int parts;
    size_t ldw, estride;
    int n;
    const int32_t *ids;
    const int8_t *aq;       /* (rows, n) codes */
    const gf_ads *ads;      /* (rows, n/32) */
    int bt;                 /* their layout: gq_act_at's (0 but for gf_mvq_kernel) */
    const float *af;        /* (rows, n) f32, for float weights */
    int a_div, a_g, t_total;
    int accumulate;
    /* An RMSNorm handed across a product boundary (one-token Q4_K
     * products in gf_mvk_kernel, BENCH.md twenty-fourth pass): a product
     * into x with nw set runs each GF_AB rows on one block, which writes
     * them as the next norm's int8 block of x·nw (unscaled: the norm's
     * scale is one factor of the whole row) into nq/nds and their squares'
     * sum into nss[block]; the product that reads it (ss set) multiplies
     * each row's sum by the scale formed from those ss_n sums, so no
     * activation kernel runs between the two. */
    const float *nw;
    int8_t *nq;
    gf_ads *nds;
    float *nss;
    const float *ss;
    int ss_n;
    float eps;
    /* Experts side by side (ne > 0, one-row groups): group g's activation
     * row is its U = n/ne experts' rows one after the other, ne columns
     * each; columns [e·ne, (e+1)·ne) meet row r of expert ids[g·U + e] (one
     * part, estride apart) weighted by sw[g·U + e], so y[g·y_g + r] is the
     * weighted sum of the U experts' rows r (a MoE's down product and its
     * weighted sum in one). */
    int ne;
    const float *sw;
    int pair;   /* a norm-handing product's blocks in pairs (gf_pair_meet) */
};

/* row r of a launch's rows: its matrix (the part) and its row in it */
static __device__ __forceinline__ int gf_mv_part(const gf_mv &p, int r, int *rr)
{
    int pt = r < p.end[0] ? 0 : r < p.end[1] ? 1 : 2;
    *rr = r - (pt ? p.end[pt - 1] : 0);
    return pt;
}

/* where row rr of part pt goes for group g, token t: y[g·y_g + t·y_t + rr] */
static __device__ __forceinline__ float *gf_mv_at(const gf_mv &p, int pt, int g, int t, int rr)
{
    return p.y[pt] + (size_t)g * p.y_g[pt] + (size_t)t * p.y_t[pt] + rr;
}

/* *yp = s (+ bias) (+ old: the y there, read before, when accumulating);
 * returns what it stored */
static __device__ __forceinline__ float gf_mv_store(const gf_mv &p, int pt, int rr, float *yp, float s, float old)
{
    if (p.bias[pt])
        s = s + p.bias[pt][rr];
    if (p.accumulate)
        s = s + old;
    *yp = s;
    return s;
}

static __device__ __forceinline__ void gf_mv_put(const gf_mv &p, int pt, int g, int t, int rr, float s)
{
    float *yp = gf_mv_at(p, pt, g, t, rr);
    gf_mv_store(p, pt, rr, yp, s, p.accumulate ? *yp : 0.0f);
}

/* ==== host side ==== */

enum { GF_ACT_PLAIN, GF_ACT_NORM, GF_ACT_SWIGLU };   /* gf_act's modes */

struct gf_mat {
    const uint8_t *d;   /* dev */
    int type, n, rows;
    size_t ldw, stride;
};

struct gf_layer {
    const float *attn_norm, *bq, *bk, *bv, *bo, *q_norm, *k_norm, *ffn_norm; /* dev */
    struct gf_mat wq, wk, wv, wo, gate, up, down, gate_inp, gate_exps, up_exps, down_exps;
    int moe;
};

struct gpu_model {
    struct model_hp hp;
    struct gf_layer *layers;
    struct gf_mat tok_embd, output;
    const float *output_norm, *output_b, *rope_freqs;
    float freq_scale;
    uint8_t *mem;        /* dev: everything */
    size_t bytes;
};

struct gpu_ctx {
    struct gpu_model *g;
    struct kv *kv;
    int T, MU, max_cells, max_pages, gemm_ok;
    gpuStream_t stream;
    float *x, *xn, *tmp, *q, *k, *v, *ao, *gt, *up, *eo, *router, *selw, *logits;
    int8_t *aq;
    gf_ads *ads;
    int abt;               /* the layout aq and ads were last written in (gq_act_at's bt: gf_act_bt) */
    /* a norm handed from a product into x to the products after it
     * (gf_mv.nw; gf_hand_begin): x·w's int8 blocks, the squares' sums
     * a block of 32; hand_w, the norm's weights while the product is
     * queued; handed, until its readers are */
    int8_t *nq;
    gf_ads *nds;
    float *nss;
    const float *hand_w;
    int handed;
    int32_t *sel, *io;     /* io: tokens (T), pos0 (1), page table (max_pages), then for a batch of
                              sequences (gpu_eval_batch) a position a row (B) and a page table a row
                              (B, max_pages): gf_rows */
    int32_t *order, *offs; /* a prompt's (token, expert) pairs sorted by expert (gf_moe_sort_kernel) */
    float *rope_cs;        /* (T, n_rot): a pass's RoPE cosines and sines (gf_rope_kernel) */
    int32_t *rope_pg;      /* (T): each token's page */
    float *xs;             /* (T·U, D): the pairs' rows in that order */
    int32_t *io_host;      /* pinned */
    float *lg_host;        /* pinned (1 + B, V): one row's logits, then a batch step's rows */
    float *lg_dev;         /* lg_host's device address, where the head writes those (NULL: none) */
    void *attn_scratch, *gemm_scratch;
    size_t gemm_scratch_bytes;
    int B;                 /* the most sequences of a batch step: min(T, GF_DECODE_T) */
    int rows;              /* the pass in progress takes one sequence a row (gpu_eval_batch) */
    /* the decode step of n rows (1: one sequence, 2..B: a batch) as a graph */
    gpuGraphExec_t graph[GF_DECODE_T + 1];
    int graph_state[GF_DECODE_T + 1]; /* 0 none yet, 1 captured, -1 capture failed: run directly */
    struct gf_prof *prof;  /* gpu_test_profile's events, else NULL */
};

/* ---- launches ---- */

#define GF_LAUNCH_CHECK(err, errlen) GPU_TRY(gpuGetLastError(), err, errlen)

static inline int gf_env(const char *name)
{
    const char *v = getenv(name);
    return v && *v && strcmp(v, "0") != 0;
}


/* Launches kernel k with programmatic dependent launch where the device has
 * it (sm_90+; STRATA_GPU_NO_PDL=1 turns it off) and the kernel starts with
 * gf_pdl_begin; a plain launch elsewhere. */
#ifdef GPU_CUDA
static inline int gf_pdl_ok(void)
{
    static int ok = -1;   /* one device per process: decided at the first launch */
    int arch = 0, sms = 0;
    if (ok < 0)
        ok = gpu_device_facts(&arch, &sms) == gpuSuccess && arch >= 90 && !gf_env("STRATA_GPU_NO_PDL");
    return ok;
}
#endif

template <typename... P, typename... A>
static void gf_launch(void (*k)(P...), dim3 grid, dim3 block, size_t smem, gpuStream_t s, A... args)
{
#ifdef GPU_CUDA
    (void)gpu_launch(k, grid, block, smem, s, gf_pdl_ok(), args...);   /* an error shows in gpuGetLastError */
#else
    (void)gpu_launch(k, grid, block, smem, s, 0, args...);
#endif
}

/* the device's SMs (0 if the query fails) */
static inline int gf_sms(void)
{
    int arch = 0, sms = 0;
    return gpu_device_facts(&arch, &sms) == gpuSuccess ? sms : 0;
}

/* One output of gf_matmul_n: y (T, w->rows), row stride ldy, (+ bias). */
struct gf_out {
    const struct gf_mat *w;
    float *y;
    size_t ldy;
    const float *bias;
};

/* ==== across the files (each one's contract at its definition) ==== */

/* gpu.cu */
int gf_act(gpuStream_t s, int mode, const float *x, const float *x2, const float *w, float eps, int n, int T, int bt,
           float *yf, int8_t *q, gf_ads *ds, char *err, size_t errlen);
__global__ void gf_add_kernel(float *x, const float *y, const float *b, int n, size_t total);

/* gpu_mv.cu */
int gf_act_bt(const struct gf_out *o, int n_out, int T);
int gf_matmul_n(struct gpu_ctx *c, const struct gf_out *o, int n_out, const float *af, int T, int accumulate,
                char *err, size_t errlen);
int gf_matmul_experts(struct gpu_ctx *c, const struct gf_mat *const *w, float *const *y, int n_w, const float *af,
                      int a_div, int n_groups, char *err, size_t errlen);
int gf_down_experts_sum(struct gpu_ctx *c, const struct gf_mat *dn, int T, int U, char *err, size_t errlen);
int gf_hand_takes(int type, int n, int ne);

/* gpu_mma.cu */
int gf_mma_launch(int type, const gf_mv &p, gpuStream_t s);
int gf_mvq_units(int type, int n);
int gf_mvq_takes(int type, int n, int T);
int gf_mvx_takes(const struct gf_mat *const *w, int n_w, int n, int X);
int gf_mvxh_takes(const struct gf_mat *const *w, int n_w);
int gf_mvx(struct gpu_ctx *c, const struct gf_mat *const *w, float *const *y, int n_w, size_t ldy, int n,
           const float *xf, char *err, size_t errlen);

#endif
