// dflash LINK STUB, not hipBLAS. Declares only what ggml's HIP backend (ggml-cuda/*.cu compiled
// with GGML_USE_HIP at llama.cpp 0c1e57098) uses from hipBLAS, with hipBLAS 3 (ROCm 7) types and
// enum values, so that the sources compile without ROCm. The matching definitions in
// hip_kernels/stubs/src/hipblas_stub.c abort with a message if called: a library linked against
// them compiles and links, but must be run against ROCm's real libhipblas.so.
#pragma once
#ifndef DFLASH_HIPBLAS_STUB_H
#define DFLASH_HIPBLAS_STUB_H

#include <stdint.h>
#include <hip/hip_runtime_api.h>
#include <hip/library_types.h>        // hipDataType

// hipblas-common's status, operation and compute types (values as in hipBLAS 3), declared here:
// the triton header set this build uses carries no hipblas-common.
typedef enum {
    HIPBLAS_STATUS_SUCCESS = 0, HIPBLAS_STATUS_NOT_INITIALIZED = 1, HIPBLAS_STATUS_ALLOC_FAILED = 2,
    HIPBLAS_STATUS_INVALID_VALUE = 3, HIPBLAS_STATUS_MAPPING_ERROR = 4, HIPBLAS_STATUS_EXECUTION_FAILED = 5,
    HIPBLAS_STATUS_INTERNAL_ERROR = 6, HIPBLAS_STATUS_NOT_SUPPORTED = 7, HIPBLAS_STATUS_ARCH_MISMATCH = 8,
    HIPBLAS_STATUS_HANDLE_IS_NULLPTR = 9, HIPBLAS_STATUS_INVALID_ENUM = 10, HIPBLAS_STATUS_UNKNOWN = 11
} hipblasStatus_t;
typedef enum { HIPBLAS_OP_N = 111, HIPBLAS_OP_T = 112, HIPBLAS_OP_C = 113 } hipblasOperation_t;
typedef enum {
    HIPBLAS_COMPUTE_16F = 0, HIPBLAS_COMPUTE_16F_PEDANTIC = 1, HIPBLAS_COMPUTE_32F = 2,
    HIPBLAS_COMPUTE_32F_PEDANTIC = 3, HIPBLAS_COMPUTE_32F_FAST_16F = 4, HIPBLAS_COMPUTE_32F_FAST_16BF = 5,
    HIPBLAS_COMPUTE_32F_FAST_TF32 = 6, HIPBLAS_COMPUTE_64F = 7, HIPBLAS_COMPUTE_64F_PEDANTIC = 8,
    HIPBLAS_COMPUTE_32I = 9, HIPBLAS_COMPUTE_32I_PEDANTIC = 10
} hipblasComputeType_t;

#define DFLASH_HIPBLAS_STUB 1

typedef void* hipblasHandle_t;
typedef int64_t hipblasStride;

typedef enum { HIPBLAS_FILL_MODE_UPPER = 121, HIPBLAS_FILL_MODE_LOWER = 122, HIPBLAS_FILL_MODE_FULL = 123 } hipblasFillMode_t;
typedef enum { HIPBLAS_DIAG_NON_UNIT = 131, HIPBLAS_DIAG_UNIT = 132 } hipblasDiagType_t;
typedef enum { HIPBLAS_SIDE_LEFT = 141, HIPBLAS_SIDE_RIGHT = 142, HIPBLAS_SIDE_BOTH = 143 } hipblasSideMode_t;
typedef enum { HIPBLAS_GEMM_DEFAULT = 160 } hipblasGemmAlgo_t;

// ggml's vendors/hip.h maps CUDA_R_* to HIPBLAS_R_*, and picks the GEMM type API by HIP version:
// from HIP 6.5 hipBLAS 3 (hipDataType for data, hipblasComputeType_t for compute), before it
// hipBLAS 2's single hipblasDatatype_t for both. The stub follows the headers it is compiled with.
#include <hip/hip_version.h>
#if HIP_VERSION >= 60500000
#define HIPBLAS_R_16F HIP_R_16F
#define HIPBLAS_R_32F HIP_R_32F
#define HIPBLAS_R_16B HIP_R_16BF
typedef hipDataType dflash_hipblas_data_t;
typedef hipblasComputeType_t dflash_hipblas_compute_t;
#else
typedef enum { HIPBLAS_R_16F = 150, HIPBLAS_R_32F = 151, HIPBLAS_R_64F = 152, HIPBLAS_R_16B = 168 } hipblasDatatype_t;
typedef hipblasDatatype_t dflash_hipblas_data_t;
typedef hipblasDatatype_t dflash_hipblas_compute_t;
#endif

#ifdef __cplusplus
extern "C" {
#endif

hipblasStatus_t hipblasCreate(hipblasHandle_t* handle);
hipblasStatus_t hipblasDestroy(hipblasHandle_t handle);
hipblasStatus_t hipblasSetStream(hipblasHandle_t handle, hipStream_t stream);
const char* hipblasStatusToString(hipblasStatus_t status);

hipblasStatus_t hipblasSgemm(hipblasHandle_t handle, hipblasOperation_t transA, hipblasOperation_t transB,
                             int m, int n, int k, const float* alpha, const float* AP, int lda,
                             const float* BP, int ldb, const float* beta, float* CP, int ldc);
hipblasStatus_t hipblasSgemmBatched(hipblasHandle_t handle, hipblasOperation_t transA, hipblasOperation_t transB,
                                    int m, int n, int k, const float* alpha, const float* const AP[], int lda,
                                    const float* const BP[], int ldb, const float* beta, float* const CP[],
                                    int ldc, int batchCount);
hipblasStatus_t hipblasSgemmStridedBatched(hipblasHandle_t handle, hipblasOperation_t transA,
                                           hipblasOperation_t transB, int m, int n, int k, const float* alpha,
                                           const float* AP, int lda, hipblasStride strideA, const float* BP,
                                           int ldb, hipblasStride strideB, const float* beta, float* CP, int ldc,
                                           hipblasStride strideC, int batchCount);
hipblasStatus_t hipblasGemmEx(hipblasHandle_t handle, hipblasOperation_t transA, hipblasOperation_t transB,
                              int m, int n, int k, const void* alpha, const void* A, dflash_hipblas_data_t aType, int lda,
                              const void* B, dflash_hipblas_data_t bType, int ldb, const void* beta, void* C,
                              dflash_hipblas_data_t cType, int ldc, dflash_hipblas_compute_t computeType, hipblasGemmAlgo_t algo);
hipblasStatus_t hipblasGemmBatchedEx(hipblasHandle_t handle, hipblasOperation_t transA, hipblasOperation_t transB,
                                     int m, int n, int k, const void* alpha, const void* A[], dflash_hipblas_data_t aType,
                                     int lda, const void* B[], dflash_hipblas_data_t bType, int ldb, const void* beta,
                                     void* C[], dflash_hipblas_data_t cType, int ldc, int batchCount,
                                     dflash_hipblas_compute_t computeType, hipblasGemmAlgo_t algo);
hipblasStatus_t hipblasGemmStridedBatchedEx(hipblasHandle_t handle, hipblasOperation_t transA,
                                            hipblasOperation_t transB, int m, int n, int k, const void* alpha,
                                            const void* A, dflash_hipblas_data_t aType, int lda, hipblasStride strideA,
                                            const void* B, dflash_hipblas_data_t bType, int ldb, hipblasStride strideB,
                                            const void* beta, void* C, dflash_hipblas_data_t cType, int ldc,
                                            hipblasStride strideC, int batchCount,
                                            dflash_hipblas_compute_t computeType, hipblasGemmAlgo_t algo);
hipblasStatus_t hipblasStrsmBatched(hipblasHandle_t handle, hipblasSideMode_t side, hipblasFillMode_t uplo,
                                    hipblasOperation_t transA, hipblasDiagType_t diag, int m, int n,
                                    const float* alpha, const float* const AP[], int lda, float* const BP[],
                                    int ldb, int batchCount);

#ifdef __cplusplus
}
#endif

#endif  // DFLASH_HIPBLAS_STUB_H
