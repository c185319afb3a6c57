/* draft_pipe.h: the few stream, event and pinned-memory calls of the drafter's pipelined step
 * (draft_model.c, draft_train.c), over the CUDA backend's (kernels/cuda.h) when the backend is
 * CUDA, and plain copies otherwise (the CPU runs every op at once, so its events are complete as
 * soon as they are recorded). Model code stays backend-blind: it names a stream (compute or copy)
 * and gets an opaque event. */
#ifndef DFL_DRAFT_PIPE_H
#define DFL_DRAFT_PIPE_H

#include <stdbool.h>
#include <stddef.h>
#include <stdint.h>

#include "backend.h"
#include "err.h"

typedef struct dfl_dp_event_s *dfl_dp_event;   /* NULL on a backend without events */
enum { DFL_DP_COMPUTE, DFL_DP_COPY };

/* Whether the backend runs ops asynchronously (then host buffers given to dfl_dp_upload /
 * dfl_dp_download must stay untouched until an event recorded after the copy has completed). */
bool dfl_dp_async(dfl_be *be);
/* Host memory for asynchronous copies: pinned on CUDA, malloc'ed elsewhere. */
void *dfl_dp_host_alloc(dfl_be *be, size_t bytes, dfl_err *e);
void dfl_dp_host_free(dfl_be *be, void *p);
int dfl_dp_event_new(dfl_be *be, dfl_dp_event *ev, bool timing, dfl_err *e);
void dfl_dp_event_free(dfl_be *be, dfl_dp_event ev);
/* Captures the work enqueued on the stream so far. */
int dfl_dp_record(dfl_be *be, dfl_dp_event ev, int stream, dfl_err *e);
/* Future work on the stream waits for ev (no host wait). */
int dfl_dp_stream_wait(dfl_be *be, int stream, dfl_dp_event ev, dfl_err *e);
/* The host waits for ev (returns at once when it has completed). */
int dfl_dp_event_wait(dfl_be *be, dfl_dp_event ev, dfl_err *e);
/* Milliseconds between two completed timing events (0 without events). */
int dfl_dp_elapsed(dfl_be *be, dfl_dp_event a, dfl_dp_event b, float *ms, dfl_err *e);
/* Host -> backend and backend -> host copies enqueued on a stream. */
int dfl_dp_upload(dfl_be *be, void *dst, const void *src, size_t bytes, int stream, dfl_err *e);
int dfl_dp_download(dfl_be *be, void *dst, const void *src, size_t bytes, int stream, dfl_err *e);
/* Host waits so far (kernels/cuda.h dfl_cuda_wait_stats; zeros on the CPU). */
void dfl_dp_waits(dfl_be *be, uint64_t *syncs, uint64_t *event_waits);
/* Device allocation after setup is an error from now on (CUDA), or allowed again. */
void dfl_dp_freeze(dfl_be *be, bool frozen);
/* Free device memory in bytes (0 when unknown or not a GPU). */
uint64_t dfl_dp_mem_free(dfl_be *be);

#endif
