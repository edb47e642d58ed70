// The CUDA trainer end to end without a GPU: CudaTrainer in host mode (the model on Turbo's CPU
// backends) against the reference backend's trainer (the real binary) on the same experiment:
// tinyshakespeare as bytes, gradient accumulation 2, clipping, warmup + cosine, eval and
// checkpoints. Same init, same batches, so every step's loss and every validation loss agree
// (fp32 on both sides: 1e-5 relative); then a resume from the step-3 checkpoint replays
// steps 4-6 with the same losses; the runs without the trainer's read-ahead of the next
// step's batches and without launch-ahead have the same losses bit for bit; and the GELU run as
// its own op in either direction still matches the reference.
#include <gtest/gtest.h>

#include <cstdlib>
#include <string>

#include "backends/cuda/args.h"
#include "backends/cuda/hooks.h"
#include "backends/cuda/register.h"
#include "backends/cuda/trainer.h"
#include "core/backend/backend.h"
#include "core/config/experiment.h"
#include "core/patches/registry.h"
#include "core/util/error.h"
#include "parallel/dist_checkpoint.h"
#include "tests/cuda_gpu/trainer_runs.h"
#include "tests/e2e/cli_runner.h"

namespace primus::backends::cuda {
namespace {

using testing::run_host_trainer;

TEST(CudaHostTrainer, MatchesTheReferenceTrainerAndResumes) {
  primus::testing::Workdir w;
  auto ref_file = w.write("ref.yaml", testing::tiny_trainer_experiment("reference", w.str()));
  auto cuda_file = w.write("cuda.yaml", testing::tiny_trainer_experiment("cuda", w.str()));
  auto r = primus::testing::run_primus("train pretrain --config " + ref_file.string());
  ASSERT_EQ(r.code, 0) << r.out;
  run_host_trainer(cuda_file, {});
  const auto ref = testing::read_trainer_metrics(w.path() / "g/u/reference/metrics.jsonl");
  const auto ours = testing::read_trainer_metrics(w.path() / "g/u/cuda/metrics.jsonl");
  ASSERT_EQ(ref.loss.size(), 6u);
  ASSERT_EQ(ours.loss.size(), 6u);
  for (auto [step, l] : ref.loss) EXPECT_NEAR(ours.loss.at(step), l, 1e-5 * l) << "step " << step;
  ASSERT_EQ(ref.val.size(), 2u);
  for (auto [step, l] : ref.val) EXPECT_NEAR(ours.val.at(step), l, 1e-5 * l) << "validation at step " << step;
  EXPECT_LT(ref.loss.at(6), ref.loss.at(1) - 0.3) << "the run must learn";

  // Resume from step 3 into a fresh output folder: steps 4..6 replay.
  const auto ckpt3 = w.path() / "g/u/cuda/checkpoints/iter_0000003";
  ASSERT_TRUE(std::filesystem::exists(ckpt3)) << ckpt3;
  run_host_trainer(cuda_file, {"exp_name=cuda_resumed", "load=" + ckpt3.string()});
  const auto resumed = testing::read_trainer_metrics(w.path() / "g/u/cuda_resumed/metrics.jsonl");
  ASSERT_EQ(resumed.loss.size(), 3u);
  for (auto [step, l] : resumed.loss) EXPECT_NEAR(l, ours.loss.at(step), 1e-6 * l) << "resumed step " << step;

  // The same run with one environment switch set, under its own name.
  auto run_with = [&](const char* var, const char* value) {
    const std::string name = std::string("cuda_") + var + "_" + value;
    ::setenv(var, value, 1);
    run_host_trainer(cuda_file, {"exp_name=" + name});
    ::unsetenv(var);
    return testing::read_trainer_metrics(w.path() / "g/u" / name / "metrics.jsonl");
  };

  // Reading the next step's batches while a step runs, and launch-ahead (step s + 1 launched
  // before step s's result is read; host mode included), both on by default, change nothing: the
  // same run with either off (PRIMUS_CUDA_READ_AHEAD=0, PRIMUS_CUDA_LAUNCH_AHEAD=0) has the same
  // losses and validation losses, bit for bit.
  for (const char* var : {"PRIMUS_CUDA_READ_AHEAD", "PRIMUS_CUDA_LAUNCH_AHEAD"}) {
    const auto plain = run_with(var, "0");
    ASSERT_EQ(plain.loss.size(), ours.loss.size()) << var;
    for (auto [step, l] : plain.loss) EXPECT_EQ(l, ours.loss.at(step)) << var << "=0, step " << step;
    for (auto [step, l] : plain.val) EXPECT_EQ(l, ours.val.at(step)) << var << "=0, validation at step " << step;
  }
}

// optimizer_in_bwd (one micro-batch per step, no clipping) trains with the same losses bit for bit
// as the update after the backward, checkpoints included; with clipping or accumulation it is a
// config error that names the key.
TEST(CudaHostTrainer, OptimizerInBackwardTrainsAsTheUpdateAfterTheBackward) {
  primus::testing::Workdir w;
  auto cuda_file = w.write("cuda.yaml", testing::tiny_trainer_experiment("cuda", w.str()));
  const std::vector<std::string> one_micro = {"global_batch_size=4", "clip_grad=0"};
  auto with = [&](const std::string& name, std::vector<std::string> extra) {
    std::vector<std::string> cli = one_micro;
    cli.push_back("exp_name=" + name);
    cli.insert(cli.end(), extra.begin(), extra.end());
    run_host_trainer(cuda_file, cli);
    return testing::read_trainer_metrics(w.path() / "g/u" / name / "metrics.jsonl");
  };
  const auto after = with("after", {});
  const auto inside = with("inside", {"optimizer_in_bwd=true"});
  ASSERT_EQ(after.loss.size(), 6u);
  ASSERT_EQ(inside.loss.size(), 6u);
  for (auto [step, l] : after.loss) EXPECT_EQ(inside.loss.at(step), l) << "step " << step;
  for (auto [step, l] : after.val) EXPECT_EQ(inside.val.at(step), l) << "validation at step " << step;
  EXPECT_LT(after.loss.at(6), after.loss.at(1)) << "the run must learn";
  EXPECT_TRUE(std::filesystem::exists(w.path() / "g/u/inside/checkpoints/iter_0000006"));

  for (const auto& bad : {std::vector<std::string>{"optimizer_in_bwd=true", "clip_grad=1.0"},
                          std::vector<std::string>{"optimizer_in_bwd=true", "global_batch_size=8"}}) {
    std::vector<std::string> cli = {"exp_name=refused", "clip_grad=0"};
    cli.insert(cli.end(), bad.begin(), bad.end());
    try {
      run_host_trainer(cuda_file, cli);
      ADD_FAILURE() << "accepted " << bad[1];
    } catch (const ConfigError& e) {
      EXPECT_NE(std::string(e.what()).find("optimizer_in_bwd"), std::string::npos) << e.what();
    }
  }
}

// optimizer: muon through the cuda trainer's OptimizerState (AdamW over the other tensors, Muon
// over the matrices' blocks, the momentum in m's rows) in host mode: the reference trainer's
// losses (fp32 both); each backend resumes the other's step-3 checkpoint (muon_momentum in the
// same flat layout) with the uninterrupted losses; optimizer_in_bwd with Muon is refused.
TEST(CudaHostTrainer, MuonMatchesTheReferenceAndResumesAcrossBackends) {
  primus::testing::Workdir w;
  auto ref_file = w.write("ref.yaml", testing::tiny_trainer_experiment("reference", w.str()));
  auto cuda_file = w.write("cuda.yaml", testing::tiny_trainer_experiment("cuda", w.str()));
  const std::string muon = " optimizer=muon lr=0.01 lr_decay_style=WSD lr_wsd_decay_iters=3";
  auto r = primus::testing::run_primus("train pretrain --config " + ref_file.string() + muon);
  ASSERT_EQ(r.code, 0) << r.out;
  const std::vector<std::string> cli = {"optimizer=muon", "lr=0.01", "lr_decay_style=WSD", "lr_wsd_decay_iters=3"};
  run_host_trainer(cuda_file, cli);
  const auto ref = testing::read_trainer_metrics(w.path() / "g/u/reference/metrics.jsonl");
  const auto ours = testing::read_trainer_metrics(w.path() / "g/u/cuda/metrics.jsonl");
  ASSERT_EQ(ref.loss.size(), 6u);
  ASSERT_EQ(ours.loss.size(), 6u);
  for (auto [step, l] : ref.loss) EXPECT_NEAR(ours.loss.at(step), l, 1e-5 * l) << "step " << step;
  for (auto [step, l] : ref.val) EXPECT_NEAR(ours.val.at(step), l, 1e-5 * l) << "validation at step " << step;
  EXPECT_LT(ref.loss.at(6), ref.loss.at(1) - 0.3) << "the run must learn";

  // The cuda trainer resumes the reference's checkpoint, and the reference the cuda trainer's.
  std::vector<std::string> from_ref = cli;
  from_ref.push_back("exp_name=cuda_from_ref");
  from_ref.push_back("load=" + (w.path() / "g/u/reference/checkpoints/iter_0000003").string());
  run_host_trainer(cuda_file, from_ref);
  const auto a = testing::read_trainer_metrics(w.path() / "g/u/cuda_from_ref/metrics.jsonl");
  ASSERT_EQ(a.loss.size(), 3u);
  for (auto [step, l] : a.loss) EXPECT_NEAR(l, ref.loss.at(step), 1e-5 * l) << "cuda from reference, step " << step;
  auto rb = primus::testing::run_primus("train pretrain --config " + ref_file.string() + muon +
                                        " exp_name=ref_from_cuda load=" +
                                        (w.path() / "g/u/cuda/checkpoints/iter_0000003").string());
  ASSERT_EQ(rb.code, 0) << rb.out;
  const auto b = testing::read_trainer_metrics(w.path() / "g/u/ref_from_cuda/metrics.jsonl");
  ASSERT_EQ(b.loss.size(), 3u);
  for (auto [step, l] : b.loss) EXPECT_NEAR(l, ours.loss.at(step), 1e-5 * l) << "reference from cuda, step " << step;

  try {
    run_host_trainer(cuda_file, {"exp_name=refused", "optimizer=muon", "optimizer_in_bwd=true", "clip_grad=0",
                                 "global_batch_size=4"});
    ADD_FAILURE() << "Muon with optimizer_in_bwd was accepted";
  } catch (const ConfigError& e) {
    EXPECT_NE(std::string(e.what()).find("optimizer: muon with optimizer_in_bwd"), std::string::npos) << e.what();
  }
}

// Tensor parallelism through the cuda trainer: two processes (primus launch --exec this
// directory's cuda_host_trainer_worker, Gloo between them, the model in host mode) train the
// tiny GPT-2 as tp2, with and without sequence parallelism, and give one process's losses and
// validation losses (fp32: 1e-5 relative); the checkpoint they save at step 3 (weights in the
// global layout, moments as per-rank shards) resumes as one process with the same losses for
// steps 4-6, and one process's resumes as tp2.
TEST(CudaHostTrainer, TensorParallelTwoProcessesTrainAsOne) {
  primus::testing::Workdir w;
  const std::string base = testing::tiny_trainer_experiment("cuda", w.str());
  auto one_file = w.write("one.yaml", base);
  run_host_trainer(one_file, {});
  const auto one = testing::read_trainer_metrics(w.path() / "g/u/cuda/metrics.jsonl");
  ASSERT_EQ(one.loss.size(), 6u);
  const std::filesystem::path worker = std::filesystem::path(PRIMUS_BINARY_DIR) / "bin" / "cuda_host_trainer_worker";
  for (const bool sp : {false, true}) {
    const std::string name = sp ? "tp2sp" : "tp2";
    auto r = primus::testing::run_primus("launch --nproc-per-node 2 --timeout 60 --exec " + worker.string() + " -- " +
                                         one_file.string() + " exp_name=" + name + " tensor_model_parallel_size=2" +
                                         (sp ? " sequence_parallel=true" : ""));
    ASSERT_EQ(r.code, 0) << r.out;
    EXPECT_NE(r.out.find("tensor parallel over 2 ranks"), std::string::npos) << r.out;
    const auto two = testing::read_trainer_metrics(w.path() / "g/u" / name / "metrics.jsonl");
    ASSERT_EQ(two.loss.size(), 6u) << name;
    for (auto [step, l] : one.loss) EXPECT_NEAR(two.loss.at(step), l, 1e-5 * l) << name << " step " << step;
    ASSERT_EQ(two.val.size(), one.val.size());
    for (auto [step, l] : one.val) EXPECT_NEAR(two.val.at(step), l, 1e-5 * l) << name << " validation at " << step;
    if (sp) continue;
    const auto ckpt3 = w.path() / "g/u" / name / "checkpoints/iter_0000003";
    ASSERT_TRUE(std::filesystem::exists(ckpt3)) << ckpt3;
    for (int k = 0; k < 2; ++k)  // the moments: one shard file per rank
      EXPECT_TRUE(std::filesystem::exists(ckpt3 / parallel::shard_file_name(k, 2))) << "rank " << k;
    run_host_trainer(one_file, {"exp_name=from_tp2", "load=" + ckpt3.string()});
    const auto resumed = testing::read_trainer_metrics(w.path() / "g/u/from_tp2/metrics.jsonl");
    ASSERT_EQ(resumed.loss.size(), 3u);
    for (auto [step, l] : resumed.loss) EXPECT_NEAR(l, one.loss.at(step), 1e-5 * l) << "resumed step " << step;
    // And one process's step-3 checkpoint resumes as tp2.
    auto rr = primus::testing::run_primus("launch --nproc-per-node 2 --timeout 60 --exec " + worker.string() + " -- " +
                                          one_file.string() + " exp_name=tp2_from_one tensor_model_parallel_size=2 load=" +
                                          (w.path() / "g/u/cuda/checkpoints/iter_0000003").string());
    ASSERT_EQ(rr.code, 0) << rr.out;
    const auto from_one = testing::read_trainer_metrics(w.path() / "g/u/tp2_from_one/metrics.jsonl");
    ASSERT_EQ(from_one.loss.size(), 3u);
    for (auto [step, l] : from_one.loss) EXPECT_NEAR(l, one.loss.at(step), 1e-5 * l) << "tp2 from one, step " << step;
  }
}

// Sharded data parallelism through the trainer: two processes (Gloo between them, the model in
// host mode), each reading its half of every global batch of 8 (micro-batch 4, no accumulation),
// give one process's losses (micro-batch 4, two accumulated) and validation losses within 1e-5
// under optim_grads and optim_grads_params; the step-3 checkpoint of the FSDP run (put together
// from the ranks' chunks) resumes as one process with the same losses, and one process's as FSDP.
TEST(CudaHostTrainer, ShardedDataParallelTwoProcessesTrainAsOne) {
  primus::testing::Workdir w;
  const std::string base = testing::tiny_trainer_experiment("cuda", w.str());
  auto one_file = w.write("one.yaml", base);
  run_host_trainer(one_file, {});
  const auto one = testing::read_trainer_metrics(w.path() / "g/u/cuda/metrics.jsonl");
  ASSERT_EQ(one.loss.size(), 6u);
  const std::filesystem::path worker = std::filesystem::path(PRIMUS_BINARY_DIR) / "bin" / "cuda_host_trainer_worker";
  for (const std::string strategy : {"optim_grads", "optim_grads_params"}) {
    const std::string name = "dp2_" + strategy;
    auto r = primus::testing::run_primus("launch --nproc-per-node 2 --timeout 60 --exec " + worker.string() + " -- " +
                                         one_file.string() + " exp_name=" + name +
                                         " data_parallel_sharding_strategy=" + strategy);
    ASSERT_EQ(r.code, 0) << r.out;
    EXPECT_NE(r.out.find("data_parallel_sharding_strategy " + strategy), std::string::npos) << r.out;
    const auto two = testing::read_trainer_metrics(w.path() / "g/u" / name / "metrics.jsonl");
    ASSERT_EQ(two.loss.size(), 6u) << name;
    for (auto [step, l] : one.loss) EXPECT_NEAR(two.loss.at(step), l, 1e-5 * l) << name << " step " << step;
    ASSERT_EQ(two.val.size(), one.val.size());
    for (auto [step, l] : one.val) EXPECT_NEAR(two.val.at(step), l, 1e-5 * l) << name << " validation at " << step;
    if (strategy != "optim_grads_params") continue;
    const auto ckpt3 = w.path() / "g/u" / name / "checkpoints/iter_0000003";
    ASSERT_TRUE(std::filesystem::exists(ckpt3)) << ckpt3;
    run_host_trainer(one_file, {"exp_name=from_fsdp2", "load=" + ckpt3.string()});
    const auto resumed = testing::read_trainer_metrics(w.path() / "g/u/from_fsdp2/metrics.jsonl");
    ASSERT_EQ(resumed.loss.size(), 3u);
    for (auto [step, l] : resumed.loss) EXPECT_NEAR(l, one.loss.at(step), 1e-5 * l) << "resumed step " << step;
    auto rr = primus::testing::run_primus("launch --nproc-per-node 2 --timeout 60 --exec " + worker.string() + " -- " +
                                          one_file.string() + " exp_name=fsdp2_from_one data_parallel_sharding_strategy=" +
                                          strategy + " load=" + (w.path() / "g/u/cuda/checkpoints/iter_0000003").string());
    ASSERT_EQ(rr.code, 0) << rr.out;
    const auto from_one = testing::read_trainer_metrics(w.path() / "g/u/fsdp2_from_one/metrics.jsonl");
    ASSERT_EQ(from_one.loss.size(), 3u);
    for (auto [step, l] : from_one.loss) EXPECT_NEAR(l, one.loss.at(step), 1e-5 * l) << "fsdp2 from one, step " << step;
  }
}

// Context parallelism through the trainer: two processes (Gloo between them, the model in host
// mode), each holding chunks r and 3 - r of every sequence of the same batches, give one process's
// losses and validation losses within 1e-5; their step-3 checkpoint resumes as one process with the
// same losses, and one process's resumes as cp2.
TEST(CudaHostTrainer, ContextParallelTwoProcessesTrainAsOne) {
  primus::testing::Workdir w;
  const std::string base = testing::tiny_trainer_experiment("cuda", w.str());
  auto one_file = w.write("one.yaml", base);
  run_host_trainer(one_file, {});
  const auto one = testing::read_trainer_metrics(w.path() / "g/u/cuda/metrics.jsonl");
  ASSERT_EQ(one.loss.size(), 6u);
  const std::filesystem::path worker = std::filesystem::path(PRIMUS_BINARY_DIR) / "bin" / "cuda_host_trainer_worker";
  auto r = primus::testing::run_primus("launch --nproc-per-node 2 --timeout 60 --exec " + worker.string() + " -- " +
                                       one_file.string() + " exp_name=cp2 context_parallel_size=2");
  ASSERT_EQ(r.code, 0) << r.out;
  EXPECT_NE(r.out.find("context parallel over 2 ranks"), std::string::npos) << r.out;
  const auto two = testing::read_trainer_metrics(w.path() / "g/u/cp2/metrics.jsonl");
  ASSERT_EQ(two.loss.size(), 6u);
  for (auto [step, l] : one.loss) EXPECT_NEAR(two.loss.at(step), l, 1e-5 * l) << "cp2 step " << step;
  ASSERT_EQ(two.val.size(), one.val.size());
  for (auto [step, l] : one.val) EXPECT_NEAR(two.val.at(step), l, 1e-5 * l) << "cp2 validation at " << step;
  const auto ckpt3 = w.path() / "g/u/cp2/checkpoints/iter_0000003";
  ASSERT_TRUE(std::filesystem::exists(ckpt3)) << ckpt3;
  run_host_trainer(one_file, {"exp_name=from_cp2", "load=" + ckpt3.string()});
  const auto resumed = testing::read_trainer_metrics(w.path() / "g/u/from_cp2/metrics.jsonl");
  ASSERT_EQ(resumed.loss.size(), 3u);
  for (auto [step, l] : resumed.loss) EXPECT_NEAR(l, one.loss.at(step), 1e-5 * l) << "resumed step " << step;
  auto rr = primus::testing::run_primus("launch --nproc-per-node 2 --timeout 60 --exec " + worker.string() + " -- " +
                                        one_file.string() + " exp_name=cp2_from_one context_parallel_size=2 load=" +
                                        (w.path() / "g/u/cuda/checkpoints/iter_0000003").string());
  ASSERT_EQ(rr.code, 0) << rr.out;
  const auto from_one = testing::read_trainer_metrics(w.path() / "g/u/cp2_from_one/metrics.jsonl");
  ASSERT_EQ(from_one.loss.size(), 3u);
  for (auto [step, l] : from_one.loss) EXPECT_NEAR(l, one.loss.at(step), 1e-5 * l) << "cp2 from one, step " << step;
}

}  // namespace
}  // namespace primus::backends::cuda
