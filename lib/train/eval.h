/* eval.h: dfl-eval's engine: the acceptance length that greedy speculative decoding gets with a
 * trained drafter on given text, computed offline from the target's hidden states and the
 * drafter's forward (dfl-eval(1) documents the behaviour).
 *
 * The walk (one response span [s0, s1) of a sequence: a maximal run of loss_mask 1). The token at
 * s0 comes from the target's prefill. At anchor a (first s0), the drafter's block holds the known
 * token at a and proposes tokens for a+1 .. a+bs-1 from the target's hidden states of the
 * positions before a; with n leading proposals equal to the text's own tokens, the step yields
 * n + 1 tokens (the n accepted and the target's own next token), at most the s1 - 1 - a tokens
 * left, and the next anchor is a + n + 1. The span is done when a reaches s1 - 1. tau is the
 * mean of the yield over the steps. The drafter's proposals at an anchor depend only on the
 * text before it, so the engine computes every anchor a walk may visit in batched forwards
 * (many anchors of many sequences at once) and walks on the host. */
#ifndef DFL_EVAL_H
#define DFL_EVAL_H

#include <jansson.h>
#include <signal.h>
#include <stdbool.h>
#include <stdint.h>

#include "draft.h"
#include "err.h"

/* Counts over steps (one sequence's, or a whole run's). */
typedef struct dfl_eval_stats {
    int bs;                                  /* block size evaluated */
    int64_t sequences;                       /* sequences with at least one response span */
    int64_t skipped;                         /* sequences without a response position */
    int64_t spans;                           /* response spans (each: one prefill) */
    int64_t steps;                           /* drafting steps = target verification passes */
    int64_t tokens;                          /* tokens the steps yielded (sum of their lengths) */
    int64_t hist[DFL_DRAFT_MAX_BS + 1];      /* hist[n]: steps that yielded n tokens (1..bs) */
    int64_t slot_n[DFL_DRAFT_MAX_BS];        /* slot j (1..bs-1) inside the span at a step */
    int64_t slot_ok[DFL_DRAFT_MAX_BS];       /* ... and its proposal equal to the text's token */
    int64_t slot_acc[DFL_DRAFT_MAX_BS];      /* ... and accepted (slots 1..j all equal) */
} dfl_eval_stats;

void dfl_eval_stats_init(dfl_eval_stats *st, int bs);
/* Adds one step whose block has correct[j] (j = 1..bs-1; correct[0] is ignored) with `left`
 * (>= 1) tokens left in the span after the anchor; returns the step's yield (1..min(bs, left)). */
int dfl_eval_step(dfl_eval_stats *st, const uint8_t *correct, int64_t left);
/* a += b (same bs). */
void dfl_eval_stats_add(dfl_eval_stats *a, const dfl_eval_stats *b);
/* The report's fields (new reference): tau, histogram, per-slot rates, target forward passes
 * against tokens (the speed-up bound), counts. */
json_t *dfl_eval_stats_json(const dfl_eval_stats *st);

/* The next response span of a sequence at or after position `from`: [*s0, *s1) with loss_mask 1
 * throughout, 0 (or the sequence's end) on each side. False when there is none. */
bool dfl_eval_next_span(const uint8_t *loss_mask, int64_t len, int64_t from, int64_t *s0,
                        int64_t *s1);

/* One sequence's result, for --per-sequence. */
typedef struct dfl_eval_seq {
    const char *input;           /* the stream's path */
    int64_t batch;               /* batch number in the stream */
    int32_t seq;                 /* sequence number in the batch */
    int64_t len;                 /* tokens */
    const dfl_eval_stats *st;
} dfl_eval_seq;

typedef struct dfl_eval_opts {
    const char *draft;           /* --draft: a checkpoint directory or a run directory (latest) */
    const char *target_dir;      /* --target */
    const char *device;          /* --device (NULL: cpu) */
    int n_inputs;
    const char *const *inputs;   /* hidden-state streams, "-" = stdin */
    int block_size;              /* 0: the checkpoint's; else 2..the checkpoint's */
    int64_t max_tokens;          /* tokens of context per forward (0: default) */
    int64_t max_blocks;          /* blocks (anchors) per forward (0: default) */
    bool no_verify;              /* skip frame checksums */
    double progress_every;       /* seconds between progress lines on stderr (0: none) */
    /* called with each finished sequence, in stream order */
    int (*on_seq)(void *ctx, const dfl_eval_seq *s, dfl_err *e);
    void *ctx;
    /* called after each drafter forward (tests: CPU against GPU) with its blocks: block k is
     * sequence seq0 + bseq[k] of batch `batch` of input `input`, at anchor banchor[k], its slots'
     * matches correct[k * bs + j] */
    void (*on_forward)(void *ctx, int input, int64_t batch, int64_t seq0, int64_t n_blocks,
                       const int32_t *bseq, const int32_t *banchor, const uint8_t *correct, int bs);
    volatile sig_atomic_t *stop; /* when set, the run stops with DFL_EINTR */
} dfl_eval_opts;

/* What the run used, for the report. */
typedef struct dfl_eval_info {
    char ckpt[4096];             /* the checkpoint directory */
    char device[32];
    int trained_bs;              /* the checkpoint's block size */
    int64_t max_tokens, max_blocks;
    int64_t forwards;            /* drafter forwards run */
    int64_t blocks;              /* blocks computed (>= steps: every anchor a walk may visit) */
    double seconds;
} dfl_eval_info;

/* Runs the evaluation over every input in turn. A stream of another target, or with other layers
 * than the drafter's, is DFL_EMISMATCH; a stream with no response position DFL_EDATA; a
 * checkpoint holding a non-finite weight DFL_ENAN. */
int dfl_eval_run(const dfl_eval_opts *o, dfl_eval_stats *st, dfl_eval_info *info, dfl_err *e);

#endif
