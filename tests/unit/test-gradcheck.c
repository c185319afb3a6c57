/* test-gradcheck.c: every backward op of the CPU backend against central finite differences of
 * a double-precision reference of its forward (and the f32 forward ops against that reference),
 * and the drafter's other ops (AdamW, norms and clipping, block metrics, noise) against their
 * definitions.
 * The scalar checked is L = sum(r * forward(x)) for a fixed random r, so the op's backward with
 * dout = r must equal dL/dx. Errors are measured relative to the largest |gradient| of each
 * tensor (the golden test's rule, doc/dflash-step.md section 6). */
#include <math.h>
#include <stdint.h>
#include <stdlib.h>
#include <string.h>

#include "backend.h"
#include "be_math.h"
#include "util.h"
#include "t.h"

static dfl_be *be;
static uint64_t rng = 0x1234567;

static double urand(void) /* [-1, 1) */
{
    rng = rng * 6364136223846793005ull + 1442695040888963407ull;
    return (double)(rng >> 11) * (2.0 / 9007199254740992.0) - 1.0;
}

static float *frand(int64_t n, double lo, double hi)
{
    float *p = malloc((size_t)n * sizeof *p);
    for (int64_t i = 0; i < n; i++)
        p[i] = (float)(lo + (hi - lo) * (urand() + 1) / 2);
    return p;
}

static double *to_d(const float *x, int64_t n)
{
    double *p = malloc((size_t)n * sizeof *p);
    for (int64_t i = 0; i < n; i++)
        p[i] = x[i];
    return p;
}

/* max |a - b| / max |b| over n, failing on NaN */
static double rel_err(const float *a, const double *b, int64_t n)
{
    double mx = 0, err = 0;
    for (int64_t i = 0; i < n; i++) {
        if (!(fabs(b[i]) <= mx))   /* a NaN reference makes the result NaN: the check fails */
            mx = fabs(b[i]);
        double e = fabs((double)a[i] - b[i]);
        if (!(e <= err))
            err = isnan(e) ? INFINITY : e;
    }
    return mx > 0 ? err / mx : err;
}

/* Central differences of f over the n doubles at x (h = 1e-6 relative to 1). */
typedef double (*loss_fn)(void *ctx);
static void fd_grad(double *x, int64_t n, loss_fn f, void *ctx, double *g)
{
    const double h = 1e-6;
    for (int64_t i = 0; i < n; i++) {
        double x0 = x[i];
        x[i] = x0 + h;
        double lp = f(ctx);
        x[i] = x0 - h;
        double lm = f(ctx);
        x[i] = x0;
        g[i] = (lp - lm) / (2 * h);
    }
}

#define TOL 1e-5

/* ---- rmsnorm -------------------------------------------------------------------------------- */

typedef struct { double *x, *w, *r; int64_t R, n; double eps; } rms_ctx;

static double rms_loss(void *p)
{
    rms_ctx *c = p;
    double L = 0;
    for (int64_t r = 0; r < c->R; r++) {
        double ss = 0;
        for (int64_t i = 0; i < c->n; i++)
            ss += c->x[r * c->n + i] * c->x[r * c->n + i];
        double s = 1 / sqrt(ss / c->n + c->eps);
        for (int64_t i = 0; i < c->n; i++)
            L += c->r[r * c->n + i] * c->w[i] * c->x[r * c->n + i] * s;
    }
    return L;
}

static void test_rmsnorm_bwd(void)
{
    const int64_t R = 7, n = 24;
    float *x = frand(R * n, -2, 2), *w = frand(n, 0.5, 1.5), *r = frand(R * n, -1, 1);
    float *y = calloc(R * n, 4), *rstd = calloc(R, 4), *dx = calloc(R * n, 4), *dw = calloc(n, 4);
    T_CHECK(be->ops->rmsnorm(be, y, rstd, x, w, R, n, 1e-6f) == 0, "rmsnorm");
    T_CHECK(be->ops->rmsnorm_bwd(be, dx, dw, r, x, w, rstd, R, n, false) == 0, "rmsnorm_bwd");
    rms_ctx c = {to_d(x, R * n), to_d(w, n), to_d(r, R * n), R, n, 1e-6};
    double *gx = malloc(R * n * 8), *gw = malloc(n * 8);
    fd_grad(c.x, R * n, rms_loss, &c, gx);
    fd_grad(c.w, n, rms_loss, &c, gw);
    double ex = rel_err(dx, gx, R * n), ew = rel_err(dw, gw, n);
    T_CHECK(ex <= TOL, "rmsnorm dx rel err %.3g", ex);
    T_CHECK(ew <= TOL, "rmsnorm dw rel err %.3g", ew);
    /* accumulate_dx adds; dw accumulates */
    float *dx2 = malloc(R * n * 4);
    for (int64_t i = 0; i < R * n; i++)
        dx2[i] = 1.0f;
    T_CHECK(be->ops->rmsnorm_bwd(be, dx2, dw, r, x, w, rstd, R, n, true) == 0, "rmsnorm_bwd acc");
    double worst = 0;
    for (int64_t i = 0; i < R * n; i++)
        worst = t_worst(worst, fabs(dx2[i] - 1.0f - dx[i]));
    for (int64_t i = 0; i < n; i++)
        worst = t_worst(worst, fabs(dw[i] - 2 * gw[i]) / 100);
    T_CHECK(worst <= 1e-4, "accumulation: %.3g", worst);
    /* dx may alias dy */
    float *al = malloc(R * n * 4);
    memcpy(al, r, R * n * 4);
    T_CHECK(be->ops->rmsnorm_bwd(be, al, NULL, al, x, w, rstd, R, n, false) == 0, "alias");
    T_CHECK(memcmp(al, dx, R * n * 4) == 0, "dx aliasing dy gives the same bits");
    free(x), free(w), free(r), free(y), free(rstd), free(dx), free(dw), free(dx2), free(al);
    free(c.x), free(c.w), free(c.r), free(gx), free(gw);
}

/* ---- qknorm + rope -------------------------------------------------------------------------- */

typedef struct { double *x, *w, *r; const int32_t *pos; int64_t R, ld; int heads, d; double eps, theta; } qk_ctx;

static void qk_fwd(const qk_ctx *c, double *out)
{
    int half = c->d / 2;
    for (int64_t r = 0; r < c->R; r++)
        for (int h = 0; h < c->heads; h++) {
            const double *v = c->x + r * c->ld + (int64_t)h * c->d;
            double y[64], s = 1;
            if (c->w) {
                double ss = 0;
                for (int i = 0; i < c->d; i++)
                    ss += v[i] * v[i];
                s = 1 / sqrt(ss / c->d + c->eps);
            }
            for (int i = 0; i < c->d; i++)
                y[i] = (c->w ? c->w[i] : 1) * v[i] * s;
            double *o = out + r * c->ld + (int64_t)h * c->d;
            float inv[32];
            dfl_rope_inv_freq(inv, c->d, (float)c->theta, be->rope_dtype);
            for (int i = 0; i < half; i++) {
                float ang = (float)c->pos[r] * inv[i];   /* angles as the f32 op computes them */
                double co = cosf(ang), si = sinf(ang);
                o[i] = y[i] * co - y[i + half] * si;
                o[i + half] = y[i + half] * co + y[i] * si;
            }
        }
}

static double qk_loss(void *p)
{
    qk_ctx *c = p;
    double *out = calloc(c->R * c->ld, 8), L = 0;
    qk_fwd(c, out);
    for (int64_t r = 0; r < c->R; r++)
        for (int64_t i = 0; i < (int64_t)c->heads * c->d; i++)
            L += c->r[r * c->ld + i] * out[r * c->ld + i];
    free(out);
    return L;
}

static void qk_case(bool with_w, bool with_rstd)
{
    const int64_t R = 5;
    const int heads = 3, d = 8;
    const int64_t ld = heads * d + 4;   /* a strided view, as in a fused projection */
    int32_t pos[5] = {0, 3, 17, 250, 4095};
    float *x = frand(R * ld, -2, 2), *w = with_w ? frand(d, 0.5, 1.5) : NULL;
    float *r = frand(R * ld, -1, 1);
    float *y = malloc(R * ld * 4), *rstd = calloc(R * heads, 4), *dw = calloc(d, 4);
    memcpy(y, x, R * ld * 4);
    T_CHECK(be->ops->qknorm_rope(be, y, NULL, ld, rstd, w, pos, R, heads, d, 1e-6f, 1e6f) == 0, "fwd");
    /* out of place: the same values at the heads, the output's other columns untouched */
    float *yo = malloc(R * ld * 4);
    for (int64_t i = 0; i < R * ld; i++)
        yo[i] = -7.0f;
    T_CHECK(be->ops->qknorm_rope(be, yo, x, ld, NULL, w, pos, R, heads, d, 1e-6f, 1e6f) == 0, "fwd src");
    for (int64_t rr = 0; rr < R; rr++)
        for (int64_t i = 0; i < ld; i++)
            T_CHECK(yo[rr * ld + i] == (i < heads * d ? y[rr * ld + i] : -7.0f),
                    "out of place, row %lld column %lld", (long long)rr, (long long)i);
    free(yo);
    qk_ctx c = {to_d(x, R * ld), w ? to_d(w, d) : NULL, to_d(r, R * ld), pos, R, ld, heads, d,
                1e-6, 1e6};
    double *ref = calloc(R * ld, 8);
    qk_fwd(&c, ref);
    double ef = 0;
    for (int64_t rr = 0; rr < R; rr++)
        for (int64_t i = 0; i < heads * d; i++)
            ef = fmax(ef, fabs(y[rr * ld + i] - ref[rr * ld + i]));
    T_CHECK(ef <= 1e-5, "qknorm_rope forward vs double: %.3g", ef);
    float *dx = malloc(R * ld * 4);
    memcpy(dx, r, R * ld * 4);
    T_CHECK(be->ops->qknorm_rope_bwd(be, dx, ld, with_w ? dw : NULL, x, w, with_rstd ? rstd : NULL,
                                     pos, R, heads, d, 1e-6f, 1e6f) == 0, "bwd");
    double *gx = calloc(R * ld, 8);
    fd_grad(c.x, R * ld, qk_loss, &c, gx);
    /* only the head columns are the op's; the padding columns are left as they were */
    float *dxh = malloc(R * heads * d * 4);
    double *gxh = malloc(R * heads * d * 8);
    double pad = 0;
    for (int64_t rr = 0; rr < R; rr++) {
        for (int64_t i = 0; i < heads * d; i++) {
            dxh[rr * heads * d + i] = dx[rr * ld + i];
            gxh[rr * heads * d + i] = gx[rr * ld + i];
        }
        for (int64_t i = heads * d; i < ld; i++)
            pad = fmax(pad, fabs(dx[rr * ld + i] - r[rr * ld + i]));
    }
    double ex = rel_err(dxh, gxh, R * heads * d);
    T_CHECK(ex <= TOL, "qknorm_rope dx rel err %.3g (w %d, rstd %d)", ex, with_w, with_rstd);
    T_CHECK(pad == 0, "columns past the heads untouched");
    if (with_w) {
        double gw[8];
        fd_grad(c.w, d, qk_loss, &c, gw);
        double ew = rel_err(dw, gw, d);
        T_CHECK(ew <= TOL, "qknorm_rope dw rel err %.3g", ew);
    }
    free(x), free(w), free(r), free(y), free(rstd), free(dw), free(dx), free(dxh), free(gxh);
    free(c.x), free(c.w), free(c.r), free(ref), free(gx);
}

static void test_qknorm_rope_bwd(void)
{
    qk_case(true, true);
    qk_case(true, false);
    qk_case(false, false);
    be->rope_dtype = DFL_BF16;   /* inverse frequencies rounded as for a bf16 target */
    qk_case(true, true);
    be->rope_dtype = DFL_DT_INVALID;
}

/* ---- swiglu --------------------------------------------------------------------------------- */

typedef struct { double *gu, *r; int64_t R, I; } sw_ctx;

static double sw_loss(void *p)
{
    sw_ctx *c = p;
    double L = 0;
    for (int64_t r = 0; r < c->R; r++)
        for (int64_t i = 0; i < c->I; i++) {
            double g = c->gu[r * 2 * c->I + i], u = c->gu[r * 2 * c->I + c->I + i];
            L += c->r[r * c->I + i] * g / (1 + exp(-g)) * u;
        }
    return L;
}

static void test_swiglu_bwd(void)
{
    const int64_t R = 6, I = 10;
    float *gu = frand(R * 2 * I, -4, 4), *r = frand(R * I, -1, 1), *dgu = calloc(R * 2 * I, 4);
    T_CHECK(be->ops->swiglu_bwd(be, dgu, r, gu, R, I) == 0, "swiglu_bwd");
    sw_ctx c = {to_d(gu, R * 2 * I), to_d(r, R * I), R, I};
    double *g = malloc(R * 2 * I * 8);
    fd_grad(c.gu, R * 2 * I, sw_loss, &c, g);
    double e = rel_err(dgu, g, R * 2 * I);
    T_CHECK(e <= TOL, "swiglu rel err %.3g", e);
    free(gu), free(r), free(dgu), free(c.gu), free(c.r), free(g);
}

/* ---- DFlash attention ----------------------------------------------------------------------- */

typedef struct {
    double *q, *kc, *vc, *kb, *vb, *r;
    const int32_t *cs, *an;
    int nb, bs, nh, nkv, d;
    int64_t T;
    int window;      /* 0: full attention; W > 0: the sliding rule written out densely */
} at_ctx;

/* Dense reference of the attention rule: scores over all keys [ctx | blocks], masked. */
static void at_fwd(const at_ctx *c, double *o)
{
    int group = c->nh / c->nkv;
    int64_t Q = (int64_t)c->nb * c->bs;
    double sc = 1 / sqrt((double)c->d);
    for (int64_t qr = 0; qr < Q; qr++) {
        int b = (int)(qr / c->bs);
        for (int h = 0; h < c->nh; h++) {
            int g = h / group;
            const double *qv = c->q + qr * c->nh * c->d + h * c->d;
            double mx = -INFINITY, *s = malloc((c->T + Q) * 8);
            for (int64_t k = 0; k < c->T + Q; k++) {
                const int j = (int)(qr % c->bs);
                bool ok = k < c->T ? (k >= c->cs[b] && k < c->cs[b] + c->an[b])
                                   : ((k - c->T) / c->bs == b);
                if (c->window > 0 && ok)   /* position k - cs >= anchor + j - (W - 1); slot <= j */
                    ok = k < c->T ? k - c->cs[b] >= (int64_t)c->an[b] + j - (c->window - 1)
                                  : (k - c->T) % c->bs <= j;
                s[k] = -INFINITY;
                if (!ok)
                    continue;
                const double *kv = k < c->T ? c->kc + k * c->nkv * c->d + g * c->d
                                            : c->kb + (k - c->T) * c->nkv * c->d + g * c->d;
                double dot = 0;
                for (int i = 0; i < c->d; i++)
                    dot += qv[i] * kv[i];
                s[k] = dot * sc;
                mx = fmax(mx, s[k]);
            }
            double sum = 0;
            for (int64_t k = 0; k < c->T + Q; k++)
                sum += s[k] == -INFINITY ? 0 : exp(s[k] - mx);
            double *ov = o + qr * c->nh * c->d + h * c->d;
            for (int i = 0; i < c->d; i++)
                ov[i] = 0;
            for (int64_t k = 0; k < c->T + Q; k++) {
                if (s[k] == -INFINITY)
                    continue;
                double p = exp(s[k] - mx) / sum;
                const double *vv = k < c->T ? c->vc + k * c->nkv * c->d + g * c->d
                                            : c->vb + (k - c->T) * c->nkv * c->d + g * c->d;
                for (int i = 0; i < c->d; i++)
                    ov[i] += p * vv[i];
            }
            free(s);
        }
    }
}

static double at_loss(void *p)
{
    at_ctx *c = p;
    int64_t n = (int64_t)c->nb * c->bs * c->nh * c->d;
    double *o = malloc(n * 8), L = 0;
    at_fwd(c, o);
    for (int64_t i = 0; i < n; i++)
        L += c->r[i] * o[i];
    free(o);
    return L;
}

/* window 0: full attention; window > 0: sliding */
static void dflash_attn_case(int window)
{
    /* two sequences of 9 and 7 rows; blocks overlap, one has anchor 0, one sees all but one row;
     * a third sequence of 3 rows has no block (its rows must get zero gradient) */
    enum { NB = 6, BS = 4, NH = 4, NKV = 2, D = 8 };
    const int64_t T = 19, Q = NB * BS;
    int32_t cs[NB] = {0, 0, 0, 9, 9, 9};
    int32_t an[NB] = {0, 2, 7, 1, 3, 5};
    const int64_t nq = Q * NH * D, nk = Q * NKV * D, nc = T * NKV * D;
    float *q = frand(nq, -1, 1), *kc = frand(nc, -1, 1), *vc = frand(nc, -1, 1);
    float *kb = frand(nk, -1, 1), *vb = frand(nk, -1, 1), *r = frand(nq, -1, 1);
    float *o = calloc(nq, 4), *lse = calloc(Q * NH, 4), *delta = calloc(Q * NH, 4);
    float *dq = calloc(nq, 4), *dkc = malloc(nc * 4), *dvc = malloc(nc * 4);
    float *dkb = malloc(nk * 4), *dvb = malloc(nk * 4);
    for (int64_t i = 0; i < nc; i++)
        dkc[i] = dvc[i] = NAN;   /* every row must be written */
    for (int64_t i = 0; i < nk; i++)
        dkb[i] = dvb[i] = NAN;
    dfl_dflash_attn a = {
        .q = q, .k_ctx = kc, .v_ctx = vc, .k_blk = kb, .v_blk = vb, .o = o, .lse = lse,
        .ctx_start = cs, .anchor = an, .n_blocks = NB, .bs = BS, .max_anchor = 7,
        .window = window, .T_ctx = T, .n_heads = NH, .n_kv = NKV, .d = D,
        .scale = 1.0f / sqrtf((float)D),
        .dout = r, .delta = delta, .dq = dq, .dk_ctx = dkc, .dv_ctx = dvc, .dk_blk = dkb, .dv_blk = dvb,
    };
    T_CHECK(be->ops->dflash_attn(be, &a) == 0, "forward");
    T_CHECK(be->ops->dflash_attn_bwd(be, &a) == 0, "backward");
    at_ctx c = {to_d(q, nq), to_d(kc, nc), to_d(vc, nc), to_d(kb, nk), to_d(vb, nk), to_d(r, nq),
                cs, an, NB, BS, NH, NKV, D, T, window};
    double *ref = malloc(nq * 8);
    at_fwd(&c, ref);
    double ef = 0;
    for (int64_t i = 0; i < nq; i++)
        ef = fmax(ef, isnan(o[i]) ? INFINITY : fabs(o[i] - ref[i]));
    T_CHECK(ef <= 1e-5, "forward vs dense double reference: %.3g", ef);
    struct { const char *name; double *x; float *g; int64_t n; } in[] = {
        {"dq", c.q, dq, nq}, {"dk_ctx", c.kc, dkc, nc}, {"dv_ctx", c.vc, dvc, nc},
        {"dk_blk", c.kb, dkb, nk}, {"dv_blk", c.vb, dvb, nk},
    };
    for (size_t t = 0; t < DFL_ARRAY_LEN(in); t++) {
        double *g = malloc(in[t].n * 8);
        fd_grad(in[t].x, in[t].n, at_loss, &c, g);
        double e = rel_err(in[t].g, g, in[t].n);
        T_CHECK(e <= TOL, "%s rel err %.3g", in[t].name, e);
        free(g);
    }
    /* rows 16..18 (no block) and rows of seq 1 at or after its largest anchor are zero */
    double z = 0;
    for (int64_t row = 9 + 5; row < T; row++)
        for (int i = 0; i < NKV * D; i++)
            z = fmax(z, fabs(dkc[row * NKV * D + i]) + fabs(dvc[row * NKV * D + i]));
    T_CHECK(z == 0, "unseen context rows get zero gradient");
    if (window > 0) {
        /* row 0 of seq 0 is seen only by the blocks anchored within W - 1 + bs - 1 of it: with
         * W = 3 and anchors 2 and 7, by block 1 only (slots j <= 0 + 3 - 1 - 2 = 0) */
        double d0 = 0;
        for (int i = 0; i < NKV * D; i++)
            d0 += fabs(dkc[i]) + fabs(dvc[i]);
        T_CHECK(d0 > 0, "row 0 has a gradient from block 1 slot 0");
    }
    free(q), free(kc), free(vc), free(kb), free(vb), free(r), free(o), free(lse), free(delta);
    free(dq), free(dkc), free(dvc), free(dkb), free(dvb);
    free(c.q), free(c.kc), free(c.vc), free(c.kb), free(c.vb), free(c.r), free(ref);
}

static void test_dflash_attn(void) { dflash_attn_case(0); }

/* Sliding window W = 3 (smaller than the block, so that both the context bound and the causal
 * block rule cut) and W = 6. */
static void test_dflash_attn_window(void)
{
    dflash_attn_case(3);
    dflash_attn_case(6);
}

/* ---- LM head + cross-entropy ---------------------------------------------------------------- */

typedef struct { double *z, *W; const int32_t *lab; const float *w; int64_t Q, H, V; } ce_ctx;

static double ce_loss(void *p)
{
    ce_ctx *c = p;
    double L = 0;
    double *lg = malloc(c->V * 8);
    for (int64_t q = 0; q < c->Q; q++) {
        if (!(c->w[q] > 0))
            continue;
        double mx = -INFINITY;
        for (int64_t v = 0; v < c->V; v++) {
            double s = 0;
            for (int64_t i = 0; i < c->H; i++)
                s += c->z[q * c->H + i] * c->W[v * c->H + i];
            lg[v] = s;
            mx = fmax(mx, s);
        }
        double se = 0;
        for (int64_t v = 0; v < c->V; v++)
            se += exp(lg[v] - mx);
        L += c->w[q] * (mx + log(se) - lg[c->lab[q]]);
    }
    free(lg);
    return L;
}

static void test_lmce(void)
{
    const int64_t Q = 11, H = 6, V = 37;
    float *z = frand(Q * H, -1, 1), *W = frand(V * H, -1, 1);
    int32_t lab[11];
    float w[11];
    for (int q = 0; q < Q; q++) {
        lab[q] = (q * 7) % V;
        w[q] = q % 4 == 0 ? 0.0f : (float)exp(-(q % 4 - 1) / 4.0);
    }
    /* make row 1 predicted correctly */
    for (int64_t i = 0; i < H; i++)
        W[lab[1] * H + i] = 3 * z[1 * H + i];
    double sums[DFL_SUM_COUNT] = {0};
    uint8_t correct[11];
    float *dz = malloc(Q * H * 4), ce[11];
    for (int64_t chunk = 1; chunk <= 16; chunk *= 4) {
        float *work = malloc((size_t)dfl_lmce_work(chunk, V) * 4);
        memset(sums, 0, sizeof sums);
        dfl_lmce a = {.z = z, .w_lm = W, .labels = lab, .weight = w, .Q = Q, .H = H, .V = V,
                      .sums = sums, .correct = correct, .ce_out = ce, .dz = dz, .grad_scale = 0.5f,
                      .work = work, .chunk_rows = chunk};
        T_CHECK(be->ops->lmce(be, &a) == 0, "lmce");
        ce_ctx c = {to_d(z, Q * H), to_d(W, V * H), lab, w, Q, H, V};
        double L = ce_loss(&c), den = 0, acc_den = 0;
        for (int q = 0; q < Q; q++) {
            den += w[q];
            acc_den += w[q] > 0;
        }
        T_NEAR(sums[DFL_SUM_LOSS_NUM], L, 1e-5 * fabs(L), "loss_num");
        T_NEAR(sums[DFL_SUM_LOSS_DEN], den, 1e-6, "loss_den");
        T_NEAR(sums[DFL_SUM_ACC_DEN], acc_den, 0, "acc_den");
        T_CHECK(correct[1] == 1 && correct[0] == 0, "correct flags %d %d", correct[1], correct[0]);
        T_CHECK(sums[DFL_SUM_ACC_NUM] >= 1, "acc_num %g", sums[DFL_SUM_ACC_NUM]);
        double *g = malloc(Q * H * 8);
        fd_grad(c.z, Q * H, ce_loss, &c, g);
        for (int64_t i = 0; i < Q * H; i++)
            g[i] *= 0.5;
        double e = rel_err(dz, g, Q * H);
        T_CHECK(e <= TOL, "dz rel err %.3g (chunk %lld)", e, (long long)chunk);
        free(g), free(c.z), free(c.W), free(work);
    }
    free(z), free(W), free(dz);
}

/* ---- optimizer pieces ----------------------------------------------------------------------- */

static void test_adamw(void)
{
    const int64_t n = 1000;
    float *p = frand(n, -1, 1), *m = calloc(n, 4), *v = calloc(n, 4), *g = malloc(n * 4);
    double *pd = to_d(p, n), *md = calloc(n, 8), *vd = calloc(n, 8);
    const double lr = 1e-3, b1 = 0.9, b2 = 0.95, eps = 1e-8, wd = 0.1;
    float scale = 0.25f;
    int32_t skip = 0;
    for (int step = 1; step <= 3; step++) {
        for (int64_t i = 0; i < n; i++)
            g[i] = (float)(urand() * (i % 10 == 0 ? 1e-6 : 1));
        dfl_adamw a = {.p = p, .g = g, .m = m, .v = v, .n = n, .lr = (float)lr, .beta1 = (float)b1,
                       .beta2 = (float)b2, .eps = (float)eps, .weight_decay = (float)wd, .step = step,
                       .grad_scale = &scale, .skip = &skip};
        T_CHECK(be->ops->adamw(be, &a) == 0, "adamw");
        for (int64_t i = 0; i < n; i++) {
            double gi = g[i] * (double)scale;
            pd[i] *= 1 - lr * wd;
            md[i] = b1 * md[i] + (1 - b1) * gi;
            vd[i] = b2 * vd[i] + (1 - b2) * gi * gi;
            double den = sqrt(vd[i]) / sqrt(1 - pow(b2, step)) + eps;
            pd[i] -= lr * md[i] / ((1 - pow(b1, step)) * den);
        }
    }
    double e = 0;
    for (int64_t i = 0; i < n; i++)
        e = fmax(e, isnan(p[i]) ? INFINITY : fabs(p[i] - pd[i]));
    T_CHECK(e <= 2e-7, "adamw vs double: %.3g", e);
    /* skip leaves everything unchanged */
    float *p0 = malloc(n * 4);
    memcpy(p0, p, n * 4);
    skip = 1;
    dfl_adamw a = {.p = p, .g = g, .m = m, .v = v, .n = n, .lr = 1, .beta1 = 0.9f, .beta2 = 0.9f,
                   .eps = 1e-8f, .step = 4, .grad_scale = &scale, .skip = &skip};
    T_CHECK(be->ops->adamw(be, &a) == 0, "adamw skip");
    T_CHECK(memcmp(p0, p, n * 4) == 0, "skip changes nothing");
    free(p), free(m), free(v), free(g), free(pd), free(md), free(vd), free(p0);
}

static void test_sumsq_clip(void)
{
    const int64_t n = 100003;
    float *x = frand(n, -1, 1);
    double ref = 0, s[DFL_SUM_COUNT] = {0};
    for (int64_t i = 0; i < n; i++)
        ref += (double)x[i] * x[i];
    T_CHECK(be->ops->sumsq(be, &s[DFL_SUM_GRAD_SQ], x, n) == 0, "sumsq");
    T_NEAR(s[DFL_SUM_GRAD_SQ], ref, 1e-9 * ref, "sumsq");
    s[DFL_SUM_LOSS_NUM] = 10;
    s[DFL_SUM_LOSS_DEN] = 4;
    s[DFL_SUM_GRAD_SQ] = 64;  /* norm of loss gradient = 8 / 4 = 2 */
    float out[3];
    int32_t skip = 7;
    be->ops->clip_scale(be, out, &skip, s, 1.0f);
    T_EQ_INT(skip, 0, "skip");
    T_NEAR(out[1], 2.0, 1e-6, "norm");
    T_NEAR(out[2], 1.0 / (2.0 + 1e-6), 1e-7, "coef");
    T_NEAR(out[0], out[2] / 4.0, 1e-8, "scale");
    be->ops->clip_scale(be, out, &skip, s, 0.0f);
    T_NEAR(out[0], 0.25, 0, "no clipping");
    s[DFL_SUM_GRAD_SQ] = NAN;
    be->ops->clip_scale(be, out, &skip, s, 1.0f);
    T_EQ_INT(skip, 1, "NaN norm skips");
    s[DFL_SUM_GRAD_SQ] = 1;
    s[DFL_SUM_LOSS_NUM] = INFINITY;
    be->ops->clip_scale(be, out, &skip, s, 1.0f);
    T_EQ_INT(skip, 1, "infinite loss skips");
    s[DFL_SUM_LOSS_NUM] = 1;
    s[DFL_SUM_LOSS_DEN] = 0;
    be->ops->clip_scale(be, out, &skip, s, 1.0f);
    T_EQ_INT(skip, 1, "zero denominator skips");
    free(x);
}

static void test_block_metrics(void)
{
    /* 3 blocks of 4: slot weights and correct flags as lmce leaves them */
    const float w[12] = {0, 1, .8f, .6f,   0, 1, 0, .6f,   0, 0, .8f, .6f};
    const uint8_t ok[12] = {0, 1, 1, 0,    0, 1, 0, 1,     0, 0, 1, 1};
    double out[10] = {0};
    T_CHECK(be->ops->block_metrics(be, out, ok, w, 3, 4) == 0, "block_metrics");
    const double want[10] = {0, 2, 2, 3,   0, 2, 2, 2,   2 + 3, 2};
    for (int i = 0; i < 10; i++)
        T_NEAR(out[i], want[i], 0, "block metrics");
    /* accumulates */
    be->ops->block_metrics(be, out, ok, w, 1, 4);
    T_NEAR(out[8], 5 + 3, 0, "tau sum accumulates");
}

static void test_gather_rows(void)
{
    /* rows of 3 bytes (any element type is copied as bytes), -1 rows zeroed */
    const uint8_t src[4 * 3] = {1, 2, 3,   4, 5, 6,   7, 8, 9,   10, 11, 12};
    const int32_t rows[5] = {2, -1, 0, 2, 3};
    uint8_t dst[5 * 3];
    memset(dst, 0xEE, sizeof dst);
    T_CHECK(be->ops->gather_rows(be, dst, src, rows, 5, 3) == 0, "gather_rows");
    const uint8_t want[5 * 3] = {7, 8, 9,   0, 0, 0,   1, 2, 3,   7, 8, 9,   10, 11, 12};
    T_CHECK(!memcmp(dst, want, sizeof want), "gathered rows and zeroed -1 rows");
    /* scatter back through the inverse map of the drafter's scored rows (bs 4: slots 1..3) */
    const float z[2 * 4] = {.5f, 1, 2, 3,   -.5f, 4, 5, 6};
    const int32_t scored[6] = {1, 2, 3, 5, 6, 7}, inv[8] = {-1, 0, 1, 2, -1, 3, 4, 5};
    float zs[6], back[8];
    be->ops->gather_rows(be, zs, z, scored, 6, sizeof(float));
    be->ops->gather_rows(be, back, zs, inv, 8, sizeof(float));
    for (int q = 0; q < 8; q++)
        T_CHECK(back[q] == (q % 4 ? z[q] : 0.0f), "row %d through the scored rows and back", q);
}

static void test_segment_sum(void)
{
    /* 5 rows of 3; segments [0,1) [1,4) [4,4) (empty: 0) [4,5) */
    const float src[5 * 3] = {1, 2, 3,   .5f, -1, 1e8f,   .25f, 2, 1,   .125f, 4, -1e8f,   7, 8, 9};
    const int32_t off[5] = {0, 1, 4, 4, 5};
    float dst[4 * 3];
    memset(dst, 0xEE, sizeof dst);
    T_CHECK(be->ops->segment_sum(be, dst, src, off, 4, 3) == 0, "segment_sum");
    /* in row order, in f32: (1e8 + 1) - 1e8 is 0 in f32, not 1 */
    const float want[4 * 3] = {1, 2, 3,   .875f, 5, (1e8f + 1.0f) - 1e8f,   0, 0, 0,   7, 8, 9};
    for (int i = 0; i < 12; i++)
        T_CHECK(dst[i] == want[i], "segment_sum element %d: %g, want %g", i, dst[i], want[i]);
}

/* matmul with a separate added C (dfl_mm.Cin; the drafter's residual products): the same bits
 * as copying Cin into C and adding in place, f32 and bf16 C, padded rows; Cin unchanged, C's
 * padding untouched; beta 0 ignores Cin */
static void test_matmul_cin(void)
{
    enum { M = 5, N = 7, K = 3, LD = 9 };
    float A[M * K], B[N * K], cin[M * LD];
    for (int i = 0; i < M * K; i++)
        A[i] = 0.25f * (float)(i % 7) - 0.5f;
    for (int i = 0; i < N * K; i++)
        B[i] = 0.125f * (float)(i % 5) + 0.1f;
    for (int i = 0; i < M * LD; i++)
        cin[i] = 0.3f * (float)(i % 11) - 1.0f;
    for (int bf = 0; bf < 2; bf++) {
        const dfl_dtype cdt = bf ? DFL_BF16 : DFL_F32;
        const size_t es = dfl_dtype_size(cdt);
        uint8_t cin_c[M * LD * 4], cin_keep[M * LD * 4], ref[M * LD * 4], got[M * LD * 4];
        dfl_convert(cin_c, cdt, cin, DFL_F32, M * LD);
        memcpy(cin_keep, cin_c, sizeof cin_c);
        memcpy(ref, cin_c, M * LD * es);
        memset(got, 0x7f, sizeof got);
        dfl_mm m = {.M = M, .N = N, .K = K, .A = A, .adt = DFL_F32, .lda = K, .B = B, .bdt = DFL_F32,
                    .ldb = K, .tb = true, .C = ref, .cdt = cdt, .ldc = LD, .alpha = 1, .beta = 1};
        T_CHECK(be->ops->matmul(be, &m) == 0, "in place");
        m.C = got;
        m.Cin = cin_c;
        T_CHECK(be->ops->matmul(be, &m) == 0, "with Cin");
        int bad = 0, pad = 0;
        for (int i = 0; i < M; i++)
            for (int j = 0; j < LD; j++) {
                const size_t o = ((size_t)i * LD + j) * es;
                if (j < N)
                    bad += memcmp(got + o, ref + o, es) != 0;
                else
                    pad += got[o] != 0x7f;
            }
        T_CHECK(bad == 0 && pad == 0, "%s C: %d elements differ from in place, %d padding bytes written",
                bf ? "bf16" : "f32", bad, pad);
        T_CHECK(!memcmp(cin_c, cin_keep, sizeof cin_c), "Cin unchanged");
        m.beta = 0;   /* Cin is not read */
        m.Cin = NULL;
        m.C = ref;
        memcpy(ref, got, sizeof got);
        T_CHECK(be->ops->matmul(be, &m) == 0, "beta 0");
        m.C = got;
        m.Cin = cin_c;
        T_CHECK(be->ops->matmul(be, &m) == 0 && !memcmp(got, ref, sizeof got), "beta 0 ignores Cin");
    }
}

static void test_uniform_noise(void)
{
    const int64_t n = 200000;
    float *x = calloc(n, 4);
    be->ops->uniform_noise(be, x, n, 0.5f, 42);
    double mn = 1, mx = -1, mean = 0, var = 0;
    for (int64_t i = 0; i < n; i++) {
        mn = fmin(mn, x[i]);
        mx = fmax(mx, x[i]);
        mean += x[i];
        var += (double)x[i] * x[i];
    }
    mean /= n;
    var /= n;
    T_CHECK(mn >= -0.5 && mx < 0.5 && mx > 0.49 && mn < -0.49, "range [%g, %g]", mn, mx);
    T_NEAR(mean, 0, 0.005, "mean");
    T_NEAR(var, 0.25 / 3, 0.002, "variance of U(-a, a) is a^2/3");
    T_NEAR(x[0], 0.5f * (2 * dfl_noise_u01(42, 0) - 1), 0, "counter-based, element 0");
    free(x);
}

int main(int argc, char **argv)
{
    t_init(argv[0]);
    if (!(be = t_cpu_backend()))
        return 1;
    T_RUN(test_rmsnorm_bwd);
    T_RUN(test_qknorm_rope_bwd);
    T_RUN(test_swiglu_bwd);
    T_RUN(test_dflash_attn);
    T_RUN(test_dflash_attn_window);
    T_RUN(test_lmce);
    T_RUN(test_adamw);
    T_RUN(test_sumsq_clip);
    T_RUN(test_block_metrics);
    T_RUN(test_gather_rows);
    T_RUN(test_segment_sum);
    T_RUN(test_uniform_noise);
    T_RUN(test_matmul_cin);
    dfl_be_close(be);
    return t_done();
}
