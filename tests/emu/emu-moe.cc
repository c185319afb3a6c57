/* emu-moe.cc: runs the grouped expert GEMM of kernels/moe_gemm.cuh (moe_mm_mma_kernel, the bf16
 * path of the CUDA backend's moe_matmul) in the SIMT emulator (simt.h), in every tile shape
 * (MgTile0..4) and every form (plain; GATHER: A's token rows read through rows; SWIGLU: silu(gate)
 * * up in the epilogue; both: the fused gate|up of dfl_moe_forward), on grouped inputs laid out as
 * moe_route makes them (each expert's rows padded to DFL_MOE_PAD, uneven counts with empty
 * experts, counts that are not multiples of the tile, N not a multiple of the tile, odd N).
 * Checks: the plain product against a CPU product (f32 sums of the bf16 inputs) within the bf16
 * rounding of the result; the fused forms bit for bit against the plain kernel of the same tile
 * followed by the gather done on the host and the swiglu of kernels/ops.cu (act-rounded gate and
 * up, silu in f32, rounded); and that padding rows and the rows past the last expert are left
 * as they were. The launch is the one of kernels/moe.cu (grid: column tiles x row tiles).
 * Built and run by tests/emu/run (moe). Exit 0 when everything agrees. */
#include "simt.h"

extern "C" {
#include "backend.h"
}

#include "../../kernels/moe_gemm.cuh"

static int failures;

#define EMU_SEED 0xB7E151628AED2A6Bull
#include "emu-rng.h"

static const float sentinel = 776.0f; /* exact in bf16 */

/* One launch of tile CF in form (G, S), the grid of kernels/moe.cu's moe_mma_launch. */
template <class CF, bool G, bool S>
static void run_tile(const std::vector<bf16> &A, const std::vector<int32_t> &rows,
                     const std::vector<bf16> &W, std::vector<bf16> &C,
                     const std::vector<int32_t> &cnt, const std::vector<int32_t> &off, int64_t N,
                     int64_t K, int64_t cap)
{
    const int E = (int)cnt.size();
    const int64_t Nc = S ? N / 2 : N, bn = S ? CF::BN / 2 : CF::BN;
    const bool pair = Nc % 2 == 0;
    const dim3 grid((unsigned)((Nc + bn - 1) / bn), (unsigned)(cap / CF::BM));
    emu::launch(grid, dim3(CF::THREADS), CF::SMEM, [&] {
        moe_mm_mma_kernel<CF, G, S>(A.data(), G ? rows.data() : nullptr, W.data(), C.data(),
                                    cnt.data(), off.data(), E, N, K, pair);
    });
}

/* Rows of C (width Nc) outside every expert still hold the sentinel; counted into *bad. */
static int64_t untouched_bad(const std::vector<bf16> &C, const std::vector<int32_t> &cnt,
                             const std::vector<int32_t> &off, int64_t Nc, int64_t cap)
{
    int64_t bad = 0;
    for (int64_t g = 0; g < cap; g++) {
        bool expert = false;
        for (size_t q = 0; q < cnt.size(); q++)
            expert |= g >= off[q] && g < off[q] + cnt[q];
        if (!expert)
            for (int64_t n = 0; n < Nc; n++)
                bad += !(__bfloat162float(C[(size_t)(g * Nc + n)]) == sentinel);
    }
    return bad;
}

template <class CF>
static void moe_case(const char *tile, const std::vector<int> &counts, int64_t N, int64_t K)
{
    const int E = (int)counts.size();
    std::vector<int32_t> cnt(counts.begin(), counts.end()), off((size_t)E + 1);
    int32_t o = 0;
    for (int e = 0; e < E; e++) {
        off[(size_t)e] = o;
        o += (cnt[(size_t)e] + DFL_MOE_PAD - 1) / DFL_MOE_PAD * DFL_MOE_PAD;
    }
    off[(size_t)E] = o;
    const int64_t cap = o + DFL_MOE_PAD; /* one more tile past the last expert: left alone */
    /* tokens: as many as the largest expert plus a few; each expert takes an ascending subset */
    int64_t T = 3;
    for (int c : counts)
        T = std::max<int64_t>(T, c + 3);
    std::vector<bf16> X((size_t)(T * K));
    for (auto &x : X)
        x = __float2bfloat16_rn(rnorm());
    std::vector<int32_t> rows((size_t)cap, -1);
    for (int e = 0; e < E; e++) {
        int64_t skip = T - cnt[(size_t)e], t = 0; /* drop skip tokens, spread out */
        for (int64_t i = 0; i < cnt[(size_t)e]; i++, t++) {
            while (skip > 0 && (t * 7 + e) % 3 == 0) {
                t++;
                skip--;
            }
            rows[(size_t)(off[(size_t)e] + i)] = (int32_t)t;
        }
    }
    /* A: the gathered rows, NaN in the padding (never to be read) */
    const float nanf_ = NAN;
    std::vector<bf16> A((size_t)(cap * K), __float2bfloat16_rn(nanf_));
    for (int64_t g = 0; g < cap; g++)
        if (rows[(size_t)g] >= 0)
            for (int64_t k = 0; k < K; k++)
                A[(size_t)(g * K + k)] = X[(size_t)(rows[(size_t)g] * K + k)];
    std::vector<bf16> W((size_t)(E * N * K));
    for (auto &w : W)
        w = __float2bfloat16_rn(0.2f * rnorm());
    const bf16 s16 = __float2bfloat16_rn(sentinel);
    std::vector<bf16> C((size_t)(cap * N), s16);
    run_tile<CF, false, false>(A, rows, W, C, cnt, off, N, K, cap);
    int64_t bad = 0, padbad = untouched_bad(C, cnt, off, N, cap);
    double worst = 0;
    for (int e = 0; e < E; e++)
        for (int64_t g = off[(size_t)e]; g < off[(size_t)e] + cnt[(size_t)e]; g++)
            for (int64_t n = 0; n < N; n++) {
                const float got = __bfloat162float(C[(size_t)(g * N + n)]);
                float ref = 0, mag = 0;
                for (int64_t k = 0; k < K; k++) {
                    const float p = __bfloat162float(A[(size_t)(g * K + k)]) *
                                    __bfloat162float(W[(size_t)(((int64_t)e * N + n) * K + k)]);
                    ref += p;
                    mag += fabsf(p);
                }
                /* bf16 rounding of the output (half an ulp: 2^-9 relative; 2^-8 allowed), plus
                 * the f32 sum in another order */
                const double err = fabs((double)got - ref),
                             tol = fabs(ref) / 256 + 1e-5 * mag + 1e-30;
                worst = std::max(worst, err / tol);
                if (!(err <= tol)) {
                    if (bad < 4)
                        fprintf(stderr, "    row %lld (expert %d) col %lld: got %g, want %g\n",
                                (long long)g, e, (long long)n, got, ref);
                    bad++;
                }
            }
    /* the fused forms against the plain product: gather on the host, swiglu as ops.cu does */
    const int64_t Nh = N / 2;
    std::vector<bf16> act((size_t)(cap * Nh), s16);
    for (int64_t g = 0; g < cap; g++)
        if (rows[(size_t)g] >= 0)
            for (int64_t i = 0; i < Nh; i++) {
                const float gv = __bfloat162float(C[(size_t)(g * N + i)]);
                const float uv = __bfloat162float(C[(size_t)(g * N + Nh + i)]);
                act[(size_t)(g * Nh + i)] = __float2bfloat16_rn(gv / (1.0f + expf(-gv)) * uv);
            }
    int64_t fbad[3] = {0, 0, 0};
    std::vector<bf16> Cg((size_t)(cap * N), s16);
    run_tile<CF, true, false>(X, rows, W, Cg, cnt, off, N, K, cap);
    fbad[0] = untouched_bad(Cg, cnt, off, N, cap) +
              (int64_t)(memcmp(Cg.data(), C.data(), C.size() * sizeof(bf16)) != 0);
    if (N % 2 == 0) {
        std::vector<bf16> Cs((size_t)(cap * Nh), s16), Cf((size_t)(cap * Nh), s16);
        run_tile<CF, false, true>(A, rows, W, Cs, cnt, off, N, K, cap);
        run_tile<CF, true, true>(X, rows, W, Cf, cnt, off, N, K, cap);
        fbad[1] = untouched_bad(Cs, cnt, off, Nh, cap);
        fbad[2] = untouched_bad(Cf, cnt, off, Nh, cap);
        for (size_t i = 0; i < act.size(); i++) {
            fbad[1] += !(memcmp(&Cs[i], &act[i], sizeof(bf16)) == 0);
            fbad[2] += !(memcmp(&Cf[i], &act[i], sizeof(bf16)) == 0);
        }
    }
    char what[200];
    int w = snprintf(what, sizeof what, "%s N %lld K %lld counts", tile, (long long)N,
                     (long long)K);
    for (int e = 0; e < E && w < 150; e++)
        w += snprintf(what + w, sizeof what - (size_t)w, " %d", cnt[(size_t)e]);
    printf("  %-60s worst err/tol %.3f%s%s; fused: gather %s, swiglu %s, both %s\n", what, worst,
           bad ? "  FAIL" : "", padbad ? "  FAIL (padding rows written)" : "",
           fbad[0] ? "FAIL" : "exact", N % 2 ? "-" : fbad[1] ? "FAIL" : "exact",
           N % 2 ? "-" : fbad[2] ? "FAIL" : "exact");
    if (bad || padbad || fbad[0] || fbad[1] || fbad[2])
        failures++;
}

template <class CF> static void tile_cases(const char *tile)
{
    moe_case<CF>(tile, {70, 0, 130, 5, 64}, 200, 96);  /* empty expert, partial tiles, N tail */
    moe_case<CF>(tile, {0, 1, 63, 0}, 72, 32);         /* one K step: fewer than the stages */
    moe_case<CF>(tile, {65, 128, 0, 3}, 257, 160);     /* odd N (single stores), stages wrap */
    moe_case<CF>(tile, {200, 0, 0, 17, 300, 64, 1, 90}, 518, 256); /* column tiles, long K,
                                                                     * odd N / 2 */
}

int main()
{
    printf("emu-moe: kernels/moe_gemm.cuh in the SIMT emulator\n");
    tile_cases<MgTile0>("tile0 64x128");
    tile_cases<MgTile1>("tile1 128x128/8w");
    tile_cases<MgTile2>("tile2 128x128/4w");
    tile_cases<MgTile3>("tile3 128x256");
    tile_cases<MgTile4>("tile4 128x256/4st");
    printf("emu-moe: %s\n", failures ? "FAIL" : "ok");
    return failures ? 1 : 0;
}
