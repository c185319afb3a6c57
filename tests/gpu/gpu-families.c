/* gpu-families.c: the CUDA side of the target families beyond dense default-rope models: the
 * RoPE op with llama3 and yarn scaling and the mixture-of-experts ops (moe_route, moe_gather,
 * moe_matmul: for bf16 wgmma by default with K % 64 == 0 (kernels/moe_wgmma.cu), else mma.sync
 * with K % 32 == 0 (kernels/moe_gemm.cuh), WMMA with K % 8 == 0, SIMT otherwise; test_moe_ops
 * sets DFL_CUDA_MOE_WGMMA=0 and runs the bf16 cases twice, the second time with
 * DFL_CUDA_MOE_MMA=0 too, which puts the mma.sync shapes on WMMA; the fused gate|up form with
 * the gather and SwiGLU, against the CPU and bit for bit against gather + moe_matmul + swiglu;
 * every tile shape of DFL_CUDA_MOE_TILE; the wgmma kernel in every shape of DFL_CUDA_MOE_WTILE,
 * also value for value against mma.sync, the warp-specialized ones last; moe_combine), each CUDA
 * against the CPU backend on the same inputs, with guard bands around every output and
 * NaN-failing comparisons (moe_combine also with qwen3_5_moe's gated shared expert; moe_route
 * in both forms, DFL_CUDA_MOE_ROUTE 0 and 1, value for value); then the
 * Qwen3-MoE and Qwen3.5-MoE oracles (../shared/oracle/qwen3moe-tiny-a, qwen35moe-tiny-a) through
 * the CUDA backend in bf16 and f32. Routing is where
 * bf16 and f32 part ways: the test routes in f32 from the bf16 hidden state and prints how many
 * (token, sparse layer) pairs chose another expert set than the f32 reference and those tokens'
 * router-logit margins (the gap between the reference's k-th and (k+1)-th logits); rows of
 * tokens whose sets all matched must be within the bf16 bounds of gpu-target.c (relative error
 * 3e-2, cosine 0.999), f32 within 1e-4. (The llama31-tiny-a oracle runs in gpu-target.c.) Skips
 * without a GPU (exit 77). */
#include <math.h>
#include <stdint.h>
#include <stdio.h>
#include <unistd.h>
#include <stdlib.h>
#include <string.h>

#include "backend.h"
#include "dtype.h"
#include "moe.h"
#include "safetensors.h"
#include "target.h"
#include "../unit/t.h"

#ifdef DFL_CUDA
#include "gpu-test.h"

#define MOE_TILES 5 /* the tile shapes, DFL_CUDA_MOE_TILE=0..4 (kernels/moe_gemm.cuh) */
#define MG_BK_TEST 32 /* the K step of the mma.sync grouped GEMM (kernels/moe_gemm.cuh) */

static double rel_err(const float *a, const float *b, size_t n)
{
    return t_rows_err(a, 0, b, 0, 1, (int64_t)n, 1e-30);
}

/* qknorm_rope with rope scaling: CUDA against the CPU (f32 activations on both). */
static void test_rope_scaled(void)
{
    if (!dfl_be_cuda_available())
        T_SKIP("no CUDA GPU");
    dfl_err e = {0};
    dfl_be *cpu = NULL, *gpu = NULL;
    T_CHECK(dfl_be_open(&cpu, "cpu", DFL_DT_INVALID, &e) == 0, "%s", e.msg);
    T_CHECK(dfl_be_cuda_open(&gpu, 0, DFL_F32, &e) == 0, "%s", e.msg);
    if (!cpu || !gpu)
        goto out;
    dfl_rope_scaling sc[2] = {
        {.kind = DFL_ROPE_LLAMA3, .factor = 8, .low_freq_factor = 1, .high_freq_factor = 4,
         .original_max_pos = 128, .attention_factor = 1},
        {.kind = DFL_ROPE_YARN, .factor = 4, .original_max_pos = 256, .beta_fast = 32,
         .beta_slow = 1, .truncate = true, .attention_factor = 1.1386},
    };
    const int R = 300, heads = 3, d = 64;
    const int64_t ld = heads * d;
    int32_t *pos = xmalloc(sizeof(int32_t) * R);
    for (int r = 0; r < R; r++)
        pos[r] = r * 7 % 1000;
    gbuf gx, gp;
    gb_alloc(&gx, gpu, (size_t)R * ld, DFL_F32);
    gb_alloc(&gp, gpu, (size_t)R, DFL_F32); /* positions as raw int32 bytes */
    gb_set_raw(&gp, pos);
    for (int s = 0; s < 2; s++) {
        float *x = rnd((size_t)R * ld, 1.0f, 0.0f, false), *want = fdup(x, (size_t)R * ld);
        float *got = xmalloc(sizeof(float) * R * ld);
        cpu->rope_scaling = gpu->rope_scaling = &sc[s];
        T_CHECK(cpu->ops->qknorm_rope(cpu, want, NULL, ld, NULL, NULL, pos, R, heads, d, 1e-6f, 5e5f) == 0,
                "cpu");
        /* the default frequencies differ: the op must use the scaling */
        float *plain = fdup(x, (size_t)R * ld);
        cpu->rope_scaling = NULL;
        cpu->ops->qknorm_rope(cpu, plain, NULL, ld, NULL, NULL, pos, R, heads, d, 1e-6f, 5e5f);
        T_CHECK(!(rel_err(plain, want, (size_t)R * ld) <= 1e-3), "%s changes the rotation",
                dfl_rope_kind_name(sc[s].kind));
        gb_set(&gx, x);
        T_CHECK(gpu->ops->qknorm_rope(gpu, gx.p, NULL, ld, NULL, NULL, (const int32_t *)gp.p, R, heads, d,
                                      1e-6f, 5e5f) == 0, "cuda");
        sync_ok(gpu, "rope");
        gb_get(&gx, got);
        double err = rel_err(got, want, (size_t)R * ld);
        T_CHECK(err <= 1e-5, "%s rope: CUDA vs CPU %.3g", dfl_rope_kind_name(sc[s].kind), err);
        gb_check_guards(&gx, "rope");
        free(x);
        free(want);
        free(got);
        free(plain);
    }
    gpu->rope_scaling = NULL;
    gb_free(&gx);
    gb_free(&gp);
    free(pos);
out:
    dfl_be_close(cpu);
    dfl_be_close(gpu);
}

/* With DFL_CUDA_MOE_WGMMA=1 in the environment: the grouped product mg (its result, from the
 * wgmma kernel where it fits, in gC) again on the mma.sync kernel (the variable 0), compared
 * value for value over the expert rows of off/cnt: the count of values that differ (another f32
 * accumulation order may round differently) and the relative error between the two, which must
 * stay within the CUDA-vs-CPU bound tol. */
static void moe_vs_mma(dfl_be *gpu, const char *what, const dfl_moe_mm *mg, gbuf *gC,
                       const int32_t *cnt, const int32_t *off, double tol)
{
    const char *wv = getenv("DFL_CUDA_MOE_WGMMA");
    if (!wv || strcmp(wv, "1") != 0)
        return;
    const int64_t Nc = mg->swiglu ? mg->N / 2 : mg->N, cap = mg->cap;
    gbuf gm;
    gb_alloc(&gm, gpu, (size_t)(cap * Nc), gpu->act);
    dfl_moe_mm m = *mg;
    m.C = gm.p;
    setenv("DFL_CUDA_MOE_WGMMA", "0", 1);
    T_CHECK(gpu->ops->moe_matmul(gpu, &m) == 0, "%s: mma.sync matmul", what);
    setenv("DFL_CUDA_MOE_WGMMA", "1", 1);
    sync_ok(gpu, "mma.sync matmul");
    float *a = xmalloc(sizeof(float) * cap * Nc), *b = xmalloc(sizeof(float) * cap * Nc);
    gb_get(gC, a);
    gb_get(&gm, b);
    int64_t differ = 0, n = 0;
    double worst = 0;
    for (int e = 0; e < mg->E; e++) {
        const int64_t o = (int64_t)off[e] * Nc, c = (int64_t)cnt[e] * Nc;
        for (int64_t i = 0; i < c; i++)
            differ += memcmp(&a[o + i], &b[o + i], sizeof(float)) != 0;
        n += c;
        worst = t_worst(worst, rel_err(a + o, b + o, (size_t)c));
    }
    T_CHECK(worst <= tol, "%s: wgmma vs mma.sync %.3g", what, worst);
    printf("# moe wgmma vs mma.sync %s%s: %lld of %lld values differ, relative %.3g\n", what,
           mg->swiglu ? " (fused gate_up)" : "", (long long)differ, (long long)n, worst);
    gb_check_guards(&gm, "mma.sync matmul");
    gb_free(&gm);
    free(a);
    free(b);
}

/* The fused gate|up form of moe_matmul (rows: A's token rows read through the route's rows;
 * swiglu: C [cap, N / 2] = silu(gate) * up) for the shape of the plain products mc (CPU) and mg
 * (CUDA, whose unfused product is in gC): CUDA against the CPU's fused op on the token rows x,
 * padding rows untouched, and bit for bit against this backend's unfused path (gather,
 * moe_matmul, swiglu: the same roundings) where both take the same kernel (f32: SIMT both; bf16:
 * mma.sync both when K % 32 == 0, SIMT both when K % 8 != 0; WMMA has no fused form). */
static void moe_fused_check(dfl_be *cpu, dfl_be *gpu, const char *what, const dfl_moe_mm *mc,
                            const dfl_moe_mm *mg, const float *x, const void *gx,
                            const int32_t *rows, const int32_t *grows, gbuf *gC)
{
    const int64_t cap = mc->cap, Nh = mc->N / 2, K = mc->K;
    const int E = mc->E;
    const int32_t *cnt = mc->counts, *off = mc->offsets;
    const bool b16 = gpu->act == DFL_BF16;
    const char *mv = getenv("DFL_CUDA_MOE_MMA");
    const bool mma_on = !(mv && strcmp(mv, "0") == 0);
    float *fa = xmalloc(sizeof(float) * cap * Nh), *fa2 = xmalloc(sizeof(float) * cap * Nh);
    dfl_moe_mm fc = *mc;
    fc.A = x;
    fc.rows = rows;
    fc.swiglu = true;
    fc.C = fa;
    T_CHECK(cpu->ops->moe_matmul(cpu, &fc) == 0, "cpu fused gate_up");
    gbuf gf, gs;
    gb_alloc(&gf, gpu, (size_t)(cap * Nh), gpu->act);
    gb_alloc(&gs, gpu, (size_t)(cap * Nh), gpu->act);
    dfl_moe_mm fg = *mg;
    fg.A = gx;
    fg.rows = grows;
    fg.swiglu = true;
    fg.C = gf.p;
    T_CHECK(gpu->ops->moe_matmul(gpu, &fg) == 0, "fused gate_up");
    T_CHECK(gpu->ops->swiglu(gpu, gs.p, gC->p, cap, Nh) == 0, "swiglu");
    sync_ok(gpu, "fused gate_up");
    gb_get(&gf, fa2);
    uint8_t *imf = gb_image(&gf), *ims = gb_image(&gs);
    const size_t es = dfl_dtype_size(gpu->act);
    double worst = 0;
    int64_t differ = 0;
    for (int e = 0; e < E; e++) {
        double err = rel_err(fa2 + (int64_t)off[e] * Nh, fa + (int64_t)off[e] * Nh,
                             (size_t)(cnt[e] * Nh));
        worst = err <= worst ? worst : err;
        if (cnt[e] < off[e + 1] - off[e])
            T_CHECK(isnan(fa2[(int64_t)(off[e] + cnt[e]) * Nh]), "%s: fused: padding row untouched",
                    what);
        for (int64_t g = off[e]; g < off[e] + cnt[e]; g++)
            differ += memcmp(imf + g * Nh * es, ims + g * Nh * es, (size_t)Nh * es) != 0;
    }
    const bool same_kernel = !b16 || K % 8 != 0 || (mma_on && K % MG_BK_TEST == 0);
    T_CHECK(worst <= (b16 ? 1e-2 : 1e-5), "%s: fused gate_up vs the CPU %.3g", what, worst);
    if (same_kernel)
        T_CHECK(differ == 0, "%s: fused gate_up differs from gather + moe_matmul + swiglu in %lld "
                "rows", what, (long long)differ);
    printf("# moe fused gate_up %s: vs CPU %.3g, rows unlike the unfused path %lld%s\n", what,
           worst, (long long)differ, same_kernel ? "" : " (another kernel: not compared)");
    if (b16)
        moe_vs_mma(gpu, what, &fg, &gf, cnt, off, 1e-2);
    gb_check_guards(&gf, "fused gate_up");
    gb_free(&gf);
    gb_free(&gs);
    free(imf);
    free(ims);
    free(fa);
    free(fa2);
}

/* The four MoE ops, CUDA against the CPU, for one shape and activation dtype; shared: the
 * combine also adds a gated shared expert (qwen3_5_moe: sigmoid(gate logit) times its output). */
static void moe_ops_case(int64_t T, int E, int k, int64_t H, int64_t N, dfl_dtype act, bool shared)
{
    dfl_err e = {0};
    dfl_be *cpu = NULL, *gpu = NULL;
    T_CHECK(dfl_be_open(&cpu, "cpu", DFL_DT_INVALID, &e) == 0, "%s", e.msg);
    T_CHECK(dfl_be_cuda_open(&gpu, 0, act, &e) == 0, "%s", e.msg);
    if (!cpu || !gpu) {
        dfl_be_close(cpu);
        dfl_be_close(gpu);
        return;
    }
    bool b16 = act == DFL_BF16;
    int64_t cap = dfl_moe_cap(T, E, k), Tk = T * k;
    char what[128];
    const char *tile = getenv("DFL_CUDA_MOE_TILE"), *mv = getenv("DFL_CUDA_MOE_MMA");
    const char *wv = getenv("DFL_CUDA_MOE_WGMMA"), *wt = getenv("DFL_CUDA_MOE_WTILE");
    const bool mma_on = !(mv && strcmp(mv, "0") == 0);
    const bool wg = mma_on && !(wv && strcmp(wv, "0") == 0); /* wgmma by default where it fits */
    snprintf(what, sizeof what, "T %lld E %d k %d H %lld N %lld %s%s%s%s%s%s%s", (long long)T, E,
             k, (long long)H, (long long)N, dfl_dtype_lower(act), shared ? " shared" : "",
             tile ? " tile " : "", tile ? tile : "", mma_on ? "" : " (MMA=0)",
             wg ? " wgmma tile " : "", wg ? (wt ? wt : "default") : "");
    /* route: same f32 logits on both */
    float *logits = rnd((size_t)(T * E), 2.0f, 0.0f, false);
    int32_t *idx = xmalloc(4 * Tk), *cnt = xmalloc(4 * E), *off = xmalloc(4 * (E + 1));
    int32_t *rows = xmalloc(4 * cap), *slot = xmalloc(4 * Tk);
    float *w = xmalloc(4 * Tk);
    dfl_moe_route r = {.logits = logits, .T = T, .E = E, .k = k, .norm_topk = true, .idx = idx,
                       .weight = w, .counts = cnt, .offsets = off, .rows = rows, .slot = slot,
                       .cap = cap};
    T_CHECK(cpu->ops->moe_route(cpu, &r) == 0, "cpu route");
    gbuf gl, gi, gw, gc, go, gr, gs;
    gb_alloc(&gl, gpu, (size_t)(T * E), DFL_F32);
    gb_alloc(&gi, gpu, (size_t)Tk, DFL_F32);
    gb_alloc(&gw, gpu, (size_t)Tk, DFL_F32);
    gb_alloc(&gc, gpu, (size_t)E, DFL_F32);
    gb_alloc(&go, gpu, (size_t)E + 1, DFL_F32);
    gb_alloc(&gr, gpu, (size_t)cap, DFL_F32);
    gb_alloc(&gs, gpu, (size_t)Tk, DFL_F32);
    gb_set(&gl, logits);
    dfl_moe_route rg = {.logits = (float *)gl.p, .T = T, .E = E, .k = k, .norm_topk = true,
                        .idx = (int32_t *)gi.p, .weight = (float *)gw.p, .counts = (int32_t *)gc.p,
                        .offsets = (int32_t *)go.p, .rows = (int32_t *)gr.p,
                        .slot = (int32_t *)gs.p, .cap = cap};
    T_CHECK(gpu->ops->moe_route(gpu, &rg) == 0, "cuda route");
    sync_ok(gpu, "route");
    int32_t *i2 = xmalloc(4 * Tk), *c2 = xmalloc(4 * E), *o2 = xmalloc(4 * (E + 1));
    int32_t *r2 = xmalloc(4 * cap), *s2 = xmalloc(4 * Tk);
    float *w2 = xmalloc(4 * Tk);
    gb_get_raw(&gi, i2);
    gb_get_raw(&gw, w2);
    gb_get_raw(&gc, c2);
    gb_get_raw(&go, o2);
    gb_get_raw(&gr, r2);
    gb_get_raw(&gs, s2);
    T_CHECK(memcmp(i2, idx, 4 * Tk) == 0, "%s: expert ids", what);
    T_CHECK(memcmp(c2, cnt, 4 * E) == 0 && memcmp(o2, off, 4 * (E + 1)) == 0, "%s: counts, offsets",
            what);
    T_CHECK(memcmp(r2, rows, 4 * (size_t)off[E]) == 0 && memcmp(s2, slot, 4 * Tk) == 0,
            "%s: rows and slots (token order within each expert)", what);
    T_CHECK(rel_err(w2, w, (size_t)Tk) <= 1e-6, "%s: weights %.3g", what, rel_err(w2, w, (size_t)Tk));
    gb_check_guards(&gi, "idx");
    gb_check_guards(&gw, "weight");
    gb_check_guards(&gc, "counts");
    gb_check_guards(&go, "offsets");
    gb_check_guards(&gr, "rows");
    gb_check_guards(&gs, "slot");
    /* gather, grouped matmul, combine: CPU results on the same (rounded) inputs */
    float *x = rnd((size_t)(T * H), 1.0f, 0.0f, b16), *W = rnd((size_t)(E * N * H), 0.1f, 0.0f, b16);
    float *xg = xmalloc(sizeof(float) * cap * H), *C = xmalloc(sizeof(float) * cap * N);
    float *out = rnd((size_t)(T * N), 1.0f, 0.0f, b16), *out0 = fdup(out, (size_t)(T * N));
    cpu->ops->moe_gather(cpu, xg, x, rows, off, E, cap, H);
    dfl_moe_mm mc = {.A = xg, .W = W, .C = C, .counts = cnt, .offsets = off, .E = E, .N = N, .K = H,
                     .cap = cap};
    T_CHECK(cpu->ops->moe_matmul(cpu, &mc) == 0, "cpu matmul");
    /* the shared expert's output and gate logits (logits wide enough to reach both tails) */
    float *sy = rnd((size_t)(T * N), 1.0f, 0.0f, b16), *sg = rnd((size_t)T, 6.0f, 0.0f, false);
    cpu->ops->moe_combine(cpu, out, C, slot, w, T, k, N, true, shared ? sy : NULL,
                          shared ? sg : NULL);
    gbuf gx, gxg, gW, gC, gout, gsy, gsg;
    gb_alloc(&gsy, gpu, (size_t)(T * N), act);
    gb_alloc(&gsg, gpu, (size_t)T, DFL_F32);
    gb_set(&gsy, sy);
    gb_set(&gsg, sg);
    gb_alloc(&gx, gpu, (size_t)(T * H), act);
    gb_alloc(&gxg, gpu, (size_t)(cap * H), act);
    gb_alloc(&gW, gpu, (size_t)(E * N * H), act);
    gb_alloc(&gC, gpu, (size_t)(cap * N), act);
    gb_alloc(&gout, gpu, (size_t)(T * N), act);
    gb_set(&gx, x);
    gb_set(&gW, W);
    gb_set(&gout, out0);
    T_CHECK(gpu->ops->moe_gather(gpu, gxg.p, gx.p, rg.rows, rg.offsets, E, cap, H) == 0, "gather");
    dfl_moe_mm mg = {.A = gxg.p, .W = gW.p, .C = gC.p, .counts = rg.counts, .offsets = rg.offsets,
                     .E = E, .N = N, .K = H, .cap = cap};
    T_CHECK(gpu->ops->moe_matmul(gpu, &mg) == 0, "matmul");
    T_CHECK(gpu->ops->moe_combine(gpu, gout.p, gC.p, rg.slot, rg.weight, T, k, N, true,
                                  shared ? gsy.p : NULL, shared ? (const float *)gsg.p : NULL) == 0,
            "combine");
    sync_ok(gpu, "moe ops");
    float *xg2 = xmalloc(sizeof(float) * cap * H), *C2 = xmalloc(sizeof(float) * cap * N);
    float *out2 = xmalloc(sizeof(float) * T * N);
    gb_get(&gxg, xg2);
    gb_get(&gC, C2);
    gb_get(&gout, out2);
    /* gathered rows are copies (padding rows zero) */
    T_CHECK(memcmp(xg2, xg, sizeof(float) * (size_t)(off[E] * H)) == 0, "%s: gather", what);
    /* expert rows of C; the rest of C (never written) is still NaN on the GPU side */
    double worst = 0;
    for (int x_ = 0; x_ < E; x_++) {
        double err = rel_err(C2 + (int64_t)off[x_] * N, C + (int64_t)off[x_] * N,
                             (size_t)(cnt[x_] * N));
        worst = err <= worst ? worst : err;
        if (cnt[x_] < off[x_ + 1] - off[x_])
            T_CHECK(isnan(C2[(int64_t)(off[x_] + cnt[x_]) * N]), "%s: padding row untouched", what);
    }
    double tol = b16 ? 1e-2 : 1e-5;
    T_CHECK(worst <= tol, "%s: grouped matmul %.3g", what, worst);
    double eo = rel_err(out2, out, (size_t)(T * N));
    T_CHECK(eo <= tol, "%s: combine %.3g", what, eo);
    printf("# moe ops %s: matmul %.3g, combine %.3g\n", what, worst, eo);
    if (b16)
        moe_vs_mma(gpu, what, &mg, &gC, cnt, off, tol);
    if (N % 2 == 0)
        moe_fused_check(cpu, gpu, what, &mc, &mg, x, gx.p, rows, rg.rows, &gC);
    gb_check_guards(&gxg, "gathered");
    gb_check_guards(&gC, "grouped matmul");
    gb_check_guards(&gout, "combine");
    gb_check_guards(&gsy, "shared expert output");
    gb_check_guards(&gsg, "shared gate");
    gbuf *all[] = {&gl, &gi, &gw, &gc, &go, &gr, &gs, &gx, &gxg, &gW, &gC, &gout, &gsy, &gsg};
    for (size_t i = 0; i < sizeof all / sizeof *all; i++)
        gb_free(all[i]);
    void *frees[] = {logits, idx, cnt, off, rows, slot, w, i2, c2, o2, r2, s2, w2, x, W, xg, C,
                     out, out0, xg2, C2, out2, sy, sg};
    for (size_t i = 0; i < sizeof frees / sizeof *frees; i++)
        free(frees[i]);
    dfl_be_close(cpu);
    dfl_be_close(gpu);
}

/* Puts name = value in the environment, or takes name out when value is NULL. */
static void env_put(const char *name, const char *value)
{
    if (value)
        setenv(name, value, 1);
    else
        unsetenv(name);
}

/* The moe ops with DFL_CUDA_MOE_WGMMA=0: the mma.sync, WMMA and SIMT kernels. */
static void test_moe_ops(void)
{
    if (!dfl_be_cuda_available())
        T_SKIP("no CUDA GPU");
    char *wg_was = getenv("DFL_CUDA_MOE_WGMMA");
    wg_was = wg_was ? strdup(wg_was) : NULL;
    setenv("DFL_CUDA_MOE_WGMMA", "0", 1);
    moe_ops_case(37, 8, 2, 96, 80, DFL_F32, false);
    moe_ops_case(37, 8, 2, 96, 80, DFL_BF16, false);
    moe_ops_case(1000, 128, 8, 256, 192, DFL_BF16, false); /* the Qwen3-30B-A3B routing shape */
    moe_ops_case(5, 7, 3, 33, 17, DFL_F32, false);   /* odd sizes: partial tiles everywhere */
    moe_ops_case(5, 7, 3, 33, 17, DFL_BF16, false);  /* K % 8 != 0: the SIMT kernel in bf16 */
    moe_ops_case(5, 7, 3, 33, 18, DFL_BF16, false);  /* the same, fused on SIMT (N even) */
    moe_ops_case(200, 16, 4, 2048, 72, DFL_BF16, false); /* long K on tensor cores, N tail */
    moe_ops_case(300, 16, 4, 768, 2048, DFL_BF16, false); /* 30B-A3B down: 16 column tiles */
    moe_ops_case(60, 8, 2, 64, 81, DFL_BF16, false);  /* odd N: mma.sync with single stores */
    moe_ops_case(37, 8, 2, 40, 80, DFL_BF16, false);  /* K % 32 != 0: the WMMA kernel */
    moe_ops_case(300, 512, 10, 64, 64, DFL_F32, false);  /* more experts than tokens */
    /* with the gated shared expert (qwen3_5_moe) */
    moe_ops_case(37, 8, 2, 96, 80, DFL_F32, true);
    moe_ops_case(37, 8, 2, 96, 80, DFL_BF16, true);
    moe_ops_case(5, 7, 3, 33, 17, DFL_BF16, true);
    moe_ops_case(700, 256, 8, 256, 128, DFL_BF16, true); /* Qwen3.5-35B-A3B's 256 experts, top 8 */
    /* the route in both forms (DFL_CUDA_MOE_ROUTE: 0 four kernels, 1 two) */
    char *rt_was = getenv("DFL_CUDA_MOE_ROUTE");
    rt_was = rt_was ? strdup(rt_was) : NULL;
    for (int f = 0; f < 2; f++) {
        setenv("DFL_CUDA_MOE_ROUTE", f ? "1" : "0", 1);
        moe_ops_case(37, 8, 2, 96, 80, DFL_F32, false);
        moe_ops_case(1000, 128, 8, 256, 192, DFL_BF16, false);
        moe_ops_case(300, 512, 10, 64, 64, DFL_F32, false);
        moe_ops_case(5000, 16, 4, 64, 64, DFL_BF16, false);
    }
    env_put("DFL_CUDA_MOE_ROUTE", rt_was);
    free(rt_was);
    /* the WMMA kernel on the shapes that take mma.sync by default */
    const char *was = getenv("DFL_CUDA_MOE_MMA");
    setenv("DFL_CUDA_MOE_MMA", "0", 1);
    moe_ops_case(1000, 128, 8, 256, 192, DFL_BF16, false);
    moe_ops_case(200, 16, 4, 2048, 72, DFL_BF16, false);
    moe_ops_case(300, 16, 4, 768, 2048, DFL_BF16, false);
    moe_ops_case(700, 256, 8, 256, 128, DFL_BF16, true);
    if (was)
        setenv("DFL_CUDA_MOE_MMA", was, 1);
    else
        unsetenv("DFL_CUDA_MOE_MMA");
    /* every tile shape of the pipelined kernel (DFL_CUDA_MOE_TILE), plain and fused */
    const char *tile_was = getenv("DFL_CUDA_MOE_TILE");
    for (int v = 0; v < MOE_TILES; v++) {
        char tv[2] = {(char)('0' + v), 0};
        setenv("DFL_CUDA_MOE_TILE", tv, 1);
        moe_ops_case(1000, 128, 8, 256, 192, DFL_BF16, false);
        moe_ops_case(200, 16, 4, 2048, 72, DFL_BF16, false);
        moe_ops_case(300, 16, 4, 768, 2048, DFL_BF16, false);
        moe_ops_case(60, 8, 2, 64, 162, DFL_BF16, false); /* N / 2 odd: single stores */
    }
    if (tile_was)
        setenv("DFL_CUDA_MOE_TILE", tile_was, 1);
    else
        unsetenv("DFL_CUDA_MOE_TILE");
    env_put("DFL_CUDA_MOE_WGMMA", wg_was);
    free(wg_was);
}

/* The moe ops on the wgmma kernel (DFL_CUDA_MOE_WGMMA=1, K % 64 == 0; other shapes keep
 * mma.sync) in the tile shapes wtiles (DFL_CUDA_MOE_WTILE), plain and fused, each also value
 * for value against mma.sync; small: two small shapes (for compute-sanitizer), else all. */
static void moe_wgmma_cases(const char *wtiles, bool small)
{
    if (!dfl_be_cuda_available())
        T_SKIP("no CUDA GPU");
    char *wg_was = getenv("DFL_CUDA_MOE_WGMMA"), *wt_was = getenv("DFL_CUDA_MOE_WTILE");
    wg_was = wg_was ? strdup(wg_was) : NULL;
    wt_was = wt_was ? strdup(wt_was) : NULL;
    setenv("DFL_CUDA_MOE_WGMMA", "1", 1);
    for (const char *v = wtiles; *v; v++) {
        char tv[2] = {*v, 0};
        setenv("DFL_CUDA_MOE_WTILE", tv, 1);
        moe_ops_case(60, 8, 2, 64, 162, DFL_BF16, false); /* N / 2 odd: single stores */
        moe_ops_case(200, 16, 4, 256, 384, DFL_BF16, false);
        if (small)
            continue;
        moe_ops_case(1000, 128, 8, 256, 192, DFL_BF16, false);
        moe_ops_case(200, 16, 4, 2048, 72, DFL_BF16, false);
        moe_ops_case(300, 16, 4, 768, 2048, DFL_BF16, false);
        moe_ops_case(60, 8, 2, 64, 81, DFL_BF16, false); /* odd N */
        moe_ops_case(700, 256, 8, 256, 128, DFL_BF16, true);
    }
    if (!small)
        moe_ops_case(37, 8, 2, 96, 80, DFL_BF16, false); /* K % 64 != 0: mma.sync */
    env_put("DFL_CUDA_MOE_WTILE", wt_was);
    env_put("DFL_CUDA_MOE_WGMMA", wg_was);
    free(wg_was);
    free(wt_was);
}

/* every plain tile shape; GPU_FAMILIES_WTILES=DIGITS in the environment: those only (a device
 * run short of time) */
static void test_moe_wgmma(void)
{
    const char *only = getenv("GPU_FAMILIES_WTILES");
    moe_wgmma_cases(only && *only ? only : "012367", false);
}

/* the warp-specialized tile shapes (mbarrier hand-over) */
static void test_moe_wgmma_ws(void)
{
    const char *only = getenv("GPU_FAMILIES_WTILES");
    if (only && *only)
        T_SKIP("GPU_FAMILIES_WTILES is set (test_moe_wgmma runs those tiles)");
    moe_wgmma_cases("45", false);
}

/* two small cases in tile shapes 0, 2, 4, 6 and 7 (persistent), to run under compute-sanitizer
 * (T_ONLY) */
static void test_small_wgmma(void)
{
    moe_wgmma_cases("02467", true);
}

/* ---- the Qwen3-MoE oracle on CUDA ---- */

static const float *ref_t(const dfl_st_file *f, int s, const char *what, int k)
{
    char name[64];
    snprintf(name, sizeof name, k >= 0 ? "seq%d.%s%d" : "seq%d.%s", s, what, k);
    const dfl_st_tensor *t = dfl_st_find(f, name);
    return t ? t->data : NULL;
}

/* The reference's top-k set of a row and its margin (k-th minus (k+1)-th logit). */
static uint64_t topk_set(const float *z, int E, int k, double *margin)
{
    uint64_t s = 0;
    float last = 0;
    for (int j = 0; j <= k && j < E; j++) {
        int b = -1;
        for (int x = 0; x < E; x++)
            if (!(s >> x & 1) && (b < 0 || z[x] > z[b]))
                b = x;
        if (j == k) {
            *margin = last - z[b];
            break;
        }
        s |= 1ull << b;
        last = z[b];
    }
    return s;
}

static void moe_oracle(const char *dir, const char *name, dfl_dtype act)
{
    char p[4200];
    snprintf(p, sizeof p, "%s/ref.safetensors", dir);
    dfl_err e = {0};
    dfl_st_file *ref = NULL;
    dfl_be *be = NULL;
    dfl_target *t = NULL;
    dfl_target_ws *ws = NULL;
    if (dfl_st_open(&ref, p, &e) || dfl_be_cuda_open(&be, 0, act, &e) ||
        dfl_target_open(&t, be, dir, 0, &e)) {
        T_CHECK(0, "%s: %s", dir, e.msg);
        goto out;
    }
    const dfl_hf_config *c = &t->cfg;
    int64_t H = c->hidden_size, E = c->n_experts;
    int K = (int)c->n_layers, k = (int)c->top_k;
    int64_t maxlen = 0;
    for (int s = 0; ref_t(ref, s, "input_ids", -1); s++) {
        char n[64];
        snprintf(n, sizeof n, "seq%d.input_ids", s);
        int64_t L = dfl_st_find(ref, n)->shape[0];
        maxlen = L > maxlen ? L : maxlen;
    }
    T_CHECK(dfl_target_ws_new(t, maxlen, 1, &ws, &e) == 0, "%s", e.msg);
    if (!ws)
        goto out;
    void *caps[64];
    float *router[64] = {0};
    int32_t layers[64];
    for (int l = 0; l < K; l++) {
        layers[l] = l;
        caps[l] = be->ops->alloc(be, sizeof(float) * maxlen * H, &e);
        if (dfl_hf_layer_is_moe(c, l))
            router[l] = be->ops->alloc(be, sizeof(float) * maxlen * E, &e);
    }
    t->router_out = router;
    float *hc = xmalloc(sizeof(float) * maxlen * H), *hr = xmalloc(sizeof(float) * maxlen * E);
    uint8_t *flipped = xmalloc((size_t)maxlen);
    int pairs = 0, diffs = 0;
    int64_t down_rows = 0;   /* rows after a routing change in their sequence (attention carries it) */
    double worst_rel = 0, worst_cos = 1, worst_margin = 0, worst_router = 0, down_rel = 0, down_cos = 1;
    for (int s = 0; ref_t(ref, s, "input_ids", -1); s++) {
        char n[64];
        snprintf(n, sizeof n, "seq%d.input_ids", s);
        const dfl_st_tensor *ti = dfl_st_find(ref, n);
        uint32_t len = (uint32_t)ti->shape[0];
        uint8_t *mask = calloc(len, 1);
        dfl_batch b = {.index = (uint64_t)s, .n_tokens = len, .n_seqs = 1, .seq_lens = &len,
                       .input_ids = ti->data, .loss_mask = mask};
        if (dfl_target_forward(t, ws, &b, K, layers, DFL_F32, caps, &e) || be->ops->sync(be, &e)) {
            T_CHECK(0, "seq %d: %s", s, e.msg);
            free(mask);
            continue;
        }
        memset(flipped, 0, len);
        uint32_t first = len;   /* the first position whose expert set differed, so far */
        for (int l = 0; l < K; l++) {
            if (router[l]) {
                be->ops->download(be, hr, router[l], sizeof(float) * len * E);
                const float *rr = ref_t(ref, s, "router", l);
                double er = 0;
                for (uint32_t i = 0; i < len; i++) {
                    double mg = 0, m2 = 0;
                    uint64_t want = topk_set(rr + (int64_t)i * E, (int)E, k, &mg);
                    uint64_t got = topk_set(hr + (int64_t)i * E, (int)E, k, &m2);
                    pairs++;
                    if (got != want) {
                        diffs++;
                        flipped[i] = 1;
                        first = i < first ? i : first;
                        worst_margin = mg > worst_margin ? mg : worst_margin;
                        printf("# %s seq%d token %u layer %d: expert set differs, reference "
                               "margin %.3g\n", dfl_dtype_lower(act), s, i, l, mg);
                    }
                    double ei = rel_err(hr + (int64_t)i * E, rr + (int64_t)i * E, (size_t)E);
                    er = ei <= er ? er : ei;
                }
                worst_router = er <= worst_router ? worst_router : er;
            }
            be->ops->download(be, hc, caps[l], sizeof(float) * len * H);
            const float *rl = ref_t(ref, s, "layer", l);
            for (uint32_t i = 0; i < len; i++) {
                if (flipped[i])
                    continue; /* another expert set: reported above, not compared */
                const float *a = hc + (int64_t)i * H, *y = rl + (int64_t)i * H;
                double ab = 0, aa = 0, yy = 0;
                for (int64_t q = 0; q < H; q++) {
                    ab += (double)a[q] * y[q];
                    aa += (double)a[q] * a[q];
                    yy += (double)y[q] * y[q];
                }
                double rel = rel_err(a, y, (size_t)H), cs = ab / (sqrt(aa) * sqrt(yy) + 1e-30);
                if (i > first) {
                    /* a later position of a sequence in which a token took other experts: its
                     * attention reads that token's different output */
                    down_rows++;
                    down_rel = rel <= down_rel ? down_rel : rel;
                    down_cos = cs >= down_cos ? down_cos : cs;
                    continue;
                }
                worst_rel = rel <= worst_rel ? worst_rel : rel;
                worst_cos = cs >= worst_cos ? worst_cos : cs;
            }
        }
        free(mask);
    }
    printf("# %s on CUDA, %s: worst row %.3g, cosine %.6f, router logits %.3g; "
           "%d of %d (token, sparse layer) expert sets differ from the f32 reference "
           "(largest reference margin among them %.3g)\n", name, dfl_dtype_lower(act), worst_rel,
           worst_cos, worst_router, diffs, pairs, worst_margin);
    printf("# %s: %lld rows after a routing change in their sequence: worst row %.3g, cosine %.6f\n",
           dfl_dtype_lower(act), (long long)down_rows, down_rel, down_cos);
    if (act == DFL_F32)
        T_CHECK(worst_rel <= 1e-4 && worst_router <= 1e-4, "f32: row %.3g, router %.3g", worst_rel,
                worst_router);
    else {
        /* Rows after a routing change follow another function than the reference (another
         * expert's output entered the sequence), so only a loose bound holds there. In a hybrid
         * model the Gated DeltaNet state carries that token into every later row undiluted (on
         * the H200, qwen35moe-tiny-a: cosine 0.9878 over 2,320 such rows, while its unaffected
         * rows keep 0.9999), so its bound is 0.98; attention-only models keep 0.99. */
        double down_min = c->n_linear > 0 ? 0.98 : 0.99;
        T_CHECK(worst_rel <= 3e-2 && worst_cos >= 0.999 && down_cos >= down_min,
                "bf16: row %.3g, cosine %.6f; after a routing change: cosine %.6f (bound %.2f)",
                worst_rel, worst_cos, down_cos, down_min);
    }
    T_CHECK(pairs > 0, "sparse layers compared");
    t->router_out = NULL;
    for (int l = 0; l < K; l++) {
        be->ops->free(be, caps[l]);
        if (router[l])
            be->ops->free(be, router[l]);
    }
    free(hc);
    free(hr);
    free(flipped);
out:
    dfl_target_ws_free(t, ws);
    dfl_target_close(t);
    dfl_be_close(be);
    dfl_st_close(ref);
}

/* The oracle directory name under DFL_ORACLE, in bf16 and in f32 (the wgmma grouped GEMM where
 * K % 64 == 0); bf16 again on the mma.sync one (DFL_CUDA_MOE_WGMMA=0). */
static void moe_oracle_case(const char *name)
{
    if (!dfl_be_cuda_available())
        T_SKIP("no CUDA GPU");
    char dir[4096];
    T_NEED_ORACLE(dir, "config.json", "%s", name);
    moe_oracle(dir, name, DFL_BF16);
    moe_oracle(dir, name, DFL_F32);
    char *was = getenv("DFL_CUDA_MOE_WGMMA");
    was = was ? strdup(was) : NULL;
    setenv("DFL_CUDA_MOE_WGMMA", "0", 1);
    printf("# %s on the mma.sync grouped GEMM:\n", name);
    moe_oracle(dir, name, DFL_BF16);
    env_put("DFL_CUDA_MOE_WGMMA", was);
    free(was);
}

static void test_qwen3moe_oracle(void)
{
    moe_oracle_case("qwen3moe-tiny-a");
}

/* Qwen3.5-MoE: hybrid layers (Gated DeltaNet and gated attention), every MLP sparse with the
 * gated shared expert. */
static void test_qwen35moe_oracle(void)
{
    moe_oracle_case("qwen35moe-tiny-a");
}
#else
static void test_gpu_families(void) { T_SKIP("no CUDA GPU (built without CUDA)"); }
#endif

int main(int argc, char **argv)
{
    t_init(argv[0]);
#ifdef DFL_CUDA
    T_RUN(test_rope_scaled);
    T_RUN(test_moe_ops);
    T_RUN(test_moe_wgmma);
    T_RUN(test_small_wgmma);
    T_RUN(test_qwen3moe_oracle);
    T_RUN(test_qwen35moe_oracle);
    T_RUN(test_moe_wgmma_ws);
#else
    T_RUN(test_gpu_families);
#endif
    return t_done();
}
