/* test-frameread.c: the frame reader's hash thread (lib/formats/frame_hasher.h; dfl_reader_opts
 * .hash_thread): the thread on its own (digests equal to a one-shot XXH3 whatever the pieces,
 * cancel, reuse), and streams of large frames read through a pipe with the thread and without:
 * the same batches byte for byte, a corrupt byte anywhere in a large frame caught with the same
 * message, a stream cut inside a large frame reported the same way, and the error sticky; and the
 * writer's hash thread (dfl_writer_opts.hash_thread): the same bytes with it and without, in
 * both output modes, and a reader that goes away. */
#include <dirent.h>
#include <fcntl.h>
#include <signal.h>
#include <stdint.h>
#include <sys/wait.h>
#include <unistd.h>

#include "frame.h"
#include "frame_hasher.h"
#include "util.h"
#include "t.h"
#include "../tools/framecraft.h"

static uint64_t mix(uint64_t *s)
{
    uint64_t z = (*s += 0x9e3779b97f4a7c15ull);
    z = (z ^ (z >> 30)) * 0xbf58476d1ce4e5b9ull;
    z = (z ^ (z >> 27)) * 0x94d049bb133111ebull;
    return z ^ (z >> 31);
}

/* Hash threads of this process (threads named dfl-hash in /proc/self/task). */
static int n_threads(void)
{
    DIR *d = opendir("/proc/self/task");
    int n = 0;
    if (!d)
        return -1;
    for (struct dirent *de; (de = readdir(d));) {
        char path[300], name[32] = "";
        snprintf(path, sizeof path, "/proc/self/task/%s/comm", de->d_name);
        FILE *f = de->d_name[0] != '.' ? fopen(path, "r") : NULL;
        if (f) {
            n += fgets(name, sizeof name, f) && strcmp(name, "dfl-hash\n") == 0;
            fclose(f);
        }
    }
    closedir(d);
    return n;
}

/* n_threads once it equals want, or after a second: a thread that pthread_join has seen end can
 * stay listed a little longer. */
static int n_threads_settled(int want)
{
    int n = n_threads();
    for (int i = 0; i < 200 && n != want; i++) {
        usleep(5000);
        n = n_threads();
    }
    return n;
}

/* ---- the thread on its own ------------------------------------------------------------------- */

static void test_hasher(void)
{
    size_t n = 9u << 20;
    uint8_t *buf = malloc(n);
    uint64_t s = 1;
    for (size_t i = 0; i < n; i++)
        buf[i] = (uint8_t)mix(&s);
    uint64_t want = XXH3_64bits(buf, n);
    dfl_hasher *h = dfl_hasher_new();
    T_CHECK(h != NULL, "dfl_hasher_new");
    if (!h) {
        free(buf);
        return;
    }
    XXH3_state_t *st = XXH3_createState();
    /* pieces of every size from 1 byte to 2 MiB, some made available twice or past the end */
    for (int round = 0; round < 4; round++) {
        XXH3_64bits_reset(st);
        dfl_hasher_start(h, st, buf, n);
        size_t at = 0;
        while (at < n) {
            size_t step = round == 0 ? 1 + mix(&s) % 4096 : 1 + mix(&s) % (2u << 20);
            at = at + step > n ? n : at + step;
            dfl_hasher_avail(h, at);
            if (mix(&s) % 4 == 0)
                dfl_hasher_avail(h, at / 2); /* never goes back */
        }
        dfl_hasher_avail(h, n + 100);
        dfl_hasher_finish(h);
        uint64_t got = XXH3_64bits_digest(st);
        T_CHECK(got == want, "round %d: digest %016llx, want %016llx", round, (unsigned long long)got,
                (unsigned long long)want);
    }
    /* a cancelled job leaves the thread ready for the next; after the cancel the state is no
     * longer touched (its digest stays what it was when cancel returned) */
    XXH3_64bits_reset(st);
    dfl_hasher_start(h, st, buf, n);
    dfl_hasher_avail(h, n / 3);
    dfl_hasher_cancel(h);
    uint64_t d1 = XXH3_64bits_digest(st);
    usleep(20000);
    T_CHECK(XXH3_64bits_digest(st) == d1, "the state changed after cancel returned");
    dfl_hasher_cancel(h); /* no job: returns at once */
    XXH3_64bits_reset(st);
    dfl_hasher_start(h, st, buf + 1, n - 1);
    dfl_hasher_avail(h, n);
    dfl_hasher_finish(h);
    T_CHECK(XXH3_64bits_digest(st) == XXH3_64bits(buf + 1, n - 1), "the job after a cancel");
    /* an empty job is finished at once */
    XXH3_64bits_reset(st);
    dfl_hasher_start(h, st, buf, 0);
    dfl_hasher_finish(h);
    T_CHECK(XXH3_64bits_digest(st) == XXH3_64bits(buf, 0), "empty job");
    /* freed in the middle of a job */
    XXH3_64bits_reset(st);
    dfl_hasher_start(h, st, buf, n);
    dfl_hasher_avail(h, n / 2);
    dfl_hasher_free(h);
    XXH3_freeState(st);
    free(buf);
}

/* ---- streams through a pipe ------------------------------------------------------------------ */

enum { NB = 5 };
static const uint32_t tokens_of[NB] = {40, 700, 3, 520, 96}; /* 11.5 MB and 8.5 MB frames, small ones between */
#define HID 4096
#define LAYERS 2

static void make_batches(dfl_batch *bs)
{
    uint64_t s = 7;
    dfl_err e;
    for (int i = 0; i < NB; i++) {
        uint32_t T = tokens_of[i], S = T < 3 ? T : 3;
        if (dfl_batch_alloc(&bs[i], T, S, LAYERS, HID, DFL_BF16, &e)) {
            fprintf(stderr, "%s\n", e.msg);
            abort();
        }
        uint32_t *lens = (uint32_t *)bs[i].seq_lens;
        for (uint32_t k = 0; k < S; k++)
            lens[k] = T / S + (k < T % S);
        for (uint32_t t = 0; t < T; t++) {
            ((int32_t *)bs[i].input_ids)[t] = (int32_t)(mix(&s) % 1000);
            ((uint8_t *)bs[i].loss_mask)[t] = (uint8_t)(mix(&s) & 1);
        }
        for (uint32_t k = 0; k < LAYERS; k++) {
            uint64_t *p = (uint64_t *)bs[i].layers[k];
            for (size_t j = 0; j < (size_t)T * HID * 2 / 8; j++)
                p[j] = mix(&s) & 0x3f7f3f7f3f7f3f7full; /* finite bf16 values */
        }
    }
}

static void stream_info(dfl_stream_info *in)
{
    *in = (dfl_stream_info){.kind = DFL_KIND_HIDDEN, .vocab_size = 1000, .hidden_size = HID, .n_layers = LAYERS,
                            .layers = {3, 9}, .dtype = DFL_BF16};
    snprintf(in->producer, sizeof in->producer, "test-frameread");
    snprintf(in->fingerprint, sizeof in->fingerprint, "0123456789abcdef0123456789abcdef");
}

/* The stream of make_batches as bytes (written to a file, then read back). */
static void make_stream(fc_buf *out, dfl_batch *bs)
{
    dfl_stream_info in;
    stream_info(&in);
    char path[4096];
    snprintf(path, sizeof path, "%s/stream.dfl", t_tmpdir());
    dfl_writer *w;
    dfl_err e;
    char *data;
    size_t n;
    int rc = dfl_writer_open(&w, path, &in, NULL, &e);
    for (int i = 0; !rc && i < NB; i++)
        rc = dfl_writer_batch(w, &bs[i], &e);
    if (rc || dfl_writer_close(w, &e) || dfl_read_file(path, 1u << 30, &data, &n, &e)) {
        fprintf(stderr, "make_stream: %s\n", e.msg);
        abort();
    }
    out->n = 0;
    fc_append(out, data, n);
    free(data);
    unlink(path);
}

/* A child process writes s[0..n) into a pipe in pieces of random sizes (so that reads return
 * short); returns the read end. */
static int feed(const uint8_t *s, size_t n, uint64_t seed, pid_t *pid)
{
    int p[2];
    if (pipe(p) != 0)
        abort();
    fflush(NULL);
    *pid = fork();
    if (*pid == 0) {
        close(p[0]);
        signal(SIGPIPE, SIG_IGN); /* the reader stops early on a bad frame */
        for (size_t at = 0; at < n;) {
            size_t k = 1 + mix(&seed) % (3u << 19);
            k = k > n - at ? n - at : k;
            ssize_t w = write(p[1], s + at, k);
            if (w <= 0)
                _exit(0);
            at += (size_t)w;
        }
        _exit(0);
    }
    close(p[1]);
    return p[0];
}

typedef struct result {
    int rc, again_rc;         /* the error, and that of the call after it (sticky) */
    char msg[1024], again_msg[1024];
    int batches;              /* batches that came out before the end or the error */
    bool truncated;
    int threads_during;       /* threads of the process while the stream was read */
} result;

/* Reads s[0..n) through a pipe with the hash thread on (1) or off (-1), checking every batch
 * that comes out against bs. */
static void read_pipe(const uint8_t *s, size_t n, int hash_thread, uint32_t chunk, bool allow_truncated,
                      const dfl_batch *bs, result *res, const char *what)
{
    memset(res, 0, sizeof *res);
    pid_t pid;
    int fd = feed(s, n, (uint64_t)n * 31 + (uint64_t)hash_thread, &pid);
    dfl_reader_opts o = {.hash_thread = hash_thread, .chunk = chunk, .allow_truncated = allow_truncated};
    dfl_reader *r;
    dfl_err e = {0};
    res->rc = dfl_reader_open_fd(&r, fd, "in.dfl", &o, &e);
    if (res->rc == 0) {
        for (;;) {
            dfl_batch b;
            bool eos;
            res->rc = dfl_reader_next(r, &b, &eos, &e);
            int th = n_threads();
            res->threads_during = th > res->threads_during ? th : res->threads_during;
            if (res->rc || eos)
                break;
            int i = res->batches++;
            T_CHECK(i < NB && b.n_tokens == bs[i].n_tokens, "%s: batch %d of %llu tokens", what, i,
                    (unsigned long long)b.n_tokens);
            if (i < NB && b.n_tokens == bs[i].n_tokens) {
                T_CHECK(memcmp(b.seq_lens, bs[i].seq_lens, 4ull * b.n_seqs) == 0 &&
                            memcmp(b.input_ids, bs[i].input_ids, 4 * b.n_tokens) == 0 &&
                            memcmp(b.loss_mask, bs[i].loss_mask, b.n_tokens) == 0,
                        "%s: batch %d: tokens differ", what, i);
                for (uint32_t k = 0; k < LAYERS; k++)
                    T_CHECK(memcmp(b.layers[k], bs[i].layers[k], (size_t)b.n_tokens * HID * 2) == 0,
                            "%s: batch %d layer %u differs", what, i, k);
            }
            dfl_reader_recycle(r, &b);
        }
        if (res->rc) {
            snprintf(res->msg, sizeof res->msg, "%s", e.msg);
            dfl_batch b;
            bool eos;
            res->again_rc = dfl_reader_next(r, &b, &eos, &e);
            snprintf(res->again_msg, sizeof res->again_msg, "%s", e.msg);
        }
        res->truncated = dfl_reader_truncated(r);
        dfl_reader_close(r);
    } else {
        snprintf(res->msg, sizeof res->msg, "%s", e.msg);
    }
    close(fd);
    int st;
    waitpid(pid, &st, 0);
}

/* Offsets of the frames of s. */
static int frames_of(const fc_buf *s, size_t *offs) { return fc_list(s->p, s->n, offs, 16); }

static void test_pipe_identical(void)
{
    dfl_batch bs[NB];
    make_batches(bs);
    fc_buf s = {0};
    make_stream(&s, bs);
    int base = n_threads_settled(0);
    static const uint32_t chunks[] = {0, 4096, 64u << 10, 3u << 20};
    for (int hs = -1; hs <= 1; hs += 2)
        for (size_t c = 0; c < sizeof chunks / sizeof *chunks; c++) {
            char what[64];
            snprintf(what, sizeof what, "hash thread %s, chunk %u", hs > 0 ? "on" : "off", chunks[c]);
            result res;
            read_pipe(s.p, s.n, hs, chunks[c], false, bs, &res, what);
            T_CHECK(res.rc == 0 && res.batches == NB, "%s: rc %d after %d batches: %s", what, res.rc, res.batches,
                    res.msg);
            /* the thread exists while frames of 4 MiB and more are read with it on, and is gone
             * after close */
            T_CHECK(res.threads_during == base + (hs > 0), "%s: %d threads while reading, %d before", what,
                    res.threads_during, base);
            int after = n_threads_settled(base);
            T_CHECK(after == base, "%s: %d threads after close, %d before", what, after, base);
        }
    /* auto on a pipe is one of the two, and reads the same */
    result res;
    read_pipe(s.p, s.n, 0, 0, false, bs, &res, "auto");
    T_CHECK(res.rc == 0 && res.batches == NB, "auto: rc %d: %s", res.rc, res.msg);
    T_CHECK(res.threads_during == base + (dfl_ncpu() >= 8), "auto: %d threads on %d CPUs", res.threads_during,
            dfl_ncpu());
    free(s.p);
    for (int i = 0; i < NB; i++)
        dfl_batch_free(&bs[i]);
}

/* Both ways give the same outcome and message; returns the one with the thread. */
static void same_both_ways(const fc_buf *d, bool allow_truncated, const dfl_batch *bs, result *on, const char *what)
{
    result off;
    read_pipe(d->p, d->n, 1, 64u << 10, allow_truncated, bs, on, what);
    read_pipe(d->p, d->n, -1, 64u << 10, allow_truncated, bs, &off, what);
    T_CHECK(on->rc == off.rc && strcmp(on->msg, off.msg) == 0 && on->batches == off.batches &&
                on->truncated == off.truncated,
            "%s: with the thread rc %d after %d batches (%s), without rc %d after %d (%s)", what, on->rc, on->batches,
            on->msg, off.rc, off.batches, off.msg);
    T_CHECK(on->again_rc == on->rc && strcmp(on->again_msg, on->msg) == 0, "%s: not sticky: %d %s", what,
            on->again_rc, on->again_msg);
}

static void test_pipe_corrupt(void)
{
    dfl_batch bs[NB];
    make_batches(bs);
    fc_buf s = {0}, d = {0};
    make_stream(&s, bs);
    size_t offs[16];
    int nf = frames_of(&s, offs);
    T_CHECK(nf == NB + 3, "%d frames", nf); /* HEADER, batches, INDEX, END */
    for (int f = 2; f <= 4; f += 2) {       /* the two large frames */
        size_t at = offs[f], total = fc_total(s.p + at);
        uint64_t stored = fc_get64(s.p + at + 8);
        /* a byte of the first piece, of the middle, the last of the payload, of the padding, of
         * the trailer */
        size_t where[] = {at + 64 + 5, at + total / 2 + 1, at + 64 + stored - 1, at + 64 + stored, at + total - 3};
        for (size_t k = 0; k < sizeof where / sizeof *where; k++) {
            fc_copy(&d, s.p, s.n);
            d.p[where[k]] ^= 0x10;
            char what[96], want[160];
            snprintf(what, sizeof what, "frame %d, byte %zu flipped", f, where[k]);
            result on;
            same_both_ways(&d, false, bs, &on, what);
            snprintf(want, sizeof want, "in.dfl: frame %d at offset %zu: checksum mismatch (the HIDDEN frame is corrupt)",
                     f, at);
            T_CHECK(on.rc == DFL_EDATA && strcmp(on.msg, want) == 0 && on.batches == f - 1,
                    "%s: rc %d after %d batches: %s", what, on.rc, on.batches, on.msg);
        }
    }
    free(s.p);
    free(d.p);
    for (int i = 0; i < NB; i++)
        dfl_batch_free(&bs[i]);
}

static void test_pipe_cut(void)
{
    dfl_batch bs[NB];
    make_batches(bs);
    fc_buf s = {0};
    make_stream(&s, bs);
    size_t offs[16];
    frames_of(&s, offs);
    size_t at = offs[2], total = fc_total(s.p + at);
    size_t cuts[] = {at + 64, at + 64 + 1, at + (256u << 10), at + total / 2, at + total - 8, at + total - 1};
    for (size_t k = 0; k < sizeof cuts / sizeof *cuts; k++) {
        char what[96], want[200];
        snprintf(what, sizeof what, "cut at %zu", cuts[k]);
        fc_buf d = {s.p, cuts[k], 0};
        result on;
        same_both_ways(&d, false, bs, &on, what);
        snprintf(want, sizeof want, "in.dfl: truncated inside frame 2 (HIDDEN) at offset %zu: %zu of its %zu bytes present",
                 at, cuts[k] - at, total);
        T_CHECK(on.rc == DFL_ETRUNC && strcmp(on.msg, want) == 0 && on.batches == 1, "%s: rc %d after %d batches: %s",
                what, on.rc, on.batches, on.msg);
        /* allow_truncated: a clean end after the one complete batch */
        same_both_ways(&d, true, bs, &on, what);
        T_CHECK(on.rc == 0 && on.truncated && on.batches == 1, "%s, allow_truncated: rc %d trunc %d after %d: %s",
                what, on.rc, on.truncated, on.batches, on.msg);
    }
    free(s.p);
    for (int i = 0; i < NB; i++)
        dfl_batch_free(&bs[i]);
}

/* The reader enlarges an input pipe that its producer left at the default 64 KiB (cat, zstdcat)
 * to pipe-max-size (at most 64 MiB), and leaves one that its producer sized alone;
 * dfl_pipe_enlarge never shrinks one. */
static void test_pipe_enlarged(void)
{
    dfl_batch bs[NB];
    make_batches(bs);
    fc_buf s = {0};
    make_stream(&s, bs);
    /* what the system allows: a fresh pipe enlarged as far as it goes */
    int q[2];
    if (pipe(q) != 0)
        abort();
    long max = (long)dfl_pipe_enlarge(q[0], 64u << 20);
    close(q[0]);
    close(q[1]);
    pid_t pid;
    int fd = feed(s.p, s.n, 3, &pid);
    int before = fcntl(fd, F_GETPIPE_SZ);
    dfl_reader *r;
    dfl_err e;
    T_CHECK(dfl_reader_open_fd(&r, fd, "in.dfl", NULL, &e) == 0, "open: %s", e.msg);
    int after = fcntl(fd, F_GETPIPE_SZ);
    T_CHECK(after >= max, "pipe of %d bytes before the reader opened it, %d after (want %ld)", before,
            after, max);
    T_CHECK(dfl_pipe_enlarge(fd, 4096) == (uint32_t)after && fcntl(fd, F_GETPIPE_SZ) == after, "shrunk");
    dfl_reader_close(r);
    close(fd);
    waitpid(pid, NULL, 0);
    /* a pipe that its producer sized keeps its size */
    fd = feed(s.p, s.n, 4, &pid);
    int sized = fcntl(fd, F_SETPIPE_SZ, 262144);
    T_CHECK(dfl_reader_open_fd(&r, fd, "in.dfl", NULL, &e) == 0, "open: %s", e.msg);
    T_CHECK(sized == 262144 && fcntl(fd, F_GETPIPE_SZ) == 262144, "a pipe sized to %d bytes by its producer: %d",
            sized, fcntl(fd, F_GETPIPE_SZ));
    dfl_reader_close(r);
    close(fd);
    waitpid(pid, NULL, 0);
    free(s.p);
    for (int i = 0; i < NB; i++)
        dfl_batch_free(&bs[i]);
}

/* ---- the writer's hash thread ------------------------------------------------------------------- */

/* A child process writes bs into a pipe with the writer options o; the parent reads up to
 * `keep` bytes of it (all when keep is SIZE_MAX) into out, then closes the pipe. Returns the
 * child's exit status: 0 written, 1 the write failed with DFL_EPIPE, 2 the thread count was not
 * as expected (want_threads hash threads after the first large batch), 3 another error. */
static int capture(const dfl_writer_opts *o, dfl_batch *bs, int want_threads, size_t keep, fc_buf *out)
{
    int p[2];
    if (pipe(p) != 0)
        abort();
    fflush(NULL);
    pid_t pid = fork();
    if (pid == 0) {
        close(p[0]);
        signal(SIGPIPE, SIG_IGN);
        dfl_stream_info in;
        stream_info(&in);
        dfl_writer *w;
        dfl_err e;
        int rc = dfl_writer_open_fd(&w, p[1], "pipe", &in, o, &e), code = 0;
        for (int i = 0; !rc && i < NB; i++) {
            rc = dfl_writer_batch(w, &bs[i], &e);
            if (!rc && i == 1 && n_threads() != want_threads)
                code = 2;
        }
        if (rc) {
            dfl_writer_abort(w);
            code = rc == DFL_EPIPE ? 1 : 3;
        } else if (dfl_writer_close(w, &e)) {
            code = 3;
        }
        /* the arrays go (ASan sees any read of them after the writer said it was done) */
        for (int i = 0; i < NB; i++)
            dfl_batch_free(&bs[i]);
        if (code == 3)
            fprintf(stderr, "writer child: %s\n", e.msg);
        _exit(code);
    }
    close(p[1]);
    out->n = 0;
    uint8_t buf[1 << 16];
    for (;;) {
        size_t want = keep - out->n < sizeof buf ? keep - out->n : sizeof buf;
        ssize_t k = want ? read(p[0], buf, want) : 0;
        if (k <= 0)
            break;
        fc_append(out, buf, (size_t)k);
    }
    close(p[0]);
    int st;
    waitpid(pid, &st, 0);
    return WIFEXITED(st) ? WEXITSTATUS(st) : 100;
}

static void test_writer_thread(void)
{
    dfl_batch bs[NB];
    make_batches(bs);
    fc_buf plain = {0}, threaded = {0};
    for (int vms = 0; vms <= 1; vms++) {
        char what[64];
        snprintf(what, sizeof what, "writer %s", vms ? "vmsplice" : "write");
        dfl_writer_opts off = {.vmsplice = vms, .hash_thread = -1}, on = {.vmsplice = vms, .hash_thread = 1};
        int st = capture(&off, bs, 0, SIZE_MAX, &plain);
        T_CHECK(st == 0, "%s, no hash thread: child status %d", what, st);
        st = capture(&on, bs, 1, SIZE_MAX, &threaded);
        T_CHECK(st == 0, "%s, hash thread: child status %d", what, st);
        T_CHECK(plain.n > 20000000 && threaded.n == plain.n && memcmp(threaded.p, plain.p, plain.n) == 0,
                "%s: %zu bytes with the hash thread, %zu without, or they differ", what, threaded.n, plain.n);
        result res;
        read_pipe(threaded.p, threaded.n, -1, 0, false, bs, &res, what);
        T_CHECK(res.rc == 0 && res.batches == NB, "%s: read back: rc %d after %d: %s", what, res.rc, res.batches,
                res.msg);
        /* the reader goes away inside the second large frame: the writer fails with EPIPE, its
         * job cancelled, and the child frees the arrays */
        st = capture(&on, bs, 1, 15u << 20, &threaded);
        T_CHECK(st == 1, "%s: the reader went away: child status %d (want 1, DFL_EPIPE)", what, st);
    }
    free(plain.p);
    free(threaded.p);
    for (int i = 0; i < NB; i++)
        dfl_batch_free(&bs[i]);
}

int main(int argc, char **argv)
{
    (void)argc;
    t_init(argv[0]);
    T_RUN(test_hasher);
    T_RUN(test_pipe_identical);
    T_RUN(test_pipe_corrupt);
    T_RUN(test_pipe_cut);
    T_RUN(test_pipe_enlarged);
    T_RUN(test_writer_thread);
    return t_done();
}
