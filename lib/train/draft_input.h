/* draft_input.h: the drafter trainer's input: hidden-state streams (files, FIFOs, stdin) read
 * by one thread each, checked against the target and the drafter, and a pool of ready batches
 * from which each step takes one at random (so that sequence lengths mix).
 *
 * Two modes:
 *  - replay (every input a regular file): an epoch is a permutation of all batches of all files
 *    (from their index frames), seeded by (seed, epoch); --epochs E replays E of them. The pool
 *    is filled in that order, so the batches a run trains on depend only on the seed, and the
 *    state (epoch, position, the pool's batch ids) restores them exactly on resume.
 *  - stream (any input a pipe): batches enter the pool as they arrive from any input (fan-in);
 *    one pass; on resume only the counters are restored.
 * Either way the pool holds up to pool_size batches; training waits until min_ready are pooled
 * (or the inputs ended) before each step, and each step takes the batch at a random slot (the
 * caller's generator), the last one moving into its place. */
#ifndef DFL_DRAFT_INPUT_H
#define DFL_DRAFT_INPUT_H

#include <jansson.h>
#include <signal.h>
#include <stdbool.h>
#include <stdint.h>

#include "draft_rng.h"
#include "err.h"
#include "frame.h"

typedef struct dfl_draft_src dfl_draft_src;

typedef struct dfl_draft_src_opts {
    int n_inputs;
    const char *const *inputs;   /* paths, "-" = stdin */
    /* what every stream's header must say */
    const char *fingerprint;     /* the target's (dfl_hf_fingerprint) */
    int64_t hidden;
    int64_t vocab;
    int n_layers;
    const int32_t *layers;       /* the drafter's target layer ids, in feature order; NULL: the
                                  * first input's, which the others must then match */
    int epochs;                  /* replay mode: passes over the files (>= 1) */
    uint64_t seed;               /* replay mode: epoch permutations */
    int pool_size, min_ready;
    bool no_verify;              /* skip frame checksums */
    bool allow_truncated;        /* an input without an END frame (cut by a crash) ends after its
                                  * last complete batch, with a warning saying how many there were,
                                  * instead of failing with DFL_ETRUNC */
    volatile sig_atomic_t *stop; /* when set, a wait for input returns DFL_EINTR */
} dfl_draft_src_opts;

/* The check dfl_draft_src_open makes of each input's header (the fingerprint, the hidden size,
 * the vocabulary, the layers of o; a mismatch is DFL_EMISMATCH naming path and what differs),
 * for readers of streams that do not train (dfl-eval). */
int dfl_draft_check_stream(const dfl_draft_src_opts *o, const char *path, const dfl_stream_info *si,
                           dfl_err *e);
/* Opens and checks every input (a mismatch is DFL_EMISMATCH naming the input and what differs),
 * and in replay mode reads the files' indexes. No thread runs yet. */
int dfl_draft_src_open(dfl_draft_src **s, const dfl_draft_src_opts *o, dfl_err *e);
void dfl_draft_src_close(dfl_draft_src *s);
bool dfl_draft_src_replay(const dfl_draft_src *s);
/* Replay mode: batches per epoch; the most tokens and the most blocks (dfl_draft_max_blocks with
 * max_anchors) of any batch of the files. */
int64_t dfl_draft_src_batches(const dfl_draft_src *s);
void dfl_draft_src_max(const dfl_draft_src *s, int max_anchors, int64_t *max_tokens,
                       int64_t *max_blocks);
/* The captured layer ids of the streams (the first input's header). */
const int32_t *dfl_draft_src_layers(const dfl_draft_src *s, int *n);
/* The stream dtype of the layer arrays (the first input's; all must agree). */
dfl_dtype dfl_draft_src_dtype(const dfl_draft_src *s);

/* Restores the position saved by dfl_draft_src_state (before the first next). */
int dfl_draft_src_restore(dfl_draft_src *s, const json_t *state, dfl_err *e);
/* Whether dfl_draft_src_next would block now, waiting for a stream (replay never does): the
 * trainer reads its steps in flight first, so that an idle run's metrics are not held back. */
bool dfl_draft_src_would_wait(dfl_draft_src *s);
/* The batch for the next step, owned by the source until the following call (*b = NULL at the
 * end of the input). *waited: seconds spent blocked on input. Errors of any input (truncated,
 * corrupt) are returned here. */
int dfl_draft_src_next(dfl_draft_src *s, dfl_rng *rng, const dfl_batch **b, double *waited,
                       dfl_err *e);
/* The position to save (new reference): mode, epoch, position, the pool's batch ids. */
json_t *dfl_draft_src_state(const dfl_draft_src *s);

#endif
