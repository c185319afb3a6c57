/* target_run.c: the dfl-target driver: reads token-batch streams, runs the target forward on each
 * batch, and hands the hidden-state batches to a writer thread through a small bounded queue, so
 * that writing to a slow pipe overlaps the next forward. Stops at a batch boundary when a signal
 * handler sets the stop flag (no END frame: the consumer sees a cut stream). */
#include <errno.h>
#include <pthread.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/stat.h>
#include <unistd.h>

#include "json.h"
#include "log.h"
#include "target.h"
#include "util.h"

#define QUEUE_DEPTH 2

/* Batches waiting to be written, and the writer thread's state. */
typedef struct outq {
    pthread_mutex_t mu;
    pthread_cond_t cv;
    dfl_batch *item[QUEUE_DEPTH];
    int head, count;
    bool done;       /* no more batches will come: write what is queued, then return */
    bool stop;       /* return as soon as possible */
    bool failed;     /* the writer failed: err holds why */
    dfl_err err;
    dfl_writer *w;
    uint64_t written;
    volatile sig_atomic_t *sig;  /* the run's stop flag: waits look at it */
    bool may_hang;               /* the output is a pipe or device: a write can block for good */
} outq;

/* The error of a run stopped by signal sig after n batches. */
static int stopped(dfl_err *e, int sig, uint64_t n)
{
    return dfl_fail(e, DFL_EINTR, "stopped by signal %d (%s) after %llu batches: the output stream "
                    "was cut without an end frame", sig, strsignal(sig), (unsigned long long)n);
}

/* A wait on q->cv of at most 50 ms, so that the caller looks at the stop flag again. */
static void timed_wait(outq *q)
{
    struct timespec ts;
    clock_gettime(CLOCK_REALTIME, &ts);
    ts.tv_nsec += 50000000L;
    if (ts.tv_nsec >= 1000000000L) {
        ts.tv_sec++;
        ts.tv_nsec -= 1000000000L;
    }
    pthread_cond_timedwait(&q->cv, &q->mu, &ts);
}

static void free_batch(dfl_batch *b)
{
    if (b) {
        dfl_batch_free(b);
        free(b);
    }
}

/* The writer thread. */
static void *writer_main(void *arg)
{
    outq *q = arg;
    pthread_mutex_lock(&q->mu);
    for (;;) {
        while (!q->count && !q->done && !q->stop)
            pthread_cond_wait(&q->cv, &q->mu);
        if (q->stop || !q->count)
            break;
        dfl_batch *b = q->item[q->head];
        q->item[q->head] = NULL;
        q->head = (q->head + 1) % QUEUE_DEPTH;
        q->count--;
        pthread_cond_broadcast(&q->cv);
        pthread_mutex_unlock(&q->mu);
        dfl_err err = {0};
        int rc = dfl_writer_batch(q->w, b, &err);
        free_batch(b);
        pthread_mutex_lock(&q->mu);
        if (rc) {
            q->failed = true;
            q->err = err;
            pthread_cond_broadcast(&q->cv);
            break;
        }
        q->written++;
    }
    pthread_mutex_unlock(&q->mu);
    return NULL;
}

/* Queues b (taking it over); fails with the writer's error if the writer has failed, or with
 * DFL_EINTR if a signal stops the run while the queue is full (a consumer that does not read). */
static int push(outq *q, dfl_batch *b, uint64_t n_done, dfl_err *e)
{
    pthread_mutex_lock(&q->mu);
    while (q->count == QUEUE_DEPTH && !q->failed && !(q->sig && *q->sig))
        timed_wait(q);
    if (q->failed || q->count == QUEUE_DEPTH) {
        int rc;
        if (q->failed) {
            *e = q->err;
            rc = e->code;
        } else {
            rc = stopped(e, (int)*q->sig, n_done);
        }
        pthread_mutex_unlock(&q->mu);
        free_batch(b);
        return rc;
    }
    q->item[(q->head + q->count) % QUEUE_DEPTH] = b;
    q->count++;
    pthread_cond_broadcast(&q->cv);
    pthread_mutex_unlock(&q->mu);
    return DFL_OK;
}

/* Ends the writer thread: after writing the queue (finish) or at once. A signal while the queue
 * is being finished turns it into a stop (DFL_EINTR). After a stop, a writer still blocked 0.2 s
 * later on a pipe whose reader does not read (q->may_hang) is not waited for: it is detached
 * and *left is set; it may still use q and the dfl_writer, which the caller must then never
 * free (the process is about to end; no pthread_cancel, which the sanitizers do not support).
 * Returns the writer's error, if any. */
static int finish_writer(outq *q, pthread_t th, bool finish, uint64_t n_done, bool *left, dfl_err *e)
{
    *left = false;
    pthread_mutex_lock(&q->mu);
    if (finish)
        q->done = true;
    else
        q->stop = true;
    pthread_cond_broadcast(&q->cv);
    pthread_mutex_unlock(&q->mu);
    bool stopping = !finish, by_signal = false;
    double give_up = dfl_now() + 0.2;
    for (;;) {
        struct timespec ts;
        clock_gettime(CLOCK_REALTIME, &ts);
        ts.tv_nsec += 50000000L;
        if (ts.tv_nsec >= 1000000000L) {
            ts.tv_sec++;
            ts.tv_nsec -= 1000000000L;
        }
        if (pthread_timedjoin_np(th, NULL, &ts) != ETIMEDOUT)
            break;
        if (!stopping && q->sig && *q->sig) {
            pthread_mutex_lock(&q->mu);
            q->stop = true;
            pthread_cond_broadcast(&q->cv);
            pthread_mutex_unlock(&q->mu);
            stopping = by_signal = true;
            give_up = dfl_now() + 0.2;
        }
        if (stopping && q->may_hang && dfl_now() >= give_up) {
            pthread_detach(th);
            *left = true;
            break;
        }
    }
    pthread_mutex_lock(&q->mu);
    if (!*left)
        for (int i = 0; i < QUEUE_DEPTH; i++) {
            free_batch(q->item[i]);
            q->item[i] = NULL;
        }
    int rc = DFL_OK;
    if (q->failed) {
        *e = q->err;
        rc = e->code;
    } else if (by_signal) {
        rc = stopped(e, (int)*q->sig, n_done);
    }
    pthread_mutex_unlock(&q->mu);
    return rc;
}

/* True when the output is a pipe, FIFO, socket or device: a write there blocks for as long as
 * its reader does not read. */
static bool output_may_block(const char *path)
{
    struct stat sb;
    if (strcmp(path, "-") == 0)
        return fstat(1, &sb) == 0 && !S_ISREG(sb.st_mode);
    return stat(path, &sb) == 0 && !S_ISREG(sb.st_mode);
}

static int open_input(const char *path, dfl_reader **r, dfl_err *e)
{
    int rc = dfl_reader_open(r, path, NULL, e);
    if (rc)
        return rc;
    const dfl_stream_info *in = dfl_reader_info(*r);
    if (in->kind != DFL_KIND_TOKENS) {
        rc = dfl_fail(e, DFL_EDATA, "%s: not a token-batch stream (it holds hidden states); "
                      "dfl-target reads what dfl-bucket writes", dfl_reader_name(*r));
        dfl_reader_close(*r);
        *r = NULL;
    }
    return rc;
}

/* Activation buffers and capture buffers, sized together. */
typedef struct buffers {
    dfl_target_ws *ws;
    void *caps[DFL_MAX_LAYERS];   /* [T, H] of the stream dtype, backend memory */
    int n_caps;
} buffers;

static void buffers_free(dfl_target *t, buffers *bf)
{
    dfl_target_ws_free(t, bf->ws);
    bf->ws = NULL;
    for (int k = 0; k < bf->n_caps; k++) {
        if (bf->caps[k])
            t->be->ops->free(t->be, bf->caps[k]);
        bf->caps[k] = NULL;
    }
}

static int buffers_new(dfl_target *t, buffers *bf, const dfl_target_run_opts *o, int64_t T,
                       int64_t S, dfl_err *e)
{
    buffers_free(t, bf);
    bf->n_caps = o->n_caps;
    int rc = dfl_target_ws_new(t, T, S, &bf->ws, e);
    if (rc)
        return rc;
    size_t bytes = (size_t)bf->ws->max_tokens * (size_t)t->cfg.hidden_size * dfl_dtype_size(o->dtype);
    for (int k = 0; k < o->n_caps; k++)
        if (!(bf->caps[k] = t->be->ops->alloc(t->be, bytes, e)))
            return dfl_err_prefix(e, "capture buffers: ");
    char b1[32];
    dfl_verbose("buffers for %lld tokens, %lld sequences: %s on %s", (long long)bf->ws->max_tokens,
                (long long)bf->ws->max_seqs,
                dfl_fmt_bytes((double)(bf->ws->bytes + (uint64_t)bytes * (uint64_t)o->n_caps), b1, sizeof b1),
                t->be->name);
    return DFL_OK;
}

/* Makes sure the buffers hold batch b: sized at the first batch (or --max-tokens), grown on
 * demand when allowed. */
static int fit(dfl_target *t, buffers *bf, const dfl_target_run_opts *o, const dfl_batch *b,
               const char *name, dfl_err *e)
{
    int64_t T = (int64_t)b->n_tokens, S = b->n_seqs;
    if (!bf->ws) {
        /* --max-tokens sizes them (a first batch larger than that is handled below); without
         * it, the first batch does */
        int rc = o->max_tokens > 0 ? buffers_new(t, bf, o, o->max_tokens, o->max_tokens, e)
                                   : buffers_new(t, bf, o, T, S, e);
        if (rc)
            return rc;
    }
    if (T <= bf->ws->max_tokens && S <= bf->ws->max_seqs)
        return DFL_OK;
    if (!o->grow)
        return dfl_fail(e, DFL_EUSAGE, "batch %llu has %lld tokens in %lld sequences, more than "
                        "the buffers were sized for (%lld tokens, %lld sequences); rerun with "
                        "--max-tokens %lld or more", (unsigned long long)b->index,
                        (long long)T, (long long)S, (long long)bf->ws->max_tokens,
                        (long long)bf->ws->max_seqs, (long long)(T > S ? T : S));
    /* grow by half at least, so that slowly rising sizes do not reallocate at every batch */
    int64_t mt = bf->ws->max_tokens, ms = bf->ws->max_seqs;
    if (T > mt)
        mt = T > mt + mt / 2 ? T : mt + mt / 2;
    if (S > ms)
        ms = S > ms + ms / 2 ? S : ms + ms / 2;
    dfl_verbose("%s: batch %llu has %lld tokens in %lld sequences: growing the buffers",
                name, (unsigned long long)b->index, (long long)T, (long long)S);
    return buffers_new(t, bf, o, mt, ms, e);
}

/* The hidden-state batch for input batch b, from the capture buffers. */
static int make_output(dfl_target *t, buffers *bf, const dfl_target_run_opts *o,
                       const dfl_batch *b, dfl_batch **out, dfl_err *e)
{
    *out = NULL;
    dfl_be *be = t->be;
    dfl_batch *ob = calloc(1, sizeof *ob);
    if (!ob)
        return dfl_fail(e, DFL_ENOMEM, "out of memory");
    int rc = dfl_batch_alloc(ob, b->n_tokens, b->n_seqs, (uint32_t)o->n_caps,
                             (uint32_t)t->cfg.hidden_size, o->dtype, e);
    if (rc) {
        free(ob);
        return rc;
    }
    memcpy((void *)ob->seq_lens, b->seq_lens, (size_t)b->n_seqs * sizeof *b->seq_lens);
    memcpy((void *)ob->input_ids, b->input_ids, (size_t)b->n_tokens * sizeof *b->input_ids);
    memcpy((void *)ob->loss_mask, b->loss_mask, (size_t)b->n_tokens);
    size_t bytes = (size_t)b->n_tokens * (size_t)t->cfg.hidden_size * dfl_dtype_size(o->dtype);
    for (int k = 0; k < o->n_caps && bytes && !rc; k++)
        rc = be->ops->download(be, (void *)ob->layers[k], bf->caps[k], bytes);
    if (!rc)
        rc = be->ops->sync(be, e);
    if (rc) {
        free_batch(ob);
        return dfl_fail(e, rc, "batch %llu: copying hidden states from %s failed",
                        (unsigned long long)b->index, be->name);
    }
    *out = ob;
    return DFL_OK;
}

int dfl_target_run(dfl_target *t, const dfl_target_run_opts *o, dfl_target_stats *st, dfl_err *e)
{
    memset(st, 0, sizeof *st);
    const char *out_name = strcmp(o->output, "-") == 0 ? "stdout" : o->output;
    dfl_reader *r = NULL;
    dfl_writer *w = NULL;
    buffers bf = {0};
    /* on the heap: a writer left blocked on a consumer that does not read still uses it */
    outq *q = calloc(1, sizeof *q);
    pthread_t th;
    bool thread_started = false, left = false;
    json_t *meta = NULL;
    int rc;

    if (!q)
        return dfl_fail(e, DFL_ENOMEM, "out of memory");
    pthread_mutex_init(&q->mu, NULL);
    pthread_cond_init(&q->cv, NULL);
    q->sig = o->stop;
    q->may_hang = output_may_block(o->output);
    if ((rc = open_input(o->inputs[0], &r, e))) {
        free(q);
        return rc;
    }

    dfl_stream_info info;
    memset(&info, 0, sizeof info);
    info.kind = DFL_KIND_HIDDEN;
    info.version_major = DFL_FRAME_MAJOR;
    info.version_minor = DFL_FRAME_MINOR;
    snprintf(info.producer, sizeof info.producer, "dfl-target %s", DFL_VERSION);
    info.vocab_size = t->cfg.vocab_size;
    info.hidden_size = t->cfg.hidden_size;
    info.n_layers = o->n_caps;
    memcpy(info.layers, o->layers, (size_t)o->n_caps * sizeof *o->layers);
    info.dtype = o->dtype;
    snprintf(info.fingerprint, sizeof info.fingerprint, "%s", t->fingerprint);
    meta = json_pack("{s:{s:s,s:I}}", "target", "model_type", t->cfg.model_type,
                     "num_hidden_layers", (json_int_t)t->cfg.n_layers);
    info.meta = meta;
    if ((rc = dfl_writer_open(&w, o->output, &info, &o->wopts, e)))
        goto done;
    q->w = w;
    if (pthread_create(&th, NULL, writer_main, q) != 0) {
        rc = dfl_fail(e, DFL_EIO, "cannot start the writer thread");
        goto done;
    }
    thread_started = true;

    double t0 = dfl_now(), last_report = t0;
    double report_every = isatty(2) ? 1.0 : 10.0;
    for (int in = 0; in < o->n_inputs && !rc; in++) {
        if (!r && (rc = open_input(o->inputs[in], &r, e)))
            break;
        const char *name = dfl_reader_name(r);
        for (;;) {
            if (o->stop && *o->stop) {
                rc = stopped(e, (int)*o->stop, st->batches);
                break;
            }
            dfl_batch b;
            memset(&b, 0, sizeof b);
            bool eos = false;
            if ((rc = dfl_reader_next(r, &b, &eos, e)) || eos)
                break;
            if (o->stop && *o->stop) { /* arrived while waiting for input: do not start it */
                dfl_batch_free(&b);
                continue;
            }
            dfl_batch *ob = NULL;
            if ((rc = fit(t, &bf, o, &b, name, e)) ||
                (rc = dfl_target_forward(t, bf.ws, &b, o->n_caps, o->layers, o->dtype, bf.caps, e)) ||
                (rc = make_output(t, &bf, o, &b, &ob, e))) {
                dfl_err_prefix(e, "%s: ", name);
                dfl_batch_free(&b);
                break;
            }
            st->batches++;
            st->seqs += b.n_seqs;
            st->tokens += b.n_tokens;
            dfl_batch_free(&b);
            if ((rc = push(q, ob, st->batches, e)))
                break;
            double now = dfl_now();
            st->seconds = now - t0;
            if (now - last_report >= report_every) {
                last_report = now;
                dfl_progress("%llu batches, %llu tokens, %.0f tokens/s",
                             (unsigned long long)st->batches, (unsigned long long)st->tokens,
                             st->tokens / (st->seconds > 0 ? st->seconds : 1e-9));
            }
        }
        dfl_reader_close(r);
        r = NULL;
    }
    {
        dfl_err we = {0};
        int wrc = finish_writer(q, th, rc == DFL_OK, st->batches, &left, &we);
        thread_started = false;
        if (!rc && wrc) {
            rc = wrc;
            *e = we;
        }
    }
    if (!rc) {
        rc = dfl_writer_close(w, e);
        w = NULL;
    }
    st->seconds = dfl_now() - t0;
done:
    if (thread_started) {
        dfl_err we = {0};
        finish_writer(q, th, false, st->batches, &left, &we);
    }
    if (w && !left)
        dfl_writer_abort(w);
    if (r)
        dfl_reader_close(r);
    buffers_free(t, &bf);
    json_decref(meta);
    if (rc == DFL_EPIPE)
        dfl_fail(e, DFL_EPIPE, "%s: the consumer went away (broken pipe) after %llu batches",
                 out_name, (unsigned long long)q->written);
    if (!left) {
        pthread_mutex_destroy(&q->mu);
        pthread_cond_destroy(&q->cv);
        free(q);
    }
    dfl_progress_end();
    return rc;
}
