/*
 * gpu.cu — the GPU forward pass (CUDA, and HIP through gpu_compat.h): the
 * weights uploaded once and kept quantised, the decode matrix-vector kernels
 * per block format (int8 dot products against an activation quantised on the
 * device in blocks of 32), norms, RoPE, SwiGLU, MoE routing and expert
 * selection on the device, residuals, logits; gpu_kv_store (f32 rows into
 * kv.c's cell formats, byte for byte as kv_store writes them); KV page
 * memory (gpu_kv_mem); the decode step captured once per context as a graph,
 * and a step of up to 16 sequences (gpu_eval_batch) as one pass, a graph for
 * each batch size. Products of more than 16 rows go to gpu_gemm.cu where it
 * takes the type, else to the matrix-vector kernels over batches of tokens
 * (STRATA_GPU_NO_GEMM=1 forces that); of 2..16 rows, Q4_0, Q4_1, Q5_0,
 * Q5_1, Q8_0, Q4_K, Q5_K, Q6_K, IQ4_NL and IQ4_XS to tensor cores
 * (gf_mvq_kernel; Q4_0..Q5_1 and IQ4_NL through a stage, gf_mvqs_kernel),
 * IQ2_XXS and IQ3_XXS too, Q2_K, Q3_K, IQ2_XS and IQ3_S from 3 rows, IQ2_S
 * from 4, F16 and BF16 too (gf_mvh_kernel); of one row, Q4_K to
 * gf_mvk_kernel, the formats with a staged form (gf_mvs_of: Q4_0, Q5_0,
 * Q4_1, Q5_1, Q8_0, the other K-quants, IQ4_NL, IQ4_XS, the lattices) to
 * gf_mvs_kernel, float rows to gf_mvf_kernel, and a Q4_K and
 * a Q6_K product of one width (a Q4_K_M layer's q/k and v) to one launch
 * of both (gf_mv2_kernel; STRATA_GPU_NO_MV2=1: a launch each).
 * STRATA_GPU_NO_GRAPH=1 runs decode without the graph, STRATA_GPU_NO_PDL=1
 * without programmatic dependent launch,
 * STRATA_GPU_MV_OLD=1 with the kernels before gf_mvk_kernel, gf_mvs_kernel,
 * gf_mvf_kernel, gf_mvq_kernel and gf_mvh_kernel (the staged one for one
 * row, 8-row blocks for more), and
 * STRATA_GPU_MOE_PAIRS=1 a prompt's experts one (token, expert) pair at a
 * time through the matrix-vector kernels instead of gpu_gemm (A/B), and
 * STRATA_GPU_NO_NORM_ROUTER=1 a one-token MoE layer's RMSNorm and router
 * as two kernels instead of gf_norm_router_kernel (the same logits).
 * Attention lives in attn_cuda.cu / attn_hip.hip: this file only calls its
 * launchers. It must not touch kv.c's tables (only the page bytes) and never
 * prints.
 */
#include "gpu.h"
#include "gpu_compat.h"
#include "gpu_quant.h"

#include <math.h>
#include <stdlib.h>
#include <string.h>
#include <type_traits>

#define GF_AB 32          /* activation block: int8 codes with one scale */
#define GF_ACT_SLACK 32   /* rows past c->aq's and c->ads's last (gf_act_alloc; gf_act_src reads them) */
#define GF_MV_WARPS 4     /* matrix rows (one per warp) per block of the matrix-vector kernel */
#define GF_NT 8           /* tokens per weight read in the prompt fallback (gf_mv_kernel) */
#define GF_DECODE_T 16    /* up to this many tokens take the decode attention */

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
/* N words at p (4-aligned) in the widest loads its alignment allows: 16
 * bytes, 8 or 4 (the stages keep a row's address mod 16) */
template <int N>
static __device__ __forceinline__ void gf_ldw(uint32_t (&w)[N], const uint8_t *p)
{
    unsigned a = (unsigned)(uintptr_t)p & 15;
    if (N % 4 == 0 && a == 0)
        for (int i = 0; i < N / 4; i++) {
            uint4 v = ((const uint4 *)p)[i];
            w[4 * i] = v.x, w[4 * i + 1] = v.y, w[4 * i + 2] = v.z, w[4 * i + 3] = v.w;
        }
    else if (N % 2 == 0 && a % 8 == 0)
        for (int i = 0; i < N / 2; i++) {
            uint2 v = ((const uint2 *)p)[i];
            w[2 * i] = v.x, w[2 * i + 1] = v.y;
        }
    else
        for (int i = 0; i < N; i++)
            w[i] = ((const uint32_t *)p)[i];
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

/* ==== one unit of a weight row against the activation ====
 * Each type is a struct: BLK elements in BYTES bytes per block, UNITS units
 * per block (one lane's work per step); load() reads a unit's weights into
 * registers once, dot() meets one activation row with them, so the batched
 * kernel reads the weights once for all its tokens. aq/ads point at the
 * activation's block that lines up with the weight block. */

/* Σ code·activation over a block of 32: lo[i] holds codes 4i..4i+3, hi[i]
 * codes 16+4i..16+4i+3, the activation's codes in a0 (0..15) and a1
 * (16..31) (one chain of dp4a in a fixed order) */
static __device__ __forceinline__ int gf_dot32a(const int (&lo)[4], const int (&hi)[4], const int4 &a0,
                                                const int4 &a1)
{
    const int al[4] = {a0.x, a0.y, a0.z, a0.w}, ah[4] = {a1.x, a1.y, a1.z, a1.w};
    int s = 0;
    for (int i = 0; i < 4; i++) {
        s = gpu_dp4a(lo[i], al[i], s);
        s = gpu_dp4a(hi[i], ah[i], s);
    }
    return s;
}

/* the same, the activation's codes at aq */
static __device__ __forceinline__ int gf_dot32(const int (&lo)[4], const int (&hi)[4], const int8_t *aq)
{
    return gf_dot32a(lo, hi, ((const int4 *)aq)[0], ((const int4 *)aq)[1]);
}

/* a 4-bit block's code words q as gf_dot32 takes them, with the fifth bits
 * h of Q5_0/Q5_1 (bit j of h: element j) or none (h = 0) */
static __device__ __forceinline__ void gf_nibbles(const int (&q)[4], uint32_t h, int (&lo)[4], int (&hi)[4])
{
    for (int i = 0; i < 4; i++) {
        lo[i] = (q[i] & 0x0F0F0F0F) | gf_bit4(h >> (4 * i));
        hi[i] = ((q[i] >> 4) & 0x0F0F0F0F) | gf_bit4(h >> (16 + 4 * i));
    }
}

struct gf_q4_0 {
    enum { BLK = 32, BYTES = 18, UNITS = 1, FLOAT = 0 };
    float d;
    int q[4];
    __device__ void load(const uint8_t *bx, int) {
        d = gf_h2f(gf_ld16(bx));
        for (int i = 0; i < 4; i++) q[i] = gf_ld32h(bx + 2 + 4 * i);
    }
    __device__ float dot(const int8_t *aq, const gf_ads *ads) const {
        int lo[4], hi[4];
        gf_nibbles(q, 0, lo, hi);
        int s = gf_dot32(lo, hi, aq);
        gf_ads a = ads[0];
        return d * a.x * (float)(s - 8 * (int)a.z);
    }
};

struct gf_q4_1 {
    enum { BLK = 32, BYTES = 20, UNITS = 1, FLOAT = 0 };
    float d, m;
    int q[4];
    __device__ void load(const uint8_t *bx, int) {
        d = gf_h2f(gf_ld16(bx));
        m = gf_h2f(gf_ld16(bx + 2));
        for (int i = 0; i < 4; i++) q[i] = ((const int *)(bx + 4))[i];
    }
    __device__ float dot(const int8_t *aq, const gf_ads *ads) const {
        int lo[4], hi[4];
        gf_nibbles(q, 0, lo, hi);
        int s = gf_dot32(lo, hi, aq);
        gf_ads a = ads[0];
        return d * a.x * (float)s + m * a.y;
    }
};

struct gf_q5_0 {
    enum { BLK = 32, BYTES = 22, UNITS = 1, FLOAT = 0 };
    float d;
    int lo[4], hi[4];
    __device__ void load(const uint8_t *bx, int) {
        d = gf_h2f(gf_ld16(bx));
        int q[4];
        for (int i = 0; i < 4; i++)
            q[i] = gf_ld32h(bx + 6 + 4 * i);
        gf_nibbles(q, (uint32_t)gf_ld32h(bx + 2), lo, hi);
    }
    __device__ float dot(const int8_t *aq, const gf_ads *ads) const {
        int s = gf_dot32(lo, hi, aq);
        gf_ads a = ads[0];
        return d * a.x * (float)(s - 16 * (int)a.z);
    }
};

struct gf_q5_1 {
    enum { BLK = 32, BYTES = 24, UNITS = 1, FLOAT = 0 };
    float d, m;
    int lo[4], hi[4];
    __device__ void load(const uint8_t *bx, int) {
        d = gf_h2f(gf_ld16(bx));
        m = gf_h2f(gf_ld16(bx + 2));
        int q[4];
        for (int i = 0; i < 4; i++)
            q[i] = ((const int *)(bx + 8))[i];
        gf_nibbles(q, *(const uint32_t *)(bx + 4), lo, hi);
    }
    __device__ float dot(const int8_t *aq, const gf_ads *ads) const {
        int s = gf_dot32(lo, hi, aq);
        gf_ads a = ads[0];
        return d * a.x * (float)s + m * a.y;
    }
};

/* Q8_0: two units of 16 codes per block */
struct gf_q8_0 {
    enum { BLK = 32, BYTES = 34, UNITS = 2, FLOAT = 0 };
    float d;
    int q[4], u;
    __device__ void load(const uint8_t *bx, int unit) {
        d = gf_h2f(gf_ld16(bx));
        u = unit;
        for (int i = 0; i < 4; i++) q[i] = gf_ld32h(bx + 2 + 16 * unit + 4 * i);
    }
    __device__ float dot(const int8_t *aq, const gf_ads *ads) const {
        const int4 a = ((const int4 *)aq)[u];
        int s = gpu_dp4a(q[0], a.x, 0);
        s = gpu_dp4a(q[1], a.y, s);
        s = gpu_dp4a(q[2], a.z, s);
        s = gpu_dp4a(q[3], a.w, s);
        return d * ads[0].x * (float)s;
    }
};

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

/* The product of a unit with activation codes xa and their blocks' scales xs.
 * The high nibbles are dotted in place, as 16 times their value (unsigned
 * bytes), and the sum divided by 16 after: one shift a unit instead of one
 * a word. */
static __device__ __forceinline__ float gf_q4k_pair(int4 h, const int4 (&q)[2], const int4 (&xa)[4],
                                                    const gf_ads (&xs)[2], int p)
{
    uint32_t sc, mn;
    gf_q4k_scales(h, p, &sc, &mn);
    float d = gf_h2f((uint16_t)((uint32_t)h.x & 0xffff)), dmin = gf_h2f((uint16_t)((uint32_t)h.x >> 16));
    const int w[8] = {q[0].x, q[0].y, q[0].z, q[0].w, q[1].x, q[1].y, q[1].z, q[1].w};
    const int ax[8] = {xa[0].x, xa[0].y, xa[0].z, xa[0].w, xa[1].x, xa[1].y, xa[1].z, xa[1].w};
    const int ay[8] = {xa[2].x, xa[2].y, xa[2].z, xa[2].w, xa[3].x, xa[3].y, xa[3].z, xa[3].w};
    int s0 = 0, s1 = 0;
#pragma unroll
    for (int i = 0; i < 8; i++) {
        s0 = gpu_dp4a(w[i] & 0x0F0F0F0F, ax[i], s0);
        s1 = gpu_dp4a_us(w[i] & 0xF0F0F0F0, ay[i], s1);
    }
    s1 >>= 4;   /* a multiple of 16: exact */
    float dl = d * (float)(int)(sc & 0xff), dh = d * (float)(int)(sc >> 8);
    float ml = dmin * (float)(int)(mn & 0xff), mh = dmin * (float)(int)(mn >> 8);
    return xs[0].x * (dl * (float)s0 - ml * xs[0].z) + xs[1].x * (dh * (float)s1 - mh * xs[1].z);
}

struct gf_q4_K {
    enum { BLK = 256, BYTES = 144, UNITS = 4, FLOAT = 0 };
    int4 h, w[2];
    int p;
    __device__ void load(const uint8_t *bx, int unit) {
        p = unit;
        h = *(const int4 *)bx;
        const int4 *q = (const int4 *)(bx + 16) + 2 * unit;
        w[0] = q[0], w[1] = q[1];
    }
    __device__ float dot(const int8_t *aq, const gf_ads *ads) const {
        const int4 *a = (const int4 *)(aq + 64 * p);
        const int4 xa[4] = {a[0], a[1], a[2], a[3]};
        const gf_ads xs[2] = {ads[2 * p], ads[2 * p + 1]};
        return gf_q4k_pair(h, w, xa, xs, p);
    }
};

/* Q5_K: Q4_K's layout plus a fifth bit: element 64p + l takes bit 2p of
 * qh[l], element 64p + 32 + l bit 2p+1. */
struct gf_q5_K {
    enum { BLK = 256, BYTES = 176, UNITS = 8, FLOAT = 0 };
    float dlo, dhi, mlo, mhi;
    int lo[4], hi[4], u;
    __device__ void load(const uint8_t *bx, int unit) {
        u = unit;
        int p = unit >> 1, sc0, m0, sc1, m1;
        float d = gf_h2f(gf_ld16(bx)), dmin = gf_h2f(gf_ld16(bx + 2));
        gf_k4_scale_min(2 * p, bx + 4, &sc0, &m0);
        gf_k4_scale_min(2 * p + 1, bx + 4, &sc1, &m1);
        dlo = d * sc0;
        dhi = d * sc1;
        mlo = (unit & 1) ? 0.0f : dmin * m0;
        mhi = (unit & 1) ? 0.0f : dmin * m1;
        const int4 w = ((const int4 *)(bx + 48))[unit];
        const int4 h = ((const int4 *)(bx + 16))[unit & 1];
        const int wq[4] = {w.x, w.y, w.z, w.w}, hq[4] = {h.x, h.y, h.z, h.w};
        for (int i = 0; i < 4; i++) {
            lo[i] = (wq[i] & 0x0F0F0F0F) | (((hq[i] >> (2 * p)) & 0x01010101) << 4);
            hi[i] = ((wq[i] >> 4) & 0x0F0F0F0F) | (((hq[i] >> (2 * p + 1)) & 0x01010101) << 4);
        }
    }
    __device__ float dot(const int8_t *aq, const gf_ads *ads) const {
        int p = u >> 1, l0 = 16 * (u & 1);
        const int4 al = *(const int4 *)(aq + 64 * p + l0), ah = *(const int4 *)(aq + 64 * p + 32 + l0);
        const int a0[4] = {al.x, al.y, al.z, al.w}, a1[4] = {ah.x, ah.y, ah.z, ah.w};
        int s0 = 0, s1 = 0;
        for (int i = 0; i < 4; i++) {
            s0 = gpu_dp4a(lo[i], a0[i], s0);
            s1 = gpu_dp4a(hi[i], a1[i], s1);
        }
        gf_ads b0 = ads[2 * p], b1 = ads[2 * p + 1];
        return b0.x * (dlo * (float)s0 - mlo * b0.z) + b1.x * (dhi * (float)s1 - mhi * b1.z);
    }
};

/* Q6_K: unit u covers half h = u/4 and l = 8(u%4) .. +8 of each of the four
 * 32-element planes j: low 4 bits from ql (low nibbles for j < 2), top 2 from
 * bits 2j of qh; the stored value is that minus 32, a scale per 16. */
struct gf_q6_K {
    enum { BLK = 256, BYTES = 210, UNITS = 8, FLOAT = 0 };
    float sc[4];
    int v[4][2], u;
    __device__ void load(const uint8_t *bx, int unit) {
        u = unit;
        int h = unit >> 2, l0 = 8 * (unit & 3);
        float d = gf_h2f(gf_ld16(bx + 208));
        const int8_t *scales = (const int8_t *)(bx + 192);
        for (int j = 0; j < 4; j++)
            sc[j] = d * scales[8 * h + 2 * j + (l0 >> 4)];
        for (int i = 0; i < 2; i++) {
            int qa = gf_ld32h(bx + 64 * h + l0 + 4 * i), qb = gf_ld32h(bx + 64 * h + 32 + l0 + 4 * i);
            int qh = gf_ld32h(bx + 128 + 32 * h + l0 + 4 * i);
            v[0][i] = (qa & 0x0F0F0F0F) | ((qh << 4) & 0x30303030);
            v[1][i] = (qb & 0x0F0F0F0F) | ((qh << 2) & 0x30303030);
            v[2][i] = ((qa >> 4) & 0x0F0F0F0F) | (qh & 0x30303030);
            v[3][i] = ((qb >> 4) & 0x0F0F0F0F) | ((qh >> 2) & 0x30303030);
        }
    }
    __device__ float dot(const int8_t *aq, const gf_ads *ads) const {
        int h = u >> 2, l0 = 8 * (u & 3);
        float r = 0.0f;
        for (int j = 0; j < 4; j++) {
            const int2 a = *(const int2 *)(aq + 128 * h + 32 * j + l0);
            int s = gpu_dp4a(v[j][0], a.x, gpu_dp4a(v[j][1], a.y, 0));
            int sq = gpu_dp4a(0x01010101, a.x, gpu_dp4a(0x01010101, a.y, 0));
            r += sc[j] * ads[4 * h + j].x * (float)(s - 32 * sq);
        }
        return r;
    }
};

/* Float weights meet the f32 activation (not quantised): 16 bytes a unit,
 * read at bx (load) or already in registers (set: gf_mvf_kernel). */
struct gf_f32 {
    enum { BLK = 4, BYTES = 16, UNITS = 1, FLOAT = 1 };
    float4 w;
    __device__ void set(const int4 r)
    {
        w = make_float4(__int_as_float(r.x), __int_as_float(r.y), __int_as_float(r.z), __int_as_float(r.w));
    }
    __device__ void load(const uint8_t *bx, int) { set(*(const int4 *)bx); }
    __device__ float dotf(const float *x) const {
        const float4 a = *(const float4 *)x;
        return w.x * a.x + w.y * a.y + w.z * a.z + w.w * a.w;
    }
};

struct gf_f16 {
    enum { BLK = 8, BYTES = 16, UNITS = 1, FLOAT = 1 };
    float w[8];
    __device__ void load(const uint8_t *bx, int) { set(*(const int4 *)bx); }
    __device__ void set(const int4 r) {
        const uint32_t p[4] = {(uint32_t)r.x, (uint32_t)r.y, (uint32_t)r.z, (uint32_t)r.w};
        for (int i = 0; i < 4; i++) {
            w[2 * i] = gf_h2f((uint16_t)(p[i] & 0xffff));
            w[2 * i + 1] = gf_h2f((uint16_t)(p[i] >> 16));
        }
    }
    __device__ float dotf(const float *x) const {
        const float4 a = ((const float4 *)x)[0], b = ((const float4 *)x)[1];
        return w[0] * a.x + w[1] * a.y + w[2] * a.z + w[3] * a.w + w[4] * b.x + w[5] * b.y + w[6] * b.z +
               w[7] * b.w;
    }
};

struct gf_bf16 {
    enum { BLK = 8, BYTES = 16, UNITS = 1, FLOAT = 1 };
    float w[8];
    __device__ void load(const uint8_t *bx, int) { set(*(const int4 *)bx); }
    __device__ void set(const int4 r) {
        const uint32_t p[4] = {(uint32_t)r.x, (uint32_t)r.y, (uint32_t)r.z, (uint32_t)r.w};
        for (int i = 0; i < 4; i++) {
            w[2 * i] = __uint_as_float(p[i] << 16);
            w[2 * i + 1] = __uint_as_float(p[i] & 0xffff0000u);
        }
    }
    __device__ float dotf(const float *x) const {
        const float4 a = ((const float4 *)x)[0], b = ((const float4 *)x)[1];
        return w[0] * a.x + w[1] * a.y + w[2] * a.z + w[3] * a.w + w[4] * b.x + w[5] * b.y + w[6] * b.z +
               w[7] * b.w;
    }
};

/* Q2_K: 16 sub-blocks of 16, sub-block s = 8n + 2j + h (elements 128n +
 * 32j + 16h + l) in bits 2j of qs byte 32n + 16h + l, with a 4-bit scale
 * and min in byte s. Unit u = 2n + h takes the four planes j of the same 16
 * bytes of qs: four half activation blocks, so the Σ of their codes comes
 * from a dp4a each (the activation's z is a whole block's). */
struct gf_q2_K {
    enum { BLK = 256, BYTES = 84, UNITS = 4, FLOAT = 0 };
    float dl[4], ml[4];
    int q[4], u;
    __device__ void load(const uint8_t *bx, int unit) {
        u = unit;
        int n = unit >> 1, h = unit & 1;
        float d = gf_h2f(gf_ld16(bx + 80)), dmin = gf_h2f(gf_ld16(bx + 82));
        for (int i = 0; i < 4; i++)
            q[i] = *(const int *)(bx + 16 + 32 * n + 16 * h + 4 * i);
        for (int j = 0; j < 4; j++) {
            int sc = bx[8 * n + 2 * j + h];
            dl[j] = d * (float)(sc & 15), ml[j] = dmin * (float)(sc >> 4);
        }
    }
    __device__ float dot(const int8_t *aq, const gf_ads *ads) const {
        int n = u >> 1, h = u & 1;
        float r = 0.0f;
        for (int j = 0; j < 4; j++) {
            const int4 a = *(const int4 *)(aq + 128 * n + 32 * j + 16 * h);
            const int av[4] = {a.x, a.y, a.z, a.w};
            int s = 0, sq = 0;
            for (int i = 0; i < 4; i++) {
                s = gpu_dp4a((q[i] >> (2 * j)) & 0x03030303, av[i], s);
                sq = gpu_dp4a(0x01010101, av[i], sq);
            }
            r += ads[4 * n + j].x * (dl[j] * (float)s - ml[j] * (float)sq);
        }
        return r;
    }
};

/* Q3_K sub-block s's signed 6-bit scale: the low nibble of byte 96 + s % 8
 * (its high one for s >= 8), the top two bits from byte 104 + s % 4, less 32 */
static __device__ __forceinline__ int gf_q3k_scale(const uint8_t *b, int s)
{
    int lo = (b[96 + (s & 7)] >> (4 * (s >> 3))) & 15, hi = (b[104 + (s & 3)] >> (2 * (s >> 2))) & 3;
    return (lo | hi << 4) - 32;
}

/* Q3_K: as Q2_K's planes, each code's third bit (level + 4) in bit 4n + j
 * of hmask byte 16h + l, and the scales of gf_q3k_scale. */
struct gf_q3_K {
    enum { BLK = 256, BYTES = 110, UNITS = 4, FLOAT = 0 };
    float dl[4];
    int q[4], hm[4], u;
    __device__ void load(const uint8_t *bx, int unit) {
        u = unit;
        int n = unit >> 1, h = unit & 1;
        float d = gf_h2f(gf_ld16(bx + 108));
        for (int i = 0; i < 4; i++) {
            q[i] = gf_ld32h(bx + 32 + 32 * n + 16 * h + 4 * i);
            hm[i] = gf_ld32h(bx + 16 * h + 4 * i);
        }
        for (int j = 0; j < 4; j++)
            dl[j] = d * (float)gf_q3k_scale(bx, 8 * n + 2 * j + h);
    }
    __device__ float dot(const int8_t *aq, const gf_ads *ads) const {
        int n = u >> 1, h = u & 1;
        float r = 0.0f;
        for (int j = 0; j < 4; j++) {
            const int4 a = *(const int4 *)(aq + 128 * n + 32 * j + 16 * h);
            const int av[4] = {a.x, a.y, a.z, a.w};
            int s = 0, sq = 0;
            for (int i = 0; i < 4; i++) {
                int v = ((q[i] >> (2 * j)) & 0x03030303) | (((hm[i] >> (4 * n + j)) & 0x01010101) << 2);
                s = gpu_dp4a(v, av[i], s);
                sq = gpu_dp4a(0x01010101, av[i], sq);
            }
            r += ads[4 * n + j].x * dl[j] * (float)(s - 4 * sq);
        }
        return r;
    }
};

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

/* IQ4 codes of 32 elements (16 bytes at q: element l low nibble of byte l,
 * 16 + l the high one) as gf_dot32's lo and hi */
static __device__ __forceinline__ void gf_iq4_unit(const int (&q)[4], int (&lo)[4], int (&hi)[4])
{
    for (int i = 0; i < 4; i++) {
        lo[i] = gf_iq4_vals((unsigned)q[i] & 0x0F0F0F0Fu);
        hi[i] = gf_iq4_vals((unsigned)q[i] >> 4 & 0x0F0F0F0Fu);
    }
}

/* IQ4_NL: Q4_0's layout, the codes through the grid */
struct gf_iq4_nl {
    enum { BLK = 32, BYTES = 18, UNITS = 1, FLOAT = 0 };
    float d;
    int lo[4], hi[4];
    __device__ void load(const uint8_t *bx, int) {
        d = gf_h2f(gf_ld16(bx));
        int q[4];
        for (int i = 0; i < 4; i++)
            q[i] = gf_ld32h(bx + 2 + 4 * i);
        gf_iq4_unit(q, lo, hi);
    }
    __device__ float dot(const int8_t *aq, const gf_ads *ads) const {
        return d * ads[0].x * (float)gf_dot32(lo, hi, aq);
    }
};

/* IQ4_XS: 8 sub-blocks of 32 (a unit each), 16 bytes of codes at 8 + 16u,
 * a 6-bit scale (low nibble u % 2 of byte 4 + u/2, top bits 2u of the u16
 * at 2) */
struct gf_iq4_xs {
    enum { BLK = 256, BYTES = 136, UNITS = 8, FLOAT = 0 };
    float dl;
    int lo[4], hi[4], u;
    __device__ void load(const uint8_t *bx, int unit) {
        u = unit;
        int ls = ((bx[4 + unit / 2] >> (4 * (unit & 1))) & 15) | ((gf_ld16(bx + 2) >> (2 * unit)) & 3) << 4;
        dl = gf_h2f(gf_ld16(bx)) * (float)(ls - 32);
        int q[4];
        for (int i = 0; i < 4; i++)
            q[i] = *(const int *)(bx + 8 + 16 * unit + 4 * i);
        gf_iq4_unit(q, lo, hi);
    }
    __device__ float dot(const int8_t *aq, const gf_ads *ads) const {
        return dl * ads[u].x * (float)gf_dot32(lo, hi, aq + 32 * u);
    }
};

/* ==== the IQ2/IQ3 lattices: unit u is sub-block u of 32, its two halves'
 * codes and scales from gpu_quant.h's gq_iq_half ==== */
template <int T>
struct gf_iq {
    enum { BLK = 256, BYTES = gq_bsize(T), UNITS = 8, FLOAT = 0 };
    float dl[2];
    int v[2][4], u;
    __device__ void load(const uint8_t *bx, int unit) {
        u = unit;
        dl[0] = gq_iq_half<T>(bx, unit, 0, v[0]), dl[1] = gq_iq_half<T>(bx, unit, 1, v[1]);
    }
    /* Σ scale·code·a, half h's codes against the activation's codes ah */
    __device__ float sum(const int4 &a0, const int4 &a1) const {
        int s0 = gpu_dp4a(v[0][0], a0.x, gpu_dp4a(v[0][1], a0.y, gpu_dp4a(v[0][2], a0.z, gpu_dp4a(v[0][3], a0.w, 0))));
        int s1 = gpu_dp4a(v[1][0], a1.x, gpu_dp4a(v[1][1], a1.y, gpu_dp4a(v[1][2], a1.z, gpu_dp4a(v[1][3], a1.w, 0))));
        return dl[0] * (float)s0 + dl[1] * (float)s1;
    }
    __device__ float dot(const int8_t *aq, const gf_ads *ads) const {
        const int4 *a = (const int4 *)(aq + 32 * u);
        return ads[u].x * sum(a[0], a[1]);
    }
};

/* ==== the matrix-vector kernel ==== */

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

/* Experts side by side: block b (blk columns in bytes bytes) of group g's
 * row lies at the returned byte offset from its row's start in w[0] (in
 * its expert's matrix); *wt is that expert's weight. */
static __device__ __forceinline__ size_t gf_expert_block(const gf_mv &p, int g, int b, int blk, int bytes,
                                                         float *wt)
{
    int be = p.ne / blk, i = g * (p.n / p.ne) + b / be;
    *wt = p.sw[i];
    return (size_t)p.ids[i] * p.estride + (size_t)(b % be) * bytes;
}

/* Group g's matrix within a part: expert ids[g] of a stack, else the one
 * matrix (experts side by side: gf_expert_block places each block). */
static __device__ __forceinline__ size_t gf_group_off(const gf_mv &p, int g)
{
    return p.ids && !p.ne ? (size_t)p.ids[g] * p.estride : 0;
}

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

/* row r's y before the product, for gf_mv_store when accumulating (one-row
 * groups; 0 otherwise and past the end) */
static __device__ __forceinline__ float gf_mv_old(const gf_mv &p, int g, int r, int total)
{
    if (!p.accumulate || r >= total)
        return 0.0f;
    int rr, pt = gf_mv_part(p, r, &rr);
    return *gf_mv_at(p, pt, g, 0, rr);
}

/* The end of a round of the column-sliced kernels (gf_mvk_kernel,
 * gf_mvs_kernel), after their barrier: rows r0 + 0..RT-1 take the sums of
 * the S slices' warps (part: the round's half), added in slice order, times
 * scale (a handed-on norm's; else 1), and are stored by the first RT
 * threads (old: each one's row's y, read before). Returns the value the
 * thread stored (0: none). */
template <int SM, int RT>
static __device__ __forceinline__ float gf_slices_store(const gf_mv &p, const float (&part)[SM][RT], int S, int g,
                                                        int r0, int total, float old, float scale)
{
    if (threadIdx.x >= RT || r0 + (int)threadIdx.x >= total)
        return 0.0f;
    int r = r0 + threadIdx.x;
    float sum = part[0][threadIdx.x];
    for (int i = 1; i < S; i++)
        sum += part[i][threadIdx.x];
    sum = sum * scale;   /* (× 1 exactly where no norm is handed on) */
    int rr, pt = gf_mv_part(p, r, &rr);
    return gf_mv_store(p, pt, rr, gf_mv_at(p, pt, g, 0, rr), sum, old);
}

template <class Q, int NT>
static __device__ __forceinline__ void gf_mv_unit(const gf_mv &p, const Q &q, int b, size_t arow, int nt,
                                                  float *acc)
{
#pragma unroll
    for (int t = 0; t < NT; t++) {
        if (t < nt) {
            size_t row = arow + t;
            if constexpr (Q::FLOAT)
                acc[t] += q.dotf(p.af + row * p.n + (size_t)b * Q::BLK);
            else
                acc[t] += q.dot(p.aq + row * p.n + (size_t)b * Q::BLK,
                                p.ads + row * (p.n / GF_AB) + (size_t)b * Q::BLK / GF_AB);
        }
    }
}

/* The batched kernel (short prompts, and prompt matrices gpu_gemm does not
 * take): each warp takes R consecutive rows (they may straddle two matrices
 * of a launch) against NT tokens; per step a lane loads two units of each row
 * before using any, and the rows meet the same activation values (loaded
 * once: no stores between). */
template <class Q, int NT, int R>
__global__ void __launch_bounds__(GF_MV_WARPS * GPU_WARP) gf_mv_kernel(gf_mv p)
{
    GPU_TRACE(GT_MV);
    gf_pdl_begin();
    int warp = threadIdx.x / GPU_WARP, lane = threadIdx.x % GPU_WARP, g = blockIdx.y;
    int r0 = (blockIdx.x * GF_MV_WARPS + warp) * R, total = p.end[p.parts - 1];
    if (r0 >= total)
        return;
    int nt = p.t_total - g * NT;
    nt = nt < NT ? nt : NT;
    size_t arow = (size_t)(g / p.a_div) * p.a_g;
    const uint8_t *w[R];
    int part[R], rr[R];
#pragma unroll
    for (int j = 0; j < R; j++) {
        int r = r0 + j < total ? r0 + j : total - 1;   /* past the end: a copy of the last row, not written */
        part[j] = gf_mv_part(p, r, &rr[j]);
        w[j] = p.w[part[j]] + gf_group_off(p, g) + (size_t)rr[j] * p.ldw;
    }
    float acc[R][NT];
#pragma unroll
    for (int j = 0; j < R; j++)
#pragma unroll
        for (int t = 0; t < NT; t++)
            acc[j][t] = 0.0f;
    int units = p.n / Q::BLK * Q::UNITS;
    for (int i = lane; i < units; i += 2 * GPU_WARP) {
        int i1 = i + GPU_WARP;
        Q q0[R], q1[R];
#pragma unroll
        for (int j = 0; j < R; j++) {
            q0[j].load(w[j] + (size_t)(i / Q::UNITS) * Q::BYTES, i % Q::UNITS);
            if (i1 < units)
                q1[j].load(w[j] + (size_t)(i1 / Q::UNITS) * Q::BYTES, i1 % Q::UNITS);
        }
#pragma unroll
        for (int j = 0; j < R; j++) {
            gf_mv_unit<Q, NT>(p, q0[j], i / Q::UNITS, arow, nt, acc[j]);
            if (i1 < units)
                gf_mv_unit<Q, NT>(p, q1[j], i1 / Q::UNITS, arow, nt, acc[j]);
        }
    }
#pragma unroll
    for (int j = 0; j < R; j++)
#pragma unroll
        for (int t = 0; t < NT; t++) {
            float s = warp_sum(acc[j][t]);
            if (lane == 0 && t < nt && r0 + j < total)
                gf_mv_put(p, part[j], g, t, rr[j], s);
        }
}

/* ==== the staged decode kernel (one activation row per group) ====
 * Decode for the one-row products no kernel below takes (gf_mvk_kernel,
 * gf_mvs_kernel, gf_mvf_kernel): rows wider than those take or of widths
 * they do not tile, and the formats without a staged form side by side as
 * experts.
 * Decode streams every weight byte once: a warp copies GF_MV1_R rows'
 * bytes chunk by chunk into shared memory with aligned 16-byte loads
 * (fully coalesced whatever the block size: 34-byte Q8_0 blocks cost no
 * 2-byte global loads), and the next
 * chunk's loads are in flight while its lanes decode the current chunk from
 * shared memory with the unit structs above. A chunk of GF_MV1_CHUNK bytes
 * is one Q4_K row of 4096: the common rows take one or three chunks. On the
 * H200 it is bound by the unit decode and by re-reading the activation from
 * L1 for every row, not by the loads (BENCH.md). */
#define GF_MV1_WARPS 8
#define GF_MV1_R 2
#define GF_MV1_CHUNK 2304

template <class Q>
struct gf_mv1_shape {
    enum {
        CB = GF_MV1_CHUNK / Q::BYTES,                  /* weight blocks per chunk at most */
        NV = (CB * Q::BYTES + 15) / 16 + 1,            /* 16-byte vectors: the chunk, one more when unaligned */
        NVL = (NV + GPU_WARP - 1) / GPU_WARP           /* per lane */
    };
};

/* a weight byte read once: evict it first (the activation stays in L1) */
static __device__ __forceinline__ int4 gf_ld_stream(const int4 *p)
{
#ifdef GPU_CUDA
    return __ldcs(p);
#else
    return *p;
#endif
}

/* Chunk k of a row: its nbk blocks, the first of them block kb of the
 * activation's row, at byte off from the row's start, weighted by wt (1
 * but for experts side by side, where each expert's part of the row is cut
 * into cpe chunks of it alone). */
struct gf_chunk {
    int kb, nbk;
    size_t off;
    float wt;
};

template <class Q>
static __device__ __forceinline__ gf_chunk gf_mv1_chunk(const gf_mv &p, int g, int k, int cb, int cpe)
{
    gf_chunk c;
    if (!p.ne) {
        c.kb = k * cb, c.nbk = min(cb, p.n / Q::BLK - c.kb), c.off = (size_t)c.kb * Q::BYTES, c.wt = 1.0f;
    } else {
        int be = p.ne / Q::BLK, s = k % cpe;
        c.kb = k / cpe * be + s * cb, c.nbk = min(cb, be - s * cb);
        c.off = gf_expert_block(p, g, c.kb, Q::BLK, Q::BYTES, &c.wt);
    }
    return c;
}

/* Loads chunk c of the R rows at w[] into v: the 16-byte vectors that
 * cover it, so up to 15 bytes before and after it (at a row's end: still
 * inside the weights' 256-byte-aligned allocation). */
template <class Q>
static __device__ __forceinline__ void gf_mv1_fetch(int4 (&v)[GF_MV1_R][gf_mv1_shape<Q>::NVL],
                                                    const uint8_t *const (&w)[GF_MV1_R], const gf_chunk &c, int lane)
{
#pragma unroll
    for (int j = 0; j < GF_MV1_R; j++) {
        const uint8_t *s = w[j] + c.off;
        const int4 *a = (const int4 *)((uintptr_t)s & ~(uintptr_t)15);
        int nvec = ((int)((uintptr_t)s & 15) + c.nbk * Q::BYTES + 15) >> 4;
#pragma unroll
        for (int i = 0; i < gf_mv1_shape<Q>::NVL; i++)
            if (lane + i * GPU_WARP < nvec)
                v[j][i] = gf_ld_stream(a + lane + i * GPU_WARP);
    }
}

template <class Q>
__global__ void __launch_bounds__(GF_MV1_WARPS * GPU_WARP) gf_mv1_kernel(gf_mv p)
{
    /* the weights are no kernel's output unless expert ids choose them:
     * without ids the first chunk's loads go out before the wait */
    if (p.ids)
        gf_pdl_begin();
    typedef gf_mv1_shape<Q> S;
    __shared__ int4 sm[GF_MV1_WARPS][GF_MV1_R][S::NV];
    int warp = threadIdx.x / GPU_WARP, lane = threadIdx.x % GPU_WARP, g = blockIdx.y;
    int r0 = (blockIdx.x * GF_MV1_WARPS + warp) * GF_MV1_R, total = p.end[p.parts - 1];
    /* no early return: every warp takes part in the block's barriers; rows
     * past the end are copies of the last row, not written */
    size_t arow = (size_t)(g / p.a_div) * p.a_g;
    const int8_t *aq = p.aq + arow * p.n;
    const gf_ads *ads = p.ads + arow * (p.n / GF_AB);
    const float *af = p.af + arow * p.n;
    const uint8_t *w[GF_MV1_R];
    int part[GF_MV1_R], rr[GF_MV1_R];
#pragma unroll
    for (int j = 0; j < GF_MV1_R; j++) {
        int r = r0 + j < total ? r0 + j : total - 1;
        part[j] = gf_mv_part(p, r, &rr[j]);
        w[j] = p.w[part[j]] + gf_group_off(p, g) + (size_t)rr[j] * p.ldw;
    }
    /* balanced chunks of the row, or of each expert's part of it */
    int nb = p.ne ? p.ne / Q::BLK : p.n / Q::BLK, cpe = (nb + S::CB - 1) / S::CB, cb = (nb + cpe - 1) / cpe;
    int nch = p.ne ? cpe * (p.n / p.ne) : cpe;
    int4 v[GF_MV1_R][S::NVL];
    gf_chunk ck = gf_mv1_chunk<Q>(p, g, 0, cb, cpe);
    gf_mv1_fetch<Q>(v, w, ck, lane);
    if (!p.ids)
        gf_pdl_begin();
    float acc[GF_MV1_R], yo[GF_MV1_R];   /* yo: the rows' old y, read now (gf_mvk_kernel's yo) */
#pragma unroll
    for (int j = 0; j < GF_MV1_R; j++)
        acc[j] = 0.0f, yo[j] = lane == 0 ? gf_mv_old(p, g, r0 + j, total) : 0.0f;
    for (int k = 0; k < nch; k++) {
        int kb = ck.kb, nbk = ck.nbk;
        float wt = ck.wt;
        const uint8_t *sb[GF_MV1_R];
#pragma unroll
        for (int j = 0; j < GF_MV1_R; j++) {
            uintptr_t s = (uintptr_t)(w[j] + ck.off);
            int nvec = ((int)(s & 15) + nbk * Q::BYTES + 15) >> 4;
#pragma unroll
            for (int i = 0; i < S::NVL; i++)
                if (lane + i * GPU_WARP < nvec)
                    sm[warp][j][lane + i * GPU_WARP] = v[j][i];
            sb[j] = (const uint8_t *)sm[warp][j] + (s & 15);
        }
        __syncthreads();
        if (k + 1 < nch) {
            ck = gf_mv1_chunk<Q>(p, g, k + 1, cb, cpe);
            gf_mv1_fetch<Q>(v, w, ck, lane);
        }
        for (int u = lane; u < nbk * Q::UNITS; u += GPU_WARP) {
            int b = u / Q::UNITS;
            size_t bg = (size_t)kb + b;
#pragma unroll
            for (int j = 0; j < GF_MV1_R; j++) {
                Q q;
                q.load(sb[j] + b * Q::BYTES, u % Q::UNITS);
                if constexpr (Q::FLOAT)
                    acc[j] += wt * q.dotf(af + bg * Q::BLK);
                else
                    acc[j] += wt * q.dot(aq + bg * Q::BLK, ads + bg * Q::BLK / GF_AB);
            }
        }
        __syncthreads();
    }
#pragma unroll
    for (int j = 0; j < GF_MV1_R; j++) {
        float s = warp_sum(acc[j]);
        if (lane == 0 && r0 + j < total)
            gf_mv_store(p, part[j], rr[j], gf_mv_at(p, part[j], g, 0, rr[j]), s, yo[j]);
    }
}

/* ==== float weights, one row: F32, F16, BF16 ====
 * gf_mv1_kernel copied a float row through shared memory and met each
 * 16-byte piece with 32 bytes of the f32 activation re-read from L1. A
 * float row's pieces are 16-byte aligned (n a multiple of the piece, the
 * rows 16 bytes apart), so here each lane loads its pieces straight into
 * registers, GF_MVF_V a round, the warp's next round in flight while it
 * sums this one, and the block holds the activation row in shared memory,
 * read from global memory once. A warp takes one row at a time, rows
 * gridDim.x·GF_MVF_WARPS apart (one wave of blocks); the lanes' sums meet
 * by warp_sum. */
#define GF_MVF_WARPS 8
#define GF_MVF_V 8

template <class Q>
__global__ void __launch_bounds__(GF_MVF_WARPS * GPU_WARP) gf_mvf_kernel(gf_mv p)
{
    GPU_TRACE(GT_MVF);
    extern __shared__ float4 gf_mvf_x[];   /* the activation row, n floats */
    int warp = threadIdx.x / GPU_WARP, lane = threadIdx.x % GPU_WARP, g = blockIdx.y;
    int total = p.end[p.parts - 1], np = p.n / Q::BLK, rp = GPU_WARP * GF_MVF_V;   /* a row's pieces, a round's */
    int nrd = (np + rp - 1) / rp, r = blockIdx.x * GF_MVF_WARPS + warp, rstep = gridDim.x * GF_MVF_WARPS;
    size_t go = 0;   /* an expert stack's matrix: ids come from the kernel ahead, so after the wait */
    /* round rd of row r: its pieces rd·rp + lane + 32i */
    auto fetch = [&](int row, int rd, int4 (&v)[GF_MVF_V]) {
        int rr, pt = gf_mv_part(p, row, &rr), k0 = rd * rp + lane;
        const int4 *a = (const int4 *)(p.w[pt] + go + (size_t)rr * p.ldw) + k0;
#pragma unroll
        for (int i = 0; i < GF_MVF_V; i++)
            if (k0 + i * GPU_WARP < np)
                v[i] = gf_ld_stream(a + i * GPU_WARP);
    };
    int4 v[GF_MVF_V];
    if (!p.ids && r < total)
        fetch(r, 0, v);
    gf_pdl_begin();
    go = gf_group_off(p, g);
    if (p.ids && r < total)
        fetch(r, 0, v);
    const float4 *af = (const float4 *)(p.af + (size_t)(g / p.a_div) * p.a_g * p.n);
    for (int i = threadIdx.x; i < p.n / 4; i += blockDim.x)
        gf_mvf_x[i] = af[i];
    __syncthreads();
    const float *x = (const float *)gf_mvf_x;
    float acc = 0.0f;
    for (int rd = 0; r < total;) {
        int4 c[GF_MVF_V];
#pragma unroll
        for (int i = 0; i < GF_MVF_V; i++)
            c[i] = v[i];
        int nr = r, nd = rd + 1;   /* the next round: this row's, or the warp's next row's first */
        if (nd == nrd)
            nr = r + rstep, nd = 0;
        if (nr < total)
            fetch(nr, nd, v);
        int k0 = rd * rp + lane;
#pragma unroll
        for (int i = 0; i < GF_MVF_V; i++)
            if (k0 + i * GPU_WARP < np) {
                Q q;
                q.set(c[i]);
                acc += q.dotf(x + (size_t)(k0 + i * GPU_WARP) * Q::BLK);
            }
        if (nd == 0) {
            float s = warp_sum(acc);
            int rr, pt = gf_mv_part(p, r, &rr);
            if (lane == 0)
                gf_mv_put(p, pt, g, 0, rr, s);
            acc = 0.0f;
        }
        r = nr, rd = nd;
    }
}

/* ==== few rows: a block a row ====
 * A decode product with too few rows to give the staged kernel a block per
 * SM (a MoE's router: 128 rows) takes a block per row instead, its threads
 * across the row's units, so that a row costs one round trip to memory,
 * not one per chunk. The block's sums meet in shared memory, warp by warp
 * in a fixed order. */
#define GF_ROW_THREADS 256
#define GF_ROW_NU 2   /* units a thread loads at once */

/* Units u0, u0 + GF_ROW_THREADS, ... (GF_ROW_NU of them, loaded together)
 * of row w into q, each expert's weight into wt; the last unit stands in
 * past the end (computed, not added). */
template <class Q>
static __device__ __forceinline__ void gf_mvrow_load(const gf_mv &p, const uint8_t *w, int g, int u0, int nu,
                                                     Q (&q)[GF_ROW_NU], float (&wt)[GF_ROW_NU])
{
#pragma unroll
    for (int k = 0; k < GF_ROW_NU; k++) {
        int u = min(u0 + k * GF_ROW_THREADS, nu - 1), b = u / Q::UNITS;
        wt[k] = 1.0f;
        q[k].load(w + (p.ne ? gf_expert_block(p, g, b, Q::BLK, Q::BYTES, &wt[k]) : (size_t)b * Q::BYTES),
                  u % Q::UNITS);
    }
}

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

template <class Q>
__global__ void __launch_bounds__(GF_ROW_THREADS) gf_mvrow_kernel(gf_mv p)
{
    GPU_TRACE(GT_MVROW);
    int r = blockIdx.x, g = blockIdx.y;
    int rr, pt = gf_mv_part(p, r, &rr), nu = p.n / Q::BLK * Q::UNITS;
    const uint8_t *w = p.w[pt] + (size_t)rr * p.ldw;
    Q q[GF_ROW_NU];
    float wt[GF_ROW_NU];
    /* the weights are no kernel's output, unless expert ids choose them:
     * the first units' loads go out before the wait */
    if (!p.ids)
        gf_mvrow_load<Q>(p, w, g, threadIdx.x, nu, q, wt);
    gf_pdl_begin();
    w += gf_group_off(p, g);
    size_t arow = (size_t)(g / p.a_div) * p.a_g;
    float acc = 0.0f;
    /* added in the order of u */
    for (int u0 = threadIdx.x; u0 < nu; u0 += GF_ROW_NU * GF_ROW_THREADS) {
        if (p.ids || u0 != (int)threadIdx.x)
            gf_mvrow_load<Q>(p, w, g, u0, nu, q, wt);
#pragma unroll
        for (int k = 0; k < GF_ROW_NU; k++) {
            int u = min(u0 + k * GF_ROW_THREADS, nu - 1), b = u / Q::UNITS;
            float d;
            if constexpr (Q::FLOAT)
                d = q[k].dotf(p.af + arow * p.n + (size_t)b * Q::BLK);
            else
                d = q[k].dot(p.aq + arow * p.n + (size_t)b * Q::BLK,
                             p.ads + arow * (p.n / GF_AB) + (size_t)b * Q::BLK / GF_AB);
            if (u0 + k * GF_ROW_THREADS < nu)
                acc += wt[k] * d;
        }
    }
    float sum = gf_block_sumf<GF_ROW_THREADS>(acc);
    if (threadIdx.x == 0)
        gf_mv_put(p, pt, g, 0, rr, sum);
}

/* ==== the Q4_K decode kernel: the activation held in registers ====
 * With int8 activations a matrix-vector product reads one activation byte
 * per weight (twice the bytes of a Q4_K weight) from L1; re-reading it for
 * every row made L1, not memory, the limit of the kernels above. Here each
 * lane keeps the activation of its column units in registers for the whole
 * kernel (UL units of 64 columns: 16 words of codes and two blocks' scales
 * each) and streams rows past it: per round a warp takes R rows' units (the
 * 16-byte header and the 32 bytes of codes of each), and the next round's
 * loads are issued before this round's arithmetic. The first round's loads
 * go out before the kernel waits for the one ahead (weights are no kernel's
 * output), so they overlap its tail and the activation work. Rows wider
 * than 32·UL units are cut into S column slices of GF_MVK_SUB warps each
 * (of half as many past GF_MVK_SMAX slices: gf_mvk_sub); a round's partial
 * sums meet in shared memory and are added in slice order (deterministic).
 * The grid is sized to the resident blocks and walks the row tiles; a
 * product that hands on a norm (gf_mv.nw) runs a block for each 32 rows
 * instead (or a pair, gf_pair_meet), which writes their int8 block at its
 * end.
 * (Quantising the activation in each block instead of in gf_act_kernel
 * before it was tried: slower on the H200, BENCH.md.) */
#define GF_MVK_SUB 4     /* warps per column slice: a tile is GF_MVK_SUB·R rows (2 measured no faster) */
#define GF_MVK_SMAX 4    /* slices of GF_MVK_SUB warps: rows of up to 4 · 2 · 32 units of 64 = 16384 columns */
#define GF_MVK_WIDE 8    /* most slices, of GF_MVK_SUB / 2 warps past GF_MVK_SMAX: up to 32768 columns */

/* the warps of a slice in a block of S slices: a block holds at most
 * GF_MVK_SMAX · GF_MVK_SUB warps, so the wider rows (a Qwen3-32B's or a
 * Llama-3-70B's ffn_down, 25,600 and 28,672 columns) run tiles of half the
 * rows on more slices of fewer warps */
static constexpr __host__ __device__ int gf_mvk_sub(int S)
{
    return S <= GF_MVK_SMAX ? GF_MVK_SUB : GF_MVK_SUB / 2;
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

/* The handed-on norm's scale (gf_mv.ss), the same in every lane and block
 * (warp_sum's butterfly adds the same two operands in both lanes of a
 * pair). The sums are floats, not the activation kernel's doubles: a
 * double's shuffles and adds took ~0.3 µs more on the chain (BENCH.md,
 * twenty-fourth pass), and a float sum of 4096 squares is within 1e-5 of it. */
static __device__ __forceinline__ float gf_ss_scale(const gf_mv &p)
{
    float a = 0.0f;
    for (int i = threadIdx.x % GPU_WARP; i < p.ss_n; i += GPU_WARP)
        a += p.ss[i];
    return gf_rms_scale((double)warp_sum(a), p.n, p.eps);
}

/* The end of a product that hands on a norm (gf_mv.nw), in warp 0 of the
 * block that owns rows r0..r0+GF_AB-1: v, lane i's row of x as stored,
 * w its norm weight (lanes past GF_AB, on 64-wide wavefronts, zeros);
 * writes the block of x·w's int8 codes and the squares' sum, as
 * gf_act_kernel would write the block of RMSNorm(x)·w but for the row's
 * scale. The shuffles stay within each 32 lanes. */
static __device__ __forceinline__ void gf_norm_out(const gf_mv &p, int r0, float v, float w)
{
    float ss = __fmul_rn(v, v), u[1] = {__fmul_rn(v, w)};
    for (int m = GF_AB / 2; m > 0; m >>= 1)
        ss += gpu_shfl_xor(ss, m);
    int q[1];
    gf_ads sc = gq_q8_act<1>(u, q);
    int lane = threadIdx.x % GPU_WARP;
    if (lane < GF_AB)
        p.nq[r0 + lane] = (int8_t)q[0];
    if (lane == 0)
        p.nds[r0 / GF_AB] = sc, p.nss[r0 / GF_AB] = ss;
}

enum { GF_NORM_NONE, GF_NORM_OUT, GF_NORM_IN };   /* a column-sliced kernel's part in a handed-on norm (gf_mv.nw, .ss) */

/* A norm-handing product's blocks in pairs (gf_mv.pair: a thread block
 * cluster of two, CUDA sm_90): each GF_AB rows are two blocks' work, the
 * first half's and the second's, so that a product of few such groups (the
 * 30B-A3B's experts' down: 64) streams on twice the SMs. At the end the
 * second block hands its rows to the first's shared memory, which forms
 * their block of x·w as one block would: the same sums, bit for bit. Every
 * thread arrives at the pair's barrier as the kernel starts and waits there
 * before the handing-over, so that neither writes into the other's shared
 * memory before it runs. */
static __device__ __forceinline__ void gf_pair_begin(const gf_mv &p)
{
#if defined(GPU_CUDA) && defined(__CUDA_ARCH__) && __CUDA_ARCH__ >= 900
    if (p.pair)
        asm volatile("barrier.cluster.arrive.relaxed;" ::: "memory");
#else
    (void)p;
#endif
}

/* The pair's meeting at the product's end (every thread of both blocks):
 * whether this block forms its GF_AB rows' norm block, with the second
 * block's rows now in xo[GF_AB / 2 ..] (the first of a pair; any block
 * without pairs). */
static __device__ __forceinline__ bool gf_pair_meet(const gf_mv &p, float *xo)
{
#if defined(GPU_CUDA) && defined(__CUDA_ARCH__) && __CUDA_ARCH__ >= 900
    if (!p.pair)
        return true;
    unsigned rank, lane = threadIdx.x % GPU_WARP;
    asm volatile("mov.u32 %0, %%cluster_ctarank;" : "=r"(rank));
    asm volatile("barrier.cluster.wait;" ::: "memory");   /* both blocks run */
    if (rank == 1 && threadIdx.x < GPU_WARP) {
        gpu_syncwarp();   /* (the rows were stored by this warp's lanes) */
        if (lane >= GF_AB / 2) {   /* (sm_90: 32 lanes, GF_AB) */
            unsigned a = (unsigned)__cvta_generic_to_shared(xo + lane), r;
            asm volatile("mapa.shared::cluster.u32 %0, %1, 0;" : "=r"(r) : "r"(a));
            asm volatile("st.shared::cluster.f32 [%0], %1;" ::"r"(r), "f"(xo[lane]) : "memory");
        }
    }
    asm volatile("barrier.cluster.arrive.release;\n\tbarrier.cluster.wait.acquire;" ::: "memory");
    return rank == 0;
#else
    (void)p, (void)xo;
    return true;
#endif
}

/* A column-sliced kernel's tiles of RT rows: every nbx-th from bx (block
 * bx of the product's nbx: blockIdx.x of gridDim.x but where two products
 * share a launch, gf_mv2_kernel), or, where it hands on a norm, its block's
 * GF_AB rows one after the other (the grid: a block for each GF_AB rows),
 * or its half of them (pairs). Returns the first row of the block's first
 * tile, or of its GF_AB rows where it hands on a norm. */
template <int NORM, int RT>
static __device__ __forceinline__ int gf_block_tiles(const gf_mv &p, int bx, int nbx, int tiles, int *tile, int *step,
                                                     int *end)
{
    *tile = bx, *step = nbx, *end = tiles;
    if (NORM != GF_NORM_OUT)
        return *tile * RT;
    gf_pair_begin(p);
    int group = bx >> p.pair, per = (GF_AB / RT) >> p.pair;
    *tile = group * (GF_AB / RT) + (bx & p.pair) * per, *step = 1, *end = min(*tile + per, tiles);
    return group * GF_AB;
}

/* A norm-handing block's norm weight for lane's row of its GF_AB rows from
 * r0 (warp 0's lanes; 0 elsewhere and in the other forms) */
template <int NORM>
static __device__ __forceinline__ float gf_block_norm_w(const gf_mv &p, int r0, int total)
{
    int lane = threadIdx.x % GPU_WARP;
    return NORM == GF_NORM_OUT && threadIdx.x < GPU_WARP && lane < GF_AB && r0 + lane < total ? p.nw[r0 + lane]
                                                                                              : 0.0f;
}

/* A norm-handing block's end: warp 0, whose first RT threads stored the
 * block's rows from r0 into xo round by round, hands them on (gf_norm_out;
 * nw: the norm weight of lane's row, read at the start). */
static __device__ __forceinline__ void gf_block_norm_out(const gf_mv &p, int r0, int total, float *xo, float nw)
{
    int lane = threadIdx.x % GPU_WARP;
    if (!gf_pair_meet(p, xo) || threadIdx.x >= GPU_WARP || r0 >= total)
        return;
    gpu_syncwarp();   /* (the rows were stored by this warp's lanes) */
    gf_norm_out(p, r0, lane < GF_AB ? xo[lane] : 0.0f, nw);
}

/* the R rows from r0 (the last row past the end), each unit k at byte uo[k]
 * of its row (its superblock's; ub[k] & 3 the pair in it) */
template <int UL, int R>
static __device__ __forceinline__ void gf_mvk_fetch(const gf_mv &p, int r0, int total, const size_t (&uo)[UL],
                                                    const int (&ub)[UL], int4 (&h)[R][UL], int4 (&q)[R][UL][2])
{
#pragma unroll
    for (int j = 0; j < R; j++) {
        int r = r0 + j < total ? r0 + j : total - 1;
        int rr, pt = gf_mv_part(p, r, &rr);
        const uint8_t *w = p.w[pt] + (size_t)rr * p.ldw;
#pragma unroll
        for (int k = 0; k < UL; k++) {
            const int4 *b = (const int4 *)(w + uo[k]);
            h[j][k] = gf_ld_stream(b);
            q[j][k][0] = gf_ld_stream(b + 1 + 2 * (ub[k] & 3));
            q[j][k][1] = gf_ld_stream(b + 2 + 2 * (ub[k] & 3));
        }
    }
}

/* Launch bounds: one slice (UL 1 but for a norm-handing product, which
 * takes UL 1 at several slices) at five blocks an SM, whose registers the
 * taking kernel's scale would otherwise push to four (the 30B-A3B's q/k/v,
 * 640 tiles, then runs a second round on a fifth of its blocks) */
#define GF_MVK_ONE(UL, NORM) ((UL) == 1 && (NORM) != GF_NORM_OUT)

/* gf_mvk_kernel's rows a tile: 2 / UL a warp, SUB warps a slice */
static constexpr __host__ __device__ int gf_mvk_rt(int UL, int SUB)
{
    return SUB * (2 / UL);
}

/* gf_mvk_kernel's block bx of the product's nbx (gf_block_tiles), its
 * slices of SUB warps (gf_mvk_sub) */
template <int UL, int NORM, int SUB>
static __device__ __forceinline__ void gf_mvk_run(const gf_mv &p, int bx, int nbx)
{
    enum { R = 2 / UL, RT = gf_mvk_rt(UL, SUB) };
    __shared__ float part[2][GF_MVK_SMAX * GF_MVK_SUB / SUB][RT];
    int warp = threadIdx.x / GPU_WARP, lane = threadIdx.x % GPU_WARP, g = blockIdx.y;
    int slice = warp / SUB, sub = warp % SUB, S = blockDim.x / (SUB * GPU_WARP);
    int U = p.n / 256 * 4, total = p.end[p.parts - 1], tiles = (total + RT - 1) / RT;
    /* this lane's units: u = (slice·UL + k)·32 + lane, superblock u/4, pair u%4 */
    int ub[UL];
    bool ok[UL];
    size_t uo[UL];
#pragma unroll
    for (int k = 0; k < UL; k++) {
        int u = (slice * UL + k) * GPU_WARP + lane;
        ok[k] = u < U;
        ub[k] = ok[k] ? u : 0;
        uo[k] = (size_t)(ub[k] >> 2) * 144;
    }
    int4 wh[R][UL], wq[R][UL][2];
    /* the block's tiles: every nbx-th from bx; a block's GF_AB
     * rows (or their half, in pairs) one after the other where it hands on a norm */
    int tile, step, end, r0 = gf_block_tiles<NORM, RT>(p, bx, nbx, tiles, &tile, &step, &end);
    float nw = gf_block_norm_w<NORM>(p, r0, total);
    if (!p.ids && tile < end)   /* expert ids come from the kernel ahead: wait for them first */
        gf_mvk_fetch<UL, R>(p, tile * RT + sub * R, total, uo, ub, wh, wq);
    gf_pdl_begin();
    size_t arow = (size_t)(g / p.a_div) * p.a_g;
    float uw[UL];   /* the units' expert weights (1 but side by side) */
    size_t eo = gf_group_off(p, g);
#pragma unroll
    for (int k = 0; k < UL; k++) {
        uw[k] = 1.0f;
        uo[k] = p.ne ? gf_expert_block(p, g, ub[k] >> 2, 256, 144, &uw[k]) : uo[k] + eo;
    }
    if (p.ids && tile < tiles)
        gf_mvk_fetch<UL, R>(p, tile * RT + sub * R, total, uo, ub, wh, wq);
    int4 xa[UL][4];
    gf_ads xs[UL][2];
    const int4 *aq = (const int4 *)(p.aq + arow * p.n);
    const gf_ads *ads = p.ads + arow * (p.n / GF_AB);
#pragma unroll
    for (int k = 0; k < UL; k++) {
#pragma unroll
        for (int i = 0; i < 4; i++)
            xa[k][i] = aq[4 * ub[k] + i];
        xs[k][0] = ads[2 * ub[k]], xs[k][1] = ads[2 * ub[k] + 1];
        xs[k][0].x *= uw[k], xs[k][1].x *= uw[k];   /* the expert's weight rides on the activation's scale */
    }
    /* the old y of the rows a thread writes (accumulating), read a round
     * ahead: its round trip overlaps a round's work rather than following
     * the round's barrier on the writing warp, which the next barrier waits
     * for */
    int writer = threadIdx.x < RT;
    float yo = writer && tile < end ? gf_mv_old(p, g, tile * RT + threadIdx.x, total) : 0.0f;
    float scale = NORM == GF_NORM_IN && warp == 0 ? gf_ss_scale(p) : 1.0f;   /* (the writers are warp 0's) */
    __shared__ float xo[GF_AB];   /* a norm handed on: the block's rows as stored */
    for (int round = 0; tile < end; tile += step, round++) {
        int4 nh[R][UL], nq[R][UL][2];
        float yn = 0.0f;
        if (tile + step < end) {
            gf_mvk_fetch<UL, R>(p, (tile + step) * RT + sub * R, total, uo, ub, nh, nq);
            if (writer)
                yn = gf_mv_old(p, g, (tile + step) * RT + threadIdx.x, total);
        }
        float acc[R];
#pragma unroll
        for (int j = 0; j < R; j++) {
            acc[j] = 0.0f;
#pragma unroll
            for (int k = 0; k < UL; k++)
                if (ok[k])
                    acc[j] += gf_q4k_pair(wh[j][k], wq[j][k], xa[k], xs[k], lane & 3);   /* u%4 == lane%4 */
        }
#pragma unroll
        for (int j = 0; j < R; j++) {
            float sum = warp_sum(acc[j]);
            if (lane == 0)
                part[round & 1][slice][sub * R + j] = sum;
        }
        __syncthreads();   /* one barrier a round: the next round writes the other half of part */
        float y = gf_slices_store(p, part[round & 1], S, g, tile * RT, total, yo, scale);
        if (NORM == GF_NORM_OUT && writer)
            xo[tile * RT - r0 + threadIdx.x] = y;
        yo = yn;
#pragma unroll
        for (int j = 0; j < R; j++)
#pragma unroll
            for (int k = 0; k < UL; k++)
                wh[j][k] = nh[j][k], wq[j][k][0] = nq[j][k][0], wq[j][k][1] = nq[j][k][1];
    }
    if (NORM == GF_NORM_OUT)
        gf_block_norm_out(p, r0, total, xo, nw);
}

template <int UL, int NORM, int SUB>
__global__ void __launch_bounds__(GF_MVK_ONE(UL, NORM) ? SUB * GPU_WARP : GF_MVK_SMAX * GF_MVK_SUB * GPU_WARP,
                                  GF_MVK_ONE(UL, NORM) ? 5 : 1) gf_mvk_kernel(gf_mv p)
{
    GPU_TRACE(GT_MVK);
    gf_mvk_run<UL, NORM, SUB>(p, blockIdx.x, gridDim.x);
}

/* ==== the decode kernel of the other formats: staged rows, the activation in registers ====
 * Q6_K's 210-byte and Q8_0's 34-byte blocks (Q3_K's 110, IQ4_NL's 18) leave
 * a unit's bytes 2-aligned, so their rows cannot be loaded into registers
 * unit by unit as gf_mvk_kernel loads Q4_K's. Here a warp loads its row's slice with
 * aligned 16-byte loads (a round ahead, as gf_mvk_kernel's), stages it in
 * its own shared memory, and each lane decodes its units from there
 * against the activation it holds in registers for the whole kernel:
 * gf_mv1_kernel re-read the activation from L1 for every row and was
 * L1-bound (BENCH.md, thirteenth pass). A lane's unit is 64 columns, its
 * activation four 16-byte pieces (their blocks' scales, and the sums of
 * their codes, which take Q6_K's offset of 32 out of the products). Tiles,
 * slices, rounds and the store are gf_mvk_kernel's, and so are the forms of
 * a handed-on norm (NORM; the common files' formats, gf_mvs_hands):
 * Q4_K_M's layers of more bits and Q8_0 files take the handoff too
 * (BENCH.md, twenty-eighth pass). */

/* Q6_K: unit u is half h = u % 4 / 2 of superblock u / 4, columns 128h +
 * 32i + 16j + 0..15 (j = u % 2, quarter i = 0..3: quant.c's k6_unpack) */
struct gf_mvs_q6_K {
    enum { SB = 210, UPS = 4 };   /* bytes and units of a superblock (256 columns) */
    static __device__ int col(int u, int i) { return 256 * (u / 4) + 128 * (u % 4 / 2) + 16 * (u % 2) + 32 * i; }
    /* the unit's product, its superblock's bytes at b */
    static __device__ float dot(const uint8_t *b, int u, const int4 (&xa)[4], const float (&xd)[4],
                                const int (&xs)[4])
    {
        int h = u % 4 / 2, j = u % 2;
        float sum = 0.0f;
#pragma unroll
        for (int i = 0; i < 4; i++) {
            const int *xi = (const int *)&xa[i];
            int s = 0;
#pragma unroll
            for (int w = 0; w < 4; w++) {
                int lo = gf_ld32h(b + 64 * h + 32 * (i % 2) + 16 * j + 4 * w);
                int hi = gf_ld32h(b + 128 + 32 * h + 16 * j + 4 * w);
                int q = ((lo >> (4 * (i / 2))) & 0x0F0F0F0F) | (((hi >> (2 * i)) << 4) & 0x30303030);
                s = gpu_dp4a(q, xi[w], s);
            }
            float sc = (float)(int8_t)b[192 + 8 * h + 2 * i + j];
            sum += sc * xd[i] * (float)(s - 32 * xs[i]);
        }
        return gf_h2f(gf_ld16(b + 208)) * sum;
    }
};

/* Q8_0: unit u is blocks 2u, 2u + 1 (68 bytes from b) */
struct gf_mvs_q8_0 {
    enum { SB = 272, UPS = 4 };
    static __device__ int col(int u, int i) { return 64 * u + 16 * i; }
    static __device__ float dot(const uint8_t *b, int u, const int4 (&xa)[4], const float (&xd)[4],
                                const int (&)[4])
    {
        b += 68 * (u % 4);
        float sum = 0.0f;
#pragma unroll
        for (int k = 0; k < 2; k++) {
            const int *x = (const int *)&xa[2 * k];
            int s = 0;
#pragma unroll
            for (int w = 0; w < 8; w++)
                s = gpu_dp4a(gf_ld32h(b + 34 * k + 2 + 4 * w), x[w], s);
            sum += gf_h2f(gf_ld16(b + 34 * k)) * xd[2 * k] * (float)s;
        }
        return sum;
    }
};

/* Q2_K and Q3_K: Q6_K's units (gf_q2_K's: the four planes of 16 bytes of
 * qs, half h = u % 2 of the half n = u % 4 / 2), the sums of the pieces'
 * codes for Q2_K's mins and Q3_K's offset of 4 */
struct gf_mvs_q2_K {
    enum { SB = 84, UPS = 4 };
    static __device__ int col(int u, int i) { return gf_mvs_q6_K::col(u, i); }
    static __device__ float dot(const uint8_t *b, int u, const int4 (&xa)[4], const float (&xd)[4],
                                const int (&xs)[4])
    {
        int n = u % 4 / 2, h = u % 2, q[4];
        for (int w = 0; w < 4; w++)
            q[w] = *(const int *)(b + 16 + 32 * n + 16 * h + 4 * w);
        float d = gf_h2f(gf_ld16(b + 80)), dmin = gf_h2f(gf_ld16(b + 82)), sum = 0.0f;
#pragma unroll
        for (int i = 0; i < 4; i++) {
            const int *x = (const int *)&xa[i];
            int s = 0;
            for (int w = 0; w < 4; w++)
                s = gpu_dp4a((q[w] >> (2 * i)) & 0x03030303, x[w], s);
            int sc = b[8 * n + 2 * i + h];
            sum += xd[i] * (d * (float)(sc & 15) * (float)s - dmin * (float)(sc >> 4) * (float)xs[i]);
        }
        return sum;
    }
};

struct gf_mvs_q3_K {
    enum { SB = 110, UPS = 4 };
    static __device__ int col(int u, int i) { return gf_mvs_q6_K::col(u, i); }
    static __device__ float dot(const uint8_t *b, int u, const int4 (&xa)[4], const float (&xd)[4],
                                const int (&xs)[4])
    {
        int n = u % 4 / 2, h = u % 2, q[4], hm[4];
        for (int w = 0; w < 4; w++) {
            q[w] = gf_ld32h(b + 32 + 32 * n + 16 * h + 4 * w);
            hm[w] = gf_ld32h(b + 16 * h + 4 * w);
        }
        float d = gf_h2f(gf_ld16(b + 108)), sum = 0.0f;
#pragma unroll
        for (int i = 0; i < 4; i++) {
            const int *x = (const int *)&xa[i];
            int s = 0;
            for (int w = 0; w < 4; w++)
                s = gpu_dp4a(((q[w] >> (2 * i)) & 0x03030303) | (((hm[w] >> (4 * n + i)) & 0x01010101) << 2), x[w],
                             s);
            sum += xd[i] * d * (float)gf_q3k_scale(b, 8 * n + 2 * i + h) * (float)(s - 4 * xs[i]);
        }
        return sum;
    }
};

/* Q4_0, Q5_0, Q4_1 and Q5_1 (QH: a fifth bit a code; MIN: a min after
 * the scale; BB = 18, 22, 20 or 24 bytes a block): Q8_0's units, blocks 2u
 * and 2u + 1 of a "superblock" of eight; each block's codes as gf_q4_0's
 * and gf_q5_0's, their offset of 8 or 16 taken out of the sum, or the min
 * times the activation's sum added, with the pieces' sums of codes */
template <int BB, bool QH, bool MIN>
struct gf_mvs_q4 {
    enum { SB = 8 * BB, UPS = 4 };
    static __device__ int col(int u, int i) { return gf_mvs_q8_0::col(u, i); }
    static __device__ float dot(const uint8_t *b, int u, const int4 (&xa)[4], const float (&xd)[4],
                                const int (&xs)[4])
    {
        b += 2 * BB * (u % 4);
        if constexpr (MIN)
            return dot_min(b, xa, xd, xs);
        float sum = 0.0f;
#pragma unroll
        for (int k = 0; k < 2; k++) {
            const uint8_t *bk = b + BB * k;
            int q[4], lo[4], hi[4];
            for (int w = 0; w < 4; w++)
                q[w] = gf_ld32h(bk + BB - 16 + 4 * w);
            gf_nibbles(q, QH ? (uint32_t)gf_ld32h(bk + 2) : 0u, lo, hi);
            int s = gf_dot32a(lo, hi, xa[2 * k], xa[2 * k + 1]), sc = xs[2 * k] + xs[2 * k + 1];
            sum += gf_h2f(gf_ld16(bk)) * xd[2 * k] * (float)(s - (QH ? 16 : 8) * sc);
        }
        return sum;
    }
    /* Q4_1 and Q5_1: the pair's 2·BB bytes (4-aligned blocks) in as few
     * loads as their alignment allows. A lane's pair is 40 or 48 bytes past
     * its neighbour's, 10 or 12 banks: 4-byte loads of Q5_1's conflict four
     * ways; 8-byte ones of Q4_1's and 16-byte ones of Q5_1's not at all
     * (rows less aligned than those take narrower loads, gf_ldw). */
    static __device__ float dot_min(const uint8_t *b, const int4 (&xa)[4], const float (&xd)[4], const int (&xs)[4])
    {
        enum { W = BB / 4 };   /* words a block */
        uint32_t w[2 * W];
        gf_ldw(w, b);
        float sum = 0.0f;
#pragma unroll
        for (int k = 0; k < 2; k++) {
            const uint32_t *bw = w + W * k;   /* d and m, (Q5_1: qh,) 16 bytes of codes */
            int q[4], lo[4], hi[4];
            for (int i = 0; i < 4; i++)
                q[i] = (int)bw[W - 4 + i];
            gf_nibbles(q, QH ? bw[1] : 0u, lo, hi);
            int s = gf_dot32a(lo, hi, xa[2 * k], xa[2 * k + 1]), sc = xs[2 * k] + xs[2 * k + 1];
            sum += xd[2 * k] * (gf_h2f((uint16_t)bw[0]) * (float)s + gf_h2f((uint16_t)(bw[0] >> 16)) * (float)sc);
        }
        return sum;
    }
};

/* Q5_K: unit u is the sub-block pair p = u % 4 of superblock u / 4 (Q4_K's
 * pair: 32 bytes of nibbles, low for sub-block 2p, high for 2p + 1), the
 * fifth bits 2p and 2p + 1 of qh's 32 bytes; its scales and mins as
 * gf_q4k_scales cuts them from the header's four words */
struct gf_mvs_q5_K {
    enum { SB = 176, UPS = 4 };
    static __device__ int col(int u, int i) { return 256 * (u / 4) + 64 * (u % 4) + 16 * i; }
    static __device__ float dot(const uint8_t *b, int u, const int4 (&xa)[4], const float (&xd)[4],
                                const int (&xs)[4])
    {
        const int *bw = (const int *)b;   /* (176-byte superblocks: 4-aligned) */
        const int ax[8] = {xa[0].x, xa[0].y, xa[0].z, xa[0].w, xa[1].x, xa[1].y, xa[1].z, xa[1].w};
        const int ay[8] = {xa[2].x, xa[2].y, xa[2].z, xa[2].w, xa[3].x, xa[3].y, xa[3].z, xa[3].w};
        int p = u % 4, s0 = 0, s1 = 0;
#pragma unroll
        for (int w = 0; w < 8; w++) {
            int q = bw[12 + 8 * p + w], h = bw[4 + w];
            s0 = gpu_dp4a((q & 0x0F0F0F0F) | (((h >> (2 * p)) & 0x01010101) << 4), ax[w], s0);
            s1 = gpu_dp4a(((q >> 4) & 0x0F0F0F0F) | (((h >> (2 * p + 1)) & 0x01010101) << 4), ay[w], s1);
        }
        uint32_t sc, mn;
        gf_q4k_scales(make_int4(bw[0], bw[1], bw[2], bw[3]), p, &sc, &mn);
        float d = gf_h2f((uint16_t)((uint32_t)bw[0] & 0xffff)), dmin = gf_h2f((uint16_t)((uint32_t)bw[0] >> 16));
        float dl = d * (float)(int)(sc & 0xff), dh = d * (float)(int)(sc >> 8);
        float ml = dmin * (float)(int)(mn & 0xff), mh = dmin * (float)(int)(mn >> 8);
        return xd[0] * (dl * (float)s0 - ml * (float)(xs[0] + xs[1])) +
               xd[2] * (dh * (float)s1 - mh * (float)(xs[2] + xs[3]));
    }
};

/* IQ4_XS and IQ4_NL: unit u is 64 columns from 64u (Q8_0's), two
 * sub-blocks of 32, each a piece of low nibbles and one of high ones.
 * gf_iq4_dot: a sub-block's Σ value·code, its 16 bytes of codes in q, the
 * activation's pieces of its low and high nibbles in al and ah. */
static __device__ __forceinline__ int gf_iq4_dot(const int (&q)[4], const int4 &al, const int4 &ah)
{
    int lo[4], hi[4];
    gf_iq4_unit(q, lo, hi);
    return gf_dot32a(lo, hi, al, ah);
}

struct gf_mvs_iq4_xs {
    enum { SB = 136, UPS = 4 };
    static __device__ int col(int u, int i) { return gf_mvs_q8_0::col(u, i); }
    static __device__ float dot(const uint8_t *b, int u, const int4 (&xa)[4], const float (&xd)[4],
                                const int (&)[4])
    {
        float sum = 0.0f;
#pragma unroll
        for (int k = 0; k < 2; k++) {
            int sb = 2 * (u % 4) + k, q[4];
            int ls = ((b[4 + sb / 2] >> (4 * (sb & 1))) & 15) | ((gf_ld16(b + 2) >> (2 * sb)) & 3) << 4;
            for (int w = 0; w < 4; w++)
                q[w] = *(const int *)(b + 8 + 16 * sb + 4 * w);
            sum += gf_h2f(gf_ld16(b)) * (float)(ls - 32) * xd[2 * k] * (float)gf_iq4_dot(q, xa[2 * k], xa[2 * k + 1]);
        }
        return sum;
    }
};

struct gf_mvs_iq4_nl {
    enum { SB = 144, UPS = 4 };
    static __device__ int col(int u, int i) { return gf_mvs_q8_0::col(u, i); }
    static __device__ float dot(const uint8_t *b, int u, const int4 (&xa)[4], const float (&xd)[4],
                                const int (&)[4])
    {
        b += 36 * (u % 4);
        float sum = 0.0f;
#pragma unroll
        for (int k = 0; k < 2; k++) {
            int q[4];
            for (int w = 0; w < 4; w++)
                q[w] = gf_ld32h(b + 18 * k + 2 + 4 * w);
            sum += gf_h2f(gf_ld16(b + 18 * k)) * xd[2 * k] * (float)gf_iq4_dot(q, xa[2 * k], xa[2 * k + 1]);
        }
        return sum;
    }
};

/* the lattices: unit u is 64 columns from 64u (Q8_0's), sub-blocks
 * 2(u % 4) and 2(u % 4) + 1 of the superblock, each gf_iq's */
template <int T>
struct gf_mvs_iq {
    enum { SB = gq_bsize(T), UPS = 4 };
    static __device__ int col(int u, int i) { return gf_mvs_q8_0::col(u, i); }
    static __device__ float dot(const uint8_t *b, int u, const int4 (&xa)[4], const float (&xd)[4],
                                const int (&)[4])
    {
        float sum = 0.0f;
#pragma unroll
        for (int k = 0; k < 2; k++) {
            gf_iq<T> q;
            q.load(b, 2 * (u % 4) + k);
            sum += xd[2 * k] * q.sum(xa[2 * k], xa[2 * k + 1]);
        }
        return sum;
    }
};

/* each unit struct's staged form (OK: gf_mvs_kernel takes the format) */
template <class F> struct gf_mvs_of { enum { OK = 0 }; typedef gf_mvs_q8_0 G; };
template <> struct gf_mvs_of<gf_q8_0> { enum { OK = 1 }; typedef gf_mvs_q8_0 G; };
template <> struct gf_mvs_of<gf_q6_K> { enum { OK = 1 }; typedef gf_mvs_q6_K G; };
template <> struct gf_mvs_of<gf_q2_K> { enum { OK = 1 }; typedef gf_mvs_q2_K G; };
template <> struct gf_mvs_of<gf_q3_K> { enum { OK = 1 }; typedef gf_mvs_q3_K G; };
template <> struct gf_mvs_of<gf_q4_0> { enum { OK = 1 }; typedef gf_mvs_q4<18, false, false> G; };
template <> struct gf_mvs_of<gf_q5_0> { enum { OK = 1 }; typedef gf_mvs_q4<22, true, false> G; };
template <> struct gf_mvs_of<gf_q4_1> { enum { OK = 1 }; typedef gf_mvs_q4<20, false, true> G; };
template <> struct gf_mvs_of<gf_q5_1> { enum { OK = 1 }; typedef gf_mvs_q4<24, true, true> G; };
template <> struct gf_mvs_of<gf_q5_K> { enum { OK = 1 }; typedef gf_mvs_q5_K G; };
template <> struct gf_mvs_of<gf_iq4_xs> { enum { OK = 1 }; typedef gf_mvs_iq4_xs G; };
template <> struct gf_mvs_of<gf_iq4_nl> { enum { OK = 1 }; typedef gf_mvs_iq4_nl G; };
template <int T> struct gf_mvs_of<gf_iq<T> > { enum { OK = 1 }; typedef gf_mvs_iq<T> G; };

/* a warp's stage: the 16-byte vectors of its UL·GPU_WARP units' superblocks,
 * one more where unaligned (ne: one more for each run, up to a run a
 * superblock); per lane */
template <class F>
static constexpr __host__ __device__ int gf_mvs_nvl(int UL, bool ne)
{
    return ((UL * GPU_WARP / F::UPS * F::SB + 15) / 16 + (ne ? UL * GPU_WARP / F::UPS : 1) + GPU_WARP - 1) /
           GPU_WARP;
}

/* NE: experts side by side (gf_mv.ne, whole superblocks an expert): a
 * warp's superblocks lie in runs, one in each expert's row, each run's
 * 16-byte cover after the last in the stage, and each unit's expert weight
 * rides on its activation's scales (gf_mvk_kernel's way) */
template <class F, int UL, int NORM, bool NE, int SUB>
static __device__ __forceinline__ void gf_mvs_run(const gf_mv &p, int bx, int nbx)   /* (gf_mvk_run's bx, nbx, SUB) */
{
    enum { RT = SUB, NVL = gf_mvs_nvl<F>(UL, NE) };
    enum { SBW = GPU_WARP / F::UPS };   /* a warp's units' superblocks */
    __shared__ float part[2][GF_MVK_SMAX * GF_MVK_SUB / SUB][RT];
    extern __shared__ int4 gf_mvs_stage[];   /* a warp's NVL·32 vectors each */
    int warp = threadIdx.x / GPU_WARP, lane = threadIdx.x % GPU_WARP, g = blockIdx.y;
    int slice = warp / SUB, sub = warp % SUB, S = blockDim.x / (SUB * GPU_WARP);
    int U = p.n / 64, total = p.end[p.parts - 1], tiles = (total + RT - 1) / RT;
    /* the slice's superblocks [sb0, sb0 + nsb): bytes from b0 of each row */
    int sb0 = slice * UL * SBW, nsb = min(UL * SBW, U / F::UPS - sb0);
    size_t b0 = (size_t)sb0 * F::SB;
    size_t eo = 0;   /* an expert stack's matrix: ids come from the kernel ahead, so after the wait */
    int be = NE ? p.ne / (64 * F::UPS) : 1, ex0 = NE ? g * (p.n / p.ne) : 0;   /* NE: an expert's superblocks */
    /* the row's aligned 16-byte vectors covering the slice; returns the
     * slice's offset in the first. NE: the runs' covers one after another,
     * so[k] where the lane's superblock of unit k lies in the stage */
    auto fetch = [&](int r, int4 (&v)[NVL], int (&so)[UL]) {
        r = r < total ? r : total - 1;
        int rr, pt = gf_mv_part(p, r, &rr);
        if constexpr (!NE) {
            const uint8_t *s = p.w[pt] + eo + (size_t)rr * p.ldw + b0;
            const int4 *a = (const int4 *)((uintptr_t)s & ~(uintptr_t)15);
            int nv = ((int)((uintptr_t)s & 15) + nsb * F::SB + 15) >> 4;
#pragma unroll
            for (int i = 0; i < NVL; i++)
                if (lane + i * GPU_WARP < nv)
                    v[i] = gf_ld_stream(a + lane + i * GPU_WARP);
            return (int)((uintptr_t)s & 15);
        } else {
            /* each vector's source first, then the loads together: a
             * load a run into registers a run before may still be filling
             * (a register written twice waits for the first load) */
            const int4 *src[NVL] = {};
            for (int sb = sb0, at = 0; sb < sb0 + nsb;) {   /* a run an expert: superblocks [sb, sbe) */
                int e = sb / be, sbe = min(sb0 + nsb, (e + 1) * be);
                const uint8_t *s = p.w[pt] + (size_t)p.ids[ex0 + e] * p.estride + (size_t)rr * p.ldw +
                                   (size_t)(sb - e * be) * F::SB;
                const int4 *a = (const int4 *)((uintptr_t)s & ~(uintptr_t)15);
                int o = (int)((uintptr_t)s & 15), nv = (o + (sbe - sb) * F::SB + 15) >> 4;
#pragma unroll
                for (int i = 0; i < NVL; i++) {
                    int j = lane + i * GPU_WARP - at;
                    src[i] = j >= 0 && j < nv ? a + j : src[i];
                }
#pragma unroll
                for (int k = 0; k < UL; k++) {
                    int b = sb0 + k * SBW + lane / F::UPS;   /* (past the slice: a place no dot reads) */
                    if (b >= sb && b < sbe)
                        so[k] = 16 * at + o + (b - sb) * F::SB;
                }
                at += nv, sb = sbe;
            }
#pragma unroll
            for (int i = 0; i < NVL; i++)
                if (src[i])
                    v[i] = gf_ld_stream(src[i]);
            return 0;
        }
    };
    int4 v[NVL];
    int so[UL] = {}, tile, step, end, o = 0, r0 = gf_block_tiles<NORM, RT>(p, bx, nbx, tiles, &tile, &step, &end);
    float nw = gf_block_norm_w<NORM>(p, r0, total);
    if (!p.ids && tile < end)
        o = fetch(tile * RT + sub, v, so);
    gf_pdl_begin();
    eo = gf_group_off(p, g);
    if (p.ids && tile < end)
        o = fetch(tile * RT + sub, v, so);
    /* this lane's units: u = (slice·UL + k)·GPU_WARP + lane */
    size_t arow = (size_t)(g / p.a_div) * p.a_g;
    const int4 *aq = (const int4 *)(p.aq + arow * p.n);
    const gf_ads *ads = p.ads + arow * (p.n / GF_AB);
    bool ok[UL];
    int4 xa[UL][4];
    float xd[UL][4];
    int xs[UL][4];
#pragma unroll
    for (int k = 0; k < UL; k++) {
        int u = (slice * UL + k) * GPU_WARP + lane;
        ok[k] = u < U;
        float uw = NE && ok[k] ? p.sw[ex0 + u / F::UPS / be] : 1.0f;   /* the unit's expert's weight */
#pragma unroll
        for (int i = 0; i < 4; i++) {
            int c = ok[k] ? F::col(u, i) : 0;
            xa[k][i] = aq[c / 16];
            xd[k][i] = ads[c / GF_AB].x * uw;
            const int4 x = xa[k][i];
            xs[k][i] = gpu_dp4a(x.x, 0x01010101, gpu_dp4a(x.y, 0x01010101, gpu_dp4a(x.z, 0x01010101,
                                                                                      gpu_dp4a(x.w, 0x01010101, 0))));
        }
    }
    int writer = threadIdx.x < RT;
    float yo = writer && tile < end ? gf_mv_old(p, g, tile * RT + threadIdx.x, total) : 0.0f;
    float scale = NORM == GF_NORM_IN && warp == 0 ? gf_ss_scale(p) : 1.0f;   /* (the writers are warp 0's) */
    __shared__ float xo[GF_AB];   /* a norm handed on: the block's rows as stored */
    int4 *stage = gf_mvs_stage + warp * NVL * GPU_WARP;
    const uint8_t *sm = (const uint8_t *)stage;
    for (int round = 0; tile < end; tile += step, round++) {
        /* this round's row into the warp's stage, the next round's loads out */
        gpu_syncwarp();
#pragma unroll
        for (int i = 0; i < NVL; i++)
            stage[lane + i * GPU_WARP] = v[i];
        gpu_syncwarp();
        int so1 = o, at[UL];   /* this round's offset in the stage (NE: each unit's place) */
#pragma unroll
        for (int k = 0; k < UL; k++)
            at[k] = so[k];
        float yn = 0.0f;
        if (tile + step < end) {
            o = fetch((tile + step) * RT + sub, v, so);
            if (writer)
                yn = gf_mv_old(p, g, (tile + step) * RT + threadIdx.x, total);
        }
        float acc = 0.0f;
#pragma unroll
        for (int k = 0; k < UL; k++)
            if (ok[k])   /* (unit k·GPU_WARP + lane of the slice: in its superblock k·SBW + lane/UPS) */
                acc += F::dot(sm + (NE ? at[k] : so1 + (k * SBW + lane / F::UPS) * F::SB), lane, xa[k], xd[k],
                              xs[k]);
        float sum = warp_sum(acc);
        if (lane == 0)
            part[round & 1][slice][sub] = sum;
        __syncthreads();   /* one barrier a round: the next round writes the other half of part */
        float y = gf_slices_store(p, part[round & 1], S, g, tile * RT, total, yo, scale);
        if (NORM == GF_NORM_OUT && writer)
            xo[tile * RT - r0 + threadIdx.x] = y;
        yo = yn;
    }
    if (NORM == GF_NORM_OUT)
        gf_block_norm_out(p, r0, total, xo, nw);
}

template <class F, int UL, int NORM, bool NE, int SUB>
__global__ void __launch_bounds__(GF_MVK_SMAX * GF_MVK_SUB * GPU_WARP) gf_mvs_kernel(gf_mv p)
{
    GPU_TRACE(GT_MVS);
    gf_mvs_run<F, UL, NORM, NE, SUB>(p, blockIdx.x, gridDim.x);
}

/* Two one-row products in one launch (gf_mv2_launch): a Q4_K_M layer's
 * q/k (Q4_K) and v (Q6_K) read one activation into outputs of their own.
 * Blocks [0, nb1) are gf_mvk_kernel's for p1, the rest gf_mvs_kernel's of
 * format F for p2, each product's tiles walked by its own blocks, so that
 * the small product runs beside the large one rather than after it as a
 * launch of its own. Both of one width: the same units a lane and slices
 * a block; no norm handed on (NORM: none, or one handed in). */
template <class F, int UL, int NORM>
__global__ void __launch_bounds__(GF_MVK_ONE(UL, NORM) ? GF_MVK_SUB * GPU_WARP : GF_MVK_SMAX * GF_MVK_SUB * GPU_WARP,
                                  GF_MVK_ONE(UL, NORM) ? 5 : 1) gf_mv2_kernel(gf_mv p1, gf_mv p2, int nb1)
{
    GPU_TRACE(GT_MV2);
    if ((int)blockIdx.x < nb1)
        gf_mvk_run<UL, NORM, GF_MVK_SUB>(p1, blockIdx.x, nb1);
    else
        gf_mvs_run<F, UL, NORM, false, GF_MVK_SUB>(p2, blockIdx.x - nb1, gridDim.x - nb1);
}

/* ==== the batched kernel of the K-quants, the 4-, 5- and 8-bit blocks: tensor cores (CUDA sm_80+) ====
 * A step of several sequences (gpu_eval_batch) multiplies each matrix by
 * 2..GF_MMA_T activation rows. gf_mv_kernel meets every row's activation
 * again for each weight unit, from L1, and each row cost about as much as a
 * single-stream pass (BENCH.md, eleventh pass). Here the weights are mma.sync
 * m16n8k32 A operands (s8, s32 sums): a warp takes 16 rows of a unit (a
 * Q4_K or Q5_K superblock, four Q8_0 or Q4_0..Q5_1 blocks, half a Q2_K,
 * Q3_K, Q6_K or lattice superblock), a sub-block of 32 columns a step
 * (Q2_K, Q3_K, Q6_K, IQ2_XS and IQ2_S: 16, a scale's, m16n8k16), against
 * 8 tokens' int8 activation as B, so an activation byte serves 16 rows from a
 * register. Within a sub-block
 * the order of k is free as long as A and B agree: lane (group gq = lane/4,
 * c = lane%4) holds columns 8c..8c+7, so its codes are 8 contiguous bytes of
 * each 64-column pair (low nibbles the pair's first sub-block, high its
 * second) and its activation 8 contiguous bytes, which the activation's
 * layout (gf_act_bt) puts side by side for the 8 tokens: 256 bytes, two L1
 * wavefronts, where rows one after another cost one a token (run 1 of the
 * twelfth pass found the kernel L1-bound). Each sub-block's integer
 * dot is scaled in f32 as gf_q4k_pair does: ad·(d·sc·dot − dmin·m·Σa). A
 * block's GF_MVQ_WARPS warps share one 16-row tile and take its units in
 * turn; their sums meet in shared memory, added in warp order. The next
 * unit's loads go out before this one's arithmetic, and the first's before
 * the kernel waits for the one ahead (weights are no kernel's output).
 * 2, 4 or 16 warps a tile, persistent blocks walking the tiles, and a
 * superblock's activation loads all in flight at once were each measured no
 * faster on the H200 (BENCH.md). The blocks are held to the registers of
 * 3 (8 rows) or 2 (16) an SM: the kernel waits on latency (twelfth pass). */
#define GF_MMA_T 16     /* gf_matmul_n's nt for gf_mvq_kernel: up to 16 rows, one group */
#define GF_MVQ_WARPS 8

#ifdef GPU_CUDA
/* N words at p, whose address is 2 mod 4 where mis (a constant where the
 * caller knows the alignment), else 4-aligned: streamed loads of the
 * aligned words around them, cut by funnel shifts where 2-aligned */
template <int N>
static __device__ __forceinline__ void gf_ldu(uint32_t (&w)[N], const uint8_t *p, bool mis)
{
    if (!mis) {
        for (int i = 0; i < N; i++)
            w[i] = __ldcs((const uint32_t *)p + i);
    } else {
        const uint32_t *a = (const uint32_t *)(p - 2);
        uint32_t t[N + 1];
        for (int i = 0; i <= N; i++)
            t[i] = __ldcs(a + i);
        for (int i = 0; i < N; i++)
            w[i] = __funnelshift_r(t[i], t[i + 1], 16);
    }
}

/* The weight formats gf_mvq_kernel takes: unit u of a row (COLS columns,
 * G groups of GK), the lane's share (c = lane % 4) loaded by fetch (a Q8_0
 * or Q6_K unit holds about as many registers as a Q4_K one); sub(k) gives
 * group k's codes, as int8, at columns 8c..8c+3 (lo) and 8c+4..8c+7 (hi)
 * of a group of 32 (SPLIT: 4c..4c+3 and 16 + 4c..+3, a word of nibbles),
 * or 4c..4c+3 (lo) of a group of 16, its scale and (MIN) its min, both
 * multiplied out. A group is one mma (k = GK) and lies
 * in one block of 32 of the activation. */
struct gf_mvq_q4_K {   /* one superblock: the header, and 8 code bytes of each pair */
    enum { COLS = 256, GK = 32, G = 8, MIN = 1, SPLIT = 0 };
    int4 h;
    int2 q[4];
    __device__ void fetch(const uint8_t *row, int u, int c) {
        const uint8_t *b = row + (size_t)u * 144;
        h = gf_ld_stream((const int4 *)b);
#pragma unroll
        for (int pr = 0; pr < 4; pr++)
            q[pr] = __ldcs((const int2 *)(b + 16 + 32 * pr + 8 * c));
    }
    __device__ void sub(int k, uint32_t *lo, uint32_t *hi, float *ds, float *ms) const {
        int pr = k / 2, sh = 4 * (k % 2);   /* low nibbles: the pair's first sub-block */
        uint32_t sc, mn;
        gf_q4k_scales(h, pr, &sc, &mn);
        *lo = ((uint32_t)q[pr].x >> sh) & 0x0f0f0f0f;
        *hi = ((uint32_t)q[pr].y >> sh) & 0x0f0f0f0f;
        *ds = gf_h2f((uint16_t)((uint32_t)h.x & 0xffff)) * (float)((sc >> (2 * sh)) & 0xff);
        *ms = gf_h2f((uint16_t)((uint32_t)h.x >> 16)) * (float)((mn >> (2 * sh)) & 0xff);
    }
};

struct gf_mvq_q8_0 {   /* four blocks of 34 bytes: each one's scale, and 8 of its codes */
    enum { COLS = 128, GK = 32, G = 4, MIN = 0, SPLIT = 0 };
    uint32_t w[G][2];
    float d[G];
    __device__ void fetch(const uint8_t *row, int u, int c) {
        /* (b is 8-aligned: block k's codes from 8c lie 4-aligned for odd k,
         * 2 bytes off for even k, cut out of three aligned words) */
        const uint8_t *b = row + (size_t)u * 136;
#pragma unroll
        for (int k = 0; k < G; k++) {
            const uint8_t *bk = b + 34 * k;
            d[k] = gf_h2f(gf_ld16(bk));
            if (k % 2) {
                const uint32_t *a = (const uint32_t *)(bk + 2 + 8 * c);
                w[k][0] = a[0], w[k][1] = a[1];
            } else {
                const uint32_t *a = (const uint32_t *)(bk + 8 * c);
                uint32_t x0 = a[0], x1 = a[1], x2 = a[2];
                w[k][0] = __funnelshift_r(x0, x1, 16), w[k][1] = __funnelshift_r(x1, x2, 16);
            }
        }
    }
    __device__ void sub(int k, uint32_t *lo, uint32_t *hi, float *ds, float *ms) const {
        *lo = w[k][0], *hi = w[k][1], *ds = d[k], *ms = 0.0f;
    }
};

struct gf_mvq_q6_K {   /* half a superblock (128 columns): 8 groups of 16, a scale each */
    enum { COLS = 128, GK = 16, G = 8, MIN = 0, SPLIT = 0 };
    uint32_t ql[2][2], qh[2], sc[2];
    float d;
    /* 4 bytes at a 2-aligned address (blocks of 210 bytes): from the two
     * aligned words around them */
    static __device__ uint32_t ld4(const uint8_t *x)
    {
        const uint32_t *a = (const uint32_t *)((uintptr_t)x & ~(uintptr_t)3);
        return __funnelshift_r(__ldcs(a), __ldcs(a + 1), 8 * (unsigned)((uintptr_t)x & 3));
    }
    /* half h of the superblock: its quarter i (32 columns) takes the low
     * (i < 2) or high nibbles of ql bytes 64h + 32(i % 2) + l and bits 2i
     * of qh bytes 128 + 32h + l, l = 16j + 4c + 0..3 in group 2i + j;
     * the group's scale is byte 192 + 8h + 2i + j (quant.c's k6_unpack) */
    __device__ void fetch(const uint8_t *row, int u, int c) {
        const uint8_t *b = row + (size_t)(u >> 1) * 210;
        int h = u & 1;
#pragma unroll
        for (int j = 0; j < 2; j++) {
            ql[0][j] = ld4(b + 64 * h + 16 * j + 4 * c);
            ql[1][j] = ld4(b + 64 * h + 32 + 16 * j + 4 * c);
            qh[j] = ld4(b + 128 + 32 * h + 16 * j + 4 * c);
            sc[j] = ld4(b + 192 + 8 * h + 4 * j);
        }
        d = gf_h2f(gf_ld16(b + 208));
    }
    __device__ void sub(int k, uint32_t *lo, uint32_t *hi, float *ds, float *ms) const {
        int i = k / 2, j = k % 2;
        uint32_t v = ((ql[i % 2][j] >> (4 * (i / 2))) & 0x0f0f0f0f) | (((qh[j] >> (2 * i)) << 4) & 0x30303030);
        *lo = ((v | 0x80808080u) - 0x20202020u) ^ 0x80808080u;   /* each byte minus 32, no borrow between bytes */
        *hi = 0;
        *ds = d * (float)(int8_t)(sc[i / 2] >> (8 * (k % 4)));
        *ms = 0.0f;
    }
};

/* Q2_K: half a superblock (n = u & 1), 8 groups of 16. Group k = 2j + h
 * (columns 32j + 16h + 0..15 of the half) takes bits 2j of qs bytes 16 +
 * 32n + 16h + l, and byte 8n + k of the scales: its scale (low nibble,
 * times d) and min (high, times dmin). */
struct gf_mvq_q2_K {
    enum { COLS = 128, GK = 16, G = 8, MIN = 1, SPLIT = 0 };
    uint32_t qs[2], sc[2], dm;
    __device__ void fetch(const uint8_t *row, int u, int c) {
        const uint8_t *b = row + (size_t)(u >> 1) * 84;
        int n = u & 1;
#pragma unroll
        for (int h = 0; h < 2; h++) {
            qs[h] = __ldcs((const uint32_t *)(b + 16 + 32 * n + 16 * h + 4 * c));
            sc[h] = __ldcs((const uint32_t *)(b + 8 * n + 4 * h));
        }
        dm = __ldcs((const uint32_t *)(b + 80));
    }
    __device__ void sub(int k, uint32_t *lo, uint32_t *hi, float *ds, float *ms) const {
        uint32_t s = (sc[k / 4] >> (8 * (k % 4))) & 0xff;
        *lo = (qs[k % 2] >> (2 * (k / 2))) & 0x03030303;
        *hi = 0;
        *ds = gf_h2f((uint16_t)(dm & 0xffff)) * (float)(s & 15);
        *ms = gf_h2f((uint16_t)(dm >> 16)) * (float)(s >> 4);
    }
};

/* Q3_K: half a superblock as Q6_K's unit, 8 groups of 16. Group k = 2i + j
 * of half h (columns 32i + 16j + 0..15 of the half) takes bits 2i of qs
 * bytes 32 + 32h + 16j + l, bit 4h + i of hmask bytes 16j + l (clear:
 * level − 4) and scale 8h + k (gf_q3k_scale's packing). */
struct gf_mvq_q3_K {
    enum { COLS = 128, GK = 16, G = 8, MIN = 0, SPLIT = 0 };
    uint32_t qs[2], hm[2], sc[2];   /* hm and the scales shifted to the half */
    float d;
    __device__ void fetch(const uint8_t *row, int u, int c) {
        const uint8_t *b = row + (size_t)(u >> 1) * 110;
        int h = u & 1;
#pragma unroll
        for (int j = 0; j < 2; j++) {
            qs[j] = gf_mvq_q6_K::ld4(b + 32 + 32 * h + 16 * j + 4 * c);
            hm[j] = gf_mvq_q6_K::ld4(b + 16 * j + 4 * c) >> (4 * h);
        }
        uint32_t s2 = gf_mvq_q6_K::ld4(b + 104);
#pragma unroll
        for (int t = 0; t < 2; t++)
            sc[t] = ((gf_mvq_q6_K::ld4(b + 96 + 4 * t) >> (4 * h)) & 0x0f0f0f0f) |
                    ((s2 >> (4 * h + 2 * t)) & 0x03030303) << 4;
        d = gf_h2f(gf_ld16(b + 108));
    }
    __device__ void sub(int k, uint32_t *lo, uint32_t *hi, float *ds, float *ms) const {
        int i = k / 2, j = k % 2;
        uint32_t v = ((qs[j] >> (2 * i)) & 0x03030303) | ((hm[j] >> i) & 0x01010101) << 2;
        *lo = ((v | 0x80808080u) - 0x04040404u) ^ 0x80808080u;   /* each byte minus 4, no borrow between bytes */
        *hi = 0;
        *ds = d * (float)((int)((sc[k / 4] >> (8 * (k % 4))) & 0xff) - 32);
        *ms = 0.0f;
    }
};

struct gf_mvq_q5_K {   /* Q4_K's unit, and each pair's fifth bits (bit k of qh byte l: sub-block k) */
    enum { COLS = 256, GK = 32, G = 8, MIN = 1, SPLIT = 0 };
    int4 h;
    int2 qh, q[4];
    __device__ void fetch(const uint8_t *row, int u, int c) {
        const uint8_t *b = row + (size_t)u * 176;
        h = gf_ld_stream((const int4 *)b);
        qh = __ldcs((const int2 *)(b + 16 + 8 * c));
#pragma unroll
        for (int pr = 0; pr < 4; pr++)
            q[pr] = __ldcs((const int2 *)(b + 48 + 32 * pr + 8 * c));
    }
    __device__ void sub(int k, uint32_t *lo, uint32_t *hi, float *ds, float *ms) const {
        int pr = k / 2, sh = 4 * (k % 2);
        uint32_t sc, mn;
        gf_q4k_scales(h, pr, &sc, &mn);
        *lo = (((uint32_t)q[pr].x >> sh) & 0x0f0f0f0f) | (((uint32_t)qh.x >> k) & 0x01010101) << 4;
        *hi = (((uint32_t)q[pr].y >> sh) & 0x0f0f0f0f) | (((uint32_t)qh.y >> k) & 0x01010101) << 4;
        *ds = gf_h2f((uint16_t)((uint32_t)h.x & 0xffff)) * (float)((sc >> (2 * sh)) & 0xff);
        *ms = gf_h2f((uint16_t)((uint32_t)h.x >> 16)) * (float)((mn >> (2 * sh)) & 0xff);
    }
};

/* Q4_0, Q5_0, Q4_1, Q5_1 and IQ4_NL: four blocks of BB bytes (an 8-aligned
 * unit), each its f16 scale (MN: and min) at 0, its fifth bits at HO (0:
 * none), its 16 bytes of codes last (column l the low nibble of byte l,
 * 16 + l the high one). Lane c takes the columns of one word of codes
 * (SPLIT): 4c..4c+3 (lo) and 16 + 4c..+3 (hi), each with its fifth bit, the
 * codes through the IQ4 grid where NL. The offset of 8 or 16 comes out as a
 * min of 8 or 16 times the scale against the activation's sum of codes. */
template <int BB, int HO, bool MN, bool NL>
struct gf_mvq_q4 {
    enum { COLS = 128, GK = 32, G = 4, MIN = !NL, SPLIT = 1 };
    uint32_t q[G][2], dm[G];   /* a block's codes, and its scale's (and min's) f16 bits */
    __device__ void fetch(const uint8_t *row, int u, int c) {
        const uint8_t *b = row + (size_t)u * 4 * BB;
#pragma unroll
        for (int k = 0; k < G; k++) {
            const uint8_t *bk = b + BB * k;
            uint32_t w[1], h[1] = {0};
            dm[k] = MN ? __ldcs((const uint32_t *)bk) : __ldcs((const uint16_t *)bk);
            gf_ldu(w, bk + BB - 16 + 4 * c, (BB * k + BB) % 4);
            if (HO)
                gf_ldu(h, bk + HO, (BB * k + HO) % 4);
            codes(w[0], h[0], c, &q[k][0], &q[k][1]);
        }
    }
    __device__ void sub(int k, uint32_t *lo, uint32_t *hi, float *ds, float *ms) const {
        float d = gf_h2f((uint16_t)(dm[k] & 0xffff));
        *lo = q[k][0], *hi = q[k][1], *ds = d, *ms = dmin(d, (uint16_t)(dm[k] >> 16));
    }
    /* lane c's codes from its word of nibbles w and the block's fifth bits h */
    static __device__ void codes(uint32_t w, uint32_t h, int c, uint32_t *lo, uint32_t *hi) {
        uint32_t l = (w & 0x0f0f0f0f) | (uint32_t)gf_bit4(h >> (4 * c));
        uint32_t u = ((w >> 4) & 0x0f0f0f0f) | (uint32_t)gf_bit4(h >> (16 + 4 * c));
        *lo = NL ? (uint32_t)gf_iq4_vals(l) : l;
        *hi = NL ? (uint32_t)gf_iq4_vals(u) : u;
    }
    /* the min against the activation's sum of codes, for scale d (m: the stored min's f16 bits) */
    static __device__ float dmin(float d, uint16_t m) { return NL ? 0.0f : MN ? -gf_h2f(m) : HO ? 16.0f * d : 8.0f * d; }
};

struct gf_mvq_iq4_xs {   /* half a superblock: sub-blocks 4h..4h+3, each IQ4_NL's codes and a 6-bit scale */
    enum { COLS = 128, GK = 32, G = 4, MIN = 0, SPLIT = 0 };
    uint32_t q[G][2], hd, sl;   /* the codes; d and the high scale bits; the half's low scale nibbles */
    __device__ void fetch(const uint8_t *row, int u, int c) {
        const uint8_t *b = row + (size_t)(u / 2) * 136;
        int h = u % 2;
        uint32_t w = __ldcs((const uint32_t *)b);   /* d, then scales_h: 2 bits a sub-block, a byte a half */
        hd = (w & 0xffff) | ((w >> (8 * h)) & 0xffff0000);
        sl = __ldcs((const uint16_t *)(b + 4) + h);
#pragma unroll
        for (int k = 0; k < G; k++) {
            uint2 v = __ldcs((const uint2 *)(b + 8 + 16 * (4 * h + k) + 8 * (c % 2)));
            q[k][0] = (uint32_t)gf_iq4_vals((v.x >> (4 * (c / 2))) & 0x0f0f0f0f);
            q[k][1] = (uint32_t)gf_iq4_vals((v.y >> (4 * (c / 2))) & 0x0f0f0f0f);
        }
    }
    __device__ void sub(int k, uint32_t *lo, uint32_t *hi, float *ds, float *ms) const {
        int ls = (int)((sl >> (4 * k)) & 15) | (int)((hd >> (16 + 2 * k)) & 3) << 4;
        *lo = q[k][0], *hi = q[k][1], *ms = 0.0f;
        *ds = gf_h2f((uint16_t)(hd & 0xffff)) * (float)(ls - 32);
    }
};

/* The IQ2/IQ3 lattices: four groups, each group's codes and scale from
 * gq_iq_eight. Where a scale covers 32 columns (IQ2_XXS, IQ3_XXS, IQ3_S) a
 * unit is half a superblock, a group a sub-block, and lane c's columns
 * 8c..8c+7 the sub-block's group of 8 c. Where it covers 16 (IQ2_XS,
 * IQ2_S) a unit is two sub-blocks, a group half of one, and lane c's
 * columns 4c..4c+3 half of the group of 8 2h + c/2 (half h): 8 groups a
 * unit held 16 registers a row, which spilled at 8 rows' 80. */
template <int T>
struct gf_mvq_iq {
    enum { GK = T == QT_IQ2_XS || T == QT_IQ2_S ? 16 : 32, COLS = 4 * GK, G = 4, MIN = 0, SPLIT = 0 };
    uint32_t q[G][GK / 16];
    float d[G];
    __device__ void fetch(const uint8_t *row, int u, int c) {
        enum { UPS = 256 / COLS };   /* units a superblock */
        const uint8_t *b = row + (size_t)(u / UPS) * gq_bsize(T);
        int sb = COLS / 32 * (u % UPS);   /* the unit's first sub-block */
#pragma unroll
        for (int k = 0; k < G; k++) {
            int w[2];
            if constexpr (GK == 32) {
                d[k] = gq_iq_eight<T>(b, sb + k, c, w);
                q[k][0] = (uint32_t)w[0], q[k][1] = (uint32_t)w[1];
            } else {
                d[k] = gq_iq_eight<T>(b, sb + k / 2, 2 * (k % 2) + c / 2, w);
                q[k][0] = (uint32_t)w[c % 2];
            }
        }
    }
    __device__ void sub(int k, uint32_t *lo, uint32_t *hi, float *ds, float *ms) const {
        *lo = q[k][0], *ds = d[k], *ms = 0.0f;
        if constexpr (GK == 32)
            *hi = q[k][1];
        else
            *hi = 0;
    }
};

/* the format of a unit struct above (only those gf_mvq_takes reach the kernel) */
template <class Q> struct gf_mvq_of { typedef gf_mvq_q8_0 F; };
template <> struct gf_mvq_of<gf_q4_K> { typedef gf_mvq_q4_K F; };
template <> struct gf_mvq_of<gf_q5_K> { typedef gf_mvq_q5_K F; };
template <> struct gf_mvq_of<gf_q6_K> { typedef gf_mvq_q6_K F; };
template <> struct gf_mvq_of<gf_q2_K> { typedef gf_mvq_q2_K F; };
template <> struct gf_mvq_of<gf_q3_K> { typedef gf_mvq_q3_K F; };
template <> struct gf_mvq_of<gf_q4_0> { typedef gf_mvq_q4<18, 0, false, false> F; };
template <> struct gf_mvq_of<gf_q5_0> { typedef gf_mvq_q4<22, 2, false, false> F; };
template <> struct gf_mvq_of<gf_q4_1> { typedef gf_mvq_q4<20, 0, true, false> F; };
template <> struct gf_mvq_of<gf_q5_1> { typedef gf_mvq_q4<24, 4, true, false> F; };
template <> struct gf_mvq_of<gf_iq4_nl> { typedef gf_mvq_q4<18, 0, false, true> F; };
template <> struct gf_mvq_of<gf_iq4_xs> { typedef gf_mvq_iq4_xs F; };
template <int T> struct gf_mvq_of<gf_iq<T> > { typedef gf_mvq_iq<T> F; };

/* A staged batch format (gf_mvqs_kernel): Q4_0, Q5_0, Q4_1, Q5_1 and
 * IQ4_NL as gf_mvq_q4's groups, a unit of eight blocks (UB bytes a row,
 * 16-aligned), read from the warp's stage rather than from global memory
 * a row at a time: their 2-4 loads a block a row each reached the warp's
 * 8 rows' lines (~8 L1 wavefronts an instruction), where a stage takes a
 * unit's rows in 16-byte loads and each lane's reads are one wavefront
 * (BENCH.md, forty-second pass; the stage 1.2-1.8 times as fast at 4-16
 * rows, forty-third). sub reads group k of the row whose unit lies at s. */
template <int BB, int HO, bool MN, bool NL>
struct gf_mvqs_q4 {
    typedef gf_mvq_q4<BB, HO, MN, NL> F;
    enum { COLS = 256, GK = 32, G = 8, MIN = F::MIN, SPLIT = 1, UB = 8 * BB };
    /* 4 bytes o past p (4-aligned; o a constant): a word, or two halves where o is 2 mod 4 */
    static __device__ uint32_t ld(const uint8_t *p, int o) { return o % 4 ? (uint32_t)gf_ld32h(p + o) : *(const uint32_t *)(p + o); }
    static __device__ void sub(const uint8_t *s, int k, int c, uint32_t *lo, uint32_t *hi, float *ds, float *ms) {
        float d = gf_h2f(gf_ld16(s + BB * k));
        F::codes(ld(s + 4 * c, BB * k + BB - 16), HO ? ld(s, BB * k + HO) : 0, c, lo, hi);
        *ds = d, *ms = F::dmin(d, MN ? gf_ld16(s + BB * k + 2) : 0);
    }
};

/* a staged format's row for gf_mvq_unit: its unit at s in the stage, lane c */
template <class S>
struct gf_mvq_at : S {
    const uint8_t *s;
    int c;
    __device__ void sub(int k, uint32_t *lo, uint32_t *hi, float *ds, float *ms) const { S::sub(s, k, c, lo, hi, ds, ms); }
};

/* a unit struct's staged form (OK: gf_mvqs_kernel takes it): gf_mvq_q4's */
template <class F> struct gf_mvqs_of { enum { OK = 0 }; };
template <int BB, int HO, bool MN, bool NL> struct gf_mvqs_of<gf_mvq_q4<BB, HO, MN, NL> > {
    enum { OK = 1 };
    typedef gf_mvqs_q4<BB, HO, MN, NL> S;
};

/* a stage's row stride for units of ub bytes: 16-aligned, and an odd
 * multiple of 4 words mod 32, so that a word of each of 8 rows (c: 0..3
 * words on) lies on 32 distinct banks */
static constexpr __host__ __device__ int gf_stage_stride(int ub)
{
    int s = (ub + 15) / 16 * 16;
    while (s / 4 % 8 != 4)
        s += 16;
    return s;
}

/* lane's two rows (w: their starts), unit sb */
template <class F>
static __device__ __forceinline__ void gf_mvq_fetch(const uint8_t *const (&w)[2], int sb, int c, F (&f)[2])
{
#pragma unroll
    for (int j = 0; j < 2; j++)
        f[j].fetch(w[j], sb, c);
}

/* The lane's view of the activation for gf_mvq_unit: group b (tokens 8b
 * .. 8b + 7 of the tile) of activation block s, its B operand (token 8b +
 * gq, the lane's 8 bytes of a group of 32 (SPLIT: 4 at 4c and 4 at 16 +
 * 4c), or its 4 at o of one of 16)
 * and the scales of C's tokens 8b + 2c and + 1. Pointers formed once a
 * tile (block s of row t: t·ts + s·ss blocks on), no bounds: the tokens
 * past the tile's T read other rows of the buffer (gf_act_alloc's slack of
 * GF_ACT_SLACK rows covers the last), into sums that are never stored.
 * Nsight Compute counted 47.6 instructions an mma in gf_mvx_kernel with
 * each load's address rebuilt and checked, about a third of them
 * addresses (BENCH.md, thirtieth pass). */
struct gf_act_src {
    const int8_t *q;     /* the lane's B bytes in block 0, group 0 */
    const gf_ads *d;     /* token 2c's scales in block 0 */
    size_t qs;           /* a block's stride, bytes */
    int ds;              /* ... in gf_ads */
    int qt, dt;          /* a group's stride (8 tokens), bytes and gf_ads */
    __device__ gf_act_src(const gf_mv &p, int a, int ts, int ss, int lb, int gq, int c)   /* lb: B bytes a lane */
    {
        q = p.aq + (size_t)GF_AB * ((size_t)(a + gq) * ts) + lb * c;
        d = p.ads + (size_t)(a + 2 * c) * ts;
        qs = (size_t)GF_AB * ss, ds = ss, qt = GF_AB * 8 * ts, dt = 8 * ts;
    }
};

/* a lane's B bytes of a group in format F's units (gf_act_src's lb) */
template <class F>
static constexpr __host__ __device__ int gf_lane_b(void) { return F::GK == 32 && !F::SPLIT ? 8 : 4; }

/* unit sb's products of the lane's rows (f) and tokens into acc, the
 * activation as src sees it */
template <class F, int NB>
static __device__ __forceinline__ void gf_mvq_unit(const gf_act_src &src, const F (&f)[2], int sb, int ts,
                                                   float (&acc)[NB][4])
{
#pragma unroll
    for (int k = 0; k < F::G; k++) {
        /* the activation's block of the group, and the group's columns in it */
        int s = F::COLS / 32 * sb + F::GK * k / 32, o = F::GK * k % 32;
        const int8_t *qk = src.q + (size_t)s * src.qs + o;
        const gf_ads *dk = src.d + (size_t)s * src.ds;
        uint32_t a[4];
        float ds[2], ms[2];
        f[0].sub(k, &a[0], &a[2], &ds[0], &ms[0]);
        f[1].sub(k, &a[1], &a[3], &ds[1], &ms[1]);
#pragma unroll
        for (int b = 0; b < NB; b++) {
            gf_ads x0 = dk[b * src.dt], x1 = dk[b * src.dt + ts];
            int dot[4];
            if constexpr (F::GK == 32) {
                int2 x = F::SPLIT ? make_int2(*(const int *)(qk + b * src.qt), *(const int *)(qk + b * src.qt + 16))
                                  : *(const int2 *)(qk + b * src.qt);
                asm volatile("mma.sync.aligned.m16n8k32.row.col.s32.s8.s8.s32 "
                             "{%0,%1,%2,%3}, {%4,%5,%6,%7}, {%8,%9}, {%10,%10,%10,%10};\n"
                             : "=r"(dot[0]), "=r"(dot[1]), "=r"(dot[2]), "=r"(dot[3])
                             : "r"(a[0]), "r"(a[1]), "r"(a[2]), "r"(a[3]), "r"(x.x), "r"(x.y), "r"(0));
            } else {
                int x = *(const int *)(qk + b * src.qt);
                asm volatile("mma.sync.aligned.m16n8k16.row.col.s32.s8.s8.s32 "
                             "{%0,%1,%2,%3}, {%4,%5}, {%6}, {%7,%7,%7,%7};\n"
                             : "=r"(dot[0]), "=r"(dot[1]), "=r"(dot[2]), "=r"(dot[3])
                             : "r"(a[0]), "r"(a[1]), "r"(x), "r"(0));
                if constexpr (F::MIN) {   /* a min a group of 16: the tokens' sums of its codes, by rows of ones */
                    int sq[4];
                    asm volatile("mma.sync.aligned.m16n8k16.row.col.s32.s8.s8.s32 "
                                 "{%0,%1,%2,%3}, {%4,%4}, {%5}, {%6,%6,%6,%6};\n"
                                 : "=r"(sq[0]), "=r"(sq[1]), "=r"(sq[2]), "=r"(sq[3])
                                 : "r"(0x01010101), "r"(x), "r"(0));
                    x0.z = (float)sq[0], x1.z = (float)sq[1];
                }
            }
            /* dot[i]: row gq + 8·(i/2), token 8b + 2c + i%2 */
            if (F::MIN) {
                acc[b][0] += x0.x * (ds[0] * (float)dot[0] - ms[0] * x0.z);
                acc[b][1] += x1.x * (ds[0] * (float)dot[1] - ms[0] * x1.z);
                acc[b][2] += x0.x * (ds[1] * (float)dot[2] - ms[1] * x0.z);
                acc[b][3] += x1.x * (ds[1] * (float)dot[3] - ms[1] * x1.z);
            } else {
                acc[b][0] += x0.x * (ds[0] * (float)dot[0]);
                acc[b][1] += x1.x * (ds[0] * (float)dot[1]);
                acc[b][2] += x0.x * (ds[1] * (float)dot[2]);
                acc[b][3] += x1.x * (ds[1] * (float)dot[3]);
            }
        }
    }
}

/* The end of a 16-row tile of W warps' mma sums (acc: each warp's C
 * fragments over its share of the columns, token tiles of 8): they meet
 * in shared memory, added in warp order, and rows r0.. of the first T
 * tokens are stored. */
template <int W, int NB>
static __device__ __forceinline__ void gf_tile_put(const gf_mv &p, const float (&acc)[NB][4], int r0, int T)
{
    __shared__ float part[W][16][8 * NB];
    int warp = threadIdx.x / GPU_WARP, lane = threadIdx.x % GPU_WARP, gq = lane / 4, c = lane % 4;
    int total = p.end[p.parts - 1];
#pragma unroll
    for (int b = 0; b < NB; b++)
#pragma unroll
        for (int i = 0; i < 4; i++)
            part[warp][gq + 8 * (i / 2)][8 * b + 2 * c + i % 2] = acc[b][i];
    __syncthreads();
    for (int o = threadIdx.x; o < 16 * 8 * NB; o += blockDim.x) {
        int row = o / (8 * NB), t = o % (8 * NB);
        if (t < T && r0 + row < total) {
            float sum = part[0][row][t];
            for (int i = 1; i < W; i++)
                sum += part[i][row][t];
            int rr, pt = gf_mv_part(p, r0 + row, &rr);
            gf_mv_put(p, pt, 0, t, rr, sum);
        }
    }
}

template <class F, int NB, int BT>   /* the weight format; token tiles of 8; the activation's layout */
__global__ void __launch_bounds__(GF_MVQ_WARPS * GPU_WARP, NB == 1 ? 3 : 2) gf_mvq_kernel(gf_mv p)
{
    GPU_TRACE(GT_MVQ);
#if __CUDA_ARCH__ >= 800
    enum { W = GF_MVQ_WARPS };
    int warp = threadIdx.x / GPU_WARP, lane = threadIdx.x % GPU_WARP, gq = lane / 4, c = lane % 4;
    int total = p.end[p.parts - 1], r0 = blockIdx.x * 16, nsb = p.n / F::COLS, T = p.t_total;
    const uint8_t *w[2];   /* the lane's rows gq, gq + 8 (past the end: the last row, not written) */
#pragma unroll
    for (int j = 0; j < 2; j++) {
        int r = min(r0 + gq + 8 * j, total - 1), rr;
        int pt = gf_mv_part(p, r, &rr);
        w[j] = p.w[pt] + (size_t)rr * p.ldw;
    }
    F f[2];
    int sb = warp;
    if (sb < nsb)
        gf_mvq_fetch(w, sb, c, f);
    gf_pdl_begin();
    float acc[NB][4] = {};
    /* block s of activation row t: block t·ts + s·ss (BT: gq_act_at's
     * layout of the rows side by side, else rows in turn), the layout a
     * compile-time choice so that each form's offsets stay multiply-adds */
    const int ts = BT ? 1 : p.n / GF_AB, ss = BT ? p.bt : 1;
    const gf_act_src src(p, 0, ts, ss, gf_lane_b<F>(), gq, c);
    /* the next unit's loads before this one's arithmetic; the last round
     * apart, so that no branch sits around a fetch (ptxas: ~25 registers
     * more with one) and no unit is fetched twice */
    for (; sb + W < nsb; sb += W) {
        F nf[2];
        gf_mvq_fetch(w, sb + W, c, nf);
        gf_mvq_unit<F, NB>(src, f, sb, ts, acc);
        f[0] = nf[0], f[1] = nf[1];
    }
    if (sb < nsb)
        gf_mvq_unit<F, NB>(src, f, sb, ts, acc);
    gf_tile_put<W, NB>(p, acc, r0, T);
#endif
}

/* gf_mvq_kernel for a staged format S: each warp's unit of the tile's 16
 * rows comes in as 16-byte loads spread over the lanes (the next unit's in
 * flight during this one's arithmetic, the first before the wait), goes to
 * the warp's stage, and the lanes take their groups from there */
template <class S, int NB, int BT>
__global__ void __launch_bounds__(GF_MVQ_WARPS * GPU_WARP, NB == 1 ? 3 : 2) gf_mvqs_kernel(gf_mv p)
{
    GPU_TRACE(GT_MVQ);
#if __CUDA_ARCH__ >= 800
    enum { W = GF_MVQ_WARPS, ST = gf_stage_stride(S::UB), NV16 = S::UB / 16, NV = (16 * NV16 + GPU_WARP - 1) / GPU_WARP };
    __shared__ int4 stage[W][16 * ST / 16];
    int warp = threadIdx.x / GPU_WARP, lane = threadIdx.x % GPU_WARP, gq = lane / 4, c = lane % 4;
    int total = p.end[p.parts - 1], r0 = blockIdx.x * 16, nsb = p.n / S::COLS, T = p.t_total;
    /* the lane's pieces: piece i = lane + 32j is vector i % NV16 of row i / NV16
     * (past the tile's rows: the last row's, not written) */
    const int4 *src[NV];
    int dst[NV];
#pragma unroll
    for (int j = 0; j < NV; j++) {
        int i = lane + GPU_WARP * j, row = i / NV16, rr;
        int pt = gf_mv_part(p, min(r0 + row, total - 1), &rr);
        src[j] = i < 16 * NV16 ? (const int4 *)(p.w[pt] + (size_t)rr * p.ldw) + i % NV16 : NULL;
        dst[j] = row * (ST / 16) + i % NV16;
    }
    int4 v[NV];
    auto fetch = [&](int sb) {
#pragma unroll
        for (int j = 0; j < NV; j++)
            if (src[j])
                v[j] = gf_ld_stream(src[j] + (size_t)sb * NV16);
    };
    int sb = warp;
    if (sb < nsb)
        fetch(sb);
    gf_pdl_begin();
    float acc[NB][4] = {};
    const int ts = BT ? 1 : p.n / GF_AB, ss = BT ? p.bt : 1;
    const gf_act_src asrc(p, 0, ts, ss, gf_lane_b<S>(), gq, c);
    const uint8_t *sm = (const uint8_t *)stage[warp];
    gf_mvq_at<S> f[2];
    f[0].s = sm + gq * ST, f[1].s = sm + (gq + 8) * ST, f[0].c = f[1].c = c;
    for (; sb < nsb; sb += W) {
        gpu_syncwarp();
#pragma unroll
        for (int j = 0; j < NV; j++)
            if (src[j])
                stage[warp][dst[j]] = v[j];
        gpu_syncwarp();
        if (sb + W < nsb)
            fetch(sb + W);
        gf_mvq_unit<gf_mvq_at<S>, NB>(asrc, f, sb, ts, acc);
    }
    gf_tile_put<W, NB>(p, acc, r0, T);
#endif
}

/* ==== the batched F16 and BF16 kernel: tensor cores (CUDA sm_80+) ====
 * Against float weights, gf_mv_kernel met each 16-byte piece with every
 * row's f32 activation from L1 (256 bytes a piece at 8 rows). Here the
 * weights as they are, f16 or bf16, are the A operands of mma.sync
 * m16n8k16 straight from memory, and the activation rounded to the
 * weights' type (as quant.c's float dots round it) is B, f32 sums. The
 * order of k within a k-step is free as long as A and B agree: lane
 * (gq = lane/4, c = lane%4) loads 16 bytes of each of its rows gq, gq + 8
 * at columns 32j + 8c .. +7 (a quad's 64 bytes of a row in one run), the
 * first four k-step 2j's and the last four 2j + 1's, and its B from the
 * same columns of token 8b + gq. A block is gf_mvq_kernel's: a 16-row
 * tile, its warps taking the chunks of 32 columns in turn, GF_MVH_U of
 * them loaded before any is used and the next GF_MVH_U in flight during
 * their sums, the first before the wait (weights are no kernel's output). */
#define GF_MVH_U 4

template <bool BF, int NB>   /* bf16 weights, else f16; token tiles of 8 */
__global__ void __launch_bounds__(GF_MVQ_WARPS * GPU_WARP, NB == 1 ? 3 : 2) gf_mvh_kernel(gf_mv p)
{
    GPU_TRACE(GT_MVH);
#if __CUDA_ARCH__ >= 800
    enum { W = GF_MVQ_WARPS, U = GF_MVH_U };
    int warp = threadIdx.x / GPU_WARP, lane = threadIdx.x % GPU_WARP, gq = lane / 4, c = lane % 4;
    int total = p.end[p.parts - 1], r0 = blockIdx.x * 16, nch = p.n / 32, T = p.t_total;
    const int4 *w[2];   /* the lane's rows gq, gq + 8 (past the end: the last row, not written) */
#pragma unroll
    for (int j = 0; j < 2; j++) {
        int rr, pt = gf_mv_part(p, min(r0 + gq + 8 * j, total - 1), &rr);
        w[j] = (const int4 *)(p.w[pt] + (size_t)rr * p.ldw) + c;
    }
    int4 a[U][2];   /* chunks ch, ch + W, ... (past the row: not loaded, not used) */
    auto fetch = [&](int ch) {
#pragma unroll
        for (int u = 0; u < U; u++)
            if (ch + u * W < nch)
#pragma unroll
                for (int j = 0; j < 2; j++)
                    a[u][j] = gf_ld_stream(w[j] + 4 * (ch + u * W));
    };
    fetch(warp);
    gf_pdl_begin();
    /* token 8b + gq's columns 8c.. (tokens past T: the last one's, never stored) */
    const float *x[NB];
#pragma unroll
    for (int b = 0; b < NB; b++)
        x[b] = p.af + (size_t)min(8 * b + gq, T - 1) * p.n + 8 * c;
    float acc[NB][4] = {};
    for (int ch = warp; ch < nch; ch += U * W) {
        int4 cur[U][2];
#pragma unroll
        for (int u = 0; u < U; u++)
            cur[u][0] = a[u][0], cur[u][1] = a[u][1];
        fetch(ch + U * W);
#pragma unroll
        for (int u = 0; u < U; u++) {
            int k = ch + u * W;
            if (k >= nch)
                break;
            const int4 &ra = cur[u][0], &rb = cur[u][1];
            const uint32_t a0[4] = {(uint32_t)ra.x, (uint32_t)rb.x, (uint32_t)ra.y, (uint32_t)rb.y};
            const uint32_t a1[4] = {(uint32_t)ra.z, (uint32_t)rb.z, (uint32_t)ra.w, (uint32_t)rb.w};
#pragma unroll
            for (int b = 0; b < NB; b++) {
                float4 x0 = *(const float4 *)(x[b] + 32 * k), x1 = *(const float4 *)(x[b] + 32 * k + 4);
                gpu_mma16816<BF>(acc[b], a0, gpu_pack16<BF>(x0.x, x0.y), gpu_pack16<BF>(x0.z, x0.w));
                gpu_mma16816<BF>(acc[b], a1, gpu_pack16<BF>(x1.x, x1.y), gpu_pack16<BF>(x1.z, x1.w));
            }
        }
    }
    gf_tile_put<W, NB>(p, acc, r0, T);
#endif
}

/* ==== a prompt's MoE experts on tensor cores (CUDA sm_80+) ====
 * A prompt chunk's (token, expert) pairs sorted by expert
 * (gf_moe_sort_kernel: expert e's are rows offs[e] .. offs[e+1] - 1 of the
 * gathered activation), each against its expert's matrices with
 * gf_mvq_kernel's units: the weights as mma A operands straight from
 * memory into registers, the rows' int8 activation as B. gpu_gemm decodes
 * each weight tile to f16 in shared memory for every 32 rows, which at
 * ~32 rows an expert (512 tokens, 128 experts) ran the experts at ~36
 * TFLOP/s (BENCH.md, sixth pass). Block (x, e): GF_MVX_WARPS warps, each
 * a 16-row tile of expert e's rows (across the parts as gf_mv's: gate and
 * up) walking all its units, the next unit's loads before this one's
 * arithmetic and the first before the wait (the expert is blockIdx.y,
 * no kernel's output); e's rows in tiles of 8·NB, each lane storing its
 * own sums; no barrier, so a warp past the rows leaves. The activation's
 * blocks lie in gq_act_at's layout of bt = all the rows side by side, so
 * that a warp's B operand (8 rows of a block) is one run of 256 bytes:
 * rows in turn cost 8 L1 wavefronts an operand instead of 2, and a
 * 512-token prompt 30% of its speed (BENCH.md, twenty-ninth pass). */
#define GF_MVX_WARPS 4

template <class F, int NB>
__global__ void __launch_bounds__(GF_MVX_WARPS * GPU_WARP, 3) gf_mvx_kernel(gf_mv p, const int32_t *offs)
{
    GPU_TRACE(GT_MVX);
#if __CUDA_ARCH__ >= 800
    int warp = threadIdx.x / GPU_WARP, lane = threadIdx.x % GPU_WARP, gq = lane / 4, c = lane % 4;
    int e = blockIdx.y, total = p.end[p.parts - 1], nsb = p.n / F::COLS;
    int r0 = (blockIdx.x * GF_MVX_WARPS + warp) * 16;
    const uint8_t *w[2];   /* the lane's rows gq, gq + 8 (past the end: the last row, not written) */
    int pt[2], rr[2];
#pragma unroll
    for (int j = 0; j < 2; j++) {
        pt[j] = gf_mv_part(p, min(r0 + gq + 8 * j, total - 1), &rr[j]);
        w[j] = p.w[pt[j]] + (size_t)e * p.estride + (size_t)rr[j] * p.ldw;
    }
    F f[2];
    if (r0 < total)
        gf_mvq_fetch(w, 0, c, f);
    gf_pdl_begin();
    int a0 = offs[e], m = offs[e + 1] - a0;
    if (r0 >= total)
        return;
    for (int t0 = 0; t0 < m; t0 += 8 * NB) {
        int tt = min(m - t0, 8 * NB);   /* the tile's rows */
        const gf_act_src src(p, a0 + t0, 1, p.bt, gf_lane_b<F>(), gq, c);
        float acc[NB][4] = {};
        /* the next unit's loads, unit 0 after the last (the next tile's,
         * or one unused fetch: no branch around the loads) */
        for (int sb = 0; sb < nsb; sb++) {
            F nf[2];
            gf_mvq_fetch(w, sb + 1 < nsb ? sb + 1 : 0, c, nf);
            gf_mvq_unit<F, NB>(src, f, sb, 1, acc);
            f[0] = nf[0], f[1] = nf[1];
        }
        /* acc[b][i]: row gq + 8·(i/2), row t of the tile 8b + 2c + i%2 */
#pragma unroll
        for (int b = 0; b < NB; b++)
#pragma unroll
            for (int i = 0; i < 4; i++) {
                int t = 8 * b + 2 * c + i % 2, j = i / 2;
                if (t < tt && r0 + gq + 8 * j < total)
                    *gf_mv_at(p, pt[j], 0, a0 + t0 + t, rr[j]) = acc[b][i];
            }
    }
#endif
}

/* ==== a prompt's Q4_K and Q8_0 experts as f16 mma, the weights decoded in registers ====
 * gf_mvx_kernel's int8 mma leaves each product's sums to be scaled a
 * 32-column block at a time (the K-quants' scale and min a block, the
 * activation's scale a block and row): ~40 instructions an mma, the
 * kernel's limit at ~32 rows an expert. Here the weights are decoded
 * into f16 mma A operands with their block's scale and min applied (d·sc·q
 * − dmin·m, Q8_0's d·q, rounded to f16 as gg_mma's tiles are), so that the mma's f32
 * sums run the whole row, against the rows' activation in f16 (xh,
 * gf_half4_kernel's layout). A warp takes 32 rows (two m-tiles) of expert
 * e = blockIdx.y / S, lane (g, t4) its rows g + 8j; of each 256-column superblock
 * lane t4 takes the 32 bytes 32·t4.. of the rows' nibbles (sub-blocks
 * 2·t4, 2·t4 + 1: two scales and mins a row), each word of them four
 * columns of each of the two sub-blocks. Any order of the product's
 * columns serves when both operands follow it: a word's low nibbles
 * (columns c..c+3 of sub-block 2·t4) are the lane's k of one mma, 2t4,
 * 2t4+1 = c, c+2 and 2t4+8, 2t4+9 = c+1, c+3, its high nibbles (sub-block
 * 2·t4 + 1) another's. Q8_0 takes the same columns from blocks 2·t4 (the
 * low nibbles' columns) and 2·t4 + 1, half a superblock a step (gf_q8_h4).
 * The next superblock's (Q8_0: step's) bytes load during this one's
 * mma (its B lines asked of L1 and the one after's weights of L2 ahead:
 * not measured apart); tokens in tiles of 8·NB, tile k of expert e on
 * block (x, e·S + k % S) (S = GF_MVXH_SPLIT: an expert with many rows is
 * not a few blocks' long walk, BENCH.md forty-ninth pass), no barrier. */
#define GF_MVXH_WARPS 4
#define GF_MVXH_SPLIT 4   /* blocks an expert's row block: its token tiles dealt out among them */

/* The rows (P of them, n wide) of x in f16 as gf_mvxh_kernel reads them:
 * unit u = 16·sb + 8·side + i (of superblock sb, the word i of the low or
 * high nibbles) of row r is 16 halves at (u·P + r)·16, four for each t4:
 * the columns 256·sb + 64·t4 + 32·side + 4·i + {0, 2, 1, 3}, a lane's B
 * operand (k 2t4, 2t4+1, 2t4+8, 2t4+9) in one 8-byte load, and the 8 rows
 * of an n-tile 256 bytes in a run, whichever row the tile starts at (rows
 * in turn would take 32 L1 wavefronts a load, not 2). Thread o: unit o /
 * (4P), row o / 4 % P, t4 o % 4 (the stores in order). */
__global__ void gf_half4_kernel(const float *x, uint2 *y, int P, int n)
{
    gf_pdl_begin();
    size_t o = blockIdx.x * (size_t)blockDim.x + threadIdx.x;
    if (o >= (size_t)P * n / 4)
        return;
    int t4 = (int)(o % 4), r = (int)(o / 4 % P), u = (int)(o / 4 / P);
    int c = 256 * (u / 16) + 64 * t4 + 32 * (u / 8 % 2) + 4 * (u % 8);
    float4 v = *(const float4 *)(x + (size_t)r * n + c);
    y[o] = make_uint2(gpu_pack16(v.x, v.z), gpu_pack16(v.y, v.w));
}

/* The 8 nibbles of word w as four f16 pairs (c, c+2 and c+1, c+3 of the
 * low nibbles, then of the high), each q·s − m */
static __device__ __forceinline__ void gf_q4_h8(uint32_t w, __half2 slo, __half2 mlo, __half2 shi, __half2 mhi,
                                                uint32_t (&h)[4])
{
    const __half2 k1024 = __halves2half2(__ushort_as_half(0x6400), __ushort_as_half(0x6400));
    uint32_t v[4] = {w, w >> 8, w >> 4, w >> 12};
#pragma unroll
    for (int i = 0; i < 4; i++) {
        uint32_t x = (v[i] & 0x000f000fu) | 0x64006400u;   /* 1024 + q, exactly */
        __half2 q = __hsub2(*(__half2 *)&x, k1024);
        __half2 r = __hfma2(q, i < 2 ? slo : shi, i < 2 ? mlo : mhi);
        h[i] = *(uint32_t *)&r;
    }
}

/* Q8_0's step (half a superblock: block 2·t4 + side of each 256
 * columns) of one row, v the 9 words from its block's first (side 0: the
 * scale, then its codes two bytes off the words; side 1: the first word
 * holds the scale in its high half, the codes whole words after it): the
 * block's scale d (gf_q8_d), and word i of the codes as two f16 pairs
 * (c, c+2 and c+1, c+3), each q·d */
static __device__ __forceinline__ __half2 gf_q8_d(const uint32_t (&v)[9], int side)
{
    return __half2half2(__ushort_as_half((uint16_t)(side ? v[0] >> 16 : v[0] & 0xffff)));
}

static __device__ __forceinline__ void gf_q8_h4(const uint32_t (&v)[9], int side, int i, __half2 d, uint32_t (&h)[2])
{
    uint32_t w = side ? v[i + 1] : __funnelshift_r(v[i], v[i + 1], 16);
    const __half2 bias = __halves2half2(__ushort_as_half(0x6480), __ushort_as_half(0x6480));
    uint32_t u = w ^ 0x80808080u;   /* code + 128 as the low byte of 1024 + 128, exactly */
    uint32_t x = __byte_perm(u, 0x64646464u, 0x4240), y = __byte_perm(u, 0x64646464u, 0x4341);
    __half2 hx = __hmul2(__hsub2(*(__half2 *)&x, bias), d), hy = __hmul2(__hsub2(*(__half2 *)&y, bias), d);
    h[0] = *(uint32_t *)&hx;
    h[1] = *(uint32_t *)&hy;
}

/* One unit's mma: row j's two pairs a[j] (A: rows g + 8j, k 2t4, 2t4+1 and
 * 2t4+8, 2t4+9) against the NB token groups' B at xr[b] + off */
template <int NB>
static __device__ __forceinline__ void gf_mvxh_mma(float (&acc)[2][NB][4], const uint32_t (&a)[4][2],
                                                   const __half *const (&xr)[NB], size_t off)
{
    uint2 bx[NB];
#pragma unroll
    for (int b = 0; b < NB; b++)
        bx[b] = *(const uint2 *)(xr[b] + off);
#pragma unroll
    for (int mt = 0; mt < 2; mt++) {
        const uint32_t A[4] = {a[2 * mt][0], a[2 * mt + 1][0], a[2 * mt][1], a[2 * mt + 1][1]};
#pragma unroll
        for (int b = 0; b < NB; b++)
            gpu_mma16816(acc[mt][b], A, bx[b].x, bx[b].y);
    }
}

template <int FMT, int NB>   /* QT_Q4_K or QT_Q8_0 */
__global__ void __launch_bounds__(GF_MVXH_WARPS * GPU_WARP, 2) gf_mvxh_kernel(gf_mv p, const __half *xh, int P,
                                                                           const int32_t *offs)
{
    GPU_TRACE(GT_MVX);
#if __CUDA_ARCH__ >= 800
    int warp = threadIdx.x / GPU_WARP, lane = threadIdx.x % GPU_WARP, g = lane / 4, t4 = lane % 4;
    int e = blockIdx.y / GF_MVXH_SPLIT, split = blockIdx.y % GF_MVXH_SPLIT, total = p.end[p.parts - 1];
    int nsb = p.n / 256, r0 = (blockIdx.x * GF_MVXH_WARPS + warp) * 32;
    const uint8_t *w[4];   /* the lane's rows g + 8j (past the end: the last row, not written) */
    int pt[4], rr[4];
#pragma unroll
    for (int j = 0; j < 4; j++) {
        pt[j] = gf_mv_part(p, min(r0 + g + 8 * j, total - 1), &rr[j]);
        w[j] = p.w[pt[j]] + (size_t)e * p.estride + (size_t)rr[j] * p.ldw;
    }
    /* Q4_K: a superblock's bytes of the lane's rows: d, dmin and scales;
     * its 32 nibble bytes. Q8_0: step k's (superblock k / 2, side k % 2)
     * 9 words of each row (gf_q8_h4) */
    enum { RB = FMT == QT_Q8_0 ? 272 : 144 };   /* a row's bytes a superblock */
    int4 hd[4], q0[4], q1[4];
    uint32_t v8[4][9];
    auto fetch = [&](int k) {
#pragma unroll
        for (int j = 0; j < 4; j++) {
            if constexpr (FMT == QT_Q8_0) {
                const uint32_t *b = (const uint32_t *)(w[j] + (size_t)(k / 2) * RB + 68 * t4 + 32 * (k % 2));
#pragma unroll
                for (int i = 0; i < 9; i++)
                    v8[j][i] = b[i];
            } else {
                const uint8_t *b = w[j] + (size_t)k * RB;
                hd[j] = *(const int4 *)b;
                q0[j] = *(const int4 *)(b + 16 + 32 * t4);
                q1[j] = *(const int4 *)(b + 32 + 32 * t4);
            }
        }
    };
    if (r0 < total)
        fetch(0);
    gf_pdl_begin();
    int a0 = offs[e], m = offs[e + 1] - a0;
    if (r0 >= total)
        return;
    for (int t0 = 8 * NB * split; t0 < m; t0 += 8 * NB * GF_MVXH_SPLIT) {
        int tt = min(m - t0, 8 * NB);   /* the tile's rows */
        const __half *xr[NB];           /* token 8b + g's unit 0, the lane's four (past the tile: its last row) */
#pragma unroll
        for (int b = 0; b < NB; b++)
            xr[b] = xh + (size_t)(a0 + t0 + min(8 * b + g, tt - 1)) * 16 + 4 * t4;
        size_t us = (size_t)16 * P;     /* a unit's halves */
        /* superblock sb's B bytes of the tile (16 units of up to 32 rows:
         * 128 lines of 128 bytes) asked of L1 a superblock ahead, a line a
         * thread, so that the B loads, each just before its mma, find them
         * there and not in L2 */
        int pl = threadIdx.x % 128;
        const __half *pf = xh + (size_t)(pl / 8) * us + (size_t)min(a0 + t0 + 4 * (pl % 8), P - 1) * 16;
        auto ahead = [&](int sb) {
            if (threadIdx.x < 128 && sb < nsb)
                asm volatile("prefetch.global.L1 [%0];" ::"l"(pf + (size_t)sb * 16 * us));
        };
        /* and the weights two superblocks ahead asked of L2 (lane t4 row t4's RB bytes) */
        const uint8_t *wl = t4 == 0 ? w[0] : t4 == 1 ? w[1] : t4 == 2 ? w[2] : w[3];
        ahead(0);
        float acc[2][NB][4] = {};
        for (int sb = 0; sb < nsb; sb++) {
            ahead(sb + 1);
            if (sb + 2 < nsb) {   /* (every line of the row's bytes: Q8_0's 272 may touch four) */
                asm volatile("prefetch.global.L2 [%0];\n\tprefetch.global.L2 [%1];"
                             ::"l"(wl + (size_t)(sb + 2) * RB), "l"(wl + (size_t)(sb + 2) * RB + RB - 1));
                if constexpr (FMT == QT_Q8_0)
                    asm volatile("prefetch.global.L2 [%0];\n\tprefetch.global.L2 [%1];"
                                 ::"l"(wl + (size_t)(sb + 2) * RB + 128), "l"(wl + (size_t)(sb + 2) * RB + 256));
            }
            if constexpr (FMT == QT_Q8_0) {
#pragma unroll
                for (int side = 0; side < 2; side++) {
                    uint32_t v[4][9];
#pragma unroll
                    for (int j = 0; j < 4; j++)
#pragma unroll
                        for (int i = 0; i < 9; i++)
                            v[j][i] = v8[j][i];
                    int k = 2 * sb + side + 1;
                    fetch(k < 2 * nsb ? k : 0);   /* the next step (the next tile's first) */
                    __half2 d[4];
#pragma unroll
                    for (int j = 0; j < 4; j++)
                        d[j] = gf_q8_d(v[j], side);
#pragma unroll
                    for (int i = 0; i < 8; i++) {
                        uint32_t a[4][2];   /* row j's word i: its two pairs */
#pragma unroll
                        for (int j = 0; j < 4; j++)
                            gf_q8_h4(v[j], side, i, d[j], a[j]);
                        gf_mvxh_mma<NB>(acc, a, xr, (16 * sb + 8 * side + i) * us);
                    }
                }
                continue;
            }
            int4 h[4] = {hd[0], hd[1], hd[2], hd[3]}, u0[4] = {q0[0], q0[1], q0[2], q0[3]};
            int4 u1[4] = {q1[0], q1[1], q1[2], q1[3]};
            fetch(sb + 1 < nsb ? sb + 1 : 0);   /* the next superblock (the next tile's first) */
            __half2 slo[4], mlo[4], shi[4], mhi[4];
#pragma unroll
            for (int j = 0; j < 4; j++) {
                /* the scale bytes: 0..7 in lo, 8..11 in hi */
                uint64_t lo = (uint32_t)h[j].y | (uint64_t)(uint32_t)h[j].z << 32;
                uint32_t hi = (uint32_t)h[j].w;
                auto sb8 = [lo, hi](int k) { return (int)((k < 8 ? lo >> (8 * k) : hi >> (8 * (k - 8))) & 255); };
                int sc0, m0, sc1, m1;
                gf_k4_sm(2 * t4, sb8, &sc0, &m0);
                gf_k4_sm(2 * t4 + 1, sb8, &sc1, &m1);
                float d = gf_h2f((uint16_t)h[j].x), dm = gf_h2f((uint16_t)((uint32_t)h[j].x >> 16));
                slo[j] = __float2half2_rn(d * (float)sc0), mlo[j] = __float2half2_rn(-dm * (float)m0);
                shi[j] = __float2half2_rn(d * (float)sc1), mhi[j] = __float2half2_rn(-dm * (float)m1);
            }
#pragma unroll
            for (int i = 0; i < 8; i++) {
                uint32_t a[4][4];   /* row j's word i: its four pairs */
#pragma unroll
                for (int j = 0; j < 4; j++) {
                    const int4 &u = i < 4 ? u0[j] : u1[j];
                    int wd = (i & 3) == 0 ? u.x : (i & 3) == 1 ? u.y : (i & 3) == 2 ? u.z : u.w;
                    gf_q4_h8((uint32_t)wd, slo[j], mlo[j], shi[j], mhi[j], a[j]);
                }
#pragma unroll
                for (int side = 0; side < 2; side++) {
                    uint32_t as[4][2];
#pragma unroll
                    for (int j = 0; j < 4; j++)
                        as[j][0] = a[j][2 * side], as[j][1] = a[j][2 * side + 1];
                    gf_mvxh_mma<NB>(acc, as, xr, (16 * sb + 8 * side + i) * us);
                }
            }
        }
        /* acc[mt][b][i]: row 16mt + g + 8·(i/2), token 8b + 2t4 + i%2 */
#pragma unroll
        for (int mt = 0; mt < 2; mt++)
#pragma unroll
            for (int b = 0; b < NB; b++)
#pragma unroll
                for (int i = 0; i < 4; i++) {
                    int t = 8 * b + 2 * t4 + i % 2, j = 2 * mt + i / 2;
                    if (t < tt && r0 + g + 8 * j < total)
                        *gf_mv_at(p, pt[j], 0, a0 + t0 + t, rr[j]) = acc[mt][b][i];
                }
    }
#endif
}
#endif

/* ==== activations: RMSNorm / SwiGLU / plain, then int8 blocks ==== */

enum { GF_ACT_PLAIN, GF_ACT_NORM, GF_ACT_SWIGLU };

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

/* ---- launches ---- */

#define GF_LAUNCH_CHECK(err, errlen) GPU_TRY(gpuGetLastError(), err, errlen)

static int gf_env(const char *name)
{
    const char *v = getenv(name);
    return v && *v && strcmp(v, "0") != 0;
}

/* the column slices of rows n wide at UL units a lane (a unit: 64 columns) */
static int gf_mvk_slices(int n, int UL)
{
    return (n / 256 * 4 + UL * GPU_WARP - 1) / (UL * GPU_WARP);
}

/* the Q4_K decode kernel for rows of n columns: UL units a lane, S slices
 * (0 when the rows are too wide for it) */
static int gf_mvk_shape(int n, int *UL)
{
    *UL = n / 256 * 4 <= GPU_WARP ? 1 : 2;
    int S = gf_mvk_slices(n, *UL);
    return S <= GF_MVK_WIDE ? S : 0;
}

/* Launches kernel k with programmatic dependent launch where the device has
 * it (sm_90+; STRATA_GPU_NO_PDL=1 turns it off) and the kernel starts with
 * gf_pdl_begin; a plain launch elsewhere. */
#ifdef GPU_CUDA
static int gf_pdl_ok(void)
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
static int gf_sms(void)
{
    int arch = 0, sms = 0;
    return gpu_device_facts(&arch, &sms) == gpuSuccess ? sms : 0;
}

/* the device's SMs, and in *per_sm the blocks of k an SM holds (asked
 * once; left 0 if the query fails) */
template <typename... P>
static int gf_per_sm(void (*k)(P...), int threads, int smem, int *per_sm)
{
    int sms = gf_sms(), b = 0;
    if (!*per_sm && sms > 0 && gpuOccupancyMaxActiveBlocksPerMultiprocessor(&b, k, threads, smem) == gpuSuccess &&
        b > 0)
        *per_sm = b;
    return sms;
}

/* The column-sliced kernels' grid: one wave of the blocks of kernel k
 * resident at once (*per_sm: how many an SM holds, asked once) over the
 * groups, at most a block a tile. (Rounded up: the 30B-A3B's gate/up
 * experts get 8 groups of 83 blocks where 660 fit; rounded down, 82, was
 * 1.3% slower, BENCH.md, twentieth pass. A failed query: one block a
 * group; the launch's own error check reports a broken device.) */
static dim3 gf_wave(void (*k)(gf_mv), int threads, int smem, int *per_sm, int groups, int tiles)
{
    int sms = gf_per_sm(k, threads, smem, per_sm);
    int blocks = *per_sm ? (sms * *per_sm + groups - 1) / groups : 1;
    return dim3(blocks < tiles ? blocks : tiles, groups);
}

/* A column-sliced kernel's grid: a block for each GF_AB rows where it hands
 * on a norm, or two (p->pair, gf_pair_meet: CUDA sm_90, where twice the
 * blocks are still one wave; STRATA_GPU_NO_PAIRS=1: one, the same sums),
 * else one wave (gf_wave) over tiles of rt rows */
template <int NORM>
static dim3 gf_sliced_grid(void (*k)(gf_mv), int threads, int smem, int *per_sm, gf_mv *p, int groups, int rt)
{
    int total = p->end[p->parts - 1], blocks = (total + GF_AB - 1) / GF_AB;
    if (NORM != GF_NORM_OUT)
        return gf_wave(k, threads, smem, per_sm, groups, (total + rt - 1) / rt);
    p->pair = 0;
#ifdef GPU_CUDA
    int arch = 0, sms = 0;
    if (gpu_device_facts(&arch, &sms) == gpuSuccess && arch >= 90 && !gf_env("STRATA_GPU_NO_PAIRS")) {
        gf_per_sm(k, threads, smem, per_sm);
        p->pair = 2 * blocks * groups <= sms * *per_sm;
    }
#endif
    return dim3(blocks << p->pair, groups);
}

/* a column-sliced kernel's launch, its blocks in clusters of two where
 * they pair */
static void gf_launch_sliced(void (*k)(gf_mv), dim3 grid, int threads, int smem, gpuStream_t s, const gf_mv &p)
{
#ifdef GPU_CUDA
    (void)gpu_launch_cl(k, grid, threads, smem, s, gf_pdl_ok(), 1 + p.pair, p);
#else
    (void)gpu_launch(k, grid, threads, smem, s, 0, p);
#endif
}

/* the slices' warps of the kernels of UL units a lane past GF_MVK_SMAX
 * slices (gf_mvk_sub), which only rows of two units a lane have (UL 1 is
 * one slice, or 2-4 where a norm is handed on) */
template <int UL> struct gf_wide { enum { SUB = gf_mvk_sub(UL == 2 ? GF_MVK_WIDE : 1) }; };

template <int UL, int NORM>
static void gf_mvk_launch_n(const gf_mv &p, int groups, int S, gpuStream_t s)
{
    void (*k)(gf_mv) =
        S > GF_MVK_SMAX ? gf_mvk_kernel<UL, NORM, gf_wide<UL>::SUB> : gf_mvk_kernel<UL, NORM, GF_MVK_SUB>;
    int sub = gf_mvk_sub(S), threads = S * sub * GPU_WARP;
    static int per_sm[GF_MVK_WIDE + 1];   /* for each slice count */
    gf_mv q = p;
    dim3 grid = gf_sliced_grid<NORM>(k, threads, 0, &per_sm[S], &q, groups, gf_mvk_rt(UL, sub));
    gf_launch_sliced(k, grid, threads, 0, s, q);
}

template <int UL>
static void gf_mvk_launch(const gf_mv &p, int groups, int S, gpuStream_t s)
{
    if (p.nw)
        gf_mvk_launch_n<UL, GF_NORM_OUT>(p, groups, S, s);
    else if (p.ss)
        gf_mvk_launch_n<UL, GF_NORM_IN>(p, groups, S, s);
    else
        gf_mvk_launch_n<UL, GF_NORM_NONE>(p, groups, S, s);
}

/* gf_mvs_kernel's stage for a block of S slices, in bytes */
template <class F>
static int gf_mvs_smem(int UL, int S, bool ne)
{
    return S * gf_mvk_sub(S) * gf_mvs_nvl<F>(UL, ne) * GPU_WARP * 16;
}

/* Whether kernel k may launch with smem bytes of shared memory of its own
 * (dynamic): what passes 48 KB with the kernel's static arrays must be
 * asked for first, so every size is asked once (*asked: the most granted so
 * far). A stage of exactly 48 KB (the Q6_K experts' down of
 * 12,288 columns) failed to launch where only more was asked for. */
template <class K>
static bool gf_smem_ask(K k, int smem, int *asked)
{
    if (smem > *asked && gpuFuncSetAttribute(k, gpuFuncAttributeMaxDynamicSharedMemorySize, smem) == gpuSuccess)
        *asked = smem;
    return smem <= *asked;
}

template <class F, int UL, int NORM, bool NE>
static void gf_mvs_launch_n(const gf_mv &p, int groups, int S, gpuStream_t s)
{
    int wide = S > GF_MVK_SMAX, sub = gf_mvk_sub(S);
    void (*k)(gf_mv) =
        wide ? gf_mvs_kernel<F, UL, NORM, NE, gf_wide<UL>::SUB> : gf_mvs_kernel<F, UL, NORM, NE, GF_MVK_SUB>;
    int threads = S * sub * GPU_WARP, smem = gf_mvs_smem<F>(UL, S, NE);
    static int per_sm[GF_MVK_WIDE + 1], asked[2];   /* for each slice count; each kernel */
    (void)gf_smem_ask(k, smem, &asked[wide]);   /* (a refusal shows as the launch's error) */
    gf_mv q = p;
    dim3 grid = gf_sliced_grid<NORM>(k, threads, smem, &per_sm[S], &q, groups, sub);
    gf_launch_sliced(k, grid, threads, smem, s, q);
}

/* the staged formats with a handed-on norm's forms (gf_hand_takes) and
 * experts side by side: the common files' (Q4_K_M's and Q5_K_M's layers
 * of more bits, Q8_0, Q4_0, Q5_0, Q4_1, Q5_1 and Q5_K files); the others never take
 * part in one (each form is some dozen kernels more to compile) */
template <class F> struct gf_mvs_hands { enum { OK = 0 }; };
template <> struct gf_mvs_hands<gf_mvs_q6_K> { enum { OK = 1 }; };
template <> struct gf_mvs_hands<gf_mvs_q8_0> { enum { OK = 1 }; };
template <> struct gf_mvs_hands<gf_mvs_q5_K> { enum { OK = 1 }; };
template <int BB, bool QH, bool MIN> struct gf_mvs_hands<gf_mvs_q4<BB, QH, MIN> > { enum { OK = 1 }; };

template <class F, int UL>
static void gf_mvs_launch(const gf_mv &p, int groups, int S, gpuStream_t s)
{
    enum { H = gf_mvs_hands<F>::OK };
    if (H && p.ne && p.nw)
        gf_mvs_launch_n<F, UL, H ? GF_NORM_OUT : GF_NORM_NONE, H>(p, groups, S, s);
    else if (H && p.ne)
        gf_mvs_launch_n<F, UL, GF_NORM_NONE, H>(p, groups, S, s);
    else if (H && p.nw)
        gf_mvs_launch_n<F, UL, H ? GF_NORM_OUT : GF_NORM_NONE, false>(p, groups, S, s);
    else if (H && p.ss)
        gf_mvs_launch_n<F, UL, H ? GF_NORM_IN : GF_NORM_NONE, false>(p, groups, S, s);
    else
        gf_mvs_launch_n<F, UL, GF_NORM_NONE, false>(p, groups, S, s);
}

/* whether gf_mvs_kernel takes this product's one-row groups: rows of whole
 * superblocks of a format it has (gf_mvs_of), of one matrix, an expert
 * stack, or experts side by side of whole superblocks each (the formats
 * with a handed-on norm's forms: a Q4_K_M MoE's Q6_K experts' down, a Q8_0
 * MoE's), a stage of at most 96 KB */
template <class Q>
static int gf_mvs_takes(int n, int ne, int *UL, int *S)
{
    typedef typename gf_mvs_of<Q>::G G;
    if (!gf_mvs_of<Q>::OK || n % 256 || (ne && (!gf_mvs_hands<G>::OK || ne % 256)) || gf_env("STRATA_GPU_MV_OLD") ||
        !(*S = gf_mvk_shape(n, UL)))
        return 0;
    return gf_mvs_smem<G>(*UL, *S, ne) <= 96 * 1024;
}

/* whether gf_mvk_kernel takes one-row groups of this type and width */
static int gf_mvk_takes(int type, int n, int *UL, int *S)
{
    return type == QT_Q4_K && !gf_env("STRATA_GPU_MV_OLD") && (*S = gf_mvk_shape(n, UL)) > 0;
}

template <class Q>
static int gf_mvs_hand_takes(int n, int ne)
{
    int UL, S;
    return gf_mvs_hands<typename gf_mvs_of<Q>::G>::OK && gf_mvs_takes<Q>(n, ne, &UL, &S);
}

/* whether one token's product of this type and width (one matrix, or
 * experts side by side ne wide each) runs in a kernel with a handed-on
 * norm's forms: gf_mvk_kernel's Q4_K, gf_mvs_kernel's formats of
 * gf_mvs_hands (gf_mv_launch_t's choice for them) */
static int gf_hand_takes(int type, int n, int ne)
{
    int UL, S;
    switch (type) {
    case QT_Q4_K: return gf_mvk_takes(type, n, &UL, &S);
    case QT_Q4_0: return gf_mvs_hand_takes<gf_q4_0>(n, ne);
    case QT_Q5_0: return gf_mvs_hand_takes<gf_q5_0>(n, ne);
    case QT_Q4_1: return gf_mvs_hand_takes<gf_q4_1>(n, ne);
    case QT_Q5_1: return gf_mvs_hand_takes<gf_q5_1>(n, ne);
    case QT_Q5_K: return gf_mvs_hand_takes<gf_q5_K>(n, ne);
    case QT_Q6_K: return gf_mvs_hand_takes<gf_q6_K>(n, ne);
    case QT_Q8_0: return gf_mvs_hand_takes<gf_q8_0>(n, ne);
    default: return 0;
    }
}

#ifdef GPU_CUDA
/* the batch kernel of format Q (staged where gf_mvqs_of has its form), NB
 * token blocks of 8, the activation's layout p.bt */
template <class Q, int NB>
static void gf_mvq_launch(const gf_mv &p, dim3 grid, gpuStream_t s)
{
    typedef typename gf_mvq_of<Q>::F F;
    void (*k)(gf_mv);
    if constexpr (gf_mvqs_of<F>::OK) {
        typedef typename gf_mvqs_of<F>::S S;
        k = p.bt ? gf_mvqs_kernel<S, NB, 1> : gf_mvqs_kernel<S, NB, 0>;
    } else {
        k = p.bt ? gf_mvq_kernel<F, NB, 1> : gf_mvq_kernel<F, NB, 0>;
    }
    gf_launch(k, grid, GF_MVQ_WARPS * GPU_WARP, 0, s, p);
}
#endif

/* A norm-handing product runs rows/32 blocks: the slices of one unit a
 * lane where they fit, for twice the warps a block (0: keep UL units) */
static int gf_hand_slices(const gf_mv &p, int UL)
{
    int S1 = p.nw && UL == 2 ? gf_mvk_slices(p.n, 1) : 0;
    return S1 <= GF_MVK_SMAX ? S1 : 0;
}

/* A one-row product of float rows (not experts side by side) in 16-byte
 * pieces, every row 16-byte aligned, its activation row within
 * GF_MVF_SMEM of shared memory: gf_mvf_kernel over one wave of its blocks
 * (how many an SM holds depends on the width: asked at each launch, which
 * a graph captures once). Returns whether it took the product. */
#define GF_MVF_SMEM (128 * 1024)

template <class Q>
static bool gf_mvf_launch(const gf_mv &p, int groups, gpuStream_t s)
{
    if constexpr (!Q::FLOAT) {
        return false;
    } else {
        size_t al = p.ldw | (p.ids ? p.estride : 0);
        for (int i = 0; i < p.parts; i++)
            al |= (uintptr_t)p.w[i];
        int smem = p.n * (int)sizeof(float);
        if (p.ne || p.n % Q::BLK || al % 16 || smem > GF_MVF_SMEM || gf_env("STRATA_GPU_MV_OLD"))
            return false;
        static int asked;
        int per_sm = 0, threads = GF_MVF_WARPS * GPU_WARP, total = p.end[p.parts - 1];
        void (*k)(gf_mv) = gf_mvf_kernel<Q>;
        if (!gf_smem_ask(k, smem, &asked))   /* (a device with less: gf_mv1_kernel) */
            return false;
        gf_launch(k, gf_wave(k, threads, smem, &per_sm, groups, (total + GF_MVF_WARPS - 1) / GF_MVF_WARPS),
                  threads, smem, s, p);
        return true;
    }
}

template <class Q>
static void gf_mv_launch_t(const gf_mv &p, int groups, int nt, gpuStream_t s)
{
    int rows = p.end[p.parts - 1], UL = 0, S = 0;
    if (nt == 1 && Q::BYTES == 144 && gf_mvk_takes(QT_Q4_K, p.n, &UL, &S)) {
        int S1 = gf_hand_slices(p, UL);
        if (S1)
            UL = 1, S = S1;
        if (UL == 1)
            gf_mvk_launch<1>(p, groups, S, s);
        else
            gf_mvk_launch<2>(p, groups, S, s);
    } else if (nt == 1 && gf_mvs_takes<Q>(p.n, p.ne, &UL, &S)) {
        typedef typename gf_mvs_of<Q>::G G;
        int S1 = gf_hand_slices(p, UL);
        if (S1 && gf_mvs_smem<G>(1, S1, p.ne) <= 96 * 1024)   /* (where the stage fits) */
            UL = 1, S = S1;
        if (UL == 1)
            gf_mvs_launch<G, 1>(p, groups, S, s);
        else
            gf_mvs_launch<G, 2>(p, groups, S, s);
    } else if (nt == 1) {
        dim3 grid((rows + GF_MV1_WARPS * GF_MV1_R - 1) / (GF_MV1_WARPS * GF_MV1_R), groups);
        if ((int)(grid.x * grid.y) < gf_sms())
            gf_launch(gf_mvrow_kernel<Q>, dim3(rows, groups), GF_ROW_THREADS, 0, s, p);
        else if (!gf_mvf_launch<Q>(p, groups, s))
            gf_launch(gf_mv1_kernel<Q>, grid, GF_MV1_WARPS * GPU_WARP, 0, s, p);
    } else if (nt == GF_MMA_T) {
#ifdef GPU_CUDA
        dim3 grid((rows + 15) / 16);
        if constexpr (Q::FLOAT) {
            constexpr bool BF = std::is_same<Q, gf_bf16>::value;
            if (p.t_total > 8)
                gf_launch(gf_mvh_kernel<BF, 2>, grid, GF_MVQ_WARPS * GPU_WARP, 0, s, p);
            else
                gf_launch(gf_mvh_kernel<BF, 1>, grid, GF_MVQ_WARPS * GPU_WARP, 0, s, p);
        } else if (p.t_total > 8) {
            gf_mvq_launch<Q, 2>(p, grid, s);
        } else {
            gf_mvq_launch<Q, 1>(p, grid, s);
        }
#endif
    } else {
        dim3 grid((rows + GF_MV_WARPS - 1) / GF_MV_WARPS, groups);
        gf_launch(gf_mv_kernel<Q, GF_NT, 1>, grid, GF_MV_WARPS * GPU_WARP, 0, s, p);
    }
}

/* whether the device has the tensor cores of gf_mvq_kernel and
 * gf_mvh_kernel (CUDA sm_80+; STRATA_GPU_MV_OLD=1: never) */
static int gf_mma_ok(void)
{
#ifdef GPU_CUDA
    int arch = 0, sms = 0;
    return !gf_env("STRATA_GPU_MV_OLD") && gpu_device_facts(&arch, &sms) == gpuSuccess && arch >= 80;
#else
    return 0;   /* no tensor-core kernel in a HIP build */
#endif
}

/* whether a matrix of this type and width has gf_mvq_kernel's units (and
 * the device the tensor cores they need): the fewest rows a batch product
 * takes them for, else 0: the rows where they first beat the one-row
 * groups on the H200. For most formats that is 2 (8B Q4_0 694 tok/s
 * against 699 through gf_mvqs_kernel's stage, IQ4_NL 563 against 415,
 * IQ2_XXS 477 against 454). The groups keep 2 rows of Q2_K, Q3_K, IQ2_XS
 * and IQ3_S (8B Q2_K 678 against 536, IQ2_XS 477 against 337) and 3 of
 * IQ2_S (446 against 371; at 4 rows 539 against 519). From 8 rows the
 * units are 2-5 times as fast (BENCH.md, forty-third and forty-fourth
 * passes). */
static int gf_mvq_units(int type, int n)
{
    if (n % 256 || !gf_mma_ok())
        return 0;
    switch (type) {
    case QT_Q2_K: case QT_Q3_K: case QT_IQ2_XS: case QT_IQ3_S:
        return 3;
    case QT_IQ2_S:
        return 4;
    case QT_Q4_0: case QT_Q4_1: case QT_Q5_0: case QT_Q5_1: case QT_IQ4_NL:
    case QT_Q8_0: case QT_Q4_K: case QT_Q5_K: case QT_Q6_K: case QT_IQ4_XS:
    case QT_IQ2_XXS: case QT_IQ3_XXS:
        return 2;
    default:
        return 0;
    }
}

/* whether gf_mvq_kernel (F16 and BF16: gf_mvh_kernel) takes T rows against
 * a matrix of this type and width */
static int gf_mvq_takes(int type, int n, int T)
{
    int fl = (type == QT_F16 || type == QT_BF16) && n % 32 == 0 && gf_mma_ok();
    int least = gf_mvq_units(type, n);
    return T > 1 && T <= GF_MMA_T && ((least && T >= least) || fl);
}

/* nt: 1 (each group one activation row), GF_NT (groups of tokens) or
 * GF_MMA_T (one group of up to 16 rows: gf_mvq_kernel, where gf_mvq_takes) */
static int gf_mv_launch(int type, const gf_mv &p, int groups, int nt, gpuStream_t s, char *err, size_t errlen)
{
    switch (type) {
    case QT_F32: gf_mv_launch_t<gf_f32>(p, groups, nt, s); break;
    case QT_F16: gf_mv_launch_t<gf_f16>(p, groups, nt, s); break;
    case QT_BF16: gf_mv_launch_t<gf_bf16>(p, groups, nt, s); break;
    case QT_Q4_0: gf_mv_launch_t<gf_q4_0>(p, groups, nt, s); break;
    case QT_Q4_1: gf_mv_launch_t<gf_q4_1>(p, groups, nt, s); break;
    case QT_Q5_0: gf_mv_launch_t<gf_q5_0>(p, groups, nt, s); break;
    case QT_Q5_1: gf_mv_launch_t<gf_q5_1>(p, groups, nt, s); break;
    case QT_Q8_0: gf_mv_launch_t<gf_q8_0>(p, groups, nt, s); break;
    case QT_Q4_K: gf_mv_launch_t<gf_q4_K>(p, groups, nt, s); break;
    case QT_Q5_K: gf_mv_launch_t<gf_q5_K>(p, groups, nt, s); break;
    case QT_Q6_K: gf_mv_launch_t<gf_q6_K>(p, groups, nt, s); break;
    case QT_Q2_K: gf_mv_launch_t<gf_q2_K>(p, groups, nt, s); break;
    case QT_Q3_K: gf_mv_launch_t<gf_q3_K>(p, groups, nt, s); break;
    case QT_IQ4_NL: gf_mv_launch_t<gf_iq4_nl>(p, groups, nt, s); break;
    case QT_IQ4_XS: gf_mv_launch_t<gf_iq4_xs>(p, groups, nt, s); break;
    case QT_IQ2_XXS: gf_mv_launch_t<gf_iq<QT_IQ2_XXS> >(p, groups, nt, s); break;
    case QT_IQ2_XS: gf_mv_launch_t<gf_iq<QT_IQ2_XS> >(p, groups, nt, s); break;
    case QT_IQ2_S: gf_mv_launch_t<gf_iq<QT_IQ2_S> >(p, groups, nt, s); break;
    case QT_IQ3_XXS: gf_mv_launch_t<gf_iq<QT_IQ3_XXS> >(p, groups, nt, s); break;
    case QT_IQ3_S: gf_mv_launch_t<gf_iq<QT_IQ3_S> >(p, groups, nt, s); break;
    default:
        return strata_errf(err, errlen, "tensor type %s not supported on the GPU yet (use --device cpu)",
                           gguf_type_name(type));
    }
    GF_LAUNCH_CHECK(err, errlen);
    return 0;
}

/* Activation rows (T, n) into the int8 blocks (and f32 into yf). */
static int gf_act(gpuStream_t s, int mode, const float *x, const float *x2, const float *w, float eps, int n,
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

/* One output of gf_matmul_n: y (T, w->rows), row stride ldy, (+ bias). */
struct gf_out {
    const struct gf_mat *w;
    float *y;
    size_t ldy;
    const float *bias;
};

/* The layout (gq_act_at's bt) in which the int8 activation of T rows is
 * written for the products o: the rows' blocks side by side where every one
 * of them is a batch product of gf_mvq_kernel, else row after row, the
 * layout every other kernel reads. Each writer of c->aq sets c->abt to it
 * for the products that read what it writes. */
static int gf_act_bt(const struct gf_out *o, int n_out, int T)
{
    for (int i = 0; i < n_out; i++)
        if (!gf_mvq_takes(o[i].w->type, o[i].w->n, T))
            return 0;
    return T;
}

/* A handed-on norm's fields on a product's launch (gf_hand_begin): the
 * one product into x that hands it on, or a launch of its readers (one for
 * each type among them: Q4_K_M's q and k beside a Q6_K v); the caller
 * spends it after their launches (c->handed = 0) */
static void gf_mv_hand(struct gpu_ctx *c, gf_mv *p)
{
    if (c->hand_w)
        p->nw = c->hand_w, p->nq = c->nq, p->nds = c->nds, p->nss = c->nss;
    if (c->handed)
        p->aq = c->nq, p->ads = c->nds, p->ss = c->nss, p->ss_n = p->n / GF_AB, p->eps = c->g->hp.rms_eps;
}

/* A Q4_K product and a Q6_K one of one token and one width (p[0], p[1] of
 * types t[0], t[1], either order) in one launch of gf_mv2_kernel, the
 * blocks of one wave shared in proportion to their bytes: whether it took
 * them. STRATA_GPU_NO_MV2=1: never (a launch each). */
static int gf_mv2_launch(const gf_mv *p, const int *t, gpuStream_t s)
{
    int a = t[0] == QT_Q4_K ? 0 : 1, UL, S, UL2, S2;   /* a: the Q4_K product, b the Q6_K one */
    const gf_mv &pa = p[a], &pb = p[1 - a];
    if (t[a] != QT_Q4_K || t[1 - a] != QT_Q6_K || pa.n != pb.n || pa.nw || pb.nw || pa.ne || pb.ne ||
        !gf_mvk_takes(QT_Q4_K, pa.n, &UL, &S) || !gf_mvs_takes<gf_q6_K>(pb.n, 0, &UL2, &S2) || UL != UL2 ||
        S != S2 || S > GF_MVK_SMAX || gf_env("STRATA_GPU_NO_MV2"))
        return 0;
    void (*k)(gf_mv, gf_mv, int) = UL == 1 ? (pa.ss ? gf_mv2_kernel<gf_mvs_q6_K, 1, GF_NORM_IN>
                                                    : gf_mv2_kernel<gf_mvs_q6_K, 1, GF_NORM_NONE>)
                                           : (pa.ss ? gf_mv2_kernel<gf_mvs_q6_K, 2, GF_NORM_IN>
                                                    : gf_mv2_kernel<gf_mvs_q6_K, 2, GF_NORM_NONE>);
    int threads = S * GF_MVK_SUB * GPU_WARP, smem = gf_mvs_smem<gf_mvs_q6_K>(UL, S, false);
    static int per_sm[2][2], asked[2][2];   /* for each UL and norm */
    int f = pa.ss != NULL, *ps = &per_sm[UL - 1][f];
    if (!gf_smem_ask(k, smem, &asked[UL - 1][f]))
        return 0;
    int sms = gf_per_sm(k, threads, smem, ps), wave = sms * (*ps ? *ps : 1);
    int ra = pa.end[pa.parts - 1], rb = pb.end[pb.parts - 1], rt = gf_mvk_rt(UL, GF_MVK_SUB);   /* tiles: rt rows, */
    int ta = (ra + rt - 1) / rt, tb = (rb + GF_MVK_SUB - 1) / GF_MVK_SUB;   /* and GF_MVK_SUB */
    double ba = (double)ra * pa.ldw, bb = (double)rb * pb.ldw;
    int nb = (int)(wave * bb / (ba + bb) + 0.5);
    nb = nb < 1 ? 1 : nb > tb ? tb : nb;
    int na = wave - nb < 1 ? 1 : wave - nb > ta ? ta : wave - nb;
    gf_launch(k, dim3(na + nb), threads, smem, s, pa, pb, na);
    return 1;
}

/* For each o[i]: o[i].y = W_i · the T activation rows (af f32, and the same
 * rows quantised in c->aq/c->ads) (+ bias) (+ y when accumulate). gpu_gemm
 * takes prompts whose type it supports; the matrix-vector kernels the rest,
 * matrices of one type and width in one launch. */
static int gf_matmul_n(struct gpu_ctx *c, const struct gf_out *o, int n_out, const float *af, int T,
                       int accumulate, char *err, size_t errlen)
{
    int done[GF_PARTS] = {0};
    for (int i = 0; i < n_out; i++) {
        const struct gf_mat *w = o[i].w;
        if (!(T > GF_DECODE_T && c->gemm_ok && gpu_gemm_supports(w->type)))
            continue;
        float *dst = accumulate ? c->tmp : o[i].y;
        if (gpu_gemm(w->type, w->d, w->ldw, w->n, w->rows, af, T, dst, o[i].ldy, c->gemm_scratch, c->stream, err,
                     errlen) != 0) {
            c->gemm_ok = 0;   /* not written yet / failed: the matrix-vector kernels from now on */
            continue;
        }
        if (accumulate || o[i].bias) {
            size_t total = (size_t)T * w->rows, blocks = (total + 255) / 256;
            gf_launch(gf_add_kernel, (unsigned)(blocks < 4096 ? blocks : 4096), 256, 0, c->stream,
                o[i].y, accumulate ? dst : NULL, o[i].bias, w->rows, total);
            GF_LAUNCH_CHECK(err, errlen);
        }
        done[i] = 1;
    }
    gf_mv ps[GF_PARTS];   /* the launches: a product of each type and width */
    int types[GF_PARTS], nts[GF_PARTS], np = 0;
    for (int i = 0; i < n_out; i++) {
        if (done[i])
            continue;
        gf_mv &p = ps[np];
        memset(&p, 0, sizeof p);
        const struct gf_mat *w = o[i].w;
        /* 2..GF_DECODE_T rows (a batch step, a short prompt): gf_mvq_units' formats on tensor
         * cores; else as one-row groups of the decode kernels where those beat
         * gf_mv_kernel's 8-row blocks on the H200 (BENCH.md: Q4_K's gf_mvk up
         * to 16 rows, 1.4-1.8x; the staged kernel at 2 rows, 1.3x, but not at
         * 4 or 8); else 8-row blocks */
        int groups = T <= GF_DECODE_T && (w->type == QT_Q4_K || T <= 2) && !gf_env("STRATA_GPU_MV_OLD");
        int nt = T == 1 ? 1 : gf_mvq_takes(w->type, w->n, T) ? GF_MMA_T : groups ? 1 : GF_NT;
        if (c->abt && nt != GF_MMA_T)   /* (a writer's gf_act_bt over other products than these) */
            return strata_errf(err, errlen, "GPU: a %s product reads an activation laid out for batch products",
                               gguf_type_name(w->type));
        p.ldw = w->ldw, p.estride = w->stride, p.n = w->n;
        p.aq = c->aq, p.ads = c->ads, p.bt = c->abt, p.af = af;
        p.a_div = 1, p.a_g = nt, p.t_total = T, p.accumulate = accumulate;
        for (int j = i; j < n_out; j++) {
            const struct gf_mat *wj = o[j].w;
            if (done[j] || wj->type != w->type || wj->n != w->n || wj->ldw != w->ldw)
                continue;
            int k = p.parts++;
            p.w[k] = wj->d;
            p.end[k] = (k ? p.end[k - 1] : 0) + wj->rows;
            p.y[k] = o[j].y, p.y_t[k] = o[j].ldy, p.y_g[k] = (size_t)nt * o[j].ldy, p.bias[k] = o[j].bias;
            done[j] = 1;
        }
        for (int k = p.parts; k < GF_PARTS; k++)
            p.end[k] = p.end[p.parts - 1];
        gf_mv_hand(c, &p);
        types[np] = w->type, nts[np++] = nt;
    }
    if (np == 2 && T == 1 && gf_mv2_launch(ps, types, c->stream))
        np = 0;
    for (int i = 0; i < np; i++)
        if (gf_mv_launch(types[i], ps[i], (T + nts[i] - 1) / nts[i], nts[i], c->stream, err, errlen))
            return -1;
    c->handed = 0;
    return 0;
}

/* Expert matrices: group i (of n_groups = T*U) multiplies expert sel[i] of
 * each stack w[k] by activation row i / a_div into y[k] + i*rows: the gate
 * and up stacks in one launch when they share type and shape. */
static int gf_matmul_experts(struct gpu_ctx *c, const struct gf_mat *const *w, float *const *y, int n_w,
                             const float *af, int a_div, int n_groups, char *err, size_t errlen)
{
    for (int i = 0; i < n_w;) {
        gf_mv p;
        memset(&p, 0, sizeof p);
        p.ldw = w[i]->ldw, p.estride = w[i]->stride, p.n = w[i]->n;
        p.ids = c->sel, p.aq = c->aq, p.ads = c->ads, p.af = af;
        p.a_div = a_div, p.a_g = 1, p.t_total = n_groups;
        int j = i;
        for (; j < n_w && j - i < GF_PARTS && w[j]->type == w[i]->type && w[j]->n == w[i]->n &&
               w[j]->ldw == w[i]->ldw && w[j]->stride == w[i]->stride && w[j]->rows == w[i]->rows; j++) {
            int k = p.parts++;
            p.w[k] = w[j]->d, p.end[k] = (k ? p.end[k - 1] : 0) + w[j]->rows;
            p.y[k] = y[j], p.y_g[k] = (size_t)w[j]->rows;
        }
        for (int k = p.parts; k < GF_PARTS; k++)
            p.end[k] = p.end[p.parts - 1];
        if (gf_mv_launch(w[i]->type, p, n_groups, 1, c->stream, err, errlen))
            return -1;
        i = j;
    }
    return 0;
}

#ifdef GPU_CUDA
/* gf_mvx_kernel's token tiles for an average of avg rows an expert: 8·NB
 * rows, 16 where most experts have fewer, else 32 (64 held more registers
 * than a thread has, 255, and spilled) */
template <class Q>   /* (Q: the decode format; gf_mvq_of its units) */
static void gf_mvx_launch(const gf_mv &p, dim3 grid, int avg, const int32_t *offs, gpuStream_t s)
{
    typedef typename gf_mvq_of<Q>::F F;
    int threads = GF_MVX_WARPS * GPU_WARP;
    if (avg <= 8)
        gf_launch(gf_mvx_kernel<F, 2>, grid, threads, 0, s, p, offs);
    else
        gf_launch(gf_mvx_kernel<F, 4>, grid, threads, 0, s, p, offs);
}
#endif

/* Whether gf_mvx takes the stacks w as f16 mma (gf_mvxh_kernel): Q4_K, or
 * Q8_0 rows of whole 256 columns, all of one type, whose rows' f32
 * activation it reads, not the int8 one */
static int gf_mvxh_takes(const struct gf_mat *const *w, int n_w)
{
    for (int k = 0; k < n_w; k++) {
        int t = w[k]->type;
        if (t != w[0]->type || !(t == QT_Q4_K || (t == QT_Q8_0 && w[k]->n % 256 == 0)))
            return 0;
    }
    return 1;
}

/* Whether the n pairs of a prompt's experts of layer ly (X experts) take
 * gf_mvx (gf_mvx_kernel, or gf_mvxh_kernel for Q4_K and Q8_0): every stack in a format with gf_mvq_kernel's units, and
 * the rows an expert on average times a weight's bytes at most
 * GF_MVX_BYTES in each (STRATA_GPU_MOE_GEMM=1: gpu_gemm's products, for
 * comparisons). Each tile of 32 rows reads the expert's weights again,
 * where gpu_gemm's f16 tiles pay off with more rows, so the crossing
 * falls with the weights' bytes: on the H200's 30B-A3B gpu_gemm ran at
 * 64 rows an expert (36 bytes in the 4.5-bit types) level with
 * gf_mvx_kernel in Q4_K, 1.09 times its speed in IQ4_NL and 1.34 in
 * Q4_0; gf_mvx_kernel was faster at 32 rows in Q4_K and in Q8_0 (34
 * bytes; BENCH.md, twenty-ninth, thirty-first, forty-fifth and
 * forty-sixth passes). gf_mvxh_kernel, 1.2 times gf_mvx_kernel's speed
 * at 32 rows in Q4_K and Q8_0 (forty-ninth and fifty-first: the MoE
 * prompt +21% and +22%), keeps its threshold: the crossing with gpu_gemm
 * is not measured again. */
#define GF_MVX_BYTES 35.0
static int gf_mvx_takes(const struct gf_layer *ly, int n, int X)
{
    const struct gf_mat *w[3] = { &ly->gate_exps, &ly->up_exps, &ly->down_exps };
    for (int k = 0; k < 3; k++)
        if (!gf_mvq_units(w[k]->type, w[k]->n) || (double)n / X * w[k]->ldw / w[k]->n > GF_MVX_BYTES)
            return 0;
    return !gf_env("STRATA_GPU_MOE_GEMM");
}

/* The experts' products of a prompt's n pairs, sorted by expert (c->offs):
 * each expert's rows of the activation against that expert of each stack
 * w[k] (one type and width) into y[k], ldy a row, the stacks in one
 * launch: Q4_K and Q8_0 (gf_mvxh_takes) the rows' f32 activation xf, in f16 in
 * c->gemm_scratch (gf_mvxh_kernel), the other types its int8 blocks
 * (c->aq, c->ads; gq_act_at's layout of bt = n; gf_mvx_kernel) */
static int gf_mvx(struct gpu_ctx *c, const struct gf_mat *const *w, float *const *y, int n_w, size_t ldy, int n,
                  const float *xf, char *err, size_t errlen)
{
    gf_mv p;
    memset(&p, 0, sizeof p);
    p.ldw = w[0]->ldw, p.estride = w[0]->stride, p.n = w[0]->n, p.aq = c->aq, p.ads = c->ads, p.bt = n;
    p.parts = n_w;
    for (int k = 0; k < GF_PARTS; k++) {
        p.end[k] = (k ? p.end[k - 1] : 0) + (k < n_w ? w[k]->rows : 0);
        if (k < n_w)
            p.w[k] = w[k]->d, p.y[k] = y[k], p.y_t[k] = ldy;
    }
#ifdef GPU_CUDA
    int X = c->g->hp.n_expert, avg = (n + X - 1) / X;
    const int32_t *offs = c->offs;
    if (gf_mvxh_takes(w, n_w)) {
        size_t n4 = (size_t)n * p.n / 4;
        const __half *xh = (const __half *)c->gemm_scratch;
        gf_launch(gf_half4_kernel, (unsigned)((n4 + 255) / 256), 256, 0, c->stream, xf, (uint2 *)c->gemm_scratch, n,
                  p.n);
        dim3 grid((p.end[n_w - 1] + 32 * GF_MVXH_WARPS - 1) / (32 * GF_MVXH_WARPS), X * GF_MVXH_SPLIT);
        int q8 = w[0]->type == QT_Q8_0;
        void (*k)(gf_mv, const __half *, int, const int32_t *) =
            avg <= 8 ? (q8 ? gf_mvxh_kernel<QT_Q8_0, 2> : gf_mvxh_kernel<QT_Q4_K, 2>)
                     : (q8 ? gf_mvxh_kernel<QT_Q8_0, 4> : gf_mvxh_kernel<QT_Q4_K, 4>);
        gf_launch(k, grid, GF_MVXH_WARPS * GPU_WARP, 0, c->stream, p, xh, n, offs);
        GF_LAUNCH_CHECK(err, errlen);
        return 0;
    }
    dim3 grid((p.end[n_w - 1] + 16 * GF_MVX_WARPS - 1) / (16 * GF_MVX_WARPS), X);
    switch (w[0]->type) {   /* (gf_mvx_takes: one of gf_mvq_units' types) */
    case QT_Q4_0: gf_mvx_launch<gf_q4_0>(p, grid, avg, offs, c->stream); break;
    case QT_Q4_1: gf_mvx_launch<gf_q4_1>(p, grid, avg, offs, c->stream); break;
    case QT_Q5_0: gf_mvx_launch<gf_q5_0>(p, grid, avg, offs, c->stream); break;
    case QT_Q5_1: gf_mvx_launch<gf_q5_1>(p, grid, avg, offs, c->stream); break;
    case QT_Q2_K: gf_mvx_launch<gf_q2_K>(p, grid, avg, offs, c->stream); break;
    case QT_Q3_K: gf_mvx_launch<gf_q3_K>(p, grid, avg, offs, c->stream); break;
    case QT_Q4_K: gf_mvx_launch<gf_q4_K>(p, grid, avg, offs, c->stream); break;
    case QT_Q5_K: gf_mvx_launch<gf_q5_K>(p, grid, avg, offs, c->stream); break;
    case QT_Q6_K: gf_mvx_launch<gf_q6_K>(p, grid, avg, offs, c->stream); break;
    case QT_IQ4_NL: gf_mvx_launch<gf_iq4_nl>(p, grid, avg, offs, c->stream); break;
    case QT_IQ4_XS: gf_mvx_launch<gf_iq4_xs>(p, grid, avg, offs, c->stream); break;
    case QT_IQ2_XXS: gf_mvx_launch<gf_iq<QT_IQ2_XXS> >(p, grid, avg, offs, c->stream); break;
    case QT_IQ2_XS: gf_mvx_launch<gf_iq<QT_IQ2_XS> >(p, grid, avg, offs, c->stream); break;
    case QT_IQ2_S: gf_mvx_launch<gf_iq<QT_IQ2_S> >(p, grid, avg, offs, c->stream); break;
    case QT_IQ3_XXS: gf_mvx_launch<gf_iq<QT_IQ3_XXS> >(p, grid, avg, offs, c->stream); break;
    case QT_IQ3_S: gf_mvx_launch<gf_iq<QT_IQ3_S> >(p, grid, avg, offs, c->stream); break;
    default: gf_mvx_launch<gf_q8_0>(p, grid, avg, offs, c->stream); break;
    }
    GF_LAUNCH_CHECK(err, errlen);
    return 0;
#else
    (void)n, (void)xf;   /* (gf_mvx_takes: never in a HIP build) */
    return strata_errf(err, errlen, "GPU: no tensor-core experts' kernel in this build");
#endif
}

/* Decode: the experts' down products and their weighted sum added into x
 * in one launch, the T tokens' U experts side by side (gf_mv's ne); 1 for
 * prompts (the caller runs them one by one, then gf_moe_sum_kernel). */
static int gf_down_experts_sum(struct gpu_ctx *c, const struct gf_mat *dn, int T, int U, char *err, size_t errlen)
{
    if (T > GF_DECODE_T)
        return 1;
    gf_mv p;
    memset(&p, 0, sizeof p);
    p.w[0] = dn->d, p.parts = 1, p.end[0] = p.end[1] = p.end[2] = dn->rows;
    p.y[0] = c->x, p.y_g[0] = (size_t)c->g->hp.n_embd;
    p.ldw = dn->ldw, p.estride = dn->stride, p.n = U * dn->n;
    p.ids = c->sel, p.sw = c->selw, p.ne = dn->n;
    p.aq = c->aq, p.ads = c->ads, p.af = c->gt, p.a_div = 1, p.a_g = 1, p.t_total = T, p.accumulate = 1;
    gf_mv_hand(c, &p);
    c->handed = 0;
    return gf_mv_launch(dn->type, p, T, 1, c->stream, err, errlen) ? -1 : 0;
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
     * first), else gpu_gemm's; a failure of gpu_gemm: as gf_matmul_n, the
     * matrix-vector kernels from now on (they redo it all) */
    const struct gf_mat *gu[2] = {gw, uw};
    float *gu_y[2] = {c->gt, c->up};
    int mvx = gf_mvx_takes(ly, n, X);
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
    if (gf_act(s, GF_ACT_SWIGLU, c->gt, c->up, NULL, 0, Fe, n, mvx ? n : 0, c->gt, c->aq, c->ads, err, errlen))
        return -1;
    gf_mark(c, GF_ST_SWIGLU);
    if (mvx) {
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
