/*
 * gpu.cu — the GPU forward pass (CUDA, and HIP through gpu_compat.h; gf_*,
 * with gpu_mv.cu and gpu_mma.cu, gpu_fwd.h between them): the weights
 * uploaded once and kept quantised; the pass itself, layer by layer, and
 * its small kernels: norms and the activation's int8 blocks (quantised on
 * the device in blocks of 32), RoPE, SwiGLU, MoE routing and expert
 * selection on the device, residuals, embeddings, logits; gpu_kv_store (f32
 * rows into kv.c's cell formats, byte for byte as kv_store writes them); KV
 * page memory (gpu_kv_mem); the decode step captured once per context as a
 * graph, and a step of up to 16 sequences (gpu_eval_batch) as one pass, a
 * graph for each batch size; the test and benchmark entry points of gpu.h.
 * The weight products are gpu_mv.cu's (gf_matmul_n: one row, and the
 * dispatch to gpu_gemm.cu above 16 rows or STRATA_GPU_NO_GEMM=1's 8-row
 * blocks) and gpu_mma.cu's (2..16 rows and a prompt's experts on tensor
 * cores). STRATA_GPU_NO_GRAPH=1 runs decode without the graph,
 * STRATA_GPU_NO_PDL=1 without programmatic dependent launch,
 * STRATA_GPU_MOE_PAIRS=1 a prompt's experts one (token, expert) pair at a
 * time through the matrix-vector kernels instead of gpu_gemm (A/B), and
 * STRATA_GPU_NO_NORM_ROUTER=1 a one-token MoE layer's RMSNorm and router
 * as two kernels instead of gf_norm_router_kernel (the same logits).
 * Attention lives in attn_cuda.cu / attn_hip.hip: this file only calls its
 * launchers. It must not touch kv.c's tables (only the page bytes) and never
 * prints.
 */
#include "gpu_fwd.h"

/* ==== activations: RMSNorm / SwiGLU / plain, then int8 blocks ==== */

/* Block sum of a double over the block's threads (all call it). */
static __device__ double gf_block_sum(double v)
{
    __shared__ double part[32];
    for (int m = GPU_WARP / 2; m > 0; m >>= 1)
        v += gpu_shfl_xor(v, m);
    int warp = threadIdx.x / GPU_WARP, lane = threadIdx.x % GPU_WARP, nw = blockDim.x / GPU_WARP;
    __syncthreads();
    if (lane == 0)
        part[warp] = v;
    __syncthreads();
    double s = 0;
    for (int i = 0; i < nw; i++)
        s += part[i];
    return s;
}

/* Row blockIdx.x of n: v = x (PLAIN), RMSNorm(x)·w (NORM: the reference's
 * steps: squares summed in double, scale = 1/sqrtf(mean + eps), two
 * multiplications), silu(x)·x2 (SWIGLU); written as f32 to yf (may be NULL,
 * may be x) and as int8 blocks of 32 the way quant.c's Q8_0/Q8_1 quantise
 * (d = amax/127 stored as f16, multiplier 127/amax, round to nearest even).
 * Each thread takes 4 elements (one 16-byte load), 8 threads a block of 32;
 * a row is spread over blocks of GF_ACT_CHUNK elements (blockIdx.y). The
 * blocks go where gq_act_at's layout bt puts them (gf_act_bt). */
#define GF_ACT_THREADS 256
#define GF_ACT_CHUNK (4 * GF_ACT_THREADS)
#define GF_ACT_NV 4   /* loads a thread has in flight at once (RMSNorm's sum, the router's logits) */

/* Elements 4·i4.. of row `row` (v; ok: whether to store them) as f32 into
 * yf (unless NULL) and as int8 codes with their block's scale. The whole
 * warp calls it (gq_q8_act's shuffles within each 8 lanes' block). */
static __device__ __forceinline__ void gf_act_store(const float (&v)[4], bool ok, int i4, size_t row, int n,
                                                    float *yf, int8_t *q, gf_ads *ds, int bt)
{
    int qi[4];
    gf_ads sc = gq_q8_act<4>(v, qi);
    if (!ok)
        return;
    if (yf)
        ((float4 *)(yf + row * n))[i4] = make_float4(v[0], v[1], v[2], v[3]);
    size_t at = gq_act_at(row * n + 4 * (size_t)i4, n, bt);
    *(char4 *)(q + at) = make_char4((signed char)qi[0], (signed char)qi[1], (signed char)qi[2], (signed char)qi[3]);
    if (i4 % (GF_AB / 4) == 0)
        ds[at / GF_AB] = sc;
}

/* RMSNorm's elements: times scale, times weight (gf_sq4, gf_rms_scale: its sum and scale) */
static __device__ __forceinline__ void gf_rms_apply(float4 x, float scale, float4 g, float (&v)[4])
{
    v[0] = __fmul_rn(__fmul_rn(x.x, scale), g.x), v[1] = __fmul_rn(__fmul_rn(x.y, scale), g.y);
    v[2] = __fmul_rn(__fmul_rn(x.z, scale), g.z), v[3] = __fmul_rn(__fmul_rn(x.w, scale), g.w);
}

template <int MODE>
__global__ void __launch_bounds__(GF_ACT_THREADS) gf_act_kernel(const float *x, const float *x2, const float *w,
                                                                float eps, int n, float *yf, int8_t *q, gf_ads *ds,
                                                                int bt)
{
    GPU_TRACE(GT_ACT);
    /* the norm's weights are no kernel's output: loaded before the wait */
    int i4 = blockIdx.y * GF_ACT_THREADS + threadIdx.x, ok = i4 < n / GF_AB * (GF_AB / 4);
    float4 g = MODE == GF_ACT_NORM && ok ? ((const float4 *)w)[i4] : make_float4(0.0f, 0.0f, 0.0f, 0.0f);
    gf_pdl_begin();
    size_t row = blockIdx.x;
    const float4 *xr = (const float4 *)(x + row * n);
    float scale = 1.0f;
    if (MODE == GF_ACT_NORM) { /* every block of the row sums the whole row: the same sum */
        double s = 0;
        /* a thread's loads go out together (GF_ACT_NV a pass: the whole row at 4096 wide), not one
         * L2 round trip after the other; the squares are added in the same order either way */
        for (int i0 = threadIdx.x; i0 < n / 4; i0 += GF_ACT_NV * blockDim.x) {
            float4 v[GF_ACT_NV];
#pragma unroll
            for (int k = 0; k < GF_ACT_NV; k++) {
                int i = i0 + k * blockDim.x;
                v[k] = i < n / 4 ? xr[i] : make_float4(0.0f, 0.0f, 0.0f, 0.0f);
            }
#pragma unroll
            for (int k = 0; k < GF_ACT_NV; k++)
                s += gf_sq4(v[k]);
        }
        scale = gf_rms_scale(gf_block_sum(s), n, eps);
    }
    GPU_TRACE_MARK();   /* the row's sum formed (the measuring build) */
    /* the whole warp runs the shuffles; lanes past the row's blocks compute on zeros and store nothing */
    float v[4] = {0.0f, 0.0f, 0.0f, 0.0f};
    if (ok) {
        float4 a = xr[i4];
        v[0] = a.x, v[1] = a.y, v[2] = a.z, v[3] = a.w;
        if (MODE == GF_ACT_NORM) {
            gf_rms_apply(a, scale, g, v);
        } else if (MODE == GF_ACT_SWIGLU) {
            float4 u = ((const float4 *)(x2 + row * n))[i4];
            float uw[4] = {u.x, u.y, u.z, u.w};
            for (int k = 0; k < 4; k++)
                v[k] = __fmul_rn(v[k] / (1.0f + expf(-v[k])), uw[k]);
        }
    }
    gf_act_store(v, ok, i4, row, n, yf, q, ds, bt);
}

/* ==== MoE decode: the FFN's RMSNorm and the router in one kernel ====
 * One token, an F32 router of X rows: block e forms the whole normalised
 * row itself (every block the same sum) and the router's logit e. The
 * norm takes gf_act_kernel's steps in its thread layout and the logit
 * gf_mvrow_kernel's sums in their order, so both come out bit for bit as
 * those two kernels wrote them; block e writes the row's int8 blocks j
 * with j % X == e (and f32 into yf) for the experts. The norm's and the
 * router row's weights load before the wait. Against the two kernels: a
 * kernel boundary and an L2 round trip fewer on a MoE layer's chain. */
#define GF_NR_PER 8   /* float4 a thread holds: rows up to 8 · 4 · GF_ACT_THREADS = 8192 wide */
static_assert(GF_ACT_THREADS == GF_ROW_THREADS, "gf_norm_router_kernel sums a logit in gf_mvrow_kernel's layout");

__global__ void __launch_bounds__(GF_ACT_THREADS) gf_norm_router_kernel(const float *x, const float *nw, float eps,
                                                                        const float *wr, size_t ldw, int n,
                                                                        float *router, float *yf, int8_t *q,
                                                                        gf_ads *ds)
{
    GPU_TRACE(GT_NORM_ROUTER);
    int e = blockIdx.x, n4 = n / 4;
    const float4 *w4 = (const float4 *)((const uint8_t *)wr + (size_t)e * ldw), *g4 = (const float4 *)nw;
    const float4 zero = make_float4(0.0f, 0.0f, 0.0f, 0.0f);
    float4 g[GF_NR_PER], w[GF_NR_PER], xv[GF_NR_PER];
#pragma unroll
    for (int k = 0; k < GF_NR_PER; k++) {
        int i4 = threadIdx.x + k * GF_ACT_THREADS;
        g[k] = i4 < n4 ? g4[i4] : zero;
        w[k] = i4 < n4 ? w4[i4] : zero;
    }
    gf_pdl_begin();
#pragma unroll
    for (int k = 0; k < GF_NR_PER; k++) {
        int i4 = threadIdx.x + k * GF_ACT_THREADS;
        xv[k] = i4 < n4 ? ((const float4 *)x)[i4] : zero;
    }
    double s = 0;   /* a thread's squares in gf_act_kernel's order */
#pragma unroll
    for (int k = 0; k < GF_NR_PER; k++)
        s += gf_sq4(xv[k]);
    float scale = gf_rms_scale(gf_block_sum(s), n, eps), acc = 0.0f;
#pragma unroll
    for (int k = 0; k < GF_NR_PER; k++) {
        int i4 = threadIdx.x + k * GF_ACT_THREADS;
        if (k * GF_ACT_THREADS >= n4)   /* (the whole block alike) */
            break;
        float v[4];
        gf_rms_apply(xv[k], scale, g[k], v);
        if (i4 < n4)   /* gf_f32::dotf's sum */
            acc += w[k].x * v[0] + w[k].y * v[1] + w[k].z * v[2] + w[k].w * v[3];
        gf_act_store(v, i4 < n4 && (int)(i4 / (GF_AB / 4)) % (int)gridDim.x == e, i4, 0, n, yf, q, ds, 0);
    }
    float sum = gf_block_sumf<GF_ACT_THREADS>(acc);
    if (threadIdx.x == 0)
        router[e] = sum;
}

/* ==== embeddings: a row of any supported type, 16 elements a thread at a time ==== */

__global__ void gf_embed_kernel(const uint8_t *w, size_t ldw, int type, int D, const int32_t *tokens, float *x)
{
    GPU_TRACE(GT_EMBED);
    gf_pdl_begin();
    int t = blockIdx.x;
    const uint8_t *row = w + (size_t)tokens[t] * ldw;
    for (int i = threadIdx.x; i < D / 16; i += blockDim.x) {   /* (gpu_model_new: D % 16 == 0) */
        float v[16];
        gq_dequant16(type, row, i, v);
        for (int k = 0; k < 16; k++)
            x[(size_t)t * D + 16 * i + k] = v[k];
    }
}

/* ==== KV rows into the page cells (gpu_kv_store) ==== */

enum { GF_ROW_F32, GF_ROW_F16, GF_ROW_I8, GF_ROW_Q4 };

static int gf_krow(int cell)
{
    static const int k[KV_CELL_COUNT] = {GF_ROW_F32, GF_ROW_F16, GF_ROW_I8, GF_ROW_Q4, GF_ROW_I8};
    return k[cell];
}
static int gf_vrow(int cell)
{
    static const int v[KV_CELL_COUNT] = {GF_ROW_F32, GF_ROW_F16, GF_ROW_I8, GF_ROW_Q4, GF_ROW_Q4};
    return v[cell];
}

struct gf_store {
    struct gpu_kv kv;
    int layer, krow, vrow;
    const int32_t *pos0;
    const float *k, *v;
};

/* One row x (E) of cell c (in page pg), kv head h, K or V, into its page
 * slot in the format fmt, by the 32 lanes of one warp: kv.c's encoders, the
 * same bits. */
static __device__ void gf_store_row(const struct gpu_kv &kv, int layer, int fmt, int c, int pg, int h, int isv,
                                    const float *x)
{
    int lane = threadIdx.x % 32, E = kv.E, P = kv.P;
    uint8_t *blk = kv.pages + (size_t)pg * kv.page_bytes +
                   ((size_t)layer * kv.K + h) * P * (kv.kbytes + kv.vbytes);
    uint8_t *dst = isv ? blk + (size_t)P * kv.kbytes + (size_t)(c % P) * kv.vbytes : blk + (size_t)(c % P) * kv.kbytes;
    if (fmt == GF_ROW_F32) {
        for (int i = lane; i < E; i += 32)
            ((float *)dst)[i] = x[i];
    } else if (fmt == GF_ROW_F16) {
        for (int i = lane; i < E; i += 32)
            ((uint16_t *)dst)[i] = gf_f2h(x[i]);
    } else if (fmt == GF_ROW_I8) {
        float amax = 0.0f;
        for (int i = lane; i < E; i += 32)
            amax = fmaxf(amax, fabsf(x[i]));
        for (int m = 16; m > 0; m >>= 1)
            amax = fmaxf(amax, gpu_shfl_xor(amax, m));
        float d = amax / 127.0f, id = d > 0.0f ? 127.0f / amax : 0.0f;
        if (lane == 0)
            memcpy(dst, &d, 4);
        for (int i = lane; i < E; i += 32) {
            float r = rintf(__fmul_rn(x[i], id));
            dst[4 + i] = (uint8_t)(int8_t)(r > 127.0f ? 127 : r < -127.0f ? -127 : (int)r);
        }
    } else {
        /* Q4_0 (quant.c's q4_0_from_f32): d = the signed extreme / -8 (its
         * first occurrence), codes trunc(x/d + 8.5) capped at 15 */
        for (int b = 0; b < E / 32; b++) {
            float v = x[32 * b + lane], amax = fabsf(v);
            for (int m = 16; m > 0; m >>= 1)
                amax = fmaxf(amax, gpu_shfl_xor(amax, m));
            int first = fabsf(v) == amax ? lane : 32;
            for (int m = 16; m > 0; m >>= 1)
                first = min(first, gpu_shfl_xor(first, m));
            float bv = gpu_shfl(v, first < 32 ? first : 0);
            float d = bv / -8.0f, id = d != 0.0f ? 1.0f / d : 0.0f;
            int qv = (int)__fadd_rn(__fmul_rn(v, id), 8.5f);
            qv = qv < 15 ? qv : 15;
            /* byte j (< 16) of the codes: element j low, element j + 16 high;
             * the 18-byte block goes out as 9 halfwords (a 2-byte memcpy of
             * the scale lost its low byte on sm_90) */
            int byte = qv | gpu_shfl_xor(qv, 16) << 4;
            int lo = gpu_shfl(byte, (2 * lane + 30) & 31), hi = gpu_shfl(byte, (2 * lane + 31) & 31);
            uint16_t *o = (uint16_t *)(dst + 18 * b);
            if (lane == 0)
                o[0] = gf_f2h(d);
            else if (lane < 9)
                o[lane] = (uint16_t)(lo | hi << 8);
        }
    }
}

/* one warp per (cell t, kv head, K or V) */
__global__ void gf_store_kernel(gf_store p)
{
    GPU_TRACE(GT_STORE);
    gf_pdl_begin();
    int t = blockIdx.x, h = blockIdx.y, isv = blockIdx.z, c = *p.pos0 + t;
    gf_store_row(p.kv, p.layer, isv ? p.vrow : p.krow, c, p.kv.page_table[c / p.kv.P], h, isv,
                 (isv ? p.v : p.k) + ((size_t)t * p.kv.K + h) * p.kv.E);
}

/* ==== Q/K/V: biases, per-head RMSNorm, RoPE ==== */

struct gf_qkv {
    float *q, *k, *v;               /* (T, H*E), (T, K*E), (T, K*E) */
    const float *bq, *bk, *bv, *q_norm, *k_norm, *rope_freqs;
    int H, K, E, n_rot, neox;
    float eps, theta_scale, freq_scale;
    const int32_t *pos0;
    struct gpu_kv kv;              /* K and V rows go to their cells (kv.pages NULL: not) */
    int layer, krow, vrow;
    /* one sequence a row (gpu_eval_batch): row t at cell pos_t[t] of the
     * page table at pt_t + t·pt_stride, instead of pos0 + t of kv's; NULL:
     * one sequence */
    const int32_t *pos_t, *pt_t;
    int pt_stride;
    /* a pass's RoPE cosines and sines (T, n_rot: cos then sin of each
     * pair) and each token's page, formed once a pass by gf_rope_kernel */
    float *cs;
    int32_t *pg;
};

/* Once a pass, block t: token t's RoPE angles (θ as the CPU forms them:
 * the position times theta_scale i times in f32) as cosines and sines, and
 * its page, for gf_qkv_kernel in every layer. Formed here, not in each
 * layer's kernel before its wait: that kernel's blocks that start only as
 * the q/k/v product ends did this work after it, on the chain (BENCH.md,
 * twentieth pass; once a pass: 8B +1.2%, 30B-A3B +2.4%, twenty-first). */
__global__ void gf_rope_kernel(gf_qkv p)
{
    GPU_TRACE(GT_ROPE);
    gf_pdl_begin();
    int t = blockIdx.x, half = p.n_rot / 2, cell = p.pos_t ? p.pos_t[t] : *p.pos0 + t;
    const int32_t *pt = p.pos_t ? p.pt_t + (size_t)t * p.pt_stride : p.kv.page_table;
    if (threadIdx.x == 0)
        p.pg[t] = p.kv.pages ? pt[cell / p.kv.P] : 0;
    for (int i = threadIdx.x; i < half; i += blockDim.x) {
        float theta = (float)cell;
        for (int j = 0; j < i; j++)
            theta = __fmul_rn(theta, p.theta_scale);
        float th = p.rope_freqs ? theta / p.rope_freqs[i] : theta;
        th = __fmul_rn(p.freq_scale, th);
        p.cs[(size_t)t * p.n_rot + i] = cosf(th);
        p.cs[(size_t)t * p.n_rot + half + i] = sinf(th);
    }
}

/* gf_qkv_head's shared floats for one head, sized to it (it was 12 KB of
 * fixed arrays, whatever the head; BENCH.md, twentieth pass: tg128 level) */
static __host__ __device__ size_t gf_qkv_floats(int E, int n_rot)
{
    return (size_t)(2 * E + n_rot);
}

#define GF_QKV_THREADS 128   /* gf_qkv_kernel's block: a head's threads in the one-token step */

/* Sum of the squares of hv[0..E) as gf_block_sum adds them over a block
 * of GF_QKV_THREADS (thread v: elements v, v + GF_QKV_THREADS, ...; each
 * warp's by shuffles; the warps' sums in order), on NT threads: that
 * block, or GPU_WARP, a warp whose lane stands for the block's threads
 * lane + GPU_WARP·k in turn; so both forms of gf_qkv_head give the same
 * double. */
template <int NT>
static __device__ double gf_head_ss(const float *hv, int E, int tid)
{
    if (NT == GF_QKV_THREADS) {
        double s = 0;
        for (int i = tid; i < E; i += blockDim.x)
            s += (double)__fmul_rn(hv[i], hv[i]);
        return gf_block_sum(s);
    }
    double s = 0;
    for (int k = 0; k < GF_QKV_THREADS / GPU_WARP; k++) {
        double d = 0;
        for (int i = tid + GPU_WARP * k; i < E; i += GF_QKV_THREADS)
            d += (double)__fmul_rn(hv[i], hv[i]);
        for (int m = GPU_WARP / 2; m > 0; m >>= 1)
            d += gpu_shfl_xor(d, m);
        s += d;
    }
    return s;
}

template <int NT>
static __device__ __forceinline__ void gf_head_sync()
{
    if (NT == GF_QKV_THREADS)
        __syncthreads();
    else
        gpu_syncwarp();
}

/* Head hd of H+K+K (q heads, then k, then v) of token t: its bias,
 * RMSNorm and RoPE in place, and for k and v its cell. On NT threads
 * (gf_head_ss: GF_QKV_THREADS, a block, or a warp), tid among them; hv
 * their shared gf_qkv_floats: the head's values, its norm's weights, the
 * cosines and sines. */
template <int NT>
static __device__ __forceinline__ void gf_qkv_head(const gf_qkv &p, int t, int hd, int tid, float *hv)
{
    int E = p.E, half = p.n_rot / 2;
    const unsigned nt = NT == GF_QKV_THREADS ? blockDim.x : NT;   /* (the block form's stride at run time, as it was) */
    float *nwv = hv + E, *co = nwv + E, *si = co + half;
    float *x;
    const float *b, *nw;
    if (hd < p.H) {
        x = p.q + ((size_t)t * p.H + hd) * E, b = p.bq ? p.bq + hd * E : NULL, nw = p.q_norm;
    } else if (hd < p.H + p.K) {
        int h = hd - p.H;
        x = p.k + ((size_t)t * p.K + h) * E, b = p.bk ? p.bk + h * E : NULL, nw = p.k_norm;
    } else {
        int h = hd - p.H - p.K;
        x = p.v + ((size_t)t * p.K + h) * E, b = p.bv ? p.bv + h * E : NULL, nw = NULL;
    }
    /* Before the wait only the loads of the weights (the bias, the norm's:
     * no kernel writes them), into registers, in flight during the wait and
     * not waited for before it (the first 2·NT of a head; any past that
     * after it). The norm's weights come from memory, not L2: waited for
     * after the wait, they made the late blocks late again (BENCH.md,
     * twenty-first pass). The position, page, cosines and sines come from
     * gf_rope_kernel, further up the chain, so after the wait. */
    float wb[2], wn[2];
#pragma unroll
    for (int k = 0; k < 2; k++) {
        int i = tid + k * nt;
        wb[k] = b && i < E ? b[i] : 0.0f;
        wn[k] = nw && i < E ? nw[i] : 0.0f;
    }
    gf_pdl_begin();
    int cell = p.pos_t ? p.pos_t[t] : *p.pos0 + t;
    int pg = p.kv.pages && hd >= p.H ? p.pg[t] : 0;
#pragma unroll
    for (int k = 0; k < 2; k++) {
        int i = tid + k * nt;
        if (i < E) {
            hv[i] = b ? x[i] + wb[k] : x[i];
            nwv[i] = wn[k];
        }
    }
    for (int i = tid + 2 * nt; i < E; i += nt) {
        hv[i] = b ? x[i] + b[i] : x[i];
        if (nw)
            nwv[i] = nw[i];
    }
    if (hd < p.H + p.K)
        for (int i = tid; i < half; i += nt)
            co[i] = p.cs[(size_t)t * p.n_rot + i], si[i] = p.cs[(size_t)t * p.n_rot + half + i];
    gf_head_sync<NT>();
    GPU_TRACE_MARK();   /* the head's values in (the measuring build) */
    /* the cells are encoded from hv (shared), not read back from x */
    if (hd >= p.H + p.K) {
        for (int i = tid; i < E; i += nt)
            x[i] = hv[i];
        gf_head_sync<NT>();
        if (p.kv.pages && tid < 32)
            gf_store_row(p.kv, p.layer, p.vrow, cell, pg, hd - p.H - p.K, 1, hv);
        return;
    }
    if (nw) {
        double s = gf_head_ss<NT>(hv, E, tid);
        float scale = 1.0f / sqrtf((float)(s / E) + p.eps);
        for (int i = tid; i < E; i += nt)
            hv[i] = __fmul_rn(__fmul_rn(hv[i], scale), nwv[i]);
        gf_head_sync<NT>();
    }
    for (int i = tid; i < half; i += nt) {
        int i0 = p.neox ? i : 2 * i, i1 = p.neox ? i + half : 2 * i + 1;
        float a = hv[i0], c = hv[i1];
        /* the CPU's fused forms: fma(a, cos, -(b·sin)), fma(a, sin, b·cos);
         * a pair is this thread's alone, so it is rotated in place too */
        x[i0] = hv[i0] = fmaf(a, co[i], -__fmul_rn(c, si[i]));
        x[i1] = hv[i1] = fmaf(a, si[i], __fmul_rn(c, co[i]));
    }
    for (int i = 2 * half + tid; i < E; i += nt)
        x[i] = hv[i];
    if (hd >= p.H) {
        gf_head_sync<NT>();
        if (p.kv.pages && tid < 32)
            gf_store_row(p.kv, p.layer, p.krow, cell, pg, hd - p.H, 0, hv);
    }
}

/* block (t, head of H+K+K) of GF_QKV_THREADS: a step of up to GF_DECODE_T rows
 * (a warp a head there cost the one-token step 2-3.5%: BENCH.md,
 * twenty-sixth pass) */
__global__ void gf_qkv_kernel(gf_qkv p)
{
    GPU_TRACE(GT_QKV);
    extern __shared__ float hv[];   /* gf_qkv_floats */
    gf_qkv_head<GF_QKV_THREADS>(p, blockIdx.x, blockIdx.y, threadIdx.x, hv);
}

/* A prompt's T rows: a warp a head, GF_QKV_WARPS of the T·(H+K+K) heads a
 * block, token by token (a block a head took a 2048-token chunk ~120 µs a
 * layer on the H200, ten times its bytes: BENCH.md, forty-seventh pass) */
#define GF_QKV_WARPS 8
__global__ void __launch_bounds__(GF_QKV_WARPS * GPU_WARP) gf_qkv_rows_kernel(gf_qkv p, int T)
{
    extern __shared__ float hv[];   /* GF_QKV_WARPS · gf_qkv_floats */
    int w = threadIdx.x / GPU_WARP, nh = p.H + 2 * p.K, j = blockIdx.x * GF_QKV_WARPS + w;
    if (j < T * nh)
        gf_qkv_head<GPU_WARP>(p, j / nh, j % nh, threadIdx.x % GPU_WARP, hv + w * gf_qkv_floats(p.E, p.n_rot));
}

/* ==== MoE: routing, weighted sum ==== */

/* whether expert j (probability o) ranks above expert e (v): higher, or
 * as high and of a lower index */
static __device__ __forceinline__ int gf_ranks_above(float o, int j, float v, int e)
{
    return o > v || (o == v && j < e);
}

/* A block per token: the softmax of its X router logits, the U most
 * probable experts (ties to the lower index) into sel (T, U) in order,
 * their probabilities renormalised (summed in double, the sum at least
 * 2^-14) into selw. Warp 0 alone forms the softmax (its sums in a fixed
 * order); then each thread ranks its experts among all X at once, where
 * picking the largest U times over took U rounds of warp reductions in
 * series. */
#define GF_ROUTE_THREADS 128
__global__ void __launch_bounds__(GF_ROUTE_THREADS) gf_route_kernel(const float *router, int X, int U, int32_t *sel,
                                                                    float *selw)
{
    GPU_TRACE(GT_ROUTE);
    gf_pdl_begin();
    extern __shared__ float4 route_sm[];   /* X probabilities, then U choices and U weights (16-aligned) */
    float *pr = (float *)route_sm;
    int t = blockIdx.x, tid = threadIdx.x, *ch = (int *)(pr + X);
    float *w = pr + X + U;
    if (tid < U)
        ch[tid] = 0, w[tid] = 0.0f;   /* (what a NaN logit leaves unranked) */
    if (tid < GPU_WARP) {
        int lane = tid;
        const float *x = router + (size_t)t * X;
        /* the logits into pr, a lane's loads in flight together (GF_ACT_NV a pass: 128 experts in one) */
        for (int e0 = lane; e0 < X; e0 += GF_ACT_NV * GPU_WARP) {
            float v[GF_ACT_NV];
#pragma unroll
            for (int k = 0; k < GF_ACT_NV; k++)
                v[k] = x[min(e0 + k * GPU_WARP, X - 1)];
#pragma unroll
            for (int k = 0; k < GF_ACT_NV; k++)
                if (e0 + k * GPU_WARP < X)
                    pr[e0 + k * GPU_WARP] = v[k];
        }
        float mx = -INFINITY;
        for (int e = lane; e < X; e += GPU_WARP)   /* (each lane reads back what it wrote) */
            mx = fmaxf(mx, pr[e]);
        mx = warp_max(mx);
        double s = 0;
        for (int e = lane; e < X; e += GPU_WARP) {
            pr[e] = expf(pr[e] - mx);
            s += (double)pr[e];
        }
        for (int m = GPU_WARP / 2; m > 0; m >>= 1)
            s += gpu_shfl_xor(s, m);
        float inv = (float)(1.0 / s);
        for (int e = lane; e < X; e += GPU_WARP)
            pr[e] *= inv;
    }
    __syncthreads();
    /* each expert's rank among all X (ties to the lower index), four
     * probabilities a load and sixteen loads in flight: one load at a
     * time, each compare waiting on it, the loop was ~2 µs of the kernel
     * on every MoE layer (BENCH.md, twenty-fifth pass) */
    for (int e = tid; e < X; e += blockDim.x) {
        float v = pr[e];
        int r = 0, j = 0;
#pragma unroll 4
        for (; j + 4 <= X; j += 4) {
            float4 o = *(const float4 *)(pr + j);
            r += gf_ranks_above(o.x, j, v, e) + gf_ranks_above(o.y, j + 1, v, e) + gf_ranks_above(o.z, j + 2, v, e) +
                 gf_ranks_above(o.w, j + 3, v, e);
        }
        for (; j < X; j++)
            r += gf_ranks_above(pr[j], j, v, e);
        if (r < U)
            ch[r] = e, w[r] = v;
    }
    __syncthreads();
    if (tid < U) {
        double wsum = 0;
        for (int k = 0; k < U; k++)
            wsum += (double)w[k];
        float ws = (float)wsum;
        ws = ws < 6.103515625e-5f ? 6.103515625e-5f : ws;
        sel[(size_t)t * U + tid] = ch[tid], selw[(size_t)t * U + tid] = w[tid] / ws;
    }
}

/* x (T, D) += Σ_k w[t,k]·eo[t*U+k], summed in the order chosen */
__global__ void gf_moe_sum_kernel(float *x, const float *eo, const float *selw, int D, int U)
{
    GPU_TRACE(GT_MOE_SUM);
    gf_pdl_begin();
    int t = blockIdx.x;
    const float *w = selw + (size_t)t * U;
    for (int i = threadIdx.x; i < D; i += blockDim.x) {
        float acc = __fmul_rn(eo[(size_t)t * U * D + i], w[0]);
        for (int k = 1; k < U; k++)
            acc = __fadd_rn(acc, __fmul_rn(eo[((size_t)t * U + k) * D + i], w[k]));
        x[(size_t)t * D + i] = acc + x[(size_t)t * D + i];
    }
}

/* The n = T·U (token, expert) pairs of a prompt chunk (sel) grouped by
 * expert: order (n) lists expert 0's pairs, then expert 1's, and so on;
 * offs (X + 1) where each expert's start. One block (X <= GF_SORT_MAX_X):
 * the experts' counts in shared memory, their prefix sums, then each pair
 * takes the next place of its expert. Those places are taken by shared
 * atomics, so the order within an expert varies from run to run; no result
 * depends on it: each row of the grouped products is computed on its own,
 * and gf_rows_kernel scatters it back to its pair. */
#define GF_SORT_THREADS 1024
#define GF_SORT_MAX_X 1024
__global__ void __launch_bounds__(GF_SORT_THREADS) gf_moe_sort_kernel(const int32_t *sel, int n, int X,
                                                                       int32_t *order, int32_t *offs)
{
    gf_pdl_begin();
    __shared__ int32_t next[GF_SORT_MAX_X], off[GF_SORT_MAX_X + 1];
    for (int e = threadIdx.x; e < X; e += blockDim.x)
        next[e] = 0;
    __syncthreads();
    for (int i = threadIdx.x; i < n; i += blockDim.x)
        atomicAdd(&next[sel[i]], 1);
    __syncthreads();
    if (threadIdx.x == 0) {
        off[0] = 0;
        for (int e = 0; e < X; e++)
            off[e + 1] = off[e] + next[e];
    }
    __syncthreads();
    for (int e = threadIdx.x; e <= X; e += blockDim.x) {
        offs[e] = off[e];
        if (e < X)
            next[e] = off[e];
    }
    __syncthreads();
    for (int i = threadIdx.x; i < n; i += blockDim.x)
        order[atomicAdd(&next[sel[i]], 1)] = i;
}

/* Row i (blockIdx.x) of dst (width w) = row order[i] / div of src (gather),
 * or row order[i] of dst = row i of src (scatter). */
__global__ void gf_rows_kernel(float *dst, const float *src, const int32_t *order, int div, int w, int scatter)
{
    gf_pdl_begin();
    size_t i = blockIdx.x, j = (size_t)order[i];
    float *d = dst + (scatter ? j : i) * w;
    const float *x = src + (scatter ? i : j / div) * w;
    for (int k = threadIdx.x; k < w; k += blockDim.x)
        d[k] = x[k];
}

/* x (T, n) = (y + b) + x, either of y and b absent */
__global__ void gf_add_kernel(float *x, const float *y, const float *b, int n, size_t total)
{
    GPU_TRACE(GT_ADD);
    gf_pdl_begin();
    for (size_t i = blockIdx.x * (size_t)blockDim.x + threadIdx.x; i < total; i += (size_t)gridDim.x * blockDim.x) {
        float v = y ? y[i] : b[i % n];
        if (y && b)
            v = v + b[i % n];
        x[i] = v + x[i];
    }
}

/* ==== host side ==== */


/* Stage timing for gpu_test_profile: an event after each stage. */
enum { GF_ST_EMBED, GF_ST_NORM, GF_ST_QKV, GF_ST_ROPE_STORE, GF_ST_ATTN, GF_ST_ACT, GF_ST_WO, GF_ST_FFN_NORM,
       GF_ST_ROUTER, GF_ST_SORT, GF_ST_GATE_UP, GF_ST_SWIGLU, GF_ST_DOWN, GF_ST_HEAD, GF_ST_COUNT };
static const char *const gf_st_names[GF_ST_COUNT] = {"embed", "attn_norm+q8", "qkv", "rope+kv_store", "attention",
                                                      "q8(attn out)", "wo+resid", "ffn_norm+q8", "router+top-k",
                                                      "sort+gather", "gate/up", "swiglu+q8", "down+resid",
                                                      "norm+head"};
#define GF_PROF_MAX 4096
struct gf_prof {
    gpuEvent_t ev[GF_PROF_MAX];
    int stage[GF_PROF_MAX];
    int n;
};

static void gf_mark(struct gpu_ctx *c, int stage)
{
    struct gf_prof *p = c->prof;
    if (p && p->n < GF_PROF_MAX && gpuEventRecord(p->ev[p->n], c->stream) == gpuSuccess)
        p->stage[p->n++] = stage;
}

/* c->io's length, and where a batch's rows begin in it: the position of
 * row t at gf_rows(c)[t], its page table at gf_rows(c) + B + t·max_pages */
static size_t gf_io_ints(const struct gpu_ctx *c)
{
    return (size_t)c->T + 1 + c->max_pages + c->B + (size_t)c->B * c->max_pages;
}

static int32_t *gf_rows(const struct gpu_ctx *c)
{
    return c->io + c->T + 1 + c->max_pages;
}

static int gf_supported(int type)
{
    switch (type) {
    case QT_F32: case QT_F16: case QT_BF16: case QT_Q4_0: case QT_Q4_1: case QT_Q5_0: case QT_Q5_1:
    case QT_Q8_0: case QT_Q2_K: case QT_Q3_K: case QT_Q4_K: case QT_Q5_K: case QT_Q6_K: case QT_IQ4_NL:
    case QT_IQ4_XS: case QT_IQ2_XXS: case QT_IQ2_XS: case QT_IQ2_S: case QT_IQ3_XXS: case QT_IQ3_S:
        return 1;
    }
    return 0;
}

static int gf_float_type(int type) { return type == QT_F32 || type == QT_F16 || type == QT_BF16; }

const char *gpu_backend(void)
{
#ifdef GPU_HIP
    return "hip";
#else
    return "cuda";
#endif
}

int gpu_devices(char *name, size_t cap)
{
    int n = 0;
    if (gpuGetDeviceCount(&n) != gpuSuccess)
        n = 0;
    if (name && cap) {
        name[0] = 0;
        gpuDeviceProp p;
        if (n > 0 && gpuGetDeviceProperties(&p, 0) == gpuSuccess)
            snprintf(name, cap, "%s", p.name);
    }
    return n;
}

double gpu_copy_bandwidth(size_t bytes)
{
    void *a = NULL, *b = NULL;
    gpuEvent_t e0 = NULL, e1 = NULL;
    float ms = 0;
    double bw = 0;
    enum { REPS = 5 };
    if (gpuMalloc(&a, bytes) == gpuSuccess && gpuMalloc(&b, bytes) == gpuSuccess &&
        gpuMemset(a, 1, bytes) == gpuSuccess && gpuEventCreate(&e0) == gpuSuccess &&
        gpuEventCreate(&e1) == gpuSuccess &&
        gpuMemcpy(b, a, bytes, gpuMemcpyDeviceToDevice) == gpuSuccess && /* warm-up */
        gpuEventRecord(e0, 0) == gpuSuccess) {
        int ok = 1;
        for (int r = 0; r < REPS && ok; r++)
            ok = gpuMemcpyAsync(r % 2 ? a : b, r % 2 ? b : a, bytes, gpuMemcpyDeviceToDevice, 0) == gpuSuccess;
        if (ok && gpuEventRecord(e1, 0) == gpuSuccess && gpuEventSynchronize(e1) == gpuSuccess &&
            gpuEventElapsedTime(&ms, e0, e1) == gpuSuccess && ms > 0)
            bw = 2.0 * (double)bytes * REPS / (ms * 1e-3); /* each byte read once and written once */
    }
    if (e0)
        gpuEventDestroy(e0);
    if (e1)
        gpuEventDestroy(e1);
    if (a)
        gpuFree(a);
    if (b)
        gpuFree(b);
    return bw;
}

/* ---- weights ---- */

static size_t gf_align(size_t n) { return (n + 255) & ~(size_t)255; }

static size_t gf_mat_bytes(const struct model_mat *w, int X)
{
    return w->data ? w->stride * (size_t)(X > 0 ? X : 1) : 0;
}

/* Checks a matrix's type and shape for the kernels. */
static int gf_mat_check(const struct model_mat *w, const char *what, char *err, size_t errlen)
{
    if (!w->data)
        return 0;
    if (!gf_supported(w->type))
        return strata_errf(err, errlen, "tensor type %s not supported on the GPU yet (use --device cpu)",
                           gguf_type_name(w->type));
    if (w->n % (gf_float_type(w->type) ? 8 : GF_AB) != 0)
        return strata_errf(err, errlen, "%s: rows of %d elements do not fit the GPU kernels (use --device cpu)",
                           what, w->n);
    return 0;
}

struct gf_upload {
    uint8_t *base;
    size_t off;
    const struct gpu_model *g;
};

static int gf_put(struct gf_upload *u, const void *src, size_t bytes, const void **dst, char *err, size_t errlen)
{
    *dst = NULL;
    if (!src || !bytes)
        return 0;
    GPU_TRY(gpuMemcpy(u->base + u->off, src, bytes, gpuMemcpyHostToDevice), err, errlen);
    *dst = u->base + u->off;
    u->off += gf_align(bytes);
    return 0;
}

static int gf_put_mat(struct gf_upload *u, const struct model_mat *w, int X, struct gf_mat *o, char *err,
                      size_t errlen)
{
    o->type = w->type, o->n = w->n, o->rows = w->rows, o->ldw = w->ldw, o->stride = w->stride;
    return gf_put(u, w->data, gf_mat_bytes(w, X), (const void **)&o->d, err, errlen);
}

static int gf_put_vec(struct gf_upload *u, const float *v, int n, const float **o, char *err, size_t errlen)
{
    return gf_put(u, v, (size_t)n * sizeof(float), (const void **)o, err, errlen);
}

int gpu_model_new(struct gpu_model **out, const struct model *m, char *err, size_t errlen)
{
    *out = NULL;
    if (gpu_devices(NULL, 0) <= 0)
        return strata_errf(err, errlen, "no GPU device (use --device cpu)");
    const struct model_hp *hp = model_hp(m);
    struct model_weights w;
    model_weights(m, &w);
    int D = hp->n_embd, HE = hp->n_head * hp->head_dim, KE = hp->n_head_kv * hp->head_dim, X = hp->n_expert;
    if (hp->head_dim > 1024 || hp->n_expert_used > 64 || hp->n_expert > 8192 || D % 16)
        return strata_errf(err, errlen,
                           "model shape (n_embd %d, head dim %d, %d of %d experts) not supported on the GPU "
                           "(use --device cpu)", D, hp->head_dim, hp->n_expert_used, hp->n_expert);
    if (gf_mat_check(&w.tok_embd, "token_embd", err, errlen) || gf_mat_check(&w.output, "output", err, errlen))
        return -1;
    size_t total = gf_align(gf_mat_bytes(&w.tok_embd, 0)) + 5 * gf_align((size_t)hp->n_vocab * 4) +
                   gf_align((size_t)D * 4) + gf_align((size_t)hp->n_rot * 4);
    if (w.output.data != w.tok_embd.data)
        total += gf_align(gf_mat_bytes(&w.output, 0));
    for (int il = 0; il < hp->n_layer; il++) {
        const struct model_layer *ly = &w.layers[il];
        const struct model_mat *mats[] = {&ly->wq, &ly->wk, &ly->wv, &ly->wo, &ly->gate, &ly->up, &ly->down,
                                          &ly->gate_inp, &ly->gate_exps, &ly->up_exps, &ly->down_exps};
        for (size_t i = 0; i < sizeof mats / sizeof mats[0]; i++) {
            char what[48];
            snprintf(what, sizeof what, "layer %d matrix %zu", il, i);
            if (gf_mat_check(mats[i], what, err, errlen))
                return -1;
            total += gf_align(gf_mat_bytes(mats[i], i >= 8 ? X : 0));
        }
        total += 4 * gf_align((size_t)D * 4) + 2 * gf_align((size_t)HE * 4) + 4 * gf_align((size_t)KE * 4) +
                 2 * gf_align((size_t)hp->head_dim * 4);
    }
    struct gpu_model *g = (struct gpu_model *)calloc(1, sizeof *g);
    if (!g || !(g->layers = (struct gf_layer *)calloc((size_t)hp->n_layer, sizeof *g->layers))) {
        free(g);
        return strata_errf(err, errlen, "out of memory");
    }
    g->hp = *hp;
    g->freq_scale = w.freq_scale;
    gpuError_t e = gpuMalloc((void **)&g->mem, total);
    if (e != gpuSuccess) {
        free(g->layers);
        free(g);
        return strata_errf(err, errlen, "GPU memory for %.1f MiB of weights: %s", total / 1048576.0,
                           gpuGetErrorString(e));
    }
    struct gf_upload u = {g->mem, 0, g};
    int rc = gf_put_mat(&u, &w.tok_embd, 0, &g->tok_embd, err, errlen);
    if (!rc && w.output.data == w.tok_embd.data)
        g->output = g->tok_embd;
    else if (!rc)
        rc = gf_put_mat(&u, &w.output, 0, &g->output, err, errlen);
    if (!rc) rc = gf_put_vec(&u, w.output_norm, D, &g->output_norm, err, errlen);
    if (!rc) rc = gf_put_vec(&u, w.output_b, hp->n_vocab, &g->output_b, err, errlen);
    if (!rc) rc = gf_put_vec(&u, w.rope_freqs, hp->n_rot / 2, &g->rope_freqs, err, errlen);
    for (int il = 0; il < hp->n_layer && !rc; il++) {
        const struct model_layer *ly = &w.layers[il];
        struct gf_layer *o = &g->layers[il];
        o->moe = ly->moe;
        rc = gf_put_vec(&u, ly->attn_norm, D, &o->attn_norm, err, errlen) ||
             gf_put_vec(&u, ly->bq, HE, &o->bq, err, errlen) || gf_put_vec(&u, ly->bk, KE, &o->bk, err, errlen) ||
             gf_put_vec(&u, ly->bv, KE, &o->bv, err, errlen) || gf_put_vec(&u, ly->bo, D, &o->bo, err, errlen) ||
             gf_put_vec(&u, ly->q_norm, hp->head_dim, &o->q_norm, err, errlen) ||
             gf_put_vec(&u, ly->k_norm, hp->head_dim, &o->k_norm, err, errlen) ||
             gf_put_vec(&u, ly->ffn_norm, D, &o->ffn_norm, err, errlen) ||
             gf_put_mat(&u, &ly->wq, 0, &o->wq, err, errlen) || gf_put_mat(&u, &ly->wk, 0, &o->wk, err, errlen) ||
             gf_put_mat(&u, &ly->wv, 0, &o->wv, err, errlen) || gf_put_mat(&u, &ly->wo, 0, &o->wo, err, errlen) ||
             gf_put_mat(&u, &ly->gate, 0, &o->gate, err, errlen) || gf_put_mat(&u, &ly->up, 0, &o->up, err, errlen) ||
             gf_put_mat(&u, &ly->down, 0, &o->down, err, errlen) ||
             gf_put_mat(&u, &ly->gate_inp, 0, &o->gate_inp, err, errlen) ||
             gf_put_mat(&u, &ly->gate_exps, X, &o->gate_exps, err, errlen) ||
             gf_put_mat(&u, &ly->up_exps, X, &o->up_exps, err, errlen) ||
             gf_put_mat(&u, &ly->down_exps, X, &o->down_exps, err, errlen) ? -1 : 0;
    }
    g->bytes = u.off;
    if (rc) {
        gpu_model_free(g);
        return -1;
    }
    *out = g;
    return 0;
}

void gpu_model_free(struct gpu_model *g)
{
    if (!g)
        return;
    gpuFree(g->mem);
    free(g->layers);
    free(g);
}

size_t gpu_model_bytes(const struct gpu_model *g) { return g ? g->bytes : 0; }

/* ---- KV page memory ---- */

static void *gf_kv_alloc(void *user, size_t bytes)
{
    (void)user;
    void *p = NULL;
    return gpuMalloc(&p, bytes) == gpuSuccess ? p : NULL;
}

static void gf_kv_copy(void *user, void *dst, const void *src, size_t bytes)
{
    (void)user;
    /* ordered after the forward pass's stream: that stream is a blocking one */
    (void)gpuMemcpy(dst, src, bytes, gpuMemcpyDeviceToDevice);
}

static void gf_kv_free(void *user, void *p)
{
    (void)user;
    gpuFree(p);
}

static const struct kv_mem gf_kv_mem = {gf_kv_alloc, gf_kv_copy, gf_kv_free, NULL};

const struct kv_mem *gpu_kv_mem(struct gpu_model *g)
{
    (void)g;
    return &gf_kv_mem;
}

/* Activation rows (T, n) into the int8 blocks (and f32 into yf). */
int gf_act(gpuStream_t s, int mode, const float *x, const float *x2, const float *w, float eps, int n,
           int T, int bt, float *yf, int8_t *q, gf_ads *ds, char *err, size_t errlen)
{
    if (T <= 0)
        return 0;
    int threads = GF_ACT_THREADS;
    dim3 grid(T, (n + GF_ACT_CHUNK - 1) / GF_ACT_CHUNK);
    if (mode == GF_ACT_NORM)
        gf_launch(gf_act_kernel<GF_ACT_NORM>, grid, threads, 0, s, x, x2, w, eps, n, yf, q, ds, bt);
    else if (mode == GF_ACT_SWIGLU)
        gf_launch(gf_act_kernel<GF_ACT_SWIGLU>, grid, threads, 0, s, x, x2, w, eps, n, yf, q, ds, bt);
    else
        gf_launch(gf_act_kernel<GF_ACT_PLAIN>, grid, threads, 0, s, x, x2, w, eps, n, yf, q, ds, bt);
    GF_LAUNCH_CHECK(err, errlen);
    return 0;
}

static void gf_kv_desc(struct gpu_ctx *c, struct gpu_kv *d)
{
    struct kv_layout lo;
    kv_layout(c->kv, &lo);
    const struct kv_config *cfg = kv_cfg(c->kv);
    d->pages = lo.data;
    d->page_bytes = lo.page_bytes, d->kbytes = lo.kbytes, d->vbytes = lo.vbytes;
    d->cell = cfg->cell;
    d->L = cfg->n_layer, d->K = cfg->n_head_kv, d->E = cfg->head_dim, d->P = lo.P;
    d->page_table = c->io + c->T + 1;
}

static int gf_attention(struct gpu_ctx *c, int il, int T, char *err, size_t errlen)
{
    const struct model_hp *hp = &c->g->hp;
    struct gpu_attn a;
    memset(&a, 0, sizeof a);
    gf_kv_desc(c, &a.kv);
    a.layer = il, a.q = c->q, a.out = c->ao, a.H = hp->n_head, a.T = T, a.pos0 = c->io + c->T;
    a.max_cells = c->max_cells, a.scale = 1.0f / sqrtf((float)hp->head_dim), a.scratch = c->attn_scratch;
    if (T > GF_DECODE_T)
        return gpu_attn_prompt(&a, c->stream, err, errlen);
    a.out_q = c->aq, a.out_ds = (float *)c->ads, a.out_bt = c->abt;
    /* gpu_eval copies pos0 and the page table before the step, and every
     * cell before pos0 came from an earlier gpu_eval, which synchronised */
    a.settled = 1;
    if (!c->rows)
        return gpu_attn_decode(&a, c->stream, err, errlen);
    /* one sequence a row: one call for all (multi), where the kernel takes
     * it and STRATA_GPU_BATCH_ROWS=1 does not ask for a call a row */
    a.kv.page_table = gf_rows(c) + c->B, a.pos0 = gf_rows(c);
    a.multi = 1, a.pt_stride = c->max_pages;
    if (gpu_attn_takes_multi(&a) && !gf_env("STRATA_GPU_BATCH_ROWS"))
        return gpu_attn_decode(&a, c->stream, err, errlen);
    a.multi = 0;
    int HE = hp->n_head * hp->head_dim, rc = 0;
    a.T = 1;
    for (int t = 0; t < T && rc >= 0; t++) {
        a.kv.page_table = gf_rows(c) + c->B + (size_t)t * c->max_pages, a.pos0 = gf_rows(c) + t;
        a.q = c->q + (size_t)t * HE, a.out = c->ao + (size_t)t * HE;
        /* (row t's blocks start t blocks in where they lie side by side) */
        size_t b0 = c->abt ? (size_t)t : (size_t)t * (HE / GF_AB);
        a.out_q = c->aq + b0 * GF_AB, a.out_ds = (float *)(c->ads + b0);
        int r = gpu_attn_decode(&a, c->stream, err, errlen);
        rc = r < 0 || (t && r != rc) ? -1 : r;   /* (every row takes the same kernel) */
    }
    return rc;
}

/* A prompt's experts as matrix products: the (token, expert) pairs sorted
 * by expert (gf_moe_sort_kernel, which writes each expert's offset into the
 * sorted pairs), their rows gathered in that order, and one grouped
 * product (gpu_gemm_experts: every expert's contiguous rows times its
 * matrix, in one launch that reads the offsets on the device, so the host
 * never waits) each for gate and up; SwiGLU on the sorted rows; down the
 * same way; then the outputs scattered back to pair order for
 * gf_moe_sum_kernel. Returns 1 where not taken (decode, types gpu_gemm
 * lacks, more than 1024 experts, STRATA_GPU_MOE_PAIRS=1, a gpu_gemm
 * failure): the caller runs the pairs through the matrix-vector kernels. */
static int gf_experts_gemm(struct gpu_ctx *c, const struct gf_layer *ly, int T, char *err, size_t errlen)
{
    const struct model_hp *hp = &c->g->hp;
    const struct gf_mat *gw = &ly->gate_exps, *uw = &ly->up_exps, *dw = &ly->down_exps;
    int X = hp->n_expert, U = hp->n_expert_used, D = hp->n_embd, Fe = gw->rows, n = T * U;
    if (T <= GF_DECODE_T || !c->gemm_ok || X > GF_SORT_MAX_X || !gpu_gemm_supports(gw->type) ||
        !gpu_gemm_supports(uw->type) || !gpu_gemm_supports(dw->type) || gf_env("STRATA_GPU_MOE_PAIRS"))
        return 1;
    gpuStream_t s = c->stream;
    gf_launch(gf_moe_sort_kernel, 1, GF_SORT_THREADS, 0, s, (const int32_t *)c->sel, n, X, c->order, c->offs);
    gf_launch(gf_rows_kernel, n, 256, 0, s, c->xs, (const float *)c->xn, (const int32_t *)c->order, U, D, 0);
    GF_LAUNCH_CHECK(err, errlen);
    gf_mark(c, GF_ST_SORT);
    /* on tensor cores from the weights' blocks (the sorted rows' int8 blocks
     * first), else gpu_gemm's, chosen for gate/up and for down apart (a
     * Q4_K_M file's Q4_K gate/up and Q6_K down cross gpu_gemm at different
     * rows); a failure of gpu_gemm: as gf_matmul_n, the matrix-vector
     * kernels from now on (they redo it all) */
    const struct gf_mat *gu[2] = {gw, uw};
    float *gu_y[2] = {c->gt, c->up};
    int mvx = gf_mvx_takes(gu, 2, n, X), mvx_down = gf_mvx_takes(&dw, 1, n, X);
    if (mvx) {
        /* (the int8 activation for gf_mvx_kernel's types) */
        if ((!gf_mvxh_takes(gu, 2) &&
             gf_act(s, GF_ACT_PLAIN, c->xs, NULL, NULL, 0, D, n, n, NULL, c->aq, c->ads, err, errlen)) ||
            gf_mvx(c, gu, gu_y, 2, Fe, n, c->xs, err, errlen))
            return -1;
    } else if (gpu_gemm_experts(gw->type, gw->d, gw->ldw, gw->stride, D, Fe, c->xs, n, c->offs, X, c->gt, Fe,
                                c->gemm_scratch, s, err, errlen) ||
               gpu_gemm_experts(uw->type, uw->d, uw->ldw, uw->stride, D, Fe, c->xs, n, c->offs, X, c->up, Fe,
                                c->gemm_scratch, s, err, errlen))
        return c->gemm_ok = 0, 1;
    gf_mark(c, GF_ST_GATE_UP);
    if (gf_act(s, GF_ACT_SWIGLU, c->gt, c->up, NULL, 0, Fe, n, mvx_down ? n : 0, c->gt, c->aq, c->ads, err,
               errlen))
        return -1;
    gf_mark(c, GF_ST_SWIGLU);
    if (mvx_down) {
        if (gf_mvx(c, &dw, &c->xs, 1, D, n, c->gt, err, errlen))
            return -1;
    } else if (gpu_gemm_experts(dw->type, dw->d, dw->ldw, dw->stride, Fe, D, c->gt, n, c->offs, X, c->xs, D,
                                c->gemm_scratch, s, err, errlen))
        return c->gemm_ok = 0, 1;
    gf_launch(gf_rows_kernel, n, 256, 0, s, c->eo, (const float *)c->xs, (const int32_t *)c->order, 1, D, 1);
    GF_LAUNCH_CHECK(err, errlen);
    return 0;
}

/* gf_qkv's fields that are the pass's, not a layer's: the positions, the
 * page tables, RoPE's constants and the pass's tables */
static gf_qkv gf_qkv_of(struct gpu_ctx *c)
{
    const struct model_hp *hp = &c->g->hp;
    gf_qkv p;
    memset(&p, 0, sizeof p);
    p.rope_freqs = c->g->rope_freqs, p.n_rot = hp->n_rot;
    p.theta_scale = powf(hp->rope_base, -2.0f / (float)hp->n_rot), p.freq_scale = c->g->freq_scale;
    p.pos0 = c->io + c->T;
    /* the K and V rows go to their cells from gf_qkv_kernel (gpu_kv_store's encoder) */
    gf_kv_desc(c, &p.kv);
    p.pos_t = c->rows ? gf_rows(c) : NULL, p.pt_t = p.pos_t ? gf_rows(c) + c->B : NULL;
    p.pt_stride = c->max_pages;
    p.cs = c->rope_cs, p.pg = c->rope_pg;
    return p;
}

/* Before a product into x of rows n wide (from): hand the RMSNorm of
 * weights nw on to the products `to` that read it next (gf_mv.nw and .ss:
 * no gf_act_kernel between them), where it can: one token of one sequence,
 * every product in a kernel with the handed-on forms (gf_hand_takes; an
 * experts' product: its experts side by side, ne columns each), x in whole
 * blocks of 32, at most one for each SM (the product runs a block for each
 * 32 rows: more are a second round of blocks, slower than the plain
 * product and the norm kernel: a Qwen3-32B's 160 on the H200's 132 SMs,
 * +13% without, BENCH.md thirty-eighth pass); nw NULL: never.
 * STRATA_GPU_NO_HANDOFF=1 never does, for comparisons.
 * gf_hand_end after the product: c->handed then says whether the norm was
 * handed on (its readers' launches, gf_mv_hand, spend it). */
static void gf_hand_begin(struct gpu_ctx *c, int type, int n, int ne, const float *nw,
                          const struct gf_mat *const *to, int n_to, int T)
{
    int D = c->g->hp.n_embd;
    int ok = nw && T == 1 && !c->rows && D % GF_AB == 0 && D / GF_AB <= gf_sms() && gf_hand_takes(type, n, ne) &&
             !gf_env("STRATA_GPU_NO_HANDOFF");
    for (int i = 0; ok && i < n_to; i++)
        ok = gf_hand_takes(to[i]->type, to[i]->n, 0);
    c->hand_w = ok ? nw : NULL;
}

static void gf_hand_end(struct gpu_ctx *c)
{
    c->handed = c->hand_w != NULL, c->hand_w = NULL;
}

/* One layer over the chunk's T rows (tokens already embedded in c->x). */
static int gf_layer(struct gpu_ctx *c, int il, int T, char *err, size_t errlen)
{
    const struct model_hp *hp = &c->g->hp;
    const struct gf_layer *ly = &c->g->layers[il];
    int D = hp->n_embd, E = hp->head_dim, H = hp->n_head, K = hp->n_head_kv;
    int HE = H * E, KE = K * E;
    gpuStream_t s = c->stream;

    struct gf_out qkv[3] = {{&ly->wq, c->q, (size_t)HE, NULL}, {&ly->wk, c->k, (size_t)KE, NULL},
                            {&ly->wv, c->v, (size_t)KE, NULL}};
    c->abt = gf_act_bt(qkv, 3, T);
    if ((!c->handed && gf_act(s, GF_ACT_NORM, c->x, NULL, ly->attn_norm, hp->rms_eps, D, T, c->abt, c->xn, c->aq,
                              c->ads, err, errlen)) ||
        (gf_mark(c, GF_ST_NORM), gf_matmul_n(c, qkv, 3, c->xn, T, 0, err, errlen)))
        return -1;
    gf_mark(c, GF_ST_QKV);
    gf_qkv qp = gf_qkv_of(c);
    qp.q = c->q, qp.k = c->k, qp.v = c->v, qp.bq = ly->bq, qp.bk = ly->bk, qp.bv = ly->bv;
    qp.q_norm = ly->q_norm, qp.k_norm = ly->q_norm ? ly->k_norm : NULL;
    qp.H = H, qp.K = K, qp.E = E, qp.neox = hp->rope_neox, qp.eps = hp->rms_eps;
    qp.layer = il, qp.krow = gf_krow(qp.kv.cell), qp.vrow = gf_vrow(qp.kv.cell);
    if (T > GF_DECODE_T)
        gf_launch(gf_qkv_rows_kernel, dim3((T * (H + 2 * K) + GF_QKV_WARPS - 1) / GF_QKV_WARPS),
                  GF_QKV_WARPS * GPU_WARP, GF_QKV_WARPS * gf_qkv_floats(E, hp->n_rot) * sizeof(float), s, qp, T);
    else
        gf_launch(gf_qkv_kernel, dim3(T, H + 2 * K), GF_QKV_THREADS, gf_qkv_floats(E, hp->n_rot) * sizeof(float), s,
                  qp);
    GF_LAUNCH_CHECK(err, errlen);
    gf_mark(c, GF_ST_ROPE_STORE);

    struct gf_out wo = {&ly->wo, c->x, (size_t)D, ly->bo};
    c->abt = gf_act_bt(&wo, 1, T);
    /* one-token MoE with an F32 router: its norm and router in one kernel
     * (STRATA_GPU_NO_NORM_ROUTER=1: the two, for comparisons) */
    int norm_router = ly->moe && T == 1 && ly->gate_inp.type == QT_F32 && D % GF_AB == 0 &&
                      D <= GF_NR_PER * 4 * GF_ACT_THREADS && !gf_env("STRATA_GPU_NO_NORM_ROUTER");
    int quantised = gf_attention(c, il, T, err, errlen);   /* 1: the output's int8 blocks written too */
    int F = ly->gate.rows;
    struct gf_out gu[2] = {{&ly->gate, c->gt, (size_t)F, NULL}, {&ly->up, c->up, (size_t)F, NULL}};
    struct gf_out down = {&ly->down, c->x, (size_t)D, NULL};
    const struct gf_mat *gum[2] = {&ly->gate, &ly->up};
    if (quantised < 0 || (gf_mark(c, GF_ST_ATTN), 0) ||
        (!quantised &&
         gf_act(s, GF_ACT_PLAIN, c->ao, NULL, NULL, 0, HE, T, c->abt, NULL, c->aq, c->ads, err, errlen)) ||
        (gf_mark(c, GF_ST_ACT), 0) ||
        (gf_hand_begin(c, ly->wo.type, ly->wo.n, 0, ly->moe ? NULL : ly->ffn_norm, gum, 2, T),
         gf_matmul_n(c, &wo, 1, c->ao, T, 1, err, errlen)) ||
        (gf_hand_end(c), gf_mark(c, GF_ST_WO), 0) || (c->abt = ly->moe ? 0 : gf_act_bt(gu, 2, T), 0) ||
        (!norm_router && !c->handed &&
         gf_act(s, GF_ACT_NORM, c->x, NULL, ly->ffn_norm, hp->rms_eps, D, T, c->abt, c->xn, c->aq, c->ads, err,
                errlen)))
        return -1;
    gf_mark(c, GF_ST_FFN_NORM);
    /* the next layer's attention norm, for a product into x to hand on */
    const struct gf_layer *nx = il + 1 < hp->n_layer ? &c->g->layers[il + 1] : NULL;
    const struct gf_mat *qkvm[3] = {nx ? &nx->wq : NULL, nx ? &nx->wk : NULL, nx ? &nx->wv : NULL};
    if (!ly->moe) {
        int rc = gf_matmul_n(c, gu, 2, c->xn, T, 0, err, errlen) || (gf_mark(c, GF_ST_GATE_UP), 0) ||
                 (c->abt = gf_act_bt(&down, 1, T), 0) ||
                 gf_act(s, GF_ACT_SWIGLU, c->gt, c->up, NULL, 0, F, T, c->abt, c->gt, c->aq, c->ads, err, errlen) ||
                 (gf_mark(c, GF_ST_SWIGLU), 0) ||
                 (gf_hand_begin(c, ly->down.type, ly->down.n, 0, nx ? nx->attn_norm : NULL, qkvm, 3, T),
                  gf_matmul_n(c, &down, 1, c->gt, T, 1, err, errlen)) ? -1 : 0;
        gf_hand_end(c);
        gf_mark(c, GF_ST_DOWN);
        return rc;
    }
    int X = hp->n_expert, U = hp->n_expert_used, Fe = ly->gate_exps.rows;
    struct gf_out router = {&ly->gate_inp, c->router, (size_t)X, NULL};
    if (norm_router) {
        gf_launch(gf_norm_router_kernel, X, GF_ACT_THREADS, 0, s, (const float *)c->x, ly->ffn_norm, hp->rms_eps,
                  (const float *)ly->gate_inp.d, ly->gate_inp.ldw, D, c->router, c->xn, c->aq, c->ads);
        GF_LAUNCH_CHECK(err, errlen);
    } else if (gf_matmul_n(c, &router, 1, c->xn, T, 0, err, errlen))
        return -1;
    gf_launch(gf_route_kernel, T, GF_ROUTE_THREADS, (size_t)(X + 2 * U) * sizeof(float), s, (const float *)c->router,
              X, U, c->sel, c->selw);
    GF_LAUNCH_CHECK(err, errlen);
    gf_mark(c, GF_ST_ROUTER);
    /* a prompt's experts as gemms (eo written), else the matrix-vector
     * kernels; in decode the down products add into x themselves */
    const struct gf_mat *gue[2] = {&ly->gate_exps, &ly->up_exps}, *dn = &ly->down_exps;
    float *gu_y[2] = {c->gt, c->up};
    int rc = gf_experts_gemm(c, ly, T, err, errlen), summed = 0;
    if (rc > 0) {
        if (gf_matmul_experts(c, gue, gu_y, 2, c->xn, U, T * U, err, errlen) || (gf_mark(c, GF_ST_GATE_UP), 0) ||
            gf_act(s, GF_ACT_SWIGLU, c->gt, c->up, NULL, 0, Fe, T * U, 0, c->gt, c->aq, c->ads, err, errlen))
            return -1;
        gf_mark(c, GF_ST_SWIGLU);
        gf_hand_begin(c, dn->type, U * dn->n, dn->n, nx ? nx->attn_norm : NULL, qkvm, 3, T);
        rc = gf_down_experts_sum(c, dn, T, U, err, errlen);
        gf_hand_end(c);
        summed = rc == 0;
        if (rc > 0)
            rc = gf_matmul_experts(c, &dn, &c->eo, 1, c->gt, 1, T * U, err, errlen);
    }
    if (rc < 0)
        return -1;
    if (!summed) {
        gf_launch(gf_moe_sum_kernel, T, 256, 0, s, c->x, c->eo, c->selw, D, U);
        GF_LAUNCH_CHECK(err, errlen);
    }
    gf_mark(c, GF_ST_DOWN);
    return 0;
}

/* Where the head writes n rows: one row, or a batch step's rows, straight
 * into the pinned rows the host reads (row 0; rows 1..n: their stores
 * cross the bus while the head still runs, and nothing is copied back
 * after the step); a prompt's rows into c->logits. */
static float *gf_head_y(const struct gpu_ctx *c, int n)
{
    if (!c->lg_dev)
        return c->logits;
    if (c->rows)
        return c->lg_dev + c->g->hp.n_vocab;
    return n == 1 ? c->lg_dev : c->logits;
}

/* The whole pass over c->io's T tokens; the head over rows out0..T-1 into
 * gf_head_y (none when out0 == T). */
static int gf_forward(struct gpu_ctx *c, int T, int out0, char *err, size_t errlen)
{
    const struct gpu_model *g = c->g;
    const struct model_hp *hp = &g->hp;
    int D = hp->n_embd, V = hp->n_vocab;
    c->hand_w = NULL, c->handed = 0;
    gf_launch(gf_embed_kernel, T, 256, 0, c->stream, g->tok_embd.d, g->tok_embd.ldw, g->tok_embd.type, D,
              (const int32_t *)c->io, c->x);
    GF_LAUNCH_CHECK(err, errlen);
    gf_launch(gf_rope_kernel, T, 64, 0, c->stream, gf_qkv_of(c));
    GF_LAUNCH_CHECK(err, errlen);
    gf_mark(c, GF_ST_EMBED);
    for (int il = 0; il < hp->n_layer; il++)
        if (gf_layer(c, il, T, err, errlen))
            return -1;
    int n = T - out0;
    if (n <= 0)
        return 0;
    struct gf_out head = {&g->output, gf_head_y(c, n), (size_t)V, g->output_b};
    c->abt = gf_act_bt(&head, 1, n);
    int rc = gf_act(c->stream, GF_ACT_NORM, c->x + (size_t)out0 * D, NULL, g->output_norm, hp->rms_eps, D, n,
                    c->abt, c->xn, c->aq, c->ads, err, errlen) ||
             gf_matmul_n(c, &head, 1, c->xn, n, 0, err, errlen) ? -1 : 0;
    gf_mark(c, GF_ST_HEAD);
    return rc;
}

/* ---- contexts ---- */

#ifdef STRATA_TRACE
/* A measuring build (make TRACE=1) writes, when a context is freed, the
 * last one-token decode step it ran to $STRATA_GPU_TRACE: a line a launch
 * in order of start, µs from the step's first start: the kernel, its
 * blocks, its first block's start, the first arrival at its wait, its
 * first and last release from the wait, its last warp's end; then sync
 * (the kernel ahead's end to this one's first release), run (that release
 * to this one's end) and its blocks' first and last GPU_TRACE_MARK (0:
 * none). A graph's kernels keep their %gridid from
 * replay to replay, so the rings hold the last replay's blocks; a slot
 * shows the grid that started last in it (a graph captured before a long
 * prompt has older ids than the prompt's launches that share its slots). */
struct gf_trace_grid {
    unsigned long long t0, tw, tr, trl, t1, tm, tml;
    int tag, blocks;
    const gpu_trace_rec *rec;   /* its blocks' records (the ring's row) */
    unsigned long long grid;
};

static int gf_trace_cmp(const void *a, const void *b)
{
    unsigned long long x = ((const gf_trace_grid *)a)->t0, y = ((const gf_trace_grid *)b)->t0;
    return x < y ? -1 : x > y;
}

/* ring r's slot launches, each from its blocks of the slot's latest grid */
static int gf_trace_grids(const gpu_trace_rec *r, gf_trace_grid *out)
{
    int n = 0;
    for (int gi = 0; gi < GPU_TRACE_GRIDS; gi++) {
        const gpu_trace_rec *b = r + (size_t)gi * GPU_TRACE_BLOCKS;
        unsigned long long last = 0, tl = 0;   /* the grid of the slot's latest start */
        for (int i = 0; i < GPU_TRACE_BLOCKS; i++)
            if (b[i].t0 > tl) {
                tl = b[i].t0;
                last = b[i].grid;
            }
        gf_trace_grid g = {};
        for (int i = 0; i < GPU_TRACE_BLOCKS; i++) {
            const gpu_trace_rec *x = &b[i];
            if (!x->t0 || x->grid != last)
                continue;
            if (!g.blocks++)
                g.tag = (int)x->tag;
#define GF_TMIN(a, v) (a = (v) && (!(a) || (v) < (a)) ? (v) : (a))   /* the least nonzero */
            GF_TMIN(g.t0, x->t0);
            GF_TMIN(g.tw, x->tw);
            GF_TMIN(g.tr, x->tr);
            GF_TMIN(g.tm, x->tm[0]);
#undef GF_TMIN
            g.trl = x->tr > g.trl ? x->tr : g.trl;
            g.tml = x->tm[0] > g.tml ? x->tm[0] : g.tml;
            g.t1 = x->t1 > g.t1 ? x->t1 : g.t1;
        }
        g.rec = b, g.grid = last;
        if (g.blocks)
            out[n++] = g;
    }
    return n;
}

static const char *gf_trace_name(const gf_trace_grid *g)
{
    static const char *names[GT_N] = {"-", "mv", "mvrow", "mvk", "mvs", "mvq", "act", "norm_router", "embed",
                                      "store", "qkv", "route", "moe_sum", "add", "dec", "merge", "rope", "mvx", "mv2",
                                      "mvf", "mvh"};
    return g->tag < GT_N ? names[g->tag] : "?";
}

static void gf_trace_write(void)
{
    const char *path = getenv("STRATA_GPU_TRACE");
    if (!path || !*path)
        return;
    size_t nrec = (size_t)GPU_TRACE_GRIDS * GPU_TRACE_BLOCKS;
    gpu_trace_rec *r = (gpu_trace_rec *)malloc(2 * nrec * sizeof *r);
    gf_trace_grid *g = r ? (gf_trace_grid *)malloc(2 * GPU_TRACE_GRIDS * sizeof *g) : NULL;
    FILE *f = g ? fopen(path, "w") : NULL;
    if (!f || cudaDeviceSynchronize() != cudaSuccess || gpu_trace_copy(r) || gpu_attn_trace_copy(r + nrec)) {
        fprintf(stderr, "strata: no trace written to %s\n", path);
        if (f)
            fclose(f);
        free(g);
        free(r);
        return;
    }
    int n = gf_trace_grids(r, g);
    n += gf_trace_grids(r + nrec, g + n);
    qsort(g, n, sizeof *g, gf_trace_cmp);
    int i0 = 0, i1 = n;   /* the last one-token embedding, to the next embedding */
    for (int i = 0; i < n; i++)
        if (g[i].tag == GT_EMBED && g[i].blocks == 1)
            i0 = i;
    for (int i = i0 + 1; i < n; i++)
        if (g[i].tag == GT_EMBED) {
            i1 = i;
            break;
        }
    fprintf(f, "# kernel blocks start wait release release_last end sync run mark mark_last (us)\n");
    unsigned long long s0 = n ? g[i0].t0 : 0;
#define GF_US(t) ((t) ? ((double)(t) - (double)s0) / 1e3 : 0.0)
    for (int i = i0; i < i1; i++) {
        const gf_trace_grid *x = &g[i];
        double sync = i > i0 && x->tr ? GF_US(x->tr) - GF_US(g[i - 1].t1) : 0.0;
        fprintf(f, "%-11s %5d %9.2f %9.2f %9.2f %9.2f %9.2f %6.2f %7.2f %9.2f %9.2f\n", gf_trace_name(x), x->blocks,
                GF_US(x->t0), GF_US(x->tw), GF_US(x->tr), GF_US(x->trl), GF_US(x->t1), sync,
                x->tr ? GF_US(x->t1) - GF_US(x->tr) : 0.0, GF_US(x->tm), GF_US(x->tml));
    }
    /* $STRATA_GPU_TRACE_BLOCKS: the same step block by block (kernel, its
     * index in the step, block, SM, then start, wait, release, mark, end,
     * GPU_TRACE_AT 1..3) */
    const char *bpath = getenv("STRATA_GPU_TRACE_BLOCKS");
    FILE *bf = bpath && *bpath ? fopen(bpath, "w") : NULL;
    if (bf) {
        fprintf(bf, "# kernel step_index block sm start wait release mark end at1 at2 at3 (us)\n");
        for (int i = i0; i < i1; i++)
            for (int b = 0; b < GPU_TRACE_BLOCKS; b++) {
                const gpu_trace_rec *x = &g[i].rec[b];
                if (x->t0 && x->grid == g[i].grid)
                    fprintf(bf, "%-11s %4d %4d %3u %9.2f %9.2f %9.2f %9.2f %9.2f %9.2f %9.2f %9.2f\n",
                            gf_trace_name(&g[i]), i - i0, b, x->sm, GF_US(x->t0), GF_US(x->tw), GF_US(x->tr),
                            GF_US(x->tm[0]), GF_US(x->t1), GF_US(x->tm[1]), GF_US(x->tm[2]), GF_US(x->tm[3]));
            }
        fclose(bf);
    }
#undef GF_US
    fclose(f);
    free(g);
    free(r);
}
#endif

void gpu_ctx_free(struct gpu_ctx *c)
{
    if (!c)
        return;
#ifdef STRATA_TRACE
    gf_trace_write();
#endif
    for (int n = 0; n <= GF_DECODE_T; n++)
        if (c->graph_state[n] == 1)
            gpuGraphExecDestroy(c->graph[n]);
    void *bufs[] = {c->x, c->xn, c->tmp, c->q, c->k, c->v, c->ao, c->gt, c->up, c->eo, c->router, c->selw,
                    c->logits, c->aq, c->ads, c->sel, c->io, c->attn_scratch, c->gemm_scratch, c->order,
                    c->rope_cs, c->rope_pg, c->offs, c->xs, c->nq, c->nds, c->nss};
    for (size_t i = 0; i < sizeof bufs / sizeof bufs[0]; i++)
        if (bufs[i])
            gpuFree(bufs[i]);
    if (c->io_host)
        gpuFreeHost(c->io_host);
    if (c->lg_host)
        gpuFreeHost(c->lg_host);
    if (c->stream)
        gpuStreamDestroy(c->stream);
    free(c);
}

float *gpu_ctx_logits(struct gpu_ctx *c, int *batch)
{
    if (batch)
        *batch = c->B;
    return c->lg_host;
}

static int gf_alloc(void **p, size_t bytes, char *err, size_t errlen)
{
    GPU_TRY(gpuMalloc(p, bytes ? bytes : 16), err, errlen);
    return 0;
}

/* c's int8 activation (aq, ads) for rows of up to n columns, with the
 * GF_ACT_SLACK rows past the last that gf_act_src's tiles read */
static int gf_act_alloc(struct gpu_ctx *c, size_t rows, size_t n, char *err, size_t errlen)
{
    rows += GF_ACT_SLACK;
    return gf_alloc((void **)&c->aq, rows * n, err, errlen) ||
           gf_alloc((void **)&c->ads, rows * (n / GF_AB + 1) * sizeof(gf_ads), err, errlen);
}

int gpu_ctx_new(struct gpu_ctx **out, struct gpu_model *g, struct kv *kv, int max_tokens, char *err,
                size_t errlen)
{
    *out = NULL;
    const struct model_hp *hp = &g->hp;
    const struct kv_config *cfg = kv_cfg(kv);
    if (max_tokens <= 0)
        return strata_errf(err, errlen, "GPU context: max_tokens %d", max_tokens);
    if (cfg->n_layer != hp->n_layer || cfg->n_head_kv != hp->n_head_kv || cfg->head_dim != hp->head_dim)
        return strata_errf(err, errlen, "GPU context: the KV cache's shape does not match the model");
    /* a prompt chunk's expert products are one launch of T·U groups, the grid's second dimension */
    if ((long)max_tokens * hp->n_expert_used > 65535)
        return strata_errf(err, errlen, "prompt chunks of %d tokens x %d experts a token are too many for the GPU's "
                           "expert launch: use --prefill-chunk %d or less", max_tokens, hp->n_expert_used,
                           65535 / hp->n_expert_used);
    struct gpu_ctx *c = (struct gpu_ctx *)calloc(1, sizeof *c);
    if (!c)
        return strata_errf(err, errlen, "out of memory");
    struct kv_layout lo;
    kv_layout(kv, &lo);
    if ((gf_krow(cfg->cell) == GF_ROW_Q4 || gf_vrow(cfg->cell) == GF_ROW_Q4) && hp->head_dim % 32) {
        free(c);
        return strata_errf(err, errlen, "GPU context: head dim %d does not fit %s cells", hp->head_dim,
                           kv_cell_name(cfg->cell));
    }
    c->g = g, c->kv = kv, c->T = max_tokens;
    c->max_cells = cfg->n_ctx, c->max_pages = lo.max_pages;
    c->gemm_ok = !gf_env("STRATA_GPU_NO_GEMM");
    for (int n = 0; n <= GF_DECODE_T; n++)
        c->graph_state[n] = gf_env("STRATA_GPU_NO_GRAPH") ? -1 : 0;
    c->B = max_tokens < GF_DECODE_T ? max_tokens : GF_DECODE_T;
    int T = max_tokens, U = hp->n_expert_used > 0 ? hp->n_expert_used : 1;
    int D = hp->n_embd, HE = hp->n_head * hp->head_dim, KE = hp->n_head_kv * hp->head_dim;
    int F = hp->n_ff > hp->n_ff_exp ? hp->n_ff : hp->n_ff_exp;
    int maxn = D > HE ? D : HE;
    maxn = maxn > F ? maxn : F;
    size_t MU = (size_t)T * U;
    c->MU = (int)MU;
    size_t fb = sizeof(float);
    size_t gemm = 0;
    for (int il = 0; il < hp->n_layer; il++) {
        const struct gf_layer *ly = &g->layers[il];
        const struct gf_mat *mats[] = {&ly->wq, &ly->wk, &ly->wv, &ly->wo, &ly->gate, &ly->up, &ly->down};
        for (size_t i = 0; i < sizeof mats / sizeof mats[0]; i++)
            if (mats[i]->d && gpu_gemm_supports(mats[i]->type)) {
                size_t b = gpu_gemm_scratch_bytes(mats[i]->type, mats[i]->n, mats[i]->rows, T);
                gemm = b > gemm ? b : gemm;
            }
        const struct gf_mat *exps[] = {&ly->gate_exps, &ly->up_exps, &ly->down_exps};   /* MU sorted rows */
        for (size_t i = 0; i < sizeof exps / sizeof exps[0]; i++)
            if (exps[i]->d) {
                size_t b = gpu_gemm_experts_scratch_bytes(exps[i]->n, (int)MU);
                gemm = b > gemm ? b : gemm;
            }
    }
    if (gpu_gemm_supports(g->output.type)) {
        size_t b = gpu_gemm_scratch_bytes(g->output.type, g->output.n, g->output.rows, T);
        gemm = b > gemm ? b : gemm;
    }
    int rc = 0;
    gpuError_t e = gpuStreamCreate(&c->stream);
    if (e != gpuSuccess)
        rc = strata_errf(err, errlen, "gpuStreamCreate: %s", gpuGetErrorString(e));
    if (!rc) {
        rc = gf_alloc((void **)&c->x, (size_t)T * D * fb, err, errlen) ||
             gf_alloc((void **)&c->xn, (size_t)T * D * fb, err, errlen) ||
             gf_alloc((void **)&c->tmp, (size_t)T * D * fb, err, errlen) ||
             gf_alloc((void **)&c->q, (size_t)T * HE * fb, err, errlen) ||
             gf_alloc((void **)&c->k, (size_t)T * KE * fb, err, errlen) ||
             gf_alloc((void **)&c->v, (size_t)T * KE * fb, err, errlen) ||
             gf_alloc((void **)&c->ao, (size_t)T * HE * fb, err, errlen) ||
             gf_alloc((void **)&c->gt, MU * F * fb, err, errlen) ||
             gf_alloc((void **)&c->up, MU * F * fb, err, errlen) ||
             gf_alloc((void **)&c->eo, hp->n_expert ? MU * D * fb : 0, err, errlen) ||
             gf_alloc((void **)&c->router, (size_t)T * (hp->n_expert ? hp->n_expert : 1) * fb, err, errlen) ||
             gf_alloc((void **)&c->selw, MU * fb, err, errlen) ||
             gf_alloc((void **)&c->sel, MU * sizeof(int32_t), err, errlen) ||
             gf_alloc((void **)&c->order, hp->n_expert ? MU * sizeof(int32_t) : 0, err, errlen) ||
             gf_alloc((void **)&c->offs, (size_t)(hp->n_expert + 1) * sizeof(int32_t), err, errlen) ||
             gf_alloc((void **)&c->xs, hp->n_expert ? MU * D * fb : 0, err, errlen) ||
             gf_alloc((void **)&c->logits, (size_t)T * hp->n_vocab * fb, err, errlen) ||
             gf_act_alloc(c, MU, maxn, err, errlen) ||
             gf_alloc((void **)&c->nq, D, err, errlen) ||
             gf_alloc((void **)&c->nds, D / GF_AB * sizeof(gf_ads), err, errlen) ||
             gf_alloc((void **)&c->nss, D / GF_AB * sizeof(float), err, errlen) ||
             gf_alloc((void **)&c->io, gf_io_ints(c) * sizeof(int32_t), err, errlen) ||
             gf_alloc((void **)&c->rope_cs, (size_t)T * hp->n_rot * fb, err, errlen) ||
             gf_alloc((void **)&c->rope_pg, (size_t)T * sizeof(int32_t), err, errlen) ||
             gf_alloc(&c->attn_scratch, gpu_attn_scratch_bytes(hp->n_head, T, c->max_cells, hp->head_dim), err,
                      errlen) ||
             gf_alloc(&c->gemm_scratch, gemm, err, errlen) ? -1 : 0;
    }
    if (!rc) {
        e = gpuMallocHost((void **)&c->io_host, gf_io_ints(c) * sizeof(int32_t));
        if (e == gpuSuccess)
            e = gpuMallocHost((void **)&c->lg_host, (size_t)(1 + c->B) * hp->n_vocab * sizeof(float));
        if (e != gpuSuccess)
            rc = strata_errf(err, errlen, "gpuMallocHost: %s", gpuGetErrorString(e));
    }
    /* (a device that cannot address it copies the row back instead, as
     * STRATA_GPU_COPY_LOGITS=1 does, for comparisons) */
    if (!rc && (gf_env("STRATA_GPU_COPY_LOGITS") ||
                gpuHostGetDevicePointer((void **)&c->lg_dev, c->lg_host, 0) != gpuSuccess)) {
        c->lg_dev = NULL;
        (void)gpuGetLastError();
    }
    if (rc) {
        gpu_ctx_free(c);
        return -1;
    }
    c->gemm_scratch_bytes = gemm;
    *out = c;
    return 0;
}

/* A decode step of n rows (n = 1: one sequence; 2..B: one sequence a row)
 * as a graph: captured at the first such step, replayed after (every
 * kernel reads the tokens, positions and page tables from c->io). */
static int gf_decode_graph_n(struct gpu_ctx *c, int n, char *err, size_t errlen)
{
    if (c->graph_state[n] == 0) {
        gpuGraph_t graph;
        GPU_TRY(gpuStreamBeginCapture(c->stream, gpuStreamCaptureModeThreadLocal), err, errlen);
        int rc = gf_forward(c, n, 0, err, errlen);
        gpuError_t e = gpuStreamEndCapture(c->stream, &graph);
        if (rc || e != gpuSuccess || gpuGraphInstantiate(&c->graph[n], graph) != gpuSuccess) {
            /* something in the step cannot be captured: run it directly from now on */
            if (e == gpuSuccess)
                gpuGraphDestroy(graph);
            (void)gpuGetLastError();
            c->graph_state[n] = -1;
            return gf_forward(c, n, 0, err, errlen);
        }
        gpuGraphDestroy(graph);
        c->graph_state[n] = 1;
    }
    if (c->graph_state[n] < 0)
        return gf_forward(c, n, 0, err, errlen);
    GPU_TRY(gpuGraphLaunch(c->graph[n], c->stream), err, errlen);
    return 0;
}

static int gf_decode_graph(struct gpu_ctx *c, int n, char *err, size_t errlen)
{
    c->rows = n > 1;
    int rc = gf_decode_graph_n(c, n, err, errlen);
    c->rows = 0;
    return rc;
}

int gpu_eval(struct gpu_ctx *c, int seq, const int32_t *tokens, int n, int pos, float *logits, int all_logits,
             char *err, size_t errlen)
{
    const struct model_hp *hp = &c->g->hp;
    if (n <= 0 || n > c->T)
        return strata_errf(err, errlen, "GPU eval: %d tokens (this context takes 1..%d)", n, c->T);
    if (pos < 0 || kv_seq_len(c->kv, seq) != pos + n)
        return strata_errf(err, errlen, "GPU eval: cells %d..%d are not the last of sequence %d (%d cells)",
                           pos, pos + n - 1, seq, kv_seq_len(c->kv, seq));
    for (int i = 0; i < n; i++)
        if (tokens[i] < 0 || tokens[i] >= hp->n_vocab)
            return strata_errf(err, errlen, "token id %d out of range (vocabulary of %d)", (int)tokens[i],
                               hp->n_vocab);
    int P = kv_cfg(c->kv)->page_cells, pages = (pos + n + P - 1) / P;
    memcpy(c->io_host, tokens, (size_t)n * sizeof(int32_t));
    c->io_host[c->T] = pos;
    memcpy(c->io_host + c->T + 1, kv_page_table(c->kv, seq), (size_t)pages * sizeof(int32_t));
    GPU_TRY(gpuMemcpyAsync(c->io, c->io_host, (size_t)n * sizeof(int32_t), gpuMemcpyHostToDevice, c->stream),
            err, errlen);
    GPU_TRY(gpuMemcpyAsync(c->io + c->T, c->io_host + c->T, (size_t)(1 + pages) * sizeof(int32_t),
                           gpuMemcpyHostToDevice, c->stream), err, errlen);
    int out0 = !logits ? n : all_logits ? 0 : n - 1;
    int rc = n == 1 && logits ? gf_decode_graph(c, 1, err, errlen) : gf_forward(c, n, out0, err, errlen);
    /* one row lands in the pinned lg_host (written there by the head, else
     * a truly asynchronous copy), then in logits unless that is lg_host */
    size_t lg_bytes = (size_t)(n - out0) * hp->n_vocab * sizeof(float);
    float *lg_dst = n - out0 == 1 ? c->lg_host : logits;
    if (!rc && logits && gf_head_y(c, n - out0) == c->logits)
        GPU_TRY(gpuMemcpyAsync(lg_dst, c->logits, lg_bytes, gpuMemcpyDeviceToHost, c->stream), err, errlen);
    gpuError_t e = gpuStreamSynchronize(c->stream);
    if (rc)
        return -1;
    if (e != gpuSuccess)
        return strata_errf(err, errlen, "GPU eval: %s", gpuGetErrorString(e));
    if (logits && lg_dst != logits)
        memcpy(logits, lg_dst, lg_bytes);
    return 0;
}

int gpu_eval_batch(struct gpu_ctx *c, const int *seqs, const int32_t *tokens, int n, float *logits, char *err,
                   size_t errlen)
{
    int V = c->g->hp.n_vocab, P = kv_cfg(c->kv)->page_cells;
    if (kv_seqs_check(c->kv, seqs, n, 1, "GPU batch", err, errlen) != 0)   /* (a cell for each token) */
        return -1;
    for (int i = 0; i < n; i++)
        if (tokens[i] < 0 || tokens[i] >= V)
            return strata_errf(err, errlen, "token id %d out of range (vocabulary of %d)", (int)tokens[i], V);
    /* passes of up to B rows; a single row is an ordinary decode step */
    int32_t *rows = c->io_host + (gf_rows(c) - c->io);
    for (int done = 0; done < n;) {
        int m = n - done < c->B ? n - done : c->B;
        if (m == 1) {
            int s = seqs[done];
            if (gpu_eval(c, s, tokens + done, 1, kv_seq_len(c->kv, s) - 1, logits + (size_t)done * V, 0, err, errlen))
                return -1;
            done++;
            continue;
        }
        /* row t: its token, the position of its cell, its page table */
        for (int t = 0; t < m; t++) {
            int s = seqs[done + t];
            c->io_host[t] = tokens[done + t];
            rows[t] = kv_seq_len(c->kv, s) - 1;
            memcpy(rows + c->B + (size_t)t * c->max_pages, kv_page_table(c->kv, s),
                   (size_t)(rows[t] / P + 1) * sizeof(int32_t));
        }
        GPU_TRY(gpuMemcpyAsync(c->io, c->io_host, (size_t)m * sizeof(int32_t), gpuMemcpyHostToDevice, c->stream),
                err, errlen);
        GPU_TRY(gpuMemcpyAsync(gf_rows(c), rows, (size_t)m * sizeof(int32_t), gpuMemcpyHostToDevice, c->stream), err,
                errlen);
        for (int t = 0; t < m; t++) {
            size_t off = c->B + (size_t)t * c->max_pages;
            GPU_TRY(gpuMemcpyAsync(gf_rows(c) + off, rows + off, (size_t)(rows[t] / P + 1) * sizeof(int32_t),
                                   gpuMemcpyHostToDevice, c->stream), err, errlen);
        }
        /* the head writes the rows into lg_host's batch rows (gf_head_y),
         * else they come back after the step */
        int rc = gf_decode_graph(c, m, err, errlen);
        float *dst = logits + (size_t)done * V, *written = c->lg_host + V;
        size_t bytes = (size_t)m * V * sizeof(float);
        if (!rc && !c->lg_dev)
            GPU_TRY(gpuMemcpyAsync(dst, c->logits, bytes, gpuMemcpyDeviceToHost, c->stream), err, errlen);
        gpuError_t e = gpuStreamSynchronize(c->stream);
        if (rc)
            return -1;
        if (e != gpuSuccess)
            return strata_errf(err, errlen, "GPU batch: %s", gpuGetErrorString(e));
        if (c->lg_dev && dst != written)
            memcpy(dst, written, bytes);
        done += m;
    }
    return 0;
}

int gpu_kv_store(const struct gpu_kv *kv, int layer, const int32_t *pos0, int T, const float *k, const float *v,
                 void *stream, char *err, size_t errlen)
{
    if (kv->cell < 0 || kv->cell >= KV_CELL_COUNT || layer < 0 || layer >= kv->L || T <= 0)
        return strata_errf(err, errlen, "gpu_kv_store: bad call (cell %d, layer %d, %d rows)", kv->cell, layer, T);
    int kr = gf_krow(kv->cell), vr = gf_vrow(kv->cell);
    if ((kr == GF_ROW_Q4 || vr == GF_ROW_Q4) && kv->E % 32)
        return strata_errf(err, errlen, "gpu_kv_store: head dim %d does not fit Q4 cells", kv->E);
    gf_store p;
    p.kv = *kv, p.layer = layer, p.krow = kr, p.vrow = vr, p.pos0 = pos0, p.k = k, p.v = v;
    gf_launch(gf_store_kernel, dim3(T, kv->K, 2), 32, 0, (gpuStream_t)stream, p);
    GF_LAUNCH_CHECK(err, errlen);
    return 0;
}

/* ---- for tests ---- */

void *gpu_test_alloc(size_t bytes)
{
    void *p = NULL;
    return gpuMalloc(&p, bytes ? bytes : 16) == gpuSuccess ? p : NULL;
}

void gpu_test_free(void *p)
{
    if (p)
        gpuFree(p);
}

int gpu_test_copy(void *dst, const void *src, size_t bytes, int to_host)
{
    return gpuMemcpy(dst, src, bytes, to_host ? gpuMemcpyDeviceToHost : gpuMemcpyHostToDevice) == gpuSuccess
               ? 0 : -1;
}

int gpu_test_sms(void)
{
    return gf_sms();
}

/* The end of a test's launches on c's stream (rc: how they went): wait for
 * them, then the bytes of dy into y, the stream destroyed; the result */
static int gf_test_end(struct gpu_ctx *c, int rc, const char *what, void *y, const void *dy, size_t bytes, char *err,
                       size_t errlen)
{
    if (!c->stream)
        return rc;
    gpuError_t e = gpuStreamSynchronize(c->stream);
    if (!rc && e != gpuSuccess)
        rc = strata_errf(err, errlen, "%s: %s", what, gpuGetErrorString(e));
    if (!rc && gpuMemcpy(y, dy, bytes, gpuMemcpyDeviceToHost) != gpuSuccess)
        rc = strata_errf(err, errlen, "copy from the device failed");
    gpuStreamDestroy(c->stream);
    return rc;
}

int gpu_test_matvec(int type, const void *w, size_t ldw, int n, int rows, const float *x, int T, int mode,
                    const float *b, float *y, char *err, size_t errlen)
{
    if (!gf_supported(type))
        return strata_errf(err, errlen, "tensor type %s not supported on the GPU yet", gguf_type_name(type));
    int rows_in_turn = mode & GPU_TEST_ROWS;
    size_t shift = mode & GPU_TEST_SHIFT4 ? 4 : mode & GPU_TEST_SHIFT8 ? 8 : 0;
    mode &= ~(GPU_TEST_ROWS | GPU_TEST_SHIFT4 | GPU_TEST_SHIFT8);
    struct gpu_ctx c;
    memset(&c, 0, sizeof c);
    c.T = T;
    uint8_t *dw = NULL;
    float *dx = NULL, *dy = NULL, *db = NULL, *dxn = NULL;
    size_t nb = mode == GPU_TEST_NORM ? (size_t)n : (size_t)T * n;
    int rc = gf_alloc((void **)&dw, ldw * rows + shift, err, errlen) ||
             gf_alloc((void **)&dx, (size_t)T * n * 4, err, errlen) || gf_alloc((void **)&db, nb * 4, err, errlen) ||
             gf_alloc((void **)&dxn, (size_t)T * n * 4, err, errlen) ||
             gf_alloc((void **)&dy, (size_t)T * rows * 4, err, errlen) ||
             gf_act_alloc(&c, T, n, err, errlen) ? -1 : 0;
    if (!rc && (gpuStreamCreate(&c.stream) != gpuSuccess))
        rc = strata_errf(err, errlen, "gpuStreamCreate failed");
    if (!rc && (gpuMemcpy(dw + shift, w, ldw * rows, gpuMemcpyHostToDevice) != gpuSuccess ||
                gpuMemcpy(dx, x, (size_t)T * n * 4, gpuMemcpyHostToDevice) != gpuSuccess ||
                (mode != GPU_TEST_PLAIN && gpuMemcpy(db, b, nb * 4, gpuMemcpyHostToDevice) != gpuSuccess) ||
                gpuMemset(dy, 0xff, (size_t)T * rows * 4) != gpuSuccess))
        rc = strata_errf(err, errlen, "copy to the device failed");
    if (!rc) {
        struct gf_mat m = {dw + shift, type, n, rows, ldw, ldw * rows};
        struct gf_out o = {&m, dy, (size_t)rows, NULL};
        int am = mode == GPU_TEST_NORM ? GF_ACT_NORM : mode == GPU_TEST_SWIGLU ? GF_ACT_SWIGLU : GF_ACT_PLAIN;
        c.abt = rows_in_turn ? 0 : gf_act_bt(&o, 1, T);
        rc = gf_act(c.stream, am, dx, mode == GPU_TEST_SWIGLU ? db : NULL, mode == GPU_TEST_NORM ? db : NULL, 1e-6f, n,
                    T, c.abt, dxn, c.aq, c.ads, err, errlen) ||
             gf_matmul_n(&c, &o, 1, dxn, T, 0, err, errlen);
    }
    rc = gf_test_end(&c, rc, "matvec", y, dy, (size_t)T * rows * 4, err, errlen);
    gpu_test_free(dw), gpu_test_free(dx), gpu_test_free(dy), gpu_test_free(c.aq), gpu_test_free(c.ads);
    gpu_test_free(db), gpu_test_free(dxn);
    return rc;
}

int gpu_test_experts(int type, const void *w, size_t ldw, int n, int rows, int X, const float *x, const int32_t *offs,
                     float *y, char *err, size_t errlen)
{
    if (!gf_mvq_units(type, n)) {
        strata_errf(err, errlen, "no experts' kernel for %s n=%d here", gguf_type_name(type), n);
        return 1;
    }
    int P = offs[X];
    struct gpu_model g;
    struct gpu_ctx c;
    memset(&g, 0, sizeof g);
    memset(&c, 0, sizeof c);
    g.hp.n_expert = X, c.g = &g;
    uint8_t *dw = NULL;
    float *dx = NULL, *dy = NULL;
    int rc = gf_alloc((void **)&dw, ldw * rows * X, err, errlen) || gf_alloc((void **)&dx, (size_t)P * n * 4, err, errlen) ||
             gf_alloc((void **)&dy, (size_t)P * rows * 4, err, errlen) ||
             gf_alloc((void **)&c.offs, (size_t)(X + 1) * sizeof(int32_t), err, errlen) ||
             gf_alloc(&c.gemm_scratch, (size_t)P * n * 2, err, errlen) ||
             gf_act_alloc(&c, P, n, err, errlen) ? -1 : 0;
    if (!rc && (gpuStreamCreate(&c.stream) != gpuSuccess))
        rc = strata_errf(err, errlen, "gpuStreamCreate failed");
    if (!rc && (gpuMemcpy(dw, w, ldw * rows * X, gpuMemcpyHostToDevice) != gpuSuccess ||
                gpuMemcpy(dx, x, (size_t)P * n * 4, gpuMemcpyHostToDevice) != gpuSuccess ||
                gpuMemcpy(c.offs, offs, (size_t)(X + 1) * sizeof(int32_t), gpuMemcpyHostToDevice) != gpuSuccess ||
                gpuMemset(dy, 0xff, (size_t)P * rows * 4) != gpuSuccess))
        rc = strata_errf(err, errlen, "copy to the device failed");
    if (!rc) {
        struct gf_mat m = {dw, type, n, rows, ldw, ldw * rows};
        const struct gf_mat *mp = &m;
        rc = gf_act(c.stream, GF_ACT_PLAIN, dx, NULL, NULL, 0, n, P, P, NULL, c.aq, c.ads, err, errlen) ||
             gf_mvx(&c, &mp, &dy, 1, (size_t)rows, P, dx, err, errlen);
    }
    rc = gf_test_end(&c, rc, "experts", y, dy, (size_t)P * rows * 4, err, errlen);
    gpu_test_free(dw), gpu_test_free(dx), gpu_test_free(dy), gpu_test_free(c.offs), gpu_test_free(c.aq);
    gpu_test_free(c.ads), gpu_test_free(c.gemm_scratch);
    return rc;
}

/* holds the GPU for about `cycles` clocks, so that everything queued after
 * it runs back to back (timings without launch gaps) */
__global__ void gf_spin_kernel(long long cycles)
{
    long long t0 = clock64();
    while (clock64() - t0 < cycles) {
    }
}

__global__ void gf_fill_kernel(uint32_t *p, size_t n, uint32_t seed)
{
    for (size_t i = blockIdx.x * (size_t)blockDim.x + threadIdx.x; i < n; i += (size_t)gridDim.x * blockDim.x) {
        uint32_t h = (uint32_t)i * 2654435761u ^ seed;
        h ^= h >> 15, h *= 2246822519u, h ^= h >> 13;
        p[i] = h & 0x3bff3bffu;   /* halves stay finite f16 (scales below 1) */
    }
}

double gpu_test_mv_us(int type, int n, int rows, int T, int reps, char *err, size_t errlen)
{
    if (!gf_supported(type))
        return strata_errf(err, errlen, "mv bench: type %s not timed", gguf_type_name(type));
    enum { BATCHES = 5 };
    size_t ldw = quant_row_bytes(type, n), bytes = gf_align(ldw * rows);
    int copies = (int)((512u << 20) / bytes) + 1;   /* rotate through more than L2 holds */
    copies = copies < 2 ? 2 : copies;
    struct gpu_ctx c;
    memset(&c, 0, sizeof c);
    uint8_t *dw = NULL;
    float *dx = NULL, *dy = NULL;
    gpuEvent_t ev[2] = {NULL, NULL};
    double ms[BATCHES], med = -1;
    int rc = gf_alloc((void **)&dw, bytes * copies, err, errlen) ||
             gf_alloc((void **)&dx, (size_t)T * n * 4, err, errlen) ||
             gf_alloc((void **)&dy, (size_t)T * rows * 4, err, errlen) ||
             gf_act_alloc(&c, T, n, err, errlen) ||
             gpuStreamCreate(&c.stream) != gpuSuccess || gpuEventCreate(&ev[0]) != gpuSuccess ||
             gpuEventCreate(&ev[1]) != gpuSuccess ? -1 : 0;
    if (!rc) {
        gf_fill_kernel<<<1024, 256, 0, c.stream>>>((uint32_t *)dw, bytes * copies / 4, 7u);
        gf_fill_kernel<<<64, 256, 0, c.stream>>>((uint32_t *)dx, (size_t)T * n, 9u);
    }
    /* back to back as in a decode step: each batch's calls queue behind a
     * spin, and the events time the whole batch */
    for (int k = -1, i = 0; k < BATCHES && !rc; k++) {
        gf_spin_kernel<<<1, 1, 0, c.stream>>>(20000000LL);
        rc = gpuEventRecord(ev[0], c.stream) != gpuSuccess;
        for (int j = 0; j < reps && !rc; j++, i++) {
            struct gf_mat m = {dw + bytes * (size_t)(i % copies), type, n, rows, ldw, ldw * rows};
            struct gf_out o = {&m, dy, (size_t)rows, NULL};
            c.abt = gf_act_bt(&o, 1, T);
            rc = gf_act(c.stream, GF_ACT_NORM, dx, NULL, dx, 1e-6f, n, T, c.abt, NULL, c.aq, c.ads, err, errlen) ||
                 gf_matmul_n(&c, &o, 1, dx, T, 0, err, errlen);
        }
        float t = 0;
        if (rc || gpuEventRecord(ev[1], c.stream) != gpuSuccess || gpuEventSynchronize(ev[1]) != gpuSuccess ||
            gpuEventElapsedTime(&t, ev[0], ev[1]) != gpuSuccess)
            rc = strata_errf(err, errlen, "mv bench: a timed batch failed");
        else if (k >= 0)
            ms[k] = t / reps;
    }
    if (!rc) {
        for (int i = 1; i < BATCHES; i++)   /* insertion sort of five */
            for (int j = i; j > 0 && ms[j] < ms[j - 1]; j--) {
                double t = ms[j];
                ms[j] = ms[j - 1], ms[j - 1] = t;
            }
        med = 1000 * ms[BATCHES / 2];
    }
    for (int i = 0; i < 2; i++)
        if (ev[i])
            gpuEventDestroy(ev[i]);
    if (c.stream)
        gpuStreamDestroy(c.stream);
    gpu_test_free(dw), gpu_test_free(dx), gpu_test_free(dy), gpu_test_free(c.aq), gpu_test_free(c.ads);
    return med;
}


int gpu_test_profile(struct gpu_ctx *c, int seq, const int32_t *tokens, int n, int pos, char *out, size_t cap,
                     char *err, size_t errlen)
{
    if (n < 1 || n > c->T || kv_seq_len(c->kv, seq) != pos + n)
        return strata_errf(err, errlen, "profile: %d tokens from cell %d are not the last of sequence %d", n, pos,
                           seq);
    struct gf_prof *p = (struct gf_prof *)calloc(1, sizeof *p);
    if (!p)
        return strata_errf(err, errlen, "out of memory");
    int rc = 0, made = 0;
    for (; made < GF_PROF_MAX && !rc; made++)
        if (gpuEventCreate(&p->ev[made]) != gpuSuccess) {
            rc = strata_errf(err, errlen, "gpuEventCreate failed");
            made--;
        }
    gpuEvent_t start = NULL;
    if (!rc && gpuEventCreate(&start) != gpuSuccess) {
        start = NULL;
        rc = strata_errf(err, errlen, "gpuEventCreate failed");
    }
    if (!rc) {
        int P = kv_cfg(c->kv)->page_cells, pages = (pos + n - 1 + P) / P;
        memcpy(c->io_host, tokens, (size_t)n * sizeof(int32_t));
        c->io_host[c->T] = pos;
        memcpy(c->io_host + c->T + 1, kv_page_table(c->kv, seq), (size_t)pages * sizeof(int32_t));
        if (gpuMemcpyAsync(c->io, c->io_host, (size_t)n * sizeof(int32_t), gpuMemcpyHostToDevice, c->stream) !=
                gpuSuccess ||
            gpuMemcpyAsync(c->io + c->T, c->io_host + c->T, (size_t)(1 + pages) * sizeof(int32_t),
                           gpuMemcpyHostToDevice, c->stream) != gpuSuccess)
            rc = strata_errf(err, errlen, "profile: upload failed");
        gf_spin_kernel<<<1, 1, 0, c->stream>>>(200000000LL);   /* ~0.1 s */
        if (!rc && gpuEventRecord(start, c->stream) != gpuSuccess)
            rc = strata_errf(err, errlen, "profile: gpuEventRecord failed");
        c->prof = p;
        if (!rc)
            rc = gf_forward(c, n, n - 1, err, errlen);
        c->prof = NULL;
        if (gpuStreamSynchronize(c->stream) != gpuSuccess && !rc)
            rc = strata_errf(err, errlen, "profile: the step failed");
    }
    if (!rc) {
        double ms[GF_ST_COUNT] = {0}, total = 0;
        int count[GF_ST_COUNT] = {0};
        for (int i = 0; i < p->n; i++) {
            float t = 0;
            if (gpuEventElapsedTime(&t, i ? p->ev[i - 1] : start, p->ev[i]) != gpuSuccess)
                t = 0;
            ms[p->stage[i]] += t;
            count[p->stage[i]]++;
            total += t;
        }
        size_t o = 0;
        o += (size_t)snprintf(out + o, o < cap ? cap - o : 0, "step %.1f us:", 1000 * total);
        for (int k = 0; k < GF_ST_COUNT; k++)
            if (count[k])
                o += (size_t)snprintf(out + o, o < cap ? cap - o : 0, " %s %.1f", gf_st_names[k], 1000 * ms[k]);
    }
    if (start)
        gpuEventDestroy(start);
    for (int i = 0; i < made; i++)
        gpuEventDestroy(p->ev[i]);
    free(p);
    return rc;
}
