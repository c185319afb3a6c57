/* target.h: the target model (a dense qwen3 / llama / qwen2 decoder in the Hugging Face layout)
 * on a backend, and its prefill forward over one packed batch of variable-length sequences,
 * capturing the outputs of chosen decoder layers. Written only against the backend ops
 * (backend.h): the same code runs on the CPU and on CUDA.
 *
 * Three separate pieces, so that a pipelined driver can overlap them:
 *   dfl_target_open      weights on the backend (converted on the host to be->wdt)
 *   dfl_target_ws_new    activation buffers, allocated once for the largest batch
 *   dfl_target_forward   enqueue one batch: ids in, captured layers out into backend buffers
 * and a driver that reads token batches and writes hidden-state batches (dfl_target_run). */
#ifndef DFL_TARGET_H
#define DFL_TARGET_H

#include <signal.h>
#include <stdbool.h>
#include <stdint.h>

#include "backend.h"
#include "frame.h"
#include "hfmodel.h"

/* One decoder layer's weights on the backend. q/k/v and gate/up are fused so that each is one
 * GEMM. Biases are f32; NULL when the model has none. */
typedef struct dfl_target_layer {
    void *ln1, *ln2;       /* [H] w: input_layernorm, post_attention_layernorm */
    void *wqkv;            /* [(nH + 2 nKV) d, H] w: q_proj | k_proj | v_proj rows */
    float *bqkv;           /* [(nH + 2 nKV) d] */
    void *q_norm, *k_norm; /* [d] w (qwen3), else NULL */
    void *wo;              /* [H, nH d] w */
    float *bo;             /* [H] */
    void *wgu;             /* [2 I, H] w: gate_proj | up_proj rows */
    float *bgu;            /* [2 I] */
    void *wdown;           /* [H, I] w */
    float *bdown;          /* [H] */
} dfl_target_layer;

typedef struct dfl_target {
    dfl_be *be;
    dfl_hf_config cfg;
    char fingerprint[33];  /* dfl_hf_fingerprint of the directory */
    dfl_dtype rope_dtype;  /* inv_freq rounding: config dtype, else the weights' dtype */
    int n_loaded;          /* layers 0 .. n_loaded-1 are on the backend */
    void *embed;           /* [V, H] w */
    dfl_target_layer *layers; /* [n_loaded] */
    uint64_t weight_bytes; /* backend bytes held by the weights */
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

/* Activation buffers for batches of at most max_tokens tokens and max_seqs sequences. */
typedef struct dfl_target_ws {
    int64_t max_tokens, max_seqs;
    void *h;               /* [T, H] act: the residual stream */
    void *x;               /* [T, H] act: normed input of attention / MLP */
    void *delta;           /* [T, H] act: attention or MLP output before the residual add */
    void *big1;            /* [T, max((nH + 2 nKV) d, 2 I)] act: qkv, then gate|up */
    void *big2;            /* [T, max(nH d, I)] act: attention output, then swiglu output */
    int32_t *ids, *pos;    /* [T] backend */
    int32_t *cu;           /* [S + 1] backend: cu_seqlens */
    int32_t *pos_host;     /* [T] host staging */
    int32_t *cu_host;      /* [S + 1] host staging */
    uint64_t bytes;        /* backend bytes held */
} dfl_target_ws;

int dfl_target_ws_new(const dfl_target *t, int64_t max_tokens, int64_t max_seqs,
                      dfl_target_ws **out, dfl_err *e);
void dfl_target_ws_free(const dfl_target *t, dfl_target_ws *ws);

/* Token ids of b against the vocabulary: DFL_EDATA naming the batch, sequence and position of
 * the first id out of range. Also checks that seq_lens add up to n_tokens. */
int dfl_target_check_batch(const dfl_target *t, const dfl_batch *b, dfl_err *e);

/* Enqueues the forward of token batch b (checked with dfl_target_check_batch) on the backend:
 * positions restart at 0 for each sequence, attention is causal within each sequence, and the
 * forward stops after layer layers[n_caps-1] (no final norm). caps[k] (backend memory, at least
 * n_tokens x H elements of cap_dt) receives the output of decoder layer layers[k]. layers must be
 * ascending and < t->n_loaded. Does not wait for the backend: sync before reading caps. */
int dfl_target_forward(dfl_target *t, dfl_target_ws *ws, const dfl_batch *b, int n_caps,
                       const int32_t *layers, dfl_dtype cap_dt, void *const *caps, dfl_err *e);

/* The driver of dfl-target: reads token-batch streams and writes one hidden-state stream. */
typedef struct dfl_target_run_opts {
    const char *const *inputs;   /* token streams ("-" = stdin) */
    int n_inputs;
    const char *output;          /* "-" = stdout */
    int n_caps;
    const int32_t *layers;       /* captured layer ids */
    dfl_dtype dtype;             /* stream dtype: DFL_BF16 or DFL_F32 */
    int64_t max_tokens;          /* buffer size; 0 = from the first batch */
    bool grow;                   /* a larger batch grows the buffers (else: error) */
    dfl_writer_opts wopts;
    volatile sig_atomic_t *stop; /* set by a signal handler: stop at the next batch boundary */
} dfl_target_run_opts;

/* Totals of a run, filled as it goes (also on failure). */
typedef struct dfl_target_stats {
    uint64_t batches, seqs, tokens;
    double seconds;              /* from the first batch read to the end */
} dfl_target_stats;

/* Runs the whole stream. On a signal (opts->stop set) returns DFL_EINTR without an END frame;
 * when the consumer goes away, DFL_EPIPE. Any failure leaves no complete-looking output. */
int dfl_target_run(dfl_target *t, const dfl_target_run_opts *o, dfl_target_stats *st, dfl_err *e);

#endif
