/* gpu-train-ops.c: the CUDA backend's drafter ops (kernels/train_ops.cu, kernels/dflash_attn.cu)
 * against the CPU reference ops (lib/backends/be_cpu_train.c) on random inputs, in bf16 mode
 * (be->act = bf16) and f32 mode: rmsnorm_bwd, qknorm_rope_bwd, swiglu_bwd, dflash_attn (forward
 * and backward; every tile variant, the exact f32 kernels, odd shapes), lmce, sumsq, clip_scale,
 * adamw, uniform_noise, gather_rows and segment_sum. Without a GPU (or in a build without CUDA) every case is skipped and
 * the program exits 77.
 *
 * Inputs are drawn in f32 and, in bf16 mode, rounded to bf16 first, so both backends see the
 * same values; the CPU computes in f32 (double for its long sums). Outputs are compared per row:
 * relative error ||gpu - cpu|| / ||cpu|| and cosine similarity; a non-finite GPU value where
 * the CPU has a finite one fails, and so does a nonzero value where the CPU has an all-zero row.
 * Tolerances (per row):
 *   bf16, row/elementwise ops (one rounding of the output, <= 2^-9):  rel 8e-3,  cos 0.99995
 *   f32, row/elementwise ops:                                         rel 2e-5,  cos 0.9999999
 *   weight gradients of the norms (f32 out, same inputs; order only): rel 2e-5 (both modes)
 *   attention forward bf16 (P rounded to bf16 for P V):               rel 1e-2,  cos 0.9999
 *   attention backward bf16 (P and dS rounded to bf16):               rel 3e-2,  cos 0.9995
 *   attention f32 (exact kernels):                                     rel 5e-5,  cos 0.999999
 *   (attention gradients: |diff| <= rel |ref| + 1e-5 M per row, M the size of the row's terms,
 *   for rows whose terms cancel; see cmp_grad. A tiled variant whose query rows per CTA are
 *   fewer than group * bs falls back to the exact kernels for that case.)
 *   lse, delta:                                                        rel 1e-4 (bf16), 2e-5 (f32)
 *   lmce: ce per row |diff| <= 2e-4 + 1e-5 |ce|; loss sum rel 1e-5; weight sum, scored count
 *         exact; hits exact except rows whose top-2 logit gap is below 1e-3 (counted, allowed);
 *         dz rel 1e-2 / cos 0.9999 (bf16: G is rounded to bf16), rel 1e-4 (f32). In bf16 mode the
 *         GPU rounds the logits to bf16 (as a bf16 LM head does), so the reference is the host's
 *         (lmce_ref_bf16): the same rounding of double-precision logits, and per row an allowance
 *         for the logits whose rounding the GPU's f32 sums could turn the other way (see there)
 *   sumsq rel 1e-12; clip_scale, block_metrics, gather_rows, segment_sum bit-exact; uniform_noise bit-exact (bf16: the
 *         rounded CPU value);
 *   adamw |diff| <= 2^-20 |value| per element (the arithmetic is the CPU's operation for
 *         operation; the count of bitwise-different elements is printed, expected 0).
 * Every op also runs twice on the same inputs and must give the same bytes (determinism). Device
 * buffers have guard bands of sentinel bytes that must come back untouched, outputs start as NaN
 * bytes, and inputs must come back unchanged. Each comparison prints a "#" line with its
 * figures; failures print the worst rows (for attention: block, slot, head, anchor) and
 * elements. */
#include <math.h>
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "backend.h"
#include "dtype.h"
#include "err.h"
#include "../unit/t.h"

#ifdef DFL_CUDA
#include "../../kernels/cuda.h"
#include "../../kernels/cuda_train.h"
#include "gpu-test.h"

/* ------------------------------------------------------------------------------------------ */
/* comparisons */

static bool cmp_rows(const char *what, const float *got, int64_t ldg, const float *ref, int64_t ldr,
                     int64_t R, int64_t n, double rel_tol, double cos_min)
{
    return gpu_cmp_rows(what, got, ldg, ref, ldr, R, n, rel_tol, cos_min, NULL, NULL, true);
}

/* Rows of attention gradients: row r passes when ||got - ref|| <= rtol ||ref|| + ctol M[r], where
 * M[r] bounds the sum of the magnitudes of the terms that make up the row (see df_cond): rows
 * whose terms cancel (a peaked softmax: dS = P (dP - delta) with P ~ 1 and dP ~ delta) have a
 * tiny ||ref|| that no f32 computation reproduces to rtol; their error is bounded by the terms'
 * size instead. The cosine is checked (>= cos_min) only on rows where ||ref|| dominates. */
static bool cmp_grad(const char *what, const float *got, const float *ref, const double *M, int64_t R,
                     int64_t n, double rtol, double ctol, double cos_min, row_desc_fn desc, const void *ctx)
{
    int64_t bad = 0, illcond = 0;
    double worst = 0, worst_cos = 1;
    int printed = 0;
    for (int64_t r = 0; r < R; r++) {
        const float *g = got + r * n, *f = ref + r * n;
        double e2 = 0, r2 = 0, g2 = 0, dot = 0;
        int64_t nf = 0;
        for (int64_t j = 0; j < n; j++) {
            if (!isfinite(g[j])) {
                nf++;
                continue;
            }
            double d = (double)g[j] - f[j];
            e2 += d * d;
            r2 += (double)f[j] * f[j];
            g2 += (double)g[j] * g[j];
            dot += (double)g[j] * f[j];
        }
        const double err = sqrt(e2), nr = sqrt(r2);
        const double bound = rtol * nr + ctol * M[r];
        const bool well = ctol * M[r] <= rtol * nr;
        const double cs = (r2 == 0 && g2 == 0) ? 1.0 : (r2 == 0 || g2 == 0) ? 0.0 : dot / sqrt(r2 * g2);
        illcond += !well;
        const double ratio = bound > 0 ? err / bound : (err > 0 ? INFINITY : 0);
        if (!(ratio <= worst))
            worst = ratio;
        if (well && !(cs >= worst_cos))
            worst_cos = cs;
        const bool ok = nf == 0 && err <= bound && (!well || cs >= cos_min);
        if (!ok) {
            bad++;
            if (printed < 6) {
                printed++;
                char d[200] = "";
                if (desc)
                    desc(ctx, r, d, sizeof d);
                fprintf(stderr, "    %s: row %lld%s%s: |diff| %.3g > %.3g (rtol %.3g x |ref| %.3g + ctol %.3g x "
                        "M %.3g), cos %.9f (min %.9f), %lld non-finite\n", what, (long long)r, d[0] ? " " : "",
                        d, err, bound, rtol, nr, ctol, M[r], cs, cos_min, (long long)nf);
            }
        }
    }
    printf("#   %-64s rows %-7lld worst |diff|/bound %.3f  min cos %.9f (%lld ill-conditioned rows)%s\n", what,
           (long long)R, worst, worst_cos, (long long)illcond, bad ? "  FAIL" : "");
    T_CHECK(bad == 0, "%s: %lld of %lld rows out of tolerance", what, (long long)bad, (long long)R);
    return bad == 0;
}

/* Per element: |got - ref| <= tol[i] (NaN fails). */
static bool cmp_vals(const char *what, const float *got, const float *ref, const double *tol, int64_t n,
                     row_desc_fn desc, const void *ctx)
{
    int64_t bad = 0;
    double worst = 0, worst_ratio = 0;
    int printed = 0;
    for (int64_t i = 0; i < n; i++) {
        double dd = fabs((double)got[i] - ref[i]);
        if (!(dd <= tol[i])) {
            bad++;
            if (printed < 6) {
                printed++;
                char d[200] = "";
                if (desc)
                    desc(ctx, i, d, sizeof d);
                fprintf(stderr, "    %s: [%lld]%s%s: gpu %.9g cpu %.9g (|diff| %.3g, tol %.3g)\n", what,
                        (long long)i, d[0] ? " " : "", d, (double)got[i], (double)ref[i], dd, tol[i]);
            }
        }
        if (dd > worst || !(dd == dd))
            worst = dd;
        if (tol[i] > 0 && dd / tol[i] > worst_ratio)
            worst_ratio = dd / tol[i];
    }
    printf("#   %-64s n %-8lld max |diff| %.3g (%.2f of tolerance)%s\n", what, (long long)n, worst,
           worst_ratio, bad ? "  FAIL" : "");
    T_CHECK(bad == 0, "%s: %lld of %lld values out of tolerance", what, (long long)bad, (long long)n);
    return bad == 0;
}

/* Byte images of two runs must agree (determinism). */
static bool cmp_same(const char *what, const uint8_t *a, const uint8_t *b, size_t n, size_t esize)
{
    for (size_t i = 0; i < n; i++)
        if (a[i] != b[i]) {
            size_t bad = 0;
            for (size_t j = i; j < n; j++)
                bad += a[j] != b[j];
            T_CHECK(0, "%s: two runs on the same inputs differ: first at byte %zu (element %zu), %zu "
                    "bytes differ", what, i, esize ? i / esize : i, bad);
            return false;
        }
    return true;
}

struct mode {
    dfl_be *be;
    dfl_dtype dt;
    const char *name;
    bool bf16;
};

static int modes(struct mode m[2])
{
    m[0] = (struct mode){g_bf, DFL_BF16, "bf16", true};
    m[1] = (struct mode){g_f32, DFL_F32, "f32", false};
    return 2;
}

#define NEED_GPU()                                                                           \
    do {                                                                                     \
        if (!g_bf)                                                                           \
            T_SKIP("no CUDA GPU");                                                           \
    } while (0)

static void check_rc(int rc, dfl_be *be, const char *what)
{
    dfl_err e = {0};
    if (rc) {
        be->ops->sync(be, &e);
        T_CHECK(rc == 0, "%s: rc %d (%s)", what, rc, e.msg);
    }
}

/* ------------------------------------------------------------------------------------------ */
/* rmsnorm_bwd */

/* " [form F]" while test_norm_bwd_forms runs the tests below under DFL_CUDA_NORM_BWD=F (0: the
 * first kernels) */
static char g_form_tag[16];

static void test_rmsnorm_bwd(void)
{
    NEED_GPU();
    static const int shapes[][2] = {{1, 64}, {3, 100}, {37, 4096}, {1000, 4096}, {17, 5000},
                                    {5, 7}, {300, 128}, {4, 12288}, {2049, 256}};
    static const char *vname[] = {"dx =, dw", "dx +=, dw", "in place dx = dy, dw", "dx +=, no dw"};
    struct mode md[2];
    int nm = modes(md);
    for (int k = 0; k < nm; k++)
        for (size_t s = 0; s < sizeof shapes / sizeof shapes[0]; s++)
            for (int v = 0; v < 4; v++) {
                dfl_be *be = md[k].be;
                const int64_t R = shapes[s][0], n = shapes[s][1];
                const size_t N = (size_t)(R * n);
                const bool acc = v == 1 || v == 3, inplace = v == 2, use_dw = v != 3;
                float *x = rnd(N, 1, 0, md[k].bf16), *w = rnd((size_t)n, 0.3f, 1, md[k].bf16);
                float *dy = rnd(N, 1, 0, md[k].bf16), *dx0 = rnd(N, 1, 0, md[k].bf16);
                float *dw0 = rnd((size_t)n, 0.1f, 0, false), *rstd = xmalloc((size_t)R * sizeof *rstd);
                for (int64_t r = 0; r < R; r++) {
                    float ss = 0;
                    for (int64_t i = 0; i < n; i++)
                        ss += x[r * n + i] * x[r * n + i];
                    rstd[r] = 1.0f / sqrtf(ss / (float)n + 1e-6f);
                }
                float *rdx = fdup(inplace ? dy : dx0, N), *rdw = fdup(dw0, (size_t)n);
                T_CHECK(g_cpu->ops->rmsnorm_bwd(g_cpu, rdx, use_dw ? rdw : NULL, inplace ? rdx : dy,
                                                x, w, rstd, R, n, acc) == 0, "cpu rmsnorm_bwd");
                char what[160];
                snprintf(what, sizeof what, "rmsnorm_bwd %s R%lld n%lld [%s]%s", md[k].name,
                         (long long)R, (long long)n, vname[v], g_form_tag);
                gbuf gx, gw, gdy, gdx, gdw, gr;
                bool ok = gb_alloc(&gx, be, N, md[k].dt) && gb_alloc(&gw, be, (size_t)n, md[k].dt) &&
                          gb_alloc(&gdy, be, N, md[k].dt) && gb_alloc(&gdx, be, N, md[k].dt) &&
                          gb_alloc(&gdw, be, (size_t)n, DFL_F32) && gb_alloc(&gr, be, (size_t)R, DFL_F32);
                if (ok) {
                    gb_set(&gx, x);
                    gb_set(&gw, w);
                    gb_set(&gr, rstd);
                    uint8_t *img[2][2] = {{0}};
                    for (int run = 0; run < 2; run++) {
                        gb_set(&gdy, dy);
                        gb_set(&gdx, dx0);
                        gb_set(&gdw, dw0);
                        gbuf *out = inplace ? &gdy : &gdx;
                        check_rc(be->ops->rmsnorm_bwd(be, out->p, use_dw ? (float *)gdw.p : NULL, gdy.p,
                                                      gx.p, gw.p, (const float *)gr.p, R, n, acc),
                                 be, what);
                        sync_ok(be, what);
                        img[run][0] = gb_image(out);
                        img[run][1] = gb_image(&gdw);
                        if (run == 0) {
                            float *got = xmalloc(N * sizeof *got), *gdwv = xmalloc((size_t)n * sizeof *gdwv);
                            gb_get(out, got);
                            gb_get(&gdw, gdwv);
                            cmp_rows(what, got, n, rdx, n, R, n, md[k].bf16 ? 8e-3 : 2e-5,
                                     md[k].bf16 ? 0.99995 : 0.9999999);
                            char w2[200];
                            snprintf(w2, sizeof w2, "%s: dw", what);
                            cmp_rows(w2, gdwv, n, use_dw ? rdw : dw0, n, 1, n, 2e-5, 0.9999999);
                            free(got);
                            free(gdwv);
                        }
                    }
                    cmp_same(what, img[0][0], img[1][0], gdx.bytes, dfl_dtype_size(md[k].dt));
                    cmp_same(what, img[0][1], img[1][1], gdw.bytes, 4);
                    for (int i = 0; i < 2; i++)
                        for (int j = 0; j < 2; j++)
                            free(img[i][j]);
                    /* inputs unchanged */
                    float *chk = xmalloc(N * sizeof *chk);
                    gb_get(&gx, chk);
                    cmp_bytes("rmsnorm_bwd: x changed", (uint8_t *)chk, (uint8_t *)x, N * 4);
                    if (!inplace) {
                        gb_get(&gdy, chk);
                        cmp_bytes("rmsnorm_bwd: dy changed", (uint8_t *)chk, (uint8_t *)dy, N * 4);
                    }
                    free(chk);
                    gb_check_guards(&gx, what);
                    gb_check_guards(&gdy, what);
                    gb_check_guards(&gdx, what);
                    gb_check_guards(&gdw, what);
                }
                gb_free(&gx);
                gb_free(&gw);
                gb_free(&gdy);
                gb_free(&gdx);
                gb_free(&gdw);
                gb_free(&gr);
                free(x);
                free(w);
                free(dy);
                free(dx0);
                free(dw0);
                free(rstd);
                free(rdx);
                free(rdw);
            }
}

/* ------------------------------------------------------------------------------------------ */
/* the norms' backward kernels: the faster kernels (the default) against the first ones
 * (DFL_CUDA_NORM_BWD=0), at the drafter's shapes and odd ones: within the CPU comparison's
 * tolerances (and the same bytes on a second run); how many values differ from the first
 * kernels' is printed (the faster kernels add in the first ones' order, but the compiler may
 * fuse a multiply and an add differently, and qknorm_rope_bwd_row_kernel adds dw in another
 * order). On the H200, dx and dw of rmsnorm_bwd and dx of qknorm_rope_bwd came out the same bits
 * in every bf16 case. */

static const char *const norm_forms[] = {"0", "1"};   /* the first kernels, the default */

/* runs op under each form on the same uploaded inputs (reset() restores the outputs) and
 * compares the default's out and dw with the first kernels': rows of `cols` values at stride ld
 * in out */
static void forms_same(const char *what, gbuf *out, gbuf *dw, int64_t rows, int64_t cols, int64_t ld,
                       void (*reset)(void *), int (*op)(void *), void *arg)
{
    float *ref = NULL, *refw = NULL;
    const bool bf = out->dt == DFL_BF16;
    for (size_t f = 0; f < sizeof norm_forms / sizeof norm_forms[0]; f++) {
        setenv("DFL_CUDA_NORM_BWD", norm_forms[f], 1);
        uint8_t *img[2][2];
        for (int run = 0; run < 2; run++) {
            reset(arg);
            check_rc(op(arg), out->be, what);
            sync_ok(out->be, what);
            img[run][0] = gb_image(out);
            img[run][1] = gb_image(dw);
        }
        char w2[240];
        snprintf(w2, sizeof w2, "%s [form %s]", what, norm_forms[f]);
        cmp_same(w2, img[0][0], img[1][0], out->bytes, dfl_dtype_size(out->dt));
        cmp_same(w2, img[0][1], img[1][1], dw->bytes, 4);
        float *got = xmalloc(out->n * sizeof *got), *gotw = xmalloc(dw->n * sizeof *gotw);
        gb_get(out, got);
        gb_get(dw, gotw);
        if (f == 0) {
            ref = got;
            refw = gotw;
        } else {
            size_t dx = 0, dwd = 0;
            for (size_t i = 0; i < out->n; i++)
                dx += memcmp(got + i, ref + i, 4) != 0;
            for (size_t i = 0; i < dw->n; i++)
                dwd += memcmp(gotw + i, refw + i, 4) != 0;
            printf("#   %-64s %zu of %zu dx and %zu of %zu dw values differ from the first kernels'\n", what,
                   dx, out->n, dwd, dw->n);
            cmp_rows(w2, got, ld, ref, ld, rows, cols, bf ? 8e-3 : 2e-5, bf ? 0.99995 : 0.9999999);
            snprintf(w2, sizeof w2, "%s [form %s]: dw", what, norm_forms[f]);
            cmp_rows(w2, gotw, dw->n, refw, dw->n, 1, (int64_t)dw->n, 2e-5, 0.9999999);
            free(got);
            free(gotw);
        }
        for (int run = 0; run < 2; run++)
            free(img[run][0]), free(img[run][1]);
    }
    unsetenv("DFL_CUDA_NORM_BWD");
    free(ref);
    free(refw);
}

struct nf_case {
    dfl_be *be;
    gbuf gx, gw, gdy, gdx, gdw, gr, gp;
    const float *dx0, *dy, *dw0;
    int64_t R, n, ld;
    int heads, d;
    bool acc, inplace, use_w, use_rstd;
};

static void nf_reset(void *arg)
{
    struct nf_case *c = arg;
    gb_set(&c->gdx, c->dx0);
    if (c->dy)
        gb_set(&c->gdy, c->dy);
    gb_set(&c->gdw, c->dw0);
}

static int nf_rms(void *arg)
{
    struct nf_case *c = arg;
    return c->be->ops->rmsnorm_bwd(c->be, c->inplace ? c->gdy.p : c->gdx.p, (float *)c->gdw.p, c->gdy.p, c->gx.p,
                                   c->gw.p, (const float *)c->gr.p, c->R, c->n, c->acc);
}

static int nf_qk(void *arg)
{
    struct nf_case *c = arg;
    return c->be->ops->qknorm_rope_bwd(c->be, c->gdx.p, c->ld, (float *)c->gdw.p, c->gx.p, c->use_w ? c->gw.p : NULL,
                                       c->use_rstd ? (const float *)c->gr.p : NULL, (const int32_t *)c->gp.p, c->R,
                                       c->heads, c->d, 1e-6f, 1e6f);
}

static void test_qknorm_rope_bwd(void);

static void test_norm_bwd_forms(void)
{
    NEED_GPU();
    /* the CPU comparisons of rmsnorm_bwd and qknorm_rope_bwd with the first kernels too */
    for (size_t f = 0; f < sizeof norm_forms / sizeof norm_forms[0]; f++) {
        setenv("DFL_CUDA_NORM_BWD", norm_forms[f], 1);
        snprintf(g_form_tag, sizeof g_form_tag, " [form %s]", norm_forms[f]);
        test_rmsnorm_bwd();
        test_qknorm_rope_bwd();
    }
    unsetenv("DFL_CUDA_NORM_BWD");
    g_form_tag[0] = 0;
    struct mode md[2];
    int nm = modes(md);
    static const int rms[][4] = {/* R, n, acc, in place */
                                 {2048, 4096, 1, 0}, {1000, 5120, 0, 0}, {37, 4096, 0, 1}, {300, 1000, 1, 0}, {5, 7, 1, 0}};
    static const int qk[][6] = {/* R, heads, d, pad, w, rstd */
                                {8192, 32, 128, 0, 1, 1}, {11264, 8, 128, 0, 1, 1}, {300, 32, 128, 0, 1, 0},
                                {37, 8, 128, 8, 1, 0},    {11, 4, 128, 0, 0, 0},   {64, 8, 256, 0, 1, 1}};
    for (int k = 0; k < nm; k++) {
        for (size_t i = 0; i < sizeof rms / sizeof rms[0]; i++) {
            struct nf_case c = {.be = md[k].be, .R = rms[i][0], .n = rms[i][1], .acc = rms[i][2], .inplace = rms[i][3]};
            const size_t N = (size_t)(c.R * c.n);
            float *x = rnd(N, 1, 0, md[k].bf16), *w = rnd((size_t)c.n, 0.3f, 1, md[k].bf16);
            float *dy = rnd(N, 1, 0, md[k].bf16), *dx0 = rnd(N, 1, 0, md[k].bf16);
            float *dw0 = rnd((size_t)c.n, 0.1f, 0, false), *rstd = rnd((size_t)c.R, 0.2f, 1, false);
            c.dx0 = c.inplace ? dy : dx0;
            c.dy = dy;
            c.dw0 = dw0;
            char what[160];
            snprintf(what, sizeof what, "rmsnorm_bwd forms %s R%lld n%lld%s%s", md[k].name, (long long)c.R,
                     (long long)c.n, c.acc ? " acc" : "", c.inplace ? " in place" : "");
            if (gb_alloc(&c.gx, c.be, N, md[k].dt) && gb_alloc(&c.gw, c.be, (size_t)c.n, md[k].dt) &&
                gb_alloc(&c.gdy, c.be, N, md[k].dt) && gb_alloc(&c.gdx, c.be, N, md[k].dt) &&
                gb_alloc(&c.gdw, c.be, (size_t)c.n, DFL_F32) && gb_alloc(&c.gr, c.be, (size_t)c.R, DFL_F32)) {
                gb_set(&c.gx, x);
                gb_set(&c.gw, w);
                gb_set(&c.gr, rstd);
                forms_same(what, c.inplace ? &c.gdy : &c.gdx, &c.gdw, c.R, c.n, c.n, nf_reset, nf_rms, &c);
            }
            gb_free(&c.gx), gb_free(&c.gw), gb_free(&c.gdy), gb_free(&c.gdx), gb_free(&c.gdw), gb_free(&c.gr);
            free(x), free(w), free(dy), free(dx0), free(dw0), free(rstd);
        }
        for (size_t i = 0; i < sizeof qk / sizeof qk[0]; i++) {
            struct nf_case c = {.be = md[k].be, .R = qk[i][0], .heads = qk[i][1], .d = qk[i][2],
                                .use_w = qk[i][4], .use_rstd = qk[i][5]};
            c.ld = (int64_t)c.heads * c.d + qk[i][3];
            const size_t N = (size_t)(c.R * c.ld);
            float *x = rnd(N, 1, 0, md[k].bf16), *w = rnd((size_t)c.d, 0.3f, 1, md[k].bf16);
            float *dx0 = rnd(N, 1, 0, md[k].bf16), *dw0 = rnd((size_t)c.d, 0.1f, 0, false);
            float *rstd = rnd((size_t)(c.R * c.heads), 0.2f, 1, false);
            int32_t *pos = xmalloc((size_t)c.R * sizeof *pos);
            for (int64_t r = 0; r < c.R; r++)
                pos[r] = rng_int(0, 40000);
            c.dx0 = dx0;
            c.dw0 = dw0;
            char what[160];
            snprintf(what, sizeof what, "qknorm_rope_bwd forms %s R%lld h%d d%d ld%lld%s%s", md[k].name,
                     (long long)c.R, c.heads, c.d, (long long)c.ld, c.use_w ? "" : " no-w",
                     c.use_rstd ? " rstd" : " recompute");
            if (gb_alloc(&c.gx, c.be, N, md[k].dt) && gb_alloc(&c.gw, c.be, (size_t)c.d, md[k].dt) &&
                gb_alloc(&c.gdx, c.be, N, md[k].dt) && gb_alloc(&c.gdw, c.be, (size_t)c.d, DFL_F32) &&
                gb_alloc(&c.gr, c.be, (size_t)(c.R * c.heads), DFL_F32) && gb_alloc(&c.gp, c.be, (size_t)c.R, DFL_I32)) {
                gb_set(&c.gx, x);
                gb_set(&c.gw, w);
                gb_set(&c.gr, rstd);
                gb_set_raw(&c.gp, pos);
                forms_same(what, &c.gdx, &c.gdw, c.R, (int64_t)c.heads * c.d, c.ld, nf_reset, nf_qk, &c);
            }
            gb_free(&c.gx), gb_free(&c.gw), gb_free(&c.gdx), gb_free(&c.gdw), gb_free(&c.gr), gb_free(&c.gp);
            free(x), free(w), free(dx0), free(dw0), free(rstd), free(pos);
        }
    }
}

/* ------------------------------------------------------------------------------------------ */
/* qknorm_rope_bwd */

struct qk_case {
    int R, heads, d, ld_pad;
    bool w, rstd;
    float theta;
};

static void test_qknorm_rope_bwd(void)
{
    NEED_GPU();
    static const struct qk_case cases[] = {
        {5, 4, 128, 0, true, true, 1e6f},     {37, 8, 128, 8, true, false, 1e6f},
        {1000, 32, 128, 0, true, true, 1e6f}, {300, 2, 64, 0, true, true, 1e4f},
        {17, 3, 32, 2, true, false, 1e6f},    {7, 2, 512, 0, true, true, 1e6f},
        {9, 4, 6, 1, true, true, 1e6f},       {11, 4, 128, 0, false, false, 1e6f},
        {64, 8, 256, 0, true, false, 5e5f},   {3000, 8, 128, 0, true, true, 1e6f},
    };
    struct mode md[2];
    int nm = modes(md);
    for (int k = 0; k < nm; k++)
        for (size_t ci = 0; ci < sizeof cases / sizeof cases[0]; ci++) {
            const struct qk_case *c = &cases[ci];
            dfl_be *be = md[k].be;
            const int64_t R = c->R, d = c->d, ld = (int64_t)c->heads * d + c->ld_pad;
            const size_t N = (size_t)(R * ld);
            const float eps = 1e-6f;
            float *xin = rnd(N, 1, 0, md[k].bf16), *dx = rnd(N, 1, 0, md[k].bf16);
            float *w = rnd((size_t)d, 0.3f, 1, md[k].bf16), *dw0 = rnd((size_t)d, 0.1f, 0, false);
            float *rstd = xmalloc((size_t)(R * c->heads) * sizeof *rstd);
            int32_t *pos = xmalloc((size_t)R * sizeof *pos);
            for (int64_t r = 0; r < R; r++) {
                pos[r] = rng_int(0, 5000);
                for (int h = 0; h < c->heads; h++) {
                    float ss = 0;
                    for (int64_t i = 0; i < d; i++) {
                        float v = xin[r * ld + h * d + i];
                        ss += v * v;
                    }
                    rstd[r * c->heads + h] = 1.0f / sqrtf(ss / (float)d + eps);
                }
            }
            float *rdx = fdup(dx, N), *rdw = fdup(dw0, (size_t)d);
            T_CHECK(g_cpu->ops->qknorm_rope_bwd(g_cpu, rdx, ld, rdw, xin, c->w ? w : NULL,
                                                c->rstd ? rstd : NULL, pos, R, c->heads, (int)d, eps,
                                                c->theta) == 0, "cpu qknorm_rope_bwd");
            char what[160];
            snprintf(what, sizeof what, "qknorm_rope_bwd %s R%d h%d d%d ld%lld%s%s theta %g%s", md[k].name,
                     c->R, c->heads, c->d, (long long)ld, c->w ? "" : " no-w",
                     c->rstd ? " rstd" : " recompute", (double)c->theta, g_form_tag);
            gbuf gx, gdx, gw, gdw, gr, gp;
            bool ok = gb_alloc(&gx, be, N, md[k].dt) && gb_alloc(&gdx, be, N, md[k].dt) &&
                      gb_alloc(&gw, be, (size_t)d, md[k].dt) && gb_alloc(&gdw, be, (size_t)d, DFL_F32) &&
                      gb_alloc(&gr, be, (size_t)(R * c->heads), DFL_F32) &&
                      gb_alloc(&gp, be, (size_t)R, DFL_I32);
            if (ok) {
                gb_set(&gx, xin);
                gb_set(&gw, w);
                gb_set(&gr, rstd);
                gb_set_raw(&gp, pos);
                uint8_t *img[2][2] = {{0}};
                for (int run = 0; run < 2; run++) {
                    gb_set(&gdx, dx);
                    gb_set(&gdw, dw0);
                    check_rc(be->ops->qknorm_rope_bwd(be, gdx.p, ld, (float *)gdw.p, gx.p, c->w ? gw.p : NULL,
                                                      c->rstd ? (const float *)gr.p : NULL,
                                                      (const int32_t *)gp.p, R, c->heads, (int)d, eps,
                                                      c->theta), be, what);
                    sync_ok(be, what);
                    img[run][0] = gb_image(&gdx);
                    img[run][1] = gb_image(&gdw);
                    if (run == 0) {
                        float *got = xmalloc(N * sizeof *got), *gw2 = xmalloc((size_t)d * sizeof *gw2);
                        gb_get(&gdx, got);
                        gb_get(&gdw, gw2);
                        cmp_rows(what, got, ld, rdx, ld, R, (int64_t)c->heads * d,
                                 md[k].bf16 ? 8e-3 : 2e-5, md[k].bf16 ? 0.99995 : 0.9999999);
                        /* padding columns keep the uploaded values */
                        for (int64_t r = 0; r < R && c->ld_pad; r++)
                            if (!cmp_bytes("qknorm_rope_bwd: padding columns changed",
                                           (uint8_t *)(got + r * ld + c->heads * d),
                                           (uint8_t *)(dx + r * ld + c->heads * d), (size_t)c->ld_pad * 4))
                                break;
                        char w2[200];
                        snprintf(w2, sizeof w2, "%s: dw", what);
                        cmp_rows(w2, gw2, d, rdw, d, 1, d, 2e-5, 0.9999999);
                        free(got);
                        free(gw2);
                    }
                }
                cmp_same(what, img[0][0], img[1][0], gdx.bytes, dfl_dtype_size(md[k].dt));
                cmp_same(what, img[0][1], img[1][1], gdw.bytes, 4);
                for (int i = 0; i < 2; i++)
                    for (int j = 0; j < 2; j++)
                        free(img[i][j]);
                float *chk = xmalloc(N * sizeof *chk);
                gb_get(&gx, chk);
                cmp_bytes("qknorm_rope_bwd: x_in changed", (uint8_t *)chk, (uint8_t *)xin, N * 4);
                free(chk);
                gb_check_guards(&gdx, what);
                gb_check_guards(&gdw, what);
                gb_check_guards(&gx, what);
            }
            gb_free(&gx);
            gb_free(&gdx);
            gb_free(&gw);
            gb_free(&gdw);
            gb_free(&gr);
            gb_free(&gp);
            free(xin);
            free(dx);
            free(w);
            free(dw0);
            free(rstd);
            free(pos);
            free(rdx);
            free(rdw);
        }
}

/* ------------------------------------------------------------------------------------------ */
/* swiglu_bwd */

static void test_swiglu_bwd(void)
{
    NEED_GPU();
    static const int shapes[][2] = {{1, 64}, {17, 99}, {1000, 1536}, {3, 12288}, {2, 5}, {256, 12288}};
    struct mode md[2];
    int nm = modes(md);
    for (int k = 0; k < nm; k++)
        for (size_t s = 0; s < sizeof shapes / sizeof shapes[0]; s++) {
            dfl_be *be = md[k].be;
            const int64_t R = shapes[s][0], I = shapes[s][1];
            float *gu = rnd((size_t)(R * 2 * I), 2, 0, md[k].bf16), *dout = rnd((size_t)(R * I), 1, 0, md[k].bf16);
            float *ref = xmalloc((size_t)(R * 2 * I) * sizeof *ref);
            T_CHECK(g_cpu->ops->swiglu_bwd(g_cpu, ref, dout, gu, R, I) == 0, "cpu swiglu_bwd");
            char what[120];
            snprintf(what, sizeof what, "swiglu_bwd %s R%lld I%lld", md[k].name, (long long)R, (long long)I);
            gbuf ggu, gdo, gdgu;
            if (gb_alloc(&ggu, be, (size_t)(R * 2 * I), md[k].dt) && gb_alloc(&gdo, be, (size_t)(R * I), md[k].dt) &&
                gb_alloc(&gdgu, be, (size_t)(R * 2 * I), md[k].dt)) {
                gb_set(&ggu, gu);
                gb_set(&gdo, dout);
                uint8_t *img[2];
                for (int run = 0; run < 2; run++) {
                    check_rc(be->ops->swiglu_bwd(be, gdgu.p, gdo.p, ggu.p, R, I), be, what);
                    sync_ok(be, what);
                    img[run] = gb_image(&gdgu);
                }
                float *got = xmalloc((size_t)(R * 2 * I) * sizeof *got);
                gb_get(&gdgu, got);
                cmp_rows(what, got, 2 * I, ref, 2 * I, R, 2 * I, md[k].bf16 ? 8e-3 : 2e-5,
                         md[k].bf16 ? 0.99995 : 0.9999999);
                cmp_same(what, img[0], img[1], gdgu.bytes, dfl_dtype_size(md[k].dt));
                free(img[0]);
                free(img[1]);
                free(got);
                gb_check_guards(&gdgu, what);
                gb_check_guards(&ggu, what);
            }
            gb_free(&ggu);
            gb_free(&gdo);
            gb_free(&gdgu);
            free(gu);
            free(dout);
            free(ref);
        }
}

/* ------------------------------------------------------------------------------------------ */
/* DFlash attention */

enum { AN_RANDOM, AN_ZERO, AN_END, AN_UNSORTED, AN_GOLDEN, AN_DENSE };

struct df_case {
    const char *name;
    int nh, nkv, d, bs;
    int nseq;
    int lens[8];
    int nanch[8];   /* anchors per sequence (0: a sequence without blocks) */
    int amode;
    float qscale;
    int window;     /* sliding window (0: full attention) */
};

/* a packed batch: blocks ordered by sequence, ctx_start = the sequence's first row */
struct df_batch {
    const struct df_case *c;
    int64_t T, Q;
    int n_blocks;
    int32_t *cs, *an;
    int *bseq;                 /* block -> sequence */
    int64_t *seq_start;
};

static int cmp_i32(const void *a, const void *b)
{
    int32_t x = *(const int32_t *)a, y = *(const int32_t *)b;
    return (x > y) - (x < y);
}

static void df_batch_make(struct df_batch *bt, const struct df_case *c)
{
    memset(bt, 0, sizeof *bt);
    bt->c = c;
    int nb = 0;
    for (int s = 0; s < c->nseq; s++) {
        bt->T += c->lens[s];
        nb += c->nanch[s];
    }
    bt->n_blocks = nb;
    bt->Q = (int64_t)nb * c->bs;
    bt->cs = xmalloc((size_t)(nb + 1) * sizeof *bt->cs);
    bt->an = xmalloc((size_t)(nb + 1) * sizeof *bt->an);
    bt->bseq = xmalloc((size_t)(nb + 1) * sizeof *bt->bseq);
    bt->seq_start = xmalloc((size_t)(c->nseq + 1) * sizeof *bt->seq_start);
    int64_t start = 0;
    int b = 0;
    for (int s = 0; s < c->nseq; s++) {
        const int L = c->lens[s], n = c->nanch[s];
        bt->seq_start[s] = start;
        int32_t *a = bt->an + b;
        for (int i = 0; i < n; i++) {
            switch (c->amode) {
            case AN_ZERO: a[i] = 0; break;
            case AN_END: a[i] = L - 1 - (i % 2); break;                 /* L-1 and L-2 */
            case AN_GOLDEN: a[i] = i * 3 < L - 1 ? i * 3 : L - 2; break;
            case AN_DENSE: a[i] = i % (L - 1); break;
            default: a[i] = rng_int(0, L - 2); break;
            }
            if (a[i] < 0)
                a[i] = 0;
        }
        if (c->amode == AN_RANDOM || c->amode == AN_GOLDEN || c->amode == AN_DENSE)
            qsort(a, (size_t)n, sizeof *a, cmp_i32);
        for (int i = 0; i < n; i++) {
            bt->cs[b] = (int32_t)start;
            bt->bseq[b] = s;
            b++;
        }
        start += L;
    }
    bt->seq_start[c->nseq] = start;
}

static void df_batch_free(struct df_batch *bt)
{
    free(bt->cs);
    free(bt->an);
    free(bt->bseq);
    free(bt->seq_start);
}

/* row descriptions for failure reports */
struct qdesc { const struct df_batch *bt; int nh; };

static void desc_qrow(const void *ctx, int64_t r, char *buf, size_t n)
{
    const struct qdesc *q = ctx;
    const int bs = q->bt->c->bs;
    int64_t qr = r / q->nh;
    int h = (int)(r % q->nh);
    int64_t b = qr / bs;
    snprintf(buf, n, "(block %lld slot %lld head %d kv %d; seq %d anchor %d)", (long long)b,
             (long long)(qr % bs), h, h / (q->nh / q->bt->c->nkv), q->bt->bseq[b], q->bt->an[b]);
}

static void desc_kblk(const void *ctx, int64_t r, char *buf, size_t n)
{
    const struct qdesc *q = ctx;
    const int bs = q->bt->c->bs, nkv = q->bt->c->nkv;
    int64_t kr = r / nkv;
    int64_t b = kr / bs;
    snprintf(buf, n, "(block key row %lld: block %lld key %lld, kv head %d; anchor %d)", (long long)kr,
             (long long)b, (long long)(kr % bs), (int)(r % nkv), q->bt->an[b]);
}

static void desc_kctx(const void *ctx, int64_t r, char *buf, size_t n)
{
    const struct qdesc *q = ctx;
    const struct df_batch *bt = q->bt;
    const int nkv = bt->c->nkv;
    int64_t c = r / nkv;
    int s = 0;
    while (s + 1 < bt->c->nseq && bt->seq_start[s + 1] <= c)
        s++;
    int seen = 0;
    for (int b = 0; b < bt->n_blocks; b++)
        seen += bt->bseq[b] == s && c < bt->seq_start[s] + bt->an[b];
    snprintf(buf, n, "(context row %lld: seq %d pos %lld, kv head %d; seen by %d blocks)", (long long)c,
             s, (long long)(c - bt->seq_start[s]), (int)(r % nkv), seen);
}

struct df_host {
    float *q, *kc, *vc, *kb, *vb, *dout;
    float *o, *lse;                     /* CPU forward (o rounded to the act type) */
    float *dq, *dkc, *dvc, *dkb, *dvb, *delta;
    double *mdq, *mdkc, *mdvc, *mdkb, *mdvb;   /* df_cond */
};

static double vnorm(const float *x, int n)
{
    double s = 0;
    for (int i = 0; i < n; i++)
        s += (double)x[i] * x[i];
    return sqrt(s);
}

/* Per gradient row, M = the sum of the sizes of the terms that make it up:
 * dq[q]: scale sum_k P (|dP| + |delta|) |k|, dk[k]: scale sum_q P (|dP| + |delta|) |q|,
 * dv[k]: sum_q P |dout_q|. (f32 rounding of dS = P (dP - delta) is ~1e-7 of P (|dP| + |delta|).) */
static void df_cond(const struct df_batch *bt, struct df_host *h, float scale)
{
    const struct df_case *c = bt->c;
    const int d = c->d, nh = c->nh, nkv = c->nkv, group = nh / nkv, bs = c->bs;
    const int64_t nq = (int64_t)nh * d, nk = (int64_t)nkv * d, Q = bt->Q, T = bt->T;
    h->mdq = calloc((size_t)(Q * nh + 1), sizeof(double));
    h->mdkc = calloc((size_t)(T * nkv + 1), sizeof(double));
    h->mdvc = calloc((size_t)(T * nkv + 1), sizeof(double));
    h->mdkb = calloc((size_t)(Q * nkv + 1), sizeof(double));
    h->mdvb = calloc((size_t)(Q * nkv + 1), sizeof(double));
    for (int b = 0; b < bt->n_blocks; b++)
        for (int hh = 0; hh < nh; hh++)
            for (int j = 0; j < bs; j++) {
                const int64_t qr = (int64_t)b * bs + j, g = hh / group;
                const float *qv = h->q + qr * nq + (int64_t)hh * d, *dov = h->dout + qr * nq + (int64_t)hh * d;
                const float *ov = h->o + qr * nq + (int64_t)hh * d;
                const double L = h->lse[qr * nh + hh];
                const double nqv = vnorm(qv, d), ndo = vnorm(dov, d);
                double dabs = 0;   /* delta = dO . O: the size of its terms, not of the sum */
                for (int i = 0; i < d; i++)
                    dabs += fabs((double)dov[i] * ov[i]);
                const int64_t nkeys = (int64_t)bt->an[b] + bs;
                for (int64_t t = 0; t < nkeys; t++) {
                    const bool ctx = t < bt->an[b];
                    if (c->window > 0 && (ctx ? t < (int64_t)bt->an[b] + j - (c->window - 1)
                                              : t - bt->an[b] > j))
                        continue;   /* outside the sliding window */
                    const int64_t krow = ctx ? bt->cs[b] + t : (int64_t)b * bs + (t - bt->an[b]);
                    const float *kv = (ctx ? h->kc : h->kb) + krow * nk + g * d;
                    const float *vv = (ctx ? h->vc : h->vb) + krow * nk + g * d;
                    double sdot = 0, pabs = 0;
                    for (int i = 0; i < d; i++) {
                        sdot += (double)qv[i] * kv[i];
                        pabs += fabs((double)dov[i] * vv[i]);
                    }
                    /* dS = P (dP - delta): both dot products are summed in f32 by the kernels and
                     * by the CPU, so their error scales with the magnitudes of their terms (pabs,
                     * dabs), which can be far above |dP| and |delta| when either sum cancels. */
                    const double P = exp(sdot * scale - L);
                    const double w = P * (pabs + dabs) * scale;
                    h->mdq[qr * nh + hh] += w * vnorm(kv, d);
                    double *mk = ctx ? h->mdkc : h->mdkb, *mv = ctx ? h->mdvc : h->mdvb;
                    mk[krow * nkv + g] += w * nqv;
                    mv[krow * nkv + g] += P * ndo;
                }
            }
}

static void df_host_free(struct df_host *h)
{
    free(h->q);
    free(h->kc);
    free(h->vc);
    free(h->kb);
    free(h->vb);
    free(h->dout);
    free(h->o);
    free(h->lse);
    free(h->dq);
    free(h->dkc);
    free(h->dvc);
    free(h->dkb);
    free(h->dvb);
    free(h->delta);
    free(h->mdq);
    free(h->mdkc);
    free(h->mdvc);
    free(h->mdkb);
    free(h->mdvb);
}

struct df_dev {
    gbuf q, kc, vc, kb, vb, o, lse, cs, an, dout, delta, dq, dkc, dvc, dkb, dvb;
};

static gbuf *df_dev_list(struct df_dev *g, int i)
{
    gbuf *l[] = {&g->q, &g->kc, &g->vc, &g->kb, &g->vb, &g->o, &g->lse, &g->cs, &g->an, &g->dout,
                 &g->delta, &g->dq, &g->dkc, &g->dvc, &g->dkb, &g->dvb};
    return i < (int)(sizeof l / sizeof l[0]) ? l[i] : NULL;
}

static void df_dev_free(struct df_dev *g)
{
    for (int i = 0; df_dev_list(g, i); i++)
        gb_free(df_dev_list(g, i));
}

static void df_dev_guards(struct df_dev *g, const char *what)
{
    for (int i = 0; df_dev_list(g, i); i++)
        if (df_dev_list(g, i)->base)
            gb_check_guards(df_dev_list(g, i), what);
}

static dfl_dflash_attn df_args(const struct df_batch *bt, float scale)
{
    const struct df_case *c = bt->c;
    dfl_dflash_attn a = {
        .n_blocks = bt->n_blocks, .bs = c->bs, .max_anchor = (int32_t)bt->T, .T_ctx = bt->T,
        .n_heads = c->nh, .n_kv = c->nkv, .d = c->d, .scale = scale, .window = c->window,
    };
    return a;
}

static dfl_dflash_attn df_dev_args(const struct df_batch *bt, struct df_dev *g, float scale)
{
    dfl_dflash_attn a = df_args(bt, scale);
    a.q = g->q.p;
    a.k_ctx = g->kc.p;
    a.v_ctx = g->vc.p;
    a.k_blk = g->kb.p;
    a.v_blk = g->vb.p;
    a.o = g->o.p;
    a.lse = (float *)g->lse.p;
    a.ctx_start = (const int32_t *)g->cs.p;
    a.anchor = (const int32_t *)g->an.p;
    a.ctx_start_host = bt->cs;   /* the backward may keep dS (dfl_cuda_dflash_bwd_ds) */
    a.anchor_host = bt->an;
    a.dout = g->dout.p;
    a.delta = (float *)g->delta.p;
    a.dq = g->dq.p;
    a.dk_ctx = g->dkc.p;
    a.dv_ctx = g->dvc.p;
    a.dk_blk = g->dkb.p;
    a.dv_blk = g->dvb.p;
    return a;
}

/* Output buffers back to NaN bytes. */
static void gb_nan(gbuf *b)
{
    uint8_t *h = xmalloc(b->bytes);
    memset(h, 0xFF, b->bytes);
    gb_set_raw(b, h);
    free(h);
}

struct df_outs {
    float *o, *lse, *dq, *dkc, *dvc, *dkb, *dvb, *delta;
};

/* One GPU configuration of a case: forward, then backward from the CPU's o and lse. The first
 * run's outputs go to out (f32), the bytes of both runs are compared. */
static void df_run(const struct df_batch *bt, const struct df_host *h, struct mode *md, const char *label,
                   bool det)
{
    const struct df_case *c = bt->c;
    dfl_be *be = md->be;
    const int64_t T = bt->T, Q = bt->Q, nq = (int64_t)c->nh * c->d, nk = (int64_t)c->nkv * c->d;
    const float scale = 1.0f / sqrtf((float)c->d);
    struct df_dev g;
    memset(&g, 0, sizeof g);
    const dfl_dtype dt = md->dt;
    bool ok = gb_alloc(&g.q, be, (size_t)(Q * nq), dt) && gb_alloc(&g.kc, be, (size_t)(T * nk), dt) &&
              gb_alloc(&g.vc, be, (size_t)(T * nk), dt) && gb_alloc(&g.kb, be, (size_t)(Q * nk), dt) &&
              gb_alloc(&g.vb, be, (size_t)(Q * nk), dt) && gb_alloc(&g.o, be, (size_t)(Q * nq), dt) &&
              gb_alloc(&g.lse, be, (size_t)(Q * c->nh), DFL_F32) &&
              gb_alloc(&g.cs, be, (size_t)bt->n_blocks + 1, DFL_I32) &&
              gb_alloc(&g.an, be, (size_t)bt->n_blocks + 1, DFL_I32) &&
              gb_alloc(&g.dout, be, (size_t)(Q * nq), dt) &&
              gb_alloc(&g.delta, be, (size_t)(Q * c->nh), DFL_F32) &&
              gb_alloc(&g.dq, be, (size_t)(Q * nq), dt) && gb_alloc(&g.dkc, be, (size_t)(T * nk), dt) &&
              gb_alloc(&g.dvc, be, (size_t)(T * nk), dt) && gb_alloc(&g.dkb, be, (size_t)(Q * nk), dt) &&
              gb_alloc(&g.dvb, be, (size_t)(Q * nk), dt);
    if (!ok) {
        df_dev_free(&g);
        return;
    }
    gb_set(&g.q, h->q);
    gb_set(&g.kc, h->kc);
    gb_set(&g.vc, h->vc);
    gb_set(&g.kb, h->kb);
    gb_set(&g.vb, h->vb);
    gb_set(&g.dout, h->dout);
    if (bt->n_blocks) {
        T_CHECK(be->ops->upload(be, g.cs.p, bt->cs, (size_t)bt->n_blocks * 4) == 0, "upload");
        T_CHECK(be->ops->upload(be, g.an.p, bt->an, (size_t)bt->n_blocks * 4) == 0, "upload");
    }
    uint8_t *qimg = gb_image(&g.q), *kimg = gb_image(&g.kc), *vimg = gb_image(&g.vb);
    dfl_dflash_attn a = df_dev_args(bt, &g, scale);
    const bool bf = md->bf16;
    struct qdesc qd = {bt, c->nh}, kd = {bt, c->nkv};
    char what[240];

    /* forward */
    uint8_t *fimg[2][2] = {{0}};
    for (int run = 0; run < (det ? 2 : 1); run++) {
        gb_nan(&g.o);
        gb_nan(&g.lse);
        snprintf(what, sizeof what, "dflash_attn %s %s [%s]", md->name, c->name, label);
        check_rc(be->ops->dflash_attn(be, &a), be, what);
        sync_ok(be, what);
        fimg[run][0] = gb_image(&g.o);
        fimg[run][1] = gb_image(&g.lse);
        if (run == 0 && Q > 0) {
            float *go = xmalloc((size_t)(Q * nq) * sizeof *go), *gl = xmalloc((size_t)(Q * c->nh) * sizeof *gl);
            gb_get(&g.o, go);
            gb_get(&g.lse, gl);
            char w2[260];
            snprintf(w2, sizeof w2, "%s: o", what);
            gpu_cmp_rows(w2, go, c->d, h->o, c->d, Q * c->nh, c->d, bf ? 1e-2 : 5e-5,
                         bf ? 0.9999 : 0.999999, desc_qrow, &qd, true);
            snprintf(w2, sizeof w2, "%s: lse", what);
            double *tol = xmalloc((size_t)(Q * c->nh) * sizeof *tol);
            for (int64_t i = 0; i < Q * c->nh; i++)
                tol[i] = (bf ? 1e-4 : 2e-5) * (1.0 + fabs((double)h->lse[i]));
            cmp_vals(w2, gl, h->lse, tol, Q * c->nh, desc_qrow, &qd);
            free(tol);
            free(go);
            free(gl);
        }
    }
    if (det) {
        cmp_same("dflash_attn: o", fimg[0][0], fimg[1][0], g.o.bytes, dfl_dtype_size(dt));
        cmp_same("dflash_attn: lse", fimg[0][1], fimg[1][1], g.lse.bytes, 4);
    }
    for (int i = 0; i < 2; i++)
        for (int j = 0; j < 2; j++)
            free(fimg[i][j]);

    /* backward from the CPU's o (rounded) and lse */
    gb_set(&g.o, h->o);
    gb_set(&g.lse, h->lse);
    uint8_t *bimg[2][6] = {{0}};
    gbuf *bo[6] = {&g.dq, &g.dkc, &g.dvc, &g.dkb, &g.dvb, &g.delta};
    for (int run = 0; run < (det ? 2 : 1); run++) {
        for (int i = 0; i < 6; i++)
            gb_nan(bo[i]);
        snprintf(what, sizeof what, "dflash_attn_bwd %s %s [%s]", md->name, c->name, label);
        check_rc(be->ops->dflash_attn_bwd(be, &a), be, what);
        sync_ok(be, what);
        for (int i = 0; i < 6; i++)
            bimg[run][i] = gb_image(bo[i]);
        if (run > 0)
            continue;
        const double rt = bf ? 3e-2 : 5e-5, cm = bf ? 0.9995 : 0.999999, ct = 1e-5;
        char w2[260];
        float *x = xmalloc((size_t)((Q > T ? Q : T) * nq + 1) * sizeof *x);
        if (Q > 0) {
            gb_get(&g.dq, x);
            snprintf(w2, sizeof w2, "%s: dq", what);
            cmp_grad(w2, x, h->dq, h->mdq, Q * c->nh, c->d, rt, ct, cm, desc_qrow, &qd);
            gb_get(&g.dkb, x);
            snprintf(w2, sizeof w2, "%s: dk_blk", what);
            cmp_grad(w2, x, h->dkb, h->mdkb, Q * c->nkv, c->d, rt, ct, cm, desc_kblk, &kd);
            gb_get(&g.dvb, x);
            snprintf(w2, sizeof w2, "%s: dv_blk", what);
            cmp_grad(w2, x, h->dvb, h->mdvb, Q * c->nkv, c->d, rt, ct, cm, desc_kblk, &kd);
            gb_get(&g.delta, x);
            snprintf(w2, sizeof w2, "%s: delta", what);
            /* delta = sum(dout o): tolerance relative to sum |dout o| */
            double *tol = xmalloc((size_t)(Q * c->nh) * sizeof *tol);
            for (int64_t i = 0; i < Q * c->nh; i++) {
                double sa = 0;
                for (int j = 0; j < c->d; j++)
                    sa += fabs((double)h->dout[i * c->d + j] * h->o[i * c->d + j]);
                tol[i] = 2e-5 * sa + 1e-6;
            }
            cmp_vals(w2, x, h->delta, tol, Q * c->nh, desc_qrow, &qd);
            free(tol);
        }
        gb_get(&g.dkc, x);
        snprintf(w2, sizeof w2, "%s: dk_ctx", what);
        cmp_grad(w2, x, h->dkc, h->mdkc, T * c->nkv, c->d, rt, ct, cm, desc_kctx, &kd);
        int64_t unseen = 0, nonzero = 0;
        for (int64_t r = 0; r < T * c->nkv; r++) {
            bool z = true;
            for (int i = 0; i < c->d; i++)
                z &= h->dkc[r * c->d + i] == 0.0f;
            if (z) {
                unseen++;
                for (int i = 0; i < c->d; i++)
                    nonzero += x[r * c->d + i] != 0.0f;
            }
        }
        T_CHECK(nonzero == 0, "%s: %lld nonzero values in dk_ctx rows that no block sees", what,
                (long long)nonzero);
        gb_get(&g.dvc, x);
        snprintf(w2, sizeof w2, "%s: dv_ctx (%lld of %lld rows unseen: must be 0)", what,
                 (long long)unseen, (long long)(T * c->nkv));
        cmp_grad(w2, x, h->dvc, h->mdvc, T * c->nkv, c->d, rt, ct, cm, desc_kctx, &kd);
        free(x);
    }
    if (det) {
        static const char *nm[6] = {"dq", "dk_ctx", "dv_ctx", "dk_blk", "dv_blk", "delta"};
        for (int i = 0; i < 6; i++) {
            char w2[80];
            snprintf(w2, sizeof w2, "dflash_attn_bwd: %s", nm[i]);
            cmp_same(w2, bimg[0][i], bimg[1][i], bo[i]->bytes, i == 5 ? 4 : dfl_dtype_size(dt));
        }
    }
    for (int i = 0; i < 2; i++)
        for (int j = 0; j < 6; j++)
            free(bimg[i][j]);
    /* inputs unchanged */
    uint8_t *q2 = gb_image(&g.q), *k2 = gb_image(&g.kc), *v2 = gb_image(&g.vb);
    cmp_bytes("dflash_attn: q changed", q2, qimg, g.q.bytes);
    cmp_bytes("dflash_attn: k_ctx changed", k2, kimg, g.kc.bytes);
    cmp_bytes("dflash_attn: v_blk changed", v2, vimg, g.vb.bytes);
    free(q2);
    free(k2);
    free(v2);
    free(qimg);
    free(kimg);
    free(vimg);
    df_dev_guards(&g, what);
    df_dev_free(&g);
}

static void df_case_run(const struct df_case *c)
{
    struct df_batch bt;
    df_batch_make(&bt, c);
    const int64_t T = bt.T, Q = bt.Q, nq = (int64_t)c->nh * c->d, nk = (int64_t)c->nkv * c->d;
    const float scale = 1.0f / sqrtf((float)c->d);
    struct mode md[2];
    int nm = modes(md);
    printf("#   case %s: %d blocks, %lld context rows, %d sequences, bs %d, heads %d/%d, d %d\n", c->name,
           bt.n_blocks, (long long)T, c->nseq, c->bs, c->nh, c->nkv, c->d);
    for (int k = 0; k < nm; k++) {
        struct df_host h;
        memset(&h, 0, sizeof h);
        const bool bf = md[k].bf16;
        h.q = rnd((size_t)(Q * nq), c->qscale, 0, bf);
        h.kc = rnd((size_t)(T * nk), 1, 0, bf);
        h.vc = rnd((size_t)(T * nk), 1, 0, bf);
        h.kb = rnd((size_t)(Q * nk), 1, 0, bf);
        h.vb = rnd((size_t)(Q * nk), 1, 0, bf);
        h.dout = rnd((size_t)(Q * nq), 1, 0, bf);
        h.o = xmalloc((size_t)(Q * nq + 1) * sizeof *h.o);
        h.lse = xmalloc((size_t)(Q * c->nh + 1) * sizeof *h.lse);
        h.dq = xmalloc((size_t)(Q * nq + 1) * sizeof *h.dq);
        h.dkc = xmalloc((size_t)(T * nk + 1) * sizeof *h.dkc);
        h.dvc = xmalloc((size_t)(T * nk + 1) * sizeof *h.dvc);
        h.dkb = xmalloc((size_t)(Q * nk + 1) * sizeof *h.dkb);
        h.dvb = xmalloc((size_t)(Q * nk + 1) * sizeof *h.dvb);
        h.delta = xmalloc((size_t)(Q * c->nh + 1) * sizeof *h.delta);
        dfl_dflash_attn a = df_args(&bt, scale);
        a.q = h.q;
        a.k_ctx = h.kc;
        a.v_ctx = h.vc;
        a.k_blk = h.kb;
        a.v_blk = h.vb;
        a.o = h.o;
        a.lse = h.lse;
        a.ctx_start = bt.cs;
        a.anchor = bt.an;
        a.dout = h.dout;
        a.delta = h.delta;
        a.dq = h.dq;
        a.dk_ctx = h.dkc;
        a.dv_ctx = h.dvc;
        a.dk_blk = h.dkb;
        a.dv_blk = h.dvb;
        if (bt.n_blocks > 0)
            T_CHECK(g_cpu->ops->dflash_attn(g_cpu, &a) == 0, "cpu dflash_attn");
        if (bf)
            for (int64_t i = 0; i < Q * nq; i++)
                h.o[i] = round_bf16(h.o[i]);
        T_CHECK(g_cpu->ops->dflash_attn_bwd(g_cpu, &a) == 0, "cpu dflash_attn_bwd");
        df_cond(&bt, &h, scale);

        if (!bf) {
            df_run(&bt, &h, &md[k], "exact f32 kernels", true);
        } else {
            /* every tiled variant of the head dimension (defaults first, with determinism),
             * then the exact kernels on bf16 inputs */
            const int d = c->d;
            int nf = 0, nq2 = 0, nkv2 = 0;
            while (dfl_cuda_dflash_variant_name(DFL_DFLASH_FWD, d, nf))
                nf++;
            while (dfl_cuda_dflash_variant_name(DFL_DFLASH_BWD_Q, d, nq2))
                nq2++;
            while (dfl_cuda_dflash_variant_name(DFL_DFLASH_BWD_KV, d, nkv2))
                nkv2++;
            int nvar = nf > nq2 ? nf : nq2;
            if (nkv2 > nvar)
                nvar = nkv2;
            for (int v = 0; v < (nvar ? nvar : 1); v++) {
                char label[400];
                if (nvar) {
                    int vf = v < nf ? v : 0, vq = v < nq2 ? v : 0, vk = v < nkv2 ? v : 0;
                    dfl_cuda_dflash_set_variant(DFL_DFLASH_FWD, d, vf);
                    dfl_cuda_dflash_set_variant(DFL_DFLASH_BWD_Q, d, vq);
                    dfl_cuda_dflash_set_variant(DFL_DFLASH_BWD_KV, d, vk);
                    snprintf(label, sizeof label, "%s | %s | %s%s%s",
                             dfl_cuda_dflash_variant_name(DFL_DFLASH_FWD, d, vf),
                             dfl_cuda_dflash_variant_name(DFL_DFLASH_BWD_Q, d, vq),
                             dfl_cuda_dflash_variant_name(DFL_DFLASH_BWD_KV, d, vk),
                             (c->nh / c->nkv) * c->bs > 128 ? " (rows per block > 128: exact kernels)" : "",
                             v == 0 ? " (dS kept where the shape takes it)" : "");
                } else {
                    snprintf(label, sizeof label, "no tiled kernel for d %d: exact kernels", d);
                }
                df_run(&bt, &h, &md[k], label, v == 0);
            }
            if (nvar) {
                dfl_cuda_dflash_set_variant(DFL_DFLASH_FWD, d, 0);
                dfl_cuda_dflash_set_variant(DFL_DFLASH_BWD_Q, d, 0);
                dfl_cuda_dflash_set_variant(DFL_DFLASH_BWD_KV, d, 0);
                if (d == 128 && (c->nh / c->nkv) * c->bs == 64) {
                    /* the defaults ran with dS kept: once more with it recomputed by pass Q */
                    dfl_cuda_dflash_bwd_ds(0);
                    df_run(&bt, &h, &md[k], "defaults, dS recomputed (DFL_CUDA_DFLASH_DS=0)", true);
                    dfl_cuda_dflash_bwd_ds(1);
                }
                dfl_cuda_dflash_force_simple(1);
                df_run(&bt, &h, &md[k], "exact kernels on bf16", false);
                dfl_cuda_dflash_force_simple(0);
            }
        }
        df_host_free(&h);
    }
    df_batch_free(&bt);
}

static const struct df_case df_cases[] = {
    /* simplest first: one block, no context; then context only through one segment */
    {"one block, anchor 0", 2, 2, 64, 8, 1, {20}, {1}, AN_ZERO, 1, 0},
    {"no context at all (anchors 0)", 4, 2, 128, 16, 2, {50, 30}, {5, 3}, AN_ZERO, 1, 0},
    {"golden shape", 8, 4, 32, 8, 3, {40, 97, 61}, {13, 29, 14}, AN_GOLDEN, 1, 0},
    {"8B heads, 2 seqs", 32, 8, 128, 16, 2, {300, 200}, {40, 25}, AN_RANDOM, 1, 0},
    {"GQA 1, d64", 4, 4, 64, 8, 3, {130, 64, 65}, {20, 9, 12}, AN_RANDOM, 1, 0},
    {"GQA 2, d128, bs16", 4, 2, 128, 16, 2, {257, 100}, {30, 11}, AN_RANDOM, 1, 0},
    {"anchors near the end", 8, 2, 128, 16, 3, {129, 64, 200}, {6, 4, 8}, AN_END, 1, 0},
    {"unsorted anchors", 8, 2, 64, 8, 2, {150, 90}, {21, 13}, AN_UNSORTED, 1, 0},
    {"unsorted anchors, GQA 4, bs 16 (dS kept)", 8, 2, 128, 16, 2, {300, 170}, {21, 13}, AN_UNSORTED, 1, 0},
    {"anchors 0, GQA 4, bs 16 (dS kept, no context tiles)", 8, 2, 128, 16, 2, {50, 30}, {3, 2}, AN_ZERO, 1, 0},
    {"bs 4, GQA 4", 8, 2, 128, 4, 2, {300, 77}, {60, 15}, AN_RANDOM, 1, 0},
    {"bs 32, GQA 4", 8, 2, 128, 32, 2, {200, 150}, {9, 7}, AN_RANDOM, 1, 0},
    {"bs 32, GQA 8 (256 rows per block)", 8, 1, 128, 32, 1, {120}, {5}, AN_RANDOM, 1, 0},
    {"sequence without blocks in the middle", 4, 2, 64, 8, 4, {50, 80, 40, 70}, {6, 0, 5, 0}, AN_RANDOM, 1, 0},
    {"dense anchors, many blocks", 8, 2, 32, 8, 1, {400}, {300}, AN_DENSE, 1, 0},
    {"large scores", 8, 2, 128, 16, 1, {257}, {20}, AN_RANDOM, 8, 0},
    {"d96 (no tiled kernel)", 4, 2, 96, 8, 2, {60, 33}, {7, 4}, AN_RANDOM, 1, 0},
    {"long sequence", 16, 4, 128, 16, 1, {1500}, {96}, AN_RANDOM, 1, 0},
    /* sliding-window layers (issue 18) */
    {"window 24, golden shape", 8, 4, 32, 8, 3, {40, 97, 61}, {13, 29, 14}, AN_GOLDEN, 1, 24},
    {"window 5 < bs, unsorted", 8, 2, 64, 8, 2, {150, 90}, {21, 13}, AN_UNSORTED, 1, 5},
    {"window 1 (each slot sees only itself and the slots before)", 4, 2, 64, 8, 1, {60}, {9}, AN_RANDOM, 1, 1},
    {"27B drafter heads, window 200, long sequence", 32, 8, 128, 16, 1, {1500}, {96}, AN_RANDOM, 1, 200},
    {"window 64, dense anchors, d128", 8, 2, 128, 16, 2, {700, 300}, {300, 120}, AN_DENSE, 1, 64},
    {"window 100, bs 32, GQA 4", 8, 2, 128, 32, 2, {400, 150}, {12, 7}, AN_RANDOM, 1, 100},
    {"window 40, sequence without blocks, d96", 4, 2, 96, 8, 3, {80, 60, 90}, {7, 0, 6}, AN_RANDOM, 1, 40},
};

/* DFL_DF_CASES=SUBSTRING: only the cases whose name holds it (e.g. "window" under
 * compute-sanitizer) */
static void test_dflash_attn(void)
{
    NEED_GPU();
    const char *only = getenv("DFL_DF_CASES");
    for (size_t i = 0; i < sizeof df_cases / sizeof df_cases[0]; i++)
        if (!only || strstr(df_cases[i].name, only))
            df_case_run(&df_cases[i]);
}

/* no blocks at all: the forward does nothing, the backward zeroes dk_ctx / dv_ctx */
static void test_dflash_attn_empty(void)
{
    NEED_GPU();
    struct mode md[2];
    int nm = modes(md);
    for (int k = 0; k < nm; k++) {
        dfl_be *be = md[k].be;
        gbuf kc, dkc, dvc;
        const int64_t T = 37, nk = 2 * 64;
        if (gb_alloc(&kc, be, (size_t)(T * nk), md[k].dt) && gb_alloc(&dkc, be, (size_t)(T * nk), md[k].dt) &&
            gb_alloc(&dvc, be, (size_t)(T * nk), md[k].dt)) {
            dfl_dflash_attn a = {.k_ctx = kc.p, .v_ctx = kc.p, .n_blocks = 0, .bs = 8, .T_ctx = T,
                                 .n_heads = 4, .n_kv = 2, .d = 64, .scale = 0.125f, .dk_ctx = dkc.p,
                                 .dv_ctx = dvc.p};
            check_rc(be->ops->dflash_attn(be, &a), be, "dflash_attn, no blocks");
            check_rc(be->ops->dflash_attn_bwd(be, &a), be, "dflash_attn_bwd, no blocks");
            sync_ok(be, "dflash_attn_bwd, no blocks");
            float *x = xmalloc((size_t)(T * nk) * sizeof *x);
            int64_t bad = 0;
            gb_get(&dkc, x);
            for (int64_t i = 0; i < T * nk; i++)
                bad += x[i] != 0.0f;
            gb_get(&dvc, x);
            for (int64_t i = 0; i < T * nk; i++)
                bad += x[i] != 0.0f;
            printf("#   dflash_attn_bwd %s, no blocks: %lld nonzero context gradients\n", md[k].name, (long long)bad);
            T_CHECK(bad == 0, "dflash_attn_bwd %s with no blocks: %lld nonzero context gradients", md[k].name,
                    (long long)bad);
            free(x);
            gb_check_guards(&dkc, "dflash_attn_bwd, no blocks");
            gb_check_guards(&dvc, "dflash_attn_bwd, no blocks");
        }
        gb_free(&kc);
        gb_free(&dkc);
        gb_free(&dvc);
    }
}

/* ------------------------------------------------------------------------------------------ */
/* lmce */

/* lmce's reference in bf16 mode, on the host: each logit the double-precision product rounded
 * to f32, then to bf16, as the GPU's GEMM (f32 sums, one rounding to bf16) gives it up to the
 * order of its sums. A logit is ambiguous when the GPU's f32 sum could round the other way: when
 * the two ends of [d - e, d + e], e = 2^-16 sum |z_i W_vi| (well above the error of an f32 sum of
 * H <= 512 terms for these inputs), round differently; its other value is kept. Per scored row:
 * ce, the hit (first index of the maximum), and ce's allowance: the largest change of the
 * log-sum-exp the ambiguous logits can make (sum of p_v |other - x_v|) plus that of the label's
 * logit; the row's hit is fuzzy when an ambiguous logit is the maximum or could reach it. dz =
 * sum_v G_v W_v in double with G_v = grad_scale w (softmax - onehot). sums as the op's. */
static void lmce_ref_bf16(const float *z, const float *W, const int32_t *lab, const float *wt, int64_t Q,
                          int64_t H, int64_t V, float grad_scale, float *ce, uint8_t *corr, double *tol,
                          bool *fuzzy, float *dz, double *sums)
{
    float *x = xmalloc((size_t)V * sizeof *x), *xo = xmalloc((size_t)V * sizeof *xo);
    double *acc = xmalloc((size_t)H * sizeof *acc);
    for (int64_t q = 0; q < Q; q++) {
        ce[q] = 0.0f;
        corr[q] = 0;
        tol[q] = 0;
        fuzzy[q] = false;
        for (int64_t i = 0; i < H; i++)
            dz[q * H + i] = 0.0f;
        const double w = wt[q];
        if (!(w > 0))
            continue;
        double m = -INFINITY;
        int64_t am = 0;
        for (int64_t v = 0; v < V; v++) {
            double d = 0, a = 0;
            for (int64_t i = 0; i < H; i++) {
                d += (double)z[q * H + i] * W[v * H + i];
                a += fabs((double)z[q * H + i] * W[v * H + i]);
            }
            const double e = ldexp(a, -16);
            const float lo = round_bf16((float)(d - e)), hi = round_bf16((float)(d + e));
            x[v] = round_bf16((float)d);
            xo[v] = x[v] == lo ? hi : lo;   /* == x[v] where unambiguous */
            if (x[v] > m) {
                m = x[v];
                am = v;
            }
        }
        double se = 0;
        for (int64_t v = 0; v < V; v++)
            se += exp(x[v] - m);
        const double l = m + log(se);
        const int32_t lb = lab[q];
        double t = fabs((double)xo[lb] - x[lb]);
        for (int64_t v = 0; v < V; v++)
            if (xo[v] != x[v]) {
                t += exp(x[v] - l) * fabs((double)xo[v] - x[v]);
                if (x[v] == m || xo[v] >= m)
                    fuzzy[q] = true;
            }
        ce[q] = (float)(l - x[lb]);
        corr[q] = am == lb;
        tol[q] = t;
        sums[DFL_SUM_LOSS_NUM] += w * (l - x[lb]);
        sums[DFL_SUM_LOSS_DEN] += w;
        sums[DFL_SUM_ACC_NUM] += corr[q];
        sums[DFL_SUM_ACC_DEN] += 1;
        for (int64_t i = 0; i < H; i++)
            acc[i] = 0;
        for (int64_t v = 0; v < V; v++) {
            const double g = grad_scale * w * (exp(x[v] - l) - (v == lb ? 1.0 : 0.0));
            for (int64_t i = 0; i < H; i++)
                acc[i] += g * W[v * H + i];
        }
        for (int64_t i = 0; i < H; i++)
            dz[q * H + i] = (float)acc[i];
    }
    free(x);
    free(xo);
    free(acc);
}

struct lm_case {
    int Q, H, V, chunk;
    float grad_scale;
    bool dz, outs;
};

static void test_lmce(void)
{
    NEED_GPU();
    static const struct lm_case cases[] = {
        {37, 64, 1000, 8, 1.0f, true, true},   {200, 256, 2048, 64, 1.0f, true, true},
        {200, 256, 2048, 200, 0.37f, true, false}, {64, 128, 151936, 16, 1.0f, true, true},
        {50, 96, 777, 7, 1.0f, false, true},   {300, 512, 5003, 128, 2.0f, true, true},
        {1, 64, 3, 1, 1.0f, true, true},
    };
    struct mode md[2];
    int nm = modes(md);
    for (int k = 0; k < nm; k++)
        for (size_t ci = 0; ci < sizeof cases / sizeof cases[0]; ci++) {
            const struct lm_case *c = &cases[ci];
            dfl_be *be = md[k].be;
            const bool bf = md[k].bf16;
            const int64_t Q = c->Q, H = c->H, V = c->V, CR = c->chunk;
            float *z = rnd((size_t)(Q * H), 1, 0, bf), *W = rnd((size_t)(V * H), 0.2f, 0, bf);
            int32_t *lab = xmalloc((size_t)Q * sizeof *lab);
            float *wt = xmalloc((size_t)Q * sizeof *wt);
            /* logits on the host (double) for labels that are the argmax half the time, and the
             * top-2 gap of each row */
            double *gap = xmalloc((size_t)Q * sizeof *gap);
            for (int64_t q = 0; q < Q; q++) {
                double b1 = -INFINITY, b2 = -INFINITY;
                int64_t am = 0;
                for (int64_t v = 0; v < V; v++) {
                    double s = 0;
                    for (int64_t i = 0; i < H; i++)
                        s += (double)z[q * H + i] * W[v * H + i];
                    if (s > b1) {
                        b2 = b1;
                        b1 = s;
                        am = v;
                    } else if (s > b2) {
                        b2 = s;
                    }
                }
                gap[q] = b1 - b2;
                lab[q] = rng_int(0, 1) ? (int32_t)am : rng_int(0, (int)V - 1);
                int r = rng_int(0, 9);
                wt[q] = r < 2 ? 0.0f : r < 4 ? 1.0f : (float)exp(-(double)rng_int(1, 15) / 7.0);
            }
            float *work = xmalloc((size_t)dfl_lmce_work_act(CR, V, DFL_F32) * sizeof *work);
            double sums[DFL_SUM_COUNT] = {0};
            uint8_t *corr = xmalloc((size_t)Q);
            float *ce = xmalloc((size_t)Q * sizeof *ce), *dz = xmalloc((size_t)(Q * H) * sizeof *dz);
            dfl_lmce a = {.z = z, .w_lm = W, .labels = lab, .weight = wt, .Q = Q, .H = H, .V = V,
                          .sums = sums, .correct = corr, .ce_out = ce, .dz = c->dz ? dz : NULL,
                          .grad_scale = c->grad_scale, .work = work, .chunk_rows = CR};
            double *tol = xmalloc((size_t)Q * sizeof *tol);
            bool *fz = xmalloc((size_t)Q * sizeof *fz);
            if (bf)   /* the GPU rounds the logits to bf16: the host's reference of those */
                lmce_ref_bf16(z, W, lab, wt, Q, H, V, c->grad_scale, ce, corr, tol, fz, dz, sums);
            else
                T_CHECK(g_cpu->ops->lmce(g_cpu, &a) == 0, "cpu lmce");
            char what[160];
            snprintf(what, sizeof what, "lmce %s Q%d H%d V%d chunk %d scale %g%s%s", md[k].name, c->Q,
                     c->H, c->V, c->chunk, (double)c->grad_scale, c->dz ? "" : " no dz",
                     c->outs ? "" : " no per-row outputs");
            gbuf gz, gW, gl, gwt, gs, gc, gce, gdz, gwork;
            bool ok = gb_alloc(&gz, be, (size_t)(Q * H), md[k].dt) && gb_alloc(&gW, be, (size_t)(V * H), md[k].dt) &&
                      gb_alloc(&gl, be, (size_t)Q, DFL_I32) && gb_alloc(&gwt, be, (size_t)Q, DFL_F32) &&
                      gb_alloc(&gs, be, DFL_SUM_COUNT, DFL_F64) && gb_alloc(&gc, be, (size_t)Q, DFL_U8) &&
                      gb_alloc(&gce, be, (size_t)Q, DFL_F32) && gb_alloc(&gdz, be, (size_t)(Q * H), md[k].dt) &&
                      gb_alloc(&gwork, be, (size_t)dfl_lmce_work_act(CR, V, md[k].dt), DFL_F32);
            if (ok) {
                gb_set(&gz, z);
                gb_set(&gW, W);
                gb_set_raw(&gl, lab);
                gb_set_raw(&gwt, wt);
                /* run 0 against the CPU, run 1 byte for byte against run 0, run 2 with the GEMMs'
                 * algorithms timed first (lmce's tune) against the CPU again */
                uint8_t *img[3][4] = {{0}};
                for (int run = 0; run < 3; run++) {
                    double z8[DFL_SUM_COUNT] = {0};
                    z8[6] = 123.0;   /* untouched slot */
                    gb_set_raw(&gs, z8);
                    gb_nan(&gdz);
                    gb_nan(&gce);
                    dfl_lmce g = a;
                    g.z = gz.p;
                    g.w_lm = gW.p;
                    g.labels = (const int32_t *)gl.p;
                    g.weight = (const float *)gwt.p;
                    g.sums = (double *)gs.p;
                    g.correct = c->outs ? gc.p : NULL;
                    g.ce_out = c->outs ? (float *)gce.p : NULL;
                    g.dz = c->dz ? gdz.p : NULL;
                    g.work = (float *)gwork.p;
                    g.tune = run == 2;
                    if (run == 2)
                        strncat(what, " (tuned)", sizeof what - strlen(what) - 1);
                    check_rc(be->ops->lmce(be, &g), be, what);
                    sync_ok(be, what);
                    img[run][0] = gb_image(&gs);
                    img[run][1] = gb_image(&gc);
                    img[run][2] = gb_image(&gce);
                    img[run][3] = gb_image(&gdz);
                    if (run == 1)
                        continue;
                    double gsum[DFL_SUM_COUNT];
                    memcpy(gsum, img[run][0], sizeof gsum);
                    int64_t small_gap = 0, hit_diff = 0, ce_bad = 0;
                    double ce_worst = 0, loss_tol = 1e-5 * fabs(sums[0]) + 1e-6;
                    uint8_t *gcorr = img[run][1];
                    float *gce2 = xmalloc((size_t)Q * sizeof *gce2);
                    gb_get(&gce, gce2);
                    for (int64_t q = 0; q < Q; q++) {
                        if (!(wt[q] > 0))
                            continue;
                        bool fuzzy = bf ? fz[q] : gap[q] < 1e-3;
                        small_gap += fuzzy;
                        const double ctol = 2e-4 + 1e-5 * fabs(ce[q]) + (bf ? tol[q] : 0.0);
                        loss_tol += bf ? wt[q] * tol[q] : 0.0;
                        if (c->outs) {
                            if (gcorr[q] != corr[q] && !fuzzy) {
                                hit_diff++;
                                if (hit_diff <= 3)
                                    fprintf(stderr, "    %s: row %lld: correct %d, cpu %d (label %d, gap %.3g)\n",
                                            what, (long long)q, gcorr[q], corr[q], lab[q], gap[q]);
                            }
                            double dd = fabs((double)gce2[q] - ce[q]);
                            if (!(dd <= ctol)) {
                                ce_bad++;
                                if (ce_bad <= 3)
                                    fprintf(stderr, "    %s: row %lld: ce gpu %.9g cpu %.9g\n", what,
                                            (long long)q, (double)gce2[q], (double)ce[q]);
                            }
                            if (dd > ce_worst)
                                ce_worst = dd;
                        }
                    }
                    if (c->outs)
                        for (int64_t q = 0; q < Q; q++)
                            if (!(wt[q] > 0) && (gcorr[q] != 0 || gce2[q] != 0.0f)) {
                                T_CHECK(0, "%s: row %lld has weight 0 but correct %d, ce %g", what,
                                        (long long)q, gcorr[q], (double)gce2[q]);
                                break;
                            }
                    printf("#   %-64s loss %.9g (cpu %.9g) den %.9g (cpu %.9g) acc %g/%g (cpu %g/%g); ce max "
                           "|diff| %.3g; %lld rows %s\n", what, gsum[0], sums[0], gsum[1],
                           sums[1], gsum[2], gsum[3], sums[2], sums[3], ce_worst, (long long)small_gap,
                           bf ? "whose argmax a bf16 rounding could change" : "with top-2 gap < 1e-3");
                    T_CHECK(fabs(gsum[0] - sums[0]) <= loss_tol, "%s: loss_num %.12g vs %.12g (tolerance %.3g)",
                            what, gsum[0], sums[0], loss_tol);
                    T_CHECK(fabs(gsum[1] - sums[1]) <= 1e-12 * fabs(sums[1]), "%s: loss_den %.17g vs %.17g", what,
                            gsum[1], sums[1]);
                    T_CHECK(fabs(gsum[2] - sums[2]) <= (double)small_gap, "%s: acc_num %g vs %g", what, gsum[2], sums[2]);
                    T_CHECK(gsum[3] == sums[3], "%s: acc_den %g vs %g", what, gsum[3], sums[3]);
                    T_CHECK(gsum[4] == 0 && gsum[5] == 0 && gsum[6] == 123.0 && gsum[7] == 0,
                            "%s: sums slots 4..7 changed", what);
                    T_CHECK(hit_diff == 0, "%s: %lld rows with a different argmax hit", what, (long long)hit_diff);
                    T_CHECK(ce_bad == 0, "%s: %lld rows with ce out of tolerance", what, (long long)ce_bad);
                    free(gce2);
                    if (c->dz) {
                        float *gdzv = xmalloc((size_t)(Q * H) * sizeof *gdzv);
                        gb_get(&gdz, gdzv);
                        char w2[200];
                        snprintf(w2, sizeof w2, "%s: dz", what);
                        cmp_rows(w2, gdzv, H, dz, H, Q, H, bf ? 1e-2 : 1e-4, bf ? 0.9999 : 0.9999999);
                        free(gdzv);
                    }
                }
                cmp_same("lmce: sums", img[0][0], img[1][0], gs.bytes, 8);
                if (c->outs) {
                    cmp_same("lmce: correct", img[0][1], img[1][1], gc.bytes, 1);
                    cmp_same("lmce: ce", img[0][2], img[1][2], gce.bytes, 4);
                }
                if (c->dz)
                    cmp_same("lmce: dz", img[0][3], img[1][3], gdz.bytes, dfl_dtype_size(md[k].dt));
                for (int i = 0; i < 3; i++)
                    for (int j = 0; j < 4; j++)
                        free(img[i][j]);
                gb_check_guards(&gwork, what);
                gb_check_guards(&gdz, what);
                gb_check_guards(&gs, what);
                gb_check_guards(&gc, what);
                gb_check_guards(&gce, what);
            }
            gb_free(&gz);
            gb_free(&gW);
            gb_free(&gl);
            gb_free(&gwt);
            gb_free(&gs);
            gb_free(&gc);
            gb_free(&gce);
            gb_free(&gdz);
            gb_free(&gwork);
            free(z);
            free(W);
            free(lab);
            free(wt);
            free(gap);
            free(tol);
            free(fz);
            free(work);
            free(corr);
            free(ce);
            free(dz);
        }
}

/* ------------------------------------------------------------------------------------------ */
/* sumsq, clip_scale */

static void test_sumsq(void)
{
    NEED_GPU();
    static const int64_t sizes[] = {1, 5, 4096, 16385, 1000003, 40000001};
    dfl_be *be = g_bf;   /* f32 data in either mode */
    for (size_t si = 0; si < sizeof sizes / sizeof sizes[0]; si++)
        for (int skew = 0; skew < 2; skew++) {
            const int64_t n = sizes[si];
            float *x = rnd((size_t)n, 0.01f, 0, false);
            double ref[1] = {0.5};
            T_CHECK(g_cpu->ops->sumsq(g_cpu, ref, x, n) == 0, "cpu sumsq");
            gbuf gx, go;
            char what[100];
            snprintf(what, sizeof what, "sumsq n%lld%s", (long long)n, skew ? " (x 4 bytes past alignment)" : "");
            if (gb_alloc_skew(&gx, be, (size_t)n, DFL_F32, skew ? 4 : 0) && gb_alloc(&go, be, 1, DFL_F64)) {
                gb_set(&gx, x);
                double got[2];
                for (int run = 0; run < 2; run++) {
                    double init = 0.5;
                    gb_set_raw(&go, &init);
                    check_rc(be->ops->sumsq(be, (double *)go.p, (const float *)gx.p, n), be, what);
                    sync_ok(be, what);
                    gb_get_raw(&go, &got[run]);
                }
                double rel = fabs(got[0] - ref[0]) / fabs(ref[0]);
                printf("#   %-64s gpu %.17g cpu %.17g rel %.3g\n", what, got[0], ref[0], rel);
                T_CHECK(rel <= 1e-12, "%s: %.17g vs %.17g", what, got[0], ref[0]);
                T_CHECK(memcmp(&got[0], &got[1], sizeof got[0]) == 0, "%s: two runs differ (%.17g, %.17g)",
                        what, got[0], got[1]);
                gb_check_guards(&gx, what);
                gb_check_guards(&go, what);
            }
            gb_free(&gx);
            gb_free(&go);
            free(x);
        }
}

static void test_clip_scale(void)
{
    NEED_GPU();
    static const double sums[][DFL_SUM_COUNT] = {
        {1245.7313, 180.6192, 92, 324, 2043.5, 0, 0, 0},
        {10.0, 3.0, 1, 2, 1e-20, 0, 0, 0},
        {10.0, 0.0, 0, 0, 4.0, 0, 0, 0},        /* no scored slot: skip */
        {NAN, 3.0, 1, 2, 4.0, 0, 0, 0},         /* NaN loss: skip */
        {10.0, 3.0, 1, 2, INFINITY, 0, 0, 0},   /* inf gradient: skip */
        {10.0, 3.0, 1, 2, 1e30, 0, 0, 0},
    };
    static const float norms[] = {0.5f, 1.0f, 0.0f, 1e30f};
    dfl_be *be = g_bf;
    gbuf gs, go, gk;
    if (gb_alloc(&gs, be, DFL_SUM_COUNT, DFL_F64) && gb_alloc(&go, be, 4, DFL_F32) && gb_alloc(&gk, be, 1, DFL_I32)) {
        int cases = 0;
        for (size_t i = 0; i < sizeof sums / sizeof sums[0]; i++)
            for (size_t j = 0; j < sizeof norms / sizeof norms[0]; j++) {
                float ref[4] = {0}, got[4] = {0};
                int32_t rskip = -1, gskip = -1;
                T_CHECK(g_cpu->ops->clip_scale(g_cpu, ref, &rskip, sums[i], norms[j]) == 0, "cpu clip_scale");
                gb_set_raw(&gs, sums[i]);
                check_rc(be->ops->clip_scale(be, (float *)go.p, (int32_t *)gk.p, (const double *)gs.p, norms[j]),
                         be, "clip_scale");
                sync_ok(be, "clip_scale");
                gb_get_raw(&go, got);
                gb_get_raw(&gk, &gskip);
                bool same = memcmp(got, ref, 3 * sizeof(float)) == 0 && gskip == rskip;
                if (!same)
                    fprintf(stderr, "    clip_scale case %zu/%zu: gpu %.9g %.9g %.9g skip %d; cpu %.9g %.9g %.9g skip %d\n",
                            i, j, (double)got[0], (double)got[1], (double)got[2], gskip, (double)ref[0],
                            (double)ref[1], (double)ref[2], rskip);
                T_CHECK(same, "clip_scale case %zu (max_norm %g) differs from the CPU", i, (double)norms[j]);
                cases++;
            }
        printf("#   clip_scale: %d cases bit-exact against the CPU\n", cases);
        gb_check_guards(&go, "clip_scale");
        gb_check_guards(&gk, "clip_scale");
    }
    gb_free(&gs);
    gb_free(&go);
    gb_free(&gk);
}

/* ------------------------------------------------------------------------------------------ */
/* block_metrics */

static void test_block_metrics(void)
{
    NEED_GPU();
    static const int shapes[][2] = {{1, 2}, {7, 8}, {2048, 16}, {300, 256}, {5000, 4}};
    dfl_be *be = g_bf;
    for (size_t si = 0; si < sizeof shapes / sizeof shapes[0]; si++) {
        const int64_t nb = shapes[si][0];
        const int bs = shapes[si][1];
        const int64_t Q = nb * bs;
        uint8_t *ok = xmalloc((size_t)Q);
        float *w = xmalloc((size_t)Q * sizeof *w);
        for (int64_t i = 0; i < Q; i++) {
            int r = rng_int(0, 9);
            w[i] = (i % bs == 0 || r < 2) ? 0.0f : 0.5f + 0.01f * (float)r;
            ok[i] = w[i] > 0 && rng_int(0, 3) != 0;   /* long correct runs */
        }
        const int no = 2 * bs + 2;
        double *ref = xmalloc((size_t)no * sizeof *ref), *got = xmalloc((size_t)no * sizeof *got);
        for (int i = 0; i < no; i++)
            ref[i] = 0.5 * i;
        gbuf go, gok, gw;
        char what[100];
        snprintf(what, sizeof what, "block_metrics %lld blocks of %d", (long long)nb, bs);
        if (gb_alloc(&go, be, (size_t)no, DFL_F64) && gb_alloc(&gok, be, (size_t)Q, DFL_U8) &&
            gb_alloc(&gw, be, (size_t)Q, DFL_F32)) {
            gb_set_raw(&go, ref);
            gb_set_raw(&gok, ok);
            gb_set_raw(&gw, w);
            T_CHECK(g_cpu->ops->block_metrics(g_cpu, ref, ok, w, nb, bs) == 0, "cpu block_metrics");
            check_rc(be->ops->block_metrics(be, (double *)go.p, gok.p, (const float *)gw.p, nb, bs), be, what);
            sync_ok(be, what);
            gb_get_raw(&go, got);
            int bad = 0;
            for (int i = 0; i < no; i++)
                if (got[i] != ref[i]) {
                    if (bad < 4)
                        fprintf(stderr, "    %s: out[%d] gpu %.17g cpu %.17g\n", what, i, got[i], ref[i]);
                    bad++;
                }
            printf("#   %-64s %d values, %d differ (acceptance length %g over %g blocks)\n", what, no, bad,
                   ref[2 * bs] - 0.5 * (2 * bs), ref[2 * bs + 1] - 0.5 * (2 * bs + 1));
            T_CHECK(bad == 0, "%s: %d of %d values differ from the CPU", what, bad, no);
            gb_check_guards(&go, what);
        }
        gb_free(&go);
        gb_free(&gok);
        gb_free(&gw);
        free(ok);
        free(w);
        free(ref);
        free(got);
    }
}

/* ------------------------------------------------------------------------------------------ */
/* segment_sum: each output element adds its segment's rows in order in f32 and rounds once, so
 * it is bit-exact against the same sum on the host (f32 mode: the CPU op; bf16 mode: the bf16
 * inputs added in f32, rounded to bf16). Segments as the drafter's first layer has them (1 row,
 * bs - 1 rows), empty ones and long ones; odd widths. */

static void test_segment_sum(void)
{
    NEED_GPU();
    static const struct { int64_t n_blk, bs, w; } cases[] = {
        {1, 2, 1}, {7, 16, 33}, {2048, 16, 1024}, {300, 3, 4096}, {5, 100, 257},
    };
    struct mode md[2];
    int nm = modes(md);
    for (int mi = 0; mi < nm; mi++)
        for (size_t ci = 0; ci < sizeof cases / sizeof cases[0]; ci++) {
            dfl_be *be = md[mi].be;
            const int64_t nb = cases[ci].n_blk, bs = cases[ci].bs, w = cases[ci].w;
            const int64_t R = nb * bs, n = 2 * nb + 1;   /* the last segment: empty */
            int32_t *off = xmalloc((size_t)(n + 1) * sizeof *off);
            for (int64_t b = 0; b <= nb; b++) {
                off[2 * b] = (int32_t)(b * bs);
                if (b < nb)
                    off[2 * b + 1] = (int32_t)(b * bs + 1);
            }
            off[n] = off[n - 1];
            float *src = rnd((size_t)(R * w), 1.0f, 0.0f, md[mi].bf16);
            float *ref = xmalloc((size_t)(n * w) * 4), *got = xmalloc((size_t)(n * w) * 4);
            for (int64_t i = 0; i < n; i++)
                for (int64_t k = 0; k < w; k++) {
                    float acc = 0.0f;
                    for (int64_t r = off[i]; r < off[i + 1]; r++)
                        acc += src[r * w + k];
                    ref[i * w + k] = acc;
                }
            for (int64_t i = 0; md[mi].bf16 && i < n * w; i++)
                ref[i] = round_bf16(ref[i]);
            char what[100];
            snprintf(what, sizeof what, "segment_sum %s: %lld blocks of %lld, width %lld",
                     md[mi].name, (long long)nb, (long long)bs, (long long)w);
            gbuf gs, gd, go;
            if (gb_alloc(&gs, be, (size_t)(R * w), md[mi].dt) &&
                gb_alloc(&gd, be, (size_t)(n * w), md[mi].dt) &&
                gb_alloc(&go, be, (size_t)(n + 1), DFL_I32)) {
                gb_set(&gs, src);
                gb_set_raw(&go, off);
                check_rc(be->ops->segment_sum(be, gd.p, gs.p, (const int32_t *)go.p, n, w), be, what);
                sync_ok(be, what);
                gb_get(&gd, got);
                int64_t bad = 0;
                for (int64_t i = 0; i < n * w; i++)
                    bad += memcmp(&got[i], &ref[i], 4) != 0;
                printf("#   %-64s %lld values differ\n", what, (long long)bad);
                T_CHECK(bad == 0, "%s: %lld values differ from the host sum", what, (long long)bad);
                gb_check_guards(&gd, what);
            }
            gb_free(&gs);
            gb_free(&gd);
            gb_free(&go);
            free(off), free(src), free(ref), free(got);
        }
}

/* ------------------------------------------------------------------------------------------ */
/* gather_rows: a copy, so bit-exact against the CPU op; rows of 1, 4, 6, 12, 2H (bf16) and 4H
 * bytes, aligned and misaligned buffers (the 16-, 4- and 1-byte paths), -1 rows zeroed. */

static void test_gather_rows(void)
{
    NEED_GPU();
    static const struct { int64_t n, src_rows, row_bytes; size_t skew; } cases[] = {
        {1, 1, 1, 0}, {8190, 8192, 1, 0}, {7, 9, 4, 0}, {1000, 1100, 6, 0}, {513, 600, 12, 4},
        {4095, 4096, 2 * 4096, 0}, {300, 301, 4 * 1024, 0}, {300, 301, 4 * 1024, 4},
        {300, 301, 2 * 1000, 2}, {20000, 16, 32, 0},
    };
    dfl_be *be = g_bf;
    for (size_t ci = 0; ci < sizeof cases / sizeof cases[0]; ci++) {
        const int64_t n = cases[ci].n, R = cases[ci].src_rows, rb = cases[ci].row_bytes;
        const size_t skew = cases[ci].skew;
        uint8_t *src = xmalloc((size_t)(R * rb)), *ref = xmalloc((size_t)(n * rb));
        uint8_t *got = xmalloc((size_t)(n * rb));
        int32_t *rows = xmalloc((size_t)n * sizeof *rows);
        for (int64_t i = 0; i < R * rb; i++)
            src[i] = (uint8_t)rng_int(1, 255);
        for (int64_t i = 0; i < n; i++)
            rows[i] = rng_int(0, 9) == 0 ? -1 : rng_int(0, (int)R - 1);
        char what[100];
        snprintf(what, sizeof what, "gather_rows %lld rows of %lld bytes from %lld (skew %zu)",
                 (long long)n, (long long)rb, (long long)R, skew);
        gbuf gs, gd, gr;
        if (gb_alloc_skew(&gs, be, (size_t)(R * rb), DFL_U8, skew) &&
            gb_alloc_skew(&gd, be, (size_t)(n * rb), DFL_U8, skew) &&
            gb_alloc(&gr, be, (size_t)n, DFL_I32)) {
            gb_set_raw(&gs, src);
            gb_set_raw(&gr, rows);
            T_CHECK(g_cpu->ops->gather_rows(g_cpu, ref, src, rows, n, rb) == 0, "cpu gather_rows");
            check_rc(be->ops->gather_rows(be, gd.p, gs.p, (const int32_t *)gr.p, n, rb), be, what);
            sync_ok(be, what);
            gb_get_raw(&gd, got);
            int64_t bad = 0, zeros = 0;
            for (int64_t i = 0; i < n; i++) {
                bad += memcmp(got + i * rb, ref + i * rb, (size_t)rb) != 0;
                zeros += rows[i] < 0;
            }
            printf("#   %-64s %lld rows (%lld zeroed), %lld differ\n", what, (long long)n,
                   (long long)zeros, (long long)bad);
            T_CHECK(bad == 0, "%s: %lld rows differ from the CPU", what, (long long)bad);
            gb_check_guards(&gd, what);
            gb_check_guards(&gs, what);
        }
        gb_free(&gs);
        gb_free(&gd);
        gb_free(&gr);
        free(src);
        free(ref);
        free(got);
        free(rows);
    }
}

/* ------------------------------------------------------------------------------------------ */
/* adamw */

struct aw_case {
    int64_t n;
    int64_t step;
    float lr, b1, b2, eps, wd;
    bool scale, skip, p_act;
    int skew;
};

static void test_adamw(void)
{
    NEED_GPU();
    static const struct aw_case cases[] = {
        {1000003, 1, 1e-3f, 0.9f, 0.95f, 1e-8f, 0.0f, false, false, true, 0},
        {4096, 10, 6e-4f, 0.9f, 0.999f, 1e-8f, 0.01f, true, false, true, 0},
        {77, 3, 1e-2f, 0.8f, 0.99f, 1e-6f, 0.1f, true, false, true, 1},
        {5000, 2, 1e-3f, 0.9f, 0.95f, 1e-8f, 0.0f, true, true, true, 0},   /* skipped step */
        {12345, 100000, 1e-4f, 0.9f, 0.999f, 1e-8f, 0.0f, false, false, false, 0},
    };
    struct mode md[2];
    int nm = modes(md);
    for (int k = 0; k < nm; k++)
        for (size_t ci = 0; ci < sizeof cases / sizeof cases[0]; ci++) {
            const struct aw_case *c = &cases[ci];
            dfl_be *be = md[k].be;
            const int64_t n = c->n;
            float *p = rnd((size_t)n, 0.05f, 0, false), *g = rnd((size_t)n, 1e-3f, 0, false);
            float *m = rnd((size_t)n, 1e-4f, 0, false), *v = rnd((size_t)n, 0, 0, false);
            for (int64_t i = 0; i < n; i++) {
                v[i] = 1e-7f * fabsf(rng_normal());
                if (i % 1000 == 7)
                    g[i] = 1e-9f;   /* tiny gradients: lr * g / (|g| + eps) territory */
            }
            float gs = 0.37f;
            int32_t skip = c->skip;
            float *rp = fdup(p, (size_t)n), *rm = fdup(m, (size_t)n), *rv = fdup(v, (size_t)n);
            dfl_adamw a = {.p = rp, .g = g, .m = rm, .v = rv, .n = n, .lr = c->lr, .beta1 = c->b1,
                           .beta2 = c->b2, .eps = c->eps, .weight_decay = c->wd, .step = c->step,
                           .grad_scale = c->scale ? &gs : NULL, .skip = &skip};
            T_CHECK(g_cpu->ops->adamw(g_cpu, &a) == 0, "cpu adamw");
            char what[200];
            snprintf(what, sizeof what, "adamw %s n%lld step %lld lr %g b %g/%g wd %g%s%s%s%s", md[k].name,
                     (long long)n, (long long)c->step, (double)c->lr, (double)c->b1, (double)c->b2,
                     (double)c->wd, c->scale ? " scaled" : "", c->skip ? " SKIP" : "",
                     c->p_act ? " p_act" : "", c->skew ? " misaligned" : "");
            gbuf gp, gg, gm, gv, gpa, gsc, gsk;
            bool ok = gb_alloc_skew(&gp, be, (size_t)n, DFL_F32, (size_t)c->skew * 4) &&
                      gb_alloc(&gg, be, (size_t)n, DFL_F32) && gb_alloc(&gm, be, (size_t)n, DFL_F32) &&
                      gb_alloc(&gv, be, (size_t)n, DFL_F32) && gb_alloc(&gpa, be, (size_t)n, md[k].dt) &&
                      gb_alloc(&gsc, be, 1, DFL_F32) && gb_alloc(&gsk, be, 1, DFL_I32);
            if (ok) {
                gb_set(&gg, g);
                gb_set_raw(&gsc, &gs);
                gb_set_raw(&gsk, &skip);
                uint8_t *img[2][4] = {{0}};
                for (int run = 0; run < 2; run++) {
                    gb_set(&gp, p);
                    gb_set(&gm, m);
                    gb_set(&gv, v);
                    gb_nan(&gpa);
                    dfl_adamw ga = a;
                    ga.p = (float *)gp.p;
                    ga.g = (float *)gg.p;
                    ga.m = (float *)gm.p;
                    ga.v = (float *)gv.p;
                    ga.p_act = c->p_act ? gpa.p : NULL;
                    ga.grad_scale = c->scale ? (const float *)gsc.p : NULL;
                    ga.skip = (const int32_t *)gsk.p;
                    check_rc(be->ops->adamw(be, &ga), be, what);
                    sync_ok(be, what);
                    img[run][0] = gb_image(&gp);
                    img[run][1] = gb_image(&gm);
                    img[run][2] = gb_image(&gv);
                    img[run][3] = gb_image(&gpa);
                }
                const float *gpv = (const float *)img[0][0], *gmv = (const float *)img[0][1],
                            *gvv = (const float *)img[0][2];
                const float *ref[3] = {rp, rm, rv}, *got[3] = {gpv, gmv, gvv};
                static const char *nmv[3] = {"p", "m", "v"};
                for (int t = 0; t < 3; t++) {
                    int64_t diff_bits = 0, bad = 0, first = -1;
                    for (int64_t i = 0; i < n; i++) {
                        if (memcmp(&got[t][i], &ref[t][i], 4) != 0)
                            diff_bits++;
                        double tol = ldexp(fabs((double)ref[t][i]), -20);
                        if (!(fabs((double)got[t][i] - ref[t][i]) <= tol)) {
                            if (first < 0)
                                first = i;
                            bad++;
                        }
                    }
                    printf("#   %-64s %s: %lld of %lld elements not bit-identical to the CPU, %lld out of "
                           "tolerance\n", what, nmv[t], (long long)diff_bits, (long long)n, (long long)bad);
                    T_CHECK(bad == 0, "%s: %s: %lld elements out of tolerance; first [%lld]: gpu %.9g cpu %.9g",
                            what, nmv[t], (long long)bad, (long long)first, first >= 0 ? (double)got[t][first] : 0.0,
                            first >= 0 ? (double)ref[t][first] : 0.0);
                }
                if (c->p_act) {
                    /* p_act = the GPU's own p rounded to the act type; untouched when skipped */
                    size_t es = dfl_dtype_size(md[k].dt);
                    uint8_t *want = xmalloc((size_t)n * es);
                    if (c->skip)
                        memset(want, 0xFF, (size_t)n * es);
                    else
                        dfl_convert(want, md[k].dt, gpv, DFL_F32, (size_t)n);
                    cmp_bytes(c->skip ? "adamw: p_act written on a skipped step" : "adamw: p_act is not p rounded",
                              img[0][3], want, (size_t)n * es);
                    free(want);
                }
                for (int t = 0; t < 4; t++)
                    cmp_same("adamw", img[0][t], img[1][t], t == 3 ? gpa.bytes : gp.bytes, 4);
                for (int i = 0; i < 2; i++)
                    for (int j = 0; j < 4; j++)
                        free(img[i][j]);
                gb_check_guards(&gp, what);
                gb_check_guards(&gm, what);
                gb_check_guards(&gv, what);
                gb_check_guards(&gpa, what);
            }
            gb_free(&gp);
            gb_free(&gg);
            gb_free(&gm);
            gb_free(&gv);
            gb_free(&gpa);
            gb_free(&gsc);
            gb_free(&gsk);
            free(p);
            free(g);
            free(m);
            free(v);
            free(rp);
            free(rm);
            free(rv);
        }
}

/* ------------------------------------------------------------------------------------------ */
/* uniform_noise */

static void test_uniform_noise(void)
{
    NEED_GPU();
    static const int64_t sizes[] = {1, 1000, 1000003};
    static const uint64_t seeds[] = {0, 42, 0xFFFFFFFFFFFFFFFFull};
    struct mode md[2];
    int nm = modes(md);
    for (int k = 0; k < nm; k++)
        for (size_t si = 0; si < sizeof sizes / sizeof sizes[0]; si++)
            for (size_t sd = 0; sd < sizeof seeds / sizeof seeds[0]; sd++) {
                dfl_be *be = md[k].be;
                const int64_t n = sizes[si];
                const float amp = 0.0625f * (float)(sd + 1);
                float *x = rnd((size_t)n, 1, 0, md[k].bf16), *ref = fdup(x, (size_t)n);
                T_CHECK(g_cpu->ops->uniform_noise(g_cpu, ref, n, amp, seeds[sd]) == 0, "cpu uniform_noise");
                if (md[k].bf16)
                    for (int64_t i = 0; i < n; i++)
                        ref[i] = round_bf16(ref[i]);
                char what[120];
                snprintf(what, sizeof what, "uniform_noise %s n%lld seed %llu amp %g", md[k].name, (long long)n,
                         (unsigned long long)seeds[sd], (double)amp);
                gbuf gx;
                if (gb_alloc(&gx, be, (size_t)n, md[k].dt)) {
                    gb_set(&gx, x);
                    check_rc(be->ops->uniform_noise(be, gx.p, n, amp, seeds[sd]), be, what);
                    sync_ok(be, what);
                    float *got = xmalloc((size_t)n * sizeof *got);
                    gb_get(&gx, got);
                    int64_t bad = 0, first = -1;
                    for (int64_t i = 0; i < n; i++)
                        if (memcmp(&got[i], &ref[i], 4) != 0) {
                            if (first < 0)
                                first = i;
                            bad++;
                        }
                    printf("#   %-64s %lld of %lld differ from the CPU\n", what, (long long)bad, (long long)n);
                    T_CHECK(bad == 0, "%s: %lld values differ; first [%lld]: gpu %.9g cpu %.9g", what,
                            (long long)bad, (long long)first, first >= 0 ? (double)got[first] : 0.0,
                            first >= 0 ? (double)ref[first] : 0.0);
                    free(got);
                    gb_check_guards(&gx, what);
                }
                gb_free(&gx);
                free(x);
                free(ref);
            }
}

#else /* no CUDA in this build */

static void test_gpu_train_ops(void) { T_SKIP("no CUDA GPU (this build has no CUDA support)"); }

#endif

int main(int argc, char **argv)
{
    (void)argc;
    t_init(argv[0]);
#ifdef DFL_CUDA
    if (!gpu_open_backends(argv[0]))
        return 1;
    T_RUN(test_clip_scale);
    T_RUN(test_block_metrics);
    T_RUN(test_gather_rows);
    T_RUN(test_segment_sum);
    T_RUN(test_uniform_noise);
    T_RUN(test_sumsq);
    T_RUN(test_adamw);
    T_RUN(test_swiglu_bwd);
    T_RUN(test_rmsnorm_bwd);
    T_RUN(test_qknorm_rope_bwd);
    T_RUN(test_norm_bwd_forms);
    T_RUN(test_lmce);
    T_RUN(test_dflash_attn_empty);
    T_RUN(test_dflash_attn);
    gpu_close_backends();
#else
    T_RUN(test_gpu_train_ops);
#endif
    return t_done();
}
