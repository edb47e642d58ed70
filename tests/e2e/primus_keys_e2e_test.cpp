// Primus' experiments through the binary. Its logging keys: stderr_sink_level sets the console's
// level (and PRIMUS_LOG_LEVEL wins over it), log_avg_skip_iterations leaves the first steps out of
// the progress lines' average, and a level that is no level is refused naming the key. The other
// keys its Megatron-LM experiments set carry over or are refused by name, and an experiment
// written as Primus writes them (pre_trainer.yaml, its override block) plans on the cuda backend.
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

TEST(PrimusKeysE2E, StderrSinkLevelQuietensTheConsoleAndTheEnvironmentWins) {
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

TEST(PrimusKeysE2E, TheAverageLeavesOutTheFirstSteps) {
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

TEST(PrimusKeysE2E, PrimusKeysCarryOverOrAreRefusedByName) {
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
      {"overlap_param_gather=true use_distributed_optimizer=true",
       "overlap_param_gather: true with a sharded optimizer (optim) is not implemented"},
      {"disable_tensorboard=true tensorboard_dir=/tmp/tb", "disable_tensorboard is true but tensorboard_dir is set"},
  };
  for (const auto& [keys, message] : refused) {
    auto r = run_primus(args + " " + keys + " --dry-run");
    EXPECT_EQ(r.code, 2) << keys << "\n" << r.out;
    EXPECT_NE(r.out.find(message), std::string::npos) << keys << "\n" << r.out;
  }
  for (const char* ok_keys : {"overlap_param_gather=false use_distributed_optimizer=true", "overlap_param_gather=true"}) {
    auto ok = run_primus(args + " " + ok_keys + " --dry-run");
    EXPECT_EQ(ok.code, 0) << ok_keys << "\n" << ok.out;
  }
}

// Megatron-LM's tokenizer names: HuggingFaceTokenizer reads tokenizer_model (here a folder holding a
// placeholder tokenizer.json: a dry run resolves the path without reading the file),
// GPT2BPETokenizer is the built-in GPT-2 BPE; the wrong combinations are refused.
TEST(PrimusKeysE2E, MegatronTokenizerNamesResolve) {
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

// An experiment as Primus writes one for Megatron-LM (its module config name, its override block
// for a Mixtral, with the values this backend implements) plans unchanged on the cuda backend; each
// value it does not implement is refused naming the key, and Primus' platform section and framework
// names are refused with what to write instead.
TEST(PrimusKeysE2E, APrimusStyleMixtralExperimentPlansOnTheCudaBackend) {
  if (run_primus("backends").out.find("cuda ") == std::string::npos) {
    GTEST_SKIP() << "this build has no cuda backend (the sanitizer build leaves it out)";
  }
  Workdir w;
  const std::string head = "work_group: ${TEAM:amd}\nuser_name: ${USER:root}\nexp_name: ${EXP_NAME:exp_pretrain}\n"
                           "workspace: " + w.str() + "/output\n";
  const std::string module =
      "modules:\n  pre_trainer:\n    config: pre_trainer.yaml\n    framework: FRAMEWORK\n"
      "    model: moe/mixtral-8x7B.yaml\n    overrides:\n"
      "      wandb_project: \"Mixtral_Pretrain\"\n      stderr_sink_level: DEBUG\n"
      "      moe_router_force_load_balancing: true\n      moe_router_dtype: fp32\n"
      "      log_avg_skip_iterations: 2\n      log_avg_reset_interval: 5\n"
      "      train_iters: 3\n      micro_batch_size: 1\n      global_batch_size: 8\n"
      "      seq_length: ${PRIMUS_SEQ_LENGTH:4096}\n      max_position_embeddings: ${PRIMUS_MAX_POSITION_EMBEDDINGS:4096}\n"
      "      lr: 1.0e-5\n      min_lr: 0.0\n      lr_warmup_iters: 2\n      lr_decay_iters: null\n"
      "      lr_decay_style: cosine\n      weight_decay: 0.1\n      adam_beta1: 0.9\n      adam_beta2: 0.95\n"
      "      eod_mask_loss: true\n      init_method_std: 0.008\n      norm_epsilon: 1.0e-6\n"
      "      tensor_model_parallel_size: ${PRIMUS_TP:1}\n      pipeline_model_parallel_size: ${PRIMUS_PP:1}\n"
      "      expert_model_parallel_size: ${PRIMUS_EP:1}\n      overlap_grad_reduce: true\n"
      "      overlap_param_gather: true\n      mock_data: true\n"
      "      train_data_path: ${TOKENIZED_DATA_PATH:null}\n      valid_data_path: null\n      test_data_path: null\n"
      "      moe_use_legacy_grouped_gemm: true\n"
      "      enable_primus_turbo: true\n      use_turbo_attention: true\n      use_turbo_grouped_mlp: true\n"
      "      moe_use_fused_router_with_aux_score: true\n      turbo_sync_free_moe_stage: 2\n"
      "      use_turbo_parallel_linear: true\n      multi_latent_attention: false\n      mtp_num_layers: null\n"
      "      cross_entropy_fusion_impl: \"te\"\n      cross_entropy_loss_fusion: true\n"
      "      finetune: false\n      auto_continue_train: true\n      load: null\n      no_load_optim: null\n"
      "      no_load_rng: null\n      save: null\n      save_interval: 20000\n      no_save_optim: null\n"
      "      no_save_rng: null\n      disable_last_saving: true\n";
  auto with = [&](const std::string& framework, const std::string& extra, const std::string& top = "") {
    std::string m = module;
    m.replace(m.find("FRAMEWORK"), 9, framework);
    return w.write("exp.yaml", head + top + m + extra).string();
  };
  auto plan = run_primus("train pretrain --config " + with("cuda", "") + " --dry-run");
  EXPECT_EQ(plan.code, 0) << plan.out;
  EXPECT_NE(plan.out.find("pre_trainer.yaml"), std::string::npos) << plan.out;
  EXPECT_NE(plan.out.find("attention_backend: turbo"), std::string::npos) << plan.out;  // use_turbo_attention
  EXPECT_EQ(plan.out.find("cuda.grad.unfused_accumulation: condition true"), std::string::npos) << plan.out;
  // Most of Primus' examples switch Megatron-LM's fused weight-gradient accumulation off.
  auto unfused = run_primus("train pretrain --config " + with("cuda", "      gradient_accumulation_fusion: false\n") +
                            " --dry-run");
  EXPECT_EQ(unfused.code, 0) << unfused.out;
  EXPECT_NE(unfused.out.find("apply cuda.grad.unfused_accumulation: condition true (gradient_accumulation_fusion=false)"),
            std::string::npos) << unfused.out;

  const std::pair<std::string, std::string> refused[] = {
      {"      ckpt_format: torch\n", "ckpt_format: torch: Primus writes its own checkpoints"},
      {"      moe_permute_fusion: false\n", "moe_permute_fusion"},
      {"      use_turbo_deepep: true\n", "use_turbo_deepep: true is not implemented (DeepEP is not implemented)"},
      {"      turbo_gemm_backend: hipblaslt\n", "'hipblaslt' names Primus-Turbo's AMD backends"},
  };
  for (const auto& [extra, message] : refused) {
    auto r = run_primus("train pretrain --config " + with("cuda", extra) + " --dry-run");
    EXPECT_EQ(r.code, 2) << extra << r.out;
    EXPECT_NE(r.out.find(message), std::string::npos) << extra << r.out;
  }
  auto megatron = run_primus("train pretrain --config " + with("megatron", "") + " --dry-run");
  EXPECT_EQ(megatron.code, 2) << megatron.out;
  EXPECT_NE(megatron.out.find("here the backend does: cuda (NVIDIA GPUs) or reference (CPU)"), std::string::npos)
      << megatron.out;
  auto platform = run_primus("train pretrain --config " +
                             with("cuda", "", "platform:\n  config: platform_azure.yaml\n") + " --dry-run");
  EXPECT_EQ(platform.code, 2) << platform.out;
  EXPECT_NE(platform.out.find("Primus' `platform` section is not read here"), std::string::npos) << platform.out;
}

// Megatron-LM's training keys that Primus' experiments and launch scripts set: exit_interval
// checkpoints and exits 0 after a multiple (a resume stops at the next), lr_warmup_fraction replaces
// the module config's warmup and is refused beside the experiment's own, the garbage-collection keys
// are accepted (no collector here) and a switched-off NaN check is refused by name.
TEST(PrimusKeysE2E, MegatronTrainingKeysCarryOver) {
  namespace fs = std::filesystem;
  Workdir w;
  const std::string args = tiny_run_args(w.str()) + " train_iters=10 log_interval=1 exit_interval=4 manual_gc=true "
                                                    "manual_gc_interval=1 check_for_nan_in_loss_and_grad=true";
  auto first = run_primus(args);
  ASSERT_EQ(first.code, 0) << first.out;
  EXPECT_NE(first.out.find("[stop] step 4 is a multiple of exit_interval 4: checkpoint of step 4"), std::string::npos)
      << first.out;
  EXPECT_EQ(step_lines(first.out).size(), 4u) << first.out;
  auto again = run_primus(args + " auto_continue_train=true");
  ASSERT_EQ(again.code, 0) << again.out;
  EXPECT_NE(again.out.find("[stop] step 8 is a multiple of exit_interval 4"), std::string::npos) << again.out;
  EXPECT_EQ(step_lines(again.out).size(), 4u) << again.out;
  bool ckpt8 = false;
  for (const auto& e : fs::recursive_directory_iterator(w.path()))
    ckpt8 = ckpt8 || e.path().filename() == "iter_0000008";
  EXPECT_TRUE(ckpt8) << "no checkpoint of step 8 under " << w.str();

  auto nan = run_primus(args + " check_for_nan_in_loss_and_grad=false");
  EXPECT_EQ(nan.code, 2) << nan.out;
  EXPECT_NE(nan.out.find("check_for_nan_in_loss_and_grad: false is not implemented"), std::string::npos) << nan.out;

  const std::string exp = w.write("warm.yaml",
                                  "workspace: " + w.str() + "/warm\nmodules:\n  pre_trainer:\n    framework: reference\n"
                                  "    config: pretrain.yaml\n    model: gpt2/tiny.yaml\n    overrides:\n"
                                  "      mock_data: true\n      train_iters: 100\n      lr_warmup_fraction: 0.25\n")
                              .string();
  auto plan = run_primus("train pretrain --config " + exp + " --dry-run");
  ASSERT_EQ(plan.code, 0) << plan.out;
  EXPECT_NE(plan.out.find("(cosine, warmup 25)"), std::string::npos) << plan.out;
  auto both = run_primus("train pretrain --config " + exp + " --dry-run lr_warmup_iters=3");
  EXPECT_EQ(both.code, 2) << both.out;
  EXPECT_NE(both.out.find("warm.yaml:10:27: lr_warmup_fraction and <command line: lr_warmup_iters=3>"),
            std::string::npos)
      << both.out;
}

// Megatron-LM's recompute_activations (true: recompute_granularity selective; false leaves it as
// set) and deterministic_mode (deterministic) on the cuda backend.
TEST(PrimusKeysE2E, MegatronRecomputeAndDeterminismNamesOnTheCudaBackend) {
  if (run_primus("backends").out.find("cuda ") == std::string::npos) {
    GTEST_SKIP() << "this build has no cuda backend (the sanitizer build leaves it out)";
  }
  Workdir w;
  const std::string base = "train pretrain --config " + std::string(PRIMUS_SOURCE_DIR) +
                           "/examples/cuda/gpt2-124M-shakespeare.yaml --dry-run workspace=" + w.str();
  const std::pair<const char*, const char*> plans[] = {
      {"recompute_activations=true", "apply cuda.memory.recompute: condition true (recompute_granularity=selective)"},
      {"recompute_activations=false recompute_granularity=full", "(recompute_granularity=full)"},
      {"recompute_activations=false", "skip  cuda.memory.recompute"},
      {"deterministic_mode=true", "apply cuda.attention.deterministic"},
  };
  for (const auto& [keys, planned] : plans) {
    auto r = run_primus(base + " " + keys);
    ASSERT_EQ(r.code, 0) << keys << "\n" << r.out;
    EXPECT_NE(r.out.find(planned), std::string::npos) << keys << "\n" << r.out;
  }
}
