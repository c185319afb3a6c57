/* test-hybrid.c: the CPU ops of hybrid targets (Qwen3.5 / Qwen3.6) on their own: the chunked
 * gated delta rule against the token-by-token recurrence (sequences of 1, 63, 64, 65 and 200
 * tokens around the chunk of 64, several key/value head counts and head sizes, packed and alone),
 * the per-sequence causal conv1d (the window never reaches into the previous sequence), and the
 * small ops against their formulas. The whole layer is checked against transformers in
 * test-target (qwen35-tiny-a). */
#include <stdint.h>

#include "backend.h"
#include "util.h"
#include "t.h"

static uint64_t rng = 12345;

static float urand(void) /* [-1, 1) */
{
    rng = rng * 6364136223846793005ull + 1442695040888963407ull;
    return (float)((rng >> 40) * (1.0 / 16777216.0)) * 2.0f - 1.0f;
}

static float *randv(int64_t n, float amp)
{
    float *v = malloc((size_t)(n > 0 ? n : 1) * sizeof *v);
    for (int64_t i = 0; i < n; i++)
        v[i] = amp * urand();
    return v;
}

/* One case: sequences of lens[] packed, Hk key heads of dk, Hv value heads of dv. */
static void delta_case(dfl_be *be, const int32_t *lens, int S, int Hk, int Hv, int dk, int dv)
{
    int32_t cu[16];
    cu[0] = 0;
    for (int s = 0; s < S; s++)
        cu[s + 1] = cu[s] + lens[s];
    int64_t T = cu[S], ldqk = 2 * (int64_t)Hk * dk + 3, ldv = (int64_t)Hv * dv + 1, ldab = 2 * Hv;
    float *qk = randv(T * ldqk, 1.0f), *v = randv(T * ldv, 1.0f), *ab = randv(T * ldab, 2.0f);
    float *A_log = randv(Hv, 1.0f), *dtb = randv(Hv, 0.5f);
    int64_t ldo = (int64_t)Hv * dv;
    float *o_rec = calloc((size_t)(T * ldo), 4), *o_chk = calloc((size_t)(T * ldo), 4);
    float *o_one = calloc((size_t)(T * ldo), 4);
    /* as the layer does: L2-normalised q (scaled) and k */
    be->ops->l2norm(be, qk, ldqk, T, Hk, dk, 1.0f / sqrtf((float)dk), 1e-6f);
    be->ops->l2norm(be, qk + (int64_t)Hk * dk, ldqk, T, Hk, dk, 1.0f, 1e-6f);
    int32_t max_len = 0;
    for (int s = 0; s < S; s++)
        max_len = lens[s] > max_len ? lens[s] : max_len;
    dfl_gated_delta g = {
        .q = qk, .k = qk + (int64_t)Hk * dk, .ldqk = ldqk, .v = v, .ldv = ldv,
        .b = ab, .a = ab + Hv, .ldab = ldab, .A_log = A_log, .dt_bias = dtb,
        .o = o_rec, .ldo = ldo, .cu_seqlens = cu, .n_seqs = S, .max_len = max_len, .T = T,
        .Hk = Hk, .Hv = Hv, .dk = dk, .dv = dv, .chunk = 0,
    };
    T_CHECK(be->ops->gated_delta(be, &g) == 0, "recurrence");
    g.o = o_chk;
    g.chunk = 64;
    T_CHECK(be->ops->gated_delta(be, &g) == 0, "chunked");
    /* each sequence alone, chunked */
    for (int s = 0; s < S; s++) {
        int32_t cu1[2] = {0, lens[s]};
        dfl_gated_delta g1 = g;
        g1.q = qk + cu[s] * ldqk;
        g1.k = qk + cu[s] * ldqk + (int64_t)Hk * dk;
        g1.v = v + cu[s] * ldv;
        g1.b = ab + cu[s] * ldab;
        g1.a = ab + cu[s] * ldab + Hv;
        g1.o = o_one + cu[s] * ldo;
        g1.cu_seqlens = cu1;
        g1.n_seqs = 1;
        g1.T = lens[s];
        T_CHECK(be->ops->gated_delta(be, &g1) == 0, "alone");
    }
    for (int s = 0; s < S; s++) {
        double e1 = t_rows_err(o_chk + cu[s] * ldo, ldo, o_rec + cu[s] * ldo, ldo, lens[s], ldo, 1e-30);
        double e2 = t_rows_err(o_one + cu[s] * ldo, ldo, o_chk + cu[s] * ldo, ldo, lens[s], ldo, 1e-30);
        if (getenv("DFL_TEST_VERBOSE"))
            fprintf(stderr, "  Hk %d Hv %d dk %d dv %d len %d: chunked vs recurrence %.3g, "
                    "alone vs packed %.3g\n", Hk, Hv, dk, dv, lens[s], e1, e2);
        T_CHECK(e1 <= 2e-5, "Hk %d Hv %d dk %d dv %d, sequence of %d: chunked vs recurrence %.3g",
                Hk, Hv, dk, dv, lens[s], e1);
        T_CHECK(e2 <= 1e-6, "Hk %d Hv %d dk %d dv %d, sequence of %d: alone vs packed %.3g", Hk,
                Hv, dk, dv, lens[s], e2);
    }
    free(qk); free(v); free(ab); free(A_log); free(dtb); free(o_rec); free(o_chk); free(o_one);
}

static void test_delta_chunked_vs_recurrence(void)
{
    dfl_be *be = t_cpu_backend();
    if (!be)
        return;
    const int32_t lens[] = {1, 63, 64, 65, 200};
    struct { int Hk, Hv, dk, dv; } cases[] = {
        {1, 1, 32, 32}, {2, 4, 32, 32}, {2, 6, 16, 24}, {3, 3, 64, 64}, {1, 4, 24, 40},
    };
    for (size_t i = 0; i < DFL_ARRAY_LEN(cases); i++)
        delta_case(be, lens, 5, cases[i].Hk, cases[i].Hv, cases[i].dk, cases[i].dv);
    /* a head ratio that does not divide is refused */
    dfl_gated_delta bad = {.Hk = 2, .Hv = 3, .dk = 8, .dv = 8, .chunk = 64};
    T_CHECK(be->ops->gated_delta(be, &bad) == DFL_EUNSUP, "Hv 3 over Hk 2");
    dfl_be_close(be);
}

/* One token, one head, by hand: S = k beta v^T after the first token, o = S^T q. */
static void test_delta_by_hand(void)
{
    dfl_be *be = t_cpu_backend();
    if (!be)
        return;
    float qk[4] = {0.6f, 0.8f, 1.0f, 0.0f}; /* q, k (dk 2) */
    float v[2] = {2.0f, -1.0f}, ab[2] = {0.0f, 0.0f}; /* b, a */
    float A_log = 0.0f, dtb = 0.0f, o[2] = {0};
    int32_t cu[2] = {0, 1};
    dfl_gated_delta g = {.q = qk, .k = qk + 2, .ldqk = 4, .v = v, .ldv = 2, .b = ab, .a = ab + 1,
                         .ldab = 2, .A_log = &A_log, .dt_bias = &dtb, .o = o, .ldo = 2,
                         .cu_seqlens = cu, .n_seqs = 1, .max_len = 1, .T = 1, .Hk = 1, .Hv = 1,
                         .dk = 2, .dv = 2, .chunk = 64};
    T_CHECK(be->ops->gated_delta(be, &g) == 0, "run");
    /* beta = 0.5; S = k (0.5 v)^T = [[1, -0.5], [0, 0]]; o = S^T q = 0.6 * [1, -0.5] */
    T_NEAR(o[0], 0.6, 1e-6, "o[0]");
    T_NEAR(o[1], -0.3, 1e-6, "o[1]");
    dfl_be_close(be);
}

static void test_conv1d_per_sequence(void)
{
    dfl_be *be = t_cpu_backend();
    if (!be)
        return;
    /* two sequences of 3 and 4 tokens, 2 channels, K = 4 */
    int32_t pos[7] = {0, 1, 2, 0, 1, 2, 3};
    float x[14], w[8], y[14];
    for (int i = 0; i < 14; i++)
        x[i] = (float)(i + 1) * 0.1f;
    for (int i = 0; i < 8; i++)
        w[i] = (float)(i % 4 + 1) * 0.25f; /* w[c, j] = (j+1)/4 */
    T_CHECK(be->ops->conv1d_silu(be, y, 2, x, 2, w, pos, 7, 2, 4) == 0, "run");
    for (int t = 0; t < 7; t++)
        for (int c = 0; c < 2; c++) {
            double acc = 0;
            for (int j = 0; j < 4 && j <= pos[t]; j++)
                acc += w[c * 4 + 3 - j] * x[(t - j) * 2 + c];
            double want = acc / (1.0 + exp(-acc));
            T_NEAR(y[t * 2 + c], want, 1e-6, "conv");
        }
    /* token 3 starts a sequence: only its own input counts */
    double a3 = 1.0 * x[6];
    T_NEAR(y[6], a3 / (1.0 + exp(-a3)), 1e-6, "first token of the second sequence");
    dfl_be_close(be);
}

static void test_small_ops(void)
{
    dfl_be *be = t_cpu_backend();
    if (!be)
        return;
    /* zero-centred RMSNorm: rmsnorm(x) * (1 + w) */
    float x[4] = {1, -2, 3, -4}, w[4] = {0, 0.5f, -0.5f, 1}, y[4];
    T_CHECK(be->ops->rmsnorm_1p(be, y, x, w, 1, 4, 0.0f) == 0, "rmsnorm_1p");
    double r = 1.0 / sqrt((1 + 4 + 9 + 16) / 4.0);
    for (int i = 0; i < 4; i++)
        T_NEAR(y[i], x[i] * r * (1 + w[i]), 1e-6, "rmsnorm_1p");
    /* L2 norm with scale */
    float v[4] = {3, 4, 0, 0};
    T_CHECK(be->ops->l2norm(be, v, 4, 1, 2, 2, 2.0f, 1e-6f) == 0, "l2norm");
    T_NEAR(v[0], 1.2, 1e-6, "l2 0");
    T_NEAR(v[1], 1.6, 1e-6, "l2 1");
    T_CHECK(v[2] == 0 && v[3] == 0, "a zero head stays zero (eps)");
    /* gated RMSNorm: w * rmsnorm(x) * silu(z) */
    float gx[2] = {1, -1}, z[2] = {0.5f, -2}, gw[2] = {2, 3};
    T_CHECK(be->ops->gated_rmsnorm(be, gx, 2, z, 2, gw, 1, 1, 2, 0.0f) == 0, "gated_rmsnorm");
    T_NEAR(gx[0], 2 * 1 * 0.5 / (1 + exp(-0.5)), 1e-6, "gated 0");
    T_NEAR(gx[1], 3 * -1 * -2 / (1 + exp(2.0)), 1e-6, "gated 1");
    /* sigmoid gate */
    float a[2] = {2, 2}, gt[2] = {0, 100};
    T_CHECK(be->ops->sigmoid_mul(be, a, 2, gt, 2, 1, 2) == 0, "sigmoid_mul");
    T_NEAR(a[0], 1, 1e-6, "sigmoid(0)");
    T_NEAR(a[1], 2, 1e-6, "sigmoid(100)");
    /* partial RoPE: dims past rot pass through (norm weight 0: plain rmsnorm) */
    float h[8] = {1, 2, 3, 4, 5, 6, 7, 8}, hw[8] = {0};
    int32_t p = 3;
    T_CHECK(be->ops->qknorm_rope_partial(be, h, 8, hw, &p, 1, 1, 8, 4, 0.0f, 10000.0f) == 0, "rope");
    double rr = 1.0 / sqrt((1 + 4 + 9 + 16 + 25 + 36 + 49 + 64) / 8.0);
    for (int i = 4; i < 8; i++)
        T_NEAR(h[i], (i + 1) * rr, 1e-6, "passed through");
    double c0 = cos(3.0), s0 = sin(3.0); /* inv_freq[0] = 1 */
    T_NEAR(h[0], (1 * c0 - 3 * s0) * rr, 1e-5, "rotated 0");
    T_NEAR(h[2], (3 * c0 + 1 * s0) * rr, 1e-5, "rotated 2");
    dfl_be_close(be);
}

int main(int argc, char **argv)
{
    t_init(argv[0]);
    T_RUN(test_delta_by_hand);
    T_RUN(test_delta_chunked_vs_recurrence);
    T_RUN(test_conv1d_per_sequence);
    T_RUN(test_small_ops);
    return t_done();
}
