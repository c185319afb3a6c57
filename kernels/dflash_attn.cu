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
 *    dK_blk = dS^T Q for those keys (complete: every row of the block is in the CTA). The K/V
 *    tiles stream through a ring of ST stages (ST - 1 tiles in flight; 3 in the d128 default).
 *  - backward, pass KV: one CTA per (context key tile of BNK rows, kv head), FA2 style: the
 *    tile's K and V stay in shared memory; the query rows of the blocks that see the tile stream
 *    by in chunks of QC rows (Q, dO, lse, delta, each row's visible context range); each warp
 *    owns 16 keys: S^T = K Q^T, dP^T = V dO^T, P^T, dS^T, dV += P^T dO, dK += dS^T Q. Variants
 *    "rows prefetched" fetch each chunk's row tables (cs, an, lse, delta) by cp.async a chunk
 *    ahead instead of loading them between chunks; "P via smem" (the d128 default, 8 warps, 128
 *    keys) also splits the work differently: each warp computes S^T, dP^T for 32 keys x 32 rows,
 *    P^T and dS^T go through shared memory, then each warp accumulates dV, dK for 32 keys x d/2
 *    (fewer ldmatrix per mma than 16 keys x all rows and x all of d). Every
 *    context row is written by exactly one CTA (0 where no block sees it): no atomics, no
 *    accumulation across CTAs, so the result is deterministic. A one-CTA scheduling kernel first
 *    counts, per key tile, the blocks that see it (and their range) and orders the tiles
 *    heaviest first (tiles near the start of a sequence are seen by most of its blocks).
 *    Blocks are assumed ordered by ctx_start (backend.h); anchors need not be sorted. On a
 *    Hopper GPU the d128 default of each pass is in kernels/dflash_wgmma.cu: pass KV with the
 *    same CTAs, schedule and row chunks, its four matmuls on wgmma (two warpgroups of 64 keys,
 *    P^T and dS^T in registers); pass Q with CTAs of 128 rows, S, dP and dQ on wgmma (two
 *    warpgroups of 64 rows, Q, dO, P, dS in registers), the block keys' part on mma.sync. The
 *    forward's d128 default is there too: pass Q's CTAs, S = Q K^T and O += P V on wgmma with Q
 *    and P in registers, key tiles of 64 or 128 rows, P V of a key tile overlapped with the
 *    softmax of the next in most forms; the default is warp-specialized (a loading warpgroup
 *    handing stages to the two multiplying ones through mbarriers).
 *  dS kept (the default where it applies; DFL_CUDA_DFLASH_DS=0 or dfl_cuda_dflash_bwd_ds(0) turn it
 *  off): pass Q recomputes S and dP only to make dS, which pass KV makes too. With the d128
 *  wgmma defaults, blocks of DF_DS_ROWS = 64 rows a kv head (a pass KV chunk is then one block,
 *  a pass Q warpgroup one block) and the host copies of ctx_start and anchor given, the order is:
 *  delta (df_delta_kernel), the schedule and the plan of the slots (df_ds_plan_kernel: each
 *  block's run of context key tiles of DF_DS_KEYS that it sees, df_ds_tiles, laid out in block
 *  order), pass KV (df_bwd_kv_wg_ds_kernel) writing each chunk's dS^T (bf16, as dK's product
 *  takes it) into the block's slot for its tile, 16 KB a kv head in 8 x 8 pieces of 128 bytes,
 *  then pass Q (df_bwd_q_wg_ds_kernel) over global 64-key tiles (half a slot), reading the two
 *  blocks' pieces with the K tile and transposing them into dQ's A fragments with ldmatrix
 *  .trans: no S, dP or exponentials on the context tiles (the block-key tiles as before). Those
 *  context tiles stream through DQW_DS_CST = 6 stages of 32 KB (five in flight: the reads are
 *  latency-bound), in the shared memory that Q, dO and the block-key tiles' stages take after
 *  them (2.68 -> 2.53 ms at the 8B shape against three stages, two in flight). Each
 *  dS value is one rounding of the same P (dP - delta) pass Q would make; dQ's k16 sums are
 *  grouped by global tiles instead of the segment's, so the bits differ from the recomputing
 *  path, within rounding (tests/emu emu-dflash, gpu-train-ops compare both against the CPU).
 *  The slots live in the backend's ds_buf, sized here from the host arrays and grown with a
 *  quarter of headroom while 1 GiB stays free (also after the allocation freeze: failing, the
 *  call recomputes dS instead); H200, 8B drafter's shape: backward 7.29 -> 6.36 ms a layer
 *  (pass KV with delta, schedule and plan 4.04 ms, pass Q 2.72; 6.28 with pass Q's six stages,
 *  2.53), 4 GB of slots.
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
#include "dflash_ptx.cuh"
#include "dflash_kernels.cuh"
#include "dflash_wgmma.cuh"
#include "attn_wgmma.cuh"

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
    bool hopper;       /* wgmma (sm_90a): compute capability 9 only */
};

#define FWD_V(NAME, D, MT, NW, BN, QREG)                                                        \
    { NAME, df_fwd_kernel<D, MT, NW, BN, QREG>, FwdCfg<D, MT, NW, BN, QREG>::MMAX,               \
      FwdCfg<D, MT, NW, BN, QREG>::THREADS, FwdCfg<D, MT, NW, BN, QREG>::SMEM, BN }
#define BWDQ_VS(NAME, D, NW, BN, QREG, ST)                                                     \
    { NAME, df_bwd_q_kernel<D, NW, BN, QREG, ST>, BwdQCfg<D, NW, BN, QREG, ST>::MMAX,              \
      BwdQCfg<D, NW, BN, QREG, ST>::THREADS, BwdQCfg<D, NW, BN, QREG, ST>::SMEM, BN }
#define BWDQ_V(NAME, D, NW, BN, QREG) BWDQ_VS(NAME, D, NW, BN, QREG, 2)
#define BWDKV_VS(NAME, D, NW, QC, PIPE, SP)                                                    \
    { NAME, df_bwd_kv_kernel<D, NW, QC, PIPE, SP>, BwdKVCfg<D, NW, QC, PIPE, SP>::BNK,          \
      BwdKVCfg<D, NW, QC, PIPE, SP>::THREADS, BwdKVCfg<D, NW, QC, PIPE, SP>::SMEM, 0 }
#define BWDKV_VP(NAME, D, NW, QC, PIPE) BWDKV_VS(NAME, D, NW, QC, PIPE, false)
#define BWDKV_V(NAME, D, NW, QC) BWDKV_VP(NAME, D, NW, QC, false)

static const DfVariant fwd32[] = {
    FWD_V("fwd d32 128 rows (4 warps x 32) BN64 Q regs", 32, 2, 4, 64, true),
    FWD_V("fwd d32 64 rows (4 warps x 16) BN64 Q regs", 32, 1, 4, 64, true),
};
static const DfVariant fwd64[] = {
    FWD_V("fwd d64 128 rows (4 warps x 32) BN64 Q regs", 64, 2, 4, 64, true),
    FWD_V("fwd d64 128 rows (8 warps x 16) BN64 Q regs", 64, 1, 8, 64, true),
};
/* d128 forward: the default (index 0) on compute capability 9 is the warp-specialized wgmma
 * kernel (kernels/dflash_wgmma.cu dw_fwd_ws: a loading warpgroup hands K and V stages to the two
 * multiplying ones through mbarriers); H200, bench-train-ops --quick --attention, same run (8B
 * drafter attention, 4 x 3072 tokens, 512 anchors): 2.043 ms (410.9 TFLOP/s) against 2.575-3.074
 * for the BN128 overlapped kernel (index 1, the default before) and 2.72-2.74 for the BN64 ones;
 * --window (4 x 4096 tokens, full attention): 2.534 against 3.409-3.792. Before that (index 1 the
 * default): 2.551 ms against 3.409 for the mma.sync default before it (index 2, which df_pick
 * takes elsewhere), 2.698-2.959 for the BN64 wgmma forms; --window: 3.205 against 4.609 ms with
 * full attention, 2.580 against 3.303 with the window of 2048. gpu-train-ops passed every case
 * with each of these; a BN128 plain form of two stages gave wrong results there (o cos 0.13) and
 * was removed. */
static const DfVariant fwd128[] = {
    {"fwd d128 128 rows (2 warpgroups + a loading one) BN64 wgmma, warp-specialized, 4 stages", df_fwd_ws_kernel,
     DQW_MMAX, DFWS_THREADS, DFWS_SMEM, 64, true},
    {"fwd d128 128 rows (2 warpgroups) BN128 wgmma, P V overlapped, 3 stages", df_fwd_wg128_ovl3_kernel, DQW_MMAX,
     DQW_THREADS, DFW_SMEM(3, 128), 128, true},
    FWD_V("fwd d128 128 rows (4 warps x 32) BN32 Q smem", 128, 2, 4, 32, false),
    FWD_V("fwd d128 128 rows (8 warps x 16) BN64 Q regs", 128, 1, 8, 64, true),
    FWD_V("fwd d128 64 rows (4 warps x 16) BN64 Q regs", 128, 1, 4, 64, true),
    {"fwd d128 128 rows (2 warpgroups) BN64 wgmma, P V overlapped, 3 stages", df_fwd_wg_ovl3_kernel, DQW_MMAX,
     DQW_THREADS, DFW_SMEM(3, 64), 64, true},
    {"fwd d128 128 rows (2 warpgroups) BN64 wgmma, P V overlapped, 4 stages", df_fwd_wg_ovl4_kernel, DQW_MMAX,
     DQW_THREADS, DFW_SMEM(4, 64), 64, true},
    {"fwd d128 128 rows (2 warpgroups) BN64 wgmma, 3 stages", df_fwd_wg_kernel, DQW_MMAX, DQW_THREADS, DFW_SMEM(3, 64),
     64, true},
};
static const DfVariant bq32[] = {
    BWDQ_V("bwd-q d32 128 rows (8 warps) BN64 Q/dO regs", 32, 8, 64, true),
    BWDQ_V("bwd-q d32 128 rows (8 warps) BN64 Q/dO smem", 32, 8, 64, false),
    BWDQ_V("bwd-q d32 64 rows (4 warps) BN64 Q/dO regs", 32, 4, 64, true),
};
static const DfVariant bq64[] = {
    BWDQ_V("bwd-q d64 128 rows (8 warps) BN32 Q/dO regs", 64, 8, 32, true),
    BWDQ_V("bwd-q d64 128 rows (8 warps) BN32 Q/dO smem", 64, 8, 32, false),
    BWDQ_V("bwd-q d64 64 rows (4 warps) BN32 Q/dO regs", 64, 4, 32, true),
};
/* d128 defaults (index 0) from bench-train-ops on the H200 (8B drafter attention, 4 x 3072 tokens,
 * 512 anchors), both on wgmma (kernels/dflash_wgmma.cu): pass Q 3.888 ms against 3.871 with two
 * stages (the same within the run-to-run spread) and 5.994 for the mma.sync default before it
 * (64 rows, 3 stages: 6.034 in an earlier run against 6.540 for the 128-row variant and 6.127
 * with two stages); pass KV 5.739 ms against 5.998 with two stages and 8.495 for the mma.sync
 * default before it (8.459 in an earlier run against 8.593). At the Qwen3.6-27B drafter's shape
 * (4 x 4096 tokens) pass Q 4.796 ms against 7.642 with full attention, 3.902 against 6.015 with
 * the window of 2048; pass KV 7.401 against 10.986, 6.005 against 8.661. Since 2026-12-02 pass
 * Q's default is the pipelined form of the three-stage kernel (a tile's dQ += dS K runs on while
 * the next tile's S and dP are issued): 3.808 / 3.837 ms against 3.908 / 3.929 (two runs), at the
 * 27B shape 4.673 against 4.804 (full attention) and 3.829 against 3.933 (window 2048). The same
 * change to pass KV (the next chunk's S^T, dP^T issued behind a chunk's dK) gave 5.772 / 5.783
 * against 5.792 / 5.751 and was not kept. ncu on pass KV then showed the tensor pipe 31% busy and
 * the warps waiting on the exponentials: a branch per element of P^T, each behind its own
 * shared-memory load of the row tables (short scoreboard 23%, fixed-latency waits 27%, branch
 * resolution 11% of the stall samples). Written branch-free (the exponential everywhere, the mask a
 * select, the tables read in pairs; the same in pass Q): pass KV 3.666 ms (458 TFLOP/s of its
 * matmuls) against 5.751, 4.700 against 7.437 at the 27B shape and 3.760 against 6.042 with the
 * window; pass Q (pipelined) 3.785. In the 8B step the attention backward went from 62.7 to 49.3
 * ms (27B: 70.8 to 54.9). Later the same day pass Q's default became the pipelined form with
 * its stages handed over through mbarriers (df_bwd_q_wg3m_kernel: no block barrier a step, the
 * warpgroups up to a step apart): 3.759 ms against 3.869 (same run), at the 27B shape with full
 * attention 4.528 against 4.673; pass KV with one block barrier a chunk instead of two (kv_finish
 * without `any`): 3.606-3.636 ms against 3.666 before. On a device other than compute capability 9 df_pick takes the first
 * mma.sync variant (pass Q: the first that holds the rows of a block, the 128-row one for more
 * than 64). */
static const DfVariant bq128[] = {
    {"bwd-q d128 128 rows (2 warpgroups) BN64 wgmma, 3 stages, pipelined, mbarriers", df_bwd_q_wg3m_kernel, DQW_MMAX,
     DQW_THREADS, DQW_SMEM(3), 64, true},
    {"bwd-q d128 128 rows (2 warpgroups) BN64 wgmma, 3 stages, pipelined", df_bwd_q_wg3p_kernel, DQW_MMAX, DQW_THREADS,
     DQW_SMEM(3), 64, true},
    {"bwd-q d128 128 rows (2 warpgroups) BN64 wgmma, 3 stages", df_bwd_q_wg3_kernel, DQW_MMAX, DQW_THREADS, DQW_SMEM(3), 64,
     true},
    BWDQ_VS("bwd-q d128 64 rows (4 warps) BN32 Q/dO regs 3 stages", 128, 4, 32, true, 3),
    BWDQ_V("bwd-q d128 128 rows (8 warps) BN32 Q/dO regs", 128, 8, 32, true),
    BWDQ_V("bwd-q d128 128 rows (8 warps) BN32 Q/dO smem", 128, 8, 32, false),
    BWDQ_V("bwd-q d128 64 rows (4 warps) BN32 Q/dO regs", 128, 4, 32, true),
    BWDQ_VS("bwd-q d128 128 rows (8 warps) BN32 Q/dO regs 3 stages", 128, 8, 32, true, 3),
    {"bwd-q d128 128 rows (2 warpgroups) BN64 wgmma", df_bwd_q_wg_kernel, DQW_MMAX, DQW_THREADS, DQW_SMEM(2), 64, true},
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
    {"bwd-kv d128 128 keys (2 warpgroups) QC64 wgmma, 3 stages", df_bwd_kv_wg_ovl_kernel, DW_BNK, DW_THREADS,
     DW_SMEM(true), 0, true},
    BWDKV_VS("bwd-kv d128 128 keys (8 warps) QC64 rows prefetched, P via smem", 128, 8, 64, true, true),
    BWDKV_V("bwd-kv d128 64 keys (4 warps) QC64", 128, 4, 64),
    BWDKV_V("bwd-kv d128 128 keys (8 warps) QC64", 128, 8, 64),
    BWDKV_V("bwd-kv d128 64 keys (4 warps) QC32", 128, 4, 32),
    BWDKV_VP("bwd-kv d128 64 keys (4 warps) QC64 rows prefetched", 128, 4, 64, true),
    BWDKV_VP("bwd-kv d128 128 keys (8 warps) QC64 rows prefetched", 128, 8, 64, true),
    BWDKV_VP("bwd-kv d128 64 keys (4 warps) QC32 rows prefetched", 128, 4, 32, true),
    BWDKV_VS("bwd-kv d128 64 keys (4 warps) QC64 rows prefetched, P via smem", 128, 4, 64, true, true),
    {"bwd-kv d128 128 keys (2 warpgroups) QC64 wgmma", df_bwd_kv_wg_kernel, DW_BNK, DW_THREADS, DW_SMEM(false), 0, true},
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

static int df_passes = 3;
extern "C" void dfl_cuda_dflash_bwd_passes(int mask) { df_passes = mask & 3; }

/* dS kept: -1 (DFL_CUDA_DFLASH_DS, default on), 0 off, 1 on (dfl_cuda_dflash_bwd_ds) */
static int df_ds_mode = -1;
extern "C" void dfl_cuda_dflash_bwd_ds(int on) { df_ds_mode = on ? 1 : 0; }
static bool df_ds_wanted()
{
    if (df_ds_mode < 0) {
        const char *v = getenv("DFL_CUDA_DFLASH_DS");
        df_ds_mode = v && !strcmp(v, "0") ? 0 : 1;
    }
    return df_ds_mode == 1;
}

/* free device memory that the kept dS leaves to everything else */
#define DF_DS_MARGIN ((size_t)1 << 30)

/* dS kept: the slots (one context key tile of a block, every kv head) of this call's blocks from
 * the host copies of the arrays, and ds_buf grown to hold them (a quarter more, so that later
 * steps rarely grow it), when free memory allows; false where it cannot be had */
static bool df_ds_buffer(dfl_be *be, const dfl_dflash_attn *a, DfP &p)
{
    int64_t slots = 0;
    for (int b = 0; b < a->n_blocks; b++) {
        int lo;
        slots += df_ds_tiles(p.window, a->ctx_start_host[b], a->anchor_host[b], &lo) - lo;
    }
    const size_t slot_bytes = (size_t)p.nkv * DF_DS_KEYS * DF_DS_ROWS * 2, need = (size_t)slots * slot_bytes;
    cuda_impl *im = cuda_of(be);
    if (need > im->ds_bytes) {
        const size_t want = need + need / 4;
        size_t fr = 0, tot = 0;
        if (cudaMemGetInfo(&fr, &tot) != cudaSuccess) {
            cudaGetLastError();
            return false;
        }
        if (fr + im->ds_bytes < want + DF_DS_MARGIN)
            return false;
        if (im->ds_buf) {
            cudaStreamSynchronize(im->stream);   /* the last call's kernels are done with it */
            cudaFree(im->ds_buf);
            im->ds_buf = NULL;
            im->ds_bytes = 0;
        }
        void *q = NULL;
        if (cudaMalloc(&q, want) != cudaSuccess) {
            cudaGetLastError();
            return false;
        }
        im->ds_buf = q;
        im->ds_bytes = want;
    }
    p.ds = im->ds_buf;
    p.ds_cap = (int64_t)(im->ds_bytes / slot_bytes);
    return true;
}

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
                if (t[v].smem > im->smem_optin || (t[v].hopper && !cuda_attn_wgmma_fits(im->device)))
                    continue;
                cudaError_t err = cuda_allow_smem(t[v].fn, t[v].smem);
                if (err != cudaSuccess) {
                    cudaGetLastError();
                    return cuda_op_fail(be, DFL_EDEVICE, "%s: kernel setup (%s): %s", op, t[v].name,
                                        cudaGetErrorString(err));
                }
            }
        }
    if (cuda_attn_wgmma_fits(im->device)) {   /* dS kept: the d128 defaults' forms */
        const struct {
            const char *name;
            df_kernel_fn fn;
            size_t smem;
        } ds[] = {{"bwd-kv dS kept", df_bwd_kv_wg_ds_kernel, DW_SMEM(true)},
                  {"bwd-q dS kept", df_bwd_q_wg_ds_kernel, DQW_DS_SMEM}};
        for (const auto &k : ds) {
            if (k.smem > im->smem_optin)
                continue;
            cudaError_t err = cuda_allow_smem(k.fn, k.smem);
            if (err != cudaSuccess) {
                cudaGetLastError();
                return cuda_op_fail(be, DFL_EDEVICE, "%s: kernel setup (%s): %s", op, k.name, cudaGetErrorString(err));
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
    p.window = a->window > 0 ? a->window : 0;
    p.T_ctx = a->T_ctx;
    p.ldq = (int64_t)a->n_heads * a->d;
    p.ldk = (int64_t)a->n_kv * a->d;
    p.scale = a->scale;
    p.sl2 = a->scale * DF_LOG2E;
    return p;
}

/* The tiled variant for kernel k: the chosen one, or where it does not take the shape (more
 * query rows per block than its CTA holds, more shared memory than the device has, a wgmma
 * kernel on a device other than compute capability 9) the first in table order that does; NULL when none does or the buffers are not aligned. */
static const DfVariant *df_pick(dfl_be *be, const dfl_dflash_attn *a, int k, bool bwd)
{
    if (be->act != DFL_BF16 || df_force_simple)
        return NULL;
    int di = df_dim_index(a->d), n;
    if (di < 0)
        return NULL;
    const DfVariant *t = df_table(k, a->d, &n);
    const int rb = (a->n_heads / a->n_kv) * a->bs;
    const size_t optin = cuda_of(be)->smem_optin;
    const bool hopper = cuda_attn_wgmma_fits(cuda_of(be)->device);
    auto fits = [&](const DfVariant *x) {
        return x->smem <= optin && (k == DFL_DFLASH_BWD_KV || rb <= x->mmax) && (!x->hopper || hopper);
    };
    const DfVariant *v = &t[df_choice[k][di]];
    for (int i = 0; i < n && !fits(v); i++)
        v = &t[i];
    if (!fits(v))
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
    /* dS kept (the d128 wgmma defaults, blocks of DF_DS_ROWS rows a kv head, host arrays given):
     * delta, the schedule and the slots' plan, pass KV writing dS, pass Q reading it */
    if (vq && vkv && vq->fn == df_bwd_q_wg3m_kernel && vkv->fn == df_bwd_kv_wg_ovl_kernel && p.rb == DF_DS_ROWS &&
        a->T_ctx > 0 && a->ctx_start_host && a->anchor_host && df_ds_wanted()) {
        p.n_kt = (int)((a->T_ctx + DW_BNK - 1) / DW_BNK);
        const size_t sched_bytes = ((size_t)p.n_kt * 3 * sizeof(int) + 15) & ~(size_t)15;
        if (sched_bytes + (size_t)a->n_blocks * sizeof(int4) <= cuda_of(be)->ws_bytes && df_ds_buffer(be, a, p)) {
            int *sched = (int *)cuda_of(be)->ws;
            int4 *blk = (int4 *)((char *)cuda_of(be)->ws + sched_bytes);
            p.sched = sched;
            p.ds_blk = blk;
            const int64_t items = (int64_t)a->n_blocks * a->bs * a->n_heads;
            df_delta_kernel<DW_D><<<(unsigned)((items + 7) / 8), 256, 0, s>>>(p);
            df_sched_kernel<<<1, 1024, 0, s>>>(p, sched, DW_BNK);
            df_ds_plan_kernel<<<1, DF_PLAN_THREADS, 0, s>>>(p, blk, NULL);
            if ((rc = cuda_launch_check(be, "dflash_attn_bwd (delta, schedule, plan)")))
                return rc;
            if (df_passes & 2) {
                df_bwd_kv_wg_ds_kernel<<<(unsigned)((int64_t)p.n_kt * p.nkv), vkv->threads, vkv->smem, s>>>(p);
                if ((rc = cuda_launch_check(be, "dflash_attn_bwd (kv, dS kept)")))
                    return rc;
            }
            if (df_passes & 1) {
                df_blocks_per_cta(p, vq->mmax);
                df_bwd_q_wg_ds_kernel<<<(unsigned)((int64_t)p.n_bg * p.nkv), DQW_THREADS, DQW_DS_SMEM, s>>>(p);
                if ((rc = cuda_launch_check(be, "dflash_attn_bwd (q, dS kept)")))
                    return rc;
            }
            return 0;
        }
    }
    /* pass Q: delta, dq, dk_blk, dv_blk */
    if (!(df_passes & 1)) {
        /* benchmarks only (dfl_cuda_dflash_bwd_passes) */
    } else if (vq) {
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
    if (a->T_ctx == 0 || !(df_passes & 2))
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
