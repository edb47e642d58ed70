// The CUDA trainer end to end without a GPU: CudaTrainer in host mode (the model on Turbo's CPU
// backends) against the reference backend's trainer (the real binary) on the same experiment:
// tinyshakespeare as bytes, gradient accumulation 2, clipping, warmup + cosine, eval and
// checkpoints. Same init, same batches, so every step's loss and every validation loss agree
// (fp32 on both sides: 1e-5 relative); then a resume from the step-3 checkpoint replays
// steps 4-6 with the same losses; the runs without the trainer's read-ahead of the next
// step's batches and without launch-ahead have the same losses bit for bit; and the GELU run as
// its own op in either direction still matches the reference.
#include <gtest/gtest.h>

#include <cmath>
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
#include "core/util/fs.h"
#include "io/checkpoint.h"
#include "io/safetensors.h"
#include "parallel/dist_checkpoint.h"
#include "tests/cuda_gpu/trainer_runs.h"
#include "tests/cuda_gpu/two_processes.h"
#include "tests/e2e/cli_runner.h"
#include "tests/parallel/train_e2e_util.h"

namespace primus::backends::cuda {
namespace {

using testing::run_host_trainer;

// The cuda trainer (host mode, `cli`) resumes the reference trainer's step-3 checkpoint with the
// reference's losses, and the reference (the binary, the same keys) the cuda trainer's with the
// cuda trainer's: steps 4..6 within 1e-5.
void expect_resumes_across_backends(const primus::testing::Workdir& w, const std::filesystem::path& ref_file,
                                    const std::filesystem::path& cuda_file, const std::vector<std::string>& cli,
                                    const testing::TrainerMetrics& ref, const testing::TrainerMetrics& ours) {
  std::vector<std::string> from_ref = cli;
  from_ref.push_back("exp_name=cuda_from_ref");
  from_ref.push_back("load=" + (w.path() / "g/u/reference/checkpoints/iter_0000003").string());
  run_host_trainer(cuda_file, from_ref);
  const auto a = testing::read_trainer_metrics(w.path() / "g/u/cuda_from_ref/metrics.jsonl");
  ASSERT_EQ(a.loss.size(), 3u);
  for (auto [step, l] : a.loss) EXPECT_NEAR(l, ref.loss.at(step), 1e-5 * l) << "cuda from reference, step " << step;
  std::string words;
  for (const auto& c : cli) words += " " + c;
  auto rb = primus::testing::run_primus("train pretrain --config " + ref_file.string() + words +
                                        " exp_name=ref_from_cuda load=" +
                                        (w.path() / "g/u/cuda/checkpoints/iter_0000003").string());
  ASSERT_EQ(rb.code, 0) << rb.out;
  const auto b = testing::read_trainer_metrics(w.path() / "g/u/ref_from_cuda/metrics.jsonl");
  ASSERT_EQ(b.loss.size(), 3u);
  for (auto [step, l] : b.loss) EXPECT_NEAR(l, ours.loss.at(step), 1e-5 * l) << "reference from cuda, step " << step;
}

// Two checkpoints' bf16 moments: the same values but where two runs' fp32 sums straddle a rounding
// threshold (about 1% on the tiny runs; other rounding keys turn over half of them the other way).
void expect_mostly_same_moments(const std::filesystem::path& a, const std::filesystem::path& b) {
  const auto ca = io::load_checkpoint(a), cb = io::load_checkpoint(b);
  for (const char* name : {"exp_avg", "exp_avg_sq"}) {
    const auto x = ca.optimizer.at(name).as<float>(), y = cb.optimizer.at(name).as<float>();
    ASSERT_EQ(x.size(), y.size()) << name;
    size_t same = 0;
    for (size_t i = 0; i < x.size(); ++i) same += x[i] == y[i];
    EXPECT_GT(double(same), 0.95 * double(x.size())) << name << ": " << same << " of " << x.size() << " equal";
  }
}

// The tiny experiment for both backends under `w` (ref.yaml and cuda.yaml, `extra` appended under
// their overrides) and the reference trainer's run of it (exp_name reference); false when that
// run failed.
struct TinyFiles {
  std::filesystem::path ref, cuda;
  bool ok = false;
};
TinyFiles run_reference(const primus::testing::Workdir& w, const std::string& extra = "") {
  TinyFiles f{w.write("ref.yaml", testing::tiny_trainer_experiment("reference", w.str()) + extra),
              w.write("cuda.yaml", testing::tiny_trainer_experiment("cuda", w.str()) + extra)};
  auto r = primus::testing::run_primus("train pretrain --config " + f.ref.string());
  EXPECT_EQ(r.code, 0) << r.out;
  f.ok = r.code == 0;
  return f;
}

TEST(CudaHostTrainer, MatchesTheReferenceTrainerAndResumes) {
  primus::testing::Workdir w;
  const TinyFiles files = run_reference(w);
  ASSERT_TRUE(files.ok);
  const std::filesystem::path& cuda_file = files.cuda;
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

// eod_mask_loss: no loss where the input is the end-of-document token (tinyshakespeare as bytes
// has one document a line: about two ends a row of 64). The cuda trainer counts the targets that
// keep a loss in the model (on the device in a captured step) and gives the reference trainer's
// losses and validation losses, which are not the unmasked run's; under tensor parallelism (the
// vocabulary-split loss) and context parallelism (the count summed over the group) two processes
// give one process's.
TEST(CudaHostTrainer, EodMaskedLossMatchesTheReferenceAndSplitsAsOne) {
  primus::testing::Workdir w;
  const std::string eod = "      eod_mask_loss: true\n";
  const TinyFiles files = run_reference(w, eod);
  ASSERT_TRUE(files.ok);
  const std::filesystem::path& cuda_file = files.cuda;
  run_host_trainer(cuda_file, {});
  run_host_trainer(cuda_file, {"exp_name=unmasked", "eod_mask_loss=false"});
  const auto [ref, ours] = testing::expect_same_trainer_runs(w.path(), "reference", "cuda");
  ASSERT_EQ(ref.val.size(), 2u);
  ASSERT_EQ(ours.loss.size(), 6u);
  const auto unmasked = testing::read_trainer_metrics(w.path() / "g/u/unmasked/metrics.jsonl");
  // Twice the matching tolerance at least (at step 1, the random init, the masked targets' losses
  // are near the mean: 2.6e-4 apart; later, 6e-3 and more).
  for (auto [step, l] : unmasked.loss)
    EXPECT_GT(std::abs(ours.loss.at(step) - l), 1e-4) << "step " << step << ": masked as unmasked";

  testing::TwoProcesses t(eod);
  t.expect_matches("tp2", "tensor_model_parallel_size=2", "tensor parallel over 2 ranks");
  t.expect_matches("cp2", "context_parallel_size=2", "context parallel over 2 ranks");
}

// no_load_optim: the cuda trainer resumes the reference's step-3 checkpoint with a fresh optimizer
// (AdamW counting its steps from 3) as the reference does: the same losses for steps 4..6, which
// are not the plain resume's.
TEST(CudaHostTrainer, NoLoadOptimResumesAsTheReferenceDoes) {
  primus::testing::Workdir w;
  const TinyFiles files = run_reference(w);
  ASSERT_TRUE(files.ok);
  const std::filesystem::path &ref_file = files.ref, &cuda_file = files.cuda;
  const std::string load = "load=" + (w.path() / "g/u/reference/checkpoints/iter_0000003").string();
  auto f = primus::testing::run_primus("train pretrain --config " + ref_file.string() + " exp_name=ref_fresh " + load +
                                       " no_load_optim=true");
  ASSERT_EQ(f.code, 0) << f.out;
  run_host_trainer(cuda_file, {"exp_name=cuda_fresh", load, "no_load_optim=true"});
  const auto ref = testing::read_trainer_metrics(w.path() / "g/u/ref_fresh/metrics.jsonl");
  const auto ours = testing::read_trainer_metrics(w.path() / "g/u/cuda_fresh/metrics.jsonl");
  const auto plain = testing::read_trainer_metrics(w.path() / "g/u/reference/metrics.jsonl");
  ASSERT_EQ(ref.loss.size(), 3u);
  ASSERT_EQ(ours.loss.size(), 3u);
  for (auto [step, l] : ref.loss) EXPECT_NEAR(ours.loss.at(step), l, 1e-5 * l) << "step " << step;
  EXPECT_GT(std::abs(ref.loss.at(6) - plain.loss.at(6)), 1e-3) << "a fresh optimizer is another run";
}

// A checkpoint the cuda backend writes with no_save_optim holds no moments and says so; a plain
// resume of it is refused, and with no_load_optim both backends resume it with the same losses
// and the same test loss (test_data_path, evaluated after the last step).
TEST(CudaHostTrainer, NoSaveOptimCheckpointResumesWithNoLoadOptimAsTheReferenceDoes) {
  primus::testing::Workdir w;
  const TinyFiles files = run_reference(w);
  ASSERT_TRUE(files.ok);
  run_host_trainer(files.cuda, {"exp_name=cuda_lean", "train_iters=3", "no_save_optim=true"});
  const auto ck = w.path() / "g/u/cuda_lean/checkpoints/iter_0000003";
  const auto state = nlohmann::json::parse(primus::fs::read_file(ck / "trainer_state.json"));
  EXPECT_EQ(state.value("optimizer_state", true), false);
  const auto opt = primus::io::SafetensorsFile::open(ck / "optimizer.safetensors");
  for (const auto& t : opt.tensors()) EXPECT_NE(t.name.rfind("exp_avg", 0), 0u) << t.name;
  const std::string load = "load=" + ck.string();
  EXPECT_THROW(run_host_trainer(files.cuda, {"exp_name=cuda_plain", load}), primus::ConfigError);
  const std::string test = "test_data_path=[" + (w.path() / "g/u/reference/data/tinyshakespeare-bytes_valid").string() + "]";
  auto f = primus::testing::run_primus("train pretrain --config " + files.ref.string() + " exp_name=ref_fresh " + load +
                                       " no_load_optim=true " + test);
  ASSERT_EQ(f.code, 0) << f.out;
  run_host_trainer(files.cuda, {"exp_name=cuda_fresh", load, "no_load_optim=true", test});
  const auto ref = testing::read_trainer_metrics(w.path() / "g/u/ref_fresh/metrics.jsonl");
  const auto ours = testing::read_trainer_metrics(w.path() / "g/u/cuda_fresh/metrics.jsonl");
  ASSERT_EQ(ref.loss.size(), 3u);
  ASSERT_EQ(ours.loss.size(), 3u);
  for (auto [step, l] : ref.loss) EXPECT_NEAR(ours.loss.at(step), l, 1e-5 * l) << "step " << step;
  ASSERT_EQ(ref.test.size(), 1u);
  ASSERT_EQ(ours.test.size(), 1u);
  EXPECT_NEAR(ours.test.at(6), ref.test.at(6), 1e-5 * ref.test.at(6));
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

// moe_expert_grad_dtype: bf16 is refused by name where it cannot do what it says: without experts,
// without the optimizer in the backward (a gradient accumulated in bf16), in host mode (f32).
TEST(CudaHostTrainer, Bf16ExpertGradientsAreRefusedWhereTheyCannotApply) {
  primus::testing::Workdir w;
  auto cuda_file = w.write("cuda.yaml", testing::tiny_trainer_experiment("cuda", w.str()));
  const std::vector<std::string> moe = {"num_experts=4", "moe_router_topk=2", "moe_ffn_hidden_size=32", "activation=swiglu",
                                        "add_bias_linear=false"};
  std::vector<std::string> moe_in_bwd = moe;  // only host mode is left to refuse it
  moe_in_bwd.insert(moe_in_bwd.end(), {"global_batch_size=4", "optimizer_in_bwd=true"});
  const std::vector<std::pair<std::vector<std::string>, std::string>> cases = {
      {{"global_batch_size=4", "optimizer_in_bwd=true"}, "needs an MoE model"},
      {moe, "needs optimizer_in_bwd: true"},
      {moe_in_bwd, "needs the GPU"},
  };
  for (const auto& [extra, why] : cases) {
    std::vector<std::string> cli = {"exp_name=refused", "clip_grad=0", "moe_expert_grad_dtype=bf16"};
    cli.insert(cli.end(), extra.begin(), extra.end());
    try {
      run_host_trainer(cuda_file, cli);
      ADD_FAILURE() << "accepted: " << why;
    } catch (const ConfigError& e) {
      EXPECT_NE(std::string(e.what()).find("moe_expert_grad_dtype: bf16 " + why), std::string::npos) << e.what();
    }
  }
}

// master_weights: split is refused by name in host mode, whose compute runs on the fp32 masters
// themselves (the other refusals: CudaProjection.SplitMasterWeightsHalveTheMasterBuffer).
TEST(CudaHostTrainer, SplitMasterWeightsAreRefusedInHostMode) {
  primus::testing::Workdir w;
  auto cuda_file = w.write("cuda.yaml", testing::tiny_trainer_experiment("cuda", w.str()));
  try {
    run_host_trainer(cuda_file, {"exp_name=refused", "master_weights=split"});
    ADD_FAILURE() << "accepted in host mode";
  } catch (const ConfigError& e) {
    EXPECT_NE(std::string(e.what()).find("master_weights: split: host mode"), std::string::npos) << e.what();
  }
}

// fp8_recipe delayed through the trainer (host mode, gradient accumulation 2): the amax histories
// and scales go into the checkpoint (fp8_amax_history [24, 3], fp8_scale [24]: 2 layers x 4
// linear layers x x|w|dy), and a resume from step 3 replays steps 4-6 bit for bit, validation
// included; a resume from a checkpoint without them (tensorwise) starts the histories empty and
// so does not. The recipe's keys without it are refused by name (several ranks: host_fp8_dp_test.cpp).
TEST(CudaHostTrainer, DelayedFp8ScalingResumesBitForBit) {
  primus::testing::Workdir w;
  auto cuda_file = w.write("cuda.yaml", testing::tiny_trainer_experiment("cuda", w.str()));
  const std::vector<std::string> delayed = {"fp8=hybrid", "fp8_recipe=delayed", "fp8_amax_history_len=3",
                                            "fp8_amax_compute_algo=max"};
  auto run = [&](const std::string& name, std::vector<std::string> extra) {
    std::vector<std::string> cli = extra;
    cli.push_back("exp_name=" + name);
    run_host_trainer(cuda_file, cli);
    return testing::read_trainer_metrics(w.path() / "g/u" / name / "metrics.jsonl");
  };
  const auto [whole, ckpt3] = testing::expect_delayed_fp8_resumes(w.path(), cuda_file, delayed, 24, 3, 0.3);
  ASSERT_EQ(whole.loss.size(), 6u);
  const io::CheckpointData saved = io::load_checkpoint(ckpt3);
  EXPECT_TRUE(saved.state.at("fp8_delayed").at("use_history").get<bool>());
  EXPECT_TRUE(saved.state.at("fp8_delayed").at("pending").get<bool>());

  // The same resume from a tensorwise run's checkpoint: no histories, so step 4 runs current
  // scaling and the curve is not the delayed run's.
  const auto tw = run("tensorwise", {"fp8=hybrid"});
  ASSERT_EQ(tw.loss.size(), 6u);
  std::vector<std::string> cross = delayed;
  cross.push_back("load=" + (w.path() / "g/u/tensorwise/checkpoints/iter_0000003").string());
  const auto fresh = run("from_tensorwise", cross);
  ASSERT_EQ(fresh.loss.size(), 3u);
  EXPECT_EQ(fresh.loss.at(4), tw.loss.at(4)) << "no history: current scaling, as the tensorwise run";
  EXPECT_NE(fresh.loss.at(5), tw.loss.at(5)) << "step 5 quantizes with step 4's amaxes";

  for (const auto& [bad, key] : {std::pair{std::vector<std::string>{"fp8=hybrid", "fp8_amax_history_len=4"},
                                           "fp8_amax_history_len"},
                                 std::pair{std::vector<std::string>{"fp8=e4m3", "fp8_recipe=rowwise", "fp8_margin=1"},
                                           "fp8_margin"}}) {
    try {
      run("refused", bad);
      ADD_FAILURE() << "accepted " << key << " without fp8_recipe delayed";
    } catch (const ConfigError& e) {
      EXPECT_NE(std::string(e.what()).find(std::string(key) + " applies to fp8_recipe delayed only"), std::string::npos)
          << e.what();
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
  const auto [ref, ours] = testing::expect_same_trainer_runs(w.path(), "reference", "cuda");
  ASSERT_EQ(ref.loss.size(), 6u);
  EXPECT_LT(ref.loss.at(6), ref.loss.at(1) - 0.3) << "the run must learn";

  // The cuda trainer resumes the reference's checkpoint, and the reference the cuda trainer's.
  expect_resumes_across_backends(w, ref_file, cuda_file, cli, ref, ours);

  try {
    run_host_trainer(cuda_file, {"exp_name=refused", "optimizer=muon", "optimizer_in_bwd=true", "clip_grad=0",
                                 "global_batch_size=4"});
    ADD_FAILURE() << "Muon with optimizer_in_bwd was accepted";
  } catch (const ConfigError& e) {
    EXPECT_NE(std::string(e.what()).find("optimizer: muon with optimizer_in_bwd"), std::string::npos) << e.what();
  }
}

// bf16 AdamW moments (exp_avg_dtype / exp_avg_sq_dtype: bf16) in host mode: the reference
// trainer's losses and saved moments (the same stochastic rounding, keyed by the flat layout offset
// and the step), not the fp32 moments' run; each backend resumes the other's step-3 checkpoint; the optimizer in
// the backward (its groups cut the tensors into other tables, the keys stay the elements') gives
// the update after the backward's losses bit for bit.
TEST(CudaHostTrainer, Bf16MomentsMatchTheReferenceAndResumeAcrossBackends) {
  primus::testing::Workdir w;
  auto ref_file = w.write("ref.yaml", testing::tiny_trainer_experiment("reference", w.str()));
  auto cuda_file = w.write("cuda.yaml", testing::tiny_trainer_experiment("cuda", w.str()));
  const std::vector<std::string> cli = {"use_precision_aware_optimizer=true", "exp_avg_dtype=bf16",
                                        "exp_avg_sq_dtype=bf16", "adam_beta2=0.999", "lr=0.01"};
  std::string words;
  for (const auto& c : cli) words += " " + c;
  auto r = primus::testing::run_primus("train pretrain --config " + ref_file.string() + words);
  ASSERT_EQ(r.code, 0) << r.out;
  run_host_trainer(cuda_file, cli);
  std::vector<std::string> f32 = {"adam_beta2=0.999", "lr=0.01", "exp_name=f32"};
  run_host_trainer(cuda_file, f32);
  const auto ref = testing::read_trainer_metrics(w.path() / "g/u/reference/metrics.jsonl");
  const auto ours = testing::read_trainer_metrics(w.path() / "g/u/cuda/metrics.jsonl");
  const auto full = testing::read_trainer_metrics(w.path() / "g/u/f32/metrics.jsonl");
  ASSERT_EQ(ref.loss.size(), 6u);
  ASSERT_EQ(ours.loss.size(), 6u);
  for (auto [step, l] : ref.loss) EXPECT_NEAR(ours.loss.at(step), l, 1e-5 * l) << "step " << step;
  for (auto [step, l] : ref.val) EXPECT_NEAR(ours.val.at(step), l, 1e-5 * l) << "validation at step " << step;
  EXPECT_LT(ref.loss.at(6), ref.loss.at(1) - 0.3) << "the run must learn";
  EXPECT_NE(full.loss.at(6), ours.loss.at(6)) << "the moments were rounded";
  // The saved moments (the same keys on both sides).
  expect_mostly_same_moments(w.path() / "g/u/reference/checkpoints/iter_0000006",
                             w.path() / "g/u/cuda/checkpoints/iter_0000006");

  expect_resumes_across_backends(w, ref_file, cuda_file, cli, ref, ours);

  auto one_micro = [&](const std::string& name, bool inside) {
    std::vector<std::string> c = cli;
    c.insert(c.end(), {"global_batch_size=4", "clip_grad=0", "exp_name=" + name});
    if (inside) c.push_back("optimizer_in_bwd=true");
    run_host_trainer(cuda_file, c);
    return testing::read_trainer_metrics(w.path() / "g/u" / name / "metrics.jsonl");
  };
  const auto after = one_micro("after", false), in_bwd = one_micro("in_bwd", true);
  ASSERT_EQ(after.loss.size(), 6u);
  for (auto [step, l] : after.loss) EXPECT_EQ(in_bwd.loss.at(step), l) << "optimizer in the backward, step " << step;
}

// bf16 AdamW moments beside the model's sharded data parallelism: ZeRO-1 (host mode runs it in the
// model) and optim_grads_params over two processes give one process's losses, and the moments the
// latter saves (put together from the ranks' chunks) are one process's bf16 values but where the
// fp32 sums straddle a rounding threshold (each shard's pieces round with their elements' keys in
// the whole layout); the ZeRO-1 checkpoint moves both ways.
TEST(CudaHostTrainer, Bf16MomentsBesideShardedDataParallelismTrainAsOne) {
  testing::TwoProcesses t("      use_precision_aware_optimizer: true\n      exp_avg_dtype: bf16\n"
                          "      exp_avg_sq_dtype: bf16\n");
  t.expect_matches("dp2_zero1", "use_distributed_optimizer=true", "");
  t.expect_matches("dp2_fsdp", "data_parallel_sharding_strategy=optim_grads_params", "");
  expect_mostly_same_moments(t.dir() / "g/u/cuda/checkpoints/iter_0000006",
                             t.dir() / "g/u/dp2_fsdp/checkpoints/iter_0000006");
  t.expect_checkpoints_move("dp2_zero1", "use_distributed_optimizer=true");
}

// Muon beside plain data parallelism (the replicas' gradients averaged, then every replica
// orthogonalises the same momenta): two processes give one process's losses and validation losses.
TEST(CudaHostTrainer, MuonBesideDataParallelTrainsAsOne) {
  testing::TwoProcesses t("      optimizer: muon\n");
  t.expect_matches("dp2", "", "data parallel: 2 ranks");
}

// Muon beside tensor and context parallelism. tp: each rank's blocks of the weight matrices are
// row ranges (q, k, v, gate, up, the experts' gate and up) or column ranges (the output
// projections, the experts' down projections) of the global blocks; the momentum updates are
// gathered over the tp group and every rank orthogonalises the whole matrix, so GPT-2 tp2 and
// tp2+sp, a GQA Llama tp2 x dp2 and the tiny MoE tp2 give one process's losses and validation
// losses, and the tp2 checkpoint (Muon's momentum as its own per-rank flat state) moves both ways.
// cp: the gradients averaged over the cp group before the update (cp2 x dp2 on the Llama). tp4
// over the Llama's two key/value groups: each k|v piece on two ranks, gathered once.
TEST(CudaHostTrainer, MuonBesideTensorAndContextParallelTrainsAsOne) {
  const std::string muon = "      optimizer: muon\n";
  {
    testing::TwoProcesses t(muon, "gpt2/tiny.yaml", 2);
    t.expect_matches("tp2", "tensor_model_parallel_size=2", "tensor parallel over 2 ranks");
    t.expect_matches("tp2sp", "tensor_model_parallel_size=2 sequence_parallel=true", "");
    t.expect_checkpoints_move("tp2", "tensor_model_parallel_size=2");
  }
  {
    testing::TwoProcesses l(muon, "llama/tiny.yaml", 4);
    l.expect_matches("tp2dp2", "tensor_model_parallel_size=2", "x data parallel over 2 ranks", 1e-5, 4);
    l.expect_matches("cp2dp2", "context_parallel_size=2", "", 1e-5, 4);
    // Four ranks over two key/value groups: k and v replicated on two ranks each.
    l.expect_matches("tp4", "tensor_model_parallel_size=4", "", 1e-5, 4);
  }
  testing::TwoProcesses m(muon, "moe/tiny.yaml", 4);
  m.expect_matches("tp2", "tensor_model_parallel_size=2", "");
}

// Tensor parallelism through the cuda trainer: tp2, with and without sequence parallelism, gives
// one process's losses and validation losses; the checkpoint tp2 saves at step 3 (weights in the
// global layout, moments as per-rank shards) resumes as one process, and one process's as tp2.
TEST(CudaHostTrainer, TensorParallelTwoProcessesTrainAsOne) {
  testing::TwoProcesses t;
  t.expect_matches("tp2", "tensor_model_parallel_size=2", "tensor parallel over 2 ranks");
  t.expect_matches("tp2sp", "tensor_model_parallel_size=2 sequence_parallel=true", "tensor parallel over 2 ranks");
  const auto ckpt3 = t.dir() / "g/u/tp2/checkpoints/iter_0000003";
  for (int k = 0; k < 2; ++k)  // the moments: one shard file per rank
    EXPECT_TRUE(std::filesystem::exists(ckpt3 / parallel::shard_file_name(k, 2))) << "rank " << k;
  t.expect_checkpoints_move("tp2", "tensor_model_parallel_size=2");
}

// A stop signal that reaches one rank of a tp2 job (rank 1, once the step-20 checkpoint exists; rank
// 0 never gets one): the ranks vote through the store after every step, so both stop after the
// same step, save it together and exit 0, rank 0 saying another rank was signalled; the saved
// step resumes under tp2.
TEST(CudaHostTrainer, StopSignalToOneTensorParallelRankStopsBothAtOneStep) {
  primus::testing::Workdir w;
  const auto file = w.write("tp2.yaml", testing::tiny_trainer_experiment("cuda", w.str()));
  const std::filesystem::path save = w.path() / "g/u/cuda/checkpoints";
  const std::string worker = std::string(PRIMUS_BINARY_DIR) + "/bin/cuda_host_trainer_worker";
  auto launch = [&](const std::string& keys, const std::string& env) {
    return primus::testing::run_primus("launch --nproc-per-node 2 --timeout 60 --exec " + worker + " -- " +
                                           file.string() + " tensor_model_parallel_size=2 " + keys,
                                       env);
  };
  auto r = launch("train_iters=100000 save_interval=20 eval_interval=0",
                  "PRIMUS_TEST_SIGNAL_RANK=1 PRIMUS_TEST_SIGNAL_AFTER=" +
                      (save / primus::io::kTrackerFile).string());
  ASSERT_EQ(r.code, 0) << r.out;
  const std::string said = "[signal] another rank received a stop signal: checkpoint of step ";
  const auto at = r.out.find(said);
  ASSERT_NE(at, std::string::npos) << r.out;
  const int64_t stopped = std::stoll(r.out.substr(at + said.size()));
  EXPECT_GE(stopped, 20);
  EXPECT_LT(stopped, 100000);
  const auto latest = primus::io::find_latest(save);
  ASSERT_TRUE(latest.has_value());
  EXPECT_EQ(latest->iteration, stopped);
  auto resumed = launch("exp_name=resumed train_iters=" + std::to_string(stopped + 2) + " load=" + save.string(), "");
  ASSERT_EQ(resumed.code, 0) << resumed.out;
  EXPECT_NE(resumed.out.find("resumed from"), std::string::npos) << resumed.out;
}

// Sharded data parallelism through the trainer: each process reads its half of every global batch
// of 8 (micro-batch 4, no accumulation) against one process's micro-batch 4 accumulated twice,
// under optim_grads and optim_grads_params; the FSDP checkpoint (put together from the ranks'
// chunks) resumes as one process, and one process's as FSDP.
TEST(CudaHostTrainer, ShardedDataParallelTwoProcessesTrainAsOne) {
  testing::TwoProcesses t;
  for (const std::string strategy : {"optim_grads", "optim_grads_params"})
    t.expect_matches("dp2_" + strategy, "data_parallel_sharding_strategy=" + strategy,
                     "data_parallel_sharding_strategy " + strategy);
  t.expect_checkpoints_move("dp2_optim_grads_params", "data_parallel_sharding_strategy=optim_grads_params");
}

// Context parallelism through the trainer: each process holds chunks r and 3 - r of every sequence
// of the same batches; the cp2 checkpoint resumes as one process, and one process's as cp2.
TEST(CudaHostTrainer, ContextParallelTwoProcessesTrainAsOne) {
  testing::TwoProcesses t;
  t.expect_matches("cp2", "context_parallel_size=2", "context parallel over 2 ranks");
  t.expect_checkpoints_move("cp2", "context_parallel_size=2");
}

// Plain data parallelism through the trainer in host mode (each replica's gradients averaged over
// the dp group after its backward), alone and beside tensor or context parallelism in Megatron's
// rank order (tp2 x dp2 and cp2 x dp2: four processes, ranks {0, 1} and {2, 3} the tp / cp groups,
// {0, 2} and {1, 3} the dp groups): one process's losses and validation losses. The replica of dp
// coordinate 0 writes the checkpoints (tp: its two ranks' moment shards, no file from the other
// replica); they resume as one process, and one process's resumes on the same layout.
TEST(CudaHostTrainer, DataParallelBesideTensorAndContextParallelTrainsAsOne) {
  testing::TwoProcesses t;
  t.expect_matches("dp2", "", "data parallel: 2 ranks");
  t.expect_matches("tp2dp2", "tensor_model_parallel_size=2", "tensor parallel over 2 ranks (gloo group) x data parallel "
                   "over 2 ranks", 1e-5, 4);
  t.expect_matches("tp2spdp2", "tensor_model_parallel_size=2 sequence_parallel=true",
                   "tensor parallel over 2 ranks with sequence parallelism", 1e-5, 4);
  t.expect_matches("cp2dp2", "context_parallel_size=2", "x data parallel over 2 ranks", 1e-5, 4);
  const auto ckpt3 = t.dir() / "g/u/tp2dp2/checkpoints/iter_0000003";
  for (int k = 0; k < 2; ++k)
    EXPECT_TRUE(std::filesystem::exists(ckpt3 / parallel::shard_file_name(k, 2))) << "tp rank " << k;
  for (int k = 0; k < 4; ++k)
    EXPECT_FALSE(std::filesystem::exists(ckpt3 / parallel::shard_file_name(k, 4))) << "a file per rank of 4: " << k;
  t.expect_checkpoints_move("tp2dp2", "tensor_model_parallel_size=2", 4);
  t.expect_checkpoints_move("cp2dp2", "context_parallel_size=2", 4);
}

// Tensor and context parallelism together (tp fastest: ranks {0, 1} and {2, 3} the tp groups,
// {0, 2} and {1, 3} the cp groups), with and without sequence parallelism, and with data
// parallelism beside both (eight processes, tp2 x cp2 x dp2): one process's losses and validation
// losses. The tp group of cp and dp coordinates 0 writes the checkpoints; they move both ways.
TEST(CudaHostTrainer, TensorAndContextParallelTogetherTrainAsOne) {
  testing::TwoProcesses t;
  t.expect_matches("tp2cp2", "tensor_model_parallel_size=2 context_parallel_size=2",
                   "tensor parallel over 2 ranks (gloo group) x context parallel over 2 ranks", 1e-5, 4);
  t.expect_matches("tp2spcp2", "tensor_model_parallel_size=2 sequence_parallel=true context_parallel_size=2", "", 1e-5, 4);
  t.expect_matches("tp2cp2dp2", "tensor_model_parallel_size=2 context_parallel_size=2", "x data parallel over 2 ranks",
                   1e-5, 8);
  const auto ckpt3 = t.dir() / "g/u/tp2cp2/checkpoints/iter_0000003";
  for (int k = 0; k < 2; ++k)
    EXPECT_TRUE(std::filesystem::exists(ckpt3 / parallel::shard_file_name(k, 2))) << "tp rank " << k;
  t.expect_checkpoints_move("tp2cp2", "tensor_model_parallel_size=2 context_parallel_size=2", 4);
  t.expect_checkpoints_move("tp2cp2dp2", "tensor_model_parallel_size=2 context_parallel_size=2", 8);
}

// The sharded strategies beside context parallelism shard over dp x cp (Megatron's gradient group):
// cp2 alone shards over its two ranks, cp2 x dp2 over four; one process's losses and validation
// losses, and the checkpoints (put together from every rank's chunks) move both ways.
TEST(CudaHostTrainer, ShardedDataParallelBesideContextParallelTrainsAsOne) {
  testing::TwoProcesses t;
  for (const std::string strategy : {"optim_grads", "optim_grads_params"}) {
    t.expect_matches("cp2_" + strategy, "context_parallel_size=2 data_parallel_sharding_strategy=" + strategy,
                     "sharded over dp x cp = 2 ranks");
    t.expect_matches("cp2dp2_" + strategy, "context_parallel_size=2 data_parallel_sharding_strategy=" + strategy,
                     "sharded over dp x cp = 4 ranks", 1e-5, 4);
  }
  t.expect_checkpoints_move("cp2dp2_optim_grads_params",
                            "context_parallel_size=2 data_parallel_sharding_strategy=optim_grads_params", 4);
}

// The sharded strategies beside tensor parallelism (TorchTitan's 2-D layout, FSDP x tp), sharded
// over the dp x cp ranks of each tp coordinate: each rank's chunks of its tp slices, the per-head
// and sequence-parallel partial gradients summed over the tp group on the chunks. tp2 x dp2 under
// both strategies (with and without sequence parallelism), tp2 x cp2 x dp2 under FSDP (eight
// processes); one process's losses and validation losses, and the checkpoints (written by the tp
// group of dp coordinate 0) move both ways.
TEST(CudaHostTrainer, ShardedDataParallelBesideTensorParallelTrainsAsOne) {
  testing::TwoProcesses t;
  for (const std::string strategy : {"optim_grads", "optim_grads_params"}) {
    t.expect_matches("tp2dp2_" + strategy, "tensor_model_parallel_size=2 data_parallel_sharding_strategy=" + strategy,
                     "data_parallel_sharding_strategy " + strategy, 1e-5, 4);
  }
  t.expect_matches("tp2spdp2_fsdp",
                   "tensor_model_parallel_size=2 sequence_parallel=true data_parallel_sharding_strategy=optim_grads_params",
                   "", 1e-5, 4);
  t.expect_matches("tp2cp2dp2_fsdp",
                   "tensor_model_parallel_size=2 context_parallel_size=2 data_parallel_sharding_strategy=optim_grads_params",
                   "sharded over dp x cp = 4 ranks", 1e-5, 8);
  t.expect_checkpoints_move("tp2dp2_optim_grads_params",
                            "tensor_model_parallel_size=2 data_parallel_sharding_strategy=optim_grads_params", 4);
}

// The distributed optimizer (ZeRO-1: use_distributed_optimizer, or its newer name
// data_parallel_sharding_strategy optim) in host mode and beside tensor or context parallelism:
// the model's sharded data parallelism with the gradients whole, sharded over dp x cp. At
// micro-batch 2 every rank accumulates micro-batches (two under dp2, four under cp2) and reduces
// once a step: dp2, tp2 x dp2, cp2 alone (sharded over its two ranks) and tp2 with sequence
// parallelism x cp2 give one process's losses and validation losses; the tp2 x dp2 checkpoint
// moves both ways.
TEST(CudaHostTrainer, DistributedOptimizerBesideTensorAndContextParallelTrainsAsOne) {
  testing::TwoProcesses t("", "gpt2/tiny.yaml", 2, 2);
  t.expect_matches("dp2_zero1", "use_distributed_optimizer=true", "data_parallel_sharding_strategy optim (gloo group)");
  t.expect_matches("tp2dp2_zero1", "tensor_model_parallel_size=2 data_parallel_sharding_strategy=optim",
                   "the gradients accumulate whole and are reduce-scattered once a step", 1e-5, 4);
  t.expect_matches("cp2_zero1", "context_parallel_size=2 use_distributed_optimizer=true",
                   "sharded over dp x cp = 2 ranks");
  t.expect_matches("tp2spcp2_zero1",
                   "tensor_model_parallel_size=2 sequence_parallel=true context_parallel_size=2 "
                   "use_distributed_optimizer=true",
                   "sharded over dp x cp = 2 ranks", 1e-5, 4);
  t.expect_checkpoints_move("tp2dp2_zero1", "tensor_model_parallel_size=2 use_distributed_optimizer=true", 4);
}

// The optimizer in the backward beside context parallelism (one micro-batch of 8 a step, clip 0):
// each layer's gradients averaged over the cp group before its update. cp2 and tp2 x cp2 of a GQA
// Llama and cp2 of the tiny MoE (switch loss, its counts summed over the group) give one
// process's losses and validation losses; the cp2 checkpoint moves both ways.
TEST(CudaHostTrainer, OptimizerInBackwardBesideContextParallelTrainsAsOne) {
  const std::string oib = "      optimizer_in_bwd: true\n      clip_grad: 0\n";
  {
    testing::TwoProcesses t(oib, "llama/tiny.yaml", 4, 8);
    t.expect_matches("cp2", "context_parallel_size=2", "context parallel over 2 ranks");
    t.expect_checkpoints_move("cp2", "context_parallel_size=2");
    // Beside tp too: the cp mean, then the tp sums, of each layer's gradients.
    t.expect_matches("tp2cp2", "context_parallel_size=2 tensor_model_parallel_size=2", "", 1e-5, 4);
  }
  testing::TwoProcesses m(oib, "moe/tiny.yaml", 4, 8);
  m.expect_matches("cp2", "context_parallel_size=2", "context parallel over 2 ranks");
}

// The optimizer in the backward beside data parallelism (a global batch of 8, one micro-batch a
// step: 4 on each of two replicas against 8 on one process; clip 0; each rank evaluates 4 batches
// of 4 where the one process evaluates 2 of 8, the same samples): each layer's gradients
// averaged over the replicas (over dp x cp beside context parallelism) before its update, the
// layers in two gradient windows. GPT-2 dp2, a GQA Llama dp2 x cp2 and tp2 x dp2 (four processes)
// and the tiny MoE dp2 give one process's losses and validation losses; the dp2 checkpoint moves
// both ways. Delayed FP8 scaling beside it keeps one process's losses only with the step's amaxes
// max-reduced over the replicas. ZeRO-1 beside it is refused by name.
TEST(CudaHostTrainer, OptimizerInBackwardBesideDataParallelTrainsAsOne) {
  const std::string oib = "      optimizer_in_bwd: true\n      clip_grad: 0\n";
  {
    testing::TwoProcesses t(oib, "gpt2/tiny.yaml", 2, 8);
    t.expect_matches("dp2", "micro_batch_size=4 eval_iters=4", "replicated optimizer in the backward");
    t.expect_checkpoints_move("dp2", "micro_batch_size=4 eval_iters=4");
    t.expect_refused("zero1", "micro_batch_size=4 eval_iters=4 use_distributed_optimizer=true",
                     "optimizer_in_bwd: true with use_distributed_optimizer (ZeRO-1) over 2 data-parallel ranks");
  }
  {
    testing::TwoProcesses l(oib, "llama/tiny.yaml", 4, 8);
    l.expect_matches("cp2dp2", "context_parallel_size=2 micro_batch_size=4 eval_iters=4", "", 1e-5, 4);
    l.expect_matches("tp2dp2", "tensor_model_parallel_size=2 micro_batch_size=4 eval_iters=4", "x data parallel over 2 ranks",
                     1e-5, 4);
  }
}

// The same for the tiny MoE (switch aux loss, z-loss) and DeepSeek-style routing (sigmoid,
// group-limited, expert bias moved by the replicas' summed loads, a shared expert). The switch
// loss is each rank's own micro-batch's, as Megatron's: the reference is one process accumulating
// the replicas' two micro-batches of 4 (clip 0), whose loss terms are the same.
TEST(CudaHostTrainerMoe, OptimizerInBackwardBesideDataParallelTrainsAsOne) {
  {
    testing::TwoProcesses m("      clip_grad: 0\n", "moe/tiny.yaml", 4, 4);
    m.expect_matches("dp2", "optimizer_in_bwd=true", "replicated optimizer in the backward");
  }
  testing::TwoProcesses d("      clip_grad: 0\n      moe_router_score_function: sigmoid\n      moe_router_num_groups: 4\n"
                          "      moe_router_group_topk: 2\n      moe_router_enable_expert_bias: true\n"
                          "      moe_aux_loss_coeff: 0.0\n      moe_shared_expert_intermediate_size: 64\n",
                          "moe/tiny.yaml", 4, 4);
  d.expect_matches("dp2", "optimizer_in_bwd=true", "");
}

// Delayed FP8 scaling with the optimizer in the backward beside data parallelism: the step's amaxes
// max-reduced over the replicas, so that each keeps one process's histories and scales. Against
// one process accumulating the replicas' two micro-batches of 4 (the first step's current scaling
// then sees the same samples as each replica's): dp2 gives its losses and validation losses.
TEST(CudaHostTrainer, OptimizerInBackwardWithDelayedFp8BesideDataParallelTrainsAsOne) {
  testing::TwoProcesses f("      clip_grad: 0\n      fp8: hybrid\n      fp8_recipe: delayed\n"
                          "      fp8_amax_history_len: 3\n      fp8_amax_compute_algo: max\n",
                          "gpt2/tiny.yaml", 2, 4);
  f.expect_matches("dp2", "optimizer_in_bwd=true", "replicated optimizer in the backward");
}

// The optimizer in the backward beside tensor parallelism (one micro-batch of 8 a step, clip 0):
// each layer's partial gradients summed over the tp group and its replicated key/value rows
// exchanged just before its update, its norm counted once over the group. GPT-2 tp2 and tp2+sp
// (the norms' and row-parallel biases' gradients partial), Qwen3 tp2 (per-head q/k norms), a GQA
// Llama tp4 (key/value groups replicated) and the tiny MoE tp2 (the router partial) give one
// process's losses, validation losses and gradient norms.
TEST(CudaHostTrainer, OptimizerInBackwardBesideTensorParallelTrainsAsOne) {
  const std::string oib = "      optimizer_in_bwd: true\n      clip_grad: 0\n";
  auto expect_norms = [](const testing::TwoProcesses& t, const std::string& run) {
    const auto one = primus::testing::losses(t.dir() / "g/u/cuda", "grad_norm");
    ASSERT_EQ(one.size(), 6u);
    primus::testing::expect_same_losses(one, primus::testing::losses(t.dir() / "g/u" / run, "grad_norm"),
                                        run + " grad norm");
  };
  {
    testing::TwoProcesses t(oib, "gpt2/tiny.yaml", 2, 8);
    t.expect_matches("tp2", "tensor_model_parallel_size=2", "tensor parallel over 2 ranks");
    expect_norms(t, "tp2");
    t.expect_matches("tp2sp", "tensor_model_parallel_size=2 sequence_parallel=true", "");
    expect_norms(t, "tp2sp");
    t.expect_checkpoints_move("tp2", "tensor_model_parallel_size=2");
  }
  {
    testing::TwoProcesses q(oib, "qwen3/tiny.yaml", 4, 8);
    q.expect_matches("tp2", "tensor_model_parallel_size=2", "");
    expect_norms(q, "tp2");
  }
  {
    testing::TwoProcesses l(oib, "llama/tiny.yaml", 4, 8);
    l.expect_matches("tp4", "tensor_model_parallel_size=4", "tensor parallel over 4 ranks", 1e-5, 4);
    expect_norms(l, "tp4");
  }
  testing::TwoProcesses m(oib, "moe/tiny.yaml", 4, 8);
  m.expect_matches("tp2", "tensor_model_parallel_size=2", "");
  expect_norms(m, "tp2");
}

// MoE layers under tensor parallelism (every expert's and the shared expert's FFN split over the
// tp ranks, the router replicated: each rank routes the whole batch alike, its part of the logits'
// gradient summed over the group, the aux and z terms counted once): the tiny MoE (softmax top-2,
// switch aux loss and z-loss) as tp2, tp2 with sequence parallelism, tp2 x dp2 and tp2 under
// ZeRO-1 x dp2 gives one process's losses and validation losses; the tp2 checkpoint moves both
// ways; DeepSeek-style routing (sigmoid, group-limited, expert bias, a shared expert) as tp2 x dp2.
TEST(CudaHostTrainerMoe, TensorParallelExpertsTrainAsOne) {
  {
    testing::TwoProcesses t("", "moe/tiny.yaml", 4);
    t.expect_matches("tp2", "tensor_model_parallel_size=2", "tensor parallel over 2 ranks");
    t.expect_matches("tp2sp", "tensor_model_parallel_size=2 sequence_parallel=true", "");
    t.expect_matches("tp2dp2", "tensor_model_parallel_size=2", "x data parallel over 2 ranks", 1e-5, 4);
    t.expect_matches("tp2dp2_zero1", "tensor_model_parallel_size=2 use_distributed_optimizer=true", "", 1e-5, 4);
    t.expect_checkpoints_move("tp2", "tensor_model_parallel_size=2");
  }
  testing::TwoProcesses d("      moe_router_score_function: sigmoid\n      moe_router_num_groups: 4\n"
                          "      moe_router_group_topk: 2\n      moe_router_enable_expert_bias: true\n"
                          "      moe_aux_loss_coeff: 0.0\n      moe_shared_expert_intermediate_size: 64\n",
                          "moe/tiny.yaml", 4);
  d.expect_matches("tp2dp2", "tensor_model_parallel_size=2", "", 1e-5, 4);
}

// The same with grouped-query attention and RoPE (Llama: 4 heads over 2 key/value groups; tp4
// replicates each group on two ranks, whose key/value gradients are summed over them) and with
// Qwen3's per-head q/k norms (their weights' gradients are partial on every tp rank), each also
// under FSDP beside tp, and Qwen3 under ZeRO-1 beside tp.
TEST(CudaHostTrainer, MeshLayoutsTrainGqaModelsAsOne) {
  {
    testing::TwoProcesses t("", "llama/tiny.yaml", 4);
    t.expect_matches("tp2cp2", "tensor_model_parallel_size=2 context_parallel_size=2", "", 1e-5, 4);
    t.expect_matches("tp2spcp2", "tensor_model_parallel_size=2 sequence_parallel=true context_parallel_size=2", "", 1e-5,
                     4);
    t.expect_matches("tp4cp2", "tensor_model_parallel_size=4 context_parallel_size=2", "", 1e-5, 8);
    // FSDP beside tp: the replicated key/value rows' exchange and their norm on the chunks.
    t.expect_matches("tp4dp2_fsdp", "tensor_model_parallel_size=4 data_parallel_sharding_strategy=optim_grads_params", "",
                     1e-5, 8);
  }
  testing::TwoProcesses q("", "qwen3/tiny.yaml", 4);
  q.expect_matches("tp2cp2", "tensor_model_parallel_size=2 context_parallel_size=2", "", 1e-5, 4);
  q.expect_matches("tp2dp2_fsdp", "tensor_model_parallel_size=2 data_parallel_sharding_strategy=optim_grads_params", "",
                   1e-5, 4);
  // ZeRO-1 beside tp: the partial q/k norm gradients summed over the tp group on the shards.
  q.expect_matches("tp2dp2_zero1", "tensor_model_parallel_size=2 use_distributed_optimizer=true", "", 1e-5, 4);
}

}  // namespace
}  // namespace primus::backends::cuda
