/* err.h: error codes and messages for libdfl.
 * lib/ never prints to stdout and never exits: a failing function fills a dfl_err and returns its
 * (non-zero) code; the program decides what to print and which exit status to use. */
#ifndef DFL_ERR_H
#define DFL_ERR_H

#include <stddef.h>

/* Error codes. dfl_exit_code() maps them onto the documented exit statuses:
 * 0 ok, 1 usage or runtime error, 2 invalid data. */
enum {
    DFL_OK = 0,
    DFL_EUSAGE,   /* bad option or argument (exit 1) */
    DFL_EIO,      /* system or I/O error: open, read, write, mmap (exit 1) */
    DFL_ENOMEM,   /* out of memory, host or device (exit 1) */
    DFL_EDEVICE,  /* no GPU, a failure of the GPU or its libraries (exit 1) */
    DFL_EPIPE,    /* the consumer went away (exit 1) */
    DFL_EINTR,    /* stopped by a signal (exit 1) */
    DFL_EDATA,    /* invalid data: bad magic, checksum, structure, value (exit 2) */
    DFL_ETRUNC,   /* truncated input (exit 2) */
    DFL_EUNSUP,   /* well-formed input using something we do not implement (exit 2) */
    DFL_ENAN,     /* non-finite value found (exit 2) */
    DFL_EMISMATCH,/* inputs that do not belong together (fingerprint, shapes) (exit 2) */
    DFL_ECODE_COUNT
};

typedef struct dfl_err {
    int code;        /* DFL_OK when nothing failed */
    char msg[1024];  /* human-readable, without program name or trailing newline */
} dfl_err;

/* Set *e (if e is non-NULL) to code with a printf-style message; returns code.
 * Usage: return dfl_fail(e, DFL_EDATA, "%s: bad magic at offset %llu", path, off); */
int dfl_fail(dfl_err *e, int code, const char *fmt, ...) __attribute__((format(printf, 3, 4)));
/* Like dfl_fail, appending ": strerror(errnum)". */
int dfl_fail_errno(dfl_err *e, int code, int errnum, const char *fmt, ...)
    __attribute__((format(printf, 4, 5)));
/* An input without a single byte is a truncated one, whatever it was meant to be (a .dfl stream,
 * on a file or a pipe: dfl-frame(5) READING, step 1; a tensor file): the one message for it,
 * "NAME: truncated: empty input (no bytes at all)". Returns DFL_ETRUNC. */
int dfl_fail_empty(dfl_err *e, const char *name);
/* Prefix an existing message: "ctx: old message". Returns e->code. */
int dfl_err_prefix(dfl_err *e, const char *fmt, ...) __attribute__((format(printf, 2, 3)));
void dfl_err_clear(dfl_err *e);
/* Exit status for a code (0, 1 or 2). */
int dfl_exit_code(int code);
const char *dfl_code_name(int code);

#endif
