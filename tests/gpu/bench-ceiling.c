/* bench-ceiling.c: the ceilings the dfl-target benchmark (bench/target) compares against,
 * measured in a few seconds: the cuBLAS(Lt) bf16 GEMM rate on an 8192^3 product of random data
 * (cuBLASLt's first choice and the best of its candidates, each the median of several timed
 * rounds), the device-to-device copy bandwidth, and the device-to-host copy bandwidth into
 * pinned memory. Prints one line per figure and a last JSON line. Not a test: exits 77 without a
 * GPU.
 *   bench-ceiling [--quick] [--sustained S] [--algos S] [--own S] [--shapes M,N,K[,acc|,swiglu][;...]]
 * --sustained runs the 8192^3 GEMM back to back for S seconds and prints its rate in each quarter
 * second's slice (the rate of a long run, after the clocks settle, against the short ceiling);
 * --shapes times other GEMMs (C [M, N] = A [M, K] B^T, B as a [N, K] weight, acc: C added to, as
 * dfl-target's residual epilogue does) with cuBLASLt's first choice; --algos S (with --shapes, or
 * alone for the 8192^3 GEMM) times each of cuBLASLt's candidates for the shape back to back for S
 * seconds at the clocks the power cap leaves (the GPU first held there for a second with the
 * first choice; the first choice timed again last, to show the drift): at the cap the algorithm
 * of least energy a FLOP is the fastest, which need not be the fastest in short bursts; then the
 * tune's own choice (dfl_cuda_matmul_tune, its choice described on stderr).
 * --own S (with --shapes) times our own TMA GEMM (kernels/gemm_tma.cu) beside cuBLAS on each
 * shape: in bursts (the median of rounds) and back to back for S seconds each at the power cap
 * (cuBLAS, ours, cuBLAS again, to show the drift), after checking ours against cuBLAS's output;
 * a shape M,N,K,swiglu is the MLP's gate|up product (W [N, K], N = 2 I) with its activation:
 * cuBLAS's product then the swiglu op, against ours with SwiGLU in the epilogue. */
#include <math.h>
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "backend.h"
#include "dtype.h"
#include "err.h"
#include "log.h"

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

/* ms of `iters` calls of fn(arg) back to back */
static double run_ms(void (*fn)(void *), void *arg, int iters)
{
    dfl_err e = {0};
    dfl_cuda_stream s = dfl_cuda_compute_stream(be);
    float ms = 0;
    if (dfl_cuda_event_record(be, ev0, s, &e))
        die("event", &e);
    for (int i = 0; i < iters; i++)
        fn(arg);
    if (dfl_cuda_event_record(be, ev1, s, &e) || dfl_cuda_event_sync(be, ev1, &e) ||
        dfl_cuda_event_elapsed(be, ev0, ev1, &ms, &e))
        die("event", &e);
    return ms;
}

/* ms of `iters` calls of m back to back */
static double timed_ms(dfl_mm *m, int iters) { return run_ms(run_mm_or_die, m, iters); }

/* The 8192^3 GEMM m back to back for `seconds`, timed in slices of ~0.25 s. */
static void sustained(dfl_mm *m, double flop, double seconds)
{
    double per = median_ms(run_mm_or_die, m, 10, 3);
    int iters = (int)(250.0 / per) + 1, slices = (int)(seconds * 4) + 1;
    double lo = 1e30, hi = 0, first = 0, last = 0, t = 0;
    printf("sustained gemm 8192^3 bf16, slices of %d calls:", iters);
    for (int k = 0; k < slices; k++) {
        double ms = timed_ms(m, iters);
        double r = flop * iters / ms / 1e9;
        t += ms / 1e3;
        lo = r < lo ? r : lo;
        hi = r > hi ? r : hi;
        first = k ? first : r;
        last = r;
        printf(" %.0f", r);
    }
    printf(" TFLOP/s\nsustained: %.1f s of GEMMs: first slice %.1f, last %.1f, lowest %.1f, highest %.1f TFLOP/s\n",
           t, first, last, lo, hi);
}

/* Each of cuBLASLt's candidates for m back to back for `seconds` (after a second of the first
 * choice, to reach the power cap), then the first choice again; the last choice stays picked. */
static void algos(dfl_mm *m, double seconds)
{
    dfl_err e = {0};
    int n = 0;
    char desc[160];
    if (dfl_cuda_matmul_pick(be, m, 0, &n, NULL, 0, &e))
        die("pick", &e);
    const double flop = 2.0 * (double)m->M * (double)m->N * (double)m->K;
    double per = median_ms(run_mm_or_die, m, 3, 3);
    int iters = (int)(seconds * 1e3 / per) + 1, warm = (int)(1e3 / per) + 1;
    for (int i = 0; i < warm; i++)
        run_mm_or_die(m);
    double first = 0, best = 0;
    int best_i = 0;
    for (int k = 0; k <= n; k++) {
        int i = k < n ? k : 0;
        if (dfl_cuda_matmul_pick(be, m, i, NULL, desc, sizeof desc, &e))
            die("pick", &e);
        run_mm_or_die(m);
        double ms = timed_ms(m, iters);
        double r = flop * iters / ms / 1e9;
        printf("algo %lldx%lldx%lld%s candidate %d%s: %.1f TFLOP/s over %.2f s (%s)\n", (long long)m->M,
               (long long)m->N, (long long)m->K, m->beta != 0.0f ? " +C" : "", i,
               k == n ? " (again)" : "", r, ms / 1e3, desc);
        if (k == 0)
            first = r;
        if (k < n && r > best) {
            best = r;
            best_i = i;
        }
    }
    printf("algos %lldx%lldx%lld%s: %d candidates; first choice %.1f, best %.1f TFLOP/s (candidate %d, %+.1f%%)\n",
           (long long)m->M, (long long)m->N, (long long)m->K, m->beta != 0.0f ? " +C" : "", n, first,
           best, best_i, 100.0 * (best / first - 1.0));
    /* then the tune itself (dfl-target's 16 candidates, 4 rounds; its -v line describes its choice) */
    float t_best = 0, t_first = 0;
    if (dfl_cuda_matmul_tune(be, m, 16, 4, &t_best, &t_first, &e))
        die("tune", &e);
    printf("tune %lldx%lldx%lld%s: first choice %.1f, kept %.1f TFLOP/s (%+.1f%%)\n", (long long)m->M,
           (long long)m->N, (long long)m->K, m->beta != 0.0f ? " +C" : "", flop / t_first / 1e9,
           flop / t_best / 1e9, 100.0 * (t_first / t_best - 1.0));
}

/* a product as cuBLAS runs it (with swiglu: then the swiglu op into out) or as ours does */
struct own {
    dfl_mm m;
    bool swiglu, ours;
    void *out; /* swiglu's [M, N / 2] */
};

static void run_own(void *arg)
{
    struct own *o = arg;
    if (o->ours) {
        const int mode = o->swiglu ? DFL_CUDA_GEMM_SWIGLU : o->m.beta != 0.0f ? DFL_CUDA_GEMM_ACC : DFL_CUDA_GEMM_STORE;
        if (dfl_cuda_gemm_tma(be, o->swiglu ? o->out : o->m.C, o->swiglu ? o->m.N / 2 : o->m.ldc, NULL,
                              o->m.A, o->m.lda, o->m.B, o->m.ldb, o->m.M, o->m.N, o->m.K, mode))
            die("gemm_tma", NULL);
        return;
    }
    run_mm_or_die(&o->m);
    if (o->swiglu && be->ops->swiglu(be, o->out, o->m.C, o->m.M, o->m.N / 2))
        die("swiglu", NULL);
}

/* the largest |ours - cuBLAS| over n bf16 values, relative to cuBLAS's largest |value|, and how
 * many differ at all; the output o writes (C, or out with swiglu) taken from both */
static void own_check(struct own *o, const char *name)
{
    const size_t n = (size_t)o->m.M * (size_t)(o->swiglu ? o->m.N / 2 : o->m.N);
    uint16_t *ref = malloc(n * 2), *got = malloc(n * 2);
    void *dst = o->swiglu ? o->out : o->m.C;
    if (!ref || !got)
        die("malloc", NULL);
    if (o->m.beta != 0.0f)
        fill_bf16(o->m.C, n, 1, 3);
    o->ours = false;
    run_own(o);
    check_sync("cuBLAS");
    if (be->ops->download(be, ref, dst, n * 2))
        die("download", NULL);
    if (o->m.beta != 0.0f)
        fill_bf16(o->m.C, n, 1, 3);
    o->ours = true;
    run_own(o);
    check_sync("ours");
    if (be->ops->download(be, got, dst, n * 2))
        die("download", NULL);
    double top = 0, worst = 0;
    size_t differ = 0, bad = 0;
    for (size_t i = 0; i < n; i++) {
        const double r = fabs(dfl_bf16_to_f32(ref[i]));
        if (!(r <= top))
            top = r;
    }
    for (size_t i = 0; i < n; i++) {
        const double r = dfl_bf16_to_f32(ref[i]), g = dfl_bf16_to_f32(got[i]);
        const double d = fabs(g - r);
        if (!(d <= worst))
            worst = d;
        differ += ref[i] != got[i];
        bad += !(d <= 1e-2 * fabs(r) + 1e-2 * top);
    }
    /* the bound: 1% of the value and 1% of the largest one (a sum with C can cancel to near 0,
     * where both are a few roundings of the largest terms; a misplaced tile is off by the values) */
    printf("own %s: ours against cuBLAS: %zu of %zu values differ, largest difference %.3g (of "
           "values up to %.3g), %zu beyond 1%% of the value + 1%% of the largest: %s\n", name,
           differ, n, worst, top, bad, bad ? "MISMATCH" : "ok");
    if (bad)
        exit(1);
    free(ref);
    free(got);
}

/* cuBLAS and ours on o: bursts (median of rounds), then each back to back for `seconds` */
static void own_bench(struct own *o, const char *name, int rounds, double seconds)
{
    own_check(o, name);
    const double flop = 2.0 * (double)o->m.M * (double)o->m.N * (double)o->m.K;
    double burst[2], sus[3];
    for (int k = 0; k < 2; k++) {
        o->ours = k == 1;
        burst[k] = median_ms(run_own, o, 10, rounds);
    }
    if (seconds > 0) {
        int iters = (int)(seconds * 1e3 / burst[0]) + 1;
        o->ours = false;
        run_ms(run_own, o, (int)(1e3 / burst[0]) + 1); /* a second to reach the cap */
        for (int k = 0; k < 3; k++) {
            o->ours = k == 1;
            sus[k] = run_ms(run_own, o, iters) / iters;
        }
    }
    printf("own %s: bursts cuBLAS%s %.3f ms (%.1f TFLOP/s), ours %.3f ms (%.1f): %.3fx", name,
           o->swiglu ? " + swiglu" : "", burst[0], flop / burst[0] / 1e9, burst[1],
           flop / burst[1] / 1e9, burst[0] / burst[1]);
    if (seconds > 0)
        printf("; sustained %.1f s each: cuBLAS %.1f, ours %.1f, cuBLAS again %.1f TFLOP/s: %.3fx",
               seconds, flop / sus[0] / 1e9, flop / sus[1] / 1e9, flop / sus[2] / 1e9,
               (sus[0] + sus[2]) / 2 / sus[1]);
    printf("\n");
    fflush(stdout);
}

/* Each shape of spec ("M,N,K[,acc];...") with cuBLASLt's first choice, median of rounds. */
static void shapes(const char *spec, int rounds, double algo_s, double own_s)
{
    const char *p = spec;
    while (*p) {
        long long M = 0, N = 0, K = 0;
        int used = 0;
        if (sscanf(p, "%lld,%lld,%lld%n", &M, &N, &K, &used) != 3 || M < 1 || N < 1 || K < 1 ||
            M * K > (1LL << 31) || N * K > (1LL << 31) || M * N > (1LL << 31)) {
            fprintf(stderr, "bench-ceiling: --shapes: cannot read a shape M,N,K at '%s'\n", p);
            exit(2);
        }
        p += used;
        bool acc = strncmp(p, ",acc", 4) == 0, swiglu = strncmp(p, ",swiglu", 7) == 0;
        if (acc)
            p += 4;
        if (swiglu)
            p += 7;
        if (*p == ';')
            p++;
        else if (*p) {
            fprintf(stderr, "bench-ceiling: --shapes: unexpected '%s'\n", p);
            exit(2);
        }
        void *a = dalloc((size_t)(M * K) * 2), *b = dalloc((size_t)(N * K) * 2), *c = dalloc((size_t)(M * N) * 2);
        fill_bf16(a, (size_t)(M * K), 1, 1);
        fill_bf16(b, (size_t)(N * K), 1, 2);
        fill_bf16(c, (size_t)(M * N), 1, 3);
        dfl_mm m = {.M = M, .N = N, .K = K, .A = a, .adt = DFL_BF16, .lda = K, .B = b, .bdt = DFL_BF16,
                    .ldb = K, .tb = true, .C = c, .cdt = DFL_BF16, .ldc = N, .alpha = 1, .beta = acc ? 1.0f : 0.0f};
        double t = median_ms(run_mm_or_die, &m, 10, rounds);
        char name[96];
        snprintf(name, sizeof name, "%lldx%lldx%lld%s", M, N, K, acc ? " +C" : swiglu ? " swiglu" : "");
        printf("gemm %s bf16: %.3f ms, %.1f TFLOP/s\n", name, t, 2.0 * M * N * K / t / 1e9);
        if (algo_s > 0)
            algos(&m, algo_s);
        if (own_s >= 0) {
            struct own o = {.m = m, .swiglu = swiglu};
            if (swiglu && (N % 2 || !(o.out = dalloc((size_t)(M * (N / 2)) * 2))))
                die("--shapes: swiglu needs an even N", NULL);
            if (!dfl_cuda_gemm_tma_fits(be, swiglu ? o.out : c, swiglu ? N / 2 : N, a, K, b, K, M, N, K,
                                        swiglu ? DFL_CUDA_GEMM_SWIGLU : acc ? DFL_CUDA_GEMM_ACC : DFL_CUDA_GEMM_STORE))
                printf("own %s: not taken by the TMA GEMM (not a Hopper GPU, or the shape)\n", name);
            else
                own_bench(&o, name, rounds, own_s);
            if (o.out)
                be->ops->free(be, o.out);
        }
        be->ops->free(be, a);
        be->ops->free(be, b);
        be->ops->free(be, c);
    }
}

int main(int argc, char **argv)
{
    bool quick = false;
    double sus = 0, algo_s = 0, own_s = -1;
    const char *shape_spec = NULL;
    for (int i = 1; i < argc; i++) {
        if (!strcmp(argv[i], "--quick"))
            quick = true;
        else if (!strcmp(argv[i], "--sustained") && i + 1 < argc)
            sus = atof(argv[++i]);
        else if (!strcmp(argv[i], "--algos") && i + 1 < argc)
            algo_s = atof(argv[++i]);
        else if (!strcmp(argv[i], "--own") && i + 1 < argc)
            own_s = atof(argv[++i]);
        else if (!strcmp(argv[i], "--shapes") && i + 1 < argc)
            shape_spec = argv[++i];
        else {
            fprintf(stderr, "usage: bench-ceiling [--quick] [--sustained S] [--algos S] [--own S] [--shapes M,N,K[,acc|,swiglu][;...]]\n");
            return 2;
        }
    }
    int rounds = quick ? 3 : 7;
    dfl_progname = BENCH_NAME;
    if (algo_s > 0)
        dfl_log_level = DFL_LOG_VERBOSE;   /* the tune's description of its choice */
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
    if (sus > 0)
        sustained(&m, flop, sus);
    if (shape_spec)
        shapes(shape_spec, rounds, algo_s, own_s);
    else if (algo_s > 0)
        algos(&m, algo_s);
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
