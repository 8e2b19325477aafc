# Build llama.cpp's shared libraries from DFLASH_LLAMA_SRC (a private copy: the patches edit it).
#
# Both flavors keep llama.cpp's build options (GGML_NATIVE, llamafile, repacking, AMX). The patch
# set (cpu_kernels/patches) decides the flavor:
# exact: common + exact patches: every weight type runs one kernel family at every batch width
#        (tinyBLAS for n = 1 too, the tiled K-quant kernels for every row count, no Q2_K repack).
#        The runner turns flash attention off at run time.
# stock: common patches only (fixes a build needs to run at all): llama.cpp's defaults, kept for
#        comparison (`--lib stock`).
# Both build ggml's RPC backend (GGML_RPC, libggml-rpc.so): `dflash rpc-server` serves a build's
# devices and `--rpc HOST:PORT` uses remote ones (rpc/patches applies to both flavors).
include(ExternalProject)

if(NOT EXISTS "${DFLASH_LLAMA_SRC}/CMakeLists.txt")
  message(FATAL_ERROR "DFLASH_LLAMA_SRC='${DFLASH_LLAMA_SRC}' is not a llama.cpp source tree")
endif()
if(NOT DFLASH_LLAMA_FLAVOR MATCHES "^(exact|stock)$")
  message(FATAL_ERROR "DFLASH_LLAMA_FLAVOR must be 'exact' or 'stock', got '${DFLASH_LLAMA_FLAVOR}'")
endif()

set(_llama_args
  -DCMAKE_BUILD_TYPE=Release
  -DCMAKE_INSTALL_PREFIX=${DFLASH_LLAMA_PREFIX}
  -DCMAKE_INSTALL_LIBDIR=lib
  -DBUILD_SHARED_LIBS=ON
  -DLLAMA_BUILD_TESTS=OFF
  -DLLAMA_BUILD_TOOLS=OFF
  -DLLAMA_BUILD_EXAMPLES=OFF
  -DLLAMA_BUILD_SERVER=OFF
  -DLLAMA_BUILD_APP=OFF
  -DLLAMA_BUILD_COMMON=OFF
  -DLLAMA_BUILD_UI=OFF
  -DLLAMA_USE_PREBUILT_UI=OFF
  -DLLAMA_BUILD_MTMD=OFF
  -DLLAMA_CURL=OFF
  -DLLAMA_OPENSSL=OFF
  -DGGML_NATIVE=ON
  -DGGML_RPC=ON
)
set(_llama_patch ${CMAKE_COMMAND} -DSRC=<SOURCE_DIR> -DFLAVOR=${DFLASH_LLAMA_FLAVOR}
    -DREPO=${CMAKE_CURRENT_SOURCE_DIR} -P ${CMAKE_CURRENT_SOURCE_DIR}/cmake/apply_patches.cmake)
if(DFLASH_GPU STREQUAL "hip")
  # ROCm's clang must be the HIP compiler; CMAKE_HIP_PLATFORM=amd keeps nvcc on PATH from winning.
  # GPU_TARGETS is a list: pass it with '|' as the separator ExternalProject turns back into ';'.
  string(REPLACE ";" "|" _gpu_targets "${GPU_TARGETS}")
  list(APPEND _llama_args -DGGML_HIP=ON "-DGPU_TARGETS=${_gpu_targets}" -DCMAKE_HIP_PLATFORM=amd)
  if(DFLASH_LLAMA_FLAVOR STREQUAL "exact")
    list(APPEND _llama_patch COMMAND ${CMAKE_COMMAND} -DSRC=<SOURCE_DIR>
         -DPATCH_DIR=${CMAKE_CURRENT_SOURCE_DIR}/hip_kernels
         -P ${CMAKE_CURRENT_SOURCE_DIR}/hip_kernels/apply_patch.cmake)
  endif()
elseif(DFLASH_GPU STREQUAL "cuda")
  # The same ggml-cuda sources for NVIDIA (nvcc). Flash-attention kernels are not built: exact GPU
  # runs turn flash attention off. The exact flavor applies the narrow-MMVQ patch set with its
  # CUDA switch (GGML_DFLASH_MMVQ_CUDA), so the dflash kernels take the narrow products there too.
  string(REPLACE ";" "|" _cuda_archs "${CUDA_ARCHITECTURES}")
  list(APPEND _llama_args -DGGML_CUDA=ON "-DCMAKE_CUDA_ARCHITECTURES=${_cuda_archs}" -DGGML_CUDA_FA=OFF)
  if(DFLASH_LLAMA_FLAVOR STREQUAL "exact")
    list(APPEND _llama_args "-DCMAKE_CUDA_FLAGS=-DGGML_DFLASH_MMVQ_CUDA")
    list(APPEND _llama_patch COMMAND ${CMAKE_COMMAND} -DSRC=<SOURCE_DIR>
         -DPATCH_DIR=${CMAKE_CURRENT_SOURCE_DIR}/hip_kernels
         -P ${CMAKE_CURRENT_SOURCE_DIR}/hip_kernels/apply_patch.cmake)
  endif()
endif()

ExternalProject_Add(llama_cpp
  SOURCE_DIR ${DFLASH_LLAMA_SRC}
  LIST_SEPARATOR |
  CMAKE_ARGS ${_llama_args}
  PATCH_COMMAND ${_llama_patch}
  BUILD_ALWAYS OFF
  INSTALL_DIR ${DFLASH_LLAMA_PREFIX}
)
