/* bucket_scan.c: dfl-bucket's scanning (see bucket.h): read the inputs (mapped files or streams, in
 * chunks of whole lines), parse and check the records on the worker pool, and merge them in input
 * order into the compact sample index (spilling stream parts' tokens): dfl_bucket_scan. */
#include "bucket_int.h"

#include <dirent.h>
#include <errno.h>
#include <fcntl.h>
#include <jansson.h>
#include <pthread.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/mman.h>
#include <sys/stat.h>
#include <unistd.h>

#include "bytes.h"
#include "frame.h"
#include "json.h"
#include "jsonl.h"
#include "log.h"
#include "util.h"


/* ---- scanning ---- */

/* A line over DFL_JSONL_MAX_LINE, in any kind of input. */
#define OVERLONG_MSG "line longer than the limit of %u bytes"

typedef struct bk_chunk {
    const char *data;          /* whole lines */
    size_t size;
    uint64_t base;             /* offset of data in its part (mapped parts) */
    uint32_t part;
    bool spill;                /* keep the tokens (stream parts, unless --stats) */
    bool overlong;             /* stands for one line over the length limit (stream parts) */
    char *buf;                 /* owned buffer (stream parts) */
    size_t buf_cap;
    /* results */
    bk_sample *ents;
    size_t n_ents, cap_ents;
    uint8_t *sp;
    size_t sp_n, sp_cap;
    uint64_t lines, blank, skipped, truncated, drop_long, drop_masked, tokens, trained;
    uint64_t bad_line;         /* line (within the chunk) of the first bad record, 0: none */
    int bad_code;
    bool failed;               /* stopped at the bad record (not skipping) */
    char bad_msg[600];
} bk_chunk;

static void chunk_reset(bk_chunk *c)
{
    c->data = NULL;
    c->size = 0;
    c->base = 0;
    c->overlong = false;
    c->n_ents = c->sp_n = 0;
    c->lines = c->blank = c->skipped = c->truncated = c->drop_long = c->drop_masked = 0;
    c->tokens = c->trained = 0;
    c->bad_line = 0;
    c->bad_code = 0;
    c->failed = false;
    c->bad_msg[0] = 0;
}

static int check_vocab(const dfl_sample *s, int64_t vocab, dfl_err *e)
{
    int32_t mx = 0;
    for (size_t i = 0; i < s->n; i++)
        mx = s->ids[i] > mx ? s->ids[i] : mx;
    if (mx < vocab)
        return DFL_OK;
    for (size_t i = 0; i < s->n; i++)
        if (s->ids[i] >= vocab)
            return dfl_fail(e, DFL_EDATA, "input_ids[%zu] = %d is out of range for --vocab-size %lld", i,
                            s->ids[i], (long long)vocab);
    return DFL_OK;
}

static bool chunk_keep(const dfl_bucket_run *r, bk_chunk *c, const dfl_sample *s, const char *line,
                       size_t len)
{
    size_t n = s->n;
    bool trunc = false;
    if (r->max_len && n > r->max_len) {
        if (r->o.long_drop) {
            c->drop_long++;
            return true;
        }
        n = r->max_len;
        trunc = true;
    }
    uint64_t trained = 0;
    for (size_t i = 0; i < n; i++)
        trained += s->mask[i];
    if (trained == 0) {
        c->drop_masked++;
        return true;
    }
    c->truncated += trunc;
    if (c->n_ents == c->cap_ents) {
        size_t cap = c->cap_ents ? c->cap_ents * 2 : 1024;
        bk_sample *ne = realloc(c->ents, cap * sizeof *ne);
        if (!ne)
            return false;
        c->ents = ne;
        c->cap_ents = cap;
    }
    bk_sample *ent = &c->ents[c->n_ents++];
    ent->n_tokens = (uint32_t)n;
    if (c->spill) {
        size_t need = c->sp_n + n * 5;
        if (need > c->sp_cap) {
            size_t cap = c->sp_cap ? c->sp_cap : (1u << 20);
            while (cap < need)
                cap *= 2;
            uint8_t *ns = realloc(c->sp, cap);
            if (!ns)
                return false;
            c->sp = ns;
            c->sp_cap = cap;
        }
        /* spill record: the ids (native i32) then the mask bytes; private to this process */
        ent->where = c->sp_n;
        ent->bytes = 0;
        memcpy(c->sp + c->sp_n, s->ids, n * 4);
        memcpy(c->sp + c->sp_n + n * 4, s->mask, n);
        c->sp_n = need;
    } else {
        ent->where = c->base + (uint64_t)(line - c->data);
        ent->bytes = (uint32_t)len;
    }
    c->tokens += n;
    c->trained += trained;
    return true;
}

/* Parses every line of a chunk (in a worker thread). */
static void chunk_scan(const dfl_bucket_run *r, bk_chunk *c, dfl_sample *s)
{
    const char *p = c->data, *end = c->data + c->size;
    s->count_ids = !c->spill && !r->o.vocab_size; /* the ids of a mapped part are read when written */
    while (p < end) {
        const char *le;
        bool blank = false;
        dfl_err e;
        int rc = dfl_sample_parse_fast_eol(s, p, end, &le);
        if (rc == 1) {
            rc = DFL_OK;
        } else if (rc < 0) {
            rc = dfl_fail(&e, DFL_ENOMEM, "out of memory");
            le = end;
        } else { /* declined: find the line, and let the full parser decide */
            le = memchr(p, '\n', (size_t)(end - p));
            if (!le)
                le = end;
            rc = dfl_sample_parse(s, p, (size_t)(le - p), &blank, &e);
        }
        const char *nl = le < end ? le : NULL;
        size_t len = (size_t)(le - p);
        c->lines++;
        if (len > DFL_JSONL_MAX_LINE) /* as a stream part's overlong line (feed_stream) */
            rc = dfl_fail(&e, DFL_EDATA, OVERLONG_MSG, DFL_JSONL_MAX_LINE);
        if (rc == DFL_OK && !blank && r->o.vocab_size)
            rc = check_vocab(s, r->o.vocab_size, &e);
        if (rc == DFL_OK && !blank && !chunk_keep(r, c, s, p, len))
            rc = dfl_fail(&e, DFL_ENOMEM, "out of memory");
        if (rc) {
            bool fatal = !r->o.skip_bad || rc == DFL_ENOMEM;
            if (!c->bad_line || fatal) { /* the first skipped record, or the one that stops */
                c->bad_line = c->lines;
                c->bad_code = rc;
                snprintf(c->bad_msg, sizeof c->bad_msg, "%s", e.msg);
            }
            if (fatal) {
                c->failed = true;
                return;
            }
            c->skipped++;
        } else if (blank) {
            c->blank++;
        }
        p = nl ? nl + 1 : end;
    }
}

typedef struct scan_ctx {
    dfl_bucket_run *r;
    bk_chunk *ch;              /* [slots] */
    dfl_sample *scratch;       /* [threads] */
} scan_ctx;

static void scan_work(void *ctx, int slot, int worker)
{
    scan_ctx *sc = ctx;
    chunk_scan(sc->r, &sc->ch[slot], &sc->scratch[worker]);
}

static int spill_open(dfl_bucket_run *r, dfl_err *e)
{
    if (r->spill_fd >= 0)
        return DFL_OK;
    char *p = dfl_path_join(r->tmp, "spill.XXXXXX");
    if (!p)
        return dfl_fail(e, DFL_ENOMEM, "out of memory");
    r->spill_fd = mkostemp(p, O_CLOEXEC);
    if (r->spill_fd < 0) {
        int err = errno;
        free(p);
        return dfl_fail_errno(e, DFL_EIO, err, "%s: cannot create the spill file", r->tmp);
    }
    unlink(p); /* it lives as long as the descriptor: nothing to clean up after a crash */
    free(p);
    return DFL_OK;
}

static void progress_read(dfl_bucket_run *r, uint64_t done)
{
    double now = dfl_now();
    if (now - r->t_last < 1.0)
        return;
    r->t_last = now;
    double dt = now - r->t0;
    char a[16], b[16], c[16];
    double rate = dt > 0 ? (double)done / dt : 0;
    if (r->total_size && done <= r->total_size && rate > 0)
        dfl_progress("reading: %s of %s (%.0f%%), %s/s, %zu samples, ETA %.0f s",
                     dfl_fmt_bytes((double)done, a, sizeof a), dfl_fmt_bytes((double)r->total_size, b, sizeof b),
                     100.0 * (double)done / (double)r->total_size, dfl_fmt_bytes(rate, c, sizeof c),
                     r->n_samples, (double)(r->total_size - done) / rate);
    else
        dfl_progress("reading: %s, %s/s, %zu samples", dfl_fmt_bytes((double)done, a, sizeof a),
                     dfl_fmt_bytes(rate, c, sizeof c), r->n_samples);
}

/* Merges one processed chunk into the index (in input order). */
static int merge_chunk(dfl_bucket_run *r, bk_chunk *c, dfl_err *e)
{
    bk_part *pt = &r->parts[c->part];
    if (c->overlong) {
        c->lines = 1;
        c->bad_line = 1;
        c->bad_code = DFL_EDATA;
        c->failed = !r->o.skip_bad;
        c->skipped = !c->failed;
        snprintf(c->bad_msg, sizeof c->bad_msg, OVERLONG_MSG, DFL_JSONL_MAX_LINE);
    }
    if (c->bad_line && c->bad_code == DFL_ENOMEM)
        return dfl_fail(e, DFL_ENOMEM, "%s: out of memory", pt->name);
    if (c->bad_line && (c->failed || !r->first_skip[0])) {
        char msg[sizeof r->first_skip];
        snprintf(msg, sizeof msg, "%s:%llu: %s", pt->name, (unsigned long long)(pt->lines + c->bad_line),
                 c->bad_msg);
        if (c->failed)
            return dfl_fail(e, c->bad_code, "%s (--on-error skip skips bad records)", msg);
        memcpy(r->first_skip, msg, sizeof msg);
    }
    if (r->n_samples + c->n_ents > r->cap_samples) {
        size_t cap = r->cap_samples ? r->cap_samples : 65536;
        while (cap < r->n_samples + c->n_ents)
            cap *= 2;
        bk_sample *ns = realloc(r->samples, cap * sizeof *ns);
        if (!ns)
            return dfl_fail(e, DFL_ENOMEM, "out of memory for the index of %zu samples", cap);
        r->samples = ns;
        r->cap_samples = cap;
    }
    uint64_t add = c->spill ? r->spill_size : 0;
    if (add + c->sp_n > OFF_MASK)
        return dfl_fail(e, DFL_EUNSUP, "%s: spill larger than 256 TiB", pt->name);
    uint64_t tag = (uint64_t)c->part << PART_SHIFT;
    for (size_t k = 0; k < c->n_ents; k++) {
        bk_sample s = c->ents[k];
        s.where = tag | (s.where + add);
        r->samples[r->n_samples++] = s;
    }
    if (c->spill && c->sp_n) {
        int rc = spill_open(r, e);
        if (!rc)
            rc = dfl_write_all(r->spill_fd, c->sp, c->sp_n, "spill file", e);
        if (rc)
            return rc;
        r->spill_size += c->sp_n;
    }
    r->lines += c->lines;
    r->blank += c->blank;
    r->skipped += c->skipped;
    r->truncated += c->truncated;
    r->drop_long += c->drop_long;
    r->drop_masked += c->drop_masked;
    r->tokens += c->tokens;
    r->trained += c->trained;
    r->bytes += c->size;
    pt->lines += c->lines;
    pt->samples += c->n_ents;
    pt->tokens += c->tokens;
    pt->bytes += c->size;
    return DFL_OK;
}

static int add_part(dfl_bucket_run *r, const dfl_part *p, size_t input, dfl_err *e)
{
    if (r->n_parts == MAX_PARTS)
        return dfl_fail(e, DFL_EUNSUP, "%s: more than %d input files and archive members", p->name, MAX_PARTS);
    if (!dfl_grow(&r->parts, &r->cap_parts, r->n_parts, sizeof *r->parts, 16))
        return dfl_fail(e, DFL_ENOMEM, "out of memory");
    bk_part *pt = &r->parts[r->n_parts];
    memset(pt, 0, sizeof *pt);
    pt->name = dfl_strdup(p->name);
    if (!pt->name)
        return dfl_fail(e, DFL_ENOMEM, "out of memory");
    pt->mapped = p->mapped;
    pt->data = p->data;
    pt->size = p->size;
    pt->input = input;
    r->n_parts++;
    return DFL_OK;
}

/* Cuts the inputs into chunks of whole lines, in order, across inputs and parts. */
typedef struct feeder {
    size_t i;                  /* current input */
    bool in_part, mapped, any_mapped, part_eof;
    uint32_t part;
    const char *data;          /* mapped part */
    size_t size, pos;
    char *carry;               /* stream part: the start of an incomplete line */
    size_t carry_n, carry_cap;
} feeder;

static uint64_t feeder_consumed(const dfl_bucket_run *r, const feeder *fd)
{
    if (fd->i >= r->n_in || !r->in[fd->i])
        return r->done_size;
    return r->done_size + (fd->mapped ? fd->pos : dfl_input_consumed(r->in[fd->i]));
}

static int buf_reserve(char **buf, size_t *cap, size_t need, dfl_err *e)
{
    if (need <= *cap)
        return DFL_OK;
    size_t c = *cap ? *cap : CHUNK + (64u << 10);
    while (c < need)
        c *= 2;
    char *nb = realloc(*buf, c);
    if (!nb)
        return dfl_fail(e, DFL_ENOMEM, "out of memory for a read buffer of %zu bytes", c);
    *buf = nb;
    *cap = c;
    return DFL_OK;
}

/* The next chunk of a stream part into c; *empty when the part had nothing more. */
static int feed_stream(dfl_bucket_run *r, feeder *fd, dfl_input *in, bk_chunk *c, bool *empty, dfl_err *e)
{
    *empty = false;
    int rc = buf_reserve(&c->buf, &c->buf_cap, fd->carry_n + CHUNK, e);
    if (rc)
        return rc;
    if (fd->carry_n)
        memcpy(c->buf, fd->carry, fd->carry_n);
    size_t n = fd->carry_n, want = CHUNK, done;
    fd->carry_n = 0;
    for (;;) {
        while (!fd->part_eof && n < want) {
            if ((rc = buf_reserve(&c->buf, &c->buf_cap, n + (64u << 10), e)))
                return rc;
            size_t got;
            if ((rc = dfl_input_read(in, c->buf + n, c->buf_cap - n, &got, e)))
                return rc;
            if (got == 0)
                fd->part_eof = true;
            n += got;
        }
        if (n == 0) {
            *empty = true;
            return DFL_OK;
        }
        if (fd->part_eof) {
            done = n;
            break;
        }
        const char *nl = memrchr(c->buf, '\n', n);
        if (nl) {
            done = (size_t)(nl - c->buf) + 1;
            break;
        }
        if (n <= DFL_JSONL_MAX_LINE) { /* one long line so far: read more */
            want = n + CHUNK;
            continue;
        }
        /* a line over the limit: the chunk stands for it; drop the rest of it */
        c->overlong = true;
        c->part = fd->part;
        for (;;) {
            size_t got;
            if ((rc = dfl_input_read(in, c->buf, c->buf_cap, &got, e)))
                return rc;
            if (got == 0) {
                fd->part_eof = true;
                break;
            }
            nl = memchr(c->buf, '\n', got);
            if (nl) {
                size_t rest = got - (size_t)(nl + 1 - c->buf);
                if ((rc = buf_reserve(&fd->carry, &fd->carry_cap, rest, e)))
                    return rc;
                memcpy(fd->carry, nl + 1, rest);
                fd->carry_n = rest;
                break;
            }
        }
        return DFL_OK;
    }
    if (n > done) {
        if ((rc = buf_reserve(&fd->carry, &fd->carry_cap, n - done, e)))
            return rc;
        memcpy(fd->carry, c->buf + done, n - done);
        fd->carry_n = n - done;
    }
    c->data = c->buf;
    c->size = done;
    c->part = fd->part;
    c->spill = !r->o.stats_only;
    return DFL_OK;
}

/* The next chunk of lines into c; *end when every input is read. */
static int feed(dfl_bucket_run *r, feeder *fd, bk_chunk *c, bool *end, dfl_err *e)
{
    *end = false;
    chunk_reset(c);
    for (;;) {
        if (fd->i >= r->n_in) {
            *end = true;
            return DFL_OK;
        }
        dfl_input *in = r->in[fd->i];
        int rc;
        if (!fd->in_part) {
            dfl_part p;
            bool eof;
            if ((rc = dfl_input_next_part(in, &p, &eof, e)))
                return rc;
            if (eof) {
                r->done_size += dfl_input_size(in);
                if (!fd->any_mapped) { /* a stream has nothing more to give: release it */
                    dfl_input_close(in);
                    r->in[fd->i] = NULL;
                }
                fd->i++;
                fd->any_mapped = false;
                continue;
            }
            if ((rc = add_part(r, &p, fd->i, e)))
                return rc;
            fd->part = (uint32_t)(r->n_parts - 1);
            fd->in_part = true;
            fd->mapped = p.mapped;
            fd->data = (const char *)p.data;
            fd->size = p.size;
            fd->pos = 0;
            fd->part_eof = false;
            fd->carry_n = 0;
            if (p.mapped) {
                fd->any_mapped = true;
                if (p.size > OFF_MASK)
                    return dfl_fail(e, DFL_EUNSUP, "%s: larger than 256 TiB", p.name);
                if (stat(r->o.inputs[fd->i], &r->in_st[fd->i]) != 0)
                    memset(&r->in_st[fd->i], 0, sizeof r->in_st[fd->i]);
            }
        }
        if (fd->mapped) {
            if (fd->pos >= fd->size) {
                fd->in_part = false;
                continue;
            }
            size_t end_pos = fd->size - fd->pos > CHUNK ? fd->pos + CHUNK : fd->size;
            if (end_pos < fd->size) {
                const char *nl = memchr(fd->data + end_pos, '\n', fd->size - end_pos);
                end_pos = nl ? (size_t)(nl - fd->data) + 1 : fd->size;
            }
            c->data = fd->data + fd->pos;
            c->size = end_pos - fd->pos;
            c->base = fd->pos;
            c->part = fd->part;
            c->spill = false;
            fd->pos = end_pos;
            return DFL_OK;
        }
        if (fd->part_eof && fd->carry_n == 0) {
            fd->in_part = false;
            continue;
        }
        bool empty;
        if ((rc = feed_stream(r, fd, in, c, &empty, e)))
            return rc;
        if (!empty)
            return DFL_OK;
        fd->in_part = false;
    }
}

int dfl_bucket_scan(dfl_bucket_run *r, dfl_err *e)
{
    int n_slots = 2 * r->threads + 2;
    scan_ctx sc = {r, NULL, NULL};
    sc.ch = calloc((size_t)n_slots, sizeof *sc.ch);
    sc.scratch = calloc((size_t)r->threads, sizeof *sc.scratch);
    feeder fd;
    memset(&fd, 0, sizeof fd);
    bk_pool pool;
    int rc = DFL_OK;
    if (!sc.ch || !sc.scratch) {
        free(sc.ch);
        free(sc.scratch);
        return dfl_fail(e, DFL_ENOMEM, "out of memory");
    }
    rc = dfl_bucket_pool_start(&pool, r->threads, n_slots, scan_work, &sc, e);
    if (!rc) {
        uint64_t filled = 0, merged = 0;
        bool end = false;
        for (;;) {
            while (!rc && !end && filled - merged < (uint64_t)n_slots) {
                int s = (int)(filled % (uint64_t)n_slots);
                rc = feed(r, &fd, &sc.ch[s], &end, e);
                if (rc || end)
                    break;
                if (sc.ch[s].overlong)
                    dfl_bucket_pool_skip(&pool, s);
                else
                    dfl_bucket_pool_submit(&pool, s);
                filled++;
            }
            if (merged == filled)
                break;
            int s = (int)(merged % (uint64_t)n_slots);
            dfl_bucket_pool_wait(&pool, s);
            if (!rc)
                rc = merge_chunk(r, &sc.ch[s], e);
            merged++;
            if (!rc && dfl_bucket_stopped(r))
                rc = dfl_bucket_stop_fail(e);
            if (!rc)
                progress_read(r, feeder_consumed(r, &fd));
        }
        dfl_bucket_pool_stop(&pool);
    }
    for (int i = 0; i < n_slots; i++) {
        free(sc.ch[i].ents);
        free(sc.ch[i].sp);
        free(sc.ch[i].buf);
    }
    free(sc.ch);
    for (int i = 0; i < r->threads; i++)
        dfl_sample_free(&sc.scratch[i]);
    free(sc.scratch);
    free(fd.carry);
    dfl_progress_end();
    r->t_scan = dfl_now();
    if (rc)
        return rc;
    if (r->skipped)
        dfl_warn("skipped %llu bad record%s; the first: %s", (unsigned long long)r->skipped,
                 r->skipped == 1 ? "" : "s", r->first_skip);
    if (r->spill_fd >= 0 && r->spill_size) {
        void *m = mmap(NULL, r->spill_size, PROT_READ, MAP_SHARED, r->spill_fd, 0);
        if (m == MAP_FAILED)
            return dfl_fail_errno(e, DFL_EIO, errno, "%s: cannot map the spill file", r->tmp);
        r->spill_map = m;
    }
    return DFL_OK;
}
