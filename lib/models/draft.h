/* draft.h: the DFlash drafter (doc/dflash-step.md): its configuration, its parameters, and one training
 * step (forward, loss, backward, clipping, AdamW) over a packed batch, written once against the
 * backend ops of backend.h so that every backend runs the same model code.
 *
 * One step:
 *   dfl_draft_step(m, &in, true, e);       forward + loss + gradients of loss_num (sums on device)
 *   dfl_draft_apply(m, &opt, lr, t, e);    gradient norm, clipping, 1/loss_den, AdamW
 *   dfl_draft_fetch(m, &stats, e);         loss, accuracy, norm, per-slot counts, tau (host)
 * Gradients are of loss_num; the division by the (global) loss denominator happens in one place,
 * the backend's clip_scale op called by dfl_draft_apply.
 *
 * Pipelined (dfl-draft; the same calls on every backend, no host wait on an asynchronous one):
 *   dfl_draft_stage(m, &in_{N+1}, e)       host arrays + features into the next input set, upload
 *                                          enqueued on the copy stream (while step N runs)
 *   dfl_draft_run(m, true, e)              step N+1 on the compute stream, after its upload
 *   dfl_draft_apply(m, &opt, lr, t, e)     t counts the updates of the collected steps only
 *   dfl_draft_post(m, e)                   results -> a host slot, an event after them
 *   dfl_draft_collect(m, &stats_N, e)      the oldest posted slot (waits for its event)
 * Up to 2 input sets (1 on the CPU) and 2 result slots; dfl_draft_step = stage + run and
 * dfl_draft_fetch = post + collect everything. */
#ifndef DFL_DRAFT_H
#define DFL_DRAFT_H

#include <jansson.h>
#include <stdbool.h>
#include <stdint.h>

#include "backend.h"
#include "err.h"
#include "safetensors.h"
#include "span_prof.h"

#define DFL_DRAFT_MAX_FEAT 64     /* captured target layers */
#define DFL_DRAFT_MAX_BS 256      /* block size */
#define DFL_DRAFT_MAX_LAYERS 256  /* drafter layers */

typedef struct dfl_draft_config {
    int64_t hidden;              /* H (drafter and target) */
    int64_t vocab;               /* V */
    int64_t intermediate;        /* I */
    int n_layers;                /* drafter decoder layers */
    int n_heads, n_kv, head_dim;
    int n_feat;                  /* k: captured target layers */
    int32_t target_layers[DFL_DRAFT_MAX_FEAT];
    int n_target_layers;         /* layers of the target (num_target_layers) */
    int block_size;
    int32_t mask_token_id;
    double gamma;                /* loss decay */
    double rms_eps, rope_theta;
    int64_t max_position;        /* max_position_embeddings (written to config.json) */
    int64_t bos_token_id, eos_token_id; /* -1 = unknown (written when known) */
    /* layer_types: sliding[l] = 1 when layer l is "sliding_attention" (else "full_attention");
     * sliding layers see the window of sliding_window positions (backend.h dfl_dflash_attn) */
    uint8_t sliding[DFL_DRAFT_MAX_LAYERS];
    int64_t sliding_window;      /* W (0: no sliding layer) */
} dfl_draft_config;

/* SpecForge's default target layers for n features of a T-layer target (dfl-draft(1)). */
void dfl_draft_default_layers(int n_target_layers, int n, int32_t *out);
/* Checks sizes (positive, heads divisible, head_dim even, mask id < vocab, ...). */
int dfl_draft_config_check(const dfl_draft_config *c, dfl_err *e);
/* Reads a DFlash config.json (public layout: Qwen3 fields, block_size, dflash_config.{
 * mask_token_id, target_layer_ids}, num_target_layers, layer_types, use_sliding_window,
 * sliding_window, max_window_layers as Qwen3Config reads them). Fields it lacks keep their value
 * in *c (fill *c with defaults first). what names the input in errors. */
int dfl_draft_config_from_json(dfl_draft_config *c, const json_t *j, const char *what, dfl_err *e);
/* The config.json of a checkpoint (new reference): the layout of the published DFlash drafters
 * (architectures DFlashDraftModel, auto_map, model_type qwen3, dflash_config, layer_types, ...). */
json_t *dfl_draft_config_to_json(const dfl_draft_config *c);
/* Parses a layer-types spec for n layers into c->sliding: a comma list of items TYPE or TYPE:N
 * (N layers of that type, in order), TYPE one of sliding, full, sliding_attention,
 * full_attention; the counts must add up to n (e.g. "sliding:4,full:1" for 5 layers), or with
 * n <= 0, any count, which becomes c->n_layers. */
int dfl_draft_parse_layer_types(dfl_draft_config *c, const char *spec, int n, const char *what,
                                dfl_err *e);
/* Number of sliding layers. */
int dfl_draft_n_sliding(const dfl_draft_config *c);

/* One trainable tensor of the flat parameter buffer. */
typedef struct dfl_draft_tensor {
    char name[64];               /* state_dict name (doc/dflash-step.md section 1), no prefix */
    int ndim;
    int64_t shape[2];
    int64_t numel;
    int64_t offset;              /* elements from the start of the flat buffer */
} dfl_draft_tensor;

/* Tensors in flat order: fc, hidden_norm, per layer (input_layernorm, q, k, v, o, q_norm, k_norm,
 * post_attention_layernorm, gate, up (right after gate: [gate; up] is one [2I, H] matrix), down),
 * norm. Offsets are 16-element aligned except up_proj. Returns the count (3 + 11 * layers: 25 for 2 layers) and
 * sets *flat_len; tensors is malloc'ed. */
int dfl_draft_tensors(const dfl_draft_config *c, dfl_draft_tensor **tensors, int64_t *flat_len);

typedef struct dfl_draft dfl_draft;

/* A packed batch and its blocks, in host memory. feat[j] row t is at feat[j] + t * feat_ld
 * elements of feat_dt. Blocks are (sequence, anchor) pairs ordered by sequence (anchors of one
 * sequence in any order, normally ascending); 0 <= anchor < the sequence's length. */
typedef struct dfl_draft_input {
    int64_t T;                   /* tokens */
    int32_t S;                   /* sequences */
    const uint32_t *seq_lens;    /* [S] */
    const int32_t *input_ids;    /* [T] */
    const uint8_t *loss_mask;    /* [T] 0/1 */
    const void *feat[DFL_DRAFT_MAX_FEAT];
    dfl_dtype feat_dt;
    int64_t feat_ld;
    int32_t n_blocks;
    const int32_t *block_seq;    /* [n_blocks] */
    const int32_t *block_anchor; /* [n_blocks] */
    float noise_amp;             /* > 0: add U(-amp, amp) to the features */
    uint64_t noise_seed;
} dfl_draft_input;

typedef struct dfl_draft_optim {
    float beta1, beta2, eps, weight_decay;
    float max_grad_norm;         /* <= 0: no clipping */
} dfl_draft_optim;

/* What a step produced, read back to the host. */
typedef struct dfl_draft_stats {
    double loss_num, loss_den, acc_num, acc_den;
    double grad_norm, clip_coef;          /* after dfl_draft_apply */
    bool skipped;                         /* non-finite loss or gradient norm: no update */
    int bs;
    double slot_correct[DFL_DRAFT_MAX_BS], slot_count[DFL_DRAFT_MAX_BS];
    double tau_sum;                       /* sum over blocks of the acceptance length */
    int64_t tau_blocks;                   /* blocks whose slot 1 is scored */
    int64_t tokens, blocks;
    double gpu_ms;                        /* the step's device time (timing on), else -1 */
} dfl_draft_stats;

/* Allocates parameters (f32 master, gradients, AdamW moments, compute copy) on the backend,
 * zeroed. The frozen embedding / LM head and the workspace come later. */
int dfl_draft_open(dfl_draft **m, dfl_be *be, const dfl_draft_config *c, dfl_err *e);
void dfl_draft_close(dfl_draft *m);
const dfl_draft_config *dfl_draft_cfg(const dfl_draft *m);
const dfl_draft_tensor *dfl_draft_tensor_list(const dfl_draft *m, int *n);
int64_t dfl_draft_flat_len(const dfl_draft *m);

/* Fresh weights: linear layers N(0, std^2) from a seeded generator, norms 1. */
int dfl_draft_init_random(dfl_draft *m, uint64_t seed, double std, dfl_err *e);
/* Weights from tensors named prefix + name in f (any float dtype, exact shapes). */
int dfl_draft_load_weights(dfl_draft *m, const dfl_st_file *f, const char *prefix, dfl_err *e);
/* The frozen target embedding E [V, H] and LM head W [V, H] (lm_head NULL: tied to E). */
int dfl_draft_set_frozen(dfl_draft *m, const dfl_st_tensor *embed, const dfl_st_tensor *lm_head,
                         dfl_err *e);
/* Host copies of flat buffers (flat_len f32 each): master weights, gradients (of loss_num after
 * dfl_draft_step), AdamW moments; and setting them (resume). */
enum { DFL_DRAFT_MASTER, DFL_DRAFT_GRAD, DFL_DRAFT_ADAM_M, DFL_DRAFT_ADAM_V };
int dfl_draft_download(dfl_draft *m, int which, float *dst, dfl_err *e);
int dfl_draft_upload(dfl_draft *m, int which, const float *src, dfl_err *e);

/* Sizes the workspace for batches of up to max_tokens tokens and max_blocks blocks (once; a
 * later call with larger sizes reallocates, smaller ones keep the buffers). lmce_chunk: rows of
 * logits at a time (0: 64). */
int dfl_draft_reserve(dfl_draft *m, int64_t max_tokens, int64_t max_blocks, int64_t lmce_chunk,
                      dfl_err *e);
/* The reservation: tokens, blocks, bytes of backend memory (0s before dfl_draft_reserve). On an
 * asynchronous backend (a GPU) the workspace is sized once: a second dfl_draft_reserve for larger
 * batches fails (DFL_EUSAGE) instead of reallocating, and the first fails at once (DFL_ENOMEM,
 * with the sizes) when the device has less memory free than it needs. */
void dfl_draft_capacity(const dfl_draft *m, int64_t *max_tokens, int64_t *max_blocks,
                        uint64_t *bytes);
/* The dtype of the features the input sets hold (default f32, which holds any: give the
 * streams' dtype before dfl_draft_reserve to size them exactly; batches of a narrower float
 * dtype are accepted too). */
int dfl_draft_set_feat_dtype(dfl_draft *m, dfl_dtype dt, dfl_err *e);
/* Timing events around each step (dfl_draft_stats.gpu_ms); set with no results pending. */
int dfl_draft_set_timing(dfl_draft *m, bool on, dfl_err *e);
/* With tune on, the warm-up (dfl_draft_warmup) times cuBLASLt's candidate algorithms for each
 * GEMM shape of its step (the layers', fc's and the LM head's) and keeps the fastest for every
 * later product of that shape (on a GPU; nothing elsewhere). The warm-up takes longer. */
void dfl_draft_set_tune(dfl_draft *m, bool on);
/* With the timing on, the step's ops are also timed by kind of work (span_prof.h): */
enum { DFL_DP_GEMM_FWD,   /* the layers' and fc's GEMMs, forward */
       DFL_DP_GEMM_BWD,   /* their input and weight gradients */
       DFL_DP_ATTN_FWD,   /* the DFlash attention */
       DFL_DP_ATTN_BWD,
       DFL_DP_LMCE,       /* the LM head and the cross-entropy, forward and backward */
       DFL_DP_EW,         /* norms, RoPE, SwiGLU, copies, gathers: forward and backward */
       DFL_DP_OPT,        /* zeroing the gradients, their norm, clipping, AdamW */
       DFL_DP_N };
/* GEMM shapes: the weight's N x K with tag DFL_DP_TAG_* */
enum { DFL_DP_TAG_FWD, DFL_DP_TAG_DX, DFL_DP_TAG_DW };
extern const char *const dfl_draft_prof_kind[DFL_DP_N];
/* Waits for the spans enqueued so far; the totals since the timing was turned on (zero when
 * it is off). */
void dfl_draft_prof_read(dfl_draft *m, dfl_span_sum *out);
/* Forward and loss (and, with backward, the gradients of loss_num) of one batch. Checks token
 * ids, anchors and sizes against the reservation (DFL_EDATA / DFL_EUSAGE). */
int dfl_draft_step(dfl_draft *m, const dfl_draft_input *in, bool backward, dfl_err *e);
/* The two halves of dfl_draft_step. stage checks and copies the batch (in's arrays may be reused
 * when it returns) and enqueues its upload; run runs the oldest staged batch. */
int dfl_draft_stage(dfl_draft *m, const dfl_draft_input *in, dfl_err *e);
int dfl_draft_run(dfl_draft *m, bool backward, dfl_err *e);
/* Gradient norm, clipping, division by the loss denominator, AdamW step t (1-based count of
 * applied updates) at learning rate lr; nothing changes when the step is non-finite. When the
 * previous step is posted and not collected, t must not count it: whether it was applied is
 * known only on the device, which then uses t + 1 or t (adamw prev_skip). */
int dfl_draft_apply(dfl_draft *m, const dfl_draft_optim *o, float lr, int64_t t, dfl_err *e);
/* Reads back the last step's sums, flags and per-slot counts (waits for it). */
int dfl_draft_fetch(dfl_draft *m, dfl_draft_stats *st, dfl_err *e);
/* After apply (or a step without one): enqueues the copy of the step's results into a host
 * slot (2 at most posted and not collected). */
int dfl_draft_post(dfl_draft *m, dfl_err *e);
/* The oldest posted step's results (waits for its event: at once when it has long run). */
int dfl_draft_collect(dfl_draft *m, dfl_draft_stats *st, dfl_err *e);
/* Results posted and not collected. */
int dfl_draft_pending(const dfl_draft *m);
/* A warm-up step (forward and backward, no update) on the largest batch of the reservation, on
 * synthetic inputs, then a wait for it: every kernel loaded and every plan made before the first
 * real batch. Leaves the weights, the optimizer and the results of earlier steps unchanged. */
int dfl_draft_warmup(dfl_draft *m, dfl_err *e);
/* Host waits so far (the GPU backend's count: syncs that drained a stream, event waits that
 * blocked; zeros on the CPU). */
void dfl_draft_host_waits(const dfl_draft *m, uint64_t *syncs, uint64_t *event_waits);

/* Activations of the last step, for tests (host copies, f32; read after dfl_draft_step: the
 * last layer's and z use the step's gradient scratch). The last layer runs its output
 * projection and MLP at the scored rows only (slots 1..bs-1: slot 0's output is never scored),
 * so its output and z are 0 at slot 0. */
enum { DFL_DRAFT_ACT_CTX,      /* C [T, H] */
       DFL_DRAFT_ACT_LAYER,    /* output of layer `layer` [Q, H] */
       DFL_DRAFT_ACT_OUT,      /* z after the final norm [Q, H] (computed again from the last
                                * layer's output: the step keeps z for the scored rows only) */
       DFL_DRAFT_ACT_CE,       /* per-slot unweighted cross-entropy [Q] (0 where unscored) */
       DFL_DRAFT_ACT_WEIGHT,   /* per-slot decayed loss weight [Q] */
       DFL_DRAFT_ACT_LABEL };  /* per-slot label [Q] (as float) */
int dfl_draft_activation(dfl_draft *m, int which, int layer, float *dst, int64_t n, dfl_err *e);

/* Forward-only evaluation (dfl-eval): runs the drafter on in's blocks (no loss backward, no
 * noise) and writes to the host, for block b and slot j, correct[b * bs + j] = 1 when the
 * drafter's most likely token at that slot (the first of equal maxima) is the sequence's own
 * token at anchor + j; 0 for slot 0 (the anchor's known token), for slots past the end of the
 * sequence and for slots whose loss_mask is 0. Every scored slot counts alike (the loss decay
 * plays no part). Waits for the result; nothing may be staged or pending. correct holds
 * n_blocks * bs bytes. */
int dfl_draft_eval(dfl_draft *m, const dfl_draft_input *in, uint8_t *correct, dfl_err *e);

/* Learning rate at optimizer step s (1-based) of total: linear warmup over warmup steps
 * (lr * s / warmup), then cosine decay to 0 at s = total. */
double dfl_draft_lr(double lr, int64_t s, int64_t warmup, int64_t total);

#endif
