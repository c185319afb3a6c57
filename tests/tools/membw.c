/* membw.c: the memory-bandwidth ceiling for benchmarks: memcpy and read-only rates in GB/s over
 * a buffer much larger than the caches, with 1 thread and with N threads (each copying its own
 * slice).
 *
 *   membw [SIZE_MIB [THREADS]]    (defaults: 1024 MiB, all online CPUs)
 *
 * Prints "memcpy 1 thread: X GB/s", "memcpy N threads: X GB/s", "read 1 thread: X GB/s" and
 * "read N threads: X GB/s" (bytes copied, or read, per second; best of 5 runs). */
#include <omp.h>
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "util.h"

static double best_copy(uint8_t *dst, const uint8_t *src, size_t n, int nt)
{
    double best = 0;
    for (int rep = 0; rep < 5; rep++) {
        double t0 = dfl_now();
#pragma omp parallel num_threads(nt)
        {
            int t = omp_get_thread_num(), k = omp_get_num_threads();
            size_t lo = n / (size_t)k * (size_t)t, hi = t == k - 1 ? n : n / (size_t)k * (size_t)(t + 1);
            memcpy(dst + lo, src + lo, hi - lo);
        }
        double dt = dfl_now() - t0;
        if ((double)n / dt > best)
            best = (double)n / dt;
    }
    return best / 1e9;
}

__attribute__((target_clones("avx2", "default"))) static uint64_t xor_all(const uint64_t *p, size_t n)
{
    uint64_t acc = 0;
#pragma omp simd reduction(^ : acc)
    for (size_t i = 0; i < n; i++)
        acc ^= p[i];
    return acc;
}

static volatile uint64_t sink;

static double best_read(const uint8_t *src, size_t n, int nt)
{
    double best = 0;
    for (int rep = 0; rep < 5; rep++) {
        double t0 = dfl_now();
        uint64_t acc = 0;
#pragma omp parallel num_threads(nt) reduction(^ : acc)
        {
            int t = omp_get_thread_num(), k = omp_get_num_threads();
            size_t words = n / 8;
            size_t lo = words / (size_t)k * (size_t)t, hi = t == k - 1 ? words : words / (size_t)k * (size_t)(t + 1);
            acc ^= xor_all((const uint64_t *)src + lo, hi - lo);
        }
        sink = acc;
        double dt = dfl_now() - t0;
        if ((double)n / dt > best)
            best = (double)n / dt;
    }
    return best / 1e9;
}

int main(int argc, char **argv)
{
    size_t mib = argc > 1 ? (size_t)atol(argv[1]) : 1024;
    int nt = argc > 2 ? atoi(argv[2]) : 0;
    if (nt <= 0)
        nt = dfl_ncpu();
    size_t n = mib << 20;
    uint8_t *a = malloc(n), *b = malloc(n);
    if (!a || !b) {
        fprintf(stderr, "membw: cannot allocate 2 x %zu MiB\n", mib);
        return 1;
    }
    memset(a, 1, n); /* touch every page first: the rates are of memory, not of page faults */
    memset(b, 2, n);
    printf("memcpy 1 thread: %.2f GB/s\n", best_copy(b, a, n, 1));
    printf("memcpy %d threads: %.2f GB/s\n", nt, best_copy(b, a, n, nt));
    printf("read 1 thread: %.2f GB/s\n", best_read(a, n, 1));
    printf("read %d threads: %.2f GB/s\n", nt, best_read(a, n, nt));
    free(a);
    free(b);
    return 0;
}
