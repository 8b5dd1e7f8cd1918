/*
 * gpu_mma.cu — the GPU forward pass's tensor-core products (CUDA sm_80+;
 * gf_*, with gpu.cu and gpu_mv.cu, gpu_fwd.h between them): a product of
 * 2..16 activation rows (a batch step, a short prompt) as int8 mma over
 * the block formats' units (gf_mvq_kernel: Q4_0, Q4_1, Q5_0, Q5_1, Q8_0,
 * Q4_K, Q5_K, Q6_K, IQ4_NL, IQ4_XS, IQ2_XXS and IQ3_XXS from 2 rows, Q2_K,
 * Q3_K, IQ2_XS and IQ3_S from 3, IQ2_S from 4; Q4_0..Q5_1 and IQ4_NL
 * through a stage, gf_mvqs_kernel) or f16 mma over F16 and BF16 rows
 * (gf_mvh_kernel); a prompt's MoE experts of up to ~64
 * rows an expert (gf_mvx_kernel, and gf_mvxh_kernel for Q4_K and Q8_0 as
 * f16). A HIP build compiles only the host side, which takes nothing
 * (gf_mvq_units 0). No allocation; never prints.
 */
#include "gpu_fwd.h"

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

/* a block type's units among the structs above (gf_mvq_units' types reach
 * the kernels; the lattices take the general case) */
template <int TYPE> struct gf_mvq_of { typedef gf_mvq_iq<TYPE> F; };
template <> struct gf_mvq_of<QT_Q8_0> { typedef gf_mvq_q8_0 F; };
template <> struct gf_mvq_of<QT_Q4_K> { typedef gf_mvq_q4_K F; };
template <> struct gf_mvq_of<QT_Q5_K> { typedef gf_mvq_q5_K F; };
template <> struct gf_mvq_of<QT_Q6_K> { typedef gf_mvq_q6_K F; };
template <> struct gf_mvq_of<QT_Q2_K> { typedef gf_mvq_q2_K F; };
template <> struct gf_mvq_of<QT_Q3_K> { typedef gf_mvq_q3_K F; };
template <> struct gf_mvq_of<QT_Q4_0> { typedef gf_mvq_q4<18, 0, false, false> F; };
template <> struct gf_mvq_of<QT_Q5_0> { typedef gf_mvq_q4<22, 2, false, false> F; };
template <> struct gf_mvq_of<QT_Q4_1> { typedef gf_mvq_q4<20, 0, true, false> F; };
template <> struct gf_mvq_of<QT_Q5_1> { typedef gf_mvq_q4<24, 4, true, false> F; };
template <> struct gf_mvq_of<QT_IQ4_NL> { typedef gf_mvq_q4<18, 0, false, true> F; };
template <> struct gf_mvq_of<QT_IQ4_XS> { typedef gf_mvq_iq4_xs F; };

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

/* ==== host side ==== */

#ifdef GPU_CUDA
/* f(std::integral_constant<int, type>()) for a type of gf_mvq_units: whether it was one */
template <class Fn>
static bool gf_mma_type(int type, Fn f)
{
    switch (type) {
    case QT_Q4_0: f(std::integral_constant<int, QT_Q4_0>()); break;
    case QT_Q4_1: f(std::integral_constant<int, QT_Q4_1>()); break;
    case QT_Q5_0: f(std::integral_constant<int, QT_Q5_0>()); break;
    case QT_Q5_1: f(std::integral_constant<int, QT_Q5_1>()); break;
    case QT_Q8_0: f(std::integral_constant<int, QT_Q8_0>()); break;
    case QT_Q2_K: f(std::integral_constant<int, QT_Q2_K>()); break;
    case QT_Q3_K: f(std::integral_constant<int, QT_Q3_K>()); break;
    case QT_Q4_K: f(std::integral_constant<int, QT_Q4_K>()); break;
    case QT_Q5_K: f(std::integral_constant<int, QT_Q5_K>()); break;
    case QT_Q6_K: f(std::integral_constant<int, QT_Q6_K>()); break;
    case QT_IQ4_NL: f(std::integral_constant<int, QT_IQ4_NL>()); break;
    case QT_IQ4_XS: f(std::integral_constant<int, QT_IQ4_XS>()); break;
    case QT_IQ2_XXS: f(std::integral_constant<int, QT_IQ2_XXS>()); break;
    case QT_IQ2_XS: f(std::integral_constant<int, QT_IQ2_XS>()); break;
    case QT_IQ2_S: f(std::integral_constant<int, QT_IQ2_S>()); break;
    case QT_IQ3_XXS: f(std::integral_constant<int, QT_IQ3_XXS>()); break;
    case QT_IQ3_S: f(std::integral_constant<int, QT_IQ3_S>()); break;
    default: return false;
    }
    return true;
}

/* the batch kernel of a type (staged where gf_mvqs_of has its form), NB
 * token blocks of 8, the activation's layout p.bt */
template <int TYPE, int NB>
static void gf_mvq_launch(const gf_mv &p, dim3 grid, gpuStream_t s)
{
    typedef typename gf_mvq_of<TYPE>::F F;
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

/* A product of 2..GF_MMA_T rows on tensor cores, one group
 * (gf_mvq_takes): gf_mvq_kernel, gf_mvqs_kernel or for F16 and BF16
 * gf_mvh_kernel; the launch's error is the caller's to check. Returns
 * whether it took the type. */
int gf_mma_launch(int type, const gf_mv &p, gpuStream_t s)
{
#ifdef GPU_CUDA
    dim3 grid((p.end[p.parts - 1] + 15) / 16);
    int two = p.t_total > 8;
    if (type == QT_F16 || type == QT_BF16) {
        void (*k)(gf_mv) = type == QT_BF16 ? (two ? gf_mvh_kernel<true, 2> : gf_mvh_kernel<true, 1>)
                                           : (two ? gf_mvh_kernel<false, 2> : gf_mvh_kernel<false, 1>);
        gf_launch(k, grid, GF_MVQ_WARPS * GPU_WARP, 0, s, p);
        return 1;
    }
    return gf_mma_type(type, [&](auto t) {
        if (two)
            gf_mvq_launch<decltype(t)::value, 2>(p, grid, s);
        else
            gf_mvq_launch<decltype(t)::value, 1>(p, grid, s);
    });
#else
    (void)type, (void)p, (void)s;
    return 0;
#endif
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
int gf_mvq_units(int type, int n)
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
int gf_mvq_takes(int type, int n, int T)
{
    int fl = (type == QT_F16 || type == QT_BF16) && n % 32 == 0 && gf_mma_ok();
    int least = gf_mvq_units(type, n);
    return T > 1 && T <= GF_MMA_T && ((least && T >= least) || fl);
}

#ifdef GPU_CUDA
/* gf_mvx_kernel's token tiles for an average of avg rows an expert: 8·NB
 * rows, 16 where most experts have fewer, else 32 (64 held more registers
 * than a thread has, 255, and spilled) */
template <int TYPE>
static void gf_mvx_launch(const gf_mv &p, dim3 grid, int avg, const int32_t *offs, gpuStream_t s)
{
    typedef typename gf_mvq_of<TYPE>::F F;
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
int gf_mvxh_takes(const struct gf_mat *const *w, int n_w)
{
    for (int k = 0; k < n_w; k++) {
        int t = w[k]->type;
        if (t != w[0]->type || !(t == QT_Q4_K || (t == QT_Q8_0 && w[k]->n % 256 == 0)))
            return 0;
    }
    return 1;
}

/* Whether the n pairs of a prompt's experts (X experts) take gf_mvx for
 * the n_w stacks w of one launch (gf_mvx_kernel, or gf_mvxh_kernel for
 * Q4_K and Q8_0): every stack in a format with gf_mvq_kernel's units, and
 * the rows an expert on average times a weight's bytes at most
 * GF_MVX_BYTES in each, GF_MVXH_BYTES where the stacks take
 * gf_mvxh_kernel (STRATA_GPU_MOE_GEMM=1: gpu_gemm's products, for
 * comparisons). Each tile of 32 rows reads the expert's weights again,
 * where gpu_gemm's f16 tiles pay off with more rows, so the crossing falls
 * with the weights' bytes: on the H200's 30B-A3B gpu_gemm ran at 64 rows
 * an expert (36 bytes in the 4.5-bit types) level with gf_mvx_kernel in
 * Q4_K, 1.09 times its speed in IQ4_NL and 1.34 in Q4_0; gf_mvx_kernel was
 * faster at 32 rows in Q4_K and in Q8_0 (34 bytes; BENCH.md, twenty-ninth,
 * thirty-first, forty-fifth and forty-sixth passes). gf_mvxh_kernel (1.2
 * times gf_mvx_kernel at 32 rows, forty-ninth and fifty-first passes)
 * against gpu_gemm, one chunk of Q4_K (fifty-second pass): 64 rows +10%,
 * 68 rows −3.5%, 72-112 rows −4 to −12%; Q8_0 at 64 rows (68 bytes) level. */
#define GF_MVX_BYTES 35.0
#define GF_MVXH_BYTES 36.0
int gf_mvx_takes(const struct gf_mat *const *w, int n_w, int n, int X)
{
    double most = gf_mvxh_takes(w, n_w) ? GF_MVXH_BYTES : GF_MVX_BYTES;
    for (int k = 0; k < n_w; k++)
        if (!gf_mvq_units(w[k]->type, w[k]->n) || (double)n / X * w[k]->ldw / w[k]->n > most)
            return 0;
    return !gf_env("STRATA_GPU_MOE_GEMM");
}

/* The experts' products of a prompt's n pairs, sorted by expert (c->offs):
 * each expert's rows of the activation against that expert of each stack
 * w[k] (one type and width) into y[k], ldy a row, the stacks in one
 * launch: Q4_K and Q8_0 (gf_mvxh_takes) the rows' f32 activation xf, in f16 in
 * c->gemm_scratch (gf_mvxh_kernel), the other types its int8 blocks
 * (c->aq, c->ads; gq_act_at's layout of bt = n; gf_mvx_kernel) */
int gf_mvx(struct gpu_ctx *c, const struct gf_mat *const *w, float *const *y, int n_w, size_t ldy, int n,
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
    auto launch = [&](auto t) { gf_mvx_launch<decltype(t)::value>(p, grid, avg, offs, c->stream); };
    if (!gf_mma_type(w[0]->type, launch))
        return strata_errf(err, errlen, "GPU: no tensor-core experts' kernel for %s", gguf_type_name(w[0]->type));
    GF_LAUNCH_CHECK(err, errlen);
    return 0;
#else
    (void)n, (void)xf;   /* (gf_mvx_takes: never in a HIP build) */
    return strata_errf(err, errlen, "GPU: no tensor-core experts' kernel in this build");
#endif
}

