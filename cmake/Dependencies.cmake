# Every dependency comes from Debian's packages (see scripts/setup.sh).
# fmt and spdlog (compiled once, third_party/fmt_spdlog) and yaml-cpp / OpenBLAS are linked statically,
# so build/bin/primus runs on machines that have none of Debian's -dev libraries (the GPU machine is Ubuntu).
find_package(yaml-cpp REQUIRED)
find_package(fmt REQUIRED)
find_package(spdlog REQUIRED)
find_package(CLI11 REQUIRED)
find_package(nlohmann_json REQUIRED)
find_package(Threads REQUIRED)
find_package(OpenMP REQUIRED COMPONENTS CXX)
# Gloo (libgloo-dev): the CPU collectives. Only parallel/gloo's plugin links it; primus opens
# that plugin at run time (parallel/gloo/gloo_plugin_abi.h says why).
find_package(Gloo REQUIRED)

# Cairo draws `primus report` (PNG, SVG, PDF). Only its headers are used at build time: the
# library is dlopen'ed at first use (report/cairo_api.cpp), so the binary carried to GPU machines,
# which have no Cairo, keeps its dependencies (glibc, libgomp) and reports "Cairo not available".
find_package(PkgConfig REQUIRED)
pkg_check_modules(PRIMUS_CAIRO REQUIRED cairo cairo-png cairo-svg cairo-pdf)
add_library(primus_cairo_headers INTERFACE)
target_include_directories(primus_cairo_headers SYSTEM INTERFACE ${PRIMUS_CAIRO_INCLUDE_DIRS})

# utf8proc (libutf8proc-dev): the Unicode normalization forms of tokenizer.json normalizers (NFC
# in Qwen2 / Qwen2.5 / Qwen3 files). The static archive is linked, as yaml-cpp's, so the binary
# does not need the library on the GPU machine.
find_path(PRIMUS_UTF8PROC_INCLUDE utf8proc.h)
find_library(PRIMUS_UTF8PROC_LIB NAMES libutf8proc.a utf8proc)
if(NOT PRIMUS_UTF8PROC_INCLUDE OR NOT PRIMUS_UTF8PROC_LIB)
  message(FATAL_ERROR "utf8proc not found: apt-get install libutf8proc-dev (scripts/setup.sh installs it)")
endif()
add_library(primus_utf8proc INTERFACE)
target_include_directories(primus_utf8proc SYSTEM INTERFACE ${PRIMUS_UTF8PROC_INCLUDE})
target_link_libraries(primus_utf8proc INTERFACE ${PRIMUS_UTF8PROC_LIB})
target_compile_definitions(primus_utf8proc INTERFACE UTF8PROC_STATIC)

set(PRIMUS_YAML_LIB /usr/lib/x86_64-linux-gnu/libyaml-cpp.a)
if(NOT EXISTS ${PRIMUS_YAML_LIB})
  set(PRIMUS_YAML_LIB yaml-cpp)
endif()

find_library(PRIMUS_OPENBLAS_STATIC NAMES libopenblas.a
  PATHS /usr/lib/x86_64-linux-gnu/openblas-pthread /usr/lib/x86_64-linux-gnu NO_DEFAULT_PATH)
add_library(primus_blas INTERFACE)
if(PRIMUS_OPENBLAS_STATIC)
  target_link_libraries(primus_blas INTERFACE ${PRIMUS_OPENBLAS_STATIC} Threads::Threads m)
else()
  find_package(BLAS REQUIRED)
  target_link_libraries(primus_blas INTERFACE ${BLAS_LIBRARIES})
endif()
find_path(PRIMUS_CBLAS_INCLUDE cblas.h PATHS /usr/include/x86_64-linux-gnu/openblas-pthread /usr/include/openblas /usr/include)
target_include_directories(primus_blas INTERFACE ${PRIMUS_CBLAS_INCLUDE})

# fmt and spdlog in their compiled-library mode: their out-of-line code is built once, in
# third_party/fmt_spdlog, instead of in every source that includes them (header-only mode measured
# 0-13 s more per unity file at -O3). Debian ships no static archives of either, hence
# our own; only their headers are used (the include directories of the header-only targets).
add_library(primus_fmt_spdlog STATIC ${CMAKE_SOURCE_DIR}/third_party/fmt_spdlog/fmt_spdlog.cpp)
set_target_properties(primus_fmt_spdlog PROPERTIES UNITY_BUILD OFF POSITION_INDEPENDENT_CODE ON)
target_compile_definitions(primus_fmt_spdlog PUBLIC SPDLOG_COMPILED_LIB SPDLOG_FMT_EXTERNAL)
target_include_directories(primus_fmt_spdlog PUBLIC
  $<TARGET_PROPERTY:fmt::fmt-header-only,INTERFACE_INCLUDE_DIRECTORIES>
  $<TARGET_PROPERTY:spdlog::spdlog_header_only,INTERFACE_INCLUDE_DIRECTORIES>)
target_link_libraries(primus_fmt_spdlog PUBLIC Threads::Threads)

# The common link set for every Primus library.
add_library(primus_deps INTERFACE)
target_link_libraries(primus_deps INTERFACE primus_fmt_spdlog nlohmann_json::nlohmann_json Threads::Threads)
target_include_directories(primus_deps INTERFACE ${CMAKE_SOURCE_DIR})
# libgomp and libstdc++ are on every Linux machine; link them statically anyway so the binary
# depends on nothing but glibc, the CUDA runtime libraries and the driver.
add_link_options($<$<LINK_LANGUAGE:CXX>:-static-libstdc++> $<$<LINK_LANGUAGE:CXX>:-static-libgcc>)
