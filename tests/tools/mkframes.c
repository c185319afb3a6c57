/* mkframes.c: writes the corpus of bad .dfl streams (one small file per defect, named for it) and
 * a few good example streams, from a fixed seed (same bytes every run).
 *
 *   build/tools/mkframes tests/bad/frame tests/fixtures/frame [tests/fixtures/draft/target]
 *
 * The third argument (by default BAD_DIR/../../fixtures/draft/target) is the target model of
 * dfl-draft's tests: the *-indexed streams are hidden states for it (its fingerprint, hidden
 * size and vocabulary, layers 1 and 2), files with an INDEX that dfl-draft would train on but for
 * their one defect, so that its tests can read each one through the INDEX (a file), as a stream
 * (a pipe) and under dfl-ckpt --verify; their good base is GOOD_DIR/hidden-draft.dfl.
 *
 * A bad file's name says how a reader must reject it: trunc-*.dfl is truncated (DFL_ETRUNC),
 * unsup-*.dfl uses what version 1 does not know (DFL_EUNSUP), every other one is invalid data
 * (DFL_EDATA); tests/unit/test-frame.c checks each one through a file and a pipe. Each directory
 * also gets a README listing its files. Existing *.dfl files in both directories are replaced. */
#include <dirent.h>
#include <errno.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/stat.h>
#include <unistd.h>
#include <zstd.h>

#include "frame.h"
#include "hfmodel.h"
#include "util.h"
#include "framecraft.h"
#include "frame-example.h"

static const char *bad_dir, *good_dir;
static FILE *bad_readme, *good_readme;
static int n_written;

static void die(const char *what, const dfl_err *e)
{
    fprintf(stderr, "mkframes: %s: %s\n", what, e ? e->msg : strerror(errno));
    exit(1);
}

static void put_file(const char *dir, const char *name, const uint8_t *p, size_t n)
{
    char *path = dfl_path_join(dir, name);
    dfl_err e;
    if (!path || dfl_write_file_atomic(path, p, n, &e))
        die(name, &e);
    free(path);
    n_written++;
}

static void bad(const char *name, const fc_buf *b, const char *what)
{
    put_file(bad_dir, name, b->p, b->n);
    fprintf(bad_readme, "%-32s %s\n", name, what);
}

static uint64_t rng(uint64_t *s)
{
    *s += 0x9e3779b97f4a7c15ull;
    uint64_t z = *s;
    z = (z ^ (z >> 30)) * 0xbf58476d1ce4e5b9ull;
    z = (z ^ (z >> 27)) * 0x94d049bb133111ebull;
    return z ^ (z >> 31);
}

/* A small batch: 1..3 sequences of 1..6 tokens; layer values from a small set (compressible). */
static void gen_batch(dfl_batch *b, const dfl_stream_info *in, uint64_t seed)
{
    uint64_t s = seed;
    uint32_t S = 1 + (uint32_t)(rng(&s) % 3), lens[3];
    uint64_t T = 0;
    for (uint32_t i = 0; i < S; i++)
        T += lens[i] = 1 + (uint32_t)(rng(&s) % 6);
    bool hid = in->kind == DFL_KIND_HIDDEN;
    dfl_err e;
    if (dfl_batch_alloc(b, T, S, hid ? (uint32_t)in->n_layers : 0, hid ? (uint32_t)in->hidden_size : 0,
                        hid ? in->dtype : DFL_DT_INVALID, &e))
        die("batch", &e);
    memcpy((void *)b->seq_lens, lens, 4 * S);
    for (uint64_t i = 0; i < T; i++) {
        ((int32_t *)b->input_ids)[i] = (int32_t)(rng(&s) % 1000);
        ((uint8_t *)b->loss_mask)[i] = (uint8_t)(i % 4 != 0);
    }
    for (uint32_t k = 0; k < b->n_layers; k++) {
        size_t n = (size_t)T * b->hidden;
        for (size_t i = 0; i < n; i++) {
            fc_store_f32((void *)b->layers[k], in->dtype, i, (float)((int)(rng(&s) % 16) - 8) / 4.0f);
        }
    }
}

static void info_tokens(dfl_stream_info *in)
{
    memset(in, 0, sizeof *in);
    in->kind = DFL_KIND_TOKENS;
    snprintf(in->producer, sizeof in->producer, "mkframes 0.1.0");
    in->vocab_size = 1000;
}

static void info_hidden(dfl_stream_info *in, dfl_dtype dt, int64_t hidden)
{
    memset(in, 0, sizeof *in);
    in->kind = DFL_KIND_HIDDEN;
    snprintf(in->producer, sizeof in->producer, "mkframes 0.1.0");
    in->vocab_size = 1000;
    in->hidden_size = hidden;
    in->n_layers = 2;
    in->layers[0] = 1;
    in->layers[1] = 5;
    in->dtype = dt;
    dfl_fingerprint_hex("mkframes target", 15, in->fingerprint);
}

/* A stream written by libdfl: n batches from seed, a NOTE after batch note_after (if >= 0). */
static void make_stream_with(fc_buf *out, const dfl_stream_info *in, int n, uint64_t seed, int zstd_level, bool index,
                             int note_after, void (*gen)(dfl_batch *, const dfl_stream_info *, uint64_t))
{
    char *path = dfl_path_join(bad_dir, ".mkframes.tmp");
    dfl_writer_opts o = {.zstd_level = zstd_level, .no_index = !index};
    dfl_writer *w;
    dfl_err e;
    if (!path || dfl_writer_open(&w, path, in, &o, &e))
        die("writer", &e);
    for (int i = 0; i < n; i++) {
        dfl_batch b;
        gen(&b, in, seed * 100 + (uint64_t)i);
        if (dfl_writer_batch(w, &b, &e))
            die("batch", &e);
        dfl_batch_free(&b);
        if (i == note_after) {
            json_t *note = json_pack("{s:s,s:i}", "event", "example", "after_batch", i);
            if (dfl_writer_note(w, note, &e))
                die("note", &e);
            json_decref(note);
        }
    }
    if (dfl_writer_close(w, &e))
        die("close", &e);
    char *s;
    size_t len;
    if (dfl_read_file(path, 1u << 26, &s, &len, &e))
        die("read back", &e);
    unlink(path);
    free(path);
    out->n = 0;
    fc_append(out, s, len);
    free(s);
}

static void make_stream(fc_buf *out, const dfl_stream_info *in, int n, uint64_t seed, int zstd_level, bool index,
                        int note_after)
{
    make_stream_with(out, in, n, seed, zstd_level, index, note_after, gen_batch);
}

/* A batch for the dfl-draft fixture target: 2 sequences of 24 tokens that follow
 * t[i+1] = (5 t[i] + 3) mod (V - 1) (the rule of tests/tools/draftdata.c: the mask token V - 1
 * never occurs), the first 2 tokens of each unscored, layer values in [-1, 1]. */
static void gen_draft_batch(dfl_batch *b, const dfl_stream_info *in, uint64_t seed)
{
    uint64_t s = seed;
    dfl_err e;
    if (dfl_batch_alloc(b, 48, 2, (uint32_t)in->n_layers, (uint32_t)in->hidden_size, in->dtype, &e))
        die("batch", &e);
    int32_t *ids = (int32_t *)b->input_ids;
    uint8_t *mask = (uint8_t *)b->loss_mask;
    for (uint32_t q = 0; q < 2; q++) {
        ((uint32_t *)b->seq_lens)[q] = 24;
        int32_t t = (int32_t)(rng(&s) % (uint64_t)(in->vocab_size - 1));
        for (int i = 0; i < 24; i++) {
            ids[24 * q + (uint32_t)i] = t;
            mask[24 * q + (uint32_t)i] = i >= 2;
            t = (int32_t)((5 * (int64_t)t + 3) % (in->vocab_size - 1));
        }
    }
    for (uint32_t k = 0; k < b->n_layers; k++)
        for (size_t i = 0; i < 48 * (size_t)in->hidden_size; i++)
            ((uint16_t *)b->layers[k])[i] = dfl_f32_to_bf16((float)((int)(rng(&s) % 17) - 8) / 8.0f);
}

/* Offset of frame number k. */
static size_t frame_off(const fc_buf *b, int k)
{
    size_t offs[256];
    int n = fc_list(b->p, b->n, offs, 256);
    if (k >= n) {
        fprintf(stderr, "mkframes: no frame %d\n", k);
        exit(1);
    }
    return offs[k];
}

/* The stream with its HEADER frame replaced by one holding json (streams without an INDEX). */
static void with_header(fc_buf *out, const fc_buf *base, const char *json)
{
    size_t h1 = frame_off(base, 1);
    out->n = 0;
    fc_frame(out, DFL_FT_HEADER, 0, 0, json, strlen(json), strlen(json));
    fc_append(out, base->p + h1, base->n - h1);
}

/* The frame k replaced by a frame of the given type, flags and payload (streams without INDEX). */
static void with_frame(fc_buf *out, const fc_buf *base, int k, uint16_t type, uint8_t flags, const void *payload,
                       size_t stored, size_t raw)
{
    size_t a = frame_off(base, k), b = a + (size_t)fc_total(base->p + a);
    out->n = 0;
    fc_append(out, base->p, a);
    fc_frame(out, type, flags, (uint64_t)k, payload, stored, raw);
    fc_append(out, base->p + b, base->n - b);
}

/* base (a stream with an INDEX) with n bytes of frames inserted at offset at, renumbered, its
 * INDEX and END rewritten to agree. */
static void with_inserted(fc_buf *out, const fc_buf *base, size_t at, const uint8_t *frames, size_t n)
{
    fc_copy(out, base->p, base->n);
    fc_insert(out, at, frames, n);
    fc_renumber(out->p, out->n);
    fc_reindex(out->p, out->n);
}

static void clean_dir(const char *dir)
{
    DIR *d = opendir(dir);
    if (!d)
        die(dir, NULL);
    struct dirent *de;
    while ((de = readdir(d))) {
        size_t n = strlen(de->d_name);
        if (n > 4 && strcmp(de->d_name + n - 4, ".dfl") == 0) {
            char *p = dfl_path_join(dir, de->d_name);
            unlink(p);
            free(p);
        }
    }
    closedir(d);
}

/* Payload offsets inside a small batch frame at off. */
typedef struct bpos {
    uint8_t *pay;
    uint64_t T;
    uint32_t S;
    size_t o_ids, o_mask, o_layer0;
} bpos;

static bpos batch_at(fc_buf *b, size_t off)
{
    bpos p;
    p.pay = b->p + off + 64;
    p.T = fc_get64(p.pay + 8);
    p.S = fc_get32(p.pay + 16);
    p.o_ids = 64 + DFL_ALIGN_UP(4 * p.S, 64);
    p.o_mask = p.o_ids + DFL_ALIGN_UP(4 * p.T, 64);
    p.o_layer0 = p.o_mask + DFL_ALIGN_UP(p.T, 64);
    return p;
}

/* A good stream (make_stream's arguments) into good_dir, listed in its README. */
static void good(fc_buf *g, const char *name, const dfl_stream_info *in, int n, uint64_t seed, int zstd_level,
                 bool index, int note_after, const char *what)
{
    make_stream(g, in, n, seed, zstd_level, index, note_after);
    put_file(good_dir, name, g->p, g->n);
    fprintf(good_readme, "%-24s %s\n", name, what);
}

int main(int argc, char **argv)
{
    if (argc != 3 && argc != 4) {
        fprintf(stderr, "usage: mkframes BAD_DIR GOOD_DIR [DRAFT_TARGET_DIR]\n");
        return 1;
    }
    bad_dir = argv[1];
    good_dir = argv[2];
    dfl_err e;
    /* the dfl-draft fixture target, read before anything is removed */
    char *draft_dir = argc == 4 ? dfl_strdup(argv[3]) : dfl_path_join(bad_dir, "../../fixtures/draft/target");
    dfl_hf_config tc;
    dfl_stream_info drf;
    memset(&drf, 0, sizeof drf);
    if (!draft_dir || dfl_hf_config_load(draft_dir, &tc, NULL, &e) || dfl_hf_fingerprint(draft_dir, drf.fingerprint, &e))
        die("the dfl-draft fixture target", &e);
    free(draft_dir);
    drf.kind = DFL_KIND_HIDDEN;
    snprintf(drf.producer, sizeof drf.producer, "mkframes 0.1.0");
    drf.vocab_size = tc.vocab_size;
    drf.hidden_size = tc.hidden_size;
    drf.n_layers = 2;
    drf.layers[0] = 1;
    drf.layers[1] = 2;
    drf.dtype = DFL_BF16;
    if (dfl_mkdir_p(bad_dir, 0755, &e) || dfl_mkdir_p(good_dir, 0755, &e))
        die("mkdir", &e);
    clean_dir(bad_dir);
    clean_dir(good_dir);
    char *rp = dfl_path_join(bad_dir, "README");
    bad_readme = fopen(rp, "w");
    free(rp);
    rp = dfl_path_join(good_dir, "README");
    good_readme = fopen(rp, "w");
    free(rp);
    if (!bad_readme || !good_readme)
        die("README", NULL);
    fprintf(bad_readme, "Bad .dfl streams, one defect each, written by tests/tools/mkframes.c (do not edit).\n"
                        "trunc-*: truncated (DFL_ETRUNC); unsup-*: unsupported (DFL_EUNSUP); others: invalid data (DFL_EDATA).\n\n");
    fprintf(good_readme, "Good .dfl streams, written by tests/tools/mkframes.c with libdfl (do not edit).\n\n");

    dfl_stream_info tok, hid, hid32, hid16;
    info_tokens(&tok);
    info_hidden(&hid, DFL_BF16, 8);
    info_hidden(&hid32, DFL_F32, 8);
    info_hidden(&hid16, DFL_F16, 8);

    /* ---- good examples ---- */
    fc_buf g = {0};
    good(&g, "tokens.dfl", &tok, 3, 1, 0, true, -1, "tokens stream, 3 batches, vocab 1000, INDEX (as written to a file)");
    good(&g, "tokens-pipe.dfl", &tok, 3, 2, 0, false, 1, "tokens stream, 3 batches, a NOTE, no INDEX (as written to a pipe)");
    good(&g, "hidden-bf16.dfl", &hid, 3, 3, 0, true, -1, "hidden stream, bf16, layers [1, 5], hidden 8, 3 batches, INDEX");
    good(&g, "hidden-f16.dfl", &hid16, 2, 4, 0, true, -1, "hidden stream, f16, 2 batches, INDEX");
    good(&g, "hidden-f32.dfl", &hid32, 2, 5, 0, true, -1, "hidden stream, f32, 2 batches, INDEX");
    good(&g, "hidden-zstd.dfl", &hid, 3, 6, 19, true, -1, "hidden stream, bf16, 3 batches compressed (zstd 19, shuffle 2), INDEX");
    good(&g, "hidden-f32-zstd.dfl", &hid32, 2, 7, 19, true, -1, "hidden stream, f32, 2 batches compressed (zstd 19, shuffle 4), INDEX");

    fc_buf dg = {0}; /* the base of the *-indexed bad streams */
    make_stream_with(&dg, &drf, 4, 8, 0, true, -1, gen_draft_batch);
    put_file(good_dir, "hidden-draft.dfl", dg.p, dg.n);
    fprintf(good_readme, "%-24s hidden stream for tests/fixtures/draft/target, bf16, layers [1, 2], 4 batches, INDEX\n",
            "hidden-draft.dfl");

    /* the EXAMPLE of dfl-frame(5): one batch of sequences of 3 and 2 tokens */
    {
        char *path = dfl_path_join(good_dir, "example.dfl");
        if (write_frame_example(path, &e))
            die("example", &e);
        free(path);
        n_written++;
        fprintf(good_readme, "%-24s the EXAMPLE of dfl-frame(5), byte for byte\n", "example.dfl");
    }

    /* ---- bases for the bad ones ---- */
    fc_buf t = {0}, ti = {0}, h = {0}, hz = {0}, d = {0};
    make_stream(&t, &tok, 3, 12, 0, false, -1);  /* HEADER, 3 TOKENS, END */
    make_stream(&ti, &tok, 3, 12, 0, true, -1);  /* HEADER, 3 TOKENS, INDEX, END */
    make_stream(&h, &hid, 2, 12, 0, false, -1);  /* HEADER, 2 HIDDEN, END */
    make_stream(&hz, &hid, 2, 13, 19, false, -1); /* compressed */
    size_t t1 = frame_off(&t, 1), t2 = frame_off(&t, 2), tend = frame_off(&t, 4);
    size_t ti_idx = frame_off(&ti, 4), ti_end = frame_off(&ti, 5);
    size_t h1 = frame_off(&h, 1), hz1 = frame_off(&hz, 1);

    /* truncated */
    d.n = 0;
    bad("trunc-empty.dfl", &d, "no bytes at all");
    fc_copy(&d, t.p, 30);
    bad("trunc-header-part.dfl", &d, "30 bytes of a HEADER frame");
    fc_copy(&d, t.p, t1);
    bad("trunc-header-only.dfl", &d, "a HEADER frame and nothing after it");
    fc_copy(&d, t.p, tend);
    bad("trunc-no-end.dfl", &d, "every batch, no END frame");
    fc_copy(&d, t.p, t2 + 100);
    bad("trunc-inside-batch.dfl", &d, "cut 100 bytes into the second batch frame");
    fc_copy(&d, t.p, t.n - 8);
    bad("trunc-inside-end.dfl", &d, "END frame without its trailer");
    fc_copy(&d, ti.p, ti_end);
    bad("trunc-after-index.dfl", &d, "cut after the INDEX frame, before END");
    fc_copy(&d, t.p, t.n);
    fc_put64(d.p + t2 + 8, 1u << 20);
    fc_put64(d.p + t2 + 16, 1u << 20);
    fc_refix_header(d.p, t2);
    bad("trunc-length-past-end.dfl", &d, "a batch frame claiming 1 MiB, more than the stream holds (valid header check)");

    /* unsupported */
    fc_copy(&d, t.p, t.n);
    d.p[4] = 2;
    fc_refix(d.p, 0);
    bad("unsup-major-version.dfl", &d, "format major version 2 in the HEADER frame");
    {
        uint8_t pl[40];
        memset(pl, 0x11, sizeof pl);
        fc_with_frame(&d, t.p, t.n, t2, 1000, 0, pl, sizeof pl, sizeof pl);
        bad("unsup-frame-type.dfl", &d, "a must-understand frame of unassigned type 1000");
    }

    /* frame structure */
    fc_copy(&d, t.p, t.n);
    d.p[0] = 0x88;
    bad("bad-magic.dfl", &d, "first byte of the magic changed");
    {
        const char *text = "{\"format\": \"dfl\", \"this\": \"is JSON, not a stream\"}\n";
        d.n = 0;
        fc_append(&d, text, strlen(text));
        bad("bad-magic-text.dfl", &d, "a text file");
    }
    fc_copy(&d, t.p, t.n);
    d.p[t2] = 0;
    bad("bad-magic-mid.dfl", &d, "the magic of the second batch frame damaged");
    fc_copy(&d, t.p, t.n);
    d.p[t1 + 9] ^= 0x01;
    bad("header-check.dfl", &d, "stored_len of a batch frame changed, header check not updated");
    fc_copy(&d, t.p, t.n);
    d.p[t1 + 64 + 70] ^= 0x40;
    bad("checksum-payload.dfl", &d, "one bit of a batch payload flipped");
    fc_copy(&d, t.p, t.n);
    d.p[t1 + fc_total(t.p + t1) - 1] ^= 0x80;
    bad("checksum-trailer.dfl", &d, "one bit of a trailer flipped");
    fc_copy(&d, t.p, t.n);
    d.p[t1 + 5] |= 0x10;
    fc_refix(d.p, t1);
    bad("reserved-flag.dfl", &d, "reserved flag bit 4 set (checks updated)");
    fc_copy(&d, t.p, t.n);
    d.p[t1 + 47] = 1;
    fc_refix(d.p, t1);
    bad("reserved-header-bytes.dfl", &d, "a reserved frame header byte set");
    fc_copy(&d, t.p, t.n);
    fc_put16(d.p + t1 + 6, 0);
    fc_refix(d.p, t1);
    bad("type-zero.dfl", &d, "a frame of type 0");
    fc_copy(&d, t.p, t.n);
    d.p[t1 + 5] |= DFL_FF_SKIPPABLE;
    fc_refix(d.p, t1);
    bad("tokens-skippable.dfl", &d, "a TOKENS frame marked skippable");
    fc_copy(&d, ti.p, ti.n);
    d.p[ti_idx + 5] &= (uint8_t)~DFL_FF_SKIPPABLE;
    fc_refix(d.p, ti_idx);
    bad("index-not-skippable.dfl", &d, "an INDEX frame without the skippable flag");
    fc_copy(&d, t.p, t.n);
    d.p[5] |= DFL_FF_ZSTD;
    fc_refix(d.p, 0);
    bad("header-compressed.dfl", &d, "the HEADER frame marked compressed");
    fc_copy(&d, t.p, t.n);
    d.p[t1 + 5] |= DFL_FF_SHUFFLE2;
    fc_refix(d.p, t1);
    bad("shuffle-without-zstd.dfl", &d, "shuffle flag without the zstd flag");
    fc_copy(&d, hz.p, hz.n);
    d.p[hz1 + 5] |= DFL_FF_SHUFFLE4;
    fc_refix(d.p, hz1);
    bad("shuffle-both.dfl", &d, "both shuffle flags");
    fc_copy(&d, t.p, t.n);
    fc_put64(d.p + t1 + 16, fc_get64(d.p + t1 + 16) + 64);
    fc_refix(d.p, t1);
    bad("raw-len-uncompressed.dfl", &d, "raw_len != stored_len in an uncompressed frame");
    fc_copy(&d, t.p, t.n);
    fc_put64(d.p + t1 + 8, 1ull << 50);
    fc_put64(d.p + t1 + 16, 1ull << 50);
    fc_refix_header(d.p, t1);
    bad("huge-length.dfl", &d, "a batch frame claiming 2^50 bytes (valid header check): over the limit");
    fc_copy(&d, t.p, t.n);
    fc_put64(d.p + t2 + 24, 3);
    fc_refix(d.p, t2);
    bad("seq-gap.dfl", &d, "frame numbers 0, 1, 3");
    fc_copy(&d, t.p, t.n);
    fc_put64(d.p + t2 + 24, 1);
    fc_refix(d.p, t2);
    bad("seq-repeat.dfl", &d, "frame number 1 twice");
    fc_copy(&d, t.p, t.n);
    d.p[t1 + fc_total(t.p + t1) - 9] = 0xff; /* last padding byte before the trailer */
    fc_refix(d.p, t1);
    if (fc_get64(t.p + t1 + 8) % 64 == 56)
        return fprintf(stderr, "mkframes: no frame padding to damage\n"), 1;
    bad("frame-padding.dfl", &d, "a non-zero frame padding byte (checks updated)");

    /* stream structure */
    fc_copy(&d, t.p + t1, t.n - t1);
    fc_renumber(d.p, d.n);
    bad("first-not-header.dfl", &d, "a stream that starts with a TOKENS frame");
    fc_with_bytes(&d, t.p, t.n, t2, t.p, t1);
    bad("header-twice.dfl", &d, "a second HEADER frame between batches");
    fc_with_bytes(&d, t.p, t.n, t1, h.p + h1, (size_t)fc_total(h.p + h1));
    bad("batch-wrong-kind.dfl", &d, "a HIDDEN frame in a tokens stream");
    {
        const char *note = "{\"after\":\"index\"}";
        fc_with_frame(&d, ti.p, ti.n, ti_end, DFL_FT_NOTE, DFL_FF_SKIPPABLE, note, strlen(note), strlen(note));
        bad("index-not-last.dfl", &d, "a NOTE frame between INDEX and END");
    }

    /* HEADER contents */
    static const struct { const char *name, *json, *what; } hdrs[] = {
        {"header-not-json.dfl", "{\"format\":\"dfl\",", "HEADER payload is not JSON"},
        {"header-not-object.dfl", "[\"dfl\",1]", "HEADER payload is a JSON array"},
        {"header-format.dfl", "{\"format\":\"zip\",\"kind\":\"tokens\",\"producer\":\"x\",\"version\":[1,0]}", "\"format\" is not \"dfl\""},
        {"header-no-kind.dfl", "{\"format\":\"dfl\",\"producer\":\"x\",\"version\":[1,0]}", "no \"kind\""},
        {"header-kind.dfl", "{\"format\":\"dfl\",\"kind\":\"images\",\"producer\":\"x\",\"version\":[1,0]}", "unknown \"kind\""},
        {"header-version.dfl", "{\"format\":\"dfl\",\"kind\":\"tokens\",\"producer\":\"x\",\"version\":[2,0]}", "\"version\" major 2 in version 1 frames"},
        {"header-version-shape.dfl", "{\"format\":\"dfl\",\"kind\":\"tokens\",\"producer\":\"x\",\"version\":\"1.0\"}", "\"version\" is not [major, minor]"},
        {"header-no-producer.dfl", "{\"format\":\"dfl\",\"kind\":\"tokens\",\"version\":[1,0]}", "no \"producer\""},
        {"header-duplicate-key.dfl", "{\"format\":\"dfl\",\"kind\":\"tokens\",\"kind\":\"tokens\",\"producer\":\"x\",\"version\":[1,0]}", "a key twice"},
        {"header-vocab-zero.dfl", "{\"format\":\"dfl\",\"kind\":\"tokens\",\"producer\":\"x\",\"version\":[1,0],\"vocab_size\":0}", "\"vocab_size\" 0"},
        {"header-tokens-dtype.dfl", "{\"dtype\":\"bf16\",\"format\":\"dfl\",\"kind\":\"tokens\",\"producer\":\"x\",\"version\":[1,0]}", "a tokens stream with \"dtype\""},
        {"header-vocab-real.dfl", "{\"format\":\"dfl\",\"kind\":\"tokens\",\"producer\":\"x\",\"version\":[1,0],\"vocab_size\":1000.0}", "\"vocab_size\" written 1000.0 (integers are integer tokens)"},
        {"header-vocab-exponent.dfl", "{\"format\":\"dfl\",\"kind\":\"tokens\",\"producer\":\"x\",\"version\":[1,0],\"vocab_size\":1e3}", "\"vocab_size\" written 1e3"},
        {"header-vocab-null.dfl", "{\"format\":\"dfl\",\"kind\":\"tokens\",\"producer\":\"x\",\"version\":[1,0],\"vocab_size\":null}", "\"vocab_size\" null (an optional key is left out, never null)"},
        {"header-fingerprint-null.dfl", "{\"fingerprint\":null,\"format\":\"dfl\",\"kind\":\"tokens\",\"producer\":\"x\",\"version\":[1,0]}", "\"fingerprint\" null"},
        {"header-meta-null.dfl", "{\"format\":\"dfl\",\"kind\":\"tokens\",\"meta\":null,\"producer\":\"x\",\"version\":[1,0]}", "\"meta\" null"},
        {"header-minor-too-big.dfl", "{\"format\":\"dfl\",\"kind\":\"tokens\",\"producer\":\"x\",\"version\":[1,9223372036854775808]}", "minor version 2^63 (integers are within int64)"},
        {"header-bom.dfl", "\xef\xbb\xbf{\"format\":\"dfl\",\"kind\":\"tokens\",\"producer\":\"x\",\"version\":[1,0]}", "a byte order mark before the HEADER object"},
        {"header-escaped-nul.dfl", "{\"format\":\"dfl\",\"kind\":\"tokens\",\"producer\":\"x\\u0000y\",\"version\":[1,0]}", "\\u0000 in a HEADER string"},
        {"header-lone-surrogate.dfl", "{\"format\":\"dfl\",\"kind\":\"tokens\",\"producer\":\"x\\ud800\",\"version\":[1,0]}", "a lone surrogate \\ud800 in a HEADER string"},
        {"header-producer-long.dfl", "{\"format\":\"dfl\",\"kind\":\"tokens\",\"producer\":\"xxxxxxxxxxxxxxxxxxxxxxxxxxxxxxxxxxxxxxxxxxxxxxxxxxxxxxxxxxxxxxxxxxxxxxxxxxxxxxxxxxxxxxxxxxxxxxxxxxxxxxxxxxxxxxxxxxxxxxxxxxxxxxxx\",\"version\":[1,0]}", "\"producer\" of 128 bytes"},
    };
    for (size_t i = 0; i < sizeof hdrs / sizeof hdrs[0]; i++) {
        with_header(&d, &t, hdrs[i].json);
        bad(hdrs[i].name, &d, hdrs[i].what);
    }
    static const struct { const char *name, *json, *what; } hhdrs[] = {
        {"header-hidden-no-layers.dfl", "{\"dtype\":\"bf16\",\"format\":\"dfl\",\"hidden_size\":8,\"kind\":\"hidden\",\"producer\":\"x\",\"version\":[1,0]}", "a hidden stream without \"layers\""},
        {"header-hidden-layers-twice.dfl", "{\"dtype\":\"bf16\",\"format\":\"dfl\",\"hidden_size\":8,\"kind\":\"hidden\",\"layers\":[5,5],\"producer\":\"x\",\"version\":[1,0]}", "a layer id listed twice"},
        {"header-hidden-layer-negative.dfl", "{\"dtype\":\"bf16\",\"format\":\"dfl\",\"hidden_size\":8,\"kind\":\"hidden\",\"layers\":[1,-5],\"producer\":\"x\",\"version\":[1,0]}", "a negative layer id"},
        {"header-hidden-dtype.dfl", "{\"dtype\":\"i8\",\"format\":\"dfl\",\"hidden_size\":8,\"kind\":\"hidden\",\"layers\":[1,5],\"producer\":\"x\",\"version\":[1,0]}", "\"dtype\" i8"},
        {"header-hidden-size.dfl", "{\"dtype\":\"bf16\",\"format\":\"dfl\",\"hidden_size\":0,\"kind\":\"hidden\",\"layers\":[1,5],\"producer\":\"x\",\"version\":[1,0]}", "\"hidden_size\" 0"},
        {"header-hidden-size-real.dfl", "{\"dtype\":\"bf16\",\"format\":\"dfl\",\"hidden_size\":8.0,\"kind\":\"hidden\",\"layers\":[1,5],\"producer\":\"x\",\"version\":[1,0]}", "\"hidden_size\" written 8.0"},
    };
    for (size_t i = 0; i < sizeof hhdrs / sizeof hhdrs[0]; i++) {
        with_header(&d, &h, hhdrs[i].json);
        bad(hhdrs[i].name, &d, hhdrs[i].what);
    }

    /* batch contents (checks updated, so only the contents are wrong) */
    bpos p;
#define EDIT_T(off)                                                                                    \
    do {                                                                                               \
        fc_copy(&d, t.p, t.n);                                                                         \
        p = batch_at(&d, off);                                                                         \
    } while (0)
    EDIT_T(t2);
    fc_put64(p.pay, 7);
    fc_refix(d.p, t2);
    bad("batch-index.dfl", &d, "the second batch says it is batch 7");
    EDIT_T(t1);
    fc_put64(p.pay + 8, 0);
    fc_refix(d.p, t1);
    bad("batch-no-tokens.dfl", &d, "n_tokens 0");
    EDIT_T(t1);
    fc_put32(p.pay + 16, 0);
    fc_refix(d.p, t1);
    bad("batch-no-seqs.dfl", &d, "n_seqs 0");
    EDIT_T(t1);
    fc_put64(p.pay + 8, p.T + 64);
    fc_refix(d.p, t1);
    bad("batch-size.dfl", &d, "n_tokens that does not match the payload size");
    EDIT_T(t1);
    p.pay[50] = 1;
    fc_refix(d.p, t1);
    bad("batch-reserved.dfl", &d, "a reserved batch header byte set");
    EDIT_T(t1);
    fc_put32(p.pay + 32, fc_get32(p.pay + 32) + 1);
    fc_refix(d.p, t1);
    bad("batch-max-len.dfl", &d, "max_len is not the longest sequence");
    EDIT_T(t1);
    fc_put32(p.pay + 64, fc_get32(p.pay + 64) + 1);
    fc_refix(d.p, t1);
    bad("seq-lens-sum.dfl", &d, "seq_lens do not sum to n_tokens");
    EDIT_T(t1);
    if (p.S < 2)
        return fprintf(stderr, "mkframes: first batch has one sequence\n"), 1;
    fc_put32(p.pay + 68, fc_get32(p.pay + 68) + fc_get32(p.pay + 64));
    fc_put32(p.pay + 64, 0);
    fc_refix(d.p, t1);
    bad("seq-len-zero.dfl", &d, "a sequence of length 0 (the sum kept)");
    EDIT_T(t1);
    p.pay[p.o_mask] = 2;
    fc_refix(d.p, t1);
    bad("loss-mask-2.dfl", &d, "a loss_mask value of 2");
    EDIT_T(t1);
    fc_put32(p.pay + p.o_ids, 0xffffffffu);
    fc_refix(d.p, t1);
    bad("input-id-negative.dfl", &d, "a token id of -1");
    EDIT_T(t1);
    fc_put32(p.pay + p.o_ids + 4 * (p.T - 1), 1000);
    fc_refix(d.p, t1);
    bad("input-id-vocab.dfl", &d, "a token id equal to vocab_size");
    EDIT_T(t1);
    p.pay[64 + 4 * p.S] = 1;
    fc_refix(d.p, t1);
    bad("section-padding.dfl", &d, "a non-zero padding byte after seq_lens");
    fc_copy(&d, h.p, h.n);
    p = batch_at(&d, h1);
    fc_put32(p.pay + 24, 4);
    fc_refix(d.p, h1);
    bad("hidden-size-mismatch.dfl", &d, "a hidden batch of hidden 4 in a hidden-8 stream");
    fc_copy(&d, h.p, h.n);
    p = batch_at(&d, h1);
    fc_put16(p.pay + 28, DFL_F16);
    fc_refix(d.p, h1);
    bad("hidden-dtype-mismatch.dfl", &d, "an f16 batch in a bf16 stream");
    fc_copy(&d, h.p, h.n);
    p = batch_at(&d, h1);
    fc_put32(p.pay + 20, 1);
    fc_refix(d.p, h1);
    bad("hidden-layers-mismatch.dfl", &d, "a batch of 1 layer in a 2-layer stream");
    fc_copy(&d, h.p, h.n);
    p = batch_at(&d, h1);
    p.pay[p.o_layer0 + 2 * p.T * 8] = 1; /* first padding byte after layer 0 (T*H*2 < 64*k) */
    fc_refix(d.p, h1);
    if ((2 * p.T * 8) % 64 == 0)
        return fprintf(stderr, "mkframes: layer has no padding\n"), 1;
    bad("layer-padding.dfl", &d, "a non-zero padding byte after a layer array");

    /* compression */
    {
        size_t raw = (size_t)fc_get64(h.p + h1 + 16);
        uint8_t junk[200];
        for (size_t i = 0; i < sizeof junk; i++)
            junk[i] = (uint8_t)(i * 37 + 11);
        with_frame(&d, &h, 1, DFL_FT_HIDDEN, DFL_FF_ZSTD, junk, sizeof junk, raw);
        bad("zstd-garbage.dfl", &d, "a compressed frame whose payload is not zstd");
        /* a valid zstd frame of the right payload, without its content size */
        const uint8_t *src = h.p + h1 + 64;
        size_t bound = ZSTD_compressBound(raw);
        uint8_t *z = malloc(bound + 16);
        ZSTD_CCtx *cc = ZSTD_createCCtx();
        ZSTD_CCtx_setParameter(cc, ZSTD_c_contentSizeFlag, 0);
        size_t zn = ZSTD_compress2(cc, z, bound, src, raw);
        if (ZSTD_isError(zn))
            return fprintf(stderr, "mkframes: zstd: %s\n", ZSTD_getErrorName(zn)), 1;
        with_frame(&d, &h, 1, DFL_FT_HIDDEN, DFL_FF_ZSTD, z, zn, raw);
        bad("zstd-no-content-size.dfl", &d, "a zstd frame without its content size");
        ZSTD_CCtx_reset(cc, ZSTD_reset_session_and_parameters);
        zn = ZSTD_compress2(cc, z, bound, src, raw);
        memcpy(z + zn, "\0\0\0\0\0\0\0\0", 8);
        with_frame(&d, &h, 1, DFL_FT_HIDDEN, DFL_FF_ZSTD, z, zn + 8, raw);
        bad("zstd-trailing.dfl", &d, "8 bytes after the zstd frame in a payload");
        with_frame(&d, &h, 1, DFL_FT_HIDDEN, DFL_FF_ZSTD, z, zn, raw + 64);
        bad("zstd-size.dfl", &d, "raw_len differs from the zstd content size");
        /* decompresses to a payload that fails the batch checks (mask value 2) */
        uint8_t *copy = malloc(raw);
        memcpy(copy, src, raw);
        bpos q = batch_at(&h, h1);
        copy[q.o_mask] = 2;
        ZSTD_CCtx_reset(cc, ZSTD_reset_session_and_parameters);
        zn = ZSTD_compress2(cc, z, bound, copy, raw);
        with_frame(&d, &h, 1, DFL_FT_HIDDEN, DFL_FF_ZSTD, z, zn, raw);
        bad("zstd-loss-mask-2.dfl", &d, "a compressed batch whose loss_mask holds a 2");
        free(copy);
        free(z);
        ZSTD_freeCCtx(cc);
    }

    /* INDEX and END */
    fc_copy(&d, ti.p, ti.n);
    fc_put64(d.p + ti_idx + 64, 2);
    fc_refix(d.p, ti_idx);
    bad("index-count.dfl", &d, "INDEX count 2 in a frame with room for 3");
    fc_copy(&d, ti.p, ti.n);
    fc_put64(d.p + ti_idx + 64 + 16 + 16, fc_get64(d.p + ti_idx + 64 + 16 + 16) + 64);
    fc_refix(d.p, ti_idx);
    bad("index-entry.dfl", &d, "an INDEX entry with a wrong offset");
    fc_copy(&d, ti.p, ti.n);
    d.p[ti_idx + 64 + 8] = 1;
    fc_refix(d.p, ti_idx);
    bad("index-reserved.dfl", &d, "INDEX reserved field set");
    fc_copy(&d, ti.p, ti.n);
    fc_put64(d.p + ti_end + 64 + 24, 0);
    fc_refix(d.p, ti_end);
    bad("end-index-offset.dfl", &d, "END says there is no INDEX, but there is one");
    fc_copy(&d, t.p, t.n);
    fc_put64(d.p + tend + 64 + 8, fc_get64(d.p + tend + 64 + 8) + 1);
    fc_refix(d.p, tend);
    bad("end-tokens.dfl", &d, "END n_tokens one more than the batches hold");
    fc_copy(&d, t.p, t.n);
    fc_put64(d.p + tend + 64, 2);
    fc_refix(d.p, tend);
    bad("end-batches.dfl", &d, "END n_batches 2 after 3 batches");
    fc_copy(&d, t.p, t.n);
    fc_put64(d.p + tend + 64 + 16, 0);
    fc_refix(d.p, tend);
    bad("end-seqs.dfl", &d, "END n_seqs 0");
    fc_copy(&d, t.p, t.n);
    fc_put64(d.p + tend + 64 + 32, 7);
    fc_refix(d.p, tend);
    bad("end-frames.dfl", &d, "END counts 7 frames before it");
    fc_copy(&d, t.p, t.n);
    d.p[tend + 64 + 60] = 1;
    fc_refix(d.p, tend);
    bad("end-reserved.dfl", &d, "END reserved bytes set");
    {
        uint8_t endp[128] = {0};
        memcpy(endp, t.p + tend + 64, 64);
        with_frame(&d, &t, 4, DFL_FT_END, 0, endp, 128, 128);
        bad("end-size.dfl", &d, "an END payload of 128 bytes");
    }
    fc_copy(&d, t.p, t.n);
    fc_append(&d, "\n", 1);
    bad("trailing-byte.dfl", &d, "one byte after END");
    fc_copy(&d, t.p, t.n);
    fc_append(&d, t.p + tend, 192);
    bad("trailing-end.dfl", &d, "a second END frame after END");
    fc_copy(&d, t.p, t.n);
    fc_append(&d, t.p, t.n);
    bad("two-streams.dfl", &d, "two streams one after the other");
    {
        const char *notes[2] = {"{\"a\":", "[1,2]"};
        const char *names[2] = {"note-not-json.dfl", "note-not-object.dfl"};
        const char *whats[2] = {"a NOTE whose payload is not JSON", "a NOTE holding a JSON array"};
        for (int i = 0; i < 2; i++) {
            fc_with_frame(&d, t.p, t.n, t2, DFL_FT_NOTE, DFL_FF_SKIPPABLE, notes[i], strlen(notes[i]),
                          strlen(notes[i]));
            bad(names[i], &d, whats[i]);
        }
    }
    fc_copy(&d, t.p, t.n);
    d.p[t2 + 4] = 2;
    fc_refix(d.p, t2);
    bad("major-version-mid.dfl", &d, "a batch frame of major version 2 in a version 1 stream");

    /* Random access: a file read through its INDEX gets the checks of a walk of the stream. Each
     * of these has an INDEX and an END that agree with it; only the one defect is wrong. Hidden
     * states for the dfl-draft fixture target, made from hidden-draft.dfl. */
    {
        size_t g1 = frame_off(&dg, 1), g2 = frame_off(&dg, 2);
        fc_buf fr = {0};
        uint8_t pl[40];
        memset(pl, 0x11, sizeof pl);
        fc_frame(&fr, 1000, 0, 0, pl, sizeof pl, sizeof pl);
        with_inserted(&d, &dg, g2, fr.p, fr.n);
        bad("unsup-frame-type-indexed.dfl", &d, "a must-understand frame of unassigned type 1000 (file with an INDEX)");
        fc_copy(&d, dg.p, dg.n);
        fc_put64(d.p + g2 + 64, 7);
        fc_refix(d.p, g2);
        bad("batch-index-indexed.dfl", &d, "the second batch says it is batch 7 (file with an INDEX)");
        with_inserted(&d, &dg, g2, dg.p, g1);
        bad("header-twice-indexed.dfl", &d, "a second HEADER frame between batches (file with an INDEX)");
        const char *note = "{\"a\":";
        fr.n = 0;
        fc_frame(&fr, DFL_FT_NOTE, DFL_FF_SKIPPABLE, 0, note, strlen(note), strlen(note));
        with_inserted(&d, &dg, g2, fr.p, fr.n);
        bad("note-not-json-indexed.dfl", &d, "a NOTE whose payload is not JSON (file with an INDEX)");
        /* frame numbers 0, 1, 3, 4, ...: every frame from the second batch on one too high */
        fc_copy(&d, dg.p, dg.n);
        size_t offs[64];
        int nf = fc_list(d.p, d.n, offs, 64);
        for (int i = 2; i < nf; i++) {
            fc_put64(d.p + offs[i] + 24, (uint64_t)i + 1);
            fc_refix(d.p, offs[i]);
        }
        fc_reindex(d.p, d.n);
        bad("seq-gap-indexed.dfl", &d, "frame numbers 0, 1, 3, 4, ... (file with an INDEX)");
        free(fr.p);
    }

    fclose(bad_readme);
    fclose(good_readme);
    free(g.p);
    free(t.p);
    free(ti.p);
    free(h.p);
    free(hz.p);
    free(dg.p);
    free(d.p);
    fprintf(stderr, "mkframes: wrote %d files\n", n_written);
    return 0;
}
