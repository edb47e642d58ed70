// Llama-3's RoPE frequency scaling in the cuda model on the device (bf16, the scaled cos/sin
// table) against the fp32 reference (rope_scaling_parity.h). Skips without a GPU.
#include "tests/cuda_gpu/rope_scaling_parity.h"

namespace primus::backends::cuda::testing {
namespace {

class RopeScalingGpuTest : public CudaGpuTest {};

// bf16 against fp32: model_parity_test.cpp's step-0 loss gate and its Llama gradient gate (rounded up).
TEST_F(RopeScalingGpuTest, LossAndEveryGradientMatchReference) {
  expect_rope_scaling_parity(turbo::Device::CUDA, 1e-2, 3e-2);
}

}  // namespace
}  // namespace primus::backends::cuda::testing
