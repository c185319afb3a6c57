/* moe.cu: the CUDA backend's mixture-of-experts ops (see dfl_moe_route in backend.h), with no
 * host round trip: the router's softmax and top-k fused in f32 (one warp per token), the
 * grouping by expert in three small kernels (count per expert, padded offsets, placement in
 * ascending token order: deterministic, no atomics; DFL_CUDA_MOE_ROUTE=1: the top-k counting
 * with integer atomics, then offsets and placement in one kernel; kernels/moe_route.cuh), a
 * row gather (dfl_moe_forward fuses it into
 * the gate|up GEMM instead), one grouped GEMM launch per projection over all experts (each row
 * tile belongs to one expert, found from the device offsets), and the weighted combine (adding qwen3_5_moe's gated shared expert; bf16 rows of a
 * multiple of 8 with 16-byte loads). The grouped GEMM: bf16 on a compute capability 9 device
 * with K a multiple of 64 and 16-byte aligned rows, Hopper's wgmma (kernels/moe_wgmma.cu,
 * DFL_CUDA_MOE_WTILE picks the tile shape; DFL_CUDA_MOE_WGMMA=0 in the environment selects the
 * next kernel instead), with the same fused forms; other bf16
 * with K a multiple of 32 and 16-byte aligned rows, mma.sync tiles with a cp.async pipeline
 * (kernels/moe_gemm.cuh; DFL_CUDA_MOE_TILE=0..4 in the environment picks the tile shape), which
 * also takes the fused forms (the gather of A's rows, SwiGLU in the epilogue); other bf16 with
 * K % 8 == 0 (or with DFL_CUDA_MOE_MMA=0), WMMA 64 x 64 tiles for the plain product and f32 SIMT
 * tiles for the fused forms; else (f32) SIMT tiles. Reference: lib/backends/be_cpu_moe.c. */
#include <math.h>
#include <stdlib.h>
#include <mma.h>

#include "be_cuda.cuh"
#include "dflash_ptx.cuh"
#include "moe_gemm.cuh"
#include "moe_route.cuh"
#include "moe_wgmma.cuh"

/* ---- routing ---- */

/* DFL_CUDA_MOE_ROUTE=1 in the environment: the two-kernel route (moe_topk_kernel counting,
 * then moe_place_fast_kernel); else the four-kernel one (top-k, count, offsets, place). The
 * two-kernel form is checked in the SIMT emulator (tests/emu/emu-route.cc: the CPU route's
 * results value for value) but not yet on a GPU, hence not the default. */
static bool moe_route_fast(void)
{
    const char *v = getenv("DFL_CUDA_MOE_ROUTE");
    return v && v[0] == '1' && !v[1];
}

int cuda_moe_route(dfl_be *be, const dfl_moe_route *r)
{
    if (r->T <= 0)
        return 0;
    if (r->E < 1 || r->E > MOE_MAX_E || r->k < 1 || r->k > r->E || r->k > MOE_MAX_K)
        return cuda_op_fail(be, DFL_EUNSUP, "moe_route: %d experts, top %d (at most %d, %d)", r->E,
                            r->k, MOE_MAX_E, MOE_MAX_K);
    int rc = cuda_enter(be);
    if (rc)
        return rc;
    cudaStream_t s = cuda_of(be)->stream;
    unsigned blocks = (unsigned)((r->T + 7) / 8);
    if (moe_route_fast()) {
        cudaError_t err = cudaMemsetAsync(r->counts, 0, sizeof(int32_t) * (size_t)r->E, s);
        if (err != cudaSuccess)
            return cuda_op_fail(be, DFL_EDEVICE, "moe_route: %s", cudaGetErrorString(err));
        moe_topk_kernel<<<blocks, 256, 0, s>>>(r->logits, r->T, r->E, r->k, r->norm_topk, r->idx,
                                               r->weight, r->counts);
        moe_place_fast_kernel<<<r->E, MP_THREADS, 0, s>>>(r->idx, r->T, r->k, r->counts, r->E,
                                                          r->offsets, r->rows, r->slot);
        return cuda_launch_check(be, "moe_route");
    }
    moe_topk_kernel<<<blocks, 256, 0, s>>>(r->logits, r->T, r->E, r->k, r->norm_topk, r->idx,
                                           r->weight, NULL);
    moe_count_kernel<<<r->E, 256, 0, s>>>(r->idx, r->T * r->k, r->counts);
    moe_offsets_kernel<<<1, 32, 0, s>>>(r->counts, r->E, r->offsets);
    moe_place_kernel<<<r->E, 256, 0, s>>>(r->idx, r->T, r->k, r->offsets, r->counts, r->rows,
                                          r->slot);
    return cuda_launch_check(be, "moe_route");
}

/* ---- gather ---- */

template <typename T>
__global__ void moe_gather_kernel(T *dst, const T *src, const int32_t *rows, const int32_t *offsets,
                                  int E, int64_t cap, int64_t H)
{
    int64_t n = offsets[E] < cap ? offsets[E] : cap;
    for (int64_t g = blockIdx.x; g < n; g += gridDim.x) {
        int32_t r = rows[g];
        T *d = dst + g * H;
        if (r >= 0) {
            const T *sr = src + (int64_t)r * H;
            for (int64_t i = threadIdx.x; i < H; i += blockDim.x)
                d[i] = sr[i];
        } else {
            for (int64_t i = threadIdx.x; i < H; i += blockDim.x)
                d[i] = from_f32<T>(0.0f);
        }
    }
}

int cuda_moe_gather(dfl_be *be, void *dst, const void *src, const int32_t *rows,
                               const int32_t *offsets, int E, int64_t cap, int64_t H)
{
    if (cap <= 0 || H <= 0)
        return 0;
    int rc = cuda_enter(be);
    if (rc)
        return rc;
    cudaStream_t s = cuda_of(be)->stream;
    unsigned blocks = (unsigned)(cap < 65535 ? cap : 65535);
    if (be->act == DFL_BF16)
        moe_gather_kernel<bf16><<<blocks, 256, 0, s>>>((bf16 *)dst, (const bf16 *)src, rows,
                                                       offsets, E, cap, H);
    else
        moe_gather_kernel<float><<<blocks, 256, 0, s>>>((float *)dst, (const float *)src, rows,
                                                        offsets, E, cap, H);
    return cuda_launch_check(be, "moe_gather");
}

/* ---- grouped GEMM ---- */

#define GM 64   /* rows of a tile: a divisor of DFL_MOE_PAD, so that a tile never spans two experts */
#define GN 64
#define GK 16
static_assert(DFL_MOE_PAD % GM == 0, "a tile of grouped rows must not span two experts");
static_assert(DFL_MOE_PAD % MgTile0::BM == 0 && DFL_MOE_PAD % MgTile1::BM == 0 &&
                  DFL_MOE_PAD % MgTile2::BM == 0 && DFL_MOE_PAD % MgTile3::BM == 0 &&
                  DFL_MOE_PAD % MgTile4::BM == 0,
              "a tile of grouped rows must not span two experts");
static_assert(MgTile0::SMEM <= 48 * 1024, "tile 0 runs without the shared-memory opt-in");

/* This block's tile: grouped rows from g0, output columns from n0, of expert e (the last e with
 * offsets[e] <= g0: empty experts share their offset with the next one), whose rows end at end
 * (padding after), and e's weights We. False when the tile is past the last expert's rows. */
template <typename T> struct MoeTile {
    int64_t g0, n0, end;
    const T *We;
};

template <typename T>
__device__ __forceinline__ bool moe_tile(const T *W, const int32_t *counts, const int32_t *offsets,
                                         int E, int64_t N, int64_t K, MoeTile<T> *t)
{
    t->g0 = (int64_t)blockIdx.x * GM;
    t->n0 = (int64_t)blockIdx.y * GN;
    if (t->g0 >= offsets[E])
        return false;
    int lo = moe_expert_of(offsets, E, t->g0);
    t->end = (int64_t)offsets[lo] + counts[lo];
    t->We = W + (int64_t)lo * N * K;
    return t->g0 < t->end;
}

/* C[g, :] = A[g, :] W_e^T for the grouped rows g of expert e (A row rows[g] when rows; with
 * swiglu, C [cap, N / 2] = silu(gate) * up of the act-rounded columns n and N / 2 + n). Block
 * (x, y): rows [x GM, x GM + GM) and output columns [y GN, y GN + GN); 256 threads, 4 x 4 outputs
 * each, f32. */
template <typename T>
__global__ void moe_mm_kernel(const T *A, const int32_t *rows, const T *W, T *C,
                              const int32_t *counts, const int32_t *offsets, int E, int64_t N,
                              int64_t K, bool swiglu)
{
    __shared__ float As[GK][GM + 4];
    __shared__ float Ws[GK][GN + 4];
    __shared__ float Us[GK][GN + 4];
    MoeTile<T> tl;
    if (!moe_tile(W, counts, offsets, E, N, K, &tl))
        return;
    const int64_t g0 = tl.g0, n0 = tl.n0, end = tl.end, Nc = swiglu ? N / 2 : N;
    const T *We = tl.We;
    int tx = threadIdx.x % 16, ty = threadIdx.x / 16;
    float acc[4][4] = {}, up[4][4] = {};
    for (int64_t k0 = 0; k0 < K; k0 += GK) {
        for (int i = threadIdx.x; i < GM * GK; i += 256) {
            int r = i / GK, c = i % GK;
            int64_t g = g0 + r, kk = k0 + c, n = n0 + r;
            int64_t ar = g < end && rows ? rows[g] : g;
            As[c][r] = g < end && kk < K ? to_f32(A[ar * K + kk]) : 0.0f;
            Ws[c][r] = n < Nc && kk < K ? to_f32(We[n * K + kk]) : 0.0f;
            if (swiglu)
                Us[c][r] = n < Nc && kk < K ? to_f32(We[(Nc + n) * K + kk]) : 0.0f;
        }
        __syncthreads();
#pragma unroll
        for (int c = 0; c < GK; c++) {
            float a[4], b[4], u[4];
#pragma unroll
            for (int q = 0; q < 4; q++) {
                a[q] = As[c][ty * 4 + q];
                b[q] = Ws[c][tx * 4 + q];
                u[q] = swiglu ? Us[c][tx * 4 + q] : 0.0f;
            }
#pragma unroll
            for (int p = 0; p < 4; p++)
#pragma unroll
                for (int q = 0; q < 4; q++) {
                    acc[p][q] += a[p] * b[q];
                    up[p][q] += a[p] * u[q];
                }
        }
        __syncthreads();
    }
#pragma unroll
    for (int p = 0; p < 4; p++) {
        int64_t g = g0 + ty * 4 + p;
        if (g >= end)
            continue;
#pragma unroll
        for (int q = 0; q < 4; q++) {
            int64_t n = n0 + tx * 4 + q;
            if (n >= Nc)
                continue;
            float v = acc[p][q];
            if (swiglu) { /* as swiglu does it, on the act-rounded gate and up */
                float gv = to_f32(from_f32<T>(v)), uv = to_f32(from_f32<T>(up[p][q]));
                v = gv / (1.0f + expf(-gv)) * uv;
            }
            C[g * Nc + n] = from_f32<T>(v);
        }
    }
}

/* The same on tensor cores for bf16 with K a multiple of 8 (16-byte row loads): 4 warps, each
 * a 32 x 32 quarter of the 64 x 64 tile as 2 x 2 WMMA 16x16x16 fragments, f32 accumulation,
 * K in steps of WK through shared memory; the tile goes out through shared memory so that
 * padding rows and columns past N are not stored. */
#define WK 32
#define WLD (WK + 8)      /* bf16 row stride of the shared tiles: 80 bytes */
#define CLD (GN + 4)      /* f32 row stride of the output tile */

__global__ void __launch_bounds__(128) moe_mm_wmma_kernel(const bf16 *A, const bf16 *W, bf16 *C,
                                                          const int32_t *counts,
                                                          const int32_t *offsets, int E,
                                                          int64_t N, int64_t K)
{
    using namespace nvcuda;
    __shared__ __align__(32) bf16 As[GM][WLD];
    __shared__ __align__(32) bf16 Bs[GN][WLD];
    __shared__ __align__(32) float Cs[GM][CLD];
    MoeTile<bf16> tl;
    if (!moe_tile(W, counts, offsets, E, N, K, &tl))
        return;
    const int64_t g0 = tl.g0, n0 = tl.n0, end = tl.end;
    const bf16 *We = tl.We;
    int warp = threadIdx.x >> 5, wm = (warp >> 1) * 32, wn = (warp & 1) * 32;
    wmma::fragment<wmma::accumulator, 16, 16, 16, float> acc[2][2];
#pragma unroll
    for (int i = 0; i < 2; i++)
#pragma unroll
        for (int j = 0; j < 2; j++)
            wmma::fill_fragment(acc[i][j], 0.0f);
    for (int64_t k0 = 0; k0 < K; k0 += WK) {
        /* 64 rows x WK columns of A and of W: 8-element (16-byte) pieces, zero outside */
        for (int v = threadIdx.x; v < GM * (WK / 8); v += blockDim.x) {
            int r = v / (WK / 8), c = (v % (WK / 8)) * 8;
            int64_t g = g0 + r, n = n0 + r, kk = k0 + c;
            uint4 a = make_uint4(0, 0, 0, 0), b = make_uint4(0, 0, 0, 0);
            if (g < end && kk < K)
                a = *(const uint4 *)(A + g * K + kk);
            if (n < N && kk < K)
                b = *(const uint4 *)(We + n * K + kk);
            *(uint4 *)&As[r][c] = a;
            *(uint4 *)&Bs[r][c] = b;
        }
        __syncthreads();
#pragma unroll
        for (int kk = 0; kk < WK; kk += 16) {
            wmma::fragment<wmma::matrix_a, 16, 16, 16, __nv_bfloat16, wmma::row_major> fa[2];
            wmma::fragment<wmma::matrix_b, 16, 16, 16, __nv_bfloat16, wmma::col_major> fb[2];
#pragma unroll
            for (int i = 0; i < 2; i++)
                wmma::load_matrix_sync(fa[i], &As[wm + 16 * i][kk], WLD);
#pragma unroll
            for (int j = 0; j < 2; j++) /* B(k, n) = W[n][k]: column-major with stride WLD */
                wmma::load_matrix_sync(fb[j], &Bs[wn + 16 * j][kk], WLD);
#pragma unroll
            for (int i = 0; i < 2; i++)
#pragma unroll
                for (int j = 0; j < 2; j++)
                    wmma::mma_sync(acc[i][j], fa[i], fb[j], acc[i][j]);
        }
        __syncthreads();
    }
#pragma unroll
    for (int i = 0; i < 2; i++)
#pragma unroll
        for (int j = 0; j < 2; j++)
            wmma::store_matrix_sync(&Cs[wm + 16 * i][wn + 16 * j], acc[i][j], CLD,
                                    wmma::mem_row_major);
    __syncthreads();
    for (int v = threadIdx.x; v < GM * GN; v += blockDim.x) {
        int r = v / GN, c = v % GN;
        int64_t g = g0 + r, n = n0 + c;
        if (g < end && n < N)
            C[g * N + n] = __float2bfloat16_rn(Cs[r][c]);
    }
}

/* The pipelined kernel (moe_gemm.cuh) is the default where its conditions hold (verified on the
 * H200 by gpu-families' moe ops, every tile plain and fused, and the MoE oracles);
 * DFL_CUDA_MOE_MMA=0 in the environment selects the WMMA kernel instead (the SIMT one for the
 * fused forms), to compare them. DFL_CUDA_MOE_TILE=0..4 picks the pipelined kernel's tile shape
 * (MgTile0..4), default MOE_TILE_DEFAULT: on the H200 (bench-ops --moe, Qwen3-30B-A3B block,
 * 16384 tokens) tile 2 took the fused gate|up in 2.749 ms (300 TFLOP/s) and down in 1.572 ms
 * (262), the whole block 4.708 ms; tiles 0, 1, 3, 4: 5.998, 5.160, 6.232, 5.913 ms. Read at
 * every call (a getenv is nothing beside a grouped GEMM), so that a test or a benchmark can run
 * them all. */
#define MOE_TILE_DEFAULT 2

static bool moe_mma_enabled(void)
{
    const char *v = getenv("DFL_CUDA_MOE_MMA");
    return !(v && v[0] == '0' && !v[1]);
}

/* The wgmma kernel (kernels/moe_wgmma.cu) is the default where it fits: on the H200 (bench-ops
 * --quick --moe, the Qwen3-30B-A3B block, 16384 tokens; tile 0) bit for bit the mma.sync
 * kernel's results in gpu-families (82 comparisons, plain and fused, every tile) and faster: the
 * fused gate|up 1.551 ms (532 TFLOP/s; mma.sync tile 2: 2.697 ms, 306), down 1.042 ms (396;
 * 1.524 ms, 271), dfl_moe_forward 3.081 ms against 4.667. DFL_CUDA_MOE_WGMMA=0 selects the
 * mma.sync kernel (as does DFL_CUDA_MOE_MMA=0, which goes on to the WMMA one). */
static bool moe_wgmma_enabled(void)
{
    const char *v = getenv("DFL_CUDA_MOE_WGMMA");
    return !(v && v[0] == '0' && !v[1]) && moe_mma_enabled();
}

static int moe_tile_choice(void)
{
    const char *v = getenv("DFL_CUDA_MOE_TILE");
    if (v && v[0] >= '0' && v[0] < '0' + MG_TILES && !v[1])
        return v[0] - '0';
    return MOE_TILE_DEFAULT;
}

template <class CF, bool G, bool S>
static cudaError_t moe_mma_launch(const dfl_moe_mm *m, cudaStream_t s)
{
    auto fn = moe_mm_mma_kernel<CF, G, S>;
    if (CF::SMEM > 48 * 1024) {
        cudaError_t err = cuda_allow_smem(fn, CF::SMEM);
        if (err != cudaSuccess)
            return err;
    }
    const int64_t Nc = S ? m->N / 2 : m->N, bn = S ? CF::BN / 2 : CF::BN;
    const dim3 grid((unsigned)((Nc + bn - 1) / bn), (unsigned)(m->cap / CF::BM));
    const bool pair = Nc % 2 == 0 && is_aligned(m->C, 4);
    fn<<<grid, CF::THREADS, CF::SMEM, s>>>((const bf16 *)m->A, m->rows, (const bf16 *)m->W,
                                           (bf16 *)m->C, m->counts, m->offsets, m->E, m->N, m->K,
                                           pair);
    return cudaSuccess;
}

template <class CF> static cudaError_t moe_mma_tile(const dfl_moe_mm *m, cudaStream_t s)
{
    if (m->rows)
        return m->swiglu ? moe_mma_launch<CF, true, true>(m, s)
                         : moe_mma_launch<CF, true, false>(m, s);
    return m->swiglu ? moe_mma_launch<CF, false, true>(m, s)
                     : moe_mma_launch<CF, false, false>(m, s);
}

int cuda_moe_matmul(dfl_be *be, const dfl_moe_mm *m)
{
    if (m->cap <= 0 || m->N <= 0)
        return 0;
    const int64_t Nc = m->swiglu ? m->N / 2 : m->N;
    if (m->cap % DFL_MOE_PAD || (m->swiglu && m->N % 2) || (Nc + GN - 1) / GN > 65535 ||
        m->cap / GM > INT32_MAX)
        return cuda_op_fail(be, DFL_EUNSUP, "moe_matmul: %lld rows, N %lld%s", (long long)m->cap,
                            (long long)m->N, m->swiglu ? " (SwiGLU: N must be even)" : "");
    int rc = cuda_enter(be);
    if (rc)
        return rc;
    cudaStream_t s = cuda_of(be)->stream;
    const bool fused = m->rows || m->swiglu;
    dim3 grid((unsigned)(m->cap / GM), (unsigned)((Nc + GN - 1) / GN));
    if (be->act == DFL_BF16 && moe_wgmma_enabled() &&
        cuda_moe_wgmma_fits(m, cuda_of(be)->device)) {
        cudaError_t err = cuda_moe_wgmma(m, s);
        if (err != cudaSuccess)
            return cuda_op_fail(be, DFL_EDEVICE, "moe_matmul: shared memory: %s",
                                cudaGetErrorString(err));
    } else if (be->act == DFL_BF16 && moe_mma_enabled() && m->K % MG_BK == 0 &&
               is_aligned(m->A, 16) && is_aligned(m->W, 16) && m->cap / 64 <= 65535) {
        cudaError_t err = cudaSuccess;
        switch (moe_tile_choice()) {
        case 0: err = moe_mma_tile<MgTile0>(m, s); break;
        case 1: err = moe_mma_tile<MgTile1>(m, s); break;
        case 2: err = moe_mma_tile<MgTile2>(m, s); break;
        case 3: err = moe_mma_tile<MgTile3>(m, s); break;
        default: err = moe_mma_tile<MgTile4>(m, s); break;
        }
        if (err != cudaSuccess)
            return cuda_op_fail(be, DFL_EDEVICE, "moe_matmul: shared memory: %s",
                                cudaGetErrorString(err));
    } else if (be->act == DFL_BF16 && !fused && m->K % 8 == 0 && is_aligned(m->A, 16) &&
               is_aligned(m->W, 16))
        moe_mm_wmma_kernel<<<grid, 128, 0, s>>>((const bf16 *)m->A, (const bf16 *)m->W,
                                                (bf16 *)m->C, m->counts, m->offsets, m->E, m->N,
                                                m->K);
    else if (be->act == DFL_BF16)
        moe_mm_kernel<bf16><<<grid, 256, 0, s>>>((const bf16 *)m->A, m->rows, (const bf16 *)m->W,
                                                 (bf16 *)m->C, m->counts, m->offsets, m->E,
                                                 m->N, m->K, m->swiglu);
    else
        moe_mm_kernel<float><<<grid, 256, 0, s>>>((const float *)m->A, m->rows,
                                                  (const float *)m->W, (float *)m->C, m->counts,
                                                  m->offsets, m->E, m->N, m->K, m->swiglu);
    return cuda_launch_check(be, "moe_matmul");
}

/* ---- combine ---- */

/* One block per token: out = (out) + sum_j w_j y[slot_j] (+ sigmoid(gate) shared: the gated
 * shared expert of qwen3_5_moe, fused here rather than another pass over out). */
template <typename T>
__global__ void moe_combine_kernel(T *out, const T *y, const int32_t *slot, const float *weight,
                                   int64_t T_, int k, int64_t H, bool accumulate, const T *shared,
                                   const float *shared_gate)
{
    for (int64_t t = blockIdx.x; t < T_; t += gridDim.x) {
        T *o = out + t * H;
        float g = shared ? 1.0f / (1.0f + expf(-shared_gate[t])) : 0.0f;
        for (int64_t i = threadIdx.x; i < H; i += blockDim.x) {
            float acc = accumulate ? to_f32(o[i]) : 0.0f;
            for (int j = 0; j < k; j++)
                acc += weight[t * k + j] * to_f32(y[(int64_t)slot[t * k + j] * H + i]);
            if (shared)
                acc += g * to_f32(shared[t * H + i]);
            o[i] = from_f32<T>(acc);
        }
    }
}

/* The same for bf16 with H % 8 == 0 and 16-byte aligned rows: 8 columns a thread, one 16-byte
 * load per row (the same f32 sums in the same order). */
__global__ void moe_combine_v8_kernel(bf16 *out, const bf16 *y, const int32_t *slot,
                                      const float *weight, int64_t T_, int k, int64_t H,
                                      bool accumulate, const bf16 *shared,
                                      const float *shared_gate)
{
    for (int64_t t = blockIdx.x; t < T_; t += gridDim.x) {
        bf16 *o = out + t * H;
        const int32_t *sl = slot + t * k;
        const float *wt = weight + t * k;
        const float g = shared ? 1.0f / (1.0f + expf(-shared_gate[t])) : 0.0f;
        for (int64_t c = (int64_t)threadIdx.x * 8; c < H; c += (int64_t)blockDim.x * 8) {
            float acc[8];
            uint4 v = accumulate ? *(const uint4 *)(o + c) : make_uint4(0, 0, 0, 0);
            uint32_t wv[4] = {v.x, v.y, v.z, v.w};
#pragma unroll
            for (int q = 0; q < 4; q++) {
                acc[2 * q] = df_bf_lo(wv[q]);
                acc[2 * q + 1] = df_bf_hi(wv[q]);
            }
            for (int j = 0; j < k; j++) {
                const float w = wt[j];
                const uint4 r = *(const uint4 *)(y + (int64_t)sl[j] * H + c);
                const uint32_t rv[4] = {r.x, r.y, r.z, r.w};
#pragma unroll
                for (int q = 0; q < 4; q++) {
                    acc[2 * q] += w * df_bf_lo(rv[q]);
                    acc[2 * q + 1] += w * df_bf_hi(rv[q]);
                }
            }
            if (shared) {
                const uint4 r = *(const uint4 *)(shared + t * H + c);
                const uint32_t rv[4] = {r.x, r.y, r.z, r.w};
#pragma unroll
                for (int q = 0; q < 4; q++) {
                    acc[2 * q] += g * df_bf_lo(rv[q]);
                    acc[2 * q + 1] += g * df_bf_hi(rv[q]);
                }
            }
            *(uint4 *)(o + c) = make_uint4(df_pack(acc[0], acc[1]), df_pack(acc[2], acc[3]),
                                           df_pack(acc[4], acc[5]), df_pack(acc[6], acc[7]));
        }
    }
}

int cuda_moe_combine(dfl_be *be, void *out, const void *y, const int32_t *slot,
                                const float *weight, int64_t T, int k, int64_t H, bool accumulate,
                                const void *shared, const float *shared_gate)
{
    if (T <= 0 || H <= 0)
        return 0;
    int rc = cuda_enter(be);
    if (rc)
        return rc;
    cudaStream_t s = cuda_of(be)->stream;
    unsigned blocks = (unsigned)(T < 65535 ? T : 65535);
    if (be->act == DFL_BF16 && H % 8 == 0 && is_aligned(out, 16) && is_aligned(y, 16) &&
        (!shared || is_aligned(shared, 16))) {
        int64_t th = (H / 8 + 31) / 32 * 32;
        moe_combine_v8_kernel<<<blocks, (unsigned)(th < 256 ? th : 256), 0, s>>>(
            (bf16 *)out, (const bf16 *)y, slot, weight, T, k, H, accumulate, (const bf16 *)shared,
            shared_gate);
    } else if (be->act == DFL_BF16)
        moe_combine_kernel<bf16><<<blocks, 256, 0, s>>>((bf16 *)out, (const bf16 *)y, slot, weight,
                                                        T, k, H, accumulate, (const bf16 *)shared,
                                                        shared_gate);
    else
        moe_combine_kernel<float><<<blocks, 256, 0, s>>>((float *)out, (const float *)y, slot,
                                                         weight, T, k, H, accumulate,
                                                         (const float *)shared, shared_gate);
    return cuda_launch_check(be, "moe_combine");
}
