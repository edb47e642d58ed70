# CUDA is compiled whenever nvcc is present (also in CI, where no GPU can run it).
set(PRIMUS_HAVE_CUDA OFF)
if(NOT PRIMUS_CUDA STREQUAL "OFF")
  if(NOT CMAKE_CUDA_COMPILER AND EXISTS /usr/local/cuda/bin/nvcc)
    set(CMAKE_CUDA_COMPILER /usr/local/cuda/bin/nvcc)
  endif()
  include(CheckLanguage)
  check_language(CUDA)
  if(CMAKE_CUDA_COMPILER)
    if(NOT DEFINED CMAKE_CUDA_ARCHITECTURES)
      # SASS only: compute_90a PTX can be JIT-compiled for sm_90a alone, which the SASS already
      # covers, and it made the binaries a third larger (the device call carries them).
      set(CMAKE_CUDA_ARCHITECTURES 90a-real)
    endif()
    enable_language(CUDA)
    find_package(CUDAToolkit REQUIRED)
    # nvcc 13 with CMake 3.25 cannot generate CUDA 20 targets; device code is C++17.
    set(CMAKE_CUDA_STANDARD 17)
    set(PRIMUS_HAVE_CUDA ON)
  elseif(PRIMUS_CUDA STREQUAL "ON")
    message(FATAL_ERROR "PRIMUS_CUDA=ON but nvcc was not found")
  endif()
endif()
message(STATUS "Primus CUDA parts: ${PRIMUS_HAVE_CUDA}")
