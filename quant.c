/*
 * quant.c — tensor block formats: dequantisation, activation quantisation,
 * weight quantisers, dot products, and the unpacked forms (levels, activation
 * parts) that the matrix kernel in quant_gemm.c reads.
 *
 * Owns every byte layout of the GGUF tensor types Strata reads (F32, F16, BF16,
 * the 32-element legacy blocks, the 256-element K-quants, the IQ types) and the
 * numerics the reference engine (llama.cpp, CPU backend on x86) uses with them:
 * dequantisation is bit-exact, activation quantisation (Q8_0, Q8_1, Q8_K, F16,
 * BF16) byte-exact, dot products exact in their integer parts.
 * Must not: know about models or threads, print, or allocate. Kernels are
 * chosen at build time (-march=native: AVX-512 VNNI / AVX2; STRATA_PORTABLE:
 * scalar only).
 * Bit-exact dequantisation needs the float expressions evaluated as written:
 * no FMA contraction (GCC's -std=c11 implies -ffp-contract=off; clang needs
 * the flag).
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

/* ==== small SIMD helpers ==== */

#ifdef QUANT_AVX2
static inline __m256i load256(const void *p)
{
    return _mm256_loadu_si256((const __m256i *)p);
}

static inline void store256(void *p, __m256i v)
{
    _mm256_storeu_si256((__m256i *)p, v);
}

/* Bytes b >> k then masked with m, with 16-bit shifts: the mask clears what
 * crossed in from the neighbouring byte. */
static inline __m256i shr_mask(__m256i v, int k, int m)
{
    return _mm256_and_si256(_mm256_srli_epi16(v, k), _mm256_set1_epi8((char)m));
}

/* 16 bytes of nibbles to 32 bytes: low nibbles first (elements 0..15). */
static inline __m256i nibbles32(const uint8_t *qs)
{
    __m128i t = _mm_loadu_si128((const __m128i *)qs);
    __m256i b = _mm256_set_m128i(_mm_srli_epi16(t, 4), t);
    return _mm256_and_si256(b, _mm256_set1_epi8(15));
}

static inline float hsum256(__m256 v)
{
    __m128 s = _mm_add_ps(_mm256_castps256_ps128(v), _mm256_extractf128_ps(v, 1));
    s = _mm_add_ps(s, _mm_movehl_ps(s, s));
    s = _mm_add_ss(s, _mm_movehdup_ps(s));
    return _mm_cvtss_f32(s);
}

static inline int hsum256i(__m256i v)
{
    __m128i s = _mm_add_epi32(_mm256_castsi256_si128(v), _mm256_extracti128_si256(v, 1));
    s = _mm_add_epi32(s, _mm_unpackhi_epi64(s, s));
    s = _mm_add_epi32(s, _mm_shuffle_epi32(s, 1));
    return _mm_cvtsi128_si32(s);
}

#endif

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
    return (uint8_t)(i7 | (unsigned)__builtin_parity(i7) << 7);
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

#ifndef QUANT_AVX2
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
#endif

#ifdef QUANT_AVX2
/* The block above in vectors, as the reference's AVX2 code does it. */
static int q8_block_avx2(const float *x, int8_t *q, uint16_t *dh, float *dout)
{
    const __m256 sign = _mm256_set1_ps(-0.0f);
    __m256 v[4], m = _mm256_setzero_ps();
    for (int k = 0; k < 4; k++) {
        v[k] = _mm256_loadu_ps(x + 8 * k);
        m = _mm256_max_ps(m, _mm256_andnot_ps(sign, v[k]));
    }
    __m128 m4 = _mm_max_ps(_mm256_extractf128_ps(m, 1), _mm256_castps256_ps128(m));
    m4 = _mm_max_ps(m4, _mm_movehl_ps(m4, m4));
    m4 = _mm_max_ss(m4, _mm_movehdup_ps(m4));
    float amax = _mm_cvtss_f32(m4), d = amax / 127.f;
    __m256 id = _mm256_set1_ps(amax != 0.f ? 127.f / amax : 0.f);
    *dh = quant_f32_to_f16(d);
    *dout = d;
    __m256i i[4];
    for (int k = 0; k < 4; k++)
        i[k] = _mm256_cvtps_epi32(_mm256_round_ps(_mm256_mul_ps(v[k], id),
                                                  _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC));
    int sum = hsum256i(_mm256_add_epi32(_mm256_add_epi32(i[0], i[1]), _mm256_add_epi32(i[2], i[3])));
    /* the packs interleave 128-bit lanes; the permute restores element order */
    __m256i p = _mm256_packs_epi16(_mm256_packs_epi32(i[0], i[1]), _mm256_packs_epi32(i[2], i[3]));
    store256(q, _mm256_permutevar8x32_epi32(p, _mm256_setr_epi32(0, 4, 1, 5, 2, 6, 3, 7)));
    return sum;
}
#define Q8_BLOCK q8_block_avx2
#else
#define Q8_BLOCK q8_block
#endif

static void q8_0_from_f32(const float *x, void *vy, int64_t n)
{
    blk_q8_0 *y = vy;
    float d;
    for (int64_t b = 0; b < n / 32; b++)
        Q8_BLOCK(x + 32 * b, y[b].qs, &y[b].d, &d);
}

static void q8_1_from_f32(const float *x, void *vy, int64_t n)
{
    blk_q8_1 *y = vy;
    float d;
    for (int64_t b = 0; b < n / 32; b++) {
        int sum = Q8_BLOCK(x + 32 * b, y[b].qs, &y[b].d, &d);
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

/* The 8 (scale, min) pairs of Q4_K/Q5_K as bytes of two 64-bit words,
 * sub-block s in byte s (kept in registers: no store-to-load round trip). */
static inline void k4_scales8(const uint8_t *s, uint64_t *sc, uint64_t *mn)
{
    uint32_t a, b, c;
    memcpy(&a, s, 4);
    memcpy(&b, s + 4, 4);
    memcpy(&c, s + 8, 4);
    uint32_t sc_lo = a & 0x3f3f3f3f, mn_lo = b & 0x3f3f3f3f;
    uint32_t sc_hi = (c & 0x0f0f0f0f) | ((a >> 2) & 0x30303030);
    uint32_t mn_hi = ((c >> 4) & 0x0f0f0f0f) | ((b >> 2) & 0x30303030);
    *sc = sc_lo | (uint64_t)sc_hi << 32;
    *mn = mn_lo | (uint64_t)mn_hi << 32;
}

/* All 16 signed 6-bit scales of Q3_K at once: low nibbles from bytes 0..7,
 * top bit pairs from bytes 8..11 (scale j: bits 2(j/4) of byte 8 + j%4). */
static inline void k3_scales16(const uint8_t *s, int8_t *out)
{
    uint32_t a0, a1, a2, v[4];
    memcpy(&a0, s, 4);
    memcpy(&a1, s + 4, 4);
    memcpy(&a2, s + 8, 4);
    v[0] = (a0 & 0x0f0f0f0f) | (a2 & 0x03030303) << 4;
    v[1] = (a1 & 0x0f0f0f0f) | ((a2 >> 2) & 0x03030303) << 4;
    v[2] = ((a0 >> 4) & 0x0f0f0f0f) | ((a2 >> 4) & 0x03030303) << 4;
    v[3] = ((a1 >> 4) & 0x0f0f0f0f) | ((a2 >> 6) & 0x03030303) << 4;
    uint8_t u[16];
    memcpy(u, v, 16);
    for (int i = 0; i < 16; i++) /* bytewise: a packed subtract would borrow */
        out[i] = (int8_t)(u[i] - 32);
}

/* The signed 6-bit scale j (of 16) of Q3_K, packed in 12 bytes. */
static inline int k3_scale(int j, const uint8_t *s)
{
    int lo = j < 8 ? s[j] & 15 : s[j - 8] >> 4;
    int hi = (s[8 + j % 4] >> (2 * (j / 4))) & 3;
    return (lo | hi << 4) - 32;
}

/* ---- K-quant unpacking: a super-block's levels to 256 bytes ---- */

/* The 2-bit planes of Q2_K and Q3_K: each 128-element half holds 32 bytes,
 * elements 32j..32j+31 of the half in bits 2j..2j+1. */
static void k2_unpack(const uint8_t *qs, uint8_t *u)
{
    for (int h = 0; h < 2; h++) {
#ifdef QUANT_AVX2
        __m256i q = load256(qs + 32 * h);
        for (int j = 0; j < 4; j++)
            store256(u + 128 * h + 32 * j, shr_mask(q, 2 * j, 3));
#else
        for (int j = 0; j < 4; j++)
            for (int l = 0; l < 32; l++)
                u[128 * h + 32 * j + l] = (qs[32 * h + l] >> (2 * j)) & 3;
#endif
    }
}

/* The extra bit planes of Q3_K and Q5_K: element k's bit is bit k/32 of
 * byte k%32; it is ORed into u at bit position `at`. */
static void khigh_or(const uint8_t *bits, uint8_t *u, int at)
{
#ifdef QUANT_AVX2
    __m256i b = load256(bits);
    for (int p = 0; p < 8; p++) {
        __m256i h = _mm256_slli_epi16(shr_mask(b, p, 1), at);
        store256(u + 32 * p, _mm256_or_si256(load256(u + 32 * p), h));
    }
#else
    for (int k = 0; k < QK; k++)
        u[k] |= (uint8_t)(((bits[k % 32] >> (k / 32)) & 1) << at);
#endif
}

/* The 4-bit layout of Q4_K/Q5_K: 32 bytes per 64 elements, elements 0..31
 * of the 64 in the low nibbles, 32..63 in the high ones. */
static void k4_unpack(const uint8_t *qs, uint8_t *u)
{
    for (int p = 0; p < 4; p++) {
#ifdef QUANT_AVX2
        __m256i q = load256(qs + 32 * p);
        store256(u + 64 * p, _mm256_and_si256(q, _mm256_set1_epi8(15)));
        store256(u + 64 * p + 32, shr_mask(q, 4, 15));
#else
        for (int l = 0; l < 32; l++) {
            u[64 * p + l] = qs[32 * p + l] & 15;
            u[64 * p + l + 32] = qs[32 * p + l] >> 4;
        }
#endif
    }
}

/* The 6-bit values of Q6_K, 0..63 (the stored value is this minus 32): per
 * 128-element half, plane j (32 elements) takes its low 4 bits from the low
 * (j < 2) or high nibbles of ql and its top 2 bits from bits 2j of qh. */
static void k6_unpack(const blk_q6_K *x, uint8_t *u)
{
    for (int h = 0; h < 2; h++) {
        uint8_t *uh = u + 128 * h;
#ifdef QUANT_AVX2
        __m256i l0 = load256(x->ql + 64 * h), l1 = load256(x->ql + 64 * h + 32);
        __m256i qh = load256(x->qh + 32 * h), lo = _mm256_set1_epi8(15);
        __m256i top = _mm256_set1_epi8(0x30);
        store256(uh, _mm256_or_si256(_mm256_and_si256(l0, lo),
                                     _mm256_and_si256(_mm256_slli_epi16(qh, 4), top)));
        store256(uh + 32, _mm256_or_si256(_mm256_and_si256(l1, lo),
                                          _mm256_and_si256(_mm256_slli_epi16(qh, 2), top)));
        store256(uh + 64, _mm256_or_si256(shr_mask(l0, 4, 15), _mm256_and_si256(qh, top)));
        store256(uh + 96, _mm256_or_si256(shr_mask(l1, 4, 15), shr_mask(qh, 2, 0x30)));
#else
        for (int l = 0; l < 32; l++) {
            const uint8_t *ql = x->ql + 64 * h, qh = x->qh[32 * h + l];
            uh[l] = (uint8_t)((ql[l] & 15) | (qh & 3) << 4);
            uh[l + 32] = (uint8_t)((ql[l + 32] & 15) | ((qh >> 2) & 3) << 4);
            uh[l + 64] = (uint8_t)((ql[l] >> 4) | ((qh >> 4) & 3) << 4);
            uh[l + 96] = (uint8_t)((ql[l + 32] >> 4) | ((qh >> 6) & 3) << 4);
        }
#endif
    }
}

static void q2_K_to_f32(const void *vx, float *y, int64_t n)
{
    const blk_q2_K *x = vx;
    uint8_t u[QK];
    for (int64_t i = 0; i < n / QK; i++, y += QK) {
        float d = fp16(x[i].d), dmin = fp16(x[i].dmin);
        k2_unpack(x[i].qs, u);
        for (int s = 0; s < 16; s++) {
            int sc = x[i].scales[s];
            float dl = d * (sc & 15), ml = dmin * (sc >> 4);
            for (int k = 16 * s; k < 16 * s + 16; k++)
                y[k] = dl * u[k] - ml;
        }
    }
}

static void q3_K_to_f32(const void *vx, float *y, int64_t n)
{
    const blk_q3_K *x = vx;
    uint8_t u[QK];
    for (int64_t i = 0; i < n / QK; i++, y += QK) {
        float d = fp16(x[i].d);
        k2_unpack(x[i].qs, u);
        khigh_or(x[i].hmask, u, 2); /* u = level + 4: the high bit set means +0, clear -4 */
        for (int s = 0; s < 16; s++) {
            float dl = d * k3_scale(s, x[i].scales);
            for (int k = 16 * s; k < 16 * s + 16; k++)
                y[k] = dl * (u[k] - 4);
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
        khigh_or(x[i].qh, u, 4);
        for (int s = 0; s < 8; s++) {
            int sc, m;
            k4_scale_min(s, x[i].scales, &sc, &m);
            float dl = d * sc, ml = dmin * m;
            for (int k = 32 * s; k < 32 * s + 32; k++)
                y[k] = dl * u[k] - ml;
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

#ifdef QUANT_AVX2
/* One block of Q8_K (below) in vectors: the same operations, so the
 * same bytes (the rounding instruction rounds to nearest even too). */
static void q8_K_block_avx2(const float *x, blk_q8_K *y)
{
    const __m256 sign = _mm256_set1_ps(-0.0f);
    __m256 m = _mm256_setzero_ps();
    for (int k = 0; k < QK; k += 8)
        m = _mm256_max_ps(m, _mm256_andnot_ps(sign, _mm256_loadu_ps(x + k)));
    __m128 m4 = _mm_max_ps(_mm256_extractf128_ps(m, 1), _mm256_castps256_ps128(m));
    m4 = _mm_max_ps(m4, _mm_movehl_ps(m4, m4));
    m4 = _mm_max_ss(m4, _mm_movehdup_ps(m4));
    float amax = _mm_cvtss_f32(m4);
    if (amax == 0.f) {
        memset(y, 0, sizeof *y);
        return;
    }
    /* the signed value of the first element reaching amax */
    __m256 am = _mm256_set1_ps(amax);
    int k = 0, mask = 0;
    for (; k < QK; k += 8)
        if ((mask = _mm256_movemask_ps(_mm256_cmp_ps(_mm256_andnot_ps(sign, _mm256_loadu_ps(x + k)),
                                                     am, _CMP_EQ_OQ))))
            break;
    float iscale = -127.f / x[k + __builtin_ctz((unsigned)mask)];
    __m256 is = _mm256_set1_ps(iscale);
    for (int g = 0; g < 16; g++) {
        __m256i i0 = _mm256_cvtps_epi32(_mm256_round_ps(_mm256_mul_ps(_mm256_loadu_ps(x + 16 * g), is),
                                                        _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC));
        __m256i i1 = _mm256_cvtps_epi32(_mm256_round_ps(_mm256_mul_ps(_mm256_loadu_ps(x + 16 * g + 8), is),
                                                        _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC));
        i0 = _mm256_min_epi32(i0, _mm256_set1_epi32(127));
        i1 = _mm256_min_epi32(i1, _mm256_set1_epi32(127));
        y->bsums[g] = (int16_t)hsum256i(_mm256_add_epi32(i0, i1));
        __m256i p = _mm256_packs_epi16(_mm256_packs_epi32(i0, i1), _mm256_setzero_si256());
        p = _mm256_permutevar8x32_epi32(p, _mm256_setr_epi32(0, 4, 1, 5, 2, 6, 3, 7));
        _mm_storeu_si128((__m128i *)(y->qs + 16 * g), _mm256_castsi256_si128(p));
    }
    y->d = 1 / iscale;
}
#endif

/* Q8_K is the reference function on every platform: scale by the signed
 * extreme so it maps to -127, round to nearest even, clamp at 127. */
#ifndef QUANT_AVX2
static void q8_K_block(const float *x, blk_q8_K *y)
{
    float amax = 0, max = 0;
    for (int k = 0; k < QK; k++)
        if (fabsf(x[k]) > amax) {
            amax = fabsf(x[k]);
            max = x[k];
        }
    if (amax == 0.f) {
        memset(y, 0, sizeof *y);
        return;
    }
    float iscale = -127.f / max;
    for (int k = 0; k < QK; k++) {
        int v = nearest_int(iscale * x[k]);
        y->qs[k] = (int8_t)(v < 127 ? v : 127);
    }
    for (int g = 0; g < 16; g++) {
        int sum = 0;
        for (int k = 16 * g; k < 16 * g + 16; k++)
            sum += y->qs[k];
        y->bsums[g] = (int16_t)sum;
    }
    y->d = 1 / iscale;
}
#define Q8K_BLOCK q8_K_block
#else
#define Q8K_BLOCK q8_K_block_avx2
#endif

static void q8_K_from_f32(const float *x, void *vy, int64_t n)
{
    blk_q8_K *y = vy;
    for (int64_t i = 0; i < n / QK; i++)
        Q8K_BLOCK(x + QK * i, &y[i]);
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
    k2_unpack(x->qs, k->u);
}

static void ksb_q3_K(const void *vx, struct ksb *k)
{
    const blk_q3_K *x = vx;
    k->sb = 16;
    k->bias = 4;
    k->d = fp16(x->d);
    k->dmin = 0;
    int8_t sc[16];
    k3_scales16(x->scales, sc);
    for (int s = 0; s < 16; s++) {
        k->sc[s] = sc[s];
        k->mn[s] = 0;
    }
    k2_unpack(x->qs, k->u);
    khigh_or(x->hmask, k->u, 2);
}

static void ksb_q4_K(const void *vx, struct ksb *k)
{
    const blk_q4_K *x = vx;
    k->sb = 32;
    k->bias = 0;
    k->d = fp16(x->d);
    k->dmin = fp16(x->dmin);
    uint64_t sc, mn;
    k4_scales8(x->scales, &sc, &mn);
    for (int s = 0; s < 8; s++) {
        k->sc[s] = (int16_t)((sc >> (8 * s)) & 63);
        k->mn[s] = (int16_t)((mn >> (8 * s)) & 63);
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
    uint64_t sc, mn;
    k4_scales8(x->scales, &sc, &mn);
    for (int s = 0; s < 8; s++) {
        k->sc[s] = (int16_t)((sc >> (8 * s)) & 63);
        k->mn[s] = (int16_t)((mn >> (8 * s)) & 63);
    }
    k4_unpack(x->qs, k->u);
    khigh_or(x->qh, k->u, 4);
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
#ifdef QUANT_AVX2
        const __m256i book = _mm256_broadcastsi128_si256(_mm_loadu_si128((const __m128i *)kvalues_iq4nl));
        __m256i v = _mm256_shuffle_epi8(book, nibbles32(x->qs + 16 * s));
        store256(k->u + 32 * s, _mm256_xor_si256(v, _mm256_set1_epi8(-128)));
#else
        for (int j = 0; j < 16; j++) {
            k->u[32 * s + j] = (uint8_t)(kvalues_iq4nl[x->qs[16 * s + j] & 15] + 128);
            k->u[32 * s + j + 16] = (uint8_t)(kvalues_iq4nl[x->qs[16 * s + j] >> 4] + 128);
        }
#endif
    }
}

/* The IQ2/IQ3 types: value = magnitude with sign, scale 2*nibble + 1, and a
 * constant factor (1/8 for IQ2, 1/4 for IQ3_XXS) folded into d. */
static inline void ksb_iq_put8(uint8_t *u, const uint8_t *mag, uint8_t signs)
{
#ifdef QUANT_AVX2
    /* sign bit j to a mask in byte j; (v ^ m) - m negates where it is set */
    const __m128i bit = _mm_set1_epi64x(0x8040201008040201ll);
    __m128i m = _mm_cmpeq_epi8(_mm_and_si128(_mm_set1_epi8((char)signs), bit), bit);
    __m128i v = _mm_sub_epi8(_mm_xor_si128(_mm_loadl_epi64((const __m128i *)mag), m), m);
    _mm_storel_epi64((__m128i *)u, _mm_add_epi8(v, _mm_set1_epi8((char)128)));
#else
    for (int j = 0; j < 8; j++)
        u[j] = (uint8_t)(128 + ((signs >> j) & 1 ? -mag[j] : mag[j]));
#endif
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

/* dot_<type>_<isa>: the blocks unpacked by ksb_<type>, each dotted by
 * ksb_dot_fn (one definition for every ISA's K-style dot) */
#define KSB_DOT(type, isa, ksb_dot_fn)                                                \
    static void dot_##type##_##isa(int n, float *s, const void *vw, const void *va)  \
    {                                                                              \
        const blk_##type *w = vw;                                                  \
        const blk_q8_K *a = va;                                                    \
        struct ksb k;                                                              \
        float sum = 0;                                                             \
        for (int i = 0; i < n / QK; i++) {                                         \
            ksb_##type(&w[i], &k);                                                 \
            sum += ksb_dot_fn(&k, &a[i]);                                          \
        }                                                                          \
        *s = sum;                                                                  \
    }
KSB_DOT(q2_K, scalar, ksb_dot)
KSB_DOT(q3_K, scalar, ksb_dot)
KSB_DOT(q4_K, scalar, ksb_dot)
KSB_DOT(q5_K, scalar, ksb_dot)
KSB_DOT(q6_K, scalar, ksb_dot)
KSB_DOT(iq4_xs, scalar, ksb_dot)
KSB_DOT(iq2_xxs, scalar, ksb_dot)
KSB_DOT(iq2_xs, scalar, ksb_dot)
KSB_DOT(iq2_s, scalar, ksb_dot)
KSB_DOT(iq3_xxs, scalar, ksb_dot)
KSB_DOT(iq3_s, scalar, ksb_dot)

/* ==== AVX2 row dots: one weight row with one activation row ==== */

#ifdef QUANT_AVX2
/* acc + sums of 4 products of unsigned bytes u and signed bytes s. Without
 * VNNI the 16-bit pair sums saturate above 32767: callers keep u <= 127. */
static inline __m256i udot256(__m256i acc, __m256i u, __m256i s)
{
#if defined(__AVX512VNNI__) && defined(__AVX512VL__)
    return _mm256_dpbusd_epi32(acc, u, s);
#elif defined(__AVXVNNI__)
    return _mm256_dpbusd_avx_epi32(acc, u, s);
#else
    __m256i p = _mm256_maddubs_epi16(u, s);
    return _mm256_add_epi32(acc, _mm256_madd_epi16(p, _mm256_set1_epi16(1)));
#endif
}

/* Signed by signed: |x| times y with x's sign (|x| <= 128 keeps pairs exact). */
static inline __m256i sdot256(__m256i acc, __m256i x, __m256i y)
{
    return udot256(acc, _mm256_sign_epi8(x, x), _mm256_sign_epi8(y, x));
}

/* The 32 bits at p as 32 bytes, 0x10 where the bit is set: Q5's fifth bit. */
static inline __m256i fifth_bits(const uint8_t *p)
{
    uint32_t x;
    memcpy(&x, p, 4);
    const __m256i spread = _mm256_setr_epi64x(0, 0x0101010101010101, 0x0202020202020202,
                                              0x0303030303030303);
    const __m256i bit = _mm256_set1_epi64x((long long)0x8040201008040201ull);
    __m256i b = _mm256_shuffle_epi8(_mm256_set1_epi32((int)x), spread);
    b = _mm256_cmpeq_epi8(_mm256_and_si256(b, bit), bit);
    return _mm256_and_si256(b, _mm256_set1_epi8(0x10));
}

static void dot_q8_0_avx2(int n, float *s, const void *vw, const void *va)
{
    const blk_q8_0 *w = vw, *a = va;
    __m256 acc0 = _mm256_setzero_ps(), acc1 = _mm256_setzero_ps();
    int b = 0;
    for (; b + 1 < n / 32; b += 2) { /* two chains hide the FMA latency */
        __m256i p0 = sdot256(_mm256_setzero_si256(), load256(w[b].qs), load256(a[b].qs));
        __m256i p1 = sdot256(_mm256_setzero_si256(), load256(w[b + 1].qs), load256(a[b + 1].qs));
        acc0 = _mm256_fmadd_ps(_mm256_set1_ps(fp16(w[b].d) * fp16(a[b].d)), _mm256_cvtepi32_ps(p0), acc0);
        acc1 = _mm256_fmadd_ps(_mm256_set1_ps(fp16(w[b + 1].d) * fp16(a[b + 1].d)),
                               _mm256_cvtepi32_ps(p1), acc1);
    }
    for (; b < n / 32; b++) {
        __m256i p = sdot256(_mm256_setzero_si256(), load256(w[b].qs), load256(a[b].qs));
        acc0 = _mm256_fmadd_ps(_mm256_set1_ps(fp16(w[b].d) * fp16(a[b].d)), _mm256_cvtepi32_ps(p), acc0);
    }
    *s = hsum256(_mm256_add_ps(acc0, acc1));
}

/* Q4_0 and Q5_0: unsigned levels u minus a bias, times Q8_0. The bias term
 * bias * sum(a) comes from a second product with a constant vector. */
static inline __m256 q_biased_block(__m256 acc, __m256i u, int bias, const blk_q8_0 *a, float dw)
{
    __m256i qa = load256(a->qs);
    __m256i p = udot256(_mm256_setzero_si256(), u, qa);
    p = _mm256_sub_epi32(p, udot256(_mm256_setzero_si256(), _mm256_set1_epi8((char)bias), qa));
    return _mm256_fmadd_ps(_mm256_set1_ps(dw * fp16(a->d)), _mm256_cvtepi32_ps(p), acc);
}

static void dot_q4_0_avx2(int n, float *s, const void *vw, const void *va)
{
    const blk_q4_0 *w = vw;
    const blk_q8_0 *a = va;
    __m256 acc = _mm256_setzero_ps();
    for (int b = 0; b < n / 32; b++)
        acc = q_biased_block(acc, nibbles32(w[b].qs), 8, &a[b], fp16(w[b].d));
    *s = hsum256(acc);
}

static void dot_q5_0_avx2(int n, float *s, const void *vw, const void *va)
{
    const blk_q5_0 *w = vw;
    const blk_q8_0 *a = va;
    __m256 acc = _mm256_setzero_ps();
    for (int b = 0; b < n / 32; b++) {
        __m256i u = _mm256_or_si256(nibbles32(w[b].qs), fifth_bits(w[b].qh));
        acc = q_biased_block(acc, u, 16, &a[b], fp16(w[b].d));
    }
    *s = hsum256(acc);
}

static void dot_q4_1_avx2(int n, float *s, const void *vw, const void *va)
{
    const blk_q4_1 *w = vw;
    const blk_q8_1 *a = va;
    __m256 acc = _mm256_setzero_ps();
    float mins = 0;
    for (int b = 0; b < n / 32; b++) {
        __m256i p = udot256(_mm256_setzero_si256(), nibbles32(w[b].qs), load256(a[b].qs));
        acc = _mm256_fmadd_ps(_mm256_set1_ps(fp16(w[b].d) * fp16(a[b].d)), _mm256_cvtepi32_ps(p), acc);
        mins += fp16(w[b].m) * fp16(a[b].s);
    }
    *s = hsum256(acc) + mins;
}

static void dot_q5_1_avx2(int n, float *s, const void *vw, const void *va)
{
    const blk_q5_1 *w = vw;
    const blk_q8_1 *a = va;
    __m256 acc = _mm256_setzero_ps();
    float mins = 0;
    for (int b = 0; b < n / 32; b++) {
        __m256i u = _mm256_or_si256(nibbles32(w[b].qs), fifth_bits(w[b].qh));
        __m256i p = udot256(_mm256_setzero_si256(), u, load256(a[b].qs));
        acc = _mm256_fmadd_ps(_mm256_set1_ps(fp16(w[b].d) * fp16(a[b].d)), _mm256_cvtepi32_ps(p), acc);
        mins += fp16(w[b].m) * fp16(a[b].s);
    }
    *s = hsum256(acc) + mins;
}

static void dot_iq4_nl_avx2(int n, float *s, const void *vw, const void *va)
{
    const blk_iq4_nl *w = vw;
    const blk_q8_0 *a = va;
    const __m256i book = _mm256_broadcastsi128_si256(_mm_loadu_si128((const __m128i *)kvalues_iq4nl));
    __m256 acc = _mm256_setzero_ps();
    for (int b = 0; b < n / 32; b++) {
        __m256i v = _mm256_shuffle_epi8(book, nibbles32(w[b].qs));
        __m256i p = sdot256(_mm256_setzero_si256(), v, load256(a[b].qs));
        acc = _mm256_fmadd_ps(_mm256_set1_ps(fp16(w[b].d) * fp16(a[b].d)), _mm256_cvtepi32_ps(p), acc);
    }
    *s = hsum256(acc);
}

/* A decoded super-block times a Q8_K block. Integer sums stay exact: a lane
 * holds at most 8 * 4 * 255 * 127 * 32 < 2^31. */
static float ksb_dot_avx2(const struct ksb *k, const blk_q8_K *a)
{
    __m256i acc = _mm256_setzero_si256();
    int signed_levels = k->bias == 128; /* u > 127: use signed bytes u - 128 */
    for (int c = 0; c < 8; c++) {
        __m256i u = load256(k->u + 32 * c), qa = load256(a->qs + 32 * c), p;
        if (signed_levels)
            p = sdot256(_mm256_setzero_si256(), _mm256_xor_si256(u, _mm256_set1_epi8(-128)), qa);
        else
            p = udot256(_mm256_setzero_si256(), u, qa);
        /* lanes 0-3 cover the first 16 elements of the 32, lanes 4-7 the rest */
        __m256i sc = k->sb == 32 ? _mm256_set1_epi32(k->sc[c])
                                 : _mm256_set_m128i(_mm_set1_epi32(k->sc[2 * c + 1]),
                                                    _mm_set1_epi32(k->sc[2 * c]));
        acc = _mm256_add_epi32(acc, _mm256_mullo_epi32(p, sc));
    }
    /* the level bias and the mins meet the 16-sums of the activations: one
     * scale and min per 16-group (a 32-element sub-block covers two) */
    __m256i sc16 = load256(k->sc), mn16 = load256(k->mn);
    if (k->sb == 32) {
        __m128i s8 = _mm256_castsi256_si128(sc16), m8 = _mm256_castsi256_si128(mn16);
        sc16 = _mm256_set_m128i(_mm_unpackhi_epi16(s8, s8), _mm_unpacklo_epi16(s8, s8));
        mn16 = _mm256_set_m128i(_mm_unpackhi_epi16(m8, m8), _mm_unpacklo_epi16(m8, m8));
    }
    __m256i bs = load256(a->bsums);
    int isum = hsum256i(acc), msum = hsum256i(_mm256_madd_epi16(bs, mn16));
    if (!signed_levels)
        isum -= k->bias * hsum256i(_mm256_madd_epi16(bs, sc16));
    return a->d * (k->d * (float)isum - k->dmin * (float)msum);
}

/* ---- fused K-quant dots: unpack in registers, no trip through memory ----
 * maddubs makes 16-bit pair sums (at most 2 * 63 * 127, no saturation), and
 * madd with the sub-block scale widens them to 32 bits, scaled. */


/* sum over the 8 sub-blocks of mn[s] * (bsums[2s] + bsums[2s+1]), as 8 lanes */
static inline __m256i k4_minsum(uint64_t mn, const int16_t *bsums)
{
    __m128i m8 = _mm_cvtsi64_si128((long long)mn);
    __m256i m16 = _mm256_cvtepu8_epi16(_mm_unpacklo_epi8(m8, m8)); /* m0 m0 m1 m1 ... */
    return _mm256_madd_epi16(load256(bsums), m16);
}

static inline __m256i scaled_pairs(__m256i u, __m256i a, int sc)
{
    return _mm256_madd_epi16(_mm256_maddubs_epi16(u, a), _mm256_set1_epi16((short)sc));
}

#ifndef QUANT_AVX512 /* AVX-512 builds use the wider kernels below */
static void dot_q4_K_avx2(int n, float *s, const void *vw, const void *va)
{
    const blk_q4_K *w = vw;
    const blk_q8_K *a = va;
    __m256 acc = _mm256_setzero_ps();
    uint64_t sc, mn;
    for (int i = 0; i < n / QK; i++) {
        k4_scales8(w[i].scales, &sc, &mn);
        __m256i isum = _mm256_setzero_si256();
        for (int p = 0; p < 4; p++) {
            __m256i q = load256(w[i].qs + 32 * p);
            __m256i lo = _mm256_and_si256(q, _mm256_set1_epi8(15)), hi = shr_mask(q, 4, 15);
            isum = _mm256_add_epi32(isum, scaled_pairs(lo, load256(a[i].qs + 64 * p), (sc >> (16 * p)) & 63));
            isum = _mm256_add_epi32(isum, scaled_pairs(hi, load256(a[i].qs + 64 * p + 32), (sc >> (16 * p + 8)) & 63));
        }
        float d = a[i].d * fp16(w[i].d), dmin = a[i].d * fp16(w[i].dmin);
        acc = _mm256_fmadd_ps(_mm256_set1_ps(d), _mm256_cvtepi32_ps(isum), acc);
        acc = _mm256_fmadd_ps(_mm256_set1_ps(-dmin), _mm256_cvtepi32_ps(k4_minsum(mn, a[i].bsums)), acc);
    }
    *s = hsum256(acc);
}

#endif

static void dot_q5_K_avx2(int n, float *s, const void *vw, const void *va)
{
    const blk_q5_K *w = vw;
    const blk_q8_K *a = va;
    __m256 acc = _mm256_setzero_ps();
    uint64_t sc, mn;
    for (int i = 0; i < n / QK; i++) {
        k4_scales8(w[i].scales, &sc, &mn);
        __m256i qh = load256(w[i].qh), isum = _mm256_setzero_si256();
        for (int p = 0; p < 4; p++) {
            __m256i q = load256(w[i].qs + 32 * p);
            /* the fifth bit of sub-block s is bit s of qh: 2p and 2p + 1 here */
            __m256i lo = _mm256_or_si256(_mm256_and_si256(q, _mm256_set1_epi8(15)),
                                         _mm256_slli_epi16(shr_mask(qh, 2 * p, 1), 4));
            __m256i hi = _mm256_or_si256(shr_mask(q, 4, 15),
                                         _mm256_slli_epi16(shr_mask(qh, 2 * p + 1, 1), 4));
            isum = _mm256_add_epi32(isum, scaled_pairs(lo, load256(a[i].qs + 64 * p), (sc >> (16 * p)) & 63));
            isum = _mm256_add_epi32(isum, scaled_pairs(hi, load256(a[i].qs + 64 * p + 32), (sc >> (16 * p + 8)) & 63));
        }
        float d = a[i].d * fp16(w[i].d), dmin = a[i].d * fp16(w[i].dmin);
        acc = _mm256_fmadd_ps(_mm256_set1_ps(d), _mm256_cvtepi32_ps(isum), acc);
        acc = _mm256_fmadd_ps(_mm256_set1_ps(-dmin), _mm256_cvtepi32_ps(k4_minsum(mn, a[i].bsums)), acc);
    }
    *s = hsum256(acc);
}

/* Q6_K: levels 0..63 (the stored value + 32); 16 signed scales, one per 16
 * elements, so a 32-byte vector spans two: its low 128 bits take the first. */
static inline __m256i two_scales(int a, int b)
{
    return _mm256_set_m128i(_mm_set1_epi16((short)b), _mm_set1_epi16((short)a));
}

#ifndef QUANT_AVX512
static void dot_q6_K_avx2(int n, float *s, const void *vw, const void *va)
{
    const blk_q6_K *w = vw;
    const blk_q8_K *a = va;
    __m256 acc = _mm256_setzero_ps();
    const __m256i lo4 = _mm256_set1_epi8(15), top = _mm256_set1_epi8(0x30);
    for (int i = 0; i < n / QK; i++) {
        const int8_t *sc = w[i].scales;
        __m256i isum = _mm256_setzero_si256();
        for (int h = 0; h < 2; h++) {
            __m256i l0 = load256(w[i].ql + 64 * h), l1 = load256(w[i].ql + 64 * h + 32);
            __m256i qh = load256(w[i].qh + 32 * h);
            __m256i u[4] = {
                _mm256_or_si256(_mm256_and_si256(l0, lo4), _mm256_and_si256(_mm256_slli_epi16(qh, 4), top)),
                _mm256_or_si256(_mm256_and_si256(l1, lo4), _mm256_and_si256(_mm256_slli_epi16(qh, 2), top)),
                _mm256_or_si256(shr_mask(l0, 4, 15), _mm256_and_si256(qh, top)),
                _mm256_or_si256(shr_mask(l1, 4, 15), shr_mask(qh, 2, 0x30)),
            };
            for (int j = 0; j < 4; j++) {
                const int8_t *scj = sc + 8 * h + 2 * j;
                __m256i pr = _mm256_maddubs_epi16(u[j], load256(a[i].qs + 128 * h + 32 * j));
                isum = _mm256_add_epi32(isum, _mm256_madd_epi16(pr, two_scales(scj[0], scj[1])));
            }
        }
        /* the levels carry +32: take out 32 * sum(sc * a) via the 16-sums */
        __m256i sc16 = _mm256_cvtepi8_epi16(_mm_loadu_si128((const __m128i *)sc));
        __m256i bias = _mm256_slli_epi32(_mm256_madd_epi16(load256(a[i].bsums), sc16), 5);
        isum = _mm256_sub_epi32(isum, bias);
        acc = _mm256_fmadd_ps(_mm256_set1_ps(a[i].d * fp16(w[i].d)), _mm256_cvtepi32_ps(isum), acc);
    }
    *s = hsum256(acc);
}

#endif

KSB_DOT(q2_K, avx2, ksb_dot_avx2)
KSB_DOT(q3_K, avx2, ksb_dot_avx2)
KSB_DOT(iq4_xs, avx2, ksb_dot_avx2)

/* ---- fused IQ2/IQ3 dots: a sub-block's grid magnitudes (unsigned bytes)
 * meet the activation with the weights' signs put on it (sign_epi8: Q8_K's
 * codes lie in -127..127), maddubs makes pair sums (at most 2 * 62 * 127),
 * madd weighs them by the integer scale 2s + 1 (for each 16 of IQ2_XS and
 * IQ2_S); the constant factor of each type (1/8, 1/4, 1) rides on d ---- */

/* byte j: -1 where bit j of s is set, else 1 */
static inline __m256i iq_signs256(uint32_t s)
{
    const __m256i spread = _mm256_set_epi64x(0x0303030303030303ll, 0x0202020202020202ll, 0x0101010101010101ll, 0);
    const __m256i bit = _mm256_set1_epi64x((long long)0x8040201008040201ull);
    __m256i b = _mm256_shuffle_epi8(_mm256_set1_epi32((int)s), spread);
    return _mm256_or_si256(_mm256_cmpeq_epi8(_mm256_and_si256(b, bit), bit), _mm256_set1_epi8(1));
}

/* Σ mag·sign·a over a sub-block, as 8 int32 lanes (4-7: the second 16), scaled by sc */
static inline __m256i iq_dot32(__m256i mag, uint32_t signs, const int8_t *qa, __m256i sc)
{
    __m256i pr = _mm256_maddubs_epi16(mag, _mm256_sign_epi8(load256(qa), iq_signs256(signs)));
    return _mm256_madd_epi16(pr, sc);
}

/* 4 IQ2 grid points (8 bytes each) as a vector */
static inline __m256i iq_grid2(const uint64_t *g, unsigned i0, unsigned i1, unsigned i2, unsigned i3)
{
    return _mm256_set_epi64x((long long)g[i3], (long long)g[i2], (long long)g[i1], (long long)g[i0]);
}

/* Sub-block ib of a superblock against its 32 activation codes qa, for each
 * lattice: the scaled sums as 8 int32 lanes. */
static inline __m256i iq_sub_iq2_xxs(const blk_iq2_xxs *x, int ib, const int8_t *qa)
{
    uint32_t idx = x->qs[4 * ib] | (uint32_t)x->qs[4 * ib + 1] << 16;
    uint32_t aux = x->qs[4 * ib + 2] | (uint32_t)x->qs[4 * ib + 3] << 16, sg = 0;
    for (int l = 0; l < 4; l++)
        sg |= (uint32_t)iq_signs((aux >> 7 * l) & 127) << 8 * l;
    __m256i mag = iq_grid2(iq2xxs_grid, idx & 255, idx >> 8 & 255, idx >> 16 & 255, idx >> 24);
    return iq_dot32(mag, sg, qa, _mm256_set1_epi16((short)(2 * (aux >> 28) + 1)));
}

static inline __m256i iq_sub_iq2_xs(const blk_iq2_xs *x, int ib, const int8_t *qa)
{
    const uint16_t *q = x->qs + 4 * ib;
    uint32_t sg = 0;
    for (int l = 0; l < 4; l++)
        sg |= (uint32_t)iq_signs(q[l] >> 9) << 8 * l;
    __m256i mag = iq_grid2(iq2xs_grid, q[0] & 511, q[1] & 511, q[2] & 511, q[3] & 511);
    int sc = x->scales[ib];
    return iq_dot32(mag, sg, qa, two_scales(2 * (sc & 15) + 1, 2 * (sc >> 4) + 1));
}

static inline __m256i iq_sub_iq2_s(const blk_iq2_s *x, int ib, const int8_t *qa)
{
    const uint8_t *q = x->qs + 4 * ib;
    unsigned qh = x->qh[ib];
    uint32_t sg;
    memcpy(&sg, x->qs + 32 + 4 * ib, 4);
    __m256i mag = iq_grid2(iq2s_grid, q[0] | (qh & 3) << 8, q[1] | (qh >> 2 & 3) << 8, q[2] | (qh >> 4 & 3) << 8,
                           q[3] | (qh >> 6 & 3) << 8);
    int sc = x->scales[ib];
    return iq_dot32(mag, sg, qa, two_scales(2 * (sc & 15) + 1, 2 * (sc >> 4) + 1));
}

static inline __m256i iq_sub_iq3_xxs(const blk_iq3_xxs *x, int ib, const int8_t *qa)
{
    const uint8_t *q = x->qs + 8 * ib;
    const uint32_t *g = iq3xxs_grid;
    uint32_t aux, sg = 0;
    memcpy(&aux, x->qs + 64 + 4 * ib, 4);
    for (int l = 0; l < 4; l++)
        sg |= (uint32_t)iq_signs((aux >> 7 * l) & 127) << 8 * l;
    __m256i mag = _mm256_set_epi32((int)g[q[7]], (int)g[q[6]], (int)g[q[5]], (int)g[q[4]], (int)g[q[3]],
                                   (int)g[q[2]], (int)g[q[1]], (int)g[q[0]]);
    return iq_dot32(mag, sg, qa, _mm256_set1_epi16((short)(2 * (aux >> 28) + 1)));
}

static inline __m256i iq_sub_iq3_s(const blk_iq3_s *x, int ib, const int8_t *qa)
{
    const uint8_t *q = x->qs + 8 * ib;
    const uint32_t *g = iq3s_grid;
    unsigned qh = x->qh[ib];
    uint32_t sg;
    memcpy(&sg, x->signs + 4 * ib, 4);
    __m256i mag = _mm256_set_epi32((int)g[q[7] | (qh >> 7 & 1) << 8], (int)g[q[6] | (qh >> 6 & 1) << 8],
                                   (int)g[q[5] | (qh >> 5 & 1) << 8], (int)g[q[4] | (qh >> 4 & 1) << 8],
                                   (int)g[q[3] | (qh >> 3 & 1) << 8], (int)g[q[2] | (qh >> 2 & 1) << 8],
                                   (int)g[q[1] | (qh >> 1 & 1) << 8], (int)g[q[0] | (qh & 1) << 8]);
    int sc = (x->scales[ib / 2] >> (4 * (ib % 2))) & 15;
    return iq_dot32(mag, sg, qa, _mm256_set1_epi16((short)(2 * sc + 1)));
}

/* dot_<type>_avx2: the sub-blocks' sums, times d · the type's factor */
#define IQ_DOT(type, factor)                                                                                    \
    static void dot_##type##_avx2(int n, float *s, const void *vw, const void *va)                             \
    {                                                                                                          \
        const blk_##type *w = vw;                                                                              \
        const blk_q8_K *a = va;                                                                                \
        __m256 acc = _mm256_setzero_ps();                                                                      \
        for (int i = 0; i < n / QK; i++) {                                                                     \
            __m256i isum = _mm256_setzero_si256();                                                             \
            for (int ib = 0; ib < 8; ib++)                                                                     \
                isum = _mm256_add_epi32(isum, iq_sub_##type(&w[i], ib, a[i].qs + 32 * ib));                    \
            acc = _mm256_fmadd_ps(_mm256_set1_ps(a[i].d * fp16(w[i].d) * (factor)), _mm256_cvtepi32_ps(isum), \
                                  acc);                                                                        \
        }                                                                                                      \
        *s = hsum256(acc);                                                                                     \
    }
IQ_DOT(iq2_xxs, 0.125f)
IQ_DOT(iq2_xs, 0.125f)
IQ_DOT(iq2_s, 0.125f)
IQ_DOT(iq3_xxs, 0.25f)
IQ_DOT(iq3_s, 1.0f)

static void dot_f32_avx2(int n, float *s, const void *vw, const void *va)
{
    const float *w = vw, *a = va;
    __m256 acc[4] = {_mm256_setzero_ps(), _mm256_setzero_ps(), _mm256_setzero_ps(), _mm256_setzero_ps()};
    int i = 0;
    for (; i + 32 <= n; i += 32)
        for (int k = 0; k < 4; k++)
            acc[k] = _mm256_fmadd_ps(_mm256_loadu_ps(w + i + 8 * k), _mm256_loadu_ps(a + i + 8 * k), acc[k]);
    float sum = hsum256(_mm256_add_ps(_mm256_add_ps(acc[0], acc[1]), _mm256_add_ps(acc[2], acc[3])));
    for (; i < n; i++)
        sum += w[i] * a[i];
    *s = sum;
}

static inline __m256 f16x8(const uint16_t *p)
{
    return _mm256_cvtph_ps(_mm_loadu_si128((const __m128i *)p));
}

static inline __m256 bf16x8(const uint16_t *p)
{
    __m256i v = _mm256_cvtepu16_epi32(_mm_loadu_si128((const __m128i *)p));
    return _mm256_castsi256_ps(_mm256_slli_epi32(v, 16));
}

#define FLOAT16_DOT(name, widen, scalar)                                           \
    static void name(int n, float *s, const void *vw, const void *va)            \
    {                                                                            \
        const uint16_t *w = vw, *a = va;                                         \
        __m256 acc[4] = {_mm256_setzero_ps(), _mm256_setzero_ps(), _mm256_setzero_ps(), \
                         _mm256_setzero_ps()};                                   \
        int i = 0;                                                               \
        for (; i + 32 <= n; i += 32)                                             \
            for (int k = 0; k < 4; k++)                                          \
                acc[k] = _mm256_fmadd_ps(widen(w + i + 8 * k), widen(a + i + 8 * k), acc[k]); \
        float sum = hsum256(_mm256_add_ps(_mm256_add_ps(acc[0], acc[1]),         \
                                          _mm256_add_ps(acc[2], acc[3])));       \
        for (; i < n; i++)                                                       \
            sum += scalar(w[i]) * scalar(a[i]);                                  \
        *s = sum;                                                                \
    }
FLOAT16_DOT(dot_f16_avx2, f16x8, fp16)
FLOAT16_DOT(dot_bf16_avx2, bf16x8, quant_bf16_to_f32)
#endif

/* ==== AVX-512 row dots: two legacy blocks or half a super-block per step ==== */

#ifdef QUANT_AVX512
static inline __m512i join256(__m256i lo, __m256i hi)
{
    return _mm512_inserti64x4(_mm512_castsi256_si512(lo), hi, 1);
}

/* The nibbles of two 4-bit blocks as 64 bytes in element order. */
static inline __m512i nibbles64(const uint8_t *q0, const uint8_t *q1)
{
    __m256i q = _mm256_set_m128i(_mm_loadu_si128((const __m128i *)q1),
                                 _mm_loadu_si128((const __m128i *)q0));
    /* 128-bit lanes: q0 low, q1 low, q0 high, q1 high -> q0 low, q0 high, ... */
    __m512i z = join256(q, _mm256_srli_epi16(q, 4));
    z = _mm512_shuffle_i64x2(z, z, _MM_SHUFFLE(3, 1, 2, 0));
    return _mm512_and_si512(z, _mm512_set1_epi8(15));
}

/* The product of two scales per block: block b in lanes 0-7, b + 1 in 8-15. */
static inline __m512 scales2(uint16_t w0, uint16_t a0, uint16_t w1, uint16_t a1)
{
    return _mm512_insertf32x8(_mm512_set1_ps(fp16(w0) * fp16(a0)),
                              _mm256_set1_ps(fp16(w1) * fp16(a1)), 1);
}

#define Q4_LEVELS(x0, x1) nibbles64((x0)->qs, (x1)->qs)
/* the fifth bits of two Q5 blocks straight from a 64-bit mask */
static inline __m512i fifth_bits64(const uint8_t *qh0, const uint8_t *qh1)
{
    return _mm512_maskz_mov_epi8(q5_high(qh0) | (uint64_t)q5_high(qh1) << 32, _mm512_set1_epi8(0x10));
}
#define Q5_LEVELS(x0, x1) _mm512_or_si512(nibbles64((x0)->qs, (x1)->qs), fifth_bits64((x0)->qh, (x1)->qh))
#define IQ4_LEVELS(x0, x1) _mm512_xor_si512(_mm512_shuffle_epi8(book, nibbles64((x0)->qs, (x1)->qs)), \
                                            _mm512_set1_epi8(-128))

/* Weight levels u - bias (u unsigned) against Q8_0, two blocks a step; the
 * bias meets the activations through a second product with a constant. */
#define LEGACY_DOT512(name, wtype, LEVELS, BIAS, single)                               \
    static void name(int n, float *s, const void *vw, const void *va)                  \
    {                                                                                  \
        const wtype *w = vw;                                                           \
        const blk_q8_0 *a = va;                                                        \
        const __m512i book = _mm512_broadcast_i32x4(_mm_loadu_si128((const __m128i *)kvalues_iq4nl)); \
        (void)book;                                                                    \
        __m512 acc = _mm512_setzero_ps();                                              \
        int b = 0;                                                                     \
        for (; b + 1 < n / 32; b += 2) {                                               \
            __m512i qa = join256(load256(a[b].qs), load256(a[b + 1].qs));              \
            __m512i p = _mm512_dpbusd_epi32(_mm512_setzero_si512(), LEVELS(&w[b], &w[b + 1]), qa); \
            p = _mm512_sub_epi32(p, _mm512_dpbusd_epi32(_mm512_setzero_si512(),       \
                                                        _mm512_set1_epi8(BIAS), qa)); \
            acc = _mm512_fmadd_ps(_mm512_cvtepi32_ps(p),                               \
                                  scales2(w[b].d, a[b].d, w[b + 1].d, a[b + 1].d), acc); \
        }                                                                              \
        float sum = _mm512_reduce_add_ps(acc), tail = 0;                               \
        if (b < n / 32)                                                                \
            single(32, &tail, &w[b], &a[b]);                                           \
        *s = sum + tail;                                                               \
    }
LEGACY_DOT512(dot_q4_0_avx512, blk_q4_0, Q4_LEVELS, 8, dot_q4_0_avx2)
LEGACY_DOT512(dot_q5_0_avx512, blk_q5_0, Q5_LEVELS, 16, dot_q5_0_avx2)
LEGACY_DOT512(dot_iq4_nl_avx512, blk_iq4_nl, IQ4_LEVELS, -128, dot_iq4_nl_avx2)

/* Q4_1 / Q5_1 against Q8_1: no bias; the min meets the stored d * sum(a). */
#define LEGACY_MIN_DOT512(name, wtype, LEVELS, single)                                 \
    static void name(int n, float *s, const void *vw, const void *va)                  \
    {                                                                                  \
        const wtype *w = vw;                                                           \
        const blk_q8_1 *a = va;                                                        \
        __m512 acc = _mm512_setzero_ps();                                              \
        float mins = 0;                                                                \
        int b = 0;                                                                     \
        for (; b + 1 < n / 32; b += 2) {                                               \
            __m512i qa = join256(load256(a[b].qs), load256(a[b + 1].qs));              \
            __m512i p = _mm512_dpbusd_epi32(_mm512_setzero_si512(), LEVELS(&w[b], &w[b + 1]), qa); \
            acc = _mm512_fmadd_ps(_mm512_cvtepi32_ps(p),                               \
                                  scales2(w[b].d, a[b].d, w[b + 1].d, a[b + 1].d), acc); \
            mins += fp16(w[b].m) * fp16(a[b].s) + fp16(w[b + 1].m) * fp16(a[b + 1].s); \
        }                                                                              \
        float sum = _mm512_reduce_add_ps(acc) + mins, tail = 0;                        \
        if (b < n / 32)                                                                \
            single(32, &tail, &w[b], &a[b]);                                           \
        *s = sum + tail;                                                               \
    }
LEGACY_MIN_DOT512(dot_q4_1_avx512, blk_q4_1, Q4_LEVELS, dot_q4_1_avx2)
LEGACY_MIN_DOT512(dot_q5_1_avx512, blk_q5_1, Q5_LEVELS, dot_q5_1_avx2)

/* Lane patterns picking one 32-bit scale per group of lanes: sub-blocks of
 * 32 (8 lanes each) and of 16 (4 lanes each). */
static inline __m512i lanes_of(int first, int per)
{
    return _mm512_add_epi32(_mm512_set1_epi32(first),
                            _mm512_srli_epi32(_mm512_setr_epi32(0, 1, 2, 3, 4, 5, 6, 7, 8, 9, 10,
                                                                11, 12, 13, 14, 15), per == 8 ? 3 : 2));
}

static void dot_q4_K_avx512(int n, float *s, const void *vw, const void *va)
{
    const blk_q4_K *w = vw;
    const blk_q8_K *a = va;
    __m512 acc = _mm512_setzero_ps();
    __m256 accm = _mm256_setzero_ps();
    const __m512i pick[4] = {lanes_of(0, 8), lanes_of(2, 8), lanes_of(4, 8), lanes_of(6, 8)};
    uint64_t sc, mn;
    for (int i = 0; i < n / QK; i++) {
        k4_scales8(w[i].scales, &sc, &mn);
        __m512i sc32 = _mm512_cvtepu8_epi32(_mm_cvtsi64_si128((long long)sc)), isum = _mm512_setzero_si512();
        for (int c = 0; c < 2; c++) {
            __m512i q = _mm512_loadu_si512(w[i].qs + 64 * c);
            __m512i lo = _mm512_and_si512(q, _mm512_set1_epi8(15));
            __m512i hi = _mm512_and_si512(_mm512_srli_epi16(q, 4), _mm512_set1_epi8(15));
            /* 64 elements each, in order: sub-blocks 4c, 4c+1 and 4c+2, 4c+3 */
            __m512i x = _mm512_shuffle_i64x2(lo, hi, _MM_SHUFFLE(1, 0, 1, 0));
            __m512i y = _mm512_shuffle_i64x2(lo, hi, _MM_SHUFFLE(3, 2, 3, 2));
            __m512i px = _mm512_dpbusd_epi32(_mm512_setzero_si512(), x, _mm512_loadu_si512(a[i].qs + 128 * c));
            __m512i py = _mm512_dpbusd_epi32(_mm512_setzero_si512(), y, _mm512_loadu_si512(a[i].qs + 128 * c + 64));
            isum = _mm512_add_epi32(isum, _mm512_mullo_epi32(px, _mm512_permutexvar_epi32(pick[2 * c], sc32)));
            isum = _mm512_add_epi32(isum, _mm512_mullo_epi32(py, _mm512_permutexvar_epi32(pick[2 * c + 1], sc32)));
        }
        float d = a[i].d * fp16(w[i].d), dmin = a[i].d * fp16(w[i].dmin);
        acc = _mm512_fmadd_ps(_mm512_set1_ps(d), _mm512_cvtepi32_ps(isum), acc);
        accm = _mm256_fmadd_ps(_mm256_set1_ps(-dmin), _mm256_cvtepi32_ps(k4_minsum(mn, a[i].bsums)), accm);
    }
    *s = _mm512_reduce_add_ps(acc) + hsum256(accm);
}

static void dot_q6_K_avx512(int n, float *s, const void *vw, const void *va)
{
    const blk_q6_K *w = vw;
    const blk_q8_K *a = va;
    __m512 acc = _mm512_setzero_ps();
    const __m512i pick[4] = {lanes_of(0, 4), lanes_of(4, 4), lanes_of(8, 4), lanes_of(12, 4)};
    /* the two 32-byte halves of a vector take their top bits from different
     * bit pairs of the same qh bytes */
    const __m512i up = join256(_mm256_set1_epi16(4), _mm256_set1_epi16(2));
    const __m512i down = join256(_mm256_set1_epi16(0), _mm256_set1_epi16(2));
    const __m512i lo4 = _mm512_set1_epi8(15), top = _mm512_set1_epi8(0x30);
    for (int i = 0; i < n / QK; i++) {
        __m512i sc32 = _mm512_cvtepi8_epi32(_mm_loadu_si128((const __m128i *)w[i].scales));
        __m512i isum = _mm512_setzero_si512();
        for (int h = 0; h < 2; h++) {
            __m512i ql = _mm512_loadu_si512(w[i].ql + 64 * h);
            __m512i qh = _mm512_broadcast_i64x4(load256(w[i].qh + 32 * h));
            __m512i x = _mm512_or_si512(_mm512_and_si512(ql, lo4),
                                        _mm512_and_si512(_mm512_sllv_epi16(qh, up), top));
            __m512i y = _mm512_or_si512(_mm512_and_si512(_mm512_srli_epi16(ql, 4), lo4),
                                        _mm512_and_si512(_mm512_srlv_epi16(qh, down), top));
            __m512i px = _mm512_dpbusd_epi32(_mm512_setzero_si512(), x, _mm512_loadu_si512(a[i].qs + 128 * h));
            __m512i py = _mm512_dpbusd_epi32(_mm512_setzero_si512(), y, _mm512_loadu_si512(a[i].qs + 128 * h + 64));
            isum = _mm512_add_epi32(isum, _mm512_mullo_epi32(px, _mm512_permutexvar_epi32(pick[2 * h], sc32)));
            isum = _mm512_add_epi32(isum, _mm512_mullo_epi32(py, _mm512_permutexvar_epi32(pick[2 * h + 1], sc32)));
        }
        /* the levels carry +32: take out 32 * sum(sc * a) via the 16-sums */
        __m256i sc16 = _mm256_cvtepi8_epi16(_mm_loadu_si128((const __m128i *)w[i].scales));
        __m256i bias = _mm256_slli_epi32(_mm256_madd_epi16(load256(a[i].bsums), sc16), 5);
        isum = _mm512_sub_epi32(isum, _mm512_zextsi256_si512(bias));
        acc = _mm512_fmadd_ps(_mm512_set1_ps(a[i].d * fp16(w[i].d)), _mm512_cvtepi32_ps(isum), acc);
    }
    *s = _mm512_reduce_add_ps(acc);
}

static void dot_f32_avx512(int n, float *s, const void *vw, const void *va)
{
    const float *w = vw, *a = va;
    __m512 acc[4] = {_mm512_setzero_ps(), _mm512_setzero_ps(), _mm512_setzero_ps(), _mm512_setzero_ps()};
    int i = 0;
    for (; i + 64 <= n; i += 64)
        for (int k = 0; k < 4; k++)
            acc[k] = _mm512_fmadd_ps(_mm512_loadu_ps(w + i + 16 * k), _mm512_loadu_ps(a + i + 16 * k), acc[k]);
    float sum = _mm512_reduce_add_ps(_mm512_add_ps(_mm512_add_ps(acc[0], acc[1]), _mm512_add_ps(acc[2], acc[3])));
    float tail = 0;
    if (i < n)
        dot_f32_avx2(n - i, &tail, w + i, a + i);
    *s = sum + tail;
}

static inline __m512 f16x16(const uint16_t *p)
{
    return _mm512_cvtph_ps(load256(p));
}

static inline __m512 bf16x16(const uint16_t *p)
{
    return _mm512_castsi512_ps(_mm512_slli_epi32(_mm512_cvtepu16_epi32(load256(p)), 16));
}

#define FLOAT16_DOT512(name, widen, tail_dot)                                      \
    static void name(int n, float *s, const void *vw, const void *va)            \
    {                                                                            \
        const uint16_t *w = vw, *a = va;                                         \
        __m512 acc[4] = {_mm512_setzero_ps(), _mm512_setzero_ps(), _mm512_setzero_ps(), \
                         _mm512_setzero_ps()};                                   \
        int i = 0;                                                               \
        for (; i + 64 <= n; i += 64)                                             \
            for (int k = 0; k < 4; k++)                                          \
                acc[k] = _mm512_fmadd_ps(widen(w + i + 16 * k), widen(a + i + 16 * k), acc[k]); \
        float sum = _mm512_reduce_add_ps(_mm512_add_ps(_mm512_add_ps(acc[0], acc[1]), \
                                                       _mm512_add_ps(acc[2], acc[3]))); \
        float tail = 0;                                                          \
        if (i < n)                                                               \
            tail_dot(n - i, &tail, w + i, a + i);                                \
        *s = sum + tail;                                                         \
    }
FLOAT16_DOT512(dot_f16_avx512, f16x16, dot_f16_avx2)
FLOAT16_DOT512(dot_bf16_avx512, bf16x16, dot_bf16_avx2)
#endif

/* ---- kernel choice: the fastest row dot built for each type ---- */

#if defined(QUANT_AVX512)
#define DOT_BEST(t) DOT512_##t
#define DOT512_f32 dot_f32_avx512
#define DOT512_f16 dot_f16_avx512
#define DOT512_bf16 dot_bf16_avx512
#define DOT512_q4_0 dot_q4_0_avx512
#define DOT512_q4_1 dot_q4_1_avx512
#define DOT512_q5_0 dot_q5_0_avx512
#define DOT512_q5_1 dot_q5_1_avx512
#define DOT512_q8_0 dot_q8_0_avx2
#define DOT512_iq4_nl dot_iq4_nl_avx512
#define DOT512_q4_K dot_q4_K_avx512
#define DOT512_q6_K dot_q6_K_avx512
#define DOT512_q2_K dot_q2_K_avx2
#define DOT512_q3_K dot_q3_K_avx2
#define DOT512_q5_K dot_q5_K_avx2
#define DOT512_iq4_xs dot_iq4_xs_avx2
#define DOT512_iq2_xxs dot_iq2_xxs_avx2
#define DOT512_iq2_xs dot_iq2_xs_avx2
#define DOT512_iq2_s dot_iq2_s_avx2
#define DOT512_iq3_xxs dot_iq3_xxs_avx2
#define DOT512_iq3_s dot_iq3_s_avx2
#elif defined(QUANT_AVX2)
#define DOT_BEST(t) dot_##t##_avx2
#else
#define DOT_BEST(t) dot_##t##_scalar
#endif

/* ==== the type table ==== */

/* dot: the fastest kernel built; dot_scalar: the portable one */
#define DOTS(t) DOT_BEST(t), dot_##t##_scalar

static const struct quant_type qtypes[QT_COUNT] = {
    [QT_F32] = {"F32", 1, 4, QT_F32, f32_to_f32, f32_from_f32, DOTS(f32)},
    [QT_F16] = {"F16", 1, 2, QT_F16, f16_to_f32, f16_from_f32, DOTS(f16)},
    [QT_BF16] = {"BF16", 1, 2, QT_BF16, bf16_to_f32, bf16_from_f32, DOTS(bf16)},
    [QT_Q4_0] = {"Q4_0", 32, 18, QT_Q8_0, q4_0_to_f32, q4_0_from_f32, DOTS(q4_0)},
    [QT_Q4_1] = {"Q4_1", 32, 20, QT_Q8_1, q4_1_to_f32, q4_1_from_f32, DOTS(q4_1)},
    [QT_Q5_0] = {"Q5_0", 32, 22, QT_Q8_0, q5_0_to_f32, q5_0_from_f32, DOTS(q5_0)},
    [QT_Q5_1] = {"Q5_1", 32, 24, QT_Q8_1, q5_1_to_f32, q5_1_from_f32, DOTS(q5_1)},
    [QT_Q8_0] = {"Q8_0", 32, 34, QT_Q8_0, q8_0_to_f32, q8_0_from_f32, DOTS(q8_0)},
    [QT_Q8_1] = {"Q8_1", 32, 36, QT_Q8_1, q8_1_to_f32, q8_1_from_f32, NULL, NULL},
    [QT_Q2_K] = {"Q2_K", QK, 84, QT_Q8_K, q2_K_to_f32, q2_K_from_f32, DOTS(q2_K)},
    [QT_Q3_K] = {"Q3_K", QK, 110, QT_Q8_K, q3_K_to_f32, q3_K_from_f32, DOTS(q3_K)},
    [QT_Q4_K] = {"Q4_K", QK, 144, QT_Q8_K, q4_K_to_f32, q4_K_from_f32, DOTS(q4_K)},
    [QT_Q5_K] = {"Q5_K", QK, 176, QT_Q8_K, q5_K_to_f32, q5_K_from_f32, DOTS(q5_K)},
    [QT_Q6_K] = {"Q6_K", QK, 210, QT_Q8_K, q6_K_to_f32, q6_K_from_f32, DOTS(q6_K)},
    [QT_Q8_K] = {"Q8_K", QK, 292, QT_Q8_K, q8_K_to_f32, q8_K_from_f32, NULL, NULL},
    [QT_IQ2_XXS] = {"IQ2_XXS", QK, 66, QT_Q8_K, iq2_xxs_to_f32, NULL, DOTS(iq2_xxs)},
    [QT_IQ2_XS] = {"IQ2_XS", QK, 74, QT_Q8_K, iq2_xs_to_f32, NULL, DOTS(iq2_xs)},
    [QT_IQ2_S] = {"IQ2_S", QK, 82, QT_Q8_K, iq2_s_to_f32, NULL, DOTS(iq2_s)},
    [QT_IQ3_XXS] = {"IQ3_XXS", QK, 98, QT_Q8_K, iq3_xxs_to_f32, NULL, DOTS(iq3_xxs)},
    [QT_IQ3_S] = {"IQ3_S", QK, 110, QT_Q8_K, iq3_s_to_f32, NULL, DOTS(iq3_s)},
    [QT_IQ4_NL] = {"IQ4_NL", 32, 18, QT_Q8_0, iq4_nl_to_f32, iq4_nl_from_f32, DOTS(iq4_nl)},
    [QT_IQ4_XS] = {"IQ4_XS", QK, 136, QT_Q8_K, iq4_xs_to_f32, iq4_xs_from_f32, DOTS(iq4_xs)},
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

/* The IQ2/IQ3 lattice types have decoders but no quantiser here; any bytes
 * are codes of theirs, and each block begins with its half-float scale. */
int quant_lattice(int qtype)
{
    return qtype == QT_IQ2_XXS || qtype == QT_IQ2_XS || qtype == QT_IQ2_S || qtype == QT_IQ3_XXS ||
           qtype == QT_IQ3_S;
}

int quant_lattice_row(int qtype, void *row, int64_t n, float amax)
{
    const struct quant_type *t = quant_type(qtype);
    float *y = quant_lattice(qtype) && n > 0 && n % QK == 0 ? malloc((size_t)n * sizeof *y) : NULL;
    if (!y)
        return -1;
    uint8_t *b = row;
    uint16_t d = quant_f32_to_f16(1.0f);
    for (int64_t i = 0; i < n / QK; i++)
        memcpy(b + i * t->size, &d, 2);
    t->to_f32(row, y, n);
    float m = 0.0f;
    for (int64_t i = 0; i < n; i++)
        m = fmaxf(m, fabsf(y[i]));
    free(y);
    d = quant_f32_to_f16(m > 0.0f ? amax / m : 0.0f);
    for (int64_t i = 0; i < n / QK; i++)
        memcpy(b + i * t->size, &d, 2);
    return 0;
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

/* ==== weight rows as levels: the form the tiled kernel reads ==== */

#ifdef QUANT_AVX512
/* Each unpacker writes one row of n elements as unsigned levels u (n bytes),
 * a float scale per sub-block (sc) and, for types with mins, an offset per
 * sub-block (off): see struct quant_levels. */

static void levels_q8_0(const void *row, int n, uint8_t *u, float *sc, float *off)
{
    const blk_q8_0 *x = row;
    (void)off;
    for (int b = 0; b < n / 32; b++) {
        sc[b] = fp16(x[b].d);
        store256(u + 32 * b, _mm256_xor_si256(load256(x[b].qs), _mm256_set1_epi8(-128)));
    }
}

static void levels_q4_0(const void *row, int n, uint8_t *u, float *sc, float *off)
{
    const blk_q4_0 *x = row;
    (void)off;
    for (int b = 0; b < n / 32; b++) {
        sc[b] = fp16(x[b].d);
        store256(u + 32 * b, nibbles32(x[b].qs));
    }
}

static void levels_q4_1(const void *row, int n, uint8_t *u, float *sc, float *off)
{
    const blk_q4_1 *x = row;
    for (int b = 0; b < n / 32; b++) {
        sc[b] = fp16(x[b].d);
        off[b] = fp16(x[b].m);
        store256(u + 32 * b, nibbles32(x[b].qs));
    }
}

static void levels_q5_0(const void *row, int n, uint8_t *u, float *sc, float *off)
{
    const blk_q5_0 *x = row;
    (void)off;
    for (int b = 0; b < n / 32; b++) {
        sc[b] = fp16(x[b].d);
        store256(u + 32 * b, _mm256_or_si256(nibbles32(x[b].qs), fifth_bits(x[b].qh)));
    }
}

static void levels_q5_1(const void *row, int n, uint8_t *u, float *sc, float *off)
{
    const blk_q5_1 *x = row;
    for (int b = 0; b < n / 32; b++) {
        sc[b] = fp16(x[b].d);
        off[b] = fp16(x[b].m);
        store256(u + 32 * b, _mm256_or_si256(nibbles32(x[b].qs), fifth_bits(x[b].qh)));
    }
}

static void levels_iq4_nl(const void *row, int n, uint8_t *u, float *sc, float *off)
{
    const blk_iq4_nl *x = row;
    (void)off;
    const __m256i book = _mm256_broadcastsi128_si256(_mm_loadu_si128((const __m128i *)kvalues_iq4nl));
    for (int b = 0; b < n / 32; b++) {
        sc[b] = fp16(x[b].d);
        __m256i v = _mm256_shuffle_epi8(book, nibbles32(x[b].qs));
        store256(u + 32 * b, _mm256_xor_si256(v, _mm256_set1_epi8(-128)));
    }
}

/* 8 byte-sized integers (a 64-bit word, byte s = sub-block s) times d. */
static inline __m256 scaled8(uint64_t bytes, float d)
{
    __m256i v = _mm256_cvtepu8_epi32(_mm_cvtsi64_si128((long long)bytes));
    return _mm256_mul_ps(_mm256_cvtepi32_ps(v), _mm256_set1_ps(d));
}

/* Q4_K and Q6_K, the types of most K-quant files, decode straight to the
 * row; the others go through their struct ksb. */
static void levels_q4_K(const void *row, int n, uint8_t *u, float *sc, float *off)
{
    const blk_q4_K *x = row;
    for (int i = 0; i < n / QK; i++) {
        uint64_t s, m;
        k4_scales8(x[i].scales, &s, &m);
        _mm256_storeu_ps(sc + 8 * i, scaled8(s, fp16(x[i].d)));
        _mm256_storeu_ps(off + 8 * i, scaled8(m, -fp16(x[i].dmin)));
        k4_unpack(x[i].qs, u + QK * i);
    }
}

static void levels_q6_K(const void *row, int n, uint8_t *u, float *sc, float *off)
{
    const blk_q6_K *x = row;
    (void)off;
    for (int i = 0; i < n / QK; i++) {
        __m512 s = _mm512_cvtepi32_ps(_mm512_cvtepi8_epi32(_mm_loadu_si128((const __m128i *)x[i].scales)));
        _mm512_storeu_ps(sc + 16 * i, _mm512_mul_ps(s, _mm512_set1_ps(fp16(x[i].d))));
        k6_unpack(&x[i], u + QK * i);
    }
}

#define LEVELS_KSB(type)                                                            \
    static void levels_##type(const void *row, int n, uint8_t *u, float *sc, float *off) \
    {                                                                               \
        struct ksb k;                                                               \
        for (int i = 0; i < n / QK; i++) {                                          \
            ksb_##type((const blk_##type *)row + i, &k);                            \
            memcpy(u + QK * i, k.u, QK);                                            \
            int ns = QK / k.sb;                                                     \
            for (int s = 0; s < ns; s++) {                                          \
                sc[ns * i + s] = k.d * k.sc[s];                                     \
                off[ns * i + s] = -k.dmin * k.mn[s];                                \
            }                                                                       \
        }                                                                           \
    }
LEVELS_KSB(q2_K)
LEVELS_KSB(q3_K)
LEVELS_KSB(q5_K)
LEVELS_KSB(iq4_xs)
LEVELS_KSB(iq2_xxs)
LEVELS_KSB(iq2_xs)
LEVELS_KSB(iq2_s)
LEVELS_KSB(iq3_xxs)
LEVELS_KSB(iq3_s)

/* sb, unit, bias, mins, unpack */
static const struct quant_levels levels[QT_COUNT] = {
    [QT_Q8_0] = {32, 32, 128, QUANT_MINS_NONE, levels_q8_0},
    [QT_Q4_0] = {32, 32, 8, QUANT_MINS_NONE, levels_q4_0},
    [QT_Q4_1] = {32, 32, 0, QUANT_MINS_Q8_1, levels_q4_1},
    [QT_Q5_0] = {32, 32, 16, QUANT_MINS_NONE, levels_q5_0},
    [QT_Q5_1] = {32, 32, 0, QUANT_MINS_Q8_1, levels_q5_1},
    [QT_IQ4_NL] = {32, 32, 128, QUANT_MINS_NONE, levels_iq4_nl},
    [QT_Q2_K] = {16, QK, 0, QUANT_MINS_SUB, levels_q2_K},
    [QT_Q3_K] = {16, QK, 4, QUANT_MINS_NONE, levels_q3_K},
    [QT_Q4_K] = {32, QK, 0, QUANT_MINS_SUB, levels_q4_K},
    [QT_Q5_K] = {32, QK, 0, QUANT_MINS_SUB, levels_q5_K},
    [QT_Q6_K] = {16, QK, 32, QUANT_MINS_NONE, levels_q6_K},
    [QT_IQ4_XS] = {32, QK, 128, QUANT_MINS_NONE, levels_iq4_xs},
    [QT_IQ2_XXS] = {32, QK, 128, QUANT_MINS_NONE, levels_iq2_xxs},
    [QT_IQ2_XS] = {16, QK, 128, QUANT_MINS_NONE, levels_iq2_xs},
    [QT_IQ2_S] = {16, QK, 128, QUANT_MINS_NONE, levels_iq2_s},
    [QT_IQ3_XXS] = {32, QK, 128, QUANT_MINS_NONE, levels_iq3_xxs},
    [QT_IQ3_S] = {32, QK, 128, QUANT_MINS_NONE, levels_iq3_s},
};
#endif

const struct quant_levels *quant_levels(int qtype)
{
#ifdef QUANT_AVX512
    if (qtype >= 0 && qtype < QT_COUNT && levels[qtype].unpack)
        return &levels[qtype];
#endif
    (void)qtype;
    return NULL;
}

void quant_act_parts(int dot_type, const void *row, int n, int8_t *qs, float *d, int32_t *s16, float *s)
{
    if (dot_type == QT_Q8_K) {
        const blk_q8_K *x = row;
        for (int i = 0; i < n / QK; i++) {
            memcpy(qs + QK * i, x[i].qs, QK);
            d[i] = x[i].d;
            for (int g = 0; g < 16; g++)
                s16[16 * i + g] = x[i].bsums[g];
        }
        return;
    }
    int q81 = dot_type == QT_Q8_1;
    for (int b = 0; b < n / 32; b++) {
        const int8_t *q;
        if (q81) {
            const blk_q8_1 *x = (const blk_q8_1 *)row + b;
            q = x->qs;
            d[b] = fp16(x->d);
            s[b] = fp16(x->s);
        } else {
            const blk_q8_0 *x = (const blk_q8_0 *)row + b;
            q = x->qs;
            d[b] = fp16(x->d);
        }
        memcpy(qs + 32 * b, q, 32);
        for (int h = 0; h < 2; h++) {
            int sum = 0;
            for (int j = 0; j < 16; j++)
                sum += q[16 * h + j];
            s16[2 * b + h] = sum;
        }
    }
}
