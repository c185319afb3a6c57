/* draft_pipe.c: see draft_pipe.h. */
#include "draft_pipe.h"

#include <stdlib.h>
#include <string.h>

#ifdef DFL_CUDA
#include "../../kernels/cuda.h"
#define CUDA_BE(be) ((be)->kind == DFL_BE_CUDA)

static dfl_cuda_stream stream_of(dfl_be *be, int s)
{
    return s == DFL_DP_COPY ? dfl_cuda_copy_stream(be) : dfl_cuda_compute_stream(be);
}
#else
#define CUDA_BE(be) false
#endif

bool dfl_dp_async(dfl_be *be) { return CUDA_BE(be); }

void *dfl_dp_host_alloc(dfl_be *be, size_t bytes, dfl_err *e)
{
#ifdef DFL_CUDA
    if (CUDA_BE(be))
        return dfl_cuda_host_alloc(be, bytes, e);
#endif
    void *p = malloc(bytes ? bytes : 1);
    if (!p)
        dfl_fail(e, DFL_ENOMEM, "out of memory (%zu bytes of host buffers)", bytes);
    return p;
}

void dfl_dp_host_free(dfl_be *be, void *p)
{
    if (!p)
        return;
#ifdef DFL_CUDA
    if (CUDA_BE(be)) {
        dfl_cuda_host_free(be, p);
        return;
    }
#endif
    free(p);
}

int dfl_dp_event_new(dfl_be *be, dfl_dp_event *ev, bool timing, dfl_err *e)
{
    *ev = NULL;
#ifdef DFL_CUDA
    if (CUDA_BE(be))
        return dfl_cuda_event_create(be, (dfl_cuda_event *)ev, timing, e);
#endif
    return DFL_OK;
}

void dfl_dp_event_free(dfl_be *be, dfl_dp_event ev)
{
#ifdef DFL_CUDA
    if (CUDA_BE(be) && ev)
        dfl_cuda_event_destroy(be, (dfl_cuda_event)ev);
#endif
}

int dfl_dp_record(dfl_be *be, dfl_dp_event ev, int stream, dfl_err *e)
{
#ifdef DFL_CUDA
    if (CUDA_BE(be) && ev)
        return dfl_cuda_event_record(be, (dfl_cuda_event)ev, stream_of(be, stream), e);
#endif
    return DFL_OK;
}

int dfl_dp_stream_wait(dfl_be *be, int stream, dfl_dp_event ev, dfl_err *e)
{
#ifdef DFL_CUDA
    if (CUDA_BE(be) && ev)
        return dfl_cuda_stream_wait_event(be, stream_of(be, stream), (dfl_cuda_event)ev, e);
#endif
    return DFL_OK;
}

int dfl_dp_event_wait(dfl_be *be, dfl_dp_event ev, dfl_err *e)
{
#ifdef DFL_CUDA
    if (CUDA_BE(be) && ev)
        return dfl_cuda_event_sync(be, (dfl_cuda_event)ev, e);
#endif
    return DFL_OK;
}

int dfl_dp_elapsed(dfl_be *be, dfl_dp_event a, dfl_dp_event b, float *ms, dfl_err *e)
{
    *ms = 0;
#ifdef DFL_CUDA
    if (CUDA_BE(be) && a && b)
        return dfl_cuda_event_elapsed(be, (dfl_cuda_event)a, (dfl_cuda_event)b, ms, e);
#endif
    return DFL_OK;
}

int dfl_dp_upload(dfl_be *be, void *dst, const void *src, size_t bytes, int stream, dfl_err *e)
{
    if (bytes == 0)
        return DFL_OK;
#ifdef DFL_CUDA
    if (CUDA_BE(be))
        return dfl_cuda_upload_async(be, dst, src, bytes, stream_of(be, stream), e);
#endif
    int rc = be->ops->upload(be, dst, src, bytes);
    return rc ? dfl_fail(e, rc, "%s: upload of %zu bytes failed", be->name, bytes) : DFL_OK;
}

int dfl_dp_download(dfl_be *be, void *dst, const void *src, size_t bytes, int stream, dfl_err *e)
{
    if (bytes == 0)
        return DFL_OK;
#ifdef DFL_CUDA
    if (CUDA_BE(be))
        return dfl_cuda_download_async(be, dst, src, bytes, stream_of(be, stream), e);
#endif
    int rc = be->ops->download(be, dst, src, bytes);
    return rc ? dfl_fail(e, rc, "%s: download of %zu bytes failed", be->name, bytes) : DFL_OK;
}

void dfl_dp_waits(dfl_be *be, uint64_t *syncs, uint64_t *event_waits)
{
    *syncs = *event_waits = 0;
#ifdef DFL_CUDA
    if (CUDA_BE(be)) {
        dfl_cuda_waits w;
        dfl_cuda_wait_stats(be, &w);
        *syncs = w.syncs;
        *event_waits = w.event_waits;
    }
#endif
}

void dfl_dp_freeze(dfl_be *be, bool frozen)
{
#ifdef DFL_CUDA
    if (CUDA_BE(be))
        dfl_cuda_freeze(be, frozen);
#endif
}

uint64_t dfl_dp_mem_free(dfl_be *be)
{
#ifdef DFL_CUDA
    if (CUDA_BE(be)) {
        const char *c = strchr(be->name, ':');
        dfl_cuda_props p;
        if (dfl_cuda_device_props(c ? atoi(c + 1) : 0, &p, NULL) == 0)
            return p.mem_free;
    }
#endif
    return 0;
}
