/* attn.cu: variable-length causal GQA attention forward (the target's prefill) on the CUDA
 * backend.
 *
 * bf16 path: a flash-attention kernel on the tensor cores (mma.sync m16n8k16, bf16 inputs, f32
 * accumulation). One CTA takes BM query rows of one (sequence, head); each warp owns 16*MT of
 * those rows. Key/value tiles of BN rows stream through shared memory (cp.async, two stages);
 * S = Q K^T stays in registers, the softmax is online (running max and sum per row, in base 2),
 * P is rounded to bf16 and multiplied with V from registers. The score matrix never leaves
 * registers. Only key tiles up to the diagonal are visited; the causal mask is applied only on
 * tiles that cross the diagonal, and a warp skips tiles that lie wholly above its rows.
 * Shared-memory rows are 16-byte chunks XOR-swizzled by (row & 7), so ldmatrix and cp.async
 * are free of bank conflicts. CTAs are ordered heaviest first (last query tile of each sequence
 * first), with all heads of a sequence adjacent so that GQA groups share K/V in L2.
 *
 * On Hopper (sm_90) the d128 default is kernels/attn_wgmma.cu's wgmma kernel instead (variants 4
 * to 6 below, 6 the default; DFL_CUDA_ATTN_WGMMA=0 keeps the mma.sync one); other GPUs given a
 * wgmma variant run variant 0.
 *
 * f32 path (and bf16 inputs the tiled kernel cannot take: other head dims, unaligned strides):
 * one warp per (row, head), online softmax over the keys one at a time, f32 throughout. Slow,
 * exact, for tests and odd shapes. */
#include <math.h>

#include "be_cuda.cuh"

#include "dflash_ptx.cuh"
#include "warp_sum.cuh"
#include "attn_tiled.cuh"
#include "attn_wgmma.h"
#include "attn_wgmma.cuh"

/* ------------------------------------------------------------------------------------------ */
/* variants */

typedef void (*attn_kernel_fn)(const AttnParams);

struct AttnVariant {
    const char *name;
    attn_kernel_fn kernel;
    int bm, threads;
    size_t smem;
    int wg;   /* >= 0: kernels/attn_wgmma.cu's kernel wg (kernel NULL), on sm_90 only */
};

#define VARIANT(NAME, D, MT, NW, BN, QREG, MINB)                                              \
    { NAME, attn_fwd_bf16_kernel<D, MT, NW, BN, QREG, MINB>,                                   \
      AttnCfg<D, MT, NW, BN, QREG, MINB>::BM, AttnCfg<D, MT, NW, BN, QREG, MINB>::THREADS,      \
      AttnCfg<D, MT, NW, BN, QREG, MINB>::SMEM, -1 }

/* Variant 0 of each head dimension is the default. "Q regs": Q fragments held in registers for
 * the whole CTA; "Q smem": re-read from shared memory every key tile (frees registers for 32
 * rows per warp). */
static const AttnVariant variants64[] = {
    VARIANT("d64 BM128 BN64 4 warps x 32 rows, Q regs", 64, 2, 4, 64, true, 0),
    VARIANT("d64 BM64 BN64 4 warps x 16 rows, Q regs", 64, 1, 4, 64, true, 0),
    VARIANT("d64 BM128 BN64 8 warps x 16 rows, Q regs", 64, 1, 8, 64, true, 0),
};
static const AttnVariant variants128[] = {
    VARIANT("d128 BM128 BN32 4 warps x 32 rows, Q smem", 128, 2, 4, 32, false, 0),
    VARIANT("d128 BM64 BN64 4 warps x 16 rows, Q regs", 128, 1, 4, 64, true, 0),
    VARIANT("d128 BM128 BN64 8 warps x 16 rows, Q regs", 128, 1, 8, 64, true, 0),
    VARIANT("d128 BM64 BN32 4 warps x 16 rows, Q regs, 3 CTAs/SM", 128, 1, 4, 32, true, 3),
    {"d128 wgmma BM128 BN128 2 warpgroups, P V overlapped (sm_90)", NULL, AW_BM, AW_THREADS, AW_SMEM, 0},
    {"d128 wgmma BM128 BN128 2 warpgroups, plain (sm_90)", NULL, AW_BM, AW_THREADS, AW_SMEM, 1},
    {"d128 wgmma BM128 BN128 warp-specialized, persistent (sm_90)", NULL, AW_BM, AW_WS_THREADS, AW_WS_SMEM, 2},
};
#define ATTN_WGMMA_VARIANT 4   /* the first wgmma entry of variants128 */
#define ATTN_WS_VARIANT 6      /* the warp-specialized one */
/* The d128 default on sm_90: 0 the mma.sync kernel (variant 0), 1 the wgmma kernel's overlapped
 * schedule (variant 4), 2 its warp-specialized persistent form (variant 6);
 * DFL_CUDA_ATTN_WGMMA=0, 1 or 2 in the environment at open overrides it, dfl_cuda_attn_set_variant
 * after. Measured on
 * the H200 (bench-ops --quick --attn, causal TFLOP/s, d128 8 x 2048; variant 0, the mma.sync
 * default before, in brackets): heads 32/8 358.0 (279.8), 16/8 354.3 (275.7), 32/4 355.7
 * (279.7); mixed lengths 1..4096, 32/8, 350.6 (274.7); 1 x 16384 410.1 (310.9); the plain
 * schedule (variant 5) 2-4% behind the overlapped one. gpu-ops' attention cases within their
 * bounds for both, compute-sanitizer memcheck clean on test_attn_tiles128. In the Qwen3-1.7B
 * shape's forward (bench/target --quick, 10 batches) attention took 15.1% of the GPU's forward
 * time (0.125 s of 0.826 s) against 18.7% with the mma.sync kernel. The warp-specialized
 * persistent form (variant 6; 2026-12-02, same run, bench-ops --quick --attn, H200): 8 x 2048
 * heads 32/8 458.9 TFLOP/s against 358.5 for variant 4 (16/8 448.1 / 355.5, 32/4 453.8 / 353.8),
 * mixed lengths 422.6 / 350.3, 1 x 16384 527.6 / 412.7; the same bits as variant 4 (tests/emu);
 * gpu-ops' attention cases pass on every variant; compute-sanitizer memcheck and racecheck clean
 * on test_attn_tiles128 with it. It is the default. */
#define ATTN_WGMMA_DEFAULT 2
static const AttnVariant variants256[] = {
    VARIANT("d256 BM64 BN32 4 warps x 16 rows, Q smem", 256, 1, 4, 32, false, 0),
    VARIANT("d256 BM128 BN32 8 warps x 16 rows, Q smem", 256, 1, 8, 32, false, 0),
    VARIANT("d256 BM64 BN64 4 warps x 16 rows, Q smem", 256, 1, 4, 64, false, 0),
};

static const AttnVariant *variants_for(int d, int *n)
{
    switch (d) {
    case 64: *n = (int)(sizeof variants64 / sizeof variants64[0]); return variants64;
    case 128: *n = (int)(sizeof variants128 / sizeof variants128[0]); return variants128;
    case 256: *n = (int)(sizeof variants256 / sizeof variants256[0]); return variants256;
    default: *n = 0; return NULL;
    }
}

int cuda_attn_dim_index(int d) { return d == 64 ? 0 : d == 128 ? 1 : d == 256 ? 2 : -1; }

int cuda_attn_n_variants(int d)
{
    int n;
    variants_for(d, &n);
    return n;
}

extern "C" const char *dfl_cuda_attn_variant_name(int d, int v)
{
    int n;
    const AttnVariant *t = variants_for(d, &n);
    return t && v >= 0 && v < n ? t[v].name : NULL;
}

int cuda_attn_init(dfl_be *be, dfl_err *e)
{
    cuda_impl *im = cuda_of(be);
    static const int dims[] = {64, 128, 256};
    for (int di = 0; di < 3; di++) {
        int n;
        const AttnVariant *t = variants_for(dims[di], &n);
        for (int v = 0; v < n; v++) {
            if (t[v].smem > im->smem_optin)
                continue;   /* not on this device; attn_set_variant / launch reports it */
            if (t[v].wg >= 0 && !cuda_attn_wgmma_fits(im->device))
                continue;   /* not Hopper: the launch takes variant 0 instead */
            cudaError_t err = t[v].wg >= 0 ? cuda_attn_wgmma_init(t[v].wg) : cuda_allow_smem(t[v].kernel, t[v].smem);
            if (err != cudaSuccess) {
                cudaGetLastError();
                return dfl_fail(e, DFL_EDEVICE, "%s: attention kernel (%s) setup: %s", be->name,
                                t[v].name, cudaGetErrorString(err));
            }
        }
        im->attn_variant[di] = 0;
    }
    const char *wv = getenv("DFL_CUDA_ATTN_WGMMA");
    const int wgmma = wv && wv[0] >= '0' && wv[0] <= '2' && !wv[1] ? wv[0] - '0' : ATTN_WGMMA_DEFAULT;
    const int wvar = wgmma == 2 ? ATTN_WS_VARIANT : ATTN_WGMMA_VARIANT;
    if (wgmma && cuda_attn_wgmma_fits(im->device) && variants128[wvar].smem <= im->smem_optin)
        im->attn_variant[cuda_attn_dim_index(128)] = wvar;
    return 0;
}

/* ------------------------------------------------------------------------------------------ */
/* the simple kernel: one warp per (row, head) */

#define SIMPLE_WARPS 4

template <typename T, int MAXV>
__global__ void attn_simple_kernel(const AttnParams p)
{
    int64_t gw = (int64_t)blockIdx.x * SIMPLE_WARPS + (threadIdx.x >> 5);
    int lane = threadIdx.x & 31;
    if (gw >= p.T * p.n_heads)
        return;
    int64_t t = gw / p.n_heads;
    int h = (int)(gw % p.n_heads);
    if (t < p.cu[0] || t >= p.cu[p.n_seqs])
        return;
    int lo = 0, hi = p.n_seqs;   /* cu[lo] <= t < cu[hi] */
    while (hi - lo > 1) {
        int mid = (lo + hi) / 2;
        if (p.cu[mid] <= t)
            lo = mid;
        else
            hi = mid;
    }
    int64_t s0 = p.cu[lo];
    int kvh = h / p.group, d = p.d;
    const T *qr = (const T *)p.q + t * p.ldq + (int64_t)h * d;
    float qv[MAXV], acc[MAXV];
#pragma unroll
    for (int j = 0; j < MAXV; j++) {
        int i = lane + 32 * j;
        qv[j] = i < d ? to_f32(qr[i]) : 0.0f;
        acc[j] = 0.0f;
    }
    float m = -INFINITY, l = 0.0f;
    for (int64_t key = s0; key <= t; key++) {
        const T *kr = (const T *)p.k + key * p.ldk + (int64_t)kvh * d;
        const T *vr = (const T *)p.v + key * p.ldv + (int64_t)kvh * d;
        float dot = 0.0f;
#pragma unroll
        for (int j = 0; j < MAXV; j++) {
            int i = lane + 32 * j;
            if (i < d)
                dot += qv[j] * to_f32(kr[i]);
        }
        dot = warp_sum(dot);
        float sc = dot * p.scale;
        float mn = fmaxf(m, sc);
        float corr = expf(m - mn), pw = expf(sc - mn);
        l = l * corr + pw;
#pragma unroll
        for (int j = 0; j < MAXV; j++) {
            int i = lane + 32 * j;
            acc[j] = acc[j] * corr + (i < d ? pw * to_f32(vr[i]) : 0.0f);
        }
        m = mn;
    }
    float inv = 1.0f / l;
    T *orow = (T *)p.o + t * p.ldo + (int64_t)h * d;
#pragma unroll
    for (int j = 0; j < MAXV; j++) {
        int i = lane + 32 * j;
        if (i < d)
            orow[i] = from_f32<T>(acc[j] * inv);
    }
}

template <typename T>
static void launch_simple(const AttnParams &p, cudaStream_t s)
{
    int64_t warps = p.T * p.n_heads;
    unsigned blocks = (unsigned)((warps + SIMPLE_WARPS - 1) / SIMPLE_WARPS);
    if (p.d <= 64)
        attn_simple_kernel<T, 2><<<blocks, SIMPLE_WARPS * 32, 0, s>>>(p);
    else if (p.d <= 128)
        attn_simple_kernel<T, 4><<<blocks, SIMPLE_WARPS * 32, 0, s>>>(p);
    else
        attn_simple_kernel<T, 8><<<blocks, SIMPLE_WARPS * 32, 0, s>>>(p);
}

/* ------------------------------------------------------------------------------------------ */

int cuda_attn_varlen(dfl_be *be, const dfl_attn_varlen *a)
{
    cuda_impl *im = cuda_of(be);
    if (a->T <= 0 || a->n_seqs <= 0 || a->n_heads <= 0)
        return 0;
    if (a->n_kv <= 0 || a->n_heads % a->n_kv != 0)
        return cuda_op_fail(be, DFL_EUNSUP, "attn_varlen: %d query heads are not a multiple of %d "
                            "kv heads", a->n_heads, a->n_kv);
    if (a->d <= 0 || a->d > 256)
        return cuda_op_fail(be, DFL_EUNSUP, "attn_varlen: head dimension %d (at most 256)", a->d);
    int rc = cuda_enter(be);
    if (rc)
        return rc;
    AttnParams p;
    p.q = a->q;
    p.k = a->k;
    p.v = a->v;
    p.o = a->o;
    p.ldq = a->ldq;
    p.ldk = a->ldk;
    p.ldv = a->ldv;
    p.ldo = a->ldo;
    p.cu = a->cu_seqlens;
    p.n_seqs = a->n_seqs;
    p.n_heads = a->n_heads;
    p.group = a->n_heads / a->n_kv;
    p.d = a->d;
    p.T = a->T;
    p.scale = a->scale;
    p.scale_log2 = a->scale * 1.4426950408889634f;
    cudaStream_t s = im->stream;

    int nv = 0;
    const AttnVariant *tab = be->act == DFL_BF16 ? variants_for(a->d, &nv) : NULL;
    bool tiled = tab && is_aligned(a->q, 16) && is_aligned(a->k, 16) && is_aligned(a->v, 16) &&
                 is_aligned(a->o, 16) && a->ldq % 8 == 0 && a->ldk % 8 == 0 && a->ldv % 8 == 0 &&
                 a->ldo % 8 == 0 && a->max_len > 0;
    if (tiled) {
        const AttnVariant *v = &tab[im->attn_variant[cuda_attn_dim_index(a->d)]];
        if (v->wg >= 0 && !cuda_attn_wgmma_fits(im->device))
            v = &tab[0];   /* the wgmma kernel is Hopper's alone */
        if (v->smem > im->smem_optin)
            return cuda_op_fail(be, DFL_EUNSUP, "attn_varlen: kernel %s needs %zu bytes of shared "
                                "memory, this device allows %zu", v->name, v->smem, im->smem_optin);
        int64_t gx = (int64_t)a->n_seqs * a->n_heads;
        int64_t gy = ((int64_t)a->max_len + v->bm - 1) / v->bm;
        if (gx <= INT32_MAX && gy <= 65535) {
            if (v->wg >= 0)
                cuda_attn_wgmma(p, v->wg, dim3((unsigned)gx, (unsigned)gy), im->sm_count, s);
            else
                v->kernel<<<dim3((unsigned)gx, (unsigned)gy), v->threads, v->smem, s>>>(p);
            return cuda_launch_check(be, "attn_varlen");
        }
    }
    if ((a->T * a->n_heads + SIMPLE_WARPS - 1) / SIMPLE_WARPS > INT32_MAX)
        return cuda_op_fail(be, DFL_EUNSUP, "attn_varlen: %lld rows x %d heads is too many",
                            (long long)a->T, a->n_heads);
    if (be->act == DFL_BF16)
        launch_simple<bf16>(p, s);
    else
        launch_simple<float>(p, s);
    return cuda_launch_check(be, "attn_varlen (simple)");
}
