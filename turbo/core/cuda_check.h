// Check macros for every CUDA runtime and cuBLAS/cuBLASLt call: a failure throws
// primus::RuntimeError carrying the error's name and text, the failing expression and the
// source file:line. CUDA_CHECK_LAST() after each kernel launch catches bad launch
// configurations at the launch site instead of at some later, unrelated call.
// Only CUDA-enabled code includes this header.
#pragma once
#include <cublas_api.h>
#include <cuda_runtime_api.h>

namespace primus::turbo::detail {
[[noreturn]] void throw_cuda_error(cudaError_t err, const char* expr, const char* file, int line);
[[noreturn]] void throw_cublas_error(cublasStatus_t st, const char* expr, const char* file, int line);
}  // namespace primus::turbo::detail

#define CUDA_CHECK(expr)                                                           \
  do {                                                                             \
    const cudaError_t primus_err_ = (expr);                                        \
    if (primus_err_ != cudaSuccess)                                                \
      ::primus::turbo::detail::throw_cuda_error(primus_err_, #expr, __FILE__, __LINE__); \
  } while (0)

#define CUBLAS_CHECK(expr)                                                           \
  do {                                                                               \
    const cublasStatus_t primus_st_ = (expr);                                        \
    if (primus_st_ != CUBLAS_STATUS_SUCCESS)                                         \
      ::primus::turbo::detail::throw_cublas_error(primus_st_, #expr, __FILE__, __LINE__); \
  } while (0)

// After a <<<...>>> launch: a bad grid, too much shared memory or a sticky earlier fault.
#define CUDA_CHECK_LAST() CUDA_CHECK(cudaGetLastError())

namespace primus::turbo {
// Number of CUDA devices, or 0 when there is no driver, no device or any error; never throws.
// GPU tests skip themselves on 0.
int cuda_device_count_or_zero();
// True while `stream` is being captured into a CUDA graph (the dispatcher then skips autotune).
bool cuda_stream_is_capturing(cudaStream_t stream);
}  // namespace primus::turbo
