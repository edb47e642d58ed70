// turbo::MultiMatrixMuon on the device against the CPU reference (turbo/kernels/cpu/muon.h):
// three steps over wide, tall, square and odd-sized matrices with a clip factor and the lr read
// from the device. Newton-Schulz runs in bf16 on the GPU (as Moonlight's), fp32 on the CPU, so
// the updates agree to bf16's tolerance; the momentum (fp32 elementwise) agrees to fp32's. A
// non-finite clip factor leaves everything untouched, repeated runs give the same bits, and a
// captured CUDA graph of the step replays to the eager step's bits.
#include <gtest/gtest.h>

#include <cuda_runtime_api.h>

#include "gpu_fixture.h"
#include "turbo/kernels/cpu/muon.h"
#include "turbo/ops/muon.h"

namespace primus::turbo::testing {
namespace {

class MuonGpuTest : public GpuTest {
 protected:
  struct Host {
    std::vector<float> p, g, m;
  };
  // Matrices of these shapes with random weights, gradients and momentum.
  void build(const std::vector<std::pair<int64_t, int64_t>>& shapes) {
    for (size_t i = 0; i < shapes.size(); ++i) {
      const auto [r, c] = shapes[i];
      MuonMatrix mm;
      mm.rows = r;
      mm.cols = c;
      mm.master = make(DType::F32, {r * c});
      mm.model = make(DType::BF16, {r * c});
      mm.grad = make(DType::F32, {r * c});
      mm.m = make(DType::F32, {r * c});
      mm.decay = i % 2 == 0;
      Host h{random_tensor(mm.master, 0.05f), random_tensor(mm.grad, 0.01f), random_tensor(mm.m, 0.01f)};
      poison(mm.model);
      mats.push_back(mm);
      host.push_back(std::move(h));
    }
  }
  std::vector<MuonMatrix> mats;
  std::vector<Host> host;
};

TEST_F(MuonGpuTest, ThreeStepsMatchTheCpuReference) {
  build({{64, 96}, {96, 64}, {256, 1024}, {1024, 256}, {48, 48}, {200, 77}});
  MultiMatrixMuon opt(mats);
  MuonHyper hp;
  hp.lr = 123.0f;  // ignored: the device lr below wins
  hp.lr_scale = 1.5f;
  hp.weight_decay = 0.1f;
  TensorView scale = make(DType::F32, {1}), lr = make(DType::F32, {1});
  put(scale, {0.7f});
  put(lr, {0.02f});
  cpu::MuonParams ref;
  ref.lr = 0.02 * 1.5;
  ref.grad_scale = 0.7;
  std::vector<std::vector<float>> p0;
  for (auto& h : host) p0.push_back(h.p);
  for (int step = 0; step < 3; ++step) {
    if (step > 0) {  // fresh gradients each step
      for (size_t i = 0; i < mats.size(); ++i) host[i].g = random_tensor(mats[i].grad, 0.01f);
    }
    opt.step(hp, scale, lr, ctx);
    for (size_t i = 0; i < mats.size(); ++i) {
      ref.weight_decay = mats[i].decay ? 0.1 : 0.0;
      cpu::muon_update(host[i].p.data(), host[i].g.data(), host[i].m.data(), mats[i].rows, mats[i].cols, ref);
    }
  }
  for (size_t i = 0; i < mats.size(); ++i) {
    const auto p = get(mats[i].master), m = get(mats[i].m), model = get(mats[i].model);
    std::vector<float> dgot(p.size()), dref(p.size());
    for (size_t k = 0; k < p.size(); ++k) {
      dgot[k] = p[k] - p0[i][k];
      dref[k] = host[i].p[k] - p0[i][k];
    }
    const std::string what = fmt::format("matrix {} [{}, {}]", i, mats[i].rows, mats[i].cols);
    EXPECT_LT(rel_err(dgot, dref), 3e-2) << what << ": the update";
    EXPECT_LT(rel_err(m, host[i].m), 1e-5) << what << ": the momentum";
    for (size_t k = 0; k < p.size(); ++k) {
      ASSERT_EQ(model[k], round_to(DType::BF16, p[k])) << what << ": the bf16 copy at " << k;
    }
  }
}

TEST_F(MuonGpuTest, NonFiniteClipFactorSkipsAndStepsAreDeterministic) {
  build({{128, 64}, {32, 300}});
  MultiMatrixMuon opt(mats);
  MuonHyper hp;
  hp.lr = 0.02f;
  hp.weight_decay = 0.1f;
  TensorView scale = make(DType::F32, {1});
  auto snapshot = [&] {
    std::vector<std::vector<uint8_t>> s;
    for (auto& mm : mats) {
      s.push_back(bytes(mm.master));
      s.push_back(bytes(mm.m));
      s.push_back(bytes(mm.model));
    }
    return s;
  };
  const auto before = snapshot();
  put(scale, {NAN});
  opt.step(hp, scale, TensorView(), ctx);
  EXPECT_EQ(snapshot(), before) << "a vetoed step must write nothing";
  put(scale, {1.0f});
  opt.step(hp, scale, TensorView(), ctx);
  const auto once = snapshot();
  EXPECT_NE(once, before);
  // The same step from the same state: the same bits.
  for (size_t i = 0; i < mats.size(); ++i) {
    put(mats[i].master, host[i].p);
    put(mats[i].m, host[i].m);
  }
  opt.step(hp, scale, TensorView(), ctx);
  EXPECT_EQ(snapshot(), once);
}

TEST_F(MuonGpuTest, CapturedGraphReplaysTheEagerStep) {
  build({{96, 160}, {160, 96}});
  MultiMatrixMuon opt(mats);
  MuonHyper hp;
  TensorView scale = make(DType::F32, {1}), lr = make(DType::F32, {1});
  put(scale, {0.9f});
  put(lr, {0.01f});
  cudaStream_t stream;
  CUDA_CHECK(cudaStreamCreateWithFlags(&stream, cudaStreamNonBlocking));
  ExecContext sctx = ctx;
  sctx.stream = stream;
  opt.step(hp, scale, lr, sctx);  // eager, from the initial state
  CUDA_CHECK(cudaStreamSynchronize(stream));
  std::vector<std::vector<uint8_t>> eager;
  for (auto& mm : mats) eager.push_back(bytes(mm.master));
  for (size_t i = 0; i < mats.size(); ++i) {  // back to the initial state
    put(mats[i].master, host[i].p);
    put(mats[i].m, host[i].m);
  }
  cudaGraph_t graph;
  cudaGraphExec_t exec;
  CUDA_CHECK(cudaStreamBeginCapture(stream, cudaStreamCaptureModeGlobal));
  opt.step(hp, scale, lr, sctx);
  CUDA_CHECK(cudaStreamEndCapture(stream, &graph));
  CUDA_CHECK(cudaGraphInstantiate(&exec, graph, 0));
  CUDA_CHECK(cudaGraphLaunch(exec, stream));
  CUDA_CHECK(cudaStreamSynchronize(stream));
  for (size_t i = 0; i < mats.size(); ++i) EXPECT_EQ(bytes(mats[i].master), eager[i]) << "matrix " << i;
  CUDA_CHECK(cudaGraphExecDestroy(exec));
  CUDA_CHECK(cudaGraphDestroy(graph));
  CUDA_CHECK(cudaStreamDestroy(stream));
}

}  // namespace
}  // namespace primus::turbo::testing
