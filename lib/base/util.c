/* util.c: see util.h. */
#include "util.h"

#include <ctype.h>
#include <errno.h>
#include <fcntl.h>
#include <libgen.h>
#include <limits.h>
#include <math.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/mman.h>
#include <sys/stat.h>
#include <time.h>
#include <unistd.h>

int dfl_parse_size(const char *s, uint64_t *out, const char *what, dfl_err *e)
{
    if (!s || !*s)
        return dfl_fail(e, DFL_EUSAGE, "%s: empty size", what);
    const char *p = s;
    uint64_t v = 0;
    if (!isdigit((unsigned char)*p))
        return dfl_fail(e, DFL_EUSAGE, "%s: '%s' is not a size (expected e.g. 512, 64K, 2G)", what, s);
    while (isdigit((unsigned char)*p)) {
        if (!dfl_mul_u64(v, 10, &v) || !dfl_add_u64(v, (uint64_t)(*p - '0'), &v))
            return dfl_fail(e, DFL_EUSAGE, "%s: '%s' is too large", what, s);
        p++;
    }
    unsigned shift = 0;
    switch (*p) {
    case 'k': case 'K': shift = 10; p++; break;
    case 'm': case 'M': shift = 20; p++; break;
    case 'g': case 'G': shift = 30; p++; break;
    case 't': case 'T': shift = 40; p++; break;
    default: break;
    }
    if (shift && *p == 'i')
        p++;
    if (*p == 'B')
        p++;
    if (*p)
        return dfl_fail(e, DFL_EUSAGE, "%s: '%s' is not a size (expected e.g. 512, 64K, 2G)", what, s);
    if (shift && v > (UINT64_MAX >> shift))
        return dfl_fail(e, DFL_EUSAGE, "%s: '%s' is too large", what, s);
    *out = v << shift;
    return DFL_OK;
}

int dfl_parse_i64(const char *s, int64_t min, int64_t max, int64_t *out, const char *what, dfl_err *e)
{
    if (!s || !*s)
        return dfl_fail(e, DFL_EUSAGE, "%s: empty number", what);
    char *end;
    errno = 0;
    long long v = strtoll(s, &end, 10);
    if (*end || end == s || isspace((unsigned char)*s))
        return dfl_fail(e, DFL_EUSAGE, "%s: '%s' is not an integer", what, s);
    if (errno == ERANGE || v < min || v > max)
        return dfl_fail(e, DFL_EUSAGE, "%s: %s is out of range [%lld, %lld]", what, s,
                        (long long)min, (long long)max);
    *out = v;
    return DFL_OK;
}

int dfl_parse_double(const char *s, double *out, const char *what, dfl_err *e)
{
    if (!s || !*s)
        return dfl_fail(e, DFL_EUSAGE, "%s: empty number", what);
    char *end;
    errno = 0;
    double v = strtod(s, &end);
    if (*end || end == s || isspace((unsigned char)*s) || errno == ERANGE || !isfinite(v))
        return dfl_fail(e, DFL_EUSAGE, "%s: '%s' is not a finite number", what, s);
    *out = v;
    return DFL_OK;
}

int dfl_parse_i64_list(const char *s, int64_t min, int64_t max, size_t max_n,
                       int64_t **out, size_t *n, const char *what, dfl_err *e)
{
    *out = NULL;
    *n = 0;
    if (!s || !*s)
        return dfl_fail(e, DFL_EUSAGE, "%s: empty list", what);
    size_t cap = 1;
    for (const char *p = s; *p; p++)
        cap += *p == ',';
    if (cap > max_n)
        return dfl_fail(e, DFL_EUSAGE, "%s: more than %zu values", what, max_n);
    int64_t *v = malloc(cap * sizeof *v);
    char *copy = dfl_strdup(s);
    if (!v || !copy) {
        free(v);
        free(copy);
        return dfl_fail(e, DFL_ENOMEM, "%s: out of memory", what);
    }
    size_t k = 0;
    int rc = DFL_OK;
    /* Walk by hand (strtok would merge empty fields) so that "1,,2" is an error. */
    char *p = copy;
    for (;;) {
        char *comma = strchr(p, ',');
        if (comma)
            *comma = 0;
        rc = dfl_parse_i64(p, min, max, &v[k], what, e);
        if (rc)
            break;
        k++;
        if (!comma)
            break;
        p = comma + 1;
    }
    free(copy);
    if (rc) {
        free(v);
        return rc;
    }
    *out = v;
    *n = k;
    return DFL_OK;
}

int dfl_write_all(int fd, const void *buf, size_t n, const char *what, dfl_err *e)
{
    const uint8_t *p = buf;
    while (n > 0) {
        size_t chunk = n > (1u << 30) ? (1u << 30) : n;
        ssize_t w = write(fd, p, chunk);
        if (w < 0) {
            if (errno == EINTR)
                continue;
            if (errno == EPIPE)
                return dfl_fail(e, DFL_EPIPE, "%s: the reader went away (broken pipe)", what);
            return dfl_fail_errno(e, DFL_EIO, errno, "%s: write failed", what);
        }
        p += w;
        n -= (size_t)w;
    }
    return DFL_OK;
}

int dfl_read_full(int fd, void *buf, size_t n, size_t *got, const char *what, dfl_err *e)
{
    uint8_t *p = buf;
    size_t done = 0;
    while (done < n) {
        size_t chunk = n - done > (1u << 30) ? (1u << 30) : n - done;
        ssize_t r = read(fd, p + done, chunk);
        if (r < 0) {
            if (errno == EINTR)
                continue;
            if (got)
                *got = done;
            return dfl_fail_errno(e, DFL_EIO, errno, "%s: read failed", what);
        }
        if (r == 0)
            break;
        done += (size_t)r;
    }
    if (got)
        *got = done;
    if (done < n)
        return dfl_fail(e, DFL_ETRUNC, "%s: unexpected end of input (%zu of %zu bytes)", what, done, n);
    return DFL_OK;
}

int dfl_read_file(const char *path, size_t max, char **buf, size_t *len, dfl_err *e)
{
    *buf = NULL;
    if (len)
        *len = 0;
    int fd = open(path, O_RDONLY | O_CLOEXEC);
    if (fd < 0)
        return dfl_fail_errno(e, DFL_EIO, errno, "%s: cannot open", path);
    struct stat st;
    if (fstat(fd, &st) != 0) {
        close(fd);
        return dfl_fail_errno(e, DFL_EIO, errno, "%s: cannot stat", path);
    }
    if (S_ISDIR(st.st_mode)) {
        close(fd);
        return dfl_fail(e, DFL_EIO, "%s: is a directory", path);
    }
    /* read up to max + 1 bytes: one more than allowed means the file is too large */
    size_t cap = max < 65536 ? max + 1 : 65536, n = 0;
    char *b = malloc(cap + 1);
    if (!b) {
        close(fd);
        return dfl_fail(e, DFL_ENOMEM, "%s: out of memory", path);
    }
    for (;;) {
        if (n == cap) {
            if (cap > max) {
                free(b);
                close(fd);
                return dfl_fail(e, DFL_EDATA, "%s: larger than the limit of %zu bytes", path, max);
            }
            cap = cap * 2 > max + 1 ? max + 1 : cap * 2;
            char *nb = realloc(b, cap + 1);
            if (!nb) {
                free(b);
                close(fd);
                return dfl_fail(e, DFL_ENOMEM, "%s: out of memory", path);
            }
            b = nb;
        }
        ssize_t r = read(fd, b + n, cap - n);
        if (r < 0) {
            if (errno == EINTR)
                continue;
            int err = errno;
            free(b);
            close(fd);
            return dfl_fail_errno(e, DFL_EIO, err, "%s: read failed", path);
        }
        if (r == 0)
            break;
        n += (size_t)r;
    }
    if (n > max) {
        free(b);
        close(fd);
        return dfl_fail(e, DFL_EDATA, "%s: larger than the limit of %zu bytes", path, max);
    }
    close(fd);
    b[n] = 0;
    *buf = b;
    if (len)
        *len = n;
    return DFL_OK;
}

int dfl_map_open(dfl_map *m, const char *path, dfl_err *e)
{
    m->data = NULL;
    m->size = 0;
    /* O_NONBLOCK: opening a FIFO must not wait for a writer (it is refused below) */
    m->fd = open(path, O_RDONLY | O_CLOEXEC | O_NONBLOCK);
    if (m->fd < 0)
        return dfl_fail_errno(e, DFL_EIO, errno, "%s: cannot open", path);
    struct stat st;
    if (fstat(m->fd, &st) != 0) {
        int err = errno;
        close(m->fd);
        m->fd = -1;
        return dfl_fail_errno(e, DFL_EIO, err, "%s: cannot stat", path);
    }
    if (!S_ISREG(st.st_mode)) {
        close(m->fd);
        m->fd = -1;
        return dfl_fail(e, DFL_EIO, "%s: not a regular file", path);
    }
    fcntl(m->fd, F_SETFL, fcntl(m->fd, F_GETFL) & ~O_NONBLOCK);
    m->size = (size_t)st.st_size;
    if (m->size > 0) {
        void *p = mmap(NULL, m->size, PROT_READ, MAP_SHARED, m->fd, 0);
        if (p == MAP_FAILED) {
            int err = errno;
            close(m->fd);
            m->fd = -1;
            return dfl_fail_errno(e, DFL_EIO, err, "%s: cannot map", path);
        }
        m->data = p;
    }
    return DFL_OK;
}

void dfl_map_close(dfl_map *m)
{
    if (m->data)
        munmap((void *)m->data, m->size);
    if (m->fd >= 0)
        close(m->fd);
    m->data = NULL;
    m->size = 0;
    m->fd = -1;
}

char *dfl_strdup(const char *s)
{
    size_t n = strlen(s) + 1;
    char *d = malloc(n);
    if (d)
        memcpy(d, s, n);
    return d;
}

char *dfl_path_join(const char *a, const char *b)
{
    size_t na = strlen(a), nb = strlen(b);
    char *p = malloc(na + nb + 2);
    if (!p)
        return NULL;
    memcpy(p, a, na);
    size_t k = na;
    if (k > 0 && p[k - 1] != '/')
        p[k++] = '/';
    memcpy(p + k, b, nb + 1);
    return p;
}

static char *dir_of(const char *path)
{
    char *c = dfl_strdup(path);
    if (!c)
        return NULL;
    char *d = dfl_strdup(dirname(c));
    free(c);
    return d;
}

int dfl_fsync_dir(const char *dir, dfl_err *e)
{
    int fd = open(dir, O_RDONLY | O_DIRECTORY | O_CLOEXEC);
    if (fd < 0)
        return dfl_fail_errno(e, DFL_EIO, errno, "%s: cannot open directory", dir);
    if (fsync(fd) != 0 && errno != EINVAL && errno != EROFS) {
        int err = errno;
        close(fd);
        return dfl_fail_errno(e, DFL_EIO, err, "%s: fsync failed", dir);
    }
    close(fd);
    return DFL_OK;
}

int dfl_atomic_open(dfl_atomic *a, const char *path, dfl_err *e)
{
    a->fd = -1;
    a->direct = false;
    a->path = dfl_strdup(path);
    char *dir = dir_of(path);
    char *c = dfl_strdup(path);
    if (!a->path || !dir || !c) {
        free(a->path);
        free(dir);
        free(c);
        a->path = NULL;
        return dfl_fail(e, DFL_ENOMEM, "%s: out of memory", path);
    }
    const char *base = basename(c);
    size_t n = strlen(dir) + strlen(base) + 32;
    a->tmp = malloc(n);
    if (!a->tmp) {
        free(a->path);
        free(dir);
        free(c);
        a->path = NULL;
        return dfl_fail(e, DFL_ENOMEM, "%s: out of memory", path);
    }
    snprintf(a->tmp, n, "%s/.%s.tmp.XXXXXX", dir, base);
    free(dir);
    free(c);
    a->fd = mkostemp(a->tmp, O_CLOEXEC);
    if (a->fd < 0) {
        int err = errno;
        free(a->path);
        free(a->tmp);
        a->path = a->tmp = NULL;
        return dfl_fail_errno(e, DFL_EIO, err, "%s: cannot create a temporary file beside it", path);
    }
    fchmod(a->fd, 0644);
    return DFL_OK;
}

int dfl_output_open(dfl_atomic *a, const char *path, dfl_err *e)
{
    a->fd = -1;
    a->path = a->tmp = NULL;
    a->direct = false;
    struct stat st;
    if (lstat(path, &st) != 0) {
        if (errno != ENOENT)
            return dfl_fail_errno(e, DFL_EIO, errno, "%s: cannot stat", path);
        return dfl_atomic_open(a, path, e);
    }
    if (S_ISLNK(st.st_mode)) {
        if (stat(path, &st) != 0)
            return dfl_fail_errno(e, DFL_EUSAGE, errno, "%s: a symbolic link to nothing: refusing to write "
                                  "through it (name the file to write)", path);
        if (S_ISREG(st.st_mode)) { /* replace the file it points to, not the link */
            char *target = realpath(path, NULL);
            if (!target)
                return dfl_fail_errno(e, DFL_EIO, errno, "%s: cannot resolve the symbolic link", path);
            int rc = dfl_atomic_open(a, target, e);
            free(target);
            return rc;
        }
    }
    if (S_ISDIR(st.st_mode))
        return dfl_fail(e, DFL_EUSAGE, "%s: is a directory", path);
    if (S_ISREG(st.st_mode))
        return dfl_atomic_open(a, path, e);
    /* a FIFO, a device, a socket (or a link to one): written in place, there is nothing to rename */
    a->fd = open(path, O_WRONLY | O_CLOEXEC);
    if (a->fd < 0)
        return dfl_fail_errno(e, DFL_EIO, errno, "%s: cannot open for writing", path);
    if (isatty(a->fd)) {
        close(a->fd);
        a->fd = -1;
        return dfl_fail(e, DFL_EUSAGE, "%s: refusing to write binary data to a terminal", path);
    }
    a->path = dfl_strdup(path);
    if (!a->path) {
        close(a->fd);
        a->fd = -1;
        return dfl_fail(e, DFL_ENOMEM, "%s: out of memory", path);
    }
    a->direct = true;
    return DFL_OK;
}

int dfl_atomic_commit(dfl_atomic *a, dfl_err *e)
{
    int rc = DFL_OK;
    if (a->direct) {
        if (close(a->fd) != 0)
            rc = dfl_fail_errno(e, DFL_EIO, errno, "%s: close failed", a->path);
        a->fd = -1;
        free(a->path);
        a->path = NULL;
        return rc;
    }
    if (fsync(a->fd) != 0)
        rc = dfl_fail_errno(e, DFL_EIO, errno, "%s: fsync failed", a->tmp);
    if (close(a->fd) != 0 && !rc)
        rc = dfl_fail_errno(e, DFL_EIO, errno, "%s: close failed", a->tmp);
    a->fd = -1;
    if (!rc && rename(a->tmp, a->path) != 0)
        rc = dfl_fail_errno(e, DFL_EIO, errno, "%s: cannot rename into place", a->path);
    if (rc) {
        unlink(a->tmp);
    } else {
        char *dir = dir_of(a->path);
        if (dir) {
            rc = dfl_fsync_dir(dir, e);
            free(dir);
        }
    }
    free(a->path);
    free(a->tmp);
    a->path = a->tmp = NULL;
    return rc;
}

void dfl_atomic_abort(dfl_atomic *a)
{
    if (a->fd >= 0)
        close(a->fd);
    if (a->tmp)
        unlink(a->tmp);
    free(a->path);
    free(a->tmp);
    a->path = a->tmp = NULL;
    a->fd = -1;
}

int dfl_write_file_atomic(const char *path, const void *buf, size_t n, dfl_err *e)
{
    dfl_atomic a;
    int rc = dfl_atomic_open(&a, path, e);
    if (rc)
        return rc;
    rc = dfl_write_all(a.fd, buf, n, path, e);
    if (rc) {
        dfl_atomic_abort(&a);
        return rc;
    }
    return dfl_atomic_commit(&a, e);
}

int dfl_mkdir_p(const char *path, int mode, dfl_err *e)
{
    char *p = dfl_strdup(path);
    if (!p)
        return dfl_fail(e, DFL_ENOMEM, "out of memory");
    size_t n = strlen(p);
    for (size_t i = 1; i <= n; i++) {
        if (p[i] == '/' || p[i] == 0) {
            char c = p[i];
            p[i] = 0;
            if (mkdir(p, (mode_t)mode) != 0 && errno != EEXIST) {
                int err = errno;
                int rc = dfl_fail_errno(e, DFL_EIO, err, "%s: cannot create directory", p);
                free(p);
                return rc;
            }
            p[i] = c;
        }
    }
    free(p);
    struct stat st;
    if (stat(path, &st) != 0 || !S_ISDIR(st.st_mode))
        return dfl_fail(e, DFL_EIO, "%s: not a directory", path);
    return DFL_OK;
}

bool dfl_is_tty(int fd) { return isatty(fd) == 1; }

double dfl_now(void)
{
    struct timespec ts;
    clock_gettime(CLOCK_MONOTONIC, &ts);
    return (double)ts.tv_sec + 1e-9 * (double)ts.tv_nsec;
}

const char *dfl_fmt_bytes(double b, char *buf, size_t n)
{
    static const char *u[] = {"B", "kB", "MB", "GB", "TB", "PB"};
    int k = 0;
    while (b >= 1000 && k < 5) {
        b /= 1000;
        k++;
    }
    if (k == 0)
        snprintf(buf, n, "%.0f B", b);
    else
        snprintf(buf, n, b < 10 ? "%.2f %s" : b < 100 ? "%.1f %s" : "%.0f %s", b, u[k]);
    return buf;
}

int dfl_ncpu(void)
{
    long n = sysconf(_SC_NPROCESSORS_ONLN);
    return n > 0 ? (int)n : 1;
}

/* A larger pipe means fewer wake-ups per batch, and a producer that can run ahead of its
 * consumer (util.h). */
uint32_t dfl_pipe_enlarge(int fd, uint32_t want)
{
    int cur = fcntl(fd, F_GETPIPE_SZ);
    if (cur < 0 || (uint64_t)cur >= want)
        return cur > 0 ? (uint32_t)cur : 0;
    int got = want <= INT_MAX ? fcntl(fd, F_SETPIPE_SZ, (int)want) : -1;
    if (got > 0)
        return (uint32_t)got;
    long max = 1 << 20;
    FILE *f = fopen("/proc/sys/fs/pipe-max-size", "r");
    if (f) {
        if (fscanf(f, "%ld", &max) != 1)
            max = 1 << 20;
        fclose(f);
    }
    if (max > (long)want)
        max = (long)want;
    if (cur < max && max <= INT_MAX && (got = fcntl(fd, F_SETPIPE_SZ, (int)max)) > 0)
        return (uint32_t)got;
    return (uint32_t)cur;
}
