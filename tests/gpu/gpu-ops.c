/* gpu-ops.c: every CUDA op against the CPU reference op (lib/be_cpu*.c) on random inputs, in
 * bf16 mode (be->act = bf16) and in f32 mode, plus the backend's memory rules (allocation
 * freeze, guard bands, error reporting) and the kernels/cuda.h API. Without a GPU (or in a build
 * without CUDA) every case is skipped ("skip: no CUDA GPU") and the program exits 77.
 *
 * Inputs are drawn in f32 and, in bf16 mode, rounded to bf16 first, so that both backends see
 * the same values; the CPU computes in f32. Outputs are compared per row: relative error
 * ||gpu - cpu|| / ||cpu|| and cosine similarity, and any non-finite GPU value where the CPU has
 * a finite one fails. Tolerances:
 *   bf16, elementwise/row ops:   rel <= 8e-3,  cos >= 0.99995  (one bf16 rounding is <= 2^-9)
 *   bf16, matmul to bf16:        rel <= 1e-2,  cos >= 0.9999
 *   bf16 inputs, matmul to f32:  rel <= 1e-4,  cos >= 0.9999999
 *   bf16, attention:             rel <= 1e-2,  cos >= 0.9999   (P is rounded to bf16)
 *   f32, everything:             rel <= 2e-5,  cos >= 0.9999999 (qknorm_rope, attention,
 *                                matmul: accumulation order and sin/cos ulps)
 *   embedding, convert, rstd:    exact bytes (convert, embedding), rel 1e-5 (rstd)
 * Every device buffer has guard bands of sentinel bytes before and after (and strided outputs
 * have sentinel gaps between rows) that must come back untouched; outputs start as NaN bytes
 * so that an element the kernel fails to write shows up. Each comparison prints a "#" line with
 * its figures; failures print the worst rows and elements. */
#include <math.h>
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "backend.h"
#include "dtype.h"
#include "err.h"
#include "../unit/t.h"

#ifdef DFL_CUDA
#include "../../kernels/cuda.h"
#include "gpu-test.h"

/* ------------------------------------------------------------------------------------------ */
/* comparisons */

static bool cmp_rows(const char *what, const float *got, int64_t ldg, const float *ref, int64_t ldr,
                     int64_t R, int64_t n, double rel_tol, double cos_min)
{
    return gpu_cmp_rows(what, got, ldg, ref, ldr, R, n, rel_tol, cos_min, NULL, NULL, false);
}

/* got and ref (f32 views) must agree exactly, NaN matching NaN. */
static bool cmp_exact(const char *what, const float *got, const float *ref, size_t n)
{
    size_t bad = 0, first = 0;
    for (size_t i = 0; i < n; i++) {
        bool same = (isnan(got[i]) && isnan(ref[i])) ||
                    memcmp(&got[i], &ref[i], sizeof(float)) == 0;
        if (!same) {
            if (!bad)
                first = i;
            bad++;
        }
    }
    printf("#   %-58s n %-8zu %s\n", what, n, bad ? "MISMATCH" : "exact");
    T_CHECK(bad == 0, "%s: %zu of %zu values differ; first at [%zu]: gpu %.9g cpu %.9g", what, bad,
            n, first, (double)got[first], (double)ref[first]);
    return bad == 0;
}

struct mode {
    dfl_be *be;
    dfl_dtype dt;
    const char *name;
    bool bf16;
};

static int modes(struct mode m[2])
{
    m[0] = (struct mode){g_bf, DFL_BF16, "bf16", true};
    m[1] = (struct mode){g_f32, DFL_F32, "f32", false};
    return 2;
}

#define NEED_GPU()                                                                           \
    do {                                                                                     \
        if (!g_bf)                                                                           \
            T_SKIP("no CUDA GPU");                                                           \
    } while (0)

/* ------------------------------------------------------------------------------------------ */
/* memory, errors, API */

static void test_memory(void)
{
    NEED_GPU();
    dfl_be *be = g_bf;
    dfl_err e = {0};
    dfl_cuda_mem m0, m1;
    dfl_cuda_mem_stats(be, &m0);
    void *p = be_alloc(be, 1000, &e);
    T_CHECK(p != NULL, "alloc: %s", e.msg);
    dfl_cuda_mem_stats(be, &m1);
    T_CHECK(m1.allocated >= m0.allocated + 1000 && m1.n_allocs == m0.n_allocs + 1,
            "allocated %zu -> %zu, n %zu -> %zu", m0.allocated, m1.allocated, m0.n_allocs, m1.n_allocs);

    /* round trip through upload, copy, memset0, download */
    uint8_t h[1000], back[1000];
    for (int i = 0; i < 1000; i++)
        h[i] = (uint8_t)(i * 7 + 1);
    void *q = be_alloc(be, 1000, &e);
    T_CHECK(q != NULL, "alloc: %s", e.msg);
    if (p && q) {
        T_CHECK(be->ops->upload(be, p, h, 1000) == 0, "upload");
        T_CHECK(be->ops->copy(be, q, p, 1000) == 0, "copy");
        T_CHECK(be->ops->memset0(be, p, 500) == 0, "memset0");
        T_CHECK(be->ops->download(be, back, q, 1000) == 0, "download");
        cmp_bytes("copy", back, h, 1000);
        T_CHECK(be->ops->download(be, back, p, 1000) == 0, "download");
        uint8_t z[500];
        memset(z, 0, sizeof z);
        cmp_bytes("memset0", back, z, 500);
        cmp_bytes("memset0 (rest)", back + 500, h + 500, 500);
        /* overlapping copies are refused (and reported at the next sync) */
        T_CHECK(be->ops->copy(be, (uint8_t *)p + 10, p, 100) != 0, "overlapping copy accepted");
        int rc = be->ops->sync(be, &e);
        T_CHECK(rc != 0 && strstr(e.msg, "overlapping"), "sync after overlapping copy: rc %d '%s'", rc, e.msg);
        sync_ok(be, "sync after the reported error");
    }

    /* freeze: any allocation fails with a message; unfreeze allows it again */
    dfl_cuda_freeze(be, true);
    T_CHECK(dfl_cuda_frozen(be), "frozen");
    dfl_err_clear(&e);
    void *x = be_alloc(be, 64, &e);
    T_CHECK(x == NULL && e.code == DFL_ENOMEM && strstr(e.msg, "frozen"),
            "alloc while frozen: %p, code %d, '%s'", x, e.code, e.msg);
    if (x)
        be->ops->free(be, x);
    dfl_cuda_freeze(be, false);
    x = be_alloc(be, 64, &e);
    T_CHECK(x != NULL, "alloc after unfreeze: %s", e.msg);
    be->ops->free(be, x);
    be->ops->free(be, p);
    be->ops->free(be, q);
    dfl_cuda_mem_stats(be, &m1);
    T_CHECK(m1.allocated == m0.allocated && m1.n_allocs == m0.n_allocs, "after free: %zu vs %zu bytes",
            m1.allocated, m0.allocated);
    printf("#   backend's own device memory: %zu bytes; peak through be_alloc: %zu\n",
           m1.backend_bytes, m1.peak);

    /* a matmul with unsupported types fails, and sync reports why */
    dfl_mm mm = {.M = 2, .N = 2, .K = 2, .A = (void *)1, .adt = DFL_BF16, .lda = 2,
                 .B = (void *)1, .bdt = DFL_F32, .ldb = 2, .C = (void *)1, .cdt = DFL_BF16,
                 .ldc = 2, .alpha = 1};
    T_CHECK(be->ops->matmul(be, &mm) == DFL_EUNSUP, "mixed-type matmul accepted");
    int rc = be->ops->sync(be, &e);
    T_CHECK(rc == DFL_EUNSUP && strstr(e.msg, "matmul"), "sync: rc %d '%s'", rc, e.msg);
    sync_ok(be, "sync after reported error");

    /* the drafter ops are all there (tested in gpu-train-ops) */
    T_CHECK(be->ops->rmsnorm_bwd && be->ops->qknorm_rope_bwd && be->ops->swiglu_bwd &&
            be->ops->dflash_attn && be->ops->dflash_attn_bwd && be->ops->lmce && be->ops->sumsq &&
            be->ops->clip_scale && be->ops->block_metrics && be->ops->adamw && be->ops->uniform_noise,
            "drafter op missing");
}

static void test_open(void)
{
    NEED_GPU();
    dfl_err e = {0};
    dfl_be *be = NULL;
    int rc = dfl_be_open(&be, "cuda", DFL_DT_INVALID, &e);
    T_CHECK(rc == 0 && be && be->act == DFL_BF16 && be->wdt == DFL_BF16 && strcmp(be->name, "cuda:0") == 0,
            "open cuda: rc %d %s", rc, e.msg);
    dfl_be_close(be);
    be = NULL;
    rc = dfl_be_open(&be, "cuda:1000", DFL_DT_INVALID, &e);
    T_CHECK(rc == DFL_EDEVICE && !be && strstr(e.msg, "found"), "cuda:1000: rc %d '%s'", rc, e.msg);
    rc = dfl_be_open(&be, "cuda", DFL_F16, &e);
    T_CHECK(rc == DFL_EUSAGE && !be, "cuda f16: rc %d '%s'", rc, e.msg);
    T_CHECK(dfl_be_cuda_available(), "dfl_be_cuda_available");
    dfl_cuda_props pr;
    rc = dfl_cuda_device_props(0, &pr, &e);
    T_CHECK(rc == 0 && pr.sm_count > 0 && pr.mem_total > 0 && pr.mem_free > 0 && pr.mem_free <= pr.mem_total,
            "props: %s", e.msg);
    printf("#   device 0: %s, cc %d.%d, %d SMs, %.1f GB (%.1f GB free), %zu KB smem/block, %zu MB L2\n",
           pr.name, pr.cc_major, pr.cc_minor, pr.sm_count, pr.mem_total / 1e9, pr.mem_free / 1e9,
           pr.smem_per_block_optin / 1024, pr.l2_bytes >> 20);
}

static void test_api(void)
{
    NEED_GPU();
    dfl_be *be = g_bf;
    dfl_err e = {0};
    size_t n = (size_t)16 << 20;
    uint8_t *pinned = dfl_cuda_host_alloc(be, n, &e);
    T_CHECK(pinned != NULL, "host_alloc: %s", e.msg);
    void *dev = be_alloc(be, n, &e);
    T_CHECK(dev != NULL, "alloc: %s", e.msg);
    if (!pinned || !dev)
        return;
    for (size_t i = 0; i < n; i++)
        pinned[i] = (uint8_t)(i * 13 + 5);
    dfl_cuda_stream cs = dfl_cuda_compute_stream(be), xs = dfl_cuda_copy_stream(be);
    T_CHECK(cs && xs && cs != xs, "streams");
    dfl_cuda_event ev = NULL, t0 = NULL, t1 = NULL;
    T_CHECK(dfl_cuda_event_create(be, &ev, false, &e) == 0, "event: %s", e.msg);
    T_CHECK(dfl_cuda_event_create(be, &t0, true, &e) == 0, "event: %s", e.msg);
    T_CHECK(dfl_cuda_event_create(be, &t1, true, &e) == 0, "event: %s", e.msg);
    /* upload on the compute stream, then copy back on the copy stream after an event */
    T_CHECK(dfl_cuda_event_record(be, t0, cs, &e) == 0, "record: %s", e.msg);
    T_CHECK(dfl_cuda_upload_async(be, dev, pinned, n, cs, &e) == 0, "upload_async: %s", e.msg);
    T_CHECK(be->ops->memset0(be, dev, 4096) == 0, "memset0");  /* same stream: ordered */
    T_CHECK(dfl_cuda_event_record(be, ev, cs, &e) == 0, "record: %s", e.msg);
    T_CHECK(dfl_cuda_event_record(be, t1, cs, &e) == 0, "record: %s", e.msg);
    uint8_t *back = dfl_cuda_host_alloc(be, n, &e);
    T_CHECK(back != NULL, "host_alloc: %s", e.msg);
    if (back) {
        memset(back, 0xEE, n);
        T_CHECK(dfl_cuda_stream_wait_event(be, xs, ev, &e) == 0, "wait_event: %s", e.msg);
        T_CHECK(dfl_cuda_download_async(be, back, dev, n, xs, &e) == 0, "download_async: %s", e.msg);
        T_CHECK(dfl_cuda_event_record(be, ev, xs, &e) == 0, "record: %s", e.msg);
        T_CHECK(dfl_cuda_event_sync(be, ev, &e) == 0, "event_sync: %s", e.msg);
        bool done = false;
        T_CHECK(dfl_cuda_event_query(be, ev, &done, &e) == 0 && done, "query: %s", e.msg);
        size_t bad = 0;
        for (size_t i = 0; i < n; i++)
            if (back[i] != (i < 4096 ? 0 : pinned[i]))
                bad++;
        T_CHECK(bad == 0, "%zu bytes differ after upload/memset/download across streams", bad);
        float ms = -1;
        T_CHECK(dfl_cuda_event_elapsed(be, t0, t1, &ms, &e) == 0 && ms >= 0, "elapsed: %s", e.msg);
        printf("#   16 MiB pinned upload + memset: %.3f ms (%.1f GB/s)\n", ms, ms > 0 ? n / ms / 1e6 : 0);
        T_CHECK(dfl_cuda_stream_sync(be, xs, &e) == 0, "stream_sync: %s", e.msg);
    }
    dfl_cuda_host_free(be, back);
    dfl_cuda_host_free(be, pinned);
    dfl_cuda_event_destroy(be, ev);
    dfl_cuda_event_destroy(be, t0);
    dfl_cuda_event_destroy(be, t1);

    /* page-locking an existing (page-aligned) allocation */
    void *reg = NULL;
    if (posix_memalign(&reg, 4096, 1 << 20) == 0) {
        memset(reg, 1, 1 << 20);
        T_CHECK(dfl_cuda_host_register(be, reg, 1 << 20, false, &e) == 0, "host_register: %s", e.msg);
        T_CHECK(dfl_cuda_download_async(be, reg, dev, 1 << 20, cs, &e) == 0, "download: %s", e.msg);
        T_CHECK(dfl_cuda_stream_sync(be, cs, &e) == 0, "sync: %s", e.msg);
        T_CHECK(((uint8_t *)reg)[0] == 0 && ((uint8_t *)reg)[5000] == (uint8_t)(5000 * 13 + 5),
                "registered download");
        T_CHECK(dfl_cuda_host_unregister(be, reg, &e) == 0, "host_unregister: %s", e.msg);
        free(reg);
    }
    be->ops->free(be, dev);
}

/* ------------------------------------------------------------------------------------------ */
/* convert */

static void test_convert(void)
{
    NEED_GPU();
    dfl_be *be = g_bf;
    const size_t n = 12345;
    float *src = rnd(n, 3, 0, false);
    /* special values first: signed zeros, infinities, NaN, f32 subnormals, values that overflow
     * bf16 / f16, and exact halfway cases of bf16 rounding (ties to even) */
    const float sp[] = {0.0f, -0.0f, INFINITY, -INFINITY, NAN, 1e-40f, -1e-42f, 3.3961e38f,
                        65504.0f, 65520.0f, 1.0f + 1.0f / 256, 1.0f + 3.0f / 256, -(1.0f + 1.0f / 256),
                        1e-8f, 6e-5f, -2.5e-6f};
    memcpy(src, sp, sizeof sp);
    double *src64 = xmalloc(n * sizeof *src64);
    for (size_t i = 0; i < n; i++)   /* f64 values between bf16 / f32 grid points */
        src64[i] = (double)rng_normal() * 100.0 * (1.0 + 1e-12 * (double)i);
    static const dfl_dtype pairs[][2] = {
        {DFL_F32, DFL_BF16}, {DFL_BF16, DFL_F32}, {DFL_F32, DFL_F16}, {DFL_F16, DFL_F32},
        {DFL_BF16, DFL_F16}, {DFL_F16, DFL_BF16}, {DFL_F64, DFL_BF16}, {DFL_F64, DFL_F32},
        {DFL_F32, DFL_F64}, {DFL_BF16, DFL_F64}, {DFL_F64, DFL_F16}, {DFL_BF16, DFL_BF16},
    };
    for (size_t k = 0; k < sizeof pairs / sizeof pairs[0]; k++) {
        dfl_dtype st = pairs[k][0], dt = pairs[k][1];
        size_t ss = dfl_dtype_size(st), ds = dfl_dtype_size(dt);
        void *hs = xmalloc(n * ss), *ref = xmalloc(n * ds), *got = xmalloc(n * ds);
        if (st == DFL_F64)
            memcpy(hs, src64, n * ss);
        else
            dfl_convert(hs, st, src, DFL_F32, n);
        T_CHECK(dfl_convert(ref, dt, hs, st, n), "host reference convert");
        gbuf bs, bd;
        if (gb_alloc(&bs, be, n, st) && gb_alloc(&bd, be, n, dt)) {
            gb_set_raw(&bs, hs);
            int rc = be->ops->convert(be, bd.p, dt, bs.p, st, (int64_t)n);
            T_CHECK(rc == 0, "convert %s -> %s: rc %d", dfl_dtype_lower(st), dfl_dtype_lower(dt), rc);
            sync_ok(be, "convert");
            gb_get_raw(&bd, got);
            size_t bad = 0, first = 0;
            for (size_t i = 0; i < n; i++) {
                double a = dfl_load_f64(got, dt, i), b = dfl_load_f64(ref, dt, i);
                bool same = (isnan(a) && isnan(b)) || (a == b && signbit(a) == signbit(b));
                if (!same && bad++ == 0)
                    first = i;
            }
            char what[64];
            snprintf(what, sizeof what, "convert %s -> %s", dfl_dtype_lower(st), dfl_dtype_lower(dt));
            printf("#   %-58s n %-8zu %s\n", what, n, bad ? "MISMATCH" : "exact");
            T_CHECK(bad == 0, "%s: %zu values differ; first [%zu]: src %.17g gpu %.17g cpu %.17g", what,
                    bad, first, dfl_load_f64(hs, st, first), dfl_load_f64(got, dt, first),
                    dfl_load_f64(ref, dt, first));
            gb_check_guards(&bd, what);
        }
        gb_free(&bs);
        gb_free(&bd);
        free(hs);
        free(ref);
        free(got);
    }
    T_CHECK(be->ops->convert(be, NULL, DFL_I32, NULL, DFL_F32, 10) == DFL_EUNSUP, "f32 -> i32 accepted");
    dfl_err e;
    be->ops->sync(be, &e);
    free(src);
    free(src64);
}

/* ------------------------------------------------------------------------------------------ */
/* matmul */

struct mm_case {
    int M, N, K;
    bool ta, tb;
    float alpha, beta;
    bool bias;
    int pad;        /* added to every leading dimension */
    bool f32out;    /* bf16 mode: C in f32 */
    bool cin;       /* the C added comes from its own buffer (dfl_mm.Cin); C starts as NaN */
};

static void run_mm_case(struct mode *md, const struct mm_case *c)
{
    dfl_be *be = md->be;
    dfl_dtype adt = md->dt, cdt = c->f32out ? DFL_F32 : md->dt;
    int64_t lda = (c->ta ? c->M : c->K) + c->pad, ldb = (c->tb ? c->K : c->N) + c->pad;
    int64_t ldc = c->N + c->pad;
    if (lda < 1)
        lda = 1;
    if (ldb < 1)
        ldb = 1;
    size_t na = (size_t)(c->ta ? c->K : c->M) * lda, nb = (size_t)(c->tb ? c->N : c->K) * ldb;
    size_t nc = (size_t)c->M * ldc;
    float *A = rnd(na, 1, 0, md->bf16), *B = rnd(nb, 1, 0, md->bf16);
    float *C0 = rnd(nc, 1, 0, cdt == DFL_BF16);
    float *bias = c->bias ? rnd(c->N, 1, 0, false) : NULL;
    float *Cref = xmalloc(nc * sizeof *Cref), *Cgot = xmalloc(nc * sizeof *Cgot);
    if (c->beta == 0)
        memset(C0, 0, nc * sizeof *C0);
    memcpy(Cref, C0, nc * sizeof *Cref);
    dfl_mm m = {.M = c->M, .N = c->N, .K = c->K, .A = A, .adt = DFL_F32, .lda = lda, .ta = c->ta,
                .B = B, .bdt = DFL_F32, .ldb = ldb, .tb = c->tb, .C = Cref, .cdt = DFL_F32,
                .ldc = ldc, .alpha = c->alpha, .beta = c->beta, .bias = bias};
    T_CHECK(g_cpu->ops->matmul(g_cpu, &m) == 0, "cpu matmul");
    if (c->cin) {   /* the CPU's own Cin: the same bytes as in place, C's padding untouched */
        float *Cc = xmalloc(nc * sizeof *Cc);
        for (size_t i = 0; i < nc; i++)
            Cc[i] = NAN;
        dfl_mm mc = m;
        mc.C = Cc;
        mc.Cin = C0;
        T_CHECK(g_cpu->ops->matmul(g_cpu, &mc) == 0, "cpu matmul with Cin");
        int64_t bad = 0;
        for (int i = 0; i < c->M; i++)
            for (int j = 0; j < ldc; j++)
                bad += j < c->N ? memcmp(&Cc[(size_t)i * ldc + j], &Cref[(size_t)i * ldc + j], 4) != 0
                                : !isnan(Cc[(size_t)i * ldc + j]);
        T_CHECK(bad == 0, "cpu matmul with Cin: %lld elements differ from in place", (long long)bad);
        free(Cc);
    }

    char what[128];
    snprintf(what, sizeof what, "matmul %s%s %dx%dx%d ta%d tb%d a%.2g b%.2g%s pad%d%s", md->name,
             c->f32out ? "->f32" : "", c->M, c->N, c->K, c->ta, c->tb, c->alpha, c->beta,
             c->bias ? " bias" : "", c->pad, c->cin ? " Cin" : "");
    gbuf ga, gb, gc, gbias = {0}, gcin = {0};
    bool ok = gb_alloc(&ga, be, na, adt) && gb_alloc(&gb, be, nb, adt) && gb_alloc(&gc, be, nc, cdt);
    if (ok && c->bias)
        ok = gb_alloc(&gbias, be, (size_t)c->N, DFL_F32);
    if (ok && c->cin)
        ok = gb_alloc(&gcin, be, nc, cdt);
    if (ok) {
        gb_set(&ga, A);
        gb_set(&gb, B);
        if (c->cin)
            gb_set(&gcin, C0);  /* C stays NaN: only Cin is read */
        else if (c->beta != 0)
            gb_set(&gc, C0);    /* else C stays NaN: beta = 0 must not read it */
        if (c->bias)
            gb_set(&gbias, bias);
        uint8_t *before = xmalloc(gc.bytes), *after = xmalloc(gc.bytes);
        gb_get_raw(&gc, before);
        dfl_mm g = m;
        g.A = ga.p;
        g.adt = adt;
        g.B = gb.p;
        g.bdt = adt;
        g.C = gc.p;
        g.cdt = cdt;
        g.bias = c->bias ? (const float *)gbias.p : NULL;
        g.Cin = c->cin ? gcin.p : NULL;
        int rc = be->ops->matmul(be, &g);
        T_CHECK(rc == 0, "%s: rc %d", what, rc);
        sync_ok(be, what);
        gb_get(&gc, Cgot);
        double rel = md->bf16 ? (c->f32out ? 1e-4 : 1e-2) : 2e-5;
        double cmin = md->bf16 ? (c->f32out ? 0.9999999 : 0.9999) : 0.9999999;
        cmp_rows(what, Cgot, ldc, Cref, ldc, c->M, c->N, rel, cmin);
        /* the padding columns of C are untouched */
        gb_get_raw(&gc, after);
        size_t es = dfl_dtype_size(cdt);
        for (int i = 0; i < c->M && c->pad; i++)
            if (!cmp_bytes("matmul C padding", after + ((size_t)i * ldc + c->N) * es,
                           before + ((size_t)i * ldc + c->N) * es, (size_t)c->pad * es))
                break;
        gb_check_guards(&gc, what);
        if (c->cin)
            gb_check_guards(&gcin, what);
        gb_check_guards(&ga, what);
        gb_check_guards(&gb, what);
        free(before);
        free(after);
    }
    gb_free(&ga);
    gb_free(&gb);
    gb_free(&gc);
    gb_free(&gbias);
    gb_free(&gcin);
    free(A);
    free(B);
    free(C0);
    free(bias);
    free(Cref);
    free(Cgot);
}

static void test_matmul(void)
{
    NEED_GPU();
    static const struct mm_case cases[] = {
        {1, 1, 1, false, false, 1, 0, false, 0, false, false},
        {7, 13, 5, false, false, 1, 0, false, 0, false, false},
        {7, 13, 5, true, false, 1, 0, false, 0, false, false},
        {7, 13, 5, false, true, 1, 0, false, 0, false, false},
        {7, 13, 5, true, true, 1, 0, false, 0, false, false},
        {64, 64, 64, false, true, 1, 0, false, 0, false, false},
        {129, 257, 95, false, true, 0.5f, 1, true, 0, false, false},
        {300, 1000, 512, false, true, 1, 0, false, 0, false, false},
        {33, 65, 130, false, false, 1, 0.5f, false, 3, false, false},
        {33, 65, 130, true, true, 2, 1, true, 5, false, false},
        {17, 40, 0, false, true, 1, 0.5f, true, 0, false, false},      /* K = 0: C = beta C + bias */
        {128, 2048, 1024, false, true, 1, 0, false, 0, false, false},
        {100, 96, 64, false, true, 1, 1, true, 0, true, false},        /* bf16 -> f32, bias fused */
        {64, 48, 200, true, false, 1, 1, false, 0, true, false},       /* bf16 -> f32 accumulate */
        {5, 3, 1000, false, true, 1, 0, true, 1, true, false},
        /* C = A B^T + Cin, as the drafter's residual products: cuBLASLt with C and D apart */
        {300, 256, 128, false, true, 1, 1, false, 0, false, true},
        {33, 65, 130, false, true, 1, 0.5f, true, 3, false, true},
        {64, 48, 200, true, false, 1, 1, false, 2, true, true},
        {17, 40, 0, false, true, 1, 0.5f, false, 1, false, true},   /* K = 0: C = beta Cin */
    };
    struct mode md[2];
    int nm = modes(md);
    for (int k = 0; k < nm; k++)
        for (size_t i = 0; i < sizeof cases / sizeof cases[0]; i++) {
            if (cases[i].f32out && !md[k].bf16)
                continue;
            run_mm_case(&md[k], &cases[i]);
        }
}

/* The product the tuning tests choose algorithms for: 256 x 512 x 384, bf16, B transposed, on
 * random data (g: A, B, C); false when a buffer could not be had (a failed check already) */
static const struct mm_case tune_case = {256, 512, 384, false, true, 1, 0, false, 0, false, false};

static bool tune_setup(gbuf g[3], dfl_mm *m)
{
    dfl_be *be = g_bf;
    if (!gb_alloc(&g[0], be, 256 * 384, DFL_BF16) || !gb_alloc(&g[1], be, 512 * 384, DFL_BF16) ||
        !gb_alloc(&g[2], be, 256 * 512, DFL_BF16))
        return false;
    float *z = rnd(512 * 384, 1, 0, true);
    gb_set(&g[0], z);
    gb_set(&g[1], z);
    free(z);
    *m = (dfl_mm){.M = 256, .N = 512, .K = 384, .A = g[0].p, .adt = DFL_BF16, .lda = 384, .B = g[1].p,
                  .bdt = DFL_BF16, .ldb = 384, .tb = true, .C = g[2].p, .cdt = DFL_BF16, .ldc = 512,
                  .alpha = 1, .beta = 0};
    return true;
}

static void tune_free(gbuf g[3])
{
    for (int i = 0; i < 3; i++)
        gb_free(&g[i]);
}

static void test_matmul_tune(void)
{
    NEED_GPU();
    /* tuning picks an algorithm from cuBLASLt's heuristic list; results must stay right afterwards */
    struct mode md = {g_bf, DFL_BF16, "bf16", true};
    dfl_err e = {0};
    gbuf g[3];
    dfl_mm m;
    if (!tune_setup(g, &m))
        return;
    float best = 0, first = 0;
    int rc = dfl_cuda_matmul_tune(g_bf, &m, 8, 2, &best, &first, &e);
    T_CHECK(rc == 0 && best > 0 && first > 0 && best <= first, "tune: rc %d best %g first %g %s", rc, best,
            first, e.msg);
    printf("#   tune 256x512x384: heuristic %.4f ms, best %.4f ms\n", first, best);
    tune_free(g);
    run_mm_case(&md, &tune_case);   /* same shape through the tuned plan */
}

static void test_matmul_pick(void)
{
    NEED_GPU();
    /* every one of cuBLASLt's candidates gives the right product; an index out of range fails
     * with DFL_EUSAGE and leaves the choice as it was */
    dfl_be *be = g_bf;
    dfl_err e = {0};
    struct mode md = {g_bf, DFL_BF16, "bf16", true};
    gbuf g[3];
    dfl_mm m;
    if (!tune_setup(g, &m))
        return;
    int n = 0;
    char desc[160];
    int rc = dfl_cuda_matmul_pick(be, &m, 0, &n, desc, sizeof desc, &e);
    T_CHECK(rc == 0 && n >= 1 && n <= 32 && !strncmp(desc, "algo ", 5) && strstr(desc, " tile "),
            "pick 0: rc %d, %d candidates, '%s' %s", rc, n, desc, e.msg);
    printf("#   pick 256x512x384: %d candidates, the first %s\n", n, desc);
    for (int i = 0; i < n; i++) {
        rc = dfl_cuda_matmul_pick(be, &m, i, NULL, NULL, 0, &e);
        T_CHECK(rc == 0, "pick %d: rc %d %s", i, rc, e.msg);
        run_mm_case(&md, &tune_case);   /* the shape through candidate i */
    }
    memset(&e, 0, sizeof e);
    rc = dfl_cuda_matmul_pick(be, &m, n, NULL, NULL, 0, &e);
    T_CHECK(rc == DFL_EUSAGE && strstr(e.msg, "candidate"), "pick %d of %d: rc %d '%s'", n, n, rc, e.msg);
    memset(&e, 0, sizeof e);
    rc = dfl_cuda_matmul_pick(be, &m, -1, NULL, NULL, 0, &e);
    T_CHECK(rc == DFL_EUSAGE, "pick -1: rc %d", rc);
    run_mm_case(&md, &tune_case);   /* still the last good pick */
    T_CHECK(dfl_cuda_matmul_pick(be, &m, 0, NULL, NULL, 0, &e) == 0, "pick 0 again: %s", e.msg);
    tune_free(g);
}

/* matmul_algo: a plan's algorithm out (with its key and scope) and back in gives the right
 * product; bytes cuBLASLt does not accept are refused (DFL_EDATA) and leave the plan as it was. */
static void test_matmul_algo(void)
{
    NEED_GPU();
    dfl_be *be = g_bf;
    dfl_err e = {0};
    struct mode md = {g_bf, DFL_BF16, "bf16", true};
    gbuf g[3];
    dfl_mm m;
    if (!tune_setup(g, &m))
        return;
    dfl_mm_algo a, bad;
    memset(&a, 0, sizeof a);
    int rc = be->ops->matmul_algo(be, &m, &a, false, &e);
    T_CHECK(rc == 0 && strstr(a.key, "256x512x384") && strstr(a.scope, " sm_") && strstr(a.scope, "cuBLASLt "),
            "get: rc %d key '%s' scope '%s' %s", rc, a.key, a.scope, e.msg);
    printf("#   algo 256x512x384: key '%s', scope '%s'\n", a.key, a.scope);
    rc = be->ops->matmul_algo(be, &m, &a, true, &e);
    T_CHECK(rc == 0, "set back: rc %d %s", rc, e.msg);
    run_mm_case(&md, &tune_case);
    bad = a;
    memset(bad.bytes, 0xff, sizeof bad.bytes);
    memset(&e, 0, sizeof e);
    rc = be->ops->matmul_algo(be, &m, &bad, true, &e);
    T_CHECK(rc == DFL_EDATA && strstr(e.msg, "refuses"), "garbage bytes: rc %d '%s'", rc, e.msg);
    dfl_mm_algo now;
    memset(&now, 0, sizeof now);
    T_CHECK(be->ops->matmul_algo(be, &m, &now, false, &e) == 0 && !memcmp(now.bytes, a.bytes, sizeof a.bytes),
            "the plan kept its algorithm: %s", e.msg);
    run_mm_case(&md, &tune_case);
    tune_free(g);
}

/* ------------------------------------------------------------------------------------------ */
/* embedding */

static void test_embedding(void)
{
    NEED_GPU();
    static const int shapes[][2] = {{1, 64}, {37, 100}, {1000, 4096}, {5, 7}};
    const int V = 500;
    struct mode md[2];
    int nm = modes(md);
    for (int k = 0; k < nm; k++)
        for (size_t s = 0; s < sizeof shapes / sizeof shapes[0]; s++) {
            int T = shapes[s][0], H = shapes[s][1];
            dfl_be *be = md[k].be;
            float *E = rnd((size_t)V * H, 1, 0, md[k].bf16);
            int32_t *ids = xmalloc((size_t)T * sizeof *ids);
            for (int t = 0; t < T; t++)
                ids[t] = t == 0 ? V - 1 : rng_int(0, V - 1);
            float *ref = xmalloc((size_t)T * H * sizeof *ref), *got = xmalloc((size_t)T * H * sizeof *got);
            g_cpu->ops->embedding(g_cpu, ref, ids, E, T, H);
            gbuf ge, gi, go;
            if (gb_alloc(&ge, be, (size_t)V * H, md[k].dt) && gb_alloc(&gi, be, T, DFL_I32) &&
                gb_alloc(&go, be, (size_t)T * H, md[k].dt)) {
                gb_set(&ge, E);
                gb_set_raw(&gi, ids);
                char what[96];
                snprintf(what, sizeof what, "embedding %s T=%d H=%d", md[k].name, T, H);
                T_CHECK(be->ops->embedding(be, go.p, (const int32_t *)gi.p, ge.p, T, H) == 0, "%s", what);
                sync_ok(be, what);
                gb_get(&go, got);
                cmp_exact(what, got, ref, (size_t)T * H);
                gb_check_guards(&go, what);
            }
            gb_free(&ge);
            gb_free(&gi);
            gb_free(&go);
            free(E);
            free(ids);
            free(ref);
            free(got);
        }
}

/* ------------------------------------------------------------------------------------------ */
/* rmsnorm, add_rmsnorm */

static const int norm_shapes[][2] = {{1, 64}, {3, 100}, {1000, 4096}, {17, 5000}, {5, 7}, {64, 128}};

static void test_rmsnorm(void)
{
    NEED_GPU();
    struct mode md[2];
    int nm = modes(md);
    for (int k = 0; k < nm; k++)
        for (size_t s = 0; s < sizeof norm_shapes / sizeof norm_shapes[0]; s++)
            for (int inplace = 0; inplace < 2; inplace++) {
                int R = norm_shapes[s][0], n = norm_shapes[s][1];
                dfl_be *be = md[k].be;
                size_t N = (size_t)R * n;
                float *x = rnd(N, 1.5f, 0.3f, md[k].bf16), *w = rnd(n, 0.2f, 1.0f, md[k].bf16);
                float *ref = xmalloc(N * sizeof *ref), *got = xmalloc(N * sizeof *got);
                float *rref = xmalloc(R * sizeof *rref), *rgot = xmalloc(R * sizeof *rgot);
                g_cpu->ops->rmsnorm(g_cpu, ref, rref, x, w, R, n, 1e-6f);
                gbuf gx, gw, gy = {0}, gr;
                bool ok = gb_alloc(&gx, be, N, md[k].dt) && gb_alloc(&gw, be, n, md[k].dt) &&
                          gb_alloc(&gr, be, R, DFL_F32);
                if (ok && !inplace)
                    ok = gb_alloc(&gy, be, N, md[k].dt);
                if (ok) {
                    gb_set(&gx, x);
                    gb_set(&gw, w);
                    gbuf *out = inplace ? &gx : &gy;
                    char what[96];
                    snprintf(what, sizeof what, "rmsnorm %s R=%d n=%d%s", md[k].name, R, n,
                             inplace ? " in place" : "");
                    T_CHECK(be->ops->rmsnorm(be, out->p, (float *)gr.p, gx.p, gw.p, R, n, 1e-6f) == 0, "%s", what);
                    sync_ok(be, what);
                    gb_get(out, got);
                    gb_get(&gr, rgot);
                    cmp_rows(what, got, n, ref, n, R, n, md[k].bf16 ? 8e-3 : 2e-6,
                             md[k].bf16 ? 0.99995 : 0.9999999);
                    char w2[128];
                    snprintf(w2, sizeof w2, "%s: rstd", what);
                    cmp_rows(w2, rgot, R, rref, R, 1, R, 1e-5, 0.9999999);
                    gb_check_guards(out, what);
                    gb_check_guards(&gr, what);
                }
                gb_free(&gx);
                gb_free(&gw);
                gb_free(&gy);
                gb_free(&gr);
                free(x);
                free(w);
                free(ref);
                free(got);
                free(rref);
                free(rgot);
            }
}

static void test_add_rmsnorm(void)
{
    NEED_GPU();
    struct mode md[2];
    int nm = modes(md);
    for (int k = 0; k < nm; k++)
        for (size_t s = 0; s < sizeof norm_shapes / sizeof norm_shapes[0]; s++) {
            int R = norm_shapes[s][0], n = norm_shapes[s][1];
            dfl_be *be = md[k].be;
            size_t N = (size_t)R * n;
            float *h = rnd(N, 3.0f, 0, md[k].bf16), *d = rnd(N, 1.0f, 0, md[k].bf16);
            float *w = rnd(n, 0.2f, 1.0f, md[k].bf16);
            float *href = xmalloc(N * sizeof *href), *yref = xmalloc(N * sizeof *yref);
            float *hgot = xmalloc(N * sizeof *hgot), *ygot = xmalloc(N * sizeof *ygot);
            float *rref = xmalloc(R * sizeof *rref), *rgot = xmalloc(R * sizeof *rgot);
            memcpy(href, h, N * sizeof *h);
            g_cpu->ops->add_rmsnorm(g_cpu, href, d, yref, rref, w, R, n, 1e-6f);
            gbuf gh, gd, gw, gy, gr;
            if (gb_alloc(&gh, be, N, md[k].dt) && gb_alloc(&gd, be, N, md[k].dt) &&
                gb_alloc(&gw, be, n, md[k].dt) && gb_alloc(&gy, be, N, md[k].dt) &&
                gb_alloc(&gr, be, R, DFL_F32)) {
                gb_set(&gh, h);
                gb_set(&gd, d);
                gb_set(&gw, w);
                char what[96];
                snprintf(what, sizeof what, "add_rmsnorm %s R=%d n=%d", md[k].name, R, n);
                T_CHECK(be->ops->add_rmsnorm(be, gh.p, gd.p, gy.p, (float *)gr.p, gw.p, R, n, 1e-6f) == 0,
                        "%s", what);
                sync_ok(be, what);
                gb_get(&gh, hgot);
                gb_get(&gy, ygot);
                gb_get(&gr, rgot);
                char w2[128];
                snprintf(w2, sizeof w2, "%s: h", what);
                cmp_rows(w2, hgot, n, href, n, R, n, md[k].bf16 ? 8e-3 : 2e-6, md[k].bf16 ? 0.99995 : 0.9999999);
                snprintf(w2, sizeof w2, "%s: y", what);
                cmp_rows(w2, ygot, n, yref, n, R, n, md[k].bf16 ? 8e-3 : 2e-6, md[k].bf16 ? 0.99995 : 0.9999999);
                snprintf(w2, sizeof w2, "%s: rstd", what);
                /* bf16: the GPU norms the rounded h, the CPU the exact sum */
                cmp_rows(w2, rgot, R, rref, R, 1, R, md[k].bf16 ? 3e-3 : 1e-5, 0.99999);
                gb_check_guards(&gh, what);
                gb_check_guards(&gy, what);
                gb_check_guards(&gr, what);
            }
            gb_free(&gh);
            gb_free(&gd);
            gb_free(&gw);
            gb_free(&gy);
            gb_free(&gr);
            free(h);
            free(d);
            free(w);
            free(href);
            free(yref);
            free(hgot);
            free(ygot);
            free(rref);
            free(rgot);
        }
}

/* ------------------------------------------------------------------------------------------ */
/* qknorm_rope */

struct qk_case {
    int R, heads, d, ld, col0;   /* x = buffer + col0; rows of ld elements */
    bool w, rstd;
    int maxpos;
    float theta;
};

static void test_qknorm_rope(void)
{
    NEED_GPU();
    static const struct qk_case cases[] = {
        {37, 32, 128, 32 * 128 + 2 * 8 * 128, 0, true, true, 40000, 1e6f},        /* q of fused QKV */
        {37, 8, 128, 32 * 128 + 2 * 8 * 128, 32 * 128, true, true, 40000, 1e6f},  /* k of fused QKV */
        {5, 4, 64, 256, 0, false, false, 3000, 1e4f},                             /* RoPE only */
        {3, 2, 256, 520, 4, true, true, 100, 1e6f},
        {4, 3, 6, 20, 1, true, false, 10, 1e4f},                                  /* odd half, odd offset */
        {1, 1, 128, 128, 0, true, true, 0, 1e6f},
        {300, 16, 128, 2048, 0, true, false, 2047, 1e6f},
    };
    struct mode md[2];
    int nm = modes(md);
    for (int k = 0; k < nm; k++)
        for (size_t c = 0; c < sizeof cases / sizeof cases[0]; c++) {
            const struct qk_case *q = &cases[c];
            dfl_be *be = md[k].be;
            size_t N = (size_t)q->R * q->ld, nr = (size_t)q->R * q->heads;
            float *x = rnd(N, 1.0f, 0.1f, md[k].bf16), *w = rnd(q->d, 0.3f, 1.0f, md[k].bf16);
            float *ref = xmalloc(N * sizeof *ref), *got = xmalloc(N * sizeof *got);
            float *rref = xmalloc(nr * sizeof *rref), *rgot = xmalloc(nr * sizeof *rgot);
            int32_t *pos = xmalloc((size_t)q->R * sizeof *pos);
            for (int r = 0; r < q->R; r++)
                pos[r] = r == 0 ? q->maxpos : rng_int(0, q->maxpos);
            memcpy(ref, x, N * sizeof *x);
            g_cpu->ops->qknorm_rope(g_cpu, ref + q->col0, NULL, q->ld, q->rstd ? rref : NULL, q->w ? w : NULL,
                                    pos, q->R, q->heads, q->d, 1e-6f, q->theta);
            gbuf gx, gw, gp, gr;
            if (gb_alloc(&gx, be, N, md[k].dt) && gb_alloc(&gw, be, q->d, md[k].dt) &&
                gb_alloc(&gp, be, q->R, DFL_I32) && gb_alloc(&gr, be, nr, DFL_F32)) {
                gb_set(&gx, x);
                gb_set(&gw, w);
                gb_set_raw(&gp, pos);
                uint8_t *before = xmalloc(gx.bytes), *after = xmalloc(gx.bytes);
                gb_get_raw(&gx, before);
                char what[128];
                snprintf(what, sizeof what, "qknorm_rope %s R=%d heads=%d d=%d ld=%d+%d%s%s", md[k].name,
                         q->R, q->heads, q->d, q->ld, q->col0, q->w ? "" : " no norm",
                         q->rstd ? " rstd" : "");
                size_t es = dfl_dtype_size(md[k].dt);
                int rc = be->ops->qknorm_rope(be, gx.p + (size_t)q->col0 * es, NULL, q->ld,
                                              q->rstd ? (float *)gr.p : NULL, q->w ? gw.p : NULL,
                                              (const int32_t *)gp.p, q->R, q->heads, q->d, 1e-6f, q->theta);
                T_CHECK(rc == 0, "%s: rc %d", what, rc);
                sync_ok(be, what);
                gb_get(&gx, got);
                gb_get_raw(&gx, after);
                int span = q->heads * q->d;
                cmp_rows(what, got + q->col0, q->ld, ref + q->col0, q->ld, q->R, span,
                         md[k].bf16 ? 8e-3 : 2e-5, md[k].bf16 ? 0.99995 : 0.9999999);
                /* columns outside the heads are untouched */
                for (int r = 0; r < q->R; r++) {
                    size_t row = (size_t)r * q->ld * es;
                    if (!cmp_bytes("qknorm_rope: columns before the heads", after + row, before + row,
                                   (size_t)q->col0 * es) ||
                        !cmp_bytes("qknorm_rope: columns after the heads",
                                   after + row + (size_t)(q->col0 + span) * es,
                                   before + row + (size_t)(q->col0 + span) * es,
                                   (size_t)(q->ld - q->col0 - span) * es))
                        break;
                }
                if (q->rstd) {
                    gb_get(&gr, rgot);
                    char w2[160];
                    snprintf(w2, sizeof w2, "%s: rstd", what);
                    cmp_rows(w2, rgot, (int64_t)nr, rref, (int64_t)nr, 1, (int64_t)nr, 1e-5, 0.9999999);
                }
                /* out of place (src: a copy of the input; the drafter's use): the same bytes as
                 * in place at the heads, the rest of the output and the input untouched */
                gbuf gs, gd;
                if (gb_alloc(&gs, be, N, md[k].dt) && gb_alloc(&gd, be, N, md[k].dt)) {
                    uint8_t *fill = xmalloc(gd.bytes), *od = xmalloc(gd.bytes), *os = xmalloc(gs.bytes);
                    for (size_t i = 0; i < gd.bytes; i++)
                        fill[i] = (uint8_t)(i * 7 + 3);
                    gb_set_raw(&gs, before);
                    gb_set_raw(&gd, fill);
                    rc = be->ops->qknorm_rope(be, gd.p + (size_t)q->col0 * es, gs.p + (size_t)q->col0 * es,
                                              q->ld, NULL, q->w ? gw.p : NULL, (const int32_t *)gp.p,
                                              q->R, q->heads, q->d, 1e-6f, q->theta);
                    T_CHECK(rc == 0, "%s out of place: rc %d", what, rc);
                    sync_ok(be, what);
                    gb_get_raw(&gd, od);
                    gb_get_raw(&gs, os);
                    int64_t bad = 0;
                    for (int r = 0; r < q->R; r++) {
                        size_t row = (size_t)r * q->ld * es, a = (size_t)q->col0 * es,
                               b = (size_t)(q->col0 + span) * es;
                        bad += memcmp(od + row + a, after + row + a, b - a) != 0;
                        bad += memcmp(od + row, fill + row, a) != 0;
                        bad += memcmp(od + row + b, fill + row + b, (size_t)q->ld * es - b) != 0;
                    }
                    T_CHECK(bad == 0, "%s out of place: %lld rows differ from in place or wrote "
                            "outside the heads", what, (long long)bad);
                    T_CHECK(!memcmp(os, before, gs.bytes), "%s out of place: the input changed", what);
                    gb_check_guards(&gd, what);
                    free(fill), free(od), free(os);
                }
                gb_free(&gs);
                gb_free(&gd);
                gb_check_guards(&gx, what);
                gb_check_guards(&gr, what);
                free(before);
                free(after);
            }
            gb_free(&gx);
            gb_free(&gw);
            gb_free(&gp);
            gb_free(&gr);
            free(x);
            free(w);
            free(ref);
            free(got);
            free(rref);
            free(rgot);
            free(pos);
        }
}

/* ------------------------------------------------------------------------------------------ */
/* swiglu, add */

static void test_swiglu(void)
{
    NEED_GPU();
    static const int shapes[][2] = {{1, 64}, {17, 99}, {1000, 1536}, {3, 12288}, {2, 5}};
    struct mode md[2];
    int nm = modes(md);
    for (int k = 0; k < nm; k++)
        for (size_t s = 0; s < sizeof shapes / sizeof shapes[0]; s++) {
            int R = shapes[s][0], I = shapes[s][1];
            dfl_be *be = md[k].be;
            size_t N = (size_t)R * I;
            float *gu = rnd(2 * N, 2.5f, 0, md[k].bf16);
            float *ref = xmalloc(N * sizeof *ref), *got = xmalloc(N * sizeof *got);
            g_cpu->ops->swiglu(g_cpu, ref, gu, R, I);
            gbuf gg, go;
            if (gb_alloc(&gg, be, 2 * N, md[k].dt) && gb_alloc(&go, be, N, md[k].dt)) {
                gb_set(&gg, gu);
                char what[96];
                snprintf(what, sizeof what, "swiglu %s R=%d I=%d", md[k].name, R, I);
                T_CHECK(be->ops->swiglu(be, go.p, gg.p, R, I) == 0, "%s", what);
                sync_ok(be, what);
                gb_get(&go, got);
                cmp_rows(what, got, I, ref, I, R, I, md[k].bf16 ? 8e-3 : 2e-6,
                         md[k].bf16 ? 0.99995 : 0.9999999);
                gb_check_guards(&go, what);
            }
            gb_free(&gg);
            gb_free(&go);
            free(gu);
            free(ref);
            free(got);
        }
}

/* The TMA GEMM (kernels/gemm_tma.cu) in its three epilogues, against the CPU's f32 product of
 * the same bf16 operands: whole and ragged row tiles (rows past M are neither read as data nor
 * written: C's guard band), several column tiles, K of one and of several stages and more stages
 * than the ring holds, ACC in place and from another buffer. Every output element starts as NaN
 * (gbuf), so an unwritten one fails. */
static void test_gemm_tma(void)
{
    NEED_GPU();
    static const struct {
        int M, N, K, mode;
        bool cin;
    } cs[] = {
        {128, 256, 64, DFL_CUDA_GEMM_STORE, false},   {1, 256, 64, DFL_CUDA_GEMM_STORE, false},
        {300, 768, 320, DFL_CUDA_GEMM_STORE, false},  {1000, 512, 1024, DFL_CUDA_GEMM_STORE, false},
        {257, 512, 192, DFL_CUDA_GEMM_ACC, false},    {129, 256, 448, DFL_CUDA_GEMM_ACC, true},
        {300, 256, 128, DFL_CUDA_GEMM_SWIGLU, false}, {513, 768, 640, DFL_CUDA_GEMM_SWIGLU, false},
        {64, 512, 64, DFL_CUDA_GEMM_SWIGLU, false},
    };
    if (!dfl_cuda_gemm_tma_fits(g_bf, (void *)256, 256, (void *)256, 64, (void *)256, 64, 128, 256,
                                64, DFL_CUDA_GEMM_STORE))
        T_SKIP("the TMA GEMM needs a compute-capability 9 GPU");
    const char *was = getenv("DFL_CUDA_GEMM_CLUSTER"), *was_bk = getenv("DFL_CUDA_GEMM_BK");
    char *keep = was ? strdup(was) : NULL, *keep_bk = was_bk ? strdup(was_bk) : NULL;
    for (int form = 0; form < 4; form++)
    for (size_t i = 0; i < sizeof cs / sizeof cs[0]; i++) {
        const int cl = form % 2 + 1, bk = form < 2 ? 64 : 32;
        setenv("DFL_CUDA_GEMM_CLUSTER", cl == 2 ? "2" : "1", 1);
        setenv("DFL_CUDA_GEMM_BK", bk == 32 ? "32" : "64", 1);
        const int M = cs[i].M, N = cs[i].N, K = cs[i].K, mode = cs[i].mode;
        const int Nc = mode == DFL_CUDA_GEMM_SWIGLU ? N / 2 : N;
        float *a = rnd((size_t)M * K, 1.0f, 0, true), *w = rnd((size_t)N * K, 0.1f, 0, true);
        float *c0 = rnd((size_t)M * Nc, 2.0f, 0, true);
        float *ref = xmalloc((size_t)M * Nc * sizeof *ref), *got = xmalloc((size_t)M * Nc * sizeof *got);
        for (int r = 0; r < M; r++)
            for (int n = 0; n < Nc; n++) {
                double p = 0, q = 0;
                for (int k = 0; k < K; k++) {
                    p += (double)a[(size_t)r * K + k] * w[(size_t)n * K + k];
                    if (mode == DFL_CUDA_GEMM_SWIGLU)
                        q += (double)a[(size_t)r * K + k] * w[(size_t)(n + Nc) * K + k];
                }
                float v = (float)p;
                if (mode == DFL_CUDA_GEMM_ACC)
                    v += c0[(size_t)r * Nc + n];
                if (mode == DFL_CUDA_GEMM_SWIGLU) {
                    const float g = round_bf16(v), u = round_bf16((float)q);
                    v = g / (1.0f + expf(-g)) * u;
                }
                ref[(size_t)r * Nc + n] = v;
            }
        gbuf ga, gw, gc, gi;
        memset(&gi, 0, sizeof gi);
        char what[96];
        snprintf(what, sizeof what, "gemm_tma %s M=%d N=%d K=%d%s, cluster %d, bk %d",
                 mode == DFL_CUDA_GEMM_STORE ? "store" : mode == DFL_CUDA_GEMM_ACC ? "acc" : "swiglu",
                 M, N, K, cs[i].cin ? " (Cin apart)" : "", cl, bk);
        if (gb_alloc(&ga, g_bf, (size_t)M * K, DFL_BF16) && gb_alloc(&gw, g_bf, (size_t)N * K, DFL_BF16) &&
            gb_alloc(&gc, g_bf, (size_t)M * Nc, DFL_BF16) &&
            (!cs[i].cin || gb_alloc(&gi, g_bf, (size_t)M * Nc, DFL_BF16))) {
            gb_set(&ga, a);
            gb_set(&gw, w);
            if (mode == DFL_CUDA_GEMM_ACC)
                gb_set(cs[i].cin ? &gi : &gc, c0);
            T_CHECK(dfl_cuda_gemm_tma_fits(g_bf, gc.p, Nc, ga.p, K, gw.p, K, M, N, K, mode), "%s: fits", what);
            T_CHECK(dfl_cuda_gemm_tma(g_bf, gc.p, Nc, cs[i].cin ? gi.p : NULL, ga.p, K, gw.p, K, M, N, K,
                                      mode) == 0, "%s", what);
            sync_ok(g_bf, what);
            gb_get(&gc, got);
            cmp_rows(what, got, Nc, ref, Nc, M, Nc, 8e-3, 0.99995);
            gb_check_guards(&gc, what);
        }
        gb_free(&ga);
        gb_free(&gw);
        gb_free(&gc);
        gb_free(&gi);
        free(a);
        free(w);
        free(c0);
        free(ref);
        free(got);
    }
    if (keep)
        setenv("DFL_CUDA_GEMM_CLUSTER", keep, 1);
    else
        unsetenv("DFL_CUDA_GEMM_CLUSTER");
    if (keep_bk)
        setenv("DFL_CUDA_GEMM_BK", keep_bk, 1);
    else
        unsetenv("DFL_CUDA_GEMM_BK");
    free(keep);
    free(keep_bk);
    /* what it does not take: DFL_EUNSUP, kept until the next sync, nothing launched */
    gbuf gx;
    if (gb_alloc(&gx, g_bf, 256 * 256, DFL_BF16)) {
        static const int bad[][4] = {{128, 256, 96, DFL_CUDA_GEMM_STORE},   /* K not of 64 */
                                     {128, 320, 64, DFL_CUDA_GEMM_STORE},   /* columns not of 256 */
                                     {128, 384, 64, DFL_CUDA_GEMM_SWIGLU},  /* I = 192: not of 128 */
                                     {128, 256, 64, 3}};                    /* no such epilogue */
        for (size_t i = 0; i < sizeof bad / sizeof bad[0]; i++) {
            dfl_err e = {0};
            T_CHECK(!dfl_cuda_gemm_tma_fits(g_bf, gx.p, 256, gx.p, 64, gx.p, 64, bad[i][0], bad[i][1],
                                            bad[i][2], bad[i][3]), "bad case %zu fits", i);
            T_CHECK(dfl_cuda_gemm_tma(g_bf, gx.p, 256, NULL, gx.p, 64, gx.p, 64, bad[i][0], bad[i][1],
                                      bad[i][2], bad[i][3]) == DFL_EUNSUP, "bad case %zu: DFL_EUNSUP", i);
            T_CHECK(g_bf->ops->sync(g_bf, &e) == DFL_EUNSUP && strstr(e.msg, "gemm_tma"),
                    "bad case %zu: the sync reports it (%s)", i, e.msg);
        }
        /* the f32 backend never takes it */
        T_CHECK(!dfl_cuda_gemm_tma_fits(g_f32, gx.p, 256, gx.p, 64, gx.p, 64, 128, 256, 64,
                                        DFL_CUDA_GEMM_STORE), "f32 activations fit");
    }
    gb_free(&gx);
}

static void test_add(void)
{
    NEED_GPU();
    static const int sizes[] = {1, 7, 1000003, 4096};
    struct mode md[2];
    int nm = modes(md);
    for (int k = 0; k < nm; k++)
        for (size_t s = 0; s < sizeof sizes / sizeof sizes[0]; s++)
            for (int off = 0; off < 2; off++) {   /* off = 1: pointers not 16-byte aligned */
                int n = sizes[s];
                dfl_be *be = md[k].be;
                float *y = rnd((size_t)n + 1, 1, 0, md[k].bf16), *x = rnd((size_t)n + 1, 1, 0, md[k].bf16);
                float *ref = xmalloc(((size_t)n + 1) * sizeof *ref), *got = xmalloc(((size_t)n + 1) * sizeof *got);
                memcpy(ref, y, ((size_t)n + 1) * sizeof *y);
                g_cpu->ops->add(g_cpu, ref + off, x + off, n);
                gbuf gy, gx;
                if (gb_alloc(&gy, be, (size_t)n + 1, md[k].dt) && gb_alloc(&gx, be, (size_t)n + 1, md[k].dt)) {
                    gb_set(&gy, y);
                    gb_set(&gx, x);
                    size_t es = dfl_dtype_size(md[k].dt);
                    char what[96];
                    snprintf(what, sizeof what, "add %s n=%d%s", md[k].name, n, off ? " unaligned" : "");
                    T_CHECK(be->ops->add(be, gy.p + off * es, gx.p + off * es, n) == 0, "%s", what);
                    sync_ok(be, what);
                    gb_get(&gy, got);
                    /* one rounding of an exact sum: within half an ulp, compared per element */
                    cmp_rows(what, got, 1, ref, 1, n + 1, 1, md[k].bf16 ? 4e-3 : 1e-7, -1.0);
                    gb_check_guards(&gy, what);
                }
                gb_free(&gy);
                gb_free(&gx);
                free(y);
                free(x);
                free(ref);
                free(got);
            }
}

/* ------------------------------------------------------------------------------------------ */
/* attention */

struct at_case {
    int nh, nkv, d;
    int layout;        /* 0 separate q/k/v/o; 1 fused QKV (+8 pad) and padded o; 2 fused, odd ld */
    float qscale;
    int nseq;
    int lens[16];      /* nseq <= 16; nseq < 0: -nseq random lengths in 1..lens[0] */
};

static void run_attn_case(const struct at_case *c)
{
    int nseq = c->nseq > 0 ? c->nseq : -c->nseq;
    int32_t *cu = xmalloc(((size_t)nseq + 1) * sizeof *cu);
    int max_len = 0;
    cu[0] = 0;
    for (int s = 0; s < nseq; s++) {
        int L = c->nseq > 0 ? c->lens[s] : rng_int(1, c->lens[0]);
        cu[s + 1] = cu[s] + L;
        if (L > max_len)
            max_len = L;
    }
    int64_t T = cu[nseq];
    int d = c->d;
    int64_t qw = (int64_t)c->nh * d, kw = (int64_t)c->nkv * d;
    int64_t ldq, ldk, ldv, ldo;
    int64_t offq, offk, offv;   /* element offsets of q, k, v in their buffers */
    size_t nq, nk;              /* elements of the q buffer (fused: the whole QKV) and k/v buffers */
    if (c->layout == 0) {
        ldq = qw;
        ldk = ldv = kw;
        ldo = qw;
        offq = offk = offv = 0;
        nq = (size_t)T * qw;
        nk = (size_t)T * kw;
    } else {
        int64_t w = qw + 2 * kw + (c->layout == 1 ? 8 : 1);
        ldq = ldk = ldv = w;
        ldo = qw + (c->layout == 1 ? 8 : 0);
        offq = 0;
        offk = qw;
        offv = qw + kw;
        nq = (size_t)T * w;
        nk = 0;
    }
    size_t no = (size_t)T * ldo;
    float scale = 1.0f / sqrtf((float)d);

    struct mode md[2];
    int nm = modes(md);
    for (int k = 0; k < nm; k++) {
        dfl_be *be = md[k].be;
        size_t es = dfl_dtype_size(md[k].dt);
        float *hq = rnd(nq, 1, 0, md[k].bf16);
        float *hk = nk ? rnd(nk, 1, 0, md[k].bf16) : NULL, *hv = nk ? rnd(nk, 1, 0, md[k].bf16) : NULL;
        for (size_t i = 0; i < nq; i++)   /* sharpen the scores (q columns only matter) */
            hq[i] = md[k].bf16 ? round_bf16(hq[i] * c->qscale) : hq[i] * c->qscale;
        if (c->layout != 0)   /* fused: k and v columns back to unit scale */
            for (int64_t t = 0; t < T; t++)
                for (int64_t j = qw; j < ldq; j++) {
                    float *p = &hq[t * ldq + j];
                    *p = md[k].bf16 ? round_bf16(*p / c->qscale) : *p / c->qscale;
                }
        float *ref = xmalloc(no * sizeof *ref), *got = xmalloc(no * sizeof *got);
        for (size_t i = 0; i < no; i++)
            ref[i] = NAN;
        dfl_attn_varlen a = {.q = hq + offq, .ldq = ldq, .k = (nk ? hk : hq) + offk, .ldk = ldk,
                             .v = (nk ? hv : hq) + offv, .ldv = ldv, .o = ref, .ldo = ldo,
                             .cu_seqlens = cu, .n_seqs = nseq, .max_len = max_len, .T = T,
                             .n_heads = c->nh, .n_kv = c->nkv, .d = d, .scale = scale};
        T_CHECK(g_cpu->ops->attn_varlen(g_cpu, &a) == 0, "cpu attention");

        gbuf gq, gk = {0}, gv = {0}, go, gc;
        bool ok = gb_alloc(&gq, be, nq, md[k].dt) && gb_alloc(&go, be, no, md[k].dt) &&
                  gb_alloc(&gc, be, (size_t)nseq + 1, DFL_I32);
        if (ok && nk)
            ok = gb_alloc(&gk, be, nk, md[k].dt) && gb_alloc(&gv, be, nk, md[k].dt);
        if (ok) {
            gb_set(&gq, hq);
            if (nk) {
                gb_set(&gk, hk);
                gb_set(&gv, hv);
            }
            gb_set_raw(&gc, cu);
            uint8_t *qimg = xmalloc(gq.bytes), *qafter = xmalloc(gq.bytes);
            uint8_t *oimg = xmalloc(go.bytes), *oafter = xmalloc(go.bytes);
            gb_get_raw(&gq, qimg);
            /* output image: NaN in the data columns, a 0x77 pattern in the padding columns */
            memset(oimg, 0xFF, go.bytes);
            for (int64_t t = 0; t < T; t++)
                memset(oimg + ((size_t)t * ldo + qw) * es, 0x77, (size_t)(ldo - qw) * es);
            int nvar = 1, v_default = dfl_cuda_attn_get_variant(be, d);
            if (md[k].bf16 && dfl_cuda_attn_variant_name(d, 0))
                while (dfl_cuda_attn_variant_name(d, nvar))
                    nvar++;
            for (int v = 0; v < nvar; v++) {
                dfl_err e = {0};
                if (md[k].bf16 && dfl_cuda_attn_variant_name(d, 0))
                    T_CHECK(dfl_cuda_attn_set_variant(be, d, v, &e) == 0, "set variant: %s", e.msg);
                gb_set_raw(&go, oimg);
                dfl_attn_varlen g = a;
                g.q = gq.p + (size_t)offq * es;
                g.k = (nk ? gk.p : gq.p) + (size_t)offk * es;
                g.v = (nk ? gv.p : gq.p) + (size_t)offv * es;
                g.o = go.p;
                g.cu_seqlens = (const int32_t *)gc.p;
                char what[200];
                const char *vn = md[k].bf16 ? dfl_cuda_attn_variant_name(d, v) : NULL;
                bool tiled = vn && c->layout != 2;
                snprintf(what, sizeof what, "attn %s h%d/%d d%d T%lld seqs%d max%d L%d q*%g [%s]",
                         md[k].name, c->nh, c->nkv, d, (long long)T, nseq, max_len, c->layout,
                         c->qscale, tiled ? vn : "simple kernel");
                int rc = be->ops->attn_varlen(be, &g);
                T_CHECK(rc == 0, "%s: rc %d", what, rc);
                sync_ok(be, what);
                gb_get(&go, got);
                gb_get_raw(&go, oafter);
                cmp_rows(what, got, ldo, ref, ldo, T, qw, md[k].bf16 ? 1e-2 : 2e-5,
                         md[k].bf16 ? 0.9999 : 0.9999999);
                for (int64_t t = 0; t < T; t++) {
                    size_t off = ((size_t)t * ldo + qw) * es;
                    if (!cmp_bytes("attn: o padding columns", oafter + off, oimg + off, (size_t)(ldo - qw) * es))
                        break;
                }
                gb_check_guards(&go, what);
                gb_get_raw(&gq, qafter);
                cmp_bytes("attn: q/k/v input changed", qafter, qimg, gq.bytes);
                gb_check_guards(&gq, what);
                if (!tiled)
                    break;
            }
            if (md[k].bf16 && dfl_cuda_attn_variant_name(d, 0) && v_default >= 0) {
                dfl_err e = {0};   /* back to the backend's default (wgmma at d128 on Hopper) */
                dfl_cuda_attn_set_variant(be, d, v_default, &e);
            }
            free(qimg);
            free(qafter);
            free(oimg);
            free(oafter);
        }
        gb_free(&gq);
        gb_free(&gk);
        gb_free(&gv);
        gb_free(&go);
        gb_free(&gc);
        free(hq);
        free(hk);
        free(hv);
        free(ref);
        free(got);
    }
    free(cu);
}

static void test_attn_varlen(void)
{
    NEED_GPU();
    static const struct at_case cases[] = {
        {4, 1, 128, 1, 2, 1, {1}},
        {32, 8, 128, 1, 2, 3, {1, 1, 1}},
        {8, 8, 128, 0, 2, 9, {5, 130, 77, 1, 64, 65, 63, 128, 129}},
        {8, 4, 64, 1, 2, 4, {200, 3, 64, 1}},
        {8, 1, 256, 0, 2, 4, {100, 37, 1, 70}},
        {16, 2, 128, 1, 2, -50, {150}},
        {4, 1, 128, 0, 2, 1, {2048}},
        {16, 2, 64, 1, 2, 2, {1000, 517}},
        {4, 2, 96, 1, 2, 2, {33, 7}},               /* no tiled kernel for d = 96 */
        {8, 2, 128, 2, 2, 2, {300, 45}},            /* odd row stride: simple kernel */
        {4, 4, 128, 0, 30, 1, {257}},               /* large scores */
        {8, 2, 256, 1, 2, 3, {129, 64, 191}},
        {2, 2, 64, 0, 1, 5, {16, 17, 15, 0, 33}},  /* an empty sequence */
    };
    for (size_t i = 0; i < sizeof cases / sizeof cases[0]; i++)
        run_attn_case(&cases[i]);
}

/* d128 around the wgmma kernel's 128-row tiles and its warpgroups' 64-row halves (small enough
 * for compute-sanitizer: T_ONLY=test_attn_tiles128) */
static void test_attn_tiles128(void)
{
    NEED_GPU();
    static const struct at_case cases[] = {
        {16, 8, 128, 1, 2, 7, {384, 257, 1, 640, 191, 64, 65}},
        {32, 4, 128, 0, 30, 2, {700, 63}},   /* GQA 8, large scores */
    };
    for (size_t i = 0; i < sizeof cases / sizeof cases[0]; i++)
        run_attn_case(&cases[i]);
}

#else /* no CUDA in this build */

static void test_gpu_ops(void) { T_SKIP("no CUDA GPU (this build has no CUDA support)"); }

#endif

int main(int argc, char **argv)
{
    (void)argc;
    t_init(argv[0]);
#ifdef DFL_CUDA
    if (!gpu_open_backends(argv[0]))
        return 1;
    T_RUN(test_open);
    T_RUN(test_memory);
    T_RUN(test_api);
    T_RUN(test_convert);
    T_RUN(test_matmul);
    T_RUN(test_matmul_tune);
    T_RUN(test_matmul_pick);
    T_RUN(test_matmul_algo);
    T_RUN(test_embedding);
    T_RUN(test_rmsnorm);
    T_RUN(test_add_rmsnorm);
    T_RUN(test_qknorm_rope);
    T_RUN(test_swiglu);
    T_RUN(test_gemm_tma);
    T_RUN(test_add);
    T_RUN(test_attn_varlen);
    T_RUN(test_attn_tiles128);
    gpu_close_backends();
#else
    T_RUN(test_gpu_ops);
#endif
    return t_done();
}
