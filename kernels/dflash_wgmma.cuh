/* dflash_wgmma.cuh: the wgmma kernel of the DFlash attention backward's pass KV
 * (kernels/dflash_wgmma.cu) for kernels/dflash_attn.cu: its shape and its shared memory. Needs
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

#endif
