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

int dfl_cpu_moe_matmul(dfl_be *be, const dfl_moe_mm *m)
{
    for (int e = 0; e < m->E; e++) {
        int64_t M = m->counts[e], off = m->offsets[e];
        if (M <= 0)
            continue;
        if (off + M > m->cap)
            return DFL_EUNSUP;
        dfl_mm mm = {
            .M = M, .N = m->N, .K = m->K,
            .A = (const float *)m->A + off * m->K, .adt = be->act, .lda = m->K, .ta = false,
            .B = (const float *)m->W + (int64_t)e * m->N * m->K, .bdt = be->wdt, .ldb = m->K,
            .tb = true,
            .C = (float *)m->C + off * m->N, .cdt = be->act, .ldc = m->N,
            .alpha = 1.0f, .beta = 0.0f,
        };
        int rc = be->ops->matmul(be, &mm);
        if (rc)
            return rc;
    }
    return 0;
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
