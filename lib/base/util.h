/* util.h: small helpers shared by lib/ and bin/: checked integer and size parsing, checked
 * arithmetic, whole-buffer I/O, read-only file mapping, and atomic file replacement
 * (temporary name, fsync, rename, fsync of the directory). */
#ifndef DFL_UTIL_H
#define DFL_UTIL_H

#include <stdbool.h>
#include <stddef.h>
#include <stdint.h>
#include <sys/types.h>

#include "err.h"

#define DFL_ARRAY_LEN(a) (sizeof(a) / sizeof((a)[0]))
#define DFL_ALIGN_UP(x, a) (((x) + ((a)-1)) & ~((uint64_t)(a)-1))

/* Checked arithmetic: return false on overflow. */
static inline bool dfl_mul_u64(uint64_t a, uint64_t b, uint64_t *out) { return !__builtin_mul_overflow(a, b, out); }
static inline bool dfl_add_u64(uint64_t a, uint64_t b, uint64_t *out) { return !__builtin_add_overflow(a, b, out); }

/* "123", "64K", "1.5G"? no: integers only, with optional K/M/G/T suffix (powers of 1024, an
 * optional trailing "B" or "iB" accepted). what names the option in the error message. */
int dfl_parse_size(const char *s, uint64_t *out, const char *what, dfl_err *e);
/* Decimal integers in [min, max]. */
int dfl_parse_i64(const char *s, int64_t min, int64_t max, int64_t *out, const char *what, dfl_err *e);
int dfl_parse_double(const char *s, double *out, const char *what, dfl_err *e);
/* "1,9,17" -> malloc'ed array; at most max_n entries, each in [min, max]. */
int dfl_parse_i64_list(const char *s, int64_t min, int64_t max, size_t max_n,
                       int64_t **out, size_t *n, const char *what, dfl_err *e);

/* Whole-buffer I/O, retrying on EINTR and short counts. what names the file in errors.
 * dfl_write_all returns DFL_EPIPE when the reader went away (EPIPE). */
int dfl_write_all(int fd, const void *buf, size_t n, const char *what, dfl_err *e);
/* Reads exactly n bytes; *got (if non-NULL) receives how many were read before EOF. Returns
 * DFL_ETRUNC if EOF came first (*got < n), 0 on success. */
int dfl_read_full(int fd, void *buf, size_t n, size_t *got, const char *what, dfl_err *e);
/* Reads a whole (small) file into a NUL-terminated malloc'ed buffer of at most max bytes. */
int dfl_read_file(const char *path, size_t max, char **buf, size_t *len, dfl_err *e);

/* A read-only mapping of a whole regular file. An empty file has data == NULL, size == 0. */
typedef struct dfl_map {
    const uint8_t *data;
    size_t size;
    int fd;
} dfl_map;
int dfl_map_open(dfl_map *m, const char *path, dfl_err *e);
void dfl_map_close(dfl_map *m);

/* Atomic replacement of a file: write to a temporary in the same directory, then commit
 * (fsync, rename over the final name, fsync the directory) or abort (unlink). */
typedef struct dfl_atomic {
    int fd;
    char *path;  /* final name */
    char *tmp;   /* temporary name (NULL when direct) */
    bool direct; /* dfl_output_open: written in place (a FIFO, a device), nothing to rename */
} dfl_atomic;
int dfl_atomic_open(dfl_atomic *a, const char *path, dfl_err *e);
/* A binary output file the user names (dfl-ckpt --to-safetensors OUT), committed and aborted like
 * dfl_atomic_open's, but never renamed over anything that is not a regular file: an existing
 * FIFO, device or socket is opened and written in place (commit closes it; a terminal is refused,
 * DFL_EUSAGE); a symbolic link is written through, never replaced: to a FIFO or a device in place,
 * to a regular file by replacing that file (a temporary beside it, renamed onto it), the link
 * left as it is; a link to nothing is refused (DFL_EUSAGE), and so is a directory. */
int dfl_output_open(dfl_atomic *a, const char *path, dfl_err *e);
int dfl_atomic_commit(dfl_atomic *a, dfl_err *e);
void dfl_atomic_abort(dfl_atomic *a);
/* Convenience: atomically replace path with buf[0..n). */
int dfl_write_file_atomic(const char *path, const void *buf, size_t n, dfl_err *e);
/* fsync a directory (after creating or renaming entries in it). */
int dfl_fsync_dir(const char *dir, dfl_err *e);
/* mkdir -p. */
int dfl_mkdir_p(const char *path, int mode, dfl_err *e);
/* Is fd a terminal? Programs refuse to write binary to one. */
bool dfl_is_tty(int fd);

/* Monotonic seconds. */
double dfl_now(void);
/* "12.3 MB", "4.0 GB": 3 significant digits, decimal units; buf of >= 16 bytes. */
const char *dfl_fmt_bytes(double bytes, char *buf, size_t n);
/* Join path a and b with '/', malloc'ed. */
char *dfl_path_join(const char *a, const char *b);
/* strdup that never returns NULL silently: NULL means out of memory. */
char *dfl_strdup(const char *s);
/* Number of online CPUs (>= 1). */
int dfl_ncpu(void);
/* Enlarges the pipe fd to want bytes where the system lets us (above /proc/sys/fs/pipe-max-size
 * only with CAP_SYS_RESOURCE), else to pipe-max-size; never shrinks it; failure is harmless.
 * Returns the pipe's capacity then (0 if unknown). Either end of the pipe may call it. */
uint32_t dfl_pipe_enlarge(int fd, uint32_t want);

#endif
