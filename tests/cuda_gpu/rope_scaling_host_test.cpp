// Llama-3's RoPE frequency scaling in the cuda model's host mode against the reference
// (rope_scaling_parity.h); fp32 on both sides, the gates of host_parity_test.cpp.
#include "tests/cuda_gpu/rope_scaling_parity.h"

namespace primus::backends::cuda::testing {
namespace {

TEST(HostRopeScalingParity, LossAndEveryGradientMatchReference) {
  expect_rope_scaling_parity(turbo::Device::CPU, 1e-5, 1e-4);
}

}  // namespace
}  // namespace primus::backends::cuda::testing
