/* dflash_wgmma.cuh: the wgmma kernels of the DFlash attention (kernels/dflash_wgmma.cu: the
 * backward's pass KV and pass Q, the forward) for kernels/dflash_attn.cu: their shapes and their
 * shared memory. Needs
 * DfP (dflash_kernels.cuh). */
#ifndef DFL_DFLASH_WGMMA_CUH
#define DFL_DFLASH_WGMMA_CUH

#define DW_D 128                           /* head dimension */
#define DW_BNK 128                         /* context keys of a CTA: two warpgroups of m64 */
#define DW_QC 64                           /* query rows of a chunk */
#define DW_THREADS 256
#define DW_TILEK (DW_BNK * DW_D * 2)       /* bytes of the K (or V) tile */
#define DW_TILEQ (DW_QC * DW_D * 2)        /* bytes of a chunk of Q (or dO) */
/* K, V, 2 (OVL: 3) stages of Q and dO, room to align */
#define DW_SMEM(OVL) (2 * DW_TILEK + ((OVL) ? 6 : 4) * DW_TILEQ + 1024)

/* Pass KV (dk_ctx, dv_ctx) for head dimension 128, bf16, on a device of compute capability 9
 * (built for sm_90a; elsewhere they trap): grid n_kt * nkv of DW_THREADS threads, DW_SMEM(false)
 * (the _ovl kernel: DW_SMEM(true)) bytes of dynamic shared memory, after df_sched_kernel with
 * DW_BNK keys a tile (as df_bwd_kv_kernel). The _ovl kernel loads chunks two ahead (three
 * stages) and builds the next chunks' row tables while a chunk's dK runs. */
__global__ void df_bwd_kv_wg_kernel(const DfP p);
__global__ void df_bwd_kv_wg_ovl_kernel(const DfP p);
/* The _ovl kernel that also writes each chunk's dS^T into its slot of p.ds (dS kept: blocks of
 * DW_QC rows, after df_delta_kernel and df_ds_plan_kernel), for df_bwd_q_wg_ds_kernel */
__global__ void df_bwd_kv_wg_ds_kernel(const DfP p);

#define DQW_MMAX 128                       /* pass Q: query rows of a CTA, two warpgroups of m64 */
#define DQW_BN 64                          /* keys of a K/V tile */
#define DQW_THREADS 256
#define DQW_TILE (DQW_BN * DW_D * 2)       /* bytes of a K (or V) tile */
/* ST stages of K and V, Q and dO (rows of D * 2 + 16 bytes), P and dS (rows of BN * 2 + 16) */
#define DQW_SMEM(ST) (2 * (ST) * DQW_TILE + 2 * DQW_MMAX * (DW_D * 2 + 16) + 2 * DQW_MMAX * (DQW_BN * 2 + 16) + 1024)

/* dS kept, pass Q: the context tiles stream through DQW_DS_CST stages of a K tile and the two
 * blocks' dS (2 DQW_TILE bytes a stage), which have the CTA's shared memory to themselves (Q and
 * dO are loaded after them, the block-key tiles' three stages too) */
#define DQW_DS_CST 6
#define DQW_DS_SMEM DQW_SMEM(3)
static_assert(DQW_DS_CST * 2 * DQW_TILE + 1024 <= DQW_DS_SMEM, "pass Q's context stages (dS kept)");

/* Pass Q (delta, dq, dk_blk, dv_blk) for head dimension 128, bf16, on compute capability 9 (as
 * df_bwd_q_kernel: grid n_bg * nkv with DQW_MMAX rows a CTA, DQW_THREADS threads, DQW_SMEM(2)
 * (the wg3 kernel: DQW_SMEM(3), three stages) bytes of dynamic shared memory) */
__global__ void df_bwd_q_wg_kernel(const DfP p);
__global__ void df_bwd_q_wg3_kernel(const DfP p);
/* as wg3, dQ += dS K of a tile running on while the next tile's S and dP are issued (tiles loaded
 * one ahead) */
__global__ void df_bwd_q_wg3p_kernel(const DfP p);
/* as wg3p, the stages handed over through mbarriers (a full and an empty one a stage) instead of
 * a block barrier a step (block barriers only around the block-key tiles' shared P and dS) */
__global__ void df_bwd_q_wg3m_kernel(const DfP p);
/* as wg3m, after df_bwd_kv_wg_ds_kernel: the context tiles' dQ += dS K with dS read from p.ds
 * (no S, dP or exponentials there), delta read from p.delta (DQW_DS_SMEM bytes) */
__global__ void df_bwd_q_wg_ds_kernel(const DfP p);

/* The forward (o, lse) for head dimension 128, bf16, on compute capability 9, on pass Q's CTAs
 * (grid n_bg * nkv with DQW_MMAX rows a CTA, DQW_THREADS threads) with DFW_SMEM(ST, BN) bytes of
 * dynamic shared memory: ST stages of K and V tiles of BN keys, and Q (rows of D * 2 + 16 bytes),
 * which with BN = 128 takes the place of the last V stage (once in registers) so that three
 * stages fit. BN 64: df_fwd_wg_kernel: plain schedule, 3 stages; _ovl3, _ovl4: P V of a tile
 * overlapped with the softmax of the next, 3 or 4 stages. BN 128: df_fwd_wg128_ovl3_kernel
 * (overlapped, 3 stages; the d128 default on Hopper). A plain BN 128 form of two stages passed
 * the emulator but gave wrong results on the H200, and was removed. */
#define DFW_TILE(BN) ((BN) * DW_D * 2)
#define DFW_QALIAS(BN) ((BN) == 128)
#define DFW_QBYTES (DQW_MMAX * (DW_D * 2 + 16))
#define DFW_SMEM(ST, BN) \
    (2 * (ST) * DFW_TILE(BN) + DFW_QBYTES - (DFW_QALIAS(BN) ? DFW_TILE(BN) : 0) + 1024)
__global__ void df_fwd_wg_kernel(const DfP p);
__global__ void df_fwd_wg_ovl3_kernel(const DfP p);
__global__ void df_fwd_wg_ovl4_kernel(const DfP p);
__global__ void df_fwd_wg128_ovl3_kernel(const DfP p);
/* The forward warp-specialized (BN 64, overlapped; a loading warpgroup and two multiplying ones
 * handing stages over through mbarriers): DFWS_THREADS threads, DFWS_SMEM bytes */
#define DFWS_ST 4
#define DFWS_THREADS 384
#define DFWS_LREGS 72
#define DFWS_MREGS 216
#define DFWS_SMEM (2 * DFWS_ST * DFW_TILE(64) + DFW_QBYTES + 8 * (1 + 4 * DFWS_ST) + 1024)
__global__ void df_fwd_ws_kernel(const DfP p);

#endif
