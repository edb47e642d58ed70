#include "step_fixture.h"

#include <algorithm>
#include <cmath>
#include <cstring>
#include <cstdlib>
#include <stdexcept>
#include <string>

#include "backends/cuda/step_graph.h"

namespace primus::backends::cuda::testing {

StepRun run_steps(const StepRunOptions& o) {
  const train::ModelSpec spec = o.spec ? *o.spec : tiny_spec(o.llama);
  const int64_t T = spec.seq_length, B = kTrainBatch / o.micro;
  CudaOps ops = ops_for(o.attn);
  if (o.recompute) ops.recompute_policy = o.recompute;
  CudaModelOptions mo = options(spec, B, o.device);
  mo.loss_slots = o.micro;
  if (o.fp8) {
    use_fp8_linear(ops, *o.fp8);
    mo.fp8_linear = true;
    mo.fp8_delayed = o.fp8->delayed;  // one model at a time: each run registers its layers afresh
    mo.fp8_saved = o.fp8->saved;
    mo.fp8_weights = o.fp8->weights;
    mo.fp8_maxima = o.fp8->maxima;        // the SwiGLU kernels' maxima (rowwise, tensorwise)
    mo.fp8_producers = o.fp8->producers;  // the SwiGLU folded into the quantizers (delayed)
    mo.fp8_multiple = turbo::linear_fp8_multiple(*o.fp8);
    if (spec.moe.enabled()) {  // the experts too (patch cuda.moe.fp8)
      use_fp8_moe(ops, *o.fp8);
      mo.fp8_moe = true;
    }
  }
  if (o.model_options) o.model_options(mo);
  CudaModel model(spec, mo, ops);
  const std::vector<float> init = initial_params(spec);
  model.set_params(init.data());
  std::unique_ptr<StepProfiler> prof;
  if (o.profile) {
    prof = std::make_unique<StepProfiler>(model.stream(), o.steps);
    model.set_profiler(prof.get());
  }
  StepGraph graph(model.stream(), o.graph, prof.get());
  Batches data(T, o.steps);
  StepRun r;
  r.activation_bytes = model.activation_bytes();
  const float dloss = 1.0f / float(B * T * o.micro);
  for (int s = 0; s < o.steps; ++s) {
    for (int m = 0; m < o.micro; ++m) {
      model.stage_batch(data.inputs[s].data() + m * B * T, data.targets[s].data() + m * B * T, B, T, m);
    }
    turbo::AdamWHyper hp;
    // Peak 1e-3: at 2e-3 the tiny GPT-2 (with train/param_init's weights) hits an attention-logit
    // loss spike at step 19 of 20 (3.33 -> 9.42), which the fp64 reference backend reproduces to
    // 5 digits: an optimisation instability of the setting, not a kernel's error.
    hp.lr = 1e-3f * float(s + 1) / float(o.steps);
    hp.beta1 = 0.9f, hp.beta2 = 0.99f, hp.eps = 1e-8f, hp.weight_decay = 0.1f;
    hp.step = s + 1;
    model.set_hyper(hp);
    if (o.before_step) o.before_step(s, model);
    graph.run([&] {
      model.zero_grad();
      for (int m = 0; m < o.micro; ++m) {
        model.forward_staged(B, T, dloss, m);
        model.backward();
      }
      if (model.optimizer_in_backward()) return;
      model.grad_norm(o.clip);
      model.check_step(o.micro);
      model.update();
    });
    const CudaModel::StepStatus st = model.read_step_status(o.micro);
    if (prof) prof->collect();
    r.losses.push_back(st.loss_sum / o.micro);
    r.norms.push_back(st.grad_norm);
    r.finite.push_back(st.finite);
    if (s == 0 && !model.optimizer_in_backward()) {
      r.grads0.resize(static_cast<size_t>(model.layout().total));
      model.get_grads(r.grads0.data());
    }
    if (o.after_step) o.after_step(s, model);
  }
  r.params.resize(static_cast<size_t>(model.layout().total));
  model.get_params(r.params.data());
  r.m.resize(r.params.size());
  r.v.resize(r.params.size());
  model.get_moments(r.m.data(), r.v.data());
  r.grad_elems = model.grads().numel();
  r.graph_launches = graph.launches();
  if (prof) {
    r.profiled_steps = prof->steps_done();
    r.profile_total_ms = prof->total_ms();
    for (int p = 0; p < int(Phase::Count); ++p)
      if (prof->ms(Phase(p)) > 0) r.phase_ms.push_back({Phase(p), prof->ms(Phase(p))});
  }
  return r;
}

void expect_bias_grad_mode_matches_separate(const char* mode, StepRunOptions o, double tol) {
  auto parse = [](const std::string& m) {
    if (m == "ones") return BiasGrad::Ones;
    if (m == "norm") return BiasGrad::Norm;
    if (m == "gemm") return BiasGrad::Gemm;
    if (m == "separate") return BiasGrad::Separate;
    throw std::invalid_argument("bias gradient mode " + m);
  };
  std::vector<float> grads[2];
  bool ones[2] = {false, false};
  train::ParamLayout layout;
  int i = 0;
  for (const char* m : {mode, "separate"}) {
    const BiasGrad b = parse(m);
    o.model_options = [b](CudaModelOptions& mo) { mo.bias_grad = b; };
    o.steps = 1;
    o.after_step = [&](int, CudaModel& model) {
      ones[i] = model.bias_grad_from_ones();
      layout = model.layout();
    };
    grads[i] = run_steps(o).grads0;
    ++i;
  }
  EXPECT_EQ(ones[0], std::string(mode) == "ones") << mode;
  EXPECT_FALSE(ones[1]);
  ASSERT_EQ(grads[0].size(), grads[1].size());
  for (const auto& t : layout.tensors) {
    double worst = 0, scale = 0;
    for (int64_t k = t.offset; k < t.offset + t.numel; ++k) {
      worst = std::max(worst, std::fabs(double(grads[0][size_t(k)]) - grads[1][size_t(k)]));
      scale = std::max(scale, std::fabs(double(grads[1][size_t(k)])));
    }
    if (t.name.find("bias") != std::string::npos) {
      EXPECT_GT(scale, 0.0) << t.name << " has no gradient";
    }
    EXPECT_LE(worst, tol * scale + 1e-12) << t.name << " (" << mode << " vs separate)";
  }
}

namespace {
// Several micro-batches: the unfused gradients within tol of the fused (and rounded on the device).
template <class GradsOf>
double expect_unfused_wgrad_accumulates(const StepRunOptions& o, double tol, GradsOf& grads_of,
                                        const train::ParamLayout& layout) {
  const int micro = std::max(o.micro, 2);
  const std::vector<float> fused = grads_of(false, micro), unfused = grads_of(true, micro);
  double largest = 0;
  for (const auto& t : layout.tensors)
    largest = std::max(largest, rel_l2(unfused.data() + t.offset, fused.data() + t.offset, t.numel));
  EXPECT_LE(largest, tol) << micro << " micro-batches";
  if (o.device == turbo::Device::CUDA) {
    EXPECT_NE(fused, unfused) << "the micro-batches' products were not rounded";
  }
  return largest;
}
}  // namespace

double expect_unfused_wgrad_matches_fused(StepRunOptions o, double tol) {
  const bool device = o.device == turbo::Device::CUDA;
  const auto base_options = o.model_options;
  train::ParamLayout layout;
  auto grads_of = [&](bool unfused, int micro) {
    StepRunOptions r = o;
    r.steps = 1;
    r.micro = micro;
    r.model_options = [&base_options, unfused](CudaModelOptions& mo) {
      if (base_options) base_options(mo);
      mo.unfused_wgrad = unfused;
    };
    r.after_step = [&layout](int, CudaModel& model) { layout = model.layout(); };
    return run_steps(r).grads0;
  };
  auto linear_weight = [](const train::ParamTensor& t) {
    return t.shape.size() >= 2 && t.name.find("router") == std::string::npos &&
           t.name.find("embedding") == std::string::npos;
  };
  const std::vector<float> fused1 = grads_of(false, 1), unfused1 = grads_of(true, 1);
  EXPECT_EQ(fused1.size(), unfused1.size());
  if (fused1.size() != unfused1.size()) return 1.0;
  // Bit for bit only where the step reproduces itself (a kernel adding with atomics does not).
  if (grads_of(false, 1) != fused1) {
    std::printf("two fused runs differ: the unfused gradients are compared within 1e-2\n");
    return expect_unfused_wgrad_accumulates(o, tol, grads_of, layout);
  }
  int64_t rounded_away = 0;
  for (const auto& t : layout.tensors) {
    const bool tied_embedding = t.name == "embedding.weight" && !layout.find("output_layer.weight");
    int64_t wrong = 0;
    double worst = 0, scale = 0;
    for (int64_t k = t.offset; k < t.offset + t.numel; ++k) {
      const float f = fused1[size_t(k)], u = unfused1[size_t(k)];
      const float want = linear_weight(t) && device ? round_bf16(f) : f;
      if (tied_embedding) {
        worst = std::max(worst, std::fabs(double(u) - f));
        scale = std::max(scale, std::fabs(double(f)));
        continue;
      }
      if (std::memcmp(&u, &want, sizeof(float)) != 0) ++wrong;
      if (want != f) ++rounded_away;
    }
    if (tied_embedding) {
      EXPECT_LE(worst, 1e-2 * scale) << t.name;
    } else {
      EXPECT_EQ(wrong, 0) << t.name << ": elements not the fused gradient" << (linear_weight(t) ? " rounded" : "");
    }
  }
  if (device) {
    EXPECT_GT(rounded_away, 0) << "no linear weight gradient changed on rounding to bf16";
  }
  return expect_unfused_wgrad_accumulates(o, tol, grads_of, layout);
}

}  // namespace primus::backends::cuda::testing
