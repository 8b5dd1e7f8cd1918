/*
 * test_gpu_gemm.c — gpu_gemm.cu's prompt matrix products against the CPU's (GPU builds; skipped otherwise).
 */
#include "strata.h"
#include "test.h"

void test_gpu_gemm(void)
{
    if (!test_begin("gpu/gemm/placeholder"))
        return;
    test_skip("not written yet");
}
