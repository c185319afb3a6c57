/* bucket.c: dfl-bucket's work (see bucket.h): scan the inputs into a compact sample index,
 * plan buckets, batches and shards, write the shards and the manifest. */
#include "bucket.h"

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

/* ---- shuffles ---- */

void dfl_rng_shuffle_u32(dfl_rng *r, uint32_t *a, size_t n)
{
    for (size_t i = n; i > 1; i--) {
        size_t j = (size_t)dfl_rng_below(r, i);
        uint32_t t = a[i - 1];
        a[i - 1] = a[j];
        a[j] = t;
    }
}

/* ---- planning steps ---- */

int dfl_bucket_parse_spec(const char *s, uint32_t **bounds, size_t *n_bounds, uint32_t *auto_k, dfl_err *e)
{
    *bounds = NULL;
    *n_bounds = 0;
    *auto_k = 0;
    if (strncmp(s, "auto:", 5) == 0) {
        int64_t k;
        int rc = dfl_parse_i64(s + 5, 1, DFL_BUCKET_MAX_BUCKETS, &k, "--buckets auto:K", e);
        if (rc)
            return rc;
        *auto_k = (uint32_t)k;
        return DFL_OK;
    }
    int64_t *v;
    size_t n;
    int rc = dfl_parse_i64_list(s, 1, DFL_BUCKET_MAX_LEN, DFL_BUCKET_MAX_BUCKETS, &v, &n,
                                "--buckets (a list like 512,1024,2048 or auto:K)", e);
    if (rc)
        return rc;
    uint32_t *b = malloc(n * sizeof *b);
    if (!b) {
        free(v);
        return dfl_fail(e, DFL_ENOMEM, "out of memory");
    }
    for (size_t i = 0; i < n; i++) {
        if (i > 0 && v[i] <= v[i - 1]) {
            rc = dfl_fail(e, DFL_EUSAGE, "--buckets: bounds must increase (%lld after %lld)", (long long)v[i],
                          (long long)v[i - 1]);
            free(v);
            free(b);
            return rc;
        }
        b[i] = (uint32_t)v[i];
    }
    free(v);
    *bounds = b;
    *n_bounds = n;
    return DFL_OK;
}

static int cmp_u32(const void *a, const void *b)
{
    uint32_t x = *(const uint32_t *)a, y = *(const uint32_t *)b;
    return x < y ? -1 : x > y;
}

int dfl_bucket_auto_bounds(const uint32_t *lens, size_t n, uint32_t k, uint32_t *bounds, size_t *n_bounds,
                           dfl_err *e)
{
    *n_bounds = 0;
    if (n == 0 || k == 0)
        return dfl_fail(e, DFL_EDATA, "no lengths to place auto buckets on");
    uint32_t *s = malloc(n * sizeof *s);
    if (!s)
        return dfl_fail(e, DFL_ENOMEM, "out of memory sorting %zu lengths", n);
    memcpy(s, lens, n * sizeof *s);
    qsort(s, n, sizeof *s, cmp_u32);
    size_t nb = 0;
    for (uint64_t j = 1; j <= k; j++) {
        uint64_t idx = (j * (uint64_t)n + k - 1) / k - 1; /* ceil(j*n/k) - 1 */
        uint32_t b = s[idx];
        if (nb == 0 || b > bounds[nb - 1])
            bounds[nb++] = b;
    }
    free(s);
    *n_bounds = nb;
    return DFL_OK;
}

size_t dfl_bucket_find(const uint32_t *bounds, size_t n_bounds, uint32_t len)
{
    size_t lo = 0, hi = n_bounds;
    while (lo < hi) {
        size_t mid = (lo + hi) / 2;
        if (bounds[mid] >= len)
            hi = mid;
        else
            lo = mid + 1;
    }
    return lo;
}

typedef struct open_batch {
    uint32_t *m;
    size_t n, cap;
    uint64_t tokens;
    uint32_t max_len;
} open_batch;

static int emit_batch(const uint32_t *m, size_t n, uint64_t tokens, uint32_t max_len, uint32_t bucket,
                      dfl_bk_batch **batches, size_t *n_batches, size_t *cap_batches, uint32_t **members,
                      size_t *n_members, size_t *cap_members, dfl_err *e)
{
    if (*n_batches == *cap_batches) {
        size_t c = *cap_batches ? *cap_batches * 2 : 1024;
        dfl_bk_batch *nb = realloc(*batches, c * sizeof *nb);
        if (!nb)
            return dfl_fail(e, DFL_ENOMEM, "out of memory for %zu batches", c);
        *batches = nb;
        *cap_batches = c;
    }
    if (*n_members + n > *cap_members) {
        size_t c = *cap_members ? *cap_members : 4096;
        while (c < *n_members + n)
            c *= 2;
        uint32_t *nm = realloc(*members, c * sizeof *nm);
        if (!nm)
            return dfl_fail(e, DFL_ENOMEM, "out of memory for %zu batch members", c);
        *members = nm;
        *cap_members = c;
    }
    dfl_bk_batch *b = &(*batches)[(*n_batches)++];
    b->first = *n_members;
    b->n_tokens = tokens;
    b->n_seqs = (uint32_t)n;
    b->max_len = max_len;
    b->bucket = bucket;
    b->shard = 0;
    memcpy(*members + *n_members, m, n * sizeof *m);
    *n_members += n;
    return DFL_OK;
}

int dfl_bucket_pack(const uint32_t *order, size_t n, const uint32_t *lens, uint32_t min_len,
                    uint64_t max_tokens, uint32_t bucket, dfl_bk_batch **batches, size_t *n_batches,
                    size_t *cap_batches, uint32_t **members, size_t *n_members, size_t *cap_members,
                    dfl_err *e)
{
    open_batch open[DFL_BUCKET_OPEN];
    memset(open, 0, sizeof open);
    int n_open = 0, rc = DFL_OK;
    if (min_len == 0)
        min_len = 1;
#define EMIT(ob) emit_batch((ob)->m, (ob)->n, (ob)->tokens, (ob)->max_len, bucket, batches, n_batches, \
                            cap_batches, members, n_members, cap_members, e)
    for (size_t i = 0; i < n && !rc; i++) {
        uint32_t s = order[i], len = lens[s];
        if (len > max_tokens) {
            rc = emit_batch(&s, 1, len, len, bucket, batches, n_batches, cap_batches, members, n_members,
                            cap_members, e);
            continue;
        }
        int j;
        for (j = 0; j < n_open; j++)
            if (open[j].tokens + len <= max_tokens)
                break;
        if (j == n_open) {
            if (n_open == DFL_BUCKET_OPEN) { /* close the oldest */
                rc = EMIT(&open[0]);
                if (rc)
                    break;
                open_batch t = open[0];
                memmove(open, open + 1, (DFL_BUCKET_OPEN - 1) * sizeof *open);
                open[DFL_BUCKET_OPEN - 1] = t;
                j = DFL_BUCKET_OPEN - 1;
            } else {
                j = n_open++;
            }
            open[j].n = 0;
            open[j].tokens = 0;
            open[j].max_len = 0;
        }
        open_batch *ob = &open[j];
        if (ob->n == ob->cap) {
            size_t c = ob->cap ? ob->cap * 2 : 64;
            uint32_t *nm = realloc(ob->m, c * sizeof *nm);
            if (!nm) {
                rc = dfl_fail(e, DFL_ENOMEM, "out of memory while packing");
                break;
            }
            ob->m = nm;
            ob->cap = c;
        }
        ob->m[ob->n++] = s;
        ob->tokens += len;
        if (len > ob->max_len)
            ob->max_len = len;
        if (max_tokens - ob->tokens < min_len) { /* full: nothing of this bucket fits any more */
            rc = EMIT(ob);
            open_batch t = *ob;
            memmove(open + j, open + j + 1, (size_t)(n_open - j - 1) * sizeof *open);
            open[--n_open] = t;
        }
    }
    for (int j = 0; j < n_open && !rc; j++)
        rc = EMIT(&open[j]);
#undef EMIT
    for (int j = 0; j < DFL_BUCKET_OPEN; j++)
        free(open[j].m);
    return rc;
}

void dfl_bucket_deal(dfl_bk_batch *batches, const uint32_t *order, size_t n, uint32_t shards)
{
    /* a binary min-heap of shards keyed by (tokens, index) */
    uint64_t *tok = calloc(shards, sizeof *tok);
    uint32_t *heap = malloc(shards * sizeof *heap);
    if (!tok || !heap) { /* tiny allocations; fall back to a linear scan */
        free(heap);
        heap = NULL;
    }
    if (!tok) {
        for (size_t i = 0; i < n; i++)
            batches[order[i]].shard = (uint32_t)(i % shards);
        return;
    }
#define LESS(a, b) (tok[a] < tok[b] || (tok[a] == tok[b] && (a) < (b)))
    if (heap)
        for (uint32_t s = 0; s < shards; s++)
            heap[s] = s; /* all zero: index order is a valid heap */
    for (size_t i = 0; i < n; i++) {
        dfl_bk_batch *b = &batches[order[i]];
        uint32_t s;
        if (heap) {
            s = heap[0];
            b->shard = s;
            tok[s] += b->n_tokens;
            size_t k = 0;
            for (;;) { /* sift down */
                size_t l = 2 * k + 1, r = l + 1, m = k;
                if (l < shards && LESS(heap[l], heap[m]))
                    m = l;
                if (r < shards && LESS(heap[r], heap[m]))
                    m = r;
                if (m == k)
                    break;
                uint32_t t = heap[k];
                heap[k] = heap[m];
                heap[m] = t;
                k = m;
            }
        } else {
            s = 0;
            for (uint32_t q = 1; q < shards; q++)
                if (LESS(q, s))
                    s = q;
            b->shard = s;
            tok[s] += b->n_tokens;
        }
    }
#undef LESS
    free(tok);
    free(heap);
}

/* ---- the run ---- */

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

static bool stopped(const dfl_bucket_run *r) { return r->o.stop && *r->o.stop; }

static int stop_fail(dfl_err *e) { return dfl_fail(e, DFL_EINTR, "interrupted"); }

static bool shard_file_name(const char *n)
{
    if (strncmp(n, "shard-", 6) != 0)
        return false;
    const char *p = n + 6;
    if (*p < '0' || *p > '9')
        return false;
    while (*p >= '0' && *p <= '9')
        p++;
    return strcmp(p, ".dfl") == 0;
}

#define TMP_PREFIX ".dfl-bucket.tmp."

/* Removes the plain files in a directory we made, then the directory. */
static void remove_flat_dir(const char *dir)
{
    DIR *d = opendir(dir);
    if (d) {
        struct dirent *de;
        while ((de = readdir(d))) {
            if (strcmp(de->d_name, ".") == 0 || strcmp(de->d_name, "..") == 0)
                continue;
            char *p = dfl_path_join(dir, de->d_name);
            if (p) {
                unlink(p);
                free(p);
            }
        }
        closedir(d);
    }
    rmdir(dir);
}

/* The output directory: must be empty, or with force, have a previous output removed (the
 * manifest first, so that it never looks complete while being replaced). */
static int prepare_dir(dfl_bucket_run *r, dfl_err *e)
{
    const char *dir = r->o.out_dir;
    struct stat st;
    if (stat(dir, &st) != 0) {
        if (errno != ENOENT)
            return dfl_fail_errno(e, DFL_EIO, errno, "%s: cannot access the output directory", dir);
        int rc = dfl_mkdir_p(dir, 0777, e);
        if (rc)
            return rc;
        r->dir_created = true;
    } else if (!S_ISDIR(st.st_mode)) {
        return dfl_fail(e, DFL_EUSAGE, "%s: not a directory (-o names the output directory)", dir);
    } else {
        DIR *d = opendir(dir);
        if (!d)
            return dfl_fail_errno(e, DFL_EIO, errno, "%s: cannot list the output directory", dir);
        struct dirent *de;
        char first[256] = "";
        while ((de = readdir(d))) {
            if (strcmp(de->d_name, ".") == 0 || strcmp(de->d_name, "..") == 0)
                continue;
            snprintf(first, sizeof first, "%s", de->d_name);
            break;
        }
        closedir(d);
        if (first[0] && !r->o.force)
            return dfl_fail(e, DFL_EUSAGE, "%s: the output directory is not empty (it holds '%s'); use --force "
                            "to replace a previous output", dir, first);
        if (first[0]) {
            char *m = dfl_path_join(dir, "manifest.json");
            if (!m)
                return dfl_fail(e, DFL_ENOMEM, "out of memory");
            if (unlink(m) != 0 && errno != ENOENT) {
                int err = errno;
                free(m);
                return dfl_fail_errno(e, DFL_EIO, err, "%s/manifest.json: cannot remove", dir);
            }
            free(m);
            int rc = dfl_fsync_dir(dir, e);
            if (rc)
                return rc;
            d = opendir(dir);
            if (!d)
                return dfl_fail_errno(e, DFL_EIO, errno, "%s: cannot list the output directory", dir);
            while ((de = readdir(d))) {
                char *p = dfl_path_join(dir, de->d_name);
                if (!p)
                    continue;
                if (shard_file_name(de->d_name)) {
                    if (unlink(p) != 0 && errno != ENOENT)
                        dfl_warn("%s: cannot remove: %s", p, strerror(errno));
                } else if (strncmp(de->d_name, TMP_PREFIX, strlen(TMP_PREFIX)) == 0) {
                    remove_flat_dir(p);
                }
                free(p);
            }
            closedir(d);
        }
    }
    r->dir = dfl_strdup(dir);
    r->tmp = dfl_path_join(dir, TMP_PREFIX "XXXXXX");
    if (!r->dir || !r->tmp)
        return dfl_fail(e, DFL_ENOMEM, "out of memory");
    if (!mkdtemp(r->tmp)) {
        int err = errno;
        free(r->tmp);
        r->tmp = NULL;
        return dfl_fail_errno(e, DFL_EIO, err, "%s: cannot create a temporary directory in it", dir);
    }
    return DFL_OK;
}

int dfl_bucket_open(dfl_bucket_run **out, const dfl_bucket_opts *o, dfl_err *e)
{
    *out = NULL;
    if (o->n_inputs == 0)
        return dfl_fail(e, DFL_EUSAGE, "no input (name files, or - for stdin)");
    if (!o->stats_only && !o->out_dir)
        return dfl_fail(e, DFL_EUSAGE, "no output directory (-o DIR)");
    if (o->shards < 1 || o->shards > DFL_BUCKET_MAX_SHARDS)
        return dfl_fail(e, DFL_EUSAGE, "--shards must be in [1, %d]", DFL_BUCKET_MAX_SHARDS);
    if (o->max_tokens < 1 || o->max_tokens > DFL_BUCKET_MAX_LEN)
        return dfl_fail(e, DFL_EUSAGE, "--max-tokens must be in [1, %u]", DFL_BUCKET_MAX_LEN);
    if (!o->auto_k && o->n_bounds == 0)
        return dfl_fail(e, DFL_EUSAGE, "no bucket bounds");
    if (!o->auto_k && o->max_len > o->bounds[o->n_bounds - 1])
        return dfl_fail(e, DFL_EUSAGE, "--max-len %u is larger than the last bucket bound %u (raise the bounds "
                        "or lower --max-len)", o->max_len, o->bounds[o->n_bounds - 1]);
    if (o->vocab_size < 0)
        return dfl_fail(e, DFL_EUSAGE, "--vocab-size must be positive");
    size_t n_stdin = 0;
    for (size_t i = 0; i < o->n_inputs; i++)
        n_stdin += strcmp(o->inputs[i], "-") == 0;
    if (n_stdin > 1)
        return dfl_fail(e, DFL_EUSAGE, "stdin (-) named more than once");

    dfl_bucket_run *r = calloc(1, sizeof *r);
    if (!r)
        return dfl_fail(e, DFL_ENOMEM, "out of memory");
    r->o = *o;
    r->spill_fd = -1;
    r->t0 = r->t_last = dfl_now();
    r->threads = o->threads > 0 ? o->threads : dfl_ncpu();
    if (o->auto_k) {
        r->max_len = o->max_len;
    } else {
        r->max_len = o->max_len ? o->max_len : o->bounds[o->n_bounds - 1];
        r->bounds = malloc(o->n_bounds * sizeof *r->bounds);
        if (!r->bounds) {
            free(r);
            return dfl_fail(e, DFL_ENOMEM, "out of memory");
        }
        memcpy(r->bounds, o->bounds, o->n_bounds * sizeof *r->bounds);
        r->n_bounds = o->n_bounds;
    }
    int rc = DFL_OK;
    r->in = calloc(o->n_inputs, sizeof *r->in);
    r->in_st = calloc(o->n_inputs, sizeof *r->in_st);
    if (!r->in || !r->in_st)
        rc = dfl_fail(e, DFL_ENOMEM, "out of memory");
    for (size_t i = 0; i < o->n_inputs && !rc; i++) {
        rc = dfl_input_open(&r->in[i], o->inputs[i], o->stop, e);
        if (!rc) {
            r->n_in = i + 1;
            r->total_size += dfl_input_size(r->in[i]);
        }
    }
    if (!rc && !o->stats_only)
        rc = prepare_dir(r, e);
    if (rc) {
        dfl_bucket_close(r);
        return rc;
    }
    *out = r;
    return DFL_OK;
}

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

static void *pool_main(void *arg)
{
    pool_arg *a = arg;
    bk_pool *p = a->p;
    pthread_mutex_lock(&p->mu);
    for (;;) {
        while (!p->quit && p->q_len == 0)
            pthread_cond_wait(&p->work, &p->mu);
        if (p->q_len == 0)
            break;
        int s = p->queue[p->q_head];
        p->q_head = (p->q_head + 1) % p->n_slots;
        p->q_len--;
        p->state[s] = SLOT_BUSY;
        pthread_mutex_unlock(&p->mu);
        p->fn(p->ctx, s, a->id);
        pthread_mutex_lock(&p->mu);
        p->state[s] = SLOT_DONE;
        pthread_cond_broadcast(&p->done);
    }
    pthread_mutex_unlock(&p->mu);
    return NULL;
}

static void pool_stop(bk_pool *p);

static int pool_start(bk_pool *p, int n_th, int n_slots, void (*fn)(void *, int, int), void *ctx, dfl_err *e)
{
    memset(p, 0, sizeof *p);
    p->n_slots = n_slots;
    p->fn = fn;
    p->ctx = ctx;
    p->state = calloc((size_t)n_slots, sizeof *p->state);
    p->queue = calloc((size_t)n_slots, sizeof *p->queue);
    p->th = calloc((size_t)n_th, sizeof *p->th);
    p->args = calloc((size_t)n_th, sizeof *p->args);
    pthread_mutex_init(&p->mu, NULL);
    pthread_cond_init(&p->work, NULL);
    pthread_cond_init(&p->done, NULL);
    if (!p->state || !p->queue || !p->th || !p->args) {
        pool_stop(p);
        return dfl_fail(e, DFL_ENOMEM, "out of memory");
    }
    for (int i = 0; i < n_th; i++) {
        p->args[i].p = p;
        p->args[i].id = i;
        int err = pthread_create(&p->th[i], NULL, pool_main, &p->args[i]);
        if (err) {
            pool_stop(p);
            return dfl_fail_errno(e, DFL_EIO, err, "cannot start a worker thread");
        }
        p->n_th = i + 1;
    }
    return DFL_OK;
}

static void pool_submit(bk_pool *p, int s)
{
    pthread_mutex_lock(&p->mu);
    p->state[s] = SLOT_READY;
    p->queue[(p->q_head + p->q_len) % p->n_slots] = s;
    p->q_len++;
    pthread_cond_signal(&p->work);
    pthread_mutex_unlock(&p->mu);
}

/* A slot that needs no work (it is collected like the others). */
static void pool_skip(bk_pool *p, int s)
{
    pthread_mutex_lock(&p->mu);
    p->state[s] = SLOT_DONE;
    pthread_mutex_unlock(&p->mu);
}

/* Waits until slot s is processed, then frees it. */
static void pool_wait(bk_pool *p, int s)
{
    pthread_mutex_lock(&p->mu);
    while (p->state[s] != SLOT_DONE)
        pthread_cond_wait(&p->done, &p->mu);
    p->state[s] = SLOT_FREE;
    pthread_mutex_unlock(&p->mu);
}

/* Lets the workers finish what was submitted, joins them, frees the pool. */
static void pool_stop(bk_pool *p)
{
    pthread_mutex_lock(&p->mu);
    p->quit = true;
    pthread_cond_broadcast(&p->work);
    pthread_mutex_unlock(&p->mu);
    for (int i = 0; i < p->n_th; i++)
        pthread_join(p->th[i], NULL);
    pthread_mutex_destroy(&p->mu);
    pthread_cond_destroy(&p->work);
    pthread_cond_destroy(&p->done);
    free(p->state);
    free(p->queue);
    free(p->th);
    free(p->args);
    memset(p, 0, sizeof *p);
}

/* ---- scanning ---- */

/* A line over DFL_JSONL_MAX_LINE, in any kind of input. */
#define OVERLONG_MSG "line longer than the limit of %u bytes"

typedef struct bk_chunk {
    const char *data;          /* whole lines */
    size_t size;
    uint64_t base;             /* offset of data in its part (mapped parts) */
    uint32_t part;
    bool spill;                /* keep the tokens (stream parts, unless --stats) */
    bool overlong;             /* stands for one line over the length limit (stream parts) */
    char *buf;                 /* owned buffer (stream parts) */
    size_t buf_cap;
    /* results */
    bk_sample *ents;
    size_t n_ents, cap_ents;
    uint8_t *sp;
    size_t sp_n, sp_cap;
    uint64_t lines, blank, skipped, truncated, drop_long, drop_masked, tokens, trained;
    uint64_t bad_line;         /* line (within the chunk) of the first bad record, 0: none */
    int bad_code;
    bool failed;               /* stopped at the bad record (not skipping) */
    char bad_msg[600];
} bk_chunk;

static void chunk_reset(bk_chunk *c)
{
    c->data = NULL;
    c->size = 0;
    c->base = 0;
    c->overlong = false;
    c->n_ents = c->sp_n = 0;
    c->lines = c->blank = c->skipped = c->truncated = c->drop_long = c->drop_masked = 0;
    c->tokens = c->trained = 0;
    c->bad_line = 0;
    c->bad_code = 0;
    c->failed = false;
    c->bad_msg[0] = 0;
}

static int check_vocab(const dfl_sample *s, int64_t vocab, dfl_err *e)
{
    int32_t mx = 0;
    for (size_t i = 0; i < s->n; i++)
        mx = s->ids[i] > mx ? s->ids[i] : mx;
    if (mx < vocab)
        return DFL_OK;
    for (size_t i = 0; i < s->n; i++)
        if (s->ids[i] >= vocab)
            return dfl_fail(e, DFL_EDATA, "input_ids[%zu] = %d is out of range for --vocab-size %lld", i,
                            s->ids[i], (long long)vocab);
    return DFL_OK;
}

static bool chunk_keep(const dfl_bucket_run *r, bk_chunk *c, const dfl_sample *s, const char *line,
                       size_t len)
{
    size_t n = s->n;
    bool trunc = false;
    if (r->max_len && n > r->max_len) {
        if (r->o.long_drop) {
            c->drop_long++;
            return true;
        }
        n = r->max_len;
        trunc = true;
    }
    uint64_t trained = 0;
    for (size_t i = 0; i < n; i++)
        trained += s->mask[i];
    if (trained == 0) {
        c->drop_masked++;
        return true;
    }
    c->truncated += trunc;
    if (c->n_ents == c->cap_ents) {
        size_t cap = c->cap_ents ? c->cap_ents * 2 : 1024;
        bk_sample *ne = realloc(c->ents, cap * sizeof *ne);
        if (!ne)
            return false;
        c->ents = ne;
        c->cap_ents = cap;
    }
    bk_sample *ent = &c->ents[c->n_ents++];
    ent->n_tokens = (uint32_t)n;
    if (c->spill) {
        size_t need = c->sp_n + n * 5;
        if (need > c->sp_cap) {
            size_t cap = c->sp_cap ? c->sp_cap : (1u << 20);
            while (cap < need)
                cap *= 2;
            uint8_t *ns = realloc(c->sp, cap);
            if (!ns)
                return false;
            c->sp = ns;
            c->sp_cap = cap;
        }
        /* spill record: the ids (native i32) then the mask bytes; private to this process */
        ent->where = c->sp_n;
        ent->bytes = 0;
        memcpy(c->sp + c->sp_n, s->ids, n * 4);
        memcpy(c->sp + c->sp_n + n * 4, s->mask, n);
        c->sp_n = need;
    } else {
        ent->where = c->base + (uint64_t)(line - c->data);
        ent->bytes = (uint32_t)len;
    }
    c->tokens += n;
    c->trained += trained;
    return true;
}

/* Parses every line of a chunk (in a worker thread). */
static void chunk_scan(const dfl_bucket_run *r, bk_chunk *c, dfl_sample *s)
{
    const char *p = c->data, *end = c->data + c->size;
    s->count_ids = !c->spill && !r->o.vocab_size; /* the ids of a mapped part are read when written */
    while (p < end) {
        const char *le;
        bool blank = false;
        dfl_err e;
        int rc = dfl_sample_parse_fast_eol(s, p, end, &le);
        if (rc == 1) {
            rc = DFL_OK;
        } else if (rc < 0) {
            rc = dfl_fail(&e, DFL_ENOMEM, "out of memory");
            le = end;
        } else { /* declined: find the line, and let the full parser decide */
            le = memchr(p, '\n', (size_t)(end - p));
            if (!le)
                le = end;
            rc = dfl_sample_parse(s, p, (size_t)(le - p), &blank, &e);
        }
        const char *nl = le < end ? le : NULL;
        size_t len = (size_t)(le - p);
        c->lines++;
        if (len > DFL_JSONL_MAX_LINE) /* as a stream part's overlong line (feed_stream) */
            rc = dfl_fail(&e, DFL_EDATA, OVERLONG_MSG, DFL_JSONL_MAX_LINE);
        if (rc == DFL_OK && !blank && r->o.vocab_size)
            rc = check_vocab(s, r->o.vocab_size, &e);
        if (rc == DFL_OK && !blank && !chunk_keep(r, c, s, p, len))
            rc = dfl_fail(&e, DFL_ENOMEM, "out of memory");
        if (rc) {
            bool fatal = !r->o.skip_bad || rc == DFL_ENOMEM;
            if (!c->bad_line || fatal) { /* the first skipped record, or the one that stops */
                c->bad_line = c->lines;
                c->bad_code = rc;
                snprintf(c->bad_msg, sizeof c->bad_msg, "%s", e.msg);
            }
            if (fatal) {
                c->failed = true;
                return;
            }
            c->skipped++;
        } else if (blank) {
            c->blank++;
        }
        p = nl ? nl + 1 : end;
    }
}

typedef struct scan_ctx {
    dfl_bucket_run *r;
    bk_chunk *ch;              /* [slots] */
    dfl_sample *scratch;       /* [threads] */
} scan_ctx;

static void scan_work(void *ctx, int slot, int worker)
{
    scan_ctx *sc = ctx;
    chunk_scan(sc->r, &sc->ch[slot], &sc->scratch[worker]);
}

static int spill_open(dfl_bucket_run *r, dfl_err *e)
{
    if (r->spill_fd >= 0)
        return DFL_OK;
    char *p = dfl_path_join(r->tmp, "spill.XXXXXX");
    if (!p)
        return dfl_fail(e, DFL_ENOMEM, "out of memory");
    r->spill_fd = mkostemp(p, O_CLOEXEC);
    if (r->spill_fd < 0) {
        int err = errno;
        free(p);
        return dfl_fail_errno(e, DFL_EIO, err, "%s: cannot create the spill file", r->tmp);
    }
    unlink(p); /* it lives as long as the descriptor: nothing to clean up after a crash */
    free(p);
    return DFL_OK;
}

static void progress_read(dfl_bucket_run *r, uint64_t done)
{
    double now = dfl_now();
    if (now - r->t_last < 1.0)
        return;
    r->t_last = now;
    double dt = now - r->t0;
    char a[16], b[16], c[16];
    double rate = dt > 0 ? (double)done / dt : 0;
    if (r->total_size && done <= r->total_size && rate > 0)
        dfl_progress("reading: %s of %s (%.0f%%), %s/s, %zu samples, ETA %.0f s",
                     dfl_fmt_bytes((double)done, a, sizeof a), dfl_fmt_bytes((double)r->total_size, b, sizeof b),
                     100.0 * (double)done / (double)r->total_size, dfl_fmt_bytes(rate, c, sizeof c),
                     r->n_samples, (double)(r->total_size - done) / rate);
    else
        dfl_progress("reading: %s, %s/s, %zu samples", dfl_fmt_bytes((double)done, a, sizeof a),
                     dfl_fmt_bytes(rate, c, sizeof c), r->n_samples);
}

/* Merges one processed chunk into the index (in input order). */
static int merge_chunk(dfl_bucket_run *r, bk_chunk *c, dfl_err *e)
{
    bk_part *pt = &r->parts[c->part];
    if (c->overlong) {
        c->lines = 1;
        c->bad_line = 1;
        c->bad_code = DFL_EDATA;
        c->failed = !r->o.skip_bad;
        c->skipped = !c->failed;
        snprintf(c->bad_msg, sizeof c->bad_msg, OVERLONG_MSG, DFL_JSONL_MAX_LINE);
    }
    if (c->bad_line && c->bad_code == DFL_ENOMEM)
        return dfl_fail(e, DFL_ENOMEM, "%s: out of memory", pt->name);
    if (c->bad_line && (c->failed || !r->first_skip[0])) {
        char msg[sizeof r->first_skip];
        snprintf(msg, sizeof msg, "%s:%llu: %s", pt->name, (unsigned long long)(pt->lines + c->bad_line),
                 c->bad_msg);
        if (c->failed)
            return dfl_fail(e, c->bad_code, "%s (--on-error skip skips bad records)", msg);
        memcpy(r->first_skip, msg, sizeof msg);
    }
    if (r->n_samples + c->n_ents > r->cap_samples) {
        size_t cap = r->cap_samples ? r->cap_samples : 65536;
        while (cap < r->n_samples + c->n_ents)
            cap *= 2;
        bk_sample *ns = realloc(r->samples, cap * sizeof *ns);
        if (!ns)
            return dfl_fail(e, DFL_ENOMEM, "out of memory for the index of %zu samples", cap);
        r->samples = ns;
        r->cap_samples = cap;
    }
    uint64_t add = c->spill ? r->spill_size : 0;
    if (add + c->sp_n > OFF_MASK)
        return dfl_fail(e, DFL_EUNSUP, "%s: spill larger than 256 TiB", pt->name);
    uint64_t tag = (uint64_t)c->part << PART_SHIFT;
    for (size_t k = 0; k < c->n_ents; k++) {
        bk_sample s = c->ents[k];
        s.where = tag | (s.where + add);
        r->samples[r->n_samples++] = s;
    }
    if (c->spill && c->sp_n) {
        int rc = spill_open(r, e);
        if (!rc)
            rc = dfl_write_all(r->spill_fd, c->sp, c->sp_n, "spill file", e);
        if (rc)
            return rc;
        r->spill_size += c->sp_n;
    }
    r->lines += c->lines;
    r->blank += c->blank;
    r->skipped += c->skipped;
    r->truncated += c->truncated;
    r->drop_long += c->drop_long;
    r->drop_masked += c->drop_masked;
    r->tokens += c->tokens;
    r->trained += c->trained;
    r->bytes += c->size;
    pt->lines += c->lines;
    pt->samples += c->n_ents;
    pt->tokens += c->tokens;
    pt->bytes += c->size;
    return DFL_OK;
}

static int add_part(dfl_bucket_run *r, const dfl_part *p, size_t input, dfl_err *e)
{
    if (r->n_parts == MAX_PARTS)
        return dfl_fail(e, DFL_EUNSUP, "%s: more than %d input files and archive members", p->name, MAX_PARTS);
    if (r->n_parts == r->cap_parts) {
        size_t cap = r->cap_parts ? r->cap_parts * 2 : 16;
        bk_part *np = realloc(r->parts, cap * sizeof *np);
        if (!np)
            return dfl_fail(e, DFL_ENOMEM, "out of memory");
        r->parts = np;
        r->cap_parts = cap;
    }
    bk_part *pt = &r->parts[r->n_parts];
    memset(pt, 0, sizeof *pt);
    pt->name = dfl_strdup(p->name);
    if (!pt->name)
        return dfl_fail(e, DFL_ENOMEM, "out of memory");
    pt->mapped = p->mapped;
    pt->data = p->data;
    pt->size = p->size;
    pt->input = input;
    r->n_parts++;
    return DFL_OK;
}

/* Cuts the inputs into chunks of whole lines, in order, across inputs and parts. */
typedef struct feeder {
    size_t i;                  /* current input */
    bool in_part, mapped, any_mapped, part_eof;
    uint32_t part;
    const char *data;          /* mapped part */
    size_t size, pos;
    char *carry;               /* stream part: the start of an incomplete line */
    size_t carry_n, carry_cap;
} feeder;

static uint64_t feeder_consumed(const dfl_bucket_run *r, const feeder *fd)
{
    if (fd->i >= r->n_in || !r->in[fd->i])
        return r->done_size;
    return r->done_size + (fd->mapped ? fd->pos : dfl_input_consumed(r->in[fd->i]));
}

static int buf_reserve(char **buf, size_t *cap, size_t need, dfl_err *e)
{
    if (need <= *cap)
        return DFL_OK;
    size_t c = *cap ? *cap : CHUNK + (64u << 10);
    while (c < need)
        c *= 2;
    char *nb = realloc(*buf, c);
    if (!nb)
        return dfl_fail(e, DFL_ENOMEM, "out of memory for a read buffer of %zu bytes", c);
    *buf = nb;
    *cap = c;
    return DFL_OK;
}

/* The next chunk of a stream part into c; *empty when the part had nothing more. */
static int feed_stream(dfl_bucket_run *r, feeder *fd, dfl_input *in, bk_chunk *c, bool *empty, dfl_err *e)
{
    *empty = false;
    int rc = buf_reserve(&c->buf, &c->buf_cap, fd->carry_n + CHUNK, e);
    if (rc)
        return rc;
    if (fd->carry_n)
        memcpy(c->buf, fd->carry, fd->carry_n);
    size_t n = fd->carry_n, want = CHUNK, done;
    fd->carry_n = 0;
    for (;;) {
        while (!fd->part_eof && n < want) {
            if ((rc = buf_reserve(&c->buf, &c->buf_cap, n + (64u << 10), e)))
                return rc;
            size_t got;
            if ((rc = dfl_input_read(in, c->buf + n, c->buf_cap - n, &got, e)))
                return rc;
            if (got == 0)
                fd->part_eof = true;
            n += got;
        }
        if (n == 0) {
            *empty = true;
            return DFL_OK;
        }
        if (fd->part_eof) {
            done = n;
            break;
        }
        const char *nl = memrchr(c->buf, '\n', n);
        if (nl) {
            done = (size_t)(nl - c->buf) + 1;
            break;
        }
        if (n <= DFL_JSONL_MAX_LINE) { /* one long line so far: read more */
            want = n + CHUNK;
            continue;
        }
        /* a line over the limit: the chunk stands for it; drop the rest of it */
        c->overlong = true;
        c->part = fd->part;
        for (;;) {
            size_t got;
            if ((rc = dfl_input_read(in, c->buf, c->buf_cap, &got, e)))
                return rc;
            if (got == 0) {
                fd->part_eof = true;
                break;
            }
            nl = memchr(c->buf, '\n', got);
            if (nl) {
                size_t rest = got - (size_t)(nl + 1 - c->buf);
                if ((rc = buf_reserve(&fd->carry, &fd->carry_cap, rest, e)))
                    return rc;
                memcpy(fd->carry, nl + 1, rest);
                fd->carry_n = rest;
                break;
            }
        }
        return DFL_OK;
    }
    if (n > done) {
        if ((rc = buf_reserve(&fd->carry, &fd->carry_cap, n - done, e)))
            return rc;
        memcpy(fd->carry, c->buf + done, n - done);
        fd->carry_n = n - done;
    }
    c->data = c->buf;
    c->size = done;
    c->part = fd->part;
    c->spill = !r->o.stats_only;
    return DFL_OK;
}

/* The next chunk of lines into c; *end when every input is read. */
static int feed(dfl_bucket_run *r, feeder *fd, bk_chunk *c, bool *end, dfl_err *e)
{
    *end = false;
    chunk_reset(c);
    for (;;) {
        if (fd->i >= r->n_in) {
            *end = true;
            return DFL_OK;
        }
        dfl_input *in = r->in[fd->i];
        int rc;
        if (!fd->in_part) {
            dfl_part p;
            bool eof;
            if ((rc = dfl_input_next_part(in, &p, &eof, e)))
                return rc;
            if (eof) {
                r->done_size += dfl_input_size(in);
                if (!fd->any_mapped) { /* a stream has nothing more to give: release it */
                    dfl_input_close(in);
                    r->in[fd->i] = NULL;
                }
                fd->i++;
                fd->any_mapped = false;
                continue;
            }
            if ((rc = add_part(r, &p, fd->i, e)))
                return rc;
            fd->part = (uint32_t)(r->n_parts - 1);
            fd->in_part = true;
            fd->mapped = p.mapped;
            fd->data = (const char *)p.data;
            fd->size = p.size;
            fd->pos = 0;
            fd->part_eof = false;
            fd->carry_n = 0;
            if (p.mapped) {
                fd->any_mapped = true;
                if (p.size > OFF_MASK)
                    return dfl_fail(e, DFL_EUNSUP, "%s: larger than 256 TiB", p.name);
                if (stat(r->o.inputs[fd->i], &r->in_st[fd->i]) != 0)
                    memset(&r->in_st[fd->i], 0, sizeof r->in_st[fd->i]);
            }
        }
        if (fd->mapped) {
            if (fd->pos >= fd->size) {
                fd->in_part = false;
                continue;
            }
            size_t end_pos = fd->size - fd->pos > CHUNK ? fd->pos + CHUNK : fd->size;
            if (end_pos < fd->size) {
                const char *nl = memchr(fd->data + end_pos, '\n', fd->size - end_pos);
                end_pos = nl ? (size_t)(nl - fd->data) + 1 : fd->size;
            }
            c->data = fd->data + fd->pos;
            c->size = end_pos - fd->pos;
            c->base = fd->pos;
            c->part = fd->part;
            c->spill = false;
            fd->pos = end_pos;
            return DFL_OK;
        }
        if (fd->part_eof && fd->carry_n == 0) {
            fd->in_part = false;
            continue;
        }
        bool empty;
        if ((rc = feed_stream(r, fd, in, c, &empty, e)))
            return rc;
        if (!empty)
            return DFL_OK;
        fd->in_part = false;
    }
}

int dfl_bucket_scan(dfl_bucket_run *r, dfl_err *e)
{
    int n_slots = 2 * r->threads + 2;
    scan_ctx sc = {r, NULL, NULL};
    sc.ch = calloc((size_t)n_slots, sizeof *sc.ch);
    sc.scratch = calloc((size_t)r->threads, sizeof *sc.scratch);
    feeder fd;
    memset(&fd, 0, sizeof fd);
    bk_pool pool;
    int rc = DFL_OK;
    if (!sc.ch || !sc.scratch) {
        free(sc.ch);
        free(sc.scratch);
        return dfl_fail(e, DFL_ENOMEM, "out of memory");
    }
    rc = pool_start(&pool, r->threads, n_slots, scan_work, &sc, e);
    if (!rc) {
        uint64_t filled = 0, merged = 0;
        bool end = false;
        for (;;) {
            while (!rc && !end && filled - merged < (uint64_t)n_slots) {
                int s = (int)(filled % (uint64_t)n_slots);
                rc = feed(r, &fd, &sc.ch[s], &end, e);
                if (rc || end)
                    break;
                if (sc.ch[s].overlong)
                    pool_skip(&pool, s);
                else
                    pool_submit(&pool, s);
                filled++;
            }
            if (merged == filled)
                break;
            int s = (int)(merged % (uint64_t)n_slots);
            pool_wait(&pool, s);
            if (!rc)
                rc = merge_chunk(r, &sc.ch[s], e);
            merged++;
            if (!rc && stopped(r))
                rc = stop_fail(e);
            if (!rc)
                progress_read(r, feeder_consumed(r, &fd));
        }
        pool_stop(&pool);
    }
    for (int i = 0; i < n_slots; i++) {
        free(sc.ch[i].ents);
        free(sc.ch[i].sp);
        free(sc.ch[i].buf);
    }
    free(sc.ch);
    for (int i = 0; i < r->threads; i++)
        dfl_sample_free(&sc.scratch[i]);
    free(sc.scratch);
    free(fd.carry);
    dfl_progress_end();
    r->t_scan = dfl_now();
    if (rc)
        return rc;
    if (r->skipped)
        dfl_warn("skipped %llu bad record%s; the first: %s", (unsigned long long)r->skipped,
                 r->skipped == 1 ? "" : "s", r->first_skip);
    if (r->spill_fd >= 0 && r->spill_size) {
        void *m = mmap(NULL, r->spill_size, PROT_READ, MAP_SHARED, r->spill_fd, 0);
        if (m == MAP_FAILED)
            return dfl_fail_errno(e, DFL_EIO, errno, "%s: cannot map the spill file", r->tmp);
        r->spill_map = m;
    }
    return DFL_OK;
}

/* ---- planning ---- */

int dfl_bucket_plan(dfl_bucket_run *r, dfl_err *e)
{
    size_t n = r->n_samples;
    if (n == 0)
        return dfl_fail(e, DFL_EDATA, "no samples left (%llu lines: %llu skipped, %llu too long, %llu without a "
                        "trained token, %llu blank)", (unsigned long long)r->lines,
                        (unsigned long long)r->skipped, (unsigned long long)r->drop_long,
                        (unsigned long long)r->drop_masked, (unsigned long long)r->blank);
    if (n > UINT32_MAX)
        return dfl_fail(e, DFL_EUNSUP, "%zu samples: more than %u are not supported", n, UINT32_MAX);
    int rc = DFL_OK;
    uint32_t *lens = malloc(n * sizeof *lens);
    uint32_t *order = malloc(n * sizeof *order);
    size_t *start = NULL;
    if (!lens || !order) {
        rc = dfl_fail(e, DFL_ENOMEM, "out of memory planning %zu samples", n);
        goto out;
    }
    r->len_min = UINT32_MAX;
    r->len_max = 0;
    memset(r->hist_n, 0, sizeof r->hist_n);
    memset(r->hist_tok, 0, sizeof r->hist_tok);
    for (size_t i = 0; i < n; i++) {
        uint32_t l = r->samples[i].n_tokens;
        lens[i] = l;
        r->len_min = l < r->len_min ? l : r->len_min;
        r->len_max = l > r->len_max ? l : r->len_max;
        int b = 31 - __builtin_clz(l);
        r->hist_n[b]++;
        r->hist_tok[b] += l;
    }
    if (r->o.auto_k) {
        free(r->bounds);
        r->bounds = malloc(r->o.auto_k * sizeof *r->bounds);
        if (!r->bounds) {
            rc = dfl_fail(e, DFL_ENOMEM, "out of memory");
            goto out;
        }
        rc = dfl_bucket_auto_bounds(lens, n, r->o.auto_k, r->bounds, &r->n_bounds, e);
        if (rc)
            goto out;
    }
    size_t nb = r->n_bounds;
    r->bk = calloc(nb, sizeof *r->bk);
    r->sh = calloc(r->o.shards, sizeof *r->sh);
    start = calloc(nb + 1, sizeof *start);
    if (!r->bk || !r->sh || !start) {
        rc = dfl_fail(e, DFL_ENOMEM, "out of memory");
        goto out;
    }
    /* group by bucket, input order kept within each */
    for (size_t i = 0; i < n; i++) {
        size_t b = dfl_bucket_find(r->bounds, nb, lens[i]);
        if (b == nb) {
            rc = dfl_fail(e, DFL_EDATA, "internal: a sample of %u tokens is above the last bucket bound %u",
                          lens[i], r->bounds[nb - 1]);
            goto out;
        }
        r->bk[b].samples++;
        r->bk[b].tokens += lens[i];
    }
    for (size_t b = 0; b < nb; b++)
        start[b + 1] = start[b] + r->bk[b].samples;
    {
        size_t *fill = malloc(nb * sizeof *fill);
        if (!fill) {
            rc = dfl_fail(e, DFL_ENOMEM, "out of memory");
            goto out;
        }
        memcpy(fill, start, nb * sizeof *fill);
        for (size_t i = 0; i < n; i++)
            order[fill[dfl_bucket_find(r->bounds, nb, lens[i])]++] = (uint32_t)i;
        free(fill);
    }
    dfl_rng rng;
    dfl_rng_seed(&rng, r->o.seed);
    size_t cap_b = 0, cap_m = 0;
    for (size_t b = 0; b < nb && !rc; b++) {
        dfl_rng_shuffle_u32(&rng, order + start[b], start[b + 1] - start[b]);
        uint32_t min_len = b == 0 ? 1 : r->bounds[b - 1] + 1;
        rc = dfl_bucket_pack(order + start[b], start[b + 1] - start[b], lens, min_len, r->o.max_tokens,
                             (uint32_t)b, &r->batches, &r->n_batches, &cap_b, &r->members, &r->n_members,
                             &cap_m, e);
    }
    if (rc)
        goto out;
    if (r->n_batches > UINT32_MAX) {
        rc = dfl_fail(e, DFL_EUNSUP, "more than %u batches", UINT32_MAX);
        goto out;
    }
    r->batch_order = malloc(r->n_batches * sizeof *r->batch_order);
    r->shard_list = malloc(r->n_batches * sizeof *r->shard_list);
    r->shard_start = calloc((size_t)r->o.shards + 1, sizeof *r->shard_start);
    if (!r->batch_order || !r->shard_list || !r->shard_start) {
        rc = dfl_fail(e, DFL_ENOMEM, "out of memory");
        goto out;
    }
    for (size_t i = 0; i < r->n_batches; i++)
        r->batch_order[i] = (uint32_t)i;
    dfl_rng_shuffle_u32(&rng, r->batch_order, r->n_batches);
    dfl_bucket_deal(r->batches, r->batch_order, r->n_batches, r->o.shards);
    for (size_t i = 0; i < r->n_batches; i++) {
        const dfl_bk_batch *bt = &r->batches[i];
        bk_bucket *bk = &r->bk[bt->bucket];
        bk->batches++;
        bk->capacity += bt->n_tokens > r->o.max_tokens ? bt->n_tokens : r->o.max_tokens;
        if (bt->n_seqs > bk->warm.seqs)
            bk->warm.seqs = bt->n_seqs;
        if (bt->n_tokens > bk->warm.tokens)
            bk->warm.tokens = bt->n_tokens;
        if (bt->max_len > bk->warm.max_len)
            bk->warm.max_len = bt->max_len;
        bk_shard *sh = &r->sh[bt->shard];
        sh->batches++;
        sh->tokens += bt->n_tokens;
        sh->samples += bt->n_seqs;
        r->shard_start[bt->shard + 1]++;
    }
    for (uint32_t s = 0; s < r->o.shards; s++)
        r->shard_start[s + 1] += r->shard_start[s];
    {
        uint64_t *fill = malloc(r->o.shards * sizeof *fill);
        if (!fill) {
            rc = dfl_fail(e, DFL_ENOMEM, "out of memory");
            goto out;
        }
        memcpy(fill, r->shard_start, r->o.shards * sizeof *fill);
        for (size_t i = 0; i < r->n_batches; i++) {
            uint32_t b = r->batch_order[i];
            r->shard_list[fill[r->batches[b].shard]++] = b;
        }
        free(fill);
    }
    r->planned = true;
    r->t_plan = dfl_now();
out:
    free(lens);
    free(order);
    free(start);
    return rc;
}

/* ---- the report ---- */

static void pct(char *buf, size_t n, uint64_t a, uint64_t b)
{
    if (b)
        snprintf(buf, n, "%.1f%%", 100.0 * (double)a / (double)b);
    else
        snprintf(buf, n, "-");
}

char *dfl_bucket_report(const dfl_bucket_run *r)
{
    char *text = NULL;
    size_t len = 0;
    FILE *f = open_memstream(&text, &len);
    if (!f)
        return NULL;
    char a[16];
    fprintf(f, "inputs: %zu (%zu files or archive members), %llu lines, %s\n", r->n_in, r->n_parts,
            (unsigned long long)r->lines, dfl_fmt_bytes((double)r->bytes, a, sizeof a));
    fprintf(f, "samples: %zu kept; %llu skipped (bad), %llu dropped (longer than %u), %llu dropped (no trained "
            "token), %llu truncated to %u, %llu blank lines\n", r->n_samples, (unsigned long long)r->skipped,
            (unsigned long long)r->drop_long, r->max_len, (unsigned long long)r->drop_masked,
            (unsigned long long)r->truncated, r->max_len, (unsigned long long)r->blank);
    fprintf(f, "tokens: %llu, trained %llu\n", (unsigned long long)r->tokens, (unsigned long long)r->trained);
    if (!r->planned) {
        fclose(f);
        return text;
    }
    fprintf(f, "lengths: min %u, max %u, mean %.1f\n", r->len_min, r->len_max,
            (double)r->tokens / (double)r->n_samples);
    fprintf(f, "\nlength histogram:\n%12s %12s %12s %14s %8s\n", "from", "to", "samples", "tokens", "share");
    int lo = 0, hi = HIST_BINS - 1;
    while (lo < HIST_BINS && !r->hist_n[lo])
        lo++;
    while (hi > lo && !r->hist_n[hi])
        hi--;
    for (int b = lo; b <= hi; b++) {
        char s[16];
        pct(s, sizeof s, r->hist_n[b], r->n_samples);
        fprintf(f, "%12llu %12llu %12llu %14llu %8s\n", 1ull << b, (2ull << b) - 1,
                (unsigned long long)r->hist_n[b], (unsigned long long)r->hist_tok[b], s);
    }
    fprintf(f, "\nbuckets (max-tokens %llu, seed %llu):\n%8s %10s %10s %14s %9s %10s %8s %10s %9s\n",
            (unsigned long long)r->o.max_tokens, (unsigned long long)r->o.seed, "bucket", "bound", "samples",
            "tokens", "batches", "efficiency", "max-seqs", "max-tokens", "max-len");
    for (size_t b = 0; b < r->n_bounds; b++) {
        const bk_bucket *bk = &r->bk[b];
        char s[16];
        pct(s, sizeof s, bk->tokens, bk->capacity);
        fprintf(f, "%8zu %10u %10llu %14llu %9llu %10s %8u %10llu %9u\n", b, r->bounds[b],
                (unsigned long long)bk->samples, (unsigned long long)bk->tokens, (unsigned long long)bk->batches, s,
                bk->warm.seqs, (unsigned long long)bk->warm.tokens, bk->warm.max_len);
    }
    uint64_t cap = 0;
    for (size_t b = 0; b < r->n_bounds; b++)
        cap += r->bk[b].capacity;
    char s[16];
    pct(s, sizeof s, r->tokens, cap);
    fprintf(f, "%8s %10s %10zu %14llu %9zu %10s\n", "total", "", r->n_samples, (unsigned long long)r->tokens,
            r->n_batches, s);
    fprintf(f, "\nshards: %u\n%8s %9s %14s %10s\n", r->o.shards, "shard", "batches", "tokens", "samples");
    for (uint32_t i = 0; i < r->o.shards; i++)
        fprintf(f, "%8u %9llu %14llu %10llu\n", i, (unsigned long long)r->sh[i].batches,
                (unsigned long long)r->sh[i].tokens, (unsigned long long)r->sh[i].samples);
    fclose(f);
    return text;
}

void dfl_bucket_summary(const dfl_bucket_run *r, char *buf, size_t n)
{
    char a[16], b[16];
    double dt = (r->t_write > 0 ? r->t_write : r->t_scan) - r->t0;
    if (dt <= 0)
        dt = 1e-9;
    snprintf(buf, n, "%zu samples, %llu tokens from %s in %.2f s (%s/s, %.0f samples/s) -> %zu batch%s in %u "
             "shard%s; dropped %llu too long + %llu without a trained token, truncated %llu, skipped %llu",
             r->n_samples, (unsigned long long)r->tokens, dfl_fmt_bytes((double)r->bytes, a, sizeof a), dt,
             dfl_fmt_bytes((double)r->bytes / dt, b, sizeof b), (double)(r->n_samples + r->drop_long +
             r->drop_masked) / dt, r->n_batches, r->n_batches == 1 ? "" : "es", r->o.shards, r->o.shards == 1 ? "" : "s",
             (unsigned long long)r->drop_long, (unsigned long long)r->drop_masked,
             (unsigned long long)r->truncated, (unsigned long long)r->skipped);
}

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
    pool_wait(&y->pool, s);
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
    pool_submit(&y->pool, s);
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
    pool_stop(&y->pool);
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
        if (!rc && stopped(r))
            rc = stop_fail(&e);
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
    int rc = pool_start(&W.sync.pool, 1, SYNC_SLOTS, sync_work, &W.sync.c, e);
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

void dfl_bucket_close(dfl_bucket_run *r)
{
    if (!r)
        return;
    if (!r->complete)
        for (size_t i = 0; i < r->n_moved; i++)
            unlink(r->moved[i]);
    for (size_t i = 0; i < r->n_moved; i++)
        free(r->moved[i]);
    free(r->moved);
    if (r->spill_map)
        munmap(r->spill_map, r->spill_size);
    if (r->spill_fd >= 0)
        close(r->spill_fd);
    if (r->tmp)
        remove_flat_dir(r->tmp);
    if (!r->complete && r->dir_created && r->dir)
        rmdir(r->dir); /* only if empty */
    for (size_t i = 0; i < r->n_in; i++)
        dfl_input_close(r->in[i]);
    free(r->in);
    free(r->in_st);
    for (size_t i = 0; i < r->n_parts; i++)
        free(r->parts[i].name);
    free(r->parts);
    free(r->samples);
    free(r->bounds);
    free(r->batches);
    free(r->members);
    free(r->batch_order);
    free(r->shard_list);
    free(r->shard_start);
    free(r->bk);
    free(r->sh);
    free(r->dir);
    free(r->tmp);
    free(r);
}
