/* golden_tol.h: the tolerances of dflash-golden's checks of counts and of the accuracy (their
 * ratio), shared with test-golden.c, which checks that they agree. One flipped argmax among the
 * golden's acc_den scored slots changes acc_num by 1 and the accuracy by 1 / acc_den: k flips must
 * be within both tolerances or within neither. */
#ifndef DFL_GOLDEN_TOL_H
#define DFL_GOLDEN_TOL_H

#include <math.h>
#include <stdbool.h>

/* Counts (acc_num, acc_den, per-slot counts): exact in float32; in bf16 2% of the scored slots
 * may differ (the smallest top-1/top-2 logit gap of the golden is 6e-3, within bf16 rounding). */
static inline double golden_count_tol(bool bf16, double acc_den)
{
    return bf16 ? ceil(0.02 * acc_den) : 0;
}

/* The accuracy: what the count tolerance allows, plus half a slot (so that count_tol + 1 flips
 * fail); in float32 at most 1e-6 (the rounding of the golden's stored ratio is far below it). */
static inline double golden_acc_tol(bool bf16, double acc_den)
{
    double c = golden_count_tol(bf16, acc_den);
    return c > 0 ? (c + 0.5) / acc_den : fmin(1e-6, 0.5 / acc_den);
}

#endif
