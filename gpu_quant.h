/*
 * gpu_quant.h — GGUF block formats decoded on the device: gq_dequant16 turns
 * 16 consecutive elements of a weight row (in its file layout) into floats,
 * equal bit for bit to quant.c's to_f32; and gq_q8_act, the one encoder: an
 * activation's int8 blocks of 32 as the decode kernels read them. Shared by
 * gpu_gemm.cu, the forward pass's files and attn_cuda.cu; nvcc and hipcc. From C,
 * only gq_supported is visible.
 *
 * Owns the device-side block layouts only: no launches, no allocation, no
 * host state. quant.c stays the definition of each format
 * (struct offsets below are its blk_* structs, little-endian).
 * Bit-exactness: a multiply followed by an add is written with __fmul_rn /
 * __fadd_rn so that the compiler cannot fuse it into an FMA (quant.c is
 * built with -ffp-contract=off); pure products need no guard.
 * The IQ2/IQ3 lattice grids are quant_grids.h's tables, included here into
 * device memory. Not here: Q8_1's use as a weight beyond its values.
 */
#ifndef STRATA_GPU_QUANT_H
#define STRATA_GPU_QUANT_H

#include "strata.h"

/* Whether gq_dequant16 decodes this block type (host or device). */
static inline int gq_supported(int type)
{
    switch (type) {
    case QT_F32: case QT_F16: case QT_BF16:
    case QT_Q4_0: case QT_Q4_1: case QT_Q5_0: case QT_Q5_1: case QT_Q8_0: case QT_Q8_1:
    case QT_Q2_K: case QT_Q3_K: case QT_Q4_K: case QT_Q5_K: case QT_Q6_K: case QT_Q8_K:
    case QT_IQ4_NL: case QT_IQ4_XS:
    case QT_IQ2_XXS: case QT_IQ2_XS: case QT_IQ2_S: case QT_IQ3_XXS: case QT_IQ3_S:
        return 1;
    default:
        return 0;
    }
}

#if defined(__CUDACC__) || defined(__HIPCC__)
#include "gpu_compat.h"

/* Bytes of a block of each type gq_supported lists (quant.c's blk_* sizes;
 * gpu_gemm.cu checks them against quant_type() before a launch). */
static __host__ __device__ constexpr int gq_bsize(int t)
{
    return t == QT_F32 ? 4 : t == QT_F16 || t == QT_BF16 ? 2 : t == QT_Q4_0 ? 18 : t == QT_Q4_1 ? 20
           : t == QT_Q5_0 ? 22 : t == QT_Q5_1 ? 24 : t == QT_Q8_0 ? 34 : t == QT_Q8_1 ? 36
           : t == QT_Q2_K ? 84 : t == QT_Q3_K ? 110 : t == QT_Q4_K ? 144 : t == QT_Q5_K ? 176
           : t == QT_Q6_K ? 210 : t == QT_Q8_K ? 292 : t == QT_IQ4_NL ? 18 : t == QT_IQ4_XS ? 136
           : t == QT_IQ2_XXS ? 66 : t == QT_IQ2_XS ? 74 : t == QT_IQ2_S ? 82 : t == QT_IQ3_XXS ? 98
           : t == QT_IQ3_S ? 110 : 0;
}

/* ---- byte access: rows may sit at any byte offset a block size allows ---- */

static __device__ __forceinline__ unsigned gq_u16(const uint8_t *p)
{
    return (unsigned)p[0] | (unsigned)p[1] << 8;
}

static __device__ __forceinline__ float gq_f16(const uint8_t *p)
{
    return __half2float(__ushort_as_half((unsigned short)gq_u16(p)));
}

/* Power-of-two alignment (at most 4) of row + bsize * block + off for a row
 * aligned to ra bytes (1: unknown). */
static __host__ __device__ constexpr int gq_al(int ra, int bsize, int off)
{
    return (ra | bsize | off | 4) & -(ra | bsize | off | 4);
}

/* 16 bytes at p into q (registers once unrolled), by the widest loads that
 * alignment A (gq_al) allows; A = 1 decides at run time (the branch is
 * uniform across a warp for rows that share an alignment). */
template <int A>
static __device__ __forceinline__ void gq_ld16(const uint8_t *p, uint8_t q[16])
{
    if (A >= 4 || (A == 1 && ((size_t)p & 3) == 0)) {
#pragma unroll
        for (int i = 0; i < 4; i++) {
            unsigned v = ((const unsigned *)p)[i];
#pragma unroll
            for (int b = 0; b < 4; b++)
                q[4 * i + b] = (uint8_t)(v >> (8 * b));
        }
    } else if (A == 2 || ((size_t)p & 1) == 0) {
#pragma unroll
        for (int i = 0; i < 8; i++) {
            unsigned v = ((const unsigned short *)p)[i];
            q[2 * i] = (uint8_t)v;
            q[2 * i + 1] = (uint8_t)(v >> 8);
        }
    } else {
#pragma unroll
        for (int i = 0; i < 16; i++)
            q[i] = p[i];
    }
}

/* (float)v for |v| < 2^22, exact, without the conversion unit (a quarter-
 * rate pipe): 1.5 * 2^23 + v has v in its low mantissa bits. */
static __device__ __forceinline__ float gq_i2f(int v)
{
    return __int_as_float(0x4B400000 + v) - 12582912.f;
}

/* The IQ4 non-linear codebook (quant.c's kvalues_iq4nl) as two words of
 * bytes, entry i in byte i % 8: read without a memory table. */
static __device__ __forceinline__ int gq_iq4nl(unsigned i)
{
    const unsigned long long lo = 0xF6EADDCFBFAD9881ull, hi = 0x7159453526190D01ull;
    return (int)(signed char)(((i < 8 ? lo : hi) >> (8 * (i & 7))) & 0xff);
}

/* Q4_K / Q5_K: the 6-bit (scale, min) pair j of 8, packed in 12 bytes read
 * as three little-endian words a, b, c (no runtime-indexed local array). */
static __device__ __forceinline__ void gq_k4_scale_min(int j, unsigned a, unsigned b, unsigned c, int *sc,
                                                       int *m)
{
    int sh = 8 * (j & 3);
    if (j < 4) {
        *sc = (a >> sh) & 63;
        *m = (b >> sh) & 63;
    } else {
        *sc = ((c >> sh) & 15) | ((a >> (sh + 6)) & 3) << 4;
        *m = ((c >> (sh + 4)) & 15) | ((b >> (sh + 6)) & 3) << 4;
    }
}

/* ---- one decoder per type: elements 16*i16 .. 16*i16+15 of a row ---- */

static __device__ __forceinline__ void gq_f32_16(const uint8_t *row, int i16, float *y)
{
    const float *x = (const float *)row + 16 * i16;
#pragma unroll
    for (int j = 0; j < 16; j++)
        y[j] = x[j];
}

static __device__ __forceinline__ void gq_f16_16(const uint8_t *row, int i16, float *y)
{
    const unsigned short *x = (const unsigned short *)row + 16 * i16;
#pragma unroll
    for (int j = 0; j < 16; j++)
        y[j] = __half2float(__ushort_as_half(x[j]));
}

static __device__ __forceinline__ void gq_bf16_16(const uint8_t *row, int i16, float *y)
{
    const unsigned short *x = (const unsigned short *)row + 16 * i16;
#pragma unroll
    for (int j = 0; j < 16; j++)
        y[j] = __uint_as_float((unsigned)x[j] << 16);
}

/* Legacy 32-element blocks: byte j holds element j (low nibble) and j + 16
 * (high nibble); half h of the block is one nibble plane. Q4_0 and IQ4_NL
 * share the 18-byte layout (d, then 16 bytes of nibbles): code c is the
 * value c - 8 in Q4_0, the IQ4_NL grid's entry c in IQ4_NL (NL). */
template <int RA, bool NL>
static __device__ __forceinline__ void gq_nib18_16(const uint8_t *row, int i16, float *y)
{
    const uint8_t *b = row + 18 * (i16 >> 1);
    int sh = 4 * (i16 & 1);
    float d = gq_f16(b);
    uint8_t q[16];
    gq_ld16<gq_al(RA, 18, 2)>(b + 2, q);
#pragma unroll
    for (int j = 0; j < 16; j++) {
        int c = (q[j] >> sh) & 15;
        y[j] = gq_i2f(NL ? gq_iq4nl(c) : c - 8) * d;
    }
}

template <int RA>
static __device__ __forceinline__ void gq_q4_1_16(const uint8_t *row, int i16, float *y)
{
    const uint8_t *b = row + 20 * (i16 >> 1);
    int sh = 4 * (i16 & 1);
    float d = gq_f16(b), m = gq_f16(b + 2);
    uint8_t q[16];
    gq_ld16<gq_al(RA, 20, 4)>(b + 4, q);
#pragma unroll
    for (int j = 0; j < 16; j++)
        y[j] = __fadd_rn(__fmul_rn(gq_i2f((q[j] >> sh) & 15), d), m);
}

template <int RA>
static __device__ __forceinline__ void gq_q5_0_16(const uint8_t *row, int i16, float *y)
{
    const uint8_t *b = row + 22 * (i16 >> 1);
    int h = i16 & 1;
    float d = gq_f16(b);
    unsigned qh = gq_u16(b + 2) | gq_u16(b + 4) << 16;
    uint8_t qs[16];
    gq_ld16<gq_al(RA, 22, 6)>(b + 6, qs);
#pragma unroll
    for (int j = 0; j < 16; j++) {
        int q = ((qs[j] >> (4 * h)) & 15) | ((qh >> (16 * h + j)) & 1) << 4;
        y[j] = gq_i2f(q - 16) * d;
    }
}

template <int RA>
static __device__ __forceinline__ void gq_q5_1_16(const uint8_t *row, int i16, float *y)
{
    const uint8_t *b = row + 24 * (i16 >> 1);
    int h = i16 & 1;
    float d = gq_f16(b), m = gq_f16(b + 2);
    unsigned qh = gq_u16(b + 4) | gq_u16(b + 6) << 16;
    uint8_t qs[16];
    gq_ld16<gq_al(RA, 24, 8)>(b + 8, qs);
#pragma unroll
    for (int j = 0; j < 16; j++) {
        int q = ((qs[j] >> (4 * h)) & 15) | ((qh >> (16 * h + j)) & 1) << 4;
        y[j] = __fadd_rn(__fmul_rn(gq_i2f(q), d), m);
    }
}

/* Q8_0 (34 bytes) and Q8_1 (36: its stored sum s sits between d and qs). */
template <int RA, int BS, int QOFF>
static __device__ __forceinline__ void gq_q8_16(const uint8_t *row, int i16, float *y)
{
    const uint8_t *b = row + BS * (i16 >> 1);
    uint8_t q[16];
    gq_ld16<gq_al(RA, BS, QOFF)>(b + QOFF + 16 * (i16 & 1), q);
    float d = gq_f16(b);
#pragma unroll
    for (int j = 0; j < 16; j++)
        y[j] = gq_i2f((signed char)q[j]) * d;
}


/* K-quants: super-blocks of 256; s = i16 & 15 is the 16-element group.
 * 2-bit planes (Q2_K, Q3_K): element k = 128h + 32p + l sits in bits 2p of
 * byte 32h + l; for group s, h = s/8, p = (s%8)/2, l = 16(s%2) + j. */
template <int RA>
static __device__ __forceinline__ void gq_q2_K_16(const uint8_t *row, int i16, float *y)
{
    const uint8_t *b = row + 84 * (i16 >> 4);
    int s = i16 & 15;
    uint8_t qs[16];
    gq_ld16<gq_al(RA, 84, 16)>(b + 16 + 32 * (s >> 3) + 16 * (s & 1), qs);
    int sh = 2 * ((s & 7) >> 1), sc = b[s];
    float dl = gq_f16(b + 80) * (float)(sc & 15), ml = gq_f16(b + 82) * (float)(sc >> 4);
#pragma unroll
    for (int j = 0; j < 16; j++)
        y[j] = __fsub_rn(__fmul_rn(dl, gq_i2f((qs[j] >> sh) & 3)), ml);
}

template <int RA>
static __device__ __forceinline__ void gq_q3_K_16(const uint8_t *row, int i16, float *y)
{
    const uint8_t *b = row + 110 * (i16 >> 4);
    int s = i16 & 15;
    uint8_t qs[16], hm[16];
    gq_ld16<gq_al(RA, 110, 32)>(b + 32 + 32 * (s >> 3) + 16 * (s & 1), qs);
    gq_ld16<gq_al(RA, 110, 16)>(b + 16 * (s & 1), hm);
    const uint8_t *scales = b + 96;
    int sh = 2 * ((s & 7) >> 1), hb = s >> 1; /* the high bit of element k: bit k/32 of hmask[k%32] */
    int lo = s < 8 ? scales[s] & 15 : scales[s - 8] >> 4;
    int hi = (scales[8 + (s & 3)] >> (2 * (s >> 2))) & 3;
    float dl = gq_f16(b + 108) * (float)((lo | hi << 4) - 32);
#pragma unroll
    for (int j = 0; j < 16; j++) {
        int u = ((qs[j] >> sh) & 3) | ((hm[j] >> hb) & 1) << 2; /* level + 4 */
        y[j] = dl * gq_i2f(u - 4);
    }
}

/* Q4_K / Q5_K: 32 bytes of qs per 64 elements, elements 0..31 of the 64 in
 * the low nibbles, 32..63 in the high ones; 8 (scale, min) pairs of 32. */
template <int RA, int BS>
static __device__ __forceinline__ void gq_q45_K_16(const uint8_t *b, const uint8_t *qs, const uint8_t *qh,
                                                   int s, float *y)
{
    int sc, m;
    uint8_t hd[16], q[16], h[16];
    gq_ld16<gq_al(RA, BS, 0)>(b, hd); /* d, dmin, the 12 scale bytes */
    gq_k4_scale_min(s >> 1, hd[4] | hd[5] << 8 | hd[6] << 16 | (unsigned)hd[7] << 24,
                    hd[8] | hd[9] << 8 | hd[10] << 16 | (unsigned)hd[11] << 24,
                    hd[12] | hd[13] << 8 | hd[14] << 16 | (unsigned)hd[15] << 24, &sc, &m);
    float dl = __half2float(__ushort_as_half((unsigned short)(hd[0] | hd[1] << 8))) * (float)sc;
    float ml = __half2float(__ushort_as_half((unsigned short)(hd[2] | hd[3] << 8))) * (float)m;
    gq_ld16<gq_al(RA, BS, 16)>(qs + 32 * (s >> 2) + 16 * (s & 1), q);
    if (qh)
        gq_ld16<gq_al(RA, BS, 16)>(qh + 16 * (s & 1), h);
    int sh = 4 * ((s >> 1) & 1), hb = s >> 1; /* Q5_K's fifth bit of k: bit k/32 of qh[k%32] */
#pragma unroll
    for (int j = 0; j < 16; j++) {
        int u = (q[j] >> sh) & 15;
        if (qh)
            u |= ((h[j] >> hb) & 1) << 4;
        y[j] = __fsub_rn(__fmul_rn(dl, gq_i2f(u)), ml);
    }
}

template <int RA>
static __device__ __forceinline__ void gq_q6_K_16(const uint8_t *row, int i16, float *y)
{
    const uint8_t *b = row + 210 * (i16 >> 4);
    int s = i16 & 15, h = s >> 3, p = (s & 7) >> 1, l0 = 16 * (s & 1);
    uint8_t ql[16], qh[16];
    gq_ld16<gq_al(RA, 210, 16)>(b + 64 * h + 32 * (p & 1) + l0, ql);
    gq_ld16<gq_al(RA, 210, 128)>(b + 128 + 32 * h + l0, qh);
    int shl = 4 * (p >> 1), shh = 2 * p;
    float ds = gq_f16(b + 208) * (float)(signed char)b[192 + s];
#pragma unroll
    for (int j = 0; j < 16; j++) {
        int u = ((ql[j] >> shl) & 15) | ((qh[j] >> shh) & 3) << 4;
        y[j] = ds * gq_i2f(u - 32);
    }
}

template <int RA>
static __device__ __forceinline__ void gq_q8_K_16(const uint8_t *row, int i16, float *y)
{
    const uint8_t *b = row + 292 * (i16 >> 4);
    uint8_t q[16];
    gq_ld16<gq_al(RA, 292, 4)>(b + 4 + 16 * (i16 & 15), q);
    float d = __uint_as_float(gq_u16(b) | gq_u16(b + 2) << 16);
#pragma unroll
    for (int j = 0; j < 16; j++)
        y[j] = d * gq_i2f((signed char)q[j]);
}

template <int RA>
static __device__ __forceinline__ void gq_iq4_xs_16(const uint8_t *row, int i16, float *y)
{
    const uint8_t *b = row + 136 * (i16 >> 4);
    int s = i16 & 15, sb = s >> 1, sh = 4 * (s & 1);
    int lo = (b[4 + sb / 2] >> (4 * (sb & 1))) & 15, hi = (gq_u16(b + 2) >> (2 * sb)) & 3;
    float dl = gq_f16(b) * (float)((lo | hi << 4) - 32);
    uint8_t q[16];
    gq_ld16<gq_al(RA, 136, 8)>(b + 8 + 16 * sb, q);
#pragma unroll
    for (int j = 0; j < 16; j++)
        y[j] = dl * gq_i2f(gq_iq4nl((q[j] >> sh) & 15));
}

/* ---- the IQ2/IQ3 lattices: grids of 8 (IQ2) or 4 (IQ3) magnitudes a
 * point, a sign bit an element, a 4-bit scale a 32 (a 16 for IQ2_XS and
 * IQ2_S). One decoder a format, gq_iq_eight, serves gq_dequant16 and the
 * decode and batch kernels' int8 units (gpu_mv.cu, gpu_mma.cu). ---- */
#define QG_TABLE static __device__ const
#include "quant_grids.h"
#undef QG_TABLE

/* quant.c's iq_signs: 7 stored sign bits, the 8th makes the count even */
static __device__ __forceinline__ unsigned gq_iq_signs(unsigned i7)
{
    return i7 | (unsigned)(__popc(i7) & 1) << 7;
}

/* four grid magnitudes (the bytes of g, never 0) negated where bits 0..3
 * of s are set: -m is ~m + 1 in a byte, with no carry out of it */
static __device__ __forceinline__ int gq_iq_signed(unsigned g, unsigned s)
{
    unsigned m = ((s & 15) * 0x00204081u & 0x01010101u) * 0xFFu;
    return (int)((g ^ m) + (m & 0x01010101u));
}

/* 2-byte-aligned loads (the lattices' blocks are of even size, their rows
 * 2-aligned wherever they are read) */
static __device__ __forceinline__ unsigned gq_iq_u32(const uint8_t *p)
{
    return (unsigned)((const uint16_t *)p)[0] | (unsigned)((const uint16_t *)p)[1] << 16;
}

/* Byte l of the 2-aligned bytes at p, read as its aligned pair: the two
 * groups of a half (gq_iq_half) share one load */
static __device__ __forceinline__ unsigned gq_iq_pair(const uint8_t *p, int l)
{
    return ((const uint16_t *)p)[l / 2] >> (8 * (l & 1)) & 255;
}

/* Group l of 8 of sub-block sb (elements 32sb + 8l .. + 7) of the
 * superblock at b, type T: its 8 codes as signed bytes (elements 4i ..
 * 4i+3 in q[i]), and the scale they take: scale · code is quant.c's value
 * bit for bit (the sign of a product of floats is exact). */
template <int T>
static __device__ __forceinline__ float gq_iq_eight(const uint8_t *b, int sb, int l, int (&q)[2])
{
    float d = gq_f16(b);
    unsigned g0, g1, sg;   /* the group's magnitudes (bytes), its 8 signs */
    float s;
    if (T == QT_IQ2_XXS) {   /* 8 bytes at 2 + 8sb: four grid indices, then 7-bit sign fields and the scale */
        unsigned aux = gq_iq_u32(b + 6 + 8 * sb);
        uint64_t g = iq2xxs_grid[b[2 + 8 * sb + l]];
        g0 = (unsigned)g, g1 = (unsigned)(g >> 32), sg = gq_iq_signs((aux >> 7 * l) & 127);
        s = d * (0.5f + (float)(aux >> 28)) * 0.25f;
    } else if (T == QT_IQ2_XS) {   /* u16 words at 2 + 8sb (9-bit index, 7 sign bits), the halves' scales at 66 + sb */
        unsigned w = ((const uint16_t *)(b + 2 + 8 * sb))[l];
        uint64_t g = iq2xs_grid[w & 511];
        g0 = (unsigned)g, g1 = (unsigned)(g >> 32), sg = gq_iq_signs(w >> 9);
        s = d * (0.5f + (float)((b[66 + sb] >> (4 * (l / 2))) & 15)) * 0.25f;
    } else if (T == QT_IQ2_S) {   /* index bytes at 2 + 4sb (top bits at 66 + sb), sign bytes at 34 + 4sb, scales at 74 + sb */
        unsigned idx = gq_iq_pair(b + 2 + 4 * sb, l);
        uint64_t g = iq2s_grid[idx | ((b[66 + sb] >> (2 * l)) & 3) << 8];
        g0 = (unsigned)g, g1 = (unsigned)(g >> 32), sg = gq_iq_pair(b + 34 + 4 * sb, l);
        s = d * (0.5f + (float)((b[74 + sb] >> (4 * (l / 2))) & 15)) * 0.25f;
    } else if (T == QT_IQ3_XXS) {   /* index bytes at 2 + 8sb (4-element points), IQ2_XXS's sign fields and scale at 66 + 4sb */
        unsigned aux = gq_iq_u32(b + 66 + 4 * sb), w = ((const uint16_t *)(b + 2 + 8 * sb))[l];
        g0 = iq3xxs_grid[w & 255], g1 = iq3xxs_grid[w >> 8], sg = gq_iq_signs((aux >> 7 * l) & 127);
        s = d * (0.5f + (float)(aux >> 28)) * 0.5f;
    } else {   /* QT_IQ3_S: index bytes at 2 + 8sb (ninth bits at 66 + sb), sign bytes at 74 + 4sb, scale nibbles at 106 */
        unsigned w = ((const uint16_t *)(b + 2 + 8 * sb))[l], qh = b[66 + sb] >> (2 * l);
        g0 = iq3s_grid[(w & 255) | (qh & 1) << 8], g1 = iq3s_grid[(w >> 8) | (qh & 2) << 7], sg = b[74 + 4 * sb + l];
        s = d * (float)(1 + 2 * ((b[106 + sb / 2] >> (4 * (sb & 1))) & 15));
    }
    q[0] = gq_iq_signed(g0, sg), q[1] = gq_iq_signed(g1, sg >> 4);
    return s;
}

/* Half h of sub-block sb (elements 32sb + 16h .. + 15): its groups of 8
 * 2h and 2h + 1 (gq_iq_eight), the codes in q, the scale returned */
template <int T>
static __device__ __forceinline__ float gq_iq_half(const uint8_t *b, int sb, int h, int (&q)[4])
{
    int a[2], c[2];
    float s = gq_iq_eight<T>(b, sb, 2 * h, a);
    gq_iq_eight<T>(b, sb, 2 * h + 1, c);
    q[0] = a[0], q[1] = a[1], q[2] = c[0], q[3] = c[1];
    return s;
}

template <int T>
static __device__ __forceinline__ void gq_iq_16(const uint8_t *row, int i16, float *y)
{
    int q[4];
    float d = gq_iq_half<T>(row + gq_bsize(T) * (i16 >> 4), (i16 & 15) >> 1, i16 & 1, q);
#pragma unroll
    for (int j = 0; j < 16; j++)
        y[j] = d * gq_i2f((signed char)(q[j >> 2] >> (8 * (j & 3))));
}

/* Elements 16*i16 .. 16*i16+15 of a row of block type `type` (gq_supported)
 * stored as in the file, the row aligned to RA bytes (1, 2 or 4: picks the
 * load width at compile time; 1 checks at run time); row may point to global
 * or shared memory. The switch folds away when type is a compile-time
 * constant. An unsupported type gives NaNs. */
template <int RA>
static __device__ __forceinline__ void gq_dequant16_al(int type, const uint8_t *row, int i16, float out[16])
{
    switch (type) {
    case QT_F32: gq_f32_16(row, i16, out); break;
    case QT_F16: gq_f16_16(row, i16, out); break;
    case QT_BF16: gq_bf16_16(row, i16, out); break;
    case QT_Q4_0: gq_nib18_16<RA, false>(row, i16, out); break;
    case QT_Q4_1: gq_q4_1_16<RA>(row, i16, out); break;
    case QT_Q5_0: gq_q5_0_16<RA>(row, i16, out); break;
    case QT_Q5_1: gq_q5_1_16<RA>(row, i16, out); break;
    case QT_Q8_0: gq_q8_16<RA, 34, 2>(row, i16, out); break;
    case QT_Q8_1: gq_q8_16<RA, 36, 4>(row, i16, out); break;
    case QT_Q2_K: gq_q2_K_16<RA>(row, i16, out); break;
    case QT_Q3_K: gq_q3_K_16<RA>(row, i16, out); break;
    case QT_Q4_K: {
        const uint8_t *b = row + 144 * (i16 >> 4);
        gq_q45_K_16<RA, 144>(b, b + 16, (const uint8_t *)0, i16 & 15, out);
        break;
    }
    case QT_Q5_K: {
        const uint8_t *b = row + 176 * (i16 >> 4);
        gq_q45_K_16<RA, 176>(b, b + 48, b + 16, i16 & 15, out);
        break;
    }
    case QT_Q6_K: gq_q6_K_16<RA>(row, i16, out); break;
    case QT_Q8_K: gq_q8_K_16<RA>(row, i16, out); break;
    case QT_IQ4_NL: gq_nib18_16<RA, true>(row, i16, out); break;
    case QT_IQ4_XS: gq_iq4_xs_16<RA>(row, i16, out); break;
    case QT_IQ2_XXS: gq_iq_16<QT_IQ2_XXS>(row, i16, out); break;
    case QT_IQ2_XS: gq_iq_16<QT_IQ2_XS>(row, i16, out); break;
    case QT_IQ2_S: gq_iq_16<QT_IQ2_S>(row, i16, out); break;
    case QT_IQ3_XXS: gq_iq_16<QT_IQ3_XXS>(row, i16, out); break;
    case QT_IQ3_S: gq_iq_16<QT_IQ3_S>(row, i16, out); break;
    default:
#pragma unroll
        for (int j = 0; j < 16; j++)
            out[j] = __int_as_float(0x7fc00000);
    }
}

/* gq_dequant16_al for a row of any alignment. */
static __device__ __forceinline__ void gq_dequant16(int type, const uint8_t *row, int i16, float out[16])
{
    gq_dequant16_al<1>(type, row, i16, out);
}

/* ---- activations: int8 blocks of 32 ---- */

/* One block of 32 activation values spread over 32/V consecutive lanes (V
 * each, the lanes aligned to the block) quantised the way quant.c quantises
 * to Q8_0/Q8_1: d = amax/127, codes round(v·127/amax) to nearest even. The
 * lane's codes go to q; the block's scales come back as the decode kernels
 * read them: (d as f16, Q8_1's s = d·Σq as f16, Σq, 0). Every lane of the
 * warp must call it (shuffles). */
template <int V>
static __device__ __forceinline__ float4 gq_q8_act(const float (&v)[V], int (&q)[V])
{
    float amax = 0.0f;
#pragma unroll
    for (int k = 0; k < V; k++)
        amax = fmaxf(amax, fabsf(v[k]));
    for (int m = 16 / V; m > 0; m >>= 1)
        amax = fmaxf(amax, gpu_shfl_xor(amax, m));
    float d = amax / 127.0f, id = amax != 0.0f ? 127.0f / amax : 0.0f;
    int sum = 0;
#pragma unroll
    for (int k = 0; k < V; k++) {
        float r = rintf(__fmul_rn(v[k], id));
        q[k] = (int)fminf(fmaxf(r, -128.0f), 127.0f);
        sum += q[k];
    }
    for (int m = 16 / V; m > 0; m >>= 1)
        sum += gpu_shfl_xor(sum, m);
    float fs = (float)sum;
    return make_float4(__half2float(__float2half_rn(d)), __half2float(__float2half_rn(__fmul_rn(d, fs))), fs, 0.0f);
}

/* Where element i of an activation of rows of n (i = row·n + column)
 * lies in the layout its reader takes: bt 0, one row after the other; bt
 * = the row count, the rows' blocks of 32 of each column range side by
 * side (block b of row t is block b·bt + t), so that a batch product
 * (gf_mvq_kernel) finds a sub-block of every row in a few lines. A block's
 * 32 codes stay together and in order either way; its scales sit at the
 * returned index / 32. */
static __device__ __forceinline__ size_t gq_act_at(size_t i, int n, int bt)
{
    if (!bt)
        return i;
    size_t t = i / n, col = i - t * n;
    return ((col / 32) * bt + t) * 32 + col % 32;
}

#endif /* __CUDACC__ || __HIPCC__ */
#endif
