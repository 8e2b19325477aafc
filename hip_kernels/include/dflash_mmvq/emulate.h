// dflash narrow MMVQ on the host: runs every lane of a block through the same lane_accumulate
// the GPU runs, then replays the GPU's reduction order (body.h, reduce_store) lane by lane.
// The result is bit-identical to the kernels when the float operations are rounded once each
// (host builds use -ffp-contract=off).
#pragma once

#include <cstdio>
#include <cstdlib>

#include "body.h"

namespace dfmmvq {

template <int T, int NC>
inline void emulate_row(const uint8_t* wrow, const q8_1_block* x, int64_t x_col, int nblocks, float (&out)[NC]) {
    float part[kThreads][NC];
    for (int tid = 0; tid < kThreads; ++tid) {
        lane_accumulate<T, NC>(wrow, x, x_col, nblocks, tid, part[tid]);
    }
    for (int c = 0; c < NC; ++c) {
        float v[kWarp];
        for (int l = 0; l < kWarp; ++l) {  // step 1: warp 0 adds warps 1 .. kWarps-1 in order
            v[l] = part[l][c];
            for (int w = 1; w < kWarps; ++w) {
                v[l] = fadd(v[l], part[w * kWarp + l][c]);
            }
        }
        for (int m = kWarp / 2; m > 0; m >>= 1) {  // step 2: butterfly, every lane at once
            float t[kWarp];
            for (int l = 0; l < kWarp; ++l) {
                t[l] = fadd(v[l], v[l ^ m]);
            }
            for (int l = 0; l < kWarp; ++l) {
                v[l] = t[l];
            }
        }
        out[c] = v[0];  // step 3: lane 0
    }
}

// y[c*y_col + r] for r < nrows, c < NC; w_row in bytes, x_col in q8_1 blocks.
template <int T, int NC>
inline void emulate_dense(const uint8_t* w, const q8_1_block* x, float* y, int nblocks, int nrows, int64_t w_row,
                          int64_t x_col, int64_t y_col) {
    for (int r = 0; r < nrows; ++r) {
        float out[NC];
        emulate_row<T, NC>(w + (int64_t)r * w_row, x, x_col, nblocks, out);
        for (int c = 0; c < NC; ++c) {
            y[c * y_col + r] = out[c];
        }
    }
}

template <int T>
inline void emulate_dense_ncols(int ncols, const uint8_t* w, const q8_1_block* x, float* y, int nblocks, int nrows,
                                int64_t w_row, int64_t x_col, int64_t y_col) {
    switch (ncols) {
        case 1: emulate_dense<T, 1>(w, x, y, nblocks, nrows, w_row, x_col, y_col); break;
        case 2: emulate_dense<T, 2>(w, x, y, nblocks, nrows, w_row, x_col, y_col); break;
        case 3: emulate_dense<T, 3>(w, x, y, nblocks, nrows, w_row, x_col, y_col); break;
        case 4: emulate_dense<T, 4>(w, x, y, nblocks, nrows, w_row, x_col, y_col); break;
        default: std::fprintf(stderr, "dflash_mmvq: ncols %d is not 1..4\n", ncols); std::abort();
    }
}

// Runtime (ggml type, ncols) -> template arguments.
inline void emulate_dense_any(int type, int ncols, const uint8_t* w, const q8_1_block* x, float* y, int nblocks,
                              int nrows, int64_t w_row, int64_t x_col, int64_t y_col) {
    switch (type) {
        case Q8_0:  emulate_dense_ncols<Q8_0>(ncols, w, x, y, nblocks, nrows, w_row, x_col, y_col); break;
        case Q4_0:  emulate_dense_ncols<Q4_0>(ncols, w, x, y, nblocks, nrows, w_row, x_col, y_col); break;
        case Q4_K:  emulate_dense_ncols<Q4_K>(ncols, w, x, y, nblocks, nrows, w_row, x_col, y_col); break;
        case MXFP4: emulate_dense_ncols<MXFP4>(ncols, w, x, y, nblocks, nrows, w_row, x_col, y_col); break;
        case Q5_0:  emulate_dense_ncols<Q5_0>(ncols, w, x, y, nblocks, nrows, w_row, x_col, y_col); break;
        case Q5_K:  emulate_dense_ncols<Q5_K>(ncols, w, x, y, nblocks, nrows, w_row, x_col, y_col); break;
        case Q6_K:  emulate_dense_ncols<Q6_K>(ncols, w, x, y, nblocks, nrows, w_row, x_col, y_col); break;
        default: std::fprintf(stderr, "dflash_mmvq: unsupported weight type %d\n", type); std::abort();
    }
}

}  // namespace dfmmvq
