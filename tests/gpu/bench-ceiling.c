/* bench-ceiling.c: the ceilings the dfl-target benchmark (bench/target) compares against,
 * measured in a few seconds: the cuBLAS(Lt) bf16 GEMM rate on an 8192^3 product of random data
 * (cuBLASLt's first choice and the best of its candidates, each the median of several timed
 * rounds), the device-to-device copy bandwidth, and the device-to-host copy bandwidth into
 * pinned memory. Prints one line per figure and a last JSON line. Not a test: exits 77 without a
 * GPU.   bench-ceiling [--quick] */
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "backend.h"
#include "dtype.h"
#include "err.h"

#define BENCH_NAME "bench-ceiling"
#include "bench.h"

#ifdef DFL_CUDA


static int cmp_d(const void *a, const void *b)
{
    double x = *(const double *)a, y = *(const double *)b;
    return x < y ? -1 : x > y;
}

/* Median over `rounds` of the ms per call of fn over `iters` calls. */
static double median_ms(void (*fn)(void *), void *arg, int iters, int rounds)
{
    dfl_err e = {0};
    dfl_cuda_stream s = dfl_cuda_compute_stream(be);
    double t[32];
    fn(arg);
    if (be->ops->sync(be, &e))
        die("warm-up", &e);
    for (int r = 0; r < rounds && r < 32; r++) {
        if (dfl_cuda_event_record(be, ev0, s, &e))
            die("event", &e);
        for (int i = 0; i < iters; i++)
            fn(arg);
        float ms = 0;
        if (dfl_cuda_event_record(be, ev1, s, &e) || dfl_cuda_event_sync(be, ev1, &e) ||
            dfl_cuda_event_elapsed(be, ev0, ev1, &ms, &e))
            die("event", &e);
        t[r] = ms / iters;
    }
    if (be->ops->sync(be, &e))
        die("timed runs", &e);
    qsort(t, (size_t)rounds, sizeof t[0], cmp_d);
    return t[rounds / 2];
}

/* run_mm, but a failed call is fatal at once */
static void run_mm_or_die(void *arg)
{
    if (be->ops->matmul(be, (const dfl_mm *)arg))
        die("matmul", NULL);
}

struct cp {
    void *dst;
    const void *src;
    size_t n;
    bool d2h;
};

static void run_copy(void *arg)
{
    struct cp *c = arg;
    dfl_err e = {0};
    if (c->d2h) {
        if (dfl_cuda_download_async(be, c->dst, c->src, c->n, dfl_cuda_compute_stream(be), &e))
            die("download", &e);
    } else if (be->ops->copy(be, c->dst, c->src, c->n)) {
        die("copy", NULL);
    }
}

int main(int argc, char **argv)
{
    bool quick = argc > 1 && strcmp(argv[1], "--quick") == 0;
    int rounds = quick ? 3 : 7;
    dfl_cuda_props pr;
    if (!bench_open(&pr))
        return 77;
    dfl_err e = {0};
    printf("device: %s, %d SMs, %.0f GB\n", pr.name, pr.sm_count, pr.mem_total / 1e9);

    const int64_t P = 8192;
    void *a = dalloc((size_t)P * P * 2), *b = dalloc((size_t)P * P * 2), *c = dalloc((size_t)P * P * 2);
    fill_bf16(a, (size_t)P * P, 1, 1);
    fill_bf16(b, (size_t)P * P, 1, 2);
    dfl_mm m = {.M = P, .N = P, .K = P, .A = a, .adt = DFL_BF16, .lda = P, .B = b, .bdt = DFL_BF16,
                .ldb = P, .tb = true, .C = c, .cdt = DFL_BF16, .ldc = P, .alpha = 1, .beta = 0};
    double flop = 2.0 * P * P * P;
    double t_h = median_ms(run_mm_or_die, &m, 10, rounds);
    float best = 0, first = 0;
    if (dfl_cuda_matmul_tune(be, &m, 16, 5, &best, &first, &e))
        die("tune", &e);
    double t_t = median_ms(run_mm_or_die, &m, 10, rounds);
    double gemm = flop / (t_h < t_t ? t_h : t_t) / 1e9;
    printf("gemm 8192^3 bf16: first choice %.3f ms (%.1f TFLOP/s), tuned %.3f ms (%.1f TFLOP/s)\n", t_h,
           flop / t_h / 1e9, t_t, flop / t_t / 1e9);
    printf("ceiling: cuBLAS bf16 GEMM %.1f TFLOP/s\n", gemm);
    be->ops->free(be, a);
    be->ops->free(be, b);
    be->ops->free(be, c);

    size_t n = (size_t)1 << 30;
    struct cp d2d = {.dst = dalloc(n), .src = dalloc(n), .n = n};
    double t_c = median_ms(run_copy, &d2d, 5, rounds);
    double copy = 2.0 * n / t_c / 1e6;
    printf("ceiling: device-to-device copy %.0f GB/s (read + write)\n", copy);
    void *host = dfl_cuda_host_alloc(be, n / 4, &e);
    if (!host)
        die("pinned", &e);
    struct cp d2h = {.dst = host, .src = d2d.src, .n = n / 4, .d2h = true};
    double t_p = median_ms(run_copy, &d2h, 3, rounds);
    double pcie = (double)(n / 4) / t_p / 1e6;
    printf("ceiling: device-to-host copy into pinned memory %.1f GB/s\n", pcie);
    printf("{\"device\": \"%s\", \"gemm_tflops\": %.1f, \"gemm_first_tflops\": %.1f, \"copy_gbs\": %.0f, "
           "\"d2h_gbs\": %.1f}\n", pr.name, gemm, flop / t_h / 1e9, copy, pcie);
    dfl_cuda_host_free(be, host);
    be->ops->free(be, (void *)d2d.dst);
    be->ops->free(be, (void *)d2d.src);
    bench_close();
    return 0;
}

#endif
