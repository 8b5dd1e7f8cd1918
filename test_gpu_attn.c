/*
 * test_gpu_attn.c — the GPU attention kernels against attn.c and FP64 (GPU builds; skipped otherwise).
 */
#include "strata.h"
#include "test.h"

void test_gpu_attn(void)
{
    if (!test_begin("gpu/attn/placeholder"))
        return;
    test_skip("not written yet");
}
