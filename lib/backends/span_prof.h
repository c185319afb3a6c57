/* span_prof.h: --profile's time by kind of work. A caller brackets spans of backend ops (a GEMM,
 * an attention, an optimizer step) with dfl_span_begin / dfl_span_end; on an asynchronous
 * backend each span is two timing events on the compute stream, read back later without
 * draining the stream, and on a backend that runs ops at once (the CPU) the host clock times
 * it. The timing is best effort: a failed event marks the sums incomplete and turns it off; it
 * never fails the caller's work. Every call takes a NULL profiler and does nothing. */
#ifndef DFL_SPAN_PROF_H
#define DFL_SPAN_PROF_H

#include <stdbool.h>
#include <stddef.h>
#include <stdint.h>

#include "backend.h"

#define DFL_SPAN_KINDS 8
#define DFL_SPAN_SHAPES 24

typedef struct dfl_span_sum {
    double seconds[DFL_SPAN_KINDS];   /* device (or CPU) time in each kind's spans */
    double flops[DFL_SPAN_KINDS];     /* the FLOPs their callers gave (0: no rate) */
    uint64_t calls[DFL_SPAN_KINDS];
    bool incomplete;                  /* an event failed: some spans are missing */
    /* GEMMs by shape (the caller's N x K and tag), in the order first seen; shapes past
     * DFL_SPAN_SHAPES are summed into the last entry (n = k = 0) */
    struct {
        int64_t n, k;
        int tag;
        double seconds, flops;
        uint64_t calls;
    } gemm[DFL_SPAN_SHAPES];
    int n_gemm;
} dfl_span_sum;

typedef struct dfl_span_prof dfl_span_prof;

int dfl_span_prof_new(dfl_be *be, dfl_span_prof **out, dfl_err *e);
void dfl_span_prof_free(dfl_span_prof *p);
/* Opens a span of kind (0 .. DFL_SPAN_KINDS - 1); returns its handle, -1 when off. */
int dfl_span_begin(dfl_span_prof *p, int kind);
/* Closes span (a handle from dfl_span_begin; -1 is ignored) with the FLOPs it did. */
void dfl_span_end(dfl_span_prof *p, int span, double flops);
/* The same, also counted under the shape n x k (tag: the caller's kind of product). */
void dfl_span_end_shape(dfl_span_prof *p, int span, int64_t n, int64_t k, int tag, double flops);
/* Waits for every span enqueued so far; the totals since dfl_span_prof_new. */
void dfl_span_read(dfl_span_prof *p, dfl_span_sum *out);

/* Appends "LABEL S s (P%, R TFLOP/s)" to line[*n..size), after "; " unless it is the first
 * item: the time (in ms instead when ms), its share of total, and the rate where there are
 * FLOPs. Never writes past the end (a full line is cut short). */
void dfl_span_item(char *line, size_t size, size_t *n, const char *label, double seconds,
                   double flops, double total, bool ms);
/* line = the GEMMs by shape, longest first, each a dfl_span_item labelled "PREFIX NxKSUFFIX"
 * (prefix[tag], suffix[tag]; a NULL table adds nothing) with its time and FLOPs over div. */
void dfl_span_shapes(const dfl_span_sum *s, const char *const *prefix, const char *const *suffix,
                     double div, double total, bool ms, char *line, size_t size);

#endif
