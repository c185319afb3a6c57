/* be_cpu_train.c: the CPU backend's drafter ops and backward ops.
 * PLACEHOLDER: not implemented yet (the drafter issue fills this file in). */
#include "be_cpu.h"

int dfl_cpu_rmsnorm_bwd(dfl_be *be, void *dx, float *dw, const void *dy, const void *x,
                        const void *w, const float *rstd, int64_t R, int64_t n, bool accumulate_dx)
{ return DFL_EUNSUP; }
int dfl_cpu_qknorm_rope_bwd(dfl_be *be, void *dx, int64_t ld, float *dw, const void *x_in,
                            const void *w, const float *rstd, const int32_t *pos, int64_t R,
                            int heads, int d, float eps, float theta)
{ return DFL_EUNSUP; }
int dfl_cpu_swiglu_bwd(dfl_be *be, void *dgu, const void *dout, const void *gu, int64_t R, int64_t I)
{ return DFL_EUNSUP; }
int dfl_cpu_dflash_attn(dfl_be *be, const dfl_dflash_attn *a) { return DFL_EUNSUP; }
int dfl_cpu_dflash_attn_bwd(dfl_be *be, const dfl_dflash_attn *a) { return DFL_EUNSUP; }
int dfl_cpu_lmce(dfl_be *be, const dfl_lmce *a) { return DFL_EUNSUP; }
int dfl_cpu_sumsq(dfl_be *be, double *out, const float *x, int64_t n) { return DFL_EUNSUP; }
int dfl_cpu_adamw(dfl_be *be, const dfl_adamw *a) { return DFL_EUNSUP; }
