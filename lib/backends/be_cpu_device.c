/* be_cpu_device.c: the CPU backend's device plumbing (backend.h): the CPU runs every op at once,
 * so its events are complete as soon as they are recorded (they are NULL handles), its
 * asynchronous copies are plain copies, its "pinned" memory is malloc'ed, and there is nothing to
 * freeze, tune or wait for. It has no device communicator (dist.c carries the sums itself). */
#include "be_cpu.h"

#include <stdlib.h>
#include <string.h>

static void *cpu_host_alloc(dfl_be *be, size_t bytes, dfl_err *e)
{
    void *p = malloc(bytes ? bytes : 1);
    if (!p)
        dfl_fail(e, DFL_ENOMEM, "out of memory (%zu bytes of host buffers)", bytes);
    return p;
}

static void cpu_host_free(dfl_be *be, void *p) { free(p); }
static int cpu_host_register(dfl_be *be, void *p, size_t bytes, bool ro, dfl_err *e) { return DFL_OK; }
static int cpu_host_unregister(dfl_be *be, void *p, dfl_err *e) { return DFL_OK; }

static int cpu_event_new(dfl_be *be, dfl_be_event *ev, bool timing, dfl_err *e)
{
    *ev = NULL;
    return DFL_OK;
}

static void cpu_event_free(dfl_be *be, dfl_be_event ev) {}
static int cpu_event_record(dfl_be *be, dfl_be_event ev, int stream, dfl_err *e) { return DFL_OK; }
static int cpu_stream_wait(dfl_be *be, int stream, dfl_be_event ev, dfl_err *e) { return DFL_OK; }
static int cpu_event_sync(dfl_be *be, dfl_be_event ev, dfl_err *e) { return DFL_OK; }
static int cpu_stream_sync(dfl_be *be, int stream, dfl_err *e) { return DFL_OK; }

static int cpu_event_query(dfl_be *be, dfl_be_event ev, bool *done, dfl_err *e)
{
    *done = true;
    return DFL_OK;
}

static int cpu_event_elapsed(dfl_be *be, dfl_be_event a, dfl_be_event b, float *ms, dfl_err *e)
{
    *ms = 0;
    return DFL_OK;
}

static int cpu_copy_async(dfl_be *be, void *dst, const void *src, size_t bytes, int stream, dfl_err *e)
{
    if (bytes)
        memcpy(dst, src, bytes);
    return DFL_OK;
}

static void cpu_freeze(dfl_be *be, bool frozen) {}

static void cpu_wait_stats(dfl_be *be, uint64_t *syncs, uint64_t *event_waits)
{
    *syncs = *event_waits = 0;
}

static int cpu_mem_info(dfl_be *be, dfl_be_mem *m, dfl_err *e)
{
    memset(m, 0, sizeof *m);
    return DFL_OK;
}

static int cpu_matmul_tune(dfl_be *be, const dfl_mm *m, int max_algos, int iters, float *best_ms,
                           float *first_ms, dfl_err *e)
{
    if (best_ms)
        *best_ms = 0;
    if (first_ms)
        *first_ms = 0;
    return DFL_OK;
}

static int no_comm(dfl_be *be, dfl_err *e)
{
    return dfl_fail(e, DFL_EDEVICE, "%s: this backend has no device communicator", be->name);
}

static int cpu_comm_id(dfl_be *be, uint8_t id[DFL_COMM_ID_BYTES], dfl_err *e) { return no_comm(be, e); }
static int cpu_comm_init(dfl_be *be, dfl_be_comm *c, int world, int rank,
                         const uint8_t id[DFL_COMM_ID_BYTES], dfl_err *e)
{
    *c = NULL;
    return no_comm(be, e);
}
static int cpu_comm_status(dfl_be *be, dfl_be_comm c, bool *busy, dfl_err *e)
{
    *busy = false;
    return no_comm(be, e);
}
static int cpu_comm_allreduce(dfl_be *be, dfl_be_comm c, void *buf, int64_t n, dfl_dtype dt, dfl_err *e)
{
    return no_comm(be, e);
}
static int cpu_comm_finalize(dfl_be *be, dfl_be_comm c, dfl_err *e) { return no_comm(be, e); }
static void cpu_comm_drop(dfl_be *be, dfl_be_comm c) {}

void dfl_cpu_device_ops(dfl_be_ops *o)
{
    o->host_alloc = cpu_host_alloc;
    o->host_free = cpu_host_free;
    o->host_register = cpu_host_register;
    o->host_unregister = cpu_host_unregister;
    o->event_new = cpu_event_new;
    o->event_free = cpu_event_free;
    o->event_record = cpu_event_record;
    o->stream_wait = cpu_stream_wait;
    o->event_query = cpu_event_query;
    o->event_sync = cpu_event_sync;
    o->event_elapsed = cpu_event_elapsed;
    o->stream_sync = cpu_stream_sync;
    o->upload_async = cpu_copy_async;
    o->download_async = cpu_copy_async;
    o->freeze = cpu_freeze;
    o->wait_stats = cpu_wait_stats;
    o->mem_info = cpu_mem_info;
    o->matmul_tune = cpu_matmul_tune;
    o->comm_id = cpu_comm_id;
    o->comm_init = cpu_comm_init;
    o->comm_status = cpu_comm_status;
    o->comm_allreduce = cpu_comm_allreduce;
    o->comm_finalize = cpu_comm_finalize;
    o->comm_abort = cpu_comm_drop;
    o->comm_destroy = cpu_comm_drop;
}
