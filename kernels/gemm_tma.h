/* gemm_tma.h: the tile shape, shared-memory layout and schedule of the TMA GEMM
 * (kernels/gemm_tma.cu), plain C so that tests/unit/test-gemm-tma.c checks the same arithmetic
 * on the CPU. A stage holds the A tile (GT_BM rows) then the W tile (GT_BN rows), each row
 * GT_BK = 64 bf16 of K (128 bytes) in the 128-byte swizzle of moe_wgmma.h, which the tensor
 * copies write (CU_TENSOR_MAP_SWIZZLE_128B) and wgmma's descriptors name; every part starts on a
 * 1,024-byte boundary (the swizzle's atom). */
#ifndef DFL_GEMM_TMA_H
#define DFL_GEMM_TMA_H

#ifdef __CUDACC__
#define GT_HD static inline __host__ __device__
#else
#define GT_HD static inline
#endif

#define GT_BM 128                          /* rows of a tile: two warpgroups of m64 */
#define GT_BN 256                          /* columns of a tile (SWIGLU: 128 gate + 128 up) */
#define GT_BK 64                           /* K columns of a stage: one 128-byte row */
#define GT_ST 4                            /* stages */
#define GT_GM 16                           /* row tiles of a group of the schedule */
#define GT_THREADS 384                     /* a loading warpgroup and two multiplying ones */
#define GT_AB (GT_BM * GT_BK * 2)          /* 16,384 bytes: a stage's A tile */
#define GT_STB (GT_AB + GT_BN * GT_BK * 2) /* 49,152 bytes: a stage */
#define GT_SMEM (GT_ST * GT_STB + 16 * GT_ST + 1024) /* + the barriers, + room to align */

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
