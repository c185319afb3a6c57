/* target_fwd.h: internal to the target model (lib/models/target.c and the files of its layer
 * kinds, such as gdn.c): the state of one batch's forward and the helpers each layer kind's
 * forward uses. Not part of the library's interface. */
#ifndef DFL_TARGET_FWD_H
#define DFL_TARGET_FWD_H

#include "target.h"

#define DFL_GDN_CHUNK 64 /* tokens per chunk of the gated delta rule */

/* One batch's forward: ws->h holds the residual stream; each mixer and the MLP add their output
 * to it (in the GEMM's epilogue when t->fuse_residual, else through ws->delta). */
typedef struct dfl_target_fwd {
    dfl_target *t;
    dfl_target_ws *ws;
    int64_t T, S;
    int32_t max_len;
} dfl_target_fwd;

/* Element pointer arithmetic on act buffers. */
static inline void *dfl_act_at(const void *p, int64_t elems, dfl_dtype dt)
{
    return (char *)p + (size_t)elems * dfl_dtype_size(dt);
}

/* C [T, N] (act) = A [T, K] (act) W^T (+ bias) (+ C when accumulate), W [N, K] (w). */
int dfl_target_linear(dfl_be *be, void *C, const void *A, const void *W, const float *bias,
                      int64_t T, int64_t N, int64_t K, bool accumulate);
/* The same over the batch's T rows, timed as a GEMM span under --profile. */
int dfl_target_fwd_linear(const dfl_target_fwd *f, void *C, const void *A, const void *W,
                          const float *bias, int64_t N, int64_t K);
/* h += A [T, K] W^T (+ bias), W [H, K]. */
int dfl_target_residual_linear(const dfl_target_fwd *f, const void *A, const void *W,
                               const float *bias, int64_t K);

/* Sizes of a Gated DeltaNet layer (qwen3_5 linear_attention). */
typedef struct dfl_gdn_dims {
    int64_t key_dim, value_dim, conv_dim; /* Hk dk, Hv dv, 2 key_dim + value_dim */
    int64_t n_in;                         /* rows of the fused in-projection: qkv | z | b | a */
} dfl_gdn_dims;

static inline dfl_gdn_dims dfl_gdn_dims_of(const dfl_hf_config *c)
{
    dfl_gdn_dims g;
    g.key_dim = c->lin_k_heads * c->lin_k_dim;
    g.value_dim = c->lin_v_heads * c->lin_v_dim;
    g.conv_dim = 2 * g.key_dim + g.value_dim;
    g.n_in = g.conv_dim + g.value_dim + 2 * c->lin_v_heads;
    return g;
}

/* target_prof.c: a span of --profile's timing around ops of kind DFL_TP_*; begin returns the
 * span's handle (-1 when the timing is off or failed), end closes it with its model FLOPs. */
int dfl_tp_begin(const dfl_target_fwd *f, int kind);
void dfl_tp_end(const dfl_target_fwd *f, int span, double flops);
/* end of a GEMM's span: 2 T N K FLOPs, counted under its shape too */
void dfl_tp_end_gemm(const dfl_target_fwd *f, int span, int64_t N, int64_t K, bool acc);
void dfl_target_prof_free(dfl_target *t);

/* gdn.c: a Gated DeltaNet layer's mixer over ws->x, added to ws->h. */
int dfl_gdn_forward(const dfl_target_fwd *f, const dfl_target_layer *w);

#endif
