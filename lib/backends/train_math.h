/* train_math.h: the scalar arithmetic of the drafter's optimizer step that both backends run
 * (the CPU in be_cpu_train.c, the GPU in one thread of a kernel): one copy, so that their
 * results agree bit for bit. Header-only; C, and CUDA host/device code. */
#ifndef DFL_TRAIN_MATH_H
#define DFL_TRAIN_MATH_H

#include <math.h>
#include <stdint.h>

#include "backend.h"

#ifdef __CUDACC__
#define DFL_HOST_DEVICE __host__ __device__
#else
#define DFL_HOST_DEVICE
#endif

/* clip_scale (backend.h) from the step's sums: out[0] the gradient scale (clip coefficient /
 * loss denominator; 0 for a bad step), out[1] the gradient norm, out[2] the clip coefficient;
 * *skip 1 for a bad step (no weight, or a non-finite loss or norm). */
static inline DFL_HOST_DEVICE void dfl_clip_scale_calc(float *out, int32_t *skip, const double *sums,
                                                       float max_norm)
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

#endif
