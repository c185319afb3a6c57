/* scan.c: non-finite scanning and statistics of tensors (see scan.h). */
#include "scan.h"

#include <errno.h>
#include <inttypes.h>
#include <math.h>
#include <omp.h>
#include <pthread.h>
#include <stdlib.h>
#include <string.h>
#include <unistd.h>

#include "util.h"

/* ---------------------------------------------------------------- the fast test
 * Each kernel is branch-free over its whole range so that the compiler vectorizes it; the
 * avx2 clone is picked at load time where the CPU has it. A float is non-finite exactly when its
 * exponent bits are all ones, i.e. when its magnitude bits are >= those of +Inf. */

#define CLONES __attribute__((target_clones("avx2", "default")))

/* The largest magnitude (sign bit cleared) of n unsigned words of type T. */
#define MAX_MAG(name, T, mask)                                 \
    CLONES static T name(const T *p, size_t n)                 \
    {                                                          \
        T acc = 0;                                             \
        _Pragma("omp simd reduction(max : acc)")               \
        for (size_t i = 0; i < n; i++) {                       \
            T v = p[i] & (mask);                               \
            acc = v > acc ? v : acc;                           \
        }                                                      \
        return acc;                                            \
    }
MAX_MAG(max_mag8, uint8_t, 0x7fu)
MAX_MAG(max_mag16, uint16_t, 0x7fffu)
MAX_MAG(max_mag32, uint32_t, 0x7fffffffu)

CLONES static uint64_t any_exp64(const uint64_t *p, size_t n)
{
    const uint64_t exp = 0x7ff0000000000000ull;
    uint64_t acc = 0;
#pragma omp simd reduction(| : acc)
    for (size_t i = 0; i < n; i++)
        acc |= (uint64_t)((p[i] & exp) == exp);
    return acc;
}

bool dfl_any_nonfinite(const void *p, dfl_dtype dt, uint64_t n)
{
    switch (dt) {
    case DFL_BF16: return max_mag16(p, n) >= 0x7f80u;
    case DFL_F16: return max_mag16(p, n) >= 0x7c00u;
    case DFL_F32: return max_mag32(p, n) >= 0x7f800000u;
    case DFL_F64: return any_exp64(p, n) != 0;
    case DFL_F8_E5M2: return max_mag8(p, n) >= 0x7cu;
    case DFL_F8_E4M3: return max_mag8(p, n) >= 0x7fu; /* e4m3fn: no Inf, NaN is S.1111.111 */
    default: return false;
    }
}

/* ---------------------------------------------------------------- the exact pass (on a hit) */

typedef struct chunk_nf {
    uint64_t nan, posinf, neginf;
    uint64_t first;          /* within the chunk, or DFL_SCAN_NONE */
} chunk_nf;

/* 0 finite, 1 NaN, 2 +Inf, 3 -Inf */
static inline int classify(const void *p, dfl_dtype dt, size_t i)
{
    switch (dt) {
    case DFL_BF16:
    case DFL_F16: {
        uint16_t x = ((const uint16_t *)p)[i], a = x & 0x7fffu, inf = dt == DFL_BF16 ? 0x7f80u : 0x7c00u;
        return a < inf ? 0 : a > inf ? 1 : (x & 0x8000u) ? 3 : 2;
    }
    case DFL_F32: {
        uint32_t x = ((const uint32_t *)p)[i], a = x & 0x7fffffffu;
        return a < 0x7f800000u ? 0 : a > 0x7f800000u ? 1 : (x >> 31) ? 3 : 2;
    }
    case DFL_F64: {
        uint64_t x = ((const uint64_t *)p)[i], a = x & 0x7fffffffffffffffull;
        return a < 0x7ff0000000000000ull ? 0 : a > 0x7ff0000000000000ull ? 1 : (x >> 63) ? 3 : 2;
    }
    case DFL_F8_E5M2: {
        uint8_t x = ((const uint8_t *)p)[i], a = x & 0x7fu;
        return a < 0x7cu ? 0 : a > 0x7cu ? 1 : (x & 0x80u) ? 3 : 2;
    }
    case DFL_F8_E4M3:
        return (((const uint8_t *)p)[i] & 0x7fu) == 0x7fu ? 1 : 0;
    default:
        return 0;
    }
}

static void exact_pass(const void *p, dfl_dtype dt, size_t n, chunk_nf *c)
{
    c->first = DFL_SCAN_NONE;
    for (size_t i = 0; i < n; i++) {
        int k = classify(p, dt, i);
        if (!k)
            continue;
        if (c->first == DFL_SCAN_NONE)
            c->first = i;
        c->nan += k == 1;
        c->posinf += k == 2;
        c->neginf += k == 3;
    }
}

static bool scannable(dfl_dtype dt) { return dfl_dtype_size(dt) > 0; }

/* ---------------------------------------------------------------- chunking */

typedef struct chunk {
    size_t job;
    uint64_t start, n;
} chunk;

/* Job j's chunks of DFL_SCAN_CHUNK elements (the last one shorter) into c from index k; returns
 * the index after them. */
static size_t chunks_count(uint64_t n) { return (size_t)((n + DFL_SCAN_CHUNK - 1) / DFL_SCAN_CHUNK); }

static size_t chunks_fill(chunk *c, size_t k, size_t j, uint64_t n)
{
    for (uint64_t s = 0; s < n; s += DFL_SCAN_CHUNK) {
        c[k].job = j;
        c[k].start = s;
        c[k].n = n - s < DFL_SCAN_CHUNK ? n - s : DFL_SCAN_CHUNK;
        k++;
    }
    return k;
}

/* A chunk's first hit (relative to the chunk) folded into its job's (absolute): chunks come in
 * order, so the job's first hit is the first chunk's that has one. */
static void first_hit(uint64_t *first, const chunk *c, uint64_t chunk_first)
{
    if (*first == DFL_SCAN_NONE && chunk_first != DFL_SCAN_NONE)
        *first = c->start + chunk_first;
}

static int make_chunks(const dfl_scan_job *jobs, size_t njobs, chunk **out, size_t *nout, dfl_err *e)
{
    uint64_t total = 0;
    for (size_t j = 0; j < njobs; j++) {
        if (!scannable(jobs[j].dtype))
            return dfl_fail(e, DFL_EUNSUP, "cannot scan elements of dtype %d", (int)jobs[j].dtype);
        total += chunks_count(jobs[j].n);
    }
    chunk *c = malloc((total ? total : 1) * sizeof *c);
    if (!c)
        return dfl_fail(e, DFL_ENOMEM, "out of memory (%" PRIu64 " scan chunks)", total);
    size_t k = 0;
    for (size_t j = 0; j < njobs; j++)
        k = chunks_fill(c, k, j, jobs[j].n);
    *out = c;
    *nout = k;
    return DFL_OK;
}

static int nthreads(int threads, size_t nchunks)
{
    int nt = threads > 0 ? threads : dfl_ncpu();
    if ((size_t)nt > nchunks)
        nt = nchunks ? (int)nchunks : 1;
    return nt;
}

/* The chunk's elements: in place, or read (copied, when unaligned) into buf (DFL_SCAN_CHUNK x 8
 * bytes). Returns 0 or an errno value (EIO for a short read). */
static int chunk_load(const dfl_scan_job *j, const chunk *c, void *buf, const void **out)
{
    size_t es = dfl_dtype_size(j->dtype);
    if (j->data) {
        const uint8_t *p = (const uint8_t *)j->data + c->start * es;
        if ((uintptr_t)p % es) { /* foreign files may hold unaligned tensors: copy them */
            memcpy(buf, p, (size_t)c->n * es);
            p = buf;
        }
        *out = p;
        return 0;
    }
    uint64_t off = j->offset + c->start * es;
    size_t want = (size_t)c->n * es, got = 0;
    while (got < want) {
        ssize_t r = pread(j->fd, (uint8_t *)buf + got, want - got, (off_t)(off + got));
        if (r < 0) {
            if (errno == EINTR)
                continue;
            return errno;
        }
        if (r == 0)
            return EIO; /* the file is shorter than its header said: it changed under us */
        got += (size_t)r;
    }
    *out = buf;
    return 0;
}

/* Runs fn on every chunk with nt threads, each with its own read buffer and scratch buffers.
 * On a read error, fills e for the first failing chunk. */
typedef void (*chunk_fn)(const void *p, dfl_dtype dt, size_t n, float *fbuf, double *dbuf, void *res);

static int run_chunks(const dfl_scan_job *jobs, const chunk *ch, size_t nch, int nt, bool scratch,
                      chunk_fn fn, void *res, size_t res_size, dfl_err *e)
{
    bool need_read = false;
    for (size_t k = 0; k < nch && !need_read; k++) {
        const dfl_scan_job *j = &jobs[ch[k].job];
        need_read = j->data == NULL || (uintptr_t)j->data % dfl_dtype_size(j->dtype) != 0;
    }
    int *errs = calloc(nch ? nch : 1, sizeof *errs);
    if (!errs)
        return dfl_fail(e, DFL_ENOMEM, "out of memory");
    int failed = 0;
#pragma omp parallel num_threads(nt) if (nt > 1)
    {
        void *rbuf = NULL;
        float *fbuf = scratch ? malloc(DFL_SCAN_CHUNK * sizeof *fbuf) : NULL;
        double *dbuf = scratch ? malloc(DFL_SCAN_CHUNK * sizeof *dbuf) : NULL;
        bool ok = !scratch || (fbuf && dbuf);
        if (need_read && posix_memalign(&rbuf, 4096, DFL_SCAN_CHUNK * 8) != 0) {
            rbuf = NULL;
            ok = false;
        }
        if (!ok) {
#pragma omp atomic write
            failed = 1;
        }
#pragma omp for schedule(dynamic, 1)
        for (size_t k = 0; k < nch; k++) {
            if (!ok)
                continue;
            const dfl_scan_job *j = &jobs[ch[k].job];
            const void *p = NULL;
            int err = chunk_load(j, &ch[k], rbuf, &p);
            if (err)
                errs[k] = err;
            else
                fn(p, j->dtype, ch[k].n, fbuf, dbuf, (uint8_t *)res + k * res_size);
        }
        free(rbuf);
        free(fbuf);
        free(dbuf);
    }
    int rc = DFL_OK;
    if (failed)
        rc = dfl_fail(e, DFL_ENOMEM, "out of memory");
    for (size_t k = 0; k < nch && !rc; k++)
        if (errs[k]) {
            const dfl_scan_job *j = &jobs[ch[k].job];
            uint64_t off = j->offset + ch[k].start * dfl_dtype_size(j->dtype);
            rc = dfl_fail_errno(e, DFL_EIO, errs[k], "%s: reading %" PRIu64 " bytes at offset %" PRIu64,
                                j->what ? j->what : "tensor", ch[k].n * dfl_dtype_size(j->dtype), off);
        }
    free(errs);
    return rc;
}

/* The jobs' chunks and fn's result for each (res_size bytes each, in chunk order). */
typedef struct scan_run {
    chunk *ch;
    size_t nch;
    void *res;
} scan_run;

static void scan_run_free(scan_run *r)
{
    free(r->res);
    free(r->ch);
}

/* Chunks the jobs and runs fn on every chunk into *r (the caller's to free on success; nothing
 * is left on failure). */
static int scan_jobs(const dfl_scan_job *jobs, size_t njobs, int threads, bool scratch, chunk_fn fn,
                     size_t res_size, scan_run *r, dfl_err *e)
{
    int rc = make_chunks(jobs, njobs, &r->ch, &r->nch, e);
    if (rc)
        return rc;
    r->res = calloc(r->nch ? r->nch : 1, res_size);
    if (!r->res) {
        free(r->ch);
        return dfl_fail(e, DFL_ENOMEM, "out of memory");
    }
    rc = run_chunks(jobs, r->ch, r->nch, nthreads(threads, r->nch), scratch, fn, r->res, res_size, e);
    if (rc)
        scan_run_free(r);
    return rc;
}

/* A job's non-finite counts: start (n elements, no hit), fold its chunks in in order, finish. */
static void nf_start(dfl_scan_result *r, uint64_t n)
{
    memset(r, 0, sizeof *r);
    r->n = n;
    r->first = DFL_SCAN_NONE;
}

static void nf_fold(dfl_scan_result *r, const chunk *c, const chunk_nf *b)
{
    r->nan += b->nan;
    r->posinf += b->posinf;
    r->neginf += b->neginf;
    first_hit(&r->first, c, b->first);
}

static void nf_finish(dfl_scan_result *r) { r->nonfinite = r->nan + r->posinf + r->neginf; }

/* ---------------------------------------------------------------- non-finite scan */

static void nf_chunk(const void *p, dfl_dtype dt, size_t n, float *fbuf, double *dbuf, void *res)
{
    chunk_nf *c = res;
    (void)fbuf;
    (void)dbuf;
    c->first = DFL_SCAN_NONE;
    if (dfl_any_nonfinite(p, dt, n))
        exact_pass(p, dt, n, c);
}

int dfl_scan_nonfinite_many(const dfl_scan_job *jobs, size_t njobs, int threads, dfl_scan_result *out,
                            dfl_err *e)
{
    scan_run sr;
    int rc = scan_jobs(jobs, njobs, threads, false, nf_chunk, sizeof(chunk_nf), &sr, e);
    if (rc)
        return rc;
    const chunk_nf *res = sr.res;
    for (size_t j = 0; j < njobs; j++)
        nf_start(&out[j], jobs[j].n);
    for (size_t k = 0; k < sr.nch; k++) /* in order: the first hit of a job is its first index */
        nf_fold(&out[sr.ch[k].job], &sr.ch[k], &res[k]);
    for (size_t j = 0; j < njobs; j++)
        nf_finish(&out[j]);
    scan_run_free(&sr);
    return DFL_OK;
}

int dfl_scan_nonfinite(const void *data, dfl_dtype dt, uint64_t n, int threads, dfl_scan_result *r,
                       dfl_err *e)
{
    dfl_scan_job j = {.data = data, .fd = -1, .dtype = dt, .n = n};
    return dfl_scan_nonfinite_many(&j, 1, threads, r, e);
}

/* ---------------------------------------------------------------- statistics */

typedef struct chunk_stats {
    chunk_nf nf;
    uint64_t n;              /* finite elements */
    double mean, m2, min, max;
} chunk_stats;

/* Finite values only: sum, min, max in one pass, then the squared deviations from the chunk's
 * mean in a second (the chunk is still in cache), all in double. */
#define STATS_FN(name, T)                                                                  \
    CLONES static void name(const T *x, size_t n, chunk_stats *c)                          \
    {                                                                                      \
        double sum = 0;                                                                    \
        T mn = INFINITY, mx = -INFINITY;                                                   \
        _Pragma("omp simd reduction(+ : sum) reduction(min : mn) reduction(max : mx)")     \
        for (size_t i = 0; i < n; i++) {                                                   \
            sum += (double)x[i];                                                           \
            mn = x[i] < mn ? x[i] : mn;                                                    \
            mx = x[i] > mx ? x[i] : mx;                                                    \
        }                                                                                  \
        double mean = sum / (double)n, m2 = 0;                                             \
        _Pragma("omp simd reduction(+ : m2)")                                              \
        for (size_t i = 0; i < n; i++) {                                                   \
            double d = (double)x[i] - mean;                                                \
            m2 += d * d;                                                                   \
        }                                                                                  \
        c->n = n;                                                                          \
        c->mean = mean;                                                                    \
        c->m2 = m2;                                                                        \
        c->min = mn;                                                                       \
        c->max = mx;                                                                       \
    }
STATS_FN(stats_f32, float)
STATS_FN(stats_f64, double)

CLONES static void bf16_to_f32(float *dst, const uint16_t *src, size_t n)
{
#pragma omp simd
    for (size_t i = 0; i < n; i++) {
        uint32_t u = (uint32_t)src[i] << 16;
        memcpy(&dst[i], &u, 4);
    }
}

static float f16_table[65536], f8_table[2][256];
static pthread_once_t tables_once = PTHREAD_ONCE_INIT;

static float f8_value(uint8_t x, bool e5m2)
{
    int sign = x >> 7, mbits = e5m2 ? 2 : 3, ebits = e5m2 ? 5 : 4, bias = e5m2 ? 15 : 7;
    int ex = (x >> mbits) & ((1 << ebits) - 1), man = x & ((1 << mbits) - 1);
    float v;
    if (ex == 0)
        v = ldexpf((float)man, 1 - bias - mbits);
    else
        v = ldexpf((float)(man + (1 << mbits)), ex - bias - mbits);
    if (e5m2 && ex == 31)
        v = man ? NAN : INFINITY;
    if (!e5m2 && ex == 15 && man == 7)
        v = NAN;
    return sign ? -v : v;
}

static void make_tables(void)
{
    for (uint32_t i = 0; i < 65536; i++)
        f16_table[i] = dfl_f16_to_f32((uint16_t)i);
    for (uint32_t i = 0; i < 256; i++) {
        f8_table[0][i] = f8_value((uint8_t)i, false);
        f8_table[1][i] = f8_value((uint8_t)i, true);
    }
}

static double int_value(const void *p, dfl_dtype dt, size_t i)
{
    /* through memcpy: integer tensors of foreign files may be unaligned */
    const uint8_t *b = (const uint8_t *)p + i * dfl_dtype_size(dt);
    switch (dt) {
    case DFL_I8: { int8_t v; memcpy(&v, b, 1); return v; }
    case DFL_I16: { int16_t v; memcpy(&v, b, 2); return v; }
    case DFL_I32: { int32_t v; memcpy(&v, b, 4); return v; }
    case DFL_I64: { int64_t v; memcpy(&v, b, 8); return (double)v; }
    case DFL_U8: case DFL_BOOL: return b[0];
    case DFL_U16: { uint16_t v; memcpy(&v, b, 2); return v; }
    case DFL_U32: { uint32_t v; memcpy(&v, b, 4); return v; }
    case DFL_U64: { uint64_t v; memcpy(&v, b, 8); return (double)v; }
    default: return 0;
    }
}

/* One chunk: into fbuf (floats) or dbuf (doubles) as needed, dropping non-finite values when
 * the fast test found some. */
static void stats_chunk(const void *p, dfl_dtype dt, size_t n, float *fbuf, double *dbuf, void *res)
{
    chunk_stats *c = res;
    memset(c, 0, sizeof *c);
    c->nf.first = DFL_SCAN_NONE;
    bool hit = dfl_any_nonfinite(p, dt, n);
    if (hit)
        exact_pass(p, dt, n, &c->nf);
    size_t m = 0;
    if (dt == DFL_F64 || (!dfl_dtype_is_float(dt))) {
        const double *x = p;
        if (dt != DFL_F64) {
            for (size_t i = 0; i < n; i++)
                dbuf[i] = int_value(p, dt, i);
            x = dbuf;
            m = n;
        } else if (hit) {
            for (size_t i = 0; i < n; i++)
                if (isfinite(x[i]))
                    dbuf[m++] = x[i];
            x = dbuf;
        } else {
            m = n;
        }
        if (m)
            stats_f64(x, m, c);
        return;
    }
    const float *x = fbuf;
    switch (dt) {
    case DFL_F32:
        x = p;
        break;
    case DFL_BF16:
        bf16_to_f32(fbuf, p, n);
        break;
    case DFL_F16:
        for (size_t i = 0; i < n; i++)
            fbuf[i] = f16_table[((const uint16_t *)p)[i]];
        break;
    default: /* f8 */
        for (size_t i = 0; i < n; i++)
            fbuf[i] = f8_table[dt == DFL_F8_E5M2][((const uint8_t *)p)[i]];
        break;
    }
    m = n;
    if (hit) {
        m = 0;
        for (size_t i = 0; i < n; i++)
            if (isfinite(x[i]))
                fbuf[m++] = x[i];
        x = fbuf;
    }
    if (m)
        stats_f32(x, m, c);
}

int dfl_scan_stats_many(const dfl_scan_job *jobs, size_t njobs, int threads, dfl_stats *out, dfl_err *e)
{
    pthread_once(&tables_once, make_tables);
    scan_run sr;
    int rc = scan_jobs(jobs, njobs, threads, true, stats_chunk, sizeof(chunk_stats), &sr, e);
    if (rc)
        return rc;
    const chunk_stats *res = sr.res;
    /* combine in chunk order (deterministic whatever the thread count) */
    chunk_stats *acc = calloc(njobs ? njobs : 1, sizeof *acc);
    if (!acc) {
        scan_run_free(&sr);
        return dfl_fail(e, DFL_ENOMEM, "out of memory");
    }
    for (size_t j = 0; j < njobs; j++) {
        memset(&out[j], 0, sizeof out[j]);
        nf_start(&out[j].nf, jobs[j].n);
    }
    for (size_t k = 0; k < sr.nch; k++) {
        chunk_stats *a = &acc[sr.ch[k].job];
        const chunk_stats *b = &res[k];
        nf_fold(&out[sr.ch[k].job].nf, &sr.ch[k], &b->nf);
        if (!b->n)
            continue;
        if (!a->n) {
            a->n = b->n;
            a->mean = b->mean;
            a->m2 = b->m2;
            a->min = b->min;
            a->max = b->max;
            continue;
        }
        double na = (double)a->n, nb = (double)b->n, nn = na + nb, d = b->mean - a->mean;
        a->mean += d * nb / nn;
        a->m2 += b->m2 + d * d * na * nb / nn;
        a->n += b->n;
        a->min = b->min < a->min ? b->min : a->min;
        a->max = b->max > a->max ? b->max : a->max;
    }
    for (size_t j = 0; j < njobs; j++) {
        dfl_stats *s = &out[j];
        const chunk_stats *a = &acc[j];
        nf_finish(&s->nf);
        s->finite = a->n;
        if (a->n) {
            s->min = a->min;
            s->max = a->max;
            s->mean = a->mean;
            s->std = sqrt(a->m2 / (double)a->n);
            s->absmax = fabs(a->min) > fabs(a->max) ? fabs(a->min) : fabs(a->max);
        } else {
            s->min = s->max = s->mean = s->std = s->absmax = NAN;
        }
    }
    free(acc);
    scan_run_free(&sr);
    return DFL_OK;
}

int dfl_scan_stats(const void *data, dfl_dtype dt, uint64_t n, int threads, dfl_stats *s, dfl_err *e)
{
    dfl_scan_job j = {.data = data, .fd = -1, .dtype = dt, .n = n};
    return dfl_scan_stats_many(&j, 1, threads, s, e);
}

/* ---------------------------------------------------------------- differences */

static double value_of(const void *p, dfl_dtype dt, size_t i)
{
    return dfl_dtype_is_float(dt) ? dfl_load_f64(p, dt, i) : int_value(p, dt, i);
}

int dfl_diff_many(const dfl_diff_job *jobs, size_t njobs, int threads, dfl_diff_result *out, dfl_err *e)
{
    pthread_once(&tables_once, make_tables);
    uint64_t total = 0;
    for (size_t j = 0; j < njobs; j++) {
        if (!scannable(jobs[j].ta) || !scannable(jobs[j].tb))
            return dfl_fail(e, DFL_EUNSUP, "cannot compare elements of an invalid dtype");
        total += chunks_count(jobs[j].n);
    }
    chunk *ch = malloc((total ? total : 1) * sizeof *ch);
    dfl_diff_result *res = calloc(total ? total : 1, sizeof *res);
    if (!ch || !res) {
        free(ch);
        free(res);
        return dfl_fail(e, DFL_ENOMEM, "out of memory");
    }
    size_t nch = 0;
    for (size_t j = 0; j < njobs; j++)
        nch = chunks_fill(ch, nch, j, jobs[j].n);
    int nt = nthreads(threads, nch);
#pragma omp parallel for schedule(dynamic, 1) num_threads(nt) if (nt > 1)
    for (size_t k = 0; k < nch; k++) {
        const dfl_diff_job *j = &jobs[ch[k].job];
        dfl_diff_result *r = &res[k];
        size_t ea = dfl_dtype_size(j->ta), eb = dfl_dtype_size(j->tb);
        const uint8_t *pa = (const uint8_t *)j->a + ch[k].start * ea;
        const uint8_t *pb = (const uint8_t *)j->b + ch[k].start * eb;
        r->first = DFL_SCAN_NONE;
        if (j->ta == j->tb && memcmp(pa, pb, ch[k].n * ea) == 0)
            continue;
        for (size_t i = 0; i < ch[k].n; i++) {
            if (j->ta == j->tb && memcmp(pa + i * ea, pb + i * eb, ea) == 0)
                continue;
            double a = value_of(pa, j->ta, i), b = value_of(pb, j->tb, i);
            if (a == b || (isnan(a) && isnan(b)))
                continue; /* -0 vs +0, or a NaN payload: the same value */
            double d = fabs(a - b), m = fmax(fabs(a), fabs(b)), rel = d / m;
            if (!isfinite(a) || !isfinite(b))
                d = rel = INFINITY;
            if (r->first == DFL_SCAN_NONE)
                r->first = i;
            r->ndiff++;
            r->max_abs = d > r->max_abs ? d : r->max_abs;
            r->max_rel = rel > r->max_rel ? rel : r->max_rel;
        }
    }
    for (size_t j = 0; j < njobs; j++) {
        memset(&out[j], 0, sizeof out[j]);
        out[j].n = jobs[j].n;
        out[j].first = DFL_SCAN_NONE;
    }
    for (size_t k = 0; k < nch; k++) {
        dfl_diff_result *o = &out[ch[k].job];
        o->ndiff += res[k].ndiff;
        first_hit(&o->first, &ch[k], res[k].first);
        o->max_abs = res[k].max_abs > o->max_abs ? res[k].max_abs : o->max_abs;
        o->max_rel = res[k].max_rel > o->max_rel ? res[k].max_rel : o->max_rel;
    }
    free(ch);
    free(res);
    return DFL_OK;
}
