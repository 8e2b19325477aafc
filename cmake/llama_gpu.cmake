# The GPU branch of cmake/llama.cmake (included when DFLASH_GPU is hip, cuda or vulkan): the options
# and patches of ggml's HIP, CUDA and Vulkan backends. A file of its own, so that only GPU builds are keyed by
# it (dflash/native/build.py): editing it rebuilds no CPU library.
# Its one option of its own, DFLASH_CUDA_LIBS (-DDFLASH_CUDA_LIBS=<folder>, what `dflash build --gpu cuda`
# passes): cuBLAS, the CUDA runtime and a driver link stub from NVIDIA's wheels (dflash/native/cuda_libs.py).
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
elseif(DFLASH_GPU STREQUAL "vulkan")
  # ggml's Vulkan backend with the system's Vulkan headers, loader, SPIRV-Headers and glslc
  # (Debian: libvulkan-dev, spirv-headers, glslc); it runs on any Vulkan driver (lavapipe here,
  # RADV on gfx1151/gfx1201). Both flavors apply vulkan_kernels' common patches; the exact one
  # also its exact patches (and, as every exact build, the exact CPU patch set).
  list(APPEND _llama_args -DGGML_VULKAN=ON)
  list(APPEND _llama_patch COMMAND ${CMAKE_COMMAND} -DSRC=<SOURCE_DIR> -DFLAVOR=${DFLASH_LLAMA_FLAVOR}
       -DPATCH_DIR=${CMAKE_CURRENT_SOURCE_DIR}/vulkan_kernels
       -P ${CMAKE_CURRENT_SOURCE_DIR}/vulkan_kernels/apply_patches.cmake)
elseif(DFLASH_GPU STREQUAL "cuda")
  # The same ggml-cuda sources for NVIDIA (nvcc). Flash-attention kernels are not built: exact GPU
  # runs turn flash attention off. The exact flavor applies the narrow-MMVQ patch set with its
  # CUDA switch (GGML_DFLASH_MMVQ_CUDA), so the dflash kernels take the narrow products there too.
  string(REPLACE ";" "|" _cuda_archs "${CUDA_ARCHITECTURES}")
  list(APPEND _llama_args -DGGML_CUDA=ON "-DCMAKE_CUDA_ARCHITECTURES=${_cuda_archs}" -DGGML_CUDA_FA=OFF)
  # DFLASH_CUDA_LIBS (dflash/native/cuda_libs.py): cuBLAS and the runtime from NVIDIA's wheels, cuBLAS's
  # headers, and a link stub of the driver. FindCUDAToolkit is handed each library, so a toolkit
  # without cuBLAS links; the libraries run from that folder (run path, with $ORIGIN for their
  # siblings), the driver's own libcuda.so.1 from the system (the stub is never on a run path).
  if(DFLASH_CUDA_LIBS)
    list(APPEND _llama_args
         "-DCUDA_cublas_LIBRARY=${DFLASH_CUDA_LIBS}/lib/libcublas.so"
         "-DCUDA_cublasLt_LIBRARY=${DFLASH_CUDA_LIBS}/lib/libcublasLt.so"
         "-DCUDA_cudart_LIBRARY=${DFLASH_CUDA_LIBS}/lib/libcudart.so"
         "-DCUDA_cuda_driver_LIBRARY=${DFLASH_CUDA_LIBS}/stubs/libcuda.so"
         "-DCMAKE_CUDA_STANDARD_INCLUDE_DIRECTORIES=${DFLASH_CUDA_LIBS}/include")
    # a cache argument (written to the initial cache file, no shell in between): $ORIGIN stays literal
    set(_llama_cuda_cache CMAKE_CACHE_ARGS "-DCMAKE_INSTALL_RPATH:STRING=$ORIGIN;${DFLASH_CUDA_LIBS}/lib")
  endif()
  if(DFLASH_LLAMA_FLAVOR STREQUAL "exact")
    list(APPEND _llama_args "-DCMAKE_CUDA_FLAGS=-DGGML_DFLASH_MMVQ_CUDA")
    list(APPEND _llama_patch COMMAND ${CMAKE_COMMAND} -DSRC=<SOURCE_DIR>
         -DPATCH_DIR=${CMAKE_CURRENT_SOURCE_DIR}/hip_kernels
         -P ${CMAKE_CURRENT_SOURCE_DIR}/hip_kernels/apply_patch.cmake)
  endif()
endif()
