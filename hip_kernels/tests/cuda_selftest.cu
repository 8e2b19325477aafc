// CUDA self-test of the narrow MMVQ kernels on an NVIDIA GPU (a stand-in until AMD hardware is
// available): nvcc compiles the very kernels of src/dflash_mmvq.hip through the shim (__dp4a,
// __shfl_xor_sync, warp 32, the same lane and reduction order as wave32 RDNA). Per weight type:
//   1. GPU == host emulation of the body (emulate.h), bit for bit, for ncols 1..4
//   2. column c of an ncols = k launch == the ncols = 1 launch on x[c], bit for bit
//   3. ncols = 1 within tolerance of the dequantize-then-dot reference (host_data.h)
//   4. the routed-expert kernel (_id) == ncols = 1 on the selected expert, bit for bit
//   nvcc -std=c++17 -O2 -arch=native -Ihip_kernels/include -Ihip_kernels/tests \
//        -Xcompiler -ffp-contract=off hip_kernels/tests/cuda_selftest.cu -o cuda_selftest
// Exit 0 pass, 1 a check failed, 3 no CUDA device. Without a GPU, `cuda_selftest --host-only
// [--expect-planted]` runs the host half: this binary's own emulation (the side every GPU result is
// compared with, as nvcc's host pass built it) through the host self-check of host_check.h.
#include <cstdio>
#include <cstring>

#include "../src/dflash_mmvq.hip"
#include "host_check.h"

using namespace dftest;

#define CHECK_CUDA(call)                                                                       \
    do {                                                                                       \
        const cudaError_t e_ = (call);                                                         \
        if (e_ != cudaSuccess) {                                                               \
            std::fprintf(stderr, "%s:%d: %s\n", __FILE__, __LINE__, cudaGetErrorString(e_));   \
            std::exit(2);                                                                      \
        }                                                                                      \
    } while (0)

typedef void (*dense_fn)(const void*, const void*, float*, int32_t, int32_t, int64_t, int64_t, int64_t);
typedef void (*id_fn)(const void*, const void*, float*, const int32_t*, int32_t, int32_t, int64_t, int64_t, int64_t,
                      int64_t, int32_t, int64_t, int64_t, int64_t, int64_t);

#define DF_ROW(t) {dflash_mmvq_##t##_nc1, dflash_mmvq_##t##_nc2, dflash_mmvq_##t##_nc3, dflash_mmvq_##t##_nc4}
static dense_fn dense_kernel(int type, int nc) {
    static const dense_fn q8[4] = DF_ROW(q8_0), q4[4] = DF_ROW(q4_0), qk[4] = DF_ROW(q4_k), mx[4] = DF_ROW(mxfp4);
    static const dense_fn q5[4] = DF_ROW(q5_0), q5k[4] = DF_ROW(q5_k), q6k[4] = DF_ROW(q6_k);
    switch (type) {
        case dfmmvq::Q5_0: return q5[nc - 1];
        case dfmmvq::Q5_K: return q5k[nc - 1];
        case dfmmvq::Q6_K: return q6k[nc - 1];
        case dfmmvq::Q8_0: return q8[nc - 1];
        case dfmmvq::Q4_0: return q4[nc - 1];
        case dfmmvq::Q4_K: return qk[nc - 1];
        case dfmmvq::MXFP4: return mx[nc - 1];
        default: std::fprintf(stderr, "unsupported type %d\n", type); std::abort();
    }
}
static id_fn id_kernel(int type) {
    switch (type) {
        case dfmmvq::Q8_0: return dflash_mmvq_q8_0_id;
        case dfmmvq::Q4_0: return dflash_mmvq_q4_0_id;
        case dfmmvq::Q4_K: return dflash_mmvq_q4_k_id;
        case dfmmvq::MXFP4: return dflash_mmvq_mxfp4_id;
        case dfmmvq::Q5_0: return dflash_mmvq_q5_0_id;
        case dfmmvq::Q5_K: return dflash_mmvq_q5_k_id;
        case dfmmvq::Q6_K: return dflash_mmvq_q6_k_id;
        default: std::fprintf(stderr, "unsupported type %d\n", type); std::abort();
    }
}

template <typename T>
static T* upload(const std::vector<T>& v) {
    T* p = nullptr;
    CHECK_CUDA(cudaMalloc(&p, v.size() * sizeof(T)));
    CHECK_CUDA(cudaMemcpy(p, v.data(), v.size() * sizeof(T), cudaMemcpyHostToDevice));
    return p;
}
static std::vector<float> download(const float* p, size_t n) {
    std::vector<float> v(n);
    CHECK_CUDA(cudaMemcpy(v.data(), p, n * sizeof(float), cudaMemcpyDeviceToHost));
    return v;
}

// E experts of nrows x nblocks; 4 activation columns (dense) or slots x tokens columns (_id)
static bool check_type(const type_info& t, int nrows, int nblocks, uint64_t seed) {
    const int k = nblocks * t.qk, xb = k / 32, experts = 3, slots = 2, tokens = 3;
    const int64_t w_row = (int64_t)nblocks * t.bytes, w_expert = w_row * nrows;
    rng g{seed};
    const std::vector<uint8_t> w = random_weights(t, nrows * experts, nblocks, g);
    std::vector<float> x((size_t)slots * tokens * k);
    for (float& v : x) {
        v = (float)g.normal();
    }
    std::vector<q8_1_block> xq((size_t)slots * tokens * xb);
    for (int c = 0; c < slots * tokens; ++c) {
        quantize_q8_1(&x[(size_t)c * k], k, &xq[(size_t)c * xb]);
    }
    std::vector<int32_t> ids(slots * tokens);
    for (int32_t& e : ids) {
        e = (int32_t)(g.next() % experts);
    }
    const uint8_t* dw = upload(w);
    const q8_1_block* dx = upload(xq);
    const int32_t* dids = upload(ids);
    float* dy = nullptr;
    CHECK_CUDA(cudaMalloc(&dy, sizeof(float) * slots * tokens * nrows));
    const dim3 block(dfmmvq::kWarp, dfmmvq::kWarps);

    bool gpu_eq_host = true, ncols_eq = true, ref_ok = true, id_eq = true;
    double worst = 0.0;
    std::vector<float> y1((size_t)4 * nrows), host((size_t)4 * nrows);
    for (int c = 0; c < 4; ++c) {  // ncols = 1, one launch per column
        dense_kernel(t.type, 1)<<<dim3(nrows), block>>>(dw, dx + (size_t)c * xb, dy + (size_t)c * nrows, nblocks, nrows,
                                                        w_row, xb, nrows);
    }
    CHECK_CUDA(cudaDeviceSynchronize());
    y1 = download(dy, y1.size());
    for (int nc = 1; nc <= 4; ++nc) {
        dense_kernel(t.type, nc)<<<dim3(nrows), block>>>(dw, dx, dy, nblocks, nrows, w_row, xb, nrows);
        CHECK_CUDA(cudaDeviceSynchronize());
        const std::vector<float> yn = download(dy, (size_t)nc * nrows);
        dfmmvq::emulate_dense_any(t.type, nc, w.data(), xq.data(), host.data(), nblocks, nrows, w_row, xb, nrows);
        gpu_eq_host = gpu_eq_host && std::memcmp(yn.data(), host.data(), yn.size() * sizeof(float)) == 0;
        ncols_eq = ncols_eq && std::memcmp(yn.data(), y1.data(), yn.size() * sizeof(float)) == 0;
    }
    for (int c = 0; c < 4; ++c) {
        for (int r = 0; r < nrows; ++r) {
            double ref, scale;
            reference_row(t, &w[(size_t)r * w_row], &xq[(size_t)c * xb], nblocks, ref, scale);
            const double err = std::fabs(y1[(size_t)c * nrows + r] - ref) / (scale > 0 ? scale : 1.0);
            worst = std::fmax(worst, err);
            ref_ok = ref_ok && err <= kRelTol;
        }
    }
    // routed experts: x column (slot, token) = slot + slots * token, y likewise
    id_kernel(t.type)<<<dim3(nrows, slots, tokens), block>>>(dw, dx, dy, dids, nblocks, nrows, w_row, w_expert, xb,
                                                              (int64_t)slots * xb, slots, nrows, (int64_t)slots * nrows,
                                                              1, slots);
    CHECK_CUDA(cudaDeviceSynchronize());
    const std::vector<float> yid = download(dy, (size_t)slots * tokens * nrows);
    for (int c = 0; c < slots * tokens; ++c) {
        dense_kernel(t.type, 1)<<<dim3(nrows), block>>>(dw + ids[c] * w_expert, dx + (size_t)c * xb, dy, nblocks, nrows,
                                                        w_row, xb, nrows);
        CHECK_CUDA(cudaDeviceSynchronize());
        const std::vector<float> one = download(dy, nrows);
        id_eq = id_eq && std::memcmp(one.data(), &yid[(size_t)c * nrows], nrows * sizeof(float)) == 0;
    }
    CHECK_CUDA(cudaFree((void*)dw));
    CHECK_CUDA(cudaFree((void*)dx));
    CHECK_CUDA(cudaFree((void*)dids));
    CHECK_CUDA(cudaFree(dy));
    std::printf("%-6s rows %3d k %5d: gpu==host %s  ncols 1..4 bit-identical %s  _id==nc1 %s  reference %s (%.1e)\n",
                t.name, nrows, k, gpu_eq_host ? "yes" : "NO", ncols_eq ? "yes" : "NO", id_eq ? "yes" : "NO",
                ref_ok ? "ok" : "FAIL", worst);
    return gpu_eq_host && ncols_eq && id_eq && ref_ok;
}

int main(int argc, char** argv) {
    bool host_only = false, expect_planted = false;
    for (int i = 1; i < argc; ++i) {
        if (std::strcmp(argv[i], "--host-only") == 0) {
            host_only = true;
        } else if (std::strcmp(argv[i], "--expect-planted") == 0) {
            expect_planted = true;
        } else {
            std::fprintf(stderr, "cuda_selftest: unknown argument %s (--host-only [--expect-planted])\n", argv[i]);
            return 2;
        }
    }
    if (host_only || expect_planted) {
        return selfcheck(expect_planted);
    }
    int n = 0;
    if (cudaGetDeviceCount(&n) != cudaSuccess || n == 0) {
        std::printf("no CUDA device\n");
        return 3;
    }
    bool ok = true;
    for (const type_info& t : kTypes) {
        ok = check_type(t, 29, t.qk == 256 ? 5 : 40, 99 + t.type) && ok;
        ok = check_type(t, 64, 4096 / t.qk, 7 + t.type) && ok;
    }
    std::printf(ok ? "cuda selftest: PASS\n" : "cuda selftest: FAIL\n");
    return ok ? 0 : 1;
}
