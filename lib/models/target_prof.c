/* target_prof.c: --profile's time by kind of work in the target forward (target.h,
 * dfl_target_prof_on): each span (a GEMM, an attention, a chunked delta rule, a mixture-of-experts
 * block) is timed by the backend's span profiler (span_prof.h). */
#include "target_fwd.h"

const char *const dfl_target_prof_kind[DFL_TP_N] = {"GEMMs", "attention", "chunked delta rule",
                                                    "MoE experts"};

int dfl_target_prof_on(dfl_target *t, dfl_err *e)
{
    return t->prof ? DFL_OK : dfl_span_prof_new(t->be, &t->prof, e);
}

void dfl_target_prof_free(dfl_target *t)
{
    dfl_span_prof_free(t->prof);
    t->prof = NULL;
}

int dfl_tp_begin(const dfl_target_fwd *f, int kind) { return dfl_span_begin(f->t->prof, kind); }

void dfl_tp_end(const dfl_target_fwd *f, int span, double flops) { dfl_span_end(f->t->prof, span, flops); }

void dfl_tp_end_gemm(const dfl_target_fwd *f, int span, int64_t N, int64_t K, bool acc)
{
    dfl_span_end_shape(f->t->prof, span, N, K, acc, 2.0 * (double)f->T * (double)N * (double)K);
}

void dfl_target_prof_read(dfl_target *t, dfl_target_prof_sum *out) { dfl_span_read(t->prof, out); }

double dfl_target_delta_flops(const dfl_hf_config *c, int64_t T)
{
    double C = DFL_GDN_CHUNK, dk = (double)c->lin_k_dim, dv = (double)c->lin_v_dim;
    return (double)T * (double)c->lin_v_heads * (2 * C * dk + 2 * C * dv + 6 * dk * dv);
}
