/*
 * test_gpu.c — the whole model on the GPU against the CPU (GPU builds; skipped otherwise).
 */
#include "strata.h"
#include "test.h"

void test_gpu(void)
{
    if (!test_begin("gpu/placeholder"))
        return;
    test_skip("not written yet");
}
