/* cublas_dl.cuh: cuBLAS and cuBLASLt are loaded (dlopen) when a CUDA backend is first opened, not
 * linked: a program linked with them spends about 0.4 s of every start in their initialisation,
 * GPU or not, and every dfl program and test pays that. The cuBLAS names used in kernels/ are
 * macros here for the pointers of dfl_cublas (the _v2 names that cublas_v2.h maps to), so that
 * the calls read as ordinary cuBLAS calls. Included by be_cuda.cuh after the cuBLAS headers;
 * dfl_cublas_load (be_cuda.cu) fills the table once. */
#ifndef DFL_CUBLAS_DL_CUH
#define DFL_CUBLAS_DL_CUH

#include <cublasLt.h>
#include <cublas_v2.h>
#include <stddef.h>

struct dfl_cublas_api {
    decltype(&cublasLtCreate) LtCreate;
    decltype(&cublasLtDestroy) LtDestroy;
    decltype(&cublasLtGetStatusString) LtGetStatusString;
    decltype(&cublasLtMatmul) LtMatmul;
    decltype(&cublasLtMatmulDescCreate) LtMatmulDescCreate;
    decltype(&cublasLtMatmulDescDestroy) LtMatmulDescDestroy;
    decltype(&cublasLtMatmulDescSetAttribute) LtMatmulDescSetAttribute;
    decltype(&cublasLtMatrixLayoutCreate) LtMatrixLayoutCreate;
    decltype(&cublasLtMatrixLayoutDestroy) LtMatrixLayoutDestroy;
    decltype(&cublasLtMatmulPreferenceCreate) LtMatmulPreferenceCreate;
    decltype(&cublasLtMatmulPreferenceDestroy) LtMatmulPreferenceDestroy;
    decltype(&cublasLtMatmulPreferenceSetAttribute) LtMatmulPreferenceSetAttribute;
    decltype(&cublasLtMatmulAlgoGetHeuristic) LtMatmulAlgoGetHeuristic;
    decltype(&cublasLtMatmulAlgoConfigGetAttribute) LtMatmulAlgoConfigGetAttribute;
    decltype(&cublasLtMatmulAlgoCheck) LtMatmulAlgoCheck;
    decltype(&cublasLtGetVersion) LtGetVersion;
    decltype(&cublasCreate_v2) Create;
    decltype(&cublasDestroy_v2) Destroy;
    decltype(&cublasSetStream_v2) SetStream;
    decltype(&cublasSetWorkspace_v2) SetWorkspace;
    decltype(&cublasGetStatusString) GetStatusString;
    /* spelled out: C++ sees an inline overload of cublasGemmEx in cublas_api.h */
    cublasStatus_t (*GemmEx)(cublasHandle_t, cublasOperation_t, cublasOperation_t, int, int, int,
                             const void *, const void *, cudaDataType, int, const void *,
                             cudaDataType, int, const void *, void *, cudaDataType, int,
                             cublasComputeType_t, cublasGemmAlgo_t);
};
extern dfl_cublas_api dfl_cublas;

/* Loads libcublasLt and libcublas of this build's major version once (thread-safe). 0, or -1
 * with what failed (the library or the symbol, and dlerror) in msg. */
int dfl_cublas_load(char *msg, size_t n);

#define cublasLtCreate (dfl_cublas.LtCreate)
#define cublasLtDestroy (dfl_cublas.LtDestroy)
#define cublasLtGetStatusString (dfl_cublas.LtGetStatusString)
#define cublasLtMatmul (dfl_cublas.LtMatmul)
#define cublasLtMatmulDescCreate (dfl_cublas.LtMatmulDescCreate)
#define cublasLtMatmulDescDestroy (dfl_cublas.LtMatmulDescDestroy)
#define cublasLtMatmulDescSetAttribute (dfl_cublas.LtMatmulDescSetAttribute)
#define cublasLtMatrixLayoutCreate (dfl_cublas.LtMatrixLayoutCreate)
#define cublasLtMatrixLayoutDestroy (dfl_cublas.LtMatrixLayoutDestroy)
#define cublasLtMatmulPreferenceCreate (dfl_cublas.LtMatmulPreferenceCreate)
#define cublasLtMatmulPreferenceDestroy (dfl_cublas.LtMatmulPreferenceDestroy)
#define cublasLtMatmulPreferenceSetAttribute (dfl_cublas.LtMatmulPreferenceSetAttribute)
#define cublasLtMatmulAlgoGetHeuristic (dfl_cublas.LtMatmulAlgoGetHeuristic)
#define cublasLtMatmulAlgoConfigGetAttribute (dfl_cublas.LtMatmulAlgoConfigGetAttribute)
#define cublasLtMatmulAlgoCheck (dfl_cublas.LtMatmulAlgoCheck)
#define cublasLtGetVersion (dfl_cublas.LtGetVersion)
#define cublasCreate_v2 (dfl_cublas.Create)
#define cublasDestroy_v2 (dfl_cublas.Destroy)
#define cublasSetStream_v2 (dfl_cublas.SetStream)
#define cublasSetWorkspace_v2 (dfl_cublas.SetWorkspace)
#define cublasGetStatusString (dfl_cublas.GetStatusString)
#define cublasGemmEx (dfl_cublas.GemmEx)

#endif
