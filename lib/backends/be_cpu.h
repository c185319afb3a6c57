/* be_cpu.h: internal to the CPU backend: the op functions, split over be_cpu.c (memory,
 * conversions, matmul), be_cpu_ops.c (forward ops of the target model), be_cpu_hybrid.c (the
 * ops of hybrid targets) and be_cpu_train.c (the
 * drafter's ops and backward ops). fp32 compute; OpenMP over rows. */
#ifndef DFL_BE_CPU_H
#define DFL_BE_CPU_H

#include <math.h>

#include "backend.h"

/* Run a loop on several threads only when it has enough work: on small shapes spinning up (and
 * spinning) OpenMP threads costs more than the work itself. */
#define PAR(work) ((int64_t)(work) >= ((int64_t)1 << 16))

/* RoPE of one row: the cosines and sines at position pos of the half = rot/2 frequencies inv,
 * then the rotation of the pairs (v[i], v[i + half]) of one head by them. */
static inline void dfl_cpu_rope_cs(float *c, float *s, int32_t pos, const float *inv, int half)
{
    for (int i = 0; i < half; i++) {
        float ang = (float)pos * inv[i];
        c[i] = cosf(ang);
        s[i] = sinf(ang);
    }
}

static inline void dfl_cpu_rope_rotate(float *v, const float *c, const float *s, int half)
{
    for (int i = 0; i < half; i++) {
        float x1 = v[i], x2 = v[i + half];
        v[i] = x1 * c[i] - x2 * s[i];
        v[i + half] = x2 * c[i] + x1 * s[i];
    }
}

/* be_cpu_ops.c */
int dfl_cpu_embedding(dfl_be *be, void *out, const int32_t *ids, const void *E, int64_t T, int64_t H);
int dfl_cpu_rmsnorm(dfl_be *be, void *y, float *rstd, const void *x, const void *w, int64_t R,
                    int64_t n, float eps);
int dfl_cpu_add_rmsnorm(dfl_be *be, void *h, const void *d, void *y, float *rstd, const void *w,
                        int64_t R, int64_t n, float eps);
int dfl_cpu_qknorm_rope(dfl_be *be, void *x, const void *src, int64_t ld, float *rstd, const void *w,
                        const int32_t *pos, int64_t R, int heads, int d, float eps, float theta);
int dfl_cpu_swiglu(dfl_be *be, void *out, const void *gu, int64_t R, int64_t I);
int dfl_cpu_add(dfl_be *be, void *y, const void *x, int64_t n);
int dfl_cpu_attn_varlen(dfl_be *be, const dfl_attn_varlen *a);

/* be_cpu_hybrid.c */
int dfl_cpu_rmsnorm_1p(dfl_be *be, void *y, const void *x, const void *w, int64_t R, int64_t n,
                       float eps);
int dfl_cpu_qknorm_rope_partial(dfl_be *be, void *x, int64_t ld, const void *w, const int32_t *pos,
                                int64_t R, int heads, int d, int rot, float eps, float theta);
int dfl_cpu_sigmoid_mul(dfl_be *be, void *x, int64_t ldx, const void *g, int64_t ldg, int64_t R,
                        int64_t n);
int dfl_cpu_conv1d_silu(dfl_be *be, void *y, int64_t ldy, const void *x, int64_t ldx,
                        const void *w, const int32_t *pos, int64_t T, int64_t C, int K);
int dfl_cpu_l2norm(dfl_be *be, void *x, int64_t ld, int64_t R, int heads, int d, float scale,
                   float eps);
int dfl_cpu_gated_rmsnorm(dfl_be *be, void *x, int64_t ldx, const void *z, int64_t ldz,
                          const void *w, int64_t R, int heads, int d, float eps);
int dfl_cpu_gated_delta(dfl_be *be, const dfl_gated_delta *a);
/* be_cpu_moe.c */
int dfl_cpu_moe_route(dfl_be *be, const dfl_moe_route *r);
int dfl_cpu_moe_gather(dfl_be *be, void *dst, const void *src, const int32_t *rows,
                       const int32_t *offsets, int E, int64_t cap, int64_t H);
int dfl_cpu_moe_matmul(dfl_be *be, const dfl_moe_mm *m);
int dfl_cpu_moe_combine(dfl_be *be, void *out, const void *y, const int32_t *slot,
                        const float *weight, int64_t T, int k, int64_t H, bool accumulate,
                        const void *shared, const float *shared_gate);

/* be_cpu_train.c */
int dfl_cpu_rmsnorm_bwd(dfl_be *be, void *dx, float *dw, const void *dy, const void *x,
                        const void *w, const float *rstd, int64_t R, int64_t n, bool accumulate_dx);
int dfl_cpu_qknorm_rope_bwd(dfl_be *be, void *dx, int64_t ld, float *dw, const void *x_in,
                            const void *w, const float *rstd, const int32_t *pos, int64_t R,
                            int heads, int d, float eps, float theta);
int dfl_cpu_swiglu_bwd(dfl_be *be, void *dgu, const void *dout, const void *gu, int64_t R, int64_t I);
int dfl_cpu_dflash_attn(dfl_be *be, const dfl_dflash_attn *a);
int dfl_cpu_dflash_attn_bwd(dfl_be *be, const dfl_dflash_attn *a);
int dfl_cpu_lmce(dfl_be *be, const dfl_lmce *a);
int dfl_cpu_sumsq(dfl_be *be, double *out, const float *x, int64_t n);
int dfl_cpu_clip_scale(dfl_be *be, float *out, int32_t *skip, const double *sums, float max_norm);
int dfl_cpu_block_metrics(dfl_be *be, double *out, const uint8_t *correct, const float *weight,
                          int64_t n_blocks, int bs);
int dfl_cpu_adamw(dfl_be *be, const dfl_adamw *a);
int dfl_cpu_uniform_noise(dfl_be *be, void *x, int64_t n, float amp, uint64_t seed);
int dfl_cpu_gather_rows(dfl_be *be, void *dst, const void *src, const int32_t *rows, int64_t n,
                        int64_t row_bytes);
int dfl_cpu_segment_sum(dfl_be *be, void *dst, const void *src, const int32_t *off, int64_t n,
                        int64_t w);
/* be_cpu_device.c: fills the device-plumbing ops of the table. */
void dfl_cpu_device_ops(dfl_be_ops *o);

#endif
