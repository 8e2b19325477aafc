/* libhipblas.so.3 link stub: the hipBLAS functions ggml's HIP backend calls (the declarations are
 * in hip_kernels/stubs/include/hipblas/hipblas.h). Each aborts with a message if called. */
#include "stub_abort.h"
#define S(name) DFLASH_STUB("libhipblas", name)
S(hipblasCreate)
S(hipblasDestroy)
S(hipblasSetStream)
S(hipblasStatusToString)
S(hipblasSgemm)
S(hipblasSgemmBatched)
S(hipblasSgemmStridedBatched)
S(hipblasGemmEx)
S(hipblasGemmBatchedEx)
S(hipblasGemmStridedBatchedEx)
S(hipblasStrsmBatched)
