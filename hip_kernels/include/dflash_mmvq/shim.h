// dflash narrow MMVQ: the few primitives whose implementation differs between targets.
//
// The kernel body (body.h) is written once against these helpers. Each helper has up to three
// implementations that give bit-identical results:
//   AMD device (clang -x hip, __HIP_DEVICE_COMPILE__): dot4 builtin, ds_bpermute, s_barrier.
//   NVIDIA device (nvcc, __CUDA_ARCH__):               __dp4a, __shfl_xor_sync, __f*_rn.
//   host (g++, or the host pass of hip/nvcc):          plain scalar C++.
// Integer dot products are exact everywhere. Float arithmetic is one rounding per operation:
// the AMD path turns contraction off with `#pragma clang fp contract(off)` (body.h), the NVIDIA
// path uses the non-contractable __fmul_rn/__fadd_rn, and host builds pass -ffp-contract=off.
#pragma once

#include <stdint.h>

// One rounding per float operation even where the build allows contraction (HIP's default is
// -ffp-contract=fast-honor-pragmas). Must precede every function of the body; applies to the
// rest of the translation unit.
#if defined(__clang__)
#pragma clang fp contract(off)
#endif

#if defined(__CUDACC__) || defined(__HIP__)
#define DF_GPU_LANG 1
#endif

#if defined(__HIP_DEVICE_COMPILE__)
#define DF_AMD_DEVICE 1
#elif defined(__CUDA_ARCH__) && !defined(__HIP__)  // ggml's hip.h defines __CUDA_ARCH__ in both HIP passes
#define DF_NV_DEVICE 1
#endif

// Without ROCm headers (-nogpuinc) nothing defines the CUDA-style keywords; with them, or under
// nvcc, these macros already exist and are left alone.
#if defined(__HIP__)
#ifndef __global__
#define __global__ __attribute__((global))
#endif
#ifndef __device__
#define __device__ __attribute__((device))
#endif
#ifndef __host__
#define __host__ __attribute__((host))
#endif
#ifndef __shared__
#define __shared__ __attribute__((shared))
#endif
#endif

#if defined(DF_GPU_LANG)
#define DF_FN __host__ __device__ inline
#define DF_DEV __device__ inline
#else
#define DF_FN inline
#endif

#if defined(__CUDACC__) && !defined(__HIP__)
#include <cuda_fp16.h>
#define DF_LAUNCH_BOUNDS(n) __launch_bounds__(n)
#elif defined(__HIP__)
#define DF_LAUNCH_BOUNDS(n) __attribute__((amdgpu_flat_work_group_size(1, n)))
#endif

namespace dfmmvq {

// ---- integer dot product of four signed bytes, accumulated into c ----
DF_FN int dot4(int a, int b, int c) {
#if defined(DF_AMD_DEVICE) && (defined(__GFX11__) || defined(__GFX12__))
    return __builtin_amdgcn_sudot4(true, a, true, b, c, false);  // v_dot4_i32_iu8, both signed
#elif defined(DF_NV_DEVICE)
    return __dp4a(a, b, c);
#else
    for (int i = 0; i < 4; ++i) {
        c += (int)(int8_t)(uint8_t)((uint32_t)a >> (8 * i)) * (int)(int8_t)(uint8_t)((uint32_t)b >> (8 * i));
    }
    return c;
#endif
}

// ---- float arithmetic, one rounding each ----
DF_FN float fmul(float a, float b) {
#if defined(DF_NV_DEVICE)
    return __fmul_rn(a, b);
#else
    return a * b;
#endif
}
DF_FN float fadd(float a, float b) {
#if defined(DF_NV_DEVICE)
    return __fadd_rn(a, b);
#else
    return a + b;
#endif
}
DF_FN float fsub(float a, float b) {
#if defined(DF_NV_DEVICE)
    return __fsub_rn(a, b);
#else
    return a - b;
#endif
}

DF_FN float bits_to_float(uint32_t u) {
#if defined(DF_NV_DEVICE)
    return __uint_as_float(u);
#else
    return __builtin_bit_cast(float, u);
#endif
}

// ---- IEEE half (stored as uint16) to float; exact on every path ----
DF_FN float half_to_float(uint16_t h) {
#if defined(DF_AMD_DEVICE)
    return (float)__builtin_bit_cast(_Float16, h);
#elif defined(DF_NV_DEVICE)
    return __half2float(__ushort_as_half(h));
#else
    const uint32_t sign = (uint32_t)(h & 0x8000u) << 16;
    uint32_t exp = (h >> 10) & 0x1Fu;
    uint32_t man = h & 0x3FFu;
    if (exp == 0x1Fu) {
        return bits_to_float(sign | 0x7F800000u | (man << 13));  // inf / nan
    }
    if (exp == 0) {
        if (man == 0) {
            return bits_to_float(sign);
        }
        exp = 113;  // subnormal: normalise (127 - 15 + 1)
        while ((man & 0x400u) == 0) {
            man <<= 1;
            --exp;
        }
        return bits_to_float(sign | (exp << 23) | ((man & 0x3FFu) << 13));
    }
    return bits_to_float(sign | ((exp + 112) << 23) | (man << 13));
#endif
}

// ---- E8M0 exponent to float, halved (ggml_e8m0_to_fp32_half: kvalues are doubled E2M1) ----
DF_FN float e8m0_to_float_half(uint8_t e) {
    return bits_to_float(e < 2 ? (0x00200000u << e) : ((uint32_t)(e - 1) << 23));
}

#if defined(DF_GPU_LANG)
// ---- thread geometry: block = (32 lanes, kWarps warps); grid = (x, y, z) ----
DF_DEV int lane_x() {
#if defined(DF_AMD_DEVICE)
    return (int)__builtin_amdgcn_workitem_id_x();
#elif defined(DF_NV_DEVICE)
    return (int)threadIdx.x;
#else
    return 0;
#endif
}
DF_DEV int warp_y() {
#if defined(DF_AMD_DEVICE)
    return (int)__builtin_amdgcn_workitem_id_y();
#elif defined(DF_NV_DEVICE)
    return (int)threadIdx.y;
#else
    return 0;
#endif
}
DF_DEV int block_id(int dim) {
#if defined(DF_AMD_DEVICE)
    return dim == 0 ? (int)__builtin_amdgcn_workgroup_id_x()
         : dim == 1 ? (int)__builtin_amdgcn_workgroup_id_y() : (int)__builtin_amdgcn_workgroup_id_z();
#elif defined(DF_NV_DEVICE)
    return dim == 0 ? (int)blockIdx.x : dim == 1 ? (int)blockIdx.y : (int)blockIdx.z;
#else
    return dim * 0;
#endif
}

// value of v held by lane (this lane ^ mask), within a group of 32 lanes
DF_DEV float shfl_xor32(float v, int mask) {
#if defined(DF_AMD_DEVICE)
    // lane index inside the hardware wave (also right for wave64, where two warps share a wave)
    const unsigned lo = __builtin_amdgcn_mbcnt_lo(~0u, 0u);
    const int lane = (int)(__builtin_amdgcn_wavefrontsize() == 64 ? __builtin_amdgcn_mbcnt_hi(~0u, lo) : lo);
    return __builtin_bit_cast(float, __builtin_amdgcn_ds_bpermute((lane ^ mask) << 2, __builtin_bit_cast(int, v)));
#elif defined(DF_NV_DEVICE)
    return __shfl_xor_sync(0xFFFFFFFFu, v, mask, 32);
#else
    (void)mask;
    return v;
#endif
}

DF_DEV void block_barrier() {
#if defined(DF_AMD_DEVICE)
    __builtin_amdgcn_fence(__ATOMIC_RELEASE, "workgroup");
    __builtin_amdgcn_s_barrier();
    __builtin_amdgcn_fence(__ATOMIC_ACQUIRE, "workgroup");
#elif defined(DF_NV_DEVICE)
    __syncthreads();
#endif
}
#endif  // DF_GPU_LANG

}  // namespace dfmmvq
