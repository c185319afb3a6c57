/* draft_train.h: the dfl-draft training run: target, drafter configuration, inputs, the loop
 * (anchors, step, optimizer, schedule), metrics, checkpoints, resume and stopping. dfl-draft(1)
 * documents the behaviour; bin/dfl-draft.c only parses options into dfl_draft_train_opts. */
#ifndef DFL_DRAFT_TRAIN_H
#define DFL_DRAFT_TRAIN_H

#include <signal.h>
#include <stdbool.h>
#include <stdint.h>

#include "dtype.h"
#include "err.h"

typedef struct dfl_draft_train_opts {
    const char *target_dir;      /* --target */
    const char *run_dir;         /* --out */
    const char *config_path;     /* --config (NULL: from the checkpoint, flags and the target) */
    const char *resume;          /* --resume */
    const char *device;          /* --device (NULL: cpu) */
    int n_inputs;
    const char *const *inputs;
    /* drafter shape; 0 / negative = not given */
    int draft_layers;
    int block_size;
    double gamma;
    int64_t mask_token_id;       /* -1: not given */
    const char *layer_types;     /* --layer-types (NULL: all full_attention, or the config's) */
    int64_t sliding_window;      /* --sliding-window */
    int heads, kv_heads, head_dim; /* --heads, --kv-heads, --head-dim (default: the target's) */
    int64_t intermediate;        /* --intermediate-size (default: the target's) */
    /* step */
    int num_anchors;
    double noise_std;
    /* optimizer and schedule */
    double lr, beta1, beta2, eps, weight_decay, max_grad_norm, warmup_ratio;
    int64_t total_steps;         /* 0: from --epochs and the files */
    int epochs;
    int64_t stop_at;             /* 0: none; else stop (with a checkpoint) at this step */
    /* input */
    int pool_size, min_ready;
    int64_t max_tokens;          /* 0: from the files' indexes (CPU: or grow) */
    int64_t max_blocks;          /* 0: from the files' indexes or from max_tokens */
    bool no_verify;
    bool allow_truncated;        /* --allow-truncated: train on the complete batches of a cut input */
    /* checkpoints and metrics */
    int64_t save_every;
    int keep;
    const char *on_save;
    dfl_dtype save_dtype;        /* BF16 or F32 */
    int64_t log_every;
    int max_bad_steps;
    bool profile;                /* --profile: per log window, host and GPU times, host waits */
    bool tune;                   /* --tune: the GPU warm-up chooses the GEMMs' algorithms */
    bool no_pipeline;            /* --no-pipeline: read each step's results before the next */
    uint64_t seed;
    double init_std;
    volatile sig_atomic_t *stop; /* set by a signal handler: save and stop */
    /* data parallel (rank and world size from the launcher's variables, dist.h) */
    const char *rendezvous;      /* --rendezvous FILE or tcp://HOST:PORT */
    double dist_timeout;         /* --dist-timeout: seconds to wait for the other ranks at start */
} dfl_draft_train_opts;

/* Defaults of every field (the documented ones). */
void dfl_draft_train_defaults(dfl_draft_train_opts *o);
/* Runs the training; returns 0 when it finished (steps done or inputs exhausted), DFL_EINTR when
 * stopped by *stop (after writing a checkpoint), or an error. */
int dfl_draft_train(const dfl_draft_train_opts *o, dfl_err *e);

#endif
