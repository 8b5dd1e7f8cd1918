/*
 * gpu_head.h — one attention head's row on its way from the q/k/v product
 * to attention: the bias, the per-head RMSNorm and RoPE (as model.c forms
 * them), and a K or V row in a KV cell format (as kv.c's kv_store encodes
 * it, the same bits). Shared by gpu.cu (gf_qkv_kernel: every head of a
 * prompt) and attn_cuda.cu (ak_dec forms a decode step's heads itself);
 * compiled by nvcc and hipcc.
 *
 * Each function is called by the 32 lanes of one warp (lane = threadIdx.x
 * % 32), on rows the caller keeps in shared memory; between gh_head_norm
 * and gh_head_rope, and before other lanes read the result, the caller
 * synchronises the warp (lanes write elements that other lanes read).
 */
#ifndef STRATA_GPU_HEAD_H
#define STRATA_GPU_HEAD_H

#include "gpu_compat.h"

/* KV row formats (gpu_qkv's krow, vrow) */
enum { GH_ROW_F32, GH_ROW_F16, GH_ROW_I8, GH_ROW_Q4 };

/* RoPE's angles at position pos: co[i], si[i] for i < half, by lanes (or
 * threads) i0, i0 + step, ...; θ as the CPU forms it: the position times
 * theta_scale i times in f32, over freqs[i] (llama3 scaling; NULL: 1), times
 * freq_scale. What no kernel writes: callers form it before they wait. */
static __device__ void gh_rope_angles(float *co, float *si, int pos, int half, float theta_scale, float freq_scale,
                                      const float *freqs, int i0, int step)
{
    for (int i = i0; i < half; i += step) {
        float theta = (float)pos;
        for (int j = 0; j < i; j++)
            theta = __fmul_rn(theta, theta_scale);
        float th = freqs ? theta / freqs[i] : theta;
        th = __fmul_rn(freq_scale, th);
        co[i] = cosf(th), si[i] = sinf(th);
    }
}

/* x (E) = src + b (b NULL: none), then with norm weights nw (NULL: none)
 * the RMSNorm x·(1/sqrt(mean(x²) + eps))·nw, the squares summed in double. */
static __device__ void gh_head_norm(float *x, const float *src, const float *b, const float *nw, float eps, int E)
{
    int lane = threadIdx.x % 32;
    double s = 0;
    for (int i = lane; i < E; i += 32) {
        float h = b ? src[i] + b[i] : src[i];
        x[i] = h;
        s += (double)__fmul_rn(h, h);
    }
    if (!nw)
        return;
    for (int m = 16; m > 0; m >>= 1)
        s += gpu_shfl_xor(s, m);
    float scale = 1.0f / sqrtf((float)(s / E) + eps);
    for (int i = lane; i < E; i += 32)
        x[i] = __fmul_rn(__fmul_rn(x[i], scale), nw[i]);
}

/* RoPE in place over x's first 2·half elements: pairs (i, i + half) (neox)
 * or (2i, 2i + 1), rotated by the angles of gh_rope_angles in the CPU's
 * fused forms fma(a, cos, -(b·sin)), fma(a, sin, b·cos). */
static __device__ void gh_head_rope(float *x, const float *co, const float *si, int half, int neox)
{
    for (int i = threadIdx.x % 32; i < half; i += 32) {
        int i0 = neox ? i : 2 * i, i1 = neox ? i + half : 2 * i + 1;
        float a = x[i0], c = x[i1];
        x[i0] = fmaf(a, co[i], -__fmul_rn(c, si[i]));
        x[i1] = fmaf(a, si[i], __fmul_rn(c, co[i]));
    }
}

static __device__ __forceinline__ uint16_t gh_f2h(float f) { return __half_as_ushort(__float2half_rn(f)); }

/* Row x (E) encoded in format fmt at dst (a cell's K or V row, 4-aligned):
 * kv.c's encoders, the same bits. */
static __device__ void gh_cell_row(uint8_t *dst, int fmt, const float *x, int E)
{
    int lane = threadIdx.x % 32;
    if (fmt == GH_ROW_F32) {
        for (int i = lane; i < E; i += 32)
            ((float *)dst)[i] = x[i];
    } else if (fmt == GH_ROW_F16) {
        for (int i = lane; i < E; i += 32)
            ((uint16_t *)dst)[i] = gh_f2h(x[i]);
    } else if (fmt == GH_ROW_I8) {
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
                o[0] = gh_f2h(d);
            else if (lane < 9)
                o[lane] = (uint16_t)(lo | hi << 8);
        }
    }
}

#endif
