/* emu-moe.cc: runs the grouped expert GEMM of kernels/moe_gemm.cuh (moe_mm_mma_kernel, the bf16
 * path of the CUDA backend's moe_matmul) in the SIMT emulator (simt.h) on grouped inputs laid
 * out as moe_route makes them (each expert's rows padded to DFL_MOE_PAD, uneven counts with
 * empty experts, N not a multiple of the tile, odd N) and compares it with a plain CPU product
 * (f32 sums of the bf16 inputs): each output within the bf16 rounding of the result, and the
 * padding rows and the rows past the last expert left as they were. The launch is the one of
 * kernels/moe.cu (grid: column tiles x row tiles). Built and run by tests/emu/run (moe).
 * Exit 0 when everything agrees. */
#include "simt.h"

extern "C" {
#include "backend.h"
}

#include "../../kernels/moe_gemm.cuh"

static int failures;

#define EMU_SEED 0xB7E151628AED2A6Bull
#include "emu-rng.h"

static void moe_case(const std::vector<int> &counts, int64_t N, int64_t K)
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
    const float nanf_ = NAN, sentinel = 776.0f; /* exact in bf16 */
    /* A: random bf16 in the experts' rows, NaN in the padding (never to be read) */
    std::vector<bf16> A((size_t)(cap * K), __float2bfloat16_rn(nanf_));
    for (int e = 0; e < E; e++)
        for (int64_t g = off[(size_t)e]; g < off[(size_t)e] + cnt[(size_t)e]; g++)
            for (int64_t k = 0; k < K; k++)
                A[(size_t)(g * K + k)] = __float2bfloat16_rn(rnorm());
    std::vector<bf16> W((size_t)(E * N * K));
    for (auto &w : W)
        w = __float2bfloat16_rn(0.2f * rnorm());
    std::vector<bf16> C((size_t)(cap * N), __float2bfloat16_rn(sentinel));
    const bool pair = N % 2 == 0;
    const dim3 grid((unsigned)((N + MG_BN - 1) / MG_BN), (unsigned)(cap / MG_BM));
    emu::launch(grid, dim3(MG_THREADS), MG_SMEM, [&] {
        moe_mm_mma_kernel(A.data(), W.data(), C.data(), cnt.data(), off.data(), E, N, K, pair);
    });
    int64_t bad = 0, padbad = 0;
    double worst = 0;
    for (int64_t g = 0; g < cap; g++) {
        int e = -1;
        for (int q = 0; q < E; q++)
            if (g >= off[(size_t)q] && g < off[(size_t)q] + cnt[(size_t)q])
                e = q;
        for (int64_t n = 0; n < N; n++) {
            const float got = __bfloat162float(C[(size_t)(g * N + n)]);
            if (e < 0) {
                if (!(got == sentinel))
                    padbad++;
                continue;
            }
            float ref = 0, mag = 0;
            for (int64_t k = 0; k < K; k++) {
                const float p = __bfloat162float(A[(size_t)(g * K + k)]) *
                                __bfloat162float(W[(size_t)(((int64_t)e * N + n) * K + k)]);
                ref += p;
                mag += fabsf(p);
            }
            /* bf16 rounding of the output (half an ulp: 2^-9 relative; 2^-8 allowed), plus the
             * f32 sum in another order */
            const double err = fabs((double)got - ref), tol = fabs(ref) / 256 + 1e-5 * mag + 1e-30;
            worst = std::max(worst, err / tol);
            if (!(err <= tol)) {
                if (bad < 4)
                    fprintf(stderr, "    row %lld (expert %d) col %lld: got %g, want %g\n",
                            (long long)g, e, (long long)n, got, ref);
                bad++;
            }
        }
    }
    char what[200];
    int w = snprintf(what, sizeof what, "moe_mm_mma E %d N %lld K %lld counts", E, (long long)N,
                     (long long)K);
    for (int e = 0; e < E && w < 150; e++)
        w += snprintf(what + w, sizeof what - (size_t)w, " %d", cnt[(size_t)e]);
    printf("  %-64s worst err/tol %.3f%s%s\n", what, worst, bad ? "  FAIL" : "",
           padbad ? "  FAIL (padding rows written)" : "");
    if (bad || padbad)
        failures++;
}

int main()
{
    printf("emu-moe: kernels/moe_gemm.cuh in the SIMT emulator\n");
    moe_case({70, 0, 130, 5, 64}, 200, 96);        /* empty expert, partial tiles, N tail */
    moe_case({0, 1, 63, 0}, 72, 32);               /* one K step: fewer than the stages */
    moe_case({65, 128, 0, 3}, 257, 160);           /* odd N (single stores), stages wrap */
    moe_case({200, 0, 0, 17, 300, 64, 1, 90}, 384, 256); /* several column tiles, long K */
    printf("emu-moe: %s\n", failures ? "FAIL" : "ok");
    return failures ? 1 : 0;
}
