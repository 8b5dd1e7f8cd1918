/*
 * attn_hip.hip — skeleton: the helper "attn-hip" replaces this file.
 */
#include "gpu.h"
#include "gpu_compat.h"

static int todo(char *err, size_t errlen) { return strata_errf(err, errlen, "attn_hip.hip: not written yet"); }
int gpu_attn_prompt_rdna2(const struct gpu_attn *a, void *s, char *err, size_t errlen) { (void)a, (void)s; return todo(err, errlen); }
int gpu_attn_decode_rdna2(const struct gpu_attn *a, void *s, char *err, size_t errlen) { (void)a, (void)s; return todo(err, errlen); }
int gpu_attn_qsa_prompt_rdna2(const struct gpu_attn *a, void *s, char *err, size_t errlen) { (void)a, (void)s; return todo(err, errlen); }
int gpu_attn_qsa_decode_rdna2(const struct gpu_attn *a, void *s, char *err, size_t errlen) { (void)a, (void)s; return todo(err, errlen); }
