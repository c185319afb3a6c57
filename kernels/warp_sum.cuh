/* warp_sum.cuh: the sum over a warp (or over groups of W adjacent lanes) and the sum over a block
 * that the kernels share: a butterfly of __shfl_xor_sync, after which every lane holds the sum,
 * added in the same order on every lane. tests/emu/simt.h emulates __shfl_xor_sync, so that the
 * emulator runs the same code. */
#ifndef DFL_WARP_SUM_CUH
#define DFL_WARP_SUM_CUH

/* Sum over each group of W lanes (W a power of two, at most 32; groups of adjacent lanes) */
template <int W = 32, typename T> __device__ __forceinline__ T warp_sum(T v)
{
#pragma unroll
    for (int o = W / 2; o > 0; o >>= 1)
        v += __shfl_xor_sync(0xffffffffu, v, o);
    return v;
}

/* Sum over the block (blockDim.x a multiple of 32); every thread gets the same result (each adds
 * the warp partials in the same order). sh: 32 elements of shared memory. May be called
 * repeatedly: the leading barrier keeps a call from overwriting sh while a previous one is being
 * read. */
template <typename T> __device__ __forceinline__ T block_sum_sh(T v, T *sh)
{
    const int lane = threadIdx.x & 31, wid = threadIdx.x >> 5, nw = blockDim.x >> 5;
    v = warp_sum(v);
    __syncthreads();
    if (lane == 0)
        sh[wid] = v;
    __syncthreads();
    T s = 0;
    for (int i = 0; i < nw; i++)
        s += sh[i];
    return s;
}

#endif
