/* wmma.h: nvcuda::wmma for the SIMT emulator (simt.h): the subset kernels/gdn_chunk.cuh uses
 * (m16n16k8 TF32 operand fragments, f32 accumulators). Every lane holds the whole tile, row-major,
 * so products need no exchange; element-wise code on .x[] sees every element in every lane, which
 * is what code that treats .x[] as opaque may assume. Loads and stores are warp collectives as on
 * the GPU (a __syncwarp before and after), so that a tile loaded, updated and stored back by a
 * warp is read by all its lanes before any of them writes it. __float_to_tf32 rounds
 * to 10 mantissa bits (nearest, ties away from zero, as cvt.rna.tf32.f32); mma_sync sums in k
 * order in float. */
#ifndef DFL_EMU_WMMA_H
#define DFL_EMU_WMMA_H

#include <type_traits>

namespace nvcuda {
namespace wmma {
struct row_major {};
struct col_major {};
struct matrix_a {};
struct matrix_b {};
struct accumulator {};
namespace precision {
struct tf32 {};
}
enum layout_t { mem_row_major, mem_col_major };

template <typename Use, int M, int N, int K> struct shape_of;
template <int M, int N, int K> struct shape_of<matrix_a, M, N, K> { static constexpr int R = M, C = K; };
template <int M, int N, int K> struct shape_of<matrix_b, M, N, K> { static constexpr int R = K, C = N; };
template <int M, int N, int K> struct shape_of<accumulator, M, N, K> { static constexpr int R = M, C = N; };

template <typename Use, int M, int N, int K, typename T, typename Layout = void> struct fragment {
    static constexpr int R = shape_of<Use, M, N, K>::R, C = shape_of<Use, M, N, K>::C;
    static constexpr int num_elements = R * C;
    float x[R * C];
};

template <typename Use, int M, int N, int K, typename T, typename L>
inline void load_matrix_sync(fragment<Use, M, N, K, T, L> &f, const float *p, unsigned ld)
{
    constexpr bool row = std::is_same<L, row_major>::value;
    __syncwarp();
    for (int r = 0; r < f.R; r++)
        for (int c = 0; c < f.C; c++)
            f.x[r * f.C + c] = row ? p[(size_t)r * ld + c] : p[(size_t)c * ld + r];
    __syncwarp();
}

template <int M, int N, int K>
inline void load_matrix_sync(fragment<accumulator, M, N, K, float> &f, const float *p, unsigned ld, layout_t l)
{
    __syncwarp();
    for (int r = 0; r < M; r++)
        for (int c = 0; c < N; c++)
            f.x[r * N + c] = l == mem_row_major ? p[(size_t)r * ld + c] : p[(size_t)c * ld + r];
    __syncwarp();
}

template <int M, int N, int K>
inline void store_matrix_sync(float *p, const fragment<accumulator, M, N, K, float> &f, unsigned ld, layout_t l)
{
    __syncwarp();
    for (int r = 0; r < M; r++)
        for (int c = 0; c < N; c++)
            (l == mem_row_major ? p[(size_t)r * ld + c] : p[(size_t)c * ld + r]) = f.x[r * N + c];
    __syncwarp();
}

template <typename F> inline void fill_fragment(F &f, float v)
{
    for (int t = 0; t < f.num_elements; t++)
        f.x[t] = v;
}

template <int M, int N, int K, typename TA, typename LA, typename TB, typename LB>
inline void mma_sync(fragment<accumulator, M, N, K, float> &d, const fragment<matrix_a, M, N, K, TA, LA> &a,
                     const fragment<matrix_b, M, N, K, TB, LB> &b, const fragment<accumulator, M, N, K, float> &c)
{
    float out[M * N];
    for (int r = 0; r < M; r++)
        for (int n = 0; n < N; n++) {
            float acc = c.x[r * N + n];
            for (int k = 0; k < K; k++)
                acc += a.x[r * K + k] * b.x[k * N + n];
            out[r * N + n] = acc;
        }
    memcpy(d.x, out, sizeof out);
}

inline float __float_to_tf32(float x)
{
    if (!std::isfinite(x))
        return x;
    uint32_t u;
    memcpy(&u, &x, 4);
    u = (u + 0x1000u) & 0xFFFFE000u;
    memcpy(&x, &u, 4);
    return x;
}
} /* namespace wmma */
} /* namespace nvcuda */

#endif
