/*
 * gpu_gemm.cu — prompt matrix products on the GPU: y (T, rows) = x (T, n) · Wᵀ
 * with W kept in its GGUF block format and dequantised inside the kernel
 * (gpu_quant.h), for every type gq_supported lists.
 *
 * One choice (gg_run) among three paths: from 64 tokens, where the CUDA
 * toolkit's cuBLAS can be loaded at run time, W dequantised to f16 and
 * cuBLAS's gemm (gg_blas_run); else on sm_80+ (CUDA) tensor cores, mma.sync
 * m16n8k16 with f16 inputs and f32 accumulation — the activations rounded to
 * f16 once into the caller's scratch, the raw weight blocks streamed into
 * shared memory and dequantised there to f16 tiles, four k-tiles in flight,
 * split along k (partials in the scratch, summed in a fixed order) when the
 * grid is too small to fill the device; elsewhere (older cards,
 * HIP, shapes the mma kernel does not tile, or STRATA_GEMM_PORTABLE=1) a
 * tiled f32 kernel without matrix units. gpu_gemm_experts runs many
 * matrices' products in one launch of the same kernels (a prompt's MoE
 * experts, each over its own rows; gg_groups). Must not: allocate, synchronise, or
 * keep state between calls (so gpu.cu can capture the launches in a graph),
 * but for the cuBLAS handle, made once per process.
 * Shapes: T tokens (x rows), n the shared dimension, rows the weight rows.
 * Numerics of the cuBLAS and mma paths: f16 activations and weights
 * (relative rounding 2^-11 each; the mma kernel's K-quant weights also
 * carry one factor rounded to f16: Q6_K's d·scale, Q4_K's and Q5_K's
 * dmin·min), f32 sums; |x| and |w| must stay below f16's 65504.
 */
#include <limits.h>
#include <stdlib.h>

#include "gpu.h"
#include "gpu_compat.h"
#include "gpu_quant.h"
#ifdef GPU_CUDA
#include <cublas_v2.h>
#include <dlfcn.h>
#include <pthread.h>
#endif

#define GG_BK 32        /* k per shared tile */
#define GG_THREADS 256

/* ==== weight chunks: 16 elements of a row, zero past n ==== */

/* Blocked types have n a multiple of their block (>= 32), so only the float
 * types (block 1) can end inside a tile; the padding reads as 0 so that it
 * meets the zero-padded activations without NaN. */
template <int TYPE>
static __device__ __forceinline__ void gg_wchunk(const uint8_t *row, int i16, int n, float f[16])
{
    if (16 * i16 + 16 <= n) {
        gq_dequant16(TYPE, row, i16, f);
        return;
    }
#pragma unroll
    for (int j = 0; j < 16; j++) {
        int k = 16 * i16 + j;
        float v = 0.f;
        if (k < n) {
            if (TYPE == QT_F32)
                v = ((const float *)row)[k];
            else if (TYPE == QT_F16)
                v = __half2float(__ushort_as_half(((const unsigned short *)row)[k]));
            else if (TYPE == QT_BF16)
                v = __uint_as_float((unsigned)((const unsigned short *)row)[k] << 16);
        }
        f[j] = v;
    }
}

/* One thread per 16 elements: y (rows, n) = W dequantised, as f32 or, for
 * the vendor gemm (gg_blas_run), f16 rounded to nearest (two 16-byte stores
 * a thread: ldy a multiple of 16 there). */
static __device__ __forceinline__ void gg_store16(float *dst, const float f[16], int m)
{
    for (int j = 0; j < m; j++)
        dst[j] = f[j];
}

#ifdef GPU_CUDA /* (the vendor gemm is CUDA's) */
static __device__ __forceinline__ void gg_store16(__half *dst, const float f[16], int m)
{
    if (m < 16) {
        for (int j = 0; j < m; j++)
            dst[j] = __float2half_rn(f[j]);
        return;
    }
    __half2 h[8];
#pragma unroll
    for (int j = 0; j < 8; j++)
        h[j] = __floats2half2_rn(f[2 * j], f[2 * j + 1]);
    ((int4 *)dst)[0] = *(const int4 *)&h[0];
    ((int4 *)dst)[1] = *(const int4 *)&h[4];
}
#endif

template <int TYPE, class O>
__global__ void gg_dequant(const uint8_t *w, size_t ldw, int n, int rows, O *y, size_t ldy)
{
    int c16 = (n + 15) / 16;
    size_t i = (size_t)blockIdx.x * blockDim.x + threadIdx.x;
    if (i >= (size_t)rows * c16)
        return;
    int r = (int)(i / c16), i16 = (int)(i % c16);
    float f[16];
    gg_wchunk<TYPE>(w + (size_t)r * ldw, i16, n, f);
    gg_store16(y + (size_t)r * ldy + 16 * i16, f, min(16, n - 16 * i16));
}

/* ==== groups: one launch for many matrices (gpu_gemm_experts) ====
 * x's rows come in X groups, group e the rows offs[e] .. offs[e+1] - 1 (offs
 * on the device, written by a kernel ahead: the host never reads it), each
 * multiplied by its own matrix at w + e·estride into the same rows of y.
 * blockIdx.y counts the groups' tiles of bm rows in group order; the grid
 * has room for the most tiles any offsets give (T / bm + X), and blocks
 * past the last tile return at once. */
struct gg_groups {
    const int32_t *offs; /* NULL: one matrix, blockIdx.y the tile of the T rows */
    int X;
    size_t estride;
};

static int gg_group_tiles(const gg_groups &gr, int T, int bm)
{
    return (T + bm - 1) / bm + (gr.offs ? gr.X : 0);
}

/* The first row of this block's tile within its group, with w, x, y and T
 * moved to the group; -1 for a block past the last tile. */
template <class XT>
static __device__ __forceinline__ int gg_group(const gg_groups &gr, int bm, int n, const uint8_t **w,
                                               const XT **x, float **y, size_t ldy, int *T)
{
    if (!gr.offs)
        return blockIdx.y * bm;
    int t = blockIdx.y;
    for (int e = 0; e < gr.X; e++) {
        int r0 = gr.offs[e], m = gr.offs[e + 1] - r0, tiles = (m + bm - 1) / bm;
        if (t < tiles) {
            *w += e * gr.estride;
            *x += (size_t)r0 * n;
            *y += (size_t)r0 * ldy;
            *T = m;
            return t * bm;
        }
        t -= tiles;
    }
    return -1;
}

/* ==== portable tiled kernel: f32, no matrix units ==== */

#define GG_TM 64 /* tokens per block */
#define GG_TN 64 /* weight rows per block */

/* Each of the 256 threads sums 4 tokens x 4 rows (strided by 16, so the
 * shared reads of a warp are broadcasts or consecutive words). */
template <int TYPE>
__global__ void __launch_bounds__(GG_THREADS) gg_tiled(const uint8_t *w, size_t ldw, int n, int rows,
                                                       const float *x, int T, float *y, size_t ldy, gg_groups gr)
{
    __shared__ float xs[GG_BK][GG_TM + 1]; /* (k, token) */
    __shared__ float ws[GG_BK][GG_TN + 1]; /* (k, weight row) */
    int tid = threadIdx.x, tx = tid & 15, ty = tid >> 4;
    int m0 = gg_group(gr, GG_TM, n, &w, &x, &y, ldy, &T), n0 = blockIdx.x * GG_TN;
    if (m0 < 0)
        return;
    float acc[4][4] = {};
    for (int k0 = 0; k0 < n; k0 += GG_BK) {
        for (int e = tid; e < GG_TM * GG_BK; e += GG_THREADS) {
            int r = e / GG_BK, k = e % GG_BK;
            xs[k][r] = m0 + r < T && k0 + k < n ? x[(size_t)(m0 + r) * n + k0 + k] : 0.f;
        }
        if (tid < GG_TN * 2) {
            int r = tid >> 1, h = tid & 1;
            float f[16];
            gg_wchunk<TYPE>(w + (size_t)min(n0 + r, rows - 1) * ldw, k0 / 16 + h, n, f);
#pragma unroll
            for (int j = 0; j < 16; j++)
                ws[16 * h + j][r] = f[j];
        }
        __syncthreads();
#pragma unroll 8
        for (int k = 0; k < GG_BK; k++) {
            float a[4], b[4];
#pragma unroll
            for (int i = 0; i < 4; i++) {
                a[i] = xs[k][ty + 16 * i];
                b[i] = ws[k][tx + 16 * i];
            }
#pragma unroll
            for (int i = 0; i < 4; i++)
#pragma unroll
                for (int j = 0; j < 4; j++)
                    acc[i][j] += a[i] * b[j];
        }
        __syncthreads();
    }
#pragma unroll
    for (int i = 0; i < 4; i++)
#pragma unroll
        for (int j = 0; j < 4; j++) {
            int t = m0 + ty + 16 * i, r = n0 + tx + 16 * j;
            if (t < T && r < rows)
                y[(size_t)t * ldy + r] = acc[i][j];
        }
}

/* ==== tensor-core kernel (CUDA sm_80+) ==== */

#ifdef GPU_CUDA
#define GG_LD 40  /* halves per shared row of a k-tile: 32 + 8 of padding, so rows are
                     80 bytes apart and the 8 row addresses of an ldmatrix hit 8
                     distinct bank quads */
#define GG_BN 128 /* weight rows per block */

/* The file layout of each type, as quant.c's table has it (checked against
 * quant_type() on the host before a launch). */
static __host__ __device__ constexpr int gg_blck(int t)
{
    return t == QT_F32 || t == QT_F16 || t == QT_BF16 ? 1
           : t == QT_Q4_0 || t == QT_Q4_1 || t == QT_Q5_0 || t == QT_Q5_1 || t == QT_Q8_0 || t == QT_Q8_1 ||
                   t == QT_IQ4_NL
               ? 32
               : 256;
}

/* A weight row is staged in "supersteps" of gg_sup elements (one K-quant
 * super-block, eight 32-blocks, or 32 floats): gg_rb bytes, copied as 4-byte
 * words from the aligned-down start (rows may begin at any even address), so
 * gg_upr words cover it; gg_rs words per shared row, odd so that the rows a
 * warp decodes sit in distinct banks. */
static __host__ __device__ constexpr int gg_sup(int t) { return gg_blck(t) == 1 ? 32 : 256; }
static __host__ __device__ constexpr int gg_rb(int t) { return gg_sup(t) / gg_blck(t) * gq_bsize(t); }
static __host__ __device__ constexpr int gg_upr(int t) { return (gg_rb(t) + 3) / 4 + 1; }
static __host__ __device__ constexpr int gg_rs(int t) { return gg_upr(t) | 1; }
/* The alignment gg_mma asks of w, ldw and an expert's stride: 4 where a
 * superstep is whole words, else 2 (Q6_K's 210 bytes, Q3_K's and the
 * lattices'), as their rows of an odd count of supersteps (the 30B-A3B's
 * 768-wide down experts, 630 bytes in Q6_K) start 2 bytes off a word every
 * other row. */
static __host__ __device__ constexpr int gg_al(int t) { return gg_rb(t) % 4 == 0 ? 4 : 2; }

/* x (T, n) f32 -> xh (T, n) f16 (the mma kernel's A), pairs = T * n / 2. */
__global__ void gg_to_half(const float2 *x, size_t pairs, __half2 *xh)
{
    size_t i = (size_t)blockIdx.x * blockDim.x + threadIdx.x;
    if (i < pairs)
        xh[i] = __float22half2_rn(x[i]);
}

#if defined(__CUDA_ARCH__) && __CUDA_ARCH__ >= 800
static __device__ __forceinline__ unsigned gg_smem(const void *p)
{
    return (unsigned)__cvta_generic_to_shared(p);
}

/* 16 bytes global -> shared, asynchronous (both 16-byte aligned). */
static __device__ __forceinline__ void gg_cp16(void *dst, const void *src)
{
    asm volatile("cp.async.cg.shared.global [%0], [%1], 16;\n" ::"r"(gg_smem(dst)), "l"(src));
}

/* 4 bytes global -> shared, of which the first `bytes` are read and the rest
 * zero-filled (no read past a row's last block). */
static __device__ __forceinline__ void gg_cp4(void *dst, const void *src, int bytes)
{
    asm volatile("cp.async.ca.shared.global [%0], [%1], 4, %2;\n" ::"r"(gg_smem(dst)), "l"(src), "r"(bytes));
}

static __device__ __forceinline__ void gg_ldm4(unsigned r[4], const void *p)
{
    asm volatile("ldmatrix.sync.aligned.m8n8.x4.shared.b16 {%0,%1,%2,%3}, [%4];\n"
                 : "=r"(r[0]), "=r"(r[1]), "=r"(r[2]), "=r"(r[3])
                 : "r"(gg_smem(p)));
}

/* ---- K-quant and Q8_0 chunks for gg_mma: f16 weights straight from the bits ----
 * A 16-bit lane holding 0x6400 | u (u < 1024) is the half 1024 + u; its u
 * comes from bytes placed in the lane by a byte permute (lanes 0, 1 of the
 * word from bytes 2k, 2k + 1: gg_lanes). Then one subtraction gives the code
 * as an exact half (less Q6_K's 32 or Q8_0's 128, folded into the constant;
 * for Q4_K and Q5_K one fma gives code·scale) and an fma or product the
 * weight. A thread's chunks of a k-tile lie in one
 * 32-element sub-block, so the factors are formed once a k-tile (Q4_K, Q5_K,
 * Q8_0). Against gq_dequant16 (f32, then rounded to f16): Q8_0 the same bits
 * (d·q is exact before the one rounding); Q6_K's d·scale is rounded to f16
 * first; Q4_K and Q5_K form code·scale·d exactly and round dmin·min to f16
 * first, so a weight near zero, where the two cancel, carries 2^-12 of
 * dmin·min (BENCH.md, forty-fifth and forty-sixth passes). */
static __device__ __forceinline__ __half2 gg_h2(unsigned u)
{
    __half2 h;
    memcpy(&h, &u, 4);
    return h;
}

static __device__ __forceinline__ unsigned gg_u(__half2 h)
{
    unsigned u;
    memcpy(&u, &h, 4);
    return u;
}

/* bytes 2k and 2k + 1 of w in the low bytes of its two 16-bit lanes */
static __device__ __forceinline__ unsigned gg_lanes(unsigned w, int k)
{
    return __byte_perm(w, 0, k ? 0x4342 : 0x4140);
}

/* word i of bytes that start sh8 / 8 bytes into the aligned words a (the
 * word past them is in the raw row: gg_upr's extra word) */
static __device__ __forceinline__ unsigned gg_w2(const unsigned *a, int i, int sh8)
{
    return __funnelshift_r(a[i], a[i + 1], sh8);
}

/* Q4_K / Q5_K: sub-block j's factors: its scale sc and −1024·sc (exact
 * halves: sc < 64), the super-block's d (a half), and −dmin·m rounded to
 * f16 */
struct gg_k45 {
    __half2 sc, sc1024, d, mn;
};

static __device__ __forceinline__ gg_k45 gg_k45_of(const unsigned *u, int j)
{
    int sc, m;
    gq_k4_scale_min(j, u[1], u[2], u[3], &sc, &m);
    float mn = -__half2float(__ushort_as_half((unsigned short)(u[0] >> 16))) * (float)m;
    return {__float2half2_rn((float)sc), __float2half2_rn(-1024.0f * (float)sc),
            __half2half2(__ushort_as_half((unsigned short)u[0])), __float2half2_rn(mn)};
}

/* Q4_K / Q5_K: elements 16·i16 .. +15 of the super-block at u (aligned)
 * into 8 pairs; Q5_K's fifth bit is bit j of the qh byte beside the code.
 * (1024 + q)·sc − 1024·sc in one fma is q·sc exactly (an integer below
 * 2048; the fma rounds once, after the sum); then q·sc·d − dmin·m rounds
 * once, with dmin·m's own rounding in it. */
template <bool Q5>
static __device__ __forceinline__ void gg_q45_K_h16(const unsigned *u, const gg_k45 &f, int i16, unsigned out[8])
{
    int j = i16 >> 1, sh = 4 * (j & 1);
    const unsigned *qs = u + (Q5 ? 12 : 4) + 8 * (j >> 1) + 4 * (i16 & 1); /* 32 bytes a sub-block pair */
    const unsigned *qh = u + 4 + 4 * (i16 & 1);
#pragma unroll
    for (int i = 0; i < 4; i++) {
        unsigned w = qs[i] >> sh, hb = Q5 ? qh[i] >> j : 0;
#pragma unroll
        for (int k = 0; k < 2; k++) {
            unsigned h = (gg_lanes(w, k) & 0x000f000fu) | 0x64006400u;
            if (Q5)
                h |= (gg_lanes(hb, k) & 0x00010001u) << 4;
            __half2 qsc = __hfma2(gg_h2(h), f.sc, f.sc1024);
            out[2 * i + k] = gg_u(__hfma2(qsc, f.d, f.mn));
        }
    }
}

/* Q6_K: elements 16·i16 .. +15 of the 210-byte super-block that starts
 * sh8 / 8 bytes into the aligned words u: 4 low bits from ql, 2 from qh,
 * the code less 32 (1056 off the half) times d·scale[i16] */
static __device__ __forceinline__ void gg_q6_K_h16(const unsigned *u, int sh8, int i16, unsigned out[8])
{
    int hf = i16 >> 3, p = (i16 & 7) >> 1, l0 = 4 * (i16 & 1);
    int ql = 16 * hf + 8 * (p & 1) + l0, qh = 32 + 8 * hf + l0, shl = 4 * (p >> 1), shh = 2 * p;
    float d = __half2float(__ushort_as_half((unsigned short)gg_w2(u, 52, sh8)));
    int sc = (signed char)(gg_w2(u, 48 + (i16 >> 2), sh8) >> 8 * (i16 & 3));
    __half2 ds = __float2half2_rn(d * (float)sc), k1056 = __float2half2_rn(1056.0f);
#pragma unroll
    for (int i = 0; i < 4; i++) {
        unsigned lo = gg_w2(u, ql + i, sh8) >> shl, hi = gg_w2(u, qh + i, sh8) >> shh;
#pragma unroll
        for (int k = 0; k < 2; k++) {
            unsigned h = (gg_lanes(lo, k) & 0x000f000fu) | (gg_lanes(hi, k) & 0x00030003u) << 4 | 0x64006400u;
            out[2 * i + k] = gg_u(__hmul2(__hsub2(gg_h2(h), k1056), ds));
        }
    }
}

/* Q8_0: block blk's d of the 8 blocks (34 bytes each) at u (aligned) */
static __device__ __forceinline__ __half2 gg_q8_0_d(const unsigned *u, int blk)
{
    int dof = 34 * blk;
    return __half2half2(__ushort_as_half((unsigned short)(u[dof >> 2] >> 8 * (dof & 3))));
}

/* Q8_0: elements 16·i16 .. +15 of those blocks: the codes at
 * 34·blk + 2 + 16·half, 2 bytes off every other block */
static __device__ __forceinline__ void gg_q8_0_h16(const unsigned *u, __half2 d, int i16, unsigned out[8])
{
    int qof = 34 * (i16 >> 1) + 2 + 16 * (i16 & 1);
    __half2 k1152 = __float2half2_rn(1152.0f);
#pragma unroll
    for (int i = 0; i < 4; i++) {
        unsigned w = gg_w2(u, (qof >> 2) + i, 8 * (qof & 3));
#pragma unroll
        for (int k = 0; k < 2; k++) {
            /* byte c as 0x80 ^ c: the signed code plus 128 */
            unsigned h = (gg_lanes(w, k) ^ 0x00800080u) | 0x64006400u;
            out[2 * i + k] = gg_u(__hmul2(__hsub2(gg_h2(h), k1152), d));
        }
    }
}

#endif

/* The pipeline: GG_SA activation k-tiles in flight (cp.async groups, one
 * committed per iteration), so a tile's loads have GG_SA - 1 iterations of
 * mma to arrive in. A weight superstep's raw words arrive over gg_m
 * iterations that end GG_SA iterations before its first tile is decoded
 * (they share the activations' groups, so the same wait covers both); gg_rr
 * superstep buffers keep that early arrival from overwriting a superstep
 * still being decoded: a buffer is refilled from iteration
 * (S + RR) * NSUB - SA - M + 1, after its last decode at S * NSUB + NSUB - 2,
 * exactly when (RR - 1) * NSUB >= SA + M - 2. */
#define GG_SA 4
static __host__ __device__ constexpr int gg_nsub(int t) { return gg_sup(t) / GG_BK; }
static __host__ __device__ constexpr int gg_m(int t)
{
    return gg_nsub(t) - GG_SA + 2 > 1 ? gg_nsub(t) - GG_SA + 2 : 1;
}
static __host__ __device__ constexpr int gg_rr(int t)
{
    return 1 + (GG_SA + gg_m(t) - 2 + gg_nsub(t) - 1) / gg_nsub(t);
}

/* Shared memory of one block: GG_SA activation k-tiles, two weight k-tiles
 * (f16), gg_rr raw weight supersteps. */
static __host__ __device__ constexpr size_t gg_smem_bytes(int type, int bm)
{
    return (size_t)(GG_SA * bm + 2 * GG_BN) * GG_LD * 2 + (size_t)gg_rr(type) * GG_BN * gg_rs(type) * 4;
}

/* Block tile (16*MT*WM tokens) x 128 weight rows, WM x 2 warps, a warp
 * owning (16*MT) x 64 outputs; k in tiles of 32, one barrier per tile.
 * Iteration kt: wait for tile kt (and the raw supersteps decoded next),
 * barrier; issue activation tile kt + SA - 1 and a slice of raw words;
 * decode weight tile kt + 1 from the raw words into registers; the mma of
 * tile kt; store the decoded tile as f16 into the other weight buffer (read
 * by the mma of kt - 1, which the barrier has retired). The mma's A is x
 * (row-major tokens x k), B is W (each weight row k-contiguous = B's "col"
 * layout), both read with ldmatrix. Split-K: block z of gridDim.z sums the
 * supersteps [z * ns / Z, (z + 1) * ns / Z) into y + z * ysplit. Requires n
 * a multiple of gg_sup(TYPE), gridDim.z <= n / gg_sup(TYPE), w, ldw and
 * gr.estride multiples of gg_al(TYPE) (the host checks). */
template <int TYPE, int WM, int MT>
__global__ void __launch_bounds__(64 * WM) gg_mma(const uint8_t *w, size_t ldw, int n, int rows,
                                                  const __half *xh, int T, float *y, size_t ldy, size_t ysplit,
                                                  gg_groups gr)
{
#if defined(__CUDA_ARCH__) && __CUDA_ARCH__ >= 800
    constexpr int NTH = 64 * WM, BM = 16 * MT * WM, NT = 8, SA = GG_SA;
    constexpr int NSUB = gg_nsub(TYPE), RB = gg_rb(TYPE), UPR = gg_upr(TYPE), RS = gg_rs(TYPE);
    constexpr int M = gg_m(TYPE), RR = gg_rr(TYPE);
    constexpr int CPT = 2 * GG_BN / NTH;               /* 16-element chunks per thread per k-tile */
    constexpr int SLICE = (GG_BN * UPR + M - 1) / M;   /* raw words issued per iteration */
    static_assert((RR - 1) * NSUB >= SA + M - 2 && M <= NSUB, "raw superstep ring too short");
    extern __shared__ __align__(16) unsigned char gg_sm[];
    __half(*sa)[BM][GG_LD] = (__half(*)[BM][GG_LD])gg_sm;                             /* (SA, BM, k) */
    __half(*sb)[GG_BN][GG_LD] = (__half(*)[GG_BN][GG_LD])(gg_sm + SA * BM * GG_LD * 2); /* (2, BN, k) */
    unsigned *raw = (unsigned *)(gg_sm + (SA * BM + 2 * GG_BN) * GG_LD * 2);            /* (RR, BN, RS) */
    int tid = threadIdx.x, lane = tid & 31, warp = tid >> 5;
    int wm = warp >> 1, wn = warp & 1;
    int m0 = gg_group(gr, BM, n, &w, &xh, &y, ldy, &T), n0 = blockIdx.x * GG_BN;
    if (m0 < 0)
        return;
    int ns_all = n / gg_sup(TYPE);
    int s0 = (int)((long long)blockIdx.z * ns_all / gridDim.z);
    int ns = (int)((long long)(blockIdx.z + 1) * ns_all / gridDim.z) - s0, nk = ns * NSUB, kt0 = s0 * NSUB;
    y += blockIdx.z * ysplit;
    float acc[MT][NT][4] = {};
    unsigned wreg[CPT * 8];
    /* this thread's weight row: chunks ci = tid*CPT + c all lie in row
     * (tid*CPT) >> 1. A row's superstep is copied from the word its first
     * byte lies in, so it sits in the shared row at that byte's address & 3
     * (0 where RA is 4). */
    constexpr int RA = gg_al(TYPE);
    int wr = (tid * CPT) >> 1;

    /* raw words of local superstep S, slice sl of M: word e = r·UPR + u of
     * the tile's rows, thread tid taking e = sl·SLICE + tid, + NTH, ...
     * (consecutive threads, consecutive words: coalesced). The first word's
     * row and place come from one division a slice; each next one's by
     * adding NTH's quotient and remainder, a carry past the row's end (a
     * division and 64-bit products for every word, ~35 instructions, were
     * about a third of the kernel's: BENCH.md, forty-fifth pass). Rows
     * past the matrix are not copied (their columns of the tile are never
     * stored). */
    auto issue_raw = [&](int S, int sl) {
        constexpr int DR = NTH / UPR, DU = NTH % UPR;
        int e = sl * SLICE + tid, e1 = min((sl + 1) * SLICE, GG_BN * UPR);
        int r = e / UPR, u = e % UPR;
        /* 4·u bytes into row r's superstep; its word starts sh bytes before */
        const uint8_t *src = w + (size_t)(n0 + r) * ldw + (size_t)(s0 + S) * RB + 4 * u;
        unsigned *dst = raw + (S % RR) * GG_BN * RS;
        for (; e < e1; e += NTH) {
            int sh = RA == 4 ? 0 : (int)((uintptr_t)src & 3), left = sh + RB - 4 * u;
            if (left > 0 && n0 + r < rows)
                gg_cp4(dst + r * RS + u, src - sh, min(left, 4));
            r += DR, u += DU;
            src += DR * ldw + 4 * DU;
            if (u >= UPR) {
                u -= UPR, r++;
                src += (ptrdiff_t)ldw - 4 * UPR;
            }
        }
    };
    /* iteration it issues slice sl < M of superstep S where
     * S * NSUB + sl = it + SA + M - 1 */
    auto issue_raw_iter = [&](int it) {
        int f = it + SA + M - 1, S = f / NSUB, sl = f % NSUB;
        if (sl < M && S < ns)
            issue_raw(S, sl);
    };
    auto load_a = [&](int kt, int st) {
        for (int c = tid; c < BM * 4; c += NTH) {
            int r = c >> 2, cc = c & 3;
            gg_cp16(&sa[st][r][8 * cc], xh + (size_t)min(m0 + r, T - 1) * n + (kt0 + kt) * GG_BK + 8 * cc);
        }
    };
    /* weight tile kt into wreg: chunk c of this thread is i16(c), 2·sub + its parity */
    auto dequant_w = [&](int kt) {
        int S = kt / NSUB, sub = kt % NSUB;
        int sh = RA == 4 ? 0 : (int)((uintptr_t)(w + (size_t)(n0 + wr) * ldw + (size_t)(s0 + S) * RB) & 3);
        const unsigned *rw = raw + (S % RR) * GG_BN * RS + wr * RS; /* the superstep, sh bytes in */
        auto i16 = [&](int c) { return 2 * sub + ((tid * CPT + c) & 1); };
        if constexpr (TYPE == QT_Q4_K || TYPE == QT_Q5_K) { /* (RA == 4: sh == 0) */
            gg_k45 f = gg_k45_of(rw, sub);
#pragma unroll
            for (int c = 0; c < CPT; c++)
                gg_q45_K_h16<TYPE == QT_Q5_K>(rw, f, i16(c), &wreg[8 * c]);
        } else if constexpr (TYPE == QT_Q8_0) {            /* (RA == 4: sh == 0) */
            __half2 d = gg_q8_0_d(rw, sub);
#pragma unroll
            for (int c = 0; c < CPT; c++)
                gg_q8_0_h16(rw, d, i16(c), &wreg[8 * c]);
        } else if constexpr (TYPE == QT_Q6_K) {
#pragma unroll
            for (int c = 0; c < CPT; c++)
                gg_q6_K_h16(rw, 8 * sh, i16(c), &wreg[8 * c]);
        } else {
#pragma unroll
            for (int c = 0; c < CPT; c++) {
                float f[16];
                gq_dequant16_al<RA>(TYPE, (const uint8_t *)rw + sh, i16(c), f);
#pragma unroll
                for (int j = 0; j < 8; j++)
                    wreg[8 * c + j] = gg_u(__floats2half2_rn(f[2 * j], f[2 * j + 1]));
            }
        }
    };
    auto store_w = [&](int st) {
#pragma unroll
        for (int c = 0; c < CPT; c++) {
            int ci = tid * CPT + c;
            uint4 *d = (uint4 *)&sb[st][ci >> 1][16 * (ci & 1)];
            d[0] = make_uint4(wreg[8 * c], wreg[8 * c + 1], wreg[8 * c + 2], wreg[8 * c + 3]);
            d[1] = make_uint4(wreg[8 * c + 4], wreg[8 * c + 5], wreg[8 * c + 6], wreg[8 * c + 7]);
        }
    };

    /* prologue: group j holds activation tile j (j < SA - 1), group 0 also
     * the raw slices of the iterations before 0 */
    for (int it = -(SA + M - 1); it < 0; it++)
        issue_raw_iter(it);
#pragma unroll
    for (int j = 0; j < SA - 1; j++) {
        if (j < nk)
            load_a(j, j);
        asm volatile("cp.async.commit_group;\n" ::);
    }
    asm volatile("cp.async.wait_group %0;\n" ::"n"(SA - 2) : "memory");
    __syncthreads();
    dequant_w(0);
    store_w(0);
    for (int kt = 0; kt < nk; kt++) {
        /* committed: SA - 1 + kt groups; all but the newest SA - 2 done =
         * activation tile kt and the raw slices of iterations <= kt - SA + 1 */
        asm volatile("cp.async.wait_group %0;\n" ::"n"(SA - 2) : "memory");
        __syncthreads();
        int cur = kt % SA;
        if (kt + SA - 1 < nk)
            load_a(kt + SA - 1, (kt + SA - 1) % SA);
        issue_raw_iter(kt);
        asm volatile("cp.async.commit_group;\n" ::);
        dequant_w(min(kt + 1, nk - 1)); /* the last iteration repeats a decode into the idle buffer */
#pragma unroll
        for (int kk = 0; kk < GG_BK / 16; kk++) {
            unsigned af[MT][4], bf[NT][2];
#pragma unroll
            for (int mt = 0; mt < MT; mt++)
                gg_ldm4(af[mt], &sa[cur][wm * 16 * MT + mt * 16 + (lane & 15)][kk * 16 + (lane >> 4) * 8]);
#pragma unroll
            for (int np = 0; np < NT / 2; np++) {
                unsigned r[4];
                gg_ldm4(r, &sb[kt & 1][wn * 64 + np * 16 + (lane >> 4) * 8 + (lane & 7)]
                              [kk * 16 + ((lane >> 3) & 1) * 8]);
                bf[2 * np][0] = r[0];
                bf[2 * np][1] = r[1];
                bf[2 * np + 1][0] = r[2];
                bf[2 * np + 1][1] = r[3];
            }
#pragma unroll
            for (int mt = 0; mt < MT; mt++)
#pragma unroll
                for (int nt = 0; nt < NT; nt++)
                    gpu_mma16816(acc[mt][nt], af[mt], bf[nt][0], bf[nt][1]);
        }
        store_w((kt + 1) & 1);
    }
    asm volatile("cp.async.wait_all;\n" ::: "memory");
    /* accumulator fragment: c0,c1 at (token g, rows 2t, 2t+1), c2,c3 at token g+8 */
    int g = lane >> 2, t4 = lane & 3;
    int pairs = ((size_t)y & 7) == 0 && (ldy & 1) == 0; /* (c0, c1) as one 8-byte store */
#pragma unroll
    for (int mt = 0; mt < MT; mt++)
#pragma unroll
        for (int nt = 0; nt < NT; nt++)
#pragma unroll
            for (int h = 0; h < 2; h++) {
                int tok = m0 + wm * 16 * MT + mt * 16 + g + 8 * h;
                int col = n0 + wn * 64 + nt * 8 + 2 * t4;
                if (tok >= T)
                    continue;
                float *dst = y + (size_t)tok * ldy + col;
                if (pairs && col + 1 < rows) {
                    *(float2 *)dst = make_float2(acc[mt][nt][2 * h], acc[mt][nt][2 * h + 1]);
                    continue;
                }
                if (col < rows)
                    dst[0] = acc[mt][nt][2 * h];
                if (col + 1 < rows)
                    dst[1] = acc[mt][nt][2 * h + 1];
            }
#else
    (void)w, (void)ldw, (void)n, (void)rows, (void)xh, (void)T, (void)y, (void)ldy, (void)ysplit, (void)gr;
#endif
}

/* y (T, rows) = the sum of the split-K partials part (splits, T, rows), in
 * split order (deterministic). */
__global__ void gg_sum_splits(const float *part, int splits, int T, int rows, float *y, size_t ldy)
{
    size_t i = (size_t)blockIdx.x * blockDim.x + threadIdx.x, count = (size_t)T * rows;
    if (i >= count)
        return;
    float s = part[i];
    for (int z = 1; z < splits; z++)
        s += part[z * count + i];
    y[i / rows * ldy + i % rows] = s;
}

/* Split-K partials: at most 8 splits, and at most GG_PART_CAP bytes (a grid
 * small enough to split has T * rows <= SMs * BM * 128, far below it on
 * current cards). */
#define GG_MAX_SPLIT 8
#define GG_PART_CAP ((size_t)32 << 20)
static size_t gg_part_bytes(int rows, int T)
{
    size_t b = (size_t)GG_MAX_SPLIT * T * rows * sizeof(float);
    return b < GG_PART_CAP ? b : GG_PART_CAP;
}

/* The activations' f16 copy comes first in the scratch, 256-byte aligned. */
static size_t gg_xh_bytes(int n, int T)
{
    return ((size_t)T * n * 2 + 255) & ~(size_t)255;
}

/* 1 when the device cannot give the block its shared memory (the caller
 * takes the tiled kernel), else 0 / -1 as gpu_gemm. Split-K when fewer
 * blocks than the device holds at once: as many splits as fill it without a
 * second wave (measured on the H200: two splits of 128 blocks that fit two
 * per SM +26-38%; the same split where one block fits per SM, a second wave,
 * -4 to -10%); STRATA_GEMM_SPLIT=N forces N (tests). */
template <int TYPE, int WM, int MT>
static int gg_launch(const uint8_t *w, size_t ldw, int n, int rows, const __half *xh, int T, float *y,
                     size_t ldy, const gg_groups &gr, void *scratch, int dev, int sms, gpuStream_t st, char *err,
                     size_t errlen)
{
    constexpr int BM = 16 * MT * WM;
    constexpr size_t smem = gg_smem_bytes(TYPE, BM);
    auto kern = gg_mma<TYPE, WM, MT>;
    int optin = 0, per_sm = 0;
    GPU_TRY(cudaDeviceGetAttribute(&optin, cudaDevAttrMaxSharedMemoryPerBlockOptin, dev), err, errlen);
    if ((size_t)optin < smem)
        return 1;
    /* the opt-in above 48 KiB, per call: it is per device, and not a stream
     * operation (allowed while a graph is captured) */
    GPU_TRY(gpuFuncSetAttribute(kern, gpuFuncAttributeMaxDynamicSharedMemorySize, (int)smem), err, errlen);
    GPU_TRY(cudaOccupancyMaxActiveBlocksPerMultiprocessor(&per_sm, kern, 64 * WM, smem), err, errlen);
    dim3 grid((rows + GG_BN - 1) / GG_BN, gg_group_tiles(gr, T, BM), 1);
    int blocks = (int)(grid.x * grid.y), ns = n / gg_sup(TYPE);
    int splits = min(min(sms * max(per_sm, 1) / blocks, GG_MAX_SPLIT), ns);
    const char *fs = getenv("STRATA_GEMM_SPLIT");
    if (fs)
        splits = max(1, min(min(atoi(fs), GG_MAX_SPLIT), ns));
    splits = min(splits, (int)(gg_part_bytes(rows, T) / ((size_t)T * rows * sizeof(float))));
    if (splits < 2 || gr.offs) {   /* (groups fill the device with their own tiles) */
        kern<<<grid, 64 * WM, smem, st>>>(w, ldw, n, rows, xh, T, y, ldy, 0, gr);
        GPU_TRY(gpuGetLastError(), err, errlen);
        return 0;
    }
    float *part = (float *)((char *)scratch + gg_xh_bytes(n, T)); /* (splits, T, rows) */
    grid.z = splits;
    kern<<<grid, 64 * WM, smem, st>>>(w, ldw, n, rows, xh, T, part, rows, (size_t)T * rows, gr);
    GPU_TRY(gpuGetLastError(), err, errlen);
    size_t count = (size_t)T * rows;
    gg_sum_splits<<<(unsigned)((count + 255) / 256), 256, 0, st>>>(part, splits, T, rows, y, ldy);
    GPU_TRY(gpuGetLastError(), err, errlen);
    return 0;
}

/* ==== the vendor gemm: cuBLAS, loaded at run time ====
 * For prompts of GG_BLAS_MIN_T tokens or more, W is dequantised to f16 in
 * the scratch, GG_SLAB weights at a time, and cuBLAS multiplies the f16
 * rows with f32 sums: the numerics of gg_mma (f16 operands, f32 sums), at
 * the matrix rate of the vendor's Hopper kernels (wgmma), which gg_mma's
 * mma.sync does not reach (BENCH.md). The library is opened with dlopen, so
 * the binary has no link-time dependency on it: where libcublas.so.<major
 * of the build's toolkit> is not on the loader's path, or with
 * STRATA_GEMM_BLAS=0, the kernels above serve. One handle per process,
 * made at the first use (gpu_gemm_scratch_bytes, called when a context is
 * made) and used under a lock: the stream is set per call. */
#define GG_BLAS_MIN_T 64
#define GG_SLAB ((size_t)64 << 20)
#define GG_STR2(x) #x
#define GG_STR(x) GG_STR2(x)

/* cublasGemmEx's C entry (the header adds a C++ overload) */
typedef cublasStatus_t (*gg_gemm_fn)(cublasHandle_t, cublasOperation_t, cublasOperation_t, int, int, int,
                                     const void *, const void *, cudaDataType, int, const void *, cudaDataType,
                                     int, const void *, void *, cudaDataType, int, cublasComputeType_t,
                                     cublasGemmAlgo_t);

static struct {
    pthread_once_t once;
    pthread_mutex_t lock;
    cublasHandle_t h;
    decltype(&cublasSetStream_v2) set_stream;
    gg_gemm_fn gemm;
} gg_blas = {PTHREAD_ONCE_INIT, PTHREAD_MUTEX_INITIALIZER, NULL, NULL, NULL};

static void gg_blas_open(void)
{
    void *lib = dlopen("libcublas.so." GG_STR(CUBLAS_VER_MAJOR), RTLD_NOW | RTLD_LOCAL);
    if (!lib)
        return;
    decltype(&cublasCreate_v2) create = (decltype(&cublasCreate_v2))dlsym(lib, "cublasCreate_v2");
    gg_blas.set_stream = (decltype(&cublasSetStream_v2))dlsym(lib, "cublasSetStream_v2");
    gg_blas.gemm = (gg_gemm_fn)dlsym(lib, "cublasGemmEx");
    if (!create || !gg_blas.set_stream || !gg_blas.gemm || create(&gg_blas.h) != CUBLAS_STATUS_SUCCESS)
        gg_blas.h = NULL;   /* (the library stays loaded: a handle may hold its memory) */
}

/* Whether the vendor gemm takes this shape (f16 rows of n a multiple of 16,
 * T large enough) and is loaded; the scratch is sized by this. */
static int gg_blas_fits(int n, int T)
{
    if (T < GG_BLAS_MIN_T || n % 16)
        return 0;
    pthread_once(&gg_blas.once, gg_blas_open);
    return gg_blas.h != NULL;
}

/* ... and serves this call: not turned off by STRATA_GEMM_BLAS=0 */
static int gg_blas_ok(int n, int T)
{
    const char *env = getenv("STRATA_GEMM_BLAS");
    return !(env && env[0] == '0') && gg_blas_fits(n, T);
}

/* rows dequantised at once: all of them up to GG_SLAB weights, else a
 * multiple of 256 (aligned output columns) */
static int gg_slab_rows(int n, int rows)
{
    size_t r = GG_SLAB / (size_t)n;
    return (size_t)rows <= r ? rows : (int)(r > 256 ? r & ~(size_t)255 : 256);
}

template <int TYPE>
static int gg_blas_run(const uint8_t *w, size_t ldw, int n, int rows, const __half *xh, int T, float *y,
                       size_t ldy, void *scratch, gpuStream_t st, char *err, size_t errlen)
{
    __half *wh = (__half *)((char *)scratch + gg_xh_bytes(n, T));
    int slab = gg_slab_rows(n, rows);
    const float one = 1.0f, zero = 0.0f;
    for (int r0 = 0; r0 < rows; r0 += slab) {
        int nr = min(slab, rows - r0);
        size_t threads = (size_t)nr * (n / 16);
        gg_dequant<TYPE><<<(unsigned)((threads + 255) / 256), 256, 0, st>>>(w + (size_t)r0 * ldw, ldw, n, nr, wh,
                                                                              (size_t)n);
        GPU_TRY(gpuGetLastError(), err, errlen);
        /* column-major: y[r0.., T] (nr x T, ldy) = whᵀ (nr x n) · xh (n x T) */
        pthread_mutex_lock(&gg_blas.lock);
        cublasStatus_t rc = gg_blas.set_stream(gg_blas.h, st);
        if (rc == CUBLAS_STATUS_SUCCESS)
            rc = gg_blas.gemm(gg_blas.h, CUBLAS_OP_T, CUBLAS_OP_N, nr, T, n, &one, wh, CUDA_R_16F, n, xh,
                              CUDA_R_16F, n, &zero, y + r0, CUDA_R_32F, (int)ldy, CUBLAS_COMPUTE_32F,
                              CUBLAS_GEMM_DEFAULT);
        pthread_mutex_unlock(&gg_blas.lock);
        if (rc != CUBLAS_STATUS_SUCCESS)
            return strata_errf(err, errlen, "gpu_gemm: cuBLAS gemm failed (status %d; STRATA_GEMM_BLAS=0 "
                               "uses Strata's own kernels)", (int)rc);
    }
    return 0;
}
#endif /* GPU_CUDA */

/* ==== dispatch ==== */

#ifdef GPU_CUDA
/* Whether this call takes the tensor-core kernel: a device of compute
 * capability 8.0 or newer, and no STRATA_GEMM_PORTABLE=1. */
static int gg_use_mma(void)
{
    const char *env = getenv("STRATA_GEMM_PORTABLE");
    if (env && env[0] == '1')
        return 0;
    int arch = 0, sms = 0;
    return gpu_device_facts(&arch, &sms) == gpuSuccess && arch >= 80;
}
#endif

/* Groups (gr.offs) take Strata's own kernels (the vendor gemm would need
 * the group sizes on the host), without split-K, the tile chosen by the
 * mean group's rows. */
template <int TYPE>
static int gg_run(const uint8_t *w, size_t ldw, int n, int rows, const float *x, int T, float *y,
                  size_t ldy, const gg_groups &gr, void *scratch, gpuStream_t st, char *err, size_t errlen)
{
#ifdef GPU_CUDA
    const struct quant_type *qt = quant_type(TYPE);
    if (qt->blck != gg_blck(TYPE) || (int)qt->size != gq_bsize(TYPE))
        return strata_errf(err, errlen, "gpu_gemm: %s's layout differs from quant.c's", qt->name);
    int mma = gg_use_mma(), blas = mma && !gr.offs && gg_blas_ok(n, T) && ldy <= INT_MAX, al = gg_al(TYPE);
    if ((blas || (mma && n % gg_sup(TYPE) == 0 && (uintptr_t)w % al == 0 && ldw % al == 0 && gr.estride % al == 0)) &&
        ((uintptr_t)x & 7) == 0) {
        __half *xh = (__half *)scratch;
        size_t pairs = (size_t)T * n / 2; /* n is even here */
        gg_to_half<<<(unsigned)((pairs + 255) / 256), 256, 0, st>>>((const float2 *)x, pairs, (__half2 *)xh);
        GPU_TRY(gpuGetLastError(), err, errlen);
        if (blas)
            return gg_blas_run<TYPE>(w, ldw, n, rows, xh, T, y, ldy, scratch, st, err, errlen);
        /* the 256-token tile above 1024 tokens, and from 512 where the 128-token
         * tile's grid would leave half the SMs idle (k and v at 512 tokens, split
         * 8 ways: 88-94 TFLOP/s on the H200 against 49-62 with 128-token tiles) */
        int dev = 0, arch = 0, sms = 0, rc;
        GPU_TRY(cudaGetDevice(&dev), err, errlen);
        GPU_TRY(gpu_device_facts(&arch, &sms), err, errlen);
        const char *bm = getenv("STRATA_GEMM_BM");
        /* (groups by their mean rows, though about half the groups have more:
         * the tile chosen from 1.5 times the mean measured +11-14% for Q4_K
         * experts and -9 to -13% for Q8_0 and Q6_K ones, BENCH.md,
         * fifty-second pass) */
        int Tm = gr.offs ? (T + gr.X - 1) / gr.X : T;
        int small_grid = (rows + GG_BN - 1) / GG_BN * ((T + 127) / 128) < sms / 2;
        int big = bm ? atoi(bm) == 256 : Tm > 1024 || (Tm >= 512 && small_grid);
        if (Tm <= 32)
            rc = gg_launch<TYPE, 2, 1>(w, ldw, n, rows, xh, T, y, ldy, gr, scratch, dev, sms, st, err, errlen);
        else if (Tm <= 64)
            rc = gg_launch<TYPE, 2, 2>(w, ldw, n, rows, xh, T, y, ldy, gr, scratch, dev, sms, st, err, errlen);
        else if (!big)
            rc = gg_launch<TYPE, 2, 4>(w, ldw, n, rows, xh, T, y, ldy, gr, scratch, dev, sms, st, err, errlen);
        else
            rc = gg_launch<TYPE, 4, 4>(w, ldw, n, rows, xh, T, y, ldy, gr, scratch, dev, sms, st, err, errlen);
        if (rc <= 0)
            return rc;
    }
#endif
    (void)scratch;
    dim3 grid((rows + GG_TN - 1) / GG_TN, gg_group_tiles(gr, T, GG_TM));
    gg_tiled<TYPE><<<grid, GG_THREADS, 0, st>>>(w, ldw, n, rows, x, T, y, ldy, gr);
    GPU_TRY(gpuGetLastError(), err, errlen);
    return 0;
}

/* x in f16, then the split-K partials (gg_launch); both grow with T and
 * rows, so the bytes of the largest shape cover every smaller call. */
size_t gpu_gemm_scratch_bytes(int type, int n, int rows, int T)
{
    (void)type;
#ifdef GPU_CUDA
    size_t after = gg_part_bytes(rows, T);
    if (gg_blas_fits(n, T))
        after = max(after, (size_t)gg_slab_rows(n, rows) * n * sizeof(__half));
    return gg_xh_bytes(n, T) + after;
#else
    (void)n, (void)rows, (void)T;
    return 0;
#endif
}

int gpu_gemm_supports(int type)
{
    return gq_supported(type);
}

int gpu_gemm_blas(void)
{
#ifdef GPU_CUDA
    return gg_blas_ok(16, GG_BLAS_MIN_T);
#else
    return 0;
#endif
}

/* The type switch: F(TYPE) for each type gq_supported lists. */
#define GG_TYPES(F)                                                                               \
    F(QT_F32) F(QT_F16) F(QT_BF16) F(QT_Q4_0) F(QT_Q4_1) F(QT_Q5_0) F(QT_Q5_1) F(QT_Q8_0) F(QT_Q8_1) \
    F(QT_Q2_K) F(QT_Q3_K) F(QT_Q4_K) F(QT_Q5_K) F(QT_Q6_K) F(QT_Q8_K) F(QT_IQ4_NL) F(QT_IQ4_XS)         \
    F(QT_IQ2_XXS) F(QT_IQ2_XS) F(QT_IQ2_S) F(QT_IQ3_XXS) F(QT_IQ3_S)

int gpu_dequant(int type, const void *w, size_t ldw, int n, int rows, float *y, size_t ldy,
                void *stream, char *err, size_t errlen)
{
    const struct quant_type *qt = quant_type(type);
    if (!qt || !gq_supported(type))
        return strata_errf(err, errlen, "gpu_dequant: block type %d is not supported", type);
    if (n <= 0 || n % qt->blck || ldy < (size_t)n)
        return strata_errf(err, errlen, "gpu_dequant: bad shape n = %d for %s", n, qt->name);
    if (rows <= 0)
        return 0;
    size_t threads = (size_t)rows * ((n + 15) / 16);
    unsigned blocks = (unsigned)((threads + 255) / 256);
    gpuStream_t st = (gpuStream_t)stream;
    const uint8_t *wb = (const uint8_t *)w;
    switch (type) {
#define GG_CASE(t)                                                    \
    case t:                                                           \
        gg_dequant<t><<<blocks, 256, 0, st>>>(wb, ldw, n, rows, y, ldy); \
        break;
        GG_TYPES(GG_CASE)
#undef GG_CASE
    }
    GPU_TRY(gpuGetLastError(), err, errlen);
    return 0;
}

static int gg_call(int type, const void *w, size_t ldw, int n, int rows, const float *x, int T, float *y,
                   size_t ldy, const gg_groups &gr, void *scratch, void *stream, char *err, size_t errlen)
{
    const uint8_t *wb = (const uint8_t *)w;
    gpuStream_t st = (gpuStream_t)stream;
    if (T <= 0 || rows <= 0)
        return 0;
    const struct quant_type *qt = quant_type(type);
    if (!qt || !gq_supported(type))
        return strata_errf(err, errlen, "gpu_gemm: block type %d is not supported", type);
    if (n <= 0 || n % qt->blck)
        return strata_errf(err, errlen, "gpu_gemm: n = %d is not a multiple of %s's block", n, qt->name);
    if (ldy < (size_t)rows)
        return strata_errf(err, errlen, "gpu_gemm: ldy %zu < rows %d", ldy, rows);
    if (((uintptr_t)scratch & 15) != 0)
        return strata_errf(err, errlen, "gpu_gemm: scratch must be 16-byte aligned");
    switch (type) {
#define GG_CASE(t)                                                                      \
    case t:                                                                             \
        return gg_run<t>(wb, ldw, n, rows, x, T, y, ldy, gr, scratch, st, err, errlen);
        GG_TYPES(GG_CASE)
#undef GG_CASE
    default:
        return strata_errf(err, errlen, "gpu_gemm: block type %d is not supported", type);
    }
}

int gpu_gemm(int type, const void *w, size_t ldw, int n, int rows, const float *x, int T, float *y,
             size_t ldy, void *scratch, void *stream, char *err, size_t errlen)
{
    gg_groups gr = {NULL, 0, 0};
    return gg_call(type, w, ldw, n, rows, x, T, y, ldy, gr, scratch, stream, err, errlen);
}

int gpu_gemm_experts(int type, const void *w, size_t ldw, size_t estride, int n, int rows, const float *x, int T,
                     const int32_t *offs, int X, float *y, size_t ldy, void *scratch, void *stream, char *err,
                     size_t errlen)
{
    if (X <= 0 || !offs)
        return strata_errf(err, errlen, "gpu_gemm_experts: %d groups, offsets %p", X, (const void *)offs);
    gg_groups gr = {offs, X, estride};
    return gg_call(type, w, ldw, n, rows, x, T, y, ldy, gr, scratch, stream, err, errlen);
}

size_t gpu_gemm_experts_scratch_bytes(int n, int T)
{
#ifdef GPU_CUDA
    return gg_xh_bytes(n, T);
#else
    (void)n, (void)T;
    return 0;
#endif
}

/* ==== test and benchmark support ==== */

int gpu_gemm_test_fill(void *dev, int byte, size_t bytes)
{
    return gpuMemset(dev, byte, bytes) == gpuSuccess && gpuDeviceSynchronize() == gpuSuccess ? 0 : -1;
}

static int gg_cmp_float(const void *a, const void *b)
{
    float x = *(const float *)a, y = *(const float *)b;
    return (x > y) - (x < y);
}

double gpu_gemm_test_ms(int type, const void *w, size_t ldw, int n, int rows, const float *x, int T,
                        float *y, size_t ldy, void *scratch, int reps, char *err, size_t errlen)
{
    float ms[64];
    gpuEvent_t a, b;
    if (reps < 1 || reps > 64)
        return strata_errf(err, errlen, "gpu_gemm_test_ms: reps %d out of 1..64", reps);
    GPU_TRY(gpuEventCreate(&a), err, errlen);
    GPU_TRY(gpuEventCreate(&b), err, errlen);
    int rc = gpu_gemm(type, w, ldw, n, rows, x, T, y, ldy, scratch, NULL, err, errlen); /* warm-up */
    for (int i = 0; i < reps && rc == 0; i++) {
        if (gpuEventRecord(a, 0) != gpuSuccess)
            rc = strata_errf(err, errlen, "gpu_gemm_test_ms: event record failed");
        else if (gpu_gemm(type, w, ldw, n, rows, x, T, y, ldy, scratch, NULL, err, errlen))
            rc = -1;
        else if (gpuEventRecord(b, 0) != gpuSuccess || gpuEventSynchronize(b) != gpuSuccess ||
                 gpuEventElapsedTime(&ms[i], a, b) != gpuSuccess)
            rc = strata_errf(err, errlen, "gpu_gemm_test_ms: event timing failed");
    }
    (void)gpuEventDestroy(a);
    (void)gpuEventDestroy(b);
    if (rc)
        return -1;
    qsort(ms, (size_t)reps, sizeof ms[0], gg_cmp_float);
    return ms[reps / 2];
}
