// dflash narrow products in ggml (added by dflash's hip_kernels patch set).
//
// Routed here, for 1 <= ne11 (dense) or tokens (MUL_MAT_ID) <= LUCE_MMVQ_MAX_NCOLS:
//  - Q8_0 / Q4_0 / Q4_K / MXFP4 (and what dflash_mmvq_type_ok lists) weights: kernels whose
//    per-column result does not depend on the batch width (hip_kernels/include/dflash_mmvq/body.h);
//    dense products in chunks of at most 4 columns, routed experts one ncols = 1 product per
//    (slot, token).
//  - F32 / F16 / BF16 weights: ggml's own MMVF (ggml_cuda_mul_mat_vec_f). Its block size depends
//    on the row length only and every column runs the same per-lane loop and reduction, so it is
//    batch-invariant; stock ggml leaves it at width 4 (F16 on RDNA3/3.5, BF16) or 6 (F16 on RDNA4)
//    for MMF/hipBLAS, and with NVIDIA tensor cores already at width 2.
// Every product taken here is also kept out of ggml's fused MMVQ/MMVF paths (GLU, bias, scale),
// which exist for width 1 only and would give width 1 a different code path than widths 2..8.
// Compiled for HIP only (RDNA3 / RDNA3.5 / RDNA4); GGML_DFLASH_MMVQ_CUDA also turns it on in a
// CUDA build, for testing the same code on NVIDIA hardware.
#pragma once

#include "common.cuh"

#if defined(GGML_USE_HIP) || defined(GGML_DFLASH_MMVQ_CUDA)
#define GGML_DFLASH_MMVQ 1

// DFLASH_NARROW_MMVQ, read once: 1/0, true/false, yes/no, on/off (any case); unset or empty -> on;
// anything else -> a warning and on. Off: every dflash hook is inert and ggml runs as stock.
bool dflash_narrow_enabled();

// Widest batch routed here. LUCE_MMVQ_MAX_NCOLS is read once: unset -> 4, <= 0 -> 8, > 8 -> 8
// (wider batches always stay on ggml's MMQ / MMF / hipBLAS).
int dflash_mmvq_max_ncols();

bool dflash_mmvq_use_mul_mat(const ggml_tensor * src0, const ggml_tensor * src1, const ggml_tensor * dst, int cc);
bool dflash_mmvq_use_mul_mat_id(const ggml_tensor * dst, int cc);
bool dflash_mmvq_use(const ggml_tensor * node, int cc);  // MUL_MAT or MUL_MAT_ID node taken by a hook above

// ids == nullptr: MUL_MAT; otherwise MUL_MAT_ID with dst->src[2] == ids.
void dflash_mmvq_mul_mat(ggml_backend_cuda_context & ctx, const ggml_tensor * src0, const ggml_tensor * src1,
                         const ggml_tensor * ids, ggml_tensor * dst);
#endif
