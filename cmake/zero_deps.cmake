# zero's dependencies besides LibTorch: nlohmann/json, oneTBB, liburing
# (target PkgConfig::URING), Threads. Included by the top-level CMakeLists and
# by the installed zeroConfig.cmake, so a consumer finds them where zero did.
#
# ZERO_DEPS_PREFIX: a folder made by scripts/gpu/bundle.sh (the GPU machine
# has no package registry). Set, every dependency comes from there and from
# nowhere else (NO_DEFAULT_PATH): a missing piece fails here, naming it,
# instead of silently taking the system's. Unset, the system's packages
# (scripts/setup.sh installs them).
if(ZERO_DEPS_PREFIX)
  get_filename_component(ZERO_DEPS_PREFIX "${ZERO_DEPS_PREFIX}" ABSOLUTE)
  set(ZERO_DEPS_ROOT "${ZERO_DEPS_PREFIX}/usr")
  if(NOT EXISTS "${ZERO_DEPS_PREFIX}/MANIFEST" OR NOT EXISTS "${ZERO_DEPS_ROOT}/include/liburing.h")
    message(FATAL_ERROR "zero: ZERO_DEPS_PREFIX=${ZERO_DEPS_PREFIX} is not a folder made by scripts/gpu/bundle.sh "
                        "(no MANIFEST or usr/include/liburing.h); run scripts/gpu/bundle.sh there first")
  endif()
  set(ZERO_DEPS_FIND PATHS "${ZERO_DEPS_ROOT}" NO_DEFAULT_PATH)
else()
  set(ZERO_DEPS_FIND)
endif()

find_package(nlohmann_json 3.10 REQUIRED CONFIG ${ZERO_DEPS_FIND})
find_package(TBB REQUIRED CONFIG ${ZERO_DEPS_FIND})
find_package(Threads REQUIRED)

if(NOT TARGET PkgConfig::URING)
  if(ZERO_DEPS_PREFIX)
    # The static library: nothing of liburing is needed where the programs run.
    find_path(ZERO_URING_INCLUDE_DIR liburing.h PATHS "${ZERO_DEPS_ROOT}/include" NO_DEFAULT_PATH REQUIRED)
    find_library(ZERO_URING_LIBRARY NAMES liburing.a
                 PATHS "${ZERO_DEPS_ROOT}/lib/${CMAKE_LIBRARY_ARCHITECTURE}" "${ZERO_DEPS_ROOT}/lib/x86_64-linux-gnu"
                       "${ZERO_DEPS_ROOT}/lib" NO_DEFAULT_PATH REQUIRED)
    add_library(PkgConfig::URING INTERFACE IMPORTED)
    set_target_properties(PkgConfig::URING PROPERTIES INTERFACE_INCLUDE_DIRECTORIES "${ZERO_URING_INCLUDE_DIR}"
                                                      INTERFACE_LINK_LIBRARIES "${ZERO_URING_LIBRARY}")
  else()
    find_package(PkgConfig REQUIRED)
    pkg_check_modules(URING REQUIRED IMPORTED_TARGET liburing)
    set(ZERO_URING_LIBRARY "${URING_LINK_LIBRARIES}")
  endif()
endif()
