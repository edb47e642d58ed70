// The optimizer in the backward (CudaModelOptions::optimizer_in_backward) in host mode: the same
// weights, moments and losses bit for bit as AdamW after the whole backward (without clipping),
// with a gradient buffer of the largest layer's size; the per-group step check's decisions; and the
// options it refuses.
#include <gtest/gtest.h>

#include <cmath>
#include <limits>
#include <vector>

#include "backends/cuda/model.h"
#include "backends/cuda/model/grad_placement.h"
#include "core/util/error.h"
#include "tests/cuda_gpu/cuda_fixture.h"
#include "tests/cuda_gpu/step_fixture.h"
#include "turbo/kernels/cuda/step_check.h"

namespace primus::backends::cuda {
namespace {

using testing::Batches;
using testing::initial_params;
using testing::kTrainBatch;


// Three steps of AdamW without clipping, one micro-batch each, after the backward or inside it.
testing::StepRun train3(const train::ModelSpec& spec, bool in_backward) {
  testing::StepRunOptions o;
  o.spec = &spec;
  o.clip = 0.0f;
  o.micro = 1;
  o.model_options = [in_backward](CudaModelOptions& mo) { mo.optimizer_in_backward = in_backward; };
  return testing::run_steps(o);
}

class InBackwardTest : public ::testing::TestWithParam<int> {};

train::ModelSpec spec_of(int which) {
  switch (which) {
    case 0: return testing::tiny_spec(false);     // GPT-2: tied head, biases
    case 1: return testing::tiny_spec(true);      // Llama: untied head, GQA
    case 2: return testing::tiny_moe_spec(false);  // Mixtral-style MoE
    default: return testing::tiny_moe_spec(true);  // DeepSeek-style: a dense first layer, shared expert, bias
  }
}

TEST_P(InBackwardTest, SameWeightsAndMomentsAsTheUpdateAfterTheBackward) {
  const train::ModelSpec spec = spec_of(GetParam());
  const testing::StepRun after = train3(spec, false);
  const testing::StepRun inside = train3(spec, true);
  for (size_t s = 0; s < after.finite.size(); ++s) EXPECT_TRUE(after.finite[s] && inside.finite[s]) << "step " << s;
  EXPECT_EQ(inside.losses, after.losses);
  for (size_t s = 0; s < after.norms.size(); ++s)
    EXPECT_NEAR(inside.norms[s], after.norms[s], 1e-5 * after.norms[s]) << "grad norm of step " << s;
  EXPECT_TRUE(inside.params == after.params) << "weights differ";
  EXPECT_TRUE(inside.m == after.m && inside.v == after.v) << "moments differ";
  EXPECT_NE(inside.params, initial_params(spec)) << "nothing was trained";

  // The gradient buffer: the embeddings, the final norm and head, and one layer's window (and the
  // few tensors whose gradient is written before their layer's backward).
  const train::ParamLayout layout = train::make_param_layout(spec);
  const GradPlacement g = place_grads(layout, 1, grad_written_before_layer_backward);
  EXPECT_EQ(inside.grad_elems, g.elems);
  EXPECT_EQ(after.grad_elems, layout.total);
  EXPECT_LT(g.elems, layout.total);
  int64_t largest = 0;
  for (int64_t l = 0; l < spec.num_layers; ++l) {
    int64_t n = 0;
    for (const auto& t : layout.tensors)
      if (layer_of(t.name) == l) n += t.numel;
    largest = std::max(largest, n);
  }
  EXPECT_EQ(g.window_elems, largest);
  int64_t outside = 0;  // not in a layer, or a layer's tensor with a place of its own (GPT-2's MLP output bias)
  for (const auto& t : layout.tensors)
    if (layer_of(t.name) < 0 || grad_written_before_layer_backward(t.name)) outside += t.numel;
  // An untied head's gradient and the embedding's share one place (the head's update runs first);
  // the bit-for-bit weights above show the embedding's gradient starts from zero after it.
  const train::ParamTensor* head = layout.find("output_layer.weight");
  if (head) {
    const size_t h = static_cast<size_t>(head - layout.tensors.data());
    const size_t e = static_cast<size_t>(&layout.get("embedding.weight") - layout.tensors.data());
    ASSERT_EQ(g.reuse.size(), 1u);
    EXPECT_EQ(g.reuse[0], std::make_pair(h, e));
    EXPECT_EQ(g.offset[h], g.offset[e]);
    outside -= head->numel;
  } else {
    EXPECT_TRUE(g.reuse.empty());
  }
  EXPECT_EQ(g.elems, outside + largest);
}

std::string model_name(const ::testing::TestParamInfo<int>& info) {
  static const char* const kNames[] = {"Gpt2", "Llama", "Mixtral", "DeepSeek"};
  return kNames[info.param];
}
INSTANTIATE_TEST_SUITE_P(Models, InBackwardTest, ::testing::Values(0, 1, 2, 3), model_name);

TEST(InBackward, NonFiniteLossUpdatesNothing) {
  const train::ModelSpec spec = testing::tiny_spec(true);
  CudaModelOptions mo = testing::options(spec, kTrainBatch, turbo::Device::CPU);
  mo.optimizer_in_backward = true;
  CudaModel model(spec, mo, testing::ops_for(testing::Attn::Default));
  std::vector<float> init = initial_params(spec);
  init[static_cast<size_t>(model.layout().get("final_norm.weight").offset)] = std::numeric_limits<float>::infinity();
  model.set_params(init.data());
  Batches data(spec.seq_length, 1);
  turbo::AdamWHyper hp;
  model.set_hyper(hp);
  model.zero_grad();
  model.forward(data.inputs[0].data(), data.targets[0].data(), kTrainBatch, spec.seq_length,
                1.0f / float(kTrainBatch * spec.seq_length), 0);
  model.backward();
  const CudaModel::StepStatus st = model.read_step_status(1);
  EXPECT_FALSE(st.finite);
  EXPECT_FALSE(st.partial);
  std::vector<float> after(init.size());
  model.get_params(after.data());
  for (size_t i = 0; i < init.size(); ++i) {
    if (std::isfinite(init[i])) {
      ASSERT_EQ(after[i], init[i]) << "parameter " << i << " moved";
    }
  }
}

// The per-group check (turbo/kernels/cuda/step_check.h) over a step of three groups, each group's
// norm as its update reported it (NaN: skipped).
TEST(InBackward, GroupCheckFlagsSkippedAndPartlyAppliedSteps) {
  const int64_t S = 1;
  auto run = [](float loss, std::vector<float> norms) {
    std::vector<float> st(S + 3, -7.0f);
    st[0] = loss;
    turbo::cuda::step_check_begin_apply(st.data(), 1, S);
    EXPECT_EQ(st[S + 2], std::isfinite(loss) ? 1.0f : 0.0f);
    for (size_t g = 0; g < norms.size(); ++g)
      turbo::cuda::step_check_group_apply(st.data(), S, norms[g], g + 1 == norms.size());
    return st;
  };
  const float nan = std::nanf(""), inf = std::numeric_limits<float>::infinity();
  std::vector<float> ok = run(2.5f, {3.0f, 4.0f, 12.0f});
  EXPECT_FLOAT_EQ(ok[S], 13.0f);  // sqrt(9 + 16 + 144)
  EXPECT_EQ(ok[S + 1], 1.0f);
  EXPECT_EQ(ok[S + 2], 1.0f);
  std::vector<float> bad_loss = run(nan, {nan, nan, nan});  // every group skipped
  EXPECT_TRUE(std::isnan(bad_loss[S + 1]));
  EXPECT_EQ(bad_loss[S + 2], 0.0f) << "nothing was applied";
  std::vector<float> bad_first = run(2.5f, {inf, nan, nan});
  EXPECT_TRUE(std::isnan(bad_first[S + 1])) << "the groups after it are skipped";
  EXPECT_EQ(bad_first[S + 2], -1.0f) << "the first group was applied with non-finite gradients";
  std::vector<float> bad_second = run(2.5f, {3.0f, nan, nan});
  EXPECT_TRUE(std::isnan(bad_second[S + 1]));
  EXPECT_EQ(bad_second[S + 2], -1.0f);
}

TEST(InBackward, RefusesAccumulationAndZeroOneAndTheCallsAfterTheBackward) {
  const train::ModelSpec spec = testing::tiny_spec(true);
  CudaModelOptions mo = testing::options(spec, 2, turbo::Device::CPU);
  mo.optimizer_in_backward = true;
  mo.loss_slots = 2;
  EXPECT_THROW(CudaModel(spec, mo, testing::ops_for(testing::Attn::Default)), ConfigError);
  mo.loss_slots = 1;
  CudaModel model(spec, mo, testing::ops_for(testing::Attn::Default));
  EXPECT_THROW(model.grad_norm(0.0f), RuntimeError);
  EXPECT_THROW(model.check_step(1), RuntimeError);
  EXPECT_THROW(model.update(), RuntimeError);
  std::vector<float> g(static_cast<size_t>(model.layout().total));
  EXPECT_THROW(model.get_grads(g.data()), RuntimeError);
  EXPECT_THROW(model.on_grads_ready([](int64_t) {}), RuntimeError);
}

// bf16 expert gradients: the experts' grouped weights are the tensors marked, and grad_view reads a
// marked tensor's elements as bf16 from the first half of its f32 place (any slice of it), the
// others as f32 slices; the model refuses them where they cannot apply (host mode, no optimizer
// in the backward, no experts).
TEST(InBackward, Bf16ExpertGradientViewsAndRefusals) {
  EXPECT_TRUE(is_expert_weight("layers.3.moe.experts.fc.weight"));
  EXPECT_TRUE(is_expert_weight("layers.0.moe.experts.proj.weight"));
  EXPECT_FALSE(is_expert_weight("layers.0.moe.shared.fc.weight"));
  EXPECT_FALSE(is_expert_weight("layers.0.moe.router.weight"));
  EXPECT_FALSE(is_expert_weight("moe.experts.fc.weight"));
  std::vector<float> buf(64, 0.0f);
  const turbo::TensorView grads(buf.data(), turbo::DType::F32, turbo::Device::CPU, {64});
  GradPlacement place;
  place.offset = {0, 16};
  place.bf16 = {false, true};
  const turbo::TensorView a = grad_view(grads, place, 0, 4, 8), b = grad_view(grads, place, 1, 6, 10);
  EXPECT_EQ(a.dtype, turbo::DType::F32);
  EXPECT_EQ(a.data, static_cast<void*>(buf.data() + 4));
  EXPECT_EQ(a.numel(), 8);
  EXPECT_EQ(b.dtype, turbo::DType::BF16);
  EXPECT_EQ(b.data, static_cast<void*>(reinterpret_cast<char*>(buf.data() + 16) + 6 * 2));
  EXPECT_EQ(b.numel(), 10);
  place.bf16.clear();  // no marks: every tensor f32
  EXPECT_EQ(grad_view(grads, place, 1, 0, 4).dtype, turbo::DType::F32);

  const train::ModelSpec moe = testing::tiny_moe_spec(true);
  CudaModelOptions mo = testing::options(moe, 1, turbo::Device::CPU);
  mo.bf16_expert_grads = true;
  for (bool in_backward : {false, true}) {
    mo.optimizer_in_backward = in_backward;
    try {
      CudaModel model(moe, mo, testing::ops_for(testing::Attn::Default));
      ADD_FAILURE() << "accepted in host mode, optimizer in the backward " << in_backward;
    } catch (const ConfigError& e) {
      EXPECT_NE(std::string(e.what()).find(in_backward ? "host mode" : "optimizer in the backward"), std::string::npos)
          << e.what();
    }
  }
  const train::ModelSpec dense = testing::tiny_spec(true);
  CudaModelOptions md = testing::options(dense, 1, turbo::Device::CPU);
  md.bf16_expert_grads = true;
  md.optimizer_in_backward = true;
  EXPECT_THROW(CudaModel(dense, md, testing::ops_for(testing::Attn::Default)), ConfigError);
}

}  // namespace
}  // namespace primus::backends::cuda
