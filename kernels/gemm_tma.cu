/* gemm_tma.cu: a dense bf16 GEMM of our own on Hopper (sm_90a; the Makefile compiles this file
 * for sm_90a alone), C = A W^T with A [M, K] and W [N, K] both K-major (a linear layer's
 * product), f32 accumulation, and three epilogues:
 *   STORE   C = P, rounded to bf16 once;
 *   ACC     C = P + Cin (Cin may be C: the residual add), the sum in f32 rounded once (what
 *           cuBLAS gives with beta 1);
 *   SWIGLU  W holds the gate rows [0, I) then the up rows [I, 2I) (N = 2I): C [M, I] =
 *           silu(g) * u of the products g and u, each rounded to bf16 first, as swiglu
 *           (kernels/ops.cu) computes it after a bf16 gate|up product: the MLP's gate|up
 *           projection and its activation without the [M, 2I] intermediate.
 *
 * Why: cuBLAS has no SwiGLU epilogue, and in the target's forward the activation between the
 * gate|up and down products is a separate pass over 3 bytes of memory per output element
 * (about 3% of Qwen3-8B's forward on the H200).
 *
 * How: a persistent kernel, one block of three warpgroups an SM. Warpgroup 0 loads: one thread
 * issues the Tensor Memory Accelerator's copies (cp.async.bulk.tensor) of each K step's A tile
 * (GT_BM = 128 rows of 64 bf16) and W tile (GT_BN = 256 rows; SWIGLU: the tile's 128 gate rows
 * then the 128 matching up rows) into a ring of 4 stages, in the 128-byte swizzle that both
 * the copy (CU_TENSOR_MAP_SWIZZLE_128B) and wgmma's descriptors (gemm_tma.h) name, and each
 * stage's "full" mbarrier counts its bytes in. Warpgroups 1 and 2 multiply, rows [0, 64) and
 * [64, 128) of the tile by wgmma m64n256k16 (128 f32 accumulators a thread), one wgmma group in
 * flight: once step k's group is issued, step k - 1's is waited for and its stage handed back
 * on the stage's "empty" mbarrier (one arrival a warp). The loading thread runs up to 4
 * steps ahead, across tile boundaries, so the next tile's first stages load during this tile's
 * epilogue. Tiles go in groups of GT_GM row tiles, the row tile fastest, so that the blocks at
 * work at one time share their W tiles in L2. Rows past M are read as zeros (the copy fills
 * them) and never written.
 *
 * Measured on the H200 (2026-12-03; build/tests/bench-ceiling --quick --own 2 --shapes ..., the
 * Qwen3-8B forward's products of 16,384 rows): its results equal cuBLAS's bit for bit for STORE
 * and SWIGLU (K 4096; ACC differs by a rounding in a quarter of the values). It is slower than
 * cuBLAS: gate|up [24576 x 4096] 627 TFLOP/s in bursts against 711-741, back to back at the
 * power cap 623 against 677 (0.92x); with SWIGLU 0.97x cuBLAS + swiglu at the cap (0.91-0.95x
 * in bursts); qkv, o and down 0.80-0.90x at the cap. Its rate is the same at ncu's 1.35 GHz as
 * in bursts at full clock (where ncu puts the tensor pipe at 86% of its peak): what holds it back
 * at full clock does not scale with the SM clock (the loads in flight, with 4 stages of 48 KB, or
 * L2). Clusters of two sharing W by multicast (DFL_CUDA_GEMM_CLUSTER=2) were slower still
 * (0.73-0.80x), and so were stages of 32 columns (DFL_CUDA_GEMM_BK=32: 8 stages, 168 KB
 * loading instead of 144; SwiGLU 0.90x at the cap against 0.98x with 64 in the same call, the
 * plain product 0.77x): not the bytes in flight then. So it is not the default: DFL_CUDA_GEMM_TMA=1 puts the target MLP's gate|up
 * product and SwiGLU on it (dfl-target at 8B: 44,392 tokens/s against 44,778 with cuBLAS, the
 * SwiGLU pass's 0.105 s of 3.64 s saved and 0.157 s lost in the product), 2 every product it
 * takes (42,341). */
#include <cuda.h>
#include <cudaTypedefs.h>
#include <stdlib.h>
#include <string.h>

#include "be_cuda.cuh"
#include "cuda.h"
#include "gemm_tma.h"

static_assert(GT_SMEM <= 227 * 1024, "shared memory of one block");

#if defined(__CUDA_ARCH_FEAT_SM90_ALL)
#define GT_ON 1
#endif

#ifdef GT_ON
#include "wgmma_ptx.cuh"

/* the ring of stages: the next stage, and its phase flipped on each turn */
__device__ __forceinline__ void gt_next(int &s, uint32_t &ph, int stages)
{
    if (++s == stages) {
        s = 0;
        ph ^= 1;
    }
}

/* the stage's full barrier expects `bytes` more from the copies, and the loading thread arrives */
__device__ __forceinline__ void gt_expect(uint32_t bar, uint32_t bytes)
{
    asm volatile("mbarrier.arrive.expect_tx.shared::cta.b64 _, [%0], %1;\n" ::"r"(bar), "r"(bytes)
                 : "memory");
}

/* the tensor copy of the box at (x: column, y: row) of map into shared dst, counted on bar */
__device__ __forceinline__ void gt_load(uint32_t dst, const CUtensorMap *map, int x, int y,
                                        uint32_t bar)
{
    asm volatile("cp.async.bulk.tensor.2d.shared::cluster.global.mbarrier::complete_tx::bytes"
                 " [%0], [%1, {%2, %3}], [%4];\n" ::"r"(dst),
                 "l"((uint64_t)map), "r"(x), "r"(y), "r"(bar)
                 : "memory");
}

__device__ __forceinline__ float gt_silu_mul(float g, float u)
{
    const float gv = to_f32(from_f32<bf16>(g)), uv = to_f32(from_f32<bf16>(u));
    return gv / (1.0f + expf(-gv)) * uv;
}

__device__ __forceinline__ uint32_t gt_rank(void)
{
    uint32_t r;
    asm volatile("mov.u32 %0, %%cluster_ctarank;\n" : "=r"(r));
    return r;
}

/* every thread of the cluster that has not exited (release, then acquire) */
__device__ __forceinline__ void gt_cluster_sync(void)
{
    asm volatile("barrier.cluster.arrive.release.aligned;\nbarrier.cluster.wait.acquire.aligned;\n" ::: "memory");
}

/* the tensor copy of the box at (x, y) of map into shared dst of every CTA of the cluster in
 * mask, counted on each one's barrier at bar (the same offsets in each) */
__device__ __forceinline__ void gt_load_mc(uint32_t dst, const CUtensorMap *map, int x, int y,
                                           uint32_t bar, uint16_t mask)
{
    asm volatile("cp.async.bulk.tensor.2d.shared::cluster.global.mbarrier::complete_tx::bytes"
                 ".multicast::cluster [%0], [%1, {%2, %3}], [%4], %5;\n" ::"r"(dst),
                 "l"((uint64_t)map), "r"(x), "r"(y), "r"(bar), "h"(mask)
                 : "memory");
}

/* one arrival on the barrier at bar in CTA rank of the cluster */
__device__ __forceinline__ void gt_arrive_remote(uint32_t bar, uint32_t rank)
{
    asm volatile("{\n.reg .b32 ra;\nmapa.shared::cluster.u32 ra, %0, %1;\n"
                 "mbarrier.arrive.release.cluster.shared::cluster.b64 _, [ra];\n}\n" ::"r"(bar),
                 "r"(rank)
                 : "memory");
}
#endif

/* MODE 0 STORE, 1 ACC, 2 SWIGLU (above); C [M, Nc] with ldc, Nc = N (SWIGLU: N / 2); Cin: ACC's
 * addend (ldc too); mt row tiles and nt column tiles of Nc (GT_BN columns each, SWIGLU GT_BN / 2).
 * CL 2: clusters of two blocks on row tiles 2 p and 2 p + 1 of the same column tile, each block
 * loading half of the W tile for both (multicast): a stage is refilled once the multiplying warps
 * of both blocks have handed it back (its empty barrier counts 16 warps), and neither block
 * leaves before the other is done with its barriers. The tiles then go by pairs (p, tn). */
template <int MODE, int CL, int BK>
__global__ void __launch_bounds__(GT_THREADS, 1)
gemm_tma_kernel(const __grid_constant__ CUtensorMap ta, const __grid_constant__ CUtensorMap tw,
                bf16 *C, const bf16 *Cin, int64_t ldc, int M, int K, int half, int mt, int nt)
{
#ifdef GT_ON
    extern __shared__ uint8_t gt_smem[];
    const uint32_t raw = (uint32_t)__cvta_generic_to_shared(gt_smem);
    const uint32_t base = (raw + 1023u) & ~1023u;
    constexpr int ST = gt_stages(BK);
    constexpr uint32_t AB = gt_ab(BK), STB = gt_stb(BK), ROWB = BK * 2;
    static_assert(BK == 64 || BK == 32, "stages of 64 or 32 columns");
    const uint32_t full = base + ST * STB, empty = full + 8 * ST;
    const int tid = threadIdx.x, wg = tid / 128, KT = K / BK;
    const uint32_t rank = CL == 2 ? gt_rank() : 0;
    const int mp = (mt + CL - 1) / CL, units = mp * nt, gm = GT_GM / CL;
    const int first = blockIdx.x / CL, stride = gridDim.x / CL;
    if (tid == 0) {
        for (int s = 0; s < ST; s++) {
            wg_bar_init(full + 8 * s, 1);        /* the loading thread's arrival, + the bytes */
            wg_bar_init(empty + 8 * s, 8 * CL);  /* one arrival of each multiplying warp */
        }
        asm volatile("fence.mbarrier_init.release.cluster;\n" ::: "memory");
        asm volatile("prefetch.tensormap [%0];\n" ::"l"((uint64_t)&ta) : "memory");
        asm volatile("prefetch.tensormap [%0];\n" ::"l"((uint64_t)&tw) : "memory");
    }
    if (CL == 2)
        gt_cluster_sync(); /* the peer's barriers are ready before any copy or arrival reaches them */
    else
        __syncthreads();
    if (wg == 0) {
        wg_regs_dec<40>();
        if (tid == 0) {
            int s = 0;
            uint32_t ph = 0;
            for (int u = first; u < units; u += stride) {
                int pm, tn;
                gt_tile(u, mp, nt, gm, &pm, &tn);
                const int tm = pm * CL + (int)rank;
                for (int kb = 0; kb < KT; kb++) {
                    wg_bar_wait(empty + 8 * s, ph ^ 1);
                    const uint32_t st = base + s * STB, fb = full + 8 * s;
                    gt_expect(fb, STB);
                    gt_load(st, &ta, kb * BK, tm * GT_BM, fb);
                    if (CL == 2) {
                        /* this block's half of the W tile, into both blocks: rows [128 rank,
                         * 128 rank + 128) of the tile (SWIGLU: rank 0 the gate rows, 1 the up) */
                        const int wy = MODE == 2 ? (int)rank * half + tn * (GT_BN / 2)
                                                 : tn * GT_BN + (int)rank * (GT_BN / 2);
                        gt_load_mc(st + AB + rank * (GT_BN / 2) * ROWB, &tw, kb * BK, wy, fb, 3);
                    } else if (MODE == 2) {
                        gt_load(st + AB, &tw, kb * BK, tn * (GT_BN / 2), fb);
                        gt_load(st + AB + (GT_BN / 2) * ROWB, &tw, kb * BK, half + tn * (GT_BN / 2), fb);
                    } else {
                        gt_load(st + AB, &tw, kb * BK, tn * GT_BN, fb);
                    }
                    gt_next(s, ph, ST);
                }
            }
        }
        if (CL == 2) {
            __syncwarp();
            gt_cluster_sync();
        }
        return;
    }
    wg_regs_inc<232>();
    const int c = wg - 1, w = (tid / 32) & 3, lane = tid & 31;
    float d[128];
    int s = 0;
    uint32_t ph = 0;
    for (int u = first; u < units; u += stride) {
        int pm, tn;
        gt_tile(u, mp, nt, gm, &pm, &tn);
        const int tm = pm * CL + (int)rank;
#pragma unroll
        for (int i = 0; i < 128; i++)
            d[i] = 0.0f;
        int prev = -1;
        for (int kb = 0; kb < KT; kb++) {
            wg_bar_wait(full + 8 * s, ph);
            const uint32_t st = base + s * STB;
            wg_fence();
#pragma unroll
            for (int kk = 0; kk < BK / 16; kk++)
                wg_mma_ss_n256(d, gt_desc(st + c * 64 * ROWB + kk * 32, BK), gt_desc(st + AB + kk * 32, BK));
            wg_commit();
            wg_wait<1>();
            wg_hold_flat(d);
            if (prev >= 0) {
                wg_bar_arrive_warp(empty + 8 * prev, lane);
                if (CL == 2 && lane == 0)
                    gt_arrive_remote(empty + 8 * prev, rank ^ 1);
            }
            prev = s;
            gt_next(s, ph, ST);
        }
        wg_wait<0>();
        wg_hold_flat(d);
        if (prev >= 0) {
            wg_bar_arrive_warp(empty + 8 * prev, lane);
            if (CL == 2 && lane == 0)
                gt_arrive_remote(empty + 8 * prev, rank ^ 1);
        }
        /* the epilogue: fragment j (n8 tile j) of this thread holds rows r0 and r0 + 8, columns
         * 8 j + 2 (lane % 4) and the one after */
        const int r0 = tm * GT_BM + c * 64 + w * 16 + lane / 4, cq = 2 * (lane % 4);
#pragma unroll
        for (int h = 0; h < 2; h++) {
            const int r = r0 + 8 * h;
            if (r >= M)
                continue;
            if (MODE == 2) {
                bf16 *cr = C + (int64_t)r * ldc + tn * (GT_BN / 2) + cq;
#pragma unroll
                for (int j = 0; j < 16; j++) {
                    const float *g = d + 4 * j + 2 * h, *uu = d + 4 * (j + 16) + 2 * h;
                    *(__nv_bfloat162 *)(cr + 8 * j) =
                        __floats2bfloat162_rn(gt_silu_mul(g[0], uu[0]), gt_silu_mul(g[1], uu[1]));
                }
            } else {
                bf16 *cr = C + (int64_t)r * ldc + tn * GT_BN + cq;
                const bf16 *ci = MODE == 1 ? Cin + (int64_t)r * ldc + tn * GT_BN + cq : NULL;
#pragma unroll
                for (int j = 0; j < 32; j++) {
                    float v0 = d[4 * j + 2 * h], v1 = d[4 * j + 2 * h + 1];
                    if (MODE == 1) {
                        const __nv_bfloat162 o = *(const __nv_bfloat162 *)(ci + 8 * j);
                        v0 += __low2float(o);
                        v1 += __high2float(o);
                    }
                    *(__nv_bfloat162 *)(cr + 8 * j) = __floats2bfloat162_rn(v0, v1);
                }
            }
        }
    }
    if (CL == 2)
        gt_cluster_sync(); /* the peer's last arrivals on this block's barriers have landed */
#else
    __trap(); /* built without sm_90a: dfl_cuda_gemm_tma never launches it */
#endif
}

/* cuTensorMapEncodeTiled from the driver (through the runtime: no link to libcuda) */
static PFN_cuTensorMapEncodeTiled_v12000 gt_encoder(void)
{
    static PFN_cuTensorMapEncodeTiled_v12000 fn;
    static bool asked;
    if (!asked) {
        void *p = NULL;
        cudaDriverEntryPointQueryResult q;
        if (cudaGetDriverEntryPointByVersion("cuTensorMapEncodeTiled", &p, 12000, cudaEnableDefault,
                                             &q) == cudaSuccess &&
            q == cudaDriverEntryPointSuccess)
            fn = (PFN_cuTensorMapEncodeTiled_v12000)p;
        asked = true;
    }
    return fn;
}

/* the map of a row-major bf16 matrix [rows, K] (leading dimension ld) in boxes of box_rows rows
 * of bk columns, in the form's swizzle (gemm_tma.h); rows past the end read as zeros */
static bool gt_map(CUtensorMap *m, const void *p, int64_t rows, int64_t K, int64_t ld, uint32_t box_rows,
                   int bk)
{
    PFN_cuTensorMapEncodeTiled_v12000 enc = gt_encoder();
    if (!enc)
        return false;
    cuuint64_t dims[2] = {(cuuint64_t)K, (cuuint64_t)rows}, strides[1] = {(cuuint64_t)ld * 2};
    cuuint32_t box[2] = {(cuuint32_t)bk, box_rows}, es[2] = {1, 1};
    return enc(m, CU_TENSOR_MAP_DATA_TYPE_BFLOAT16, 2, (void *)p, dims, strides, box, es,
               CU_TENSOR_MAP_INTERLEAVE_NONE, bk == 64 ? CU_TENSOR_MAP_SWIZZLE_128B : CU_TENSOR_MAP_SWIZZLE_64B,
               CU_TENSOR_MAP_L2_PROMOTION_L2_256B, CU_TENSOR_MAP_FLOAT_OOB_FILL_NONE) == CUDA_SUCCESS;
}

/* blocks of CL: 1 or 2 (DFL_CUDA_GEMM_CLUSTER=1 or 2 in the environment; default 1) */
static int gt_cluster(void)
{
    const char *v = getenv("DFL_CUDA_GEMM_CLUSTER");
    return v && !strcmp(v, "2") ? 2 : 1;
}

/* the K columns of a stage: 64 or 32 (DFL_CUDA_GEMM_BK=32 in the environment; default 64) */
static int gt_bk(void)
{
    const char *v = getenv("DFL_CUDA_GEMM_BK");
    return v && !strcmp(v, "32") ? 32 : 64;
}

/* one block an SM (CL 2: as many clusters as fit at once), each going through its tiles */
template <int MODE, int CL, int BK>
static cudaError_t gt_launch(cuda_impl *ci, const CUtensorMap &ta, const CUtensorMap &tw, bf16 *C,
                             const bf16 *cin, int64_t ldc, int M, int K, int half, int mt, int nt)
{
    auto fn = gemm_tma_kernel<MODE, CL, BK>;
    cudaError_t err = cuda_allow_smem(fn, GT_SMEM);
    if (err != cudaSuccess)
        return err;
    const int64_t units = (int64_t)(mt + CL - 1) / CL * nt;
    cudaLaunchConfig_t cfg = {};
    cudaLaunchAttribute at[1];
    cfg.blockDim = dim3(GT_THREADS);
    cfg.dynamicSmemBytes = GT_SMEM;
    cfg.stream = ci->stream;
    int64_t blocks = ci->sm_count;
    if (CL == 2) {
        static int fit; /* clusters of two that fit at once (the GPCs' SMs in pairs) */
        at[0].id = cudaLaunchAttributeClusterDimension;
        at[0].val.clusterDim.x = 2;
        at[0].val.clusterDim.y = 1;
        at[0].val.clusterDim.z = 1;
        cfg.attrs = at;
        cfg.numAttrs = 1;
        if (!fit) {
            cfg.gridDim = dim3((unsigned)blocks & ~1u);
            if ((err = cudaOccupancyMaxActiveClusters(&fit, fn, &cfg)) != cudaSuccess)
                return err;
            if (fit < 1)
                fit = ci->sm_count / 2;
        }
        blocks = 2 * (int64_t)fit;
    }
    if (blocks > units * CL)
        blocks = units * CL;
    cfg.gridDim = dim3((unsigned)blocks);
    return cudaLaunchKernelEx(&cfg, fn, ta, tw, C, cin, ldc, M, K, half, mt, nt);
}

extern "C" bool dfl_cuda_gemm_tma_fits(dfl_be *be, const void *C, int64_t ldc, const void *A,
                                       int64_t lda, const void *W, int64_t ldw, int64_t M,
                                       int64_t N, int64_t K, int mode)
{
    if (!be || be->kind != DFL_BE_CUDA || be->act != DFL_BF16 || mode < 0 || mode > 2)
        return false;
    if (cuda_of(be)->cc_major != 9 || !gt_encoder())
        return false;
    const int64_t Nc = mode == 2 ? N / 2 : N, tile = mode == 2 ? GT_BN / 2 : GT_BN;
    return M > 0 && K > 0 && K % GT_BK == 0 && Nc > 0 && Nc % tile == 0 && (mode != 2 || N % 2 == 0) &&
           lda % 8 == 0 && ldw % 8 == 0 && ldc % 2 == 0 && ldc >= Nc && lda >= K && ldw >= K &&
           is_aligned(A, 16) && is_aligned(W, 16) && is_aligned(C, 4) &&
           (M + GT_BM - 1) / GT_BM * (Nc / tile) <= INT32_MAX && M <= INT32_MAX && K <= INT32_MAX;
}

extern "C" int dfl_cuda_gemm_tma(dfl_be *be, void *C, int64_t ldc, const void *Cin, const void *A,
                                 int64_t lda, const void *W, int64_t ldw, int64_t M, int64_t N,
                                 int64_t K, int mode)
{
    if (!dfl_cuda_gemm_tma_fits(be, C, ldc, A, lda, W, ldw, M, N, K, mode))
        return cuda_op_fail(be, DFL_EUNSUP, "gemm_tma: %lld x %lld x %lld (mode %d) does not fit "
                            "the TMA GEMM (a Hopper GPU, K a multiple of %d, the output columns of "
                            "whole tiles, 16-byte aligned operands)", (long long)M, (long long)N,
                            (long long)K, mode, GT_BK);
    if (Cin && (mode != 1 || !is_aligned(Cin, 4)))
        return cuda_op_fail(be, DFL_EUNSUP, "gemm_tma: an addend is for the ACC epilogue only, "
                            "4-byte aligned");
    int rc = cuda_enter(be);
    if (rc)
        return rc;
    cuda_impl *ci = cuda_of(be);
    CUtensorMap ta, tw;
    const int cl = gt_cluster();
    /* the output columns of a tile, and the W rows of one copy (with clusters each block copies
     * half of the tile's rows; SWIGLU: the gate rows and the up rows in two copies) */
    const uint32_t wbox = mode == 2 ? GT_BN / 2 : GT_BN, wcopy = mode == 2 || cl == 2 ? GT_BN / 2 : GT_BN;
    const int bk = gt_bk();
    if (!gt_map(&ta, A, M, K, lda, GT_BM, bk) || !gt_map(&tw, W, N, K, ldw, wcopy, bk))
        return cuda_op_fail(be, DFL_EDEVICE, "gemm_tma: cuTensorMapEncodeTiled refused the "
                            "operands (%lld x %lld x %lld)", (long long)M, (long long)N, (long long)K);
    const int mt = (int)((M + GT_BM - 1) / GT_BM);
    const int nt = (int)((mode == 2 ? N / 2 : N) / wbox);
    cudaError_t err;
    const bf16 *cin = (const bf16 *)(Cin ? Cin : C);
    const int half = mode == 2 ? (int)(N / 2) : 0;
#define GT_GO(MO, CLU, B) gt_launch<MO, CLU, B>(ci, ta, tw, (bf16 *)C, cin, ldc, (int)M, (int)K, half, mt, nt)
#define GT_BY_MODE(CLU, B) (mode == 0 ? GT_GO(0, CLU, B) : mode == 1 ? GT_GO(1, CLU, B) : GT_GO(2, CLU, B))
    if (bk == 32)
        err = cl == 2 ? GT_BY_MODE(2, 32) : GT_BY_MODE(1, 32);
    else
        err = cl == 2 ? GT_BY_MODE(2, 64) : GT_BY_MODE(1, 64);
#undef GT_BY_MODE
#undef GT_GO
    if (err != cudaSuccess)
        return cuda_op_fail(be, DFL_EDEVICE, "gemm_tma: launch: %s", cudaGetErrorString(err));
    return cuda_launch_check(be, "gemm_tma");
}
