// fp8_recipe delayed under data parallelism on the GPU (fp8_dp_parity.h): two replicas sharing one
// GPU, the gradient mean and the amax max through device memory (parallel/cuda/threaded_device_ops.h),
// so that reduce_fp8_amaxes' device path runs: the strided copies of the newest entries into the
// staging column and back (history 3), or the reduction in place (history 1). The replicas keep the
// same histories and scales bit for bit whatever the GPU's rounding. With the weights frozen they
// are the one model's (dy's scaled by two: fp8_dp_factor), held to bf16's 1e-2 since eager runs
// need not be bit-reproducible on the GPU (an H200 gave them exactly); in training the losses are
// (DESIGN.md's bf16 gate), while the histories follow weights that part from the one model's in
// their last bits and spread through FP8's rounding (an H200: 5% after 4 steps, losses 5e-5), so
// they are only printed. Without the reduction the replicas part.
#define PRIMUS_FP8_DP_PARITY_DEVICE 1
#include <fmt/format.h>
#include <gtest/gtest.h>

#include <cstdio>

#include "fp8_dp_parity.h"

namespace primus::backends::cuda::testing {
namespace {

class Fp8DpGpuTest : public CudaGpuTest {};

TEST_F(Fp8DpGpuTest, DelayedScalingReplicasKeepOneModelsHistories) {
  const turbo::Device gpu = turbo::Device::CUDA;
  for (const auto& [len, algo] : {std::pair{int64_t{3}, turbo::Fp8AmaxAlgo::Max},
                                  std::pair{int64_t{1}, turbo::Fp8AmaxAlgo::MostRecent}}) {
    const std::string what = fmt::format("history {} {}", len, turbo::fp8_amax_algo_name(algo));
    SCOPED_TRACE(what);
    const turbo::Fp8DelayedOptions delayed{len, algo};
    for (const bool learn : {false, true}) {
      SCOPED_TRACE(learn ? "training" : "frozen weights");
      const Fp8DpRun one = run_fp8_dp(1, delayed, false, learn, gpu);
      const Fp8DpRun two = run_fp8_dp(2, delayed, true, learn, gpu);
      EXPECT_EQ(two.state[0].history, two.state[1].history) << "the replicas' histories differ";
      EXPECT_EQ(two.state[0].scale, two.state[1].scale) << "the replicas' scales differ";
      const double d = fp8_dp_distance(two.state[0], one.state[0]);
      if (!learn) EXPECT_LT(d, 1e-2) << "the replicas' state against the one model's";
      double worst_loss = 0;
      for (int s = 0; s < kFp8DpSteps; ++s) {
        EXPECT_NEAR(two.loss[s], one.loss[s], 1e-2 * one.loss[s]) << "step " << s;
        worst_loss = std::max(worst_loss, std::abs(two.loss[s] - one.loss[s]) / one.loss[s]);
      }
      if (learn) EXPECT_LT(one.loss.back(), one.loss.front() - 0.5) << "the run must learn";
      std::printf("[fp8 dp %s, %s] replicas vs one model: histories and scales within %.3g, losses within %.3g\n",
                  what.c_str(), learn ? "training" : "frozen", d, worst_loss);
    }
    const Fp8DpRun apart = run_fp8_dp(2, delayed, false, false, gpu);
    EXPECT_NE(apart.state[0].history, apart.state[1].history) << "without the reduction the halves' amaxes differ";
  }
}

}  // namespace
}  // namespace primus::backends::cuda::testing
