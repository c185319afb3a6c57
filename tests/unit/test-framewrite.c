/* test-framewrite.c: the frame writer's ways of copying less (lib/formats/frame.h): batch frames
 * reserved in a file, filled in place and committed (the file byte-identical to one written with
 * dfl_writer_batch, for any dtype, layer count and batch shape; reservations made on one thread
 * while another commits; the order, shape and state rules; a given-up frame; no file left
 * behind); vmsplice into a pipe (the same bytes as writing; dfl_writer_read_upto follows the
 * consumer); and the piece sizes of writing and reading (dfl_writer_opts.chunk,
 * dfl_reader_opts.chunk: odd sizes through a pipe give the same batches, and a file the same
 * bytes) and the pipe's enlargement (dfl_writer_opts.pipe_size). */
#include <errno.h>
#include <fcntl.h>
#include <pthread.h>
#include <signal.h>
#include <stdint.h>
#include <sys/mman.h>
#include <sys/stat.h>
#include <sys/wait.h>
#include <unistd.h>

#include "frame.h"
#include "util.h"
#include "t.h"

static uint64_t rng(uint64_t *s)
{
    *s += 0x9e3779b97f4a7c15ull;
    uint64_t z = *s;
    z = (z ^ (z >> 30)) * 0xbf58476d1ce4e5b9ull;
    z = (z ^ (z >> 27)) * 0x94d049bb133111ebull;
    return z ^ (z >> 31);
}

static void info_of(dfl_stream_info *in, int K, int64_t H, dfl_dtype dt)
{
    memset(in, 0, sizeof *in);
    in->kind = DFL_KIND_HIDDEN;
    snprintf(in->producer, sizeof in->producer, "test-framewrite");
    in->vocab_size = 5000;
    in->hidden_size = H;
    in->n_layers = K;
    for (int k = 0; k < K; k++)
        in->layers[k] = 3 * k + 1;
    in->dtype = dt;
    snprintf(in->fingerprint, sizeof in->fingerprint, "00112233445566778899aabbccddeeff");
}

/* A batch of random shape (odd sizes, so that every section needs padding) and contents. */
static void gen(dfl_batch *b, uint64_t seed, int K, int64_t H, dfl_dtype dt)
{
    uint64_t s = seed;
    uint32_t S = 1 + (uint32_t)(rng(&s) % 7), lens[8];
    uint64_t T = 0;
    for (uint32_t i = 0; i < S; i++)
        T += lens[i] = 1 + (uint32_t)(rng(&s) % 37);
    dfl_err e;
    if (dfl_batch_alloc(b, T, S, (uint32_t)K, (uint32_t)H, dt, &e))
        abort();
    memcpy((void *)b->seq_lens, lens, 4 * S);
    for (uint64_t i = 0; i < T; i++) {
        ((int32_t *)b->input_ids)[i] = (int32_t)(rng(&s) % 5000);
        ((uint8_t *)b->loss_mask)[i] = (uint8_t)(rng(&s) & 1);
    }
    size_t n = (size_t)T * (size_t)H * dfl_dtype_size(dt);
    for (int k = 0; k < K; k++)
        for (size_t i = 0; i < n; i++)
            ((uint8_t *)b->layers[k])[i] = (uint8_t)rng(&s);
}

static bool same_files(const char *a, const char *b)
{
    dfl_map ma, mb;
    dfl_err e;
    if (dfl_map_open(&ma, a, &e) || dfl_map_open(&mb, b, &e))
        return false;
    bool same = ma.size == mb.size && (ma.size == 0 || memcmp(ma.data, mb.data, ma.size) == 0);
    dfl_map_close(&ma);
    dfl_map_close(&mb);
    return same;
}

static bool exists(const char *p)
{
    struct stat st;
    return stat(p, &st) == 0;
}

static int n_entries(const char *dir)
{
    char cmd[4200];
    snprintf(cmd, sizeof cmd, "test -z \"$(ls -A '%s')\"", dir);
    return system(cmd) == 0 ? 0 : 1;
}

/* The same batches through dfl_writer_batch and through reserve / fill / commit: same file. */
static void test_same_bytes(void)
{
    static const struct {
        int K;
        int64_t H;
        dfl_dtype dt;
        int n;
    } cases[] = {{1, 8, DFL_BF16, 1}, {3, 33, DFL_BF16, 5}, {2, 7, DFL_F32, 4}, {5, 64, DFL_F16, 3}};
    char a[4200], b[4200];
    for (size_t c = 0; c < sizeof cases / sizeof cases[0]; c++) {
        snprintf(a, sizeof a, "%s/a%zu.dfl", t_tmpdir(), c);
        snprintf(b, sizeof b, "%s/b%zu.dfl", t_tmpdir(), c);
        dfl_stream_info in;
        info_of(&in, cases[c].K, cases[c].H, cases[c].dt);
        dfl_err e = {0};
        dfl_writer *wa = NULL, *wb = NULL;
        T_CHECK(dfl_writer_open(&wa, a, &in, NULL, &e) == 0 && dfl_writer_open(&wb, b, &in, NULL, &e) == 0,
                "%s", e.msg);
        if (!wa || !wb)
            return;
        T_CHECK(dfl_writer_can_reserve(wb), "a file output can be written in place");
        for (int i = 0; i < cases[c].n; i++) {
            dfl_batch x;
            gen(&x, 100 * c + (uint64_t)i, cases[c].K, cases[c].H, cases[c].dt);
            T_CHECK(dfl_writer_batch(wa, &x, &e) == 0, "%s", e.msg);
            dfl_frame_res f;
            T_CHECK(dfl_writer_reserve(wb, x.n_tokens, x.n_seqs, &f, &e) == 0, "%s", e.msg);
            size_t n = (size_t)x.n_tokens * (size_t)cases[c].H * dfl_dtype_size(cases[c].dt);
            for (int k = 0; k < cases[c].K; k++) {
                T_CHECK(((uintptr_t)f.layers[k] & 63) == 0, "layer %d is 64-aligned", k);
                memcpy(f.layers[k], x.layers[k], n);
            }
            dfl_batch y = x;
            for (int k = 0; k < cases[c].K; k++)
                y.layers[k] = k % 2 ? NULL : f.layers[k]; /* NULL or the frame's own pointer */
            T_CHECK(dfl_writer_commit(wb, &f, &y, &e) == 0, "%s", e.msg);
            T_CHECK(f.map == NULL, "committed frames are unmapped");
            dfl_batch_free(&x);
        }
        T_CHECK(dfl_writer_close(wa, &e) == 0 && dfl_writer_close(wb, &e) == 0, "%s", e.msg);
        T_CHECK(same_files(a, b), "case %zu: in place and written give the same file", c);
        /* and it reads back */
        dfl_reader *r = NULL;
        T_CHECK(dfl_reader_open(&r, b, NULL, &e) == 0, "%s", e.msg);
        const dfl_index_entry *ent;
        uint64_t ne = 0;
        T_CHECK(r && dfl_reader_index(r, &ent, &ne, &e) == 0 && ne == (uint64_t)cases[c].n, "index: %s", e.msg);
        dfl_reader_close(r);
    }
}

/* Reservations made several frames ahead on one thread while another thread commits. */
typedef struct ahead {
    dfl_writer *w;
    dfl_frame_res f[16];
    dfl_batch x[16];
    int n, made;
    pthread_mutex_t mu;
    pthread_cond_t cv;
    int failed;
} ahead;

static void *committer(void *arg)
{
    ahead *a = arg;
    for (int i = 0; i < a->n; i++) {
        pthread_mutex_lock(&a->mu);
        while (a->made <= i)
            pthread_cond_wait(&a->cv, &a->mu);
        pthread_mutex_unlock(&a->mu);
        dfl_err e = {0};
        dfl_batch y = a->x[i];
        memset(y.layers, 0, sizeof y.layers);
        if (dfl_writer_commit(a->w, &a->f[i], &y, &e))
            a->failed = 1;
    }
    return NULL;
}

static void test_threads(void)
{
    char a[4200], b[4200];
    snprintf(a, sizeof a, "%s/ta.dfl", t_tmpdir());
    snprintf(b, sizeof b, "%s/tb.dfl", t_tmpdir());
    dfl_stream_info in;
    info_of(&in, 2, 40, DFL_BF16);
    dfl_err e = {0};
    dfl_writer *wa = NULL;
    ahead ah = {.n = 16, .mu = PTHREAD_MUTEX_INITIALIZER, .cv = PTHREAD_COND_INITIALIZER};
    T_CHECK(dfl_writer_open(&wa, a, &in, NULL, &e) == 0 && dfl_writer_open(&ah.w, b, &in, NULL, &e) == 0,
            "%s", e.msg);
    if (!wa || !ah.w)
        return;
    for (int i = 0; i < ah.n; i++) {
        gen(&ah.x[i], 7000 + (uint64_t)i, 2, 40, DFL_BF16);
        dfl_writer_batch(wa, &ah.x[i], &e);
    }
    pthread_t th;
    pthread_create(&th, NULL, committer, &ah);
    for (int i = 0; i < ah.n; i++) {
        if (dfl_writer_reserve(ah.w, ah.x[i].n_tokens, ah.x[i].n_seqs, &ah.f[i], &e)) {
            T_CHECK(0, "reserve %d: %s", i, e.msg);
            break;
        }
        size_t n = (size_t)ah.x[i].n_tokens * 40 * 2;
        for (int k = 0; k < 2; k++)
            memcpy(ah.f[i].layers[k], ah.x[i].layers[k], n);
        pthread_mutex_lock(&ah.mu);
        ah.made++;
        pthread_cond_broadcast(&ah.cv);
        pthread_mutex_unlock(&ah.mu);
    }
    pthread_join(th, NULL);
    T_CHECK(!ah.failed, "every commit succeeded");
    T_CHECK(dfl_writer_close(wa, &e) == 0 && dfl_writer_close(ah.w, &e) == 0, "%s", e.msg);
    T_CHECK(same_files(a, b), "reserved ahead on one thread, committed on another: same file");
    for (int i = 0; i < ah.n; i++)
        dfl_batch_free(&ah.x[i]);
}

/* The rules: commit in order, the reserved shape, no batch or note while reserved, pipes and
 * compressed files cannot reserve, a given-up frame fails the writer, and nothing is left. */
/* A fresh directory NAME under the scratch directory into d, d/o.dfl into p, and the stream of
 * one layer of hidden 16 in bf16 into in. */
static void scratch(const char *name, char d[4200], char p[4300], dfl_stream_info *in)
{
    snprintf(d, 4200, "%s/%s", t_tmpdir(), name);
    mkdir(d, 0755);
    snprintf(p, 4300, "%s/o.dfl", d);
    info_of(in, 1, 16, DFL_BF16);
}

static void test_rules(void)
{
    char d[4200], p[4300];
    dfl_stream_info in;
    scratch("rules", d, p, &in);
    dfl_err e = {0};
    dfl_writer *w = NULL;
    dfl_batch x, y;
    gen(&x, 1, 1, 16, DFL_BF16);
    gen(&y, 2, 1, 16, DFL_BF16);
    dfl_batch xn = x, yn = y; /* committed: their layers are already in the frame */
    memset(xn.layers, 0, sizeof xn.layers);
    memset(yn.layers, 0, sizeof yn.layers);

    /* out of order */
    T_CHECK(dfl_writer_open(&w, p, &in, NULL, &e) == 0, "%s", e.msg);
    dfl_frame_res f1, f2;
    T_CHECK(dfl_writer_reserve(w, x.n_tokens, x.n_seqs, &f1, &e) == 0, "%s", e.msg);
    T_CHECK(dfl_writer_reserve(w, y.n_tokens, y.n_seqs, &f2, &e) == 0, "%s", e.msg);
    T_CHECK(f2.offset == f1.offset + f1.frame_len, "frames follow each other");
    T_CHECK(dfl_writer_batch(w, &x, &e) == DFL_EUSAGE && strstr(e.msg, "reserved"),
            "no batch while frames are reserved: %s", e.msg);
    T_CHECK(dfl_writer_commit(w, &f2, &yn, &e) == DFL_EUSAGE && strstr(e.msg, "order"),
            "out of order: %s", e.msg);
    dfl_writer_unreserve(w, &f1);
    T_CHECK(dfl_writer_close(w, &e) != 0, "a failed writer does not close cleanly");
    T_CHECK(n_entries(d) == 0, "nothing left in the directory");

    /* wrong shape at commit */
    T_CHECK(dfl_writer_open(&w, p, &in, NULL, &e) == 0, "%s", e.msg);
    T_CHECK(dfl_writer_reserve(w, x.n_tokens + 1, x.n_seqs, &f1, &e) == 0, "%s", e.msg);
    T_CHECK(dfl_writer_commit(w, &f1, &xn, &e) == DFL_EUSAGE && strstr(e.msg, "reserved for"),
            "shape: %s", e.msg);
    T_CHECK(dfl_writer_reserve(w, x.n_tokens, x.n_seqs, &f2, &e) != 0, "a failed writer reserves nothing");
    dfl_writer_abort(w);
    T_CHECK(n_entries(d) == 0, "nothing left after abort");

    /* closing with a frame still reserved */
    T_CHECK(dfl_writer_open(&w, p, &in, NULL, &e) == 0, "%s", e.msg);
    T_CHECK(dfl_writer_reserve(w, x.n_tokens, x.n_seqs, &f1, &e) == 0, "%s", e.msg);
    T_CHECK(dfl_writer_close(w, &e) == DFL_EUSAGE && strstr(e.msg, "still reserved"), "close: %s", e.msg);
    munmap(f1.map, f1.map_len); /* the writer is gone; the mapping was the caller's to give up */
    T_CHECK(!exists(p) && n_entries(d) == 0, "no file after a refused close");

    /* compressed: cannot reserve */
    dfl_writer_opts zo = {.zstd_level = 3};
    T_CHECK(dfl_writer_open(&w, p, &in, &zo, &e) == 0, "%s", e.msg);
    T_CHECK(!dfl_writer_can_reserve(w), "compressed files are written, not reserved");
    T_CHECK(dfl_writer_reserve(w, x.n_tokens, x.n_seqs, &f1, &e) == DFL_EUSAGE, "reserve refused");
    dfl_writer_abort(w);

    /* a pipe: cannot reserve */
    int fds[2];
    T_CHECK(pipe(fds) == 0, "pipe");
    T_CHECK(dfl_writer_open_fd(&w, fds[1], "pipe", &in, NULL, &e) == 0, "%s", e.msg);
    T_CHECK(!dfl_writer_can_reserve(w), "pipes are written, not reserved");
    dfl_writer_abort(w);
    close(fds[0]);
    close(fds[1]);
    dfl_batch_free(&x);
    dfl_batch_free(&y);
}

/* json_t nested depth levels deep: {"a":{"a":...{}...}} (the outermost object is level 1). */
static json_t *nested_object(int depth)
{
    json_t *v = json_object();
    for (int l = 1; l < depth; l++) {
        json_t *o = json_object();
        json_object_set_new(o, "a", v);
        v = o;
    }
    return v;
}

/* A writer never writes a HEADER or a NOTE that its reader would refuse (dfl-frame(5) JSON
 * PAYLOADS): a meta that would nest the HEADER 65 deep, a NOTE 65 deep, are usage errors, and
 * nothing is written; at 64 levels both are written and read back. */
static void test_json_limits(void)
{
    char d[4200], p[4300];
    dfl_stream_info in;
    scratch("jsonlimits", d, p, &in);
    dfl_err e = {0};
    dfl_writer *w = NULL;
    in.meta = nested_object(64); /* the HEADER is one level more */
    T_CHECK(dfl_writer_open(&w, p, &in, NULL, &e) == DFL_EUSAGE && w == NULL &&
                strstr(e.msg, "a reader would refuse this stream description") && strstr(e.msg, "nested deeper than 64"),
            "HEADER 65 deep: %s", e.msg);
    T_CHECK(n_entries(d) == 0, "nothing written");
    json_decref(in.meta);
    in.meta = nested_object(63);
    T_CHECK(dfl_writer_open(&w, p, &in, NULL, &e) == 0, "HEADER 64 deep: %s", e.msg);
    json_decref(in.meta);
    in.meta = NULL;
    json_t *note = nested_object(65);
    T_CHECK(w && dfl_writer_note(w, note, &e) == DFL_EUSAGE && strstr(e.msg, "a reader would refuse this NOTE"),
            "NOTE 65 deep: %s", e.msg);
    json_decref(note);
    note = nested_object(64);
    T_CHECK(w && dfl_writer_note(w, note, &e) == 0, "NOTE 64 deep: %s", e.msg);
    json_decref(note);
    T_CHECK(w && dfl_writer_close(w, &e) == 0, "close: %s", e.msg);
    dfl_reader *r;
    T_CHECK(dfl_reader_open(&r, p, NULL, &e) == 0, "read back: %s", e.msg);
    bool eos = false;
    dfl_batch b;
    T_CHECK(r && dfl_reader_next(r, &b, &eos, &e) == 0 && eos, "the NOTE reads: %s", e.msg);
    dfl_reader_close(r);
    unlink(p);
}

/* The reuse rule: of W bytes pushed, U unread: W - U read, and none when U > W (another
 * writer's bytes in the pipe; unsigned arithmetic would wrap to a huge "read" offset). */
static void test_pipe_read_upto(void)
{
    T_CHECK(dfl_pipe_read_upto(0, 0) == 0, "nothing pushed");
    T_CHECK(dfl_pipe_read_upto(100, 0) == 100, "all read");
    T_CHECK(dfl_pipe_read_upto(100, 40) == 60, "40 unread");
    T_CHECK(dfl_pipe_read_upto(100, 100) == 0, "none read");
    T_CHECK(dfl_pipe_read_upto(100, 101) == 0, "more unread than pushed: none read");
    T_CHECK(dfl_pipe_read_upto(5, (uint64_t)INT32_MAX) == 0, "far more unread than pushed");
    T_CHECK(dfl_pipe_read_upto(UINT64_MAX, 1) == UINT64_MAX - 1, "large counts");
    /* the wait before asking again: the bytes' time at 4 GB/s, within [50 us, 20 ms] */
    T_CHECK(dfl_pipe_poll_ns(0) == 50000 && dfl_pipe_poll_ns(1) == 50000, "at least 50 us");
    T_CHECK(dfl_pipe_poll_ns(4000000) == 1000000, "4 MB: 1 ms");
    T_CHECK(dfl_pipe_poll_ns(UINT64_MAX) == 20000000, "at most 20 ms");
}

/* Another writer's bytes in the same pipe make the answer smaller, never larger: 4096 bytes
 * already in the pipe when the writer opens, a spliced batch after them: nothing counts as read
 * until the reader has read past the foreign bytes and into ours. */
static void test_pipe_foreign(void)
{
    int fds[2];
    if (pipe(fds)) {
        T_CHECK(0, "pipe");
        return;
    }
    char junk[4096];
    memset(junk, 'j', sizeof junk);
    T_CHECK(write(fds[1], junk, sizeof junk) == (ssize_t)sizeof junk, "junk");
    dfl_stream_info in;
    info_of(&in, 2, 16, DFL_F32);
    dfl_err e = {0};
    dfl_writer *w = NULL;
    dfl_writer_opts o = {.vmsplice = true};
    T_CHECK(dfl_writer_open_fd(&w, fds[1], "pipe", &in, &o, &e) == 0, "%s", e.msg);
    dfl_batch x;
    gen(&x, 7, 2, 16, DFL_F32);
    T_CHECK(w && dfl_writer_batch(w, &x, &e) == 0, "%s", e.msg);
    uint64_t upto = 1;
    T_CHECK(w && dfl_writer_read_upto(w, &upto, &e) == 0 && upto == 0, "unread foreign bytes: %llu read",
            (unsigned long long)upto);
    T_CHECK(read(fds[0], junk, sizeof junk) == (ssize_t)sizeof junk, "read the junk");
    T_CHECK(w && dfl_writer_read_upto(w, &upto, &e) == 0 && upto == 0, "only the junk read: %llu",
            (unsigned long long)upto);
    T_CHECK(read(fds[0], junk, 100) == 100, "read 100 of ours");
    T_CHECK(w && dfl_writer_read_upto(w, &upto, &e) == 0 && upto == 100, "100 of ours read: %llu",
            (unsigned long long)upto);
    if (w)
        dfl_writer_abort(w);
    close(fds[0]);
    close(fds[1]);
    dfl_batch_free(&x);
}

/* Reads what the pipe at fd holds, without waiting: 1 where that ended at the end of the input
 * (no writing end open), 0 where it ended with nothing to read yet (a writing end still open), -1
 * on an error; the bytes read into *got. */
static int drain_nowait(int fd, size_t *got)
{
    *got = 0;
    int fl = fcntl(fd, F_GETFL);
    if (fl < 0 || fcntl(fd, F_SETFL, fl | O_NONBLOCK) < 0)
        return -1;
    char buf[65536];
    for (;;) {
        ssize_t n = read(fd, buf, sizeof buf);
        if (n > 0)
            *got += (size_t)n;
        else if (n == 0)
            return 1;
        else if (errno != EINTR)
            return errno == EAGAIN ? 0 : -1;
    }
}

/* dfl_writer_opts.end_releases_fd: once dfl_writer_close has written the END frame, a reader of
 * the pipe sees the end of its input at once, not when the writing process exits (dfl-target's
 * teardown of the GPU after its last frame); without it the caller's descriptor stays open.
 * Standard output gets /dev/null in its place, so that fd 1 stays open. */
static void test_end_releases_fd(void)
{
    dfl_stream_info in;
    info_of(&in, 2, 16, DFL_F32);
    dfl_batch x;
    gen(&x, 11, 2, 16, DFL_F32);
    struct stat nul;
    T_CHECK(stat("/dev/null", &nul) == 0, "/dev/null");
    for (int mode = 0; mode < 3; mode++) {   /* 0: kept; 1: a pipe's descriptor let go; 2: fd 1 */
        int fds[2];
        if (pipe(fds)) {
            T_CHECK(0, "pipe");
            break;
        }
        int fd = fds[1], saved = -1;
        if (mode == 2) {   /* standard output is the pipe until the END frame (no output meanwhile) */
            fflush(stdout);
            saved = dup(1);
            T_CHECK(saved >= 0 && dup2(fds[1], 1) == 1, "stdout onto the pipe");
            close(fds[1]);
            fd = 1;
        }
        dfl_writer_opts o = {.end_releases_fd = mode > 0};
        dfl_err e = {0};
        dfl_writer *w = NULL;
        int rc = dfl_writer_open_fd(&w, fd, mode == 2 ? "stdout" : "pipe", &in, &o, &e);
        if (!rc)
            rc = dfl_writer_batch(w, &x, &e);
        if (!rc) {
            rc = dfl_writer_close(w, &e);
            w = NULL;
        }
        size_t got = 0;
        const int end = drain_nowait(fds[0], &got);
        struct stat now;
        const bool fd1_null = mode == 2 && fstat(1, &now) == 0 && S_ISCHR(now.st_mode) &&
                              now.st_rdev == nul.st_rdev;
        if (mode == 2) {
            fflush(stdout);
            dup2(saved, 1);
            close(saved);
        }
        if (w)
            dfl_writer_abort(w);
        T_CHECK(rc == 0, "mode %d: %s", mode, e.msg);
        T_CHECK(got > 64, "mode %d: the stream is in the pipe (%zu bytes)", mode, got);
        if (mode == 0) {
            T_CHECK(end == 0, "kept: the writing end is still open (drain gave %d)", end);
            close(fds[1]);
        } else {
            T_CHECK(end == 1, "mode %d: the reader sees the end of its input after END (drain gave %d)", mode, end);
        }
        if (mode == 2)
            T_CHECK(fd1_null, "standard output is /dev/null after END, not closed");
        close(fds[0]);
    }
    dfl_batch_free(&x);
}

/* vmsplice: a child reads the pipe slowly; the stream is the same as written without it, and
 * dfl_writer_consumed is false while the pages are still in the pipe. */
static void test_vmsplice(void)
{
    char a[4200], b[4200];
    snprintf(a, sizeof a, "%s/va.dfl", t_tmpdir());
    snprintf(b, sizeof b, "%s/vb.dfl", t_tmpdir());
    dfl_stream_info in;
    info_of(&in, 2, 16, DFL_F32);
    for (int mode = 0; mode < 2; mode++) {
        int fds[2], go[2];
        if (pipe(fds) || pipe(go)) {
            T_CHECK(0, "pipe");
            return;
        }
        pid_t pid = fork();
        if (pid == 0) { /* reader: waits for a byte on go, then copies the stream to a file */
            close(fds[1]);
            close(go[1]);
            char c;
            if (read(go[0], &c, 1) < 0)
                _exit(3);
            int out = open(mode ? b : a, O_WRONLY | O_CREAT | O_TRUNC, 0644);
            char buf[65536];
            ssize_t n;
            while ((n = read(fds[0], buf, sizeof buf)) > 0)
                if (write(out, buf, (size_t)n) != n)
                    _exit(2);
            close(out);
            _exit(n < 0);
        }
        close(fds[0]);
        close(go[0]);
        dfl_err e = {0};
        dfl_writer *w = NULL;
        dfl_writer_opts o = {.vmsplice = mode == 1};
        T_CHECK(dfl_writer_open_fd(&w, fds[1], "pipe", &in, &o, &e) == 0, "%s", e.msg);
        dfl_batch x;
        gen(&x, 99, 2, 16, DFL_F32); /* under 40 KB: fits the pipe before the reader starts */
        T_CHECK(w && dfl_writer_batch(w, &x, &e) == 0, "%s", e.msg);
        uint64_t after = w ? dfl_writer_bytes(w) : 0, upto = 0;
        T_CHECK(w && dfl_writer_read_upto(w, &upto, &e) == 0, "read_upto: %s", e.msg);
        if (w && mode == 1)
            T_CHECK(upto == 0, "with vmsplice, nothing is read before the reader starts (%llu)",
                    (unsigned long long)upto);
        if (w && mode == 0)
            T_CHECK(upto == UINT64_MAX, "without vmsplice, no page is held");
        if (write(go[1], "g", 1) != 1)
            T_CHECK(0, "go");
        close(go[1]);
        for (int i = 0; w && i < 400 && upto < after; i++) {
            usleep(5000);
            T_CHECK(dfl_writer_read_upto(w, &upto, &e) == 0, "read_upto: %s", e.msg);
        }
        T_CHECK(w && upto >= after, "read up to the end once the reader has read it");
        T_CHECK(w && dfl_writer_close(w, &e) == 0, "%s", e.msg);
        close(fds[1]);
        int st = 0;
        waitpid(pid, &st, 0);
        T_CHECK(WIFEXITED(st) && WEXITSTATUS(st) == 0, "reader exit");
        dfl_batch_free(&x);
    }
    T_CHECK(same_files(a, b), "vmsplice gives the same stream");
}

static bool same_batch(const dfl_batch *x, const dfl_batch *y, int K, int64_t H, dfl_dtype dt)
{
    if (x->n_tokens != y->n_tokens || x->n_seqs != y->n_seqs || x->n_layers != y->n_layers)
        return false;
    size_t n = (size_t)x->n_tokens * (size_t)H * dfl_dtype_size(dt);
    if (memcmp(x->seq_lens, y->seq_lens, 4 * (size_t)x->n_seqs) ||
        memcmp(x->input_ids, y->input_ids, 4 * (size_t)x->n_tokens) ||
        memcmp(x->loss_mask, y->loss_mask, (size_t)x->n_tokens))
        return false;
    for (int k = 0; k < K; k++)
        if (memcmp(x->layers[k], y->layers[k], n))
            return false;
    return true;
}

/* Writer pieces of 7 and 64 bytes and the default, copied or spliced, read in pieces of 13 bytes
 * and the default: the same batches come out, every checksum verified; a file written in
 * 7-byte pieces is byte-identical to one written with the default; pipe_size sets the pipe. */
static void test_chunks(void)
{
    enum { NB = 4, K = 3 };
    const int64_t H = 96;
    dfl_stream_info in;
    info_of(&in, K, H, DFL_F32);
    static const uint32_t wchunks[] = {7, 64, 0}, rchunks[] = {13, 0};
    for (int wi = 0; wi < 3; wi++)
        for (int vm = 0; vm < 2; vm++)
            for (int ri = 0; ri < 2; ri++) {
                int fds[2];
                if (pipe(fds)) {
                    T_CHECK(0, "pipe");
                    return;
                }
                pid_t pid = fork();
                if (pid == 0) { /* the writer; its batches stay unchanged until it exits */
                    close(fds[0]);
                    dfl_err e = {0};
                    dfl_writer *w = NULL;
                    dfl_writer_opts o = {.vmsplice = vm == 1, .chunk = wchunks[wi], .pipe_size = 65536};
                    if (dfl_writer_open_fd(&w, fds[1], "pipe", &in, &o, &e))
                        _exit(2);
                    if (dfl_writer_pipe_bytes(w) != 65536)
                        _exit(3);
                    static dfl_batch x[NB];
                    for (int i = 0; i < NB; i++) {
                        gen(&x[i], 500 + (uint64_t)i, K, H, DFL_F32);
                        if (dfl_writer_batch(w, &x[i], &e))
                            _exit(4);
                    }
                    _exit(dfl_writer_close(w, &e) ? 5 : 0);
                }
                close(fds[1]);
                dfl_err e = {0};
                dfl_reader *r = NULL;
                dfl_reader_opts ro = {.chunk = rchunks[ri]};
                int got = 0;
                bool ok = dfl_reader_open_fd(&r, fds[0], "pipe", &ro, &e) == 0;
                T_CHECK(ok, "writer chunk %u vmsplice %d reader chunk %u: open: %s", wchunks[wi], vm,
                        rchunks[ri], e.msg);
                while (ok) {
                    dfl_batch b, want;
                    memset(&b, 0, sizeof b);
                    bool eos = false;
                    if (dfl_reader_next(r, &b, &eos, &e)) {
                        T_CHECK(0, "writer chunk %u vmsplice %d reader chunk %u: batch %d: %s", wchunks[wi],
                                vm, rchunks[ri], got, e.msg);
                        break;
                    }
                    if (eos)
                        break;
                    gen(&want, 500 + (uint64_t)got, K, H, DFL_F32);
                    T_CHECK(same_batch(&b, &want, K, H, DFL_F32), "writer chunk %u vmsplice %d reader "
                            "chunk %u: batch %d differs", wchunks[wi], vm, rchunks[ri], got);
                    dfl_batch_free(&want);
                    dfl_reader_recycle(r, &b);
                    got++;
                }
                T_EQ_INT(got, NB, "batches read");
                dfl_reader_close(r);
                close(fds[0]);
                int st = 0;
                waitpid(pid, &st, 0);
                T_CHECK(WIFEXITED(st) && WEXITSTATUS(st) == 0, "writer chunk %u vmsplice %d: writer exit %d",
                        wchunks[wi], vm, WIFEXITED(st) ? WEXITSTATUS(st) : -1);
            }
    /* a file: the piece size changes nothing in the bytes */
    char a[4200], b[4200];
    snprintf(a, sizeof a, "%s/ca.dfl", t_tmpdir());
    snprintf(b, sizeof b, "%s/cb.dfl", t_tmpdir());
    for (int f = 0; f < 2; f++) {
        dfl_err e = {0};
        dfl_writer *w = NULL;
        dfl_writer_opts o = {.chunk = f ? 7 : 0};
        T_CHECK(dfl_writer_open(&w, f ? b : a, &in, &o, &e) == 0, "%s", e.msg);
        T_CHECK(w && dfl_writer_pipe_bytes(w) == 0, "a file is not a pipe");
        for (int i = 0; w && i < NB; i++) {
            dfl_batch x;
            gen(&x, 500 + (uint64_t)i, K, H, DFL_F32);
            T_CHECK(dfl_writer_batch(w, &x, &e) == 0, "%s", e.msg);
            dfl_batch_free(&x);
        }
        T_CHECK(w && dfl_writer_close(w, &e) == 0, "%s", e.msg);
    }
    T_CHECK(same_files(a, b), "a file written in 7-byte pieces is the same as with the default");
}

int main(int argc, char **argv)
{
    t_init(argv[0]);
    signal(SIGPIPE, SIG_IGN);
    T_RUN(test_same_bytes);
    T_RUN(test_threads);
    T_RUN(test_rules);
    T_RUN(test_json_limits);
    T_RUN(test_pipe_read_upto);
    T_RUN(test_pipe_foreign);
    T_RUN(test_end_releases_fd);
    T_RUN(test_vmsplice);
    T_RUN(test_chunks);
    return t_done();
}
