/* be_cuda_device.cu: the device plumbing of backend.h on CUDA (streams, events, pinned memory,
 * asynchronous copies, the allocation freeze, memory figures, tuning: adapters over the functions
 * of kernels/cuda.h) and the device communicator on NCCL. lib/ reaches the GPU only through these
 * ops; the NCCL communicator is created non-blocking, so that dist.c can poll it and abort it when
 * a peer dies instead of hanging in a collective. */
#include <nccl.h>
#include <stdio.h>
#include <string.h>

#include "be_cuda.cuh"

static dfl_cuda_stream stream_of(dfl_be *be, int s)
{
    return s == DFL_STREAM_COPY ? dfl_cuda_copy_stream(be) : dfl_cuda_compute_stream(be);
}

static inline dfl_cuda_event ev_of(dfl_be_event ev) { return reinterpret_cast<dfl_cuda_event>(ev); }

static void *d_host_alloc(dfl_be *be, size_t bytes, dfl_err *e) { return dfl_cuda_host_alloc(be, bytes, e); }
static void d_host_free(dfl_be *be, void *p) { dfl_cuda_host_free(be, p); }
static int d_host_register(dfl_be *be, void *p, size_t bytes, bool ro, dfl_err *e)
{
    return dfl_cuda_host_register(be, p, bytes, ro, e);
}
static int d_host_unregister(dfl_be *be, void *p, dfl_err *e) { return dfl_cuda_host_unregister(be, p, e); }

static int d_event_new(dfl_be *be, dfl_be_event *ev, bool timing, dfl_err *e)
{
    dfl_cuda_event x = NULL;
    int rc = dfl_cuda_event_create(be, &x, timing, e);
    *ev = reinterpret_cast<dfl_be_event>(x);
    return rc;
}

static void d_event_free(dfl_be *be, dfl_be_event ev)
{
    if (ev)
        dfl_cuda_event_destroy(be, ev_of(ev));
}

static int d_event_record(dfl_be *be, dfl_be_event ev, int stream, dfl_err *e)
{
    return ev ? dfl_cuda_event_record(be, ev_of(ev), stream_of(be, stream), e) : 0;
}

static int d_stream_wait(dfl_be *be, int stream, dfl_be_event ev, dfl_err *e)
{
    return ev ? dfl_cuda_stream_wait_event(be, stream_of(be, stream), ev_of(ev), e) : 0;
}

static int d_event_query(dfl_be *be, dfl_be_event ev, bool *done, dfl_err *e)
{
    if (!ev) {
        *done = true;
        return 0;
    }
    return dfl_cuda_event_query(be, ev_of(ev), done, e);
}

static int d_event_sync(dfl_be *be, dfl_be_event ev, dfl_err *e)
{
    return ev ? dfl_cuda_event_sync(be, ev_of(ev), e) : 0;
}

static int d_event_elapsed(dfl_be *be, dfl_be_event a, dfl_be_event b, float *ms, dfl_err *e)
{
    *ms = 0;
    return a && b ? dfl_cuda_event_elapsed(be, ev_of(a), ev_of(b), ms, e) : 0;
}

static int d_stream_sync(dfl_be *be, int stream, dfl_err *e)
{
    return dfl_cuda_stream_sync(be, stream_of(be, stream), e);
}

static int d_upload_async(dfl_be *be, void *dst, const void *src, size_t bytes, int stream, dfl_err *e)
{
    return dfl_cuda_upload_async(be, dst, src, bytes, stream_of(be, stream), e);
}

static int d_download_async(dfl_be *be, void *dst, const void *src, size_t bytes, int stream, dfl_err *e)
{
    return dfl_cuda_download_async(be, dst, src, bytes, stream_of(be, stream), e);
}

static void d_freeze(dfl_be *be, bool frozen) { dfl_cuda_freeze(be, frozen); }

static void d_wait_stats(dfl_be *be, uint64_t *syncs, uint64_t *event_waits)
{
    dfl_cuda_waits w;
    dfl_cuda_wait_stats(be, &w);
    *syncs = w.syncs;
    *event_waits = w.event_waits;
}

static int d_mem_info(dfl_be *be, dfl_be_mem *m, dfl_err *e)
{
    memset(m, 0, sizeof *m);
    dfl_cuda_mem cm;
    dfl_cuda_mem_stats(be, &cm);
    m->allocated = cm.allocated;
    m->peak = cm.peak;
    m->n_allocs = cm.n_allocs;
    m->backend_bytes = cm.backend_bytes;
    dfl_cuda_props p;
    int rc = dfl_cuda_device_props(cuda_of(be)->device, &p, e);
    if (rc)
        return rc;
    m->total = p.mem_total;
    m->free = p.mem_free;
    return 0;
}

static int d_matmul_tune(dfl_be *be, const dfl_mm *m, int max_algos, int iters, float *best_ms,
                         float *first_ms, dfl_err *e)
{
    return dfl_cuda_matmul_tune(be, m, max_algos, iters, best_ms, first_ms, e);
}

static int d_matmul_algo(dfl_be *be, const dfl_mm *m, dfl_mm_algo *a, bool set, dfl_err *e)
{
    return dfl_cuda_matmul_algo(be, m, a, set, e);
}

/* ---- the NCCL communicator ---- */

static_assert(sizeof(ncclUniqueId) <= DFL_COMM_ID_BYTES, "ncclUniqueId larger than DFL_COMM_ID_BYTES");

static inline ncclComm_t comm_of(dfl_be_comm c) { return reinterpret_cast<ncclComm_t>(c); }

static int nccl_fail(dfl_err *e, ncclResult_t r, ncclComm_t c, const char *what)
{
    return dfl_fail(e, DFL_EDEVICE, "%s: %s (%s)", what, ncclGetErrorString(r),
                    ncclGetLastError(c));
}

static int d_comm_id(dfl_be *be, uint8_t id[DFL_COMM_ID_BYTES], dfl_err *e)
{
    memset(id, 0, DFL_COMM_ID_BYTES);
    ncclUniqueId u;
    ncclResult_t r = ncclGetUniqueId(&u);
    if (r != ncclSuccess)
        return dfl_fail(e, DFL_EDEVICE, "ncclGetUniqueId failed: %s", ncclGetLastError(NULL));
    memcpy(id, &u, sizeof u);
    return 0;
}

static int d_comm_init(dfl_be *be, dfl_be_comm *c, int world, int rank,
                       const uint8_t id[DFL_COMM_ID_BYTES], dfl_err *e)
{
    *c = NULL;
    cudaError_t ce = cudaSetDevice(cuda_of(be)->device);
    if (ce != cudaSuccess)
        return dfl_fail(e, DFL_EDEVICE, "cudaSetDevice(%d) failed", cuda_of(be)->device);
    ncclUniqueId u;
    memcpy(&u, id, sizeof u);
    ncclConfig_t cfg = NCCL_CONFIG_INITIALIZER;
    cfg.blocking = 0;
    ncclComm_t comm = NULL;
    ncclResult_t r = ncclCommInitRankConfig(&comm, world, u, rank, &cfg);
    *c = reinterpret_cast<dfl_be_comm>(comm);
    if (r != ncclSuccess && r != ncclInProgress) {
        char what[96];
        snprintf(what, sizeof what, "NCCL communicator on %s not created", be->name);
        return nccl_fail(e, r, comm, what);
    }
    return 0;
}

static int d_comm_status(dfl_be *be, dfl_be_comm c, bool *busy, dfl_err *e)
{
    *busy = false;
    if (!c)
        return dfl_fail(e, DFL_EDEVICE, "no NCCL communicator");
    ncclResult_t st = ncclSuccess;
    ncclResult_t r = ncclCommGetAsyncError(comm_of(c), &st);
    if (r != ncclSuccess)
        return nccl_fail(e, r, comm_of(c), "NCCL failed");
    if (st == ncclInProgress) {
        *busy = true;
        return 0;
    }
    if (st != ncclSuccess)
        return nccl_fail(e, st, comm_of(c), "NCCL failed");
    return 0;
}

static int d_comm_allreduce(dfl_be *be, dfl_be_comm c, void *buf, int64_t n, dfl_dtype dt, dfl_err *e)
{
    if (!c)
        return dfl_fail(e, DFL_EDEVICE, "no NCCL communicator");
    if (dt != DFL_F32 && dt != DFL_F64)
        return dfl_fail(e, DFL_EUNSUP, "NCCL all-reduce of %s values", dfl_dtype_name(dt));
    cudaStream_t s = reinterpret_cast<cudaStream_t>(dfl_cuda_compute_stream(be));
    ncclResult_t r = ncclAllReduce(buf, buf, (size_t)n, dt == DFL_F64 ? ncclDouble : ncclFloat,
                                   ncclSum, comm_of(c), s);
    if (r != ncclSuccess && r != ncclInProgress) {
        char what[96];
        snprintf(what, sizeof what, "ncclAllReduce of %lld values failed", (long long)n);
        return nccl_fail(e, r, comm_of(c), what);
    }
    return 0;
}

static int d_comm_finalize(dfl_be *be, dfl_be_comm c, dfl_err *e)
{
    if (!c)
        return 0;
    ncclResult_t r = ncclCommFinalize(comm_of(c));
    if (r != ncclSuccess && r != ncclInProgress)
        return nccl_fail(e, r, comm_of(c), "NCCL finalize failed");
    return 0;
}

static void d_comm_abort(dfl_be *be, dfl_be_comm c)
{
    if (c)
        ncclCommAbort(comm_of(c));
}

static void d_comm_destroy(dfl_be *be, dfl_be_comm c)
{
    if (c)
        ncclCommDestroy(comm_of(c));
}

void cuda_device_ops_fill(dfl_be_ops *o)
{
    o->host_alloc = d_host_alloc;
    o->host_free = d_host_free;
    o->host_register = d_host_register;
    o->host_unregister = d_host_unregister;
    o->event_new = d_event_new;
    o->event_free = d_event_free;
    o->event_record = d_event_record;
    o->stream_wait = d_stream_wait;
    o->event_query = d_event_query;
    o->event_sync = d_event_sync;
    o->event_elapsed = d_event_elapsed;
    o->stream_sync = d_stream_sync;
    o->upload_async = d_upload_async;
    o->download_async = d_download_async;
    o->freeze = d_freeze;
    o->wait_stats = d_wait_stats;
    o->mem_info = d_mem_info;
    o->matmul_tune = d_matmul_tune;
    o->matmul_algo = d_matmul_algo;
    o->comm_id = d_comm_id;
    o->comm_init = d_comm_init;
    o->comm_status = d_comm_status;
    o->comm_allreduce = d_comm_allreduce;
    o->comm_finalize = d_comm_finalize;
    o->comm_abort = d_comm_abort;
    o->comm_destroy = d_comm_destroy;
}
