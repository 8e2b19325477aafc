// Test-only stand-in for cuBLAS's header, which this CUDA install lacks: just enough
// declarations for ggml-cuda/common.cuh to parse, so nvcc can type-check the dflash glue
// (ggml_glue_compiles_nvcc). Nothing is linked against it.
#pragma once
#include <cstddef>
#include <cuda_runtime.h>

#define CUBLAS_VER_MAJOR 13
#define CUBLAS_VER_MINOR 0

typedef struct dflash_cublas_context * cublasHandle_t;
typedef enum {
    CUBLAS_STATUS_SUCCESS = 0,
    CUBLAS_STATUS_NOT_INITIALIZED = 1,
    CUBLAS_STATUS_ALLOC_FAILED = 3,
    CUBLAS_STATUS_INVALID_VALUE = 7,
    CUBLAS_STATUS_ARCH_MISMATCH = 8,
    CUBLAS_STATUS_MAPPING_ERROR = 11,
    CUBLAS_STATUS_EXECUTION_FAILED = 13,
    CUBLAS_STATUS_INTERNAL_ERROR = 14,
    CUBLAS_STATUS_NOT_SUPPORTED = 15,
} cublasStatus_t;
typedef enum { CUBLAS_DEFAULT_MATH = 0, CUBLAS_TF32_TENSOR_OP_MATH = 3 } cublasMath_t;
typedef enum { CUBLAS_COMPUTE_16F = 64, CUBLAS_COMPUTE_32F = 68 } cublasComputeType_t;
typedef enum { CUBLAS_OP_N = 0, CUBLAS_OP_T = 1 } cublasOperation_t;
typedef enum { CUBLAS_GEMM_DEFAULT = -1, CUBLAS_GEMM_DEFAULT_TENSOR_OP = 99 } cublasGemmAlgo_t;

const char * cublasGetStatusString(cublasStatus_t status);
cublasStatus_t cublasCreate(cublasHandle_t * handle);
cublasStatus_t cublasSetMathMode(cublasHandle_t handle, cublasMath_t mode);
cublasStatus_t cublasSetStream(cublasHandle_t handle, cudaStream_t stream);
cublasStatus_t cublasSetWorkspace(cublasHandle_t handle, void * workspace, size_t size);

// Used only by ggml-cuda.cu itself (for a type check of the patched file): any arguments.
template <typename... A> cublasStatus_t cublasDestroy(A...);
template <typename... A> cublasStatus_t cublasSgemm(A...);
template <typename... A> cublasStatus_t cublasGemmEx(A...);
template <typename... A> cublasStatus_t cublasGemmBatchedEx(A...);
template <typename... A> cublasStatus_t cublasGemmStridedBatchedEx(A...);
template <typename... A> cublasStatus_t cublasLoggerConfigure(A...);
