// Forced into softmax.cu by the compile-only ggml-hip build (hip_kernels/ggml_hip), only there.
//
// softmax.cu synchronises a cooperative grid (cooperative_groups::this_grid().sync()), which HIP
// lowers to ockl's __ockl_grid_sync. The only ockl bitcode clang 19 can read here (Debian's ROCm
// 5.2 rocm-device-libs) implements it with a GWS barrier that gfx11 and gfx12 do not have, so
// clang stops with "Cannot select: intrinsic %llvm.amdgcn.ds.gws.barrier". A definition in the
// translation unit is linked instead of ockl's (device libraries are linked only where needed).
// The compile-only library never runs (its HIP runtime is a link stub that aborts), so this one
// traps instead of synchronising. A real ROCm build never sees this file.
extern "C" __device__ __attribute__((noinline, used)) void __ockl_grid_sync(void) {
    __builtin_trap();
}
