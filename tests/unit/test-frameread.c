/* test-frameread.c: the frame reader's hash thread (lib/formats/frame_hasher.h; dfl_reader_opts
 * .hash_thread): the thread on its own (digests equal to a one-shot XXH3 whatever the pieces,
 * cancel, reuse), and streams of large frames read through a pipe with the thread and without:
 * the same batches byte for byte, a corrupt byte anywhere in a large frame caught with the same
 * message, a stream cut inside a large frame reported the same way, and the error sticky; and the
 * writer's hash thread (dfl_writer_opts.hash_thread): the same bytes with it and without, in
 * both output modes, and a reader that goes away; and the bounce path (dfl_reader_opts.bounce,
 * frame_bounce.h): the streaming copy against memcpy at every alignment and length, the bounce
 * thread on its own, and the stream tests above through it, in the reading thread and in its
 * thread, with pieces and buffers of sizes that are not multiples of 32 bytes, and many frames
 * through one recycled block. */
#include <dirent.h>
#include <fcntl.h>
#include <signal.h>
#include <stdint.h>
#include <sys/wait.h>
#include <unistd.h>

#include "frame.h"
#include "frame_bounce.h"
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

/* Threads of this process named `comm` in /proc/self/task. */
static int n_named(const char *comm)
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
            n += fgets(name, sizeof name, f) && strncmp(name, comm, strlen(comm)) == 0 && name[strlen(comm)] == '\n';
            fclose(f);
        }
    }
    closedir(d);
    return n;
}

/* Hash threads of this process. */
static int n_threads(void) { return n_named("dfl-hash"); }

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

/* bs[0..nb) of tokens[i] tokens in seqs[i] sequences (3, or fewer where there are fewer tokens,
 * when seqs is NULL), random contents from seed. */
static void make_batches_of(dfl_batch *bs, int nb, const uint32_t *tokens, const uint32_t *seqs, uint64_t seed)
{
    uint64_t s = seed;
    dfl_err e;
    for (int i = 0; i < nb; i++) {
        uint32_t T = tokens[i], S = seqs ? seqs[i] : T < 3 ? T : 3;
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

static void make_batches(dfl_batch *bs) { make_batches_of(bs, NB, tokens_of, NULL, 7); }

static void stream_info(dfl_stream_info *in)
{
    *in = (dfl_stream_info){.kind = DFL_KIND_HIDDEN, .vocab_size = 1000, .hidden_size = HID, .n_layers = LAYERS,
                            .layers = {3, 9}, .dtype = DFL_BF16};
    snprintf(in->producer, sizeof in->producer, "test-frameread");
    snprintf(in->fingerprint, sizeof in->fingerprint, "0123456789abcdef0123456789abcdef");
}

/* The stream of bs[0..nb) as bytes (written to a file, then read back). */
static void make_stream_of(fc_buf *out, dfl_batch *bs, int nb)
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
    for (int i = 0; !rc && i < nb; i++)
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

static void make_stream(fc_buf *out, dfl_batch *bs) { make_stream_of(out, bs, NB); }

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
    int threads_during;       /* hash threads of the process while the stream was read */
    int bouncers_during;      /* bounce threads */
} result;

/* Reads s[0..n) through a pipe with the reader options o, checking every batch that comes out
 * against bs[0..nb). */
static void read_pipe_opts(const uint8_t *s, size_t n, const dfl_reader_opts *o, const dfl_batch *bs, int nb,
                           result *res, const char *what)
{
    memset(res, 0, sizeof *res);
    pid_t pid;
    int fd = feed(s, n, (uint64_t)n * 31 + (uint64_t)o->hash_thread * 7 + (uint64_t)o->bounce, &pid);
    dfl_reader *r;
    dfl_err e = {0};
    res->rc = dfl_reader_open_fd(&r, fd, "in.dfl", o, &e);
    if (res->rc == 0) {
        for (;;) {
            dfl_batch b;
            bool eos;
            res->rc = dfl_reader_next(r, &b, &eos, &e);
            int th = n_threads(), tb = n_named("dfl-bounce");
            res->threads_during = th > res->threads_during ? th : res->threads_during;
            res->bouncers_during = tb > res->bouncers_during ? tb : res->bouncers_during;
            if (res->rc || eos)
                break;
            int i = res->batches++;
            T_CHECK(i < nb && b.n_tokens == bs[i].n_tokens, "%s: batch %d of %llu tokens", what, i,
                    (unsigned long long)b.n_tokens);
            if (i < nb && b.n_tokens == bs[i].n_tokens) {
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

/* read_pipe_opts of the NB batches with the hash thread on (1) or off (-1), without the bounce
 * path. */
static void read_pipe(const uint8_t *s, size_t n, int hash_thread, uint32_t chunk, bool allow_truncated,
                      const dfl_batch *bs, result *res, const char *what)
{
    dfl_reader_opts o = {.hash_thread = hash_thread, .chunk = chunk, .allow_truncated = allow_truncated, .bounce = -1};
    read_pipe_opts(s, n, &o, bs, NB, res, what);
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

/* The bounce ways of reading (dfl_reader_opts.bounce, chunk, bounce_slots): in the reading
 * thread and in the bounce thread, with buffers of sizes that are and are not multiples of 32
 * bytes. */
static const struct {
    int bounce;
    uint32_t chunk, slots;
} bounce_ways[] = {{1, 64u << 10, 0}, {1, 100003, 0}, {2, 64u << 10, 2}, {2, 1000037, 3}, {2, 0, 0}};
#define N_BOUNCE_WAYS (sizeof bounce_ways / sizeof *bounce_ways)

/* Every way gives the same outcome and message: the hash thread on and off, and each bounce way;
 * returns the one with the hash thread. */
static void same_both_ways(const fc_buf *d, bool allow_truncated, const dfl_batch *bs, result *on, const char *what)
{
    result off;
    read_pipe(d->p, d->n, 1, 64u << 10, allow_truncated, bs, on, what);
    for (size_t w = 0; w <= N_BOUNCE_WAYS; w++) {
        char how[64] = "without";
        if (w == 0) {
            read_pipe(d->p, d->n, -1, 64u << 10, allow_truncated, bs, &off, what);
        } else {
            dfl_reader_opts o = {.allow_truncated = allow_truncated, .bounce = bounce_ways[w - 1].bounce,
                                 .chunk = bounce_ways[w - 1].chunk, .bounce_slots = bounce_ways[w - 1].slots};
            snprintf(how, sizeof how, "bounce %d, chunk %u, %u slots", o.bounce, o.chunk, o.bounce_slots);
            read_pipe_opts(d->p, d->n, &o, bs, NB, &off, what);
            T_CHECK(off.again_rc == off.rc && strcmp(off.again_msg, off.msg) == 0, "%s, %s: not sticky: %d %s", what,
                    how, off.again_rc, off.again_msg);
        }
        T_CHECK(on->rc == off.rc && strcmp(on->msg, off.msg) == 0 && on->batches == off.batches &&
                    on->truncated == off.truncated,
                "%s: with the thread rc %d after %d batches (%s), %s rc %d after %d (%s)", what, on->rc, on->batches,
                on->msg, how, off.rc, off.batches, off.msg);
    }
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

/* ---- the bounce path ------------------------------------------------------------------------- */

/* dfl_copy_stream equals memcpy for every length up to 600 and every alignment of both ends, and
 * for long copies of lengths that are not multiples of 32 bytes, and writes nothing outside
 * dst[0..n): streaming where the CPU can, and with memcpy. */
static void test_copy_stream(void)
{
    size_t cap = (3u << 20) + 4096;
    uint8_t *src = malloc(cap), *dst = malloc(cap);
    uint64_t s = 11;
    for (size_t i = 0; i < cap; i++)
        src[i] = (uint8_t)mix(&s);
    bool nt = dfl_copy_stream_nt();
    for (int pass = 0; pass < 2; pass++) {
        dfl_copy_stream_set(pass == 0);
        const char *how = pass == 0 ? (nt ? "streaming" : "memcpy (no AVX2)") : "memcpy";
        int bad = 0;
        for (size_t n = 0; n <= 600 && bad < 5; n++)
            for (size_t da = 0; da < 64 && bad < 5; da += (n < 200 ? 1 : 7))
                for (size_t sa = 0; sa < 64; sa += 13) {
                    memset(dst, 0xa5, n + 256);
                    dfl_copy_stream(dst + 64 + da, src + sa, n);
                    bool ok = memcmp(dst + 64 + da, src + sa, n) == 0;
                    for (size_t i = 0; i < 64 + da; i++)
                        ok = ok && dst[i] == 0xa5;
                    for (size_t i = 64 + da + n; i < n + 256; i++)
                        ok = ok && dst[i] == 0xa5;
                    if (!ok && bad++ < 5)
                        T_CHECK(ok, "%s: %zu bytes to offset %zu from offset %zu", how, n, da, sa);
                }
        static const size_t longs[] = {1u << 20, (1u << 20) + 1, (3u << 20) - 33, 1000037, 262144 + 31};
        for (size_t k = 0; k < sizeof longs / sizeof *longs; k++)
            for (size_t da = 0; da < 64; da += 21) {
                size_t n = longs[k];
                memset(dst, 0xa5, cap);
                dfl_copy_stream(dst + da, src + 3, n);
                bool ok = memcmp(dst + da, src + 3, n) == 0;
                for (size_t i = 0; i < da; i++)
                    ok = ok && dst[i] == 0xa5;
                for (size_t i = da + n; i < da + n + 64 && i < cap; i++)
                    ok = ok && dst[i] == 0xa5;
                T_CHECK(ok, "%s: %zu bytes to offset %zu", how, n, da);
            }
    }
    dfl_copy_stream_set(true);
    T_CHECK(dfl_copy_stream_nt() == nt, "dfl_copy_stream_set(true) gives %d, the CPU %d", dfl_copy_stream_nt(), nt);
    free(src);
    free(dst);
}

/* The bounce thread on its own: pieces of every size up to the buffer put through rings of 2 and 5
 * buffers give one-shot XXH3 digests and copies; a cancel drops what was queued and leaves it
 * ready; freed with pieces queued. */
static void test_bouncer(void)
{
    size_t n = 9u << 20, piece = 300007;
    uint8_t *src = malloc(n), *dst = malloc(n + 64);
    uint64_t s = 5;
    for (size_t i = 0; i < n; i++)
        src[i] = (uint8_t)mix(&s);
    XXH3_state_t *st = XXH3_createState();
    for (unsigned slots = 2; slots <= 5; slots += 3) {
        dfl_bouncer *b = dfl_bouncer_new(piece, slots);
        T_CHECK(b != NULL, "dfl_bouncer_new(%zu, %u)", piece, slots);
        if (!b)
            continue;
        T_CHECK(n_named("dfl-bounce") == 1, "%d bounce threads", n_named("dfl-bounce"));
        for (int round = 0; round < 3; round++) {
            /* the last 8 bytes are copied, not hashed (a frame's trailer) */
            XXH3_64bits_reset(st);
            memset(dst, 0, n + 64);
            size_t at = 0;
            while (at < n) {
                size_t k = round == 0 ? 1 + mix(&s) % 4096 : round == 1 ? piece : 1 + mix(&s) % piece;
                k = k > n - at ? n - at : k;
                uint8_t *buf = dfl_bouncer_take(b);
                memcpy(buf, src + at, k);
                size_t h = at >= n - 8 ? 0 : n - 8 - at < k ? n - 8 - at : k;
                dfl_bouncer_put(b, st, h, dst + 1 + at, k);
                at += k;
            }
            dfl_bouncer_finish(b);
            T_CHECK(XXH3_64bits_digest(st) == XXH3_64bits(src, n - 8), "%u slots, round %d: digest", slots, round);
            T_CHECK(memcmp(dst + 1, src, n) == 0 && dst[0] == 0 && dst[n + 1] == 0, "%u slots, round %d: copy", slots,
                    round);
        }
        /* cancelled: nothing more is written once cancel returns, and the next job is whole */
        XXH3_64bits_reset(st);
        memset(dst, 0, n + 64);
        for (size_t at = 0; at < 6 * piece; at += piece) {
            uint8_t *buf = dfl_bouncer_take(b);
            memcpy(buf, src + at, piece);
            dfl_bouncer_put(b, st, piece, dst + at, piece);
        }
        dfl_bouncer_cancel(b);
        uint64_t d1 = XXH3_64bits_digest(st);
        uint64_t sum1 = XXH3_64bits(dst, 6 * piece);
        usleep(20000);
        T_CHECK(XXH3_64bits_digest(st) == d1 && XXH3_64bits(dst, 6 * piece) == sum1, "%u slots: changed after cancel",
                slots);
        dfl_bouncer_cancel(b); /* nothing queued: returns at once */
        XXH3_64bits_reset(st);
        uint8_t *buf = dfl_bouncer_take(b);
        memcpy(buf, src + 5, piece);
        dfl_bouncer_put(b, st, piece, dst + 7, piece);
        dfl_bouncer_finish(b);
        T_CHECK(XXH3_64bits_digest(st) == XXH3_64bits(src + 5, piece) && memcmp(dst + 7, src + 5, piece) == 0,
                "%u slots: the piece after a cancel", slots);
        /* freed with pieces queued */
        for (unsigned k = 0; k < slots; k++) {
            buf = dfl_bouncer_take(b);
            memcpy(buf, src, piece);
            dfl_bouncer_put(b, st, piece, dst, piece);
        }
        dfl_bouncer_free(b);
        int left = n_named("dfl-bounce");
        for (int i = 0; i < 200 && left; i++) {
            usleep(5000);
            left = n_named("dfl-bounce");
        }
        T_CHECK(left == 0, "%d bounce threads after free", left);
    }
    T_CHECK(dfl_bouncer_new(0, 4) == NULL && dfl_bouncer_new(4096, 1) == NULL, "bad rings accepted");
    XXH3_freeState(st);
    free(src);
    free(dst);
}

/* Each bounce way reads the stream of test_pipe_identical byte for byte (the hash thread not
 * used; the bounce thread only where asked, and gone after close), with streaming stores and
 * with memcpy; and bad options are refused. */
static void test_pipe_bounce(void)
{
    dfl_batch bs[NB];
    make_batches(bs);
    fc_buf s = {0};
    make_stream(&s, bs);
    int base = n_threads_settled(0);
    for (int nt = 1; nt >= 0; nt--) {
        dfl_copy_stream_set(nt);
        for (size_t w = 0; w < N_BOUNCE_WAYS; w++) {
            dfl_reader_opts o = {.bounce = bounce_ways[w].bounce, .chunk = bounce_ways[w].chunk,
                                 .bounce_slots = bounce_ways[w].slots, .hash_thread = 1};
            char what[96];
            snprintf(what, sizeof what, "bounce %d, chunk %u, %u slots, %s", o.bounce, o.chunk, o.bounce_slots,
                     nt ? "streaming" : "memcpy");
            result res;
            read_pipe_opts(s.p, s.n, &o, bs, NB, &res, what);
            T_CHECK(res.rc == 0 && res.batches == NB, "%s: rc %d after %d batches: %s", what, res.rc, res.batches,
                    res.msg);
            T_CHECK(res.threads_during == base && res.bouncers_during == (o.bounce == 2),
                    "%s: %d hash threads (%d before), %d bounce threads while reading", what, res.threads_during,
                    base, res.bouncers_during);
            int left = n_named("dfl-bounce");
            for (int i = 0; i < 200 && left; i++) {
                usleep(5000);
                left = n_named("dfl-bounce");
            }
            T_CHECK(left == 0, "%s: %d bounce threads after close", what, left);
        }
    }
    dfl_copy_stream_set(true);
    /* auto: the bounce thread where 8 CPUs are online (then no hash thread), else read_body */
    dfl_reader_opts ao = {.hash_thread = 1};
    result res;
    read_pipe_opts(s.p, s.n, &ao, bs, NB, &res, "bounce auto");
    bool many = dfl_ncpu() >= 8;
    T_CHECK(res.rc == 0 && res.batches == NB && res.bouncers_during == many && res.threads_during == base + !many,
            "bounce auto on %d CPUs: rc %d after %d batches (%s), %d bounce and %d hash threads", dfl_ncpu(), res.rc,
            res.batches, res.msg, res.bouncers_during, res.threads_during);
    /* a file keeps read_body, also where it is read and not mapped (a stream that starts at an
     * offset that is not a multiple of 64) */
    char path[4096];
    snprintf(path, sizeof path, "%s/at1.dfl", t_tmpdir());
    FILE *f = fopen(path, "wb");
    bool wrote = f && fputc('x', f) != EOF && fwrite(s.p, 1, s.n, f) == s.n;
    if (f)
        fclose(f);
    int ffd = open(path, O_RDONLY);
    T_CHECK(wrote && ffd >= 0 && lseek(ffd, 1, SEEK_SET) == 1, "%s", path);
    dfl_reader_opts fo = {.bounce = 2};
    dfl_reader *fr = NULL;
    dfl_err fe = {0};
    int frc = dfl_reader_open_fd(&fr, ffd, "at1.dfl", &fo, &fe);
    int fb = 0, nfb = 0;
    for (bool eos = false; !frc && !eos;) {
        dfl_batch b;
        frc = dfl_reader_next(fr, &b, &eos, &fe);
        if (!frc && !eos) {
            nfb++;
            fb += n_named("dfl-bounce");
            dfl_reader_recycle(fr, &b);
        }
    }
    T_CHECK(frc == 0 && nfb == NB && fb == 0, "a file read at offset 1: rc %d after %d batches, %d bounce threads: %s",
            frc, nfb, fb, fe.msg);
    dfl_reader_close(fr);
    if (ffd >= 0)
        close(ffd);
    unlink(path);
    /* bad options */
    static const struct {
        int bounce;
        uint32_t slots;
    } bad[] = {{3, 0}, {-2, 0}, {2, 1}, {2, 65}};
    for (size_t k = 0; k < sizeof bad / sizeof *bad; k++) {
        pid_t pid;
        int fd = feed(s.p, s.n, 9, &pid);
        dfl_reader_opts o = {.bounce = bad[k].bounce, .bounce_slots = bad[k].slots};
        dfl_reader *r = NULL;
        dfl_err e = {0};
        int rc = dfl_reader_open_fd(&r, fd, "in.dfl", &o, &e);
        T_CHECK(rc == DFL_EUSAGE && r == NULL && strstr(e.msg, "in.dfl: reader options: bounce"),
                "bounce %d, %u slots: rc %d: %s", bad[k].bounce, bad[k].slots, rc, e.msg);
        close(fd);
        waitpid(pid, NULL, 0);
    }
    free(s.p);
    for (int i = 0; i < NB; i++)
        dfl_batch_free(&bs[i]);
}

/* Many large frames of sizes that differ (none a multiple of the buffer), read through one
 * recycled block by each way: every batch byte for byte, as without the bounce path. */
static void test_pipe_bounce_many(void)
{
    enum { MANY = 24 };
    dfl_batch *bs = calloc(MANY, sizeof *bs);
    uint32_t tokens[MANY], seqs[MANY];
    uint64_t s = 99;
    for (int i = 0; i < MANY; i++) {
        tokens[i] = 260 + (uint32_t)(mix(&s) % 500); /* frames of 4.3 to 12.4 MB */
        seqs[i] = 1 + (uint32_t)(mix(&s) % 7);
    }
    make_batches_of(bs, MANY, tokens, seqs, 99);
    fc_buf d = {0};
    make_stream_of(&d, bs, MANY);
    for (size_t k = 0; k < N_BOUNCE_WAYS; k++) {
        dfl_reader_opts o = {.bounce = bounce_ways[k].bounce, .chunk = bounce_ways[k].chunk,
                             .bounce_slots = bounce_ways[k].slots};
        char what[96];
        snprintf(what, sizeof what, "%d frames, bounce %d, chunk %u, %u slots", MANY, o.bounce, o.chunk,
                 o.bounce_slots);
        result res;
        read_pipe_opts(d.p, d.n, &o, bs, MANY, &res, what);
        T_CHECK(res.rc == 0 && res.batches == MANY, "%s: rc %d after %d batches: %s", what, res.rc, res.batches,
                res.msg);
    }
    free(d.p);
    for (int i = 0; i < MANY; i++)
        dfl_batch_free(&bs[i]);
    free(bs);
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
    T_RUN(test_copy_stream);
    T_RUN(test_bouncer);
    T_RUN(test_pipe_bounce);
    T_RUN(test_pipe_bounce_many);
    return t_done();
}
