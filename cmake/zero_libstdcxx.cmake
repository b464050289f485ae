# NOTE [standard library first]: the shared libstdc++ a program lists before
# LibTorch, by its path. "-lstdc++" finds a compiler's static libstdc++.a where
# its own folders hold no shared one (the GPU machine's /opt/gcc, round 2 of
# 2026-11-27): nothing is NEEDED then, and std::filesystem binds to LibTorch's
# copies again. Included by zero's build and by the installed zeroConfig.cmake,
# so a user's program gets the same, found with the user's compiler.
#
# zero_libstdcxx_link_option(OUT): OUT = the link option (LINKER:...) that
# lists it first; "-lstdc++" in its place, with a warning, when there is none.
function(zero_libstdcxx_link_option out)
  if(NOT ZERO_LIBSTDCXX_SO)
    execute_process(COMMAND ${CMAKE_CXX_COMPILER} -print-file-name=libstdc++.so.6
                    OUTPUT_VARIABLE compiler_libstdcxx OUTPUT_STRIP_TRAILING_WHITESPACE ERROR_QUIET)
    get_filename_component(compiler_dir "${compiler_libstdcxx}" DIRECTORY)
    find_file(ZERO_LIBSTDCXX_SO libstdc++.so.6
              PATHS "${compiler_dir}" /usr/lib/${CMAKE_LIBRARY_ARCHITECTURE} /lib/${CMAKE_LIBRARY_ARCHITECTURE}
                    /usr/lib/x86_64-linux-gnu /usr/lib/aarch64-linux-gnu /usr/lib64 /lib64
              NO_DEFAULT_PATH DOC "The shared libstdc++ every program lists before LibTorch (NOTE [standard library first])")
  endif()
  if(ZERO_LIBSTDCXX_SO)
    set(lib "${ZERO_LIBSTDCXX_SO}")
  else()
    message(WARNING "zero: no shared libstdc++.so.6 found (set ZERO_LIBSTDCXX_SO to its path); linking -lstdc++, "
                    "which is the static library with some compilers: std::filesystem may then bind to LibTorch's copies")
    set(lib "-lstdc++")
  endif()
  set(${out} "LINKER:--push-state,--no-as-needed,${lib},--pop-state" PARENT_SCOPE)
endfunction()
