/*
 * gpu_mv.cu — the GPU forward pass's weight products (gf_*, with gpu.cu and
 * gpu_mma.cu; gpu_fwd.h between them): one unit of each block format against
 * an int8 activation, the one-row decode kernels (gf_mvk_kernel for Q4_K,
 * the staged gf_mvs_kernel for the other formats, gf_mvf_kernel for float
 * rows, gf_mvrow_kernel for products of few rows, gf_mv1_kernel), the 8-row
 * fallback gf_mv_kernel, and the dispatch that picks among them and
 * gpu_gemm.cu and gpu_mma.cu (gf_matmul_n, gf_matmul_experts,
 * gf_down_experts_sum), with the norms handed from one product to the next.
 * Of 2..16 rows, the formats with tensor-core units go to gpu_mma.cu; of one
 * row, Q4_K to gf_mvk_kernel, the formats with a staged form (gf_mvs_of:
 * Q4_0, Q5_0, Q4_1, Q5_1, Q8_0, the other K-quants, IQ4_NL, IQ4_XS, the
 * lattices) to gf_mvs_kernel, float rows to gf_mvf_kernel, and a Q4_K and a
 * Q6_K product of one width (a Q4_K_M layer's q/k and v) to one launch of
 * both (gf_mv2_kernel; STRATA_GPU_NO_MV2=1: a launch each).
 * STRATA_GPU_MV_OLD=1 takes the kernels before gf_mvk_kernel, gf_mvs_kernel,
 * gf_mvf_kernel, gf_mvq_kernel and gf_mvh_kernel (the staged one for one
 * row, 8-row blocks for more).
 * No allocation and no host state beyond the launch helpers' cached
 * occupancies; never prints.
 */
#include "gpu_fwd.h"

#define GF_MV_WARPS 4     /* matrix rows (one per warp) per block of the matrix-vector kernel */
#define GF_NT 8           /* tokens per weight read in the prompt fallback (gf_mv_kernel) */

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

/* ==== host side ==== */

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
int gf_hand_takes(int type, int n, int ne)
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
    } else {
        dim3 grid((rows + GF_MV_WARPS - 1) / GF_MV_WARPS, groups);
        gf_launch(gf_mv_kernel<Q, GF_NT, 1>, grid, GF_MV_WARPS * GPU_WARP, 0, s, p);
    }
}

/* nt: 1 (each group one activation row), GF_NT (groups of tokens) or
 * GF_MMA_T (one group of up to 16 rows on tensor cores: gpu_mma.cu's gf_mma_launch,
 * where gf_mvq_takes) */
static int gf_mv_launch(int type, const gf_mv &p, int groups, int nt, gpuStream_t s, char *err, size_t errlen)
{
    if (nt == GF_MMA_T) {
        if (!gf_mma_launch(type, p, s))
            return strata_errf(err, errlen, "GPU: no tensor-core kernel for %s", gguf_type_name(type));
        GF_LAUNCH_CHECK(err, errlen);
        return 0;
    }
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


/* The layout (gq_act_at's bt) in which the int8 activation of T rows is
 * written for the products o: the rows' blocks side by side where every one
 * of them is a batch product of gf_mvq_kernel, else row after row, the
 * layout every other kernel reads. Each writer of c->aq sets c->abt to it
 * for the products that read what it writes. */
int gf_act_bt(const struct gf_out *o, int n_out, int T)
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
int gf_matmul_n(struct gpu_ctx *c, const struct gf_out *o, int n_out, const float *af, int T,
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
int gf_matmul_experts(struct gpu_ctx *c, const struct gf_mat *const *w, float *const *y, int n_w,
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

/* Decode: the experts' down products and their weighted sum added into x
 * in one launch, the T tokens' U experts side by side (gf_mv's ne); 1 for
 * prompts (the caller runs them one by one, then gf_moe_sum_kernel). */
int gf_down_experts_sum(struct gpu_ctx *c, const struct gf_mat *dn, int T, int U, char *err, size_t errlen)
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

