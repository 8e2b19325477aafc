# Apply dflash's ggml patch set to a llama.cpp source tree. Safe to run again on a patched tree.
#   cmake -DSRC=<llama.cpp source> -DPATCH_DIR=<repo>/hip_kernels -P apply_patch.cmake
# (cmake/llama.cmake runs this as the ExternalProject PATCH_COMMAND for DFLASH_GPU=hip, flavor exact.)
#  1. applies PATCH_DIR/patches/*.patch in name order. The first application keeps each touched
#     file's original as <file>.dflash-orig; later runs restore that original first, so a tree
#     patched by an older version of the set gets the current one. A tree patched without a
#     backup is left alone when the patch is already applied (its reverse applies cleanly).
#     A patch that applies neither way is a fatal error.
#  2. copies the added sources: PATCH_DIR/ggml/* -> SRC/ggml/src/ggml-cuda/ and the kernel body
#     headers PATCH_DIR/include/dflash_mmvq/*.h -> SRC/ggml/src/ggml-cuda/dflash_mmvq/
foreach(v SRC PATCH_DIR)
  if(NOT DEFINED ${v})
    message(FATAL_ERROR "apply_patch.cmake: -D${v}=... is required")
  endif()
endforeach()
set(cuda_dir "${SRC}/ggml/src/ggml-cuda")
if(NOT EXISTS "${cuda_dir}/ggml-cuda.cu")
  message(FATAL_ERROR "apply_patch.cmake: ${SRC} is not a llama.cpp tree (no ggml/src/ggml-cuda/ggml-cuda.cu)")
endif()

file(GLOB added_sources "${PATCH_DIR}/ggml/*")
file(GLOB body_headers "${PATCH_DIR}/include/dflash_mmvq/*.h")
if(NOT added_sources OR NOT body_headers)
  message(FATAL_ERROR "apply_patch.cmake: ${PATCH_DIR} lacks ggml/ or include/dflash_mmvq/")
endif()

include(${CMAKE_CURRENT_LIST_DIR}/../cmake/patch_set.cmake)
file(GLOB patches "${PATCH_DIR}/patches/*.patch")
list(SORT patches)
dflash_apply_patches("${SRC}" ${patches})

# the added sources last, so that a tree the patches do not fit is left as it was
file(COPY ${added_sources} DESTINATION "${cuda_dir}")
file(COPY ${body_headers} DESTINATION "${cuda_dir}/dflash_mmvq")
