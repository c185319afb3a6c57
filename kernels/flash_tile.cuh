/* flash_tile.cuh: the register-tile steps of a flash-attention forward on the tensor cores that
 * the target's attention (attn_tiled.cuh) and the DFlash forward (dflash_kernels.cuh) share. A
 * warp holds MT m16 tiles of query rows: the scores S[MT][NT][4] of NT n8 key tiles, the output
 * O[MT][DT][4] of DT n8 column tiles, and for each row half hh (rows g and g + 8 of a tile) the
 * running max mrow (of raw scores) and this thread's share lrow of the running sum. Needs, from
 * the including file, the PTX helpers df_* (dflash_ptx.cuh, or tests/emu/simt.h). */
#ifndef DFL_FLASH_TILE_CUH
#define DFL_FLASH_TILE_CUH

#include <stdint.h>

/* O = 0, running max -inf, running sum 0 */
template <int MT, int DT>
__device__ __forceinline__ void ft_init(float (&o)[MT][DT][4], float (&mrow)[MT][2], float (&lrow)[MT][2])
{
#pragma unroll
    for (int i = 0; i < MT; i++) {
#pragma unroll
        for (int dt = 0; dt < DT; dt++)
#pragma unroll
            for (int e = 0; e < 4; e++)
                o[i][dt][e] = 0.0f;
#pragma unroll
        for (int hh = 0; hh < 2; hh++) {
            mrow[i][hh] = -INFINITY;
            lrow[i][hh] = 0.0f;
        }
    }
}

/* c[i][2n] += a[i] * (b[0], b[1]) and c[i][2n + 1] += a[i] * (b[2], b[3]) for each m16 tile i:
 * the two n8 tiles of one ldmatrix .x4 of B */
template <int MT, int N>
__device__ __forceinline__ void ft_mma_x4(float (&c)[MT][N][4], const uint32_t (&a)[MT][4], const uint32_t (&b)[4],
                                          int n)
{
#pragma unroll
    for (int i = 0; i < MT; i++) {
        df_mma(c[i][2 * n], a[i], b[0], b[1]);
        df_mma(c[i][2 * n + 1], a[i], b[2], b[3]);
    }
}

/* Online softmax over one key tile of S (masked scores -inf): the four threads of a row (t4 =
 * 0..3) combine their maxima through shuffles; the max is kept on raw scores and exponents are
 * taken in base 2 as s * sl2 - max * sl2 (one FFMA; sl2 = scale * log2 e). S becomes P and this
 * thread's share of the row sum is rescaled by alpha = exp2((old max - new max) sl2), which is
 * left in alpha for the caller to rescale O with (ft_rescale_o): a kernel whose O is still being
 * accumulated asynchronously (kernels/attn_wgmma.cu) rescales it later. A row fully masked so
 * far has max -inf: 0 stands in for it, so that there is no inf - inf. */
template <int MT, int NT>
__device__ __forceinline__ void ft_softmax_p(float (&s)[MT][NT][4], float (&mrow)[MT][2], float (&lrow)[MT][2],
                                             float (&alpha)[MT][2], float sl2)
{
#pragma unroll
    for (int i = 0; i < MT; i++)
#pragma unroll
        for (int hh = 0; hh < 2; hh++) {
            float mx = -INFINITY;
#pragma unroll
            for (int nt = 0; nt < NT; nt++)
                mx = fmaxf(mx, fmaxf(s[i][nt][2 * hh], s[i][nt][2 * hh + 1]));
            mx = fmaxf(mx, __shfl_xor_sync(0xffffffffu, mx, 1));
            mx = fmaxf(mx, __shfl_xor_sync(0xffffffffu, mx, 2));
            float mnew = fmaxf(mrow[i][hh], mx);
            float mscaled = mnew == -INFINITY ? 0.0f : mnew * sl2;
            alpha[i][hh] = df_exp2(mrow[i][hh] * sl2 - mscaled);
            mrow[i][hh] = mnew;
            float rs = 0.0f;
#pragma unroll
            for (int nt = 0; nt < NT; nt++)
#pragma unroll
                for (int e = 2 * hh; e < 2 * hh + 2; e++) {
                    float pv = df_exp2(fmaf(s[i][nt][e], sl2, -mscaled));
                    s[i][nt][e] = pv;
                    rs += pv;
                }
            lrow[i][hh] = lrow[i][hh] * alpha[i][hh] + rs;
        }
}

/* O rows g (hh = 0) and g + 8 (hh = 1) of each m16 tile times alpha */
template <int MT, int DT>
__device__ __forceinline__ void ft_rescale_o(float (&o)[MT][DT][4], const float (&alpha)[MT][2])
{
#pragma unroll
    for (int i = 0; i < MT; i++)
#pragma unroll
        for (int hh = 0; hh < 2; hh++)
#pragma unroll
            for (int dt = 0; dt < DT; dt++) {
                o[i][dt][2 * hh] *= alpha[i][hh];
                o[i][dt][2 * hh + 1] *= alpha[i][hh];
            }
}

/* Both: the online softmax of one key tile, O rescaled at once */
template <int MT, int NT, int DT>
__device__ __forceinline__ void ft_online_softmax(float (&s)[MT][NT][4], float (&mrow)[MT][2], float (&lrow)[MT][2],
                                                  float (&o)[MT][DT][4], float sl2)
{
    float alpha[MT][2];
    ft_softmax_p(s, mrow, lrow, alpha, sl2);
    ft_rescale_o(o, alpha);
}

/* The A fragments of k16 step kb of P V: the P accumulators of n8 tiles 2kb and 2kb + 1, as bf16 */
template <int MT, int NT>
__device__ __forceinline__ void ft_pack_p(uint32_t (&a)[MT][4], const float (&s)[MT][NT][4], int kb)
{
#pragma unroll
    for (int i = 0; i < MT; i++) {
        a[i][0] = df_pack(s[i][2 * kb][0], s[i][2 * kb][1]);
        a[i][1] = df_pack(s[i][2 * kb][2], s[i][2 * kb][3]);
        a[i][2] = df_pack(s[i][2 * kb + 1][0], s[i][2 * kb + 1][1]);
        a[i][3] = df_pack(s[i][2 * kb + 1][2], s[i][2 * kb + 1][3]);
    }
}

/* The whole row sum from this thread's share (the four threads of a row add theirs) */
__device__ __forceinline__ float ft_row_sum(float l)
{
    l += __shfl_xor_sync(0xffffffffu, l, 1);
    l += __shfl_xor_sync(0xffffffffu, l, 2);
    return l;
}

#endif
