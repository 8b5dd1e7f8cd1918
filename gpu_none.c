/*
 * gpu_none.c — the GPU backend's entry points in a build without one (plain
 * `make`): no devices, and a clear error for anything that would need one.
 * `make cuda` and `make hip` link gpu.cu in its place.
 */
#include "strata.h"

const char *gpu_backend(void) { return "none"; }

int gpu_devices(char *name, size_t cap)
{
    if (name && cap)
        name[0] = 0;
    return 0;
}

double gpu_copy_bandwidth(size_t bytes)
{
    (void)bytes;
    return 0;
}

int gpu_gemm_blas(void) { return 0; }

static int no_gpu(char *err, size_t errlen)
{
    return strata_errf(err, errlen, "this strata was built without a GPU backend (build with make cuda or make hip)");
}

int gpu_model_new(struct gpu_model **g, const struct model *m, char *err, size_t errlen)
{
    (void)m;
    *g = NULL;
    return no_gpu(err, errlen);
}

void gpu_model_free(struct gpu_model *g) { (void)g; }
size_t gpu_model_bytes(const struct gpu_model *g) { (void)g; return 0; }
const struct kv_mem *gpu_kv_mem(struct gpu_model *g) { (void)g; return NULL; }

int gpu_ctx_new(struct gpu_ctx **c, struct gpu_model *g, struct kv *kv, int max_tokens, char *err, size_t errlen)
{
    (void)g, (void)kv, (void)max_tokens;
    *c = NULL;
    return no_gpu(err, errlen);
}

void gpu_ctx_free(struct gpu_ctx *c) { (void)c; }

float *gpu_ctx_logits(struct gpu_ctx *c, int *batch)
{
    (void)c, (void)batch;
    return NULL;
}

int gpu_eval(struct gpu_ctx *c, int seq, const int32_t *tokens, int n, int pos, float *logits, int all_logits,
             char *err, size_t errlen)
{
    (void)c, (void)seq, (void)tokens, (void)n, (void)pos, (void)logits, (void)all_logits;
    return no_gpu(err, errlen);
}

int gpu_eval_batch(struct gpu_ctx *c, const int *seqs, const int32_t *tokens, int n, float *logits, char *err,
                   size_t errlen)
{
    (void)c, (void)seqs, (void)tokens, (void)n, (void)logits;
    return no_gpu(err, errlen);
}
