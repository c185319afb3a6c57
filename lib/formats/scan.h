/* scan.h: NaN/Inf scanning and statistics of tensors in place (a mapping or a buffer), in
 * parallel, never converting a whole tensor.
 *
 * Work is cut into chunks of DFL_SCAN_CHUNK elements (across all the tensors of one call) that
 * threads take in turn. The non-finite scan runs a branch-free, vectorized "any exponent all
 * ones?" test over each chunk and only on a hit runs the exact pass that counts NaN, +Inf and
 * -Inf and finds the first index; it is memory-bandwidth-bound. Statistics are accumulated per
 * chunk in double and combined in chunk order (Chan et al.), so results do not depend on the
 * number of threads. */
#ifndef DFL_SCAN_H
#define DFL_SCAN_H

#include <stddef.h>
#include <stdint.h>

#include "dtype.h"
#include "err.h"

#define DFL_SCAN_CHUNK (1u << 18)      /* elements per unit of work */
#define DFL_SCAN_NONE UINT64_MAX       /* "no non-finite element" as a first index */

/* One tensor to scan: n contiguous elements of dtype, either in memory (data) or, when data is
 * NULL, in a file (fd at byte offset), read chunk by chunk into a small per-thread buffer with
 * pread. Reading the page cache that way is often faster than touching a fresh mapping page by
 * page (each first touch of a mapped page costs a fault or a TLB fill; a reused buffer stays hot),
 * and it never holds more than a chunk per thread. */
typedef struct dfl_scan_job {
    const void *data;
    int fd;
    uint64_t offset;
    dfl_dtype dtype;
    uint64_t n;
    const char *what;                  /* names the tensor in read errors (may be NULL) */
} dfl_scan_job;

typedef struct dfl_scan_result {
    uint64_t n;                        /* elements scanned */
    uint64_t nonfinite;                /* nan + posinf + neginf */
    uint64_t nan, posinf, neginf;
    uint64_t first;                    /* flat index of the first non-finite, or DFL_SCAN_NONE */
} dfl_scan_result;

typedef struct dfl_stats {
    dfl_scan_result nf;                /* the non-finite counts, as dfl_scan_nonfinite gives them */
    uint64_t finite;                   /* elements the statistics are over */
    double min, max, mean, std, absmax;/* over the finite elements; NaN when there are none.
                                        * std is the population standard deviation (ddof 0). */
} dfl_stats;

/* Integer and bool tensors have no non-finite values (their scan is a no-op, counted in n);
 * their statistics are computed like those of float tensors. */

/* threads: 0 = all online CPUs. Fails only on an invalid dtype, out of memory or a read error. */
int dfl_scan_nonfinite(const void *data, dfl_dtype dt, uint64_t n, int threads, dfl_scan_result *r,
                       dfl_err *e);
int dfl_scan_stats(const void *data, dfl_dtype dt, uint64_t n, int threads, dfl_stats *s, dfl_err *e);

/* Many tensors in one parallel pass (out has njobs entries). */
int dfl_scan_nonfinite_many(const dfl_scan_job *jobs, size_t njobs, int threads, dfl_scan_result *out,
                            dfl_err *e);
int dfl_scan_stats_many(const dfl_scan_job *jobs, size_t njobs, int threads, dfl_stats *out, dfl_err *e);

/* Element-wise comparison of two tensors of n elements (in memory; dtypes may differ, values are
 * then compared as doubles). Elements are equal when their bits are (same dtype) or their values
 * are (NaN equals NaN). */
typedef struct dfl_diff_job {
    const void *a, *b;
    dfl_dtype ta, tb;
    uint64_t n;
} dfl_diff_job;

typedef struct dfl_diff_result {
    uint64_t n;                        /* elements compared */
    uint64_t ndiff;                    /* elements that differ */
    uint64_t first;                    /* flat index of the first difference, or DFL_SCAN_NONE */
    double max_abs;                    /* max |a - b| over differing elements (Inf when one side
                                        * is NaN or Inf and the other is not the same) */
    double max_rel;                    /* max |a - b| / max(|a|, |b|) (0 when identical) */
} dfl_diff_result;

int dfl_diff_many(const dfl_diff_job *jobs, size_t njobs, int threads, dfl_diff_result *out, dfl_err *e);

/* The fast test alone, single-threaded: does p[0..n) hold any NaN or Inf? */
bool dfl_any_nonfinite(const void *p, dfl_dtype dt, uint64_t n);

#endif
