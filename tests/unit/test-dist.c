/* test-dist.c: the socket transport of the data-parallel communicator (lib/train/dist.c), with ranks
 * as forked processes on this machine: all-reduce sums exact and in rank order (f32 and f64,
 * buffers larger than the hub's chunk), barrier, broadcast, all-gather, gather, host sums, the
 * tcp:// and file rendezvous (including a stale file from an earlier run), and the failures: a
 * rank that dies, ranks that call different collectives, a world-size mismatch, rendezvous
 * timeouts on either side, and the launcher variables. Each child process checks its own
 * results and exits 0 (ok) or 1; the parent, rank 0, checks the children's statuses. */
#include <arpa/inet.h>
#include <netinet/in.h>
#include <signal.h>
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/socket.h>
#include <sys/wait.h>
#include <unistd.h>

#include "dist.h"
#include "util.h"
#include "t.h"

static char g_dir[256];

typedef void (*rank_fn)(dfl_dist *d, int rank);

static void rdv_path(char *buf, size_t n, const char *name)
{
    snprintf(buf, n, "%s/%s", g_dir, name);
}

static int open_rank(dfl_dist **d, int rank, int world, const char *rdv, double timeout, dfl_err *e)
{
    dfl_dist_opts o = {.rank = rank, .world = world, .local_rank = rank, .rendezvous = rdv,
                       .timeout_s = timeout};
    return dfl_dist_open(d, &o, e);
}

/* Runs fn on world ranks: 1..world-1 forked, 0 here. Returns how many children failed. */
static int run_world(int world, const char *rdv, rank_fn fn)
{
    pid_t kids[16];
    for (int r = 1; r < world; r++) {
        kids[r] = fork();
        if (kids[r] == 0) {
            dfl_dist *d;
            dfl_err e = {0};
            t_case_failed_ = 0;
            if (open_rank(&d, r, world, rdv, 10, &e)) {
                fprintf(stderr, "  rank %d: %s\n", r, e.msg);
                _exit(1);
            }
            fn(d, r);
            if (dfl_dist_finish(d, &e))
                fprintf(stderr, "  rank %d: finish: %s\n", r, e.msg), t_case_failed_ = 1;
            dfl_dist_close(d);
            _exit(t_case_failed_ ? 1 : 0);
        }
    }
    dfl_dist *d;
    dfl_err e = {0};
    int bad = 0;
    if (open_rank(&d, 0, world, rdv, 10, &e)) {
        fprintf(stderr, "  rank 0: %s\n", e.msg);
        bad++;
    } else {
        fn(d, 0);
        if (dfl_dist_finish(d, &e))
            fprintf(stderr, "  rank 0: finish: %s\n", e.msg), bad++;
        dfl_dist_close(d);
    }
    for (int r = 1; r < world; r++) {
        int st;
        waitpid(kids[r], &st, 0);
        if (!WIFEXITED(st) || WEXITSTATUS(st) != 0)
            bad++;
    }
    return bad;
}

/* ---- collectives --------------------------------------------------------------------------- */

#define BIG (1536 * 1024 + 7)   /* f32 values: more than the hub's 4 MiB chunk */

static float val32(int r, int64_t i) { return (float)((i * 2654435761u) % 1000003) * 1e-3f / (float)(r + 1) + (float)r; }
static double val64(int r, int64_t i) { return sin((double)i * 0.37 + r) / (r + 1.5); }

static void allreduce_ranks(dfl_dist *d, int rank)
{
    int W = dfl_dist_size(d);
    dfl_err e = {0};
    float *x = malloc(BIG * sizeof *x);
    double *y = malloc(1000 * sizeof *y);
    for (int64_t i = 0; i < BIG; i++)
        x[i] = val32(rank, i);
    for (int64_t i = 0; i < 1000; i++)
        y[i] = val64(rank, i);
    int rc = dfl_dist_allreduce(d, x, BIG, DFL_F32, &e);
    T_CHECK(rc == 0, "%s", e.msg);
    rc = dfl_dist_allreduce(d, y, 1000, DFL_F64, &e);
    T_CHECK(rc == 0, "%s", e.msg);
    int64_t bad = 0;
    for (int64_t i = 0; i < BIG; i++) {   /* rank order: ((x0 + x1) + x2) + ... bit for bit */
        float s = val32(0, i);
        for (int r = 1; r < W; r++)
            s += val32(r, i);
        bad += memcmp(&s, &x[i], sizeof s) != 0;
    }
    for (int64_t i = 0; i < 1000; i++) {
        double s = val64(0, i);
        for (int r = 1; r < W; r++)
            s += val64(r, i);
        bad += memcmp(&s, &y[i], sizeof s) != 0;
    }
    T_EQ_INT(bad, 0, "values that differ from the rank-order sum");
    rc = dfl_dist_allreduce(d, x, 0, DFL_F32, &e);   /* empty: still a matched call */
    T_CHECK(rc == 0, "%s", e.msg);
    T_CHECK(dfl_dist_allreduce(d, x, 1, DFL_BF16, &e) == DFL_EUSAGE, "bf16 refused");
    free(x);
    free(y);
}

static void test_allreduce_exact(void)
{
    char p[300];
    rdv_path(p, sizeof p, "ar");
    T_EQ_INT(run_world(3, p, allreduce_ranks), 0, "ranks that failed");
}

static void misc_ranks(dfl_dist *d, int rank)
{
    int W = dfl_dist_size(d);
    dfl_err e = {0};
    T_EQ_INT(dfl_dist_rank(d), rank, "rank");
    T_CHECK(dfl_dist_barrier(d, &e) == 0, "barrier: %s", e.msg);
    char msg[32] = "";
    if (rank == 0)
        snprintf(msg, sizeof msg, "hello from zero");
    T_CHECK(dfl_dist_bcast(d, msg, sizeof msg, &e) == 0, "bcast: %s", e.msg);
    T_CHECK(strcmp(msg, "hello from zero") == 0, "bcast gave '%s'", msg);
    int64_t mine = 100 + rank, all[8] = {0};
    T_CHECK(dfl_dist_allgather(d, &mine, sizeof mine, all, &e) == 0, "allgather: %s", e.msg);
    for (int r = 0; r < W; r++)
        T_EQ_INT(all[r], 100 + r, "allgather entry");
    char text[64];
    int n = snprintf(text, sizeof text, "rank %d says %s", rank, rank == 2 ? "more words" : "hi");
    void **parts;
    size_t *lens;
    T_CHECK(dfl_dist_gather(d, text, (size_t)n, &parts, &lens, &e) == 0, "gather: %s", e.msg);
    if (rank == 0 && parts) {
        for (int r = 0; r < W; r++) {
            char want[64];
            int k = snprintf(want, sizeof want, "rank %d says %s", r, r == 2 ? "more words" : "hi");
            T_CHECK(lens[r] == (size_t)k && memcmp(parts[r], want, (size_t)k) == 0, "gather part %d", r);
            free(parts[r]);
        }
        free(parts);
        free(lens);
    } else {
        T_CHECK(rank != 0 || parts, "rank 0 got the parts");
        T_CHECK(rank == 0 || !parts, "only rank 0 gets parts");
    }
    double v[3] = {1, rank, 0.5};
    T_CHECK(dfl_dist_sum_host(d, v, 3, &e) == 0, "sum_host: %s", e.msg);
    T_NEAR(v[0], W, 0, "sum of ones");
    T_NEAR(v[1], W * (W - 1) / 2, 0, "sum of ranks");
    T_CHECK(dfl_dist_barrier(d, &e) == 0, "barrier: %s", e.msg);
}

static void test_collectives(void)
{
    char p[300];
    rdv_path(p, sizeof p, "misc");
    T_EQ_INT(run_world(4, p, misc_ranks), 0, "ranks that failed");
    T_CHECK(access(p, F_OK) != 0, "rank 0 removes the rendezvous file once everyone joined");
}

static int free_port(void)
{
    int s = socket(AF_INET, SOCK_STREAM, 0);
    struct sockaddr_in sa = {.sin_family = AF_INET, .sin_addr.s_addr = htonl(INADDR_LOOPBACK)};
    socklen_t sl = sizeof sa;
    if (bind(s, (struct sockaddr *)&sa, sizeof sa) != 0 || getsockname(s, (struct sockaddr *)&sa, &sl) != 0) {
        close(s);
        return 0;
    }
    close(s);
    return ntohs(sa.sin_port);
}

static void test_tcp(void)
{
    int port = free_port();
    if (!port)
        T_SKIP("no free TCP port");
    char rdv[64];
    snprintf(rdv, sizeof rdv, "tcp://127.0.0.1:%d", port);
    T_EQ_INT(run_world(2, rdv, misc_ranks), 0, "ranks that failed");
    dfl_dist *d;
    dfl_err e = {0};
    T_EQ_INT(open_rank(&d, 0, 2, "tcp://nohost", 1, &e), DFL_EUSAGE, "no port");
    T_CHECK(strstr(e.msg, "tcp://HOST:PORT"), "%s", e.msg);
    T_EQ_INT(open_rank(&d, 0, 2, NULL, 1, &e), DFL_EUSAGE, "no rendezvous");
    T_CHECK(strstr(e.msg, "--rendezvous"), "%s", e.msg);
}

static void test_stale_file(void)
{
    /* an earlier run's file: a dead port, a wrong nonce; the ranks must still meet */
    char p[300];
    rdv_path(p, sizeof p, "stale");
    FILE *f = fopen(p, "w");
    fprintf(f, "dfl-rendezvous-1 localhost %d 0123456789abcdef 2\n", free_port());
    fclose(f);
    T_EQ_INT(run_world(2, p, misc_ranks), 0, "ranks that failed");
}

static void test_world_one(void)
{
    dfl_dist *d;
    dfl_err e = {0};
    T_CHECK(open_rank(&d, 0, 1, NULL, 1, &e) == 0, "%s", e.msg);
    float x[3] = {1, 2, 3};
    T_CHECK(dfl_dist_allreduce(d, x, 3, DFL_F32, &e) == 0, "%s", e.msg);
    T_CHECK(x[0] == 1 && x[1] == 2 && x[2] == 3, "identity");
    T_CHECK(dfl_dist_barrier(d, &e) == 0, "%s", e.msg);
    T_CHECK(!dfl_dist_uses_device_comm(d), "no NCCL without a CUDA backend");
    T_CHECK(dfl_dist_finish(d, &e) == 0, "%s", e.msg);
    dfl_dist_close(d);
}

/* ---- failures ------------------------------------------------------------------------------ */

static void dying_ranks(dfl_dist *d, int rank)
{
    dfl_err e = {0};
    float x[4] = {1, 2, 3, 4};
    if (rank == 2)
        _exit(3);   /* dies without a word */
    double t0 = dfl_now();
    int rc = dfl_dist_allreduce(d, x, 4, DFL_F32, &e);
    T_CHECK(rc == DFL_EIO, "allreduce with a dead rank: rc %d", rc);
    T_CHECK(strstr(e.msg, "rank 2"), "the message names the dead rank: %s", e.msg);
    T_CHECK(dfl_now() - t0 < 5, "fails promptly (%.1f s)", dfl_now() - t0);
    /* the error is latched: later calls fail at once with it */
    dfl_err e2 = {0};
    T_CHECK(dfl_dist_barrier(d, &e2) == rc && strcmp(e.msg, e2.msg) == 0, "latched: %s", e2.msg);
    T_CHECK(dfl_dist_check(d, NULL) == rc, "check");
    if (rank == 0)
        fprintf(stderr, "  # rank 0: %s\n", e.msg);
    else
        fprintf(stderr, "  # rank 1: %s\n", e.msg);
    dfl_dist_close(d);
    if (rank != 0)
        _exit(t_case_failed_ ? 1 : 0);
}

/* Forks rank `rank` of world at rdv: the child opens it, runs fn (which may exit itself), closes
 * it and exits 0, or 1 when a check failed or the rank did not open. Returns the child's pid. */
static pid_t spawn_rank(int rank, int world, const char *rdv, rank_fn fn)
{
    pid_t k = fork();
    if (k == 0) {
        dfl_dist *d;
        dfl_err e = {0};
        t_case_failed_ = 0;
        if (open_rank(&d, rank, world, rdv, 10, &e))
            _exit(1);
        fn(d, rank);
        dfl_dist_close(d);
        _exit(t_case_failed_ ? 1 : 0);
    }
    return k;
}

static void test_dead_rank(void)
{
    char p[300];
    rdv_path(p, sizeof p, "dead");
    pid_t k1 = spawn_rank(1, 3, p, dying_ranks); /* dying_ranks exits the process itself */
    pid_t k2 = spawn_rank(2, 3, p, dying_ranks);
    dfl_dist *d;
    dfl_err e = {0};
    T_CHECK(open_rank(&d, 0, 3, p, 10, &e) == 0, "%s", e.msg);
    if (d)
        dying_ranks(d, 0);
    int st;
    waitpid(k1, &st, 0);
    T_CHECK(WIFEXITED(st) && WEXITSTATUS(st) == 0, "rank 1 saw the failure");
    waitpid(k2, &st, 0);
    T_CHECK(WIFEXITED(st) && WEXITSTATUS(st) == 3, "rank 2 died");
}

static void disagree_ranks(dfl_dist *d, int rank)
{
    dfl_err e = {0};
    char buf[8] = "";
    int rc = rank == 0 ? dfl_dist_barrier(d, &e) : dfl_dist_bcast(d, buf, sizeof buf, &e);
    T_CHECK(rc != 0, "mismatched collectives fail");
    T_CHECK(strstr(e.msg, "disagree") || strstr(e.msg, "gave up"), "%s", e.msg);
    T_CHECK(dfl_dist_finish(d, &e) != 0, "finish after a failure fails");
}

static void test_disagree(void)
{
    char p[300];
    rdv_path(p, sizeof p, "disagree");
    /* run_world's finish fails on every rank: count failures instead */
    pid_t k = spawn_rank(1, 2, p, disagree_ranks);
    dfl_dist *d;
    dfl_err e = {0};
    T_CHECK(open_rank(&d, 0, 2, p, 10, &e) == 0, "%s", e.msg);
    if (d) {
        disagree_ranks(d, 0);
        dfl_dist_close(d);
    }
    int st;
    waitpid(k, &st, 0);
    T_CHECK(WIFEXITED(st) && WEXITSTATUS(st) == 0, "rank 1 saw the mismatch");
}

static void test_world_mismatch(void)
{
    char p[300];
    rdv_path(p, sizeof p, "mismatch");
    pid_t k = fork();
    if (k == 0) {
        dfl_dist *d;
        dfl_err e = {0};
        int rc = open_rank(&d, 1, 3, p, 2, &e);
        _exit(rc != 0 && strstr(e.msg, "world") ? 0 : 1);
    }
    /* rank 0 of 2 ignores a file of another world size: rank 1 (of 3) cannot read it as its
     * own, so it times out on its side; rank 0 times out too */
    dfl_dist *d;
    dfl_err e = {0};
    int rc = open_rank(&d, 0, 2, p, 1.5, &e);
    T_CHECK(rc != 0, "rank 0 alone");
    int st;
    waitpid(k, &st, 0);
    T_CHECK(WIFEXITED(st) && WEXITSTATUS(st) == 0, "rank 1 says the world sizes differ");

    /* over tcp the hub sees the mismatch and both fail with it */
    int port = free_port();
    char rdv[64];
    snprintf(rdv, sizeof rdv, "tcp://127.0.0.1:%d", port);
    k = fork();
    if (k == 0) {
        dfl_dist *d1;
        dfl_err e1 = {0};
        int r1 = open_rank(&d1, 1, 3, rdv, 5, &e1);
        _exit(r1 != 0 && strstr(e1.msg, "world size 3") ? 0 : 1);
    }
    rc = open_rank(&d, 0, 2, rdv, 5, &e);
    T_CHECK(rc == DFL_EUSAGE && strstr(e.msg, "rank 1 has world size 3, rank 0 has 2"), "%s", e.msg);
    waitpid(k, &st, 0);
    T_CHECK(WIFEXITED(st) && WEXITSTATUS(st) == 0, "rank 1 is told why");
}

static void test_timeouts(void)
{
    char p[300];
    rdv_path(p, sizeof p, "lonely");
    dfl_dist *d;
    dfl_err e = {0};
    double t0 = dfl_now();
    int rc = open_rank(&d, 0, 3, p, 0.5, &e);
    T_EQ_INT(rc, DFL_EIO, "rank 0 alone");
    T_CHECK(strstr(e.msg, "only 1 of 3 ranks joined") && strstr(e.msg, "missing: ranks 1, 2") &&
            strstr(e.msg, p), "%s", e.msg);
    T_CHECK(dfl_now() - t0 < 3, "within the timeout");
    T_CHECK(access(p, F_OK) != 0, "no rendezvous file left");
    t0 = dfl_now();
    rc = open_rank(&d, 1, 2, p, 0.5, &e);
    T_EQ_INT(rc, DFL_EIO, "rank 1 alone");
    T_CHECK(strstr(e.msg, "rank 1 of 2") && strstr(e.msg, "does not exist"), "%s", e.msg);
    T_CHECK(dfl_now() - t0 < 3, "within the timeout");
    int port = free_port();
    char rdv[64];
    snprintf(rdv, sizeof rdv, "tcp://127.0.0.1:%d", port);
    rc = open_rank(&d, 1, 2, rdv, 0.5, &e);
    T_EQ_INT(rc, DFL_EIO, "rank 1 alone over tcp");
    T_CHECK(strstr(e.msg, "cannot connect to rank 0 at 127.0.0.1:"), "%s", e.msg);
}

static void test_env(void)
{
    dfl_dist_env v;
    dfl_err e = {0};
    const char *vars[] = {"RANK", "WORLD_SIZE", "LOCAL_RANK", "SLURM_PROCID", "SLURM_NTASKS",
                          "SLURM_LOCALID"};
    for (size_t i = 0; i < 6; i++)
        unsetenv(vars[i]);
    T_CHECK(dfl_dist_env_get(&v, &e) == 0 && v.rank == 0 && v.world == 1, "none");
    setenv("SLURM_PROCID", "5", 1);
    setenv("SLURM_NTASKS", "8", 1);
    setenv("SLURM_LOCALID", "1", 1);
    T_CHECK(dfl_dist_env_get(&v, &e) == 0 && v.rank == 5 && v.world == 8 && v.local_rank == 1 &&
            strcmp(v.from, "SLURM") == 0, "slurm");
    setenv("RANK", "2", 1);
    setenv("WORLD_SIZE", "4", 1);
    T_CHECK(dfl_dist_env_get(&v, &e) == 0 && v.rank == 2 && v.world == 4 && v.local_rank == 2,
            "torchrun variables win; LOCAL_RANK defaults to RANK");
    setenv("LOCAL_RANK", "0", 1);
    T_CHECK(dfl_dist_env_get(&v, &e) == 0 && v.local_rank == 0, "LOCAL_RANK");
    setenv("RANK", "4", 1);
    T_EQ_INT(dfl_dist_env_get(&v, &e), DFL_EUSAGE, "rank >= world");
    T_CHECK(strstr(e.msg, "rank 4 is not below the world size 4"), "%s", e.msg);
    setenv("RANK", "x", 1);
    T_EQ_INT(dfl_dist_env_get(&v, &e), DFL_EUSAGE, "not a number");
    T_CHECK(strstr(e.msg, "RANK='x'"), "%s", e.msg);
    unsetenv("WORLD_SIZE");
    T_EQ_INT(dfl_dist_env_get(&v, &e), DFL_EUSAGE, "RANK alone");
    for (size_t i = 0; i < 6; i++)
        unsetenv(vars[i]);
}

int main(int argc, char **argv)
{
    (void)argc;
    t_init(argv[0]);
    signal(SIGPIPE, SIG_IGN);
    alarm(120);   /* a hang is a failure */
    snprintf(g_dir, sizeof g_dir, "/tmp/test-dist.XXXXXX");
    if (!mkdtemp(g_dir)) {
        perror("mkdtemp");
        return 1;
    }
    T_RUN(test_env);
    T_RUN(test_world_one);
    T_RUN(test_allreduce_exact);
    T_RUN(test_collectives);
    T_RUN(test_tcp);
    T_RUN(test_stale_file);
    T_RUN(test_dead_rank);
    T_RUN(test_disagree);
    T_RUN(test_world_mismatch);
    T_RUN(test_timeouts);
    char cmd[300];
    snprintf(cmd, sizeof cmd, "rm -rf %s", g_dir);
    if (system(cmd) != 0)
        fprintf(stderr, "cannot remove %s\n", g_dir);
    return t_done();
}
