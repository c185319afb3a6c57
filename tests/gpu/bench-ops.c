/* bench-ops.c: timings of the CUDA backend's ops on the Qwen3-8B layer shapes (T = 16384 tokens
 * as 8 sequences of 2048; hidden 4096, 32 query / 8 kv heads of 128, intermediate 12288),
 * against the ceilings measured in the same run: the cuBLAS rate of an 8192^3 bf16 GEMM and the
 * device-to-device copy bandwidth. Prints TFLOP/s or GB/s per op, every attention tile variant,
 * a projection of the 36-layer forward in tokens/s, and the grouped expert GEMMs (moe_matmul) of
 * a Qwen3-30B-A3B layer beside cuBLAS on the dense GEMM of as many rows, and that layer's whole
 * MoE block op by op for every grouped-GEMM tile shape. Not a test: run by hand on a GPU machine
 * (build/tests/bench-ops); exits 77 without a GPU.
 *   bench-ops [--quick] [--moe] [--attn]   (--quick: fewer iterations; --moe: the MoE parts only;
 *   --attn: the attention parts only, with the 16/8 and 32/4 head shapes too) */
#include <math.h>
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "backend.h"
#include "dtype.h"
#include "err.h"
#include "moe.h"

#define BENCH_NAME "bench-ops"
#include "bench.h"

#define MOE_TILES 5 /* the grouped GEMM's tile shapes, DFL_CUDA_MOE_TILE (kernels/moe_gemm.cuh) */
#define MOE_WTILES 8 /* the wgmma kernel's, DFL_CUDA_MOE_WTILE (kernels/moe_wgmma.cu) */

#ifdef DFL_CUDA

static int iters = 20;

/* Puts name = value in the environment, or takes name out when value is NULL. */
static void env_put(const char *name, const char *value)
{
    if (value)
        setenv(name, value, 1);
    else
        unsetenv(name);
}

/* ---- GEMM ---- */

/* y[M,N] = x[M,K] W[N,K]^T, the nn.Linear layout; returns the tuned ms per call */
static double bench_gemm(const char *name, int64_t M, int64_t N, int64_t K, double peak_tflops,
                         void *x, void *w, void *y)
{
    dfl_err e = {0};
    dfl_mm m = {.M = M, .N = N, .K = K, .A = x, .adt = DFL_BF16, .lda = K, .B = w, .bdt = DFL_BF16,
                .ldb = K, .tb = true, .C = y, .cdt = DFL_BF16, .ldc = N, .alpha = 1, .beta = 0};
    double flop = 2.0 * M * N * K;
    double t_heur = time_ms(run_mm, &m, iters);
    float best = 0, first = 0;
    if (dfl_cuda_matmul_tune(be, &m, 16, 5, &best, &first, &e))
        die("tune", &e);
    double t_tuned = time_ms(run_mm, &m, iters);
    double tf_h = flop / t_heur / 1e9, tf_t = flop / t_tuned / 1e9;
    printf("gemm %-28s %6lldx%-6lldx%-6lld heuristic %7.3f ms %6.1f TFLOP/s | tuned %7.3f ms %6.1f TFLOP/s",
           name, (long long)M, (long long)N, (long long)K, t_heur, tf_h, t_tuned, tf_t);
    if (peak_tflops > 0)
        printf(" (%3.0f%% of peak)", 100.0 * (tf_t > tf_h ? tf_t : tf_h) / peak_tflops);
    printf("\n");
    return t_tuned < t_heur ? t_tuned : t_heur;
}

/* ---- grouped expert GEMMs ---- */

static void run_moe(void *arg)
{
    if (be->ops->moe_matmul(be, (const dfl_moe_mm *)arg))
        check_sync("moe_matmul");
}

/* The expert GEMMs of a Qwen3-30B-A3B MoE layer (hidden 2048, 128 experts of width 768, top 8) on
 * T = 16384 tokens: 131072 grouped rows, expert e 1024 + d rows (d up to +-199, pairs cancel),
 * each padded to DFL_MOE_PAD; then cuBLAS on the dense GEMM of as many rows and one weight. */
static void bench_moe(double peak)
{
    enum { E = 128 };
    const int64_t T = 16384, H = 2048, I = 768;
    const int k = 8;
    int32_t cnt[E], off[E + 1];
    int64_t rows = 0;
    for (int e = 0; e < E; e++) {
        int d = (e / 2 * 23) % 200;
        cnt[e] = 1024 + (e % 2 ? -d : d);
        rows += cnt[e];
    }
    off[0] = 0;
    for (int e = 0; e < E; e++)
        off[e + 1] = off[e] + (cnt[e] + DFL_MOE_PAD - 1) / DFL_MOE_PAD * DFL_MOE_PAD;
    const int64_t cap = dfl_moe_cap(T, E, k);
    void *A = dalloc((size_t)(cap * H * 2)), *W = dalloc((size_t)(E * 2 * I * H * 2));
    void *C = dalloc((size_t)(cap * H * 2));
    int32_t *dcnt = dalloc(sizeof cnt), *doff = dalloc(sizeof off);
    if (be->ops->upload(be, dcnt, cnt, sizeof cnt) || be->ops->upload(be, doff, off, sizeof off))
        die("upload", NULL);
    fill_bf16(A, (size_t)(cap * H), 1, 6);
    fill_bf16(W, (size_t)(E * 2 * I * H), 0.02f, 7);
    const struct {
        const char *name;
        int64_t N, K;
    } sh[2] = {{"gate_up", 2 * I, H}, {"down", H, I}};
    const char *wg_was = getenv("DFL_CUDA_MOE_WGMMA");
    for (int i = 0; i < 2; i++) {
        dfl_moe_mm m = {.A = A, .W = W, .C = C, .counts = dcnt, .offsets = doff, .E = E,
                        .N = sh[i].N, .K = sh[i].K, .cap = cap};
        for (int w = 0; w < 2; w++) { /* mma.sync, then wgmma (DFL_CUDA_MOE_WGMMA) */
            setenv("DFL_CUDA_MOE_WGMMA", w ? "1" : "0", 1);
            double t = time_ms(run_moe, &m, iters), tf = 2.0 * rows * sh[i].N * sh[i].K / t / 1e9;
            printf("moe_matmul %-8s %-8s %lld rows (%d experts) x %-5lld x %-5lld %7.3f ms %6.1f "
                   "TFLOP/s (%3.0f%% of peak)\n", sh[i].name, w ? "wgmma" : "mma.sync",
                   (long long)rows, E, (long long)sh[i].N, (long long)sh[i].K, t, tf,
                   100 * tf / peak);
        }
        env_put("DFL_CUDA_MOE_WGMMA", wg_was);
        char name[64];
        snprintf(name, sizeof name, "dense as moe %s", sh[i].name);
        bench_gemm(name, rows, sh[i].N, sh[i].K, peak, A, W, C);
    }
    void *bufs[] = {A, W, C, dcnt, doff};
    for (size_t i = 0; i < sizeof bufs / sizeof *bufs; i++)
        be->ops->free(be, bufs[i]);
}

/* ---- the whole MoE block at the Qwen3-30B-A3B shape ---- */

struct moe_blk {
    int op;
    dfl_mm router;
    dfl_moe_route route;
    dfl_moe_mm up, down, plain_up;
    void *x, *xg, *gu, *act, *y, *out;
    int64_t T, H, Im, cap;
    int E, k;
    const dfl_hf_config *cfg;
    const dfl_moe_ws *ws;
    const dfl_moe_weights *w;
};

static void run_moe_blk(void *arg)
{
    struct moe_blk *b = arg;
    int rc = 0;
    switch (b->op) {
    case 0: rc = be->ops->matmul(be, &b->router); break;
    case 1: rc = be->ops->moe_route(be, &b->route); break;
    case 2: rc = be->ops->moe_matmul(be, &b->up); break;
    case 3: rc = be->ops->moe_matmul(be, &b->down); break;
    case 4:
        rc = be->ops->moe_combine(be, b->out, b->y, b->route.slot, b->route.weight, b->T, b->k,
                                  b->H, false, NULL, NULL);
        break;
    case 5:
        rc = be->ops->moe_gather(be, b->xg, b->x, b->route.rows, b->route.offsets, b->E, b->cap,
                                 b->H);
        break;
    case 6: rc = be->ops->moe_matmul(be, &b->plain_up); break;
    case 7: rc = be->ops->swiglu(be, b->act, b->gu, b->cap, b->Im); break;
    case 8:
        rc = dfl_moe_forward(be, b->cfg, b->ws, b->w, b->x, b->T, b->out, false, NULL);
        break;
    }
    if (rc)
        check_sync("moe block op");
}

/* The MoE block of a Qwen3-30B-A3B layer (hidden 2048, 128 experts of width 768, top 8) on
 * T = 16384 tokens (8 x 2048), random weights and hidden states (the router spreads them over
 * the experts): each op of dfl_moe_forward timed alone (router GEMM, route, the fused
 * gather + gate|up + SwiGLU, down, combine; the unfused gather, gate|up and swiglu beside), the
 * grouped GEMMs' TFLOP/s on the routed rows, for every tile shape (DFL_CUDA_MOE_TILE), then
 * dfl_moe_forward whole. */
static void bench_moe_block(double peak)
{
    const int64_t T = 16384, H = 2048, Im = 768;
    const int E = 128, k = 8;
    dfl_hf_config c = {.hidden_size = H, .n_experts = E, .top_k = k, .moe_intermediate = Im,
                       .norm_topk_prob = true, .sparse_step = 1};
    const int64_t cap = dfl_moe_cap(T, E, k);
    struct moe_blk b = {.T = T, .H = H, .Im = Im, .cap = cap, .E = E, .k = k, .cfg = &c};
    b.x = dalloc((size_t)(T * H * 2));
    void *wr = dalloc((size_t)(E * H * 2)), *wgu = dalloc((size_t)(E * 2 * Im * H * 2));
    void *wd = dalloc((size_t)(E * H * Im * 2));
    b.xg = dalloc((size_t)(cap * H * 2));
    b.gu = dalloc((size_t)(cap * 2 * Im * 2));
    b.act = dalloc((size_t)(cap * Im * 2));
    b.y = dalloc((size_t)(cap * H * 2));
    b.out = dalloc((size_t)(T * H * 2));
    float *logits = dalloc((size_t)(T * E * 4)), *wt = dalloc((size_t)(T * k * 4));
    int32_t *idx = dalloc((size_t)(T * k * 4)), *slot = dalloc((size_t)(T * k * 4));
    int32_t *cnt = dalloc((size_t)E * 4), *off = dalloc((size_t)(E + 1) * 4);
    int32_t *rows = dalloc((size_t)cap * 4);
    fill_bf16(b.x, (size_t)(T * H), 1, 21);
    fill_bf16(wr, (size_t)(E * H), 0.05f, 22);
    fill_bf16(wgu, (size_t)(E * 2 * Im * H), 0.02f, 23);
    fill_bf16(wd, (size_t)(E * H * Im), 0.02f, 24);
    b.router = (dfl_mm){.M = T, .N = E, .K = H, .A = b.x, .adt = DFL_BF16, .lda = H, .B = wr,
                        .bdt = DFL_BF16, .ldb = H, .tb = true, .C = logits, .cdt = DFL_F32,
                        .ldc = E, .alpha = 1, .beta = 0};
    b.route = (dfl_moe_route){.logits = logits, .T = T, .E = E, .k = k, .norm_topk = true,
                              .idx = idx, .weight = wt, .counts = cnt, .offsets = off,
                              .rows = rows, .slot = slot, .cap = cap};
    b.up = (dfl_moe_mm){.A = b.x, .W = wgu, .C = b.act, .counts = cnt, .offsets = off,
                        .rows = rows, .swiglu = true, .E = E, .N = 2 * Im, .K = H, .cap = cap};
    b.plain_up = (dfl_moe_mm){.A = b.xg, .W = wgu, .C = b.gu, .counts = cnt, .offsets = off,
                              .E = E, .N = 2 * Im, .K = H, .cap = cap};
    b.down = (dfl_moe_mm){.A = b.act, .W = wd, .C = b.y, .counts = cnt, .offsets = off, .E = E,
                          .N = H, .K = Im, .cap = cap};
    run_moe_blk(&(struct moe_blk){.op = 0, .router = b.router});
    b.op = 1;
    run_moe_blk(&b);
    int32_t hc[128];
    dfl_err e = {0};
    if (be->ops->download(be, hc, cnt, sizeof hc) || be->ops->sync(be, &e))
        die("download", &e);
    int lo = hc[0], hi = hc[0];
    for (int x = 1; x < E; x++) {
        lo = hc[x] < lo ? hc[x] : lo;
        hi = hc[x] > hi ? hc[x] : hi;
    }
    const double rows_k = (double)T * k, f_up = 2.0 * rows_k * 2 * Im * H, f_dn = 2.0 * rows_k * H * Im;
    printf("moe block 30b-a3b: T %lld, %d experts (rows per expert %d..%d), top %d, hidden %lld, "
           "width %lld\n", (long long)T, E, lo, hi, k, (long long)H, (long long)Im);
    const char *names[] = {"router gemm", "route", "gate_up fused", "down", "combine", "gather",
                           "gate_up plain", "swiglu"};
    const char *was = getenv("DFL_CUDA_MOE_TILE"), *wg_was = getenv("DFL_CUDA_MOE_WGMMA");
    const char *wt_was = getenv("DFL_CUDA_MOE_WTILE");
    char label[32];
    for (int v = 0; v < MOE_TILES + MOE_WTILES; v++) { /* the mma.sync tiles, then wgmma's */
        const bool wg = v >= MOE_TILES;
        char tv[2] = {(char)('0' + (wg ? v - MOE_TILES : v)), 0};
        setenv(wg ? "DFL_CUDA_MOE_WTILE" : "DFL_CUDA_MOE_TILE", tv, 1);
        setenv("DFL_CUDA_MOE_WGMMA", wg ? "1" : "0", 1);
        snprintf(label, sizeof label, "%stile %s", wg ? "wgmma " : "", tv);
        double ms[8], sum = 0;
        for (int op = 0; op < 8; op++) {
            b.op = op;
            ms[op] = time_ms(run_moe_blk, &b, iters);
        }
        printf("moe block %s:", label);
        for (int op = 0; op < 8; op++)
            printf(" %s %.3f ms%s", names[op], ms[op], op == 4 ? " |" : ";");
        printf("\n");
        for (int op = 0; op < 5; op++)
            sum += ms[op];
        printf("moe block %s: fused block %.3f ms (unfused %.3f ms); gate_up fused %.1f "
               "TFLOP/s, plain %.1f TFLOP/s; down %.1f TFLOP/s (peak %.1f)\n", label, sum,
               sum - ms[2] + ms[5] + ms[6] + ms[7], f_up / ms[2] / 1e9, f_up / ms[6] / 1e9,
               f_dn / ms[3] / 1e9, peak);
    }
    env_put("DFL_CUDA_MOE_TILE", was);
    env_put("DFL_CUDA_MOE_WTILE", wt_was);
    /* the route in both forms (DFL_CUDA_MOE_ROUTE) */
    const char *rt_was = getenv("DFL_CUDA_MOE_ROUTE");
    double rt[2];
    b.op = 1;
    for (int f = 0; f < 2; f++) {
        setenv("DFL_CUDA_MOE_ROUTE", f ? "1" : "0", 1);
        rt[f] = time_ms(run_moe_blk, &b, iters);
    }
    env_put("DFL_CUDA_MOE_ROUTE", rt_was);
    printf("moe block route: two kernels (DFL_CUDA_MOE_ROUTE=1) %.3f ms, four kernels (0) %.3f "
           "ms\n", rt[1], rt[0]);
    /* dfl_moe_forward whole: on mma.sync, on wgmma (the defaults, or the environment's tile and
     * route), then on wgmma in given tiles and routes (tile 0 with the four-kernel route: the
     * defaults before the persistent tiles 6 and 7) */
    uint64_t wsb = dfl_moe_ws_bytes(&c, be, T);
    void *blk = be->ops->alloc(be, (size_t)wsb, &e);
    if (!blk)
        die("alloc", &e);
    dfl_moe_ws ws;
    dfl_moe_ws_carve(&c, be, T, blk, &ws);
    dfl_moe_weights w = {.router = wr, .wgu = wgu, .wdown = wd};
    b.ws = &ws;
    b.w = &w;
    b.op = 8;
    const struct {
        const char *wgmma, *wtile, *route, *name;
    } fv[] = {{"0", wt_was, rt_was, "mma.sync"},
              {"1", wt_was, rt_was, "wgmma"},
              {"1", "0", "0", "wgmma tile 0, four-kernel route"},
              {"1", "6", "1", "wgmma tile 6, two-kernel route"},
              {"1", "7", "1", "wgmma tile 7, two-kernel route"}};
    for (size_t v = 0; v < sizeof fv / sizeof *fv; v++) {
        setenv("DFL_CUDA_MOE_WGMMA", fv[v].wgmma, 1);
        env_put("DFL_CUDA_MOE_WTILE", fv[v].wtile);
        env_put("DFL_CUDA_MOE_ROUTE", fv[v].route);
        double t = time_ms(run_moe_blk, &b, iters);
        printf("moe block dfl_moe_forward %s: %.3f ms per layer per 16384 tokens, %.1f TFLOP/s on "
               "the expert GEMMs (transformers: ~11.7 ms; goal under ~5.85 ms)\n", fv[v].name, t,
               (f_up + f_dn) / t / 1e9);
    }
    env_put("DFL_CUDA_MOE_WGMMA", wg_was);
    env_put("DFL_CUDA_MOE_WTILE", wt_was);
    env_put("DFL_CUDA_MOE_ROUTE", rt_was);
    void *bufs[] = {b.x, wr, wgu, wd, b.xg, b.gu, b.act, b.y, b.out, logits, wt, idx, slot, cnt,
                    off, rows, blk};
    for (size_t i = 0; i < sizeof bufs / sizeof *bufs; i++)
        be->ops->free(be, bufs[i]);
}

/* ---- attention ---- */

struct attn_arg {
    dfl_attn_varlen a;
};

static void run_attn(void *arg)
{
    if (be->ops->attn_varlen(be, &((struct attn_arg *)arg)->a))
        check_sync("attention");
}

/* returns the best ms of the variants (and leaves the best one selected) */
static double bench_attn(int d, int nh, int nkv, const int *lens, int nseq, const char *label)
{
    dfl_err e = {0};
    int64_t T = 0;
    int max_len = 0;
    double flop = 0;
    int32_t *cu = malloc(((size_t)nseq + 1) * sizeof *cu);
    cu[0] = 0;
    for (int s = 0; s < nseq; s++) {
        cu[s + 1] = cu[s] + lens[s];
        T += lens[s];
        if (lens[s] > max_len)
            max_len = lens[s];
        flop += 4.0 * (double)lens[s] * lens[s] / 2 * d * nh;   /* causal: half of 4 S^2 d */
    }
    int64_t ld = (int64_t)(nh + 2 * nkv) * d;
    void *qkv = dalloc((size_t)T * ld * 2), *o = dalloc((size_t)T * nh * d * 2);
    int32_t *dcu = dalloc(((size_t)nseq + 1) * 4);
    fill_bf16(qkv, (size_t)T * ld, 2.0f, (uint64_t)d * 7 + (uint64_t)nseq);
    if (be->ops->upload(be, dcu, cu, ((size_t)nseq + 1) * 4))
        die("upload", NULL);
    struct attn_arg arg = {{.q = qkv, .ldq = ld, .k = (uint16_t *)qkv + (int64_t)nh * d, .ldk = ld,
                            .v = (uint16_t *)qkv + (int64_t)(nh + nkv) * d, .ldv = ld, .o = o,
                            .ldo = (int64_t)nh * d, .cu_seqlens = dcu, .n_seqs = nseq,
                            .max_len = max_len, .T = T, .n_heads = nh, .n_kv = nkv, .d = d,
                            .scale = 1.0f / sqrtf((float)d)}};
    double best = 1e30;
    int best_v = 0;
    for (int v = 0; dfl_cuda_attn_variant_name(d, v); v++) {
        if (dfl_cuda_attn_set_variant(be, d, v, &e))
            die("variant", &e);
        double ms = time_ms(run_attn, &arg, iters);
        printf("attn %-22s d%-3d heads %2d/%-2d T %-6lld %-52s %7.3f ms %6.1f TFLOP/s\n", label, d, nh,
               nkv, (long long)T, dfl_cuda_attn_variant_name(d, v), ms, flop / ms / 1e9);
        if (ms < best) {
            best = ms;
            best_v = v;
        }
    }
    if (dfl_cuda_attn_set_variant(be, d, best_v, &e))
        die("variant", &e);
    printf("attn %-22s d%-3d best: %s\n", label, d, dfl_cuda_attn_variant_name(d, best_v));
    be->ops->free(be, qkv);
    be->ops->free(be, o);
    be->ops->free(be, dcu);
    free(cu);
    return best;
}

/* the attention benchmarks: d128 32/8 heads on 8 x 2048 (returned: the best variant's ms), mixed
 * lengths and 1 x 16384; d64 and d256; with gqa also d128 16/8 and 32/4 heads on 8 x 2048 (the
 * Qwen3-1.7B and Qwen3-30B-A3B shapes) */
static double bench_attn_set(bool gqa)
{
    int lens8[8], lensmix[64];
    for (int i = 0; i < 8; i++)
        lens8[i] = 2048;
    int nmix = 0, tot = 0;
    uint64_t r = 12345;
    while (tot < 16384 - 64 && nmix < 64) {
        r = r * 6364136223846793005ull + 1442695040888963407ull;
        int L = 1 + (int)((r >> 33) % 4096);
        if (tot + L > 16384)
            L = 16384 - tot;
        lensmix[nmix++] = L;
        tot += L;
    }
    double t_attn = bench_attn(128, 32, 8, lens8, 8, "8 x 2048");
    if (gqa) {
        bench_attn(128, 16, 8, lens8, 8, "8 x 2048");
        bench_attn(128, 32, 4, lens8, 8, "8 x 2048");
    }
    bench_attn(128, 32, 8, lensmix, nmix, "mixed 1..4096");
    int lens1[1] = {16384};
    bench_attn(128, 32, 8, lens1, 1, "1 x 16384");
    bench_attn(64, 32, 8, lens8, 8, "8 x 2048");
    bench_attn(256, 16, 4, lens8, 8, "8 x 2048");
    return t_attn;
}

/* ---- elementwise ---- */

struct ew {
    int kind;
    void *a, *b, *c, *w;
    float *rstd;
    int32_t *ids, *pos;
    int64_t T, H, I;
};

static void run_ew(void *arg)
{
    struct ew *x = arg;
    int rc = 0;
    switch (x->kind) {
    case 0: rc = be->ops->rmsnorm(be, x->c, x->rstd, x->a, x->w, x->T, x->H, 1e-6f); break;
    case 1: rc = be->ops->add_rmsnorm(be, x->a, x->b, x->c, NULL, x->w, x->T, x->H, 1e-6f); break;
    case 2: rc = be->ops->swiglu(be, x->c, x->a, x->T, x->I); break;
    case 3:   /* q and k heads of a fused QKV row [T, 6144] */
        rc = be->ops->qknorm_rope(be, x->a, NULL, 6144, NULL, x->w, x->pos, x->T, 32, 128, 1e-6f, 1e6f);
        if (!rc)
            rc = be->ops->qknorm_rope(be, (uint16_t *)x->a + 4096, NULL, 6144, NULL, x->w, x->pos, x->T, 8,
                                      128, 1e-6f, 1e6f);
        break;
    case 4: rc = be->ops->add(be, x->a, x->b, x->T * x->H); break;
    case 5: rc = be->ops->embedding(be, x->c, x->ids, x->a, x->T, x->H); break;
    }
    if (rc)
        check_sync("elementwise op");
}

static void run_copy(void *arg)
{
    struct ew *x = arg;
    if (be->ops->copy(be, x->b, x->a, (size_t)x->T * x->H * 2))
        check_sync("copy");
}

static double bench_ew(const char *name, struct ew *x, double bytes, double copy_gbs)
{
    double ms = time_ms(run_ew, x, iters);
    double gbs = bytes / ms / 1e6;
    printf("op   %-28s %8.3f ms %7.0f GB/s (%3.0f%% of copy bandwidth)\n", name, ms, gbs,
           100 * gbs / copy_gbs);
    return ms;
}

int main(int argc, char **argv)
{
    bool moe_only = false, attn_only = false;
    for (int i = 1; i < argc; i++) {
        if (strcmp(argv[i], "--quick") == 0)
            iters = 5;
        else if (strcmp(argv[i], "--moe") == 0)
            moe_only = true;
        else if (strcmp(argv[i], "--attn") == 0)
            attn_only = true;
        else {
            fprintf(stderr, "bench-ops: unknown option '%s' (--quick, --moe, --attn)\n", argv[i]);
            return 1;
        }
    }
    dfl_cuda_props pr;
    if (!bench_open(&pr))
        return 77;
    printf("device: %s, %d SMs, %.0f GB (%.0f GB free)\n", pr.name, pr.sm_count, pr.mem_total / 1e9,
           pr.mem_free / 1e9);

    /* ceilings */
    const int64_t P = 8192;
    void *pa = dalloc((size_t)P * P * 2), *pb = dalloc((size_t)P * P * 2), *pc = dalloc((size_t)P * P * 2);
    fill_bf16(pa, (size_t)P * P, 1, 1);
    fill_bf16(pb, (size_t)P * P, 1, 2);
    double t_peak = bench_gemm("peak 8192^3", P, P, P, 0, pa, pb, pc);
    double peak = 2.0 * P * P * P / t_peak / 1e9;
    printf("ceiling: cuBLAS bf16 GEMM %.1f TFLOP/s\n", peak);
    be->ops->free(be, pa);
    be->ops->free(be, pb);
    be->ops->free(be, pc);
    if (attn_only) {
        bench_attn_set(true);
        bench_close();
        return 0;
    }
    if (moe_only) {
        bench_moe(peak);
        bench_moe_block(peak);
        bench_close();
        return 0;
    }

    const int64_t T = 16384, H = 4096, I = 12288, QKV = 6144;
    struct ew cp = {.a = dalloc((size_t)T * H * 2 * 4), .b = dalloc((size_t)T * H * 2 * 4), .T = T, .H = H * 4};
    double t_copy = time_ms(run_copy, &cp, iters);
    double copy_gbs = 2.0 * T * H * 4 * 2 / t_copy / 1e6;
    printf("ceiling: device-to-device copy %.0f GB/s (read + write)\n", copy_gbs);
    be->ops->free(be, cp.a);
    be->ops->free(be, cp.b);

    /* the layer's GEMMs */
    void *x = dalloc((size_t)T * I * 2), *w = dalloc((size_t)2 * I * H * 2), *y = dalloc((size_t)T * 2 * I * 2);
    fill_bf16(x, (size_t)T * I, 1, 3);
    fill_bf16(w, (size_t)2 * I * H, 0.02f, 4);
    double t_gemm = 0;
    t_gemm += bench_gemm("qkv_proj", T, QKV, H, peak, x, w, y);
    t_gemm += bench_gemm("o_proj", T, H, H, peak, x, w, y);
    t_gemm += bench_gemm("gate_up_proj", T, 2 * I, H, peak, x, w, y);
    t_gemm += bench_gemm("down_proj", T, H, I, peak, x, w, y);
    double layer_flop = 2.0 * T * H * (QKV + H + 2 * I + I);
    printf("gemm layer total %.3f ms, %.1f TFLOP/s (%.0f%% of peak)\n", t_gemm, layer_flop / t_gemm / 1e9,
           100 * layer_flop / t_gemm / 1e9 / peak);
    bench_moe(peak);
    bench_moe_block(peak);

    /* elementwise ops of the layer (x, y reused as scratch) */
    double copy_ref = copy_gbs;
    void *wn = dalloc((size_t)H * 2);
    fill_bf16(wn, (size_t)H, 1, 5);
    int32_t *pos = dalloc((size_t)T * 4), *ids = dalloc((size_t)T * 4);
    int32_t *hp = malloc((size_t)T * 4);
    for (int64_t t = 0; t < T; t++)
        hp[t] = (int32_t)(t % 2048);
    be->ops->upload(be, pos, hp, (size_t)T * 4);
    for (int64_t t = 0; t < T; t++)
        hp[t] = (int32_t)((t * 7919) % 151936);
    be->ops->upload(be, ids, hp, (size_t)T * 4);
    free(hp);
    void *emb = dalloc((size_t)151936 * H * 2);
    double t_ew = 0;
    struct ew r0 = {.kind = 0, .a = x, .c = y, .w = wn, .T = T, .H = H};
    bench_ew("rmsnorm [16384,4096]", &r0, 2.0 * T * H * 2, copy_ref);
    struct ew r1 = {.kind = 1, .a = x, .b = (uint16_t *)x + T * H, .c = y, .w = wn, .T = T, .H = H};
    t_ew += 2 * bench_ew("add_rmsnorm [16384,4096]", &r1, 4.0 * T * H * 2, copy_ref);
    struct ew r2 = {.kind = 2, .a = y, .c = x, .T = T, .I = I};
    t_ew += bench_ew("swiglu [16384,2*12288]", &r2, 3.0 * T * I * 2, copy_ref);
    struct ew r3 = {.kind = 3, .a = y, .w = wn, .pos = pos, .T = T};
    t_ew += bench_ew("qknorm_rope q+k [16384,6144]", &r3, 2.0 * T * (QKV - 1024) * 2, copy_ref);
    struct ew r4 = {.kind = 4, .a = x, .b = y, .T = T, .H = H};
    bench_ew("add [16384*4096]", &r4, 3.0 * T * H * 2, copy_ref);
    struct ew r5 = {.kind = 5, .a = emb, .c = x, .ids = ids, .T = T, .H = H};
    bench_ew("embedding [16384,4096]", &r5, 2.0 * T * H * 2, copy_ref);
    be->ops->free(be, x);
    be->ops->free(be, y);
    be->ops->free(be, w);
    be->ops->free(be, emb);

    double t_attn = bench_attn_set(false);

    /* projection: 36 layers of the measured pieces (per layer: 4 GEMMs, attention, two
     * add_rmsnorm, qknorm_rope of q and k, swiglu) */
    double layer = t_gemm + t_attn + t_ew;
    printf("layer estimate: gemm %.3f + attention %.3f + elementwise %.3f = %.3f ms; 36 layers: "
           "%.0f tokens/s (goal: 1.35 x HF ~ 40000)\n", t_gemm, t_attn, t_ew, layer,
           T / (36 * layer / 1e3));

    be->ops->free(be, wn);
    be->ops->free(be, pos);
    be->ops->free(be, ids);
    bench_close();
    return 0;
}

#endif
