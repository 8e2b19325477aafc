# Compile the kernel source into one plain AMDGPU code object (ELF, no offload bundle) for one
# architecture with a ROCm-less clang, keeping the compiler's resource-usage remarks.
#   cmake -DCLANGXX=clang++-19 -DARCH=gfx1201 -DSRC=dflash_mmvq.hip -DINCLUDE=<dir>
#         -DOUT=dflash_mmvq_gfx1201.hsaco -DREMARKS=dflash_mmvq_gfx1201.remarks.txt -P compile_co.cmake
# -DDEFINE=NAME adds -DNAME (the planted twin: DFLASH_MMVQ_PLANTED_ORDER).
# No -ffp-contract flag on purpose: the body's own pragma must keep float contraction off, as it
# has to in ggml's HIP build; check_isa.cmake verifies that no fused multiply-add survives.
foreach(v CLANGXX ARCH SRC INCLUDE OUT REMARKS)
  if(NOT DEFINED ${v})
    message(FATAL_ERROR "compile_co.cmake: -D${v}=... is required")
  endif()
endforeach()

set(_defines "")
if(DEFINE)
  set(_defines "-D${DEFINE}")
endif()
execute_process(
  COMMAND "${CLANGXX}" -x hip ${_defines} --offload-arch=${ARCH} --cuda-device-only --no-gpu-bundle-output
          -nogpulib -nogpuinc -O3 -std=c++17 -Wall -Werror "-I${INCLUDE}"
          -Rpass-analysis=kernel-resource-usage -c "${SRC}" -o "${OUT}"
  RESULT_VARIABLE rc
  OUTPUT_VARIABLE out
  ERROR_VARIABLE err)
file(WRITE "${REMARKS}" "${err}")
if(NOT rc EQUAL 0)
  file(REMOVE "${OUT}")
  string(REGEX REPLACE "[^\n]*remark:[^\n]*\n" "" errors "${err}")
  message(FATAL_ERROR "clang (${CLANGXX}) failed to build ${SRC} for ${ARCH}:\n${errors}")
endif()
