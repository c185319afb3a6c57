/* test-attn-wgmma.c: the shared-memory layout arithmetic of the wgmma attention kernel
 * (kernels/attn_wgmma.h) on the CPU. Independent models of how wgmma addresses its shared
 * operands through a descriptor with the 128-byte swizzle (the byte address's 16-byte chunk bits
 * 4-6 XORed with bits 7-9): K-major (8-row core groups SBO bytes apart, rows of 128 bytes, K
 * contiguous) for Q and K, MN-major (the transposed B of P V: 64 N-contiguous elements a 128-byte
 * row, one row a k, 8-row groups SBO apart, the next 64 of N LBO bytes on) for V. Every element
 * of every k16 step of both warpgroups' Q, of K and of V is found exactly where the kernel's
 * cp.async put it; the unswizzled layout and V read K-major fail the same models (the checks can
 * fail); the descriptors decode to the fields wgmma reads; and the load split covers every
 * 16-byte chunk of a tile once. */
#include <stdint.h>
#include <stdlib.h>

#include "t.h"
#include "../../kernels/attn_wgmma.h"

static uint32_t swz_addr(uint32_t a) { return a ^ (((a >> 7) & 7) << 4); }

/* element (m, k) of a K-major bf16 operand described by desc */
static uint32_t model_kmajor(uint64_t desc, uint32_t m, uint32_t k)
{
    const uint32_t start = (uint32_t)(desc & 0x3FFF) << 4, sbo = (uint32_t)((desc >> 32) & 0x3FFF) << 4;
    return swz_addr(start + (m / 8) * sbo + (m % 8) * 128 + k * 2);
}

/* element (n, k) of an MN-major bf16 operand described by desc */
static uint32_t model_mnmajor(uint64_t desc, uint32_t n, uint32_t k)
{
    const uint32_t start = (uint32_t)(desc & 0x3FFF) << 4, lbo = (uint32_t)((desc >> 16) & 0x3FFF) << 4,
                   sbo = (uint32_t)((desc >> 32) & 0x3FFF) << 4;
    return swz_addr(start + (n / 64) * lbo + (k / 8) * sbo + (k % 8) * 128 + (n % 64) * 2);
}

/* where the kernel's loads put element (row r, column c) of a tile of rows rows at base */
static uint32_t kernel_addr(uint32_t base, uint32_t rows, uint32_t r, uint32_t c, int swizzled)
{
    const uint32_t off = swizzled ? aw_off(rows, r, c / 8) : (c / 64) * rows * AW_ROWB + r * AW_ROWB + (c % 64) / 8 * 16;
    return base + off + (c % 8) * 2;
}

static void test_v_descriptor(void)
{
    const uint32_t addrs[] = {1024, 1024 + 3 * 2048, 1024 + AW_TILEB + 15 * 2048, AW_SMEM - 2048};
    for (size_t i = 0; i < sizeof addrs / sizeof *addrs; i++) {
        const uint64_t d = aw_desc_mn(addrs[i]);
        T_EQ_INT((int64_t)((d & 0x3FFF) << 4), (int64_t)addrs[i], "start address");
        T_EQ_INT((int64_t)(((d >> 16) & 0x3FFF) << 4), AW_BN * AW_ROWB, "leading byte offset: the halves");
        T_EQ_INT((int64_t)(((d >> 32) & 0x3FFF) << 4), 1024, "stride byte offset: 8-row groups");
        T_EQ_INT((int64_t)(d >> 62), 1, "swizzle mode 128 bytes");
        T_EQ_INT((int64_t)(d & 0x3FFFC000C000C000ull), 0, "reserved and base-offset bits");
    }
}

/* mismatches of S = Q K^T's operands (Q at q, K at k) and of P V's (V at v) against the models */
static int64_t mismatches(uint32_t q, uint32_t k, uint32_t v, int swizzled, int v_kmajor)
{
    int64_t bad = 0;
    for (uint32_t kk = 0; kk < AW_D / 16; kk++) {
        for (uint32_t w = 0; w < 2; w++) {
            const uint64_t da = mw_desc(q + aw_koff(AW_BM, kk) + w * 64 * AW_ROWB);
            for (uint32_t m = 0; m < 64; m++)
                for (uint32_t c = 0; c < 16; c++)
                    bad += model_kmajor(da, m, c) != kernel_addr(q, AW_BM, 64 * w + m, 16 * kk + c, swizzled);
        }
        const uint64_t db = mw_desc(k + aw_koff(AW_BN, kk));
        for (uint32_t n = 0; n < AW_BN; n++)
            for (uint32_t c = 0; c < 16; c++)
                bad += model_kmajor(db, n, c) != kernel_addr(k, AW_BN, n, 16 * kk + c, swizzled);
    }
    for (uint32_t kb = 0; kb < AW_BN / 16; kb++) {
        const uint64_t db = aw_desc_mn(v + aw_voff(kb));
        for (uint32_t n = 0; n < AW_D; n++)   /* N: V's columns; K: its rows (keys) */
            for (uint32_t c = 0; c < 16; c++) {
                const uint32_t want = kernel_addr(v, AW_BN, 16 * kb + c, n, swizzled);
                bad += (v_kmajor ? model_kmajor(db, n, c) : model_mnmajor(db, n, c)) != want;
            }
    }
    return bad;
}

static void test_tiles_vs_wgmma(void)
{
    /* the kernel's tiles: Q, then two stages of K, then two of V, from a 1,024-aligned base */
    const uint32_t base = 1024, q = base, k0 = q + AW_TILEB, v0 = k0 + 2 * AW_TILEB;
    T_CHECK(v0 + 2 * AW_TILEB <= AW_SMEM + (base - 1024) && AW_SMEM <= 227 * 1024, "shared memory");
    for (uint32_t st = 0; st < 2; st++) {
        T_EQ_INT((k0 + st * AW_TILEB) % 1024, 0, "K stage alignment");
        T_EQ_INT((v0 + st * AW_TILEB) % 1024, 0, "V stage alignment");
        T_EQ_INT(mismatches(q, k0 + st * AW_TILEB, v0 + st * AW_TILEB, 1, 0), 0,
                 "swizzled layout vs wgmma's reading");
    }
    T_CHECK(mismatches(q, k0, v0, 0, 0) > 0, "the unswizzled layout must not pass");
    T_CHECK(mismatches(q, k0, v0, 1, 1) > 0, "V read K-major must not pass");
}

/* aw_load_tile's split for NT threads (AW_THREADS: kernels 0 and 1; AW_WS_LT: the loading
 * warpgroup of kernel 2): thread t, chunk t % 16 of rows t / 16 + (NT / 16) i; every chunk of the
 * tile written once (no chunk twice, as many writes as chunks) */
static void check_tile_loads(uint32_t nt)
{
    const uint32_t n = AW_TILEB / 16, rs = nt / 16, loads = AW_BN / rs;
    uint8_t *seen = calloc(n, 1);
    int64_t twice = 0, outside = 0, writes = 0;
    for (uint32_t t = 0; t < nt; t++)
        for (uint32_t i = 0; i < loads; i++, writes++) {
            const uint32_t off = aw_off(AW_BM, t / 16, t % 16) + i * rs * AW_ROWB;
            T_EQ_INT(off, aw_off(AW_BM, t / 16 + rs * i, t % 16), "the row's phase is the same for every i");
            if (off / 16 >= n)
                outside++;
            else
                twice += seen[off / 16]++ > 0;
        }
    T_EQ_INT(writes, n, "chunks a tile");
    T_EQ_INT(outside, 0, "chunks outside the tile");
    T_EQ_INT(twice, 0, "chunks written twice");
    free(seen);
}

static void test_tile_loads(void)
{
    check_tile_loads(AW_THREADS);
    check_tile_loads(AW_WS_LT);
}

int main(int argc, char **argv)
{
    (void)argc;
    t_init(argv[0]);
    T_RUN(test_v_descriptor);
    T_RUN(test_tiles_vs_wgmma);
    T_RUN(test_tile_loads);
    return t_done();
}
