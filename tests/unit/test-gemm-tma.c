/* test-gemm-tma.c: the layout and schedule arithmetic of the TMA GEMM (kernels/gemm_tma.h) on
 * the CPU: where the tensor copies put each element of a stage (the 128-byte swizzle, relative
 * to a 1,024-byte aligned destination: 16-byte chunk c of row r at chunk c ^ (r % 8)), for the
 * A tile, the whole W tile and the W tile in two halves (SWIGLU's gate and up rows, or the two
 * blocks of a cluster), is where wgmma reads it through the kernel's descriptors (the model of
 * test-moe-wgmma.c); copies without the swizzle fail the same model; the stages fit the
 * block's shared memory; and the schedule gives every tile to exactly one block (cl 1) or
 * cluster (cl 2, row tiles in pairs), for ragged row counts, grids of one block, fewer blocks
 * than units and more. */
#include <stdint.h>
#include <stdlib.h>

#include "backend.h"
#include "t.h"
#include "../../kernels/gemm_tma.h"

/* wgmma's address of element (m, k) of a K-major bf16 operand through descriptor desc, per the
 * PTX ISA's canonical layouts: rows of the swizzle's width (mode 1: 128 bytes, 2: 64), 8-row
 * groups SBO bytes apart, then the swizzle of the address (the 16-byte chunk bits 4-6, or 4-5,
 * XORed with bits 7-9, or 7-8) */
static uint32_t model_addr(uint64_t desc, uint32_t m, uint32_t k)
{
    const uint32_t start = (uint32_t)(desc & 0x3FFF) << 4;
    const uint32_t sbo = (uint32_t)((desc >> 32) & 0x3FFF) << 4, mode = (uint32_t)(desc >> 62);
    const uint32_t rowb = mode == 1 ? 128 : 64, mask = mode == 1 ? 7 : 3;
    const uint32_t a = start + (m / 8) * sbo + (m % 8) * rowb + k * 2;
    return a ^ (((a >> 7) & mask) << 4);
}

/* where a tensor copy of a box of bk columns (rows of 2 bk bytes) to dst (aligned to the
 * swizzle's atom) puts its element (row r, column c): 16-byte chunk c / 8 of row r at chunk
 * (c / 8) ^ (r % 8) (128-byte rows) or (c / 8) ^ (r / 2 % 4) (64-byte rows) */
static uint32_t copy_addr(uint32_t dst, uint32_t r, uint32_t c, int bk, int swizzled)
{
    const uint32_t phase = bk == 64 ? r % 8 : r / 2 % 4;
    const uint32_t chunk = swizzled ? (c / 8) ^ phase : c / 8;
    return dst + r * (uint32_t)(2 * bk) + chunk * 16 + (c % 8) * 2;
}

/* mismatches over a stage at st of the form bk: A of each multiplying warpgroup, W from one copy
 * of GT_BN rows or two copies of GT_BN / 2 rows */
static int64_t stage_mismatch(uint32_t st, int bk, int halves, int swizzled)
{
    int64_t bad = 0;
    const uint32_t rowb = 2 * (uint32_t)bk;
    for (uint32_t kk = 0; kk < (uint32_t)bk / 16; kk++) {
        for (uint32_t c = 0; c < 2; c++) {
            const uint64_t da = gt_desc(st + c * 64 * rowb + kk * 32, bk);
            for (uint32_t m = 0; m < 64; m++)
                for (uint32_t k = 0; k < 16; k++)
                    bad += model_addr(da, m, k) != copy_addr(st, 64 * c + m, 16 * kk + k, bk, swizzled);
        }
        const uint64_t db = gt_desc(st + gt_ab(bk) + kk * 32, bk);
        for (uint32_t n = 0; n < GT_BN; n++) {
            const uint32_t box = halves ? n / (GT_BN / 2) : 0, row = halves ? n % (GT_BN / 2) : n;
            const uint32_t dst = st + gt_ab(bk) + box * (GT_BN / 2) * rowb;
            for (uint32_t k = 0; k < 16; k++)
                bad += model_addr(db, n, k) != copy_addr(dst, row, 16 * kk + k, bk, swizzled);
        }
    }
    return bad;
}

static void test_stage_layout(void)
{
    T_CHECK(GT_SMEM <= 227 * 1024, "%d bytes of shared memory", GT_SMEM);
    const int bks[] = {64, 32};
    for (int b = 0; b < 2; b++) {
        const int bk = bks[b], st = gt_stages(bk);
        const uint64_t d = gt_desc(1024, bk);
        T_EQ_INT((int64_t)(((d >> 32) & 0x3FFF) << 4), 16 * bk, "stride byte offset: 8 rows");
        T_EQ_INT((int64_t)(d >> 62), bk == 64 ? 1 : 2, "swizzle mode");
        T_EQ_INT((int64_t)((d >> 16) & 0x3FFF), 1, "leading byte offset (unused)");
        /* the worst alignment the kernel can get: base rounded up from 1 byte past a boundary */
        T_CHECK(1023 + st * gt_stb(bk) + 16 * st <= GT_SMEM, "bk %d: the stages and barriers fit", bk);
        T_EQ_INT(gt_stb(bk) % 1024, 0, "a stage keeps the next one aligned");
        T_EQ_INT(gt_ab(bk) % 1024, 0, "W's part is aligned");
        for (int halves = 0; halves < 2; halves++) {
            for (int s = 0; s < st; s++)
                T_EQ_INT(stage_mismatch(1024 + (uint32_t)s * gt_stb(bk), bk, halves, 1), 0,
                         "the copies' swizzle vs wgmma's reading");
            T_CHECK(stage_mismatch(1024, bk, halves, 0) > 0, "copies without the swizzle must not pass");
        }
    }
    /* the forms are not interchangeable: 128-byte rows read through the 64-byte form's
     * descriptor are elsewhere */
    T_CHECK(model_addr(gt_desc(1024, 32), 9, 3) != copy_addr(1024, 9, 3, 64, 1), "forms differ");
}

static void test_schedule(void)
{
    const int mts[] = {1, 2, 3, 15, 16, 17, 33, 128}, nts[] = {1, 3, 96};
    const int grids[] = {1, 2, 7, 66, 132, 4000};
    for (int cl = 1; cl <= 2; cl++)
        for (size_t a = 0; a < sizeof mts / sizeof *mts; a++)
            for (size_t b = 0; b < sizeof nts / sizeof *nts; b++)
                for (size_t g = 0; g < sizeof grids / sizeof *grids; g++) {
                    const int mt = mts[a], nt = nts[b], mp = (mt + cl - 1) / cl;
                    const int units = mp * nt, gm = GT_GM / cl, stride = grids[g];
                    int *seen = calloc((size_t)(mp * cl * nt), sizeof(int));
                    int64_t wrong = 0;
                    for (int blk = 0; blk < stride; blk++)
                        for (int u = blk; u < units; u += stride) {
                            int pm, tn;
                            gt_tile(u, mp, nt, gm, &pm, &tn);
                            wrong += pm < 0 || pm >= mp || tn < 0 || tn >= nt;
                            if (pm >= 0 && pm < mp && tn >= 0 && tn < nt)
                                for (int r = 0; r < cl; r++)
                                    seen[(pm * cl + r) * nt + tn]++;
                        }
                    int64_t cover = 0;
                    for (int tm = 0; tm < mp * cl; tm++)
                        for (int tn = 0; tn < nt; tn++)
                            cover += seen[tm * nt + tn] != 1;
                    T_EQ_INT(wrong, 0, "units outside the grid of tiles");
                    T_CHECK(cover == 0, "%lld tiles not taken exactly once (cl %d, %d x %d, %d "
                            "blocks)", (long long)cover, cl, mt, nt, stride);
                    free(seen);
                }
    /* the groups: the first GT_GM / cl units of a group share a column tile */
    int pm, tn, pm2, tn2;
    gt_tile(0, 100, 10, GT_GM, &pm, &tn);
    gt_tile(GT_GM - 1, 100, 10, GT_GM, &pm2, &tn2);
    T_CHECK(tn == tn2 && pm == 0 && pm2 == GT_GM - 1, "a group's row tiles go first");
}

int main(int argc, char **argv)
{
    (void)argc;
    t_init(argv[0]);
    T_RUN(test_stage_layout);
    T_RUN(test_schedule);
    return t_done();
}
