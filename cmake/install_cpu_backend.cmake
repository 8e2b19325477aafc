# Install the CPU backend alone (DFLASH_CPU_BACKEND_ONLY): BIN/libggml-cpu.so* -> PREFIX/lib,
# links kept as links, so the library sits beside another build's libllama and libggml-base.
file(GLOB _files "${BIN}/libggml-cpu.so*")
if(NOT _files)
  message(FATAL_ERROR "no libggml-cpu.so in ${BIN}")
endif()
file(MAKE_DIRECTORY "${PREFIX}/lib")
file(COPY ${_files} DESTINATION "${PREFIX}/lib" FOLLOW_SYMLINK_CHAIN)
