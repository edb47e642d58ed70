// Shared by the end-to-end hardening tests: a fresh folder per test, the argument lists of
// small reference-backend runs of examples/reference/shakespeare.yaml, and readers for what a
// run leaves behind (metrics.jsonl losses, checkpoint folders as bytes).
#pragma once
#include <gtest/gtest.h>

#include <cstdint>
#include <filesystem>
#include <map>
#include <string>
#include <utility>
#include <vector>

#include "primus_process.h"

namespace primus::hardening {

namespace fsys = std::filesystem;

// A model size and how long a step takes with one thread (Release build, this machine).
struct ModelSize {
  std::vector<std::string> overrides;
  static ModelSize tiny();    // ~1 ms a step
  static ModelSize small();   // ~20 ms a step
  static ModelSize medium();  // ~60 ms a step
};

struct TrainOptions {
  ModelSize model = ModelSize::small();
  int64_t iters = 20;
  int64_t decay_iters = 20;  // the LR schedule's length: equal in runs that are compared
  int64_t save_interval = 0;
  std::vector<std::string> extra;
};

class HardeningTest : public ::testing::Test {
 protected:
  void SetUp() override;
  void TearDown() override;
  const fsys::path& dir() const { return dir_; }

 private:
  fsys::path dir_;
};

// `train pretrain` of the shakespeare example into `workspace`.
std::vector<std::string> train_args(const fsys::path& workspace, const TrainOptions& o);
fsys::path output_dir(const fsys::path& workspace);  // workspace/local/local/shakespeare
fsys::path save_dir(const fsys::path& workspace);    // output_dir/checkpoints

// The (step, loss) of every training line of metrics.jsonl, in file order (a resumed run
// appends, so steps may repeat).
std::vector<std::pair<int64_t, double>> read_losses(const fsys::path& workspace);

// Every regular file under `dir` (relative path -> bytes).
std::map<std::string, std::string> snapshot(const fsys::path& dir);

// Runs to completion and returns the loss of each step; fails the test if the run fails.
std::map<int64_t, double> reference_losses(const fsys::path& workspace, const TrainOptions& o);

// Expects every line of the run's metrics (repeated steps included) to carry exactly the
// reference's loss for its step, bit for bit, and the steps 1..last all present.
void expect_losses_match(const fsys::path& workspace, const std::map<int64_t, double>& reference,
                         int64_t last_step);

}  // namespace primus::hardening
