/* attn_tiled.cuh: the tiled bf16 flash-attention kernel of kernels/attn.cu (which has the design
 * notes and the launches): its parameters, tile configuration and device code. Needs, from the
 * including file: the PTX helpers df_* and DF_DYN_SMEM (kernels/dflash_ptx.cuh; tests/emu/simt.h
 * for running the kernel on the CPU, which tests/emu/emu-dflash.cc does). */
#ifndef DFL_ATTN_TILED_CUH
#define DFL_ATTN_TILED_CUH

#include <stdint.h>

#include "flash_tile.cuh"

struct AttnParams {
    const void *q, *k, *v;
    void *o;
    int64_t ldq, ldk, ldv, ldo;
    const int32_t *cu;
    int n_seqs, n_heads, group, d;
    int64_t T;
    float scale;       /* natural (simple kernel) */
    float scale_log2;  /* scale * log2(e) (tiled kernel) */
};

/* Byte offset of 16-byte chunk ch of row r in a tile of rows of ROWB bytes (swizzled). */
template <int ROWB> __device__ __forceinline__ uint32_t swz(int r, int ch)
{
    return (uint32_t)(r * ROWB + ((ch ^ (r & 7)) << 4));
}

/* Address of logical chunk c (even, compile-time) for a lane whose address `base` already holds
 * the lane's part of the swizzle in bits 4..6 (rows start at multiples of 128 bytes): XOR the
 * chunk's low bits into those bits, add its high bits. One LOP3 and an immediate offset. */
__device__ __forceinline__ uint32_t chunk_addr(uint32_t base, int c)
{
    return (base ^ (uint32_t)((c & 7) << 4)) + (uint32_t)((c >> 3) << 7);
}

/* ------------------------------------------------------------------------------------------ */
/* the tiled bf16 kernel */

template <int D, int MT, int NW, int BN, bool QREG, int MINB>
struct AttnCfg {
    static constexpr int BM = 16 * MT * NW;
    static constexpr int THREADS = 32 * NW;
    static constexpr int ROWB = D * 2;
    static constexpr size_t SMEM = (size_t)(BM + 4 * BN) * ROWB;  /* Q + 2 stages of K and V */
};

template <int D, int MT, int NW, int BN, bool QREG, int MINB>
__global__ void __launch_bounds__(32 * NW, MINB)
attn_fwd_bf16_kernel(const AttnParams p)
{
    typedef AttnCfg<D, MT, NW, BN, QREG, MINB> C;
    constexpr int BM = C::BM, THREADS = C::THREADS, ROWB = C::ROWB;
    constexpr int CH = D / 8;   /* 16-byte chunks per row */
    constexpr int NT = BN / 8;  /* n8 tiles of S per m16 tile */
    constexpr int KD = D / 16;  /* k16 steps of Q K^T */
    constexpr int DT = D / 8;   /* n8 tiles of O per m16 tile */
    constexpr int KB = BN / 16; /* k16 steps of P V */
    static_assert(D % 64 == 0 && BN % 16 == 0, "tile shape");

    DF_DYN_SMEM(smem);
    const uint32_t sQ = df_smem(smem);
    if (sQ & 127)
        __trap();   /* the swizzle arithmetic below needs 128-byte aligned rows */
    const uint32_t sK0 = sQ + BM * ROWB;
    const uint32_t sV0 = sK0 + 2 * BN * ROWB;

    const int head = (int)(blockIdx.x % (unsigned)p.n_heads);
    const int seq = (int)(blockIdx.x / (unsigned)p.n_heads);
    const int s0 = p.cu[seq];
    const int len = p.cu[seq + 1] - s0;
    const int mt_idx = (len + BM - 1) / BM - 1 - (int)blockIdx.y;  /* heaviest tile first */
    if (mt_idx < 0)
        return;
    const int m0 = mt_idx * BM;
    const int kvh = head / p.group;
    const bf16 *qg = (const bf16 *)p.q + (int64_t)s0 * p.ldq + (int64_t)head * D;
    const bf16 *kg = (const bf16 *)p.k + (int64_t)s0 * p.ldk + (int64_t)kvh * D;
    const bf16 *vg = (const bf16 *)p.v + (int64_t)s0 * p.ldv + (int64_t)kvh * D;

    const int tid = threadIdx.x, warp = tid >> 5, lane = tid & 31;

    /* Q tile (rows past the sequence end read as zeros) */
    for (int c = tid; c < BM * CH; c += THREADS) {
        int r = c / CH, ch = c % CH, row = m0 + r;
        bool ok = row < len;
        df_cp16(sQ + swz<ROWB>(r, ch), ok ? qg + (int64_t)row * p.ldq + ch * 8 : qg, ok);
    }
    const int n_end = min(len, m0 + BM);      /* keys past the last query are never needed */
    const int n_tiles = (n_end + BN - 1) / BN;
    auto load_kv = [&](int tile, int stage) {
        const uint32_t dk = sK0 + stage * BN * ROWB, dv = sV0 + stage * BN * ROWB;
        for (int c = tid; c < BN * CH; c += THREADS) {
            int r = c / CH, ch = c % CH, key = tile * BN + r;
            bool ok = key < len;
            df_cp16(dk + swz<ROWB>(r, ch), ok ? kg + (int64_t)key * p.ldk + ch * 8 : kg, ok);
            df_cp16(dv + swz<ROWB>(r, ch), ok ? vg + (int64_t)key * p.ldv + ch * 8 : vg, ok);
        }
    };
    load_kv(0, 0);
    df_commit();

    const int wr0 = warp * 16 * MT;          /* the warp's first row in the tile */
    const int wrow0 = m0 + wr0;              /* ... within the sequence */
    const int wrow_last = wrow0 + 16 * MT - 1;
    const bool warp_live = wrow0 < len;
    const int g = lane >> 2, t4 = lane & 3, x7 = lane & 7;
    /* per-lane ldmatrix bases (see chunk_addr): Q rows wr0 + (lane & 15), chunk 2kk + (lane >> 4);
     * K rows (lane & 7) + 8 (lane >> 4), chunk 2kk + ((lane >> 3) & 1); V rows (lane & 7) +
     * 8 ((lane >> 3) & 1), chunk 2dp + (lane >> 4). Row & 7 == lane & 7 in all three. */
    const uint32_t q_base = sQ + (uint32_t)((wr0 + (lane & 15)) * ROWB + (((lane >> 4) ^ x7) << 4));
    const uint32_t k_base = sK0 + (uint32_t)(((lane & 7) + ((lane >> 4) << 3)) * ROWB +
                                             ((((lane >> 3) & 1) ^ x7) << 4));
    const uint32_t v_base = sV0 + (uint32_t)(((lane & 7) + (((lane >> 3) & 1) << 3)) * ROWB +
                                             (((lane >> 4) ^ x7) << 4));

    float o[MT][DT][4];
    float mrow[MT][2], lrow[MT][2];
    ft_init(o, mrow, lrow);
    uint32_t qf[QREG ? MT : 1][QREG ? KD : 1][4];
    const float sl2 = p.scale_log2;

    for (int it = 0; it < n_tiles; it++) {
        const int stage = it & 1;
        if (it + 1 < n_tiles) {
            load_kv(it + 1, stage ^ 1);
            df_commit();
            df_wait<1>();
        } else {
            df_wait<0>();
        }
        __syncthreads();
        if (QREG && it == 0) {
#pragma unroll
            for (int mt = 0; mt < MT; mt++)
#pragma unroll
                for (int kk = 0; kk < KD; kk++)
                    df_ldm(qf[QREG ? mt : 0][QREG ? kk : 0], chunk_addr(q_base, 2 * kk) + mt * 16 * ROWB);
        }
        const int n0 = it * BN;
        if (warp_live && n0 <= wrow_last) {
            const uint32_t kst = k_base + stage * BN * ROWB, vst = v_base + stage * BN * ROWB;
            float s[MT][NT][4];
#pragma unroll
            for (int mt = 0; mt < MT; mt++)
#pragma unroll
                for (int nt = 0; nt < NT; nt++)
#pragma unroll
                    for (int e = 0; e < 4; e++)
                        s[mt][nt][e] = 0.0f;
            /* S = Q K^T */
#pragma unroll
            for (int kk = 0; kk < KD; kk++) {
                uint32_t a[MT][4];
#pragma unroll
                for (int mt = 0; mt < MT; mt++) {
                    if (QREG) {
#pragma unroll
                        for (int e = 0; e < 4; e++)
                            a[mt][e] = qf[QREG ? mt : 0][QREG ? kk : 0][e];
                    } else {
                        df_ldm(a[mt], chunk_addr(q_base, 2 * kk) + mt * 16 * ROWB);
                    }
                }
#pragma unroll
                for (int np = 0; np < NT / 2; np++) {
                    uint32_t b[4];
                    df_ldm(b, chunk_addr(kst, 2 * kk) + np * 16 * ROWB);
                    ft_mma_x4(s, a, b, np);
                }
            }
            /* causal mask where the tile crosses the warp's diagonal */
            if (n0 + BN - 1 > wrow0) {
#pragma unroll
                for (int mt = 0; mt < MT; mt++)
#pragma unroll
                    for (int nt = 0; nt < NT; nt++)
#pragma unroll
                        for (int e = 0; e < 4; e++) {
                            int qi = wrow0 + mt * 16 + g + ((e >> 1) << 3);
                            int kj = n0 + nt * 8 + 2 * t4 + (e & 1);
                            if (kj > qi)
                                s[mt][nt][e] = -INFINITY;
                        }
            }
            /* online softmax: rows g (hh = 0) and g + 8 (hh = 1) of each m16 tile */
            ft_online_softmax(s, mrow, lrow, o, sl2);
            /* O += P V: the S accumulators of two adjacent n8 tiles are the A fragment of one
             * k16 step */
#pragma unroll
            for (int kb = 0; kb < KB; kb++) {
                uint32_t a[MT][4];
                ft_pack_p(a, s, kb);
#pragma unroll
                for (int dp = 0; dp < DT / 2; dp++) {
                    uint32_t b[4];
                    df_ldm_t(b, chunk_addr(vst, 2 * dp) + kb * 16 * ROWB);
                    ft_mma_x4(o, a, b, dp);
                }
            }
        }
        __syncthreads();   /* everyone is done with this stage before it is refilled */
    }

    /* O / l, staged through the warp's own Q rows in shared memory, then 16-byte stores */
#pragma unroll
    for (int mt = 0; mt < MT; mt++)
#pragma unroll
        for (int hh = 0; hh < 2; hh++) {
            float l = ft_row_sum(lrow[mt][hh]);
            float inv = l > 0.0f ? 1.0f / l : 0.0f;
            /* row wr0 + mt*16 + g + 8hh (row & 7 == g), columns dt*8 + 2 t4, +1 */
            const uint32_t o_base = (uint32_t)((wr0 + g) * ROWB + (g << 4) + 4 * t4);
#pragma unroll
            for (int dt = 0; dt < DT; dt++)
                *reinterpret_cast<uint32_t *>(smem + chunk_addr(o_base, dt) + (mt * 16 + 8 * hh) * ROWB) =
                    df_pack(o[mt][dt][2 * hh] * inv, o[mt][dt][2 * hh + 1] * inv);
        }
    __syncwarp();
    bf16 *og = (bf16 *)p.o + (int64_t)s0 * p.ldo + (int64_t)head * D;
    for (int c = lane; c < 16 * MT * CH; c += 32) {
        int r = c / CH, ch = c % CH, row = wrow0 + r;
        if (row < len)
            *reinterpret_cast<uint4 *>(og + (int64_t)row * p.ldo + ch * 8) =
                *reinterpret_cast<const uint4 *>(smem + swz<ROWB>(wr0 + r, ch));
    }
}

#endif
