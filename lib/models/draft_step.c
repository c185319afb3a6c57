/* draft_step.c: the DFlash drafter's math (doc/dflash-step.md sections 3-5), written against the
 * backend ops only: the forward of a packed batch (context features, the layers, the final norm,
 * the LM head and the loss on the scored rows), its backward, and the optimizer step (gradient
 * norm, clipping, AdamW) with the learning-rate schedule. The buffers are the workspace's
 * (draft_workspace.c); the step's inputs are the input set's (draft_stage.c). */
#include "draft_int.h"

#include <math.h>
#include <string.h>

#include "log.h"

/* TRY of an op of kind k (DFL_DP_*) that does fl FLOPs, timed under --profile */
#define OPF(k, fl, x)                                                                          \
    do {                                                                                       \
        int sp_ = dfl_span_begin(m->prof, k);                                                  \
        TRY(x);                                                                                \
        dfl_span_end(m->prof, sp_, fl);                                                        \
    } while (0)
#define EW(x) OPF(DFL_DP_EW, 0, x)
#define OPT(x) OPF(DFL_DP_OPT, 0, x)

/* In a tuning warm-up (dfl_draft_set_tune): times the algorithms of x's shape once (a later
 * product of the same shape reuses the choice; the products it runs write C, which the warm-up
 * step overwrites or discards). */
static int tune_once(dfl_draft *m, const dfl_mm *x)
{
    const int64_t key[12] = {x->M, x->N, x->K, x->lda, x->ldb, x->ldc, x->ta, x->tb,
                             x->adt, x->bdt, x->cdt, x->beta != 0.0f};
    for (int i = 0; i < m->n_tuned; i++)
        if (!memcmp(m->tuned[i], key, sizeof key))
            return DFL_OK;
    if (m->n_tuned == (int)(sizeof m->tuned / sizeof m->tuned[0]))
        return DFL_OK;
    memcpy(m->tuned[m->n_tuned++], key, sizeof key);
    dfl_err e = {0};
    float best = 0, first = 0;
    int rc = m->be->ops->matmul_tune(m->be, x, 16, 4, &best, &first, &e);
    if (rc)
        return rc;
    if (best > 0)
        dfl_verbose("tune %lldx%lldx%lld%s%s: cuBLASLt's first choice %.3f ms, the fastest %.3f ms (a call, sustained)",
                    (long long)x->M, (long long)x->N, (long long)x->K, x->ta ? " A^T" : "",
                    x->beta != 0.0f ? " +C" : "", first, best);
    return DFL_OK;
}

/* C = alpha op(A) op(B) + beta C (or + beta cin, when cin is not NULL) with the model's dtypes;
 * tag (DFL_DP_TAG_*) says which product of a weight it is, for --profile: the forward (the weight
 * is N x K), its input gradient (K x N) or its weight gradient (M x N). */
static int mm(dfl_draft *m, int tag, int64_t M, int64_t N, int64_t K, const void *A, dfl_dtype adt,
              int64_t lda, bool ta, const void *B, dfl_dtype bdt, int64_t ldb, bool tb, void *C,
              dfl_dtype cdt, int64_t ldc, float beta, const void *cin)
{
    dfl_mm x = {.M = M, .N = N, .K = K, .A = A, .adt = adt, .lda = lda, .ta = ta, .B = B,
                .bdt = bdt, .ldb = ldb, .tb = tb, .C = C, .cdt = cdt, .ldc = ldc,
                .alpha = 1.0f, .beta = beta, .Cin = cin};
    if (m->tuning) {
        int rc = tune_once(m, &x);
        if (rc)
            return rc;
    }
    int sp = dfl_span_begin(m->prof, tag == DFL_DP_TAG_FWD ? DFL_DP_GEMM_FWD : DFL_DP_GEMM_BWD);
    int rc = m->be->ops->matmul(m->be, &x);
    dfl_span_end_shape(m->prof, sp, tag == DFL_DP_TAG_DW ? M : tag == DFL_DP_TAG_DX ? K : N,
                       tag == DFL_DP_TAG_FWD ? K : N, tag, 2.0 * (double)M * (double)N * (double)K);
    return rc;
}

/* y [rows, out] = x [rows, in] W^T (+ res [rows, out] when res is not NULL), W = weight tensor
 * at offset off, [out, in] */
static int linear(dfl_draft *m, void *y, const void *x, int64_t rows, int64_t off, int64_t out,
                  int64_t in, const void *res)
{
    dfl_dtype act = m->be->act, wdt = m->be->wdt;
    const void *W = (const char *)m->wts + off * dfl_dtype_size(wdt);
    return mm(m, DFL_DP_TAG_FWD, rows, out, in, x, act, in, false, W, wdt, in, true, y, act, out,
              res ? 1.0f : 0.0f, res);
}

/* dW [out, in] (= or +=) dy^T x over rows: the first product of a weight's gradient in a step
 * sets it (beta 0: no zeroing before, no read of it), a second adds */
static int linear_dw(dfl_draft *m, int64_t off, const void *dy, const void *x, int64_t rows,
                     int64_t out, int64_t in, float beta)
{
    dfl_dtype act = m->be->act;
    return mm(m, DFL_DP_TAG_DW, out, in, rows, dy, act, out, true, x, act, in, false, m->grad + off,
              DFL_F32, in, beta, NULL);
}

/* dx [rows, in] (= or +=) dy [rows, out] W */
static int linear_dx(dfl_draft *m, void *dx, const void *dy, int64_t rows, int64_t off, int64_t out,
                     int64_t in, float beta)
{
    dfl_dtype act = m->be->act, wdt = m->be->wdt;
    const void *W = (const char *)m->wts + off * dfl_dtype_size(wdt);
    return mm(m, DFL_DP_TAG_DX, rows, in, out, dy, act, out, false, W, wdt, in, false, dx, act, in, beta,
              NULL);
}

static inline void *W(dfl_draft *m, int64_t off) { return (char *)m->wts + off * dfl_dtype_size(m->be->wdt); }
static inline void *ACT(dfl_draft *m, void *base, int64_t rows_off, int64_t width)
{
    return (char *)base + rows_off * width * (int64_t)dfl_dtype_size(m->be->act);
}

/* The sizes of the step being run. */
typedef struct step_dims {
    int64_t T, Q, Qs;      /* context rows (tokens), block rows (n_blocks * bs), scored rows
                            * (n_blocks * (bs - 1): see scored_rows) */
    int64_t H, I, NQ, NK;  /* hidden, MLP, query and key/value widths */
    size_t as;             /* bytes of an activation */
    float eps, theta;
} step_dims;

static step_dims dims_of(const dfl_draft *m)
{
    const dfl_draft_config *c = &m->c;
    return (step_dims){
        .T = m->T, .Q = m->Q, .Qs = m->B * (c->block_size - 1), .H = c->hidden, .I = c->intermediate,
        .NQ = (int64_t)c->n_heads * c->head_dim, .NK = (int64_t)c->n_kv * c->head_dim,
        .as = dfl_dtype_size(m->be->act), .eps = (float)c->rms_eps, .theta = (float)c->rope_theta,
    };
}

/* The DFlash attention of layer l over the step's blocks (the forward's arguments; the backward
 * adds its own). Keys and values are [context rows | block rows]. */
static dfl_dflash_attn layer_attn(dfl_draft *m, int l)
{
    const dfl_draft_config *c = &m->c;
    const layer_acts *a = &m->la[l];
    const int64_t T = m->T, NK = (int64_t)c->n_kv * c->head_dim;
    return (dfl_dflash_attn){
        .q = a->q, .k_ctx = a->k, .v_ctx = a->v, .k_blk = ACT(m, a->k, T, NK),
        .v_blk = ACT(m, a->v, T, NK), .o = a->o, .lse = a->lse, .ctx_start = m->in.ctx_start,
        .anchor = m->in.anchor, .ctx_start_host = m->h_in.ctx_start, .anchor_host = m->h_in.anchor,
        .n_blocks = (int32_t)m->B, .bs = c->block_size,
        .max_anchor = (int32_t)T, .window = c->sliding[l] ? (int32_t)c->sliding_window : 0,
        .T_ctx = T, .n_heads = c->n_heads, .n_kv = c->n_kv, .d = c->head_dim,
        .scale = 1.0f / sqrtf((float)c->head_dim),
    };
}

/* --profile's count of the attention's model FLOPs of a layer over this step's blocks: 4 d for
 * each query row, head and key it sees under the mask of window W (0: full attention;
 * doc/dflash-step.md); the backward is counted as 2.5 times the forward. */
static double attn_flops(const dfl_draft *m, int64_t W)
{
    const dfl_draft_config *c = &m->c;
    double keys = 0;
    for (int64_t b = 0; b < m->B; b++) {
        const int64_t a = m->h_in.anchor[b];
        for (int j = 0; j < c->block_size; j++) {
            int64_t lo = W > 0 ? a + j - (W - 1) : 0;
            lo = lo < 0 ? 0 : lo;
            keys += (double)(a > lo ? a - lo : 0) + (double)(W > 0 ? j + 1 : c->block_size);
        }
    }
    return 4.0 * (double)c->head_dim * (double)c->n_heads * keys;
}

/* y [Q, out] = x W^T at the step's block rows (W at offset off, [out, in]). With pairs (the first
 * layer: see pair_rows), x holds the pair rows only ([2B, in]): the product is made into tmp
 * [2B, out] and spread over the rows. A block's rows at slots 1..bs-1 hold the same input there,
 * so each gets what a product over every row would give it. */
static int block_linear(dfl_draft *m, bool pairs, void *y, const void *x, void *tmp, int64_t off,
                        int64_t out, int64_t in)
{
    if (!pairs)
        return linear(m, y, x, m->Q, off, out, in, NULL);
    int rc = linear(m, tmp, x, 2 * m->B, off, out, in, NULL);
    if (!rc) {
        int sp = dfl_span_begin(m->prof, DFL_DP_EW);
        rc = m->be->ops->gather_rows(m->be, y, tmp, m->row_pair, m->Q,
                                     out * (int64_t)dfl_dtype_size(m->be->act));
        dfl_span_end(m->prof, sp, 0);
    }
    return rc;
}

/* Layer l: la[l].hin -> hout, keeping what the backward needs in la[l].
 *
 * The last layer is cut after its attention: only the rows of block slots 1..bs-1 (the scored
 * rows, see scored_rows) go through its output projection, its MLP and the final norm. Its slot-0
 * rows are still needed up to there (they are keys and values of their block), but their output
 * reaches only the LM head's slot 0, which is never scored, so it can change neither the loss
 * nor a gradient. Their attention output (a->o) and the residual are gathered (m->os, and dx,
 * free until the final norm); hout has the Qs scored rows. */
static int layer_forward(dfl_draft *m, int l, void *hout, dfl_err *e)
{
    dfl_be *be = m->be;
    const dfl_draft_config *c = &m->c;
    const layer_w *w = &m->lw[l];
    layer_acts *a = &m->la[l];
    const step_dims d = dims_of(m);
    const bool last = l == c->n_layers - 1;
    const int64_t R = last ? d.Qs : d.Q;   /* the rows after attention */

    /* The first layer's block rows: 2 distinct rows a block (see pair_rows). Its input norm runs
     * at those (gathered into dx, free until the last layer; x and rstd kept for the pair rows
     * only), and its products are made into dq, dk and dv (free until the backward) and spread
     * over the rows. */
    const bool pairs = l == 0;
    if (pairs) {
        EW(be->ops->gather_rows(be, m->dx, a->hin, m->pair_rows, 2 * m->B, d.H * (int64_t)d.as));
        EW(be->ops->rmsnorm(be, a->x, a->rstd1, m->dx, W(m, w->in_ln), 2 * m->B, d.H, d.eps));
    } else {
        EW(be->ops->rmsnorm(be, a->x, a->rstd1, a->hin, W(m, w->in_ln), d.Q, d.H, d.eps));
    }
    /* queries */
    TRY(block_linear(m, pairs, a->qraw, a->x, m->dq, w->wq, d.NQ, d.H));
    EW(be->ops->qknorm_rope(be, a->q, a->qraw, d.NQ, a->rstdq, W(m, w->q_norm), m->in.pos + d.T,
                             d.Q, c->n_heads, c->head_dim, d.eps, d.theta));
    /* keys and values: rows [context | block slots] */
    TRY(linear(m, a->kraw, m->C, d.T, w->wk, d.NK, d.H, NULL));
    TRY(block_linear(m, pairs, ACT(m, a->kraw, d.T, d.NK), a->x, m->dk, w->wk, d.NK, d.H));
    EW(be->ops->qknorm_rope(be, a->k, a->kraw, d.NK, a->rstdk, W(m, w->k_norm), m->in.pos,
                             d.T + d.Q, c->n_kv, c->head_dim, d.eps, d.theta));
    TRY(linear(m, a->v, m->C, d.T, w->wv, d.NK, d.H, NULL));
    TRY(block_linear(m, pairs, ACT(m, a->v, d.T, d.NK), a->x, m->dv, w->wv, d.NK, d.H));
    const dfl_dflash_attn at = layer_attn(m, l);
    OPF(DFL_DP_ATTN_FWD, m->attn_fl[c->sliding[l] ? 1 : 0], be->ops->dflash_attn(be, &at));
    /* residual + MLP (the products add the residual as they write) */
    const void *o = a->o, *res = a->hin;
    if (last) {
        EW(be->ops->gather_rows(be, m->os, a->o, m->scored_rows, R, d.NQ * (int64_t)d.as));
        EW(be->ops->gather_rows(be, m->dx, a->hin, m->scored_rows, R, d.H * (int64_t)d.as));
        o = m->os;
        res = m->dx;
    }
    TRY(linear(m, a->hmid, o, R, w->wo, d.H, d.NQ, res));
    EW(be->ops->rmsnorm(be, a->y, a->rstd2, a->hmid, W(m, w->post_ln), R, d.H, d.eps));
    TRY(linear(m, a->gu, a->y, R, w->wgu, 2 * d.I, d.H, NULL));
    EW(be->ops->swiglu(be, a->act, a->gu, R, d.I));
    TRY(linear(m, hout, a->act, R, w->wdown, d.H, d.I, a->hmid));
    return DFL_OK;
}

/* The first layer's queries, keys and values, backward (the end of layer_backward for l = 0;
 * at->dq, dk_blk, dv_blk hold the gradients at every block row). Its block rows have 2 distinct
 * inputs a block (see pair_rows): x at slot 0 and the mask token's x at the others. So each
 * weight's gradient over the block rows, sum_r dy_r x_r^T, is a product over the 2B pair rows
 * with dy at pair row 2b+1 the sum of the block's slots 1..bs-1 (segment_sum, in f32); likewise
 * the input norm's weight gradient, sum_r dx_r * x_r rstd_r, with dx at the pair rows (dx is
 * linear in dy). The layer's input gradient is not made: the embeddings are frozen, so nothing
 * reads it (dh is left as scratch). x and rstd are the pair rows' (layer_forward); scratch, free
 * after the attention's backward: each sum in turn in dout or dq (after its own sum), the pair
 * rows' h in dh. */
static int layer0_qkv_backward(dfl_draft *m, const dfl_dflash_attn *at, dfl_err *e)
{
    dfl_be *be = m->be;
    const layer_w *w = &m->lw[0];
    layer_acts *a = &m->la[0];
    const step_dims d = dims_of(m);
    const int64_t P = 2 * m->B;
    EW(be->ops->segment_sum(be, m->dout, m->dq, m->pair_rows, P, d.NQ));
    TRY(linear_dw(m, w->wq, m->dout, a->x, P, d.NQ, d.H, 0.0f));
    TRY(linear_dx(m, m->dx, m->dout, P, w->wq, d.NQ, d.H, 0.0f));
    EW(be->ops->segment_sum(be, m->dq, at->dk_blk, m->pair_rows, P, d.NK));
    TRY(linear_dw(m, w->wk, m->dq, a->x, P, d.NK, d.H, 0.0f));
    TRY(linear_dw(m, w->wk, m->dk, m->C, d.T, d.NK, d.H, 1.0f));
    TRY(linear_dx(m, m->dx, m->dq, P, w->wk, d.NK, d.H, 1.0f));
    EW(be->ops->segment_sum(be, m->dout, at->dv_blk, m->pair_rows, P, d.NK));
    TRY(linear_dw(m, w->wv, m->dout, a->x, P, d.NK, d.H, 0.0f));
    TRY(linear_dw(m, w->wv, m->dv, m->C, d.T, d.NK, d.H, 1.0f));
    TRY(linear_dx(m, m->dx, m->dout, P, w->wv, d.NK, d.H, 1.0f));
    TRY(linear_dx(m, m->dC, m->dk, d.T, w->wk, d.NK, d.H, 1.0f));
    TRY(linear_dx(m, m->dC, m->dv, d.T, w->wv, d.NK, d.H, 1.0f));
    EW(be->ops->gather_rows(be, m->dh, a->hin, m->pair_rows, P, d.H * (int64_t)d.as));
    EW(be->ops->rmsnorm_bwd(be, m->dx, m->grad + w->in_ln, m->dx, m->dh, W(m, w->in_ln),
                             a->rstd1, P, d.H, false));
    return DFL_OK;
}

/* On entry m->dh = dL/d(output of layer l) (the last layer: m->dx, at its scored rows only; see
 * layer_forward); on exit m->dh = dL/d(input of layer l) (not for the first layer: see
 * layer0_qkv_backward). dC accumulates. */
static int layer_backward(dfl_draft *m, int l, dfl_err *e)
{
    dfl_be *be = m->be;
    const dfl_draft_config *c = &m->c;
    const layer_w *w = &m->lw[l];
    layer_acts *a = &m->la[l];
    const step_dims d = dims_of(m);
    const bool last = l == c->n_layers - 1;
    const int64_t R = last ? d.Qs : d.Q;   /* the rows after attention */
    void *dho = last ? m->dx : m->dh;   /* dL/d(output), then dL/d(hmid) */
    void *dy = last ? m->dh : m->dx;    /* dL/d(y) */

    /* MLP: h_out = hmid + act Wdown^T */
    TRY(linear_dx(m, m->dact, dho, R, w->wdown, d.H, d.I, 0.0f));
    TRY(linear_dw(m, w->wdown, dho, a->act, R, d.H, d.I, 0.0f));
    EW(be->ops->swiglu_bwd(be, m->dgu, m->dact, a->gu, R, d.I));
    TRY(linear_dw(m, w->wgu, m->dgu, a->y, R, 2 * d.I, d.H, 0.0f));
    TRY(linear_dx(m, dy, m->dgu, R, w->wgu, 2 * d.I, d.H, 0.0f));
    EW(be->ops->rmsnorm_bwd(be, dho, m->grad + w->post_ln, dy, a->hmid, W(m, w->post_ln),
                             a->rstd2, R, d.H, true));
    /* attention: hmid = hin + o Wo^T. The last layer's dL/d(o) at the scored rows goes to dq
     * (free until the attention's backward) and is spread over the rows, 0 at slot 0, as is
     * dL/d(hmid) into dh, the residual's gradient. */
    if (last) {
        TRY(linear_dx(m, m->dq, dho, R, w->wo, d.H, d.NQ, 0.0f));
        TRY(linear_dw(m, w->wo, dho, m->os, R, d.H, d.NQ, 0.0f));
        EW(be->ops->gather_rows(be, m->dout, m->dq, m->row_scored, d.Q, d.NQ * (int64_t)d.as));
        EW(be->ops->gather_rows(be, m->dh, dho, m->row_scored, d.Q, d.H * (int64_t)d.as));
    } else {
        TRY(linear_dx(m, m->dout, m->dh, d.Q, w->wo, d.H, d.NQ, 0.0f));
        TRY(linear_dw(m, w->wo, m->dh, a->o, d.Q, d.H, d.NQ, 0.0f));
    }
    dfl_dflash_attn at = layer_attn(m, l);
    at.dout = m->dout;
    at.delta = m->delta;
    at.dq = m->dq;
    at.dk_ctx = m->dk;
    at.dv_ctx = m->dv;
    at.dk_blk = ACT(m, m->dk, d.T, d.NK);
    at.dv_blk = ACT(m, m->dv, d.T, d.NK);
    OPF(DFL_DP_ATTN_BWD, 2.5 * m->attn_fl[c->sliding[l] ? 1 : 0], be->ops->dflash_attn_bwd(be, &at));
    EW(be->ops->qknorm_rope_bwd(be, m->dq, d.NQ, m->grad + w->q_norm, a->qraw, W(m, w->q_norm),
                                 a->rstdq, m->in.pos + d.T, d.Q, c->n_heads, c->head_dim, d.eps,
                                 d.theta));
    EW(be->ops->qknorm_rope_bwd(be, m->dk, d.NK, m->grad + w->k_norm, a->kraw, W(m, w->k_norm),
                                 a->rstdk, m->in.pos, d.T + d.Q, c->n_kv, c->head_dim, d.eps,
                                 d.theta));
    if (l == 0)
        return layer0_qkv_backward(m, &at, e);
    const void *dk_blk = at.dk_blk, *dv_blk = at.dv_blk;
    TRY(linear_dw(m, w->wq, m->dq, a->x, d.Q, d.NQ, d.H, 0.0f));
    TRY(linear_dw(m, w->wk, dk_blk, a->x, d.Q, d.NK, d.H, 0.0f));
    TRY(linear_dw(m, w->wk, m->dk, m->C, d.T, d.NK, d.H, 1.0f));
    TRY(linear_dw(m, w->wv, dv_blk, a->x, d.Q, d.NK, d.H, 0.0f));
    TRY(linear_dw(m, w->wv, m->dv, m->C, d.T, d.NK, d.H, 1.0f));
    TRY(linear_dx(m, m->dx, m->dq, d.Q, w->wq, d.NQ, d.H, 0.0f));
    TRY(linear_dx(m, m->dx, dk_blk, d.Q, w->wk, d.NK, d.H, 1.0f));
    TRY(linear_dx(m, m->dx, dv_blk, d.Q, w->wv, d.NK, d.H, 1.0f));
    TRY(linear_dx(m, m->dC, m->dk, d.T, w->wk, d.NK, d.H, 1.0f));
    TRY(linear_dx(m, m->dC, m->dv, d.T, w->wv, d.NK, d.H, 1.0f));
    EW(be->ops->rmsnorm_bwd(be, m->dh, m->grad + w->in_ln, m->dx, a->hin, W(m, w->in_ln),
                             a->rstd1, d.Q, d.H, true));
    return DFL_OK;
}

/* The features of captured layer j (act [T, H]). */
static const void *feat_j(dfl_draft *m, int j)
{
    return (const char *)m->in.feat + (size_t)j * (size_t)(m->T * m->c.hidden) * dfl_dtype_size(m->be->act);
}

int dfl_draft_forward(dfl_draft *m, bool want_grad, dfl_err *e)
{
    dfl_be *be = m->be;
    const dfl_draft_config *c = &m->c;
    const step_dims d = dims_of(m);
    const int64_t T = d.T, Q = d.Q, H = d.H, ldfc = (int64_t)c->n_feat * H;
    EW(be->ops->memset0(be, m->sums, DFL_SUM_COUNT * sizeof(double)));
    EW(be->ops->memset0(be, m->bmet, (size_t)(2 * c->block_size + 2) * sizeof(double)));

    /* context features: C = hidden_norm(sum_j feat_j fc[:, jH:(j+1)H]^T), one GEMM per layer */
    for (int j = 0; j < c->n_feat; j++)
        TRY(mm(m, DFL_DP_TAG_FWD, T, H, H, feat_j(m, j), be->act, H, false, W(m, m->off_fc + (int64_t)j * H),
               be->wdt, ldfc, true, m->cpre, be->act, H, j == 0 ? 0.0f : 1.0f, NULL));
    EW(be->ops->rmsnorm(be, m->C, m->rstdc, m->cpre, W(m, m->off_hnorm), T, H, d.eps));
    if (Q == 0)
        return DFL_OK;

    /* --profile: the attention's FLOPs of a full and of a sliding layer, once a step */
    if (m->prof && m->h_in.anchor) {
        m->attn_fl[0] = attn_flops(m, 0);
        m->attn_fl[1] = c->sliding_window > 0 ? attn_flops(m, c->sliding_window) : 0;
    }
    /* the blocks: embeddings, the layers, the final norm */
    EW(be->ops->embedding(be, m->la[0].hin, m->in.tok, m->embed, Q, H));
    for (int l = 0; l < c->n_layers; l++) {
        int rc = layer_forward(m, l, l + 1 < c->n_layers ? m->la[l + 1].hin : m->hL, e);
        if (rc)
            return rc;
    }

    /* The final norm, the LM head and the loss on the scored rows only (see scored_rows; hL has
     * only them): z = norm(hL) into dx (free until the backward), the gradient at z into dh. */
    const int64_t Qs = d.Qs;
    EW(be->ops->rmsnorm(be, m->dx, m->rstd_s, m->hL, W(m, m->off_norm), Qs, H, d.eps));
    const dfl_lmce lm = {
        .z = m->dx, .w_lm = m->lm_head, .labels = m->labels_s, .weight = m->weight_s, .Q = Qs,
        .H = H, .V = c->vocab, .sums = m->sums, .correct = m->correct_s, .ce_out = m->ce,
        .dz = want_grad ? m->dh : NULL, .grad_scale = 1.0f, .work = m->lm_work,
        .chunk_rows = m->chunk, .tune = m->tuning,
    };
    EW(be->ops->gather_rows(be, m->labels_s, m->in.labels, m->scored_rows, Qs, 4));
    EW(be->ops->gather_rows(be, m->weight_s, m->in.weight, m->scored_rows, Qs, 4));
    const double lm_flops = (want_grad ? 4.0 : 2.0) * (double)Qs * (double)H * (double)c->vocab;
    OPF(DFL_DP_LMCE, lm_flops, be->ops->lmce(be, &lm));
    EW(be->ops->gather_rows(be, m->correct, m->correct_s, m->row_scored, Q, 1));
    EW(be->ops->block_metrics(be, m->bmet, m->correct, m->in.weight, m->B, c->block_size));
    return DFL_OK;
}

/* The gradients no product sets (the norms' weights, the model's 1-D tensors: their kernels add
 * over rows and layers) to 0. */
static int zero_norm_grads(dfl_draft *m, dfl_err *e)
{
    dfl_be *be = m->be;
    for (int i = 0; i < m->n_tensors; i++) {
        const dfl_draft_tensor *t = &m->tensors[i];
        if (t->ndim == 1)
            OPT(be->ops->memset0(be, m->grad + t->offset, (size_t)t->numel * sizeof(float)));
    }
    return DFL_OK;
}

int dfl_draft_backward(dfl_draft *m, dfl_err *e)
{
    dfl_be *be = m->be;
    const dfl_draft_config *c = &m->c;
    const step_dims d = dims_of(m);
    const int64_t T = d.T, Q = d.Q, H = d.H, ldfc = (int64_t)c->n_feat * H;
    /* The gradient: the products set the matrices' (linear_dw); the norms' weights accumulate
     * over rows and layers' kernels, so they start at 0. (The padding between tensors is never
     * written: 0 since the model was made.) With no block rows, no layer runs: all of it is 0. */
    if (Q == 0) {
        OPT(be->ops->memset0(be, m->grad, (size_t)m->flat * sizeof(float)));
        return DFL_OK;
    }
    const int zr = zero_norm_grads(m, e);
    if (zr)
        return zr;

    /* the final norm, at the scored rows (the last layer's only rows): dL/dz in dh, dL/dhL into
     * dx, where the last layer's backward takes it */
    EW(be->ops->rmsnorm_bwd(be, m->dx, m->grad + m->off_norm, m->dh, m->hL, W(m, m->off_norm),
                             m->rstd_s, d.Qs, H, false));
    /* the layers, last first; dC collects the context rows' gradients */
    EW(be->ops->memset0(be, m->dC, (size_t)(T * H) * d.as));
    for (int l = c->n_layers - 1; l >= 0; l--) {
        int rc = layer_backward(m, l, e);
        if (rc)
            return rc;
    }
    /* C = hidden_norm(cpre): dC -> dcpre in place; then fc per captured layer */
    EW(be->ops->rmsnorm_bwd(be, m->dC, m->grad + m->off_hnorm, m->dC, m->cpre, W(m, m->off_hnorm),
                             m->rstdc, T, H, false));
    for (int j = 0; j < c->n_feat; j++)
        TRY(mm(m, DFL_DP_TAG_DW, H, H, T, m->dC, be->act, H, true, feat_j(m, j), be->act, H, false,
               m->grad + m->off_fc + (int64_t)j * H, DFL_F32, ldfc, 0.0f, NULL));
    return DFL_OK;
}

void dfl_draft_set_comm(dfl_draft *m, dfl_dist *comm) { m->comm = comm; }

int dfl_draft_apply(dfl_draft *m, const dfl_draft_optim *o, float lr, int64_t t, dfl_err *e)
{
    dfl_be *be = m->be;
    if (!m->have_step)
        return dfl_fail(e, DFL_EUSAGE, "drafter: apply without a step");
    /* pipelined: when the previous step's results are posted and not collected yet, the caller's
     * t does not count it; adamw takes t + 1, or t when that step turns out skipped (prev_skip) */
    const bool prev_unread = m->n_posted - m->n_collected > (m->step_posted ? 1 : 0);
    OPT(be->ops->copy(be, m->prev_skip, m->skip, sizeof(int32_t)));
    /* Data parallelism: all-reduce the gradients and m->sums over ranks here, so that the norm
     * and the denominator below are global (sums[GRAD_SQ] is still 0 on every rank). */
    if (m->comm) {
        int rc = dfl_dist_allreduce(m->comm, m->grad, m->flat, DFL_F32, e);
        if (!rc)
            rc = dfl_dist_allreduce(m->comm, m->sums, DFL_SUM_COUNT, DFL_F64, e);
        if (!rc)
            rc = dfl_dist_allreduce(m->comm, m->bmet, 2 * m->c.block_size + 2, DFL_F64, e);
        if (rc)
            return rc;
    }
    OPT(be->ops->sumsq(be, &m->sums[DFL_SUM_GRAD_SQ], m->grad, m->flat));
    OPT(be->ops->clip_scale(be, m->scal, m->skip, m->sums, o->max_grad_norm));
    dfl_adamw a = {
        .p = m->master, .g = m->grad, .m = m->adam_m, .v = m->adam_v,
        .p_act = m->wts != m->master ? m->wts : NULL, .n = m->flat, .lr = lr,
        .beta1 = o->beta1, .beta2 = o->beta2, .eps = o->eps, .weight_decay = o->weight_decay,
        .step = prev_unread ? t + 1 : t, .grad_scale = m->scal, .skip = m->skip,
        .prev_skip = prev_unread ? m->prev_skip : NULL,
    };
    OPT(be->ops->adamw(be, &a));
    m->have_apply = true;
    return DFL_OK;
}

double dfl_draft_lr(double lr, int64_t s, int64_t warmup, int64_t total)
{
    if (s < 1)
        s = 1;
    if (warmup > 0 && s <= warmup)
        return lr * (double)s / (double)warmup;
    if (total <= warmup)
        return lr;
    double p = (double)(s - warmup) / (double)(total - warmup);
    if (p > 1)
        p = 1;
    return lr * 0.5 * (1.0 + cos(M_PI * p));
}
