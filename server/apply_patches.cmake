# Apply the project's llama-server patches (server/patches/*.patch, in order) to a private copy of
# the llama.cpp source that already carries the flavor's patch set:
#   cmake -DSRC=<llama.cpp copy> -DREPO=<dflash checkout> -P server/apply_patches.cmake
# (cmake/llama.cmake runs this after cmake/apply_patches.cmake when DFLASH_LLAMA_SERVER is ON.)
foreach(v SRC REPO)
  if(NOT DEFINED ${v})
    message(FATAL_ERROR "server/apply_patches.cmake: -D${v}=... is required")
  endif()
endforeach()
if(NOT EXISTS "${SRC}/tools/server/server-context.cpp")
  message(FATAL_ERROR "server/apply_patches.cmake: ${SRC} has no tools/server")
endif()
include(${REPO}/cmake/patch_set.cmake)
file(GLOB patches "${REPO}/server/patches/*.patch")
list(SORT patches)
dflash_apply_patches("${SRC}" ${patches})
