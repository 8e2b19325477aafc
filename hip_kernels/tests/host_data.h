// Test data for the narrow MMVQ kernels: random GGUF-layout weight blocks, ggml's q8_1
// activation quantiser, and an independent dequantize-then-dot reference in double.
// Shared by the host test binary (host_main.cpp) and the CUDA self-test (cuda_selftest.cu).
#pragma once

#include <cmath>
#include <cstdint>
#include <cstring>
#include <string>
#include <vector>

#include "dflash_mmvq/formats.h"

namespace dftest {

using dfmmvq::q8_1_block;

struct type_info {
    int type;
    const char* name;
    int qk, bytes;
};
inline const type_info kTypes[] = {
    {dfmmvq::Q8_0, "q8_0", 32, 34},
    {dfmmvq::Q4_0, "q4_0", 32, 18},
    {dfmmvq::Q4_K, "q4_k", 256, 144},
    {dfmmvq::MXFP4, "mxfp4", 32, 17},
    {dfmmvq::Q5_0, "q5_0", 32, 22},
    {dfmmvq::Q5_K, "q5_k", 256, 176},
    {dfmmvq::Q6_K, "q6_k", 256, 210},
};
inline const type_info* find_type(const std::string& name) {
    for (const type_info& t : kTypes) {
        if (name == t.name) {
            return &t;
        }
    }
    return nullptr;
}

struct rng {  // splitmix64
    uint64_t s;
    uint64_t next() {
        uint64_t z = (s += 0x9E3779B97F4A7C15ull);
        z = (z ^ (z >> 30)) * 0xBF58476D1CE4E5B9ull;
        z = (z ^ (z >> 27)) * 0x94D049BB133111EBull;
        return z ^ (z >> 31);
    }
    double uniform() { return (double)(next() >> 11) * (1.0 / 9007199254740992.0); }
    double normal() { return std::sqrt(-2.0 * std::log(1.0 - uniform())) * std::cos(6.283185307179586 * uniform()); }
};

// float -> IEEE half, round to nearest even (what make_half2 / __float2half do)
inline uint16_t float_to_half(float f) {
    uint32_t u;
    std::memcpy(&u, &f, 4);
    const uint32_t sign = (u >> 16) & 0x8000u;
    const uint32_t au = u & 0x7FFFFFFFu;
    if (au >= 0x7F800000u) {
        return (uint16_t)(sign | 0x7C00u | (au > 0x7F800000u ? 0x200u : 0u));
    }
    if (au >= 0x477FF000u) {  // rounds to >= 65520: overflow to inf
        return (uint16_t)(sign | 0x7C00u);
    }
    if (au < 0x38800000u) {  // below 2^-14: subnormal half (or zero)
        const uint32_t man = (au & 0x7FFFFFu) | 0x800000u;
        const int shift = 126 - (int)(au >> 23);  // 14 + (113 - exp) ... places bit 23 at the half lsb
        if (shift > 24) {
            return (uint16_t)sign;
        }
        const uint32_t q = man >> shift, rem = man & ((1u << shift) - 1), half = 1u << (shift - 1);
        return (uint16_t)(sign | (q + (rem > half || (rem == half && (q & 1u)))));
    }
    const uint32_t r = au - 0x38000000u;  // rebias exponent 127 -> 15
    const uint32_t q = r >> 13, rem = r & 0x1FFFu;
    return (uint16_t)(sign | (q + (rem > 0x1000u || (rem == 0x1000u && (q & 1u)))));
}

// ggml's quantize_q8_1 (ggml-cuda/quantize.cu): d = amax / 127, q = round(x / d), s = sum(x)
inline void quantize_q8_1(const float* x, int k, q8_1_block* out) {
    for (int b = 0; b < k / 32; ++b) {
        const float* v = x + 32 * b;
        float amax = 0.0f, sum = 0.0f;
        for (int i = 0; i < 32; ++i) {
            amax = std::fmax(amax, std::fabs(v[i]));
            sum += v[i];
        }
        const float d = amax / 127.0f;
        for (int i = 0; i < 32; ++i) {
            out[b].qs[i] = (int8_t)(amax == 0.0f ? 0.0f : std::round(v[i] / d));
        }
        out[b].d = float_to_half(d);
        out[b].s = float_to_half(sum);
    }
}

// Random blocks with every byte pattern the format allows, scales kept in a sane range.
inline std::vector<uint8_t> random_weights(const type_info& t, int nrows, int nblocks, rng& g) {
    std::vector<uint8_t> w((size_t)nrows * nblocks * t.bytes);
    for (uint8_t& b : w) {
        b = (uint8_t)g.next();
    }
    for (size_t off = 0; off < w.size(); off += t.bytes) {
        uint8_t* blk = &w[off];
        const float sgn = (g.next() & 1) ? -1.0f : 1.0f;
        const uint16_t d = float_to_half(sgn * (float)(0.002 + 0.02 * g.uniform()));
        switch (t.type) {
            case dfmmvq::MXFP4: blk[0] = (uint8_t)(112 + g.next() % 24); break;
            case dfmmvq::Q6_K: std::memcpy(blk + 208, &d, 2); break;  // int8 scales stay random
            case dfmmvq::Q4_K:
            case dfmmvq::Q5_K: {
                const uint16_t dd = float_to_half((float)(0.001 + 0.01 * g.uniform()));
                const uint16_t dm = float_to_half((float)(0.001 + 0.01 * g.uniform()));
                std::memcpy(blk, &dd, 2);
                std::memcpy(blk + 2, &dm, 2);
                break;
            }
            default: std::memcpy(blk, &d, 2); break;
        }
    }
    return w;
}

// Independent scalar dequantiser (written from the GGUF block definitions, not from the body).
// val: the values; mag: |each term| before cancellation, which bounds the float error.
inline void dequant_block(int type, const uint8_t* b, double* val, double* mag) {
    static const int kv[16] = {0, 1, 2, 3, 4, 6, 8, 12, 0, -1, -2, -3, -4, -6, -8, -12};
    uint16_t h0, h1;
    std::memcpy(&h0, b, 2);
    std::memcpy(&h1, b + 2, 2);
    if (type == dfmmvq::Q8_0) {
        for (int i = 0; i < 32; ++i) {
            val[i] = dfmmvq::half_to_float(h0) * (double)(int8_t)b[2 + i];
        }
    } else if (type == dfmmvq::Q4_0 || type == dfmmvq::MXFP4) {
        const bool q4 = type == dfmmvq::Q4_0;
        const double d = q4 ? dfmmvq::half_to_float(h0) : std::ldexp(1.0, (int)b[0] - 128);
        const uint8_t* qs = b + (q4 ? 2 : 1);
        for (int j = 0; j < 16; ++j) {
            const int lo = qs[j] & 15, hi = qs[j] >> 4;
            val[j] = d * (q4 ? lo - 8 : kv[lo]);
            val[j + 16] = d * (q4 ? hi - 8 : kv[hi]);
        }
    } else if (type == dfmmvq::Q5_0) {
        const double d = dfmmvq::half_to_float(h0);
        const uint32_t qh = (uint32_t)b[2] | ((uint32_t)b[3] << 8) | ((uint32_t)b[4] << 16) | ((uint32_t)b[5] << 24);
        for (int j = 0; j < 16; ++j) {
            val[j] = d * ((int)((b[6 + j] & 15) | (((qh >> j) & 1) << 4)) - 16);
            val[j + 16] = d * ((int)((b[6 + j] >> 4) | (((qh >> (j + 16)) & 1) << 4)) - 16);
        }
    } else if (type == dfmmvq::Q6_K) {  // ql[128], qh[64], int8 scales[16], half d
        uint16_t hd;
        std::memcpy(&hd, b + 208, 2);
        const double d = dfmmvq::half_to_float(hd);
        for (int v = 0; v < 256; ++v) {
            const int n = v / 128, g = (v % 128) / 32, l = v % 32;
            const int ql = (b[64 * n + 32 * (g & 1) + l] >> (4 * (g >> 1))) & 15;
            const int qh = (b[128 + 32 * n + l] >> (2 * g)) & 3;
            val[v] = d * (int8_t)b[192 + v / 16] * ((ql | (qh << 4)) - 32);
            mag[v] = std::fabs(val[v]);
        }
        return;
    } else {  // Q4_K, Q5_K (same scales; Q5_K adds qh[32] before the nibbles: bit j of qh[i])
        const bool q5 = type == dfmmvq::Q5_K;
        const double d = dfmmvq::half_to_float(h0), dmin = dfmmvq::half_to_float(h1);
        const uint8_t* sc = b + 4;
        const uint8_t* qs = b + (q5 ? 48 : 16);
        for (int j = 0; j < 8; ++j) {
            const int s = j < 4 ? (sc[j] & 63) : ((sc[j + 4] & 15) | ((sc[j - 4] >> 6) << 4));
            const int m = j < 4 ? (sc[j + 4] & 63) : ((sc[j + 4] >> 4) | ((sc[j] >> 6) << 4));
            for (int i = 0; i < 32; ++i) {
                const int q = ((qs[32 * (j / 2) + i] >> (4 * (j % 2))) & 15) | (q5 ? ((b[16 + i] >> j) & 1) << 4 : 0);
                val[32 * j + i] = d * s * q - dmin * m;
                mag[32 * j + i] = std::fabs(d * s * q) + std::fabs(dmin * m);
            }
        }
        return;
    }
    for (int i = 0; i < 32; ++i) {
        mag[i] = std::fabs(val[i]);
    }
}

// Reference y = dequant(W[row]) . dequant(xq) in double, plus the error scale sum|w||x|.
inline void reference_row(const type_info& t, const uint8_t* wrow, const q8_1_block* xq, int nblocks, double& y,
                          double& scale) {
    std::vector<double> val(t.qk), mag(t.qk);
    y = 0.0;
    scale = 0.0;
    for (int b = 0; b < nblocks; ++b) {
        dequant_block(t.type, wrow + (size_t)b * t.bytes, val.data(), mag.data());
        for (int i = 0; i < t.qk; ++i) {
            const q8_1_block& xb = xq[(b * t.qk + i) / 32];
            const double x = dfmmvq::half_to_float(xb.d) * (double)xb.qs[i % 32];
            y += val[i] * x;
            scale += mag[i] * std::fabs(x);
        }
    }
}

constexpr double kRelTol = 1e-5;  // of sum|w||x|; the float error is about 20 ulps of that

}  // namespace dftest
