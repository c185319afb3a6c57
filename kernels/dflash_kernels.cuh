/* dflash_kernels.cuh: the DFlash attention kernels (see kernels/dflash_attn.cu for the design):
 * the tiled bf16 forward, backward pass Q and backward pass KV, the scheduler of pass KV, and the
 * exact f32 kernels. Device code only. Needs, from the including file: bf16, to_f32/from_f32
 * (be_cuda.cuh) and the PTX helpers (dflash_ptx.cuh); tests/emu compiles the same code for the
 * CPU with its own versions of those. */
#ifndef DFL_DFLASH_KERNELS_CUH
#define DFL_DFLASH_KERNELS_CUH

#define DF_LOG2E 1.4426950408889634f
#define DF_NBMAX 32            /* blocks per CTA at most */
#define DF_SCHED_MAX 8192      /* key tiles the scheduler sorts (more: natural order) */

#include "flash_tile.cuh"
#include "warp_sum.cuh"

struct DfP {
    const void *q, *kc, *vc, *kb, *vb, *o_in, *dout;
    void *o, *dq, *dkc, *dvc, *dkb, *dvb;
    float *lse, *delta;
    const int32_t *cs, *an;
    int n_blocks, bs, nh, nkv, group, d, rb, nb, n_bg;
    int window;         /* 0: full attention; W > 0: sliding (backend.h dfl_dflash_attn) */
    int64_t T_ctx, ldq, ldk;
    float scale, sl2;
    const int *sched;   /* pass KV: order [n_kt], first block [n_kt], end block [n_kt] */
    int n_kt;
    /* The backward with the score gradients kept (dflash_attn.cu, "dS kept"): pass KV writes each
     * (block, context key tile of DF_DS_KEYS, kv head) tile of dS^T into ds, pass Q reads it back
     * instead of recomputing S and dP; ds_blk[b] = {first slot - first tile, first tile, end
     * tile} of block b (df_ds_plan_kernel), ds_cap the slots ds holds (a slot: one tile of every
     * kv head) */
    void *ds;
    const int4 *ds_blk;
    int64_t ds_cap;
};

/* dS kept: context keys of a tile (pass KV's DW_BNK) and query rows of a block (group x bs) */
#define DF_DS_KEYS 128
#define DF_DS_ROWS 64

/* The first context position that slot j of a block anchored at an sees (an: none). */
__host__ __device__ __forceinline__ int df_ctx_lo(int window, int an, int j)
{
    const int w = an + j - (window - 1), l = w > 0 ? w : 0;   /* min(an, max(0, w)) */
    return window > 0 ? (l < an ? l : an) : 0;
}

/* dS kept: the context key tiles (DF_DS_KEYS keys, counted over the whole context) that block
 * (ctx_start cs, anchor an) sees some key of: [*tlo, return value); none where an is 0. The host
 * sizes ds with it (dflash_attn.cu), df_ds_plan_kernel lays the slots out with it. */
__host__ __device__ __forceinline__ int df_ds_tiles(int window, int cs, int an, int *tlo)
{
    if (an <= 0) {
        *tlo = 0;
        return 0;
    }
    *tlo = (cs + df_ctx_lo(window, an, 0)) / DF_DS_KEYS;
    return (cs + an + DF_DS_KEYS - 1) / DF_DS_KEYS;
}

/* Per-lane ldmatrix offsets (bytes) within a tile of rows of RB bytes (padded rows, no swizzle):
 *  A  (16 rows x 16 cols, row-major source):            row lane & 15, chunk lane >> 4
 *  B  (16 n-rows x 16 k, the n rows of two n8 tiles):   row (lane & 7) + 8 (lane >> 4), chunk (lane >> 3) & 1
 *  BT (16 k-rows x 16 n cols, transposed load):         row (lane & 7) + 8 ((lane >> 3) & 1), chunk lane >> 4
 *  AT (A from a [k][m] source, transposed load):        as B (with .trans) */
__device__ __forceinline__ uint32_t lane_a(int lane, int rowb) { return (uint32_t)((lane & 15) * rowb + (lane >> 4) * 16); }
__device__ __forceinline__ uint32_t lane_b(int lane, int rowb) { return (uint32_t)(((lane & 7) + ((lane >> 4) << 3)) * rowb + ((lane >> 3) & 1) * 16); }
__device__ __forceinline__ uint32_t lane_bt(int lane, int rowb) { return (uint32_t)(((lane & 7) + (((lane >> 3) & 1) << 3)) * rowb + (lane >> 4) * 16); }

/* A fragments of two m16 tiles (rows 16 apart) of each of two row-major sources, at byte column
 * col (sa, sb: this lane's lane_a address of the first tile) */
__device__ __forceinline__ void ldm_a2(uint32_t (&a)[2][4], uint32_t (&b)[2][4], uint32_t sa, uint32_t sb, int rowb,
                                       uint32_t col)
{
#pragma unroll
    for (int mi = 0; mi < 2; mi++) {
        df_ldm(a[mi], sa + mi * 16 * rowb + col);
        df_ldm(b[mi], sb + mi * 16 * rowb + col);
    }
}

/* ------------------------------------------------------------------------------------------ */
/* query-stationary CTAs (forward, backward pass Q): metadata in shared memory */

template <int MMAX> struct QsMeta {
    int blk_an[DF_NBMAX], blk_seg[DF_NBMAX];
    int seg_cs[DF_NBMAX], seg_amax[DF_NBMAX], seg_amin[DF_NBMAX], seg_nt[DF_NBMAX];
    /* sliding window: the segment's first key tile (tiles below it are outside every row's
     * window) and the largest first context position of its rows (keys below it need the mask) */
    int seg_t0[DF_NBMAX], seg_lomax[DF_NBMAX];
    int nseg, nb, ntiles;
    long long row_off[MMAX];   /* element offset of row m in [Q, n_heads*d] arrays; -1: no row */
    int row_idx[MMAX];         /* index of row m in [Q, n_heads] arrays */
};

/* The CTA's kv head and first block (grid n_bg * nkv; the heaviest group, the last, first) */
__device__ __forceinline__ int qs_kv(const DfP &p) { return (int)(blockIdx.x % (unsigned)p.nkv); }
__device__ __forceinline__ int qs_b0(const DfP &p) { return (p.n_bg - 1 - (int)(blockIdx.x / (unsigned)p.nkv)) * p.nb; }

/* b0: the CTA's first block; g: its kv head. Ends with a barrier. */
template <int MMAX>
__device__ void qs_setup(QsMeta<MMAX> &mt, const DfP &p, int b0, int g, int BN)
{
    const int nb = min(p.nb, p.n_blocks - b0);
    if (threadIdx.x == 0) {
        int ns = 0, nt = 0;
        int seg_lomin[DF_NBMAX];
        for (int i = 0; i < nb; i++) {
            int c = p.cs[b0 + i], a = p.an[b0 + i];
            int lo0 = df_ctx_lo(p.window, a, 0), lo1 = df_ctx_lo(p.window, a, p.bs - 1);
            mt.blk_an[i] = a;
            if (ns == 0 || c != mt.seg_cs[ns - 1]) {
                mt.seg_cs[ns] = c;
                mt.seg_amax[ns] = a;
                mt.seg_amin[ns] = a;
                seg_lomin[ns] = lo0;
                mt.seg_lomax[ns] = lo1;
                ns++;
            } else {
                mt.seg_amax[ns - 1] = max(mt.seg_amax[ns - 1], a);
                mt.seg_amin[ns - 1] = min(mt.seg_amin[ns - 1], a);
                seg_lomin[ns - 1] = min(seg_lomin[ns - 1], lo0);
                mt.seg_lomax[ns - 1] = max(mt.seg_lomax[ns - 1], lo1);
            }
            mt.blk_seg[i] = ns - 1;
        }
        for (int s = 0; s < ns; s++) {
            mt.seg_t0[s] = seg_lomin[s] / BN;
            mt.seg_nt[s] = max(0, (mt.seg_amax[s] + BN - 1) / BN - mt.seg_t0[s]);
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

/* The segment of the CTA's tile it (mt.nseg: the block keys) and its index within it, in place */
template <int MMAX> __device__ __forceinline__ int tile_seg(const QsMeta<MMAX> &mt, int &it)
{
    int s = 0;
    while (s < mt.nseg && it >= mt.seg_nt[s]) {
        it -= mt.seg_nt[s];
        s++;
    }
    return s;
}

template <int MMAX>
__device__ __forceinline__ DfTile tile_at(const QsMeta<MMAX> &mt, const DfP &p, int it, int b0, int g, int BN)
{
    const int s = tile_seg<MMAX>(mt, it);
    DfTile t;
    t.key0 = (s < mt.nseg ? mt.seg_t0[s] + it : it) * BN;
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

/* Whether key tile t (BN keys) needs the per-key mask: the block keys, several segments, keys past
 * the smallest anchor of its segment or before the largest window start */
template <int MMAX>
__device__ __forceinline__ bool tile_needs_mask(const QsMeta<MMAX> &mt, const DfTile &t, int BN)
{
    return t.seg < 0 || mt.nseg > 1 || t.key0 + BN > mt.seg_amin[t.seg] || t.key0 < mt.seg_lomax[t.seg];
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

/* load MMAX rows of a [Q, n_heads*d] array (the CTA's query rows) into shared memory: THREADS
 * threads, this one tid of them (default: the whole CTA, threadIdx.x) */
template <int D, int MMAX, int THREADS>
__device__ __forceinline__ void load_rows(const QsMeta<MMAX> &mt, const bf16 *src, uint32_t dst,
                                          int tid = (int)threadIdx.x)
{
    constexpr int CH = D / 8, ROWB = D * 2 + 16;
    for (int c = tid; c < MMAX * CH; c += THREADS) {
        int r = c / CH, ch = c % CH;
        long long off = mt.row_off[r];
        df_cp16(dst + r * ROWB + ch * 16, off >= 0 ? src + off + ch * 8 : src, off >= 0);
    }
}

/* The keys [lo, hi) of the thread's rows (local block rlb, slot rj) for phase seg (see the file
 * comment); with a sliding window, context keys from df_ctx_lo and block keys up to the slot. */
template <int MMAX, int MT>
__device__ __forceinline__ void phase_ranges(const QsMeta<MMAX> &mt, int seg, int bs, int window,
                                             const int (&rlb)[MT][2], const int (&rj)[MT][2],
                                             int (&lo)[MT][2], int (&hi)[MT][2])
{
#pragma unroll
    for (int i = 0; i < MT; i++)
#pragma unroll
        for (int hh = 0; hh < 2; hh++) {
            int lb = rlb[i][hh];
            if (lb < 0) {
                lo[i][hh] = hi[i][hh] = 0;
            } else if (seg >= 0) {
                const bool in = mt.blk_seg[lb] == seg;
                lo[i][hh] = in ? df_ctx_lo(window, mt.blk_an[lb], rj[i][hh]) : 0;
                hi[i][hh] = in ? mt.blk_an[lb] : 0;
            } else {
                lo[i][hh] = lb * bs;
                hi[i][hh] = lo[i][hh] + (window > 0 ? rj[i][hh] + 1 : bs);
            }
        }
}

/* The start of a key tile's step on the query-stationary CTAs: the thread's mask ranges for tile
 * t's phase where it changes (cur_seg: the phase lo and hi hold), and whether the tile needs the
 * per-key mask */
template <int MMAX, int MT>
__device__ __forceinline__ bool tile_phase(const QsMeta<MMAX> &mt, const DfP &p, const DfTile &t, int BN, int &cur_seg,
                                           const int (&rlb)[MT][2], const int (&rj)[MT][2], int (&lo)[MT][2],
                                           int (&hi)[MT][2])
{
    if (t.seg != cur_seg) {
        phase_ranges<MMAX, MT>(mt, t.seg, p.bs, p.window, rlb, rj, lo, hi);
        cur_seg = t.seg;
    }
    return tile_needs_mask<MMAX>(mt, t, BN);
}

/* ------------------------------------------------------------------------------------------ */
/* forward (bf16) */

/* The thread's rows m0 + 16 i (+ 8) of the CTA (i < MT): their local block (-1: no row) and slot */
template <int MMAX, int MT>
__device__ __forceinline__ void qs_rows(const QsMeta<MMAX> &mt, const DfP &p, int m0, int (&rlb)[MT][2],
                                        int (&rj)[MT][2])
{
#pragma unroll
    for (int i = 0; i < MT; i++)
#pragma unroll
        for (int hh = 0; hh < 2; hh++) {
            const int m = m0 + i * 16 + 8 * hh;
            rlb[i][hh] = mt.row_off[m] >= 0 ? m / p.rb : -1;
            rj[i][hh] = (m % p.rb) % p.bs;
        }
}

/* Forward: -inf for the scores of the thread's rows (mma.sync m16 layout: n8 tile nt, keys
 * key0 + 8 nt + 2 t4 (+ 1)) outside their keys [lo, hi) */
template <int MT, int NT>
__device__ __forceinline__ void fwd_mask(float (&s)[MT][NT][4], int key0, int t4, const int (&lo)[MT][2],
                                         const int (&hi)[MT][2])
{
#pragma unroll
    for (int i = 0; i < MT; i++)
#pragma unroll
        for (int nt = 0; nt < NT; nt++)
#pragma unroll
            for (int e = 0; e < 4; e++) {
                const int kj = key0 + nt * 8 + 2 * t4 + (e & 1), hh = e >> 1;
                if (!(kj >= lo[i][hh] && kj < hi[i][hh]))
                    s[i][nt][e] = -INFINITY;
            }
}

/* Forward's end: O / l of the warp's MT m16 tiles of rows from wr0 (mma.sync m16 layout) through
 * the warp's own rows of the Q tile at smem (rows of D * 2 + 16 bytes; no other warp reads them
 * any more), then 16-byte stores; lse (natural log of the scaled scores; -inf for a row without
 * keys) */
template <int D, int MMAX, int MT>
__device__ __forceinline__ void fwd_store(const QsMeta<MMAX> &mt, const DfP &p, unsigned char *smem, int wr0, int lane,
                                          const float (&o)[MT][D / 8][4], const float (&mrow)[MT][2],
                                          const float (&lrow)[MT][2])
{
    constexpr int CH = D / 8, DT = D / 8, ROWB = D * 2 + 16;
    const int g = lane >> 2, t4 = lane & 3;
#pragma unroll
    for (int i = 0; i < MT; i++)
#pragma unroll
        for (int hh = 0; hh < 2; hh++) {
            float l = ft_row_sum(lrow[i][hh]);
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
    constexpr int NT = BN / 8, KD = D / 16, DT = D / 8, KB = BN / 16;
    static_assert(D % 32 == 0 && BN % 16 == 0, "tile shape");

    DF_DYN_SMEM(smem);
    __shared__ QsMeta<MMAX> mt;
    const uint32_t sQ = df_smem(smem), sK0 = sQ + MMAX * ROWB, sV0 = sK0 + 2 * BN * ROWB;
    const int g_kv = qs_kv(p), b0 = qs_b0(p);
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
    int rlb[MT][2], rj[MT][2], lo[MT][2], hi[MT][2];
    qs_rows<MMAX, MT>(mt, p, wr0 + g, rlb, rj);
    int cur_seg = -2;

    const uint32_t q_lane = sQ + wr0 * ROWB + lane_a(lane, ROWB);
    const uint32_t k_lane = lane_b(lane, ROWB);
    const uint32_t v_lane = lane_bt(lane, ROWB);

    float o[MT][DT][4];
    float mrow[MT][2], lrow[MT][2];
    ft_init(o, mrow, lrow);
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
        const bool need_mask = tile_phase<MMAX, MT>(mt, p, t, BN, cur_seg, rlb, rj, lo, hi);
        const int key0 = t.key0;
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
                    ft_mma_x4(s, a, b, np);
                }
            }
            if (need_mask)
                fwd_mask(s, key0, t4, lo, hi);
            ft_online_softmax(s, mrow, lrow, o, sl2);
#pragma unroll
            for (int kb = 0; kb < KB; kb++) {
                uint32_t a[MT][4];
                ft_pack_p(a, s, kb);
#pragma unroll
                for (int dp = 0; dp < DT / 2; dp++) {
                    uint32_t b[4];
                    df_ldm_t(b, vst + kb * 16 * ROWB + v_lane + dp * 32);
                    ft_mma_x4(o, a, b, dp);
                }
            }
        }
        __syncthreads();   /* the stage is refilled next iteration */
    }

    fwd_store<D, MMAX, MT>(mt, p, smem, wr0, lane, o, mrow, lrow);
}

/* Pass Q: the CTA's Q and dO rows into shared memory at sQ, sDO (rows of D * 2 + 16 bytes; one
 * commit group) */
template <int D, int MMAX, int THREADS>
__device__ __forceinline__ void bq_load_qdo(const QsMeta<MMAX> &mt, const DfP &p, uint32_t sQ, uint32_t sDO)
{
    load_rows<D, MMAX, THREADS>(mt, (const bf16 *)p.q, sQ);
    load_rows<D, MMAX, THREADS>(mt, (const bf16 *)p.dout, sDO);
    df_commit();
}

/* Pass Q's start: the CTA's metadata (qs_setup), then its Q and dO rows (bq_load_qdo) */
template <int D, int MMAX, int THREADS>
__device__ __forceinline__ void bq_setup(QsMeta<MMAX> &mt, const DfP &p, int b0, int g_kv, int BN, uint32_t sQ,
                                         uint32_t sDO)
{
    qs_setup<MMAX>(mt, p, b0, g_kv, BN);
    bq_load_qdo<D, MMAX, THREADS>(mt, p, sQ, sDO);
}

/* Pass Q, a block-key tile: the warp's P and dS (NT n8 tiles of its 16 rows from wr0) as bf16
 * into the [rows][keys] tiles at pP, pDS (rows of ROWP bytes) */
template <int NT>
__device__ __forceinline__ void bq_put_pds(unsigned char *pP, unsigned char *pDS, int rowp, int wr0, int lane,
                                           const float (&s)[NT][4], const float (&dp)[NT][4])
{
    const int g = lane >> 2, t4 = lane & 3;
#pragma unroll
    for (int nt = 0; nt < NT; nt++)
#pragma unroll
        for (int hh = 0; hh < 2; hh++) {
            const int off = (wr0 + g + 8 * hh) * rowp + (nt * 8 + 2 * t4) * 2;
            *reinterpret_cast<uint32_t *>(pP + off) = df_pack(s[nt][2 * hh], s[nt][2 * hh + 1]);
            *reinterpret_cast<uint32_t *>(pDS + off) = df_pack(dp[nt][2 * hh], dp[nt][2 * hh + 1]);
        }
}

/* Pass Q: delta = rowsum(dout * o) of the warp's 16 rows from wr0 (dO in shared memory at pDO,
 * rows of D * 2 + 16 bytes), written to p.delta, and each row's lse * log2 e and delta into
 * sLse2, sDelta (a row that is not there: INFINITY, 0); LPR lanes per row */
template <int D, int MMAX, bool READ = false>
__device__ __forceinline__ void bq_delta(const QsMeta<MMAX> &mt, const DfP &p, const unsigned char *pDO, int wr0,
                                         int lane, float *sLse2, float *sDelta)
{
    if constexpr (READ) {   /* dS kept: delta made before pass KV (df_delta_kernel); read it */
        if (lane < 16) {
            const int r = wr0 + lane;
            const long long off = mt.row_off[r];
            const int idx = mt.row_idx[r];
            sDelta[r] = off >= 0 ? p.delta[idx] : 0.0f;
            sLse2[r] = off >= 0 ? p.lse[idx] * DF_LOG2E : INFINITY;
        }
        return;
    }
    constexpr int CH = D / 8, ROWB = D * 2 + 16;
    constexpr int LPR = CH < 32 ? CH : 32, RPP = 32 / LPR;
    const bf16 *og = (const bf16 *)p.o_in;
    for (int k = 0; k < 16 / RPP; k++) {
        const int r = wr0 + k * RPP + lane / LPR;
        const long long off = mt.row_off[r];
        float dot = 0.0f;
        for (int ch = lane % LPR; ch < CH; ch += LPR) {
            if (off >= 0) {
                const uint4 ov = *reinterpret_cast<const uint4 *>(og + off + ch * 8);
                const uint4 dv = *reinterpret_cast<const uint4 *>(pDO + r * ROWB + ch * 16);
                const uint32_t ow[4] = {ov.x, ov.y, ov.z, ov.w}, dw[4] = {dv.x, dv.y, dv.z, dv.w};
#pragma unroll
                for (int j = 0; j < 4; j++)
                    dot += df_bf_lo(ow[j]) * df_bf_lo(dw[j]) + df_bf_hi(ow[j]) * df_bf_hi(dw[j]);
            }
        }
        dot = warp_sum<LPR>(dot);
        if (lane % LPR == 0) {
            const int idx = mt.row_idx[r];
            sDelta[r] = off >= 0 ? dot : 0.0f;
            sLse2[r] = off >= 0 ? p.lse[idx] * DF_LOG2E : INFINITY;
            if (off >= 0)
                p.delta[idx] = dot;
        }
    }
}

/* Pass Q: the thread's rows m0 and m0 + 8 of the CTA: their local block (-1: no row) and slot,
 * lse * log2 e and delta (after bq_delta and a barrier of the warps that wrote them) */
template <int MMAX>
__device__ __forceinline__ void bq_rows(const QsMeta<MMAX> &mt, const DfP &p, int m0, const float *sLse2,
                                        const float *sDelta, int (&rlb)[1][2], int (&rj)[1][2], float (&lse2)[2],
                                        float (&dlt)[2])
{
    qs_rows<MMAX, 1>(mt, p, m0, rlb, rj);
#pragma unroll
    for (int hh = 0; hh < 2; hh++) {
        lse2[hh] = sLse2[m0 + 8 * hh];
        dlt[hh] = sDelta[m0 + 8 * hh];
    }
}

/* Pass Q, a block-key tile of BN keys from key0: dV_blk = P^T dO, dK_blk = scale dS^T Q of its
 * keys (P, dS at sP, sDS: [MMAX rows][BN keys] of BN * 2 + 16 bytes; Q, dO at sQ, sDO: rows of
 * D * 2 + 16 bytes; complete: every row of the CTA's blocks is in it), split in units of 16 keys
 * x 16 columns of one of the two among the NW warps */
template <int D, int BN, int NW, int MMAX>
__device__ __forceinline__ void bq_blk(const QsMeta<MMAX> &mt, const DfP &p, int b0, int g_kv, int key0, uint32_t sP,
                                       uint32_t sDS, uint32_t sQ, uint32_t sDO, int warp, int lane)
{
    constexpr int ROWB = D * 2 + 16, ROWP = BN * 2 + 16;
    const int g = lane >> 2, t4 = lane & 3;
    const uint32_t at_lane = lane_b(lane, ROWP), bt_lane = lane_bt(lane, ROWB);
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

/* Pass Q: dQ * scale (the warp's accumulators dq of its 16 rows from wr0, the mma.sync m16
 * layout) through the warp's own Q rows in shared memory at smem, then 16-byte stores */
template <int D, int MMAX>
__device__ __forceinline__ void bq_store_dq(const QsMeta<MMAX> &mt, const DfP &p, unsigned char *smem, int wr0, int lane,
                                            const float (&dq)[D / 8][4])
{
    constexpr int CH = D / 8, DT = D / 8, ROWB = D * 2 + 16;
    const int g = lane >> 2, t4 = lane & 3;
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
/* backward pass Q (bf16): one warp per 16 query rows */

/* ST: K/V tiles in flight (a ring of ST stages; ST - 1 tiles loading while one is computed) */
template <int D, int NW, int BN, bool QREG, int ST = 2>
struct BwdQCfg {
    static constexpr int MMAX = 16 * NW;
    static constexpr int THREADS = 32 * NW;
    static constexpr int ROWB = D * 2 + 16;
    static constexpr int ROWP = BN * 2 + 16;
    static constexpr size_t SMEM = (size_t)(2 * MMAX + 2 * ST * BN) * ROWB + (size_t)2 * MMAX * ROWP;
};

template <int D, int NW, int BN, bool QREG, int ST = 2>
__global__ void __launch_bounds__(32 * NW)
df_bwd_q_kernel(const DfP p)
{
    typedef BwdQCfg<D, NW, BN, QREG, ST> C;
    constexpr int MMAX = C::MMAX, THREADS = C::THREADS, ROWB = C::ROWB, ROWP = C::ROWP;
    constexpr int NT = BN / 8, KD = D / 16, DT = D / 8, KB = BN / 16;
    static_assert(D % 32 == 0 && BN % 16 == 0 && ST >= 2, "tile shape");

    DF_DYN_SMEM(smem);
    __shared__ QsMeta<MMAX> mt;
    __shared__ float sLse2[MMAX], sDelta[MMAX];
    const uint32_t sQ = df_smem(smem), sDO = sQ + MMAX * ROWB, sK0 = sDO + MMAX * ROWB;
    const uint32_t sV0 = sK0 + ST * BN * ROWB, sP = sV0 + ST * BN * ROWB, sDS = sP + MMAX * ROWP;
    unsigned char *pP = smem + (sP - sQ), *pDS = smem + (sDS - sQ), *pDO = smem + (sDO - sQ);
    const int g_kv = qs_kv(p), b0 = qs_b0(p);
    const int tid = threadIdx.x, warp = tid >> 5, lane = tid & 31;
    const int g = lane >> 2, t4 = lane & 3;

    bq_setup<D, MMAX, THREADS>(mt, p, b0, g_kv, BN, sQ, sDO);
    const int ntiles = mt.ntiles;
    /* K/V tiles 0 .. ST-2, a commit group each (empty past the last tile) */
    auto load_tile = [&](int it) {
        if (it < ntiles) {
            DfTile tn = tile_at<MMAX>(mt, p, it, b0, g_kv, BN);
            const int st = it % ST;
            load_kv_tile<D, BN, THREADS>(tn, p.ldk, sK0 + st * BN * ROWB, sV0 + st * BN * ROWB);
        }
        df_commit();
    };
    for (int it = 0; it < ST - 1; it++)
        load_tile(it);
    df_wait<ST - 1>();   /* Q and dO */
    __syncthreads();

    const int wr0 = warp * 16;
    bq_delta<D, MMAX>(mt, p, pDO, wr0, lane, sLse2, sDelta);
    __syncwarp();
    int rlb[1][2], rj[1][2], lo[1][2], hi[1][2];
    float lse2[2], dlt[2];
    bq_rows<MMAX>(mt, p, wr0 + g, sLse2, sDelta, rlb, rj, lse2, dlt);
    int cur_seg = -2;

    const uint32_t q_lane = sQ + wr0 * ROWB + lane_a(lane, ROWB);
    const uint32_t do_lane = sDO + wr0 * ROWB + lane_a(lane, ROWB);
    const uint32_t k_lane = lane_b(lane, ROWB);
    const uint32_t kt_lane = lane_bt(lane, ROWB);
    const float sl2 = p.sl2;

    float dq[DT][4];
#pragma unroll
    for (int dt = 0; dt < DT; dt++)
#pragma unroll
        for (int e = 0; e < 4; e++)
            dq[dt][e] = 0.0f;
    /* QREG: the warp's Q and dO fragments stay in registers (loaded once; Q and dO are in shared
     * memory since the barrier above) */
    uint32_t qf[QREG ? KD : 1][4], dof[QREG ? KD : 1][4];
    if (QREG) {
#pragma unroll
        for (int kk = 0; kk < KD; kk++) {
            df_ldm(qf[QREG ? kk : 0], q_lane + kk * 32);
            df_ldm(dof[QREG ? kk : 0], do_lane + kk * 32);
        }
    }

    for (int it = 0; it < ntiles; it++) {
        const int stage = it % ST;
        const DfTile t = tile_at<MMAX>(mt, p, it, b0, g_kv, BN);
        /* the stage of tile it + ST - 1 was last read in iteration it - 1 (barrier at its end) */
        load_tile(it + ST - 1);
        df_wait<ST - 1>();   /* tile it */
        __syncthreads();
        const bool need_mask = tile_phase<MMAX, 1>(mt, p, t, BN, cur_seg, rlb, rj, lo, hi);
        const int key0 = t.key0;
        const bool blk = t.seg < 0;
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
                if (QREG) {
#pragma unroll
                    for (int e = 0; e < 4; e++) {
                        a[e] = qf[QREG ? kk : 0][e];
                        ad[e] = dof[QREG ? kk : 0][e];
                    }
                } else {
                    df_ldm(a, q_lane + kk * 32);
                    df_ldm(ad, do_lane + kk * 32);
                }
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
            /* P = exp(S - lse) (0 where masked), dS = P (dP - delta); the exponential is taken
             * everywhere and the mask applied after it as a select (as the wgmma kernels do:
             * a conditional exponential compiles to a branch per element) */
#pragma unroll
            for (int nt = 0; nt < NT; nt++)
#pragma unroll
                for (int e = 0; e < 4; e++) {
                    const int hh = e >> 1;
                    const int kj = key0 + nt * 8 + 2 * t4 + (e & 1);
                    const bool ok = !need_mask || (kj >= lo[0][hh] && kj < hi[0][hh]);
                    const float ex = df_exp2(fmaf(s[nt][e], sl2, -lse2[hh]));   /* everywhere: no branch */
                    const float pv = ok ? ex : 0.0f;
                    s[nt][e] = pv;
                    dp[nt][e] = pv * (dp[nt][e] - dlt[hh]);
                }
            if (blk)
                bq_put_pds<NT>(pP, pDS, ROWP, wr0, lane, s, dp);
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
            __syncthreads();
            bq_blk<D, BN, NW, MMAX>(mt, p, b0, g_kv, t.key0, sP, sDS, sQ, sDO, warp, lane);
        }
        __syncthreads();
    }

    bq_store_dq<D, MMAX>(mt, p, smem, wr0, lane, dq);
}

/* ------------------------------------------------------------------------------------------ */
/* backward pass KV (bf16): key-stationary, one warp per 16 context keys */

/* PIPE: the rows' cs, an, lse, delta fetched a chunk ahead (two stages of 4 x QC words).
 * SP (with PIPE): P^T and dS^T of a chunk go through shared memory ([BNK keys][QC rows] each), so
 * that each warp computes S^T, dP^T for 32 keys x 32 rows and then dV, dK for 32 keys x D/2
 * (instead of 16 keys x all rows, then 16 keys x D): fewer shared-memory fragment loads a FLOP */
template <int D, int NW, int QC, bool PIPE = false, bool SP = false>
struct BwdKVCfg {
    static constexpr int BNK = 16 * NW;
    static constexpr int THREADS = 32 * NW;
    static constexpr int ROWB = D * 2 + 16;
    static constexpr int ROWP = QC * 2 + 16;
    static constexpr size_t SMEM = (size_t)(2 * BNK + 4 * QC) * ROWB + (PIPE ? 2 * 4 * QC * 4 : 0) +
                                   (SP ? (size_t)2 * BNK * ROWP : 0);
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
 * c0 and of sequences starting inside the range), those with cs + an > c0 and an > 0 (and, with
 * a sliding window, whose slot 0 window starts before c1). */
static __device__ void df_tile_blocks(const DfP &p, int64_t c0, int64_t c1, int *first, int *end, int *count)
{
    const int blast = df_upper(p.cs, p.n_blocks, c1 - 1);
    const int ub0 = df_upper(p.cs, p.n_blocks, c0);
    const int bfirst = ub0 > 0 ? df_lower(p.cs, p.n_blocks, p.cs[ub0 - 1]) : 0;
    int f = blast, l = bfirst, n = 0;
    for (int b = bfirst; b < blast; b++) {
        int a = p.an[b];
        if (a > 0 && (int64_t)p.cs[b] + a > c0 && (int64_t)p.cs[b] + df_ctx_lo(p.window, a, 0) < c1) {
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
static __global__ void __launch_bounds__(1024) df_sched_kernel(const DfP p, int *sched, int bnk)
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

/* dS kept, one CTA of DF_PLAN_THREADS: blk[b] = {first slot - first tile, first tile, end tile}
 * of each block (df_ds_tiles), the slots laid out in block order; *total (when not null) the
 * slots used. Thread t takes a contiguous run of blocks; the runs' counts are summed in order by
 * one thread. */
#define DF_PLAN_THREADS 1024
static __global__ void __launch_bounds__(DF_PLAN_THREADS) df_ds_plan_kernel(const DfP p, int4 *blk, int64_t *total)
{
    __shared__ long long run[DF_PLAN_THREADS];
    const int t = (int)threadIdx.x, n = p.n_blocks;
    const int per = (n + DF_PLAN_THREADS - 1) / DF_PLAN_THREADS, b0 = t * per, b1 = min(n, b0 + per);
    long long c = 0;
    for (int b = b0; b < b1; b++) {
        int lo;
        c += df_ds_tiles(p.window, p.cs[b], p.an[b], &lo) - lo;
    }
    run[t] = c;
    __syncthreads();
    if (t == 0) {
        long long acc = 0;
        for (int i = 0; i < DF_PLAN_THREADS; i++) {
            const long long x = run[i];
            run[i] = acc;
            acc += x;
        }
        if (total)
            *total = acc;
    }
    __syncthreads();
    long long off = run[t];
    for (int b = b0; b < b1; b++) {
        int lo;
        const int hi = df_ds_tiles(p.window, p.cs[b], p.an[b], &lo);
        blk[b] = make_int4((int)(off - lo), lo, hi, 0);
        off += hi - lo;
    }
}

/* dS kept: delta = rowsum(dout * o) of every (block row, head) (head dimension D), one warp each,
 * before pass KV (which reads it) */
template <int D>
static __global__ void __launch_bounds__(256) df_delta_kernel(const DfP p)
{
    static_assert(D % 64 == 0, "whole 4-byte pairs a lane");
    const int64_t item = (int64_t)blockIdx.x * 8 + (threadIdx.x >> 5), n = (int64_t)p.n_blocks * p.bs * p.nh;
    const int lane = (int)threadIdx.x & 31;
    if (item >= n)
        return;
    const uint32_t *og = reinterpret_cast<const uint32_t *>((const bf16 *)p.o_in + item * p.d);
    const uint32_t *dg = reinterpret_cast<const uint32_t *>((const bf16 *)p.dout + item * p.d);
    float dot = 0.0f;
#pragma unroll
    for (int i = 0; i < D / 64; i++) {
        const uint32_t ow = og[lane + 32 * i], dw = dg[lane + 32 * i];
        dot += df_bf_lo(ow) * df_bf_lo(dw) + df_bf_hi(ow) * df_bf_hi(dw);
    }
    dot = warp_sum(dot);
    if (lane == 0)
        p.delta[item] = dot;
}

/* Pass KV: the key tile [c0, c1) of a CTA, its query rows [rbeg, rend) (rows of the blocks
 * [bfirst, bend) of the schedule, rb to a block) in nch chunks, its kv head */
struct KvSpan {
    int64_t c0, c1, rbeg, rend;
    int nch, g_kv;
};

/* The span of this CTA (bnk keys a tile, chunks of qc rows): key tile p.sched[blockIdx.x / nkv]
 * (the schedule's order), kv head blockIdx.x % nkv */
__device__ __forceinline__ KvSpan kv_span(const DfP &p, int bnk, int qc)
{
    KvSpan k;
    k.g_kv = (int)(blockIdx.x % (unsigned)p.nkv);
    const int kt = p.sched[blockIdx.x / (unsigned)p.nkv];
    k.c0 = (int64_t)kt * bnk;
    k.c1 = min(p.T_ctx, k.c0 + bnk);
    k.rbeg = (int64_t)p.sched[p.n_kt + kt] * p.rb;
    k.rend = (int64_t)p.sched[2 * p.n_kt + kt] * p.rb;
    k.nch = (int)((k.rend - k.rbeg + qc - 1) / qc);
    return k;
}

/* The row tables of MS chunk stages: per row of a chunk its element offset in [Q, n_heads*d]
 * arrays (-1: the row does not see the tile), lse * log2 e, delta, and the context rows [lo, hi)
 * it sees */
template <int MS, int QC> struct KvRows {
    long long off[MS][QC];
    float l2[MS][QC], dl[MS][QC];
    int lo[MS][QC], hi[MS][QC];
};

/* cp.async of the cs, an, lse and delta of chunk ci's rows (thread t < QC: row t) into the raw
 * stage at shared address raw ([cs, an, lse, delta][QC] words; zeros past the rows): the row
 * tables of a chunk are fetched a chunk ahead, so that no global load is waited on between
 * chunks; thread t alone reads its words back (kv_finish) */
template <int QC>
__device__ __forceinline__ void kv_fetch(const DfP &p, const KvSpan &k, int ci, uint32_t raw, int tid)
{
    if (tid < QC) {
        const int64_t r = k.rbeg + (int64_t)ci * QC + tid;
        const bool ok = ci < k.nch && r < k.rend;
        const int b = ok ? (int)(r / p.rb) : 0, rem = ok ? (int)(r - (int64_t)b * p.rb) : 0;
        const int64_t idx = ((int64_t)b * p.bs + rem % p.bs) * p.nh + k.g_kv * p.group + rem / p.bs;
        const uint32_t dst = raw + (uint32_t)tid * 4;
        df_cp4(dst, p.cs + b, ok);
        df_cp4(dst + QC * 4, p.an + b, ok);
        df_cp4(dst + 2 * QC * 4, p.lse + (ok ? idx : 0), ok);
        df_cp4(dst + 3 * QC * 4, p.delta + (ok ? idx : 0), ok);
    }
}

/* The row tables of chunk ci from its raw stage at raw (complete: waited on) into stage ms;
 * *any: a row sees the tile (any null: not computed); returns whether no row needs the per-key
 * mask. Uniform: every thread of the CTA calls it; two barriers (one with a null any). */
template <int MS, int QC>
__device__ __forceinline__ bool kv_finish(KvRows<MS, QC> &rt, const DfP &p, const KvSpan &k, int ci,
                                          const unsigned char *raw, int ms, int tid, bool *any)
{
    bool sees = false, fullt = true;
    if (tid < QC) {
        long long off = -1;
        float l2 = INFINITY, dl = 0.0f;
        int lo = 0, hi = 0;
        const int64_t r = k.rbeg + (int64_t)ci * QC + tid;
        if (ci < k.nch && r < k.rend) {
            const int b = (int)(r / p.rb), rem = (int)(r - (int64_t)b * p.rb);
            const int hl = rem / p.bs, j = rem - hl * p.bs;
            const int csb = reinterpret_cast<const int *>(raw)[tid];
            const int anb = reinterpret_cast<const int *>(raw)[QC + tid];
            lo = csb + df_ctx_lo(p.window, anb, j);
            hi = csb + anb;
            sees = anb > 0 && hi > k.c0 && lo < k.c1 && lo < hi;
            if (sees) {
                const int64_t grow = (int64_t)b * p.bs + j;
                off = grow * p.ldq + (int64_t)(k.g_kv * p.group + hl) * p.d;
                l2 = reinterpret_cast<const float *>(raw)[2 * QC + tid] * DF_LOG2E;
                dl = reinterpret_cast<const float *>(raw)[3 * QC + tid];
                fullt = lo <= k.c0 && hi >= k.c1;
            }
        }
        rt.off[ms][tid] = off;
        rt.l2[ms][tid] = l2;
        rt.dl[ms][tid] = dl;
        rt.lo[ms][tid] = lo;
        rt.hi[ms][tid] = hi;
    }
    if (any)   /* a null any (known where kv_finish is inlined): one barrier, not two */
        *any = __syncthreads_or(sees);
    return __syncthreads_and(fullt);
}

template <int D, int NW, int QC, bool PIPE = false, bool SP = false>
__global__ void __launch_bounds__(32 * NW)
df_bwd_kv_kernel(const DfP p)
{
    typedef BwdKVCfg<D, NW, QC, PIPE, SP> C;
    constexpr int BNK = C::BNK, THREADS = C::THREADS, ROWB = C::ROWB, ROWP = C::ROWP;
    constexpr int CH = D / 8, KD = D / 16, DT = D / 8, NSC = QC / 32;
    static_assert(D % 32 == 0 && QC % 32 == 0 && QC <= THREADS, "tile shape");
    static_assert(!SP || (PIPE && QC == 64 && NW % 2 == 0), "SP: 2 x NW/2 warps over 64 rows x BNK keys");

    DF_DYN_SMEM(smem);
    constexpr int MS = PIPE ? 3 : 2;   /* stages of the row tables */
    __shared__ KvRows<MS, QC> rt;
    long long (&sOff)[MS][QC] = rt.off;
    float (&sL2)[MS][QC] = rt.l2, (&sDl)[MS][QC] = rt.dl;
    int (&sLo)[MS][QC] = rt.lo, (&sHi)[MS][QC] = rt.hi;
    const uint32_t sK = df_smem(smem), sV = sK + BNK * ROWB, sQ0 = sV + BNK * ROWB;
    const uint32_t sDO0 = sQ0 + 2 * QC * ROWB;
    const KvSpan span = kv_span(p, BNK, QC);
    const int g_kv = span.g_kv, nch = span.nch;
    const int64_t c0 = span.c0, c1 = span.c1, rbeg = span.rbeg, rend = span.rend;
    const int tid = threadIdx.x, warp = tid >> 5, lane = tid & 31;
    const int g = lane >> 2, t4 = lane & 3;

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
        if (!PIPE)
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
                    lo = csb + df_ctx_lo(p.window, anb, j);
                    hi = csb + anb;
                    sees = anb > 0 && hi > c0 && lo < c1 && lo < hi;
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
    /* PIPE: the row tables of chunk ci come from cs, an, lse and delta fetched by cp.async one
     * chunk ahead (thread t < QC: row t, into raw stage rs; it alone reads them back), so no
     * global load is waited on between chunks; chunks no row of which sees the tile are loaded
     * but not computed (the schedule's block range rarely holds any) */
    const uint32_t sRaw = sDO0 + 2 * QC * ROWB;   /* [stage][cs, an, lse, delta][QC] */
    const unsigned char *pRaw = smem + (2 * BNK + 4 * QC) * ROWB;
    auto fetch = [&](int ci, int rs) { kv_fetch<QC>(p, span, ci, sRaw + (uint32_t)(rs * 4 * QC) * 4, tid); };
    auto finish = [&](int ci, int rs, int ms, bool *any) -> bool {
        return kv_finish<MS, QC>(rt, p, span, ci, pRaw + rs * 4 * QC * 4, ms, tid, any);
    };

    auto load_chunk = [&](int st, int ms) {
        const bf16 *qg = (const bf16 *)p.q, *dg = (const bf16 *)p.dout;
        const uint32_t dq_ = sQ0 + st * QC * ROWB, dd_ = sDO0 + st * QC * ROWB;
        for (int c = tid; c < QC * CH; c += THREADS) {
            int r = c / CH, ch = c % CH;
            long long off = sOff[ms][r];
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

    /* one chunk: S^T = K Q^T, dP^T = V dO^T, P^T, dS^T, dV += P^T dO, dK += dS^T Q; Q, dO at qst,
     * dost; the row tables of stage ms; full: no row needs the per-key mask */
    auto compute = [&](uint32_t qst, uint32_t dost, int ms, bool full) {
#pragma unroll 1
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
                    const bool ok = full || (key >= sLo[ms][qi] && key < sHi[ms][qi]);
                    const float ex = df_exp2(fmaf(s[nt][e], sl2, -sL2[ms][qi]));   /* everywhere: no branch */
                    const float pv = ok ? ex : 0.0f;
                    s[nt][e] = pv;
                    dp[nt][e] = pv * (dp[nt][e] - sDl[ms][qi]);
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
    };
    /* SP: phase 1, warp (wk, wq) = (warp / 2, warp % 2): S^T, dP^T of keys [32 wk, +32) x rows
     * [32 wq, +32); P^T, dS^T to shared memory; barrier; phase 2, warp (kg, dsl) = (warp / 2,
     * warp % 2): dV, dK of keys [32 kg, +32) x d [dsl D/2, +D/2) (dk, dv [mi * DT/2 + n8 tile]) */
    const uint32_t sPT = sRaw + 2 * 4 * QC * 4, sDST = sPT + BNK * ROWP;
    auto compute_sp = [&](uint32_t qst, uint32_t dost, int ms, bool full) {
        const int wk = warp >> 1, wq = warp & 1;
        float s[2][4][4], dp[2][4][4];
#pragma unroll
        for (int mi = 0; mi < 2; mi++)
#pragma unroll
            for (int nt = 0; nt < 4; nt++)
#pragma unroll
                for (int e = 0; e < 4; e++)
                    s[mi][nt][e] = dp[mi][nt][e] = 0.0f;
        const uint32_t ka = sK + wk * 32 * ROWB + lane_a(lane, ROWB), va = ka + BNK * ROWB;
#pragma unroll
        for (int kk = 0; kk < KD; kk++) {
            uint32_t a[2][4], av[2][4];
            ldm_a2(a, av, ka, va, ROWB, kk * 32);
#pragma unroll
            for (int np = 0; np < 2; np++) {
                uint32_t b[4];
                df_ldm(b, qst + (wq * 32 + np * 16) * ROWB + b_lane + kk * 32);
#pragma unroll
                for (int mi = 0; mi < 2; mi++) {
                    df_mma(s[mi][2 * np], a[mi], b[0], b[1]);
                    df_mma(s[mi][2 * np + 1], a[mi], b[2], b[3]);
                }
                df_ldm(b, dost + (wq * 32 + np * 16) * ROWB + b_lane + kk * 32);
#pragma unroll
                for (int mi = 0; mi < 2; mi++) {
                    df_mma(dp[mi][2 * np], av[mi], b[0], b[1]);
                    df_mma(dp[mi][2 * np + 1], av[mi], b[2], b[3]);
                }
            }
        }
        unsigned char *pPT = smem + (sPT - sK), *pDST = smem + (sDST - sK);
#pragma unroll
        for (int mi = 0; mi < 2; mi++)
#pragma unroll
            for (int nt = 0; nt < 4; nt++) {
#pragma unroll
                for (int e = 0; e < 4; e++) {
                    const int qi = wq * 32 + nt * 8 + 2 * t4 + (e & 1);
                    const int64_t key = c0 + wk * 32 + mi * 16 + g + 8 * (e >> 1);
                    const bool ok = full || (key >= sLo[ms][qi] && key < sHi[ms][qi]);
                    const float ex = df_exp2(fmaf(s[mi][nt][e], sl2, -sL2[ms][qi]));   /* everywhere: no branch */
                    const float pv = ok ? ex : 0.0f;
                    s[mi][nt][e] = pv;
                    dp[mi][nt][e] = pv * (dp[mi][nt][e] - sDl[ms][qi]);
                }
#pragma unroll
                for (int hh = 0; hh < 2; hh++) {
                    const int off = (wk * 32 + mi * 16 + g + 8 * hh) * ROWP + (wq * 32 + nt * 8 + 2 * t4) * 2;
                    *reinterpret_cast<uint32_t *>(pPT + off) = df_pack(s[mi][nt][2 * hh], s[mi][nt][2 * hh + 1]);
                    *reinterpret_cast<uint32_t *>(pDST + off) = df_pack(dp[mi][nt][2 * hh], dp[mi][nt][2 * hh + 1]);
                }
            }
        __syncthreads();
        const int kg = warp >> 1, dsl = warp & 1;
        const uint32_t pa = sPT + kg * 32 * ROWP + lane_a(lane, ROWP), da = pa + BNK * ROWP;
#pragma unroll
        for (int kb = 0; kb < QC / 16; kb++) {
            uint32_t ap[2][4], ad[2][4];
            ldm_a2(ap, ad, pa, da, ROWP, kb * 32);
#pragma unroll
            for (int d2 = 0; d2 < DT / 4; d2++) {
                const uint32_t col = (uint32_t)(dsl * D / 2 + d2 * 16) * 2;
                uint32_t b[4];
                df_ldm_t(b, dost + kb * 16 * ROWB + bt_lane + col);
#pragma unroll
                for (int mi = 0; mi < 2; mi++) {
                    df_mma(dv[mi * (DT / 2) + 2 * d2], ap[mi], b[0], b[1]);
                    df_mma(dv[mi * (DT / 2) + 2 * d2 + 1], ap[mi], b[2], b[3]);
                }
                df_ldm_t(b, qst + kb * 16 * ROWB + bt_lane + col);
#pragma unroll
                for (int mi = 0; mi < 2; mi++) {
                    df_mma(dk[mi * (DT / 2) + 2 * d2], ad[mi], b[0], b[1]);
                    df_mma(dk[mi * (DT / 2) + 2 * d2 + 1], ad[mi], b[2], b[3]);
                }
            }
        }
    };
    if constexpr (PIPE) {
        /* iteration ci: wait for chunk ci's Q/dO and chunk ci+1's raw rows (one group), build
         * chunk ci+1's tables, start chunk ci+1's Q/dO and chunk ci+2's raw rows, compute ci.
         * Stages: Q/dO ci & 1 (refilled after the barriers of the next iteration), tables ci % 3
         * (chunk ci+1's are written while slower warps may still read ci's), raw ci % 2. */
        fetch(0, 0);
        fetch(1, 1);
        df_commit();
        df_wait<0>();
        bool any_cur, any_next;
        bool full_cur = finish(0, 0, 0, &any_cur);
        load_chunk(0, 0);
        df_commit();
        for (int ci = 0; ci < nch; ci++) {
            df_wait<0>();
            const bool full_next = finish(ci + 1, (ci + 1) & 1, (ci + 1) % 3, &any_next);
            if (ci + 1 < nch)
                load_chunk((ci + 1) & 1, (ci + 1) % 3);
            fetch(ci + 2, ci & 1);
            df_commit();
            if (any_cur) {
                /* (SP: P^T, dS^T are rewritten only after the next iteration's barriers) */
                if constexpr (SP)
                    compute_sp(sQ0 + (ci & 1) * QC * ROWB, sDO0 + (ci & 1) * QC * ROWB, ci % 3, full_cur);
                else
                    compute(sQ0 + (ci & 1) * QC * ROWB, sDO0 + (ci & 1) * QC * ROWB, ci % 3, full_cur);
            }
            any_cur = any_next;
            full_cur = full_next;
        }
    } else {
        bool full_cur = false, full_next = false;
        int cur = prep(0, 0, &full_cur);
        if (cur < nch)
            load_chunk(0, 0);
        df_commit();
        int stage = 0;
        while (cur < nch) {
            int nxt = prep(cur + 1, stage ^ 1, &full_next);
            if (nxt < nch) {
                load_chunk(stage ^ 1, stage ^ 1);
                df_commit();
                df_wait<1>();
            } else {
                df_wait<0>();
            }
            __syncthreads();
            compute(sQ0 + stage * QC * ROWB, sDO0 + stage * QC * ROWB, stage, full_cur);
            cur = nxt;
            full_cur = full_next;
            stage ^= 1;
        }
    }
    df_wait<0>();
    __syncthreads();   /* K/V loads done (no chunk case) and every warp past its last read */

    /* dK * scale and dV through the K / V rows (each thread the elements of its accumulators:
     * 16 keys x D, or with SP 32 keys x D/2), then 16-byte stores */
#pragma unroll
    for (int i = 0; i < DT; i++)
#pragma unroll
        for (int hh = 0; hh < 2; hh++) {
            const int r = SP ? (warp >> 1) * 32 + (i / (DT / 2)) * 16 + g + 8 * hh : warp * 16 + g + 8 * hh;
            const int col = SP ? (warp & 1) * D + (i % (DT / 2)) * 16 : i * 16;
            unsigned char *kp = smem + r * ROWB + col + 4 * t4, *vp = kp + BNK * ROWB;
            *reinterpret_cast<uint32_t *>(kp) = df_pack(dk[i][2 * hh] * p.scale, dk[i][2 * hh + 1] * p.scale);
            *reinterpret_cast<uint32_t *>(vp) = df_pack(dv[i][2 * hh], dv[i][2 * hh + 1]);
        }
    __syncthreads();
    bf16 *dkg = (bf16 *)p.dkc + (int64_t)g_kv * D, *dvg = (bf16 *)p.dvc + (int64_t)g_kv * D;
    for (int c = tid; c < BNK * CH; c += THREADS) {
        const int r = c / CH, ch = c % CH;
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
    return warp_sum(s);
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

/* key t of a query whose context keys are the nctx rows from row c0, then its block's rows from
 * brow: a context row or a block row */
template <typename T>
__device__ __forceinline__ const T *ds_key(const T *ctx, const T *blk, int64_t ld, int64_t c0,
                                           int64_t nctx, int64_t brow, int64_t t, int64_t off)
{
    return t < nctx ? ctx + (c0 + t) * ld + off : blk + (brow + t - nctx) * ld + off;
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
    const int32_t cs = p.cs[b], an = p.an[b], j = (int)(qr - brow);
    const int clo = df_ctx_lo(p.window, an, j);
    const int64_t c0 = (int64_t)cs + clo, nctx = an - clo;
    const T *kc = (const T *)p.kc, *vc = (const T *)p.vc, *kb = (const T *)p.kb, *vb = (const T *)p.vb;
    float qv[MAXV], acc[MAXV], kv[MAXV];
    ds_load<T, MAXV>(qv, (const T *)p.q + qr * p.ldq + (int64_t)h * d, d, lane);
#pragma unroll
    for (int i = 0; i < MAXV; i++)
        acc[i] = 0.0f;
    float m = -INFINITY, l = 0.0f;
    const int64_t nkeys = nctx + (p.window > 0 ? j + 1 : p.bs);
    for (int64_t t = 0; t < nkeys; t++) {
        ds_load<T, MAXV>(kv, ds_key(kc, kb, p.ldk, c0, nctx, brow, t, koff), d, lane);
        float sc = ds_dot<MAXV>(qv, kv) * p.scale;
        float mn = fmaxf(m, sc);
        float corr = expf(m - mn), pw = expf(sc - mn);
        l = l * corr + pw;
        ds_load<T, MAXV>(kv, ds_key(vc, vb, p.ldk, c0, nctx, brow, t, koff), d, lane);
#pragma unroll
        for (int i = 0; i < MAXV; i++)
            acc[i] = acc[i] * corr + pw * kv[i];
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
    const int32_t cs = p.cs[b], an = p.an[b], j = (int)(qr - brow);
    const int clo = df_ctx_lo(p.window, an, j);
    const int64_t c0 = (int64_t)cs + clo, nctx = an - clo;
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
    for (int i = 0; i < MAXV; i++)
        acc[i] = 0.0f;
    const int64_t nkeys = nctx + (p.window > 0 ? j + 1 : p.bs);
    for (int64_t t = 0; t < nkeys; t++) {
        ds_load<T, MAXV>(kv, ds_key(kc, kb, p.ldk, c0, nctx, brow, t, koff), d, lane);
        ds_load<T, MAXV>(vv, ds_key(vc, vb, p.ldk, c0, nctx, brow, t, koff), d, lane);
        float pp = expf(ds_dot<MAXV>(qv, kv) * p.scale - L);
        float ds = pp * (ds_dot<MAXV>(dov, vv) - D);
#pragma unroll
        for (int i = 0; i < MAXV; i++)
            acc[i] += ds * kv[i];
    }
    ds_store<T, MAXV>((T *)p.dq + qo, acc, p.scale, d, lane);
}

/* dk, dv of key row `key` (k, v pointers, head column included) over the query rows of block b
 * at slots [j0, j1) (the slots that see the key; all heads of kv head g) */
template <typename T, int MAXV>
__device__ __forceinline__ void ds_kv_block(const DfP &p, int64_t b, int g, const float (&kv)[MAXV],
                                            const float (&vv)[MAXV], float (&dk)[MAXV],
                                            float (&dv)[MAXV], int lane, int j0, int j1)
{
    const int d = p.d;
    float qv[MAXV], dov[MAXV];
    for (int h = g * p.group; h < (g + 1) * p.group; h++)
        for (int j = j0; j < j1; j++) {
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
    /* block key i is seen by every slot, or (sliding) by the slots j >= i */
    ds_kv_block<T, MAXV>(p, kr / p.bs, g, kv, vv, dk, dv, lane, p.window > 0 ? (int)(kr % p.bs) : 0, p.bs);
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
            if (c < (int64_t)s0 + p.an[b]) {
                /* sliding: slot j sees position c - s0 iff j <= c - s0 - an + W - 1 */
                const int64_t jend = p.window > 0 ? min((int64_t)p.bs, c - s0 - p.an[b] + p.window) : p.bs;
                ds_kv_block<T, MAXV>(p, b, g, kv, vv, dk, dv, lane, 0, (int)max((int64_t)0, jend));
            }
    }
    ds_store<T, MAXV>((T *)p.dkc + ko, dk, 1.0f, d, lane);
    ds_store<T, MAXV>((T *)p.dvc + ko, dv, 1.0f, d, lane);
}

#endif
