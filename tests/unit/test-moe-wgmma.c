/* test-moe-wgmma.c: the shared-memory layout arithmetic of the wgmma grouped expert GEMM
 * (kernels/moe_wgmma.h) on the CPU: the descriptors decode to the fields wgmma reads; an
 * independent model of how wgmma addresses a K-major bf16 operand through a descriptor with the
 * 128-byte swizzle (PTX ISA: 8-row core groups SBO bytes apart, rows of 128 bytes, the 16-byte
 * chunk bits 4-6 of the byte address XORed with bits 7-9) finds every element (row m, column k)
 * of every k16 step of both warpgroups' A and of W (n128 and n256) exactly where the kernel's
 * cp.async put it; the unswizzled layout fails the same model (the check can fail); the load
 * split covers every 16-byte chunk of a stage once; and the persistent kernel's schedule takes
 * every tile with an expert row once. */
#include <stdint.h>
#include <stdlib.h>

#include "backend.h"
#include "t.h"
#include "../../kernels/moe_wgmma.h"

/* The byte address wgmma reads for element (m, k) (bf16, K-major) of the operand described by
 * desc, per the PTX ISA's canonical layout with the 128-byte swizzle. */
static uint32_t model_addr(uint64_t desc, uint32_t m, uint32_t k)
{
    const uint32_t start = (uint32_t)(desc & 0x3FFF) << 4;
    const uint32_t sbo = (uint32_t)((desc >> 32) & 0x3FFF) << 4;
    const uint32_t a = start + (m / 8) * sbo + (m % 8) * 128 + k * 2;
    return a ^ (((a >> 7) & 7) << 4);
}

/* Where the kernel's loads put element (row r, column c) of a tile at base (c < MW_BK). */
static uint32_t kernel_addr(uint32_t base, uint32_t r, uint32_t c, int swizzled)
{
    return base + (swizzled ? mw_swz(r, c / 8) : r * MW_ROWB + (c / 8) * 16) + (c % 8) * 2;
}

static void test_desc_fields(void)
{
    const uint32_t addrs[] = {0, 1024, 16384 + 32, 99328, 197632 - 1024 + 96};
    for (size_t i = 0; i < sizeof addrs / sizeof *addrs; i++) {
        const uint64_t d = mw_desc(addrs[i]);
        T_EQ_INT((int64_t)((d & 0x3FFF) << 4), (int64_t)addrs[i], "start address");
        T_EQ_INT((int64_t)((d >> 16) & 0x3FFF), 1, "leading byte offset (unused)");
        T_EQ_INT((int64_t)(((d >> 32) & 0x3FFF) << 4), MW_SBO, "stride byte offset");
        T_EQ_INT((int64_t)(d >> 62), 1, "swizzle mode 128 bytes");
        T_EQ_INT((int64_t)(d & 0x3FFFC000C000C000ull), 0, "reserved and base-offset bits");
    }
}

/* Mismatches between the model and the kernel's layout over one stage of a tile shape BN: A of
 * warpgroup w at rows 64 w, W at the stage's A bytes; every k16 step kk at kk 32 bytes. */
static int64_t stage_mismatch(uint32_t stage, uint32_t BN, int swizzled)
{
    int64_t bad = 0;
    const uint32_t AB = MW_BM * MW_ROWB;
    for (uint32_t kk = 0; kk < MW_BK / 16; kk++) {
        for (uint32_t w = 0; w < 2; w++) {
            const uint64_t da = mw_desc(stage + w * 64 * MW_ROWB + kk * 32);
            for (uint32_t m = 0; m < 64; m++)
                for (uint32_t k = 0; k < 16; k++)
                    bad += model_addr(da, m, k) !=
                           kernel_addr(stage, 64 * w + m, 16 * kk + k, swizzled);
        }
        const uint64_t db = mw_desc(stage + AB + kk * 32);
        for (uint32_t n = 0; n < BN; n++)
            for (uint32_t k = 0; k < 16; k++)
                bad += model_addr(db, n, k) != kernel_addr(stage + AB, n, 16 * kk + k, swizzled);
    }
    return bad;
}

static void test_operand_layout(void)
{
    const uint32_t bns[] = {128, 256};
    for (int b = 0; b < 2; b++) {
        const uint32_t BN = bns[b], STB = (MW_BM + BN) * MW_ROWB;
        /* every stage that fits in a block's 227 KiB (the kernel aligns its base to 1,024) */
        for (uint32_t s = 0; 1024 + (s + 1) * STB <= 227 * 1024; s++) {
            const uint32_t stage = 1024 + s * STB;
            T_EQ_INT(stage % 1024, 0, "stage alignment");
            T_EQ_INT(stage_mismatch(stage, BN, 1), 0, "swizzled layout vs wgmma's reading");
        }
        T_CHECK(stage_mismatch(1024, BN, 0) > 0, "the unswizzled layout must not pass");
    }
}

static void test_load_split(void)
{
    const uint32_t rows_of[] = {MW_BM, 128, 256}, lts[] = {MW_THREADS, 128};
    for (int l = 0; l < 2; l++)
        for (int q = 0; q < 3; q++) {
            const uint32_t R = rows_of[q], lt = lts[l], per = R * 8 / lt;
            uint8_t *seen = calloc(R * MW_ROWB / 16, 1);
            for (uint32_t t = 0; t < lt; t++)
                for (uint32_t i = 0; i < per; i++) {
                    const uint32_t r = mw_load_row(t, i, lt), off = mw_load_off(t, i, lt);
                    T_CHECK(r < R, "row %u of %u", r, R);
                    T_EQ_INT(off, mw_swz(r, t % 8), "the load offset is the swizzled chunk");
                    if (off / 16 < R * MW_ROWB / 16)
                        seen[off / 16]++;
                }
            int64_t wrong = 0;
            for (uint32_t c = 0; c < R * MW_ROWB / 16; c++)
                wrong += seen[c] != 1;
            T_EQ_INT(wrong, 0, "chunks not written exactly once");
            free(seen);
        }
}

/* The persistent kernel's schedule (mw_next_tile): over the blocks of a grid, every tile that
 * holds a row of an expert exactly once, each block's tiles ascending and its own (b + i stride),
 * with the first row, expert and end of rows of a search over the experts; for expert counts
 * with empty experts (first, inside, last), single rows, whole tiles, row tiles past the last
 * expert, grids of one block, fewer blocks than tiles, and more. */
static void test_schedule(void)
{
    enum { E = 8 };
    const int32_t sets[][E] = {{0, 300, 1, 0, 128, 257, 0, 0}, {129, 0, 0, 5, 1000, 127, 128, 1},
                               {0, 0, 0, 0, 0, 0, 0, 0}};
    for (int q = 0; q < 3; q++) {
        const int32_t *cnt = sets[q];
        int32_t off[E + 1];
        off[0] = 0;
        for (int e = 0; e < E; e++)
            off[e + 1] = off[e] + (cnt[e] + DFL_MOE_PAD - 1) / DFL_MOE_PAD * DFL_MOE_PAD;
        const int64_t cap = off[E] + 3 * MW_BM; /* row tiles past the last expert's rows */
        const int64_t ntcs[] = {1, 3, 8};
        for (int c = 0; c < 3; c++) {
            const int64_t ntc = ntcs[c], nt = ntc * (cap / MW_BM);
            const int64_t strides[] = {1, 2, 7, 132, nt + 5};
            for (int si = 0; si < 5; si++) {
                const int64_t stride = strides[si];
                int *seen = calloc((size_t)nt, sizeof(int));
                int64_t wrong = 0;
                for (int64_t b = 0; b < stride; b++) {
                    int64_t g0 = -1, end = -1, prev = -1;
                    int e = -1;
                    for (int64_t t = mw_next_tile(b, stride, nt, ntc, cnt, off, E, &g0, &end, &e);
                         t < nt;
                         t = mw_next_tile(t + stride, stride, nt, ntc, cnt, off, E, &g0, &end, &e)) {
                        wrong += t < b || (t - b) % stride != 0 || t <= prev;
                        prev = t;
                        seen[t]++;
                        wrong += g0 != t / ntc * MW_BM;
                        wrong += e < 0 || e >= E || !(off[e] <= g0 && g0 < off[e] + cnt[e]) ||
                                 end != off[e] + cnt[e];
                    }
                }
                int64_t cover = 0;
                for (int64_t t = 0; t < nt; t++) {
                    const int64_t g = t / ntc * MW_BM;
                    int want = 0;
                    for (int e = 0; e < E; e++)
                        want |= off[e] <= g && g < off[e] + cnt[e];
                    cover += seen[t] != want;
                }
                T_EQ_INT(wrong, 0, "tiles out of order, of another block, or with a wrong expert");
                T_EQ_INT(cover, 0, "tiles with a row of an expert not taken exactly once (or "
                                   "empty ones taken)");
                free(seen);
            }
        }
    }
}

int main(int argc, char **argv)
{
    (void)argc;
    t_init(argv[0]);
    T_RUN(test_desc_fields);
    T_RUN(test_operand_layout);
    T_RUN(test_load_split);
    T_RUN(test_schedule);
    return t_done();
}
