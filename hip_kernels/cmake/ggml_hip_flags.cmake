# Compile flags of ggml's HIP backend (ggml-cuda/*.cu with GGML_USE_HIP) for a ROCm-less clang >= 19,
# shared by the CTest compile checks (compile_ggml_hip.cmake) and the compile-only library build
# (hip_kernels/ggml_hip/CMakeLists.txt). Include, then call:
#   dflash_ggml_hip_flags(<out-var> ROOT <hip root> GGML <ggml dir> HIP_KERNELS <repo>/hip_kernels ARCHS <a;b>)
#   dflash_ggml_hip_source_flags(<out-var> <source path>)   # per-source extras (the dflash glue)
# ROOT is a folder made by hip_root.cmake: HIP 6.2 headers (triton wheel), a HIP version file and
# ROCm's device libraries, so clang adds its HIP wrapper headers and links ocml/ockl as ROCm would.
# What the real ggml-hip build (ROCm clang, CMake HIP language, Release) passes and this mirrors:
# -O3 -DNDEBUG, -std=c++17, -fPIC, GGML_USE_HIP, GGML_BUILD/GGML_SHARED/GGML_BACKEND_BUILD/
# GGML_BACKEND_SHARED, GGML_SCHED_MAX_COPIES=4; and for dflash-mmvq.cu the options the patch set
# adds in ggml-hip/CMakeLists.txt (IEEE f32 subnormals, no fast math).
function(dflash_ggml_hip_flags out)
  cmake_parse_arguments(A "" "ROOT;GGML;HIP_KERNELS" "ARCHS" ${ARGN})
  set(f -x hip --rocm-path=${A_ROOT} -O3 -DNDEBUG -std=c++17 -fPIC
        -DGGML_USE_HIP -DGGML_BUILD -DGGML_SHARED -DGGML_BACKEND_BUILD -DGGML_BACKEND_SHARED
        -DGGML_SCHED_MAX_COPIES=4
        # hip_fp16.h / hip_bf16.h / hip_fp8.h come with the triton wheel's header set
        # (hip_kernels/tools/fetch_hip_headers.py); they include amd_detail siblings by relative name
        -idirafter ${A_ROOT}/include/hip/amd_detail
        # hipblas/hipblas.h: the project's link-stub declarations
        -I${A_HIP_KERNELS}/stubs/include
        -I${A_GGML}/include -I${A_GGML}/src -I${A_GGML}/src/ggml-cuda
        -Wno-unused-command-line-argument)
  foreach(a IN LISTS A_ARCHS)
    list(APPEND f --offload-arch=${a})
  endforeach()
  set(${out} ${f} PARENT_SCOPE)
endfunction()

function(dflash_ggml_hip_source_flags out src)
  set(f "")
  if(src MATCHES "(^|/)dflash-mmvq\\.cu$")
    set(f -fno-fast-math -fno-gpu-flush-denormals-to-zero)
  endif()
  if(src MATCHES "(^|/)softmax\\.cu$")  # see ggml_hip/grid_sync_trap.h (compile-only builds)
    get_filename_component(here "${CMAKE_CURRENT_FUNCTION_LIST_DIR}/.." ABSOLUTE)
    set(f -include ${here}/ggml_hip/grid_sync_trap.h)
  endif()
  set(${out} ${f} PARENT_SCOPE)
endfunction()
