/* target.h: the target model (a dense qwen3 / llama / qwen2 decoder, or a hybrid qwen3_5 one of
 * Gated DeltaNet and gated attention layers, in the Hugging Face layout) on a backend, and its prefill forward over one packed batch of variable-length sequences,
 * capturing the outputs of chosen decoder layers. Written only against the backend ops
 * (backend.h): the same code runs on the CPU and on a GPU.
 *
 * Separate pieces, so that a pipelined driver can overlap them:
 *   dfl_target_open      weights on the backend (converted on the host to be->wdt)
 *   dfl_target_ws_new    activation buffers, allocated once (one block) for the largest batch
 *   dfl_target_forward   enqueue one batch: ids in, captured layers out into backend buffers
 *                        (or, split for a pipeline: dfl_target_positions on the host, the
 *                        caller stages ids, positions and cu_seqlens, and
 *                        dfl_target_forward_staged enqueues the layers)
 * and a driver that reads token batches and writes hidden-state batches (dfl_target_run,
 * lib/train/target_run.c: a reader thread, the forward, device-to-host copies on a second stream and a
 * writer thread, overlapped). */
#ifndef DFL_TARGET_H
#define DFL_TARGET_H

#include <signal.h>
#include <stdbool.h>
#include <stdint.h>

#include "backend.h"
#include "frame.h"
#include "hfmodel.h"
#include "moe.h"
#include "span_prof.h"

/* One decoder layer's weights on the backend. q/k/v and gate/up are fused so that each is one
 * GEMM. Biases are f32; NULL when the model has none. The layer's kind (hfmodel.h) says which
 * of the mixer's weights are set: attention (wqkv, q_norm, k_norm, wo) or Gated DeltaNet (w_in,
 * conv_w, A_log, dt_bias, gdn_norm, w_out). */
typedef struct dfl_target_layer {
    int kind;              /* dfl_layer_kind */
    void *ln1, *ln2;       /* [H] w: input_layernorm, post_attention_layernorm */
    void *wqkv;            /* [(nH + 2 nKV) d, H] w: q_proj | k_proj | v_proj rows; gated
                            * attention: [(2 nH + 2 nKV) d, H], q_proj's query rows of every head,
                            * then its gate rows, then k_proj | v_proj */
    float *bqkv;           /* [(nH + 2 nKV) d] */
    void *q_norm, *k_norm; /* [d] w (qwen3), else NULL */
    void *wo;              /* [H, nH d] w */
    float *bo;             /* [H] */
    void *wgu;             /* [2 I, H] w: gate_proj | up_proj rows */
    float *bgu;            /* [2 I] */
    void *wdown;           /* [H, I] w */
    float *bdown;          /* [H] */
    /* Gated DeltaNet: conv_dim = 2 Hk dk + Hv dv, value_dim = Hv dv */
    void *w_in;            /* [conv_dim + value_dim + 2 Hv, H] w: in_proj_qkv | in_proj_z |
                            * in_proj_b | in_proj_a rows */
    void *conv_w;          /* [conv_dim, K] w: conv1d.weight */
    float *A_log, *dt_bias;/* [Hv] */
    void *gdn_norm;        /* [dv] w: linear_attn.norm.weight */
    void *w_out;           /* [H, value_dim] w: out_proj */
    bool is_moe;           /* a sparse layer: the MLP is moe (wgu, wdown are NULL) */
    dfl_moe_weights moe;
} dfl_target_layer;

typedef struct dfl_target {
    dfl_be *be;
    dfl_hf_config cfg;
    char fingerprint[33];  /* dfl_hf_fingerprint of the directory */
    char prefix[32];       /* of the text model's tensor names: "model." or, in the multimodal
                            * layout of qwen3_5, "model.language_model." */
    dfl_dtype rope_dtype;  /* inv_freq rounding: config dtype, else the weights' dtype */
    int n_loaded;          /* layers 0 .. n_loaded-1 are on the backend */
    void *embed;           /* [V, H] w */
    dfl_target_layer *layers; /* [n_loaded] */
    uint64_t weight_bytes; /* backend bytes held by the weights */
    /* The residual adds run in the epilogues of o_proj and down_proj (h += x W^T, a GEMM with
     * beta = 1) instead of as separate passes: one pass over [T, H] less per add, and h rounded
     * once instead of twice. Set by dfl_target_open where the backend fuses (be->fuse_residual: a
     * GPU); the CPU keeps the separate adds (its results stay bit-identical to earlier versions). */
    bool fuse_residual;
    /* Tests: when non-NULL, router_out[l] (backend f32 [T, E], or NULL) receives the router
     * logits of sparse layer l in each forward. */
    float **router_out;
    /* --profile's time by kind of work (dfl_target_prof_on), or NULL. */
    struct dfl_span_prof *prof;
} dfl_target;

/* Opens the model directory DIR: parses config.json (errors name unsupported features), opens
 * the safetensors weights (single file or sharded), checks that every tensor of every layer is
 * present with the right shape and a float dtype, computes the fingerprint, and uploads the
 * embedding and layers 0 .. n_load-1 (n_load <= 0: all layers), converted to be->wdt. */
int dfl_target_open(dfl_target **out, dfl_be *be, const char *dir, int n_load, dfl_err *e);
void dfl_target_close(dfl_target *t);

/* Captured layers from a --layers spec: "auto" (K = 5), "auto:K" (dfl_hf_auto_layers), or a
 * comma-separated list of ascending, distinct layer ids < n_layers. out has room for
 * DFL_MAX_LAYERS entries. */
int dfl_target_parse_layers(const char *spec, int64_t n_layers, int32_t *out, int *n, dfl_err *e);

/* Activation buffers for batches of at most max_tokens tokens and max_seqs sequences, carved
 * from one backend allocation (with room for the caller at `extra`). */
typedef struct dfl_target_ws {
    int64_t max_tokens, max_seqs;
    void *arena;           /* the one backend allocation behind every buffer below */
    void *h;               /* [T, H] act: the residual stream */
    void *x;               /* [T, H] act: normed input of attention / MLP */
    void *delta;           /* [T, H] act: attention or MLP output before the residual add */
    void *big1;            /* [T, max((nH + 2 nKV) d, 2 I)] act: qkv, then gate|up */
    void *big2;            /* [T, max(nH d, I)] act: attention output, then swiglu output
                            * (hybrid: also the conv output, [T, conv_dim]) */
    void *lin;             /* [T, value_dim] act: the gated delta rule's output (hybrid models
                            * only, else NULL) */
    int32_t *ids, *pos;    /* [T] backend */
    int32_t *cu;           /* [S + 1] backend: cu_seqlens */
    int32_t *pos_host;     /* [T] host staging */
    int32_t *cu_host;      /* [S + 1] host staging */
    void *moe_block;       /* MoE models: the backend block behind moe's buffers */
    dfl_moe_ws moe;
    void *extra;           /* extra_bytes of backend memory for the caller (256-aligned), or NULL */
    uint64_t extra_bytes;
    uint64_t bytes;        /* backend bytes held (extra included) */
} dfl_target_ws;

int dfl_target_ws_new(const dfl_target *t, int64_t max_tokens, int64_t max_seqs,
                      dfl_target_ws **out, dfl_err *e);
/* Same, with extra_bytes more in the same allocation (ws->extra): a driver puts its capture
 * buffers there, so that a run holds one arena sized at start. */
int dfl_target_ws_new_ex(const dfl_target *t, int64_t max_tokens, int64_t max_seqs,
                         uint64_t extra_bytes, dfl_target_ws **out, dfl_err *e);
/* Backend bytes dfl_target_ws_new takes for these maxima (without extra); 0 on overflow. */
uint64_t dfl_target_ws_bytes(const dfl_target *t, int64_t max_tokens, int64_t max_seqs);
void dfl_target_ws_free(const dfl_target *t, dfl_target_ws *ws);

/* Token ids of b against the vocabulary: DFL_EDATA naming the batch, sequence and position of
 * the first id out of range. Also checks that seq_lens add up to n_tokens. */
int dfl_target_check_batch(const dfl_target *t, const dfl_batch *b, dfl_err *e);
/* The same against a vocabulary size (for a thread that must not hold the model). */
int dfl_target_check_vocab(int64_t vocab_size, const dfl_batch *b, dfl_err *e);

/* Enqueues the forward of token batch b (checked with dfl_target_check_batch) on the backend:
 * positions restart at 0 for each sequence, attention is causal within each sequence, and the
 * forward stops after layer layers[n_caps-1] (no final norm). caps[k] (backend memory, at least
 * n_tokens x H elements of cap_dt) receives the output of decoder layer layers[k]. layers must be
 * ascending and < t->n_loaded. Does not wait for the backend: sync before reading caps. */
int dfl_target_forward(dfl_target *t, dfl_target_ws *ws, const dfl_batch *b, int n_caps,
                       const int32_t *layers, dfl_dtype cap_dt, void *const *caps, dfl_err *e);

/* Host side of a batch's inputs: pos [T] (positions restarting at 0 for each sequence) and
 * cu [S + 1] (cu_seqlens) of b, whose seq_lens must add up to n_tokens. Returns the longest
 * sequence. */
int32_t dfl_target_positions(const dfl_batch *b, int32_t *pos, int32_t *cu);

/* The forward of a batch whose token ids, positions and cu_seqlens have already been enqueued
 * into ws->ids, ws->pos and ws->cu (the ids checked by the caller): T tokens in S sequences, the
 * longest max_len; index names the batch in messages. Enqueues the layers as dfl_target_forward
 * does and returns without waiting. */
int dfl_target_forward_staged(dfl_target *t, dfl_target_ws *ws, uint64_t index, int64_t T,
                              int64_t S, int32_t max_len, int n_caps, const int32_t *layers,
                              dfl_dtype cap_dt, void *const *caps, dfl_err *e);

/* The four GEMMs of a layer as dfl_target_forward_staged issues them for a batch of T tokens on
 * ws (qkv_proj, o_proj, gate_up_proj, down_proj; layer 0's weights, the same shapes for every
 * layer of its kind; a Gated DeltaNet layer 0 gives in_proj and out_proj instead), so that a
 * driver can tune them before its first batch. When layer 0 is sparse (MoE), the last two have
 * M = 0 (its expert GEMMs are grouped kernels, not tunable). */
int dfl_target_gemms(const dfl_target *t, const dfl_target_ws *ws, int64_t T, dfl_mm out[4]);

/* --profile's time by kind of work: the forward times the spans of its GEMMs, attention, chunked
 * gated delta rule and mixture-of-experts blocks (with backend events on an asynchronous backend,
 * the host clock on the CPU), so that a driver can say where the forward's time goes. */
enum { DFL_TP_GEMM, DFL_TP_ATTN, DFL_TP_DELTA, DFL_TP_MOE, DFL_TP_N };
/* seconds/flops/calls by kind DFL_TP_*; the GEMMs by shape: the weight's N x K, tag 1 where the
 * residual is added into C; flops: GEMMs 2 M N K, the delta rule as dfl_target_delta_flops counts
 * it, 0 for attention and MoE */
typedef dfl_span_sum dfl_target_prof_sum;
extern const char *const dfl_target_prof_kind[DFL_TP_N];  /* "GEMMs", "attention", ... */
/* Turns the timing on (before the first forward). */
int dfl_target_prof_on(dfl_target *t, dfl_err *e);
/* Waits for every span enqueued so far and returns the totals since dfl_target_prof_on. */
void dfl_target_prof_read(dfl_target *t, dfl_target_prof_sum *out);
/* FLOPs of the chunked gated delta rule over T tokens, counted as bench/target counts them: per
 * value head and chunk of C tokens, 2 C^2 dk (the lower triangles of K K^T and Q K^T) + 2 C^2 dv
 * (the triangular solve and the intra-chunk attention) + 6 C dk dv (K S, Q S, the state update),
 * i.e. Hv (2 C dk + 2 C dv + 6 dk dv) a token. */
double dfl_target_delta_flops(const dfl_hf_config *c, int64_t T);

/* The driver of dfl-target: reads token-batch streams and writes one hidden-state stream. */
typedef struct dfl_target_run_opts {
    const char *const *inputs;   /* token streams ("-" = stdin) */
    int n_inputs;
    const char *output;          /* "-" = stdout */
    int n_caps;
    const int32_t *layers;       /* captured layer ids */
    dfl_dtype dtype;             /* stream dtype: DFL_BF16 or DFL_F32 */
    int64_t max_tokens;          /* buffer size; 0 = from a manifest, the inputs' warm-up shapes
                                    or index, or the first batch */
    const char *manifest;        /* dfl-bucket's manifest.json: its warm-up shapes size the
                                    buffers (NULL: none) */
    bool grow;                   /* a larger batch grows the buffers (else: error) */
    int inflight;                /* output slots: batches between the forward and the writer
                                    (0 = default: 2, and 4 when wopts.vmsplice splices into a
                                    pipe, where a slot waits until the consumer has read it) */
    int profile;                 /* print stage times every `profile` batches (0 = off) */
    int file_io;                 /* -o FILE: DFL_FILE_IO_* */
    bool tune;                   /* GPU: time the GEMM library's candidate algorithms for the largest
                                    batch's GEMMs before the first batch */
    struct dfl_tune_file *tune_file; /* with tune (GPU): take the algorithms stored in this file
                                    (opened and checked by the caller, lib/train/tune_file.h) for
                                    the products it has for this GPU and library, time the rest,
                                    and store their choices in it; NULL: none */
    dfl_writer_opts wopts;
    volatile sig_atomic_t *stop; /* set by a signal handler: stop at the next batch boundary */
} dfl_target_run_opts;

/* How a file output (-o FILE) is written: from host buffers with write(2); through a mapping of
 * the file (the CPU forward writes straight into it; a GPU's copies land in pinned buffers and are
 * copied into it); or, GPU only, with the mapping registered with the GPU so that its copies
 * land in the file's pages (falls back to DFL_FILE_IO_MAP when registration is refused). Pipes
 * are always written with write(2) (or vmsplice). */
enum { DFL_FILE_IO_WRITE = 0, DFL_FILE_IO_MAP = 1, DFL_FILE_IO_REGISTER = 2 };

/* Totals of a run, filled as it goes (also on failure). */
typedef struct dfl_target_stats {
    uint64_t batches, seqs, tokens;
    double seconds;              /* from the first batch read to the end */
    double setup_seconds;        /* sizing, buffers, warm-up (before the first batch) */
} dfl_target_stats;

/* Runs the whole stream. On a signal (opts->stop set) returns DFL_EINTR without an END frame;
 * when the consumer goes away, DFL_EPIPE. Any failure leaves no complete-looking output. */
int dfl_target_run(dfl_target *t, const dfl_target_run_opts *o, dfl_target_stats *st, dfl_err *e);

#endif
