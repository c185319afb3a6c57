/* moe_wgmma.h: the shared-memory layout of the wgmma grouped expert GEMM (kernels/moe_wgmma.cu),
 * plain C so that tests/unit/test-moe-wgmma.c checks the same arithmetic on the CPU.
 * A stage holds the A tile (MW_BM grouped rows) then the W tile (BN weight rows), each row
 * MW_BK = 64 bf16 of K = 128 bytes, in the 128-byte swizzle that wgmma's descriptors name
 * (swizzle mode 1): 16-byte chunk ch of row r sits at chunk ch ^ (r % 8) of its row, in atoms
 * of 8 rows (1,024 bytes, 1,024-byte aligned). A K-major operand of such rows is described by
 * its start address, a stride of 1,024 bytes between 8-row groups (SBO), the leading offset
 * unused (LBO 1, as for every swizzled K-major layout whose K step fits in one row) and the
 * swizzle mode; the k16 slices of a row are its 32-byte steps, reached by adding kk 32 bytes to
 * the start address (the swizzle is a function of the address bits, the row's phase coming from
 * bits 7-9). */
#ifndef DFL_MOE_WGMMA_H
#define DFL_MOE_WGMMA_H

#include <stdint.h>

#ifdef __CUDACC__
#define MW_HD static inline __host__ __device__
#else
#define MW_HD static inline
#endif

#define MW_BM 128       /* grouped rows of a tile: two warpgroups of m64 */
#define MW_BK 64        /* K columns of a stage: one 128-byte row */
#define MW_ROWB 128     /* bytes of a shared row */
#define MW_THREADS 256  /* two warpgroups (the warp-specialized form: a third loads) */
#define MW_SBO 1024     /* bytes between 8-row groups */

/* Byte offset, from a 1,024-byte aligned tile, of the 16-byte chunk ch (0..7) of row r. */
MW_HD uint32_t mw_swz(uint32_t r, uint32_t ch) { return r * MW_ROWB + ((ch ^ (r & 7u)) << 4); }

/* The wgmma descriptor of a K-major bf16 operand in the layout above starting at shared
 * address addr (bits 0-13: addr / 16; 16-29: LBO / 16; 32-45: SBO / 16; 62-63: swizzle). */
MW_HD uint64_t mw_desc(uint32_t addr)
{
    return (uint64_t)((addr & 0x3FFFFu) >> 4) | (uint64_t)1 << 16 | (uint64_t)(MW_SBO >> 4) << 32 |
           (uint64_t)1 << 62;
}

/* The load split among lt loading threads (a multiple of 8): chunk i (0 .. rows * 8 / lt - 1)
 * of thread tid is row tid / 8 + (lt / 8) i, 16-byte chunk tid % 8, at shared offset
 * mw_swz(tid / 8, tid % 8) + i (lt / 8) MW_ROWB (the row's phase r % 8 is the same for every i
 * when lt / 8 is a multiple of 8). */
MW_HD uint32_t mw_load_row(uint32_t tid, uint32_t i, uint32_t lt) { return tid / 8 + lt / 8 * i; }
MW_HD uint32_t mw_load_off(uint32_t tid, uint32_t i, uint32_t lt)
{
    return mw_swz(tid / 8, tid % 8) + i * (lt / 8) * MW_ROWB;
}

/* The expert of grouped row g (below offsets[E]): the last e with offsets[e] <= g (empty experts
 * share their offset with the next one). */
MW_HD int mw_expert_of(const int32_t *offsets, int E, int64_t g)
{
    int lo = 0, hi = E - 1;
    while (lo < hi) {
        const int mid = (lo + hi + 1) / 2;
        if (offsets[mid] <= g)
            lo = mid;
        else
            hi = mid - 1;
    }
    return lo;
}

/* The schedule of the persistent kernel (tile shape 6 and 7 of kernels/moe_wgmma.cu): of the
 * tiles t, t + stride, t + 2 stride, ... below nt (tile t: row tile t / ntc, grouped rows from
 * MW_BM (t / ntc), and column tile t % ntc), the first that holds a row of an expert, with its
 * first row *g0, the end *end of its expert's rows and the expert *e; nt when there is none.
 * A block b of a grid of stride blocks multiplies the tiles this gives from b on, each next one
 * from the last one + stride, and loads them in the same order. */
MW_HD int64_t mw_next_tile(int64_t t, int64_t stride, int64_t nt, int64_t ntc,
                           const int32_t *counts, const int32_t *offsets, int E, int64_t *g0,
                           int64_t *end, int *e)
{
    for (; t < nt; t += stride) {
        *g0 = t / ntc * MW_BM;
        if (*g0 >= offsets[E])
            return nt; /* past the last expert's rows, as is every later tile */
        *e = mw_expert_of(offsets, E, *g0);
        *end = (int64_t)offsets[*e] + counts[*e];
        if (*g0 < *end)
            return t;
    }
    return nt;
}

#endif
