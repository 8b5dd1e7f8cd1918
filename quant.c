/*
 * quant.c — tensor block formats: dequantisation, activation quantisation,
 * weight quantisers, dot products and the matrix kernel the model calls.
 *
 * Owns every byte layout of the GGUF tensor types Strata reads (F32, F16, BF16,
 * the 32-element legacy blocks, the 256-element K-quants, the IQ types) and the
 * numerics the reference engine (llama.cpp, CPU backend on x86) uses with them:
 * dequantisation is bit-exact, activation quantisation (Q8_0, Q8_1, Q8_K, F16,
 * BF16) byte-exact, dot products exact in their integer parts.
 * Must not: know about models or threads, print, or allocate outside
 * quant_gemm's packing scratch. Kernels are chosen at build time
 * (-march=native: AVX-512 VNNI / AVX2; STRATA_PORTABLE: scalar only).
 * Shapes: n elements per row; w = weight rows, a = activation rows (already in
 * the weight type's dot_type); QK = 256, the K-quant super-block.
 */
#include "strata.h"

#include <math.h>
#include <stdlib.h>
#include <string.h>

#include "quant_grids.h"

#if !defined(STRATA_PORTABLE) && defined(__AVX2__) && defined(__FMA__) && defined(__F16C__)
#define QUANT_AVX2 1
#include <immintrin.h>
#endif
#if defined(QUANT_AVX2) && defined(__AVX512F__) && defined(__AVX512BW__) && \
    defined(__AVX512VL__) && defined(__AVX512VNNI__)
#define QUANT_AVX512 1
#endif

#define QK 256 /* elements of a K-quant / IQ super-block */

/* ==== scalar conversions ==== */

static inline uint32_t f32_bits(float f)
{
    uint32_t u;
    memcpy(&u, &f, 4);
    return u;
}

static inline float f32_from(uint32_t u)
{
    float f;
    memcpy(&f, &u, 4);
    return f;
}

float quant_f16_to_f32(uint16_t h)
{
    uint32_t sign = (uint32_t)(h & 0x8000) << 16;
    uint32_t em = h & 0x7fff;
    uint32_t bits;
    if (em >= 0x7c00)          /* inf and NaN: the payload moves up, quiet bit included */
        bits = 0x7f800000 | (em & 0x3ff) << 13;
    else if (em >= 0x0400)     /* normal: rebias the exponent from 15 to 127 */
        bits = (em << 13) + 0x38000000;
    else                       /* zero or subnormal: m * 2^-24 is exact in a float */
        bits = f32_bits((float)em * 0x1p-24f);
    return f32_from(bits | sign);
}

uint16_t quant_f32_to_f16(float f)
{
    uint32_t x = f32_bits(f);
    uint16_t sign = (uint16_t)((x >> 16) & 0x8000);
    x &= 0x7fffffff;
    if (x > 0x7f800000) /* NaN: stays NaN, made quiet, top payload bits kept */
        return sign | 0x7e00 | ((x >> 13) & 0x3ff);
    if (x >= 0x477ff000) /* >= 65520, the midpoint above 65504: ties go to inf (even) */
        return sign | 0x7c00;
    if (x >= 0x38800000) { /* normal half (>= 2^-14): round 13 bits, ties to even */
        x += 0xfff + ((x >> 13) & 1);
        return sign | (uint16_t)((x - 0x38000000) >> 13);
    }
    /* Subnormal half: after adding 0.5 the float's last mantissa bit is worth
     * 2^-24, one half ulp, so the add itself rounds to nearest even. */
    float r = f32_from(x) + 0.5f;
    return sign | (uint16_t)(f32_bits(r) - 0x3f000000);
}

float quant_bf16_to_f32(uint16_t h)
{
    return f32_from((uint32_t)h << 16);
}

static uint16_t f32_to_bf16(float f)
{
    uint32_t x = f32_bits(f);
    if ((x & 0x7fffffff) > 0x7f800000) /* NaN: forced quiet */
        return (uint16_t)((x >> 16) | 64);
    return (uint16_t)((x + 0x7fff + ((x >> 16) & 1)) >> 16);
}

/* The hot-path half conversion: one instruction where F16C exists. */
static inline float fp16(uint16_t h)
{
#ifdef QUANT_AVX2
    return _cvtsh_ss(h);
#else
    return quant_f16_to_f32(h);
#endif
}

/* Round to nearest, ties to even, as the reference's nearest_int: adding
 * 1.5 * 2^23 leaves the integer in the low mantissa bits (|x| < 2^22). */
static inline int nearest_int(float x)
{
    float v = x + 12582912.f;
    return (int)(f32_bits(v) & 0x007fffff) - 0x00400000;
}

/* ==== block layouts (little-endian, fields in storage order) ==== */

typedef struct { uint16_t d; uint8_t qs[16]; } blk_q4_0;
typedef struct { uint16_t d, m; uint8_t qs[16]; } blk_q4_1;
typedef struct { uint16_t d; uint8_t qh[4]; uint8_t qs[16]; } blk_q5_0;
typedef struct { uint16_t d, m; uint8_t qh[4]; uint8_t qs[16]; } blk_q5_1;
typedef struct { uint16_t d; int8_t qs[32]; } blk_q8_0;
typedef struct { uint16_t d, s; int8_t qs[32]; } blk_q8_1; /* s = d * sum(qs) */
typedef struct { uint8_t scales[16]; uint8_t qs[64]; uint16_t d, dmin; } blk_q2_K;
typedef struct { uint8_t hmask[32]; uint8_t qs[64]; uint8_t scales[12]; uint16_t d; } blk_q3_K;
typedef struct { uint16_t d, dmin; uint8_t scales[12]; uint8_t qs[128]; } blk_q4_K;
typedef struct { uint16_t d, dmin; uint8_t scales[12]; uint8_t qh[32]; uint8_t qs[128]; } blk_q5_K;
typedef struct { uint8_t ql[128]; uint8_t qh[64]; int8_t scales[16]; uint16_t d; } blk_q6_K;
typedef struct { float d; int8_t qs[QK]; int16_t bsums[16]; } blk_q8_K; /* bsums: sums of 16 */
typedef struct { uint16_t d; uint16_t qs[32]; } blk_iq2_xxs;
typedef struct { uint16_t d; uint16_t qs[32]; uint8_t scales[8]; } blk_iq2_xs;
typedef struct { uint16_t d; uint8_t qs[64]; uint8_t qh[8]; uint8_t scales[8]; } blk_iq2_s;
typedef struct { uint16_t d; uint8_t qs[96]; } blk_iq3_xxs;
typedef struct { uint16_t d; uint8_t qs[64]; uint8_t qh[8]; uint8_t signs[32]; uint8_t scales[4]; } blk_iq3_s;
typedef struct { uint16_t d; uint8_t qs[16]; } blk_iq4_nl;
typedef struct { uint16_t d; uint16_t scales_h; uint8_t scales_l[4]; uint8_t qs[128]; } blk_iq4_xs;

_Static_assert(sizeof(blk_q4_0) == 18 && sizeof(blk_q4_1) == 20, "legacy block size");
_Static_assert(sizeof(blk_q5_0) == 22 && sizeof(blk_q5_1) == 24, "legacy block size");
_Static_assert(sizeof(blk_q8_0) == 34 && sizeof(blk_q8_1) == 36, "legacy block size");
_Static_assert(sizeof(blk_q2_K) == 84 && sizeof(blk_q3_K) == 110, "K block size");
_Static_assert(sizeof(blk_q4_K) == 144 && sizeof(blk_q5_K) == 176, "K block size");
_Static_assert(sizeof(blk_q6_K) == 210 && sizeof(blk_q8_K) == 292, "K block size");
_Static_assert(sizeof(blk_iq2_xxs) == 66 && sizeof(blk_iq2_xs) == 74, "IQ block size");
_Static_assert(sizeof(blk_iq2_s) == 82 && sizeof(blk_iq3_xxs) == 98, "IQ block size");
_Static_assert(sizeof(blk_iq3_s) == 110 && sizeof(blk_iq4_nl) == 18, "IQ block size");
_Static_assert(sizeof(blk_iq4_xs) == 136, "IQ block size");

/* The IQ4 non-linear 4-bit codebook. */
static const int8_t kvalues_iq4nl[16] = {
    -127, -104, -83, -65, -49, -35, -22, -10, 1, 13, 25, 38, 53, 69, 89, 113,
};

/* IQ2/IQ3 sign bytes: 7 stored bits, the 8th makes the count of set bits even. */
static inline uint8_t iq_signs(unsigned i7)
{
    unsigned p = i7 ^ (i7 >> 4);
    p ^= p >> 2;
    p ^= p >> 1;
    return (uint8_t)(i7 | (p & 1) << 7);
}

/* ==== float types: F32, F16, BF16 ==== */

static void f32_to_f32(const void *x, float *y, int64_t n)
{
    memcpy(y, x, (size_t)n * 4);
}

static void f32_from_f32(const float *x, void *y, int64_t n)
{
    memcpy(y, x, (size_t)n * 4);
}

static void f16_to_f32(const void *vx, float *y, int64_t n)
{
    const uint16_t *x = vx;
    for (int64_t i = 0; i < n; i++)
        y[i] = fp16(x[i]);
}

static void f16_from_f32(const float *x, void *vy, int64_t n)
{
    uint16_t *y = vy;
    int64_t i = 0;
#ifdef QUANT_AVX2
    for (; i + 8 <= n; i += 8) /* the same rounding: to nearest even */
        _mm_storeu_si128((__m128i *)(y + i),
                         _mm256_cvtps_ph(_mm256_loadu_ps(x + i), _MM_FROUND_TO_NEAREST_INT));
#endif
    for (; i < n; i++)
        y[i] = quant_f32_to_f16(x[i]);
}

static void bf16_to_f32(const void *vx, float *y, int64_t n)
{
    const uint16_t *x = vx;
    for (int64_t i = 0; i < n; i++)
        y[i] = quant_bf16_to_f32(x[i]);
}

static void bf16_from_f32(const float *x, void *vy, int64_t n)
{
    uint16_t *y = vy;
    for (int64_t i = 0; i < n; i++)
        y[i] = f32_to_bf16(x[i]);
}

/* Float dots sum in double: the portable answer, exact to one rounding. */
static void dot_f32_scalar(int n, float *s, const void *vw, const void *va)
{
    const float *w = vw, *a = va;
    double sum = 0;
    for (int i = 0; i < n; i++)
        sum += (double)w[i] * a[i];
    *s = (float)sum;
}

static void dot_f16_scalar(int n, float *s, const void *vw, const void *va)
{
    const uint16_t *w = vw, *a = va;
    double sum = 0;
    for (int i = 0; i < n; i++)
        sum += (double)fp16(w[i]) * fp16(a[i]);
    *s = (float)sum;
}

static void dot_bf16_scalar(int n, float *s, const void *vw, const void *va)
{
    const uint16_t *w = vw, *a = va;
    double sum = 0;
    for (int i = 0; i < n; i++)
        sum += (double)quant_bf16_to_f32(w[i]) * quant_bf16_to_f32(a[i]);
    *s = (float)sum;
}

/* ==== legacy 32-element blocks: Q4_0 Q4_1 Q5_0 Q5_1 Q8_0 Q8_1 ==== */

/* 4-bit blocks hold element j (< 16) in the low nibble of byte j and element
 * j + 16 in its high nibble; loops walk the 16 bytes and write both halves.
 * (Written this way on purpose: GCC 12's AVX-512 loop vectorizer miscompiles
 * the equivalent single loop over 32 elements with a j < 16 select.) */

/* The fifth bits of a Q5 block: bit j belongs to element j. */
static inline uint32_t q5_high(const uint8_t *qh)
{
    uint32_t h;
    memcpy(&h, qh, 4);
    return h;
}

static void q4_0_to_f32(const void *vx, float *y, int64_t n)
{
    const blk_q4_0 *x = vx;
    for (int64_t b = 0; b < n / 32; b++, y += 32) {
        float d = fp16(x[b].d);
        for (int j = 0; j < 16; j++) {
            y[j] = ((x[b].qs[j] & 15) - 8) * d;
            y[j + 16] = ((x[b].qs[j] >> 4) - 8) * d;
        }
    }
}

static void q4_1_to_f32(const void *vx, float *y, int64_t n)
{
    const blk_q4_1 *x = vx;
    for (int64_t b = 0; b < n / 32; b++, y += 32) {
        float d = fp16(x[b].d), m = fp16(x[b].m);
        for (int j = 0; j < 16; j++) {
            y[j] = (x[b].qs[j] & 15) * d + m;
            y[j + 16] = (x[b].qs[j] >> 4) * d + m;
        }
    }
}

static void q5_0_to_f32(const void *vx, float *y, int64_t n)
{
    const blk_q5_0 *x = vx;
    for (int64_t b = 0; b < n / 32; b++, y += 32) {
        float d = fp16(x[b].d);
        uint32_t h = q5_high(x[b].qh);
        for (int j = 0; j < 16; j++) {
            y[j] = (int)(((x[b].qs[j] & 15) | ((h >> j) & 1) << 4) - 16) * d;
            y[j + 16] = (int)(((x[b].qs[j] >> 4) | ((h >> (j + 16)) & 1) << 4) - 16) * d;
        }
    }
}

static void q5_1_to_f32(const void *vx, float *y, int64_t n)
{
    const blk_q5_1 *x = vx;
    for (int64_t b = 0; b < n / 32; b++, y += 32) {
        float d = fp16(x[b].d), m = fp16(x[b].m);
        uint32_t h = q5_high(x[b].qh);
        for (int j = 0; j < 16; j++) {
            y[j] = (int)((x[b].qs[j] & 15) | ((h >> j) & 1) << 4) * d + m;
            y[j + 16] = (int)((x[b].qs[j] >> 4) | ((h >> (j + 16)) & 1) << 4) * d + m;
        }
    }
}

static void q8_0_to_f32(const void *vx, float *y, int64_t n)
{
    const blk_q8_0 *x = vx;
    for (int64_t b = 0; b < n / 32; b++, y += 32) {
        float d = fp16(x[b].d);
        for (int j = 0; j < 32; j++)
            y[j] = x[b].qs[j] * d;
    }
}

static void q8_1_to_f32(const void *vx, float *y, int64_t n)
{
    const blk_q8_1 *x = vx;
    for (int64_t b = 0; b < n / 32; b++, y += 32) {
        float d = fp16(x[b].d);
        for (int j = 0; j < 32; j++)
            y[j] = x[b].qs[j] * d;
    }
}

/* Q8_0 / Q8_1 activation quantisation as the reference's x86 SIMD path does
 * it (not its scalar reference function): the scale is d = amax/127 stored as
 * half, but the multiplier is 127/amax (which can differ from 1/d by an ulp),
 * and the rounding is to nearest even. Returns the sum of the quants. */
static int q8_block(const float *x, int8_t *q, uint16_t *dh, float *dout)
{
    float amax = 0;
    for (int j = 0; j < 32; j++)
        amax = fmaxf(amax, fabsf(x[j]));
    float d = amax / 127.f;
    float id = amax != 0.f ? 127.f / amax : 0.f;
    *dh = quant_f32_to_f16(d);
    *dout = d;
    int sum = 0;
    for (int j = 0; j < 32; j++) {
        int v = nearest_int(x[j] * id);
        v = v > 127 ? 127 : v < -128 ? -128 : v; /* the saturating pack */
        q[j] = (int8_t)v;
        sum += v;
    }
    return sum;
}

static void q8_0_from_f32(const float *x, void *vy, int64_t n)
{
    blk_q8_0 *y = vy;
    float d;
    for (int64_t b = 0; b < n / 32; b++)
        q8_block(x + 32 * b, y[b].qs, &y[b].d, &d);
}

static void q8_1_from_f32(const float *x, void *vy, int64_t n)
{
    blk_q8_1 *y = vy;
    float d;
    for (int64_t b = 0; b < n / 32; b++) {
        int sum = q8_block(x + 32 * b, y[b].qs, &y[b].d, &d);
        y[b].s = quant_f32_to_f16(d * (float)sum);
    }
}

/* Weight quantisers of the reference (llama-quantize without an importance
 * matrix): symmetric types scale by the signed extreme so it lands on the end
 * of the range; asymmetric types store min and step. */
static float block_signed_max(const float *x, float *amax_out)
{
    float amax = 0, max = 0;
    for (int j = 0; j < 32; j++)
        if (amax < fabsf(x[j])) {
            amax = fabsf(x[j]);
            max = x[j];
        }
    *amax_out = amax;
    return max;
}

static void block_min_max(const float *x, float *mn, float *mx)
{
    *mn = x[0];
    *mx = x[0];
    for (int j = 1; j < 32; j++) {
        *mn = fminf(*mn, x[j]);
        *mx = fmaxf(*mx, x[j]);
    }
}

static void q4_0_from_f32(const float *x, void *vy, int64_t n)
{
    blk_q4_0 *y = vy;
    for (int64_t b = 0; b < n / 32; b++, x += 32) {
        float amax, max = block_signed_max(x, &amax);
        float d = max / -8, id = d != 0.f ? 1.0f / d : 0.f;
        y[b].d = quant_f32_to_f16(d);
        for (int j = 0; j < 16; j++) {
            int lo = (int)(int8_t)(x[j] * id + 8.5f), hi = (int)(int8_t)(x[j + 16] * id + 8.5f);
            y[b].qs[j] = (uint8_t)((lo < 15 ? lo : 15) | (hi < 15 ? hi : 15) << 4);
        }
    }
}

static void q4_1_from_f32(const float *x, void *vy, int64_t n)
{
    blk_q4_1 *y = vy;
    for (int64_t b = 0; b < n / 32; b++, x += 32) {
        float mn, mx;
        block_min_max(x, &mn, &mx);
        float d = (mx - mn) / 15, id = d != 0.f ? 1.0f / d : 0.f;
        y[b].d = quant_f32_to_f16(d);
        y[b].m = quant_f32_to_f16(mn);
        for (int j = 0; j < 16; j++) {
            int lo = (int)(int8_t)((x[j] - mn) * id + 0.5f);
            int hi = (int)(int8_t)((x[j + 16] - mn) * id + 0.5f);
            y[b].qs[j] = (uint8_t)((lo < 15 ? lo : 15) | (hi < 15 ? hi : 15) << 4);
        }
    }
}

static void q5_0_from_f32(const float *x, void *vy, int64_t n)
{
    blk_q5_0 *y = vy;
    for (int64_t b = 0; b < n / 32; b++, x += 32) {
        float amax, max = block_signed_max(x, &amax);
        float d = max / -16, id = d != 0.f ? 1.0f / d : 0.f;
        y[b].d = quant_f32_to_f16(d);
        uint32_t qh = 0;
        for (int j = 0; j < 16; j++) {
            int lo = (int)(int8_t)(x[j] * id + 16.5f), hi = (int)(int8_t)(x[j + 16] * id + 16.5f);
            lo = lo < 31 ? lo : 31;
            hi = hi < 31 ? hi : 31;
            y[b].qs[j] = (uint8_t)((lo & 15) | (hi & 15) << 4);
            qh |= (uint32_t)(lo >> 4) << j | (uint32_t)(hi >> 4) << (j + 16);
        }
        memcpy(y[b].qh, &qh, 4);
    }
}

static void q5_1_from_f32(const float *x, void *vy, int64_t n)
{
    blk_q5_1 *y = vy;
    for (int64_t b = 0; b < n / 32; b++, x += 32) {
        float mn, mx;
        block_min_max(x, &mn, &mx);
        float d = (mx - mn) / 31, id = d != 0.f ? 1.0f / d : 0.f;
        y[b].d = quant_f32_to_f16(d);
        y[b].m = quant_f32_to_f16(mn);
        uint32_t qh = 0;
        for (int j = 0; j < 16; j++) {
            int lo = (uint8_t)((x[j] - mn) * id + 0.5f), hi = (uint8_t)((x[j + 16] - mn) * id + 0.5f);
            y[b].qs[j] = (uint8_t)((lo & 15) | (hi & 15) << 4);
            qh |= (uint32_t)((lo >> 4) & 1) << j | (uint32_t)((hi >> 4) & 1) << (j + 16);
        }
        memcpy(y[b].qh, &qh, 4);
    }
}

static void dot_q4_0_scalar(int n, float *s, const void *vw, const void *va)
{
    const blk_q4_0 *w = vw;
    const blk_q8_0 *a = va;
    float sum = 0;
    for (int b = 0; b < n / 32; b++) {
        int si = 0;
        for (int j = 0; j < 16; j++)
            si += ((w[b].qs[j] & 15) - 8) * a[b].qs[j] + ((w[b].qs[j] >> 4) - 8) * a[b].qs[j + 16];
        sum += si * (fp16(w[b].d) * fp16(a[b].d));
    }
    *s = sum;
}

static void dot_q4_1_scalar(int n, float *s, const void *vw, const void *va)
{
    const blk_q4_1 *w = vw;
    const blk_q8_1 *a = va;
    float sum = 0;
    for (int b = 0; b < n / 32; b++) {
        int si = 0;
        for (int j = 0; j < 16; j++)
            si += (w[b].qs[j] & 15) * a[b].qs[j] + (w[b].qs[j] >> 4) * a[b].qs[j + 16];
        /* the min meets the activation's stored d*sum(q), as the reference does */
        sum += si * (fp16(w[b].d) * fp16(a[b].d)) + fp16(w[b].m) * fp16(a[b].s);
    }
    *s = sum;
}

static void dot_q5_0_scalar(int n, float *s, const void *vw, const void *va)
{
    const blk_q5_0 *w = vw;
    const blk_q8_0 *a = va;
    float sum = 0;
    for (int b = 0; b < n / 32; b++) {
        int si = 0;
        uint32_t h = q5_high(w[b].qh);
        for (int j = 0; j < 16; j++)
            si += (int)(((w[b].qs[j] & 15) | ((h >> j) & 1) << 4) - 16) * a[b].qs[j] +
                  (int)(((w[b].qs[j] >> 4) | ((h >> (j + 16)) & 1) << 4) - 16) * a[b].qs[j + 16];
        sum += si * (fp16(w[b].d) * fp16(a[b].d));
    }
    *s = sum;
}

static void dot_q5_1_scalar(int n, float *s, const void *vw, const void *va)
{
    const blk_q5_1 *w = vw;
    const blk_q8_1 *a = va;
    float sum = 0;
    for (int b = 0; b < n / 32; b++) {
        int si = 0;
        uint32_t h = q5_high(w[b].qh);
        for (int j = 0; j < 16; j++)
            si += (int)((w[b].qs[j] & 15) | ((h >> j) & 1) << 4) * a[b].qs[j] +
                  (int)((w[b].qs[j] >> 4) | ((h >> (j + 16)) & 1) << 4) * a[b].qs[j + 16];
        sum += si * (fp16(w[b].d) * fp16(a[b].d)) + fp16(w[b].m) * fp16(a[b].s);
    }
    *s = sum;
}

static void dot_q8_0_scalar(int n, float *s, const void *vw, const void *va)
{
    const blk_q8_0 *w = vw, *a = va;
    float sum = 0;
    for (int b = 0; b < n / 32; b++) {
        int si = 0;
        for (int j = 0; j < 32; j++)
            si += w[b].qs[j] * a[b].qs[j];
        sum += si * (fp16(w[b].d) * fp16(a[b].d));
    }
    *s = sum;
}

/* ==== K-quants: Q2_K Q3_K Q4_K Q5_K Q6_K, and the Q8_K activation ==== */

/* The 6-bit (scale, min) pair j of Q4_K/Q5_K, packed in 12 bytes. */
static inline void k4_scale_min(int j, const uint8_t *s, int *sc, int *m)
{
    if (j < 4) {
        *sc = s[j] & 63;
        *m = s[j + 4] & 63;
    } else {
        *sc = (s[j + 4] & 15) | (s[j - 4] >> 6) << 4;
        *m = (s[j + 4] >> 4) | (s[j] >> 6) << 4;
    }
}

/* The signed 6-bit scale j (of 16) of Q3_K, packed in 12 bytes. */
static inline int k3_scale(int j, const uint8_t *s)
{
    int lo = j < 8 ? s[j] & 15 : s[j - 8] >> 4;
    int hi = (s[8 + j % 4] >> (2 * (j / 4))) & 3;
    return (lo | hi << 4) - 32;
}

/* Element k (of 256) of the 2-bit planes used by Q2_K and Q3_K: each 128-element
 * half holds 32 bytes, plane j (elements 32j..32j+31) in bits 2j..2j+1. */
static inline int k2bits(const uint8_t *qs, int k)
{
    int h = k / 128, r = k % 128;
    return (qs[32 * h + r % 32] >> (2 * (r / 32))) & 3;
}

/* The 4-bit layout of Q4_K/Q5_K: 32 bytes per 64 elements, elements 0..31
 * of the 64 in the low nibbles, 32..63 in the high ones. */
static void k4_unpack(const uint8_t *qs, uint8_t *u)
{
    for (int p = 0; p < 4; p++)
        for (int l = 0; l < 32; l++) {
            u[64 * p + l] = qs[32 * p + l] & 15;
            u[64 * p + l + 32] = qs[32 * p + l] >> 4;
        }
}

/* The 6-bit values of Q6_K, 0..63 (the stored value is this minus 32): per
 * 128-element half, plane j (32 elements) takes its low 4 bits from the low
 * (j < 2) or high nibbles of ql and its top 2 bits from bits 2j of qh. */
static void k6_unpack(const blk_q6_K *x, uint8_t *u)
{
    for (int h = 0; h < 2; h++)
        for (int l = 0; l < 32; l++) {
            const uint8_t *ql = x->ql + 64 * h, qh = x->qh[32 * h + l];
            uint8_t *uh = u + 128 * h;
            uh[l] = (uint8_t)((ql[l] & 15) | (qh & 3) << 4);
            uh[l + 32] = (uint8_t)((ql[l + 32] & 15) | ((qh >> 2) & 3) << 4);
            uh[l + 64] = (uint8_t)((ql[l] >> 4) | ((qh >> 4) & 3) << 4);
            uh[l + 96] = (uint8_t)((ql[l + 32] >> 4) | ((qh >> 6) & 3) << 4);
        }
}

static void q2_K_to_f32(const void *vx, float *y, int64_t n)
{
    const blk_q2_K *x = vx;
    for (int64_t i = 0; i < n / QK; i++, y += QK) {
        float d = fp16(x[i].d), dmin = fp16(x[i].dmin);
        for (int s = 0; s < 16; s++) {
            int sc = x[i].scales[s];
            float dl = d * (sc & 15), ml = dmin * (sc >> 4);
            for (int k = 16 * s; k < 16 * s + 16; k++)
                y[k] = dl * k2bits(x[i].qs, k) - ml;
        }
    }
}

static void q3_K_to_f32(const void *vx, float *y, int64_t n)
{
    const blk_q3_K *x = vx;
    for (int64_t i = 0; i < n / QK; i++, y += QK) {
        float d = fp16(x[i].d);
        for (int s = 0; s < 16; s++) {
            float dl = d * k3_scale(s, x[i].scales);
            for (int k = 16 * s; k < 16 * s + 16; k++) {
                int high = (x[i].hmask[k % 32] >> (k / 32)) & 1;
                y[k] = dl * (k2bits(x[i].qs, k) - (high ? 0 : 4));
            }
        }
    }
}

static void q4_K_to_f32(const void *vx, float *y, int64_t n)
{
    const blk_q4_K *x = vx;
    uint8_t u[QK];
    for (int64_t i = 0; i < n / QK; i++, y += QK) {
        float d = fp16(x[i].d), dmin = fp16(x[i].dmin);
        k4_unpack(x[i].qs, u);
        for (int s = 0; s < 8; s++) {
            int sc, m;
            k4_scale_min(s, x[i].scales, &sc, &m);
            float dl = d * sc, ml = dmin * m;
            for (int k = 32 * s; k < 32 * s + 32; k++)
                y[k] = dl * u[k] - ml;
        }
    }
}

static void q5_K_to_f32(const void *vx, float *y, int64_t n)
{
    const blk_q5_K *x = vx;
    uint8_t u[QK];
    for (int64_t i = 0; i < n / QK; i++, y += QK) {
        float d = fp16(x[i].d), dmin = fp16(x[i].dmin);
        k4_unpack(x[i].qs, u);
        for (int s = 0; s < 8; s++) {
            int sc, m;
            k4_scale_min(s, x[i].scales, &sc, &m);
            float dl = d * sc, ml = dmin * m;
            for (int k = 32 * s; k < 32 * s + 32; k++)
                y[k] = dl * (u[k] + ((x[i].qh[k % 32] >> s) & 1) * 16) - ml;
        }
    }
}

static void q6_K_to_f32(const void *vx, float *y, int64_t n)
{
    const blk_q6_K *x = vx;
    uint8_t u[QK];
    for (int64_t i = 0; i < n / QK; i++, y += QK) {
        float d = fp16(x[i].d);
        k6_unpack(&x[i], u);
        for (int k = 0; k < QK; k++) /* scale s covers elements 16s..16s+15 */
            y[k] = d * x[i].scales[k / 16] * (u[k] - 32);
    }
}

static void q8_K_to_f32(const void *vx, float *y, int64_t n)
{
    const blk_q8_K *x = vx;
    for (int64_t i = 0; i < n / QK; i++, y += QK)
        for (int k = 0; k < QK; k++)
            y[k] = x[i].d * x[i].qs[k];
}

/* Q8_K is the reference function on every platform: scale by the signed
 * extreme so it maps to -127, round to nearest even, clamp at 127. */
static void q8_K_from_f32(const float *x, void *vy, int64_t n)
{
    blk_q8_K *y = vy;
    for (int64_t i = 0; i < n / QK; i++, x += QK) {
        float amax = 0, max = 0;
        for (int k = 0; k < QK; k++)
            if (fabsf(x[k]) > amax) {
                amax = fabsf(x[k]);
                max = x[k];
            }
        if (amax == 0.f) {
            memset(&y[i], 0, sizeof y[i]);
            continue;
        }
        float iscale = -127.f / max;
        for (int k = 0; k < QK; k++) {
            int v = nearest_int(iscale * x[k]);
            y[i].qs[k] = (int8_t)(v < 127 ? v : 127);
        }
        for (int g = 0; g < 16; g++) {
            int sum = 0;
            for (int k = 16 * g; k < 16 * g + 16; k++)
                sum += y[i].qs[k];
            y[i].bsums[g] = (int16_t)sum;
        }
        y[i].d = 1 / iscale;
    }
}

/* ---- K-quant weight quantisers (the reference's, without importance) ---- */

/* Best symmetric scale for n values on levels -nmax..nmax-1, trying 19 scales
 * around nmax/max and keeping the one with the least weighted error (weights
 * x^2). Writes levels + nmax to L and returns the scale. */
static float fit_symmetric(int n, int nmax, const float *x, int8_t *L)
{
    float amax = 0, max = 0;
    for (int i = 0; i < n; i++)
        if (fabsf(x[i]) > amax) {
            amax = fabsf(x[i]);
            max = x[i];
        }
    if (amax < 1e-15f) {
        memset(L, 0, (size_t)n);
        return 0.f;
    }
    float iscale = -nmax / max, sumlx = 0, suml2 = 0;
    for (int i = 0; i < n; i++) {
        int l = nearest_int(iscale * x[i]);
        l = l < -nmax ? -nmax : l > nmax - 1 ? nmax - 1 : l;
        L[i] = (int8_t)(l + nmax);
        float w = x[i] * x[i];
        sumlx += w * x[i] * l;
        suml2 += w * l * l;
    }
    float scale = suml2 != 0.f ? sumlx / suml2 : 0.f;
    float best = scale * sumlx;
    for (int is = -9; is <= 9; is++) {
        if (is == 0)
            continue;
        iscale = -(nmax + 0.1f * is) / max;
        sumlx = suml2 = 0;
        for (int i = 0; i < n; i++) {
            int l = nearest_int(iscale * x[i]);
            l = l < -nmax ? -nmax : l > nmax - 1 ? nmax - 1 : l;
            float w = x[i] * x[i];
            sumlx += w * x[i] * l;
            suml2 += w * l * l;
        }
        if (suml2 > 0 && sumlx * sumlx > best * suml2) {
            for (int i = 0; i < n; i++) {
                int l = nearest_int(iscale * x[i]);
                L[i] = (int8_t)(nmax + (l < -nmax ? -nmax : l > nmax - 1 ? nmax - 1 : l));
            }
            scale = sumlx / suml2;
            best = scale * sumlx;
        }
    }
    return scale;
}

/* Q3_K's symmetric fit: start from the extreme, then move single levels while
 * the weighted error drops (up to 5 rounds). Levels are stored unshifted. */
static float fit_symmetric_q3(int n, int nmax, const float *x, int8_t *L)
{
    float amax = 0, max = 0;
    for (int i = 0; i < n; i++)
        if (fabsf(x[i]) > amax) {
            amax = fabsf(x[i]);
            max = x[i];
        }
    if (amax < 1e-15f) {
        memset(L, 0, (size_t)n);
        return 0.f;
    }
    float iscale = -nmax / max, sumlx = 0, suml2 = 0;
    for (int i = 0; i < n; i++) {
        int l = nearest_int(iscale * x[i]);
        l = l < -nmax ? -nmax : l > nmax - 1 ? nmax - 1 : l;
        L[i] = (int8_t)l;
        float w = x[i] * x[i];
        sumlx += w * x[i] * l;
        suml2 += w * l * l;
    }
    for (int round = 0; round < 5; round++) {
        int changed = 0;
        for (int i = 0; i < n; i++) {
            float w = x[i] * x[i];
            float slx = sumlx - w * x[i] * L[i];
            if (slx <= 0)
                continue;
            float sl2 = suml2 - w * L[i] * L[i];
            int l = nearest_int(x[i] * sl2 / slx);
            l = l < -nmax ? -nmax : l > nmax - 1 ? nmax - 1 : l;
            if (l == L[i])
                continue;
            slx += w * x[i] * l;
            sl2 += w * l * l;
            if (sl2 > 0 && slx * slx * suml2 > sumlx * sumlx * sl2) {
                L[i] = (int8_t)l;
                sumlx = slx;
                suml2 = sl2;
                changed++;
            }
        }
        if (!changed)
            break;
    }
    for (int i = 0; i < n; i++)
        L[i] = (int8_t)(L[i] + nmax);
    return sumlx / suml2;
}

/* Best (scale, min) for n values on levels 0..nmax with the min clamped to
 * <= 0: start from max - min, then try nstep+1 alternative scales and solve
 * the weighted least-squares (scale, min) for each level assignment. Returns
 * the scale; *neg_min = -min >= 0. use_mad: absolute instead of squared error. */
static float fit_affine(int n, int nmax, const float *x, const float *w, uint8_t *L,
                        float *neg_min, float rmin, float rdelta, int nstep, int use_mad)
{
    float min = x[0], max = x[0], sum_w = w[0], sum_x = w[0] * x[0];
    for (int i = 1; i < n; i++) {
        min = fminf(min, x[i]);
        max = fmaxf(max, x[i]);
        sum_w += w[i];
        sum_x += w[i] * x[i];
    }
    if (min > 0)
        min = 0;
    if (max == min) {
        memset(L, 0, (size_t)n);
        *neg_min = -min;
        return 0.f;
    }
    float iscale = nmax / (max - min), scale = 1 / iscale, best = 0;
    for (int i = 0; i < n; i++) {
        int l = nearest_int(iscale * (x[i] - min));
        L[i] = (uint8_t)(l < 0 ? 0 : l > nmax ? nmax : l);
        float diff = scale * L[i] + min - x[i];
        best += w[i] * (use_mad ? fabsf(diff) : diff * diff);
    }
    uint8_t Laux[32];
    for (int is = 0; is <= nstep; is++) {
        iscale = (rmin + rdelta * is + nmax) / (max - min);
        float sum_l = 0, sum_l2 = 0, sum_xl = 0;
        for (int i = 0; i < n; i++) {
            int l = nearest_int(iscale * (x[i] - min));
            l = l < 0 ? 0 : l > nmax ? nmax : l;
            Laux[i] = (uint8_t)l;
            sum_l += w[i] * l;
            sum_l2 += w[i] * l * l;
            sum_xl += w[i] * l * x[i];
        }
        float D = sum_w * sum_l2 - sum_l * sum_l;
        if (D <= 0)
            continue;
        float this_scale = (sum_w * sum_xl - sum_x * sum_l) / D;
        float this_min = (sum_l2 * sum_x - sum_l * sum_xl) / D;
        if (this_min > 0) {
            this_min = 0;
            this_scale = sum_xl / sum_l2;
        }
        float err = 0;
        for (int i = 0; i < n; i++) {
            float diff = this_scale * Laux[i] + this_min - x[i];
            err += w[i] * (use_mad ? fabsf(diff) : diff * diff);
        }
        if (err < best) {
            memcpy(L, Laux, (size_t)n);
            best = err;
            scale = this_scale;
            min = this_min;
        }
    }
    *neg_min = -min;
    return scale;
}

/* Packs 2-bit levels L[256] into the four planes of Q2_K/Q3_K. */
static void k2_pack(const uint8_t *L, uint8_t *qs)
{
    for (int h = 0; h < 2; h++)
        for (int l = 0; l < 32; l++)
            qs[32 * h + l] = (uint8_t)(L[128 * h + l] | L[128 * h + l + 32] << 2 |
                                       L[128 * h + l + 64] << 4 | L[128 * h + l + 96] << 6);
}

static void q2_K_from_f32(const float *x, void *vy, int64_t n)
{
    blk_q2_K *y = vy;
    uint8_t L[QK];
    float scales[16], mins[16], w[16];
    for (int64_t i = 0; i < n / QK; i++, x += QK) {
        float max_scale = 0, max_min = 0;
        for (int s = 0; s < 16; s++) {
            for (int l = 0; l < 16; l++)
                w[l] = fabsf(x[16 * s + l]);
            scales[s] = fit_affine(16, 3, x + 16 * s, w, L + 16 * s, &mins[s], -0.5f, 0.1f, 15, 1);
            max_scale = fmaxf(max_scale, scales[s]);
            max_min = fmaxf(max_min, mins[s]);
        }
        memset(y[i].scales, 0, 16);
        y[i].d = quant_f32_to_f16(max_scale > 0 ? max_scale / 15.f : 0.f);
        y[i].dmin = quant_f32_to_f16(max_min > 0 ? max_min / 15.f : 0.f);
        for (int s = 0; s < 16; s++) {
            if (max_scale > 0)
                y[i].scales[s] = (uint8_t)nearest_int(15.f / max_scale * scales[s]);
            if (max_min > 0)
                y[i].scales[s] |= (uint8_t)(nearest_int(15.f / max_min * mins[s]) << 4);
        }
        /* requantise against the scales actually stored */
        for (int s = 0; s < 16; s++) {
            float d = fp16(y[i].d) * (y[i].scales[s] & 15);
            if (d == 0.f)
                continue;
            float dm = fp16(y[i].dmin) * (y[i].scales[s] >> 4);
            for (int l = 0; l < 16; l++) {
                int q = nearest_int((x[16 * s + l] + dm) / d);
                L[16 * s + l] = (uint8_t)(q < 0 ? 0 : q > 3 ? 3 : q);
            }
        }
        k2_pack(L, y[i].qs);
    }
}

static void q3_K_from_f32(const float *x, void *vy, int64_t n)
{
    blk_q3_K *y = vy;
    int8_t L[QK];
    float scales[16];
    for (int64_t i = 0; i < n / QK; i++, x += QK) {
        float max_scale = 0, amax = 0;
        for (int s = 0; s < 16; s++) {
            scales[s] = fit_symmetric_q3(16, 4, x + 16 * s, L + 16 * s);
            if (fabsf(scales[s]) > amax) {
                amax = fabsf(scales[s]);
                max_scale = scales[s];
            }
        }
        memset(y[i].scales, 0, 12);
        if (max_scale != 0.f) {
            float iscale = -32.f / max_scale;
            for (int s = 0; s < 16; s++) {
                int l = nearest_int(iscale * scales[s]);
                l = (l < -32 ? -32 : l > 31 ? 31 : l) + 32;
                if (s < 8)
                    y[i].scales[s] = (uint8_t)(l & 15);
                else
                    y[i].scales[s - 8] |= (uint8_t)((l & 15) << 4);
                y[i].scales[8 + s % 4] |= (uint8_t)((l >> 4) << (2 * (s / 4)));
            }
            y[i].d = quant_f32_to_f16(1 / iscale);
        } else {
            y[i].d = 0;
        }
        for (int s = 0; s < 16; s++) {
            float d = fp16(y[i].d) * k3_scale(s, y[i].scales);
            if (d == 0.f)
                continue;
            for (int l = 0; l < 16; l++) {
                int q = nearest_int(x[16 * s + l] / d);
                L[16 * s + l] = (int8_t)((q < -4 ? -4 : q > 3 ? 3 : q) + 4);
            }
        }
        uint8_t low[QK];
        memset(y[i].hmask, 0, 32);
        for (int k = 0; k < QK; k++) {
            if (L[k] > 3)
                y[i].hmask[k % 32] |= (uint8_t)(1 << (k / 32));
            low[k] = (uint8_t)(L[k] & 3);
        }
        k2_pack(low, y[i].qs);
    }
}

/* Q4_K and Q5_K share everything but the level count and the high bits. */
static void k45_from_f32(const float *x, uint8_t *L, uint16_t *dh, uint16_t *dminh,
                         uint8_t *packed, int nmax)
{
    float scales[8], mins[8], w[32];
    float max_scale = 0, max_min = 0;
    for (int s = 0; s < 8; s++) {
        const float *xs = x + 32 * s;
        float sum_x2 = 0;
        for (int l = 0; l < 32; l++)
            sum_x2 += xs[l] * xs[l];
        float av_x = sqrtf(sum_x2 / 32);
        for (int l = 0; l < 32; l++)
            w[l] = av_x + fabsf(xs[l]);
        scales[s] = nmax == 15
                        ? fit_affine(32, nmax, xs, w, L + 32 * s, &mins[s], -1.f, 0.1f, 20, 0)
                        : fit_affine(32, nmax, xs, w, L + 32 * s, &mins[s], -0.5f, 0.1f, 15, 0);
        max_scale = fmaxf(max_scale, scales[s]);
        max_min = fmaxf(max_min, mins[s]);
    }
    float inv_scale = max_scale > 0 ? 63.f / max_scale : 0.f;
    float inv_min = max_min > 0 ? 63.f / max_min : 0.f;
    for (int s = 0; s < 8; s++) {
        int ls = nearest_int(inv_scale * scales[s]), lm = nearest_int(inv_min * mins[s]);
        ls = ls < 63 ? ls : 63;
        lm = lm < 63 ? lm : 63;
        if (s < 4) {
            packed[s] = (uint8_t)ls;
            packed[s + 4] = (uint8_t)lm;
        } else {
            packed[s + 4] = (uint8_t)((ls & 15) | (lm & 15) << 4);
            packed[s - 4] |= (uint8_t)((ls >> 4) << 6);
            packed[s] |= (uint8_t)((lm >> 4) << 6);
        }
    }
    *dh = quant_f32_to_f16(max_scale / 63.f);
    *dminh = quant_f32_to_f16(max_min / 63.f);
    for (int s = 0; s < 8; s++) {
        int sc, m;
        k4_scale_min(s, packed, &sc, &m);
        float d = fp16(*dh) * sc;
        if (d == 0.f)
            continue;
        float dm = fp16(*dminh) * m;
        for (int l = 0; l < 32; l++) {
            int q = nearest_int((x[32 * s + l] + dm) / d);
            L[32 * s + l] = (uint8_t)(q < 0 ? 0 : q > nmax ? nmax : q);
        }
    }
}

static void q4_K_from_f32(const float *x, void *vy, int64_t n)
{
    blk_q4_K *y = vy;
    uint8_t L[QK];
    for (int64_t i = 0; i < n / QK; i++, x += QK) {
        memset(y[i].scales, 0, 12);
        k45_from_f32(x, L, &y[i].d, &y[i].dmin, y[i].scales, 15);
        for (int p = 0; p < 4; p++)
            for (int l = 0; l < 32; l++)
                y[i].qs[32 * p + l] = (uint8_t)(L[64 * p + l] | L[64 * p + l + 32] << 4);
    }
}

static void q5_K_from_f32(const float *x, void *vy, int64_t n)
{
    blk_q5_K *y = vy;
    uint8_t L[QK];
    for (int64_t i = 0; i < n / QK; i++, x += QK) {
        memset(y[i].scales, 0, 12);
        k45_from_f32(x, L, &y[i].d, &y[i].dmin, y[i].scales, 31);
        memset(y[i].qh, 0, 32);
        for (int k = 0; k < QK; k++)
            if (L[k] > 15)
                y[i].qh[k % 32] |= (uint8_t)(1 << (k / 32));
        for (int p = 0; p < 4; p++)
            for (int l = 0; l < 32; l++)
                y[i].qs[32 * p + l] =
                    (uint8_t)((L[64 * p + l] & 15) | (L[64 * p + l + 32] & 15) << 4);
    }
}

static void q6_K_from_f32(const float *x, void *vy, int64_t n)
{
    blk_q6_K *y = vy;
    int8_t L[QK];
    float scales[16];
    for (int64_t i = 0; i < n / QK; i++, x += QK) {
        float max_scale = 0, amax = 0;
        for (int s = 0; s < 16; s++) {
            scales[s] = fit_symmetric(16, 32, x + 16 * s, L + 16 * s);
            if (fabsf(scales[s]) > amax) {
                amax = fabsf(scales[s]);
                max_scale = scales[s];
            }
        }
        if (amax < 1e-15f) {
            memset(&y[i], 0, sizeof y[i]);
            continue;
        }
        float iscale = -128.f / max_scale;
        y[i].d = quant_f32_to_f16(1 / iscale);
        for (int s = 0; s < 16; s++) {
            int l = nearest_int(iscale * scales[s]);
            y[i].scales[s] = (int8_t)(l < 127 ? l : 127);
        }
        for (int s = 0; s < 16; s++) {
            float d = fp16(y[i].d) * y[i].scales[s];
            if (d == 0.f)
                continue;
            for (int l = 0; l < 16; l++) {
                int q = nearest_int(x[16 * s + l] / d);
                L[16 * s + l] = (int8_t)((q < -32 ? -32 : q > 31 ? 31 : q) + 32);
            }
        }
        for (int h = 0; h < 2; h++)
            for (int l = 0; l < 32; l++) {
                const int8_t *Lh = L + 128 * h;
                y[i].ql[64 * h + l] = (uint8_t)((Lh[l] & 15) | (Lh[l + 64] & 15) << 4);
                y[i].ql[64 * h + l + 32] = (uint8_t)((Lh[l + 32] & 15) | (Lh[l + 96] & 15) << 4);
                y[i].qh[32 * h + l] = (uint8_t)(Lh[l] >> 4 | (Lh[l + 32] >> 4) << 2 |
                                                (Lh[l + 64] >> 4) << 4 | (Lh[l + 96] >> 4) << 6);
            }
    }
}

/* ==== IQ types: IQ4_NL IQ4_XS IQ2_XXS IQ2_XS IQ2_S IQ3_XXS IQ3_S ==== */

static void iq4_nl_to_f32(const void *vx, float *y, int64_t n)
{
    const blk_iq4_nl *x = vx;
    for (int64_t b = 0; b < n / 32; b++, y += 32) {
        float d = fp16(x[b].d);
        for (int j = 0; j < 16; j++) {
            y[j] = d * kvalues_iq4nl[x[b].qs[j] & 15];
            y[j + 16] = d * kvalues_iq4nl[x[b].qs[j] >> 4];
        }
    }
}

/* The 6-bit scale of sub-block s of IQ4_XS, minus its bias of 32. */
static inline int iq4xs_scale(const blk_iq4_xs *x, int s)
{
    int lo = (x->scales_l[s / 2] >> (4 * (s % 2))) & 15;
    int hi = (x->scales_h >> (2 * s)) & 3;
    return (lo | hi << 4) - 32;
}

static void iq4_xs_to_f32(const void *vx, float *y, int64_t n)
{
    const blk_iq4_xs *x = vx;
    for (int64_t i = 0; i < n / QK; i++, y += QK) {
        float d = fp16(x[i].d);
        for (int s = 0; s < 8; s++) {
            float dl = d * iq4xs_scale(&x[i], s);
            const uint8_t *qs = x[i].qs + 16 * s;
            for (int j = 0; j < 16; j++) {
                y[32 * s + j] = dl * kvalues_iq4nl[qs[j] & 15];
                y[32 * s + j + 16] = dl * kvalues_iq4nl[qs[j] >> 4];
            }
        }
    }
}

/* Writes 8 grid magnitudes with their signs, times db, as the reference
 * orders it: (db * magnitude) then the sign. */
static inline void iq_put8(float *y, float db, const uint8_t *mag, uint8_t signs)
{
    for (int j = 0; j < 8; j++)
        y[j] = db * mag[j] * ((signs >> j) & 1 ? -1.f : 1.f);
}

static void iq2_xxs_to_f32(const void *vx, float *y, int64_t n)
{
    const blk_iq2_xxs *x = vx;
    for (int64_t i = 0; i < n / QK; i++) {
        float d = fp16(x[i].d);
        for (int ib = 0; ib < 8; ib++) {
            uint32_t idx = x[i].qs[4 * ib] | (uint32_t)x[i].qs[4 * ib + 1] << 16;
            uint32_t aux = x[i].qs[4 * ib + 2] | (uint32_t)x[i].qs[4 * ib + 3] << 16;
            float db = d * (0.5f + (aux >> 28)) * 0.25f;
            for (int l = 0; l < 4; l++, y += 8)
                iq_put8(y, db, (const uint8_t *)&iq2xxs_grid[(idx >> 8 * l) & 255],
                        iq_signs((aux >> 7 * l) & 127));
        }
    }
}

static void iq2_xs_to_f32(const void *vx, float *y, int64_t n)
{
    const blk_iq2_xs *x = vx;
    for (int64_t i = 0; i < n / QK; i++) {
        float d = fp16(x[i].d);
        for (int ib = 0; ib < 8; ib++) {
            float db[2] = {d * (0.5f + (x[i].scales[ib] & 15)) * 0.25f,
                           d * (0.5f + (x[i].scales[ib] >> 4)) * 0.25f};
            for (int l = 0; l < 4; l++, y += 8) {
                uint16_t q = x[i].qs[4 * ib + l];
                iq_put8(y, db[l / 2], (const uint8_t *)&iq2xs_grid[q & 511], iq_signs(q >> 9));
            }
        }
    }
}

static void iq2_s_to_f32(const void *vx, float *y, int64_t n)
{
    const blk_iq2_s *x = vx;
    for (int64_t i = 0; i < n / QK; i++) {
        float d = fp16(x[i].d);
        for (int ib = 0; ib < 8; ib++) {
            float db[2] = {d * (0.5f + (x[i].scales[ib] & 15)) * 0.25f,
                           d * (0.5f + (x[i].scales[ib] >> 4)) * 0.25f};
            for (int l = 0; l < 4; l++, y += 8) {
                int idx = x[i].qs[4 * ib + l] | ((x[i].qh[ib] >> (2 * l)) & 3) << 8;
                iq_put8(y, db[l / 2], (const uint8_t *)&iq2s_grid[idx], x[i].qs[32 + 4 * ib + l]);
            }
        }
    }
}

static void iq3_xxs_to_f32(const void *vx, float *y, int64_t n)
{
    const blk_iq3_xxs *x = vx;
    for (int64_t i = 0; i < n / QK; i++) {
        float d = fp16(x[i].d);
        for (int ib = 0; ib < 8; ib++) {
            uint32_t aux;
            memcpy(&aux, x[i].qs + 64 + 4 * ib, 4);
            float db = d * (0.5f + (aux >> 28)) * 0.5f;
            for (int l = 0; l < 4; l++, y += 8) {
                uint8_t mag[8];
                memcpy(mag, &iq3xxs_grid[x[i].qs[8 * ib + 2 * l]], 4);
                memcpy(mag + 4, &iq3xxs_grid[x[i].qs[8 * ib + 2 * l + 1]], 4);
                iq_put8(y, db, mag, iq_signs((aux >> 7 * l) & 127));
            }
        }
    }
}

static void iq3_s_to_f32(const void *vx, float *y, int64_t n)
{
    const blk_iq3_s *x = vx;
    for (int64_t i = 0; i < n / QK; i++) {
        float d = fp16(x[i].d);
        for (int ib = 0; ib < 8; ib++) {
            float db = d * (1 + 2 * ((x[i].scales[ib / 2] >> (4 * (ib % 2))) & 15));
            for (int l = 0; l < 4; l++, y += 8) {
                int qh = x[i].qh[ib];
                uint8_t mag[8];
                memcpy(mag, &iq3s_grid[x[i].qs[8 * ib + 2 * l] | ((qh >> (2 * l)) & 1) << 8], 4);
                memcpy(mag + 4, &iq3s_grid[x[i].qs[8 * ib + 2 * l + 1] | ((qh >> (2 * l + 1)) & 1) << 8], 4);
                iq_put8(y, db, mag, x[i].signs[4 * ib + l]);
            }
        }
    }
}

/* ---- IQ4 quantisers (the reference's, without importance: weights x^2) ---- */

/* Index of the codebook value nearest to x (ties to the lower one). */
static int iq4_nearest(float x)
{
    const int8_t *v = kvalues_iq4nl;
    if (x <= v[0])
        return 0;
    if (x >= v[15])
        return 15;
    int lo = 0, hi = 15;
    while (hi - lo > 1) {
        int mid = (lo + hi) / 2;
        if (x < v[mid])
            hi = mid;
        else
            lo = mid;
    }
    return x - v[hi - 1] < v[hi] - x ? hi - 1 : hi;
}

/* Fits one 32-element block: the scale mapping the extreme to the first
 * codebook value, then 15 neighbouring scales, keeping the least weighted
 * error. Writes indices to L and returns the scale (0 for an all-zero block). */
static float iq4_fit_block(const float *x, uint8_t *L)
{
    float w[32], amax = 0, max = 0;
    for (int j = 0; j < 32; j++) {
        w[j] = x[j] * x[j];
        if (fabsf(x[j]) > amax) {
            amax = fabsf(x[j]);
            max = x[j];
        }
    }
    if (amax < 1e-15f) {
        memset(L, 0, 32);
        return 0.f;
    }
    const int8_t *v = kvalues_iq4nl;
    float d = -max / v[0], id = 1 / d, sumqx = 0, sumq2 = 0;
    for (int j = 0; j < 32; j++) {
        L[j] = (uint8_t)iq4_nearest(id * x[j]);
        float q = v[L[j]];
        sumqx += w[j] * q * x[j];
        sumq2 += w[j] * q * q;
    }
    d = sumqx / sumq2;
    float best = d * sumqx;
    for (int itry = -7; itry <= 7; itry++) {
        id = (itry + v[0]) / max;
        sumqx = sumq2 = 0;
        for (int j = 0; j < 32; j++) {
            float q = v[iq4_nearest(id * x[j])];
            sumqx += w[j] * q * x[j];
            sumq2 += w[j] * q * q;
        }
        if (sumq2 > 0 && sumqx * sumqx > best * sumq2) {
            d = sumqx / sumq2;
            best = d * sumqx;
        }
    }
    return d;
}

static void iq4_pack(const uint8_t *L, uint8_t *qs)
{
    for (int j = 0; j < 16; j++)
        qs[j] = (uint8_t)(L[j] | L[j + 16] << 4);
}

static void iq4_nl_from_f32(const float *x, void *vy, int64_t n)
{
    blk_iq4_nl *y = vy;
    uint8_t L[32];
    for (int64_t b = 0; b < n / 32; b++, x += 32) {
        float d = iq4_fit_block(x, L);
        float id = d != 0.f ? 1 / d : 0.f; /* re-pick the indices for the final scale */
        y[b].d = quant_f32_to_f16(d);
        for (int j = 0; j < 32; j++)
            L[j] = (uint8_t)iq4_nearest(id * x[j]);
        iq4_pack(L, y[b].qs);
    }
}

static void iq4_xs_from_f32(const float *x, void *vy, int64_t n)
{
    blk_iq4_xs *y = vy;
    uint8_t L[32];
    float scales[8];
    for (int64_t i = 0; i < n / QK; i++, x += QK) {
        float max_scale = 0, amax = 0;
        for (int s = 0; s < 8; s++) {
            scales[s] = iq4_fit_block(x + 32 * s, L);
            if (fabsf(scales[s]) > amax) {
                amax = fabsf(scales[s]);
                max_scale = scales[s];
            }
        }
        float d = -max_scale / 32, id = d != 0.f ? 1 / d : 0.f;
        y[i].d = quant_f32_to_f16(d);
        y[i].scales_h = 0;
        memset(y[i].scales_l, 0, 4);
        for (int s = 0; s < 8; s++) {
            int l = nearest_int(id * scales[s]);
            l = l < -32 ? -32 : l > 31 ? 31 : l;
            float dl = d * l, idl = dl != 0.f ? 1 / dl : 0.f;
            for (int j = 0; j < 32; j++)
                L[j] = (uint8_t)iq4_nearest(idl * x[32 * s + j]);
            iq4_pack(L, y[i].qs + 16 * s);
            l += 32;
            y[i].scales_l[s / 2] |= (uint8_t)((l & 15) << (4 * (s % 2)));
            y[i].scales_h |= (uint16_t)((l >> 4) << (2 * s));
        }
    }
}

static void dot_iq4_nl_scalar(int n, float *s, const void *vw, const void *va)
{
    const blk_iq4_nl *w = vw;
    const blk_q8_0 *a = va;
    float sum = 0;
    for (int b = 0; b < n / 32; b++) {
        int si = 0;
        for (int j = 0; j < 16; j++)
            si += kvalues_iq4nl[w[b].qs[j] & 15] * a[b].qs[j] +
                  kvalues_iq4nl[w[b].qs[j] >> 4] * a[b].qs[j + 16];
        sum += fp16(w[b].d) * fp16(a[b].d) * si;
    }
    *s = sum;
}

/* ==== super-blocks as integers: the shared form of the Q8_K dots ==== */

/* One K or IQ super-block decoded to integers. Element k equals
 *   d * sc[k/sb] * (u[k] - bias) - dmin * mn[k/sb]
 * with u unsigned: the form every Q8_K dot (scalar and tiled) consumes. */
struct ksb {
    uint8_t u[QK];   /* levels shifted by bias to be unsigned */
    int16_t sc[16];  /* sub-block scales */
    int16_t mn[16];  /* sub-block mins (zero where the type has none) */
    float d, dmin;
    int sb, bias;    /* sub-block size (16 or 32), level offset */
};

static void ksb_q2_K(const void *vx, struct ksb *k)
{
    const blk_q2_K *x = vx;
    k->sb = 16;
    k->bias = 0;
    k->d = fp16(x->d);
    k->dmin = fp16(x->dmin);
    for (int s = 0; s < 16; s++) {
        k->sc[s] = x->scales[s] & 15;
        k->mn[s] = x->scales[s] >> 4;
    }
    for (int i = 0; i < QK; i++)
        k->u[i] = (uint8_t)k2bits(x->qs, i);
}

static void ksb_q3_K(const void *vx, struct ksb *k)
{
    const blk_q3_K *x = vx;
    k->sb = 16;
    k->bias = 4;
    k->d = fp16(x->d);
    k->dmin = 0;
    for (int s = 0; s < 16; s++) {
        k->sc[s] = (int16_t)k3_scale(s, x->scales);
        k->mn[s] = 0;
    }
    for (int i = 0; i < QK; i++)
        k->u[i] = (uint8_t)(k2bits(x->qs, i) | ((x->hmask[i % 32] >> (i / 32)) & 1) << 2);
}

static void ksb_q4_K(const void *vx, struct ksb *k)
{
    const blk_q4_K *x = vx;
    k->sb = 32;
    k->bias = 0;
    k->d = fp16(x->d);
    k->dmin = fp16(x->dmin);
    for (int s = 0; s < 8; s++) {
        int sc, m;
        k4_scale_min(s, x->scales, &sc, &m);
        k->sc[s] = (int16_t)sc;
        k->mn[s] = (int16_t)m;
    }
    k4_unpack(x->qs, k->u);
}

static void ksb_q5_K(const void *vx, struct ksb *k)
{
    const blk_q5_K *x = vx;
    k->sb = 32;
    k->bias = 0;
    k->d = fp16(x->d);
    k->dmin = fp16(x->dmin);
    for (int s = 0; s < 8; s++) {
        int sc, m;
        k4_scale_min(s, x->scales, &sc, &m);
        k->sc[s] = (int16_t)sc;
        k->mn[s] = (int16_t)m;
    }
    k4_unpack(x->qs, k->u);
    for (int i = 0; i < QK; i++) /* the fifth bit of sub-block s is bit s of qh */
        k->u[i] |= (uint8_t)(((x->qh[i % 32] >> (i / 32)) & 1) << 4);
}

static void ksb_q6_K(const void *vx, struct ksb *k)
{
    const blk_q6_K *x = vx;
    k->sb = 16;
    k->bias = 32;
    k->d = fp16(x->d);
    k->dmin = 0;
    for (int s = 0; s < 16; s++) {
        k->sc[s] = x->scales[s];
        k->mn[s] = 0;
    }
    k6_unpack(x, k->u);
}

static void ksb_iq4_xs(const void *vx, struct ksb *k)
{
    const blk_iq4_xs *x = vx;
    k->sb = 32;
    k->bias = 128;
    k->d = fp16(x->d);
    k->dmin = 0;
    for (int s = 0; s < 8; s++) {
        k->sc[s] = (int16_t)iq4xs_scale(x, s);
        k->mn[s] = 0;
        for (int j = 0; j < 16; j++) {
            k->u[32 * s + j] = (uint8_t)(kvalues_iq4nl[x->qs[16 * s + j] & 15] + 128);
            k->u[32 * s + j + 16] = (uint8_t)(kvalues_iq4nl[x->qs[16 * s + j] >> 4] + 128);
        }
    }
}

/* The IQ2/IQ3 types: value = magnitude with sign, scale 2*nibble + 1, and a
 * constant factor (1/8 for IQ2, 1/4 for IQ3_XXS) folded into d. */
static inline void ksb_iq_put8(uint8_t *u, const uint8_t *mag, uint8_t signs)
{
    for (int j = 0; j < 8; j++)
        u[j] = (uint8_t)(128 + ((signs >> j) & 1 ? -mag[j] : mag[j]));
}

static void ksb_iq_common(struct ksb *k, float d, float factor)
{
    k->sb = 32;
    k->bias = 128;
    k->d = d * factor;
    k->dmin = 0;
    memset(k->mn, 0, sizeof k->mn);
}

static void ksb_iq2_xxs(const void *vx, struct ksb *k)
{
    const blk_iq2_xxs *x = vx;
    ksb_iq_common(k, fp16(x->d), 0.125f);
    for (int ib = 0; ib < 8; ib++) {
        uint32_t idx = x->qs[4 * ib] | (uint32_t)x->qs[4 * ib + 1] << 16;
        uint32_t aux = x->qs[4 * ib + 2] | (uint32_t)x->qs[4 * ib + 3] << 16;
        k->sc[ib] = (int16_t)(2 * (aux >> 28) + 1);
        for (int l = 0; l < 4; l++)
            ksb_iq_put8(k->u + 32 * ib + 8 * l, (const uint8_t *)&iq2xxs_grid[(idx >> 8 * l) & 255],
                        iq_signs((aux >> 7 * l) & 127));
    }
}

/* IQ2_XS and IQ2_S have two scales per 32 elements: use 16-element sub-blocks. */
static void ksb_iq2_xs(const void *vx, struct ksb *k)
{
    const blk_iq2_xs *x = vx;
    ksb_iq_common(k, fp16(x->d), 0.125f);
    k->sb = 16;
    for (int ib = 0; ib < 8; ib++) {
        k->sc[2 * ib] = (int16_t)(2 * (x->scales[ib] & 15) + 1);
        k->sc[2 * ib + 1] = (int16_t)(2 * (x->scales[ib] >> 4) + 1);
        for (int l = 0; l < 4; l++) {
            uint16_t q = x->qs[4 * ib + l];
            ksb_iq_put8(k->u + 32 * ib + 8 * l, (const uint8_t *)&iq2xs_grid[q & 511], iq_signs(q >> 9));
        }
    }
}

static void ksb_iq2_s(const void *vx, struct ksb *k)
{
    const blk_iq2_s *x = vx;
    ksb_iq_common(k, fp16(x->d), 0.125f);
    k->sb = 16;
    for (int ib = 0; ib < 8; ib++) {
        k->sc[2 * ib] = (int16_t)(2 * (x->scales[ib] & 15) + 1);
        k->sc[2 * ib + 1] = (int16_t)(2 * (x->scales[ib] >> 4) + 1);
        for (int l = 0; l < 4; l++) {
            int idx = x->qs[4 * ib + l] | ((x->qh[ib] >> (2 * l)) & 3) << 8;
            ksb_iq_put8(k->u + 32 * ib + 8 * l, (const uint8_t *)&iq2s_grid[idx], x->qs[32 + 4 * ib + l]);
        }
    }
}

static void ksb_iq3_xxs(const void *vx, struct ksb *k)
{
    const blk_iq3_xxs *x = vx;
    ksb_iq_common(k, fp16(x->d), 0.25f);
    for (int ib = 0; ib < 8; ib++) {
        uint32_t aux;
        memcpy(&aux, x->qs + 64 + 4 * ib, 4);
        k->sc[ib] = (int16_t)(2 * (aux >> 28) + 1);
        for (int l = 0; l < 4; l++) {
            uint8_t mag[8];
            memcpy(mag, &iq3xxs_grid[x->qs[8 * ib + 2 * l]], 4);
            memcpy(mag + 4, &iq3xxs_grid[x->qs[8 * ib + 2 * l + 1]], 4);
            ksb_iq_put8(k->u + 32 * ib + 8 * l, mag, iq_signs((aux >> 7 * l) & 127));
        }
    }
}

static void ksb_iq3_s(const void *vx, struct ksb *k)
{
    const blk_iq3_s *x = vx;
    ksb_iq_common(k, fp16(x->d), 1.f);
    for (int ib = 0; ib < 8; ib++) {
        k->sc[ib] = (int16_t)(2 * ((x->scales[ib / 2] >> (4 * (ib % 2))) & 15) + 1);
        int qh = x->qh[ib];
        for (int l = 0; l < 4; l++) {
            uint8_t mag[8];
            memcpy(mag, &iq3s_grid[x->qs[8 * ib + 2 * l] | ((qh >> (2 * l)) & 1) << 8], 4);
            memcpy(mag + 4, &iq3s_grid[x->qs[8 * ib + 2 * l + 1] | ((qh >> (2 * l + 1)) & 1) << 8], 4);
            ksb_iq_put8(k->u + 32 * ib + 8 * l, mag, x->signs[4 * ib + l]);
        }
    }
}

/* One super-block's dot with a Q8_K block. The integer part is exact: at most
 * 16 * 127 * (16 * 63 * 127) < 2^31 for the widest type (Q6_K). */
static float ksb_dot(const struct ksb *k, const blk_q8_K *a)
{
    int isum = 0, msum = 0;
    for (int s = 0; s < QK / k->sb; s++) {
        int dot = 0, asum = 0;
        for (int i = s * k->sb; i < (s + 1) * k->sb; i++)
            dot += k->u[i] * a->qs[i];
        for (int g = s * k->sb / 16; g < (s + 1) * k->sb / 16; g++)
            asum += a->bsums[g];
        isum += k->sc[s] * (dot - k->bias * asum);
        msum += k->mn[s] * asum;
    }
    return a->d * (k->d * (float)isum - k->dmin * (float)msum);
}

#define KSB_DOT(type)                                                              \
    static void dot_##type##_scalar(int n, float *s, const void *vw, const void *va) \
    {                                                                              \
        const blk_##type *w = vw;                                                  \
        const blk_q8_K *a = va;                                                    \
        struct ksb k;                                                              \
        float sum = 0;                                                             \
        for (int i = 0; i < n / QK; i++) {                                         \
            ksb_##type(&w[i], &k);                                                 \
            sum += ksb_dot(&k, &a[i]);                                             \
        }                                                                          \
        *s = sum;                                                                  \
    }
KSB_DOT(q2_K)
KSB_DOT(q3_K)
KSB_DOT(q4_K)
KSB_DOT(q5_K)
KSB_DOT(q6_K)
KSB_DOT(iq4_xs)
KSB_DOT(iq2_xxs)
KSB_DOT(iq2_xs)
KSB_DOT(iq2_s)
KSB_DOT(iq3_xxs)
KSB_DOT(iq3_s)

/* ==== the type table ==== */

#define DOTS(f) f, f /* the same function as dot and dot_scalar */

static const struct quant_type qtypes[QT_COUNT] = {
    [QT_F32] = {"F32", 1, 4, QT_F32, f32_to_f32, f32_from_f32, DOTS(dot_f32_scalar)},
    [QT_F16] = {"F16", 1, 2, QT_F16, f16_to_f32, f16_from_f32, DOTS(dot_f16_scalar)},
    [QT_BF16] = {"BF16", 1, 2, QT_BF16, bf16_to_f32, bf16_from_f32, DOTS(dot_bf16_scalar)},
    [QT_Q4_0] = {"Q4_0", 32, 18, QT_Q8_0, q4_0_to_f32, q4_0_from_f32, DOTS(dot_q4_0_scalar)},
    [QT_Q4_1] = {"Q4_1", 32, 20, QT_Q8_1, q4_1_to_f32, q4_1_from_f32, DOTS(dot_q4_1_scalar)},
    [QT_Q5_0] = {"Q5_0", 32, 22, QT_Q8_0, q5_0_to_f32, q5_0_from_f32, DOTS(dot_q5_0_scalar)},
    [QT_Q5_1] = {"Q5_1", 32, 24, QT_Q8_1, q5_1_to_f32, q5_1_from_f32, DOTS(dot_q5_1_scalar)},
    [QT_Q8_0] = {"Q8_0", 32, 34, QT_Q8_0, q8_0_to_f32, q8_0_from_f32, DOTS(dot_q8_0_scalar)},
    [QT_Q8_1] = {"Q8_1", 32, 36, QT_Q8_1, q8_1_to_f32, q8_1_from_f32, NULL, NULL},
    [QT_Q2_K] = {"Q2_K", QK, 84, QT_Q8_K, q2_K_to_f32, q2_K_from_f32, DOTS(dot_q2_K_scalar)},
    [QT_Q3_K] = {"Q3_K", QK, 110, QT_Q8_K, q3_K_to_f32, q3_K_from_f32, DOTS(dot_q3_K_scalar)},
    [QT_Q4_K] = {"Q4_K", QK, 144, QT_Q8_K, q4_K_to_f32, q4_K_from_f32, DOTS(dot_q4_K_scalar)},
    [QT_Q5_K] = {"Q5_K", QK, 176, QT_Q8_K, q5_K_to_f32, q5_K_from_f32, DOTS(dot_q5_K_scalar)},
    [QT_Q6_K] = {"Q6_K", QK, 210, QT_Q8_K, q6_K_to_f32, q6_K_from_f32, DOTS(dot_q6_K_scalar)},
    [QT_Q8_K] = {"Q8_K", QK, 292, QT_Q8_K, q8_K_to_f32, q8_K_from_f32, NULL, NULL},
    [QT_IQ2_XXS] = {"IQ2_XXS", QK, 66, QT_Q8_K, iq2_xxs_to_f32, NULL, DOTS(dot_iq2_xxs_scalar)},
    [QT_IQ2_XS] = {"IQ2_XS", QK, 74, QT_Q8_K, iq2_xs_to_f32, NULL, DOTS(dot_iq2_xs_scalar)},
    [QT_IQ2_S] = {"IQ2_S", QK, 82, QT_Q8_K, iq2_s_to_f32, NULL, DOTS(dot_iq2_s_scalar)},
    [QT_IQ3_XXS] = {"IQ3_XXS", QK, 98, QT_Q8_K, iq3_xxs_to_f32, NULL, DOTS(dot_iq3_xxs_scalar)},
    [QT_IQ3_S] = {"IQ3_S", QK, 110, QT_Q8_K, iq3_s_to_f32, NULL, DOTS(dot_iq3_s_scalar)},
    [QT_IQ4_NL] = {"IQ4_NL", 32, 18, QT_Q8_0, iq4_nl_to_f32, iq4_nl_from_f32, DOTS(dot_iq4_nl_scalar)},
    [QT_IQ4_XS] = {"IQ4_XS", QK, 136, QT_Q8_K, iq4_xs_to_f32, iq4_xs_from_f32, DOTS(dot_iq4_xs_scalar)},
};

const struct quant_type *quant_type(int qtype)
{
    if (qtype < 0 || qtype >= QT_COUNT || !qtypes[qtype].name)
        return NULL;
    return &qtypes[qtype];
}

size_t quant_row_bytes(int qtype, int64_t n)
{
    const struct quant_type *t = quant_type(qtype);
    if (!t || n < 0 || n % t->blck)
        return 0;
    return (size_t)(n / t->blck) * t->size;
}

const char *quant_simd_name(void)
{
#if defined(QUANT_AVX512)
    return "avx512-vnni";
#elif defined(QUANT_AVX2)
    return "avx2";
#else
    return "scalar";
#endif
}

/* ==== the matrix kernel ==== */

void quant_gemm(int qtype, int n, const void *w, size_t ldw, int nw,
                const void *a, size_t lda, int na, float *y, size_t ldy)
{
    const struct quant_type *t = quant_type(qtype);
    for (int i = 0; i < nw; i++)
        for (int j = 0; j < na; j++)
            t->dot(n, &y[(size_t)j * ldy + i], (const char *)w + i * ldw,
                   (const char *)a + j * lda);
}
