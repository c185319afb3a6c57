/* target_prof.c: --profile's time by kind of work in the target forward (target.h,
 * dfl_target_prof_on). Each span (a GEMM, an attention, a chunked delta rule, a mixture-of-experts
 * block) is bracketed by two timing events on an asynchronous backend. The events sit in a ring
 * of RING spans: before a span's events are recorded again, the host waits for their previous
 * use (RING spans ago, several batches back, so normally long complete) and adds its elapsed time
 * to the totals; dfl_target_prof_read collects the rest. On a backend that runs ops at once (the
 * CPU) the host clock times each span. The timing is best effort: a failed event marks the sums
 * incomplete and turns it off; it never fails the forward. */
#include <stdlib.h>
#include <string.h>

#include "target_fwd.h"
#include "util.h"

#define RING 2048

const char *const dfl_target_prof_kind[DFL_TP_N] = {"GEMMs", "attention", "chunked delta rule",
                                                    "MoE experts"};

typedef struct dfl_target_prof {
    bool async, off;
    dfl_be_event ev[2 * RING];
    int kind[RING];
    double flops[RING];
    int shape[RING];           /* GEMMs: the index in sum.gemm, else -1 */
    bool pending[RING];        /* recorded, not yet added to the sums */
    double host_t0[RING];      /* CPU: the span's start */
    uint64_t next;
    dfl_target_prof_sum sum;
} dfl_target_prof;

static void prof_free(dfl_be *be, dfl_target_prof *p)
{
    for (int i = 0; i < 2 * RING; i++)
        if (p->ev[i])
            be->ops->event_free(be, p->ev[i]);
    free(p);
}

int dfl_target_prof_on(dfl_target *t, dfl_err *e)
{
    if (t->prof)
        return DFL_OK;
    dfl_target_prof *p = calloc(1, sizeof *p);
    if (!p)
        return dfl_fail(e, DFL_ENOMEM, "profile: out of memory");
    dfl_be *be = t->be;
    p->async = be->async;
    if (p->async)
        for (int i = 0; i < 2 * RING; i++) {
            int rc = be->ops->event_new(be, &p->ev[i], true, e);
            if (rc) {
                prof_free(be, p);
                return dfl_err_prefix(e, "profile: ");
            }
        }
    t->prof = p;
    return DFL_OK;
}

void dfl_target_prof_free(dfl_target *t)
{
    if (t->prof)
        prof_free(t->be, t->prof);
    t->prof = NULL;
}

static void add(dfl_target_prof *p, int kind, int shape, double seconds, double flops)
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

/* The index in sum.gemm of shape N x K (acc), added when new; the last entry takes the rest. */
static int shape_of(dfl_target_prof_sum *s, int64_t n, int64_t k, bool acc)
{
    for (int i = 0; i < s->n_gemm; i++)
        if (s->gemm[i].n == n && s->gemm[i].k == k && s->gemm[i].acc == acc)
            return i;
    if (s->n_gemm == DFL_TP_SHAPES) {
        s->gemm[DFL_TP_SHAPES - 1].n = s->gemm[DFL_TP_SHAPES - 1].k = 0;
        return DFL_TP_SHAPES - 1;
    }
    int i = s->n_gemm++;
    s->gemm[i].n = n;
    s->gemm[i].k = k;
    s->gemm[i].acc = acc;
    return i;
}

/* Adds span i (recorded) to the sums, waiting for its end event. */
static void harvest(dfl_be *be, dfl_target_prof *p, int i)
{
    dfl_err e = {0};
    float ms = 0;
    p->pending[i] = false;
    if (be->ops->event_sync(be, p->ev[2 * i + 1], &e) ||
        be->ops->event_elapsed(be, p->ev[2 * i], p->ev[2 * i + 1], &ms, &e)) {
        p->sum.incomplete = true;
        p->off = true;
        return;
    }
    add(p, p->kind[i], p->shape[i], ms / 1e3, p->flops[i]);
}

int dfl_tp_begin(const dfl_target_fwd *f, int kind)
{
    dfl_target_prof *p = f->t->prof;
    if (!p || p->off)
        return -1;
    dfl_be *be = f->t->be;
    int i = (int)(p->next++ % RING);
    if (p->pending[i])
        harvest(be, p, i);
    p->kind[i] = kind;
    p->flops[i] = 0;
    p->shape[i] = -1;
    if (!p->async) {
        p->host_t0[i] = dfl_now();
        return i;
    }
    dfl_err e = {0};
    if (p->off || be->ops->event_record(be, p->ev[2 * i], DFL_STREAM_COMPUTE, &e)) {
        p->sum.incomplete = true;
        p->off = true;
        return -1;
    }
    return i;
}

void dfl_tp_end(const dfl_target_fwd *f, int span, double flops)
{
    dfl_target_prof *p = f->t->prof;
    if (!p || span < 0 || p->off)
        return;
    dfl_be *be = f->t->be;
    p->flops[span] = flops;
    if (!p->async) {
        add(p, p->kind[span], p->shape[span], dfl_now() - p->host_t0[span], flops);
        return;
    }
    dfl_err e = {0};
    if (be->ops->event_record(be, p->ev[2 * span + 1], DFL_STREAM_COMPUTE, &e)) {
        p->sum.incomplete = true;
        p->off = true;
        return;
    }
    p->pending[span] = true;
}

void dfl_tp_end_gemm(const dfl_target_fwd *f, int span, int64_t N, int64_t K, bool acc)
{
    dfl_target_prof *p = f->t->prof;
    if (p && span >= 0 && !p->off)
        p->shape[span] = shape_of(&p->sum, N, K, acc);
    dfl_tp_end(f, span, 2.0 * (double)f->T * (double)N * (double)K);
}

void dfl_target_prof_read(dfl_target *t, dfl_target_prof_sum *out)
{
    dfl_target_prof *p = t->prof;
    if (!p) {
        memset(out, 0, sizeof *out);
        return;
    }
    for (int i = 0; i < RING; i++)
        if (p->pending[i])
            harvest(t->be, p, i);
    *out = p->sum;
}

double dfl_target_delta_flops(const dfl_hf_config *c, int64_t T)
{
    double C = DFL_GDN_CHUNK, dk = (double)c->lin_k_dim, dv = (double)c->lin_v_dim;
    return (double)T * (double)c->lin_v_heads * (2 * C * dk + 2 * C * dv + 6 * dk * dv);
}
