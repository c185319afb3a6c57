/* gdn.c: the Gated DeltaNet layer of hybrid targets (Qwen3.5 / Qwen3.6 linear_attention), as
 * transformers' Qwen3_5GatedDeltaNet computes it, written against the backend's ops: the fused
 * in-projection (in_proj_qkv | in_proj_z | in_proj_b | in_proj_a), the causal depthwise conv1d +
 * SiLU over each sequence, q and k L2-normalised (q scaled by dk^-0.5), the chunked gated delta
 * rule with its state zero at the start of every sequence (backend.h, dfl_gated_delta), the
 * gated RMSNorm w rmsnorm(o) silu(z) per value head, and out_proj added to the residual stream.
 * The weights are loaded by target.c (dfl_target_layer's Gated DeltaNet fields). */
#include <math.h>

#include "target_fwd.h"

/* Gated DeltaNet over x (qwen3_5 linear_attention): in-projection, causal conv1d + SiLU per
 * sequence, L2-normalised q and k, the chunked gated delta rule, gated RMSNorm, out_proj. */
int dfl_gdn_forward(const dfl_target_fwd *f, const dfl_target_layer *w)
{
    dfl_target *t = f->t;
    dfl_be *be = t->be;
    const dfl_be_ops *ops = be->ops;
    const dfl_hf_config *c = &t->cfg;
    dfl_target_ws *ws = f->ws;
    dfl_gdn_dims g = dfl_gdn_dims_of(c);
    int64_t H = c->hidden_size, T = f->T, Hv = c->lin_v_heads;
    int Hk = (int)c->lin_k_heads, dk = (int)c->lin_k_dim, dv = (int)c->lin_v_dim;
    dfl_dtype act = be->act;
    void *in = ws->big1;    /* [T, n_in]: qkv | z | b | a */
    void *qkv = ws->big2;   /* [T, conv_dim]: q | k | v after the conv */
    int rc;
    if ((rc = dfl_target_fwd_linear(f, in, ws->x, w->w_in, NULL, g.n_in, H)) ||
        (rc = ops->conv1d_silu(be, qkv, g.conv_dim, in, g.n_in, w->conv_w, ws->pos, T, g.conv_dim,
                               (int)c->lin_conv)) ||
        (rc = ops->l2norm(be, qkv, g.conv_dim, T, Hk, dk, (float)(1.0 / sqrt((double)dk)), 1e-6f)) ||
        (rc = ops->l2norm(be, dfl_act_at(qkv, g.key_dim, act), g.conv_dim, T, Hk, dk, 1.0f, 1e-6f)))
        return rc;
    dfl_gated_delta gd = {
        .q = qkv, .k = dfl_act_at(qkv, g.key_dim, act), .ldqk = g.conv_dim,
        .v = dfl_act_at(qkv, 2 * g.key_dim, act), .ldv = g.conv_dim,
        .b = dfl_act_at(in, g.conv_dim + g.value_dim, act),
        .a = dfl_act_at(in, g.conv_dim + g.value_dim + Hv, act), .ldab = g.n_in, .A_log = w->A_log, .dt_bias = w->dt_bias,
        .o = ws->lin, .ldo = g.value_dim,
        .cu_seqlens = ws->cu, .n_seqs = (int32_t)f->S, .max_len = f->max_len, .T = T,
        .Hk = Hk, .Hv = (int)Hv, .dk = dk, .dv = dv, .chunk = DFL_GDN_CHUNK,
    };
    int span = dfl_tp_begin(f, DFL_TP_DELTA);
    rc = ops->gated_delta(be, &gd);
    dfl_tp_end(f, span, dfl_target_delta_flops(c, T));
    if (rc ||
        (rc = ops->gated_rmsnorm(be, ws->lin, g.value_dim, dfl_act_at(in, g.conv_dim, act), g.n_in,
                                 w->gdn_norm, T, (int)Hv, dv, (float)c->rms_norm_eps)))
        return rc;
    return dfl_target_residual_linear(f, ws->lin, w->w_out, NULL, g.value_dim);
}
