/* bucket.h: turning tokenized samples into sequence-length-bucketed token-batch streams
 * (dfl-bucket): reading and checking the samples (lib/formats/jsonl.h), bucketing by length, packing
 * into batches of at most max_tokens tokens, a seeded shuffle, dealing batches to shards with
 * balanced token totals, and writing the shards (.dfl token-batch streams) and manifest.json.
 *
 * The rules (dfl-bucket(1) documents them for users):
 *  - A sample of length L goes to the first bucket whose upper bound is >= L.
 *  - auto:K bounds: with the kept lengths sorted, L[0] <= ... <= L[N-1], bound j (j = 1..K) is
 *    L[ceil(j*N/K) - 1]; equal bounds collapse into one (so there may be fewer than K).
 *  - Shuffle: one xoshiro256** generator seeded through splitmix64 from the seed; Fisher-Yates
 *    over each bucket's samples (in input order, bucket 0 first), then over all batches.
 *  - Packing, per bucket, samples in shuffled order: each goes into the first open batch with
 *    room (total <= max_tokens); when none has room a new batch is opened; when more than
 *    DFL_BUCKET_OPEN batches are open the oldest is closed. A batch is also closed when its room
 *    is smaller than the shortest length its bucket can hold. A sample longer than max_tokens is
 *    a batch of its own. Batches are numbered in the order they close.
 *  - Shards: batches in shuffled order, each to the shard with the fewest tokens so far, ties to
 *    the lowest shard index. A shard keeps the shuffled order.
 *
 * Memory: per sample an index entry of 16 bytes and 4 bytes of plan (8 more while planning);
 * samples are re-read when the shards are written (plain files by offset, through a mapping;
 * streams from a spill file of their tokens in the output directory). */
#ifndef DFL_BUCKET_H
#define DFL_BUCKET_H

#include <signal.h>
#include <stdbool.h>
#include <stddef.h>
#include <stdint.h>

#include "draft_rng.h"
#include "err.h"

#define DFL_BUCKET_OPEN 8          /* open batches per bucket while packing */
#define DFL_BUCKET_MAX_BUCKETS 1024
#define DFL_BUCKET_MAX_SHARDS 100000
#define DFL_BUCKET_MAX_LEN 0x7fffffffu

/* ---- deterministic shuffles (dfl_rng: xoshiro256** seeded through splitmix64, draft_rng.h) ---- */
/* Fisher-Yates: for i = n-1 down to 1, swap a[i] with a[below(i+1)]. */
void dfl_rng_shuffle_u32(dfl_rng *r, uint32_t *a, size_t n);

/* ---- pure planning steps (exposed for the tests) ---- */

/* Parses "512,1024,2048" (strictly increasing, each in [1, DFL_BUCKET_MAX_LEN]) or "auto:K"
 * (K in [1, DFL_BUCKET_MAX_BUCKETS]) into bounds / *auto_k. *bounds is malloc'ed (NULL for auto). */
int dfl_bucket_parse_spec(const char *s, uint32_t **bounds, size_t *n_bounds, uint32_t *auto_k, dfl_err *e);
/* auto:K bounds from lengths (any order; sorted internally). bounds must hold k entries. */
int dfl_bucket_auto_bounds(const uint32_t *lens, size_t n, uint32_t k, uint32_t *bounds, size_t *n_bounds,
                           dfl_err *e);
/* Index of the first bound >= len, or n_bounds when len is above every bound. */
size_t dfl_bucket_find(const uint32_t *bounds, size_t n_bounds, uint32_t len);

typedef struct dfl_bk_batch {
    uint64_t first;     /* index of its first sample in the members array */
    uint64_t n_tokens;
    uint32_t n_seqs;
    uint32_t max_len;   /* longest sequence */
    uint32_t bucket;
    uint32_t shard;
} dfl_bk_batch;

/* Packs the samples order[0..n) (lengths lens[order[i]]) of one bucket whose shortest possible
 * length is min_len, appending batches to *batches (with bucket set) and their samples to
 * *members. Arrays grow by realloc; *n_batches / *n_members are their lengths. */
int dfl_bucket_pack(const uint32_t *order, size_t n, const uint32_t *lens, uint32_t min_len,
                    uint64_t max_tokens, uint32_t bucket, dfl_bk_batch **batches, size_t *n_batches,
                    size_t *cap_batches, uint32_t **members, size_t *n_members, size_t *cap_members,
                    dfl_err *e);
/* Deals batches (in the order of `order`) to shards: sets batches[i].shard. */
void dfl_bucket_deal(dfl_bk_batch *batches, const uint32_t *order, size_t n, uint32_t shards);

/* ---- the whole job ---- */

typedef struct dfl_bucket_opts {
    const char *const *inputs;   /* paths, "-" = stdin */
    size_t n_inputs;
    const char *out_dir;         /* required unless stats_only */
    bool stats_only;             /* read, plan, report; write nothing */
    bool force;                  /* replace a previous output in out_dir */
    const uint32_t *bounds;      /* explicit bucket bounds (strictly increasing), or */
    size_t n_bounds;
    uint32_t auto_k;             /* > 0: auto:K */
    uint64_t max_tokens;         /* token budget of a batch (>= 1) */
    uint32_t max_len;            /* 0: the largest bound (explicit buckets), none (auto) */
    bool long_drop;              /* samples longer than max_len: drop (else truncate) */
    int64_t vocab_size;          /* 0: no range check */
    bool skip_bad;               /* bad records: skip and count (else fail) */
    uint64_t seed;
    uint32_t shards;             /* >= 1 */
    int threads;                 /* 0: all CPUs */
    volatile sig_atomic_t *stop; /* set by a signal handler to stop cleanly; may be NULL */
    const char *producer;        /* "dfl-bucket 0.1.0" */
} dfl_bucket_opts;

typedef struct dfl_bucket_run dfl_bucket_run;

/* Checks the options and prepares the output directory (creates it; refuses a non-empty one
 * unless force; makes the private temporary directory inside it). */
int dfl_bucket_open(dfl_bucket_run **r, const dfl_bucket_opts *o, dfl_err *e);
/* Reads and checks every input, building the sample index (and the spill for streams). */
int dfl_bucket_scan(dfl_bucket_run *r, dfl_err *e);
/* Buckets, shuffles, packs and deals. */
int dfl_bucket_plan(dfl_bucket_run *r, dfl_err *e);
/* The --stats report (length histogram and what the plan produces), malloc'ed text. */
char *dfl_bucket_report(const dfl_bucket_run *r);
/* Writes the shards and manifest.json. Nothing that looks complete is left if it fails. */
int dfl_bucket_write(dfl_bucket_run *r, dfl_err *e);
/* One line for the log: counts, sizes, rates. */
void dfl_bucket_summary(const dfl_bucket_run *r, char *buf, size_t n);
/* Removes the temporaries (and, unless dfl_bucket_write succeeded, any output of this run). */
void dfl_bucket_close(dfl_bucket_run *r);

#endif
