# Apply dflash's llama.cpp patch set for one flavor to a private copy of the source tree:
#   cmake -DSRC=<llama.cpp copy> -DFLAVOR=exact|stock -DREPO=<dflash checkout> -P apply_patches.cmake
#   cpu_kernels/patches/common/*.patch  every flavor: fixes without which a build does not run, and
#                                       the C function dflash reads memory sizes through
#   cpu_kernels/patches/exact/*.patch   the exact flavor: one kernel family per weight type at
#                                       every batch width (see cpu_kernels/README.md)
#   rpc/patches/*.patch                 every flavor: the RPC backend reports its build and names
#                                       a lost server (see README.md, "Across machines")
# (cmake/llama.cmake runs this as the ExternalProject PATCH_COMMAND; the HIP set is applied by
# hip_kernels/apply_patch.cmake after it.)
foreach(v SRC FLAVOR REPO)
  if(NOT DEFINED ${v})
    message(FATAL_ERROR "apply_patches.cmake: -D${v}=... is required")
  endif()
endforeach()
if(NOT EXISTS "${SRC}/ggml/src/ggml-cpu/ggml-cpu.c")
  message(FATAL_ERROR "apply_patches.cmake: ${SRC} is not a llama.cpp tree")
endif()
include(${CMAKE_CURRENT_LIST_DIR}/patch_set.cmake)
set(dirs common)
if(FLAVOR STREQUAL "exact")
  list(APPEND dirs exact)
endif()
set(patches "")
foreach(d IN LISTS dirs)
  file(GLOB ps "${REPO}/cpu_kernels/patches/${d}/*.patch")
  list(SORT ps)
  list(APPEND patches ${ps})
endforeach()
file(GLOB ps "${REPO}/rpc/patches/*.patch")
list(SORT ps)
list(APPEND patches ${ps})
dflash_apply_patches("${SRC}" ${patches})
