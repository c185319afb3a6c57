/* frame_write.c: the .dfl frame writer (dfl-frame(5)). Frames are written front to back with
 * writev(2) straight from the caller's arrays (header, sections, padding, trailer), hashed with
 * streaming XXH3 in cache-sized pieces just before each piece is written: no copy of the layer
 * data unless the frame is compressed. A file is written under a temporary name beside it and
 * renamed into place after END; pipes are enlarged. Two ways to copy less: on a pipe, layer
 * arrays can be handed over with vmsplice(2); on a file, batch frames can be reserved, filled in
 * place through a mapping and committed (dfl_writer_reserve / dfl_writer_commit). */
#include "frame.h"

#include <errno.h>
#include <fcntl.h>
#include <limits.h>
#include <poll.h>
#include <pthread.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/ioctl.h>
#include <sys/mman.h>
#include <sys/stat.h>
#include <sys/uio.h>
#include <unistd.h>

#include <zstd.h>

#include "batch_check.h"
#include "bytes.h"
#include "frame_hasher.h"
#include "json.h"
#include "util.h"
#include "xxh.h"

#define WRITE_CHUNK (4u << 20)       /* default opts.chunk: hash this much, then write it while
                                        it is in the cache */
#define WRITE_CHUNK_PIPE (256u << 10) /* on a pipe: smaller pieces, so that the consumer drains
                                        the pipe while the next piece is hashed */
#define PIPE_SIZE (64u << 20)         /* default opts.pipe_size */
#define HASH_THREAD_MIN (4u << 20)    /* frames from this size on, and their pieces from
                                         HASH_PIECE_MIN on, are hashed by the hash thread
                                         (opts.hash_thread) */
#define HASH_PIECE_MIN (256u << 10)
#define GROUP_IOV 64

static const uint8_t zeros[64];

struct dfl_writer {
    char *name;
    int fd;
    bool own_fd;
    bool atomic;
    dfl_atomic at;
    bool want_index;
    dfl_writer_opts opts;
    int kind;
    int n_layers;
    int64_t hidden, vocab;
    dfl_dtype dtype;
    uint64_t bytes, seq, n_batches, n_tokens, n_seqs;
    dfl_index_entry *entries;
    size_t cap;
    XXH3_state_t *xx;
    dfl_hasher *hasher;          /* the hash thread, started at the first frame that uses it */
    bool hasher_off;             /* not used (opts.hash_thread, not a pipe, or no thread) */
    uint32_t pipe_bytes;         /* the pipe's capacity after dfl_pipe_enlarge; 0: not a pipe */
    ZSTD_CCtx *cctx;
    uint8_t *raw;     /* gathered (and shuffled) payload, for compression */
    size_t rawcap;
    uint8_t *zb;      /* compressed payload */
    size_t zcap;
    int failed;
    char failed_msg[sizeof(((dfl_err *)0)->msg)];
    /* vmsplice (opts.vmsplice on a pipe) */
    bool may_splice;  /* set at open, never changed: pages may be spliced (dfl_writer_read_upto
                         then asks the pipe) */
    bool splice;      /* still allowed (cleared when the system refuses it) */
    uint64_t pushed;  /* bytes the pipe has accepted (every write(2) and vmsplice(2) counted
                         once it returns); read by other threads: __atomic only */
    /* frames written in place (dfl_writer_reserve); mu guards failed and the counters below,
     * which the reserving thread reads while the committing one updates bytes, seq, ... */
    pthread_mutex_t mu;
    bool mu_init;
    bool in_place;    /* a regular file from its start, read-write: frames can be reserved */
    uint64_t res_end, res_seq, res_index;   /* next reservation's offset, frame seq, batch index */
    int res_out;      /* reserved, not committed */
};

static int wfail(dfl_writer *w, dfl_err *e, int rc)
{
    if (w->mu_init)
        pthread_mutex_lock(&w->mu);
    w->failed = rc;
    memcpy(w->failed_msg, e->msg, sizeof w->failed_msg);
    if (w->mu_init)
        pthread_mutex_unlock(&w->mu);
    return rc;
}

/* After a failed write to fd: true to try again (EINTR, or EAGAIN once fd is writable). */
static bool write_again(int fd)
{
    if (errno == EINTR)
        return true;
    if (errno == EAGAIN || errno == EWOULDBLOCK) {
        struct pollfd p = {.fd = fd, .events = POLLOUT};
        poll(&p, 1, -1);
        return true;
    }
    return false;
}

/* Drops the first done bytes of the list *iov of *n pieces. */
static void iov_advance(struct iovec **iov, int *n, size_t done)
{
    while (*n > 0 && done >= (*iov)->iov_len) {
        done -= (*iov)->iov_len;
        (*iov)++;
        (*n)--;
    }
    if (*n > 0) {
        (*iov)->iov_base = (uint8_t *)(*iov)->iov_base + done;
        (*iov)->iov_len -= done;
    }
}

/* writev of the whole list, through short writes, EINTR and EAGAIN. */
static int writev_all(dfl_writer *w, struct iovec *iov, int n, dfl_err *e)
{
    while (n > 0) {
        ssize_t k = writev(w->fd, iov, n);
        if (k < 0) {
            if (write_again(w->fd))
                continue;
            if (errno == EPIPE)
                return dfl_fail(e, DFL_EPIPE, "%s: the reader went away (broken pipe)", w->name);
            return dfl_fail_errno(e, DFL_EIO, errno, "%s: write failed", w->name);
        }
        __atomic_fetch_add(&w->pushed, (uint64_t)k, __ATOMIC_RELEASE);
        iov_advance(&iov, &n, (size_t)k);
    }
    return DFL_OK;
}

/* vmsplice of the whole list into the pipe (the pages are referenced, not copied), through
 * partial transfers, EINTR and EAGAIN. If the system refuses it, vmsplice is turned off for good
 * and the rest is written with writev. */
static int vmsplice_all(dfl_writer *w, struct iovec *iov, int n, dfl_err *e)
{
    while (n > 0) {
        ssize_t k = vmsplice(w->fd, iov, (unsigned long)n, 0);
        if (k < 0) {
            if (write_again(w->fd))
                continue;
            if (errno == EPIPE)
                return dfl_fail(e, DFL_EPIPE, "%s: the reader went away (broken pipe)", w->name);
            w->splice = false; /* EINVAL, EFAULT, ENOSYS, ...: copy instead */
            return writev_all(w, iov, n, e);
        }
        __atomic_fetch_add(&w->pushed, (uint64_t)k, __ATOMIC_RELEASE);
        iov_advance(&iov, &n, (size_t)k);
    }
    return DFL_OK;
}

/* Writes a group of pieces: runs of stable pieces (which the caller keeps unchanged until the
 * consumer has read them) are spliced when vmsplice is on, the rest is copied. */
static int write_group(dfl_writer *w, struct iovec *g, const bool *stable, int n, dfl_err *e)
{
    for (int i = 0; i < n;) {
        bool sp = w->splice && stable[i];
        int j = i + 1;
        while (j < n && (w->splice && stable[j]) == sp)
            j++;
        int rc = sp ? vmsplice_all(w, g + i, j - i, e) : writev_all(w, g + i, j - i, e);
        if (rc)
            return rc;
        i = j;
    }
    return DFL_OK;
}

/* Writes one frame whose payload is the concatenation of pieces (stored_len bytes in all):
 * frame header, pieces, padding, trailer. Pieces are hashed and written in groups of about
 * opts.chunk bytes. stable (may be NULL): which pieces stay unchanged until the consumer has
 * read them (they may be spliced). */
static int write_frame(dfl_writer *w, uint32_t type, uint32_t flags, const struct iovec *pieces, int npieces,
                       uint64_t stored_len, uint64_t raw_len, const bool *stable, dfl_err *e)
{
    uint8_t hdr[64], trailer[8];
    memset(hdr, 0, sizeof hdr);
    memcpy(hdr, DFL_FRAME_MAGIC, 4);
    hdr[4] = DFL_FRAME_MAJOR;
    hdr[5] = (uint8_t)flags;
    dfl_put_le16(hdr + 6, (uint16_t)type);
    dfl_put_le64(hdr + 8, stored_len);
    dfl_put_le64(hdr + 16, raw_len);
    dfl_put_le64(hdr + 24, w->seq);
    dfl_put_le64(hdr + 56, XXH3_64bits(hdr, 56));
    uint64_t pad = (64 - (stored_len + 8) % 64) % 64;

    XXH3_64bits_reset(w->xx);
    /* the hash thread, for the large pieces of a large frame: it hashes a piece while this thread
     * writes it (both only read it), so that the writing thread's time goes to write(2) or
     * vmsplice(2) alone. A piece's job ends (dfl_hasher_finish) before the next piece is hashed,
     * here or there, so the state sees every byte in order, and before the trailer is made; on
     * a failed write it is cancelled before returning (the caller may then free the arrays). */
    dfl_hasher *hs = NULL;
    if (!w->hasher_off && 64 + stored_len >= HASH_THREAD_MIN) {
        if (!w->hasher && !(w->hasher = dfl_hasher_new()))
            w->hasher_off = true;   /* no thread to be had: hash here, from now on */
        hs = w->hasher;
    }
    struct iovec g[GROUP_IOV + 1];
    bool gs[GROUP_IOV + 1];
    int gn = 0;
    size_t gbytes = 0;
    int rc;
    /* all pieces in order: header, payload pieces, padding */
    for (int k = -1; k <= npieces; k++) {
        const uint8_t *base;
        size_t len;
        if (k < 0)
            base = hdr, len = 64;
        else if (k == npieces)
            base = zeros, len = (size_t)pad;
        else
            base = pieces[k].iov_base, len = pieces[k].iov_len;
        bool threaded = hs && k >= 0 && k < npieces && len >= HASH_PIECE_MIN;
        if (hs)
            dfl_hasher_finish(hs); /* the previous piece's job, if any */
        if (threaded) {
            dfl_hasher_start(hs, w->xx, base, len);
            dfl_hasher_avail(hs, len);
        }
        size_t off = 0;
        while (off < len) {
            size_t take = len - off;
            if (take > w->opts.chunk - gbytes)
                take = w->opts.chunk - gbytes;
            if (!threaded)
                XXH3_64bits_update(w->xx, base + off, take);
            g[gn].iov_base = (void *)(base + off);
            g[gn].iov_len = take;
            gs[gn] = stable && k >= 0 && k < npieces && stable[k];
            gn++;
            gbytes += take;
            off += take;
            if (gbytes == w->opts.chunk || gn == GROUP_IOV) {
                if ((rc = write_group(w, g, gs, gn, e))) {
                    if (hs)
                        dfl_hasher_cancel(hs);
                    return rc;
                }
                gn = 0;
                gbytes = 0;
            }
        }
    }
    dfl_put_le64(trailer, XXH3_64bits_digest(w->xx));
    g[gn].iov_base = trailer;
    g[gn].iov_len = 8;
    gs[gn] = false;
    gn++;
    if ((rc = write_group(w, g, gs, gn, e)))
        return rc;
    w->bytes += 64 + stored_len + pad + 8;
    w->seq++;
    return DFL_OK;
}

/* ---- opening ---------------------------------------------------------------------------------- */

static int check_info(const dfl_stream_info *in, const char *name, dfl_err *e)
{
    if (in->kind != DFL_KIND_TOKENS && in->kind != DFL_KIND_HIDDEN)
        return dfl_fail(e, DFL_EUSAGE, "%s: stream kind %d is neither tokens nor hidden", name, in->kind);
    if (memchr(in->producer, 0, sizeof in->producer) == NULL || memchr(in->fingerprint, 0, sizeof in->fingerprint) == NULL)
        return dfl_fail(e, DFL_EUSAGE, "%s: producer or fingerprint is not a terminated string", name);
    if (in->vocab_size < 0 || in->vocab_size > INT32_MAX)
        return dfl_fail(e, DFL_EUSAGE, "%s: vocab_size %lld is out of range", name, (long long)in->vocab_size);
    if (in->meta && !json_is_object(in->meta))
        return dfl_fail(e, DFL_EUSAGE, "%s: meta must be a JSON object", name);
    if (in->kind == DFL_KIND_TOKENS)
        return DFL_OK;
    if (in->n_layers < 1 || in->n_layers > DFL_MAX_LAYERS)
        return dfl_fail(e, DFL_EUSAGE, "%s: %d layers: a hidden stream has 1 to %d", name, in->n_layers, DFL_MAX_LAYERS);
    if (in->hidden_size < 1 || in->hidden_size > INT32_MAX)
        return dfl_fail(e, DFL_EUSAGE, "%s: hidden_size %lld is out of range", name, (long long)in->hidden_size);
    if (in->dtype != DFL_BF16 && in->dtype != DFL_F16 && in->dtype != DFL_F32)
        return dfl_fail(e, DFL_EUSAGE, "%s: dtype %s: a hidden stream holds bf16, f16 or f32", name,
                        dfl_dtype_lower(in->dtype));
    for (int k = 0; k < in->n_layers; k++) {
        if (in->layers[k] < 0)
            return dfl_fail(e, DFL_EUSAGE, "%s: layer id %d is negative", name, in->layers[k]);
        for (int i = 0; i < k; i++)
            if (in->layers[i] == in->layers[k])
                return dfl_fail(e, DFL_EUSAGE, "%s: layer %d is listed twice", name, in->layers[k]);
    }
    return DFL_OK;
}

static const char *dtype_key(dfl_dtype t)
{
    return t == DFL_BF16 ? "bf16" : t == DFL_F16 ? "f16" : "f32";
}

/* The text of a HEADER or NOTE payload: compact JSON with sorted keys, within the limits that a
 * reader accepts (dfl-frame(5) JSON PAYLOADS: 16 MiB, nesting, ...), checked by parsing it back,
 * so that a writer never writes what its reader refuses. *out is malloc'ed. */
static int json_payload(dfl_writer *w, const json_t *v, const char *what, char **out, size_t *n, dfl_err *e)
{
    *out = NULL;
    char *text = dfl_json_dump(v, 0);
    if (!text)
        return dfl_fail(e, DFL_EUSAGE, "%s: cannot serialize the %s (a string that is not valid UTF-8?)", w->name,
                        what);
    size_t len = strlen(text);
    json_t *back = NULL;
    dfl_err pe;
    int rc = len > (16u << 20) ? dfl_fail(e, DFL_EUSAGE, "%s: %s of %zu bytes is over 16 MiB", w->name, what, len)
             : dfl_json_parse(text, len, &back, what, &pe)
                 ? dfl_fail(e, DFL_EUSAGE, "%s: a reader would refuse this %s: %s", w->name, what, pe.msg)
                 : DFL_OK;
    json_decref(back);
    if (rc) {
        free(text);
        return rc;
    }
    *out = text;
    *n = len;
    return DFL_OK;
}

static int write_header(dfl_writer *w, const dfl_stream_info *in, dfl_err *e)
{
    json_t *j = json_object();
    if (!j)
        return dfl_fail(e, DFL_ENOMEM, "%s: out of memory", w->name);
    json_object_set_new(j, "format", json_string("dfl"));
    json_object_set_new(j, "version", json_pack("[ii]", DFL_FRAME_MAJOR, DFL_FRAME_MINOR));
    json_object_set_new(j, "kind", json_string(in->kind == DFL_KIND_TOKENS ? "tokens" : "hidden"));
    json_object_set_new(j, "producer", json_string(in->producer));
    if (in->vocab_size > 0)
        json_object_set_new(j, "vocab_size", json_integer(in->vocab_size));
    if (in->fingerprint[0])
        json_object_set_new(j, "fingerprint", json_string(in->fingerprint));
    if (in->meta)
        json_object_set(j, "meta", in->meta);
    if (in->kind == DFL_KIND_HIDDEN) {
        json_object_set_new(j, "hidden_size", json_integer(in->hidden_size));
        json_object_set_new(j, "dtype", json_string(dtype_key(in->dtype)));
        json_t *ly = json_array();
        for (int k = 0; k < in->n_layers; k++)
            json_array_append_new(ly, json_integer(in->layers[k]));
        json_object_set_new(j, "layers", ly);
    }
    char *text;
    size_t n;
    int rc = json_payload(w, j, "stream description", &text, &n, e);
    json_decref(j);
    if (rc)
        return rc;
    struct iovec iov = {text, n};
    rc = write_frame(w, DFL_FT_HEADER, 0, &iov, 1, n, n, NULL, e);
    free(text);
    return rc;
}

static void writer_free(dfl_writer *w)
{
    if (!w)
        return;
    free(w->name);
    free(w->entries);
    free(w->raw);
    free(w->zb);
    ZSTD_freeCCtx(w->cctx);
    if (w->xx)
        XXH3_freeState(w->xx);
    dfl_hasher_free(w->hasher);
    if (w->mu_init)
        pthread_mutex_destroy(&w->mu);
    free(w);
}

static int writer_start(dfl_writer **out, dfl_writer *w, const dfl_stream_info *info, const dfl_writer_opts *opts,
                        dfl_err *e)
{
    int rc;
    if (opts)
        w->opts = *opts;
    if (w->opts.zstd_level < 0 || w->opts.zstd_level > ZSTD_maxCLevel()) {
        rc = dfl_fail(e, DFL_EUSAGE, "%s: zstd level %d is out of range [0, %d]", w->name, w->opts.zstd_level,
                      ZSTD_maxCLevel());
        goto fail;
    }
    if ((rc = check_info(info, w->name, e)))
        goto fail;
    if (!w->opts.allow_tty && isatty(w->fd)) {
        rc = dfl_fail(e, DFL_EUSAGE, "%s: refusing to write binary data to a terminal (redirect it to a file or a pipe)",
                      w->name);
        goto fail;
    }
    struct stat st;
    if (fstat(w->fd, &st) != 0) {
        rc = dfl_fail_errno(e, DFL_EIO, errno, "%s: cannot stat", w->name);
        goto fail;
    }
    if (w->opts.pipe_size == 0)
        w->opts.pipe_size = PIPE_SIZE;
    if (w->opts.chunk == 0)
        w->opts.chunk = S_ISFIFO(st.st_mode) ? WRITE_CHUNK_PIPE : WRITE_CHUNK;
    if (S_ISFIFO(st.st_mode))
        w->pipe_bytes = dfl_pipe_enlarge(w->fd, w->opts.pipe_size);
    w->hasher_off = !S_ISFIFO(st.st_mode) || w->opts.hash_thread <= 0;
    /* an INDEX holds stream offsets: only where the stream starts the file */
    bool at_start = S_ISREG(st.st_mode) && lseek(w->fd, 0, SEEK_CUR) == 0;
    w->want_index = at_start && !w->opts.no_index;
    int fl = fcntl(w->fd, F_GETFL);
    w->in_place = at_start && fl >= 0 && (fl & O_ACCMODE) == O_RDWR && w->opts.zstd_level == 0;
    if (w->opts.vmsplice && S_ISFIFO(st.st_mode) && w->pipe_bytes > 0 && w->pipe_bytes <= INT_MAX) {
        int unread = 0; /* dfl_writer_read_upto needs FIONREAD, whose count is an int */
        w->may_splice = w->splice = ioctl(w->fd, FIONREAD, &unread) == 0;
    }
    if (pthread_mutex_init(&w->mu, NULL) != 0) {
        rc = dfl_fail(e, DFL_ENOMEM, "%s: cannot create a mutex", w->name);
        goto fail;
    }
    w->mu_init = true;
    w->kind = info->kind;
    w->n_layers = info->kind == DFL_KIND_HIDDEN ? info->n_layers : 0;
    w->hidden = info->kind == DFL_KIND_HIDDEN ? info->hidden_size : 0;
    w->dtype = info->kind == DFL_KIND_HIDDEN ? info->dtype : DFL_DT_INVALID;
    w->vocab = info->vocab_size;
    w->xx = XXH3_createState();
    if (!w->xx) {
        rc = dfl_fail(e, DFL_ENOMEM, "%s: out of memory", w->name);
        goto fail;
    }
    if ((rc = write_header(w, info, e)))
        goto fail;
    *out = w;
    return DFL_OK;
fail:
    dfl_writer_abort(w);
    return rc;
}

int dfl_writer_output_mode(const char *mode, dfl_writer_opts *o, dfl_err *e)
{
    if (strcmp(mode, "auto") && strcmp(mode, "vmsplice") && strcmp(mode, "write"))
        return dfl_fail(e, DFL_EUSAGE, "--output-mode: '%s' is not auto, vmsplice or write", mode);
    o->vmsplice = strcmp(mode, "write") != 0;
    return DFL_OK;
}

int dfl_writer_open_fd(dfl_writer **out, int fd, const char *name, const dfl_stream_info *info,
                       const dfl_writer_opts *opts, dfl_err *e)
{
    *out = NULL;
    dfl_writer *w = calloc(1, sizeof *w);
    if (!w || !(w->name = dfl_strdup(name))) {
        free(w);
        return dfl_fail(e, DFL_ENOMEM, "%s: out of memory", name);
    }
    w->fd = fd;
    return writer_start(out, w, info, opts, e);
}

int dfl_writer_open(dfl_writer **out, const char *path, const dfl_stream_info *info, const dfl_writer_opts *opts,
                    dfl_err *e)
{
    *out = NULL;
    if (strcmp(path, "-") == 0)
        return dfl_writer_open_fd(out, 1, "stdout", info, opts, e);
    dfl_writer *w = calloc(1, sizeof *w);
    if (!w || !(w->name = dfl_strdup(path))) {
        free(w);
        return dfl_fail(e, DFL_ENOMEM, "%s: out of memory", path);
    }
    w->fd = -1;
    struct stat st;
    int rc;
    if (stat(path, &st) == 0 && !S_ISREG(st.st_mode)) {
        /* a FIFO or a device: written directly, there is nothing to rename */
        if (S_ISDIR(st.st_mode)) {
            rc = dfl_fail(e, DFL_EUSAGE, "%s: is a directory", path);
            writer_free(w);
            return rc;
        }
        w->fd = open(path, O_WRONLY | O_CLOEXEC);
        if (w->fd < 0) {
            rc = dfl_fail_errno(e, DFL_EIO, errno, "%s: cannot open for writing", path);
            writer_free(w);
            return rc;
        }
        w->own_fd = true;
    } else {
        if ((rc = dfl_atomic_open(&w->at, path, e))) {
            writer_free(w);
            return rc;
        }
        w->atomic = true;
        w->fd = w->at.fd;
    }
    return writer_start(out, w, info, opts, e);
}

/* ---- batches ---------------------------------------------------------------------------------- */

static int check_batch(dfl_writer *w, const dfl_batch *b, uint32_t *max_len, dfl_err *e)
{
    uint64_t idx = w->n_batches, T = b->n_tokens;
    uint32_t S = b->n_seqs;
    if (T < 1 || T > UINT32_MAX || S < 1 || S > T)
        return dfl_fail(e, DFL_EUSAGE, "%s: batch %llu: %llu tokens in %u sequences (need 1 <= sequences <= tokens < 2^32)",
                        w->name, (unsigned long long)idx, (unsigned long long)T, S);
    if (!b->seq_lens || !b->input_ids || !b->loss_mask)
        return dfl_fail(e, DFL_EUSAGE, "%s: batch %llu: missing seq_lens, input_ids or loss_mask", w->name,
                        (unsigned long long)idx);
    if (w->kind == DFL_KIND_TOKENS) {
        if (b->n_layers != 0)
            return dfl_fail(e, DFL_EUSAGE, "%s: batch %llu has %u layers, but this is a tokens stream", w->name,
                            (unsigned long long)idx, b->n_layers);
    } else {
        if (b->n_layers != (uint32_t)w->n_layers || b->hidden != (uint64_t)w->hidden || b->dtype != w->dtype)
            return dfl_fail(e, DFL_EMISMATCH, "%s: batch %llu is %u layers x %u of %s, the stream is %d x %lld of %s",
                            w->name, (unsigned long long)idx, b->n_layers, b->hidden, dfl_dtype_lower(b->dtype),
                            w->n_layers, (long long)w->hidden, dfl_dtype_lower(w->dtype));
        for (uint32_t k = 0; k < b->n_layers; k++)
            if (!b->layers[k])
                return dfl_fail(e, DFL_EUSAGE, "%s: batch %llu: layer array %u is missing", w->name,
                                (unsigned long long)idx, k);
    }
    uint64_t sum;
    uint32_t mx;
    bool zero = dfl_seq_lens_scan(b->seq_lens, S, &sum, &mx) >= 0;
    if (zero || sum != T)
        return dfl_fail(e, DFL_EDATA, "%s: batch %llu: seq_lens %s (sum %llu, n_tokens %llu)", w->name,
                        (unsigned long long)idx, zero ? "include a 0" : "do not sum to n_tokens",
                        (unsigned long long)sum, (unsigned long long)T);
    if (b->max_len && b->max_len != mx)
        return dfl_fail(e, DFL_EDATA, "%s: batch %llu: max_len %u, but the longest sequence is %u", w->name,
                        (unsigned long long)idx, b->max_len, mx);
    uint32_t lim = w->vocab > 0 ? (uint32_t)w->vocab : 0x80000000u;
    int64_t i = dfl_ids_first_bad(b->input_ids, T, lim);
    if (i >= 0)
        return dfl_fail(e, DFL_EDATA, "%s: batch %llu: token %llu has id %d, outside [0, %u)", w->name,
                        (unsigned long long)idx, (unsigned long long)i, b->input_ids[i], lim);
    if ((i = dfl_mask_first_bad(b->loss_mask, T)) >= 0)
        return dfl_fail(e, DFL_EDATA, "%s: batch %llu: loss_mask[%llu] is %u (must be 0 or 1)", w->name,
                        (unsigned long long)idx, (unsigned long long)i, b->loss_mask[i]);
    *max_len = mx;
    return DFL_OK;
}

/* Copies a piece of the payload at offset off into the (zeroed) buffer, byte-shuffled with width
 * sw (1: plain copy); n = raw_len / sw elements in all. off is a multiple of 64. */
static void scatter(uint8_t *dst, uint64_t n, const uint8_t *src, size_t len, uint64_t off, unsigned sw)
{
    if (sw == 1) {
        memcpy(dst + off, src, len);
        return;
    }
    size_t m = len / sw, i0 = (size_t)(off / sw);
    if (sw == 2) {
        uint8_t *d0 = dst + i0, *d1 = dst + n + i0;
        for (size_t i = 0; i < m; i++) {
            d0[i] = src[2 * i];
            d1[i] = src[2 * i + 1];
        }
    } else {
        uint8_t *d0 = dst + i0, *d1 = dst + n + i0, *d2 = dst + 2 * n + i0, *d3 = dst + 3 * n + i0;
        for (size_t i = 0; i < m; i++) {
            d0[i] = src[4 * i];
            d1[i] = src[4 * i + 1];
            d2[i] = src[4 * i + 2];
            d3[i] = src[4 * i + 3];
        }
    }
    for (size_t j = 0; j < len % sw; j++) /* a partial last element: the rest of it is padding */
        dst[j * n + i0 + m] = src[m * sw + j];
}

static bool reserved_out(dfl_writer *w)
{
    pthread_mutex_lock(&w->mu);
    bool out = w->res_out > 0;
    pthread_mutex_unlock(&w->mu);
    return out;
}

static int grow(uint8_t **buf, size_t *cap, size_t need)
{
    if (need <= *cap)
        return 0;
    uint8_t *p = NULL;
    if (posix_memalign((void **)&p, 64, need) != 0)
        return -1;
    free(*buf);
    *buf = p;
    *cap = need;
    return 0;
}

int dfl_writer_batch(dfl_writer *w, const dfl_batch *b, dfl_err *e)
{
    if (w->failed)
        return dfl_fail(e, w->failed, "%s", w->failed_msg);
    if (reserved_out(w))
        return dfl_fail(e, DFL_EUSAGE, "%s: a batch cannot be written while frames are reserved", w->name);
    uint32_t max_len = 0;
    int rc = check_batch(w, b, &max_len, e);
    if (rc)
        return rc; /* nothing written: the stream is still good */
    uint64_t T = b->n_tokens;
    uint32_t S = b->n_seqs, K = b->n_layers, H = b->hidden;
    dfl_batch_layout l;
    if (!dfl_batch_layout_of(T, S, K, H, b->dtype, &l) || l.size > SIZE_MAX / 2)
        return dfl_fail(e, DFL_EUSAGE, "%s: batch %llu is too large", w->name, (unsigned long long)w->n_batches);
    uint8_t bh[64];
    memset(bh, 0, sizeof bh);
    dfl_put_le64(bh, w->n_batches);
    dfl_put_le64(bh + 8, T);
    dfl_put_le32(bh + 16, S);
    dfl_put_le32(bh + 20, K);
    dfl_put_le32(bh + 24, H);
    dfl_put_le16(bh + 28, (uint16_t)(K ? b->dtype : 0));
    dfl_put_le32(bh + 32, max_len);

    /* the payload as pieces, each followed by its padding */
    struct iovec pieces[2 * (4 + DFL_MAX_LAYERS)];
    uint64_t at[2 * (4 + DFL_MAX_LAYERS)];
    int np = 0;
    uint64_t off = 0;
#define PIECE(ptr, len)                                                                                \
    do {                                                                                               \
        pieces[np].iov_base = (void *)(ptr);                                                           \
        pieces[np].iov_len = (size_t)(len);                                                            \
        at[np++] = off;                                                                                \
        off += (len);                                                                                  \
        if (off % 64) {                                                                                \
            uint64_t p_ = 64 - off % 64;                                                               \
            pieces[np].iov_base = (void *)zeros;                                                       \
            pieces[np].iov_len = (size_t)p_;                                                           \
            at[np++] = UINT64_MAX; /* padding: already zero in a gathered buffer */                    \
            off += p_;                                                                                 \
        }                                                                                              \
    } while (0)
    PIECE(bh, 64);
    PIECE(b->seq_lens, 4ull * S);
    PIECE(b->input_ids, 4 * T);
    PIECE(b->loss_mask, T);
    uint64_t layer_bytes = T * H * (K ? dfl_dtype_size(b->dtype) : 0);
    bool stable[2 * (4 + DFL_MAX_LAYERS)];
    memset(stable, 0, sizeof stable);
    for (uint32_t k = 0; k < K; k++) {
        stable[np] = true; /* the caller's layer arrays (spliced with opts.vmsplice) */
        PIECE(b->layers[k], layer_bytes);
    }
#undef PIECE
    uint32_t type = w->kind == DFL_KIND_TOKENS ? DFL_FT_TOKENS : DFL_FT_HIDDEN;
    uint64_t frame_off = w->bytes;

    bool compressed = false;
    if (w->opts.zstd_level > 0) {
        unsigned sw = 1;
        uint32_t flags = DFL_FF_ZSTD;
        if (K) {
            sw = (unsigned)dfl_dtype_size(b->dtype);
            flags |= sw == 2 ? DFL_FF_SHUFFLE2 : DFL_FF_SHUFFLE4;
        }
        size_t bound = ZSTD_compressBound((size_t)l.size);
        if (!w->cctx) {
            /* zstd's multi-threaded mode gives the same bytes for any number of workers >= 1, so
             * the output does not depend on the machine */
            int workers = dfl_ncpu() < 16 ? dfl_ncpu() : 16;
            if (!(w->cctx = ZSTD_createCCtx()))
                return wfail(w, e, dfl_fail(e, DFL_ENOMEM, "%s: out of memory for zstd", w->name));
            ZSTD_CCtx_setParameter(w->cctx, ZSTD_c_compressionLevel, w->opts.zstd_level);
            ZSTD_CCtx_setParameter(w->cctx, ZSTD_c_contentSizeFlag, 1);
            ZSTD_CCtx_setParameter(w->cctx, ZSTD_c_checksumFlag, 0);
            if (ZSTD_isError(ZSTD_CCtx_setParameter(w->cctx, ZSTD_c_nbWorkers, workers < 1 ? 1 : workers)))
                return wfail(w, e, dfl_fail(e, DFL_EUNSUP, "%s: this zstd library has no multi-threaded mode", w->name));
        }
        if (grow(&w->raw, &w->rawcap, (size_t)l.size) || grow(&w->zb, &w->zcap, bound))
            return wfail(w, e, dfl_fail(e, DFL_ENOMEM, "%s: out of memory for compressing %llu bytes", w->name,
                                        (unsigned long long)l.size));
        memset(w->raw, 0, (size_t)l.size);
        for (int i = 0; i < np; i++)
            if (at[i] != UINT64_MAX)
                scatter(w->raw, l.size / sw, pieces[i].iov_base, pieces[i].iov_len, at[i], sw);
        ZSTD_CCtx_reset(w->cctx, ZSTD_reset_session_only);
        size_t zn = ZSTD_compress2(w->cctx, w->zb, bound, w->raw, (size_t)l.size);
        if (ZSTD_isError(zn))
            return wfail(w, e, dfl_fail(e, DFL_EIO, "%s: zstd compression failed: %s", w->name, ZSTD_getErrorName(zn)));
        if (zn < l.size) {
            struct iovec z = {w->zb, zn};
            rc = write_frame(w, type, flags, &z, 1, zn, l.size, NULL, e);
            compressed = true;
        }
    }
    if (!compressed)
        rc = write_frame(w, type, 0, pieces, np, l.size, l.size, stable, e);
    if (rc)
        return wfail(w, e, rc);
    if (w->want_index) {
        if (w->n_batches == w->cap) {
            size_t cap = w->cap ? w->cap * 2 : 256;
            dfl_index_entry *p = realloc(w->entries, cap * sizeof *p);
            if (!p)
                return wfail(w, e, dfl_fail(e, DFL_ENOMEM, "%s: out of memory", w->name));
            w->entries = p;
            w->cap = cap;
        }
        w->entries[w->n_batches] = (dfl_index_entry){frame_off, S, (uint32_t)T};
    }
    w->n_batches++;
    w->n_tokens += T;
    w->n_seqs += S;
    return DFL_OK;
}

int dfl_writer_note(dfl_writer *w, const json_t *note, dfl_err *e)
{
    if (w->failed)
        return dfl_fail(e, w->failed, "%s", w->failed_msg);
    if (reserved_out(w))
        return dfl_fail(e, DFL_EUSAGE, "%s: a note cannot be written while frames are reserved", w->name);
    if (!json_is_object(note))
        return dfl_fail(e, DFL_EUSAGE, "%s: a NOTE is a JSON object", w->name);
    char *text;
    size_t n;
    int rc = json_payload(w, note, "NOTE", &text, &n, e);
    if (rc)
        return rc;
    struct iovec iov = {text, n};
    rc = write_frame(w, DFL_FT_NOTE, DFL_FF_SKIPPABLE, &iov, 1, n, n, NULL, e);
    free(text);
    if (rc && rc != DFL_EUSAGE)
        wfail(w, e, rc);
    return rc;
}

uint32_t dfl_writer_pipe_bytes(const dfl_writer *w) { return w->pipe_bytes; }

uint64_t dfl_writer_bytes(const dfl_writer *w) { return w->bytes; }

/* Why a spliced page may be rewritten once dfl_writer_read_upto has passed it.
 *
 * vmsplice(2) without SPLICE_F_GIFT puts references to the caller's pages into the pipe: the
 * reader gets whatever the pages hold when it reads them, so a page must not change before the
 * reader has copied it out. A read(2) of a pipe copies the bytes to the reader's buffer and
 * then, under the pipe's lock, advances the buffer past them (dropping the page once it is
 * empty); FIONREAD sums, under the same lock, the bytes still in the pipe. So once FIONREAD has
 * returned U, every byte that had entered the pipe but is not among the U was already copied
 * out. Let W be this writer's count of bytes the pipe accepted (added to after each write or
 * vmsplice returns, so never ahead of the pipe) read BEFORE FIONREAD: the pipe had received at
 * least W of our bytes by then, at most U of which are unread, so the first W - U bytes of the
 * stream have been read and their pages may change (dfl_pipe_read_upto). Bytes that another
 * process writes into the same pipe only make U larger, i.e. the answer smaller: still true.
 * If U > W (more unread than we wrote: someone else's bytes), the answer is 0. The order
 * matters: W read after FIONREAD could count bytes that entered the pipe after U was measured.
 *
 * The limit: this holds for consumers that read(2) the pipe (or copy out of it otherwise). One
 * that splice(2)s or tee(2)s it on, to a socket, a file or another pipe, moves or copies the page
 * references, not the bytes: FIONREAD drops while the pages are still in use elsewhere, and a
 * rewrite would show there. Such consumers need the write path (dfl-target --output-mode write). */
uint64_t dfl_pipe_read_upto(uint64_t pushed, uint64_t unread)
{
    return unread <= pushed ? pushed - unread : 0;
}

long dfl_pipe_poll_ns(uint64_t left)
{
    uint64_t ns = left / 4;
    return ns < 50000 ? 50000L : ns > 20000000 ? 20000000L : (long)ns;
}

int dfl_writer_read_upto(dfl_writer *w, uint64_t *upto, dfl_err *e)
{
    if (!w->may_splice) {
        *upto = UINT64_MAX; /* copied into the pipe or a file: nothing refers to the caller's pages */
        return DFL_OK;
    }
    uint64_t pushed = __atomic_load_n(&w->pushed, __ATOMIC_ACQUIRE); /* W first, then U */
    int unread = 0;
    if (ioctl(w->fd, FIONREAD, &unread) != 0 || unread < 0) {
        *upto = 0;
        return dfl_fail_errno(e, DFL_EIO, errno, "%s: cannot tell how much of the pipe was read (FIONREAD)",
                              w->name);
    }
    *upto = dfl_pipe_read_upto(pushed, (uint64_t)unread);
    /* bytes left in a pipe that nobody can read any more would be waited for forever: when the
     * reader has gone (POLLERR on the write end), say so, as a write would (EPIPE) */
    struct pollfd pf = {.fd = w->fd, .events = POLLOUT};
    if (unread > 0 && poll(&pf, 1, 0) == 1 && (pf.revents & POLLERR))
        return dfl_fail(e, DFL_EPIPE, "%s: the reader went away (broken pipe)", w->name);
    return DFL_OK;
}

/* ---- batch frames written in place ------------------------------------------------------------ */

bool dfl_writer_can_reserve(const dfl_writer *w) { return w->in_place && w->kind == DFL_KIND_HIDDEN; }

int dfl_writer_reserve(dfl_writer *w, uint64_t n_tokens, uint32_t n_seqs, dfl_frame_res *f, dfl_err *e)
{
    memset(f, 0, sizeof *f);
    if (!dfl_writer_can_reserve(w))
        return dfl_fail(e, DFL_EUSAGE, "%s: batch frames can be written in place only into a file written from its "
                        "start, opened read-write, without compression", w->name);
    if (n_tokens < 1 || n_tokens > UINT32_MAX || n_seqs < 1 || n_seqs > n_tokens)
        return dfl_fail(e, DFL_EUSAGE, "%s: reserving a batch of %llu tokens in %u sequences (need 1 <= sequences "
                        "<= tokens < 2^32)", w->name, (unsigned long long)n_tokens, n_seqs);
    dfl_batch_layout l;
    if (!dfl_batch_layout_of(n_tokens, n_seqs, (uint32_t)w->n_layers, (uint32_t)w->hidden, w->dtype, &l) ||
        l.size > SIZE_MAX / 4)
        return dfl_fail(e, DFL_EUSAGE, "%s: a batch of %llu tokens is too large", w->name,
                        (unsigned long long)n_tokens);
    uint64_t pad = (64 - (l.size + 8) % 64) % 64, len = 64 + l.size + pad + 8;
    pthread_mutex_lock(&w->mu);
    if (w->failed) {
        int rc = dfl_fail(e, w->failed, "%s", w->failed_msg);
        pthread_mutex_unlock(&w->mu);
        return rc;
    }
    if (w->res_out == 0) {
        w->res_end = w->bytes;
        w->res_seq = w->seq;
        w->res_index = w->n_batches;
    }
    f->offset = w->res_end;
    f->seq = w->res_seq++;
    f->index = w->res_index++;
    w->res_end += len;
    w->res_out++;
    pthread_mutex_unlock(&w->mu);
    f->n_tokens = n_tokens;
    f->n_seqs = n_seqs;
    f->frame_len = len;

    /* the space first, so that a full disk fails here and not as SIGBUS on a mapped page */
    int rc = DFL_OK;
    if (fallocate(w->fd, 0, (off_t)f->offset, (off_t)len) != 0) {
        int err = errno;
        if (err == EOPNOTSUPP || err == ENOSYS) {
            if (ftruncate(w->fd, (off_t)(f->offset + len)) != 0)
                rc = dfl_fail_errno(e, DFL_EIO, errno, "%s: cannot extend the file to %llu bytes", w->name,
                                    (unsigned long long)(f->offset + len));
        } else {
            rc = dfl_fail_errno(e, DFL_EIO, err, "%s: cannot allocate %llu bytes for batch %llu", w->name,
                                (unsigned long long)len, (unsigned long long)f->index);
        }
    }
    if (!rc) {
        uint64_t page = (uint64_t)sysconf(_SC_PAGESIZE);
        uint64_t moff = f->offset / page * page;
        f->map_len = (size_t)(f->offset - moff + len);
        void *m = mmap(NULL, f->map_len, PROT_READ | PROT_WRITE, MAP_SHARED, w->fd, (off_t)moff);
        if (m == MAP_FAILED) {
            rc = dfl_fail_errno(e, DFL_EIO, errno, "%s: cannot map %llu bytes for batch %llu", w->name,
                                (unsigned long long)len, (unsigned long long)f->index);
            f->map_len = 0;
        } else {
            f->map = m;
            f->frame = (uint8_t *)m + (f->offset - moff);
            for (int k = 0; k < w->n_layers; k++)
                f->layers[k] = f->frame + 64 + l.layer0 + (uint64_t)k * l.layer_stride;
        }
    }
    if (rc)
        wfail(w, e, rc); /* the reservation chain is broken: the stream cannot continue */
    return rc;
}

static void unmap_res(dfl_frame_res *f)
{
    if (f->map)
        munmap(f->map, f->map_len);
    f->map = NULL;
    f->frame = NULL;
    f->map_len = 0;
}

void dfl_writer_unreserve(dfl_writer *w, dfl_frame_res *f)
{
    if (!f->frame_len)
        return;
    unmap_res(f);
    dfl_err e = {0};
    dfl_fail(&e, DFL_EUSAGE, "%s: a reserved batch frame was given up", w->name);
    pthread_mutex_lock(&w->mu);
    if (w->res_out > 0)
        w->res_out--;
    if (!w->failed) {
        w->failed = DFL_EUSAGE;
        memcpy(w->failed_msg, e.msg, sizeof w->failed_msg);
    }
    pthread_mutex_unlock(&w->mu);
    f->frame_len = 0;
}

/* Copies n bytes to dst (unless already there) and zeroes the padding up to the next multiple of
 * 64 bytes. */
static void put_section(uint8_t *dst, const void *src, uint64_t n)
{
    if (n && dst != src)
        memcpy(dst, src, (size_t)n);
    if (n % 64)
        memset(dst + n, 0, (size_t)(64 - n % 64));
}

int dfl_writer_commit(dfl_writer *w, dfl_frame_res *f, const dfl_batch *b, dfl_err *e)
{
    int rc;
    if (!f->frame) {
        rc = dfl_fail(e, DFL_EUSAGE, "%s: committing a batch frame that is not reserved", w->name);
        return wfail(w, e, rc);
    }
    pthread_mutex_lock(&w->mu);
    int failed = w->failed;
    pthread_mutex_unlock(&w->mu);
    if (failed) {
        rc = dfl_fail(e, failed, "%s", w->failed_msg);
        dfl_writer_unreserve(w, f);
        return rc;
    }
    dfl_batch c = *b;
    bool elsewhere = false;
    for (int k = 0; k < w->n_layers; k++) {
        elsewhere |= c.layers[k] && c.layers[k] != f->layers[k];
        c.layers[k] = f->layers[k];
    }
    uint32_t max_len = 0;
    if (f->offset != w->bytes)
        rc = dfl_fail(e, DFL_EUSAGE, "%s: batch frames must be committed in the order they were reserved "
                      "(frame at %llu, stream at %llu)", w->name, (unsigned long long)f->offset,
                      (unsigned long long)w->bytes);
    else if (b->n_tokens != f->n_tokens || b->n_seqs != f->n_seqs)
        rc = dfl_fail(e, DFL_EUSAGE, "%s: batch %llu has %llu tokens in %u sequences, reserved for %llu in %u",
                      w->name, (unsigned long long)f->index, (unsigned long long)b->n_tokens, b->n_seqs,
                      (unsigned long long)f->n_tokens, f->n_seqs);
    else if (elsewhere)
        rc = dfl_fail(e, DFL_EUSAGE, "%s: batch %llu: its layers are not in the reserved frame", w->name,
                      (unsigned long long)f->index);
    else
        rc = check_batch(w, &c, &max_len, e);
    if (rc) {
        dfl_writer_unreserve(w, f);
        return wfail(w, e, rc);
    }
    uint64_t T = c.n_tokens;
    uint32_t S = c.n_seqs, K = (uint32_t)w->n_layers, H = (uint32_t)w->hidden;
    dfl_batch_layout l;
    dfl_batch_layout_of(T, S, K, H, w->dtype, &l); /* as at reserve */
    uint8_t *fr = f->frame, *p = fr + 64;
    /* frame header */
    memset(fr, 0, 64);
    memcpy(fr, DFL_FRAME_MAGIC, 4);
    fr[4] = DFL_FRAME_MAJOR;
    dfl_put_le16(fr + 6, DFL_FT_HIDDEN);
    dfl_put_le64(fr + 8, l.size);
    dfl_put_le64(fr + 16, l.size);
    dfl_put_le64(fr + 24, f->seq);
    dfl_put_le64(fr + 56, XXH3_64bits(fr, 56));
    /* batch header and sections */
    memset(p, 0, 64);
    dfl_put_le64(p, f->index);
    dfl_put_le64(p + 8, T);
    dfl_put_le32(p + 16, S);
    dfl_put_le32(p + 20, K);
    dfl_put_le32(p + 24, H);
    dfl_put_le16(p + 28, (uint16_t)w->dtype);
    dfl_put_le32(p + 32, max_len);
    put_section(p + l.seq_lens, c.seq_lens, 4ull * S);
    put_section(p + l.input_ids, c.input_ids, 4 * T);
    put_section(p + l.loss_mask, c.loss_mask, T);
    uint64_t layer_bytes = T * H * dfl_dtype_size(w->dtype);
    for (uint32_t k = 0; k < K; k++)
        if (layer_bytes % 64)
            memset(p + l.layer0 + k * l.layer_stride + layer_bytes, 0, (size_t)(64 - layer_bytes % 64));
    uint64_t pad = f->frame_len - 64 - l.size - 8;
    memset(p + l.size, 0, (size_t)pad);
    dfl_put_le64(fr + f->frame_len - 8, XXH3_64bits(fr, (size_t)(f->frame_len - 8)));
    unmap_res(f);
    /* the next write (INDEX, END) goes after this frame */
    if (lseek(w->fd, (off_t)(f->offset + f->frame_len), SEEK_SET) < 0) {
        rc = dfl_fail_errno(e, DFL_EIO, errno, "%s: seek failed", w->name);
        pthread_mutex_lock(&w->mu);
        w->res_out--;
        pthread_mutex_unlock(&w->mu);
        f->frame_len = 0;
        return wfail(w, e, rc);
    }
    if (w->want_index) {
        if (w->n_batches == w->cap) {
            size_t cap = w->cap ? w->cap * 2 : 256;
            dfl_index_entry *q = realloc(w->entries, cap * sizeof *q);
            if (!q) {
                rc = dfl_fail(e, DFL_ENOMEM, "%s: out of memory", w->name);
                pthread_mutex_lock(&w->mu);
                w->res_out--;
                pthread_mutex_unlock(&w->mu);
                f->frame_len = 0;
                return wfail(w, e, rc);
            }
            w->entries = q;
            w->cap = cap;
        }
        w->entries[w->n_batches] = (dfl_index_entry){f->offset, S, (uint32_t)T};
    }
    pthread_mutex_lock(&w->mu);
    w->bytes += f->frame_len;
    w->seq++;
    w->n_batches++;
    w->n_tokens += T;
    w->n_seqs += S;
    w->res_out--;
    pthread_mutex_unlock(&w->mu);
    f->frame_len = 0;
    return DFL_OK;
}

/* opts.end_releases_fd: the caller's descriptor let go of after the END frame, so that the
 * reader's wait for the end of the input (frame.c's check after END) ends now. 0, 1 and 2 get
 * /dev/null in their place: a later write to standard output must not land in whatever file the
 * process opens next under that number. Where /dev/null cannot be opened the descriptor stays as
 * it is (the reader then sees the end when the process exits, as without the option). */
static int release_fd(dfl_writer *w, dfl_err *e)
{
    if (w->fd > 2) {
        if (close(w->fd) != 0)
            return dfl_fail_errno(e, DFL_EIO, errno, "%s: close failed", w->name);
        return DFL_OK;
    }
    int nul = open("/dev/null", O_WRONLY | O_CLOEXEC);
    if (nul < 0)
        return DFL_OK;
    while (dup2(nul, w->fd) < 0 && errno == EINTR)
        ;
    close(nul);
    return DFL_OK;
}

int dfl_writer_close(dfl_writer *w, dfl_err *e)
{
    if (!w)
        return DFL_OK;
    int rc = DFL_OK;
    if (!w->failed && reserved_out(w))
        wfail(w, e, dfl_fail(e, DFL_EUSAGE, "%s: closed with batch frames still reserved", w->name));
    if (w->failed) {
        rc = dfl_fail(e, w->failed, "%s", w->failed_msg);
        dfl_writer_abort(w);
        return rc;
    }
    uint64_t index_off = 0;
    if (w->want_index) {
        uint64_t n = w->n_batches, len = 16 + 16 * n;
        uint8_t *p = malloc((size_t)len);
        if (!p) {
            rc = dfl_fail(e, DFL_ENOMEM, "%s: out of memory for the index", w->name);
            dfl_writer_abort(w);
            return rc;
        }
        dfl_put_le64(p, n);
        dfl_put_le64(p + 8, 0);
        for (uint64_t i = 0; i < n; i++) {
            dfl_put_le64(p + 16 + 16 * i, w->entries[i].offset);
            dfl_put_le32(p + 24 + 16 * i, w->entries[i].n_seqs);
            dfl_put_le32(p + 28 + 16 * i, w->entries[i].n_tokens);
        }
        index_off = w->bytes;
        struct iovec iov = {p, (size_t)len};
        rc = write_frame(w, DFL_FT_INDEX, DFL_FF_SKIPPABLE, &iov, 1, len, len, NULL, e);
        free(p);
        if (rc) {
            dfl_writer_abort(w);
            return rc;
        }
    }
    uint8_t end[64];
    memset(end, 0, sizeof end);
    dfl_put_le64(end, w->n_batches);
    dfl_put_le64(end + 8, w->n_tokens);
    dfl_put_le64(end + 16, w->n_seqs);
    dfl_put_le64(end + 24, index_off);
    dfl_put_le64(end + 32, w->seq);
    struct iovec iov = {end, 64};
    if ((rc = write_frame(w, DFL_FT_END, 0, &iov, 1, 64, 64, NULL, e))) {
        dfl_writer_abort(w);
        return rc;
    }
    if (w->atomic) {
        rc = dfl_atomic_commit(&w->at, e);
        w->atomic = false;
    } else if (w->own_fd) {
        if (close(w->fd) != 0)
            rc = dfl_fail_errno(e, DFL_EIO, errno, "%s: close failed", w->name);
        w->own_fd = false;
    } else if (w->opts.end_releases_fd) {
        rc = release_fd(w, e);
    }
    writer_free(w);
    return rc;
}

void dfl_writer_abort(dfl_writer *w)
{
    if (!w)
        return;
    if (w->atomic)
        dfl_atomic_abort(&w->at);
    else if (w->own_fd && w->fd >= 0)
        close(w->fd);
    writer_free(w);
}
