/* be_math.h: the scalar arithmetic of the optimizer step that the CPU backend
 * (lib/backends/be_cpu_train.c) and the CUDA kernels (kernels/train_kernels.cuh) share, written
 * once: the clip scale, AdamW's scalars and its update of one element, and the counter-based
 * uniform noise. Plain C, compiled by cc for the CPU and by nvcc for the device (DFL_HD); tests/emu
 * compiles it with g++. Every operation is rounded to f32 once, in the order written: the device
 * code uses the _rn intrinsics, which nvcc never contracts into FMAs, and the C build (x86-64
 * without FMA, tests/emu with -ffp-contract=off) does not contract either, so that both backends
 * agree bit for bit. */
#ifndef DFL_BE_MATH_H
#define DFL_BE_MATH_H

#include <math.h>
#include <stdint.h>

#include "backend.h"

#if defined(__CUDACC__)
#define DFL_HD __host__ __device__
#else
#define DFL_HD
#endif

/* f32 operations rounded once each */
#if defined(__CUDA_ARCH__)
#define DFL_FMUL(a, b) __fmul_rn((a), (b))
#define DFL_FADD(a, b) __fadd_rn((a), (b))
#define DFL_FSUB(a, b) __fsub_rn((a), (b))
#define DFL_FDIV(a, b) __fdiv_rn((a), (b))
#define DFL_FSQRT(a) __fsqrt_rn(a)
#else
#define DFL_FMUL(a, b) ((a) * (b))
#define DFL_FADD(a, b) ((a) + (b))
#define DFL_FSUB(a, b) ((a) - (b))
#define DFL_FDIV(a, b) ((a) / (b))
#define DFL_FSQRT(a) sqrtf(a)
#endif

/* clip_scale (backend.h) from the step's sums: out[0] = coef / loss_den, the scale of the summed
 * gradients (0 for a skipped step), out[1] = the gradient norm sqrt(grad_sq) / loss_den, out[2] =
 * coef = min(1, max_norm / (norm + 1e-6)) (1 when max_norm <= 0); *skip = 1 when the step is
 * skipped: no scored tokens, or a non-finite loss or norm. In double. */
static inline DFL_HD void dfl_clip_scale_of(float *out, int32_t *skip, const double *sums, float max_norm)
{
    double den = sums[DFL_SUM_LOSS_DEN];
    double norm = sqrt(sums[DFL_SUM_GRAD_SQ]) / den;
    int bad = !(den > 0) || !isfinite(sums[DFL_SUM_LOSS_NUM]) || !isfinite(norm);
    double coef = 1.0;
    if (max_norm > 0 && !bad) {
        coef = (double)max_norm / (norm + 1e-6);
        if (coef > 1.0)
            coef = 1.0;
    }
    out[0] = bad ? 0.0f : (float)(coef / den);
    out[1] = (float)norm;
    out[2] = (float)coef;
    *skip = bad;
}

/* AdamW's scalars for one step (see dfl_adamw in backend.h) */
typedef struct dfl_adam_scalars {
    float decay;     /* 1 - lr wd */
    float b1w;       /* 1 - b1 */
    float b2, b2w;   /* b2, 1 - b2 */
    float eps;
    float step_size; /* lr / (1 - b1^t), computed in double */
    float bc2_sqrt;  /* sqrt(1 - b2^t), computed in double */
} dfl_adam_scalars;

/* The scalars of step t (>= 1) of a's update; on the host. */
static inline dfl_adam_scalars dfl_adam_scalars_at(const dfl_adamw *a, int64_t t)
{
    const double bc1 = 1.0 - pow((double)a->beta1, (double)t);
    const double bc2 = 1.0 - pow((double)a->beta2, (double)t);
    dfl_adam_scalars c;
    c.step_size = (float)((double)a->lr / bc1);
    c.bc2_sqrt = (float)sqrt(bc2);
    c.decay = 1.0f - a->lr * a->weight_decay;
    c.b1w = 1.0f - a->beta1;
    c.b2 = a->beta2;
    c.b2w = 1.0f - a->beta2;
    c.eps = a->eps;
    return c;
}

/* AdamW on one element, in this order, each operation rounded to f32:
 *   gi = g * gs;  pi = p * decay;  mi = m + b1w * (gi - m);  vi = v * b2 + (b2w * gi) * gi;
 *   denom = sqrt(vi) / bc2_sqrt + eps;  p = pi - step_size * (mi / denom)
 * Updates *p, *m, *v; returns the new p. */
static inline DFL_HD float dfl_adamw_one(float *p, float *m, float *v, float g, float gs,
                                         const dfl_adam_scalars *c)
{
    float gi = DFL_FMUL(g, gs);
    float pi = DFL_FMUL(*p, c->decay);
    float mi = DFL_FADD(*m, DFL_FMUL(c->b1w, DFL_FSUB(gi, *m)));
    float vi = DFL_FADD(DFL_FMUL(*v, c->b2), DFL_FMUL(DFL_FMUL(c->b2w, gi), gi));
    float denom = DFL_FADD(DFL_FDIV(DFL_FSQRT(vi), c->bc2_sqrt), c->eps);
    pi = DFL_FSUB(pi, DFL_FMUL(c->step_size, DFL_FDIV(mi, denom)));
    *p = pi;
    *m = mi;
    *v = vi;
    return pi;
}

/* The counter-based uniform generator of uniform_noise (the same numbers on every backend):
 * z = splitmix64(seed + (i + 1) * 0x9E3779B97F4A7C15) (the splitmix64 output function),
 * u = (z >> 40) * 2^-24 in [0, 1). */
static inline DFL_HD float dfl_noise_u01(uint64_t seed, uint64_t i)
{
    uint64_t z = seed + (i + 1) * 0x9E3779B97F4A7C15ull;
    z = (z ^ (z >> 30)) * 0xBF58476D1CE4E5B9ull;
    z = (z ^ (z >> 27)) * 0x94D049BB133111EBull;
    z ^= z >> 31;
    return (float)(z >> 40) * (1.0f / 16777216.0f);
}

/* What uniform_noise adds to element i: amp * (2 u_i - 1). */
static inline DFL_HD float dfl_noise_add(uint64_t seed, uint64_t i, float amp)
{
    return DFL_FMUL(amp, DFL_FSUB(DFL_FMUL(2.0f, dfl_noise_u01(seed, i)), 1.0f));
}

#endif
