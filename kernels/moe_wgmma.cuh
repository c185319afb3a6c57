/* moe_wgmma.cuh: the host entry points of the wgmma grouped expert GEMM (kernels/moe_wgmma.cu)
 * for kernels/moe.cu. */
#ifndef DFL_MOE_WGMMA_CUH
#define DFL_MOE_WGMMA_CUH

#include "backend.h"

/* Whether the wgmma kernel takes m on device (compute capability 9, K % MW_BK == 0, cap %
 * MW_BM == 0, A and W 16-byte aligned); then cuda_moe_wgmma launches it on s (a launch error is
 * left for the caller's check; the return value is the shared-memory opt-in's). */
bool cuda_moe_wgmma_fits(const dfl_moe_mm *m, int device);
cudaError_t cuda_moe_wgmma(const dfl_moe_mm *m, cudaStream_t s);

#endif
