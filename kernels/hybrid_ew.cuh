/* hybrid_ew.cuh: the element-wise ops of hybrid targets on 8 bf16 channels per thread (16-byte
 * loads and stores; kernels/hybrid.cu launches them where the rows and strides allow, and the
 * one-channel kernels elsewhere): the per-sequence causal conv1d + SiLU, the sigmoid gate, and the
 * per-head L2 norm and gated RMSNorm.
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

/* ---- per-head norms, 8 channels a lane ----
 * One group of G = d / 8 lanes per (row, head) (G a power of two from 4 to 32: d 32, 64, 128 or
 * 256), 32 / G groups a warp; the warps of the grid step over the (row, head) items together, so
 * that every lane reaches every shuffle (a group past the last item computes nothing it stores).
 * The head's sum of squares: each lane's 8 in order, then a butterfly over the group. */

/* the sum of squares of the 8 values in f, summed over the lane's group of G */
template <int G>
__device__ __forceinline__ float ew_group_sumsq(const float *f)
{
    float ss = 0.0f;
#pragma unroll
    for (int e = 0; e < 8; e++)
        ss += f[e] * f[e];
#pragma unroll
    for (int o = G / 2; o > 0; o >>= 1)
        ss += __shfl_xor_sync(0xffffffffu, ss, o);
    return ss;
}

/* x = x / sqrt(sum x^2 + eps) * scale per head of 8 G channels (rows of stride ld) */
template <int G>
__global__ void __launch_bounds__(EW_THREADS)
l2norm_v8_kernel(bf16 *x, int64_t ld, int64_t R, int heads, float scale, float eps)
{
    constexpr int GPW = 32 / G, WPB = EW_THREADS / 32;
    const int lane = threadIdx.x & 31, gl = lane % G;
    const int64_t items = R * heads;
    for (int64_t w0 = ((int64_t)blockIdx.x * WPB + threadIdx.x / 32) * GPW; w0 < items;
         w0 += (int64_t)gridDim.x * WPB * GPW) {
        const int64_t it = w0 + lane / G;
        const bool on = it < items;
        bf16 *p = on ? x + (it / heads) * ld + (it % heads) * (8 * G) + 8 * gl : x;
        float f[8];
        ew_unpack8(on ? *(const uint4 *)p : make_uint4(0, 0, 0, 0), f);
        const float s = 1.0f / sqrtf(ew_group_sumsq<G>(f) + eps);
#pragma unroll
        for (int e = 0; e < 8; e++)
            f[e] = f[e] * s * scale;
        if (on)
            *(uint4 *)p = ew_pack8(f);
    }
}

/* x = w * rmsnorm(x) * silu(z) per head of 8 G channels (x rows of stride ldx, z of ldz) */
template <int G>
__global__ void __launch_bounds__(EW_THREADS)
gated_rmsnorm_v8_kernel(bf16 *x, int64_t ldx, const bf16 *z, int64_t ldz, const bf16 *w, int64_t R,
                        int heads, float eps)
{
    constexpr int GPW = 32 / G, WPB = EW_THREADS / 32;
    const int lane = threadIdx.x & 31, gl = lane % G;
    const int64_t items = R * heads;
    float wv[8];
    ew_unpack8(*(const uint4 *)(w + 8 * gl), wv);
    for (int64_t w0 = ((int64_t)blockIdx.x * WPB + threadIdx.x / 32) * GPW; w0 < items;
         w0 += (int64_t)gridDim.x * WPB * GPW) {
        const int64_t it = w0 + lane / G;
        const bool on = it < items;
        const int64_t r = on ? it / heads : 0, c = on ? (it % heads) * (8 * G) + 8 * gl : 0;
        float f[8], zf[8];
        ew_unpack8(on ? *(const uint4 *)(x + r * ldx + c) : make_uint4(0, 0, 0, 0), f);
        ew_unpack8(on ? *(const uint4 *)(z + r * ldz + c) : make_uint4(0, 0, 0, 0), zf);
        const float s = 1.0f / sqrtf(ew_group_sumsq<G>(f) / (float)(8 * G) + eps);
#pragma unroll
        for (int e = 0; e < 8; e++)
            f[e] = wv[e] * (f[e] * s) * (zf[e] / (1.0f + expf(-zf[e])));
        if (on)
            *(uint4 *)(x + r * ldx + c) = ew_pack8(f);
    }
}

#endif
