/* be_cpu_moe.c: the CPU backend's mixture-of-experts ops (routing, gather, per-expert GEMMs,
 * weighted combine with the gated shared expert) in f32: the reference for the CUDA kernels (kernels/moe.cu). */
#include <math.h>
#include <stdlib.h>
#include <string.h>

#include "be_cpu.h"

int dfl_cpu_moe_route(dfl_be *be, const dfl_moe_route *r)
{
    int E = r->E, k = r->k;
    if (k < 1 || k > E || E < 1)
        return DFL_EUNSUP;
#pragma omp parallel for schedule(static) if (PAR(r->T * E))
    for (int64_t t = 0; t < r->T; t++) {
        const float *z = r->logits + t * E;
        float mx = -INFINITY;
        for (int e = 0; e < E; e++)
            mx = z[e] > mx ? z[e] : mx;
        double sum = 0;
        for (int e = 0; e < E; e++)
            sum += expf(z[e] - mx);
        int32_t *idx = r->idx + t * k;
        float *w = r->weight + t * k;
        float wsum = 0;
        for (int j = 0; j < k; j++) {
            /* the largest logit not taken yet (the softmax keeps the order); ties: lower id */
            int best = -1;
            for (int e = 0; e < E; e++) {
                bool taken = false;
                for (int i = 0; i < j; i++)
                    taken |= idx[i] == e;
                if (!taken && (best < 0 || z[e] > z[best]))
                    best = e;
            }
            idx[j] = best;
            w[j] = (float)(expf(z[best] - mx) / sum);
            wsum += w[j];
        }
        if (r->norm_topk)
            for (int j = 0; j < k; j++)
                w[j] /= wsum;
    }
    /* group by expert, tokens ascending */
    memset(r->counts, 0, (size_t)E * sizeof *r->counts);
    for (int64_t i = 0; i < r->T * k; i++)
        r->counts[r->idx[i]]++;
    r->offsets[0] = 0;
    for (int e = 0; e < E; e++)
        r->offsets[e + 1] = r->offsets[e] +
                            (r->counts[e] + DFL_MOE_PAD - 1) / DFL_MOE_PAD * DFL_MOE_PAD;
    if (r->offsets[E] > r->cap)
        return DFL_EUNSUP;
    for (int64_t g = 0; g < r->offsets[E]; g++)
        r->rows[g] = -1;
    int32_t *fill = malloc((size_t)E * sizeof *fill);
    if (!fill)
        return DFL_ENOMEM;
    memcpy(fill, r->offsets, (size_t)E * sizeof *fill);
    for (int64_t t = 0; t < r->T; t++)
        for (int j = 0; j < k; j++) {
            int32_t g = fill[r->idx[t * k + j]]++;
            r->rows[g] = (int32_t)t;
            r->slot[t * k + j] = g;
        }
    free(fill);
    return 0;
}

int dfl_cpu_moe_gather(dfl_be *be, void *dstv, const void *srcv, const int32_t *rows,
                       const int32_t *offsets, int E, int64_t cap, int64_t H)
{
    float *dst = dstv;
    const float *src = srcv;
    int64_t n = offsets[E] < cap ? offsets[E] : cap;
#pragma omp parallel for schedule(static) if (PAR(n * H))
    for (int64_t g = 0; g < n; g++) {
        if (rows[g] >= 0)
            memcpy(dst + g * H, src + (int64_t)rows[g] * H, (size_t)H * sizeof(float));
        else
            memset(dst + g * H, 0, (size_t)H * sizeof(float));
    }
    return 0;
}

/* Expert by expert: with rows, A's token rows gathered into a scratch block first; with
 * swiglu, the product into a scratch block, then swiglu into C (f32 throughout: the reference
 * of the fused CUDA kernel). */
int dfl_cpu_moe_matmul(dfl_be *be, const dfl_moe_mm *m)
{
    if (m->swiglu && m->N % 2)
        return DFL_EUNSUP;
    int64_t Nc = m->swiglu ? m->N / 2 : m->N, most = 0;
    for (int e = 0; e < m->E; e++) {
        if (m->counts[e] > 0 && (int64_t)m->offsets[e] + m->counts[e] > m->cap)
            return DFL_EUNSUP;
        most = m->counts[e] > most ? m->counts[e] : most;
    }
    if (most == 0)
        return 0;
    float *ga = NULL, *gp = NULL;
    if ((m->rows && !(ga = malloc((size_t)(most * m->K) * sizeof(float)))) ||
        (m->swiglu && !(gp = malloc((size_t)(most * m->N) * sizeof(float))))) {
        free(ga);
        return DFL_ENOMEM;
    }
    int rc = 0;
    for (int e = 0; e < m->E && !rc; e++) {
        int64_t M = m->counts[e], off = m->offsets[e];
        if (M <= 0)
            continue;
        const float *a = (const float *)m->A + off * m->K;
        if (m->rows) {
            for (int64_t i = 0; i < M; i++)
                memcpy(ga + i * m->K, (const float *)m->A + (int64_t)m->rows[off + i] * m->K,
                       (size_t)m->K * sizeof(float));
            a = ga;
        }
        float *c = (float *)m->C + off * Nc;
        dfl_mm mm = {
            .M = M, .N = m->N, .K = m->K,
            .A = a, .adt = be->act, .lda = m->K, .ta = false,
            .B = (const float *)m->W + (int64_t)e * m->N * m->K, .bdt = be->wdt, .ldb = m->K,
            .tb = true,
            .C = gp ? gp : c, .cdt = be->act, .ldc = m->N,
            .alpha = 1.0f, .beta = 0.0f,
        };
        rc = be->ops->matmul(be, &mm);
        if (!rc && gp)
            rc = be->ops->swiglu(be, c, gp, M, Nc);
    }
    free(ga);
    free(gp);
    return rc;
}

int dfl_cpu_moe_combine(dfl_be *be, void *outv, const void *yv, const int32_t *slot,
                        const float *weight, int64_t T, int k, int64_t H, bool accumulate,
                        const void *sharedv, const float *shared_gate)
{
    float *out = outv;
    const float *y = yv, *shared = sharedv;
#pragma omp parallel for schedule(static) if (PAR(T * H * k))
    for (int64_t t = 0; t < T; t++) {
        float *o = out + t * H;
        if (!accumulate)
            memset(o, 0, (size_t)H * sizeof(float));
        for (int j = 0; j < k; j++) {
            const float *yr = y + (int64_t)slot[t * k + j] * H;
            float w = weight[t * k + j];
            for (int64_t i = 0; i < H; i++)
                o[i] += w * yr[i];
        }
        if (shared) {
            const float *sr = shared + t * H;
            float g = 1.0f / (1.0f + expf(-shared_gate[t]));
            for (int64_t i = 0; i < H; i++)
                o[i] += g * sr[i];
        }
    }
    return 0;
}
