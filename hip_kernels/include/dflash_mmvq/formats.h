// dflash narrow MMVQ: weight formats, byte-exact with the blocks a GGUF file holds, and the
// per-slice decode + dot product against q8_1 activations.
//
// A *slice* is the unit of work one lane handles per step. Slice s of a row lives in weight
// block s / spb at part s % spb. Every dot product is an exact int32 sum of dot4 calls; floats
// enter only when the block scales are applied, in the fixed order written below.
#pragma once

#include "shim.h"

namespace dfmmvq {

// The ggml_type values, so a runtime ggml type is also the template argument.
enum wtype : int { Q4_0 = 2, Q5_0 = 6, Q8_0 = 8, Q4_K = 12, Q5_K = 13, Q6_K = 14, MXFP4 = 39 };

// ggml's block_q8_1: 32 activations as int8 with scale d = max|x| / 127 (IEEE half).
// s (sum of x, half) is carried for layout compatibility and never read here.
struct q8_1_block {
    uint16_t d;
    uint16_t s;
    int8_t qs[32];
};
static_assert(sizeof(q8_1_block) == 36, "block_q8_1 is 36 bytes");

// qk: values per weight block; bytes: block size in a GGUF; spb: slices per block.
template <int T> struct wtraits;
template <> struct wtraits<Q8_0>  { static constexpr int qk = 32,  bytes = 34,  spb = 4;  };
template <> struct wtraits<Q4_0>  { static constexpr int qk = 32,  bytes = 18,  spb = 4;  };
template <> struct wtraits<MXFP4> { static constexpr int qk = 32,  bytes = 17,  spb = 4;  };
template <> struct wtraits<Q4_K>  { static constexpr int qk = 256, bytes = 144, spb = 16; };
template <> struct wtraits<Q5_0>  { static constexpr int qk = 32,  bytes = 22,  spb = 4;  };
template <> struct wtraits<Q5_K>  { static constexpr int qk = 256, bytes = 176, spb = 16; };
template <> struct wtraits<Q6_K>  { static constexpr int qk = 256, bytes = 210, spb = 16; };

// Loads with the alignment each format guarantees (Q8_0/Q4_0/Q5_0/Q6_K blocks are 2-byte
// aligned, MXFP4 blocks 1-byte aligned, Q4_K/Q5_K quants and q8_1 quants 4-byte aligned).
DF_FN uint16_t load_u16(const uint8_t* p) { return *(const uint16_t*)p; }
DF_FN uint32_t load_u32_a1(const uint8_t* p) {
    return (uint32_t)p[0] | ((uint32_t)p[1] << 8) | ((uint32_t)p[2] << 16) | ((uint32_t)p[3] << 24);
}
DF_FN uint32_t load_u32_a2(const uint8_t* p) {
    const uint16_t* q = (const uint16_t*)p;
    return (uint32_t)q[0] | ((uint32_t)q[1] << 16);
}
DF_FN uint32_t load_u32_a4(const uint8_t* p) { return *(const uint32_t*)p; }
DF_FN const int* x_ints(const q8_1_block* xb) { return (const int*)xb->qs; }

// Four nibbles from the low (values j) or high (values j + 16) halves of four packed bytes.
// DFLASH_MMVQ_PLANTED_BUG swaps them: a deliberately wrong variant the tests must reject.
#if defined(DFLASH_MMVQ_PLANTED_BUG)
DF_FN uint32_t nib_lo(uint32_t v) { return (v >> 4) & 0x0F0F0F0Fu; }
DF_FN uint32_t nib_hi(uint32_t v) { return v & 0x0F0F0F0Fu; }
#else
DF_FN uint32_t nib_lo(uint32_t v) { return v & 0x0F0F0F0Fu; }
DF_FN uint32_t nib_hi(uint32_t v) { return (v >> 4) & 0x0F0F0F0Fu; }
#endif

// bytes 0..15 -> bytes -8..7 (q + 120 stays below 256 per byte, xor 0x80 re-centres it)
DF_FN int nib_minus_8(uint32_t n) { return (int)((n + 0x78787878u) ^ 0x80808080u); }
// the same for 5-bit (0..31 -> -16..15: q + 112 < 256) and 6-bit (0..63 -> -32..31: q + 96 < 256)
DF_FN int q5_minus_16(uint32_t n) { return (int)((n + 0x70707070u) ^ 0x80808080u); }
DF_FN int q6_minus_32(uint32_t n) { return (int)((n + 0x60606060u) ^ 0x80808080u); }

// Bits 0..3 of b to bit 4 of bytes 0..3 (the fifth bit of four Q5_0 values).
DF_FN uint32_t bits4_to_b4(uint32_t b) {
    return ((b & 1u) << 4) | ((b & 2u) << 11) | ((b & 4u) << 18) | ((b & 8u) << 25);
}

// bytes 0..15 -> kvalues_mxfp4 (doubled E2M1): 0 1 2 3 4 6 8 12, then the same negated
DF_FN int nib_mxfp4(uint32_t n) {
    const uint64_t pos = 0x0C08060403020100ull, neg = 0xF4F8FAFCFDFEFF00ull;
    uint32_t r = 0;
    for (int i = 0; i < 4; ++i) {
        const uint32_t b = (n >> (8 * i)) & 0xFu;
        const uint64_t t = (b & 8u) ? neg : pos;
        r |= (uint32_t)((t >> (8 * (b & 7u))) & 0xFFu) << (8 * i);
    }
    return (int)r;
}

template <int T> struct slice;

// Q8_0: half d, int8 qs[32]. Part p: values 8p .. 8p+7.
template <> struct slice<Q8_0> {
    float d;
    int q0, q1, part;
    DF_FN void load(const uint8_t* blk, int p) {
        d = half_to_float(load_u16(blk));
        q0 = (int)load_u32_a2(blk + 2 + 8 * p);
        q1 = (int)load_u32_a2(blk + 6 + 8 * p);
        part = p;
    }
    DF_FN float dot(const q8_1_block* xb) const {
        const int* x = x_ints(xb);
        const int s = dot4(q1, x[2 * part + 1], dot4(q0, x[2 * part], 0));
        return fmul(fmul(d, half_to_float(xb->d)), (float)s);
    }
};

// Q4_0 (half d, 16 bytes of nibbles, value = d * (q - 8)) and MXFP4 (E8M0 e, 16 bytes of
// nibbles, value = 2^(e-128) * kvalues[q]) share a layout: byte j holds value j (low nibble)
// and value j + 16 (high nibble). Part p: bytes 4p .. 4p+3, i.e. values 4p.. and 16+4p...
template <int T> struct slice_nib32 {
    float d;
    int lo, hi, part;
    DF_FN void load(const uint8_t* blk, int p) {
        uint32_t v;
        if constexpr (T == Q4_0) {
            d = half_to_float(load_u16(blk));
            v = load_u32_a2(blk + 2 + 4 * p);
            lo = nib_minus_8(nib_lo(v));
            hi = nib_minus_8(nib_hi(v));
        } else {
            d = e8m0_to_float_half(blk[0]);
            v = load_u32_a1(blk + 1 + 4 * p);
            lo = nib_mxfp4(nib_lo(v));
            hi = nib_mxfp4(nib_hi(v));
        }
        part = p;
    }
    DF_FN float dot(const q8_1_block* xb) const {
        const int* x = x_ints(xb);
        const int s = dot4(hi, x[4 + part], dot4(lo, x[part], 0));
        return fmul(fmul(d, half_to_float(xb->d)), (float)s);
    }
};
template <> struct slice<Q4_0> : slice_nib32<Q4_0> {};
template <> struct slice<MXFP4> : slice_nib32<MXFP4> {};

// Q4_K: half d, half dmin, 12 bytes of 6-bit scales/mins, 128 bytes of nibbles for 8
// sub-blocks of 32; value = d*sc[j]*q - dmin*m[j]. Bytes 32i .. 32i+31 hold sub-block 2i (low
// nibbles) and 2i+1 (high nibbles). Part p = 4i + k: bytes 32i+8k .. +7, i.e. values 8k..8k+7
// of sub-blocks 2i and 2i+1, which meet the q8_1 blocks 2i and 2i+1 of this super-block.
DF_FN void q4k_scale_min(const uint8_t* q, int j, int& sc, int& m) {
    if (j < 4) {
        sc = q[j] & 63;
        m = q[j + 4] & 63;
    } else {
        sc = (q[j + 4] & 0xF) | ((q[j - 4] >> 6) << 4);
        m = (q[j + 4] >> 4) | ((q[j] >> 6) << 4);
    }
}

template <> struct slice<Q4_K> {
    float d, dmin;
    int sc_a, m_a, sc_b, m_b;
    int lo0, lo1, hi0, hi1, pair, quad;
    // the part's position and its two sub-blocks' scales and mins (Q5_K shares the layout)
    DF_FN void load_scales(const uint8_t* blk, int p) {
        pair = p >> 2;
        quad = p & 3;
        d = half_to_float(load_u16(blk));
        dmin = half_to_float(load_u16(blk + 2));
        q4k_scale_min(blk + 4, 2 * pair, sc_a, m_a);
        q4k_scale_min(blk + 4, 2 * pair + 1, sc_b, m_b);
    }
    DF_FN void load(const uint8_t* blk, int p) {
        load_scales(blk, p);
        const uint32_t v0 = load_u32_a4(blk + 16 + 32 * pair + 8 * quad);
        const uint32_t v1 = load_u32_a4(blk + 20 + 32 * pair + 8 * quad);
        lo0 = (int)nib_lo(v0);
        lo1 = (int)nib_lo(v1);
        hi0 = (int)nib_hi(v0);
        hi1 = (int)nib_hi(v1);
    }
    // one sub-block: dx * (d * (sc * sum q*x) - dmin * (m * sum x))
    DF_FN float sub(const q8_1_block* xb, int q0, int q1, int sc, int m) const {
        const int* x = x_ints(xb) + 2 * quad;
        const int ones = 0x01010101;
        const int s = dot4(q1, x[1], dot4(q0, x[0], 0));
        const int t = dot4(ones, x[1], dot4(ones, x[0], 0));
        return fmul(half_to_float(xb->d), fsub(fmul(d, (float)(sc * s)), fmul(dmin, (float)(m * t))));
    }
    DF_FN float dot(const q8_1_block* xb) const {
        const float fa = sub(xb + 2 * pair, lo0, lo1, sc_a, m_a);
        const float fb = sub(xb + 2 * pair + 1, hi0, hi1, sc_b, m_b);
        return fadd(fa, fb);
    }
};

// Q5_0: half d, 4 bytes qh (bit j = fifth bit of value j), 16 bytes of nibbles laid out as
// Q4_0's; value = d * ((nibble | fifth bit << 4) - 16). Part p: bytes 4p .. 4p+3, i.e. values
// 4p.. (low nibbles, qh bits 4p..) and 16+4p.. (high nibbles, qh bits 16+4p..).
template <> struct slice<Q5_0> {
    float d;
    int lo, hi, part;
    DF_FN void load(const uint8_t* blk, int p) {
        d = half_to_float(load_u16(blk));
        const uint32_t qh = load_u32_a2(blk + 2);
        const uint32_t v = load_u32_a2(blk + 6 + 4 * p);
        lo = q5_minus_16(nib_lo(v) | bits4_to_b4(qh >> (4 * p)));
        hi = q5_minus_16(nib_hi(v) | bits4_to_b4(qh >> (16 + 4 * p)));
        part = p;
    }
    DF_FN float dot(const q8_1_block* xb) const {
        const int* x = x_ints(xb);
        const int s = dot4(hi, x[4 + part], dot4(lo, x[part], 0));
        return fmul(fmul(d, half_to_float(xb->d)), (float)s);
    }
};

// Q5_K: Q4_K's half d, half dmin, 12 bytes of 6-bit scales/mins, then qh[32] and 128 bytes of
// nibbles; value l of sub-block j = d*sc[j]*(nibble | (bit j of qh[l]) << 4) - dmin*m[j]. Parts
// as Q4_K: p = 4i + k covers values 8k..8k+7 of sub-blocks 2i (low nibbles, qh bit 2i) and 2i+1
// (high nibbles, qh bit 2i+1), whose fifth bits sit in qh[8k .. 8k+7].
template <> struct slice<Q5_K> : slice<Q4_K> {
    DF_FN void load(const uint8_t* blk, int p) {
        load_scales(blk, p);
        const uint32_t h0 = load_u32_a4(blk + 16 + 8 * quad) >> (2 * pair);
        const uint32_t h1 = load_u32_a4(blk + 20 + 8 * quad) >> (2 * pair);
        const uint32_t v0 = load_u32_a4(blk + 48 + 32 * pair + 8 * quad);
        const uint32_t v1 = load_u32_a4(blk + 52 + 32 * pair + 8 * quad);
        lo0 = (int)(nib_lo(v0) | ((h0 & 0x01010101u) << 4));
        lo1 = (int)(nib_lo(v1) | ((h1 & 0x01010101u) << 4));
        hi0 = (int)(nib_hi(v0) | ((h0 & 0x02020202u) << 3));
        hi1 = (int)(nib_hi(v1) | ((h1 & 0x02020202u) << 3));
    }
};

// Q6_K: ql[128] (nibbles), qh[64] (2-bit pairs), int8 scales[16], half d (last); value =
// d * sc[v/16] * (q - 32) with q = nibble | 2 bits << 4. Half n (values 128n ..): value
// 128n + 32g + l (g = 0..3, l = 0..31) has nibble (g >> 1) of ql[64n + 32(g&1) + l] and bits
// 2g, 2g+1 of qh[32n + l]. Part p = 8n + 4j + k (j = 0, 1; k = 0..3): ql bytes 64n + 32j + 8k ..
// +7 and qh bytes 32n + 8k .. +7, i.e. values 8k..8k+7 of the 32-groups g = j (low nibbles,
// q8_1 block 4n + j) and g = j + 2 (high nibbles, q8_1 block 4n + j + 2).
template <> struct slice<Q6_K> {
    float d;
    int sc_a, sc_b;
    int lo0, lo1, hi0, hi1, xa, quad;
    DF_FN void load(const uint8_t* blk, int p) {
        const int n = p >> 3, j = (p >> 2) & 1;
        quad = p & 3;
        xa = 4 * n + j;
        d = half_to_float(load_u16(blk + 208));
        sc_a = (int)(int8_t)blk[192 + 8 * n + 2 * j + (quad >> 1)];
        sc_b = (int)(int8_t)blk[192 + 8 * n + 2 * j + 4 + (quad >> 1)];
        const uint32_t h0 = load_u32_a2(blk + 128 + 32 * n + 8 * quad) >> (2 * j);
        const uint32_t h1 = load_u32_a2(blk + 132 + 32 * n + 8 * quad) >> (2 * j);
        const uint32_t v0 = load_u32_a2(blk + 64 * n + 32 * j + 8 * quad);
        const uint32_t v1 = load_u32_a2(blk + 4 + 64 * n + 32 * j + 8 * quad);
        lo0 = q6_minus_32(nib_lo(v0) | ((h0 & 0x03030303u) << 4));
        lo1 = q6_minus_32(nib_lo(v1) | ((h1 & 0x03030303u) << 4));
        hi0 = q6_minus_32(nib_hi(v0) | (h0 & 0x30303030u));
        hi1 = q6_minus_32(nib_hi(v1) | (h1 & 0x30303030u));
    }
    // one group of 8 values: dx * (d * (sc * sum q*x))
    DF_FN float sub(const q8_1_block* xb, int q0, int q1, int sc) const {
        const int* x = x_ints(xb) + 2 * quad;
        const int s = dot4(q1, x[1], dot4(q0, x[0], 0));
        return fmul(half_to_float(xb->d), fmul(d, (float)(sc * s)));
    }
    DF_FN float dot(const q8_1_block* xb) const {
        const float fa = sub(xb + xa, lo0, lo1, sc_a);
        const float fb = sub(xb + xa + 2, hi0, hi1, sc_b);
        return fadd(fa, fb);
    }
};

}  // namespace dfmmvq
