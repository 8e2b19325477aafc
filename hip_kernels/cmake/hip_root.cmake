# Assemble a ROCm-shaped folder that clang's HIP driver accepts as --rocm-path, without ROCm:
#   OUT/include            -> HEADERS (the HIP 6.2 headers of the triton wheel, fetch_hip_headers.py)
#   OUT/share/hip/version  HIP version read from hip_version.h (clang adds its HIP runtime wrapper
#                          headers only when it sees a version > 3.5)
#   OUT/amdgcn/bitcode/    ROCm's device libraries (ocml, ockl, oclc_*): Debian's rocm-device-libs
#                          (DEVICE_LIBS), linked in, plus oclc_isa_version_<n>.bc for each of ARCHS
#                          that it lacks (one constant each, assembled with LLVM_AS)
#   cmake -DHEADERS=<include> -DDEVICE_LIBS=<.../amdgcn/bitcode> -DLLVM_AS=llvm-as-19
#         -DARCHS=gfx1151,gfx1201 -DOUT=<dir> -P hip_root.cmake
# Idempotent; cheap (links and two tiny files).
foreach(v HEADERS DEVICE_LIBS LLVM_AS ARCHS OUT)
  if(NOT DEFINED ${v})
    message(FATAL_ERROR "hip_root.cmake: -D${v}=... is required")
  endif()
endforeach()
if(NOT EXISTS "${HEADERS}/hip/hip_runtime.h" OR NOT EXISTS "${HEADERS}/hip/hip_version.h")
  message(FATAL_ERROR "hip_root.cmake: ${HEADERS} has no hip/hip_runtime.h (run hip_kernels/tools/fetch_hip_headers.py)")
endif()
if(NOT EXISTS "${DEVICE_LIBS}/ocml.bc" OR NOT EXISTS "${DEVICE_LIBS}/ockl.bc")
  message(FATAL_ERROR "hip_root.cmake: no ROCm device libraries (ocml.bc, ockl.bc) in '${DEVICE_LIBS}': "
                      "apt-get install rocm-device-libs")
endif()

file(MAKE_DIRECTORY "${OUT}/share/hip" "${OUT}/amdgcn/bitcode")
file(REAL_PATH "${HEADERS}" HEADERS)  # through any symlinked cache (the tests' own) to the files
file(CREATE_LINK "${HEADERS}" "${OUT}/include" SYMBOLIC)

file(STRINGS "${HEADERS}/hip/hip_version.h" vlines REGEX "#define HIP_VERSION_(MAJOR|MINOR|PATCH) ")
set(version "")
foreach(l IN LISTS vlines)
  if(l MATCHES "HIP_VERSION_(MAJOR|MINOR|PATCH) +([0-9]+)")
    string(APPEND version "HIP_VERSION_${CMAKE_MATCH_1}=${CMAKE_MATCH_2}\n")
  endif()
endforeach()
file(WRITE "${OUT}/share/hip/version.tmp" "${version}")
file(RENAME "${OUT}/share/hip/version.tmp" "${OUT}/share/hip/version")

file(GLOB libs "${DEVICE_LIBS}/*.bc")
foreach(lib IN LISTS libs)
  get_filename_component(name "${lib}" NAME)
  file(CREATE_LINK "${lib}" "${OUT}/amdgcn/bitcode/${name}" SYMBOLIC)
endforeach()

# __oclc_ISA_version for gfxMMmS: major*1000 + minor*100 + stepping (gfx1030 -> 10300, gfx90a -> 9010)
string(REPLACE "," ";" archs "${ARCHS}")
foreach(arch IN LISTS archs)
  if(NOT arch MATCHES "^gfx([0-9]+)([0-9a-f])([0-9a-f])$")
    message(FATAL_ERROR "hip_root.cmake: cannot read architecture '${arch}'")
  endif()
  set(num "${CMAKE_MATCH_1}${CMAKE_MATCH_2}${CMAKE_MATCH_3}")
  math(EXPR minor "0x${CMAKE_MATCH_2}")
  math(EXPR step "0x${CMAKE_MATCH_3}")
  math(EXPR isa "${CMAKE_MATCH_1} * 1000 + ${minor} * 100 + ${step}")
  set(bc "${OUT}/amdgcn/bitcode/oclc_isa_version_${num}.bc")
  if(EXISTS "${bc}")
    continue()
  endif()
  file(WRITE "${OUT}/isa_${num}.ll"
    "target datalayout = \"e-p:64:64-p1:64:64-p2:32:32-p3:32:32-p4:64:64-p5:32:32-p6:32:32-p7:160:256:256:32-p8:128:128-p9:192:256:256:32-i64:64-v16:16-v24:32-v32:32-v48:64-v96:128-v192:256-v256:256-v512:512-v1024:1024-v2048:2048-n32:64-S32-A5-G1-ni:7:8:9\"\n"
    "target triple = \"amdgcn-amd-amdhsa\"\n"
    "@__oclc_ISA_version = linkonce_odr protected local_unnamed_addr addrspace(4) constant i32 ${isa}, align 4\n")
  execute_process(COMMAND "${LLVM_AS}" "${OUT}/isa_${num}.ll" -o "${bc}.tmp" RESULT_VARIABLE rc ERROR_VARIABLE err)
  if(NOT rc EQUAL 0)
    message(FATAL_ERROR "hip_root.cmake: ${LLVM_AS} failed: ${err}")
  endif()
  file(RENAME "${bc}.tmp" "${bc}")
  file(REMOVE "${OUT}/isa_${num}.ll")
endforeach()
message("hip root: ${OUT}")
