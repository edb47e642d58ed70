// Two one-thread kernels around the all-reduce of the squared shard norms (dp_norm.h): the
// values stay on the device, so the step needs no host round trip for the clip factor.
#include "turbo/kernels/cuda/dp_norm.h"

#include <algorithm>
#include <cstdint>

#include "turbo/core/cuda_check.h"

namespace primus::turbo::cuda {
namespace {

__global__ void square_norm_kernel(float* out) { out[0] = out[0] * out[0]; }

__global__ void remove_squares_kernel(float* out, const float* part) { out[0] = remove_squares_value(out[0], part[0]); }

__global__ void finish_norm_kernel(float* out, float max_norm) {
  // The sum of squares in f64 as turbo's grad_norm takes its square root.
  const double norm = sqrt(static_cast<double>(out[0]));
  out[0] = static_cast<float>(norm);
  out[1] = max_norm > 0.0f ? static_cast<float>(fmin(1.0, max_norm / (norm + 1e-6))) : 1.0f;
}

__global__ void bf16_to_f32_kernel(float* dst, const uint16_t* src, int64_t n) {
  for (int64_t i = blockIdx.x * int64_t(blockDim.x) + threadIdx.x; i < n; i += int64_t(gridDim.x) * blockDim.x) {
    dst[i] = __uint_as_float(static_cast<uint32_t>(src[i]) << 16);
  }
}

}  // namespace

void remove_squares(float* out, const float* part, cudaStream_t stream) {
  remove_squares_kernel<<<1, 1, 0, stream>>>(out, part);
  CUDA_CHECK_LAST();
}

void bf16_to_f32(float* dst, const void* src, int64_t n, cudaStream_t stream) {
  if (n <= 0) return;
  const int64_t blocks = std::min<int64_t>((n + 255) / 256, 4096);
  bf16_to_f32_kernel<<<static_cast<unsigned>(blocks), 256, 0, stream>>>(dst, static_cast<const uint16_t*>(src), n);
  CUDA_CHECK_LAST();
}

void square_norm(float* out, cudaStream_t stream) {
  square_norm_kernel<<<1, 1, 0, stream>>>(out);
  CUDA_CHECK_LAST();
}

void finish_norm(float* out, float max_norm, cudaStream_t stream) {
  finish_norm_kernel<<<1, 1, 0, stream>>>(out, max_norm);
  CUDA_CHECK_LAST();
}

}  // namespace primus::turbo::cuda
