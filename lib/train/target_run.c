/* target_run.c: the dfl-target driver, a pipeline of three threads.
 *
 *   reader   reads the token-batch streams, checks every batch against the model and stages its
 *            lengths, ids, mask, positions and cu_seqlens, up to IN_DEPTH batches ahead;
 *   forward  (the calling thread) takes a staged batch and a free output slot and enqueues the
 *            batch: on a GPU the uploads of its inputs, the forward and the copies of the captured
 *            layers to the slot's pinned host buffers, all asynchronous; it waits for the writer
 *            only when every slot is in flight, and never for the GPU;
 *   writer   takes the slots in order, waits for their copies (an event, on its own thread),
 *            frames, checksums and writes them, and gives the slots back.
 *
 * On a GPU, batch i uses output slot i % inflight and device capture set i % 2:
 *   compute stream: upload(i) | wait set_free[i % 2] | forward(i) into the set | record done(i)
 *   copy stream:    wait done(i) | copy the set to the slot | record copied(i), set_free[i % 2]
 * so a capture set is overwritten only after the copies out of it have completed (ordered on the
 * GPU, no host wait), and a slot's host buffers (which also stage the next batch's uploads) only
 * after the writer has written them. On the CPU the same pipeline runs with the forward writing
 * straight into the slot's buffers, or into the output file's mapping.
 *
 * Device memory is one arena (activations and the two capture sets) sized before the first batch:
 * from --max-tokens, a dfl-bucket manifest, the inputs' warm-up shapes (their header's meta) or
 * index, or else the first batch. On a GPU a warm-up forward on the largest shape precedes the
 * first batch and device allocation is frozen after it. A signal stops the run at a batch
 * boundary (no END frame). */
#include <errno.h>
#include <pthread.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/mman.h>
#include <sys/stat.h>
#include <time.h>
#include <unistd.h>

#include "json.h"
#include "log.h"
#include "target.h"
#include "tune_file.h"
#include "util.h"


#define IN_DEPTH 4         /* token batches read and staged ahead */
#define MAX_INFLIGHT 64
#define CAP_SETS 2         /* device capture sets (GPU) */
#define POLL_NS 50000000L  /* waits wake up this often to look at the stop flag */

/* ------------------------------------------------------------------------------------------ */
/* small helpers */

static void deadline_in(struct timespec *ts, long ns)
{
    clock_gettime(CLOCK_REALTIME, ts);
    ts->tv_nsec += ns;
    while (ts->tv_nsec >= 1000000000L) {
        ts->tv_nsec -= 1000000000L;
        ts->tv_sec++;
    }
}

static bool grow_buf(void **p, uint64_t *cap, uint64_t need, size_t elem)
{
    if (need <= *cap)
        return true;
    uint64_t c = *cap ? *cap : 256;
    while (c < need)
        c *= 2;
    void *q = realloc(*p, (size_t)(c * elem));
    if (!q)
        return false;
    *p = q;
    *cap = c;
    return true;
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

/* ------------------------------------------------------------------------------------------ */
/* the reader thread */

typedef struct in_item {
    int input;                 /* which input it came from */
    uint64_t index;            /* batch number within that input */
    uint64_t n_tokens;
    uint32_t n_seqs;
    int32_t max_len;
    uint32_t *lens;            /* [S] */
    int32_t *ids, *pos;        /* [T] */
    uint8_t *mask;             /* [T] */
    int32_t *cu;               /* [S + 1] */
    uint64_t cap_t, cap_s, cap_m, cap_p, cap_c;
} in_item;

typedef struct inq {
    pthread_mutex_t mu;
    pthread_cond_t cv;
    in_item items[IN_DEPTH];
    int head, count;           /* filled items, in order */
    bool eof;                  /* the reader is done; after the items, rc and err say how */
    int rc;
    dfl_err err;
    bool quit;                 /* asked to stop */
    bool exited;               /* the thread is about to return */
    bool abandoned;            /* the caller has gone: the thread frees this on its way out */
    int64_t vocab;             /* the model's vocabulary size (the thread never holds the model) */
    const char *const *inputs; /* the caller's strings, valid for the process's life */
    int n_inputs;
    dfl_reader *first;         /* inputs[0], opened by the caller (checked before any output) */
    char (*names)[256];        /* [n_inputs] reader names, for messages */
} inq;

static void in_free(inq *q);

static int item_fill(in_item *it, const dfl_batch *b, int input)
{
    uint64_t T = b->n_tokens, S = b->n_seqs;
    if (!grow_buf((void **)&it->lens, &it->cap_s, S, 4) ||
        !grow_buf((void **)&it->ids, &it->cap_t, T, 4) ||
        !grow_buf((void **)&it->pos, &it->cap_p, T, 4) ||
        !grow_buf((void **)&it->mask, &it->cap_m, T, 1) ||
        !grow_buf((void **)&it->cu, &it->cap_c, S + 1, 4))
        return DFL_ENOMEM;
    it->input = input;
    it->index = b->index;
    it->n_tokens = T;
    it->n_seqs = (uint32_t)S;
    memcpy(it->lens, b->seq_lens, (size_t)S * 4);
    memcpy(it->ids, b->input_ids, (size_t)T * 4);
    memcpy(it->mask, b->loss_mask, (size_t)T);
    it->max_len = dfl_target_positions(b, it->pos, it->cu);
    return DFL_OK;
}

/* The thread may be blocked reading an input (a pipe, a FIFO) when the run stops; the caller then
 * leaves it (in_stop), and it frees its state itself once its read returns. So it touches nothing
 * of the caller's but q, and the strings in q->inputs. */
static void *reader_main(void *arg)
{
    inq *q = arg;
    int rc = DFL_OK;
    dfl_err err = {0};
    bool quit = false;
    for (int in = 0; in < q->n_inputs && !rc && !quit; in++) {
        dfl_reader *r = NULL;
        if (in == 0) {
            pthread_mutex_lock(&q->mu);
            r = q->first;
            q->first = NULL;
            pthread_mutex_unlock(&q->mu);
        } else if ((rc = open_input(q->inputs[in], &r, &err))) {
            break;
        }
        const char *name = dfl_reader_name(r);
        pthread_mutex_lock(&q->mu);
        snprintf(q->names[in], sizeof q->names[in], "%s", name);
        pthread_mutex_unlock(&q->mu);
        for (;;) {
            dfl_batch b;
            memset(&b, 0, sizeof b);
            bool eos = false;
            if ((rc = dfl_reader_next(r, &b, &eos, &err)) || eos)
                break;
            if ((rc = dfl_target_check_vocab(q->vocab, &b, &err))) {
                dfl_err_prefix(&err, "%s: ", name);
                dfl_reader_recycle(r, &b);
                break;
            }
            pthread_mutex_lock(&q->mu);
            while (q->count == IN_DEPTH && !q->quit)
                pthread_cond_wait(&q->cv, &q->mu);
            quit = q->quit;
            in_item *it = &q->items[(q->head + q->count) % IN_DEPTH];
            pthread_mutex_unlock(&q->mu);
            if (quit) {
                dfl_reader_recycle(r, &b);
                break;
            }
            /* the item is the consumer's only after count++ below */
            rc = item_fill(it, &b, in);
            dfl_reader_recycle(r, &b);
            if (rc) {
                rc = dfl_fail(&err, DFL_ENOMEM, "out of memory");
                break;
            }
            pthread_mutex_lock(&q->mu);
            q->count++;
            pthread_cond_broadcast(&q->cv);
            pthread_mutex_unlock(&q->mu);
        }
        dfl_reader_close(r);
    }
    pthread_mutex_lock(&q->mu);
    q->eof = true;
    q->rc = rc;
    q->err = err;
    q->exited = true;
    bool abandoned = q->abandoned;
    pthread_cond_broadcast(&q->cv);
    pthread_mutex_unlock(&q->mu);
    if (abandoned)
        in_free(q);
    return NULL;
}

enum { POP_ITEM, POP_END, POP_STOP };

/* The next staged batch (POP_ITEM), the end of the inputs (POP_END, with the reader's error if
 * any in rc/e), or POP_STOP when the stop flag was set while waiting. */
static int in_pop(inq *q, in_item **it, volatile sig_atomic_t *stop, int *rc, dfl_err *e)
{
    int res;
    pthread_mutex_lock(&q->mu);
    while (!q->count && !q->eof && !(stop && *stop)) {
        struct timespec ts;
        deadline_in(&ts, POLL_NS);
        pthread_cond_timedwait(&q->cv, &q->mu, &ts);
    }
    if (q->count) {
        *it = &q->items[q->head];
        res = POP_ITEM;
    } else if (q->eof) {
        *rc = q->rc;
        if (q->rc)
            *e = q->err;
        res = POP_END;
    } else {
        res = POP_STOP;
    }
    pthread_mutex_unlock(&q->mu);
    return res;
}

static void in_release(inq *q)
{
    pthread_mutex_lock(&q->mu);
    q->head = (q->head + 1) % IN_DEPTH;
    q->count--;
    pthread_cond_broadcast(&q->cv);
    pthread_mutex_unlock(&q->mu);
}

/* Stops the reader thread. Returns true when it has ended (the caller frees q); false when it is
 * still blocked on its input after a short wait: it is then left to end when its read returns
 * (at the latest when the process exits), and frees q itself. */
static bool in_stop(inq *q, pthread_t th)
{
    pthread_mutex_lock(&q->mu);
    q->quit = true;
    pthread_cond_broadcast(&q->cv);
    struct timespec ts;
    deadline_in(&ts, 4 * POLL_NS);
    while (!q->exited && pthread_cond_timedwait(&q->cv, &q->mu, &ts) == 0)
        ;
    bool ended = q->exited;
    if (!ended)
        q->abandoned = true;
    pthread_mutex_unlock(&q->mu);
    if (ended)
        pthread_join(th, NULL);
    else
        pthread_detach(th);
    return ended;
}

static void in_free(inq *q)
{
    if (q->first)
        dfl_reader_close(q->first);
    q->first = NULL;
    for (int i = 0; i < IN_DEPTH; i++) {
        in_item *it = &q->items[i];
        free(it->lens);
        free(it->ids);
        free(it->pos);
        free(it->mask);
        free(it->cu);
    }
    free(q->names);
    pthread_mutex_destroy(&q->mu);
    pthread_cond_destroy(&q->cv);
    free(q);
}

/* ------------------------------------------------------------------------------------------ */
/* output slots */

/* Per-batch figures for --profile, seconds. */
typedef struct prof {
    double in_wait;    /* forward thread waiting for the reader */
    double slot_wait;  /* forward thread waiting for a free slot (every slot in flight) */
    double enqueue;    /* forward thread enqueuing (CPU: includes the forward itself) */
    double forward;    /* GPU time of the forward (CPU: host time) */
    double copy;       /* GPU time of the device-to-host copies */
    double copy_wait;  /* writer waiting for the copies */
    double write;      /* writer framing, checksumming and writing */
    uint64_t tokens;
} prof;

typedef struct slot {
    uint64_t in_index;         /* the batch's number within its input (for messages) */
    uint64_t T;
    uint32_t S;
    uint32_t max_len;
    uint32_t *lens;            /* [max S] */
    uint8_t *mask;             /* [max T] */
    /* one host block (mmap-ed; pinned on a GPU): the staged inputs, then the layer buffers */
    void *block;
    size_t block_bytes;
    bool block_pinned;
    int32_t *ids, *pos, *cu;   /* [max T], [max T], [max S + 1] */
    void *host[DFL_MAX_LAYERS]; /* [max T, H] of the stream dtype, or NULL when the layers go
                                   straight into the file's mapping (CPU) */
    /* the frame reserved in a file output, when writing in place */
    bool mapped, registered;
    dfl_frame_res res;
    int set;                   /* device capture set used (asynchronous backend) */
    dfl_be_event ev_start, ev_done, ev_copied;
    prof pf;
} slot;

/* What the forward thread and the writer thread share. */
typedef struct outq {
    pthread_mutex_t mu;
    pthread_cond_t cv;
    uint64_t submitted;        /* batches handed to the writer */
    uint64_t written;          /* batches written */
    uint64_t released;         /* slots given back: batch i's slot is free once released > i */
    bool done;                 /* no more batches: write what is submitted, then return */
    bool stop;                 /* return as soon as possible */
    bool failed;
    dfl_err err;
    bool may_hang;             /* the output is a pipe or device: a write can block for good */
    uint64_t end_off[MAX_INFLIGHT]; /* stream offset after each slot's frame (for vmsplice) */
    double t_written, t_released; /* when the last batch so far was written, its slot given back */
} outq;

typedef struct pipeline {
    dfl_target *t;
    dfl_be *be;
    const dfl_target_run_opts *o;
    bool async;                /* the backend runs ops asynchronously (a GPU): streams, events, pinned copies */
    int K;                     /* captured layers */
    int64_t H;
    size_t ds;                 /* bytes per element of the stream dtype */
    int n_slots;
    int64_t max_t, max_s;      /* what the buffers hold */
    dfl_target_ws *ws;
    void *sets[CAP_SETS][DFL_MAX_LAYERS]; /* device capture sets (GPU), in ws->extra */
    bool set_used[CAP_SETS];
    dfl_be_event set_free[CAP_SETS];
    slot slots[MAX_INFLIGHT];
    bool slots_ready;
    int file_io;               /* what is in effect */
    bool can_register;
    dfl_writer *w;
    outq oq;
    /* profile (writer thread) */
    prof win, total;
    uint64_t win_first;
    double win_t0, t0;
} pipeline;

static slot *slot_of(pipeline *p, uint64_t i) { return &p->slots[i % (uint64_t)p->n_slots]; }

static void slot_free(pipeline *p, slot *s)
{
    free(s->lens);
    free(s->mask);
    s->lens = NULL;
    s->mask = NULL;
    if (s->block) {
        if (s->block_pinned)
            p->be->ops->host_unregister(p->be, s->block, NULL);
        munmap(s->block, s->block_bytes);
    }
    s->block = NULL;
    s->block_pinned = false;
    if (p->async) {
        p->be->ops->event_free(p->be, s->ev_start);
        p->be->ops->event_free(p->be, s->ev_done);
        p->be->ops->event_free(p->be, s->ev_copied);
        s->ev_start = s->ev_done = s->ev_copied = NULL;
    }
}

static void slots_free(pipeline *p)
{
    for (int i = 0; i < p->n_slots; i++)
        slot_free(p, &p->slots[i]);
    p->slots_ready = false;
}

static uint64_t align_up(uint64_t x, uint64_t a) { return (x + a - 1) / a * a; }

/* Host buffers of every slot for batches of max_t tokens and max_s sequences. Layer buffers are
 * left out where the layers go straight into the file (CPU writing in place). */
static int slots_new(pipeline *p, dfl_err *e)
{
    uint64_t T = (uint64_t)p->max_t, S = (uint64_t)p->max_s;
    bool layers = p->async || p->file_io == DFL_FILE_IO_WRITE;
    uint64_t stage = align_up(4 * (2 * T + S + 1), 4096);
    uint64_t lb = align_up(T * (uint64_t)p->H * p->ds, 4096);
    uint64_t bytes = stage + (layers ? lb * (uint64_t)p->K : 0);
    for (int i = 0; i < p->n_slots; i++) {
        slot *s = &p->slots[i];
        memset(s, 0, sizeof *s);
        s->lens = malloc((size_t)S * 4);
        s->mask = malloc((size_t)T);
        if (!s->lens || !s->mask)
            return dfl_fail(e, DFL_ENOMEM, "out of memory");
        void *b = mmap(NULL, (size_t)bytes, PROT_READ | PROT_WRITE, MAP_PRIVATE | MAP_ANONYMOUS, -1, 0);
        if (b == MAP_FAILED) {
            char b1[32];
            return dfl_fail_errno(e, DFL_ENOMEM, errno, "output buffers: cannot map %s",
                                  dfl_fmt_bytes((double)bytes, b1, sizeof b1));
        }
        s->block = b;
        s->block_bytes = (size_t)bytes;
        s->ids = (int32_t *)b;
        s->pos = s->ids + T;
        s->cu = s->pos + T;
        for (int k = 0; k < p->K; k++)
            s->host[k] = layers ? (char *)b + stage + (uint64_t)k * lb : NULL;
        if (p->async) {
            dfl_be *be = p->be;
            int rc = be->ops->host_register(be, b, (size_t)bytes, false, e);
            if (rc)
                return dfl_err_prefix(e, "output buffers: ");
            s->block_pinned = true;
            bool timing = p->o->profile > 0;
            if ((rc = be->ops->event_new(be, &s->ev_start, timing, e)) ||
                (rc = be->ops->event_new(be, &s->ev_done, timing, e)) ||
                (rc = be->ops->event_new(be, &s->ev_copied, timing, e)))
                return rc;
        }
    }
    p->slots_ready = true;
    char b1[32];
    dfl_verbose("%d output slots of %s%s", p->n_slots, dfl_fmt_bytes((double)bytes, b1, sizeof b1),
                p->async ? " (pinned)" : "");
    return DFL_OK;
}

/* ------------------------------------------------------------------------------------------ */
/* the writer thread */

static void prof_add(prof *a, const prof *b)
{
    a->in_wait += b->in_wait;
    a->slot_wait += b->slot_wait;
    a->enqueue += b->enqueue;
    a->forward += b->forward;
    a->copy += b->copy;
    a->copy_wait += b->copy_wait;
    a->write += b->write;
    a->tokens += b->tokens;
}

static void prof_print(const pipeline *p, const char *what, const prof *f, double wall)
{
    double busy = wall > 0 ? f->forward / wall : 0;
    const char *verdict;
    const double idle = wall - f->forward, waited = f->slot_wait > f->in_wait ? f->slot_wait : f->in_wait;
    if (busy >= 0.9)
        verdict = p->async ? "the GPU is the bottleneck" : "the forward is the bottleneck";
    else if (waited < 0.25 * idle)
        /* neither side made the forward thread wait: the idle time is the pipeline filling
         * (the first batch has nothing to overlap) and draining (the last batch's write) */
        verdict = "no bottleneck: neither the input nor the output held the forward up; the idle time is the start and "
                  "the end of the run (more batches amortise them)";
    else if (f->slot_wait >= f->in_wait)
        verdict = "the output is the bottleneck (the writer, or the consumer of the stream)";
    else
        verdict = "the input is the bottleneck (the reader, or the producer of the stream)";
    dfl_info("profile: %s: %llu tokens in %.3f s, %.0f tokens/s; %s busy %.0f%%; forward thread: "
             "input wait %.3f s, enqueue %.3f s, output wait %.3f s; %s: forward %.3f s%s%.3f s; "
             "writer: copy wait %.3f s, write %.3f s; %s", what, (unsigned long long)f->tokens,
             wall, wall > 0 ? (double)f->tokens / wall : 0.0, p->async ? "GPU" : "forward",
             100 * busy, f->in_wait, f->enqueue, f->slot_wait, p->async ? "GPU" : "CPU", f->forward,
             p->async ? ", copy " : ", copy (none) ", f->copy, f->copy_wait, f->write, verdict);
}

/* --profile's closing lines: the forward's time by kind of work (dfl_target_prof_read), as shares
 * of the forward's measured time, what no span covers being the rest; then the GEMMs by weight
 * shape, longest first. */
static void prof_kinds(const pipeline *p, dfl_target *t)
{
    dfl_target_prof_sum s;
    dfl_target_prof_read(t, &s);
    double fwd = p->total.forward, known = 0;
    char line[1024] = "";
    size_t n = 0;
    for (int k = 0; k < DFL_TP_N; k++) {
        if (!s.calls[k])
            continue;
        known += s.seconds[k];
        dfl_span_item(line, sizeof line, &n, dfl_target_prof_kind[k], s.seconds[k], s.flops[k],
                      fwd, false);
    }
    double rest = fwd > known ? fwd - known : 0;
    dfl_info("profile: the forward's %.3f s by kind: %s; the rest (norms, RoPE, conv, element-wise "
             "ops, captures) %.3f s (%.1f%%)%s", fwd, line, rest, fwd > 0 ? 100 * rest / fwd : 0.0,
             s.incomplete ? "; incomplete: a timing event failed" : "");
    if (!s.n_gemm)
        return;
    static const char *const acc[] = {"", "+h"};   /* tag: the residual added into C */
    dfl_span_shapes(&s, NULL, acc, 1, fwd, false, line, sizeof line);
    dfl_info("profile: the GEMMs by weight shape N x K (+h: the residual added in the epilogue): %s",
             line);
}

/* Makes sure a registered mapping's pages are dirty after the GPU wrote them by DMA (a write
 * through the CPU marks them; DMA into pinned pages may not), so that they reach the file. */
static void touch_pages(void *p, size_t n)
{
    size_t page = (size_t)sysconf(_SC_PAGESIZE);
    for (size_t i = 0; i < n; i += page) {
        volatile uint8_t *b = (volatile uint8_t *)p + i;
        *b = *b;
    }
}

/* Writes batch j (its slot's frame). */
static int write_one(pipeline *p, uint64_t j, dfl_err *e)
{
    slot *s = slot_of(p, j);
    int rc = DFL_OK;
    double t0 = dfl_now();
    if (p->async) {
        if ((rc = p->be->ops->event_sync(p->be, s->ev_copied, e)))
            return dfl_err_prefix(e, "batch %llu: ", (unsigned long long)j);
        if (p->o->profile) {
            float a = 0, b = 0;
            dfl_err pe = {0};
            if (!p->be->ops->event_elapsed(p->be, s->ev_start, s->ev_done, &a, &pe) &&
                !p->be->ops->event_elapsed(p->be, s->ev_done, s->ev_copied, &b, &pe)) {
                s->pf.forward = a / 1e3;
                s->pf.copy = b / 1e3;
            }
        }
    }
    double t1 = dfl_now();
    dfl_batch ob;
    memset(&ob, 0, sizeof ob);
    ob.n_tokens = s->T;
    ob.n_seqs = s->S;
    ob.max_len = s->max_len;
    ob.n_layers = (uint32_t)p->K;
    ob.hidden = (uint32_t)p->H;
    ob.dtype = p->o->dtype;
    ob.seq_lens = s->lens;
    ob.input_ids = s->ids;
    ob.loss_mask = s->mask;
    if (s->mapped) {
        if (s->registered) {
            p->be->ops->host_unregister(p->be, s->res.map, NULL);
            s->registered = false;
            touch_pages(s->res.map, s->res.map_len);
        } else if (p->async) {
            size_t n = (size_t)s->T * (size_t)p->H * p->ds;
            for (int k = 0; k < p->K; k++)
                memcpy(s->res.layers[k], s->host[k], n);
        }
        rc = dfl_writer_commit(p->w, &s->res, &ob, e);
        s->mapped = false;
    } else {
        for (int k = 0; k < p->K; k++)
            ob.layers[k] = s->host[k];
        rc = dfl_writer_batch(p->w, &ob, e);
    }
    double t2 = dfl_now();
    s->pf.copy_wait = t1 - t0;
    s->pf.write = t2 - t1;
    if (p->o->profile) {
        prof_add(&p->win, &s->pf);
        prof_add(&p->total, &s->pf);
        uint64_t n = j + 1 - p->win_first;
        if (n >= (uint64_t)p->o->profile) {
            char what[64];
            snprintf(what, sizeof what, "batches %llu-%llu", (unsigned long long)p->win_first,
                     (unsigned long long)j);
            prof_print(p, what, &p->win, t2 - p->win_t0);
            memset(&p->win, 0, sizeof p->win);
            p->win_first = j + 1;
            p->win_t0 = t2;
        }
    }
    return rc;
}

/* Gives back, in order, the slots whose frames the consumer has certainly read (every written one
 * at once when nothing is spliced): batch j's slot may be rewritten once the stream has been read
 * up to the end of its frame, q->end_off (dfl_writer_read_upto; why that is certain, and for
 * which consumers, is argued in frame_write.c). Called with oq.mu held, by the writer thread
 * between frames and by the forward thread while it waits for a slot, so that a slot comes back
 * as soon as the consumer has passed it, not only once the writer has finished the frame after
 * it. Returns how many bytes the consumer has yet to read before the next slot comes back (0:
 * none is waiting on the consumer). An error (the pipe cannot say) fails the queue. */
static uint64_t release_drained(pipeline *p)
{
    outq *q = &p->oq;
    if (q->released >= q->written || q->failed)
        return 0;
    uint64_t upto = 0;
    dfl_err err = {0};
    if (dfl_writer_read_upto(p->w, &upto, &err)) {
        q->failed = true;
        q->err = err;
        pthread_cond_broadcast(&q->cv);
        return 0;
    }
    bool any = false;
    while (q->released < q->written && upto >= q->end_off[q->released % (uint64_t)p->n_slots]) {
        q->released++;
        any = true;
    }
    if (any) {
        q->t_released = dfl_now();
        pthread_cond_broadcast(&q->cv);
    }
    return q->released < q->written ? q->end_off[q->released % (uint64_t)p->n_slots] - upto : 0;
}

static void *writer_main(void *arg)
{
    pipeline *p = arg;
    outq *q = &p->oq;
    pthread_mutex_lock(&q->mu);
    for (;;) {
        uint64_t left = release_drained(p);
        if (q->stop || q->failed)
            break;
        if (q->written < q->submitted) {
            uint64_t j = q->written;
            pthread_mutex_unlock(&q->mu);
            dfl_err err = {0};
            int rc = write_one(p, j, &err);
            pthread_mutex_lock(&q->mu);
            if (rc) {
                q->failed = true;
                q->err = err;
                pthread_cond_broadcast(&q->cv);
                break;
            }
            q->end_off[j % (uint64_t)p->n_slots] = dfl_writer_bytes(p->w);
            q->written++;
            q->t_written = dfl_now();
            pthread_cond_broadcast(&q->cv);
            continue;
        }
        if (q->done && q->released == q->written)
            break;
        if (left) { /* spliced pages still in the pipe */
            struct timespec ts;
            deadline_in(&ts, dfl_pipe_poll_ns(left));
            pthread_cond_timedwait(&q->cv, &q->mu, &ts);
        } else {
            pthread_cond_wait(&q->cv, &q->mu);
        }
    }
    pthread_mutex_unlock(&q->mu);
    return NULL;
}

static void out_submit(outq *q)
{
    pthread_mutex_lock(&q->mu);
    q->submitted++;
    pthread_cond_broadcast(&q->cv);
    pthread_mutex_unlock(&q->mu);
}

/* Waits until batch i's slot is free (every earlier use of it written and given back). */
static int slot_acquire(pipeline *p, uint64_t i, double *waited, dfl_err *e)
{
    outq *q = &p->oq;
    uint64_t need = i + 1 > (uint64_t)p->n_slots ? i + 1 - (uint64_t)p->n_slots : 0;
    double t0 = dfl_now();
    int rc = DFL_OK;
    pthread_mutex_lock(&q->mu);
    while (q->released < need && !q->failed && !(p->o->stop && *p->o->stop)) {
        uint64_t left = release_drained(p); /* the slot may be waiting on the consumer only */
        if (q->released >= need || q->failed)
            break;
        struct timespec ts;
        deadline_in(&ts, left ? dfl_pipe_poll_ns(left) : POLL_NS);
        pthread_cond_timedwait(&q->cv, &q->mu, &ts);
    }
    if (q->failed) {
        *e = q->err;
        rc = e->code;
    } else if (q->released < need) {
        rc = DFL_EINTR; /* the caller reports the signal */
    }
    pthread_mutex_unlock(&q->mu);
    *waited = dfl_now() - t0;
    return rc;
}

/* Waits until every submitted batch is written and its slot given back. */
static int out_drain(pipeline *p, dfl_err *e)
{
    outq *q = &p->oq;
    int rc = DFL_OK;
    pthread_mutex_lock(&q->mu);
    while (q->released < q->submitted && !q->failed) {
        uint64_t left = release_drained(p);
        if (q->released >= q->submitted || q->failed)
            break;
        struct timespec ts;
        deadline_in(&ts, left ? dfl_pipe_poll_ns(left) : POLL_NS);
        pthread_cond_timedwait(&q->cv, &q->mu, &ts);
    }
    if (q->failed) {
        *e = q->err;
        rc = e->code;
    }
    pthread_mutex_unlock(&q->mu);
    return rc;
}

/* Ends the writer thread: after writing everything (finish) or at once. A signal while it
 * finishes turns that into a stop (DFL_EINTR, n_done batches). After a stop, a writer still
 * blocked 0.2 s later on a pipe whose reader does not read (q->may_hang) is not waited for: it
 * is detached and *left is set; it may still use p (its slots, its writer), which the caller
 * must then never free (the process is about to end; no pthread_cancel, which the sanitizers do
 * not support). Returns the writer's error. */
static int out_finish(pipeline *p, pthread_t th, bool finish, uint64_t n_done, bool *left, dfl_err *e)
{
    outq *q = &p->oq;
    volatile sig_atomic_t *sig = p->o->stop;
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
        deadline_in(&ts, POLL_NS);
        if (pthread_timedjoin_np(th, NULL, &ts) != ETIMEDOUT)
            break;
        if (!stopping && sig && *sig) {
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
    int rc = DFL_OK;
    pthread_mutex_lock(&q->mu);
    if (q->failed) {
        *e = q->err;
        rc = e->code;
    } else if (by_signal) {
        rc = dfl_fail(e, DFL_EINTR, "stopped by signal %d (%s) after %llu batches: the output "
                      "stream was cut without an end frame", (int)*sig, strsignal((int)*sig),
                      (unsigned long long)n_done);
    }
    pthread_mutex_unlock(&q->mu);
    return rc;
}

/* ------------------------------------------------------------------------------------------ */
/* sizing */

/* The largest batch the run is known to hold, with a shape for the warm-up. */
typedef struct shape {
    int64_t tokens, seqs, max_len;
    bool known;
} shape;

static void shape_max(shape *a, int64_t tokens, int64_t seqs, int64_t max_len)
{
    if (!a->known || tokens > a->tokens) {
        a->tokens = tokens;
        a->seqs = seqs;
        a->max_len = max_len;
    }
    a->known = true;
}

/* The warm-up shapes of a manifest or of a stream header's meta: a "warmup" list of {seqs,
 * tokens, max_len}. False when there is none. */
static bool shape_from_warmup(const json_t *obj, shape *sh)
{
    const json_t *wl = obj ? json_object_get(obj, "warmup") : NULL;
    if (!json_is_array(wl) || json_array_size(wl) == 0)
        return false;
    size_t i;
    const json_t *x;
    bool any = false;
    json_array_foreach(wl, i, x) {
        json_int_t t = json_integer_value(json_object_get(x, "tokens"));
        json_int_t s = json_integer_value(json_object_get(x, "seqs"));
        json_int_t m = json_integer_value(json_object_get(x, "max_len"));
        if (t < 1 || t > INT32_MAX || s < 1 || s > t)
            continue;
        if (m < 1 || m > t)
            m = t;
        shape_max(sh, t, s, m);
        any = true;
    }
    return any;
}

/* Shape hints of one input that is a regular file: its header's warm-up shapes, else its index.
 * False when it has neither (or is not a file). */
static bool shape_of_reader(dfl_reader *r, shape *sh)
{
    const dfl_stream_info *in = dfl_reader_info(r);
    if (shape_from_warmup(in->meta, sh))
        return true;
    const dfl_index_entry *ent = NULL;
    uint64_t n = 0;
    dfl_err e = {0};
    if (dfl_reader_index(r, &ent, &n, &e) != 0)
        return false;
    for (uint64_t i = 0; i < n; i++) /* the index has no longest sequence: assume even ones */
        shape_max(sh, ent[i].n_tokens, ent[i].n_seqs,
                  ((int64_t)ent[i].n_tokens + ent[i].n_seqs - 1) / (ent[i].n_seqs ? ent[i].n_seqs : 1));
    return true;
}

static int shape_of_manifest(const char *path, shape *sh, dfl_err *e)
{
    json_t *m = NULL;
    int rc = dfl_json_load_file(path, &m, e);
    if (rc)
        return rc;
    if (!shape_from_warmup(m, sh))
        rc = dfl_fail(e, DFL_EDATA, "%s: no \"warmup\" list of batch shapes (is it the manifest.json "
                      "that dfl-bucket writes?)", path);
    json_decref(m);
    return rc;
}

/* What sizes the buffers, before the first batch: --max-tokens, a manifest, or the warm-up
 * shapes / indexes of the inputs when every input has them. */
static int plan_shape(pipeline *p, dfl_reader *first, shape *sh, dfl_err *e)
{
    const dfl_target_run_opts *o = p->o;
    memset(sh, 0, sizeof *sh);
    if (o->max_tokens > 0) {
        sh->tokens = o->max_tokens;
        sh->seqs = (o->max_tokens + 2047) / 2048;
        sh->max_len = o->max_tokens < 2048 ? o->max_tokens : 2048;
        sh->known = true;
        return DFL_OK;
    }
    if (o->manifest)
        return shape_of_manifest(o->manifest, sh, e);
    if (!p->async)
        return DFL_OK; /* the CPU sizes from the first batch and grows */
    shape all = {0};
    for (int i = 0; i < o->n_inputs; i++) {
        dfl_reader *r = NULL;
        struct stat st;
        bool ok;
        if (i == 0) {
            ok = shape_of_reader(first, &all);
        } else {
            if (strcmp(o->inputs[i], "-") == 0 || stat(o->inputs[i], &st) != 0 || !S_ISREG(st.st_mode))
                return DFL_OK; /* a pipe: it may hold anything */
            dfl_err ie = {0};
            if (open_input(o->inputs[i], &r, &ie) != 0)
                return DFL_OK; /* the reader thread reports it, in its turn */
            ok = shape_of_reader(r, &all);
            dfl_reader_close(r);
        }
        if (!ok)
            return DFL_OK;
    }
    *sh = all;
    return DFL_OK;
}

/* ------------------------------------------------------------------------------------------ */
/* device memory, warm-up */

/* Activations and capture sets for batches of max_t tokens, in one arena. */
static int buffers_new(pipeline *p, int64_t max_t, int64_t max_s, dfl_err *e)
{
    dfl_target *t = p->t;
    p->max_t = max_t;
    p->max_s = max_s;
    uint64_t set_layer = align_up((uint64_t)max_t * (uint64_t)p->H * p->ds, 256);
    uint64_t caps = p->async ? set_layer * (uint64_t)p->K * CAP_SETS : 0;
    if (p->async) {
        char b1[32], b2[32], b3[32], b4[32], b5[32], b6[32], b7[32];
        uint64_t act = dfl_target_ws_bytes(t, max_t, max_s);
        dfl_be_mem pr;
        if (act && p->be->ops->mem_info(p->be, &pr, NULL) == 0 && pr.total) {
            uint64_t margin = 512ull << 20; /* cuBLAS, kernels loaded on first use */
            if (act + caps + margin > pr.free)
                return dfl_fail(e, DFL_ENOMEM, "%s: batches of up to %lld tokens need %s of device "
                                "memory (activations %s, capture buffers %s, and %s of margin), but "
                                "only %s of %s is free with the weights (%s) loaded; lower "
                                "--max-tokens, or capture fewer layers", p->be->name,
                                (long long)max_t, dfl_fmt_bytes((double)(act + caps + margin), b1, sizeof b1),
                                dfl_fmt_bytes((double)act, b2, sizeof b2),
                                dfl_fmt_bytes((double)caps, b3, sizeof b3),
                                dfl_fmt_bytes((double)margin, b4, sizeof b4),
                                dfl_fmt_bytes((double)pr.free, b5, sizeof b5),
                                dfl_fmt_bytes((double)pr.total, b6, sizeof b6),
                                dfl_fmt_bytes((double)t->weight_bytes, b7, sizeof b7));
        }
    }
    int rc = dfl_target_ws_new_ex(t, max_t, max_s, caps, &p->ws, e);
    if (rc)
        return rc;
    for (int c = 0; c < CAP_SETS && p->async; c++)
        for (int k = 0; k < p->K; k++)
            p->sets[c][k] = (char *)p->ws->extra + ((uint64_t)c * (uint64_t)p->K + (uint64_t)k) * set_layer;
    char b1[32];
    dfl_verbose("buffers for %lld tokens, %lld sequences: %s on %s", (long long)p->ws->max_tokens,
                (long long)p->ws->max_seqs, dfl_fmt_bytes((double)p->ws->bytes, b1, sizeof b1),
                p->be->name);
    return DFL_OK;
}

/* One product's algorithm from the tune file (tf may be NULL): true when it was stored there
 * for this GPU and library and the library took it. *a gets the product's key and scope. */
static bool tune_from_file(pipeline *p, dfl_tune_file *tf, const dfl_mm *m, const char *name, dfl_mm_algo *a)
{
    dfl_be *be = p->be;
    dfl_err ke = {0};
    memset(a, 0, sizeof *a);
    if (!tf || be->ops->matmul_algo(be, m, a, false, &ke))
        return false;   /* no file, or no algorithm to store for this product (ke says why) */
    if (!dfl_tune_file_get(tf, a))
        return false;
    if (be->ops->matmul_algo(be, m, a, true, &ke)) {
        dfl_info("--tune-file %s: %s: %s; timing it again", dfl_tune_file_path(tf), name, ke.msg);
        return false;
    }
    return true;
}

/* --tune: the largest batch's four products, each from the tune file where it has them, else
 * timed (and then stored in it). */
static int tune_gemms(pipeline *p, int64_t T, dfl_err *e)
{
    dfl_be *be = p->be;
    dfl_mm mm[4];
    const char *names[4] = {"qkv_proj", "o_proj", "gate_up_proj", "down_proj"};
    int rc = dfl_target_gemms(p->t, p->ws, T, mm);
    if (rc)
        return rc;
    dfl_tune_file *tf = be->ops->matmul_algo ? p->o->tune_file : NULL;
    int stored = 0, timed = 0;
    bool other_scope = false;
    for (int i = 0; i < 4 && !rc; i++) {
        float best = 0, first = 0;
        dfl_mm_algo a;
        if (mm[i].M == 0) /* a sparse layer's experts */
            continue;
        if (tune_from_file(p, tf, &mm[i], names[i], &a)) {
            stored++;
            dfl_verbose("tune %s %lldx%lldx%lld: the algorithm stored in %s", names[i], (long long)mm[i].M,
                        (long long)mm[i].N, (long long)mm[i].K, dfl_tune_file_path(tf));
            continue;
        }
        other_scope = other_scope || (tf && a.scope[0] && dfl_tune_file_scope(tf)[0] &&
                                      strcmp(dfl_tune_file_scope(tf), a.scope));
        if ((rc = be->ops->matmul_tune(be, &mm[i], 16, 4, &best, &first, e))) {
            dfl_err_prefix(e, "--tune %s: ", names[i]);
            break;
        }
        timed++;
        dfl_verbose("tune %s %lldx%lldx%lld: cuBLASLt's first choice %.3f ms, the fastest %.3f ms (a call, sustained)",
                    names[i], (long long)mm[i].M, (long long)mm[i].N, (long long)mm[i].K, first, best);
        if (tf) {   /* stored, unless the product has no algorithm to store (DFL_EUNSUP) */
            dfl_err ge = {0};
            int grc = be->ops->matmul_algo(be, &mm[i], &a, false, &ge);
            if (!grc)
                rc = dfl_tune_file_put(tf, &a, e);
            else if (grc != DFL_EUNSUP) {
                rc = grc;
                *e = ge;
            }
        }
    }
    bool written = false;
    if (!rc && tf && (rc = dfl_tune_file_save(tf, &written, e)))
        dfl_err_prefix(e, "--tune-file: ");
    if (!rc && tf)
        dfl_info("--tune-file %s: %d product%s from the file, %d timed%s%s", dfl_tune_file_path(tf), stored,
                 stored == 1 ? "" : "s", timed, written ? " and stored in it" : "",
                 other_scope ? " (it was written for another GPU or library: now for this one)" : "");
    return rc;
}

/* A forward on a made-up batch of the largest shape (token ids spread over the vocabulary), so
 * that kernels are loaded, cuBLASLt plans exist and (--tune) the GEMMs' algorithms are chosen
 * before the first real batch. */
static int warm_up(pipeline *p, const shape *sh, dfl_err *e)
{
    dfl_target *t = p->t;
    dfl_be *be = p->be;
    int64_t T = sh->tokens, len = sh->max_len > 0 ? sh->max_len : T;
    int64_t S = (T + len - 1) / len;
    if (S > p->max_s)
        S = p->max_s;
    if (S < sh->seqs && sh->seqs <= p->max_s && sh->seqs <= T)
        S = sh->seqs;
    uint32_t *lens = malloc((size_t)S * 4);
    int32_t *ids = malloc((size_t)T * 4), *pos = malloc((size_t)T * 4), *cu = malloc((size_t)(S + 1) * 4);
    int rc = DFL_OK;
    if (!lens || !ids || !pos || !cu) {
        rc = dfl_fail(e, DFL_ENOMEM, "out of memory");
        goto out;
    }
    /* the first sequence as long as the longest, the rest shared out evenly */
    int64_t rest = T;
    for (int64_t s = 0; s < S; s++) {
        int64_t n = s == 0 ? (len < T - (S - 1) ? len : T - (S - 1)) : rest / (S - s);
        lens[s] = (uint32_t)n;
        rest -= n;
    }
    for (int64_t i = 0; i < T; i++)
        ids[i] = (int32_t)((i * 7919 + 13) % t->cfg.vocab_size);
    dfl_batch b = {.n_tokens = (uint64_t)T, .n_seqs = (uint32_t)S, .seq_lens = lens, .input_ids = ids};
    int32_t max_len = dfl_target_positions(&b, pos, cu);
    double t0 = dfl_now();
    if ((rc = be->ops->upload(be, p->ws->ids, ids, (size_t)T * 4)) ||
        (rc = be->ops->upload(be, p->ws->pos, pos, (size_t)T * 4)) ||
        (rc = be->ops->upload(be, p->ws->cu, cu, (size_t)(S + 1) * 4)) ||
        (rc = dfl_target_forward_staged(t, p->ws, 0, T, S, max_len, p->K, p->o->layers, p->o->dtype,
                                        p->sets[0], e)) ||
        (rc = be->ops->sync(be, e))) {
        if (!e->msg[0] || rc != e->code)
            be->ops->sync(be, e);
        dfl_err_prefix(e, "warm-up: ");
        goto out;
    }
    double t1 = dfl_now();
    dfl_verbose("warm-up: a batch of %lld tokens in %lld sequences in %.3f s", (long long)T,
                (long long)S, t1 - t0);
    if (p->o->tune && (rc = tune_gemms(p, T, e)))
        goto out;
out:
    free(lens);
    free(ids);
    free(pos);
    free(cu);
    return rc;
}

/* Buffers and output slots for batches of up to mt tokens in ms sequences; on a GPU then the
 * warm-up on shape sh and the freeze of device allocation. */
static int size_buffers(pipeline *p, int64_t mt, int64_t ms, const shape *sh, dfl_err *e)
{
    int rc;
    if ((rc = buffers_new(p, mt, ms, e)) || (rc = slots_new(p, e)))
        return rc;
    if (p->async) {
        if ((rc = warm_up(p, sh, e)))
            return rc;
        p->be->ops->freeze(p->be, true); /* no device allocation from here on */
        dfl_be_mem mem = {0};
        p->be->ops->mem_info(p->be, &mem, NULL);
        char b1[32];
        dfl_verbose("%s: %s of device memory held (weights, activations, capture buffers); "
                    "allocation frozen", p->be->name, dfl_fmt_bytes((double)mem.allocated, b1, sizeof b1));
    }
    return DFL_OK;
}

/* ------------------------------------------------------------------------------------------ */
/* one batch */

/* Copies the staged batch into slot s (what the frame needs, and the inputs to upload). */
static void slot_fill(slot *s, const in_item *it)
{
    s->in_index = it->index;
    s->T = it->n_tokens;
    s->S = it->n_seqs;
    s->max_len = (uint32_t)it->max_len;
    memcpy(s->lens, it->lens, (size_t)it->n_seqs * 4);
    memcpy(s->mask, it->mask, (size_t)it->n_tokens);
    memcpy(s->ids, it->ids, (size_t)it->n_tokens * 4);
    memcpy(s->pos, it->pos, (size_t)it->n_tokens * 4);
    memcpy(s->cu, it->cu, (size_t)(it->n_seqs + 1) * 4);
}

/* After an op failed on an asynchronous backend: the backend's own message (kept until the next sync). */
static int op_error(pipeline *p, int rc, dfl_err *e)
{
    dfl_err be_err = {0};
    if (p->be->ops->sync(p->be, &be_err) && be_err.msg[0]) {
        char m[sizeof e->msg];
        snprintf(m, sizeof m, "%s", e->msg);
        return dfl_fail(e, rc, "%s (%s)", m, be_err.msg);
    }
    return rc;
}

/* Enqueues batch i in its slot: reserves its frame when writing in place, uploads its inputs,
 * runs the forward and (GPU) the copies. */
static int submit(pipeline *p, uint64_t i, dfl_err *e)
{
    slot *s = slot_of(p, i);
    dfl_target *t = p->t;
    dfl_be *be = p->be;
    int rc;
    int64_t T = (int64_t)s->T, S = s->S;
    s->mapped = s->registered = false;
    if (p->file_io != DFL_FILE_IO_WRITE) {
        if ((rc = dfl_writer_reserve(p->w, s->T, s->S, &s->res, e)))
            return rc;
        s->mapped = true;
        if (p->async && p->can_register) {
            dfl_err re = {0};
            if (be->ops->host_register(be, s->res.map, s->res.map_len, false, &re) == 0) {
                s->registered = true;
            } else {
                p->can_register = false;
                dfl_verbose("%s; copying through pinned buffers instead", re.msg);
            }
        }
    }
    void *caps[DFL_MAX_LAYERS];
    if (!p->async) {
        for (int k = 0; k < p->K; k++)
            caps[k] = s->mapped ? s->res.layers[k] : s->host[k];
        double t0 = dfl_now();
        if ((rc = be->ops->upload(be, p->ws->ids, s->ids, (size_t)T * 4)) ||
            (rc = be->ops->upload(be, p->ws->pos, s->pos, (size_t)T * 4)) ||
            (rc = be->ops->upload(be, p->ws->cu, s->cu, (size_t)(S + 1) * 4)))
            return dfl_fail(e, rc, "batch %llu: staging its inputs failed",
                            (unsigned long long)s->in_index);
        rc = dfl_target_forward_staged(t, p->ws, s->in_index, T, S, (int32_t)s->max_len, p->K,
                                       p->o->layers, p->o->dtype, caps, e);
        s->pf.forward = dfl_now() - t0;
        return rc;
    }
    int set = (int)(i % CAP_SETS);
    s->set = set;
    enum { cs = DFL_STREAM_COMPUTE, xs = DFL_STREAM_COPY };
    size_t lb = (size_t)T * (size_t)p->H * p->ds;
    const dfl_be_ops *op = be->ops;
    if ((p->o->profile && (rc = op->event_record(be, s->ev_start, cs, e))) ||
        (rc = op->upload_async(be, p->ws->ids, s->ids, (size_t)T * 4, cs, e)) ||
        (rc = op->upload_async(be, p->ws->pos, s->pos, (size_t)T * 4, cs, e)) ||
        (rc = op->upload_async(be, p->ws->cu, s->cu, (size_t)(S + 1) * 4, cs, e)) ||
        (p->set_used[set] && (rc = op->stream_wait(be, cs, p->set_free[set], e))))
        return dfl_err_prefix(e, "batch %llu: ", (unsigned long long)s->in_index);
    if ((rc = dfl_target_forward_staged(t, p->ws, s->in_index, T, S, (int32_t)s->max_len, p->K,
                                        p->o->layers, p->o->dtype, p->sets[set], e)))
        return op_error(p, rc, e);
    if ((rc = op->event_record(be, s->ev_done, cs, e)) ||
        (rc = op->stream_wait(be, xs, s->ev_done, e)))
        return dfl_err_prefix(e, "batch %llu: ", (unsigned long long)s->in_index);
    for (int k = 0; k < p->K; k++) {
        void *dst = s->registered ? s->res.layers[k] : s->host[k];
        if ((rc = op->download_async(be, dst, p->sets[set][k], lb, xs, e)))
            return dfl_err_prefix(e, "batch %llu: copying layer %d: ",
                                  (unsigned long long)s->in_index, p->o->layers[k]);
    }
    if ((rc = op->event_record(be, s->ev_copied, xs, e)) ||
        (rc = op->event_record(be, p->set_free[set], xs, e)))
        return dfl_err_prefix(e, "batch %llu: ", (unsigned long long)s->in_index);
    p->set_used[set] = true;
    return DFL_OK;
}

/* Makes sure the buffers hold a batch of T tokens in S sequences: sized at the first batch when
 * nothing sized them before; on the CPU a larger batch grows them (after the writer has caught
 * up), on a GPU it is an error. */
static int fit(pipeline *p, const in_item *it, const char *name, dfl_err *e)
{
    int64_t T = (int64_t)it->n_tokens, S = it->n_seqs;
    int rc;
    if (!p->ws) {
        shape sh = {.tokens = T, .seqs = S, .max_len = it->max_len, .known = true};
        if ((rc = size_buffers(p, T, S, &sh, e)))
            return rc;
    }
    if (T <= p->max_t && S <= p->max_s)
        return DFL_OK;
    if (!p->o->grow)
        return dfl_fail(e, DFL_EUSAGE, "batch %llu has %lld tokens in %lld sequences, more than "
                        "the buffers were sized for (%lld tokens, %lld sequences); rerun with "
                        "--max-tokens %lld or more", (unsigned long long)it->index,
                        (long long)T, (long long)S, (long long)p->max_t, (long long)p->max_s,
                        (long long)(T > S ? T : S));
    /* grow by half at least, so that slowly rising sizes do not reallocate at every batch */
    int64_t mt = p->max_t, ms = p->max_s;
    if (T > mt)
        mt = T > mt + mt / 2 ? T : mt + mt / 2;
    if (S > ms)
        ms = S > ms + ms / 2 ? S : ms + ms / 2;
    dfl_verbose("%s: batch %llu has %lld tokens in %lld sequences: growing the buffers",
                name, (unsigned long long)it->index, (long long)T, (long long)S);
    if ((rc = out_drain(p, e)))
        return rc;
    slots_free(p);
    dfl_target_ws_free(p->t, p->ws);
    p->ws = NULL;
    if ((rc = buffers_new(p, mt, ms, e)) || (rc = slots_new(p, e)))
        return rc;
    return DFL_OK;
}

/* ------------------------------------------------------------------------------------------ */
/* the run */

int dfl_target_run(dfl_target *t, const dfl_target_run_opts *o, dfl_target_stats *st, dfl_err *e)
{
    memset(st, 0, sizeof *st);
    const char *out_name = strcmp(o->output, "-") == 0 ? "stdout" : o->output;
    double t_setup = dfl_now();
    pipeline *p = calloc(1, sizeof *p);
    inq *q = calloc(1, sizeof *q);
    if (!p || !q) {
        free(p);
        free(q);
        return dfl_fail(e, DFL_ENOMEM, "out of memory");
    }
    p->t = t;
    p->be = t->be;
    p->o = o;
    p->async = t->be->async;
    p->K = o->n_caps;
    p->H = t->cfg.hidden_size;
    p->ds = dfl_dtype_size(o->dtype);
    p->n_slots = o->inflight > 0 ? o->inflight : 2;
    if (p->n_slots > MAX_INFLIGHT)
        p->n_slots = MAX_INFLIGHT;
    pthread_mutex_init(&p->oq.mu, NULL);
    pthread_cond_init(&p->oq.cv, NULL);
    p->oq.may_hang = output_may_block(o->output);
    pthread_mutex_init(&q->mu, NULL);
    pthread_cond_init(&q->cv, NULL);
    q->vocab = t->cfg.vocab_size;
    q->inputs = o->inputs;
    q->n_inputs = o->n_inputs;
    q->names = calloc((size_t)o->n_inputs, sizeof *q->names);
    pthread_t rth, wth;
    bool reader_started = false, writer_started = false, left = false;
    json_t *meta = NULL;
    uint64_t i = 0;
    int rc;

    if (!q->names) {
        rc = dfl_fail(e, DFL_ENOMEM, "out of memory");
        goto done;
    }
    /* the first input is opened here, so that a bad one fails before any output */
    if ((rc = open_input(o->inputs[0], &q->first, e)))
        goto done;
    if (p->async) {
        for (int c = 0; c < CAP_SETS; c++)
            if ((rc = p->be->ops->event_new(p->be, &p->set_free[c], false, e)))
                goto done;
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
    if ((rc = dfl_writer_open(&p->w, o->output, &info, &o->wopts, e)))
        goto done;
    bool spliced = o->wopts.vmsplice && dfl_writer_pipe_bytes(p->w);
    if (spliced && o->inflight <= 0)
        p->n_slots = 4; /* a spliced slot is held until the consumer has read it */
    if (dfl_writer_pipe_bytes(p->w))
        dfl_log(DFL_LOG_VERBOSE, "output: a pipe of %u KiB, %s", dfl_writer_pipe_bytes(p->w) >> 10,
                spliced ? "vmsplice" : "write");
    p->file_io = DFL_FILE_IO_WRITE;
    if (o->file_io != DFL_FILE_IO_WRITE && dfl_writer_can_reserve(p->w)) {
        p->file_io = o->file_io == DFL_FILE_IO_REGISTER && !p->async ? DFL_FILE_IO_MAP : o->file_io;
        p->can_register = p->file_io == DFL_FILE_IO_REGISTER;
    }

    /* size the buffers now if anything says how large batches get */
    shape sh;
    if ((rc = plan_shape(p, q->first, &sh, e)))
        goto done;
    /* any batch of up to sh.tokens tokens fits, whatever its number of sequences */
    if (sh.known && (rc = size_buffers(p, sh.tokens, sh.tokens, &sh, e)))
        goto done;

    if (pthread_create(&wth, NULL, writer_main, p) != 0) {
        rc = dfl_fail(e, DFL_EIO, "cannot start the writer thread");
        goto done;
    }
    writer_started = true;
    if (pthread_create(&rth, NULL, reader_main, q) != 0) {
        rc = dfl_fail(e, DFL_EIO, "cannot start the reader thread");
        goto done;
    }
    reader_started = true;

    if (o->profile && (rc = dfl_target_prof_on(t, e)))
        goto done;
    double t0 = dfl_now(), last_report = t0, t_submit = t0;
    double report_every = isatty(2) ? 1.0 : 10.0;
    st->setup_seconds = t0 - t_setup;
    p->t0 = p->win_t0 = t0;
    for (;;) {
        if (o->stop && *o->stop) {
            rc = dfl_fail(e, DFL_EINTR, "stopped by signal %d (%s) after %llu batches: the "
                          "output stream was cut without an end frame", (int)*o->stop,
                          strsignal((int)*o->stop), (unsigned long long)st->batches);
            break;
        }
        in_item *it = NULL;
        double w0 = dfl_now();
        int pr = in_pop(q, &it, o->stop, &rc, e);
        double in_wait = dfl_now() - w0;
        if (pr == POP_STOP)
            continue; /* the signal: reported at the top of the loop */
        if (pr == POP_END)
            break;
        const char *name = q->names[it->input];
        if ((rc = fit(p, it, name, e))) {
            dfl_err_prefix(e, "%s: ", name);
            in_release(q);
            break;
        }
        double slot_wait = 0;
        if ((rc = slot_acquire(p, i, &slot_wait, e))) {
            in_release(q);
            if (rc == DFL_EINTR) { /* the signal: reported at the top of the loop */
                rc = DFL_OK;
                continue;
            }
            break;
        }
        double t1 = dfl_now();
        slot *s = slot_of(p, i);
        slot_fill(s, it);
        in_release(q);
        memset(&s->pf, 0, sizeof s->pf);
        if ((rc = submit(p, i, e))) {
            dfl_err_prefix(e, "%s: ", name);
            break;
        }
        s->pf.in_wait = in_wait;
        s->pf.slot_wait = slot_wait;
        s->pf.enqueue = dfl_now() - t1;
        s->pf.tokens = s->T;
        st->batches++;
        st->seqs += s->S;
        st->tokens += s->T;
        out_submit(&p->oq);
        i++;
        double now = dfl_now();
        t_submit = now;
        st->seconds = now - t0;
        if (!o->profile && now - last_report >= report_every) {
            last_report = now;
            dfl_progress("%llu batches, %llu tokens, %.0f tokens/s",
                         (unsigned long long)st->batches, (unsigned long long)st->tokens,
                         st->tokens / (st->seconds > 0 ? st->seconds : 1e-9));
        }
    }
    if (reader_started) {
        if (!in_stop(q, rth))
            q = NULL; /* the thread frees it */
        reader_started = false;
    }
    double t_inputs = dfl_now();
    {
        dfl_err we = {0};
        int wrc = out_finish(p, wth, rc == DFL_OK, st->batches, &left, &we);
        writer_started = false;
        if (!rc && wrc) {
            rc = wrc;
            *e = we;
        }
    }
    /* the END frame before the profile's report, whose reading back of the forward's timing
     * events (an event sync a span, up to 2048 of them) the consumer need not wait for */
    double t_end = dfl_now();
    if (!rc) {
        rc = dfl_writer_close(p->w, e);
        p->w = NULL;
    }
    if (!rc && st->batches)
        dfl_verbose("the end, after the last batch was enqueued: the inputs closed at %+.3f s, its "
                    "frame written at %+.3f s, its slot given back at %+.3f s, the writer done at "
                    "%+.3f s, the end frame written at %+.3f s", t_inputs - t_submit,
                    p->oq.t_written - t_submit, p->oq.t_released - t_submit, t_end - t_submit,
                    dfl_now() - t_submit);
    if (!rc && o->profile && p->win.tokens)
        prof_print(p, "last batches", &p->win, t_end - p->win_t0);
    if (!rc && o->profile && st->batches) {
        prof_print(p, "all batches", &p->total, t_end - t0);
        prof_kinds(p, t);
    }
    st->seconds = dfl_now() - t0;
done:
    if (reader_started && !in_stop(q, rth))
        q = NULL;
    if (writer_started) {
        dfl_err we = {0};
        out_finish(p, wth, false, st->batches, &left, &we);
    }
    if (left) {   /* the writer, blocked on a consumer that does not read, still uses p */
        if (q)
            in_free(q);
        json_decref(meta);
        dfl_progress_end();
        return rc;
    }
    if (p->async) {
        /* nothing may still be copying into buffers about to be freed */
        dfl_err se = {0};
        p->be->ops->stream_sync(p->be, DFL_STREAM_COMPUTE, &se);
        p->be->ops->stream_sync(p->be, DFL_STREAM_COPY, &se);
        p->be->ops->sync(p->be, &se);
    }
    for (int k = 0; k < p->n_slots && p->slots_ready; k++) {
        slot *s = &p->slots[k];
        if (s->mapped) {
            if (s->registered)
                p->be->ops->host_unregister(p->be, s->res.map, NULL);
            if (p->w)
                dfl_writer_unreserve(p->w, &s->res);
        }
    }
    if (p->w)
        dfl_writer_abort(p->w);
    if (q)
        in_free(q);
    slots_free(p);
    dfl_target_ws_free(t, p->ws);
    if (p->async) {
        p->be->ops->freeze(p->be, false);
        for (int c = 0; c < CAP_SETS; c++)
            p->be->ops->event_free(p->be, p->set_free[c]);
    }
    json_decref(meta);
    if (rc == DFL_EPIPE)
        dfl_fail(e, DFL_EPIPE, "%s: the consumer went away (broken pipe) after %llu batches",
                 out_name, (unsigned long long)p->oq.written);
    pthread_mutex_destroy(&p->oq.mu);
    pthread_cond_destroy(&p->oq.cv);
    free(p);
    dfl_progress_end();
    return rc;
}
