# The C++ compilers Lily builds with, and a probe for groups of compiler flags. Included from
# CMakeLists.txt; tests/test_compiler_gate.py runs both on their own.
#
# The sim compiles the .metal sources as C++ and needs __bf16 as an arithmetic type (upstream
# clang 17, and Apple's clang from Xcode 16: AppleClang 16, which is based on it) and the
# -Xclang=-fbfloat16-excess-precision=none flag (clang 17 too). clang 16 and AppleClang 15
# (Xcode 15, the newest on macOS 14.0-14.4) reject both: 26 of 53 translation units fail with
# bfloat errors. So they are refused here, in one line, before anything is compiled.
set(LILY_MIN_CLANG 17)
set(LILY_MIN_APPLECLANG 16)

# Fails the configure with one line saying which compiler is needed, unless `id` `version` is
# a clang Lily supports. (The leading space keeps CMake from wrapping the message.)
function(lily_require_compiler id version path)
  if(id STREQUAL "AppleClang")
    if(version VERSION_LESS LILY_MIN_APPLECLANG)
      message(FATAL_ERROR
        " Lily needs AppleClang ${LILY_MIN_APPLECLANG} or later (Xcode ${LILY_MIN_APPLECLANG} or its "
        "Command Line Tools, which need macOS 14.5 or later); found AppleClang ${version} (${path}).")
    endif()
  elseif(id STREQUAL "Clang")
    if(version VERSION_LESS LILY_MIN_CLANG)
      message(FATAL_ERROR
        " Lily needs clang ${LILY_MIN_CLANG} or later as the C++ compiler (Debian: clang-19); "
        "found clang ${version} (${path}).")
    endif()
  else()
    message(FATAL_ERROR
      " Lily needs clang ${LILY_MIN_CLANG} or later (on macOS: AppleClang ${LILY_MIN_APPLECLANG}, "
      "Xcode ${LILY_MIN_APPLECLANG}) as the C++ compiler; found ${id} ${version} (${path}).")
  endif()
endfunction()

# Sets `var` to whether the C++ compiler compiles a small source with every flag given, each
# its own argument, and uses them all: an unknown flag is an error, and a flag the compiler
# accepts but ignores counts as unknown (-Werror=unused-command-line-argument). Compile only, so
# flags whose run-time support a link would need can be probed too. The result is cached under
# `var`, like CMake's own checks.
function(lily_compiler_accepts var)
  include(CheckCXXSourceCompiles)
  set(CMAKE_REQUIRED_DEFINITIONS ${ARGN})
  set(CMAKE_REQUIRED_FLAGS "-Werror=unused-command-line-argument")
  set(CMAKE_TRY_COMPILE_TARGET_TYPE STATIC_LIBRARY)
  check_cxx_source_compiles("
    #include <string.h>
    int lily_probe(int* p, char* q, const char* r, unsigned n) {
      memcpy(q, r, n);
      return *p += 1;
    }" ${var})
endfunction()
