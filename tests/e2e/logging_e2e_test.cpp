// Primus' logging keys through the binary: stderr_sink_level sets the console's level (and
// PRIMUS_LOG_LEVEL wins over it), log_avg_skip_iterations leaves the first steps out of the
// progress lines' average, and a level that is no level is refused naming the key. The other keys
// Primus' Megatron-LM configs set about logging and checkpoints carry over or are refused by name.
#include <gtest/gtest.h>

#include <sstream>
#include <string>
#include <vector>

#include "cli_runner.h"

#include <filesystem>
#include <fstream>

using primus::testing::run_primus;
using primus::testing::tiny_run_args;
using primus::testing::Workdir;

namespace {
std::vector<std::string> step_lines(const std::string& out) {
  std::vector<std::string> lines;
  std::istringstream in(out);
  for (std::string l; std::getline(in, l);)
    if (l.find("] step ") != std::string::npos && l.find(" tok/s") != std::string::npos) lines.push_back(l);
  return lines;
}
const std::string kNoEnvLevel = "env -u PRIMUS_LOG_LEVEL";
}  // namespace

TEST(LoggingE2E, StderrSinkLevelQuietensTheConsoleAndTheEnvironmentWins) {
  Workdir w;
  const std::string args = tiny_run_args(w.str()) + " train_iters=3 log_interval=1 save_at_end=false";
  auto info = run_primus(args, kNoEnvLevel);
  ASSERT_EQ(info.code, 0) << info.out;
  EXPECT_EQ(step_lines(info.out).size(), 3u) << info.out;

  auto quiet = run_primus(args + " stderr_sink_level=WARNING", kNoEnvLevel);
  ASSERT_EQ(quiet.code, 0) << quiet.out;
  EXPECT_TRUE(step_lines(quiet.out).empty()) << quiet.out;

  auto env = run_primus(args + " stderr_sink_level=error", "PRIMUS_LOG_LEVEL=info");
  ASSERT_EQ(env.code, 0) << env.out;
  EXPECT_EQ(step_lines(env.out).size(), 3u) << env.out;

  auto bad = run_primus(args + " stderr_sink_level=LOUD", kNoEnvLevel);
  EXPECT_NE(bad.code, 0);
  EXPECT_NE(bad.out.find("stderr_sink_level 'LOUD' is not one of"), std::string::npos) << bad.out;
}

TEST(LoggingE2E, TheAverageLeavesOutTheFirstSteps) {
  Workdir w;
  auto r = run_primus(tiny_run_args(w.str()) + " train_iters=5 log_interval=1 save_at_end=false "
                      "log_avg_skip_iterations=3 log_avg_reset_interval=2",
                      kNoEnvLevel);
  ASSERT_EQ(r.code, 0) << r.out;
  auto lines = step_lines(r.out);
  ASSERT_EQ(lines.size(), 5u) << r.out;
  for (size_t i = 0; i < lines.size(); ++i) {
    EXPECT_EQ(lines[i].find(" tok/s (avg ") != std::string::npos, i >= 3) << lines[i];
  }
}

TEST(LoggingE2E, PrimusKeysCarryOverOrAreRefusedByName) {
  Workdir w, quiet;
  const std::string args = tiny_run_args(w.str()) + " train_iters=2 save_at_end=false";
  // W&B keys as Primus' configs write them: unused while disable_wandb is true (its default).
  auto a = run_primus(args + " wandb_project=p wandb_exp_name=e disable_wandb=true");
  ASSERT_EQ(a.code, 0) << a.out;
  EXPECT_TRUE(std::filesystem::exists(w.path() / "local/local/shakespeare/tensorboard"));
  auto b = run_primus(tiny_run_args(quiet.str()) + " train_iters=2 save_at_end=false disable_tensorboard=true");
  ASSERT_EQ(b.code, 0) << b.out;
  EXPECT_TRUE(std::filesystem::exists(quiet.path() / "local/local/shakespeare/metrics.jsonl"));
  EXPECT_FALSE(std::filesystem::exists(quiet.path() / "local/local/shakespeare/tensorboard"));

  const std::pair<std::string, std::string> refused[] = {
      {"disable_wandb=false", "Weights & Biases logging is not built in"},
      {"ckpt_format=torch_dist", "ckpt_format: torch_dist: Primus writes its own checkpoints"},
      {"overlap_param_gather=true", "overlap_param_gather: true is not implemented"},
      {"disable_tensorboard=true tensorboard_dir=/tmp/tb", "disable_tensorboard is true but tensorboard_dir is set"},
  };
  for (const auto& [keys, message] : refused) {
    auto r = run_primus(args + " " + keys + " --dry-run");
    EXPECT_EQ(r.code, 2) << keys << "\n" << r.out;
    EXPECT_NE(r.out.find(message), std::string::npos) << keys << "\n" << r.out;
  }
  auto ok = run_primus(args + " overlap_param_gather=false --dry-run");
  EXPECT_EQ(ok.code, 0) << ok.out;
}

// Megatron-LM's tokenizer names: HuggingFaceTokenizer reads tokenizer_model (here a folder holding a
// placeholder tokenizer.json: a dry run resolves the path without reading the file),
// GPT2BPETokenizer is the built-in GPT-2 BPE; the wrong combinations are refused.
TEST(LoggingE2E, MegatronTokenizerNamesResolve) {
  Workdir w;
  const std::string args = tiny_run_args(w.str()) + " train_iters=1 --dry-run";
  const std::string folder = (w.path() / "tok").string();
  std::filesystem::create_directories(folder);
  std::ofstream(folder + "/tokenizer.json") << "{}";
  auto hf = run_primus(args + " tokenizer_type=HuggingFaceTokenizer tokenizer_model=" + folder);
  EXPECT_EQ(hf.code, 0) << hf.out;
  EXPECT_NE(hf.out.find("tokenizer: " + folder + "/tokenizer.json"), std::string::npos) << hf.out;
  auto gpt2 = run_primus(args + " tokenizer_type=GPT2BPETokenizer");
  EXPECT_EQ(gpt2.code, 0) << gpt2.out;
  EXPECT_NE(gpt2.out.find("tokenizer: gpt2"), std::string::npos) << gpt2.out;
  auto none = run_primus(args + " tokenizer_type=HuggingFaceTokenizer");
  EXPECT_EQ(none.code, 2) << none.out;
  EXPECT_NE(none.out.find("HuggingFaceTokenizer needs tokenizer_model"), std::string::npos) << none.out;
  auto stray = run_primus(args + " tokenizer_model=" + folder);
  EXPECT_EQ(stray.code, 2) << stray.out;
  EXPECT_NE(stray.out.find("tokenizer_model is read with tokenizer_type HuggingFaceTokenizer only"),
            std::string::npos) << stray.out;
  auto missing = run_primus(args + " tokenizer_type=HuggingFaceTokenizer tokenizer_model=org/none",
                            "HF_HUB_CACHE=" + w.str() + "/hub");
  EXPECT_EQ(missing.code, 2) << missing.out;
  EXPECT_NE(missing.out.find("tokenizer_model 'org/none'"), std::string::npos) << missing.out;
}
