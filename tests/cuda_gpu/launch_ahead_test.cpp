// The cuda trainer on the GPU (the real binary, patches applied) with launch-ahead, step s + 1
// enqueued before step s's result is read (the default), and without it
// (PRIMUS_CUDA_LAUNCH_AHEAD=0). With deterministic: true and cuBLASLt's heuristic algorithms
// both runs compute the same bits, so every training loss and every validation loss (taken at
// evaluation boundaries, where the loop must not have the next step in flight) agree exactly,
// and a resume from the step-3 checkpoint (written with nothing in flight) replays steps 4..8.
#include <gtest/gtest.h>

#include <cmath>
#include <filesystem>
#include <string>

#include "core/util/fs.h"
#include "tests/cuda_gpu/cuda_fixture.h"
#include "tests/cuda_gpu/trainer_runs.h"
#include "tests/e2e/cli_runner.h"

namespace primus::backends::cuda::testing {
namespace {

class LaunchAheadTest : public CudaGpuTest {
 protected:
  // The tiny experiment for 8 steps through the binary (evaluations and checkpoints after steps 3
  // and 6, and the last), every checkpoint kept, bit-reproducible (heuristic GEMM algorithms); empty
  // when the binary is missing.
  std::string bit_reproducible_run() const {
    if (!std::filesystem::exists(primus::testing::primus_binary())) return "";
    return "train pretrain --config " + w.write("cuda.yaml", tiny_trainer_experiment("cuda", w.str())).string() +
           " train_iters=8 keep_last_k=3 deterministic=true gemm_algo_search=1";
  }
  const primus::testing::Workdir w;
};

TEST_F(LaunchAheadTest, SameLossesWithAndWithoutAndResumesExactly) {
  using primus::testing::run_primus;
  const std::string base = bit_reproducible_run();
  if (base.empty()) GTEST_SKIP() << primus::testing::primus_binary() << " not built (set PRIMUS_BIN)";
  const auto& dir = w.path();
  const auto ahead = run_primus(base + " exp_name=ahead");
  ASSERT_EQ(ahead.code, 0) << ahead.out;
  EXPECT_NE(ahead.out.find("launch-ahead: on"), std::string::npos) << ahead.out;
  const auto plain = run_primus(base + " exp_name=plain", "PRIMUS_CUDA_LAUNCH_AHEAD=0");
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
  const auto resumed = run_primus(base + " exp_name=resumed load=" + ckpt3.string());
  ASSERT_EQ(resumed.code, 0) << resumed.out;
  const TrainerMetrics r = read_trainer_metrics(dir / "g/u/resumed/metrics.jsonl");
  ASSERT_EQ(r.loss.size(), 5u);
  for (auto [step, l] : r.loss) EXPECT_EQ(l, a.loss.at(step)) << "resumed step " << step;
}

// master_weights: split through the binary (patch cuda.optimizer.split_master), bit-reproducible as
// above: a resume from the step-3 checkpoint (the masters joined into fp32 on save, split again on
// load) replays steps 4..8 exactly, and the run follows the fp32-master run within bf16 noise (the
// two differ only where a bf16 weight met an exact tie).
TEST_F(LaunchAheadTest, SplitMasterWeightsResumeExactlyThroughTheBinary) {
  using primus::testing::run_primus;
  const std::string base = bit_reproducible_run();
  if (base.empty()) GTEST_SKIP() << primus::testing::primus_binary() << " not built (set PRIMUS_BIN)";
  const auto& dir = w.path();
  const auto split = run_primus(base + " exp_name=split master_weights=split");
  ASSERT_EQ(split.code, 0) << split.out;
  const auto f32 = run_primus(base + " exp_name=f32");
  ASSERT_EQ(f32.code, 0) << f32.out;
  const TrainerMetrics a = read_trainer_metrics(dir / "g/u/split/metrics.jsonl");
  const TrainerMetrics b = read_trainer_metrics(dir / "g/u/f32/metrics.jsonl");
  ASSERT_EQ(a.loss.size(), 8u);
  ASSERT_EQ(b.loss.size(), 8u);
  for (auto [step, l] : b.loss) EXPECT_NEAR(a.loss.at(step), l, 1e-3 * std::fabs(l)) << "step " << step;
  EXPECT_LT(a.loss.at(8), a.loss.at(1) - 0.3) << "the run must learn";
  const auto ckpt3 = dir / "g/u/split/checkpoints/iter_0000003";
  ASSERT_TRUE(std::filesystem::exists(ckpt3)) << ckpt3;
  const auto resumed = run_primus(base + " exp_name=resumed master_weights=split load=" + ckpt3.string());
  ASSERT_EQ(resumed.code, 0) << resumed.out;
  const TrainerMetrics r = read_trainer_metrics(dir / "g/u/resumed/metrics.jsonl");
  ASSERT_EQ(r.loss.size(), 5u);
  for (auto [step, l] : r.loss) EXPECT_EQ(l, a.loss.at(step)) << "resumed step " << step;
  for (auto [step, l] : r.val) EXPECT_EQ(l, a.val.at(step)) << "resumed validation at step " << step;
}

// bf16 AdamW moments (exp_avg_dtype / exp_avg_sq_dtype: bf16) beside split masters through the
// binary: the run follows the fp32-moment run within 1% (the same first loss), and a resume from the
// step-3 checkpoint (the moments widened to f32 on save, bf16 again on load; the rounding keyed by the
// step the graph reads from the device) replays steps 4..8 exactly.
TEST_F(LaunchAheadTest, Bf16MomentsFollowFp32AndResumeExactly) {
  using primus::testing::run_primus;
  const std::string base = bit_reproducible_run();
  if (base.empty()) GTEST_SKIP() << primus::testing::primus_binary() << " not built (set PRIMUS_BIN)";
  const auto& dir = w.path();
  const std::string bf16 = " master_weights=split use_precision_aware_optimizer=true exp_avg_dtype=bf16 "
                           "exp_avg_sq_dtype=bf16";
  const auto b = run_primus(base + " exp_name=bf16" + bf16);
  ASSERT_EQ(b.code, 0) << b.out;
  EXPECT_NE(b.out.find("AdamW moments exp_avg bf16, exp_avg_sq bf16"), std::string::npos) << b.out;
  const auto f = run_primus(base + " exp_name=f32 master_weights=split");
  ASSERT_EQ(f.code, 0) << f.out;
  const TrainerMetrics a = read_trainer_metrics(dir / "g/u/bf16/metrics.jsonl");
  const TrainerMetrics c = read_trainer_metrics(dir / "g/u/f32/metrics.jsonl");
  ASSERT_EQ(a.loss.size(), 8u);
  ASSERT_EQ(c.loss.size(), 8u);
  EXPECT_EQ(a.loss.at(1), c.loss.at(1));
  bool differ = false;
  for (auto [step, l] : c.loss) {
    EXPECT_NEAR(a.loss.at(step), l, 1e-2 * std::fabs(l)) << "step " << step;
    differ = differ || a.loss.at(step) != l;
  }
  EXPECT_TRUE(differ) << "the moments were rounded";
  EXPECT_LT(a.loss.at(8), a.loss.at(1) - 0.3) << "the run must learn";
  const auto ckpt3 = dir / "g/u/bf16/checkpoints/iter_0000003";
  ASSERT_TRUE(std::filesystem::exists(ckpt3)) << ckpt3;
  const auto resumed = run_primus(base + " exp_name=resumed" + bf16 + " load=" + ckpt3.string());
  ASSERT_EQ(resumed.code, 0) << resumed.out;
  const TrainerMetrics r = read_trainer_metrics(dir / "g/u/resumed/metrics.jsonl");
  ASSERT_EQ(r.loss.size(), 5u);
  for (auto [step, l] : r.loss) EXPECT_EQ(l, a.loss.at(step)) << "resumed step " << step;
  for (auto [step, l] : r.val) EXPECT_EQ(l, a.val.at(step)) << "resumed validation at step " << step;
}

// finetune on the GPU: the run starts from the step-8 checkpoint's weights at step 0 with a fresh
// optimizer. At lr 0 its own checkpoint's weights are the loaded ones bit for bit (the fp32 masters
// untouched, the bf16 copies made from them), its first loss is the trained model's, and its
// optimizer state is its own.
TEST_F(LaunchAheadTest, FinetuneStartsFromACheckpointsWeights) {
  using primus::testing::run_primus;
  const std::string base = bit_reproducible_run();
  if (base.empty()) GTEST_SKIP() << primus::testing::primus_binary() << " not built (set PRIMUS_BIN)";
  const auto& dir = w.path();
  const auto trained = run_primus(base + " exp_name=base");
  ASSERT_EQ(trained.code, 0) << trained.out;
  const auto ckpt8 = dir / "g/u/base/checkpoints/iter_0000008";
  ASSERT_TRUE(std::filesystem::exists(ckpt8)) << ckpt8;
  const auto tuned = run_primus(base + " exp_name=tuned finetune=true load=" + ckpt8.string() +
                                " train_iters=2 lr=0 min_lr=0 lr_warmup_iters=0");
  ASSERT_EQ(tuned.code, 0) << tuned.out;
  EXPECT_NE(tuned.out.find("finetune: weights from " + ckpt8.string() + " (its step 8)"), std::string::npos)
      << tuned.out;
  const TrainerMetrics a = read_trainer_metrics(dir / "g/u/base/metrics.jsonl");
  const TrainerMetrics t = read_trainer_metrics(dir / "g/u/tuned/metrics.jsonl");
  ASSERT_EQ(t.loss.size(), 2u);
  EXPECT_LT(t.loss.at(1), a.loss.at(1) - 0.3) << "the first loss must be the trained model's";
  const auto ckpt2 = dir / "g/u/tuned/checkpoints/iter_0000002";
  EXPECT_TRUE(primus::fs::read_file(ckpt2 / "model.safetensors") == primus::fs::read_file(ckpt8 / "model.safetensors"))
      << "lr 0 must leave the loaded weights as they were";
  EXPECT_FALSE(primus::fs::read_file(ckpt2 / "optimizer.safetensors") ==
               primus::fs::read_file(ckpt8 / "optimizer.safetensors"));
}

// eod_mask_loss on the GPU: the step is captured as a CUDA graph and replayed for every batch, so
// the count of the targets that keep a loss must be the device's own each time. The captured run
// (cuda_graph: true) gives the eager run's losses and validation losses (the same kernels: equal
// to f32 rounding of the graph's scalars at most), and follows the reference backend's masked run
// (fp32 on the CPU, same batches) within bf16 noise; the unmasked run is another run.
TEST_F(LaunchAheadTest, EodMaskedLossReplaysInTheGraphAsEagerly) {
  using primus::testing::run_primus;
  const std::string base = bit_reproducible_run();
  if (base.empty()) GTEST_SKIP() << primus::testing::primus_binary() << " not built (set PRIMUS_BIN)";
  const auto& dir = w.path();
  for (const char* run : {"graph cuda_graph=true", "eager cuda_graph=false", "unmasked eod_mask_loss=false"}) {
    const std::string r = run;
    const std::string name = r.substr(0, r.find(' ')), keys = r.substr(r.find(' ') + 1);
    const auto out = run_primus(base + " eod_mask_loss=true exp_name=" + name + " " + keys);
    ASSERT_EQ(out.code, 0) << out.out;
  }
  const std::string ref_file = w.write("ref.yaml", tiny_trainer_experiment("reference", w.str())).string();
  const auto ref = run_primus("train pretrain --config " + ref_file + " train_iters=8 eod_mask_loss=true");
  ASSERT_EQ(ref.code, 0) << ref.out;
  const TrainerMetrics g = read_trainer_metrics(dir / "g/u/graph/metrics.jsonl");
  const TrainerMetrics e = read_trainer_metrics(dir / "g/u/eager/metrics.jsonl");
  const TrainerMetrics u = read_trainer_metrics(dir / "g/u/unmasked/metrics.jsonl");
  const TrainerMetrics r = read_trainer_metrics(dir / "g/u/reference/metrics.jsonl");
  ASSERT_EQ(g.loss.size(), 8u);
  ASSERT_EQ(e.loss.size(), 8u);
  ASSERT_EQ(r.loss.size(), 8u);
  for (auto [step, l] : e.loss) EXPECT_NEAR(g.loss.at(step), l, 1e-6 * l) << "graph vs eager, step " << step;
  for (auto [step, l] : e.val) EXPECT_NEAR(g.val.at(step), l, 1e-6 * l) << "graph vs eager, validation " << step;
  for (auto [step, l] : r.loss) EXPECT_NEAR(g.loss.at(step), l, 2e-2 * l) << "graph vs reference, step " << step;
  double apart = 0;
  for (auto [step, l] : u.loss) apart = std::max(apart, std::abs(g.loss.at(step) - l));
  EXPECT_GT(apart, 5e-3) << "the masked run must not be the unmasked one";
}

// Primus-Turbo's backend keys through the binary (backends/cuda/turbo_keys.h): turbo_gemm_backend:
// TURBO runs the linear layers on Turbo's own GEMM (other bits, the same training within 2%),
// use_turbo_autotune times the backends per shape, and PRIMUS_TURBO_GEMM_BACKEND wins over the key:
// forced to cuBLASLt, the run is the default's bit for bit.
TEST_F(LaunchAheadTest, TurboBackendKeysReachTheDispatcher) {
  using primus::testing::run_primus;
  const std::string base = bit_reproducible_run();
  if (base.empty()) GTEST_SKIP() << primus::testing::primus_binary() << " not built (set PRIMUS_BIN)";
  const auto& dir = w.path();
  const auto plain = run_primus(base + " exp_name=plain");
  ASSERT_EQ(plain.code, 0) << plain.out;
  const auto turbo = run_primus(base + " exp_name=turbo turbo_gemm_backend=TURBO");
  ASSERT_EQ(turbo.code, 0) << turbo.out;
  EXPECT_NE(turbo.out.find("gemm backend: TURBO (turbo_gemm_backend)"), std::string::npos) << turbo.out;
  const auto tuned = run_primus(base + " exp_name=tuned use_turbo_autotune=true");
  ASSERT_EQ(tuned.code, 0) << tuned.out;
  EXPECT_NE(tuned.out.find("timed per shape (use_turbo_autotune)"), std::string::npos) << tuned.out;
  const auto env = run_primus(base + " exp_name=env turbo_gemm_backend=TURBO", "PRIMUS_TURBO_GEMM_BACKEND=CUBLASLT");
  ASSERT_EQ(env.code, 0) << env.out;
  EXPECT_NE(env.out.find("PRIMUS_TURBO_GEMM_BACKEND=CUBLASLT wins over the config's TURBO"), std::string::npos)
      << env.out;

  const TrainerMetrics p = read_trainer_metrics(dir / "g/u/plain/metrics.jsonl");
  const TrainerMetrics t = read_trainer_metrics(dir / "g/u/turbo/metrics.jsonl");
  const TrainerMetrics a = read_trainer_metrics(dir / "g/u/tuned/metrics.jsonl");
  const TrainerMetrics e = read_trainer_metrics(dir / "g/u/env/metrics.jsonl");
  ASSERT_EQ(p.loss.size(), 8u);
  ASSERT_EQ(t.loss.size(), 8u);
  ASSERT_EQ(a.loss.size(), 8u);
  ASSERT_EQ(e.loss.size(), 8u);
  bool differs = false;
  for (auto [step, l] : p.loss) {
    EXPECT_NEAR(t.loss.at(step), l, 0.02 * std::fabs(l)) << "TURBO, step " << step;
    EXPECT_NEAR(a.loss.at(step), l, 0.02 * std::fabs(l)) << "autotune, step " << step;
    EXPECT_EQ(e.loss.at(step), l) << "cuBLASLt from the environment, step " << step;
    differs = differs || t.loss.at(step) != l;
  }
  EXPECT_TRUE(differs) << "turbo_gemm_backend: TURBO gave cuBLASLt's bits at every step";
  EXPECT_LT(t.loss.at(8), t.loss.at(1) - 0.3) << "the run must learn";
}

}  // namespace
}  // namespace primus::backends::cuda::testing
