/* wgmma.h: Hopper's warpgroup MMA (the helpers of kernels/wgmma_ptx.cuh) for the SIMT emulator
 * (simt.h), so that emu-dflash runs the wgmma kernels of kernels/dflash_wgmma.cu on the CPU.
 * Include it after simt.h and before the kernel file: it takes wgmma_ptx.cuh's include guard.
 *
 * A wgmma is a collective of the 128 threads of a warpgroup (threads 128 w .. 128 w + 127): the
 * last to arrive computes D = (scale_d ? D : 0) + A B for all of them, at once (the asynchrony is
 * not emulated: fence, commit, wait and the proxy fence are no-ops, and a kernel that reads an
 * accumulator before its wait goes unnoticed). Built from the PTX ISA's layouts, independently of
 * how the kernels use them:
 *  - accumulator (m64 x nN, f32): warp w % 4 of the warpgroup holds rows 16 (w % 4) + lane / 4
 *    (+ 8), its n8 tile j the columns 8 j + 2 (lane % 4) (+ 1): d[j][0..3] as an mma.sync m16n8
 *    accumulator;
 *  - A from registers: the warp's 16 rows as the mma.sync m16n8k16 A fragment;
 *  - operands in shared memory through a descriptor (start address, leading byte offset LBO,
 *    stride byte offset SBO, swizzle mode; only the 128-byte swizzle, mode 1, is taken): K-major
 *    (A, or B with tnspB 0): row r (of M or N), k (0..15) at start + (r / 8) SBO + (r % 8) 128 +
 *    2 k; MN-major (B with tnspB 1): k, column n at start + (n / 64) LBO + (k / 8) SBO +
 *    (k % 8) 128 + 2 (n % 64); the 128-byte swizzle then moves the address's 16-byte chunk (bits
 *    4-6) by XOR with its bits 7-9.
 * Products of the bf16 inputs are summed in f32 in k order. */
#ifndef DFL_EMU_WGMMA_H
#define DFL_EMU_WGMMA_H

#define DFL_WGMMA_PTX_CUH 1   /* kernels/wgmma_ptx.cuh: these take its place */

#include <array>

namespace emu {

struct WgIn {
    float d[64];
    uint32_t a[4];
    uint64_t da, db;
    int n, scale_d, a_regs, tnsp_b;
};

struct WgSlot {
    int arrived = 0;
    WgIn in[128];
    float out[128][64];
};

inline WgSlot *wg_slots()
{
    static WgSlot s[8];   /* up to 1,024 threads */
    return s;
}

/* the byte address of an element through a descriptor: K-major (row r, k) or MN-major (k, col n) */
inline uint32_t wg_addr(uint64_t desc, bool mn, int r_or_k, int k_or_n)
{
    const uint32_t start = (uint32_t)(desc & 0x3FFFu) << 4, lbo = (uint32_t)((desc >> 16) & 0x3FFFu) << 4;
    const uint32_t sbo = (uint32_t)((desc >> 32) & 0x3FFFu) << 4, mode = (uint32_t)(desc >> 62);
    if (mode != 1)
        die("wgmma descriptor: only the 128-byte swizzle is emulated");
    uint32_t lin;
    if (!mn) {
        const uint32_t r = (uint32_t)r_or_k, k = (uint32_t)k_or_n;
        lin = start + (r / 8) * sbo + (r % 8) * 128 + 2 * k;
    } else {
        const uint32_t k = (uint32_t)r_or_k, n = (uint32_t)k_or_n;
        lin = start + (n / 64) * lbo + (k / 8) * sbo + (k % 8) * 128 + 2 * (n % 64);
    }
    return lin ^ (((lin >> 7) & 7u) << 4);
}

inline float wg_elem(uint32_t addr)
{
    uint16_t h;
    memcpy(&h, smem_at(addr, 2), 2);
    return emu_bf(h, 0);
}

inline void wg_mma(float *d, int n, const uint32_t *a, uint64_t da, uint64_t db, int scale_d, bool a_regs, bool tnsp_b)
{
    Cta *c = cta();
    const int lin = c->cur, wg = lin / 128, t = lin % 128;
    const int nt = (int)(c->bdim.x * c->bdim.y * c->bdim.z);
    if (nt < 128 * (wg + 1))
        die("wgmma with a partial warpgroup");
    WgSlot &s = wg_slots()[wg];
    WgIn &x = s.in[t];
    memcpy(x.d, d, sizeof(float) * (size_t)n / 2);
    if (a_regs)
        memcpy(x.a, a, sizeof x.a);
    x.da = da, x.db = db, x.n = n, x.scale_d = scale_d, x.a_regs = a_regs, x.tnsp_b = tnsp_b;
    if (++s.arrived == 128) {
        const WgIn &x0 = s.in[0];
        for (int l = 1; l < 128; l++) {
            const WgIn &y = s.in[l];
            if (y.n != x0.n || y.a_regs != x0.a_regs || y.tnsp_b != x0.tnsp_b || y.db != x0.db ||
                (!x0.a_regs && y.da != x0.da) || y.scale_d != x0.scale_d)
                die("threads of a warpgroup issued different wgmma");
        }
        static float A[64][16], B[16][256];
        for (int m = 0; m < 64; m++)
            for (int k = 0; k < 16; k++) {
                if (x0.a_regs) {
                    /* the A fragment of warp m / 16: lane 4 g + t holds (g, 2t..), (g+8, 2t..), (g, 2t+8..), (g+8, 2t+8..) */
                    const int w = m / 16, rr = m % 16, g = rr % 8, kt = (k % 8) / 2;
                    const int reg = (rr >= 8 ? 1 : 0) + (k >= 8 ? 2 : 0);
                    A[m][k] = emu_bf(s.in[32 * w + 4 * g + kt].a[reg], k & 1);
                } else {
                    A[m][k] = wg_elem(wg_addr(x0.da, false, m, k));
                }
            }
        for (int k = 0; k < 16; k++)
            for (int j = 0; j < n; j++)
                B[k][j] = x0.tnsp_b ? wg_elem(wg_addr(x0.db, true, k, j)) : wg_elem(wg_addr(x0.db, false, j, k));
        for (int l = 0; l < 128; l++) {
            const int w = l / 32, g = (l % 32) / 4, t4 = l % 4;
            for (int j = 0; j < n / 8; j++)
                for (int e = 0; e < 4; e++) {
                    const int m = 16 * w + g + 8 * (e >> 1), col = 8 * j + 2 * t4 + (e & 1);
                    float acc = x0.scale_d ? s.in[l].d[4 * j + e] : 0.0f;
                    for (int k = 0; k < 16; k++)
                        acc += A[m][k] * B[k][col];
                    s.out[l][4 * j + e] = acc;
                }
        }
        s.arrived = 0;
        for (int l = 0; l < 128; l++)
            if (c->f[(size_t)(128 * wg + l)].wait == 2)
                c->f[(size_t)(128 * wg + l)].wait = 0;
    } else {
        c->f[(size_t)lin].wait = 2;
        yield();
    }
    memcpy(d, s.out[t], sizeof(float) * (size_t)n / 2);
}

} /* namespace emu */

inline void wg_fence() {}
inline void wg_commit() {}
template <int N> inline void wg_wait() {}
inline void wg_proxy_fence() {}

/* mbarriers (kernels/wgmma_ptx.cuh's wg_bar_*): 8 bytes of shared memory, the arrivals still
 * expected in the current phase, then a tag, the count and the phase bit (so that an arrival
 * on memory never initialized, or one arrival too many, stops the emulator); a cp.async
 * arrival lands the thread's cp.async first. A waiting thread polls (emu::spin). setmaxnreg is a
 * no-op. */
namespace emu {
constexpr uint32_t BAR_TAG = 0xB0000000u;
inline uint32_t *bar_at(uint32_t bar)
{
    if (bar % 8)
        die("mbarrier not 8-byte aligned");
    return (uint32_t *)smem_at(bar, 8);
}
} /* namespace emu */
inline void wg_bar_init(uint32_t bar, uint32_t count)
{
    if (count == 0 || count >= (1u << 20))
        emu::die("mbarrier count out of range");
    uint32_t *w = emu::bar_at(bar);
    w[0] = count;
    w[1] = emu::BAR_TAG | count << 1;
}
inline void wg_bar_arrive(uint32_t bar)
{
    uint32_t *w = emu::bar_at(bar);
    if ((w[1] & 0xF0000000u) != emu::BAR_TAG)
        emu::die("arrival on an mbarrier that was never initialized");
    if (w[0] == 0)
        emu::die("mbarrier: more arrivals than its count");
    if (--w[0] == 0) {
        w[0] = (w[1] & 0x0FFFFFFFu) >> 1;
        w[1] ^= 1u;
    }
}
/* the arrival once every cp.async this thread issued has landed (made to land now) */
inline void wg_bar_arrive_cp(uint32_t bar)
{
    emu::cp_land(emu::cur_fiber(), 1 << 30);
    wg_bar_arrive(bar);
}
inline void wg_bar_wait(uint32_t bar, uint32_t par)
{
    for (;;) {
        const uint32_t *w = emu::bar_at(bar);
        if ((w[1] & 0xF0000000u) != emu::BAR_TAG)
            emu::die("wait on an mbarrier that was never initialized");
        if ((w[1] & 1u) != (par & 1u))   /* the phase of parity par has completed */
            return;
        emu::spin();
    }
}
inline void wg_bar_arrive_warp(uint32_t bar, uint32_t lane)
{
    __syncwarp();
    if (lane == 0)
        wg_bar_arrive(bar);
}
template <int N> inline void wg_regs_dec() {}
template <int N> inline void wg_regs_inc() {}
template <int N> inline void wg_hold(float (&)[N][4]) {}
template <int N> inline void wg_hold_a(uint32_t (&)[N][4]) {}

inline void wg_mma_ss_n64(float (&d)[8][4], uint64_t da, uint64_t db, int scale_d)
{
    emu::wg_mma(&d[0][0], 64, nullptr, da, db, scale_d, false, false);
}
inline void wg_mma_rs_n64(float (&d)[8][4], const uint32_t (&a)[4], uint64_t db, int scale_d)
{
    emu::wg_mma(&d[0][0], 64, a, 0, db, scale_d, true, false);
}
inline void wg_mma_rs_n128(float (&d)[16][4], const uint32_t (&a)[4], uint64_t db, int scale_d)
{
    emu::wg_mma(&d[0][0], 128, a, 0, db, scale_d, true, false);
}
inline void wg_mma_ss(float (&d)[16][4], uint64_t da, uint64_t db, int scale_d)
{
    emu::wg_mma(&d[0][0], 128, nullptr, da, db, scale_d, false, false);
}
inline void wg_mma_rs_tb(float (&d)[16][4], const uint32_t (&a)[4], uint64_t db)
{
    emu::wg_mma(&d[0][0], 128, a, 0, db, 1, true, true);
}

#endif
