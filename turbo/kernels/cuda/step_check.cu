#include "turbo/kernels/cuda/step_check.h"
#include "turbo/kernels/cuda/common.cuh"

namespace primus::turbo::cuda {

namespace {
__global__ void step_check_kernel(float* status, int64_t n_losses, int64_t slots) {
  step_check_apply(status, n_losses, slots);
}
__global__ void step_check_begin_kernel(float* status, int64_t n_losses, int64_t slots) {
  step_check_begin_apply(status, n_losses, slots);
}
__global__ void step_check_group_kernel(float* status, int64_t slots, const float* group_norm, bool last) {
  step_check_group_apply(status, slots, group_norm[0], last);
}
}  // namespace

void step_check_begin(float* status, int64_t n_losses, int64_t slots, cudaStream_t stream) {
  step_check_begin_kernel<<<1, 1, 0, stream>>>(status, n_losses, slots);
  CUDA_CHECK_LAST();
}

void step_check_group(float* status, int64_t slots, const float* group_norm, bool last, cudaStream_t stream) {
  step_check_group_kernel<<<1, 1, 0, stream>>>(status, slots, group_norm, last);
  CUDA_CHECK_LAST();
}

void step_check(float* status, int64_t n_losses, int64_t slots, cudaStream_t stream) {
  step_check_kernel<<<1, 1, 0, stream>>>(status, n_losses, slots);
  CUDA_CHECK_LAST();
}

}  // namespace primus::turbo::cuda
