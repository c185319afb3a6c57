/* gpu-hybrid.c: the CUDA ops of hybrid targets (kernels/hybrid.cu) against the CPU ops
 * (lib/backends/be_cpu_hybrid.c), with bf16 and f32 activations, on inputs rounded to the
 * activation type (so both sides see the same numbers): zero-centred RMSNorm, q/k norm with
 * partial RoPE, the sigmoid gate, the per-sequence conv1d + SiLU (both on rows the 8-channel
 * kernels take and on rows they do not), L2 norm, gated RMSNorm (on heads of 128 in 16-byte rows,
 * which the 8-channel kernels take, and of 32 in rows they do not); and the
 * chunked gated delta rule against the CPU's token-by-token recurrence on packed sequences of
 * 1, 63, 64, 65 and 5000 tokens, key/value head dims 64 and 128 and several head ratios (bf16
 * with key head dim 64 or 128 and value head dim a multiple of 64 runs on tensor cores, the
 * two-pass form with the bf16 mma.sync passes, and those cases run the one-kernel form, the
 * two-pass form with the TF32 passes (DFL_CUDA_GDN_MMA=0) and with the TF32 key-side pass and the
 * mma.sync state pass (=2), and with the state pass on 16 warps a block (DFL_CUDA_GDN_STATE_WARPS=16)
 * too; the rest the SIMT kernel), with
 * the random gates' fast decays and with slow ones, and at the Qwen3.5-27B shape the three
 * timed and compared. Every
 * device buffer has guard bands checked after the op, outputs start as NaN bytes, and every
 * comparison fails on NaN. Tolerances (max over rows of ||gpu - cpu|| / ||cpu||): f32 1e-4 (the
 * delta rule: 1e-4 against the recurrence), bf16 1e-2 (one bf16 rounding of the output, 2^-9,
 * plus the rounding of intermediate inputs). Skips without a GPU (exit 77). */
#include <math.h>
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "backend.h"
#include "dtype.h"
#include "util.h"
#include "../unit/t.h"

#ifdef DFL_CUDA
#include "../../kernels/cuda.h"
#include "gpu-test.h"

static dfl_be *cpu_be, *gpu_be;

static bool open_gpu(dfl_dtype act)
{
    dfl_err e = {0};
    dfl_be_close(gpu_be);
    gpu_be = NULL;
    if (dfl_be_cuda_open(&gpu_be, 0, act, &e)) {
        T_CHECK(0, "cuda: %s", e.msg);
        return false;
    }
    return true;
}

/* random host values, rounded to act when it is bf16 */
static float *vals(size_t n, float scale, float offset, dfl_dtype act)
{
    return rnd(n, scale, offset, act == DFL_BF16);
}

/* device copy of x (n values of act), with guard bands */
static bool dev(gbuf *b, const float *x, size_t n, dfl_dtype dt)
{
    if (!gb_alloc(b, gpu_be, n, dt))
        return false;
    if (x)
        gb_set(b, x);
    return true;
}

/* max over R rows of n (stride ld) of the relative error (the absolute error of a zero row of
 * want); NaN sticks */
static double rows_err(const float *got, const float *want, int64_t R, int64_t n, int64_t ld)
{
    return t_rows_err(got, ld, want, ld, R, n, 1.0);
}

static double tol_of(dfl_dtype act) { return act == DFL_F32 ? 1e-4 : 1e-2; }

/* Downloads b, checks its guards, compares rows [R, n] (stride ld) with want. */
static void check_out(gbuf *b, const float *want, int64_t R, int64_t n, int64_t ld, dfl_dtype act,
                      const char *what)
{
    float *got = xmalloc(b->n * sizeof *got);
    gb_get(b, got);
    gb_check_guards(b, what);
    double err = rows_err(got, want, R, n, ld);
    printf("# %s (%s): max row rel err %.3g\n", what, dfl_dtype_lower(act), err);
    T_CHECK(err <= tol_of(act), "%s (%s): max row rel err %.3g", what, dfl_dtype_lower(act), err);
    free(got);
}

static void test_small_ops(dfl_dtype act)
{
    if (!open_gpu(act))
        return;
    const int64_t R = 37, n = 96, ld = 100;
    /* rmsnorm_1p */
    {
        float *x = vals((size_t)(R * n), 1.0f, 0.2f, act), *w = vals((size_t)n, 0.3f, 0.0f, act);
        float *y = xmalloc((size_t)(R * n) * 4);
        cpu_be->ops->rmsnorm_1p(cpu_be, y, x, w, R, n, 1e-6f);
        gbuf gx, gw, gy;
        if (dev(&gx, x, (size_t)(R * n), act) && dev(&gw, w, (size_t)n, act) &&
            dev(&gy, NULL, (size_t)(R * n), act)) {
            T_CHECK(gpu_be->ops->rmsnorm_1p(gpu_be, gy.p, gx.p, gw.p, R, n, 1e-6f) == 0, "launch");
            sync_ok(gpu_be, "rmsnorm_1p");
            check_out(&gy, y, R, n, n, act, "rmsnorm_1p");
        }
        gb_free(&gx); gb_free(&gw); gb_free(&gy);
        free(x); free(w); free(y);
    }
    /* qknorm_rope_partial: 3 heads of 64 (rot 16) and of 128 (rot 32), rows of stride ld */
    int dims[2][2] = {{64, 16}, {128, 32}};
    for (int c = 0; c < 2; c++) {
        int d = dims[c][0], rot = dims[c][1], heads = 3;
        int64_t lq = heads * d + 8;
        float *x = vals((size_t)(R * lq), 1.0f, 0.0f, act), *w = vals((size_t)d, 0.3f, 0.0f, act);
        int32_t *pos = xmalloc((size_t)R * 4);
        for (int64_t r = 0; r < R; r++)
            pos[r] = (int32_t)((r * 977) % 5000);
        float *y = fdup(x, (size_t)(R * lq));
        cpu_be->rope_dtype = gpu_be->rope_dtype = DFL_BF16;
        cpu_be->ops->qknorm_rope_partial(cpu_be, y, lq, w, pos, R, heads, d, rot, 1e-6f, 1e7f);
        gbuf gx, gw, gp;
        if (dev(&gx, x, (size_t)(R * lq), act) && dev(&gw, w, (size_t)d, act) &&
            gb_alloc(&gp, gpu_be, (size_t)R, DFL_I32)) {
            gb_set_raw(&gp, pos);
            T_CHECK(gpu_be->ops->qknorm_rope_partial(gpu_be, gx.p, lq, gw.p, (const int32_t *)gp.p, R, heads, d, rot,
                                                     1e-6f, 1e7f) == 0, "launch");
            sync_ok(gpu_be, "qknorm_rope_partial");
            /* the 8 columns past the heads are left alone (NaN-free input there) */
            check_out(&gx, y, R, lq, lq, act, d == 64 ? "qknorm_rope_partial d64" : "qknorm_rope_partial d128");
        }
        gb_free(&gx); gb_free(&gw); gb_free(&gp);
        free(x); free(w); free(y); free(pos);
    }
    /* sigmoid_mul, l2norm, gated_rmsnorm on strided rows: 3 heads of 32 in rows of stride 100, and
     * (bf16: the 8-channel kernels of hybrid_ew.cuh) of 128 in rows of stride 392 */
    for (int lay = 0; lay < 2; lay++) {
        const int d = lay ? 128 : 32;
        const int64_t ldl = lay ? 392 : ld, nl = 3 * (int64_t)d;
        float *x = vals((size_t)(R * ldl), 1.0f, 0.0f, act), *g = vals((size_t)(R * ldl), 3.0f, 0.0f, act);
        float *w = vals((size_t)d, 0.5f, 1.0f, act);
        float *y1 = fdup(x, (size_t)(R * ldl)), *y2 = fdup(x, (size_t)(R * ldl)), *y3 = fdup(x, (size_t)(R * ldl));
        cpu_be->ops->sigmoid_mul(cpu_be, y1, ldl, g, ldl, R, nl);
        cpu_be->ops->l2norm(cpu_be, y2, ldl, R, 3, d, 0.17f, 1e-6f);
        cpu_be->ops->gated_rmsnorm(cpu_be, y3, ldl, g, ldl, w, R, 3, d, 1e-6f);
        gbuf g1, g2, g3, gg, gw;
        if (dev(&g1, x, (size_t)(R * ldl), act) && dev(&g2, x, (size_t)(R * ldl), act) &&
            dev(&g3, x, (size_t)(R * ldl), act) && dev(&gg, g, (size_t)(R * ldl), act) &&
            dev(&gw, w, (size_t)d, act)) {
            T_CHECK(gpu_be->ops->sigmoid_mul(gpu_be, g1.p, ldl, gg.p, ldl, R, nl) == 0, "launch");
            T_CHECK(gpu_be->ops->l2norm(gpu_be, g2.p, ldl, R, 3, d, 0.17f, 1e-6f) == 0, "launch");
            T_CHECK(gpu_be->ops->gated_rmsnorm(gpu_be, g3.p, ldl, gg.p, ldl, gw.p, R, 3, d, 1e-6f) == 0,
                    "launch");
            sync_ok(gpu_be, "gate ops");
            check_out(&g1, y1, R, ldl, ldl, act, "sigmoid_mul");
            check_out(&g2, y2, R, ldl, ldl, act, "l2norm");
            check_out(&g3, y3, R, ldl, ldl, act, "gated_rmsnorm");
        }
        gb_free(&g1); gb_free(&g2); gb_free(&g3); gb_free(&gg); gb_free(&gw);
        free(x); free(g); free(w); free(y1); free(y2); free(y3);
    }
    /* conv1d_silu over packed sequences of 1, 2, 7 and 30 tokens, K = 4: C 70 (one channel a
     * thread) and, 16-byte rows, C 1096 (bf16: 8 channels a thread, kernels/hybrid_ew.cuh) */
    for (int shape = 0; shape < 2; shape++) {
        int32_t lens[4] = {1, 2, 7, 30};
        int64_t T = 40, C = shape ? 1096 : 70, lx = shape ? 1112 : 90;
        int32_t *pos = xmalloc((size_t)T * 4);
        for (int s = 0, row = 0; s < 4; s++)
            for (int j = 0; j < lens[s]; j++)
                pos[row++] = j;
        float *x = vals((size_t)(T * lx), 1.0f, 0.0f, act), *w = vals((size_t)(C * 4), 0.5f, 0.0f, act);
        float *y = xmalloc((size_t)(T * C) * 4);
        cpu_be->ops->conv1d_silu(cpu_be, y, C, x, lx, w, pos, T, C, 4);
        gbuf gx, gw, gy, gp;
        if (dev(&gx, x, (size_t)(T * lx), act) && dev(&gw, w, (size_t)(C * 4), act) &&
            dev(&gy, NULL, (size_t)(T * C), act) && gb_alloc(&gp, gpu_be, (size_t)T, DFL_I32)) {
            gb_set_raw(&gp, pos);
            T_CHECK(gpu_be->ops->conv1d_silu(gpu_be, gy.p, C, gx.p, lx, gw.p, (const int32_t *)gp.p, T, C, 4) == 0,
                    "launch");
            sync_ok(gpu_be, "conv1d_silu");
            check_out(&gy, y, T, C, C, act, shape ? "conv1d_silu C 1096" : "conv1d_silu C 70");
        }
        gb_free(&gx); gb_free(&gw); gb_free(&gy); gb_free(&gp);
        free(x); free(w); free(y); free(pos);
    }
    /* sigmoid_mul on 16-byte rows (bf16: 8 columns a thread); the 8 columns past n left alone */
    {
        const int64_t R2 = 37, n2 = 96, l2 = 104;
        float *x = vals((size_t)(R2 * l2), 1.0f, 0.0f, act), *g = vals((size_t)(R2 * l2), 3.0f, 0.0f, act);
        float *y = fdup(x, (size_t)(R2 * l2));
        cpu_be->ops->sigmoid_mul(cpu_be, y, l2, g, l2, R2, n2);
        gbuf gx, gg;
        if (dev(&gx, x, (size_t)(R2 * l2), act) && dev(&gg, g, (size_t)(R2 * l2), act)) {
            T_CHECK(gpu_be->ops->sigmoid_mul(gpu_be, gx.p, l2, gg.p, l2, R2, n2) == 0, "launch");
            sync_ok(gpu_be, "sigmoid_mul");
            check_out(&gx, y, R2, l2, l2, act, "sigmoid_mul, 16-byte rows");
        }
        gb_free(&gx); gb_free(&gg);
        free(x); free(g); free(y);
    }
}

static void test_small_ops_bf16(void) { if (!dfl_be_cuda_available()) T_SKIP("no CUDA GPU"); test_small_ops(DFL_BF16); }
static void test_small_ops_f32(void) { if (!dfl_be_cuda_available()) T_SKIP("no CUDA GPU"); test_small_ops(DFL_F32); }

/* b's data back to NaN bytes (as gb_alloc leaves it) */
static void nan_fill(gbuf *b)
{
    uint8_t *h = xmalloc(b->bytes);
    memset(h, 0xFF, b->bytes);
    gb_set_raw(b, h);
    free(h);
}

/* The op (and, where it takes tensor cores, the one-kernel form dfl_cuda_gated_delta_fused) against
 * the CPU recurrence: sequences lens[] packed, Hk / Hv heads of dk / dv. slow: slow decays (|g|
 * about 1e-3 to 0.1 per token, where the state carried over chunk boundaries shapes the output),
 * else the decays of the random gates (a few tenths per token and more). */
static void delta_case(dfl_dtype act, const int32_t *lens, int S, int Hk, int Hv, int dk, int dv,
                       bool slow)
{
    int32_t cu[16];
    cu[0] = 0;
    for (int s = 0; s < S; s++)
        cu[s + 1] = cu[s] + lens[s];
    int64_t T = cu[S], ldqk = 2 * (int64_t)Hk * dk + Hv * (int64_t)dv, ldab = 2 * Hv, ldo = (int64_t)Hv * dv;
    float *qkv = vals((size_t)(T * ldqk), 1.0f, 0.0f, DFL_F32), *ab = vals((size_t)(T * ldab), 1.5f, 0.0f, act);
    /* L2-normalised q (scaled) and k as the layer gives them, then rounded to act */
    cpu_be->ops->l2norm(cpu_be, qkv, ldqk, T, Hk, dk, 1.0f / sqrtf((float)dk), 1e-6f);
    cpu_be->ops->l2norm(cpu_be, qkv + (int64_t)Hk * dk, ldqk, T, Hk, dk, 1.0f, 1e-6f);
    if (act == DFL_BF16)
        for (int64_t i = 0; i < T * ldqk; i++)
            qkv[i] = round_bf16(qkv[i]);
    float *A_log = vals((size_t)Hv, 1.0f, slow ? -4.0f : -0.5f, DFL_F32);
    float *dtb = vals((size_t)Hv, 0.5f, slow ? -1.0f : 0.0f, DFL_F32);
    float *want = xmalloc((size_t)(T * ldo) * 4);
    int32_t max_len = 0;
    for (int s = 0; s < S; s++)
        max_len = lens[s] > max_len ? lens[s] : max_len;
    dfl_gated_delta g = {
        .q = qkv, .k = qkv + (int64_t)Hk * dk, .ldqk = ldqk, .v = qkv + 2 * (int64_t)Hk * dk,
        .ldv = ldqk, .b = ab, .a = ab + Hv, .ldab = ldab, .A_log = A_log, .dt_bias = dtb,
        .o = want, .ldo = ldo, .cu_seqlens = cu, .n_seqs = S, .max_len = max_len, .T = T,
        .Hk = Hk, .Hv = Hv, .dk = dk, .dv = dv, .chunk = 0,
    };
    T_CHECK(cpu_be->ops->gated_delta(cpu_be, &g) == 0, "cpu recurrence");
    gbuf gq, gab, gA, gd, go, gcu;
    if (dev(&gq, qkv, (size_t)(T * ldqk), act) && dev(&gab, ab, (size_t)(T * ldab), act) &&
        dev(&gA, A_log, (size_t)Hv, DFL_F32) && dev(&gd, dtb, (size_t)Hv, DFL_F32) &&
        dev(&go, NULL, (size_t)(T * ldo), act) && gb_alloc(&gcu, gpu_be, (size_t)S + 1, DFL_I32)) {
        gb_set_raw(&gcu, cu);
        dfl_gated_delta d = g;
        size_t es = dfl_dtype_size(act);
        d.q = gq.p;
        d.k = gq.p + (size_t)Hk * dk * es;
        d.v = gq.p + 2 * (size_t)Hk * dk * es;
        d.b = gab.p;
        d.a = gab.p + (size_t)Hv * es;
        d.A_log = (const float *)gA.p;
        d.dt_bias = (const float *)gd.p;
        d.o = go.p;
        d.cu_seqlens = (const int32_t *)gcu.p;
        d.chunk = 64;
        static const char *const form[5] = {"op", "one-kernel form", "op, TF32 passes", "op, TF32 key-side pass",
                                            "op, 16-warp state pass"};
        for (int f = 0; f < (act == DFL_BF16 ? 5 : 1); f++) {
            nan_fill(&go);
            if (f == 2 || f == 3)
                setenv("DFL_CUDA_GDN_MMA", f == 2 ? "0" : "2", 1);
            if (f == 4)
                setenv("DFL_CUDA_GDN_STATE_WARPS", "16", 1);
            T_CHECK((f == 1 ? dfl_cuda_gated_delta_fused(gpu_be, &d) : gpu_be->ops->gated_delta(gpu_be, &d)) == 0,
                    "launch");
            unsetenv("DFL_CUDA_GDN_MMA");
            unsetenv("DFL_CUDA_GDN_STATE_WARPS");
            sync_ok(gpu_be, "gated delta");
            float *got = xmalloc((size_t)(T * ldo) * 4);
            gb_get(&go, got);
            gb_check_guards(&go, "gated delta output");
            for (int s = 0; s < S; s++) {
                double err = rows_err(got + cu[s] * ldo, want + cu[s] * ldo, lens[s], ldo, ldo);
                printf("# gated delta %s (%s) Hk %d Hv %d dk %d dv %d%s, sequence of %d: rel %.3g\n",
                       form[f], dfl_dtype_lower(act), Hk, Hv, dk, dv, slow ? " slow decays" : "", lens[s], err);
                T_CHECK(err <= tol_of(act), "gated delta %s (%s) Hk %d Hv %d dk %d dv %d%s, sequence of %d: "
                        "rel %.3g", form[f], dfl_dtype_lower(act), Hk, Hv, dk, dv, slow ? " slow decays" : "",
                        lens[s], err);
            }
            free(got);
        }
    }
    gb_free(&gq); gb_free(&gab); gb_free(&gA); gb_free(&gd); gb_free(&go); gb_free(&gcu);
    free(qkv); free(ab); free(A_log); free(dtb); free(want);
}

static void test_delta(dfl_dtype act)
{
    if (!open_gpu(act))
        return;
    /* DFL_GPU_QUICK (for compute-sanitizer runs): 300 tokens instead of 5000 */
    const int32_t lens[] = {1, 63, 64, 65, getenv("DFL_GPU_QUICK") ? 300 : 5000};
    struct { int Hk, Hv, dk, dv; } cases[] = {
        {1, 1, 128, 128}, {2, 6, 128, 128}, {2, 4, 64, 64}, {1, 3, 64, 128}, {2, 2, 32, 32},
        {1, 2, 128, 192}, {2, 2, 128, 96},
    };
    for (size_t i = 0; i < sizeof cases / sizeof cases[0]; i++)
        delta_case(act, lens, 5, cases[i].Hk, cases[i].Hv, cases[i].dk, cases[i].dv, false);
    delta_case(act, lens, 5, 2, 6, 128, 128, true);
    delta_case(act, lens, 5, 2, 4, 64, 64, true);
    /* sizes the kernel does not take: a clear error, nothing launched */
    dfl_gated_delta bad = {.Hk = 2, .Hv = 3, .dk = 64, .dv = 64, .chunk = 64};
    dfl_err e = {0};
    T_CHECK(gpu_be->ops->gated_delta(gpu_be, &bad) == DFL_EUNSUP, "Hv 3 over Hk 2 refused");
    T_CHECK(gpu_be->ops->sync(gpu_be, &e) == DFL_EUNSUP && strstr(e.msg, "multiple of the key heads"),
            "message: %s", e.msg);
    bad = (dfl_gated_delta){.Hk = 1, .Hv = 1, .dk = 512, .dv = 64, .chunk = 64};
    T_CHECK(gpu_be->ops->gated_delta(gpu_be, &bad) == DFL_EUNSUP, "dk 512 refused");
    T_CHECK(gpu_be->ops->sync(gpu_be, &e) == DFL_EUNSUP && strstr(e.msg, "key head dim 512"),
            "message: %s", e.msg);
}

/* Why a speed test is skipped (no GPU, or DFL_GPU_QUICK), or NULL */
static const char *speed_skip(void)
{
    return !dfl_be_cuda_available() ? "no CUDA GPU" : getenv("DFL_GPU_QUICK") ? "DFL_GPU_QUICK" : NULL;
}

/* Time per call of one gated delta rule launcher (warm-up, then the mean of reps calls). */
static double delta_time(int (*run)(dfl_be *, const dfl_gated_delta *), const dfl_gated_delta *d,
                         int reps)
{
    T_CHECK(run(gpu_be, d) == 0, "warm-up");
    sync_ok(gpu_be, "warm-up");
    double t0 = dfl_now();
    for (int i = 0; i < reps; i++)
        run(gpu_be, d);
    sync_ok(gpu_be, "timed");
    return (dfl_now() - t0) / reps;
}

static int delta_op(dfl_be *be, const dfl_gated_delta *d) { return be->ops->gated_delta(be, d); }
static int delta_key_pass(dfl_be *be, const dfl_gated_delta *d) { return dfl_cuda_gated_delta_pass(be, d, 1); }
static int delta_state_pass(dfl_be *be, const dfl_gated_delta *d) { return dfl_cuda_gated_delta_pass(be, d, 2); }

/* The delta rule at the Qwen3.5-27B shape (16 key / 48 value heads of 128, bf16), 8 sequences
 * of 2048 tokens: time per call and model FLOP/s of the op (the two-pass tensor-core form) and, in
 * the same run, of the one-kernel tensor-core form (dfl_cuda_gated_delta_fused) and of the SIMT
 * kernel (dfl_cuda_gated_delta_simt); each output must agree with the SIMT kernel's within the
 * bf16 tolerance. FLOPs counted per value head and chunk of L tokens as the chunked
 * algorithm's essential products: the lower triangles of K K^T and Q K^T (2 L^2 dk), the
 * triangular solve and the intra-chunk Aqk Vn (2 L^2 dv), and K S, Q S and the state update
 * K^T Vn (6 L dk dv); the one-kernel forms' recomputation of K K^T and Q K^T for each slice of
 * value columns is not counted. */
static void test_delta_speed_27b(void)
{
    const char *why = speed_skip();
    if (why)
        T_SKIP("%s", why);
    if (!open_gpu(DFL_BF16))
        return;
    const int Hk = 16, Hv = 48, dk = 128, dv = 128, S = 8, Ls = 2048, L = 64;
    int64_t T = (int64_t)S * Ls, ldqk = 2 * Hk * dk + Hv * dv, ldab = 2 * Hv, ldo = (int64_t)Hv * dv;
    int32_t cu[9];
    for (int s = 0; s <= S; s++)
        cu[s] = s * Ls;
    float *x = vals((size_t)(T * ldqk), 0.05f, 0.0f, DFL_BF16), *ab = vals((size_t)(T * ldab), 1.0f, 0.0f, DFL_BF16);
    float *A_log = vals((size_t)Hv, 0.5f, 0.0f, DFL_F32), *dtb = vals((size_t)Hv, 0.5f, 0.0f, DFL_F32);
    gbuf gq, gab, gA, gd, go, gf, gs, gt, gcu;
    if (dev(&gq, x, (size_t)(T * ldqk), DFL_BF16) && dev(&gab, ab, (size_t)(T * ldab), DFL_BF16) &&
        dev(&gA, A_log, (size_t)Hv, DFL_F32) && dev(&gd, dtb, (size_t)Hv, DFL_F32) &&
        dev(&go, NULL, (size_t)(T * ldo), DFL_BF16) && dev(&gf, NULL, (size_t)(T * ldo), DFL_BF16) &&
        dev(&gs, NULL, (size_t)(T * ldo), DFL_BF16) && dev(&gt, NULL, (size_t)(T * ldo), DFL_BF16) &&
        gb_alloc(&gcu, gpu_be, 9, DFL_I32)) {
        gb_set_raw(&gcu, cu);
        dfl_gated_delta d = {
            .q = gq.p, .k = gq.p + (size_t)Hk * dk * 2, .ldqk = ldqk, .v = gq.p + (size_t)2 * Hk * dk * 2,
            .ldv = ldqk, .b = gab.p, .a = gab.p + (size_t)Hv * 2, .ldab = ldab,
            .A_log = (const float *)gA.p, .dt_bias = (const float *)gd.p, .o = go.p, .ldo = ldo,
            .cu_seqlens = (const int32_t *)gcu.p, .n_seqs = S, .max_len = Ls, .T = T, .Hk = Hk,
            .Hv = Hv, .dk = dk, .dv = dv, .chunk = 64,
        };
        double sec_key = delta_time(delta_key_pass, &d, 10), sec_state = delta_time(delta_state_pass, &d, 10);
        double sec = delta_time(delta_op, &d, 10);
        /* the TF32 passes (DFL_CUDA_GDN_MMA=0; the key-side pass also writes Qe and Kd), and the
         * TF32 key-side pass with the mma.sync state pass (=2) */
        dfl_gated_delta dt = d;
        dt.o = gt.p;
        setenv("DFL_CUDA_GDN_MMA", "2", 1);
        double t2_key = delta_time(delta_key_pass, &dt, 10), t2_state = delta_time(delta_state_pass, &dt, 10);
        double sec_2 = delta_time(delta_op, &dt, 10);
        unsetenv("DFL_CUDA_GDN_MMA");
        setenv("DFL_CUDA_GDN_STATE_WARPS", "16", 1);
        double t16_state = delta_time(delta_state_pass, &dt, 10), sec_16 = delta_time(delta_op, &dt, 10);
        unsetenv("DFL_CUDA_GDN_STATE_WARPS");
        setenv("DFL_CUDA_GDN_MMA", "0", 1);
        double tk_key = delta_time(delta_key_pass, &dt, 10), tk_state = delta_time(delta_state_pass, &dt, 10);
        double sec_tf = delta_time(delta_op, &dt, 10);
        unsetenv("DFL_CUDA_GDN_MMA");
        dfl_gated_delta df = d, ds = d;
        df.o = gf.p;
        ds.o = gs.p;
        double sec_fused = delta_time(dfl_cuda_gated_delta_fused, &df, 10);
        double sec_simt = delta_time(dfl_cuda_gated_delta_simt, &ds, 3);
        double flops = (double)Hv * (double)(T / L) *
                       (2.0 * L * L * dk + 2.0 * L * L * dv + 6.0 * L * dk * dv);
        float *got = xmalloc((size_t)(T * ldo) * 4), *fused = xmalloc((size_t)(T * ldo) * 4);
        float *ref = xmalloc((size_t)(T * ldo) * 4), *tf = xmalloc((size_t)(T * ldo) * 4);
        gb_get(&gt, tf);
        gb_check_guards(&gt, "gated delta (TF32 state pass) output");
        gb_get(&go, got);
        gb_get(&gf, fused);
        gb_get(&gs, ref);
        gb_check_guards(&go, "gated delta output");
        gb_check_guards(&gf, "gated delta (one-kernel form) output");
        gb_check_guards(&gs, "gated delta (SIMT) output");
        bool finite = true;
        for (int64_t i = 0; i < T * ldo; i++)
            finite &= isfinite(got[i]) && isfinite(fused[i]) && isfinite(tf[i]);
        T_CHECK(finite, "finite output");
        double err = rows_err(got, ref, T, ldo, ldo), err_f = rows_err(fused, ref, T, ldo, ldo);
        double err_t = rows_err(tf, ref, T, ldo, ldo);
        T_CHECK(err_t <= tol_of(DFL_BF16), "two-pass form, TF32 state pass vs SIMT kernel: max row rel err %.3g",
                err_t);
        T_CHECK(err <= tol_of(DFL_BF16), "two-pass form vs SIMT kernel: max row rel err %.3g", err);
        T_CHECK(err_f <= tol_of(DFL_BF16), "one-kernel form vs SIMT kernel: max row rel err %.3g", err_f);
        printf("# gated delta rule, Qwen3.5-27B shape (Hk 16, Hv 48, dk = dv = 128, bf16), 8 x 2048 "
               "tokens (%.2f GFLOP): two-pass %.3f ms, %.1f TFLOP/s; one-kernel %.3f ms, %.1f TFLOP/s; "
               "SIMT %.3f ms, %.1f TFLOP/s; two-pass %.2fx one-kernel; max row rel difference from "
               "SIMT %.3g (two-pass), %.3g (one-kernel)\n", flops / 1e9, sec * 1e3, flops / sec / 1e12,
               sec_fused * 1e3, flops / sec_fused / 1e12, sec_simt * 1e3, flops / sec_simt / 1e12,
               sec_fused / sec, err, err_f);
        printf("# gated delta rule, two-pass form's passes alone: key-side %.3f ms, state %.3f ms\n",
               sec_key * 1e3, sec_state * 1e3);
        printf("# gated delta rule, two-pass form with the TF32 passes (DFL_CUDA_GDN_MMA=0): %.3f ms, %.1f "
               "TFLOP/s (key-side %.3f ms, state %.3f ms); the bf16 mma.sync passes %.2fx it; max row rel "
               "difference from SIMT %.3g\n", sec_tf * 1e3, flops / sec_tf / 1e12, tk_key * 1e3, tk_state * 1e3,
               sec_tf / sec, err_t);
        printf("# gated delta rule, two-pass form with the TF32 key-side pass and the mma.sync state pass "
               "(DFL_CUDA_GDN_MMA=2): %.3f ms (key-side %.3f ms, state %.3f ms)\n", sec_2 * 1e3, t2_key * 1e3,
               t2_state * 1e3);
        printf("# gated delta rule, two-pass form with the mma.sync passes, the state pass on 16 warps a block "
               "(DFL_CUDA_GDN_STATE_WARPS=16): %.3f ms (state %.3f ms)\n", sec_16 * 1e3, t16_state * 1e3);
        free(tf);
        free(got);
        free(fused);
        free(ref);
    }
    gb_free(&gf);
    gb_free(&gt);
    gb_free(&gq); gb_free(&gab); gb_free(&gA); gb_free(&gd); gb_free(&go); gb_free(&gs); gb_free(&gcu);
    free(x); free(ab); free(A_log); free(dtb);
}

/* Time per call of a norm at the Qwen3.5-27B shape (warm-up, then the mean of 20): lay 0 the
 * gated RMSNorm (x [T, 48 x 128] times silu(z)), 1 the L2 norm of 16 heads of 128 (q or k). */
static double norm_time(int lay, gbuf *x, int64_t ldx, gbuf *z, int64_t ldz, gbuf *w, int64_t T)
{
    double t0 = 0;
    for (int i = 0; i < 21; i++) {
        if (i == 1) {
            sync_ok(gpu_be, "warm-up");
            t0 = dfl_now();
        }
        int rc = lay ? gpu_be->ops->l2norm(gpu_be, x->p, ldx, T, 16, 128, 1.0f, 1e-6f)
                     : gpu_be->ops->gated_rmsnorm(gpu_be, x->p, ldx, z->p, ldz, w->p, T, 48, 128, 1e-6f);
        T_CHECK(rc == 0, "norm launch");
    }
    sync_ok(gpu_be, "timed");
    return (dfl_now() - t0) / 20;
}

/* The gated RMSNorm and the L2 norm at the Qwen3.5-27B shape (8 x 2048 tokens, bf16): rows of
 * 16-byte stride (the 8-channel kernels) against rows 4 columns wider (the one-warp kernels),
 * the same values. */
static void test_norm_speed_27b(void)
{
    const char *why = speed_skip();
    if (why)
        T_SKIP("%s", why);
    if (!open_gpu(DFL_BF16))
        return;
    const int64_t T = 16384, n = 48 * 128;
    gbuf x8, z8, xs, zs, w;
    float *wv = vals(128, 0.5f, 1.0f, DFL_BF16);
    if (dev(&x8, NULL, (size_t)(T * n), DFL_BF16) && dev(&z8, NULL, (size_t)(T * n), DFL_BF16) &&
        dev(&xs, NULL, (size_t)(T * (n + 4)), DFL_BF16) && dev(&zs, NULL, (size_t)(T * (n + 4)), DFL_BF16) &&
        dev(&w, wv, 128, DFL_BF16)) {
        T_CHECK(gpu_be->ops->memset0(gpu_be, x8.p, x8.bytes) == 0 && gpu_be->ops->memset0(gpu_be, z8.p, z8.bytes) == 0 &&
                gpu_be->ops->memset0(gpu_be, xs.p, xs.bytes) == 0 && gpu_be->ops->memset0(gpu_be, zs.p, zs.bytes) == 0,
                "zeroing");
        double g8 = norm_time(0, &x8, n, &z8, n, &w, T), gs = norm_time(0, &xs, n + 4, &zs, n + 4, &w, T);
        double l8 = norm_time(1, &x8, n, NULL, 0, NULL, T), ls = norm_time(1, &xs, n + 4, NULL, 0, NULL, T);
        double gbytes = 3.0 * T * n * 2 / 1e9;
        printf("# gated RMSNorm, Qwen3.5-27B shape (16384 x 48 heads of 128, bf16): 8 channels a lane %.3f ms "
               "(%.0f GB/s of x, z read and x written), one warp a head %.3f ms (%.2fx)\n", g8 * 1e3,
               gbytes / g8, gs * 1e3, gs / g8);
        printf("# L2 norm, 16384 rows of 16 heads of 128 (bf16, one of the layer's two): 8 channels a lane %.3f ms, one warp a head "
               "%.3f ms (%.2fx)\n", l8 * 1e3, ls * 1e3, ls / l8);
    }
    gb_free(&x8); gb_free(&z8); gb_free(&xs); gb_free(&zs); gb_free(&w);
    free(wv);
}

static void test_delta_bf16(void) { if (!dfl_be_cuda_available()) T_SKIP("no CUDA GPU"); test_delta(DFL_BF16); }
static void test_delta_f32(void) { if (!dfl_be_cuda_available()) T_SKIP("no CUDA GPU"); test_delta(DFL_F32); }
#else
static void test_gpu_hybrid(void) { T_SKIP("no CUDA GPU (built without CUDA)"); }
#endif

int main(int argc, char **argv)
{
    t_init(argv[0]);
#ifdef DFL_CUDA
    if (!(cpu_be = t_cpu_backend()))
        return 1;
    T_RUN(test_small_ops_bf16);
    T_RUN(test_small_ops_f32);
    T_RUN(test_delta_f32);
    T_RUN(test_delta_bf16);
    T_RUN(test_delta_speed_27b);
    T_RUN(test_norm_speed_27b);
    dfl_be_close(gpu_be);
    dfl_be_close(cpu_be);
#else
    T_RUN(test_gpu_hybrid);
#endif
    return t_done();
}
