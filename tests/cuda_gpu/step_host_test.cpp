// The step machinery without a GPU (label unit), in the model's host mode (fp32 on Turbo's CPU
// backends, the ops run synchronously):
//   - recompute_granularity: selective, full and a per-layer mix train with exactly the
//     gradients, losses and weights of no recomputation (bit for bit: the recomputation reruns
//     the same kernels on the same inputs), and reserve fewer activation bytes, none > selective
//     > full;
//   - the on-device non-finite check: a step with a NaN weight reports finite = false and leaves
//     every weight and moment as it was (AdamW vetoed through the clip factor); the next good
//     step trains again;
//   - the phase profiler changes no result and times every phase the step runs;
//   - configs that cannot be captured are errors naming why; the three patches switch the keys on.
#include <gtest/gtest.h>

#include <algorithm>
#include <cmath>
#include <cstring>
#include <unistd.h>

#include <filesystem>
#include <fstream>
#include <map>
#include <nlohmann/json.hpp>

#include "backends/cuda/args.h"
#include "backends/cuda/register.h"
#include "backends/cuda/step_graph.h"
#include "backends/cuda/trainer.h"
#include "core/backend/backend.h"
#include "core/config/experiment.h"
#include "core/patches/context.h"
#include "core/patches/registry.h"
#include "core/util/error.h"
#include "step_fixture.h"

namespace primus::backends::cuda::testing {
namespace {

bool same_bits(const std::vector<float>& a, const std::vector<float>& b) {
  return a.size() == b.size() && std::memcmp(a.data(), b.data(), a.size() * sizeof(float)) == 0;
}

class HostRecompute : public ::testing::TestWithParam<bool> {};

TEST_P(HostRecompute, GradientsLossesAndWeightsEqualNoRecompute) {
  const bool llama = GetParam();
  StepRunOptions o;
  o.llama = llama;
  o.steps = 3;
  const StepRun none = run_steps(o);
  ASSERT_EQ(none.losses.size(), 3u);
  for (bool f : none.finite) EXPECT_TRUE(f);
  struct Variant {
    const char* name;
    std::function<RecomputePolicyFn> policy;
  };
  const Variant variants[] = {
      {"selective", recompute_all(Recompute::Selective)},
      {"full", recompute_all(Recompute::Full)},
      {"norms", recompute_all(Recompute::Norms)},
      {"layer 0 full, layer 1 selective",
       [](int64_t l, int64_t) { return l == 0 ? Recompute::Full : Recompute::Selective; }},
      {"layer 0 none, layer 1 full", [](int64_t l, int64_t) { return l == 0 ? Recompute::None : Recompute::Full; }},
  };
  std::vector<size_t> bytes = {none.activation_bytes};
  for (const Variant& v : variants) {
    SCOPED_TRACE(v.name);
    o.recompute = v.policy;
    const StepRun r = run_steps(o);
    EXPECT_TRUE(same_bits(r.grads0, none.grads0)) << "step-0 gradients differ from no recomputation";
    EXPECT_EQ(r.losses, none.losses);
    EXPECT_TRUE(same_bits(r.params, none.params)) << "weights after 3 steps differ";
    // (With two layers, one full layer saves what the shared set costs: not less, not more.)
    EXPECT_LE(r.activation_bytes, none.activation_bytes);
    bytes.push_back(r.activation_bytes);
  }
  // none > norms > selective > full (the mixes lie between).
  EXPECT_GT(bytes[0], bytes[3]);
  EXPECT_GT(bytes[3], bytes[1]);
  EXPECT_GT(bytes[1], bytes[2]);
  std::printf("[host %s] activation bytes: none %zu, selective %zu, full %zu\n", llama ? "llama" : "gpt2", bytes[0],
              bytes[1], bytes[2]);
}

INSTANTIATE_TEST_SUITE_P(Host, HostRecompute, ::testing::Values(false, true),
                         [](const auto& info) { return std::string(info.param ? "Llama" : "Gpt2"); });

// Step 1 runs with one weight poisoned to NaN; step 2 with the good weights back.
void poisoned_run(const StepRunOptions& base, StepRun* out) {
  StepRunOptions o = base;
  std::vector<float> good, poisoned, m0, v0, after, m1, v1;
  o.before_step = [&](int s, CudaModel& model) {
    if (s == 1) {
      const size_t n = static_cast<size_t>(model.layout().total);
      good.resize(n);
      model.get_params(good.data());
      poisoned = good;
      poisoned[n / 2] = std::numeric_limits<float>::quiet_NaN();
      model.set_params(poisoned.data());
      m0.resize(n), v0.resize(n);
      model.get_moments(m0.data(), v0.data());
    }
    if (s == 2) model.set_params(good.data());
  };
  o.after_step = [&](int s, CudaModel& model) {
    if (s != 1) return;
    const size_t n = static_cast<size_t>(model.layout().total);
    after.resize(n), m1.resize(n), v1.resize(n);
    model.get_params(after.data());
    model.get_moments(m1.data(), v1.data());
  };
  *out = run_steps(o);
  EXPECT_TRUE(same_bits(after, poisoned)) << "a vetoed step changed the weights";
  EXPECT_TRUE(same_bits(m1, m0)) << "a vetoed step changed the first moments";
  EXPECT_TRUE(same_bits(v1, v0)) << "a vetoed step changed the second moments";
}

// zero_grad() clears only what no beta-0 GEMM writes first in the step: after a step, the linear
// layers' and the head's weight gradients still hold that step's values (the next step's first
// GEMMs overwrite them), every other gradient is zero. Training through this is covered by the
// multi-step, two-micro-batch comparisons above and the host parity against the reference.
TEST(HostZeroGrad, ClearsAllButTheGemmWrittenWeightGradients) {
  for (bool llama : {false, true}) {
    SCOPED_TRACE(llama ? "llama" : "gpt2");
    StepRunOptions o;
    o.llama = llama;
    o.steps = 1;
    std::vector<float> after, before;
    o.after_step = [&](int, CudaModel& m) {
      before.resize(static_cast<size_t>(m.layout().total));
      m.get_grads(before.data());
      m.zero_grad();
      after.resize(before.size());
      m.get_grads(after.data());
      for (const auto& t : m.layout().tensors) {
        const bool gemm = t.name.find(".weight") != std::string::npos &&
                          (t.name.find("attn.qkv") != std::string::npos || t.name.find("attn.proj") != std::string::npos ||
                           t.name.find("mlp.fc") != std::string::npos || t.name.find("mlp.proj") != std::string::npos ||
                           t.name == "output_layer.weight" || (t.name == "embedding.weight" && !llama));
        double kept = 0, was = 0;
        for (int64_t i = t.offset; i < t.offset + t.numel; ++i) {
          kept += std::fabs(after[static_cast<size_t>(i)]);
          was += std::fabs(before[static_cast<size_t>(i)]);
        }
        EXPECT_GT(was, 0.0) << t.name << " had no gradient";
        if (gemm) EXPECT_EQ(kept, was) << t.name << ": a GEMM-written gradient was cleared";
        else EXPECT_EQ(kept, 0.0) << t.name << ": not cleared";
      }
    };
    run_steps(o);
    EXPECT_FALSE(after.empty());
  }
}

// The bias gradients of q|k|v and the MLP up-projection from their weight GEMMs over the norm
// outputs' column of ones (the default) equal the separate column sums; also under norm
// recomputation (the padded buffer shared by the layers) and with the other modes.
TEST(HostBiasGrad, OnesColumnMatchesTheSeparateReductions) {
  StepRunOptions o;
  expect_bias_grad_mode_matches_separate("ones", o, 1e-5);
  expect_bias_grad_mode_matches_separate("norm", o, 1e-5);
  expect_bias_grad_mode_matches_separate("gemm", o, 1e-5);
  o.recompute = recompute_all(Recompute::Norms);
  expect_bias_grad_mode_matches_separate("ones", o, 1e-5);
  o.llama = true;  // no linear biases: the ones column does not apply
  o.recompute = {};
  expect_bias_grad_mode_matches_separate("norm", o, 1e-5);
}

// The step's other variants train as the defaults do: GPT-2's GELU as a separate op instead of
// the up-projection's epilogue (forward) or of the dgrad's (backward, in place on its output),
// and a zero_grad that clears every gradient (every GEMM accumulating).
TEST(HostStepVariants, UnfusedGeluAndFullZeroGradTrainAsTheDefaults) {
  StepRunOptions o;
  o.steps = 4;
  const StepRun base = run_steps(o);
  const std::pair<const char*, std::function<void(CudaModelOptions&)>> variants[] = {
      {"gelu_unfused_forward", [](CudaModelOptions& mo) { mo.gelu_unfused_forward = true; }},
      {"gelu_unfused_backward", [](CudaModelOptions& mo) { mo.gelu_unfused_backward = true; }},
      {"zero_grad_full", [](CudaModelOptions& mo) { mo.zero_grad_full = true; }},
  };
  for (const auto& [name, set] : variants) {
    o.model_options = set;
    const StepRun v = run_steps(o);
    ASSERT_EQ(v.losses.size(), base.losses.size()) << name;
    for (size_t s = 0; s < base.losses.size(); ++s)
      EXPECT_NEAR(v.losses[s], base.losses[s], 1e-5 * base.losses[s]) << name << ", step " << s;
    ASSERT_EQ(v.grads0.size(), base.grads0.size()) << name;
    double worst = 0, scale = 0;
    for (size_t k = 0; k < base.grads0.size(); ++k) {
      worst = std::max(worst, double(std::fabs(v.grads0[k] - base.grads0[k])));
      scale = std::max(scale, double(std::fabs(base.grads0[k])));
    }
    EXPECT_GT(scale, 0.0) << name;
    EXPECT_LE(worst, 1e-5 * scale) << name << ": step 0's gradients differ";
  }
}

// The MoE experts' SwiGLU in the grouped GEMM calls (CudaModelOptions::moe_swiglu_epilogue; on the
// host the op composes the product and the activation itself) against the separate activation
// calls, with and without the experts' recomputation: the same bits.
TEST(HostStepVariants, MoeSwiGLUEpilogueTrainsAsTheSeparateActivation) {
  for (const bool deepseek : {false, true}) {
    for (const Recompute r : {Recompute::None, Recompute::Selective, Recompute::Full}) {
      SCOPED_TRACE(std::string(deepseek ? "deepseek" : "mixtral") + ", recompute " + std::to_string(static_cast<int>(r)));
      const train::ModelSpec spec = tiny_moe_spec_128(deepseek);
      CudaModelOptions host;
      host.device = turbo::Device::CPU;
      ASSERT_TRUE(moe_swiglu_epilogue_applies(host, spec)) << "the test would compare the separate path with itself";
      StepRunOptions o;
      o.spec = &spec;
      o.steps = 3;
      if (r != Recompute::None) o.recompute = recompute_all(r);
      auto run = [&](bool fused) {
        o.model_options = [fused](CudaModelOptions& mo) { mo.moe_swiglu_epilogue = fused; };
        return run_steps(o);
      };
      const StepRun plain = run(false), fused = run(true);
      EXPECT_EQ(fused.losses, plain.losses);
      EXPECT_TRUE(same_bits(fused.params, plain.params)) << "weights differ";
      EXPECT_TRUE(same_bits(fused.grads0, plain.grads0)) << "step 0's gradients differ";
      EXPECT_LT(plain.losses.back(), plain.losses.front()) << "the run must learn";
    }
  }
  // FP8 experts, the option off, and a dense model keep the separate activation.
  CudaModelOptions o;
  o.device = turbo::Device::CPU;
  o.fp8_moe = true;
  EXPECT_FALSE(moe_swiglu_epilogue_applies(o, tiny_moe_spec_128(false)));
  o.fp8_moe = false;
  o.moe_swiglu_epilogue = false;
  EXPECT_FALSE(moe_swiglu_epilogue_applies(o, tiny_moe_spec_128(false)));
  o.moe_swiglu_epilogue = true;
  EXPECT_FALSE(moe_swiglu_epilogue_applies(o, tiny_spec(true)));
}

// gradient_accumulation_fusion: false in host mode, where the weights are f32: each weight gradient
// is its own product added to the gradient, the same values as the GEMM's accumulation (GPT-2 with
// its biases and tied embedding, Llama with an untied output layer, an MoE's experts and router;
// two and four micro-batches). The scratch that holds the product is planned: a smaller arena
// would throw.
TEST(HostStepVariants, UnfusedWeightGradientAccumulationAddsTheSameGradients) {
  const train::ModelSpec moe = tiny_moe_spec_128(true);
  for (const int micro : {2, 4}) {
    for (const int model : {0, 1, 2}) {
      SCOPED_TRACE(std::string(model == 0 ? "gpt2" : model == 1 ? "llama" : "moe") + ", micro " + std::to_string(micro));
      StepRunOptions o;
      o.llama = model == 1;
      if (model == 2) o.spec = &moe;
      o.micro = micro;
      EXPECT_LE(expect_unfused_wgrad_matches_fused(o, 1e-6), 1e-6);
    }
  }
}

TEST(HostStepCheck, NonFiniteStepIsSkippedOnTheDevice) {
  for (bool llama : {false, true}) {
    SCOPED_TRACE(llama ? "llama" : "gpt2");
    StepRunOptions o;
    o.llama = llama;
    o.steps = 4;
    StepRun r;
    poisoned_run(o, &r);
    ASSERT_EQ(r.finite.size(), 4u);
    EXPECT_TRUE(r.finite[0]);
    EXPECT_FALSE(r.finite[1]);
    EXPECT_FALSE(std::isfinite(r.losses[1]));
    EXPECT_TRUE(r.finite[2]) << "the flag must be rewritten by every step";
    EXPECT_TRUE(r.finite[3]);
    EXPECT_LT(r.losses[3], r.losses[0]) << "training goes on after the skipped step";
  }
}

TEST(HostProfile, PhasesAreTimedAndResultsUnchanged) {
  for (bool llama : {false, true}) {
    SCOPED_TRACE(llama ? "llama" : "gpt2");
    StepRunOptions o;
    o.llama = llama;
    o.steps = 3;
    o.recompute = recompute_all(Recompute::Full);
    const StepRun plain = run_steps(o);
    o.profile = true;
    const StepRun prof = run_steps(o);
    EXPECT_EQ(prof.losses, plain.losses);
    EXPECT_TRUE(same_bits(prof.params, plain.params));
    EXPECT_EQ(prof.profiled_steps, 2) << "every step after the warm-up";
    std::vector<Phase> seen;
    double sum = 0;
    for (auto [p, ms] : prof.phase_ms) {
      seen.push_back(p);
      sum += ms;
    }
    for (Phase p : {Phase::Embedding, Phase::Norm, Phase::QkvGemm, Phase::Attention, Phase::ProjGemm,
                    Phase::MlpUpGemm, Phase::MlpDownGemm, Phase::HeadGemm, Phase::Loss, Phase::HeadGemmBwd,
                    Phase::NormBwd, Phase::MlpDownGemmBwd, Phase::MlpUpGemmBwd, Phase::ProjGemmBwd,
                    Phase::AttentionBwd, Phase::QkvGemmBwd, Phase::EmbeddingBwd, Phase::Recompute, Phase::GradNorm,
                    Phase::Optimizer}) {
      EXPECT_NE(std::find(seen.begin(), seen.end(), p), seen.end()) << phase_name(p) << " was not timed";
    }
    if (llama) {
      for (Phase p : {Phase::Rope, Phase::Activation, Phase::RopeBwd, Phase::ActivationBwd})
        EXPECT_NE(std::find(seen.begin(), seen.end(), p), seen.end()) << phase_name(p) << " was not timed";
    }
    EXPECT_NEAR(sum, prof.profile_total_ms, 1e-9 * sum);
    EXPECT_GT(sum, 0.0);
  }
}

TEST(HostProfile, ReportIsATableAndJson) {
  StepProfiler p(nullptr, 5);
  for (int s = 0; s < 3; ++s) {
    p.begin_step(true, s > 0);
    p.mark(Phase::QkvGemm);
    p.mark(Phase::Attention);
    p.mark(Phase::QkvGemm);
    p.end_step();
    p.collect();
  }
  EXPECT_EQ(p.steps_done(), 2);
  const auto j = nlohmann::json::parse(p.json());
  EXPECT_EQ(j["steps"], 2);
  ASSERT_EQ(j["phases"].size(), 2u);
  double share = 0;
  for (const auto& ph : j["phases"]) share += ph["share"].get<double>();
  EXPECT_NEAR(share, 1.0, 1e-9);
  for (const auto& ph : j["phases"])
    if (ph["phase"] == "qkv GEMM") {
      EXPECT_EQ(ph["marks_per_step"], 2);
    }
  EXPECT_NE(p.table().find("attention"), std::string::npos) << p.table();
  p.mark(Phase::Loss);  // outside a step: ignored
  p.collect();
  EXPECT_EQ(p.steps_done(), 2);
}

// CudaTrainer in host mode on tinyshakespeare (6 steps, accumulation 2, recompute full): with
// profile_steps 3 it writes profile.json for steps 2-4 and logs exactly the losses of the run
// without profiling.
std::map<int64_t, double> run_trainer(const std::filesystem::path& dir, const std::string& name, int64_t profile,
                                      const std::string& extra = "") {
  const std::string exp = "work_group: g\nuser_name: u\nexp_name: " + name + "\nworkspace: " + dir.string() +
                          "\nmodules:\n  pre_trainer:\n    framework: cuda\n    config: pretrain.yaml\n"
                          "    model: gpt2/tiny.yaml\n    overrides:\n"
                          "      tokenizer_type: bytes\n      vocab_size: 256\n      seq_length: 64\n"
                          "      num_layers: 2\n      hidden_size: 64\n      num_attention_heads: 2\n"
                          "      ffn_hidden_size: 256\n      data_path: [" + std::string(PRIMUS_SOURCE_DIR) +
                          "/examples/data/tinyshakespeare.txt]\n      split: 0.95\n      train_iters: 6\n"
                          "      micro_batch_size: 4\n      global_batch_size: 8\n      log_interval: 1\n"
                          "      eval_interval: 0\n      save_interval: 0\n" + extra;
  const auto file = dir / (name + ".yaml");
  std::ofstream(file) << exp;
  BackendRegistry backends;
  patches::PatchRegistry reg;
  register_backend(backends, reg);
  auto adapter = backends.create("cuda");
  auto e = config::load_experiment(file, {});
  auto cfg = config::resolve_module(e, "pre_trainer", adapter->schema());
  auto args = std::static_pointer_cast<CudaArgs>(adapter->convert_config(cfg, e));
  args->host_mode = true;
  args->train.grad_accum_steps = 2;
  args->profile_steps = profile;
  CudaOps ops = CudaOps::defaults();
  ops.recompute_policy = recompute_all(Recompute::Full);
  CudaTrainer trainer(args, ops);
  trainer.setup();
  trainer.init();
  trainer.train();
  trainer.cleanup(false);
  std::map<int64_t, double> loss;
  std::ifstream f(dir / "g/u" / name / "metrics.jsonl");
  std::string line;
  while (std::getline(f, line)) {
    auto j = nlohmann::json::parse(line);
    if (j.contains("loss")) loss[j["step"]] = j["loss"].is_number() ? j["loss"].get<double>() : NAN;  // NaN: null
  }
  return loss;
}

TEST(HostProfile, TrainerWritesProfileJsonAndKeepsItsLosses) {
  const auto dir = std::filesystem::temp_directory_path() / ("primus_step_host_" + std::to_string(::getpid()));
  std::filesystem::create_directories(dir);
  const auto plain = run_trainer(dir, "plain", 0);
  const auto prof = run_trainer(dir, "profiled", 3);
  ASSERT_EQ(plain.size(), 6u);
  EXPECT_EQ(prof, plain) << "profiling changed the losses";
  EXPECT_FALSE(std::filesystem::exists(dir / "g/u/plain/profile.json"));
  std::ifstream f(dir / "g/u/profiled/profile.json");
  ASSERT_TRUE(f.good()) << "no profile.json in the output folder";
  const auto j = nlohmann::json::parse(f);
  EXPECT_EQ(j["steps"], 3);
  EXPECT_GT(j["phases"].size(), 15u);
  std::filesystem::remove_all(dir);
}

// The trainer reads the device's finite flag: a diverging run (lr 1e30: the first update blows
// the weights up) stops at step 2 naming it, or with skip_nan_steps goes on, each such step
// logged as skipped.
TEST(HostStepCheck, TrainerStopsOrSkipsOnTheDeviceFlag) {
  const auto dir = std::filesystem::temp_directory_path() / ("primus_step_nan_" + std::to_string(::getpid()));
  std::filesystem::create_directories(dir);
  try {
    run_trainer(dir, "stop", 0, "      lr: 1.0e30\n      min_lr: 1.0e30\n      lr_warmup_iters: 0\n");
    ADD_FAILURE() << "a non-finite step must stop the run";
  } catch (const RuntimeError& e) {
    EXPECT_NE(std::string(e.what()).find("non-finite loss"), std::string::npos) << e.what();
    EXPECT_NE(std::string(e.what()).find("at step 2"), std::string::npos) << e.what();
  }
  const auto skipped = run_trainer(
      dir, "skip", 0, "      lr: 1.0e30\n      min_lr: 1.0e30\n      lr_warmup_iters: 0\n      skip_nan_steps: true\n");
  ASSERT_EQ(skipped.size(), 6u);
  EXPECT_TRUE(std::isfinite(skipped.at(1)));
  int flagged = 0;
  std::ifstream f(dir / "g/u/skip/metrics.jsonl");
  std::string line;
  while (std::getline(f, line)) {
    auto j = nlohmann::json::parse(line);
    if (j.contains("skipped") && j["skipped"].get<bool>()) ++flagged;
  }
  EXPECT_EQ(flagged, 5) << "steps 2-6 are non-finite and logged as skipped";
  std::filesystem::remove_all(dir);
}

TEST(StepConfig, GraphInSettingsThatCannotBeCapturedIsAConfigError) {
  CudaArgs a;
  a.cuda_graph = true;
  a.host_mode = true;
  try {
    check_graph_config(a);
    ADD_FAILURE() << "host mode + cuda_graph must be refused";
  } catch (const ConfigError& e) {
    EXPECT_NE(std::string(e.what()).find("cuda_graph"), std::string::npos) << e.what();
    EXPECT_NE(std::string(e.what()).find("host mode"), std::string::npos) << e.what();
  }
  a.host_mode = false;
  a.train.data_parallel_size = 2;
  try {
    check_graph_config(a);
    ADD_FAILURE() << "data parallelism + cuda_graph must be refused";
  } catch (const ConfigError& e) {
    EXPECT_NE(std::string(e.what()).find("data_parallel_size 2"), std::string::npos) << e.what();
  }
  a.train.data_parallel_size = 1;
  EXPECT_NO_THROW(check_graph_config(a));
  EXPECT_TRUE(a.cuda_graph);
  a.cuda_graph = false;
  a.host_mode = true;
  EXPECT_NO_THROW(check_graph_config(a));
}

// cuda_graph: auto (the default) captures where it can and runs eagerly where it cannot, with no
// error; the key's values and their origins.
TEST(StepConfig, AutoGraphRunsEagerlyWhereTheStepCannotBeCaptured) {
  for (int setting = 0; setting < 3; ++setting) {
    CudaArgs a;
    a.cuda_graph = true;
    a.cuda_graph_auto = true;
    a.host_mode = setting == 1;
    a.train.data_parallel_size = setting == 2 ? 4 : 1;
    EXPECT_NO_THROW(check_graph_config(a)) << setting;
    EXPECT_EQ(a.cuda_graph, setting == 0) << "setting " << setting << ": captured only on one GPU";
  }
  using config::Value;
  EXPECT_EQ(parse_cuda_graph(Value::boolean(true)), GraphMode::On);
  EXPECT_EQ(parse_cuda_graph(Value::boolean(false)), GraphMode::Off);
  EXPECT_EQ(parse_cuda_graph(Value::string("auto")), GraphMode::Auto);
  EXPECT_EQ(parse_cuda_graph(Value::string("true")), GraphMode::On);
  EXPECT_EQ(parse_cuda_graph(Value::string("false")), GraphMode::Off);
  for (const Value& bad : {Value::string("yes"), Value::string("Auto"), Value::integer(1)}) {
    try {
      parse_cuda_graph(bad);
      ADD_FAILURE() << bad.scalar_text() << " must be refused";
    } catch (const ConfigError& e) {
      EXPECT_NE(std::string(e.what()).find("auto, true, false"), std::string::npos) << e.what();
    }
  }
}

TEST(StepConfig, ProfileEnvironmentValuesAreChecked) {
  ::setenv("PRIMUS_CUDA_PROFILE", "1", 1);
  EXPECT_EQ(profile_env_steps(), std::numeric_limits<int64_t>::max());
  ::setenv("PRIMUS_CUDA_PROFILE", "0", 1);
  EXPECT_EQ(profile_env_steps(), 0);
  ::setenv("PRIMUS_CUDA_PROFILE", "yes", 1);
  try {
    (void)profile_env_steps();
    ADD_FAILURE() << "PRIMUS_CUDA_PROFILE=yes must be refused";
  } catch (const ConfigError& e) {
    EXPECT_NE(std::string(e.what()).find("PRIMUS_CUDA_PROFILE='yes'"), std::string::npos) << e.what();
  }
  ::unsetenv("PRIMUS_CUDA_PROFILE");
  EXPECT_EQ(profile_env_steps(), 0);
  EXPECT_THROW(parse_recompute("partial", "exp.yaml:3"), ConfigError);
  EXPECT_EQ(parse_recompute("selective", "x"), Recompute::Selective);
  EXPECT_EQ(parse_recompute("norms", "x"), Recompute::Norms);
}

}  // namespace
}  // namespace primus::backends::cuda::testing

namespace primus::backends::cuda::testing {
namespace {

// FP8 weights quantized once per optimizer step (turbo::Fp8WeightCache) under gradient
// accumulation (2 micro-batches a step): the step's first forward fills each weight's two FP8
// copies, the second micro-batch's forward and both input-gradient GEMMs read them, so per step
// one fill and three reads per weight; the losses, norms and weights are those of quantizing at
// every GEMM, bit for bit (the same bytes), for each scaling. Evaluation between steps does not
// use the copies; a recomputing layer (full) still gets its forward's copy.
// Runs `o` with the recipe that caches its weights and with the one that does not: the same
// losses, norms and weights, bit for bit.
void expect_cache_changes_nothing(StepRunOptions o, const turbo::Fp8Recipe& with, const turbo::Fp8Recipe& without) {
  o.fp8 = &with;
  const StepRun cached = run_steps(o);
  o.fp8 = &without;
  const StepRun plain = run_steps(o);
  EXPECT_EQ(cached.losses, plain.losses);
  EXPECT_EQ(cached.norms, plain.norms);
  EXPECT_EQ(cached.params, plain.params);
}

TEST(HostFp8WeightCache, QuantizesEachWeightOncePerStep) {
  for (const bool llama : {false, true}) {
    for (const char* scaling : {"tensorwise", "rowwise", "delayed"}) {
      SCOPED_TRACE(fmt::format("{} {}", llama ? "llama" : "gpt2", scaling));
      const turbo::Fp8Recipe with = fp8_test_recipe("hybrid", scaling, {.weights = true}),
                             without = fp8_test_recipe("hybrid", scaling);
      StepRunOptions o;
      o.llama = llama;
      o.steps = 3;
      o.micro = 2;
      int64_t evals = 0;
      o.after_step = [&](int, CudaModel& m) {  // an evaluation forward between steps
        const train::ModelSpec spec = tiny_spec(llama);
        Batches data(spec.seq_length, 1);
        m.forward(data.inputs[0].data(), data.targets[0].data(), 2, spec.seq_length, 0.0f, 0);
        ++evals;
      };
      expect_cache_changes_nothing(o, with, without);
      const int64_t weights = 4 * tiny_spec(llama).num_layers;
      ASSERT_EQ(with.weights->size(), static_cast<size_t>(weights));
      EXPECT_EQ(with.weights->fills, 3 * weights) << "one fill per weight and step";
      EXPECT_EQ(with.weights->hits, 3 * 3 * weights) << "mb1's forward and both micro-batches' input gradients";
      EXPECT_EQ(evals, 6) << "three evaluations in each of the two runs";
    }
  }
  // An MoE model: the FP8 experts' weights (both MoE layers' fc and proj of the tiny 128-wide MoE)
  // and the MoE layers' attention linears, every recipe: one fill per weight and step,
  // read by the second micro-batch's forward and both input gradients; bit for bit the run that
  // quantizes at every product.
  for (const auto& [format, scaling] :
       {std::pair{"hybrid", "rowwise"}, std::pair{"e4m3", "blockwise"}, std::pair{"hybrid", "tensorwise"},
        std::pair{"hybrid", "delayed"}}) {
    SCOPED_TRACE(fmt::format("MoE {} {}", format, scaling));
    const train::ModelSpec spec = tiny_moe_spec_128(false);
    const turbo::Fp8Recipe with = fp8_test_recipe(format, scaling, {.weights = true}),
                           without = fp8_test_recipe(format, scaling);
    StepRunOptions o;
    o.spec = &spec;
    o.steps = 3;
    o.micro = 2;
    expect_cache_changes_nothing(o, with, without);
    const int64_t experts = 2 * spec.num_moe_layers();  // fc and proj per MoE layer
    // q|k|v and attention output in every layer, MLP up and down in the dense ones.
    const int64_t dense = 4 * spec.num_layers - 2 * spec.num_moe_layers();
    ASSERT_EQ(with.weights->size(), static_cast<size_t>(experts + dense));
    EXPECT_EQ(with.weights->fills, 3 * (experts + dense)) << "one fill per weight and step";
    EXPECT_EQ(with.weights->hits, 3 * 3 * (experts + dense));
  }
  // One micro-batch a step: no copies (nothing to reuse).
  turbo::Fp8Recipe one = turbo::parse_fp8_recipe("hybrid", "test");
  one.weights = std::make_shared<turbo::Fp8WeightCache>();
  StepRunOptions o;
  o.micro = 1;
  o.steps = 1;
  o.fp8 = &one;
  (void)run_steps(o);
  EXPECT_EQ(one.weights->size(), 0u);
  EXPECT_EQ(one.weights->fills, 0);
}

// no_fp8_weight_transpose_cache (Fp8WeightCache::keep_transpose = false): the step's copies keep
// the forward layout alone, read by the second micro-batch's forward; each input gradient quantizes
// the weight's transpose again. The same run bit for bit as quantizing at every product (dense
// GPT-2 and Llama per recipe, an MoE's experts in every recipe), and the model reserves less.
TEST(HostFp8WeightCache, WithoutTransposesTheInputGradientsQuantizeAgain) {
  auto reserved = [](StepRunOptions o, const turbo::Fp8Recipe& r) {
    size_t bytes = 0;
    o.fp8 = &r;
    o.steps = 1;
    o.after_step = [&bytes](int, CudaModel& m) { bytes = m.reserved_bytes(); };
    (void)run_steps(o);
    return bytes;
  };
  struct Case {
    bool llama;
    const char *format, *scaling;
    bool moe;
  };
  const train::ModelSpec moe = tiny_moe_spec_128(false);
  for (const Case& k : {Case{false, "hybrid", "tensorwise", false}, Case{true, "hybrid", "rowwise", false},
                        Case{true, "hybrid", "delayed", false}, Case{false, "hybrid", "rowwise", true},
                        Case{false, "e4m3", "blockwise", true}, Case{false, "hybrid", "tensorwise", true},
                        Case{false, "hybrid", "delayed", true}}) {
    SCOPED_TRACE(fmt::format("{} {} {}", k.moe ? "moe" : k.llama ? "llama" : "gpt2", k.format, k.scaling));
    const turbo::Fp8Recipe lean = fp8_test_recipe(k.format, k.scaling, {.weights = true}),
                           both = fp8_test_recipe(k.format, k.scaling, {.weights = true}),
                           without = fp8_test_recipe(k.format, k.scaling);
    lean.weights->keep_transpose = false;
    StepRunOptions o;
    o.llama = k.llama;
    if (k.moe) o.spec = &moe;
    o.steps = 3;
    o.micro = 2;
    expect_cache_changes_nothing(o, lean, without);
    const int64_t n = static_cast<int64_t>(lean.weights->size());
    ASSERT_GT(n, 0);
    EXPECT_EQ(lean.weights->fills, 3 * n) << "one fill per weight and step";
    EXPECT_EQ(lean.weights->hits, 3 * n) << "the second micro-batch's forward only";
    EXPECT_LT(reserved(o, lean), reserved(o, both)) << "the transposed copies were reserved";
  }
}

}  // namespace
}  // namespace primus::backends::cuda::testing
