/* moe_gemm.cuh: the bf16 grouped expert GEMM of the CUDA MoE path (kernels/moe.cu's
 * moe_matmul), C[g, :] = A[g, :] W_e^T for the grouped rows g of expert e, on mma.sync
 * m16n8k16 (bf16 in, f32 accumulation), in tile shapes MgCfg<BM, BN, WM, WN, ST>: a block
 * computes BM grouped rows (a divisor of DFL_MOE_PAD: a tile never spans two experts) by BN
 * columns of the product with WM x WN warps, each a (BM / WM) x (BN / WN) warp tile of 16 x 8
 * fragments; A and W_e come through shared memory MG_BK = 32 columns of K at a time, in ST
 * stages filled by cp.async (the loads of step k + ST - 1 overlap the tensor-core work of step
 * k), rows padded to 80 bytes so that ldmatrix reads are free of bank conflicts. Grid: x the
 * column tiles, y the row tiles, so that the column tiles of one row tile run together (A read
 * once from memory) and the row tiles of one expert follow each other (W_e stays in L2).
 * Two fusions, as template flags:
 *  GATHER: A holds token rows and grouped row g reads A row rows[g] (the row gather done by the
 *    A tile's cp.async, no gathered copy);
 *  SWIGLU: the block's BN weight rows are BN / 2 gate rows [c0, c0 + BN / 2) and the matching up
 *    rows [N / 2 + c0, ...) of the stacked gate|up weight, laid out in shared memory so that each
 *    warp holds the gate and up values of the same outputs (the first half of its fragments
 *    gate, the second half up); the epilogue writes silu(gate) * up, both rounded to bf16 first
 *    as moe_matmul then swiglu round them, into C [cap, N / 2].
 * Conditions: K % MG_BK == 0, A and W 16-byte aligned, N even with SWIGLU; rows past the expert's
 * count (padding) are neither read nor written. Device code only; needs from the including file
 * bf16, to_f32, from_f32 (be_cuda.cuh) and the PTX helpers (dflash_ptx.cuh);
 * tests/emu/emu-moe.cc compiles the same code for the CPU with the emulator's versions. */
#ifndef DFL_MOE_GEMM_CUH
#define DFL_MOE_GEMM_CUH

#include "moe_wgmma.h"

#define MG_BK 32
#define MG_ROWB (MG_BK * 2 + 16) /* bytes of a shared row: 80 */

template <int BM_, int BN_, int WM_, int WN_, int ST_> struct MgCfg {
    static constexpr int BM = BM_, BN = BN_, WM = WM_, WN = WN_, ST = ST_;
    static constexpr int THREADS = 32 * WM * WN;
    static constexpr int TM = BM / WM, TN = BN / WN; /* the warp tile */
    static constexpr int MI = TM / 16, NJ = TN / 8;  /* its fragments */
    static constexpr int CH = MG_BK / 8;             /* 16-byte chunks of a shared row */
    static constexpr int AI = BM * CH / THREADS, WI = BN * CH / THREADS; /* chunks per thread */
    static constexpr uint32_t AB = BM * MG_ROWB, STB = (BM + BN) * MG_ROWB;
    static constexpr size_t SMEM = (size_t)ST * STB;
    static_assert(TM % 16 == 0 && TN % 16 == 0, "warp tiles of whole ldmatrix x4 pieces");
    static_assert(BM * CH % THREADS == 0 && BN * CH % THREADS == 0, "even load split");
    static_assert(ST >= 2, "a pipeline needs two stages");
};

/* The expert of grouped row g (below offsets[E]): moe_wgmma.h's mw_expert_of. */
__device__ __forceinline__ int moe_expert_of(const int32_t *offsets, int E, int64_t g)
{
    return mw_expert_of(offsets, E, g);
}

/* The row tile of grouped rows [g0, g0 + BM): false when it holds no row of an expert (past
 * the last expert's rows, or all padding); else its expert's rows end at *end and *We is that
 * expert's [N, K] weight. */
__device__ __forceinline__ bool mg_row_tile(const bf16 *W, const int32_t *counts,
                                            const int32_t *offsets, int E, int64_t N, int64_t K,
                                            int64_t g0, int64_t *end, const bf16 **We)
{
    if (g0 >= offsets[E])
        return false;
    const int e = moe_expert_of(offsets, E, g0);
    *end = (int64_t)offsets[e] + counts[e];
    *We = W + (int64_t)e * N * K;
    return g0 < *end;
}

/* Output columns n and n + 1 of row cr (width Nc): one 4-byte store when pair (Nc even, C
 * 4-byte aligned), else the ones below Nc. */
__device__ __forceinline__ void mg_store2(bf16 *cr, int64_t n, int64_t Nc, float v0, float v1,
                                          bool pair)
{
    if (pair) {
        if (n < Nc) /* Nc even: n + 1 < Nc too */
            *(uint32_t *)(cr + n) = df_pack(v0, v1);
    } else {
        if (n < Nc)
            cr[n] = from_f32<bf16>(v0);
        if (n + 1 < Nc)
            cr[n + 1] = from_f32<bf16>(v1);
    }
}

/* silu(g) * u of act-rounded g and u, the way swiglu (kernels/ops.cu) computes it */
__device__ __forceinline__ float mg_swiglu(float g, float u)
{
    const float gv = to_f32(from_f32<bf16>(g)), uv = to_f32(from_f32<bf16>(u));
    return gv / (1.0f + expf(-gv)) * uv;
}

/* cp.async of one K step (columns k0 .. k0 + MG_BK) into the stage at st: this thread's chunks
 * of the A tile (ap: row starts, NULL for rows past the expert: zero) and of the W tile (wp). */
template <class CF>
__device__ __forceinline__ void mg_load(uint32_t st, const bf16 *const (&ap)[CF::AI],
                                        const bf16 *const (&wp)[CF::WI], const bf16 *any,
                                        int64_t k0)
{
#pragma unroll
    for (int i = 0; i < CF::AI; i++) {
        const int c = (int)threadIdx.x + i * CF::THREADS, r = c / CF::CH, ch = c % CF::CH;
        df_cp16(st + r * MG_ROWB + ch * 16, ap[i] ? ap[i] + k0 : any, ap[i] != nullptr);
    }
#pragma unroll
    for (int i = 0; i < CF::WI; i++) {
        const int c = (int)threadIdx.x + i * CF::THREADS, r = c / CF::CH, ch = c % CF::CH;
        df_cp16(st + CF::AB + r * MG_ROWB + ch * 16, wp[i] ? wp[i] + k0 : any, wp[i] != nullptr);
    }
}

/* Block (x, y): output columns from x BN (x BN / 2 with SWIGLU), grouped rows [y BM, +BM);
 * CF::THREADS threads, CF::SMEM bytes of dynamic shared memory. pair: the output width (N, or
 * N / 2 with SWIGLU) even and C 4-byte aligned (bf16 pairs stored as one word). */
template <class CF, bool GATHER, bool SWIGLU>
__global__ void __launch_bounds__(CF::THREADS)
    moe_mm_mma_kernel(const bf16 *__restrict__ A, const int32_t *__restrict__ rows,
                      const bf16 *__restrict__ W, bf16 *__restrict__ C, const int32_t *counts,
                      const int32_t *offsets, int E, int64_t N, int64_t K, bool pair)
{
    DF_DYN_SMEM(moe_smem);
    const int64_t g0 = (int64_t)blockIdx.y * CF::BM;
    int64_t end;
    const bf16 *We;
    if (!mg_row_tile(W, counts, offsets, E, N, K, g0, &end, &We))
        return;
    const int64_t Nc = SWIGLU ? N / 2 : N;                                /* output width */
    const int64_t c0 = (int64_t)blockIdx.x * (SWIGLU ? CF::BN / 2 : CF::BN); /* first output */
    const bf16 *ap[CF::AI], *wp[CF::WI];
#pragma unroll
    for (int i = 0; i < CF::AI; i++) {
        const int c = (int)threadIdx.x + i * CF::THREADS, r = c / CF::CH, ch = c % CF::CH;
        const int64_t g = g0 + r;
        ap[i] = g < end ? A + (GATHER ? (int64_t)rows[g] : g) * K + ch * 8 : nullptr;
    }
#pragma unroll
    for (int i = 0; i < CF::WI; i++) {
        const int c = (int)threadIdx.x + i * CF::THREADS, r = c / CF::CH, ch = c % CF::CH;
        int64_t n = c0 + r, lim = N;
        if (SWIGLU) {
            /* shared row r: warp column block r / TN; its first TN / 2 rows gate, then up */
            const int wb = r / CF::TN, w = r % CF::TN;
            const int64_t j = c0 + wb * (CF::TN / 2) + w % (CF::TN / 2);
            n = (w >= CF::TN / 2 ? Nc : 0) + j;
            lim = j < Nc ? N : -1;
        }
        wp[i] = n < lim ? We + n * K + ch * 8 : nullptr;
    }
    const uint32_t s0 = df_smem(moe_smem);
    const int lane = (int)threadIdx.x & 31, warp = (int)threadIdx.x >> 5;
    const int wm = (warp / CF::WN) * CF::TM, wn = (warp % CF::WN) * CF::TN;
    /* ldmatrix row addresses: A as 16 x 16 (rows 0-15, then the k 8-15 half); W as 16 (n) x 16
     * (k): n 0-7 k 0-7, n 0-7 k 8-15, n 8-15 k 0-7, n 8-15 k 8-15 (b0, b1 of two n8 tiles) */
    const uint32_t a_lane = (uint32_t)((wm + (lane & 15)) * MG_ROWB + (lane >> 4) * 16);
    const uint32_t b_lane = CF::AB + (uint32_t)((wn + (lane & 7) + ((lane >> 4) << 3)) * MG_ROWB +
                                                ((lane >> 3) & 1) * 16);
    float acc[CF::MI][CF::NJ][4];
#pragma unroll
    for (int i = 0; i < CF::MI; i++)
#pragma unroll
        for (int j = 0; j < CF::NJ; j++)
#pragma unroll
            for (int q = 0; q < 4; q++)
                acc[i][j][q] = 0.0f;
    const int nk = (int)(K / MG_BK);
#pragma unroll
    for (int s = 0; s < CF::ST - 1; s++) {
        if (s < nk)
            mg_load<CF>(s0 + s * CF::STB, ap, wp, W, (int64_t)s * MG_BK);
        df_commit();
    }
    for (int kt = 0; kt < nk; kt++) {
        df_wait<CF::ST - 2>(); /* step kt's group has landed (this thread's part) */
        __syncthreads();       /* everyone's part; and every warp is done with step kt - 1 */
        const int pf = kt + CF::ST - 1;
        if (pf < nk)
            mg_load<CF>(s0 + (uint32_t)(pf % CF::ST) * CF::STB, ap, wp, W, (int64_t)pf * MG_BK);
        df_commit(); /* possibly empty: keeps one group per step */
        const uint32_t st = s0 + (uint32_t)(kt % CF::ST) * CF::STB;
#pragma unroll
        for (int kk = 0; kk < MG_BK / 16; kk++) {
            uint32_t a[CF::MI][4];
#pragma unroll
            for (int i = 0; i < CF::MI; i++)
                df_ldm(a[i], st + a_lane + i * 16 * MG_ROWB + kk * 32);
#pragma unroll
            for (int np = 0; np < CF::NJ / 2; np++) {
                uint32_t b[4];
                df_ldm(b, st + b_lane + np * 16 * MG_ROWB + kk * 32);
#pragma unroll
                for (int i = 0; i < CF::MI; i++) {
                    df_mma(acc[i][2 * np], a[i], b[0], b[1]);
                    df_mma(acc[i][2 * np + 1], a[i], b[2], b[3]);
                }
            }
        }
    }
    /* fragment (i, j): rows wm + 16 i + lane / 4 (+8), columns wn + 8 j + 2 (lane % 4) (+1); with
     * SWIGLU fragment j < NJ / 2 is gate and j + NJ / 2 the up of the same outputs, output column
     * c0 + (wn / TN) (TN / 2) + 8 j + 2 (lane % 4) */
    constexpr int NO = SWIGLU ? CF::NJ / 2 : CF::NJ;
    const int64_t cw = c0 + (SWIGLU ? (wn / CF::TN) * (CF::TN / 2) : wn) + 2 * (lane & 3);
#pragma unroll
    for (int i = 0; i < CF::MI; i++)
#pragma unroll
        for (int h = 0; h < 2; h++) {
            const int64_t g = g0 + wm + 16 * i + (lane >> 2) + 8 * h;
            if (g >= end)
                continue;
            bf16 *cr = C + g * Nc;
#pragma unroll
            for (int j = 0; j < NO; j++) {
                const int64_t n = cw + 8 * j;
                float v0 = acc[i][j][2 * h], v1 = acc[i][j][2 * h + 1];
                if (SWIGLU) {
                    v0 = mg_swiglu(v0, acc[i][j + NO][2 * h]);
                    v1 = mg_swiglu(v1, acc[i][j + NO][2 * h + 1]);
                }
                mg_store2(cr, n, Nc, v0, v1, pair);
            }
        }
}

/* The tile shapes moe_matmul chooses from (DFL_CUDA_MOE_TILE), each BM a divisor of
 * DFL_MOE_PAD; shared memory 46,080, 81,920, 81,920, 92,160 and 122,880 bytes. */
typedef MgCfg<64, 128, 2, 2, 3> MgTile0;  /* 4 warps of 32 x 64, 3 stages */
typedef MgCfg<128, 128, 4, 2, 4> MgTile1; /* 8 warps of 32 x 64, 4 stages */
typedef MgCfg<128, 128, 2, 2, 4> MgTile2; /* 4 warps of 64 x 64, 4 stages */
typedef MgCfg<128, 256, 2, 4, 3> MgTile3; /* 8 warps of 64 x 64, 3 stages */
typedef MgCfg<128, 256, 2, 4, 4> MgTile4; /* 8 warps of 64 x 64, 4 stages */
#define MG_TILES 5

#endif
