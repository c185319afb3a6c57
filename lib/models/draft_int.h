/* draft_int.h: what the drafter's files share inside lib/models: the model object (struct
 * dfl_draft: parameters, the results block, the input sets, the workspace's buffers), the step's
 * sizes and the few functions one file calls in another. Not a public interface: draft.h is.
 *
 *   draft_config.c     configuration (config.json in and out, layer types) and the tensor list
 *   draft_model.c      the object: open, close, parameters in and out, activations for tests
 *   draft_workspace.c  memory: the workspace's buffers carved out of one arena (the plan)
 *   draft_stage.c      staging: input sets, uploads, pinned result slots, events, the step's
 *                      driver (run, post, collect, warm-up, evaluation)
 *   draft_step.c       the math: forward, backward and the optimizer (doc/dflash-step.md 3-5) */
#ifndef DFL_DRAFT_INT_H
#define DFL_DRAFT_INT_H

#include <stdbool.h>
#include <stdint.h>

#include "backend.h"
#include "dist.h"
#include "draft.h"

#define IN_SETS 2       /* input sets on an asynchronous backend (1 on the CPU) */
#define RES_SLOTS 2     /* result slots: the step being read and the one just posted */

/* The backend block of a step's small results (one copy to the host). */
typedef struct res_layout {
    size_t sums, bmet, scal, skip, prev_skip, bytes;
} res_layout;

/* The per-step arrays of a batch (built by the host, read by the step). */
typedef struct step_arrays {
    int32_t *pos;                /* [T+Q] context positions, then block-slot positions */
    int32_t *tok, *labels;       /* [Q] */
    float *weight;               /* [Q] */
    int32_t *ctx_start, *anchor; /* [B] */
    void *feat;                  /* [k, T, H] feat_dt, rows packed */
} step_arrays;

/* One step's inputs: host arrays (pinned on a GPU) and their backend copies. */
typedef struct in_set {
    void *hblock;                /* the host arrays, one allocation */
    step_arrays h;               /* the host arrays */
    step_arrays d;               /* their backend copies (arena) */
    /* the batch staged into it */
    int64_t T, B;
    int32_t S;
    dfl_dtype feat_dt;
    float noise_amp;
    uint64_t noise_seed;
    bool full;                   /* staged, not run yet */
    bool uploaded, read;         /* ev_up / ev_read have been recorded */
    dfl_be_event ev_up, ev_read;
} in_set;

/* One result slot (host, pinned on a GPU). */
typedef struct res_slot {
    void *host;                  /* res_layout.bytes */
    int64_t T, B;
    bool have_apply, posted;
    dfl_be_event ev_start, ev_done;
} res_slot;

/* Saved activations of one drafter layer. */
typedef struct layer_acts {
    void *hin;       /* [Q, H] residual in (h[l]; h[0] = embeddings) */
    void *x;         /* [Q, H] input_layernorm(hin) (the first layer: its 2B pair rows only) */
    float *rstd1;    /* [Q] (the first layer: [2B]) */
    void *qraw;      /* [Q, nH*d] x Wq^T */
    void *q;         /* [Q, nH*d] after q_norm + RoPE */
    float *rstdq;    /* [Q*nH] */
    void *kraw;      /* [T+Q, nKV*d] rows [C Wk^T | x Wk^T] */
    void *k;         /* [T+Q, nKV*d] after k_norm + RoPE */
    float *rstdk;    /* [(T+Q)*nKV] */
    void *v;         /* [T+Q, nKV*d] */
    void *o;         /* [Q, nH*d] attention output */
    float *lse;      /* [Q*nH] */
    void *hmid;      /* [Q, H] hin + o Wo^T (the last layer: Qs scored rows; y, gu, act too) */
    float *rstd2;    /* [Q] */
    void *y;         /* [Q, H] post_attention_layernorm(hmid) */
    void *gu;        /* [Q, 2I] y [Wgate; Wup]^T */
    void *act;       /* [Q, I] silu(gate) * up */
} layer_acts;

/* Offsets of one layer's tensors in the flat buffer. */
typedef struct layer_w {
    int64_t in_ln, wq, wk, wv, wo, q_norm, k_norm, post_ln, wgu, wdown;
} layer_w;

struct dfl_draft {
    dfl_be *be;
    dfl_draft_config c;
    dfl_draft_tensor *tensors;
    int n_tensors;
    int64_t flat;                /* flat length (elements) */
    int64_t off_fc, off_hnorm, off_norm;
    layer_w *lw;
    float *master, *grad, *adam_m, *adam_v;   /* [flat] f32 */
    void *wts;                   /* [flat] be->wdt (== master when wdt is F32) */
    void *embed, *lm_head;       /* [V, H] be->wdt; lm_head == embed when tied */
    float decay[DFL_DRAFT_MAX_BS];

    /* a step's small results: one backend block (res_layout), allocated with the parameters */
    void *res;
    res_layout rl;
    double *sums;                /* [DFL_SUM_COUNT] */
    double *bmet;                /* [2*bs + 2] block_metrics */
    float *scal;                 /* [4] scale, norm, coef */
    int32_t *skip;               /* [1] */
    int32_t *prev_skip;          /* [1] the previous step's skip (adamw prev_skip) */
    res_slot slots[RES_SLOTS];
    int64_t n_posted, n_collected;
    bool timing;
    dfl_span_prof *prof;         /* --profile's spans by kind (dfl_draft_set_timing) */
    double attn_fl[2];           /* --profile: this step's attention FLOPs, full / sliding layer */
    bool tune;                   /* dfl_draft_set_tune: the warm-up times GEMM algorithms */
    bool tuning;                 /* in that warm-up step */
    int64_t tuned[64][12];       /* the GEMM shapes timed so far (mm's key) */
    int n_tuned;

    /* input sets */
    in_set sets[IN_SETS];
    int n_sets;
    int64_t n_staged, n_run;
    dfl_dtype feat_dt;           /* the features' dtype the sets are sized for */

    /* workspace (dfl_draft_reserve) */
    int64_t capT, capB, chunk;
    void *arena;                 /* one backend allocation */
    uint64_t ws_bytes;
    /* the step's inputs: the backend arrays of the input set it runs on (in.feat: the set's
     * features, or featc), and their host copies (dfl_draft_activation) */
    step_arrays in, h_in;
    /* The LM head and the loss run on the Qs = B (bs - 1) rows of block slots 1..bs-1 only
     * (slot 0 holds the anchor's known token and is never scored; rows whose label is masked
     * stay in, with weight 0): gathered with scored_rows, results scattered back with
     * row_scored. Both maps depend on bs alone and are written once by dfl_draft_reserve. */
    int32_t *scored_rows;        /* [capB*(bs-1)] the row of each scored row */
    int32_t *row_scored;         /* [capB*bs] the scored row of each row, -1 at slot 0 */
    /* The first layer's block rows are the anchor's token at slot 0 and the mask token at every
     * other slot, so before its attention a block has two distinct rows: its queries, keys and
     * values are made for 2 rows a block (the "pair" rows: slot 0, slot 1) and spread, and its
     * weight gradients take, per block, slot 0's gradient and the sum of the other slots' (see
     * layer_forward). Like the maps above, these depend on bs alone. */
    int32_t *pair_rows;          /* [2 capB + 1] the row of pair row p: b bs (p = 2b), b bs + 1
                                  * (p = 2b + 1), then capB bs. A gather map of the pair rows, and
                                  * the segments of segment_sum: pair row 2b sums slot 0, 2b + 1
                                  * slots 1..bs-1 */
    int32_t *row_pair;           /* [capB*bs] the pair row of each row: 2b at slot 0, else 2b+1 */
    int32_t *labels_s;           /* [Qs] */
    float *weight_s;             /* [Qs] */
    uint8_t *correct_s;          /* [Qs] */
    float *ce;                   /* [Qs] */
    uint8_t *correct;            /* [Q] (0 at slot 0) */
    void *featc;                 /* [k, T, H] act: features converted from another dtype */
    void *cpre, *C;              /* [T, H] */
    float *rstdc;                /* [T] */
    layer_acts *la;              /* [layers] */
    void *os;                    /* [Qs, nH*d] the last layer's attention output, scored rows */
    void *hL;                    /* [Qs, H] the last layer's output, at the scored rows only */
    float *rstd_s;               /* [Qs] the final norm's */
    float *lm_work;              /* [dfl_lmce_work_act(chunk, V, act)] */
    void *dh, *dx;               /* [Q, H] */
    void *dact;                  /* [Q, I] */
    void *dgu;                   /* [Q, 2I] */
    void *dout, *dq;             /* [Q, nH*d] */
    void *dk, *dv;               /* [T+Q, nKV*d] */
    float *delta;                /* [Q*nH] */
    void *dC;                    /* [T, H] */

    int64_t *h_seq_start;        /* [S+1] host scratch of prepare */
    int64_t capS;

    /* the last step */
    int64_t T, B, Q;
    int32_t S;
    bool have_step, have_apply;
    bool step_posted;            /* the last step's results are posted */
    dfl_dist *comm;              /* data parallel: sums over ranks in dfl_draft_apply (NULL: one) */
};

#define TRY(x)                                                                         \
    do {                                                                               \
        int rc_ = (x);                                                                 \
        if (rc_)                                                                       \
            return dfl_fail(e, rc_, "drafter step: %s failed (%s)", #x, dfl_code_name(rc_)); \
    } while (0)

/* draft_stage.c: the results block, its host slots and the events (dfl_draft_open), waiting for
 * copies in flight and freeing them (dfl_draft_close). */
int dfl_draft_stage_open(dfl_draft *m, dfl_err *e);
void dfl_draft_stage_drain(dfl_draft *m);
void dfl_draft_stage_close(dfl_draft *m);
/* draft_workspace.c: frees the arena and the input sets' host arrays. */
void dfl_draft_free_workspace(dfl_draft *m);
/* draft_step.c: the forward of the step's batch (m->T, S, B, Q set): sums, correct, block
 * metrics; with want_grad, also the gradient of loss_num at the scored rows' z (in m->dh). Then
 * the backward: m->grad = the gradients of loss_num. */
int dfl_draft_forward(dfl_draft *m, bool want_grad, dfl_err *e);
int dfl_draft_backward(dfl_draft *m, dfl_err *e);

#endif
