/* moe_wgmma.cu: the grouped expert GEMM of the CUDA MoE path on Hopper's wgmma (sm_90a; the
 * Makefile compiles this file for sm_90a alone), the same contract as moe_gemm.cuh's mma.sync
 * kernel (C[g, :] = A[g, :] W_e^T for the grouped rows g of expert e, tiles of DFL_MOE_PAD-dividing
 * row counts, counts and offsets on the device, padding rows neither read nor written; the fused
 * forms: A's rows gathered through the route, silu(gate) * up in the epilogue with the same
 * roundings). A block of two warpgroups (256 threads) computes MW_BM = 128 grouped rows by BN
 * columns: warpgroup w the rows [64 w, 64 w + 64) by wgmma.mma_async m64nBNk16 (bf16 in, f32
 * accumulation), both operands from shared memory in the 128-byte swizzle of moe_wgmma.h
 * (written by cp.async, the swizzle computed by hand), MW_BK = 64 columns of K a stage, ST
 * stages: the loads of step k + ST - 2 are issued while step k's wgmma runs and step k - 1's may
 * still run (one wgmma group left in flight; its stage is refilled only after every thread has
 * waited for it, at the next barrier). With SWIGLU the block's BN weight rows are BN / 2 gate rows
 * then the BN / 2 matching up rows, so that accumulator fragment j (gate) and j + BN / 16 (up)
 * of a thread hold the same outputs. kernels/moe.cu takes it by default (DFL_CUDA_MOE_WGMMA=0
 * in the environment: the mma.sync kernel); DFL_CUDA_MOE_WTILE=0..MW_TILES-1 its tile shape.
 * Measured on the H200 (bench-ops --quick --moe, the Qwen3-30B-A3B block, 16384 tokens, 131072
 * routed rows; fused gate|up [x 1536 x 2048] / down [x 2048 x 768] in TFLOP/s): tile 0 532 / 396,
 * 1 431 / 309, 2 472 / 352, 3 440 / 334, 4 (warp-specialized) 469 / 343, 5 362 / 277; the plain
 * gate|up on tile 0 550 (cuBLAS on the dense GEMM of as many rows: 797). Tiles 6 and 7 are
 * tile 0's shape in a persistent kernel (moe_mm_wgmma_persist_kernel: one block an SM, the next
 * tile's loads issued during this tile's last steps and epilogue; tile 7 loads 3 steps ahead and
 * waits for each step's wgmma; the same products bit for bit), not yet run on a GPU. */
#include <stdlib.h>

#include "be_cuda.cuh"
#include "dflash_ptx.cuh"
#include "moe_gemm.cuh"
#include "moe_wgmma.h"
#include "moe_wgmma.cuh"

/* BN columns, ST stages; WS: warp-specialized (a third warpgroup loads, the two others only
 * multiply, stages handed over by mbarriers); PERSIST: one block an SM going through the tiles,
 * its loads running ahead across tile boundaries (moe_mm_wgmma_persist_kernel); LAG (the
 * persistent form): wgmma groups left in flight at the end of a step, 1 (loads ST - 2 steps
 * ahead) or 0 (each step's products waited for, loads ST - 1 steps ahead) */
template <int BN_, int ST_, bool WS_ = false, bool PERSIST_ = false, int LAG_ = 1> struct MwCfg {
    static constexpr int BN = BN_, ST = ST_, LAG = LAG_;
    static constexpr bool WS = WS_, PERSIST = PERSIST_;
    static constexpr int THREADS = WS ? MW_THREADS + 128 : MW_THREADS;
    static constexpr int LT = WS ? 128 : MW_THREADS;   /* loading threads */
    static constexpr int D = ST - 1 - LAG;             /* prefetch distance in stages */
    static constexpr int NR = BN / 2;                  /* f32 accumulators a thread */
    static constexpr int AI = MW_BM * 8 / LT;          /* 16-byte chunks a loading thread: A */
    static constexpr int WI = BN * 8 / LT;             /* and W */
    static constexpr uint32_t AB = MW_BM * MW_ROWB, STB = (MW_BM + BN) * MW_ROWB;
    static constexpr uint32_t BAR = ST * STB;          /* WS: full[ST], empty[ST] after the stages */
    static constexpr size_t SMEM = (size_t)BAR + (WS ? 16 * ST : 0) + 1024; /* + room to align */
    static_assert(BN == 128 || BN == 256, "wgmma n128 or n256");
    static_assert(ST >= 3, "one stage in flight, one read, one filled");
    static_assert(SMEM <= 227 * 1024, "shared memory of one block");
    static_assert(!(WS && PERSIST), "the persistent form is the plain one's");
    static_assert(LAG == 1 || (LAG == 0 && PERSIST), "LAG 0: the persistent form only");
};

/* the tile shapes (DFL_CUDA_MOE_WTILE) */
typedef MwCfg<256, 4> MwTile0;       /* 128 x 256, 4 stages: 197,632 bytes */
typedef MwCfg<128, 6> MwTile1;       /* 128 x 128, 6 stages: 197,632 bytes */
typedef MwCfg<128, 3> MwTile2;       /* 128 x 128, 3 stages: 99,328 bytes (two blocks an SM) */
typedef MwCfg<256, 3> MwTile3;       /* 128 x 256, 3 stages: 148,480 bytes */
typedef MwCfg<256, 4, true> MwTile4; /* 128 x 256, 4 stages, warp-specialized: 197,696 bytes */
typedef MwCfg<128, 6, true> MwTile5; /* 128 x 128, 6 stages, warp-specialized: 197,728 bytes */
typedef MwCfg<256, 4, false, true> MwTile6; /* tile 0's shape, persistent: + (2 E + 1) 4 bytes */
typedef MwCfg<256, 4, false, true, 0> MwTile7; /* the same, loads 3 steps ahead, no wgmma lag */
#define MW_TILES 8
#define MW_TAB_MAX (2 * 2048 + 1) /* the offsets and counts table of the persistent form, in
                                   * int32 (E <= 2048, moe.cu's MOE_MAX_E) */
static_assert(MwTile6::SMEM + 4 * MW_TAB_MAX <= 227 * 1024, "tile 6 and its table");
#define MW_TILE_DEFAULT 0 /* the fastest in every part measured (above) */

#if defined(__CUDA_ARCH_FEAT_SM90_ALL)
#define MW_ON 1
#endif

#ifdef MW_ON
#include "wgmma_ptx.cuh" /* wg_fence, wg_commit, wg_wait, wg_proxy_fence, wg_bar_* */
/* d (m64 x n128, f32) += A (descriptor da, m64 x k16) B (db, k16 x n128), both bf16 K-major in
 * shared memory */
__device__ __forceinline__ void mw_mma128(float (&d)[64], uint64_t da, uint64_t db)
{
    asm volatile("{\n.reg .pred p;\nsetp.ne.b32 p, %66, 0;\n"
                 "wgmma.mma_async.sync.aligned.m64n128k16.f32.bf16.bf16 {"
                 "%0, %1, %2, %3, %4, %5, %6, %7, %8, %9, %10, %11, "
                 "%12, %13, %14, %15, %16, %17, %18, %19, %20, %21, %22, %23, "
                 "%24, %25, %26, %27, %28, %29, %30, %31, %32, %33, %34, %35, "
                 "%36, %37, %38, %39, %40, %41, %42, %43, %44, %45, %46, %47, "
                 "%48, %49, %50, %51, %52, %53, %54, %55, %56, %57, %58, %59, "
                 "%60, %61, %62, %63"
                 "}, %64, %65, p, 1, 1, 0, 0;\n}\n"
                 : "+f"(d[0]), "+f"(d[1]), "+f"(d[2]), "+f"(d[3]), "+f"(d[4]), "+f"(d[5]),
                   "+f"(d[6]), "+f"(d[7]), "+f"(d[8]), "+f"(d[9]), "+f"(d[10]), "+f"(d[11]),
                   "+f"(d[12]), "+f"(d[13]), "+f"(d[14]), "+f"(d[15]), "+f"(d[16]), "+f"(d[17]),
                   "+f"(d[18]), "+f"(d[19]), "+f"(d[20]), "+f"(d[21]), "+f"(d[22]), "+f"(d[23]),
                   "+f"(d[24]), "+f"(d[25]), "+f"(d[26]), "+f"(d[27]), "+f"(d[28]), "+f"(d[29]),
                   "+f"(d[30]), "+f"(d[31]), "+f"(d[32]), "+f"(d[33]), "+f"(d[34]), "+f"(d[35]),
                   "+f"(d[36]), "+f"(d[37]), "+f"(d[38]), "+f"(d[39]), "+f"(d[40]), "+f"(d[41]),
                   "+f"(d[42]), "+f"(d[43]), "+f"(d[44]), "+f"(d[45]), "+f"(d[46]), "+f"(d[47]),
                   "+f"(d[48]), "+f"(d[49]), "+f"(d[50]), "+f"(d[51]), "+f"(d[52]), "+f"(d[53]),
                   "+f"(d[54]), "+f"(d[55]), "+f"(d[56]), "+f"(d[57]), "+f"(d[58]), "+f"(d[59]),
                   "+f"(d[60]), "+f"(d[61]), "+f"(d[62]), "+f"(d[63])
                 : "l"(da), "l"(db), "r"(1));
}

template <int BN> __device__ __forceinline__ void mw_mma(float (&d)[BN / 2], uint64_t da, uint64_t db);
template <> __device__ __forceinline__ void mw_mma<128>(float (&d)[64], uint64_t da, uint64_t db)
{
    mw_mma128(d, da, db);
}
template <> __device__ __forceinline__ void mw_mma<256>(float (&d)[128], uint64_t da, uint64_t db)
{
    wg_mma_ss_n256(d, da, db);
}

/* The row starts of loading thread lt_id's chunks: A rows (through rows with GATHER; NULL past
 * the expert's rows: zero) and W rows (with SWIGLU the BN / 2 gate rows from output c0, then the
 * matching up rows; NULL past the output width), each already at its 16-byte chunk. */
template <class CF, bool GATHER, bool SWIGLU>
__device__ __forceinline__ void mw_rows(const bf16 *(&ap)[CF::AI], const bf16 *(&wp)[CF::WI],
                                        uint32_t lt_id, const bf16 *A, const int32_t *rows,
                                        const bf16 *We, int64_t g0, int64_t end, int64_t c0,
                                        int64_t N, int64_t K)
{
    const int64_t Nc = SWIGLU ? N / 2 : N, ch = lt_id % 8;
#pragma unroll
    for (int i = 0; i < CF::AI; i++) {
        const int64_t g = g0 + mw_load_row(lt_id, i, CF::LT);
        ap[i] = g < end ? A + (GATHER ? (int64_t)rows[g] : g) * K + ch * 8 : nullptr;
    }
#pragma unroll
    for (int i = 0; i < CF::WI; i++) {
        const int r = (int)mw_load_row(lt_id, i, CF::LT);
        int64_t n = c0 + r, lim = N;
        if (SWIGLU) { /* rows [0, BN / 2): gate outputs c0 + r; then the up rows of the same */
            const int64_t j = c0 + r % (CF::BN / 2);
            n = (r >= CF::BN / 2 ? Nc : 0) + j;
            lim = j < Nc ? N : -1;
        }
        wp[i] = n < lim ? We + n * K + ch * 8 : nullptr;
    }
}

/* cp.async of one K step (columns k0 .. k0 + MW_BK) into the stage at st (off: this thread's
 * first chunk) of this thread's chunks of the A tile and of the W tile; NULL rows zero. */
template <class CF>
__device__ __forceinline__ void mw_load(uint32_t st, uint32_t off, const bf16 *const (&ap)[CF::AI],
                                        const bf16 *const (&wp)[CF::WI], const bf16 *any,
                                        int64_t k0)
{
    constexpr uint32_t step = CF::LT / 8 * MW_ROWB;
#pragma unroll
    for (int i = 0; i < CF::AI; i++)
        df_cp16(st + off + i * step, ap[i] ? ap[i] + k0 : any, ap[i] != nullptr);
#pragma unroll
    for (int i = 0; i < CF::WI; i++)
        df_cp16(st + CF::AB + off + i * step, wp[i] ? wp[i] + k0 : any, wp[i] != nullptr);
}

/* Warpgroup wg's products of the stage at st, as one wgmma group (committed, not waited). */
template <class CF>
__device__ __forceinline__ void mw_stage_mma(float (&acc)[CF::NR], uint32_t st, uint32_t wg)
{
    wg_hold_flat(acc);
    wg_fence();
#pragma unroll
    for (int kk = 0; kk < MW_BK / 16; kk++)
        mw_mma<CF::BN>(acc, mw_desc(st + wg * 64 * MW_ROWB + kk * 32),
                       mw_desc(st + CF::AB + kk * 32));
    wg_commit();
}

/* The epilogue of warpgroup wg (thread t of 128 in it): accumulator i holds row
 * 64 wg + 16 (t / 32) + (t % 32) / 4 (+8 when i % 4 >= 2), column 8 (i / 4) + 2 (t % 4) + i % 2;
 * with SWIGLU fragment j < BN / 16 is gate and j + BN / 16 the up of output column
 * c0 + 8 j + 2 (t % 4). */
template <class CF, bool SWIGLU>
__device__ __forceinline__ void mw_epilogue(const float (&acc)[CF::NR], uint32_t wg, uint32_t t,
                                            bf16 *C, int64_t g0, int64_t end, int64_t c0,
                                            int64_t Nc, bool pair)
{
    constexpr int NJ = CF::BN / 8, NO = SWIGLU ? NJ / 2 : NJ;
    const uint32_t lane = t & 31;
    const int64_t cw = c0 + 2 * (lane & 3);
#pragma unroll
    for (int h = 0; h < 2; h++) {
        const int64_t g = g0 + 64 * wg + 16 * (t / 32) + (lane >> 2) + 8 * h;
        if (g >= end)
            continue;
        bf16 *cr = C + g * Nc;
#pragma unroll
        for (int j = 0; j < NO; j++) {
            float v0 = acc[4 * j + 2 * h], v1 = acc[4 * j + 2 * h + 1];
            if (SWIGLU) {
                v0 = mg_swiglu(v0, acc[4 * (j + NO) + 2 * h]);
                v1 = mg_swiglu(v1, acc[4 * (j + NO) + 2 * h + 1]);
            }
            mg_store2(cr, cw + 8 * j, Nc, v0, v1, pair);
        }
    }
}
#endif

/* Block (x, y): output columns from x BN (x BN / 2 with SWIGLU), grouped rows [y MW_BM, +MW_BM);
 * CF::THREADS threads, CF::SMEM bytes of dynamic shared memory; pair as moe_mm_mma_kernel's.
 * Without CF::WS every thread loads (cp.async, ST - 2 stages ahead) and multiplies, a barrier
 * a step; with CF::WS warpgroup 0 loads (stage s's cp.async arrive on full[s]) and warpgroups
 * 1 and 2 multiply (each thread arrives on empty[s] once its wgmma of stage s is done). */
template <class CF, bool GATHER, bool SWIGLU>
__global__ void __launch_bounds__(CF::THREADS, 1)
    moe_mm_wgmma_kernel(const bf16 *__restrict__ A, const int32_t *__restrict__ rows,
                        const bf16 *__restrict__ W, bf16 *__restrict__ C, const int32_t *counts,
                        const int32_t *offsets, int E, int64_t N, int64_t K, bool pair)
{
#ifdef MW_ON
    DF_DYN_SMEM(moe_smem);
    const int64_t g0 = (int64_t)blockIdx.y * MW_BM;
    int64_t end;
    const bf16 *We;
    if (!mg_row_tile(W, counts, offsets, E, N, K, g0, &end, &We))
        return;
    const int64_t Nc = SWIGLU ? N / 2 : N;                               /* output width */
    const int64_t c0 = (int64_t)blockIdx.x * (SWIGLU ? CF::BN / 2 : CF::BN); /* first output */
    const uint32_t tid = threadIdx.x, s0 = (df_smem(moe_smem) + 1023u) & ~1023u;
    const int nk = (int)(K / MW_BK);
    const bf16 *ap[CF::AI], *wp[CF::WI];
    float acc[CF::NR];
    if (!CF::WS) {
        mw_rows<CF, GATHER, SWIGLU>(ap, wp, tid, A, rows, We, g0, end, c0, N, K);
        const uint32_t off = mw_load_off(tid, 0, CF::LT), wg = tid / 128;
#pragma unroll
        for (int i = 0; i < CF::NR; i++)
            acc[i] = 0.0f;
#pragma unroll
        for (int s = 0; s < CF::D; s++) {
            if (s < nk)
                mw_load<CF>(s0 + s * CF::STB, off, ap, wp, W, (int64_t)s * MW_BK);
            df_commit();
        }
        for (int kt = 0; kt < nk; kt++) {
            df_wait<CF::D - 1>(); /* step kt's group has landed (this thread's part) */
            wg_proxy_fence();
            __syncthreads(); /* everyone's part; every warpgroup is done with step kt - 2 */
            const int pf = kt + CF::D;
            if (pf < nk)
                mw_load<CF>(s0 + (uint32_t)(pf % CF::ST) * CF::STB, off, ap, wp, W,
                            (int64_t)pf * MW_BK);
            df_commit(); /* possibly empty: keeps one group per step */
            mw_stage_mma<CF>(acc, s0 + (uint32_t)(kt % CF::ST) * CF::STB, wg);
            wg_wait<1>(); /* step kt - 1 done (this warpgroup) */
            wg_hold_flat(acc);
        }
        wg_wait<0>();
        wg_hold_flat(acc);
        mw_epilogue<CF, SWIGLU>(acc, wg, tid % 128, C, g0, end, c0, Nc, pair);
        return;
    }
    const uint32_t full = s0 + CF::BAR, empty = full + 8 * CF::ST;
    if (tid == 0)
        for (int s = 0; s < CF::ST; s++) {
            wg_bar_init(full + 8 * s, CF::LT);       /* every loading thread's cp.async */
            wg_bar_init(empty + 8 * s, MW_THREADS);  /* every multiplying thread */
        }
    __syncthreads();
    if (tid < CF::LT) { /* the loads: stage kt into slot kt % ST once its last reads are done */
        mw_rows<CF, GATHER, SWIGLU>(ap, wp, tid, A, rows, We, g0, end, c0, N, K);
        const uint32_t off = mw_load_off(tid, 0, CF::LT);
        for (int kt = 0; kt < nk; kt++) {
            const uint32_t slot = (uint32_t)(kt % CF::ST), round = (uint32_t)(kt / CF::ST);
            wg_bar_wait(empty + 8 * slot, (round & 1) ^ 1); /* round 0: passes at once */
            mw_load<CF>(s0 + slot * CF::STB, off, ap, wp, W, (int64_t)kt * MW_BK);
            wg_bar_arrive_cp(full + 8 * slot);
        }
        df_wait<0>();
        return;
    }
    const uint32_t wg = tid / 128 - 1;
#pragma unroll
    for (int i = 0; i < CF::NR; i++)
        acc[i] = 0.0f;
    for (int kt = 0; kt < nk; kt++) {
        const uint32_t slot = (uint32_t)(kt % CF::ST);
        wg_bar_wait(full + 8 * slot, (uint32_t)(kt / CF::ST) & 1);
        wg_proxy_fence();
        mw_stage_mma<CF>(acc, s0 + slot * CF::STB, wg);
        wg_wait<1>(); /* step kt - 1 done: its slot goes back to the loads */
        wg_hold_flat(acc);
        if (kt > 0)
            wg_bar_arrive(empty + 8 * (uint32_t)((kt - 1) % CF::ST));
    }
    wg_wait<0>();
    wg_hold_flat(acc);
    mw_epilogue<CF, SWIGLU>(acc, wg, tid % 128, C, g0, end, c0, Nc, pair);
#else
    __trap(); /* built without sm_90a: cuda_moe_wgmma never launches it */
#endif
}

/* The persistent form of moe_mm_wgmma_kernel's plain path (CF::PERSIST): nt = ntc row-tile
 * count tiles, tile t being row tile t / ntc and column tile t % ntc (the plain form's launch
 * order: the column tiles of a row tile together); block b takes tiles b, b + gridDim.x, ...
 * that hold a row of an expert. Every tile's products are the plain form's, step for step (the
 * same stage layout, wgmma groups and epilogue: the same results bit for bit); what changes is
 * that the cp.async of the next tile's first D steps are issued during this tile's last steps,
 * so that they land while its last products and its epilogue run, and that one block an SM
 * stays resident (no block launch, no prologue wait a tile). offsets and counts are read once
 * into shared memory after the stages (the expert of a tile is a binary search there). */
template <class CF, bool SWIGLU>
__device__ __forceinline__ int64_t mw_seek(int64_t t, int64_t nt, int64_t ntc, const int32_t *scnt,
                                           const int32_t *soff, int E, const bf16 *W, int64_t N,
                                           int64_t K, int64_t *g0, int64_t *end, int64_t *c0,
                                           const bf16 **We)
{
    int e = 0;
    t = mw_next_tile(t, gridDim.x, nt, ntc, scnt, soff, E, g0, end, &e);
    *c0 = t % ntc * (SWIGLU ? CF::BN / 2 : CF::BN);
    *We = W + (int64_t)e * N * K;
    return t;
}

template <class CF, bool GATHER, bool SWIGLU>
__global__ void __launch_bounds__(CF::THREADS, 1)
    moe_mm_wgmma_persist_kernel(const bf16 *__restrict__ A, const int32_t *__restrict__ rows,
                                const bf16 *__restrict__ W, bf16 *__restrict__ C,
                                const int32_t *counts, const int32_t *offsets, int E, int64_t N,
                                int64_t K, bool pair, int64_t ntc, int64_t nt)
{
#ifdef MW_ON
    static_assert(CF::PERSIST && !CF::WS, "the persistent plain form");
    DF_DYN_SMEM(moe_smem);
    const uint32_t tid = threadIdx.x, base = df_smem(moe_smem), s0 = (base + 1023u) & ~1023u;
    int32_t *soff = (int32_t *)(moe_smem + (s0 - base) + CF::BAR), *scnt = soff + E + 1;
    for (int i = (int)tid; i <= E; i += CF::THREADS)
        soff[i] = offsets[i];
    for (int i = (int)tid; i < E; i += CF::THREADS)
        scnt[i] = counts[i];
    __syncthreads();
    const int64_t Nc = SWIGLU ? N / 2 : N;
    const int nk = (int)(K / MW_BK);
    /* the tile being multiplied (ct) and the one being loaded (lt, at step lk) */
    int64_t g0, end, c0, lg0, lend, lc0;
    const bf16 *We, *lWe;
    int64_t ct = mw_seek<CF, SWIGLU>(blockIdx.x, nt, ntc, scnt, soff, E, W, N, K, &g0, &end, &c0,
                                     &We);
    int64_t lt = ct;
    int lk = 0;
    lg0 = g0, lend = end, lc0 = c0, lWe = We;
    const bf16 *ap[CF::AI], *wp[CF::WI];
    if (lt < nt)
        mw_rows<CF, GATHER, SWIGLU>(ap, wp, tid, A, rows, lWe, lg0, lend, lc0, N, K);
    const uint32_t off = mw_load_off(tid, 0, CF::LT), wg = tid / 128;
    /* the load of the next step in the block's sequence, then the cursor moved on */
    auto load_next = [&](uint32_t slot) {
        if (lt >= nt)
            return;
        mw_load<CF>(s0 + slot * CF::STB, off, ap, wp, W, (int64_t)lk * MW_BK);
        if (++lk == nk) {
            lk = 0;
            lt = mw_seek<CF, SWIGLU>(lt + gridDim.x, nt, ntc, scnt, soff, E, W, N, K, &lg0, &lend,
                                     &lc0, &lWe);
            if (lt < nt)
                mw_rows<CF, GATHER, SWIGLU>(ap, wp, tid, A, rows, lWe, lg0, lend, lc0, N, K);
        }
    };
#pragma unroll
    for (int s = 0; s < CF::D; s++) {
        load_next((uint32_t)s);
        df_commit();
    }
    uint32_t gs = 0; /* the block's step: its stage slot is gs % ST */
    float acc[CF::NR];
    while (ct < nt) {
#pragma unroll
        for (int i = 0; i < CF::NR; i++)
            acc[i] = 0.0f;
        for (int kt = 0; kt < nk; kt++, gs++) {
            df_wait<CF::D - 1>(); /* step gs's group has landed (this thread's part) */
            wg_proxy_fence();
            __syncthreads(); /* everyone's part; every warpgroup is done with step gs - 1 - LAG,
                              * whose slot is (gs + D) % ST */
            mw_stage_mma<CF>(acc, s0 + (gs % CF::ST) * CF::STB, wg);
            /* the loads after the products are issued, so that the row lookups of a next tile
             * (GATHER: rows[g] read before its cp.async) wait under the running wgmma */
            load_next((gs + CF::D) % CF::ST); /* the last D steps load the next tile's first */
            df_commit(); /* possibly empty: keeps one group per step */
            wg_wait<CF::LAG>(); /* step gs - LAG done (this warpgroup) */
            wg_hold_flat(acc);
        }
        wg_wait<0>();
        wg_hold_flat(acc);
        mw_epilogue<CF, SWIGLU>(acc, wg, tid % 128, C, g0, end, c0, Nc, pair);
        ct = mw_seek<CF, SWIGLU>(ct + gridDim.x, nt, ntc, scnt, soff, E, W, N, K, &g0, &end, &c0,
                                 &We);
    }
    df_wait<0>();
#else
    __trap(); /* built without sm_90a: cuda_moe_wgmma never launches it */
#endif
}

/* the multiprocessors of the current device (0 when it cannot say) */
static int mw_sms(void)
{
    static int sms[64];
    int d = 0;
    if (cudaGetDevice(&d) != cudaSuccess || d < 0 || d >= 64)
        return 0;
    if (!sms[d] && cudaDeviceGetAttribute(&sms[d], cudaDevAttrMultiProcessorCount, d) != cudaSuccess)
        sms[d] = 0;
    return sms[d];
}

template <class CF, bool G, bool S>
static cudaError_t mw_launch_persist(const dfl_moe_mm *m, cudaStream_t s)
{
    auto fn = moe_mm_wgmma_persist_kernel<CF, G, S>;
    const size_t smem = CF::SMEM + 4 * (size_t)(2 * m->E + 1);
    cudaError_t err = cuda_allow_smem(fn, smem);
    if (err != cudaSuccess)
        return err;
    const int64_t Nc = S ? m->N / 2 : m->N, bn = S ? CF::BN / 2 : CF::BN;
    const int64_t ntc = (Nc + bn - 1) / bn, nt = ntc * (m->cap / MW_BM);
    const int sms = mw_sms();
    const int64_t blocks = sms > 0 && sms < nt ? sms : nt;
    const bool pair = Nc % 2 == 0 && is_aligned(m->C, 4);
    fn<<<(unsigned)blocks, CF::THREADS, smem, s>>>((const bf16 *)m->A, m->rows,
                                                   (const bf16 *)m->W, (bf16 *)m->C, m->counts,
                                                   m->offsets, m->E, m->N, m->K, pair, ntc, nt);
    return cudaSuccess; /* a launch error: the caller's cuda_launch_check */
}

template <class CF, bool G, bool S>
static cudaError_t mw_launch(const dfl_moe_mm *m, cudaStream_t s)
{
    auto fn = moe_mm_wgmma_kernel<CF, G, S>;
    cudaError_t err = cuda_allow_smem(fn, CF::SMEM);
    if (err != cudaSuccess)
        return err;
    const int64_t Nc = S ? m->N / 2 : m->N, bn = S ? CF::BN / 2 : CF::BN;
    const dim3 grid((unsigned)((Nc + bn - 1) / bn), (unsigned)(m->cap / MW_BM));
    const bool pair = Nc % 2 == 0 && is_aligned(m->C, 4);
    fn<<<grid, CF::THREADS, CF::SMEM, s>>>((const bf16 *)m->A, m->rows, (const bf16 *)m->W,
                                          (bf16 *)m->C, m->counts, m->offsets, m->E, m->N, m->K,
                                          pair);
    return cudaSuccess; /* a launch error: the caller's cuda_launch_check */
}

template <class CF> static cudaError_t mw_tile(const dfl_moe_mm *m, cudaStream_t s)
{
    if constexpr (CF::PERSIST) {
        if (2 * (int64_t)m->E + 1 > MW_TAB_MAX) /* the table does not fit: the plain form */
            return mw_tile<MwCfg<CF::BN, CF::ST>>(m, s);
        if (m->rows)
            return m->swiglu ? mw_launch_persist<CF, true, true>(m, s)
                             : mw_launch_persist<CF, true, false>(m, s);
        return m->swiglu ? mw_launch_persist<CF, false, true>(m, s)
                         : mw_launch_persist<CF, false, false>(m, s);
    } else {
        if (m->rows)
            return m->swiglu ? mw_launch<CF, true, true>(m, s) : mw_launch<CF, true, false>(m, s);
        return m->swiglu ? mw_launch<CF, false, true>(m, s) : mw_launch<CF, false, false>(m, s);
    }
}

bool cuda_moe_wgmma_fits(const dfl_moe_mm *m, int device)
{
    static int major[64]; /* the device's compute capability, 0 until asked */
    if (device < 0 || device >= 64)
        return false;
    if (!major[device] &&
        cudaDeviceGetAttribute(&major[device], cudaDevAttrComputeCapabilityMajor, device) !=
            cudaSuccess)
        return false;
    return major[device] == 9 && m->K % MW_BK == 0 && m->cap % MW_BM == 0 &&
           m->cap / MW_BM <= 65535 && is_aligned(m->A, 16) && is_aligned(m->W, 16);
}

cudaError_t cuda_moe_wgmma(const dfl_moe_mm *m, cudaStream_t s)
{
    const char *v = getenv("DFL_CUDA_MOE_WTILE");
    const int t = v && v[0] >= '0' && v[0] < '0' + MW_TILES && !v[1] ? v[0] - '0' : MW_TILE_DEFAULT;
    switch (t) {
    case 0: return mw_tile<MwTile0>(m, s);
    case 1: return mw_tile<MwTile1>(m, s);
    case 2: return mw_tile<MwTile2>(m, s);
    case 3: return mw_tile<MwTile3>(m, s);
    case 4: return mw_tile<MwTile4>(m, s);
    case 5: return mw_tile<MwTile5>(m, s);
    case 6: return mw_tile<MwTile6>(m, s);
    default: return mw_tile<MwTile7>(m, s);
    }
}
