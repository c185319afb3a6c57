/* be_cuda.cu: the CUDA backend: construction, device memory (tracked cudaMalloc with a freeze),
 * copies, error reporting, matmul through cuBLASLt (plans cached per shape, optional timing of
 * candidate algorithms), the op table, and the C API of kernels/cuda.h. The elementwise ops are
 * in ops.cu, attention in attn.cu. Every op is enqueued on the backend's compute stream; an op
 * that fails records its message, which the next sync reports. */
#include <dlfcn.h>
#include <pthread.h>
#include <stdarg.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "be_cuda.cuh"

extern "C" {
#include "log.h"
#include "util.h"
}

#define WORKSPACE_BYTES ((size_t)32 << 20)   /* cuBLASLt workspace (Hopper wants 32 MiB) */

/* ------------------------------------------------------------------------------------------ */
/* errors */

int cuda_op_fail(dfl_be *be, int code, const char *fmt, ...)
{
    cuda_impl *im = cuda_of(be);
    if (im->err_code == 0) {
        va_list ap;
        va_start(ap, fmt);
        int n = snprintf(im->err_msg, sizeof im->err_msg, "%s: ", be->name);
        if (n < 0 || (size_t)n >= sizeof im->err_msg)
            n = 0;
        vsnprintf(im->err_msg + n, sizeof im->err_msg - (size_t)n, fmt, ap);
        va_end(ap);
        im->err_code = code;
    }
    return code;
}

int cuda_launch_check(dfl_be *be, const char *op)
{
    cudaError_t err = cudaGetLastError();
    if (err != cudaSuccess)
        return cuda_op_fail(be, DFL_EDEVICE, "%s: kernel launch failed: %s", op,
                            cudaGetErrorString(err));
    return 0;
}

int cuda_enter(dfl_be *be)
{
    cudaError_t err = cudaSetDevice(cuda_of(be)->device);
    if (err != cudaSuccess)
        return cuda_op_fail(be, DFL_EDEVICE, "cudaSetDevice: %s", cudaGetErrorString(err));
    return 0;
}

static int cuda_fail_err(dfl_err *e, cudaError_t err, const char *what, const char *name)
{
    return dfl_fail(e, DFL_EDEVICE, "%s: %s: %s", name, what, cudaGetErrorString(err));
}

static const char *fmtb(size_t bytes, char *buf, size_t n) { return dfl_fmt_bytes((double)bytes, buf, n); }

/* ------------------------------------------------------------------------------------------ */
/* memory */

static void *cu_alloc(dfl_be *be, size_t bytes, dfl_err *e)
{
    cuda_impl *im = cuda_of(be);
    char b1[32], b2[32], b3[32], b4[32];
    if (im->frozen) {
        dfl_fail(e, DFL_ENOMEM, "%s: allocation of %s after device memory was frozen (the steady "
                 "state must not allocate: allocate every buffer before dfl_cuda_freeze)",
                 be->name, fmtb(bytes, b1, sizeof b1));
        return NULL;
    }
    cudaError_t err = cudaSetDevice(im->device);
    if (err != cudaSuccess) {
        cuda_fail_err(e, err, "cudaSetDevice", be->name);
        return NULL;
    }
    if (im->n_recs == im->cap_recs) {
        size_t cap = im->cap_recs ? 2 * im->cap_recs : 256;
        cuda_alloc_rec *r = (cuda_alloc_rec *)realloc(im->recs, cap * sizeof *r);
        if (!r) {
            dfl_fail(e, DFL_ENOMEM, "%s: out of host memory", be->name);
            return NULL;
        }
        im->recs = r;
        im->cap_recs = cap;
    }
    size_t n = bytes ? bytes : 1;
    void *p = NULL;
    err = cudaMalloc(&p, n);
    if (err != cudaSuccess || !p) {
        cudaGetLastError();
        size_t fr = 0, tot = 0;
        cudaMemGetInfo(&fr, &tot);
        cudaGetLastError();
        dfl_fail(e, DFL_ENOMEM, "%s: cannot allocate %s of device memory (%s free of %s; %s held "
                 "by this backend): %s", be->name, fmtb(bytes, b1, sizeof b1),
                 fmtb(fr, b2, sizeof b2), fmtb(tot, b3, sizeof b3),
                 fmtb(im->allocated + im->ws_bytes + im->ds_bytes, b4, sizeof b4), cudaGetErrorString(err));
        return NULL;
    }
    im->recs[im->n_recs].p = p;
    im->recs[im->n_recs].bytes = n;
    im->n_recs++;
    im->allocated += n;
    if (im->allocated > im->peak)
        im->peak = im->allocated;
    return p;
}

static void cu_free(dfl_be *be, void *p)
{
    cuda_impl *im = cuda_of(be);
    if (!p)
        return;
    for (size_t i = im->n_recs; i-- > 0;) {
        if (im->recs[i].p == p) {
            im->allocated -= im->recs[i].bytes;
            im->recs[i] = im->recs[--im->n_recs];
            cudaSetDevice(im->device);
            cudaError_t err = cudaFree(p);
            if (err != cudaSuccess)
                cuda_op_fail(be, DFL_EDEVICE, "cudaFree: %s", cudaGetErrorString(err));
            return;
        }
    }
    cuda_op_fail(be, DFL_EDEVICE, "free of %p, which this backend did not allocate", p);
}

/* Host -> device. Returns when src may be reused: pageable sources are staged by the driver
 * before cudaMemcpyAsync returns; pinned ones are copied by DMA later, so we wait for them. */
static int cu_upload(dfl_be *be, void *dst, const void *src, size_t n)
{
    cuda_impl *im = cuda_of(be);
    if (n == 0)
        return 0;
    int rc = cuda_enter(be);
    if (rc)
        return rc;
    cudaError_t err = cudaMemcpyAsync(dst, src, n, cudaMemcpyHostToDevice, im->stream);
    if (err != cudaSuccess)
        return cuda_op_fail(be, DFL_EDEVICE, "upload of %zu bytes: %s", n, cudaGetErrorString(err));
    cudaPointerAttributes at;
    err = cudaPointerGetAttributes(&at, src);
    if (err != cudaSuccess) {
        cudaGetLastError();
        at.type = cudaMemoryTypeHost;   /* unknown: be safe */
    }
    if (at.type == cudaMemoryTypeHost) {
        im->n_syncs++;
        err = cudaStreamSynchronize(im->stream);
        if (err != cudaSuccess)
            return cuda_op_fail(be, DFL_EDEVICE, "upload of %zu bytes: %s", n,
                                cudaGetErrorString(err));
    }
    return 0;
}

/* Device -> host, synchronous: the data is in dst on return (the pipeline uses
 * dfl_cuda_download_async for overlapped copies). */
static int cu_download(dfl_be *be, void *dst, const void *src, size_t n)
{
    cuda_impl *im = cuda_of(be);
    if (n == 0)
        return 0;
    int rc = cuda_enter(be);
    if (rc)
        return rc;
    cudaError_t err = cudaMemcpyAsync(dst, src, n, cudaMemcpyDeviceToHost, im->stream);
    im->n_syncs++;
    if (err == cudaSuccess)
        err = cudaStreamSynchronize(im->stream);
    if (err != cudaSuccess)
        return cuda_op_fail(be, DFL_EDEVICE, "download of %zu bytes: %s", n, cudaGetErrorString(err));
    return 0;
}

static int cu_memset0(dfl_be *be, void *dst, size_t n)
{
    if (n == 0)
        return 0;
    int rc = cuda_enter(be);
    if (rc)
        return rc;
    cudaError_t err = cudaMemsetAsync(dst, 0, n, cuda_of(be)->stream);
    if (err != cudaSuccess)
        return cuda_op_fail(be, DFL_EDEVICE, "memset of %zu bytes: %s", n, cudaGetErrorString(err));
    return 0;
}

static int cu_copy(dfl_be *be, void *dst, const void *src, size_t n)
{
    if (n == 0 || dst == src)
        return 0;
    uintptr_t d = (uintptr_t)dst, s = (uintptr_t)src;
    if (d < s + n && s < d + n)
        return cuda_op_fail(be, DFL_EUNSUP, "copy of %zu bytes between overlapping buffers", n);
    int rc = cuda_enter(be);
    if (rc)
        return rc;
    cudaError_t err = cudaMemcpyAsync(dst, src, n, cudaMemcpyDeviceToDevice, cuda_of(be)->stream);
    if (err != cudaSuccess)
        return cuda_op_fail(be, DFL_EDEVICE, "copy of %zu bytes: %s", n, cudaGetErrorString(err));
    return 0;
}

static int cu_sync(dfl_be *be, dfl_err *e)
{
    cuda_impl *im = cuda_of(be);
    cudaError_t err = cudaSetDevice(im->device);
    im->n_syncs++;
    if (err == cudaSuccess)
        err = cudaStreamSynchronize(im->stream);
    if (im->err_code) {
        int code = im->err_code;
        dfl_fail(e, code, "%s", im->err_msg);
        im->err_code = 0;
        im->err_msg[0] = 0;
        return code;
    }
    if (err != cudaSuccess)
        return dfl_fail(e, DFL_EDEVICE, "%s: CUDA error while running queued work: %s (an "
                        "earlier kernel failed; compute-sanitizer finds which)", be->name,
                        cudaGetErrorString(err));
    return 0;
}

/* ------------------------------------------------------------------------------------------ */
/* matmul: row-major C = A B is column-major C^T = B^T A^T, so cuBLASLt's A is our B and its B is
 * our A, with m = N, n = M. */

static bool mm_cuda_type(dfl_dtype t, cudaDataType_t *ct)
{
    *ct = CUDA_R_32F;
    switch (t) {
    case DFL_BF16: *ct = CUDA_R_16BF; return true;
    case DFL_F16: *ct = CUDA_R_16F; return true;
    case DFL_F32: *ct = CUDA_R_32F; return true;
    default: return false;
    }
}

/* Alignment (power of two, at most 256) of every column start of a matrix at p with leading
 * dimension ld elements of es bytes. */
static int32_t mm_align(const void *p, int64_t ld, size_t es)
{
    uint64_t a = (uint64_t)(uintptr_t)p | ((uint64_t)ld * es) | 256;
    return (int32_t)(a & (~a + 1));
}

static void mm_plan_release(cuda_mm_plan *pl)
{
    if (pl->desc)
        cublasLtMatmulDescDestroy(pl->desc);
    if (pl->la)
        cublasLtMatrixLayoutDestroy(pl->la);
    if (pl->lb)
        cublasLtMatrixLayoutDestroy(pl->lb);
    if (pl->lc)
        cublasLtMatrixLayoutDestroy(pl->lc);
    memset(pl, 0, sizeof *pl);
}

#define LT_TRY(call)                                                                          \
    do {                                                                                      \
        cublasStatus_t st_ = (call);                                                          \
        if (st_ != CUBLAS_STATUS_SUCCESS)                                                     \
            return cuda_op_fail(be, DFL_EDEVICE, "matmul %lldx%lldx%lld: %s: %s",             \
                                (long long)m->M, (long long)m->N, (long long)m->K, #call,     \
                                cublasLtGetStatusString(st_));                                \
    } while (0)

static int mm_preference(dfl_be *be, const dfl_mm *m, const cuda_mm_key *k,
                         cublasLtMatmulPreference_t *pref)
{
    cuda_impl *im = cuda_of(be);
    uint64_t ws = im->ws_bytes;
    uint32_t aa = (uint32_t)k->align_b, ab = (uint32_t)k->align_a, ac = (uint32_t)k->align_c;
    LT_TRY(cublasLtMatmulPreferenceCreate(pref));
    LT_TRY(cublasLtMatmulPreferenceSetAttribute(*pref, CUBLASLT_MATMUL_PREF_MAX_WORKSPACE_BYTES, &ws, sizeof ws));
    LT_TRY(cublasLtMatmulPreferenceSetAttribute(*pref, CUBLASLT_MATMUL_PREF_MIN_ALIGNMENT_A_BYTES, &aa, sizeof aa));
    LT_TRY(cublasLtMatmulPreferenceSetAttribute(*pref, CUBLASLT_MATMUL_PREF_MIN_ALIGNMENT_B_BYTES, &ab, sizeof ab));
    LT_TRY(cublasLtMatmulPreferenceSetAttribute(*pref, CUBLASLT_MATMUL_PREF_MIN_ALIGNMENT_C_BYTES, &ac, sizeof ac));
    LT_TRY(cublasLtMatmulPreferenceSetAttribute(*pref, CUBLASLT_MATMUL_PREF_MIN_ALIGNMENT_D_BYTES, &ac, sizeof ac));
    return 0;
}

/* Candidate algorithms for the plan's current descriptor (best first); *n_out may be 0. */
static int mm_heuristics(dfl_be *be, const dfl_mm *m, cuda_mm_plan *pl,
                         cublasLtMatmulHeuristicResult_t *res, int max, int *n_out)
{
    cuda_impl *im = cuda_of(be);
    cublasLtMatmulPreference_t pref = NULL;
    *n_out = 0;
    int rc = mm_preference(be, m, &pl->key, &pref);
    if (rc) {
        if (pref)
            cublasLtMatmulPreferenceDestroy(pref);
        return rc;
    }
    int n = 0;
    cublasStatus_t st = cublasLtMatmulAlgoGetHeuristic(im->lt, pl->desc, pl->la, pl->lb, pl->lc,
                                                       pl->lc, pref, max, res, &n);
    cublasLtMatmulPreferenceDestroy(pref);
    if (st != CUBLAS_STATUS_SUCCESS && st != CUBLAS_STATUS_NOT_SUPPORTED)
        return cuda_op_fail(be, DFL_EDEVICE, "matmul %lldx%lldx%lld: cublasLtMatmulAlgoGetHeuristic: %s",
                            (long long)m->M, (long long)m->N, (long long)m->K,
                            cublasLtGetStatusString(st));
    int good = 0;
    for (int i = 0; st == CUBLAS_STATUS_SUCCESS && i < n; i++)
        if (res[i].state == CUBLAS_STATUS_SUCCESS && res[i].workspaceSize <= im->ws_bytes)
            res[good++] = res[i];
    *n_out = good;
    return 0;
}

static int mm_set_epilogue(dfl_be *be, const dfl_mm *m, cuda_mm_plan *pl, bool bias)
{
    cublasLtEpilogue_t epi = bias ? CUBLASLT_EPILOGUE_BIAS : CUBLASLT_EPILOGUE_DEFAULT;
    LT_TRY(cublasLtMatmulDescSetAttribute(pl->desc, CUBLASLT_MATMUL_DESC_EPILOGUE, &epi, sizeof epi));
    if (bias) {
        int32_t bt = CUDA_R_32F;
        const void *bp = m->bias;
        LT_TRY(cublasLtMatmulDescSetAttribute(pl->desc, CUBLASLT_MATMUL_DESC_BIAS_DATA_TYPE, &bt, sizeof bt));
        LT_TRY(cublasLtMatmulDescSetAttribute(pl->desc, CUBLASLT_MATMUL_DESC_BIAS_POINTER, &bp, sizeof bp));
    }
    pl->bias_fused = bias;
    return 0;
}

static int mm_plan_build(dfl_be *be, const dfl_mm *m, cuda_mm_plan *pl)
{
    cudaDataType_t at, bt, ct;
    mm_cuda_type(m->adt, &at);
    mm_cuda_type(m->bdt, &bt);
    mm_cuda_type(m->cdt, &ct);
    cublasOperation_t opa = m->tb ? CUBLAS_OP_T : CUBLAS_OP_N;   /* Lt's A = our B */
    cublasOperation_t opb = m->ta ? CUBLAS_OP_T : CUBLAS_OP_N;   /* Lt's B = our A */
    LT_TRY(cublasLtMatmulDescCreate(&pl->desc, CUBLAS_COMPUTE_32F, CUDA_R_32F));
    LT_TRY(cublasLtMatmulDescSetAttribute(pl->desc, CUBLASLT_MATMUL_DESC_TRANSA, &opa, sizeof opa));
    LT_TRY(cublasLtMatmulDescSetAttribute(pl->desc, CUBLASLT_MATMUL_DESC_TRANSB, &opb, sizeof opb));
    /* stored column-major shapes: our B [K,N] row-major is N x K column-major (op N), our B^T
     * stored [N,K] is K x N (op T); likewise for A with M. */
    LT_TRY(cublasLtMatrixLayoutCreate(&pl->la, bt, (uint64_t)(m->tb ? m->K : m->N),
                                      (uint64_t)(m->tb ? m->N : m->K), m->ldb));
    LT_TRY(cublasLtMatrixLayoutCreate(&pl->lb, at, (uint64_t)(m->ta ? m->M : m->K),
                                      (uint64_t)(m->ta ? m->K : m->M), m->lda));
    LT_TRY(cublasLtMatrixLayoutCreate(&pl->lc, ct, (uint64_t)m->N, (uint64_t)m->M, m->ldc));

    /* The bias epilogue takes a bias of D's type: fuse only for f32 output (our bias is f32),
     * with a 16-byte aligned bias; otherwise a separate kernel adds it. */
    bool fuse = m->bias && m->cdt == DFL_F32 && is_aligned(m->bias, 16);
    cublasLtMatmulHeuristicResult_t res[1];
    int n = 0, rc;
    if ((rc = mm_set_epilogue(be, m, pl, fuse)))
        return rc;
    if ((rc = mm_heuristics(be, m, pl, res, 1, &n)))
        return rc;
    if (n == 0 && fuse) {
        if ((rc = mm_set_epilogue(be, m, pl, false)) || (rc = mm_heuristics(be, m, pl, res, 1, &n)))
            return rc;
    }
    pl->use_lt = n > 0;
    if (n > 0)
        pl->algo = res[0].algo;
    return 0;
}

/* C = Cin (rows of N elements at ldc) before a product that adds C in place */
static int mm_copy_cin(dfl_be *be, const dfl_mm *m)
{
    if (dfl_mm_cin(m) == m->C)
        return 0;
    const size_t es = dfl_dtype_size(m->cdt);
    cudaError_t err = cudaMemcpy2DAsync(m->C, (size_t)m->ldc * es, dfl_mm_cin(m), (size_t)m->ldc * es,
                                        (size_t)m->N * es, (size_t)m->M, cudaMemcpyDeviceToDevice,
                                        cuda_of(be)->stream);
    return err == cudaSuccess ? 0 : cuda_op_fail(be, DFL_EDEVICE, "matmul: copying C: %s",
                                                 cudaGetErrorString(err));
}

static void mm_make_key(const dfl_mm *m, cuda_mm_key *k)
{
    memset(k, 0, sizeof *k);
    k->M = m->M; k->N = m->N; k->K = m->K;
    k->lda = m->lda; k->ldb = m->ldb; k->ldc = m->ldc;
    k->adt = m->adt; k->bdt = m->bdt; k->cdt = m->cdt;
    k->ta = m->ta; k->tb = m->tb;
    k->beta_nonzero = m->beta != 0.0f;
    k->has_bias = m->bias != NULL;
    k->align_a = mm_align(m->A, m->lda, dfl_dtype_size(m->adt));
    k->align_b = mm_align(m->B, m->ldb, dfl_dtype_size(m->bdt));
    k->align_c = mm_align(m->C, m->ldc, dfl_dtype_size(m->cdt));
    if (dfl_mm_cin(m) != m->C) {
        const int ai = mm_align(dfl_mm_cin(m), m->ldc, dfl_dtype_size(m->cdt));
        k->align_c = ai < k->align_c ? ai : k->align_c;
    }
    k->align_bias = m->bias ? mm_align(m->bias, 0, 4) : 0;
}

/* The plan for m's shape: cached, or built (evicting the least recently used). */
static int mm_get_plan(dfl_be *be, const dfl_mm *m, cuda_mm_plan **out)
{
    cuda_impl *im = cuda_of(be);
    cuda_mm_key k;
    mm_make_key(m, &k);
    cuda_mm_plan *victim = NULL;
    for (int i = 0; i < CUDA_MM_PLANS; i++) {
        cuda_mm_plan *pl = &im->plans[i];
        if (pl->used && memcmp(&pl->key, &k, sizeof k) == 0) {
            pl->last_use = ++im->plan_clock;
            *out = pl;
            return 0;
        }
        if (!pl->used) {
            if (!victim || victim->used)
                victim = pl;   /* a free slot first */
        } else if (!victim || (victim->used && pl->last_use < victim->last_use)) {
            victim = pl;       /* else the least recently used */
        }
    }
    mm_plan_release(victim);
    victim->key = k;
    int rc = mm_plan_build(be, m, victim);
    if (rc) {
        mm_plan_release(victim);
        return rc;
    }
    victim->used = true;
    victim->last_use = ++im->plan_clock;
    *out = victim;
    return 0;
}

static int mm_run(dfl_be *be, const dfl_mm *m, cuda_mm_plan *pl, const cublasLtMatmulAlgo_t *algo)
{
    cuda_impl *im = cuda_of(be);
    if (pl->use_lt) {
        if (pl->bias_fused) {
            const void *bp = m->bias;
            LT_TRY(cublasLtMatmulDescSetAttribute(pl->desc, CUBLASLT_MATMUL_DESC_BIAS_POINTER, &bp, sizeof bp));
        }
        LT_TRY(cublasLtMatmul(im->lt, pl->desc, &m->alpha, m->B, pl->la, m->A, pl->lb, &m->beta,
                              dfl_mm_cin(m), pl->lc, m->C, pl->lc, algo ? algo : &pl->algo, im->ws,
                              im->ws_bytes, im->stream));
    } else {
        int rc = mm_copy_cin(be, m);
        if (rc)
            return rc;
        cudaDataType_t at, bt, ct;
        mm_cuda_type(m->adt, &at);
        mm_cuda_type(m->bdt, &bt);
        mm_cuda_type(m->cdt, &ct);
        cublasStatus_t st = cublasGemmEx(im->blas, m->tb ? CUBLAS_OP_T : CUBLAS_OP_N,
                                         m->ta ? CUBLAS_OP_T : CUBLAS_OP_N, (int)m->N, (int)m->M,
                                         (int)m->K, &m->alpha, m->B, bt, (int)m->ldb, m->A, at,
                                         (int)m->lda, &m->beta, m->C, ct, (int)m->ldc,
                                         CUBLAS_COMPUTE_32F, CUBLAS_GEMM_DEFAULT);
        if (st != CUBLAS_STATUS_SUCCESS)
            return cuda_op_fail(be, DFL_EDEVICE, "matmul %lldx%lldx%lld: cublasGemmEx: %s",
                                (long long)m->M, (long long)m->N, (long long)m->K,
                                cublasGetStatusString(st));
    }
    if (m->bias && !pl->bias_fused)
        return cuda_scale_bias(be, m->C, m->cdt, m->ldc, m->M, m->N, 1.0f, m->bias);
    return 0;
}

static int mm_check(dfl_be *be, const dfl_mm *m)
{
    cudaDataType_t t;
    bool ok = m->adt == m->bdt && mm_cuda_type(m->adt, &t) && mm_cuda_type(m->cdt, &t) &&
              (m->cdt == m->adt || m->cdt == DFL_F32);
    if (!ok)
        return cuda_op_fail(be, DFL_EUNSUP, "matmul: unsupported types %s x %s -> %s (supported: "
                            "bf16 or f16 -> same or f32, f32 -> f32)", dfl_dtype_lower(m->adt),
                            dfl_dtype_lower(m->bdt), dfl_dtype_lower(m->cdt));
    bool lds = m->ldc >= m->N && m->lda >= (m->ta ? m->M : m->K) && m->ldb >= (m->tb ? m->K : m->N) &&
               m->lda >= 1 && m->ldb >= 1;
    if (!lds || m->K < 0)
        return cuda_op_fail(be, DFL_EUSAGE, "matmul %lldx%lldx%lld: bad leading dimensions "
                            "(lda %lld, ldb %lld, ldc %lld, ta %d, tb %d)", (long long)m->M,
                            (long long)m->N, (long long)m->K, (long long)m->lda, (long long)m->ldb,
                            (long long)m->ldc, m->ta, m->tb);
    if ((m->M > INT32_MAX || m->N > INT32_MAX || m->K > INT32_MAX))
        return cuda_op_fail(be, DFL_EUNSUP, "matmul %lldx%lldx%lld: dimension too large",
                            (long long)m->M, (long long)m->N, (long long)m->K);
    return 0;
}

/* DFL_CUDA_GEMM_TMA in the environment (read when the backend opens): 0 or unset, cuBLAS(Lt) for
 * every product; 1, the TMA GEMM (gemm_tma.cu) for the MLP's gate|up product with its SwiGLU
 * (matmul_swiglu); 2, also for every other product it takes (bf16, A [M, K] times a [N, K]
 * weight, beta 0 or 1, no bias) */
static int gemm_tma_level(void)
{
    const char *v = getenv("DFL_CUDA_GEMM_TMA");
    return v && (v[0] == '1' || v[0] == '2') && !v[1] ? v[0] - '0' : 0;
}

/* the product on the TMA GEMM when DFL_CUDA_GEMM_TMA=2 and it fits; DFL_EUNSUP otherwise */
static int mm_tma(dfl_be *be, const dfl_mm *m)
{
    if (cuda_of(be)->gemm_tma < 2 || m->adt != DFL_BF16 || m->bdt != DFL_BF16 || m->cdt != DFL_BF16 ||
        m->ta || !m->tb || m->alpha != 1.0f || (m->beta != 0.0f && m->beta != 1.0f) || m->bias)
        return DFL_EUNSUP;
    const int mode = m->beta != 0.0f ? DFL_CUDA_GEMM_ACC : DFL_CUDA_GEMM_STORE;
    const void *cin = m->beta != 0.0f && m->Cin ? m->Cin : NULL;
    if (!dfl_cuda_gemm_tma_fits(be, m->C, m->ldc, m->A, m->lda, m->B, m->ldb, m->M, m->N, m->K, mode) ||
        (cin && ((uintptr_t)cin & 3)))
        return DFL_EUNSUP;
    return dfl_cuda_gemm_tma(be, m->C, m->ldc, cin, m->A, m->lda, m->B, m->ldb, m->M, m->N, m->K, mode);
}

static int cu_matmul_swiglu(dfl_be *be, void *out, const void *A, const void *W, int64_t R,
                            int64_t I, int64_t K)
{
    if (cuda_of(be)->gemm_tma < 1 ||
        !dfl_cuda_gemm_tma_fits(be, out ? out : (void *)16, I, A, K, W, K, R, 2 * I, K,
                                DFL_CUDA_GEMM_SWIGLU))
        return DFL_EUNSUP;
    if (!out)
        return 0;
    return dfl_cuda_gemm_tma(be, out, I, NULL, A, K, W, K, R, 2 * I, K, DFL_CUDA_GEMM_SWIGLU);
}

static int cu_matmul(dfl_be *be, const dfl_mm *m)
{
    if (m->M <= 0 || m->N <= 0)
        return 0;
    int rc = mm_check(be, m);
    if (rc || (rc = cuda_enter(be)))
        return rc;
    if (m->K > 0 && (rc = mm_tma(be, m)) != DFL_EUNSUP)
        return rc;
    if (m->K == 0)
        return (rc = mm_copy_cin(be, m)) ? rc : cuda_scale_bias(be, m->C, m->cdt, m->ldc, m->M, m->N, m->beta, m->bias);
    cuda_mm_plan *pl;
    if ((rc = mm_get_plan(be, m, &pl)))
        return rc;
    return mm_run(be, m, pl, NULL);
}

/* ------------------------------------------------------------------------------------------ */
/* construction */

static __global__ void probe_kernel(int *p)
{
    if (p)
        *p = 1;
}

static dfl_be_ops cuda_ops;

static void cuda_ops_fill(void)
{
    memset(&cuda_ops, 0, sizeof cuda_ops);
    cuda_ops.alloc = cu_alloc;
    cuda_ops.free = cu_free;
    cuda_ops.upload = cu_upload;
    cuda_ops.download = cu_download;
    cuda_ops.memset0 = cu_memset0;
    cuda_ops.copy = cu_copy;
    cuda_ops.sync = cu_sync;
    cuda_device_ops_fill(&cuda_ops);
    cuda_ops.convert = cuda_convert;
    cuda_ops.matmul = cu_matmul;
    cuda_ops.embedding = cuda_embedding;
    cuda_ops.rmsnorm = cuda_rmsnorm;
    cuda_ops.add_rmsnorm = cuda_add_rmsnorm;
    cuda_ops.qknorm_rope = cuda_qknorm_rope;
    cuda_ops.swiglu = cuda_swiglu;
    cuda_ops.matmul_swiglu = cu_matmul_swiglu;
    cuda_ops.add = cuda_add;
    cuda_ops.attn_varlen = cuda_attn_varlen;
    /* hybrid targets: hybrid.cu */
    cuda_ops.rmsnorm_1p = cuda_rmsnorm_1p;
    cuda_ops.qknorm_rope_partial = cuda_qknorm_rope_partial;
    cuda_ops.sigmoid_mul = cuda_sigmoid_mul;
    cuda_ops.conv1d_silu = cuda_conv1d_silu;
    cuda_ops.l2norm = cuda_l2norm;
    cuda_ops.gated_rmsnorm = cuda_gated_rmsnorm;
    cuda_ops.gated_delta = cuda_gated_delta;
    /* drafter ops: train_ops.cu, dflash_attn.cu */
    cuda_ops.rmsnorm_bwd = cuda_rmsnorm_bwd;
    cuda_ops.qknorm_rope_bwd = cuda_qknorm_rope_bwd;
    cuda_ops.swiglu_bwd = cuda_swiglu_bwd;
    cuda_ops.dflash_attn = cuda_dflash_attn;
    cuda_ops.dflash_attn_bwd = cuda_dflash_attn_bwd;
    cuda_ops.lmce = cuda_lmce;
    cuda_ops.sumsq = cuda_sumsq;
    cuda_ops.clip_scale = cuda_clip_scale;
    cuda_ops.block_metrics = cuda_block_metrics;
    cuda_ops.adamw = cuda_adamw;
    cuda_ops.uniform_noise = cuda_uniform_noise;
    cuda_ops.gather_rows = cuda_gather_rows;
    cuda_ops.segment_sum = cuda_segment_sum;
    /* mixture of experts: moe.cu */
    cuda_ops.moe_route = cuda_moe_route;
    cuda_ops.moe_gather = cuda_moe_gather;
    cuda_ops.moe_matmul = cuda_moe_matmul;
    cuda_ops.moe_combine = cuda_moe_combine;
}

extern "C" int dfl_be_cuda_count(void)
{
    int n = 0;
    cudaError_t err = cudaGetDeviceCount(&n);
    if (err != cudaSuccess) {
        cudaGetLastError();
        return 0;
    }
    return n;
}

extern "C" void dfl_be_cuda_destroy(dfl_be *be)
{
    if (!be)
        return;
    cuda_impl *im = cuda_of(be);
    if (im) {
        cudaSetDevice(im->device);
        if (im->stream)
            cudaStreamSynchronize(im->stream);
        if (im->copy_stream)
            cudaStreamSynchronize(im->copy_stream);
        for (int i = 0; i < CUDA_MM_PLANS; i++)
            mm_plan_release(&im->plans[i]);
        for (size_t i = 0; i < im->n_recs; i++)
            cudaFree(im->recs[i].p);
        free(im->recs);
        if (im->ws)
            cudaFree(im->ws);
        if (im->ds_buf)
            cudaFree(im->ds_buf);
        if (im->rope_tab)
            cudaFree(im->rope_tab);
        if (im->blas)
            cublasDestroy(im->blas);
        if (im->lt)
            cublasLtDestroy(im->lt);
        if (im->copy_stream)
            cudaStreamDestroy(im->copy_stream);
        if (im->stream)
            cudaStreamDestroy(im->stream);
        cudaGetLastError();
        free(im);
    }
    free(be);
}

extern "C" int dfl_be_cuda_open(dfl_be **out, int device, dfl_dtype act, dfl_err *e)
{
    *out = NULL;
    if (act == DFL_DT_INVALID)
        act = DFL_BF16;
    if (act != DFL_BF16 && act != DFL_F32)
        return dfl_fail(e, DFL_EUSAGE, "--device cuda computes in bf16 or f32 (asked for %s)",
                        dfl_dtype_lower(act));
    /* a benchmark's choice of the LM head's chunk (dfl-draft(1)): checked before anything is made */
    int64_t lrows = 0;
    const char *lr = getenv("DFL_CUDA_LMCE_ROWS");
    dfl_err pe = {0};
    if (lr && *lr && dfl_parse_i64(lr, 64, 65535, &lrows, "DFL_CUDA_LMCE_ROWS", &pe))
        return dfl_fail(e, DFL_EUSAGE, "DFL_CUDA_LMCE_ROWS=%s: the LM head's rows a chunk must be a "
                        "number from 64 to 65535", lr);
    /* the attention backward's kept score gradients (dflash_attn.cu reads it): 0 or 1 */
    const char *dsk = getenv("DFL_CUDA_DFLASH_DS");
    if (dsk && *dsk && strcmp(dsk, "0") && strcmp(dsk, "1"))
        return dfl_fail(e, DFL_EUSAGE, "DFL_CUDA_DFLASH_DS=%s: 0 (the attention backward recomputes "
                        "the score gradients) or 1 (keeps them, the default)", dsk);
    int n = dfl_be_cuda_count();
    if (n <= 0)
        return dfl_fail(e, DFL_EDEVICE, "cuda:%d: no CUDA GPU found (use --device cpu)", device);
    if (device < 0 || device >= n)
        return dfl_fail(e, DFL_EDEVICE, "cuda:%d: only %d CUDA GPU%s found", device, n,
                        n == 1 ? "" : "s");
    char name[32];
    snprintf(name, sizeof name, "cuda:%d", device);
    cudaError_t err = cudaSetDevice(device);
    if (err != cudaSuccess)
        return cuda_fail_err(e, err, "cudaSetDevice", name);
    cudaDeviceProp prop;
    err = cudaGetDeviceProperties(&prop, device);
    if (err != cudaSuccess)
        return cuda_fail_err(e, err, "cudaGetDeviceProperties", name);
    if (prop.major < 8)
        return dfl_fail(e, DFL_EDEVICE, "%s (%s) has compute capability %d.%d; dfl's kernels need "
                        "8.0 or newer (and this build targets 9.0)", name, prop.name, prop.major,
                        prop.minor);

    dfl_be *be = (dfl_be *)calloc(1, sizeof *be);
    cuda_impl *im = (cuda_impl *)calloc(1, sizeof *im);
    if (!be || !im) {
        free(be);
        free(im);
        return dfl_fail(e, DFL_ENOMEM, "out of memory");
    }
    be->kind = DFL_BE_CUDA;
    snprintf(be->name, sizeof be->name, "%s", name);
    be->act = act;
    be->wdt = act;
    be->threads = 1;
    be->async = true;
    be->device_comm = true;
    be->fuse_residual = true;
    /* each chunk of the LM head re-reads the whole [V, H] head: chunks must be large for the two
     * GEMMs to be compute-bound */
    be->lmce_rows = lrows ? lrows : 1024;
    be->impl = im;
    im->device = device;
    im->sm_count = prop.multiProcessorCount;
    im->cc_major = prop.major;
    im->gemm_tma = gemm_tma_level();
    im->smem_optin = prop.sharedMemPerBlockOptin;
    int rc = 0;
    cublasStatus_t st;
    char dl[512];
    if (dfl_cublas_load(dl, sizeof dl)) {
        rc = dfl_fail(e, DFL_EDEVICE, "%s: %s", name, dl);
        goto fail;
    }
    if ((err = cudaStreamCreateWithFlags(&im->stream, cudaStreamNonBlocking)) != cudaSuccess ||
        (err = cudaStreamCreateWithFlags(&im->copy_stream, cudaStreamNonBlocking)) != cudaSuccess) {
        rc = cuda_fail_err(e, err, "cannot create streams", name);
        goto fail;
    }
    if ((err = cudaMalloc(&im->ws, WORKSPACE_BYTES)) != cudaSuccess) {
        rc = cuda_fail_err(e, err, "cannot allocate the cuBLAS workspace", name);
        goto fail;
    }
    im->ws_bytes = WORKSPACE_BYTES;
    if ((err = cudaMalloc(&im->rope_tab, sizeof im->rope_host)) != cudaSuccess) {
        rc = cuda_fail_err(e, err, "cannot allocate the RoPE table", name);
        goto fail;
    }
    if ((st = cublasLtCreate(&im->lt)) != CUBLAS_STATUS_SUCCESS) {
        rc = dfl_fail(e, DFL_EDEVICE, "%s: cublasLtCreate: %s", name, cublasLtGetStatusString(st));
        goto fail;
    }
    if ((st = cublasCreate(&im->blas)) != CUBLAS_STATUS_SUCCESS ||
        (st = cublasSetStream(im->blas, im->stream)) != CUBLAS_STATUS_SUCCESS ||
        (st = cublasSetWorkspace(im->blas, im->ws, im->ws_bytes)) != CUBLAS_STATUS_SUCCESS) {
        rc = dfl_fail(e, DFL_EDEVICE, "%s: cuBLAS setup: %s", name, cublasGetStatusString(st));
        goto fail;
    }
    /* Can this device run this build's kernels at all? */
    probe_kernel<<<1, 1, 0, im->stream>>>(NULL);
    err = cudaGetLastError();
    if (err == cudaSuccess)
        err = cudaStreamSynchronize(im->stream);
    if (err != cudaSuccess) {
        rc = dfl_fail(e, DFL_EDEVICE, "%s (%s, compute capability %d.%d) cannot run this build's "
                      "kernels (built for sm_90): %s", name, prop.name, prop.major, prop.minor,
                      cudaGetErrorString(err));
        goto fail;
    }
    if ((rc = cuda_attn_init(be, e)))
        goto fail;
    static bool ops_ready;
    if (!ops_ready) {
        cuda_ops_fill();
        ops_ready = true;
    }
    be->ops = &cuda_ops;
    *out = be;
    return 0;
fail:
    cudaGetLastError();
    dfl_be_cuda_destroy(be);
    return rc;
}

/* ------------------------------------------------------------------------------------------ */
/* kernels/cuda.h */

static inline cudaStream_t to_stream(dfl_cuda_stream s) { return reinterpret_cast<cudaStream_t>(s); }
static inline cudaEvent_t to_event(dfl_cuda_event ev) { return reinterpret_cast<cudaEvent_t>(ev); }

/* Make the device current; on failure fill e. */
static int api_enter(dfl_be *be, dfl_err *e)
{
    cudaError_t err = cudaSetDevice(cuda_of(be)->device);
    return err == cudaSuccess ? 0 : cuda_fail_err(e, err, "cudaSetDevice", be->name);
}

#define API_TRY(call, what)                                                                   \
    do {                                                                                      \
        cudaError_t err_ = (call);                                                            \
        if (err_ != cudaSuccess)                                                              \
            return cuda_fail_err(e, err_, what, be->name);                                    \
    } while (0)

extern "C" int dfl_cuda_device_props(int device, dfl_cuda_props *p, dfl_err *e)
{
    memset(p, 0, sizeof *p);
    char name[32];
    snprintf(name, sizeof name, "cuda:%d", device);
    int n = dfl_be_cuda_count();
    if (device < 0 || device >= n)
        return dfl_fail(e, DFL_EDEVICE, "%s: no such CUDA GPU (%d found)", name, n);
    cudaDeviceProp prop;
    cudaError_t err = cudaGetDeviceProperties(&prop, device);
    if (err != cudaSuccess)
        return cuda_fail_err(e, err, "cudaGetDeviceProperties", name);
    snprintf(p->name, sizeof p->name, "%s", prop.name);
    p->device = device;
    p->cc_major = prop.major;
    p->cc_minor = prop.minor;
    p->sm_count = prop.multiProcessorCount;
    p->mem_total = prop.totalGlobalMem;
    p->smem_per_block_optin = prop.sharedMemPerBlockOptin;
    p->l2_bytes = (size_t)prop.l2CacheSize;
    int cur = 0;
    cudaGetDevice(&cur);
    if ((err = cudaSetDevice(device)) == cudaSuccess) {
        size_t fr = 0, tot = 0;
        err = cudaMemGetInfo(&fr, &tot);
        p->mem_free = fr;
        cudaSetDevice(cur);
    }
    if (err != cudaSuccess) {
        cudaGetLastError();
        return cuda_fail_err(e, err, "cudaMemGetInfo", name);
    }
    return 0;
}

extern "C" dfl_cuda_stream dfl_cuda_compute_stream(dfl_be *be)
{
    return reinterpret_cast<dfl_cuda_stream>(cuda_of(be)->stream);
}

extern "C" dfl_cuda_stream dfl_cuda_copy_stream(dfl_be *be)
{
    return reinterpret_cast<dfl_cuda_stream>(cuda_of(be)->copy_stream);
}

extern "C" int dfl_cuda_stream_sync(dfl_be *be, dfl_cuda_stream s, dfl_err *e)
{
    int rc = api_enter(be, e);
    if (rc)
        return rc;
    cuda_of(be)->n_syncs++;
    API_TRY(cudaStreamSynchronize(to_stream(s)), "CUDA error while running queued work");
    return 0;
}

extern "C" int dfl_cuda_event_create(dfl_be *be, dfl_cuda_event *ev, bool timing, dfl_err *e)
{
    *ev = NULL;
    int rc = api_enter(be, e);
    if (rc)
        return rc;
    cudaEvent_t x;
    API_TRY(cudaEventCreateWithFlags(&x, timing ? cudaEventDefault : cudaEventDisableTiming),
            "cudaEventCreate");
    *ev = reinterpret_cast<dfl_cuda_event>(x);
    return 0;
}

extern "C" void dfl_cuda_event_destroy(dfl_be *be, dfl_cuda_event ev)
{
    if (!ev)
        return;
    cudaSetDevice(cuda_of(be)->device);
    cudaEventDestroy(to_event(ev));
}

extern "C" int dfl_cuda_event_record(dfl_be *be, dfl_cuda_event ev, dfl_cuda_stream s, dfl_err *e)
{
    int rc = api_enter(be, e);
    if (rc)
        return rc;
    API_TRY(cudaEventRecord(to_event(ev), to_stream(s)), "cudaEventRecord");
    return 0;
}

extern "C" int dfl_cuda_stream_wait_event(dfl_be *be, dfl_cuda_stream s, dfl_cuda_event ev, dfl_err *e)
{
    int rc = api_enter(be, e);
    if (rc)
        return rc;
    API_TRY(cudaStreamWaitEvent(to_stream(s), to_event(ev), 0), "cudaStreamWaitEvent");
    return 0;
}

extern "C" int dfl_cuda_event_query(dfl_be *be, dfl_cuda_event ev, bool *done, dfl_err *e)
{
    *done = false;
    int rc = api_enter(be, e);
    if (rc)
        return rc;
    cudaError_t err = cudaEventQuery(to_event(ev));
    if (err == cudaErrorNotReady) {
        cudaGetLastError();
        return 0;
    }
    if (err != cudaSuccess)
        return cuda_fail_err(e, err, "CUDA error while running queued work", be->name);
    *done = true;
    return 0;
}

extern "C" int dfl_cuda_event_sync(dfl_be *be, dfl_cuda_event ev, dfl_err *e)
{
    int rc = api_enter(be, e);
    if (rc)
        return rc;
    if (cudaEventQuery(to_event(ev)) == cudaErrorNotReady) {   /* a real wait: count it */
        cudaGetLastError();
        cuda_of(be)->n_event_waits++;
    }
    API_TRY(cudaEventSynchronize(to_event(ev)), "CUDA error while running queued work");
    return 0;
}

extern "C" int dfl_cuda_event_elapsed(dfl_be *be, dfl_cuda_event start, dfl_cuda_event end,
                                      float *ms, dfl_err *e)
{
    *ms = 0;
    int rc = api_enter(be, e);
    if (rc)
        return rc;
    API_TRY(cudaEventElapsedTime(ms, to_event(start), to_event(end)), "cudaEventElapsedTime");
    return 0;
}

extern "C" void *dfl_cuda_host_alloc(dfl_be *be, size_t bytes, dfl_err *e)
{
    char b[32];
    if (api_enter(be, e))
        return NULL;
    void *p = NULL;
    cudaError_t err = cudaHostAlloc(&p, bytes ? bytes : 1, cudaHostAllocPortable);
    if (err != cudaSuccess || !p) {
        cudaGetLastError();
        dfl_fail(e, DFL_ENOMEM, "%s: cannot allocate %s of pinned host memory: %s", be->name,
                 fmtb(bytes, b, sizeof b), cudaGetErrorString(err));
        return NULL;
    }
    return p;
}

extern "C" void dfl_cuda_host_free(dfl_be *be, void *p)
{
    if (!p)
        return;
    cudaSetDevice(cuda_of(be)->device);
    cudaFreeHost(p);
}

extern "C" int dfl_cuda_host_register(dfl_be *be, void *p, size_t bytes, bool read_only, dfl_err *e)
{
    char b[32];
    int rc = api_enter(be, e);
    if (rc)
        return rc;
    unsigned flags = cudaHostRegisterPortable | (read_only ? cudaHostRegisterReadOnly : 0);
    cudaError_t err = cudaHostRegister(p, bytes, flags);
    if (err != cudaSuccess) {
        cudaGetLastError();
        return dfl_fail(e, DFL_EDEVICE, "%s: cannot page-lock %s of host memory: %s", be->name,
                        fmtb(bytes, b, sizeof b), cudaGetErrorString(err));
    }
    return 0;
}

extern "C" int dfl_cuda_host_unregister(dfl_be *be, void *p, dfl_err *e)
{
    int rc = api_enter(be, e);
    if (rc)
        return rc;
    cudaError_t err = cudaHostUnregister(p);
    if (err != cudaSuccess) {
        cudaGetLastError();
        return cuda_fail_err(e, err, "cudaHostUnregister", be->name);
    }
    return 0;
}

/* An asynchronous copy of bytes on stream s (nothing for 0 bytes); what names it in errors. */
static int copy_async(dfl_be *be, void *dst, const void *src, size_t bytes, cudaMemcpyKind kind,
                      dfl_cuda_stream s, const char *what, dfl_err *e)
{
    if (bytes == 0)
        return 0;
    int rc = api_enter(be, e);
    if (rc)
        return rc;
    API_TRY(cudaMemcpyAsync(dst, src, bytes, kind, to_stream(s)), what);
    return 0;
}

extern "C" int dfl_cuda_download_async(dfl_be *be, void *dst_host, const void *src_dev, size_t bytes,
                                       dfl_cuda_stream s, dfl_err *e)
{
    return copy_async(be, dst_host, src_dev, bytes, cudaMemcpyDeviceToHost, s, "asynchronous download", e);
}

extern "C" int dfl_cuda_upload_async(dfl_be *be, void *dst_dev, const void *src_host, size_t bytes,
                                     dfl_cuda_stream s, dfl_err *e)
{
    return copy_async(be, dst_dev, src_host, bytes, cudaMemcpyHostToDevice, s, "asynchronous upload", e);
}

extern "C" void dfl_cuda_freeze(dfl_be *be, bool frozen) { cuda_of(be)->frozen = frozen; }

extern "C" void dfl_cuda_wait_stats(dfl_be *be, dfl_cuda_waits *w)
{
    w->syncs = cuda_of(be)->n_syncs;
    w->event_waits = cuda_of(be)->n_event_waits;
}
extern "C" bool dfl_cuda_frozen(dfl_be *be) { return cuda_of(be)->frozen; }

extern "C" void dfl_cuda_mem_stats(dfl_be *be, dfl_cuda_mem *m)
{
    cuda_impl *im = cuda_of(be);
    m->allocated = im->allocated;
    m->peak = im->peak;
    m->n_allocs = im->n_recs;
    m->backend_bytes = im->ws_bytes + sizeof im->rope_host + im->ds_bytes;
}

/* Take the op's recorded error (if any) into e. */
static int take_op_error(dfl_be *be, int rc, dfl_err *e)
{
    cuda_impl *im = cuda_of(be);
    if (im->err_code) {
        rc = im->err_code;
        dfl_fail(e, rc, "%s", im->err_msg);
        im->err_code = 0;
        im->err_msg[0] = 0;
    } else if (rc) {
        dfl_fail(e, rc, "%s: failed", be->name);
    }
    return rc;
}

/* "algo A tile T stages S cluster C split-K K swizzle W option O" of an algorithm (cuBLASLt's
 * enum values: cublasLtMatmulTile_t, cublasLtMatmulStages_t, cublasLtClusterShape_t) */
static void mm_algo_desc(const cublasLtMatmulAlgo_t *a, char *buf, size_t n)
{
    static const cublasLtMatmulAlgoConfigAttributes_t at[] = {
        CUBLASLT_ALGO_CONFIG_ID, CUBLASLT_ALGO_CONFIG_TILE_ID, CUBLASLT_ALGO_CONFIG_STAGES_ID,
        CUBLASLT_ALGO_CONFIG_CLUSTER_SHAPE_ID, CUBLASLT_ALGO_CONFIG_SPLITK_NUM,
        CUBLASLT_ALGO_CONFIG_CTA_SWIZZLING, CUBLASLT_ALGO_CONFIG_CUSTOM_OPTION};
    static const char *name[] = {"algo", "tile", "stages", "cluster", "split-K", "swizzle", "option"};
    size_t used = 0;
    buf[0] = 0;
    for (size_t i = 0; i < sizeof at / sizeof at[0] && used < n; i++) {
        /* 32-bit values but for the cluster shape's 16 bits: asked for the size first */
        size_t sz = 0, got = 0;
        uint32_t v = 0;
        uint16_t v16 = 0;
        if (cublasLtMatmulAlgoConfigGetAttribute(a, at[i], NULL, 0, &sz) != CUBLAS_STATUS_SUCCESS ||
            (sz != 2 && sz != 4) ||
            cublasLtMatmulAlgoConfigGetAttribute(a, at[i], sz == 2 ? (void *)&v16 : (void *)&v, sz, &got) !=
                CUBLAS_STATUS_SUCCESS)
            continue;
        if (sz == 2)
            v = v16;
        int w = snprintf(buf + used, n - used, "%s%s %u", used ? " " : "", name[i], v);
        used += w > 0 ? (size_t)w : 0;
    }
}

/* The plan for m (checked, on this backend's device) into *pl; NULL for an empty product */
static int mm_plan_for(dfl_be *be, const dfl_mm *m, cuda_mm_plan **pl, dfl_err *e)
{
    *pl = NULL;
    if (m->M <= 0 || m->N <= 0 || m->K <= 0)
        return 0;
    int rc = mm_check(be, m);
    if (rc || (rc = cuda_enter(be)) || (rc = mm_get_plan(be, m, pl)))
        return take_op_error(be, rc, e);
    return 0;
}

/* The choice the tune and the pick make for m: its plan and up to max of cuBLASLt's candidates
 * (best first) into res, *n of them; *pl NULL where there is nothing to choose (an empty
 * product, or the cublasGemmEx fallback) */
static int mm_candidates(dfl_be *be, const dfl_mm *m, int max, cuda_mm_plan **pl,
                         cublasLtMatmulHeuristicResult_t *res, int *n, dfl_err *e)
{
    *n = 0;
    cuda_mm_plan *p;
    int rc = mm_plan_for(be, m, &p, e);
    *pl = NULL;
    if (rc || !p || !p->use_lt)
        return rc;
    if ((rc = mm_heuristics(be, m, p, res, max, n)))
        return take_op_error(be, rc, e);
    *pl = p;
    return 0;
}

/* The GPU runs large products at its power cap, where an algorithm's rate is set by its energy a
 * FLOP, not by its speed at the burst clocks of a few calls (on the H200, cuBLASLt's sixth
 * candidate for the 16384 x 24576 x 4096 product sustained 706 TFLOP/s against its first
 * choice's 690, `bench-ceiling --algos`). So the tuning first holds the GPU at the clocks a long
 * run leaves it (the first choice for TUNE_WARM_MS), then times every candidate in slices of
 * about TUNE_SLICE_MS, one slice each a round, `rounds` rounds (every other one in reverse order):
 * the clocks drift by a few per cent over seconds, and the rounds spread that drift over all
 * candidates alike. Only cuBLASLt's heuristic list is timed: a search of every tile, kernel option
 * and cluster shape its algorithms accept (2,839 configurations checked, 1,024 run, for each of
 * dfl-target's products at 8B on the H200) found none better at the cap than the list's best
 * (bench/target-notes.md, tenth). */
#define TUNE_WARM_MS 250.0
#define TUNE_SLICE_MS 25.0
#define TUNE_MAX_CALLS 100000

extern "C" int dfl_cuda_matmul_tune(dfl_be *be, const dfl_mm *m, int max_algos, int rounds,
                                    float *best_ms, float *heuristic_ms, dfl_err *e)
{
    cuda_impl *im = cuda_of(be);
    if (best_ms)
        *best_ms = 0;
    if (heuristic_ms)
        *heuristic_ms = 0;
    if (max_algos < 1)
        max_algos = 1;
    if (max_algos > 32)
        max_algos = 32;
    if (rounds < 1)
        rounds = 1;
    cuda_mm_plan *pl;
    cublasLtMatmulHeuristicResult_t res[32];
    int n = 0;
    int rc = mm_candidates(be, m, max_algos, &pl, res, &n, e);
    if (rc || !pl)
        return rc;
    /* finish pending work so that it does not count */
    if ((rc = cu_sync(be, e)))
        return rc;
    cudaEvent_t t0 = NULL, t1 = NULL;
    API_TRY(cudaEventCreate(&t0), "cudaEventCreate");
    if (cudaEventCreate(&t1) != cudaSuccess) {
        cudaEventDestroy(t0);
        return dfl_fail(e, DFL_EDEVICE, "%s: cudaEventCreate failed", be->name);
    }
    /* ms of `calls` calls of candidate i into *ms; false where a call failed (the candidate is
     * skipped); a CUDA error in err */
    cudaError_t err = cudaSuccess;
    auto timed = [&](int i, int64_t calls, double *ms) {
        bool ok = (err = cudaEventRecord(t0, im->stream)) == cudaSuccess;
        for (int64_t c = 0; c < calls && ok; c++)
            ok = cublasLtMatmul(im->lt, pl->desc, &m->alpha, m->B, pl->la, m->A, pl->lb, &m->beta, dfl_mm_cin(m),
                                pl->lc, m->C, pl->lc, &res[i].algo, im->ws, im->ws_bytes,
                                im->stream) == CUBLAS_STATUS_SUCCESS;
        float f = 0;
        if (err == cudaSuccess && (err = cudaEventRecord(t1, im->stream)) == cudaSuccess &&
            (err = cudaEventSynchronize(t1)) == cudaSuccess)
            err = cudaEventElapsedTime(&f, t0, t1);
        *ms = f;
        return ok && err == cudaSuccess;
    };
    /* calls to fill ms milliseconds at per ms a call */
    auto calls_for = [](double ms, double per) {
        double c = ms / (per > 1e-4 ? per : 1e-4);
        return (int64_t)(c < 1 ? 1 : c > TUNE_MAX_CALLS ? TUNE_MAX_CALLS : c);
    };
    bool good[32] = {false};
    double acc[32] = {0}, ms = 0;
    int64_t slice = 1;
    bool warm = false;
    for (int i = 0; i < n && err == cudaSuccess; i++) {
        good[i] = timed(i, 1, &ms);   /* the check that candidate i runs */
        if (good[i] && !warm) {       /* the first that runs: to the power cap, and the slice */
            int64_t w = calls_for(TUNE_WARM_MS, ms);
            if ((warm = timed(i, w, &ms)))
                slice = calls_for(TUNE_SLICE_MS, ms / (double)w);
        }
    }
    /* odd rounds go backwards, so that a drift along a round falls on every candidate alike */
    for (int r = 0; r < rounds && err == cudaSuccess; r++)
        for (int k = 0; k < n && err == cudaSuccess; k++) {
            const int i = r % 2 ? n - 1 - k : k;
            if (good[i]) {
                good[i] = timed(i, slice, &ms);
                acc[i] += ms;
            }
        }
    cudaEventDestroy(t0);
    cudaEventDestroy(t1);
    if (err != cudaSuccess)
        return cuda_fail_err(e, err, "while timing matmul algorithms", be->name);
    int best_i = -1;
    for (int i = 0; i < n; i++)
        if (good[i] && (best_i < 0 || acc[i] < acc[best_i]))
            best_i = i;
    if (best_i >= 0)
        pl->algo = res[best_i].algo;
    const double per = (double)rounds * (double)slice;
    if (best_ms && best_i >= 0)
        *best_ms = (float)(acc[best_i] / per);
    if (heuristic_ms && n > 0 && good[0])
        *heuristic_ms = (float)(acc[0] / per);
    if (best_i >= 0) {
        char d0[160] = "", db[160] = "";
        mm_algo_desc(&res[0].algo, d0, sizeof d0);
        mm_algo_desc(&res[best_i].algo, db, sizeof db);
        dfl_verbose("matmul tune %lldx%lldx%lld%s: kept cuBLASLt's candidate %d of %d (%s), %.4f ms a call at "
                    "the power cap against %.4f for the first choice (%s)",
                    (long long)m->M, (long long)m->N, (long long)m->K, m->beta != 0.0f ? " +C" : "", best_i, n, db,
                    acc[best_i] / per, good[0] ? acc[0] / per : 0.0, d0);
    }
    return 0;
}

extern "C" int dfl_cuda_matmul_pick(dfl_be *be, const dfl_mm *m, int index, int *n_algos, char *desc,
                                    size_t desc_n, dfl_err *e)
{
    if (desc && desc_n)
        desc[0] = 0;
    if (n_algos)
        *n_algos = 0;
    cuda_mm_plan *pl;
    cublasLtMatmulHeuristicResult_t res[32];
    int n = 0;
    int rc = mm_candidates(be, m, 32, &pl, res, &n, e);
    if (rc || !pl)
        return rc;
    if (n_algos)
        *n_algos = n;
    if (index < 0 || index >= n)
        return dfl_fail(e, DFL_EUSAGE, "matmul %lldx%lldx%lld: candidate %d of %d", (long long)m->M,
                        (long long)m->N, (long long)m->K, index, n);
    pl->algo = res[index].algo;
    if (desc && desc_n)
        mm_algo_desc(&pl->algo, desc, desc_n);
    return 0;
}

static_assert(sizeof(cublasLtMatmulAlgo_t) == DFL_MM_ALGO_BYTES, "cublasLtMatmulAlgo_t is not 64 bytes");

extern "C" int dfl_cuda_matmul_algo(dfl_be *be, const dfl_mm *m, dfl_mm_algo *a, bool set, dfl_err *e)
{
    cuda_impl *im = cuda_of(be);
    cuda_mm_plan *pl;
    int rc = mm_plan_for(be, m, &pl, e);
    if (rc)
        return rc;
    if (!pl)
        return dfl_fail(e, DFL_EUNSUP, "%s: an empty product has no algorithm", be->name);
    const cuda_mm_key *k = &pl->key;
    if (!set) {
        snprintf(a->key, sizeof a->key,
                 "%lldx%lldx%lld ld %lld,%lld,%lld dtype %d,%d,%d trans %d,%d beta %d bias %d align %d,%d,%d,%d",
                 (long long)k->M, (long long)k->N, (long long)k->K, (long long)k->lda, (long long)k->ldb,
                 (long long)k->ldc, k->adt, k->bdt, k->cdt, k->ta, k->tb, k->beta_nonzero, k->has_bias,
                 k->align_a, k->align_b, k->align_c, k->align_bias);
        dfl_cuda_props p;
        if ((rc = dfl_cuda_device_props(im->device, &p, e)))
            return rc;
        snprintf(a->scope, sizeof a->scope, "%.96s sm_%d%d cuBLASLt %zu", p.name, p.cc_major, p.cc_minor,
                 (size_t)cublasLtGetVersion());
    }
    if (!pl->use_lt)
        return dfl_fail(e, DFL_EUNSUP, "%s: matmul %lldx%lldx%lld goes through cublasGemmEx: no algorithm to "
                        "store", be->name, (long long)m->M, (long long)m->N, (long long)m->K);
    if (!set) {
        memcpy(a->bytes, &pl->algo, sizeof pl->algo);
        return 0;
    }
    cublasLtMatmulAlgo_t algo;
    memcpy(&algo, a->bytes, sizeof algo);
    cublasLtMatmulHeuristicResult_t r;
    memset(&r, 0, sizeof r);
    const cublasStatus_t cs = cublasLtMatmulAlgoCheck(im->lt, pl->desc, pl->la, pl->lb, pl->lc, pl->lc, &algo, &r);
    if (cs != CUBLAS_STATUS_SUCCESS || r.workspaceSize > im->ws_bytes)
        return dfl_fail(e, DFL_EDATA, "%s: cuBLASLt refuses the stored algorithm for matmul %lldx%lldx%lld (%s)",
                        be->name, (long long)m->M, (long long)m->N, (long long)m->K,
                        cs != CUBLAS_STATUS_SUCCESS ? cublasLtGetStatusString(cs) : "it needs more workspace");
    pl->algo = algo;
    return 0;
}

extern "C" int dfl_cuda_attn_set_variant(dfl_be *be, int d, int v, dfl_err *e)
{
    int di = cuda_attn_dim_index(d);
    if (di < 0)
        return dfl_fail(e, DFL_EUSAGE, "attention head dimension %d has no tiled kernel (64, 128, "
                        "256)", d);
    if (v < 0 || v >= cuda_attn_n_variants(d))
        return dfl_fail(e, DFL_EUSAGE, "attention variant %d out of range for head dimension %d "
                        "(0..%d)", v, d, cuda_attn_n_variants(d) - 1);
    cuda_of(be)->attn_variant[di] = v;
    return 0;
}

extern "C" int dfl_cuda_attn_get_variant(dfl_be *be, int d)
{
    int di = cuda_attn_dim_index(d);
    return di < 0 ? -1 : cuda_of(be)->attn_variant[di];
}

/* ---- cuBLAS loaded at run time (cublas_dl.cuh) ---------------------------------------------- */

dfl_cublas_api dfl_cublas;
static pthread_once_t cublas_once = PTHREAD_ONCE_INIT;
static char cublas_err[480];
static bool cublas_ok;

static void *cublas_open(const char *base)
{
    char name[256];
    snprintf(name, sizeof name, "%s.so.%d", base, CUBLAS_VER_MAJOR);
    void *h = dlopen(name, RTLD_NOW | RTLD_LOCAL);
#ifdef DFL_CUDA_LIBDIR
    if (!h) {   /* not on the library path: where the build found the toolkit */
        snprintf(name, sizeof name, "%s/%s.so.%d", DFL_CUDA_LIBDIR, base, CUBLAS_VER_MAJOR);
        h = dlopen(name, RTLD_NOW | RTLD_LOCAL);
    }
#endif
    if (!h)
        snprintf(cublas_err, sizeof cublas_err, "cannot load %s.so.%d (cuBLAS %d, part of the CUDA "
                 "toolkit; is it on LD_LIBRARY_PATH?): %s", base, CUBLAS_VER_MAJOR, CUBLAS_VER_MAJOR,
                 dlerror());
    return h;
}

static void cublas_load_once(void)
{
    void *lt = cublas_open("libcublasLt");
    void *bl = lt ? cublas_open("libcublas") : NULL;
    if (!bl)
        return;
    bool ok = true;
#define DFL_SYM(h, field, sym)                                                                      \
    if (ok && !(*(void **)&dfl_cublas.field = dlsym(h, sym))) {                                    \
        snprintf(cublas_err, sizeof cublas_err, "cuBLAS has no symbol %s: %s", sym, dlerror());   \
        ok = false;                                                                                 \
    }
    DFL_SYM(lt, LtCreate, "cublasLtCreate")
    DFL_SYM(lt, LtDestroy, "cublasLtDestroy")
    DFL_SYM(lt, LtGetStatusString, "cublasLtGetStatusString")
    DFL_SYM(lt, LtMatmul, "cublasLtMatmul")
    DFL_SYM(lt, LtMatmulDescCreate, "cublasLtMatmulDescCreate")
    DFL_SYM(lt, LtMatmulDescDestroy, "cublasLtMatmulDescDestroy")
    DFL_SYM(lt, LtMatmulDescSetAttribute, "cublasLtMatmulDescSetAttribute")
    DFL_SYM(lt, LtMatrixLayoutCreate, "cublasLtMatrixLayoutCreate")
    DFL_SYM(lt, LtMatrixLayoutDestroy, "cublasLtMatrixLayoutDestroy")
    DFL_SYM(lt, LtMatmulPreferenceCreate, "cublasLtMatmulPreferenceCreate")
    DFL_SYM(lt, LtMatmulPreferenceDestroy, "cublasLtMatmulPreferenceDestroy")
    DFL_SYM(lt, LtMatmulPreferenceSetAttribute, "cublasLtMatmulPreferenceSetAttribute")
    DFL_SYM(lt, LtMatmulAlgoGetHeuristic, "cublasLtMatmulAlgoGetHeuristic")
    DFL_SYM(lt, LtMatmulAlgoConfigGetAttribute, "cublasLtMatmulAlgoConfigGetAttribute")
    DFL_SYM(lt, LtMatmulAlgoCheck, "cublasLtMatmulAlgoCheck")
    DFL_SYM(lt, LtGetVersion, "cublasLtGetVersion")
    DFL_SYM(bl, Create, "cublasCreate_v2")
    DFL_SYM(bl, Destroy, "cublasDestroy_v2")
    DFL_SYM(bl, SetStream, "cublasSetStream_v2")
    DFL_SYM(bl, SetWorkspace, "cublasSetWorkspace_v2")
    DFL_SYM(bl, GetStatusString, "cublasGetStatusString")
    DFL_SYM(bl, GemmEx, "cublasGemmEx")
#undef DFL_SYM
    cublas_ok = ok;
}

int dfl_cublas_load(char *msg, size_t n)
{
    pthread_once(&cublas_once, cublas_load_once);
    if (cublas_ok)
        return 0;
    snprintf(msg, n, "%s", cublas_err);
    return -1;
}
