/*
 * gpu_compat.h — one source for two toolchains: the runtime API and the warp
 * primitives that Strata's GPU files use, spelled once for CUDA (nvcc) and
 * for HIP (hipcc). Kernels use gpu* names, GPU_WARP for the warp width of the
 * target (32 on NVIDIA and RDNA, 64 on CDNA/GCN) and the warp_* reductions,
 * which are correct for either width. No masks that assume 32 lanes.
 */
#ifndef STRATA_GPU_COMPAT_H
#define STRATA_GPU_COMPAT_H

#if defined(__HIP_PLATFORM_AMD__) || defined(__HIPCC__)
#include <hip/hip_fp16.h>
#include <hip/hip_runtime.h>
#define GPU_HIP 1
typedef hipStream_t gpuStream_t;
typedef hipEvent_t gpuEvent_t;
typedef hipError_t gpuError_t;
typedef hipGraph_t gpuGraph_t;
typedef hipGraphExec_t gpuGraphExec_t;
typedef hipDeviceProp_t gpuDeviceProp;
#define gpuSuccess hipSuccess
#define gpuGetErrorString hipGetErrorString
#define gpuGetLastError hipGetLastError
#define gpuGetDeviceCount hipGetDeviceCount
#define gpuGetDeviceProperties hipGetDeviceProperties
#define gpuSetDevice hipSetDevice
#define gpuMalloc hipMalloc
#define gpuMallocHost hipHostMalloc
#define gpuHostGetDevicePointer hipHostGetDevicePointer
/* HIP 5.2 declares hipError_t [[nodiscard]] (cudaError_t is not): the
 * release calls, which cleanup paths make without a check, drop it here */
static inline void gpu_hip_drop(hipError_t e) { (void)e; }
#define gpuFree(p) gpu_hip_drop(hipFree(p))
#define gpuFreeHost(p) gpu_hip_drop(hipHostFree(p))
#define gpuMemcpy hipMemcpy
#define gpuMemcpyAsync hipMemcpyAsync
#define gpuMemset hipMemset
#define gpuMemsetAsync hipMemsetAsync
#define gpuMemcpyHostToDevice hipMemcpyHostToDevice
#define gpuMemcpyDeviceToHost hipMemcpyDeviceToHost
#define gpuMemcpyDeviceToDevice hipMemcpyDeviceToDevice
#define gpuStreamCreate hipStreamCreate
#define gpuStreamDestroy(s) gpu_hip_drop(hipStreamDestroy(s))
#define gpuStreamSynchronize hipStreamSynchronize
#define gpuDeviceSynchronize hipDeviceSynchronize
#define gpuEventCreate hipEventCreate
#define gpuEventDestroy(e) gpu_hip_drop(hipEventDestroy(e))
#define gpuEventRecord hipEventRecord
#define gpuEventSynchronize hipEventSynchronize
#define gpuEventElapsedTime hipEventElapsedTime
#define gpuStreamBeginCapture hipStreamBeginCapture
#define gpuStreamEndCapture hipStreamEndCapture
#define gpuStreamCaptureModeThreadLocal hipStreamCaptureModeThreadLocal
#define gpuGraphInstantiate(e, g) hipGraphInstantiate(e, g, NULL, NULL, 0)
#define gpuGraphLaunch hipGraphLaunch
#define gpuGraphDestroy(g) gpu_hip_drop(hipGraphDestroy(g))
#define gpuGraphExecDestroy(g) gpu_hip_drop(hipGraphExecDestroy(g))
#define gpuFuncSetAttribute(f, a, v) hipFuncSetAttribute((const void *)(f), a, v)
#define gpuFuncAttributeMaxDynamicSharedMemorySize hipFuncAttributeMaxDynamicSharedMemorySize
#define gpuGetDevice hipGetDevice
#define gpuDeviceGetAttribute hipDeviceGetAttribute
#define gpuDevAttrMultiProcessorCount hipDeviceAttributeMultiprocessorCount
#define gpuDevAttrComputeCapabilityMajor hipDeviceAttributeComputeCapabilityMajor
#define gpuDevAttrComputeCapabilityMinor hipDeviceAttributeComputeCapabilityMinor
#define gpuOccupancyMaxActiveBlocksPerMultiprocessor(n, f, t, sm) \
    hipOccupancyMaxActiveBlocksPerMultiprocessor(n, (const void *)(f), t, sm)
#ifdef __AMDGCN_WAVEFRONT_SIZE
#define GPU_WARP __AMDGCN_WAVEFRONT_SIZE
#else
#define GPU_WARP 64
#endif
#define gpu_shfl_xor(v, m) __shfl_xor(v, m)
#define gpu_shfl(v, l) __shfl(v, l)
#else
#include <cuda_bf16.h>
#include <cuda_fp16.h>
#include <cuda_runtime.h>
#define GPU_CUDA 1
typedef cudaStream_t gpuStream_t;
typedef cudaEvent_t gpuEvent_t;
typedef cudaError_t gpuError_t;
typedef cudaGraph_t gpuGraph_t;
typedef cudaGraphExec_t gpuGraphExec_t;
typedef cudaDeviceProp gpuDeviceProp;
#define gpuSuccess cudaSuccess
#define gpuGetErrorString cudaGetErrorString
#define gpuGetLastError cudaGetLastError
#define gpuGetDeviceCount cudaGetDeviceCount
#define gpuGetDeviceProperties cudaGetDeviceProperties
#define gpuSetDevice cudaSetDevice
#define gpuMalloc cudaMalloc
#define gpuFree cudaFree
#define gpuMallocHost cudaMallocHost
#define gpuHostGetDevicePointer cudaHostGetDevicePointer
#define gpuFreeHost cudaFreeHost
#define gpuMemcpy cudaMemcpy
#define gpuMemcpyAsync cudaMemcpyAsync
#define gpuMemset cudaMemset
#define gpuMemsetAsync cudaMemsetAsync
#define gpuMemcpyHostToDevice cudaMemcpyHostToDevice
#define gpuMemcpyDeviceToHost cudaMemcpyDeviceToHost
#define gpuMemcpyDeviceToDevice cudaMemcpyDeviceToDevice
#define gpuStreamCreate cudaStreamCreate
#define gpuStreamDestroy cudaStreamDestroy
#define gpuStreamSynchronize cudaStreamSynchronize
#define gpuDeviceSynchronize cudaDeviceSynchronize
#define gpuEventCreate cudaEventCreate
#define gpuEventDestroy cudaEventDestroy
#define gpuEventRecord cudaEventRecord
#define gpuEventSynchronize cudaEventSynchronize
#define gpuEventElapsedTime cudaEventElapsedTime
#define gpuStreamBeginCapture cudaStreamBeginCapture
#define gpuStreamEndCapture cudaStreamEndCapture
#define gpuStreamCaptureModeThreadLocal cudaStreamCaptureModeThreadLocal
#define gpuGraphInstantiate(e, g) cudaGraphInstantiate(e, g, 0)
#define gpuGraphLaunch cudaGraphLaunch
#define gpuGraphDestroy cudaGraphDestroy
#define gpuGraphExecDestroy cudaGraphExecDestroy
#define gpuFuncSetAttribute(f, a, v) cudaFuncSetAttribute(f, a, v)
#define gpuFuncAttributeMaxDynamicSharedMemorySize cudaFuncAttributeMaxDynamicSharedMemorySize
#define gpuGetDevice cudaGetDevice
#define gpuDeviceGetAttribute cudaDeviceGetAttribute
#define gpuDevAttrMultiProcessorCount cudaDevAttrMultiProcessorCount
#define gpuDevAttrComputeCapabilityMajor cudaDevAttrComputeCapabilityMajor
#define gpuDevAttrComputeCapabilityMinor cudaDevAttrComputeCapabilityMinor
#define gpuOccupancyMaxActiveBlocksPerMultiprocessor cudaOccupancyMaxActiveBlocksPerMultiprocessor
#define GPU_WARP 32
#define gpu_shfl_xor(v, m) __shfl_xor_sync(0xffffffffu, v, m)
#define gpu_shfl(v, l) __shfl_sync(0xffffffffu, v, l)
#endif

/* Sum / max over the lanes of one warp; every lane gets the result. */
static __device__ __forceinline__ float warp_sum(float v)
{
#pragma unroll
    for (int m = GPU_WARP / 2; m > 0; m >>= 1)
        v += gpu_shfl_xor(v, m);
    return v;
}

static __device__ __forceinline__ float warp_max(float v)
{
#pragma unroll
    for (int m = GPU_WARP / 2; m > 0; m >>= 1)
        v = fmaxf(v, gpu_shfl_xor(v, m));
    return v;
}

/* c + the dot product of the four signed bytes of a and of b (dp4a);
 * gpu_dp4a_us: of the four unsigned bytes of a and the signed ones of b. */
#ifdef GPU_CUDA
#define gpu_dp4a(a, b, c) __dp4a(a, b, c)
static __device__ __forceinline__ int gpu_dp4a_us(int a, int b, int c)
{
    int d;
    asm("dp4a.u32.s32 %0, %1, %2, %3;" : "=r"(d) : "r"(a), "r"(b), "r"(c));
    return d;
}
#else
template <typename A>   /* a's bytes as A */
static __device__ __forceinline__ int gpu_dp4a_of(int a, int b, int c)
{
#pragma unroll
    for (int i = 0; i < 32; i += 8)
        c += (int)(A)(a >> i) * (int)(int8_t)(b >> i);
    return c;
}
#define gpu_dp4a(a, b, c) gpu_dp4a_of<int8_t>(a, b, c)
#define gpu_dp4a_us(a, b, c) gpu_dp4a_of<uint8_t>(a, b, c)
#endif

/* c += A·B, one mma.sync m16n8k16 (CUDA sm_80+; its callers are built for
 * those only): A's four registers a, B's b0 and b1, f16 (or bf16: BF),
 * f32 sums; gpu_pack16 rounds two floats to such a register (lo in the
 * low half). */
#ifdef GPU_CUDA
template <bool BF = false>
static __device__ __forceinline__ uint32_t gpu_pack16(float lo, float hi)
{
    if constexpr (BF) {
        __nv_bfloat162 h = __floats2bfloat162_rn(lo, hi);
        return *(const uint32_t *)&h;
    } else {
        __half2 h = __floats2half2_rn(lo, hi);
        return *(const uint32_t *)&h;
    }
}

template <bool BF = false>
static __device__ __forceinline__ void gpu_mma16816(float *c, const uint32_t *a, uint32_t b0, uint32_t b1)
{
    if constexpr (BF)
        asm volatile("mma.sync.aligned.m16n8k16.row.col.f32.bf16.bf16.f32 "
                     "{%0,%1,%2,%3}, {%4,%5,%6,%7}, {%8,%9}, {%0,%1,%2,%3};\n"
                     : "+f"(c[0]), "+f"(c[1]), "+f"(c[2]), "+f"(c[3])
                     : "r"(a[0]), "r"(a[1]), "r"(a[2]), "r"(a[3]), "r"(b0), "r"(b1));
    else
        asm volatile("mma.sync.aligned.m16n8k16.row.col.f32.f16.f16.f32 "
                     "{%0,%1,%2,%3}, {%4,%5,%6,%7}, {%8,%9}, {%0,%1,%2,%3};\n"
                     : "+f"(c[0]), "+f"(c[1]), "+f"(c[2]), "+f"(c[3])
                     : "r"(a[0]), "r"(a[1]), "r"(a[2]), "r"(a[3]), "r"(b0), "r"(b1));
}
#endif

/* The lanes of one warp meet: shared-memory writes before it show to every
 * lane after it. */
#ifdef GPU_CUDA
#define gpu_syncwarp() __syncwarp()
#else
static __device__ __forceinline__ void gpu_syncwarp()
{
    __builtin_amdgcn_fence(__ATOMIC_RELEASE, "wavefront");
    __builtin_amdgcn_wave_barrier();
    __builtin_amdgcn_fence(__ATOMIC_ACQUIRE, "wavefront");
}
#endif

/* The decode chain's timeline (CUDA, built with -DSTRATA_TRACE only: the
 * measuring build of `make cuda TRACE=1`, BENCH.md's twentieth pass). Each
 * block of a kernel that opens with GPU_TRACE(tag) records, from the
 * device's nanosecond clock: when it started, when it reached
 * gpu_grid_wait and when the wait returned (the kernel ahead done and its
 * writes shown), when it first passed GPU_TRACE_MARK() (a point of the
 * kernel's own) and GPU_TRACE_AT(1..3) (three more, for the block by block
 * file), and when its last warp ended. Records live in a ring of
 * GPU_TRACE_GRIDS launches by %gridid (a graph's kernels keep theirs from
 * replay to replay, so the ring holds the last replay), GPU_TRACE_BLOCKS
 * blocks a launch (blocks past that are not recorded); each file that
 * includes this header has its own ring, which gpu_trace_copy reads back.
 * Plain stores and one reduction a warp, no atomics that return; it still
 * costs 6-7% of a decode step. */
#if defined(STRATA_TRACE) && defined(GPU_CUDA)
enum gpu_trace_tag { GT_MV = 1, GT_MVROW, GT_MVK, GT_MVS, GT_MVQ, GT_ACT, GT_NORM_ROUTER, GT_EMBED, GT_STORE, GT_QKV,
                     GT_ROUTE, GT_MOE_SUM, GT_ADD, GT_DEC, GT_MERGE, GT_ROPE, GT_MVX, GT_MV2, GT_MVF, GT_MVH, GT_N };
#define GPU_TRACE_GRIDS 4096
#define GPU_TRACE_BLOCKS 1024
struct gpu_trace_rec {
    unsigned long long grid, t0, tw, tr, t1;   /* start, at the wait, past it, end */
    unsigned long long tm[4];                  /* GPU_TRACE_MARK, GPU_TRACE_AT(1..3) */
    unsigned tag, sm;
};
static __device__ gpu_trace_rec gpu_trace_ring[GPU_TRACE_GRIDS * GPU_TRACE_BLOCKS];
/* the points thread 0 has passed (bit k: GPU_TRACE_AT(k), bit
 * GPU_TRACE_WAIT: the wait), so that a point costs no read of its record:
 * an L2 round trip on the first thread's path would lengthen what it
 * measures */
static __shared__ unsigned gpu_trace_seen;
#define GPU_TRACE_WAIT 4

static __device__ __forceinline__ unsigned long long gpu_clock_ns()
{
    unsigned long long t;
    asm volatile("mov.u64 %0, %%globaltimer;" : "=l"(t));
    return t;
}

/* this block's record, or NULL past GPU_TRACE_BLOCKS */
static __device__ __forceinline__ gpu_trace_rec *gpu_trace_at(unsigned long long *grid)
{
    asm("mov.u64 %0, %%gridid;" : "=l"(*grid));
    unsigned b = blockIdx.x + gridDim.x * (blockIdx.y + gridDim.y * blockIdx.z);
    return b < GPU_TRACE_BLOCKS ? &gpu_trace_ring[(*grid % GPU_TRACE_GRIDS) * GPU_TRACE_BLOCKS + b] : NULL;
}

struct gpu_trace_scope {
    __device__ explicit gpu_trace_scope(unsigned tag)
    {
        unsigned long long g, t = gpu_clock_ns();
        gpu_trace_rec *r = gpu_trace_at(&g);
        if (r && threadIdx.x == 0) {
            unsigned sm;
            asm("mov.u32 %0, %%smid;" : "=r"(sm));
            r->grid = g, r->t0 = t, r->tw = r->tr = r->t1 = 0, r->tag = tag, r->sm = sm;
            r->tm[0] = r->tm[1] = r->tm[2] = r->tm[3] = 0;
        }
        if (threadIdx.x == 0)
            gpu_trace_seen = 0;
    }
    __device__ ~gpu_trace_scope()
    {
        unsigned long long g;
        gpu_trace_rec *r = gpu_trace_at(&g);
        if (r && threadIdx.x % 32 == 0)
            asm volatile("red.relaxed.gpu.global.max.u64 [%0], %1;" ::"l"(&r->t1), "l"(gpu_clock_ns()) : "memory");
    }
};
#define GPU_TRACE(tag) gpu_trace_scope gpu_trace_scope_(tag)

/* this block's record when thread 0 passes point k for the first time,
 * else NULL */
static __device__ __forceinline__ gpu_trace_rec *gpu_trace_first(int k)
{
    unsigned long long g;
    gpu_trace_rec *r = gpu_trace_at(&g);
    if (!r || threadIdx.x != 0 || gpu_trace_seen & 1u << k)
        return NULL;
    gpu_trace_seen |= 1u << k;
    return r;
}

/* the first time thread 0 of the block passes point k: GPU_TRACE_MARK (0,
 * one a kernel, in the timeline) or GPU_TRACE_AT(1..3) (the block by block
 * file only) */
static __device__ __forceinline__ void gpu_trace_point(int k)
{
    if (gpu_trace_rec *r = gpu_trace_first(k))
        r->tm[k] = gpu_clock_ns();
}
#define GPU_TRACE_MARK() gpu_trace_point(0)
#define GPU_TRACE_AT(k) gpu_trace_point(k)

/* the ring, for the host (bytes to dst; 0 or the runtime's error) */
static inline int gpu_trace_copy(void *dst)
{
    return (int)cudaMemcpyFromSymbol(dst, gpu_trace_ring, sizeof gpu_trace_ring);
}
#else
#define GPU_TRACE(tag) ((void)0)
#define GPU_TRACE_MARK() ((void)0)
#define GPU_TRACE_AT(k) ((void)0)
#endif

/* Programmatic dependent launch (CUDA, sm_90+): a kernel launched with
 * gpu_launch(..., pdl = 1, ...) may have blocks resident before the kernel
 * ahead of it has finished; it must call gpu_grid_wait before it touches
 * memory the one ahead writes or reads (the wait returns once that kernel
 * has finished and its writes show). gpu_grid_launch_dependents lets the
 * kernel behind launch early (it still waits). Elsewhere: no-ops, and
 * gpu_launch launches plainly. */
static __device__ __forceinline__ void gpu_grid_wait()
{
#if defined(STRATA_TRACE) && defined(GPU_CUDA)
    unsigned long long tw = gpu_clock_ns();
#endif
#if defined(GPU_CUDA) && defined(__CUDA_ARCH__) && __CUDA_ARCH__ >= 900
    asm volatile("griddepcontrol.wait;" ::: "memory");
#endif
#if defined(STRATA_TRACE) && defined(GPU_CUDA)
    if (gpu_trace_rec *r = gpu_trace_first(GPU_TRACE_WAIT))
        r->tw = tw, r->tr = gpu_clock_ns();
#endif
}

static __device__ __forceinline__ void gpu_grid_launch_dependents()
{
#if defined(GPU_CUDA) && defined(__CUDA_ARCH__) && __CUDA_ARCH__ >= 900
    asm volatile("griddepcontrol.launch_dependents;" ::: "memory");
#endif
}

/* The current device's compute capability (major·10 + minor) and SM
 * count, asked of the runtime once per device (each file that calls this
 * keeps its own answers). */
static inline gpuError_t gpu_device_facts(int *arch, int *sms)
{
    static int c_arch[64], c_sms[64];
    int dev = 0, major = 0, minor = 0, n = 0;
    gpuError_t e = gpuGetDevice(&dev);
    if (e != gpuSuccess)
        return e;
    int cached = dev >= 0 && dev < 64;
    if (!cached || !c_arch[dev]) {
        if ((e = gpuDeviceGetAttribute(&major, gpuDevAttrComputeCapabilityMajor, dev)) != gpuSuccess ||
            (e = gpuDeviceGetAttribute(&minor, gpuDevAttrComputeCapabilityMinor, dev)) != gpuSuccess ||
            (e = gpuDeviceGetAttribute(&n, gpuDevAttrMultiProcessorCount, dev)) != gpuSuccess)
            return e;
        if (!cached) {
            *arch = major * 10 + minor, *sms = n;
            return gpuSuccess;
        }
        c_arch[dev] = major * 10 + minor, c_sms[dev] = n;
    }
    *arch = c_arch[dev], *sms = c_sms[dev];
    return gpuSuccess;
}

/* Launches k, with programmatic dependent launch (pdl) and in thread block
 * clusters of cl blocks along x (cl 1: none) where asked: CUDA sm_90+ only;
 * HIP has neither and launches plainly. */
template <typename... P, typename... A>
static inline gpuError_t gpu_launch_cl(void (*k)(P...), dim3 grid, dim3 block, size_t smem, gpuStream_t s, int pdl,
                                       int cl, A... args)
{
#ifdef GPU_CUDA
    if (pdl || cl > 1) {
        cudaLaunchAttribute at[2] = {};
        int n = 0;
        if (pdl) {
            at[n].id = cudaLaunchAttributeProgrammaticStreamSerialization;
            at[n++].val.programmaticStreamSerializationAllowed = 1;
        }
        if (cl > 1) {
            at[n].id = cudaLaunchAttributeClusterDimension;
            at[n].val.clusterDim.x = (unsigned)cl, at[n].val.clusterDim.y = 1, at[n++].val.clusterDim.z = 1;
        }
        cudaLaunchConfig_t cfg = {};
        cfg.gridDim = grid, cfg.blockDim = block, cfg.dynamicSmemBytes = smem, cfg.stream = s;
        cfg.attrs = at, cfg.numAttrs = n;
        return cudaLaunchKernelEx(&cfg, k, (P)args...);
    }
#else
    (void)pdl, (void)cl;
#endif
    k<<<grid, block, smem, s>>>((P)args...);
    return gpuGetLastError();
}

template <typename... P, typename... A>
static inline gpuError_t gpu_launch(void (*k)(P...), dim3 grid, dim3 block, size_t smem, gpuStream_t s, int pdl,
                                    A... args)
{
    return gpu_launch_cl(k, grid, block, smem, s, pdl, 1, args...);
}

/* The error convention of strata.h for a runtime call. */
#define GPU_TRY(call, err, errlen)                                                              \
    do {                                                                                        \
        gpuError_t e_ = (call);                                                                 \
        if (e_ != gpuSuccess)                                                                   \
            return strata_errf(err, errlen, "%s: %s (%s:%d)", #call, gpuGetErrorString(e_),     \
                               __FILE__, __LINE__);                                             \
    } while (0)

#endif
