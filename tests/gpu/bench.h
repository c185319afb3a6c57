/* bench.h: what the GPU benchmarks (bench-ops.c, bench-train-ops.c, bench-ceiling.c) share: the
 * CUDA backend and two timing events, die(), device allocation, bf16 data filled from the host, a
 * checked sync, milliseconds per call, the GEMM runner, and opening and closing the device.
 * Without CUDA, it is the whole program: a main that skips (exit 77). Define BENCH_NAME (the
 * program's name, for messages) first; include after backend.h, dtype.h and err.h, and put the
 * program inside #ifdef DFL_CUDA. */
#ifndef DFL_BENCH_H
#define DFL_BENCH_H

#include <stdbool.h>
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>

#ifdef DFL_CUDA
#include "../../kernels/cuda.h"

static dfl_be *be;
static dfl_cuda_event ev0, ev1;

static inline void die(const char *what, const dfl_err *e)
{
    fprintf(stderr, BENCH_NAME ": %s: %s\n", what, e ? e->msg : "failed");
    exit(1);
}

static inline void *dalloc(size_t bytes)
{
    dfl_err e = {0};
    void *p = be_alloc(be, bytes, &e);
    if (!p)
        die("alloc", &e);
    return p;
}

/* fill n bf16 values ~ U(-a, a) on the device (through a host buffer) */
static inline void fill_bf16(void *dev, size_t n, float a, uint64_t seed)
{
    const size_t chunk = (size_t)1 << 24;
    uint16_t *h = malloc(chunk * sizeof *h);
    if (!h)
        die("malloc", NULL);
    uint64_t x = seed * 0x9E3779B97F4A7C15ull + 1;
    for (size_t off = 0; off < n; off += chunk) {
        size_t m = n - off < chunk ? n - off : chunk;
        for (size_t i = 0; i < m; i++) {
            x ^= x >> 12;
            x ^= x << 25;
            x ^= x >> 27;
            float u = (float)((x * 0x2545F4914F6CDD1Dull) >> 40) / 16777216.0f;
            h[i] = dfl_f32_to_bf16(a * (2 * u - 1));
        }
        if (be->ops->upload(be, (uint16_t *)dev + off, h, m * 2))
            die("upload", NULL);
    }
    free(h);
}

static inline void check_sync(const char *what)
{
    dfl_err e = {0};
    if (be->ops->sync(be, &e))
        die(what, &e);
}

/* Milliseconds per call of fn(arg), averaged over n calls after one warm-up call. */
static inline double time_ms(void (*fn)(void *), void *arg, int n)
{
    dfl_err e = {0};
    dfl_cuda_stream s = dfl_cuda_compute_stream(be);
    fn(arg);
    check_sync("warm-up");
    if (dfl_cuda_event_record(be, ev0, s, &e))
        die("event", &e);
    for (int i = 0; i < n; i++)
        fn(arg);
    if (dfl_cuda_event_record(be, ev1, s, &e) || dfl_cuda_event_sync(be, ev1, &e))
        die("event", &e);
    check_sync("timed runs");
    float ms = 0;
    if (dfl_cuda_event_elapsed(be, ev0, ev1, &ms, &e))
        die("elapsed", &e);
    return ms / n;
}

static inline void run_mm(void *arg)
{
    if (be->ops->matmul(be, (const dfl_mm *)arg))
        check_sync("matmul");
}

/* Opens device 0 (bf16 activations) and the two events into be, ev0, ev1, and reads the device's
 * properties into *pr. False (after printing "skip: no CUDA GPU") when there is no GPU. */
static inline bool bench_open(dfl_cuda_props *pr)
{
    if (dfl_be_cuda_count() <= 0) {
        printf("skip: no CUDA GPU\n");
        return false;
    }
    dfl_err e = {0};
    if (dfl_be_cuda_open(&be, 0, DFL_BF16, &e))
        die("open", &e);
    if (dfl_cuda_event_create(be, &ev0, true, &e) || dfl_cuda_event_create(be, &ev1, true, &e))
        die("event", &e);
    if (dfl_cuda_device_props(0, pr, &e))
        die("props", &e);
    return true;
}

static inline void bench_close(void)
{
    dfl_cuda_event_destroy(be, ev0);
    dfl_cuda_event_destroy(be, ev1);
    dfl_be_close(be);
}

#else

int main(void)
{
    printf("skip: no CUDA GPU (this build has no CUDA support)\n");
    return 77;
}

#endif
#endif
