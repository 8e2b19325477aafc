# Build llama.cpp's shared libraries from DFLASH_LLAMA_SRC (a private copy: the patches edit it).
#
# Both flavors keep llama.cpp's build options (GGML_NATIVE, llamafile, repacking, AMX). The patch
# set (cpu_kernels/patches) decides the flavor:
# exact: common + exact patches: every weight type runs one kernel family at every batch width
#        (tinyBLAS for n = 1 too, the tiled K-quant kernels for every row count, no Q2_K repack).
#        The runner turns flash attention off at run time.
# stock: common patches only (fixes a build needs to run at all): llama.cpp's defaults, kept for
#        comparison (`--lib stock`).
# DFLASH_CPU_VARIANT picks the instruction sets of ggml's CPU backend (`dflash build --cpu`):
# native: -march=native (llama.cpp's default, GGML_NATIVE); the others are llama.cpp's own
# GGML_<ISA> options with GGML_NATIVE off, so a variant does not depend on the host that builds it:
#   avx512:       Sapphire Rapids level: AVX-512 F/CD/VL/DQ/BW, VBMI, VNNI, BF16 and AMX tile/int8/bf16
#   avx512-noamx: the same without AMX (Zen 4, Zen 5: Strix Halo's CPU)
#   avx2:         Haswell level: AVX, AVX2, FMA, F16C, BMI2 (Zen 2/3, Intel client parts)
# Only libggml-cpu carries ISA-specific code (llama.cpp compiles libllama and libggml-base without
# -march flags), so with DFLASH_CPU_BACKEND_ONLY the build stops at the ggml-cpu target and
# installs lib/libggml-cpu.so* alone: dflash puts it beside the native build's other libraries.
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
  -DGGML_RPC=ON
)
set(_isa_avx2 -DGGML_SSE42=ON -DGGML_AVX=ON -DGGML_AVX2=ON -DGGML_FMA=ON -DGGML_F16C=ON -DGGML_BMI2=ON
    -DGGML_AVX_VNNI=OFF)
set(_isa_avx512 ${_isa_avx2} -DGGML_AVX512=ON -DGGML_AVX512_VBMI=ON -DGGML_AVX512_VNNI=ON -DGGML_AVX512_BF16=ON)
if(DFLASH_CPU_VARIANT STREQUAL "native")
  list(APPEND _llama_args -DGGML_NATIVE=ON)
elseif(DFLASH_CPU_VARIANT STREQUAL "avx512")
  list(APPEND _llama_args -DGGML_NATIVE=OFF ${_isa_avx512} -DGGML_AMX_TILE=ON -DGGML_AMX_INT8=ON -DGGML_AMX_BF16=ON)
elseif(DFLASH_CPU_VARIANT STREQUAL "avx512-noamx")
  list(APPEND _llama_args -DGGML_NATIVE=OFF ${_isa_avx512} -DGGML_AMX_TILE=OFF -DGGML_AMX_INT8=OFF -DGGML_AMX_BF16=OFF)
elseif(DFLASH_CPU_VARIANT STREQUAL "avx2")
  list(APPEND _llama_args -DGGML_NATIVE=OFF ${_isa_avx2} -DGGML_AVX512=OFF -DGGML_AVX512_VBMI=OFF
       -DGGML_AVX512_VNNI=OFF -DGGML_AVX512_BF16=OFF -DGGML_AMX_TILE=OFF -DGGML_AMX_INT8=OFF -DGGML_AMX_BF16=OFF)
else()
  message(FATAL_ERROR "DFLASH_CPU_VARIANT must be native, avx512, avx512-noamx or avx2, got '${DFLASH_CPU_VARIANT}'")
endif()
if(DFLASH_CPU_BACKEND_ONLY)
  if(NOT DFLASH_GPU STREQUAL "none")
    message(FATAL_ERROR "DFLASH_CPU_BACKEND_ONLY builds the CPU backend alone: no DFLASH_GPU")
  endif()
  set(_llama_steps
    BUILD_COMMAND ${CMAKE_COMMAND} --build <BINARY_DIR> --target ggml-cpu
    INSTALL_COMMAND ${CMAKE_COMMAND} -DBIN=<BINARY_DIR>/bin -DPREFIX=${DFLASH_LLAMA_PREFIX}
                    -P ${CMAKE_CURRENT_SOURCE_DIR}/cmake/install_cpu_backend.cmake)
else()
  set(_llama_steps)
endif()
set(_llama_patch ${CMAKE_COMMAND} -DSRC=<SOURCE_DIR> -DFLAVOR=${DFLASH_LLAMA_FLAVOR}
    -DREPO=${CMAKE_CURRENT_SOURCE_DIR} -P ${CMAKE_CURRENT_SOURCE_DIR}/cmake/apply_patches.cmake)
if(NOT DFLASH_GPU STREQUAL "none")  # the GPU backends: their own file, in the GPU builds' keys only
  include(${CMAKE_CURRENT_SOURCE_DIR}/cmake/llama_gpu.cmake)
endif()

ExternalProject_Add(llama_cpp
  SOURCE_DIR ${DFLASH_LLAMA_SRC}
  LIST_SEPARATOR |
  CMAKE_ARGS ${_llama_args}
  ${_llama_cuda_cache}
  PATCH_COMMAND ${_llama_patch}
  BUILD_ALWAYS OFF
  INSTALL_DIR ${DFLASH_LLAMA_PREFIX}
  ${_llama_steps}
)
