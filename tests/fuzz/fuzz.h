/* fuzz.h: small helpers shared by the libFuzzer harnesses (tests/fuzz/fuzz-*.c): in-memory
 * files, scratch directories, reading every byte a reader hands out (so that ASan checks the
 * bounds), and checks of the error contract (a code in range, a message that names something). */
#ifndef DFL_FUZZ_H
#define DFL_FUZZ_H

#include <errno.h>
#include <fcntl.h>
#include <ftw.h>
#include <stdarg.h>
#include <stddef.h>
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/mman.h>
#include <sys/stat.h>
#include <unistd.h>

#include "err.h"

/* A finding: print it and abort, so that libFuzzer records the input as a crash. */
__attribute__((noreturn, format(printf, 1, 2))) static void fz_die(const char *fmt, ...)
{
    va_list ap;
    va_start(ap, fmt);
    fprintf(stderr, "fuzz: ");
    vfprintf(stderr, fmt, ap);
    fputc('\n', stderr);
    va_end(ap);
    abort();
}

#define FZ_ASSERT(cond, ...)                                                                   \
    do {                                                                                       \
        if (!(cond)) {                                                                         \
            fprintf(stderr, "fuzz: %s:%d: %s\n", __FILE__, __LINE__, #cond);                   \
            fz_die(__VA_ARGS__);                                                               \
        }                                                                                      \
    } while (0)

static inline void fz_write_all(int fd, const void *p, size_t n)
{
    const uint8_t *b = p;
    while (n > 0) {
        ssize_t k = write(fd, b, n);
        if (k < 0 && errno == EINTR)
            continue;
        if (k <= 0)
            fz_die("write: %s", strerror(errno));
        b += k;
        n -= (size_t)k;
    }
}

/* An anonymous regular file holding prefix bytes of value 0 and then data[0..n), positioned
 * right after the prefix. */
static inline int fz_memfd(const uint8_t *data, size_t n, size_t prefix)
{
    int fd = memfd_create("fuzz-input", MFD_CLOEXEC);
    if (fd < 0)
        fz_die("memfd_create: %s", strerror(errno));
    static const uint8_t zeros[64];
    if (prefix > sizeof zeros)
        fz_die("prefix too long");
    fz_write_all(fd, zeros, prefix);
    fz_write_all(fd, data, n);
    if (lseek(fd, (off_t)prefix, SEEK_SET) != (off_t)prefix)
        fz_die("lseek: %s", strerror(errno));
    return fd;
}

/* Writes data to path (created or truncated). */
static inline void fz_write_file(const char *path, const uint8_t *data, size_t n)
{
    int fd = open(path, O_WRONLY | O_CREAT | O_TRUNC | O_CLOEXEC, 0644);
    if (fd < 0)
        fz_die("%s: %s", path, strerror(errno));
    fz_write_all(fd, data, n);
    close(fd);
}

static inline int fz_rm_entry(const char *path, const struct stat *st, int flag, struct FTW *ftw)
{
    (void)st, (void)flag, (void)ftw;
    remove(path);
    return 0;
}

static char fz_scratch[256];
static inline void fz_scratch_remove(void)
{
    if (fz_scratch[0])
        nftw(fz_scratch, fz_rm_entry, 16, FTW_DEPTH | FTW_PHYS);
}

/* A scratch directory for this process (in /dev/shm when there is one), removed at exit. */
static inline const char *fz_scratch_dir(void)
{
    if (fz_scratch[0])
        return fz_scratch;
    const char *base = access("/dev/shm", W_OK) == 0 ? "/dev/shm" : getenv("TMPDIR") ? getenv("TMPDIR") : "/tmp";
    snprintf(fz_scratch, sizeof fz_scratch, "%s/dfl-fuzz.XXXXXX", base);
    if (!mkdtemp(fz_scratch))
        fz_die("mkdtemp %s: %s", fz_scratch, strerror(errno));
    atexit(fz_scratch_remove);
    return fz_scratch;
}

/* Reads every byte of p[0..n) (ASan checks each access); the sum keeps the reads. */
static volatile uint64_t fz_sink;
static inline void fz_touch(const void *p, uint64_t n)
{
    const volatile uint8_t *b = p;
    uint64_t s = 0;
    for (uint64_t i = 0; i < n; i++)
        s += b[i];
    fz_sink += s;
}

/* FUZZ_DEBUG=1 in the environment: each harness says what the reader answered (for looking at
 * one input; far too slow for fuzzing). */
static inline void fz_debug(int rc, const dfl_err *e, const char *where)
{
    static int on = -1;
    if (on < 0)
        on = getenv("FUZZ_DEBUG") != NULL;
    if (on)
        fprintf(stderr, "fuzz: %s: %s%s%s\n", where, dfl_code_name(rc), rc ? ": " : "", rc ? e->msg : "");
}

/* The error contract of lib/: a failing call returns the code it stored, a known code, and a
 * NUL-terminated message that is not empty. */
static inline void fz_check_err(int rc, const dfl_err *e, const char *where)
{
    fz_debug(rc, e, where);
    if (rc == DFL_OK)
        return;
    FZ_ASSERT(rc > 0 && rc < DFL_ECODE_COUNT, "%s: error code %d out of range", where, rc);
    FZ_ASSERT(e->code == rc, "%s: returned %d but the error says %d", where, rc, e->code);
    FZ_ASSERT(memchr(e->msg, 0, sizeof e->msg) != NULL, "%s: message not terminated", where);
    FZ_ASSERT(e->msg[0] != 0, "%s: empty message for %s", where, dfl_code_name(rc));
}

#endif
