/* jsonl.h: reading tokenized training samples from JSON Lines.
 *
 * A sample is one line holding a JSON object with
 *   "input_ids": [int, ...]              required, non-empty, each an integer in [0, 2^31)
 *   "loss_mask": [0|1|true|false, ...]   optional, same length (absent or null: all 1)
 *   "labels":    [int, ...]              optional Hugging Face style, same length: -100 marks a
 *                                        position that is not trained on (loss_mask 0 there)
 * When both loss_mask and labels are present, loss_mask wins and labels is ignored like any
 * other key. Other keys may hold any JSON value and are ignored. Duplicate keys (anywhere on
 * the line) are an error, as everywhere in dfl (lib/base/json.h). Blank lines are skipped.
 *
 * Parsing has two paths that give the same answer: a fast scanner specialised for these lines,
 * which either parses a line completely (valid JSON, valid sample) or declines it, and the
 * jansson path (dfl_json_parse), which decides the declined lines and words every error.
 *
 * Inputs are read through libarchive, so plain files, compressed files (.gz, .zst, .xz, .bz2,
 * ...) and tar/zip archives all go through one path. An input yields "parts": the file itself,
 * or, for an archive, every regular member whose name ends in .jsonl/.json/.ndjson (optionally
 * followed by a compression suffix). A part is either mapped (a plain regular file: its bytes
 * stay addressable, so samples can be re-read by offset) or a stream (read front to back once).
 * An input with no data (an empty file, compressed or not, empty stdin) is one empty part.
 * Compressed data is checked to its end (jsonl.c: gzip CRC-32 and length, nothing after the
 * compressed data); a failed check is DFL_EDATA, data that ends early DFL_ETRUNC, both naming
 * the input. Member names are only ever used in messages. */
#ifndef DFL_JSONL_H
#define DFL_JSONL_H

#include <signal.h>
#include <stdbool.h>
#include <stddef.h>
#include <stdint.h>

#include "err.h"
#include "json.h"

/* Longest line accepted, in bytes: the limit of lib/base/json.h (64 MiB). */
#define DFL_JSONL_MAX_LINE DFL_JSON_MAX_BYTES

/* One parsed sample. The arrays are scratch owned by the struct and reused line after line. */
typedef struct dfl_sample {
    int32_t *ids;       /* [n] token ids */
    uint8_t *mask;      /* [n] loss mask, 0 or 1 */
    size_t n;
    bool count_ids;     /* set by the caller: the fast path checks and counts input_ids (n) but
                           does not keep them (ids is not to be read); much faster */
    /* internal: capacities and the mask sources seen on the line */
    size_t ids_cap, mask_cap, lab_cap;
    uint8_t *lab;       /* mask derived from labels */
    size_t n_mask, n_lab;
    bool has_ids, has_mask, has_lab;
} dfl_sample;

void dfl_sample_free(dfl_sample *s);

/* Parses one line (without its '\n'). Returns 0 with s->ids, s->mask, s->n filled; DFL_EDATA
 * with a message that has no location prefix (the caller adds "file:line: "); DFL_ENOMEM.
 * *blank is set (and 0 returned) for a line of only JSON whitespace. */
int dfl_sample_parse(dfl_sample *s, const char *line, size_t n, bool *blank, dfl_err *e);

/* The two paths, exposed for the tests. dfl_sample_parse_fast returns 1 when it parsed the line
 * (s filled exactly as dfl_sample_parse would), 0 when it declines (s is then garbage) and -1
 * when out of memory. dfl_sample_parse_json is the jansson path. */
int dfl_sample_parse_fast(dfl_sample *s, const char *line, size_t n);
int dfl_sample_parse_json(dfl_sample *s, const char *line, size_t n, dfl_err *e);
/* The fast path on the line that starts at `line` and ends at the first '\n' or at `end`, so that
 * a caller need not find the line end first: on success (1) *eol is that end. */
int dfl_sample_parse_fast_eol(dfl_sample *s, const char *line, const char *end, const char **eol);

/* ---- inputs ---- */

typedef struct dfl_input dfl_input;

typedef struct dfl_part {
    const char *name;       /* "data.jsonl", "(stdin)", "shards.tar:part-0.jsonl.gz" (sanitized) */
    bool mapped;            /* plain regular file: data/size valid until dfl_input_close */
    const uint8_t *data;
    size_t size;
} dfl_part;

/* Opens path ("-" = stdin). Nothing is read yet. stop (may be NULL): when a signal handler sets
 * it, a read waiting for data on stdin or a pipe fails with DFL_EINTR. */
int dfl_input_open(dfl_input **in, const char *path, volatile sig_atomic_t *stop, dfl_err *e);
/* The next part of the input; *eof at the end. The previous part of a stream input is finished
 * (its unread data is skipped). Mapped parts stay mapped until dfl_input_close. */
int dfl_input_next_part(dfl_input *in, dfl_part *p, bool *eof, dfl_err *e);
/* Reads decompressed bytes of the current stream part; *got = 0 at its end. The end checks of
 * compressed data come at the end of the part that holds it, or, for a compressed archive, from
 * the dfl_input_next_part that finds no more members. */
int dfl_input_read(dfl_input *in, void *buf, size_t cap, size_t *got, dfl_err *e);
/* Bytes of the input consumed so far (compressed bytes for a compressed input), for progress. */
uint64_t dfl_input_consumed(const dfl_input *in);
/* Size of the input file in bytes (0 when unknown: stdin, a pipe). */
uint64_t dfl_input_size(const dfl_input *in);
void dfl_input_close(dfl_input *in);

/* CRC-32 of gzip (ISO-HDLC, reflected 0xEDB88320) of n bytes, continuing crc (0 to start). */
uint32_t dfl_crc32(uint32_t crc, const void *buf, size_t n);

/* Does an archive member name look like JSON Lines data (.jsonl, .json, .ndjson, each optionally
 * followed by .gz, .zst, .zstd, .xz, .bz2, .lz4)? */
bool dfl_jsonl_member_name(const char *name);

#endif
