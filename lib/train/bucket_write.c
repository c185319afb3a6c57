/* bucket_write.c: dfl-bucket's shard writing (see bucket.h): build each batch's frame from the index,
 * write the shards through their lanes (a writer thread per group of shards, batches built ahead in
 * slots), fsync them on a pool, write the manifest and move it all into place: dfl_bucket_write. */
#include "bucket_int.h"

#include <dirent.h>
#include <errno.h>
#include <fcntl.h>
#include <jansson.h>
#include <pthread.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/mman.h>
#include <sys/stat.h>
#include <unistd.h>

#include "frame.h"
#include "json.h"
#include "jsonl.h"
#include "log.h"
#include "util.h"

/* ---- writing ---- */

/* Copies one sample's tokens (its first n_tokens) into ids / mask. */
static int fetch_sample(const dfl_bucket_run *r, uint32_t idx, int32_t *ids, uint8_t *mask, dfl_sample *s,
                        dfl_err *e)
{
    const bk_sample *sm = &r->samples[idx];
    const bk_part *pt = &r->parts[sm->where >> PART_SHIFT];
    uint64_t off = sm->where & OFF_MASK;
    size_t n = sm->n_tokens;
    if (!pt->mapped) {
        if (!r->spill_map || off + (uint64_t)n * 5 > r->spill_size)
            return dfl_fail(e, DFL_EIO, "internal: spill record out of range");
        memcpy(ids, r->spill_map + off, n * 4);
        memcpy(mask, r->spill_map + off + n * 4, n);
        return DFL_OK;
    }
    bool blank;
    dfl_err pe;
    if (off + sm->bytes > pt->size || dfl_sample_parse(s, (const char *)pt->data + off, sm->bytes, &blank, &pe) ||
        blank || s->n < n)
        return dfl_fail(e, DFL_EDATA, "%s: changed while being read (the line at byte %llu no longer holds "
                        "the same sample)", pt->name, (unsigned long long)off);
    memcpy(ids, s->ids, n * 4);
    memcpy(mask, s->mask, n);
    return DFL_OK;
}

/* A batch being built, in arrays that are kept from one batch to the next (the batch points into
 * them: it owns nothing). */
typedef struct bk_slot {
    dfl_batch b;
    uint32_t *lens;            /* [cap_seqs] */
    int32_t *ids;              /* [cap_tokens] */
    uint8_t *mask;             /* [cap_tokens] */
    size_t cap_seqs, cap_tokens;
} bk_slot;

static void slot_free(bk_slot *sl)
{
    free(sl->lens);
    free(sl->ids);
    free(sl->mask);
    memset(sl, 0, sizeof *sl);
}

/* Room for T tokens in S sequences (the old contents are not kept). */
static int slot_reserve(bk_slot *sl, uint64_t T, uint32_t S, dfl_err *e)
{
    if (S > sl->cap_seqs) {
        free(sl->lens);
        sl->cap_seqs = 0;
        if (!(sl->lens = malloc((size_t)S * sizeof *sl->lens)))
            return dfl_fail(e, DFL_ENOMEM, "out of memory for a batch of %u sequences", S);
        sl->cap_seqs = S;
    }
    if (T > sl->cap_tokens) {
        free(sl->ids);
        free(sl->mask);
        sl->mask = NULL;
        sl->cap_tokens = 0;
        if (!(sl->ids = malloc((size_t)T * sizeof *sl->ids)) || !(sl->mask = malloc((size_t)T)))
            return dfl_fail(e, DFL_ENOMEM, "out of memory for a batch of %llu tokens", (unsigned long long)T);
        sl->cap_tokens = (size_t)T;
    }
    return DFL_OK;
}

static int build_batch(const dfl_bucket_run *r, uint32_t bi, bk_slot *out, dfl_sample *s, dfl_err *e)
{
    const dfl_bk_batch *b = &r->batches[bi];
    int rc = slot_reserve(out, b->n_tokens, b->n_seqs, e);
    if (rc)
        return rc;
    uint64_t off = 0;
    for (uint32_t k = 0; k < b->n_seqs; k++) {
        uint32_t idx = r->members[b->first + k];
        uint32_t n = r->samples[idx].n_tokens;
        out->lens[k] = n;
        rc = fetch_sample(r, idx, out->ids + off, out->mask + off, s, e);
        if (rc)
            return rc;
        off += n;
    }
    dfl_batch *d = &out->b;
    memset(d, 0, sizeof *d);
    d->n_tokens = b->n_tokens;
    d->n_seqs = b->n_seqs;
    d->max_len = b->max_len;
    d->dtype = DFL_DT_INVALID;
    d->seq_lens = out->lens;
    d->input_ids = out->ids;
    d->loss_mask = out->mask;
    return DFL_OK;
}

static json_t *warm_json(size_t bucket, uint32_t bound, const bk_warm *w)
{
    return json_pack("{s:I, s:I, s:I, s:I, s:I}", "bucket", (json_int_t)bucket, "bound", (json_int_t)bound,
                     "seqs", (json_int_t)w->seqs, "tokens", (json_int_t)w->tokens, "max_len",
                     (json_int_t)w->max_len);
}

static json_t *bounds_json(const dfl_bucket_run *r)
{
    json_t *a = json_array();
    for (size_t b = 0; a && b < r->n_bounds; b++)
        json_array_append_new(a, json_integer(r->bounds[b]));
    return a;
}

/* The HEADER frame's "meta" of shard s: the plan, and the warm-up shapes of this shard. */
static json_t *shard_meta(const dfl_bucket_run *r, uint32_t s)
{
    bk_warm *w = calloc(r->n_bounds, sizeof *w);
    if (!w)
        return NULL;
    for (uint64_t i = r->shard_start[s]; i < r->shard_start[s + 1]; i++) {
        const dfl_bk_batch *b = &r->batches[r->shard_list[i]];
        bk_warm *x = &w[b->bucket];
        x->seqs = b->n_seqs > x->seqs ? b->n_seqs : x->seqs;
        x->tokens = b->n_tokens > x->tokens ? b->n_tokens : x->tokens;
        x->max_len = b->max_len > x->max_len ? b->max_len : x->max_len;
    }
    json_t *warm = json_array();
    for (size_t b = 0; warm && b < r->n_bounds; b++)
        if (w[b].seqs)
            json_array_append_new(warm, warm_json(b, r->bounds[b], &w[b]));
    free(w);
    return json_pack("{s:s, s:I, s:I, s:I, s:I, s:o, s:I, s:I, s:I, s:o}", "producer", r->o.producer,
                     "shard", (json_int_t)s, "shards", (json_int_t)r->o.shards, "seed", (json_int_t)r->o.seed,
                     "max_tokens", (json_int_t)r->o.max_tokens, "buckets", bounds_json(r), "batches",
                     (json_int_t)r->sh[s].batches, "tokens", (json_int_t)r->sh[s].tokens, "samples",
                     (json_int_t)r->sh[s].samples, "warmup", warm);
}

static json_t *manifest_json(const dfl_bucket_run *r)
{
    json_t *inputs = json_array(), *buckets = json_array(), *shards = json_array(), *warm = json_array();
    if (!inputs || !buckets || !shards || !warm)
        goto fail;
    for (size_t i = 0; i < r->n_parts; i++) {
        const bk_part *p = &r->parts[i];
        json_array_append_new(inputs, json_pack("{s:s, s:I, s:I, s:I, s:I}", "name", p->name, "lines",
                                                (json_int_t)p->lines, "samples", (json_int_t)p->samples, "tokens",
                                                (json_int_t)p->tokens, "bytes", (json_int_t)p->bytes));
    }
    for (size_t b = 0; b < r->n_bounds; b++) {
        const bk_bucket *bk = &r->bk[b];
        double eff = bk->capacity ? (double)bk->tokens / (double)bk->capacity : 0.0;
        json_array_append_new(buckets, json_pack("{s:I, s:I, s:I, s:I, s:I, s:f}", "bound", (json_int_t)r->bounds[b],
                                                 "samples", (json_int_t)bk->samples, "tokens", (json_int_t)bk->tokens,
                                                 "batches", (json_int_t)bk->batches, "capacity",
                                                 (json_int_t)bk->capacity, "efficiency", eff));
        if (bk->batches)
            json_array_append_new(warm, warm_json(b, r->bounds[b], &bk->warm));
    }
    for (uint32_t s = 0; s < r->o.shards; s++) {
        char name[32];
        snprintf(name, sizeof name, "shard-%05u.dfl", s);
        json_array_append_new(shards, json_pack("{s:s, s:I, s:I, s:I}", "file", name, "batches",
                                                (json_int_t)r->sh[s].batches, "tokens", (json_int_t)r->sh[s].tokens,
                                                "samples", (json_int_t)r->sh[s].samples));
    }
    json_t *m = json_pack("{s:I, s:s, s:o, s:I, s:I, s:I, s:s, s:s, s:o, s:o, s:o, s:o}",
                          "manifest_version", (json_int_t)1, "producer", r->o.producer, "inputs", inputs,
                          "seed", (json_int_t)r->o.seed, "max_tokens", (json_int_t)r->o.max_tokens,
                          "max_len", (json_int_t)r->max_len, "long", r->o.long_drop ? "drop" : "truncate",
                          "on_error", r->o.skip_bad ? "skip" : "error", "buckets", buckets, "shards", shards,
                          "warmup", warm,
                          "counts", json_pack("{s:I, s:I, s:I, s:I, s:I, s:I, s:I, s:I, s:I, s:I}",
                                              "lines", (json_int_t)r->lines, "blank_lines", (json_int_t)r->blank,
                                              "samples", (json_int_t)r->n_samples, "tokens", (json_int_t)r->tokens,
                                              "trained_tokens", (json_int_t)r->trained, "batches",
                                              (json_int_t)r->n_batches, "skipped", (json_int_t)r->skipped,
                                              "truncated", (json_int_t)r->truncated, "dropped_too_long",
                                              (json_int_t)r->drop_long, "dropped_no_trained_token",
                                              (json_int_t)r->drop_masked));
    if (m && r->o.vocab_size)
        json_object_set_new(m, "vocab_size", json_integer(r->o.vocab_size));
    if (m && r->o.auto_k)
        json_object_set_new(m, "buckets_auto", json_integer(r->o.auto_k));
    return m;
fail:
    json_decref(inputs);
    json_decref(buckets);
    json_decref(shards);
    json_decref(warm);
    return NULL;
}

/* ---- writing the shards ----
 * A shard is written through a descriptor of ours, so that a finished one can be fsynced (and
 * closed) by the syncer thread while the others are written: fsync waits for the disk. Every
 * shard has been synced before any is moved into place.
 *
 * The threads write several shards at once, each in a lane of its own, and every thread takes
 * the next piece of work there is: opening a lane's next shard, writing the batches built at the
 * front of a lane (one thread at a time in a lane, in order), closing a finished shard, or else
 * building a lane's next batch (reading its samples) into a free slot. So the writing (checks,
 * hashing, the copy into the page cache) is spread over the threads like the reading, and no
 * thread waits while there is work. What a shard holds does not depend on who wrote what. */

#define SYNC_SLOTS 16
#define LANE_SLOTS 4               /* batches built ahead in a lane */

typedef struct sync_ctx {
    int fd[SYNC_SLOTS];
    uint32_t shard[SYNC_SLOTS];
    int err[SYNC_SLOTS];           /* errno of a failed fsync or close, 0: none */
} sync_ctx;

static void sync_work(void *ctx, int slot, int worker)
{
    (void)worker;
    sync_ctx *c = ctx;
    int err = fsync(c->fd[slot]) != 0 ? errno : 0;
    if (close(c->fd[slot]) != 0 && !err)
        err = errno;
    c->err[slot] = err;
}

typedef struct bk_syncer {
    pthread_mutex_t mu;            /* over what follows (the pool has its own) */
    bk_pool pool;
    sync_ctx c;
    uint64_t sent, synced;
    int err;                       /* the first failure */
    uint32_t err_shard;
} bk_syncer;

/* Waits for the oldest shard handed over (y->mu held). */
static void syncer_wait_one(bk_syncer *y)
{
    int s = (int)(y->synced % SYNC_SLOTS);
    dfl_bucket_pool_wait(&y->pool, s);
    if (y->c.err[s] && !y->err) {
        y->err = y->c.err[s];
        y->err_shard = y->c.shard[s];
    }
    y->synced++;
}

/* Hands a finished shard's descriptor over: it is fsynced and closed. */
static void syncer_add(bk_syncer *y, int fd, uint32_t shard)
{
    pthread_mutex_lock(&y->mu);
    if (y->sent - y->synced == SYNC_SLOTS)
        syncer_wait_one(y);
    int s = (int)(y->sent % SYNC_SLOTS);
    y->c.fd[s] = fd;
    y->c.shard[s] = shard;
    y->c.err[s] = 0;
    dfl_bucket_pool_submit(&y->pool, s);
    y->sent++;
    pthread_mutex_unlock(&y->mu);
}

/* Waits for every shard handed over, and stops the syncer. */
static int syncer_stop(dfl_bucket_run *r, bk_syncer *y, dfl_err *e)
{
    pthread_mutex_lock(&y->mu);
    while (y->synced < y->sent)
        syncer_wait_one(y);
    pthread_mutex_unlock(&y->mu);
    dfl_bucket_pool_stop(&y->pool);
    pthread_mutex_destroy(&y->mu);
    if (y->err)
        return dfl_fail_errno(e, DFL_EIO, y->err, "%s/shard-%05u.dfl: fsync failed", r->tmp, y->err_shard);
    return DFL_OK;
}

enum { LANE_IDLE, LANE_OPEN };

typedef struct bk_lane {
    int state;                     /* LANE_IDLE: no shard; LANE_OPEN */
    bool busy;                     /* a thread opens, writes or closes it */
    dfl_writer *w;
    int fd;
    uint32_t shard;
    uint64_t first, count;         /* its batches: shard_list[first .. first + count) */
    uint64_t built, written;       /* batches given out to build; written */
    uint64_t bytes;                /* written to its shard so far (for the progress line) */
    bk_slot slot[LANE_SLOTS];      /* batch i in slot i % LANE_SLOTS */
    int slot_state[LANE_SLOTS];    /* SLOT_FREE, SLOT_BUSY (being built), SLOT_DONE */
    int slot_rc[LANE_SLOTS];
    dfl_err slot_err[LANE_SLOTS];
} bk_lane;

typedef struct bk_writing {
    dfl_bucket_run *r;
    pthread_mutex_t mu;            /* over all of it, but the slots being built and the lanes busy */
    pthread_cond_t cv;             /* some work may have come (or the end) */
    bk_lane *lane;
    int n_lanes;
    uint32_t next_shard;           /* the next shard to open */
    uint32_t shards_done;
    uint64_t batches_done;
    int rc;                        /* the first failure */
    dfl_err e;
    bk_syncer sync;
} bk_writing;

typedef struct write_arg {
    bk_writing *W;
    dfl_sample scratch;
} write_arg;

/* The lanes' invariants, true whenever W->mu is held between two updates (a busy lane's thread
 * works on its writer and descriptor without mu, so those are checked only on lanes not busy):
 *   - written <= built <= count and built - written <= LANE_SLOTS: at most LANE_SLOTS batches are
 *     given out and not yet written;
 *   - batch i of [written, built) is in slot i % LANE_SLOTS, SLOT_BUSY (being built) or SLOT_DONE;
 *     every other slot is SLOT_FREE;
 *   - LANE_IDLE: no batch in a slot (written == built); not busy: no descriptor;
 *   - LANE_OPEN: shard < shards, and its batches are its shard's, shard_list[first, first + count)
 *     with first = shard_start[shard] and count = shard_start[shard + 1] - first; not busy: a
 *     writer and a descriptor;
 *   - next_shard <= shards, shards_done <= next_shard, batches_done <= n_batches.
 * Checked only in builds with DFL_DEBUG defined (make SAN=1 defines it): a broken one prints what
 * and where to stderr and aborts, like assert(3). Otherwise lanes_check compiles to nothing. */
#ifdef DFL_DEBUG
static void lane_broken(int lane, const char *what, int line)
{
    fprintf(stderr, "%s:%d: lane %d: invariant broken: %s\n", __FILE__, line, lane, what);
    abort();
}

#define LANE_REQUIRE(i, c) ((c) ? (void)0 : lane_broken((i), #c, __LINE__))

/* Checks every lane's invariants (mu held). */
static void lanes_check(const bk_writing *W)
{
    const dfl_bucket_run *r = W->r;
    LANE_REQUIRE(-1, W->next_shard <= r->o.shards);
    LANE_REQUIRE(-1, W->shards_done <= W->next_shard);
    LANE_REQUIRE(-1, W->batches_done <= r->n_batches);
    for (int i = 0; i < W->n_lanes; i++) {
        const bk_lane *L = &W->lane[i];
        LANE_REQUIRE(i, L->written <= L->built && L->built <= L->count);
        LANE_REQUIRE(i, L->built - L->written <= LANE_SLOTS);
        for (uint64_t b = L->written; b < L->built; b++)
            LANE_REQUIRE(i, L->slot_state[b % LANE_SLOTS] == SLOT_BUSY ||
                                L->slot_state[b % LANE_SLOTS] == SLOT_DONE);
        int in_use = 0;
        for (int s = 0; s < LANE_SLOTS; s++)
            in_use += L->slot_state[s] != SLOT_FREE;
        LANE_REQUIRE(i, (uint64_t)in_use == L->built - L->written);
        if (L->state == LANE_IDLE) {
            LANE_REQUIRE(i, L->written == L->built);
            LANE_REQUIRE(i, L->busy || L->fd == -1);
        } else {
            LANE_REQUIRE(i, L->state == LANE_OPEN);
            LANE_REQUIRE(i, L->shard < r->o.shards && L->shard < W->next_shard);
            LANE_REQUIRE(i, L->first == r->shard_start[L->shard]);
            LANE_REQUIRE(i, L->count == r->shard_start[L->shard + 1] - L->first);
            LANE_REQUIRE(i, L->busy || (L->w && L->fd >= 0));
        }
    }
}
#else
#define lanes_check(W) ((void)0)
#endif

/* Opens shard s in lane L (mu not held; L busy). */
static int lane_open(dfl_bucket_run *r, bk_lane *L, uint32_t s, dfl_err *e)
{
    char name[32];
    snprintf(name, sizeof name, "shard-%05u.dfl", s);
    char *path = dfl_path_join(r->tmp, name);
    if (!path)
        return dfl_fail(e, DFL_ENOMEM, "out of memory");
    int fd = open(path, O_RDWR | O_CREAT | O_EXCL | O_CLOEXEC, 0644);
    if (fd < 0) {
        int err = errno;
        int rc = dfl_fail_errno(e, DFL_EIO, err, "%s: cannot create", path);
        free(path);
        return rc;
    }
    fchmod(fd, 0644); /* whatever the umask, as a file renamed into place by dfl_writer_open */
    dfl_stream_info info;
    memset(&info, 0, sizeof info);
    info.kind = DFL_KIND_TOKENS;
    info.version_major = DFL_FRAME_MAJOR;
    info.version_minor = DFL_FRAME_MINOR;
    snprintf(info.producer, sizeof info.producer, "%s", r->o.producer);
    info.vocab_size = r->o.vocab_size;
    info.dtype = DFL_DT_INVALID;
    info.meta = shard_meta(r, s);
    int rc = info.meta ? dfl_writer_open_fd(&L->w, fd, path, &info, NULL, e)
                       : dfl_fail(e, DFL_ENOMEM, "out of memory");
    json_decref(info.meta);
    free(path);
    if (rc) {
        close(fd);
        return rc;
    }
    L->fd = fd;
    return DFL_OK;
}

/* Writes INDEX and END to the lane's shard and hands it to the syncer (mu not held; L busy). */
static int lane_close(bk_writing *W, bk_lane *L, dfl_err *e)
{
    int rc = dfl_writer_close(L->w, e);
    L->w = NULL;
    if (rc)
        close(L->fd);
    else
        syncer_add(&W->sync, L->fd, L->shard);
    L->fd = -1;
    return rc;
}

/* Writes the lane's batches [from, to), built (mu not held; L busy). */
static int lane_write(bk_lane *L, uint64_t from, uint64_t to, dfl_err *e)
{
    for (uint64_t i = from; i < to; i++) {
        int s = (int)(i % LANE_SLOTS);
        if (L->slot_rc[s]) {
            *e = L->slot_err[s];
            return L->slot_rc[s];
        }
        int rc = dfl_writer_batch(L->w, &L->slot[s].b, e);
        if (rc)
            return rc;
    }
    return DFL_OK;
}

static void writing_progress(bk_writing *W)
{
    dfl_bucket_run *r = W->r;
    double now = dfl_now();
    if (now - r->t_last < 1.0)
        return;
    r->t_last = now;
    uint64_t bytes = r->out_bytes, done = W->batches_done;
    for (int i = 0; i < W->n_lanes; i++)
        bytes += W->lane[i].bytes;
    double dt = now - r->t_scan;
    char a[16], b[16];
    double rate = dt > 0 ? (double)done / dt : 0;
    dfl_progress("writing: %u of %u shards done, %llu of %zu batches (%.0f%%), %s, %s/s, ETA %.0f s",
                 W->shards_done, r->o.shards, (unsigned long long)done, r->n_batches,
                 r->n_batches ? 100.0 * (double)done / (double)r->n_batches : 100.0,
                 dfl_fmt_bytes((double)bytes, a, sizeof a), dfl_fmt_bytes(dt > 0 ? (double)bytes / dt : 0, b, sizeof b),
                 rate > 0 ? (double)(r->n_batches - done) / rate : 0.0);
}

/* A lane that is not busy and has opening, writing or closing to do (mu held), or NULL. */
static bk_lane *lane_to_write(bk_writing *W)
{
    for (int i = 0; i < W->n_lanes; i++) {
        bk_lane *L = &W->lane[i];
        if (L->busy)
            continue;
        if (L->state == LANE_IDLE ? W->next_shard < W->r->o.shards
                                  : L->written == L->count ||
                                        (L->written < L->built &&
                                         L->slot_state[L->written % LANE_SLOTS] == SLOT_DONE))
            return L;
    }
    return NULL;
}

/* The open lane with a batch to build and a free slot for it, the least ahead (mu held), or NULL. */
static bk_lane *lane_to_build(bk_writing *W)
{
    bk_lane *best = NULL;
    for (int i = 0; i < W->n_lanes; i++) {
        bk_lane *L = &W->lane[i];
        if (L->state == LANE_OPEN && L->built < L->count && L->built - L->written < LANE_SLOTS &&
            (!best || L->built - L->written < best->built - best->written))
            best = L;
    }
    return best;
}

/* What every writing thread runs, until every shard is written or something failed. */
static void *write_main(void *arg)
{
    write_arg *a = arg;
    bk_writing *W = a->W;
    dfl_bucket_run *r = W->r;
    dfl_err e;
    pthread_mutex_lock(&W->mu);
    while (!W->rc && W->shards_done < r->o.shards) {
        int rc = DFL_OK;
        bk_lane *L = lane_to_write(W);
        if (L) {
            L->busy = true;
            if (L->state == LANE_IDLE) {
                uint32_t s = W->next_shard++;
                uint64_t first = r->shard_start[s], count = r->shard_start[s + 1] - first;
                pthread_mutex_unlock(&W->mu);
                rc = lane_open(r, L, s, &e);
                pthread_mutex_lock(&W->mu);
                if (!rc) {
                    L->state = LANE_OPEN;
                    L->shard = s;
                    L->first = first;
                    L->count = count;
                    L->built = L->written = 0;
                }
            } else if (L->written == L->count) {
                r->out_bytes += dfl_writer_bytes(L->w);
                L->bytes = 0;
                pthread_mutex_unlock(&W->mu);
                rc = lane_close(W, L, &e);
                pthread_mutex_lock(&W->mu);
                L->state = LANE_IDLE;
                W->shards_done += !rc;
            } else {
                uint64_t from = L->written, to = from;
                while (to < L->built && L->slot_state[to % LANE_SLOTS] == SLOT_DONE)
                    to++;
                pthread_mutex_unlock(&W->mu);
                rc = lane_write(L, from, to, &e);
                pthread_mutex_lock(&W->mu);
                for (uint64_t i = from; i < to; i++)
                    L->slot_state[i % LANE_SLOTS] = SLOT_FREE;
                L->written = to;
                L->bytes = dfl_writer_bytes(L->w);
                W->batches_done += to - from;
                if (!rc)
                    writing_progress(W);
            }
            L->busy = false;
        } else if ((L = lane_to_build(W))) {
            uint64_t b = L->built++;
            int s = (int)(b % LANE_SLOTS);
            uint32_t bi = r->shard_list[L->first + b];
            L->slot_state[s] = SLOT_BUSY;
            pthread_mutex_unlock(&W->mu);
            L->slot_rc[s] = build_batch(r, bi, &L->slot[s], &a->scratch, &L->slot_err[s]);
            pthread_mutex_lock(&W->mu);
            L->slot_state[s] = SLOT_DONE;
        } else {
            pthread_cond_wait(&W->cv, &W->mu);
            continue;
        }
        lanes_check(W);
        if (!rc && dfl_bucket_stopped(r))
            rc = dfl_bucket_stop_fail(&e);
        if (rc && !W->rc) {
            W->rc = rc;
            W->e = e;
        }
        pthread_cond_broadcast(&W->cv);
    }
    pthread_mutex_unlock(&W->mu);
    return NULL;
}

/* Every shard into the temporary directory, by r->threads threads (this one and the others). */
static int write_shards(dfl_bucket_run *r, dfl_err *e)
{
    bk_writing W;
    memset(&W, 0, sizeof W);
    W.r = r;
    int n_th = r->threads;
    W.n_lanes = (uint32_t)n_th < r->o.shards ? n_th : (int)r->o.shards;
    W.lane = calloc((size_t)W.n_lanes, sizeof *W.lane);
    write_arg *args = calloc((size_t)n_th, sizeof *args);
    pthread_t *th = calloc((size_t)n_th, sizeof *th);
    if (!W.lane || !args || !th) {
        free(W.lane);
        free(args);
        free(th);
        return dfl_fail(e, DFL_ENOMEM, "out of memory");
    }
    for (int i = 0; i < W.n_lanes; i++)
        W.lane[i].fd = -1;
    pthread_mutex_init(&W.mu, NULL);
    pthread_cond_init(&W.cv, NULL);
    pthread_mutex_init(&W.sync.mu, NULL);
    int rc = dfl_bucket_pool_start(&W.sync.pool, 1, SYNC_SLOTS, sync_work, &W.sync.c, e);
    bool sync_started = !rc;
    int started = 0;
    for (int i = 0; i < n_th && !rc; i++) {
        args[i].W = &W;
        if (i == 0)
            continue; /* this thread */
        int err = pthread_create(&th[i], NULL, write_main, &args[i]);
        if (err)
            rc = dfl_fail_errno(e, DFL_EIO, err, "cannot start a worker thread");
        else
            started = i;
    }
    if (rc) {
        pthread_mutex_lock(&W.mu);
        W.rc = rc;
        W.e = *e;
        pthread_cond_broadcast(&W.cv);
        pthread_mutex_unlock(&W.mu);
    } else {
        write_main(&args[0]);
    }
    for (int i = 1; i <= started; i++)
        pthread_join(th[i], NULL);
    rc = W.rc;
    if (rc)
        *e = W.e;
    for (int i = 0; i < W.n_lanes; i++) {
        bk_lane *L = &W.lane[i];
        if (L->w) {
            dfl_writer_abort(L->w);
            close(L->fd);
        }
        for (int s = 0; s < LANE_SLOTS; s++)
            slot_free(&L->slot[s]);
    }
    if (sync_started) {
        dfl_err e2;
        int rc2 = syncer_stop(r, &W.sync, rc ? &e2 : e);
        rc = rc ? rc : rc2;
    } else {
        pthread_mutex_destroy(&W.sync.mu);
    }
    for (int i = 0; i < n_th; i++)
        dfl_sample_free(&args[i].scratch);
    pthread_mutex_destroy(&W.mu);
    pthread_cond_destroy(&W.cv);
    free(W.lane);
    free(args);
    free(th);
    dfl_progress_end();
    return rc;
}

int dfl_bucket_write(dfl_bucket_run *r, dfl_err *e)
{
    if (!r->planned || r->o.stats_only || !r->tmp)
        return dfl_fail(e, DFL_EUSAGE, "internal: dfl_bucket_write without a plan or an output directory");
    for (size_t i = 0; i < r->n_parts; i++) { /* a mapped input must not have changed since it was read */
        const bk_part *p = &r->parts[i];
        if (!p->mapped)
            continue;
        struct stat st;
        const struct stat *o = &r->in_st[p->input];
        if (stat(r->o.inputs[p->input], &st) != 0 || st.st_size != o->st_size ||
            st.st_mtim.tv_sec != o->st_mtim.tv_sec || st.st_mtim.tv_nsec != o->st_mtim.tv_nsec)
            return dfl_fail(e, DFL_EDATA, "%s: changed while being read", p->name);
    }
    int rc = write_shards(r, e);
    if (rc)
        return rc;
    /* move the shards into place, then the manifest marks the directory complete */
    r->moved = calloc(r->o.shards, sizeof *r->moved);
    if (!r->moved)
        return dfl_fail(e, DFL_ENOMEM, "out of memory");
    for (uint32_t s = 0; s < r->o.shards; s++) {
        char name[32];
        snprintf(name, sizeof name, "shard-%05u.dfl", s);
        char *from = dfl_path_join(r->tmp, name), *to = dfl_path_join(r->dir, name);
        if (!from || !to) {
            free(from);
            free(to);
            return dfl_fail(e, DFL_ENOMEM, "out of memory");
        }
        if (rename(from, to) != 0) {
            int err = errno;
            free(from);
            free(to);
            return dfl_fail_errno(e, DFL_EIO, err, "%s/%s: cannot move into place", r->dir, name);
        }
        free(from);
        r->moved[r->n_moved++] = to;
    }
    rc = dfl_fsync_dir(r->dir, e);
    if (rc)
        return rc;
    json_t *m = manifest_json(r);
    if (!m)
        return dfl_fail(e, DFL_ENOMEM, "out of memory building the manifest");
    char *text = json_dumps(m, JSON_SORT_KEYS | JSON_INDENT(2) | JSON_REAL_PRECISION(6));
    json_decref(m);
    if (!text)
        return dfl_fail(e, DFL_ENOMEM, "out of memory writing the manifest");
    size_t tn = strlen(text);
    char *t2 = realloc(text, tn + 2);
    if (!t2) {
        free(text);
        return dfl_fail(e, DFL_ENOMEM, "out of memory");
    }
    t2[tn] = '\n';
    t2[tn + 1] = 0;
    char *mpath = dfl_path_join(r->dir, "manifest.json");
    rc = mpath ? dfl_write_file_atomic(mpath, t2, tn + 1, e) : dfl_fail(e, DFL_ENOMEM, "out of memory");
    free(mpath);
    free(t2);
    if (rc)
        return rc;
    r->complete = true;
    r->t_write = dfl_now();
    dfl_verbose("timing: read %.2f s, plan %.2f s, write %.2f s", r->t_scan - r->t0, r->t_plan - r->t_scan,
                r->t_write - r->t_plan);
    return DFL_OK;
}
