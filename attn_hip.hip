/*
 * attn_hip.hip — attention without matrix cores, written for AMD RDNA2
 * (gfx103x: wave32 warps, 128-thread blocks, 64 KiB of LDS) and correct for
 * wave64 (CDNA, gfx90a) through GPU_WARP. The same source compiles as CUDA
 * through gpu_compat.h: attn_cuda.cu's table calls the *_rdna2 launchers
 * below sm_80 and with STRATA_ATTN_PRE75=1. Under HIP this file also holds
 * the gpu_attn_* dispatch table (the only one in a HIP build).
 *
 * Owns: dense prompt attention (chunked online softmax), QSA prompt attention
 * without split and merge (one block per query and kv head), decode and QSA
 * decode (cells split across blocks, log-sum-exp merge), K/V dequantised on
 * the fly from kv.c's pages (f32, f16, int8, q4, k8v4). Must not: allocate,
 * synchronise, or use AMD-only built-ins (it uses none: every kernel here
 * runs on NVIDIA too). Shapes: T queries, H query heads, K kv heads,
 * G = H/K, E head dim, P cells per page, R rows of a block ((query, head)
 * pairs of one kv head), S partitions, 64 entries (cells or list entries)
 * per online-softmax chunk, SU cells staged in LDS at once.
 *
 * Host code never depends on the warp width: HIP's host pass sees another
 * GPU_WARP than the gfx1030 device pass, so grids, LDS sizes and template
 * arguments are the same for wave32 and wave64 and only device code reads
 * GPU_WARP.
 */
#include "gpu.h"
#include "gpu_compat.h"

#include <stdlib.h>
#include <string.h>

#define RD_THREADS 128          /* 4 wave32 warps (2 on wave64) */
#define RD_NW (RD_THREADS / GPU_WARP)
#define RD_ROWS 16              /* rows (query, head) of one block */
#define RD_ROWS_Q8 8            /* rows of the int8 QSA block (its LDS reduction is 512 floats a row) */
#define RD_CHUNK 64             /* entries per online-softmax step, aligned like attn.c's blocks */
#define RD_STAGE 4096           /* SU*E: floats of dequantised K or V staged at once */
#define RD_MAX_E 256
#define RD_MAX_SPLIT 32
#define RD_SPLIT_BLOCKS 512     /* split blocks aimed at: a few waves on 40-132 CUs/SMs */
#define RD_PART_HDR 4           /* a partial: m, l, 2 floats of padding, acc (E) */

enum rd_row { RD_F32, RD_F16, RD_I8, RD_Q4 };

/* Everything a kernel reads; passed by value. */
struct rd_args {
    const uint8_t *pages;       /* dev: kv_layout.data */
    const int32_t *pt;          /* dev: page table */
    size_t page_bytes, kbytes, vbytes;
    int krow, vrow;             /* enum rd_row */
    int K, E, P, layer, H, G, T;
    int SU;                     /* cells staged at once: a power of two, SU*E <= RD_STAGE */
    int gtiles;                 /* query-head tiles of a kv head (list and split kernels) */
    const float *q;             /* dev: (T, H*E) */
    float *out;                 /* dev: (T, H*E) */
    const int32_t *pos0;        /* dev: one int */
    const int32_t *sel;         /* dev: QSA lists */
    const int64_t *sel_off;     /* dev: (T+1) */
    float scale;
    float *part;                /* dev: (T*H, S, RD_PART_HDR + E) split partials */
    int S, plen;                /* partitions; entries per partition (a multiple of 64) */
};

/* ==== device helpers ==== */

/* K (v = 0) or V (v = 1) row of cell c of kv head h. */
static __device__ __forceinline__ const uint8_t *rd_rowp(const rd_args &a, int h, int c, int v)
{
    const uint8_t *blk = a.pages + (size_t)a.pt[c / a.P] * a.page_bytes +
                         ((size_t)a.layer * a.K + h) * (size_t)a.P * (a.kbytes + a.vbytes);
    int slot = c % a.P;
    return v ? blk + (size_t)a.P * a.kbytes + (size_t)slot * a.vbytes : blk + (size_t)slot * a.kbytes;
}

/* Values d..d+3 (d % 4 == 0) of a row, to the values kv.c's kv_read gives. */
static __device__ __forceinline__ void rd_dequant4(const uint8_t *row, int fmt, int d, float *y)
{
    switch (fmt) {
    case RD_F32: {
        const float *p = (const float *)row + d;
        y[0] = p[0], y[1] = p[1], y[2] = p[2], y[3] = p[3];
        break;
    }
    case RD_F16: {
        const __half *p = (const __half *)row + d;
        y[0] = __half2float(p[0]), y[1] = __half2float(p[1]);
        y[2] = __half2float(p[2]), y[3] = __half2float(p[3]);
        break;
    }
    case RD_I8: {
        /* an f32 scale, then the codes: 4 + E bytes a row keep both 4-aligned */
        float s = *(const float *)row;
        int w = *(const int *)(row + 4 + d);
        for (int i = 0; i < 4; i++)
            y[i] = (float)(signed char)(w >> (8 * i)) * s;
        break;
    }
    default: {
        /* Q4_0: per 32 values an f16 scale and 16 bytes; value i < 16 is the low
         * nibble of byte i, value i + 16 its high nibble, both offset by 8 */
        const uint8_t *blk = row + (d / 32) * 18;
        float s = __half2float(*(const __half *)blk);
        int w = d % 32, sh = w >= 16 ? 4 : 0;
        const uint8_t *b = blk + 2 + w % 16;
        for (int i = 0; i < 4; i++)
            y[i] = (float)(((b[i] >> sh) & 15) - 8) * s;
        break;
    }
    }
}

/* The block stages K or V of entries u..u+n-1 of the chunk (cells cid[])
 * dequantised into buf (n, E+1): the pad column keeps the score phase's
 * lanes, each on its own cell, on distinct LDS banks. */
static __device__ void rd_stage(const rd_args &a, int h, const int *cid, int u, int n, int v, float *buf)
{
    int E = a.E, nq = E / 4, fmt = v ? a.vrow : a.krow;
    for (int i = threadIdx.x; i < n * nq; i += RD_THREADS) {
        int j = i / nq, d = (i % nq) * 4;
        float y[4];
        rd_dequant4(rd_rowp(a, h, cid[u + j], v), fmt, d, y);
        float *dst = buf + j * (E + 1) + d;
        dst[0] = y[0], dst[1] = y[1], dst[2] = y[2], dst[3] = y[3];
    }
}

/* ==== the walk ==== */

/* Kernel kinds: which rows a block takes and which entries they walk. */
enum rd_kind {
    RD_PROMPT,      /* rows: 16 consecutive (t, g) of kv head h; cells 0..pos0+t */
    RD_QSA,         /* rows: query t's heads of kv head h; its whole list */
    RD_SPLIT,       /* rows: query t's heads; partition s of cells 0..pos0+t */
    RD_QSA_SPLIT    /* rows: query t's heads; partition s of its list */
};

/*
 * One block: R <= ROWS rows of kv head h walk entries [e0, e1) in chunks of
 * 64 with an online softmax. Row r belongs to warp r % NW (slot r / NW), so
 * a few rows still spread over every warp. Per chunk:
 *   1. cell ids of the chunk into LDS;
 *   2. K staged SU cells at a time; scores: lane <-> cell (a cell split over
 *      W/SU lanes when SU < W), q rows broadcast from LDS;
 *   3. per row (one warp): chunk max, p = e^(s - m_new), chunk sum by warp
 *      shuffles; the running (m, l) stay in the warp's registers;
 *   4. V: either staged like K and accumulated lane <-> dimension (E/W dims
 *      a lane), or (Q8) read straight from the page, 4 dims a thread from one
 *      4-byte load of int8 codes, the block's cell groups reduced in LDS;
 *   5. the chunk's sum, formed from zero, folded into the running one with
 *      one fma: acc = acc*alpha + chunk, the blocking of attn.c's split path.
 * EC >= E is the compile-time head-dim class (128 or 256); Q8 needs int8 V.
 */
template <int EC, int KIND, int ROWS, int Q8>
__global__ void __launch_bounds__(RD_THREADS) rd_attn(rd_args a)
{
    constexpr int W = GPU_WARP, NW = RD_THREADS / W, RPW = ROWS / NW;
    constexpr int NDL = (EC + W - 1) / W;       /* dims per lane (V staged) */
    constexpr int NPL = RD_CHUNK / W;           /* chunk entries per lane in the softmax */
    constexpr int ACCN = ROWS * EC / RD_THREADS; /* Q8: accumulators per thread */
    extern __shared__ float rd_smem[];
    const int E = a.E, SU = a.SU, G = a.G;
    const int lane = threadIdx.x % W, warp = threadIdx.x / W;
    int stage_n = SU * (E + 1) > 512 * RD_ROWS_Q8 ? SU * (E + 1) : 512 * RD_ROWS_Q8;
    float *kbuf = rd_smem;                      /* (SU, E+1) staged rows; Q8: the reduction */
    float *qs = kbuf + stage_n;                 /* (ROWS, E) */
    float *ps = qs + ROWS * E;                  /* (ROWS, 64) scores, then probabilities */
    float *als = ps + ROWS * RD_CHUNK;          /* (ROWS) Q8: alpha of the chunk */
    float *ls = als + ROWS;                     /* (ROWS) Q8: running sum */
    int *cid = (int *)(ls + ROWS);              /* (64) cells of the chunk */

    const int h = blockIdx.y, pos0 = *a.pos0;
    int t_row[RPW];                             /* query of each slot; -1: no row */
    int lim[RPW];                               /* last visible cell of each slot */
    int t = 0, g0 = 0, R, e0 = 0, e1, s = 0, first = 0;
    const int32_t *list = nullptr;
    if (KIND == RD_PROMPT) {
        first = (gridDim.x - 1 - blockIdx.x) * ROWS; /* the longest tiles first */
        int n = a.T * G - first;
        R = n < ROWS ? n : ROWS;
        e1 = pos0 + (first + R - 1) / G + 1;
    } else {
        int z = KIND == RD_QSA ? blockIdx.x : blockIdx.z;
        t = z / a.gtiles;
        g0 = (z % a.gtiles) * ROWS;
        R = G - g0 < ROWS ? G - g0 : ROWS;
        if (KIND == RD_QSA || KIND == RD_QSA_SPLIT) {
            list = a.sel + a.sel_off[t];
            e1 = (int)(a.sel_off[t + 1] - a.sel_off[t]);
        } else {
            e1 = pos0 + t + 1;
        }
        if (KIND == RD_SPLIT || KIND == RD_QSA_SPLIT) {
            s = blockIdx.x;
            e0 = s * a.plen;
            e1 = e1 < e0 + a.plen ? e1 : e0 + a.plen;
        }
    }
    /* the rows' (query, head) and their q rows into LDS */
    for (int i = 0; i < RPW; i++) {
        int r = i * NW + warp;
        t_row[i] = -1;
        lim[i] = -1;
        if (r < R) {
            t_row[i] = KIND == RD_PROMPT ? (first + r) / G : t;
            lim[i] = list ? 0x7fffffff : pos0 + t_row[i];
        }
    }
    for (int i = threadIdx.x; i < ROWS * E; i += RD_THREADS) {
        int r = i / E, d = i % E;
        float v = 0.0f;
        if (r < R) {
            int tr, g;
            if (KIND == RD_PROMPT) {
                tr = (first + r) / G, g = (first + r) % G;
            } else {
                tr = t, g = g0 + r;
            }
            v = a.q[((size_t)tr * a.H + (size_t)h * G + g) * E + d];
        }
        qs[i] = v;
    }

    float m[RPW], l[RPW], acc[RPW][NDL];
    float accq[Q8 ? ACCN : 1];
    for (int i = 0; i < RPW; i++) {
        m[i] = -INFINITY;
        l[i] = 0.0f;
        for (int k = 0; k < NDL; k++)
            acc[i][k] = 0.0f;
    }
    for (int k = 0; k < (Q8 ? ACCN : 1); k++)
        accq[k] = 0.0f;

    const int lpc = SU >= W ? 1 : W / SU;       /* lanes per cell in the score phase */
    const int cpl = SU >= W ? SU / W : 1;       /* cells per lane */
    const int part = lane / (W / lpc), jl = lane % (W / lpc);
    const int dlen = E / lpc, dbeg = part * dlen;

    for (int c0 = e0; c0 < e1; c0 += RD_CHUNK) {
        int nc = e1 - c0 < RD_CHUNK ? e1 - c0 : RD_CHUNK;
        __syncthreads(); /* the previous chunk is done with cid, kbuf, ps */
        for (int i = threadIdx.x; i < nc; i += RD_THREADS)
            cid[i] = list ? list[c0 + i] : c0 + i;

        /* ---- scores ---- */
        for (int u = 0; u < nc; u += SU) {
            int nsub = nc - u < SU ? nc - u : SU;
            __syncthreads();
            rd_stage(a, h, cid, u, nsub, 0, kbuf);
            __syncthreads();
            /* every slot computes (an empty one on q = 0), so each k value
             * read from LDS feeds RPW fmas and the shuffles stay uniform */
            for (int k = 0; k < cpl; k++) {
                int j = jl + k * W;
                const float *kr = kbuf + j * (E + 1);
                /* eight interleaved chains and a tree per row: the rounding
                 * of attn.c's lane-parallel dot, not of one 128-term chain */
                float c8[RPW][8];
                for (int i = 0; i < RPW; i++)
                    for (int x = 0; x < 8; x++)
                        c8[i][x] = 0.0f;
                int d = dbeg;
                for (; d + 8 <= dbeg + dlen; d += 8)
                    for (int x = 0; x < 8; x++) {
                        float kv = kr[d + x];
                        for (int i = 0; i < RPW; i++)
                            c8[i][x] = fmaf(qs[(i * NW + warp) * E + d + x], kv, c8[i][x]);
                    }
                for (int x = 0; d < dbeg + dlen; d++, x++) {
                    float kv = kr[d];
                    for (int i = 0; i < RPW; i++)
                        c8[i][x] = fmaf(qs[(i * NW + warp) * E + d], kv, c8[i][x]);
                }
                for (int i = 0; i < RPW; i++) {
                    const float *c = c8[i];
                    float dot = ((c[0] + c[4]) + (c[2] + c[6])) + ((c[1] + c[5]) + (c[3] + c[7]));
                    for (int o = W / lpc; o < W; o <<= 1)
                        dot += gpu_shfl_xor(dot, o);
                    if (part == 0 && t_row[i] >= 0) {
                        int vis = j < nsub && cid[u + j] <= lim[i];
                        ps[(i * NW + warp) * RD_CHUNK + u + j] = vis ? dot * a.scale : -INFINITY;
                    }
                }
            }
        }
        __syncthreads(); /* every lane's scores are in ps */

        /* ---- softmax step per row, one warp each ---- */
        float alpha[RPW];
        for (int i = 0; i < RPW; i++) {
            alpha[i] = 1.0f;
            if (t_row[i] < 0)
                continue;
            float *pr = ps + (i * NW + warp) * RD_CHUNK;
            float sv[NPL > 0 ? NPL : 1], mx = -INFINITY;
            for (int k = 0; k < NPL; k++) {
                int j = lane + k * W;
                sv[k] = j < nc ? pr[j] : -INFINITY;
                mx = fmaxf(mx, sv[k]);
            }
            mx = warp_max(mx);
            float m_new = fmaxf(m[i], mx);
            /* exp(-inf - -inf) is NaN: a cell at -inf weighs 0, and a row
             * with no finite score yet keeps nothing to rescale */
            float al = m[i] == -INFINITY ? 0.0f : expf(m[i] - m_new), sum = 0.0f;
            for (int k = 0; k < NPL; k++) {
                float p = sv[k] == -INFINITY ? 0.0f : expf(sv[k] - m_new);
                sum += p;
                int j = lane + k * W;
                pr[j] = p;
            }
            sum = warp_sum(sum);
            l[i] = fmaf(l[i], al, sum);
            m[i] = m_new;
            alpha[i] = al;
            if (Q8 && lane == 0) {
                als[i * NW + warp] = al;
                ls[i * NW + warp] = l[i];
            }
        }

        /* ---- values ---- */
        if constexpr (!Q8) {
            float cacc[RPW][NDL];
            for (int i = 0; i < RPW; i++)
                for (int k = 0; k < NDL; k++)
                    cacc[i][k] = 0.0f;
            for (int u = 0; u < nc; u += SU) {
                int nsub = nc - u < SU ? nc - u : SU;
                __syncthreads();
                rd_stage(a, h, cid, u, nsub, 1, kbuf);
                __syncthreads();
                /* each V value read feeds RPW fmas; an empty slot's are
                 * never written out */
                for (int j = 0; j < nsub; j++) {
                    const float *vr = kbuf + j * (E + 1);
                    float v[NDL];
                    for (int k = 0; k < NDL; k++)
                        v[k] = lane + k * W < E ? vr[lane + k * W] : 0.0f;
                    for (int i = 0; i < RPW; i++) {
                        float p = ps[(i * NW + warp) * RD_CHUNK + u + j];
                        for (int k = 0; k < NDL; k++)
                            cacc[i][k] = fmaf(p, v[k], cacc[i][k]);
                    }
                }
            }
            for (int i = 0; i < RPW; i++)
                for (int k = 0; k < NDL; k++)
                    acc[i][k] = fmaf(acc[i][k], alpha[i], cacc[i][k]);
        } else {
            /* groups of E/4 threads each take every NG-th cell of the chunk,
             * all dims: one 4-byte load of codes feeds 4*R fmas */
            int nq = E / 4, NG = RD_THREADS / nq, gi = threadIdx.x / nq, d = (threadIdx.x % nq) * 4;
            float cv[ROWS][4];
            for (int r = 0; r < ROWS; r++)
                cv[r][0] = cv[r][1] = cv[r][2] = cv[r][3] = 0.0f;
            __syncthreads(); /* probabilities of every row */
            if (gi < NG)
                for (int j = gi; j < nc; j += NG) {
                    const uint8_t *row = rd_rowp(a, h, cid[j], 1);
                    float sc = *(const float *)row, v[4];
                    int w = *(const int *)(row + 4 + d);
                    for (int k = 0; k < 4; k++)
                        v[k] = (float)(signed char)(w >> (8 * k)) * sc;
                    for (int r = 0; r < ROWS; r++) {
                        if (r >= R)
                            break;
                        float p = ps[r * RD_CHUNK + j];
                        for (int k = 0; k < 4; k++)
                            cv[r][k] = fmaf(p, v[k], cv[r][k]);
                    }
                }
            if (gi < NG)
                for (int r = 0; r < R; r++)
                    for (int k = 0; k < 4; k++)
                        kbuf[(gi * ROWS + r) * E + d + k] = cv[r][k];
            __syncthreads();
            for (int k = 0; k < ACCN; k++) {
                int idx = threadIdx.x + k * RD_THREADS, r = idx / E, dd = idx % E;
                if (r >= R)
                    break;
                float sum = kbuf[r * E + dd];
                for (int g = 1; g < NG; g++)
                    sum += kbuf[(g * ROWS + r) * E + dd];
                accq[k] = fmaf(accq[k], als[r], sum);
            }
        }
    }

    /* ---- results ---- */
    if constexpr (Q8) {
        __syncthreads();
        for (int k = 0; k < ACCN; k++) {
            int idx = threadIdx.x + k * RD_THREADS, r = idx / E, dd = idx % E;
            if (r >= R)
                break;
            float L = ls[r];
            a.out[((size_t)t * a.H + (size_t)h * G + g0 + r) * E + dd] = accq[k] * (L > 0.0f ? 1.0f / L : 0.0f);
        }
    } else {
        for (int i = 0; i < RPW; i++) {
            if (t_row[i] < 0)
                continue;
            int r = i * NW + warp, g = KIND == RD_PROMPT ? (first + r) % G : g0 + r;
            size_t orow = (size_t)t_row[i] * a.H + (size_t)h * G + g;
            if (KIND == RD_SPLIT || KIND == RD_QSA_SPLIT) {
                float *p = a.part + (orow * a.S + s) * (size_t)(RD_PART_HDR + E);
                if (lane == 0)
                    p[0] = m[i], p[1] = l[i];
                for (int k = 0; k < NDL; k++)
                    if (lane + k * W < E)
                        p[RD_PART_HDR + lane + k * W] = acc[i][k];
            } else {
                float inv = l[i] > 0.0f ? 1.0f / l[i] : 0.0f;
                for (int k = 0; k < NDL; k++)
                    if (lane + k * W < E)
                        a.out[orow * E + lane + k * W] = acc[i][k] * inv;
            }
        }
    }
}

/* The log-sum-exp merge of a row's S partials (one block per row, as
 * attn.c's merge): out = Σ w_s·acc_s / Σ w_s·l_s, w_s = e^(m_s - M); the
 * first term is a product, so S = 1 passes acc/l through unchanged. */
__global__ void __launch_bounds__(RD_THREADS) rd_merge(const float *part, float *out, int S, int E)
{
    const float *p = part + (size_t)blockIdx.x * S * (RD_PART_HDR + E);
    float M = -INFINITY;
    for (int s = 0; s < S; s++)
        M = fmaxf(M, p[(size_t)s * (RD_PART_HDR + E)]);
    for (int d = threadIdx.x; d < E; d += RD_THREADS) {
        float L = 0.0f, o = 0.0f;
        for (int s = 0; s < S; s++) {
            const float *ps = p + (size_t)s * (RD_PART_HDR + E);
            /* a partition that saw no cell has m = -inf and weight 0 */
            float w = ps[0] == -INFINITY ? 0.0f : expf(ps[0] - M);
            L = s ? fmaf(w, ps[1], L) : w * ps[1];
            o = s ? fmaf(w, ps[RD_PART_HDR + d], o) : w * ps[RD_PART_HDR + d];
        }
        out[(size_t)blockIdx.x * E + d] = o * (1.0f / L);
    }
}

/* ==== host side ==== */

static int rd_row_of(int cell, int v)
{
    static const int k[KV_CELL_COUNT] = {RD_F32, RD_F16, RD_I8, RD_Q4, RD_I8};
    static const int vv[KV_CELL_COUNT] = {RD_F32, RD_F16, RD_I8, RD_Q4, RD_Q4};
    return v ? vv[cell] : k[cell];
}

/* The partition count and length for entries up to n_max, other = blocks
 * per partition; the same on every device, so results never depend on the
 * card. Bounded by rd_split_max for the scratch. */
static int rd_split(int n_max, int other, int *plen)
{
    int chunks = (n_max + RD_CHUNK - 1) / RD_CHUNK;
    int S = (RD_SPLIT_BLOCKS + other - 1) / other;
    /* each partition keeps >= 4 chunks: the merge reads E+4 floats per row
     * and partition, small next to the cells the partition read */
    if (S > chunks / 4)
        S = chunks / 4;
    S = S < 1 ? 1 : S > RD_MAX_SPLIT ? RD_MAX_SPLIT : S;
    int per = chunks > 0 ? (chunks + S - 1) / S : 1;
    *plen = per * RD_CHUNK;
    return chunks > 0 ? (chunks + per - 1) / per : 1;
}

size_t gpu_attn_rdna2_scratch_bytes(int H, int T, int max_cells, int E)
{
    if (H <= 0 || T <= 0 || E <= 0)
        return 0;
    int plen, S = rd_split(max_cells, T, &plen); /* other >= T: the most partitions */
    return (size_t)S * T * H * (RD_PART_HDR + (size_t)E) * sizeof(float);
}

static int rd_check(const struct gpu_attn *a, int qsa, char *err, size_t errlen)
{
    const struct gpu_kv *kv = &a->kv;
    if (kv->cell < 0 || kv->cell >= KV_CELL_COUNT)
        return strata_errf(err, errlen, "rdna2 attention: unknown cell format %d", kv->cell);
    if (kv->E <= 0 || kv->E > RD_MAX_E || kv->E % 4 || (kv->cell >= KV_CELL_Q4 && kv->E % 32))
        return strata_errf(err, errlen, "rdna2 attention: head dim %d (a multiple of 4 up to %d, of 32 for q4)",
                           kv->E, RD_MAX_E);
    if (kv->P <= 0 || (kv->P & (kv->P - 1)))
        return strata_errf(err, errlen, "rdna2 attention: %d cells a page, not a power of two", kv->P);
    if (kv->K <= 0 || a->H % kv->K || a->layer < 0 || a->layer >= kv->L)
        return strata_errf(err, errlen, "rdna2 attention: %d heads on %d kv heads, layer %d of %d", a->H, kv->K,
                           a->layer, kv->L);
    if (!a->q || !a->out || !a->pos0 || !kv->pages || !kv->page_table || a->T < 0)
        return strata_errf(err, errlen, "rdna2 attention: missing q, out, pos0 or pages");
    if (qsa && (!a->sel || !a->sel_off))
        return strata_errf(err, errlen, "rdna2 attention: QSA without a cell selection");
    return 0;
}

static struct rd_args rd_args_of(const struct gpu_attn *a)
{
    struct rd_args r;
    memset(&r, 0, sizeof r);
    const struct gpu_kv *kv = &a->kv;
    r.pages = kv->pages;
    r.pt = kv->page_table;
    r.page_bytes = kv->page_bytes;
    r.kbytes = kv->kbytes;
    r.vbytes = kv->vbytes;
    r.krow = rd_row_of(kv->cell, 0);
    r.vrow = rd_row_of(kv->cell, 1);
    r.K = kv->K, r.E = kv->E, r.P = kv->P, r.layer = a->layer;
    r.H = a->H, r.G = a->H / kv->K, r.T = a->T;
    int su = 64;
    while (su * kv->E > RD_STAGE)
        su >>= 1;
    r.SU = su;
    r.q = a->q, r.out = a->out, r.pos0 = a->pos0, r.sel = a->sel, r.sel_off = a->sel_off;
    r.scale = a->scale;
    r.part = (float *)a->scratch;
    return r;
}

/* LDS bytes of one block (the layout at the top of rd_attn). */
static size_t rd_lds_bytes(const struct rd_args *r, int rows)
{
    size_t stage = (size_t)r->SU * (r->E + 1);
    if (stage < 512 * RD_ROWS_Q8)
        stage = 512 * RD_ROWS_Q8;
    return (stage + (size_t)rows * r->E + (size_t)rows * RD_CHUNK + 2 * (size_t)rows + RD_CHUNK) * sizeof(float);
}

template <int KIND, int ROWS, int Q8>
static int rd_launch(const struct rd_args *r, dim3 grid, void *stream, char *err, size_t errlen)
{
    size_t smem = rd_lds_bytes(r, ROWS);
    if (r->E <= 128)
        rd_attn<128, KIND, ROWS, Q8><<<grid, RD_THREADS, smem, (gpuStream_t)stream>>>(*r);
    else
        rd_attn<256, KIND, ROWS, Q8><<<grid, RD_THREADS, smem, (gpuStream_t)stream>>>(*r);
    GPU_TRY(gpuGetLastError(), err, errlen);
    return 0;
}

/* Split + merge over cells (qsa = 0) or each query's list (qsa = 1). */
static int rd_split_run(const struct gpu_attn *a, int qsa, void *stream, char *err, size_t errlen)
{
    if (rd_check(a, qsa, err, errlen))
        return -1;
    if (a->T == 0)
        return 0;
    if (!a->scratch)
        return strata_errf(err, errlen, "rdna2 attention: the split kernels need scratch");
    struct rd_args r = rd_args_of(a);
    r.gtiles = (r.G + RD_ROWS - 1) / RD_ROWS;
    /* a list holds at most max_cells entries, as the causal range does */
    r.S = rd_split(a->max_cells, r.K * a->T * r.gtiles, &r.plen);
    if (a->T * r.gtiles > 65535)
        return strata_errf(err, errlen, "rdna2 attention: %d queries in one split call, at most %d", a->T,
                           65535 / r.gtiles);
    dim3 grid(r.S, r.K, a->T * r.gtiles);
    int rc = qsa ? rd_launch<RD_QSA_SPLIT, RD_ROWS, 0>(&r, grid, stream, err, errlen)
                 : rd_launch<RD_SPLIT, RD_ROWS, 0>(&r, grid, stream, err, errlen);
    if (rc)
        return rc;
    rd_merge<<<a->T * a->H, RD_THREADS, 0, (gpuStream_t)stream>>>(r.part, a->out, r.S, r.E);
    GPU_TRY(gpuGetLastError(), err, errlen);
    return 0;
}

/* ==== the launchers gpu.h declares ==== */

int gpu_attn_prompt_rdna2(const struct gpu_attn *a, void *stream, char *err, size_t errlen)
{
    if (rd_check(a, 0, err, errlen))
        return -1;
    if (a->T == 0)
        return 0;
    struct rd_args r = rd_args_of(a);
    dim3 grid((a->T * r.G + RD_ROWS - 1) / RD_ROWS, r.K);
    return rd_launch<RD_PROMPT, RD_ROWS, 0>(&r, grid, stream, err, errlen);
}

int gpu_attn_decode_rdna2(const struct gpu_attn *a, void *stream, char *err, size_t errlen)
{
    return rd_split_run(a, 0, stream, err, errlen);
}

/* int8 KV takes the value phase of 4-byte code loads; other formats stage V. */
int gpu_attn_qsa_prompt_rdna2(const struct gpu_attn *a, void *stream, char *err, size_t errlen)
{
    if (rd_check(a, 1, err, errlen))
        return -1;
    if (a->T == 0)
        return 0;
    struct rd_args r = rd_args_of(a);
    if (a->kv.cell == KV_CELL_INT8 && r.E / 4 <= RD_THREADS) {
        r.gtiles = (r.G + RD_ROWS_Q8 - 1) / RD_ROWS_Q8;
        return rd_launch<RD_QSA, RD_ROWS_Q8, 1>(&r, dim3(a->T * r.gtiles, r.K), stream, err, errlen);
    }
    r.gtiles = (r.G + RD_ROWS - 1) / RD_ROWS;
    return rd_launch<RD_QSA, RD_ROWS, 0>(&r, dim3(a->T * r.gtiles, r.K), stream, err, errlen);
}

int gpu_attn_qsa_decode_rdna2(const struct gpu_attn *a, void *stream, char *err, size_t errlen)
{
    return rd_split_run(a, 1, stream, err, errlen);
}

#ifdef GPU_HIP
/* ==== the HIP dispatch table ==== */

/* Whether the current device is RDNA2 (gfx103x), once per device. */
static int rd_is_gfx103(void)
{
    static int known[16]; /* 0 unknown, 1 yes, 2 no */
    int dev = 0;
    if (hipGetDevice(&dev) != hipSuccess || dev < 0 || dev >= 16)
        return 0;
    if (!known[dev]) {
        hipDeviceProp_t p;
        known[dev] = hipGetDeviceProperties(&p, dev) == hipSuccess && strncmp(p.gcnArchName, "gfx103", 6) == 0
                         ? 1
                         : 2;
    }
    return known[dev] == 1;
}

/* STRATA_PROMPT_ATTN_RDNA2=1 takes QSA prompts on int8 KV on gfx103x to
 * the kernel without split and merge; otherwise they go through the split
 * kernels, as decode queries do (the default, unchanged by the switch). */
static int rd_optin(const struct gpu_attn *a)
{
    const char *e = getenv("STRATA_PROMPT_ATTN_RDNA2");
    return e && strcmp(e, "1") == 0 && a->kv.cell == KV_CELL_INT8 && a->kv.E / 4 <= RD_THREADS && rd_is_gfx103();
}

enum rd_path { RD_P_PROMPT, RD_P_DECODE, RD_P_QSA_SPLIT, RD_P_QSA_RDNA2, RD_P_QSA_DECODE };

static const struct {
    const char *name;
    int (*run)(const struct gpu_attn *a, void *stream, char *err, size_t errlen);
} rd_table[] = { /* in enum rd_path's order */
    {"rdna2_prompt", gpu_attn_prompt_rdna2},
    {"rdna2_decode_split", gpu_attn_decode_rdna2},
    {"rdna2_qsa_split", gpu_attn_qsa_decode_rdna2},
    {"rdna2_qsa_prompt", gpu_attn_qsa_prompt_rdna2},
    {"rdna2_qsa_decode_split", gpu_attn_qsa_decode_rdna2},
};

static int rd_pick(const struct gpu_attn *a, int decode, int qsa)
{
    if (decode)
        return qsa ? RD_P_QSA_DECODE : RD_P_DECODE;
    if (!qsa)
        return RD_P_PROMPT;
    return rd_optin(a) ? RD_P_QSA_RDNA2 : RD_P_QSA_SPLIT;
}

size_t gpu_attn_scratch_bytes(int H, int T, int max_cells, int E)
{
    return gpu_attn_rdna2_scratch_bytes(H, T, max_cells, E);
}

/* No kernel here takes several sequences in one call: gpu.cu calls a row at a time. */
int gpu_attn_takes_multi(const struct gpu_attn *a)
{
    (void)a;
    return 0;
}

const char *gpu_attn_kernel_name(const struct gpu_attn *a, int decode, int qsa)
{
    return rd_table[rd_pick(a, decode, qsa)].name;
}

int gpu_attn_prompt(const struct gpu_attn *a, void *stream, char *err, size_t errlen)
{
    return rd_table[rd_pick(a, 0, 0)].run(a, stream, err, errlen);
}

int gpu_attn_decode(const struct gpu_attn *a, void *stream, char *err, size_t errlen)
{
    return rd_table[rd_pick(a, 1, 0)].run(a, stream, err, errlen);
}

int gpu_attn_qsa_prompt(const struct gpu_attn *a, void *stream, char *err, size_t errlen)
{
    int p = rd_pick(a, 0, 1);
    static int said;
    if (p == RD_P_QSA_RDNA2 && !said) {
        said = 1;
        fprintf(stderr, "strata: STRATA_PROMPT_ATTN_RDNA2=1: QSA prompt attention without split and merge "
                        "(RDNA2 kernel, int8 KV)\n");
    }
    return rd_table[p].run(a, stream, err, errlen);
}

int gpu_attn_qsa_decode(const struct gpu_attn *a, void *stream, char *err, size_t errlen)
{
    return rd_table[rd_pick(a, 1, 1)].run(a, stream, err, errlen);
}

/* gpu.h's test hooks, which attn_cuda.cu defines in a CUDA build. */
int gpu_attn_test_sync(void)
{
    return gpuDeviceSynchronize() == gpuSuccess ? 0 : -1;
}

double gpu_attn_test_time(int (*fn)(void *), void *arg, int reps)
{
    gpuEvent_t e[2] = {NULL, NULL};
    float ms = -1;
    if (gpuEventCreate(&e[0]) == gpuSuccess && gpuEventCreate(&e[1]) == gpuSuccess) {
        int bad = fn(arg) != 0;
        bad |= gpuEventRecord(e[0], 0) != gpuSuccess;
        for (int i = 0; i < reps && !bad; i++)
            bad = fn(arg) != 0;
        bad |= gpuEventRecord(e[1], 0) != gpuSuccess;
        if (bad || gpuEventSynchronize(e[1]) != gpuSuccess || gpuEventElapsedTime(&ms, e[0], e[1]) != gpuSuccess)
            ms = -1;
        else
            ms /= reps > 0 ? reps : 1;
    }
    for (int i = 0; i < 2; i++)
        if (e[i])
            gpuEventDestroy(e[i]);
    return ms;
}
#endif

/* ==== test support ==== */

static int (*const rd_entry[8])(const struct gpu_attn *, void *, char *, size_t) = {
    gpu_attn_prompt_rdna2, gpu_attn_decode_rdna2, gpu_attn_qsa_prompt_rdna2, gpu_attn_qsa_decode_rdna2,
    gpu_attn_prompt,       gpu_attn_decode,       gpu_attn_qsa_prompt,       gpu_attn_qsa_decode,
};

struct rd_dev {
    void *p[7];     /* pages, page table, q, out, pos0, sel, sel_off */
    void *scratch;
    gpuEvent_t ev[2];
    gpuStream_t st;
};

/* Releases what rd_test_run took; a failure to free is not the test's. */
static void rd_dev_free(struct rd_dev *d)
{
    for (int i = 0; i < 7; i++)
        if (d->p[i])
            (void)gpuFree(d->p[i]);
    if (d->scratch)
        (void)gpuFree(d->scratch);
    for (int i = 0; i < 2; i++)
        if (d->ev[i])
            (void)gpuEventDestroy(d->ev[i]);
    if (d->st)
        (void)gpuStreamDestroy(d->st);
}

static int rd_test_run(const struct gpu_attn *h, int n_pages, int max_pages, int which, int reps, float *ms,
                       struct rd_dev *d, char *err, size_t errlen)
{
    size_t n_out = (size_t)h->T * h->H * h->kv.E, n_sel = h->sel_off ? (size_t)h->sel_off[h->T] : 0;
    size_t bytes[7] = {(size_t)n_pages * h->kv.page_bytes, (size_t)max_pages * 4, n_out * 4, n_out * 4, 4,
                       n_sel * 4, h->sel_off ? ((size_t)h->T + 1) * 8 : 0};
    const void *src[7] = {h->kv.pages, h->kv.page_table, h->q, NULL, h->pos0, h->sel, h->sel_off};
    for (int i = 0; i < 7; i++) {
        if (!bytes[i])
            continue;
        GPU_TRY(gpuMalloc(&d->p[i], bytes[i]), err, errlen);
        if (src[i])
            GPU_TRY(gpuMemcpy(d->p[i], src[i], bytes[i], gpuMemcpyHostToDevice), err, errlen);
    }
    /* the launchers' own need and the table's, whichever is larger */
    size_t sb = gpu_attn_rdna2_scratch_bytes(h->H, h->T, h->max_cells, h->kv.E);
    size_t tb = gpu_attn_scratch_bytes(h->H, h->T, h->max_cells, h->kv.E);
    GPU_TRY(gpuMalloc(&d->scratch, (sb > tb ? sb : tb) + 256), err, errlen);
    GPU_TRY(gpuStreamCreate(&d->st), err, errlen);
    GPU_TRY(gpuEventCreate(&d->ev[0]), err, errlen);
    GPU_TRY(gpuEventCreate(&d->ev[1]), err, errlen);
    struct gpu_attn a = *h;
    a.kv.pages = (uint8_t *)d->p[0];
    a.kv.page_table = (const int32_t *)d->p[1];
    a.q = (const float *)d->p[2];
    a.out = (float *)d->p[3];
    a.pos0 = (const int32_t *)d->p[4];
    a.sel = (const int32_t *)d->p[5];
    a.sel_off = (const int64_t *)d->p[6];
    a.scratch = d->scratch;
    /* poisoned: 0xFF bytes are NaN, so a row never written shows */
    GPU_TRY(gpuMemsetAsync(d->p[3], 0xff, bytes[3], d->st), err, errlen);
    if (rd_entry[which](&a, d->st, err, errlen))
        return -1;
    GPU_TRY(gpuMemcpyAsync(h->out, d->p[3], bytes[3], gpuMemcpyDeviceToHost, d->st), err, errlen);
    GPU_TRY(gpuStreamSynchronize(d->st), err, errlen);
    *ms = 0.0f;
    if (reps > 0) {
        GPU_TRY(gpuEventRecord(d->ev[0], d->st), err, errlen);
        for (int i = 0; i < reps; i++)
            if (rd_entry[which](&a, d->st, err, errlen))
                return -1;
        GPU_TRY(gpuEventRecord(d->ev[1], d->st), err, errlen);
        GPU_TRY(gpuEventSynchronize(d->ev[1]), err, errlen);
        GPU_TRY(gpuEventElapsedTime(ms, d->ev[0], d->ev[1]), err, errlen);
        *ms /= (float)reps;
    }
    return 0;
}

int gpu_attn_rdna2_test(const struct gpu_attn *host, int n_pages, int max_pages, int which, int reps, float *ms,
                        char *err, size_t errlen)
{
    if (which < 0 || which >= 8)
        return strata_errf(err, errlen, "rdna2 test: no entry %d", which);
    struct rd_dev d;
    memset(&d, 0, sizeof d);
    int rc = rd_test_run(host, n_pages, max_pages, which, reps, ms, &d, err, errlen);
    rd_dev_free(&d);
    return rc;
}
