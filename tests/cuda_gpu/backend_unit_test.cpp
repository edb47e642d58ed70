// What the CUDA backend does without a GPU (label unit, runs everywhere): it registers with its
// schema, hook slots and patches; its init draws the reference backend's weights bit for bit;
// the MFU peak table; and through the real binary, a train run with no device fails with
// "no CUDA device" (exit 3) while config errors stay exit 2.
#include <gtest/gtest.h>

#include "backends/cuda/device.h"
#include "backends/cuda/hooks.h"
#include "backends/cuda/register.h"
#include "backends/reference/model.h"
#include "core/backend/backend.h"
#include "core/config/yaml_loader.h"
#include "core/patches/context.h"
#include "core/patches/registry.h"
#include "tests/e2e/cli_runner.h"
#include "train/param_init.h"
#include "turbo/core/arena.h"
#include "turbo/core/cuda_check.h"
#include "turbo/ops/grouped_gemm_fp8.h"

namespace primus::backends::cuda {
namespace {

train::ModelSpec small_spec(bool llama) {
  train::ModelSpec m;
  m.model_type = llama ? "llama" : "gpt2";
  m.vocab_size = 250;
  m.padded_vocab_size = 256;  // padded rows must come out zero on both sides
  m.seq_length = 16;
  m.num_layers = 3;
  m.hidden_size = 32;
  m.num_attention_heads = 4;
  m.num_query_groups = llama ? 2 : 4;
  m.ffn_hidden_size = 64;
  m.layernorm = !llama;
  m.swiglu = llama;
  m.rope = llama;
  m.untied = llama;
  m.bias = !llama;
  return m;
}

TEST(CudaBackendUnit, InitDrawsTheReferenceWeightsBitForBit) {
  for (bool llama : {false, true}) {
    const train::ModelSpec spec = small_spec(llama);
    reference::GptModel<float> ref(spec, 1, spec.seq_length);
    ref.init_weights(77);
    std::vector<float> ours(ref.params.size(), -1.0f);
    train::init_params(spec, ref.layout(), 77, ours.data());
    EXPECT_EQ(ours, ref.params) << spec.model_type;
    std::vector<float> other(ours.size());
    train::init_params(spec, ref.layout(), 78, other.data());
    EXPECT_NE(other, ours) << "the seed must matter";
  }
}

TEST(CudaBackendUnit, RegistersSchemaSlotsAndPatches) {
  BackendRegistry backends;
  patches::PatchRegistry reg;
  register_backend(backends, reg);
  ASSERT_TRUE(backends.has("cuda"));
  auto adapter = backends.create("cuda");
  EXPECT_EQ(adapter->version(), kVersion);
  for (const char* key : {"device", "recompute_granularity", "cuda_graph", "gemm_algo_search", "attention_backend",
                          "fp8", "peak_flops", "hidden_size", "micro_batch_size", "lr", "mock_data"}) {
    EXPECT_NE(adapter->schema().find(key), nullptr) << key;
  }
  patches::HookTable hooks;
  adapter->define_hooks(hooks);
  for (const char* slot : {kAttentionForward, kAttentionBackward, kLinearForward, kLinearBackward,
                           kLinearBackwardDGelu, kBiasGrad, kLinearWeightGradOnes, kHeadForward, kHeadBackward, kNormForward, kNormBackward,
                           kCrossEntropy, kGradNorm, kAdamWStep, kRecomputePolicy, kMoeRouter, kMoeRouterBackward,
                           kMoeDispatch, kMoeDispatchBackward, kMoeCombine, kMoeCombineBackward, kMoeExperts,
                           kMoeExpertsDgrad, kMoeExpertsWgrad}) {
    EXPECT_TRUE(hooks.has(slot)) << slot;
    EXPECT_FALSE(hooks.doc(slot).empty()) << slot;
  }
  EXPECT_EQ(hooks.names().size(), 24u);
  for (const char* id : {"cuda.args.grad_accum", "cuda.args.mock_data", "cuda.logging.tensorboard_dir",
                         "cuda.runtime.peak_flops", "cuda.attention.fallback", "cuda.step.cuda_graph", "cuda.step.launch_ahead",
                         "cuda.gemm.algo_search", "cuda.memory.recompute", "cuda.profile.phase_times",
                         "cuda.linear.fp8", "cuda.attention.deterministic", "cuda.moe.sequential_experts",
                         "cuda.moe.fp8", "cuda.moe.swiglu_epilogue"}) {
    const patches::Patch* p = reg.find(id);
    ASSERT_NE(p, nullptr) << id;
    EXPECT_EQ(p->backend, "cuda") << id;
    EXPECT_FALSE(p->description.empty()) << id;
    EXPECT_TRUE(!p->slots.empty() || !p->logic.empty()) << id << ": the inventory must say what it changes";
  }
  EXPECT_EQ(reg.find("cuda.attention.fallback")->slots,
            (std::vector<std::string>{kAttentionForward, kAttentionBackward}));
  // Every slot default can be read back with the signature the model uses.
  CudaOps ops = CudaOps::from(hooks);
  EXPECT_TRUE(ops.attention_forward && ops.attention_backward && ops.linear_forward && ops.adamw);
  EXPECT_TRUE(ops.moe_router && ops.moe_router_backward && ops.moe_dispatch && ops.moe_dispatch_backward &&
              ops.moe_combine && ops.moe_combine_backward && ops.moe_experts && ops.moe_experts_dgrad &&
              ops.moe_experts_wgrad);
  EXPECT_EQ(ops.recompute_policy(0, 12), Recompute::None);
  EXPECT_EQ(reg.find("cuda.memory.recompute")->slots, (std::vector<std::string>{kRecomputePolicy}));
  // FP8 replaces the layers' linear slots, never the output layer's.
  EXPECT_EQ(reg.find("cuda.linear.fp8")->slots,
            (std::vector<std::string>{kLinearForward, kLinearBackward, kLinearBackwardDGelu}));
  EXPECT_EQ(reg.find("cuda.moe.fp8")->slots, (std::vector<std::string>{kMoeExperts, kMoeExpertsDgrad, kMoeExpertsWgrad}));
}

TEST(CudaBackendUnit, PeakTableCoversTheDataCentreGpus) {
  EXPECT_EQ(peak_bf16_flops("NVIDIA H100 80GB HBM3"), 989e12);
  EXPECT_EQ(peak_bf16_flops("NVIDIA H100 PCIe"), 756e12);
  EXPECT_EQ(peak_bf16_flops("NVIDIA H200"), 989e12);
  EXPECT_EQ(peak_bf16_flops("NVIDIA A100-SXM4-80GB"), 312e12);
  EXPECT_EQ(peak_bf16_flops("NVIDIA GeForce RTX 4090"), 0.0);
}

std::string example_args(const std::string& extra) {
  return "train pretrain --config " + std::string(PRIMUS_SOURCE_DIR) +
         "/examples/cuda/gpt2-124M-shakespeare.yaml " + extra;
}

// Megatron-LM's recompute_method / recompute_num_layers beside recompute_granularity: full: block N
// recomputes the first N layers; the memory plan and the step-time projection follow the layers.
TEST(CudaBackendUnit, RecomputeMethodPicksTheLayersFullRecomputes) {
  auto layers = [](const std::string& yaml) {
    const config::Value v = config::parse_yaml_text("num_layers: 12\n" + yaml, "exp.yaml");
    return recompute_layers([&](const std::string& k) { return v.find_path(k); });
  };
  EXPECT_EQ(layers("recompute_granularity: none\n"), -1);
  EXPECT_EQ(layers("recompute_granularity: full\n"), -1);
  EXPECT_EQ(layers("recompute_granularity: full\nrecompute_method: block\nrecompute_num_layers: 4\n"), 4);
  EXPECT_EQ(layers("recompute_granularity: full\nrecompute_method: block\n"), 1);  // Megatron-LM's default count
  EXPECT_EQ(layers("recompute_granularity: full\nrecompute_method: block\nrecompute_num_layers: 80\n"), -1);
  EXPECT_EQ(layers("recompute_granularity: full\nrecompute_method: uniform\nrecompute_num_layers: 1\n"), -1);
  // Block 0, as Primus' Mixtral-8x22B and Qwen3.5 examples write it: no layer recomputed.
  EXPECT_EQ(layers("recompute_granularity: full\nrecompute_method: block\nrecompute_num_layers: 0\n"), 0);
  const std::pair<const char*, const char*> refused[] = {
      {"recompute_granularity: full\nrecompute_method: uniform\nrecompute_num_layers: 0\n",
       "uniform with recompute_num_layers 0: chunks of no layer"},
      {"recompute_granularity: selective\nrecompute_method: block\n", "exp.yaml:3:19: recompute_method and"},
      {"recompute_granularity: full\nrecompute_num_layers: 2\n", "recompute_num_layers needs recompute_method"},
      {"recompute_granularity: full\nrecompute_method: uniform\nrecompute_num_layers: 2\n",
       "uniform with recompute_num_layers 2 (chunks of 2 layers"},
  };
  for (const auto& [yaml, why] : refused) {
    try {
      layers(yaml);
      ADD_FAILURE() << yaml << " was accepted";
    } catch (const ConfigError& e) {
      EXPECT_NE(std::string(e.what()).find(why), std::string::npos) << e.what();
    }
  }
  // Through the binary: the plan's activations and the step's recomputed forward follow the layers.
  const std::string e = std::string(PRIMUS_SOURCE_DIR) + "/examples/cuda/gpt2-124M-shakespeare.yaml";
  auto step_ms = [&](const std::string& keys) {
    auto r = primus::testing::run_primus("projection both -c " + e + " --peak-tflops 900 --hbm-gbps 4000 " + keys);
    EXPECT_EQ(r.code, 0) << r.out;
    const size_t at = r.out.find("  step ");
    EXPECT_NE(at, std::string::npos) << r.out;
    return std::make_pair(at == std::string::npos ? 0.0 : std::stod(r.out.substr(at + 6)), r.out);
  };
  const auto [none, none_out] = step_ms("");
  const auto [full, full_out] = step_ms("recompute_granularity=full");
  const auto [block, block_out] = step_ms("recompute_granularity=full recompute_method=block recompute_num_layers=4");
  EXPECT_NE(block_out.find("recompute full in the first 4 layers"), std::string::npos) << block_out;
  EXPECT_NE(block_out.find("(recompute_granularity full in the first 4 of 12 layers)"), std::string::npos) << block_out;
  EXPECT_NEAR(block, none + (full - none) * 4 / 12, 0.02) << none_out << full_out << block_out;
  const auto [block0, block0_out] = step_ms("recompute_granularity=full recompute_method=block recompute_num_layers=0");
  EXPECT_NEAR(block0, none, 0.02) << none_out << block0_out;
  EXPECT_NE(block0_out.find("recompute none (full in no layer)"), std::string::npos) << block0_out;
}

TEST(CudaBackendUnit, TrainWithoutDeviceFailsClearlyWithExit3) {
  if (turbo::cuda_device_count_or_zero() > 0) GTEST_SKIP() << "this machine has a CUDA device";
  primus::testing::Workdir w;
  auto r = primus::testing::run_primus(example_args("train_iters=2 workspace=" + w.str()));
  EXPECT_EQ(r.code, 3) << r.out;
  EXPECT_NE(r.out.find("no CUDA device"), std::string::npos) << r.out;
}

TEST(CudaBackendUnit, StepOptionsAreSwitchedOnByTheirPatches) {
  primus::testing::Workdir w;
  const std::string opts = " recompute_granularity=selective cuda_graph=true profile_steps=5 workspace=" + w.str();
  auto on = primus::testing::run_primus(example_args("--dry-run" + opts));
  EXPECT_EQ(on.code, 0) << on.out;
  auto off = primus::testing::run_primus(example_args("--dry-run workspace=" + w.str()));
  EXPECT_EQ(off.code, 0) << off.out;
  EXPECT_NE(off.out.find("cuda.runtime.peak_flops"), std::string::npos) << off.out;
  // The dry run's patch plan: each applies with its key and is skipped without it.
  for (const char* id : {"cuda.memory.recompute", "cuda.profile.phase_times"}) {
    EXPECT_NE(on.out.find(std::string("apply ") + id + ": condition true"), std::string::npos) << id << "\n" << on.out;
    EXPECT_NE(off.out.find(std::string("skip  ") + id + ": condition false"), std::string::npos) << id << "\n" << off.out;
  }
  // cuda_graph is auto by default (the patch applies; the trainer runs a step it cannot capture
  // eagerly), true applies it too, false skips it, and any other value is a config error.
  EXPECT_NE(on.out.find("apply cuda.step.cuda_graph: condition true"), std::string::npos) << on.out;
  EXPECT_NE(off.out.find("apply cuda.step.cuda_graph: condition true"), std::string::npos) << off.out;
  auto eager = primus::testing::run_primus(example_args("--dry-run cuda_graph=false workspace=" + w.str()));
  EXPECT_EQ(eager.code, 0) << eager.out;
  EXPECT_NE(eager.out.find("skip  cuda.step.cuda_graph: condition false"), std::string::npos) << eager.out;
  auto bad_graph = primus::testing::run_primus(example_args("--dry-run cuda_graph=maybe workspace=" + w.str()));
  EXPECT_EQ(bad_graph.code, 2) << bad_graph.out;
  EXPECT_NE(bad_graph.out.find("'cuda_graph' = 'maybe' is not one of: auto, true, false"), std::string::npos)
      << bad_graph.out;
  // The cuBLASLt algorithm search is on by default (gemm_algo_search: 8); 0 or 1 switch it off.
  EXPECT_NE(off.out.find("apply cuda.gemm.algo_search: condition true"), std::string::npos) << off.out;
  for (const char* k : {"0", "1"}) {
    auto no = primus::testing::run_primus(
        example_args(std::string("--dry-run gemm_algo_search=") + k + " workspace=" + w.str()));
    EXPECT_EQ(no.code, 0) << no.out;
    EXPECT_NE(no.out.find("skip  cuda.gemm.algo_search: condition false"), std::string::npos) << no.out;
  }
  auto nine = primus::testing::run_primus(example_args("--dry-run gemm_algo_search=9 workspace=" + w.str()));
  EXPECT_EQ(nine.code, 2) << nine.out;
  EXPECT_NE(nine.out.find("gemm_algo_search"), std::string::npos) << nine.out;
  // fp8: off by default; hybrid / e4m3 switch the patch on; anything else is a config error.
  EXPECT_NE(off.out.find("skip  cuda.linear.fp8: condition false"), std::string::npos) << off.out;
  auto fp8 = primus::testing::run_primus(example_args("--dry-run fp8=hybrid workspace=" + w.str()));
  EXPECT_EQ(fp8.code, 0) << fp8.out;
  EXPECT_NE(fp8.out.find("apply cuda.linear.fp8: condition true"), std::string::npos) << fp8.out;
  EXPECT_NE(off.out.find("skip  cuda.attention.deterministic: condition false"), std::string::npos) << off.out;
  auto det = primus::testing::run_primus(example_args("--dry-run deterministic=true workspace=" + w.str()));
  EXPECT_EQ(det.code, 0) << det.out;
  EXPECT_NE(det.out.find("apply cuda.attention.deterministic: condition true"), std::string::npos) << det.out;
  auto fp8bad = primus::testing::run_primus(example_args("--dry-run fp8=e5m2 workspace=" + w.str()));
  EXPECT_EQ(fp8bad.code, 2) << fp8bad.out;
  EXPECT_NE(fp8bad.out.find("fp8"), std::string::npos) << fp8bad.out;
  // MoE: the grouped expert GEMMs by default; moe_grouped_gemm=false switches the sequential
  // (per-expert cuBLASLt) path on, for MoE models only.
  const std::string moe = "train pretrain --config " + std::string(PRIMUS_SOURCE_DIR) + "/examples/cuda/olmoe-mini.yaml ";
  auto grouped = primus::testing::run_primus(moe + "--dry-run workspace=" + w.str());
  EXPECT_EQ(grouped.code, 0) << grouped.out;
  EXPECT_NE(grouped.out.find("skip  cuda.moe.sequential_experts: condition false"), std::string::npos) << grouped.out;
  auto seq = primus::testing::run_primus(moe + "--dry-run moe_grouped_gemm=false cuda_graph=false workspace=" + w.str());
  EXPECT_EQ(seq.code, 0) << seq.out;
  EXPECT_NE(seq.out.find("apply cuda.moe.sequential_experts: condition true"), std::string::npos) << seq.out;
  // The experts' SwiGLU in the grouped GEMMs' epilogues: on for MoE models unless the switch says 0;
  // another value is an error naming it.
  EXPECT_NE(grouped.out.find("apply cuda.moe.swiglu_epilogue: condition true"), std::string::npos) << grouped.out;
  auto unfused = primus::testing::run_primus(moe + "--dry-run workspace=" + w.str(), "PRIMUS_CUDA_MOE_SWIGLU_EPILOGUE=0");
  EXPECT_EQ(unfused.code, 0) << unfused.out;
  EXPECT_NE(unfused.out.find("skip  cuda.moe.swiglu_epilogue: condition false"), std::string::npos) << unfused.out;
  // The plan lists the step options the patches set (the args the trainer gets).
  const auto set_by_patches = [](const std::string& out) {
    const size_t at = out.find("backend args set by build_args patches:");
    return at == std::string::npos ? std::string() : out.substr(at);
  };
  EXPECT_NE(set_by_patches(grouped.out).find("experts' SwiGLU in the GEMM epilogues"), std::string::npos) << grouped.out;
  EXPECT_EQ(set_by_patches(unfused.out).find("experts' SwiGLU"), std::string::npos) << unfused.out;
  EXPECT_NE(set_by_patches(on.out).find("CUDA graph, cuBLASLt search of 8"), std::string::npos) << on.out;
  EXPECT_NE(set_by_patches(on.out).find("phase profile of 5 steps"), std::string::npos) << on.out;
  EXPECT_NE(set_by_patches(off.out).find("CUDA graph (auto)"), std::string::npos) << off.out;
  // A patch's refusal fails the dry run as it would fail the run: the sequential experts read the
  // group sizes on the host, which the default (auto) CUDA graph cannot capture.
  auto seq_graph = primus::testing::run_primus(moe + "--dry-run moe_grouped_gemm=false workspace=" + w.str());
  EXPECT_EQ(seq_graph.code, 2) << seq_graph.out;
  EXPECT_NE(seq_graph.out.find("set cuda_graph: false with it"), std::string::npos) << seq_graph.out;
  auto swbad = primus::testing::run_primus(moe + "--dry-run workspace=" + w.str(), "PRIMUS_CUDA_MOE_SWIGLU_EPILOGUE=yes");
  EXPECT_NE(swbad.code, 0) << swbad.out;
  EXPECT_NE(swbad.out.find("PRIMUS_CUDA_MOE_SWIGLU_EPILOGUE='yes': expected one of 0, 1"), std::string::npos) << swbad.out;
  // FP8 experts: every recipe with an MoE model (patch cuda.moe.fp8; tensorwise is the default),
  // refused for the sequential experts; a dense model leaves the patch off.
  EXPECT_NE(grouped.out.find("skip  cuda.moe.fp8: condition false"), std::string::npos) << grouped.out;
  auto moe8 = primus::testing::run_primus(moe + "--dry-run fp8=hybrid fp8_recipe=rowwise workspace=" + w.str());
  EXPECT_EQ(moe8.code, 0) << moe8.out;
  EXPECT_NE(moe8.out.find("apply cuda.moe.fp8: condition true"), std::string::npos) << moe8.out;
  auto moe8b = primus::testing::run_primus(moe + "--dry-run fp8=e4m3 fp8_recipe=blockwise workspace=" + w.str());
  EXPECT_EQ(moe8b.code, 0) << moe8b.out;
  EXPECT_NE(moe8b.out.find("apply cuda.moe.fp8: condition true"), std::string::npos) << moe8b.out;
  auto moe8d = primus::testing::run_primus(moe + "--dry-run fp8=hybrid fp8_recipe=delayed workspace=" + w.str());
  EXPECT_EQ(moe8d.code, 0) << moe8d.out;
  EXPECT_NE(moe8d.out.find("apply cuda.moe.fp8: condition true"), std::string::npos) << moe8d.out;
  auto moe8t = primus::testing::run_primus(moe + "--dry-run fp8=hybrid workspace=" + w.str());
  EXPECT_EQ(moe8t.code, 0) << moe8t.out;
  EXPECT_NE(moe8t.out.find("apply cuda.moe.fp8: condition true"), std::string::npos) << moe8t.out;
  auto moe8s = primus::testing::run_primus(moe + "--dry-run fp8=hybrid fp8_recipe=rowwise moe_grouped_gemm=false "
                                                 "cuda_graph=false workspace=" + w.str());
  EXPECT_EQ(moe8s.code, 2) << moe8s.out;
  EXPECT_NE(moe8s.out.find("moe_grouped_gemm"), std::string::npos) << moe8s.out;
  EXPECT_NE(fp8.out.find("skip  cuda.moe.fp8: condition false"), std::string::npos) << fp8.out;
  auto dense = primus::testing::run_primus(example_args("--dry-run moe_grouped_gemm=false workspace=" + w.str()));
  EXPECT_NE(dense.out.find("skip  cuda.moe.sequential_experts: condition false"), std::string::npos) << dense.out;
  EXPECT_NE(dense.out.find("skip  cuda.moe.swiglu_epilogue: condition false"), std::string::npos) << dense.out;
  auto bad = primus::testing::run_primus(example_args("--dry-run recompute_granularity=partial workspace=" + w.str()));
  EXPECT_EQ(bad.code, 2) << bad.out;
  EXPECT_NE(bad.out.find("recompute_granularity"), std::string::npos) << bad.out;
}

// Megatron-LM's fused-or-unfused switches: a Megatron config's values carry over (the fused
// kernels are what the cuda backend runs), the unimplemented value is refused naming the key and
// the line it was set on, and no value is silently ignored.
TEST(CudaBackendUnit, MegatronFusionSwitchesAcceptWhatRunsAndRefuseTheRest) {
  primus::testing::Workdir w;
  const std::string moe = "train pretrain --config " + std::string(PRIMUS_SOURCE_DIR) + "/examples/cuda/olmoe-mini.yaml ";
  const char* fused[] = {"moe_permute_fusion", "moe_router_fusion", "bias_swiglu_fusion", "apply_rope_fusion",
                         "cross_entropy_loss_fusion"};
  std::string megatron;
  for (const char* k : fused) megatron += std::string(k) + "=true ";
  auto ok = primus::testing::run_primus(moe + "--dry-run " + megatron + "moe_shared_expert_overlap=false workspace=" +
                                        w.str());
  EXPECT_EQ(ok.code, 0) << ok.out;
  for (const char* k : fused) {
    auto r = primus::testing::run_primus(moe + "--dry-run " + k + "=false workspace=" + w.str());
    EXPECT_EQ(r.code, 2) << k << "\n" << r.out;
    EXPECT_NE(r.out.find(std::string(k) + ": false is not implemented"), std::string::npos) << r.out;
  }
  for (const char* k : {"moe_shared_expert_overlap", "fp16"}) {
    auto r = primus::testing::run_primus(moe + "--dry-run " + k + "=true workspace=" + w.str());
    EXPECT_EQ(r.code, 2) << k << "\n" << r.out;
    EXPECT_NE(r.out.find(std::string(k) + ": true is not implemented"), std::string::npos) << r.out;
  }
  auto bf16 = primus::testing::run_primus(moe + "--dry-run bf16=true fp16=false workspace=" + w.str());
  EXPECT_EQ(bf16.code, 0) << bf16.out;
  auto fp32 = primus::testing::run_primus(moe + "--dry-run bf16=false workspace=" + w.str());
  EXPECT_EQ(fp32.code, 2) << fp32.out;
  EXPECT_NE(fp32.out.find("bf16: false is not implemented (the cuda backend has no fp32 compute; the reference "
                          "backend trains in fp32)"),
            std::string::npos)
      << fp32.out;
  // Set in a file, the error names the file and line.
  const auto exp = w.write("megatron.yaml",
                           "workspace: " + w.str() +
                               "\nmodules:\n  pre_trainer:\n    framework: cuda\n    config: pretrain.yaml\n"
                               "    model: moe/tiny.yaml\n    overrides:\n      mock_data: true\n"
                               "      moe_permute_fusion: true\n      moe_router_fusion: false\n");
  auto file = primus::testing::run_primus("train pretrain --config " + exp.string() + " --dry-run");
  EXPECT_EQ(file.code, 2) << file.out;
  EXPECT_NE(file.out.find("megatron.yaml:10:"), std::string::npos) << file.out;
  EXPECT_NE(file.out.find("moe_router_fusion: false is not implemented"), std::string::npos) << file.out;
}

// The trainer's own refusals of its args (model_options_for), which the dry run meets while it
// projects the memory: the dry run fails with the run's error and exit code, where a reason the
// projection alone has (a layout it does not model) only leaves the memory line unprojected.
TEST(CudaBackendUnit, DryRunFailsWhereTheTrainerWouldRefuseItsArgs) {
  primus::testing::Workdir w;
  const std::string moe = "train pretrain --config " + std::string(PRIMUS_SOURCE_DIR) + "/examples/cuda/olmoe-mini.yaml ";
  auto ok = primus::testing::run_primus(moe + "--dry-run workspace=" + w.str());
  EXPECT_EQ(ok.code, 0) << ok.out;
  EXPECT_NE(ok.out.find("  memory:    "), std::string::npos) << ok.out;
  EXPECT_NE(ok.out.find("Dry run: nothing was run."), std::string::npos) << ok.out;
  auto seq = primus::testing::run_primus(moe + "--dry-run moe_router_load_balancing_type=seq_aux_loss workspace=" + w.str());
  EXPECT_EQ(seq.code, 0) << seq.out;
  EXPECT_NE(seq.out.find("  memory:    "), std::string::npos) << seq.out;
  seq = primus::testing::run_primus(
      moe + "--dry-run moe_router_load_balancing_type=seq_aux_loss context_parallel_size=2 workspace=" + w.str(),
      "RANK=0 WORLD_SIZE=2");
  EXPECT_EQ(seq.code, 0) << seq.out;
  EXPECT_NE(seq.out.find("Dry run: nothing was run."), std::string::npos) << seq.out;
  auto muon = primus::testing::run_primus(moe + "--dry-run optimizer=muon optimizer_in_bwd=true clip_grad=0 workspace=" +
                                          w.str());
  EXPECT_EQ(muon.code, 2) << muon.out;
  EXPECT_NE(muon.out.find("muon with optimizer_in_bwd: true is not supported"), std::string::npos) << muon.out;
  EXPECT_TRUE(std::filesystem::is_empty(w.path())) << "the dry runs wrote into the workspace";
}

// Patch cuda.moe.fp8's expert slots quantize into the step's weight copies that cuda.linear.fp8
// made (the object the model registers its expert slots in under gradient accumulation): a
// forward through the patched slot fills the weight's slot, the input gradient reads it.
TEST(CudaBackendUnit, Fp8ExpertPatchUsesTheStepsWeightCopies) {
  BackendRegistry backends;
  patches::PatchRegistry reg;
  register_backend(backends, reg);
  auto adapter = backends.create("cuda");
  patches::HookTable hooks;
  adapter->define_hooks(hooks);
  config::Value params = config::Value::map();
  adapter->schema().apply_defaults(params);
  params.set("fp8", config::Value::string("hybrid"));
  params.set("fp8_recipe", config::Value::string("rowwise"));
  params.set("num_experts", config::Value::integer(2));
  patches::PatchContext ctx(params, "cuda", adapter->version(), &hooks);
  auto args = std::make_shared<CudaArgs>();
  ctx.set_args(args);
  for (const char* id : {"cuda.linear.fp8", "cuda.moe.fp8"}) {
    const patches::Patch* p = reg.find(id);
    ASSERT_NE(p, nullptr) << id;
    ctx.begin_patch(*p, p->phase);
    p->apply(ctx);
  }
  ASSERT_TRUE(args->fp8_weights);
  const int64_t G = 2, N = 32, K = 48, M = 64;
  std::vector<float> w(G * N * K, 0.25f), x(M * K, 0.5f), dy(M * N, -0.5f), y(M * N), dx(M * K);
  for (size_t i = 0; i < w.size(); ++i) w[i] = 0.01f * float(i % 97) - 0.3f;
  std::vector<int32_t> offsets = {0, 32, 64};
  std::vector<uint8_t> q(G * N * K), q_t(G * N * K);
  std::vector<float> scale(G * N), scale_t(G * K);
  const auto host = [](auto& v, turbo::DType t, std::initializer_list<int64_t> shape) {
    return turbo::TensorView(v.data(), t, turbo::Device::CPU, shape);
  };
  args->fp8_weights->add(w.data(), {host(q, turbo::DType::F8E4M3, {G * N * K}), host(scale, turbo::DType::F32, {G * N}),
                                    host(q_t, turbo::DType::F8E4M3, {G * N * K}), host(scale_t, turbo::DType::F32, {G * K})});
  auto arena = turbo::make_host_arena(turbo::grouped_gemm_fp8_scratch_bytes(M, G, N, K));
  turbo::ExecContext ec;
  ec.scratch = arena.get();
  const CudaOps ops = CudaOps::from(hooks);
  const turbo::TensorView W = host(w, turbo::DType::F32, {G, N, K}), off = host(offsets, turbo::DType::I32, {G + 1});
  ops.moe_experts({host(y, turbo::DType::F32, {M, N}), host(x, turbo::DType::F32, {M, K}), W, off, 16, ec});
  EXPECT_EQ(args->fp8_weights->fills, 1) << "the forward filled the weight's step copies";
  ops.moe_experts_dgrad({host(dx, turbo::DType::F32, {M, K}), host(dy, turbo::DType::F32, {M, N}), W, off, 16, ec});
  EXPECT_EQ(args->fp8_weights->hits, 1) << "the input gradient read them";
  EXPECT_NE(scale_t[0], 0.0f);
}

TEST(CudaBackendUnit, PatchInventoryListsTheCudaPatches) {
  auto r = primus::testing::run_primus("patches list --backend cuda");
  EXPECT_EQ(r.code, 0) << r.out;
  for (const char* id : {"cuda.args.grad_accum", "cuda.runtime.peak_flops", "cuda.attention.fallback"})
    EXPECT_NE(r.out.find(id), std::string::npos) << id << "\n" << r.out;
  auto b = primus::testing::run_primus("backends");
  EXPECT_NE(b.out.find("cuda"), std::string::npos) << b.out;
}

// The deterministic attention backward's scratch covers what cuDNN's engine asked for on an H200
// (cuda arena exhausted otherwise, before the first step): Llama-3.2-1B at 8 x 2048 (32 heads of
// 64) needed 2,283,798,784 bytes; GPT-2 124M at 16 x 1024 ran within the old bound.
TEST(CudaBackendUnit, DeterministicAttentionScratchCoversCudnnWorkspace) {
  EXPECT_GE(deterministic_attention_scratch_bytes(8, 2048, 32, 64), size_t{2283798784});
  const size_t gpt2 = deterministic_attention_scratch_bytes(16, 1024, 12, 64);
  EXPECT_GE(gpt2, size_t(16) * 12 * 1024 * 1024 * 2);  // the dP workspace alone
  // Grows with every dimension of the dQ-sized buffer.
  EXPECT_GT(deterministic_attention_scratch_bytes(8, 2048, 32, 128), deterministic_attention_scratch_bytes(8, 2048, 32, 64));
}

}  // namespace
}  // namespace primus::backends::cuda
