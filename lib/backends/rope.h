/* rope.h: RoPE inverse frequencies with the scalings of Hugging Face configs (rope_type default,
 * linear, llama3, yarn), computed on the host in f32 as transformers computes them, for both
 * backends. The backend takes a model's scaling through dfl_be.rope_scaling (NULL: default). */
#ifndef DFL_ROPE_H
#define DFL_ROPE_H

#include <stdbool.h>

#include "dtype.h"

typedef enum dfl_rope_kind {
    DFL_ROPE_DEFAULT = 0, /* inv[i] = 1 / theta^(2i/d) */
    DFL_ROPE_LINEAR,      /* inv[i] / factor */
    DFL_ROPE_LLAMA3,      /* by wavelength band: kept, divided by factor, or blended between */
    DFL_ROPE_YARN,        /* ramp between interpolated and extrapolated; attention factor */
} dfl_rope_kind;

typedef struct dfl_rope_scaling {
    dfl_rope_kind kind;
    double factor;            /* linear, llama3, yarn */
    double low_freq_factor;   /* llama3 */
    double high_freq_factor;  /* llama3 */
    double original_max_pos;  /* llama3, yarn: original_max_position_embeddings */
    double beta_fast;         /* yarn (default 32) */
    double beta_slow;         /* yarn (default 1) */
    bool truncate;            /* yarn: floor/ceil the correction range (default true) */
    double attention_factor;  /* cos and sin are multiplied by it (1 but for yarn) */
} dfl_rope_scaling;

/* "default", "linear", "llama3", "yarn". */
const char *dfl_rope_kind_name(dfl_rope_kind k);

/* inv[i], i < d/2, for base theta and scaling rs (NULL: default), in f32 as transformers 5
 * computes them, then rounded to round_to when it is DFL_BF16 or DFL_F16 (dfl_be.rope_dtype). */
void dfl_rope_inv_freq_scaled(float *inv, int d, float theta, const dfl_rope_scaling *rs,
                              dfl_dtype round_to);

/* Same scaling (NULL and a default one are equal). */
bool dfl_rope_scaling_eq(const dfl_rope_scaling *a, const dfl_rope_scaling *b);

#endif
