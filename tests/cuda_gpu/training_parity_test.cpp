// 200 training steps (issue [cuda]'s Show list) of the CUDA backend on the device against the reference backend (fp32 CPU),
// from the same bf16-representable initial weights on the same tinyshakespeare batches, with
// the trainers' optimizer recipe (see training_curves). Gate: at every step
// |loss_cuda - loss_ref| / loss_ref < 2%; the reference must learn (lose > 0.5 nats), so the
// comparison is of learning curves, not of two flat lines.
#include <gtest/gtest.h>

#include "cuda_fixture.h"

namespace primus::backends::cuda::testing {
namespace {

struct TrainingCase {
  bool llama;
  Attn attn;
};

class TrainingParityTest : public CudaGpuTest, public ::testing::WithParamInterface<TrainingCase> {};

TEST_P(TrainingParityTest, TwoHundredStepsFollowTheReferenceCurve) {
  const auto [llama, attn] = GetParam();
  const auto [curve, ref] = training_curves(llama, attn, turbo::Device::CUDA, 200);
  double worst = 0;
  for (size_t s = 0; s < curve.size(); ++s) {
    const double rel = std::fabs(curve[s] - ref[s]) / ref[s];
    worst = std::max(worst, rel);
    EXPECT_LT(rel, 0.02) << "step " << s << ": cuda " << curve[s] << " reference " << ref[s];
  }
  std::printf("[%s, attention %s] loss cuda / reference: step 0 %.4f / %.4f, step 99 %.4f / %.4f, step 199 %.4f / "
              "%.4f; worst relative difference %.2e\n",
              llama ? "llama" : "gpt2", attn_name(attn).c_str(), curve[0], ref[0], curve[99], ref[99], curve[199],
              ref[199], worst);
  EXPECT_LT(ref.back(), ref.front() - 0.5) << "the reference must learn, or the comparison says nothing";
}

// FP8 (patch cuda.linear.fp8, per-tensor current scaling) on the same 200 steps. FP8 rounding
// (E4M3: 3 mantissa bits, E5M2: 2) is far coarser than bf16's 8, so the gate is wider than the bf16
// curves' 2%: 4% at every step, and the mean difference over the last 100 steps below 2% (FP8
// training must follow the curve, not just stay near it at the start).
class Fp8TrainingParityTest : public CudaGpuTest, public ::testing::WithParamInterface<std::pair<bool, const char*>> {};

// FP8's gate on a 200-step curve: every step within 4% of the reference, the mean over steps
// 100-199 within 2%. Returns {worst, mean over the tail}.
std::pair<double, double> expect_fp8_curve(const std::vector<double>& curve, const std::vector<double>& ref) {
  double worst = 0, tail = 0;
  for (size_t s = 0; s < curve.size(); ++s) {
    const double rel = std::fabs(curve[s] - ref[s]) / ref[s];
    worst = std::max(worst, rel);
    if (s >= 100) tail += rel / 100.0;
    EXPECT_LT(rel, 0.04) << "step " << s << ": fp8 " << curve[s] << " reference " << ref[s];
  }
  EXPECT_LT(tail, 0.02);
  return {worst, tail};
}

// "format" or "format/scaling"; fp8_recipe delayed keeps a 16-step history and takes its largest
// entry; the inputs are saved in FP8 for the backward, and the SwiGLU hands its maxima (rowwise,
// tensorwise) or is folded into the quantizers (delayed), as the trainer does.
TEST_P(Fp8TrainingParityTest, TwoHundredStepsFollowTheReferenceCurve) {
  const auto [llama, recipe_name] = GetParam();
  const std::string name = recipe_name, format = name.substr(0, name.find('/'));
  const std::string scaling = name.find('/') == std::string::npos ? "tensorwise" : name.substr(name.find('/') + 1);
  const turbo::Fp8Recipe recipe = fp8_test_recipe(format.c_str(), scaling.c_str(),
                                                  {.saved = true, .maxima = true, .producers = true, .delayed = {16, turbo::Fp8AmaxAlgo::Max}});
  const auto [curve, ref] = training_curves(llama, Attn::Default, turbo::Device::CUDA, 200, &recipe);
  const auto [worst, tail] = expect_fp8_curve(curve, ref);
  std::printf("[%s, fp8 %s] loss cuda / reference: step 0 %.4f / %.4f, step 99 %.4f / %.4f, step 199 %.4f / "
              "%.4f; worst relative difference %.2e, mean over steps 100-199 %.2e\n",
              llama ? "llama" : "gpt2", recipe_name, curve[0], ref[0], curve[99], ref[99], curve[199], ref[199], worst,
              tail);
}

INSTANTIATE_TEST_SUITE_P(Cuda, Fp8TrainingParityTest,
                         ::testing::Values(std::pair<bool, const char*>{false, "hybrid"},
                                           std::pair<bool, const char*>{true, "hybrid"},
                                           std::pair<bool, const char*>{true, "e4m3"},
                                           std::pair<bool, const char*>{true, "hybrid/rowwise"},
                                           std::pair<bool, const char*>{false, "hybrid/delayed"},
                                           std::pair<bool, const char*>{true, "hybrid/delayed"}),
                         [](const auto& info) {
                           std::string s = std::string(info.param.first ? "Llama" : "Gpt2") + "_" + info.param.second;
                           for (char& c : s) c = c == '/' ? '_' : c;
                           return s;
                         });

INSTANTIATE_TEST_SUITE_P(Cuda, TrainingParityTest,
                         ::testing::Values(TrainingCase{false, Attn::Default}, TrainingCase{true, Attn::Default},
                                           TrainingCase{false, Attn::Fallback}, TrainingCase{true, Attn::Fallback}),
                         [](const auto& info) {
                           return std::string(info.param.llama ? "Llama" : "Gpt2") +
                                  (info.param.attn == Attn::Default ? "Default" : "Fallback");
                         });

}  // namespace
}  // namespace primus::backends::cuda::testing

namespace primus::backends::cuda::testing {
namespace {

// The tiny MoE models' 200 steps against the reference curve. Routing makes a bf16 curve chaotic
// once near-tied expert choices flip: on an H200 (2026-12-02) the Mixtral-style run was 3.19% off the
// reference at its worst step, the same run on the fallback attention 2.91%, and the two bf16 runs
// 2.34% apart, while the mean difference over steps 100-199 was 0.60% (fallback 0.66%). So the
// gate is bf16's own spread measured in the same test: every step within 2% or 1.5x the largest
// distance between the two attention kernels' curves, whichever is larger, and the mean over the
// last 100 steps within 1% (a kernel fault moves the whole curve, not single steps).
class MoeTrainingParityTest : public CudaGpuTest, public ::testing::WithParamInterface<bool> {};

TEST_P(MoeTrainingParityTest, TwoHundredStepsFollowTheReferenceCurve) {
  const bool deepseek = GetParam();
  const auto [curve, ref] = training_curves(tiny_moe_spec(deepseek), Attn::Default, turbo::Device::CUDA, 200);
  const auto other = training_curves(tiny_moe_spec(deepseek), Attn::Fallback, turbo::Device::CUDA, 200).first;
  double worst = 0, worst_other = 0, spread = 0, mean = 0, mean_other = 0;
  for (size_t s = 0; s < curve.size(); ++s) {
    spread = std::max(spread, std::fabs(other[s] - curve[s]) / ref[s]);
    worst_other = std::max(worst_other, std::fabs(other[s] - ref[s]) / ref[s]);
  }
  const double gate = std::max(0.02, 1.5 * spread);
  for (size_t s = 0; s < curve.size(); ++s) {
    const double rel = std::fabs(curve[s] - ref[s]) / ref[s];
    worst = std::max(worst, rel);
    if (s >= 100) {
      mean += rel / 100.0;
      mean_other += std::fabs(other[s] - ref[s]) / ref[s] / 100.0;
    }
    EXPECT_LT(rel, gate) << "step " << s << ": cuda " << curve[s] << " reference " << ref[s] << " (fallback attention "
                         << other[s] << ")";
  }
  EXPECT_LT(mean, 0.01) << "the mean difference over steps 100-199";
  std::printf("[%s MoE] loss step 0 %.4f/%.4f, 199 %.4f/%.4f (cuda/reference); worst relative difference %.2e "
              "(gate %.2e: the two attention kernels' curves %.2e apart; fallback vs reference %.2e); mean over "
              "steps 100-199 %.2e (fallback %.2e)\n",
              deepseek ? "deepseek" : "mixtral", curve[0], ref[0], curve[199], ref[199], worst, gate, spread,
              worst_other, mean, mean_other);
}

INSTANTIATE_TEST_SUITE_P(Cuda, MoeTrainingParityTest, ::testing::Bool(),
                         [](const auto& info) { return std::string(info.param ? "DeepSeek" : "Mixtral"); });

// FP8 experts (hybrid rowwise, e4m3 blockwise, hybrid tensorwise or delayed: the FP8 grouped GEMM on
// the device) with the dense linears in FP8 too: the tiny MoE models' 200-step curves within FP8's gate
// of the fp32 reference, as for the dense models (Fp8TrainingParityTest). Blockwise on the 128-wide
// tiny MoE.
class Fp8MoeTrainingParityTest : public CudaGpuTest,
                                 public ::testing::WithParamInterface<std::tuple<bool, std::string>> {};

TEST_P(Fp8MoeTrainingParityTest, TwoHundredStepsFollowTheReferenceCurve) {
  const auto& [deepseek, scaling_name] = GetParam();
  const char* scaling = scaling_name.c_str();
  const bool block = scaling_name == "blockwise";
  const char* format = block ? "e4m3" : "hybrid";  // DeepSeek-V3's blockwise recipe is E4M3 throughout
  const turbo::Fp8Recipe recipe = fp8_test_recipe(format, scaling, {.saved = true});
  const train::ModelSpec spec = block ? tiny_moe_spec_128(deepseek) : tiny_moe_spec(deepseek);
  const auto [curve, ref] = training_curves(spec, Attn::Default, turbo::Device::CUDA, 200, &recipe);
  const auto [worst, tail] = expect_fp8_curve(curve, ref);
  std::printf("[%s MoE, fp8 %s/%s experts] loss cuda / reference: step 0 %.4f / %.4f, step 199 %.4f / %.4f; "
              "worst relative difference %.2e, mean over steps 100-199 %.2e\n",
              deepseek ? "deepseek" : "mixtral", format, scaling, curve[0], ref[0], curve[199], ref[199], worst, tail);
}

INSTANTIATE_TEST_SUITE_P(Cuda, Fp8MoeTrainingParityTest,
                         ::testing::Combine(::testing::Bool(),
                                            ::testing::Values(std::string("rowwise"), std::string("blockwise"),
                                                              std::string("tensorwise"), std::string("delayed"))),
                         [](const auto& info) {
                           std::string s = std::get<1>(info.param);
                           s[0] = static_cast<char>(s[0] - 'a' + 'A');
                           return std::string(std::get<0>(info.param) ? "DeepSeek" : "Mixtral") + s;
                         });

}  // namespace
}  // namespace primus::backends::cuda::testing
