/* tune_file.h: dfl-target's --tune-file: the GEMM algorithms a tune chose, kept in a file so
 * that later runs on the same GPU and library take them again without timing anything (and, the
 * algorithms being the same, write the same bits). A JSON object:
 *
 *   {"format": "dfl-tune 1",
 *    "scope": "NVIDIA H200 sm_90 cuBLASLt 120805",
 *    "products": {"<the plan's key>": "<128 hex digits: the algorithm's 64 bytes>", ...}}
 *
 * The scope is the backend's (dfl_mm_algo.scope); the products' keys and bytes too. A file for
 * another scope is read (and checked) but gives nothing; the first put replaces its contents. */
#ifndef DFL_TUNE_FILE_H
#define DFL_TUNE_FILE_H

#include <stdbool.h>

#include "backend.h"
#include "err.h"

typedef struct dfl_tune_file dfl_tune_file;

/* Opens path: an absent file is an empty one; a file that is not such an object fails with
 * DFL_EDATA, naming the file and what is wrong with it. */
int dfl_tune_file_open(dfl_tune_file **out, const char *path, dfl_err *e);
/* The stored algorithm for a->key under a->scope into a->bytes: true, else false. */
bool dfl_tune_file_get(const dfl_tune_file *f, dfl_mm_algo *a);
/* Stores a (under a->scope: a file of another scope is emptied first). */
int dfl_tune_file_put(dfl_tune_file *f, const dfl_mm_algo *a, dfl_err *e);
/* The number of products stored under scope (0 when the file's scope is another). */
int dfl_tune_file_count(const dfl_tune_file *f, const char *scope);
/* The file's scope as read ("" when it was absent), and its path. */
const char *dfl_tune_file_scope(const dfl_tune_file *f);
const char *dfl_tune_file_path(const dfl_tune_file *f);
/* Writes the file (atomically: dfl_json_write_file) when a put changed it; *written (may be
 * NULL) says whether it did. */
int dfl_tune_file_save(dfl_tune_file *f, bool *written, dfl_err *e);
void dfl_tune_file_close(dfl_tune_file *f);

#endif
