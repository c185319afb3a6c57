/* attn_wgmma.cu: the target's causal attention forward (kernels/attn.cu's contract: varlen
 * packed sequences through cu offsets, GQA, bf16 in and out, f32 softmax in base 2) for head
 * dimension 128 on Hopper's wgmma (sm_90a: the Makefile compiles this file for sm_90a alone).
 *
 * A block of two warpgroups (256 threads) takes AW_BM = 128 query rows of one (sequence, head),
 * warpgroup w the rows [64 w, 64 w + 64). Q stays in shared memory for the whole block; key and
 * value tiles of AW_BN = 128 rows stream through two stages (cp.async, every thread loading).
 * Every shared tile is two 64-column halves of rows of 128 bytes in the 128-byte swizzle of
 * moe_wgmma.h (attn_wgmma.h has the arithmetic). S = Q K^T: wgmma m64n128k16 with both operands
 * from shared memory (K-major), eight k16 steps. The online softmax runs on the accumulators
 * (kernels/flash_tile.cuh's steps: a warp's share of the m64 accumulator is laid out as an
 * mma.sync m16 tile), P is rounded to bf16 in registers and is the A operand of O += P V, wgmma
 * m64n128k16 with A from registers and V from shared memory in the transposed-B (MN-major)
 * form, eight k16 steps. The score matrix never leaves registers.
 *
 * Schedules (AW_OVL): plain: S, softmax, P V, one after the other, loads of the next tile in
 * flight meanwhile. Overlapped: the P V of tile j - 1 runs on the tensor cores while the
 * softmax of tile j runs on the other units (O is rescaled once that P V is done); K of tile
 * j + 1 is loaded from the start of step j, V of tile j + 1 once the P V of tile j - 1 has
 * released its stage.
 *
 * Causal: only key tiles up to the diagonal are visited (AW_BN == AW_BM, so a warpgroup's rows
 * always have keys in every visited tile); the mask is applied on tiles that cross a warpgroup's
 * diagonal. Every warpgroup runs every wgmma of the block's tiles (a wgmma on a path that ptxas
 * cannot prove uniform is serialized), masked P being zeros. Rows past the sequence end read
 * zeros and are not stored; keys past it read zeros and are masked (they lie above the diagonal
 * of every stored row). CTAs are ordered as attn.cu's tiled kernel's.
 *
 * Kernel 2 (attn_fwd_ws_kernel, below; attn.cu's default) is the overlapped schedule in a
 * warp-specialized persistent block: a loading warpgroup and two multiplying ones that hand
 * stages over through mbarriers instead of block barriers (8 x 2048, 32/8 heads on the H200:
 * 459 TFLOP/s against 359). */
#include "be_cuda.cuh"
#include "dflash_ptx.cuh"
#include "attn_tiled.cuh"
#include "flash_tile.cuh"
#include "attn_wgmma.h"
#include "attn_wgmma.cuh"

#if defined(__CUDA_ARCH_FEAT_SM90_ALL)
#define AW_ON 1
#endif

#ifdef AW_ON
#include "wgmma_ptx.cuh"

__device__ __forceinline__ void aw_hold_a(uint32_t (&a)[8][1][4])
{
#pragma unroll
    for (int i = 0; i < 8; i++)
#pragma unroll
        for (int j = 0; j < 4; j++)
            asm volatile("" : "+r"(a[i][0][j])::"memory");
}

/* cp.async of rows row0 .. row0 + 127 of g (row stride ld; rows at or past len: zeros) into the
 * tile at dst: thread tid of NT takes 16-byte chunk tid % 16 of rows tid / 16 + (NT / 16) i */
template <int NT = AW_THREADS>
__device__ __forceinline__ void aw_load_tile(uint32_t dst, const bf16 *g, int64_t ld, int row0, int len,
                                             uint32_t tid)
{
    constexpr int RS = NT / 16;   /* rows a pass */
    const uint32_t ch = tid % 16, r0 = tid / 16, off = aw_off(AW_BM, r0, ch);
#pragma unroll
    for (int i = 0; i < AW_BN / RS; i++) {
        const int row = row0 + (int)r0 + RS * i;
        const bool ok = row < len;
        df_cp16(dst + off + (uint32_t)i * RS * AW_ROWB, ok ? g + (int64_t)row * ld + ch * 8 : g, ok);
    }
}

/* S = Q K^T of the key tile at sk for warpgroup wg (issued and committed, not waited) */
__device__ __forceinline__ void aw_issue_s(float (&s)[16][4], uint32_t sq, uint32_t sk, uint32_t wg)
{
#pragma unroll
    for (int kk = 0; kk < AW_D / 16; kk++)
        wg_mma_ss(s, mw_desc(sq + aw_koff(AW_BM, kk) + wg * 64 * AW_ROWB), mw_desc(sk + aw_koff(AW_BN, kk)),
                  kk > 0);
    wg_commit();
}

/* O += P V of the value tile at sv (issued and committed, not waited) */
__device__ __forceinline__ void aw_issue_pv(float (&o)[16][4], const uint32_t (&pa)[8][1][4], uint32_t sv)
{
#pragma unroll
    for (int kb = 0; kb < AW_BN / 16; kb++)
        wg_mma_rs_tb(o, pa[kb][0], aw_desc_mn(sv + aw_voff(kb)));
    wg_commit();
}

/* the causal mask of the thread's scores of the key tile from n0: rows r0 (+8), keys n0 + 8 nt +
 * 2 (lane % 4) (+1) */
__device__ __forceinline__ void aw_mask(float (&s)[1][16][4], int r0, int n0, uint32_t lane)
{
#pragma unroll
    for (int nt = 0; nt < 16; nt++)
#pragma unroll
        for (int e = 0; e < 4; e++) {
            const int qi = r0 + ((e >> 1) << 3), kj = n0 + nt * 8 + 2 * (int)(lane & 3) + (e & 1);
            if (kj > qi)
                s[0][nt][e] = -INFINITY;
        }
}

/* O / l of the warp's 16 rows (rows wrow .. wrow + 15 of the tile, from m0 of the sequence at
 * s0), staged as bf16 in those rows of the shared tile at tile, then stored 16 bytes at a time
 * (rows at or past len: not stored) */
__device__ __forceinline__ void aw_store_o(const AttnParams &p, const float (&o)[1][16][4], const float (&lrow)[1][2],
                                           uint8_t *tile, uint32_t wrow, uint32_t lane, int s0, int head,
                                           int m0, int len)
{
#pragma unroll
    for (int hh = 0; hh < 2; hh++) {
        const float l = ft_row_sum(lrow[0][hh]);
        const float inv = l > 0.0f ? 1.0f / l : 0.0f;
        const uint32_t r = wrow + lane / 4 + 8 * hh;
#pragma unroll
        for (int dt = 0; dt < 16; dt++)
            *reinterpret_cast<uint32_t *>(tile + aw_off(AW_BM, r, (uint32_t)dt) + 4 * (lane % 4)) =
                df_pack(o[0][dt][2 * hh] * inv, o[0][dt][2 * hh + 1] * inv);
    }
    __syncwarp();
    bf16 *og = (bf16 *)p.o + (int64_t)s0 * p.ldo + (int64_t)head * AW_D;
#pragma unroll
    for (int i = 0; i < 8; i++) {
        const uint32_t c = lane + 32 * i, r = c / 16, ch = c % 16;
        const int row = m0 + (int)(wrow + r);
        if (row < len)
            *reinterpret_cast<uint4 *>(og + (int64_t)row * p.ldo + ch * 8) =
                *reinterpret_cast<const uint4 *>(tile + aw_off(AW_BM, wrow + r, ch));
    }
}

#endif

template <bool OVL>
__global__ void __launch_bounds__(AW_THREADS, 1) attn_fwd_wgmma_kernel(const AttnParams p)
{
#ifdef AW_ON
    DF_DYN_SMEM(smem);
    const uint32_t sbase = df_smem(smem), sQ = (sbase + 1023u) & ~1023u;
    const uint32_t sK0 = sQ + AW_TILEB, sV0 = sK0 + 2 * AW_TILEB;   /* stages: +AW_TILEB */

    const int head = (int)(blockIdx.x % (unsigned)p.n_heads);
    const int seq = (int)(blockIdx.x / (unsigned)p.n_heads);
    const int s0 = p.cu[seq];
    const int len = p.cu[seq + 1] - s0;
    const int mt_idx = (len + AW_BM - 1) / AW_BM - 1 - (int)blockIdx.y;  /* heaviest tile first */
    if (mt_idx < 0)
        return;
    const int m0 = mt_idx * AW_BM;
    const int kvh = head / p.group;
    const bf16 *qg = (const bf16 *)p.q + (int64_t)s0 * p.ldq + (int64_t)head * AW_D;
    const bf16 *kg = (const bf16 *)p.k + (int64_t)s0 * p.ldk + (int64_t)kvh * AW_D;
    const bf16 *vg = (const bf16 *)p.v + (int64_t)s0 * p.ldv + (int64_t)kvh * AW_D;

    const uint32_t tid = threadIdx.x, wg = tid / 128, lane = tid % 32, warp = (tid % 128) / 32;
    const int wr0 = m0 + 64 * (int)wg;                       /* the warpgroup's first row */
    const int r0 = wr0 + 16 * (int)warp + (int)(lane / 4);   /* the thread's rows: r0, r0 + 8 */
    /* A warpgroup whose rows all lie past the sequence end multiplies zeros all the same: wgmma
     * under a branch that ptxas cannot prove uniform in the warpgroup is serialized. */
    const bool live = wr0 < len;
    const int n_tiles = (min(len, m0 + AW_BM) + AW_BN - 1) / AW_BN;
    const float sl2 = p.scale_log2;

    float o[1][16][4], s[1][16][4], mrow[1][2], lrow[1][2], alpha[1][2];
    uint32_t pa[8][1][4];   /* P of a key tile: the A fragments of its k16 steps */
    ft_init(o, mrow, lrow);

    if (!OVL) {
        aw_load_tile(sQ, qg, p.ldq, m0, len, tid);
        aw_load_tile(sK0, kg, p.ldk, 0, len, tid);
        aw_load_tile(sV0, vg, p.ldv, 0, len, tid);
        df_commit();
        for (int it = 0; it < n_tiles; it++) {
            const uint32_t st = (uint32_t)(it & 1) * AW_TILEB;
            if (it + 1 < n_tiles) {
                aw_load_tile(sK0 + (st ^ AW_TILEB), kg, p.ldk, (it + 1) * AW_BN, len, tid);
                aw_load_tile(sV0 + (st ^ AW_TILEB), vg, p.ldv, (it + 1) * AW_BN, len, tid);
                df_commit();
                df_wait<1>();
            } else {
                df_wait<0>();
            }
            wg_proxy_fence();
            __syncthreads();
            const int n0 = it * AW_BN;
            {
                wg_hold(s[0]);
                wg_fence();
                aw_issue_s(s[0], sQ, sK0 + st, wg);
                wg_wait<0>();
                wg_hold(s[0]);
                if (n0 + AW_BN - 1 > wr0)
                    aw_mask(s, r0, n0, lane);
                ft_softmax_p(s, mrow, lrow, alpha, sl2);
                ft_rescale_o(o, alpha);
#pragma unroll
                for (int kb = 0; kb < AW_BN / 16; kb++)
                    ft_pack_p(pa[kb], s, kb);
                wg_hold(o[0]);
                aw_hold_a(pa);
                wg_fence();
                aw_issue_pv(o[0], pa, sV0 + st);
                wg_wait<0>();
                wg_hold(o[0]);
            }
            __syncthreads();   /* everyone is done with this stage before it is refilled */
        }
    } else {
        /* groups: Q + K0, V0, K1, V1, then K(j + 1) and V(j + 1) in step j (possibly empty) */
        aw_load_tile(sQ, qg, p.ldq, m0, len, tid);
        aw_load_tile(sK0, kg, p.ldk, 0, len, tid);
        df_commit();
        aw_load_tile(sV0, vg, p.ldv, 0, len, tid);
        df_commit();
        if (n_tiles > 1) {
            aw_load_tile(sK0 + AW_TILEB, kg, p.ldk, AW_BN, len, tid);
            df_commit();
            aw_load_tile(sV0 + AW_TILEB, vg, p.ldv, AW_BN, len, tid);
        } else {
            df_commit();
        }
        df_commit();
        df_wait<3>();   /* Q and K0 */
        wg_proxy_fence();
        __syncthreads();
        {
            wg_hold(s[0]);
            wg_fence();
            aw_issue_s(s[0], sQ, sK0, wg);
            wg_wait<0>();
            wg_hold(s[0]);
            if (AW_BN - 1 > wr0)   /* tile 0 crosses the diagonal (then it is the only one) */
                aw_mask(s, r0, 0, lane);
            ft_softmax_p(s, mrow, lrow, alpha, sl2);
#pragma unroll
            for (int kb = 0; kb < AW_BN / 16; kb++)
                ft_pack_p(pa[kb], s, kb);
        }
        for (int it = 1; it < n_tiles; it++) {
            const uint32_t st = (uint32_t)(it & 1) * AW_TILEB, pst = st ^ AW_TILEB;
            const int n0 = it * AW_BN;
            df_wait<1>();   /* K(it), V(it - 1); V(it) may still be in flight */
            wg_proxy_fence();
            __syncthreads();   /* ... everyone's; everyone is done with S(it - 1), its K stage */
            if (it + 1 < n_tiles)
                aw_load_tile(sK0 + pst, kg, p.ldk, n0 + AW_BN, len, tid);
            df_commit();
            {
                wg_hold(s[0]);
                wg_hold(o[0]);
                aw_hold_a(pa);
                wg_fence();
                aw_issue_s(s[0], sQ, sK0 + st, wg);
                aw_issue_pv(o[0], pa, sV0 + pst);
                wg_wait<1>();
                wg_hold(s[0]);
                if (n0 + AW_BN - 1 > wr0)
                    aw_mask(s, r0, n0, lane);
                ft_softmax_p(s, mrow, lrow, alpha, sl2);
                wg_wait<0>();
                wg_hold(o[0]);
                aw_hold_a(pa);
                ft_rescale_o(o, alpha);
#pragma unroll
                for (int kb = 0; kb < AW_BN / 16; kb++)
                    ft_pack_p(pa[kb], s, kb);
            }
            __syncthreads();   /* everyone is done with V(it - 1), its stage */
            if (it + 1 < n_tiles)
                aw_load_tile(sV0 + pst, vg, p.ldv, n0 + AW_BN, len, tid);
            df_commit();
        }
        df_wait<0>();
        wg_proxy_fence();
        __syncthreads();
        {
            wg_hold(o[0]);
            aw_hold_a(pa);
            wg_fence();
            aw_issue_pv(o[0], pa, sV0 + (uint32_t)((n_tiles - 1) & 1) * AW_TILEB);
            wg_wait<0>();
            wg_hold(o[0]);
        }
    }
    if (!live)
        return;

    /* through the warp's own 16 Q rows (no other warp reads them: the warpgroup's wgmma are done) */
    aw_store_o(p, o, lrow, smem + (sQ - sbase), 64 * wg + 16 * warp, lane, s0, head, m0, len);
#else
    __trap();   /* built without sm_90a: attn.cu never launches it */
#endif
}

/* ------------------------------------------------------------------------------------------ */
/* The warp-specialized persistent form (kernel 2; AW_WS_* in attn_wgmma.h). One block an SM
 * (gridDim.x of them) walks the work items b, b + gridDim.x, ... of the other forms' grid in their
 * order (item t: x = t % gx, y = t / gx; heaviest tile first), so that no block is launched and
 * no prologue waits per tile. Warpgroup 2 (AW_WS_LT threads) only loads: for each item Q once the
 * multiplying warpgroups are done with the last one's (qempty), then K and V of every key tile
 * into a ring of AW_WS_ST stages, each once the wgmma that last read it are done (kempty,
 * vempty); every loading thread's cp.async arrive on the stage's qfull / kfull / vfull when they
 * land; it gives registers back (setmaxnreg: AW_WS_LREGS), the multiplying ones take them
 * (AW_WS_MREGS; 3 warpgroups alone would leave 168 a thread). Warpgroups 0 and 1
 * only multiply (rows [64 w, +64) of the item), the overlapped schedule of kernel 0 (P V
 * of tile j - 1 on the tensor cores while the softmax of tile j runs), each waiting on the
 * stages' mbarriers instead of block barriers, so that the two drift apart and one's softmax
 * runs under the other's wgmma; a warp hands a stage back (one arrival of the 8 a stage counts)
 * once its wgmma reading it are done. O / l is staged through a tile of its own (Q's may already
 * hold the next item's). The products, the softmax and the roundings are kernel 0's, step for
 * step: the same results bit for bit. */
#ifdef AW_ON
/* x, y of work item t (grid gx x gy); returns whether it has a query tile (else: skipped) */
__device__ __forceinline__ bool aw_item(const AttnParams &p, int64_t t, int64_t gx, int *head, int *s0,
                                        int *len, int *m0)
{
    const int x = (int)(t % gx), y = (int)(t / gx);
    *head = x % p.n_heads;
    const int seq = x / p.n_heads;
    *s0 = p.cu[seq];
    *len = p.cu[seq + 1] - *s0;
    const int mt = (*len + AW_BM - 1) / AW_BM - 1 - y;
    *m0 = mt * AW_BM;
    return mt >= 0;
}
#endif

static_assert(AW_WS_SMEM <= 227 * 1024, "the warp-specialized form's shared memory: one block an SM");
static_assert(AW_WS_LT * AW_WS_LREGS + 256 * AW_WS_MREGS <= 65536, "setmaxnreg budgets: the register file");

__global__ void __launch_bounds__(AW_WS_THREADS, 1) attn_fwd_ws_kernel(const AttnParams p, int64_t gx, int64_t n_items)
{
#ifdef AW_ON
    DF_DYN_SMEM(smem);
    const uint32_t sbase = df_smem(smem), sQ = (sbase + 1023u) & ~1023u;
    const uint32_t sK0 = sQ + AW_TILEB, sV0 = sK0 + AW_WS_ST * AW_TILEB, sO = sV0 + AW_WS_ST * AW_TILEB;
    const uint32_t qfull = sO + AW_TILEB, qempty = qfull + 8, kfull = qempty + 8;
    const uint32_t kempty = kfull + 8 * AW_WS_ST, vfull = kempty + 8 * AW_WS_ST, vempty = vfull + 8 * AW_WS_ST;
    const uint32_t tid = threadIdx.x, wg = tid / 128, lane = tid % 32, warp = (tid % 128) / 32;
    if (tid == 0) {
        wg_bar_init(qfull, AW_WS_LT);   /* every loading thread's cp.async */
        wg_bar_init(qempty, 8);    /* every multiplying warp */
        for (int st = 0; st < AW_WS_ST; st++) {
            wg_bar_init(kfull + 8 * st, AW_WS_LT);
            wg_bar_init(kempty + 8 * st, 8);
            wg_bar_init(vfull + 8 * st, AW_WS_LT);
            wg_bar_init(vempty + 8 * st, 8);
        }
    }
    __syncthreads();
    int head, s0, len, m0;
    uint32_t kv = 0, j = 0;   /* key tiles and items this block has gone through */
    if (wg == 2) {   /* the loading warpgroup */
        wg_regs_dec<AW_WS_LREGS>();
        const uint32_t lt = tid - 256;
        for (int64_t t = blockIdx.x; t < n_items; t += gridDim.x) {
            if (!aw_item(p, t, gx, &head, &s0, &len, &m0))
                continue;
            const int kvh = head / p.group;
            const bf16 *kg = (const bf16 *)p.k + (int64_t)s0 * p.ldk + (int64_t)kvh * AW_D;
            const bf16 *vg = (const bf16 *)p.v + (int64_t)s0 * p.ldv + (int64_t)kvh * AW_D;
            wg_bar_wait(qempty, (j & 1) ^ 1);   /* item 0: passes at once */
            aw_load_tile<AW_WS_LT>(sQ, (const bf16 *)p.q + (int64_t)s0 * p.ldq + (int64_t)head * AW_D, p.ldq,
                              m0, len, lt);
            wg_bar_arrive_cp(qfull);
            const int n_tiles = (min(len, m0 + AW_BM) + AW_BN - 1) / AW_BN;
            for (int it = 0; it < n_tiles; it++, kv++) {
                const uint32_t st = kv % AW_WS_ST, par = ((kv / AW_WS_ST) & 1) ^ 1;
                wg_bar_wait(kempty + 8 * st, par);
                aw_load_tile<AW_WS_LT>(sK0 + st * AW_TILEB, kg, p.ldk, it * AW_BN, len, lt);
                wg_bar_arrive_cp(kfull + 8 * st);
                wg_bar_wait(vempty + 8 * st, par);
                aw_load_tile<AW_WS_LT>(sV0 + st * AW_TILEB, vg, p.ldv, it * AW_BN, len, lt);
                wg_bar_arrive_cp(vfull + 8 * st);
            }
            j++;
        }
        df_wait<0>();
        return;
    }
    wg_regs_inc<AW_WS_MREGS>();
    const uint32_t cw = wg;   /* the multiplying warpgroup: rows [64 cw, 64 cw + 64) */
    const float sl2 = p.scale_log2;
    for (int64_t t = blockIdx.x; t < n_items; t += gridDim.x) {
        if (!aw_item(p, t, gx, &head, &s0, &len, &m0))
            continue;
        const int wr0 = m0 + 64 * (int)cw;                       /* the warpgroup's first row */
        const int r0 = wr0 + 16 * (int)warp + (int)(lane / 4);   /* the thread's rows: r0, r0 + 8 */
        const int n_tiles = (min(len, m0 + AW_BM) + AW_BN - 1) / AW_BN;
        float o[1][16][4], s[1][16][4], mrow[1][2], lrow[1][2], alpha[1][2];
        uint32_t pa[8][1][4];
        ft_init(o, mrow, lrow);
        auto kbar = [&](uint32_t c, uint32_t base) { return base + 8 * (c % AW_WS_ST); };
        auto kpar = [&](uint32_t c) { return (c / AW_WS_ST) & 1; };
        wg_bar_wait(qfull, j & 1);
        wg_bar_wait(kbar(kv, kfull), kpar(kv));
        __syncwarp();
        {
            wg_hold(s[0]);
            wg_fence();
            aw_issue_s(s[0], sQ, sK0 + (kv % AW_WS_ST) * AW_TILEB, cw);
            wg_wait<0>();
            wg_hold(s[0]);
            wg_bar_arrive_warp(kbar(kv, kempty), lane);
            if (n_tiles == 1)
                wg_bar_arrive_warp(qempty, lane);
            if (AW_BN - 1 > wr0)   /* tile 0 crosses the diagonal (then it is the only one) */
                aw_mask(s, r0, 0, lane);
            ft_softmax_p(s, mrow, lrow, alpha, sl2);
#pragma unroll
            for (int kb = 0; kb < AW_BN / 16; kb++)
                ft_pack_p(pa[kb], s, kb);
        }
        for (int it = 1; it < n_tiles; it++) {
            const uint32_t c = kv + (uint32_t)it, pc = c - 1;
            const int n0 = it * AW_BN;
            wg_bar_wait(kbar(c, kfull), kpar(c));
            wg_bar_wait(kbar(pc, vfull), kpar(pc));
            __syncwarp();
            wg_hold(s[0]);
            wg_hold(o[0]);
            aw_hold_a(pa);
            wg_fence();
            aw_issue_s(s[0], sQ, sK0 + (c % AW_WS_ST) * AW_TILEB, cw);
            aw_issue_pv(o[0], pa, sV0 + (pc % AW_WS_ST) * AW_TILEB);
            wg_wait<1>();   /* S(it): its K stage and, on the last tile, Q go back */
            wg_hold(s[0]);
            wg_bar_arrive_warp(kbar(c, kempty), lane);
            if (it == n_tiles - 1)
                wg_bar_arrive_warp(qempty, lane);
            if (n0 + AW_BN - 1 > wr0)
                aw_mask(s, r0, n0, lane);
            ft_softmax_p(s, mrow, lrow, alpha, sl2);
            wg_wait<0>();   /* P V of tile it - 1: its V stage goes back */
            wg_hold(o[0]);
            aw_hold_a(pa);
            wg_bar_arrive_warp(kbar(pc, vempty), lane);
            ft_rescale_o(o, alpha);
#pragma unroll
            for (int kb = 0; kb < AW_BN / 16; kb++)
                ft_pack_p(pa[kb], s, kb);
        }
        {
            const uint32_t lc = kv + (uint32_t)n_tiles - 1;
            wg_bar_wait(kbar(lc, vfull), kpar(lc));
            __syncwarp();
            wg_hold(o[0]);
            aw_hold_a(pa);
            wg_fence();
            aw_issue_pv(o[0], pa, sV0 + (lc % AW_WS_ST) * AW_TILEB);
            wg_wait<0>();
            wg_hold(o[0]);
            wg_bar_arrive_warp(kbar(lc, vempty), lane);
        }
        kv += (uint32_t)n_tiles;
        j++;
        if (wr0 >= len)
            continue;   /* every row of the warpgroup past the sequence end */
        /* through the warp's own 16 rows of the staging tile (its last reads of them, in the
         * previous item, are behind this __syncwarp) */
        __syncwarp();
        aw_store_o(p, o, lrow, smem + (sO - sbase), 64 * cw + 16 * warp, lane, s0, head, m0, len);
    }
#else
    __trap();   /* built without sm_90a: attn.cu never launches it */
#endif
}

/* ------------------------------------------------------------------------------------------ */
/* the host side (nvcc only: tests/emu includes this file for its kernels) */
#ifdef __CUDACC__

static int aw_major[64];   /* a device's compute capability major, 0 until asked */

bool cuda_attn_wgmma_fits(int device)
{
    if (device < 0 || device >= 64)
        return false;
    if (!aw_major[device] &&
        cudaDeviceGetAttribute(&aw_major[device], cudaDevAttrComputeCapabilityMajor, device) != cudaSuccess)
        return false;
    return aw_major[device] == 9;
}

static void (*aw_kernel(int which))(const AttnParams)
{
    return which == 0 ? attn_fwd_wgmma_kernel<true> : attn_fwd_wgmma_kernel<false>;
}

cudaError_t cuda_attn_wgmma_init(int which)
{
    if (which == 2)
        return cuda_allow_smem(attn_fwd_ws_kernel, AW_WS_SMEM);
    return cuda_allow_smem(aw_kernel(which), AW_SMEM);
}

void cuda_attn_wgmma(const AttnParams &p, int which, dim3 grid, int sms, cudaStream_t s)
{
    if (which == 2) {
        const int64_t n_items = (int64_t)grid.x * grid.y;
        if (n_items <= 0)
            return;   /* nothing to do (attn.cu sends no empty batch here) */
        const int64_t nsm = sms > 0 ? sms : 1;
        const unsigned nb = (unsigned)(n_items < nsm ? n_items : nsm);
        attn_fwd_ws_kernel<<<nb, AW_WS_THREADS, AW_WS_SMEM, s>>>(p, (int64_t)grid.x, n_items);
        return;
    }
    aw_kernel(which)<<<grid, AW_THREADS, AW_SMEM, s>>>(p);
}

#endif
