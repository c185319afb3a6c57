/* train_ops.cu: the CUDA backend's drafter training ops other than attention: RMSNorm backward,
 * per-head q/k RMSNorm + RoPE backward, SwiGLU backward, the fused LM head + cross-entropy
 * (lmce), the gradient sum of squares, the clipping scalars, AdamW and the uniform feature noise.
 * The CPU reference is lib/be_cpu_train.c; T is the activation type (bf16 or f32), arithmetic is
 * f32 (double where the CPU op sums many terms in double), one rounding per output.
 *
 * Determinism: no float atomics anywhere. Every reduction over rows (the weight gradients of the
 * norms, sumsq, the loss sums) runs in two passes: blocks write partial sums (double) for fixed
 * row ranges, then a second kernel adds them in block order. The block count depends only on the
 * problem's shape, never on the device, so the same inputs give the same bytes on every run (and
 * on every GPU model). The partials live in the backend's cuBLAS workspace (cuda_impl.ws, 32 MiB):
 * every op runs on the backend's one compute stream, so no GEMM can be using it between the two
 * kernels of a reduction. */
#include <math.h>
#include <string.h>

#include "be_cuda.cuh"

#define TR_THREADS 256

static inline int tr_max_blocks(dfl_be *be) { return cuda_of(be)->sm_count * 32; }

__device__ __forceinline__ float tr_warp_sum(float v)
{
#pragma unroll
    for (int o = 16; o > 0; o >>= 1)
        v += __shfl_xor_sync(0xffffffffu, v, o);
    return v;
}

__device__ __forceinline__ double tr_warp_sum_d(double v)
{
#pragma unroll
    for (int o = 16; o > 0; o >>= 1)
        v += __shfl_xor_sync(0xffffffffu, v, o);
    return v;
}

/* Sum over the block (blockDim.x a multiple of 32); every thread gets the same result (each adds
 * the warp partials in the same order). sh: 32 floats of shared memory. May be called repeatedly:
 * the leading barrier keeps a call from overwriting sh while a previous one is being read. */
__device__ __forceinline__ float tr_block_sum(float v, float *sh)
{
    const int lane = threadIdx.x & 31, wid = threadIdx.x >> 5, nw = blockDim.x >> 5;
    v = tr_warp_sum(v);
    __syncthreads();
    if (lane == 0)
        sh[wid] = v;
    __syncthreads();
    float s = 0.0f;
    for (int i = 0; i < nw; i++)
        s += sh[i];
    return s;
}

__device__ __forceinline__ double tr_block_sum_d(double v, double *sh)
{
    const int lane = threadIdx.x & 31, wid = threadIdx.x >> 5, nw = blockDim.x >> 5;
    v = tr_warp_sum_d(v);
    __syncthreads();
    if (lane == 0)
        sh[wid] = v;
    __syncthreads();
    double s = 0.0;
    for (int i = 0; i < nw; i++)
        s += sh[i];
    return s;
}

/* The backend's scratch for partial sums (see the file comment); NULL if too small. */
static void *tr_scratch(dfl_be *be, size_t bytes)
{
    cuda_impl *im = cuda_of(be);
    return bytes <= im->ws_bytes ? im->ws : NULL;
}

#define TR_SCRATCH_DOUBLES(be) (cuda_of(be)->ws_bytes / sizeof(double))

/* dw[i] += (float)(sum over b < nb of part[b * n + i]), in block order */
__global__ void tr_colsum_kernel(float *dw, const double *part, int nb, int64_t n)
{
    int64_t i = (int64_t)blockIdx.x * blockDim.x + threadIdx.x;
    if (i >= n)
        return;
    double s = 0.0;
    for (int b = 0; b < nb; b++)
        s += part[(int64_t)b * n + i];
    dw[i] += (float)s;
}

static int tr_colsum(dfl_be *be, float *dw, const double *part, int nb, int64_t n, const char *op)
{
    unsigned g = (unsigned)((n + TR_THREADS - 1) / TR_THREADS);
    tr_colsum_kernel<<<g, TR_THREADS, 0, cuda_of(be)->stream>>>(dw, part, nb, n);
    return cuda_launch_check(be, op);
}

/* ------------------------------------------------------------------------------------------ */
/* rmsnorm_bwd: block b takes rows [b*rpb, (b+1)*rpb); thread t holds the column packs
 * t, t + blockDim, ... (at most P) of every row it visits, so the row never leaves registers:
 * dot = sum(w dy x) over the row (block sum), dx = rstd (w dy - x rstd dot rstd / n), and the
 * thread's share of dw (sum over the block's rows of dy x rstd, f32 over at most rpb <= 64 rows)
 * goes to part[b] (double), which tr_colsum adds up in block order. */

#define RB_MAX_THREADS 512

template <typename T, int VEC, int P>
__global__ void __launch_bounds__(RB_MAX_THREADS)
rmsnorm_bwd_kernel(T *dx, double *part, const T *dy, const T *x, const T *w, const float *rstd,
                   int64_t R, int64_t n, int64_t rpb, bool acc)
{
    typedef Pack<T, VEC> PK;
    __shared__ float sh[32];
    const int64_t nv = n / VEC;
    const int64_t r0 = (int64_t)blockIdx.x * rpb;
    const int64_t r1 = r0 + rpb < R ? r0 + rpb : R;
    PK wp[P];
    float dwa[P][VEC];
#pragma unroll
    for (int k = 0; k < P; k++) {
        int64_t c = threadIdx.x + (int64_t)k * blockDim.x;
        wp[k] = c < nv ? ((const PK *)w)[c] : PK{};
#pragma unroll
        for (int j = 0; j < VEC; j++)
            dwa[k][j] = 0.0f;
    }
    const float inv_n = 1.0f / (float)n;
    for (int64_t r = r0; r < r1; r++) {
        const PK *dyr = (const PK *)(dy + r * n), *xr = (const PK *)(x + r * n);
        PK *dxr = (PK *)(dx + r * n);
        PK yp[P], xp[P];
        float dot = 0.0f;
#pragma unroll
        for (int k = 0; k < P; k++) {
            int64_t c = threadIdx.x + (int64_t)k * blockDim.x;
            yp[k] = c < nv ? dyr[c] : PK{};
            xp[k] = c < nv ? xr[c] : PK{};
        }
#pragma unroll
        for (int k = 0; k < P; k++)
#pragma unroll
            for (int j = 0; j < VEC; j++)
                dot += to_f32(wp[k].v[j]) * to_f32(yp[k].v[j]) * to_f32(xp[k].v[j]);
        const float s = rstd[r];
        dot = tr_block_sum(dot, sh);
        const float cm = dot * s * inv_n;   /* mean(w dy xhat) */
#pragma unroll
        for (int k = 0; k < P; k++) {
            int64_t c = threadIdx.x + (int64_t)k * blockDim.x;
            if (c < nv) {
                PK o = acc ? dxr[c] : PK{};
#pragma unroll
                for (int j = 0; j < VEC; j++) {
                    float fy = to_f32(yp[k].v[j]), fx = to_f32(xp[k].v[j]);
                    float gv = s * (to_f32(wp[k].v[j]) * fy - fx * s * cm);
                    o.v[j] = from_f32<T>(acc ? to_f32(o.v[j]) + gv : gv);
                    dwa[k][j] += fy * fx * s;
                }
                dxr[c] = o;
            }
        }
    }
    if (part) {
        double *pb = part + (int64_t)blockIdx.x * n;
#pragma unroll
        for (int k = 0; k < P; k++) {
            int64_t c = threadIdx.x + (int64_t)k * blockDim.x;
            if (c < nv)
#pragma unroll
                for (int j = 0; j < VEC; j++)
                    pb[c * VEC + j] = (double)dwa[k][j];
        }
    }
}

template <typename T, int VEC>
static int launch_rmsnorm_bwd(dfl_be *be, void *dx, float *dw, const void *dy, const void *x,
                              const void *w, const float *rstd, int64_t R, int64_t n, bool acc)
{
    const int64_t nv = n / VEC;
    int64_t th = (nv + 1) / 2;                 /* about two packs per thread */
    th = (th + 31) / 32 * 32;
    if (th < 64)
        th = 64;
    if (th > RB_MAX_THREADS)
        th = RB_MAX_THREADS;
    int64_t p = (nv + th - 1) / th;
    /* blocks: a function of the shape only (deterministic partial sums), at most 64 rows each */
    int64_t nb = (R + 3) / 4;
    if (nb > 512)
        nb = 512;
    if (nb < (R + 63) / 64)
        nb = (R + 63) / 64;
    if (dw && nb * n > (int64_t)TR_SCRATCH_DOUBLES(be))
        return cuda_op_fail(be, DFL_EUNSUP, "rmsnorm_bwd: %lld rows of %lld values: too many for "
                            "the weight-gradient scratch", (long long)R, (long long)n);
    if (nb < 1)
        nb = 1;
    int64_t rpb = (R + nb - 1) / nb;
    nb = (R + rpb - 1) / rpb;
    double *part = dw ? (double *)tr_scratch(be, (size_t)(nb * n) * sizeof(double)) : NULL;
    cudaStream_t s = cuda_of(be)->stream;
#define RB_CASE(PP)                                                                            \
    rmsnorm_bwd_kernel<T, VEC, PP><<<(unsigned)nb, (unsigned)th, 0, s>>>(                     \
        (T *)dx, part, (const T *)dy, (const T *)x, (const T *)w, rstd, R, n, rpb, acc)
    /* register budget: P * VEC values of dy, x, w and dw per thread */
    constexpr int PMAX = VEC == 1 ? 16 : VEC == 4 ? 8 : 4;
    if (p > PMAX)
        return cuda_op_fail(be, DFL_EUNSUP, "rmsnorm_bwd: rows of %lld values are too long (at most "
                            "%d)", (long long)n, PMAX * RB_MAX_THREADS * VEC);
    if (p <= 1)
        RB_CASE(1);
    else if (p <= 2)
        RB_CASE(2);
    else if (p <= 4)
        RB_CASE(4);
    else if constexpr (PMAX >= 8) {
        if (p <= 8)
            RB_CASE(8);
        else if constexpr (PMAX >= 16)
            RB_CASE(16);
    }
#undef RB_CASE
    int rc = cuda_launch_check(be, "rmsnorm_bwd");
    if (rc || !dw)
        return rc;
    return tr_colsum(be, dw, part, (int)nb, n, "rmsnorm_bwd (dw)");
}

int cuda_rmsnorm_bwd(dfl_be *be, void *dx, float *dw, const void *dy, const void *x, const void *w,
                     const float *rstd, int64_t R, int64_t n, bool accumulate_dx)
{
    if (R <= 0 || n <= 0)
        return 0;
    if (!rstd)
        return cuda_op_fail(be, DFL_EUNSUP, "rmsnorm_bwd: needs the forward's rstd");
    if (R > INT32_MAX)
        return cuda_op_fail(be, DFL_EUNSUP, "rmsnorm_bwd: %lld rows is too many", (long long)R);
    int rc = cuda_enter(be);
    if (rc)
        return rc;
    bool a16 = is_aligned(dx, 16) && is_aligned(dy, 16) && is_aligned(x, 16) && is_aligned(w, 16);
    if (be->act == DFL_BF16)
        return n % 8 == 0 && a16 ? launch_rmsnorm_bwd<bf16, 8>(be, dx, dw, dy, x, w, rstd, R, n, accumulate_dx)
                                 : launch_rmsnorm_bwd<bf16, 1>(be, dx, dw, dy, x, w, rstd, R, n, accumulate_dx);
    return n % 4 == 0 && a16 ? launch_rmsnorm_bwd<float, 4>(be, dx, dw, dy, x, w, rstd, R, n, accumulate_dx)
                             : launch_rmsnorm_bwd<float, 1>(be, dx, dw, dy, x, w, rstd, R, n, accumulate_dx);
}

/* ------------------------------------------------------------------------------------------ */
/* qknorm_rope_bwd: one warp per (row, head), lanes laid out as in the forward (lane l holds
 * elements i = (l + 32 j) P + p of the first half and i + d/2 of the second). The gradient
 * through RoPE is the inverse rotation; through the norm, as rmsnorm_bwd. Block b takes the
 * (row, head) items [b*ipb, (b+1)*ipb); its warps' dw shares are added in warp order into
 * part[b]. */

#define QKB_WARPS 8

template <typename T, int P, int MAXJ>
__global__ void __launch_bounds__(QKB_WARPS * 32)
qknorm_rope_bwd_kernel(T *dx, int64_t ld, double *part, const T *xin, const T *w, const float *rstd,
                       const int32_t *pos, const float *inv_freq, int64_t R, int heads, int d,
                       float eps, int64_t ipb)
{
    typedef Pack<T, P> PK;
    __shared__ double shw[QKB_WARPS][2 * 32 * MAXJ * P];
    const int lane = threadIdx.x & 31, wid = threadIdx.x >> 5;
    const int half = d / 2;
    const int64_t items = R * heads;
    const int64_t i0 = (int64_t)blockIdx.x * ipb;
    const int64_t i1 = i0 + ipb < items ? i0 + ipb : items;
    float w1[MAXJ][P], w2[MAXJ][P];
    double a1[MAXJ][P], a2[MAXJ][P];
#pragma unroll
    for (int j = 0; j < MAXJ; j++)
#pragma unroll
        for (int p = 0; p < P; p++) {
            int i = (lane + 32 * j) * P + p;
            w1[j][p] = (w && i < half) ? to_f32(w[i]) : 0.0f;
            w2[j][p] = (w && i < half) ? to_f32(w[half + i]) : 0.0f;
            a1[j][p] = a2[j][p] = 0.0;
        }
    for (int64_t it = i0 + wid; it < i1; it += QKB_WARPS) {
        const int64_t r = it / heads;
        const int h = (int)(it % heads);
        T *dv = dx + r * ld + (int64_t)h * d;
        const T *xv = xin + r * ld + (int64_t)h * d;
        const float fp = (float)pos[r];
        float g1[MAXJ][P], g2[MAXJ][P], x1[MAXJ][P], x2[MAXJ][P];
        float ss = 0.0f;
#pragma unroll
        for (int j = 0; j < MAXJ; j++) {
            int ib = (lane + 32 * j) * P;
            if (ib < half) {
                PK da = *(const PK *)(dv + ib), db = *(const PK *)(dv + half + ib);
                PK xa = *(const PK *)(xv + ib), xb = *(const PK *)(xv + half + ib);
#pragma unroll
                for (int p = 0; p < P; p++) {
                    float sn, c;
                    sincosf(fp * inv_freq[ib + p], &sn, &c);
                    float u = to_f32(da.v[p]), v = to_f32(db.v[p]);
                    g1[j][p] = u * c + v * sn;
                    g2[j][p] = -u * sn + v * c;
                    x1[j][p] = to_f32(xa.v[p]);
                    x2[j][p] = to_f32(xb.v[p]);
                    ss += x1[j][p] * x1[j][p] + x2[j][p] * x2[j][p];
                }
            } else {
#pragma unroll
                for (int p = 0; p < P; p++)
                    g1[j][p] = g2[j][p] = x1[j][p] = x2[j][p] = 0.0f;
            }
        }
        if (w) {
            float sc;
            if (rstd) {
                sc = rstd[r * heads + h];
            } else {
                ss = tr_warp_sum(ss);
                sc = 1.0f / sqrtf(ss / (float)d + eps);
            }
            float dot = 0.0f;
#pragma unroll
            for (int j = 0; j < MAXJ; j++)
#pragma unroll
                for (int p = 0; p < P; p++)
                    dot += w1[j][p] * g1[j][p] * x1[j][p] + w2[j][p] * g2[j][p] * x2[j][p];
            dot = tr_warp_sum(dot);
            const float m = dot * sc / (float)d;
#pragma unroll
            for (int j = 0; j < MAXJ; j++)
#pragma unroll
                for (int p = 0; p < P; p++) {
                    if (part) {
                        a1[j][p] += (double)g1[j][p] * (double)(x1[j][p] * sc);
                        a2[j][p] += (double)g2[j][p] * (double)(x2[j][p] * sc);
                    }
                    g1[j][p] = sc * (w1[j][p] * g1[j][p] - x1[j][p] * sc * m);
                    g2[j][p] = sc * (w2[j][p] * g2[j][p] - x2[j][p] * sc * m);
                }
        }
#pragma unroll
        for (int j = 0; j < MAXJ; j++) {
            int ib = (lane + 32 * j) * P;
            if (ib < half) {
                PK oa, ob;
#pragma unroll
                for (int p = 0; p < P; p++) {
                    oa.v[p] = from_f32<T>(g1[j][p]);
                    ob.v[p] = from_f32<T>(g2[j][p]);
                }
                *(PK *)(dv + ib) = oa;
                *(PK *)(dv + half + ib) = ob;
            }
        }
    }
    if (!part)
        return;
    /* the block's dw share: warps' partials added in warp order */
#pragma unroll
    for (int j = 0; j < MAXJ; j++)
#pragma unroll
        for (int p = 0; p < P; p++) {
            int i = (lane + 32 * j) * P + p;
            if (i < half) {
                shw[wid][i] = a1[j][p];
                shw[wid][half + i] = a2[j][p];
            }
        }
    __syncthreads();
    for (int i = threadIdx.x; i < d; i += blockDim.x) {
        double s = 0.0;
        for (int k = 0; k < QKB_WARPS; k++)
            s += shw[k][i];
        part[(int64_t)blockIdx.x * d + i] = s;
    }
}

template <typename T, int P>
static void launch_qkb(cudaStream_t s, unsigned blocks, int maxj, T *x, int64_t ld, double *part,
                       const T *xin, const T *w, const float *rstd, const int32_t *pos,
                       const float *inv, int64_t R, int heads, int d, float eps, int64_t ipb)
{
#define QKB_CASE(J)                                                                           \
    case J:                                                                                  \
        qknorm_rope_bwd_kernel<T, P, J><<<blocks, QKB_WARPS * 32, 0, s>>>(                    \
            x, ld, part, xin, w, rstd, pos, inv, R, heads, d, eps, ipb);                      \
        break;
    switch (maxj) {
        QKB_CASE(1)
        QKB_CASE(2)
        default:
        QKB_CASE(4)
    }
#undef QKB_CASE
}

int cuda_qknorm_rope_bwd(dfl_be *be, void *dx, int64_t ld, float *dw, const void *x_in, const void *w,
                         const float *rstd, const int32_t *pos, int64_t R, int heads, int d,
                         float eps, float theta)
{
    if (R <= 0 || heads <= 0)
        return 0;
    if (d <= 0 || d % 2 || d > 512)
        return cuda_op_fail(be, DFL_EUNSUP, "qknorm_rope_bwd: head dimension %d (even, at most 512)", d);
    int rc = cuda_enter(be);
    if (rc)
        return rc;
    const float *inv = NULL;
    if ((rc = cuda_rope_table(be, theta, d, &inv)))
        return rc;
    const int half = d / 2;
    const size_t es = dfl_dtype_size(be->act);
    const int P = (half % 2 == 0 && ld % 2 == 0 && is_aligned(dx, 2 * es) && is_aligned(x_in, 2 * es)) ? 2 : 1;
    int need = (half + 32 * P - 1) / (32 * P), maxj = 1;
    while (maxj < need)
        maxj *= 2;
    if (maxj > 4)   /* d = 512 with P = 1: 8 */
        return cuda_op_fail(be, DFL_EUNSUP, "qknorm_rope_bwd: head dimension %d needs 2-element "
                            "aligned rows", d);
    const int64_t items = R * heads;
    int64_t nb = (items + 63) / 64;
    if (nb > 1024)
        nb = 1024;
    int64_t ipb = (items + nb - 1) / nb;
    nb = (items + ipb - 1) / ipb;
    double *part = NULL;
    if (w && dw) {
        part = (double *)tr_scratch(be, (size_t)(nb * d) * sizeof(double));
        if (!part)
            return cuda_op_fail(be, DFL_EUNSUP, "qknorm_rope_bwd: scratch too small");
    }
    cudaStream_t s = cuda_of(be)->stream;
    if (be->act == DFL_BF16) {
        if (P == 2)
            launch_qkb<bf16, 2>(s, (unsigned)nb, maxj, (bf16 *)dx, ld, part, (const bf16 *)x_in,
                                (const bf16 *)w, rstd, pos, inv, R, heads, d, eps, ipb);
        else
            launch_qkb<bf16, 1>(s, (unsigned)nb, maxj, (bf16 *)dx, ld, part, (const bf16 *)x_in,
                                (const bf16 *)w, rstd, pos, inv, R, heads, d, eps, ipb);
    } else {
        if (P == 2)
            launch_qkb<float, 2>(s, (unsigned)nb, maxj, (float *)dx, ld, part, (const float *)x_in,
                                 (const float *)w, rstd, pos, inv, R, heads, d, eps, ipb);
        else
            launch_qkb<float, 1>(s, (unsigned)nb, maxj, (float *)dx, ld, part, (const float *)x_in,
                                 (const float *)w, rstd, pos, inv, R, heads, d, eps, ipb);
    }
    rc = cuda_launch_check(be, "qknorm_rope_bwd");
    if (rc || !part)
        return rc;
    return tr_colsum(be, dw, part, (int)nb, d, "qknorm_rope_bwd (dw)");
}

/* ------------------------------------------------------------------------------------------ */
/* swiglu_bwd: dgate = dout * up * sg (1 + g (1 - sg)), dup = dout * silu(g); one block per row
 * (grid-stride over rows), packs of VEC columns. */

template <typename T, int VEC>
__global__ void swiglu_bwd_kernel(T *dgu, const T *dout, const T *gu, int64_t R, int64_t I)
{
    typedef Pack<T, VEC> PK;
    const int64_t iv = I / VEC;
    for (int64_t r = blockIdx.x; r < R; r += gridDim.x) {
        const PK *g = (const PK *)(gu + r * 2 * I), *u = (const PK *)(gu + r * 2 * I + I);
        const PK *dr = (const PK *)(dout + r * I);
        PK *dg = (PK *)(dgu + r * 2 * I), *du = (PK *)(dgu + r * 2 * I + I);
        for (int64_t c = threadIdx.x; c < iv; c += blockDim.x) {
            PK a = g[c], b = u[c], e = dr[c], og, ou;
#pragma unroll
            for (int j = 0; j < VEC; j++) {
                float gv = to_f32(a.v[j]), uv = to_f32(b.v[j]), dv = to_f32(e.v[j]);
                float sg = 1.0f / (1.0f + expf(-gv));
                float silu = gv * sg;
                ou.v[j] = from_f32<T>(dv * silu);
                og.v[j] = from_f32<T>(dv * uv * (sg * (1.0f + gv * (1.0f - sg))));
            }
            dg[c] = og;
            du[c] = ou;
        }
    }
}

static int row_threads_tr(int64_t nvec)
{
    int64_t t = (nvec + 31) / 32 * 32;
    return (int)(t < 32 ? 32 : t > TR_THREADS ? TR_THREADS : t);
}

template <typename T>
static int launch_swiglu_bwd(dfl_be *be, void *dgu, const void *dout, const void *gu, int64_t R, int64_t I)
{
    constexpr int V = 16 / sizeof(T);
    cudaStream_t s = cuda_of(be)->stream;
    unsigned blocks = (unsigned)(R < tr_max_blocks(be) ? R : tr_max_blocks(be));
    if (I % V == 0 && is_aligned(dgu, 16) && is_aligned(dout, 16) && is_aligned(gu, 16))
        swiglu_bwd_kernel<T, V><<<blocks, row_threads_tr(I / V), 0, s>>>((T *)dgu, (const T *)dout,
                                                                         (const T *)gu, R, I);
    else
        swiglu_bwd_kernel<T, 1><<<blocks, row_threads_tr(I), 0, s>>>((T *)dgu, (const T *)dout,
                                                                     (const T *)gu, R, I);
    return cuda_launch_check(be, "swiglu_bwd");
}

int cuda_swiglu_bwd(dfl_be *be, void *dgu, const void *dout, const void *gu, int64_t R, int64_t I)
{
    if (R <= 0 || I <= 0)
        return 0;
    int rc = cuda_enter(be);
    if (rc)
        return rc;
    return be->act == DFL_BF16 ? launch_swiglu_bwd<bf16>(be, dgu, dout, gu, R, I)
                               : launch_swiglu_bwd<float>(be, dgu, dout, gu, R, I);
}

/* ------------------------------------------------------------------------------------------ */
/* sumsq: block b sums x[b*cs, (b+1)*cs) in double (16-byte loads when aligned); one warp adds
 * the block sums in a fixed order into out[0]. cs depends on n only. */

#define SUMSQ_THREADS 256
#define SUMSQ_MAXB 1024

__global__ void __launch_bounds__(SUMSQ_THREADS)
sumsq_part_kernel(double *part, const float *x, int64_t n, int64_t cs, bool vec)
{
    __shared__ double sh[32];
    const int64_t i0 = (int64_t)blockIdx.x * cs;
    const int64_t i1 = i0 + cs < n ? i0 + cs : n;
    double s = 0.0;
    if (vec) {
        /* i0 is a multiple of 4 (cs is), x 16-byte aligned */
        const int64_t nv = (i1 - i0) / 4;
        const float4 *xv = (const float4 *)(x + i0);
        for (int64_t k = threadIdx.x; k < nv; k += blockDim.x) {
            float4 a = xv[k];
            s += (double)a.x * a.x + (double)a.y * a.y + (double)a.z * a.z + (double)a.w * a.w;
        }
        for (int64_t i = i0 + nv * 4 + threadIdx.x; i < i1; i += blockDim.x)
            s += (double)x[i] * x[i];
    } else {
        for (int64_t i = i0 + threadIdx.x; i < i1; i += blockDim.x)
            s += (double)x[i] * x[i];
    }
    s = tr_block_sum_d(s, sh);
    if (threadIdx.x == 0)
        part[blockIdx.x] = s;
}

/* one warp: lane l adds part[l], part[l + 32], ... in order; then a fixed shuffle tree */
__global__ void sumsq_final_kernel(double *out, const double *part, int nb)
{
    double s = 0.0;
    for (int i = threadIdx.x; i < nb; i += 32)
        s += part[i];
    s = tr_warp_sum_d(s);
    if (threadIdx.x == 0)
        out[0] += s;
}

int cuda_sumsq(dfl_be *be, double *out, const float *x, int64_t n)
{
    if (n <= 0)
        return 0;
    int rc = cuda_enter(be);
    if (rc)
        return rc;
    int64_t nb = (n + 16383) / 16384;
    if (nb > SUMSQ_MAXB)
        nb = SUMSQ_MAXB;
    int64_t cs = (n + nb - 1) / nb;
    cs = (cs + 3) / 4 * 4;
    nb = (n + cs - 1) / cs;
    double *part = (double *)tr_scratch(be, (size_t)nb * sizeof(double));
    cudaStream_t s = cuda_of(be)->stream;
    sumsq_part_kernel<<<(unsigned)nb, SUMSQ_THREADS, 0, s>>>(part, x, n, cs, is_aligned(x, 16));
    if ((rc = cuda_launch_check(be, "sumsq")))
        return rc;
    sumsq_final_kernel<<<1, 32, 0, s>>>(out, part, (int)nb);
    return cuda_launch_check(be, "sumsq (final)");
}

/* ------------------------------------------------------------------------------------------ */
/* clip_scale: the CPU op's double arithmetic, on one thread (sqrt and division are correctly
 * rounded on the device, so the results are the CPU's bit for bit). */

__global__ void clip_scale_kernel(float *out, int32_t *skip, const double *sums, float max_norm)
{
    double den = sums[DFL_SUM_LOSS_DEN];
    double norm = sqrt(sums[DFL_SUM_GRAD_SQ]) / den;
    int bad = !(den > 0) || !isfinite(sums[DFL_SUM_LOSS_NUM]) || !isfinite(norm);
    double coef = 1.0;
    if (max_norm > 0 && !bad) {
        coef = (double)max_norm / (norm + 1e-6);
        if (coef > 1.0)
            coef = 1.0;
    }
    out[0] = bad ? 0.0f : (float)(coef / den);
    out[1] = (float)norm;
    out[2] = (float)coef;
    *skip = bad;
}

int cuda_clip_scale(dfl_be *be, float *out, int32_t *skip, const double *sums, float max_norm)
{
    int rc = cuda_enter(be);
    if (rc)
        return rc;
    clip_scale_kernel<<<1, 1, 0, cuda_of(be)->stream>>>(out, skip, sums, max_norm);
    return cuda_launch_check(be, "clip_scale");
}

/* ------------------------------------------------------------------------------------------ */
/* adamw: per element, in this order, each operation rounded to f32 (explicit _rn intrinsics, so
 * that the compiler cannot contract them into FMAs):
 *   gi = g * gs;  pi = p * decay;  mi = m + b1w * (gi - m);  vi = v * b2 + (b2w * gi) * gi;
 *   denom = sqrt(vi) / bc2_sqrt + eps;  p = pi - step_size * (mi / denom)
 * with decay = 1 - lr wd, b1w = 1 - b1, b2w = 1 - b2 (f32), step_size = (float)(lr / (1 - b1^t))
 * and bc2_sqrt = (float)sqrt(1 - b2^t) computed in double on the host. These are exactly the CPU
 * op's operations (lib/be_cpu_train.c), so results agree bit for bit with a CPU build that does
 * not contract a*b+c into FMAs (the default x86-64 build). p_act gets p rounded to be->wdt
 * (round to nearest even) in the same pass. *skip != 0: nothing is written. */

struct AdamScalars {
    float decay, b1w, b2, b2w, eps, step_size, bc2_sqrt;
};

template <typename W>
__device__ __forceinline__ void adamw_one(float &p, float &m, float &v, float g, float gs,
                                          const AdamScalars &c, W *pa, int64_t i)
{
    float gi = __fmul_rn(g, gs);
    float pi = __fmul_rn(p, c.decay);
    float mi = __fadd_rn(m, __fmul_rn(c.b1w, __fsub_rn(gi, m)));
    float vi = __fadd_rn(__fmul_rn(v, c.b2), __fmul_rn(__fmul_rn(c.b2w, gi), gi));
    float denom = __fadd_rn(__fdiv_rn(__fsqrt_rn(vi), c.bc2_sqrt), c.eps);
    pi = __fsub_rn(pi, __fmul_rn(c.step_size, __fdiv_rn(mi, denom)));
    p = pi;
    m = mi;
    v = vi;
    if (pa)
        pa[i] = from_f32<W>(pi);
}

template <typename W>
__global__ void adamw_kernel(float *p, const float *g, float *m, float *v, W *pa, int64_t n,
                             AdamScalars c, const float *gsp, const int32_t *skip, bool vec)
{
    if (skip && *skip)
        return;
    const float gs = gsp ? *gsp : 1.0f;
    const int64_t stride = (int64_t)gridDim.x * blockDim.x;
    const int64_t k0 = (int64_t)blockIdx.x * blockDim.x + threadIdx.x;
    int64_t done = 0;
    if (vec) {
        const int64_t nv = n / 4;
        for (int64_t k = k0; k < nv; k += stride) {
            float4 pp = ((float4 *)p)[k], gg = ((const float4 *)g)[k];
            float4 mm = ((float4 *)m)[k], vv = ((float4 *)v)[k];
            adamw_one(pp.x, mm.x, vv.x, gg.x, gs, c, pa, 4 * k);
            adamw_one(pp.y, mm.y, vv.y, gg.y, gs, c, pa, 4 * k + 1);
            adamw_one(pp.z, mm.z, vv.z, gg.z, gs, c, pa, 4 * k + 2);
            adamw_one(pp.w, mm.w, vv.w, gg.w, gs, c, pa, 4 * k + 3);
            ((float4 *)p)[k] = pp;
            ((float4 *)m)[k] = mm;
            ((float4 *)v)[k] = vv;
        }
        done = nv * 4;
    }
    for (int64_t i = done + k0; i < n; i += stride) {
        float pp = p[i], mm = m[i], vv = v[i];
        adamw_one(pp, mm, vv, g[i], gs, c, pa, i);
        p[i] = pp;
        m[i] = mm;
        v[i] = vv;
    }
}

int cuda_adamw(dfl_be *be, const dfl_adamw *a)
{
    if (a->n <= 0)
        return 0;
    if (a->step < 1)
        return cuda_op_fail(be, DFL_EUSAGE, "adamw: step %lld (the first step is 1)", (long long)a->step);
    int rc = cuda_enter(be);
    if (rc)
        return rc;
    const double bc1 = 1.0 - pow((double)a->beta1, (double)a->step);
    const double bc2 = 1.0 - pow((double)a->beta2, (double)a->step);
    AdamScalars c;
    c.step_size = (float)((double)a->lr / bc1);
    c.bc2_sqrt = (float)sqrt(bc2);
    c.decay = 1.0f - a->lr * a->weight_decay;
    c.b1w = 1.0f - a->beta1;
    c.b2 = a->beta2;
    c.b2w = 1.0f - a->beta2;
    c.eps = a->eps;
    void *pa = a->p_act && a->p_act != (void *)a->p ? a->p_act : NULL;
    bool vec = is_aligned(a->p, 16) && is_aligned(a->g, 16) && is_aligned(a->m, 16) && is_aligned(a->v, 16);
    unsigned g = grid_for((a->n + 3) / 4, TR_THREADS, tr_max_blocks(be));
    cudaStream_t s = cuda_of(be)->stream;
    if (pa && be->wdt == DFL_BF16)
        adamw_kernel<bf16><<<g, TR_THREADS, 0, s>>>(a->p, a->g, a->m, a->v, (bf16 *)pa, a->n, c,
                                                    a->grad_scale, a->skip, vec);
    else
        adamw_kernel<float><<<g, TR_THREADS, 0, s>>>(a->p, a->g, a->m, a->v, (float *)pa, a->n, c,
                                                     a->grad_scale, a->skip, vec);
    return cuda_launch_check(be, "adamw");
}

/* ------------------------------------------------------------------------------------------ */
/* uniform_noise: x[i] += amp * (2 u_i - 1), u_i = dfl_noise_u01(seed, i) (backend.h), computed
 * with the same f32 operations as the CPU op (no contraction), then rounded to the act type. */

__device__ __forceinline__ float noise_u01(uint64_t seed, uint64_t i)
{
    uint64_t z = seed + (i + 1) * 0x9E3779B97F4A7C15ull;
    z = (z ^ (z >> 30)) * 0xBF58476D1CE4E5B9ull;
    z = (z ^ (z >> 27)) * 0x94D049BB133111EBull;
    z ^= z >> 31;
    return (float)(z >> 40) * (1.0f / 16777216.0f);
}

template <typename T>
__global__ void uniform_noise_kernel(T *x, int64_t n, float amp, uint64_t seed)
{
    for (int64_t i = (int64_t)blockIdx.x * blockDim.x + threadIdx.x; i < n;
         i += (int64_t)gridDim.x * blockDim.x) {
        float u = noise_u01(seed, (uint64_t)i);
        float t = __fsub_rn(__fmul_rn(2.0f, u), 1.0f);
        x[i] = from_f32<T>(__fadd_rn(to_f32(x[i]), __fmul_rn(amp, t)));
    }
}

int cuda_uniform_noise(dfl_be *be, void *x, int64_t n, float amp, uint64_t seed)
{
    if (n <= 0)
        return 0;
    int rc = cuda_enter(be);
    if (rc)
        return rc;
    unsigned g = grid_for(n, TR_THREADS, tr_max_blocks(be));
    cudaStream_t s = cuda_of(be)->stream;
    if (be->act == DFL_BF16)
        uniform_noise_kernel<bf16><<<g, TR_THREADS, 0, s>>>((bf16 *)x, n, amp, seed);
    else
        uniform_noise_kernel<float><<<g, TR_THREADS, 0, s>>>((float *)x, n, amp, seed);
    return cuda_launch_check(be, "uniform_noise");
}

/* ------------------------------------------------------------------------------------------ */
/* lmce: per chunk of nr rows,
 *  1. logits [nr, V] f32 = z W^T (cuBLASLt, into work);
 *  2. one block per row: max, first argmax and sum of exp in one pass (online, per thread, then
 *     a fixed-order block combine); ce = lse - logit[label]; then, if dz is wanted, the row is
 *     replaced by G = grad_scale w (softmax - onehot(label)): in bf16 mode G is written as bf16
 *     into the first half of the row's own bytes (row stride 2V bf16 elements), tile by tile
 *     behind a barrier so that no f32 logit is overwritten before it is read; in f32 mode in
 *     place. Rows with w == 0 get G = 0;
 *  3. one warp adds the chunk's per-row w*ce, w, hits and counts into sums in a fixed order;
 *  4. dz rows = G W (cuBLASLt).
 * work: [chunk_rows, V] logits, then [chunk_rows] w*ce and [chunk_rows] hits. */

#define LMCE_THREADS 1024

struct Smx {
    float m, s;
    int64_t a;
};

__device__ __forceinline__ Smx smx_combine(Smx x, Smx y)
{
    Smx r;
    r.m = fmaxf(x.m, y.m);
    float fx = x.m == -INFINITY ? 0.0f : x.s * expf(x.m - r.m);
    float fy = y.m == -INFINITY ? 0.0f : y.s * expf(y.m - r.m);
    r.s = fx + fy;
    r.a = x.m > y.m ? x.a : y.m > x.m ? y.a : (x.a < y.a ? x.a : y.a);
    return r;
}

__device__ __forceinline__ void smx_add(Smx &t, float x, int64_t v)
{
    if (x > t.m) {
        t.s = t.s * expf(t.m - x) + 1.0f;
        t.m = x;
        t.a = v;
    } else {
        t.s += expf(x - t.m);
    }
}

template <bool BF16G>
__global__ void __launch_bounds__(LMCE_THREADS)
lmce_row_kernel(float *logits, int64_t V, int64_t r0, const int32_t *labels, const float *weight,
                float grad_scale, bool want_grad, uint8_t *correct, float *ce_out, float *row_wce,
                float *row_hit)
{
    __shared__ float shm[32], shs[32];
    __shared__ int64_t sha[32];
    const int64_t r = blockIdx.x, q = r0 + r;
    float *lr = logits + r * V;
    const float w = weight[q];
    const bool vec = V % 4 == 0;   /* rows 16-byte aligned (work is) */
    if (!(w > 0)) {
        if (threadIdx.x == 0) {
            row_wce[r] = 0.0f;
            row_hit[r] = 0.0f;
            if (correct)
                correct[q] = 0;
            if (ce_out)
                ce_out[q] = 0.0f;
        }
        if (want_grad) {
            if (BF16G) {
                bf16 *gr = (bf16 *)lr;
                for (int64_t v = threadIdx.x; v < V; v += blockDim.x)
                    gr[v] = __float2bfloat16_rn(0.0f);
            } else {
                for (int64_t v = threadIdx.x; v < V; v += blockDim.x)
                    lr[v] = 0.0f;
            }
        }
        return;
    }
    Smx t = {-INFINITY, 0.0f, 0};
    if (vec) {
        const float4 *l4 = (const float4 *)lr;
        for (int64_t k = threadIdx.x; k < V / 4; k += blockDim.x) {
            float4 x = l4[k];
            smx_add(t, x.x, 4 * k);
            smx_add(t, x.y, 4 * k + 1);
            smx_add(t, x.z, 4 * k + 2);
            smx_add(t, x.w, 4 * k + 3);
        }
    } else {
        for (int64_t v = threadIdx.x; v < V; v += blockDim.x)
            smx_add(t, lr[v], v);
    }
#pragma unroll
    for (int o = 16; o > 0; o >>= 1) {
        Smx u;
        u.m = __shfl_xor_sync(0xffffffffu, t.m, o);
        u.s = __shfl_xor_sync(0xffffffffu, t.s, o);
        u.a = __shfl_xor_sync(0xffffffffu, t.a, o);
        t = smx_combine(t, u);
    }
    const int lane = threadIdx.x & 31, wid = threadIdx.x >> 5, nw = blockDim.x >> 5;
    if (lane == 0) {
        shm[wid] = t.m;
        shs[wid] = t.s;
        sha[wid] = t.a;
    }
    __syncthreads();
    Smx tot = {shm[0], shs[0], sha[0]};
    for (int i = 1; i < nw; i++) {
        Smx u = {shm[i], shs[i], sha[i]};
        tot = smx_combine(tot, u);
    }
    const int32_t label = labels[q];
    const float xl = lr[label];
    const double lse = (double)tot.m + log((double)tot.s);
    if (threadIdx.x == 0) {
        double ce = lse - (double)xl;
        bool hit = tot.a == (int64_t)label;
        row_wce[r] = (float)((double)w * ce);
        row_hit[r] = hit ? 1.0f : 0.0f;
        if (correct)
            correct[q] = hit;
        if (ce_out)
            ce_out[q] = (float)ce;
    }
    if (!want_grad)
        return;
    const float gw = grad_scale * w;
    const float lsef = (float)lse;
    if (BF16G) {
        /* in place, f32 -> bf16 in the first half of the row: a barrier between reading a tile
         * and writing it (the writes of tile k land on f32 elements of tiles <= k/2) */
        bf16 *gr = (bf16 *)lr;
        const int64_t tile = (int64_t)blockDim.x * 4;
        for (int64_t base = 0; base < V; base += tile) {
            int64_t v0 = base + (int64_t)threadIdx.x * 4;
            float x[4];
#pragma unroll
            for (int j = 0; j < 4; j++)
                x[j] = v0 + j < V ? lr[v0 + j] : 0.0f;
            __syncthreads();
#pragma unroll
            for (int j = 0; j < 4; j++) {
                int64_t v = v0 + j;
                if (v < V) {
                    float g = gw * expf(x[j] - lsef);
                    if (v == label)
                        g -= gw;
                    gr[v] = __float2bfloat16_rn(g);
                }
            }
        }
    } else {
        for (int64_t v = threadIdx.x; v < V; v += blockDim.x) {
            float g = gw * expf(lr[v] - lsef);
            if (v == label)
                g -= gw;
            lr[v] = g;
        }
    }
}

/* sums += the chunk's rows, in a fixed order (one warp) */
__global__ void lmce_sums_kernel(double *sums, const float *row_wce, const float *row_hit,
                                 const float *weight, int64_t r0, int64_t nr)
{
    double ln = 0, ld = 0, an = 0, ad = 0;
    for (int64_t r = threadIdx.x; r < nr; r += 32) {
        float w = weight[r0 + r];
        if (!(w > 0))
            continue;
        ln += row_wce[r];
        ld += w;
        an += row_hit[r];
        ad += 1.0;
    }
    ln = tr_warp_sum_d(ln);
    ld = tr_warp_sum_d(ld);
    an = tr_warp_sum_d(an);
    ad = tr_warp_sum_d(ad);
    if (threadIdx.x == 0) {
        sums[DFL_SUM_LOSS_NUM] += ln;
        sums[DFL_SUM_LOSS_DEN] += ld;
        sums[DFL_SUM_ACC_NUM] += an;
        sums[DFL_SUM_ACC_DEN] += ad;
    }
}

int cuda_lmce(dfl_be *be, const dfl_lmce *a)
{
    if (a->Q <= 0)
        return 0;
    if (a->V <= 0 || a->H <= 0)
        return cuda_op_fail(be, DFL_EUSAGE, "lmce: vocabulary %lld, hidden %lld", (long long)a->V,
                            (long long)a->H);
    int rc = cuda_enter(be);
    if (rc)
        return rc;
    const int64_t V = a->V, H = a->H, CR = a->chunk_rows > 0 ? a->chunk_rows : 1;
    if (CR > INT32_MAX)
        return cuda_op_fail(be, DFL_EUNSUP, "lmce: chunk of %lld rows", (long long)CR);
    const bool bf = be->act == DFL_BF16;
    if (bf && be->wdt != DFL_BF16)
        return cuda_op_fail(be, DFL_EUNSUP, "lmce: bf16 activations need bf16 weights");
    float *logits = a->work;
    float *row_wce = a->work + CR * V;
    float *row_hit = row_wce + CR;
    const size_t as = dfl_dtype_size(be->act);
    cudaStream_t s = cuda_of(be)->stream;
    for (int64_t r0 = 0; r0 < a->Q; r0 += CR) {
        const int64_t nr = a->Q - r0 < CR ? a->Q - r0 : CR;
        dfl_mm mm;
        memset(&mm, 0, sizeof mm);
        mm.M = nr;
        mm.N = V;
        mm.K = H;
        mm.A = (const char *)a->z + (size_t)(r0 * H) * as;
        mm.adt = be->act;
        mm.lda = H;
        mm.B = a->w_lm;
        mm.bdt = be->wdt;
        mm.ldb = H;
        mm.tb = true;
        mm.C = logits;
        mm.cdt = DFL_F32;
        mm.ldc = V;
        mm.alpha = 1.0f;
        mm.beta = 0.0f;
        if ((rc = be->ops->matmul(be, &mm)))
            return rc;
        const bool grad = a->dz != NULL;
        if (bf)
            lmce_row_kernel<true><<<(unsigned)nr, LMCE_THREADS, 0, s>>>(
                logits, V, r0, a->labels, a->weight, a->grad_scale, grad, a->correct, a->ce_out,
                row_wce, row_hit);
        else
            lmce_row_kernel<false><<<(unsigned)nr, LMCE_THREADS, 0, s>>>(
                logits, V, r0, a->labels, a->weight, a->grad_scale, grad, a->correct, a->ce_out,
                row_wce, row_hit);
        if ((rc = cuda_launch_check(be, "lmce (rows)")))
            return rc;
        lmce_sums_kernel<<<1, 32, 0, s>>>(a->sums, row_wce, row_hit, a->weight, r0, nr);
        if ((rc = cuda_launch_check(be, "lmce (sums)")))
            return rc;
        if (grad) {
            dfl_mm mz;
            memset(&mz, 0, sizeof mz);
            mz.M = nr;
            mz.N = H;
            mz.K = V;
            mz.A = logits;
            mz.adt = be->act;          /* G: bf16 (row stride 2V) or f32 (stride V) */
            mz.lda = bf ? 2 * V : V;
            mz.B = a->w_lm;
            mz.bdt = be->wdt;
            mz.ldb = H;
            mz.C = (char *)a->dz + (size_t)(r0 * H) * as;
            mz.cdt = be->act;
            mz.ldc = H;
            mz.alpha = 1.0f;
            mz.beta = 0.0f;
            if ((rc = be->ops->matmul(be, &mz)))
                return rc;
        }
    }
    return 0;
}
