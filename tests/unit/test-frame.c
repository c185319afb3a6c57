/* test-frame.c: the .dfl frame reader and writer (lib/formats/frame.h, dfl-frame(5)): round trips through
 * files (mapped) and pipes, the index, frame listing, determinism, truncation at every offset,
 * every flipped bit, crafted defects, and the committed corpus of bad streams. */
#include <dirent.h>
#include <errno.h>
#include <fcntl.h>
#include <signal.h>
#include <stdint.h>
#include <sys/stat.h>
#include <sys/wait.h>
#include <unistd.h>

#include "frame.h"
#include "frame_type.h"
#include "util.h"
#include "t.h"
#include "../tools/framecraft.h"
#include "../tools/frame-example.h"

/* ---- test data -------------------------------------------------------------------------------- */

typedef struct cfg {
    int kind;
    int n_layers;
    int64_t hidden;
    dfl_dtype dtype;
    int64_t vocab;
} cfg;

static uint64_t rng_next(uint64_t *s)
{
    *s += 0x9e3779b97f4a7c15ull;
    uint64_t z = *s;
    z = (z ^ (z >> 30)) * 0xbf58476d1ce4e5b9ull;
    z = (z ^ (z >> 27)) * 0x94d049bb133111ebull;
    return z ^ (z >> 31);
}

static void make_info(dfl_stream_info *in, const cfg *c)
{
    memset(in, 0, sizeof *in);
    in->kind = c->kind;
    snprintf(in->producer, sizeof in->producer, "test-frame 0.1.0");
    in->vocab_size = c->vocab;
    if (c->kind == DFL_KIND_HIDDEN) {
        in->hidden_size = c->hidden;
        in->n_layers = c->n_layers;
        for (int k = 0; k < c->n_layers; k++)
            in->layers[k] = 1 + 8 * k;
        in->dtype = c->dtype;
        snprintf(in->fingerprint, sizeof in->fingerprint, "0123456789abcdef0123456789abcdef");
    }
}

/* A batch of 1..maxs sequences of 1..maxlen tokens; layer values from a small set of numbers so
 * that the layers compress. */
static void gen_batch(dfl_batch *b, const cfg *c, uint64_t seed, int maxs, int maxlen)
{
    uint64_t s = seed;
    uint32_t S = 1 + (uint32_t)(rng_next(&s) % (uint64_t)maxs), lens[64];
    uint64_t T = 0;
    for (uint32_t i = 0; i < S; i++) {
        lens[i] = 1 + (uint32_t)(rng_next(&s) % (uint64_t)maxlen);
        T += lens[i];
    }
    dfl_err e;
    uint32_t K = c->kind == DFL_KIND_HIDDEN ? (uint32_t)c->n_layers : 0;
    if (dfl_batch_alloc(b, T, S, K, (uint32_t)(K ? c->hidden : 0), K ? c->dtype : DFL_DT_INVALID, &e)) {
        fprintf(stderr, "dfl_batch_alloc: %s\n", e.msg);
        abort();
    }
    memcpy((void *)b->seq_lens, lens, 4 * S);
    for (uint64_t i = 0; i < T; i++) {
        ((int32_t *)b->input_ids)[i] = (int32_t)(rng_next(&s) % (uint64_t)(c->vocab ? c->vocab : 1000000));
        ((uint8_t *)b->loss_mask)[i] = (uint8_t)(rng_next(&s) % 3 != 0);
    }
    for (uint32_t k = 0; k < K; k++) {
        size_t n = (size_t)T * (size_t)c->hidden;
        for (size_t i = 0; i < n; i++) {
            fc_store_f32((void *)b->layers[k], c->dtype, i, (float)((int)(rng_next(&s) % 64) - 32) / 8.0f);
        }
    }
}

static uint32_t max_of(const uint32_t *v, uint32_t n)
{
    uint32_t m = 0;
    for (uint32_t i = 0; i < n; i++)
        m = v[i] > m ? v[i] : m;
    return m;
}

static bool aligned64(const void *p) { return ((uintptr_t)p & 63) == 0; }

/* Compares a read batch with the batch that was written as number idx. */
static void check_same(const dfl_batch *got, const dfl_batch *want, uint64_t idx, const char *what)
{
    T_CHECK(got->index == idx, "%s: index %llu != %llu", what, (unsigned long long)got->index, (unsigned long long)idx);
    T_CHECK(got->n_tokens == want->n_tokens && got->n_seqs == want->n_seqs, "%s: batch %llu shape", what,
            (unsigned long long)idx);
    T_CHECK(got->n_layers == want->n_layers && got->hidden == want->hidden && got->dtype == want->dtype,
            "%s: batch %llu layers", what, (unsigned long long)idx);
    T_CHECK(got->max_len == max_of(want->seq_lens, want->n_seqs), "%s: batch %llu max_len %u", what,
            (unsigned long long)idx, got->max_len);
    if (got->n_tokens != want->n_tokens || got->n_seqs != want->n_seqs || got->n_layers != want->n_layers)
        return;
    uint64_t T = want->n_tokens;
    T_CHECK(memcmp(got->seq_lens, want->seq_lens, 4ull * want->n_seqs) == 0, "%s: seq_lens", what);
    T_CHECK(memcmp(got->input_ids, want->input_ids, 4 * T) == 0, "%s: input_ids", what);
    T_CHECK(memcmp(got->loss_mask, want->loss_mask, T) == 0, "%s: loss_mask", what);
    T_CHECK(aligned64(got->seq_lens) && aligned64(got->input_ids) && aligned64(got->loss_mask),
            "%s: sections not 64-aligned", what);
    for (uint32_t k = 0; k < want->n_layers; k++) {
        T_CHECK(aligned64(got->layers[k]), "%s: layer %u not 64-aligned", what, k);
        T_CHECK(memcmp(got->layers[k], want->layers[k], T * want->hidden * dfl_dtype_size(want->dtype)) == 0,
                "%s: batch %llu layer %u bytes differ", what, (unsigned long long)idx, k);
    }
    for (uint32_t k = want->n_layers; k < DFL_MAX_LAYERS; k++)
        T_CHECK(got->layers[k] == NULL, "%s: layer %u set", what, k);
}

static char *tmp_path(const char *name)
{
    static char p[8][4096];
    static int k;
    k = (k + 1) % 8;
    snprintf(p[k], sizeof p[k], "%s/%s", t_tmpdir(), name);
    return p[k];
}

/* Writes batches [0, n) (a NOTE after batch note_after, if >= 0) through an open writer. */
static int write_batches(dfl_writer *w, dfl_batch *bs, int n, int note_after, dfl_err *e)
{
    for (int i = 0; i < n; i++) {
        int rc = dfl_writer_batch(w, &bs[i], e);
        if (rc)
            return rc;
        if (i == note_after) {
            json_t *note = json_pack("{s:s, s:i}", "event", "test", "after", i);
            rc = dfl_writer_note(w, note, e);
            json_decref(note);
            if (rc)
                return rc;
        }
    }
    return DFL_OK;
}

static int write_file(const char *path, const cfg *c, const dfl_writer_opts *o, dfl_batch *bs, int n,
                      int note_after, dfl_err *e)
{
    dfl_stream_info in;
    make_info(&in, c);
    dfl_writer *w;
    int rc = dfl_writer_open(&w, path, &in, o, e);
    if (rc)
        return rc;
    rc = write_batches(w, bs, n, note_after, e);
    if (rc) {
        dfl_writer_abort(w);
        return rc;
    }
    return dfl_writer_close(w, e);
}

/* Reads a whole stream, checking every batch against bs. */
static void read_and_check(dfl_reader *r, const cfg *c, dfl_batch *bs, int n, bool expect_owned, const char *what)
{
    const dfl_stream_info *in = dfl_reader_info(r);
    T_CHECK(in->kind == c->kind, "%s: kind", what);
    T_CHECK(in->version_major == 1 && in->version_minor == 0, "%s: version", what);
    T_CHECK(strcmp(in->producer, "test-frame 0.1.0") == 0, "%s: producer '%s'", what, in->producer);
    T_CHECK(in->vocab_size == c->vocab, "%s: vocab", what);
    if (c->kind == DFL_KIND_HIDDEN) {
        T_CHECK(in->hidden_size == c->hidden && in->n_layers == c->n_layers && in->dtype == c->dtype,
                "%s: hidden info", what);
        for (int k = 0; k < c->n_layers; k++)
            T_CHECK(in->layers[k] == 1 + 8 * k, "%s: layer id %d", what, k);
        T_CHECK(strcmp(in->fingerprint, "0123456789abcdef0123456789abcdef") == 0, "%s: fingerprint", what);
    }
    uint64_t toks = 0, seqs = 0;
    int i = 0;
    for (;;) {
        dfl_batch b;
        bool eos;
        dfl_err e;
        int rc = dfl_reader_next(r, &b, &eos, &e);
        T_CHECK(rc == 0, "%s: next: %s", what, e.msg);
        if (rc || eos)
            break;
        T_CHECK(i < n, "%s: more batches than written", what);
        if (i >= n) {
            dfl_batch_free(&b);
            break;
        }
        check_same(&b, &bs[i], (uint64_t)i, what);
        if (expect_owned)
            T_CHECK(b.owned != NULL, "%s: batch %d should own its memory", what, i);
        toks += b.n_tokens;
        seqs += b.n_seqs;
        /* half the batches give their memory back for the next ones */
        if (i % 2)
            dfl_reader_recycle(r, &b);
        else
            dfl_batch_free(&b);
        T_CHECK(b.owned == NULL && b.n_tokens == 0, "%s: batch cleared", what);
        i++;
    }
    T_EQ_INT(i, n, what);
    const dfl_stream_end *end = dfl_reader_end(r);
    T_CHECK(end->n_batches == (uint64_t)n && end->n_tokens == toks && end->n_seqs == seqs, "%s: END totals", what);
    T_CHECK(!dfl_reader_truncated(r), "%s: truncated", what);
    bool eos;
    dfl_batch b;
    dfl_err e;
    T_CHECK(dfl_reader_next(r, &b, &eos, &e) == 0 && eos, "%s: eos again", what);
}

/* ---- round trips ------------------------------------------------------------------------------ */

static const cfg cfgs[] = {
    {DFL_KIND_TOKENS, 0, 0, DFL_DT_INVALID, 50000},
    {DFL_KIND_TOKENS, 0, 0, DFL_DT_INVALID, 0},
    {DFL_KIND_HIDDEN, 3, 64, DFL_BF16, 32000},
    {DFL_KIND_HIDDEN, 2, 40, DFL_F16, 32000},
    {DFL_KIND_HIDDEN, 5, 24, DFL_F32, 0},
};

static int gen_all(dfl_batch *bs, const cfg *c, int n, uint64_t seed)
{
    for (int i = 0; i < n; i++)
        gen_batch(&bs[i], c, seed * 1000 + (uint64_t)i, 9, 60);
    return n;
}

static void free_all(dfl_batch *bs, int n)
{
    for (int i = 0; i < n; i++)
        dfl_batch_free(&bs[i]);
}

/* Configurations cfgs[from..to), each uncompressed and compressed (zstd at level), as nb <= 24
 * batches from seed ci + seed, each given to fn with a name for messages. */
typedef void (*rt_fn)(const cfg *c, const dfl_writer_opts *o, dfl_batch *bs, int n, int z, const char *what);

static void each_config_of(size_t from, size_t to, int nb, const char *via, size_t seed, int level, rt_fn fn)
{
    for (size_t ci = from; ci < to; ci++) {
        for (int z = 0; z <= 1; z++) {
            const cfg *c = &cfgs[ci];
            dfl_batch bs[24];
            int n = gen_all(bs, c, nb, ci + seed);
            dfl_writer_opts o = {.zstd_level = z ? level : 0};
            char what[64];
            snprintf(what, sizeof what, "%s cfg %zu zstd %d", via, ci, z);
            fn(c, &o, bs, n, z, what);
            free_all(bs, n);
        }
    }
}

static void each_config(const char *via, size_t seed, int level, rt_fn fn)
{
    each_config_of(0, DFL_ARRAY_LEN(cfgs), 24, via, seed, level, fn);
}

/* dfl_reader_open, checked: NULL (a failed check) when it fails. */
static dfl_reader *open_ok(const char *path)
{
    dfl_reader *r = NULL;
    dfl_err e;
    if (dfl_reader_open(&r, path, NULL, &e)) {
        T_CHECK(0, "open: %s", e.msg);
        return NULL;
    }
    return r;
}

/* The next frame into *f: false at the end of the stream or on an error (a failed check). */
static bool next_frame_ok(dfl_reader *r, dfl_frame *f)
{
    bool eos;
    dfl_err e;
    int rc = dfl_reader_next_frame(r, f, &eos, &e);
    T_CHECK(rc == 0, "next_frame: %s", e.msg);
    return rc == 0 && !eos;
}

static void roundtrip_file(const cfg *c, const dfl_writer_opts *o, dfl_batch *bs, int n, int z, const char *what)
{
    char *path = tmp_path("rt.dfl");
    dfl_err e;
    int rc = write_file(path, c, o, bs, n, 5, &e);
    T_CHECK(rc == 0, "%s: write: %s", what, e.msg);
    dfl_reader *r;
    rc = dfl_reader_open(&r, path, NULL, &e);
    T_CHECK(rc == 0, "%s: open: %s", what, e.msg);
    if (rc == 0) {
        read_and_check(r, c, bs, n, false, what);
        T_CHECK(dfl_reader_end(r)->index_offset > 0, "%s: a file gets an index", what);
        dfl_reader_close(r);
    }
    /* the compressed path was taken for compressible batches, and batches point into the
     * mapping otherwise */
    rc = dfl_reader_open(&r, path, NULL, &e);
    if (rc == 0) {
        int zframes = 0;
        dfl_frame f;
        while (next_frame_ok(r, &f)) {
            if (f.type == DFL_FT_TOKENS || f.type == DFL_FT_HIDDEN) {
                zframes += (f.flags & DFL_FF_ZSTD) != 0;
                T_CHECK(z || f.owned == NULL, "%s: uncompressed mapped frame should not be copied", what);
                if (f.flags & DFL_FF_ZSTD) {
                    unsigned want = c->kind == DFL_KIND_TOKENS ? 0
                                    : dfl_dtype_size(c->dtype) == 2 ? DFL_FF_SHUFFLE2 : DFL_FF_SHUFFLE4;
                    T_CHECK((f.flags & (DFL_FF_SHUFFLE2 | DFL_FF_SHUFFLE4)) == want, "%s: shuffle flags 0x%x",
                            what, f.flags);
                }
            }
            dfl_frame_free(&f);
        }
        if (z && c->kind == DFL_KIND_HIDDEN)
            T_CHECK(zframes == n, "%s: %d of %d hidden frames compressed", what, zframes, n);
        if (!z)
            T_CHECK(zframes == 0, "%s: compressed without zstd_level", what);
        dfl_reader_close(r);
    }
}

static void test_roundtrip_file(void) { each_config("file", 1, 3, roundtrip_file); }

/* Writes in a child process into a pipe; returns the read end and the child's pid. */
static int spawn_writer(const cfg *c, const dfl_writer_opts *o, dfl_batch *bs, int n, pid_t *pid)
{
    int p[2];
    if (pipe(p) != 0)
        return -1;
    fflush(NULL);
    *pid = fork();
    if (*pid == 0) {
        close(p[0]);
        signal(SIGPIPE, SIG_IGN);
        dfl_stream_info in;
        make_info(&in, c);
        dfl_writer *w;
        dfl_err e;
        int rc = dfl_writer_open_fd(&w, p[1], "pipe", &in, o, &e);
        if (!rc) {
            rc = write_batches(w, bs, n, 3, &e);
            rc = rc ? (dfl_writer_abort(w), rc) : dfl_writer_close(w, &e);
        }
        if (rc)
            fprintf(stderr, "writer child: %s\n", e.msg);
        close(p[1]);
        _exit(rc ? 1 : 0);
    }
    close(p[1]);
    return p[0];
}

/* Closes the read end of a writer child's pipe and checks that the child succeeded. */
static void reap_writer(int fd, pid_t pid, const char *what)
{
    close(fd);
    int st;
    waitpid(pid, &st, 0);
    T_CHECK(WIFEXITED(st) && WEXITSTATUS(st) == 0, "%s: writer child failed", what);
}

static void roundtrip_pipe(const cfg *c, const dfl_writer_opts *o, dfl_batch *bs, int n, int z, const char *what)
{
    (void)z;
    pid_t pid;
    int fd = spawn_writer(c, o, bs, n, &pid);
    dfl_reader *r;
    dfl_err e;
    int rc = dfl_reader_open_fd(&r, fd, "pipe", NULL, &e);
    T_CHECK(rc == 0, "%s: open: %s", what, e.msg);
    if (rc == 0) {
        read_and_check(r, c, bs, n, true, what);
        T_CHECK(dfl_reader_end(r)->index_offset == 0, "%s: a pipe gets no index", what);
        const dfl_index_entry *ent;
        uint64_t ne;
        T_CHECK(dfl_reader_index(r, &ent, &ne, &e) == DFL_EUNSUP, "%s: index on a pipe", what);
        dfl_reader_close(r);
    }
    reap_writer(fd, pid, what);
}

static void test_roundtrip_pipe(void) { each_config("pipe", 7, 1, roundtrip_pipe); }

/* A big hidden batch (several write and read chunks) through a pipe and a file. */
static void test_large_batch(void)
{
    cfg c = {DFL_KIND_HIDDEN, 2, 4096, DFL_BF16, 0};
    dfl_batch bs[2];
    gen_batch(&bs[0], &c, 99, 4, 400);
    gen_batch(&bs[1], &c, 98, 4, 400);
    pid_t pid;
    dfl_writer_opts o = {0};
    int fd = spawn_writer(&c, &o, bs, 2, &pid);
    dfl_reader *r;
    dfl_err e;
    if (dfl_reader_open_fd(&r, fd, "pipe", NULL, &e) == 0) {
        read_and_check(r, &c, bs, 2, true, "large pipe");
        dfl_reader_close(r);
    } else {
        T_CHECK(0, "open: %s", e.msg);
    }
    reap_writer(fd, pid, "large pipe");
    char *path = tmp_path("large.dfl");
    T_CHECK(write_file(path, &c, &o, bs, 2, -1, &e) == 0, "write: %s", e.msg);
    if (dfl_reader_open(&r, path, NULL, &e) == 0) {
        read_and_check(r, &c, bs, 2, false, "large file");
        dfl_reader_close(r);
    }
    free_all(bs, 2);
}

static void index_case(const cfg *c, const dfl_writer_opts *o, dfl_batch *bs, int n, int z, const char *what)
{
    (void)what;
    char *path = tmp_path("index.dfl");
    dfl_err e;
    T_CHECK(write_file(path, c, o, bs, n, 2, &e) == 0, "write: %s", e.msg);
    /* the offsets, as walking finds them */
    uint64_t offs[12];
    int k = 0;
    dfl_reader *r = open_ok(path);
    if (!r)
        return;
    dfl_frame f;
    while (next_frame_ok(r, &f)) {
        if (f.type == DFL_FT_HIDDEN && k < 12)
            offs[k++] = f.offset;
        dfl_frame_free(&f);
    }
    dfl_reader_close(r);
    T_EQ_INT(k, n, "batches walked");
    /* a fresh reader finds the index without walking, and reads batches in any order */
    T_CHECK(dfl_reader_open(&r, path, NULL, &e) == 0, "open: %s", e.msg);
    const dfl_index_entry *ent;
    uint64_t ne;
    int rc = dfl_reader_index(r, &ent, &ne, &e);
    T_CHECK(rc == 0, "index: %s", e.msg);
    if (rc == 0) {
        T_CHECK(ne == (uint64_t)n, "index has %llu entries", (unsigned long long)ne);
        for (int i = 0; i < n && (uint64_t)i < ne; i++)
            T_CHECK(ent[i].offset == offs[i] && ent[i].n_seqs == bs[i].n_seqs && ent[i].n_tokens == bs[i].n_tokens,
                    "entry %d", i);
        for (int i = n - 1; i >= 0; i--) {
            dfl_batch b;
            rc = dfl_reader_batch_at(r, ent[i].offset, &b, &e);
            T_CHECK(rc == 0, "batch_at %d: %s", i, e.msg);
            if (rc)
                continue;
            check_same(&b, &bs[i], (uint64_t)i, "batch_at");
            T_CHECK(z ? b.owned != NULL : b.owned == NULL, "batch_at %d owned", i);
            dfl_batch_free(&b);
        }
        dfl_batch b;
        T_CHECK(dfl_reader_batch_at(r, ent[0].offset + 64, &b, &e) == DFL_EUSAGE, "an offset not in the index");
        /* random access leaves the walk intact */
        read_and_check(r, c, bs, n, z, "walk after random access");
    }
    dfl_reader_close(r);
}

static void test_index(void)
{
    each_config_of(2, 3, 12, "index", 29, 3, index_case);
    /* without an index */
    const cfg *c = &cfgs[0];
    dfl_batch bs[3];
    int n = gen_all(bs, c, 3, 5);
    dfl_writer_opts o = {.no_index = true};
    char *path = tmp_path("noindex.dfl");
    dfl_err e;
    T_CHECK(write_file(path, c, &o, bs, n, -1, &e) == 0, "write: %s", e.msg);
    dfl_reader *r;
    if (dfl_reader_open(&r, path, NULL, &e) == 0) {
        const dfl_index_entry *ent;
        uint64_t ne;
        T_CHECK(dfl_reader_index(r, &ent, &ne, &e) == DFL_EUNSUP, "no index: %s", e.msg);
        dfl_batch b;
        /* batch_at still reads a batch frame at a known offset */
        T_CHECK(dfl_reader_batch_at(r, dfl_reader_offset(r), &b, &e) == 0, "batch_at without index: %s", e.msg);
        check_same(&b, &bs[0], 0, "batch_at without index");
        dfl_batch_free(&b);
        read_and_check(r, c, bs, n, false, "no index");
        dfl_reader_close(r);
    }
    free_all(bs, n);
}

static void test_listing(void)
{
    const cfg *c = &cfgs[0];
    dfl_batch bs[3];
    int n = gen_all(bs, c, 3, 8);
    char *path = tmp_path("list.dfl");
    dfl_err e;
    dfl_writer_opts o = {0};
    T_CHECK(write_file(path, c, &o, bs, n, 1, &e) == 0, "write: %s", e.msg);
    dfl_reader *r = open_ok(path);
    if (!r)
        return;
    static const uint32_t want[] = {DFL_FT_TOKENS, DFL_FT_TOKENS, DFL_FT_NOTE, DFL_FT_TOKENS, DFL_FT_INDEX, DFL_FT_END};
    uint64_t off = dfl_reader_offset(r);
    T_CHECK(off > 64 && off % 64 == 0, "header frame size %llu", (unsigned long long)off);
    size_t k = 0;
    dfl_frame f;
    while (next_frame_ok(r, &f)) {
        T_CHECK(k < DFL_ARRAY_LEN(want) && f.type == want[k], "frame %zu type %u", k, f.type);
        T_CHECK(f.seq == k + 1, "frame seq %llu", (unsigned long long)f.seq);
        T_CHECK(f.offset == off, "frame %zu offset %llu, expected %llu", k, (unsigned long long)f.offset,
                (unsigned long long)off);
        T_CHECK(f.total_len % 64 == 0 && f.total_len == 64 + f.stored_len + (64 - (f.stored_len + 8) % 64) % 64 + 8,
                "frame %zu total %llu", k, (unsigned long long)f.total_len);
        T_CHECK(f.payload && aligned64(f.payload), "frame %zu payload", k);
        if (f.type == DFL_FT_NOTE)
            T_CHECK(f.raw_len > 2 && f.payload[0] == '{', "note payload");
        if (f.type == DFL_FT_END)
            T_CHECK(f.total_len == 192, "END frame is %llu bytes", (unsigned long long)f.total_len);
        off += f.total_len;
        k++;
        dfl_frame_free(&f);
    }
    T_EQ_INT(k, DFL_ARRAY_LEN(want), "frames listed");
    struct stat st;
    stat(path, &st);
    T_CHECK((uint64_t)st.st_size == off, "file size %lld vs frames %llu", (long long)st.st_size, (unsigned long long)off);
    T_CHECK(dfl_reader_end(r)->n_frames == k, "n_frames");
    dfl_reader_close(r);
    free_all(bs, n);
}

static bool slurp(const char *path, fc_buf *b)
{
    char *s;
    size_t n;
    dfl_err e;
    if (dfl_read_file(path, 1u << 30, &s, &n, &e))
        return false;
    b->n = 0;
    fc_append(b, s, n);
    free(s);
    return true;
}

static void determinism_case(const cfg *c, const dfl_writer_opts *o, dfl_batch *bs, int n, int z, const char *what)
{
    (void)what;
    dfl_err e;
    char *p1 = tmp_path("det1.dfl"), *p2 = tmp_path("det2.dfl");
    T_CHECK(write_file(p1, c, o, bs, n, 1, &e) == 0, "write 1");
    T_CHECK(write_file(p2, c, o, bs, n, 1, &e) == 0, "write 2");
    fc_buf a = {0}, b = {0};
    T_CHECK(slurp(p1, &a) && slurp(p2, &b), "read back");
    T_CHECK(a.n == b.n && a.n > 0 && memcmp(a.p, b.p, a.n) == 0, "zstd %d: same batches gave different bytes", z);
    /* and a pipe gets the same bytes, less INDEX, with END saying so */
    free(a.p);
    free(b.p);
}

static void test_determinism(void) { each_config_of(3, 4, 5, "determinism", 74, 5, determinism_case); }

/* ---- damaged streams -------------------------------------------------------------------------- */

/* Reads a whole stream from bytes, through a file (mapped) or a pipe; returns the code. */
static int read_bytes(const uint8_t *s, size_t n, bool via_pipe, const dfl_reader_opts *o, uint64_t *nb,
                      bool *trunc, dfl_err *e)
{
    int fd;
    if (via_pipe) {
        int p[2];
        if (pipe(p) != 0)
            abort();
        fcntl(p[1], F_SETPIPE_SZ, 1 << 20);
        if (n > 65536 && (size_t)fcntl(p[1], F_GETPIPE_SZ) < n)
            abort();
        if (dfl_write_all(p[1], s, n, "pipe", e))
            abort();
        close(p[1]);
        fd = p[0];
    } else {
        /* unlinked scratch file: no fsync, no name */
        char *path = tmp_path("bytes.dfl");
        fd = open(path, O_RDWR | O_CREAT | O_TRUNC, 0600);
        if (fd < 0 || dfl_write_all(fd, s, n, path, e))
            abort();
        unlink(path);
        lseek(fd, 0, SEEK_SET);
    }
    dfl_reader *r;
    int rc = dfl_reader_open_fd(&r, fd, "in.dfl", o, e);
    *nb = 0;
    *trunc = false;
    if (rc == 0) {
        for (;;) {
            dfl_batch b;
            bool eos;
            rc = dfl_reader_next(r, &b, &eos, e);
            if (rc || eos)
                break;
            (*nb)++;
            dfl_batch_free(&b);
        }
        *trunc = dfl_reader_truncated(r);
        dfl_reader_close(r);
    }
    close(fd);
    return rc;
}

/* A small good token stream (with an INDEX), as bytes. */
static void small_stream(fc_buf *out, bool index, int zstd_level, const cfg *c, int nbatch)
{
    dfl_batch bs[8];
    int n = nbatch;
    for (int i = 0; i < n; i++)
        gen_batch(&bs[i], c, 500 + (uint64_t)i, 3, 7);
    dfl_writer_opts o = {.zstd_level = zstd_level, .no_index = !index};
    char *path = tmp_path("small.dfl");
    dfl_err e;
    if (write_file(path, c, &o, bs, n, -1, &e) || !slurp(path, out)) {
        fprintf(stderr, "small_stream: %s\n", e.msg);
        abort();
    }
    free_all(bs, n);
}

static const cfg small_tokens = {DFL_KIND_TOKENS, 0, 0, DFL_DT_INVALID, 1000};
static const cfg small_hidden = {DFL_KIND_HIDDEN, 2, 8, DFL_BF16, 1000};

static void test_truncation(void)
{
    fc_buf s = {0};
    small_stream(&s, true, 0, &small_tokens, 3);
    size_t offs[64];
    int nf = fc_list(s.p, s.n, offs, 64);
    T_EQ_INT(nf, 6, "frames in the small stream"); /* HEADER, 3 TOKENS, INDEX, END */
    for (int via_pipe = 0; via_pipe <= 1; via_pipe++) {
        int fails = 0;
        for (size_t cut = 0; cut < s.n && fails < 5; cut++) {
            uint64_t nb;
            bool tr;
            dfl_err e;
            int rc = read_bytes(s.p, cut, via_pipe, NULL, &nb, &tr, &e);
            if (rc != DFL_ETRUNC || (!strstr(e.msg, "truncated") && !strstr(e.msg, "empty"))) {
                T_CHECK(0, "%s cut at %zu: code %d (%s)", via_pipe ? "pipe" : "file", cut, rc, rc ? e.msg : "ok");
                fails++;
                continue;
            }
            /* allow_truncated: a clean end after the last complete batch (or no stream at all
             * before the HEADER is complete) */
            dfl_reader_opts o = {.allow_truncated = true};
            rc = read_bytes(s.p, cut, via_pipe, &o, &nb, &tr, &e);
            uint64_t complete = 0;
            for (int f = 1; f <= 3; f++)
                complete += offs[f] + fc_total(s.p + offs[f]) <= cut;
            if (cut < offs[1]) {
                if (rc != DFL_ETRUNC) {
                    T_CHECK(0, "cut at %zu inside HEADER with allow_truncated: code %d", cut, rc);
                    fails++;
                }
            } else if (rc != 0 || !tr || nb != complete) {
                T_CHECK(0, "%s cut at %zu allow_truncated: rc %d trunc %d batches %llu (want %llu): %s",
                        via_pipe ? "pipe" : "file", cut, rc, tr, (unsigned long long)nb, (unsigned long long)complete,
                        rc ? e.msg : "");
                fails++;
            }
        }
        /* the exact wording at a frame boundary and inside a frame, and of an empty input */
        uint64_t nb;
        bool tr;
        dfl_err e;
        T_CHECK(read_bytes(s.p, 0, via_pipe, NULL, &nb, &tr, &e) == DFL_ETRUNC &&
                    strcmp(e.msg, "in.dfl: truncated: empty input (no bytes at all)") == 0,
                "empty input (%s): %s", via_pipe ? "pipe" : "file", e.msg);
        read_bytes(s.p, offs[4], via_pipe, NULL, &nb, &tr, &e);
        T_CHECK(strstr(e.msg, "in.dfl: truncated: no END frame after 3 batches") != NULL, "message: %s", e.msg);
        char want[128];
        snprintf(want, sizeof want, "in.dfl: truncated inside frame 2 (TOKENS) at offset %zu", offs[2]);
        read_bytes(s.p, offs[2] + 100, via_pipe, NULL, &nb, &tr, &e);
        T_CHECK(strstr(e.msg, want) != NULL, "message: %s", e.msg);
        snprintf(want, sizeof want, "in.dfl: truncated inside frame 5 at offset %zu", offs[5]);
        read_bytes(s.p, offs[5] + 10, via_pipe, NULL, &nb, &tr, &e);
        T_CHECK(strstr(e.msg, want) != NULL, "message: %s", e.msg);
    }
    /* the index of a cut file */
    char *path = tmp_path("cutindex.dfl");
    dfl_err e;
    dfl_write_file_atomic(path, s.p, s.n - 64, &e);
    dfl_reader *r;
    if (dfl_reader_open(&r, path, NULL, &e) == 0) {
        const dfl_index_entry *ent;
        uint64_t ne;
        T_CHECK(dfl_reader_index(r, &ent, &ne, &e) == DFL_ETRUNC, "index of a cut file: %s", e.msg);
        dfl_reader_close(r);
    }
    dfl_reader_opts o = {.allow_truncated = true};
    if (dfl_reader_open(&r, path, &o, &e) == 0) {
        const dfl_index_entry *ent;
        uint64_t ne;
        T_CHECK(dfl_reader_index(r, &ent, &ne, &e) == DFL_EUNSUP, "index of a cut file, allow_truncated: %s", e.msg);
        dfl_reader_close(r);
    }
    free(s.p);
}

/* Which frame holds byte i. */
static int frame_of(const size_t *offs, int nf, size_t i)
{
    int f = 0;
    while (f + 1 < nf && offs[f + 1] <= i)
        f++;
    return f;
}

static void flip_all(const fc_buf *s, const char *what, int bit_stride)
{
    size_t offs[64];
    int nf = fc_list(s->p, s->n, offs, 64);
    fc_buf d = {0};
    int fails = 0;
    for (int via_pipe = 0; via_pipe <= 1; via_pipe++) {
        for (size_t bit = (size_t)via_pipe; bit < 8 * s->n && fails < 5; bit += (size_t)(via_pipe ? 7 : bit_stride)) {
            fc_copy(&d, s->p, s->n);
            d.p[bit / 8] ^= (uint8_t)(1u << (bit % 8));
            uint64_t nb;
            bool tr;
            dfl_err e;
            int rc = read_bytes(d.p, d.n, via_pipe, NULL, &nb, &tr, &e);
            int f = frame_of(offs, nf, bit / 8);
            char want[96];
            snprintf(want, sizeof want, "in.dfl: frame %d at offset %zu: ", f, offs[f]);
            bool ok = (rc == DFL_EDATA || (rc == DFL_EUNSUP && bit / 8 == 4)) && strstr(e.msg, want);
            if (!ok) {
                T_CHECK(0, "%s %s: flipped bit %zu (byte %zu, frame %d): code %d: %s", what, via_pipe ? "pipe" : "file",
                        bit, bit / 8, f, rc, rc ? e.msg : "accepted");
                fails++;
            }
        }
    }
    free(d.p);
}

static void test_bit_flips(void)
{
    fc_buf s = {0};
    small_stream(&s, true, 0, &small_tokens, 2);
    flip_all(&s, "tokens", 1);
    small_stream(&s, true, 9, &small_hidden, 2);
    flip_all(&s, "hidden zstd", 3);
    free(s.p);
}

/* Expects the edited stream to fail with code and a message containing want, both ways. */
static void expect_bad(const fc_buf *d, int code, const char *want, const char *what)
{
    for (int via_pipe = 0; via_pipe <= 1; via_pipe++) {
        uint64_t nb;
        bool tr;
        dfl_err e;
        int rc = read_bytes(d->p, d->n, via_pipe, NULL, &nb, &tr, &e);
        T_CHECK(rc == code && strstr(e.msg, want), "%s (%s): code %d, want %d; message '%s', want '%s'", what,
                via_pipe ? "pipe" : "file", rc, code, rc ? e.msg : "", want);
    }
}

static void test_defects(void)
{
    fc_buf s = {0}, d = {0};
    small_stream(&s, false, 0, &small_tokens, 3);
    size_t offs[64], end_off = 0;
    int nf = fc_list(s.p, s.n, offs, 64);
    T_EQ_INT(nf, 5, "frames");
    fc_find(s.p, s.n, DFL_FT_END, &end_off);
    char want[160];

    /* unknown must-understand type before END */
    uint8_t pl[100];
    memset(pl, 0x5a, sizeof pl);
    fc_with_frame(&d, s.p, s.n, end_off, 77, 0, pl, sizeof pl, sizeof pl);
    snprintf(want, sizeof want, "frame 4 at offset %zu: unsupported frame type 77", end_off);
    expect_bad(&d, DFL_EUNSUP, want, "unknown must-understand type");

    /* the same, skippable: skipped, everything else read */
    fc_with_frame(&d, s.p, s.n, offs[2], 77, DFL_FF_SKIPPABLE, pl, sizeof pl, sizeof pl);
    for (int via_pipe = 0; via_pipe <= 1; via_pipe++) {
        uint64_t nb;
        bool tr;
        dfl_err e;
        int rc = read_bytes(d.p, d.n, via_pipe, NULL, &nb, &tr, &e);
        T_CHECK(rc == 0 && nb == 3, "unknown skippable frame: code %d, %llu batches: %s", rc, (unsigned long long)nb,
                rc ? e.msg : "");
    }
    /* listed with its type and no payload */
    {
        char *path = tmp_path("skip.dfl");
        dfl_err e;
        dfl_write_file_atomic(path, d.p, d.n, &e);
        dfl_reader *r;
        if (dfl_reader_open(&r, path, NULL, &e) == 0) {
            int seen = 0;
            dfl_frame f;
            while (next_frame_ok(r, &f)) {
                if (f.type == 77) {
                    seen++;
                    T_CHECK(f.payload == NULL && f.stored_len == 100 && (f.flags & DFL_FF_SKIPPABLE), "listed unknown frame");
                }
                dfl_frame_free(&f);
            }
            T_EQ_INT(seen, 1, "unknown frame listed");
            dfl_reader_close(r);
        }
    }
    /* a skippable frame with a payload that is not even zstd is skipped unread */
    fc_with_frame(&d, s.p, s.n, offs[1], 300, DFL_FF_SKIPPABLE | DFL_FF_ZSTD, pl, sizeof pl, 1000);
    {
        uint64_t nb;
        bool tr;
        dfl_err e;
        T_CHECK(read_bytes(d.p, d.n, true, NULL, &nb, &tr, &e) == 0 && nb == 3, "compressed unknown skippable: %s", e.msg);
    }

    /* wrong major version in the HEADER: unsupported */
    fc_copy(&d, s.p, s.n);
    d.p[4] = 2;
    fc_refix(d.p, 0);
    expect_bad(&d, DFL_EUNSUP, "frame 0 at offset 0: format major version 2 is not supported", "major version");
    /* in a later frame: invalid */
    fc_copy(&d, s.p, s.n);
    d.p[offs[2] + 4] = 2;
    fc_refix(d.p, offs[2]);
    snprintf(want, sizeof want, "frame 2 at offset %zu: major version 2 differs", offs[2]);
    expect_bad(&d, DFL_EDATA, want, "major version mid-stream");

    /* a reserved flag bit */
    fc_copy(&d, s.p, s.n);
    d.p[offs[1] + 5] |= 0x20;
    fc_refix(d.p, offs[1]);
    snprintf(want, sizeof want, "frame 1 at offset %zu: reserved flag bits set", offs[1]);
    expect_bad(&d, DFL_EDATA, want, "reserved flag");

    /* a reserved header byte */
    fc_copy(&d, s.p, s.n);
    d.p[offs[1] + 40] = 1;
    fc_refix(d.p, offs[1]);
    expect_bad(&d, DFL_EDATA, "reserved header bytes", "reserved header byte");

    /* a huge length with a valid header check: rejected before any allocation */
    fc_copy(&d, s.p, s.n);
    fc_put64(d.p + offs[1] + 8, 1ull << 50);
    fc_put64(d.p + offs[1] + 16, 1ull << 50);
    fc_refix_header(d.p, offs[1]);
    snprintf(want, sizeof want, "frame 1 at offset %zu: TOKENS frame of 1125899906842624 bytes", offs[1]);
    expect_bad(&d, DFL_EDATA, want, "huge length");
    /* under the limit but longer than the file: a cut */
    fc_copy(&d, s.p, s.n);
    fc_put64(d.p + offs[1] + 8, 1ull << 20);
    fc_put64(d.p + offs[1] + 16, 1ull << 20);
    fc_refix_header(d.p, offs[1]);
    {
        uint64_t nb;
        bool tr;
        dfl_err e;
        T_CHECK(read_bytes(d.p, d.n, false, NULL, &nb, &tr, &e) == DFL_ETRUNC, "length past the end of a file: %s", e.msg);
        dfl_reader_opts o = {.max_frame = 1000};
        T_CHECK(read_bytes(d.p, d.n, true, &o, &nb, &tr, &e) == DFL_EDATA && strstr(e.msg, "over the limit"),
                "max_frame option: %s", e.msg);
    }

    /* END totals */
    fc_copy(&d, s.p, s.n);
    fc_put64(d.p + end_off + 64 + 8, fc_get64(d.p + end_off + 64 + 8) + 1);
    fc_refix(d.p, end_off);
    expect_bad(&d, DFL_EDATA, "END totals", "END totals");
    fc_copy(&d, s.p, s.n);
    fc_put64(d.p + end_off + 64 + 32, 9);
    fc_refix(d.p, end_off);
    expect_bad(&d, DFL_EDATA, "END counts 9 frames", "END frame count");

    /* bytes after END */
    fc_copy(&d, s.p, s.n);
    fc_append(&d, "\0", 1);
    expect_bad(&d, DFL_EDATA, "after the END frame", "trailing byte");
    fc_copy(&d, s.p, s.n);
    fc_append(&d, s.p + end_off, 192); /* a second END */
    expect_bad(&d, DFL_EDATA, "after the END frame", "trailing END");

    /* seq_lens that do not sum to T */
    fc_copy(&d, s.p, s.n);
    uint8_t *pay = d.p + offs[1] + 64;
    fc_put32(pay + 64, fc_get32(pay + 64) + 1);
    fc_refix(d.p, offs[1]);
    expect_bad(&d, DFL_EDATA, "seq_lens sum to", "seq_lens sum");

    /* loss_mask 2 */
    fc_copy(&d, s.p, s.n);
    pay = d.p + offs[1] + 64;
    {
        uint32_t S = fc_get32(pay + 16);
        uint64_t T = fc_get64(pay + 8);
        size_t o_mask = 64 + DFL_ALIGN_UP(4 * S, 64) + DFL_ALIGN_UP(4 * T, 64);
        pay[o_mask + T - 1] = 2;
    }
    fc_refix(d.p, offs[1]);
    snprintf(want, sizeof want, "frame 1 at offset %zu: batch 0: loss_mask[", offs[1]);
    expect_bad(&d, DFL_EDATA, want, "loss_mask 2");

    /* a token id at the vocabulary size */
    fc_copy(&d, s.p, s.n);
    pay = d.p + offs[2] + 64;
    fc_put32(pay + 64 + DFL_ALIGN_UP(4 * fc_get32(pay + 16), 64), 1000);
    fc_refix(d.p, offs[2]);
    expect_bad(&d, DFL_EDATA, "has id 1000, outside [0, 1000)", "id >= vocab");

    /* a missing frame (seq gap) */
    fc_copy(&d, s.p, s.n);
    fc_put64(d.p + offs[2] + 24, 3);
    fc_refix(d.p, offs[2]);
    expect_bad(&d, DFL_EDATA, "frame number 3, expected 2", "seq gap");

    /* a batch index out of order */
    fc_copy(&d, s.p, s.n);
    fc_put64(d.p + offs[2] + 64, 5);
    fc_refix(d.p, offs[2]);
    expect_bad(&d, DFL_EDATA, "batch index 5, expected 1", "batch index");
    free(d.p);
    free(s.p);
}

/* The stream base with its HEADER replaced by one holding json (base has no INDEX). */
static void with_header_json(fc_buf *out, const fc_buf *base, const char *json, size_t len)
{
    size_t offs[64];
    fc_list(base->p, base->n, offs, 64);
    out->n = 0;
    fc_frame(out, DFL_FT_HEADER, 0, 0, json, len, len);
    fc_append(out, base->p + offs[1], base->n - offs[1]);
}

/* The stream base with a NOTE holding json inserted before its second frame (base has no INDEX). */
static void with_note_json(fc_buf *out, const fc_buf *base, const char *json, size_t len)
{
    size_t offs[64];
    fc_list(base->p, base->n, offs, 64);
    fc_buf fr = {0};
    fc_frame(&fr, DFL_FT_NOTE, DFL_FF_SKIPPABLE, 0, json, len, len);
    fc_copy(out, base->p, base->n);
    fc_insert(out, offs[1], fr.p, fr.n);
    fc_renumber(out->p, out->n);
    free(fr.p);
}

/* Reads d through a file and a pipe: both accept it (want 0) or both fail with code and want in
 * the message. */
static void expect_json(const fc_buf *d, int code, const char *want, const char *what)
{
    if (code)
        return expect_bad(d, code, want, what);
    for (int via_pipe = 0; via_pipe <= 1; via_pipe++) {
        uint64_t nb;
        bool tr;
        dfl_err e;
        int rc = read_bytes(d->p, d->n, via_pipe, NULL, &nb, &tr, &e);
        T_CHECK(rc == 0 && nb == 3, "%s (%s): refused: %s", what, via_pipe ? "pipe" : "file", rc ? e.msg : "");
    }
}

/* The HEADER follows dfl-frame(5) strictly: integers are integer tokens, null is not absence; and
 * the JSON limits of the page hold in HEADER and NOTE, at their edges. */
static void test_header_json(void)
{
    fc_buf t = {0}, h = {0}, d = {0};
    small_stream(&t, false, 0, &small_tokens, 3);
    small_stream(&h, false, 0, &small_hidden, 3);
#define TOK "\"format\":\"dfl\",\"kind\":\"tokens\",\"producer\":\"x\""
#define HID "\"dtype\":\"bf16\",\"format\":\"dfl\",\"kind\":\"hidden\",\"layers\":[1,9],\"producer\":\"x\""
    static const struct { bool hidden; const char *json, *want; } cases[] = {
        /* accepted: the writer's form, and the same with white space */
        {false, "{" TOK ",\"version\":[1,0],\"vocab_size\":1000}", NULL},
        {false, "{ " TOK ", \"version\": [1, 0],\n \"vocab_size\": 1000 }", NULL},
        {true, "{" HID ",\"hidden_size\":8,\"version\":[1,0],\"vocab_size\":1000}", NULL},
        /* integers are integer tokens */
        {false, "{" TOK ",\"version\":[1,0],\"vocab_size\":1000.0}", "\"vocab_size\" must be an integer"},
        {false, "{" TOK ",\"version\":[1,0],\"vocab_size\":1e3}", "\"vocab_size\" must be an integer"},
        {false, "{" TOK ",\"version\":[1,0],\"vocab_size\":1000E0}", "\"vocab_size\" must be an integer"},
        {true, "{" HID ",\"hidden_size\":8.0,\"version\":[1,0]}", "\"hidden_size\" must be an integer"},
        {true, "{" HID ",\"hidden_size\":8e0,\"version\":[1,0]}", "\"hidden_size\" must be an integer"},
        {false, "{" TOK ",\"version\":[1,0.0]}", "\"version\" must be [major, minor]"},
        {false, "{" TOK ",\"version\":[1e0,0]}", "\"version\" must be [major, minor]"},
        {true, "{\"dtype\":\"bf16\",\"format\":\"dfl\",\"hidden_size\":8,\"kind\":\"hidden\",\"layers\":[1,9.0],\"producer\":\"x\",\"version\":[1,0]}", "\"layers\"[1] is not a layer id"},
        /* null is not absence */
        {false, "{" TOK ",\"version\":[1,0],\"vocab_size\":null}", "\"vocab_size\" is null"},
        {false, "{" TOK ",\"fingerprint\":null,\"version\":[1,0]}", "\"fingerprint\" is null"},
        {false, "{" TOK ",\"meta\":null,\"version\":[1,0]}", "\"meta\" is null"},
        {false, "{\"format\":\"dfl\",\"kind\":\"tokens\",\"producer\":null,\"version\":[1,0]}", "\"producer\" is null"},
        {false, "{" TOK ",\"dtype\":null,\"version\":[1,0]}", "\"dtype\" is null"},
        /* an unknown key may hold anything, null included */
        {false, "{" TOK ",\"version\":[1,0],\"x-later\":null}", NULL},
        /* the version rule: any minor version from 0 to 2^63-1 */
        {false, "{" TOK ",\"version\":[1,9223372036854775807]}", NULL},
        {false, "{" TOK ",\"version\":[1,9223372036854775808]}", "invalid JSON"},
        {false, "{" TOK ",\"version\":[1,-1]}", "\"version\" must be [major, minor]"},
        /* integers within int64 anywhere */
        {false, "{" TOK ",\"meta\":{\"n\":-9223372036854775808},\"version\":[1,0]}", NULL},
        {false, "{" TOK ",\"meta\":{\"n\":-9223372036854775809},\"version\":[1,0]}", "invalid JSON"},
        /* no \u0000, no lone surrogate */
        {false, "{" TOK ",\"meta\":{\"s\":\"a\\u0000b\"},\"version\":[1,0]}", "invalid JSON"},
        {false, "{" TOK ",\"meta\":{\"s\":\"a\\ud800b\"},\"version\":[1,0]}", "invalid JSON"},
        {false, "{" TOK ",\"meta\":{\"s\":\"a\\udc00\"},\"version\":[1,0]}", "invalid JSON"},
        {false, "{" TOK ",\"meta\":{\"s\":\"\\ud83d\\ude00\"},\"version\":[1,0]}", NULL},
        /* no byte order mark */
        {false, "\xef\xbb\xbf{" TOK ",\"version\":[1,0]}", "invalid JSON"},
    };
    for (size_t i = 0; i < DFL_ARRAY_LEN(cases); i++) {
        with_header_json(&d, cases[i].hidden ? &h : &t, cases[i].json, strlen(cases[i].json));
        char what[64];
        snprintf(what, sizeof what, "HEADER case %zu", i);
        expect_json(&d, cases[i].want ? DFL_EDATA : 0, cases[i].want ? cases[i].want : "", what);
    }
    /* nesting: 64 levels (the HEADER object is level 1) accepted, 65 refused */
    for (int depth = 64; depth <= 65; depth++) {
        char json[1024];
        size_t k = (size_t)snprintf(json, sizeof json, "{" TOK ",\"version\":[1,0],\"x\":");
        for (int l = 2; l <= depth; l++)
            json[k++] = '[';
        json[k++] = '1';
        for (int l = 2; l <= depth; l++)
            json[k++] = ']';
        json[k++] = '}';
        with_header_json(&d, &t, json, k);
        expect_json(&d, depth == 64 ? 0 : DFL_EDATA, "nested deeper than 64", depth == 64 ? "HEADER depth 64" : "HEADER depth 65");
        /* the same in a NOTE */
        k = (size_t)snprintf(json, sizeof json, "{\"n\":");
        for (int l = 2; l <= depth; l++)
            json[k++] = '{', k += (size_t)snprintf(json + k, sizeof json - k, "\"a\":");
        json[k++] = '1';
        for (int l = 1; l <= depth; l++)
            json[k++] = '}';
        with_note_json(&d, &t, json, k);
        expect_json(&d, depth == 64 ? 0 : DFL_EDATA, "nested deeper than 64", depth == 64 ? "NOTE depth 64" : "NOTE depth 65");
    }
    /* the NOTE limits */
    static const struct { const char *json, *want; } notes[] = {
        {"{\"a\":1}", NULL},
        {"{\"a\":9223372036854775808}", "invalid JSON"},
        {"{\"a\":\"x\\u0000\"}", "invalid JSON"},
        {"{\"a\":\"\\ud800\"}", "invalid JSON"},
        {"\xef\xbb\xbf{\"a\":1}", "invalid JSON"},
        {"{\"a\":1,\"a\":2}", "invalid JSON"},
        {"{\"a\":\"\xff\"}", "invalid JSON"},
    };
    for (size_t i = 0; i < DFL_ARRAY_LEN(notes); i++) {
        with_note_json(&d, &t, notes[i].json, strlen(notes[i].json));
        char what[64];
        snprintf(what, sizeof what, "NOTE case %zu", i);
        expect_json(&d, notes[i].want ? DFL_EDATA : 0, notes[i].want ? notes[i].want : "", what);
    }
    /* a NUL byte, in HEADER and NOTE */
    static const char nul[] = "{\"a\":\"x\0\"}";
    with_note_json(&d, &t, nul, sizeof nul - 1);
    expect_json(&d, DFL_EDATA, "NUL byte", "NOTE with a NUL byte");
#undef TOK
#undef HID
    free(t.p);
    free(h.p);
    free(d.p);
}

/* ---- the committed corpus --------------------------------------------------------------------- */

static const char *src_root(void)
{
    static char root[4096];
    const char *env = getenv("DFL_SRCDIR");
    if (env && *env)
        return env;
    ssize_t n = readlink("/proc/self/exe", root, sizeof root - 1);
    if (n <= 0)
        return NULL;
    root[n] = 0;
    for (int i = 0; i < 3; i++) { /* <root>/build/tests/test-frame */
        char *slash = strrchr(root, '/');
        if (!slash)
            return NULL;
        *slash = 0;
    }
    return root;
}

/* Reads a file by random access: its index, then every batch it lists (direct: the batches by
 * their offsets, last first, on a second reader that was not asked for the index, as dfl-draft's
 * prefetch threads read them). Returns the first error (DFL_OK when everything reads);
 * *no_index when the file has no index to read it by (no INDEX, or no END at its end:
 * dfl_reader_index's DFL_EUNSUP and DFL_ETRUNC, on which a caller walks the stream instead). */
static int read_by_index(const char *path, bool direct, bool *no_index, dfl_err *e)
{
    *no_index = false;
    dfl_reader *r;
    int rc = dfl_reader_open(&r, path, NULL, e);
    if (rc)
        return rc;
    const dfl_index_entry *ent;
    uint64_t n;
    rc = dfl_reader_index(r, &ent, &n, e);
    if ((rc == DFL_EUNSUP && strstr(e->msg, "has no INDEX frame")) ||
        (rc == DFL_ETRUNC && strstr(e->msg, "no END frame at the end of the file")))
        *no_index = true;
    for (uint64_t i = 0; rc == DFL_OK && !direct && i < n; i++) {
        dfl_batch b;
        rc = dfl_reader_batch_at(r, ent[i].offset, &b, e);
        dfl_batch_free(&b);
    }
    dfl_reader *r2;
    if (rc == DFL_OK && direct && (rc = dfl_reader_open(&r2, path, NULL, e)) == DFL_OK) {
        for (uint64_t i = n; rc == DFL_OK && i-- > 0;) {
            dfl_batch b;
            rc = dfl_reader_batch_at(r2, ent[i].offset, &b, e);
            dfl_batch_free(&b);
        }
        dfl_reader_close(r2);
    }
    dfl_reader_close(r);
    return rc;
}

static void test_corpus(void)
{
    const char *root = src_root();
    char dir[4300];
    snprintf(dir, sizeof dir, "%s/tests/bad/frame", root ? root : ".");
    DIR *dp = opendir(dir);
    if (!dp)
        T_SKIP("no corpus at %s", dir);
    int count = 0;
    struct dirent *de;
    while ((de = readdir(dp))) {
        const char *nm = de->d_name;
        size_t len = strlen(nm);
        if (len < 5 || strcmp(nm + len - 4, ".dfl") != 0)
            continue;
        int want = strncmp(nm, "trunc-", 6) == 0 ? DFL_ETRUNC : strncmp(nm, "unsup-", 6) == 0 ? DFL_EUNSUP : DFL_EDATA;
        char path[4600];
        snprintf(path, sizeof path, "%s/%s", dir, nm);
        fc_buf b = {0};
        T_CHECK(slurp(path, &b), "read %s", path);
        for (int via_pipe = 0; via_pipe <= 1; via_pipe++) {
            uint64_t nb;
            bool tr;
            dfl_err e;
            int rc = read_bytes(b.p, b.n, via_pipe, NULL, &nb, &tr, &e);
            T_CHECK(rc == want && strstr(e.msg, "in.dfl: "), "%s (%s): code %d (%s), want %d (%s): %s", nm,
                    via_pipe ? "pipe" : "file", rc, dfl_code_name(rc), want, dfl_code_name(want), rc ? e.msg : "accepted");
        }
        /* read through its INDEX, a file is refused the same way (or has no index to read by) */
        for (int direct = 0; direct <= 1; direct++) {
            bool no_index;
            dfl_err e;
            int rc = read_by_index(path, direct, &no_index, &e);
            T_CHECK(rc == want || no_index, "%s (by its index%s): code %d (%s), want %d (%s): %s", nm,
                    direct ? ", batches by offset" : "", rc, dfl_code_name(rc), want, dfl_code_name(want),
                    rc ? e.msg : "accepted");
            if (strstr(nm, "-indexed.dfl"))
                T_CHECK(!no_index && rc == want, "%s: not refused through its index%s: %s", nm,
                        direct ? " (batches by offset)" : "", rc ? e.msg : "accepted");
        }
        free(b.p);
        count++;
    }
    closedir(dp);
    T_CHECK(count >= 20, "only %d corpus files", count);
    /* and the good examples read cleanly */
    snprintf(dir, sizeof dir, "%s/tests/fixtures/frame", root);
    dp = opendir(dir);
    T_CHECK(dp != NULL, "no fixtures at %s", dir);
    int good = 0;
    while (dp && (de = readdir(dp))) {
        size_t len = strlen(de->d_name);
        if (len < 5 || strcmp(de->d_name + len - 4, ".dfl") != 0)
            continue;
        char path[4600];
        snprintf(path, sizeof path, "%s/%s", dir, de->d_name);
        fc_buf b = {0};
        T_CHECK(slurp(path, &b), "read %s", path);
        uint64_t nb;
        bool tr;
        dfl_err e;
        int rc = read_bytes(b.p, b.n, false, NULL, &nb, &tr, &e);
        T_CHECK(rc == 0 && nb > 0, "fixture %s: %s", de->d_name, rc ? e.msg : "no batches");
        free(b.p);
        good++;
    }
    if (dp)
        closedir(dp);
    T_CHECK(good >= 3, "only %d fixtures", good);

    /* the EXAMPLE of dfl-frame(5) is what the writer writes, byte for byte */
    snprintf(dir, sizeof dir, "%s/tests/fixtures/frame/example.dfl", root);
    fc_buf want = {0}, got = {0};
    T_CHECK(slurp(dir, &want) && want.n == 896, "example.dfl");
    char *path = tmp_path("example.dfl");
    dfl_err e;
    T_CHECK(write_frame_example(path, &e) == 0, "write the example: %s", e.msg);
    T_CHECK(slurp(path, &got) && got.n == want.n && memcmp(got.p, want.p, want.n) == 0,
            "the writer no longer writes the bytes of the EXAMPLE in man/dfl-frame.5");
    free(want.p);
    free(got.p);
}

/* The hex dump in the EXAMPLE of man/dfl-frame.5 is example.dfl. */
static void test_man_example(void)
{
    const char *root = src_root();
    char path[4300];
    snprintf(path, sizeof path, "%s/man/dfl-frame.5", root ? root : ".");
    FILE *f = fopen(path, "r");
    if (!f)
        T_SKIP("no %s", path);
    fc_buf dump = {0}, file = {0};
    char line[256];
    while (fgets(line, sizeof line, f)) {
        unsigned off;
        int pos;
        if (sscanf(line, "%8x: %n", &off, &pos) != 1 || strlen(line) < 10 || line[8] != ':')
            continue;
        T_CHECK(off == dump.n, "dump line at %x, expected %zx", off, dump.n);
        unsigned v;
        int k;
        const char *q = line + pos;
        while (sscanf(q, "%2x%n", &v, &k) == 1) {
            uint8_t c = (uint8_t)v;
            fc_append(&dump, &c, 1);
            q += k;
            while (*q == ' ')
                q++;
        }
    }
    fclose(f);
    snprintf(path, sizeof path, "%s/tests/fixtures/frame/example.dfl", root);
    T_CHECK(slurp(path, &file), "read %s", path);
    T_CHECK(dump.n == file.n && memcmp(dump.p, file.p, file.n) == 0,
            "the hex dump in man/dfl-frame.5 (%zu bytes) is not example.dfl (%zu bytes)", dump.n, file.n);
    free(dump.p);
    free(file.p);
}

/* ---- the writer ------------------------------------------------------------------------------- */

static int count_dir(const char *dir)
{
    DIR *dp = opendir(dir);
    int n = 0;
    struct dirent *de;
    while (dp && (de = readdir(dp)))
        n += de->d_name[0] != '.' || (strcmp(de->d_name, ".") && strcmp(de->d_name, ".."));
    if (dp)
        closedir(dp);
    return n;
}

static void test_writer_files(void)
{
    char dir[4200];
    snprintf(dir, sizeof dir, "%s/wdir", t_tmpdir());
    mkdir(dir, 0755);
    char path[4300];
    snprintf(path, sizeof path, "%s/out.dfl", dir);
    const cfg *c = &cfgs[2];
    dfl_batch bs[2];
    gen_all(bs, c, 2, 3);
    dfl_stream_info in;
    make_info(&in, c);
    dfl_writer *w;
    dfl_err e;
    struct stat st;
    /* nothing under the final name until close; abort leaves nothing at all */
    T_CHECK(dfl_writer_open(&w, path, &in, NULL, &e) == 0, "open: %s", e.msg);
    T_CHECK(dfl_writer_batch(w, &bs[0], &e) == 0, "batch: %s", e.msg);
    T_CHECK(stat(path, &st) != 0, "final name exists before close");
    dfl_writer_abort(w);
    T_EQ_INT(count_dir(dir), 0, "files left after abort");
    /* a bad batch is refused and the stream stays good */
    T_CHECK(dfl_writer_open(&w, path, &in, NULL, &e) == 0, "open: %s", e.msg);
    T_CHECK(dfl_writer_batch(w, &bs[0], &e) == 0, "batch: %s", e.msg);
    uint32_t keep = ((uint32_t *)bs[1].seq_lens)[0];
    ((uint32_t *)bs[1].seq_lens)[0] = keep + 1;
    T_CHECK(dfl_writer_batch(w, &bs[1], &e) == DFL_EDATA && strstr(e.msg, "batch 1"), "bad seq_lens: %s", e.msg);
    ((uint32_t *)bs[1].seq_lens)[0] = keep;
    dfl_batch wrong = bs[1];
    wrong.hidden = 63;
    T_CHECK(dfl_writer_batch(w, &wrong, &e) == DFL_EMISMATCH, "wrong hidden: %s", e.msg);
    ((uint8_t *)bs[1].loss_mask)[0] = 7;
    T_CHECK(dfl_writer_batch(w, &bs[1], &e) == DFL_EDATA && strstr(e.msg, "loss_mask"), "bad mask: %s", e.msg);
    ((uint8_t *)bs[1].loss_mask)[0] = 1;
    T_CHECK(dfl_writer_batch(w, &bs[1], &e) == 0, "batch: %s", e.msg);
    T_CHECK(dfl_writer_close(w, &e) == 0, "close: %s", e.msg);
    T_EQ_INT(count_dir(dir), 1, "files after close");
    dfl_reader *r;
    if (dfl_reader_open(&r, path, NULL, &e) == 0) {
        read_and_check(r, c, bs, 2, false, "after refused batches");
        dfl_reader_close(r);
    }
    /* bad stream descriptions */
    dfl_stream_info bad = in;
    bad.layers[1] = bad.layers[0];
    T_CHECK(dfl_writer_open(&w, path, &bad, NULL, &e) == DFL_EUSAGE, "duplicate layers");
    bad = in;
    bad.dtype = DFL_I32;
    T_CHECK(dfl_writer_open(&w, path, &bad, NULL, &e) == DFL_EUSAGE, "dtype i32");
    T_EQ_INT(count_dir(dir), 1, "files after refused opens");
    /* a terminal is refused unless allowed */
    int m = posix_openpt(O_RDWR | O_NOCTTY);
    if (m >= 0 && grantpt(m) == 0 && unlockpt(m) == 0) {
        int sl = open(ptsname(m), O_RDWR | O_NOCTTY);
        if (sl >= 0) {
            T_CHECK(dfl_writer_open_fd(&w, sl, "tty", &in, NULL, &e) == DFL_EUSAGE && strstr(e.msg, "terminal"),
                    "terminal: %s", e.msg);
            dfl_writer_opts o = {.allow_tty = true};
            T_CHECK(dfl_writer_open_fd(&w, sl, "tty", &in, &o, &e) == 0, "allow_tty: %s", e.msg);
            if (w)
                dfl_writer_abort(w);
            close(sl);
        }
    }
    if (m >= 0)
        close(m);
    /* a consumer that goes away: EPIPE, not a signal */
    int p[2];
    if (pipe(p) == 0) {
        signal(SIGPIPE, SIG_IGN);
        close(p[0]);
        int rc = dfl_writer_open_fd(&w, p[1], "pipe", &in, NULL, &e);
        T_CHECK(rc == DFL_EPIPE, "closed pipe: code %d: %s", rc, e.msg);
        close(p[1]);
        signal(SIGPIPE, SIG_DFL);
    }
    free_all(bs, 2);
}

static void test_payload_size(void)
{
    /* header 64 + seq_lens A(4*3)=64 + ids A(4*10)=64 + mask A(10)=64 + 2 x A(10*8*2)=192 */
    T_EQ_INT(dfl_batch_payload_size(10, 3, 2, 8, DFL_BF16), 64 + 64 + 64 + 64 + 2 * 192, "size");
    T_EQ_INT(dfl_batch_payload_size(10, 3, 0, 0, DFL_DT_INVALID), 256, "tokens size");
    T_EQ_INT(dfl_batch_payload_size(16384, 64, 5, 4096, DFL_BF16), 64 + 256 + 65536 + 16384 + 5ull * 16384 * 4096 * 2,
             "big size");
    T_EQ_INT(dfl_batch_payload_size(1ull << 40, 1, 64, 1u << 31, DFL_F32), 0, "overflow");
    T_EQ_INT(dfl_batch_payload_size(10, 3, 1, 8, DFL_DT_INVALID), 0, "no dtype");
    char hex[33];
    dfl_fingerprint_hex("abc", 3, hex);
    T_CHECK(strlen(hex) == 32 && strspn(hex, "0123456789abcdef") == 32, "fingerprint %s", hex);
    char hex2[33];
    dfl_fingerprint_hex("abd", 3, hex2);
    T_CHECK(strcmp(hex, hex2) != 0, "fingerprints differ");
    dfl_batch b;
    dfl_err e;
    T_CHECK(dfl_batch_alloc(&b, 5, 6, 0, 0, DFL_DT_INVALID, &e) == DFL_EUSAGE, "more sequences than tokens");
    T_CHECK(dfl_batch_alloc(&b, 5, 2, 1, 8, DFL_I8, &e) == DFL_EUSAGE, "i8 layers");
    T_CHECK(dfl_batch_alloc(&b, 100, 2, 3, 8, DFL_F32, &e) == 0, "alloc");
    T_CHECK(b.owned && aligned64(b.seq_lens) && aligned64(b.input_ids) && aligned64(b.loss_mask) &&
                aligned64(b.layers[0]) && aligned64(b.layers[2]) && b.layers[3] == NULL, "alloc pointers");
    dfl_batch_free(&b);
    dfl_batch_free(&b); /* a zeroed batch */
    /* contents are zero, small and large (a large block comes from fresh pages) */
    for (int big = 0; big <= 1; big++) {
        uint64_t T = big ? 5000 : 37;
        if (dfl_batch_alloc(&b, T, 3, 2, 1024, DFL_BF16, &e)) {
            T_CHECK(0, "alloc: %s", e.msg);
            continue;
        }
        bool zero = true;
        for (uint32_t i = 0; i < 3; i++)
            zero &= b.seq_lens[i] == 0;
        for (uint64_t i = 0; i < T; i++)
            zero &= b.input_ids[i] == 0 && b.loss_mask[i] == 0;
        for (int k = 0; k < 2; k++) {
            const uint8_t *l = b.layers[k];
            for (uint64_t i = 0; i < T * 1024 * 2; i++)
                zero &= l[i] == 0;
        }
        T_CHECK(zero, "batch_alloc contents not zero (T %llu)", (unsigned long long)T);
        T_CHECK(aligned64(b.layers[1]), "alignment");
        dfl_batch_free(&b);
    }
}

static void test_type_names(void)
{
    static const char *const names[] = {NULL, "HEADER", "TOKENS", "HIDDEN", "INDEX", "END", "NOTE", NULL};
    for (uint32_t t = 0; t < DFL_ARRAY_LEN(names); t++) {
        const char *n = dfl_frame_type_name(t);
        T_CHECK(names[t] ? n && strcmp(n, names[t]) == 0 : n == NULL, "type %u: %s", t, n ? n : "NULL");
    }
    T_CHECK(dfl_frame_type_name(1000) == NULL, "an unassigned type has no name");
}

int main(int argc, char **argv)
{
    (void)argc;
    t_init(argv[0]);
    T_RUN(test_type_names);
    T_RUN(test_payload_size);
    T_RUN(test_roundtrip_file);
    T_RUN(test_roundtrip_pipe);
    T_RUN(test_large_batch);
    T_RUN(test_index);
    T_RUN(test_listing);
    T_RUN(test_determinism);
    T_RUN(test_truncation);
    T_RUN(test_bit_flips);
    T_RUN(test_defects);
    T_RUN(test_header_json);
    T_RUN(test_writer_files);
    T_RUN(test_corpus);
    T_RUN(test_man_example);
    return t_done();
}
