/* attn_wgmma.h: the shared-memory layout of the wgmma attention kernel (kernels/attn_wgmma.cu),
 * plain C so that tests/unit/test-attn-wgmma.c checks the same arithmetic on the CPU.
 * A tile (Q: AW_BM rows; K or V: AW_BN rows) of head dimension AW_D = 128 is two halves of 64
 * columns, half h at h * rows * 128 bytes from the tile's (1,024-byte aligned) start, each a
 * column of rows of 128 bytes in the 128-byte swizzle of moe_wgmma.h (mw_swz). Q and K are the
 * K-major operands of S = Q K^T: their k16 step kk is the 32-byte step kk % 4 of half kk / 4
 * (mw_desc: stride of 1,024 bytes between 8-row groups). V is the B operand of O = P V in the
 * MN-major (transposed-B) form: its k16 step kb is the 16 rows from kb * 16, the 8-row groups
 * 1,024 bytes apart (the descriptor's stride), the two 64-column halves AW_BN * 128 bytes apart
 * (the descriptor's leading offset). */
#ifndef DFL_ATTN_WGMMA_H
#define DFL_ATTN_WGMMA_H

#include <stdint.h>

#include "moe_wgmma.h"

#define AW_D 128         /* head dimension */
#define AW_BM 128        /* query rows of a block: two warpgroups of m64 */
#define AW_BN 128        /* keys of a tile */
#define AW_ROWB 128      /* bytes of a shared row (64 columns) */
#define AW_THREADS 256
#define AW_TILEB (AW_BN * AW_D * 2)                   /* bytes of a tile (Q, K or V) */
#define AW_SMEM (5 * AW_TILEB + 1024)                 /* Q, 2 stages of K and V, room to align */
/* the warp-specialized persistent form (kernel 2): two multiplying warpgroups and a loading
 * warp; Q, AW_WS_ST stages of K and of V, O's staging tile, then the mbarriers (qfull, qempty,
 * kfull[ST], kempty[ST], vfull[ST], vempty[ST]: 8 bytes each) */
#define AW_WS_LT 128                                  /* loading threads */
#define AW_WS_THREADS (256 + AW_WS_LT)
#define AW_WS_LREGS 56                                /* registers a loading thread (setmaxnreg) */
#define AW_WS_MREGS 224                               /* and a multiplying one: 128 x 56 + 256 x 224 <= 64 Ki */
#define AW_WS_ST 2
#define AW_WS_BARB (8 * (2 + 4 * AW_WS_ST))
#define AW_WS_SMEM ((2 + 2 * AW_WS_ST) * AW_TILEB + AW_WS_BARB + 1024)

/* Byte offset of the 16-byte chunk ch (0..15) of row r in a tile of rows rows */
MW_HD uint32_t aw_off(uint32_t rows, uint32_t r, uint32_t ch)
{
    return (ch >> 3) * rows * AW_ROWB + mw_swz(r, ch & 7u);
}

/* Byte offset of k16 step kk (0..7) of a K-major tile of rows rows (its descriptor's start) */
MW_HD uint32_t aw_koff(uint32_t rows, uint32_t kk) { return (kk >> 2) * rows * AW_ROWB + (kk & 3u) * 32; }

/* Byte offset of k16 step kb (0..AW_BN / 16 - 1) of the V tile */
MW_HD uint32_t aw_voff(uint32_t kb) { return kb * 16 * AW_ROWB; }

/* The wgmma descriptor of V's k16 step starting at shared address addr (MN-major, 128-byte
 * swizzle: leading offset AW_BN * 128 between the halves, stride 1,024 between 8-row groups) */
MW_HD uint64_t aw_desc_mn(uint32_t addr)
{
    return (uint64_t)((addr & 0x3FFFFu) >> 4) | (uint64_t)((AW_BN * AW_ROWB) >> 4) << 16 |
           (uint64_t)(MW_SBO >> 4) << 32 | (uint64_t)1 << 62;
}

#endif
