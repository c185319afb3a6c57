/* be_cpu_train.c: the CPU backend's drafter ops and backward ops, in f32 with double where a
 * sum runs over many terms (the readable reference for the CUDA kernels). Every reduction runs
 * in a fixed order, so results do not depend on the number of OpenMP threads: row-wise outputs
 * are computed by one thread each, and column sums (weight gradients of the norms) are split
 * over columns, never over rows. No op allocates memory. */
#include <math.h>
#include <stdlib.h>
#include <string.h>

#include "be_cpu.h"
#include "be_math.h"

/* Run a loop on several threads only when it has enough work to pay for waking them (many
 * small ops in a row otherwise spend more time in barriers than in arithmetic, badly so on a
 * loaded machine). */

#define ATTN_TILE 64     /* keys per tile in the attention ops (stack scratch) */
#define MAX_HEAD_DIM 512

static inline float row_rstd(const float *x, int64_t n, float eps)
{
    double ss = 0;
    for (int64_t i = 0; i < n; i++)
        ss += (double)x[i] * x[i];
    return (float)(1.0 / sqrt(ss / (double)n + (double)eps));
}

/* ---- RMSNorm backward ---------------------------------------------------------------------- */

int dfl_cpu_rmsnorm_bwd(dfl_be *be, void *dxv, float *dw, const void *dyv, const void *xv,
                        const void *wv, const float *rstd, int64_t R, int64_t n, bool accumulate_dx)
{
    float *dx = dxv;         /* [R, n] */
    const float *dy = dyv;   /* [R, n] */
    const float *x = xv;     /* [R, n] */
    const float *w = wv;     /* [n] */
    /* weight gradient first (dx may alias dy): dw[i] += sum_r dy[r,i] * x[r,i] * rstd[r] */
    if (dw) {
        const int64_t cb = 16;
        int64_t nb = (n + cb - 1) / cb;
#pragma omp parallel for schedule(static) if (PAR(R * n))
        for (int64_t b = 0; b < nb; b++) {
            double acc[16] = {0};
            int64_t i0 = b * cb, i1 = i0 + cb < n ? i0 + cb : n;
            for (int64_t r = 0; r < R; r++) {
                const float *dyr = dy + r * n, *xr = x + r * n;
                double s = rstd[r];
                for (int64_t i = i0; i < i1; i++)
                    acc[i - i0] += (double)dyr[i] * xr[i] * s;
            }
            for (int64_t i = i0; i < i1; i++)
                dw[i] += (float)acc[i - i0];
        }
    }
    /* dx = rstd * (w*dy - xhat * mean(w*dy*xhat)), xhat = x*rstd */
#pragma omp parallel for schedule(static) if (PAR(R * n))
    for (int64_t r = 0; r < R; r++) {
        const float *dyr = dy + r * n, *xr = x + r * n;
        float *dxr = dx + r * n;
        float s = rstd[r];
        double dot = 0;
        for (int64_t i = 0; i < n; i++)
            dot += (double)w[i] * dyr[i] * xr[i];
        float c = (float)(dot * s / (double)n);   /* mean(w dy xhat) */
        for (int64_t i = 0; i < n; i++) {
            float g = s * (w[i] * dyr[i] - xr[i] * s * c);
            dxr[i] = accumulate_dx ? dxr[i] + g : g;
        }
    }
    return 0;
}

/* ---- per-head RMSNorm + RoPE backward ------------------------------------------------------ */

int dfl_cpu_qknorm_rope_bwd(dfl_be *be, void *dxv, int64_t ld, float *dw, const void *x_inv,
                            const void *wv, const float *rstd, const int32_t *pos, int64_t R,
                            int heads, int d, float eps, float theta)
{
    float *dx = dxv;             /* [R, ld]: gradient of the output in, of the input out */
    const float *xin = x_inv;    /* [R, ld] */
    const float *w = wv;         /* [d] or NULL */
    if (d > MAX_HEAD_DIM || d % 2)
        return DFL_EUNSUP;
    float inv[MAX_HEAD_DIM / 2];
    dfl_rope_inv_freq_scaled(inv, d, theta, be->rope_scaling, be->rope_dtype);   /* exactly the forward's */
    const int half = d / 2;
    /* The gradient of the norm's output (before RoPE) is the inverse rotation of dx:
     * g[i] = dx[i] c + dx[i+half] s, g[i+half] = -dx[i] s + dx[i+half] c. */
    if (w && dw) {
        /* dw[i] += sum over rows and heads of g[i] * xhat[i]; one thread per column */
#pragma omp parallel for schedule(static) if (PAR(R * heads * d))
        for (int i = 0; i < d; i++) {
            int i1 = i < half ? i : i - half;
            double acc = 0;
            for (int64_t r = 0; r < R; r++) {
                float ang = (float)pos[r] * inv[i1];
                float c = cosf(ang), s = sinf(ang);
                for (int h = 0; h < heads; h++) {
                    const float *dr = dx + r * ld + (int64_t)h * d;
                    const float *xr = xin + r * ld + (int64_t)h * d;
                    float sc = rstd ? rstd[r * heads + h] : row_rstd(xr, d, eps);
                    float g = i < half ? dr[i] * c + dr[i + half] * s : -dr[i1] * s + dr[i] * c;
                    acc += (double)g * (xr[i] * sc);
                }
            }
            dw[i] += (float)acc;
        }
    }
#pragma omp parallel for schedule(static) if (PAR(R * heads * d))
    for (int64_t r = 0; r < R; r++) {
        float c[MAX_HEAD_DIM / 2], s[MAX_HEAD_DIM / 2], g[MAX_HEAD_DIM];
        dfl_cpu_rope_cs(c, s, pos[r], inv, half);
        for (int h = 0; h < heads; h++) {
            float *dr = dx + r * ld + (int64_t)h * d;
            const float *xr = xin + r * ld + (int64_t)h * d;
            for (int i = 0; i < half; i++) {
                g[i] = dr[i] * c[i] + dr[i + half] * s[i];
                g[i + half] = -dr[i] * s[i] + dr[i + half] * c[i];
            }
            if (!w) {
                memcpy(dr, g, (size_t)d * sizeof *g);
                continue;
            }
            float sc = rstd ? rstd[r * heads + h] : row_rstd(xr, d, eps);
            double dot = 0;
            for (int i = 0; i < d; i++)
                dot += (double)w[i] * g[i] * xr[i];
            float m = (float)(dot * sc / (double)d);
            for (int i = 0; i < d; i++)
                dr[i] = sc * (w[i] * g[i] - xr[i] * sc * m);
        }
    }
    return 0;
}

/* ---- SwiGLU backward ----------------------------------------------------------------------- */

int dfl_cpu_swiglu_bwd(dfl_be *be, void *dguv, const void *doutv, const void *guv, int64_t R, int64_t I)
{
    float *dgu = dguv;          /* [R, 2I] */
    const float *dout = doutv;  /* [R, I] */
    const float *gu = guv;      /* [R, 2I] */
#pragma omp parallel for schedule(static) if (PAR(R * I))
    for (int64_t r = 0; r < R; r++) {
        const float *g = gu + r * 2 * I, *u = g + I, *dr = dout + r * I;
        float *dg = dgu + r * 2 * I, *du = dg + I;
        for (int64_t i = 0; i < I; i++) {
            float sg = 1.0f / (1.0f + expf(-g[i]));
            float silu = g[i] * sg;
            du[i] = dr[i] * silu;
            dg[i] = dr[i] * u[i] * (sg * (1.0f + g[i] * (1.0f - sg)));
        }
    }
    return 0;
}

/* ---- DFlash attention ---------------------------------------------------------------------- */

/* The keys of query slot j of a block with anchor an (backend.h): the context positions
 * [*clo, an), then the block slots [0, *bhi). */
static inline void dflash_keys(int32_t window, int32_t an, int j, int bs, int64_t *clo, int *bhi)
{
    if (window > 0) {
        int64_t lo = (int64_t)an + j - (window - 1);
        *clo = lo < 0 ? 0 : lo > an ? an : lo;
        *bhi = j + 1;
    } else {
        *clo = 0;
        *bhi = bs;
    }
}

/* Key t of a query whose context keys are the nctx rows from row c0 (then its block's rows from
 * brow): context row or block row. */
static inline const float *attn_key(const float *ctx, const float *blk, int64_t ld, int64_t c0,
                                    int64_t nctx, int64_t brow, int64_t t, int64_t off)
{
    return t < nctx ? ctx + (c0 + t) * ld + off : blk + (brow + t - nctx) * ld + off;
}

static inline float dotf(const float *a, const float *b, int d)
{
    float s = 0;
    for (int i = 0; i < d; i++)
        s += a[i] * b[i];
    return s;
}

/* One task per (block, query head): online softmax over the block's keys, a tile at a time. */
int dfl_cpu_dflash_attn(dfl_be *be, const dfl_dflash_attn *a)
{
    const float *q = a->q, *kc = a->k_ctx, *vc = a->v_ctx, *kb = a->k_blk, *vb = a->v_blk;
    float *o = a->o;
    const int d = a->d, bs = a->bs, nh = a->n_heads, group = a->n_heads / a->n_kv;
    const int64_t ldq = (int64_t)nh * d, ldk = (int64_t)a->n_kv * d;
    if (d > MAX_HEAD_DIM)
        return DFL_EUNSUP;
#pragma omp parallel for schedule(dynamic, 1) collapse(2) if (PAR(a->n_blocks * (int64_t)nh * bs * (a->max_anchor + bs) * d))
    for (int64_t b = 0; b < a->n_blocks; b++) {
        for (int h = 0; h < nh; h++) {
            const int32_t cs = a->ctx_start[b], an = a->anchor[b];
            const int64_t koff = (int64_t)(h / group) * d, brow = b * bs;
            for (int j = 0; j < bs; j++) {
                const int64_t qr = brow + j;
                int64_t clo;
                int bhi;
                dflash_keys(a->window, an, j, bs, &clo, &bhi);
                const int64_t c0 = cs + clo, nctx = an - clo, nkeys = nctx + bhi;
                const float *qv = q + qr * ldq + (int64_t)h * d;
                float acc[MAX_HEAD_DIM], s[ATTN_TILE];
                float mx = -INFINITY;
                double l = 0;
                for (int i = 0; i < d; i++)
                    acc[i] = 0;
                for (int64_t t0 = 0; t0 < nkeys; t0 += ATTN_TILE) {
                    int64_t nt = nkeys - t0 < ATTN_TILE ? nkeys - t0 : ATTN_TILE;
                    float tmx = -INFINITY;
                    for (int64_t t = 0; t < nt; t++) {
                        const float *kv = attn_key(kc, kb, ldk, c0, nctx, brow, t0 + t, koff);
                        s[t] = dotf(qv, kv, d) * a->scale;
                        if (s[t] > tmx)
                            tmx = s[t];
                    }
                    float nmx = tmx > mx ? tmx : mx;
                    float corr = expf(mx - nmx);   /* 0 on the first tile */
                    l *= corr;
                    for (int i = 0; i < d; i++)
                        acc[i] *= corr;
                    for (int64_t t = 0; t < nt; t++) {
                        float p = expf(s[t] - nmx);
                        const float *vv = attn_key(vc, vb, ldk, c0, nctx, brow, t0 + t, koff);
                        l += p;
                        for (int i = 0; i < d; i++)
                            acc[i] += p * vv[i];
                    }
                    mx = nmx;
                }
                float *ov = o + qr * ldq + (int64_t)h * d;
                float inv = (float)(1.0 / l);
                for (int i = 0; i < d; i++)
                    ov[i] = acc[i] * inv;
                a->lse[qr * nh + h] = mx + (float)log(l);
            }
        }
    }
    return 0;
}

/* First block index with ctx_start > c, among [0, n). */
static int64_t blocks_upper(const int32_t *ctx_start, int64_t n, int64_t c)
{
    int64_t lo = 0, hi = n;
    while (lo < hi) {
        int64_t mid = lo + (hi - lo) / 2;
        if (ctx_start[mid] <= c)
            lo = mid + 1;
        else
            hi = mid;
    }
    return lo;
}

/* Backward in two passes, each writing every output row from one task (no atomics, no
 * accumulation across threads):
 *  1. per (block, kv head): delta, dq of the group's query heads, dk_blk and dv_blk of the block;
 *  2. per (context row, kv head): dk_ctx, dv_ctx, summed over the blocks that see the row.
 * Probabilities are recomputed from the saved log-sum-exp: p = exp(s - lse). */
int dfl_cpu_dflash_attn_bwd(dfl_be *be, const dfl_dflash_attn *a)
{
    const float *q = a->q, *kc = a->k_ctx, *vc = a->v_ctx, *kb = a->k_blk, *vb = a->v_blk;
    const float *o = a->o, *dout = a->dout, *lse = a->lse;
    float *dq = a->dq, *dkc = a->dk_ctx, *dvc = a->dv_ctx, *dkb = a->dk_blk, *dvb = a->dv_blk;
    float *delta = a->delta;
    const int d = a->d, bs = a->bs, nh = a->n_heads, nkv = a->n_kv, group = nh / nkv;
    const int64_t ldq = (int64_t)nh * d, ldk = (int64_t)nkv * d;
    const float scale = a->scale;
    if (d > MAX_HEAD_DIM)
        return DFL_EUNSUP;

    /* pass 1 */
#pragma omp parallel for schedule(dynamic, 1) collapse(2) if (PAR(a->n_blocks * (int64_t)nh * bs * (a->max_anchor + bs) * d))
    for (int64_t b = 0; b < a->n_blocks; b++) {
        for (int g = 0; g < nkv; g++) {
            const int32_t cs = a->ctx_start[b], an = a->anchor[b];
            const int64_t koff = (int64_t)g * d, brow = b * bs;
            for (int i = 0; i < bs; i++) {
                memset(dkb + (brow + i) * ldk + koff, 0, (size_t)d * sizeof(float));
                memset(dvb + (brow + i) * ldk + koff, 0, (size_t)d * sizeof(float));
            }
            for (int h = g * group; h < (g + 1) * group; h++) {
                for (int j = 0; j < bs; j++) {
                    const int64_t qr = brow + j, qo = qr * ldq + (int64_t)h * d;
                    const float *qv = q + qo, *dov = dout + qo, *ov = o + qo;
                    double dd = 0;
                    for (int i = 0; i < d; i++)
                        dd += (double)dov[i] * ov[i];
                    const float D = (float)dd, L = lse[qr * nh + h];
                    int64_t clo;
                    int bhi;
                    dflash_keys(a->window, an, j, bs, &clo, &bhi);
                    const int64_t c0 = cs + clo, nctx = an - clo, nkeys = nctx + bhi;
                    delta[qr * nh + h] = D;
                    float acc[MAX_HEAD_DIM];
                    for (int i = 0; i < d; i++)
                        acc[i] = 0;
                    for (int64_t t = 0; t < nkeys; t++) {
                        const float *kv = attn_key(kc, kb, ldk, c0, nctx, brow, t, koff);
                        const float *vv = attn_key(vc, vb, ldk, c0, nctx, brow, t, koff);
                        float p = expf(dotf(qv, kv, d) * scale - L);
                        float ds = p * (dotf(dov, vv, d) - D);
                        for (int i = 0; i < d; i++)
                            acc[i] += ds * kv[i];
                        if (t >= nctx) {
                            float *dk = dkb + (brow + t - nctx) * ldk + koff;
                            float *dv = dvb + (brow + t - nctx) * ldk + koff;
                            for (int i = 0; i < d; i++) {
                                dk[i] += ds * scale * qv[i];
                                dv[i] += p * dov[i];
                            }
                        }
                    }
                    float *dqv = dq + qo;
                    for (int i = 0; i < d; i++)
                        dqv[i] = acc[i] * scale;
                }
            }
        }
    }

    /* pass 2 */
#pragma omp parallel for schedule(dynamic, 4) collapse(2) if (PAR(a->T_ctx * (int64_t)nh * bs * d))
    for (int64_t c = 0; c < a->T_ctx; c++) {
        for (int g = 0; g < nkv; g++) {
            const int64_t koff = (int64_t)g * d;
            float dk[MAX_HEAD_DIM], dv[MAX_HEAD_DIM];
            for (int i = 0; i < d; i++)
                dk[i] = dv[i] = 0;
            int64_t last = blocks_upper(a->ctx_start, a->n_blocks, c); /* blocks [.., last) */
            if (last > 0) {
                const int32_t s0 = a->ctx_start[last - 1];
                const float *kv = kc + c * ldk + koff, *vv = vc + c * ldk + koff;
                for (int64_t b = last - 1; b >= 0 && a->ctx_start[b] == s0; b--) {
                    if (!(c < (int64_t)s0 + a->anchor[b]))
                        continue;
                    /* slots that see position c - s0: all, or j <= c - s0 - anchor + W - 1 */
                    int64_t jend = bs;
                    if (a->window > 0 && c - s0 - a->anchor[b] + a->window < jend)
                        jend = c - s0 - a->anchor[b] + a->window;
                    for (int h = g * group; h < (g + 1) * group; h++) {
                        for (int j = 0; j < jend; j++) {
                            const int64_t qr = b * bs + j, qo = qr * ldq + (int64_t)h * d;
                            const float *qv = q + qo, *dov = dout + qo;
                            float p = expf(dotf(qv, kv, d) * scale - lse[qr * nh + h]);
                            float ds = p * (dotf(dov, vv, d) - delta[qr * nh + h]);
                            for (int i = 0; i < d; i++) {
                                dk[i] += ds * scale * qv[i];
                                dv[i] += p * dov[i];
                            }
                        }
                    }
                }
            }
            memcpy(dkc + c * ldk + koff, dk, (size_t)d * sizeof(float));
            memcpy(dvc + c * ldk + koff, dv, (size_t)d * sizeof(float));
        }
    }
    return 0;
}

/* ---- LM head + cross-entropy --------------------------------------------------------------- */

int dfl_cpu_lmce(dfl_be *be, const dfl_lmce *a)
{
    const int64_t V = a->V, H = a->H, CR = a->chunk_rows > 0 ? a->chunk_rows : 1;
    float *logits = a->work;                 /* [CR, V] */
    float *row_wce = a->work + CR * V;       /* [CR] w*ce per row */
    float *row_hit = row_wce + CR;           /* [CR] 1 if argmax == label */
    for (int64_t r0 = 0; r0 < a->Q; r0 += CR) {
        int64_t nr = a->Q - r0 < CR ? a->Q - r0 : CR;
        dfl_mm mm = {
            .M = nr, .N = V, .K = H,
            .A = (const float *)a->z + r0 * H, .adt = be->act, .lda = H,
            .B = a->w_lm, .bdt = be->wdt, .ldb = H, .tb = true,
            .C = logits, .cdt = DFL_F32, .ldc = V, .alpha = 1.0f, .beta = 0.0f,
        };
        int rc = be->ops->matmul(be, &mm);
        if (rc)
            return rc;
#pragma omp parallel for schedule(static) if (PAR(nr * V))
        for (int64_t r = 0; r < nr; r++) {
            float *lr = logits + r * V;
            const int64_t q = r0 + r;
            const float w = a->weight[q];
            row_wce[r] = 0;
            row_hit[r] = 0;
            if (!(w > 0)) {
                if (a->correct)
                    a->correct[q] = 0;
                if (a->ce_out)
                    a->ce_out[q] = 0;
                if (a->dz)
                    memset(lr, 0, (size_t)V * sizeof *lr);
                continue;
            }
            const int32_t label = a->labels[q];
            float mx = lr[0];
            int64_t am = 0;
            for (int64_t v = 1; v < V; v++)
                if (lr[v] > mx) {
                    mx = lr[v];
                    am = v;
                }
            double se = 0;
            for (int64_t v = 0; v < V; v++)
                se += exp((double)lr[v] - mx);
            double lse = mx + log(se);
            double ce = lse - lr[label];
            row_wce[r] = (float)((double)w * ce);
            row_hit[r] = am == label;
            if (a->correct)
                a->correct[q] = am == label;
            if (a->ce_out)
                a->ce_out[q] = (float)ce;
            if (a->dz) {
                const float gw = a->grad_scale * w;
                for (int64_t v = 0; v < V; v++)
                    lr[v] = gw * (float)exp((double)lr[v] - lse);
                lr[label] -= gw;
            }
        }
        for (int64_t r = 0; r < nr; r++) {
            const float w = a->weight[r0 + r];
            if (!(w > 0))
                continue;
            a->sums[DFL_SUM_LOSS_NUM] += row_wce[r];
            a->sums[DFL_SUM_LOSS_DEN] += w;
            a->sums[DFL_SUM_ACC_NUM] += row_hit[r];
            a->sums[DFL_SUM_ACC_DEN] += 1;
        }
        if (a->dz) {
            dfl_mm mz = {
                .M = nr, .N = H, .K = V,
                .A = logits, .adt = DFL_F32, .lda = V,
                .B = a->w_lm, .bdt = be->wdt, .ldb = H,
                .C = (float *)a->dz + r0 * H, .cdt = be->act, .ldc = H, .alpha = 1.0f, .beta = 0.0f,
            };
            rc = be->ops->matmul(be, &mz);
            if (rc)
                return rc;
        }
    }
    return 0;
}

/* ---- gradient norm, clipping, AdamW, noise ------------------------------------------------- */

int dfl_cpu_sumsq(dfl_be *be, double *out, const float *x, int64_t n)
{
    /* at most 1024 chunks whose size depends on n only; partial sums added in order */
    enum { MAXC = 1024 };
    double part[MAXC];
    if (n <= 0)
        return 0;
    int64_t cs = (n + MAXC - 1) / MAXC;
    if (cs < 4096)
        cs = 4096;
    int64_t nc = (n + cs - 1) / cs;
#pragma omp parallel for schedule(static) if (PAR(n))
    for (int64_t c = 0; c < nc; c++) {
        int64_t i0 = c * cs, i1 = i0 + cs < n ? i0 + cs : n;
        double s = 0;
        for (int64_t i = i0; i < i1; i++)
            s += (double)x[i] * x[i];
        part[c] = s;
    }
    double s = 0;
    for (int64_t c = 0; c < nc; c++)
        s += part[c];
    out[0] += s;
    return 0;
}

int dfl_cpu_clip_scale(dfl_be *be, float *out, int32_t *skip, const double *sums, float max_norm)
{
    dfl_clip_scale_of(out, skip, sums, max_norm);
    return 0;
}

int dfl_cpu_block_metrics(dfl_be *be, double *out, const uint8_t *correct, const float *weight,
                          int64_t n_blocks, int bs)
{
    for (int64_t b = 0; b < n_blocks; b++) {
        const float *w = weight + b * bs;
        const uint8_t *ok = correct + b * bs;
        for (int j = 0; j < bs; j++) {
            out[j] += w[j] > 0;
            out[bs + j] += ok[j];
        }
        if (bs > 1 && w[1] > 0) {
            int n = 0;
            while (n + 1 < bs && ok[n + 1])
                n++;
            out[2 * bs] += 1 + n;
            out[2 * bs + 1] += 1;
        }
    }
    return 0;
}

int dfl_cpu_adamw(dfl_be *be, const dfl_adamw *a)
{
    if (a->skip && *a->skip)
        return 0;
    const float gs = a->grad_scale ? *a->grad_scale : 1.0f;
    const int64_t t = a->step - (a->prev_skip && *a->prev_skip && a->step > 1 ? 1 : 0);
    const dfl_adam_scalars c = dfl_adam_scalars_at(a, t);
    float *p = a->p, *m = a->m, *v = a->v;
    const float *g = a->g;
#pragma omp parallel for schedule(static) if (PAR(a->n))
    for (int64_t i = 0; i < a->n; i++)
        dfl_adamw_one(&p[i], &m[i], &v[i], g[i], gs, &c);
    if (a->p_act && a->p_act != (void *)a->p)
        return be->ops->convert(be, a->p_act, be->wdt, a->p, DFL_F32, a->n);
    return 0;
}

int dfl_cpu_uniform_noise(dfl_be *be, void *xv, int64_t n, float amp, uint64_t seed)
{
    float *x = xv;
#pragma omp parallel for schedule(static) if (PAR(n))
    for (int64_t i = 0; i < n; i++)
        x[i] += dfl_noise_add(seed, (uint64_t)i, amp);
    return 0;
}

/* f32 activations: the sum in row order is already the rounding the op defines */
int dfl_cpu_segment_sum(dfl_be *be, void *dstv, const void *srcv, const int32_t *off, int64_t n,
                        int64_t w)
{
    float *dst = dstv;
    const float *src = srcv;
#pragma omp parallel for schedule(static) if (PAR(n * w))
    for (int64_t i = 0; i < n; i++) {
        float *d = dst + i * w;
        for (int64_t k = 0; k < w; k++)
            d[k] = 0.0f;
        for (int64_t r = off[i]; r < off[i + 1]; r++)
            for (int64_t k = 0; k < w; k++)
                d[k] += src[r * w + k];
    }
    return 0;
}

int dfl_cpu_gather_rows(dfl_be *be, void *dstv, const void *srcv, const int32_t *rows, int64_t n,
                        int64_t row_bytes)
{
    char *dst = dstv;
    const char *src = srcv;
    const size_t rb = (size_t)row_bytes;
#pragma omp parallel for schedule(static) if (PAR(n * row_bytes / 4))
    for (int64_t i = 0; i < n; i++) {
        if (rows[i] >= 0)
            memcpy(dst + (size_t)i * rb, src + (size_t)rows[i] * rb, rb);
        else
            memset(dst + (size_t)i * rb, 0, rb);
    }
    return 0;
}
