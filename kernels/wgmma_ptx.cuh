/* wgmma_ptx.cuh: PTX helpers of Hopper's warpgroup MMA (wgmma; sm_90a code only: include it
 * under __CUDA_ARCH_FEAT_SM90_ALL) for kernels/attn_wgmma.cu, kernels/moe_wgmma.cu and
 * kernels/dflash_wgmma.cu: the fences, commit and wait, the proxy fence after cp.async, mbarriers
 * and the register budget of warp-specialized kernels, and the operand lists of m64n64 and m64n128 f32 accumulators held as 8 or 16 n8 tiles of 4 (d[j][e]:
 * n8 tile j, the mma.sync accumulator order); for kernels/moe_wgmma.cu and kernels/gemm_tma.cu,
 * the m64n256 product into flat accumulators (d[4 j + e]) and their hold. */
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

/* mbarriers in shared memory (bar: its shared address, 8-byte aligned), for warp-specialized
 * kernels whose loading warps hand stages to multiplying ones: init (one thread, then a block
 * barrier), arrive, arrive once this thread's earlier cp.async have landed (.noinc: the arrival
 * is one of the count given at init), and wait until the phase of parity par has completed (a
 * fresh barrier is in phase 0, so waiting on parity 1 passes at once) */
__device__ __forceinline__ void wg_bar_init(uint32_t bar, uint32_t count)
{
    asm volatile("mbarrier.init.shared::cta.b64 [%0], %1;\n" ::"r"(bar), "r"(count) : "memory");
}
__device__ __forceinline__ void wg_bar_arrive(uint32_t bar)
{
    asm volatile("mbarrier.arrive.shared::cta.b64 _, [%0];\n" ::"r"(bar) : "memory");
}
__device__ __forceinline__ void wg_bar_arrive_cp(uint32_t bar)
{
    asm volatile("cp.async.mbarrier.arrive.noinc.shared::cta.b64 [%0];\n" ::"r"(bar) : "memory");
}
__device__ __forceinline__ void wg_bar_wait(uint32_t bar, uint32_t par)
{
    uint32_t done;
    do {
        asm volatile("{\n.reg .pred p;\nmbarrier.try_wait.parity.shared::cta.b64 p, [%1], %2;\n"
                     "selp.u32 %0, 1, 0, p;\n}\n"
                     : "=r"(done) : "r"(bar), "r"(par) : "memory");
    } while (!done);
}
/* one arrival of the warp on bar, once all its lanes are here (lane 0's): for barriers that count
 * warps */
__device__ __forceinline__ void wg_bar_arrive_warp(uint32_t bar, uint32_t lane)
{
    __syncwarp();
    if (lane == 0)
        wg_bar_arrive(bar);
}
/* a warpgroup's register budget from here on (every warp of the warpgroup runs it; N a multiple
 * of 8 from 24 to 256): a loading warpgroup gives registers back, multiplying ones take them */
template <int N> __device__ __forceinline__ void wg_regs_dec() { asm volatile("setmaxnreg.dec.sync.aligned.u32 %0;\n" ::"n"(N)); }
template <int N> __device__ __forceinline__ void wg_regs_inc() { asm volatile("setmaxnreg.inc.sync.aligned.u32 %0;\n" ::"n"(N)); }

/* the read-write operands of accumulator float d[N][4] (N = 8: %0..%31, N = 16: %0..%63) */
#define WG_ACC4(d, i) "+f"(d[i][0]), "+f"(d[i][1]), "+f"(d[i][2]), "+f"(d[i][3])
#define WG_ACC32(d) WG_ACC4(d, 0), WG_ACC4(d, 1), WG_ACC4(d, 2), WG_ACC4(d, 3), WG_ACC4(d, 4), WG_ACC4(d, 5), \
                    WG_ACC4(d, 6), WG_ACC4(d, 7)
#define WG_ACC64(d) WG_ACC32(d), WG_ACC4(d, 8), WG_ACC4(d, 9), WG_ACC4(d, 10), WG_ACC4(d, 11), WG_ACC4(d, 12), \
                    WG_ACC4(d, 13), WG_ACC4(d, 14), WG_ACC4(d, 15)
/* their names in the instruction text */
#define WG_ACC64_REGS "%0, %1, %2, %3, %4, %5, %6, %7, %8, %9, %10, %11, %12, %13, %14, %15, %16, %17, %18, %19, %20, %21, %22, %23, %24, %25, %26, %27, %28, %29, %30, %31, %32, %33, %34, %35, %36, %37, %38, %39, %40, %41, %42, %43, %44, %45, %46, %47, %48, %49, %50, %51, %52, %53, %54, %55, %56, %57, %58, %59, %60, %61, %62, %63"
#define WG_ACC32_REGS "%0, %1, %2, %3, %4, %5, %6, %7, %8, %9, %10, %11, %12, %13, %14, %15, %16, %17, %18, %19, %20, %21, %22, %23, %24, %25, %26, %27, %28, %29, %30, %31"

/* keeps the compiler from moving accesses of d (accumulators) or a (A fragments: their registers
 * stay untouched until the wgmma reading them is done) across the asynchronous wgmma */
template <int N> __device__ __forceinline__ void wg_hold(float (&d)[N][4])
{
#pragma unroll
    for (int i = 0; i < N; i++)
#pragma unroll
        for (int j = 0; j < 4; j++)
            asm volatile("" : "+f"(d[i][j])::"memory");
}

template <int N> __device__ __forceinline__ void wg_hold_a(uint32_t (&a)[N][4])
{
#pragma unroll
    for (int i = 0; i < N; i++)
#pragma unroll
        for (int j = 0; j < 4; j++)
            asm volatile("" : "+r"(a[i][j])::"memory");
}

/* d (m64 x n64, f32) = (scale_d ? d : 0) + A (descriptor da, m64 x k16) B (descriptor db, k16 x
 * n64), bf16, both K-major in shared memory */
__device__ __forceinline__ void wg_mma_ss_n64(float (&d)[8][4], uint64_t da, uint64_t db, int scale_d)
{
    asm volatile("{\n.reg .pred p;\nsetp.ne.b32 p, %34, 0;\n"
                 "wgmma.mma_async.sync.aligned.m64n64k16.f32.bf16.bf16 {" WG_ACC32_REGS "}, %32, %33, p, 1, 1, 0, 0;\n}\n"
                 : WG_ACC32(d)
                 : "l"(da), "l"(db), "r"(scale_d));
}

/* d (m64 x n64, f32) = (scale_d ? d : 0) + A (registers: a warp's 16 rows as the mma.sync
 * m16n8k16 A fragment) B (descriptor db, k16 x n64, bf16 K-major in shared memory) */
__device__ __forceinline__ void wg_mma_rs_n64(float (&d)[8][4], const uint32_t (&a)[4], uint64_t db, int scale_d)
{
    asm volatile("{\n.reg .pred p;\nsetp.ne.b32 p, %37, 0;\n"
                 "wgmma.mma_async.sync.aligned.m64n64k16.f32.bf16.bf16 {" WG_ACC32_REGS "}, {%32, %33, %34, %35}, %36, p, 1, 1, 0;\n}\n"
                 : WG_ACC32(d)
                 : "r"(a[0]), "r"(a[1]), "r"(a[2]), "r"(a[3]), "l"(db), "r"(scale_d));
}

/* d (m64 x n128, f32) = (scale_d ? d : 0) + A (registers: a warp's 16 rows as the mma.sync
 * m16n8k16 A fragment) B (descriptor db, k16 x n128, bf16 K-major in shared memory) */
__device__ __forceinline__ void wg_mma_rs_n128(float (&d)[16][4], const uint32_t (&a)[4], uint64_t db, int scale_d)
{
    asm volatile("{\n.reg .pred p;\nsetp.ne.b32 p, %69, 0;\n"
                 "wgmma.mma_async.sync.aligned.m64n128k16.f32.bf16.bf16 {" WG_ACC64_REGS "}, {%64, %65, %66, %67}, %68, p, 1, 1, 0;\n}\n"
                 : WG_ACC64(d)
                 : "r"(a[0]), "r"(a[1]), "r"(a[2]), "r"(a[3]), "l"(db), "r"(scale_d));
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

/* keeps the compiler from moving accumulator accesses across the asynchronous wgmma */
template <int R> __device__ __forceinline__ void wg_hold_flat(float (&d)[R])
{
#pragma unroll
    for (int i = 0; i < R; i++)
        asm volatile("" : "+f"(d[i])::"memory");
}

/* d (m64 x n256, f32) += A (descriptor da, m64 x k16) B (db, k16 x n256), both bf16 K-major in
 * shared memory */
__device__ __forceinline__ void wg_mma_ss_n256(float (&d)[128], uint64_t da, uint64_t db)
{
    asm volatile("{\n.reg .pred p;\nsetp.ne.b32 p, %130, 0;\n"
                 "wgmma.mma_async.sync.aligned.m64n256k16.f32.bf16.bf16 {"
                 "%0, %1, %2, %3, %4, %5, %6, %7, %8, %9, %10, %11, "
                 "%12, %13, %14, %15, %16, %17, %18, %19, %20, %21, %22, %23, "
                 "%24, %25, %26, %27, %28, %29, %30, %31, %32, %33, %34, %35, "
                 "%36, %37, %38, %39, %40, %41, %42, %43, %44, %45, %46, %47, "
                 "%48, %49, %50, %51, %52, %53, %54, %55, %56, %57, %58, %59, "
                 "%60, %61, %62, %63, %64, %65, %66, %67, %68, %69, %70, %71, "
                 "%72, %73, %74, %75, %76, %77, %78, %79, %80, %81, %82, %83, "
                 "%84, %85, %86, %87, %88, %89, %90, %91, %92, %93, %94, %95, "
                 "%96, %97, %98, %99, %100, %101, %102, %103, %104, %105, %106, %107, "
                 "%108, %109, %110, %111, %112, %113, %114, %115, %116, %117, %118, %119, "
                 "%120, %121, %122, %123, %124, %125, %126, %127"
                 "}, %128, %129, p, 1, 1, 0, 0;\n}\n"
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
                   "+f"(d[60]), "+f"(d[61]), "+f"(d[62]), "+f"(d[63]), "+f"(d[64]), "+f"(d[65]),
                   "+f"(d[66]), "+f"(d[67]), "+f"(d[68]), "+f"(d[69]), "+f"(d[70]), "+f"(d[71]),
                   "+f"(d[72]), "+f"(d[73]), "+f"(d[74]), "+f"(d[75]), "+f"(d[76]), "+f"(d[77]),
                   "+f"(d[78]), "+f"(d[79]), "+f"(d[80]), "+f"(d[81]), "+f"(d[82]), "+f"(d[83]),
                   "+f"(d[84]), "+f"(d[85]), "+f"(d[86]), "+f"(d[87]), "+f"(d[88]), "+f"(d[89]),
                   "+f"(d[90]), "+f"(d[91]), "+f"(d[92]), "+f"(d[93]), "+f"(d[94]), "+f"(d[95]),
                   "+f"(d[96]), "+f"(d[97]), "+f"(d[98]), "+f"(d[99]), "+f"(d[100]), "+f"(d[101]),
                   "+f"(d[102]), "+f"(d[103]), "+f"(d[104]), "+f"(d[105]), "+f"(d[106]), "+f"(d[107]),
                   "+f"(d[108]), "+f"(d[109]), "+f"(d[110]), "+f"(d[111]), "+f"(d[112]), "+f"(d[113]),
                   "+f"(d[114]), "+f"(d[115]), "+f"(d[116]), "+f"(d[117]), "+f"(d[118]), "+f"(d[119]),
                   "+f"(d[120]), "+f"(d[121]), "+f"(d[122]), "+f"(d[123]), "+f"(d[124]), "+f"(d[125]),
                   "+f"(d[126]), "+f"(d[127])
                 : "l"(da), "l"(db), "r"(1));
}

#endif
