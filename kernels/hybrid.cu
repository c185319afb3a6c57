/* hybrid.cu: the CUDA backend's ops for hybrid targets (Qwen3.5 / Qwen3.6: Gated DeltaNet and
 * gated full attention): zero-centred RMSNorm, per-head q/k norm with partial RoPE, the sigmoid
 * output gate, the per-sequence causal conv1d + SiLU, L2 norm, gated RMSNorm and the chunked
 * gated delta rule. T is the activation type (bf16 or f32); arithmetic is f32 with one rounding
 * per output, as the CPU reference (lib/backends/be_cpu_hybrid.c). */
#include <math.h>
#include <mma.h>

#include "be_cuda.cuh"

#define HY_THREADS 256
#define HY_WARPS (HY_THREADS / 32)

__device__ __forceinline__ float hy_warp_sum(float v)
{
#pragma unroll
    for (int o = 16; o > 0; o >>= 1)
        v += __shfl_xor_sync(0xffffffffu, v, o);
    return v;
}

__device__ __forceinline__ float hy_sigmoid(float x) { return 1.0f / (1.0f + expf(-x)); }
__device__ __forceinline__ float hy_silu(float x) { return x / (1.0f + expf(-x)); }
__device__ __forceinline__ float hy_softplus(float x) { return x > 20.0f ? x : log1pf(expf(x)); }

static inline unsigned warp_blocks(int64_t warps) { return (unsigned)((warps + HY_WARPS - 1) / HY_WARPS); }

/* ---- zero-centred RMSNorm: one block per row ---- */

template <typename T>
__global__ void rmsnorm_1p_kernel(T *y, const T *x, const T *w, int64_t n, float eps)
{
    __shared__ float part[HY_WARPS];
    int64_t r = blockIdx.x;
    const T *xr = x + r * n;
    float ss = 0.0f;
    for (int64_t i = threadIdx.x; i < n; i += blockDim.x) {
        float f = to_f32(xr[i]);
        ss += f * f;
    }
    ss = hy_warp_sum(ss);
    if ((threadIdx.x & 31) == 0)
        part[threadIdx.x >> 5] = ss;
    __syncthreads();
    float tot = 0.0f;
#pragma unroll
    for (int i = 0; i < HY_WARPS; i++)
        tot += part[i];
    float s = 1.0f / sqrtf(tot / (float)n + eps);
    T *yr = y + r * n;
    for (int64_t i = threadIdx.x; i < n; i += blockDim.x)
        yr[i] = from_f32<T>((to_f32(xr[i]) * s) * (1.0f + to_f32(w[i])));
}

int cuda_rmsnorm_1p(dfl_be *be, void *y, const void *x, const void *w, int64_t R, int64_t n,
                    float eps)
{
    if (R <= 0 || n <= 0)
        return 0;
    if (R > INT32_MAX)
        return cuda_op_fail(be, DFL_EUNSUP, "rmsnorm_1p: %lld rows is too many", (long long)R);
    int rc = cuda_enter(be);
    if (rc)
        return rc;
    cudaStream_t s = cuda_of(be)->stream;
    if (be->act == DFL_BF16)
        rmsnorm_1p_kernel<bf16><<<(unsigned)R, HY_THREADS, 0, s>>>((bf16 *)y, (const bf16 *)x,
                                                                   (const bf16 *)w, n, eps);
    else
        rmsnorm_1p_kernel<float><<<(unsigned)R, HY_THREADS, 0, s>>>((float *)y, (const float *)x,
                                                                    (const float *)w, n, eps);
    return cuda_launch_check(be, "rmsnorm_1p");
}

/* ---- per-head ops: one warp per (row, head) ---- */

/* Zero-centred norm of each head, then rotate-half RoPE on its first rot dims. */
template <typename T>
__global__ void qknorm_rope_partial_kernel(T *x, int64_t ld, const T *w, const int32_t *pos,
                                           const float *inv_freq, int64_t R, int heads, int d,
                                           int rot, float eps)
{
    int64_t gw = (int64_t)blockIdx.x * HY_WARPS + (threadIdx.x >> 5);
    if (gw >= R * heads)
        return;
    int lane = threadIdx.x & 31;
    int64_t r = gw / heads;
    T *v = x + r * ld + (int64_t)(gw % heads) * d;
    float ss = 0.0f;
    for (int i = lane; i < d; i += 32) {
        float f = to_f32(v[i]);
        ss += f * f;
    }
    ss = hy_warp_sum(ss);
    float s = 1.0f / sqrtf(ss / (float)d + eps), fp = (float)pos[r];
    int half = rot / 2;
    for (int i = lane; i < half; i += 32) {
        float x1 = (to_f32(v[i]) * s) * (1.0f + to_f32(w[i]));
        float x2 = (to_f32(v[i + half]) * s) * (1.0f + to_f32(w[i + half]));
        float c = cosf(fp * inv_freq[i]), sn = sinf(fp * inv_freq[i]);
        v[i] = from_f32<T>(x1 * c - x2 * sn);
        v[i + half] = from_f32<T>(x2 * c + x1 * sn);
    }
    for (int i = rot + lane; i < d; i += 32)
        v[i] = from_f32<T>((to_f32(v[i]) * s) * (1.0f + to_f32(w[i])));
}

int cuda_qknorm_rope_partial(dfl_be *be, void *x, int64_t ld, const void *w, const int32_t *pos,
                             int64_t R, int heads, int d, int rot, float eps, float theta)
{
    if (R <= 0 || heads <= 0)
        return 0;
    if (rot < 0 || rot % 2 || rot > d || rot > 2 * CUDA_ROPE_MAXHALF)
        return cuda_op_fail(be, DFL_EUNSUP, "qknorm_rope_partial: %d rotary dims of head dim %d "
                            "(even, at most %d)", rot, d, 2 * CUDA_ROPE_MAXHALF);
    int rc = cuda_enter(be);
    if (rc)
        return rc;
    const float *inv = NULL;
    if (rot && (rc = cuda_rope_table(be, theta, rot, &inv)))
        return rc;
    cudaStream_t s = cuda_of(be)->stream;
    unsigned nb = warp_blocks(R * heads);
    if (be->act == DFL_BF16)
        qknorm_rope_partial_kernel<bf16><<<nb, HY_THREADS, 0, s>>>((bf16 *)x, ld, (const bf16 *)w,
                                                                   pos, inv, R, heads, d, rot, eps);
    else
        qknorm_rope_partial_kernel<float><<<nb, HY_THREADS, 0, s>>>((float *)x, ld, (const float *)w,
                                                                    pos, inv, R, heads, d, rot, eps);
    return cuda_launch_check(be, "qknorm_rope_partial");
}

/* x = x / sqrt(sum x^2 + eps) * scale per head */
template <typename T>
__global__ void l2norm_kernel(T *x, int64_t ld, int64_t R, int heads, int d, float scale, float eps)
{
    int64_t gw = (int64_t)blockIdx.x * HY_WARPS + (threadIdx.x >> 5);
    if (gw >= R * heads)
        return;
    int lane = threadIdx.x & 31;
    T *v = x + (gw / heads) * ld + (int64_t)(gw % heads) * d;
    float ss = 0.0f;
    for (int i = lane; i < d; i += 32) {
        float f = to_f32(v[i]);
        ss += f * f;
    }
    float s = 1.0f / sqrtf(hy_warp_sum(ss) + eps);
    for (int i = lane; i < d; i += 32)
        v[i] = from_f32<T>(to_f32(v[i]) * s * scale);
}

int cuda_l2norm(dfl_be *be, void *x, int64_t ld, int64_t R, int heads, int d, float scale, float eps)
{
    if (R <= 0 || heads <= 0 || d <= 0)
        return 0;
    int rc = cuda_enter(be);
    if (rc)
        return rc;
    cudaStream_t s = cuda_of(be)->stream;
    unsigned nb = warp_blocks(R * heads);
    if (be->act == DFL_BF16)
        l2norm_kernel<bf16><<<nb, HY_THREADS, 0, s>>>((bf16 *)x, ld, R, heads, d, scale, eps);
    else
        l2norm_kernel<float><<<nb, HY_THREADS, 0, s>>>((float *)x, ld, R, heads, d, scale, eps);
    return cuda_launch_check(be, "l2norm");
}

/* x = w * rmsnorm(x) * silu(z) per head */
template <typename T>
__global__ void gated_rmsnorm_kernel(T *x, int64_t ldx, const T *z, int64_t ldz, const T *w,
                                     int64_t R, int heads, int d, float eps)
{
    int64_t gw = (int64_t)blockIdx.x * HY_WARPS + (threadIdx.x >> 5);
    if (gw >= R * heads)
        return;
    int lane = threadIdx.x & 31;
    int64_t r = gw / heads, h = gw % heads;
    T *v = x + r * ldx + h * d;
    const T *zr = z + r * ldz + h * d;
    float ss = 0.0f;
    for (int i = lane; i < d; i += 32) {
        float f = to_f32(v[i]);
        ss += f * f;
    }
    float s = 1.0f / sqrtf(hy_warp_sum(ss) / (float)d + eps);
    for (int i = lane; i < d; i += 32)
        v[i] = from_f32<T>(to_f32(w[i]) * (to_f32(v[i]) * s) * hy_silu(to_f32(zr[i])));
}

int cuda_gated_rmsnorm(dfl_be *be, void *x, int64_t ldx, const void *z, int64_t ldz, const void *w,
                       int64_t R, int heads, int d, float eps)
{
    if (R <= 0 || heads <= 0 || d <= 0)
        return 0;
    int rc = cuda_enter(be);
    if (rc)
        return rc;
    cudaStream_t s = cuda_of(be)->stream;
    unsigned nb = warp_blocks(R * heads);
    if (be->act == DFL_BF16)
        gated_rmsnorm_kernel<bf16><<<nb, HY_THREADS, 0, s>>>((bf16 *)x, ldx, (const bf16 *)z, ldz,
                                                             (const bf16 *)w, R, heads, d, eps);
    else
        gated_rmsnorm_kernel<float><<<nb, HY_THREADS, 0, s>>>((float *)x, ldx, (const float *)z, ldz,
                                                              (const float *)w, R, heads, d, eps);
    return cuda_launch_check(be, "gated_rmsnorm");
}

/* ---- elementwise: the sigmoid gate and the conv ---- */

template <typename T>
__global__ void sigmoid_mul_kernel(T *x, int64_t ldx, const T *g, int64_t ldg, int64_t R, int64_t n)
{
    for (int64_t i = (int64_t)blockIdx.x * blockDim.x + threadIdx.x; i < R * n;
         i += (int64_t)gridDim.x * blockDim.x) {
        int64_t r = i / n, c = i % n;
        x[r * ldx + c] = from_f32<T>(to_f32(x[r * ldx + c]) * hy_sigmoid(to_f32(g[r * ldg + c])));
    }
}

int cuda_sigmoid_mul(dfl_be *be, void *x, int64_t ldx, const void *g, int64_t ldg, int64_t R,
                     int64_t n)
{
    if (R <= 0 || n <= 0)
        return 0;
    int rc = cuda_enter(be);
    if (rc)
        return rc;
    cudaStream_t s = cuda_of(be)->stream;
    unsigned nb = grid_for(R * n, HY_THREADS, cuda_of(be)->sm_count * 32);
    if (be->act == DFL_BF16)
        sigmoid_mul_kernel<bf16><<<nb, HY_THREADS, 0, s>>>((bf16 *)x, ldx, (const bf16 *)g, ldg, R, n);
    else
        sigmoid_mul_kernel<float><<<nb, HY_THREADS, 0, s>>>((float *)x, ldx, (const float *)g, ldg, R, n);
    return cuda_launch_check(be, "sigmoid_mul");
}

/* One thread per (token, channel); the window stops at the start of the token's sequence. */
template <typename T>
__global__ void conv1d_silu_kernel(T *y, int64_t ldy, const T *x, int64_t ldx, const T *w,
                                   const int32_t *pos, int64_t Tn, int64_t C, int K)
{
    for (int64_t i = (int64_t)blockIdx.x * blockDim.x + threadIdx.x; i < Tn * C;
         i += (int64_t)gridDim.x * blockDim.x) {
        int64_t t = i / C, c = i % C;
        int back = pos[t] < K - 1 ? pos[t] : K - 1;
        float acc = 0.0f;
        for (int j = 0; j <= back; j++)
            acc += to_f32(w[c * K + (K - 1 - j)]) * to_f32(x[(t - j) * ldx + c]);
        y[t * ldy + c] = from_f32<T>(hy_silu(acc));
    }
}

int cuda_conv1d_silu(dfl_be *be, void *y, int64_t ldy, const void *x, int64_t ldx, const void *w,
                     const int32_t *pos, int64_t T_, int64_t C, int K)
{
    if (T_ <= 0 || C <= 0)
        return 0;
    int rc = cuda_enter(be);
    if (rc)
        return rc;
    cudaStream_t s = cuda_of(be)->stream;
    unsigned nb = grid_for(T_ * C, HY_THREADS, cuda_of(be)->sm_count * 32);
    if (be->act == DFL_BF16)
        conv1d_silu_kernel<bf16><<<nb, HY_THREADS, 0, s>>>((bf16 *)y, ldy, (const bf16 *)x, ldx,
                                                           (const bf16 *)w, pos, T_, C, K);
    else
        conv1d_silu_kernel<float><<<nb, HY_THREADS, 0, s>>>((float *)y, ldy, (const float *)x, ldx,
                                                            (const float *)w, pos, T_, C, K);
    return cuda_launch_check(be, "conv1d_silu");
}

/* ---- the chunked gated delta rule ----
 * One block per (sequence, value head, slice of GD_DVB value columns): the columns of the state
 * evolve independently (each only reads its own columns of v), so a slice carries its own
 * S [dk, GD_DVB] in shared memory through the chunks of its sequence; the key-side work of a
 * chunk (A, Aqk) is recomputed by each slice. Per chunk of L <= 64 tokens (the CPU op's comment
 * has the algebra):
 *   a. K, Q rows, the V slice and the gates into shared memory; cumulative log-decay cg
 *   b. A = strict-lower(beta_i k_i.k_j exp(cg_i - cg_j)), Aqk = lower(q_i.k_j exp(cg_i - cg_j)),
 *      KS = K S
 *   c. U = beta (V - exp(cg) KS)
 *   d. warp 0 solves (I + A) Vn = U by forward substitution (lane = column); the other warps
 *      compute O = exp(cg) Q S meanwhile
 *   e. O += Aqk Vn (written out); S = exp(cg_L) S + K^T diag(exp(cg_L - cg)) Vn */

#define GD_C 64
#define GD_DVB 32
#define GD_MAX_DK 256

static size_t gd_smem(int dk)
{
    int dkp = dk + 1;
    return sizeof(float) * ((size_t)2 * GD_C * dkp + (size_t)dk * GD_DVB + 2 * (size_t)GD_C * (GD_C + 1) +
                            2 * (size_t)GD_C * GD_DVB + 3 * GD_C);
}

template <typename T>
__global__ void __launch_bounds__(HY_THREADS)
gated_delta_kernel(const T *q, const T *k, int64_t ldqk, const T *v, int64_t ldv, const T *a,
                   const T *b, int64_t ldab, const float *A_log, const float *dt_bias, T *o,
                   int64_t ldo, const int32_t *cu, int Hv, int ratio, int dk)
{
    extern __shared__ float sm[];
    const int dkp = dk + 1;
    float *Ks = sm;                              /* [C][dkp] */
    float *Qs = Ks + GD_C * dkp;                 /* [C][dkp] */
    float *S = Qs + GD_C * dkp;                  /* [dk][DVB] */
    float *A = S + dk * GD_DVB;                  /* [C][C+1] */
    float *Aqk = A + GD_C * (GD_C + 1);          /* [C][C+1] */
    float *U = Aqk + GD_C * (GD_C + 1);          /* [C][DVB]: V, then U, then Vn */
    float *W = U + GD_C * GD_DVB;                /* [C][DVB]: KS, then O */
    float *cg = W + GD_C * GD_DVB;               /* [C] */
    float *beta = cg + GD_C;                     /* [C] */
    float *gr = beta + GD_C;                     /* [C] raw g */
    const int tid = threadIdx.x, lane = tid & 31, warp = tid >> 5;
    const int s = blockIdx.x / Hv, j = blockIdx.x % Hv, kh = j / ratio;
    const int c0v = blockIdx.y * GD_DVB;          /* first value column of the slice */
    const int64_t t0 = cu[s], n = cu[s + 1] - t0;
    const float Alog = A_log[j], dtb = dt_bias[j];
    for (int i = tid; i < dk * GD_DVB; i += HY_THREADS)
        S[i] = 0.0f;
    for (int64_t base = t0; base < t0 + n; base += GD_C) {
        const int L = (int)(t0 + n - base < GD_C ? t0 + n - base : GD_C);
        /* a */
        for (int i = tid; i < L * dk; i += HY_THREADS) {
            int r = i / dk, x = i % dk;
            int64_t row = (base + r) * ldqk + (int64_t)kh * dk + x;
            Ks[r * dkp + x] = to_f32(k[row]);
            Qs[r * dkp + x] = to_f32(q[row]);
        }
        for (int i = tid; i < L * GD_DVB; i += HY_THREADS) {
            int r = i / GD_DVB, c = i % GD_DVB;
            U[i] = to_f32(v[(base + r) * ldv + (int64_t)j * (gridDim.y * GD_DVB) + c0v + c]);
        }
        if (tid < L) {
            int64_t row = (base + tid) * ldab + j;
            gr[tid] = -expf(Alog) * hy_softplus(to_f32(a[row]) + dtb);
            beta[tid] = hy_sigmoid(to_f32(b[row]));
        }
        __syncthreads();
        if (tid == 0) {
            float acc = 0.0f;
            for (int i = 0; i < L; i++) {
                acc += gr[i];
                cg[i] = acc;
            }
        }
        __syncthreads();
        /* b */
        for (int e = tid; e < L * L; e += HY_THREADS) {
            int i = e / L, m = e % L;
            float kk = 0.0f, qk = 0.0f;
            if (m <= i) {
                const float *ki = Ks + i * dkp, *km = Ks + m * dkp, *qi = Qs + i * dkp;
                for (int x = 0; x < dk; x++) {
                    kk += ki[x] * km[x];
                    qk += qi[x] * km[x];
                }
            }
            float dec = m <= i ? expf(cg[i] - cg[m]) : 0.0f;
            A[i * (GD_C + 1) + m] = m < i ? beta[i] * kk * dec : 0.0f;
            Aqk[i * (GD_C + 1) + m] = qk * dec;
        }
        for (int e = tid; e < L * GD_DVB; e += HY_THREADS) {
            int i = e / GD_DVB, c = e % GD_DVB;
            const float *ki = Ks + i * dkp;
            float acc = 0.0f;
            for (int x = 0; x < dk; x++)
                acc += ki[x] * S[x * GD_DVB + c];
            W[e] = acc;
        }
        __syncthreads();
        /* c */
        for (int e = tid; e < L * GD_DVB; e += HY_THREADS) {
            int i = e / GD_DVB;
            U[e] = beta[i] * (U[e] - expf(cg[i]) * W[e]);
        }
        if (tid < L)
            gr[tid] = expf(cg[L - 1] - cg[tid]); /* the raw g is no longer needed */
        __syncthreads();
        /* d */
        if (warp == 0) {
            for (int i = 1; i < L; i++) {
                float acc = U[i * GD_DVB + lane];
                const float *Ai = A + i * (GD_C + 1);
                for (int m = 0; m < i; m++)
                    acc -= Ai[m] * U[m * GD_DVB + lane];
                U[i * GD_DVB + lane] = acc;
                __syncwarp();
            }
        } else {
            for (int e = tid - 32; e < L * GD_DVB; e += HY_THREADS - 32) {
                int i = e / GD_DVB, c = e % GD_DVB;
                const float *qi = Qs + i * dkp;
                float acc = 0.0f;
                for (int x = 0; x < dk; x++)
                    acc += qi[x] * S[x * GD_DVB + c];
                W[e] = expf(cg[i]) * acc;
            }
        }
        __syncthreads();
        /* e */
        for (int e = tid; e < L * GD_DVB; e += HY_THREADS) {
            int i = e / GD_DVB, c = e % GD_DVB;
            const float *Ai = Aqk + i * (GD_C + 1);
            float acc = W[e];
            for (int m = 0; m <= i; m++)
                acc += Ai[m] * U[m * GD_DVB + c];
            o[(base + i) * ldo + (int64_t)j * (gridDim.y * GD_DVB) + c0v + c] = from_f32<T>(acc);
        }
        const float eL = expf(cg[L - 1]);
        for (int e = tid; e < dk * GD_DVB; e += HY_THREADS) {
            int x = e / GD_DVB, c = e % GD_DVB;
            float acc = eL * S[e];
            for (int i = 0; i < L; i++)
                acc += Ks[i * dkp + x] * gr[i] * U[i * GD_DVB + c];
            S[e] = acc;
        }
        __syncthreads();
    }
}

/* ---- the chunked gated delta rule on tensor cores (bf16 activations) ----
 * One block of GT_WARPS warps per (sequence, value head, slice of GT_DVB = 64 value columns),
 * the state slice S [DK, 64] in f32: the master copy in the warps' accumulator fragments, a copy
 * in shared memory as the operand of the next chunk's products. Per chunk of L <= 64 tokens
 * (rows past L are zero, with g = 0 and beta = 0, so every product runs on full 64-row tiles):
 *   a. K, Q rows (all DK columns), the V slice, g and beta into shared memory (f32; fetched into
 *      registers with 16-byte loads while the previous chunk ran its step f); cg = cumsum g,
 *      dec_i = exp(cg_last - cg_i)
 *   b. tensor cores: K K^T and Q K^T (lower 16 x 16 tiles), KS = K S, QS = Q S
 *   c. A = strict-lower(beta_i kk exp(cg_i - cg_j)), Aqk = lower(qk exp(cg_i - cg_j)),
 *      U = beta (V - exp(cg) KS), O = exp(cg) QS, K rows scaled by dec
 *   d. T = (I + A)^-1 by 16 x 16 blocks: the four diagonal blocks by forward substitution (one
 *      thread per column), then T_ij = -T_ii sum_{j <= m < i} A_im T_mj by distance i - j
 *   e. tensor cores: Vn = T U
 *   f. tensor cores: O += Aqk Vn; S = exp(cg_last) S + (dec K)^T Vn
 *   g. O rows < L written out (one rounding to bf16)
 * All products are TF32 (10-bit mantissa operands, f32 accumulation), the rest f32: the same
 * algebra as the SIMT kernel above and the CPU's gdn_chunked. */

#define GT_C 64
#define GT_DVB 64
#define GT_LC (GT_C + 4)   /* row stride of the [64][64] tiles (floats) */
#define GT_WARPS 8
#define GT_THREADS (GT_WARPS * 32)

namespace gtw = nvcuda::wmma;
typedef gtw::fragment<gtw::accumulator, 16, 16, 8, float> gt_acc;

template <typename L> struct gt_is_row { static constexpr bool v = false; };
template <> struct gt_is_row<gtw::row_major> { static constexpr bool v = true; };

/* A TF32 operand fragment loaded from shared memory (f32) and rounded to TF32. */
template <typename F>
__device__ __forceinline__ void gt_load(F &f, const float *p, int ld)
{
    gtw::load_matrix_sync(f, p, ld);
#pragma unroll
    for (int t = 0; t < f.num_elements; t++)
        f.x[t] = gtw::__float_to_tf32(f.x[t]);
}

/* acc += A [16, K] B [K, 16]; a and b point at the tiles' (0, 0) elements; LA / LB the layouts
 * (row_major A: a[m * lda + k]; col_major A: a[k * lda + m]; row_major B: b[k * ldb + n];
 * col_major B: b[n * ldb + k]). Operands rounded to TF32. */
template <typename LA, typename LB>
__device__ __forceinline__ void gt_mma(gt_acc &acc, const float *a, int lda, const float *b, int ldb,
                                       int K)
{
    gtw::fragment<gtw::matrix_a, 16, 16, 8, gtw::precision::tf32, LA> fa;
    gtw::fragment<gtw::matrix_b, 16, 16, 8, gtw::precision::tf32, LB> fb;
#pragma unroll 4
    for (int k0 = 0; k0 < K; k0 += 8) {
        gt_load(fa, gt_is_row<LA>::v ? a + k0 : a + (size_t)k0 * lda, lda);
        gt_load(fb, gt_is_row<LB>::v ? b + (size_t)k0 * ldb : b + k0, ldb);
        gtw::mma_sync(acc, fa, fb, acc);
    }
}

/* acc += A [16, 8] B [8, 16], A row-major at a (lda), B a loaded TF32 fragment. */
template <typename FB>
__device__ __forceinline__ void gt_mma_a(gt_acc &acc, const float *a, int lda, const FB &fb)
{
    gtw::fragment<gtw::matrix_a, 16, 16, 8, gtw::precision::tf32, gtw::row_major> fa;
    gt_load(fa, a, lda);
    gtw::mma_sync(acc, fa, fb, acc);
}

/* The idx-th 16 x 16 tile of a 64 x 64 lower triangle (row-major order of tiles). */
__device__ __forceinline__ void gt_lower(int idx, int *ti, int *tj)
{
    int r = 0;
    while ((r + 1) * (r + 2) / 2 <= idx)
        r++;
    *ti = r;
    *tj = idx - r * (r + 1) / 2;
}

/* One chunk's inputs of a block in registers, fetched with 16-byte loads (8 bf16): NK vectors of
 * K and of Q and NV of the V slice per thread, and thread t < 64 the gate inputs of row t. Rows
 * past the sequence's end are zero (g and beta 0). */
template <int DK> struct gt_regs {
    static constexpr int NK = GT_C * DK / 8 / GT_THREADS, NV = GT_C * GT_DVB / 8 / GT_THREADS;
    uint4 k[NK], q[NK], v[NV];
    float a, b;
    bool gate; /* row tid < L: a and b are real */
};

template <int DK>
__device__ __forceinline__ void gt_fetch(gt_regs<DK> &R, const bf16 *q, const bf16 *k, int64_t ldqk,
                                         const bf16 *v, int64_t ldv, const bf16 *a, const bf16 *b,
                                         int64_t ldab, int64_t base, int L, int kh, int64_t col0, int j)
{
    const int tid = threadIdx.x;
    const uint4 z = make_uint4(0, 0, 0, 0);
#pragma unroll
    for (int u = 0; u < gt_regs<DK>::NK; u++) {
        int i = tid + u * GT_THREADS, r = i / (DK / 8), x = (i % (DK / 8)) * 8;
        int64_t at = (base + r) * ldqk + (int64_t)kh * DK + x;
        R.k[u] = r < L ? *(const uint4 *)(k + at) : z;
        R.q[u] = r < L ? *(const uint4 *)(q + at) : z;
    }
#pragma unroll
    for (int u = 0; u < gt_regs<DK>::NV; u++) {
        int i = tid + u * GT_THREADS, r = i / (GT_DVB / 8), c = (i % (GT_DVB / 8)) * 8;
        R.v[u] = r < L ? *(const uint4 *)(v + (base + r) * ldv + col0 + c) : z;
    }
    R.gate = tid < L;
    R.a = R.b = 0.0f;
    if (R.gate) {
        R.a = to_f32(a[(base + tid) * ldab + j]);
        R.b = to_f32(b[(base + tid) * ldab + j]);
    }
}

/* 8 bf16 of a 16-byte vector as f32 at dst (16-byte aligned). */
__device__ __forceinline__ void gt_put8(float *dst, uint4 x)
{
    const __nv_bfloat162 *h = (const __nv_bfloat162 *)&x;
    float2 f0 = __bfloat1622float2(h[0]), f1 = __bfloat1622float2(h[1]);
    float2 f2 = __bfloat1622float2(h[2]), f3 = __bfloat1622float2(h[3]);
    ((float4 *)dst)[0] = make_float4(f0.x, f0.y, f1.x, f1.y);
    ((float4 *)dst)[1] = make_float4(f2.x, f2.y, f3.x, f3.y);
}

template <int DK>
static size_t gt_smem(void)
{
    return sizeof(float) * ((size_t)2 * GT_C * (DK + 4) + (size_t)DK * GT_LC + 6 * (size_t)GT_C * GT_LC +
                            3 * 256 + 4 * GT_C);
}

template <int DK>
__global__ void __launch_bounds__(GT_THREADS)
gated_delta_tc_kernel(const bf16 *q, const bf16 *k, int64_t ldqk, const bf16 *v, int64_t ldv,
                      const bf16 *a, const bf16 *b, int64_t ldab, const float *A_log,
                      const float *dt_bias, bf16 *o, int64_t ldo, const int32_t *cu, int Hv, int ratio,
                      int dv)
{
    constexpr int LK = DK + 4, LC = GT_LC;
    constexpr int NST = (DK / 16) * (GT_DVB / 16) / GT_WARPS; /* state tiles per warp */
    static_assert(NST * GT_WARPS == (DK / 16) * (GT_DVB / 16), "state tiles per warp");
    extern __shared__ __align__(128) float gsm[];
    float *Ks = gsm;                     /* [C][LK] */
    float *Qs = Ks + GT_C * LK;          /* [C][LK] */
    float *S = Qs + GT_C * LK;           /* [DK][LC] */
    float *U = S + DK * LC;              /* [C][LC]: V, then U */
    float *A = U + GT_C * LC;            /* [C][LC]: K K^T, then A */
    float *Aqk = A + GT_C * LC;          /* [C][LC] */
    float *Tm = Aqk + GT_C * LC;         /* [C][LC]: (I + A)^-1 (the lower blocks) */
    float *Vn = Tm + GT_C * LC;          /* [C][LC]: KS, then Vn */
    float *O = Vn + GT_C * LC;           /* [C][LC]: QS, then the output */
    float *X = O + GT_C * LC;            /* [3][16][16] */
    float *cg = X + 3 * 256, *beta = cg + GT_C, *dec = beta + GT_C, *ecg = dec + GT_C; /* [C] each */
    const int tid = threadIdx.x, lane = tid & 31, warp = tid >> 5;
    const int s = blockIdx.x / Hv, j = blockIdx.x % Hv, kh = j / ratio;
    const int64_t col0 = (int64_t)j * dv + (int64_t)blockIdx.y * GT_DVB; /* first value column */
    const int64_t t0 = cu[s], n = cu[s + 1] - t0;
    const float Alog = A_log[j], dtb = dt_bias[j];
    gt_acc Sacc[NST];
#pragma unroll
    for (int w = 0; w < NST; w++) {
        gtw::fill_fragment(Sacc[w], 0.0f);
        int ts = warp + w * GT_WARPS, ti = ts / (GT_DVB / 16), tj = ts % (GT_DVB / 16);
        gtw::store_matrix_sync(S + ti * 16 * LC + tj * 16, Sacc[w], LC, gtw::mem_row_major);
    }
    gt_regs<DK> R;
    if (n > 0)
        gt_fetch<DK>(R, q, k, ldqk, v, ldv, a, b, ldab, t0, (int)(n < GT_C ? n : GT_C), kh, col0, j);
    for (int64_t base = t0; base < t0 + n; base += GT_C) {
        const int L = (int)(t0 + n - base < GT_C ? t0 + n - base : GT_C);
        /* a: the chunk's inputs (fetched during the previous chunk) into shared memory */
#pragma unroll
        for (int u = 0; u < gt_regs<DK>::NK; u++) {
            int i = tid + u * GT_THREADS, r = i / (DK / 8), x = (i % (DK / 8)) * 8;
            gt_put8(Ks + r * LK + x, R.k[u]);
            gt_put8(Qs + r * LK + x, R.q[u]);
        }
#pragma unroll
        for (int u = 0; u < gt_regs<DK>::NV; u++) {
            int i = tid + u * GT_THREADS, r = i / (GT_DVB / 8), c = (i % (GT_DVB / 8)) * 8;
            gt_put8(U + r * LC + c, R.v[u]);
        }
        if (tid < GT_C) {
            dec[tid] = R.gate ? -expf(Alog) * hy_softplus(R.a + dtb) : 0.0f; /* raw g until the scan */
            beta[tid] = R.gate ? hy_sigmoid(R.b) : 0.0f;
        }
        __syncthreads();
        if (warp == 0) { /* inclusive scan of 64 values, two per lane */
            float g0 = dec[2 * lane], g1 = dec[2 * lane + 1], sc = g0 + g1;
#pragma unroll
            for (int off = 1; off < 32; off <<= 1) {
                float y = __shfl_up_sync(0xffffffffu, sc, off);
                if (lane >= off)
                    sc += y;
            }
            float tot = __shfl_sync(0xffffffffu, sc, 31), ex = sc - (g0 + g1);
            cg[2 * lane] = ex + g0;
            cg[2 * lane + 1] = sc;
            dec[2 * lane] = expf(tot - (ex + g0));
            dec[2 * lane + 1] = expf(tot - sc);
            ecg[2 * lane] = expf(ex + g0);
            ecg[2 * lane + 1] = expf(sc);
        }
        __syncthreads();
        /* b: K S and Q S, the warp's four tiles in tile column warp % 4 (rows warp / 4 and + 2)
         * sharing each S fragment; then K K^T and Q K^T, 20 lower tiles over the warps */
        {
            const int tj = warp % 4, ti0 = warp / 4, ti1 = ti0 + 2;
            gt_acc c0, c1, c2, c3;
            gtw::fill_fragment(c0, 0.0f);
            gtw::fill_fragment(c1, 0.0f);
            gtw::fill_fragment(c2, 0.0f);
            gtw::fill_fragment(c3, 0.0f);
#pragma unroll 2
            for (int k0 = 0; k0 < DK; k0 += 8) {
                gtw::fragment<gtw::matrix_b, 16, 16, 8, gtw::precision::tf32, gtw::row_major> fb;
                gt_load(fb, S + k0 * LC + tj * 16, LC);
                gt_mma_a(c0, Ks + ti0 * 16 * LK + k0, LK, fb);
                gt_mma_a(c1, Ks + ti1 * 16 * LK + k0, LK, fb);
                gt_mma_a(c2, Qs + ti0 * 16 * LK + k0, LK, fb);
                gt_mma_a(c3, Qs + ti1 * 16 * LK + k0, LK, fb);
            }
            gtw::store_matrix_sync(Vn + ti0 * 16 * LC + tj * 16, c0, LC, gtw::mem_row_major);
            gtw::store_matrix_sync(Vn + ti1 * 16 * LC + tj * 16, c1, LC, gtw::mem_row_major);
            gtw::store_matrix_sync(O + ti0 * 16 * LC + tj * 16, c2, LC, gtw::mem_row_major);
            gtw::store_matrix_sync(O + ti1 * 16 * LC + tj * 16, c3, LC, gtw::mem_row_major);
        }
        for (int job = warp; job < 20; job += GT_WARPS) {
            gt_acc acc;
            gtw::fill_fragment(acc, 0.0f);
            int ti, tj;
            gt_lower(job % 10, &ti, &tj);
            const float *lhs = job < 10 ? Ks : Qs;
            gt_mma<gtw::row_major, gtw::col_major>(acc, lhs + ti * 16 * LK, LK, Ks + tj * 16 * LK, LK, DK);
            gtw::store_matrix_sync((job < 10 ? A : Aqk) + ti * 16 * LC + tj * 16, acc, LC,
                                   gtw::mem_row_major);
        }
        __syncthreads();
        /* c */
        for (int e = tid; e < GT_C * GT_C; e += GT_THREADS) {
            int i = e / GT_C, m = e % GT_C;
            float d = m <= i ? expf(cg[i] - cg[m]) : 0.0f;
            A[i * LC + m] = m < i ? beta[i] * A[i * LC + m] * d : 0.0f;
            Aqk[i * LC + m] = m <= i ? Aqk[i * LC + m] * d : 0.0f;
        }
        for (int e = tid; e < GT_C * GT_DVB; e += GT_THREADS) {
            int i = e / GT_DVB, c = e % GT_DVB;
            float ei = ecg[i];
            U[i * LC + c] = beta[i] * (U[i * LC + c] - ei * Vn[i * LC + c]);
            O[i * LC + c] *= ei;
        }
        for (int e = tid; e < GT_C * DK; e += GT_THREADS) {
            int i = e / DK, x = e % DK;
            Ks[i * LK + x] *= dec[i];
        }
        __syncthreads();
        /* d: the diagonal blocks, one thread per (block, column) */
        if (tid < GT_C) {
            int r0 = (tid / 16) * 16, c = tid % 16;
            const float *Ab = A + r0 * LC + r0;
            float *Tb = Tm + r0 * LC + r0;
            for (int r = 0; r < 16; r++) {
                float t = r == c ? 1.0f : 0.0f;
                if (r > c) {
                    for (int x = c; x < r; x++)
                        t -= Ab[r * LC + x] * Tb[x * LC + c];
                }
                Tb[r * LC + c] = t;
            }
        }
        __syncthreads();
        for (int dist = 1; dist < 4; dist++) {
            int np = 4 - dist;
            for (int e = tid; e < np * 256; e += GT_THREADS) { /* X_p = sum_{j <= m < i} A_im T_mj */
                int bi = dist + e / 256, bj = bi - dist, r = (e % 256) / 16, c = e % 16;
                const float *Ar = A + (bi * 16 + r) * LC;
                float acc = 0.0f;
                for (int x = bj * 16; x < bi * 16; x++)
                    acc += Ar[x] * Tm[x * LC + bj * 16 + c];
                X[e] = acc;
            }
            __syncthreads();
            for (int e = tid; e < np * 256; e += GT_THREADS) { /* T_ij = -T_ii X_p */
                int bi = dist + e / 256, bj = bi - dist, r = (e % 256) / 16, c = e % 16;
                const float *Tr = Tm + (bi * 16 + r) * LC + bi * 16;
                const float *Xp = X + (e / 256) * 256;
                float acc = 0.0f;
                for (int x = 0; x <= r; x++)
                    acc += Tr[x] * Xp[x * 16 + c];
                Tm[(bi * 16 + r) * LC + bj * 16 + c] = -acc;
            }
            __syncthreads();
        }
        /* e: Vn = T U (T lower: the k-tiles up to the diagonal) */
        for (int t = warp; t < 16; t += GT_WARPS) {
            int ti = t / 4, tj = t % 4;
            gt_acc acc;
            gtw::fill_fragment(acc, 0.0f);
            gt_mma<gtw::row_major, gtw::row_major>(acc, Tm + ti * 16 * LC, LC, U + tj * 16, LC, (ti + 1) * 16);
            gtw::store_matrix_sync(Vn + ti * 16 * LC + tj * 16, acc, LC, gtw::mem_row_major);
        }
        __syncthreads();
        /* f: O += Aqk Vn; S = exp(cg_last) S + (dec K)^T Vn; the next chunk's inputs fetched */
        if (base + GT_C < t0 + n) {
            int64_t nb = base + GT_C;
            gt_fetch<DK>(R, q, k, ldqk, v, ldv, a, b, ldab, nb,
                         (int)(t0 + n - nb < GT_C ? t0 + n - nb : GT_C), kh, col0, j);
        }
        for (int t = warp; t < 16; t += GT_WARPS) {
            int ti = t / 4, tj = t % 4;
            gt_acc acc;
            gtw::load_matrix_sync(acc, O + ti * 16 * LC + tj * 16, LC, gtw::mem_row_major);
            gt_mma<gtw::row_major, gtw::row_major>(acc, Aqk + ti * 16 * LC, LC, Vn + tj * 16, LC, (ti + 1) * 16);
            gtw::store_matrix_sync(O + ti * 16 * LC + tj * 16, acc, LC, gtw::mem_row_major);
        }
        /* the warp's state tiles share their value columns (tile column warp % 4): one load of
         * each Vn fragment serves all of them */
        const float eL = expf(cg[GT_C - 1]);
        const int stj = warp % (GT_DVB / 16);
#pragma unroll
        for (int w = 0; w < NST; w++)
#pragma unroll
            for (int t = 0; t < Sacc[w].num_elements; t++)
                Sacc[w].x[t] *= eL;
        for (int k0 = 0; k0 < GT_C; k0 += 8) {
            gtw::fragment<gtw::matrix_b, 16, 16, 8, gtw::precision::tf32, gtw::row_major> fb;
            gt_load(fb, Vn + k0 * LC + stj * 16, LC);
#pragma unroll
            for (int w = 0; w < NST; w++) {
                int sti = (warp + w * GT_WARPS) / (GT_DVB / 16);
                gtw::fragment<gtw::matrix_a, 16, 16, 8, gtw::precision::tf32, gtw::col_major> fa;
                gt_load(fa, Ks + k0 * LK + sti * 16, LK);
                gtw::mma_sync(Sacc[w], fa, fb, Sacc[w]);
            }
        }
#pragma unroll
        for (int w = 0; w < NST; w++) {
            int sti = (warp + w * GT_WARPS) / (GT_DVB / 16);
            gtw::store_matrix_sync(S + sti * 16 * LC + stj * 16, Sacc[w], LC, gtw::mem_row_major);
        }
        __syncthreads();
        /* g: 8 columns per 16-byte store */
        for (int e = tid; e < L * (GT_DVB / 8); e += GT_THREADS) {
            int i = e / (GT_DVB / 8), c = (e % (GT_DVB / 8)) * 8;
            const float4 *src = (const float4 *)(O + i * LC + c);
            float4 f0 = src[0], f1 = src[1];
            uint4 pk;
            __nv_bfloat162 *h = (__nv_bfloat162 *)&pk;
            h[0] = __floats2bfloat162_rn(f0.x, f0.y);
            h[1] = __floats2bfloat162_rn(f0.z, f0.w);
            h[2] = __floats2bfloat162_rn(f1.x, f1.y);
            h[3] = __floats2bfloat162_rn(f1.z, f1.w);
            *(uint4 *)(o + (base + i) * ldo + col0 + c) = pk;
        }
    }
}

/* The sizes both kernels take; 0 or DFL_EUNSUP recorded. */
static int gd_check(dfl_be *be, const dfl_gated_delta *g)
{
    if (g->Hk < 1 || g->Hv < 1 || g->Hv % g->Hk)
        return cuda_op_fail(be, DFL_EUNSUP, "gated delta rule: %d value heads over %d key heads: "
                            "the value heads must be a multiple of the key heads", g->Hv, g->Hk);
    if (g->dk < 1 || g->dk > GD_MAX_DK || g->dv < GD_DVB || g->dv % GD_DVB)
        return cuda_op_fail(be, DFL_EUNSUP, "gated delta rule: key head dim %d, value head dim %d: "
                            "not supported on CUDA (key head dim at most %d, value head dim a "
                            "multiple of %d)", g->dk, g->dv, GD_MAX_DK, GD_DVB);
    if (g->chunk != GD_C)
        return cuda_op_fail(be, DFL_EUNSUP, "gated delta rule: chunk %d (CUDA runs chunks of %d)",
                            g->chunk, GD_C);
    size_t smem = gd_smem(g->dk);
    if (smem > cuda_of(be)->smem_optin)
        return cuda_op_fail(be, DFL_EUNSUP, "gated delta rule: key head dim %d needs %zu bytes of "
                            "shared memory (the GPU has %zu)", g->dk, smem, cuda_of(be)->smem_optin);
    if ((int64_t)g->n_seqs * g->Hv > INT32_MAX)
        return cuda_op_fail(be, DFL_EUNSUP, "gated delta rule: %d sequences x %d heads is too many",
                            g->n_seqs, g->Hv);
    return 0;
}

/* The SIMT kernel (f32 math throughout): every size gd_check takes, both activation types. */
static int gd_simt(dfl_be *be, const dfl_gated_delta *g)
{
    cudaStream_t s = cuda_of(be)->stream;
    size_t smem = gd_smem(g->dk);
    dim3 grid((unsigned)(g->n_seqs * g->Hv), (unsigned)(g->dv / GD_DVB));
    cudaError_t err;
#define GD_LAUNCH(TY)                                                                             \
    do {                                                                                          \
        err = cudaFuncSetAttribute(gated_delta_kernel<TY>,                                        \
                                   cudaFuncAttributeMaxDynamicSharedMemorySize, (int)smem);       \
        if (err != cudaSuccess)                                                                   \
            return cuda_op_fail(be, DFL_EDEVICE, "gated delta rule: %s", cudaGetErrorString(err));\
        gated_delta_kernel<TY><<<grid, HY_THREADS, smem, s>>>(                                    \
            (const TY *)g->q, (const TY *)g->k, g->ldqk, (const TY *)g->v, g->ldv,                \
            (const TY *)g->a, (const TY *)g->b, g->ldab, g->A_log, g->dt_bias, (TY *)g->o,        \
            g->ldo, g->cu_seqlens, g->Hv, g->Hv / g->Hk, g->dk);                                  \
    } while (0)
    if (be->act == DFL_BF16)
        GD_LAUNCH(bf16);
    else
        GD_LAUNCH(float);
#undef GD_LAUNCH
    return cuda_launch_check(be, "gated delta rule");
}

/* The tensor-core kernel: bf16 activations, key head dim DK, value head dim a multiple of 64. */
template <int DK>
static int gd_tc(dfl_be *be, const dfl_gated_delta *g)
{
    size_t smem = gt_smem<DK>();
    cudaError_t err = cudaFuncSetAttribute(gated_delta_tc_kernel<DK>,
                                           cudaFuncAttributeMaxDynamicSharedMemorySize, (int)smem);
    if (err != cudaSuccess)
        return cuda_op_fail(be, DFL_EDEVICE, "gated delta rule: %s", cudaGetErrorString(err));
    dim3 grid((unsigned)(g->n_seqs * g->Hv), (unsigned)(g->dv / GT_DVB));
    gated_delta_tc_kernel<DK><<<grid, GT_THREADS, smem, cuda_of(be)->stream>>>(
        (const bf16 *)g->q, (const bf16 *)g->k, g->ldqk, (const bf16 *)g->v, g->ldv,
        (const bf16 *)g->a, (const bf16 *)g->b, g->ldab, g->A_log, g->dt_bias, (bf16 *)g->o, g->ldo,
        g->cu_seqlens, g->Hv, g->Hv / g->Hk, g->dv);
    return cuda_launch_check(be, "gated delta rule (tensor cores)");
}

/* Whether the tensor-core kernel takes this call: bf16, the sizes it is built for, and q, k, v, o
 * rows it can move 16 bytes at a time. */
static bool gd_tc_takes(dfl_be *be, const dfl_gated_delta *g)
{
    if (be->act != DFL_BF16 || g->dv % GT_DVB)
        return false;
    if (!is_aligned(g->q, 16) || !is_aligned(g->k, 16) || !is_aligned(g->v, 16) ||
        !is_aligned(g->o, 16) || g->ldqk % 8 || g->ldv % 8 || g->ldo % 8)
        return false;
    if (g->dk == 64)
        return gt_smem<64>() <= cuda_of(be)->smem_optin;
    if (g->dk == 128)
        return gt_smem<128>() <= cuda_of(be)->smem_optin;
    return false;
}

int cuda_gated_delta(dfl_be *be, const dfl_gated_delta *g)
{
    int rc = gd_check(be, g);
    if (rc || g->T <= 0 || g->n_seqs <= 0)
        return rc;
    if ((rc = cuda_enter(be)))
        return rc;
    if (!gd_tc_takes(be, g))
        return gd_simt(be, g);
    return g->dk == 64 ? gd_tc<64>(be, g) : gd_tc<128>(be, g);
}

extern "C" int dfl_cuda_gated_delta_simt(dfl_be *be, const dfl_gated_delta *g)
{
    int rc = gd_check(be, g);
    if (rc || g->T <= 0 || g->n_seqs <= 0)
        return rc;
    if ((rc = cuda_enter(be)))
        return rc;
    return gd_simt(be, g);
}
