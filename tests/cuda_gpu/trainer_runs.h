// For the tests that run a trainer end to end: the experiment they train (a tiny GPT-2 on
// tinyshakespeare) and a run's metrics.jsonl as step -> loss and step -> validation loss.
#pragma once
#include <gtest/gtest.h>

#include "backends/cuda/args.h"
#include "backends/cuda/hooks.h"
#include "backends/cuda/register.h"
#include "backends/cuda/trainer.h"
#include "core/backend/backend.h"
#include "core/config/experiment.h"
#include "core/patches/registry.h"
#include "io/checkpoint.h"
#include "parallel/launch_env.h"
#include <cstdint>
#include <cstdlib>
#include <filesystem>
#include <fstream>
#include <map>
#include <nlohmann/json.hpp>
#include <string>
#include <utility>
#include <vector>

namespace primus::backends::cuda::testing {

// The experiment file's text: `framework` (its name is also exp_name) trains a tiny GPT-2 (2 layers,
// hidden 64, bytes) on tinyshakespeare for 6 steps of 2 micro-batches, evaluating and
// checkpointing every 3 steps, under workspace `ws`; `model` names another model file (its own
// keys beyond those set here keep their values, e.g. moe/tiny.yaml's experts, llama/tiny.yaml's 2
// key/value groups), `heads` the attention heads and `micro` the micro-batch (of a global batch of
// 8). The data come from $PRIMUS_SOURCE_DIR (the GPU machine's copy of the tree), else this
// build's source folder.
inline std::string tiny_trainer_experiment(const std::string& framework, const std::string& ws,
                                           const std::string& model = "gpt2/tiny.yaml", int heads = 2, int micro = 4) {
  const char* env = std::getenv("PRIMUS_SOURCE_DIR");
  const std::string src = env && *env ? env : PRIMUS_SOURCE_DIR;
  return "work_group: g\nuser_name: u\nexp_name: " + framework + "\nworkspace: " + ws +
         "\nmodules:\n  pre_trainer:\n    framework: " + framework +
         "\n    config: pretrain.yaml\n    model: " + model + "\n    overrides:\n"
         "      tokenizer_type: bytes\n      vocab_size: 256\n      seq_length: 64\n      num_layers: 2\n"
         "      hidden_size: 64\n      num_attention_heads: " + std::to_string(heads) + "\n      ffn_hidden_size: 256\n"
         "      data_path: [" + src + "/examples/data/tinyshakespeare.txt]\n"
         "      split: 0.95\n      train_iters: 6\n      micro_batch_size: " + std::to_string(micro) + "\n      global_batch_size: 8\n"
         "      lr: 2.0e-3\n      min_lr: 2.0e-4\n      lr_warmup_iters: 2\n      log_interval: 1\n"
         "      eval_interval: 3\n      eval_iters: 2\n      save_interval: 3\n";
}

struct TrainerMetrics {
  std::map<int64_t, double> loss, val, test;
};

inline TrainerMetrics read_trainer_metrics(const std::filesystem::path& p) {
  TrainerMetrics m;
  std::ifstream f(p);
  std::string line;
  while (std::getline(f, line)) {
    auto j = nlohmann::json::parse(line);
    if (j.contains("loss")) m.loss[j["step"]] = j["loss"];
    if (j.contains("val_loss")) m.val[j["step"]] = j["val_loss"];
    if (j.contains("test_loss")) m.test[j["step"]] = j["test_loss"];
  }
  return m;
}

// The runs `want` and `got` under workspace `ws` (g/u/<name>/metrics.jsonl): 6 steps each, every
// step's loss and validation loss within 1e-5 relative. Returns both runs' metrics.
inline std::pair<TrainerMetrics, TrainerMetrics> expect_same_trainer_runs(const std::filesystem::path& ws,
                                                                          const std::string& want,
                                                                          const std::string& got) {
  const auto a = read_trainer_metrics(ws / "g/u" / want / "metrics.jsonl");
  const auto b = read_trainer_metrics(ws / "g/u" / got / "metrics.jsonl");
  EXPECT_EQ(a.loss.size(), 6u) << want;
  EXPECT_EQ(b.loss.size(), 6u) << got;
  for (auto [step, l] : a.loss) {
    EXPECT_TRUE(b.loss.count(step)) << got << ": no loss at step " << step;
    if (b.loss.count(step)) {
      EXPECT_NEAR(b.loss.at(step), l, 1e-5 * l) << got << " step " << step;
    }
  }
  for (auto [step, l] : a.val) {
    EXPECT_TRUE(b.val.count(step)) << got << ": no validation loss at step " << step;
    if (b.val.count(step)) {
      EXPECT_NEAR(b.val.at(step), l, 1e-5 * l) << got << " validation at step " << step;
    }
  }
  EXPECT_EQ(b.val.size(), a.val.size()) << got;
  return {a, b};
}

// Runs the cuda trainer in host mode in this process, with the build_args patches' effects
// (accumulation steps, the data-parallel size) applied by hand: the runtime would need a device
// for prepare(). Under a launcher's variables (RANK, WORLD_SIZE, ...) it is one rank of the job.
inline void run_host_trainer(const std::filesystem::path& exp_file, std::vector<std::string> cli) {
  BackendRegistry backends;
  patches::PatchRegistry reg;
  register_backend(backends, reg);
  auto adapter = backends.create("cuda");
  auto exp = config::load_experiment(exp_file, config::parse_cli_overrides(cli));
  auto cfg = config::resolve_module(exp, "pre_trainer", adapter->schema());
  auto args = std::static_pointer_cast<CudaArgs>(adapter->convert_config(cfg, exp));
  args->host_mode = true;
  const int64_t world = parallel::read_dist_env().world_size;
  // As the data_parallel_size patch: world / (tp x cp x pp), the ep ranks among them.
  args->train.data_parallel_size = args->train.model_parallel.for_world(world)[parallel::Dim::DP] *
                                   args->train.model_parallel[parallel::Dim::EP];
  args->train.grad_accum_steps =
      args->train.global_batch_size / (args->train.micro_batch_size * args->train.data_parallel_size);
  args->launch_ahead = cfg.params.find_path("launch_ahead")->as_bool();  // patch cuda.step.launch_ahead
  args->optimizer_in_bwd = cfg.params.find_path("optimizer_in_bwd")->as_bool();  // patch cuda.optimizer.in_backward
  args->bf16_expert_grads = cfg.params.find_path("moe_expert_grad_dtype")->as_string() == "bf16";  // patch cuda.moe.bf16_expert_grads
  args->split_master = cfg.params.find_path("master_weights")->as_string() == "split";  // patch cuda.optimizer.split_master
  CudaOps ops = CudaOps::defaults();
  if (const std::string fp8 = cfg.params.find_path("fp8")->as_string(); fp8 != "none") {  // patch cuda.linear.fp8
    const turbo::Fp8Recipe r = configure_fp8(*args, fp8, cfg.params.find_path("fp8_recipe")->as_string());
    use_fp8_linear(ops, r);
    if (args->model.moe.enabled()) use_fp8_moe(ops, r);  // patch cuda.moe.fp8 (with the same weight copies)
  }
  CudaTrainer trainer(args, ops);
  trainer.setup();
  trainer.init();
  trainer.train();
  trainer.cleanup(false);
}

// fp8_recipe delayed through the trainer (host mode) on the tiny experiment `exp_file` under
// workspace `ws`: run "delayed" with `delayed` (its FP8 keys) must learn by `learns` over its 6
// steps and checkpoint its histories at step 3 as [tensors, history_len] (and scales [tensors]);
// a resume from there replays steps 4-6 bit for bit, validation included. Returns the whole run's
// metrics and the checkpoint's folder.
inline std::pair<TrainerMetrics, std::filesystem::path> expect_delayed_fp8_resumes(
    const std::filesystem::path& ws, const std::filesystem::path& exp_file, const std::vector<std::string>& delayed,
    int64_t tensors, int64_t history_len, double learns) {
  auto run = [&](const std::string& name, std::vector<std::string> cli) {
    cli.push_back("exp_name=" + name);
    run_host_trainer(exp_file, cli);
    return read_trainer_metrics(ws / "g/u" / name / "metrics.jsonl");
  };
  const TrainerMetrics whole = run("delayed", delayed);
  const auto ckpt3 = ws / "g/u/delayed/checkpoints/iter_0000003";
  EXPECT_EQ(whole.loss.size(), 6u);
  if (whole.loss.size() != 6u) return {whole, ckpt3};
  EXPECT_LT(whole.loss.at(6), whole.loss.at(1) - learns) << "the run must learn";
  const io::CheckpointData saved = io::load_checkpoint(ckpt3);
  EXPECT_TRUE(saved.optimizer.count("fp8_amax_history")) << "the histories are not in the checkpoint";
  if (!saved.optimizer.count("fp8_amax_history")) return {whole, ckpt3};
  EXPECT_EQ(saved.optimizer.at("fp8_amax_history").shape(), (std::vector<int64_t>{tensors, history_len}));
  EXPECT_EQ(saved.optimizer.at("fp8_scale").shape(), (std::vector<int64_t>{tensors}));
  std::vector<std::string> resume = delayed;
  resume.push_back("load=" + ckpt3.string());
  const TrainerMetrics resumed = run("delayed_resumed", resume);
  EXPECT_EQ(resumed.loss.size(), 3u);
  for (auto [step, l] : resumed.loss) EXPECT_EQ(l, whole.loss.at(step)) << "resumed step " << step;
  for (auto [step, l] : resumed.val) EXPECT_EQ(l, whole.val.at(step)) << "resumed validation at step " << step;
  return {whole, ckpt3};
}

}  // namespace primus::backends::cuda::testing
