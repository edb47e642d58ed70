// Step 0 of the CUDA model on the device against the reference backend's GptModel<float> (the
// oracle), for the tiny GPT-2 and Llama and each attention implementation (see step0_parity).
// Gates: loss relative error < 1e-2 (the bf16 gate); every parameter tensor's gradient relative
// L2 error ||g_cuda - g_ref|| / ||g_ref|| below gradient_gate() (below). The errors are printed
// per tensor, each next to its gate.
//
// ParityDump.EveryCaseSeveralSeeds (runs only with PRIMUS_PARITY_DUMP=<dir>) writes step 0 of
// every case for seeds 1..$PRIMUS_PARITY_DUMP_SEEDS (default 4) for the outside oracle
//   python3 tests/cuda_gpu/bf16_noise_floor.py <dir>
// which measures, on the same weights and batches, what PyTorch's own bf16 training shows
// against PyTorch fp32 (bench/train/run_on_gpu.sh runs both).
#include <fmt/format.h>
#include <gtest/gtest.h>

#include <algorithm>
#include <cstdlib>
#include <filesystem>

#include "cuda_fixture.h"

namespace primus::backends::cuda::testing {
namespace {

// The per-tensor gradient gate, a rule derived from a measurement rather than a hand-picked
// number:
//   gate = max(kGateFloor, kGateMargin x W)
// W: the worst per-tensor gradient relative L2 (same metric, same tensor list as this test)
// that PyTorch trains with in bf16 -- torch.autocast(cuda, bfloat16) with fp32 master weights
// and transformers' default (SDPA) attention -- shows against PyTorch fp32, on these tiny
// models with step0_parity's weights and batches, worst over the tensors and over seeds 1..4
// ("autocast" row of bf16_noise_floor.py's summary; it prints the resulting gate too). Our bf16
// model cannot be expected to beat the precision PyTorch's own bf16 recipe has on the same
// problem; the margin covers the seed-to-seed spread (this test draws a fresh seed per run) and
// our different but equally valid bf16 rounding points.
//
// W measured on an NVIDIA H100 80GB HBM3 (torch 2.11.0+cu130, transformers 5.17.0):
// the mapping check passed (reference vs torch fp32 <= 2.2e-6), autocast's worst per seed was
// GPT-2 8.7e-3..9.8e-3 and Llama 1.74e-2..1.89e-2 (ours, same seeds: 1.0e-2..1.1e-2 and
// 1.78e-2..2.04e-2). Gates: GPT-2 max(2e-2, 1.47e-2) = 2e-2; Llama 1.5 x 1.885e-2 = 2.83e-2.
constexpr double kTorchAutocastWorstGpt2 = 9.82e-3;
constexpr double kTorchAutocastWorstLlama = 1.885e-2;
constexpr double kGateFloor = 2e-2;  // never below the former gate
constexpr double kGateMargin = 1.5;

double gradient_gate(bool llama) {
  return std::max(kGateFloor, kGateMargin * (llama ? kTorchAutocastWorstLlama : kTorchAutocastWorstGpt2));
}

struct ModelCase {
  bool llama;
  Attn attn;
};

class ModelParityTest : public CudaGpuTest, public ::testing::WithParamInterface<ModelCase> {};

TEST_P(ModelParityTest, LossAndEveryGradientMatchReference) {
  const auto [llama, attn] = GetParam();
  const unsigned seed = std::random_device{}();
  SCOPED_TRACE(fmt::format("seed {}", seed));
  const Step0 r = step0_parity(llama, attn, turbo::Device::CUDA, seed);
  EXPECT_NEAR(r.loss, r.ref_loss, 1e-2 * r.ref_loss) << "step-0 loss";
  const double gate = gradient_gate(llama);
  std::string table;
  double worst = 0;
  for (const auto& [name, e] : r.errors) {
    worst = std::max(worst, e);
    table += fmt::format("  {:<28} {:.2e}  gate {:.2e}  {}\n", name, e, gate, e < gate ? "ok" : "ABOVE GATE");
    EXPECT_LT(e, gate) << name << ": gradient relative L2 above the gate (rule in model_parity_test.cpp)";
  }
  std::printf("[%s, attention %s] seed %u, loss cuda %.6f ref %.6f; gradient relative L2 per tensor "
              "(worst %.2e, gate %.2e):\n%s",
              llama ? "llama" : "gpt2", attn_name(attn).c_str(), seed, r.loss, r.ref_loss, worst, gate,
              table.c_str());
  EXPECT_NEAR(r.eval_loss, r.loss, 1e-5 * r.loss) << "a forward without gradient gives the same loss";
  EXPECT_TRUE(r.eval_kept_grads) << "a forward without gradient must not touch the gradients";
}

INSTANTIATE_TEST_SUITE_P(Cuda, ModelParityTest,
                         ::testing::Values(ModelCase{false, Attn::Default}, ModelCase{false, Attn::Fallback},
                                           ModelCase{true, Attn::Default}, ModelCase{true, Attn::Fallback}),
                         [](const auto& info) {
                           return std::string(info.param.llama ? "Llama" : "Gpt2") +
                                  (info.param.attn == Attn::Default ? "Default" : "Fallback");
                         });

// MoE layers on the device against the reference. Routing is discrete: a token whose k-th and
// (k+1)-th scores are within bf16 rounding of each other (the router reads bf16 activations) may
// go to the other expert, which changes that token's path and, through attention, the later
// layers' inputs of the tokens after it. So: in the first MoE layer (inputs apart by bf16
// arithmetic alone) the routing equals the reference's except for near-ties (at most 10% of the
// tokens, each at a gap below 0.05 in the reference's own scores: the experts' scores, or under
// group-limited routing the groups' where the chosen groups differ), over all layers at most 10%
// of the token decisions differ, and on the same routing (the reference re-run on ours,
// step0_parity) the step-0 loss is within the bf16 gate and every gradient within Llama's gate
// (the MoE model is the tiny Llama with MoE feed-forward layers). Measured on an H100 over 30 to 60
// seeds each: gaps up to 0.022 (Mixtral's logits), 0.020 (Qwen3-MoE's, with one seed above
// 0.03 in an earlier call) and 0.014 (DeepSeek's group sums of sigmoid scores), where a wrong
// choice would show the logits' spread (estimated at about 0.2 at initialisation); up to 10 of 256 tokens
// rerouted in DeepSeek's first MoE layer, which follows a dense layer and whose near-equal sigmoid
// scores at initialisation make near-ties common. Taken at the experts alone, DeepSeek's gaps read
// up to 0.08: a group chosen at a near-tie brings experts whose own scores lie far apart.
class MoeParityTest : public CudaGpuTest, public ::testing::WithParamInterface<bool> {};

int64_t spec_moe_layers(bool deepseek) { return tiny_moe_spec(deepseek).num_moe_layers(); }

Step0 check_moe_parity(const train::ModelSpec& spec, bool deepseek) {
  const unsigned seed = std::random_device{}();
  SCOPED_TRACE(fmt::format("seed {}", seed));
  const Step0 r = step0_parity(spec, Attn::Default, turbo::Device::CUDA, seed);
  EXPECT_NEAR(r.loss, r.ref_loss, 1e-2 * r.ref_loss) << "step-0 loss";
  const int64_t tokens = 4 * 64;
  EXPECT_LE(r.rerouted_first_layer, tokens / 10) << "tokens the first MoE layer routed differently";
  EXPECT_LE(r.rerouted_tokens, tokens * spec_moe_layers(deepseek) / 10) << "token decisions differing over all layers";
  EXPECT_LT(r.max_gap, 0.05) << "a token went elsewhere although the reference's scores were not near a tie";
  if (r.rerouted_tokens == 0) {
    EXPECT_EQ(r.expert_load, r.ref_expert_load);
  }
  const double gate = gradient_gate(true);
  std::string table;
  double worst = 0;
  for (const auto& [name, e] : r.errors) {
    worst = std::max(worst, e);
    table += fmt::format("  {:<36} {:.2e}  gate {:.2e}  {}\n", name, e, gate, e < gate ? "ok" : "ABOVE GATE");
    EXPECT_LT(e, gate) << name;
  }
  std::printf("[%s MoE] seed %u, loss cuda %.6f ref %.6f, %lld token decision(s) rerouted (%lld in the first MoE "
              "layer, largest gap there %.2e); gradient relative L2 per tensor (worst %.2e):\n%s",
              deepseek ? "deepseek" : "mixtral", seed, r.loss, r.ref_loss, static_cast<long long>(r.rerouted_tokens),
              static_cast<long long>(r.rerouted_first_layer), r.max_gap, worst, table.c_str());
  return r;
}

TEST_P(MoeParityTest, RoutingLossAndEveryGradientMatchReference) {
  check_moe_parity(tiny_moe_spec(GetParam()), GetParam());
}

// DeepSeek-V3's sequence-wise balance loss (each sequence's own counts) on the device: the same
// bounds, with an aux coefficient large enough that the router's gradient is mostly the aux
// term's, and every layer's logged aux and z loss within 1% of the reference's.
TEST_P(MoeParityTest, SequenceWiseAuxLossMatchesReference) {
  train::ModelSpec spec = tiny_moe_spec(GetParam());
  spec.moe.set_balance(train::MoeSpec::Balance::Sequence, 1.0);
  const Step0 r = check_moe_parity(spec, GetParam());
  ASSERT_EQ(r.moe_losses.size(), r.ref_moe_losses.size());
  ASSERT_EQ(r.moe_losses.size(), 2 * static_cast<size_t>(spec.num_moe_layers()));
  for (size_t i = 0; i < r.moe_losses.size(); ++i) {
    EXPECT_EQ(r.moe_losses[i].first, r.ref_moe_losses[i].first);
    EXPECT_NEAR(r.moe_losses[i].second, r.ref_moe_losses[i].second, 1e-2 * std::fabs(r.ref_moe_losses[i].second))
        << r.moe_losses[i].first;
  }
}

INSTANTIATE_TEST_SUITE_P(Cuda, MoeParityTest, ::testing::Bool(),
                         [](const auto& info) { return std::string(info.param ? "DeepSeek" : "Mixtral"); });

// Qwen3's attention on the device (heads of 64 apart from the width of 128, per-head q/k norms
// by Turbo's head_norm kernels before RoPE), dense and MoE, against the reference: the step-0
// loss within the bf16 gate and every gradient, the two norm weights' included, within Llama's
// gate. The MoE case takes the routing bounds of MoeParityTest (near-ties may go the other way
// under bf16; the gradients are then against the reference on our routing).
class Qwen3ParityTest : public CudaGpuTest, public ::testing::WithParamInterface<bool> {};

TEST_P(Qwen3ParityTest, LossAndEveryGradientMatchReference) {
  const bool moe = GetParam();
  const unsigned seed = std::random_device{}();
  SCOPED_TRACE(fmt::format("seed {}", seed));
  const train::ModelSpec spec = tiny_qwen3_spec(moe);
  const Step0 r = step0_parity(spec, Attn::Default, turbo::Device::CUDA, seed);
  EXPECT_NEAR(r.loss, r.ref_loss, 1e-2 * r.ref_loss) << "step-0 loss";
  if (moe) {
    const int64_t tokens = 4 * spec.seq_length;
    EXPECT_LE(r.rerouted_first_layer, tokens / 10);
    EXPECT_LE(r.rerouted_tokens, tokens * spec.num_moe_layers() / 10);
    EXPECT_LT(r.max_gap, 0.05);
  }
  const double gate = gradient_gate(true);
  std::string table;
  double worst = 0;
  int qk_norms = 0;
  for (const auto& [name, e] : r.errors) {
    worst = std::max(worst, e);
    qk_norms += name.find(".attn.q_norm.") != std::string::npos || name.find(".attn.k_norm.") != std::string::npos;
    table += fmt::format("  {:<36} {:.2e}  gate {:.2e}  {}\n", name, e, gate, e < gate ? "ok" : "ABOVE GATE");
    EXPECT_LT(e, gate) << name;
  }
  EXPECT_EQ(qk_norms, 2 * spec.num_layers);
  std::printf("[qwen3%s] seed %u, loss cuda %.6f ref %.6f, %lld token decision(s) rerouted (%lld in the first MoE "
              "layer, largest gap there %.2e); gradient relative L2 per tensor (worst %.2e):\n%s",
              moe ? " MoE" : "", seed, r.loss, r.ref_loss, static_cast<long long>(r.rerouted_tokens),
              static_cast<long long>(r.rerouted_first_layer), r.max_gap, worst, table.c_str());
  EXPECT_NEAR(r.eval_loss, r.loss, 1e-5 * r.loss) << "a forward without gradient gives the same loss";
}

INSTANTIATE_TEST_SUITE_P(Cuda, Qwen3ParityTest, ::testing::Bool(),
                         [](const auto& info) { return std::string(info.param ? "Moe" : "Dense"); });

// [hf] item 2 on the device: Qwen2's q/k/v-only bias (bias in the qkv GEMM's epilogue, its
// gradient a column sum of dq|dk|dv) and OLMoE's q/k RMSNorms over the whole projection (the
// norm op over dense copies of the packed columns), dense and every layer MoE; Qwen3's gates.
struct FamilyCase {
  const char* name;
  train::ModelSpec (*spec)();
};
class FamilyParityTest : public CudaGpuTest, public ::testing::WithParamInterface<FamilyCase> {};

TEST_P(FamilyParityTest, LossAndEveryGradientMatchReference) {
  const unsigned seed = std::random_device{}();
  SCOPED_TRACE(fmt::format("seed {}", seed));
  const train::ModelSpec spec = GetParam().spec();
  const Step0 r = step0_parity(spec, Attn::Default, turbo::Device::CUDA, seed);
  EXPECT_NEAR(r.loss, r.ref_loss, 1e-2 * r.ref_loss) << "step-0 loss";
  if (spec.moe.enabled()) {
    const int64_t tokens = 4 * spec.seq_length;
    EXPECT_LE(r.rerouted_first_layer, tokens / 10);
    EXPECT_LE(r.rerouted_tokens, tokens * spec.num_moe_layers() / 10);
    EXPECT_LT(r.max_gap, 0.05);
  }
  const double gate = gradient_gate(true);
  std::string table;
  double worst = 0;
  int extra = 0;
  for (const auto& [name, e] : r.errors) {
    worst = std::max(worst, e);
    extra += name.find(".attn.qkv.bias") != std::string::npos || name.find(".attn.q_norm.") != std::string::npos ||
             name.find(".attn.k_norm.") != std::string::npos;
    table += fmt::format("  {:<36} {:.2e}  gate {:.2e}  {}\n", name, e, gate, e < gate ? "ok" : "ABOVE GATE");
    EXPECT_LT(e, gate) << name;
  }
  EXPECT_EQ(extra, (spec.qk_layernorm ? 2 : 1) * spec.num_layers);
  std::printf("[%s] seed %u, loss cuda %.6f ref %.6f, %lld token decision(s) rerouted; gradient relative L2 per "
              "tensor (worst %.2e):\n%s",
              GetParam().name, seed, r.loss, r.ref_loss, static_cast<long long>(r.rerouted_tokens), worst,
              table.c_str());
  EXPECT_NEAR(r.eval_loss, r.loss, 1e-5 * r.loss) << "a forward without gradient gives the same loss";
}

INSTANTIATE_TEST_SUITE_P(Cuda, FamilyParityTest,
                         ::testing::Values(FamilyCase{"Qwen2", [] { return tiny_qwen2_spec(); }},
                                           FamilyCase{"DenseWholeQkNorm", [] { return tiny_olmoe_spec(false); }},
                                           FamilyCase{"Olmoe", [] { return tiny_olmoe_spec(true); }}),
                         [](const auto& info) { return std::string(info.param.name); });

// Dump mode for bf16_noise_floor.py: every case for fixed seeds 1..N (reproducible), into
// $PRIMUS_PARITY_DUMP. Gates nothing (ModelParityTest does); prints the worst error per run.
class ParityDump : public CudaGpuTest {};

TEST_F(ParityDump, EveryCaseSeveralSeeds) {
  const std::string root = parity_dump_root();
  if (root.empty()) GTEST_SKIP() << "set PRIMUS_PARITY_DUMP=<dir> to write the noise-floor dumps";
  const char* env = std::getenv("PRIMUS_PARITY_DUMP_SEEDS");
  const int seeds = env && *env ? std::atoi(env) : 4;
  ASSERT_GT(seeds, 0);
  for (bool llama : {false, true}) {
    for (Attn attn : {Attn::Default, Attn::Fallback}) {
      for (int s = 1; s <= seeds; ++s) {
        const Step0 r = step0_parity(llama, attn, turbo::Device::CUDA, unsigned(s), root);
        double worst = 0;
        for (const auto& [name, e] : r.errors) worst = std::max(worst, e);
        EXPECT_TRUE(std::filesystem::exists(std::filesystem::path(r.dump_dir) / "parity.json")) << r.dump_dir;
        std::printf("[dump %s, attention %s] seed %d: loss cuda %.6f ref %.6f, worst gradient relative L2 %.2e -> %s\n",
                    llama ? "llama" : "gpt2", attn_name(attn).c_str(), s, r.loss, r.ref_loss, worst,
                    r.dump_dir.c_str());
      }
    }
  }
}

}  // namespace
}  // namespace primus::backends::cuda::testing
