/* be_cuda.cuh: internal to the CUDA backend (the .cu files of kernels/): the backend state, error recording,
 * element-type helpers shared by the kernels, and the op entry points each .cu file provides. */
#ifndef DFL_BE_CUDA_CUH
#define DFL_BE_CUDA_CUH

#include <cublasLt.h>
#include <cublas_v2.h>
#include "cublas_dl.cuh"
#include <cuda_bf16.h>
#include <cuda_fp16.h>
#include <cuda_runtime.h>
#include <stdint.h>

extern "C" {
#include "backend.h"
#include "dtype.h"
#include "err.h"
}
#include "cuda.h"

typedef __nv_bfloat16 bf16;

/* One cached matmul configuration (see be_cuda.cu). */
struct cuda_mm_key {
    int64_t M, N, K, lda, ldb, ldc;
    int32_t adt, bdt, cdt;
    int32_t ta, tb, beta_nonzero, has_bias;
    int32_t align_a, align_b, align_c, align_bias;
};

struct cuda_mm_plan {
    cuda_mm_key key;
    bool used;
    bool use_lt;            /* false: cublasGemmEx fallback (no Lt algorithm found) */
    bool bias_fused;        /* bias added by the Lt epilogue (else by a separate kernel) */
    cublasLtMatmulDesc_t desc;
    cublasLtMatrixLayout_t la, lb, lc;   /* Lt's A (our B), Lt's B (our A), C/D */
    cublasLtMatmulAlgo_t algo;
    uint64_t last_use;
};

#define CUDA_MM_PLANS 96
#define CUDA_ATTN_DIMS 3       /* head dims 64, 128, 256 */
#define CUDA_ROPE_SLOTS 8
#define CUDA_ROPE_MAXHALF 512  /* head dim up to 1024 */

struct cuda_alloc_rec {
    void *p;
    size_t bytes;
};

struct cuda_impl {
    int device;
    cudaStream_t stream;       /* compute: every op runs here */
    cudaStream_t copy_stream;
    cublasLtHandle_t lt;
    cublasHandle_t blas;
    void *ws;                  /* cuBLAS(Lt) workspace */
    size_t ws_bytes;
    int sm_count;
    int cc_major;              /* compute capability, major */
    int gemm_tma;              /* DFL_CUDA_GEMM_TMA at open: 0, 1 or 2 (be_cuda.cu, gemm_tma.cu) */
    size_t smem_optin;
    /* allocations */
    bool frozen;
    size_t allocated, peak;
    /* host waits (dfl_cuda_wait_stats) */
    uint64_t n_syncs, n_event_waits;
    cuda_alloc_rec *recs;
    size_t n_recs, cap_recs;
    /* matmul plans */
    cuda_mm_plan plans[CUDA_MM_PLANS];
    uint64_t plan_clock;
    /* RoPE inverse frequencies per (theta, d), computed on the host like the CPU op */
    float *rope_tab;           /* device [CUDA_ROPE_SLOTS][CUDA_ROPE_MAXHALF] */
    float rope_theta[CUDA_ROPE_SLOTS];
    int rope_d[CUDA_ROPE_SLOTS];
    dfl_dtype rope_dt[CUDA_ROPE_SLOTS]; /* the be->rope_dtype it was rounded for */
    dfl_rope_scaling rope_rs[CUDA_ROPE_SLOTS]; /* the be->rope_scaling it was scaled for */
    int rope_next;
    float rope_host[CUDA_ROPE_SLOTS][CUDA_ROPE_MAXHALF];
    /* attention tile configuration per head dim (index into the variant table) */
    int attn_variant[CUDA_ATTN_DIMS];
    /* the two-pass gated delta rule's workspace (hybrid.cu), grown through be_alloc */
    void *gdn_ws;
    size_t gdn_ws_bytes;
    /* dflash_attn_bwd's kept score gradients (dflash_attn.cu, "dS kept"): cudaMalloc'ed apart
     * from the tracked allocations, grown when free memory allows (also when frozen: failing that
     * the backward recomputes them), freed at close */
    void *ds_buf;
    size_t ds_bytes;
    /* first error since the last sync */
    int err_code;
    char err_msg[768];
};

static inline cuda_impl *cuda_of(dfl_be *be) { return (cuda_impl *)be->impl; }

/* Record an op failure (kept until the next sync reports it); returns code. */
int cuda_op_fail(dfl_be *be, int code, const char *fmt, ...) __attribute__((format(printf, 3, 4)));
/* After a kernel launch: 0, or DFL_EDEVICE recorded with the op's name. */
int cuda_launch_check(dfl_be *be, const char *op);
/* Device of the backend made current on this thread. */
int cuda_enter(dfl_be *be);
/* be_cuda_device.cu: the device-plumbing and communicator ops of the table. */
void cuda_device_ops_fill(dfl_be_ops *o);

/* ---- element helpers for kernels ---- */
__device__ __forceinline__ float to_f32(float x) { return x; }
__device__ __forceinline__ float to_f32(bf16 x) { return __bfloat162float(x); }
__device__ __forceinline__ float to_f32(__half x) { return __half2float(x); }
template <typename T> __device__ __forceinline__ T from_f32(float x);
template <> __device__ __forceinline__ float from_f32<float>(float x) { return x; }
template <> __device__ __forceinline__ bf16 from_f32<bf16>(float x) { return __float2bfloat16_rn(x); }
template <> __device__ __forceinline__ __half from_f32<__half>(float x) { return __float2half_rn(x); }

/* N elements of T loaded / stored as one access (16 bytes when N * sizeof(T) == 16). */
template <typename T, int N> struct alignas(sizeof(T) * N) Pack {
    T v[N];
};

static inline bool is_aligned(const void *p, size_t a) { return ((uintptr_t)p & (a - 1)) == 0; }

/* An op on the activation type: nothing to do when empty, else, once cuda_enter succeeded,
 * launch(bf16()) or launch(float()) as be->act says (launch: a generic lambda calling the op's
 * launcher with decltype of its argument). */
template <typename F> static inline int cuda_by_act(dfl_be *be, bool empty, F launch)
{
    if (empty)
        return 0;
    int rc = cuda_enter(be);
    if (rc)
        return rc;
    return be->act == DFL_BF16 ? launch(bf16()) : launch(float());
}

/* Lets kernel fn take smem bytes of dynamic shared memory, with the shared-memory carveout at its
 * largest (the tiled attention kernels' setup). */
template <typename F> static inline cudaError_t cuda_allow_smem(F *fn, size_t smem)
{
    cudaError_t err = cudaFuncSetAttribute(fn, cudaFuncAttributeMaxDynamicSharedMemorySize, (int)smem);
    if (err == cudaSuccess)
        err = cudaFuncSetAttribute(fn, cudaFuncAttributePreferredSharedMemoryCarveout,
                                   (int)cudaSharedmemCarveoutMaxShared);
    return err;
}

/* Blocks for a grid-stride loop over n items with `threads` per block. */
static inline unsigned grid_for(int64_t n, int threads, int max_blocks)
{
    int64_t b = (n + threads - 1) / threads;
    if (b > max_blocks)
        b = max_blocks;
    return (unsigned)(b < 1 ? 1 : b);
}

/* ---- entry points (ops.cu, attn.cu, be_cuda.cu) ---- */
int cuda_convert(dfl_be *be, void *y, dfl_dtype dt, const void *x, dfl_dtype st, int64_t n);
int cuda_embedding(dfl_be *be, void *out, const int32_t *ids, const void *E, int64_t T, int64_t H);
int cuda_rmsnorm(dfl_be *be, void *y, float *rstd, const void *x, const void *w, int64_t R,
                 int64_t n, float eps);
int cuda_add_rmsnorm(dfl_be *be, void *h, const void *d, void *y, float *rstd, const void *w,
                     int64_t R, int64_t n, float eps);
int cuda_qknorm_rope(dfl_be *be, void *x, const void *src, int64_t ld, float *rstd, const void *w,
                     const int32_t *pos, int64_t R, int heads, int d, float eps, float theta);
/* ops.cu: the device table of RoPE inverse frequencies for (theta, d, be->rope_dtype)
 * (host-computed by dfl_rope_inv_freq like the CPU ops), uploaded on the compute stream the
 * first time it is asked for. */
int cuda_rope_table(dfl_be *be, float theta, int d, const float **out);
int cuda_swiglu(dfl_be *be, void *out, const void *gu, int64_t R, int64_t I);
int cuda_add(dfl_be *be, void *y, const void *x, int64_t n);
/* C[M,N] (ldc, cdt) = beta * C + bias[N] (bias may be NULL; beta == 0 writes without reading) */
int cuda_scale_bias(dfl_be *be, void *C, dfl_dtype cdt, int64_t ldc, int64_t M, int64_t N,
                    float beta, const float *bias);
int cuda_attn_varlen(dfl_be *be, const dfl_attn_varlen *a);
/* moe.cu: mixture-of-experts routing, gather, grouped GEMM, combine */
int cuda_moe_route(dfl_be *be, const dfl_moe_route *r);
int cuda_moe_gather(dfl_be *be, void *dst, const void *src, const int32_t *rows,
                               const int32_t *offsets, int E, int64_t cap, int64_t H);
int cuda_moe_matmul(dfl_be *be, const dfl_moe_mm *m);
int cuda_moe_combine(dfl_be *be, void *out, const void *y, const int32_t *slot,
                                const float *weight, int64_t T, int k, int64_t H, bool accumulate,
                                const void *shared, const float *shared_gate);
/* attn.cu: raise shared-memory limits of the attention kernels (once, at open). */
int cuda_attn_init(dfl_be *be, dfl_err *e);
int cuda_attn_dim_index(int d);   /* 0, 1, 2 for 64, 128, 256; -1 otherwise */
int cuda_attn_n_variants(int d);

/* ---- hybrid targets (hybrid.cu) ---- */
int cuda_rmsnorm_1p(dfl_be *be, void *y, const void *x, const void *w, int64_t R, int64_t n,
                    float eps);
int cuda_qknorm_rope_partial(dfl_be *be, void *x, int64_t ld, const void *w, const int32_t *pos,
                             int64_t R, int heads, int d, int rot, float eps, float theta);
int cuda_sigmoid_mul(dfl_be *be, void *x, int64_t ldx, const void *g, int64_t ldg, int64_t R,
                     int64_t n);
int cuda_conv1d_silu(dfl_be *be, void *y, int64_t ldy, const void *x, int64_t ldx, const void *w,
                     const int32_t *pos, int64_t T, int64_t C, int K);
int cuda_l2norm(dfl_be *be, void *x, int64_t ld, int64_t R, int heads, int d, float scale, float eps);
int cuda_gated_rmsnorm(dfl_be *be, void *x, int64_t ldx, const void *z, int64_t ldz, const void *w,
                       int64_t R, int heads, int d, float eps);
int cuda_gated_delta(dfl_be *be, const dfl_gated_delta *g);

/* ---- drafter ops (train_ops.cu, dflash_attn.cu) ---- */
int cuda_rmsnorm_bwd(dfl_be *be, void *dx, float *dw, const void *dy, const void *x, const void *w,
                     const float *rstd, int64_t R, int64_t n, bool accumulate_dx);
int cuda_qknorm_rope_bwd(dfl_be *be, void *dx, int64_t ld, float *dw, const void *x_in, const void *w,
                         const float *rstd, const int32_t *pos, int64_t R, int heads, int d,
                         float eps, float theta);
int cuda_swiglu_bwd(dfl_be *be, void *dgu, const void *dout, const void *gu, int64_t R, int64_t I);
int cuda_lmce(dfl_be *be, const dfl_lmce *a);
int cuda_sumsq(dfl_be *be, double *out, const float *x, int64_t n);
int cuda_clip_scale(dfl_be *be, float *out, int32_t *skip, const double *sums, float max_norm);
int cuda_block_metrics(dfl_be *be, double *out, const uint8_t *correct, const float *weight,
                       int64_t n_blocks, int bs);
int cuda_adamw(dfl_be *be, const dfl_adamw *a);
int cuda_uniform_noise(dfl_be *be, void *x, int64_t n, float amp, uint64_t seed);
int cuda_segment_sum(dfl_be *be, void *dst, const void *src, const int32_t *off, int64_t n,
                     int64_t w);
int cuda_gather_rows(dfl_be *be, void *dst, const void *src, const int32_t *rows, int64_t n,
                     int64_t row_bytes);
int cuda_dflash_attn(dfl_be *be, const dfl_dflash_attn *a);
int cuda_dflash_attn_bwd(dfl_be *be, const dfl_dflash_attn *a);

#endif
