/* ops.cu: the CUDA backend's elementwise and row ops for the target model: dtype conversion,
 * embedding gather, RMSNorm (with the residual add fused), per-head q/k RMSNorm fused with RoPE,
 * SwiGLU, add, and the scale/bias pass used by matmul. T is the activation type (bf16 or f32);
 * all arithmetic is f32 with one rounding per output, as the CPU reference (lib/backends/be_cpu_ops.c)
 * computes in f32. Rows use 16-byte accesses when sizes and pointers allow, scalar ones
 * otherwise; every kernel reads and writes device memory once. */
#include <math.h>

#include "be_cuda.cuh"
#include "warp_sum.cuh"

#define EW_THREADS 256

/* Sum over the block (blockDim.x a multiple of 32, at most 1024); every thread gets the result.
 * Call once per kernel. */
__device__ __forceinline__ float block_sum(float v)
{
    __shared__ float part[32];
    __shared__ float total;
    int lane = threadIdx.x & 31, wid = threadIdx.x >> 5;
    v = warp_sum(v);
    if (lane == 0)
        part[wid] = v;
    __syncthreads();
    if (wid == 0) {
        int nw = (int)(blockDim.x >> 5);
        float s = lane < nw ? part[lane] : 0.0f;
        s = warp_sum(s);
        if (lane == 0)
            total = s;
    }
    __syncthreads();
    return total;
}

static inline int max_blocks(dfl_be *be) { return cuda_of(be)->sm_count * 32; }

/* ------------------------------------------------------------------------------------------ */
/* convert */

__device__ __forceinline__ float ld_f32(float x) { return x; }
__device__ __forceinline__ float ld_f32(bf16 x) { return __bfloat162float(x); }
__device__ __forceinline__ float ld_f32(__half x) { return __half2float(x); }

template <typename D> __device__ __forceinline__ D cvt_from_f32(float x);
template <> __device__ __forceinline__ float cvt_from_f32<float>(float x) { return x; }
template <> __device__ __forceinline__ double cvt_from_f32<double>(float x) { return (double)x; }
template <> __device__ __forceinline__ bf16 cvt_from_f32<bf16>(float x) { return __float2bfloat16_rn(x); }
template <> __device__ __forceinline__ __half cvt_from_f32<__half>(float x) { return __float2half_rn(x); }

template <typename D> __device__ __forceinline__ D cvt_from_f64(double x);
template <> __device__ __forceinline__ float cvt_from_f64<float>(double x) { return (float)x; }
template <> __device__ __forceinline__ double cvt_from_f64<double>(double x) { return x; }
template <> __device__ __forceinline__ bf16 cvt_from_f64<bf16>(double x) { return __double2bfloat16(x); }
template <> __device__ __forceinline__ __half cvt_from_f64<__half>(double x) { return __float2half_rn((float)x); }

template <typename D, typename S> __device__ __forceinline__ D cvt(S x) { return cvt_from_f32<D>(ld_f32(x)); }
template <> __device__ __forceinline__ float cvt<float, double>(double x) { return cvt_from_f64<float>(x); }
template <> __device__ __forceinline__ bf16 cvt<bf16, double>(double x) { return cvt_from_f64<bf16>(x); }
template <> __device__ __forceinline__ __half cvt<__half, double>(double x) { return cvt_from_f64<__half>(x); }

template <typename D, typename S>
__global__ void convert_kernel(D *y, const S *x, int64_t n)
{
    for (int64_t i = (int64_t)blockIdx.x * blockDim.x + threadIdx.x; i < n;
         i += (int64_t)gridDim.x * blockDim.x)
        y[i] = cvt<D, S>(x[i]);
}

template <typename D, typename S>
static int launch_convert(dfl_be *be, void *y, const void *x, int64_t n)
{
    convert_kernel<D, S><<<grid_for(n, EW_THREADS, max_blocks(be)), EW_THREADS, 0,
                           cuda_of(be)->stream>>>((D *)y, (const S *)x, n);
    return cuda_launch_check(be, "convert");
}

template <typename D>
static int launch_convert_from(dfl_be *be, void *y, const void *x, dfl_dtype st, int64_t n)
{
    switch (st) {
    case DFL_F32: return launch_convert<D, float>(be, y, x, n);
    case DFL_BF16: return launch_convert<D, bf16>(be, y, x, n);
    case DFL_F16: return launch_convert<D, __half>(be, y, x, n);
    case DFL_F64: return launch_convert<D, double>(be, y, x, n);
    default: return -1;
    }
}

int cuda_convert(dfl_be *be, void *y, dfl_dtype dt, const void *x, dfl_dtype st, int64_t n)
{
    if (n <= 0)
        return 0;
    int rc = cuda_enter(be);
    if (rc)
        return rc;
    bool known = (dt == DFL_F32 || dt == DFL_BF16 || dt == DFL_F16 || dt == DFL_F64) &&
                 (st == DFL_F32 || st == DFL_BF16 || st == DFL_F16 || st == DFL_F64);
    if (!known)
        return cuda_op_fail(be, DFL_EUNSUP, "convert: %s -> %s is not supported (f32, bf16, f16, "
                            "f64 only)", dfl_dtype_lower(st), dfl_dtype_lower(dt));
    if (dt == st) {
        cudaError_t err = cudaMemcpyAsync(y, x, (size_t)n * dfl_dtype_size(dt),
                                          cudaMemcpyDeviceToDevice, cuda_of(be)->stream);
        if (err != cudaSuccess)
            return cuda_op_fail(be, DFL_EDEVICE, "convert (copy): %s", cudaGetErrorString(err));
        return 0;
    }
    switch (dt) {
    case DFL_F32: return launch_convert_from<float>(be, y, x, st, n);
    case DFL_BF16: return launch_convert_from<bf16>(be, y, x, st, n);
    case DFL_F16: return launch_convert_from<__half>(be, y, x, st, n);
    default: return launch_convert_from<double>(be, y, x, st, n);
    }
}

/* ------------------------------------------------------------------------------------------ */
/* embedding: out[t] = E[ids[t]], one block per token */

template <typename T, int VEC>
__global__ void embedding_kernel(T *out, const int32_t *ids, const T *E, int64_t H)
{
    typedef Pack<T, VEC> P;
    int64_t t = blockIdx.x;
    const P *src = (const P *)(E + (int64_t)ids[t] * H);
    P *dst = (P *)(out + t * H);
    for (int64_t i = threadIdx.x; i < H / VEC; i += blockDim.x)
        dst[i] = src[i];
}

static int row_threads(int64_t nvec)
{
    int64_t t = (nvec + 31) / 32 * 32;
    return (int)(t < 32 ? 32 : t > EW_THREADS ? EW_THREADS : t);
}

template <typename T>
static int launch_embedding(dfl_be *be, void *out, const int32_t *ids, const void *E, int64_t T_,
                            int64_t H)
{
    constexpr int V = 16 / sizeof(T);
    cudaStream_t s = cuda_of(be)->stream;
    if (H % V == 0 && is_aligned(out, 16) && is_aligned(E, 16))
        embedding_kernel<T, V><<<(unsigned)T_, row_threads(H / V), 0, s>>>((T *)out, ids, (const T *)E, H);
    else
        embedding_kernel<T, 1><<<(unsigned)T_, row_threads(H), 0, s>>>((T *)out, ids, (const T *)E, H);
    return cuda_launch_check(be, "embedding");
}

int cuda_embedding(dfl_be *be, void *out, const int32_t *ids, const void *E, int64_t T_, int64_t H)
{
    if (T_ > INT32_MAX && H > 0)   /* (no work at all when H <= 0) */
        return cuda_op_fail(be, DFL_EUNSUP, "embedding: %lld tokens is too many", (long long)T_);
    return cuda_by_act(be, T_ <= 0 || H <= 0,
                       [&](auto t) { return launch_embedding<decltype(t)>(be, out, ids, E, T_, H); });
}

/* ------------------------------------------------------------------------------------------ */
/* rmsnorm and add_rmsnorm: one block per row. Pass 1 reads the row (and for add_rmsnorm adds
 * the residual, rounds, and stores h) and sums squares; pass 2 re-reads the same elements (each
 * thread its own: from L1/L2, not DRAM) and writes y = w * (h * rstd). */

template <typename T, int VEC, bool ADD>
__global__ void rmsnorm_kernel(T *y, float *rstd, const T *x, T *h, const T *d, const T *w,
                               int64_t n, float eps)
{
    typedef Pack<T, VEC> P;
    int64_t r = blockIdx.x;
    int64_t nv = n / VEC;
    const P *xr = (const P *)((ADD ? h : x) + r * n);
    float ss = 0.0f;
    for (int64_t i = threadIdx.x; i < nv; i += blockDim.x) {
        P a = xr[i];
        if (ADD) {
            P b = ((const P *)(d + r * n))[i];
#pragma unroll
            for (int j = 0; j < VEC; j++)
                a.v[j] = from_f32<T>(to_f32(a.v[j]) + to_f32(b.v[j]));
            ((P *)(h + r * n))[i] = a;
        }
#pragma unroll
        for (int j = 0; j < VEC; j++) {
            float f = to_f32(a.v[j]);
            ss += f * f;
        }
    }
    ss = block_sum(ss);
    float s = 1.0f / sqrtf(ss / (float)n + eps);
    if (rstd && threadIdx.x == 0)
        rstd[r] = s;
    P *yr = (P *)(y + r * n);
    const P *wr = (const P *)w;
    for (int64_t i = threadIdx.x; i < nv; i += blockDim.x) {
        P a = xr[i], wv = wr[i], o;
#pragma unroll
        for (int j = 0; j < VEC; j++)
            o.v[j] = from_f32<T>(to_f32(wv.v[j]) * (to_f32(a.v[j]) * s));
        yr[i] = o;
    }
}

template <typename T, bool ADD>
static int launch_rmsnorm(dfl_be *be, T *y, float *rstd, const T *x, T *h, const T *d, const T *w,
                          int64_t R, int64_t n, float eps)
{
    constexpr int V = 16 / sizeof(T);
    cudaStream_t s = cuda_of(be)->stream;
    bool vec = n % V == 0 && is_aligned(y, 16) && is_aligned(w, 16) &&
               (ADD ? is_aligned(h, 16) && is_aligned(d, 16) : is_aligned(x, 16));
    if (vec)
        rmsnorm_kernel<T, V, ADD><<<(unsigned)R, row_threads(n / V), 0, s>>>(y, rstd, x, h, d, w, n, eps);
    else
        rmsnorm_kernel<T, 1, ADD><<<(unsigned)R, row_threads(n), 0, s>>>(y, rstd, x, h, d, w, n, eps);
    return cuda_launch_check(be, ADD ? "add_rmsnorm" : "rmsnorm");
}

int cuda_rmsnorm(dfl_be *be, void *y, float *rstd, const void *x, const void *w, int64_t R,
                 int64_t n, float eps)
{
    if (R <= 0 || n <= 0)
        return 0;
    if (R > INT32_MAX)
        return cuda_op_fail(be, DFL_EUNSUP, "rmsnorm: %lld rows is too many", (long long)R);
    int rc = cuda_enter(be);
    if (rc)
        return rc;
    if (be->act == DFL_BF16)
        return launch_rmsnorm<bf16, false>(be, (bf16 *)y, rstd, (const bf16 *)x, NULL, NULL,
                                           (const bf16 *)w, R, n, eps);
    return launch_rmsnorm<float, false>(be, (float *)y, rstd, (const float *)x, NULL, NULL,
                                        (const float *)w, R, n, eps);
}

int cuda_add_rmsnorm(dfl_be *be, void *h, const void *d, void *y, float *rstd, const void *w,
                     int64_t R, int64_t n, float eps)
{
    if (R <= 0 || n <= 0)
        return 0;
    if (R > INT32_MAX)
        return cuda_op_fail(be, DFL_EUNSUP, "add_rmsnorm: %lld rows is too many", (long long)R);
    int rc = cuda_enter(be);
    if (rc)
        return rc;
    if (be->act == DFL_BF16)
        return launch_rmsnorm<bf16, true>(be, (bf16 *)y, rstd, NULL, (bf16 *)h, (const bf16 *)d,
                                          (const bf16 *)w, R, n, eps);
    return launch_rmsnorm<float, true>(be, (float *)y, rstd, NULL, (float *)h, (const float *)d,
                                       (const float *)w, R, n, eps);
}

/* ------------------------------------------------------------------------------------------ */
/* qknorm_rope, general path: one warp per (row, head). Lane l holds elements i = (l + 32 j) * P + p
 * of the first half and i + d/2 of the second (P = 2: pairs, when d/2 is even and rows
 * 2-aligned). The fast path (qknorm_rope_vec_kernel, below) takes the usual head sizes. */

#define QK_WARPS 8

template <typename T, int P, int MAXJ>
__global__ void qknorm_rope_kernel(T *x, const T *src, int64_t ld, float *rstd, const T *w,
                                   const int32_t *pos, const float *inv_freq, int64_t R, int heads,
                                   int d, float eps)
{
    typedef Pack<T, P> PK;
    int64_t gw = (int64_t)blockIdx.x * QK_WARPS + (threadIdx.x >> 5);
    if (gw >= R * heads)
        return;
    int lane = threadIdx.x & 31;
    int64_t r = gw / heads;
    int h = (int)(gw % heads);
    int half = d / 2;
    T *v = x + r * ld + (int64_t)h * d;
    const T *vi = (src ? src : x) + r * ld + (int64_t)h * d;
    float x1[MAXJ][P], x2[MAXJ][P];
    float ss = 0.0f;
#pragma unroll
    for (int j = 0; j < MAXJ; j++) {
        int i0 = (lane + 32 * j) * P;
        if (i0 < half) {
            PK a = *(const PK *)(vi + i0), b = *(const PK *)(vi + half + i0);
#pragma unroll
            for (int p = 0; p < P; p++) {
                x1[j][p] = to_f32(a.v[p]);
                x2[j][p] = to_f32(b.v[p]);
                ss += x1[j][p] * x1[j][p] + x2[j][p] * x2[j][p];
            }
        } else {
#pragma unroll
            for (int p = 0; p < P; p++)
                x1[j][p] = x2[j][p] = 0.0f;
        }
    }
    if (w) {
        ss = warp_sum(ss);
        float s = 1.0f / sqrtf(ss / (float)d + eps);
        if (rstd && lane == 0)
            rstd[r * heads + h] = s;
#pragma unroll
        for (int j = 0; j < MAXJ; j++) {
            int i0 = (lane + 32 * j) * P;
            if (i0 < half) {
#pragma unroll
                for (int p = 0; p < P; p++) {
                    x1[j][p] = to_f32(w[i0 + p]) * (x1[j][p] * s);
                    x2[j][p] = to_f32(w[half + i0 + p]) * (x2[j][p] * s);
                }
            }
        }
    }
    float fp = (float)pos[r];
#pragma unroll
    for (int j = 0; j < MAXJ; j++) {
        int i0 = (lane + 32 * j) * P;
        if (i0 < half) {
            PK a, b;
#pragma unroll
            for (int p = 0; p < P; p++) {
                float sn, c;
                sincosf(fp * inv_freq[i0 + p], &sn, &c);
                a.v[p] = from_f32<T>(x1[j][p] * c - x2[j][p] * sn);
                b.v[p] = from_f32<T>(x2[j][p] * c + x1[j][p] * sn);
            }
            *(PK *)(v + i0) = a;
            *(PK *)(v + half + i0) = b;
        }
    }
}

/* Fast path, 16-byte accesses: a group of G = (d/2) / V consecutive lanes holds one head, lane c
 * of the group the V elements [c V, c V + V) of the first half and the same V of the second half
 * (two 16-byte loads in flight per lane). One warp per row: it walks the row's heads 32 / G at a
 * time, so the sines and cosines of its elements, and its slice of the norm weight, are computed
 * or loaded once per row instead of once per head. The per-head sum of squares is a shuffle over
 * the G lanes of the group. Same arithmetic per element as qknorm_rope_kernel. */
template <typename T, int V, int G>
__global__ void qknorm_rope_vec_kernel(T *x, const T *src, int64_t ld, float *rstd, const T *w,
                                       const int32_t *pos, const float *inv_freq, int64_t R,
                                       int heads, int d, float eps)
{
    typedef Pack<T, V> PK;
    constexpr int HPW = 32 / G;          /* heads per step of the warp */
    int64_t r = (int64_t)blockIdx.x * QK_WARPS + (threadIdx.x >> 5);
    if (r >= R)
        return;                          /* whole warps only: the shuffles below stay full */
    int lane = threadIdx.x & 31;
    int c = lane & (G - 1), slot = lane / G;
    int half = d / 2, i0 = c * V;
    float fp = (float)pos[r];
    float cs[V], sn[V], w1[V], w2[V];
#pragma unroll
    for (int j = 0; j < V; j++)
        sincosf(fp * inv_freq[i0 + j], &sn[j], &cs[j]);
    if (w) {
        PK a = *(const PK *)(w + i0), b = *(const PK *)(w + half + i0);
#pragma unroll
        for (int j = 0; j < V; j++) {
            w1[j] = to_f32(a.v[j]);
            w2[j] = to_f32(b.v[j]);
        }
    }
    T *row = x + r * ld;
    const T *rowi = (src ? src : x) + r * ld;
    for (int h0 = 0; h0 < heads; h0 += HPW) {
        int h = h0 + slot;
        bool on = h < heads;
        T *v = row + (int64_t)h * d;
        const T *vi = rowi + (int64_t)h * d;
        float x1[V], x2[V], ss = 0.0f;
        if (on) {
            PK a = *(const PK *)(vi + i0), b = *(const PK *)(vi + half + i0);
#pragma unroll
            for (int j = 0; j < V; j++) {
                x1[j] = to_f32(a.v[j]);
                x2[j] = to_f32(b.v[j]);
                ss += x1[j] * x1[j] + x2[j] * x2[j];
            }
        } else {
#pragma unroll
            for (int j = 0; j < V; j++)
                x1[j] = x2[j] = 0.0f;
        }
        if (w) {
            ss = warp_sum<G>(ss);
            float s = 1.0f / sqrtf(ss / (float)d + eps);
            if (rstd && on && c == 0)
                rstd[r * heads + h] = s;
#pragma unroll
            for (int j = 0; j < V; j++) {
                x1[j] = w1[j] * (x1[j] * s);
                x2[j] = w2[j] * (x2[j] * s);
            }
        }
        if (on) {
            PK a, b;
#pragma unroll
            for (int j = 0; j < V; j++) {
                a.v[j] = from_f32<T>(x1[j] * cs[j] - x2[j] * sn[j]);
                b.v[j] = from_f32<T>(x2[j] * cs[j] + x1[j] * sn[j]);
            }
            *(PK *)(v + i0) = a;
            *(PK *)(v + half + i0) = b;
        }
    }
}

/* Launches the fast path when its conditions hold (16-byte aligned rows and weight, d/2 a
 * power-of-two multiple of the vector width, at most 32 vectors); false otherwise. */
template <typename T>
static bool launch_qk_vec(cudaStream_t s, T *x, const T *src, int64_t ld, float *rstd, const T *w,
                          const int32_t *pos, const float *inv, int64_t R, int heads, int d,
                          float eps)
{
    constexpr int V = 16 / sizeof(T);
    int half = d / 2;
    if (half % V || ld % V || !is_aligned(x, 16) || (src && !is_aligned(src, 16)) ||
        (w && !is_aligned(w, 16)))
        return false;
    int g = half / V;
    if ((int64_t)(R + QK_WARPS - 1) / QK_WARPS > INT32_MAX)
        return false;
    unsigned blocks = (unsigned)((R + QK_WARPS - 1) / QK_WARPS);
#define QKV_CASE(G)                                                                            \
    case G:                                                                                   \
        qknorm_rope_vec_kernel<T, V, G><<<blocks, QK_WARPS * 32, 0, s>>>(x, src, ld, rstd, w,    \
                                                                       pos, inv, R, heads, d,  \
                                                                       eps);                   \
        return true;
    switch (g) {
        QKV_CASE(1)
        QKV_CASE(2)
        QKV_CASE(4)
        QKV_CASE(8)
        QKV_CASE(16)
        QKV_CASE(32)
    default:
        return false;
    }
#undef QKV_CASE
}

template <typename T, int P>
static void launch_qk(cudaStream_t s, unsigned blocks, int maxj, T *x, const T *src, int64_t ld,
                      float *rstd, const T *w, const int32_t *pos, const float *inv, int64_t R,
                      int heads, int d, float eps)
{
#define QK_CASE(J)                                                                             \
    case J:                                                                                   \
        qknorm_rope_kernel<T, P, J><<<blocks, QK_WARPS * 32, 0, s>>>(x, src, ld, rstd, w, pos,   \
                                                                    inv, R, heads, d, eps);   \
        break;
    switch (maxj) {
        QK_CASE(1)
        QK_CASE(2)
        QK_CASE(4)
        QK_CASE(8)
        default:
        QK_CASE(16)
    }
#undef QK_CASE
}

/* Device table of inv_freq for (theta, d, be->rope_dtype), uploaded the first time they are
 * seen. Computed on the host by dfl_rope_inv_freq, as the CPU op does, so both use identical
 * frequencies. */
int cuda_rope_table(dfl_be *be, float theta, int d, const float **out)
{
    cuda_impl *im = cuda_of(be);
    dfl_dtype rdt = be->rope_dtype == DFL_BF16 || be->rope_dtype == DFL_F16 ? be->rope_dtype : DFL_F32;
    for (int i = 0; i < CUDA_ROPE_SLOTS; i++) {
        if (im->rope_d[i] == d && im->rope_theta[i] == theta && im->rope_dt[i] == rdt &&
            dfl_rope_scaling_eq(&im->rope_rs[i], be->rope_scaling)) {
            *out = im->rope_tab + (size_t)i * CUDA_ROPE_MAXHALF;
            return 0;
        }
    }
    int slot = im->rope_next;
    im->rope_next = (slot + 1) % CUDA_ROPE_SLOTS;
    float *hst = im->rope_host[slot];
    dfl_rope_inv_freq_scaled(hst, d, theta, be->rope_scaling, rdt);
    float *dev = im->rope_tab + (size_t)slot * CUDA_ROPE_MAXHALF;
    /* pageable source: staged by the driver before this returns; stream-ordered after any
     * earlier kernel that still reads the slot */
    cudaError_t err = cudaMemcpyAsync(dev, hst, (size_t)(d / 2) * sizeof(float),
                                      cudaMemcpyHostToDevice, im->stream);
    if (err != cudaSuccess)
        return cuda_op_fail(be, DFL_EDEVICE, "qknorm_rope: uploading the frequency table: %s",
                            cudaGetErrorString(err));
    im->rope_d[slot] = d;
    im->rope_theta[slot] = theta;
    im->rope_dt[slot] = rdt;
    if (be->rope_scaling)
        im->rope_rs[slot] = *be->rope_scaling;
    else
        memset(&im->rope_rs[slot], 0, sizeof im->rope_rs[slot]);
    *out = dev;
    return 0;
}

int cuda_qknorm_rope(dfl_be *be, void *x, const void *src, int64_t ld, float *rstd, const void *w,
                     const int32_t *pos, int64_t R, int heads, int d, float eps, float theta)
{
    if (R <= 0 || heads <= 0)
        return 0;
    if (d <= 0 || d % 2 || d > 2 * CUDA_ROPE_MAXHALF)
        return cuda_op_fail(be, DFL_EUNSUP, "qknorm_rope: head dimension %d (even, at most %d)", d,
                            2 * CUDA_ROPE_MAXHALF);
    int rc = cuda_enter(be);
    if (rc)
        return rc;
    const float *inv = NULL;
    if ((rc = cuda_rope_table(be, theta, d, &inv)))
        return rc;
    int half = d / 2;
    size_t es = dfl_dtype_size(be->act);
    int P = (half % 2 == 0 && ld % 2 == 0 && is_aligned(x, 2 * es) && (!src || is_aligned(src, 2 * es))) ? 2 : 1;
    int need = (half + 32 * P - 1) / (32 * P), maxj = 1;
    while (maxj < need)
        maxj *= 2;
    int64_t warps = R * heads;
    if ((warps + QK_WARPS - 1) / QK_WARPS > INT32_MAX)
        return cuda_op_fail(be, DFL_EUNSUP, "qknorm_rope: %lld rows x %d heads is too many",
                            (long long)R, heads);
    unsigned blocks = (unsigned)((warps + QK_WARPS - 1) / QK_WARPS);
    cudaStream_t s = cuda_of(be)->stream;
    bool fast = be->act == DFL_BF16
                    ? launch_qk_vec<bf16>(s, (bf16 *)x, (const bf16 *)src, ld, rstd, (const bf16 *)w, pos, inv, R, heads, d, eps)
                    : launch_qk_vec<float>(s, (float *)x, (const float *)src, ld, rstd, (const float *)w, pos, inv, R, heads, d, eps);
    if (fast)
        return cuda_launch_check(be, "qknorm_rope");
    if (be->act == DFL_BF16) {
        if (P == 2)
            launch_qk<bf16, 2>(s, blocks, maxj, (bf16 *)x, (const bf16 *)src, ld, rstd, (const bf16 *)w, pos, inv, R, heads, d, eps);
        else
            launch_qk<bf16, 1>(s, blocks, maxj, (bf16 *)x, (const bf16 *)src, ld, rstd, (const bf16 *)w, pos, inv, R, heads, d, eps);
    } else {
        if (P == 2)
            launch_qk<float, 2>(s, blocks, maxj, (float *)x, (const float *)src, ld, rstd, (const float *)w, pos, inv, R, heads, d, eps);
        else
            launch_qk<float, 1>(s, blocks, maxj, (float *)x, (const float *)src, ld, rstd, (const float *)w, pos, inv, R, heads, d, eps);
    }
    return cuda_launch_check(be, "qknorm_rope");
}

/* ------------------------------------------------------------------------------------------ */
/* swiglu: out[r, i] = silu(gu[r, i]) * gu[r, I + i] */

template <typename T, int VEC>
__global__ void swiglu_kernel(T *out, const T *gu, int64_t R, int64_t I)
{
    typedef Pack<T, VEC> P;
    int64_t iv = I / VEC;
    for (int64_t r = blockIdx.x; r < R; r += gridDim.x) {
        const P *g = (const P *)(gu + r * 2 * I), *u = (const P *)(gu + r * 2 * I + I);
        P *o = (P *)(out + r * I);
        for (int64_t c = threadIdx.x; c < iv; c += blockDim.x) {
            P a = g[c], b = u[c], y;
#pragma unroll
            for (int j = 0; j < VEC; j++) {
                float gv = to_f32(a.v[j]);
                y.v[j] = from_f32<T>(gv / (1.0f + expf(-gv)) * to_f32(b.v[j]));
            }
            o[c] = y;
        }
    }
}

/* one block per row (grid-stride over rows) */
template <typename T>
static int launch_swiglu(dfl_be *be, void *out, const void *gu, int64_t R, int64_t I)
{
    constexpr int V = 16 / sizeof(T);
    cudaStream_t s = cuda_of(be)->stream;
    unsigned blocks = (unsigned)(R < max_blocks(be) ? R : max_blocks(be));
    if (I % V == 0 && is_aligned(out, 16) && is_aligned(gu, 16))
        swiglu_kernel<T, V><<<blocks, row_threads(I / V), 0, s>>>((T *)out, (const T *)gu, R, I);
    else
        swiglu_kernel<T, 1><<<blocks, row_threads(I), 0, s>>>((T *)out, (const T *)gu, R, I);
    return cuda_launch_check(be, "swiglu");
}

int cuda_swiglu(dfl_be *be, void *out, const void *gu, int64_t R, int64_t I)
{
    return cuda_by_act(be, R <= 0 || I <= 0, [&](auto t) { return launch_swiglu<decltype(t)>(be, out, gu, R, I); });
}

/* ------------------------------------------------------------------------------------------ */
/* add: y[i] += x[i]; packs of VEC then a scalar tail */

template <typename T, int VEC>
__global__ void add_kernel(T *y, const T *x, int64_t n)
{
    typedef Pack<T, VEC> P;
    int64_t nv = n / VEC;
    int64_t stride = (int64_t)gridDim.x * blockDim.x;
    int64_t k0 = (int64_t)blockIdx.x * blockDim.x + threadIdx.x;
    for (int64_t k = k0; k < nv; k += stride) {
        P a = ((P *)y)[k], b = ((const P *)x)[k];
#pragma unroll
        for (int j = 0; j < VEC; j++)
            a.v[j] = from_f32<T>(to_f32(a.v[j]) + to_f32(b.v[j]));
        ((P *)y)[k] = a;
    }
    for (int64_t k = nv * VEC + k0; k < n; k += stride)
        y[k] = from_f32<T>(to_f32(y[k]) + to_f32(x[k]));
}

template <typename T>
static int launch_add(dfl_be *be, void *y, const void *x, int64_t n)
{
    constexpr int V = 16 / sizeof(T);
    cudaStream_t s = cuda_of(be)->stream;
    if (is_aligned(y, 16) && is_aligned(x, 16))
        add_kernel<T, V><<<grid_for((n + V - 1) / V, EW_THREADS, max_blocks(be)), EW_THREADS, 0, s>>>(
            (T *)y, (const T *)x, n);
    else
        add_kernel<T, 1><<<grid_for(n, EW_THREADS, max_blocks(be)), EW_THREADS, 0, s>>>(
            (T *)y, (const T *)x, n);
    return cuda_launch_check(be, "add");
}

int cuda_add(dfl_be *be, void *y, const void *x, int64_t n)
{
    return cuda_by_act(be, n <= 0, [&](auto t) { return launch_add<decltype(t)>(be, y, x, n); });
}

/* ------------------------------------------------------------------------------------------ */
/* C = beta * C + bias (matmul with K == 0, or a bias the GEMM epilogue could not add) */

template <typename T>
__global__ void scale_bias_kernel(T *C, int64_t ldc, int64_t M, int64_t N, float beta,
                                  const float *bias)
{
    int64_t n = M * N;
    for (int64_t k = (int64_t)blockIdx.x * blockDim.x + threadIdx.x; k < n;
         k += (int64_t)gridDim.x * blockDim.x) {
        int64_t i = k / N, j = k - i * N;
        T *c = C + i * ldc + j;
        float v = beta == 0.0f ? 0.0f : beta * to_f32(*c);
        if (bias)
            v += bias[j];
        *c = from_f32<T>(v);
    }
}

int cuda_scale_bias(dfl_be *be, void *C, dfl_dtype cdt, int64_t ldc, int64_t M, int64_t N,
                    float beta, const float *bias)
{
    if (M <= 0 || N <= 0 || (beta == 1.0f && !bias))
        return 0;
    unsigned g = grid_for(M * N, EW_THREADS, max_blocks(be));
    cudaStream_t s = cuda_of(be)->stream;
    switch (cdt) {
    case DFL_F32: scale_bias_kernel<float><<<g, EW_THREADS, 0, s>>>((float *)C, ldc, M, N, beta, bias); break;
    case DFL_BF16: scale_bias_kernel<bf16><<<g, EW_THREADS, 0, s>>>((bf16 *)C, ldc, M, N, beta, bias); break;
    case DFL_F16: scale_bias_kernel<__half><<<g, EW_THREADS, 0, s>>>((__half *)C, ldc, M, N, beta, bias); break;
    default:
        return cuda_op_fail(be, DFL_EUNSUP, "matmul: output type %s", dfl_dtype_lower(cdt));
    }
    return cuda_launch_check(be, "matmul bias");
}
