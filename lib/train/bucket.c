/* bucket.c: dfl-bucket's run (see bucket.h): open it (options, inputs, the output directory), the
 * ordered work pipeline that scanning and writing share, the report and summary, and closing it.
 * Planning is in bucket_plan.c, scanning in bucket_scan.c, shard writing in bucket_write.c. */
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

int dfl_bucket_pool_start(bk_pool *p, int n_th, int n_slots, void (*fn)(void *, int, int), void *ctx, dfl_err *e)
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
        dfl_bucket_pool_stop(p);
        return dfl_fail(e, DFL_ENOMEM, "out of memory");
    }
    for (int i = 0; i < n_th; i++) {
        p->args[i].p = p;
        p->args[i].id = i;
        int err = pthread_create(&p->th[i], NULL, pool_main, &p->args[i]);
        if (err) {
            dfl_bucket_pool_stop(p);
            return dfl_fail_errno(e, DFL_EIO, err, "cannot start a worker thread");
        }
        p->n_th = i + 1;
    }
    return DFL_OK;
}

void dfl_bucket_pool_submit(bk_pool *p, int s)
{
    pthread_mutex_lock(&p->mu);
    p->state[s] = SLOT_READY;
    p->queue[(p->q_head + p->q_len) % p->n_slots] = s;
    p->q_len++;
    pthread_cond_signal(&p->work);
    pthread_mutex_unlock(&p->mu);
}

/* A slot that needs no work (it is collected like the others). */
void dfl_bucket_pool_skip(bk_pool *p, int s)
{
    pthread_mutex_lock(&p->mu);
    p->state[s] = SLOT_DONE;
    pthread_mutex_unlock(&p->mu);
}

/* Waits until slot s is processed, then frees it. */
void dfl_bucket_pool_wait(bk_pool *p, int s)
{
    pthread_mutex_lock(&p->mu);
    while (p->state[s] != SLOT_DONE)
        pthread_cond_wait(&p->done, &p->mu);
    p->state[s] = SLOT_FREE;
    pthread_mutex_unlock(&p->mu);
}

/* Lets the workers finish what was submitted, joins them, frees the pool. */
void dfl_bucket_pool_stop(bk_pool *p)
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
