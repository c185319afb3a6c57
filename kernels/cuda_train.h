/* cuda_train.h: tuning knobs of the CUDA backend's drafter kernels (kernels/dflash_attn.cu), for
 * the benchmarks and the GPU tests. Compiled by gcc (tests) when DFL_CUDA is defined. The
 * choices are process-wide (they apply to every CUDA backend of the process) and only change
 * speed, never results beyond rounding.
 *
 * The bf16 DFlash attention has three tiled kernels, each with a few tile configurations per
 * head dimension (32, 64, 128): DFL_DFLASH_FWD (forward), DFL_DFLASH_BWD_Q (backward, one CTA
 * per group of blocks and kv head: delta, dq, dk_blk, dv_blk) and DFL_DFLASH_BWD_KV (backward,
 * one CTA per context key tile and kv head: dk_ctx, dv_ctx). Variant 0 is the default. */
#ifndef DFL_CUDA_TRAIN_H
#define DFL_CUDA_TRAIN_H

#ifdef __cplusplus
extern "C" {
#endif

enum { DFL_DFLASH_FWD = 0, DFL_DFLASH_BWD_Q = 1, DFL_DFLASH_BWD_KV = 2 };

/* Name of variant v of kernel k for head dimension d; NULL when out of range. */
const char *dfl_cuda_dflash_variant_name(int k, int d, int v);
/* Choose it (0 on success, -1 when out of range). */
int dfl_cuda_dflash_set_variant(int k, int d, int v);
/* Force the exact f32 kernels even for bf16 inputs (tests: compare both paths). */
void dfl_cuda_dflash_force_simple(int on);
/* Benchmarks only: which passes dflash_attn_bwd runs (bit 0: pass Q, with delta, dq, dk_blk,
 * dv_blk; bit 1: the schedule and pass KV, dk_ctx and dv_ctx; default 3). Pass KV reads the
 * delta written by pass Q. */
void dfl_cuda_dflash_bwd_passes(int mask);
/* The backward with the score gradients kept (on by default; DFL_CUDA_DFLASH_DS=0 turns it off):
 * on the d128 defaults of a compute capability 9 device, with blocks of 64 query rows a kv head
 * (heads / kv heads x block size) and the host copies of ctx_start and anchor given, pass KV
 * runs first (after delta and the schedule), writes dS, and pass Q reads it back instead of
 * recomputing it; in bench-train-ops' "each pass alone", pass KV's part includes delta, the
 * schedule and the plan. on: 1 or 0 (tests and benchmarks: compare both). */
void dfl_cuda_dflash_bwd_ds(int on);

#ifdef __cplusplus
}
#endif

#endif
