// Two (or more) processes of the cuda trainer in host mode against one, for the multi-process
// trainer tests.
#pragma once
#include <gtest/gtest.h>

#include <filesystem>
#include <string>

#include "tests/core/test_util.h"
#include "tests/cuda_gpu/trainer_runs.h"
#include "tests/e2e/cli_runner.h"

namespace primus::backends::cuda::testing {

// Two processes of this directory's cuda_host_trainer_worker (primus launch --exec, Gloo between
// them, the model in host mode) against one process of the same experiment: the shared steps of
// the multi-process trainer tests below.
class TwoProcesses {
 public:
  // `overrides`: extra lines under the experiment's `overrides:` (6 spaces of indent each), and
  // `model` its model file and `heads` its attention heads, for another model or recipe than the
  // tiny GPT-2; `micro` the micro-batch of every run (of a global batch of 8).
  explicit TwoProcesses(const std::string& overrides = "", const std::string& model = "gpt2/tiny.yaml", int heads = 2,
                        int micro = 4)
      : base_(tiny_trainer_experiment("cuda", w_.str(), model, heads, micro) + overrides) {
    one_file_ = w_.write("one.yaml", base_);
    run_host_trainer(one_file_, {});
    one_ = read_trainer_metrics(w_.path() / "g/u/cuda/metrics.jsonl");
    EXPECT_EQ(one_.loss.size(), 6u);
  }
  // Runs exp_name=name with `keys` on `procs` processes; expects `banner` in the output and one
  // process's losses and validation losses (fp32: 1e-5 relative, or `rel`) for the steps it ran
  // (`validation` false: the losses only, e.g. where the keys change the micro-batch, whose size is
  // what an evaluation batch holds).
  void expect_matches(const std::string& name, const std::string& keys, const std::string& banner, double rel = 1e-5,
                      int procs = 2, bool validation = true) {
    auto r = launch(name, keys, procs);
    ASSERT_EQ(r.code, 0) << r.out;
    if (!banner.empty()) EXPECT_NE(r.out.find(banner), std::string::npos) << r.out;
    const auto two = read_trainer_metrics(w_.path() / "g/u" / name / "metrics.jsonl");
    ASSERT_FALSE(two.loss.empty()) << name;
    for (auto [step, l] : two.loss) EXPECT_NEAR(l, one_.loss.at(step), rel * l) << name << " step " << step;
    if (validation) {
      for (auto [step, l] : two.val) EXPECT_NEAR(l, one_.val.at(step), rel * l) << name << " validation at " << step;
    }
    if (keys.find("load=") == std::string::npos) {
      EXPECT_EQ(two.loss.size(), one_.loss.size()) << name;
      EXPECT_EQ(two.val.size(), one_.val.size()) << name;
    }
  }
  // `name`'s step-3 checkpoint resumes as one process with one process's losses for steps 4-6, and
  // one process's step-3 checkpoint resumes on `procs` processes with `keys`.
  void expect_checkpoints_move(const std::string& name, const std::string& keys, int procs = 2) {
    const auto ckpt3 = w_.path() / "g/u" / name / "checkpoints/iter_0000003";
    ASSERT_TRUE(std::filesystem::exists(ckpt3)) << ckpt3;
    run_host_trainer(one_file_, {"exp_name=from_" + name, "load=" + ckpt3.string()});
    const auto resumed = read_trainer_metrics(w_.path() / "g/u" / ("from_" + name) / "metrics.jsonl");
    ASSERT_EQ(resumed.loss.size(), 3u);
    for (auto [step, l] : resumed.loss) EXPECT_NEAR(l, one_.loss.at(step), 1e-5 * l) << "resumed step " << step;
    expect_matches(name + "_from_one", keys + " load=" + (w_.path() / "g/u/cuda/checkpoints/iter_0000003").string(), "",
                   1e-5, procs);
    EXPECT_EQ(read_trainer_metrics(w_.path() / "g/u" / (name + "_from_one") / "metrics.jsonl").loss.size(), 3u);
  }
  // Two processes with `keys` resume from `name`'s step-3 checkpoint and give `name`'s own losses
  // for steps 4-6 bit for bit (host mode is deterministic): whatever a rank keeps between steps
  // is in the checkpoint rank 0 wrote, and every rank may take rank 0's copy of it.
  void expect_resumes_exactly(const std::string& name, const std::string& keys) {
    const auto ckpt3 = w_.path() / "g/u" / name / "checkpoints/iter_0000003";
    ASSERT_TRUE(std::filesystem::exists(ckpt3)) << ckpt3;
    auto r = launch(name + "_resumed", keys + " load=" + ckpt3.string());
    ASSERT_EQ(r.code, 0) << r.out;
    const auto whole = read_trainer_metrics(w_.path() / "g/u" / name / "metrics.jsonl");
    const auto resumed = read_trainer_metrics(w_.path() / "g/u" / (name + "_resumed") / "metrics.jsonl");
    ASSERT_EQ(resumed.loss.size(), 3u) << name;
    for (auto [step, l] : resumed.loss) EXPECT_EQ(l, whole.loss.at(step)) << name << " resumed, step " << step;
  }
  // Runs exp_name=name with `keys` on `procs` processes and expects it to fail, saying `message`.
  void expect_refused(const std::string& name, const std::string& keys, const std::string& message, int procs = 2) const {
    auto r = launch(name, keys, procs);
    EXPECT_NE(r.code, 0) << r.out;
    EXPECT_NE(r.out.find(message), std::string::npos) << r.out;
  }
  std::filesystem::path dir() const { return w_.path(); }
  const TrainerMetrics& one() const { return one_; }

 private:
  primus::testing::CliResult launch(const std::string& name, const std::string& keys, int procs = 2) const {
    return primus::testing::run_primus("launch --nproc-per-node " + std::to_string(procs) + " --timeout 60 --exec " +
                                       worker().string() + " -- " + one_file_.string() + " exp_name=" + name + " " + keys);
  }
  static std::filesystem::path worker() {
    return std::filesystem::path(PRIMUS_BINARY_DIR) / "bin" / "cuda_host_trainer_worker";
  }
  primus::testing::Workdir w_;
  std::string base_;
  std::filesystem::path one_file_;
  TrainerMetrics one_;
};

}  // namespace primus::backends::cuda::testing
