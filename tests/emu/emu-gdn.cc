/* emu-gdn.cc: runs the two-pass chunked gated delta rule of kernels/gdn_chunk.cuh (gc_prep_kernel,
 * then gc_state_kernel: the bf16 tensor-core path of the CUDA backend's gated_delta), and the
 * one-kernel form beside it (gated_delta_tc_kernel), and the bf16 mma.sync passes
 * (gm_prep_kernel, gm_state_kernel: the default of the two-pass form), in the SIMT
 * emulator (simt.h, with the WMMA of wmma.h) and compares it with the CPU backend's token-by-token
 * recurrence (chunk 0) on the same bf16-rounded inputs: packed sequences of 1, 63, 64, 65 and 200
 * tokens (around the chunk of 64), key head dims 64 and 128, value head dims 64, 128 and 192, head
 * ratios 1 to 3, and a key-side grid narrower than the chunks (its blocks loop). The workspace
 * starts as NaN, the 64 rows past T too (which the backend zeroes): a partial chunk's reads past
 * its tokens, of the next sequence's rows or of those, must not reach the output; and the
 * columns of the output past the heads' must stay as they were. The decays are slow, so that
 * the state carried over chunk boundaries shapes the output. Each row within the bf16
 * rounding (relative L2 5e-3; the GPU test allows 1e-2). Built and run by tests/emu/run (gdn). */
#include "simt.h"
#include "wmma.h"

extern "C" {
#include "backend.h"
}

#include "../../kernels/gdn_chunk.cuh"
#include "../../kernels/hybrid_ew.cuh"

static int failures;

#define EMU_SEED 0x9E3779B97F4A7C15ull
#include "emu-rng.h"

static float bfr(float x) { return __bfloat162float(__float2bfloat16_rn(x)); }

/* max over rows of ||got - want|| / ||want|| (rows of n, strides ldg / ldw) */
static double rows_rel(const bf16 *got, int64_t ldg, const float *want, int64_t ldw, int64_t R, int64_t n)
{
    double worst = 0;
    for (int64_t r = 0; r < R; r++) {
        double d2 = 0, w2 = 0;
        for (int64_t c = 0; c < n; c++) {
            double gv = __bfloat162float(got[(size_t)(r * ldg + c)]), wv = want[(size_t)(r * ldw + c)];
            d2 += (gv - wv) * (gv - wv);
            w2 += wv * wv;
        }
        double rel = sqrt(d2 / (w2 > 1e-30 ? w2 : 1e-30));
        if (!(rel <= worst))
            worst = rel;
    }
    return worst;
}

/* grid_x > 0: the two-pass form, its key-side grid grid_x chunks wide, with the bf16 mma.sync
 * passes (gm_prep_kernel, gm_state_kernel of state_warps warps) when mma, else the TF32 ones; 0:
 * the one-kernel form */
template <int DK>
static void gdn_case(dfl_be *cpu, const std::vector<int32_t> &lens, int Hk, int Hv, int dv, int grid_x,
                     bool mma = true, int state_warps = 8)
{
    const int S = (int)lens.size();
    std::vector<int32_t> cu((size_t)S + 1, 0);
    int32_t max_len = 0;
    for (int s = 0; s < S; s++) {
        cu[(size_t)s + 1] = cu[(size_t)s] + lens[(size_t)s];
        max_len = std::max(max_len, lens[(size_t)s]);
    }
    const int64_t T = cu[(size_t)S], ldqk = 2 * (int64_t)Hk * DK + (int64_t)Hv * dv, ldab = 2 * Hv;
    const int64_t ldo = (int64_t)Hv * dv + 8; /* 8 columns that must stay untouched */
    std::vector<float> qkv((size_t)(T * ldqk)), ab((size_t)(T * ldab)), A_log((size_t)Hv), dtb((size_t)Hv);
    for (auto &x : qkv)
        x = rnorm();
    for (auto &x : ab)
        x = bfr(1.5f * rnorm());
    /* slow decays (|g| ~ 1e-3 to 0.1): the state carried from chunk to chunk matters */
    for (auto &x : A_log)
        x = -4.0f + rnorm();
    for (auto &x : dtb)
        x = -1.0f + 0.5f * rnorm();
    cpu->ops->l2norm(cpu, qkv.data(), ldqk, T, Hk, DK, 1.0f / sqrtf((float)DK), 1e-6f);
    cpu->ops->l2norm(cpu, qkv.data() + (int64_t)Hk * DK, ldqk, T, Hk, DK, 1.0f, 1e-6f);
    for (auto &x : qkv)
        x = bfr(x);
    std::vector<float> want((size_t)(T * ldo), 0.0f);
    dfl_gated_delta g = {};
    g.q = qkv.data();
    g.k = qkv.data() + (int64_t)Hk * DK;
    g.ldqk = ldqk;
    g.v = qkv.data() + 2 * (int64_t)Hk * DK;
    g.ldv = ldqk;
    g.b = ab.data();
    g.a = ab.data() + Hv;
    g.ldab = ldab;
    g.A_log = A_log.data();
    g.dt_bias = dtb.data();
    g.o = want.data();
    g.ldo = ldo;
    g.cu_seqlens = cu.data();
    g.n_seqs = S;
    g.max_len = max_len;
    g.T = T;
    g.Hk = Hk;
    g.Hv = Hv;
    g.dk = DK;
    g.dv = dv;
    g.chunk = 0;
    if (cpu->ops->gated_delta(cpu, &g)) {
        printf("FAIL cpu recurrence\n");
        failures++;
        return;
    }
    /* the device side: bf16 inputs, f32 workspace full of NaN, bf16 output with a sentinel */
    std::vector<bf16> xq((size_t)(T * ldqk)), xab((size_t)(T * ldab));
    for (size_t i = 0; i < xq.size(); i++)
        xq[i] = __float2bfloat16_rn(qkv[i]);
    for (size_t i = 0; i < xab.size(); i++)
        xab[i] = __float2bfloat16_rn(ab[i]);
    const float sentinel = 776.0f; /* exact in bf16 */
    std::vector<bf16> o((size_t)(T * ldo), __float2bfloat16_rn(sentinel));
    gc_ws w;
    w.rows = T + GT_C;
    const size_t per = (size_t)w.rows * (size_t)Hv;
    std::vector<float> wn(per * DK, NAN), qe(per * DK, NAN), kd(per * DK, NAN), u(per * (size_t)dv, NAN),
        aqk(per * GT_C, NAN), cg(per, NAN);
    w.wn = wn.data();
    w.qe = qe.data();
    w.kd = kd.data();
    w.u = u.data();
    w.aqk = aqk.data();
    w.cg = cg.data();
    const bf16 *q = xq.data(), *k = q + (int64_t)Hk * DK, *v = q + 2 * (int64_t)Hk * DK;
    const bf16 *b = xab.data(), *a = b + Hv;
    const int ratio = Hv / Hk;
    if (grid_x > 0) {
        emu::launch(dim3((unsigned)grid_x, (unsigned)S, (unsigned)Hv), dim3(GT_THREADS),
                    mma ? gm_prep_smem<DK>() : gc_prep_smem<DK>(), [&] {
            if (mma)
                gm_prep_kernel<DK>(q, k, ldqk, v, ldqk, a, b, ldab, A_log.data(), dtb.data(), cu.data(), ratio, dv, w);
            else
                gc_prep_kernel<DK>(q, k, ldqk, v, ldqk, a, b, ldab, A_log.data(), dtb.data(), cu.data(), ratio, dv, w);
        });
        /* the key-side pass writes its tokens' rows only: the 64 past T stay NaN in every head */
        int64_t tail = 0;
        for (int j = 0; j < Hv; j++)
            for (int64_t r = T; r < w.rows; r++) {
                const size_t row = (size_t)j * (size_t)w.rows + (size_t)r;
                for (int x = 0; x < DK; x++)
                    tail += !std::isnan(wn[row * DK + x]) + !std::isnan(qe[row * DK + x]) + !std::isnan(kd[row * DK + x]);
                for (int x = 0; x < dv; x++)
                    tail += !std::isnan(u[row * (size_t)dv + x]);
                for (int x = 0; x < GT_C; x++)
                    tail += !std::isnan(aqk[row * GT_C + x]);
                tail += !std::isnan(cg[row]);
            }
        if (tail) {
            printf("FAIL gdn two-pass DK %d dv %d: %lld values written past the tokens' rows\n", DK, dv, (long long)tail);
            failures++;
        }
        /* with the mma state pass, Qe and Kd are not written at all */
        int64_t qk = 0;
        for (size_t i = 0; mma && i < qe.size(); i++)
            qk += !std::isnan(qe[i]) + !std::isnan(kd[i]);
        if (qk) {
            printf("FAIL gdn two-pass DK %d dv %d: %lld values of Qe, Kd written\n", DK, dv, (long long)qk);
            failures++;
        }
        if (mma && state_warps == 8)
            emu::launch(dim3((unsigned)(S * Hv * (dv / GT_DVB))), dim3(256), gm_state_smem<DK>(), [&] {
                gm_state_kernel<DK, 8>(w, q, k, ldqk, cu.data(), o.data(), ldo, Hv, ratio, dv);
            });
        else if (mma)
            emu::launch(dim3((unsigned)(S * Hv * (dv / GT_DVB))), dim3(512), gm_state_smem<DK>(), [&] {
                gm_state_kernel<DK, 16>(w, q, k, ldqk, cu.data(), o.data(), ldo, Hv, ratio, dv);
            });
        else
            emu::launch(dim3((unsigned)(S * Hv * (dv / GT_DVB))), dim3(GT_THREADS), gc_state_smem<DK>(), [&] {
                gc_state_kernel<DK>(w, cu.data(), o.data(), ldo, Hv, dv);
            });
    } else {
        emu::launch(dim3((unsigned)(S * Hv), (unsigned)(dv / GT_DVB)), dim3(GT_THREADS), gt_smem<DK>(), [&] {
            gated_delta_tc_kernel<DK>(q, k, ldqk, v, ldqk, a, b, ldab, A_log.data(), dtb.data(), o.data(), ldo,
                                      cu.data(), Hv, ratio, dv);
        });
    }
    const double worst = rows_rel(o.data(), ldo, want.data(), ldo, T, (int64_t)Hv * dv);
    int64_t touched = 0;
    for (int64_t t = 0; t < T; t++)
        for (int64_t c = (int64_t)Hv * dv; c < ldo; c++)
            touched += !(__bfloat162float(o[(size_t)(t * ldo + c)]) == sentinel);
    bool ok = worst <= 5e-3 && touched == 0; /* the bf16 rounding of the output is ~2e-3 */
    char form[64];
    if (grid_x > 0)
        snprintf(form, sizeof form, "two-pass (%s passes%s), key-side grid %d", mma ? "bf16 mma.sync" : "TF32",
                 mma ? (state_warps == 8 ? ", 8-warp state" : ", 16-warp state") : "", grid_x);
    else
        snprintf(form, sizeof form, "one-kernel");
    printf("%s gdn %s, DK %d dv %d Hk %d Hv %d, %d sequences (T %lld): max row rel err %.3g, %lld pad "
           "columns touched\n", ok ? "ok  " : "FAIL", form, DK, dv, Hk, Hv, S, (long long)T, worst,
           (long long)touched);
    failures += !ok;
}

/* The 8-channel conv1d + SiLU and sigmoid gate of hybrid_ew.cuh against the CPU ops on the same
 * bf16 inputs: packed sequences of 1, 2, 3, 7 and 30 tokens (the window cut at each start), C
 * channels of rows of stride ld, few row slots (each thread loops over tokens); the columns past
 * C must stay as they were. */
static void ew_case(dfl_be *cpu, int64_t C, int64_t ld, unsigned slots)
{
    const std::vector<int32_t> lens = {1, 2, 3, 7, 30};
    std::vector<int32_t> pos;
    for (int32_t n : lens)
        for (int32_t j = 0; j < n; j++)
            pos.push_back(j);
    const int64_t T = (int64_t)pos.size();
    std::vector<float> x((size_t)(T * ld)), w((size_t)(C * 4)), g((size_t)(T * ld));
    for (auto &v : x)
        v = bfr(rnorm());
    for (auto &v : w)
        v = bfr(0.5f * rnorm());
    for (auto &v : g)
        v = bfr(2.0f * rnorm());
    std::vector<float> want((size_t)(T * ld), 0.0f), wsig = x;
    cpu->ops->conv1d_silu(cpu, want.data(), ld, x.data(), ld, w.data(), pos.data(), T, C, 4);
    cpu->ops->sigmoid_mul(cpu, wsig.data(), ld, g.data(), ld, T, C);
    const float sentinel = 776.0f;
    std::vector<bf16> bx((size_t)(T * ld)), bw((size_t)(C * 4)), bg((size_t)(T * ld));
    std::vector<bf16> y((size_t)(T * ld), __float2bfloat16_rn(sentinel));
    for (size_t i = 0; i < bx.size(); i++) {
        bx[i] = __float2bfloat16_rn(x[i]);
        bg[i] = __float2bfloat16_rn(g[i]);
    }
    for (size_t i = 0; i < bw.size(); i++)
        bw[i] = __float2bfloat16_rn(w[i]);
    const dim3 grid((unsigned)((C / 8 + EW_THREADS - 1) / EW_THREADS), slots);
    emu::launch(grid, dim3(EW_THREADS), 0, [&] {
        conv1d_silu_v8_kernel<4>(y.data(), ld, bx.data(), ld, bw.data(), pos.data(), T, (int)C);
    });
    std::vector<bf16> sx = bx;
    for (int64_t r = 0; r < T; r++) /* the columns past C: the sentinel, to stay */
        for (int64_t c = C; c < ld; c++)
            sx[(size_t)(r * ld + c)] = __float2bfloat16_rn(sentinel);
    emu::launch(grid, dim3(EW_THREADS), 0, [&] { sigmoid_mul_v8_kernel(sx.data(), ld, bg.data(), ld, T, (int)C); });
    int64_t touched = 0;
    for (int64_t r = 0; r < T; r++)
        for (int64_t c = C; c < ld; c++)
            touched += !(__bfloat162float(y[(size_t)(r * ld + c)]) == sentinel) +
                       !(__bfloat162float(sx[(size_t)(r * ld + c)]) == sentinel);
    double ec = rows_rel(y.data(), ld, want.data(), ld, T, C), es = rows_rel(sx.data(), ld, wsig.data(), ld, T, C);
    bool ok = ec <= 5e-3 && es <= 5e-3 && touched == 0;
    printf("%s conv1d_silu / sigmoid_mul, 8 channels a thread: C %lld, stride %lld, %u row slots: max row rel "
           "err %.3g / %.3g, %lld pad columns touched\n", ok ? "ok  " : "FAIL", (long long)C, (long long)ld, slots,
           ec, es, (long long)touched);
    failures += !ok;
}

/* The 8-channel per-head norms of hybrid_ew.cuh (l2norm_v8_kernel, gated_rmsnorm_v8_kernel: G =
 * d / 8 lanes a head) against the CPU ops on the same bf16 inputs: R rows of `heads` heads of d
 * in rows of stride ld (the columns past the heads must stay as they were), on `blocks` blocks
 * (the warps loop over the items; R * heads not a multiple of the items a warp takes, so that
 * some groups idle through the last step). */
template <int G>
static void norm_case(dfl_be *cpu, int64_t R, int heads, int64_t ld, unsigned blocks)
{
    const int d = 8 * G;
    const int64_t n = (int64_t)heads * d;
    std::vector<float> x((size_t)(R * ld)), z((size_t)(R * ld)), w((size_t)d);
    for (auto &v : x)
        v = bfr(rnorm());
    for (auto &v : z)
        v = bfr(2.0f * rnorm());
    for (auto &v : w)
        v = bfr(1.0f + 0.5f * rnorm());
    std::vector<float> wl = x, wg = x;
    cpu->ops->l2norm(cpu, wl.data(), ld, R, heads, d, 0.17f, 1e-6f);
    cpu->ops->gated_rmsnorm(cpu, wg.data(), ld, z.data(), ld, w.data(), R, heads, d, 1e-6f);
    const float sentinel = 776.0f;
    std::vector<bf16> bl((size_t)(R * ld)), bz((size_t)(R * ld)), bw((size_t)d);
    for (size_t i = 0; i < bl.size(); i++) {
        bl[i] = __float2bfloat16_rn((int64_t)(i % (size_t)ld) < n ? x[i] : sentinel);
        bz[i] = __float2bfloat16_rn(z[i]);
    }
    for (size_t i = 0; i < bw.size(); i++)
        bw[i] = __float2bfloat16_rn(w[i]);
    std::vector<bf16> bg = bl;
    emu::launch(dim3(blocks), dim3(EW_THREADS), 0, [&] { l2norm_v8_kernel<G>(bl.data(), ld, R, heads, 0.17f, 1e-6f); });
    emu::launch(dim3(blocks), dim3(EW_THREADS), 0, [&] {
        gated_rmsnorm_v8_kernel<G>(bg.data(), ld, bz.data(), ld, bw.data(), R, heads, 1e-6f);
    });
    int64_t touched = 0;
    for (int64_t r = 0; r < R; r++)
        for (int64_t c = n; c < ld; c++)
            touched += !(__bfloat162float(bl[(size_t)(r * ld + c)]) == sentinel) +
                       !(__bfloat162float(bg[(size_t)(r * ld + c)]) == sentinel);
    double el = rows_rel(bl.data(), ld, wl.data(), ld, R, n), eg = rows_rel(bg.data(), ld, wg.data(), ld, R, n);
    bool ok = el <= 5e-3 && eg <= 5e-3 && touched == 0;
    printf("%s l2norm / gated_rmsnorm, 8 channels a lane: %lld rows of %d heads of %d, stride %lld, %u blocks: "
           "max row rel err %.3g / %.3g, %lld pad columns touched\n", ok ? "ok  " : "FAIL", (long long)R, heads, d,
           (long long)ld, blocks, el, eg, (long long)touched);
    failures += !ok;
}

int main()
{
    setvbuf(stdout, nullptr, _IOLBF, 0);
    dfl_be *cpu = nullptr;
    dfl_err e = {};
    if (dfl_be_cpu_open(&cpu, 1, &e)) {
        fprintf(stderr, "cpu backend: %s\n", e.msg);
        return 1;
    }
    const std::vector<int32_t> lens = {1, 63, 64, 65, 200};
    gdn_case<128>(cpu, lens, 1, 1, 128, 4);
    gdn_case<128>(cpu, {65, 130}, 2, 6, 128, 1);   /* ratio 3, every block loops over chunks */
    gdn_case<64>(cpu, lens, 2, 4, 64, 4);
    gdn_case<64>(cpu, {100, 7}, 1, 3, 128, 2);
    gdn_case<128>(cpu, {70, 1}, 1, 2, 192, 2);
    gdn_case<128>(cpu, {65, 130}, 2, 6, 128, 1, true, 16); /* the 16-warp state pass */
    gdn_case<64>(cpu, lens, 2, 4, 64, 4, true, 16);
    gdn_case<128>(cpu, lens, 1, 1, 128, 4, false); /* the TF32 passes (DFL_CUDA_GDN_MMA=0) */
    gdn_case<64>(cpu, {65, 130}, 1, 3, 128, 2, false);
    gdn_case<128>(cpu, lens, 2, 6, 128, 0); /* the one-kernel form, on the same helpers */
    gdn_case<64>(cpu, {65, 130}, 1, 3, 128, 0);
    ew_case(cpu, 1096, 1112, 5);   /* two column blocks, the second partly idle */
    ew_case(cpu, 64, 72, 43);      /* a slot per row */
    norm_case<4>(cpu, 37, 3, 104, 2);   /* d 32: 8 heads a warp, 111 items */
    norm_case<16>(cpu, 37, 3, 392, 3);  /* d 128: 2 heads a warp */
    norm_case<32>(cpu, 5, 2, 520, 1);   /* d 256: a warp a head */
    norm_case<8>(cpu, 9, 5, 328, 64);   /* d 64, more warps than items */
    printf(failures ? "FAILED: %d checks\n" : "all checks passed\n", failures);
    dfl_be_close(cpu);
    return failures ? 1 : 0;
}
