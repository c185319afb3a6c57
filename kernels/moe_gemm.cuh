/* moe_gemm.cuh: the bf16 grouped expert GEMM of the CUDA MoE path (kernels/moe.cu's
 * moe_matmul), C[g, :] = A[g, :] W_e^T for the grouped rows g of expert e, on mma.sync
 * m16n8k16 (bf16 in, f32 accumulation). A block computes a tile of MG_BM = 64 grouped rows
 * (DFL_MOE_PAD: a tile never spans two experts) by MG_BN = 128 columns with 4 warps, each a
 * 32 x 64 quarter as 2 x 8 fragments; A and W_e come through shared memory MG_BK = 32 columns of
 * K at a time, in MG_ST = 3 stages filled by cp.async (the loads of step k + 2 overlap the
 * tensor-core work of step k), rows padded to 80 bytes so that ldmatrix reads are free of bank
 * conflicts. Grid: x the column tiles, y the row tiles, so that the column tiles of one row tile
 * run together (A read once from memory) and the row tiles of one expert follow each other (W_e
 * stays in L2). Conditions: K % MG_BK == 0, A and W 16-byte aligned; rows past the expert's
 * count (padding) are neither read nor written. Device code only; needs from the including file
 * bf16, from_f32 (be_cuda.cuh) and the PTX helpers (dflash_ptx.cuh); tests/emu/emu-moe.cc
 * compiles the same code for the CPU with the emulator's versions of those. */
#ifndef DFL_MOE_GEMM_CUH
#define DFL_MOE_GEMM_CUH

#define MG_BM 64
#define MG_BN 128
#define MG_BK 32
#define MG_ST 3
#define MG_ROWB (MG_BK * 2 + 16) /* bytes of a shared row: 80 */
#define MG_THREADS 128
#define MG_SMEM ((size_t)MG_ST * (MG_BM + MG_BN) * MG_ROWB) /* 46,080 bytes: no opt-in needed */

/* The expert of grouped row g (below offsets[E]): the last e with offsets[e] <= g (empty experts
 * share their offset with the next one). */
__device__ __forceinline__ int moe_expert_of(const int32_t *offsets, int E, int64_t g)
{
    int lo = 0, hi = E - 1;
    while (lo < hi) {
        int mid = (lo + hi + 1) / 2;
        if (offsets[mid] <= g)
            lo = mid;
        else
            hi = mid - 1;
    }
    return lo;
}

/* cp.async of one K step (columns k0 .. k0 + MG_BK) of the A tile (rows g0.., zero from end) to
 * sa and of the W_e tile (rows n0.., zero from N) to sw: 16-byte chunks, 4 a row. */
__device__ __forceinline__ void mg_load(uint32_t sa, uint32_t sw, const bf16 *A, const bf16 *We,
                                        int64_t g0, int64_t end, int64_t n0, int64_t N, int64_t K,
                                        int64_t k0)
{
    constexpr int CH = MG_BK / 8;
#pragma unroll
    for (int i = 0; i < MG_BM * CH / MG_THREADS; i++) {
        const int c = (int)threadIdx.x + i * MG_THREADS, r = c / CH, ch = c % CH;
        const bool ok = g0 + r < end;
        df_cp16(sa + r * MG_ROWB + ch * 16, ok ? A + (g0 + r) * K + k0 + ch * 8 : A, ok);
    }
#pragma unroll
    for (int i = 0; i < MG_BN * CH / MG_THREADS; i++) {
        const int c = (int)threadIdx.x + i * MG_THREADS, r = c / CH, ch = c % CH;
        const bool ok = n0 + r < N;
        df_cp16(sw + r * MG_ROWB + ch * 16, ok ? We + (n0 + r) * K + k0 + ch * 8 : We, ok);
    }
}

/* Block (x, y): columns [x MG_BN, +MG_BN), grouped rows [y MG_BM, +MG_BM); MG_THREADS threads,
 * MG_SMEM bytes of dynamic shared memory. pair: N even and C 4-byte aligned (bf16 pairs stored
 * as one word). */
__global__ void __launch_bounds__(MG_THREADS)
    moe_mm_mma_kernel(const bf16 *__restrict__ A, const bf16 *__restrict__ W, bf16 *__restrict__ C,
                      const int32_t *counts, const int32_t *offsets, int E, int64_t N, int64_t K,
                      bool pair)
{
    DF_DYN_SMEM(moe_smem);
    const int64_t g0 = (int64_t)blockIdx.y * MG_BM, n0 = (int64_t)blockIdx.x * MG_BN;
    if (g0 >= offsets[E])
        return;
    const int e = moe_expert_of(offsets, E, g0);
    const int64_t end = (int64_t)offsets[e] + counts[e];
    if (g0 >= end)
        return;
    const bf16 *We = W + (int64_t)e * N * K;
    constexpr uint32_t AB = MG_BM * MG_ROWB, STB = (MG_BM + MG_BN) * MG_ROWB;
    const uint32_t s0 = df_smem(moe_smem);
    const int lane = (int)threadIdx.x & 31, warp = (int)threadIdx.x >> 5;
    const int wm = (warp >> 1) * 32, wn = (warp & 1) * 64;
    /* ldmatrix row addresses: A as 16 x 16 (rows 0-15, then the k 8-15 half); W as 16 (n) x 16
     * (k): n 0-7 k 0-7, n 0-7 k 8-15, n 8-15 k 0-7, n 8-15 k 8-15 (b0, b1 of two n8 tiles) */
    const uint32_t a_lane = (uint32_t)((wm + (lane & 15)) * MG_ROWB + (lane >> 4) * 16);
    const uint32_t b_lane =
        AB + (uint32_t)((wn + (lane & 7) + ((lane >> 4) << 3)) * MG_ROWB + ((lane >> 3) & 1) * 16);
    float acc[2][8][4];
#pragma unroll
    for (int i = 0; i < 2; i++)
#pragma unroll
        for (int j = 0; j < 8; j++)
#pragma unroll
            for (int q = 0; q < 4; q++)
                acc[i][j][q] = 0.0f;
    const int nk = (int)(K / MG_BK);
#pragma unroll
    for (int s = 0; s < MG_ST - 1; s++) {
        if (s < nk)
            mg_load(s0 + s * STB, s0 + s * STB + AB, A, We, g0, end, n0, N, K, (int64_t)s * MG_BK);
        df_commit();
    }
    for (int kt = 0; kt < nk; kt++) {
        df_wait<MG_ST - 2>(); /* step kt's group has landed (this thread's part) */
        __syncthreads();      /* everyone's part; and every warp is done with step kt - 1 */
        const int pf = kt + MG_ST - 1;
        if (pf < nk) {
            const uint32_t sp = s0 + (uint32_t)(pf % MG_ST) * STB;
            mg_load(sp, sp + AB, A, We, g0, end, n0, N, K, (int64_t)pf * MG_BK);
        }
        df_commit(); /* possibly empty: keeps one group per step */
        const uint32_t st = s0 + (uint32_t)(kt % MG_ST) * STB;
#pragma unroll
        for (int kk = 0; kk < MG_BK / 16; kk++) {
            uint32_t a[2][4];
#pragma unroll
            for (int i = 0; i < 2; i++)
                df_ldm(a[i], st + a_lane + i * 16 * MG_ROWB + kk * 32);
#pragma unroll
            for (int np = 0; np < 4; np++) {
                uint32_t b[4];
                df_ldm(b, st + b_lane + np * 16 * MG_ROWB + kk * 32);
#pragma unroll
                for (int i = 0; i < 2; i++) {
                    df_mma(acc[i][2 * np], a[i], b[0], b[1]);
                    df_mma(acc[i][2 * np + 1], a[i], b[2], b[3]);
                }
            }
        }
    }
    /* fragment (i, j): rows wm + 16 i + lane / 4 (+8), columns wn + 8 j + 2 (lane % 4) (+1) */
#pragma unroll
    for (int i = 0; i < 2; i++)
#pragma unroll
        for (int h = 0; h < 2; h++) {
            const int64_t g = g0 + wm + 16 * i + (lane >> 2) + 8 * h;
            if (g >= end)
                continue;
            bf16 *cr = C + g * N;
#pragma unroll
            for (int j = 0; j < 8; j++) {
                const int64_t n = n0 + wn + 8 * j + 2 * (lane & 3);
                const float v0 = acc[i][j][2 * h], v1 = acc[i][j][2 * h + 1];
                if (pair) {
                    if (n < N) /* N even: n + 1 < N too */
                        *(uint32_t *)(cr + n) = df_pack(v0, v1);
                } else {
                    if (n < N)
                        cr[n] = from_f32<bf16>(v0);
                    if (n + 1 < N)
                        cr[n + 1] = from_f32<bf16>(v1);
                }
            }
        }
}

#endif
