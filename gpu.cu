/*
 * gpu.cu — skeleton: the helper "gpu-forward" replaces this file.
 */
#include "gpu.h"
#include "gpu_compat.h"

const char *gpu_backend(void)
{
#ifdef GPU_HIP
    return "hip";
#else
    return "cuda";
#endif
}

int gpu_devices(char *name, size_t cap)
{
    int n = 0;
    if (gpuGetDeviceCount(&n) != gpuSuccess)
        n = 0;
    if (name && cap) {
        name[0] = 0;
        gpuDeviceProp p;
        if (n > 0 && gpuGetDeviceProperties(&p, 0) == gpuSuccess)
            snprintf(name, cap, "%s", p.name);
    }
    return n;
}

static int todo(char *err, size_t errlen) { return strata_errf(err, errlen, "gpu.cu: not written yet"); }

int gpu_model_new(struct gpu_model **g, const struct model *m, char *err, size_t errlen)
{
    (void)m;
    *g = NULL;
    return todo(err, errlen);
}
void gpu_model_free(struct gpu_model *g) { (void)g; }
size_t gpu_model_bytes(const struct gpu_model *g) { (void)g; return 0; }
const struct kv_mem *gpu_kv_mem(struct gpu_model *g) { (void)g; return NULL; }
int gpu_ctx_new(struct gpu_ctx **c, struct gpu_model *g, struct kv *kv, int max_tokens, char *err, size_t errlen)
{
    (void)g, (void)kv, (void)max_tokens;
    *c = NULL;
    return todo(err, errlen);
}
void gpu_ctx_free(struct gpu_ctx *c) { (void)c; }
int gpu_eval(struct gpu_ctx *c, int seq, const int32_t *tokens, int n, int pos, float *logits, int all_logits,
             char *err, size_t errlen)
{
    (void)c, (void)seq, (void)tokens, (void)n, (void)pos, (void)logits, (void)all_logits;
    return todo(err, errlen);
}
int gpu_kv_store(const struct gpu_kv *kv, int layer, const int32_t *pos0, int T, const float *k, const float *v,
                 void *stream, char *err, size_t errlen)
{
    (void)kv, (void)layer, (void)pos0, (void)T, (void)k, (void)v, (void)stream;
    return todo(err, errlen);
}
