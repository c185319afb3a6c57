/* gdn_chunk.cuh: the chunked gated delta rule on tensor cores (bf16 activations; launched by
 * kernels/hybrid.cu): TF32 WMMA helpers over f32 tiles, the chunk's decay scan, K K^T / Q K^T,
 * the block triangular solve (I + A)^-1 and the state update, shared by the one-kernel form
 * (gated_delta_tc_kernel) and the two-pass form (gc_prep_kernel, then gc_state_kernel); and the
 * two-pass form on bf16 mma.sync (gm_prep_kernel, then gm_state_kernel: the default). Included
 * by hybrid.cu and by the SIMT emulator's check tests/emu/emu-gdn.cc (which supplies a WMMA of
 * its own, tests/emu/wmma.h). */
#ifndef DFL_GDN_CHUNK_CUH
#define DFL_GDN_CHUNK_CUH

#ifndef DFL_SIMT_H
#include <mma.h>

#include "dflash_ptx.cuh"
#endif
#ifndef DF_DYN_SMEM
#define DF_DYN_SMEM(name) extern __shared__ __align__(128) unsigned char name[]
#endif

__device__ __forceinline__ float hy_sigmoid(float x) { return 1.0f / (1.0f + expf(-x)); }
__device__ __forceinline__ float hy_softplus(float x) { return x > 20.0f ? x : log1pf(expf(x)); }

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

/* 8 bf16 of a 16-byte vector as f32 at dst (16-byte aligned). */
__device__ __forceinline__ void gt_put8(float *dst, uint4 x)
{
    const __nv_bfloat162 *h = (const __nv_bfloat162 *)&x;
    float2 f0 = __bfloat1622float2(h[0]), f1 = __bfloat1622float2(h[1]);
    float2 f2 = __bfloat1622float2(h[2]), f3 = __bfloat1622float2(h[3]);
    ((float4 *)dst)[0] = make_float4(f0.x, f0.y, f1.x, f1.y);
    ((float4 *)dst)[1] = make_float4(f2.x, f2.y, f3.x, f3.y);
}

/* The first L rows of O (64 f32 columns, row stride GT_LC) to dst (bf16, row stride ld, 16-byte
 * aligned rows): one rounding, 8 columns per 16-byte store. The whole block. */
__device__ __forceinline__ void gt_store_rows(bf16 *dst, int64_t ld, const float *O, int L)
{
    for (int e = threadIdx.x; e < L * (GT_DVB / 8); e += GT_THREADS) {
        int i = e / (GT_DVB / 8), c = (e % (GT_DVB / 8)) * 8;
        const float4 *src = (const float4 *)(O + i * GT_LC + c);
        float4 f0 = src[0], f1 = src[1];
        uint4 pk;
        __nv_bfloat162 *h = (__nv_bfloat162 *)&pk;
        h[0] = __floats2bfloat162_rn(f0.x, f0.y);
        h[1] = __floats2bfloat162_rn(f0.z, f0.w);
        h[2] = __floats2bfloat162_rn(f1.x, f1.y);
        h[3] = __floats2bfloat162_rn(f1.z, f1.w);
        *(uint4 *)(dst + i * ld + c) = pk;
    }
}

/* Warp 0 of a block: cg = the inclusive cumulative sum of the 64 log-decays held in dec (two per
 * lane), then dec_i = exp(cg_last - cg_i) and ecg_i = exp(cg_i). */
__device__ __forceinline__ void gt_scan(float *cg, float *dec, float *ecg, int lane)
{
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

/* The block's warps: the lower 16 x 16 tiles of K K^T into A and of Q K^T into Aqk (f32 tiles of
 * row stride GT_LC; K and Q rows of stride DK + 4). */
template <int DK>
__device__ __forceinline__ void gt_kkt(const float *Ks, const float *Qs, float *A, float *Aqk, int warp)
{
    constexpr int LK = DK + 4, LC = GT_LC;
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
}

/* The whole block, from K K^T in A and Q K^T in QK (row stride GT_LC): A = strict-lower(beta_i
 * A_im exp(cg_i - cg_m)) in place, dst[i ld + m] = lower(QK_im exp(cg_i - cg_m)) for the rows
 * i < rows (dst may be QK). */
__device__ __forceinline__ void gt_decay_mask(float *A, const float *QK, float *dst, int64_t ld,
                                              const float *cg, const float *beta, int rows)
{
    for (int e = threadIdx.x; e < GT_C * GT_C; e += GT_THREADS) {
        int i = e / GT_C, m = e % GT_C;
        float d = m <= i ? expf(cg[i] - cg[m]) : 0.0f;
        A[i * GT_LC + m] = m < i ? beta[i] * A[i * GT_LC + m] * d : 0.0f;
        if (i < rows)
            dst[i * ld + m] = m <= i ? QK[i * GT_LC + m] * d : 0.0f;
    }
}

/* The whole block: Tm = (I + A)^-1 for A strictly lower triangular (64 x 64, row stride GT_LC),
 * by 16 x 16 blocks: the four diagonal blocks by forward substitution (one thread per column),
 * then T_ij = -T_ii sum_{j <= m < i} A_im T_mj by distance i - j. Only the lower blocks of Tm
 * are written. X: [3][256] scratch. Called after a barrier; ends with one. */
__device__ __forceinline__ void gt_solve(const float *A, float *Tm, float *X)
{
    constexpr int LC = GT_LC;
    const int tid = threadIdx.x;
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
}

/* c0, c1 += rows of x0, x1 and c2, c3 += rows of y0, y1 (16 x K tiles, row stride ldxy) times
 * the 16 columns of s (K x 16, row stride lds): the four tiles of a warp that share each
 * fragment of s. */
template <int K>
__device__ __forceinline__ void gt_mma4(gt_acc &c0, gt_acc &c1, gt_acc &c2, gt_acc &c3,
                                        const float *x0, const float *x1, const float *y0,
                                        const float *y1, int ldxy, const float *s, int lds)
{
#pragma unroll 2
    for (int k0 = 0; k0 < K; k0 += 8) {
        gtw::fragment<gtw::matrix_b, 16, 16, 8, gtw::precision::tf32, gtw::row_major> fb;
        gt_load(fb, s + k0 * lds, lds);
        gt_mma_a(c0, x0 + k0, ldxy, fb);
        gt_mma_a(c1, x1 + k0, ldxy, fb);
        gt_mma_a(c2, y0 + k0, ldxy, fb);
        gt_mma_a(c3, y1 + k0, ldxy, fb);
    }
}

/* The warp's state tiles S_m (tile column warp % 4, tile rows warp / 4 + 2 m) of S [DK][GT_LC]:
 * S_m = eL S_m + X^T Vn, X [64][ld] a chunk's (scaled) key rows and Vn [64][GT_LC]; one fragment
 * of Vn per k-step serves all of them; then the tiles stored to S. */
template <int NST>
__device__ __forceinline__ void gt_state_update(gt_acc (&Sacc)[NST], float eL, const float *X, int ld,
                                                const float *Vn, float *S, int warp)
{
    const int tj = warp % 4, r0 = warp / 4;
#pragma unroll
    for (int m = 0; m < NST; m++)
#pragma unroll
        for (int t = 0; t < Sacc[m].num_elements; t++)
            Sacc[m].x[t] *= eL;
    for (int k0 = 0; k0 < GT_C; k0 += 8) {
        gtw::fragment<gtw::matrix_b, 16, 16, 8, gtw::precision::tf32, gtw::row_major> fb;
        gt_load(fb, Vn + k0 * GT_LC + tj * 16, GT_LC);
#pragma unroll
        for (int m = 0; m < NST; m++) {
            gtw::fragment<gtw::matrix_a, 16, 16, 8, gtw::precision::tf32, gtw::col_major> fa;
            gt_load(fa, X + k0 * ld + (r0 + 2 * m) * 16, ld);
            gtw::mma_sync(Sacc[m], fa, fb, Sacc[m]);
        }
    }
#pragma unroll
    for (int m = 0; m < NST; m++)
        gtw::store_matrix_sync(S + (r0 + 2 * m) * 16 * GT_LC + tj * 16, Sacc[m], GT_LC, gtw::mem_row_major);
}

/* ---- the one-kernel form ----
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
    DF_DYN_SMEM(gt_raw);
    float *Ks = (float *)gt_raw;         /* [C][LK] */
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
    gt_regs<DK> R{};
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
        if (warp == 0)
            gt_scan(cg, dec, ecg, lane);
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
            gt_mma4<DK>(c0, c1, c2, c3, Ks + ti0 * 16 * LK, Ks + ti1 * 16 * LK, Qs + ti0 * 16 * LK,
                        Qs + ti1 * 16 * LK, LK, S + tj * 16, LC);
            gtw::store_matrix_sync(Vn + ti0 * 16 * LC + tj * 16, c0, LC, gtw::mem_row_major);
            gtw::store_matrix_sync(Vn + ti1 * 16 * LC + tj * 16, c1, LC, gtw::mem_row_major);
            gtw::store_matrix_sync(O + ti0 * 16 * LC + tj * 16, c2, LC, gtw::mem_row_major);
            gtw::store_matrix_sync(O + ti1 * 16 * LC + tj * 16, c3, LC, gtw::mem_row_major);
        }
        gt_kkt<DK>(Ks, Qs, A, Aqk, warp);
        __syncthreads();
        /* c */
        gt_decay_mask(A, Aqk, Aqk, LC, cg, beta, GT_C);
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
        /* d */
        gt_solve(A, Tm, X);
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
        gt_state_update<NST>(Sacc, expf(cg[GT_C - 1]), Ks, LK, Vn, S, warp);
        __syncthreads();
        /* g */
        gt_store_rows(o + base * ldo + col0, ldo, O, L);
    }
}

/* ---- the two-pass form ----
 * The one-kernel form serialises everything on the state pass of a (sequence, value head, value
 * slice), key-side work included. Here the key-side work of every chunk runs at once first, as
 * flash-linear-attention splits it:
 *   gc_prep_kernel, one block per (chunk, sequence, value head), all chunks in parallel:
 *     cg = cumsum g, beta; A = strict-lower(beta_i k_i.k_j exp(cg_i - cg_j)), T = (I + A)^-1;
 *     Aqk = lower(q_i.k_j exp(cg_i - cg_j)); Wn = -T diag(beta exp(cg)) K; U = T diag(beta) V;
 *     Qe = diag(exp(cg)) Q; Kd = diag(exp(cg_last - cg)) K, all f32 into the workspace gc_ws
 *   gc_state_kernel, one block per (sequence, value head, 64 value columns), the chunks in
 *     order, S [DK, 64] f32 (the master copy in the warps' accumulators, a copy in shared memory):
 *     Vn = U + Wn S;  O = Qe S + Aqk Vn (written out);  S = exp(cg_last) S + Kd^T Vn
 * which is the algebra of the one-kernel form (and of the CPU's gdn_chunked) with the products
 * regrouped: T (beta (V - exp(cg) K S)) = U + Wn S. Products TF32 with f32 accumulation.
 * On the H200 at the Qwen3.5-27B shape (tests/gpu/gpu-hybrid, 48 value heads of 128, 8 x 2048
 * tokens): 3.969 ms (26.0 TFLOP/s of the chunked algorithm's essential products) against the
 * one-kernel form's 5.866 ms in the same run; the key-side pass alone 1.932 ms, the state pass
 * alone 2.037 ms (latency-bound: 768 blocks of 32 chunks in order, operands read from L2 by the
 * WMMA loads; what to speed up next).
 * Workspace rows: row t is token t's, rows = T + 64 per value head (head j's rows start at
 * j * rows; the 64 past T are zero). The key-side pass writes only the rows of its chunk's
 * tokens; the state pass reads whole 64-row tiles, so a chunk of L < 64 tokens reads the next
 * sequence's rows (or the zeros past T) past L: those rows of Vn are set to zero before use,
 * which takes them out of S (Kd^T Vn) and out of the rows of O that are written (Aqk is lower
 * triangular and zero past the diagonal in the rows < L); the rows of O past L are not written. */
struct gc_ws {
    float *wn, *qe, *kd; /* [Hv][rows][DK] */
    float *u;            /* [Hv][rows][dv] */
    float *aqk;          /* [Hv][rows][64] */
    float *cg;           /* [Hv][rows] */
    int64_t rows;
};

/* acc to the 16 x 16 tile at dst (global, row stride ld): its first rows rows, at once when that
 * is all 16, else through scratch (the warp's 256 floats of shared memory, 32-byte aligned). */
__device__ __forceinline__ void gc_store_tile(float *dst, int64_t ld, const gt_acc &acc, int rows,
                                              float *scratch)
{
    if (rows >= 16) {
        gtw::store_matrix_sync(dst, acc, (unsigned)ld, gtw::mem_row_major);
        return;
    }
    if (rows <= 0)
        return;
    gtw::store_matrix_sync(scratch, acc, 16, gtw::mem_row_major);
    __syncwarp();
    for (int e = threadIdx.x & 31; e < rows * 16; e += 32)
        dst[(e / 16) * ld + e % 16] = scratch[e];
    __syncwarp();
}

template <int DK>
static size_t gc_prep_smem(void)
{
    return sizeof(float) * ((size_t)2 * GT_C * (DK + 4) + 2 * (size_t)GT_C * GT_LC + 3 * 256 + 4 * GT_C);
}

template <int DK>
static size_t gc_state_smem(void)
{
    return sizeof(float) * ((size_t)DK + 2 * GT_C) * GT_LC;
}

/* grid (chunk slots, sequences, value heads): block x handles chunks x, x + gridDim.x, ... of its
 * sequence (any grid width is correct; ceil(max_len / 64) gives one chunk per block). */
template <int DK>
__global__ void __launch_bounds__(GT_THREADS, 2)
gc_prep_kernel(const bf16 *q, const bf16 *k, int64_t ldqk, const bf16 *v, int64_t ldv,
               const bf16 *a, const bf16 *b, int64_t ldab, const float *A_log, const float *dt_bias,
               const int32_t *cu, int ratio, int dv, gc_ws w)
{
    constexpr int LK = DK + 4, LC = GT_LC;
    DF_DYN_SMEM(gc_raw);
    float *Ks = (float *)gc_raw;   /* [C][LK]: K, then -beta exp(cg) K */
    float *Qs = Ks + GT_C * LK;    /* [C][LK]: Q, then beta V, 64 columns at a time ([C][LC]) */
    float *A = Qs + GT_C * LK;     /* [C][LC]: K K^T, then A */
    float *Tm = A + GT_C * LC;     /* [C][LC]: Q K^T, then (I + A)^-1 */
    float *X = Tm + GT_C * LC;     /* [3][256] */
    float *cg = X + 3 * 256, *beta = cg + GT_C, *dec = beta + GT_C, *ecg = dec + GT_C; /* [C] each */
    const int tid = threadIdx.x, lane = tid & 31, warp = tid >> 5;
    const int s = blockIdx.y, j = blockIdx.z, kh = j / ratio;
    const int64_t t0 = cu[s], n = cu[s + 1] - t0;
    const float Alog = A_log[j], dtb = dt_bias[j];
    const uint4 z = make_uint4(0, 0, 0, 0);
    for (int64_t c = blockIdx.x; c * GT_C < n; c += gridDim.x) {
        const int64_t base = t0 + c * GT_C;                        /* the chunk's first token */
        const int L = (int)(n - c * GT_C < GT_C ? n - c * GT_C : GT_C);
        const int64_t prow = (int64_t)j * w.rows + base; /* its first row in the workspace */
        /* a: K and Q rows, g (raw, in dec until the scan) and beta; zero past L */
        for (int i = tid; i < GT_C * (DK / 8); i += GT_THREADS) {
            int r = i / (DK / 8), x = (i % (DK / 8)) * 8;
            int64_t at = (base + r) * ldqk + (int64_t)kh * DK + x;
            gt_put8(Ks + r * LK + x, r < L ? *(const uint4 *)(k + at) : z);
            gt_put8(Qs + r * LK + x, r < L ? *(const uint4 *)(q + at) : z);
        }
        if (tid < GT_C) {
            int64_t row = (base + tid) * ldab + j;
            dec[tid] = tid < L ? -expf(Alog) * hy_softplus(to_f32(a[row]) + dtb) : 0.0f;
            beta[tid] = tid < L ? hy_sigmoid(to_f32(b[row])) : 0.0f;
        }
        __syncthreads();
        if (warp == 0)
            gt_scan(cg, dec, ecg, lane);
        __syncthreads();
        /* b: K K^T into A, Q K^T into Tm */
        gt_kkt<DK>(Ks, Qs, A, Tm, warp);
        __syncthreads();
        /* c: A, Aqk (out), Qe and Kd (out), K scaled for Wn, cg (out) */
        gt_decay_mask(A, Tm, w.aqk + prow * GT_C, GT_C, cg, beta, L);
        for (int e = tid; e < GT_C * (DK / 4); e += GT_THREADS) {
            int i = e / (DK / 4), x = (e % (DK / 4)) * 4;
            float4 kx = *(const float4 *)(Ks + i * LK + x), qx = *(const float4 *)(Qs + i * LK + x);
            float dc = dec[i], ec = ecg[i], wb = -beta[i] * ecg[i];
            if (i < L) {
                *(float4 *)(w.kd + (prow + i) * DK + x) = make_float4(dc * kx.x, dc * kx.y, dc * kx.z, dc * kx.w);
                *(float4 *)(w.qe + (prow + i) * DK + x) = make_float4(ec * qx.x, ec * qx.y, ec * qx.z, ec * qx.w);
            }
            *(float4 *)(Ks + i * LK + x) = make_float4(wb * kx.x, wb * kx.y, wb * kx.z, wb * kx.w);
        }
        if (tid < L)
            w.cg[prow + tid] = cg[tid];
        __syncthreads();
        /* d: T = (I + A)^-1 */
        gt_solve(A, Tm, X);
        /* e: Wn = T (-beta exp(cg) K) (T lower: the k-tiles up to the diagonal); A is free now:
         * the warps' scratch for tiles cut at L */
        float *scratch = A + warp * 256;
        for (int t = warp; t < 4 * (DK / 16); t += GT_WARPS) {
            int ti = t / (DK / 16), tj = t % (DK / 16);
            gt_acc acc;
            gtw::fill_fragment(acc, 0.0f);
            gt_mma<gtw::row_major, gtw::row_major>(acc, Tm + ti * 16 * LC, LC, Ks + tj * 16, LK, (ti + 1) * 16);
            gc_store_tile(w.wn + (prow + ti * 16) * DK + tj * 16, DK, acc, L - ti * 16, scratch);
        }
        /* f: U = T (beta V), 64 value columns at a time */
        for (int c0 = 0; c0 < dv; c0 += GT_DVB) {
            for (int i = tid; i < GT_C * (GT_DVB / 8); i += GT_THREADS) {
                int r = i / (GT_DVB / 8), x = (i % (GT_DVB / 8)) * 8;
                float *dst = Qs + r * LC + x;
                gt_put8(dst, r < L ? *(const uint4 *)(v + (base + r) * ldv + (int64_t)j * dv + c0 + x) : z);
#pragma unroll
                for (int u = 0; u < 8; u++)
                    dst[u] *= beta[r];
            }
            __syncthreads();
            for (int t = warp; t < 16; t += GT_WARPS) {
                int ti = t / 4, tj = t % 4;
                gt_acc acc;
                gtw::fill_fragment(acc, 0.0f);
                gt_mma<gtw::row_major, gtw::row_major>(acc, Tm + ti * 16 * LC, LC, Qs + tj * 16, LC, (ti + 1) * 16);
                gc_store_tile(w.u + (prow + ti * 16) * dv + c0 + tj * 16, dv, acc, L - ti * 16, scratch);
            }
            __syncthreads();
        }
    }
}

/* A hint to bring the bytes [p, p + n) into L2 (n a multiple of 128): the block's threads share
 * the lines, or with one, this thread asks for all of them. */
__device__ __forceinline__ void gc_prefetch(const float *p, int64_t n, bool one = false)
{
#ifndef DFL_SIMT_H
    int64_t i0 = one ? 0 : (int64_t)threadIdx.x * 128, step = one ? 128 : (int64_t)GT_THREADS * 128;
    for (int64_t i = i0; i < n; i += step)
        asm volatile("prefetch.global.L2 [%0];" ::"l"((const char *)p + i));
#endif
}

/* c[0..3] += (the 16 x K rows at a, row stride lda, one fragment per k-step) times the four
 * 16-column tiles of b (K x 64, row stride ldb): each operand fragment of a loaded once. */
template <typename LA>
__device__ __forceinline__ void gc_mma_row(gt_acc (&c)[4], const float *a, int lda, const float *b,
                                           int ldb, int K)
{
    constexpr bool row = gt_is_row<LA>::v;
#pragma unroll 2
    for (int k0 = 0; k0 < K; k0 += 8) {
        gtw::fragment<gtw::matrix_a, 16, 16, 8, gtw::precision::tf32, LA> fa;
        gt_load(fa, row ? a + k0 : a + (size_t)k0 * lda, lda);
#pragma unroll
        for (int t = 0; t < 4; t++) {
            gtw::fragment<gtw::matrix_b, 16, 16, 8, gtw::precision::tf32, gtw::row_major> fb;
            gt_load(fb, b + (size_t)k0 * ldb + t * 16, ldb);
            gtw::mma_sync(c[t], fa, fb, c[t]);
        }
    }
}

/* grid: sequences x value heads x dv / 64 slices, the slice fastest (a head's slices run side by
 * side and share its key-side reads in L2). Each warp owns whole 16-row strips (all 64 columns),
 * so that every fragment of Wn, Qe, Aqk and Kd is read from global memory once per block:
 *   1. warp w < 4: Vn strip w = U + Wn S; warp w >= 4: O strip w - 4 = Qe S (kept in registers)
 *   2. (barrier) warps >= 4: O += Aqk Vn (out to shared memory); every warp: its strips of
 *      S = exp(cg_last) S + Kd^T Vn (S, f32, lives in shared memory)
 *   3. (barrier) O rows < L out */
template <int DK>
__global__ void __launch_bounds__(GT_THREADS, 2)
gc_state_kernel(gc_ws w, const int32_t *cu, bf16 *o, int64_t ldo, int Hv, int dv)
{
    constexpr int LC = GT_LC;
    DF_DYN_SMEM(gc_raw);
    float *S = (float *)gc_raw;  /* [DK][LC] */
    float *Vn = S + DK * LC;     /* [C][LC] */
    float *O = Vn + GT_C * LC;   /* [C][LC] */
    const int tid = threadIdx.x, warp = tid >> 5;
    const int nsl = dv / GT_DVB, sl = blockIdx.x % nsl, j = (blockIdx.x / nsl) % Hv;
    const int s = blockIdx.x / (nsl * Hv);
    const int col0 = sl * GT_DVB;
    const int64_t t0 = cu[s], n = cu[s + 1] - t0;
    const int rt = warp & 3;             /* the warp's strip of Vn (warps 0-3) or O (4-7) */
    const bool vwarp = warp < 4;
    for (int i = tid; i < DK * LC; i += GT_THREADS)
        S[i] = 0.0f;
    __syncthreads();
    for (int64_t c = 0; c * GT_C < n; c++) {
        const int64_t base = t0 + c * GT_C;
        const int L = (int)(n - c * GT_C < GT_C ? n - c * GT_C : GT_C);
        const int64_t prow = (int64_t)j * w.rows + base;
        const float *wn = w.wn + prow * DK, *qe = w.qe + prow * DK, *kd = w.kd + prow * DK;
        const float *u = w.u + prow * dv + col0, *aqk = w.aqk + prow * GT_C;
        if ((c + 1) * GT_C < n) { /* the next chunk's operands on their way to L2 */
            const int64_t nb = (int64_t)GT_C * DK * 4;
            gc_prefetch(wn + GT_C * DK, nb);
            gc_prefetch(qe + GT_C * DK, nb);
            gc_prefetch(kd + GT_C * DK, nb);
            gc_prefetch(aqk + GT_C * GT_C, (int64_t)GT_C * GT_C * 4);
            if (tid < 2 * GT_C) /* the slice's 64 columns: two lines of each row */
                gc_prefetch(u + (int64_t)(GT_C + tid / 2) * dv + (tid % 2) * 32, 128, true);
        }
        /* 1: Vn = U + Wn S (warps 0-3), O = Qe S (warps 4-7) */
        gt_acc acc[4];
#pragma unroll
        for (int t = 0; t < 4; t++) {
            if (vwarp)
                gtw::load_matrix_sync(acc[t], u + rt * 16 * dv + t * 16, dv, gtw::mem_row_major);
            else
                gtw::fill_fragment(acc[t], 0.0f);
        }
        gc_mma_row<gtw::row_major>(acc, (vwarp ? wn : qe) + rt * 16 * DK, DK, S, LC, DK);
        if (vwarp) {
#pragma unroll
            for (int t = 0; t < 4; t++)
                gtw::store_matrix_sync(Vn + rt * 16 * LC + t * 16, acc[t], LC, gtw::mem_row_major);
            if (L < (rt + 1) * 16) { /* rows past the chunk's tokens (another sequence's, or zeros) out */
                __syncwarp();
                for (int e = tid & 31; e < 16 * GT_DVB; e += 32) {
                    int row = rt * 16 + e / GT_DVB;
                    if (row >= L)
                        Vn[row * LC + e % GT_DVB] = 0.0f;
                }
            }
        }
        __syncthreads();
        /* 2: O += Aqk Vn (Aqk lower: the k-tiles up to the diagonal); S = exp(cg_last) S + Kd^T Vn */
        if (!vwarp) {
            gc_mma_row<gtw::row_major>(acc, aqk + rt * 16 * GT_C, GT_C, Vn, LC, (rt + 1) * 16);
#pragma unroll
            for (int t = 0; t < 4; t++)
                gtw::store_matrix_sync(O + rt * 16 * LC + t * 16, acc[t], LC, gtw::mem_row_major);
        }
        const float eL = expf(w.cg[prow + L - 1]);
        for (int st = warp; st < DK / 16; st += GT_WARPS) {
            gt_acc sa[4];
#pragma unroll
            for (int t = 0; t < 4; t++) {
                gtw::load_matrix_sync(sa[t], S + st * 16 * LC + t * 16, LC, gtw::mem_row_major);
#pragma unroll
                for (int x = 0; x < sa[t].num_elements; x++)
                    sa[t].x[x] *= eL;
            }
            gc_mma_row<gtw::col_major>(sa, kd + st * 16, DK, Vn, LC, GT_C);
#pragma unroll
            for (int t = 0; t < 4; t++)
                gtw::store_matrix_sync(S + st * 16 * LC + t * 16, sa[t], LC, gtw::mem_row_major);
        }
        __syncthreads();
        /* 3: O rows < L out, 8 columns per 16-byte store */
        gt_store_rows(o + base * ldo + (int64_t)j * dv + col0, ldo, O, L);
    }
}

/* ---- the state pass on bf16 mma.sync (gm_state_kernel, the default) ----
 * The same chunk algebra as gc_state_kernel, with the decays applied to rows around the
 * products instead of to stored operands, so that Q and K come straight from the activations
 * (bf16, exact) and the key-side pass writes neither Qe nor Kd:
 *   Vn = U + Wn S;  O = diag(exp(cg)) (Q S) + Aqk Vn;  S = exp(cg_last) S + K^T (diag(dec) Vn)
 * Products on mma.sync m16n8k16 (bf16 operands, f32 accumulation). An operand that is not a
 * bf16 value exactly (S, Wn, Aqk, Vn, dec Vn) is split into two bf16, x = hi + lo (hi = bf16(x),
 * lo = bf16(x - hi): 16 bits of mantissa, against TF32's 11), and the product takes the terms
 * hi*hi + hi*lo + lo*hi (one operand exact: two terms); so every product is at least as exact as
 * the TF32 one it replaces. One block per (sequence, value head, 64 value columns), NW warps (8
 * by default, 16 with DFL_CUDA_GDN_STATE_WARPS=16), the chunks in order; S [DK, 64] lives in the
 * warps' accumulators (each warp 16 rows of S, 64 DK / (8 NW) columns) and as hi/lo bf16 copies
 * of S^T in shared memory (the B operand of Q S and Wn S, by ldmatrix). A chunk's operands are staged by cp.async into shared memory, zero past its L
 * tokens (so nothing past them, another sequence's rows or the unwritten rows of the workspace,
 * is read): Wn and U for the next chunk as soon as step 1 is done with them, Q, K, Aqk and cg as
 * soon as step 2 is. On the H200 at the Qwen3.5-27B shape (tests/gpu/gpu-hybrid, 48 value heads
 * of 128, 8 x 2048 tokens): the two passes 2.140 ms with the state pass on 8 warps (2.276 ms on
 * 16: key-side 0.917 ms, state 1.358 ms; 8 warps: state 1.222 ms) against the TF32 passes'
 * 3.972 ms (key-side 1.933, state 2.043) in the same run; max row difference from the SIMT
 * kernel 0.000777 against 0.00187. Per chunk:
 *   1. Vn = U + Wn S: each warp 8 VN columns of a 16-row strip; Vn^T to shared memory (f32)
 *   2. (barrier) O, the same tiles: Q S, times exp(cg_i), + Aqk Vn (the k-tiles up to the
 *      diagonal), rows < L to the output (bf16, one rounding); then the warp's S tiles:
 *      S = exp(cg_last) S + K^T (dec Vn), K^T by ldmatrix .trans
 *   3. (barrier) S^T hi/lo to shared memory */
template <int DK> struct gm_lay {
    static constexpr int LQ = DK + 8;   /* bf16 row stride of Q, K, S^T hi / lo (elements) */
    static constexpr int LW = DK + 8;   /* f32 row stride of Wn */
    static constexpr int LV = GT_C + 8; /* f32 row stride of U, Aqk, Vn^T */
    static constexpr size_t q = 0, k = q + 2 * GT_C * LQ, wn = k + 2 * GT_C * LQ, u = wn + 4 * GT_C * LW;
    static constexpr size_t aqk = u + 4 * GT_C * LV, vt = aqk + 4 * GT_C * LV, sh = vt + 4 * GT_DVB * LV;
    static constexpr size_t sl = sh + 2 * GT_DVB * LQ, cg = sl + 2 * GT_DVB * LQ, bytes = cg + 4 * GT_C;
};

template <int DK>
static size_t gm_state_smem(void)
{
    return gm_lay<DK>::bytes;
}

/* x0, x1 as bf16 pairs hi (bf16(x)) and lo (bf16(x - hi)) */
__device__ __forceinline__ void gm_split(float x0, float x1, uint32_t &hi, uint32_t &lo)
{
    hi = df_pack(x0, x1);
    lo = df_pack(x0 - df_bf_lo(hi), x1 - df_bf_hi(hi));
}

/* The A fragment (16 x 16) of f32 rows at p (row stride ld), split into hi and lo; with cs, each
 * column k times cs[k] first */
__device__ __forceinline__ void gm_a_f32(uint32_t (&hi)[4], uint32_t (&lo)[4], const float *p, int ld, int lane,
                                         const float *cs = nullptr)
{
    const int g = lane >> 2, t = lane & 3;
#pragma unroll
    for (int r = 0; r < 4; r++) {
        const int c = 2 * t + (r >> 1) * 8;
        float2 x = *(const float2 *)(p + (g + (r & 1) * 8) * ld + c);
        if (cs) {
            x.x *= cs[c];
            x.y *= cs[c + 1];
        }
        gm_split(x.x, x.y, hi[r], lo[r]);
    }
}

/* The B fragment (16 x 8) of a tile stored transposed in f32 (p: its column n0 = row n0 of the
 * storage, k along the row; row stride ld), each k scaled by d[] (k = 2t, 2t + 1, 2t + 8,
 * 2t + 9), split into hi and lo */
__device__ __forceinline__ void gm_b_f32(uint32_t (&hi)[2], uint32_t (&lo)[2], const float *p, int ld, int lane,
                                         const float (&d)[4])
{
    const int g = lane >> 2, t = lane & 3;
    float2 x0 = *(const float2 *)(p + g * ld + 2 * t), x1 = *(const float2 *)(p + g * ld + 2 * t + 8);
    gm_split(x0.x * d[0], x0.y * d[1], hi[0], lo[0]);
    gm_split(x1.x * d[2], x1.y * d[3], hi[1], lo[1]);
}

/* ldmatrix addresses: the A fragment of rows m0, columns k0 of a bf16 row-major tile; the same of
 * its transpose (A = X^T, X [k][m] stored: rows k0, columns m0); the B fragments of two 8-column
 * tiles n0, n0 + 8 of a tile stored transposed ([n][k]: rows n0, columns k0) */
__device__ __forceinline__ uint32_t gm_at_a(const bf16 *p, int ld, int m0, int k0, int lane)
{
    return df_smem(p + (m0 + (lane & 7) + ((lane >> 3) & 1) * 8) * ld + k0 + (lane >> 4) * 8);
}
__device__ __forceinline__ uint32_t gm_at_at(const bf16 *p, int ld, int m0, int k0, int lane)
{
    return df_smem(p + (k0 + (lane & 7) + (lane >> 4) * 8) * ld + m0 + ((lane >> 3) & 1) * 8);
}
__device__ __forceinline__ uint32_t gm_at_b(const bf16 *p, int ld, int n0, int k0, int lane)
{
    return df_smem(p + (n0 + (lane & 7) + (lane >> 4) * 8) * ld + k0 + ((lane >> 3) & 1) * 8);
}

/* The block stages Wn and the U slice of a chunk (rows at wn, u; L tokens, zero past them) */
template <int DK, int NTH>
__device__ __forceinline__ void gm_stage_wu(float *Wn, float *U, const float *wn, const float *u, int dv, int L)
{
    constexpr int LW = gm_lay<DK>::LW, LV = gm_lay<DK>::LV;
    for (int i = threadIdx.x; i < GT_C * (DK / 4); i += NTH) {
        int r = i / (DK / 4), x = (i % (DK / 4)) * 4;
        df_cp16(df_smem(Wn + r * LW + x), wn + (r < L ? (int64_t)r * DK + x : 0), r < L);
    }
    for (int i = threadIdx.x; i < GT_C * (GT_DVB / 4); i += NTH) {
        int r = i / (GT_DVB / 4), x = (i % (GT_DVB / 4)) * 4;
        df_cp16(df_smem(U + r * LV + x), u + (r < L ? (int64_t)r * dv + x : 0), r < L);
    }
}

/* The block stages Q and K rows (at q, k, row stride ldqk), Aqk and cg of a chunk (zero past L) */
template <int DK, int NTH>
__device__ __forceinline__ void gm_stage_qk(bf16 *Qs, bf16 *Ks, float *Aq, float *cgs, const bf16 *q,
                                            const bf16 *k, int64_t ldqk, const float *aqk, const float *cg,
                                            int L)
{
    constexpr int LQ = gm_lay<DK>::LQ, LV = gm_lay<DK>::LV;
    for (int i = threadIdx.x; i < GT_C * (DK / 8); i += NTH) {
        int r = i / (DK / 8), x = (i % (DK / 8)) * 8;
        int64_t at = r < L ? (int64_t)r * ldqk + x : 0;
        df_cp16(df_smem(Qs + r * LQ + x), q + at, r < L);
        df_cp16(df_smem(Ks + r * LQ + x), k + at, r < L);
    }
    for (int i = threadIdx.x; i < GT_C * (GT_C / 4); i += NTH) {
        int r = i / (GT_C / 4), x = (i % (GT_C / 4)) * 4;
        df_cp16(df_smem(Aq + r * LV + x), aqk + (r < L ? (int64_t)r * GT_C + x : 0), r < L);
    }
    const int tx = (int)threadIdx.x;
    if (tx < GT_C)
        df_cp4(df_smem(cgs + tx), cg + (tx < L ? tx : 0), tx < L);
}

/* grid: sequences x value heads x dv / 64 slices, the slice fastest (as gc_state_kernel); NW warps
 * (8 or 16) */
template <int DK, int NW>
__global__ void __launch_bounds__(NW * 32, 1)
gm_state_kernel(gc_ws w, const bf16 *q, const bf16 *k, int64_t ldqk, const int32_t *cu, bf16 *o, int64_t ldo,
                int Hv, int ratio, int dv)
{
    using Y = gm_lay<DK>;
    constexpr int LQ = Y::LQ, LW = Y::LW, LV = Y::LV;
    constexpr int NTH = NW * 32;
    constexpr int WPS = NW / (DK / 16);    /* warps per 16-row strip of S */
    constexpr int SN = (GT_DVB / 8) / WPS; /* 8-column tiles of S per warp */
    constexpr int VN = 32 / NW;            /* 8-column tiles of Vn and O per warp (4 strips of 8) */
    static_assert(WPS * (DK / 16) == NW && SN >= 1 && VN % 2 == 0, "tiles per warp");
    DF_DYN_SMEM(gm_raw);
    bf16 *Qs = (bf16 *)(gm_raw + Y::q), *Ks = (bf16 *)(gm_raw + Y::k);
    bf16 *Sh = (bf16 *)(gm_raw + Y::sh), *Sl = (bf16 *)(gm_raw + Y::sl); /* S^T [64][LQ] hi, lo */
    float *Wn = (float *)(gm_raw + Y::wn), *U = (float *)(gm_raw + Y::u), *Aq = (float *)(gm_raw + Y::aqk);
    float *Vt = (float *)(gm_raw + Y::vt), *cgs = (float *)(gm_raw + Y::cg); /* Vn^T [64][LV] */
    const int tid = threadIdx.x, lane = tid & 31, warp = tid >> 5, g = lane >> 2, t = lane & 3;
    const int nsl = dv / GT_DVB, sl = blockIdx.x % nsl, j = (blockIdx.x / nsl) % Hv;
    const int s = blockIdx.x / (nsl * Hv), col0 = sl * GT_DVB, kh = j / ratio;
    const int64_t t0 = cu[s], n = cu[s + 1] - t0;
    const int sr = warp / WPS, sn0 = (warp % WPS) * SN; /* the warp's S tiles: rows 16 sr, columns 8 (sn0 + i) */
    const int vr = warp / (8 / VN), vn0 = (warp % (8 / VN)) * VN; /* its Vn, O tiles: rows 16 vr, columns 8 (vn0 + i) */
    const bf16 *qh = q + (int64_t)kh * DK, *kh_ = k + (int64_t)kh * DK;
    if (n <= 0)
        return;
    float Sa[SN][4];
#pragma unroll
    for (int i = 0; i < SN; i++)
        Sa[i][0] = Sa[i][1] = Sa[i][2] = Sa[i][3] = 0.0f;
    for (int i = tid; i < GT_DVB * LQ; i += NTH)
        Sh[i] = Sl[i] = __float2bfloat16_rn(0.0f);
    {
        const int L0 = (int)(n < GT_C ? n : GT_C);
        const int64_t prow = (int64_t)j * w.rows + t0;
        gm_stage_wu<DK, NTH>(Wn, U, w.wn + prow * DK, w.u + prow * dv + col0, dv, L0);
        df_commit();
        gm_stage_qk<DK, NTH>(Qs, Ks, Aq, cgs, qh + t0 * ldqk, kh_ + t0 * ldqk, ldqk, w.aqk + prow * GT_C, w.cg + prow, L0);
        df_commit();
    }
    const float one[4] = {1.0f, 1.0f, 1.0f, 1.0f};
    for (int64_t c = 0; c * GT_C < n; c++) {
        const int64_t base = t0 + c * GT_C;
        const int L = (int)(n - c * GT_C < GT_C ? n - c * GT_C : GT_C);
        const bool more = (c + 1) * GT_C < n;
        const int64_t nb = base + GT_C, nprow = (int64_t)j * w.rows + nb;
        const int nL = more ? (int)(n - (c + 1) * GT_C < GT_C ? n - (c + 1) * GT_C : GT_C) : 0;
        df_wait<1>();
        __syncthreads(); /* Wn, U of this chunk in; S^T of the last one written */
        /* 1: Vn = U + Wn S */
        float acc[VN][4];
#pragma unroll
        for (int i = 0; i < VN; i++) {
            const float *up = U + (16 * vr + g) * LV + 8 * (vn0 + i) + 2 * t;
            float2 u0 = *(const float2 *)up, u1 = *(const float2 *)(up + 8 * LV);
            acc[i][0] = u0.x;
            acc[i][1] = u0.y;
            acc[i][2] = u1.x;
            acc[i][3] = u1.y;
        }
#pragma unroll 2
        for (int k0 = 0; k0 < DK; k0 += 16) {
            uint32_t ah[4], al[4];
            gm_a_f32(ah, al, Wn + 16 * vr * LW + k0, LW, lane);
#pragma unroll
            for (int p = 0; p < VN / 2; p++) {
                uint32_t bh[4], bl[4];
                df_ldm(bh, gm_at_b(Sh, LQ, 8 * (vn0 + 2 * p), k0, lane));
                df_ldm(bl, gm_at_b(Sl, LQ, 8 * (vn0 + 2 * p), k0, lane));
#pragma unroll
                for (int h = 0; h < 2; h++) {
                    df_mma(acc[2 * p + h], ah, bh[2 * h], bh[2 * h + 1]);
                    df_mma(acc[2 * p + h], ah, bl[2 * h], bl[2 * h + 1]);
                    df_mma(acc[2 * p + h], al, bh[2 * h], bh[2 * h + 1]);
                }
            }
        }
#pragma unroll
        for (int i = 0; i < VN; i++) { /* Vn^T: column 8 (vn0 + i) + 2t (+1), token 16 vr + g (+8) */
            float *vp = Vt + (8 * (vn0 + i) + 2 * t) * LV + 16 * vr + g;
            vp[0] = acc[i][0];
            vp[LV] = acc[i][1];
            vp[8] = acc[i][2];
            vp[LV + 8] = acc[i][3];
        }
        df_wait<0>();
        __syncthreads(); /* Vn in; Q, K, Aqk, cg of this chunk in; Wn, U free */
        if (more) {
            gm_stage_wu<DK, NTH>(Wn, U, w.wn + nprow * DK, w.u + nprow * dv + col0, dv, nL);
            df_commit();
        }
        /* 2: O = exp(cg) (Q S) + Aqk Vn */
#pragma unroll
        for (int i = 0; i < VN; i++)
            acc[i][0] = acc[i][1] = acc[i][2] = acc[i][3] = 0.0f;
#pragma unroll 2
        for (int k0 = 0; k0 < DK; k0 += 16) {
            uint32_t a[4];
            df_ldm(a, gm_at_a(Qs, LQ, 16 * vr, k0, lane));
#pragma unroll
            for (int p = 0; p < VN / 2; p++) {
                uint32_t bh[4], bl[4];
                df_ldm(bh, gm_at_b(Sh, LQ, 8 * (vn0 + 2 * p), k0, lane));
                df_ldm(bl, gm_at_b(Sl, LQ, 8 * (vn0 + 2 * p), k0, lane));
#pragma unroll
                for (int h = 0; h < 2; h++) {
                    df_mma(acc[2 * p + h], a, bh[2 * h], bh[2 * h + 1]);
                    df_mma(acc[2 * p + h], a, bl[2 * h], bl[2 * h + 1]);
                }
            }
        }
        {
            const float e0 = expf(cgs[16 * vr + g]), e1 = expf(cgs[16 * vr + g + 8]);
#pragma unroll
            for (int i = 0; i < VN; i++) {
                acc[i][0] *= e0;
                acc[i][1] *= e0;
                acc[i][2] *= e1;
                acc[i][3] *= e1;
            }
        }
        for (int kk = 0; kk <= vr; kk++) {
            uint32_t ah[4], al[4];
            gm_a_f32(ah, al, Aq + 16 * vr * LV + 16 * kk, LV, lane);
#pragma unroll
            for (int i = 0; i < VN; i++) {
                uint32_t bh[2], bl[2];
                gm_b_f32(bh, bl, Vt + 8 * (vn0 + i) * LV + 16 * kk, LV, lane, one);
                df_mma(acc[i], ah, bh[0], bh[1]);
                df_mma(acc[i], ah, bl[0], bl[1]);
                df_mma(acc[i], al, bh[0], bh[1]);
            }
        }
        {
            const int r0 = 16 * vr + g;
            bf16 *op = o + (base + r0) * ldo + (int64_t)j * dv + col0 + 8 * vn0 + 2 * t;
#pragma unroll
            for (int i = 0; i < VN; i++) {
                if (r0 < L)
                    *(__nv_bfloat162 *)(op + 8 * i) = __floats2bfloat162_rn(acc[i][0], acc[i][1]);
                if (r0 + 8 < L)
                    *(__nv_bfloat162 *)(op + 8 * ldo + 8 * i) = __floats2bfloat162_rn(acc[i][2], acc[i][3]);
            }
        }
        /* S = exp(cg_last) S + K^T (dec Vn) */
        {
            const float cl = cgs[L - 1], eL = expf(cl);
#pragma unroll
            for (int i = 0; i < SN; i++)
                Sa[i][0] *= eL, Sa[i][1] *= eL, Sa[i][2] *= eL, Sa[i][3] *= eL;
#pragma unroll
            for (int k0 = 0; k0 < GT_C; k0 += 16) {
                const float d[4] = {expf(cl - cgs[k0 + 2 * t]), expf(cl - cgs[k0 + 2 * t + 1]),
                                    expf(cl - cgs[k0 + 2 * t + 8]), expf(cl - cgs[k0 + 2 * t + 9])};
                uint32_t a[4];
                df_ldm_t(a, gm_at_at(Ks, LQ, 16 * sr, k0, lane));
#pragma unroll
                for (int i = 0; i < SN; i++) {
                    uint32_t bh[2], bl[2];
                    gm_b_f32(bh, bl, Vt + 8 * (sn0 + i) * LV + k0, LV, lane, d);
                    df_mma(Sa[i], a, bh[0], bh[1]);
                    df_mma(Sa[i], a, bl[0], bl[1]);
                }
            }
        }
        __syncthreads(); /* S^T, Q, K, Aqk, cg read by every warp */
        if (more) {
            gm_stage_qk<DK, NTH>(Qs, Ks, Aq, cgs, qh + nb * ldqk, kh_ + nb * ldqk, ldqk, w.aqk + nprow * GT_C,
                            w.cg + nprow, nL);
            df_commit();
        }
        /* 3: S^T hi / lo: S (16 sr + g (+8), 8 (sn0 + i) + 2t (+1)) */
#pragma unroll
        for (int i = 0; i < SN; i++) {
            const int r = 16 * sr + g, cc = 8 * (sn0 + i) + 2 * t;
#pragma unroll
            for (int e = 0; e < 4; e++) {
                const int at = (cc + (e & 1)) * LQ + r + (e >> 1) * 8;
                const float x = Sa[i][e];
                const bf16 h = __float2bfloat16_rn(x);
                Sh[at] = h;
                Sl[at] = __float2bfloat16_rn(x - __bfloat162float(h));
            }
        }
    }
}

/* B fragments of two 8-column tiles n0, n0 + 8 of a bf16 tile stored [k][n] (rows k0), by
 * ldmatrix .trans */
__device__ __forceinline__ uint32_t gm_at_bt(const bf16 *p, int ld, int n0, int k0, int lane)
{
    return df_smem(p + (k0 + (lane & 7) + ((lane >> 3) & 1) * 8) * ld + n0 + (lane >> 4) * 8);
}

/* acc[NT] += (T diag(cs)) X for the 16-row strip wr of T (f32 [C][GT_LC], lower: the k-tiles up
 * to the diagonal; split into hi + lo) and NT 8-column tiles of X (bf16 [C][ld], exact) from
 * column n0 */
template <int NT>
__device__ __forceinline__ void gm_tmul(float (&acc)[NT][4], const float *Tm, const float *cs, const bf16 *X, int ld,
                                        int n0, int wr, int lane)
{
    for (int kk = 0; kk <= wr; kk++) {
        uint32_t ah[4], al[4];
        gm_a_f32(ah, al, Tm + 16 * wr * GT_LC + 16 * kk, GT_LC, lane, cs + 16 * kk);
#pragma unroll
        for (int p = 0; p < NT / 2; p++) {
            uint32_t fb[4];
            df_ldm_t(fb, gm_at_bt(X, ld, n0 + 16 * p, 16 * kk, lane));
            df_mma(acc[2 * p], ah, fb[0], fb[1]);
            df_mma(acc[2 * p], al, fb[0], fb[1]);
            df_mma(acc[2 * p + 1], ah, fb[2], fb[3]);
            df_mma(acc[2 * p + 1], al, fb[2], fb[3]);
        }
    }
}

/* The rows < rows of a 16-row strip of NT accumulator tiles to dst (f32, row stride ld) */
template <int NT>
__device__ __forceinline__ void gm_out_rows(float *dst, int64_t ld, const float (&acc)[NT][4], int rows, int lane)
{
    const int g = lane >> 2, t = lane & 3;
#pragma unroll
    for (int i = 0; i < NT; i++) {
        float *p = dst + g * ld + 8 * i + 2 * t;
        if (g < rows)
            *(float2 *)p = make_float2(acc[i][0], acc[i][1]);
        if (g + 8 < rows)
            *(float2 *)(p + 8 * ld) = make_float2(acc[i][2], acc[i][3]);
    }
}

/* ---- the key-side pass on bf16 mma.sync (gm_prep_kernel, with gm_state_kernel) ----
 * gc_prep_kernel's work with the products regrouped around the bf16 values K, Q and V (exact
 * operands, loaded by cp.async and ldmatrix, never converted): K K^T and Q K^T (the 10 lower
 * 16 x 16 tiles each, exact products), their decay masks applied in registers (A to shared
 * memory for the solve, Aqk to the workspace), T = (I + A)^-1 as gt_solve, then
 * Wn = (T diag(-beta exp(cg))) K and U = (T diag(beta)) V with the scaled T split into hi + lo
 * bf16 (two terms). Writes Wn, U, Aqk (its lower 16 x 16 tiles: the state pass reads no other)
 * and cg for the rows of its chunk's tokens; not Qe and Kd. Shared memory: K, Q (then V, 64
 * columns at a time) in bf16, A and T in f32: 73.7 KB at DK 128, three blocks an SM. */
template <int DK>
static size_t gm_prep_smem(void)
{
    return 2 * (size_t)2 * GT_C * (DK + 8) + sizeof(float) * (2 * (size_t)GT_C * GT_LC + 3 * 256 + 4 * GT_C);
}

template <int DK>
__global__ void __launch_bounds__(GT_THREADS, 3)
gm_prep_kernel(const bf16 *q, const bf16 *k, int64_t ldqk, const bf16 *v, int64_t ldv, const bf16 *a,
               const bf16 *b, int64_t ldab, const float *A_log, const float *dt_bias, const int32_t *cu, int ratio,
               int dv, gc_ws w)
{
    constexpr int LQ = DK + 8, LV = GT_DVB + 8, LC = GT_LC;
    DF_DYN_SMEM(gm_raw);
    bf16 *Ks = (bf16 *)gm_raw;  /* [C][LQ] */
    bf16 *Qs = Ks + GT_C * LQ;  /* [C][LQ]: Q, then V, 64 columns at a time ([C][LV]) */
    float *A = (float *)(Qs + GT_C * LQ); /* [C][LC]: A */
    float *Tm = A + GT_C * LC;  /* [C][LC]: (I + A)^-1 */
    float *X = Tm + GT_C * LC;  /* [3][256] */
    float *cg = X + 3 * 256, *beta = cg + GT_C, *dec = beta + GT_C, *ecg = dec + GT_C; /* [C] each */
    const int tid = threadIdx.x, lane = tid & 31, warp = tid >> 5, g = lane >> 2, t = lane & 3;
    const int s = blockIdx.y, j = blockIdx.z, kh = j / ratio;
    const int64_t t0 = cu[s], n = cu[s + 1] - t0;
    const float Alog = A_log[j], dtb = dt_bias[j];
    const int wr = warp >> 1; /* the warp's 16-row strip of Wn and U */
    for (int64_t c = blockIdx.x; c * GT_C < n; c += gridDim.x) {
        const int64_t base = t0 + c * GT_C;
        const int L = (int)(n - c * GT_C < GT_C ? n - c * GT_C : GT_C);
        const int64_t prow = (int64_t)j * w.rows + base;
        /* a: K, Q rows (zero past L), g (raw, in dec until the scan) and beta */
        for (int i = tid; i < GT_C * (DK / 8); i += GT_THREADS) {
            int r = i / (DK / 8), x = (i % (DK / 8)) * 8;
            int64_t at = r < L ? (base + r) * ldqk + (int64_t)kh * DK + x : 0;
            df_cp16(df_smem(Ks + r * LQ + x), k + at, r < L);
            df_cp16(df_smem(Qs + r * LQ + x), q + at, r < L);
        }
        df_commit();
        if (tid < GT_C) {
            int64_t row = (base + tid) * ldab + j;
            dec[tid] = tid < L ? -expf(Alog) * hy_softplus(to_f32(a[row]) + dtb) : 0.0f;
            beta[tid] = tid < L ? hy_sigmoid(to_f32(b[row])) : 0.0f;
        }
        df_wait<0>();
        __syncthreads();
        if (warp == 0)
            gt_scan(cg, dec, ecg, lane);
        __syncthreads();
        if (tid < L)
            w.cg[prow + tid] = cg[tid];
        /* b: K K^T and Q K^T, the lower 16 x 16 tiles (20 over the warps), masked and decayed in
         * registers: A = strict-lower(beta_i kk exp(cg_i - cg_m)) to shared memory,
         * Aqk = lower(qk exp(cg_i - cg_m)) (rows < L) to the workspace */
        for (int job = warp; job < 20; job += GT_WARPS) {
            int ti, tj;
            gt_lower(job % 10, &ti, &tj);
            const bool kk = job < 10;
            float acc[2][4] = {};
#pragma unroll 4
            for (int k0 = 0; k0 < DK; k0 += 16) {
                uint32_t fa[4], fb[4];
                df_ldm(fa, gm_at_a(kk ? Ks : Qs, LQ, 16 * ti, k0, lane));
                df_ldm(fb, gm_at_b(Ks, LQ, 16 * tj, k0, lane));
                df_mma(acc[0], fa, fb[0], fb[1]);
                df_mma(acc[1], fa, fb[2], fb[3]);
            }
#pragma unroll
            for (int h = 0; h < 2; h++)
#pragma unroll
                for (int e = 0; e < 4; e += 2) {
                    const int i = 16 * ti + g + (e >> 1) * 8, m = 16 * tj + 8 * h + 2 * t;
                    float y0 = 0.0f, y1 = 0.0f;
                    if (kk) {
                        if (m < i)
                            y0 = beta[i] * acc[h][e] * expf(cg[i] - cg[m]);
                        if (m + 1 < i)
                            y1 = beta[i] * acc[h][e + 1] * expf(cg[i] - cg[m + 1]);
                        *(float2 *)(A + i * LC + m) = make_float2(y0, y1);
                    } else if (i < L) {
                        if (m <= i)
                            y0 = acc[h][e] * expf(cg[i] - cg[m]);
                        if (m + 1 <= i)
                            y1 = acc[h][e + 1] * expf(cg[i] - cg[m + 1]);
                        *(float2 *)(w.aqk + (prow + i) * GT_C + m) = make_float2(y0, y1);
                    }
                }
        }
        __syncthreads();
        /* Q is done with: V's first 64 columns on their way during the solve */
        for (int i = tid; i < GT_C * (GT_DVB / 8); i += GT_THREADS) {
            int r = i / (GT_DVB / 8), x = (i % (GT_DVB / 8)) * 8;
            df_cp16(df_smem(Qs + r * LV + x), v + (r < L ? (base + r) * ldv + (int64_t)j * dv + x : 0), r < L);
        }
        df_commit();
        if (tid < GT_C)
            dec[tid] = -beta[tid] * ecg[tid]; /* the column scale of T for Wn */
        /* c: T = (I + A)^-1 (its barriers publish dec too) */
        gt_solve(A, Tm, X);
        /* d: Wn = (T diag(-beta exp(cg))) K: the warp's strip wr, DK / 2 columns; T lower: the
         * k-tiles up to the diagonal */
        {
            constexpr int NT = DK / 16; /* 8-column tiles a warp */
            const int n0 = (warp & 1) * (DK / 2);
            float acc[NT][4] = {};
            gm_tmul<NT>(acc, Tm, dec, Ks, LQ, n0, wr, lane);
            gm_out_rows<NT>(w.wn + (prow + 16 * wr) * DK + n0, DK, acc, L - 16 * wr, lane);
        }
        /* e: U = (T diag(beta)) V, 64 value columns at a time: the warp's strip wr, 32 columns */
        for (int c0 = 0; c0 < dv; c0 += GT_DVB) {
            df_wait<0>();
            __syncthreads();
            const int n0 = (warp & 1) * (GT_DVB / 2);
            float acc[4][4] = {};
            gm_tmul<4>(acc, Tm, beta, Qs, LV, n0, wr, lane);
            __syncthreads(); /* V read by every warp: the next 64 columns may come in */
            if (c0 + GT_DVB < dv) {
                for (int i = tid; i < GT_C * (GT_DVB / 8); i += GT_THREADS) {
                    int r = i / (GT_DVB / 8), x = (i % (GT_DVB / 8)) * 8;
                    df_cp16(df_smem(Qs + r * LV + x),
                            v + (r < L ? (base + r) * ldv + (int64_t)j * dv + c0 + GT_DVB + x : 0), r < L);
                }
                df_commit();
            }
            gm_out_rows<4>(w.u + (prow + 16 * wr) * dv + c0 + n0, dv, acc, L - 16 * wr, lane);
        }
    }
}

#endif
