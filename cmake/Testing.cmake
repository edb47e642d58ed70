# primus_add_test(NAME SOURCES a.cpp b.cpp LIBS lib... [LABELS unit|e2e|gpu ...])
# One GoogleTest binary per area; each TEST becomes a ctest test carrying the labels.
# GPU tests carry the label `gpu` and GTEST_SKIP() themselves when no GPU is present.
include(GoogleTest)
find_package(GTest REQUIRED)
function(primus_add_test name)
  cmake_parse_arguments(T "" "" "SOURCES;LIBS;LABELS" ${ARGN})
  add_executable(${name} ${T_SOURCES})
  target_link_libraries(${name} PRIVATE ${T_LIBS} primus_deps GTest::gtest GTest::gtest_main)
  target_compile_definitions(${name} PRIVATE
    PRIMUS_SOURCE_DIR="${PRIMUS_ROOT}" PRIMUS_BINARY_DIR="${CMAKE_BINARY_DIR}")
  if(NOT T_LABELS)
    set(T_LABELS unit)
  endif()
  # One OpenMP thread per test: ctest runs tests side by side on few cores, and spinning OpenMP
  # teams on an oversubscribed machine are 100x slower. Tests that need threads set them.
  gtest_discover_tests(${name} PROPERTIES LABELS "${T_LABELS}" ENVIRONMENT "OMP_NUM_THREADS=1;OPENBLAS_NUM_THREADS=1" DISCOVERY_TIMEOUT 60
                       WORKING_DIRECTORY ${CMAKE_BINARY_DIR})
endfunction()
