// dflash narrow MMVQ in ggml (added by dflash's hip_kernels patch set).
//
// MUL_MAT with Q8_0 / Q4_0 / Q4_K / MXFP4 weights and 1 <= ne11 <= LUCE_MMVQ_MAX_NCOLS, and
// routed-expert MUL_MAT_ID with up to min(4, LUCE_MMVQ_MAX_NCOLS) tokens, run kernels whose
// per-column result does not depend on the batch width (hip_kernels/include/dflash_mmvq/body.h).
// Compiled for HIP only (RDNA3 / RDNA3.5 / RDNA4); GGML_DFLASH_MMVQ_CUDA also turns it on in a
// CUDA build, for testing the same code on NVIDIA hardware.
#pragma once

#include "common.cuh"

#if defined(GGML_USE_HIP) || defined(GGML_DFLASH_MMVQ_CUDA)
#define GGML_DFLASH_MMVQ 1

// Widest batch routed here. LUCE_MMVQ_MAX_NCOLS is read once: unset -> 4, <= 0 -> 8, > 8 -> 8
// (wider batches always stay on ggml's MMQ).
int dflash_mmvq_max_ncols();

bool dflash_mmvq_use_mul_mat(const ggml_tensor * src0, const ggml_tensor * src1, const ggml_tensor * dst, int cc);
bool dflash_mmvq_use_mul_mat_id(const ggml_tensor * dst, int cc);
bool dflash_mmvq_use(const ggml_tensor * node, int cc);  // MUL_MAT or MUL_MAT_ID node

// ids == nullptr: MUL_MAT; otherwise MUL_MAT_ID with dst->src[2] == ids.
void dflash_mmvq_mul_mat(ggml_backend_cuda_context & ctx, const ggml_tensor * src0, const ggml_tensor * src1,
                         const ggml_tensor * ids, ggml_tensor * dst);
#endif
