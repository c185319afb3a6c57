/* dist.h: the communicator of data-parallel training: ranks that run the same program on their
 * own data, joined at start through a rendezvous, summing buffers over all ranks.
 *
 * Two planes:
 *  - control (host memory, always): TCP sockets in a star around rank 0 (the hub). Barrier,
 *    broadcast from rank 0, all-gather and gather of small host data, and the all-reduce of
 *    host buffers (the CPU backend's buffers). The hub sums in rank order 0, 1, 2, ... so that
 *    every rank gets the same bytes and a run repeats exactly.
 *  - device (a backend with be->device_comm, the GPU's): the backend's communicator (backend.h
 *    comm_*); dfl_dist_allreduce of backend buffers is an all-reduce enqueued on the backend's
 *    compute stream (no host synchronization).
 *
 * Rendezvous:
 *  - "FILE": rank 0 listens on an ephemeral TCP port and writes "host port nonce" to FILE
 *    (atomically, on a file system every rank sees); the others read FILE, connect, and present
 *    the nonce (a FILE left by an earlier run is never trusted: the nonce must match). Rank 0
 *    removes FILE once every rank has joined.
 *  - "tcp://HOST:PORT": rank 0 listens on PORT; the others connect to HOST:PORT.
 * Both wait up to timeout_s for the others, retrying, and then fail naming the rank, the address
 * and what is missing. Every message carries the operation and a sequence number, so ranks that
 * call different collectives fail with a message saying so instead of exchanging garbage.
 *
 * Failure: a rank that exits closes its sockets; any rank waiting on it fails at once with a
 * message naming it (rank 0 also passes the reason to the others before it gives up). TCP
 * keep-alive notices a host that vanished. With a device communicator, a watchdog thread polls
 * its asynchronous error and the control sockets; when a peer is gone it aborts the
 * communicator (so that kernels waiting on the peer end) and latches the error, which every
 * later call returns (dfl_dist_check). A live peer that stops calling is waited for (like
 * torch.distributed without a timeout).
 *
 * World size 1 (no launcher variables): every collective returns at once (all-reduce of one
 * rank is the identity); no socket, no device communicator, unless device_comm_always (tests)
 * asks for a device communicator of one rank. */
#ifndef DFL_DIST_H
#define DFL_DIST_H

#include <stdbool.h>
#include <stddef.h>
#include <stdint.h>

#include "backend.h"
#include "dtype.h"
#include "err.h"

typedef struct dfl_dist dfl_dist;

/* Rank, world size and local rank from the launcher's variables: RANK, WORLD_SIZE, LOCAL_RANK
 * (torchrun; LOCAL_RANK defaults to RANK) or else SLURM_PROCID, SLURM_NTASKS, SLURM_LOCALID;
 * none of them: rank 0 of 1. from: which ones were used ("RANK/WORLD_SIZE", "SLURM", "none").
 * Bad values (not a number, rank >= world) are DFL_EUSAGE naming the variable. */
typedef struct dfl_dist_env {
    int rank, world, local_rank;
    const char *from;
} dfl_dist_env;
int dfl_dist_env_get(dfl_dist_env *env, dfl_err *e);

typedef struct dfl_dist_opts {
    int rank, world, local_rank;
    const char *rendezvous;      /* FILE or tcp://HOST:PORT; required when world > 1 */
    double timeout_s;            /* rendezvous wait (<= 0: 600 s) */
    bool device_comm_always;     /* a device communicator even for world size 1 (tests) */
} dfl_dist_opts;

/* Joins the ranks (control plane). Returns when every rank has joined. */
int dfl_dist_open(dfl_dist **d, const dfl_dist_opts *o, dfl_err *e);
/* The backend whose buffers dfl_dist_allreduce sums. With be->device_comm: creates the backend's
 * communicator on its device (collective: every rank calls it) and starts the watchdog. CPU:
 * nothing. */
int dfl_dist_attach(dfl_dist *d, dfl_be *be, dfl_err *e);
int dfl_dist_rank(const dfl_dist *d);
int dfl_dist_size(const dfl_dist *d);
int dfl_dist_local_rank(const dfl_dist *d);
/* Whether device buffers go through the backend's device communicator. */
bool dfl_dist_uses_device_comm(const dfl_dist *d);

/* In place: buf (n values of dt, DFL_F32 or DFL_F64, memory of the attached backend; host
 * memory when none is attached) becomes the sum over ranks. Device communicator: enqueued on the compute
 * stream, returns at once. Sockets: returns when done. */
int dfl_dist_allreduce(dfl_dist *d, void *buf, int64_t n, dfl_dtype dt, dfl_err *e);
/* Host collectives over the control plane (every rank calls them in the same order). */
int dfl_dist_barrier(dfl_dist *d, dfl_err *e);
/* buf (n bytes, host) of rank 0 copied to every rank. */
int dfl_dist_bcast(dfl_dist *d, void *buf, size_t n, dfl_err *e);
/* all[r*n .. r*n+n-1] = rank r's mine (n bytes, the same n on every rank). */
int dfl_dist_allgather(dfl_dist *d, const void *mine, size_t n, void *all, dfl_err *e);
/* Rank 0 receives every rank's bytes (any length): parts[r] malloc'ed (caller frees each and
 * the array), lens[r]; other ranks get *parts = NULL. */
int dfl_dist_gather(dfl_dist *d, const void *mine, size_t n, void ***parts, size_t **lens,
                    dfl_err *e);
/* In place: the sum over ranks of n host doubles (rank order). */
int dfl_dist_sum_host(dfl_dist *d, double *v, int n, dfl_err *e);
/* The latched error of a failed collective or of the watchdog (0 if none). */
int dfl_dist_check(dfl_dist *d, dfl_err *e);

/* The drafter's hook (lib/models/draft_step.c): dfl_draft_apply sums its gradients, loss and accuracy
 * sums and block metrics over the ranks of d (NULL: this rank alone) before the gradient norm,
 * so that the norm, the clipping and the loss denominator are global. */
struct dfl_draft;
void dfl_draft_set_comm(struct dfl_draft *m, dfl_dist *d);

/* Clean end: every rank calls it after its last collective; returns when all have. Then close. */
int dfl_dist_finish(dfl_dist *d, dfl_err *e);
/* Frees everything; without a finish first (an error path), aborts the device communicator and
 * closes the sockets,
 * which the other ranks see as this rank's end. NULL is fine. */
void dfl_dist_close(dfl_dist *d);

#endif
