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
 * f32 path (and bf16 inputs the tiled kernel cannot take: other head dims, unaligned strides):
 * one warp per (row, head), online softmax over the keys one at a time, f32 throughout. Slow,
 * exact, for tests and odd shapes. */
#include <math.h>

#include "be_cuda.cuh"

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

/* ------------------------------------------------------------------------------------------ */
/* PTX helpers */

__device__ __forceinline__ uint32_t smem_addr(const void *p)
{
    return (uint32_t)__cvta_generic_to_shared(p);
}

/* 16-byte global -> shared copy; src_ok false fills the 16 bytes with zeros (reads nothing). */
__device__ __forceinline__ void cp_async16(uint32_t dst, const void *src, bool src_ok)
{
    int n = src_ok ? 16 : 0;
    asm volatile("cp.async.cg.shared.global [%0], [%1], 16, %2;\n" ::"r"(dst), "l"(src), "r"(n)
                 : "memory");
}

__device__ __forceinline__ void cp_async_commit() { asm volatile("cp.async.commit_group;\n" ::: "memory"); }

template <int N> __device__ __forceinline__ void cp_async_wait()
{
    asm volatile("cp.async.wait_group %0;\n" ::"n"(N) : "memory");
}

__device__ __forceinline__ void ldmatrix_x4(uint32_t (&r)[4], uint32_t addr)
{
    asm volatile("ldmatrix.sync.aligned.m8n8.x4.shared.b16 {%0, %1, %2, %3}, [%4];\n"
                 : "=r"(r[0]), "=r"(r[1]), "=r"(r[2]), "=r"(r[3])
                 : "r"(addr));
}

__device__ __forceinline__ void ldmatrix_x4_trans(uint32_t (&r)[4], uint32_t addr)
{
    asm volatile("ldmatrix.sync.aligned.m8n8.x4.trans.shared.b16 {%0, %1, %2, %3}, [%4];\n"
                 : "=r"(r[0]), "=r"(r[1]), "=r"(r[2]), "=r"(r[3])
                 : "r"(addr));
}

/* c += a (16x16, row) * b (16x8, col); bf16 inputs, f32 accumulators */
__device__ __forceinline__ void mma_bf16(float (&c)[4], const uint32_t (&a)[4], uint32_t b0, uint32_t b1)
{
    asm("mma.sync.aligned.m16n8k16.row.col.f32.bf16.bf16.f32 {%0, %1, %2, %3}, "
                 "{%4, %5, %6, %7}, {%8, %9}, {%0, %1, %2, %3};\n"
                 : "+f"(c[0]), "+f"(c[1]), "+f"(c[2]), "+f"(c[3])
                 : "r"(a[0]), "r"(a[1]), "r"(a[2]), "r"(a[3]), "r"(b0), "r"(b1));
}

__device__ __forceinline__ float fast_exp2(float x)
{
    float y;
    asm("ex2.approx.ftz.f32 %0, %1;\n" : "=f"(y) : "f"(x));
    return y;
}

__device__ __forceinline__ uint32_t pack_bf16x2(float lo, float hi)
{
    __nv_bfloat162 v = __floats2bfloat162_rn(lo, hi);
    return *reinterpret_cast<uint32_t *>(&v);
}

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

    extern __shared__ __align__(1024) unsigned char smem[];
    const uint32_t sQ = smem_addr(smem);
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
        cp_async16(sQ + swz<ROWB>(r, ch), ok ? qg + (int64_t)row * p.ldq + ch * 8 : qg, ok);
    }
    const int n_end = min(len, m0 + BM);      /* keys past the last query are never needed */
    const int n_tiles = (n_end + BN - 1) / BN;
    auto load_kv = [&](int tile, int stage) {
        const uint32_t dk = sK0 + stage * BN * ROWB, dv = sV0 + stage * BN * ROWB;
        for (int c = tid; c < BN * CH; c += THREADS) {
            int r = c / CH, ch = c % CH, key = tile * BN + r;
            bool ok = key < len;
            cp_async16(dk + swz<ROWB>(r, ch), ok ? kg + (int64_t)key * p.ldk + ch * 8 : kg, ok);
            cp_async16(dv + swz<ROWB>(r, ch), ok ? vg + (int64_t)key * p.ldv + ch * 8 : vg, ok);
        }
    };
    load_kv(0, 0);
    cp_async_commit();

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
#pragma unroll
    for (int mt = 0; mt < MT; mt++) {
#pragma unroll
        for (int dt = 0; dt < DT; dt++)
#pragma unroll
            for (int e = 0; e < 4; e++)
                o[mt][dt][e] = 0.0f;
#pragma unroll
        for (int hh = 0; hh < 2; hh++) {
            mrow[mt][hh] = -INFINITY;
            lrow[mt][hh] = 0.0f;
        }
    }
    uint32_t qf[QREG ? MT : 1][QREG ? KD : 1][4];
    const float sl2 = p.scale_log2;

    for (int it = 0; it < n_tiles; it++) {
        const int stage = it & 1;
        if (it + 1 < n_tiles) {
            load_kv(it + 1, stage ^ 1);
            cp_async_commit();
            cp_async_wait<1>();
        } else {
            cp_async_wait<0>();
        }
        __syncthreads();
        if (QREG && it == 0) {
#pragma unroll
            for (int mt = 0; mt < MT; mt++)
#pragma unroll
                for (int kk = 0; kk < KD; kk++)
                    ldmatrix_x4(qf[QREG ? mt : 0][QREG ? kk : 0], chunk_addr(q_base, 2 * kk) + mt * 16 * ROWB);
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
                        ldmatrix_x4(a[mt], chunk_addr(q_base, 2 * kk) + mt * 16 * ROWB);
                    }
                }
#pragma unroll
                for (int np = 0; np < NT / 2; np++) {
                    uint32_t b[4];
                    ldmatrix_x4(b, chunk_addr(kst, 2 * kk) + np * 16 * ROWB);
#pragma unroll
                    for (int mt = 0; mt < MT; mt++) {
                        mma_bf16(s[mt][2 * np], a[mt], b[0], b[1]);
                        mma_bf16(s[mt][2 * np + 1], a[mt], b[2], b[3]);
                    }
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
            /* online softmax: rows g (hh = 0) and g + 8 (hh = 1) of each m16 tile; the four
             * threads of a row (t4 = 0..3) combine through shuffles. The running max is kept on
             * raw scores; exponents are taken in base 2 as s * scale_log2 - max * scale_log2
             * (one FFMA). */
#pragma unroll
            for (int mt = 0; mt < MT; mt++)
#pragma unroll
                for (int hh = 0; hh < 2; hh++) {
                    float mx = -INFINITY;
#pragma unroll
                    for (int nt = 0; nt < NT; nt++)
                        mx = fmaxf(mx, fmaxf(s[mt][nt][2 * hh], s[mt][nt][2 * hh + 1]));
                    mx = fmaxf(mx, __shfl_xor_sync(0xffffffffu, mx, 1));
                    mx = fmaxf(mx, __shfl_xor_sync(0xffffffffu, mx, 2));
                    float mnew = fmaxf(mrow[mt][hh], mx);
                    /* a row fully masked so far has max -inf: use 0 so that no inf - inf */
                    float mscaled = mnew == -INFINITY ? 0.0f : mnew * sl2;
                    float alpha = fast_exp2(mrow[mt][hh] * sl2 - mscaled);
                    mrow[mt][hh] = mnew;
                    float rs = 0.0f;
#pragma unroll
                    for (int nt = 0; nt < NT; nt++)
#pragma unroll
                        for (int e = 2 * hh; e < 2 * hh + 2; e++) {
                            float pv = fast_exp2(fmaf(s[mt][nt][e], sl2, -mscaled));
                            s[mt][nt][e] = pv;
                            rs += pv;
                        }
                    lrow[mt][hh] = lrow[mt][hh] * alpha + rs;   /* this thread's share */
#pragma unroll
                    for (int dt = 0; dt < DT; dt++) {
                        o[mt][dt][2 * hh] *= alpha;
                        o[mt][dt][2 * hh + 1] *= alpha;
                    }
                }
            /* O += P V: the S accumulators of two adjacent n8 tiles are the A fragment of one
             * k16 step */
#pragma unroll
            for (int kb = 0; kb < KB; kb++) {
                uint32_t a[MT][4];
#pragma unroll
                for (int mt = 0; mt < MT; mt++) {
                    a[mt][0] = pack_bf16x2(s[mt][2 * kb][0], s[mt][2 * kb][1]);
                    a[mt][1] = pack_bf16x2(s[mt][2 * kb][2], s[mt][2 * kb][3]);
                    a[mt][2] = pack_bf16x2(s[mt][2 * kb + 1][0], s[mt][2 * kb + 1][1]);
                    a[mt][3] = pack_bf16x2(s[mt][2 * kb + 1][2], s[mt][2 * kb + 1][3]);
                }
#pragma unroll
                for (int dp = 0; dp < DT / 2; dp++) {
                    uint32_t b[4];
                    ldmatrix_x4_trans(b, chunk_addr(vst, 2 * dp) + kb * 16 * ROWB);
#pragma unroll
                    for (int mt = 0; mt < MT; mt++) {
                        mma_bf16(o[mt][2 * dp], a[mt], b[0], b[1]);
                        mma_bf16(o[mt][2 * dp + 1], a[mt], b[2], b[3]);
                    }
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
            float l = lrow[mt][hh];
            l += __shfl_xor_sync(0xffffffffu, l, 1);
            l += __shfl_xor_sync(0xffffffffu, l, 2);
            float inv = l > 0.0f ? 1.0f / l : 0.0f;
            /* row wr0 + mt*16 + g + 8hh (row & 7 == g), columns dt*8 + 2 t4, +1 */
            const uint32_t o_base = (uint32_t)((wr0 + g) * ROWB + (g << 4) + 4 * t4);
#pragma unroll
            for (int dt = 0; dt < DT; dt++)
                *reinterpret_cast<uint32_t *>(smem + chunk_addr(o_base, dt) + (mt * 16 + 8 * hh) * ROWB) =
                    pack_bf16x2(o[mt][dt][2 * hh] * inv, o[mt][dt][2 * hh + 1] * inv);
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

/* ------------------------------------------------------------------------------------------ */
/* variants */

typedef void (*attn_kernel_fn)(const AttnParams);

struct AttnVariant {
    const char *name;
    attn_kernel_fn kernel;
    int bm, threads;
    size_t smem;
};

#define VARIANT(NAME, D, MT, NW, BN, QREG, MINB)                                              \
    { NAME, attn_fwd_bf16_kernel<D, MT, NW, BN, QREG, MINB>,                                   \
      AttnCfg<D, MT, NW, BN, QREG, MINB>::BM, AttnCfg<D, MT, NW, BN, QREG, MINB>::THREADS,      \
      AttnCfg<D, MT, NW, BN, QREG, MINB>::SMEM }

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
};
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
            cudaError_t err = cudaFuncSetAttribute(t[v].kernel, cudaFuncAttributeMaxDynamicSharedMemorySize,
                                                   (int)t[v].smem);
            if (err == cudaSuccess)
                err = cudaFuncSetAttribute(t[v].kernel, cudaFuncAttributePreferredSharedMemoryCarveout,
                                           (int)cudaSharedmemCarveoutMaxShared);
            if (err != cudaSuccess) {
                cudaGetLastError();
                return dfl_fail(e, DFL_EDEVICE, "%s: attention kernel (%s) setup: %s", be->name,
                                t[v].name, cudaGetErrorString(err));
            }
        }
        im->attn_variant[di] = 0;
    }
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
#pragma unroll
        for (int off = 16; off > 0; off >>= 1)
            dot += __shfl_xor_sync(0xffffffffu, dot, off);
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
        if (v->smem > im->smem_optin)
            return cuda_op_fail(be, DFL_EUNSUP, "attn_varlen: kernel %s needs %zu bytes of shared "
                                "memory, this device allows %zu", v->name, v->smem, im->smem_optin);
        int64_t gx = (int64_t)a->n_seqs * a->n_heads;
        int64_t gy = ((int64_t)a->max_len + v->bm - 1) / v->bm;
        if (gx <= INT32_MAX && gy <= 65535) {
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
