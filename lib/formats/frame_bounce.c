/* frame_bounce.c: the streaming copy and the bounce thread of the frame reader (frame_bounce.h).
 * The ring is a queue of buffer numbers under a mutex: head is the oldest queued piece (the one
 * the thread works on while busy), count the pieces queued; the reading thread fills buffer
 * (head + count) % slots, which is free while count < slots. The thread sleeps on `work` when the
 * queue is empty, the reading thread on `room` while every buffer is queued and on `idle` while
 * it waits for the queue to drain. */
#include "frame_bounce.h"

#if defined(__x86_64__) || defined(__i386__)
#include <immintrin.h>
#define HAVE_X86 1
#endif
#include <pthread.h>
#include <stdlib.h>
#include <string.h>

#include "frame_hasher.h"
#include "util.h"

/* ---- the streaming copy ----------------------------------------------------------------------- */

#ifdef HAVE_X86
__attribute__((target("avx2"))) static void copy_nt_avx2(uint8_t *d, const uint8_t *s, size_t n)
{
    size_t head = (size_t)(-(uintptr_t)d & 63); /* plain stores up to the first whole line */
    head = head < n ? head : n;
    memcpy(d, s, head);
    d += head;
    s += head;
    n -= head;
    size_t i = 0;
    for (; i + 128 <= n; i += 128) {
        __m256i a = _mm256_loadu_si256((const __m256i *)(s + i)), b = _mm256_loadu_si256((const __m256i *)(s + i + 32)),
                c = _mm256_loadu_si256((const __m256i *)(s + i + 64)), e = _mm256_loadu_si256((const __m256i *)(s + i + 96));
        _mm256_stream_si256((__m256i *)(d + i), a);
        _mm256_stream_si256((__m256i *)(d + i + 32), b);
        _mm256_stream_si256((__m256i *)(d + i + 64), c);
        _mm256_stream_si256((__m256i *)(d + i + 96), e);
    }
    for (; i + 64 <= n; i += 64) {
        __m256i a = _mm256_loadu_si256((const __m256i *)(s + i)), b = _mm256_loadu_si256((const __m256i *)(s + i + 32));
        _mm256_stream_si256((__m256i *)(d + i), a);
        _mm256_stream_si256((__m256i *)(d + i + 32), b);
    }
    memcpy(d + i, s + i, n - i); /* the partial line at the end */
    _mm_sfence(); /* the streamed lines are ordered before whatever this thread stores next (the
                     handoff of the frame) */
}

static int nt_state = -1; /* -1: not asked yet; 0: memcpy; 1: streaming */

static bool cpu_has_avx2(void)
{
    __builtin_cpu_init();
    return __builtin_cpu_supports("avx2");
}
#else /* not x86: plain memcpy */
static void copy_nt_avx2(uint8_t *d, const uint8_t *s, size_t n) { memcpy(d, s, n); }
static bool cpu_has_avx2(void) { return false; }
#endif

bool dfl_copy_stream_nt(void)
{
    int s = __atomic_load_n(&nt_state, __ATOMIC_RELAXED);
    if (s < 0) {
        s = cpu_has_avx2();
        __atomic_store_n(&nt_state, s, __ATOMIC_RELAXED);
    }
    return s;
}

void dfl_copy_stream_set(bool on) { __atomic_store_n(&nt_state, on && cpu_has_avx2(), __ATOMIC_RELAXED); }

void dfl_copy_stream(void *dst, const void *src, size_t n)
{
    if (dfl_copy_stream_nt())
        copy_nt_avx2(dst, src, n);
    else
        memcpy(dst, src, n);
}

/* ---- the bounce thread ------------------------------------------------------------------------ */

typedef struct piece {
    XXH3_state_t *st;
    size_t hash_n, n;
    uint8_t *dst;
} piece;

struct dfl_bouncer {
    pthread_t thread;
    pthread_mutex_t mu;
    pthread_cond_t work, room, idle;
    unsigned slots;
    size_t size;
    uint8_t **buf;           /* [slots] */
    piece *job;              /* [slots]: the piece queued in each buffer */
    /* under mu */
    unsigned head, count;
    bool busy, quit;         /* busy: the thread works on buffer head (count >= 1) */
};

static void *bouncer_main(void *arg)
{
    dfl_bouncer *b = arg;
    pthread_mutex_lock(&b->mu);
    for (;;) {
        while (!b->quit && b->count == 0)
            pthread_cond_wait(&b->work, &b->mu);
        if (b->quit)
            break;
        unsigned k = b->head;
        piece p = b->job[k];
        b->busy = true;
        pthread_mutex_unlock(&b->mu);
        /* the buffer was filled before it was queued (the mutex orders it), and the reading
         * thread touches neither it nor p.st nor p.dst until the piece is done */
        if (p.hash_n)
            XXH3_64bits_update(p.st, b->buf[k], p.hash_n);
        dfl_copy_stream(p.dst, b->buf[k], p.n);
        pthread_mutex_lock(&b->mu);
        b->busy = false;
        b->head = (b->head + 1) % b->slots;
        b->count--;
        pthread_cond_signal(&b->room);
        if (b->count == 0)
            pthread_cond_signal(&b->idle);
    }
    pthread_mutex_unlock(&b->mu);
    return NULL;
}

static void bouncer_release(dfl_bouncer *b)
{
    for (unsigned i = 0; b->buf && i < b->slots; i++)
        free(b->buf[i]);
    free(b->buf);
    free(b->job);
    free(b);
}

dfl_bouncer *dfl_bouncer_new(size_t size, unsigned slots)
{
    if (size == 0 || slots < 2 || size > SIZE_MAX - 4096)
        return NULL;
    dfl_bouncer *b = calloc(1, sizeof *b);
    if (!b)
        return NULL;
    b->slots = slots;
    b->size = size;
    b->buf = calloc(slots, sizeof *b->buf);
    b->job = calloc(slots, sizeof *b->job);
    bool ok = b->buf && b->job;
    for (unsigned i = 0; ok && i < slots; i++)
        ok = (b->buf[i] = aligned_alloc(4096, (size_t)DFL_ALIGN_UP(size, 4096))) != NULL;
    if (!ok || pthread_mutex_init(&b->mu, NULL)) {
        bouncer_release(b);
        return NULL;
    }
    pthread_cond_init(&b->work, NULL);
    pthread_cond_init(&b->room, NULL);
    pthread_cond_init(&b->idle, NULL);
    if (dfl_reader_thread_start(&b->thread, bouncer_main, b, "dfl-bounce")) {
        pthread_cond_destroy(&b->work);
        pthread_cond_destroy(&b->room);
        pthread_cond_destroy(&b->idle);
        pthread_mutex_destroy(&b->mu);
        bouncer_release(b);
        return NULL;
    }
    return b;
}

void dfl_bouncer_free(dfl_bouncer *b)
{
    if (!b)
        return;
    dfl_bouncer_cancel(b);
    pthread_mutex_lock(&b->mu);
    b->quit = true;
    pthread_cond_signal(&b->work);
    pthread_mutex_unlock(&b->mu);
    pthread_join(b->thread, NULL);
    pthread_cond_destroy(&b->work);
    pthread_cond_destroy(&b->room);
    pthread_cond_destroy(&b->idle);
    pthread_mutex_destroy(&b->mu);
    bouncer_release(b);
}

uint8_t *dfl_bouncer_take(dfl_bouncer *b)
{
    pthread_mutex_lock(&b->mu);
    while (b->count == b->slots)
        pthread_cond_wait(&b->room, &b->mu);
    uint8_t *p = b->buf[(b->head + b->count) % b->slots];
    pthread_mutex_unlock(&b->mu);
    return p;
}

void dfl_bouncer_put(dfl_bouncer *b, XXH3_state_t *st, size_t hash_n, uint8_t *dst, size_t n)
{
    pthread_mutex_lock(&b->mu);
    unsigned k = (b->head + b->count) % b->slots;
    b->job[k] = (piece){st, hash_n < n ? hash_n : n, n < b->size ? n : b->size, dst};
    b->count++;
    pthread_cond_signal(&b->work);
    pthread_mutex_unlock(&b->mu);
}

void dfl_bouncer_finish(dfl_bouncer *b)
{
    pthread_mutex_lock(&b->mu);
    while (b->count > 0)
        pthread_cond_wait(&b->idle, &b->mu);
    pthread_mutex_unlock(&b->mu);
}

void dfl_bouncer_cancel(dfl_bouncer *b)
{
    pthread_mutex_lock(&b->mu);
    b->count = b->busy ? 1 : 0; /* the queued pieces after the one in progress go */
    while (b->count > 0)
        pthread_cond_wait(&b->idle, &b->mu);
    pthread_mutex_unlock(&b->mu);
}
