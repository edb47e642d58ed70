// The cuda trainer on the GPU (the real binary, patches applied) with launch-ahead, step s + 1
// enqueued before step s's result is read (the default), and without it
// (PRIMUS_CUDA_LAUNCH_AHEAD=0). With deterministic: true and cuBLASLt's heuristic algorithms
// both runs compute the same bits, so every training loss and every validation loss (taken at
// evaluation boundaries, where the loop must not have the next step in flight) agree exactly,
// and a resume from the step-3 checkpoint (written with nothing in flight) replays steps 4..8.
#include <gtest/gtest.h>

#include <cstdio>
#include <cstdlib>
#include <filesystem>
#include <fstream>
#include <random>
#include <string>

#include "tests/cuda_gpu/cuda_fixture.h"
#include "tests/cuda_gpu/trainer_metrics.h"

namespace primus::backends::cuda::testing {
namespace {

std::string env_or(const char* name, const std::string& fallback) {
  const char* v = std::getenv(name);
  return v && *v ? v : fallback;
}

// The binary: $PRIMUS_BIN (the GPU run unpacks it elsewhere), else this build's.
std::string primus_bin() { return env_or("PRIMUS_BIN", std::string(PRIMUS_BINARY_DIR) + "/bin/primus"); }

struct CliRun {
  int code = -1;
  std::string out;
};
CliRun run(const std::string& cmd) {
  CliRun r;
  FILE* p = ::popen((cmd + " 2>&1").c_str(), "r");
  if (!p) return r;
  char buf[4096];
  while (std::fgets(buf, sizeof(buf), p)) r.out += buf;
  const int st = ::pclose(p);
  r.code = WIFEXITED(st) ? WEXITSTATUS(st) : -1;
  return r;
}

class LaunchAheadTest : public CudaGpuTest {};

TEST_F(LaunchAheadTest, SameLossesWithAndWithoutAndResumesExactly) {
  if (!std::filesystem::exists(primus_bin())) GTEST_SKIP() << primus_bin() << " not built (set PRIMUS_BIN)";
  std::random_device rd;
  const auto dir = std::filesystem::temp_directory_path() / ("primus_launch_ahead_" + std::to_string(rd()));
  std::filesystem::create_directories(dir);
  const std::string src = env_or("PRIMUS_SOURCE_DIR", PRIMUS_SOURCE_DIR);
  const auto exp = dir / "cuda.yaml";
  std::ofstream(exp) << "work_group: g\nuser_name: u\nexp_name: ahead\nworkspace: " << dir.string()
                     << "\nmodules:\n  pre_trainer:\n    framework: cuda\n    config: pretrain.yaml\n"
                        "    model: gpt2/tiny.yaml\n    overrides:\n"
                        "      tokenizer_type: bytes\n      vocab_size: 256\n      seq_length: 64\n      num_layers: 2\n"
                        "      hidden_size: 64\n      num_attention_heads: 2\n      ffn_hidden_size: 256\n"
                        "      data_path: ["
                     << src
                     << "/examples/data/tinyshakespeare.txt]\n      split: 0.95\n      train_iters: 8\n"
                        "      micro_batch_size: 4\n      global_batch_size: 8\n      lr: 2.0e-3\n      min_lr: 2.0e-4\n"
                        "      lr_warmup_iters: 2\n      log_interval: 1\n      eval_interval: 3\n      eval_iters: 2\n"
                        "      save_interval: 3\n      keep_last_k: 3\n      deterministic: true\n      gemm_algo_search: 1\n";
  const std::string base = primus_bin() + " train pretrain --config " + exp.string();

  const CliRun ahead = run(base);
  ASSERT_EQ(ahead.code, 0) << ahead.out;
  EXPECT_NE(ahead.out.find("launch-ahead: on"), std::string::npos) << ahead.out;
  const CliRun plain = run("PRIMUS_CUDA_LAUNCH_AHEAD=0 " + base + " exp_name=plain");
  ASSERT_EQ(plain.code, 0) << plain.out;
  EXPECT_NE(plain.out.find("launch-ahead: off"), std::string::npos) << plain.out;

  const TrainerMetrics a = read_trainer_metrics(dir / "g/u/ahead/metrics.jsonl");
  const TrainerMetrics b = read_trainer_metrics(dir / "g/u/plain/metrics.jsonl");
  ASSERT_EQ(a.loss.size(), 8u);
  ASSERT_EQ(b.loss.size(), 8u);
  for (auto [step, l] : b.loss) EXPECT_EQ(a.loss.at(step), l) << "step " << step;
  ASSERT_EQ(a.val.size(), 3u);  // steps 3, 6 and the last
  for (auto [step, l] : b.val) EXPECT_EQ(a.val.at(step), l) << "validation at step " << step;
  EXPECT_LT(a.loss.at(8), a.loss.at(1) - 0.3) << "the run must learn";

  // The step-3 checkpoint of the launch-ahead run, resumed (launch-ahead on): steps 4..8 again.
  const auto ckpt3 = dir / "g/u/ahead/checkpoints/iter_0000003";
  ASSERT_TRUE(std::filesystem::exists(ckpt3)) << ckpt3;
  const CliRun resumed = run(base + " exp_name=resumed load=" + ckpt3.string());
  ASSERT_EQ(resumed.code, 0) << resumed.out;
  const TrainerMetrics r = read_trainer_metrics(dir / "g/u/resumed/metrics.jsonl");
  ASSERT_EQ(r.loss.size(), 5u);
  for (auto [step, l] : r.loss) EXPECT_EQ(l, a.loss.at(step)) << "resumed step " << step;
  std::filesystem::remove_all(dir);
}

}  // namespace
}  // namespace primus::backends::cuda::testing
