// fp8_recipe delayed under data parallelism in host mode (fp8_dp_parity.h): two replicas on halves
// of every batch, their amaxes max-reduced every step, against one model on both halves.
#include <gtest/gtest.h>

#include <fmt/format.h>

#include <string>

#include "fp8_dp_parity.h"

namespace primus::backends::cuda::testing {
namespace {

// A replica's state against the one model's, bit for bit (fp8_dp_factor: dy's amaxes twice).
void expect_one_models_state(const CudaModel::Fp8DelayedState& two, const CudaModel::Fp8DelayedState& one) {
  ASSERT_EQ(two.tensors, one.tensors);
  ASSERT_EQ(two.history.size(), one.history.size());
  EXPECT_TRUE(two.use_history);
  EXPECT_EQ(two.pending, one.pending);
  const int64_t len = one.history_len;
  for (int64_t t = 0; t < one.tensors; ++t) {
    const float f = fp8_dp_factor(t);
    for (int64_t e = 0; e < len; ++e) {
      const float want = f * one.history[static_cast<size_t>(t * len + e)];
      EXPECT_GT(want, 0.0f) << "tensor " << t << " entry " << e << ": every step recorded an amax";
      EXPECT_EQ(two.history[static_cast<size_t>(t * len + e)], want) << "tensor " << t << " entry " << e;
    }
    EXPECT_EQ(two.scale[static_cast<size_t>(t)], one.scale[static_cast<size_t>(t)] / f) << "scale of tensor " << t;
  }
}

// With the amaxes max-reduced, both replicas keep the same histories and scales bit for bit, and
// they are the one model's: exactly so while the weights are the same (rate 0); in training the
// replicas follow the one model's losses (fp32, 1e-5 relative: its GEMMs accumulate the second
// micro-batch into the first's gradients where the replicas average two, and AdamW's first steps
// move a weight by the rate whatever its gradient's size, so the weights part in their last bits,
// which FP8's rounding then spreads). Without the reduction each replica keeps its own half's
// amaxes. The staged path (history 3, max) and the in-place one (history 1, most_recent).
TEST(HostFp8DataParallel, DelayedScalingReplicasKeepOneModelsHistories) {
  const turbo::Device cpu = turbo::Device::CPU;
  for (const auto& [len, algo] : {std::pair{int64_t{3}, turbo::Fp8AmaxAlgo::Max},
                                  std::pair{int64_t{1}, turbo::Fp8AmaxAlgo::MostRecent}}) {
    SCOPED_TRACE(fmt::format("history {} {}", len, turbo::fp8_amax_algo_name(algo)));
    const turbo::Fp8DelayedOptions delayed{len, algo};
    {
      SCOPED_TRACE("frozen weights");
      const Fp8DpRun one = run_fp8_dp(1, delayed, false, false, cpu);
      const Fp8DpRun two = run_fp8_dp(2, delayed, true, false, cpu);
      for (int r = 0; r < 2; ++r) expect_one_models_state(two.state[static_cast<size_t>(r)], one.state[0]);
      for (int s = 0; s < kFp8DpSteps; ++s) EXPECT_EQ(two.loss[s], one.loss[s]) << "step " << s;
      const Fp8DpRun apart = run_fp8_dp(2, delayed, false, false, cpu);
      EXPECT_NE(apart.state[0].history, apart.state[1].history) << "the halves' amaxes must differ";
    }
    SCOPED_TRACE("training");
    const Fp8DpRun one = run_fp8_dp(1, delayed, false, true, cpu);
    const Fp8DpRun two = run_fp8_dp(2, delayed, true, true, cpu);
    EXPECT_LT(one.loss.back(), one.loss.front() - 0.5) << "the run must learn";
    for (int s = 0; s < kFp8DpSteps; ++s) EXPECT_NEAR(two.loss[s], one.loss[s], 1e-5 * one.loss[s]) << "step " << s;
    EXPECT_EQ(two.state[0].history, two.state[1].history) << "the replicas' histories differ";
    EXPECT_EQ(two.state[0].scale, two.state[1].scale) << "the replicas' scales differ";
  }
}

}  // namespace
}  // namespace primus::backends::cuda::testing
