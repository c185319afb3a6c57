/* dflash_attn.cu: DFlash drafter attention (backend.h dfl_dflash_attn) forward and backward on the
 * CUDA backend.
 *
 * The mask is never materialized. Block b's bs query slots attend to context rows
 * [ctx_start[b], ctx_start[b] + anchor[b]) and to the bs rows of their own block. With GQA the
 * group = n_heads / n_kv query heads of a block share one kv head, so a block contributes
 * RB = group * bs query rows per kv head (64 for the 8B drafter: 4 heads x 16 slots), and a CTA
 * takes NB = MMAX / RB consecutive blocks (whole blocks: a block's dk_blk / dv_blk sum over all
 * of its rows). Query row m of a CTA is (local block m / RB, head (m % RB) / bs, slot m % bs).
 *
 * bf16 path (tensor cores, mma.sync m16n8k16 bf16 -> f32, ldmatrix, cp.async double buffering;
 * shared-memory rows padded by 16 bytes, which makes ldmatrix conflict-free for any head dim):
 *  - forward: one CTA per (group of NB blocks, kv head). Key tiles of BN rows stream through
 *    shared memory: first the context rows of each "segment" (the CTA's blocks with one
 *    ctx_start; usually one) up to the segment's largest anchor, then the CTA's own block rows
 *    (rows [b0*bs, (b0+NB)*bs) of k_blk, contiguous). Online softmax in base 2 as in attn.cu.
 *    A row's keys are [lo, hi) in the phase's key coordinates (context: [0, anchor) if the row's
 *    block is in the segment; block phase: its own bs keys); masks are applied only on tiles
 *    that need them, and a warp skips tiles in which none of its rows has a key.
 *    O and lse (natural log of the scaled scores) are written.
 *  - backward, pass Q (same CTAs): delta = rowsum(dout * o) first (written for pass KV), then per
 *    key tile S = Q K^T, dP = dO V^T, P = exp(S - lse), dS = P (dP - delta), dQ += dS K; on the
 *    block-key tiles P and dS also go to shared memory and the CTA computes dV_blk = P^T dO and
 *    dK_blk = dS^T Q for those keys (complete: every row of the block is in the CTA).
 *  - backward, pass KV: one CTA per (context key tile of BNK rows, kv head), FA2 style: the
 *    tile's K and V stay in shared memory; the query rows of the blocks that see the tile stream
 *    by in chunks of QC rows (Q, dO, lse, delta, each row's visible context range); each warp
 *    owns 16 keys: S^T = K Q^T, dP^T = V dO^T, P^T, dS^T, dV += P^T dO, dK += dS^T Q. Every
 *    context row is written by exactly one CTA (0 where no block sees it): no atomics, no
 *    accumulation across CTAs, so the result is deterministic. A one-CTA scheduling kernel first
 *    counts, per key tile, the blocks that see it (and their range) and orders the tiles
 *    heaviest first (tiles near the start of a sequence are seen by most of its blocks).
 *    Blocks are assumed ordered by ctx_start (backend.h); anchors need not be sorted.
 *  Scratch (the schedule) lives in the backend's cuBLAS workspace (no GEMM runs in between).
 *
 * f32 path (act F32, and bf16 shapes the tiled kernels do not take: head dims other than 32, 64,
 * 128, RB > 128, unaligned buffers): one warp per (query row, head), (key row, kv head); exact
 * f32 arithmetic, slow; for tests and odd shapes. */
#include <math.h>
#include <stdio.h>
#include <string.h>

#include "be_cuda.cuh"
#include "cuda_train.h"

#define DF_LOG2E 1.4426950408889634f
#define DF_NBMAX 32            /* blocks per CTA at most */
#define DF_SCHED_MAX 8192      /* key tiles the scheduler sorts (more: natural order) */

struct DfP {
    const void *q, *kc, *vc, *kb, *vb, *o_in, *dout;
    void *o, *dq, *dkc, *dvc, *dkb, *dvb;
    float *lse, *delta;
    const int32_t *cs, *an;
    int n_blocks, bs, nh, nkv, group, d, rb, nb, n_bg;
    int64_t T_ctx, ldq, ldk;
    float scale, sl2;
    const int *sched;   /* pass KV: order [n_kt], first block [n_kt], end block [n_kt] */
    int n_kt;
};

/* ------------------------------------------------------------------------------------------ */
/* PTX helpers */

__device__ __forceinline__ uint32_t df_smem(const void *p) { return (uint32_t)__cvta_generic_to_shared(p); }

__device__ __forceinline__ void df_cp16(uint32_t dst, const void *src, bool ok)
{
    int n = ok ? 16 : 0;
    asm volatile("cp.async.cg.shared.global [%0], [%1], 16, %2;\n" ::"r"(dst), "l"(src), "r"(n) : "memory");
}
__device__ __forceinline__ void df_commit() { asm volatile("cp.async.commit_group;\n" ::: "memory"); }
template <int N> __device__ __forceinline__ void df_wait() { asm volatile("cp.async.wait_group %0;\n" ::"n"(N) : "memory"); }

__device__ __forceinline__ void df_ldm(uint32_t (&r)[4], uint32_t addr)
{
    asm volatile("ldmatrix.sync.aligned.m8n8.x4.shared.b16 {%0, %1, %2, %3}, [%4];\n"
                 : "=r"(r[0]), "=r"(r[1]), "=r"(r[2]), "=r"(r[3]) : "r"(addr));
}
__device__ __forceinline__ void df_ldm_t(uint32_t (&r)[4], uint32_t addr)
{
    asm volatile("ldmatrix.sync.aligned.m8n8.x4.trans.shared.b16 {%0, %1, %2, %3}, [%4];\n"
                 : "=r"(r[0]), "=r"(r[1]), "=r"(r[2]), "=r"(r[3]) : "r"(addr));
}
/* c += a (16x16 row) * b (16x8 col), bf16 in, f32 accumulate */
__device__ __forceinline__ void df_mma(float (&c)[4], const uint32_t (&a)[4], uint32_t b0, uint32_t b1)
{
    asm("mma.sync.aligned.m16n8k16.row.col.f32.bf16.bf16.f32 {%0, %1, %2, %3}, "
        "{%4, %5, %6, %7}, {%8, %9}, {%0, %1, %2, %3};\n"
        : "+f"(c[0]), "+f"(c[1]), "+f"(c[2]), "+f"(c[3])
        : "r"(a[0]), "r"(a[1]), "r"(a[2]), "r"(a[3]), "r"(b0), "r"(b1));
}
__device__ __forceinline__ float df_exp2(float x)
{
    float y;
    asm("ex2.approx.ftz.f32 %0, %1;\n" : "=f"(y) : "f"(x));
    return y;
}
__device__ __forceinline__ uint32_t df_pack(float lo, float hi)
{
    __nv_bfloat162 v = __floats2bfloat162_rn(lo, hi);
    return *reinterpret_cast<uint32_t *>(&v);
}

/* Per-lane ldmatrix offsets (bytes) within a tile of rows of RB bytes (padded rows, no swizzle):
 *  A  (16 rows x 16 cols, row-major source):            row lane & 15, chunk lane >> 4
 *  B  (16 n-rows x 16 k, the n rows of two n8 tiles):   row (lane & 7) + 8 (lane >> 4), chunk (lane >> 3) & 1
 *  BT (16 k-rows x 16 n cols, transposed load):         row (lane & 7) + 8 ((lane >> 3) & 1), chunk lane >> 4
 *  AT (A from a [k][m] source, transposed load):        as B (with .trans) */
__device__ __forceinline__ uint32_t lane_a(int lane, int rowb) { return (uint32_t)((lane & 15) * rowb + (lane >> 4) * 16); }
__device__ __forceinline__ uint32_t lane_b(int lane, int rowb) { return (uint32_t)(((lane & 7) + ((lane >> 4) << 3)) * rowb + ((lane >> 3) & 1) * 16); }
__device__ __forceinline__ uint32_t lane_bt(int lane, int rowb) { return (uint32_t)(((lane & 7) + (((lane >> 3) & 1) << 3)) * rowb + (lane >> 4) * 16); }

/* ------------------------------------------------------------------------------------------ */
/* query-stationary CTAs (forward, backward pass Q): metadata in shared memory */

template <int MMAX> struct QsMeta {
    int blk_an[DF_NBMAX], blk_seg[DF_NBMAX];
    int seg_cs[DF_NBMAX], seg_amax[DF_NBMAX], seg_amin[DF_NBMAX], seg_nt[DF_NBMAX];
    int nseg, nb, ntiles;
    long long row_off[MMAX];   /* element offset of row m in [Q, n_heads*d] arrays; -1: no row */
    int row_idx[MMAX];         /* index of row m in [Q, n_heads] arrays */
};

/* b0: the CTA's first block; g: its kv head. Ends with a barrier. */
template <int MMAX>
__device__ void qs_setup(QsMeta<MMAX> &mt, const DfP &p, int b0, int g, int BN)
{
    const int nb = min(p.nb, p.n_blocks - b0);
    if (threadIdx.x == 0) {
        int ns = 0, nt = 0;
        for (int i = 0; i < nb; i++) {
            int c = p.cs[b0 + i], a = p.an[b0 + i];
            mt.blk_an[i] = a;
            if (ns == 0 || c != mt.seg_cs[ns - 1]) {
                mt.seg_cs[ns] = c;
                mt.seg_amax[ns] = a;
                mt.seg_amin[ns] = a;
                ns++;
            } else {
                mt.seg_amax[ns - 1] = max(mt.seg_amax[ns - 1], a);
                mt.seg_amin[ns - 1] = min(mt.seg_amin[ns - 1], a);
            }
            mt.blk_seg[i] = ns - 1;
        }
        for (int s = 0; s < ns; s++) {
            mt.seg_nt[s] = (mt.seg_amax[s] + BN - 1) / BN;
            nt += mt.seg_nt[s];
        }
        nt += (nb * p.bs + BN - 1) / BN;
        mt.nseg = ns;
        mt.nb = nb;
        mt.ntiles = nt;
    }
    for (int m = threadIdx.x; m < MMAX; m += blockDim.x) {
        if (m < nb * p.rb) {
            int lb = m / p.rb, rem = m - lb * p.rb, hl = rem / p.bs, j = rem - hl * p.bs;
            int64_t grow = (int64_t)(b0 + lb) * p.bs + j;
            int head = g * p.group + hl;
            mt.row_off[m] = grow * p.ldq + (int64_t)head * p.d;
            mt.row_idx[m] = (int)(grow * p.nh + head);
        } else {
            mt.row_off[m] = -1;
            mt.row_idx[m] = -1;
        }
    }
    __syncthreads();
}

struct DfTile {
    const bf16 *k, *v;   /* row of key 0 of the tile (head column included) */
    int key0, nvalid;
    int seg;             /* >= 0: context segment; -1: the block keys */
};

template <int MMAX>
__device__ __forceinline__ DfTile tile_at(const QsMeta<MMAX> &mt, const DfP &p, int it, int b0, int g, int BN)
{
    int s = 0;
    while (s < mt.nseg && it >= mt.seg_nt[s]) {
        it -= mt.seg_nt[s];
        s++;
    }
    DfTile t;
    t.key0 = it * BN;
    int64_t row;
    if (s < mt.nseg) {
        row = (int64_t)mt.seg_cs[s] + t.key0;
        t.k = (const bf16 *)p.kc + row * p.ldk + (int64_t)g * p.d;
        t.v = (const bf16 *)p.vc + row * p.ldk + (int64_t)g * p.d;
        t.nvalid = min(BN, mt.seg_amax[s] - t.key0);
        t.seg = s;
    } else {
        row = (int64_t)b0 * p.bs + t.key0;
        t.k = (const bf16 *)p.kb + row * p.ldk + (int64_t)g * p.d;
        t.v = (const bf16 *)p.vb + row * p.ldk + (int64_t)g * p.d;
        t.nvalid = min(BN, mt.nb * p.bs - t.key0);
        t.seg = -1;
    }
    return t;
}

/* cp.async a tile of BN rows (K and V) into shared memory; rows past nvalid are zero-filled */
template <int D, int BN, int THREADS>
__device__ __forceinline__ void load_kv_tile(const DfTile &t, int64_t ldk, uint32_t sk, uint32_t sv)
{
    constexpr int CH = D / 8, ROWB = D * 2 + 16;
    for (int c = threadIdx.x; c < BN * CH; c += THREADS) {
        int r = c / CH, ch = c % CH;
        bool ok = r < t.nvalid;
        int64_t off = ok ? (int64_t)r * ldk + ch * 8 : 0;
        df_cp16(sk + r * ROWB + ch * 16, t.k + off, ok);
        df_cp16(sv + r * ROWB + ch * 16, t.v + off, ok);
    }
}

/* load MMAX rows of a [Q, n_heads*d] array (the CTA's query rows) into shared memory */
template <int D, int MMAX, int THREADS>
__device__ __forceinline__ void load_rows(const QsMeta<MMAX> &mt, const bf16 *src, uint32_t dst)
{
    constexpr int CH = D / 8, ROWB = D * 2 + 16;
    for (int c = threadIdx.x; c < MMAX * CH; c += THREADS) {
        int r = c / CH, ch = c % CH;
        long long off = mt.row_off[r];
        df_cp16(dst + r * ROWB + ch * 16, off >= 0 ? src + off + ch * 8 : src, off >= 0);
    }
}

/* The keys [lo, hi) of the thread's rows for phase seg (see the file comment). */
template <int MMAX, int MT>
__device__ __forceinline__ void phase_ranges(const QsMeta<MMAX> &mt, int seg, int bs,
                                             const int (&rlb)[MT][2], int (&lo)[MT][2], int (&hi)[MT][2])
{
#pragma unroll
    for (int i = 0; i < MT; i++)
#pragma unroll
        for (int hh = 0; hh < 2; hh++) {
            int lb = rlb[i][hh];
            if (lb < 0) {
                lo[i][hh] = hi[i][hh] = 0;
            } else if (seg >= 0) {
                lo[i][hh] = 0;
                hi[i][hh] = mt.blk_seg[lb] == seg ? mt.blk_an[lb] : 0;
            } else {
                lo[i][hh] = lb * bs;
                hi[i][hh] = lo[i][hh] + bs;
            }
        }
}

/* ------------------------------------------------------------------------------------------ */
/* forward (bf16) */

template <int D, int MT, int NW, int BN, bool QREG>
struct FwdCfg {
    static constexpr int MMAX = 16 * MT * NW;
    static constexpr int THREADS = 32 * NW;
    static constexpr int ROWB = D * 2 + 16;
    static constexpr size_t SMEM = (size_t)(MMAX + 4 * BN) * ROWB;
};

template <int D, int MT, int NW, int BN, bool QREG>
__global__ void __launch_bounds__(32 * NW)
df_fwd_kernel(const DfP p)
{
    typedef FwdCfg<D, MT, NW, BN, QREG> C;
    constexpr int MMAX = C::MMAX, THREADS = C::THREADS, ROWB = C::ROWB;
    constexpr int CH = D / 8, NT = BN / 8, KD = D / 16, DT = D / 8, KB = BN / 16;
    static_assert(D % 32 == 0 && BN % 16 == 0, "tile shape");

    extern __shared__ __align__(128) unsigned char smem[];
    __shared__ QsMeta<MMAX> mt;
    const uint32_t sQ = df_smem(smem), sK0 = sQ + MMAX * ROWB, sV0 = sK0 + 2 * BN * ROWB;
    const int g_kv = (int)(blockIdx.x % (unsigned)p.nkv);
    const int bg = p.n_bg - 1 - (int)(blockIdx.x / (unsigned)p.nkv);   /* heaviest (last) first */
    const int b0 = bg * p.nb;
    const int tid = threadIdx.x, warp = tid >> 5, lane = tid & 31;
    const int g = lane >> 2, t4 = lane & 3;

    qs_setup<MMAX>(mt, p, b0, g_kv, BN);
    load_rows<D, MMAX, THREADS>(mt, (const bf16 *)p.q, sQ);
    const int ntiles = mt.ntiles;
    {
        DfTile t0 = tile_at<MMAX>(mt, p, 0, b0, g_kv, BN);
        load_kv_tile<D, BN, THREADS>(t0, p.ldk, sK0, sV0);
    }
    df_commit();

    const int wr0 = warp * 16 * MT;
    int rlb[MT][2], lo[MT][2], hi[MT][2];
#pragma unroll
    for (int i = 0; i < MT; i++)
#pragma unroll
        for (int hh = 0; hh < 2; hh++) {
            int m = wr0 + i * 16 + g + 8 * hh;
            rlb[i][hh] = mt.row_off[m] >= 0 ? m / p.rb : -1;
        }
    int cur_seg = -2;

    const uint32_t q_lane = sQ + wr0 * ROWB + lane_a(lane, ROWB);
    const uint32_t k_lane = lane_b(lane, ROWB);
    const uint32_t v_lane = lane_bt(lane, ROWB);

    float o[MT][DT][4];
    float mrow[MT][2], lrow[MT][2];
#pragma unroll
    for (int i = 0; i < MT; i++) {
#pragma unroll
        for (int dt = 0; dt < DT; dt++)
#pragma unroll
            for (int e = 0; e < 4; e++)
                o[i][dt][e] = 0.0f;
#pragma unroll
        for (int hh = 0; hh < 2; hh++) {
            mrow[i][hh] = -INFINITY;
            lrow[i][hh] = 0.0f;
        }
    }
    uint32_t qf[QREG ? MT : 1][QREG ? KD : 1][4];
    const float sl2 = p.sl2;

    for (int it = 0; it < ntiles; it++) {
        const int stage = it & 1;
        const DfTile t = tile_at<MMAX>(mt, p, it, b0, g_kv, BN);
        if (it + 1 < ntiles) {
            DfTile tn = tile_at<MMAX>(mt, p, it + 1, b0, g_kv, BN);
            load_kv_tile<D, BN, THREADS>(tn, p.ldk, sK0 + (stage ^ 1) * BN * ROWB, sV0 + (stage ^ 1) * BN * ROWB);
            df_commit();
            df_wait<1>();
        } else {
            df_wait<0>();
        }
        __syncthreads();
        if (QREG && it == 0) {
#pragma unroll
            for (int i = 0; i < MT; i++)
#pragma unroll
                for (int kk = 0; kk < KD; kk++)
                    df_ldm(qf[QREG ? i : 0][QREG ? kk : 0], q_lane + i * 16 * ROWB + kk * 32);
        }
        if (t.seg != cur_seg) {
            phase_ranges<MMAX, MT>(mt, t.seg, p.bs, rlb, lo, hi);
            cur_seg = t.seg;
        }
        const int key0 = t.key0;
        const bool need_mask = t.seg < 0 || mt.nseg > 1 || key0 + BN > mt.seg_amin[t.seg];
        bool mine = false;
#pragma unroll
        for (int i = 0; i < MT; i++)
#pragma unroll
            for (int hh = 0; hh < 2; hh++)
                mine |= lo[i][hh] < key0 + BN && hi[i][hh] > key0 && lo[i][hh] < hi[i][hh];
        if (__any_sync(0xffffffffu, mine)) {
            const uint32_t kst = sK0 + stage * BN * ROWB, vst = sV0 + stage * BN * ROWB;
            float s[MT][NT][4];
#pragma unroll
            for (int i = 0; i < MT; i++)
#pragma unroll
                for (int nt = 0; nt < NT; nt++)
#pragma unroll
                    for (int e = 0; e < 4; e++)
                        s[i][nt][e] = 0.0f;
#pragma unroll
            for (int kk = 0; kk < KD; kk++) {
                uint32_t a[MT][4];
#pragma unroll
                for (int i = 0; i < MT; i++) {
                    if (QREG) {
#pragma unroll
                        for (int e = 0; e < 4; e++)
                            a[i][e] = qf[QREG ? i : 0][QREG ? kk : 0][e];
                    } else {
                        df_ldm(a[i], q_lane + i * 16 * ROWB + kk * 32);
                    }
                }
#pragma unroll
                for (int np = 0; np < NT / 2; np++) {
                    uint32_t b[4];
                    df_ldm(b, kst + np * 16 * ROWB + k_lane + kk * 32);
#pragma unroll
                    for (int i = 0; i < MT; i++) {
                        df_mma(s[i][2 * np], a[i], b[0], b[1]);
                        df_mma(s[i][2 * np + 1], a[i], b[2], b[3]);
                    }
                }
            }
            if (need_mask) {
#pragma unroll
                for (int i = 0; i < MT; i++)
#pragma unroll
                    for (int nt = 0; nt < NT; nt++)
#pragma unroll
                        for (int e = 0; e < 4; e++) {
                            int kj = key0 + nt * 8 + 2 * t4 + (e & 1);
                            int hh = e >> 1;
                            if (!(kj >= lo[i][hh] && kj < hi[i][hh]))
                                s[i][nt][e] = -INFINITY;
                        }
            }
#pragma unroll
            for (int i = 0; i < MT; i++)
#pragma unroll
                for (int hh = 0; hh < 2; hh++) {
                    float mx = -INFINITY;
#pragma unroll
                    for (int nt = 0; nt < NT; nt++)
                        mx = fmaxf(mx, fmaxf(s[i][nt][2 * hh], s[i][nt][2 * hh + 1]));
                    mx = fmaxf(mx, __shfl_xor_sync(0xffffffffu, mx, 1));
                    mx = fmaxf(mx, __shfl_xor_sync(0xffffffffu, mx, 2));
                    float mnew = fmaxf(mrow[i][hh], mx);
                    float mscaled = mnew == -INFINITY ? 0.0f : mnew * sl2;
                    float alpha = df_exp2(mrow[i][hh] * sl2 - mscaled);
                    mrow[i][hh] = mnew;
                    float rs = 0.0f;
#pragma unroll
                    for (int nt = 0; nt < NT; nt++)
#pragma unroll
                        for (int e = 2 * hh; e < 2 * hh + 2; e++) {
                            float pv = df_exp2(fmaf(s[i][nt][e], sl2, -mscaled));
                            s[i][nt][e] = pv;
                            rs += pv;
                        }
                    lrow[i][hh] = lrow[i][hh] * alpha + rs;
#pragma unroll
                    for (int dt = 0; dt < DT; dt++) {
                        o[i][dt][2 * hh] *= alpha;
                        o[i][dt][2 * hh + 1] *= alpha;
                    }
                }
#pragma unroll
            for (int kb = 0; kb < KB; kb++) {
                uint32_t a[MT][4];
#pragma unroll
                for (int i = 0; i < MT; i++) {
                    a[i][0] = df_pack(s[i][2 * kb][0], s[i][2 * kb][1]);
                    a[i][1] = df_pack(s[i][2 * kb][2], s[i][2 * kb][3]);
                    a[i][2] = df_pack(s[i][2 * kb + 1][0], s[i][2 * kb + 1][1]);
                    a[i][3] = df_pack(s[i][2 * kb + 1][2], s[i][2 * kb + 1][3]);
                }
#pragma unroll
                for (int dp = 0; dp < DT / 2; dp++) {
                    uint32_t b[4];
                    df_ldm_t(b, vst + kb * 16 * ROWB + v_lane + dp * 32);
#pragma unroll
                    for (int i = 0; i < MT; i++) {
                        df_mma(o[i][2 * dp], a[i], b[0], b[1]);
                        df_mma(o[i][2 * dp + 1], a[i], b[2], b[3]);
                    }
                }
            }
        }
        __syncthreads();   /* the stage is refilled next iteration */
    }

    /* O / l through the warp's own Q rows, then 16-byte stores; lse */
#pragma unroll
    for (int i = 0; i < MT; i++)
#pragma unroll
        for (int hh = 0; hh < 2; hh++) {
            float l = lrow[i][hh];
            l += __shfl_xor_sync(0xffffffffu, l, 1);
            l += __shfl_xor_sync(0xffffffffu, l, 2);
            float inv = l > 0.0f ? 1.0f / l : 0.0f;
            const int m = wr0 + i * 16 + g + 8 * hh;
            unsigned char *rowp = smem + m * ROWB + 4 * t4;
#pragma unroll
            for (int dt = 0; dt < DT; dt++)
                *reinterpret_cast<uint32_t *>(rowp + dt * 16) =
                    df_pack(o[i][dt][2 * hh] * inv, o[i][dt][2 * hh + 1] * inv);
            if (t4 == 0 && mt.row_idx[m] >= 0)
                p.lse[mt.row_idx[m]] = l > 0.0f ? mrow[i][hh] * p.scale + logf(l) : -INFINITY;
        }
    __syncwarp();
    bf16 *og = (bf16 *)p.o;
    for (int c = lane; c < 16 * MT * CH; c += 32) {
        int r = wr0 + c / CH, ch = c % CH;
        long long off = mt.row_off[r];
        if (off >= 0)
            *reinterpret_cast<uint4 *>(og + off + ch * 8) = *reinterpret_cast<const uint4 *>(smem + r * ROWB + ch * 16);
    }
}

/* ------------------------------------------------------------------------------------------ */
/* backward pass Q (bf16): one warp per 16 query rows */

template <int D, int NW, int BN>
struct BwdQCfg {
    static constexpr int MMAX = 16 * NW;
    static constexpr int THREADS = 32 * NW;
    static constexpr int ROWB = D * 2 + 16;
    static constexpr int ROWP = BN * 2 + 16;
    static constexpr size_t SMEM = (size_t)(2 * MMAX + 4 * BN) * ROWB + (size_t)2 * MMAX * ROWP;
};

template <int D, int NW, int BN>
__global__ void __launch_bounds__(32 * NW)
df_bwd_q_kernel(const DfP p)
{
    typedef BwdQCfg<D, NW, BN> C;
    constexpr int MMAX = C::MMAX, THREADS = C::THREADS, ROWB = C::ROWB, ROWP = C::ROWP;
    constexpr int CH = D / 8, NT = BN / 8, KD = D / 16, DT = D / 8, KB = BN / 16;
    static_assert(D % 32 == 0 && BN % 16 == 0, "tile shape");

    extern __shared__ __align__(128) unsigned char smem[];
    __shared__ QsMeta<MMAX> mt;
    __shared__ float sLse2[MMAX], sDelta[MMAX];
    const uint32_t sQ = df_smem(smem), sDO = sQ + MMAX * ROWB, sK0 = sDO + MMAX * ROWB;
    const uint32_t sV0 = sK0 + 2 * BN * ROWB, sP = sV0 + 2 * BN * ROWB, sDS = sP + MMAX * ROWP;
    unsigned char *pP = smem + (sP - sQ), *pDS = smem + (sDS - sQ), *pDO = smem + (sDO - sQ);
    const int g_kv = (int)(blockIdx.x % (unsigned)p.nkv);
    const int bg = p.n_bg - 1 - (int)(blockIdx.x / (unsigned)p.nkv);
    const int b0 = bg * p.nb;
    const int tid = threadIdx.x, warp = tid >> 5, lane = tid & 31;
    const int g = lane >> 2, t4 = lane & 3;

    qs_setup<MMAX>(mt, p, b0, g_kv, BN);
    load_rows<D, MMAX, THREADS>(mt, (const bf16 *)p.q, sQ);
    load_rows<D, MMAX, THREADS>(mt, (const bf16 *)p.dout, sDO);
    df_commit();
    const int ntiles = mt.ntiles;
    {
        DfTile t0 = tile_at<MMAX>(mt, p, 0, b0, g_kv, BN);
        load_kv_tile<D, BN, THREADS>(t0, p.ldk, sK0, sV0);
    }
    df_commit();
    df_wait<1>();
    __syncthreads();

    /* delta = rowsum(dout * o) of the warp's 16 rows: LPR lanes per row */
    const int wr0 = warp * 16;
    {
        constexpr int LPR = CH < 32 ? CH : 32, RPP = 32 / LPR;
        const bf16 *og = (const bf16 *)p.o_in;
        for (int k = 0; k < 16 / RPP; k++) {
            const int r = wr0 + k * RPP + lane / LPR;
            const long long off = mt.row_off[r];
            float dot = 0.0f;
            for (int ch = lane % LPR; ch < CH; ch += LPR) {
                if (off >= 0) {
                    uint4 ov = *reinterpret_cast<const uint4 *>(og + off + ch * 8);
                    uint4 dv = *reinterpret_cast<const uint4 *>(pDO + r * ROWB + ch * 16);
                    const bf16 *oe = reinterpret_cast<const bf16 *>(&ov), *de = reinterpret_cast<const bf16 *>(&dv);
#pragma unroll
                    for (int j = 0; j < 8; j++)
                        dot += __bfloat162float(oe[j]) * __bfloat162float(de[j]);
                }
            }
#pragma unroll
            for (int sft = LPR / 2; sft > 0; sft >>= 1)
                dot += __shfl_xor_sync(0xffffffffu, dot, sft);
            if (lane % LPR == 0) {
                const int idx = mt.row_idx[r];
                sDelta[r] = off >= 0 ? dot : 0.0f;
                sLse2[r] = off >= 0 ? p.lse[idx] * DF_LOG2E : INFINITY;
                if (off >= 0)
                    p.delta[idx] = dot;
            }
        }
    }
    __syncwarp();
    int rlb[1][2], lo[1][2], hi[1][2];
    float lse2[2], dlt[2];
#pragma unroll
    for (int hh = 0; hh < 2; hh++) {
        int m = wr0 + g + 8 * hh;
        rlb[0][hh] = mt.row_off[m] >= 0 ? m / p.rb : -1;
        lse2[hh] = sLse2[m];
        dlt[hh] = sDelta[m];
    }
    int cur_seg = -2;

    const uint32_t q_lane = sQ + wr0 * ROWB + lane_a(lane, ROWB);
    const uint32_t do_lane = sDO + wr0 * ROWB + lane_a(lane, ROWB);
    const uint32_t k_lane = lane_b(lane, ROWB);
    const uint32_t kt_lane = lane_bt(lane, ROWB);
    const uint32_t at_lane = lane_b(lane, ROWP);
    const uint32_t bt_lane = lane_bt(lane, ROWB);
    const float sl2 = p.sl2;

    float dq[DT][4];
#pragma unroll
    for (int dt = 0; dt < DT; dt++)
#pragma unroll
        for (int e = 0; e < 4; e++)
            dq[dt][e] = 0.0f;

    for (int it = 0; it < ntiles; it++) {
        const int stage = it & 1;
        const DfTile t = tile_at<MMAX>(mt, p, it, b0, g_kv, BN);
        if (it + 1 < ntiles) {
            DfTile tn = tile_at<MMAX>(mt, p, it + 1, b0, g_kv, BN);
            load_kv_tile<D, BN, THREADS>(tn, p.ldk, sK0 + (stage ^ 1) * BN * ROWB, sV0 + (stage ^ 1) * BN * ROWB);
            df_commit();
            df_wait<1>();
        } else {
            df_wait<0>();
        }
        __syncthreads();
        if (t.seg != cur_seg) {
            phase_ranges<MMAX, 1>(mt, t.seg, p.bs, rlb, lo, hi);
            cur_seg = t.seg;
        }
        const int key0 = t.key0;
        const bool blk = t.seg < 0;
        const bool need_mask = blk || mt.nseg > 1 || key0 + BN > mt.seg_amin[t.seg];
        bool mine = false;
#pragma unroll
        for (int hh = 0; hh < 2; hh++)
            mine |= lo[0][hh] < key0 + BN && hi[0][hh] > key0 && lo[0][hh] < hi[0][hh];
        if (blk || __any_sync(0xffffffffu, mine)) {
            const uint32_t kst = sK0 + stage * BN * ROWB, vst = sV0 + stage * BN * ROWB;
            float s[NT][4], dp[NT][4];
#pragma unroll
            for (int nt = 0; nt < NT; nt++)
#pragma unroll
                for (int e = 0; e < 4; e++)
                    s[nt][e] = dp[nt][e] = 0.0f;
#pragma unroll
            for (int kk = 0; kk < KD; kk++) {
                uint32_t a[4], ad[4];
                df_ldm(a, q_lane + kk * 32);
                df_ldm(ad, do_lane + kk * 32);
#pragma unroll
                for (int np = 0; np < NT / 2; np++) {
                    uint32_t b[4];
                    df_ldm(b, kst + np * 16 * ROWB + k_lane + kk * 32);
                    df_mma(s[2 * np], a, b[0], b[1]);
                    df_mma(s[2 * np + 1], a, b[2], b[3]);
                    df_ldm(b, vst + np * 16 * ROWB + k_lane + kk * 32);
                    df_mma(dp[2 * np], ad, b[0], b[1]);
                    df_mma(dp[2 * np + 1], ad, b[2], b[3]);
                }
            }
            /* P = exp(S - lse) (0 where masked), dS = P (dP - delta) */
#pragma unroll
            for (int nt = 0; nt < NT; nt++)
#pragma unroll
                for (int e = 0; e < 4; e++) {
                    const int hh = e >> 1;
                    const int kj = key0 + nt * 8 + 2 * t4 + (e & 1);
                    const bool ok = !need_mask || (kj >= lo[0][hh] && kj < hi[0][hh]);
                    const float pv = ok ? df_exp2(fmaf(s[nt][e], sl2, -lse2[hh])) : 0.0f;
                    s[nt][e] = pv;
                    dp[nt][e] = pv * (dp[nt][e] - dlt[hh]);
                }
            if (blk) {
#pragma unroll
                for (int nt = 0; nt < NT; nt++)
#pragma unroll
                    for (int hh = 0; hh < 2; hh++) {
                        const int off = (wr0 + g + 8 * hh) * ROWP + (nt * 8 + 2 * t4) * 2;
                        *reinterpret_cast<uint32_t *>(pP + off) = df_pack(s[nt][2 * hh], s[nt][2 * hh + 1]);
                        *reinterpret_cast<uint32_t *>(pDS + off) = df_pack(dp[nt][2 * hh], dp[nt][2 * hh + 1]);
                    }
            }
            /* dQ += dS K */
#pragma unroll
            for (int kb = 0; kb < KB; kb++) {
                uint32_t a[4];
                a[0] = df_pack(dp[2 * kb][0], dp[2 * kb][1]);
                a[1] = df_pack(dp[2 * kb][2], dp[2 * kb][3]);
                a[2] = df_pack(dp[2 * kb + 1][0], dp[2 * kb + 1][1]);
                a[3] = df_pack(dp[2 * kb + 1][2], dp[2 * kb + 1][3]);
#pragma unroll
                for (int dp2 = 0; dp2 < DT / 2; dp2++) {
                    uint32_t b[4];
                    df_ldm_t(b, kst + kb * 16 * ROWB + kt_lane + dp2 * 32);
                    df_mma(dq[2 * dp2], a, b[0], b[1]);
                    df_mma(dq[2 * dp2 + 1], a, b[2], b[3]);
                }
            }
        }
        if (blk) {
            /* dV_blk = P^T dO, dK_blk = scale dS^T Q for this tile's keys */
            __syncthreads();
            const int M = mt.nb * p.rb, ksteps = (M + 15) / 16, nkeys = mt.nb * p.bs;
            constexpr int UNITS = (BN / 16) * 2 * (D / 16);
            for (int u = warp; u < UNITS; u += NW) {
                const int mk = u % (BN / 16), rest = u / (BN / 16), which = rest & 1, np = rest >> 1;
                const uint32_t asrc = which ? sDS : sP, bsrc = which ? sQ : sDO;
                float acc[2][4];
#pragma unroll
                for (int j = 0; j < 2; j++)
#pragma unroll
                    for (int e = 0; e < 4; e++)
                        acc[j][e] = 0.0f;
                for (int kk = 0; kk < ksteps; kk++) {
                    uint32_t a[4], b[4];
                    df_ldm_t(a, asrc + kk * 16 * ROWP + at_lane + mk * 32);
                    df_ldm_t(b, bsrc + kk * 16 * ROWB + bt_lane + np * 32);
                    df_mma(acc[0], a, b[0], b[1]);
                    df_mma(acc[1], a, b[2], b[3]);
                }
                const float f = which ? p.scale : 1.0f;
                bf16 *dst = (bf16 *)(which ? p.dkb : p.dvb);
#pragma unroll
                for (int hh = 0; hh < 2; hh++) {
                    const int key = key0 + mk * 16 + g + 8 * hh;
                    if (key < nkeys) {
                        bf16 *row = dst + ((int64_t)b0 * p.bs + key) * p.ldk + (int64_t)g_kv * D;
#pragma unroll
                        for (int j = 0; j < 2; j++)
                            *reinterpret_cast<uint32_t *>(row + np * 16 + j * 8 + 2 * t4) =
                                df_pack(acc[j][2 * hh] * f, acc[j][2 * hh + 1] * f);
                    }
                }
            }
        }
        __syncthreads();
    }

    /* dQ * scale through the warp's own Q rows, then 16-byte stores */
#pragma unroll
    for (int hh = 0; hh < 2; hh++) {
        unsigned char *rowp = smem + (wr0 + g + 8 * hh) * ROWB + 4 * t4;
#pragma unroll
        for (int dt = 0; dt < DT; dt++)
            *reinterpret_cast<uint32_t *>(rowp + dt * 16) =
                df_pack(dq[dt][2 * hh] * p.scale, dq[dt][2 * hh + 1] * p.scale);
    }
    __syncwarp();
    bf16 *dqg = (bf16 *)p.dq;
    for (int c = lane; c < 16 * CH; c += 32) {
        int r = wr0 + c / CH, ch = c % CH;
        long long off = mt.row_off[r];
        if (off >= 0)
            *reinterpret_cast<uint4 *>(dqg + off + ch * 8) = *reinterpret_cast<const uint4 *>(smem + r * ROWB + ch * 16);
    }
}

/* ------------------------------------------------------------------------------------------ */
/* backward pass KV (bf16): key-stationary, one warp per 16 context keys */

template <int D, int NW, int QC>
struct BwdKVCfg {
    static constexpr int BNK = 16 * NW;
    static constexpr int THREADS = 32 * NW;
    static constexpr int ROWB = D * 2 + 16;
    static constexpr size_t SMEM = (size_t)(2 * BNK + 4 * QC) * ROWB;
};

__device__ __forceinline__ int df_upper(const int32_t *a, int n, int64_t x)   /* first i: a[i] > x */
{
    int lo = 0, hi = n;
    while (lo < hi) {
        int mid = (lo + hi) >> 1;
        if (a[mid] <= x)
            lo = mid + 1;
        else
            hi = mid;
    }
    return lo;
}

__device__ __forceinline__ int df_lower(const int32_t *a, int n, int64_t x)   /* first i: a[i] >= x */
{
    int lo = 0, hi = n;
    while (lo < hi) {
        int mid = (lo + hi) >> 1;
        if (a[mid] < x)
            lo = mid + 1;
        else
            hi = mid;
    }
    return lo;
}

/* The blocks that see context rows [c0, c1): within [first, end) (blocks of the sequence holding
 * c0 and of sequences starting inside the range), those with cs + an > c0 and an > 0. */
__device__ void df_tile_blocks(const DfP &p, int64_t c0, int64_t c1, int *first, int *end, int *count)
{
    const int blast = df_upper(p.cs, p.n_blocks, c1 - 1);
    const int ub0 = df_upper(p.cs, p.n_blocks, c0);
    const int bfirst = ub0 > 0 ? df_lower(p.cs, p.n_blocks, p.cs[ub0 - 1]) : 0;
    int f = blast, l = bfirst, n = 0;
    for (int b = bfirst; b < blast; b++) {
        int a = p.an[b];
        if (a > 0 && (int64_t)p.cs[b] + a > c0) {
            n++;
            f = min(f, b);
            l = b + 1;
        }
    }
    if (n == 0)
        f = l = 0;
    *first = f;
    *end = l;
    *count = n;
}

/* one CTA: per key tile the range of blocks that see it and their count; the tiles ordered by
 * count, largest first (ties by index) */
__global__ void __launch_bounds__(1024) df_sched_kernel(const DfP p, int *sched, int bnk)
{
    __shared__ int work[DF_SCHED_MAX];
    const int n = p.n_kt;
    for (int kt = threadIdx.x; kt < n; kt += blockDim.x) {
        int64_t c0 = (int64_t)kt * bnk, c1 = min(p.T_ctx, c0 + bnk);
        int f, l, cnt;
        df_tile_blocks(p, c0, c1, &f, &l, &cnt);
        sched[n + kt] = f;
        sched[2 * n + kt] = l;
        if (n <= DF_SCHED_MAX)
            work[kt] = cnt;
    }
    __syncthreads();
    for (int kt = threadIdx.x; kt < n; kt += blockDim.x) {
        if (n > DF_SCHED_MAX) {
            sched[kt] = kt;
            continue;
        }
        const int w = work[kt];
        int rank = 0;
        for (int u = 0; u < n; u++) {
            int x = work[u];
            rank += x > w || (x == w && u < kt);
        }
        sched[rank] = kt;
    }
}

template <int D, int NW, int QC>
__global__ void __launch_bounds__(32 * NW)
df_bwd_kv_kernel(const DfP p)
{
    typedef BwdKVCfg<D, NW, QC> C;
    constexpr int BNK = C::BNK, THREADS = C::THREADS, ROWB = C::ROWB;
    constexpr int CH = D / 8, KD = D / 16, DT = D / 8, NSC = QC / 32;
    static_assert(D % 32 == 0 && QC % 32 == 0 && QC <= THREADS, "tile shape");

    extern __shared__ __align__(128) unsigned char smem[];
    __shared__ long long sOff[2][QC];
    __shared__ float sL2[2][QC], sDl[2][QC];
    __shared__ int sLo[2][QC], sHi[2][QC];
    const uint32_t sK = df_smem(smem), sV = sK + BNK * ROWB, sQ0 = sV + BNK * ROWB;
    const uint32_t sDO0 = sQ0 + 2 * QC * ROWB;
    const int g_kv = (int)(blockIdx.x % (unsigned)p.nkv);
    const int kt = p.sched[blockIdx.x / (unsigned)p.nkv];
    const int tid = threadIdx.x, warp = tid >> 5, lane = tid & 31;
    const int g = lane >> 2, t4 = lane & 3;
    const int64_t c0 = (int64_t)kt * BNK, c1 = min(p.T_ctx, c0 + BNK);
    const int bfirst = p.sched[p.n_kt + kt], bend = p.sched[2 * p.n_kt + kt];
    const int64_t rbeg = (int64_t)bfirst * p.rb, rend = (int64_t)bend * p.rb;
    const int nch = (int)((rend - rbeg + QC - 1) / QC);

    /* K, V of the tile (rows past the end zero-filled) */
    {
        const bf16 *kg = (const bf16 *)p.kc + (int64_t)g_kv * D, *vg = (const bf16 *)p.vc + (int64_t)g_kv * D;
        for (int c = tid; c < BNK * CH; c += THREADS) {
            int r = c / CH, ch = c % CH;
            bool ok = c0 + r < c1;
            int64_t off = ok ? (c0 + r) * p.ldk + ch * 8 : 0;
            df_cp16(sK + r * ROWB + ch * 16, kg + off, ok);
            df_cp16(sV + r * ROWB + ch * 16, vg + off, ok);
        }
        df_commit();
    }

    /* Find the first chunk >= ci with a row whose block sees the tile; fill the stage's row
     * tables (thread t < QC: row t of the chunk). Returns the chunk (nch: none); *full: no row of
     * the chunk needs the per-key mask. Uniform: every thread calls it and gets the same. */
    auto prep = [&](int ci, int st, bool *full) -> int {
        for (; ci < nch; ci++) {
            bool sees = false, fullt = true;
            long long off = -1;
            float l2 = INFINITY, dl = 0.0f;
            int lo = 0, hi = 0;
            if (tid < QC) {
                const int64_t r = rbeg + (int64_t)ci * QC + tid;
                if (r < rend) {
                    const int b = (int)(r / p.rb), rem = (int)(r - (int64_t)b * p.rb);
                    const int hl = rem / p.bs, j = rem - hl * p.bs;
                    const int csb = p.cs[b], anb = p.an[b];
                    lo = csb;
                    hi = csb + anb;
                    sees = anb > 0 && hi > c0 && lo < c1;
                    if (sees) {
                        const int64_t grow = (int64_t)b * p.bs + j;
                        const int head = g_kv * p.group + hl;
                        const int64_t idx = grow * p.nh + head;
                        off = grow * p.ldq + (int64_t)head * D;
                        l2 = p.lse[idx] * DF_LOG2E;
                        dl = p.delta[idx];
                        fullt = lo <= c0 && hi >= c1;
                    }
                }
            }
            if (__syncthreads_or(sees)) {
                if (tid < QC) {
                    sOff[st][tid] = off;
                    sL2[st][tid] = l2;
                    sDl[st][tid] = dl;
                    sLo[st][tid] = lo;
                    sHi[st][tid] = hi;
                }
                *full = __syncthreads_and(fullt);
                return ci;
            }
        }
        return nch;
    };
    auto load_chunk = [&](int st) {
        const bf16 *qg = (const bf16 *)p.q, *dg = (const bf16 *)p.dout;
        const uint32_t dq_ = sQ0 + st * QC * ROWB, dd_ = sDO0 + st * QC * ROWB;
        for (int c = tid; c < QC * CH; c += THREADS) {
            int r = c / CH, ch = c % CH;
            long long off = sOff[st][r];
            bool ok = off >= 0;
            df_cp16(dq_ + r * ROWB + ch * 16, ok ? qg + off + ch * 8 : qg, ok);
            df_cp16(dd_ + r * ROWB + ch * 16, ok ? dg + off + ch * 8 : dg, ok);
        }
    };

    float dk[DT][4], dv[DT][4];
#pragma unroll
    for (int dt = 0; dt < DT; dt++)
#pragma unroll
        for (int e = 0; e < 4; e++)
            dk[dt][e] = dv[dt][e] = 0.0f;

    const uint32_t k_lane = sK + warp * 16 * ROWB + lane_a(lane, ROWB);
    const uint32_t v_lane = sV + warp * 16 * ROWB + lane_a(lane, ROWB);
    const uint32_t b_lane = lane_b(lane, ROWB), bt_lane = lane_bt(lane, ROWB);
    const float sl2 = p.sl2;
    const int64_t key_r0 = c0 + warp * 16 + g;   /* this thread's key rows: key_r0, key_r0 + 8 */

    bool full_cur = false, full_next = false;
    int cur = prep(0, 0, &full_cur);
    if (cur < nch)
        load_chunk(0);
    df_commit();
    int stage = 0;
    while (cur < nch) {
        int nxt = prep(cur + 1, stage ^ 1, &full_next);
        if (nxt < nch) {
            load_chunk(stage ^ 1);
            df_commit();
            df_wait<1>();
        } else {
            df_wait<0>();
        }
        __syncthreads();
        const uint32_t qst = sQ0 + stage * QC * ROWB, dost = sDO0 + stage * QC * ROWB;
#pragma unroll
        for (int sc = 0; sc < NSC; sc++) {
            float s[4][4], dp[4][4];
#pragma unroll
            for (int nt = 0; nt < 4; nt++)
#pragma unroll
                for (int e = 0; e < 4; e++)
                    s[nt][e] = dp[nt][e] = 0.0f;
#pragma unroll
            for (int kk = 0; kk < KD; kk++) {
                uint32_t a[4], av[4];
                df_ldm(a, k_lane + kk * 32);
                df_ldm(av, v_lane + kk * 32);
#pragma unroll
                for (int np = 0; np < 2; np++) {
                    uint32_t b[4];
                    df_ldm(b, qst + (sc * 32 + np * 16) * ROWB + b_lane + kk * 32);
                    df_mma(s[2 * np], a, b[0], b[1]);
                    df_mma(s[2 * np + 1], a, b[2], b[3]);
                    df_ldm(b, dost + (sc * 32 + np * 16) * ROWB + b_lane + kk * 32);
                    df_mma(dp[2 * np], av, b[0], b[1]);
                    df_mma(dp[2 * np + 1], av, b[2], b[3]);
                }
            }
#pragma unroll
            for (int nt = 0; nt < 4; nt++)
#pragma unroll
                for (int e = 0; e < 4; e++) {
                    const int qi = sc * 32 + nt * 8 + 2 * t4 + (e & 1);
                    const int64_t key = key_r0 + 8 * (e >> 1);
                    const bool ok = full_cur || (key >= sLo[stage][qi] && key < sHi[stage][qi]);
                    const float pv = ok ? df_exp2(fmaf(s[nt][e], sl2, -sL2[stage][qi])) : 0.0f;
                    s[nt][e] = pv;
                    dp[nt][e] = pv * (dp[nt][e] - sDl[stage][qi]);
                }
#pragma unroll
            for (int kb = 0; kb < 2; kb++) {
                uint32_t ap[4], ad[4];
                ap[0] = df_pack(s[2 * kb][0], s[2 * kb][1]);
                ap[1] = df_pack(s[2 * kb][2], s[2 * kb][3]);
                ap[2] = df_pack(s[2 * kb + 1][0], s[2 * kb + 1][1]);
                ap[3] = df_pack(s[2 * kb + 1][2], s[2 * kb + 1][3]);
                ad[0] = df_pack(dp[2 * kb][0], dp[2 * kb][1]);
                ad[1] = df_pack(dp[2 * kb][2], dp[2 * kb][3]);
                ad[2] = df_pack(dp[2 * kb + 1][0], dp[2 * kb + 1][1]);
                ad[3] = df_pack(dp[2 * kb + 1][2], dp[2 * kb + 1][3]);
#pragma unroll
                for (int d2 = 0; d2 < DT / 2; d2++) {
                    uint32_t b[4];
                    df_ldm_t(b, dost + (sc * 32 + kb * 16) * ROWB + bt_lane + d2 * 32);
                    df_mma(dv[2 * d2], ap, b[0], b[1]);
                    df_mma(dv[2 * d2 + 1], ap, b[2], b[3]);
                    df_ldm_t(b, qst + (sc * 32 + kb * 16) * ROWB + bt_lane + d2 * 32);
                    df_mma(dk[2 * d2], ad, b[0], b[1]);
                    df_mma(dk[2 * d2 + 1], ad, b[2], b[3]);
                }
            }
        }
        cur = nxt;
        full_cur = full_next;
        stage ^= 1;
    }
    df_wait<0>();
    __syncthreads();   /* K/V loads done (no chunk case) and every warp past its last read */

    /* dK * scale and dV through the warp's own K / V rows, then 16-byte stores */
#pragma unroll
    for (int hh = 0; hh < 2; hh++) {
        const int r = warp * 16 + g + 8 * hh;
        unsigned char *kp = smem + r * ROWB + 4 * t4, *vp = smem + (BNK + r) * ROWB + 4 * t4;
#pragma unroll
        for (int dt = 0; dt < DT; dt++) {
            *reinterpret_cast<uint32_t *>(kp + dt * 16) = df_pack(dk[dt][2 * hh] * p.scale, dk[dt][2 * hh + 1] * p.scale);
            *reinterpret_cast<uint32_t *>(vp + dt * 16) = df_pack(dv[dt][2 * hh], dv[dt][2 * hh + 1]);
        }
    }
    __syncwarp();
    bf16 *dkg = (bf16 *)p.dkc + (int64_t)g_kv * D, *dvg = (bf16 *)p.dvc + (int64_t)g_kv * D;
    for (int c = lane; c < 16 * CH; c += 32) {
        const int r = warp * 16 + c / CH, ch = c % CH;
        const int64_t row = c0 + r;
        if (row < c1) {
            *reinterpret_cast<uint4 *>(dkg + row * p.ldk + ch * 8) = *reinterpret_cast<const uint4 *>(smem + r * ROWB + ch * 16);
            *reinterpret_cast<uint4 *>(dvg + row * p.ldk + ch * 8) = *reinterpret_cast<const uint4 *>(smem + (BNK + r) * ROWB + ch * 16);
        }
    }
}

/* ------------------------------------------------------------------------------------------ */
/* simple (exact f32) kernels: one warp per (row, head); lane l holds elements l + 32 j */

#define DS_WARPS 4

template <typename T, int MAXV>
__device__ __forceinline__ void ds_load(float (&x)[MAXV], const T *row, int d, int lane)
{
#pragma unroll
    for (int j = 0; j < MAXV; j++) {
        int i = lane + 32 * j;
        x[j] = i < d ? to_f32(row[i]) : 0.0f;
    }
}

template <int MAXV>
__device__ __forceinline__ float ds_dot(const float (&a)[MAXV], const float (&b)[MAXV])
{
    float s = 0.0f;
#pragma unroll
    for (int j = 0; j < MAXV; j++)
        s += a[j] * b[j];
#pragma unroll
    for (int o = 16; o > 0; o >>= 1)
        s += __shfl_xor_sync(0xffffffffu, s, o);
    return s;
}

template <typename T, int MAXV>
__device__ __forceinline__ void ds_store(T *row, const float (&x)[MAXV], float f, int d, int lane)
{
#pragma unroll
    for (int j = 0; j < MAXV; j++) {
        int i = lane + 32 * j;
        if (i < d)
            row[i] = from_f32<T>(x[j] * f);
    }
}

/* key t (0 <= t < anchor + bs) of block b: a context row or a block row */
template <typename T>
__device__ __forceinline__ const T *ds_key(const T *ctx, const T *blk, int64_t ld, int32_t cs,
                                           int32_t an, int64_t brow, int64_t t, int64_t off)
{
    return t < an ? ctx + (cs + t) * ld + off : blk + (brow + t - an) * ld + off;
}

template <typename T, int MAXV>
__global__ void ds_fwd_kernel(const DfP p)
{
    const int64_t gw = (int64_t)blockIdx.x * DS_WARPS + (threadIdx.x >> 5);
    const int lane = threadIdx.x & 31;
    const int64_t Q = (int64_t)p.n_blocks * p.bs;
    if (gw >= Q * p.nh)
        return;
    const int64_t qr = gw / p.nh;
    const int h = (int)(gw % p.nh), d = p.d;
    const int64_t b = qr / p.bs, brow = b * p.bs, koff = (int64_t)(h / p.group) * d;
    const int32_t cs = p.cs[b], an = p.an[b];
    const T *kc = (const T *)p.kc, *vc = (const T *)p.vc, *kb = (const T *)p.kb, *vb = (const T *)p.vb;
    float qv[MAXV], acc[MAXV], kv[MAXV];
    ds_load<T, MAXV>(qv, (const T *)p.q + qr * p.ldq + (int64_t)h * d, d, lane);
#pragma unroll
    for (int j = 0; j < MAXV; j++)
        acc[j] = 0.0f;
    float m = -INFINITY, l = 0.0f;
    const int64_t nkeys = (int64_t)an + p.bs;
    for (int64_t t = 0; t < nkeys; t++) {
        ds_load<T, MAXV>(kv, ds_key(kc, kb, p.ldk, cs, an, brow, t, koff), d, lane);
        float sc = ds_dot<MAXV>(qv, kv) * p.scale;
        float mn = fmaxf(m, sc);
        float corr = expf(m - mn), pw = expf(sc - mn);
        l = l * corr + pw;
        ds_load<T, MAXV>(kv, ds_key(vc, vb, p.ldk, cs, an, brow, t, koff), d, lane);
#pragma unroll
        for (int j = 0; j < MAXV; j++)
            acc[j] = acc[j] * corr + pw * kv[j];
        m = mn;
    }
    ds_store<T, MAXV>((T *)p.o + qr * p.ldq + (int64_t)h * d, acc, 1.0f / l, d, lane);
    if (lane == 0)
        p.lse[qr * p.nh + h] = m + logf(l);
}

/* delta and dq of one (query row, head) */
template <typename T, int MAXV>
__global__ void ds_bwd_q_kernel(const DfP p)
{
    const int64_t gw = (int64_t)blockIdx.x * DS_WARPS + (threadIdx.x >> 5);
    const int lane = threadIdx.x & 31;
    const int64_t Q = (int64_t)p.n_blocks * p.bs;
    if (gw >= Q * p.nh)
        return;
    const int64_t qr = gw / p.nh;
    const int h = (int)(gw % p.nh), d = p.d;
    const int64_t b = qr / p.bs, brow = b * p.bs, koff = (int64_t)(h / p.group) * d;
    const int32_t cs = p.cs[b], an = p.an[b];
    const T *kc = (const T *)p.kc, *vc = (const T *)p.vc, *kb = (const T *)p.kb, *vb = (const T *)p.vb;
    const int64_t qo = qr * p.ldq + (int64_t)h * d;
    float qv[MAXV], dov[MAXV], acc[MAXV], kv[MAXV], vv[MAXV];
    ds_load<T, MAXV>(qv, (const T *)p.q + qo, d, lane);
    ds_load<T, MAXV>(dov, (const T *)p.dout + qo, d, lane);
    ds_load<T, MAXV>(kv, (const T *)p.o_in + qo, d, lane);
    const float D = ds_dot<MAXV>(dov, kv);
    const float L = p.lse[qr * p.nh + h];
    if (lane == 0)
        p.delta[qr * p.nh + h] = D;
#pragma unroll
    for (int j = 0; j < MAXV; j++)
        acc[j] = 0.0f;
    const int64_t nkeys = (int64_t)an + p.bs;
    for (int64_t t = 0; t < nkeys; t++) {
        ds_load<T, MAXV>(kv, ds_key(kc, kb, p.ldk, cs, an, brow, t, koff), d, lane);
        ds_load<T, MAXV>(vv, ds_key(vc, vb, p.ldk, cs, an, brow, t, koff), d, lane);
        float pp = expf(ds_dot<MAXV>(qv, kv) * p.scale - L);
        float ds = pp * (ds_dot<MAXV>(dov, vv) - D);
#pragma unroll
        for (int j = 0; j < MAXV; j++)
            acc[j] += ds * kv[j];
    }
    ds_store<T, MAXV>((T *)p.dq + qo, acc, p.scale, d, lane);
}

/* dk, dv of key row `key` (k, v pointers, head column included) over the query rows of block b
 * (all heads of kv head g) */
template <typename T, int MAXV>
__device__ __forceinline__ void ds_kv_block(const DfP &p, int64_t b, int g, const float (&kv)[MAXV],
                                            const float (&vv)[MAXV], float (&dk)[MAXV],
                                            float (&dv)[MAXV], int lane)
{
    const int d = p.d;
    float qv[MAXV], dov[MAXV];
    for (int h = g * p.group; h < (g + 1) * p.group; h++)
        for (int j = 0; j < p.bs; j++) {
            const int64_t qr = b * p.bs + j, qo = qr * p.ldq + (int64_t)h * d;
            ds_load<T, MAXV>(qv, (const T *)p.q + qo, d, lane);
            ds_load<T, MAXV>(dov, (const T *)p.dout + qo, d, lane);
            float pp = expf(ds_dot<MAXV>(qv, kv) * p.scale - p.lse[qr * p.nh + h]);
            float ds = pp * (ds_dot<MAXV>(dov, vv) - p.delta[qr * p.nh + h]);
#pragma unroll
            for (int i = 0; i < MAXV; i++) {
                dk[i] += ds * p.scale * qv[i];
                dv[i] += pp * dov[i];
            }
        }
}

/* dk_blk, dv_blk of one (block key row, kv head) */
template <typename T, int MAXV>
__global__ void ds_bwd_kvblk_kernel(const DfP p)
{
    const int64_t gw = (int64_t)blockIdx.x * DS_WARPS + (threadIdx.x >> 5);
    const int lane = threadIdx.x & 31;
    const int64_t Q = (int64_t)p.n_blocks * p.bs;
    if (gw >= Q * p.nkv)
        return;
    const int64_t kr = gw / p.nkv;
    const int g = (int)(gw % p.nkv), d = p.d;
    const int64_t ko = kr * p.ldk + (int64_t)g * d;
    float kv[MAXV], vv[MAXV], dk[MAXV], dv[MAXV];
    ds_load<T, MAXV>(kv, (const T *)p.kb + ko, d, lane);
    ds_load<T, MAXV>(vv, (const T *)p.vb + ko, d, lane);
#pragma unroll
    for (int i = 0; i < MAXV; i++)
        dk[i] = dv[i] = 0.0f;
    ds_kv_block<T, MAXV>(p, kr / p.bs, g, kv, vv, dk, dv, lane);
    ds_store<T, MAXV>((T *)p.dkb + ko, dk, 1.0f, d, lane);
    ds_store<T, MAXV>((T *)p.dvb + ko, dv, 1.0f, d, lane);
}

/* dk_ctx, dv_ctx of one (context row, kv head): the blocks of the row's sequence that see it */
template <typename T, int MAXV>
__global__ void ds_bwd_kvctx_kernel(const DfP p)
{
    const int64_t gw = (int64_t)blockIdx.x * DS_WARPS + (threadIdx.x >> 5);
    const int lane = threadIdx.x & 31;
    if (gw >= p.T_ctx * p.nkv)
        return;
    const int64_t c = gw / p.nkv;
    const int g = (int)(gw % p.nkv), d = p.d;
    const int64_t ko = c * p.ldk + (int64_t)g * d;
    float kv[MAXV], vv[MAXV], dk[MAXV], dv[MAXV];
#pragma unroll
    for (int i = 0; i < MAXV; i++)
        dk[i] = dv[i] = 0.0f;
    const int last = df_upper(p.cs, p.n_blocks, c);   /* blocks [.., last) start at or before c */
    if (last > 0) {
        const int32_t s0 = p.cs[last - 1];
        const int first = df_lower(p.cs, p.n_blocks, s0);
        ds_load<T, MAXV>(kv, (const T *)p.kc + ko, d, lane);
        ds_load<T, MAXV>(vv, (const T *)p.vc + ko, d, lane);
        for (int b = first; b < last; b++)
            if (c < (int64_t)s0 + p.an[b])
                ds_kv_block<T, MAXV>(p, b, g, kv, vv, dk, dv, lane);
    }
    ds_store<T, MAXV>((T *)p.dkc + ko, dk, 1.0f, d, lane);
    ds_store<T, MAXV>((T *)p.dvc + ko, dv, 1.0f, d, lane);
}

template <typename T>
static void ds_launch(int which, const DfP &p, cudaStream_t s)
{
    int64_t items = which == 2 ? (int64_t)p.n_blocks * p.bs * p.nkv
                  : which == 3 ? p.T_ctx * p.nkv : (int64_t)p.n_blocks * p.bs * p.nh;
    unsigned blocks = (unsigned)((items + DS_WARPS - 1) / DS_WARPS);
    if (blocks == 0)
        return;
#define DS_GO(MV)                                                                              \
    do {                                                                                       \
        switch (which) {                                                                       \
        case 0: ds_fwd_kernel<T, MV><<<blocks, DS_WARPS * 32, 0, s>>>(p); break;               \
        case 1: ds_bwd_q_kernel<T, MV><<<blocks, DS_WARPS * 32, 0, s>>>(p); break;             \
        case 2: ds_bwd_kvblk_kernel<T, MV><<<blocks, DS_WARPS * 32, 0, s>>>(p); break;         \
        default: ds_bwd_kvctx_kernel<T, MV><<<blocks, DS_WARPS * 32, 0, s>>>(p); break;        \
        }                                                                                      \
    } while (0)
    if (p.d <= 32)
        DS_GO(1);
    else if (p.d <= 64)
        DS_GO(2);
    else if (p.d <= 128)
        DS_GO(4);
    else if (p.d <= 256)
        DS_GO(8);
    else
        DS_GO(16);
#undef DS_GO
}

/* ------------------------------------------------------------------------------------------ */
/* variants */

typedef void (*df_kernel_fn)(const DfP);

struct DfVariant {
    const char *name;
    df_kernel_fn fn;
    int mmax;          /* query rows per CTA (fwd, bwd Q) or keys per CTA (bwd KV) */
    int threads;
    size_t smem;
    int bn;            /* key tile (fwd, bwd Q) */
};

#define FWD_V(NAME, D, MT, NW, BN, QREG)                                                        \
    { NAME, df_fwd_kernel<D, MT, NW, BN, QREG>, FwdCfg<D, MT, NW, BN, QREG>::MMAX,               \
      FwdCfg<D, MT, NW, BN, QREG>::THREADS, FwdCfg<D, MT, NW, BN, QREG>::SMEM, BN }
#define BWDQ_V(NAME, D, NW, BN)                                                                \
    { NAME, df_bwd_q_kernel<D, NW, BN>, BwdQCfg<D, NW, BN>::MMAX, BwdQCfg<D, NW, BN>::THREADS,    \
      BwdQCfg<D, NW, BN>::SMEM, BN }
#define BWDKV_V(NAME, D, NW, QC)                                                               \
    { NAME, df_bwd_kv_kernel<D, NW, QC>, BwdKVCfg<D, NW, QC>::BNK, BwdKVCfg<D, NW, QC>::THREADS,  \
      BwdKVCfg<D, NW, QC>::SMEM, 0 }

static const DfVariant fwd32[] = {
    FWD_V("fwd d32 128 rows (4 warps x 32) BN64 Q regs", 32, 2, 4, 64, true),
    FWD_V("fwd d32 64 rows (4 warps x 16) BN64 Q regs", 32, 1, 4, 64, true),
};
static const DfVariant fwd64[] = {
    FWD_V("fwd d64 128 rows (4 warps x 32) BN64 Q regs", 64, 2, 4, 64, true),
    FWD_V("fwd d64 128 rows (8 warps x 16) BN64 Q regs", 64, 1, 8, 64, true),
};
static const DfVariant fwd128[] = {
    FWD_V("fwd d128 128 rows (4 warps x 32) BN32 Q smem", 128, 2, 4, 32, false),
    FWD_V("fwd d128 128 rows (8 warps x 16) BN64 Q regs", 128, 1, 8, 64, true),
    FWD_V("fwd d128 64 rows (4 warps x 16) BN64 Q regs", 128, 1, 4, 64, true),
};
static const DfVariant bq32[] = {
    BWDQ_V("bwd-q d32 128 rows (8 warps) BN64", 32, 8, 64),
    BWDQ_V("bwd-q d32 64 rows (4 warps) BN64", 32, 4, 64),
};
static const DfVariant bq64[] = {
    BWDQ_V("bwd-q d64 128 rows (8 warps) BN32", 64, 8, 32),
    BWDQ_V("bwd-q d64 64 rows (4 warps) BN32", 64, 4, 32),
};
static const DfVariant bq128[] = {
    BWDQ_V("bwd-q d128 128 rows (8 warps) BN32", 128, 8, 32),
    BWDQ_V("bwd-q d128 64 rows (4 warps) BN32", 128, 4, 32),
};
static const DfVariant bkv32[] = {
    BWDKV_V("bwd-kv d32 64 keys (4 warps) QC64", 32, 4, 64),
    BWDKV_V("bwd-kv d32 128 keys (8 warps) QC64", 32, 8, 64),
};
static const DfVariant bkv64[] = {
    BWDKV_V("bwd-kv d64 64 keys (4 warps) QC64", 64, 4, 64),
    BWDKV_V("bwd-kv d64 128 keys (8 warps) QC64", 64, 8, 64),
};
static const DfVariant bkv128[] = {
    BWDKV_V("bwd-kv d128 64 keys (4 warps) QC64", 128, 4, 64),
    BWDKV_V("bwd-kv d128 128 keys (8 warps) QC64", 128, 8, 64),
    BWDKV_V("bwd-kv d128 64 keys (4 warps) QC32", 128, 4, 32),
};

#define NV(a) ((int)(sizeof a / sizeof a[0]))

static const DfVariant *df_table(int k, int d, int *n)
{
    *n = 0;
    switch (k * 1000 + d) {
    case 32: *n = NV(fwd32); return fwd32;
    case 64: *n = NV(fwd64); return fwd64;
    case 128: *n = NV(fwd128); return fwd128;
    case 1032: *n = NV(bq32); return bq32;
    case 1064: *n = NV(bq64); return bq64;
    case 1128: *n = NV(bq128); return bq128;
    case 2032: *n = NV(bkv32); return bkv32;
    case 2064: *n = NV(bkv64); return bkv64;
    case 2128: *n = NV(bkv128); return bkv128;
    default: return NULL;
    }
}

static int df_dim_index(int d) { return d == 32 ? 0 : d == 64 ? 1 : d == 128 ? 2 : -1; }

static int df_choice[3][3];      /* [kernel][dim index] */
static int df_force_simple;
static bool df_attr_done[64];    /* per device: shared-memory limits raised */

extern "C" const char *dfl_cuda_dflash_variant_name(int k, int d, int v)
{
    int n;
    const DfVariant *t = df_table(k, d, &n);
    return t && v >= 0 && v < n ? t[v].name : NULL;
}

extern "C" int dfl_cuda_dflash_set_variant(int k, int d, int v)
{
    int n;
    const DfVariant *t = df_table(k, d, &n);
    if (!t || v < 0 || v >= n)
        return -1;
    df_choice[k][df_dim_index(d)] = v;
    return 0;
}

extern "C" void dfl_cuda_dflash_force_simple(int on) { df_force_simple = on; }

/* Raise the dynamic shared-memory limit of every tiled kernel (once per device). */
static int df_init(dfl_be *be, const char *op)
{
    cuda_impl *im = cuda_of(be);
    if (im->device >= 0 && im->device < 64 && df_attr_done[im->device])
        return 0;
    static const int dims[] = {32, 64, 128};
    for (int k = 0; k < 3; k++)
        for (int di = 0; di < 3; di++) {
            int n;
            const DfVariant *t = df_table(k, dims[di], &n);
            for (int v = 0; v < n; v++) {
                if (t[v].smem > im->smem_optin)
                    continue;
                cudaError_t err = cudaFuncSetAttribute(t[v].fn, cudaFuncAttributeMaxDynamicSharedMemorySize,
                                                       (int)t[v].smem);
                if (err == cudaSuccess)
                    err = cudaFuncSetAttribute(t[v].fn, cudaFuncAttributePreferredSharedMemoryCarveout,
                                               (int)cudaSharedmemCarveoutMaxShared);
                if (err != cudaSuccess) {
                    cudaGetLastError();
                    return cuda_op_fail(be, DFL_EDEVICE, "%s: kernel setup (%s): %s", op, t[v].name,
                                        cudaGetErrorString(err));
                }
            }
        }
    if (im->device >= 0 && im->device < 64)
        df_attr_done[im->device] = true;
    return 0;
}

/* ------------------------------------------------------------------------------------------ */
/* entry points */

static int df_check(dfl_be *be, const dfl_dflash_attn *a, const char *op)
{
    if (a->n_heads <= 0 || a->n_kv <= 0 || a->n_heads % a->n_kv)
        return cuda_op_fail(be, DFL_EUNSUP, "%s: %d query heads are not a multiple of %d kv heads",
                            op, a->n_heads, a->n_kv);
    if (a->d <= 0 || a->d > 512)
        return cuda_op_fail(be, DFL_EUNSUP, "%s: head dimension %d (at most 512)", op, a->d);
    if (a->bs <= 0 || a->n_blocks < 0 || a->T_ctx < 0)
        return cuda_op_fail(be, DFL_EUSAGE, "%s: %d blocks of %d, %lld context rows", op,
                            a->n_blocks, a->bs, (long long)a->T_ctx);
    if ((int64_t)a->n_blocks * a->bs * a->n_heads > INT32_MAX || a->T_ctx > INT32_MAX / 2)
        return cuda_op_fail(be, DFL_EUNSUP, "%s: %d blocks of %d x %d heads is too many", op,
                            a->n_blocks, a->bs, a->n_heads);
    return 0;
}

static DfP df_params(const dfl_dflash_attn *a)
{
    DfP p;
    memset(&p, 0, sizeof p);
    p.q = a->q;
    p.kc = a->k_ctx;
    p.vc = a->v_ctx;
    p.kb = a->k_blk;
    p.vb = a->v_blk;
    p.o = a->o;
    p.o_in = a->o;
    p.dout = a->dout;
    p.dq = a->dq;
    p.dkc = a->dk_ctx;
    p.dvc = a->dv_ctx;
    p.dkb = a->dk_blk;
    p.dvb = a->dv_blk;
    p.lse = a->lse;
    p.delta = a->delta;
    p.cs = a->ctx_start;
    p.an = a->anchor;
    p.n_blocks = a->n_blocks;
    p.bs = a->bs;
    p.nh = a->n_heads;
    p.nkv = a->n_kv;
    p.group = a->n_heads / a->n_kv;
    p.d = a->d;
    p.rb = p.group * p.bs;
    p.T_ctx = a->T_ctx;
    p.ldq = (int64_t)a->n_heads * a->d;
    p.ldk = (int64_t)a->n_kv * a->d;
    p.scale = a->scale;
    p.sl2 = a->scale * DF_LOG2E;
    return p;
}

/* The tiled variant for kernel k, or NULL when the shape or the buffers do not fit it. */
static const DfVariant *df_pick(dfl_be *be, const dfl_dflash_attn *a, int k, bool bwd)
{
    if (be->act != DFL_BF16 || df_force_simple)
        return NULL;
    int di = df_dim_index(a->d), n;
    if (di < 0)
        return NULL;
    const DfVariant *t = df_table(k, a->d, &n);
    const DfVariant *v = &t[df_choice[k][di]];
    if (v->smem > cuda_of(be)->smem_optin)
        return NULL;
    const int rb = (a->n_heads / a->n_kv) * a->bs;
    if (k != DFL_DFLASH_BWD_KV && rb > v->mmax)
        return NULL;
    const void *ptrs[] = {a->q, a->k_ctx, a->v_ctx, a->k_blk, a->v_blk, a->o,
                          bwd ? a->dout : NULL, bwd ? a->dq : NULL, bwd ? a->dk_ctx : NULL,
                          bwd ? a->dv_ctx : NULL, bwd ? a->dk_blk : NULL, bwd ? a->dv_blk : NULL};
    for (size_t i = 0; i < sizeof ptrs / sizeof ptrs[0]; i++)
        if (ptrs[i] && !is_aligned(ptrs[i], 16))
            return NULL;
    return v;
}

static void df_blocks_per_cta(DfP &p, int mmax)
{
    p.nb = mmax / p.rb;
    if (p.nb > DF_NBMAX)
        p.nb = DF_NBMAX;
    if (p.nb < 1)
        p.nb = 1;
    p.n_bg = (p.n_blocks + p.nb - 1) / p.nb;
}

int cuda_dflash_attn(dfl_be *be, const dfl_dflash_attn *a)
{
    int rc = df_check(be, a, "dflash_attn");
    if (rc || a->n_blocks == 0)
        return rc;
    if ((rc = cuda_enter(be)) || (rc = df_init(be, "dflash_attn")))
        return rc;
    DfP p = df_params(a);
    cudaStream_t s = cuda_of(be)->stream;
    const DfVariant *v = df_pick(be, a, DFL_DFLASH_FWD, false);
    if (v) {
        df_blocks_per_cta(p, v->mmax);
        v->fn<<<(unsigned)((int64_t)p.n_bg * p.nkv), v->threads, v->smem, s>>>(p);
        return cuda_launch_check(be, "dflash_attn");
    }
    if (be->act == DFL_BF16)
        ds_launch<bf16>(0, p, s);
    else
        ds_launch<float>(0, p, s);
    return cuda_launch_check(be, "dflash_attn (simple)");
}

int cuda_dflash_attn_bwd(dfl_be *be, const dfl_dflash_attn *a)
{
    int rc = df_check(be, a, "dflash_attn_bwd");
    if (rc)
        return rc;
    if ((rc = cuda_enter(be)) || (rc = df_init(be, "dflash_attn_bwd")))
        return rc;
    DfP p = df_params(a);
    cudaStream_t s = cuda_of(be)->stream;
    const DfVariant *vq = a->n_blocks > 0 ? df_pick(be, a, DFL_DFLASH_BWD_Q, true) : NULL;
    const DfVariant *vkv = df_pick(be, a, DFL_DFLASH_BWD_KV, true);
    const size_t es = dfl_dtype_size(be->act);
    if (a->n_blocks == 0) {
        /* nothing attends: the context gradients are 0 */
        size_t bytes = (size_t)(a->T_ctx * p.ldk) * es;
        if (bytes && (cudaMemsetAsync(a->dk_ctx, 0, bytes, s) != cudaSuccess ||
                      cudaMemsetAsync(a->dv_ctx, 0, bytes, s) != cudaSuccess))
            return cuda_op_fail(be, DFL_EDEVICE, "dflash_attn_bwd: memset failed");
        return 0;
    }
    /* pass Q: delta, dq, dk_blk, dv_blk */
    if (vq) {
        df_blocks_per_cta(p, vq->mmax);
        vq->fn<<<(unsigned)((int64_t)p.n_bg * p.nkv), vq->threads, vq->smem, s>>>(p);
        if ((rc = cuda_launch_check(be, "dflash_attn_bwd (q)")))
            return rc;
    } else {
        if (be->act == DFL_BF16) {
            ds_launch<bf16>(1, p, s);
            ds_launch<bf16>(2, p, s);
        } else {
            ds_launch<float>(1, p, s);
            ds_launch<float>(2, p, s);
        }
        if ((rc = cuda_launch_check(be, "dflash_attn_bwd (simple q)")))
            return rc;
    }
    if (a->T_ctx == 0)
        return 0;
    /* pass KV: dk_ctx, dv_ctx */
    if (vkv) {
        const int bnk = vkv->mmax;
        p.n_kt = (int)((a->T_ctx + bnk - 1) / bnk);
        int *sched = (int *)cuda_of(be)->ws;
        if ((size_t)p.n_kt * 3 * sizeof(int) > cuda_of(be)->ws_bytes)
            vkv = NULL;
        else {
            p.sched = sched;
            df_sched_kernel<<<1, 1024, 0, s>>>(p, sched, bnk);
            if ((rc = cuda_launch_check(be, "dflash_attn_bwd (schedule)")))
                return rc;
            vkv->fn<<<(unsigned)((int64_t)p.n_kt * p.nkv), vkv->threads, vkv->smem, s>>>(p);
            return cuda_launch_check(be, "dflash_attn_bwd (kv)");
        }
    }
    if (be->act == DFL_BF16)
        ds_launch<bf16>(3, p, s);
    else
        ds_launch<float>(3, p, s);
    return cuda_launch_check(be, "dflash_attn_bwd (simple kv)");
}
