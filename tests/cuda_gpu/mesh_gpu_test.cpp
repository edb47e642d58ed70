// Tensor, context and sharded data parallelism side by side in the CUDA model on the GPU: the
// ranks as threads sharing one GPU, the collectives through device memory
// (parallel/cuda/threaded_device_ops.h), against one rank accumulating the dp micro-batches, for
// 20 steps. bf16 gate of DESIGN.md, as the tp, cp and FSDP tests' (bf16_gate.h): every step's
// mean loss within 1e-2 relative, the gradient norm within 1e-2 for the first 10 steps and then
// within 5% or 4x the distance of one rank with the other attention kernel, the final weights
// within 1e-2; every rank the same norm.
#define PRIMUS_MESH_PARITY_DEVICE 1
#include <gtest/gtest.h>

#include <cstdio>
#include <ostream>

#include "bf16_gate.h"
#include "mesh_parity.h"

namespace primus::backends::cuda::testing {
namespace {


class MeshGpuTest : public CudaGpuTest, public ::testing::WithParamInterface<MeshCase> {};

TEST_P(MeshGpuTest, RanksOnOneGpuTrainAsOne) {
  const MeshCase& mc = GetParam();
  const train::ModelSpec spec = tp_spec(mc.model);
  constexpr int kSteps = 20;
  const MeshRun one = run_mesh(spec, mc.shape, turbo::Device::CUDA, kSteps, /*one=*/true);
  const MeshRun mesh = run_mesh(spec, mc.shape, turbo::Device::CUDA, kSteps);
  const MeshRun other = run_mesh(spec, mc.shape, turbo::Device::CUDA, kSteps, /*one=*/true, Attn::Fallback);
  for (int s = 0; s < kSteps; ++s)
    for (size_t r = 1; r < mesh.rank_gnorm.size(); ++r)
      EXPECT_EQ(mesh.rank_gnorm[r][size_t(s)], mesh.rank_gnorm[0][size_t(s)]) << "rank " << r << " step " << s;
  const std::string name = mc.shape.name();
  const Bf16Steps g = expect_bf16_steps(name.c_str(), one.loss, one.gnorm(), mesh.loss, mesh.gnorm(), other.loss,
                                        other.gnorm(), /*late_floor=*/5e-2);
  const double dw = rel_l2(mesh.params.data(), one.params.data(), static_cast<int64_t>(one.params.size()));
  EXPECT_LT(dw, 1e-2);
  EXPECT_LT(one.loss.back(), one.loss.front() - 0.2) << "the run must learn";
  std::printf("[gpu %s %s] %d steps: loss %.4f -> %.4f (mesh %.4f), worst relative loss %.1e, grad norm %.1e, "
              "weights %.1e\n",
              tp_spec_name(mc.model), name.c_str(), kSteps, one.loss.front(), one.loss.back(), mesh.loss.back(),
              g.worst_loss, g.worst_norm, dw);
}

INSTANTIATE_TEST_SUITE_P(Layouts, MeshGpuTest, ::testing::ValuesIn(mesh_layouts()),
                         [](const auto& info) { return mesh_case_name(info.param); });

}  // namespace
}  // namespace primus::backends::cuda::testing
