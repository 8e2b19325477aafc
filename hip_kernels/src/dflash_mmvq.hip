// dflash narrow MMVQ: the extern "C" kernels of the code objects (dflash_mmvq_<arch>.hsaco).
// Each is a thin wrapper around the templated body in include/dflash_mmvq/body.h; see README.md
// for names, arguments and launch geometry. Also included by tests/cuda_selftest.cu (nvcc).
#include "dflash_mmvq/body.h"

#if defined(__HIP_DEVICE_COMPILE__) && __AMDGCN_WAVEFRONT_SIZE != 32
#error "dflash MMVQ code objects are built for wave32 (RDNA3.5 / RDNA4)"
#endif

// y[c*y_col + row] = dot(W[row], x[c]) for c < NC.   grid (nrows, 1, 1), block (32, 4, 1)
#define DFLASH_MMVQ_DENSE(tname, T, NC)                                                               \
    extern "C" __global__ DF_LAUNCH_BOUNDS(dfmmvq::kThreads) void dflash_mmvq_##tname##_nc##NC(      \
        const void* w, const void* xq, float* y, int32_t nblocks, int32_t nrows, int64_t w_row,     \
        int64_t x_col, int64_t y_col) {                                                              \
        const dfmmvq::dense_args a = {(const uint8_t*)w, (const dfmmvq::q8_1_block*)xq, y, nblocks,  \
                                      nrows, w_row, x_col, y_col, 1, 1, 0, 0, 0, 0, 0, 0};           \
        dfmmvq::dense_block<dfmmvq::T, NC>(a);                                                       \
    }

// y[slot*y_slot + token*y_token + row] = dot(W[ids[slot*ids_slot + token*ids_token]][row],
//                                           x[(slot % nslots_x)*x_slot + token*x_token])
// grid (nrows, nslots, ntokens), block (32, 4, 1)
#define DFLASH_MMVQ_ID(tname, T)                                                                     \
    extern "C" __global__ DF_LAUNCH_BOUNDS(dfmmvq::kThreads) void dflash_mmvq_##tname##_id(          \
        const void* w, const void* xq, float* y, const int32_t* ids, int32_t nblocks, int32_t nrows, \
        int64_t w_row, int64_t w_expert, int64_t x_slot, int64_t x_token, int32_t nslots_x,         \
        int64_t y_slot, int64_t y_token, int64_t ids_slot, int64_t ids_token) {                      \
        const dfmmvq::id_args a = {(const uint8_t*)w, (const dfmmvq::q8_1_block*)xq, y, ids,        \
                                   nblocks, nrows, w_row, w_expert, x_slot, x_token, nslots_x,       \
                                   y_slot, y_token, ids_slot, ids_token};                            \
        dfmmvq::id_block<dfmmvq::T>(a);                                                              \
    }

#define DFLASH_MMVQ_TYPE(tname, T) \
    DFLASH_MMVQ_DENSE(tname, T, 1) \
    DFLASH_MMVQ_DENSE(tname, T, 2) \
    DFLASH_MMVQ_DENSE(tname, T, 3) \
    DFLASH_MMVQ_DENSE(tname, T, 4) \
    DFLASH_MMVQ_ID(tname, T)

DFLASH_MMVQ_TYPE(q8_0, Q8_0)
DFLASH_MMVQ_TYPE(q4_0, Q4_0)
DFLASH_MMVQ_TYPE(q4_k, Q4_K)
DFLASH_MMVQ_TYPE(mxfp4, MXFP4)
DFLASH_MMVQ_TYPE(q5_0, Q5_0)
DFLASH_MMVQ_TYPE(q5_k, Q5_K)
DFLASH_MMVQ_TYPE(q6_k, Q6_K)
