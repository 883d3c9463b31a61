# Verifies the checked sim kernels' objects before the module links (a PRE_LINK step of _native):
#   cmake -DNM=<nm> [-DSYMBOL_PREFIX=_] -P check_sim_objects.cmake -- <object>...
#
# The checked build's hooks see loads, stores and atomics, and the memory intrinsics the
# ThreadSanitizer pass turns into calls of the checked __tsan_memset / __tsan_memcpy /
# __tsan_memmove (csrc/sim/check.cpp). Anything else that reaches memory would do so unchecked,
# uncounted, and in check mode outside the windows the sim copies back. So each object must:
# - reference __tsan_init: the instrumentation ran (without it, small memory intrinsics are
#   expanded inline, which no symbol shows);
# - reference no other __tsan_ function: nothing but the memory intrinsics is instrumented;
# - call no C library function that reads or writes memory for the kernel: memset, memcpy,
#   memmove, bzero, bcopy, their _chk forms, memset_pattern4/8/16 (Apple's loop idiom).
set(library_functions memset memcpy memmove bzero bcopy __memset_chk __memcpy_chk __memmove_chk
    memset_pattern4 memset_pattern8 memset_pattern16)
set(hooks __tsan_init __tsan_memset __tsan_memcpy __tsan_memmove)

set(objects)
set(after_separator FALSE)
math(EXPR last "${CMAKE_ARGC} - 1")
foreach(i RANGE ${last})
  if(after_separator)
    list(APPEND objects "${CMAKE_ARGV${i}}")
  elseif(CMAKE_ARGV${i} STREQUAL "--")
    set(after_separator TRUE)
  endif()
endforeach()
if(NOT objects)
  message(FATAL_ERROR "check_sim_objects.cmake: no checked kernel object given")
endif()

set(problems)
foreach(object IN LISTS objects)
  execute_process(COMMAND "${NM}" -u "${object}" OUTPUT_VARIABLE listing RESULT_VARIABLE failed)
  if(failed)
    message(FATAL_ERROR "check_sim_objects.cmake: ${NM} -u ${object} failed")
  endif()
  # One undefined symbol per line: "U name" (GNU, llvm-nm) or the name alone (Apple's nm -u).
  string(REGEX MATCHALL "[^ \t\r\n]+[\r\n]" names "${listing}\n")
  set(undefined)
  foreach(name IN LISTS names)
    string(STRIP "${name}" name)
    if(SYMBOL_PREFIX AND name MATCHES "^${SYMBOL_PREFIX}(.*)$")
      set(name "${CMAKE_MATCH_1}")
    endif()
    list(APPEND undefined "${name}")
  endforeach()
  get_filename_component(shown "${object}" NAME)
  if(NOT "__tsan_init" IN_LIST undefined)
    list(APPEND problems "${shown}: not compiled with the memory-intrinsic hooks (no __tsan_init)")
  endif()
  foreach(name IN LISTS undefined)
    if(name IN_LIST library_functions)
      list(APPEND problems "${shown}: calls ${name}, which no hook of the checked build sees")
    elseif(name MATCHES "^__tsan_" AND NOT name IN_LIST hooks)
      list(APPEND problems "${shown}: calls ${name}: more than memory intrinsics instrumented")
    endif()
  endforeach()
endforeach()
if(problems)
  list(JOIN problems "\n  " text)
  message(FATAL_ERROR "checked sim kernels that would reach memory unchecked:\n  ${text}\n"
                      "(see the checked-build flags in CMakeLists.txt)")
endif()
