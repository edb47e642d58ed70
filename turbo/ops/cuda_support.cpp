// CUDA-only helpers of the ops layer (compiled in CUDA builds only).
#include <cuda_runtime_api.h>

#include <algorithm>
#include <vector>

#include "turbo/core/cuda_check.h"
#include "turbo/ops/op_support.h"

namespace primus::turbo::detail {

double cuda_time_ms(void* stream_ptr, const std::function<void()>& run) {
  auto stream = static_cast<cudaStream_t>(stream_ptr);
  run();  // warm-up: plan creation, first-touch
  cudaEvent_t start, stop;
  CUDA_CHECK(cudaEventCreate(&start));
  CUDA_CHECK(cudaEventCreate(&stop));
  std::vector<float> ms(5);
  for (float& t : ms) {
    CUDA_CHECK(cudaEventRecord(start, stream));
    run();
    CUDA_CHECK(cudaEventRecord(stop, stream));
    CUDA_CHECK(cudaEventSynchronize(stop));
    CUDA_CHECK(cudaEventElapsedTime(&t, start, stop));
  }
  cudaEventDestroy(start);
  cudaEventDestroy(stop);
  std::nth_element(ms.begin(), ms.begin() + 2, ms.end());
  return ms[2];
}

void cuda_copy_rows(void* dst, int64_t dst_pitch, const void* src, int64_t src_pitch, int64_t row_bytes,
                    int64_t rows, void* stream) {
  if (rows == 0 || row_bytes == 0) return;
  CUDA_CHECK(cudaMemcpy2DAsync(dst, size_t(dst_pitch), src, size_t(src_pitch), size_t(row_bytes), size_t(rows),
                               cudaMemcpyDeviceToDevice, static_cast<cudaStream_t>(stream)));
}

bool cuda_capturing(void* stream) { return cuda_stream_is_capturing(static_cast<cudaStream_t>(stream)); }

}  // namespace primus::turbo::detail
