/* be_cpu_hybrid.c: the CPU backend's ops for hybrid targets (Qwen3.5 / Qwen3.6: Gated DeltaNet
 * and gated full attention), in f32: zero-centred RMSNorm, per-head q/k norm with partial RoPE,
 * the sigmoid output gate, the per-sequence causal conv1d + SiLU, L2 norm, the gated RMSNorm and
 * the gated delta rule, both as the token-by-token recurrence (the test oracle) and in the
 * chunked form the forward uses. The readable reference for kernels/hybrid.cu. */
#include <math.h>
#include <stdlib.h>
#include <string.h>

#include "be_cpu.h"

static inline float sigmoidf(float x) { return 1.0f / (1.0f + expf(-x)); }
static inline float siluf(float x) { return x / (1.0f + expf(-x)); }

static inline float sumsq(const float *x, int64_t n)
{
    double ss = 0; /* double accumulation: the reference should be the accurate side */
    for (int64_t i = 0; i < n; i++)
        ss += (double)x[i] * x[i];
    return (float)ss;
}

int dfl_cpu_rmsnorm_1p(dfl_be *be, void *yv, const void *xv, const void *wv, int64_t R, int64_t n,
                       float eps)
{
    float *y = yv;
    const float *x = xv, *w = wv;
#pragma omp parallel for schedule(static) if (PAR(R * n))
    for (int64_t r = 0; r < R; r++) {
        const float *xr = x + r * n;
        float *yr = y + r * n;
        float s = (float)(1.0 / sqrt((double)sumsq(xr, n) / (double)n + (double)eps));
        for (int64_t i = 0; i < n; i++)
            yr[i] = (xr[i] * s) * (1.0f + w[i]);
    }
    return 0;
}

int dfl_cpu_qknorm_rope_partial(dfl_be *be, void *xv, int64_t ld, const void *wv,
                                const int32_t *pos, int64_t R, int heads, int d, int rot, float eps,
                                float theta)
{
    float *x = xv;
    const float *w = wv;
    float inv[512];
    if (rot > 1024 || rot % 2 || rot > d || rot < 0)
        return DFL_EUNSUP;
    dfl_rope_inv_freq(inv, rot, theta, be->rope_dtype);
    int half = rot / 2;
#pragma omp parallel for schedule(static) if (PAR(R * heads * d))
    for (int64_t r = 0; r < R; r++) {
        float c[512], s[512];
        dfl_cpu_rope_cs(c, s, pos[r], inv, half);
        for (int h = 0; h < heads; h++) {
            float *v = x + r * ld + (int64_t)h * d;
            float sc = (float)(1.0 / sqrt((double)sumsq(v, d) / (double)d + (double)eps));
            for (int i = 0; i < d; i++)
                v[i] = (v[i] * sc) * (1.0f + w[i]);
            dfl_cpu_rope_rotate(v, c, s, half);
        }
    }
    return 0;
}

int dfl_cpu_sigmoid_mul(dfl_be *be, void *xv, int64_t ldx, const void *gv, int64_t ldg, int64_t R,
                        int64_t n)
{
    float *x = xv;
    const float *g = gv;
#pragma omp parallel for schedule(static) if (PAR(R * n))
    for (int64_t r = 0; r < R; r++)
        for (int64_t i = 0; i < n; i++)
            x[r * ldx + i] *= sigmoidf(g[r * ldg + i]);
    return 0;
}

int dfl_cpu_conv1d_silu(dfl_be *be, void *yv, int64_t ldy, const void *xv, int64_t ldx,
                        const void *wv, const int32_t *pos, int64_t T, int64_t C, int K)
{
    float *y = yv;
    const float *x = xv, *w = wv;
#pragma omp parallel for schedule(static) if (PAR(T * C * K))
    for (int64_t t = 0; t < T; t++) {
        int back = pos[t] < K - 1 ? pos[t] : K - 1; /* earlier rows of the same sequence */
        for (int64_t c = 0; c < C; c++) {
            float acc = 0;
            for (int j = 0; j <= back; j++)
                acc += w[c * K + (K - 1 - j)] * x[(t - j) * ldx + c];
            y[t * ldy + c] = siluf(acc);
        }
    }
    return 0;
}

int dfl_cpu_l2norm(dfl_be *be, void *xv, int64_t ld, int64_t R, int heads, int d, float scale,
                   float eps)
{
    float *x = xv;
#pragma omp parallel for schedule(static) if (PAR(R * heads * d))
    for (int64_t r = 0; r < R; r++)
        for (int h = 0; h < heads; h++) {
            float *v = x + r * ld + (int64_t)h * d;
            float s = 1.0f / sqrtf(sumsq(v, d) + eps);
            for (int i = 0; i < d; i++)
                v[i] = v[i] * s * scale;
        }
    return 0;
}

int dfl_cpu_gated_rmsnorm(dfl_be *be, void *xv, int64_t ldx, const void *zv, int64_t ldz,
                          const void *wv, int64_t R, int heads, int d, float eps)
{
    float *x = xv;
    const float *z = zv, *w = wv;
#pragma omp parallel for schedule(static) if (PAR(R * heads * d))
    for (int64_t r = 0; r < R; r++)
        for (int h = 0; h < heads; h++) {
            float *v = x + r * ldx + (int64_t)h * d;
            const float *zr = z + r * ldz + (int64_t)h * d;
            float s = (float)(1.0 / sqrt((double)sumsq(v, d) / (double)d + (double)eps));
            for (int i = 0; i < d; i++)
                v[i] = w[i] * (v[i] * s) * siluf(zr[i]);
        }
    return 0;
}

/* ---- the gated delta rule ---- */

/* Token by token, one (sequence, value head): the definition. */
static void gdn_recurrent(const dfl_gated_delta *a, int64_t t0, int64_t n, int j, float *S)
{
    const float *q = a->q, *k = a->k, *v = a->v, *A = a->a, *B = a->b;
    float *o = a->o;
    int dk = a->dk, dv = a->dv, kh = j / (a->Hv / a->Hk);
    memset(S, 0, (size_t)dk * dv * sizeof *S);
    for (int64_t t = t0; t < t0 + n; t++) {
        const float *kt = k + t * a->ldqk + (int64_t)kh * dk, *qt = q + t * a->ldqk + (int64_t)kh * dk;
        const float *vt = v + t * a->ldv + (int64_t)j * dv;
        float decay = expf(dfl_gdn_g(A[t * a->ldab + j], a->A_log[j], a->dt_bias[j]));
        float beta = sigmoidf(B[t * a->ldab + j]);
        float *ot = o + t * a->ldo + (int64_t)j * dv;
        for (int i = 0; i < dk * dv; i++)
            S[i] *= decay;
        for (int c = 0; c < dv; c++) {
            float kv = 0;
            for (int i = 0; i < dk; i++)
                kv += S[i * dv + c] * kt[i];
            float delta = beta * (vt[c] - kv);
            for (int i = 0; i < dk; i++)
                S[i * dv + c] += kt[i] * delta;
        }
        for (int c = 0; c < dv; c++) {
            float acc = 0;
            for (int i = 0; i < dk; i++)
                acc += S[i * dv + c] * qt[i];
            ot[c] = acc;
        }
    }
}

/* Scratch of one (sequence, value head) task of the chunked form, C = chunk:
 * S [dk, dv], A [C, C] (then T = (I + A)^-1), Aqk [C, C], cg [C] (cumulative log-decay),
 * beta [C], U [C, dv] (values, then the new values), KS [C, dv]. */
static size_t gdn_scratch(int C, int dk, int dv)
{
    return (size_t)dk * dv + 2 * (size_t)C * C + 2 * (size_t)C + 2 * (size_t)C * dv;
}

/* Chunked, one (sequence, value head). Within a chunk of L tokens (rows i, j < L), with c_i the
 * cumulative sum of g over the chunk up to i, K, Q, V its rows and S the state entering it:
 *   A[i][j] = beta_i (k_i . k_j) exp(c_i - c_j) for j < i, T = (I + A)^-1 (forward substitution)
 *   Vn = T diag(beta) (V - diag(exp c) K S)          the "new values" (u - w S of the WY form)
 *   O  = diag(exp c) Q S + tril(Q K^T * exp(c_i - c_j)) Vn
 *   S  = exp(c_L) S + K^T diag(exp(c_L - c)) Vn
 * which is the recurrence carried over L tokens at once (transformers' torch_chunk_gated_delta_rule
 * and flash-linear-attention's chunk_gated_delta_rule compute the same). */
static void gdn_chunked(const dfl_gated_delta *a, int64_t t0, int64_t n, int j, float *buf)
{
    const float *q = a->q, *k = a->k, *v = a->v, *Ain = a->a, *Bin = a->b;
    float *o = a->o;
    int C = a->chunk, dk = a->dk, dv = a->dv, kh = j / (a->Hv / a->Hk);
    float *S = buf, *A = S + (size_t)dk * dv, *Aqk = A + (size_t)C * C, *cg = Aqk + (size_t)C * C;
    float *beta = cg + C, *U = beta + C, *KS = U + (size_t)C * dv;
    memset(S, 0, (size_t)dk * dv * sizeof *S);
    float Alog = a->A_log[j], dtb = a->dt_bias[j];
    for (int64_t c0 = t0; c0 < t0 + n; c0 += C) {
        int L = (int)(t0 + n - c0 < C ? t0 + n - c0 : C);
#define KR(i) (k + (c0 + (i)) * a->ldqk + (int64_t)kh * dk)
#define QR(i) (q + (c0 + (i)) * a->ldqk + (int64_t)kh * dk)
        float acc = 0;
        for (int i = 0; i < L; i++) {
            acc += dfl_gdn_g(Ain[(c0 + i) * a->ldab + j], Alog, dtb);
            cg[i] = acc;
            beta[i] = sigmoidf(Bin[(c0 + i) * a->ldab + j]);
        }
        for (int i = 0; i < L; i++) {
            for (int m = 0; m < L; m++) {
                float kk = 0, qk = 0;
                if (m <= i) {
                    for (int x = 0; x < dk; x++) {
                        kk += KR(i)[x] * KR(m)[x];
                        qk += QR(i)[x] * KR(m)[x];
                    }
                }
                float dec = m <= i ? expf(cg[i] - cg[m]) : 0.0f;
                A[i * C + m] = m < i ? beta[i] * kk * dec : 0.0f;
                Aqk[i * C + m] = qk * dec;
            }
        }
        /* T = (I + A)^-1, unit lower triangular, row by row: T[i][m] = -A[i][m] -
         * sum_{m < x < i} A[i][x] T[x][m]; stored over A (the diagonal 1 implicit) */
        for (int i = 1; i < L; i++)
            for (int m = 0; m < i; m++) {
                float s = A[i * C + m];
                for (int x = m + 1; x < i; x++)
                    s += A[i * C + x] * A[x * C + m];
                A[i * C + m] = -s;
            }
        for (int i = 0; i < L; i++) {
            /* KS = K S, then U = beta (V - exp(c) K S) */
            const float *vr = v + (c0 + i) * a->ldv + (int64_t)j * dv;
            for (int c = 0; c < dv; c++)
                KS[i * dv + c] = 0;
            for (int x = 0; x < dk; x++) {
                float kx = KR(i)[x];
                for (int c = 0; c < dv; c++)
                    KS[i * dv + c] += kx * S[x * dv + c];
            }
            float e = expf(cg[i]);
            for (int c = 0; c < dv; c++)
                U[i * dv + c] = beta[i] * (vr[c] - e * KS[i * dv + c]);
        }
        for (int i = L - 1; i >= 0; i--) /* Vn = T U in place, bottom-up */
            for (int m = 0; m < i; m++) {
                float t = A[i * C + m];
                for (int c = 0; c < dv; c++)
                    U[i * dv + c] += t * U[m * dv + c];
            }
        for (int i = 0; i < L; i++) {
            float *orow = o + (c0 + i) * a->ldo + (int64_t)j * dv;
            float e = expf(cg[i]);
            for (int c = 0; c < dv; c++) {
                float s = 0;
                for (int x = 0; x < dk; x++)
                    s += QR(i)[x] * S[x * dv + c];
                float r = e * s;
                for (int m = 0; m <= i; m++)
                    r += Aqk[i * C + m] * U[m * dv + c];
                orow[c] = r;
            }
        }
        float eL = expf(cg[L - 1]);
        for (int x = 0; x < dk * dv; x++)
            S[x] *= eL;
        for (int i = 0; i < L; i++) {
            float e = expf(cg[L - 1] - cg[i]);
            for (int x = 0; x < dk; x++) {
                float kx = KR(i)[x] * e;
                for (int c = 0; c < dv; c++)
                    S[x * dv + c] += kx * U[i * dv + c];
            }
        }
#undef KR
#undef QR
    }
}

int dfl_cpu_gated_delta(dfl_be *be, const dfl_gated_delta *a)
{
    if (a->Hk < 1 || a->Hv % a->Hk || a->dk < 1 || a->dv < 1 || a->chunk < 0)
        return DFL_EUNSUP;
    if (a->T <= 0)
        return 0;
    int64_t tasks = (int64_t)a->n_seqs * a->Hv;
    size_t per = a->chunk ? gdn_scratch(a->chunk, a->dk, a->dv) : (size_t)a->dk * a->dv;
    int bad = 0;
#pragma omp parallel reduction(| : bad) if (PAR(a->T * a->Hv * a->dk * a->dv))
    {
        float *buf = malloc(per * sizeof *buf);
#pragma omp for schedule(dynamic, 1)
        for (int64_t i = 0; i < tasks; i++) {
            if (!buf) {
                bad = 1;
                continue;
            }
            int32_t s = (int32_t)(i / a->Hv);
            int j = (int)(i % a->Hv);
            int64_t t0 = a->cu_seqlens[s], n = a->cu_seqlens[s + 1] - t0;
            if (n <= 0)
                continue;
            if (a->chunk)
                gdn_chunked(a, t0, n, j, buf);
            else
                gdn_recurrent(a, t0, n, j, buf);
        }
        free(buf);
    }
    return bad ? DFL_ENOMEM : 0;
}
