/* be_cpu.c: the CPU backend's memory ops, conversions and matmul (OpenBLAS sgemm), and its op
 * table. Activations and compute weights are f32; other float inputs are converted on the fly. */
#include "be_cpu.h"

#include <cblas.h>
#include <omp.h>
#include <pthread.h>
#include <stdlib.h>
#include <string.h>

#include "util.h"

static void *cpu_alloc(dfl_be *be, size_t bytes, dfl_err *e)
{
    void *p = NULL;
    size_t n = DFL_ALIGN_UP(bytes ? bytes : 1, 64);
    if (posix_memalign(&p, 64, n) != 0 || !p) {
        char b[32];
        dfl_fail(e, DFL_ENOMEM, "cpu: cannot allocate %s", dfl_fmt_bytes((double)bytes, b, sizeof b));
        return NULL;
    }
    return p;
}

static void cpu_free(dfl_be *be, void *p) { free(p); }
static int cpu_upload(dfl_be *be, void *dst, const void *src, size_t n) { memcpy(dst, src, n); return 0; }
static int cpu_download(dfl_be *be, void *dst, const void *src, size_t n) { memcpy(dst, src, n); return 0; }
static int cpu_memset0(dfl_be *be, void *dst, size_t n) { memset(dst, 0, n); return 0; }
static int cpu_copy(dfl_be *be, void *dst, const void *src, size_t n) { memmove(dst, src, n); return 0; }
static int cpu_sync(dfl_be *be, dfl_err *e) { return 0; }

static int cpu_convert(dfl_be *be, void *y, dfl_dtype dt, const void *x, dfl_dtype st, int64_t n)
{
    if (n <= 0)
        return 0;
    const int64_t chunk = 1 << 16;
    int64_t nchunks = (n + chunk - 1) / chunk;
    int bad = 0;
    size_t ds = dfl_dtype_size(dt), ss = dfl_dtype_size(st);
#pragma omp parallel for schedule(static) reduction(| : bad) if (PAR(n))
    for (int64_t c = 0; c < nchunks; c++) {
        int64_t i0 = c * chunk, m = n - i0 < chunk ? n - i0 : chunk;
        if (!dfl_convert((char *)y + i0 * ds, dt, (const char *)x + i0 * ss, st, (size_t)m))
            bad = 1;
    }
    return bad ? DFL_EUNSUP : 0;
}

/* f32 view of a matrix operand: the buffer itself, or a converted temporary. */
static const float *as_f32(const void *p, dfl_dtype t, size_t n, float **tmp)
{
    *tmp = NULL;
    if (t == DFL_F32)
        return p;
    float *b = malloc(n * sizeof *b);
    if (!b)
        return NULL;
    if (!dfl_convert(b, DFL_F32, p, t, n)) {
        free(b);
        return NULL;
    }
    *tmp = b;
    return b;
}

static int cpu_matmul(dfl_be *be, const dfl_mm *m)
{
    if (m->M <= 0 || m->N <= 0)
        return 0;
    /* element counts spanned by each operand */
    size_t na = (size_t)((m->ta ? m->K : m->M) - 1) * (size_t)m->lda + (size_t)(m->ta ? m->M : m->K);
    size_t nb = (size_t)((m->tb ? m->N : m->K) - 1) * (size_t)m->ldb + (size_t)(m->tb ? m->K : m->N);
    float *ta = NULL, *tb = NULL, *tc = NULL;
    const float *A = m->K > 0 ? as_f32(m->A, m->adt, na, &ta) : NULL;
    const float *B = m->K > 0 ? as_f32(m->B, m->bdt, nb, &tb) : NULL;
    if (m->K > 0 && (!A || !B)) {
        free(ta);
        free(tb);
        return DFL_ENOMEM;
    }
    float *C = m->C;
    size_t nc = (size_t)(m->M - 1) * (size_t)m->ldc + (size_t)m->N;
    const void *cin = dfl_mm_cin(m);
    if (m->cdt != DFL_F32) {
        tc = malloc(nc * sizeof *tc);
        if (!tc) {
            free(ta);
            free(tb);
            return DFL_ENOMEM;
        }
        if (m->beta != 0.0f)
            dfl_convert(tc, DFL_F32, cin, m->cdt, nc);
        C = tc;
    } else if (cin != m->C) {
        for (int64_t i = 0; i < m->M; i++)
            memcpy(C + i * m->ldc, (const float *)cin + i * m->ldc, (size_t)m->N * sizeof *C);
    }
    if (m->K > 0) {
        cblas_sgemm(CblasRowMajor, m->ta ? CblasTrans : CblasNoTrans, m->tb ? CblasTrans : CblasNoTrans,
                    (blasint)m->M, (blasint)m->N, (blasint)m->K, m->alpha, A, (blasint)m->lda, B,
                    (blasint)m->ldb, m->beta, C, (blasint)m->ldc);
    } else if (m->beta != 1.0f) {
        for (int64_t i = 0; i < m->M; i++)
            for (int64_t j = 0; j < m->N; j++)
                C[i * m->ldc + j] = m->beta == 0.0f ? 0.0f : m->beta * C[i * m->ldc + j];
    }
    if (m->bias)
#pragma omp parallel for schedule(static) if (PAR(m->M * m->N))
        for (int64_t i = 0; i < m->M; i++)
            for (int64_t j = 0; j < m->N; j++)
                C[i * m->ldc + j] += m->bias[j];
    if (tc) {
        for (int64_t i = 0; i < m->M; i++)
            dfl_convert((char *)m->C + (size_t)i * m->ldc * dfl_dtype_size(m->cdt), m->cdt,
                        tc + (size_t)i * m->ldc, DFL_F32, (size_t)m->N);
        free(tc);
    }
    free(ta);
    free(tb);
    return 0;
}

static const dfl_be_ops cpu_ops = {
    .alloc = cpu_alloc,
    .free = cpu_free,
    .upload = cpu_upload,
    .download = cpu_download,
    .memset0 = cpu_memset0,
    .copy = cpu_copy,
    .sync = cpu_sync,
    .convert = cpu_convert,
    .matmul = cpu_matmul,
    .embedding = dfl_cpu_embedding,
    .rmsnorm = dfl_cpu_rmsnorm,
    .add_rmsnorm = dfl_cpu_add_rmsnorm,
    .rmsnorm_bwd = dfl_cpu_rmsnorm_bwd,
    .qknorm_rope = dfl_cpu_qknorm_rope,
    .qknorm_rope_bwd = dfl_cpu_qknorm_rope_bwd,
    .swiglu = dfl_cpu_swiglu,
    .swiglu_bwd = dfl_cpu_swiglu_bwd,
    .add = dfl_cpu_add,
    .attn_varlen = dfl_cpu_attn_varlen,
    .rmsnorm_1p = dfl_cpu_rmsnorm_1p,
    .qknorm_rope_partial = dfl_cpu_qknorm_rope_partial,
    .sigmoid_mul = dfl_cpu_sigmoid_mul,
    .conv1d_silu = dfl_cpu_conv1d_silu,
    .l2norm = dfl_cpu_l2norm,
    .gated_rmsnorm = dfl_cpu_gated_rmsnorm,
    .gated_delta = dfl_cpu_gated_delta,
    .dflash_attn = dfl_cpu_dflash_attn,
    .dflash_attn_bwd = dfl_cpu_dflash_attn_bwd,
    .lmce = dfl_cpu_lmce,
    .sumsq = dfl_cpu_sumsq,
    .clip_scale = dfl_cpu_clip_scale,
    .block_metrics = dfl_cpu_block_metrics,
    .adamw = dfl_cpu_adamw,
    .uniform_noise = dfl_cpu_uniform_noise,
    .gather_rows = dfl_cpu_gather_rows,
    .segment_sum = dfl_cpu_segment_sum,
    .moe_route = dfl_cpu_moe_route,
    .moe_gather = dfl_cpu_moe_gather,
    .moe_matmul = dfl_cpu_moe_matmul,
    .moe_combine = dfl_cpu_moe_combine,
};

/* The op table: the ops above and the device plumbing of be_cpu_device.c. */
static dfl_be_ops cpu_table;
static pthread_once_t cpu_table_once = PTHREAD_ONCE_INIT;
static void cpu_table_fill(void)
{
    cpu_table = cpu_ops;
    dfl_cpu_device_ops(&cpu_table);
}

int dfl_be_cpu_open(dfl_be **out, int threads, dfl_err *e)
{
    pthread_once(&cpu_table_once, cpu_table_fill);
    dfl_be *be = calloc(1, sizeof *be);
    if (!be)
        return dfl_fail(e, DFL_ENOMEM, "out of memory");
    be->kind = DFL_BE_CPU;
    strcpy(be->name, "cpu");
    be->act = DFL_F32;
    be->wdt = DFL_F32;
    be->threads = threads > 0 ? threads : omp_get_max_threads();
    be->async = false;
    be->device_comm = false;
    be->fuse_residual = false;
    be->lmce_rows = 64;
    be->ops = &cpu_table;
    *out = be;
    return DFL_OK;
}

void dfl_be_cpu_destroy(dfl_be *be) { free(be); }
