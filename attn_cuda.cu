/*
 * attn_cuda.cu — skeleton: the helper "attn-cuda" replaces this file.
 */
#include "gpu.h"
#include "gpu_compat.h"

static int todo(char *err, size_t errlen) { return strata_errf(err, errlen, "attn_cuda.cu: not written yet"); }
size_t gpu_attn_scratch_bytes(int H, int T, int max_cells, int E) { (void)H, (void)T, (void)max_cells, (void)E; return 0; }
int gpu_attn_prompt(const struct gpu_attn *a, void *s, char *err, size_t errlen) { (void)a, (void)s; return todo(err, errlen); }
int gpu_attn_decode(const struct gpu_attn *a, void *s, char *err, size_t errlen) { (void)a, (void)s; return todo(err, errlen); }
int gpu_attn_qsa_prompt(const struct gpu_attn *a, void *s, char *err, size_t errlen) { (void)a, (void)s; return todo(err, errlen); }
int gpu_attn_qsa_decode(const struct gpu_attn *a, void *s, char *err, size_t errlen) { (void)a, (void)s; return todo(err, errlen); }
const char *gpu_attn_kernel_name(const struct gpu_attn *a, int decode, int qsa) { (void)a, (void)decode, (void)qsa; return "none"; }
