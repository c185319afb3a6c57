/* wgmma_ptx.cuh: PTX helpers of Hopper's warpgroup MMA (wgmma; sm_90a code only: include it
 * under __CUDA_ARCH_FEAT_SM90_ALL) for kernels/attn_wgmma.cu and kernels/moe_wgmma.cu: the
 * fences, commit and wait, the proxy fence after cp.async, and the operand list of an m64n128 f32
 * accumulator held as 16 n8 tiles of 4 (d[j][e]: n8 tile j, the mma.sync accumulator order). */
#ifndef DFL_WGMMA_PTX_CUH
#define DFL_WGMMA_PTX_CUH

#include <stdint.h>

/* registers (or accumulators) written before it are ready for the wgmma issued after it */
__device__ __forceinline__ void wg_fence() { asm volatile("wgmma.fence.sync.aligned;\n" ::: "memory"); }
/* the wgmma issued since the last commit form one group */
__device__ __forceinline__ void wg_commit() { asm volatile("wgmma.commit_group.sync.aligned;\n" ::: "memory"); }
/* waits until at most N groups are in flight */
template <int N> __device__ __forceinline__ void wg_wait() { asm volatile("wgmma.wait_group.sync.aligned %0;\n" ::"n"(N) : "memory"); }
/* cp.async's shared-memory writes (generic proxy) made visible to wgmma's reads (async proxy) */
__device__ __forceinline__ void wg_proxy_fence() { asm volatile("fence.proxy.async.shared::cta;\n" ::: "memory"); }

/* the 64 read-write operands %0..%63 of accumulator float d[16][4] */
#define WG_ACC64(d) \
    "+f"(d[0][0]), "+f"(d[0][1]), "+f"(d[0][2]), "+f"(d[0][3]), \
    "+f"(d[1][0]), "+f"(d[1][1]), "+f"(d[1][2]), "+f"(d[1][3]), \
    "+f"(d[2][0]), "+f"(d[2][1]), "+f"(d[2][2]), "+f"(d[2][3]), \
    "+f"(d[3][0]), "+f"(d[3][1]), "+f"(d[3][2]), "+f"(d[3][3]), \
    "+f"(d[4][0]), "+f"(d[4][1]), "+f"(d[4][2]), "+f"(d[4][3]), \
    "+f"(d[5][0]), "+f"(d[5][1]), "+f"(d[5][2]), "+f"(d[5][3]), \
    "+f"(d[6][0]), "+f"(d[6][1]), "+f"(d[6][2]), "+f"(d[6][3]), \
    "+f"(d[7][0]), "+f"(d[7][1]), "+f"(d[7][2]), "+f"(d[7][3]), \
    "+f"(d[8][0]), "+f"(d[8][1]), "+f"(d[8][2]), "+f"(d[8][3]), \
    "+f"(d[9][0]), "+f"(d[9][1]), "+f"(d[9][2]), "+f"(d[9][3]), \
    "+f"(d[10][0]), "+f"(d[10][1]), "+f"(d[10][2]), "+f"(d[10][3]), \
    "+f"(d[11][0]), "+f"(d[11][1]), "+f"(d[11][2]), "+f"(d[11][3]), \
    "+f"(d[12][0]), "+f"(d[12][1]), "+f"(d[12][2]), "+f"(d[12][3]), \
    "+f"(d[13][0]), "+f"(d[13][1]), "+f"(d[13][2]), "+f"(d[13][3]), \
    "+f"(d[14][0]), "+f"(d[14][1]), "+f"(d[14][2]), "+f"(d[14][3]), \
    "+f"(d[15][0]), "+f"(d[15][1]), "+f"(d[15][2]), "+f"(d[15][3])
/* their names in the instruction text */
#define WG_ACC64_REGS "%0, %1, %2, %3, %4, %5, %6, %7, %8, %9, %10, %11, %12, %13, %14, %15, %16, %17, %18, %19, %20, %21, %22, %23, %24, %25, %26, %27, %28, %29, %30, %31, %32, %33, %34, %35, %36, %37, %38, %39, %40, %41, %42, %43, %44, %45, %46, %47, %48, %49, %50, %51, %52, %53, %54, %55, %56, %57, %58, %59, %60, %61, %62, %63"

/* keeps the compiler from moving accesses of d across the asynchronous wgmma */
__device__ __forceinline__ void wg_hold(float (&d)[16][4])
{
#pragma unroll
    for (int i = 0; i < 16; i++)
#pragma unroll
        for (int j = 0; j < 4; j++)
            asm volatile("" : "+f"(d[i][j])::"memory");
}

/* d (m64 x n128, f32) = (scale_d ? d : 0) + A (descriptor da, m64 x k16) B (descriptor db, k16 x
 * n128), bf16, both K-major in shared memory */
__device__ __forceinline__ void wg_mma_ss(float (&d)[16][4], uint64_t da, uint64_t db, int scale_d)
{
    asm volatile("{\n.reg .pred p;\nsetp.ne.b32 p, %66, 0;\n"
                 "wgmma.mma_async.sync.aligned.m64n128k16.f32.bf16.bf16 {" WG_ACC64_REGS "}, %64, %65, p, 1, 1, 0, 0;\n}\n"
                 : WG_ACC64(d)
                 : "l"(da), "l"(db), "r"(scale_d));
}

/* d (m64 x n128, f32) += A (registers: a warp's 16 rows as the mma.sync m16n8k16 A fragment) B
 * (descriptor db, k16 x n128, bf16 MN-major in shared memory: the transposed-B form) */
__device__ __forceinline__ void wg_mma_rs_tb(float (&d)[16][4], const uint32_t (&a)[4], uint64_t db)
{
    asm volatile("{\n.reg .pred p;\nsetp.ne.b32 p, %69, 0;\n"
                 "wgmma.mma_async.sync.aligned.m64n128k16.f32.bf16.bf16 {" WG_ACC64_REGS "}, {%64, %65, %66, %67}, %68, p, 1, 1, 1;\n}\n"
                 : WG_ACC64(d)
                 : "r"(a[0]), "r"(a[1]), "r"(a[2]), "r"(a[3]), "l"(db), "n"(1));
}

#endif
