# CTest fixture ggml_hip_root: the HIP headers (fetched once into the user cache by
# tools/fetch_hip_headers.py with pip) and a ROCm-shaped root for clang (hip_root.cmake).
#   cmake -DPYTHON=<python with pip> -DHIP_KERNELS=<repo>/hip_kernels -DDEVICE_LIBS=<bitcode dir>
#         -DLLVM_AS=llvm-as-19 -DARCHS=gfx1151,gfx1201 -DOUT=<root> -P ggml_hip_setup.cmake
foreach(v PYTHON HIP_KERNELS DEVICE_LIBS LLVM_AS ARCHS OUT)
  if(NOT DEFINED ${v})
    message(FATAL_ERROR "ggml_hip_setup.cmake: -D${v}=... is required")
  endif()
endforeach()
execute_process(COMMAND "${PYTHON}" "${HIP_KERNELS}/tools/fetch_hip_headers.py" --python "${PYTHON}"
                RESULT_VARIABLE rc OUTPUT_VARIABLE headers ERROR_VARIABLE err OUTPUT_STRIP_TRAILING_WHITESPACE)
if(NOT rc EQUAL 0)
  message(FATAL_ERROR "fetching the HIP headers failed:\n${err}")
endif()
message("HIP headers: ${headers}")
execute_process(COMMAND "${CMAKE_COMMAND}" -DHEADERS=${headers} -DDEVICE_LIBS=${DEVICE_LIBS} -DLLVM_AS=${LLVM_AS}
                        -DARCHS=${ARCHS} -DOUT=${OUT} -P "${CMAKE_CURRENT_LIST_DIR}/hip_root.cmake"
                RESULT_VARIABLE rc ERROR_VARIABLE err)
if(NOT rc EQUAL 0)
  message(FATAL_ERROR "${err}")
endif()
message("${err}")
