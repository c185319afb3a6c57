/* attn_wgmma.cuh: the host entry points of the wgmma attention kernel (kernels/attn_wgmma.cu)
 * for kernels/attn.cu. */
#ifndef DFL_ATTN_WGMMA_CUH
#define DFL_ATTN_WGMMA_CUH

#include <cuda_runtime.h>

#include "attn_tiled.cuh"

#define AW_KERNELS 3   /* 0: the overlapped schedule, 1: the plain one, 2: warp-specialized, persistent */

/* Whether device runs the wgmma kernel (compute capability 9) */
bool cuda_attn_wgmma_fits(int device);
/* Its shared-memory opt-in (kernel which), once at open on such a device */
cudaError_t cuda_attn_wgmma_init(int which);
/* Launches kernel which for head dimension 128 (bf16, 16-byte aligned, row strides multiples of
 * 8, as the tiled kernel needs) on s, grid as the tiled kernel's (x: sequence * heads + head,
 * y: query tiles of AW_BM rows; kernel 2 runs at most sms blocks that go through that grid's
 * tiles); a launch error is left for the caller's check. */
void cuda_attn_wgmma(const AttnParams &p, int which, dim3 grid, int sms, cudaStream_t s);

#endif
