/* gemm_tma.h: the tile shape, shared-memory layout and schedule of the TMA GEMM
 * (kernels/gemm_tma.cu), plain C so that tests/unit/test-gemm-tma.c checks the same arithmetic
 * on the CPU. A stage holds the A tile (GT_BM rows) then the W tile (GT_BN rows), each row
 * GT_BK = 64 bf16 of K (128 bytes) in the 128-byte swizzle of moe_wgmma.h, which the tensor
 * copies write (CU_TENSOR_MAP_SWIZZLE_128B) and wgmma's descriptors name; every part starts on a
 * 1,024-byte boundary (the swizzle's atom). */
#ifndef DFL_GEMM_TMA_H
#define DFL_GEMM_TMA_H

#ifdef __CUDACC__
#define GT_HD static constexpr __host__ __device__
#else
#define GT_HD static inline
#endif

#include <stdint.h>

#define GT_BM 128                          /* rows of a tile: two warpgroups of m64 */
#define GT_BN 256                          /* columns of a tile (SWIGLU: 128 gate + 128 up) */
#define GT_BK 64                           /* K columns of a stage (the default form) */
#define GT_GM 16                           /* row tiles of a group of the schedule */
#define GT_THREADS 384                     /* a loading warpgroup and two multiplying ones */

/* The two stage forms, by the K columns bk a stage holds: 64 (rows of 128 bytes in the 128-byte
 * swizzle, 4 stages of 48 KB) or 32 (rows of 64 bytes in the 64-byte swizzle: 16-byte chunk c
 * of row r at chunk c ^ (r / 2 % 4), in atoms of 8 rows (512 bytes); 8 stages of 24 KB, so that
 * 7 stages (168 KB) can load while one is multiplied, against 3 (144 KB)). */
GT_HD int gt_stages(int bk) { return bk == 64 ? 4 : 8; }
GT_HD uint32_t gt_ab(int bk) { return GT_BM * bk * 2; }              /* a stage's A tile */
GT_HD uint32_t gt_stb(int bk) { return (GT_BM + GT_BN) * bk * 2; }   /* a stage */
/* the wgmma descriptor of a K-major bf16 operand at shared address addr in the form's swizzle
 * (bits 0-13: addr / 16; 16-29: LBO / 16, unused; 32-45: SBO / 16, the bytes between 8-row
 * groups; 62-63: the swizzle, 1 = 128 bytes, 2 = 64 bytes) */
GT_HD uint64_t gt_desc(uint32_t addr, int bk)
{
    const uint64_t sbo = 8u * (uint32_t)bk * 2u, mode = bk == 64 ? 1 : 2;
    return (uint64_t)((addr & 0x3FFFFu) >> 4) | (uint64_t)1 << 16 | (sbo >> 4) << 32 | mode << 62;
}
/* shared memory of a block in either form: the stages, their barriers, room to align */
#define GT_SMEM (8 * (GT_BM + GT_BN) * 32 * 2 + 16 * 8 + 1024)

/* The schedule. The units of work are tiles (cl 1) or pairs of row tiles 2 p, 2 p + 1 of one
 * column tile (cl 2: a cluster of two blocks, one row tile each): mp = ceil(mt / cl) row units
 * by nt column tiles. Unit u is row unit *pm and column tile *tn, in groups of gm = GT_GM / cl
 * row units, the row unit fastest within a group (so that the units at work at one time share
 * their W tiles in L2). Block (or cluster) b of g takes the units b, b + g, b + 2 g, ... */
GT_HD void gt_tile(int u, int mp, int nt, int gm, int *pm, int *tn)
{
    const int per = gm * nt, g = u / per, r = u - g * per;
    const int h = gm < mp - g * gm ? gm : mp - g * gm;
    *pm = g * gm + r % h;
    *tn = r / h;
}

#endif
