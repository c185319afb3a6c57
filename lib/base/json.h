/* json.h: JSON through jansson, with bounds (size, nesting) and typed getters that produce
 * errors naming the file and the key. */
#ifndef DFL_JSON_H
#define DFL_JSON_H

#include <jansson.h>
#include <stdbool.h>
#include <stdint.h>

#include "err.h"

#define DFL_JSON_MAX_DEPTH 64
#define DFL_JSON_MAX_BYTES (64u << 20)

/* Parses buf[0..len) (need not be NUL-terminated). what names the input in errors. Rejects
 * nesting deeper than DFL_JSON_MAX_DEPTH, NUL bytes, and duplicate keys. */
int dfl_json_parse(const char *buf, size_t len, json_t **out, const char *what, dfl_err *e);
int dfl_json_load_file(const char *path, json_t **out, dfl_err *e);
/* Is the nesting of the text s[0..n) (arrays and objects; strings skipped) at most max deep?
 * Checked before jansson sees a text: its own limit is far too deep for anything we read. */
bool dfl_json_depth_ok(const char *s, size_t n, int max);

/* Typed getters. A missing key is an error only when required (then *out is untouched otherwise).
 * Return DFL_EDATA with "what: key 'k' must be ..." on a type mismatch. */
int dfl_json_int(const json_t *obj, const char *key, bool required, int64_t *out, const char *what, dfl_err *e);
int dfl_json_num(const json_t *obj, const char *key, bool required, double *out, const char *what, dfl_err *e);
int dfl_json_bool(const json_t *obj, const char *key, bool required, bool *out, const char *what, dfl_err *e);
/* *out points into obj (valid while obj lives). */
int dfl_json_str(const json_t *obj, const char *key, bool required, const char **out, const char *what, dfl_err *e);

/* Deterministic serialization (sorted keys); indent 0 = compact. malloc'ed, NULL on OOM. */
char *dfl_json_dump(const json_t *v, int indent);
/* Writes JSON atomically to path (sorted keys, indent 2, trailing newline). */
int dfl_json_write_file(const char *path, const json_t *v, dfl_err *e);

#endif
