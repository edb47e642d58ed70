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
