# Install step of server/CMakeLists.txt: bin/llama-server and lib/ with the server's own shared
# libraries (llama-server-impl, llama-common, mtmd and their symlinks), never libllama or libggml:
# those come from the flavor's library folder at run time.
#   cmake -DBIN=<build>/bin -DOUT=<prefix> -P install_server.cmake
file(MAKE_DIRECTORY "${OUT}/bin" "${OUT}/lib")
file(COPY "${BIN}/llama-server" DESTINATION "${OUT}/bin")
file(GLOB libs "${BIN}/lib*.so*")
foreach(l IN LISTS libs)
  get_filename_component(name "${l}" NAME)
  if(NOT name MATCHES "^lib(llama|ggml)[.-]" OR name MATCHES "^libllama-(common|server-impl)\\.so")
    file(COPY "${l}" DESTINATION "${OUT}/lib")
  endif()
endforeach()
foreach(need llama-server-impl llama-common mtmd)
  if(NOT EXISTS "${OUT}/lib/lib${need}.so")
    message(FATAL_ERROR "install_server.cmake: lib${need}.so is not in ${BIN}")
  endif()
endforeach()
