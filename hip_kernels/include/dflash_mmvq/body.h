// dflash narrow MMVQ: y[c][row] = dot(W[row], x[c]) for c < NC, NC = 1..4.
//
// Block shape, fixed for every NC: kWarps warps of kWarp lanes, one output row per block.
// Lane tid = 32*warp + lane walks the slices tid, tid + kThreads, ... of its row and keeps one
// float accumulator per column. Columns never interact: column c goes through exactly the same
// operations, in the same order, whatever NC is, so column c of an NC = 4 call is bit-identical
// to an NC = 1 call on x[c]. Reduction (reduce_store; emulate.h replays it on the host):
//   1. warp 0 lane l: v = acc(warp 0, l); v = v + acc(warp w, l) for w = 1 .. kWarps-1
//   2. butterfly inside warp 0: v = v + v(lane ^ m) for m = 16, 8, 4, 2, 1
//   3. lane 0 stores v.
#pragma once

#include "formats.h"

namespace dfmmvq {

constexpr int kWarp = 32;                  // RDNA wave32 / NVIDIA warp
constexpr int kWarps = 4;                  // warps per block, identical for every NC
constexpr int kThreads = kWarp * kWarps;   // launch bounds and blockDim = (kWarp, kWarps)
constexpr int kMaxCols = 4;

// Per-lane partial sums: acc[c] over the slices tid, tid + kThreads, ...
// wrow: first weight block of the row; x: first q8_1 block of column 0; x_col: q8_1 blocks
// between columns; nblocks: weight blocks per row.
template <int T, int NC>
DF_FN void lane_accumulate(const uint8_t* wrow, const q8_1_block* x, int64_t x_col, int nblocks, int tid,
                           float (&acc)[NC]) {
    static_assert(NC >= 1 && NC <= kMaxCols, "ncols is 1..4");
    using tr = wtraits<T>;
    for (int c = 0; c < NC; ++c) {
        acc[c] = 0.0f;
    }
    const int nslices = nblocks * tr::spb;
    for (int s = tid; s < nslices; s += kThreads) {
        const int kb = s / tr::spb;
        slice<T> w;
        w.load(wrow + (int64_t)kb * tr::bytes, s % tr::spb);
        const q8_1_block* xb = x + (int64_t)kb * (tr::qk / 32);
        for (int c = 0; c < NC; ++c) {
            acc[c] = fadd(acc[c], w.dot(xb + c * x_col));
        }
    }
}

// Dense MUL_MAT: grid (nrows, ne2, ne3), one row per block. Weight channel i2 / r2, i3 / r3
// (ggml broadcasting). Strides: weights in bytes, x in q8_1 blocks, y in floats.
struct dense_args {
    const uint8_t* w;
    const q8_1_block* x;
    float* y;
    int nblocks, nrows;
    int64_t w_row, x_col, y_col;
    int r2, r3;
    int64_t w_s2, w_s3, x_s2, x_s3, y_s2, y_s3;
};

// Routed experts (MUL_MAT_ID): grid (nrows, slots, tokens); each (slot, token) pair is an
// NC = 1 product of expert ids[slot, token] with x column (slot % nslots_x, token).
struct id_args {
    const uint8_t* w;
    const q8_1_block* x;
    float* y;
    const int32_t* ids;
    int nblocks, nrows;
    int64_t w_row, w_expert;
    int64_t x_slot, x_token;
    int nslots_x;
    int64_t y_slot, y_token;
    int64_t ids_slot, ids_token;
};

#if defined(DF_GPU_LANG)
template <int NC>
DF_DEV void reduce_store(const float (&acc)[NC], float* y, int64_t y_col) {
    __shared__ float red[kWarps > 1 ? kWarps - 1 : 1][NC][kWarp];
    const int lane = lane_x(), warp = warp_y();
    if (warp > 0) {
        for (int c = 0; c < NC; ++c) {
            red[warp - 1][c][lane] = acc[c];
        }
    }
    block_barrier();
    if (warp > 0) {
        return;
    }
    for (int c = 0; c < NC; ++c) {
        float v = acc[c];
        for (int w = 1; w < kWarps; ++w) {
#if defined(DFLASH_MMVQ_PLANTED_ORDER)
            // a deliberately wrong variant the tests must reject: NC > 1 adds the warps last to
            // first, an order that depends on ncols (dflash_mmvq_<arch>_planted_order.hsaco)
            const int from = NC > 1 ? kWarps - w : w;
#else
            const int from = w;
#endif
            v = fadd(v, red[from - 1][c][lane]);
        }
        for (int m = kWarp / 2; m > 0; m >>= 1) {
            v = fadd(v, shfl_xor32(v, m));
        }
        if (lane == 0) {
            y[c * y_col] = v;
        }
    }
}

template <int T, int NC>
DF_DEV void dense_block(const dense_args& a) {
    const int row = block_id(0), i2 = block_id(1), i3 = block_id(2);
    if (row >= a.nrows) {
        return;
    }
    const uint8_t* wrow = a.w + (int64_t)(i2 / a.r2) * a.w_s2 + (int64_t)(i3 / a.r3) * a.w_s3 + (int64_t)row * a.w_row;
    const q8_1_block* x = a.x + i2 * a.x_s2 + i3 * a.x_s3;
    float acc[NC];
    lane_accumulate<T, NC>(wrow, x, a.x_col, a.nblocks, kWarp * warp_y() + lane_x(), acc);
    reduce_store<NC>(acc, a.y + i2 * a.y_s2 + i3 * a.y_s3 + row, a.y_col);
}

template <int T>
DF_DEV void id_block(const id_args& a) {
    const int row = block_id(0), slot = block_id(1), token = block_id(2);
    if (row >= a.nrows) {
        return;
    }
    const int64_t expert = a.ids[slot * a.ids_slot + token * a.ids_token];
    const uint8_t* wrow = a.w + expert * a.w_expert + (int64_t)row * a.w_row;
    const q8_1_block* x = a.x + (slot % a.nslots_x) * a.x_slot + token * a.x_token;
    float acc[1];
    lane_accumulate<T, 1>(wrow, x, 0, a.nblocks, kWarp * warp_y() + lane_x(), acc);
    reduce_store<1>(acc, a.y + slot * a.y_slot + token * a.y_token + row, 0);
}
#endif  // DF_GPU_LANG

}  // namespace dfmmvq
