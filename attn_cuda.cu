/*
 * attn_cuda.cu — every NVIDIA attention kernel and the one table that picks
 * among them (gpu.h's gpu_attn_*): dense prompt, split-KV decode with a
 * log-sum-exp merge, QSA prompt and QSA split decode, all reading K/V
 * straight from kv.c's pages on the device (struct kv_layout) and
 * dequantising them on the fly.
 *
 * Kernels:
 *   ak_mma   (sm_80+) tensor cores, mma.sync m16n8k16 f16 with f32
 *            accumulation: a warp owns 16 rows (query, head) of one kv
 *            head; the block's four warps load each 64-cell step of K/V
 *            into shared memory as f16 (for E <= 128 the next step's bytes
 *            are in flight in registers while this step computes) and those
 *            with rows compute; running max and sum per row in registers,
 *            no T×C buffer. One kernel serves the four paths: dense (causal,
 *            the G query heads of a kv head together, so K/V are read once
 *            per tile) or a QSA list, whole or one split-KV partition that
 *            writes (max, sum, acc) to scratch. Head dims 64, 128, 256.
 *   ak_flash (sm_80+) the prompts (dense and QSA) over f16, int8, q4 and
 *            k8v4 cells of head dim 64 or 128: ak_mma's tiles made for long
 *            prompts (dense: 8 warps, 128 rows a block), K/V steps copied
 *            raw by cp.async into a ring of stages (quantised rows decoded
 *            to f16 a step at a time), fragments by ldmatrix, the softmax
 *            in base 2, P as f16 alone (below).
 *   ak_mma<QK8> (sm_80+, int8 cells, STRATA_QSA_SPLIT_ATTN=1, opt-in) the
 *            QSA split decode with K·Q as int8 mma (m16n8k32 s8 on the
 *            pages' codes, Q quantised per row like the keys), P·V as above.
 *   ak_dec   (sm_80+) split-KV decode, dense and QSA, f16 and int8 cells,
 *            up to 16 query rows per kv head (T·G dense, G QSA): cells in
 *            the mma's 16 rows and query rows in its 8 columns (Sᵀ = K·Qᵀ,
 *            Oᵀ += Vᵀ·Pᵀ), every warp walking its own 16-cell steps (32
 *            for int8 at long contexts, AKD_LONG) with
 *            raw rows copied by cp.async ahead into a private ring, the
 *            block's warps merged once at the end. int8 codes are the mma
 *            operands (exact), their scales applied outside. One wave of
 *            blocks (as many as are resident), partitions sized on the
 *            device from the live cells (a graph captured for a long
 *            context runs a short one on a few whole blocks), the merge a
 *            programmatic dependent launch on sm_90.
 *   ak_simt  one warp per row, no matrix units, any head dim up to 512 and
 *            f32 cells: the fallback of every path (ak_table says when).
 *   ak_merge the log-sum-exp merge of split partials, a block per row
 *            (ak_dec's live partitions only; none when one is live).
 * Below sm_80, or with STRATA_ATTN_PRE75=1, the table calls attn_hip.hip's
 * gpu_attn_*_rdna2 kernels.
 *
 * Numerics of ak_mma: f16 inputs would round Q and the probabilities P to
 * 11 bits, a loss next to the f32 CPU path as large as the f16 cache's
 * own; so Q and P are each split into f16 hi + lo (x = hi + lo to 2^-22
 * relative) and every product is two mma, which costs tensor-core time
 * the kernel has to spare but leaves the error that of f32 sums. ak_flash
 * keeps Q's split and rounds P to f16 alone: measured (gpu/attn), P's
 * rounding leaves the GPU's RMS error within 2% of the CPU path's, Q's
 * takes it to 1.3-1.45 times. K and V enter as f16: exact for f16 cells;
 * int8 and Q4_0 values d·q are rounded to f16 (relative 2^-12, a
 * thousandth of their own quantisation error).
 * f32 cells take ak_simt (all f32).
 *
 * Must not: allocate, synchronise, keep state between calls beyond cached
 * device attributes, or read pos0 on the host (graphs replay at any
 * position). Shapes: T queries, H query heads, K kv heads, G = H/K, E head
 * dim, P cells per page, S partitions, TH = T·H output rows.
 */
#include <limits.h>
#include <math.h>
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "gpu.h"
#include "gpu_compat.h"
#include "gpu_quant.h"

#define AK_BC 64        /* entries per online-softmax step (one kv.c page) */
#define AK_SPLIT_MAX 128 /* most split-KV partitions (ak_dec; sizes scratch and the merge) */
#define AK_SPLIT_MMA 64  /* most partitions of ak_mma and ak_simt */
#define AK_DECODE_T 16  /* decode windows up to this many queries take the split kernels */
#define AK_PAD 8        /* halves after each shared row: the 8 rows of a fragment load
                           fall in 8 distinct bank quads */
#define AK_SIMT_ROWS 4  /* rows (warps) per ak_simt block */
#define AK_THREADS 128  /* ak_mma: four warps load every step; those with rows compute */

/* ROW_I8C: int8 cells as ak_dec lays them out unpadded (E = 128), dense
 * runs copied whole, see akd_shape */
enum { ROW_F32, ROW_F16, ROW_I8, ROW_Q4, ROW_I8C };

/* One launch's view of a call. */
struct ak_args {
    const uint8_t *pages;
    size_t page_bytes, kbytes, vbytes;
    const int32_t *pt;
    int P, K, E, H, G, T, layer;
    int lp;          /* log2 P (kv.c's pages hold a power of two of cells): cell >> lp, cell & (P - 1) */
    const float *q;
    float *out;
    const int32_t *pos0;
    float scale;
    const int32_t *sel;
    const int64_t *sel_off;
    float *ml, *acc; /* split partials (S, TH, 2) and (S, TH, E); NULL: final output */
    int8_t *out_q;   /* ak_dec: the output also as int8 blocks of 32 (gpu_attn's out_q), or NULL */
    float4 *out_ds;
    int out_bt;      /* their layout (gpu_attn's out_bt) */
    int plen;        /* entries per partition (unit == 0) */
    int S;           /* partitions in the grid (ak_dec) */
    int unit;        /* ak_dec: > 0, partitions sized on the device from the live
                        entries (akd_plen), only the live ones written */
    int pgreg;       /* ak_dec, dense: page ids of 32 steps ahead in a register */
    int settled;     /* ak_dec, dense: gpu_attn's settled */
    int tiles;       /* ak_mma: row tiles per kv head (dense) or per query (QSA) */
    int rt;          /* ak_mma: rows per tile (16 per computing warp) */
    int qsa;
    int multi;       /* ak_dec: query z the last cell of its own sequence (gpu_attn's multi) */
    int pt_stride;   /* with multi: query z's page table at pt + z·pt_stride */
};

/* ==== cell rows ==== */

/* The K row of a cell of kv head h, and its V row (kv_layout). */
static __device__ __forceinline__ const uint8_t *ak_block(const ak_args &a, int h, int cell)
{
    size_t blk = ((size_t)a.layer * a.K + h) * (size_t)a.P * (a.kbytes + a.vbytes);
    return a.pages + (size_t)a.pt[cell >> a.lp] * a.page_bytes + blk;
}

static __device__ __forceinline__ const uint8_t *ak_krow(const ak_args &a, int h, int cell)
{
    return ak_block(a, h, cell) + (size_t)(cell & (a.P - 1)) * a.kbytes;
}

static __device__ __forceinline__ const uint8_t *ak_vrow(const ak_args &a, int h, int cell)
{
    return ak_block(a, h, cell) + (size_t)a.P * a.kbytes + (size_t)(cell & (a.P - 1)) * a.vbytes;
}

/* The rows r0..r1-1 (rows a tile) of a prompt kernel's block and the
 * entries they walk (returned): QSA, z = blockIdx.z = t·tiles + tile, of
 * query t and its list; dense, tile zd of the T·G rows of the kv head,
 * cells 0..pos0 + the last row's query. */
static __device__ __forceinline__ int ak_tile_rows(const ak_args &a, int rows, int zd, int p0, int *r0, int *r1,
                                                   const int32_t **list)
{
    int G = a.G;
    if (a.qsa) {
        int t = blockIdx.z / a.tiles;
        *r0 = t * G + (blockIdx.z % a.tiles) * rows;
        *r1 = min(*r0 + rows, t * G + G);
        *list = a.sel + a.sel_off[t];
        return (int)(a.sel_off[t + 1] - a.sel_off[t]);
    }
    *r0 = zd * rows;
    *r1 = min(*r0 + rows, a.T * G);
    *list = NULL;
    return p0 + (*r1 - 1) / G + 1;
}

/* Element e of a row, as kv.c decodes it: int8 q·d, Q4_0 (nibble - 8)·d. */
template <int ROW>
static __device__ __forceinline__ float ak_elem(const uint8_t *row, int e)
{
    if (ROW == ROW_F32)
        return ((const float *)row)[e];
    if (ROW == ROW_F16)
        return __half2float(((const __half *)row)[e]);
    if (ROW == ROW_I8) {
        float d;
        memcpy(&d, row, 4); /* 4-aligned only when E is a multiple of 4 */
        return (float)((const int8_t *)(row + 4))[e] * d;
    }
    const uint8_t *b = row + (e >> 5) * 18;
    float d = __half2float(*(const __half *)b);
    int j = e & 31;
    int nib = j < 16 ? (b[2 + j] & 15) : (b[2 + j - 16] >> 4);
    return (float)(nib - 8) * d;
}

/* e^x rounded from double: within half an ulp like attn.c's exp (CUDA's
 * expf is within 2), for the f32 paths whose error is rounding alone. */
static __device__ __forceinline__ float ak_exp(float x)
{
    return (float)exp((double)x);
}

/* ==== the log-sum-exp merge ==== */

/* Entries per partition of ak_dec over n live entries (pos0 + T or a
 * selection's length, read on the device) and S partitions in the grid: the
 * fewest whole units (a unit: one 16-entry step per warp of a block) that
 * cover n in S partitions, so that a short context fills a few partitions
 * (whole blocks) and the others exit at once; ceil(n / plen) of them are
 * live. ak_merge computes the same. */
static __device__ __forceinline__ int akd_plen(int n, int S, int unit)
{
    int per = (n + S - 1) / S;
    per = (per + unit - 1) / unit * unit;
    return per < unit ? unit : per;
}

static __device__ __forceinline__ int akd_live(int n, int S, int unit)
{
    int plen = akd_plen(n, S, unit);
    return n > 0 ? (n + plen - 1) / plen : 0;
}

/* A row's partials from ak_dec's `live` partitions of nw warps: one (ak_dec
 * wrote the output) when one is live; one a warp, its fragments stored as
 * they are, while that makes at most AKD_WARP_PARTS (ak_merge's one round
 * of loads at E <= 128), so that the block's own merge of its warps, most
 * of its time after the steps at short contexts, is left to ak_merge's;
 * else one a partition. */
#define AKD_WARP_PARTS 64

static __device__ __forceinline__ bool akd_per_warp(int live, int nw)
{
    return live > 1 && live * nw <= AKD_WARP_PARTS;
}

static __device__ __forceinline__ int akd_parts(int live, int nw)
{
    return akd_per_warp(live, nw) ? live * nw : live;
}

/* Programmatic dependent launch (sm_90, gpu_compat.h): ak_dec is launched
 * while the kernel ahead still runs and waits for it first; it lets its
 * merge be launched while its own blocks still run (the launch latency
 * hides behind them); the merge waits for ak_dec's grid to complete, its
 * writes visible, before it reads the partials. Both are no-ops in a launch
 * without the attribute. */

/* One merge: S partials (S, TH, 2) and (S, TH, E) into out (TH, E). unit
 * > 0: ak_dec's partials, only the live ones written (akd_live of the row's
 * entries, from pos0 + T dense or the selection's length of query t = o / H
 * QSA); with one live partition ak_dec wrote the row itself. */
struct akm_args {
    const float *ml, *acc;
    float *out;
    int8_t *out_q;
    float4 *out_ds;
    int S, TH, E;
    int unit, T, H, qsa;
    int multi;     /* ak_dec's: row o's query t = o / H at pos0[t], one cell of its own */
    const int32_t *pos0;
    const int64_t *sel_off;
    int settled;   /* gpu_attn's */
    int out_bt;    /* gpu_attn's */
    int nw;        /* ak_dec's warps a block (akd_parts) */
};

/* Row o of the output from its S partials (one block per row): weights
 * w_s = e^(m_s - M), out = Σ w_s·acc_s / Σ w_s·l_s. A partition that saw
 * no cell (m = -inf) has weight 0 and its acc, never written, is read but
 * selected away (0·NaN would not be 0). The partials are spread over the
 * block's warps so that their loads are in flight together (up to 128
 * partials a row at long contexts), each warp's sums then added in warp
 * order. Every warp forms M and L itself, lane j from partials j, j + 32,
 * ..., with shuffles: the block meets at one barrier, before the warps'
 * sums are added (its three barriers and the loops over S in each thread
 * were most of its time: BENCH.md, twenty-second pass). */
#define AK_MERGE_W 8 /* warps of an ak_merge block */
#define AKM_LS (AK_SPLIT_MAX / 32) /* (m, l) pairs a lane holds */

/* Output element i = y, also into the int8 blocks q / ds (gpu_quant.h's
 * encoder) when q is set: the calling warp holds one block of 32, element i
 * in lane i % 32. */
static __device__ __forceinline__ void ak_store_out(float *out, int8_t *q, float4 *ds, size_t i, float y, int n,
                                                    int bt)
{
    out[i] = y;
    if (q) {
        const float v[1] = {y};
        int c[1];
        float4 sc = gq_q8_act<1>(v, c);
        size_t j = gq_act_at(i, n, bt);   /* (rows of n = H·E) */
        q[j] = (int8_t)c[0];
        if (i % 32 == 0)
            ds[j / 32] = sc;
    }
}

/* Partials s0, s0 + AK_MERGE_W, ... (NP of them, the warp's loads in
 * flight together) of row o into x, lane's elements; the last live one
 * stands in past the end (read, not added). */
template <int NE, int NP>
static __device__ __forceinline__ void akm_load(float (&x)[NP][NE], const float *acc, int s0, int S, int TH, int o,
                                                int E, int lane)
{
#pragma unroll
    for (int j = 0; j < NP; j++) {
        const float *src = acc + ((size_t)min(s0 + j * AK_MERGE_W, S - 1) * TH + o) * E;
#pragma unroll
        for (int k = 0; k < NE; k++)
            x[j][k] = lane + 32 * k < E ? src[lane + 32 * k] : 0.0f;
    }
}

/* NE: a lane's elements of a row, E <= 32·NE (akm_pick: the least power of
 * two that holds E; loops 16 long whatever E, each step guarded, cost 2%
 * of a decode step: BENCH.md, twenty-second pass). NP: the partials a warp
 * loads at once. */
template <int NE>
__global__ void __launch_bounds__(32 * AK_MERGE_W) ak_merge(akm_args m)
{
    GPU_TRACE(GT_MERGE);
    constexpr int NP = NE <= 4 ? 8 : 32 / NE;
    __shared__ float part[AK_MERGE_W][32 * NE];
    int o = blockIdx.x, tid = threadIdx.x, wp = tid >> 5, lane = tid & 31, S = m.S, TH = m.TH, E = m.E;
    const float *ml = m.ml, *acc = m.acc;
    /* the position before the wait where it is no kernel's output
     * (gpu_attn's settled); then the wait first of all else: the stream's
     * next kernel waits for this one alone, so this one returns only after
     * ak_dec's grid is complete. (Letting that kernel launch first, so that
     * the wo product's blocks wait with their first rows, measured 3.5%
     * slower on the 8B: BENCH.md, twentieth pass.) */
    int t = o / m.H, p0 = m.settled && !m.qsa ? m.pos0[m.multi ? t : 0] : 0;
    gpu_grid_wait();
    if (m.unit) {
        int n = m.qsa     ? (int)(m.sel_off[t + 1] - m.sel_off[t])
              : m.multi ? (m.settled ? p0 : m.pos0[t]) + 1
                        : (m.settled ? p0 : *m.pos0) + m.T;
        S = akd_parts(akd_live(n, m.S, m.unit), m.nw);
        if (S == 1)
            return; /* ak_dec wrote the row */
    }
    /* the warp's first NP partials and the lane's (m, l): loads in flight together */
    float x[NP][NE];
    akm_load<NE, NP>(x, acc, wp, S, TH, o, E, lane);
    /* (the loops over k stop at S for the whole warp: KS of them) */
    int KS = (S + 31) / 32;
    float2 ls[AKM_LS];
#pragma unroll
    for (int k = 0; k < AKM_LS; k++) {
        int s = lane + 32 * k;
        ls[k] = s < S ? *(const float2 *)(ml + ((size_t)s * TH + o) * 2) : make_float2(-INFINITY, 0.0f);
        if (k + 1 == KS)
            break;
    }
    GPU_TRACE_MARK();   /* the loads issued (the measuring build) */
    float M = ls[0].x;
#pragma unroll
    for (int k = 1; k < AKM_LS && k < KS; k++)
        M = fmaxf(M, ls[k].x);
    M = warp_max(M);
    float L = 0.0f, wk[AKM_LS];   /* wk[k]: partial lane + 32k's weight */
#pragma unroll
    for (int k = 0; k < AKM_LS && k < KS; k++) {
        wk[k] = ls[k].x == -INFINITY ? 0.0f : ak_exp(ls[k].x - M);
        L = fmaf(wk[k], ls[k].y, L);
    }
    L = warp_sum(L);
    GPU_TRACE_AT(1);   /* M and L formed */
    float v[NE];
#pragma unroll
    for (int k = 0; k < NE; k++)
        v[k] = 0.0f;
    /* added in the order of s */
    for (int s0 = wp; s0 < S; s0 += NP * AK_MERGE_W) {
        if (s0 != wp)
            akm_load<NE, NP>(x, acc, s0, S, TH, o, E, lane);
#pragma unroll
        for (int j = 0; j < NP; j++) {
            int s = s0 + j * AK_MERGE_W;
            if (s >= S)
                break;
            float wt = 0.0f;   /* partial s's weight, from lane s % 32 */
#pragma unroll
            for (int k = 0; k < AKM_LS && k < KS; k++) {
                float u = gpu_shfl(wk[k], s & 31);
                wt = s >> 5 == k ? u : wt;
            }
#pragma unroll
            for (int k = 0; k < NE; k++)
                if (lane + 32 * k < E)
                    v[k] = fmaf(wt, wt != 0.0f ? x[j][k] : 0.0f, v[k]);
        }
    }
#pragma unroll
    for (int k = 0; k < NE; k++)
        if (lane + 32 * k < E)
            part[wp][lane + 32 * k] = v[k];
    __syncthreads();
    GPU_TRACE_AT(2);   /* the warps' sums in shared memory */
    float inv = L > 0.0f ? 1.0f / L : 0.0f;
    for (int e = tid; e < E; e += 32 * AK_MERGE_W) {
        float y = 0.0f;
        for (int w = 0; w < AK_MERGE_W; w++)
            y += part[w][e];
        ak_store_out(m.out, m.out_q, m.out_ds, (size_t)o * E + e, y * inv, m.H * E, m.out_bt);
    }
}

typedef void (*akm_fn)(akm_args);

static akm_fn akm_pick(int E)
{
    return E <= 64 ? ak_merge<2> : E <= 128 ? ak_merge<4> : E <= 256 ? ak_merge<8> : ak_merge<16>;
}

/* ==== ak_simt: one warp per row ==== */

/* Row o = (t, query head) of the output over entries [s·plen, ...) of its
 * cells (causal) or list. Lane-strided q and acc (NE per lane); per block
 * of 32 entries each score is a warp sum and lands in lane j, then one
 * online-softmax step: max, rescale, p = e^(s - m), acc += p·v. */
template <int KR, int VR, int NE>
__global__ void __launch_bounds__(32 * AK_SIMT_ROWS) ak_simt(ak_args a)
{
    int lane = threadIdx.x & 31;
    int o = blockIdx.x * AK_SIMT_ROWS + (threadIdx.x >> 5), s = blockIdx.y;
    int TH = a.T * a.H, E = a.E;
    if (o >= TH)
        return;
    int t = o / a.H, h = (o % a.H) / a.G;
    const int32_t *list = NULL;
    int n;
    if (a.qsa) {
        list = a.sel + a.sel_off[t];
        n = (int)(a.sel_off[t + 1] - a.sel_off[t]);
    } else {
        n = *a.pos0 + t + 1;
    }
    int e_lo = s * a.plen, e_hi = min(n, e_lo + a.plen);
    float qv[NE], acc[NE];
#pragma unroll
    for (int i = 0; i < NE; i++) {
        int e = lane + 32 * i;
        qv[i] = e < E ? a.q[(size_t)o * E + e] : 0.0f;
        acc[i] = 0.0f;
    }
    float m = -INFINITY, l = 0.0f;
    for (int c0 = e_lo; c0 < e_hi; c0 += 32) {
        int nb = min(32, e_hi - c0);
        float my = -INFINITY;
        for (int j = 0; j < nb; j++) {
            int cell = list ? list[c0 + j] : c0 + j;
            const uint8_t *kr = ak_krow(a, h, cell);
            float d = 0.0f;
#pragma unroll
            for (int i = 0; i < NE; i++)
                if (lane + 32 * i < E)
                    d = fmaf(qv[i], ak_elem<KR>(kr, lane + 32 * i), d);
            d = warp_sum(d);
            if (lane == j)
                my = d * a.scale;
        }
        float mn = fmaxf(m, warp_max(my));
        if (mn == -INFINITY)
            continue; /* only -inf scores so far: nothing to weigh */
        float alpha = m == -INFINITY ? 0.0f : ak_exp(m - mn);
        float p = my == -INFINITY ? 0.0f : ak_exp(my - mn);
        l = l * alpha + warp_sum(p);
        m = mn;
#pragma unroll
        for (int i = 0; i < NE; i++)
            acc[i] *= alpha;
        for (int j = 0; j < nb; j++) {
            float pj = gpu_shfl(p, j);
            const uint8_t *vr = ak_vrow(a, h, list ? list[c0 + j] : c0 + j);
#pragma unroll
            for (int i = 0; i < NE; i++)
                if (lane + 32 * i < E)
                    acc[i] = fmaf(pj, ak_elem<VR>(vr, lane + 32 * i), acc[i]);
        }
    }
    if (a.ml) {
        size_t row = (size_t)s * TH + o;
        if (lane == 0) {
            a.ml[row * 2] = m;
            a.ml[row * 2 + 1] = l;
        }
#pragma unroll
        for (int i = 0; i < NE; i++)
            if (lane + 32 * i < E && m != -INFINITY)
                a.acc[row * E + lane + 32 * i] = acc[i];
        return;
    }
    float inv = l > 0.0f ? 1.0f / l : 0.0f;
#pragma unroll
    for (int i = 0; i < NE; i++)
        if (lane + 32 * i < E)
            a.out[(size_t)o * E + lane + 32 * i] = acc[i] * inv;
}

/* ==== ak_mma: tensor cores (sm_80+) ==== */

#if defined(GPU_CUDA) && defined(__CUDA_ARCH__) && __CUDA_ARCH__ >= 800
#define AK_MMA_BODY 1
#endif

#ifdef AK_MMA_BODY
/* x = hi + lo: hi = f16(x), lo = f16(x - hi). */
static __device__ __forceinline__ void ak_split2(float x, float y, uint32_t *hi, uint32_t *lo)
{
    __half2 h = __floats2half2_rn(x, y);
    float2 f = __half22float2(h);
    *hi = *(uint32_t *)&h;
    *lo = gpu_pack16(x - f.x, y - f.y);
}

/* The mma kernels' rows: a lane holds rows g (A) and g + 8 (B) of its
 * warp's 16, and columns 2t4, 2t4 + 1 of each 8-wide n-tile of O (the C
 * fragments' layout). */

/* O's two rows times their online-softmax rescale factors. */
template <int NT>
static __device__ __forceinline__ void ak_scale_rows(float (&O)[NT][4], float alA, float alB)
{
#pragma unroll
    for (int nt = 0; nt < NT; nt++) {
        O[nt][0] *= alA;
        O[nt][1] *= alA;
        O[nt][2] *= alB;
        O[nt][3] *= alB;
    }
}

/* A row's maximum over the quad of lanes that hold its columns. */
static __device__ __forceinline__ float ak_quad_max(float x)
{
    x = fmaxf(x, gpu_shfl_xor(x, 1));
    return fmaxf(x, gpu_shfl_xor(x, 2));
}

/* A step's scores S (64 entries from c0): -inf past each row's last
 * visible entry (limA, limB; -1: no row). */
static __device__ __forceinline__ void ak_mask(float (&S)[8][4], int c0, int t4, int limA, int limB)
{
#pragma unroll
    for (int nt = 0; nt < 8; nt++)
#pragma unroll
        for (int c = 0; c < 2; c++) {
            int ent = c0 + nt * 8 + 2 * t4 + c;
            S[nt][c] = ent <= limA ? S[nt][c] : -INFINITY;
            S[nt][2 + c] = ent <= limB ? S[nt][2 + c] : -INFINITY;
        }
}

/* Each row's maximum over a step's scores (xA, xB), pairwise: a chain
 * of 4 where a running maximum is one of 16. */
static __device__ __forceinline__ void ak_row_max(const float (&S)[8][4], float *xA, float *xB)
{
    float a[8], b[8];
#pragma unroll
    for (int nt = 0; nt < 8; nt++) {
        a[nt] = fmaxf(S[nt][0], S[nt][1]);
        b[nt] = fmaxf(S[nt][2], S[nt][3]);
    }
#pragma unroll
    for (int n = 4; n >= 1; n /= 2)
#pragma unroll
        for (int j = 0; j < n; j++) {
            a[j] = fmaxf(a[j], a[j + n]);
            b[j] = fmaxf(b[j], b[j + n]);
        }
    *xA = ak_quad_max(a[0]);
    *xB = ak_quad_max(b[0]);
}

/* A row's sum over the quad of lanes that hold its columns. */
static __device__ __forceinline__ float ak_quad_sum(float x)
{
    x += gpu_shfl_xor(x, 1);
    return x + gpu_shfl_xor(x, 2);
}

/* O's rows times fA and fB into rows oA and oB (E floats each) of out,
 * where they exist (okA, okB). */
template <int NT>
static __device__ __forceinline__ void ak_store_rows(float *out, const float (&O)[NT][4], float fA, float fB,
                                                     size_t oA, size_t oB, bool okA, bool okB, int t4, int E)
{
#pragma unroll
    for (int nt = 0; nt < NT; nt++) {
        int col = nt * 8 + 2 * t4;
        if (okA)
            *(float2 *)&out[oA * E + col] = make_float2(O[nt][0] * fA, O[nt][1] * fA);
        if (okB)
            *(float2 *)&out[oB * E + col] = make_float2(O[nt][2] * fB, O[nt][3] * fB);
    }
}

/* Four 8x8 f16 matrices, transposed: the B fragments of two n-tiles of V. */
static __device__ __forceinline__ void ak_ldm4t(uint32_t r[4], const void *p)
{
    unsigned addr = (unsigned)__cvta_generic_to_shared(p);
    asm volatile("ldmatrix.sync.aligned.m8n8.x4.trans.shared.b16 {%0,%1,%2,%3}, [%4];\n"
                 : "=r"(r[0]), "=r"(r[1]), "=r"(r[2]), "=r"(r[3])
                 : "r"(addr));
}

/* The bytes behind elements e8..e8+7 of a row, loaded first (all of a
 * step's loads in flight together), decoded after: f16 q = the 8 values;
 * int8 q.x, q.y = 8 codes, d = the scale's bits; Q4_0 q.x, q.y = the 8
 * nibble bytes, d = the block's f16 scale. Zeros for a missing row. */
struct ak_raw {
    uint4 q;
    uint32_t d;
};

template <int ROW>
static __device__ __forceinline__ ak_raw ak_fetch(const uint8_t *row, int e8)
{
    ak_raw r = {make_uint4(0, 0, 0, 0), 0};
    if (!row)
        return r;
    if (ROW == ROW_F16) {
        r.q = *(const uint4 *)(row + 2 * e8);
    } else if (ROW == ROW_I8) {
        r.d = *(const uint32_t *)row;
        r.q.x = *(const uint32_t *)(row + 4 + e8);
        r.q.y = *(const uint32_t *)(row + 8 + e8);
    } else {
        /* Q4_0: element j < 16 is the low nibble of qs[j], j >= 16 the high
         * nibble of qs[j - 16]; blocks and rows are 2-byte aligned */
        const uint8_t *b = row + (e8 >> 5) * 18;
        const uint16_t *qs = (const uint16_t *)(b + 2 + (e8 & 15));
        r.d = *(const uint16_t *)b;
        r.q.x = (uint32_t)qs[0] | (uint32_t)qs[1] << 16;
        r.q.y = (uint32_t)qs[2] | (uint32_t)qs[3] << 16;
    }
    return r;
}

/* ak_fetch's bytes as 8 f16 values, decoded as kv.c decodes them. */
template <int ROW>
static __device__ __forceinline__ uint4 ak_cvt(const ak_raw &r, int e8)
{
    if constexpr (ROW == ROW_F16) {
        return r.q;
    } else {
        float f[8];
#pragma unroll
        for (int m = 0; m < 8; m++) {
            uint32_t byte = ((m < 4 ? r.q.x : r.q.y) >> (8 * (m & 3))) & 255;
            if (ROW == ROW_I8)
                f[m] = (float)(int8_t)byte * __uint_as_float(r.d);
            else
                f[m] = (float)((int)((byte >> ((e8 & 31) < 16 ? 0 : 4)) & 15) - 8) *
                       __half2float(__ushort_as_half((unsigned short)r.d));
        }
        return make_uint4(gpu_pack16(f[0], f[1]), gpu_pack16(f[2], f[3]), gpu_pack16(f[4], f[5]), gpu_pack16(f[6], f[7]));
    }
}

/* int8 codes: exact s32 dots of 32 k per step. */
static __device__ __forceinline__ void ak_mma16832(int c[4], const uint32_t a[4], uint32_t b0, uint32_t b1)
{
    asm volatile("mma.sync.aligned.m16n8k32.row.col.s32.s8.s8.s32 "
                 "{%0,%1,%2,%3}, {%4,%5,%6,%7}, {%8,%9}, {%0,%1,%2,%3};\n"
                 : "+r"(c[0]), "+r"(c[1]), "+r"(c[2]), "+r"(c[3])
                 : "r"(a[0]), "r"(a[1]), "r"(a[2]), "r"(a[3]), "r"(b0), "r"(b1));
}
#endif

#define AK_PAD8 16 /* bytes after each int8 row (ak_mma with QK8) */

/* Shared bytes of ak_mma with rt rows per tile: entry row pointers, the V
 * step as f16, the K step and Q (f16 hi and lo; or int8 codes and one scale
 * per row with QK8). */
static size_t ak_mma_smem(int E, int rt_, int qk8)
{
    size_t rt = (size_t)rt_, v = (size_t)AK_BC * (E + AK_PAD) * 2;
    if (qk8)
        return 2 * AK_BC * sizeof(void *) + v + (AK_BC + rt) * (E + AK_PAD8 + 4);
    return 2 * AK_BC * sizeof(void *) + v + (AK_BC + 2 * rt) * (E + AK_PAD) * 2;
}

/* Block (partition s, kv head h, tile z): rows r0..r1-1 of the T·G rows of
 * kv head h (row r: query t = r/G, head h·G + r%G), dense: cells 0..pos0+t
 * each; QSA: one query's list. Thread lane holds rows g and g+8 of its
 * warp's 16 and, per step, 16 of the 64 columns (C fragment layout), which
 * become the A fragment of P·V without leaving registers. */
template <int KR, int VR, int E, bool QK8>
__global__ void __launch_bounds__(AK_THREADS) ak_mma(ak_args a)
{
#ifdef AK_MMA_BODY
    constexpr int LD = E + AK_PAD, NT = E / 8, LD8 = E + AK_PAD8;
    extern __shared__ __align__(16) uint8_t ak_smem[];
    const uint8_t **kp = (const uint8_t **)ak_smem;
    const uint8_t **vp = kp + AK_BC;
    constexpr int nth = AK_THREADS, nw = AK_THREADS / 32;
    int RT = a.rt;
    __half *Vs = (__half *)(vp + AK_BC);
    /* f16: K (64, LD), Q hi and lo (RT, LD); QK8: K codes (64, LD8), Q
     * codes (RT, LD8), then the K scales (64) and Q scales (RT) */
    __half *Ks = Vs + AK_BC * LD;
    __half *Qh = Ks + AK_BC * LD;
    __half *Ql = Qh + RT * LD;
    int8_t *Kc = (int8_t *)(Vs + AK_BC * LD);
    int8_t *Qc = Kc + AK_BC * LD8;
    float *kd = (float *)(Qc + RT * LD8);
    float *qd = kd + AK_BC;
    int tid = threadIdx.x, lane = tid & 31, w = tid >> 5, g = lane >> 2, t4 = lane & 3;
    int s = blockIdx.x, h = blockIdx.y, G = a.G, p0 = *a.pos0, r0, r1;
    const int32_t *list;
    /* prompt: the tiles with the most cells start first */
    int n_ent = ak_tile_rows(a, RT, a.ml ? (int)blockIdx.z : a.tiles - 1 - (int)blockIdx.z, p0, &r0, &r1, &list);
    int e_lo = s * a.plen, e_hi = min(n_ent, e_lo + a.plen);
    int TH = a.T * a.H;
    int rA = r0 + w * 16 + g, rB = rA + 8;
    int oA = rA / G * a.H + h * G + rA % G, oB = rB / G * a.H + h * G + rB % G;
    /* a row's last visible entry: its cell limit, or every entry of a list */
    int limA = rA >= r1 ? -1 : a.qsa ? INT_MAX : p0 + rA / G;
    int limB = rB >= r1 ? -1 : a.qsa ? INT_MAX : p0 + rB / G;
    int wfirst = r0 + w * 16, wlast = min(wfirst + 15, r1 - 1);
    int wlim = wfirst >= r1 ? -1 : a.qsa ? INT_MAX : p0 + wlast / G;

    if (e_lo >= e_hi) {
        /* a partition past the live cells: no weight in the merge */
        if (t4 == 0) {
            if (limA >= 0) {
                a.ml[((size_t)s * TH + oA) * 2] = -INFINITY;
                a.ml[((size_t)s * TH + oA) * 2 + 1] = 0.0f;
            }
            if (limB >= 0) {
                a.ml[((size_t)s * TH + oB) * 2] = -INFINITY;
                a.ml[((size_t)s * TH + oB) * 2 + 1] = 0.0f;
            }
        }
        return;
    }
    if (QK8) {
        /* Q rows as int8 codes round(q/d), d = absmax/127 (kv.c's rule for
         * the keys), one warp per row */
        for (int i = w; i < RT; i += nw) {
            int rr = r0 + i;
            const float *src = a.q + ((size_t)(rr / G) * a.H + h * G + rr % G) * E;
            float amax = 0.0f;
            for (int e = lane; e < E && rr < r1; e += 32)
                amax = fmaxf(amax, fabsf(src[e]));
            amax = warp_max(amax);
            float id = amax > 0.0f ? 127.0f / amax : 0.0f;
            for (int e = lane; e < E; e += 32)
                Qc[i * LD8 + e] = rr < r1 ? (int8_t)fminf(127.0f, fmaxf(-127.0f, rintf(src[e] * id))) : 0;
            if (lane == 0)
                qd[i] = amax / 127.0f;
        }
    } else {
        for (int i = tid; i < RT * E; i += nth) {
            int rr = r0 + i / E, e = i % E;
            float x = 0.0f;
            if (rr < r1)
                x = a.q[((size_t)(rr / G) * a.H + h * G + rr % G) * E + e];
            __half hi = __float2half_rn(x);
            Qh[(i / E) * LD + e] = hi;
            Ql[(i / E) * LD + e] = __float2half_rn(x - __half2float(hi));
        }
    }
    float O[NT][4];
#pragma unroll
    for (int i = 0; i < NT; i++)
        O[i][0] = O[i][1] = O[i][2] = O[i][3] = 0.0f;
    float mA = -INFINITY, mB = -INFINITY, lA = 0.0f, lB = 0.0f;
    const __half *qh = Qh + (w * 16 + g) * LD + 2 * t4, *ql = Ql + (w * 16 + g) * LD + 2 * t4;
    __syncthreads(); /* Q and its scales are written before the first step reads them */

    /* the K and V rows of step c's entries (NULL past the end) */
    auto rows_of = [&](int c) {
        for (int j = tid; j < AK_BC; j += nth) {
            int ent = c + j;
            if (ent < e_hi) {
                int cell = list ? list[ent] : ent;
                kp[j] = ak_krow(a, h, cell);
                vp[j] = ak_vrow(a, h, cell);
            } else {
                kp[j] = vp[j] = NULL;
            }
        }
    };
    /* item `it` of a step: 8 values of one K row and of one V row; loaded
     * (fetch), then decoded into the shared tiles (store); missing rows
     * give zeros: 0·v, never 0·NaN */
    constexpr int IT = AK_BC * (E / 8) / nth;
    auto fetch = [&](int it, ak_raw &k, ak_raw &v) {
        int i = tid + it * nth, j = i / (E / 8), e8 = (i % (E / 8)) * 8;
        k = ak_fetch<KR>(kp[j], e8);
        v = ak_fetch<VR>(vp[j], e8);
    };
    auto store = [&](int it, const ak_raw &k, const ak_raw &v) {
        int i = tid + it * nth, j = i / (E / 8), e8 = (i % (E / 8)) * 8;
        if (QK8) {
            /* int8 rows: the codes as they are, the scale beside */
            *(uint2 *)&Kc[j * LD8 + e8] = make_uint2(k.q.x, k.q.y);
            if (e8 == 0)
                kd[j] = __uint_as_float(k.d);
        } else {
            *(uint4 *)&Ks[j * LD + e8] = ak_cvt<KR>(k, e8);
        }
        *(uint4 *)&Vs[j * LD + e8] = ak_cvt<VR>(v, e8);
    };
    /* E <= 128: the next step's bytes are loaded into registers while the
     * tensor cores work on this one; E = 256 has no registers to spare and
     * loads each step in batches of 4 items, all in flight at once */
    constexpr bool PIPE = E <= 128;
    ak_raw pk[PIPE ? IT : 1], pv[PIPE ? IT : 1];
    if (PIPE) {
        rows_of(e_lo);
        __syncthreads();
#pragma unroll
        for (int it = 0; it < (PIPE ? IT : 0); it++)
            fetch(it, pk[it], pv[it]);
    }

    for (int c0 = e_lo; c0 < e_hi; c0 += AK_BC) {
        __syncthreads(); /* the last step's tiles are consumed, its rows read */
        if (PIPE) {
#pragma unroll
            for (int it = 0; it < (PIPE ? IT : 0); it++)
                store(it, pk[it], pv[it]);
            rows_of(c0 + AK_BC);
            __syncthreads();
            if (c0 + AK_BC < e_hi) {
#pragma unroll
                for (int it = 0; it < (PIPE ? IT : 0); it++)
                    fetch(it, pk[it], pv[it]);
            }
        } else {
            rows_of(c0);
            __syncthreads();
            constexpr int BATCH = 4;
#pragma unroll
            for (int b0 = 0; b0 < IT; b0 += BATCH) {
                ak_raw kr[BATCH], vr[BATCH];
#pragma unroll
                for (int u = 0; u < BATCH; u++)
                    fetch(b0 + u, kr[u], vr[u]);
#pragma unroll
                for (int u = 0; u < BATCH; u++)
                    store(b0 + u, kr[u], vr[u]);
            }
            __syncthreads();
        }
        if (c0 > wlim)
            continue; /* every row of this warp is done (causal) */

        /* S = Q·Kᵀ: (16 rows) x (64 entries), Q as hi + lo */
        float S[8][4];
#pragma unroll
        for (int nt = 0; nt < 8; nt++)
            S[nt][0] = S[nt][1] = S[nt][2] = S[nt][3] = 0.0f;
        if (QK8) {
            /* int8 codes: exact integer dots, then d_q·d_k; the A fragment
             * holds 4 consecutive k of rows g and g+8, B 4 of cell g */
            int Si[8][4];
#pragma unroll
            for (int nt = 0; nt < 8; nt++)
                Si[nt][0] = Si[nt][1] = Si[nt][2] = Si[nt][3] = 0;
            const int8_t *qc = Qc + (w * 16 + g) * LD8 + 4 * t4;
#pragma unroll
            for (int kk = 0; kk < E / 32; kk++) {
                uint32_t aq[4];
                aq[0] = *(const uint32_t *)(qc + kk * 32);
                aq[1] = *(const uint32_t *)(qc + 8 * LD8 + kk * 32);
                aq[2] = *(const uint32_t *)(qc + kk * 32 + 16);
                aq[3] = *(const uint32_t *)(qc + 8 * LD8 + kk * 32 + 16);
#pragma unroll
                for (int nt = 0; nt < 8; nt++) {
                    const int8_t *kb = Kc + (nt * 8 + g) * LD8 + kk * 32 + 4 * t4;
                    ak_mma16832(Si[nt], aq, *(const uint32_t *)kb, *(const uint32_t *)(kb + 16));
                }
            }
            float dA = qd[w * 16 + g], dB = qd[w * 16 + g + 8];
#pragma unroll
            for (int nt = 0; nt < 8; nt++)
#pragma unroll
                for (int c = 0; c < 2; c++) {
                    float dk = kd[nt * 8 + 2 * t4 + c];
                    S[nt][c] = (float)Si[nt][c] * (dA * dk);
                    S[nt][2 + c] = (float)Si[nt][2 + c] * (dB * dk);
                }
        }
#pragma unroll
        for (int kk = 0; kk < E / 16 && !QK8; kk++) {
            uint32_t ah[4], al[4];
            ah[0] = *(const uint32_t *)(qh + kk * 16);
            ah[1] = *(const uint32_t *)(qh + 8 * LD + kk * 16);
            ah[2] = *(const uint32_t *)(qh + kk * 16 + 8);
            ah[3] = *(const uint32_t *)(qh + 8 * LD + kk * 16 + 8);
            al[0] = *(const uint32_t *)(ql + kk * 16);
            al[1] = *(const uint32_t *)(ql + 8 * LD + kk * 16);
            al[2] = *(const uint32_t *)(ql + kk * 16 + 8);
            al[3] = *(const uint32_t *)(ql + 8 * LD + kk * 16 + 8);
#pragma unroll
            for (int nt = 0; nt < 8; nt++) {
                const __half *kb = Ks + (nt * 8 + g) * LD + kk * 16 + 2 * t4;
                uint32_t b0 = *(const uint32_t *)kb, b1 = *(const uint32_t *)(kb + 8);
                gpu_mma16816(S[nt], al, b0, b1);
                gpu_mma16816(S[nt], ah, b0, b1);
            }
        }
        /* scale, mask, the block max of each row (over the quad of lanes) */
        float xA = -INFINITY, xB = -INFINITY;
#pragma unroll
        for (int nt = 0; nt < 8; nt++)
#pragma unroll
            for (int c = 0; c < 2; c++) {
                int ent = c0 + nt * 8 + 2 * t4 + c;
                S[nt][c] = ent < e_hi && ent <= limA ? S[nt][c] * a.scale : -INFINITY;
                S[nt][2 + c] = ent < e_hi && ent <= limB ? S[nt][2 + c] * a.scale : -INFINITY;
                xA = fmaxf(xA, S[nt][c]);
                xB = fmaxf(xB, S[nt][2 + c]);
            }
        xA = ak_quad_max(xA);
        xB = ak_quad_max(xB);
        float nA = fmaxf(mA, xA), nB = fmaxf(mB, xB);
        /* online rescale: what was summed relative to m_old moves to m_new
         * (factor <= 1); a row with only -inf so far keeps m = -inf and
         * weighs nothing (exp(-inf - -inf) would be NaN) */
        float alA = nA == -INFINITY || mA == -INFINITY ? 0.0f : expf(mA - nA);
        float alB = nB == -INFINITY || mB == -INFINITY ? 0.0f : expf(mB - nB);
        float sA = 0.0f, sB = 0.0f;
#pragma unroll
        for (int nt = 0; nt < 8; nt++)
#pragma unroll
            for (int c = 0; c < 2; c++) {
                S[nt][c] = S[nt][c] == -INFINITY ? 0.0f : expf(S[nt][c] - nA);
                S[nt][2 + c] = S[nt][2 + c] == -INFINITY ? 0.0f : expf(S[nt][2 + c] - nB);
                sA += S[nt][c];
                sB += S[nt][2 + c];
            }
        lA = lA * alA + sA; /* this lane's columns; the quad is summed at the end */
        lB = lB * alB + sB;
        mA = nA;
        mB = nB;
        ak_scale_rows(O, alA, alB);
        /* O += P·V, P as hi + lo: entries 16kk.. of the C fragment are the
         * A fragment of this product */
#pragma unroll
        for (int kk = 0; kk < 4; kk++) {
            uint32_t ph[4], pl[4];
            ak_split2(S[2 * kk][0], S[2 * kk][1], &ph[0], &pl[0]);
            ak_split2(S[2 * kk][2], S[2 * kk][3], &ph[1], &pl[1]);
            ak_split2(S[2 * kk + 1][0], S[2 * kk + 1][1], &ph[2], &pl[2]);
            ak_split2(S[2 * kk + 1][2], S[2 * kk + 1][3], &ph[3], &pl[3]);
#pragma unroll
            for (int np = 0; np < E / 16; np++) {
                uint32_t b[4];
                ak_ldm4t(b, Vs + (kk * 16 + (lane & 15)) * LD + np * 16 + (lane >> 4) * 8);
                gpu_mma16816(O[2 * np], pl, b[0], b[1]);
                gpu_mma16816(O[2 * np], ph, b[0], b[1]);
                gpu_mma16816(O[2 * np + 1], pl, b[2], b[3]);
                gpu_mma16816(O[2 * np + 1], ph, b[2], b[3]);
            }
        }
    }
    lA = ak_quad_sum(lA);
    lB = ak_quad_sum(lB);
    if (a.ml) {
        if (t4 == 0) {
            if (limA >= 0) {
                a.ml[((size_t)s * TH + oA) * 2] = mA;
                a.ml[((size_t)s * TH + oA) * 2 + 1] = lA;
            }
            if (limB >= 0) {
                a.ml[((size_t)s * TH + oB) * 2] = mB;
                a.ml[((size_t)s * TH + oB) * 2 + 1] = lB;
            }
        }
        ak_store_rows(a.acc, O, 1.0f, 1.0f, (size_t)s * TH + oA, (size_t)s * TH + oB, limA >= 0, limB >= 0, t4, E);
        return;
    }
    float iA = lA > 0.0f ? 1.0f / lA : 0.0f, iB = lB > 0.0f ? 1.0f / lB : 0.0f;
    ak_store_rows(a.out, O, iA, iB, oA, oB, limA >= 0, limB >= 0, t4, E);
#else
    (void)a;
#endif
}

/* ==== ak_dec: decode windows, tensor cores (sm_80+) ==== */

/* ak_dec's shared memory. Per warp a ring of NST stages, each the K rows
 * then the V rows of one step's C entries (C = 16 or 32: one or two m-tiles
 * of K·Qᵀ, k-steps of Vᵀ·Pᵀ), raw bytes at strides chosen so that the
 * fragment loads below hit 32 distinct banks (f16 K: 8 mod 32 words, f16 V
 * and int8: 4 mod 32); after the loop the rings hold the warps' partials
 * for the block's merge. Then per warp the 2·C row pointers of the step
 * being loaded, and the Pᵀ tile (8·NB rows, C entries, PLD floats a row).
 * NW warps: 4, 2 for E = 256 (registers). NSTQ: the stages asked for (0: 3
 * where the ring fits in 64 KB, else 2). ROW_I8C: int8 rows without
 * padding (33 words a row), the fragment loads taking a lane's words in an
 * order that keeps them on distinct banks (ak_dec); dense, the 16 K rows
 * of a 16-entry half step, like its 16 V rows, are one run of 16·132 bytes
 * in the page (a half step lies within one page), copied in 16-byte pieces
 * (a quarter of the copies of 4-byte ones); QSA copies the same layout row
 * by row, so that both sum in one order. E = 128. */
template <int ROW, int E, int NB, int NSTQ, int C>
struct akd_shape {
    static constexpr int NW = E >= 256 ? 2 : 4;
    static constexpr int KS = ROW == ROW_F16 ? 2 * E + 32 : ROW == ROW_I8C ? E + 4 : E + 16;
    static constexpr int VS = ROW == ROW_F16 ? 2 * E + 16 : ROW == ROW_I8C ? E + 4 : E + 16;
    static constexpr int STAGE = C * (KS + VS);
    static constexpr int NST = NSTQ ? NSTQ : 3 * STAGE * NW <= 65536 ? 3 : 2;
    static constexpr int RING = NW * NST * STAGE;
    /* per warp row m (then its weight), l and Oᵀ (akd_opos: up to E + 4);
     * per row M, L and its output row */
    static constexpr int MERGE = (NW * 8 * NB * (E + 6) + 3 * 8 * NB) * 4;
    static constexpr int BIG = RING > MERGE ? RING : MERGE;
    static constexpr int PLD = C + 8;
    static constexpr int SMEM = BIG + NW * 2 * C * 8 + NW * 8 * NB * PLD * 4;
};

#ifdef AK_MMA_BODY
/* Asynchronous copies global → shared; ok = 0 writes zeros and reads
 * nothing (a step's entries past the partition: 0·v, never 0·NaN). */
static __device__ __forceinline__ void akd_cp16(void *dst, const void *src, bool ok)
{
    unsigned d = (unsigned)__cvta_generic_to_shared(dst);
    asm volatile("cp.async.cg.shared.global [%0], [%1], 16, %2;\n" ::"r"(d), "l"(src), "r"(ok ? 16 : 0)
                 : "memory");
}

/* 16 bytes of which the first n (0..16) are copied, the rest zeros. */
static __device__ __forceinline__ void akd_cp16n(void *dst, const void *src, int n)
{
    unsigned d = (unsigned)__cvta_generic_to_shared(dst);
    asm volatile("cp.async.cg.shared.global [%0], [%1], 16, %2;\n" ::"r"(d), "l"(src), "r"(n) : "memory");
}

static __device__ __forceinline__ void akd_cp4(void *dst, const void *src, bool ok)
{
    unsigned d = (unsigned)__cvta_generic_to_shared(dst);
    asm volatile("cp.async.ca.shared.global [%0], [%1], 4, %2;\n" ::"r"(d), "l"(src), "r"(ok ? 4 : 0)
                 : "memory");
}

static __device__ __forceinline__ void akd_commit()
{
    asm volatile("cp.async.commit_group;\n" ::: "memory");
}

template <int N>
static __device__ __forceinline__ void akd_wait()
{
    asm volatile("cp.async.wait_group %0;\n" ::"n"(N) : "memory");
}


/* ROW_I8C: the word (of 32 codes words of a V row) that lane row g reads
 * in chunk j of Oᵀ: over j and g all 32, and for one j, with the lanes'
 * cells 2t4 + {0, 1, 8, 9} at 33 words a row, 32 distinct banks. */
static __device__ __forceinline__ int akd_vword(int j, int g)
{
    return 8 * (g >> 1) + (g & 1) + 2 * j;
}

/* Where the block's merge keeps element e of Oᵀ's row `row` (warp w's
 * query row r: row w·NR + r). A warp stores an element of each of its
 * lanes' rows 2t4 + c at once (e from the lane's g as the Vᵀ·Pᵀ fragment
 * lays it out), and the readers take 32 consecutive e of one row: both on
 * 32 distinct banks. Plain rows: e XOR t4 (without it, four lanes a bank);
 * ROW_I8C rows (e = 32(g >> 1) + 4(g & 1) + ..., sixteen lanes a bank as
 * row·E + e): rows of E + 4 and e skewed by e / 32. */
template <int ROW, int E>
static __device__ __forceinline__ int akd_opos(int row, int e)
{
    return ROW == ROW_I8C ? row * (E + 4) + e + (e >> 5) : row * E + (e ^ ((row >> 1) & 3));
}

/* 2^x by the special function unit (relative error ~2^-22, as CUDA's expf;
 * 2^-inf = 0): ak_dec's softmax keeps its scores in base 2, log2(e) folded
 * into the scale, so that each weight is one instruction, not expf's
 * range reduction. */
#define AKD_LOG2E 1.44269504088896341f
#define AKD_LN2 0.693147180559945309f
static __device__ __forceinline__ float akd_ex2(float x)
{
    float y;
    asm("ex2.approx.ftz.f32 %0, %1;" : "=f"(y) : "f"(x));
    return y;
}

/* The least power of two above x > 0 (frexpf's 2^e, x = f·2^e, f in
 * [0.5, 1)) and its reciprocal, exactly, from x's exponent bits; x normal
 * and below 2^126. x = 0: both 1. */
static __device__ __forceinline__ void akd_pow2_above(float x, float *p, float *ip)
{
    unsigned e = __float_as_uint(x) >> 23;
    *p = x > 0.0f ? __uint_as_float((e + 1) << 23) : 1.0f;
    *ip = x > 0.0f ? __uint_as_float((253 - e) << 23) : 1.0f;
}

/* Four int8 codes (bytes 0..3 of w) as two f16 pairs (0,1) and (2,3),
 * exactly: each code + 128 becomes the low mantissa byte of 1024 (0x6400),
 * and 1024 + 128 is subtracted. */
static __device__ __forceinline__ void akd_i8x4(uint32_t w, uint32_t *lo, uint32_t *hi)
{
    uint32_t u = w ^ 0x80808080u;
    uint32_t x = __byte_perm(u, 0x64646464u, 0x4140), y = __byte_perm(u, 0x64646464u, 0x4342);
    const __half2 bias = __halves2half2(__ushort_as_half(0x6480), __ushort_as_half(0x6480));
    __half2 hx = __hsub2(*(__half2 *)&x, bias), hy = __hsub2(*(__half2 *)&y, bias);
    *lo = *(uint32_t *)&hx;
    *hi = *(uint32_t *)&hy;
}
#endif

/* Block (partition s, kv head h, z): the R = T·G rows of kv head h
 * (dense; row r: query r / G, head h·G + r % G, causal) or query z's G
 * rows over its list (QSA), R <= 8·NB. Each warp walks every NW-th step of
 * C entries (16 or 32) of the partition, loaded by cp.async NST - 1 steps
 * ahead, and keeps its own online softmax; at the end each warp writes
 * its own partial of each row while the live partitions are few
 * (akd_per_warp), else the block merges its warps and writes one partial
 * per row. The products are transposed so
 * that the cells fill the 16 rows of the mma (C / 16 m-tiles) and the few
 * query rows its 8 columns: Sᵀ = K·Qᵀ (A = 16 K rows, B = Q as f16 hi +
 * lo, in registers), then Oᵀ += Vᵀ·Pᵀ (A = Vᵀ, B = P as hi + lo through
 * shared memory, C / 16 k-steps). int8 rows enter as their codes, exact in
 * f16: a K row's scale multiplies its scores, a V row's is folded into P.
 * Any order of a product's reduction index and of Oᵀ's rows serves as long
 * as both operands follow it: lane (g, t4) takes head-dim elements 16ks +
 * 4t4 .. +3 as its k of step ks (one 4-element load of a K row), and Oᵀ's
 * m-tiles 2j, 2j+1 hold the elements 32j + 4g + {0, 1} and {2, 3} (one
 * 4-element load of a V row). C = 32 halves the steps, and with them each
 * step's chain of waits (copy, softmax shuffles, rescale, Pᵀ round trip),
 * per byte; its two m-tiles of K·Qᵀ are independent chains of mma. */
template <int ROW, int E, int NB, int NSTQ, int C>
__global__ void __launch_bounds__(32 * akd_shape<ROW, E, NB, NSTQ, C>::NW) ak_dec(ak_args a)
{
#ifdef AK_MMA_BODY
    GPU_TRACE(GT_DEC);
    using SH = akd_shape<ROW, E, NB, NSTQ, C>;
    constexpr int NW = SH::NW, KS = SH::KS, VS = SH::VS, NST = SH::NST, PLD = SH::PLD, KT = E / 16;
    constexpr int MT = E / 16, NR = 8 * NB, MC = C / 16;
    constexpr int SP = 32 / MC; /* steps whose pages (one per 16-entry half) a register holds */
    extern __shared__ __align__(16) uint8_t ak_smem[];
    int lane = threadIdx.x & 31, w = threadIdx.x >> 5, g = lane >> 2, t4 = lane & 3;
    /* Launched early: q, the new cells' K/V rows and a QSA list come from
     * the kernels ahead, so it waits for them; with a.settled (dense) it
     * first copies its first steps of cells before pos0, which no kernel
     * ahead writes (nor pos0 and the page table): their loads overlap the
     * kernels ahead instead of following them. */
    bool early = a.settled && !a.qsa;
    if (!early)
        gpu_grid_wait();
    /* multi: query z of a batch is cell pos0[z] of its own sequence */
    int s = blockIdx.x, h = blockIdx.y, G = a.G, p0 = a.pos0[a.multi ? blockIdx.z : 0];
    const int32_t *pt = a.pt + (a.multi ? (size_t)blockIdx.z * a.pt_stride : 0);
    uint8_t *ring = ak_smem + (size_t)w * NST * SH::STAGE;
    const uint8_t **rp = (const uint8_t **)(ak_smem + SH::BIG) + w * 2 * C;
    float *ps = (float *)(ak_smem + SH::BIG + NW * 2 * C * 8) + w * NR * PLD;
    const int32_t *list = NULL;
    int R, n_ent, tz = 0;
    if (a.qsa) {
        tz = blockIdx.z;
        R = G;
        list = a.sel + a.sel_off[tz];
        n_ent = (int)(a.sel_off[tz + 1] - a.sel_off[tz]);
    } else if (a.multi) {
        tz = blockIdx.z;
        R = G;
        n_ent = p0 + 1;
    } else {
        R = a.T * G;
        n_ent = p0 + a.T;
    }
    auto out_row = [&](int r) { return (a.qsa || a.multi ? tz : r / G) * a.H + h * G + r % G; };
    int plen = a.unit ? akd_plen(n_ent, a.S, a.unit) : a.plen;
    int e_lo = s * plen, e_hi = min(n_ent, e_lo + plen);
    /* a partition past the live entries: the merge does not read it (with
     * unit), and one live partition writes the output itself */
    if (a.unit && e_lo >= e_hi)
        return;
    bool direct = a.unit && akd_live(n_ent, a.S, a.unit) == 1;
    gpu_grid_launch_dependents();
    /* the warp's step i into stage i % NST: the 2·C rows (K rows of its C
     * entries, then their V rows), lane + 32k pointing at row lane + 32k
     * (entry el = lane % C), then all copy. A lane's cell and page id for
     * the next step are loaded one step ahead (nc, npg), so that the
     * page-table load is not waited for before the copies. */
    const uint8_t *kbase = a.pages + ((size_t)a.layer * a.K + h) * (size_t)a.P * (a.kbytes + a.vbytes);
    const uint8_t *vbase = kbase + (size_t)a.P * a.kbytes;
    int el = lane & (C - 1);
    int nc = -1, npg = 0;
    auto ahead = [&](int i) {
        int ent = e_lo + (w + i * NW) * C + el;
        nc = ent < e_hi ? (list ? list[ent] : ent) : -1;
        npg = nc >= 0 ? pt[nc >> a.lp] : 0;
    };
    /* pgreg (dense): a step's 16-entry halves each lie in one page (P is a
     * power of two >= 16, steps start at multiples of C), and lane j holds
     * the page of half j % MC of the warp's step i0 + j / MC, loaded once
     * per SP steps: no global load waits among a step's copies, behind the
     * copies in flight before it */
    bool pgr = (a.pgreg || ROW == ROW_I8C) && !list;
    int pgs = 0;
    auto pages_from = [&](int i0) {
        int c = e_lo + (w + (i0 + lane / MC) * NW) * C + 16 * (lane % MC);
        pgs = c < e_hi ? pt[c >> a.lp] : 0;
    };
    if (pgr)
        pages_from(0);
    else
        ahead(0);

    int n_steps = e_hi > e_lo ? (e_hi - e_lo + C - 1) / C : 0;
    int my = n_steps > w ? (n_steps - w + NW - 1) / NW : 0; /* this warp's steps */
    auto issue = [&](int i) {
        __syncwarp(); /* the last step's pointers are read */
        int c0 = e_lo + (w + i * NW) * C, pga = 0, pgb = 0;
        if (pgr) {
            if (i > 0 && i % SP == 0)
                pages_from(i);
            pga = gpu_shfl(pgs, (i % SP) * MC);          /* the first half's page */
            pgb = gpu_shfl(pgs, (i % SP) * MC + MC - 1); /* the last half's */
        }
        int pg = el < 16 ? pga : pgb; /* this lane's entry's page */
        if (ROW != ROW_I8C || !pgr) {
#pragma unroll
            for (int k = 0; k < 2 * C / 32; k++) {
                bool isv = lane + 32 * k >= C;
                const uint8_t *base = isv ? vbase : kbase;
                size_t rb = isv ? a.vbytes : a.kbytes;
                const uint8_t *p;
                if (pgr)
                    p = c0 + el < e_hi ? base + (size_t)pg * a.page_bytes + (size_t)((c0 + el) & (a.P - 1)) * rb : NULL;
                else
                    p = nc >= 0 ? base + (size_t)npg * a.page_bytes + (size_t)(nc & (a.P - 1)) * rb : NULL;
                rp[lane + 32 * k] = p;
            }
            if (!pgr)
                ahead(i + 1);
        }
        __syncwarp();
        uint8_t *kst = ring + (i % NST) * SH::STAGE, *vst = kst + C * KS;
        if constexpr (ROW == ROW_F16) {
            constexpr int LPR = 2 * E / 16; /* 16-byte pieces of a row */
#pragma unroll
            for (int q = lane; q < 2 * C * LPR; q += 32) {
                int row = q / LPR, col = q % LPR;
                const uint8_t *src = rp[row];
                uint8_t *dst = row < C ? kst + row * KS + col * 16 : vst + (row - C) * VS + col * 16;
                akd_cp16(dst, src ? src + col * 16 : a.pages, src != NULL);
            }
        } else if (ROW == ROW_I8C && pgr && c0 + C <= e_hi) {
            /* a step of live rows: per half step the K run then the V run,
             * 16-byte pieces lane, lane + 32, ... of each (the addresses of
             * a run worked out once, not per piece) */
            constexpr int RUN = 16 * (E + 4), NP = RUN / 16;
#pragma unroll
            for (int r = 0; r < 2 * MC; r++) {
                int isv = r >= MC, hh = r % MC;
                const uint8_t *run = (isv ? vbase : kbase) + (size_t)(hh ? pgb : pga) * a.page_bytes +
                                     (size_t)((c0 + 16 * hh) & (a.P - 1)) * (E + 4);
                uint8_t *dst = (isv ? vst : kst) + hh * RUN;
#pragma unroll
                for (int pc = lane; pc < NP; pc += 32)
                    akd_cp16(dst + 16 * pc, run + 16 * pc, true);
            }
        } else if (ROW == ROW_I8C && pgr) {
            /* the last step: the bytes past its last live row are zeros (a
             * row's scale included) */
            constexpr int RUN = 16 * (E + 4), NP = RUN / 16;
#pragma unroll
            for (int q = lane; q < 2 * MC * NP; q += 32) {
                int isv = q >= MC * NP, rem = isv ? q - MC * NP : q, hh = rem / NP, pc = rem % NP;
                int c = c0 + 16 * hh, live = min(16, max(0, e_hi - c)) * (E + 4);
                int n = min(16, max(0, live - 16 * pc));
                const uint8_t *run =
                    (isv ? vbase : kbase) + (size_t)(hh ? pgb : pga) * a.page_bytes + (size_t)(c & (a.P - 1)) * (E + 4);
                akd_cp16n((isv ? vst : kst) + hh * RUN + 16 * pc, n ? run + 16 * pc : a.pages, n);
            }
        } else {
            /* rows of E + 4 bytes, 4-aligned: words, lane-strided per row;
             * the words past the last multiple of 32 spread over the lanes */
            constexpr int NWR = (E + 4) / 4, MAIN = NWR / 32 * 32, TAIL = NWR - MAIN;
#pragma unroll 4
            for (int row = 0; row < 2 * C; row++) {
                const uint8_t *src = rp[row];
                uint8_t *dst = row < C ? kst + row * KS : vst + (row - C) * VS;
#pragma unroll
                for (int wd = lane; wd < MAIN; wd += 32)
                    akd_cp4(dst + 4 * wd, src ? src + 4 * wd : a.pages, src != NULL);
            }
#pragma unroll
            for (int q = lane; q < 2 * C * TAIL; q += 32) {
                int row = q / TAIL, wd = MAIN + q % TAIL;
                const uint8_t *src = rp[row];
                uint8_t *dst = row < C ? kst + row * KS : vst + (row - C) * VS;
                akd_cp4(dst + 4 * wd, src ? src + 4 * wd : a.pages, src != NULL);
            }
        }
        akd_commit();
    };

    float O[NB][MT][4], m[NB][2], l[NB][2];
#pragma unroll
    for (int nb = 0; nb < NB; nb++) {
#pragma unroll
        for (int mt = 0; mt < MT; mt++)
            O[nb][mt][0] = O[nb][mt][1] = O[nb][mt][2] = O[nb][mt][3] = 0.0f;
        m[nb][0] = m[nb][1] = -INFINITY;
        l[nb][0] = l[nb][1] = 0.0f;
    }
    /* scores in base 2 (akd_ex2); int8 rows: Oᵀ kept divided by the last
     * step's dm (dmp), its rescale by the next step's al folded with
     * dmp/dm, one multiply a row, and by dmp once after the loop */
    const float scale2 = a.scale * AKD_LOG2E;
    float dmp = 1.0f;
    int pre = 0; /* steps copied before the wait: whole steps of old cells */
    if (early) {
        for (; pre < NST - 1 && pre < my && e_lo + (w + pre * NW) * C + C <= p0; pre++)
            issue(pre);
        gpu_grid_wait();
    }
    /* Q rows 8nb + g as B fragments, hi and lo (zeros past R) */
    uint32_t qh[NB][KT][2], ql[NB][KT][2];
    int lim[NB][2]; /* the last entry rows 8nb + 2t4 + c may see (and the partition's) */
#pragma unroll
    for (int nb = 0; nb < NB; nb++) {
        int r = 8 * nb + g;
        const float *src = r < R ? a.q + (size_t)out_row(r) * E : NULL;
#pragma unroll
        for (int ks = 0; ks < KT; ks++) {
            /* ROW_I8C: lane t4 takes words t4·KT + ks of a K row (bank order) */
            int e = ROW == ROW_I8C ? 4 * (t4 * KT + ks) : 16 * ks + 4 * t4;
            float4 x = src ? *(const float4 *)(src + e) : make_float4(0.0f, 0.0f, 0.0f, 0.0f);
            ak_split2(x.x, x.y, &qh[nb][ks][0], &ql[nb][ks][0]);
            ak_split2(x.z, x.w, &qh[nb][ks][1], &ql[nb][ks][1]);
        }
#pragma unroll
        for (int c = 0; c < 2; c++)
            lim[nb][c] = min(e_hi - 1, a.qsa ? INT_MAX : p0 + (8 * nb + 2 * t4 + c) / G);
    }

    GPU_TRACE_MARK();   /* Q in registers (the measuring build) */
#pragma unroll
    for (int i = pre; i < NST - 1; i++) {
        if (i < my)
            issue(i);
        else
            akd_commit(); /* empty groups keep the count of wait_group right */
    }
    for (int i = 0; i < my; i++) {
        if (i + NST - 1 < my)
            issue(i + NST - 1);
        else
            akd_commit();
        akd_wait<NST - 1>(); /* step i's group is complete */
        __syncwarp();
        const uint8_t *kst = ring + (i % NST) * SH::STAGE, *vst = kst + C * KS;
        int c0 = e_lo + (w + i * NW) * C;

        /* Sᵀ = K·Qᵀ: m-tile mc's rows cells 16mc + g and + 8, columns
         * query rows 2t4, 2t4+1 */
        float S[NB][MC][4];
#pragma unroll
        for (int nb = 0; nb < NB; nb++)
#pragma unroll
            for (int mc = 0; mc < MC; mc++)
                S[nb][mc][0] = S[nb][mc][1] = S[nb][mc][2] = S[nb][mc][3] = 0.0f;
#pragma unroll
        for (int ks = 0; ks < KT; ks++) {
#pragma unroll
            for (int mc = 0; mc < MC; mc++) {
                const uint8_t *kr = kst + 16 * mc * KS;
                uint32_t af[4];
                if constexpr (ROW == ROW_F16) {
                    uint2 x = *(const uint2 *)(kr + g * KS + 32 * ks + 8 * t4);
                    uint2 y = *(const uint2 *)(kr + (g + 8) * KS + 32 * ks + 8 * t4);
                    af[0] = x.x;
                    af[2] = x.y;
                    af[1] = y.x;
                    af[3] = y.y;
                } else {
                    int wo = ROW == ROW_I8C ? 4 + 4 * (t4 * KT + ks) : 4 + 16 * ks + 4 * t4;
                    uint32_t x = *(const uint32_t *)(kr + g * KS + wo);
                    uint32_t y = *(const uint32_t *)(kr + (g + 8) * KS + wo);
                    akd_i8x4(x, &af[0], &af[2]);
                    akd_i8x4(y, &af[1], &af[3]);
                }
#pragma unroll
                for (int nb = 0; nb < NB; nb++) {
                    gpu_mma16816(S[nb][mc], af, ql[nb][ks][0], ql[nb][ks][1]);
                    gpu_mma16816(S[nb][mc], af, qh[nb][ks][0], qh[nb][ks][1]);
                }
            }
        }
        float kA[MC], kB[MC], dvA[MC], dvB[MC], dm = 1.0f, idm = 1.0f;   /* idm = 1/dm, exact */
#pragma unroll
        for (int mc = 0; mc < MC; mc++) {
            kA[mc] = kB[mc] = scale2;
            dvA[mc] = dvB[mc] = 1.0f;
        }
        if constexpr (ROW != ROW_F16) {
            /* the V scales enter P relative to dm, the power of two just
             * above the step's largest (Oᵀ is kept divided by dm meanwhile,
             * exactly): P·d/dm lies in [0, 1] as P does, never among f16's
             * subnormals because a row's values are small */
            float dx = 0.0f;
#pragma unroll
            for (int mc = 0; mc < MC; mc++) {
                kA[mc] *= *(const float *)(kst + (16 * mc + g) * KS);
                kB[mc] *= *(const float *)(kst + (16 * mc + g + 8) * KS);
                dvA[mc] = *(const float *)(vst + (16 * mc + g) * VS);
                dvB[mc] = *(const float *)(vst + (16 * mc + g + 8) * VS);
                dx = mc ? fmaxf(dx, fmaxf(dvA[mc], dvB[mc])) : fmaxf(dvA[mc], dvB[mc]);
            }
            dx = fmaxf(dx, gpu_shfl_xor(dx, 4));
            dx = fmaxf(dx, gpu_shfl_xor(dx, 8));
            dx = fmaxf(dx, gpu_shfl_xor(dx, 16));
            akd_pow2_above(dx, &dm, &idm);
#pragma unroll
            for (int mc = 0; mc < MC; mc++) {
                dvA[mc] *= idm;
                dvB[mc] *= idm;
            }
        }
#pragma unroll
        for (int nb = 0; nb < NB; nb++) {
            float x0 = -INFINITY, x1 = -INFINITY;
#pragma unroll
            for (int mc = 0; mc < MC; mc++) {
                int entA = c0 + 16 * mc + g, entB = entA + 8;
#pragma unroll
                for (int c = 0; c < 2; c++) {
                    S[nb][mc][c] = entA <= lim[nb][c] ? S[nb][mc][c] * kA[mc] : -INFINITY;
                    S[nb][mc][2 + c] = entB <= lim[nb][c] ? S[nb][mc][2 + c] * kB[mc] : -INFINITY;
                }
                x0 = mc ? fmaxf(x0, fmaxf(S[nb][mc][0], S[nb][mc][2])) : fmaxf(S[nb][mc][0], S[nb][mc][2]);
                x1 = mc ? fmaxf(x1, fmaxf(S[nb][mc][1], S[nb][mc][3])) : fmaxf(S[nb][mc][1], S[nb][mc][3]);
            }
            /* online softmax of rows 2t4 + c over the C cells (lanes g, m-tiles mc) */
#pragma unroll
            for (int o = 4; o < 32; o <<= 1) {
                x0 = fmaxf(x0, gpu_shfl_xor(x0, o));
                x1 = fmaxf(x1, gpu_shfl_xor(x1, o));
            }
            float n0 = fmaxf(m[nb][0], x0), n1 = fmaxf(m[nb][1], x1);
            /* a row with only -inf so far keeps m = -inf and weighs nothing:
             * its cells' 2^(-inf - 0) are 0, as a cell's past the row's end */
            float al0 = m[nb][0] == -INFINITY ? 0.0f : akd_ex2(m[nb][0] - n0);
            float al1 = m[nb][1] == -INFINITY ? 0.0f : akd_ex2(m[nb][1] - n1);
            float b0 = n0 == -INFINITY ? 0.0f : n0, b1 = n1 == -INFINITY ? 0.0f : n1;
            float ls0 = 0.0f, ls1 = 0.0f;
#pragma unroll
            for (int mc = 0; mc < MC; mc++) {
                float q0 = akd_ex2(S[nb][mc][0] - b0);
                float q1 = akd_ex2(S[nb][mc][1] - b1);
                float q2 = akd_ex2(S[nb][mc][2] - b0);
                float q3 = akd_ex2(S[nb][mc][3] - b1);
                ls0 += q0 + q2; /* this lane's cells; summed over g at the end */
                ls1 += q1 + q3;
                float *pr = ps + (8 * nb + 2 * t4) * PLD + 16 * mc;
                pr[g] = q0 * dvA[mc];
                pr[PLD + g] = q1 * dvA[mc];
                pr[g + 8] = q2 * dvB[mc];
                pr[PLD + g + 8] = q3 * dvB[mc];
            }
            l[nb][0] = l[nb][0] * al0 + ls0;
            l[nb][1] = l[nb][1] * al1 + ls1;
            m[nb][0] = n0;
            m[nb][1] = n1;
            float oa0 = al0 * (dmp * idm), oa1 = al1 * (dmp * idm);
#pragma unroll
            for (int mt = 0; mt < MT; mt++) {
                O[nb][mt][0] *= oa0;
                O[nb][mt][1] *= oa1;
                O[nb][mt][2] *= oa0;
                O[nb][mt][3] *= oa1;
            }
        }
        __syncwarp();
        /* Pᵀ's B fragments of k-step mc: row g (of the n-tile), cells
         * 16mc + 2t4.. and 16mc + 2t4+8.. */
        uint32_t ph[NB][MC][2], pl[NB][MC][2];
#pragma unroll
        for (int nb = 0; nb < NB; nb++)
#pragma unroll
            for (int mc = 0; mc < MC; mc++) {
                const float *pr = ps + (8 * nb + g) * PLD + 16 * mc + 2 * t4;
                float2 u = *(const float2 *)pr, v = *(const float2 *)(pr + 8);
                ak_split2(u.x, u.y, &ph[nb][mc][0], &pl[nb][mc][0]);
                ak_split2(v.x, v.y, &ph[nb][mc][1], &pl[nb][mc][1]);
            }
        /* Oᵀ += Vᵀ·Pᵀ: A of m-tiles 2j, 2j+1 from cells 16mc + 2t4, +1, +8,
         * +9, elements 32j + 4g .. +3, paired across cells */
#pragma unroll
        for (int j = 0; j < E / 32; j++) {
#pragma unroll
            for (int mc = 0; mc < MC; mc++) {
                const uint8_t *vr = vst + 16 * mc * VS;
                uint32_t a0[4], a1[4];
                if constexpr (ROW == ROW_F16) {
                    const uint8_t *vb = vr + 64 * j + 8 * g;
                    uint2 w0 = *(const uint2 *)(vb + (2 * t4) * VS), w1 = *(const uint2 *)(vb + (2 * t4 + 1) * VS);
                    uint2 w8 = *(const uint2 *)(vb + (2 * t4 + 8) * VS), w9 = *(const uint2 *)(vb + (2 * t4 + 9) * VS);
                    a0[0] = __byte_perm(w0.x, w1.x, 0x5410);
                    a0[1] = __byte_perm(w0.x, w1.x, 0x7632);
                    a0[2] = __byte_perm(w8.x, w9.x, 0x5410);
                    a0[3] = __byte_perm(w8.x, w9.x, 0x7632);
                    a1[0] = __byte_perm(w0.y, w1.y, 0x5410);
                    a1[1] = __byte_perm(w0.y, w1.y, 0x7632);
                    a1[2] = __byte_perm(w8.y, w9.y, 0x5410);
                    a1[3] = __byte_perm(w8.y, w9.y, 0x7632);
                } else {
                    /* ROW_I8C: word akd_vword(j, g) of the row (bank order) */
                    const uint8_t *vb = vr + 4 + (ROW == ROW_I8C ? 4 * akd_vword(j, g) : 32 * j + 4 * g);
                    uint32_t w0 = *(const uint32_t *)(vb + (2 * t4) * VS);
                    uint32_t w1 = *(const uint32_t *)(vb + (2 * t4 + 1) * VS);
                    uint32_t w8 = *(const uint32_t *)(vb + (2 * t4 + 8) * VS);
                    uint32_t w9 = *(const uint32_t *)(vb + (2 * t4 + 9) * VS);
                    akd_i8x4(__byte_perm(w0, w1, 0x5140), &a0[0], &a0[1]);
                    akd_i8x4(__byte_perm(w8, w9, 0x5140), &a0[2], &a0[3]);
                    akd_i8x4(__byte_perm(w0, w1, 0x7362), &a1[0], &a1[1]);
                    akd_i8x4(__byte_perm(w8, w9, 0x7362), &a1[2], &a1[3]);
                }
#pragma unroll
                for (int nb = 0; nb < NB; nb++) {
                    gpu_mma16816(O[nb][2 * j], a0, pl[nb][mc][0], pl[nb][mc][1]);
                    gpu_mma16816(O[nb][2 * j], a0, ph[nb][mc][0], ph[nb][mc][1]);
                    gpu_mma16816(O[nb][2 * j + 1], a1, pl[nb][mc][0], pl[nb][mc][1]);
                    gpu_mma16816(O[nb][2 * j + 1], a1, ph[nb][mc][0], ph[nb][mc][1]);
                }
            }
        }
        dmp = dm;
        __syncwarp(); /* the stage and the Pᵀ tile are read */
    }

    akd_wait<0>();
    if constexpr (ROW != ROW_F16) {
#pragma unroll
        for (int nb = 0; nb < NB; nb++)
#pragma unroll
            for (int mt = 0; mt < MT; mt++)
#pragma unroll
                for (int i = 0; i < 4; i++)
                    O[nb][mt][i] *= dmp;
    }
    /* m from base 2 back to e for the partials (ak_merge's) */
#pragma unroll
    for (int nb = 0; nb < NB; nb++)
        m[nb][0] *= AKD_LN2, m[nb][1] *= AKD_LN2;
    /* each row's l summed over the lanes' cells (g) */
#pragma unroll
    for (int nb = 0; nb < NB; nb++)
#pragma unroll
        for (int c = 0; c < 2; c++) {
            l[nb][c] += gpu_shfl_xor(l[nb][c], 4);
            l[nb][c] += gpu_shfl_xor(l[nb][c], 8);
            l[nb][c] += gpu_shfl_xor(l[nb][c], 16);
        }
    /* Oᵀ[nb][mt][i] is row 8nb + 2t4 + (i & 1), element akd_oe(mt) + (i >> 1) */
    auto akd_oe = [&](int mt) {
        return (ROW == ROW_I8C ? 4 * akd_vword(mt >> 1, g) : 32 * (mt >> 1) + 4 * g) + 2 * (mt & 1);
    };
    /* (the live partitions counted again here: kept from the top, the count
     * cost 10-16 registers a thread, and the 32-entry int8 kernel of long
     * contexts its third block an SM: BENCH.md, twenty-second pass) */
    if (a.unit && akd_per_warp(akd_live(n_ent, a.S, a.unit), NW)) {
        /* partial p = s·NW + w of each row, from the fragments */
        size_t TH = (size_t)a.T * a.H, p = (size_t)s * NW + w;
#pragma unroll
        for (int nb = 0; nb < NB; nb++)
#pragma unroll
            for (int c = 0; c < 2; c++) {
                int r = 8 * nb + 2 * t4 + c;
                if (r >= R)
                    continue;
                size_t row = p * TH + out_row(r);
                if (g == 0) {
                    a.ml[row * 2] = m[nb][c];
                    a.ml[row * 2 + 1] = l[nb][c];
                }
                if (m[nb][c] == -INFINITY)
                    continue;   /* weight 0: ak_merge reads acc but not its value */
#pragma unroll
                for (int mt = 0; mt < MT; mt++)
                    *(float2 *)(a.acc + row * E + akd_oe(mt)) = make_float2(O[nb][mt][c], O[nb][mt][2 + c]);
            }
        return;
    }
    /* the block's merge: each warp's (m, l, Oᵀ) in the rings' place */
    __syncthreads();
    GPU_TRACE_AT(1);   /* the steps done */
    /* (NW, NR) maxima, then each warp's weight exp(m - M); (NW, NR) sums;
     * (NR) M, (NR) L and (NR) output rows; Oᵀ by akd_opos */
    float *mw = (float *)ak_smem, *lw = mw + NW * NR, *ms = lw + NW * NR, *ow = ms + 3 * NR;
    int *orow = (int *)(ms + 2 * NR);
#pragma unroll
    for (int nb = 0; nb < NB; nb++) {
#pragma unroll
        for (int c = 0; c < 2; c++)
            if (g == 0) {
                mw[w * NR + 8 * nb + 2 * t4 + c] = m[nb][c];
                lw[w * NR + 8 * nb + 2 * t4 + c] = l[nb][c];
            }
#pragma unroll
        for (int mt = 0; mt < MT; mt++)
#pragma unroll
            for (int i = 0; i < 4; i++)
                ow[akd_opos<ROW, E>(w * NR + 8 * nb + 2 * t4 + (i & 1), akd_oe(mt) + (i >> 1))] = O[nb][mt][i];
    }
    __syncthreads();
    if (threadIdx.x < NR) {   /* row r: M, each warp's weight, L and where it goes, once (not per element) */
        int r = threadIdx.x;
        float M = -INFINITY, L = 0.0f;
#pragma unroll
        for (int v = 0; v < NW; v++)
            M = fmaxf(M, mw[v * NR + r]);
#pragma unroll
        for (int v = 0; v < NW; v++) {
            float mv = mw[v * NR + r];
            float wt = mv == -INFINITY ? 0.0f : expf(mv - M);   /* a warp that saw no cell of this row: 0 */
            L = fmaf(wt, lw[v * NR + r], L);
            mw[v * NR + r] = wt;
        }
        ms[r] = M;
        ms[NR + r] = L;
        orow[r] = out_row(r);
    }
    __syncthreads();
    GPU_TRACE_AT(2);   /* the warps' partials in shared memory, M and L formed */
    /* thread k·32·NW + tid: element idx of the rows; a warp's 32 one block
     * of 32 of a row. The sums first, their loads in flight together */
    constexpr int NI = NR * E / (NW * 32);
    float acc[NI];
#pragma unroll
    for (int k = 0; k < NI; k++) {
        int idx = threadIdx.x + k * NW * 32, r = idx / E, e = idx % E;
        acc[k] = 0.0f;
        if (r < R)
#pragma unroll
            for (int v = 0; v < NW; v++)
                acc[k] = fmaf(mw[v * NR + r], ow[akd_opos<ROW, E>(v * NR + r, e)], acc[k]);
    }
    /* this partition's partials (acc and ml, T·H rows from row s·T·H); a
     * row's offset formed once above: its divisions by G, done here for
     * every element, were most of the block's last instructions (BENCH.md,
     * twenty-first pass) */
    size_t srow = (size_t)s * a.T * a.H;
    float *accp = a.acc + srow * E, *mlp = a.ml + srow * 2;
#pragma unroll
    for (int k = 0; k < NI; k++) {
        int idx = threadIdx.x + k * NW * 32, r = idx / E, e = idx % E;
        if (r >= R)
            break;
        float M = ms[r], L = ms[NR + r];
        int orr = orow[r];
        if (direct) {
            ak_store_out(a.out, a.out_q, a.out_ds, (size_t)orr * E + e, acc[k] * (L > 0.0f ? 1.0f / L : 0.0f),
                         a.H * E, a.out_bt);
            continue;
        }
        if (e == 0) {
            mlp[orr * 2] = M;
            mlp[orr * 2 + 1] = L;
        }
        if (M != -INFINITY)
            accp[orr * E + e] = acc[k];
    }
#else
    (void)a;
#endif
}

/* ==== ak_flash: prompts over every f16 and quantised cell (sm_80+) ==== */

/* A prompt kernel for every cell but f32, E = 64 or 128 (E = 256 needs
 * registers it lacks), dense and QSA: a block is NW warps of 16 rows, its
 * K/V steps copied raw by cp.async into a ring of NST stages in shared
 * memory (NST - 1 steps in flight while one is computed, one barrier a
 * step, no registers hold them; int8 and Q4_0 rows, 4-byte aligned at
 * these E, are copied a word at a time and decoded to f16 as ak_mma
 * decodes them, d·q rounded, into one step's tiles behind a second
 * barrier), each
 * step's page ids read a step ahead, fragments read by ldmatrix, the
 * softmax in base 2 (log2 e folded into the scale, each weight one ex2),
 * the mask only on the steps that cross a row's limit. Q enters as f16 hi + lo, as in ak_mma; P as
 * f16 alone: its weights lie in [0, 1] and their roundings, independent
 * from cell to cell, average out in P·V (the GPU's RMS error against FP64
 * stays within 2% of the CPU path's, gpu/attn), where Q's rounding enters
 * every score of a row alike (Q as f16 alone: 1.3-1.45 times). A row's
 * arithmetic does not depend on the rows beside it, so the dense path
 * (AKF_DENSE_W warps: 128 rows, one block an SM) and the QSA path (a
 * block per query and kv head of AKF_QSA_W warps) give one query the same
 * bits when its list is every cell it sees. */
#define AKF_DENSE_W 8
#define AKF_DENSE_NST 3
#define AKF_QSA_W 4
#define AKF_QSA_NST 2

/* 4-byte words of a raw row: int8 (scale + E codes), Q4_0 (E / 32 blocks
 * of 18 bytes, E a multiple of 64). */
static __host__ __device__ constexpr int akf_words(int row, int E)
{
    return row == ROW_I8 ? (4 + E) / 4 : row == ROW_Q4 ? E / 32 * 18 / 4 : 0;
}

/* Shared bytes: Q hi and lo (16·NW rows), then the ring's stages, each a
 * step's K rows then its V rows, all rows E + AK_PAD halves; quantised
 * cells: one such step decoded, and the ring's rows raw (kw + vw words,
 * akf_words). */
static size_t akf_smem(int E, int NW, int NST, int kw, int vw)
{
    size_t ld = (size_t)(E + AK_PAD) * 2;
    if (kw)
        return (2 * 16 * NW + 2 * AK_BC) * ld + (size_t)NST * AK_BC * (kw + vw) * 4;
    return (2 * 16 * NW + NST * 2 * AK_BC) * ld;
}

#ifdef AK_MMA_BODY
/* Four 8x8 f16 matrices as stored: A fragments, or B fragments of K. */
static __device__ __forceinline__ void ak_ldm4(uint32_t r[4], const void *p)
{
    unsigned addr = (unsigned)__cvta_generic_to_shared(p);
    asm volatile("ldmatrix.sync.aligned.m8n8.x4.shared.b16 {%0,%1,%2,%3}, [%4];\n"
                 : "=r"(r[0]), "=r"(r[1]), "=r"(r[2]), "=r"(r[3])
                 : "r"(addr));
}
#endif

/* Block (kv head h, tile z): dense, rows r0..r1-1 of the T·G rows of kv
 * head h (row r: query t = r/G, head h·G + r%G; cells 0..pos0+t); QSA,
 * z = t·tiles + tile, the rows of query t and its list. KR, VR: the K and
 * V rows' formats (both ROW_F16, or quantised). */
template <int KR, int VR, int E, int NW, int NST>
__global__ void __launch_bounds__(32 * NW) ak_flash(ak_args a)
{
#ifdef AK_MMA_BODY
    /* a copy puts CH threads on a row: 16 bytes each for f16, quantised
     * rows (KW, VW words, 4-byte aligned) a word at a time */
    constexpr bool QR = KR != ROW_F16;
    constexpr int ROWS = 16 * NW, LD = E + AK_PAD, NT = E / 8, NTH = 32 * NW;
    constexpr int KW = akf_words(KR, E), VW = akf_words(VR, E);
    constexpr int CH = QR ? NTH / AK_BC : E / 8, RPP = NTH / CH;
    constexpr int RK = AK_BC / RPP; /* rows of a step a thread copies */
    extern __shared__ __align__(16) uint8_t ak_smem[];
    __half *Qh = (__half *)ak_smem, *Ql = Qh + ROWS * LD, *ring = Ql + ROWS * LD;
    uint32_t *raw = (uint32_t *)(ring + 2 * AK_BC * LD); /* quantised: the ring; ring holds the decoded step */
    int tid = threadIdx.x, lane = tid & 31, w = tid >> 5, g = lane >> 2, t4 = lane & 3;
    int h = blockIdx.y, G = a.G, p0 = *a.pos0, r0, r1;
    const int32_t *list;
    /* the tiles with the most cells start first */
    int n_ent = ak_tile_rows(a, ROWS, a.tiles - 1 - (int)blockIdx.z, p0, &r0, &r1, &list);
    int steps = (n_ent + AK_BC - 1) / AK_BC;
    int rA = r0 + w * 16 + g, rB = rA + 8;
    int oA = rA / G * a.H + h * G + rA % G, oB = rB / G * a.H + h * G + rB % G;
    /* a row's last visible entry (-1: no row); the warp's rows see entries
     * up to wlim, and every entry up to wall all of them */
    int limA = rA >= r1 ? -1 : list ? n_ent - 1 : p0 + rA / G;
    int limB = rB >= r1 ? -1 : list ? n_ent - 1 : p0 + rB / G;
    int wfirst = r0 + w * 16, wlast = min(wfirst + 15, r1 - 1);
    int wlim = wfirst >= r1 ? -1 : list ? n_ent - 1 : p0 + wlast / G;
    int wall = list ? n_ent - 1 : p0 + wfirst / G;

    /* step i's K and V rows into stage i % NST: thread tid copies the 16
     * bytes at tid % CH of the step's rows tid / CH + k·RPP, zeros past
     * n_ent; their cells' pages are read a step ahead (pages), so that no
     * page table load stands between a step's barrier and its copies */
    const uint8_t *blk = a.pages + ((size_t)a.layer * a.K + h) * (size_t)a.P * (a.kbytes + a.vbytes);
    int pg[RK], cl[RK];
    auto pages = [&](int i) {
#pragma unroll
        for (int k = 0; k < RK; k++) {
            int ent = i * AK_BC + tid / CH + k * RPP;
            cl[k] = ent < n_ent ? (list ? list[ent] : ent) : -1;
            pg[k] = cl[k] >= 0 ? a.pt[cl[k] >> a.lp] : 0;
        }
    };
    auto issue = [&](int i) {
        __half *Kd = ring + (i % NST) * 2 * AK_BC * LD, *Vd = Kd + AK_BC * LD;
        uint32_t *Kr = raw + (i % NST) * AK_BC * (KW + VW), *Vr = Kr + AK_BC * KW;
        int part = tid % CH;
#pragma unroll
        for (int k = 0; k < RK; k++) {
            int j = tid / CH + k * RPP;
            bool ok = cl[k] >= 0;
            const uint8_t *b = ok ? blk + (size_t)pg[k] * a.page_bytes : a.pages;
            size_t in = (size_t)(cl[k] & (a.P - 1));
            const uint8_t *kr = b + in * a.kbytes, *vr = b + (size_t)a.P * a.kbytes + in * a.vbytes;
            if (QR) {
                for (int wd = part; wd < KW; wd += CH)
                    akd_cp4(Kr + j * KW + wd, kr + 4 * wd, ok);
                for (int wd = part; wd < VW; wd += CH)
                    akd_cp4(Vr + j * VW + wd, vr + 4 * wd, ok);
            } else {
                akd_cp16(Kd + j * LD + part * 8, kr + part * 16, ok);
                akd_cp16(Vd + j * LD + part * 8, vr + part * 16, ok);
            }
        }
        akd_commit();
    };
    /* the pages are read for step i before issue(i), ahead of its barrier */
#pragma unroll
    for (int i = 0; i < NST - 1; i++) {
        pages(i);
        issue(i); /* past the last step, zeros */
    }
    pages(NST - 1);
    for (int i = tid; i < ROWS * E / 4; i += NTH) {
        int rr = r0 + i / (E / 4), e = i % (E / 4) * 4;
        float4 x = make_float4(0.0f, 0.0f, 0.0f, 0.0f);
        if (rr < r1)
            x = *(const float4 *)&a.q[((size_t)(rr / G) * a.H + h * G + rr % G) * E + e];
        uint32_t hi[2], lo[2];
        ak_split2(x.x, x.y, &hi[0], &lo[0]);
        ak_split2(x.z, x.w, &hi[1], &lo[1]);
        *(uint2 *)&Qh[(i / (E / 4)) * LD + e] = make_uint2(hi[0], hi[1]);
        *(uint2 *)&Ql[(i / (E / 4)) * LD + e] = make_uint2(lo[0], lo[1]);
    }

    float O[NT][4];
#pragma unroll
    for (int i = 0; i < NT; i++)
        O[i][0] = O[i][1] = O[i][2] = O[i][3] = 0.0f;
    float mA = -INFINITY, mB = -INFINITY, lA = 0.0f, lB = 0.0f, sc = a.scale * AKD_LOG2E;
    /* ldmatrix addresses: Q's A rows (lane & 15), k halves (lane >> 4); K's
     * B rows (entries) 8·(lane >> 4) + (lane & 7), k halves (lane >> 3) & 1;
     * V's rows (entries) lane & 15, e halves lane >> 4 */
    int qoff = (w * 16 + (lane & 15)) * LD + (lane >> 4) * 8;
    int koff = (8 * (lane >> 4) + (lane & 7)) * LD + ((lane >> 3) & 1) * 8;
    int voff = (lane & 15) * LD + (lane >> 4) * 8;

    for (int i = 0; i < steps; i++) {
        akd_wait<NST - 2>();
        __syncthreads(); /* step i is in (and Q, the first time); every warp is done with step i - 1's stage */
        if (i + NST - 1 < steps)
            issue(i + NST - 1);
        else
            akd_commit(); /* an empty group: the wait above counts NST - 2 behind */
        pages(i + NST);
        if (QR) {
            /* the step's rows decoded to f16 as ak_mma's are (d·q rounded),
             * 8 values an item, into the one decoded step */
            const uint32_t *st = raw + (i % NST) * AK_BC * (KW + VW);
            for (int it = tid; it < AK_BC * (E / 8); it += NTH) {
                int r = it / (E / 8), e8 = it % (E / 8) * 8;
                ak_raw k = ak_fetch<KR>((const uint8_t *)(st + r * KW), e8);
                ak_raw v = ak_fetch<VR>((const uint8_t *)(st + AK_BC * KW + r * VW), e8);
                *(uint4 *)&ring[r * LD + e8] = ak_cvt<KR>(k, e8);
                *(uint4 *)&ring[(AK_BC + r) * LD + e8] = ak_cvt<VR>(v, e8);
            }
            __syncthreads();
        }
        int c0 = i * AK_BC;
        if (c0 > wlim)
            continue; /* every row of this warp is done (causal), or it has none */
        const __half *Ks = ring + (QR ? 0 : i % NST) * 2 * AK_BC * LD, *Vs = Ks + AK_BC * LD;

        /* S = Q·Kᵀ: (16 rows) x (64 entries), Q as hi + lo */
        float S[8][4];
#pragma unroll
        for (int nt = 0; nt < 8; nt++)
            S[nt][0] = S[nt][1] = S[nt][2] = S[nt][3] = 0.0f;
#pragma unroll
        for (int kk = 0; kk < E / 16; kk++) {
            /* the 8 lo products, then the 8 hi ones: each accumulator sums
             * lo before hi as ever, with 7 others between its two */
            uint32_t ah[4], al[4], b[4][4];
            ak_ldm4(ah, Qh + qoff + kk * 16);
            ak_ldm4(al, Ql + qoff + kk * 16);
#pragma unroll
            for (int np = 0; np < 4; np++)
                ak_ldm4(b[np], Ks + koff + np * 16 * LD + kk * 16);
#pragma unroll
            for (int nt = 0; nt < 8; nt++)
                gpu_mma16816(S[nt], al, b[nt / 2][2 * (nt & 1)], b[nt / 2][2 * (nt & 1) + 1]);
#pragma unroll
            for (int nt = 0; nt < 8; nt++)
                gpu_mma16816(S[nt], ah, b[nt / 2][2 * (nt & 1)], b[nt / 2][2 * (nt & 1) + 1]);
        }
        /* the mask where a row's limit falls in the step; the maxima of
         * the raw scores, then in base 2 (sc > 0: the same as the maxima
         * of the scaled scores) */
        if (c0 + AK_BC - 1 > wall)
            ak_mask(S, c0, t4, limA, limB);
        float xA, xB;
        ak_row_max(S, &xA, &xB);
        /* the new maxima; a row with only -inf so far subtracts 0, so that
         * its weights and rescale are ex2(-inf) = 0, never NaN */
        float nA = fmaxf(mA, xA * sc), nB = fmaxf(mB, xB * sc);
        float bA = nA == -INFINITY ? 0.0f : nA, bB = nB == -INFINITY ? 0.0f : nB;
        float alA = akd_ex2(mA - bA), alB = akd_ex2(mB - bB), sA[4] = {}, sB[4] = {};
#pragma unroll
        for (int nt = 0; nt < 8; nt++)
#pragma unroll
            for (int c = 0; c < 2; c++) {
                S[nt][c] = akd_ex2(fmaf(S[nt][c], sc, -bA));
                S[nt][2 + c] = akd_ex2(fmaf(S[nt][2 + c], sc, -bB));
                sA[nt & 3] += S[nt][c];
                sB[nt & 3] += S[nt][2 + c];
            }
        /* this lane's columns; the quad is summed at the end */
        lA = lA * alA + ((sA[0] + sA[1]) + (sA[2] + sA[3]));
        lB = lB * alB + ((sB[0] + sB[1]) + (sB[2] + sB[3]));
        mA = nA;
        mB = nB;
        ak_scale_rows(O, alA, alB);
        /* O += P·V, P as f16 from the C fragments */
#pragma unroll
        for (int kk = 0; kk < 4; kk++) {
            uint32_t p[4] = {gpu_pack16(S[2 * kk][0], S[2 * kk][1]), gpu_pack16(S[2 * kk][2], S[2 * kk][3]),
                             gpu_pack16(S[2 * kk + 1][0], S[2 * kk + 1][1]),
                             gpu_pack16(S[2 * kk + 1][2], S[2 * kk + 1][3])};
#pragma unroll
            for (int np = 0; np < E / 16; np++) {
                uint32_t b[4];
                ak_ldm4t(b, Vs + voff + kk * 16 * LD + np * 16);
                gpu_mma16816(O[2 * np], p, b[0], b[1]);
                gpu_mma16816(O[2 * np + 1], p, b[2], b[3]);
            }
        }
    }
    akd_wait<0>(); /* the copies past the last step */
    lA = ak_quad_sum(lA);
    lB = ak_quad_sum(lB);
    float iA = lA > 0.0f ? 1.0f / lA : 0.0f, iB = lB > 0.0f ? 1.0f / lB : 0.0f;
    ak_store_rows(a.out, O, iA, iB, oA, oB, limA >= 0, limB >= 0, t4, E);
#else
    (void)a;
#endif
}

/* ==== host: device facts, the table, the launchers ==== */

/* Compute capability (major·10 + minor) and SM count of the current device. */
static int ak_device(int *arch, int *sms, char *err, size_t errlen)
{
    GPU_TRY(gpu_device_facts(arch, sms), err, errlen);
    return 0;
}

static int ak_env(const char *name)
{
    const char *v = getenv(name);
    return v && v[0] == '1' && v[1] == 0;
}

enum ak_path { AP_PROMPT = 1, AP_DECODE = 2, AP_QSA_PROMPT = 4, AP_QSA_DECODE = 8, AP_ALL = 15 };
enum ak_kern { AK_RDNA2, AK_MMA, AK_FLASH, AK_I8, AK_DEC, AK_SIMT };
enum ak_envreq { ENV_NONE, ENV_PRE75, ENV_QSA_SPLIT };

#define AK_CELLS_MMA ((1u << KV_CELL_F16) | (1u << KV_CELL_INT8) | (1u << KV_CELL_Q4) | (1u << KV_CELL_K8V4))
#define AK_DIMS_MMA 7u /* bit 0: E 64, bit 1: 128, bit 2: 256; bit 3: any other */
#define AK_ANY 0xffffffffu
#define AK_CELLS_DEC ((1u << KV_CELL_F16) | (1u << KV_CELL_INT8))
#define AK_CELLS_FLASH ((1u << KV_CELL_F16) | (1u << KV_CELL_INT8) | (1u << KV_CELL_Q4) | (1u << KV_CELL_K8V4))

/* The dispatch table: the first rule matching (path, arch, cell, E, rows,
 * env) picks the kernel; rows: the query rows that share one walk over the
 * cells (T·G dense, G QSA), at most max_rows (0: any). Decode windows above
 * AK_DECODE_T queries count as prompts (the split grid would hold too many
 * rows). */
static const struct ak_rule {
    unsigned paths;
    int min_arch, max_arch;
    unsigned cells, dims;
    int max_rows, env, kern;
    const char *name;
} ak_table[] = {
    {AP_ALL, 0, 79, AK_ANY, AK_ANY, 0, ENV_NONE, AK_RDNA2, "rdna2 (no matrix cores: below sm_80)"},
    {AP_ALL, 0, INT_MAX, AK_ANY, AK_ANY, 0, ENV_PRE75, AK_RDNA2, "rdna2 (STRATA_ATTN_PRE75=1)"},
    {AP_QSA_DECODE, 80, INT_MAX, 1u << KV_CELL_INT8, AK_DIMS_MMA, 0, ENV_QSA_SPLIT, AK_I8,
     "i8mma qsa split-KV + merge (STRATA_QSA_SPLIT_ATTN=1)"},
    {AP_DECODE, 80, INT_MAX, AK_CELLS_DEC, 3u, 16, ENV_NONE, AK_DEC, "dec16 split-KV + merge"},
    {AP_DECODE, 80, INT_MAX, AK_CELLS_DEC, 4u, 8, ENV_NONE, AK_DEC, "dec16 split-KV + merge"},
    {AP_QSA_DECODE, 80, INT_MAX, AK_CELLS_DEC, 3u, 16, ENV_NONE, AK_DEC, "dec16 qsa split-KV + merge"},
    {AP_QSA_DECODE, 80, INT_MAX, AK_CELLS_DEC, 4u, 8, ENV_NONE, AK_DEC, "dec16 qsa split-KV + merge"},
    {AP_PROMPT, 80, INT_MAX, AK_CELLS_FLASH, 3u, 0, ENV_NONE, AK_FLASH, "flash16 prompt"},
    {AP_PROMPT, 80, INT_MAX, AK_CELLS_MMA, AK_DIMS_MMA, 0, ENV_NONE, AK_MMA, "mma16 prompt"},
    {AP_DECODE, 80, INT_MAX, AK_CELLS_MMA, AK_DIMS_MMA, 0, ENV_NONE, AK_MMA, "mma16 split-KV + merge"},
    {AP_QSA_PROMPT, 80, INT_MAX, AK_CELLS_FLASH, 3u, 0, ENV_NONE, AK_FLASH, "flash16 qsa"},
    {AP_QSA_PROMPT, 80, INT_MAX, AK_CELLS_MMA, AK_DIMS_MMA, 0, ENV_NONE, AK_MMA, "mma16 qsa"},
    {AP_QSA_DECODE, 80, INT_MAX, AK_CELLS_MMA, AK_DIMS_MMA, 0, ENV_NONE, AK_MMA, "mma16 qsa split-KV + merge"},
    {AP_PROMPT, 0, INT_MAX, AK_ANY, AK_ANY, 0, ENV_NONE, AK_SIMT, "simt prompt"},
    {AP_DECODE, 0, INT_MAX, AK_ANY, AK_ANY, 0, ENV_NONE, AK_SIMT, "simt split-KV + merge"},
    {AP_QSA_PROMPT, 0, INT_MAX, AK_ANY, AK_ANY, 0, ENV_NONE, AK_SIMT, "simt qsa"},
    {AP_QSA_DECODE, 0, INT_MAX, AK_ANY, AK_ANY, 0, ENV_NONE, AK_SIMT, "simt qsa split-KV + merge"},
};

static int ak_path_of(const struct gpu_attn *a, int decode, int qsa)
{
    int split = decode && a->T <= AK_DECODE_T;
    return qsa ? (split ? AP_QSA_DECODE : AP_QSA_PROMPT) : (split ? AP_DECODE : AP_PROMPT);
}

static const struct ak_rule *ak_pick(const struct gpu_attn *a, int path, int arch)
{
    int E = a->kv.E, G = a->H / (a->kv.K > 0 ? a->kv.K : 1);
    int rows = path & (AP_QSA_PROMPT | AP_QSA_DECODE) || a->multi ? G : a->T * G;
    unsigned dim = E == 64 ? 1u : E == 128 ? 2u : E == 256 ? 4u : 8u;
    for (size_t i = 0; i < sizeof ak_table / sizeof *ak_table; i++) {
        const struct ak_rule *r = &ak_table[i];
        if (!(r->paths & (unsigned)path) || arch < r->min_arch || arch > r->max_arch ||
            !(r->cells & (1u << a->kv.cell)) || !(r->dims & dim) || (r->max_rows && rows > r->max_rows))
            continue;
        if ((r->env == ENV_PRE75 && !ak_env("STRATA_ATTN_PRE75")) ||
            (r->env == ENV_QSA_SPLIT && !ak_env("STRATA_QSA_SPLIT_ATTN")))
            continue;
        return r;
    }
    return &ak_table[sizeof ak_table / sizeof *ak_table - 1]; /* unreachable: the simt rows match all */
}

/* Split-KV: S partitions of whole 64-entry steps over at most n_max
 * entries, enough blocks with the other grid dimensions for about per_sm
 * per SM, at most cap partitions. */
static void ak_split(int n_max, int other, int sms, int per_sm, int cap, int *S, int *plen)
{
    int chunks = (n_max + AK_BC - 1) / AK_BC;
    if (chunks < 1)
        chunks = 1;
    int s = (per_sm * sms + other - 1) / (other > 0 ? other : 1);
    cap = chunks < cap ? chunks : cap;
    s = s < 1 ? 1 : s > cap ? cap : s;
    int per = (chunks + s - 1) / s;
    *plen = per * AK_BC;
    *S = (chunks + per - 1) / per;
}

static size_t ak_round64(size_t n)
{
    return (n + 63) & ~(size_t)63;
}

size_t gpu_attn_scratch_bytes(int H, int T, int max_cells, int E)
{
    size_t Td = T < 1 ? 1 : T > AK_DECODE_T ? AK_DECODE_T : T;
    size_t Sc = (size_t)((max_cells + AK_BC - 1) / AK_BC);
    Sc = Sc < AKD_WARP_PARTS ? AKD_WARP_PARTS : Sc > AK_SPLIT_MAX ? AK_SPLIT_MAX : Sc;   /* akd_parts' too */
    size_t rows = Sc * Td * (size_t)(H > 0 ? H : 1);
    size_t mine = (ak_round64(rows * 2) + rows * (size_t)(E > 0 ? E : 1)) * sizeof(float);
    /* the table may pick attn_hip.hip's kernels (STRATA_ATTN_PRE75=1, old cards) */
    size_t rd = gpu_attn_rdna2_scratch_bytes(H, T, max_cells, E);
    return mine > rd ? mine : rd;
}

typedef void (*ak_fn)(ak_args);

template <int E>
static ak_fn ak_mma_of(int cell, int qk8)
{
    if (qk8)
        return ak_mma<ROW_I8, ROW_I8, E, true>;
    switch (cell) {
    case KV_CELL_F16: return ak_mma<ROW_F16, ROW_F16, E, false>;
    case KV_CELL_INT8: return ak_mma<ROW_I8, ROW_I8, E, false>;
    case KV_CELL_Q4: return ak_mma<ROW_Q4, ROW_Q4, E, false>;
    default: return ak_mma<ROW_I8, ROW_Q4, E, false>;
    }
}

template <int NE>
static ak_fn ak_simt_of(int cell)
{
    switch (cell) {
    case KV_CELL_F32: return ak_simt<ROW_F32, ROW_F32, NE>;
    case KV_CELL_F16: return ak_simt<ROW_F16, ROW_F16, NE>;
    case KV_CELL_INT8: return ak_simt<ROW_I8, ROW_I8, NE>;
    case KV_CELL_Q4: return ak_simt<ROW_Q4, ROW_Q4, NE>;
    default: return ak_simt<ROW_I8, ROW_Q4, NE>;
    }
}

static ak_args ak_args_of(const struct gpu_attn *g, int qsa)
{
    ak_args a;
    memset(&a, 0, sizeof a);
    a.pages = g->kv.pages;
    a.page_bytes = g->kv.page_bytes;
    a.kbytes = g->kv.kbytes;
    a.vbytes = g->kv.vbytes;
    a.pt = g->kv.page_table;
    a.P = g->kv.P;
    for (a.lp = 0; (1 << a.lp) < a.P; a.lp++)
        ;
    a.K = g->kv.K;
    a.E = g->kv.E;
    a.H = g->H;
    a.G = g->H / g->kv.K;
    a.T = g->T;
    a.layer = g->layer;
    a.q = g->q;
    a.out = g->out;
    a.pos0 = g->pos0;
    a.scale = g->scale;
    a.sel = g->sel;
    a.sel_off = g->sel_off;
    a.plen = INT_MAX;
    a.qsa = qsa;
    a.settled = g->settled;
    a.multi = g->multi, a.pt_stride = g->pt_stride;
    return a;
}

/* The merge of S partials into g->out. */
static int ak_launch_merge(const struct gpu_attn *g, const ak_args &a, int S, gpuStream_t st, char *err,
                           size_t errlen)
{
    akm_args m = {a.ml, a.acc, g->out, NULL, NULL, S, g->T * g->H, g->kv.E, 0, g->T, g->H, 0, 0, NULL, NULL, 0, 0, 0};
    akm_pick(m.E)<<<m.TH, 32 * AK_MERGE_W, 0, st>>>(m);
    GPU_TRY(gpuGetLastError(), err, errlen);
    return 0;
}

static void ak_partials(const struct gpu_attn *g, ak_args *a, int S)
{
    size_t rows = (size_t)S * g->T * g->H;
    a->ml = (float *)g->scratch;
    a->acc = a->ml + ak_round64(rows * 2);
}

static int ak_launch_mma(const struct gpu_attn *g, int path, int qk8, int sms, gpuStream_t st, char *err,
                         size_t errlen)
{
    int qsa = path & (AP_QSA_PROMPT | AP_QSA_DECODE), split = path & (AP_DECODE | AP_QSA_DECODE);
    ak_args a = ak_args_of(g, qsa != 0);
    int G = a.G, K = a.K, E = a.E, T = g->T;
    int rows = qsa ? G : T * G; /* rows sharing one entry list */
    int nq = (rows + 15) / 16;  /* warps with rows: the others only load */
    nq = nq > 4 || (!qsa && !split) ? 4 : nq;
    a.rt = 16 * nq;
    a.tiles = (rows + a.rt - 1) / a.rt;
    int gz = qsa ? T * a.tiles : a.tiles, S = 1;
    if (split) {
        ak_split(g->max_cells, K * gz, sms, 2, AK_SPLIT_MMA, &S, &a.plen);
        ak_partials(g, &a, S);
    }
    int cell = g->kv.cell;
    ak_fn fn = E == 64 ? ak_mma_of<64>(cell, qk8) : E == 128 ? ak_mma_of<128>(cell, qk8) : ak_mma_of<256>(cell, qk8);
    size_t smem = ak_mma_smem(E, a.rt, qk8);
    GPU_TRY(cudaFuncSetAttribute((const void *)fn, cudaFuncAttributeMaxDynamicSharedMemorySize, (int)smem), err,
            errlen);
    fn<<<dim3(S, K, gz), AK_THREADS, smem, st>>>(a);
    GPU_TRY(gpuGetLastError(), err, errlen);
    return split ? ak_launch_merge(g, a, S, st, err, errlen) : 0;
}

template <int E, int NW, int NST>
static ak_fn akf_of(int cell, int *kw, int *vw)
{
    switch (cell) {
    case KV_CELL_F16: *kw = *vw = 0; return ak_flash<ROW_F16, ROW_F16, E, NW, NST>;
    case KV_CELL_INT8: *kw = *vw = akf_words(ROW_I8, E); return ak_flash<ROW_I8, ROW_I8, E, NW, NST>;
    case KV_CELL_Q4: *kw = *vw = akf_words(ROW_Q4, E); return ak_flash<ROW_Q4, ROW_Q4, E, NW, NST>;
    default: *kw = akf_words(ROW_I8, E), *vw = akf_words(ROW_Q4, E); return ak_flash<ROW_I8, ROW_Q4, E, NW, NST>;
    }
}

static int ak_launch_flash(const struct gpu_attn *g, int path, gpuStream_t st, char *err, size_t errlen)
{
    int qsa = path == AP_QSA_PROMPT, nw = qsa ? AKF_QSA_W : AKF_DENSE_W, nst = qsa ? AKF_QSA_NST : AKF_DENSE_NST;
    int cell = g->kv.cell, kw, vw;
    ak_args a = ak_args_of(g, qsa);
    a.tiles = ((qsa ? 1 : g->T) * a.G + 16 * nw - 1) / (16 * nw);
    ak_fn fn = a.E == 64 ? (qsa ? akf_of<64, AKF_QSA_W, AKF_QSA_NST>(cell, &kw, &vw)
                                : akf_of<64, AKF_DENSE_W, AKF_DENSE_NST>(cell, &kw, &vw))
                         : (qsa ? akf_of<128, AKF_QSA_W, AKF_QSA_NST>(cell, &kw, &vw)
                                : akf_of<128, AKF_DENSE_W, AKF_DENSE_NST>(cell, &kw, &vw));
    size_t smem = akf_smem(a.E, nw, nst, kw, vw);
    GPU_TRY(cudaFuncSetAttribute((const void *)fn, cudaFuncAttributeMaxDynamicSharedMemorySize, (int)smem), err,
            errlen);
    fn<<<dim3(1, a.K, (qsa ? g->T : 1) * a.tiles), 32 * nw, smem, st>>>(a);
    GPU_TRY(gpuGetLastError(), err, errlen);
    return 0;
}

template <int ROW, int E, int NB, int NSTQ, int C>
static void akd_of(ak_fn *fn, int *smem, int *nw, int *cs)
{
    *fn = ak_dec<ROW, E, NB, NSTQ, C>;
    *smem = akd_shape<ROW, E, NB, NSTQ, C>::SMEM;
    *nw = akd_shape<ROW, E, NB, NSTQ, C>::NW;
    *cs = C;
}

/* E = 128: nst, the ring's stages with up to 8 rows (the Qwen3 shapes at
 * T = 1), 2-4 for 16-entry steps, 3 for 32; 0 or another value:
 * akd_shape's own choice. */
template <int ROW, int C>
static void akd_pick128(int nb, int nst, ak_fn *fn, int *smem, int *nw, int *cs)
{
    if (nb > 1)
        akd_of<ROW, 128, 2, 0, C>(fn, smem, nw, cs);
    else if (nst == 3)
        akd_of<ROW, 128, 1, 3, C>(fn, smem, nw, cs);
    else if constexpr (C == 16) {
        if (nst == 2)
            akd_of<ROW, 128, 1, 2, C>(fn, smem, nw, cs);
        else if (nst == 4)
            akd_of<ROW, 128, 1, 4, C>(fn, smem, nw, cs);
        else
            akd_of<ROW, 128, 1, 0, C>(fn, smem, nw, cs);
    } else
        akd_of<ROW, 128, 1, 0, C>(fn, smem, nw, cs);
}

/* c: entries per warp step, 32 for E = 128 (else 16). ROW_I8C: E = 128
 * only. */
template <int ROW>
static void akd_pick(int E, int nb, int nst, int c, ak_fn *fn, int *smem, int *nw, int *cs)
{
    if (E == 128 && c == 32)
        akd_pick128<ROW, 32>(nb, nst, fn, smem, nw, cs);
    else if (E == 128 || ROW == ROW_I8C)
        akd_pick128<ROW, 16>(nb, nst, fn, smem, nw, cs);
    else if constexpr (ROW != ROW_I8C) {
        if (E == 64 && nb == 1)
            akd_of<ROW, 64, 1, 0, 16>(fn, smem, nw, cs);
        else if (E == 64)
            akd_of<ROW, 64, 2, 0, 16>(fn, smem, nw, cs);
        else
            akd_of<ROW, 256, 1, 0, 16>(fn, smem, nw, cs);
    }
}

/* How ak_launch_dec runs: ring stages (akd_pick), blocks per SM in the
 * grid (0: as many as are resident at once, one wave), partitions sized on
 * the device from the live entries (dyn; 0: by max_cells alone, every
 * partition written), ak_dec and the merge launched as programmatic
 * dependents (pdl, sm_90 only), the merge's carveout at most shared memory too (mc), page
 * ids 32 steps ahead in registers (pgreg), int8 rows unpadded (i8c: ROW_I8C,
 * E = 128, dense and QSA in one order, dense runs copied in 16-byte
 * pieces), entries per warp step (c: 16, or 32 for E = 128); nst < 0,
 * i8c < 0 and c <= 0 choose by the context (AKD_LONG). STRATA_ATTN_DEC=
 * "nst,per_sm,dyn,pdl,mc,pgreg,i8c,c" overrides the default
 * "-1,0,1,1,0,0,-1,0", for the benchmark's comparisons (test_gpu_attn.c).
 * H200: one wave + dyn + pdl measured fastest (BENCH.md, second pass), and
 * for int8 at 32K cells i8c with 32-entry steps (third pass). */
struct akd_cfg {
    int nst, per_sm, dyn, pdl, mc, pgreg, i8c, c;
};

/* max_cells from which int8 cells of head dim 128 take 32-entry steps, in
 * ROW_I8C rows where a KV head serves up to AKD_I8C_G query heads: on the
 * H200 at 32K cells 37.9 us a layer (31.7 since the sixteenth pass)
 * against 55 with 16-entry padded rows, but 17.3 against 16.3 at 4K and
 * 10.7 against 10.3 at 512 live cells (one step a warp, half the blocks),
 * so a short context keeps 16; the choice is
 * made per capture (max_cells), never per position (a graph replays at
 * any). The rows: tg128 at 32K, Qwen3-8B shape (4 query heads a KV head)
 * 276.5 tok/s unpadded against 256.6 padded (sixth pass; 298 unpadded since
 * the seventh); Qwen3-30B-A3B shape (8) 331.6 against 308.2 since the
 * sixteenth pass freed the unpadded rows' merge of its bank conflicts
 * (263.5 against 271.4 before). f16 cells from AKD_LONG take three ring
 * stages (two blocks an SM instead of three): tg128 at 32K 291.2 against
 * 289.0 (8B), 312.5 against 302.8 (30B-A3B, BENCH.md, sixteenth pass). */
#define AKD_LONG 8192
#define AKD_I8C_G 8

static struct akd_cfg akd_cfg_get(void)
{
    struct akd_cfg c = {-1, 0, 1, 1, 0, 0, -1, 0};
    const char *v = getenv("STRATA_ATTN_DEC");
    if (v && *v)
        sscanf(v, "%d,%d,%d,%d,%d,%d,%d,%d", &c.nst, &c.per_sm, &c.dyn, &c.pdl, &c.mc, &c.pgreg, &c.i8c, &c.c);
    return c;
}

/* Blocks of fn resident per SM (cached per device and function). */
static int akd_occupancy(ak_fn fn, int threads, int smem, char *err, size_t errlen)
{
    static struct {
        ak_fn fn;
        int dev, threads, smem, n;
    } cache[64];
    int dev = 0, n = 0;
    GPU_TRY(cudaGetDevice(&dev), err, errlen);
    for (int i = 0; i < 64; i++)
        if (cache[i].fn == fn && cache[i].dev == dev && cache[i].threads == threads && cache[i].smem == smem)
            return cache[i].n;
    GPU_TRY(cudaOccupancyMaxActiveBlocksPerMultiprocessor(&n, fn, threads, smem), err, errlen);
    n = n < 1 ? 1 : n;
    for (int i = 0; i < 64; i++)
        if (!cache[i].fn) {
            cache[i].fn = fn;
            cache[i].dev = dev;
            cache[i].threads = threads;
            cache[i].smem = smem;
            cache[i].n = n;
            break;
        }
    return n;
}

/* ak_dec over one wave of resident blocks (per_sm), partitions sized on the
 * device so that a short context fills a few whole blocks, then the merge
 * of the live partitions (none when one is live: ak_dec writes the
 * output). The table guarantees f16 or int8 cells, E 64/128 with up to 16
 * rows or 256 with up to 8. */
static int ak_launch_dec(const struct gpu_attn *g, int path, int arch, int sms, gpuStream_t st, char *err,
                         size_t errlen)
{
    int qsa = path == AP_QSA_DECODE;
    struct akd_cfg cf = akd_cfg_get();
    cf.pdl = cf.pdl && arch >= 90;
    ak_args a = ak_args_of(g, qsa);
    int rows = qsa || a.multi ? a.G : g->T * a.G, nb = rows > 8 ? 2 : 1, Z = qsa || a.multi ? g->T : 1, S = 1;
    int longc = a.E == 128 && g->max_cells >= AKD_LONG, long8 = longc && g->kv.cell == KV_CELL_INT8;
    cf.i8c = cf.i8c < 0 ? long8 && a.G <= AKD_I8C_G : cf.i8c;
    cf.c = cf.c > 0 ? cf.c : long8 ? 32 : 16;
    cf.nst = cf.nst >= 0 ? cf.nst : longc && g->kv.cell == KV_CELL_F16 ? 3 : 0;
    ak_fn fn;
    int smem, nw, cs;
    if (g->kv.cell == KV_CELL_INT8 && cf.i8c && a.E == 128)
        akd_pick<ROW_I8C>(a.E, nb, cf.nst, cf.c, &fn, &smem, &nw, &cs);
    else if (g->kv.cell == KV_CELL_INT8)
        akd_pick<ROW_I8>(a.E, nb, cf.nst, cf.c, &fn, &smem, &nw, &cs);
    else
        akd_pick<ROW_F16>(a.E, nb, cf.nst, cf.c, &fn, &smem, &nw, &cs);
    GPU_TRY(cudaFuncSetAttribute((const void *)fn, cudaFuncAttributeMaxDynamicSharedMemorySize, smem), err,
            errlen);
    /* 59-150 KB a block: ask for the largest shared-memory carveout, so
     * that as many blocks as fit are resident (the kernel reads little
     * through L1) */
    GPU_TRY(cudaFuncSetAttribute((const void *)fn, cudaFuncAttributePreferredSharedMemoryCarveout,
                                 cudaSharedmemCarveoutMaxShared),
            err, errlen);
    int per_sm = cf.per_sm;
    if (per_sm <= 0) {
        per_sm = akd_occupancy(fn, 32 * nw, smem, err, errlen);
        if (per_sm <= 0)
            return -1;
    }
    ak_split(g->max_cells, a.K * Z, sms, per_sm, AK_SPLIT_MAX, &S, &a.plen);
    a.S = S;
    a.unit = cf.dyn ? cs * nw : 0;
    ak_partials(g, &a, a.unit && S < AKD_WARP_PARTS ? AKD_WARP_PARTS : S);   /* room for akd_parts' */
    a.pgreg = cf.pgreg;
    a.out_q = g->out_q, a.out_ds = (float4 *)g->out_ds, a.out_bt = g->out_bt;
    GPU_TRY(cudaFuncSetAttribute((const void *)akm_pick(a.E), cudaFuncAttributePreferredSharedMemoryCarveout,
                                 cf.mc ? cudaSharedmemCarveoutMaxShared : cudaSharedmemCarveoutDefault),
            err, errlen);
    if (ak_env("STRATA_ATTN_DEC_LOG")) {
        static ak_fn said_fn;
        static int said_S;
        if (said_fn != fn || said_S != S)
            fprintf(stderr, "strata: ak_dec %d KB smem, %d warps, %d blocks/SM, grid %d x %d x %d, dyn %d, pdl %d, "
                    "mc %d, pgreg %d, i8c %d, %d entries a step\n", smem >> 10, nw, per_sm, S, a.K, Z, cf.dyn, cf.pdl,
                    cf.mc, cf.pgreg, cf.i8c, cs);
        said_fn = fn;
        said_S = S;
    }
    GPU_TRY(gpu_launch(fn, dim3(S, a.K, Z), dim3(32 * nw), smem, st, cf.pdl, a), err, errlen);
    akm_args m = {a.ml, a.acc, g->out, a.out_q, a.out_ds, S, g->T * g->H, a.E, a.unit, g->T, g->H, qsa, a.multi,
                  g->pos0, g->sel_off, g->settled, g->out_bt, nw};
    GPU_TRY(gpu_launch(akm_pick(m.E), dim3(m.TH), dim3(32 * AK_MERGE_W), 0, st, cf.pdl, m), err, errlen);
    return g->out_q ? 1 : 0;
}

static int ak_launch_simt(const struct gpu_attn *g, int path, int sms, gpuStream_t st, char *err, size_t errlen)
{
    int qsa = path & (AP_QSA_PROMPT | AP_QSA_DECODE), split = path & (AP_DECODE | AP_QSA_DECODE);
    ak_args a = ak_args_of(g, qsa != 0);
    int E = a.E, TH = g->T * g->H, bx = (TH + AK_SIMT_ROWS - 1) / AK_SIMT_ROWS, S = 1;
    if (split) {
        ak_split(g->max_cells, bx, sms, 2, AK_SPLIT_MMA, &S, &a.plen);
        ak_partials(g, &a, S);
    }
    ak_fn fn = E <= 64 ? ak_simt_of<2>(g->kv.cell)
             : E <= 128 ? ak_simt_of<4>(g->kv.cell)
             : E <= 256 ? ak_simt_of<8>(g->kv.cell)
                        : ak_simt_of<16>(g->kv.cell);
    fn<<<dim3(bx, S), 32 * AK_SIMT_ROWS, 0, st>>>(a);
    GPU_TRY(gpuGetLastError(), err, errlen);
    return split ? ak_launch_merge(g, a, S, st, err, errlen) : 0;
}

static int ak_check(const struct gpu_attn *g, int path, char *err, size_t errlen)
{
    const struct gpu_kv *kv = &g->kv;
    if (!kv->pages || !kv->page_table || !g->q || !g->out || !g->pos0)
        return strata_errf(err, errlen, "gpu attention: missing pages, page table, q, out or pos0");
    if (kv->cell < 0 || kv->cell >= KV_CELL_COUNT || kv->K <= 0 || kv->E <= 0 || kv->P <= 0 || (kv->P & (kv->P - 1)))
        return strata_errf(err, errlen, "gpu attention: bad cache shape (cell %d, %d kv heads, head dim %d, %d cells "
                           "a page: a power of two)", kv->cell, kv->K, kv->E, kv->P);
    if (g->H <= 0 || g->H % kv->K)
        return strata_errf(err, errlen, "gpu attention: %d query heads do not share %d kv heads evenly", g->H,
                           kv->K);
    if (kv->E > 512)
        return strata_errf(err, errlen, "gpu attention: head dim %d, at most 512", kv->E);
    if (g->layer < 0 || g->layer >= kv->L)
        return strata_errf(err, errlen, "gpu attention: layer %d of %d", g->layer, kv->L);
    if (g->T < 0 || g->max_cells < g->T)
        return strata_errf(err, errlen, "gpu attention: %d queries, at most %d cells", g->T, g->max_cells);
    if ((path & (AP_QSA_PROMPT | AP_QSA_DECODE)) && (!g->sel || !g->sel_off))
        return strata_errf(err, errlen, "gpu attention: QSA without a cell selection");
    if ((path & (AP_DECODE | AP_QSA_DECODE)) && !g->scratch)
        return strata_errf(err, errlen, "gpu attention: split-KV decode without scratch");
    if (g->multi && (path != AP_DECODE || !gpu_attn_takes_multi(g)))
        return strata_errf(err, errlen, "gpu attention: queries of several sequences on a call or kernel that "
                           "takes one (gpu_attn_takes_multi)");
    return 0;
}

/* While gpu_attn_test_time captures a graph (this thread only), the stream
 * a NULL stream names: the legacy default stream cannot be captured. */
static thread_local cudaStream_t ak_test_stream;

static int ak_run(const struct gpu_attn *g, int decode, int qsa, void *stream, char *err, size_t errlen)
{
    if (!stream)
        stream = (void *)ak_test_stream;
    int path = ak_path_of(g, decode, qsa), arch = 0, sms = 0;
    if (ak_check(g, path, err, errlen) || ak_device(&arch, &sms, err, errlen))
        return -1;
    if (g->T == 0)
        return 0;
    gpuStream_t st = (gpuStream_t)stream;
    const struct ak_rule *r = ak_pick(g, path, arch);
    switch (r->kern) {
    case AK_RDNA2:
        switch (path) {
        case AP_PROMPT: return gpu_attn_prompt_rdna2(g, stream, err, errlen);
        case AP_DECODE: return gpu_attn_decode_rdna2(g, stream, err, errlen);
        case AP_QSA_PROMPT: return gpu_attn_qsa_prompt_rdna2(g, stream, err, errlen);
        default: return gpu_attn_qsa_decode_rdna2(g, stream, err, errlen);
        }
    case AK_MMA: return ak_launch_mma(g, path, 0, sms, st, err, errlen);
    case AK_FLASH: return ak_launch_flash(g, path, st, err, errlen);
    case AK_DEC: return ak_launch_dec(g, path, arch, sms, st, err, errlen);
    case AK_I8: {
        static int said;
        if (!said) {
            said = 1;
            fprintf(stderr, "strata: STRATA_QSA_SPLIT_ATTN=1: QSA decode takes the int8-mma split path\n");
        }
        return ak_launch_mma(g, path, 1, sms, st, err, errlen);
    }
    default: return ak_launch_simt(g, path, sms, st, err, errlen);
    }
}

int gpu_attn_prompt(const struct gpu_attn *a, void *stream, char *err, size_t errlen)
{
    return ak_run(a, 0, 0, stream, err, errlen);
}

int gpu_attn_decode(const struct gpu_attn *a, void *stream, char *err, size_t errlen)
{
    return ak_run(a, 1, 0, stream, err, errlen);
}

int gpu_attn_qsa_prompt(const struct gpu_attn *a, void *stream, char *err, size_t errlen)
{
    return ak_run(a, 0, 1, stream, err, errlen);
}

int gpu_attn_qsa_decode(const struct gpu_attn *a, void *stream, char *err, size_t errlen)
{
    return ak_run(a, 1, 1, stream, err, errlen);
}

int gpu_attn_takes_multi(const struct gpu_attn *a)
{
    int arch = 0, sms = 0;
    char err[8];
    if (a->T > AK_DECODE_T || a->sel || !a->settled || ak_device(&arch, &sms, err, sizeof err))
        return 0;
    struct gpu_attn m = *a;
    m.multi = 1;
    return ak_pick(&m, AP_DECODE, arch)->kern == AK_DEC;
}

const char *gpu_attn_kernel_name(const struct gpu_attn *a, int decode, int qsa)
{
    int arch = 0, sms = 0;
    char err[8];
    if (ak_device(&arch, &sms, err, sizeof err))
        return "none (no device)";
    return ak_pick(a, ak_path_of(a, decode, qsa), arch)->name;
}

/* ==== synchronisation and timing for the tests ==== */

int gpu_attn_test_sync(void)
{
    return cudaDeviceSynchronize() == cudaSuccess ? 0 : -1;
}

#ifdef STRATA_TRACE
int gpu_attn_trace_copy(void *dst)
{
    return gpu_trace_copy(dst);
}
#endif

/* ms per call: the reps calls captured once into a graph on a stream of
 * this function's, replayed as gpu.cu replays its decode step (one warm
 * replay, then the median of three timed by events), so that the host's
 * launch costs are not counted. STRATA_ATTN_BENCH_STREAM=1: the old way,
 * reps launches on the default stream after one warm-up call. */
double gpu_attn_test_time(int (*fn)(void *), void *arg, int reps)
{
    cudaEvent_t e[4];
    int ne = 0;
    for (; ne < 4; ne++)
        if (cudaEventCreate(&e[ne]) != cudaSuccess)
            break;
    float ms = -1;
    reps = reps > 0 ? reps : 1;
    if (ne < 4) {
    } else if (ak_env("STRATA_ATTN_BENCH_STREAM")) {
        int bad = fn(arg) != 0;
        cudaEventRecord(e[0], 0);
        for (int i = 0; i < reps && !bad; i++)
            bad = fn(arg) != 0;
        cudaEventRecord(e[1], 0);
        if (!bad && cudaEventSynchronize(e[1]) == cudaSuccess && cudaEventElapsedTime(&ms, e[0], e[1]) == cudaSuccess)
            ms /= reps;
        else
            ms = -1;
    } else {
        cudaStream_t st;
        cudaGraph_t gr = NULL;
        cudaGraphExec_t ge = NULL;
        if (cudaStreamCreate(&st) == cudaSuccess) {
            ak_test_stream = st;
            int bad = fn(arg) != 0 || cudaStreamSynchronize(st) != cudaSuccess;
            if (!bad && cudaStreamBeginCapture(st, cudaStreamCaptureModeThreadLocal) == cudaSuccess) {
                for (int i = 0; i < reps && !bad; i++)
                    bad = fn(arg) != 0;
                bad = cudaStreamEndCapture(st, &gr) != cudaSuccess || bad;
            }
            ak_test_stream = NULL;
            float t[3];
            if (!bad && gr && cudaGraphInstantiate(&ge, gr, 0) == cudaSuccess &&
                cudaGraphLaunch(ge, st) == cudaSuccess) {
                for (int i = 0; i < 3 && !bad; i++)
                    bad = cudaEventRecord(e[0], st) != cudaSuccess || cudaGraphLaunch(ge, st) != cudaSuccess ||
                          cudaEventRecord(e[1], st) != cudaSuccess || cudaEventSynchronize(e[1]) != cudaSuccess ||
                          cudaEventElapsedTime(&t[i], e[0], e[1]) != cudaSuccess;
                if (!bad) {
                    float lo = fminf(t[0], fminf(t[1], t[2])), hi = fmaxf(t[0], fmaxf(t[1], t[2]));
                    ms = (t[0] + t[1] + t[2] - lo - hi) / reps;
                }
            }
            if (ge)
                cudaGraphExecDestroy(ge);
            if (gr)
                cudaGraphDestroy(gr);
            cudaStreamSynchronize(st);
            cudaStreamDestroy(st);
        }
    }
    for (int i = 0; i < ne; i++)
        cudaEventDestroy(e[i]);
    return ms;
}
