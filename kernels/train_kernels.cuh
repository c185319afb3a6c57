/* train_kernels.cuh: the device code of the drafter ops of kernels/train_ops.cu (which has the
 * design notes and the launches). Needs, from the including file: bf16, Pack, to_f32/from_f32
 * (be_cuda.cuh), df_exp2 (dflash_ptx.cuh) and backend.h's DFL_SUM_*; tests/emu compiles the same
 * code for the CPU. */
#ifndef DFL_TRAIN_KERNELS_CUH
#define DFL_TRAIN_KERNELS_CUH

#include "be_math.h"
#include "warp_sum.cuh"

#ifndef DF_DYN_SMEM
#define DF_DYN_SMEM(name) extern __shared__ __align__(128) unsigned char name[]
#endif

#define RB_MAX_THREADS 512
#define QKB_WARPS 8
#define SUMSQ_THREADS 256
#define LMCE_THREADS 256

/* dw[i] += (float)(sum over b < nb of part[b * n + i]), in block order; AHEAD loads in flight a
 * thread ahead of the adds (the same order, so the same bits, for every AHEAD: 1 is the first
 * form, TR_COLSUM_AHEAD the faster one) */
#define TR_COLSUM_AHEAD 32
template <int AHEAD> static __global__ void tr_colsum_kernel(float *dw, const double *part, int nb, int64_t n)
{
    int64_t i = (int64_t)blockIdx.x * blockDim.x + threadIdx.x;
    if (i >= n)
        return;
    double s = 0.0;
    int b = 0;
    for (; b + AHEAD <= nb; b += AHEAD) {
        double v[AHEAD];
#pragma unroll
        for (int u = 0; u < AHEAD; u++)
            v[u] = part[(int64_t)(b + u) * n + i];
#pragma unroll
        for (int u = 0; u < AHEAD; u++)
            s += v[u];
    }
    for (; b < nb; b++)
        s += part[(int64_t)b * n + i];
    dw[i] += (float)s;
}

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
        dot = block_sum_sh(dot, sh);
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
                ss = warp_sum(ss);
                sc = 1.0f / sqrtf(ss / (float)d + eps);
            }
            float dot = 0.0f;
#pragma unroll
            for (int j = 0; j < MAXJ; j++)
#pragma unroll
                for (int p = 0; p < P; p++)
                    dot += w1[j][p] * g1[j][p] * x1[j][p] + w2[j][p] * g2[j][p] * x2[j][p];
            dot = warp_sum(dot);
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

/* A hint that the 128-byte line at p will be read soon: fetched into L2, no register taken
 * (nothing in the emulator). */
__device__ __forceinline__ void prefetch_l2(const void *p)
{
#ifdef __CUDA_ARCH__
    asm volatile("prefetch.global.L2 [%0];" ::"l"(p));
#else
    (void)p;
#endif
}

/* rmsnorm_bwd_kernel's faster form, for rows of at most two packs a thread (P <= 2): the same
 * partition, thread layout, arithmetic and order. What differs: at most 64 registers a thread
 * (four blocks of 256 threads on a multiprocessor: the 512 blocks of a [32768, 4096] call run in
 * one wave instead of two), for which the dw sums live in shared memory (P VEC floats a thread,
 * rb_pf_smem_bytes) and w is read again for every row (from the cache); the old dx of the row is
 * loaded before its block sum, the next row's dy and x right after its own sum, and the row after
 * that is fetched into L2 (a hint, no registers) while this one is summed. */
static inline size_t rb_pf_smem_bytes(int p, int vec, int threads) { return (size_t)p * vec * threads * sizeof(float); }

template <typename T, int VEC, int P>
__global__ void __launch_bounds__(RB_MAX_THREADS, 2)
rmsnorm_bwd_pf_kernel(T *dx, double *part, const T *dy, const T *x, const T *w, const float *rstd,
                      int64_t R, int64_t n, int64_t rpb, bool acc)
{
    typedef Pack<T, VEC> PK;
    static_assert(P <= 2, "rmsnorm_bwd_pf_kernel: at most two packs a thread");
    constexpr int LINE = 128 / (int)sizeof(PK) > 0 ? 128 / (int)sizeof(PK) : 1;   /* packs a cache line */
    __shared__ float sh[32];
    DF_DYN_SMEM(rb_smem);
    float *dwa = (float *)rb_smem;   /* [P VEC][blockDim.x]: element (k, j) of thread t */
    const int t = (int)threadIdx.x, nt = (int)blockDim.x;
    const int64_t nv = n / VEC;
    const int64_t r0 = (int64_t)blockIdx.x * rpb;
    const int64_t r1 = r0 + rpb < R ? r0 + rpb : R;
    const PK *wv = (const PK *)w;
    PK yp[P], xp[P];
#pragma unroll
    for (int k = 0; k < P; k++) {
        int64_t c = t + (int64_t)k * nt;
        yp[k] = c < nv && r0 < r1 ? ((const PK *)(dy + r0 * n))[c] : PK{};
        xp[k] = c < nv && r0 < r1 ? ((const PK *)(x + r0 * n))[c] : PK{};
#pragma unroll
        for (int j = 0; j < VEC; j++)
            dwa[(k * VEC + j) * nt + t] = 0.0f;
    }
    const float inv_n = 1.0f / (float)n;
    for (int64_t r = r0; r < r1; r++) {
        PK *dxr = (PK *)(dx + r * n);
        const float s = rstd[r];
        PK o[P];
#pragma unroll
        for (int k = 0; k < P; k++) {
            int64_t c = t + (int64_t)k * nt;
            o[k] = acc && c < nv ? dxr[c] : PK{};
            if (r + 1 < r1 && c < nv && c % LINE == 0) {
                prefetch_l2((const PK *)(dy + (r + 1) * n) + c);
                prefetch_l2((const PK *)(x + (r + 1) * n) + c);
                if (acc)
                    prefetch_l2((const PK *)(dx + (r + 1) * n) + c);
            }
        }
        float dot = 0.0f;
#pragma unroll
        for (int k = 0; k < P; k++) {
            int64_t c = t + (int64_t)k * nt;
            const PK wp = c < nv ? wv[c] : PK{};
#pragma unroll
            for (int j = 0; j < VEC; j++)
                dot += to_f32(wp.v[j]) * to_f32(yp[k].v[j]) * to_f32(xp[k].v[j]);
        }
        dot = block_sum_sh(dot, sh);
        const float cm = dot * s * inv_n;   /* mean(w dy xhat) */
#pragma unroll
        for (int k = 0; k < P; k++) {
            int64_t c = t + (int64_t)k * nt;
            if (c < nv) {
                const PK wp = wv[c];
#pragma unroll
                for (int j = 0; j < VEC; j++) {
                    float fy = to_f32(yp[k].v[j]), fx = to_f32(xp[k].v[j]);
                    float gv = s * (to_f32(wp.v[j]) * fy - fx * s * cm);
                    o[k].v[j] = from_f32<T>(acc ? to_f32(o[k].v[j]) + gv : gv);
                    dwa[(k * VEC + j) * nt + t] += fy * fx * s;
                }
                dxr[c] = o[k];
            }
            if (r + 1 < r1) {
                yp[k] = c < nv ? ((const PK *)(dy + (r + 1) * n))[c] : PK{};
                xp[k] = c < nv ? ((const PK *)(x + (r + 1) * n))[c] : PK{};
            }
        }
    }
    if (part) {
        double *pb = part + (int64_t)blockIdx.x * n;
#pragma unroll
        for (int k = 0; k < P; k++) {
            int64_t c = t + (int64_t)k * nt;
            if (c < nv)
#pragma unroll
                for (int j = 0; j < VEC; j++)
                    pb[c * VEC + j] = (double)dwa[(k * VEC + j) * nt + t];
        }
    }
}

/* The sum over a head of qknorm_rope_bwd_kernel for heads of QKV_D = 128 (P = 2, MAXJ = 1 there:
 * old lane l holds elements 2 l, 2 l + 1 of each half), from the K = 32 / G partials of each of
 * the G lanes of a group that holds the head V = 2 K elements a half (its lane c the old lanes
 * c K .. c K + K - 1): the old butterfly's offsets 16 .. K cross the group's lanes (offsets
 * G / 2 .. 1 here), K / 2 .. 1 the thread's own partials; so the same sum, added in the same
 * order. */
#define QKV_D 128

template <int G, int K> __device__ __forceinline__ float qkv_oldsum(float (&v)[K])
{
#pragma unroll
    for (int k = 0; k < K; k++)
        v[k] = warp_sum<G>(v[k]);
#pragma unroll
    for (int o = K / 2; o > 0; o >>= 1)
#pragma unroll
        for (int k = 0; k < o; k++)
            v[k] = v[k] + v[k + o];
    return v[0];
}

/* qknorm_rope_bwd for heads of QKV_D = 128, by rows: warp w of block b takes the rows
 * b QKR_ROWS + w, + QKR_WARPS, ... (at most QKR_ROWS / QKR_WARPS of them), and each row's heads
 * HPW at a time, as the forward's fast path does: a group of G = 64 / V adjacent lanes holds one
 * head, lane c of the group the V elements [c V, c V + V) of each half (16-byte loads). A row's
 * sines and cosines (the same sincosf of the same arguments as qknorm_rope_bwd_kernel) are
 * computed once a warp, V / HPW a lane, into shared memory (shcs). dx is computed
 * as in qknorm_rope_bwd_kernel, with the sums over a head in its order (qkv_oldsum). dw: each lane
 * adds its elements' terms in f32 (at most QKR_ROWS / QKR_WARPS rows x heads / HPW terms), the
 * block adds its lanes' sums in double in a fixed order into part[b] (so dw is not the first
 * kernel's bit for bit: the order of its sums differs). The row's next heads are fetched into L2
 * while these are computed. */
#define QKR_WARPS 4
#define QKR_ROWS 32

template <typename T>
__global__ void __launch_bounds__(QKR_WARPS * 32, 4)
qknorm_rope_bwd_row_kernel(T *dx, int64_t ld, double *part, const T *xin, const T *w, const float *rstd,
                           const int32_t *pos, const float *inv_freq, int64_t R, int heads, float eps)
{
    constexpr int half = QKV_D / 2, V = 16 / (int)sizeof(T), G = half / V, K = V / 2, HPW = 32 / G, VS = V / HPW;
    static_assert(G * K == 32 && HPW * G == 32 && VS * HPW == V, "qknorm_rope_bwd_row_kernel: layout");
    typedef Pack<T, V> PK;
    __shared__ float shd[QKR_WARPS][HPW][QKV_D];
    __shared__ float2 shcs[QKR_WARPS][QKV_D / 2];   /* the warp's row: (cos, sin) of frequency c V + j at j G + c */
    const int lane = (int)threadIdx.x & 31, wid = (int)threadIdx.x >> 5, c = lane % G, slot = lane / G;
    const int64_t rb0 = (int64_t)blockIdx.x * QKR_ROWS, rb1 = rb0 + QKR_ROWS < R ? rb0 + QKR_ROWS : R;
    PK w1, w2;
    float d1[V], d2[V];
#pragma unroll
    for (int j = 0; j < V; j++) {
        w1.v[j] = w ? w[c * V + j] : from_f32<T>(0.0f);
        w2.v[j] = w ? w[half + c * V + j] : from_f32<T>(0.0f);
        d1[j] = d2[j] = 0.0f;
    }
    for (int64_t r = rb0 + wid; r < rb1; r += QKR_WARPS) {
        const float fp = (float)pos[r];
        __syncwarp();   /* the previous row's table is read no more */
#pragma unroll
        for (int q = 0; q < VS; q++) {   /* this lane's share: frequencies c V + slot VS + q */
            float sn, cs;
            sincosf(fp * inv_freq[c * V + slot * VS + q], &sn, &cs);
            shcs[wid][(slot * VS + q) * G + c] = make_float2(cs, sn);
        }
        __syncwarp();
        T *dr = dx + r * ld;
        const T *xr = xin + r * ld;
        for (int h0 = 0; h0 < heads; h0 += HPW) {
            const int h = h0 + slot;
            const bool on = h < heads;
            T *dv = dr + (int64_t)h * QKV_D + c * V;
            const T *xv = xr + (int64_t)h * QKV_D + c * V;
            PK da, db, xa, xb;
            if (on) {
                da = *(const PK *)dv;
                db = *(const PK *)(dv + half);
                xa = *(const PK *)xv;
                xb = *(const PK *)(xv + half);
                if (h + HPW < heads && (c * V * (int)sizeof(T)) % 128 == 0) {
                    prefetch_l2(dv + HPW * QKV_D);
                    prefetch_l2(dv + HPW * QKV_D + half);
                    prefetch_l2(xv + HPW * QKV_D);
                    prefetch_l2(xv + HPW * QKV_D + half);
                }
            }
            float g1[V], g2[V], x1[V], x2[V], ss[K];
#pragma unroll
            for (int k = 0; k < K; k++)
                ss[k] = 0.0f;
#pragma unroll
            for (int j = 0; j < V; j++) {
                const float2 t = shcs[wid][j * G + c];
                const float u1 = on ? to_f32(da.v[j]) : 0.0f, v1 = on ? to_f32(db.v[j]) : 0.0f;
                g1[j] = u1 * t.x + v1 * t.y;
                g2[j] = -u1 * t.y + v1 * t.x;
                x1[j] = on ? to_f32(xa.v[j]) : 0.0f;
                x2[j] = on ? to_f32(xb.v[j]) : 0.0f;
                ss[j / 2] += x1[j] * x1[j] + x2[j] * x2[j];
            }
            if (w) {
                float sc;
                if (rstd)
                    sc = on ? rstd[r * heads + h] : 1.0f;
                else
                    sc = 1.0f / sqrtf(qkv_oldsum<G, K>(ss) / (float)QKV_D + eps);
                float dot[K];
#pragma unroll
                for (int k = 0; k < K; k++)
                    dot[k] = 0.0f;
#pragma unroll
                for (int j = 0; j < V; j++)
                    dot[j / 2] += to_f32(w1.v[j]) * g1[j] * x1[j] + to_f32(w2.v[j]) * g2[j] * x2[j];
                const float m = qkv_oldsum<G, K>(dot) * sc / (float)QKV_D;
#pragma unroll
                for (int j = 0; j < V; j++) {
                    const float xs1 = x1[j] * sc, xs2 = x2[j] * sc;
                    if (on) {
                        d1[j] += g1[j] * xs1;
                        d2[j] += g2[j] * xs2;
                    }
                    g1[j] = sc * (to_f32(w1.v[j]) * g1[j] - x1[j] * sc * m);
                    g2[j] = sc * (to_f32(w2.v[j]) * g2[j] - x2[j] * sc * m);
                }
            }
            if (on) {
                PK oa, ob;
#pragma unroll
                for (int j = 0; j < V; j++) {
                    oa.v[j] = from_f32<T>(g1[j]);
                    ob.v[j] = from_f32<T>(g2[j]);
                }
                *(PK *)dv = oa;
                *(PK *)(dv + half) = ob;
            }
        }
    }
    if (!part)
        return;
#pragma unroll
    for (int j = 0; j < V; j++) {
        shd[wid][slot][c * V + j] = d1[j];
        shd[wid][slot][half + c * V + j] = d2[j];
    }
    __syncthreads();
    for (int i = threadIdx.x; i < QKV_D; i += blockDim.x) {
        double s = 0.0;
        for (int k = 0; k < QKR_WARPS; k++)
            for (int l = 0; l < HPW; l++)
                s += (double)shd[k][l][i];
        part[(int64_t)blockIdx.x * QKV_D + i] = s;
    }
}

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

static __global__ void __launch_bounds__(SUMSQ_THREADS)
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
    s = block_sum_sh(s, sh);
    if (threadIdx.x == 0)
        part[blockIdx.x] = s;
}

/* one warp: lane l adds part[l], part[l + 32], ... in order; then a fixed shuffle tree */
static __global__ void sumsq_final_kernel(double *out, const double *part, int nb)
{
    double s = 0.0;
    for (int i = threadIdx.x; i < nb; i += 32)
        s += part[i];
    s = warp_sum(s);
    if (threadIdx.x == 0)
        out[0] += s;
}

static __global__ void clip_scale_kernel(float *out, int32_t *skip, const double *sums, float max_norm)
{
    dfl_clip_scale_of(out, skip, sums, max_norm);
}

/* block_metrics, one block: thread t counts slot t % bs over the blocks b = t / bs (mod the
 * number of such groups), then the groups' counts are added; the acceptance lengths are summed
 * over blocks. All counts are integers, exact in any order. bs <= BM_THREADS. */
#define BM_THREADS 256
static __global__ void __launch_bounds__(BM_THREADS)
block_metrics_kernel(double *out, const uint8_t *correct, const float *weight, int64_t n_blocks, int bs)
{
    __shared__ double sh[32];
    __shared__ long long sc[BM_THREADS], shits[BM_THREADS];
    const int groups = BM_THREADS / bs, t = threadIdx.x, j = t % bs, g = t / bs;
    long long scored = 0, hits = 0;
    if (g < groups)
        for (int64_t b = g; b < n_blocks; b += groups) {
            scored += weight[b * bs + j] > 0;
            hits += correct[b * bs + j];
        }
    sc[t] = scored;
    shits[t] = hits;
    long long len = 0, cnt = 0;
    if (bs > 1)
        for (int64_t b = t; b < n_blocks; b += blockDim.x) {
            if (!(weight[b * bs + 1] > 0))
                continue;
            int n = 0;
            while (n + 1 < bs && correct[b * bs + n + 1])
                n++;
            len += 1 + n;
            cnt++;
        }
    double tl = block_sum_sh((double)len, sh);   /* (its barriers also publish sc, shits) */
    double tc = block_sum_sh((double)cnt, sh);
    if (t < bs) {
        long long a = 0, h = 0;
        for (int k = 0; k < groups; k++) {
            a += sc[k * bs + t];
            h += shits[k * bs + t];
        }
        out[t] += (double)a;
        out[bs + t] += (double)h;
    }
    if (t == 0) {
        out[2 * bs] += tl;
        out[2 * bs + 1] += tc;
    }
}

/* vec: p, g, m, v 16-byte aligned and pa (if any) aligned to 4 of its elements */
template <typename W>
__global__ void adamw_kernel(float *p, const float *g, float *m, float *v, W *pa, int64_t n,
                             dfl_adam_scalars c, dfl_adam_scalars c_prev, const int32_t *prev_skip,
                             const float *gsp, const int32_t *skip, bool vec)
{
    if (skip && *skip)
        return;
    if (prev_skip && *prev_skip)   /* the previous update was skipped: this one is step - 1 */
        c = c_prev;
    const float gs = gsp ? *gsp : 1.0f;
    const int64_t stride = (int64_t)gridDim.x * blockDim.x;
    const int64_t k0 = (int64_t)blockIdx.x * blockDim.x + threadIdx.x;
    int64_t done = 0;
    if (vec) {
        const int64_t nv = n / 4;
        for (int64_t k = k0; k < nv; k += stride) {
            float4 pp = ((float4 *)p)[k], gg = ((const float4 *)g)[k];
            float4 mm = ((float4 *)m)[k], vv = ((float4 *)v)[k];
            Pack<W, 4> o;
            o.v[0] = from_f32<W>(dfl_adamw_one(&pp.x, &mm.x, &vv.x, gg.x, gs, &c));
            o.v[1] = from_f32<W>(dfl_adamw_one(&pp.y, &mm.y, &vv.y, gg.y, gs, &c));
            o.v[2] = from_f32<W>(dfl_adamw_one(&pp.z, &mm.z, &vv.z, gg.z, gs, &c));
            o.v[3] = from_f32<W>(dfl_adamw_one(&pp.w, &mm.w, &vv.w, gg.w, gs, &c));
            ((float4 *)p)[k] = pp;
            ((float4 *)m)[k] = mm;
            ((float4 *)v)[k] = vv;
            if (pa)
                ((Pack<W, 4> *)pa)[k] = o;
        }
        done = nv * 4;
    }
    for (int64_t i = done + k0; i < n; i += stride) {
        float pp = p[i], mm = m[i], vv = v[i];
        float pn = dfl_adamw_one(&pp, &mm, &vv, g[i], gs, &c);
        p[i] = pp;
        m[i] = mm;
        v[i] = vv;
        if (pa)
            pa[i] = from_f32<W>(pn);
    }
}

template <typename T>
__global__ void uniform_noise_kernel(T *x, int64_t n, float amp, uint64_t seed)
{
    for (int64_t i = (int64_t)blockIdx.x * blockDim.x + threadIdx.x; i < n;
         i += (int64_t)gridDim.x * blockDim.x) {
        x[i] = from_f32<T>(__fadd_rn(to_f32(x[i]), dfl_noise_add(seed, (uint64_t)i, amp)));
    }
}

/* A running (max, sum of exp(x - max) in double, first argmax) */
struct Smx {
    float m;
    double s;
    int64_t a;
};

__device__ __forceinline__ Smx smx_combine(Smx x, Smx y)
{
    Smx r;
    r.m = fmaxf(x.m, y.m);
    double fx = x.m == -INFINITY ? 0.0 : x.s * exp((double)(x.m - r.m));
    double fy = y.m == -INFINITY ? 0.0 : y.s * exp((double)(y.m - r.m));
    r.s = fx + fy;
    r.a = x.m > y.m ? x.a : y.m > x.m ? y.a : (x.a < y.a ? x.a : y.a);
    return r;
}

/* The lmce row work of a chunk, in three kernels over the logits [nr, V] (row stride ld): f32 in
 * f32 mode; in bf16 mode bf16, as a bf16 model's LM head gives them (the GEMM accumulates in f32
 * and rounds once), which halves the traffic of the two passes over them. Rows of weight 0 are
 * not read: their results are 0, their G rows 0.
 *  1. lmce_stats_kernel: block (s, r) reduces slice s (LMCE_SLICE logits) of row r to a partial
 *     (max, sum of exp(x - max) in double, first argmax);
 *  2. lmce_finish_kernel: one warp a row combines its partials in a fixed order (so the result
 *     does not depend on scheduling) into the log-sum-exp; writes ce, the hit and the row sums;
 *  3. lmce_grad_kernel: G = grad_scale w (exp(x - lse) - onehot(label)), elementwise, in place
 *     over the logits in their own type (the dz GEMM's A).
 * Every kernel reads the logits in 16-byte groups (LMCE_G(X) elements: 4 f32 or 8 bf16), LMCE_PF
 * groups a thread at a time (their loads issued together); rows whose V is not a multiple of the
 * group take the same path with scalar loads and stores.
 *
 * Both passes are bandwidth-bound only if their arithmetic stays off the GPU's slow pipes
 * (conversions to and from double and the exponential run at 16 a clock an SM, double
 * arithmetic at 64, f32 at 128). So a statistics thread sums its LMCE_PF groups' exponentials in
 * f32 (at most 32 terms, each <= 1) and adds that to its running double sum once; the block
 * combines its threads at the block's maximum (one exponential a thread) instead of pairwise;
 * and a slice is LMCE_SLICE = 32768 logits (4 or 8 passes of a block), so that a row has few
 * partials. In bf16 mode the exponentials are the MUFU's (lmce_exp) and the gradient's exponent
 * is (x - lh) - ll, lse split into two floats (G is rounded to bf16 after: the double form's
 * exponent differs by at most an ulp or two). */
#define LMCE_PF 4
#define LMCE_SLICE 32768   /* logits a statistics block reduces */
#define LMCE_FIN_WARPS 8
#define LMCE_G(X) (16 / (int)sizeof(X))

/* one statistics partial (16 bytes) */
struct LmcePart {
    float m;
    int32_t a;
    double s;
};

/* lmce's work (dfl_lmce_work_act(CR, V, act) floats) for chunks of CR rows: in f32 mode the
 * [CR, V] f32 logits first; then [CR] w*ce and [CR] hits, S partials a row and [CR] lse; in bf16
 * mode the [CR, ldx] bf16 logits last (ldx = V rounded up to 8, so that every row starts 16-byte
 * aligned); each part 16-byte aligned. The logits of the mode, then G in place: x, row stride
 * ldx; end: the end of the parts used. */
struct LmceWork {
    float *row_wce, *row_hit;
    LmcePart *part;
    double *lse;
    int S;
    void *x;
    int64_t ldx;
    const void *end;
};

static inline void *lmce_align16(void *p) { return (void *)(((uintptr_t)p + 15) & ~(uintptr_t)15); }

static inline LmceWork lmce_work_layout(float *work, int64_t CR, int64_t V, bool bf)
{
    LmceWork w;
    w.S = (int)((V + LMCE_SLICE - 1) / LMCE_SLICE);
    w.row_wce = bf ? work : work + CR * V;
    w.row_hit = w.row_wce + CR;
    w.part = (LmcePart *)lmce_align16(w.row_hit + CR);
    w.lse = (double *)lmce_align16(w.part + CR * w.S);
    bf16 *g = (bf16 *)lmce_align16(w.lse + CR);
    w.x = bf ? (void *)g : (void *)work;
    w.ldx = bf ? (V + 7) / 8 * 8 : V;
    w.end = bf ? (const void *)(g + CR * w.ldx) : (const void *)(w.lse + CR);
    return w;
}

/* The launches' grids for a chunk of nr rows (blocks of LMCE_THREADS; the finish kernel's of
 * LMCE_FIN_WARPS warps): statistics (S, nr), finish, gradient (over logits of type X) */
static inline dim3 lmce_stats_grid(const LmceWork &w, int64_t nr) { return dim3((unsigned)w.S, (unsigned)nr); }
static inline dim3 lmce_finish_grid(int64_t nr) { return dim3((unsigned)((nr + LMCE_FIN_WARPS - 1) / LMCE_FIN_WARPS)); }
template <typename X> static inline dim3 lmce_grad_grid(int64_t V, int64_t nr)
{
    const int64_t per = (int64_t)LMCE_PF * LMCE_THREADS * LMCE_G(X);
    return dim3((unsigned)((V + per - 1) / per), (unsigned)nr);
}

/* exp(d) for d <= 0 (or NaN): f32 mode expf; bf16 mode 2^(d log2 e) on the MUFU (ex2.approx.ftz:
 * relative error below 2^-22 plus the product's rounding, |d| 2^-24; results below 2^-126 are
 * 0), one instruction where expf takes about ten: the logits there are bf16, their own rounding
 * 2^-9 relative */
template <typename X> __device__ __forceinline__ float lmce_exp(float d)
{
    if constexpr (sizeof(X) == 4)
        return expf(d);
    else
        return df_exp2(d * 1.4426950408889634f);
}

/* the group at element e of row lr into x (LMCE_G(T) floats): one 16-byte load (vec), or scalar
 * loads of the elements before hi (-inf past it) */
template <typename T>
__device__ __forceinline__ void lmce_load(const T *lr, int64_t e, int64_t hi, bool vec, float *x)
{
    constexpr int G = LMCE_G(T);
    if (vec) {
        const Pack<T, G> b = *(const Pack<T, G> *)(lr + e);
#pragma unroll
        for (int j = 0; j < G; j++)
            x[j] = to_f32(b.v[j]);
    } else {
#pragma unroll
        for (int j = 0; j < G; j++)
            x[j] = e + j < hi ? to_f32(lr[e + j]) : -INFINITY;
    }
}

/* t combined with the other lanes' of the warp (a fixed butterfly); every lane gets a result,
 * lane 0's is the one used */
__device__ __forceinline__ Smx smx_warp(Smx t)
{
#pragma unroll
    for (int o = 16; o > 0; o >>= 1) {
        Smx u;
        u.m = __shfl_xor_sync(0xffffffffu, t.m, o);
        u.s = __shfl_xor_sync(0xffffffffu, t.s, o);
        u.a = __shfl_xor_sync(0xffffffffu, t.a, o);
        t = smx_combine(t, u);
    }
    return t;
}

/* Block (s, r): the partial of logits [s LMCE_SLICE, (s + 1) LMCE_SLICE) of row r. A thread
 * takes the maximum of its LMCE_PF groups (the first index of it: its elements come in
 * increasing order), rescales its running sum when that maximum is a new one, then adds the
 * groups' exponentials, summed in f32: no branch per element. The block then takes its maximum
 * M, each thread's sum rescaled to M (one exponential), their sum in a fixed order (a butterfly
 * in each warp, the warps in order) and the least first-argmax of the threads whose maximum is M. */
template <typename X>
__global__ void __launch_bounds__(LMCE_THREADS)
lmce_stats_kernel(const X *logits, int64_t V, int64_t ld, int64_t r0, const float *weight, LmcePart *part,
                  int S)
{
    constexpr int G = LMCE_G(X), NE = LMCE_PF * G;
    const int64_t r = blockIdx.y, T = blockDim.x;
    if (!(weight[r0 + r] > 0))
        return;
    const X *lr = logits + r * ld;
    const bool vec = V % G == 0;   /* rows 16-byte aligned (work is, and ld keeps them) */
    const int64_t lo = (int64_t)blockIdx.x * LMCE_SLICE, hi = lo + LMCE_SLICE < V ? lo + LMCE_SLICE : V;
    float tm = -INFINITY;
    double ts = 0.0;
    int64_t ta = 0;
    for (int64_t e0 = lo + threadIdx.x * G; e0 < hi; e0 += LMCE_PF * T * G) {
        float x[NE];
#pragma unroll
        for (int p = 0; p < LMCE_PF; p++) {
            const int64_t e = e0 + p * T * G;
            if (e < hi) {
                lmce_load(lr, e, hi, vec, x + p * G);
            } else {
#pragma unroll
                for (int j = 0; j < G; j++)
                    x[p * G + j] = -INFINITY;
            }
        }
        float gm = x[0];
#pragma unroll
        for (int i = 1; i < NE; i++)
            gm = fmaxf(gm, x[i]);   /* NaN is never the maximum, as with v > gm */
        if (gm > tm) {
            int fi = 0;
#pragma unroll
            for (int i = NE - 1; i >= 0; i--)
                if (x[i] == gm)
                    fi = i;
            ts *= exp((double)tm - (double)gm);   /* 0 while tm is -inf (a NaN sum stays NaN) */
            tm = gm;
            ta = e0 + (int64_t)(fi / G) * T * G + fi % G;
        }
        const float ref = tm > -INFINITY ? tm : 0.0f;
        float acc[LMCE_PF];
#pragma unroll
        for (int p = 0; p < LMCE_PF; p++) {
            acc[p] = 0.0f;
#pragma unroll
            for (int j = 0; j < G; j++)
                acc[p] += lmce_exp<X>(x[p * G + j] - ref);
        }
#pragma unroll
        for (int w = LMCE_PF / 2; w > 0; w >>= 1)
#pragma unroll
            for (int p = 0; p < w; p++)
                acc[p] += acc[p + w];
        ts += (double)acc[0];
    }
    if (tm == -INFINITY && ts != 0.0)   /* only NaN seen: make the block's result NaN */
        tm = INFINITY;
    __shared__ float shm[LMCE_THREADS / 32];
    __shared__ double shs[LMCE_THREADS / 32];
    __shared__ int64_t sha[LMCE_THREADS / 32];
    const int lane = threadIdx.x & 31, wid = threadIdx.x >> 5, nw = blockDim.x >> 5;
    float m = tm;
#pragma unroll
    for (int o = 16; o > 0; o >>= 1)
        m = fmaxf(m, __shfl_xor_sync(0xffffffffu, m, o));
    if (lane == 0)
        shm[wid] = m;
    __syncthreads();
    float M = shm[0];
    for (int i = 1; i < nw; i++)
        M = fmaxf(M, shm[i]);
    double f = tm == -INFINITY ? 0.0 : ts * exp((double)(tm - M));
    int64_t a = tm == M ? ta : INT64_MAX;
#pragma unroll
    for (int o = 16; o > 0; o >>= 1) {
        f += __shfl_xor_sync(0xffffffffu, f, o);
        const int64_t b = __shfl_xor_sync(0xffffffffu, a, o);
        a = b < a ? b : a;
    }
    if (lane == 0) {
        shs[wid] = f;
        sha[wid] = a;
    }
    __syncthreads();
    if (threadIdx.x == 0) {
        double s = shs[0];
        int64_t am = sha[0];
        for (int i = 1; i < nw; i++) {
            s += shs[i];
            am = sha[i] < am ? sha[i] : am;
        }
        part[r * S + blockIdx.x] = LmcePart{M, (int32_t)am, s};
    }
}

/* Warp w of block b: row r = b LMCE_FIN_WARPS + w of nr. Lane i combines partials i, i + 32, ...
 * in order, then the lanes combine (smx_warp); lane 0 writes lse[r] (0 for a row of weight 0),
 * the row's w ce and hit, and correct/ce_out when given. */
template <typename X>
__global__ void __launch_bounds__(LMCE_FIN_WARPS * 32)
lmce_finish_kernel(const X *logits, int64_t ld, int64_t r0, int64_t nr, const int32_t *labels,
                   const float *weight, const LmcePart *part, int S, double *lse, uint8_t *correct,
                   float *ce_out, float *row_wce, float *row_hit)
{
    const int64_t r = (int64_t)blockIdx.x * LMCE_FIN_WARPS + (threadIdx.x >> 5), q = r0 + r;
    const int lane = threadIdx.x & 31;
    if (r >= nr)
        return;
    const float w = weight[q];
    if (!(w > 0)) {
        if (lane == 0) {
            lse[r] = 0.0;
            row_wce[r] = 0.0f;
            row_hit[r] = 0.0f;
            if (correct)
                correct[q] = 0;
            if (ce_out)
                ce_out[q] = 0.0f;
        }
        return;
    }
    Smx t = {-INFINITY, 0.0, 0};
    for (int s = lane; s < S; s += 32) {
        const LmcePart p = part[r * S + s];
        const Smx u = {p.m, p.s, (int64_t)p.a};
        t = smx_combine(t, u);
    }
    t = smx_warp(t);
    if (lane == 0) {
        const int32_t label = labels[q];
        const double l = (double)t.m + log(t.s);
        const double ce = l - (double)to_f32(logits[r * ld + label]);
        const bool hit = t.a == (int64_t)label;
        lse[r] = l;
        row_wce[r] = (float)((double)w * ce);
        row_hit[r] = hit ? 1.0f : 0.0f;
        if (correct)
            correct[q] = hit;
        if (ce_out)
            ce_out[q] = (float)ce;
    }
}

/* Block (b, r): groups [b LMCE_PF LMCE_THREADS, (b + 1) LMCE_PF LMCE_THREADS) of row r's G, in
 * place over the logits (row stride ld), in their type. The exponent x - lse: in f32 mode in
 * double and rounded once; in bf16 mode (x - lh) - ll in f32, lse = lh + ll. */
template <typename X>
__global__ void __launch_bounds__(LMCE_THREADS)
lmce_grad_kernel(X *logits, int64_t V, int64_t ld, int64_t r0, const int32_t *labels, const float *weight,
                 float grad_scale, const double *lse)
{
    constexpr int G = LMCE_G(X);
    const int64_t r = blockIdx.y, q = r0 + r, T = blockDim.x;
    X *lr = logits + r * ld;
    const bool vec = V % G == 0;
    const int64_t e0 = ((int64_t)blockIdx.x * LMCE_PF * T + threadIdx.x) * G;
    const float w = weight[q];
    const bool scored = w > 0;
    const float gw = grad_scale * w;
    const double l = lse[r];
    const float lh = (float)l, ll = (float)(l - (double)lh);
    const int64_t label = labels[q];
    float x[LMCE_PF][G];
    if (scored)
#pragma unroll
        for (int p = 0; p < LMCE_PF; p++) {
            const int64_t e = e0 + p * T * G;
            if (e < V)
                lmce_load(lr, e, V, vec, x[p]);
        }
#pragma unroll
    for (int p = 0; p < LMCE_PF; p++) {
        const int64_t e = e0 + p * T * G;
        if (e >= V)
            break;
        float o[G];
#pragma unroll
        for (int j = 0; j < G; j++) {
            o[j] = 0.0f;
            if (scored) {
                if constexpr (sizeof(X) == 4)
                    o[j] = gw * lmce_exp<X>((float)((double)x[p][j] - l));
                else
                    o[j] = gw * lmce_exp<X>((x[p][j] - lh) - ll);
                if (e + j == label)
                    o[j] -= gw;
            }
        }
        if (vec) {
            Pack<X, G> b;
#pragma unroll
            for (int j = 0; j < G; j++)
                b.v[j] = from_f32<X>(o[j]);
            *(Pack<X, G> *)(lr + e) = b;
        } else {
#pragma unroll
            for (int j = 0; j < G; j++)
                if (e + j < V)
                    lr[e + j] = from_f32<X>(o[j]);
        }
    }
}

/* sums += the chunk's rows, in a fixed order (one warp) */
static __global__ void lmce_sums_kernel(double *sums, const float *row_wce, const float *row_hit,
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
    ln = warp_sum(ln);
    ld = warp_sum(ld);
    an = warp_sum(an);
    ad = warp_sum(ad);
    if (threadIdx.x == 0) {
        sums[DFL_SUM_LOSS_NUM] += ln;
        sums[DFL_SUM_LOSS_DEN] += ld;
        sums[DFL_SUM_ACC_NUM] += an;
        sums[DFL_SUM_ACC_DEN] += ad;
    }
}

#endif
