# primus_add_test(NAME SOURCES a.cpp b.cpp LIBS lib... [LABELS unit|e2e|gpu ...])
# One GoogleTest binary per area; each TEST becomes a ctest test carrying the labels.
# GPU tests carry the label `gpu` and GTEST_SKIP() themselves when no GPU is present.
include(GoogleTest)
find_package(GTest REQUIRED)
# The tests' own sources are compiled with these flags appended to the build type's; the libraries
# they check keep the build type's. Test code is glue around library calls: on 2 cores -O0 took the
# CPU tests' objects from 305 to 145 CPU-seconds in the Release build and from 481 to 251 in the
# ASan build (-O1 before), while ctest took the same CPU time (122 against 129 s Release, 311
# against 332 s ASan). GPU tests keep the build type's flags: their host reference products (double
# loops over whole GEMMs) are hot. PRIMUS_TEST_OPT="" keeps the build type's flags everywhere.
set(PRIMUS_TEST_OPT "-O0" CACHE STRING "Flags appended for the sources of the CPU tests")
separate_arguments(PRIMUS_TEST_OPT_LIST UNIX_COMMAND "${PRIMUS_TEST_OPT}")
function(primus_add_test name)
  cmake_parse_arguments(T "" "" "SOURCES;LIBS;LABELS" ${ARGN})
  add_executable(${name} ${T_SOURCES})
  target_link_libraries(${name} PRIVATE ${T_LIBS} primus_deps GTest::gtest GTest::gtest_main)
  target_compile_definitions(${name} PRIVATE
    PRIMUS_SOURCE_DIR="${PRIMUS_ROOT}" PRIMUS_BINARY_DIR="${CMAKE_BINARY_DIR}")
  if(NOT T_LABELS)
    set(T_LABELS unit)
  endif()
  if(NOT "gpu" IN_LIST T_LABELS)
    target_compile_options(${name} PRIVATE "$<$<COMPILE_LANGUAGE:CXX>:${PRIMUS_TEST_OPT_LIST}>")
  endif()
  # One OpenMP thread per test: ctest runs tests side by side on few cores, and spinning OpenMP
  # teams on an oversubscribed machine are 100x slower. Tests that need threads set them.
  gtest_discover_tests(${name} PROPERTIES LABELS "${T_LABELS}" ENVIRONMENT "OMP_NUM_THREADS=1;OPENBLAS_NUM_THREADS=1" DISCOVERY_TIMEOUT 60
                       WORKING_DIRECTORY ${CMAKE_BINARY_DIR})
endfunction()
