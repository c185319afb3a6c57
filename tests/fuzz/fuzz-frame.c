/* fuzz-frame.c: libFuzzer harness for the .dfl frame reader (lib/formats/frame.c).
 *
 * The input is a .dfl stream. Each input is read four times:
 *   1. as it is, from a mapped file;      2. as it is, through read(2) (a file read at an offset
 *      that is not a multiple of 64 is not mapped, so it takes the descriptor path);
 *   3. and 4. the same after "fixing" it: every frame header check and trailer checksum that can
 *      be found by walking the frames is recomputed, so that mutations get past the checksums and
 *      reach the checks behind them.
 * The two paths of each pair must agree (same error code, same batches): the reader promises to
 * behave identically on pipes and on mapped files. On a mapped file the INDEX and every batch it
 * lists are also read by random access, which must not accept what the stream refuses: when the
 * index and every batch read, the walk of the stream must succeed too (dfl-frame(5) "Random
 * access"). Every batch handed out is read in full, and checked against what the reader
 * promises (seq_lens sum to n_tokens, max_len, ids, mask). */
#include <stdbool.h>
#include <xxhash.h>

#include "frame.h"
#include "fuzz.h"

typedef struct outcome {
    int rc;
    uint64_t batches, tokens, seqs;
    bool eos, truncated;
    dfl_stream_end end;
} outcome;

static uint64_t get64(const uint8_t *p)
{
    uint64_t v = 0;
    for (int i = 7; i >= 0; i--)
        v = v << 8 | p[i];
    return v;
}

static void put64(uint8_t *p, uint64_t v)
{
    for (int i = 0; i < 8; i++)
        p[i] = (uint8_t)(v >> (8 * i));
}

/* Recomputes the header check and the trailer of every frame found by walking from offset 0. */
static void fix_checksums(uint8_t *d, size_t n)
{
    size_t pos = 0;
    while (n - pos >= 64 && memcmp(d + pos, DFL_FRAME_MAGIC, 4) == 0) {
        uint8_t *h = d + pos;
        put64(h + 56, XXH3_64bits(h, 56));
        uint64_t stored = get64(h + 8);
        if (stored > n)
            return;
        uint64_t pad = (64 - (stored + 8) % 64) % 64, total = 64 + stored + pad + 8;
        if (total > n - pos)
            return;
        put64(h + total - 8, XXH3_64bits(h, total - 8));
        pos += total;
    }
}

/* Checks what the reader promises about a batch it accepted, reading all of it. */
static void check_batch(const dfl_reader *r, const dfl_batch *b)
{
    const dfl_stream_info *in = dfl_reader_info(r);
    FZ_ASSERT(b->n_seqs >= 1 && b->n_tokens >= b->n_seqs, "batch %llu: %u seqs, %llu tokens",
              (unsigned long long)b->index, b->n_seqs, (unsigned long long)b->n_tokens);
    uint64_t sum = 0;
    uint32_t mx = 0;
    for (uint32_t i = 0; i < b->n_seqs; i++) {
        FZ_ASSERT(b->seq_lens[i] > 0, "zero-length sequence accepted");
        sum += b->seq_lens[i];
        mx = b->seq_lens[i] > mx ? b->seq_lens[i] : mx;
    }
    FZ_ASSERT(sum == b->n_tokens, "seq_lens sum %llu != n_tokens %llu", (unsigned long long)sum,
              (unsigned long long)b->n_tokens);
    FZ_ASSERT(mx == b->max_len, "max_len %u, longest %u", b->max_len, mx);
    for (uint64_t i = 0; i < b->n_tokens; i++) {
        FZ_ASSERT(b->input_ids[i] >= 0 && (in->vocab_size == 0 || b->input_ids[i] < in->vocab_size),
                  "id %d accepted (vocab %lld)", b->input_ids[i], (long long)in->vocab_size);
        FZ_ASSERT(b->loss_mask[i] <= 1, "mask %u accepted", b->loss_mask[i]);
    }
    if (in->kind == DFL_KIND_HIDDEN) {
        FZ_ASSERT(b->n_layers == (uint32_t)in->n_layers && b->hidden == (uint64_t)in->hidden_size &&
                      b->dtype == in->dtype, "batch shape differs from the header");
        for (uint32_t k = 0; k < b->n_layers; k++)
            fz_touch(b->layers[k], b->n_tokens * b->hidden * dfl_dtype_size(b->dtype));
    } else {
        FZ_ASSERT(b->n_layers == 0, "token batch with layers");
    }
}

static void check_info(const dfl_stream_info *in)
{
    FZ_ASSERT(in->kind == DFL_KIND_TOKENS || in->kind == DFL_KIND_HIDDEN, "kind %d", in->kind);
    FZ_ASSERT(memchr(in->producer, 0, sizeof in->producer) && memchr(in->fingerprint, 0, sizeof in->fingerprint),
              "unterminated strings in the info");
    if (in->kind == DFL_KIND_HIDDEN) {
        FZ_ASSERT(in->n_layers >= 1 && in->n_layers <= DFL_MAX_LAYERS && in->hidden_size >= 1,
                  "hidden info: %d layers, hidden %lld", in->n_layers, (long long)in->hidden_size);
        FZ_ASSERT(dfl_dtype_size(in->dtype) > 0, "hidden dtype without a size");
    }
}

/* Random access on a mapped file: the index and every batch it lists. True when the file has an
 * index and all of it was read without an error (at most 64 batches). */
static bool random_access(dfl_reader *r, bool mapped)
{
    const dfl_index_entry *ent;
    uint64_t n;
    dfl_err e;
    int rc = dfl_reader_index(r, &ent, &n, &e);
    fz_check_err(rc, &e, "dfl_reader_index");
    if (!mapped) {
        FZ_ASSERT(rc == DFL_EUNSUP, "index on a descriptor: %d", rc);
        return false;
    }
    if (rc)
        return false;
    bool all = n <= 64;
    for (uint64_t i = 0; i < n && i < 64; i++) {
        dfl_batch b;
        rc = dfl_reader_batch_at(r, ent[i].offset, &b, &e);
        fz_check_err(rc, &e, "dfl_reader_batch_at");
        all = all && rc == DFL_OK;
        if (rc == DFL_OK) {
            FZ_ASSERT(b.n_seqs == ent[i].n_seqs && b.n_tokens == ent[i].n_tokens, "batch_at differs from the index");
            check_batch(r, &b);
            dfl_batch_free(&b);
        }
    }
    /* an offset that is not listed is refused */
    dfl_batch b;
    rc = dfl_reader_batch_at(r, 1, &b, &e);
    FZ_ASSERT(rc != DFL_OK, "batch_at offset 1 accepted");
    return all;
}

static outcome walk(const uint8_t *data, size_t n, bool mapped, const dfl_reader_opts *o, bool by_frame)
{
    outcome out = {0};
    int fd = fz_memfd(data, n, mapped ? 0 : 1);
    dfl_reader *r;
    dfl_err e;
    int rc = dfl_reader_open_fd(&r, fd, "in.dfl", o, &e);
    fz_check_err(rc, &e, "dfl_reader_open_fd");
    if (rc) {
        FZ_ASSERT(r == NULL, "reader returned on failure");
        close(fd);
        out.rc = rc;
        return out;
    }
    check_info(dfl_reader_info(r));
    bool by_index = mapped && random_access(r, mapped);
    for (uint64_t k = 0;; k++) {
        bool eos = false;
        dfl_batch b;
        if (by_frame) {
            dfl_frame f;
            rc = dfl_reader_next_frame(r, &f, &eos, &e);
            fz_check_err(rc, &e, "dfl_reader_next_frame");
            if (rc || eos)
                break;
            if (f.payload)
                fz_touch(f.payload, f.raw_len);
            if (f.type == DFL_FT_TOKENS || f.type == DFL_FT_HIDDEN) {
                int prc = dfl_reader_parse_batch(r, &f, &b, &e);
                fz_check_err(prc, &e, "dfl_reader_parse_batch");
                FZ_ASSERT(prc == DFL_OK, "a batch frame that next_frame accepted does not parse: %s", e.msg);
                check_batch(r, &b);
                out.batches++;
                out.tokens += b.n_tokens;
                out.seqs += b.n_seqs;
            }
            dfl_frame_free(&f);
            continue;
        }
        rc = dfl_reader_next(r, &b, &eos, &e);
        fz_check_err(rc, &e, "dfl_reader_next");
        if (rc || eos)
            break;
        FZ_ASSERT(b.index == out.batches, "batch index %llu, expected %llu", (unsigned long long)b.index,
                  (unsigned long long)out.batches);
        check_batch(r, &b);
        out.batches++;
        out.tokens += b.n_tokens;
        out.seqs += b.n_seqs;
        if (k & 1)
            dfl_reader_recycle(r, &b);
        else
            dfl_batch_free(&b);
    }
    out.rc = rc;
    FZ_ASSERT(!by_index || rc == DFL_OK, "read through its index, the file is accepted; as a stream: %s",
              dfl_code_name(rc));
    if (rc == DFL_OK) {
        out.eos = true;
        out.truncated = dfl_reader_truncated(r);
        out.end = *dfl_reader_end(r);
        FZ_ASSERT(out.end.n_batches == out.batches && out.end.n_tokens == out.tokens && out.end.n_seqs == out.seqs,
                  "END totals differ from what was read");
        FZ_ASSERT(!out.truncated || o->allow_truncated, "truncated without allow_truncated");
        /* after the end, the reader keeps saying so */
        bool eos = false;
        dfl_batch b;
        rc = dfl_reader_next(r, &b, &eos, &e);
        FZ_ASSERT(rc == DFL_OK && eos, "reading past the end: %d", rc);
    } else {
        /* a failed reader stays failed, with the same code */
        bool eos = false;
        dfl_batch b;
        int rc2 = dfl_reader_next(r, &b, &eos, &e);
        FZ_ASSERT(rc2 == rc, "sticky error: %d then %d", rc, rc2);
    }
    if (mapped)
        random_access(r, mapped); /* once more, after the walk (cached index) */
    dfl_reader_close(r);
    close(fd);
    return out;
}

static void same(const outcome *a, const outcome *b, const char *what)
{
    FZ_ASSERT(a->rc == b->rc, "%s: mapped gives %s, read(2) gives %s", what, dfl_code_name(a->rc), dfl_code_name(b->rc));
    FZ_ASSERT(a->batches == b->batches && a->tokens == b->tokens && a->seqs == b->seqs,
              "%s: mapped read %llu batches, read(2) %llu", what, (unsigned long long)a->batches,
              (unsigned long long)b->batches);
    FZ_ASSERT(a->truncated == b->truncated && memcmp(&a->end, &b->end, sizeof a->end) == 0, "%s: ends differ", what);
}

int LLVMFuzzerTestOneInput(const uint8_t *data, size_t size)
{
    uint64_t h = XXH3_64bits(data, size);
    dfl_reader_opts strict = {0};
    outcome a = walk(data, size, true, &strict, false);
    outcome b = walk(data, size, false, &strict, false);
    same(&a, &b, "as it is");

    uint8_t *fixed = malloc(size ? size : 1);
    if (!fixed)
        fz_die("out of memory");
    memcpy(fixed, data, size);
    fix_checksums(fixed, size);
    /* a small frame limit keeps allocations small (the default allows 64 GiB frames) */
    dfl_reader_opts o = {.allow_truncated = h & 1, .no_verify = (h >> 1) & 1, .max_frame = 1u << 20};
    bool by_frame = (h >> 2) & 1;
    outcome c = walk(fixed, size, true, &o, by_frame);
    outcome d = walk(fixed, size, false, &o, by_frame);
    same(&c, &d, "checksums fixed");
    free(fixed);
    return 0;
}
