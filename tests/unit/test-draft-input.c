/* test-draft-input.c: the drafter's input pool: replay covers every batch of every file once per
 * epoch in a seeded order, a saved position restores the same remaining batches, files without an
 * index are walked, headers are checked, and streams fan in from several pipes. Batches are told
 * apart by their first token id (file * 1000 + batch). */
#include <fcntl.h>
#include <pthread.h>
#include <stdlib.h>
#include <string.h>
#include <sys/stat.h>
#include <unistd.h>

#include "draft_input.h"
#include "t.h"
#include "util.h"

enum { H = 8 };
static const int32_t layers[2] = {1, 2};

static dfl_stream_info info(void)
{
    dfl_stream_info si = {.kind = DFL_KIND_HIDDEN, .version_major = DFL_FRAME_MAJOR, .hidden_size = H,
                          .vocab_size = 100000, .n_layers = 2, .layers = {1, 2}, .dtype = DFL_F32};
    snprintf(si.fingerprint, sizeof si.fingerprint, "fp");
    return si;
}

/* A stream of n batches; batch b of file f starts with token f*1000 + b. */
static void write_stream(const char *path, int f, int n, bool no_index)
{
    dfl_err e = {0};
    dfl_stream_info si = info();
    dfl_writer *w;
    dfl_writer_opts wo = {.no_index = no_index};
    if (dfl_writer_open(&w, path, &si, &wo, &e)) {
        fprintf(stderr, "%s\n", e.msg);
        exit(1);
    }
    for (int b = 0; b < n; b++) {
        dfl_batch bt;
        uint64_t T = 3 + (uint64_t)b % 4;
        dfl_batch_alloc(&bt, T, 1, 2, H, DFL_F32, &e);
        ((uint32_t *)bt.seq_lens)[0] = (uint32_t)T;
        for (uint64_t t = 0; t < T; t++) {
            ((int32_t *)bt.input_ids)[t] = f * 1000 + b;
            ((uint8_t *)bt.loss_mask)[t] = 1;
        }
        dfl_writer_batch(w, &bt, &e);
        dfl_batch_free(&bt);
    }
    if (dfl_writer_close(w, &e)) {
        fprintf(stderr, "%s\n", e.msg);
        exit(1);
    }
}

static dfl_draft_src_opts opts(const char *const *in, int n)
{
    dfl_draft_src_opts o = {.n_inputs = n, .inputs = in, .fingerprint = "fp", .hidden = H,
                            .vocab = 100000, .n_layers = 2, .layers = layers, .epochs = 3,
                            .seed = 11, .pool_size = 3, .min_ready = 2};
    return o;
}

/* Drains s (at most max batches) into ids; returns the count. */
static int drain(dfl_draft_src *s, dfl_rng *r, int32_t *ids, int max)
{
    int n = 0;
    dfl_err e = {0};
    while (n < max) {
        const dfl_batch *b;
        double waited;
        if (dfl_draft_src_next(s, r, &b, &waited, &e)) {
            fprintf(stderr, "  %s\n", e.msg);
            return -1;
        }
        if (!b)
            return n;
        ids[n++] = b->input_ids[0];
    }
    return n;
}

static void test_replay_epochs_and_restore(void)
{
    char a[4096], b[4096];
    snprintf(a, sizeof a, "%s/a.dfl", t_tmpdir());
    snprintf(b, sizeof b, "%s/b.dfl", t_tmpdir());
    write_stream(a, 1, 5, false);
    write_stream(b, 2, 4, true);   /* no index: walked at open */
    const char *in[2] = {a, b};
    dfl_draft_src_opts o = opts(in, 2);
    dfl_draft_src *s;
    dfl_err e = {0};
    T_CHECK(dfl_draft_src_open(&s, &o, &e) == 0, "%s", e.msg);
    T_CHECK(dfl_draft_src_replay(s), "replay mode");
    T_EQ_INT(dfl_draft_src_batches(s), 9, "batches per epoch");
    int64_t mt, mb;
    dfl_draft_src_max(s, 512, &mt, &mb);
    T_EQ_INT(mt, 6, "largest batch");
    T_EQ_INT(mb, 5, "most blocks");
    dfl_rng r;
    dfl_rng_seed(&r, 5);
    int32_t ids[64];
    int n = drain(s, &r, ids, 64);
    T_EQ_INT(n, 27, "3 epochs of 9 batches");
    int count[3][5] = {{0}};
    for (int i = 0; i < n; i++)
        count[ids[i] / 1000][ids[i] % 1000]++;
    for (int f = 1; f <= 2; f++)
        for (int k = 0; k < (f == 1 ? 5 : 4); k++)
            T_EQ_INT(count[f][k], 3, "every batch once per epoch");
    dfl_draft_src_close(s);

    /* the same seed: the same order; stop after 10, save, restore into a new source */
    T_CHECK(dfl_draft_src_open(&s, &o, &e) == 0, "%s", e.msg);
    dfl_rng_seed(&r, 5);
    int32_t first[10], rest[64];
    T_EQ_INT(drain(s, &r, first, 10), 10, "first part");
    T_CHECK(memcmp(first, ids, sizeof first) == 0, "same order with the same seed");
    json_t *st = dfl_draft_src_state(s);
    dfl_rng saved = r;
    dfl_draft_src_close(s);
    T_CHECK(dfl_draft_src_open(&s, &o, &e) == 0, "%s", e.msg);
    T_CHECK(dfl_draft_src_restore(s, st, &e) == 0, "restore: %s", e.msg);
    r = saved;
    n = drain(s, &r, rest, 64);
    T_EQ_INT(n, 17, "the rest");
    T_CHECK(memcmp(rest, ids + 10, 17 * sizeof *rest) == 0, "the restored source continues exactly");
    dfl_draft_src_close(s);
    /* a different seed: another order */
    o.seed = 12;
    T_CHECK(dfl_draft_src_open(&s, &o, &e) == 0, "%s", e.msg);
    dfl_rng_seed(&r, 5);
    n = drain(s, &r, rest, 64);
    T_CHECK(n == 27 && memcmp(rest, ids, 27 * sizeof *rest) != 0, "seed changes the order");
    dfl_draft_src_close(s);
    /* restore with other inputs is refused */
    const char *in1[1] = {a};
    dfl_draft_src_opts o1 = opts(in1, 1);
    T_CHECK(dfl_draft_src_open(&s, &o1, &e) == 0, "%s", e.msg);
    T_CHECK(dfl_draft_src_restore(s, st, &e) == DFL_EMISMATCH, "other inputs: %s", e.msg);
    dfl_draft_src_close(s);
    json_decref(st);
}

static void test_header_checks(void)
{
    char a[4096];
    snprintf(a, sizeof a, "%s/h.dfl", t_tmpdir());
    write_stream(a, 1, 2, false);
    const char *in[1] = {a};
    dfl_draft_src *s;
    dfl_err e = {0};
    dfl_draft_src_opts o = opts(in, 1);
    o.fingerprint = "other";
    T_CHECK(dfl_draft_src_open(&s, &o, &e) == DFL_EMISMATCH && strstr(e.msg, "fingerprint"), "%s", e.msg);
    o = opts(in, 1);
    o.hidden = 16;
    T_CHECK(dfl_draft_src_open(&s, &o, &e) == DFL_EMISMATCH && strstr(e.msg, "hidden size 8"), "%s", e.msg);
    o = opts(in, 1);
    int32_t other[2] = {2, 1};
    o.layers = other;
    T_CHECK(dfl_draft_src_open(&s, &o, &e) == DFL_EMISMATCH && strstr(e.msg, "layers 1,2"), "%s", e.msg);
    o = opts(in, 1);
    o.layers = NULL;   /* taken from the stream */
    T_CHECK(dfl_draft_src_open(&s, &o, &e) == 0, "%s", e.msg);
    int n;
    const int32_t *l = dfl_draft_src_layers(s, &n);
    T_CHECK(n == 2 && l[0] == 1 && l[1] == 2, "layers from the stream");
    dfl_draft_src_close(s);
}

typedef struct { const char *path; int f; } wargs;

static void *writer_thread(void *p)
{
    wargs *w = p;
    write_stream(w->path, w->f, 6, true);
    return NULL;
}

static void test_stream_fan_in(void)
{
    char p1[4096], p2[4096];
    snprintf(p1, sizeof p1, "%s/p1", t_tmpdir());
    snprintf(p2, sizeof p2, "%s/p2", t_tmpdir());
    mkfifo(p1, 0600);
    mkfifo(p2, 0600);
    pthread_t t1, t2;
    wargs w1 = {p1, 1}, w2 = {p2, 2};
    pthread_create(&t1, NULL, writer_thread, &w1);
    pthread_create(&t2, NULL, writer_thread, &w2);
    const char *in[2] = {p1, p2};
    dfl_draft_src_opts o = opts(in, 2);
    o.epochs = 1;
    dfl_draft_src *s;
    dfl_err e = {0};
    T_CHECK(dfl_draft_src_open(&s, &o, &e) == 0, "%s", e.msg);
    T_CHECK(!dfl_draft_src_replay(s), "stream mode");
    dfl_rng r;
    dfl_rng_seed(&r, 1);
    int32_t ids[64];
    int n = drain(s, &r, ids, 64);
    T_EQ_INT(n, 12, "6 + 6 batches");
    int c1 = 0, c2 = 0;
    for (int i = 0; i < n; i++) {
        c1 += ids[i] / 1000 == 1;
        c2 += ids[i] / 1000 == 2;
    }
    T_CHECK(c1 == 6 && c2 == 6, "both inputs: %d %d", c1, c2);
    dfl_draft_src_close(s);
    pthread_join(t1, NULL);
    pthread_join(t2, NULL);
    /* epochs > 1 need files */
    o.epochs = 2;
    T_CHECK(dfl_draft_src_open(&s, &o, &e) == DFL_EUSAGE, "%s", e.msg);
}

int main(int argc, char **argv)
{
    t_init(argv[0]);
    T_RUN(test_replay_epochs_and_restore);
    T_RUN(test_header_checks);
    T_RUN(test_stream_fan_in);
    return t_done();
}
