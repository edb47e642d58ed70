// The step machinery on the GPU (label gpu; skips without a device), tiny GPT-2 and Llama,
// B = 8 as 2 micro-batches of 4, T = 64, a rising learning rate (so a replayed step must read
// AdamW's scalars from the device):
//   - CUDA graph: 20 steps captured at step 2 and replayed give the same losses and final
//     weights as 20 eager steps, bit for bit (the same kernels on the same buffers in the same
//     order; a difference means the capture froze something that changes per step). Bit for bit
//     is asserted when two eager runs agree bit for bit (a non-deterministic kernel, e.g. an
//     attention backward accumulating dq with atomics, would make any two runs differ); else
//     each step's loss within 1% and the final weights within 1e-2 relative L2;
//   - an evaluation forward of another batch size between replays changes no step's reported loss;
//   - the non-finite check under the graph: a replayed step with a NaN weight reports
//     finite = false and changes no weight and no moment; the next step trains again;
//   - recompute parity on the device: gradients of selective / full against none (bit for bit
//     when the none run reproduces itself bit for bit, else within the bf16 gate; GPT-2's
//     selective recomputes GELU from the stored bf16 pre-activation instead of the GEMM
//     epilogue's fp32 value, so it is checked against the gate), and the activation memory
//     order none > selective > full;
//   - the profiler under a graph times the phases from the graph's event nodes and changes no
//     result.
#include <gtest/gtest.h>

#include <cstring>
#include <functional>
#include <random>
#include <tuple>
#include <utility>

#include "step_fixture.h"
#include "train/param_layout.h"

namespace primus::backends::cuda::testing {
namespace {

bool same_bits(const std::vector<float>& a, const std::vector<float>& b) {
  return a.size() == b.size() && std::memcmp(a.data(), b.data(), a.size() * sizeof(float)) == 0;
}

// Whether two identical eager runs agree bit for bit (the device kernels are deterministic).
bool reproducible(const StepRunOptions& o, const StepRun& first) {
  StepRunOptions e = o;
  e.graph = false;
  e.profile = false;
  const StepRun again = run_steps(e);
  const bool same = again.losses == first.losses && same_bits(again.params, first.params);
  std::printf("[%s] two eager runs %s bit for bit\n", o.llama ? "llama" : "gpt2", same ? "agree" : "do NOT agree");
  return same;
}

// got against ref: bit for bit where `exact`, else within 1% per loss and 1e-2 on the weights.
void expect_same_run(const StepRun& got, const StepRun& ref, bool exact) {
  ASSERT_EQ(got.losses.size(), ref.losses.size());
  for (size_t s = 0; s < ref.losses.size(); ++s) {
    if (exact) {
      EXPECT_EQ(got.losses[s], ref.losses[s]) << "step " << s;
      EXPECT_EQ(got.norms[s], ref.norms[s]) << "step " << s;
    } else {
      EXPECT_NEAR(got.losses[s], ref.losses[s], 1e-2 * std::fabs(ref.losses[s])) << "step " << s;
    }
  }
  if (exact) {
    EXPECT_TRUE(same_bits(got.params, ref.params)) << "final weights differ";
  } else {
    EXPECT_LT(rel_l2(got.params.data(), ref.params.data(), static_cast<int64_t>(ref.params.size())), 1e-2);
  }
}

// `o` run eagerly (and once more, to learn whether eager runs reproduce), then captured at step 2
// and replayed: the same run, bit for bit where `exact`.
struct EagerAndGraph {
  StepRun eager, graph;
  bool exact = false;
};
EagerAndGraph eager_then_graph(StepRunOptions o) {
  EagerAndGraph r;
  o.graph = false;
  r.eager = run_steps(o);
  r.exact = reproducible(o, r.eager);
  o.graph = true;
  r.graph = run_steps(o);
  EXPECT_EQ(r.graph.graph_launches, o.steps - 1) << "step 1 is the warm-up; steps 2.. launch the graph";
  expect_same_run(r.graph, r.eager, r.exact);
  return r;
}

class StepGpuTest : public CudaGpuTest, public ::testing::WithParamInterface<bool> {};

TEST_P(StepGpuTest, GraphReplayMatchesEagerBitForBitOver20Steps) {
  StepRunOptions o;
  o.llama = GetParam();
  o.device = turbo::Device::CUDA;
  o.steps = 20;
  const auto [eager, graph, exact] = eager_then_graph(o);
  ASSERT_EQ(graph.losses.size(), 20u);
  EXPECT_LT(eager.losses.back(), eager.losses.front() - 0.5) << "the run must learn";
  std::printf("[%s] graph vs eager, 20 steps: loss %.5f -> %.5f (eager), %.5f -> %.5f (graph)\n",
              o.llama ? "llama" : "gpt2", eager.losses.front(), eager.losses.back(), graph.losses.front(),
              graph.losses.back());
}

// The optimizer in the backward under the graph, on the device: the same losses, weights and
// moments bit for bit as AdamW after the backward (no clipping, one micro-batch), dense GPT-2 (its
// MLP output bias, whose gradient the next layer writes) and the DeepSeek-style tiny MoE.
// 6 steps of `spec` on the device under the graph, one micro-batch, no clipping (what the optimizer
// in the backward needs), with the model options `set`.
StepRun six_graph_steps(const train::ModelSpec& spec, std::function<void(CudaModelOptions&)> set) {
  StepRunOptions o;
  o.spec = &spec;
  o.device = turbo::Device::CUDA;
  o.graph = true;
  o.clip = 0.0f;
  o.micro = 1;
  o.steps = 6;
  o.model_options = std::move(set);
  return run_steps(o);
}

TEST_P(StepGpuTest, OptimizerInBackwardMatchesTheUpdateAfterTheBackward) {
  const train::ModelSpec spec = GetParam() ? tiny_moe_spec(true) : tiny_spec(false);
  auto run = [&](bool in_backward) {
    return six_graph_steps(spec, [in_backward](CudaModelOptions& mo) { mo.optimizer_in_backward = in_backward; });
  };
  const StepRun after = run(false), inside = run(true);
  EXPECT_EQ(inside.losses, after.losses);
  for (size_t s = 0; s < after.norms.size(); ++s)  // the norm from AdamW's pass against grad_norm's
    EXPECT_NEAR(inside.norms[s], after.norms[s], 1e-5 * after.norms[s]) << "grad norm of step " << s;
  EXPECT_TRUE(inside.params == after.params) << "weights differ";
  EXPECT_TRUE(inside.m == after.m && inside.v == after.v) << "moments differ";
  EXPECT_LT(inside.grad_elems, after.grad_elems);
  EXPECT_LT(after.losses.back(), after.losses.front()) << "the run must learn";
  std::printf("[%s] optimizer in the backward: loss %.5f -> %.5f, gradient buffer %lld of %lld elements\n",
              GetParam() ? "moe" : "gpt2", inside.losses.front(), inside.losses.back(),
              static_cast<long long>(inside.grad_elems), static_cast<long long>(after.grad_elems));
}

// bf16 expert gradients (moe_expert_grad_dtype: bf16) with the optimizer in the backward, under the
// graph, on the DeepSeek-style tiny MoE: the first loss is the f32 run's (nothing has moved yet),
// the weights move differently (the experts' gradients were rounded to bf16; the f32 run is
// bit-reproducible, as the test above shows) but stay within bf16 rounding of the f32 run's.
TEST_F(CudaGpuTest, Bf16ExpertGradientsTrainAsTheF32Ones) {
  const train::ModelSpec spec = tiny_moe_spec(true);
  auto run = [&](bool bf16) {
    return six_graph_steps(spec, [bf16](CudaModelOptions& mo) {
      mo.optimizer_in_backward = true;
      mo.bf16_expert_grads = bf16;
    });
  };
  const StepRun f32 = run(false), bf16 = run(true);
  ASSERT_EQ(bf16.losses.size(), f32.losses.size());
  EXPECT_EQ(bf16.losses[0], f32.losses[0]);
  for (size_t s = 0; s < f32.losses.size(); ++s) {
    EXPECT_NEAR(bf16.losses[s], f32.losses[s], 2e-3 * std::fabs(f32.losses[s])) << "step " << s;
    EXPECT_NEAR(bf16.norms[s], f32.norms[s], 1e-2 * f32.norms[s]) << "grad norm of step " << s;
  }
  EXPECT_FALSE(bf16.params == f32.params) << "the experts' gradients were not rounded to bf16";
  EXPECT_LT(rel_l2(bf16.params.data(), f32.params.data(), static_cast<int64_t>(f32.params.size())), 1e-3);
  EXPECT_LT(bf16.losses.back(), bf16.losses.front()) << "the run must learn";
  std::printf("[moe] bf16 expert gradients: loss %.5f -> %.5f (f32: %.5f -> %.5f)\n", bf16.losses.front(),
              bf16.losses.back(), f32.losses.front(), f32.losses.back());
}

// moe_router_load_balancing_type global_aux_loss on the device (docs/moe.md "Global-batch balance
// loss"): two micro-batches a step, the second balancing the mean of both micro-batches' loads
// (its row of counts adds the first's on the device, its coefficient baked per micro-batch into
// the capture). Captured and replayed, the eager run (bit for bit where eager runs reproduce);
// against the host model (which the host trainer tests hold to the reference backend), the final
// weights within 1e-2 relative L2, and with the aux coefficient at 5 (the routers' weights follow
// the balancing loss) the routers' weights at least three times nearer the host's than those the
// micro-batch loss trains on the host. The same for a list of the three types (docs/moe.md
// "Several balancing losses"), whose control is its micro-batch loss alone.
TEST_F(CudaGpuTest, GlobalAuxLossTrainsUnderTheGraphAsOnTheHost) {
  using Balance = train::MoeSpec::Balance;
  train::ModelSpec global = tiny_moe_spec(false), global_control = global;
  global.moe.set_balance(Balance::Global, 5.0);
  global_control.moe.set_balance(Balance::Batch, 5.0);
  train::ModelSpec list = global, list_control = global;
  list.moe.batch_aux_loss = list.moe.seq_aux_loss = true;
  list.moe.aux_loss_coeff = 1.0;
  list.moe.seq_aux_loss_coeff = 2.0;
  list_control.moe.set_balance(Balance::Batch, 1.0);
  const auto cases = {std::tuple{"global_aux_loss", &global, &global_control},
                      std::tuple{"aux_loss, seq_aux_loss, global_aux_loss", &list, &list_control}};
  for (const auto& [name, spec, control] : cases) {
    SCOPED_TRACE(name);
    StepRunOptions o;
    o.spec = spec;
    o.device = turbo::Device::CUDA;
    o.steps = 6;
    o.micro = 2;
    const EagerAndGraph gpu = eager_then_graph(o);
    StepRunOptions h = o;
    h.device = turbo::Device::CPU;
    const StepRun host = run_steps(h);
    h.spec = control;
    const StepRun micro = run_steps(h);
    const auto n = static_cast<int64_t>(host.params.size());
    EXPECT_LT(rel_l2(gpu.graph.params.data(), host.params.data(), n), 1e-2);
    auto routers = [&](const std::vector<float>& p) {
      std::vector<float> out;
      const train::ParamLayout layout = train::make_param_layout(*spec);
      for (const auto& t : layout.tensors)
        if (t.name.find("moe.router.weight") != std::string::npos)
          out.insert(out.end(), p.begin() + t.offset, p.begin() + t.offset + t.numel);
      return out;
    };
    const std::vector<float> want = routers(host.params), got = routers(gpu.graph.params);
    const std::vector<float> other = routers(micro.params);
    ASSERT_FALSE(want.empty());
    const auto r = static_cast<int64_t>(want.size());
    const double off = rel_l2(got.data(), want.data(), r), ctl = rel_l2(other.data(), want.data(), r);
    EXPECT_GT(ctl, 3 * off) << "the control's routers are as near the host's as the device's";
    std::printf("[moe] %s: routers, device vs host %.3g (the micro-batch loss alone on the host: %.3g)\n", name, off,
                ctl);
  }
}

// SwiGLU in the expert GEMMs' epilogues (CudaModelOptions::moe_swiglu_epilogue, the default where
// the expert width divides by 128) against the activation kernels, under the graph, with the update
// after the backward (f32 expert gradients) and in it (bf16 ones): the same bits at every step,
// and the dact buffer gone from the plan.
TEST_F(CudaGpuTest, MoeSwiGLUEpilogueTrainsAsTheActivationKernels) {
  for (const bool deepseek : {false, true}) {
    for (const bool in_backward : {false, true}) {
      SCOPED_TRACE(std::string(deepseek ? "deepseek" : "mixtral") + (in_backward ? ", optimizer in the backward" : ""));
      const train::ModelSpec spec = tiny_moe_spec_128(deepseek);
      CudaModelOptions probe;
      ASSERT_TRUE(moe_swiglu_epilogue_applies(probe, spec)) << "the test would compare the unfused path with itself";
      auto run = [&](bool fused) {
        return six_graph_steps(spec, [fused, in_backward](CudaModelOptions& mo) {
          mo.moe_swiglu_epilogue = fused;
          mo.optimizer_in_backward = in_backward;
          mo.bf16_expert_grads = in_backward;
        });
      };
      const StepRun plain = run(false), fused = run(true);
      EXPECT_EQ(fused.losses, plain.losses);
      EXPECT_EQ(fused.norms, plain.norms);
      EXPECT_TRUE(same_bits(fused.params, plain.params)) << "weights differ";
      EXPECT_LT(plain.losses.back(), plain.losses.front()) << "the run must learn";
    }
  }
}

// Split master weights (master_weights: split) under the graph, after the backward (dense Llama,
// with clipping) and in it (the DeepSeek-style tiny MoE with bf16 expert gradients): the same fp32
// arithmetic as f32 masters, so the runs differ only where a bf16 copy met an exact tie (rounded
// away from zero instead of to even: about one element in 2^17), within bf16 noise of each other.
// set_params / get_params give back the exact fp32 bits, the largest finite values included.
TEST_F(CudaGpuTest, SplitMasterWeightsTrainAsTheF32Ones) {
  for (const bool moe : {false, true}) {
    SCOPED_TRACE(moe ? "moe, optimizer in the backward" : "llama, after the backward");
    const train::ModelSpec spec = moe ? tiny_moe_spec(true) : tiny_spec(true);
    auto run = [&](bool split) {
      StepRunOptions o;
      o.spec = &spec;
      o.device = turbo::Device::CUDA;
      o.graph = true;
      o.clip = moe ? 0.0f : 1.0f;
      o.micro = 1;
      o.steps = 6;
      o.model_options = [split, moe](CudaModelOptions& mo) {
        mo.split_master = split;
        mo.optimizer_in_backward = moe;
        mo.bf16_expert_grads = moe;
      };
      if (split) {
        o.before_step = [](int s, CudaModel& model) {
          if (s != 0) return;
          const size_t n = static_cast<size_t>(model.layout().total);
          std::vector<float> init(n), odd(n), back(n);
          model.get_params(init.data());
          std::mt19937 rng(7);
          std::normal_distribution<float> d;
          for (auto& x : odd) x = d(rng);
          odd[0] = 3.4028235e38f, odd[1] = -3.4028235e38f, odd[2] = -0.0f, odd[3] = 1e-45f;
          model.set_params(odd.data());
          model.get_params(back.data());
          EXPECT_TRUE(same_bits(back, odd)) << "set_params / get_params changed the fp32 bits";
          model.set_params(init.data());
        };
      }
      return run_steps(o);
    };
    const StepRun f32 = run(false), split = run(true);
    ASSERT_EQ(split.losses.size(), f32.losses.size());
    for (size_t s = 0; s < f32.losses.size(); ++s) {
      EXPECT_NEAR(split.losses[s], f32.losses[s], 1e-3 * std::fabs(f32.losses[s])) << "step " << s;
      EXPECT_NEAR(split.norms[s], f32.norms[s], 1e-2 * f32.norms[s]) << "grad norm of step " << s;
    }
    const int64_t n = static_cast<int64_t>(f32.params.size());
    EXPECT_LT(rel_l2(split.params.data(), f32.params.data(), n), 1e-3);
    EXPECT_LT(rel_l2(split.m.data(), f32.m.data(), n), 1e-2);
    EXPECT_LT(split.losses.back(), split.losses.front()) << "the run must learn";
    std::printf("[%s] split master weights: loss %.5f -> %.5f (f32 masters: %.5f -> %.5f), weights %s\n",
                moe ? "moe" : "llama", split.losses.front(), split.losses.back(), f32.losses.front(),
                f32.losses.back(), split.params == f32.params ? "bit-identical" : "within bf16 noise");
  }
}

// FP8 linear layers under the graph: quantizer (amax partials, scales on the device) and FP8
// GEMMs captured once and replayed, same result as eager.
// Also with fp8_recipe delayed: the warm-up step runs current scaling, the captured step folds the
// amaxes into the scales at its start (the update is a node of the graph) and quantizes with them.
// As the trainer runs FP8: inputs saved in FP8, weights quantized once per step (the capture holds
// the first micro-batch's fill).
TEST_P(StepGpuTest, Fp8GraphReplayMatchesEager) {
  for (const char* scaling : {"tensorwise", "delayed"}) {
    const turbo::Fp8Recipe recipe = fp8_test_recipe(
        "hybrid", scaling, {.saved = true, .weights = true, .delayed = {4, turbo::Fp8AmaxAlgo::Max}});
    StepRunOptions o;
    o.llama = GetParam();
    o.device = turbo::Device::CUDA;
    o.steps = 8;
    o.fp8 = &recipe;
    const auto [eager, graph, exact] = eager_then_graph(o);
    for (bool f : graph.finite) EXPECT_TRUE(f);
    std::printf("[%s fp8 %s] graph vs eager, 8 steps: loss %.5f -> %.5f (eager), %.5f -> %.5f (graph)%s\n",
                o.llama ? "llama" : "gpt2", scaling, eager.losses.front(), eager.losses.back(), graph.losses.front(),
                graph.losses.back(), exact ? "" : " (eager runs not bit-reproducible: compared within tolerance)");
  }
}

// no_fp8_weight_transpose_cache on the device (Fp8WeightCache::keep_transpose = false): the step's
// weight copies without their transposes, each input gradient quantizing the weight's transpose
// again, train as the copies with both layouts under the graph (the same bits where eager runs
// reproduce), tensorwise, rowwise and delayed; and the model reserves less.
TEST_P(StepGpuTest, Fp8WeightCopiesWithoutTransposesTrainAsWithThem) {
  for (const char* scaling : {"tensorwise", "rowwise", "delayed"}) {
    SCOPED_TRACE(scaling);
    const turbo::Fp8Recipe both = fp8_test_recipe("hybrid", scaling, {.weights = true}),
                           lean = fp8_test_recipe("hybrid", scaling, {.weights = true});
    lean.weights->keep_transpose = false;
    StepRunOptions o;
    o.llama = GetParam();
    o.device = turbo::Device::CUDA;
    o.attn = Attn::Fallback;
    o.steps = 6;
    o.graph = true;
    size_t reserved[2] = {0, 0};
    int i = 0;
    o.after_step = [&](int, CudaModel& m) { reserved[i] = m.reserved_bytes(); };
    o.fp8 = &both;
    const StepRun with = run_steps(o);
    i = 1;
    o.fp8 = &lean;
    const StepRun without = run_steps(o);
    o.fp8 = &both;
    o.after_step = {};
    const bool exact = reproducible(o, with);
    expect_same_run(without, with, exact);
    EXPECT_GT(lean.weights->fills, 0);
    EXPECT_LT(reserved[1], reserved[0]);
    std::printf("[%s fp8 %s] without the transposed weight copies: loss %.5f -> %.5f, %.1f MiB less reserved\n",
                o.llama ? "llama" : "gpt2", scaling, without.losses.front(), without.losses.back(),
                (double(reserved[0]) - double(reserved[1])) / (1 << 20));
  }
}

// Delayed FP8 with the SwiGLU folded into its quantizers (turbo::Fp8Producers: the act and dgate_up
// the FP8 linears read are computed as they are quantized, never written) under the graph, as the
// trainer runs it: the same losses, weights and moments as the activation kernels followed by the
// quantizer, bit for bit when the step is bit-reproducible at all (a second unfolded run says).
// With and without the inputs saved in FP8, under selective recomputation.
TEST_P(StepGpuTest, Fp8DelayedSwigluFoldGivesTheSameSteps) {
  if (!GetParam()) GTEST_SKIP() << "GPT-2's GELU has no fold";
  for (const bool saved : {true, false}) {
    SCOPED_TRACE(saved ? "inputs saved in FP8, selective recompute" : "plain");
    std::shared_ptr<turbo::Fp8Producers> producers;
    const auto run = [&](bool fold) {
      const turbo::Fp8Recipe recipe =
          fp8_test_recipe("hybrid", "delayed", {.saved = saved, .weights = true, .producers = fold});
      if (fold) producers = recipe.producers;
      StepRunOptions o;
      o.llama = true;
      o.device = turbo::Device::CUDA;
      o.graph = true;
      o.steps = 8;
      o.fp8 = &recipe;
      if (saved) o.recompute = [](int64_t, int64_t) { return Recompute::Selective; };
      return run_steps(o);
    };
    const StepRun plain = run(false), folded = run(true), again = run(false);
    ASSERT_NE(producers, nullptr);
    EXPECT_GT(producers->folded, 0) << "nothing was folded in";
    for (bool f : folded.finite) EXPECT_TRUE(f);
    const bool exact = again.losses == plain.losses && again.params == plain.params;
    if (exact) {
      EXPECT_EQ(folded.losses, plain.losses);
      EXPECT_TRUE(folded.params == plain.params) << "weights differ";
      EXPECT_TRUE(folded.m == plain.m && folded.v == plain.v) << "moments differ";
    } else {
      for (size_t s = 0; s < plain.losses.size(); ++s)
        EXPECT_NEAR(folded.losses[s], plain.losses[s], 2e-3 * plain.losses[s]) << "step " << s;
    }
    EXPECT_LT(folded.losses.back(), folded.losses.front()) << "the run must learn";
    std::printf("[llama fp8 delayed%s] SwiGLU folded: loss %.6f -> %.6f (unfolded %.6f -> %.6f), %lld puts, "
                "%lld folded, %lld written%s\n",
                saved ? ", saved, selective" : "", folded.losses.front(), folded.losses.back(), plain.losses.front(),
                plain.losses.back(), static_cast<long long>(producers->puts), static_cast<long long>(producers->folded),
                static_cast<long long>(producers->written), exact ? "" : " (not bit-reproducible: compared within 0.2%)");
  }
}

// An evaluation forward of another batch size between graph replays (after step 6): the replays
// after it report the same losses as eager steps (the status divides by the training forward's
// tokens, which a replay cannot set: before that fix they read 2x), and the evaluation's own loss
// is the same under the graph and eagerly.
TEST_P(StepGpuTest, EvaluationBetweenReplaysKeepsTheStepLosses) {
  StepRunOptions o;
  o.llama = GetParam();
  o.device = turbo::Device::CUDA;
  o.steps = 10;
  std::vector<double> eval;
  o.after_step = [&](int s, CudaModel& model) {
    if (s != 5) return;
    const train::ModelSpec spec = tiny_spec(o.llama);
    Batches data(spec.seq_length, 1);
    model.forward(data.inputs[0].data(), data.targets[0].data(), 2, spec.seq_length, 0.0f, 0);
    eval.push_back(model.read_loss_sum(1));
  };
  const auto [eager, graph, exact] = eager_then_graph(o);
  ASSERT_EQ(eval.size(), 3u);  // eager, its reproduction, graph
  if (exact) EXPECT_EQ(eval[2], eval[0]);
  else EXPECT_NEAR(eval[2], eval[0], 1e-2 * eval[0]);
  EXPECT_LT(eager.losses.back(), eager.losses.front() - 0.3) << "the run must learn";
}

TEST_P(StepGpuTest, NonFiniteStepIsSkippedUnderTheGraph) {
  StepRunOptions o;
  o.llama = GetParam();
  o.device = turbo::Device::CUDA;
  o.graph = true;
  o.steps = 6;
  std::vector<float> good, poisoned, m0, v0, after, m1, v1;
  o.before_step = [&](int s, CudaModel& model) {
    const size_t n = static_cast<size_t>(model.layout().total);
    if (s == 3) {  // a replay (the capture was step 1)
      good.resize(n);
      model.get_params(good.data());
      poisoned = good;
      poisoned[n / 3] = std::numeric_limits<float>::quiet_NaN();
      model.set_params(poisoned.data());
      m0.resize(n), v0.resize(n);
      model.get_moments(m0.data(), v0.data());
    }
    if (s == 4) model.set_params(good.data());
  };
  o.after_step = [&](int s, CudaModel& model) {
    if (s != 3) return;
    const size_t n = static_cast<size_t>(model.layout().total);
    after.resize(n), m1.resize(n), v1.resize(n);
    model.get_params(after.data());
    model.get_moments(m1.data(), v1.data());
  };
  const StepRun r = run_steps(o);
  EXPECT_EQ(r.graph_launches, 5);
  EXPECT_EQ(r.finite, (std::vector<bool>{true, true, true, false, true, true}));
  EXPECT_FALSE(std::isfinite(r.losses[3]) && std::isfinite(r.norms[3]));
  EXPECT_TRUE(same_bits(after, poisoned)) << "the vetoed step changed the weights";
  EXPECT_TRUE(same_bits(m1, m0)) << "the vetoed step changed the first moments";
  EXPECT_TRUE(same_bits(v1, v0)) << "the vetoed step changed the second moments";
  EXPECT_TRUE(std::isfinite(r.losses[5]));
}

// On the device: the ones-column bias gradients (default) against the separate reductions, within
// what bf16 activations allow (the forward's GEMMs read the padded norm rows and may pick other
// cuBLASLt algorithms, so later bf16 roundings differ); a wrong or missing bias column is O(1).
TEST_P(StepGpuTest, OnesColumnBiasGradientsMatchTheSeparateReductions) {
  StepRunOptions o;
  o.device = turbo::Device::CUDA;
  o.llama = GetParam();
  expect_bias_grad_mode_matches_separate(o.llama ? "norm" : "ones", o, 2e-2);
  if (o.llama) return;
  o.recompute = recompute_all(Recompute::Selective);
  expect_bias_grad_mode_matches_separate("ones", o, 2e-2);
}

// gradient_accumulation_fusion: false on the device: one micro-batch's linear weight gradients are
// the fused ones rounded to bf16 bit for bit (everything else unchanged), two micro-batches' sums
// of rounded products stay within 1e-2 of the fused accumulation; an MoE's experts as well, and
// under FP8 linears (whose weight-gradient GEMMs write the scratch). Then a captured run trains.
TEST_P(StepGpuTest, UnfusedWeightGradientAccumulationRoundsEachProduct) {
  StepRunOptions o;
  o.device = turbo::Device::CUDA;
  o.llama = GetParam();
  o.attn = Attn::Fallback;  // deterministic, so the fused run reproduces itself bit for bit
  const double dense = expect_unfused_wgrad_matches_fused(o, 1e-2);
  const train::ModelSpec moe = tiny_moe_spec_128(o.llama);
  StepRunOptions e = o;
  e.spec = &moe;
  const double experts = expect_unfused_wgrad_matches_fused(e, 1e-2);
  const turbo::Fp8Recipe rowwise = fp8_test_recipe("hybrid", "rowwise");
  StepRunOptions f = o;
  f.fp8 = &rowwise;
  const double fp8 = expect_unfused_wgrad_matches_fused(f, 1e-2);
  std::printf("[%s] unfused weight gradients, 2 micro-batches: largest rel. L2 %.2e dense, %.2e moe, %.2e fp8\n",
              o.llama ? "llama" : "gpt2", dense, experts, fp8);
  StepRunOptions g = o;
  g.graph = true;
  g.steps = 6;
  g.model_options = [](CudaModelOptions& mo) { mo.unfused_wgrad = true; };
  const StepRun run = run_steps(g);
  EXPECT_EQ(run.graph_launches, g.steps - 1);
  EXPECT_LT(run.losses.back(), run.losses.front()) << "the run must learn";
}

TEST_P(StepGpuTest, RecomputeGradientsMatchNone) {
  StepRunOptions o;
  o.llama = GetParam();
  o.device = turbo::Device::CUDA;
  o.steps = 2;
  const StepRun none = run_steps(o);
  const StepRun again = run_steps(o);
  const bool deterministic = same_bits(none.grads0, again.grads0);
  std::printf("[%s] the none run %s itself bit for bit\n", o.llama ? "llama" : "gpt2",
              deterministic ? "reproduces" : "does NOT reproduce");
  std::vector<size_t> bytes = {none.activation_bytes};
  for (Recompute rc : {Recompute::Selective, Recompute::Full}) {
    SCOPED_TRACE(recompute_name(rc));
    o.recompute = recompute_all(rc);
    const StepRun r = run_steps(o);
    bytes.push_back(r.activation_bytes);
    const bool exact_expected = deterministic && !(rc == Recompute::Selective && !o.llama);
    const double err = rel_l2(r.grads0.data(), none.grads0.data(), static_cast<int64_t>(none.grads0.size()));
    std::printf("[%s %s] gradient relative L2 vs none %.3e, losses %.6f / %.6f\n", o.llama ? "llama" : "gpt2",
                recompute_name(rc), err, r.losses[1], none.losses[1]);
    if (exact_expected) {
      EXPECT_TRUE(same_bits(r.grads0, none.grads0)) << "relative L2 " << err;
      EXPECT_EQ(r.losses, none.losses);
    } else {
      EXPECT_LT(err, 1e-2);
      EXPECT_NEAR(r.losses[1], none.losses[1], 1e-2 * none.losses[1]);
    }
  }
  EXPECT_GT(bytes[0], bytes[1]);
  EXPECT_GT(bytes[1], bytes[2]);
}

TEST_P(StepGpuTest, ProfilerUnderTheGraphTimesPhasesAndChangesNothing) {
  StepRunOptions o;
  o.llama = GetParam();
  o.device = turbo::Device::CUDA;
  o.graph = true;
  o.steps = 5;
  const StepRun plain = run_steps(o);
  const bool exact = reproducible(o, run_steps([&] {
    StepRunOptions e = o;
    e.graph = false;
    return e;
  }()));
  o.profile = true;
  const StepRun prof = run_steps(o);
  expect_same_run(prof, plain, exact);
  EXPECT_EQ(prof.profiled_steps, 4);
  bool attention = false, qkv = false;
  for (auto [p, ms] : prof.phase_ms) {
    attention = attention || p == Phase::Attention;
    qkv = qkv || p == Phase::QkvGemm;
  }
  EXPECT_TRUE(attention && qkv);
  EXPECT_GT(prof.profile_total_ms, 0.0);
  std::printf("[%s] profiled GPU time per step under the graph: %.3f ms\n", o.llama ? "llama" : "gpt2",
              prof.profile_total_ms / 4);
}

INSTANTIATE_TEST_SUITE_P(Cuda, StepGpuTest, ::testing::Values(false, true),
                         [](const auto& info) { return std::string(info.param ? "Llama" : "Gpt2"); });

}  // namespace
}  // namespace primus::backends::cuda::testing
