# The Metal device, for Apple platforms only: included from CMakeLists.txt after the _native
# target exists.
#
# * compiles csrc/metal/metal_device.mm (Objective-C++, ARC) and gpu_core_count.cpp into _native
#   and links Metal, IOKit, Foundation and CoreGraphics; defines LILY_METAL so that bindings.cpp
#   can expose the device;
# * installs metal/*.metal and metal/*.h as lily/metal/ (compiled at first run without a metallib);
# * when Xcode's Metal toolchain is installed (`xcrun metal`), compiles metal/*.metal into
#   lily.metallib and installs it beside the module. Without the toolchain (Command Line Tools
#   only, or Xcode 26 without the separately downloaded Metal toolchain) nothing fails: the
#   device compiles the shipped .metal sources at first run instead. Unless
#   LILY_REQUIRE_METALLIB is ON (the macOS workflow): then a missing toolchain fails the build,
#   so that a run that should test the metallib cannot silently test the first-run compile.

enable_language(OBJCXX)

option(LILY_REQUIRE_METALLIB
  "Fail the build when lily.metallib cannot be built (no xcrun metal) instead of leaving the kernels to a first-run compile"
  OFF)

target_sources(_native PRIVATE "${PROJECT_SOURCE_DIR}/csrc/metal/metal_device.mm"
  "${PROJECT_SOURCE_DIR}/csrc/metal/gpu_core_count.cpp")
set_source_files_properties("${PROJECT_SOURCE_DIR}/csrc/metal/metal_device.mm"
  PROPERTIES COMPILE_OPTIONS "-fobjc-arc")
set_target_properties(_native PROPERTIES OBJCXX_STANDARD 20 OBJCXX_STANDARD_REQUIRED ON)
target_compile_definitions(_native PRIVATE LILY_METAL=1)
# Apple documents that MTLCreateSystemDefaultDevice returns a device on macOS only when the
# program links CoreGraphics, which a Python extension does not do by itself. IOKit: the GPU's
# core count (gpu_core_count.cpp).
target_link_libraries(_native PRIVATE
  "-framework Metal" "-framework Foundation" "-framework CoreGraphics" "-framework IOKit")

# The .metal sources ship in the package: without a prebuilt metallib the device compiles them.
install(DIRECTORY "${PROJECT_SOURCE_DIR}/metal/" DESTINATION lily/metal
  FILES_MATCHING PATTERN "*.metal" PATTERN "*.h")

# The MSL version and minimum macOS of each kernel file: metal/msl_versions.txt, the one list the
# macOS workflow's kernel loop reads too. lily.metallib holds the files at the default version
# (MSL 3.1, bfloat), with the same math mode as the run-time compile in metal_device.mm, so both
# paths build the same library. A file listed at another version (the tensor-op GEMMs, MSL 4.0,
# macOS 26) is left out: the device compiles it when it opens, on an M5 only, and falls back to
# the simdgroup-matrix kernels without it.
set(lily_msl_versions_file "${PROJECT_SOURCE_DIR}/metal/msl_versions.txt")
set_property(DIRECTORY APPEND PROPERTY CMAKE_CONFIGURE_DEPENDS "${lily_msl_versions_file}")
file(STRINGS "${lily_msl_versions_file}" lily_msl_lines REGEX "^[^#]")
set(lily_msl_default "")
set(lily_msl_other_files "")
foreach(line IN LISTS lily_msl_lines)
  if(line MATCHES "^[ \t]*$")
    continue()
  endif()
  if(NOT line MATCHES "^([^ \t]+)[ \t]+([0-9]+\\.[0-9]+)[ \t]+([0-9]+\\.[0-9]+)[ \t]*$")
    message(FATAL_ERROR "metal/msl_versions.txt: cannot read the line \"${line}\"")
  endif()
  if(CMAKE_MATCH_1 STREQUAL "default")
    set(lily_msl_default "${CMAKE_MATCH_2}")
    set(lily_msl_default_macos "${CMAKE_MATCH_3}")
  else()
    list(APPEND lily_msl_other_files "${CMAKE_MATCH_1}")
  endif()
endforeach()
if(NOT lily_msl_default)
  message(FATAL_ERROR "metal/msl_versions.txt has no default line")
endif()
set(lily_metallib_flags
  -std=metal${lily_msl_default} -mmacosx-version-min=${lily_msl_default_macos} -fno-fast-math)

execute_process(
  COMMAND xcrun -sdk macosx metal --version
  RESULT_VARIABLE lily_metal_toolchain_missing
  OUTPUT_QUIET ERROR_QUIET)

file(GLOB lily_metallib_sources CONFIGURE_DEPENDS "${PROJECT_SOURCE_DIR}/metal/*.metal")
foreach(name IN LISTS lily_msl_other_files)
  list(REMOVE_ITEM lily_metallib_sources "${PROJECT_SOURCE_DIR}/metal/${name}")
endforeach()
file(GLOB lily_metallib_headers CONFIGURE_DEPENDS "${PROJECT_SOURCE_DIR}/metal/*.h")

if(lily_metal_toolchain_missing OR NOT lily_metallib_sources)
  if(LILY_REQUIRE_METALLIB)
    message(FATAL_ERROR
      "Lily: LILY_REQUIRE_METALLIB is ON but lily.metallib cannot be built: "
      "`xcrun -sdk macosx metal --version` failed (no Metal toolchain: install Xcode, and on "
      "Xcode 26 or later `xcodebuild -downloadComponent MetalToolchain`) or metal/ has no kernels")
  endif()
  message(STATUS "Lily: no Metal toolchain (xcrun metal) or no kernels: the metal device will "
                 "compile metal/*.metal at first run")
else()
  set(lily_air_files "")
  foreach(source IN LISTS lily_metallib_sources)
    get_filename_component(stem "${source}" NAME_WE)
    set(air "${CMAKE_CURRENT_BINARY_DIR}/metal/${stem}.air")
    add_custom_command(
      OUTPUT "${air}"
      COMMAND "${CMAKE_COMMAND}" -E make_directory "${CMAKE_CURRENT_BINARY_DIR}/metal"
      COMMAND xcrun -sdk macosx metal ${lily_metallib_flags} -c "${source}" -o "${air}"
      DEPENDS "${source}" ${lily_metallib_headers}
      COMMENT "Compiling Metal kernels ${stem}.metal"
      VERBATIM)
    list(APPEND lily_air_files "${air}")
  endforeach()
  set(lily_metallib "${CMAKE_CURRENT_BINARY_DIR}/lily.metallib")
  add_custom_command(
    OUTPUT "${lily_metallib}"
    COMMAND xcrun -sdk macosx metallib ${lily_air_files} -o "${lily_metallib}"
    DEPENDS ${lily_air_files}
    COMMENT "Linking lily.metallib"
    VERBATIM)
  add_custom_target(lily_metallib ALL DEPENDS "${lily_metallib}")
  install(FILES "${lily_metallib}" DESTINATION lily)
  message(STATUS "Lily: building lily.metallib with xcrun metal at MSL ${lily_msl_default} "
                 "(left to the device: ${lily_msl_other_files})")
endif()
