/* draft_input.c: input streams, reader threads and the batch pool of the drafter trainer (see
 * draft_input.h). */
#include "draft_input.h"

#include <errno.h>
#include <pthread.h>
#include <signal.h>
#include <stdlib.h>
#include <string.h>
#include <sys/stat.h>
#include <time.h>

#include "draft_data.h"
#include "json.h"
#include "log.h"
#include "util.h"

#define RING 4           /* replay: batches a file's thread reads ahead */

typedef struct pooled {
    dfl_batch b;
    int32_t file;        /* input index */
    int64_t idx;         /* batch index within the file (replay) */
} pooled;

typedef struct input {
    char *path;
    dfl_reader *rd;      /* opened by dfl_draft_src_open; stream mode: the thread's */
    dfl_reader *trd;     /* replay: the prefetch thread's own reader */
    /* replay: the file's batches */
    int64_t nb;
    uint64_t *offsets;
    uint32_t *ntok, *nseq;
    /* replay prefetch ring */
    pooled ring[RING];
    int rhead, rcount;
    bool done;           /* thread finished (eos, error, stop) */
    pthread_t th;
    bool started;
    struct dfl_draft_src *src;
    int32_t index;
} input;

struct dfl_draft_src {
    dfl_draft_src_opts o;
    int n;
    input *in;
    bool replay;
    dfl_dtype dtype;
    int32_t layers[DFL_MAX_LAYERS];
    int n_layers;
    /* replay */
    int64_t nb;          /* batches per epoch */
    int32_t *g_file;     /* [nb] global list: file, index */
    int64_t *g_idx;
    int64_t *order;      /* [nb] permutation of the epoch `order_epoch` (main thread) */
    int order_epoch;
    int epoch;           /* next batch to enter the pool: order_epoch(epoch)[pos] */
    int64_t pos;
    /* stream */
    pooled *q;
    int qcap, qhead, qn;
    int live;            /* inputs still running */
    /* both */
    pthread_mutex_t mu;
    pthread_cond_t cv;
    int err_code;
    dfl_err err;
    bool stopping, started;
    pooled *pool;
    int pool_n;
    pooled cur;
    bool have_cur;
    int64_t consumed;
};

/* ---- opening and checking ------------------------------------------------------------------ */

static int check_header(const dfl_draft_src_opts *o, const char *path, const dfl_stream_info *si,
                        dfl_err *e)
{
    if (si->kind != DFL_KIND_HIDDEN)
        return dfl_fail(e, DFL_EMISMATCH, "%s: a token stream, not hidden states (run it through "
                        "dfl-target first)", path);
    if (o->fingerprint && strcmp(si->fingerprint, o->fingerprint) != 0)
        return dfl_fail(e, DFL_EMISMATCH, "%s: made from another target: its fingerprint is '%s', "
                        "--target's is '%s'", path, si->fingerprint[0] ? si->fingerprint : "(none)",
                        o->fingerprint);
    if (si->hidden_size != o->hidden)
        return dfl_fail(e, DFL_EMISMATCH, "%s: hidden size %lld, the target's is %lld", path,
                        (long long)si->hidden_size, (long long)o->hidden);
    if (si->vocab_size && o->vocab && si->vocab_size != o->vocab)
        return dfl_fail(e, DFL_EMISMATCH, "%s: vocabulary of %lld, the target's is %lld", path,
                        (long long)si->vocab_size, (long long)o->vocab);
    bool same = si->n_layers == o->n_layers;
    for (int i = 0; same && i < o->n_layers; i++)
        same = si->layers[i] == o->layers[i];
    if (!same) {
        char a[256] = "", b[256] = "";
        size_t k = 0;
        for (int i = 0; i < si->n_layers && k < sizeof a - 12; i++)
            k += (size_t)snprintf(a + k, sizeof a - k, "%s%d", i ? "," : "", si->layers[i]);
        k = 0;
        for (int i = 0; i < o->n_layers && k < sizeof b - 12; i++)
            k += (size_t)snprintf(b + k, sizeof b - k, "%s%d", i ? "," : "", o->layers[i]);
        return dfl_fail(e, DFL_EMISMATCH, "%s: captured target layers %s, the drafter's target "
                        "layer ids are %s", path, a, b);
    }
    if (si->dtype != DFL_BF16 && si->dtype != DFL_F32 && si->dtype != DFL_F16)
        return dfl_fail(e, DFL_EUNSUP, "%s: hidden states in %s (bf16, f16 or f32 expected)", path,
                        dfl_dtype_lower(si->dtype));
    return DFL_OK;
}

static bool regular_file(const char *path)
{
    struct stat st;
    return strcmp(path, "-") != 0 && stat(path, &st) == 0 && S_ISREG(st.st_mode);
}

/* An input that ended without an END frame, allowed by allow_truncated: say how much of it
 * there was (its reader's counts). */
static void warn_truncated(const input *in)
{
    const dfl_stream_end *end = dfl_reader_end(in->rd);
    dfl_warn("%s: cut short (no END frame) after %llu complete batches: training on those "
             "(--allow-truncated)", strcmp(in->path, "-") ? in->path : "stdin",
             (unsigned long long)end->n_batches);
}

/* A cut input without allow_truncated: say how to use what it has. */
static int hint_truncated(const dfl_draft_src_opts *o, dfl_err *e)
{
    size_t n = strlen(e->msg);
    if (e->code == DFL_ETRUNC && !o->allow_truncated && n < sizeof e->msg)
        snprintf(e->msg + n, sizeof e->msg - n, " (--allow-truncated trains on the complete "
                 "batches of a cut input)");
    return e->code;
}

/* Replay: the batch table of a file, from its index, or by walking it. */
static int read_table(input *in, dfl_draft_src_opts *o, dfl_err *e)
{
    const dfl_index_entry *ent;
    uint64_t n;
    int rc = dfl_reader_index(in->rd, &ent, &n, e);
    if (rc == DFL_OK) {
        in->nb = (int64_t)n;
        in->offsets = malloc((n ? n : 1) * sizeof *in->offsets);
        in->ntok = malloc((n ? n : 1) * sizeof *in->ntok);
        in->nseq = malloc((n ? n : 1) * sizeof *in->nseq);
        if (!in->offsets || !in->ntok || !in->nseq)
            return dfl_fail(e, DFL_ENOMEM, "out of memory");
        for (uint64_t i = 0; i < n; i++) {
            in->offsets[i] = ent[i].offset;
            in->ntok[i] = ent[i].n_tokens;
            in->nseq[i] = ent[i].n_seqs;
        }
        return DFL_OK;
    }
    if (rc != DFL_EUNSUP && rc != DFL_ETRUNC)
        return rc;
    dfl_err_clear(e);
    /* no index: walk the file once (this also checks every frame). A file without END is walked
     * too: to its last complete batch with allow_truncated, else to the cut, which the error then
     * names (the frame and its offset). */
    int64_t cap = 0;
    for (;;) {
        dfl_batch b = {0};
        bool eos = false;
        if ((rc = dfl_reader_next(in->rd, &b, &eos, e)))
            return hint_truncated(o, e);
        if (eos)
            break;
        if (in->nb == cap) {
            cap = cap ? 2 * cap : 64;
            uint64_t *no = realloc(in->offsets, (size_t)cap * sizeof *no);
            if (no)
                in->offsets = no;
            uint32_t *nt = realloc(in->ntok, (size_t)cap * sizeof *nt);
            if (nt)
                in->ntok = nt;
            uint32_t *ns = realloc(in->nseq, (size_t)cap * sizeof *ns);
            if (ns)
                in->nseq = ns;
            if (!no || !nt || !ns) {
                dfl_batch_free(&b);
                return dfl_fail(e, DFL_ENOMEM, "out of memory");
            }
        }
        in->offsets[in->nb] = b.offset;
        in->ntok[in->nb] = (uint32_t)b.n_tokens;
        in->nseq[in->nb] = b.n_seqs;
        in->nb++;
        dfl_batch_free(&b);
    }
    if (dfl_reader_truncated(in->rd))
        warn_truncated(in);
    return DFL_OK;
}

int dfl_draft_src_open(dfl_draft_src **out, const dfl_draft_src_opts *o, dfl_err *e)
{
    *out = NULL;
    if (o->n_inputs < 1)
        return dfl_fail(e, DFL_EUSAGE, "no input");
    dfl_draft_src *s = calloc(1, sizeof *s);
    if (!s)
        return dfl_fail(e, DFL_ENOMEM, "out of memory");
    s->o = *o;
    s->n = o->n_inputs;
    if (o->layers) {
        if (o->n_layers < 1 || o->n_layers > DFL_MAX_LAYERS) {
            free(s);
            return dfl_fail(e, DFL_EUSAGE, "%d target layers", o->n_layers);
        }
        memcpy(s->layers, o->layers, (size_t)o->n_layers * sizeof *s->layers);
        s->n_layers = o->n_layers;
        s->o.layers = s->layers;
    }
    if (s->o.pool_size < 1)
        s->o.pool_size = 1;
    if (s->o.min_ready < 1)
        s->o.min_ready = 1;
    if (s->o.min_ready > s->o.pool_size)
        s->o.min_ready = s->o.pool_size;
    if (s->o.epochs < 1)
        s->o.epochs = 1;
    pthread_mutex_init(&s->mu, NULL);
    pthread_cond_init(&s->cv, NULL);
    s->in = calloc((size_t)s->n, sizeof *s->in);
    s->pool = calloc((size_t)s->o.pool_size, sizeof *s->pool);
    s->qcap = 2 * s->n > 4 ? 2 * s->n : 4;
    s->q = calloc((size_t)s->qcap, sizeof *s->q);
    s->order_epoch = -1;
    if (!s->in || !s->pool || !s->q) {
        dfl_draft_src_close(s);
        return dfl_fail(e, DFL_ENOMEM, "out of memory");
    }
    s->replay = true;
    for (int i = 0; i < s->n; i++)
        if (!regular_file(o->inputs[i]))
            s->replay = false;
    if (!s->replay && s->o.epochs > 1) {
        dfl_draft_src_close(s);
        return dfl_fail(e, DFL_EUSAGE, "--epochs %d needs every input to be a regular file (a pipe "
                        "can be read once)", o->epochs);
    }
    dfl_reader_opts ro = {.no_verify = o->no_verify, .allow_truncated = o->allow_truncated};
    int rc = DFL_OK;
    for (int i = 0; i < s->n && !rc; i++) {
        input *in = &s->in[i];
        in->src = s;
        in->index = i;
        in->path = dfl_strdup(o->inputs[i]);
        if (!in->path) {
            rc = dfl_fail(e, DFL_ENOMEM, "out of memory");
            break;
        }
        if ((rc = dfl_reader_open(&in->rd, in->path, &ro, e)))
            break;
        const dfl_stream_info *si = dfl_reader_info(in->rd);
        if (i == 0 && !o->layers) {
            s->n_layers = si->n_layers;
            memcpy(s->layers, si->layers, sizeof s->layers);
            s->o.layers = s->layers;
            s->o.n_layers = s->n_layers;
        }
        if ((rc = check_header(&s->o, strcmp(in->path, "-") ? in->path : "stdin", si, e)))
            break;
        if (i == 0)
            s->dtype = si->dtype;
        else if (si->dtype != s->dtype)
            rc = dfl_fail(e, DFL_EMISMATCH, "%s: hidden states in %s, %s has %s", in->path,
                          dfl_dtype_lower(si->dtype), s->in[0].path, dfl_dtype_lower(s->dtype));
        if (!rc && s->replay)
            rc = read_table(in, &s->o, e);
    }
    if (!rc && s->replay) {
        for (int i = 0; i < s->n; i++)
            s->nb += s->in[i].nb;
        s->g_file = malloc((size_t)(s->nb ? s->nb : 1) * sizeof *s->g_file);
        s->g_idx = malloc((size_t)(s->nb ? s->nb : 1) * sizeof *s->g_idx);
        s->order = malloc((size_t)(s->nb ? s->nb : 1) * sizeof *s->order);
        if (!s->g_file || !s->g_idx || !s->order)
            rc = dfl_fail(e, DFL_ENOMEM, "out of memory");
        for (int64_t i = 0, k = 0; !rc && i < s->n; i++)
            for (int64_t j = 0; j < s->in[i].nb; j++, k++) {
                s->g_file[k] = (int32_t)i;
                s->g_idx[k] = j;
            }
    }
    if (rc) {
        dfl_draft_src_close(s);
        return rc;
    }
    *out = s;
    return DFL_OK;
}

bool dfl_draft_src_replay(const dfl_draft_src *s) { return s->replay; }
const int32_t *dfl_draft_src_layers(const dfl_draft_src *s, int *n)
{
    *n = s->o.n_layers;
    return s->o.layers;
}
int64_t dfl_draft_src_batches(const dfl_draft_src *s) { return s->replay ? s->nb : -1; }
dfl_dtype dfl_draft_src_dtype(const dfl_draft_src *s) { return s->dtype; }

void dfl_draft_src_max(const dfl_draft_src *s, int max_anchors, int64_t *max_tokens,
                       int64_t *max_blocks)
{
    int64_t t = 0, b = 0;
    for (int i = 0; i < s->n; i++)
        for (int64_t j = 0; j < s->in[i].nb; j++) {
            int64_t nb = dfl_draft_max_blocks(s->in[i].ntok[j], s->in[i].nseq[j], max_anchors);
            if (s->in[i].ntok[j] > t)
                t = s->in[i].ntok[j];
            if (nb > b)
                b = nb;
        }
    *max_tokens = t;
    *max_blocks = b;
}

/* ---- replay order -------------------------------------------------------------------------- */

/* The permutation of epoch e: Fisher-Yates with a generator seeded by hash(seed, e). */
static void epoch_order(const dfl_draft_src *s, int e, int64_t *out)
{
    dfl_rng r;
    dfl_rng_seed(&r, dfl_hash2(s->o.seed, 0x45504f4348ull + (uint64_t)e));
    for (int64_t i = 0; i < s->nb; i++)
        out[i] = i;
    for (int64_t i = s->nb - 1; i > 0; i--) {
        int64_t j = (int64_t)dfl_rng_below(&r, (uint64_t)(i + 1));
        int64_t t = out[i];
        out[i] = out[j];
        out[j] = t;
    }
}

static int read_replay(dfl_reader *rd, input *in, int64_t idx, pooled *p, dfl_err *e)
{
    memset(p, 0, sizeof *p);
    p->file = in->index;
    p->idx = idx;
    int rc = dfl_reader_batch_at(rd, in->offsets[idx], &p->b, e);
    if (!rc && (p->b.n_tokens != in->ntok[idx] || p->b.n_seqs != in->nseq[idx]))
        rc = dfl_fail(e, DFL_EDATA, "%s: batch %lld has %llu tokens in %u sequences, its index says "
                      "%u in %u", in->path, (long long)idx, (unsigned long long)p->b.n_tokens,
                      p->b.n_seqs, in->ntok[idx], in->nseq[idx]);
    return rc;
}

/* pthread_cond_wait for the main thread, waking every 0.2 s to look at the stop flag; true
 * when stopped. */
static bool main_wait(dfl_draft_src *s)
{
    if (s->o.stop && *s->o.stop)
        return true;
    struct timespec ts;
    clock_gettime(CLOCK_REALTIME, &ts);
    ts.tv_nsec += 200 * 1000 * 1000;
    if (ts.tv_nsec >= 1000000000) {
        ts.tv_sec++;
        ts.tv_nsec -= 1000000000;
    }
    pthread_cond_timedwait(&s->cv, &s->mu, &ts);
    return s->o.stop && *s->o.stop;
}

static void set_error(dfl_draft_src *s, const dfl_err *e)
{
    if (!s->err_code) {
        s->err_code = e->code ? e->code : DFL_EIO;
        s->err = *e;
        hint_truncated(&s->o, &s->err);
    }
}

/* Replay prefetch thread of one file: walks the same order as the pool from (epoch, pos) and
 * reads its own batches, in order, into its ring. */
typedef struct replay_arg {
    input *in;
    int epoch;
    int64_t pos;
} replay_arg;

static void *replay_thread(void *arg)
{
    replay_arg a = *(replay_arg *)arg;
    free(arg);
    input *in = a.in;
    dfl_draft_src *s = in->src;
    int64_t *order = malloc((size_t)(s->nb ? s->nb : 1) * sizeof *order);
    dfl_err e = {0};
    if (!order) {
        dfl_fail(&e, DFL_ENOMEM, "out of memory");
        pthread_mutex_lock(&s->mu);
        set_error(s, &e);
        in->done = true;
        pthread_cond_broadcast(&s->cv);
        pthread_mutex_unlock(&s->mu);
        return NULL;
    }
    for (int ep = a.epoch; ep < s->o.epochs; ep++) {
        epoch_order(s, ep, order);
        for (int64_t p = ep == a.epoch ? a.pos : 0; p < s->nb; p++) {
            int64_t g = order[p];
            if (s->g_file[g] != in->index)
                continue;
            pthread_mutex_lock(&s->mu);
            while (in->rcount == RING && !s->stopping)
                pthread_cond_wait(&s->cv, &s->mu);
            bool stop = s->stopping;
            pthread_mutex_unlock(&s->mu);
            if (stop)
                goto out;
            pooled pb;
            int rc = read_replay(in->trd, in, s->g_idx[g], &pb, &e);
            pthread_mutex_lock(&s->mu);
            if (rc) {
                set_error(s, &e);
                pthread_cond_broadcast(&s->cv);
                pthread_mutex_unlock(&s->mu);
                goto out;
            }
            in->ring[(in->rhead + in->rcount) % RING] = pb;
            in->rcount++;
            pthread_cond_broadcast(&s->cv);
            pthread_mutex_unlock(&s->mu);
        }
    }
out:
    free(order);
    pthread_mutex_lock(&s->mu);
    in->done = true;
    pthread_cond_broadcast(&s->cv);
    pthread_mutex_unlock(&s->mu);
    return NULL;
}

/* Stream thread: reads its input to the end into the shared queue. */
static void *stream_thread(void *arg)
{
    input *in = arg;
    dfl_draft_src *s = in->src;
    dfl_err e = {0};
    for (;;) {
        pooled pb = {.file = in->index, .idx = -1};
        bool eos = false;
        int rc = dfl_reader_next(in->rd, &pb.b, &eos, &e);
        pthread_mutex_lock(&s->mu);
        if (rc || eos) {
            if (rc)
                set_error(s, &e);
            else if (dfl_reader_truncated(in->rd))
                warn_truncated(in);
            in->done = true;
            s->live--;
            pthread_cond_broadcast(&s->cv);
            pthread_mutex_unlock(&s->mu);
            return NULL;
        }
        while (s->qn == s->qcap && !s->stopping)
            pthread_cond_wait(&s->cv, &s->mu);
        if (s->stopping) {
            pthread_mutex_unlock(&s->mu);
            dfl_batch_free(&pb.b);
            return NULL;
        }
        s->q[(s->qhead + s->qn) % s->qcap] = pb;
        s->qn++;
        pthread_cond_broadcast(&s->cv);
        pthread_mutex_unlock(&s->mu);
    }
}

static int start_threads(dfl_draft_src *s, dfl_err *e)
{
    sigset_t block, old;
    sigemptyset(&block);
    sigaddset(&block, SIGINT);
    sigaddset(&block, SIGTERM);
    sigaddset(&block, SIGHUP);
    pthread_sigmask(SIG_BLOCK, &block, &old);   /* signals go to the main thread */
    int rc = DFL_OK;
    s->live = s->n;
    for (int i = 0; i < s->n && !rc; i++) {
        input *in = &s->in[i];
        int r;
        if (s->replay) {
            dfl_reader_opts ro = {.no_verify = s->o.no_verify, .allow_truncated = s->o.allow_truncated};
            if ((rc = dfl_reader_open(&in->trd, in->path, &ro, e)))
                break;
            replay_arg *a = malloc(sizeof *a);
            if (!a) {
                rc = dfl_fail(e, DFL_ENOMEM, "out of memory");
                break;
            }
            *a = (replay_arg){in, s->epoch, s->pos};
            r = pthread_create(&in->th, NULL, replay_thread, a);
            if (r)
                free(a);
        } else {
            r = pthread_create(&in->th, NULL, stream_thread, in);
        }
        if (r)
            rc = dfl_fail_errno(e, DFL_EIO, r, "cannot start a reader thread");
        else
            in->started = true;
    }
    pthread_sigmask(SIG_SETMASK, &old, NULL);
    s->started = true;
    return rc;
}

void dfl_draft_src_close(dfl_draft_src *s)
{
    if (!s)
        return;
    pthread_mutex_lock(&s->mu);
    s->stopping = true;
    pthread_cond_broadcast(&s->cv);
    pthread_mutex_unlock(&s->mu);
    /* A stream thread may be blocked reading a pipe whose producer stalls: it is given 0.2 s,
     * then left, detached, and the source is not freed (that thread may still use it; the
     * process is about to end). No pthread_cancel: the sanitizers do not support it. */
    bool left = false;
    double give_up = dfl_now() + 0.2;
    for (int i = 0; s->in && i < s->n; i++) {
        if (!s->in[i].started)
            continue;
        if (s->replay) {
            pthread_join(s->in[i].th, NULL);
            continue;
        }
        for (;;) {
            struct timespec ts;
            clock_gettime(CLOCK_REALTIME, &ts);
            ts.tv_nsec += 20 * 1000 * 1000;
            if (ts.tv_nsec >= 1000000000) {
                ts.tv_sec++;
                ts.tv_nsec -= 1000000000;
            }
            if (pthread_timedjoin_np(s->in[i].th, NULL, &ts) != ETIMEDOUT)
                break;
            if (dfl_now() >= give_up) {
                pthread_detach(s->in[i].th);
                left = true;
                break;
            }
        }
    }
    if (left)
        return;
    for (int i = 0; s->in && i < s->n; i++) {
        input *in = &s->in[i];
        for (int k = 0; k < in->rcount; k++)
            dfl_batch_free(&in->ring[(in->rhead + k) % RING].b);
        dfl_reader_close(in->trd);
        dfl_reader_close(in->rd);
        free(in->path);
        free(in->offsets);
        free(in->ntok);
        free(in->nseq);
    }
    for (int k = 0; s->q && k < s->qn; k++)
        dfl_batch_free(&s->q[(s->qhead + k) % s->qcap].b);
    for (int k = 0; s->pool && k < s->pool_n; k++)
        dfl_batch_free(&s->pool[k].b);
    if (s->have_cur)
        dfl_batch_free(&s->cur.b);
    free(s->in);
    free(s->q);
    free(s->pool);
    free(s->g_file);
    free(s->g_idx);
    free(s->order);
    pthread_mutex_destroy(&s->mu);
    pthread_cond_destroy(&s->cv);
    free(s);
}

/* ---- the pool ------------------------------------------------------------------------------ */

/* Replay: the next batch in order into the pool, from its file's ring (blocking). False at the
 * end of the last epoch. */
static int replay_take(dfl_draft_src *s, bool *got, double *waited, dfl_err *e)
{
    *got = false;
    if (s->pos >= s->nb) {
        s->epoch++;
        s->pos = 0;
    }
    if (s->epoch >= s->o.epochs || s->nb == 0)
        return DFL_OK;
    if (s->order_epoch != s->epoch) {
        epoch_order(s, s->epoch, s->order);
        s->order_epoch = s->epoch;
    }
    int64_t g = s->order[s->pos];
    input *in = &s->in[s->g_file[g]];
    double t0 = dfl_now();
    pthread_mutex_lock(&s->mu);
    while (in->rcount == 0 && !in->done && !s->err_code)
        if (main_wait(s)) {
            pthread_mutex_unlock(&s->mu);
            return dfl_fail(e, DFL_EINTR, "stopped while waiting for input");
        }
    if (in->rcount == 0) {
        int rc = s->err_code ? dfl_fail(e, s->err_code, "%s", s->err.msg)
                             : dfl_fail(e, DFL_EDATA, "%s: reader stopped early", in->path);
        pthread_mutex_unlock(&s->mu);
        return rc;
    }
    pooled p = in->ring[in->rhead];
    in->rhead = (in->rhead + 1) % RING;
    in->rcount--;
    pthread_cond_broadcast(&s->cv);
    pthread_mutex_unlock(&s->mu);
    *waited += dfl_now() - t0;
    if (p.idx != s->g_idx[g]) {
        dfl_batch_free(&p.b);
        return dfl_fail(e, DFL_EDATA, "%s: internal error: batch %lld read where %lld was expected",
                        in->path, (long long)p.idx, (long long)s->g_idx[g]);
    }
    s->pool[s->pool_n++] = p;
    s->pos++;
    *got = true;
    return DFL_OK;
}

bool dfl_draft_src_would_wait(dfl_draft_src *s)
{
    if (s->replay || !s->started)
        return false;
    pthread_mutex_lock(&s->mu);
    int64_t have = s->pool_n + s->qn;
    bool wait = !s->err_code && have < s->o.min_ready && s->live > 0;
    pthread_mutex_unlock(&s->mu);
    return wait;
}

int dfl_draft_src_next(dfl_draft_src *s, dfl_rng *rng, const dfl_batch **b, double *waited,
                       dfl_err *e)
{
    *b = NULL;
    *waited = 0;
    if (s->have_cur) {
        dfl_batch_free(&s->cur.b);
        s->have_cur = false;
    }
    int rc;
    if (!s->started && (rc = start_threads(s, e)))
        return rc;
    if (s->replay) {
        while (s->pool_n < s->o.pool_size) {
            bool got;
            if ((rc = replay_take(s, &got, waited, e)))
                return rc;
            if (!got)
                break;
        }
    } else {
        double t0 = dfl_now();
        pthread_mutex_lock(&s->mu);
        for (;;) {
            while (s->qn > 0 && s->pool_n < s->o.pool_size) {
                s->pool[s->pool_n++] = s->q[s->qhead];
                s->qhead = (s->qhead + 1) % s->qcap;
                s->qn--;
                pthread_cond_broadcast(&s->cv);
            }
            if (s->err_code) {
                rc = dfl_fail(e, s->err_code, "%s", s->err.msg);
                pthread_mutex_unlock(&s->mu);
                return rc;
            }
            if (s->pool_n >= s->o.min_ready || (s->live == 0 && s->qn == 0))
                break;
            if (main_wait(s)) {
                pthread_mutex_unlock(&s->mu);
                return dfl_fail(e, DFL_EINTR, "stopped while waiting for input");
            }
        }
        pthread_mutex_unlock(&s->mu);
        *waited += dfl_now() - t0;
    }
    if (s->pool_n == 0)
        return DFL_OK;
    int64_t i = (int64_t)dfl_rng_below(rng, (uint64_t)s->pool_n);
    s->cur = s->pool[i];
    s->pool[i] = s->pool[--s->pool_n];
    s->have_cur = true;
    s->consumed++;
    *b = &s->cur.b;
    return DFL_OK;
}

/* ---- state --------------------------------------------------------------------------------- */

json_t *dfl_draft_src_state(const dfl_draft_src *s)
{
    json_t *j = json_object();
    json_object_set_new(j, "mode", json_string(s->replay ? "replay" : "stream"));
    json_object_set_new(j, "batches_consumed", json_integer(s->consumed));
    if (!s->replay)
        return j;
    json_object_set_new(j, "epoch", json_integer(s->epoch));
    json_object_set_new(j, "position", json_integer(s->pos));
    json_t *pool = json_array(), *files = json_array();
    for (int k = 0; k < s->pool_n; k++) {
        json_t *pair = json_array();
        json_array_append_new(pair, json_integer(s->pool[k].file));
        json_array_append_new(pair, json_integer(s->pool[k].idx));
        json_array_append_new(pool, pair);
    }
    for (int i = 0; i < s->n; i++) {
        json_t *f = json_object();
        json_object_set_new(f, "path", json_string(s->in[i].path));
        json_object_set_new(f, "batches", json_integer(s->in[i].nb));
        json_array_append_new(files, f);
    }
    json_object_set_new(j, "pool", pool);
    json_object_set_new(j, "inputs", files);
    return j;
}

int dfl_draft_src_restore(dfl_draft_src *s, const json_t *st, dfl_err *e)
{
    const char *mode = NULL;
    int64_t v = 0;
    int rc;
    if (s->started)
        return dfl_fail(e, DFL_EUSAGE, "input: restore after the start");
    if ((rc = dfl_json_str(st, "mode", true, &mode, "trainer_state.json data", e)))
        return rc;
    if ((rc = dfl_json_int(st, "batches_consumed", false, &v, "trainer_state.json data", e)))
        return rc;
    s->consumed = v;
    if (!s->replay || strcmp(mode, "replay") != 0)
        return DFL_OK;   /* streams restart where the producers are; only counters carry over */
    const json_t *files = json_object_get(st, "inputs");
    if (!json_is_array(files) || (int)json_array_size(files) != s->n)
        return dfl_fail(e, DFL_EMISMATCH, "--resume: the checkpoint was trained on %zu input files, "
                        "this run has %d (give the same files to continue exactly)",
                        json_is_array(files) ? json_array_size(files) : 0, s->n);
    for (int i = 0; i < s->n; i++) {
        int64_t nb = -1;
        dfl_json_int(json_array_get(files, (size_t)i), "batches", false, &nb, "", NULL);
        if (nb != s->in[i].nb)
            return dfl_fail(e, DFL_EMISMATCH, "--resume: input %d (%s) has %lld batches, the "
                            "checkpoint's had %lld", i + 1, s->in[i].path, (long long)s->in[i].nb,
                            (long long)nb);
    }
    int64_t ep = 0, pos = 0;
    if ((rc = dfl_json_int(st, "epoch", true, &ep, "trainer_state.json data", e)) ||
        (rc = dfl_json_int(st, "position", true, &pos, "trainer_state.json data", e)))
        return rc;
    if (ep < 0 || pos < 0 || pos > s->nb)
        return dfl_fail(e, DFL_EDATA, "trainer_state.json: data position %lld/%lld out of range",
                        (long long)ep, (long long)pos);
    s->epoch = (int)ep;
    s->pos = pos;
    const json_t *pool = json_object_get(st, "pool");
    if (!json_is_array(pool) || json_array_size(pool) > (size_t)s->o.pool_size)
        return dfl_fail(e, DFL_EDATA, "trainer_state.json: the pool has %zu batches, --pool-size is "
                        "%d (resume with the same --pool-size)",
                        json_is_array(pool) ? json_array_size(pool) : 0, s->o.pool_size);
    for (size_t k = 0; k < json_array_size(pool); k++) {
        const json_t *pr = json_array_get(pool, k);
        int64_t f = json_integer_value(json_array_get(pr, 0)), i = json_integer_value(json_array_get(pr, 1));
        if (!json_is_array(pr) || f < 0 || f >= s->n || i < 0 || i >= s->in[f].nb)
            return dfl_fail(e, DFL_EDATA, "trainer_state.json: pool entry %zu is not a batch of "
                            "the inputs", k);
        if ((rc = read_replay(s->in[f].rd, &s->in[f], i, &s->pool[s->pool_n], e)))
            return rc;
        s->pool_n++;
    }
    return DFL_OK;
}

int dfl_draft_check_stream(const dfl_draft_src_opts *o, const char *path, const dfl_stream_info *si,
                           dfl_err *e)
{
    return check_header(o, path, si, e);
}
