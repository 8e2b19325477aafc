// The host self-check of the narrow MMVQ kernel body: random weights of every type, ncols 1..4,
// (a) within float tolerance of the dequantize-then-dot reference and (b) column c of ncols = k
// bit-identical to ncols = 1, all through the host emulation (emulate.h). Shared by the host test
// binary (host_main.cpp: --selfcheck) and the CUDA self-test (cuda_selftest.cu: --host-only), so
// the emulation is checked as each compiler builds it.
#pragma once

#include <cstdio>

#include "dflash_mmvq/emulate.h"
#include "host_data.h"

namespace dftest {

struct case_result {
    bool ref_ok = true, ncols_ok = true;
    double worst = 0.0;                      // max |y - ref| / scale
    uint64_t bits = 0xcbf29ce484222325ull;   // FNV-1a of the ncols = 1 outputs' bytes
};

inline uint64_t fnv1a(uint64_t h, const void* data, size_t n) {
    for (size_t i = 0; i < n; ++i) {
        h = (h ^ ((const uint8_t*)data)[i]) * 0x100000001b3ull;
    }
    return h;
}

// One weight matrix, four activation columns; every ncols against ncols = 1 and the reference.
inline case_result check_case(const type_info& t, int nrows, int nblocks, uint64_t seed) {
    rng g{seed};
    const int k = nblocks * t.qk, xb = k / 32;
    const std::vector<uint8_t> w = random_weights(t, nrows, nblocks, g);
    std::vector<float> x((size_t)4 * k);
    for (float& v : x) {
        v = (float)g.normal();
    }
    for (int i = 0; i < 32; ++i) {
        x[i] = 0.0f;  // an all-zero q8_1 block (d = 0)
    }
    std::vector<q8_1_block> xq((size_t)4 * xb);
    for (int c = 0; c < 4; ++c) {
        quantize_q8_1(&x[(size_t)c * k], k, &xq[(size_t)c * xb]);
    }
    std::vector<float> y1((size_t)4 * nrows), yn((size_t)4 * nrows);
    for (int c = 0; c < 4; ++c) {
        dfmmvq::emulate_dense_any(t.type, 1, w.data(), &xq[(size_t)c * xb], &y1[(size_t)c * nrows], nblocks, nrows,
                                  t.bytes * (int64_t)nblocks, xb, nrows);
    }
    case_result res;
    res.bits = fnv1a(res.bits, y1.data(), y1.size() * sizeof(float));
    for (int nc = 2; nc <= 4; ++nc) {
        dfmmvq::emulate_dense_any(t.type, nc, w.data(), xq.data(), yn.data(), nblocks, nrows,
                                  t.bytes * (int64_t)nblocks, xb, nrows);
        res.ncols_ok = res.ncols_ok && std::memcmp(yn.data(), y1.data(), sizeof(float) * nc * nrows) == 0;
    }
    for (int c = 0; c < 4; ++c) {
        for (int r = 0; r < nrows; ++r) {
            double ref, scale;
            reference_row(t, &w[(size_t)r * nblocks * t.bytes], &xq[(size_t)c * xb], nblocks, ref, scale);
            const double err = std::fabs((double)y1[(size_t)c * nrows + r] - ref) / (scale > 0 ? scale : 1.0);
            res.worst = std::fmax(res.worst, err);
            res.ref_ok = res.ref_ok && err <= kRelTol;
        }
    }
    return res;
}

inline int selfcheck(bool expect_planted) {
    bool ok = true;
    for (const type_info& t : kTypes) {
        const bool nibbles = t.type != dfmmvq::Q8_0;
        bool ref_ok = true, ncols_ok = true;
        double worst = 0.0;
        uint64_t bits = 0;
        const int shapes[2][2] = {{13, t.qk == 256 ? 5 : 40}, {6, t.qk == 256 ? 12 : 97}};
        for (int s = 0; s < 2; ++s) {
            const case_result r = check_case(t, shapes[s][0], shapes[s][1], 1234 + 17 * s + t.type);
            ref_ok = ref_ok && r.ref_ok;
            ncols_ok = ncols_ok && r.ncols_ok;
            worst = std::fmax(worst, r.worst);
            bits = fnv1a(bits, &r.bits, sizeof r.bits);
        }
        const bool want_ref = !(expect_planted && nibbles);
        // the output bits' digest: two builds of the emulation (g++, nvcc) must print the same
        std::printf("%-6s reference %s (worst |y-ref|/sum|wx| = %.2e, tol %.0e)  ncols 1..4 bit-identical: %s  "
                    "bits %016llx\n", t.name, ref_ok ? "ok  " : "FAIL", worst, kRelTol, ncols_ok ? "yes" : "NO",
                    (unsigned long long)bits);
        ok = ok && ncols_ok && ref_ok == want_ref;
    }
    if (expect_planted) {
        std::printf(ok ? "planted bug detected by the reference check, as it must be\n"
                       : "planted bug NOT detected as expected\n");
    }
    return ok ? 0 : 1;
}

}  // namespace dftest
