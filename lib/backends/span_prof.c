/* span_prof.c: --profile's spans (span_prof.h). The events sit in a ring of RING spans: before a
 * span's events are recorded again, the host waits for their previous use (RING spans ago,
 * normally long complete) and adds its elapsed time to the totals; dfl_span_read collects the
 * rest. */
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "span_prof.h"
#include "util.h"

#define RING 4096

struct dfl_span_prof {
    dfl_be *be;
    bool async, off;
    dfl_be_event ev[2 * RING];
    int kind[RING];
    double flops[RING];
    int shape[RING];           /* the index in sum.gemm, or -1 */
    bool pending[RING];        /* recorded, not yet added to the sums */
    double host_t0[RING];      /* CPU: the span's start */
    uint64_t next;
    dfl_span_sum sum;
};

void dfl_span_prof_free(dfl_span_prof *p)
{
    if (!p)
        return;
    for (int i = 0; i < 2 * RING; i++)
        if (p->ev[i])
            p->be->ops->event_free(p->be, p->ev[i]);
    free(p);
}

int dfl_span_prof_new(dfl_be *be, dfl_span_prof **out, dfl_err *e)
{
    *out = NULL;
    dfl_span_prof *p = calloc(1, sizeof *p);
    if (!p)
        return dfl_fail(e, DFL_ENOMEM, "profile: out of memory");
    p->be = be;
    p->async = be->async;
    if (p->async)
        for (int i = 0; i < 2 * RING; i++) {
            int rc = be->ops->event_new(be, &p->ev[i], true, e);
            if (rc) {
                dfl_span_prof_free(p);
                return dfl_err_prefix(e, "profile: ");
            }
        }
    *out = p;
    return DFL_OK;
}

static void add(dfl_span_prof *p, int kind, int shape, double seconds, double flops)
{
    p->sum.seconds[kind] += seconds;
    p->sum.flops[kind] += flops;
    p->sum.calls[kind]++;
    if (shape >= 0) {
        p->sum.gemm[shape].seconds += seconds;
        p->sum.gemm[shape].flops += flops;
        p->sum.gemm[shape].calls++;
    }
}

/* The index in sum.gemm of shape n x k (tag), added when new; the last entry takes the rest. */
static int shape_of(dfl_span_sum *s, int64_t n, int64_t k, int tag)
{
    for (int i = 0; i < s->n_gemm; i++)
        if (s->gemm[i].n == n && s->gemm[i].k == k && s->gemm[i].tag == tag)
            return i;
    if (s->n_gemm == DFL_SPAN_SHAPES) {
        s->gemm[DFL_SPAN_SHAPES - 1].n = s->gemm[DFL_SPAN_SHAPES - 1].k = 0;
        return DFL_SPAN_SHAPES - 1;
    }
    int i = s->n_gemm++;
    s->gemm[i].n = n;
    s->gemm[i].k = k;
    s->gemm[i].tag = tag;
    return i;
}

static void fail(dfl_span_prof *p)
{
    p->sum.incomplete = true;
    p->off = true;
}

/* Adds span i (recorded) to the sums, waiting for its end event. */
static void harvest(dfl_span_prof *p, int i)
{
    dfl_err e = {0};
    float ms = 0;
    p->pending[i] = false;
    if (p->be->ops->event_sync(p->be, p->ev[2 * i + 1], &e) ||
        p->be->ops->event_elapsed(p->be, p->ev[2 * i], p->ev[2 * i + 1], &ms, &e)) {
        fail(p);
        return;
    }
    add(p, p->kind[i], p->shape[i], ms / 1e3, p->flops[i]);
}

int dfl_span_begin(dfl_span_prof *p, int kind)
{
    if (!p || p->off || kind < 0 || kind >= DFL_SPAN_KINDS)
        return -1;
    int i = (int)(p->next++ % RING);
    if (p->pending[i])
        harvest(p, i);
    p->kind[i] = kind;
    p->flops[i] = 0;
    p->shape[i] = -1;
    if (!p->async) {
        p->host_t0[i] = dfl_now();
        return i;
    }
    dfl_err e = {0};
    if (p->off || p->be->ops->event_record(p->be, p->ev[2 * i], DFL_STREAM_COMPUTE, &e)) {
        fail(p);
        return -1;
    }
    return i;
}

void dfl_span_end(dfl_span_prof *p, int span, double flops)
{
    if (!p || span < 0 || p->off)
        return;
    p->flops[span] = flops;
    if (!p->async) {
        add(p, p->kind[span], p->shape[span], dfl_now() - p->host_t0[span], flops);
        return;
    }
    dfl_err e = {0};
    if (p->be->ops->event_record(p->be, p->ev[2 * span + 1], DFL_STREAM_COMPUTE, &e)) {
        fail(p);
        return;
    }
    p->pending[span] = true;
}

void dfl_span_end_shape(dfl_span_prof *p, int span, int64_t n, int64_t k, int tag, double flops)
{
    if (p && span >= 0 && !p->off)
        p->shape[span] = shape_of(&p->sum, n, k, tag);
    dfl_span_end(p, span, flops);
}

void dfl_span_read(dfl_span_prof *p, dfl_span_sum *out)
{
    if (!p) {
        memset(out, 0, sizeof *out);
        return;
    }
    for (int i = 0; i < RING; i++)
        if (p->pending[i])
            harvest(p, i);
    *out = p->sum;
}

void dfl_span_item(char *line, size_t size, size_t *n, const char *label, double seconds,
                   double flops, double total, bool ms)
{
    if (*n >= size)
        return;
    char rate[48] = "";
    double r = seconds > 0 ? flops / seconds : 0;
    if (r > 0)
        snprintf(rate, sizeof rate, r >= 1e12 ? ", %.1f TFLOP/s" : ", %.2f GFLOP/s",
                 r / (r >= 1e12 ? 1e12 : 1e9));
    int k = snprintf(line + *n, size - *n, "%s%s %.3f %s (%.1f%%%s)", *n ? "; " : "", label,
                     ms ? 1e3 * seconds : seconds, ms ? "ms" : "s",
                     total > 0 ? 100 * seconds / total : 0.0, rate);
    if (k > 0)
        *n += (size_t)k;
}

void dfl_span_shapes(const dfl_span_sum *s, const char *const *prefix, const char *const *suffix,
                     double div, double total, bool ms, char *line, size_t size)
{
    int order[DFL_SPAN_SHAPES];
    for (int i = 0; i < s->n_gemm; i++) {   /* longest first */
        int j = i;
        for (; j > 0 && s->gemm[order[j - 1]].seconds < s->gemm[i].seconds; j--)
            order[j] = order[j - 1];
        order[j] = i;
    }
    size_t n = 0;
    if (size)
        line[0] = 0;
    for (int o = 0; o < s->n_gemm; o++) {
        const int i = order[o], t = s->gemm[i].tag;
        char label[64] = "other shapes";
        if (s->gemm[i].n)
            snprintf(label, sizeof label, "%s%lldx%lld%s", prefix ? prefix[t] : "",
                     (long long)s->gemm[i].n, (long long)s->gemm[i].k, suffix ? suffix[t] : "");
        dfl_span_item(line, size, &n, label, s->gemm[i].seconds / div, s->gemm[i].flops / div,
                      total, ms);
    }
}
