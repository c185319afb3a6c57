/* dflash_ptx.cuh: the PTX helpers of the DFlash attention kernels (kernels/dflash_kernels.cuh):
 * cp.async, ldmatrix, mma.sync m16n8k16 bf16, ex2.approx, bf16 packing, and the dynamic shared
 * memory declaration. tests/emu/simt.h provides the same names for running the kernels on the
 * CPU. */
#ifndef DFL_DFLASH_PTX_CUH
#define DFL_DFLASH_PTX_CUH

#include <cuda_bf16.h>
#include <stdint.h>

#define DF_DYN_SMEM(name) extern __shared__ __align__(128) unsigned char name[]

__device__ __forceinline__ uint32_t df_smem(const void *p) { return (uint32_t)__cvta_generic_to_shared(p); }

__device__ __forceinline__ void df_cp16(uint32_t dst, const void *src, bool ok)
{
    int n = ok ? 16 : 0;
    asm volatile("cp.async.cg.shared.global [%0], [%1], 16, %2;\n" ::"r"(dst), "l"(src), "r"(n) : "memory");
}
/* 4 bytes (zero-filled when !ok) */
__device__ __forceinline__ void df_cp4(uint32_t dst, const void *src, bool ok)
{
    int n = ok ? 4 : 0;
    asm volatile("cp.async.ca.shared.global [%0], [%1], 4, %2;\n" ::"r"(dst), "l"(src), "r"(n) : "memory");
}
__device__ __forceinline__ void df_commit() { asm volatile("cp.async.commit_group;\n" ::: "memory"); }
template <int N> __device__ __forceinline__ void df_wait() { asm volatile("cp.async.wait_group %0;\n" ::"n"(N) : "memory"); }

__device__ __forceinline__ void df_ldm(uint32_t (&r)[4], uint32_t addr)
{
    asm volatile("ldmatrix.sync.aligned.m8n8.x4.shared.b16 {%0, %1, %2, %3}, [%4];\n"
                 : "=r"(r[0]), "=r"(r[1]), "=r"(r[2]), "=r"(r[3]) : "r"(addr));
}
__device__ __forceinline__ void df_ldm_t(uint32_t (&r)[4], uint32_t addr)
{
    asm volatile("ldmatrix.sync.aligned.m8n8.x4.trans.shared.b16 {%0, %1, %2, %3}, [%4];\n"
                 : "=r"(r[0]), "=r"(r[1]), "=r"(r[2]), "=r"(r[3]) : "r"(addr));
}
/* c += a (16x16 row) * b (16x8 col), bf16 in, f32 accumulate */
__device__ __forceinline__ void df_mma(float (&c)[4], const uint32_t (&a)[4], uint32_t b0, uint32_t b1)
{
    asm("mma.sync.aligned.m16n8k16.row.col.f32.bf16.bf16.f32 {%0, %1, %2, %3}, "
        "{%4, %5, %6, %7}, {%8, %9}, {%0, %1, %2, %3};\n"
        : "+f"(c[0]), "+f"(c[1]), "+f"(c[2]), "+f"(c[3])
        : "r"(a[0]), "r"(a[1]), "r"(a[2]), "r"(a[3]), "r"(b0), "r"(b1));
}
__device__ __forceinline__ float df_exp2(float x)
{
    float y;
    asm("ex2.approx.ftz.f32 %0, %1;\n" : "=f"(y) : "f"(x));
    return y;
}
__device__ __forceinline__ uint32_t df_pack(float lo, float hi)
{
    __nv_bfloat162 v = __floats2bfloat162_rn(lo, hi);
    return (uint32_t)__bfloat16_as_ushort(v.x) | ((uint32_t)__bfloat16_as_ushort(v.y) << 16);
}

/* the bf16 in the low / high half of a 32-bit word, as f32 (exact) */
__device__ __forceinline__ float df_bf_lo(uint32_t w) { return __uint_as_float(w << 16); }
__device__ __forceinline__ float df_bf_hi(uint32_t w) { return __uint_as_float(w & 0xFFFF0000u); }

#endif
