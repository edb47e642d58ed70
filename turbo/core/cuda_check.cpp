#include "turbo/core/cuda_check.h"

#include <fmt/format.h>

#include "core/util/error.h"

namespace primus::turbo {
namespace {
const char* cublas_status_name(cublasStatus_t st) {
  switch (st) {
    case CUBLAS_STATUS_SUCCESS: return "CUBLAS_STATUS_SUCCESS";
    case CUBLAS_STATUS_NOT_INITIALIZED: return "CUBLAS_STATUS_NOT_INITIALIZED (no handle or no GPU)";
    case CUBLAS_STATUS_ALLOC_FAILED: return "CUBLAS_STATUS_ALLOC_FAILED";
    case CUBLAS_STATUS_INVALID_VALUE: return "CUBLAS_STATUS_INVALID_VALUE (bad argument or layout)";
    case CUBLAS_STATUS_ARCH_MISMATCH: return "CUBLAS_STATUS_ARCH_MISMATCH (feature needs a newer GPU)";
    case CUBLAS_STATUS_MAPPING_ERROR: return "CUBLAS_STATUS_MAPPING_ERROR";
    case CUBLAS_STATUS_EXECUTION_FAILED: return "CUBLAS_STATUS_EXECUTION_FAILED (kernel failed to launch)";
    case CUBLAS_STATUS_INTERNAL_ERROR: return "CUBLAS_STATUS_INTERNAL_ERROR";
    case CUBLAS_STATUS_NOT_SUPPORTED: return "CUBLAS_STATUS_NOT_SUPPORTED (no kernel for this combination)";
    case CUBLAS_STATUS_LICENSE_ERROR: return "CUBLAS_STATUS_LICENSE_ERROR";
  }
  return "unknown cuBLAS status";
}
}  // namespace

namespace detail {
void throw_cuda_error(cudaError_t err, const char* expr, const char* file, int line) {
  // A failed runtime call also records itself as the thread's "last error"; clear it so a
  // later CUDA_CHECK_LAST() does not report this failure again at an unrelated launch (sticky
  // errors, which poison the context, stay whatever we do).
  (void)cudaGetLastError();
  throw RuntimeError(fmt::format("CUDA error {} ({}) in `{}` at {}:{}", cudaGetErrorName(err),
                                 cudaGetErrorString(err), expr, file, line));
}
void throw_cublas_error(cublasStatus_t st, const char* expr, const char* file, int line) {
  throw RuntimeError(fmt::format("cuBLAS error {} = {} in `{}` at {}:{}", static_cast<int>(st),
                                 cublas_status_name(st), expr, file, line));
}
}  // namespace detail

int cuda_device_count_or_zero() {
  int n = 0;
  if (cudaGetDeviceCount(&n) != cudaSuccess) {
    (void)cudaGetLastError();  // clear the sticky "no driver" error for later callers
    return 0;
  }
  return n;
}

bool cuda_stream_is_capturing(cudaStream_t stream) {
  cudaStreamCaptureStatus st = cudaStreamCaptureStatusNone;
  if (cudaStreamIsCapturing(stream, &st) != cudaSuccess) {
    (void)cudaGetLastError();
    return false;
  }
  return st != cudaStreamCaptureStatusNone;
}

}  // namespace primus::turbo
