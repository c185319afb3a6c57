/* bench-train-ops.c: timings of the CUDA backend's drafter ops on the shapes of the 8B drafter
 * (hidden 4096, 32 query / 8 kv heads of 128, intermediate 12288, block 16; a batch of 4
 * sequences of 3072 tokens with 512 random sorted anchors each, so Q = 32768 block rows), against
 * the ceilings measured in the same run (cuBLAS bf16 GEMM rate, device-to-device copy bandwidth):
 *  - dflash_attn forward, every tile variant: TFLOP/s counting 4 bs (anchor + bs) d heads per block;
 *  - dflash_attn_bwd, every variant of each pass, and each pass alone: TFLOP/s counting 2.5 x the
 *    forward (the FA2 convention; the deterministic backward does 7 matmuls per score, 1.4 x that),
 *    all with dS recomputed; then the defaults with dS recomputed and with dS kept
 *    (dfl_cuda_dflash_bwd_ds), and the kept form's two parts alone;
 *  - lmce on the scored rows of a step (Q = 30720: 4 x 512 blocks x 15 slots), V = 151936,
 *    H = 4096, for several chunk sizes, then on the Qwen3.6-27B drafter's (H 5120, V 248320):
 *    TFLOP/s counting the two GEMMs (4 Q V H), with and without dz,
 *    against the same GEMMs alone;
 *  - rmsnorm_bwd, qknorm_rope_bwd, swiglu_bwd, adamw, sumsq, uniform_noise: GB/s of the bytes they
 *    must move, against the copy bandwidth.
 * --window: the attention only, at the Qwen3.6-27B drafter's shape (4 sequences of 4096 tokens,
 * 512 anchors each, block 16, 32/8 heads of 128) with full attention and with its sliding window
 * of 2048: the time each takes, and the TFLOP/s counting only the keys the window leaves.
 * --attention: the 8B drafter's attention only (no lmce, no bandwidth-bound ops).
 * --lmce: lmce only, chunks of 1024 rows, at both shapes.
 * --norms: the norms' backward ops only (rmsnorm_bwd at the 8B and 27B widths, qknorm_rope_bwd on
 * the 8B drafter's q and k), each with the first kernels (DFL_CUDA_NORM_BWD=0: "[first
 * kernels]") and then the default.
 * Not a test: run by hand on a GPU machine (build/tests/bench-train-ops [--quick] [--window |
 * --attention | --norms | --lmce]);
 * exits 77 without a GPU. Needs about 30 GB of device memory. */
#include <math.h>
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "backend.h"
#include "dtype.h"
#include "err.h"

#define BENCH_NAME "bench-train-ops"
#include "bench.h"

#ifdef DFL_CUDA
#include "../../kernels/cuda_train.h"

static int iters = 10;

/* n act (bf16) values ~ U(-a, a): zeros plus the backend's own uniform noise */
static void fill(void *dev, size_t n, float a, uint64_t seed)
{
    if (be->ops->memset0(be, dev, n * 2) || be->ops->uniform_noise(be, dev, (int64_t)n, a, seed))
        check_sync("fill");
}

static uint64_t rs = 0x9E3779B97F4A7C15ull;
static uint64_t rnext(void)
{
    rs ^= rs >> 12;
    rs ^= rs << 25;
    rs ^= rs >> 27;
    return rs * 0x2545F4914F6CDD1Dull;
}

struct cp {
    void *a, *b;
    size_t bytes;
};

static void run_copy(void *arg)
{
    struct cp *c = arg;
    if (be->ops->copy(be, c->b, c->a, c->bytes))
        check_sync("copy");
}

/* ---- attention ---- */

static void run_fwd(void *arg)
{
    if (be->ops->dflash_attn(be, (const dfl_dflash_attn *)arg))
        check_sync("dflash_attn");
}

static void run_bwd(void *arg)
{
    if (be->ops->dflash_attn_bwd(be, (const dfl_dflash_attn *)arg))
        check_sync("dflash_attn_bwd");
}

static int cmp_i32(const void *a, const void *b)
{
    int32_t x = *(const int32_t *)a, y = *(const int32_t *)b;
    return (x > y) - (x < y);
}

/* Forward FLOPs of one block's queries: 4 d nh per (query, key) pair it sees (backend.h). */
static double block_flop(int an, int bs, int window, int d, int nh)
{
    double keys = 0;
    for (int j = 0; j < bs; j++) {
        int lo = window > 0 ? an + j - (window - 1) : 0;
        lo = lo < 0 ? 0 : lo > an ? an : lo;
        keys += (an - lo) + (window > 0 ? j + 1 : bs);
    }
    return 4.0 * keys * d * nh;
}

/* L tokens a sequence, window W (0: full attention); returns forward + backward ms. */
static double bench_attention(double peak, int L, int window)
{
    const int nseq = 4, nanch = 512, bs = 16, nh = 32, nkv = 8, d = 128;
    const int nb = nseq * nanch;
    const int64_t T = (int64_t)nseq * L, Q = (int64_t)nb * bs, nq = (int64_t)nh * d, nk = (int64_t)nkv * d;
    int32_t *cs = malloc((size_t)nb * 4), *an = malloc((size_t)nb * 4), *pool = malloc((size_t)L * 4);
    double flop = 0;
    for (int s = 0; s < nseq; s++) {
        /* 512 distinct anchors out of 0..L-2, sorted (as dfl_draft_blocks draws them) */
        for (int i = 0; i < L - 1; i++)
            pool[i] = i;
        for (int i = 0; i < nanch; i++) {
            int j = i + (int)(rnext() % (uint64_t)(L - 1 - i));
            int32_t t = pool[i];
            pool[i] = pool[j];
            pool[j] = t;
        }
        qsort(pool, nanch, 4, cmp_i32);
        for (int i = 0; i < nanch; i++) {
            cs[s * nanch + i] = s * L;
            an[s * nanch + i] = pool[i];
            flop += block_flop(pool[i], bs, window, d, nh);
        }
    }
    void *q = dalloc((size_t)(Q * nq * 2)), *kc = dalloc((size_t)(T * nk * 2)), *vc = dalloc((size_t)(T * nk * 2));
    void *kb = dalloc((size_t)(Q * nk * 2)), *vb = dalloc((size_t)(Q * nk * 2)), *o = dalloc((size_t)(Q * nq * 2));
    void *dout = dalloc((size_t)(Q * nq * 2)), *dq = dalloc((size_t)(Q * nq * 2));
    void *dkc = dalloc((size_t)(T * nk * 2)), *dvc = dalloc((size_t)(T * nk * 2));
    void *dkb = dalloc((size_t)(Q * nk * 2)), *dvb = dalloc((size_t)(Q * nk * 2));
    float *lse = dalloc((size_t)(Q * nh * 4)), *delta = dalloc((size_t)(Q * nh * 4));
    int32_t *dcs = dalloc((size_t)nb * 4), *dan = dalloc((size_t)nb * 4);
    fill(q, (size_t)(Q * nq), 2.0f, 1);
    fill(kc, (size_t)(T * nk), 2.0f, 2);
    fill(vc, (size_t)(T * nk), 2.0f, 3);
    fill(kb, (size_t)(Q * nk), 2.0f, 4);
    fill(vb, (size_t)(Q * nk), 2.0f, 5);
    fill(dout, (size_t)(Q * nq), 1.0f, 6);
    if (be->ops->upload(be, dcs, cs, (size_t)nb * 4) || be->ops->upload(be, dan, an, (size_t)nb * 4))
        die("upload", NULL);
    dfl_dflash_attn a = {.q = q, .k_ctx = kc, .v_ctx = vc, .k_blk = kb, .v_blk = vb, .o = o, .lse = lse,
                         .ctx_start = dcs, .anchor = dan, .ctx_start_host = cs, .anchor_host = an,
                         .n_blocks = nb, .bs = bs, .max_anchor = (int32_t)T,
                         .T_ctx = T, .n_heads = nh, .n_kv = nkv, .d = d, .scale = 1.0f / sqrtf((float)d),
                         .window = window,
                         .dout = dout, .delta = delta, .dq = dq, .dk_ctx = dkc, .dv_ctx = dvc, .dk_blk = dkb,
                         .dv_blk = dvb};
    printf("dflash attention: %d sequences x %d tokens, %d anchors each (sorted random), bs %d, heads %d/%d, d %d, "
           "window %d: %.1f GFLOP forward (the keys each query sees)\n", nseq, L, nanch, bs, nh, nkv, d, window,
           flop / 1e9);
    double best_f = 1e30;
    int best_fv = 0;
    for (int v = 0; dfl_cuda_dflash_variant_name(DFL_DFLASH_FWD, d, v); v++) {
        dfl_cuda_dflash_set_variant(DFL_DFLASH_FWD, d, v);
        double ms = time_ms(run_fwd, &a, iters);
        printf("  fwd     %-52s %8.3f ms %6.1f TFLOP/s (%3.0f%% of the GEMM rate)\n",
               dfl_cuda_dflash_variant_name(DFL_DFLASH_FWD, d, v), ms, flop / ms / 1e9, 100 * flop / ms / 1e9 / peak);
        if (ms < best_f) {
            best_f = ms;
            best_fv = v;
        }
    }
    dfl_cuda_dflash_set_variant(DFL_DFLASH_FWD, d, best_fv);
    run_fwd(&a);   /* o and lse for the backward */
    run_bwd(&a);   /* and delta for pass KV alone */
    check_sync("forward, backward");
    const double bflop = 2.5 * flop;
    /* each pass alone, every variant (dS recomputed: the passes as they were) */
    dfl_cuda_dflash_bwd_ds(0);
    for (int pass = 1; pass <= 2; pass++) {
        int k = pass == 1 ? DFL_DFLASH_BWD_Q : DFL_DFLASH_BWD_KV;
        dfl_cuda_dflash_bwd_passes(pass);
        int best_v = 0;
        double best = 1e30;
        for (int v = 0; dfl_cuda_dflash_variant_name(k, d, v); v++) {
            dfl_cuda_dflash_set_variant(k, d, v);
            double ms = time_ms(run_bwd, &a, iters);
            /* its share of the matmuls: pass Q does 3 per score (S, dP, dQ), pass KV 4 */
            double pf = flop / 2.0 * (pass == 1 ? 3 : 4);
            printf("  bwd %-3s %-52s %8.3f ms %6.1f TFLOP/s of its own matmuls\n", pass == 1 ? "Q" : "KV",
                   dfl_cuda_dflash_variant_name(k, d, v), ms, pf / ms / 1e9);
            if (ms < best) {
                best = ms;
                best_v = v;
            }
        }
        dfl_cuda_dflash_set_variant(k, d, best_v);
    }
    dfl_cuda_dflash_bwd_passes(3);
    double tb = time_ms(run_bwd, &a, iters);
    printf("  bwd total (best variants)                                      %8.3f ms %6.1f TFLOP/s (2.5 x forward "
           "convention; %.1f TFLOP/s of the 7 matmuls done)\n", tb, bflop / tb / 1e9, 3.5 * flop / tb / 1e9);
    /* the defaults, dS recomputed and dS kept (pass KV first, writing dS; pass Q reading it) */
    dfl_cuda_dflash_set_variant(DFL_DFLASH_BWD_Q, d, 0);
    dfl_cuda_dflash_set_variant(DFL_DFLASH_BWD_KV, d, 0);
    const double td0 = time_ms(run_bwd, &a, iters);
    dfl_cuda_dflash_bwd_ds(1);
    const double td1 = time_ms(run_bwd, &a, iters);
    dfl_cuda_dflash_bwd_passes(2);
    const double tkv = time_ms(run_bwd, &a, iters);
    dfl_cuda_dflash_bwd_passes(1);
    const double tq = time_ms(run_bwd, &a, iters);
    dfl_cuda_dflash_bwd_passes(3);
    printf("  bwd total, defaults, dS recomputed                              %8.3f ms %6.1f TFLOP/s\n", td0,
           bflop / td0 / 1e9);
    printf("  bwd total, defaults, dS kept                                    %8.3f ms %6.1f TFLOP/s (pass KV with "
           "delta, schedule and plan %.3f ms, pass Q %.3f ms; %.0f%% of the time recomputing it)\n", td1,
           bflop / td1 / 1e9, tkv, tq, 100.0 * td1 / td0);
    if (td1 < tb)
        tb = td1;
    printf("  per drafter layer: forward %.3f ms + backward %.3f ms\n", best_f, tb);
    dfl_cuda_dflash_set_variant(DFL_DFLASH_FWD, d, 0);
    dfl_cuda_dflash_set_variant(DFL_DFLASH_BWD_Q, d, 0);
    dfl_cuda_dflash_set_variant(DFL_DFLASH_BWD_KV, d, 0);
    void *bufs[] = {q, kc, vc, kb, vb, o, dout, dq, dkc, dvc, dkb, dvb, lse, delta, dcs, dan};
    for (size_t i = 0; i < sizeof bufs / sizeof bufs[0]; i++)
        be->ops->free(be, bufs[i]);
    free(cs);
    free(an);
    free(pool);
    return best_f + tb;
}

/* ---- lmce ---- */

static void run_lmce(void *arg)
{
    dfl_lmce *l = arg;
    if (be->ops->memset0(be, l->sums, DFL_SUM_COUNT * sizeof(double)) || be->ops->lmce(be, l))
        check_sync("lmce");
}

/* lmce on Q rows (H, V), with each chunk size in chunks (0 ends the list): its two GEMMs alone
 * (cuBLASLt's first choice, then tuned: lmce runs the tuned ones after that), then lmce with
 * and without dz. */
static void bench_lmce(double peak, int64_t Q, int64_t H, int64_t V, const int64_t *chunks)
{
    int64_t maxc = 0;
    for (const int64_t *c = chunks; *c; c++)
        maxc = *c > maxc ? *c : maxc;
    void *z = dalloc((size_t)(Q * H * 2)), *W = dalloc((size_t)(V * H * 2)), *dz = dalloc((size_t)(Q * H * 2));
    float *work = dalloc((size_t)dfl_lmce_work(maxc, V) * 4), *wt = dalloc((size_t)Q * 4), *ce = dalloc((size_t)Q * 4);
    int32_t *lab = dalloc((size_t)Q * 4);
    uint8_t *corr = dalloc((size_t)Q);
    double *sums = dalloc(DFL_SUM_COUNT * sizeof(double));
    fill(z, (size_t)(Q * H), 1.0f, 11);
    fill(W, (size_t)(V * H), 0.05f, 12);
    int32_t *hl = malloc((size_t)Q * 4);
    float *hw = malloc((size_t)Q * 4);
    for (int64_t i = 0; i < Q; i++) {
        hl[i] = (int32_t)(rnext() % (uint64_t)V);
        hw[i] = i % 15 == 14 ? 0.0f : (float)exp(-(double)(i % 15) / 7.0);
    }
    if (be->ops->upload(be, lab, hl, (size_t)Q * 4) || be->ops->upload(be, wt, hw, (size_t)Q * 4))
        die("upload", NULL);
    free(hl);
    free(hw);
    printf("lmce: Q %lld, H %lld, V %lld (bf16 z and W, bf16 logits as the GEMM writes them)\n", (long long)Q, (long long)H, (long long)V);
    dfl_err e = {0};
    const double fl = 4.0 * Q * V * H;
    for (const int64_t *cp = chunks; *cp; cp++) {
        const int64_t CR = *cp;
        /* the two GEMMs alone (tuned), as lmce runs them */
        dfl_mm m1 = {.M = CR, .N = V, .K = H, .A = z, .adt = DFL_BF16, .lda = H, .B = W, .bdt = DFL_BF16,
                     .ldb = H, .tb = true, .C = work, .cdt = DFL_BF16, .ldc = (V + 7) / 8 * 8, .alpha = 1, .beta = 0};
        dfl_mm m2 = {.M = CR, .N = H, .K = V, .A = work, .adt = DFL_BF16, .lda = (V + 7) / 8 * 8, .B = W, .bdt = DFL_BF16,
                     .ldb = H, .C = dz, .cdt = DFL_BF16, .ldc = H, .alpha = 1, .beta = 0};
        float b1 = 0, h1 = 0, b2 = 0, h2 = 0;
        double t1h = time_ms(run_mm, &m1, 3), t2h = time_ms(run_mm, &m2, 3);
        if (dfl_cuda_matmul_tune(be, &m1, 16, 3, &b1, &h1, &e) || dfl_cuda_matmul_tune(be, &m2, 16, 3, &b2, &h2, &e))
            die("tune", &e);
        double t1 = time_ms(run_mm, &m1, 3), t2 = time_ms(run_mm, &m2, 3);
        double gemms = (double)Q / CR * (t1 + t2), gemm1 = (double)Q / CR * t1;
        printf("  chunk %5lld (work %.2f GB): its GEMMs alone %8.2f ms %6.1f TFLOP/s (per chunk: first choice "
               "%.2f + %.2f, tuned %.2f + %.2f ms)\n", (long long)CR, dfl_lmce_work(CR, V) * 4 / 1e9, gemms, fl / gemms / 1e9,
               t1h, t2h, t1, t2);
        dfl_lmce l = {.z = z, .w_lm = W, .labels = lab, .weight = wt, .Q = Q, .H = H, .V = V, .sums = sums,
                      .correct = corr, .ce_out = ce, .dz = dz, .grad_scale = 1.0f, .work = work, .chunk_rows = CR};
        int n = iters < 3 ? iters : 3;
        double t = time_ms(run_lmce, &l, n);
        l.dz = NULL;
        double tf = time_ms(run_lmce, &l, n);
        printf("    lmce %8.2f ms %6.1f TFLOP/s (%3.0f%% of peak); row work %6.2f ms (without dz: lmce %7.2f ms, row "
               "statistics %6.2f ms)\n", t, fl / t / 1e9, 100 * fl / t / 1e9 / peak, t - gemms, tf, tf - gemm1);
    }
    void *bufs[] = {z, W, dz, work, wt, ce, lab, corr, sums};
    for (size_t i = 0; i < sizeof bufs / sizeof bufs[0]; i++)
        be->ops->free(be, bufs[i]);
}

/* ---- bandwidth-bound ops ---- */

struct ew {
    int kind;
    void *a, *b, *c, *w;
    float *f, *g, *m, *v, *rstd, *dw;
    int32_t *pos;
    double *out;
    int64_t R, n;
    int heads;   /* qknorm_rope_bwd: heads of 128 a row (the row's length) */
};

static void run_ew(void *arg)
{
    struct ew *x = arg;
    int rc = 0;
    switch (x->kind) {
    case 0: rc = be->ops->rmsnorm_bwd(be, x->a, x->dw, x->b, x->c, x->w, x->rstd, x->R, x->n, true); break;
    case 1:
        rc = be->ops->qknorm_rope_bwd(be, x->a, (int64_t)x->heads * 128, x->dw, x->b, x->w, x->rstd, x->pos, x->R,
                                      x->heads, 128, 1e-6f, 1e6f);
        break;
    case 2: rc = be->ops->swiglu_bwd(be, x->c, x->a, x->b, x->R, x->n); break;
    case 3: {
        dfl_adamw a = {.p = x->f, .g = x->g, .m = x->m, .v = x->v, .p_act = x->a, .n = x->n, .lr = 1e-4f,
                       .beta1 = 0.9f, .beta2 = 0.999f, .eps = 1e-8f, .step = 10, .grad_scale = x->rstd};
        rc = be->ops->adamw(be, &a);
        break;
    }
    case 4: rc = be->ops->sumsq(be, x->out, x->g, x->n); break;
    case 5: rc = be->ops->uniform_noise(be, x->a, x->n, 0.01f, 7); break;
    }
    if (rc)
        check_sync("bandwidth op");
}

static void bench_ew(const char *name, struct ew *x, double bytes, double copy_gbs)
{
    double ms = time_ms(run_ew, x, iters);
    double gbs = bytes / ms / 1e6;
    printf("  %-44s %8.3f ms %7.0f GB/s (%3.0f%% of copy bandwidth)\n", name, ms, gbs, 100 * gbs / copy_gbs);
}

/* the norms' backward: the first kernels (DFL_CUDA_NORM_BWD=0), then the default under the plain
 * name */
static void bench_norm(const char *name, struct ew *x, double bytes, double copy_gbs)
{
    char nm[96];
    snprintf(nm, sizeof nm, "%s [first kernels]", name);
    setenv("DFL_CUDA_NORM_BWD", "0", 1);
    bench_ew(nm, x, bytes, copy_gbs);
    unsetenv("DFL_CUDA_NORM_BWD");
    bench_ew(name, x, bytes, copy_gbs);
}

static void bench_bandwidth(double copy_gbs, bool norms_only)
{
    const int64_t R = 32768, H = 4096, I = 12288;
    printf("bandwidth-bound ops (bf16 activations):\n");
    void *a = dalloc((size_t)(R * 2 * I * 2)), *b = dalloc((size_t)(R * 2 * I * 2)), *c = dalloc((size_t)(R * 2 * I * 2));
    const int64_t HW = 5120;   /* w and dw: up to the Qwen3.6-27B drafter's width */
    void *w = dalloc((size_t)HW * 2);
    float *rstd = dalloc((size_t)R * 32 * 4), *dw = dalloc((size_t)HW * 4);
    int32_t *pos = dalloc((size_t)R * 4);
    fill(a, (size_t)(R * 2 * I), 1.0f, 21);
    fill(b, (size_t)(R * 2 * I), 1.0f, 22);
    fill(c, (size_t)(R * 2 * I), 1.0f, 23);
    fill(w, (size_t)HW, 1.0f, 24);
    if (be->ops->memset0(be, rstd, (size_t)R * 32 * 4) || be->ops->memset0(be, dw, (size_t)HW * 4))
        check_sync("memset");
    /* positions as in a step: 4 sequences of 3072 tokens, 8 block rows a token on average */
    const int64_t RK = 45056;
    int32_t *hp = malloc((size_t)RK * sizeof *hp);
    if (!hp)
        die("malloc", NULL);
    for (int64_t r = 0; r < RK; r++)
        hp[r] = (int32_t)((r / 8) % 3072);
    if (be->ops->upload(be, pos, hp, (size_t)R * 4))
        die("upload", NULL);
    struct ew e0 = {.kind = 0, .a = a, .b = b, .c = c, .w = w, .rstd = rstd, .dw = dw, .R = R, .n = H};
    bench_norm("rmsnorm_bwd [32768,4096] dx +=, dw", &e0, 4.0 * R * H * 2, copy_gbs);
    e0.n = HW;
    bench_norm("rmsnorm_bwd [32768,5120] dx +=, dw", &e0, 4.0 * R * HW * 2, copy_gbs);
    struct ew e1 = {.kind = 1, .a = a, .b = b, .w = w, .rstd = rstd, .dw = dw, .pos = pos, .R = R, .heads = 32};
    bench_norm("qknorm_rope_bwd q [32768,32x128], dw", &e1, 3.0 * R * H * 2, copy_gbs);
    e1.rstd = NULL;
    bench_norm("qknorm_rope_bwd q, rstd recomputed", &e1, 3.0 * R * H * 2, copy_gbs);
    be->ops->free(be, pos);
    pos = dalloc((size_t)RK * 4);
    if (be->ops->upload(be, pos, hp, (size_t)RK * 4))
        die("upload", NULL);
    free(hp);
    struct ew ek = {.kind = 1, .a = a, .b = b, .w = w, .rstd = rstd, .dw = dw, .pos = pos, .R = RK, .heads = 8};
    bench_norm("qknorm_rope_bwd k [45056,8x128], dw", &ek, 3.0 * RK * 1024 * 2, copy_gbs);
    if (norms_only) {
        void *nb[] = {a, b, c, w, pos, rstd, dw};
        for (size_t i = 0; i < sizeof nb / sizeof nb[0]; i++)
            be->ops->free(be, nb[i]);
        return;
    }
    struct ew e2 = {.kind = 2, .a = a, .b = b, .c = c, .R = R, .n = I};
    bench_ew("swiglu_bwd [32768,2x12288]", &e2, 5.0 * R * I * 2, copy_gbs);
    struct ew e5 = {.kind = 5, .a = a, .n = 5 * 12288 * H};
    bench_ew("uniform_noise [5 x 12288 x 4096]", &e5, 2.0 * e5.n * 2, copy_gbs);
    be->ops->free(be, a);
    be->ops->free(be, b);
    be->ops->free(be, c);
    be->ops->free(be, w);
    be->ops->free(be, pos);
    /* optimizer over the 8B drafter's flat parameters (about 1.05e9) */
    const int64_t n = 1050000000;
    float *p = dalloc((size_t)n * 4), *g = dalloc((size_t)n * 4), *m = dalloc((size_t)n * 4), *v = dalloc((size_t)n * 4);
    void *pa = dalloc((size_t)n * 2);
    double *out = dalloc(sizeof(double));
    if (be->ops->memset0(be, p, (size_t)n * 4) || be->ops->memset0(be, g, (size_t)n * 4) ||
        be->ops->memset0(be, m, (size_t)n * 4) || be->ops->memset0(be, v, (size_t)n * 4) ||
        be->ops->memset0(be, out, sizeof(double)))
        check_sync("memset");
    float one = 1.0f;
    if (be->ops->upload(be, rstd, &one, 4))
        die("upload", NULL);
    struct ew e3 = {.kind = 3, .a = pa, .f = p, .g = g, .m = m, .v = v, .rstd = rstd, .n = n};
    bench_ew("adamw 1.05e9 parameters (+ bf16 copy)", &e3, 30.0 * n, copy_gbs);
    struct ew e4 = {.kind = 4, .g = g, .out = out, .n = n};
    bench_ew("sumsq 1.05e9 gradients", &e4, 4.0 * n, copy_gbs);
    void *bufs[] = {p, g, m, v, pa, out, rstd, dw};
    for (size_t i = 0; i < sizeof bufs / sizeof bufs[0]; i++)
        be->ops->free(be, bufs[i]);
}

int main(int argc, char **argv)
{
    bool window_only = false, attention_only = false, norms_only = false, lmce_only = false;
    for (int i = 1; i < argc; i++) {
        if (strcmp(argv[i], "--quick") == 0)
            iters = 3;
        else if (strcmp(argv[i], "--norms") == 0)
            norms_only = true;
        else if (strcmp(argv[i], "--window") == 0)
            window_only = true;
        else if (strcmp(argv[i], "--attention") == 0)
            attention_only = true;
        else if (strcmp(argv[i], "--lmce") == 0)
            lmce_only = true;
    }
    dfl_cuda_props pr;
    if (!bench_open(&pr))
        return 77;
    dfl_err e = {0};
    printf("device: %s, %d SMs, %.0f GB (%.0f GB free)\n", pr.name, pr.sm_count, pr.mem_total / 1e9, pr.mem_free / 1e9);

    /* ceilings */
    const int64_t P = 8192;
    void *pa = dalloc((size_t)P * P * 2), *pb = dalloc((size_t)P * P * 2), *pc = dalloc((size_t)P * P * 2);
    fill(pa, (size_t)P * P, 1, 1);
    fill(pb, (size_t)P * P, 1, 2);
    dfl_mm mm = {.M = P, .N = P, .K = P, .A = pa, .adt = DFL_BF16, .lda = P, .B = pb, .bdt = DFL_BF16, .ldb = P,
                 .tb = true, .C = pc, .cdt = DFL_BF16, .ldc = P, .alpha = 1, .beta = 0};
    float best = 0, first = 0;
    if (dfl_cuda_matmul_tune(be, &mm, 16, 5, &best, &first, &e))
        die("tune", &e);
    double peak = 2.0 * P * P * P / time_ms(run_mm, &mm, iters) / 1e9;
    printf("ceiling: cuBLAS bf16 GEMM 8192^3 %.1f TFLOP/s\n", peak);
    be->ops->free(be, pa);
    be->ops->free(be, pb);
    be->ops->free(be, pc);
    struct cp c = {.bytes = (size_t)1 << 31};
    c.a = dalloc(c.bytes);
    c.b = dalloc(c.bytes);
    double copy_gbs = 2.0 * c.bytes / time_ms(run_copy, &c, iters) / 1e6;
    printf("ceiling: device-to-device copy %.0f GB/s (read + write)\n", copy_gbs);
    be->ops->free(be, c.a);
    be->ops->free(be, c.b);

    if (norms_only) {
        bench_bandwidth(copy_gbs, true);
    } else if (lmce_only) {
        static const int64_t rows[] = {1024, 0};
        bench_lmce(peak, 30720, 4096, 151936, rows);
        bench_lmce(peak, 30720, 5120, 248320, rows);
    } else if (window_only) {
        double full = bench_attention(peak, 4096, 0), win = bench_attention(peak, 4096, 2048);
        printf("Qwen3.6-27B drafter attention, 4 x 4096 tokens: full %.3f ms, window 2048 %.3f ms per layer "
               "(forward + backward): the window saves %.0f%%\n", full, win, 100 * (1 - win / full));
    } else {
        bench_attention(peak, 3072, 0);
        if (!attention_only) {
            /* the 8B drafter's LM head on a step's scored rows (4 x 512 blocks x 15 slots), then
             * the Qwen3.6-27B drafter's */
            static const int64_t c8[] = {512, 1024, 2048, 4096, 0}, c27[] = {1024, 2048, 0};
            bench_lmce(peak, 30720, 4096, 151936, c8);
            bench_lmce(peak, 30720, 5120, 248320, c27);
            bench_bandwidth(copy_gbs, false);
        }
    }

    bench_close();
    return 0;
}

#endif
