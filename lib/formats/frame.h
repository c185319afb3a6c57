/* frame.h: the .dfl frame format (specified in man/dfl-frame.5, which is the contract):
 * reader and writer, used identically on pipes and on mapped files.
 *
 * Summary of format version 1 (all integers little-endian):
 *   A stream is a sequence of frames: HEADER first, then TOKENS or HIDDEN batch frames (and
 *   skippable frames), optionally an INDEX frame, and END last. A stream without END is
 *   truncated.
 *   Frame = 64-byte frame header | payload (stored_len bytes) | zero padding | 8-byte trailer,
 *   total a multiple of 64 bytes, so payloads start 64-byte aligned in the stream.
 *   Frame header: magic 89 44 46 4C ("\x89DFL"), u8 major version (1), u8 flags, u16 type,
 *   u64 stored_len, u64 raw_len, u64 seq (frame number, HEADER = 0), 24 reserved zero bytes,
 *   u64 XXH3-64 of header bytes 0..55.
 *   Trailer: XXH3-64 of every byte of the frame before it (header, payload, padding).
 *   Flags: bit0 skippable, bit1 zstd payload, bit2 byte-shuffle width 2, bit3 width 4;
 *   bits 4..7 reserved (a reader rejects them set).
 *   Batch payload: 64-byte batch header, then sections each 64-aligned and zero-padded:
 *   seq_lens u32[S], input_ids i32[T], loss_mask u8[T], then K layer arrays [T, H] of dtype.
 *
 * Errors: a stream cut anywhere is DFL_ETRUNC; bytes that are present but wrong (magic, checks,
 * checksums, reserved fields, structure, values) are DFL_EDATA; a major version or a
 * must-understand frame type this reader does not know is DFL_EUNSUP. Every message names the
 * stream, the frame number and its offset. */
#ifndef DFL_FRAME_H
#define DFL_FRAME_H

#include <jansson.h>
#include <stdbool.h>
#include <stdint.h>

#include "dtype.h"
#include "err.h"

#define DFL_FRAME_MAGIC "\x89" "DFL"
#define DFL_FRAME_MAJOR 1
#define DFL_FRAME_MINOR 0
#define DFL_FRAME_HDR 64
#define DFL_FRAME_ALIGN 64
#define DFL_MAX_LAYERS 64

enum dfl_frame_type {
    DFL_FT_HEADER = 1,   /* JSON stream description; first frame */
    DFL_FT_TOKENS = 2,   /* token batch */
    DFL_FT_HIDDEN = 3,   /* hidden-state batch */
    DFL_FT_INDEX = 4,    /* offsets of batch frames (skippable) */
    DFL_FT_END = 5,      /* totals; last frame */
    DFL_FT_NOTE = 6,     /* JSON note, informational (skippable) */
};

enum dfl_frame_flags {
    DFL_FF_SKIPPABLE = 1u << 0,
    DFL_FF_ZSTD = 1u << 1,
    DFL_FF_SHUFFLE2 = 1u << 2,
    DFL_FF_SHUFFLE4 = 1u << 3,
    DFL_FF_RESERVED = 0xf0u,
};

enum dfl_stream_kind { DFL_KIND_TOKENS = 1, DFL_KIND_HIDDEN = 2 };

/* What the HEADER frame says. */
typedef struct dfl_stream_info {
    int kind;                    /* DFL_KIND_TOKENS or DFL_KIND_HIDDEN */
    int version_major, version_minor;
    char producer[128];          /* "dfl-target 0.1.0" */
    int64_t vocab_size;          /* 0 if unknown */
    /* hidden streams: */
    int64_t hidden_size;
    int n_layers;
    int32_t layers[DFL_MAX_LAYERS]; /* captured target layer ids, in array order */
    dfl_dtype dtype;             /* dtype of the layer arrays */
    char fingerprint[80];        /* target model fingerprint, "" if none */
    json_t *meta;                /* optional free-form object ("meta" key); owned by whoever made the info */
} dfl_stream_info;

/* One batch of packed sequences. Pointers are into a mapping or into `owned`. */
typedef struct dfl_batch {
    uint64_t index;              /* batch number within its stream */
    uint64_t offset;             /* stream offset of its frame (reader) */
    uint64_t n_tokens;           /* T = sum of seq_lens */
    uint32_t n_seqs;             /* S */
    uint32_t max_len;            /* longest sequence */
    uint32_t n_layers;           /* K (0 for token batches) */
    uint32_t hidden;             /* H (0 for token batches) */
    dfl_dtype dtype;             /* layer dtype (DFL_DT_INVALID for token batches) */
    const uint32_t *seq_lens;    /* [S] */
    const int32_t *input_ids;    /* [T] */
    const uint8_t *loss_mask;    /* [T], 0 or 1 */
    const void *layers[DFL_MAX_LAYERS]; /* K arrays, each [T, H] of dtype */
    void *owned;                 /* heap block behind the pointers (free()-able; the sections
                                    inside it are 64-aligned), or NULL when they point into a
                                    mapping or into the caller's memory */
} dfl_batch;

void dfl_batch_free(dfl_batch *b);    /* frees owned; safe on a zeroed batch */
/* Payload size of a batch frame (uncompressed), 0 on overflow or for a dtype without a size
 * when n_layers > 0. */
uint64_t dfl_batch_payload_size(uint64_t n_tokens, uint32_t n_seqs, uint32_t n_layers,
                                uint32_t hidden, dfl_dtype dtype);
/* Where the sections of a batch payload start (offsets from the payload start, all multiples of
 * 64; dfl-frame(5) "Sections"). Layer k starts at layer0 + k * layer_stride. False on overflow. */
typedef struct dfl_batch_layout {
    uint64_t seq_lens, input_ids, loss_mask, layer0, layer_stride, size;
} dfl_batch_layout;
bool dfl_batch_layout_of(uint64_t n_tokens, uint32_t n_seqs, uint32_t n_layers, uint32_t hidden,
                         dfl_dtype dtype, dfl_batch_layout *l);
/* Allocates an owned batch with all sections (contents zero) and fills the pointers, so that a
 * producer can fill it in place. Layer pointers are writable through (void *)b->layers[k]. */
int dfl_batch_alloc(dfl_batch *b, uint64_t n_tokens, uint32_t n_seqs, uint32_t n_layers,
                    uint32_t hidden, dfl_dtype dtype, dfl_err *e);

/* Totals from the END frame. */
typedef struct dfl_stream_end {
    uint64_t n_batches, n_tokens, n_seqs, index_offset, n_frames;
} dfl_stream_end;

typedef struct dfl_index_entry {
    uint64_t offset;             /* stream offset of the batch frame */
    uint32_t n_seqs, n_tokens;
} dfl_index_entry;

/* A raw frame, for listing and checking (dfl-ckpt). */
typedef struct dfl_frame {
    uint64_t offset;             /* stream offset of the frame header */
    uint64_t seq;
    uint32_t type, flags;
    uint64_t stored_len, raw_len;
    uint64_t total_len;          /* header + payload + padding + trailer */
    const uint8_t *payload;      /* raw (decompressed) payload, raw_len bytes, 64-aligned; NULL
                                    for a skippable frame of a type the reader does not know */
    void *owned;
} dfl_frame;
void dfl_frame_free(dfl_frame *f);

/* A reader or a writer is used by one thread at a time. A mapped file must not be truncated
 * while a reader holds it (the mapping would fault); dfl writers never modify a file in place. */
typedef struct dfl_reader dfl_reader;

typedef struct dfl_reader_opts {
    bool no_verify;              /* skip the trailer checksums (header checks are always verified) */
    bool allow_truncated;        /* a missing END is a clean end, reported by dfl_reader_truncated */
    uint64_t max_frame;          /* largest payload accepted; 0 = default (64 GiB) */
    uint32_t chunk;              /* a descriptor (pipe, FIFO, socket) is read and hashed in read(2)
                                    calls of at most this many bytes, each hashed as soon as it
                                    returns, so that the producer refills the pipe meanwhile;
                                    0 = default (1 MiB) */
    int hash_thread;             /* on a descriptor, frames of 4 MiB and more can be hashed by a
                                    thread of the reader while the next pieces are read, instead
                                    of between the reads (the same checks, the same errors):
                                    0 = auto (where 8 or more CPUs are online), 1 = always,
                                    -1 = never */
    int bounce;                  /* on a descriptor that is not a file (pipe, FIFO, socket),
                                    frames of 4 MiB and more can be read(2) in pieces of
                                    `chunk` bytes into a bounce buffer that stays in the
                                    cache, hashed there and moved into the frame with
                                    streaming stores (frame_bounce.h; the same checks, the same
                                    errors; the hash thread is then not used): 0 = auto (2 where
                                    8 or more CPUs are online, else -1), -1 = never, 1 = in the
                                    reading thread, 2 = by a thread of the reader (hash and
                                    copy) while the next piece is read */
    uint32_t bounce_slots;       /* bounce = 2: buffers in its ring (2 to 64; 0 = default 4) */
} dfl_reader_opts;

/* Opens path ("-" = stdin; a regular file is mapped, anything else is read) and reads and checks
 * the HEADER frame. A pipe or FIFO still at 64 KiB or less then (its producer did not size it:
 * cat, zstdcat) is enlarged to pipe-max-size, as the writer enlarges its output. opts may be
 * NULL. */
int dfl_reader_open(dfl_reader **r, const char *path, const dfl_reader_opts *opts, dfl_err *e);
/* Same on an open descriptor (not closed by the reader); name is used in messages. */
int dfl_reader_open_fd(dfl_reader **r, int fd, const char *name, const dfl_reader_opts *opts, dfl_err *e);
void dfl_reader_close(dfl_reader *r);
const dfl_stream_info *dfl_reader_info(const dfl_reader *r);
const char *dfl_reader_name(const dfl_reader *r);
/* Stream offset of the next frame (bytes consumed so far; after open, the HEADER frame's size). */
uint64_t dfl_reader_offset(const dfl_reader *r);
/* Next batch into b (overwritten: free the previous one first). At a verified END (and end of
 * input after it) sets *eos = true (b untouched) and returns 0. Skippable frames
 * of unknown type are skipped; INDEX and NOTE frames are checked and skipped. Totals in END are
 * checked against what was read. Errors name the stream, the frame number and its offset. */
int dfl_reader_next(dfl_reader *r, dfl_batch *b, bool *eos, dfl_err *e);
/* Gives a batch's memory back to the reader, which reuses it for the next frame that fits
 * (large batches then cost no fresh pages); b is cleared. Only for batches from this reader or
 * from dfl_batch_alloc; batches that own nothing are just cleared. */
void dfl_reader_recycle(dfl_reader *r, dfl_batch *b);
/* Lower level: the next frame after HEADER, of any type (END included), checked like
 * dfl_reader_next checks it (checksum, structure of known types, place in the stream), with the
 * payload decompressed. After END (or a cut allowed by allow_truncated), *eos = true. */
int dfl_reader_next_frame(dfl_reader *r, dfl_frame *f, bool *eos, dfl_err *e);
/* Parses a batch frame returned by dfl_reader_next_frame into b (b borrows f's memory; take
 * f->owned into b->owned to transfer ownership). */
int dfl_reader_parse_batch(dfl_reader *r, const dfl_frame *f, dfl_batch *b, dfl_err *e);
/* After *eos: the END totals; truncated is true when allow_truncated let a cut stream end. */
const dfl_stream_end *dfl_reader_end(const dfl_reader *r);
bool dfl_reader_truncated(const dfl_reader *r);
/* Mapped files only: the INDEX entries, found through the END frame at the end of the file
 * without reading the batch payloads. END and INDEX are checked (entries against END's totals),
 * and so is every frame before the INDEX, as a walk of the stream checks it, short of the batch
 * payloads (dfl-frame(5) "Random access"): frame headers and numbers, unknown must-understand
 * types (DFL_EUNSUP), a second HEADER, NOTE frames, the batch frames exactly those listed.
 * Returns DFL_EUNSUP when the input is not a mapped file or has no index (callers then walk the
 * stream, which fails on an unknown must-understand type too), DFL_ETRUNC when the file does not
 * end with an END frame (DFL_EUNSUP with allow_truncated). *entries points into the reader. Does
 * not disturb dfl_reader_next. */
int dfl_reader_index(dfl_reader *r, const dfl_index_entry **entries, uint64_t *n, dfl_err *e);
/* Mapped files only: reads and fully checks the batch frame at a stream offset. A file with an
 * index is read through it (loaded here if dfl_reader_index was not called, and its errors
 * returned): the offset must be listed in it, and the frame number, batch index and counts must
 * match, so that reading every batch by its offset checks what reading the stream checks. A file
 * without an index (no INDEX frame, or no END) has each frame checked on its own. b points into
 * the mapping, or owns a block if the frame is compressed. */
int dfl_reader_batch_at(dfl_reader *r, uint64_t offset, dfl_batch *b, dfl_err *e);

typedef struct dfl_writer dfl_writer;

typedef struct dfl_writer_opts {
    int zstd_level;              /* 0 = no compression (default); 1..ZSTD_maxCLevel(). Batch
                                    frames only, HIDDEN ones byte-shuffled; a frame that does not
                                    shrink is stored as it is */
    bool no_index;               /* a regular file (the stream at its start) gets an INDEX frame
                                    unless set; pipes never do */
    bool allow_tty;              /* refuse to write binary to a terminal unless set */
    bool vmsplice;               /* on a pipe, hand the layer arrays of HIDDEN batches to the
                                    pipe with vmsplice(2) instead of copying them: the caller
                                    then keeps each array unchanged until dfl_writer_read_upto
                                    says the consumer has read past it (and allocated: free()
                                    writes into the blocks it frees; munmap does not). Only for consumers that
                                    read(2) the pipe (one that splices it on, e.g. to a socket,
                                    could still see the pages change). Falls back to copying
                                    when the system refuses */
    uint32_t chunk;              /* payloads are hashed, then written, in pieces of this many
                                    bytes; 0 = default (256 KiB on a pipe, 4 MiB elsewhere) */
    uint32_t pipe_size;          /* a pipe is enlarged to this many bytes where the system allows
                                    it (above /proc/sys/fs/pipe-max-size only with
                                    CAP_SYS_RESOURCE), else to pipe-max-size; 0 = default (64 MiB) */
    int hash_thread;             /* on a pipe, the pieces of 256 KiB and more (the layer arrays)
                                    of frames of 4 MiB and more can be hashed by a thread of the
                                    writer while they are written, instead of before: the same
                                    bytes; 1 = so, 0 or -1 = not (the default: the reading end
                                    of a pipe is the slower, 0.26 s of CPU a GB against the
                                    writing end's 0.16 s with vmsplice, hspump | hsdrain) */
    bool end_releases_fd;        /* a descriptor the writer does not own (dfl_writer_open_fd,
                                    or "-") is let go of once dfl_writer_close has written the
                                    END frame: closed, or, for 0, 1 and 2, pointed at /dev/null
                                    (dup2), so that those stay open for anything else the
                                    process writes. A reader sees the end of the stream then,
                                    not when the process has finished the rest of its exit */
} dfl_writer_opts;

/* --output-mode MODE of the programs that write hidden-state streams: "auto" and "vmsplice" set
 * o->vmsplice (the writer splices only into a pipe or FIFO, and copies elsewhere), "write"
 * clears it; anything else is DFL_EUSAGE naming the value. */
int dfl_writer_output_mode(const char *mode, dfl_writer_opts *o, dfl_err *e);

/* Opens path ("-" = stdout) and writes the HEADER frame. A file is written under a temporary name
 * beside it and renamed into place by dfl_writer_close (so a cut run never leaves a file that
 * looks complete); an existing FIFO or device is written directly. A pipe is enlarged to the
 * system's maximum. A terminal is refused (DFL_EUSAGE) unless allow_tty. A bad info is
 * DFL_EUSAGE. The _fd form does not close fd. */
int dfl_writer_open(dfl_writer **w, const char *path, const dfl_stream_info *info,
                    const dfl_writer_opts *opts, dfl_err *e);
int dfl_writer_open_fd(dfl_writer **w, int fd, const char *name, const dfl_stream_info *info,
                       const dfl_writer_opts *opts, dfl_err *e);
/* Writes one batch frame (TOKENS or HIDDEN according to the stream kind) with writev straight
 * from b's arrays; b->index is assigned by the writer, b->max_len is computed (0 or the right
 * value accepted). A batch that does not fit the stream (layers, hidden, dtype: DFL_EMISMATCH),
 * has a bad shape (DFL_EUSAGE) or bad contents (seq_lens, ids, mask: DFL_EDATA) is refused
 * without writing anything, and the stream stays usable. A write error (DFL_EPIPE when the
 * reader went away, DFL_EIO) fails the writer for good: close then returns it and removes a
 * file's temporary. */
int dfl_writer_batch(dfl_writer *w, const dfl_batch *b, dfl_err *e);
/* Writes a skippable NOTE frame holding a JSON object. */
int dfl_writer_note(dfl_writer *w, const json_t *note, dfl_err *e);
/* Writes INDEX (files) and END, fsyncs and renames a file into place, frees w. */
int dfl_writer_close(dfl_writer *w, dfl_err *e);
/* Stops without END (the stream reads as truncated), removes a file's temporary, frees w. */
void dfl_writer_abort(dfl_writer *w);
/* Bytes written so far. */
uint64_t dfl_writer_bytes(const dfl_writer *w);
/* The capacity of the output pipe (after the enlargement of opts.pipe_size); 0 if not a pipe. */
uint32_t dfl_writer_pipe_bytes(const dfl_writer *w);
/* The stream offset up to which the consumer has certainly read the output: arrays given to
 * dfl_writer_batch that lie wholly before it may be changed. With vmsplice on a pipe it comes
 * from the pipe (FIONREAD; the argument is in frame_write.c), else it is UINT64_MAX. May
 * be called from any thread, also while another one writes. DFL_EIO if the pipe cannot say,
 * DFL_EPIPE if bytes are left in it and its reader has gone (they will never be read). */
int dfl_writer_read_upto(dfl_writer *w, uint64_t *upto, dfl_err *e);
/* The rule on its own: of `pushed` bytes a pipe has accepted from us, `unread` are still in it
 * (read after pushed); the consumer has read the first pushed - unread, or none when unread is
 * larger (another writer's bytes). */
uint64_t dfl_pipe_read_upto(uint64_t pushed, uint64_t unread);
/* How long to wait before asking again when the consumer has `left` more bytes to read: their
 * time at 4 GB/s (about the fastest a consumer reads, so not much later than they are read),
 * between 50 us and 20 ms (each FIONREAD walks the pipe's buffers under the lock that the
 * consumer's reads take: not too often). */
long dfl_pipe_poll_ns(uint64_t left);

/* Writing batch frames in place. On a file output (a regular file written from its start,
 * opened for reading and writing, without compression), a producer can reserve the next batch
 * frame in the file, fill its layer arrays through a mapping (for example by DMA from a GPU into
 * the registered mapping), and commit it later: the writer then writes the headers, sequence
 * lengths, token ids, loss mask and padding into the frame and its checksum over the whole
 * frame, exactly as dfl_writer_batch would have written it. Frames are committed in the order
 * they were reserved. dfl_writer_reserve may be called on one thread while another commits
 * earlier frames (the only use of a writer from two threads at once); while frames are
 * reserved, dfl_writer_batch and dfl_writer_note fail. The file has its final size only at
 * dfl_writer_close, and is renamed into place only then. */
typedef struct dfl_frame_res {
    uint64_t offset;             /* stream offset of the frame */
    uint64_t n_tokens;
    uint32_t n_seqs;
    void *layers[DFL_MAX_LAYERS]; /* where layer k goes: [n_tokens, hidden] of the stream dtype,
                                    64-aligned, inside the mapping */
    void *map;                   /* the mapping holding the frame (page-aligned), e.g. to
                                    register it with a GPU */
    size_t map_len;
    /* the writer's */
    uint8_t *frame;
    uint64_t frame_len, seq, index;
} dfl_frame_res;
/* Whether batches can be written in place on this writer. */
bool dfl_writer_can_reserve(const dfl_writer *w);
/* Reserves the next batch frame, for n_tokens tokens in n_seqs sequences: allocates its space in
 * the file (fallocate, so that a full disk is an error here and not a fault later) and maps it.
 * A failure here fails the writer for good. */
int dfl_writer_reserve(dfl_writer *w, uint64_t n_tokens, uint32_t n_seqs, dfl_frame_res *f,
                       dfl_err *e);
/* Completes the oldest reserved frame f with batch b (its n_tokens and n_seqs those of the
 * reservation; its layer pointers NULL or f->layers, already filled), checked as
 * dfl_writer_batch checks it; unmaps f. Any failure fails the writer for good. */
int dfl_writer_commit(dfl_writer *w, dfl_frame_res *f, const dfl_batch *b, dfl_err *e);
/* Gives up a reserved frame (unmaps it); the writer fails for good (its file would have a
 * hole), so this is for tearing down a failed run. */
void dfl_writer_unreserve(dfl_writer *w, dfl_frame_res *f);

/* Fingerprint helper: XXH3-128 of bytes, as 32 lowercase hex digits into out[33]. */
void dfl_fingerprint_hex(const void *data, size_t n, char out[33]);

#endif
