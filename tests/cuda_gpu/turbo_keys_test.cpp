// Primus-Turbo's switches on the cuda backend (backends/cuda/turbo_keys.h), without a GPU: what an
// experiment written for Primus sets carries over, what is not built here is refused naming the
// key and where it was set, and the backend selections reach Turbo's dispatcher (the environment
// winning over the config).
#include <gtest/gtest.h>

#include <cstdlib>

#include "backends/cuda/register.h"
#include "tests/cuda_gpu/cuda_schema.h"
#include "backends/cuda/turbo_keys.h"
#include "core/backend/backend.h"
#include "core/config/yaml_loader.h"
#include "core/patches/registry.h"
#include "core/util/error.h"
#include "turbo/dispatch/backend_manager.h"

namespace primus::backends::cuda {
namespace {

// The cuda backend's schema defaults under `yaml` (as the experiment's overrides), checked.
TurboSelection check(const std::string& yaml, std::string& attention_backend) {
  const config::Value v = testing::cuda_config(yaml);
  attention_backend = v.find_path("attention_backend")->as_string();
  return check_turbo_keys(v, attention_backend);
}

std::string refusal(const std::string& yaml) {
  std::string attention;
  try {
    check(yaml, attention);
  } catch (const ConfigError& e) {
    return e.what();
  }
  return "(accepted)";
}

TEST(TurboKeys, PrimusTurboBlockCarriesOver) {
  std::string attention;
  const TurboSelection sel = check(
      "enable_primus_turbo: true\nuse_turbo_attention: true\nuse_turbo_grouped_mlp: true\n"
      "use_turbo_parallel_linear: true\nuse_turbo_rms_norm: true\nmoe_use_fused_router_with_aux_score: true\n"
      "use_turbo_fused_act_with_probs: true\nuse_turbo_deepep: false\nturbo_deepep_num_cu: 32\n"
      "turbo_sync_free_moe_stage: 3\nnum_experts: 8\nturbo_gemm_backend: fp8:TURBO,other:CUBLASLT\n"
      "use_turbo_autotune: true\n",
      attention);
  EXPECT_EQ(attention, "turbo");  // use_turbo_attention: true asks for Turbo's op, as attention_backend: turbo
  EXPECT_EQ(sel.gemm_backend, "fp8:TURBO,other:CUBLASLT");
  EXPECT_EQ(sel.grouped_gemm_backend, "");  // default: the op's own
  EXPECT_TRUE(sel.autotune);
  EXPECT_EQ(sel.gemm_key, "turbo_gemm_backend");

  // Not written: attention_backend keeps its value, and Primus' word "default" names no backend.
  const TurboSelection plain = check("turbo_gemm_backend: default\nattention_backend: fallback\n", attention);
  EXPECT_EQ(attention, "fallback");
  EXPECT_EQ(plain.gemm_backend, "");
  EXPECT_FALSE(plain.autotune);
  // Primus' examples turn Turbo's attention and grouped GEMM off: on NVIDIA GPUs Transformer Engine's
  // attention is cuDNN's, as Turbo's op is by default, and a dense model has no experts; Transformer
  // Engine's linear GEMMs are cuBLASLt's.
  const TurboSelection te = check("use_turbo_attention: false\nuse_turbo_grouped_mlp: false\nuse_turbo_gemm: false\n",
                                  attention);
  EXPECT_EQ(attention, "auto");
  EXPECT_EQ(te.gemm_backend, "CUBLASLT");
  EXPECT_EQ(te.gemm_key, "use_turbo_gemm: false");
  // The grouped GEMM's cuBLASLt loop runs where the step is not captured.
  EXPECT_EQ(check("turbo_grouped_gemm_backend: CUBLASLT\ncuda_graph: false\n", attention).grouped_gemm_backend,
            "CUBLASLT");
}

TEST(TurboKeys, WhatIsNotBuiltHereIsRefusedNamingTheKeyAndWhere) {
  const std::pair<const char*, const char*> cases[] = {
      {"enable_primus_turbo: false\n", "exp.yaml:1:22: enable_primus_turbo: false is not implemented"},
      {"use_turbo_grouped_mlp: false\nnum_experts: 8\n", "exp.yaml:1:24: use_turbo_grouped_mlp: false with experts"},
      {"use_turbo_grouped_mlp: true\nuse_turbo_grouped_gemm: false\n", "are one switch with two names"},
      {"use_turbo_gemm: false\nturbo_gemm_backend: TURBO\n", "use_turbo_gemm: false asks for cuBLASLt's GEMMs"},
      {"use_turbo_deepep: true\n", "DeepEP is not implemented"},
      {"turbo_deepep_num_cu: 64\n", "turbo_deepep_num_cu: 64 is not implemented"},
      {"use_sink_attention: true\n", "attention sinks are not implemented"},
      {"sink_sliding_window: 128\n", "sink_sliding_window: 128 is not implemented"},
      {"mxfp4_gradient_stochastic_rounding: true\n", "MXFP4 is not implemented"},
      {"turbo_mega_moe_precision: mxfp8\n", "turbo_mega_moe_precision: mxfp8 is not implemented"},
      {"te_precision_config_file: te.json\n", "exp.yaml:1:27: te_precision_config_file: there is no Transformer"},
      {"use_turbo_attention: true\nattention_backend: fallback\n", "exp.yaml:2:20 sets attention_backend: fallback"},
      {"turbo_gemm_backend: hipblaslt\n", "'hipblaslt' names Primus-Turbo's AMD backends"},
      {"turbo_gemm_backend: fp4:aiter,other:CUBLASLT\n", "names Primus-Turbo's AMD backends or precisions (aiter)"},
      {"turbo_gemm_backend: CUDNN\n", "CUDNN does not run the gemm op on the GPU"},
      {"turbo_gemm_backend: fp8:TURBO,,bf16:CUBLASLT\n", "empty entry"},
      {"turbo_grouped_gemm_backend: AUTOTUNE\n", "the grouped GEMM is not timed per shape"},
      {"turbo_grouped_gemm_backend: CUBLASLT\n", "set cuda_graph: false with it"},
      {"turbo_sync_free_moe_stage: 1\nnum_experts: 8\nexpert_model_parallel_size: 2\n",
       "with expert parallelism the token dispatch reads each layer's counts on the host"},
      {"turbo_sync_free_moe_stage: 2\nnum_experts: 8\nmoe_grouped_gemm: false\n",
       "moe_grouped_gemm: false reads the group sizes on the host"},
  };
  for (const auto& [yaml, message] : cases) {
    const std::string why = refusal(yaml);
    EXPECT_NE(why.find(message), std::string::npos) << yaml << " -> " << why;
  }
  // A stage of a dense model, or stage 0 beside expert parallelism, asks nothing of a host sync.
  EXPECT_EQ(refusal("turbo_sync_free_moe_stage: 3\n"), "(accepted)");
  EXPECT_EQ(refusal("turbo_sync_free_moe_stage: 0\nnum_experts: 8\nexpert_model_parallel_size: 2\n"), "(accepted)");
}

class TurboSelectionApplied : public ::testing::Test {
 protected:
  void SetUp() override { clear(); }
  void TearDown() override { clear(); }
  static void clear() {
    unsetenv("PRIMUS_TURBO_GEMM_BACKEND");
    unsetenv("PRIMUS_TURBO_GROUPED_GEMM_BACKEND");
    unsetenv("PRIMUS_TURBO_AUTO_TUNE");
    turbo::GlobalBackendManager::instance().reset();
  }
};

TEST_F(TurboSelectionApplied, SetsTheDispatcherAndClearsWhatAnEarlierRunSet) {
  auto& m = turbo::GlobalBackendManager::instance();
  TurboSelection sel;
  sel.gemm_backend = "fp8:TURBO,other:CUBLASLT";
  sel.grouped_gemm_backend = "TURBO";
  sel.autotune = true;
  apply_turbo_selection(sel);
  auto fp8 = m.user_choice("gemm", turbo::Precision::FP8);
  auto bf16 = m.user_choice("gemm", turbo::Precision::BF16);
  auto grouped = m.user_choice("grouped_gemm", turbo::Precision::BF16);
  ASSERT_TRUE(fp8 && bf16 && grouped);
  EXPECT_EQ(fp8->choice.backend, turbo::BackendType::TURBO);
  EXPECT_EQ(bf16->choice.backend, turbo::BackendType::CUBLASLT);
  EXPECT_EQ(grouped->choice.backend, turbo::BackendType::TURBO);
  EXPECT_EQ(bf16->source, "set_backend");
  EXPECT_TRUE(m.auto_tune_enabled());

  // A later run of the process whose config names nothing leaves each op to its default.
  apply_turbo_selection(TurboSelection{});
  EXPECT_FALSE(m.user_choice("gemm", turbo::Precision::FP8).has_value());
  EXPECT_FALSE(m.user_choice("grouped_gemm", turbo::Precision::BF16).has_value());
  EXPECT_FALSE(m.auto_tune_enabled());
}

TEST_F(TurboSelectionApplied, TheEnvironmentWinsOverTheConfig) {
  auto& m = turbo::GlobalBackendManager::instance();
  setenv("PRIMUS_TURBO_GEMM_BACKEND", "TURBO", 1);
  setenv("PRIMUS_TURBO_AUTO_TUNE", "0", 1);
  TurboSelection sel;
  sel.gemm_backend = "CUBLASLT";
  sel.autotune = true;
  apply_turbo_selection(sel);
  auto bf16 = m.user_choice("gemm", turbo::Precision::BF16);
  ASSERT_TRUE(bf16.has_value());
  EXPECT_EQ(bf16->choice.backend, turbo::BackendType::TURBO);
  EXPECT_EQ(bf16->source, "PRIMUS_TURBO_GEMM_BACKEND");
  EXPECT_FALSE(m.auto_tune_enabled());
}

}  // namespace
}  // namespace primus::backends::cuda
