/* be_cpu_ops.c: the CPU backend's forward ops for the target model, in f32 (the readable
 * reference for the CUDA kernels). Rows are spread over OpenMP threads. */
#include <math.h>
#include <stdlib.h>
#include <string.h>

#include "be_cpu.h"

int dfl_cpu_embedding(dfl_be *be, void *out, const int32_t *ids, const void *E, int64_t T, int64_t H)
{
    float *y = out;          /* [T, H] */
    const float *tab = E;    /* [V, H] */
#pragma omp parallel for schedule(static) if (PAR(T * H))
    for (int64_t t = 0; t < T; t++)
        memcpy(y + t * H, tab + (int64_t)ids[t] * H, (size_t)H * sizeof(float));
    return 0;
}

static inline float row_rstd(const float *x, int64_t n, float eps)
{
    double ss = 0; /* double accumulation: the reference should be the accurate side */
    for (int64_t i = 0; i < n; i++)
        ss += (double)x[i] * x[i];
    return (float)(1.0 / sqrt(ss / (double)n + (double)eps));
}

int dfl_cpu_rmsnorm(dfl_be *be, void *yv, float *rstd, const void *xv, const void *wv, int64_t R,
                    int64_t n, float eps)
{
    float *y = yv;
    const float *x = xv, *w = wv;
#pragma omp parallel for schedule(static) if (PAR(R * n))
    for (int64_t r = 0; r < R; r++) {
        const float *xr = x + r * n;
        float *yr = y + r * n;
        float s = row_rstd(xr, n, eps);
        if (rstd)
            rstd[r] = s;
        for (int64_t i = 0; i < n; i++)
            yr[i] = w[i] * (xr[i] * s);
    }
    return 0;
}

int dfl_cpu_add_rmsnorm(dfl_be *be, void *hv, const void *dv, void *yv, float *rstd, const void *wv,
                        int64_t R, int64_t n, float eps)
{
    float *h = hv, *y = yv;
    const float *d = dv, *w = wv;
#pragma omp parallel for schedule(static) if (PAR(R * n))
    for (int64_t r = 0; r < R; r++) {
        float *hr = h + r * n;
        const float *dr = d + r * n;
        for (int64_t i = 0; i < n; i++)
            hr[i] += dr[i];
        float s = row_rstd(hr, n, eps);
        if (rstd)
            rstd[r] = s;
        float *yr = y + r * n;
        for (int64_t i = 0; i < n; i++)
            yr[i] = w[i] * (hr[i] * s);
    }
    return 0;
}

int dfl_cpu_qknorm_rope(dfl_be *be, void *xv, const void *srcv, int64_t ld, float *rstd,
                        const void *wv, const int32_t *pos, int64_t R, int heads, int d, float eps,
                        float theta)
{
    float *x = xv;
    const float *w = wv, *src = srcv;
    float inv[512];
    if (d > 1024 || d % 2)
        return DFL_EUNSUP;
    dfl_rope_inv_freq_scaled(inv, d, theta, be->rope_scaling, be->rope_dtype);
    int half = d / 2;
#pragma omp parallel for schedule(static) if (PAR(R * heads * d))
    for (int64_t r = 0; r < R; r++) {
        float c[512], s[512];
        dfl_cpu_rope_cs(c, s, pos[r], inv, half);
        if (src && src != x)
            memcpy(x + r * ld, src + r * ld, (size_t)heads * (size_t)d * sizeof *x);
        for (int h = 0; h < heads; h++) {
            float *v = x + r * ld + (int64_t)h * d;
            if (w) {
                float sc = row_rstd(v, d, eps);
                if (rstd)
                    rstd[r * heads + h] = sc;
                for (int i = 0; i < d; i++)
                    v[i] = w[i] * (v[i] * sc);
            }
            dfl_cpu_rope_rotate(v, c, s, half);
        }
    }
    return 0;
}

int dfl_cpu_swiglu(dfl_be *be, void *outv, const void *guv, int64_t R, int64_t I)
{
    float *out = outv;
    const float *gu = guv;
#pragma omp parallel for schedule(static) if (PAR(R * I))
    for (int64_t r = 0; r < R; r++) {
        const float *g = gu + r * 2 * I, *u = g + I;
        float *o = out + r * I;
        for (int64_t i = 0; i < I; i++)
            o[i] = g[i] / (1.0f + expf(-g[i])) * u[i];
    }
    return 0;
}

int dfl_cpu_add(dfl_be *be, void *yv, const void *xv, int64_t n)
{
    float *y = yv;
    const float *x = xv;
#pragma omp parallel for schedule(static) if (PAR(n))
    for (int64_t i = 0; i < n; i++)
        y[i] += x[i];
    return 0;
}

/* One (sequence, query row, head) at a time: scores over the causal prefix, softmax, weighted sum
 * of values; f32 with a running maximum, like the GPU kernel but materialized per row. */
int dfl_cpu_attn_varlen(dfl_be *be, const dfl_attn_varlen *a)
{
    const float *q = a->q, *k = a->k, *v = a->v;
    float *o = a->o;
    int group = a->n_heads / a->n_kv;
    int d = a->d;
    int64_t T = a->T;
    int64_t nh = a->n_heads;
    /* map row -> sequence start */
    int32_t *start = malloc((size_t)(T > 0 ? T : 1) * sizeof *start);
    if (!start)
        return DFL_ENOMEM;
    for (int32_t s = 0; s < a->n_seqs; s++)
        for (int32_t t = a->cu_seqlens[s]; t < a->cu_seqlens[s + 1]; t++)
            start[t] = a->cu_seqlens[s];
#pragma omp parallel if (PAR(T * nh * a->max_len))
    {
        float *p = malloc((size_t)(a->max_len > 0 ? a->max_len : 1) * sizeof *p);
        float *acc = malloc((size_t)d * sizeof *acc);
#pragma omp for schedule(dynamic, 16) collapse(2)
        for (int64_t t = 0; t < T; t++) {
            for (int64_t h = 0; h < nh; h++) {
                if (!p || !acc)
                    continue;
                const float *qr = q + t * a->ldq + h * d;
                int64_t kh = h / group;
                int64_t s0 = start[t], n = t - s0 + 1;
                float mx = -INFINITY;
                for (int64_t j = 0; j < n; j++) {
                    const float *kr = k + (s0 + j) * a->ldk + kh * d;
                    float dot = 0;
                    for (int i = 0; i < d; i++)
                        dot += qr[i] * kr[i];
                    p[j] = dot * a->scale;
                    if (p[j] > mx)
                        mx = p[j];
                }
                double sum = 0;
                for (int64_t j = 0; j < n; j++) {
                    p[j] = expf(p[j] - mx);
                    sum += p[j];
                }
                for (int i = 0; i < d; i++)
                    acc[i] = 0;
                for (int64_t j = 0; j < n; j++) {
                    const float *vr = v + (s0 + j) * a->ldv + kh * d;
                    float pj = p[j];
                    for (int i = 0; i < d; i++)
                        acc[i] += pj * vr[i];
                }
                float inv = (float)(1.0 / sum);
                float *orow = o + t * a->ldo + h * d;
                for (int i = 0; i < d; i++)
                    orow[i] = acc[i] * inv;
            }
        }
        free(p);
        free(acc);
    }
    free(start);
    return 0;
}
