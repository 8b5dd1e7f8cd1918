/*
 * test_gpu_rdna2.c — attn_hip.hip's kernels without matrix cores, run through
 * the CUDA build, against attn.c and FP64 (GPU builds; skipped otherwise).
 */
#include "strata.h"
#include "test.h"

void test_gpu_rdna2(void)
{
    if (!test_begin("gpu/rdna2/placeholder"))
        return;
    test_skip("not written yet");
}
