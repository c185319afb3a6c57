/* frame.c: the .dfl frame reader (dfl-frame(5)), batch helpers and the fingerprint helper.
 * One reader serves both inputs: a regular file is mapped and frames are checked in place
 * (uncompressed batches point into the mapping); anything else is read with large read(2) calls
 * into a heap block per frame, which the returned batch owns. The writer is in frame_write.c. */
#include "frame.h"

#include <errno.h>
#include <fcntl.h>
#include <poll.h>
#include <stdarg.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/mman.h>
#include <sys/stat.h>
#include <unistd.h>

#include <zstd.h>

#include "batch_check.h"
#include "bytes.h"
#include "frame_bounce.h"
#include "frame_hasher.h"
#include "frame_type.h"
#include "json.h"
#include "util.h"
#include "xxh.h"

#if !defined(__BYTE_ORDER__) || __BYTE_ORDER__ != __ORDER_LITTLE_ENDIAN__
#error "libdfl uses the little-endian arrays of .dfl streams in place: little-endian hosts only"
#endif

#define DEFAULT_MAX_FRAME (64ull << 30)
#define MAX_JSON_FRAME (16ull << 20)   /* HEADER and NOTE payloads */
#define END_PAYLOAD 64
#define END_FRAME 192
#define HASH_THREAD_MIN (4u << 20)    /* frames from this size on are hashed by the hash thread
                                          (opts.hash_thread) */
#define HASH_THREAD_CPUS 8            /* ... by default where this many CPUs are online: the thread
                                          takes the hash (about 10% of the reading thread's time
                                          with AVX2 XXH3) off the read(2) loop, but costs more CPU
                                          in all (it hashes from another core's cache): for hosts
                                          with cores to spare */
#define PIPE_SIZE (64u << 20)          /* an input pipe is enlarged up to this (pipe-max-size) */
#define READ_CHUNK (1u << 20)          /* default opts.chunk: read(2) and hash pieces that stay in
                                          the cache while the producer refills the pipe; 1 MiB (a
                                          whole default pipe) against 256 KiB: hspump | hsdrain
                                          (vmsplice, 8.06 GB) 213-242k tok/s against 197-242k,
                                          the better in 6 of 8 alternating runs */
#define SKIP_CHUNK (256u << 10)        /* pieces of the skippable frames of unknown types */
#define BOUNCE_MIN (4u << 20)          /* frames from this size on go through a bounce buffer
                                          (opts.bounce) */
#define BOUNCE_SLOTS 4                 /* default opts.bounce_slots */
/* opts.bounce = 0 (auto) is the bounce thread (2) where HASH_THREAD_CPUS CPUs are online, and off
 * (-1) elsewhere. On the H200 machine (16-core Xeon VM, 2 MiB L2 a core, pipe-max-size 1 MiB),
 * hspump --batches 16 --tokens 16384 --seqs 8 --layers 5 --hidden 2048 --slots 4 --output-mode
 * vmsplice | hsdrain --warmup 2, 7 alternating rounds: the bounce thread (1 MiB pieces, 4
 * buffers) 277-299k tokens/s (5.25-5.64 GB/s) against 208-240k (4.14-4.82 GB/s) for read_body
 * with its hash thread, faster in every round (1.25-1.38x); the reading thread's CPU 0.82-0.87 s
 * against 1.05-1.25 s, the process's 2.63-2.98 s against 2.52-2.72 s. In the reading thread (1)
 * it was no faster than read_body (200-256k, 0.91-1.07x; 2.02-2.30 s of CPU without the hash
 * thread), so it is there for hosts that measure it better; on a host with few CPUs the bounce
 * thread takes a core from the producer, as the hash thread does. */
#define AUTO_BOUNCE_CPUS HASH_THREAD_CPUS

static bool all_zero(const uint8_t *p, size_t n)
{
    for (size_t i = 0; i < n; i++)
        if (p[i])
            return false;
    return true;
}

static uint64_t pad_of(uint64_t stored_len) { return (64 - (stored_len + 8) % 64) % 64; }

static const char *type_name(uint32_t t)
{
    const char *n = dfl_frame_type_name(t);
    return n ? n : "unknown";
}

/* ---- blocks, batches ------------------------------------------------------------------------ */

/* Blocks behind batches and frames: malloc'ed (or calloc'ed: a large calloc gets fresh zero pages
 * without touching them), so owned is free()-able, with the data at the first 64-aligned address
 * in them (block_data). Large ones are marked for huge pages (fewer page faults). */
static inline uint8_t *block_data(void *p) { return (uint8_t *)DFL_ALIGN_UP((uintptr_t)p, 64); }

static void *block_alloc(uint64_t n, bool zero)
{
    if (n > SIZE_MAX - 128)
        return NULL;
    void *p = zero ? calloc(1, (size_t)n + 64) : malloc((size_t)n + 64);
#ifdef MADV_HUGEPAGE
    if (p && n >= (8u << 20)) {
        uintptr_t a = DFL_ALIGN_UP((uintptr_t)p, 4096), end = ((uintptr_t)p + n) & ~(uintptr_t)4095;
        madvise((void *)a, end - a, MADV_HUGEPAGE);
    }
#endif
    return p;
}

bool dfl_batch_layout_of(uint64_t n_tokens, uint32_t n_seqs, uint32_t n_layers, uint32_t hidden,
                         dfl_dtype dtype, dfl_batch_layout *l)
{
    uint64_t w = 0, a, b;
    memset(l, 0, sizeof *l);
    if (n_layers > 0) {
        w = dfl_dtype_size(dtype);
        if (w == 0 || n_layers > DFL_MAX_LAYERS)
            return false;
    }
    /* every term is checked: n_tokens comes from the stream */
    if (n_tokens > (UINT64_MAX >> 8))
        return false;
    l->seq_lens = 64;
    l->input_ids = l->seq_lens + DFL_ALIGN_UP(4 * (uint64_t)n_seqs, 64);
    l->loss_mask = l->input_ids + DFL_ALIGN_UP(4 * n_tokens, 64);
    l->layer0 = l->loss_mask + DFL_ALIGN_UP(n_tokens, 64);
    if (!dfl_mul_u64(n_tokens, hidden, &a) || !dfl_mul_u64(a, w, &a) || a > UINT64_MAX - 63)
        return false;
    l->layer_stride = n_layers ? DFL_ALIGN_UP(a, 64) : 0;
    if (!dfl_mul_u64(l->layer_stride, n_layers, &b) || !dfl_add_u64(l->layer0, b, &l->size))
        return false;
    return true;
}

uint64_t dfl_batch_payload_size(uint64_t n_tokens, uint32_t n_seqs, uint32_t n_layers,
                                uint32_t hidden, dfl_dtype dtype)
{
    dfl_batch_layout l;
    return dfl_batch_layout_of(n_tokens, n_seqs, n_layers, hidden, dtype, &l) ? l.size : 0;
}

/* Points b's sections into a payload laid out as l says. */
static void batch_point(dfl_batch *b, const uint8_t *p, const dfl_batch_layout *l)
{
    b->seq_lens = (const uint32_t *)(p + l->seq_lens);
    b->input_ids = (const int32_t *)(p + l->input_ids);
    b->loss_mask = p + l->loss_mask;
    for (uint32_t k = 0; k < DFL_MAX_LAYERS; k++)
        b->layers[k] = k < b->n_layers ? p + l->layer0 + k * l->layer_stride : NULL;
}

int dfl_batch_alloc(dfl_batch *b, uint64_t n_tokens, uint32_t n_seqs, uint32_t n_layers,
                    uint32_t hidden, dfl_dtype dtype, dfl_err *e)
{
    memset(b, 0, sizeof *b);
    if (n_tokens < 1 || n_tokens > UINT32_MAX || n_seqs < 1 || n_seqs > n_tokens)
        return dfl_fail(e, DFL_EUSAGE, "batch of %llu tokens in %u sequences: need 1 <= sequences <= tokens < 2^32",
                        (unsigned long long)n_tokens, n_seqs);
    if (n_layers > DFL_MAX_LAYERS)
        return dfl_fail(e, DFL_EUSAGE, "batch with %u layers: at most %d", n_layers, DFL_MAX_LAYERS);
    if (n_layers > 0 && (hidden < 1 || (dtype != DFL_BF16 && dtype != DFL_F16 && dtype != DFL_F32)))
        return dfl_fail(e, DFL_EUSAGE, "hidden batch needs hidden >= 1 and dtype bf16, f16 or f32 (got %u, %s)",
                        hidden, dfl_dtype_lower(dtype));
    dfl_batch_layout l;
    if (!dfl_batch_layout_of(n_tokens, n_seqs, n_layers, hidden, dtype, &l) || l.size > SIZE_MAX)
        return dfl_fail(e, DFL_EUSAGE, "batch of %llu tokens x %u layers x %u is too large",
                        (unsigned long long)n_tokens, n_layers, hidden);
    void *blk = block_alloc(l.size + 64, true); /* every batch block has 64 bytes of headroom (recycling) */
    if (!blk)
        return dfl_fail(e, DFL_ENOMEM, "out of memory for a batch of %llu bytes", (unsigned long long)l.size);
    b->n_tokens = n_tokens;
    b->n_seqs = n_seqs;
    b->n_layers = n_layers;
    b->hidden = n_layers ? hidden : 0;
    b->dtype = n_layers ? dtype : DFL_DT_INVALID;
    batch_point(b, block_data(blk), &l);
    b->owned = blk;
    return DFL_OK;
}

void dfl_batch_free(dfl_batch *b)
{
    if (!b)
        return;
    free(b->owned);
    memset(b, 0, sizeof *b);
}

void dfl_frame_free(dfl_frame *f)
{
    if (!f)
        return;
    free(f->owned);
    memset(f, 0, sizeof *f);
}

void dfl_fingerprint_hex(const void *data, size_t n, char out[33])
{
    XXH128_canonical_t c;
    XXH128_canonicalFromHash(&c, XXH3_128bits(data, n));
    static const char hex[] = "0123456789abcdef";
    for (int i = 0; i < 16; i++) {
        out[2 * i] = hex[c.digest[i] >> 4];
        out[2 * i + 1] = hex[c.digest[i] & 15];
    }
    out[32] = 0;
}

/* ---- the reader ----------------------------------------------------------------------------- */

/* A decoded frame header. */
typedef struct fhdr {
    uint32_t type, flags;
    uint64_t stored, raw, seq, pad, total;
} fhdr;

struct dfl_reader {
    char *name;
    int fd;
    bool own_fd;
    /* mapped input: the stream is base[0..size) */
    bool mapped;
    bool pipe;               /* a pipe or FIFO */
    bool regular;            /* a regular file (mapped, or read where its position is not
                                64-aligned) */
    const uint8_t *map;
    size_t map_size;
    const uint8_t *base;
    uint64_t size;
    dfl_reader_opts opts;
    dfl_stream_info info;
    json_t *header_json;
    uint64_t header_len;
    /* walking state */
    uint64_t pos;            /* stream offset of the next frame */
    uint64_t seq;            /* its expected frame number */
    uint64_t n_batches, n_tokens, n_seqs;
    dfl_index_entry *seen;   /* the batch frames read, to check an INDEX against */
    size_t seen_cap;
    uint64_t index_offset;   /* of the INDEX frame read, 0 if none yet */
    bool at_end;             /* END read and checked */
    bool truncated;
    dfl_stream_end end;
    int failed;              /* sticky error */
    char failed_msg[sizeof(((dfl_err *)0)->msg)];
    uint64_t checked_offset; /* the batch frame whose contents were last checked */
    bool have_checked;
    /* scratch */
    uint8_t hdr[64] __attribute__((aligned(64)));
    uint8_t *zbuf;           /* stored bytes of compressed frames read from a descriptor */
    size_t zcap;
    uint8_t *sbuf;           /* shuffled raw payload */
    size_t scap;
    ZSTD_DCtx *dctx;
    XXH3_state_t *xx;
    dfl_hasher *hasher;      /* the hash thread, started at the first frame that uses it */
    bool hasher_off;         /* not used (opts.hash_thread, or it could not be started) */
    int bounce;              /* opts.bounce resolved: -1 off, 1 in the reading thread, 2 by the
                                bounce thread; lowered when what it needs cannot be had */
    uint8_t *bounce_buf;     /* bounce = 1: the buffer (opts.chunk bytes), at the first use */
    dfl_bouncer *bouncer;    /* bounce = 2: the thread and its ring, at the first use */
    void *spare;             /* a recycled batch block, and its capacity */
    uint64_t spare_cap;
    /* random access */
    dfl_index_entry *index;
    uint64_t *index_seq;     /* the frame number of each listed batch frame */
    uint64_t index_n;
    bool index_loaded;
    bool index_absent;       /* dfl_reader_index found no index (no INDEX frame, or no END) */
};

/* The number of the frame at offset off of a mapped stream, for the messages of random access
 * (which reads a frame without knowing it): found by walking the frame headers from the first
 * frame after HEADER, each header check verified, payloads skipped. UINT64_MAX when the walk
 * does not land on off (a corrupt header on the way, or off not a frame boundary). */
static uint64_t seq_at(const dfl_reader *r, uint64_t off)
{
    uint64_t pos = r->header_len, seq = 1;
    while (pos < off && r->size - pos >= 64) {
        const uint8_t *h = r->base + pos;
        if (memcmp(h, DFL_FRAME_MAGIC, 4) != 0 || XXH3_64bits(h, 56) != dfl_get_le64(h + 56))
            return UINT64_MAX;
        uint64_t stored = dfl_get_le64(h + 8);
        if (stored > r->size)
            return UINT64_MAX;
        pos += 64 + stored + pad_of(stored) + 8;
        seq++;
    }
    return pos == off && r->header_len > 0 ? seq : UINT64_MAX;
}

/* "NAME: frame N at offset X (TYPE): " prefixes */
static int rfail(dfl_reader *r, int code, uint64_t seq, uint64_t off, const char *fmt, ...)
    __attribute__((format(printf, 5, 6)));
static int rfail(dfl_reader *r, int code, uint64_t seq, uint64_t off, const char *fmt, ...)
{
    char msg[768];
    va_list ap;
    va_start(ap, fmt);
    vsnprintf(msg, sizeof msg, fmt, ap);
    va_end(ap);
    dfl_err tmp, *e = &tmp;
    if (seq == UINT64_MAX && r->mapped)
        seq = seq_at(r, off);
    if (seq == UINT64_MAX)
        dfl_fail(e, code, "%s: frame at offset %llu: %s", r->name, (unsigned long long)off, msg);
    else
        dfl_fail(e, code, "%s: frame %llu at offset %llu: %s", r->name, (unsigned long long)seq,
                 (unsigned long long)off, msg);
    r->failed = code;
    memcpy(r->failed_msg, e->msg, sizeof r->failed_msg);
    return code;
}

static int sticky(dfl_reader *r, int code, dfl_err *e)
{
    r->failed = code;
    memcpy(r->failed_msg, e->msg, sizeof r->failed_msg);
    return code;
}

static int copy_failed(dfl_reader *r, dfl_err *e)
{
    if (e) {
        e->code = r->failed;
        memcpy(e->msg, r->failed_msg, sizeof e->msg);
    }
    return r->failed;
}

/* One read(2) of at most n bytes (and 1 GiB) through EINTR and EAGAIN: *got is what it returned,
 * 0 only at end of input. */
static int read_some(dfl_reader *r, void *buf, size_t n, size_t *got, dfl_err *e)
{
    if (n > (1u << 30))
        n = 1u << 30;
    for (;;) {
        ssize_t k = read(r->fd, buf, n);
        if (k >= 0) {
            *got = (size_t)k;
            return DFL_OK;
        }
        if (errno == EINTR)
            continue;
        if (errno == EAGAIN || errno == EWOULDBLOCK) { /* a non-blocking descriptor: wait */
            struct pollfd pf = {.fd = r->fd, .events = POLLIN};
            poll(&pf, 1, -1);
            continue;
        }
        *got = 0;
        return dfl_fail_errno(e, DFL_EIO, errno, "%s: read failed", r->name);
    }
}

/* Reads up to n bytes (fewer only at end of input); *got receives the count. */
static int read_upto(dfl_reader *r, void *buf, size_t n, size_t *got, dfl_err *e)
{
    uint8_t *p = buf;
    size_t done = 0;
    while (done < n) {
        size_t k;
        int rc = read_some(r, p + done, n - done, &k, e);
        if (rc) {
            *got = done;
            return rc;
        }
        if (k == 0)
            break;
        done += k;
    }
    *got = done;
    return DFL_OK;
}

static int grow(uint8_t **buf, size_t *cap, uint64_t need)
{
    if (need <= *cap)
        return 0;
    if (need > SIZE_MAX)
        return -1;
    uint8_t *p = malloc((size_t)need);
    if (!p)
        return -1;
    free(*buf);
    *buf = p;
    *cap = (size_t)need;
    return 0;
}

/* A block with room for n bytes at block_data(): the recycled one if it is large enough. */
static void *take_block(dfl_reader *r, uint64_t n)
{
    if (r->spare && r->spare_cap >= n) {
        void *p = r->spare;
        r->spare = NULL;
        r->spare_cap = 0;
        return p;
    }
    return block_alloc(n, false);
}

void dfl_reader_recycle(dfl_reader *r, dfl_batch *b)
{
    if (!b)
        return;
    if (b->owned) {
        /* every block behind a batch of this library holds the payload and 64 bytes more at
         * block_data() */
        uint64_t cap = dfl_batch_payload_size(b->n_tokens, b->n_seqs, b->n_layers, b->hidden, b->dtype) + 64;
        if (cap > 64 && cap > r->spare_cap) {
            free(r->spare);
            r->spare = b->owned;
            r->spare_cap = cap;
        } else {
            free(b->owned);
        }
    }
    memset(b, 0, sizeof *b);
}

/* Steps 2 to 6 of dfl-frame(5) "READING": everything that can be checked on the 64 header bytes.
 * want_seq is the expected frame number, or UINT64_MAX where it is not known (random access);
 * first is true for the first frame of the stream. */
static int check_header(dfl_reader *r, const uint8_t *h, uint64_t off, uint64_t want_seq, bool first,
                        fhdr *fh, dfl_err *e)
{
    uint64_t n = want_seq;
    int rc;
    if (memcmp(h, DFL_FRAME_MAGIC, 4) != 0) {
        if (first)
            rc = rfail(r, DFL_EDATA, n, off, "bad magic %02x %02x %02x %02x: not a .dfl stream", h[0], h[1], h[2], h[3]);
        else
            rc = rfail(r, DFL_EDATA, n, off, "bad magic %02x %02x %02x %02x (corrupt stream, or not a frame boundary)",
                       h[0], h[1], h[2], h[3]);
        (void)rc;
        return copy_failed(r, e);
    }
    if (first && h[4] != DFL_FRAME_MAJOR) {
        rfail(r, DFL_EUNSUP, n, off, "format major version %u is not supported (this reader reads version %d)",
              h[4], DFL_FRAME_MAJOR);
        return copy_failed(r, e);
    }
    uint64_t check = dfl_get_le64(h + 56);
    if (XXH3_64bits(h, 56) != check) {
        rfail(r, DFL_EDATA, n, off, "frame header check mismatch (the frame header is corrupt)");
        return copy_failed(r, e);
    }
    fh->flags = h[5];
    fh->type = dfl_get_le16(h + 6);
    fh->stored = dfl_get_le64(h + 8);
    fh->raw = dfl_get_le64(h + 16);
    fh->seq = dfl_get_le64(h + 24);
    if (h[4] != DFL_FRAME_MAJOR) {
        rfail(r, DFL_EDATA, n, off, "major version %u differs from the stream's version %d", h[4], DFL_FRAME_MAJOR);
        return copy_failed(r, e);
    }
    if (fh->flags & DFL_FF_RESERVED) {
        rfail(r, DFL_EDATA, n, off, "reserved flag bits set (flags 0x%02x)", fh->flags);
        return copy_failed(r, e);
    }
    if (!all_zero(h + 32, 24)) {
        rfail(r, DFL_EDATA, n, off, "reserved header bytes 32..55 are not zero");
        return copy_failed(r, e);
    }
    uint32_t t = fh->type, fl = fh->flags;
    bool skippable = fl & DFL_FF_SKIPPABLE, z = fl & DFL_FF_ZSTD;
    bool s2 = fl & DFL_FF_SHUFFLE2, s4 = fl & DFL_FF_SHUFFLE4;
    if (t == 0) {
        rfail(r, DFL_EDATA, n, off, "frame type 0 is invalid");
        return copy_failed(r, e);
    }
    if (t > DFL_FT_NOTE && !skippable) {
        rfail(r, DFL_EUNSUP, n, off, "unsupported frame type %u that readers must understand (written by a newer dfl?)", t);
        return copy_failed(r, e);
    }
    if (t <= DFL_FT_NOTE) {
        bool want_skip = t == DFL_FT_INDEX || t == DFL_FT_NOTE;
        if (skippable != want_skip) {
            rfail(r, DFL_EDATA, n, off, "%s frame with the skippable flag %s", type_name(t), skippable ? "set" : "clear");
            return copy_failed(r, e);
        }
        if (z && t != DFL_FT_TOKENS && t != DFL_FT_HIDDEN) {
            rfail(r, DFL_EDATA, n, off, "%s frame marked compressed (only batch frames may be)", type_name(t));
            return copy_failed(r, e);
        }
    }
    if ((s2 || s4) && !z) {
        rfail(r, DFL_EDATA, n, off, "shuffle flag without the zstd flag (flags 0x%02x)", fl);
        return copy_failed(r, e);
    }
    if (s2 && s4) {
        rfail(r, DFL_EDATA, n, off, "both shuffle flags set (flags 0x%02x)", fl);
        return copy_failed(r, e);
    }
    if (want_seq != UINT64_MAX && fh->seq != want_seq) {
        rfail(r, DFL_EDATA, n, off, "frame number %llu, expected %llu (a frame is missing or repeated)",
              (unsigned long long)fh->seq, (unsigned long long)want_seq);
        return copy_failed(r, e);
    }
    if (want_seq == UINT64_MAX && fh->seq == 0) {
        rfail(r, DFL_EDATA, n, off, "frame number 0 is the HEADER's");
        return copy_failed(r, e);
    }
    if (!z && fh->raw != fh->stored) {
        rfail(r, DFL_EDATA, n, off, "uncompressed frame with raw_len %llu != stored_len %llu",
              (unsigned long long)fh->raw, (unsigned long long)fh->stored);
        return copy_failed(r, e);
    }
    if (z && fh->stored == 0) {
        rfail(r, DFL_EDATA, n, off, "compressed frame with an empty payload");
        return copy_failed(r, e);
    }
    unsigned w = s2 ? 2 : s4 ? 4 : 1;
    if (fh->raw % w) {
        rfail(r, DFL_EDATA, n, off, "shuffled payload of %llu bytes is not a multiple of the width %u",
              (unsigned long long)fh->raw, w);
        return copy_failed(r, e);
    }
    /* step 6: limits, before anything is allocated or mapped */
    uint64_t max = r->opts.max_frame;
    const char *what = "the limit (max_frame)";
    if (t == DFL_FT_HEADER || t == DFL_FT_NOTE) {
        max = MAX_JSON_FRAME < max ? MAX_JSON_FRAME : max;
        what = "the limit for JSON frames";
    }
    if (fh->stored > max || fh->raw > max) {
        rfail(r, DFL_EDATA, n, off, "%s frame of %llu bytes (%llu stored) is over %s of %llu bytes",
              type_name(t), (unsigned long long)fh->raw, (unsigned long long)fh->stored, what,
              (unsigned long long)max);
        return copy_failed(r, e);
    }
    if (t == DFL_FT_END && (fh->raw != END_PAYLOAD || fl != 0)) {
        rfail(r, DFL_EDATA, n, off, "END frame of %llu bytes, flags 0x%02x (must be 64 bytes, flags 0)",
              (unsigned long long)fh->raw, fl);
        return copy_failed(r, e);
    }
    if (t == DFL_FT_INDEX && (fh->raw < 16 || (fh->raw - 16) % 16)) {
        rfail(r, DFL_EDATA, n, off, "INDEX frame of %llu bytes (must be 16 + 16 x count)", (unsigned long long)fh->raw);
        return copy_failed(r, e);
    }
    if ((t == DFL_FT_TOKENS || t == DFL_FT_HIDDEN) && fh->raw < 256) {
        rfail(r, DFL_EDATA, n, off, "%s frame of %llu bytes is too small for a batch", type_name(t),
              (unsigned long long)fh->raw);
        return copy_failed(r, e);
    }
    fh->pad = pad_of(fh->stored);
    fh->total = 64 + fh->stored + fh->pad + 8; /* no overflow: stored <= max_frame was checked */
    if (fh->stored > UINT64_MAX - 256 || fh->total > SIZE_MAX) {
        rfail(r, DFL_EDATA, n, off, "frame of %llu bytes cannot be held in memory", (unsigned long long)fh->stored);
        return copy_failed(r, e);
    }
    return DFL_OK;
}

/* A cut: the stream ended inside frame seq at off (got of its need bytes present), or where it
 * should have started (got == 0). */
static int cut(dfl_reader *r, uint64_t seq, uint64_t off, uint64_t got, uint64_t need, const fhdr *fh, dfl_err *e)
{
    if (got == 0 && off == 0)
        dfl_fail_empty(e, r->name);
    else if (got == 0)
        dfl_fail(e, DFL_ETRUNC, "%s: truncated: no END frame after %llu batches (input ends at offset %llu, where frame %llu should start)",
                 r->name, (unsigned long long)r->n_batches, (unsigned long long)off, (unsigned long long)seq);
    else if (fh)
        dfl_fail(e, DFL_ETRUNC, "%s: truncated inside frame %llu (%s) at offset %llu: %llu of its %llu bytes present",
                 r->name, (unsigned long long)seq, type_name(fh->type), (unsigned long long)off,
                 (unsigned long long)got, (unsigned long long)need);
    else
        dfl_fail(e, DFL_ETRUNC, "%s: truncated inside frame %llu at offset %llu: %llu of its 64 header bytes present",
                 r->name, (unsigned long long)seq, (unsigned long long)off, (unsigned long long)got);
    return sticky(r, DFL_ETRUNC, e);
}

static void unshuffle(uint8_t *dst, const uint8_t *src, size_t raw, unsigned w)
{
    size_t n = raw / w;
    if (w == 2) {
        const uint8_t *s0 = src, *s1 = src + n;
        for (size_t i = 0; i < n; i++) {
            dst[2 * i] = s0[i];
            dst[2 * i + 1] = s1[i];
        }
    } else {
        const uint8_t *s0 = src, *s1 = src + n, *s2 = src + 2 * n, *s3 = src + 3 * n;
        for (size_t i = 0; i < n; i++) {
            dst[4 * i] = s0[i];
            dst[4 * i + 1] = s1[i];
            dst[4 * i + 2] = s2[i];
            dst[4 * i + 3] = s3[i];
        }
    }
}

/* Step 8 (first half): the raw payload of a compressed frame, into a new block (*out, the data at
 * block_data(*out)). */
static int decode(dfl_reader *r, const fhdr *fh, uint64_t off, const uint8_t *stored, void **out, dfl_err *e)
{
    uint64_t n = fh->seq;
    unsigned w = fh->flags & DFL_FF_SHUFFLE2 ? 2 : fh->flags & DFL_FF_SHUFFLE4 ? 4 : 1;
    unsigned long long cs = ZSTD_getFrameContentSize(stored, fh->stored);
    if (cs == ZSTD_CONTENTSIZE_ERROR) {
        rfail(r, DFL_EDATA, n, off, "payload is not a zstd frame");
        return copy_failed(r, e);
    }
    if (cs == ZSTD_CONTENTSIZE_UNKNOWN || cs != fh->raw) {
        rfail(r, DFL_EDATA, n, off, "zstd frame content size %s, expected raw_len %llu",
              cs == ZSTD_CONTENTSIZE_UNKNOWN ? "absent" : "differs", (unsigned long long)fh->raw);
        return copy_failed(r, e);
    }
    size_t zn = ZSTD_findFrameCompressedSize(stored, fh->stored);
    if (ZSTD_isError(zn) || zn != fh->stored) {
        rfail(r, DFL_EDATA, n, off, "payload is not exactly one zstd frame (%s)",
              ZSTD_isError(zn) ? ZSTD_getErrorName(zn) : "bytes after it");
        return copy_failed(r, e);
    }
    if (!r->dctx && !(r->dctx = ZSTD_createDCtx()))
        return sticky(r, dfl_fail(e, DFL_ENOMEM, "%s: out of memory for zstd", r->name), e);
    void *blk = take_block(r, fh->raw + 64); /* headroom: see dfl_reader_recycle */
    uint8_t *raw = blk ? block_data(blk) : NULL;
    if (!blk)
        return sticky(r, dfl_fail(e, DFL_ENOMEM, "%s: frame %llu: out of memory for %llu bytes", r->name,
                                  (unsigned long long)n, (unsigned long long)fh->raw), e);
    uint8_t *dst = raw;
    if (w > 1) {
        if (grow(&r->sbuf, &r->scap, fh->raw)) {
            free(blk);
            return sticky(r, dfl_fail(e, DFL_ENOMEM, "%s: out of memory for %llu bytes", r->name,
                                      (unsigned long long)fh->raw), e);
        }
        dst = r->sbuf;
    }
    size_t got = ZSTD_decompressDCtx(r->dctx, dst, fh->raw, stored, fh->stored);
    if (ZSTD_isError(got) || got != fh->raw) {
        free(blk);
        rfail(r, DFL_EDATA, n, off, "zstd payload does not decompress: %s",
              ZSTD_isError(got) ? ZSTD_getErrorName(got) : "short output");
        return copy_failed(r, e);
    }
    if (w > 1)
        unshuffle(raw, r->sbuf, fh->raw, w);
    *out = blk;
    return DFL_OK;
}

/* The hash thread for a body of n bytes, or NULL where the reader hashes itself: small frames
 * (a handoff would cost more than it saves), opts.hash_thread off, too few CPUs for auto, or no
 * thread to be had. */
static dfl_hasher *body_hasher(dfl_reader *r, uint64_t n)
{
    if (r->hasher_off || n < HASH_THREAD_MIN)
        return NULL;
    if (!r->hasher && !(r->hasher = dfl_hasher_new()))
        r->hasher_off = true;
    return r->hasher;
}

/* The checks on a frame body read into dst (stored bytes, padding, trailer) once its hash is in
 * r->xx: the trailer (when verify) and the padding. */
static int body_checks(dfl_reader *r, const fhdr *fh, uint64_t off, const uint8_t *dst, bool verify, dfl_err *e)
{
    uint64_t body = fh->stored + fh->pad + 8;
    if (verify && XXH3_64bits_digest(r->xx) != dfl_get_le64(dst + body - 8)) {
        rfail(r, DFL_EDATA, fh->seq, off, "checksum mismatch (the %s frame is corrupt)", type_name(fh->type));
        return copy_failed(r, e);
    }
    if (!all_zero(dst + fh->stored, fh->pad)) {
        rfail(r, DFL_EDATA, fh->seq, off, "padding after the payload is not zero");
        return copy_failed(r, e);
    }
    return DFL_OK;
}

/* Reads the rest of a frame from the descriptor into dst (stored bytes, padding, trailer), hashing
 * as it goes; the 64 header bytes are in h. Checks the trailer and the padding. */
static int read_body(dfl_reader *r, const uint8_t *h, const fhdr *fh, uint64_t off, uint8_t *dst, dfl_err *e)
{
    uint64_t body = fh->stored + fh->pad + 8, done = 0;
    bool verify = !r->opts.no_verify;
    dfl_hasher *hs = verify ? body_hasher(r, body) : NULL;
    if (verify) {
        XXH3_64bits_reset(r->xx);
        XXH3_64bits_update(r->xx, h, 64);
    }
    /* one read(2) at a time, each piece hashed as soon as it is in (in the cache): on a pipe the
     * producer refills it meanwhile, where gathering a large piece before hashing it would leave
     * the pipe full (the producer waiting) while we hash, and empty while we gather. With the hash
     * thread, the piece is handed to it and the next read(2) starts at once: the copy out of the
     * pipe and the hash run side by side. The frame is returned only after the thread has hashed
     * every byte (dfl_hasher_finish) and the checks below passed; on a failed or cut read the
     * job is cancelled before dst can be freed. */
    if (hs)
        dfl_hasher_start(hs, r->xx, dst, body - 8);
    while (done < body) {
        size_t want = body - done > r->opts.chunk ? r->opts.chunk : (size_t)(body - done), got;
        int rc = read_some(r, dst + done, want, &got, e);
        if (rc || got == 0) {
            if (hs)
                dfl_hasher_cancel(hs);
            return rc ? sticky(r, rc, e) : cut(r, fh->seq, off, 64 + done, fh->total, fh, e);
        }
        if (hs) {
            dfl_hasher_avail(hs, done + got);
        } else if (verify) {
            uint64_t hashable = done < body - 8 ? (body - 8 - done < got ? body - 8 - done : got) : 0;
            XXH3_64bits_update(r->xx, dst + done, hashable);
        }
        done += got;
    }
    if (hs)
        dfl_hasher_finish(hs);
    return body_checks(r, fh, off, dst, verify, e);
}

/* Where read_body_bounce puts a frame's pieces: the reading thread's buffer or the bounce
 * thread's ring, each set up at its first use; NULL buffer and NULL thread (with r->bounce
 * lowered to -1) where neither can be had, and the frame is read by read_body. */
static bool bounce_ready(dfl_reader *r, dfl_bouncer **bt)
{
    *bt = NULL;
    if (r->bounce == 2 && !r->bouncer && !(r->bouncer = dfl_bouncer_new(r->opts.chunk, r->opts.bounce_slots)))
        r->bounce = 1; /* no thread: the reading thread does it */
    if (r->bounce == 2) {
        *bt = r->bouncer;
        return true;
    }
    if (!r->bounce_buf && !(r->bounce_buf = aligned_alloc(4096, (size_t)DFL_ALIGN_UP(r->opts.chunk, 4096))))
        r->bounce = -1;
    return r->bounce == 1;
}

/* read_body through bounce buffers (opts.bounce; frame_bounce.h): each read(2) of at most
 * opts.chunk bytes goes into a buffer that stays in the cache (the kernel's copy then writes no
 * cold lines), is hashed there, and is moved to its place in dst with streaming stores; by the
 * reading thread between its reads (bt NULL), or by the bounce thread while the next piece is
 * read. The checks, the errors and their messages are read_body's: the frame is returned only
 * after every piece is hashed and in place (dfl_bouncer_finish) and the checks passed; on a failed
 * or cut read the queued pieces are dropped (dfl_bouncer_cancel) before dst can be freed. */
static int read_body_bounce(dfl_reader *r, const uint8_t *h, const fhdr *fh, uint64_t off, uint8_t *dst,
                            dfl_bouncer *bt, dfl_err *e)
{
    uint64_t body = fh->stored + fh->pad + 8, done = 0;
    bool verify = !r->opts.no_verify;
    if (verify) {
        XXH3_64bits_reset(r->xx);
        XXH3_64bits_update(r->xx, h, 64);
    }
    while (done < body) {
        uint8_t *buf = bt ? dfl_bouncer_take(bt) : r->bounce_buf;
        size_t want = body - done > r->opts.chunk ? r->opts.chunk : (size_t)(body - done), got;
        int rc = read_some(r, buf, want, &got, e);
        if (rc || got == 0) {
            if (bt)
                dfl_bouncer_cancel(bt);
            return rc ? sticky(r, rc, e) : cut(r, fh->seq, off, 64 + done, fh->total, fh, e);
        }
        size_t hashable = !verify || done >= body - 8 ? 0 : body - 8 - done < got ? (size_t)(body - 8 - done) : got;
        if (bt) {
            dfl_bouncer_put(bt, r->xx, hashable, dst + done, got);
        } else {
            XXH3_64bits_update(r->xx, buf, hashable);
            dfl_copy_stream(dst + done, buf, got);
        }
        done += got;
    }
    if (bt)
        dfl_bouncer_finish(bt);
    return body_checks(r, fh, off, dst, verify, e);
}

/* Skips the body of a frame on a descriptor without keeping it (unknown skippable types). */
static int skip_body(dfl_reader *r, const uint8_t *h, const fhdr *fh, uint64_t off, dfl_err *e)
{
    if (grow(&r->zbuf, &r->zcap, SKIP_CHUNK + 128))
        return sticky(r, dfl_fail(e, DFL_ENOMEM, "%s: out of memory", r->name), e);
    bool verify = !r->opts.no_verify;
    if (verify) {
        XXH3_64bits_reset(r->xx);
        XXH3_64bits_update(r->xx, h, 64);
    }
    uint64_t left = fh->stored, done = 64;
    while (left > 0) {
        size_t want = left > SKIP_CHUNK ? SKIP_CHUNK : (size_t)left, got;
        int rc = read_upto(r, r->zbuf, want, &got, e);
        if (rc)
            return sticky(r, rc, e);
        if (verify)
            XXH3_64bits_update(r->xx, r->zbuf, got);
        done += got;
        if (got < want)
            return cut(r, fh->seq, off, done, fh->total, fh, e);
        left -= got;
    }
    size_t tail = (size_t)fh->pad + 8, got;
    int rc = read_upto(r, r->zbuf, tail, &got, e);
    if (rc)
        return sticky(r, rc, e);
    if (got < tail)
        return cut(r, fh->seq, off, done + got, fh->total, fh, e);
    if (verify) {
        XXH3_64bits_update(r->xx, r->zbuf, fh->pad);
        if (XXH3_64bits_digest(r->xx) != dfl_get_le64(r->zbuf + fh->pad)) {
            rfail(r, DFL_EDATA, fh->seq, off, "checksum mismatch (the frame of type %u is corrupt)", fh->type);
            return copy_failed(r, e);
        }
    }
    if (!all_zero(r->zbuf, fh->pad)) {
        rfail(r, DFL_EDATA, fh->seq, off, "padding after the payload is not zero");
        return copy_failed(r, e);
    }
    return DFL_OK;
}

/* Reads and checks one frame at stream offset off (mapped: anywhere; descriptor: the next one).
 * want_seq and first as in check_header. The payload of a known type is decoded (f->payload holds
 * the raw payload; f->owned is a block, or NULL where it points into a mapping); an unknown
 * skippable frame is checked and skipped (f->payload NULL). */
static int read_frame(dfl_reader *r, uint64_t off, uint64_t want_seq, bool first, dfl_frame *f, fhdr *fh,
                      dfl_err *e)
{
    memset(f, 0, sizeof *f);
    f->offset = off;
    uint64_t n = want_seq != UINT64_MAX ? want_seq : 0;
    const uint8_t *h;
    uint64_t got = 0;
    if (r->mapped) {
        got = off <= r->size ? r->size - off : 0;
        got = got < 64 ? got : 64;
        h = got ? r->base + off : r->hdr; /* an empty file has no mapping: base is NULL */
    } else {
        size_t k;
        int rc = read_upto(r, r->hdr, 64, &k, e);
        if (rc)
            return sticky(r, rc, e);
        got = k;
        h = r->hdr;
    }
    if (got < 64) {
        /* a few bytes that are not even the start of a frame are not a cut frame */
        if (got > 0 && memcmp(h, DFL_FRAME_MAGIC, got < 4 ? got : 4) != 0) {
            rfail(r, DFL_EDATA, n, off, "bad magic in the last %llu bytes: %s", (unsigned long long)got,
                  first ? "not a .dfl stream" : "not a frame");
            return copy_failed(r, e);
        }
        return cut(r, n, off, got, 64, NULL, e);
    }
    int rc = check_header(r, h, off, want_seq, first, fh, e);
    if (rc)
        return rc;
    n = fh->seq;
    f->seq = fh->seq;
    f->type = fh->type;
    f->flags = fh->flags;
    f->stored_len = fh->stored;
    f->raw_len = fh->raw;
    f->total_len = fh->total;
    bool z = fh->flags & DFL_FF_ZSTD;
    bool decode_it = fh->type <= DFL_FT_NOTE;
    const uint8_t *stored;
    if (r->mapped) {
        if (fh->total > r->size - off)
            return cut(r, n, off, r->size - off, fh->total, fh, e);
        stored = r->base + off + 64;
        if (fh->total >= (1u << 20))
            madvise((void *)((uintptr_t)(r->base + off) & ~(uintptr_t)4095), fh->total + 4096, MADV_WILLNEED);
        if (!r->opts.no_verify &&
            XXH3_64bits(r->base + off, 64 + fh->stored + fh->pad) != dfl_get_le64(stored + fh->stored + fh->pad)) {
            rfail(r, DFL_EDATA, n, off, "checksum mismatch (the %s frame is corrupt)", type_name(fh->type));
            return copy_failed(r, e);
        }
        if (!all_zero(stored + fh->stored, fh->pad)) {
            rfail(r, DFL_EDATA, n, off, "padding after the payload is not zero");
            return copy_failed(r, e);
        }
        if (!decode_it)
            return DFL_OK;
        if (!z) {
            f->payload = stored;
            return DFL_OK;
        }
    } else {
        if (!decode_it)
            return skip_body(r, h, fh, off, e);
        uint64_t body = fh->stored + fh->pad + 8;
        void *blk = z ? NULL : take_block(r, body);
        uint8_t *dst = z ? (grow(&r->zbuf, &r->zcap, body) ? NULL : r->zbuf) : blk ? block_data(blk) : NULL;
        if (!dst)
            return sticky(r, dfl_fail(e, DFL_ENOMEM, "%s: frame %llu: out of memory for %llu bytes", r->name,
                                      (unsigned long long)n, (unsigned long long)body), e);
        dfl_bouncer *bt;
        if (r->bounce > 0 && !r->regular && body >= BOUNCE_MIN && bounce_ready(r, &bt))
            rc = read_body_bounce(r, h, fh, off, dst, bt, e);
        else
            rc = read_body(r, h, fh, off, dst, e);
        if (rc) {
            free(blk);
            return rc;
        }
        if (!z) {
            f->owned = blk;
            f->payload = dst;
            return DFL_OK;
        }
        stored = dst;
    }
    void *blk = NULL;
    rc = decode(r, fh, off, stored, &blk, e);
    if (rc)
        return rc;
    f->owned = blk;
    f->payload = block_data(blk);
    return DFL_OK;
}

/* ---- payloads --------------------------------------------------------------------------------- */

/* The HEADER keys of dfl-frame(5). The frame header is ours and only we write it, so it is read
 * strictly (a config.json of Hugging Face is not): a key of the page present with the value null
 * is invalid (an optional key is left out, never null), and an integer is an integer token
 * (1000.0 and 1e3 are numbers, not integers). */
static const char *const header_keys[] = {"format", "version", "kind", "producer", "vocab_size",
                                          "fingerprint", "hidden_size", "layers", "dtype", "meta"};

/* An integer key of the HEADER (HFAIL-style errors; *out untouched when absent). */
static int header_int(dfl_reader *r, const json_t *j, const char *key, bool required, int64_t *out,
                      const char *what, dfl_err *e)
{
    json_t *v = json_object_get(j, key);
    if (!v) {
        if (required)
            return sticky(r, dfl_fail(e, DFL_EDATA, "%s: missing key '%s'", what, key), e);
        return DFL_OK;
    }
    if (!json_is_integer(v))
        return sticky(r, dfl_fail(e, DFL_EDATA, "%s: \"%s\" must be an integer (digits, without a fraction "
                                  "or an exponent)", what, key), e);
    *out = json_integer_value(v);
    return DFL_OK;
}

static int parse_header_json(dfl_reader *r, const uint8_t *p, uint64_t len, dfl_err *e)
{
    char what[600];
    snprintf(what, sizeof what, "%s: frame 0 at offset 0: HEADER", r->name);
    json_t *j;
    int rc = dfl_json_parse((const char *)p, (size_t)len, &j, what, e);
    if (rc)
        return sticky(r, rc, e);
    r->header_json = j;
    dfl_stream_info *in = &r->info;
#define HFAIL(...) sticky(r, dfl_fail(e, DFL_EDATA, __VA_ARGS__), e)
    if (!json_is_object(j))
        return HFAIL("%s: not a JSON object", what);
    for (size_t i = 0; i < DFL_ARRAY_LEN(header_keys); i++)
        if (json_is_null(json_object_get(j, header_keys[i])))
            return HFAIL("%s: \"%s\" is null (a key without a value is left out, never null)", what,
                         header_keys[i]);
    const char *s;
    int64_t v;
    if ((rc = dfl_json_str(j, "format", true, &s, what, e)))
        return sticky(r, rc, e);
    if (strcmp(s, "dfl") != 0)
        return HFAIL("%s: \"format\" is \"%s\", expected \"dfl\"", what, s);
    json_t *ver = json_object_get(j, "version");
    if (!json_is_array(ver) || json_array_size(ver) != 2 || !json_is_integer(json_array_get(ver, 0)) ||
        !json_is_integer(json_array_get(ver, 1)) || json_integer_value(json_array_get(ver, 1)) < 0)
        return HFAIL("%s: \"version\" must be [major, minor]", what);
    if (json_integer_value(json_array_get(ver, 0)) != DFL_FRAME_MAJOR)
        return HFAIL("%s: \"version\" says major %lld, the frames say %d", what,
                     (long long)json_integer_value(json_array_get(ver, 0)), DFL_FRAME_MAJOR);
    in->version_major = DFL_FRAME_MAJOR;
    v = json_integer_value(json_array_get(ver, 1));
    in->version_minor = v > 65535 ? 65535 : (int)v;
    if ((rc = dfl_json_str(j, "kind", true, &s, what, e)))
        return sticky(r, rc, e);
    if (strcmp(s, "tokens") == 0)
        in->kind = DFL_KIND_TOKENS;
    else if (strcmp(s, "hidden") == 0)
        in->kind = DFL_KIND_HIDDEN;
    else
        return HFAIL("%s: \"kind\" is \"%s\", expected \"tokens\" or \"hidden\"", what, s);
    if ((rc = dfl_json_str(j, "producer", true, &s, what, e)))
        return sticky(r, rc, e);
    if (strlen(s) >= sizeof in->producer)
        return HFAIL("%s: \"producer\" is longer than %zu bytes", what, sizeof in->producer - 1);
    strcpy(in->producer, s);
    v = 0;
    if ((rc = header_int(r, j, "vocab_size", false, &v, what, e)))
        return rc;
    if (json_object_get(j, "vocab_size") && (v < 1 || v > INT32_MAX))
        return HFAIL("%s: \"vocab_size\" %lld is out of range [1, 2147483647]", what, (long long)v);
    in->vocab_size = v;
    s = "";
    if ((rc = dfl_json_str(j, "fingerprint", false, &s, what, e)))
        return sticky(r, rc, e);
    if (strlen(s) >= sizeof in->fingerprint)
        return HFAIL("%s: \"fingerprint\" is longer than %zu bytes", what, sizeof in->fingerprint - 1);
    strcpy(in->fingerprint, s);
    json_t *meta = json_object_get(j, "meta");
    if (meta) {
        if (!json_is_object(meta))
            return HFAIL("%s: \"meta\" must be an object", what);
        in->meta = meta; /* borrowed from header_json, which the reader keeps */
    }
    json_t *hs = json_object_get(j, "hidden_size"), *ly = json_object_get(j, "layers"),
           *dt = json_object_get(j, "dtype");
    if (in->kind == DFL_KIND_TOKENS) {
        if (hs || ly || dt)
            return HFAIL("%s: a tokens stream has no \"hidden_size\", \"layers\" or \"dtype\"", what);
        in->dtype = DFL_DT_INVALID;
        return DFL_OK;
    }
    if ((rc = header_int(r, j, "hidden_size", true, &v, what, e)))
        return rc;
    if (v < 1 || v > INT32_MAX)
        return HFAIL("%s: \"hidden_size\" %lld is out of range [1, 2147483647]", what, (long long)v);
    in->hidden_size = v;
    if ((rc = dfl_json_str(j, "dtype", true, &s, what, e)))
        return sticky(r, rc, e);
    if (strcmp(s, "bf16") == 0)
        in->dtype = DFL_BF16;
    else if (strcmp(s, "f16") == 0)
        in->dtype = DFL_F16;
    else if (strcmp(s, "f32") == 0)
        in->dtype = DFL_F32;
    else
        return HFAIL("%s: \"dtype\" is \"%s\", expected \"bf16\", \"f16\" or \"f32\"", what, s);
    if (!json_is_array(ly) || json_array_size(ly) < 1 || json_array_size(ly) > DFL_MAX_LAYERS)
        return HFAIL("%s: \"layers\" must be a list of 1 to %d layer ids", what, DFL_MAX_LAYERS);
    in->n_layers = (int)json_array_size(ly);
    for (int k = 0; k < in->n_layers; k++) {
        json_t *x = json_array_get(ly, (size_t)k);
        if (!json_is_integer(x) || json_integer_value(x) < 0 || json_integer_value(x) > INT32_MAX)
            return HFAIL("%s: \"layers\"[%d] is not a layer id (an integer >= 0)", what, k);
        in->layers[k] = (int32_t)json_integer_value(x);
        for (int i = 0; i < k; i++)
            if (in->layers[i] == in->layers[k])
                return HFAIL("%s: layer %d is listed twice in \"layers\"", what, in->layers[k]);
    }
    return DFL_OK;
#undef HFAIL
}

/* Checks a batch payload and points b into it. expect_index: the batch index it must carry
 * (UINT64_MAX: any). contents: check seq_lens, ids, mask and padding too. */
static int parse_batch(dfl_reader *r, const uint8_t *p, const fhdr *fh, uint64_t off, uint64_t seq,
                       uint64_t expect_index, bool contents, dfl_batch *b, dfl_err *e)
{
    const dfl_stream_info *in = &r->info;
    uint64_t idx = dfl_get_le64(p), T = dfl_get_le64(p + 8);
    uint32_t S = dfl_get_le32(p + 16), K = dfl_get_le32(p + 20), H = dfl_get_le32(p + 24), ml = dfl_get_le32(p + 32);
    uint16_t dt = dfl_get_le16(p + 28);
#define BFAIL(...) (rfail(r, DFL_EDATA, seq, off, __VA_ARGS__), copy_failed(r, e))
    if ((fh->type == DFL_FT_TOKENS) != (in->kind == DFL_KIND_TOKENS))
        return BFAIL("%s frame in a %s stream", type_name(fh->type), in->kind == DFL_KIND_TOKENS ? "tokens" : "hidden");
    if (expect_index != UINT64_MAX && idx != expect_index)
        return BFAIL("batch index %llu, expected %llu", (unsigned long long)idx, (unsigned long long)expect_index);
    if (T < 1 || T > UINT32_MAX)
        return BFAIL("batch %llu: n_tokens %llu is out of range [1, 4294967295]", (unsigned long long)idx,
                     (unsigned long long)T);
    if (S < 1 || S > T)
        return BFAIL("batch %llu: n_seqs %u is out of range [1, n_tokens %llu]", (unsigned long long)idx, S,
                     (unsigned long long)T);
    if (dfl_get_le16(p + 30) != 0 || !all_zero(p + 36, 28))
        return BFAIL("batch %llu: reserved batch header fields are not zero", (unsigned long long)idx);
    if (in->kind == DFL_KIND_TOKENS) {
        if (K || H || dt)
            return BFAIL("batch %llu: token batch with n_layers %u, hidden %u, dtype %u (must be 0)",
                         (unsigned long long)idx, K, H, dt);
    } else if (K != (uint32_t)in->n_layers || H != (uint64_t)in->hidden_size || dt != (uint16_t)in->dtype) {
        return BFAIL("batch %llu: %u layers x hidden %u of %s (dtype code %u), but the HEADER says %d x %lld of %s",
                     (unsigned long long)idx, K, H, dt < DFL_DT_COUNT ? dfl_dtype_lower((dfl_dtype)dt) : "?", dt,
                     in->n_layers, (long long)in->hidden_size, dfl_dtype_lower(in->dtype));
    }
    if (ml < 1 || ml > T)
        return BFAIL("batch %llu: max_len %u is out of range [1, n_tokens]", (unsigned long long)idx, ml);
    dfl_batch_layout l;
    if (!dfl_batch_layout_of(T, S, K, H, (dfl_dtype)dt, &l) || l.size != fh->raw)
        return BFAIL("batch %llu: payload is %llu bytes, the batch header implies %llu", (unsigned long long)idx,
                     (unsigned long long)fh->raw, (unsigned long long)l.size);
    memset(b, 0, sizeof *b);
    b->index = idx;
    b->offset = off;
    b->n_tokens = T;
    b->n_seqs = S;
    b->max_len = ml;
    b->n_layers = K;
    b->hidden = H;
    b->dtype = (dfl_dtype)dt;
    batch_point(b, p, &l);
    if (!contents)
        return DFL_OK;
    /* seq_lens */
    uint64_t sum;
    uint32_t mx;
    int64_t zero = dfl_seq_lens_scan(b->seq_lens, S, &sum, &mx);
    if (zero >= 0)
        return BFAIL("batch %llu: sequence %u has length 0", (unsigned long long)idx, (uint32_t)zero);
    if (sum != T)
        return BFAIL("batch %llu: seq_lens sum to %llu, not n_tokens %llu", (unsigned long long)idx,
                     (unsigned long long)sum, (unsigned long long)T);
    if (mx != ml)
        return BFAIL("batch %llu: the longest sequence is %u, max_len says %u", (unsigned long long)idx, mx, ml);
    uint32_t lim = in->vocab_size > 0 ? (uint32_t)in->vocab_size : 0x80000000u;
    int64_t at = dfl_ids_first_bad(b->input_ids, T, lim);
    if (at >= 0)
        return BFAIL("batch %llu: token %llu has id %d, outside [0, %u)", (unsigned long long)idx,
                     (unsigned long long)at, b->input_ids[at], lim);
    if ((at = dfl_mask_first_bad(b->loss_mask, T)) >= 0)
        return BFAIL("batch %llu: loss_mask[%llu] is %u (must be 0 or 1)", (unsigned long long)idx,
                     (unsigned long long)at, b->loss_mask[at]);
    /* section padding */
    uint64_t ends[3 + DFL_MAX_LAYERS][2];
    int ns = 0;
    ends[ns][0] = l.seq_lens + 4ull * S, ends[ns++][1] = l.input_ids;
    ends[ns][0] = l.input_ids + 4 * T, ends[ns++][1] = l.loss_mask;
    ends[ns][0] = l.loss_mask + T, ends[ns++][1] = l.layer0;
    for (uint32_t k = 0; k < K; k++) {
        uint64_t st = l.layer0 + k * l.layer_stride;
        ends[ns][0] = st + T * H * dfl_dtype_size((dfl_dtype)dt), ends[ns++][1] = st + l.layer_stride;
    }
    for (int i = 0; i < ns; i++)
        if (!all_zero(p + ends[i][0], ends[i][1] - ends[i][0]))
            return BFAIL("batch %llu: padding at payload offset %llu is not zero", (unsigned long long)idx,
                         (unsigned long long)ends[i][0]);
    return DFL_OK;
#undef BFAIL
}

static int check_note(dfl_reader *r, const dfl_frame *f, dfl_err *e)
{
    char what[600];
    snprintf(what, sizeof what, "%s: frame %llu at offset %llu: NOTE", r->name, (unsigned long long)f->seq,
             (unsigned long long)f->offset);
    json_t *j;
    int rc = dfl_json_parse((const char *)f->payload, (size_t)f->raw_len, &j, what, e);
    if (rc)
        return sticky(r, rc, e);
    bool obj = json_is_object(j);
    json_decref(j);
    if (!obj) {
        rfail(r, DFL_EDATA, f->seq, f->offset, "NOTE is not a JSON object");
        return copy_failed(r, e);
    }
    return DFL_OK;
}

static int check_index(dfl_reader *r, const dfl_frame *f, dfl_err *e)
{
    const uint8_t *p = f->payload;
    uint64_t count = dfl_get_le64(p);
#define IFAIL(...) (rfail(r, DFL_EDATA, f->seq, f->offset, __VA_ARGS__), copy_failed(r, e))
    if (dfl_get_le64(p + 8) != 0)
        return IFAIL("INDEX reserved field is not zero");
    if (count != (f->raw_len - 16) / 16)
        return IFAIL("INDEX count %llu does not match its %llu bytes", (unsigned long long)count,
                     (unsigned long long)f->raw_len);
    if (count != r->n_batches)
        return IFAIL("INDEX lists %llu batches, the stream has %llu", (unsigned long long)count,
                     (unsigned long long)r->n_batches);
    for (uint64_t i = 0; i < count; i++) {
        const uint8_t *q = p + 16 + 16 * i;
        if (dfl_get_le64(q) != r->seen[i].offset || dfl_get_le32(q + 8) != r->seen[i].n_seqs || dfl_get_le32(q + 12) != r->seen[i].n_tokens)
            return IFAIL("INDEX entry %llu (offset %llu, %u seqs, %u tokens) does not match batch %llu (offset %llu, %u seqs, %u tokens)",
                         (unsigned long long)i, (unsigned long long)dfl_get_le64(q), dfl_get_le32(q + 8), dfl_get_le32(q + 12),
                         (unsigned long long)i, (unsigned long long)r->seen[i].offset, r->seen[i].n_seqs,
                         r->seen[i].n_tokens);
    }
    return DFL_OK;
#undef IFAIL
}

static void decode_end(const uint8_t *p, dfl_stream_end *end)
{
    end->n_batches = dfl_get_le64(p);
    end->n_tokens = dfl_get_le64(p + 8);
    end->n_seqs = dfl_get_le64(p + 16);
    end->index_offset = dfl_get_le64(p + 24);
    end->n_frames = dfl_get_le64(p + 32);
}

static int check_end(dfl_reader *r, const dfl_frame *f, dfl_err *e)
{
    dfl_stream_end end;
    decode_end(f->payload, &end);
#define EFAIL(...) (rfail(r, DFL_EDATA, f->seq, f->offset, __VA_ARGS__), copy_failed(r, e))
    if (!all_zero(f->payload + 40, 24))
        return EFAIL("END reserved bytes are not zero");
    if (end.n_batches != r->n_batches || end.n_tokens != r->n_tokens || end.n_seqs != r->n_seqs)
        return EFAIL("END totals (%llu batches, %llu tokens, %llu sequences) differ from the stream's (%llu, %llu, %llu)",
                     (unsigned long long)end.n_batches, (unsigned long long)end.n_tokens,
                     (unsigned long long)end.n_seqs, (unsigned long long)r->n_batches,
                     (unsigned long long)r->n_tokens, (unsigned long long)r->n_seqs);
    if (end.index_offset != r->index_offset)
        return EFAIL("END gives the INDEX offset %llu, the INDEX frame is at %llu",
                     (unsigned long long)end.index_offset, (unsigned long long)r->index_offset);
    if (end.n_frames != f->seq)
        return EFAIL("END counts %llu frames before it, there were %llu", (unsigned long long)end.n_frames,
                     (unsigned long long)f->seq);
    /* nothing may follow */
    uint64_t after = f->offset + f->total_len;
    if (r->mapped) {
        if (r->size != after)
            return EFAIL("the input goes on for %llu bytes after the END frame (the stream must end there)",
                         (unsigned long long)(r->size - after));
    } else {
        uint8_t c;
        size_t got;
        int rc = read_upto(r, &c, 1, &got, e);
        if (rc)
            return sticky(r, rc, e);
        if (got)
            return EFAIL("the input goes on after the END frame (the stream must end there)");
    }
    r->end = end;
    return DFL_OK;
#undef EFAIL
}

/* ---- reader API ------------------------------------------------------------------------------- */

static int reader_setup(dfl_reader *r, dfl_err *e)
{
    fhdr fh;
    dfl_frame f;
    int rc = read_frame(r, 0, 0, true, &f, &fh, e);
    if (rc)
        return rc;
    if (fh.type != DFL_FT_HEADER) {
        dfl_frame_free(&f);
        rfail(r, DFL_EDATA, 0, 0, "the first frame is %s (type %u), not HEADER", type_name(fh.type), fh.type);
        return copy_failed(r, e);
    }
    rc = parse_header_json(r, f.payload, f.raw_len, e);
    dfl_frame_free(&f);
    if (rc)
        return rc;
    r->header_len = fh.total;
    r->pos = fh.total;
    r->seq = 1;
    /* a pipe that its producer left at the system's default (cat, zstdcat: 64 KiB) costs a
     * wake-up per 64 KiB: 1.0 -> 1.45 s of CPU and 20% of the rate for a 3.2 GB stream spliced
     * in, against 1 MiB. Enlarged once the HEADER is in, so that a producer that sized the pipe
     * itself (a dfl writer does so before its HEADER) keeps the size it chose, unless that is
     * 64 KiB or less */
    if (r->pipe && fcntl(r->fd, F_GETPIPE_SZ) <= 65536)
        dfl_pipe_enlarge(r->fd, PIPE_SIZE);
    return DFL_OK;
}

static int reader_new(dfl_reader **out, int fd, bool own_fd, const char *name, const dfl_reader_opts *opts,
                      dfl_err *e)
{
    dfl_reader *r = calloc(1, sizeof *r);
    if (!r)
        return dfl_fail(e, DFL_ENOMEM, "%s: out of memory", name);
    r->fd = fd;
    r->own_fd = own_fd;
    r->name = dfl_strdup(name);
    r->xx = XXH3_createState();
    if (opts)
        r->opts = *opts;
    if (r->opts.max_frame == 0)
        r->opts.max_frame = DEFAULT_MAX_FRAME;
    if (r->opts.chunk == 0)
        r->opts.chunk = READ_CHUNK;
    r->hasher_off = r->opts.hash_thread < 0 || (r->opts.hash_thread == 0 && dfl_ncpu() < HASH_THREAD_CPUS);
    r->bounce = r->opts.bounce ? r->opts.bounce : dfl_ncpu() >= AUTO_BOUNCE_CPUS ? 2 : -1;
    if (r->opts.bounce_slots == 0)
        r->opts.bounce_slots = BOUNCE_SLOTS;
    if (r->opts.bounce < -1 || r->opts.bounce > 2 || r->opts.bounce_slots < 2 || r->opts.bounce_slots > 64) {
        dfl_fail(e, DFL_EUSAGE, "%s: reader options: bounce %d (-1, 0, 1 or 2), bounce_slots %u (2 to 64)", name,
                 r->opts.bounce, r->opts.bounce_slots);
        dfl_reader_close(r);
        return DFL_EUSAGE;
    }
    if (!r->name || !r->xx) {
        dfl_reader_close(r);
        return dfl_fail(e, DFL_ENOMEM, "%s: out of memory", name);
    }
    struct stat st;
    if (fstat(fd, &st) != 0) {
        int err = errno;
        dfl_fail_errno(e, DFL_EIO, err, "%s: cannot stat", name);
        dfl_reader_close(r);
        return DFL_EIO;
    }
    if (S_ISDIR(st.st_mode)) {
        dfl_fail(e, DFL_EIO, "%s: is a directory", name);
        dfl_reader_close(r);
        return DFL_EIO;
    }
    r->pipe = S_ISFIFO(st.st_mode);
    r->regular = S_ISREG(st.st_mode);
    if (S_ISREG(st.st_mode)) {
        off_t pos = lseek(fd, 0, SEEK_CUR);
        if (pos >= 0 && pos % 64 == 0 && (uint64_t)st.st_size >= (uint64_t)pos) {
            r->mapped = true;
            r->map_size = (size_t)st.st_size;
            r->size = (uint64_t)st.st_size - (uint64_t)pos;
            if (r->map_size > 0) {
                void *m = mmap(NULL, r->map_size, PROT_READ, MAP_SHARED, fd, 0);
                if (m == MAP_FAILED) {
                    int err = errno;
                    dfl_fail_errno(e, DFL_EIO, err, "%s: cannot map", name);
                    dfl_reader_close(r);
                    return DFL_EIO;
                }
                r->map = m;
                r->base = r->map + pos;
            }
        }
    }
    int rc = reader_setup(r, e);
    if (rc) {
        dfl_reader_close(r);
        return rc;
    }
    *out = r;
    return DFL_OK;
}

int dfl_reader_open_fd(dfl_reader **r, int fd, const char *name, const dfl_reader_opts *opts, dfl_err *e)
{
    *r = NULL;
    return reader_new(r, fd, false, name, opts, e);
}

int dfl_reader_open(dfl_reader **r, const char *path, const dfl_reader_opts *opts, dfl_err *e)
{
    *r = NULL;
    if (strcmp(path, "-") == 0)
        return reader_new(r, 0, false, "stdin", opts, e);
    int fd = open(path, O_RDONLY | O_CLOEXEC);
    if (fd < 0)
        return dfl_fail_errno(e, DFL_EIO, errno, "%s: cannot open", path);
    return reader_new(r, fd, true, path, opts, e);
}

void dfl_reader_close(dfl_reader *r)
{
    if (!r)
        return;
    if (r->map)
        munmap((void *)r->map, r->map_size);
    if (r->own_fd && r->fd >= 0)
        close(r->fd);
    json_decref(r->header_json);
    free(r->name);
    free(r->seen);
    free(r->zbuf);
    free(r->sbuf);
    free(r->index);
    free(r->index_seq);
    free(r->spare);
    ZSTD_freeDCtx(r->dctx);
    dfl_hasher_free(r->hasher);
    dfl_bouncer_free(r->bouncer);
    free(r->bounce_buf);
    if (r->xx)
        XXH3_freeState(r->xx);
    free(r);
}

const dfl_stream_info *dfl_reader_info(const dfl_reader *r) { return &r->info; }
const char *dfl_reader_name(const dfl_reader *r) { return r->name; }
uint64_t dfl_reader_offset(const dfl_reader *r) { return r->pos; }
const dfl_stream_end *dfl_reader_end(const dfl_reader *r) { return &r->end; }
bool dfl_reader_truncated(const dfl_reader *r) { return r->truncated; }

/* Stream-level checks of a frame just read (its place, its type's payload); counts batches. */
static int accept_frame(dfl_reader *r, const dfl_frame *f, const fhdr *fh, dfl_err *e)
{
    uint32_t t = f->type;
    if (r->index_offset && t != DFL_FT_END) {
        rfail(r, DFL_EDATA, f->seq, f->offset, "%s frame after the INDEX frame (INDEX must come right before END)",
              type_name(t));
        return copy_failed(r, e);
    }
    switch (t) {
    case DFL_FT_HEADER:
        rfail(r, DFL_EDATA, f->seq, f->offset, "a second HEADER frame");
        return copy_failed(r, e);
    case DFL_FT_TOKENS:
    case DFL_FT_HIDDEN: {
        dfl_batch b;
        int rc = parse_batch(r, f->payload, fh, f->offset, f->seq, r->n_batches, true, &b, e);
        if (rc)
            return rc;
        if (r->n_batches == r->seen_cap) {
            size_t cap = r->seen_cap ? r->seen_cap * 2 : 256;
            dfl_index_entry *s = realloc(r->seen, cap * sizeof *s);
            if (!s)
                return sticky(r, dfl_fail(e, DFL_ENOMEM, "%s: out of memory", r->name), e);
            r->seen = s;
            r->seen_cap = cap;
        }
        r->seen[r->n_batches] = (dfl_index_entry){f->offset, b.n_seqs, (uint32_t)b.n_tokens};
        r->n_batches++;
        r->n_tokens += b.n_tokens;
        r->n_seqs += b.n_seqs;
        r->checked_offset = f->offset;
        r->have_checked = true;
        return DFL_OK;
    }
    case DFL_FT_INDEX: {
        int rc = check_index(r, f, e);
        if (rc)
            return rc;
        r->index_offset = f->offset;
        return DFL_OK;
    }
    case DFL_FT_NOTE:
        return check_note(r, f, e);
    case DFL_FT_END: {
        int rc = check_end(r, f, e);
        if (rc)
            return rc;
        r->at_end = true;
        return DFL_OK;
    }
    default: /* unknown skippable: nothing to check */
        return DFL_OK;
    }
}

/* Reads the next frame after HEADER. */
static int next_frame(dfl_reader *r, dfl_frame *f, bool *eos, dfl_err *e)
{
    *eos = false;
    memset(f, 0, sizeof *f);
    if (r->failed)
        return copy_failed(r, e);
    if (r->at_end || r->truncated) {
        *eos = true;
        return DFL_OK;
    }
    fhdr fh;
    int rc = read_frame(r, r->pos, r->seq, false, f, &fh, e);
    if (rc == DFL_ETRUNC && r->opts.allow_truncated) {
        dfl_frame_free(f);
        r->failed = 0;
        r->truncated = true;
        r->end = (dfl_stream_end){r->n_batches, r->n_tokens, r->n_seqs, 0, r->seq};
        *eos = true;
        dfl_err_clear(e);
        return DFL_OK;
    }
    if (rc) {
        dfl_frame_free(f);
        return rc;
    }
    rc = accept_frame(r, f, &fh, e);
    if (rc) {
        dfl_frame_free(f);
        return rc;
    }
    r->pos += fh.total;
    r->seq++;
    return DFL_OK;
}

int dfl_reader_next_frame(dfl_reader *r, dfl_frame *f, bool *eos, dfl_err *e)
{
    return next_frame(r, f, eos, e);
}

int dfl_reader_parse_batch(dfl_reader *r, const dfl_frame *f, dfl_batch *b, dfl_err *e)
{
    if (f->type != DFL_FT_TOKENS && f->type != DFL_FT_HIDDEN)
        return dfl_fail(e, DFL_EUSAGE, "%s: frame %llu at offset %llu is %s, not a batch", r->name,
                        (unsigned long long)f->seq, (unsigned long long)f->offset, type_name(f->type));
    fhdr fh = {.type = f->type, .flags = f->flags, .stored = f->stored_len, .raw = f->raw_len, .seq = f->seq};
    bool checked = r->have_checked && r->checked_offset == f->offset;
    return parse_batch(r, f->payload, &fh, f->offset, f->seq, UINT64_MAX, !checked, b, e);
}

int dfl_reader_next(dfl_reader *r, dfl_batch *b, bool *eos, dfl_err *e)
{
    for (;;) {
        dfl_frame f;
        int rc = next_frame(r, &f, eos, e);
        if (rc || *eos)
            return rc;
        if (f.type == DFL_FT_END) {
            dfl_frame_free(&f);
            *eos = true;
            return DFL_OK;
        }
        if (f.type == DFL_FT_TOKENS || f.type == DFL_FT_HIDDEN) {
            fhdr fh = {.type = f.type, .flags = f.flags, .stored = f.stored_len, .raw = f.raw_len, .seq = f.seq};
            rc = parse_batch(r, f.payload, &fh, f.offset, f.seq, UINT64_MAX, false, b, e);
            if (rc) {
                dfl_frame_free(&f);
                return rc;
            }
            b->owned = f.owned;
            return DFL_OK;
        }
        dfl_frame_free(&f);
    }
}

/* ---- random access (mapped files) ------------------------------------------------------------- */

/* Reads and checks a whole frame at off in a mapping (checksum included), decoding it. */
static int frame_at(dfl_reader *r, uint64_t off, uint64_t want_seq, dfl_frame *f, fhdr *fh, dfl_err *e)
{
    return read_frame(r, off, want_seq, false, f, fh, e);
}

/* Random access (dfl-frame(5) "Random access"): the frames between the HEADER and the INDEX at
 * io (frame io_seq), walked by their frame headers, get the checks that reading the stream makes,
 * short of reading the batch payloads, which dfl_reader_batch_at checks in full when it reads
 * them: each frame header (steps 2 to 6 of READING: frame numbers without a gap, no unknown
 * must-understand type), the place of each frame (no second HEADER, no INDEX or END before the
 * INDEX, the batch frames exactly those the INDEX lists, in its order), and every frame that is
 * not a batch (a NOTE, a skippable frame of an unknown type) read and checked in full, as the
 * walk of the stream checks it. seqs[i] receives the frame number of batch frame i. */
static int walk_to_index(dfl_reader *r, uint64_t io, uint64_t io_seq, const dfl_index_entry *ent, uint64_t count,
                         uint64_t *seqs, dfl_err *e)
{
    uint64_t pos = r->header_len, seq = 1, k = 0;
    while (pos < io) {
        fhdr fh;
        int rc = check_header(r, r->base + pos, pos, seq, false, &fh, e);
        if (rc)
            return rc;
        if (fh.total > io - pos) {
            rfail(r, DFL_EDATA, seq, pos, "%s frame of %llu bytes runs past the INDEX frame at offset %llu",
                  type_name(fh.type), (unsigned long long)fh.total, (unsigned long long)io);
            return copy_failed(r, e);
        }
        switch (fh.type) {
        case DFL_FT_HEADER:
            rfail(r, DFL_EDATA, seq, pos, "a second HEADER frame");
            return copy_failed(r, e);
        case DFL_FT_INDEX:
        case DFL_FT_END:
            rfail(r, DFL_EDATA, seq, pos, "%s frame before the INDEX frame at offset %llu (INDEX must come right "
                  "before END, and END last)", type_name(fh.type), (unsigned long long)io);
            return copy_failed(r, e);
        case DFL_FT_TOKENS:
        case DFL_FT_HIDDEN:
            if (k == count || ent[k].offset != pos) {
                rfail(r, DFL_EDATA, seq, pos, "batch frame %llu is not the one the INDEX lists (%s)",
                      (unsigned long long)k, k == count ? "it lists fewer" : "its entry gives another offset");
                return copy_failed(r, e);
            }
            seqs[k++] = seq;
            break;
        default: {
            dfl_frame f;
            fhdr fr;
            rc = read_frame(r, pos, seq, false, &f, &fr, e);
            if (!rc && fh.type == DFL_FT_NOTE)
                rc = check_note(r, &f, e);
            dfl_frame_free(&f);
            if (rc)
                return rc;
        }
        }
        pos += fh.total;
        seq++;
    }
    if (seq != io_seq) {
        rfail(r, DFL_EDATA, io_seq, io, "frame number %llu, expected %llu (a frame is missing or repeated)",
              (unsigned long long)io_seq, (unsigned long long)seq);
        return copy_failed(r, e);
    }
    if (k != count) {
        rfail(r, DFL_EDATA, io_seq, io, "INDEX lists %llu batches, the stream has %llu", (unsigned long long)count,
              (unsigned long long)k);
        return copy_failed(r, e);
    }
    return DFL_OK;
}

int dfl_reader_index(dfl_reader *r, const dfl_index_entry **entries, uint64_t *n, dfl_err *e)
{
    *entries = NULL;
    *n = 0;
    if (!r->mapped)
        return dfl_fail(e, DFL_EUNSUP, "%s: not a regular file: no random access (read the stream in order)", r->name);
    if (r->index_loaded) {
        *entries = r->index;
        *n = r->index_n;
        return DFL_OK;
    }
    /* random access must not disturb a walk in progress: save and restore the sticky error */
    int saved_failed = r->failed;
    char saved_msg[sizeof r->failed_msg];
    memcpy(saved_msg, r->failed_msg, sizeof saved_msg);
    int rc = DFL_OK;
    uint64_t end_off = r->size >= END_FRAME ? r->size - END_FRAME : 0;
    const uint8_t *h = r->base + end_off;
    dfl_frame f = {0}, fi = {0};
    fhdr fh;
    if (r->size < r->header_len + END_FRAME || end_off % 64 || memcmp(h, DFL_FRAME_MAGIC, 4) != 0 ||
        dfl_get_le16(h + 6) != DFL_FT_END) {
        r->index_absent = true;
        if (r->opts.allow_truncated)
            rc = dfl_fail(e, DFL_EUNSUP, "%s: no END frame at the end of the file: no index", r->name);
        else
            rc = dfl_fail(e, DFL_ETRUNC, "%s: truncated: no END frame at the end of the file (offset %llu)",
                          r->name, (unsigned long long)end_off);
        goto out;
    }
    if ((rc = frame_at(r, end_off, UINT64_MAX, &f, &fh, e)))
        goto out;
    dfl_stream_end end;
    decode_end(f.payload, &end);
    bool end_reserved = !all_zero(f.payload + 40, 24);
    dfl_frame_free(&f);
    if (end_reserved) {
        rc = dfl_fail(e, DFL_EDATA, "%s: frame %llu at offset %llu: END reserved bytes are not zero", r->name,
                      (unsigned long long)fh.seq, (unsigned long long)end_off);
        goto out;
    }
    if (end.n_frames != fh.seq) {
        rc = dfl_fail(e, DFL_EDATA, "%s: END frame at offset %llu counts %llu frames but is frame %llu", r->name,
                      (unsigned long long)end_off, (unsigned long long)end.n_frames, (unsigned long long)fh.seq);
        goto out;
    }
    if (end.index_offset == 0) {
        r->index_absent = true;
        rc = dfl_fail(e, DFL_EUNSUP, "%s: the file has no INDEX frame (read the stream in order)", r->name);
        goto out;
    }
    uint64_t io = end.index_offset;
    if (io % 64 || io < r->header_len || io >= end_off || end.n_frames < 2) {
        rc = dfl_fail(e, DFL_EDATA, "%s: END frame gives an impossible INDEX offset %llu", r->name, (unsigned long long)io);
        goto out;
    }
    if ((rc = frame_at(r, io, end.n_frames - 1, &fi, &fh, e)))
        goto out;
    if (fh.type != DFL_FT_INDEX || io + fh.total != end_off) {
        rc = dfl_fail(e, DFL_EDATA, "%s: the frame at the INDEX offset %llu is %s and ends at %llu, not an INDEX ending where END starts (%llu)",
                      r->name, (unsigned long long)io, type_name(fh.type), (unsigned long long)(io + fh.total),
                      (unsigned long long)end_off);
        goto out;
    }
    const uint8_t *p = fi.payload;
    uint64_t count = dfl_get_le64(p);
    if (dfl_get_le64(p + 8) != 0 || count != (fi.raw_len - 16) / 16 || count != end.n_batches) {
        rc = dfl_fail(e, DFL_EDATA, "%s: INDEX frame at offset %llu: count %llu does not match its size or END's %llu batches",
                      r->name, (unsigned long long)io, (unsigned long long)count, (unsigned long long)end.n_batches);
        goto out;
    }
    dfl_index_entry *ent = malloc((count ? count : 1) * sizeof *ent);
    if (!ent) {
        rc = dfl_fail(e, DFL_ENOMEM, "%s: out of memory for the index", r->name);
        goto out;
    }
    uint64_t st = 0, ss = 0, prev = 0;
    for (uint64_t i = 0; i < count; i++) {
        const uint8_t *q = p + 16 + 16 * i;
        ent[i] = (dfl_index_entry){dfl_get_le64(q), dfl_get_le32(q + 8), dfl_get_le32(q + 12)};
        if (ent[i].offset % 64 || ent[i].offset < r->header_len || ent[i].offset >= io || (i && ent[i].offset <= prev) ||
            ent[i].n_seqs < 1 || ent[i].n_tokens < ent[i].n_seqs) {
            rc = dfl_fail(e, DFL_EDATA, "%s: INDEX frame at offset %llu: entry %llu (offset %llu, %u seqs, %u tokens) is impossible",
                          r->name, (unsigned long long)io, (unsigned long long)i, (unsigned long long)ent[i].offset,
                          ent[i].n_seqs, ent[i].n_tokens);
            free(ent);
            goto out;
        }
        prev = ent[i].offset;
        st += ent[i].n_tokens;
        ss += ent[i].n_seqs;
    }
    if (st != end.n_tokens || ss != end.n_seqs) {
        free(ent);
        rc = dfl_fail(e, DFL_EDATA, "%s: INDEX totals (%llu tokens, %llu sequences) differ from END's (%llu, %llu)",
                      r->name, (unsigned long long)st, (unsigned long long)ss, (unsigned long long)end.n_tokens,
                      (unsigned long long)end.n_seqs);
        goto out;
    }
    uint64_t *seqs = malloc((count ? count : 1) * sizeof *seqs);
    if (!seqs) {
        free(ent);
        rc = dfl_fail(e, DFL_ENOMEM, "%s: out of memory for the index", r->name);
        goto out;
    }
    if ((rc = walk_to_index(r, io, end.n_frames - 1, ent, count, seqs, e))) {
        free(ent);
        free(seqs);
        goto out;
    }
    r->index = ent;
    r->index_seq = seqs;
    r->index_n = count;
    r->index_loaded = true;
    *entries = ent;
    *n = count;
out:
    dfl_frame_free(&fi);
    r->failed = saved_failed;
    memcpy(r->failed_msg, saved_msg, sizeof saved_msg);
    return rc;
}

int dfl_reader_batch_at(dfl_reader *r, uint64_t offset, dfl_batch *b, dfl_err *e)
{
    memset(b, 0, sizeof *b);
    if (!r->mapped)
        return dfl_fail(e, DFL_EUNSUP, "%s: not a regular file: no random access", r->name);
    uint64_t want_index = UINT64_MAX, want_seq = UINT64_MAX;
    const dfl_index_entry *ent = NULL;
    if (!r->index_loaded && !r->index_absent) {
        /* a file with an INDEX is read through it, which checks the frames around the batches and
         * the place of each: reading a batch by its offset checks what reading the stream checks */
        const dfl_index_entry *all;
        uint64_t n;
        dfl_err ie;
        int rc = dfl_reader_index(r, &all, &n, &ie);
        if (rc && !r->index_absent) { /* absent (no INDEX, no END): each frame on its own */
            if (e)
                *e = ie;
            return rc;
        }
    }
    if (r->index_loaded) {
        uint64_t lo = 0, hi = r->index_n;
        while (lo < hi) {
            uint64_t mid = lo + (hi - lo) / 2;
            if (r->index[mid].offset < offset)
                lo = mid + 1;
            else
                hi = mid;
        }
        if (lo == r->index_n || r->index[lo].offset != offset)
            return dfl_fail(e, DFL_EUSAGE, "%s: offset %llu is not a batch frame listed in the index", r->name,
                            (unsigned long long)offset);
        want_index = lo;
        want_seq = r->index_seq[lo];
        ent = &r->index[lo];
    }
    if (offset % 64 || offset < r->header_len || offset >= r->size)
        return dfl_fail(e, DFL_EUSAGE, "%s: offset %llu is not a frame offset", r->name, (unsigned long long)offset);
    int saved_failed = r->failed;
    char saved_msg[sizeof r->failed_msg];
    memcpy(saved_msg, r->failed_msg, sizeof saved_msg);
    dfl_frame f;
    fhdr fh;
    int rc = frame_at(r, offset, want_seq, &f, &fh, e);
    if (!rc && fh.type != DFL_FT_TOKENS && fh.type != DFL_FT_HIDDEN)
        rc = dfl_fail(e, DFL_EDATA, "%s: frame %llu at offset %llu is %s, not a batch", r->name,
                      (unsigned long long)fh.seq, (unsigned long long)offset, type_name(fh.type));
    if (!rc)
        rc = parse_batch(r, f.payload, &fh, offset, fh.seq, want_index, true, b, e);
    if (!rc && ent && (b->n_seqs != ent->n_seqs || b->n_tokens != ent->n_tokens))
        rc = dfl_fail(e, DFL_EDATA, "%s: frame %llu at offset %llu: batch of %u seqs, %llu tokens; the index says %u, %u",
                      r->name, (unsigned long long)fh.seq, (unsigned long long)offset, b->n_seqs,
                      (unsigned long long)b->n_tokens, ent->n_seqs, ent->n_tokens);
    if (rc) {
        dfl_frame_free(&f);
        memset(b, 0, sizeof *b);
    } else {
        b->owned = f.owned;
    }
    r->failed = saved_failed;
    memcpy(r->failed_msg, saved_msg, sizeof saved_msg);
    return rc;
}
