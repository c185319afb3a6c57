/* frame_hasher.c: the frame reader's hashing thread (frame_hasher.h). The handoff is one counter
 * under a mutex: the bytes of the region in place (avail) against those hashed (done); the thread
 * sleeps on `work` when it has caught up, the reader on `idle` while it waits for the end of a
 * job. Per read(2) of 256 KiB the reader takes the mutex once. */
#include "frame_hasher.h"

#include <pthread.h>
#include <signal.h>
#include <stdbool.h>
#include <stdlib.h>

#define PIECE (1u << 20) /* at most this much hashed between two looks at the counter, so that a
                            cancel waits for at most one piece */

struct dfl_hasher {
    pthread_t thread;
    pthread_mutex_t mu;
    pthread_cond_t work, idle;
    /* the job, under mu */
    bool busy, cancel, quit;
    XXH3_state_t *st;
    const uint8_t *base;
    uint64_t len, avail, done;
};

static void *hasher_main(void *arg)
{
    dfl_hasher *h = arg;
    pthread_mutex_lock(&h->mu);
    for (;;) {
        while (!h->quit && !(h->busy && (h->cancel || h->done < h->avail)))
            pthread_cond_wait(&h->work, &h->mu);
        if (h->quit)
            break;
        if (h->cancel) {
            h->busy = false;
            pthread_cond_signal(&h->idle);
            continue;
        }
        uint64_t n = h->avail - h->done;
        n = n > PIECE ? PIECE : n;
        const uint8_t *p = h->base + h->done;
        XXH3_state_t *st = h->st;
        pthread_mutex_unlock(&h->mu);
        /* bytes [done, done + n) were written before avail covered them (the mutex orders it),
         * and the reader does not touch them, nor st, until the job ends */
        XXH3_64bits_update(st, p, (size_t)n);
        pthread_mutex_lock(&h->mu);
        h->done += n;
        if (h->done == h->len) {
            h->busy = false;
            pthread_cond_signal(&h->idle);
        }
    }
    pthread_mutex_unlock(&h->mu);
    return NULL;
}

int dfl_reader_thread_start(pthread_t *t, void *(*fn)(void *), void *arg, const char *name)
{
    sigset_t all, old;
    sigfillset(&all);
    pthread_sigmask(SIG_BLOCK, &all, &old);
    int rc = pthread_create(t, NULL, fn, arg);
    pthread_sigmask(SIG_SETMASK, &old, NULL);
    if (!rc)
        pthread_setname_np(*t, name); /* in top, perf and /proc/PID/task/TID/comm */
    return rc;
}

dfl_hasher *dfl_hasher_new(void)
{
    dfl_hasher *h = calloc(1, sizeof *h);
    if (!h)
        return NULL;
    if (pthread_mutex_init(&h->mu, NULL)) {
        free(h);
        return NULL;
    }
    pthread_cond_init(&h->work, NULL);
    pthread_cond_init(&h->idle, NULL);
    if (dfl_reader_thread_start(&h->thread, hasher_main, h, "dfl-hash")) {
        pthread_cond_destroy(&h->work);
        pthread_cond_destroy(&h->idle);
        pthread_mutex_destroy(&h->mu);
        free(h);
        return NULL;
    }
    return h;
}

void dfl_hasher_free(dfl_hasher *h)
{
    if (!h)
        return;
    pthread_mutex_lock(&h->mu);
    h->quit = true;
    pthread_cond_signal(&h->work);
    pthread_mutex_unlock(&h->mu);
    pthread_join(h->thread, NULL);
    pthread_cond_destroy(&h->work);
    pthread_cond_destroy(&h->idle);
    pthread_mutex_destroy(&h->mu);
    free(h);
}

void dfl_hasher_start(dfl_hasher *h, XXH3_state_t *st, const uint8_t *base, uint64_t len)
{
    pthread_mutex_lock(&h->mu);
    while (h->busy) /* the previous job ends first (all of it made available, or cancelled) */
        pthread_cond_wait(&h->idle, &h->mu);
    h->st = st;
    h->base = base;
    h->len = len;
    h->avail = h->done = 0;
    h->cancel = false;
    h->busy = len > 0;
    pthread_mutex_unlock(&h->mu);
}

void dfl_hasher_avail(dfl_hasher *h, uint64_t n)
{
    pthread_mutex_lock(&h->mu);
    n = n < h->len ? n : h->len;
    if (h->busy && n > h->avail) {
        h->avail = n;
        pthread_cond_signal(&h->work);
    }
    pthread_mutex_unlock(&h->mu);
}

void dfl_hasher_finish(dfl_hasher *h)
{
    pthread_mutex_lock(&h->mu);
    while (h->busy)
        pthread_cond_wait(&h->idle, &h->mu);
    pthread_mutex_unlock(&h->mu);
}

void dfl_hasher_cancel(dfl_hasher *h)
{
    pthread_mutex_lock(&h->mu);
    if (h->busy) {
        h->cancel = true;
        pthread_cond_signal(&h->work);
        while (h->busy)
            pthread_cond_wait(&h->idle, &h->mu);
    }
    pthread_mutex_unlock(&h->mu);
}
