/* dfl-ckpt: lists, checks and compares checkpoints and tensor files: safetensors files, Hugging
 * Face model directories, dfl checkpoint directories, torch.save files (.bin/.pt, read without
 * executing anything) and .dfl streams. Finds NaN/Inf fast (in parallel, at memory bandwidth),
 * prints per-tensor statistics, verifies structure and checksums, compares two checkpoints, and
 * converts a stream into a safetensors file. See dfl-ckpt(1). */
#include <errno.h>
#include <getopt.h>
#include <inttypes.h>
#include <jansson.h>
#include <math.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "bytes.h"
#include "cli.h"
#include "frame.h"
#include "json.h"
#include "log.h"
#include "safetensors.h"
#include "scan.h"
#include "tensorview.h"
#include "util.h"

enum mode { M_LIST, M_CHECK_NAN, M_STATS, M_VERIFY, M_DIFF, M_TO_ST };

static struct {
    enum mode mode;
    bool json;
    int threads;
    bool mmap;
    const char *out;
    bool multi;              /* more than one source: name each before its rows */
} opt;

static int worst;            /* exit status so far (the largest wins) */
static json_t *j_inputs;     /* --json: one object per source */
static bool header_done;

static void fail_status(int status)
{
    if (status > worst)
        worst = status;
}

static bool output_failed;   /* the error being reported is about our output, not an input */

/* Prints e. An input that cannot be read is bad input (exit 2) like a corrupt one; so is any
 * failure under --diff, which keeps 1 for "they differ". */
static void report(const dfl_err *e)
{
    int st = dfl_cli_report(e);
    if (st && (opt.mode == M_DIFF || (e->code == DFL_EIO && !output_failed)))
        st = 2;
    fail_status(st);
}

static const char *shape_compact(const dfl_tensor_view *v, char *buf, size_t n)
{
    size_t k = (size_t)snprintf(buf, n, "[");
    for (int i = 0; i < v->ndim && k < n; i++)
        k += (size_t)snprintf(buf + k, n - k, "%s%" PRId64, i ? "," : "", v->shape[i]);
    if (k < n)
        snprintf(buf + k, n - k, "]");
    return buf;
}

static json_t *j_shape(int ndim, const int64_t *shape)
{
    json_t *a = json_array();
    for (int i = 0; i < ndim; i++)
        json_array_append_new(a, json_integer(shape[i]));
    return a;
}

static json_t *j_num(double v) { return isfinite(v) ? json_real(v) : json_null(); }

static void column_header(const char *cols)
{
    if (!opt.json && !header_done) {
        printf("# %s\n", cols);
        header_done = true;
    }
}

static void source_header(const char *label, const char *kind)
{
    if (!opt.json && opt.multi)
        printf("# %s (%s)\n", label, kind);
}

static json_t *j_source(const char *label, const char *kind)
{
    json_t *o = json_object();
    json_object_set_new(o, "path", json_string(label));
    json_object_set_new(o, "kind", json_string(kind));
    json_array_append_new(j_inputs, o);
    return o;
}

/* ---------------------------------------------------------------- tensor files */

/* The scan job of a view: read from its file unless --mmap or it lives only in memory. */
static dfl_scan_job job_of(const dfl_tensor_view *v)
{
    dfl_scan_job j = {.data = v->data, .fd = -1, .dtype = v->dtype, .n = v->numel, .what = v->name};
    if (!opt.mmap && v->fd >= 0) {
        j.data = NULL;
        j.fd = v->fd;
        j.offset = v->file_offset;
    }
    return j;
}

static void nf_text(const char *label, const char *name, const dfl_scan_result *r, const char *where)
{
    printf("%s: %s: %" PRIu64 " non-finite (%" PRIu64 " NaN, %" PRIu64 " +Inf, %" PRIu64
           " -Inf), first at flat index %" PRIu64 "%s\n", label, name, r->nonfinite, r->nan, r->posinf,
           r->neginf, r->first, where ? where : "");
}

static json_t *j_nf(const dfl_scan_result *r)
{
    json_t *o = json_object();
    json_object_set_new(o, "nonfinite", json_integer((json_int_t)r->nonfinite));
    json_object_set_new(o, "nan", json_integer((json_int_t)r->nan));
    json_object_set_new(o, "posinf", json_integer((json_int_t)r->posinf));
    json_object_set_new(o, "neginf", json_integer((json_int_t)r->neginf));
    json_object_set_new(o, "first", r->first == DFL_SCAN_NONE ? json_null() : json_integer((json_int_t)r->first));
    return o;
}

/* The column header (cols) and source line of a tensor set's text report (none when cols is NULL);
 * with --json, the source's "tensors" array to fill (NULL without). */
static json_t *tensor_report(const dfl_tensor_set *s, const char *cols)
{
    if (cols) {
        column_header(cols);
        source_header(s->label, dfl_input_kind_name(s->kind));
    }
    if (!opt.json)
        return NULL;
    json_t *src = j_source(s->label, dfl_input_kind_name(s->kind));
    json_t *arr = json_array();
    json_object_set_new(src, "tensors", arr);
    return arr;
}

static void list_set(const dfl_tensor_set *s)
{
    json_t *arr = tensor_report(s, "name\tdtype\tshape\tbytes");
    for (size_t i = 0; i < s->n; i++) {
        const dfl_tensor_view *v = &s->t[i];
        if (opt.json) {
            json_t *t = json_object();
            json_object_set_new(t, "name", json_string(v->name));
            json_object_set_new(t, "dtype", json_string(dfl_dtype_lower(v->dtype)));
            json_object_set_new(t, "shape", j_shape(v->ndim, v->shape));
            json_object_set_new(t, "bytes", json_integer((json_int_t)v->nbytes));
            json_array_append_new(arr, t);
        } else {
            char sh[256];
            printf("%s\t%s\t%s\t%" PRIu64 "\n", v->name, dfl_dtype_lower(v->dtype), shape_compact(v, sh, sizeof sh),
                   v->nbytes);
        }
    }
}

static int nan_set(const dfl_tensor_set *s, dfl_err *e)
{
    dfl_scan_job *jobs = calloc(s->n ? s->n : 1, sizeof *jobs);
    size_t *idx = calloc(s->n ? s->n : 1, sizeof *idx);
    dfl_scan_result *res = calloc(s->n ? s->n : 1, sizeof *res);
    if (!jobs || !idx || !res) {
        free(jobs);
        free(idx);
        free(res);
        return dfl_fail(e, DFL_ENOMEM, "%s: out of memory", s->label);
    }
    size_t nj = 0;
    uint64_t bytes = 0;
    for (size_t i = 0; i < s->n; i++)
        if (dfl_dtype_is_float(s->t[i].dtype)) {
            idx[nj] = i;
            jobs[nj++] = job_of(&s->t[i]);
            bytes += s->t[i].nbytes;
        }
    double t0 = dfl_now();
    int rc = dfl_scan_nonfinite_many(jobs, nj, opt.threads, res, e);
    double dt = dfl_now() - t0;
    if (rc) {
        dfl_err_prefix(e, "%s: ", s->label);
    } else {
        json_t *arr = tensor_report(s, NULL);
        size_t bad = 0;
        for (size_t k = 0; k < nj; k++) {
            const dfl_tensor_view *v = &s->t[idx[k]];
            if (res[k].nonfinite)
                bad++;
            if (opt.json) {
                json_t *t = j_nf(&res[k]);
                json_object_set_new(t, "name", json_string(v->name));
                json_object_set_new(t, "dtype", json_string(dfl_dtype_lower(v->dtype)));
                json_array_append_new(arr, t);
            } else if (res[k].nonfinite) {
                nf_text(s->label, v->name, &res[k], NULL);
            }
        }
        char b1[16];
        if (bad) {
            dfl_info("%s: %zu of %zu floating tensors hold NaN or Inf", s->label, bad, nj);
            fail_status(2);
        } else {
            dfl_info("%s: all %zu floating tensors finite (%s)", s->label, nj, dfl_fmt_bytes((double)bytes, b1, sizeof b1));
        }
        dfl_verbose("%s: scanned %s in %.3f s (%.2f GB/s)", s->label, dfl_fmt_bytes((double)bytes, b1, sizeof b1),
                    dt, dt > 0 ? (double)bytes / dt / 1e9 : 0.0);
    }
    free(jobs);
    free(idx);
    free(res);
    return rc;
}

static void stats_row(const char *name, dfl_dtype dt, const dfl_stats *st, json_t *arr)
{
    if (opt.json) {
        json_t *t = j_nf(&st->nf);
        json_object_set_new(t, "name", json_string(name));
        json_object_set_new(t, "dtype", json_string(dfl_dtype_lower(dt)));
        json_object_set_new(t, "numel", json_integer((json_int_t)st->nf.n));
        json_object_set_new(t, "finite", json_integer((json_int_t)st->finite));
        json_object_set_new(t, "min", j_num(st->min));
        json_object_set_new(t, "max", j_num(st->max));
        json_object_set_new(t, "mean", j_num(st->mean));
        json_object_set_new(t, "std", j_num(st->std));
        json_object_set_new(t, "absmax", j_num(st->absmax));
        json_array_append_new(arr, t);
        return;
    }
    printf("%s\t%s\t%" PRIu64 "\t%.9g\t%.9g\t%.9g\t%.9g\t%.9g\t%" PRIu64 "\n", name, dfl_dtype_lower(dt), st->nf.n,
           st->min, st->max, st->mean, st->std, st->absmax, st->nf.nonfinite);
}

#define STATS_COLS "name\tdtype\tnumel\tmin\tmax\tmean\tstd\tabsmax\tnonfinite"

static int stats_set(const dfl_tensor_set *s, dfl_err *e)
{
    dfl_scan_job *jobs = calloc(s->n ? s->n : 1, sizeof *jobs);
    dfl_stats *res = calloc(s->n ? s->n : 1, sizeof *res);
    if (!jobs || !res) {
        free(jobs);
        free(res);
        return dfl_fail(e, DFL_ENOMEM, "%s: out of memory", s->label);
    }
    for (size_t i = 0; i < s->n; i++)
        jobs[i] = job_of(&s->t[i]);
    int rc = dfl_scan_stats_many(jobs, s->n, opt.threads, res, e);
    if (rc) {
        dfl_err_prefix(e, "%s: ", s->label);
    } else {
        json_t *arr = tensor_report(s, STATS_COLS);
        for (size_t i = 0; i < s->n; i++)
            stats_row(s->t[i].name, s->t[i].dtype, &res[i], arr);
    }
    free(jobs);
    free(res);
    return rc;
}

static void verified(const char *label, const char *kind, const char *what)
{
    dfl_info("%s: OK (%s, %s)", label, kind, what);
    if (opt.json) {
        json_t *src = j_source(label, kind);
        json_object_set_new(src, "ok", json_true());
        json_object_set_new(src, "summary", json_string(what));
    }
}

static void verify_failed(const char *label, const dfl_err *e)
{
    if (opt.json) {
        json_t *src = j_source(label, "unknown");
        json_object_set_new(src, "ok", json_false());
        json_object_set_new(src, "error", json_string(e->msg));
    }
}

static int tensor_path(const char *path)
{
    dfl_err e = {0};
    dfl_tensor_set *sets;
    size_t ns;
    /* a listing needs no data: torch files then read only their pickle */
    int rc = dfl_tensor_sets_open(path, opt.mode == M_LIST ? DFL_TS_NO_DATA : 0, &sets, &ns, &e);
    if (rc) {
        if (opt.mode == M_VERIFY)
            verify_failed(path, &e);
        report(&e);
        return rc;
    }
    if (ns > 1)
        opt.multi = true;
    for (size_t i = 0; i < ns && !rc; i++) {
        const dfl_tensor_set *s = &sets[i];
        switch (opt.mode) {
        case M_LIST:
            list_set(s);
            break;
        case M_CHECK_NAN:
            rc = nan_set(s, &e);
            break;
        case M_STATS:
            rc = stats_set(s, &e);
            break;
        case M_VERIFY: {
            uint64_t bytes = 0;
            for (size_t k = 0; k < s->n; k++)
                bytes += s->t[k].nbytes;
            char what[128], b[16];
            snprintf(what, sizeof what, "%zu tensors, %s", s->n, dfl_fmt_bytes((double)bytes, b, sizeof b));
            verified(s->label, dfl_input_kind_name(s->kind), what);
            break;
        }
        default:
            break;
        }
    }
    if (rc)
        report(&e);
    dfl_tensor_sets_close(sets, ns);
    return rc;
}

/* ---------------------------------------------------------------- streams */

static const char *frame_type_name(uint32_t t, char *buf, size_t n)
{
    switch (t) {
    case DFL_FT_HEADER: return "header";
    case DFL_FT_TOKENS: return "tokens";
    case DFL_FT_HIDDEN: return "hidden";
    case DFL_FT_INDEX: return "index";
    case DFL_FT_END: return "end";
    case DFL_FT_NOTE: return "note";
    default: snprintf(buf, n, "type%u", t); return buf;
    }
}

static const char *flags_str(uint32_t f, char *buf, size_t n)
{
    buf[0] = 0;
    size_t k = 0;
    static const struct { uint32_t bit; const char *name; } names[] = {
        {DFL_FF_SKIPPABLE, "skippable"}, {DFL_FF_ZSTD, "zstd"}, {DFL_FF_SHUFFLE2, "shuffle2"},
        {DFL_FF_SHUFFLE4, "shuffle4"},
    };
    for (size_t i = 0; i < DFL_ARRAY_LEN(names); i++)
        if (f & names[i].bit)
            k += (size_t)snprintf(buf + k, k < n ? n - k : 0, "%s%s", k ? "," : "", names[i].name);
    if (!buf[0])
        snprintf(buf, n, "-");
    return buf;
}

static json_t *j_stream_info(const dfl_stream_info *in)
{
    json_t *o = json_object();
    json_object_set_new(o, "kind", json_string(in->kind == DFL_KIND_HIDDEN ? "hidden" : "tokens"));
    char v[32];
    snprintf(v, sizeof v, "%d.%d", in->version_major, in->version_minor);
    json_object_set_new(o, "version", json_string(v));
    json_object_set_new(o, "producer", json_string(in->producer));
    json_object_set_new(o, "vocab_size", json_integer(in->vocab_size));
    if (in->kind == DFL_KIND_HIDDEN) {
        json_object_set_new(o, "hidden_size", json_integer(in->hidden_size));
        json_t *l = json_array();
        for (int i = 0; i < in->n_layers; i++)
            json_array_append_new(l, json_integer(in->layers[i]));
        json_object_set_new(o, "layers", l);
        json_object_set_new(o, "dtype", json_string(dfl_dtype_lower(in->dtype)));
    }
    json_object_set_new(o, "fingerprint", json_string(in->fingerprint));
    return o;
}

#define FRAME_COLS "offset\tseq\ttype\tflags\tstored\traw\tS\tT\tK\tH\tdtype"

/* Calls fn on every frame of the stream with, for a tokens or hidden frame, its batch (a view of
 * the frame's payload; NULL for other frames). The frame is freed after. */
typedef int (*frame_fn)(const dfl_frame *f, const dfl_batch *b, void *ctx);

static int each_frame(dfl_reader *r, frame_fn fn, void *ctx, dfl_err *e)
{
    for (;;) {
        dfl_frame f = {0};
        dfl_batch b = {0};
        bool eos = false;
        int rc = dfl_reader_next_frame(r, &f, &eos, e);
        if (rc || eos)
            return rc;
        bool batch = f.type == DFL_FT_TOKENS || f.type == DFL_FT_HIDDEN;
        if (!(batch && (rc = dfl_reader_parse_batch(r, &f, &b, e))))
            rc = fn(&f, batch ? &b : NULL, ctx);
        dfl_frame_free(&f);
        if (rc)
            return rc;
    }
}

/* one row (or JSON object in frames) of the frame listing */
static int list_frame(const dfl_frame *f, const dfl_batch *b, void *frames)
{
    char tb[32], fb[64];
    if (opt.json) {
        json_t *o = json_object();
        json_object_set_new(o, "offset", json_integer((json_int_t)f->offset));
        json_object_set_new(o, "seq", json_integer((json_int_t)f->seq));
        json_object_set_new(o, "type", json_string(frame_type_name(f->type, tb, sizeof tb)));
        json_object_set_new(o, "flags", json_integer(f->flags));
        json_object_set_new(o, "stored", json_integer((json_int_t)f->stored_len));
        json_object_set_new(o, "raw", json_integer((json_int_t)f->raw_len));
        if (b) {
            json_object_set_new(o, "S", json_integer(b->n_seqs));
            json_object_set_new(o, "T", json_integer((json_int_t)b->n_tokens));
            json_object_set_new(o, "K", json_integer(b->n_layers));
            json_object_set_new(o, "H", json_integer(b->hidden));
            if (b->n_layers)
                json_object_set_new(o, "dtype", json_string(dfl_dtype_lower(b->dtype)));
        }
        json_array_append_new(frames, o);
    } else if (b) {
        printf("%" PRIu64 "\t%" PRIu64 "\t%s\t%s\t%" PRIu64 "\t%" PRIu64 "\t%u\t%" PRIu64 "\t%u\t%u\t%s\n",
               f->offset, f->seq, frame_type_name(f->type, tb, sizeof tb), flags_str(f->flags, fb, sizeof fb),
               f->stored_len, f->raw_len, b->n_seqs, b->n_tokens, b->n_layers, b->hidden,
               b->n_layers ? dfl_dtype_lower(b->dtype) : "-");
    } else {
        printf("%" PRIu64 "\t%" PRIu64 "\t%s\t%s\t%" PRIu64 "\t%" PRIu64 "\t-\t-\t-\t-\t-\n", f->offset, f->seq,
               frame_type_name(f->type, tb, sizeof tb), flags_str(f->flags, fb, sizeof fb), f->stored_len,
               f->raw_len);
    }
    return DFL_OK;
}

static int list_stream(dfl_reader *r, const char *label, dfl_err *e)
{
    const dfl_stream_info *in = dfl_reader_info(r);
    column_header(FRAME_COLS);
    source_header(label, "dfl-stream");
    json_t *frames = NULL;
    if (opt.json) {
        json_t *src = j_source(label, "dfl-stream");
        json_object_set_new(src, "header", j_stream_info(in));
        frames = json_array();
        json_object_set_new(src, "frames", frames);
    } else {
        printf("0\t0\theader\t-\t-\t-\t-\t-\t-\t-\t%s\n", in->kind == DFL_KIND_HIDDEN ? dfl_dtype_lower(in->dtype) : "-");
    }
    return each_frame(r, list_frame, frames, e);
}

/* Calls fn on every batch of the stream (the batch is freed after). */
typedef int (*batch_fn)(dfl_reader *r, const char *label, const dfl_batch *b, void *ctx, dfl_err *e);

static int each_batch(dfl_reader *r, const char *label, batch_fn fn, void *ctx, dfl_err *e)
{
    for (;;) {
        dfl_batch b = {0};
        bool eos = false;
        int rc = dfl_reader_next(r, &b, &eos, e);
        if (rc || eos)
            return rc;
        rc = fn(r, label, &b, ctx, e);
        dfl_batch_free(&b);
        if (rc)
            return rc;
    }
}

typedef struct stream_ctx {
    json_t *arr;
    uint64_t batches, arrays, bad_arrays, bytes;
} stream_ctx;

static int nan_batch(dfl_reader *r, const char *label, const dfl_batch *b, void *vctx, dfl_err *e)
{
    stream_ctx *c = vctx;
    const dfl_stream_info *in = dfl_reader_info(r);
    c->batches++;
    if (!b->n_layers)
        return DFL_OK;
    dfl_scan_job jobs[DFL_MAX_LAYERS];
    dfl_scan_result res[DFL_MAX_LAYERS];
    for (uint32_t k = 0; k < b->n_layers; k++) {
        jobs[k] = (dfl_scan_job){.data = b->layers[k], .fd = -1, .dtype = b->dtype,
                                 .n = b->n_tokens * b->hidden, .what = label};
        c->bytes += jobs[k].n * dfl_dtype_size(b->dtype);
    }
    int rc = dfl_scan_nonfinite_many(jobs, b->n_layers, opt.threads, res, e);
    if (rc)
        return rc;
    for (uint32_t k = 0; k < b->n_layers; k++) {
        c->arrays++;
        char name[64];
        snprintf(name, sizeof name, "batch%" PRIu64 ".layer%d", b->index, in->layers[k]);
        if (res[k].nonfinite)
            c->bad_arrays++;
        if (opt.json) {
            json_t *t = j_nf(&res[k]);
            json_object_set_new(t, "name", json_string(name));
            json_object_set_new(t, "offset", json_integer((json_int_t)b->offset));
            json_array_append_new(c->arr, t);
        } else if (res[k].nonfinite) {
            char where[96];
            snprintf(where, sizeof where, " (token %" PRIu64 ", dim %" PRIu64 "; frame at offset %" PRIu64 ")",
                     res[k].first / b->hidden, res[k].first % b->hidden, b->offset);
            nf_text(label, name, &res[k], where);
        }
    }
    return DFL_OK;
}

static int stats_batch(dfl_reader *r, const char *label, const dfl_batch *b, void *vctx, dfl_err *e)
{
    stream_ctx *c = vctx;
    const dfl_stream_info *in = dfl_reader_info(r);
    (void)label;
    dfl_scan_job jobs[DFL_MAX_LAYERS + 3];
    dfl_stats res[DFL_MAX_LAYERS + 3];
    const char *fields[3] = {"seq_lens", "input_ids", "loss_mask"};
    jobs[0] = (dfl_scan_job){.data = b->seq_lens, .fd = -1, .dtype = DFL_U32, .n = b->n_seqs};
    jobs[1] = (dfl_scan_job){.data = b->input_ids, .fd = -1, .dtype = DFL_I32, .n = b->n_tokens};
    jobs[2] = (dfl_scan_job){.data = b->loss_mask, .fd = -1, .dtype = DFL_U8, .n = b->n_tokens};
    for (uint32_t k = 0; k < b->n_layers; k++)
        jobs[3 + k] = (dfl_scan_job){.data = b->layers[k], .fd = -1, .dtype = b->dtype, .n = b->n_tokens * b->hidden};
    int rc = dfl_scan_stats_many(jobs, 3 + b->n_layers, opt.threads, res, e);
    if (rc)
        return rc;
    for (uint32_t k = 0; k < 3 + b->n_layers; k++) {
        char name[64];
        if (k < 3)
            snprintf(name, sizeof name, "batch%" PRIu64 ".%s", b->index, fields[k]);
        else
            snprintf(name, sizeof name, "batch%" PRIu64 ".layer%d", b->index, in->layers[k - 3]);
        stats_row(name, jobs[k].dtype, &res[k], c->arr);
    }
    c->batches++;
    return DFL_OK;
}

/* --to-safetensors: keeps every batch (their memory backs the writer's tensors) until written. */
typedef struct convert_ctx {
    dfl_st_writer *w;
    dfl_batch *b;
    size_t n, cap;
} convert_ctx;

static int convert_batch(dfl_reader *r, const char *label, const dfl_batch *b, void *vctx, dfl_err *e)
{
    convert_ctx *c = vctx;
    const dfl_stream_info *in = dfl_reader_info(r);
    (void)label;
    if (!dfl_grow(&c->b, &c->cap, c->n, sizeof *c->b, 64))
        return dfl_fail(e, DFL_ENOMEM, "out of memory keeping batches");
    /* take the batch over (each_batch frees what is left in *b: nothing once owned is moved) */
    c->b[c->n] = *b;
    ((dfl_batch *)b)->owned = NULL;
    const dfl_batch *k = &c->b[c->n++];
    char name[96];
    int64_t s = k->n_seqs, t = (int64_t)k->n_tokens, th[2] = {(int64_t)k->n_tokens, k->hidden};
    int rc;
    snprintf(name, sizeof name, "batch%" PRIu64 ".seq_lens", k->index);
    if ((rc = dfl_st_writer_add(c->w, name, DFL_U32, 1, &s, k->seq_lens, e)))
        return rc;
    snprintf(name, sizeof name, "batch%" PRIu64 ".input_ids", k->index);
    if ((rc = dfl_st_writer_add(c->w, name, DFL_I32, 1, &t, k->input_ids, e)))
        return rc;
    snprintf(name, sizeof name, "batch%" PRIu64 ".loss_mask", k->index);
    if ((rc = dfl_st_writer_add(c->w, name, DFL_U8, 1, &t, k->loss_mask, e)))
        return rc;
    for (uint32_t l = 0; l < k->n_layers; l++) {
        snprintf(name, sizeof name, "batch%" PRIu64 ".layer%d", k->index, in->layers[l]);
        if ((rc = dfl_st_writer_add(c->w, name, k->dtype, 2, th, k->layers[l], e)))
            return rc;
    }
    return DFL_OK;
}

static int convert_stream(dfl_reader *r, const char *label, dfl_err *e)
{
    convert_ctx c = {0};
    c.w = dfl_st_writer_new();
    if (!c.w)
        return dfl_fail(e, DFL_ENOMEM, "out of memory");
    int rc = each_batch(r, label, convert_batch, &c, e);
    const dfl_stream_info *in = dfl_reader_info(r);
    char v[512];
    if (!rc)
        rc = dfl_st_writer_meta(c.w, "dfl.kind", in->kind == DFL_KIND_HIDDEN ? "hidden" : "tokens", e);
    if (!rc)
        rc = dfl_st_writer_meta(c.w, "dfl.producer", in->producer, e);
    snprintf(v, sizeof v, "%zu", c.n);
    if (!rc)
        rc = dfl_st_writer_meta(c.w, "dfl.n_batches", v, e);
    snprintf(v, sizeof v, "%" PRId64, in->vocab_size);
    if (!rc)
        rc = dfl_st_writer_meta(c.w, "dfl.vocab_size", v, e);
    if (!rc && in->fingerprint[0])
        rc = dfl_st_writer_meta(c.w, "dfl.fingerprint", in->fingerprint, e);
    if (!rc && in->kind == DFL_KIND_HIDDEN) {
        snprintf(v, sizeof v, "%" PRId64, in->hidden_size);
        rc = dfl_st_writer_meta(c.w, "dfl.hidden_size", v, e);
        size_t k = 0;
        v[0] = 0;
        for (int i = 0; i < in->n_layers && k < sizeof v; i++)
            k += (size_t)snprintf(v + k, sizeof v - k, "%s%d", i ? "," : "", in->layers[i]);
        if (!rc)
            rc = dfl_st_writer_meta(c.w, "dfl.layers", v, e);
        if (!rc)
            rc = dfl_st_writer_meta(c.w, "dfl.dtype", dfl_dtype_lower(in->dtype), e);
    }
    if (!rc) {
        rc = dfl_st_write(c.w, opt.out, e);
        output_failed = rc != 0;
    }
    if (!rc)
        dfl_info("%s: wrote %zu batches to %s", label, c.n, opt.out);
    dfl_st_writer_free(c.w);
    for (size_t i = 0; i < c.n; i++)
        dfl_batch_free(&c.b[i]);
    free(c.b);
    return rc;
}

typedef struct stream_count {
    uint64_t frames, batches, tokens;
} stream_count;

static int count_frame(const dfl_frame *f, const dfl_batch *b, void *ctx)
{
    stream_count *c = ctx;
    c->frames++;
    if (b) {
        c->batches++;
        c->tokens += b->n_tokens;
    }
    return DFL_OK;
}

static int verify_stream(dfl_reader *r, const char *label, dfl_err *e)
{
    stream_count c = {.frames = 1};   /* the header */
    int rc = each_frame(r, count_frame, &c, e);
    if (rc)
        return rc;
    char what[160];
    snprintf(what, sizeof what, "%" PRIu64 " frames, %" PRIu64 " batches, %" PRIu64 " tokens, checksums verified",
             c.frames, c.batches, c.tokens);
    verified(label, "dfl-stream", what);
    return DFL_OK;
}

static int stream_path(const char *path)
{
    dfl_err e = {0};
    dfl_reader *r;
    const char *label = strcmp(path, "-") == 0 ? "(stdin)" : path;
    int rc = dfl_reader_open(&r, path, NULL, &e);
    if (rc) {
        if (opt.mode == M_VERIFY)
            verify_failed(label, &e);
        report(&e);
        return rc;
    }
    stream_ctx c = {0};
    json_t *src = NULL;
    if (opt.json && (opt.mode == M_CHECK_NAN || opt.mode == M_STATS)) {
        src = j_source(label, "dfl-stream");
        c.arr = json_array();
        json_object_set_new(src, "tensors", c.arr);
    }
    switch (opt.mode) {
    case M_LIST:
        rc = list_stream(r, label, &e);
        break;
    case M_CHECK_NAN: {
        double t0 = dfl_now();
        rc = each_batch(r, label, nan_batch, &c, &e);
        double dt = dfl_now() - t0;
        if (!rc) {
            char b1[16];
            if (c.bad_arrays) {
                dfl_info("%s: %" PRIu64 " of %" PRIu64 " hidden-state arrays hold NaN or Inf", label, c.bad_arrays,
                         c.arrays);
                fail_status(2);
            } else {
                dfl_info("%s: all %" PRIu64 " hidden-state arrays of %" PRIu64 " batches finite (%s)", label, c.arrays,
                         c.batches, dfl_fmt_bytes((double)c.bytes, b1, sizeof b1));
            }
            dfl_verbose("%s: read and scanned in %.3f s", label, dt);
        }
        break;
    }
    case M_STATS:
        column_header(STATS_COLS);
        source_header(label, "dfl-stream");
        rc = each_batch(r, label, stats_batch, &c, &e);
        break;
    case M_VERIFY:
        rc = verify_stream(r, label, &e);
        if (rc)
            verify_failed(label, &e);
        break;
    case M_TO_ST:
        rc = convert_stream(r, label, &e);
        break;
    default:
        break;
    }
    if (rc)
        report(&e);
    dfl_reader_close(r);
    return rc;
}

/* ---------------------------------------------------------------- --diff */

typedef struct keyed {
    char *key;
    const dfl_tensor_view *v;
} keyed;

static int cmp_keyed(const void *a, const void *b)
{
    return strcmp(((const keyed *)a)->key, ((const keyed *)b)->key);
}

/* All tensors of the sets, keyed by name; tensors of a checkpoint's second file (the optimizer)
 * by "optimizer.safetensors:name". */
static keyed *keyed_of(const dfl_tensor_set *s, size_t ns, size_t *n)
{
    size_t total = 0;
    for (size_t i = 0; i < ns; i++)
        total += s[i].n;
    keyed *k = calloc(total ? total : 1, sizeof *k);
    if (!k)
        return NULL;
    size_t m = 0;
    for (size_t i = 0; i < ns; i++) {
        const char *base = strrchr(s[i].label, '/');
        base = base ? base + 1 : s[i].label;
        for (size_t j = 0; j < s[i].n; j++) {
            size_t len = strlen(base) + strlen(s[i].t[j].name) + 2;
            k[m].key = malloc(len);
            if (!k[m].key)
                break;
            if (i == 0)
                snprintf(k[m].key, len, "%s", s[i].t[j].name);
            else
                snprintf(k[m].key, len, "%s:%s", base, s[i].t[j].name);
            k[m++].v = &s[i].t[j];
        }
    }
    qsort(k, m, sizeof *k, cmp_keyed);
    *n = m;
    return k;
}

static void free_keyed(keyed *k, size_t n)
{
    for (size_t i = 0; i < n; i++)
        free(k[i].key);
    free(k);
}

static bool same_shape(const dfl_tensor_view *a, const dfl_tensor_view *b)
{
    if (a->ndim != b->ndim)
        return false;
    for (int i = 0; i < a->ndim; i++)
        if (a->shape[i] != b->shape[i])
            return false;
    return true;
}

#define DIFF_COLS "name\tmax_abs\tmax_rel\tdiffering\tnote"

static void diff_row(json_t *arr, const char *key, const dfl_diff_result *r, const char *note)
{
    if (opt.json) {
        json_t *o = json_object();
        json_object_set_new(o, "name", json_string(key));
        if (r) {
            json_object_set_new(o, "max_abs", isfinite(r->max_abs) ? json_real(r->max_abs) : json_string("inf"));
            json_object_set_new(o, "max_rel", isfinite(r->max_rel) ? json_real(r->max_rel) : json_string("inf"));
            json_object_set_new(o, "differing", json_integer((json_int_t)r->ndiff));
            json_object_set_new(o, "numel", json_integer((json_int_t)r->n));
            json_object_set_new(o, "first", r->first == DFL_SCAN_NONE ? json_null() : json_integer((json_int_t)r->first));
        }
        if (note && *note)
            json_object_set_new(o, "note", json_string(note));
        json_array_append_new(arr, o);
        return;
    }
    if (r)
        printf("%s\t%.9g\t%.9g\t%" PRIu64 "\t%s\n", key, r->max_abs, r->max_rel, r->ndiff, note ? note : "");
    else
        printf("%s\t-\t-\t-\t%s\n", key, note ? note : "");
}

/* config.json and trainer_state.json of two checkpoint directories: equal as JSON? */
static int diff_json_members(const char *a, const char *b, json_t *arr, dfl_err *e)
{
    static const char *const names[] = {"config.json", "trainer_state.json"};
    int differ = 0;
    for (size_t i = 0; i < DFL_ARRAY_LEN(names); i++) {
        char *pa = dfl_path_join(a, names[i]), *pb = dfl_path_join(b, names[i]);
        json_t *ja = NULL, *jb = NULL;
        dfl_err ea, eb;
        int ra = pa ? dfl_json_load_file(pa, &ja, &ea) : DFL_ENOMEM;
        int rb = pb ? dfl_json_load_file(pb, &jb, &eb) : DFL_ENOMEM;
        if (ra && rb) {
            /* neither has it */
        } else if (ra || rb) {
            diff_row(arr, names[i], NULL, ra ? "only in B" : "only in A");
            differ = 1;
        } else if (!json_equal(ja, jb)) {
            diff_row(arr, names[i], NULL, "differs");
            differ = 1;
        }
        json_decref(ja);
        json_decref(jb);
        free(pa);
        free(pb);
    }
    (void)e;
    return differ;
}

static int diff_paths(const char *a, const char *b)
{
    dfl_err e = {0};
    dfl_input_kind ka, kb;
    if (dfl_input_detect(a, &ka, &e) || dfl_input_detect(b, &kb, &e)) {
        report(&e);
        return 2;
    }
    if (ka == DFL_INPUT_STREAM || kb == DFL_INPUT_STREAM) {
        dfl_fail(&e, DFL_EUNSUP, "--diff compares tensor files and checkpoints, not .dfl streams "
                 "(convert them with --to-safetensors first)");
        report(&e);
        return 2;
    }
    dfl_tensor_set *sa = NULL, *sb = NULL;
    size_t na = 0, nb = 0;
    if (dfl_tensor_sets_open(a, 0, &sa, &na, &e) || dfl_tensor_sets_open(b, 0, &sb, &nb, &e)) {
        report(&e);
        dfl_tensor_sets_close(sa, na);
        return 2;
    }
    size_t ma, mb;
    keyed *A = keyed_of(sa, na, &ma), *B = keyed_of(sb, nb, &mb);
    dfl_diff_job *jobs = calloc(ma + 1, sizeof *jobs);
    size_t *ja = calloc(ma + 1, sizeof *ja), *jb = calloc(ma + 1, sizeof *jb);
    dfl_diff_result *res = calloc(ma + 1, sizeof *res);
    int status = 0;
    if (!A || !B || !jobs || !ja || !jb || !res) {
        dfl_fail(&e, DFL_ENOMEM, "out of memory");
        report(&e);
        status = 2;
        goto done;
    }
    /* pair by key (both sorted) */
    size_t nj = 0;
    for (size_t i = 0, j = 0; i < ma && j < mb;) {
        int c = strcmp(A[i].key, B[j].key);
        if (c < 0) {
            i++;
        } else if (c > 0) {
            j++;
        } else {
            if (same_shape(A[i].v, B[j].v)) {
                jobs[nj] = (dfl_diff_job){A[i].v->data, B[j].v->data, A[i].v->dtype, B[j].v->dtype, A[i].v->numel};
                ja[nj] = i;
                jb[nj++] = j;
            }
            i++;
            j++;
        }
    }
    if (dfl_diff_many(jobs, nj, opt.threads, res, &e)) {
        report(&e);
        status = 2;
        goto done;
    }
    json_t *arr = NULL;
    if (opt.json) {
        json_t *o = json_object();
        json_object_set_new(o, "a", json_string(a));
        json_object_set_new(o, "b", json_string(b));
        arr = json_array();
        json_object_set_new(o, "tensors", arr);
        json_array_append_new(j_inputs, o);
    }
    column_header(DIFF_COLS);
    size_t differ = 0, only = 0, common = 0;
    for (size_t i = 0, j = 0, k = 0; i < ma || j < mb;) {
        int c = i >= ma ? 1 : j >= mb ? -1 : strcmp(A[i].key, B[j].key);
        if (c < 0) {
            diff_row(arr, A[i++].key, NULL, "only in A");
            only++;
            continue;
        }
        if (c > 0) {
            diff_row(arr, B[j++].key, NULL, "only in B");
            only++;
            continue;
        }
        const dfl_tensor_view *va = A[i].v, *vb = B[j].v;
        char note[300] = "";
        common++;
        if (!same_shape(va, vb)) {
            char s1[128], s2[128];
            snprintf(note, sizeof note, "shape %s vs %s", shape_compact(va, s1, sizeof s1), shape_compact(vb, s2, sizeof s2));
            diff_row(arr, A[i].key, NULL, note);
            differ++;
        } else {
            while (k < nj && ja[k] < i)
                k++;
            const dfl_diff_result *r = k < nj && ja[k] == i ? &res[k] : NULL;
            if (va->dtype != vb->dtype)
                snprintf(note, sizeof note, "dtype %s vs %s", dfl_dtype_lower(va->dtype), dfl_dtype_lower(vb->dtype));
            if (va->dtype != vb->dtype || (r && r->ndiff))
                differ++;
            diff_row(arr, A[i].key, r, note);
        }
        i++;
        j++;
    }
    size_t json_differ = 0;
    if (ka == DFL_INPUT_CKPT_DIR && kb == DFL_INPUT_CKPT_DIR)
        json_differ = (size_t)diff_json_members(a, b, arr, &e);
    if (differ || only || json_differ) {
        dfl_info("%s and %s differ: %zu of %zu common tensors differ, %zu in only one%s", a, b, differ, common, only,
                 json_differ ? ", JSON files differ" : "");
        status = 1;
    } else {
        dfl_info("%s and %s are identical (%zu tensors)", a, b, common);
    }
done:
    free(jobs);
    free(ja);
    free(jb);
    free(res);
    if (A)
        free_keyed(A, ma);
    if (B)
        free_keyed(B, mb);
    dfl_tensor_sets_close(sa, na);
    dfl_tensor_sets_close(sb, nb);
    return status;
}

/* ---------------------------------------------------------------- main */

static void usage(void)
{
    printf("Usage: %s [options] PATH...\n"
           "List, check and compare checkpoints and tensor files. PATH is a safetensors file, a\n"
           "Hugging Face model directory (single or sharded), a dfl checkpoint directory, a PyTorch\n"
           ".bin/.pt file (torch.save's zip format; nothing in it is executed), or a .dfl stream\n"
           "('-' for stdin). Kinds are told by content.\n"
           "\n"
           "Modes (default: list one line per tensor, or per frame for a stream):\n"
           "      --check-nan          scan every floating tensor (and every hidden-state array of a\n"
           "                           stream) for NaN and Inf; report each offending one with its\n"
           "                           count and first flat index; exit 2 if any is not finite\n"
           "      --stats              per tensor: min, max, mean, std, max |x|, non-finite count\n"
           "      --verify             full structural check (checksums for streams); exit 2 on a defect\n"
           "      --diff A B           per tensor max absolute and relative difference; exit 0 if\n"
           "                           identical, 1 if they differ, 2 on invalid input\n"
           "      --to-safetensors OUT write a stream's batches as tensors batch<N>.<field>\n"
           "Options:\n"
           "      --json               the same report as JSON on stdout\n"
           "  -j, --threads N          threads for scanning (default 0: all cores)\n"
           "      --mmap               scan safetensors data through the mapping instead of reading it\n"
           "  -q, --quiet              only errors on stderr\n"
           "  -v, --verbose            more on stderr (scan rates)\n"
           "      --help               this help\n"
           "      --version            version\n"
           "\n"
           "Exit status: 0 ok (all finite, identical), 1 usage or runtime error (--diff: they differ),\n"
           "2 invalid data (NaN/Inf found, corrupt, truncated, not a checkpoint).\n",
           dfl_progname);
}

int main(int argc, char **argv)
{
    dfl_cli_init(argv[0]);
    enum { O_CHECK_NAN = 256, O_STATS, O_VERIFY, O_DIFF, O_TO_ST, O_JSON, O_MMAP, O_HELP, O_VERSION };
    static const struct option longopts[] = {
        {"check-nan", no_argument, NULL, O_CHECK_NAN},
        {"stats", no_argument, NULL, O_STATS},
        {"verify", no_argument, NULL, O_VERIFY},
        {"diff", no_argument, NULL, O_DIFF},
        {"to-safetensors", required_argument, NULL, O_TO_ST},
        {"json", no_argument, NULL, O_JSON},
        {"threads", required_argument, NULL, 'j'},
        {"mmap", no_argument, NULL, O_MMAP},
        {"quiet", no_argument, NULL, 'q'},
        {"verbose", no_argument, NULL, 'v'},
        {"help", no_argument, NULL, O_HELP},
        {"version", no_argument, NULL, O_VERSION},
        {NULL, 0, NULL, 0},
    };
    int c, modes = 0;
    dfl_err e = {0};
    while ((c = getopt_long(argc, argv, "j:qv", longopts, NULL)) != -1) {
        switch (c) {
        case O_CHECK_NAN: opt.mode = M_CHECK_NAN; modes++; break;
        case O_STATS: opt.mode = M_STATS; modes++; break;
        case O_VERIFY: opt.mode = M_VERIFY; modes++; break;
        case O_DIFF: opt.mode = M_DIFF; modes++; break;
        case O_TO_ST: opt.mode = M_TO_ST; opt.out = optarg; modes++; break;
        case O_JSON: opt.json = true; break;
        case O_MMAP: opt.mmap = true; break;
        case 'j': {
            int64_t v;
            if (dfl_parse_i64(optarg, 0, 4096, &v, "--threads", &e))
                return dfl_cli_usage_error("%s", e.msg);
            opt.threads = (int)v;
            break;
        }
        case 'q': dfl_log_level = DFL_LOG_ERROR; break;
        case 'v': dfl_log_level++; break;
        case O_HELP: usage(); return 0;
        case O_VERSION: puts(dfl_cli_version_line()); return 0;
        default: return dfl_cli_usage_error("unknown option");
        }
    }
    int npaths = argc - optind;
    if (modes > 1)
        return dfl_cli_usage_error("--check-nan, --stats, --verify, --diff and --to-safetensors "
                                   "are exclusive");
    if (npaths < 1)
        return dfl_cli_usage_error("no PATH given");
    if (opt.mode == M_DIFF && npaths != 2)
        return dfl_cli_usage_error("--diff takes exactly two paths, A and B");
    if (opt.mode == M_TO_ST && (npaths != 1 || opt.json))
        return dfl_cli_usage_error("--to-safetensors converts one stream (and prints no JSON)");
    if (opt.mode == M_TO_ST && (!*opt.out || strcmp(opt.out, "-") == 0))
        return dfl_cli_usage_error("--to-safetensors needs an output file name");
    int nstdin = 0;
    for (int i = optind; i < argc; i++)
        nstdin += strcmp(argv[i], "-") == 0;
    if (nstdin > 1)
        return dfl_cli_usage_error("'-' (stdin) can be given once");
    opt.multi = npaths > 1;
    j_inputs = json_array();

    if (opt.mode == M_DIFF) {
        worst = diff_paths(argv[optind], argv[optind + 1]);
    } else {
        for (int i = optind; i < argc; i++) {
            dfl_input_kind kind;
            if (dfl_input_detect(argv[i], &kind, &e)) {
                if (opt.mode == M_VERIFY)
                    verify_failed(argv[i], &e);
                report(&e);
                continue;
            }
            if (opt.mode == M_TO_ST && kind != DFL_INPUT_STREAM) {
                dfl_fail(&e, DFL_EUSAGE, "%s: --to-safetensors converts a .dfl stream, and this is %s", argv[i],
                         dfl_input_kind_name(kind));
                report(&e);
                continue;
            }
            if (kind == DFL_INPUT_STREAM)
                stream_path(argv[i]);
            else
                tensor_path(argv[i]);
        }
    }
    if (opt.json) {
        json_t *root = json_object();
        json_object_set_new(root, opt.mode == M_DIFF ? "diff" : "inputs", j_inputs);
        if (opt.mode == M_CHECK_NAN)
            json_object_set_new(root, "finite", json_boolean(worst == 0));
        if (opt.mode == M_VERIFY)
            json_object_set_new(root, "ok", json_boolean(worst == 0));
        if (opt.mode == M_DIFF)
            json_object_set_new(root, "identical", json_boolean(worst == 0));
        char *s = dfl_json_dump(root, 2);
        if (s) {
            fputs(s, stdout);
            fputc('\n', stdout);
            free(s);
        }
        json_decref(root);
    } else {
        json_decref(j_inputs);
    }
    if (fflush(stdout) != 0 || ferror(stdout)) {
        output_failed = true;
        dfl_fail_errno(&e, DFL_EIO, errno, "writing to stdout");
        report(&e);
    }
    return worst;
}
