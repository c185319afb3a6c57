/* dflash_wgmma.cu: the two passes of the DFlash attention backward and its forward
 * (kernels/dflash_attn.cu has the design; df_bwd_kv_kernel, df_bwd_q_kernel and df_fwd_kernel in
 * dflash_kernels.cuh are the mma.sync forms) for head dimension 128 on Hopper's wgmma (sm_90a:
 * the Makefile compiles this file for sm_90a alone). Both passes of the backward (pass Q's
 * mbarrier form) and the forward (its warp-specialized form, dw_fwd_ws; dw_fwd describes the
 * others) are the d128 defaults on a GPU of compute capability 9. tests/emu/emu-dflash runs them
 * all in the SIMT emulator.
 *
 * Pass KV. A CTA of two warpgroups (256 threads) owns DW_BNK = 128 context keys of one kv head, warpgroup
 * w the keys [64 w, 64 w + 64); K and V stay in shared memory. The query rows of the blocks that
 * see the tile (the schedule's block range, as in df_bwd_kv_kernel) stream through two stages of
 * DW_QC = 64 rows of Q and dO (cp.async, every thread loading; each chunk's row tables fetched a
 * chunk ahead, kv_fetch / kv_finish). Every shared tile is two halves of 64 columns of rows of 128
 * bytes in the 128-byte swizzle of attn_wgmma.h (aw_off). Per chunk and warpgroup:
 *  - S^T = K Q^T and dP^T = V dO^T: wgmma m64n64k16, both operands K-major from shared memory,
 *    eight k16 steps each (the two issued back to back);
 *  - P^T = exp(S^T - lse) (0 where the row does not see the key), rounded to bf16 in registers:
 *    the A operand of dV += P^T dO, wgmma m64n128k16 with dO the MN-major (transposed) B operand,
 *    four k16 steps, issued before dP^T is waited on;
 *  - dS^T = P^T (dP^T - delta), to bf16 in registers: dK += dS^T Q, likewise with Q MN-major.
 * Schedules: plain (two stages: after a chunk's wgmma are done, the next chunk's row tables are
 * built and the one after it is started) and overlapped (OVL: three stages, chunks loaded two
 * ahead; that bookkeeping, with its barriers, runs while the chunk's dK is on the tensor cores).
 * A warp's share of an m64 accumulator is laid out as an mma.sync m16 tile: the thread's keys
 * are 16 warp + lane / 4 (+ 8), its rows 8 j + 2 (lane % 4) (+ 1) of n8 tile j. Every warpgroup
 * runs every wgmma of every chunk (a wgmma on a path that ptxas cannot prove uniform is
 * serialized): a chunk no row of which sees the tile multiplies P = 0. dK * scale and dV go
 * from the accumulators to global memory; rows no block sees get 0; every context row is written
 * by exactly one CTA (deterministic, no atomics).
 *
 * Pass Q. A CTA of two warpgroups takes DQW_MMAX = 128 query rows (whole blocks, as
 * df_bwd_q_kernel: qs_setup, the same key tiles through tile_at), warpgroup w the rows
 * [64 w, 64 w + 64); a warp's Q and dO rows are loaded once from shared memory (padded rows) into
 * registers as wgmma A fragments. Key tiles of DQW_BN = 64 rows of K and V stream through ST
 * stages (swizzled as above). Per tile: S = Q K^T and dP = dO V^T on wgmma m64n64k16 (A from
 * registers, K and V K-major), P and dS in registers (masked as in df_bwd_q_kernel), dQ += dS K
 * on wgmma m64n128k16 (dS the A operand, K MN-major); on the block-key tiles P and dS also go to
 * shared memory and dV_blk, dK_blk are computed with mma.sync (bq_blk) while dQ's wgmma run.
 * delta, the row tables and the dQ store are df_bwd_q_kernel's (bq_*). Pipelined (wg3p, the
 * default): a tile's dQ wgmma is not waited for at the end of its step; the next step issues S and
 * dP behind it and its first wait retires both, so S's latency overlaps dQ. That dQ reads its K
 * stage into the next step, so tiles are loaded one ahead (three stages: tile it + 1 into the
 * stage of tile it - 2), and a barrier after the loop keeps bq_store_dq, which writes through sQ,
 * behind every warp's bq_blk. */
#include "be_cuda.cuh"
#include "dflash_ptx.cuh"
#include "dflash_kernels.cuh"
#include "dflash_wgmma.cuh"
#include "attn_wgmma.h"

#include <type_traits>

#if defined(__CUDA_ARCH_FEAT_SM90_ALL)
#define DW_ON 1
#endif

#ifdef DW_ON
#include "wgmma_ptx.cuh"

/* The descriptor of k16 step kb of a tile of 64 rows (a chunk of Q or dO; pass Q: a K tile) as
 * the MN-major B operand of dV += P^T dO, dK += dS^T Q (pass Q: dQ += dS K): the 16 rows from
 * kb * 16, 8-row groups 1,024 bytes apart (stride), the two 64-column halves 64 * 128 bytes
 * apart (leading offset), 128-byte swizzle */
template <int ROWS = 64> __device__ __forceinline__ uint64_t dw_desc_mn(uint32_t tile, int kb)
{
    const uint32_t addr = tile + (uint32_t)kb * 16 * AW_ROWB;
    return (uint64_t)((addr & 0x3FFFFu) >> 4) | (uint64_t)((ROWS * AW_ROWB) >> 4) << 16 |
           (uint64_t)(MW_SBO >> 4) << 32 | (uint64_t)1 << 62;
}

/* the A fragments of the N / 2 k16 steps of an m64 x n(8 N) accumulator, as bf16 */
template <int N> __device__ __forceinline__ void dw_pack(uint32_t (&a)[N / 2][4], const float (&s)[N][4])
{
#pragma unroll
    for (int kb = 0; kb < N / 2; kb++) {
        a[kb][0] = df_pack(s[2 * kb][0], s[2 * kb][1]);
        a[kb][1] = df_pack(s[2 * kb][2], s[2 * kb][3]);
        a[kb][2] = df_pack(s[2 * kb + 1][0], s[2 * kb + 1][1]);
        a[kb][3] = df_pack(s[2 * kb + 1][2], s[2 * kb + 1][3]);
    }
}

/* d (m64 x n(8 N), N = 8 or 16) = A B^T over the head dimension: A a warp's 16 rows (Q or dO) as
 * registers (the mma.sync A fragments of its D / 16 k16 steps), B the K-major tile of 8 N rows
 * (K or V) at tile; issued, not committed */
template <int N>
__device__ __forceinline__ void dw_mma_rows(float (&d)[N][4], const uint32_t (&a)[DW_D / 16][4], uint32_t tile)
{
    static_assert(N == 8 || N == 16, "n64 or n128");
#pragma unroll
    for (int kk = 0; kk < DW_D / 16; kk++) {
        if constexpr (N == 8)
            wg_mma_rs_n64(d, a[kk], mw_desc(tile + aw_koff(64, kk)), kk > 0);
        else
            wg_mma_rs_n128(d, a[kk], mw_desc(tile + aw_koff(128, kk)), kk > 0);
    }
}

/* d (m64 x n128) += A B over 16 KB keys: A the KB k16 fragments of an m64 x n(16 KB) accumulator
 * packed by dw_pack (P, dS; pass KV: P^T, dS^T), B the tile of 16 KB rows at tile as the MN-major
 * operand; issued, not committed */
template <int KB>
__device__ __forceinline__ void dw_mma_keys(float (&d)[16][4], const uint32_t (&a)[KB][4], uint32_t tile)
{
#pragma unroll
    for (int kb = 0; kb < KB; kb++)
        wg_mma_rs_tb(d, a[kb], dw_desc_mn<16 * KB>(tile, kb));
}

/* K/V tile it of the CTA's list (tile_at, BN keys) into stage it % ST (or stage, where given) of
 * the rings at sK0, sV0 (BN * DW_D * 2 bytes a stage, swizzled), thread tid of DQW_THREADS taking
 * 16-byte chunk tid % 16 of rows tid / 16 + 16 i, rows past the tile's keys zero-filled; one
 * commit group (empty past the last tile) */
template <int ST, int MMAX, int BN = DQW_BN>
__device__ __forceinline__ void dw_load_kv(const QsMeta<MMAX> &mt, const DfP &p, int it, int b0, int g_kv,
                                           uint32_t sK0, uint32_t sV0, int tid, int stage = -1)
{
    if (it < mt.ntiles) {
        const DfTile t = tile_at<MMAX>(mt, p, it, b0, g_kv, BN);
        const uint32_t st = (uint32_t)(stage >= 0 ? stage : it % ST) * (BN * DW_D * 2);
#pragma unroll
        for (int i = 0; i < BN * 16 / DQW_THREADS; i++) {
            const int r = tid / 16 + 16 * i, ch = tid % 16;
            const bool ok = r < t.nvalid;
            const int64_t off = ok ? (int64_t)r * p.ldk + ch * 8 : 0;
            df_cp16(sK0 + st + aw_off(BN, (uint32_t)r, (uint32_t)ch), t.k + off, ok);
            df_cp16(sV0 + st + aw_off(BN, (uint32_t)r, (uint32_t)ch), t.v + off, ok);
        }
    }
    df_commit();
}


/* dS kept (pass Q): the context key tiles of a CTA are the global DW_BN-key tiles (counted over
 * the whole context, so that each is half of one of pass KV's DF_DS_KEYS tiles) from segment s's
 * first (seg_t0, made by dw_ds_setup) on; returns the global tile of the CTA's tile it (< the
 * context tiles) and its segment */
template <int MMAX>
__device__ __forceinline__ int dw_ds_tile(const QsMeta<MMAX> &mt, int it, int *seg)
{
    *seg = tile_seg<MMAX>(mt, it);
    return mt.seg_t0[*seg] + it;
}

/* dS kept: the CTA's context tiles in global units of BN keys: segment s from the tile of its
 * blocks' first visible key to the one of their last context key (none where no block of it
 * sees context); one thread, then a block barrier */
template <int MMAX>
__device__ __forceinline__ void dw_ds_setup(QsMeta<MMAX> &mt, const DfP &p, int BN)
{
    if (threadIdx.x == 0) {
        int nt = 0;
        for (int s = 0; s < mt.nseg; s++) {
            int lomin = mt.seg_amax[s];
            for (int i = 0; i < mt.nb; i++)
                if (mt.blk_seg[i] == s && mt.blk_an[i] > 0)
                    lomin = min(lomin, df_ctx_lo(p.window, mt.blk_an[i], 0));
            const int u0 = (mt.seg_cs[s] + lomin) / BN, u1 = (mt.seg_cs[s] + mt.seg_amax[s] + BN - 1) / BN;
            mt.seg_t0[s] = u0;
            mt.seg_nt[s] = mt.seg_amax[s] > 0 && u1 > u0 ? u1 - u0 : 0;
            nt += mt.seg_nt[s];
        }
        mt.ntiles = nt + (mt.nb * p.bs + BN - 1) / BN;
    }
    __syncthreads();
}

/* dS kept, pass Q's context tile it (< the context tiles) into the stage whose K tile is at sk
 * and dS part at sd (16 KB each): its K rows (those of its segment; the others zero-filled) and
 * the dS^T halves of the CTA's two blocks (8 KB each, block lb at sd + lb * 8 KB: zeros where the
 * block has no slot for the tile). One commit group. */
template <int MMAX, int BN = DQW_BN>
__device__ __forceinline__ void dw_load_kv_ds(const QsMeta<MMAX> &mt, const DfP &p, int it, int g_kv,
                                              const int4 *blk, uint32_t sk, uint32_t sd, int tid)
{
    static_assert(DF_DS_KEYS == 2 * BN && DW_QC * BN * 2 == 8192, "a tile is half of pass KV's, 8 KB a block");
    int s;
    const int u = dw_ds_tile<MMAX>(mt, it, &s);
    const int64_t key0 = (int64_t)u * BN, lo = mt.seg_cs[s], hi = lo + mt.seg_amax[s];
    const bf16 *kg = (const bf16 *)p.kc + (int64_t)g_kv * DW_D;
#pragma unroll
    for (int i = 0; i < BN * 16 / DQW_THREADS; i++) {
        const int r = tid / 16 + 16 * i, ch = tid % 16;
        const bool ok = key0 + r >= lo && key0 + r < hi;
        df_cp16(sk + aw_off(BN, (uint32_t)r, (uint32_t)ch), kg + (ok ? (key0 + r) * p.ldk + ch * 8 : 0), ok);
    }
    const int kt = u / 2;
#pragma unroll
    for (int i = 0; i < 2 * 512 / DQW_THREADS; i++) {
        const int c = tid + DQW_THREADS * i, lb = c / 512, ch = c % 512;
        const int4 e = blk[lb];   /* shared memory */
        const int64_t slot = (int64_t)e.x + kt;
        const bool ok = lb < mt.nb && kt >= e.y && kt < e.z && slot < p.ds_cap;
        const bf16 *src = (const bf16 *)p.ds + (ok ? (slot * p.nkv + g_kv) * (DF_DS_KEYS * DW_QC) + (u & 1) * (BN * DW_QC) + ch * 8 : 0);
        df_cp16(sd + (uint32_t)(lb * 8192 + ch * 16), src, ok);
    }
    df_commit();
}
#endif

/* kernel NAME of THREADS threads running the body; built without sm_90a it traps
 * (dflash_attn.cu launches these only on compute capability 9) */
#ifdef DW_ON
#define DW_KERNEL(NAME, THREADS, ...) \
    __global__ void __launch_bounds__(THREADS, 1) NAME(const DfP p) { __VA_ARGS__; }
#else
#define DW_KERNEL(NAME, THREADS, ...) \
    __global__ void __launch_bounds__(THREADS, 1) NAME(const DfP p) { __trap(); }
#endif

#ifdef DW_ON
template <bool OVL, bool DSG = false> __device__ __forceinline__ void dw_bwd_kv(const DfP &p)
{
    constexpr int QC = DW_QC, MS = 3, BNK = DW_BNK, D = DW_D, NST = OVL ? 3 : 2;
    DF_DYN_SMEM(smem);
    __shared__ KvRows<MS, QC> rt;
    __shared__ __align__(16) int raw[2][4][QC];   /* kv_fetch's raw stages */
    const uint32_t sbase = df_smem(smem), sK = (sbase + 1023u) & ~1023u, sV = sK + DW_TILEK;
    const uint32_t sQ0 = sV + DW_TILEK, sDO0 = sQ0 + NST * DW_TILEQ;   /* stage st: + st * DW_TILEQ */
    const KvSpan span = kv_span(p, BNK, QC);
    const int g_kv = span.g_kv, nch = span.nch;
    const int64_t c0 = span.c0, c1 = span.c1;
    const uint32_t tid = threadIdx.x, wg = tid / 128, warp = (tid % 128) / 32, lane = tid % 32;
    const int g = (int)(lane >> 2), t4 = (int)(lane & 3);

    /* K, V of the tile (rows past the end zero-filled): thread tid takes 16-byte chunk tid % 16
     * of rows tid / 16 + 16 i */
    {
        const bf16 *kg = (const bf16 *)p.kc + (int64_t)g_kv * D, *vg = (const bf16 *)p.vc + (int64_t)g_kv * D;
#pragma unroll
        for (int i = 0; i < BNK * 16 / DW_THREADS; i++) {
            const uint32_t r = tid / 16 + 16 * i, ch = tid % 16;
            const bool ok = c0 + r < c1;
            const int64_t off = ok ? (c0 + r) * p.ldk + ch * 8 : 0;
            df_cp16(sK + aw_off(BNK, r, ch), kg + off, ok);
            df_cp16(sV + aw_off(BNK, r, ch), vg + off, ok);
        }
    }
    /* Q and dO of the chunk whose row tables are in stage ms into stage st (rows that do not
     * see the tile: zeros) */
    auto load_chunk = [&](int st, int ms) {
        const bf16 *qg = (const bf16 *)p.q, *dg = (const bf16 *)p.dout;
#pragma unroll
        for (int i = 0; i < QC * 16 / DW_THREADS; i++) {
            const uint32_t r = tid / 16 + 16 * i, ch = tid % 16, o = (uint32_t)st * DW_TILEQ + aw_off(QC, r, ch);
            const long long off = rt.off[ms][r];
            const bool ok = off >= 0;
            df_cp16(sQ0 + o, ok ? qg + off + ch * 8 : qg, ok);
            df_cp16(sDO0 + o, ok ? dg + off + ch * 8 : dg, ok);
        }
    };
    auto raw_at = [&](int rs) { return reinterpret_cast<const unsigned char *>(&raw[rs][0][0]); };

    float dk[16][4], dv[16][4];
#pragma unroll
    for (int i = 0; i < 16; i++)
#pragma unroll
        for (int e = 0; e < 4; e++)
            dk[i][e] = dv[i][e] = 0.0f;
    wg_hold(dk);   /* zeroed here, not next to a wgmma in flight */
    wg_hold(dv);
    const uint32_t ka = sK + wg * 64 * AW_ROWB, va = sV + wg * 64 * AW_ROWB;   /* the warpgroup's keys */
    const int64_t key_r0 = c0 + 64 * wg + 16 * warp + g;   /* the thread's keys: key_r0, key_r0 + 8 */
    const float sl2 = p.sl2;

    float s[8][4], dp[8][4];
    uint32_t pa[4][4] = {}, da[4][4] = {};   /* P^T, dS^T: the A operands of dV, dK */
    /* S^T, dP^T of the chunk in Q / dO stage st (issued: two groups) */
    auto issue_sdp = [&](int st) {
        const uint32_t qst = sQ0 + (uint32_t)st * DW_TILEQ, dost = sDO0 + (uint32_t)st * DW_TILEQ;
        uint32_t kw = ka, vw = va;
        /* opaque: the 16 descriptors of K and V are made here, not kept in registers across chunks */
        asm volatile("" : "+r"(kw), "+r"(vw));
        wg_hold(s);
        wg_hold(dp);
        wg_fence();
#pragma unroll
        for (int kk = 0; kk < D / 16; kk++)
            wg_mma_ss_n64(s, mw_desc(kw + aw_koff(BNK, kk)), mw_desc(qst + aw_koff(QC, kk)), kk > 0);
        wg_commit();
#pragma unroll
        for (int kk = 0; kk < D / 16; kk++)
            wg_mma_ss_n64(dp, mw_desc(vw + aw_koff(BNK, kk)), mw_desc(dost + aw_koff(QC, kk)), kk > 0);
        wg_commit();
    };
    /* the rest of the chunk in stage st with row tables ms (full: no row needs the mask), S^T and
     * dP^T in flight as the last two groups: P^T, dV += P^T dO, dS^T, dK += dS^T Q (issued, the
     * last two groups; pa, da in use until they are done) */
    auto finish_chunk = [&](int st, int ms, bool full, int ci) {
        const uint32_t qst = sQ0 + (uint32_t)st * DW_TILEQ, dost = sDO0 + (uint32_t)st * DW_TILEQ;
        int4 dsb = make_int4(0, 0, 0, 0);   /* dS kept: the chunk's block (a chunk is a block) */
        if constexpr (DSG)
            dsb = p.ds_blk[span.rbeg / DW_QC + ci];
        wg_wait<1>();   /* S^T */
        wg_hold(s);
        /* Element e of n8 tile j: row 8 j + 2 (lane % 4) + (e & 1), key key_r0 + 8 (e >> 1). The
         * exponential is taken everywhere and the mask applied after it as a select (a row that
         * does not see the tile has l2 = inf: 0 either way), with each pair of rows' table words
         * read as one 8-byte word: written as a conditional exponential with a load per element,
         * this compiled to a branch per element, each waiting on its own shared-memory load */
#pragma unroll
        for (int j = 0; j < 8; j++) {
            const float2 l2 = *reinterpret_cast<const float2 *>(&rt.l2[ms][8 * j + 2 * t4]);
            s[j][0] = df_exp2(fmaf(s[j][0], sl2, -l2.x));
            s[j][1] = df_exp2(fmaf(s[j][1], sl2, -l2.y));
            s[j][2] = df_exp2(fmaf(s[j][2], sl2, -l2.x));
            s[j][3] = df_exp2(fmaf(s[j][3], sl2, -l2.y));
        }
        if (!full) {
            const int ka = (int)key_r0, kb = ka + 8;
#pragma unroll
            for (int j = 0; j < 8; j++) {
                const int2 lo = *reinterpret_cast<const int2 *>(&rt.lo[ms][8 * j + 2 * t4]);
                const int2 hi = *reinterpret_cast<const int2 *>(&rt.hi[ms][8 * j + 2 * t4]);
                s[j][0] = ka >= lo.x && ka < hi.x ? s[j][0] : 0.0f;
                s[j][1] = ka >= lo.y && ka < hi.y ? s[j][1] : 0.0f;
                s[j][2] = kb >= lo.x && kb < hi.x ? s[j][2] : 0.0f;
                s[j][3] = kb >= lo.y && kb < hi.y ? s[j][3] : 0.0f;
            }
        }
        dw_pack(pa, s);
        wg_hold_a(pa);
        wg_hold(dv);
        wg_fence();
        dw_mma_keys(dv, pa, dost);
        wg_commit();
        wg_wait<1>();   /* dP^T */
        wg_hold(dp);
#pragma unroll
        for (int j = 0; j < 8; j++) {
            const float2 dl = *reinterpret_cast<const float2 *>(&rt.dl[ms][8 * j + 2 * t4]);
            dp[j][0] = s[j][0] * (dp[j][0] - dl.x);
            dp[j][1] = s[j][1] * (dp[j][1] - dl.y);
            dp[j][2] = s[j][2] * (dp[j][2] - dl.x);
            dp[j][3] = s[j][3] * (dp[j][3] - dl.y);
        }
        dw_pack(da, dp);
        if constexpr (DSG) {
            /* dS^T of the chunk to its slot: 8 x 8 pieces (8 keys x 8 rows, row-major: the lane's
             * word at 4 lane) in the order (key group, row group), key group 8 wg + 2 warp + h;
             * da[kb][i] is row group 2 kb + (i >> 1), keys + 8 (i & 1) */
            const int kt = (int)(c0 / DW_BNK);
            const int64_t slot = (int64_t)dsb.x + kt;
            if (kt >= dsb.y && kt < dsb.z && slot < p.ds_cap) {
                uint32_t *dst = reinterpret_cast<uint32_t *>((bf16 *)p.ds + (slot * p.nkv + g_kv) * (DW_BNK * DW_QC)) +
                                (8 * wg + 2 * warp) * 8 * 32 + lane;
#pragma unroll
                for (int kb = 0; kb < 4; kb++)
#pragma unroll
                    for (int i = 0; i < 4; i++)
                        dst[((i & 1) * 8 + 2 * kb + (i >> 1)) * 32] = da[kb][i];
            }
        }
        wg_hold_a(da);
        wg_hold(dk);
        wg_fence();
        dw_mma_keys(dk, da, qst);
        wg_commit();
    };

    /* every wgmma of the chunk done: the accumulators and A operands are the thread's again */
    auto settle = [&] {
        wg_wait<0>();
        wg_hold(dv);
        wg_hold(dk);
        wg_hold_a(pa);
        wg_hold_a(da);
    };

    kv_fetch<QC>(p, span, 0, df_smem(&raw[0][0][0]), (int)tid);
    kv_fetch<QC>(p, span, 1, df_smem(&raw[1][0][0]), (int)tid);
    df_commit();
    df_wait<0>();
    bool full_cur = kv_finish<MS, QC>(rt, p, span, 0, raw_at(0), 0, (int)tid, nullptr);
    load_chunk(0, 0);
    if constexpr (!OVL) {
        /* chunk ci: its Q, dO in stage ci & 1, its row tables in stage ci % 3, its raw words in
         * raw stage ci & 1; iteration ci waits for chunk ci's Q / dO and chunk ci + 1's raw words
         * (one group), builds chunk ci + 1's tables (its barriers: everyone past chunk ci - 1, the
         * other Q / dO stage free), starts chunk ci + 1's Q / dO and chunk ci + 2's raw words,
         * computes chunk ci and waits for its wgmma */
        df_commit();
        for (int ci = 0; ci < nch; ci++) {
            df_wait<0>();
            wg_proxy_fence();   /* the cp.async writes, seen by wgmma (after the barriers below) */
            const bool full_next = kv_finish<MS, QC>(rt, p, span, ci + 1, raw_at((ci + 1) & 1), (ci + 1) % 3, (int)tid, nullptr);
            if (ci + 1 < nch)
                load_chunk((ci + 1) & 1, (ci + 1) % 3);
            kv_fetch<QC>(p, span, ci + 2, df_smem(&raw[ci & 1][0][0]), (int)tid);
            df_commit();
            issue_sdp(ci & 1);
            finish_chunk(ci & 1, ci % 3, full_cur, ci);
            settle();
            full_cur = full_next;
        }
    } else {
        /* chunk ci: its Q, dO and row tables in stage ci % 3, its raw words in raw stage ci & 1,
         * loaded two chunks ahead. Iteration ci issues chunk ci's wgmma, and while its dK runs
         * waits for chunk ci + 1's Q / dO and chunk ci + 2's raw words (one group), builds chunk
         * ci + 2's tables (its barriers: everyone past iteration ci - 1, whose wgmma are done, so
         * stage (ci + 2) % 3 is free), starts chunk ci + 2's Q / dO and chunk ci + 3's raw words,
         * then waits for its wgmma */
        kv_fetch<QC>(p, span, 2, df_smem(&raw[0][0][0]), (int)tid);
        df_commit();
        df_wait<0>();
        wg_proxy_fence();
        bool full_next = kv_finish<MS, QC>(rt, p, span, 1, raw_at(1), 1, (int)tid, nullptr);
        if (1 < nch)
            load_chunk(1, 1);
        kv_fetch<QC>(p, span, 3, df_smem(&raw[1][0][0]), (int)tid);
        df_commit();
        for (int ci = 0; ci < nch; ci++) {
            issue_sdp(ci % 3);
            finish_chunk(ci % 3, ci % 3, full_cur, ci);
            df_wait<0>();
            wg_proxy_fence();
            const bool full_next2 = kv_finish<MS, QC>(rt, p, span, ci + 2, raw_at(ci & 1), (ci + 2) % 3, (int)tid, nullptr);
            if (ci + 2 < nch)
                load_chunk((ci + 2) % 3, (ci + 2) % 3);
            kv_fetch<QC>(p, span, ci + 3, df_smem(&raw[(ci + 1) & 1][0][0]), (int)tid);
            df_commit();
            settle();
            full_cur = full_next;
            full_next = full_next2;
        }
    }
    settle();
    df_wait<0>();

    /* dK * scale and dV: the thread's keys key_r0 (+ 8), columns 8 j + 2 (lane % 4) (+ 1) */
    bf16 *dkg = (bf16 *)p.dkc + (int64_t)g_kv * D, *dvg = (bf16 *)p.dvc + (int64_t)g_kv * D;
#pragma unroll
    for (int hh = 0; hh < 2; hh++) {
        const int64_t row = key_r0 + 8 * hh;
        if (row < c1) {
#pragma unroll
            for (int j = 0; j < 16; j++) {
                const int64_t o = row * p.ldk + 8 * j + 2 * t4;
                *reinterpret_cast<uint32_t *>(dkg + o) = df_pack(dk[j][2 * hh] * p.scale, dk[j][2 * hh + 1] * p.scale);
                *reinterpret_cast<uint32_t *>(dvg + o) = df_pack(dv[j][2 * hh], dv[j][2 * hh + 1]);
            }
        }
    }
}
#endif

DW_KERNEL(df_bwd_kv_wg_kernel, DW_THREADS, dw_bwd_kv<false>(p))

DW_KERNEL(df_bwd_kv_wg_ovl_kernel, DW_THREADS, dw_bwd_kv<true>(p))

DW_KERNEL(df_bwd_kv_wg_ds_kernel, DW_THREADS, (dw_bwd_kv<true, true>(p)))

/* ------------------------------------------------------------------------------------------ */
/* pass Q */

#ifdef DW_ON
template <int ST, bool PIPE = false, bool MB = false, bool DSG = false> __device__ __forceinline__ void dw_bwd_q(const DfP &p)
{
    static_assert(!PIPE || ST == 3, "pipelined: three stages, tiles loaded one ahead");
    static_assert(!MB || PIPE, "mbarriers: the pipelined form");
    static_assert(!DSG || MB, "dS kept: the mbarrier form");
    constexpr int D = DW_D, BN = DQW_BN, NW = DQW_THREADS / 32, MMAX = DQW_MMAX, THREADS = DQW_THREADS;
    constexpr int ROWB = D * 2 + 16, ROWP = BN * 2 + 16, TILE = DQW_TILE, KD = D / 16, DT = D / 8;
    DF_DYN_SMEM(smem);
    __shared__ QsMeta<MMAX> mt;
    __shared__ float sLse2[MMAX], sDelta[MMAX];
    const uint32_t sbase = df_smem(smem), sK0 = (sbase + 1023u) & ~1023u, sV0 = sK0 + ST * TILE;
    const uint32_t sQ = sV0 + ST * TILE, sDO = sQ + MMAX * ROWB, sP = sDO + MMAX * ROWB, sDS = sP + MMAX * ROWP;
    unsigned char *pQ = smem + (sQ - sbase), *pDO = smem + (sDO - sbase);
    unsigned char *pP = smem + (sP - sbase), *pDS = smem + (sDS - sbase);
    const int g_kv = qs_kv(p), b0 = qs_b0(p);
    const int tid = threadIdx.x, warp = tid >> 5, lane = tid & 31;
    const int g = lane >> 2, t4 = lane & 3;
    const int wr0 = warp * 16;   /* the warp's rows (warpgroup warp / 4: rows 64 (warp / 4) ..) */

    /* MB: each K/V stage's two mbarriers (static shared memory): full (every thread's cp.async
     * of the tile, 256 arrivals) and empty (every warp, once the wgmma reading it are done) */
    /* dS kept: the context tiles' stages have their own (cfull, cempty: DQW_DS_CST of each) */
    constexpr int CST = DSG ? DQW_DS_CST : 1;
    __shared__ __align__(8) uint64_t bars[MB ? 2 * ST + (DSG ? 2 * CST : 0) : 1];
    const uint32_t full = df_smem(&bars[0]), empty = full + 8 * ST;
    const uint32_t cfull = empty + 8 * ST, cempty = cfull + 8 * CST;
    if (MB && tid == 0) {
        for (int st = 0; st < ST; st++) {
            wg_bar_init(full + 8 * st, THREADS);
            wg_bar_init(empty + 8 * st, NW);
        }
        if constexpr (DSG)
            for (int c = 0; c < CST; c++) {
                wg_bar_init(cfull + 8 * c, THREADS);
                wg_bar_init(cempty + 8 * c, NW);
            }
    }
    if constexpr (DSG)
        qs_setup<MMAX>(mt, p, b0, g_kv, BN);   /* a block barrier; Q and dO after the context tiles */
    else
        bq_setup<D, MMAX, THREADS>(mt, p, b0, g_kv, BN, sQ, sDO);   /* a block barrier */
    __shared__ int4 dsblk[DSG ? 2 : 1];   /* dS kept: the CTA's blocks' slots */
    if constexpr (DSG) {
        if (tid < 2)
            dsblk[tid] = tid < mt.nb ? p.ds_blk[b0 + tid] : make_int4(0, 0, 0, 0);
        dw_ds_setup<MMAX>(mt, p, BN);   /* a block barrier */
    }
    const int ntiles = mt.ntiles, nctx = ntiles - (mt.nb * p.bs + BN - 1) / BN;
    auto load_tile = [&](int it) {
        if constexpr (MB) {   /* into the stage of tile it - ST once every warp has handed it back */
            if (it >= ntiles)
                return;
            const int jt = DSG ? it - nctx : it;   /* dS kept: the block-key tiles count from 0 */
            const uint32_t st = (uint32_t)(jt % ST);
            wg_bar_wait(empty + 8 * st, ((uint32_t)(jt / ST) & 1) ^ 1);
            dw_load_kv<ST, MMAX>(mt, p, it, b0, g_kv, sK0, sV0, tid, (int)st);
            wg_bar_arrive_cp(full + 8 * st);
        } else {
            dw_load_kv<ST, MMAX>(mt, p, it, b0, g_kv, sK0, sV0, tid);
        }
    };
    /* dS kept: context tile it into its stage (it % CST: a K tile, then the dS of the CTA's
     * blocks) once every warp has handed back the tile that was there */
    auto load_ctx = [&](int it) {
        if (it >= nctx)
            return;
        const uint32_t c = (uint32_t)(it % CST), sk = sK0 + c * 2 * TILE;
        wg_bar_wait(cempty + 8 * c, ((uint32_t)(it / CST) & 1) ^ 1);
        dw_load_kv_ds<MMAX>(mt, p, it, g_kv, dsblk, sk, sk + TILE, tid);
        wg_bar_arrive_cp(cfull + 8 * c);
    };
    /* tiles in flight before a tile's step (dS kept: the block-key tiles two, each loaded once
     * its stage's dQ is done; the context tiles CST - 1) */
    constexpr int AHEAD = PIPE ? (DSG ? 2 : 1) : ST - 1;
    if constexpr (DSG) {
        for (int it = 0; it < CST - 1; it++)
            load_ctx(it);
    } else {
        for (int it = 0; it < AHEAD; it++)
            load_tile(it);
        df_wait<AHEAD>();   /* Q and dO */
        __syncthreads();
    }

    bq_delta<D, MMAX, DSG>(mt, p, pDO, wr0, lane, sLse2, sDelta);
    __syncwarp();
    int rlb[1][2], rj[1][2], lo[1][2], hi[1][2];
    float lse2[2], dlt[2];
    bq_rows<MMAX>(mt, p, wr0 + g, sLse2, sDelta, rlb, rj, lse2, dlt);
    int cur_seg = -2;
    const float sl2 = p.sl2;

    /* the warp's Q and dO rows as the A operands of S = Q K^T and dP = dO V^T (registers) */
    uint32_t qf[KD][4], dof[KD][4];
    auto load_rows_a = [&] {
#pragma unroll
        for (int kk = 0; kk < KD; kk++) {
            df_ldm(qf[kk], sQ + wr0 * ROWB + lane_a(lane, ROWB) + kk * 32);
            df_ldm(dof[kk], sDO + wr0 * ROWB + lane_a(lane, ROWB) + kk * 32);
        }
    };
    if constexpr (!DSG)
        load_rows_a();
    float dq[DT][4];
#pragma unroll
    for (int dt = 0; dt < DT; dt++)
#pragma unroll
        for (int e = 0; e < 4; e++)
            dq[dt][e] = 0.0f;
    wg_hold(dq);
    uint32_t da[4][4] = {};   /* dS: the A operand of dQ += dS K (pipelined: in use into the next step) */
    /* dQ's wgmma done: dq and da are the thread's again */
    auto settle = [&] {
        wg_wait<0>();
        wg_hold(dq);
        wg_hold_a(da);
    };

    if constexpr (DSG) {
        /* dS kept, the context tiles: dQ += dS K with dS^T from pass KV (after the K tile in its
         * stage: the warpgroup's block at 8 KB wg), transposed into the A fragments by ldmatrix:
         * piece (key group 2 kb + (i >> 1), row group 2 (warp % 4) + (i & 1)) for fragment i of
         * k16 step kb. Two A buffers (da, da2, tiles alternating), so that a tile's product is
         * issued while the previous one runs: after issuing tile it, waiting for tile it - 1's
         * product frees its stage (handed back) and its buffer; tile it + CST - 1 is then loaded
         * into that stage (CST - 1 tiles in flight: the reads of dS are latency-bound). */
        uint32_t da2[4][4] = {};
        const uint32_t dsa = (uint32_t)(warp >> 2) * 8192u +
                             (uint32_t)((lane >> 4) * 8 + 2 * (warp & 3) + ((lane >> 3) & 1)) * 128u +
                             (uint32_t)(lane & 7) * 16u;
        auto ctx_tile = [&](int it, uint32_t (&a)[4][4], uint32_t (&prev)[4][4]) {
            const uint32_t c = (uint32_t)(it % CST), sk = sK0 + c * 2 * TILE;
            wg_bar_wait(cfull + 8 * c, (uint32_t)(it / CST) & 1);
            wg_proxy_fence();
            __syncwarp();
#pragma unroll
            for (int kb = 0; kb < 4; kb++)
                df_ldm_t(a[kb], sk + TILE + dsa + (uint32_t)kb * 2048u);
            wg_hold_a(a);
            wg_hold(dq);
            wg_fence();
            dw_mma_keys(dq, a, sk);
            wg_commit();
            wg_wait<1>();   /* tile it - 1's product */
            wg_hold(dq);
            wg_hold_a(prev);
            if (it > 0)
                wg_bar_arrive_warp(cempty + 8 * (uint32_t)((it - 1) % CST), lane);
            load_ctx(it + CST - 1);   /* into the stage of tile it - 1, once every warp has handed it back */
        };
        int it = 0;
        for (; it + 1 < nctx; it += 2) {
            ctx_tile(it, da, da2);
            ctx_tile(it + 1, da2, da);
        }
        if (it < nctx)
            ctx_tile(it, da, da2);
        /* every warp's products done: the block-key tiles' stages, Q and dO take the shared
         * memory of the context stages */
        wg_wait<0>();
        wg_hold(dq);
        wg_hold_a(da);
        wg_hold_a(da2);
        __syncthreads();
        load_tile(nctx);
        load_tile(nctx + 1);
        bq_load_qdo<D, MMAX, THREADS>(mt, p, sQ, sDO);
        df_wait<0>();   /* Q and dO (and the tiles, needed next) */
        __syncthreads();
    }
    for (int it = DSG ? nctx : 0; it < ntiles; it++) {
        const int jt = DSG ? it - nctx : it;   /* the stages' count (dS kept: from the block-key tiles) */
        const uint32_t st = (uint32_t)(jt % ST) * TILE, kst = sK0 + st, vst = sV0 + st;
        const DfTile t = tile_at<MMAX>(mt, p, it, b0, g_kv, BN);
        if constexpr (!PIPE) {
            /* the stage of tile it + ST - 1 was last read in iteration it - 1 (barrier at its end) */
            load_tile(it + ST - 1);
            df_wait<ST - 1>();   /* tile it */
            wg_proxy_fence();
            __syncthreads();
        } else if constexpr (!MB) {
            /* Pipelined: dQ += dS K of tile it - 1 may still run (it reads that tile's stage), so
             * tile it + 1 goes to the stage of tile it - 2, whose dQ every thread waited for in
             * step it - 1 (before this barrier) */
            df_wait<0>();   /* tile it */
            wg_proxy_fence();
            __syncthreads();
            load_tile(it + 1);
        } else {
            /* mbarriers: tile it has landed (every thread's part); tile it + 1 goes to the stage
             * of tile it - 2 once every warp has handed that back (in its step it - 1): no block
             * barrier, so the warpgroups drift apart by up to a step */
            wg_bar_wait(full + 8 * (uint32_t)(jt % ST), (uint32_t)(jt / ST) & 1);
            wg_proxy_fence();
            __syncwarp();
            if constexpr (!DSG)   /* dS kept: tiles are loaded two ahead, below */
                load_tile(it + 1);
        }
        const bool need_mask = tile_phase<MMAX, 1>(mt, p, t, BN, cur_seg, rlb, rj, lo, hi);
        const int key0 = t.key0;
        const bool blk = t.seg < 0;
        /* every warpgroup runs every tile's wgmma (rows without keys in it: P = 0) */
        float s[8][4], dp[8][4];
        if constexpr (DSG)   /* dS kept: only the block-key tiles need them, loaded each (short lives); */
            load_rows_a();   /* before the fence, as registers a wgmma reads must be */
        wg_hold(s);
        wg_hold(dp);
        wg_fence();
        dw_mma_rows(s, qf, kst);
        wg_commit();
        dw_mma_rows(dp, dof, vst);
        wg_commit();
        wg_wait<1>();   /* S (pipelined: and dQ of tile it - 1) */
        wg_hold(s);
        if constexpr (PIPE) {
            wg_hold(dq);
            wg_hold_a(da);
        }
        if constexpr (MB)
            if (jt > 0)
                wg_bar_arrive_warp(empty + 8 * (uint32_t)((jt - 1) % ST), lane);   /* its dP and dQ are done */
        if constexpr (DSG)
            load_tile(it + 2);
        /* P = exp(S - lse), the mask applied after the exponential as a select (as pass KV's) */
#pragma unroll
        for (int nt = 0; nt < 8; nt++)
#pragma unroll
            for (int e = 0; e < 4; e++)
                s[nt][e] = df_exp2(fmaf(s[nt][e], sl2, -lse2[e >> 1]));
        if (need_mask) {
#pragma unroll
            for (int nt = 0; nt < 8; nt++)
#pragma unroll
                for (int e = 0; e < 4; e++) {
                    const int hh = e >> 1, kj = key0 + nt * 8 + 2 * t4 + (e & 1);
                    s[nt][e] = kj >= lo[0][hh] && kj < hi[0][hh] ? s[nt][e] : 0.0f;
                }
        }
        wg_wait<0>();
        wg_hold(dp);
        /* dS = P (dP - delta) */
#pragma unroll
        for (int nt = 0; nt < 8; nt++)
#pragma unroll
            for (int e = 0; e < 4; e++)
                dp[nt][e] = s[nt][e] * (dp[nt][e] - dlt[e >> 1]);
        if (blk) {
            if constexpr (MB)
                __syncthreads();   /* every warp's bq_blk of the last block-key tile is done with sP, sDS */
            bq_put_pds<8>(pP, pDS, ROWP, wr0, lane, s, dp);
        }
        /* dQ += dS K (K the MN-major B operand), on the tensor cores while a block-key tile's
         * dV_blk, dK_blk are computed */
        dw_pack(da, dp);
        wg_hold_a(da);
        wg_hold(dq);
        wg_fence();
        dw_mma_keys(dq, da, kst);
        wg_commit();
        if (blk) {
            __syncthreads();
            bq_blk<D, BN, NW, MMAX>(mt, p, b0, g_kv, key0, sP, sDS, sQ, sDO, warp, lane);
        }
        if constexpr (!PIPE) {
            settle();
            __syncthreads();   /* the stage is refilled next iteration */
        }
        /* pipelined: dQ runs on into the next step, whose S and dP are issued behind it (P and
         * dS are written to sP, sDS next after that step's barrier, past this step's bq_blk) */
    }
    if constexpr (PIPE) {
        settle();
        __syncthreads();   /* every warp's bq_blk is done with sQ, which bq_store_dq writes */
    }
    bq_store_dq<D, MMAX>(mt, p, pQ, wr0, lane, dq);
}
#endif

DW_KERNEL(df_bwd_q_wg_kernel, DQW_THREADS, dw_bwd_q<2>(p))

DW_KERNEL(df_bwd_q_wg3_kernel, DQW_THREADS, dw_bwd_q<3>(p))

DW_KERNEL(df_bwd_q_wg3p_kernel, DQW_THREADS, (dw_bwd_q<3, true>(p)))

DW_KERNEL(df_bwd_q_wg3m_kernel, DQW_THREADS, (dw_bwd_q<3, true, true>(p)))

DW_KERNEL(df_bwd_q_wg_ds_kernel, DQW_THREADS, (dw_bwd_q<3, true, true, true>(p)))

/* ------------------------------------------------------------------------------------------ */
/* forward */

#ifdef DW_ON
/* The forward on the CTAs of pass Q (DQW_MMAX rows, whole blocks; qs_setup, the same key tiles
 * through tile_at): warpgroup w the rows [64 w, 64 w + 64), a warp's Q rows loaded once from
 * shared memory (padded rows, as df_fwd_kernel) into registers as wgmma A fragments. Key tiles of
 * BN = 64 or 128 rows of K and V stream through a ring of ST stages (swizzled as pass Q's). Per
 * tile: S = Q K^T on wgmma m64n64k16 or m64n128k16 (A from registers, K K-major), the mask and the online
 * softmax of df_fwd_kernel on the accumulators (fwd_mask, flash_tile.cuh), P rounded to bf16 in
 * registers as the A operand of O += P V (wgmma m64n128k16, V MN-major). O and lse are written as
 * df_fwd_kernel's (fwd_store, through the warp's own Q rows). Every warpgroup runs every wgmma of
 * every tile (rows without keys in it: P = 0, O and the row sum unchanged).
 * Schedules: plain (S, softmax, P V one after the other, ST - 1 tiles loading meanwhile) and
 * overlapped (OVL, ST >= 3): the P V of tile it - 1 runs on the tensor cores while the softmax of
 * tile it runs (O rescaled once that P V is done, as attn_wgmma.cu's overlapped schedule); tile
 * it + ST - 2 is loaded from the start of step it into the stage of tile it - 2, whose P V was
 * waited on in step it - 1 (the barrier at the start of step it). With BN = 128, Q's rows lie in
 * the last V stage (DFW_SMEM): tile ST - 1 is first loaded there after a barrier that follows
 * every warp's Q loads (overlapped: step 1's; plain: one more), and the O store through them
 * waits for a barrier after every warpgroup's last P V. */
template <int ST, bool OVL, int BN> __device__ __forceinline__ void dw_fwd(const DfP &p)
{
    constexpr int D = DW_D, MMAX = DQW_MMAX, THREADS = DQW_THREADS;
    constexpr int ROWB = D * 2 + 16, TILE = DFW_TILE(BN), KD = D / 16, NT = BN / 8;
    constexpr int AHEAD = OVL ? ST - 2 : ST - 1;   /* tiles loaded before the first step */
    constexpr bool QALIAS = DFW_QALIAS(BN);        /* Q in the last V stage (see DFW_SMEM) */
    static_assert((BN == 64 || BN == 128) && ST >= 2 && (!OVL || ST >= 3), "dw_fwd shape");
    DF_DYN_SMEM(smem);
    __shared__ QsMeta<MMAX> mt;
    const uint32_t sbase = df_smem(smem), sK0 = (sbase + 1023u) & ~1023u, sV0 = sK0 + ST * TILE;
    const uint32_t sQ = sV0 + (QALIAS ? ST - 1 : ST) * TILE;
    const int g_kv = qs_kv(p), b0 = qs_b0(p);
    const int tid = threadIdx.x, warp = tid >> 5, lane = tid & 31;
    const int g = lane >> 2, t4 = lane & 3;
    const int wr0 = warp * 16;   /* the warp's rows (warpgroup warp / 4: rows 64 (warp / 4) ..) */

    qs_setup<MMAX>(mt, p, b0, g_kv, BN);
    load_rows<D, MMAX, THREADS>(mt, (const bf16 *)p.q, sQ);
    df_commit();
    const int ntiles = mt.ntiles;
    for (int it = 0; it < AHEAD; it++)
        dw_load_kv<ST, MMAX, BN>(mt, p, it, b0, g_kv, sK0, sV0, tid);
    df_wait<AHEAD>();   /* Q */
    __syncthreads();
    uint32_t qf[KD][4];
#pragma unroll
    for (int kk = 0; kk < KD; kk++)
        df_ldm(qf[kk], sQ + wr0 * ROWB + lane_a(lane, ROWB) + kk * 32);
    if (QALIAS && !OVL)
        __syncthreads();   /* everyone has Q before step 0 loads tile ST - 1 over it */

    int rlb[1][2], rj[1][2], lo[1][2], hi[1][2];
    qs_rows<MMAX, 1>(mt, p, wr0 + g, rlb, rj);
    int cur_seg = -2;
    const float sl2 = p.sl2;
    float o[1][16][4], s[1][NT][4], mrow[1][2], lrow[1][2], alpha[1][2];
    uint32_t pa[NT / 2][4] = {};   /* P of a key tile: the A fragments of its k16 steps */
    ft_init(o, mrow, lrow);
    wg_hold(o[0]);   /* zeroed here, not next to a wgmma in flight */

    /* S of tile t, masked, to P (its mask ranges first where its phase changes) */
    auto softmax = [&](const DfTile &t) {
        if (tile_phase<MMAX, 1>(mt, p, t, BN, cur_seg, rlb, rj, lo, hi))
            fwd_mask(s, t.key0, t4, lo, hi);
        ft_softmax_p(s, mrow, lrow, alpha, sl2);
    };
    /* O += P V of the V tile in stage st, waited for */
    auto pv_now = [&](uint32_t st) {
        wg_hold(o[0]);
        wg_hold_a(pa);
        wg_fence();
        dw_mma_keys(o[0], pa, sV0 + st);
        wg_commit();
        wg_wait<0>();
        wg_hold(o[0]);
        wg_hold_a(pa);
    };
    if constexpr (!OVL) {
        for (int it = 0; it < ntiles; it++) {
            const uint32_t st = (uint32_t)(it % ST) * TILE;
            const DfTile t = tile_at<MMAX>(mt, p, it, b0, g_kv, BN);
            /* the stage of tile it + ST - 1 was last read in step it - 1 (barrier at its end) */
            dw_load_kv<ST, MMAX, BN>(mt, p, it + ST - 1, b0, g_kv, sK0, sV0, tid);
            df_wait<ST - 1>();   /* tile it */
            wg_proxy_fence();
            __syncthreads();
            wg_hold(s[0]);
            wg_fence();
            dw_mma_rows(s[0], qf, sK0 + st);
            wg_commit();
            wg_wait<0>();
            wg_hold(s[0]);
            softmax(t);
            ft_rescale_o(o, alpha);
            dw_pack(pa, s[0]);
            pv_now(st);
            __syncthreads();   /* the stage is refilled next step */
        }
    } else {
        /* step it (PV: whether there is a tile it - 1, known at compile time: a wgmma under a
         * branch is fenced by ptxas) */
        auto step = [&](int it, auto PV) {
            const uint32_t st = (uint32_t)(it % ST) * TILE, pst = (uint32_t)((it + ST - 1) % ST) * TILE;
            const DfTile t = tile_at<MMAX>(mt, p, it, b0, g_kv, BN);
            df_wait<ST - 3>();   /* tile it */
            wg_proxy_fence();
            __syncthreads();   /* everyone past step it - 1: the P V of tile it - 2 is done */
            dw_load_kv<ST, MMAX, BN>(mt, p, it + ST - 2, b0, g_kv, sK0, sV0, tid);
            wg_hold(s[0]);
            wg_hold(o[0]);
            wg_hold_a(pa);
            wg_fence();
            dw_mma_rows(s[0], qf, sK0 + st);
            wg_commit();
            if constexpr (decltype(PV)::value)
                dw_mma_keys(o[0], pa, sV0 + pst);   /* tile it - 1 */
            wg_commit();
            wg_wait<1>();   /* S */
            wg_hold(s[0]);
            softmax(t);
            wg_wait<0>();   /* P V of tile it - 1 */
            wg_hold(o[0]);
            wg_hold_a(pa);
            ft_rescale_o(o, alpha);
            dw_pack(pa, s[0]);
        };
        step(0, std::false_type());
        for (int it = 1; it < ntiles; it++)
            step(it, std::true_type());
        pv_now((uint32_t)((ntiles - 1) % ST) * TILE);   /* the last tile */
    }
    df_wait<0>();
    if (QALIAS)
        __syncthreads();   /* every warpgroup's P V is done with the V stages */
    fwd_store<D, MMAX, 1>(mt, p, smem + (sQ - sbase), wr0, lane, o, mrow, lrow);
}
#endif

#ifdef DW_ON
/* The forward, warp-specialized (df_fwd_ws_kernel): dw_fwd's CTAs, tiles and overlapped schedule
 * (BN = 64, the P V of tile it - 1 under the softmax of tile it), with a third warpgroup that
 * only loads (setmaxnreg DFWS_LREGS; the multiplying two DFWS_MREGS): Q once, then K and V of
 * each key tile into rings of DFWS_ST stages (Q has its own rows, so nothing aliases). Every
 * loading thread's cp.async arrive on the stage's mbarrier (qfull, kfull, vfull); a multiplying
 * warp hands a K stage back once its S is done and a V stage once its P V is (kempty, vempty: one
 * arrival a warp), and the loads of a stage wait for that. No block barrier after the start: the
 * two multiplying warpgroups drift apart, one's softmax under the other's wgmma. The products,
 * masks and roundings are dw_fwd's, step for step (df_fwd_wg_ovl3_kernel's operations in its order). */
static_assert(DFWS_SMEM + sizeof(QsMeta<DQW_MMAX>) <= 227 * 1024, "df_fwd_ws_kernel's shared memory");
static_assert(128 * DFWS_LREGS + 256 * DFWS_MREGS <= 65536, "setmaxnreg budgets: the register file");

__device__ __forceinline__ void dw_fwd_ws(const DfP &p)
{
    constexpr int D = DW_D, MMAX = DQW_MMAX, BN = 64, ST = DFWS_ST, TILE = DFW_TILE(BN);
    constexpr int KD = D / 16, NT = BN / 8;
    DF_DYN_SMEM(smem);
    __shared__ QsMeta<MMAX> mt;
    const uint32_t sbase = df_smem(smem), sK0 = (sbase + 1023u) & ~1023u, sV0 = sK0 + ST * TILE;
    const uint32_t sQ = sV0 + ST * TILE, qfull = sQ + DFW_QBYTES, kfull = qfull + 8;
    const uint32_t kempty = kfull + 8 * ST, vfull = kempty + 8 * ST, vempty = vfull + 8 * ST;
    const int g_kv = qs_kv(p), b0 = qs_b0(p);
    const int tid = threadIdx.x, warp = tid >> 5, lane = tid & 31;
    if (tid == 0) {
        wg_bar_init(qfull, 128);   /* every loading thread's cp.async */
        for (int st = 0; st < ST; st++) {
            wg_bar_init(kfull + 8 * st, 128);
            wg_bar_init(kempty + 8 * st, 8);   /* every multiplying warp */
            wg_bar_init(vfull + 8 * st, 128);
            wg_bar_init(vempty + 8 * st, 8);
        }
    }
    qs_setup<MMAX>(mt, p, b0, g_kv, BN);   /* ends with a block barrier */
    const int ntiles = mt.ntiles;
    if (tid >= 256) {   /* the loading warpgroup */
        wg_regs_dec<DFWS_LREGS>();
        const int lt = tid - 256, ch = lt % 16;
        load_rows<D, MMAX, 128>(mt, (const bf16 *)p.q, sQ, lt);
        wg_bar_arrive_cp(qfull);
        for (int it = 0; it < ntiles; it++) {
            const DfTile t = tile_at<MMAX>(mt, p, it, b0, g_kv, BN);
            const uint32_t st = (uint32_t)(it % ST), par = ((uint32_t)(it / ST) & 1) ^ 1;   /* round 0: at once */
            for (int kv = 0; kv < 2; kv++) {
                const bf16 *src = kv ? t.v : t.k;
                const uint32_t dst = (kv ? sV0 : sK0) + st * TILE;
                wg_bar_wait((kv ? vempty : kempty) + 8 * st, par);
#pragma unroll
                for (int i = 0; i < BN * 16 / 128; i++) {
                    const int r = lt / 16 + 8 * i;
                    const bool ok = r < t.nvalid;
                    df_cp16(dst + aw_off(BN, (uint32_t)r, (uint32_t)ch), src + (ok ? (int64_t)r * p.ldk + ch * 8 : 0), ok);
                }
                wg_bar_arrive_cp((kv ? vfull : kfull) + 8 * st);
            }
        }
        df_wait<0>();
        return;
    }
    wg_regs_inc<DFWS_MREGS>();
    const int t4 = lane & 3, g = lane >> 2;
    const int wr0 = warp * 16;   /* the warp's rows (warpgroup warp / 4: rows 64 (warp / 4) ..) */
    wg_bar_wait(qfull, 0);
    uint32_t qf[KD][4];
#pragma unroll
    for (int kk = 0; kk < KD; kk++)
        df_ldm(qf[kk], sQ + wr0 * (D * 2 + 16) + lane_a(lane, D * 2 + 16) + kk * 32);
    int rlb[1][2], rj[1][2], lo[1][2], hi[1][2];
    qs_rows<MMAX, 1>(mt, p, wr0 + g, rlb, rj);
    int cur_seg = -2;
    const float sl2 = p.sl2;
    float o[1][16][4], s[1][NT][4], mrow[1][2], lrow[1][2], alpha[1][2];
    uint32_t pa[NT / 2][4] = {};
    ft_init(o, mrow, lrow);
    wg_hold(o[0]);
    auto step = [&](int it, auto PV) {
        const uint32_t st = (uint32_t)(it % ST), pst = (uint32_t)((it + ST - 1) % ST);
        const DfTile t = tile_at<MMAX>(mt, p, it, b0, g_kv, BN);
        wg_bar_wait(kfull + 8 * st, (uint32_t)(it / ST) & 1);
        if constexpr (decltype(PV)::value)
            wg_bar_wait(vfull + 8 * pst, (uint32_t)((it - 1) / ST) & 1);
        __syncwarp();
        wg_hold(s[0]);
        wg_hold(o[0]);
        wg_hold_a(pa);
        wg_fence();
        dw_mma_rows(s[0], qf, sK0 + st * TILE);
        wg_commit();
        if constexpr (decltype(PV)::value)
            dw_mma_keys(o[0], pa, sV0 + pst * TILE);   /* tile it - 1 */
        wg_commit();
        wg_wait<1>();   /* S: its K stage goes back */
        wg_hold(s[0]);
        wg_bar_arrive_warp(kempty + 8 * st, lane);
        if (tile_phase<MMAX, 1>(mt, p, t, BN, cur_seg, rlb, rj, lo, hi))
            fwd_mask(s, t.key0, t4, lo, hi);
        ft_softmax_p(s, mrow, lrow, alpha, sl2);
        wg_wait<0>();   /* P V of tile it - 1: its V stage goes back */
        wg_hold(o[0]);
        wg_hold_a(pa);
        if constexpr (decltype(PV)::value)
            wg_bar_arrive_warp(vempty + 8 * pst, lane);
        ft_rescale_o(o, alpha);
        dw_pack(pa, s[0]);
    };
    step(0, std::false_type());
    for (int it = 1; it < ntiles; it++)
        step(it, std::true_type());
    {   /* the last tile's P V */
        const uint32_t lst = (uint32_t)((ntiles - 1) % ST);
        wg_bar_wait(vfull + 8 * lst, (uint32_t)((ntiles - 1) / ST) & 1);
        __syncwarp();
        wg_hold(o[0]);
        wg_hold_a(pa);
        wg_fence();
        dw_mma_keys(o[0], pa, sV0 + lst * TILE);
        wg_commit();
        wg_wait<0>();
        wg_hold(o[0]);
        wg_hold_a(pa);
    }
    /* through the warp's own Q rows (only this warp read them, into qf) */
    fwd_store<D, MMAX, 1>(mt, p, smem + (sQ - sbase), wr0, lane, o, mrow, lrow);
}
#endif

DW_KERNEL(df_fwd_ws_kernel, DFWS_THREADS, dw_fwd_ws(p))

DW_KERNEL(df_fwd_wg_kernel, DQW_THREADS, dw_fwd<3, false, 64>(p))

DW_KERNEL(df_fwd_wg_ovl3_kernel, DQW_THREADS, dw_fwd<3, true, 64>(p))

DW_KERNEL(df_fwd_wg_ovl4_kernel, DQW_THREADS, dw_fwd<4, true, 64>(p))

DW_KERNEL(df_fwd_wg128_ovl3_kernel, DQW_THREADS, dw_fwd<3, true, 128>(p))

