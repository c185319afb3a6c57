/* dist.c: the data-parallel communicator (see dist.h): launcher variables, the rendezvous, the
 * socket star around rank 0 that carries the host collectives, and the backend's device
 * communicator with its watchdog for device buffers.
 *
 * Wire format (little-endian, every message): a 16-byte header u32 op, u32 seq, u64 bytes, then
 * the bytes. seq counts the collectives of this communicator; the hub checks that every rank's
 * op, seq and (for fixed-size ops) length match its own. */
#include "dist.h"

#include <arpa/inet.h>
#include <errno.h>
#include <fcntl.h>
#include <netdb.h>
#include <netinet/in.h>
#include <netinet/tcp.h>
#include <poll.h>
#include <pthread.h>
#include <stdarg.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/socket.h>
#include <time.h>
#include <unistd.h>

#include "bytes.h"
#include "util.h"


enum {
    OP_HELLO = 1, OP_WELCOME, OP_ABORT, OP_ALLREDUCE_F32, OP_ALLREDUCE_F64, OP_BARRIER, OP_BCAST,
    OP_ALLGATHER, OP_GATHER, OP_FINISH, OP_ID,
};

static const char *op_name(uint32_t op)
{
    static const char *names[] = {"?", "hello", "welcome", "abort", "allreduce(f32)",
                                  "allreduce(f64)", "barrier", "broadcast", "allgather", "gather",
                                  "finish", "comm-id"};
    return op < sizeof names / sizeof *names ? names[op] : "?";
}

#define HDR 16
#define MAGIC "dfl-rendezvous-1"
#define CHUNK ((size_t)4 << 20)

struct dfl_dist {
    int rank, world, local_rank;
    int *fd;                     /* hub: fd[r] for r = 1..world-1; others: fd[0] = the hub */
    char where[300];             /* the rendezvous, for messages */
    uint32_t seq;
    bool finished;
    pthread_mutex_t mu;          /* err, broken, the device communicator */
    bool broken;
    dfl_err err;                 /* latched */
    void *scratch;               /* CHUNK bytes (hub) */
    dfl_be *be;
    /* the backend's device communicator, when it has one and it is used */
    dfl_be_comm comm;
    bool comm_wanted;
    pthread_t wd;
    bool wd_running;
    pthread_cond_t wd_cv;
    bool wd_stop;
};

/* ---- little helpers ------------------------------------------------------------------------ */

/* Latches the first error of the communicator (every later call returns it) and fills e. */
static int latch(dfl_dist *d, dfl_err *e, int code, const char *fmt, ...)
    __attribute__((format(printf, 4, 5)));
static int latch(dfl_dist *d, dfl_err *e, int code, const char *fmt, ...)
{
    char msg[900];
    va_list ap;
    va_start(ap, fmt);
    vsnprintf(msg, sizeof msg, fmt, ap);
    va_end(ap);
    pthread_mutex_lock(&d->mu);
    if (!d->broken) {
        d->broken = true;
        dfl_fail(&d->err, code, "rank %d of %d: %s", d->rank, d->world, msg);
    }
    dfl_err copy = d->err;
    pthread_mutex_unlock(&d->mu);
    if (e)
        *e = copy;
    return copy.code;
}

int dfl_dist_check(dfl_dist *d, dfl_err *e)
{
    if (!d)
        return DFL_OK;
    pthread_mutex_lock(&d->mu);
    int rc = d->broken ? d->err.code : DFL_OK;
    if (rc && e)
        *e = d->err;
    pthread_mutex_unlock(&d->mu);
    return rc;
}

static void sock_opts(int fd)
{
    int one = 1, idle = 30, intvl = 5, cnt = 4;
    setsockopt(fd, IPPROTO_TCP, TCP_NODELAY, &one, sizeof one);
    setsockopt(fd, SOL_SOCKET, SO_KEEPALIVE, &one, sizeof one);
    setsockopt(fd, IPPROTO_TCP, TCP_KEEPIDLE, &idle, sizeof idle);
    setsockopt(fd, IPPROTO_TCP, TCP_KEEPINTVL, &intvl, sizeof intvl);
    setsockopt(fd, IPPROTO_TCP, TCP_KEEPCNT, &cnt, sizeof cnt);
}

static const char *peer_str(const dfl_dist *d, int peer, char *buf, size_t n)
{
    snprintf(buf, n, "rank %d", peer);
    (void)d;
    return buf;
}

/* fd index of a peer: the hub talks to rank r on fd[r], the others to the hub on fd[0]. */
static int peer_fd(const dfl_dist *d, int peer) { return d->rank == 0 ? d->fd[peer] : d->fd[0]; }

/* All n bytes to (send) or from (!send) a peer, retrying on EINTR and short counts. */
static int xfer_all(dfl_dist *d, int peer, void *buf, size_t n, bool send_, const char *during, dfl_err *e)
{
    char *p = buf;
    while (n > 0) {
        ssize_t k = send_ ? send(peer_fd(d, peer), p, n, MSG_NOSIGNAL) : recv(peer_fd(d, peer), p, n, 0);
        if (k < 0 && errno == EINTR)
            continue;
        if (k <= 0) {
            char who[32];
            if (send_)
                return latch(d, e, DFL_EIO, "lost the connection to %s during %s (%s): it exited or "
                             "failed (see its messages)", peer_str(d, peer, who, sizeof who), during,
                             strerror(errno));
            return latch(d, e, DFL_EIO, "%s closed its connection during %s%s%s: it exited or "
                         "failed (see its messages)", peer_str(d, peer, who, sizeof who), during,
                         k < 0 ? ": " : "", k < 0 ? strerror(errno) : "");
        }
        p += k;
        n -= (size_t)k;
    }
    return DFL_OK;
}

static int send_all(dfl_dist *d, int peer, const void *buf, size_t n, const char *during, dfl_err *e)
{
    return xfer_all(d, peer, (void *)buf, n, true, during, e);
}

static int recv_all(dfl_dist *d, int peer, void *buf, size_t n, const char *during, dfl_err *e)
{
    return xfer_all(d, peer, buf, n, false, during, e);
}

static int send_msg(dfl_dist *d, int peer, uint32_t op, const void *buf, size_t n, dfl_err *e)
{
    uint8_t h[HDR];
    dfl_put_le32(h, op);
    dfl_put_le32(h + 4, d->seq);
    dfl_put_le64(h + 8, n);
    int rc = send_all(d, peer, h, HDR, op_name(op), e);
    if (!rc && n)
        rc = send_all(d, peer, buf, n, op_name(op), e);
    return rc;
}

/* Reads a header from peer and checks it against ours (want_n: the length, or UINT64_MAX for
 * any). An ABORT from the hub carries the hub's reason, which becomes this rank's error. */
static int recv_hdr(dfl_dist *d, int peer, uint32_t op, uint64_t want_n, uint64_t *n, dfl_err *e)
{
    uint8_t h[HDR];
    int rc = recv_all(d, peer, h, HDR, op_name(op), e);
    if (rc)
        return rc;
    uint32_t pop = dfl_get_le32(h), pseq = dfl_get_le32(h + 4);
    uint64_t pn = dfl_get_le64(h + 8);
    if (pop == OP_ABORT && pn < 4096) {
        char msg[4096];
        if ((rc = recv_all(d, peer, msg, (size_t)pn, op_name(op), e)))
            return rc;
        msg[pn] = 0;
        return latch(d, e, DFL_EIO, "rank %d gave up: %s", peer, msg);
    }
    if (pop != op || pseq != d->seq || (want_n != UINT64_MAX && pn != want_n))
        return latch(d, e, DFL_EUSAGE, "the ranks disagree: rank %d called %s #%u (%llu bytes) "
                     "while rank %d called %s #%u (%llu bytes)", peer, op_name(pop), pseq,
                     (unsigned long long)pn, d->rank, op_name(op), d->seq,
                     want_n == UINT64_MAX ? 0ull : (unsigned long long)want_n);
    *n = pn;
    return DFL_OK;
}

/* The hub tells every other rank why it gives up (best effort, never blocking). */
static void hub_abort_others(dfl_dist *d)
{
    if (d->rank != 0 || !d->fd)
        return;
    char msg[1024];
    pthread_mutex_lock(&d->mu);
    snprintf(msg, sizeof msg, "%s", d->err.msg);
    pthread_mutex_unlock(&d->mu);
    size_t n = strlen(msg);
    uint8_t h[HDR];
    dfl_put_le32(h, OP_ABORT);
    dfl_put_le32(h + 4, d->seq);
    dfl_put_le64(h + 8, n);
    for (int r = 1; r < d->world; r++)
        if (d->fd[r] >= 0 && send(d->fd[r], h, HDR, MSG_NOSIGNAL | MSG_DONTWAIT) == HDR)
            (void)!send(d->fd[r], msg, n, MSG_NOSIGNAL | MSG_DONTWAIT);
}

static int hub_fail(dfl_dist *d, int rc)
{
    if (rc)
        hub_abort_others(d);
    return rc;
}

/* ---- launcher variables -------------------------------------------------------------------- */

static int env_int(const char *name, int lo, int hi, int *out, dfl_err *e)
{
    const char *s = getenv(name);
    int64_t v;
    if (dfl_parse_i64(s, lo, hi, &v, name, e))
        return dfl_fail(e, DFL_EUSAGE, "environment variable %s='%s': expected a number from %d "
                        "to %d", name, s, lo, hi);
    *out = (int)v;
    return DFL_OK;
}

/* Rank, world size and local rank from one launcher's variables (local rank: the rank when its
 * variable is absent). */
static int env_ranks(dfl_dist_env *env, const char *world_var, const char *rank_var,
                     const char *local_var, const char *from, dfl_err *e)
{
    const int max = 1 << 20;
    int rc;
    if ((rc = env_int(world_var, 1, max, &env->world, e)) ||
        (rc = env_int(rank_var, 0, max, &env->rank, e)))
        return rc;
    env->local_rank = env->rank;
    if (getenv(local_var) && (rc = env_int(local_var, 0, max, &env->local_rank, e)))
        return rc;
    env->from = from;
    return DFL_OK;
}

int dfl_dist_env_get(dfl_dist_env *env, dfl_err *e)
{
    env->rank = 0;
    env->world = 1;
    env->local_rank = 0;
    env->from = "none";
    int rc = DFL_OK;
    if (getenv("WORLD_SIZE") || getenv("RANK")) {
        if (!getenv("WORLD_SIZE") || !getenv("RANK"))
            return dfl_fail(e, DFL_EUSAGE, "RANK and WORLD_SIZE must be set together (only %s is)",
                            getenv("RANK") ? "RANK" : "WORLD_SIZE");
        rc = env_ranks(env, "WORLD_SIZE", "RANK", "LOCAL_RANK", "RANK/WORLD_SIZE", e);
    } else if (getenv("SLURM_PROCID") && getenv("SLURM_NTASKS")) {
        rc = env_ranks(env, "SLURM_NTASKS", "SLURM_PROCID", "SLURM_LOCALID", "SLURM", e);
    }
    if (rc)
        return rc;
    if (env->rank >= env->world)
        return dfl_fail(e, DFL_EUSAGE, "rank %d is not below the world size %d (from %s)", env->rank,
                        env->world, env->from);
    return DFL_OK;
}

/* ---- rendezvous ---------------------------------------------------------------------------- */

typedef struct rdv {
    bool file;
    char path[4096];             /* file mode */
    char host[256];
    int port;                    /* tcp mode: given; file mode: rank 0's ephemeral port */
} rdv;

static int parse_rdv(const char *s, rdv *r, dfl_err *e)
{
    memset(r, 0, sizeof *r);
    if (strncmp(s, "tcp://", 6) == 0) {
        const char *hp = s + 6, *colon = strrchr(hp, ':');
        int64_t port;
        if (!colon || colon == hp || (size_t)(colon - hp) >= sizeof r->host)
            return dfl_fail(e, DFL_EUSAGE, "--rendezvous %s: expected tcp://HOST:PORT", s);
        if (dfl_parse_i64(colon + 1, 1, 65535, &port, "--rendezvous port", e))
            return dfl_fail(e, DFL_EUSAGE, "--rendezvous %s: the port must be 1 to 65535", s);
        memcpy(r->host, hp, (size_t)(colon - hp));
        r->port = (int)port;
        return DFL_OK;
    }
    if (!*s || strlen(s) >= sizeof r->path)
        return dfl_fail(e, DFL_EUSAGE, "--rendezvous '%s': expected a file path or tcp://HOST:PORT", s);
    r->file = true;
    snprintf(r->path, sizeof r->path, "%s", s);
    return DFL_OK;
}

static uint64_t make_nonce(void)
{
    uint64_t x = 0;
    int fd = open("/dev/urandom", O_RDONLY | O_CLOEXEC);
    if (fd >= 0) {
        if (read(fd, &x, sizeof x) != (ssize_t)sizeof x)
            x = 0;
        close(fd);
    }
    struct timespec ts;
    clock_gettime(CLOCK_REALTIME, &ts);
    return x ^ ((uint64_t)ts.tv_nsec << 20) ^ (uint64_t)ts.tv_sec ^ ((uint64_t)getpid() << 40);
}

/* Rank 0: listen, publish, accept world-1 ranks, welcome them. */
static int hub_open(dfl_dist *d, const rdv *rv, double timeout, dfl_err *e)
{
    int ls = socket(AF_INET, SOCK_STREAM | SOCK_CLOEXEC, 0);
    if (ls < 0)
        return latch(d, e, DFL_EIO, "socket: %s", strerror(errno));
    int one = 1, rc = DFL_OK;
    setsockopt(ls, SOL_SOCKET, SO_REUSEADDR, &one, sizeof one);
    struct sockaddr_in sa = {.sin_family = AF_INET, .sin_addr.s_addr = htonl(INADDR_ANY),
                             .sin_port = htons((uint16_t)(rv->file ? 0 : rv->port))};
    if (bind(ls, (struct sockaddr *)&sa, sizeof sa) != 0 || listen(ls, 128) != 0) {
        rc = latch(d, e, DFL_EIO, "cannot listen on TCP port %d for %s: %s", rv->file ? 0 : rv->port,
                   d->where, strerror(errno));
        close(ls);
        return rc;
    }
    uint64_t nonce = 0;
    if (rv->file) {
        socklen_t sl = sizeof sa;
        getsockname(ls, (struct sockaddr *)&sa, &sl);
        char host[256] = "localhost", line[512];
        if (gethostname(host, sizeof host - 1) != 0)
            snprintf(host, sizeof host, "localhost");
        nonce = make_nonce();
        int n = snprintf(line, sizeof line, "%s %s %d %016llx %d\n", MAGIC, host,
                         (int)ntohs(sa.sin_port), (unsigned long long)nonce, d->world);
        dfl_err we = {0};
        if (dfl_write_file_atomic(rv->path, line, (size_t)n, &we)) {
            close(ls);
            return latch(d, e, we.code, "cannot write the rendezvous file: %s", we.msg);
        }
    }
    double deadline = dfl_now() + timeout;
    int joined = 0;
    while (joined < d->world - 1) {
        double left = deadline - dfl_now();
        struct pollfd p = {.fd = ls, .events = POLLIN};
        int pr = left > 0 ? poll(&p, 1, (int)(left * 1000) + 1) : 0;
        if (pr < 0 && errno == EINTR)
            continue;
        if (pr <= 0) {
            char missing[256] = "";
            size_t k = 0;
            for (int r = 1; r < d->world && k < sizeof missing - 16; r++)
                if (d->fd[r] < 0)
                    k += (size_t)snprintf(missing + k, sizeof missing - k, "%s%d", k ? ", " : "", r);
            rc = latch(d, e, DFL_EIO, "only %d of %d ranks joined at %s within %g s; missing: rank%s "
                       "%s (were they started, with the same --rendezvous?)", joined + 1, d->world,
                       d->where, timeout, strchr(missing, ',') ? "s" : "", missing);
            break;
        }
        int c = accept4(ls, NULL, NULL, SOCK_CLOEXEC);
        if (c < 0)
            continue;
        sock_opts(c);
        /* the hello: within 5 s, else a stray connection */
        uint8_t h[HDR + 16];
        size_t got = 0;
        while (got < sizeof h) {
            struct pollfd q = {.fd = c, .events = POLLIN};
            if (poll(&q, 1, 5000) <= 0)
                break;
            ssize_t k = recv(c, h + got, sizeof h - got, 0);
            if (k <= 0)
                break;
            got += (size_t)k;
        }
        if (got < sizeof h || dfl_get_le32(h) != OP_HELLO || dfl_get_le64(h + 8) != 16) {
            close(c);
            continue;
        }
        int cr = (int)dfl_get_le32(h + HDR), cw = (int)dfl_get_le32(h + HDR + 4);
        uint64_t cn = dfl_get_le64(h + HDR + 8);
        if (rv->file && cn != nonce) {   /* read a stale rendezvous file: it retries */
            close(c);
            continue;
        }
        char why[256] = "";
        if (cw != d->world)
            snprintf(why, sizeof why, "rank %d has world size %d, rank 0 has %d", cr, cw, d->world);
        else if (cr < 1 || cr >= d->world)
            snprintf(why, sizeof why, "a rank %d joined a world of %d", cr, d->world);
        else if (d->fd[cr] >= 0)
            snprintf(why, sizeof why, "rank %d joined twice (two processes with the same rank?)", cr);
        if (*why) {
            uint8_t a[HDR];
            dfl_put_le32(a, OP_ABORT);
            dfl_put_le32(a + 4, 0);
            dfl_put_le64(a + 8, strlen(why));
            if (send(c, a, HDR, MSG_NOSIGNAL) == HDR)
                (void)!send(c, why, strlen(why), MSG_NOSIGNAL);
            close(c);
            rc = latch(d, e, DFL_EUSAGE, "%s", why);
            break;
        }
        d->fd[cr] = c;
        joined++;
    }
    close(ls);
    if (rv->file)
        unlink(rv->path);   /* everyone joined (or we give up): the file is not needed */
    if (rc)
        return hub_fail(d, rc);
    for (int r = 1; r < d->world; r++)
        if ((rc = send_msg(d, r, OP_WELCOME, NULL, 0, e)))
            return hub_fail(d, rc);
    return DFL_OK;
}

/* Reads rank 0's address from a rendezvous file: 1 when read, 0 when not (yet) there. */
static int read_rdv_file(const char *path, int world, char *host, size_t hn, int *port,
                         uint64_t *nonce, char *why, size_t wn)
{
    char *buf = NULL;
    size_t len = 0;
    if (access(path, F_OK) != 0) {
        snprintf(why, wn, "the file %s does not exist (yet)", path);
        return 0;
    }
    if (dfl_read_file(path, 4096, &buf, &len, NULL) != 0) {
        snprintf(why, wn, "cannot read %s", path);
        return 0;
    }
    char magic[32], h[256];
    unsigned long long nn;
    int p, w, ok = sscanf(buf, "%31s %255s %d %llx %d", magic, h, &p, &nn, &w) == 5 &&
                        strcmp(magic, MAGIC) == 0 && p > 0 && p < 65536;
    free(buf);
    if (!ok) {
        snprintf(why, wn, "%s is not a dfl rendezvous file", path);
        return 0;
    }
    if (w != world) {
        snprintf(why, wn, "%s is for a world of %d ranks (an earlier run?)", path, w);
        return 0;
    }
    char me[256] = "";
    gethostname(me, sizeof me - 1);
    snprintf(host, hn, "%s", strcmp(me, h) == 0 ? "127.0.0.1" : h);
    *port = p;
    *nonce = nn;
    return 1;
}

/* Connects to host:port within ms milliseconds; -1 (errno set) on failure. */
static int connect_to(const char *host, int port, int ms)
{
    struct addrinfo hints = {.ai_family = AF_INET, .ai_socktype = SOCK_STREAM}, *ai = NULL;
    char ps[16];
    snprintf(ps, sizeof ps, "%d", port);
    if (getaddrinfo(host, ps, &hints, &ai) != 0 || !ai) {
        errno = EHOSTUNREACH;
        return -1;
    }
    int fd = socket(AF_INET, SOCK_STREAM | SOCK_CLOEXEC | SOCK_NONBLOCK, 0);
    if (fd < 0) {
        freeaddrinfo(ai);
        return -1;
    }
    int rc = connect(fd, ai->ai_addr, ai->ai_addrlen);
    freeaddrinfo(ai);
    if (rc != 0 && errno == EINPROGRESS) {
        struct pollfd p = {.fd = fd, .events = POLLOUT};
        int err = 0;
        socklen_t el = sizeof err;
        if (poll(&p, 1, ms) == 1 && getsockopt(fd, SOL_SOCKET, SO_ERROR, &err, &el) == 0 && !err)
            rc = 0;
        else
            errno = err ? err : ETIMEDOUT;
    }
    if (rc != 0) {
        int sv = errno;
        close(fd);
        errno = sv;
        return -1;
    }
    fcntl(fd, F_SETFL, fcntl(fd, F_GETFL) & ~O_NONBLOCK);
    sock_opts(fd);
    return fd;
}

static int client_open(dfl_dist *d, const rdv *rv, double timeout, dfl_err *e)
{
    double deadline = dfl_now() + timeout;
    char why[512] = "nothing tried";
    for (;;) {
        char host[256];
        int port = rv->port;
        uint64_t nonce = 0;
        snprintf(host, sizeof host, "%s", rv->host);
        bool have = !rv->file || read_rdv_file(rv->path, d->world, host, sizeof host, &port, &nonce,
                                               why, sizeof why);
        if (have) {
            int fd = connect_to(host, port, 2000);
            if (fd < 0) {
                snprintf(why, sizeof why, "cannot connect to rank 0 at %s:%d: %s", host, port,
                         strerror(errno));
            } else {
                uint8_t h[HDR + 16];
                dfl_put_le32(h, OP_HELLO);
                dfl_put_le32(h + 4, 0);
                dfl_put_le64(h + 8, 16);
                dfl_put_le32(h + HDR, (uint32_t)d->rank);
                dfl_put_le32(h + HDR + 4, (uint32_t)d->world);
                dfl_put_le64(h + HDR + 8, nonce);
                d->fd[0] = fd;
                if (send(fd, h, sizeof h, MSG_NOSIGNAL) == (ssize_t)sizeof h) {
                    /* wait for the welcome: rank 0 sends it when every rank has joined (or
                     * gives up after its own timeout) */
                    uint8_t a[HDR];
                    size_t got = 0;
                    while (got < HDR) {
                        ssize_t k = recv(fd, a + got, HDR - got, 0);
                        if (k < 0 && errno == EINTR)
                            continue;
                        if (k <= 0)
                            break;
                        got += (size_t)k;
                    }
                    if (got == HDR && dfl_get_le32(a) == OP_WELCOME)
                        return DFL_OK;
                    if (got == HDR && dfl_get_le32(a) == OP_ABORT && dfl_get_le64(a + 8) < 1024) {
                        char msg[1024];
                        size_t n = (size_t)dfl_get_le64(a + 8);
                        if (recv_all(d, 0, msg, n, "rendezvous", e) == 0) {
                            msg[n] = 0;
                            close(fd);
                            d->fd[0] = -1;
                            return latch(d, e, DFL_EUSAGE, "rank 0 refused this rank at %s: %s",
                                         d->where, msg);
                        }
                    }
                    snprintf(why, sizeof why, "rank 0 at %s:%d closed the connection (a stale "
                             "rendezvous, or rank 0 gave up)", host, port);
                }
                close(fd);
                d->fd[0] = -1;
            }
        }
        if (dfl_now() >= deadline)
            break;
        usleep(100000);
    }
    return latch(d, e, DFL_EIO, "could not join rank 0 through %s within %g s: %s (is rank 0 "
                 "running, with the same --rendezvous and world size?)", d->where, timeout, why);
}

int dfl_dist_open(dfl_dist **out, const dfl_dist_opts *o, dfl_err *e)
{
    *out = NULL;
    if (o->world < 1 || o->rank < 0 || o->rank >= o->world)
        return dfl_fail(e, DFL_EUSAGE, "rank %d, world size %d: the rank must be below the world "
                        "size", o->rank, o->world);
    rdv rv = {0};
    if (o->world > 1) {
        if (!o->rendezvous)
            return dfl_fail(e, DFL_EUSAGE, "a world of %d ranks needs --rendezvous FILE (a path "
                            "every rank sees) or --rendezvous tcp://HOST:PORT (rank 0's host)",
                            o->world);
        int rc = parse_rdv(o->rendezvous, &rv, e);
        if (rc)
            return rc;
    }
    dfl_dist *d = calloc(1, sizeof *d);
    if (!d)
        return dfl_fail(e, DFL_ENOMEM, "out of memory");
    d->rank = o->rank;
    d->world = o->world;
    d->local_rank = o->local_rank;
    pthread_mutex_init(&d->mu, NULL);
    pthread_cond_init(&d->wd_cv, NULL);
    d->comm_wanted = o->device_comm_always || o->world > 1;
    snprintf(d->where, sizeof d->where, "%s", o->rendezvous ? o->rendezvous : "(none)");
    if (o->world == 1) {
        *out = d;
        return DFL_OK;
    }
    d->fd = malloc((size_t)o->world * sizeof *d->fd);
    d->scratch = malloc(CHUNK);
    if (!d->fd || !d->scratch) {
        dfl_dist_close(d);
        return dfl_fail(e, DFL_ENOMEM, "out of memory");
    }
    for (int r = 0; r < o->world; r++)
        d->fd[r] = -1;
    double timeout = o->timeout_s > 0 ? o->timeout_s : 600;
    int rc = d->rank == 0 ? hub_open(d, &rv, timeout, e) : client_open(d, &rv, timeout, e);
    if (rc) {
        dfl_dist_close(d);
        return rc;
    }
    *out = d;
    return DFL_OK;
}

int dfl_dist_rank(const dfl_dist *d) { return d ? d->rank : 0; }
int dfl_dist_size(const dfl_dist *d) { return d ? d->world : 1; }
int dfl_dist_local_rank(const dfl_dist *d) { return d ? d->local_rank : 0; }

/* ---- host collectives ---------------------------------------------------------------------- */

static void add_into(void *dst, const void *src, size_t bytes, bool f64)
{
    if (f64) {
        double *y = dst;
        const double *x = src;
        for (size_t i = 0; i < bytes / 8; i++)
            y[i] += x[i];
    } else {
        float *y = dst;
        const float *x = src;
        for (size_t i = 0; i < bytes / 4; i++)
            y[i] += x[i];
    }
}

/* The sum over ranks in rank order, in place on host memory. */
static int sock_allreduce(dfl_dist *d, void *buf, size_t bytes, bool f64, dfl_err *e)
{
    uint32_t op = f64 ? OP_ALLREDUCE_F64 : OP_ALLREDUCE_F32;
    int rc = dfl_dist_check(d, e);
    uint64_t n;
    if (rc)
        return rc;
    d->seq++;
    if (d->rank != 0) {
        if ((rc = send_msg(d, 0, op, buf, bytes, e)) || (rc = recv_hdr(d, 0, op, bytes, &n, e)))
            return rc;
        return recv_all(d, 0, buf, bytes, op_name(op), e);
    }
    for (int r = 1; r < d->world; r++) {
        if ((rc = recv_hdr(d, r, op, bytes, &n, e)))
            return hub_fail(d, rc);
        for (size_t off = 0; off < bytes; off += CHUNK) {
            size_t k = bytes - off < CHUNK ? bytes - off : CHUNK;
            if ((rc = recv_all(d, r, d->scratch, k, op_name(op), e)))
                return hub_fail(d, rc);
            add_into((char *)buf + off, d->scratch, k, f64);
        }
    }
    for (int r = 1; r < d->world; r++)
        if ((rc = send_msg(d, r, op, buf, bytes, e)))
            return hub_fail(d, rc);
    return DFL_OK;
}

/* Starts a collective call: the communicator's latched error (or 0) into *rc, and the call
 * numbered. False when there is nothing to exchange: an error, no communicator, or one rank. */
static bool call_begin(dfl_dist *d, dfl_err *e, int *rc)
{
    *rc = dfl_dist_check(d, e);
    if (!d || *rc || d->world == 1)
        return false;
    d->seq++;
    return true;
}

static int sock_barrier(dfl_dist *d, uint32_t op, dfl_err *e)
{
    int rc;
    uint64_t n;
    if (!call_begin(d, e, &rc))
        return rc;
    if (d->rank != 0) {
        if ((rc = send_msg(d, 0, op, NULL, 0, e)))
            return rc;
        return recv_hdr(d, 0, op, 0, &n, e);
    }
    for (int r = 1; r < d->world; r++)
        if ((rc = recv_hdr(d, r, op, 0, &n, e)))
            return hub_fail(d, rc);
    for (int r = 1; r < d->world; r++)
        if ((rc = send_msg(d, r, op, NULL, 0, e)))
            return hub_fail(d, rc);
    return DFL_OK;
}

int dfl_dist_barrier(dfl_dist *d, dfl_err *e) { return d ? sock_barrier(d, OP_BARRIER, e) : DFL_OK; }

static int bcast_op(dfl_dist *d, uint32_t op, void *buf, size_t bytes, dfl_err *e)
{
    int rc;
    uint64_t n;
    if (!call_begin(d, e, &rc))
        return rc;
    /* the others announce the call first, so that the hub can check that the ranks agree */
    if (d->rank != 0) {
        if ((rc = send_msg(d, 0, op, NULL, 0, e)) || (rc = recv_hdr(d, 0, op, bytes, &n, e)))
            return rc;
        return recv_all(d, 0, buf, bytes, op_name(op), e);
    }
    for (int r = 1; r < d->world; r++)
        if ((rc = recv_hdr(d, r, op, 0, &n, e)))
            return hub_fail(d, rc);
    for (int r = 1; r < d->world; r++)
        if ((rc = send_msg(d, r, op, buf, bytes, e)))
            return hub_fail(d, rc);
    return DFL_OK;
}

int dfl_dist_bcast(dfl_dist *d, void *buf, size_t n, dfl_err *e)
{
    return d ? bcast_op(d, OP_BCAST, buf, n, e) : DFL_OK;
}

int dfl_dist_allgather(dfl_dist *d, const void *mine, size_t n, void *all, dfl_err *e)
{
    if (n)
        memcpy((char *)all + (d ? (size_t)d->rank * n : 0), mine, n);
    int rc;
    uint64_t got;
    if (!call_begin(d, e, &rc))
        return rc;
    size_t total = (size_t)d->world * n;
    if (d->rank != 0) {
        if ((rc = send_msg(d, 0, OP_ALLGATHER, mine, n, e)) ||
            (rc = recv_hdr(d, 0, OP_ALLGATHER, total, &got, e)))
            return rc;
        return recv_all(d, 0, all, total, "allgather", e);
    }
    for (int r = 1; r < d->world; r++)
        if ((rc = recv_hdr(d, r, OP_ALLGATHER, n, &got, e)) ||
            (rc = recv_all(d, r, (char *)all + (size_t)r * n, n, "allgather", e)))
            return hub_fail(d, rc);
    for (int r = 1; r < d->world; r++)
        if ((rc = send_msg(d, r, OP_ALLGATHER, all, total, e)))
            return hub_fail(d, rc);
    return DFL_OK;
}

int dfl_dist_gather(dfl_dist *d, const void *mine, size_t n, void ***parts, size_t **lens,
                    dfl_err *e)
{
    *parts = NULL;
    *lens = NULL;
    int rc = dfl_dist_check(d, e);
    if (rc)
        return rc;
    int W = dfl_dist_size(d);
    if (d && d->world > 1) {
        d->seq++;
        if (d->rank != 0)
            return send_msg(d, 0, OP_GATHER, mine, n, e);
    }
    void **p = calloc((size_t)W, sizeof *p);
    size_t *l = calloc((size_t)W, sizeof *l);
    if (!p || !l || !(p[0] = malloc(n ? n : 1))) {
        free(p);
        free(l);
        return d ? hub_fail(d, latch(d, e, DFL_ENOMEM, "out of memory")) :
                   dfl_fail(e, DFL_ENOMEM, "out of memory");
    }
    memcpy(p[0], mine, n);
    l[0] = n;
    for (int r = 1; r < W && !rc; r++) {
        uint64_t k;
        if ((rc = recv_hdr(d, r, OP_GATHER, UINT64_MAX, &k, e)))
            break;
        if (k > ((uint64_t)1 << 32) || !(p[r] = malloc(k ? (size_t)k : 1))) {
            rc = latch(d, e, DFL_ENOMEM, "gather: rank %d sends %llu bytes", r, (unsigned long long)k);
            break;
        }
        l[r] = (size_t)k;
        rc = recv_all(d, r, p[r], (size_t)k, "gather", e);
    }
    if (rc) {
        for (int r = 0; r < W; r++)
            free(p[r]);
        free(p);
        free(l);
        return hub_fail(d, rc);
    }
    *parts = p;
    *lens = l;
    return DFL_OK;
}

int dfl_dist_sum_host(dfl_dist *d, double *v, int n, dfl_err *e)
{
    if (!d || d->world == 1)
        return dfl_dist_check(d, e);
    return sock_allreduce(d, v, (size_t)n * sizeof *v, true, e);
}

/* ---- the device communicator ---------------------------------------------------------------
 * The backend's collective library (be->device_comm) sums device buffers; the sockets above
 * carry its identity from rank 0 and watch the peers. A watchdog thread polls the communicator
 * and the sockets, and aborts the communicator when it failed or a peer is gone, so that no rank
 * hangs in a collective whose peer died. */

/* Whether a control socket reports its peer gone (never consumes data). */
static int peer_gone(dfl_dist *d)
{
    if (!d->fd)
        return -1;
    for (int r = d->rank == 0 ? 1 : 0; r < (d->rank == 0 ? d->world : 1); r++) {
        struct pollfd p = {.fd = d->fd[r], .events = POLLRDHUP};
        if (d->fd[r] >= 0 && poll(&p, 1, 0) == 1 && (p.revents & (POLLRDHUP | POLLHUP | POLLERR)))
            return r;
    }
    return -1;
}

/* Called with d->mu held: abort the communicator and latch the reason. */
static void abort_locked(dfl_dist *d, const char *why)
{
    if (!d->broken) {
        d->broken = true;
        dfl_fail(&d->err, DFL_EDEVICE, "rank %d of %d: %s", d->rank, d->world, why);
    }
    if (d->comm) {
        d->be->ops->comm_abort(d->be, d->comm);
        d->comm = NULL;
    }
}

static void *watchdog(void *arg)
{
    dfl_dist *d = arg;
    pthread_mutex_lock(&d->mu);
    while (!d->wd_stop) {
        struct timespec ts;
        clock_gettime(CLOCK_REALTIME, &ts);
        ts.tv_nsec += 100 * 1000000L;
        if (ts.tv_nsec >= 1000000000L) {
            ts.tv_sec++;
            ts.tv_nsec -= 1000000000L;
        }
        pthread_cond_timedwait(&d->wd_cv, &d->mu, &ts);
        if (d->wd_stop || !d->comm)
            continue;
        bool busy;
        dfl_err ce = {0};
        if (d->be->ops->comm_status(d->be, d->comm, &busy, &ce)) {
            abort_locked(d, ce.msg);
            continue;
        }
        int r = peer_gone(d);
        if (r >= 0) {
            char why[300];
            snprintf(why, sizeof why, "rank %d exited or lost its connection (see its messages); "
                     "device communicator aborted", r);
            abort_locked(d, why);
        }
    }
    pthread_mutex_unlock(&d->mu);
    return NULL;
}

/* After a communicator call returned rc (with its message in ce): waits while the call is in
 * progress (called with d->mu held). Aborts the communicator on a failure, a gone peer or the
 * timeout, and returns the latched error. */
static int comm_wait_locked(dfl_dist *d, int rc, const dfl_err *ce, const char *what, double timeout)
{
    double deadline = dfl_now() + timeout;
    char why[600];
    if (rc) {
        snprintf(why, sizeof why, "%s", ce->msg);
        abort_locked(d, why);
        return d->err.code;
    }
    for (;;) {
        if (d->broken || !d->comm)
            return d->broken ? d->err.code : DFL_EDEVICE;
        bool busy;
        dfl_err se = {0};
        if (d->be->ops->comm_status(d->be, d->comm, &busy, &se)) {
            snprintf(why, sizeof why, "%s: %s", what, se.msg);
            abort_locked(d, why);
            return d->err.code;
        }
        if (!busy)
            return DFL_OK;
        int r = peer_gone(d);
        if (r >= 0 || dfl_now() > deadline) {
            if (r >= 0)
                snprintf(why, sizeof why, "%s: rank %d exited or lost its connection", what, r);
            else
                snprintf(why, sizeof why, "%s: no progress in %.0f s", what, timeout);
            abort_locked(d, why);
            return d->err.code;
        }
        usleep(1000);
    }
}

static int comm_init(dfl_dist *d, dfl_err *e)
{
    dfl_be *be = d->be;
    uint8_t id[DFL_COMM_ID_BYTES];
    memset(id, 0, sizeof id);
    dfl_err ie = {0};
    int rc;
    if (d->rank == 0 && be->ops->comm_id(be, id, &ie))
        rc = latch(d, e, DFL_EDEVICE, "%s", ie.msg);
    else
        rc = bcast_op(d, OP_ID, id, sizeof id, e);
    if (rc)
        return d->rank == 0 ? hub_fail(d, rc) : rc;
    pthread_mutex_lock(&d->mu);
    rc = be->ops->comm_init(be, &d->comm, d->world, d->rank, id, &ie);
    if (rc && d->comm) {
        be->ops->comm_abort(be, d->comm);
        d->comm = NULL;
    }
    char what[96];
    snprintf(what, sizeof what, "device communicator on %s not created", be->name);
    if (rc || !d->comm) {
        if (!rc)
            snprintf(ie.msg, sizeof ie.msg, "%s", what);
        abort_locked(d, ie.msg);
    } else {
        rc = comm_wait_locked(d, 0, &ie, what, 600);
    }
    if (rc || d->broken) {
        if (e)
            *e = d->err;
        pthread_mutex_unlock(&d->mu);
        return DFL_EDEVICE;
    }
    pthread_mutex_unlock(&d->mu);
    if (pthread_create(&d->wd, NULL, watchdog, d) == 0)
        d->wd_running = true;
    return DFL_OK;
}

static void stop_watchdog(dfl_dist *d)
{
    if (!d->wd_running)
        return;
    pthread_mutex_lock(&d->mu);
    d->wd_stop = true;
    pthread_cond_signal(&d->wd_cv);
    pthread_mutex_unlock(&d->mu);
    pthread_join(d->wd, NULL);
    d->wd_running = false;
}

static int comm_allreduce(dfl_dist *d, void *buf, int64_t n, dfl_dtype dt, dfl_err *e)
{
    pthread_mutex_lock(&d->mu);
    if (d->broken || !d->comm) {
        pthread_mutex_unlock(&d->mu);
        return d->broken ? dfl_dist_check(d, e) : latch(d, e, DFL_EDEVICE, "no device communicator");
    }
    dfl_err ce = {0};
    int rc = d->be->ops->comm_allreduce(d->be, d->comm, buf, n, dt, &ce);
    char what[96];
    snprintf(what, sizeof what, "all-reduce of %lld values", (long long)n);
    rc = comm_wait_locked(d, rc, &ce, what, 600);
    if (d->broken)
        rc = d->err.code;
    if (rc && e)
        *e = d->err;
    pthread_mutex_unlock(&d->mu);
    return rc;
}

int dfl_dist_attach(dfl_dist *d, dfl_be *be, dfl_err *e)
{
    d->be = be;
    if (be->device_comm && d->comm_wanted)
        return comm_init(d, e);
    d->comm_wanted = false;
    return DFL_OK;
}

bool dfl_dist_uses_device_comm(const dfl_dist *d)
{
    return d && d->be && d->be->device_comm && d->comm_wanted;
}

int dfl_dist_allreduce(dfl_dist *d, void *buf, int64_t n, dfl_dtype dt, dfl_err *e)
{
    if (dt != DFL_F32 && dt != DFL_F64)
        return dfl_fail(e, DFL_EUSAGE, "dist allreduce: f32 or f64 only (got %s)", dfl_dtype_lower(dt));
    if (!d)
        return DFL_OK;
    if (dfl_dist_uses_device_comm(d))
        return comm_allreduce(d, buf, n, dt, e);
    if (d->be && d->be->async && d->world > 1)
        return latch(d, e, DFL_EDEVICE, "dist allreduce: a device buffer without a device communicator");
    if (d->world == 1 || n <= 0)
        return dfl_dist_check(d, e);
    return sock_allreduce(d, buf, (size_t)n * dfl_dtype_size(dt), dt == DFL_F64, e);
}

/* ---- the end ------------------------------------------------------------------------------- */

int dfl_dist_finish(dfl_dist *d, dfl_err *e)
{
    if (!d)
        return DFL_OK;
    int rc = DFL_OK;
    stop_watchdog(d);
    pthread_mutex_lock(&d->mu);
    if (d->comm && !d->broken) {
        dfl_err ce = {0};
        int frc = d->be->ops->comm_finalize(d->be, d->comm, &ce);
        comm_wait_locked(d, frc, &ce, "communicator finalize", 600);
    }
    pthread_mutex_unlock(&d->mu);
    if (!(rc = sock_barrier(d, OP_FINISH, e)))
        d->finished = true;
    return rc;
}

void dfl_dist_close(dfl_dist *d)
{
    if (!d)
        return;
    stop_watchdog(d);
    if (d->comm) {
        if (d->finished && !d->broken)
            d->be->ops->comm_destroy(d->be, d->comm);
        else
            d->be->ops->comm_abort(d->be, d->comm);
        d->comm = NULL;
    }
    pthread_cond_destroy(&d->wd_cv);
    if (!d->finished && d->broken)
        hub_abort_others(d);
    if (d->fd)
        for (int r = 0; r < d->world; r++)
            if (d->fd[r] >= 0)
                close(d->fd[r]);
    free(d->fd);
    free(d->scratch);
    pthread_mutex_destroy(&d->mu);
    free(d);
}
