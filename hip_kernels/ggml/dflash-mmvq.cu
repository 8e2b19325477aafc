// dflash narrow MMVQ in ggml: routing predicates and launches (see dflash-mmvq.cuh).
#include "dflash-mmvq.cuh"

#if defined(GGML_DFLASH_MMVQ)
#include "mmvf.cuh"
#include "quantize.cuh"
#include "dflash_mmvq/body.h"

#include <cctype>
#include <climits>
#include <cstdlib>
#include <cstring>

static_assert((int) dfmmvq::Q8_0 == (int) GGML_TYPE_Q8_0 && (int) dfmmvq::Q4_0 == (int) GGML_TYPE_Q4_0 &&
              (int) dfmmvq::Q4_K == (int) GGML_TYPE_Q4_K && (int) dfmmvq::MXFP4 == (int) GGML_TYPE_MXFP4,
              "dflash weight types are ggml_type values");
static_assert(sizeof(dfmmvq::q8_1_block) == sizeof(block_q8_1) && QK8_1 == 32, "q8_1 layout");

static constexpr int DFLASH_MMVQ_WIDEST = 8;  // == MMVQ_MAX_BATCH_SIZE
static_assert(DFLASH_MMVQ_WIDEST <= MMVF_MAX_BATCH_SIZE, "MMVF takes every width routed to it");

template <int T, int NC>
DF_LAUNCH_BOUNDS(dfmmvq::kThreads)
static __global__ void dflash_mmvq_dense(const dfmmvq::dense_args a) {
    dfmmvq::dense_block<T, NC>(a);
}

template <int T>
DF_LAUNCH_BOUNDS(dfmmvq::kThreads)
static __global__ void dflash_mmvq_id(const dfmmvq::id_args a) {
    dfmmvq::id_block<T>(a);
}

int dflash_mmvq_max_ncols() {
    static const int n = [] {
        const char * s = getenv("LUCE_MMVQ_MAX_NCOLS");
        if (s == nullptr || *s == '\0') {
            return 4;
        }
        char * end = nullptr;
        const long v = strtol(s, &end, 10);
        while (end != s && (*end == ' ' || *end == '\t' || *end == '\n')) {
            ++end;
        }
        if (end == s || *end != '\0') {
            GGML_LOG_WARN("dflash_mmvq: LUCE_MMVQ_MAX_NCOLS='%s' is not an integer, using 4\n", s);
            return 4;
        }
        return v <= 0 || v > DFLASH_MMVQ_WIDEST ? DFLASH_MMVQ_WIDEST : (int) v;
    }();
    return n;
}

bool dflash_narrow_enabled() {
    static const bool on = [] {
        const char * s = getenv("DFLASH_NARROW_MMVQ");
        if (s == nullptr) {
            return true;
        }
        char v[8] = {0};  // trimmed, lower case; longer than "false" cannot be a boolean
        size_t n = 0;
        const char * p = s;
        while (*p == ' ' || *p == '\t' || *p == '\n') {
            ++p;
        }
        for (; *p != '\0' && n < sizeof(v) - 1; ++p, ++n) {
            v[n] = (char) tolower((unsigned char) *p);
        }
        while (n > 0 && (v[n - 1] == ' ' || v[n - 1] == '\t' || v[n - 1] == '\n')) {
            v[--n] = '\0';
        }
        if (*p == '\0' && n == 0) {
            return true;  // set but empty: as if unset (dflash's Python side reads it the same way)
        }
        if (*p == '\0') {
            for (const char * t : {"1", "true", "yes", "on"}) {
                if (strcmp(v, t) == 0) {
                    return true;
                }
            }
            for (const char * f : {"0", "false", "no", "off"}) {
                if (strcmp(v, f) == 0) {
                    GGML_LOG_INFO("dflash_mmvq: DFLASH_NARROW_MMVQ=%s, every dflash hook is off\n", s);
                    return false;
                }
            }
        }
        GGML_LOG_WARN("dflash_mmvq: DFLASH_NARROW_MMVQ='%s' is not a boolean (1/0, true/false, yes/no, on/off), "
                      "using on\n", s);
        return true;
    }();
    return on;
}

// F32/F16/BF16 weights: ggml's own MMVF, which is batch-invariant (see dflash-mmvq.cuh)
static bool dflash_mmvf_type(ggml_type type) {
    return type == GGML_TYPE_F32 || type == GGML_TYPE_F16 || type == GGML_TYPE_BF16;
}

// What ggml_cuda_mul_mat_vec_f asserts and ggml_cuda_should_use_mmvf checks, except the width:
// even rows, float2/half2 aligned strides, unit element strides, broadcastable channels/samples.
static bool dflash_mmvf_layout_ok(const ggml_tensor * src0, const ggml_tensor * src1, const ggml_tensor * dst) {
    const size_t ts = ggml_type_size(src0->type);
    if (src0->ne[0] % 2 != 0 || src0->nb[0] != ts || src1->nb[0] != sizeof(float) || dst->nb[0] != sizeof(float)) {
        return false;
    }
    for (int i = 1; i < GGML_MAX_DIMS; ++i) {
        if (src0->nb[i] % (2*ts) != 0 || src1->nb[i] % (2*sizeof(float)) != 0) {
            return false;
        }
    }
    return src0->ne[1] <= INT_MAX && dst->ne[3] <= 65535 && src1->ne[3] % src0->ne[3] == 0 && dst->ne[3] == src1->ne[3];
}

static bool dflash_mmvq_type_ok(ggml_type type) {
    switch (type) {
        case GGML_TYPE_Q8_0:
        case GGML_TYPE_Q4_0:
        case GGML_TYPE_Q5_0:
        case GGML_TYPE_Q4_K:
        case GGML_TYPE_Q5_K:
        case GGML_TYPE_Q6_K:
        case GGML_TYPE_MXFP4:
            return true;
        default:
            return false;
    }
}

static bool dflash_mmvq_arch_ok(int cc) {
#if defined(GGML_USE_HIP)
    return GGML_CUDA_CC_IS_RDNA3(cc) || GGML_CUDA_CC_IS_RDNA4(cc);  // wave32 with v_dot4_i32_iu8
#else
    return GGML_CUDA_CC_IS_NVIDIA(cc);  // GGML_DFLASH_MMVQ_CUDA test builds
#endif
}

bool dflash_mmvq_use_mul_mat(const ggml_tensor * src0, const ggml_tensor * src1, const ggml_tensor * dst, int cc) {
    if (!dflash_narrow_enabled()) {
        return false;
    }
    if (dflash_mmvf_type(src0->type)) {
        const int64_t ncols = src1->ne[1];
        return src1->type == GGML_TYPE_F32 && dst->type == GGML_TYPE_F32 && dflash_mmvq_arch_ok(cc) && ncols >= 1 &&
               ncols <= dflash_mmvq_max_ncols() && dflash_mmvf_layout_ok(src0, src1, dst) &&
               src1->ne[2] % src0->ne[2] == 0 && dst->ne[2] <= 65535;
    }
    if (!dflash_mmvq_type_ok(src0->type) || src1->type != GGML_TYPE_F32 || dst->type != GGML_TYPE_F32 ||
        !dflash_mmvq_arch_ok(cc)) {
        return false;
    }
    const int64_t ncols = src1->ne[1];
    return ncols >= 1 && ncols <= dflash_mmvq_max_ncols() && src0->nb[0] == ggml_type_size(src0->type) &&
           src1->nb[0] == sizeof(float) && dst->nb[0] == sizeof(float) && src1->ne[2] % src0->ne[2] == 0 &&
           src1->ne[3] % src0->ne[3] == 0 && src0->ne[1] <= INT_MAX && dst->ne[2] <= 65535 && dst->ne[3] <= 65535;
}

bool dflash_mmvq_use_mul_mat_id(const ggml_tensor * dst, int cc) {
    const ggml_tensor * src0 = dst->src[0];
    const ggml_tensor * src1 = dst->src[1];
    const ggml_tensor * ids  = dst->src[2];
    if (!dflash_narrow_enabled() || src1->type != GGML_TYPE_F32 || dst->type != GGML_TYPE_F32 || ids == nullptr ||
        ids->type != GGML_TYPE_I32 || ids->nb[0] != sizeof(int32_t) || !dflash_mmvq_arch_ok(cc)) {
        return false;
    }
    // One ncols = 1 product per (slot, token) in both kernels (ours and MMVF's multi-token path), so
    // the token count has no kernel limit: the same ceiling as dense products.
    const int64_t ntokens = dst->ne[2];
    if (ntokens < 1 || ntokens > dflash_mmvq_max_ncols()) {
        return false;
    }
    if (dflash_mmvf_type(src0->type)) {  // MMVF: src1->ne[2] == tokens <= MMVF_MAX_BATCH_SIZE
        return dflash_mmvf_layout_ok(src0, src1, dst) && src1->ne[2] == ntokens && dst->ne[1] <= 65535;
    }
    if (!dflash_mmvq_type_ok(src0->type)) {
        return false;
    }
    return dst->ne[3] == 1 && src1->ne[3] == 1 && src0->ne[3] == 1 &&
           src0->nb[0] == ggml_type_size(src0->type) && src1->nb[0] == sizeof(float) && dst->nb[0] == sizeof(float) &&
           ids->nb[0] == sizeof(int32_t) && src0->ne[1] <= INT_MAX && dst->ne[1] <= 65535;
}

bool dflash_mmvq_use(const ggml_tensor * node, int cc) {
    switch (node->op) {
        case GGML_OP_MUL_MAT:    return dflash_mmvq_use_mul_mat(node->src[0], node->src[1], node, cc);
        case GGML_OP_MUL_MAT_ID: return dflash_mmvq_use_mul_mat_id(node, cc);
        default:                 return false;
    }
}

template <int T>
static void dflash_mmvq_launch_dense(int ncols, const dfmmvq::dense_args & a, dim3 grid, cudaStream_t stream) {
    const dim3 block(dfmmvq::kWarp, dfmmvq::kWarps, 1);
    switch (ncols) {
        case 1: dflash_mmvq_dense<T, 1><<<grid, block, 0, stream>>>(a); break;
        case 2: dflash_mmvq_dense<T, 2><<<grid, block, 0, stream>>>(a); break;
        case 3: dflash_mmvq_dense<T, 3><<<grid, block, 0, stream>>>(a); break;
        case 4: dflash_mmvq_dense<T, 4><<<grid, block, 0, stream>>>(a); break;
        default: GGML_ABORT("dflash mmvq: ncols %d is not 1..4", ncols);
    }
}

template <int T>
static void dflash_mmvq_launch(int ncols, const dfmmvq::dense_args * dense, const dfmmvq::id_args * id, dim3 grid,
                               cudaStream_t stream) {
    if (id) {
        dflash_mmvq_id<T><<<grid, dim3(dfmmvq::kWarp, dfmmvq::kWarps, 1), 0, stream>>>(*id);
    } else {
        dflash_mmvq_launch_dense<T>(ncols, *dense, grid, stream);
    }
}

static_assert((int) dfmmvq::Q5_0 == (int) GGML_TYPE_Q5_0 && (int) dfmmvq::Q5_K == (int) GGML_TYPE_Q5_K &&
              (int) dfmmvq::Q6_K == (int) GGML_TYPE_Q6_K, "dflash weight types are ggml_type values");

static void dflash_mmvq_launch_any(ggml_type type, int ncols, const dfmmvq::dense_args * dense,
                                   const dfmmvq::id_args * id, dim3 grid, cudaStream_t stream) {
    switch (type) {
        case GGML_TYPE_Q8_0:  dflash_mmvq_launch<dfmmvq::Q8_0>(ncols, dense, id, grid, stream);  break;
        case GGML_TYPE_Q4_0:  dflash_mmvq_launch<dfmmvq::Q4_0>(ncols, dense, id, grid, stream);  break;
        case GGML_TYPE_Q4_K:  dflash_mmvq_launch<dfmmvq::Q4_K>(ncols, dense, id, grid, stream);  break;
        case GGML_TYPE_MXFP4: dflash_mmvq_launch<dfmmvq::MXFP4>(ncols, dense, id, grid, stream); break;
        case GGML_TYPE_Q5_0:  dflash_mmvq_launch<dfmmvq::Q5_0>(ncols, dense, id, grid, stream);  break;
        case GGML_TYPE_Q5_K:  dflash_mmvq_launch<dfmmvq::Q5_K>(ncols, dense, id, grid, stream);  break;
        case GGML_TYPE_Q6_K:  dflash_mmvq_launch<dfmmvq::Q6_K>(ncols, dense, id, grid, stream);  break;
        default: GGML_ABORT("dflash mmvq: unsupported type %s", ggml_type_name(type));
    }
}

void dflash_mmvq_mul_mat(ggml_backend_cuda_context & ctx, const ggml_tensor * src0, const ggml_tensor * src1,
                         const ggml_tensor * ids, ggml_tensor * dst) {
    if (dflash_mmvf_type(src0->type)) {  // never fused: dflash_mmvq_use vetoes the MMVF fusion paths
        ggml_cuda_mul_mat_vec_f(ctx, src0, src1, ids, dst);
        return;
    }

    GGML_TENSOR_BINARY_OP_LOCALS;
    cudaStream_t stream = ctx.stream();

    // activations -> q8_1 exactly as ggml's MMVQ path does it (per 32 values, per column)
    const int64_t ne10_padded = GGML_PAD(ne10, MATRIX_ROW_PADDING);
    ggml_cuda_pool_alloc<char> src1_q8_1(ctx.pool(), ne13*ne12*ne11*ne10_padded * sizeof(block_q8_1)/QK8_1);
    quantize_row_q8_1_cuda((const float *) src1->data, nullptr, src1_q8_1.get(), src0->type, ne10,
                           nb11/sizeof(float), nb12/sizeof(float), nb13/sizeof(float), ne10_padded, ne11, ne12, ne13,
                           stream);

    const int64_t x_col  = ne10_padded / QK8_1;  // q8_1 blocks from one src1 row to the next
    const auto *  w      = (const uint8_t *) src0->data;
    const auto *  x      = (const dfmmvq::q8_1_block *) src1_q8_1.get();
    float *       y      = (float *) dst->data;
    const int     nblocks = (int) (ne00 / ggml_blck_size(src0->type));

    if (ids) {  // grid: (rows, expert slots, tokens); each (slot, token) is one ncols = 1 product
        const dfmmvq::id_args a = {w, x, y, (const int32_t *) ids->data, nblocks, (int) ne01, (int64_t) nb01,
                                   (int64_t) nb02, x_col, ne11*x_col, (int) ne11, (int64_t) (nb1/sizeof(float)),
                                   (int64_t) (nb2/sizeof(float)), (int64_t) (ids->nb[0]/sizeof(int32_t)),
                                   (int64_t) (ids->nb[1]/sizeof(int32_t))};
        dflash_mmvq_launch_any(src0->type, 1, nullptr, &a, dim3((unsigned) ne01, (unsigned) ne1, (unsigned) ne2), stream);
    } else {    // grid: (rows, ne12, ne13); columns in chunks of at most 4, each column independent
        dfmmvq::dense_args a = {w, x, y, nblocks, (int) ne01, (int64_t) nb01, x_col, (int64_t) (nb1/sizeof(float)),
                                (int) (ne12/ne02), (int) (ne13/ne03), (int64_t) nb02, (int64_t) nb03, ne11*x_col,
                                ne12*ne11*x_col, (int64_t) (nb2/sizeof(float)), (int64_t) (nb3/sizeof(float))};
        const dim3 grid((unsigned) ne01, (unsigned) ne12, (unsigned) ne13);
        for (int64_t c0 = 0; c0 < ne11; c0 += dfmmvq::kMaxCols) {
            dfmmvq::dense_args chunk = a;
            chunk.x += c0*x_col;
            chunk.y += c0*a.y_col;
            const int ncols = (int) std::min<int64_t>(dfmmvq::kMaxCols, ne11 - c0);
            dflash_mmvq_launch_any(src0->type, ncols, &chunk, nullptr, grid, stream);
        }
    }
    CUDA_CHECK(cudaGetLastError());
}
#endif  // GGML_DFLASH_MMVQ
