// The model presets of issue [reference] (configs/models/{gpt2,llama}/*.yaml) resolve through the
// real binary to the shapes and parameter counts of the models they name (Hugging Face counts:
// GPT-2 124,439,808 and 354,823,168; Meta-Llama-3-8B 8,030,261,248).
#include <gtest/gtest.h>

#include "cli_runner.h"

using primus::testing::run_primus;
using primus::testing::Workdir;

TEST(Presets, EveryModelPresetResolvesToItsKnownSize) {
  struct Case {
    std::string preset, summary;
  };
  const Case cases[] = {
      {"gpt2/tiny", "gpt2 2 layers, hidden 64, heads 4/4, 124672 parameters"},
      {"gpt2/124M", "gpt2 12 layers, hidden 768, heads 12/12, 124439808 parameters"},
      {"gpt2/350M", "gpt2 24 layers, hidden 1024, heads 16/16, 354823168 parameters"},
      {"llama/tiny", "llama 2 layers, hidden 64, heads 4/2, 131392 parameters"},
      {"llama/llama3.2-1B", "llama 16 layers, hidden 2048, heads 32/8, 1498482688 parameters"},
      {"llama/llama3-8B", "llama 32 layers, hidden 4096, heads 32/8, 8030261248 parameters"},
      // Qwen3: heads of 128 apart from the width, query/key norms; counts from the released
      // config.json files (tests/train/moe_spec_test.cpp works them out).
      {"qwen3/tiny", "qwen3 2 layers, hidden 64, heads 4/2 of 24, qk norm, 143776 parameters"},
      {"qwen3/qwen3-0.6B", "qwen3 28 layers, hidden 1024, heads 16/8 of 128, qk norm, 596049920 parameters"},
      {"qwen3/qwen3-1.7B", "qwen3 28 layers, hidden 2048, heads 16/8, qk norm, 1720574976 parameters"},
      // Qwen2.5 (q/k/v biases) and Mistral (sliding window): transformers' counts of the released
      // configs (tests/reference/hf_families_test.cpp works the Qwen2.5 ones out).
      {"qwen2/tiny", "qwen2 2 layers, hidden 64, heads 4/2, qkv bias, 131648 parameters"},
      {"qwen2/qwen2.5-0.5B", "qwen2 24 layers, hidden 896, heads 14/2, qkv bias, 494032768 parameters"},
      {"qwen2/qwen2.5-1.5B", "qwen2 28 layers, hidden 1536, heads 12/2, qkv bias, 1543714304 parameters"},
      {"mistral/tiny", "mistral 2 layers, hidden 64, heads 4/2, sliding window 32, 131392 parameters"},
      {"mistral/mistral-7B-v0.1", "mistral 32 layers, hidden 4096, heads 32/8, sliding window 4096, 7241732096 "
                                  "parameters"},
      // MoE: the bench shapes of ../shared/bench/torch_moe_anchor.py (its parameter counts), the
      // released Mixtral-8x7B (transformers' count; 12,879,925,248 active with the embedding),
      // OLMoE-1B-7B (transformers' 6,919,161,856, its whole-projection query/key norms included)
      // and DeepSeek-V3's experts (58 x 256 x 3 x 2048 x 7168 = 653,908,770,816 routed
      // expert weights, as released) under grouped-query attention.
      {"moe/tiny", "mixtral 2 layers, hidden 64, heads 4/2, 8 experts top-2 in 2 MoE layers, 255296 parameters "
                   "(91456 active)"},
      {"moe/mixtral-mini", "mixtral 8 layers, hidden 2048, heads 16/8, 8 experts top-2 in 8 MoE layers, 2446493696 "
                           "parameters (720013312 active)"},
      {"moe/olmoe-mini", "olmoe 8 layers, hidden 2048, heads 16/16, 64 experts top-8 in 8 MoE layers, 3562571776 "
                         "parameters (640976896 active)"},
      {"moe/deepseek-mini", "deepseek_v3 8 layers, hidden 2048, heads 16/16, 64 experts top-6 in 8 MoE layers + "
                            "shared expert, 4833970176 parameters (754485248 active)"},
      {"moe/mixtral-8x7B", "mixtral 32 layers, hidden 4096, heads 32/8, 8 experts top-2 in 32 MoE layers, "
                           "46702792704 parameters (12748853248 active)"},
      {"moe/olmoe-1B-7B", "olmoe 16 layers, hidden 2048, heads 16/16, qk norm (projection), 64 experts top-8 in 16 "
                          "MoE layers, 6919161856 parameters (1178994688 active)"},
      {"moe/olmoe-tiny", "olmoe 2 layers, hidden 64, heads 4/4, qk norm (projection), 8 experts top-2 in 2 MoE layers, "
                         "263744 parameters (99904 active)"},
      {"moe/qwen3-30B-A3B", "qwen3_moe 48 layers, hidden 2048, heads 32/4 of 128, qk norm, 128 experts top-8 in 48 MoE "
                            "layers, 30532122624 parameters (3041867776 active)"},
      {"moe/deepseek-v3-gqa", "deepseek_v3 61 layers, hidden 7168, heads 128/8, 256 experts top-8 in 58 MoE layers + "
                              "shared expert, 666273033728 parameters (31872232960 active)"},
  };
  Workdir w;
  for (const auto& c : cases) {
    auto p = w.write("e.yaml", "modules:\n  pre_trainer:\n    framework: reference\n    config: pretrain.yaml\n"
                               "    model: " + c.preset + ".yaml\n    overrides:\n      mock_data: true\n");
    auto r = run_primus("train pretrain --config " + p.string() + " --dry-run");
    EXPECT_EQ(r.code, 0) << c.preset << "\n" << r.out;
    EXPECT_NE(r.out.find("model: " + c.summary), std::string::npos) << c.preset << "\n" << r.out;
  }
}
