/* hybrid_ew.cuh: the element-wise ops of hybrid targets on 8 bf16 channels per thread (16-byte
 * loads and stores; kernels/hybrid.cu launches them where the rows and strides allow, and the
 * one-channel kernels elsewhere): the per-sequence causal conv1d + SiLU and the sigmoid gate.
 * Integer work per element is a few adds (the one-channel kernels divide 64-bit indices per
 * element). Same arithmetic as the CPU ops (be_cpu_hybrid.c): f32, one rounding per output.
 * Included by hybrid.cu and by the SIMT emulator's check tests/emu/emu-gdn.cc. */
#ifndef DFL_HYBRID_EW_CUH
#define DFL_HYBRID_EW_CUH

#define EW_THREADS 128

/* 8 bf16 of a 16-byte vector as f32, and back (one rounding each) */
__device__ __forceinline__ void ew_unpack8(uint4 v, float *f)
{
    const __nv_bfloat162 *h = (const __nv_bfloat162 *)&v;
#pragma unroll
    for (int e = 0; e < 4; e++) {
        float2 p = __bfloat1622float2(h[e]);
        f[2 * e] = p.x;
        f[2 * e + 1] = p.y;
    }
}

__device__ __forceinline__ uint4 ew_pack8(const float *f)
{
    uint4 v;
    __nv_bfloat162 *h = (__nv_bfloat162 *)&v;
#pragma unroll
    for (int e = 0; e < 4; e++)
        h[e] = __floats2bfloat162_rn(f[2 * e], f[2 * e + 1]);
    return v;
}

/* grid (ceil(C / 8 / EW_THREADS), token slots): thread = 8 channels; tokens blockIdx.y,
 * + gridDim.y, ...; the weights of its channels loaded once. y[t, c] = silu(sum_{j <= back}
 * w[c, K-1-j] x[t-j, c]), back = min(pos[t], K - 1), summed in j order as the CPU op. */
template <int K>
__global__ void __launch_bounds__(EW_THREADS)
conv1d_silu_v8_kernel(bf16 *y, int64_t ldy, const bf16 *x, int64_t ldx, const bf16 *w,
                      const int32_t *pos, int64_t Tn, int C)
{
    const int c = (blockIdx.x * EW_THREADS + threadIdx.x) * 8;
    if (c >= C)
        return;
    float wr[8][K];
#pragma unroll
    for (int e = 0; e < 8; e++)
#pragma unroll
        for (int j = 0; j < K; j++)
            wr[e][j] = to_f32(w[(int64_t)(c + e) * K + j]);
    for (int64_t t = blockIdx.y; t < Tn; t += gridDim.y) {
        const int back = pos[t] < K - 1 ? pos[t] : K - 1;
        float acc[8], xv[8];
#pragma unroll
        for (int e = 0; e < 8; e++)
            acc[e] = 0.0f;
#pragma unroll
        for (int j = 0; j < K; j++) {
            if (j <= back) {
                ew_unpack8(*(const uint4 *)(x + (t - j) * ldx + c), xv);
#pragma unroll
                for (int e = 0; e < 8; e++)
                    acc[e] += wr[e][K - 1 - j] * xv[e];
            }
        }
#pragma unroll
        for (int e = 0; e < 8; e++)
            acc[e] = acc[e] / (1.0f + expf(-acc[e]));
        *(uint4 *)(y + t * ldy + c) = ew_pack8(acc);
    }
}

/* grid (ceil(n / 8 / EW_THREADS), row slots): x[r, c] *= sigmoid(g[r, c]), 8 columns a thread */
__global__ void __launch_bounds__(EW_THREADS)
sigmoid_mul_v8_kernel(bf16 *x, int64_t ldx, const bf16 *g, int64_t ldg, int64_t R, int n)
{
    const int c = (blockIdx.x * EW_THREADS + threadIdx.x) * 8;
    if (c >= n)
        return;
    for (int64_t r = blockIdx.y; r < R; r += gridDim.y) {
        float xv[8], gv[8];
        uint4 *px = (uint4 *)(x + r * ldx + c);
        ew_unpack8(*px, xv);
        ew_unpack8(*(const uint4 *)(g + r * ldg + c), gv);
#pragma unroll
        for (int e = 0; e < 8; e++)
            xv[e] *= 1.0f / (1.0f + expf(-gv[e]));
        *px = ew_pack8(xv);
    }
}

#endif
