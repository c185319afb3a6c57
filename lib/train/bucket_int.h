/* bucket_int.h: what bucket.c, bucket_plan.c, bucket_scan.c and bucket_write.c share inside lib/train:
 * the run's state (struct dfl_bucket_run and the index, part, bucket and shard records), the stop
 * checks and the ordered work pipeline (bk_pool). Not a public interface: bucket.h is. */
#ifndef DFL_BUCKET_INT_H
#define DFL_BUCKET_INT_H

#include <pthread.h>
#include <stdbool.h>
#include <stdint.h>
#include <sys/stat.h>

#include "bucket.h"
#include "jsonl.h"

#define PART_SHIFT 48
#define OFF_MASK ((1ull << PART_SHIFT) - 1)
#define MAX_PARTS 65535
#define CHUNK (4u << 20)      /* bytes of lines per parse task */
#define HIST_BINS 33          /* lengths in [2^k, 2^(k+1)) */

/* One kept sample: 16 bytes. */
typedef struct bk_sample {
    uint64_t where;           /* part << 48 | byte offset of its line (mapped) or of its spill */
    uint32_t n_tokens;        /* after truncation */
    uint32_t bytes;           /* length of its line (mapped parts) */
} bk_sample;

typedef struct bk_part {
    char *name;
    bool mapped;
    const uint8_t *data;
    size_t size;
    size_t input;             /* index of its input */
    uint64_t lines, samples, tokens, bytes;
} bk_part;

typedef struct bk_warm {
    uint32_t seqs, max_len;
    uint64_t tokens;
} bk_warm;

typedef struct bk_bucket {
    uint64_t samples, tokens, batches, capacity;
    bk_warm warm;
} bk_bucket;

typedef struct bk_shard {
    uint64_t batches, tokens, samples;
} bk_shard;

struct dfl_bucket_run {
    dfl_bucket_opts o;
    int threads;
    uint32_t *bounds;
    size_t n_bounds;
    uint32_t max_len;          /* 0: none */
    /* inputs */
    dfl_input **in;
    struct stat *in_st;        /* at the time a plain input was mapped */
    size_t n_in;
    uint64_t total_size, done_size;
    bk_part *parts;
    size_t n_parts, cap_parts;
    /* the index */
    bk_sample *samples;
    size_t n_samples, cap_samples;
    uint64_t lines, blank, skipped, truncated, drop_long, drop_masked, tokens, trained, bytes;
    char first_skip[768];
    /* output */
    char *dir, *tmp;
    bool dir_created, complete;
    int spill_fd;
    uint64_t spill_size;
    uint8_t *spill_map;
    char **moved;              /* shard files renamed into dir by this run */
    size_t n_moved;
    /* the plan */
    dfl_bk_batch *batches;
    size_t n_batches;
    uint32_t *members;
    size_t n_members;
    uint32_t *batch_order;     /* batches in shuffled order */
    uint32_t *shard_list;      /* batch ids grouped by shard, each group in shuffled order */
    uint64_t *shard_start;     /* [shards + 1] */
    bk_bucket *bk;
    bk_shard *sh;
    uint64_t hist_n[HIST_BINS], hist_tok[HIST_BINS];
    uint32_t len_min, len_max;
    bool planned;
    /* timing and progress */
    double t0, t_scan, t_plan, t_write, t_last;
    uint64_t out_bytes;
};

static inline bool dfl_bucket_stopped(const dfl_bucket_run *r) { return r->o.stop && *r->o.stop; }

static inline int dfl_bucket_stop_fail(dfl_err *e) { return dfl_fail(e, DFL_EINTR, "interrupted"); }

/* ---- an ordered work pipeline ----
 * The main thread fills slots in sequence and submits them; worker threads process submitted
 * slots in any order; the main thread collects them in sequence. Threads wait on condition
 * variables (nothing spins), so the main thread's reading or writing overlaps the workers. */

enum { SLOT_FREE, SLOT_READY, SLOT_BUSY, SLOT_DONE };

typedef struct bk_pool bk_pool;
typedef struct pool_arg {
    bk_pool *p;
    int id;
} pool_arg;

struct bk_pool {
    pthread_mutex_t mu;
    pthread_cond_t work, done;
    pthread_t *th;
    pool_arg *args;
    int n_th, n_slots;
    int *state;      /* [n_slots] */
    int *queue;      /* ring of ready slots */
    int q_head, q_len;
    void (*fn)(void *ctx, int slot, int worker);
    void *ctx;
    bool quit;
};

int dfl_bucket_pool_start(bk_pool *p, int n_th, int n_slots, void (*fn)(void *, int, int), void *ctx, dfl_err *e);
void dfl_bucket_pool_submit(bk_pool *p, int s);
void dfl_bucket_pool_skip(bk_pool *p, int s);
void dfl_bucket_pool_wait(bk_pool *p, int s);
void dfl_bucket_pool_stop(bk_pool *p);

#endif
