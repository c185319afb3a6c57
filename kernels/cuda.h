/* cuda.h: the CUDA backend's C API beyond the op table of backend.h, for the GPU pipeline
 * (dfl-target) and the GPU tests and benchmarks: the backend's streams, events, pinned host
 * memory, asynchronous copies, the allocation freeze that guarantees no allocation in the steady
 * state, device properties, and matmul / attention tuning. Compiled by gcc (lib/, bin/, tests/)
 * when DFL_CUDA is defined; implemented in kernels/be_cuda.cu. Handles are opaque: no CUDA
 * header is needed to use this one.
 *
 * Every function that takes a dfl_be takes one opened by dfl_be_cuda_open (be->kind ==
 * DFL_BE_CUDA); the ones that can fail return 0 or a DFL_E* code and fill e (which may be NULL).
 * Each makes the backend's device current on the calling thread first, so they may be called
 * from a writer thread.
 *
 * How the backend.h ops behave on CUDA: every op is enqueued on the compute stream and returns
 * at once; an op that fails returns its code and keeps its message, which the next ops->sync
 * reports (sync also reports errors of kernels that failed while running). ops->upload returns
 * when the source may be reused (it waits only for pinned sources); ops->download returns when
 * the data is in dst (it waits for the compute stream); memset0 and copy are asynchronous.
 * be->act == be->wdt == bf16 (default) or f32. The bf16 ops compute in f32 and round once per
 * output. The drafter ops (rmsnorm_bwd, ..., uniform_noise: train_ops.cu, dflash_attn.cu) keep
 * their reductions deterministic (no float atomics; partial sums in a fixed order) and use the
 * backend's cuBLAS workspace as scratch between their kernels; kernels/cuda_train.h has their
 * tuning knobs. */
#ifndef DFL_CUDA_H
#define DFL_CUDA_H

#include <stdbool.h>
#include <stddef.h>
#include <stdint.h>

#ifdef __cplusplus
extern "C" {
#endif

#include "backend.h"
#include "err.h"

typedef struct dfl_cuda_stream_s *dfl_cuda_stream;  /* a cudaStream_t */
typedef struct dfl_cuda_event_s *dfl_cuda_event;    /* a cudaEvent_t */

/* ---- device ---- */
typedef struct dfl_cuda_props {
    char name[256];        /* "NVIDIA H200" */
    int device;
    int cc_major, cc_minor;
    int sm_count;
    size_t mem_total;      /* bytes */
    size_t mem_free;       /* bytes free now (cudaMemGetInfo) */
    size_t smem_per_block_optin;
    size_t l2_bytes;
} dfl_cuda_props;

/* Properties of device `device` (creates its context if needed, for mem_free). */
int dfl_cuda_device_props(int device, dfl_cuda_props *p, dfl_err *e);

/* ---- streams ----
 * The compute stream is the one every op of the backend is enqueued on. The copy stream is a
 * second non-blocking stream of the same device for device->host copies that overlap compute;
 * order it against the compute stream with events (record on one, wait on the other). */
dfl_cuda_stream dfl_cuda_compute_stream(dfl_be *be);
dfl_cuda_stream dfl_cuda_copy_stream(dfl_be *be);
/* Wait on the host until everything enqueued on s has run; reports asynchronous errors. */
int dfl_cuda_stream_sync(dfl_be *be, dfl_cuda_stream s, dfl_err *e);

/* ---- events ----
 * timing: create with timing enabled (for dfl_cuda_event_elapsed); otherwise the cheaper
 * synchronization-only kind. */
int dfl_cuda_event_create(dfl_be *be, dfl_cuda_event *ev, bool timing, dfl_err *e);
void dfl_cuda_event_destroy(dfl_be *be, dfl_cuda_event ev);
/* Capture the work enqueued on s so far. */
int dfl_cuda_event_record(dfl_be *be, dfl_cuda_event ev, dfl_cuda_stream s, dfl_err *e);
/* Make future work on s wait until ev has completed (no host wait). */
int dfl_cuda_stream_wait_event(dfl_be *be, dfl_cuda_stream s, dfl_cuda_event ev, dfl_err *e);
/* *done = whether ev has completed (never blocks). */
int dfl_cuda_event_query(dfl_be *be, dfl_cuda_event ev, bool *done, dfl_err *e);
/* Wait on the host until ev has completed. */
int dfl_cuda_event_sync(dfl_be *be, dfl_cuda_event ev, dfl_err *e);
/* Milliseconds between two completed timing events. */
int dfl_cuda_event_elapsed(dfl_be *be, dfl_cuda_event start, dfl_cuda_event end, float *ms,
                           dfl_err *e);

/* ---- pinned host memory ---- */
/* Page-locked host memory (cudaHostAlloc, portable); NULL with e filled on failure. */
void *dfl_cuda_host_alloc(dfl_be *be, size_t bytes, dfl_err *e);
void dfl_cuda_host_free(dfl_be *be, void *p);
/* Page-lock an existing mapping (e.g. an mmap-ed file) so that copies from it run at full
 * speed and asynchronously. read_only: the mapping is not writable (PROT_READ). */
int dfl_cuda_host_register(dfl_be *be, void *p, size_t bytes, bool read_only, dfl_err *e);
int dfl_cuda_host_unregister(dfl_be *be, void *p, dfl_err *e);

/* ---- asynchronous copies on a given stream ----
 * Truly asynchronous only with pinned (or registered) host memory: the host buffer must stay
 * valid and unchanged (upload) / unread (download) until an event recorded after the copy has
 * completed. */
int dfl_cuda_download_async(dfl_be *be, void *dst_host, const void *src_dev, size_t bytes,
                            dfl_cuda_stream s, dfl_err *e);
int dfl_cuda_upload_async(dfl_be *be, void *dst_dev, const void *src_host, size_t bytes,
                          dfl_cuda_stream s, dfl_err *e);

/* ---- allocations ----
 * be_alloc is a plain cudaMalloc, tracked. After dfl_cuda_freeze(be, true) every allocation
 * fails with DFL_ENOMEM and a message saying so: set up every buffer first, freeze, then run
 * the steady state. dfl_cuda_freeze(be, false) allows allocation again (teardown, tests). */
void dfl_cuda_freeze(dfl_be *be, bool frozen);
bool dfl_cuda_frozen(dfl_be *be);
typedef struct dfl_cuda_mem {
    size_t allocated;      /* bytes held now through be_alloc (not counting the backend's own) */
    size_t peak;           /* most ever held at once */
    size_t n_allocs;       /* live allocations */
    size_t backend_bytes;  /* the backend's own buffers (cuBLASLt workspace) */
} dfl_cuda_mem;
void dfl_cuda_mem_stats(dfl_be *be, dfl_cuda_mem *m);

/* ---- the gated delta rule ----
 * ops->gated_delta runs bf16 activations with key head dim 64 or 128 and a value head dim that is
 * a multiple of 64 on tensor cores (TF32 products, f32 state), everything else on the SIMT kernel
 * (f32 math). On tensor cores it runs the two-pass form (the key-side work of all chunks at once,
 * then the state pass) with a workspace of 4 (3 dk + dv + 65) bytes per value head and row, rows
 * = T + 64 (grown through be_alloc on a call that needs more; where it cannot grow, with the
 * allocation frozen or the memory short, the one-kernel form below runs instead). This runs the SIMT kernel for any size the op takes: the reference the GPU tests
 * and the micro-benchmark compare the tensor-core kernel with. Same contract as the op. */
int dfl_cuda_gated_delta_simt(dfl_be *be, const dfl_gated_delta *g);
/* The one-kernel tensor-core form where the op takes tensor cores (the SIMT kernel elsewhere):
 * what the op ran before the two-pass form (and runs with DFL_CUDA_GDN_SPLIT=0). Same contract. */
int dfl_cuda_gated_delta_fused(dfl_be *be, const dfl_gated_delta *g);
/* The passes of the two-pass form (bit 0 the key-side pass, bit 1 the state pass, which reads
 * what the last key-side pass of the same sizes left in the workspace), to time them apart;
 * 1 where the two-pass form does not take the call. */
int dfl_cuda_gated_delta_pass(dfl_be *be, const dfl_gated_delta *g, int passes);

/* ---- host waits ----
 * Counts, since the backend opened, of the calls that made the host wait for the device: syncs
 * = calls that wait until a whole stream has drained (ops->sync, ops->download, ops->upload from
 * pinned memory, dfl_cuda_stream_sync), after which the GPU idles until the host enqueues more;
 * event_waits = dfl_cuda_event_sync calls on an event that had not completed yet (the host waited
 * while later work stayed queued, so the GPU kept running). A steady state with no syncs never
 * lets the GPU run dry because of the host. */
typedef struct dfl_cuda_waits {
    uint64_t syncs, event_waits;
} dfl_cuda_waits;
void dfl_cuda_wait_stats(dfl_be *be, dfl_cuda_waits *w);

/* ---- tuning ----
 * Time up to max_algos of cuBLASLt's candidate algorithms for this matmul shape at the clocks a
 * long run leaves the GPU (a quarter second of the first choice, then `rounds` rounds of a 25 ms
 * slice of each candidate; about 0.25 + rounds x candidates x 0.025 s), on the given buffers (C
 * is overwritten, so pass scratch when beta != 0), and keep the fastest for every later call with
 * the same shape, types, transposes, leading dimensions and alignments. best_ms / heuristic_ms
 * (may be NULL): time per call of the chosen algorithm and of cuBLASLt's first choice. */
int dfl_cuda_matmul_tune(dfl_be *be, const dfl_mm *m, int max_algos, int rounds, float *best_ms,
                         float *heuristic_ms, dfl_err *e);

/* The algorithm of m's plan as bytes that can be stored (the backend's matmul_algo): a->key
 * from the plan's key, a->scope "GPU NAME sm_XY cuBLASLt VERSION"; with set, the plan takes
 * a->bytes once cublasLtMatmulAlgoCheck accepts them for it (DFL_EDATA when not). DFL_EUNSUP for
 * a product that goes through the cublasGemmEx fallback. */
int dfl_cuda_matmul_algo(dfl_be *be, const dfl_mm *m, dfl_mm_algo *a, bool set, dfl_err *e);

/* Use cuBLASLt's candidate `index` (0: its first choice, as without a pick) for every later call
 * with m's shape, types, transposes, leading dimensions and alignments; *n_algos (may be NULL):
 * how many candidates there are (up to 32); desc (may be NULL): the candidate's configuration
 * ("algo A tile T stages S cluster C split-K K swizzle W option O", cuBLASLt's enum values). An
 * index out of range fails (DFL_EUSAGE), leaving the choice as it was. */
int dfl_cuda_matmul_pick(dfl_be *be, const dfl_mm *m, int index, int *n_algos, char *desc, size_t desc_n,
                         dfl_err *e);

/* ---- the TMA GEMM (kernels/gemm_tma.cu: Hopper, bf16 activations) ----
 * C = A W^T, A [M, K] (lda), W [N, K] (ldw), both row-major (a linear layer's product), f32
 * accumulation, on the compute stream, with one of three epilogues:
 *   DFL_CUDA_GEMM_STORE   C [M, N] = the product, rounded to bf16 once;
 *   DFL_CUDA_GEMM_ACC     C [M, N] = the product + Cin (Cin NULL: C itself), summed in f32 and
 *                         rounded once (cuBLAS's beta 1);
 *   DFL_CUDA_GEMM_SWIGLU  W's rows are gate [0, N/2) then up [N/2, N): C [M, N/2] =
 *                         silu(g) * u of the two products, each rounded to bf16 first (swiglu
 *                         after a bf16 gate|up product, without the [M, N] intermediate).
 * _fits says whether the kernel takes the product (a compute-capability 9 device, K a multiple
 * of 64, the output columns a multiple of 256 (SWIGLU: of 128), 16-byte aligned A and W with
 * leading dimensions of multiples of 8); dfl_cuda_gemm_tma fails with DFL_EUNSUP otherwise. */
enum { DFL_CUDA_GEMM_STORE = 0, DFL_CUDA_GEMM_ACC = 1, DFL_CUDA_GEMM_SWIGLU = 2 };
bool dfl_cuda_gemm_tma_fits(dfl_be *be, const void *C, int64_t ldc, const void *A, int64_t lda,
                            const void *W, int64_t ldw, int64_t M, int64_t N, int64_t K, int mode);
int dfl_cuda_gemm_tma(dfl_be *be, void *C, int64_t ldc, const void *Cin, const void *A, int64_t lda,
                      const void *W, int64_t ldw, int64_t M, int64_t N, int64_t K, int mode);

/* The bf16 attention kernel has a few tile configurations per head dimension. Name of variant
 * v for head dimension d (NULL when v is out of range), and choose the one attn_varlen uses. */
const char *dfl_cuda_attn_variant_name(int d, int v);
int dfl_cuda_attn_set_variant(dfl_be *be, int d, int v, dfl_err *e);
/* The variant attn_varlen uses now for head dimension d (-1 when d has no tiled kernel). */
int dfl_cuda_attn_get_variant(dfl_be *be, int d);

#ifdef __cplusplus
}
#endif

#endif
