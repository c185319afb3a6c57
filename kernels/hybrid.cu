/* hybrid.cu: the CUDA backend's ops for hybrid targets (Qwen3.5 / Qwen3.6: Gated DeltaNet and
 * gated full attention): zero-centred RMSNorm, per-head q/k norm with partial RoPE, the sigmoid
 * output gate, the per-sequence causal conv1d + SiLU, L2 norm, gated RMSNorm and the chunked
 * gated delta rule. T is the activation type (bf16 or f32); arithmetic is f32 with one rounding
 * per output, as the CPU reference (lib/backends/be_cpu_hybrid.c). */
#include <math.h>
#include <mma.h>
#include <string.h>

#include "be_cuda.cuh"
#include "gdn_chunk.cuh"
#include "hybrid_ew.cuh"

#define HY_THREADS 256
#define HY_WARPS (HY_THREADS / 32)

__device__ __forceinline__ float hy_warp_sum(float v)
{
#pragma unroll
    for (int o = 16; o > 0; o >>= 1)
        v += __shfl_xor_sync(0xffffffffu, v, o);
    return v;
}

__device__ __forceinline__ float hy_silu(float x) { return x / (1.0f + expf(-x)); }

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

/* Whether the 8-channel norms (hybrid_ew.cuh) take heads of d bf16 in rows of stride ld at p:
 * d 32, 64, 128 or 256, 16-byte aligned rows. */
static bool norm_v8(dfl_be *be, const void *p, int64_t ld, int d)
{
    return be->act == DFL_BF16 && (d == 32 || d == 64 || d == 128 || d == 256) && is_aligned(p, 16) && ld % 8 == 0;
}

/* Blocks of an 8-channel norm over items (row, head) pairs of d channels: one group of d / 8
 * lanes an item, at most 32 blocks an SM (the warps loop). */
static unsigned norm_v8_blocks(dfl_be *be, int64_t items, int d)
{
    const int64_t per = (EW_THREADS / 32) * (32 / (d / 8)), cap = (int64_t)cuda_of(be)->sm_count * 32;
    int64_t nb = (items + per - 1) / per;
    return (unsigned)(nb < cap ? nb : cap);
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
    if (norm_v8(be, x, ld, d)) {
        unsigned nb = norm_v8_blocks(be, R * heads, d);
        switch (d) {
        case 32: l2norm_v8_kernel<4><<<nb, EW_THREADS, 0, s>>>((bf16 *)x, ld, R, heads, scale, eps); break;
        case 64: l2norm_v8_kernel<8><<<nb, EW_THREADS, 0, s>>>((bf16 *)x, ld, R, heads, scale, eps); break;
        case 128: l2norm_v8_kernel<16><<<nb, EW_THREADS, 0, s>>>((bf16 *)x, ld, R, heads, scale, eps); break;
        default: l2norm_v8_kernel<32><<<nb, EW_THREADS, 0, s>>>((bf16 *)x, ld, R, heads, scale, eps); break;
        }
        return cuda_launch_check(be, "l2norm");
    }
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
    if (norm_v8(be, x, ldx, d) && norm_v8(be, z, ldz, d) && is_aligned(w, 16)) {
        unsigned nb = norm_v8_blocks(be, R * heads, d);
        bf16 *xb = (bf16 *)x;
        const bf16 *zb = (const bf16 *)z, *wb = (const bf16 *)w;
        switch (d) {
        case 32: gated_rmsnorm_v8_kernel<4><<<nb, EW_THREADS, 0, s>>>(xb, ldx, zb, ldz, wb, R, heads, eps); break;
        case 64: gated_rmsnorm_v8_kernel<8><<<nb, EW_THREADS, 0, s>>>(xb, ldx, zb, ldz, wb, R, heads, eps); break;
        case 128: gated_rmsnorm_v8_kernel<16><<<nb, EW_THREADS, 0, s>>>(xb, ldx, zb, ldz, wb, R, heads, eps); break;
        default: gated_rmsnorm_v8_kernel<32><<<nb, EW_THREADS, 0, s>>>(xb, ldx, zb, ldz, wb, R, heads, eps); break;
        }
        return cuda_launch_check(be, "gated_rmsnorm");
    }
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

/* Whether the 8-channel kernels (hybrid_ew.cuh) take rows of n bf16 at p with stride ld: 16-byte
 * aligned rows, n a multiple of 8 and below 2^31. */
static bool ew_v8(dfl_be *be, const void *p, int64_t ld, int64_t n)
{
    return be->act == DFL_BF16 && is_aligned(p, 16) && ld % 8 == 0 && n % 8 == 0 && n < INT32_MAX;
}

/* Row slots of an 8-channel grid: about 16 blocks per SM in all, each row slot taking rows r,
 * r + slots, ... (at most 65535). */
static unsigned ew_slots(dfl_be *be, int64_t R, int64_t n)
{
    int64_t xb = (n / 8 + EW_THREADS - 1) / EW_THREADS, want = cuda_of(be)->sm_count * 16 / (xb > 0 ? xb : 1);
    want = want < 64 ? 64 : want;
    want = want > 65535 ? 65535 : want;
    return (unsigned)(R < want ? R : want);
}

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
    if (ew_v8(be, x, ldx, n) && ew_v8(be, g, ldg, n)) {
        dim3 grid((unsigned)((n / 8 + EW_THREADS - 1) / EW_THREADS), ew_slots(be, R, n));
        sigmoid_mul_v8_kernel<<<grid, EW_THREADS, 0, s>>>((bf16 *)x, ldx, (const bf16 *)g, ldg, R, (int)n);
        return cuda_launch_check(be, "sigmoid_mul");
    }
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
    if (K == 4 && ew_v8(be, x, ldx, C) && ew_v8(be, y, ldy, C)) {
        dim3 grid((unsigned)((C / 8 + EW_THREADS - 1) / EW_THREADS), ew_slots(be, T_, C));
        conv1d_silu_v8_kernel<4><<<grid, EW_THREADS, 0, s>>>((bf16 *)y, ldy, (const bf16 *)x, ldx,
                                                              (const bf16 *)w, pos, T_, (int)C);
        return cuda_launch_check(be, "conv1d_silu");
    }
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

/* ---- the chunked gated delta rule on tensor cores (bf16 activations): gdn_chunk.cuh ---- */

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

/* The two-pass form (gdn_chunk.cuh) is the default where it takes the call; DFL_CUDA_GDN_SPLIT=0
 * in the environment selects the one-kernel form instead. Read at every call, so that a test can
 * run both. */
static bool gd_split_enabled(void)
{
    const char *v = getenv("DFL_CUDA_GDN_SPLIT");
    return !(v && v[0] == '0' && !v[1]);
}

/* The two-pass form's passes on bf16 mma.sync (gm_prep_kernel, gm_state_kernel) are the default;
 * DFL_CUDA_GDN_MMA=0 selects the TF32 WMMA ones (gc_prep_kernel, gc_state_kernel), =2 the TF32
 * key-side pass with the mma.sync state pass (for timing each). Read at every call, so that a
 * test or a benchmark can run them all. Returns 0, 1 or 2 as the variable does. */
static int gd_mma_mode(void)
{
    const char *v = getenv("DFL_CUDA_GDN_MMA");
    if (v && (v[0] == '0' || v[0] == '2') && !v[1])
        return v[0] - '0';
    return 1;
}

/* The mma.sync state pass's warps a block: 8, or 16 with DFL_CUDA_GDN_STATE_WARPS=16 (for timing;
 * on the H200 at the Qwen3.5-27B shape the op took 2.140 ms with 8, 2.276 ms with 16) */
static int gd_state_warps(void)
{
    const char *v = getenv("DFL_CUDA_GDN_STATE_WARPS");
    return v && !strcmp(v, "16") ? 16 : 8;
}

/* The two-pass form's workspace for this call (gdn_chunk.cuh, gc_ws: T + 64 rows a value head),
 * grown through be_alloc and zeroed when it grows; false (nothing recorded) where it cannot be
 * had: the allocation frozen or the memory short. */
template <int DK>
static bool gc_workspace(dfl_be *be, const dfl_gated_delta *g, gc_ws *w)
{
    cuda_impl *im = cuda_of(be);
    const int64_t rows = g->T + GT_C, Hv = g->Hv;
    const size_t per = sizeof(float) * (size_t)rows * (size_t)Hv; /* one column of every head */
    auto up = [](size_t x) { return (x + 255) & ~(size_t)255; };
    const size_t b_k = up(per * DK), b_u = up(per * (size_t)g->dv), b_a = up(per * GT_C), b_c = up(per);
    const size_t need = 3 * b_k + b_u + b_a + b_c;
    if (need > im->gdn_ws_bytes) {
        dfl_err e = {0};
        void *p = be->ops->alloc(be, need, &e);
        if (!p)
            return false;
        if (be->ops->memset0(be, p, need)) { /* the rows past T are read (as zeros) */
            be->ops->free(be, p);             /* never recorded unzeroed */
            return false;
        }
        if (im->gdn_ws)
            be->ops->free(be, im->gdn_ws);
        im->gdn_ws = p;
        im->gdn_ws_bytes = need;
    }
    char *p = (char *)im->gdn_ws;
    w->wn = (float *)p;
    w->qe = (float *)(p + b_k);
    w->kd = (float *)(p + 2 * b_k);
    w->u = (float *)(p + 3 * b_k);
    w->aqk = (float *)(p + 3 * b_k + b_u);
    w->cg = (float *)(p + 3 * b_k + b_u + b_a);
    w->rows = rows;
    return true;
}

/* The two-pass form: 1 when it does not take the call (grid limits, no workspace), else the
 * launches' status. passes: bit 0 the key-side pass, bit 1 the state pass (3: the op; one alone
 * for timing). */
template <int DK>
static int gd_split(dfl_be *be, const dfl_gated_delta *g, int passes = 3)
{
    const int64_t nsl = g->dv / GT_DVB, chunks = g->max_len > 0 ? (g->max_len + GT_C - 1) / GT_C : 1;
    if (g->n_seqs > 65535 || g->Hv > 65535 || (int64_t)g->n_seqs * g->Hv * nsl > INT32_MAX)
        return 1;
    gc_ws w;
    if (!gc_workspace<DK>(be, g, &w))
        return 1;
    const int mode = gm_state_smem<DK>() <= cuda_of(be)->smem_optin ? gd_mma_mode() : 0;
    const bool mma = mode != 0, mprep = mode == 1;
    const int nw = gd_state_warps();
    size_t sp = mprep ? gm_prep_smem<DK>() : gc_prep_smem<DK>(), ss = mma ? gm_state_smem<DK>() : gc_state_smem<DK>();
    cudaError_t err = mprep ? cudaFuncSetAttribute(gm_prep_kernel<DK>, cudaFuncAttributeMaxDynamicSharedMemorySize, (int)sp)
                            : cudaFuncSetAttribute(gc_prep_kernel<DK>, cudaFuncAttributeMaxDynamicSharedMemorySize, (int)sp);
    if (err == cudaSuccess)
        err = !mma ? cudaFuncSetAttribute(gc_state_kernel<DK>, cudaFuncAttributeMaxDynamicSharedMemorySize, (int)ss)
              : nw == 8 ? cudaFuncSetAttribute(gm_state_kernel<DK, 8>, cudaFuncAttributeMaxDynamicSharedMemorySize, (int)ss)
                        : cudaFuncSetAttribute(gm_state_kernel<DK, 16>, cudaFuncAttributeMaxDynamicSharedMemorySize, (int)ss);
    if (err != cudaSuccess)
        return cuda_op_fail(be, DFL_EDEVICE, "gated delta rule: %s", cudaGetErrorString(err));
    cudaStream_t st = cuda_of(be)->stream;
    dim3 gp((unsigned)(chunks < 65535 ? chunks : 65535), (unsigned)g->n_seqs, (unsigned)g->Hv);
    if (passes & 1) {
        if (mprep)
            gm_prep_kernel<DK><<<gp, GT_THREADS, sp, st>>>(
                (const bf16 *)g->q, (const bf16 *)g->k, g->ldqk, (const bf16 *)g->v, g->ldv,
                (const bf16 *)g->a, (const bf16 *)g->b, g->ldab, g->A_log, g->dt_bias, g->cu_seqlens,
                g->Hv / g->Hk, g->dv, w);
        else
            gc_prep_kernel<DK><<<gp, GT_THREADS, sp, st>>>(
                (const bf16 *)g->q, (const bf16 *)g->k, g->ldqk, (const bf16 *)g->v, g->ldv,
                (const bf16 *)g->a, (const bf16 *)g->b, g->ldab, g->A_log, g->dt_bias, g->cu_seqlens,
                g->Hv / g->Hk, g->dv, w);
        int rc = cuda_launch_check(be, "gated delta rule (key-side pass)");
        if (rc)
            return rc;
    }
    if (!(passes & 2))
        return 0;
    const unsigned blocks = (unsigned)(g->n_seqs * g->Hv * nsl);
    if (mma && nw == 8)
        gm_state_kernel<DK, 8><<<blocks, 256, ss, st>>>(w, (const bf16 *)g->q, (const bf16 *)g->k, g->ldqk,
                                                        g->cu_seqlens, (bf16 *)g->o, g->ldo, g->Hv,
                                                        g->Hv / g->Hk, g->dv);
    else if (mma)
        gm_state_kernel<DK, 16><<<blocks, 512, ss, st>>>(w, (const bf16 *)g->q, (const bf16 *)g->k, g->ldqk,
                                                         g->cu_seqlens, (bf16 *)g->o, g->ldo, g->Hv,
                                                         g->Hv / g->Hk, g->dv);
    else
        gc_state_kernel<DK><<<blocks, GT_THREADS, ss, st>>>(w, g->cu_seqlens, (bf16 *)g->o, g->ldo, g->Hv, g->dv);
    return cuda_launch_check(be, "gated delta rule (state pass)");
}

/* The tensor-core forms for a call gd_tc_takes: the two-pass one unless split is false or it
 * does not take the call, else the one-kernel one. */
static int gd_tensor(dfl_be *be, const dfl_gated_delta *g, bool split)
{
    if (split) {
        int rc = g->dk == 64 ? gd_split<64>(be, g) : gd_split<128>(be, g);
        if (rc != 1)
            return rc;
    }
    return g->dk == 64 ? gd_tc<64>(be, g) : gd_tc<128>(be, g);
}

/* The op's sizes checked and the device made current: *go when there is work to launch; else
 * the status to return. */
static int gd_begin(dfl_be *be, const dfl_gated_delta *g, bool *go)
{
    *go = false;
    int rc = gd_check(be, g);
    if (rc || g->T <= 0 || g->n_seqs <= 0 || (rc = cuda_enter(be)))
        return rc;
    *go = true;
    return 0;
}

int cuda_gated_delta(dfl_be *be, const dfl_gated_delta *g)
{
    bool go;
    int rc = gd_begin(be, g, &go);
    if (!go)
        return rc;
    return gd_tc_takes(be, g) ? gd_tensor(be, g, gd_split_enabled()) : gd_simt(be, g);
}

extern "C" int dfl_cuda_gated_delta_fused(dfl_be *be, const dfl_gated_delta *g)
{
    bool go;
    int rc = gd_begin(be, g, &go);
    if (!go)
        return rc;
    return gd_tc_takes(be, g) ? gd_tensor(be, g, false) : gd_simt(be, g);
}

extern "C" int dfl_cuda_gated_delta_simt(dfl_be *be, const dfl_gated_delta *g)
{
    bool go;
    int rc = gd_begin(be, g, &go);
    return go ? gd_simt(be, g) : rc;
}

extern "C" int dfl_cuda_gated_delta_pass(dfl_be *be, const dfl_gated_delta *g, int passes)
{
    bool go;
    int rc = gd_begin(be, g, &go);
    if (!go)
        return rc;
    if (!gd_tc_takes(be, g) || passes < 1 || passes > 3)
        return 1;
    return g->dk == 64 ? gd_split<64>(be, g, passes) : gd_split<128>(be, g, passes);
}
