/* gpu-dist.c: the NCCL path of the data-parallel communicator (lib/train/dist.c) on real GPUs:
 *  - world size 1 through NCCL on one GPU (what a single-GPU dfl-draft with nccl runs): the
 *    all-reduce of device buffers is the identity, enqueued on the compute stream;
 *  - two ranks on two GPUs (forked processes, a rendezvous file): f32 and f64 device buffers
 *    summed exactly (a sum of two values is one rounding whatever the order), bigger than one
 *    NCCL chunk, then barrier and a clean finish;
 *  - a rank that dies after joining: the other's all-reduce waits on the GPU for it, and the
 *    watchdog must abort NCCL so that the stream completes and the error names the dead rank.
 * The CUDA runtime is used only in child processes (a process that forks must not have
 * initialized CUDA). Without CUDA, a GPU, or two GPUs, the cases skip (exit 77 when all do). */
#include <signal.h>
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/wait.h>
#include <unistd.h>

#include "backend.h"
#include "dist.h"
#include "util.h"
#include "../unit/t.h"

#ifdef DFL_CUDA
#include "../../kernels/cuda.h"

static int g_gpus;
static char g_dir[256];

/* Runs fn(rank, world) in a child; returns its pid. */
static pid_t child(void (*fn)(int, int), int rank, int world)
{
    pid_t p = fork();
    if (p == 0) {
        t_case_failed_ = 0;
        fn(rank, world);
        _exit(t_case_failed_ ? 1 : 0);
    }
    return p;
}

static int wait_ok(pid_t p)
{
    int st;
    if (waitpid(p, &st, 0) != p)
        return 0;
    return WIFEXITED(st) && WEXITSTATUS(st) == 0;
}

static void count_gpus(int rank, int world)
{
    (void)rank;
    (void)world;
    int n = dfl_be_cuda_count();
    _exit(n < 0 ? 0 : n > 100 ? 100 : n);
}

static float v32(int r, int64_t i) { return (float)((i * 2654435761u) % 100003) * 1e-4f + 0.25f * (float)r; }
static double v64(int r, int64_t i) { return (double)(i % 977) / 977.0 - 0.5 * r; }

/* Opens cuda:rank and the communicator of this rank. */
static int setup(int rank, int world, const char *rdv, dfl_be **be, dfl_dist **d)
{
    dfl_err e = {0};
    char dev[16];
    snprintf(dev, sizeof dev, "cuda:%d", rank);
    dfl_dist_opts o = {.rank = rank, .world = world, .local_rank = rank, .rendezvous = rdv,
                       .timeout_s = 60, .device_comm_always = true};
    int rc = dfl_be_open(be, dev, DFL_DT_INVALID, &e);
    if (!rc)
        rc = dfl_dist_open(d, &o, &e);
    if (!rc)
        rc = dfl_dist_attach(*d, *be, &e);
    T_CHECK(rc == 0, "rank %d: %s", rank, e.msg);
    return rc;
}

/* allreduce of device buffers; checks the sum over world ranks of v32/v64 */
static void reduce_and_check(dfl_be *be, dfl_dist *d, int rank, int world, int64_t n)
{
    dfl_err e = {0};
    float *h = malloc((size_t)n * sizeof *h);
    double *h64 = malloc(1024 * sizeof *h64);
    for (int64_t i = 0; i < n; i++)
        h[i] = v32(rank, i);
    for (int64_t i = 0; i < 1024; i++)
        h64[i] = v64(rank, i);
    float *dx = be_alloc(be, (size_t)n * sizeof *dx, &e);
    double *dy = be_alloc(be, 1024 * sizeof *dy, &e);
    T_CHECK(dx && dy, "alloc: %s", e.msg);
    if (!dx || !dy)
        return;
    be->ops->upload(be, dx, h, (size_t)n * sizeof *h);
    be->ops->upload(be, dy, h64, 1024 * sizeof *h64);
    T_CHECK(dfl_dist_allreduce(d, dx, n, DFL_F32, &e) == 0, "allreduce f32: %s", e.msg);
    T_CHECK(dfl_dist_allreduce(d, dy, 1024, DFL_F64, &e) == 0, "allreduce f64: %s", e.msg);
    T_CHECK(be->ops->sync(be, &e) == 0, "sync: %s", e.msg);
    be->ops->download(be, h, dx, (size_t)n * sizeof *h);
    be->ops->download(be, h64, dy, 1024 * sizeof *h64);
    int64_t bad = 0;
    for (int64_t i = 0; i < n; i++) {
        float s = v32(0, i);
        for (int r = 1; r < world; r++)
            s += v32(r, i);
        if (memcmp(&s, &h[i], sizeof s) != 0 && bad++ < 3)
            fprintf(stderr, "    rank %d: f32[%lld] = %.9g, want %.9g\n", rank, (long long)i,
                    (double)h[i], (double)s);
    }
    for (int64_t i = 0; i < 1024; i++) {
        double s = v64(0, i);
        for (int r = 1; r < world; r++)
            s += v64(r, i);
        if (memcmp(&s, &h64[i], sizeof s) != 0 && bad++ < 3)
            fprintf(stderr, "    rank %d: f64[%lld] = %.17g, want %.17g\n", rank, (long long)i,
                    h64[i], s);
    }
    T_EQ_INT(bad, 0, "values off the exact sum");
    be->ops->free(be, dx);
    be->ops->free(be, dy);
    free(h);
    free(h64);
}

static void world1_rank(int rank, int world)
{
    dfl_be *be = NULL;
    dfl_dist *d = NULL;
    dfl_err e = {0};
    if (setup(rank, world, NULL, &be, &d) == 0) {
        T_CHECK(dfl_dist_uses_device_comm(d), "NCCL communicator of one rank");
        reduce_and_check(be, d, rank, world, 100003);
        T_CHECK(dfl_dist_finish(d, &e) == 0, "finish: %s", e.msg);
    }
    dfl_dist_close(d);
    dfl_be_close(be);
}

static void test_world_one_nccl(void)
{
    if (g_gpus < 1)
        T_SKIP("no CUDA GPU");
    T_CHECK(wait_ok(child(world1_rank, 0, 1)), "world size 1 through NCCL");
}

static char g_rdv[300];

static void two_rank(int rank, int world)
{
    dfl_be *be = NULL;
    dfl_dist *d = NULL;
    dfl_err e = {0};
    if (setup(rank, world, g_rdv, &be, &d) == 0) {
        T_CHECK(dfl_dist_uses_device_comm(d), "NCCL");
        reduce_and_check(be, d, rank, world, ((int64_t)1 << 22) + 3);
        T_CHECK(dfl_dist_barrier(d, &e) == 0, "barrier: %s", e.msg);
        T_CHECK(dfl_dist_finish(d, &e) == 0, "finish: %s", e.msg);
    }
    dfl_dist_close(d);
    dfl_be_close(be);
}

static void test_two_gpus(void)
{
    if (g_gpus < 2)
        T_SKIP("fewer than 2 GPUs");
    snprintf(g_rdv, sizeof g_rdv, "%s/two", g_dir);
    pid_t a = child(two_rank, 0, 2), b = child(two_rank, 1, 2);
    T_CHECK(wait_ok(a), "rank 0");
    T_CHECK(wait_ok(b), "rank 1");
}

static void dying_rank(int rank, int world)
{
    dfl_be *be = NULL;
    dfl_dist *d = NULL;
    dfl_err e = {0};
    if (setup(rank, world, g_rdv, &be, &d) != 0)
        return;
    if (rank == 1)
        _exit(3);   /* joined NCCL, then gone */
    float *dx = be_alloc(be, 1 << 20, &e);
    T_CHECK(dx != NULL, "%s", e.msg);
    be->ops->memset0(be, dx, 1 << 20);
    double t0 = dfl_now();
    int rc = dfl_dist_allreduce(d, dx, (1 << 20) / 4, DFL_F32, &e);   /* may be enqueued fine */
    dfl_err se = {0};
    dfl_cuda_stream_sync(be, dfl_cuda_compute_stream(be), &se);   /* must not wait forever */
    double dt = dfl_now() - t0;
    if (!rc)
        rc = dfl_dist_check(d, &e);
    for (int i = 0; !rc && i < 50; i++) {   /* the watchdog polls every 0.1 s */
        usleep(100000);
        rc = dfl_dist_check(d, &e);
    }
    T_CHECK(rc != 0, "the dead rank is reported");
    T_CHECK(strstr(e.msg, "rank 1"), "names rank 1: %s", e.msg);
    T_CHECK(dt < 30, "the stream completes after the abort (%.1f s)", dt);
    fprintf(stderr, "  # rank 0: %s (%.1f s)\n", e.msg, dt);
    dfl_dist_close(d);
    dfl_be_close(be);
}

static void test_dead_rank(void)
{
    if (g_gpus < 2)
        T_SKIP("fewer than 2 GPUs");
    snprintf(g_rdv, sizeof g_rdv, "%s/dead", g_dir);
    pid_t a = child(dying_rank, 0, 2), b = child(dying_rank, 1, 2);
    T_CHECK(wait_ok(a), "rank 0 reports the dead rank");
    int st;
    waitpid(b, &st, 0);
    T_CHECK(WIFEXITED(st) && WEXITSTATUS(st) == 3, "rank 1 died as planned");
}

int main(int argc, char **argv)
{
    (void)argc;
    t_init(argv[0]);
    signal(SIGPIPE, SIG_IGN);
    alarm(300);   /* a hang is a failure */
    int st;
    pid_t p = child(count_gpus, 0, 1);
    g_gpus = waitpid(p, &st, 0) == p && WIFEXITED(st) ? WEXITSTATUS(st) : 0;
    snprintf(g_dir, sizeof g_dir, "/tmp/gpu-dist.XXXXXX");
    if (!mkdtemp(g_dir))
        return 1;
    T_RUN(test_world_one_nccl);
    T_RUN(test_two_gpus);
    T_RUN(test_dead_rank);
    rmdir(g_dir);
    return t_done();
}

#else

static void test_no_cuda(void) { T_SKIP("no CUDA GPU (built without CUDA)"); }

int main(int argc, char **argv)
{
    (void)argc;
    t_init(argv[0]);
    T_RUN(test_no_cuda);
    return t_done();
}
#endif
