// Tensor, context and sharded data parallelism side by side in the CUDA model, checked without a
// GPU: tp x cp x dp ranks as threads running the model in host mode (fp32 on Turbo's CPU kernels,
// the same decoder, attention, FSDP and collective code as on the device) against one rank that
// accumulates the dp micro-batches, for GPT-2, a GQA Llama and Qwen3's per-head q|k norms. fp32
// gate of DESIGN.md: every step's mean loss over the ranks and gradient norm within 1e-5 relative,
// every rank the same norm, the final weights (put together from the tp slices) within 1e-4.
#include <gtest/gtest.h>

#include <cmath>
#include <cstdio>
#include <ostream>
#include <tuple>

#include "mesh_parity.h"

namespace primus::backends::cuda::testing {
namespace {


class MeshHostTest : public ::testing::TestWithParam<MeshCase> {};

TEST_P(MeshHostTest, RanksTrainAsOne) {
  const MeshCase& mc = GetParam();
  const train::ModelSpec spec = tp_spec(mc.model);
  constexpr int kSteps = 5;
  const MeshRun one = run_mesh(spec, mc.shape, turbo::Device::CPU, kSteps, /*one=*/true);
  const MeshRun mesh = run_mesh(spec, mc.shape, turbo::Device::CPU, kSteps);
  double worst_loss = 0, worst_norm = 0;
  for (int s = 0; s < kSteps; ++s) {
    for (size_t r = 1; r < mesh.rank_gnorm.size(); ++r)
      EXPECT_EQ(mesh.rank_gnorm[r][size_t(s)], mesh.rank_gnorm[0][size_t(s)]) << "rank " << r << " step " << s;
    const double dl = std::fabs(mesh.loss[size_t(s)] - one.loss[size_t(s)]) / one.loss[size_t(s)];
    const double dn = std::fabs(mesh.gnorm()[size_t(s)] - one.gnorm()[size_t(s)]) / one.gnorm()[size_t(s)];
    worst_loss = std::max(worst_loss, dl);
    worst_norm = std::max(worst_norm, dn);
    EXPECT_LT(dl, 1e-5) << "step " << s << ": " << mesh.loss[size_t(s)] << " vs " << one.loss[size_t(s)];
    EXPECT_LT(dn, 1e-5) << "step " << s << ": " << mesh.gnorm()[size_t(s)] << " vs " << one.gnorm()[size_t(s)];
  }
  const double dw = rel_l2(mesh.params.data(), one.params.data(), static_cast<int64_t>(one.params.size()));
  EXPECT_LT(dw, 1e-4);
  EXPECT_LT(one.loss.back(), one.loss.front()) << "the run must learn";
  std::printf("[host %s %s] %d steps: loss %.4f -> %.4f, worst relative loss %.1e, grad norm %.1e, weights %.1e\n",
              tp_spec_name(mc.model), mc.shape.name().c_str(), kSteps, one.loss.front(), one.loss.back(), worst_loss,
              worst_norm, dw);
}

INSTANTIATE_TEST_SUITE_P(Layouts, MeshHostTest, ::testing::ValuesIn(mesh_layouts()),
                         [](const auto& info) { return mesh_case_name(info.param); });

}  // namespace
}  // namespace primus::backends::cuda::testing
