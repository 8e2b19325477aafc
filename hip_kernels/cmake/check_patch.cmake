# The ggml patch set applies cleanly to a copy of the pinned llama.cpp, and re-running it (with
# and without the saved original) leaves the same result.
#   cmake -DPINNED=<vendor/llama.cpp> -DPATCH_DIR=<repo>/hip_kernels -DWORK=<scratch dir> -P check_patch.cmake
# Copies only what the patch touches and what the glue compiles against (ggml/include, the
# ggml/src headers, ggml/src/ggml-cuda); prints "SKIPPED:" when the pinned source is absent.
foreach(v PINNED PATCH_DIR WORK)
  if(NOT DEFINED ${v})
    message(FATAL_ERROR "check_patch.cmake: -D${v}=... is required")
  endif()
endforeach()
if(NOT EXISTS "${PINNED}/ggml/src/ggml-cuda/ggml-cuda.cu")
  message("SKIPPED: pinned llama.cpp source not found at '${PINNED}' (set -DDFLASH_PINNED_LLAMA_SRC)")
  return()
endif()

file(REMOVE_RECURSE "${WORK}")
file(MAKE_DIRECTORY "${WORK}/ggml/src")
file(COPY "${PINNED}/CMakeLists.txt" DESTINATION "${WORK}")
file(COPY "${PINNED}/ggml/include" DESTINATION "${WORK}/ggml")
file(COPY "${PINNED}/ggml/src/ggml-cuda" DESTINATION "${WORK}/ggml/src")
file(GLOB src_headers "${PINNED}/ggml/src/*.h")
file(COPY ${src_headers} DESTINATION "${WORK}/ggml/src")

set(cu "${WORK}/ggml/src/ggml-cuda/ggml-cuda.cu")
if(EXISTS "${cu}.dflash-orig")  # the pinned tree was patched in place by a build: use its original
  configure_file("${cu}.dflash-orig" "${cu}" COPYONLY)
  file(REMOVE "${cu}.dflash-orig")
  message("note: ${PINNED} carries the dflash patch (applied in place); testing on its saved original")
endif()
file(READ "${cu}" pristine)
if(pristine MATCHES "GGML_DFLASH_MMVQ")
  message(FATAL_ERROR "the pinned source at ${PINNED} already carries the dflash patch and no original")
endif()

function(apply round expect)
  execute_process(COMMAND ${CMAKE_COMMAND} -DSRC=${WORK} -DPATCH_DIR=${PATCH_DIR} -P ${PATCH_DIR}/apply_patch.cmake
                  RESULT_VARIABLE rc OUTPUT_VARIABLE out ERROR_VARIABLE err)
  message("${round} run:\n${out}${err}")
  if(NOT rc EQUAL 0)
    message(FATAL_ERROR "apply_patch.cmake failed on the ${round} run")
  endif()
  if(NOT out MATCHES "${expect}")
    message(FATAL_ERROR "the ${round} run did not report '${expect}'")
  endif()
endfunction()

apply(first ": applied$|: applied\n")
file(READ "${cu}" once)
apply(second "restored .* from its .dflash-orig first")  # re-run on a patched tree with backup
file(READ "${cu}" twice)
file(REMOVE "${cu}.dflash-orig")
apply(third "already applied")                           # patched tree without backup
file(READ "${cu}" thrice)
if(NOT once STREQUAL twice OR NOT once STREQUAL thrice)
  message(FATAL_ERROR "re-running apply_patch.cmake changed ggml-cuda.cu")
endif()

string(REGEX MATCHALL "#ifdef GGML_DFLASH_MMVQ" hooks "${once}")
list(LENGTH hooks n)
if(NOT n EQUAL 4)
  message(FATAL_ERROR "expected 4 GGML_DFLASH_MMVQ hooks in ggml-cuda.cu, found ${n}")
endif()
foreach(f dflash-mmvq.cu dflash-mmvq.cuh dflash_mmvq/body.h dflash_mmvq/formats.h dflash_mmvq/shim.h)
  if(NOT EXISTS "${WORK}/ggml/src/ggml-cuda/${f}")
    message(FATAL_ERROR "the patch set did not add ggml/src/ggml-cuda/${f}")
  endif()
endforeach()
message("patch set applies to ${PINNED} (copy in ${WORK}), idempotently; 4 hooks, glue and body headers in place")
