// The mesh end to end through the real binary on the reference backend, with real processes over
// Gloo: the tiny GPT-2 (LayerNorm, GELU, learned positions, biases, tied head) and the tiny Llama
// (RMSNorm, SwiGLU, RoPE, GQA with kv heads split) train under tp2, tp2 with sequence parallelism,
// dp2 x tp2 (ZeRO-1), ZeRO-2 and FSDP on 2 ranks, FSDP x tp2, cp2 and cp2 x tp2 with the losses,
// gradient norms and validation losses of one process over 20 steps. Checkpoints load under any layout: tp ones are
// written in the global layout, FSDP ones as per-rank shards of the moments, and each resumes
// under another layout with the uninterrupted run's losses and exports to Hugging Face. What a
// layout cannot split yet is refused by name before training.
#include <gtest/gtest.h>

#include <filesystem>
#include <iostream>
#include <iterator>
#include <string>
#include <type_traits>
#include <vector>

#include "tests/e2e/cli_runner.h"
#include "tests/parallel/train_e2e_util.h"

namespace {

namespace fs = std::filesystem;
using primus::testing::expect_same_losses;
using primus::testing::launch;
using primus::testing::losses;
using primus::testing::run_primus;
using primus::testing::save_dir;
using primus::testing::Workdir;

// 4 heads (tp2: 2 a rank), Llama's 2 kv groups (1 a rank), global batch 4 (dp2: one micro-batch
// of 2 a rank). Byte vocabulary 256: 128 rows a rank.
std::string run_args(const std::string& example_and_model, const std::string& ws, int iters, const std::string& extra) {
  return "train pretrain --config " + std::string(PRIMUS_SOURCE_DIR) + "/examples/reference/" + example_and_model +
         " seq_length=32 micro_batch_size=2 global_batch_size=4 train_iters=" + std::to_string(iters) +
         " eval_interval=10 eval_iters=2 log_interval=1 sample_tokens=0 lr_warmup_iters=2 lr_decay_iters=20 "
         "save_interval=10 workspace=" + ws + " " + extra;
}

std::string gpt2_args(const std::string& ws, int iters, const std::string& extra = "") {
  return run_args("shakespeare.yaml num_layers=2 hidden_size=32 num_attention_heads=4 ffn_hidden_size=64", ws, iters,
                  extra);
}

std::string llama_args(const std::string& ws, int iters, const std::string& extra = "") {
  return run_args("llama-shakespeare.yaml", ws, iters, extra);
}

using ArgsFn = std::string (*)(const std::string&, int, const std::string&);

void expect_layouts_match_one_process(ArgsFn args, const std::string& model, bool replicated_kv = false) {
  Workdir one;
  auto r1 = run_primus(args(one.str(), 20, ""));
  ASSERT_EQ(r1.code, 0) << r1.out;
  const auto want = losses(one.path()), want_norm = losses(one.path(), "grad_norm");
  const auto want_val = losses(one.path(), "val_loss");
  ASSERT_EQ(want.size(), 20u);
  ASSERT_EQ(want_val.size(), 2u);
  const struct {
    int ranks;
    const char* keys;
    const char* name;
  } layouts[] = {
      {2, "tensor_model_parallel_size=2", "tp2"},
      {2, "tensor_model_parallel_size=2 sequence_parallel=true", "tp2 + sp"},
      {4, "tensor_model_parallel_size=2 sequence_parallel=true use_distributed_optimizer=true", "dp2 x tp2, ZeRO-1"},
      {2, "data_parallel_sharding_strategy=optim_grads", "ZeRO-2"},
      {2, "data_parallel_sharding_strategy=optim_grads_params", "FSDP"},
      {4, "data_parallel_sharding_strategy=optim_grads_params tensor_model_parallel_size=2 sequence_parallel=true",
       "FSDP x tp2 + sp"},
      {2, "context_parallel_size=2", "cp2"},
      {4, "context_parallel_size=2 tensor_model_parallel_size=2 sequence_parallel=true", "cp2 x tp2 + sp"},
  };
  std::vector<std::remove_cv_t<std::remove_reference_t<decltype(layouts[0])>>> runs(std::begin(layouts), std::end(layouts));
  // 4 ranks over the Llama's 2 key/value groups: each replicated on two ranks.
  if (replicated_kv) {
    runs.push_back({4, "tensor_model_parallel_size=4", "tp4 (kv groups replicated)"});
    runs.push_back({8, "tensor_model_parallel_size=4 data_parallel_sharding_strategy=optim_grads_params",
                    "FSDP x tp4 (kv groups replicated)"});
  }
  for (const auto& l : runs) {
    Workdir w;
    auto r = run_primus(launch(l.ranks, args(w.str(), 20, l.keys)));
    ASSERT_EQ(r.code, 0) << model << " " << l.name << "\n" << r.out;
    const std::string keys = l.keys;
    EXPECT_NE(r.out.find(keys.find("tensor_model_parallel_size=4") != std::string::npos ? "tensor parallel over 4 ranks"
                         : keys.find("tensor") != std::string::npos  ? "tensor parallel over 2 ranks"
                         : keys.find("context") != std::string::npos ? "context parallel over 2 ranks"
                                                                     : "data parallel over 2 ranks"),
              std::string::npos)
        << r.out;
    const std::string what = model + " " + l.name;
    expect_same_losses(want, losses(w.path()), what);
    expect_same_losses(want_norm, losses(w.path(), "grad_norm"), what + " grad norm");
    expect_same_losses(want_val, losses(w.path(), "val_loss"), what + " validation");
  }
}

TEST(MeshTraining, Gpt2UnderEveryLayoutGivesTheLossesOfOneProcess) {
  expect_layouts_match_one_process(gpt2_args, "gpt2");
}

TEST(MeshTraining, LlamaUnderEveryLayoutGivesTheLossesOfOneProcess) {
  expect_layouts_match_one_process(llama_args, "llama", /*replicated_kv=*/true);
}

TEST(MeshTraining, TensorParallelCheckpointsAreGlobalAndResumeUnderAnyLayout) {
  Workdir full, on1, single, on_tp, hf;
  // dp2 x tp2 with ZeRO-1 saves at step 10; one process resumes it.
  auto a = run_primus(launch(4, llama_args(full.str(), 20, "tensor_model_parallel_size=2 use_distributed_optimizer=true")));
  ASSERT_EQ(a.code, 0) << a.out;
  const auto want = losses(full.path());
  ASSERT_EQ(want.size(), 20u);
  const fs::path ck10 = primus::io::checkpoint_dir(save_dir(full.path()), 10);
  ASSERT_TRUE(fs::exists(ck10 / primus::io::kManifestFile)) << ck10;
  auto b = run_primus(llama_args(on1.str(), 20, "load=" + ck10.string()));
  ASSERT_EQ(b.code, 0) << b.out;
  EXPECT_NE(b.out.find("resumed from"), std::string::npos) << b.out;
  expect_same_losses(want, losses(on1.path()), "tp2 x dp2 checkpoint resumed on 1 process", 11);
  Workdir on_cp;
  auto b2 = run_primus(launch(2, llama_args(on_cp.str(), 20, "context_parallel_size=2 load=" + ck10.string())));
  ASSERT_EQ(b2.code, 0) << b2.out;
  expect_same_losses(want, losses(on_cp.path()), "tp2 x dp2 checkpoint resumed on cp2", 11);

  // The other way: one process saves, tp2 with sequence parallelism resumes.
  auto c = run_primus(llama_args(single.str(), 20));
  ASSERT_EQ(c.code, 0) << c.out;
  const fs::path ck = primus::io::checkpoint_dir(save_dir(single.path()), 10);
  auto d = run_primus(launch(2, llama_args(on_tp.str(), 20, "tensor_model_parallel_size=2 sequence_parallel=true load=" +
                                                                  ck.string())));
  ASSERT_EQ(d.code, 0) << d.out;
  expect_same_losses(losses(single.path()), losses(on_tp.path()), "1-process checkpoint resumed on tp2 + sp", 11);

  // A tp checkpoint exports like any other.
  auto e = run_primus("export hf " + save_dir(full.path()).string() + " " + hf.str() + " --dtype fp32");
  ASSERT_EQ(e.code, 0) << e.out;
  EXPECT_TRUE(fs::exists(hf.path() / "config.json")) << e.out;
  EXPECT_TRUE(fs::exists(hf.path() / "model.safetensors")) << e.out;
}

// FSDP writes every rank's slices of the moments (one segment per unit) beside rank 0's weights;
// one process resumes them, and a one-process checkpoint resumes under FSDP x tp2, which then
// samples from the gathered model.
TEST(MeshTraining, FsdpCheckpointsResumeOnOneProcessAndOneProcessOnFsdpTimesTp) {
  Workdir full, on1, single, on_mesh;
  auto a = run_primus(launch(2, llama_args(full.str(), 20, "data_parallel_sharding_strategy=optim_grads_params")));
  ASSERT_EQ(a.code, 0) << a.out;
  const auto want = losses(full.path());
  const fs::path ck10 = primus::io::checkpoint_dir(save_dir(full.path()), 10);
  EXPECT_TRUE(fs::exists(ck10 / "optimizer.rank00001-of-00002.safetensors")) << ck10;
  auto b = run_primus(llama_args(on1.str(), 20, "load=" + ck10.string()));
  ASSERT_EQ(b.code, 0) << b.out;
  EXPECT_NE(b.out.find("saved by 2 ranks, resharded for 1"), std::string::npos) << b.out;
  expect_same_losses(want, losses(on1.path()), "FSDP checkpoint resumed on 1 process", 11);

  auto c = run_primus(llama_args(single.str(), 20));
  ASSERT_EQ(c.code, 0) << c.out;
  const fs::path ck = primus::io::checkpoint_dir(save_dir(single.path()), 10);
  auto d = run_primus(launch(4, llama_args(on_mesh.str(), 20,
                                           "data_parallel_sharding_strategy=optim_grads_params "
                                           "tensor_model_parallel_size=2 sample_tokens=8 load=" + ck.string())));
  ASSERT_EQ(d.code, 0) << d.out;
  EXPECT_NE(d.out.find("[sample]"), std::string::npos) << d.out;
  expect_same_losses(losses(single.path()), losses(on_mesh.path()), "1-process checkpoint resumed on FSDP x tp2", 11);
}

// Muon under context parallelism on the reference backend: the cp ranks' gradients are averaged
// over dp x cp before the update, so Newton-Schulz sees the whole batch's gradient. cp2 and cp2 x
// dp2 with ZeRO-1 (whole matrices per owner over the dp x cp group) give one process's losses,
// gradient norms and validation losses.
TEST(MeshTraining, MuonUnderContextParallelismGivesTheLossesOfOneProcess) {
  Workdir one;
  auto r1 = run_primus(llama_args(one.str(), 20, "optimizer=muon"));
  ASSERT_EQ(r1.code, 0) << r1.out;
  ASSERT_EQ(losses(one.path()).size(), 20u);
  for (const auto& [ranks, keys] : {std::pair{2, "context_parallel_size=2"},
                                    std::pair{4, "context_parallel_size=2 use_distributed_optimizer=true"}}) {
    Workdir w;
    auto r = run_primus(launch(ranks, llama_args(w.str(), 20, std::string("optimizer=muon ") + keys)));
    ASSERT_EQ(r.code, 0) << keys << "\n" << r.out;
    EXPECT_NE(r.out.find("context parallel over 2 ranks"), std::string::npos) << r.out;
    expect_same_losses(losses(one.path()), losses(w.path()), keys);
    expect_same_losses(losses(one.path(), "grad_norm"), losses(w.path(), "grad_norm"), std::string(keys) + " grad norm");
    expect_same_losses(losses(one.path(), "val_loss"), losses(w.path(), "val_loss"), std::string(keys) + " validation");
  }
}

// MoE layers under context parallelism on the reference backend: a rank holds two chunks of
// each sequence, so the balancing losses' counts (and the sequence-wise loss's sums of p) are
// summed over the cp group before the router's backward. With the aux coefficient raised to 0.5
// (chunks balanced on their own would move the losses well beyond the gate), cp2 gives one
// process's losses, gradient norms, validation losses and logged aux losses, for the switch loss
// (beside expert parallelism too) and for DeepSeek-V3's sequence-wise loss.
TEST(MeshTraining, MoeUnderContextParallelismGivesTheLossesOfOneProcess) {
  const std::string model = "moe-shakespeare.yaml num_layers=2 hidden_size=32 moe_ffn_hidden_size=32 moe_aux_loss_coeff=0.5";
  for (const std::string balance : {"", "moe_router_load_balancing_type=seq_aux_loss"}) {
    Workdir one, two;
    auto r1 = run_primus(run_args(model, one.str(), 10, balance));
    ASSERT_EQ(r1.code, 0) << r1.out;
    ASSERT_EQ(losses(one.path()).size(), 10u);
    auto r2 = run_primus(launch(2, run_args(model, two.str(), 10, balance + " context_parallel_size=2")));
    ASSERT_EQ(r2.code, 0) << balance << "\n" << r2.out;
    EXPECT_NE(r2.out.find("context parallel over 2 ranks"), std::string::npos) << r2.out;
    for (const char* key : {"loss", "grad_norm", "val_loss", "moe/layer0/aux_loss", "moe/layer1/aux_loss",
                            "moe/layer1/load_cv"})
      expect_same_losses(losses(one.path(), key), losses(two.path(), key), balance + " " + key);
    if (!balance.empty()) continue;
    // Beside expert parallelism (dp2 x cp2, the experts over 2 of the ranks): four processes.
    Workdir four;
    auto r4 = run_primus(launch(4, run_args(model, four.str(), 10, "context_parallel_size=2 expert_model_parallel_size=2")));
    ASSERT_EQ(r4.code, 0) << r4.out;
    EXPECT_NE(r4.out.find("the experts over 2 of them"), std::string::npos) << r4.out;
    for (const char* key : {"loss", "grad_norm", "val_loss", "moe/layer0/aux_loss"})
      expect_same_losses(losses(one.path(), key), losses(four.path(), key), std::string("cp2 x ep2 ") + key);
  }
}

// moe_router_load_balancing_type global_aux_loss on the reference backend: the loads are the
// global batch's (the counts summed over the data-parallel ranks), so dp2 with one micro-batch of
// 2 a rank trains as one process whose single micro-batch of 4 holds both ranks' sequences under
// the micro-batch switch loss: the same losses, gradient norms and logged aux losses (not the
// validation losses: eval_iters batches of micro_batch_size are other sequences at 4 than at 2).
// dp2 with the micro-batch loss (each rank's own loads) is the control: with the aux coefficient
// at 0.5 it moves the losses beyond the gate. The global run evaluates 3 batches over its 2 ranks:
// the forward's sum of the counts is a collective, so both ranks run 2 forwards (rank 1 one of
// them uncounted) and the evaluation finishes.
TEST(MeshTraining, GlobalAuxLossOverDataParallelRanksIsTheGlobalBatchsLoss) {
  const std::string model = "moe-shakespeare.yaml num_layers=2 hidden_size=32 moe_ffn_hidden_size=32 moe_aux_loss_coeff=0.5";
  Workdir one, global, local;
  auto r1 = run_primus(run_args(model, one.str(), 10, "micro_batch_size=4"));
  ASSERT_EQ(r1.code, 0) << r1.out;
  ASSERT_EQ(losses(one.path()).size(), 10u);
  auto rg = run_primus(
      launch(2, run_args(model, global.str(), 10, "moe_router_load_balancing_type=global_aux_loss eval_iters=3")));
  ASSERT_EQ(rg.code, 0) << rg.out;
  for (const char* key : {"loss", "grad_norm", "moe/layer0/aux_loss", "moe/layer1/aux_loss", "moe/layer1/load_cv"})
    expect_same_losses(losses(one.path(), key), losses(global.path(), key), std::string("global_aux_loss dp2 ") + key);
  EXPECT_EQ(losses(global.path(), "val_loss").size(), 1u) << "dp2's evaluation (collectives in the forward)";
  auto rl = run_primus(launch(2, run_args(model, local.str(), 10, "")));
  ASSERT_EQ(rl.code, 0) << rl.out;
  const auto a = losses(one.path(), "moe/layer0/aux_loss"), b = losses(local.path(), "moe/layer0/aux_loss");
  ASSERT_EQ(a.size(), b.size());
  double most = 0;
  for (const auto& [step, v] : a) most = std::max(most, std::abs(v - b.at(step)) / std::abs(v));
  EXPECT_GT(most, 1e-3) << "the micro-batch loss over dp2 logged the global batch's aux losses: the control failed";
}

// eod_mask_loss: the mean over the targets that keep a loss (tinyshakespeare as bytes holds one
// document a line, so about two ends a row of 32). Context parallelism counts them over the whole
// sequences (every rank the group's count), the tensor-parallel loss over split vocabularies scales
// alike, and the data-parallel ranks' micro-batches are one process's accumulated ones: one
// process's losses and validation losses, which are not the unmasked run's.
TEST(MeshTraining, EodMaskedLossUnderEachParallelismGivesTheLossesOfOneProcess) {
  Workdir one, plain;
  auto r1 = run_primus(llama_args(one.str(), 10, "eod_mask_loss=true"));
  ASSERT_EQ(r1.code, 0) << r1.out;
  auto dry = run_primus(llama_args(one.str(), 10, "eod_mask_loss=true --dry-run"));
  EXPECT_NE(dry.out.find("eod_mask_loss true"), std::string::npos) << dry.out;
  auto rp = run_primus(llama_args(plain.str(), 10, ""));
  ASSERT_EQ(rp.code, 0) << rp.out;
  const auto want = losses(one.path()), want_val = losses(one.path(), "val_loss"), unmasked = losses(plain.path());
  ASSERT_EQ(want.size(), 10u);
  ASSERT_EQ(unmasked.size(), 10u);
  // The prediction of a line's first byte from the end of the one before is among the hardest:
  // leaving it out lowers the mean once the model has learnt the rest.
  const double last = want.rbegin()->second, last_unmasked = unmasked.rbegin()->second;
  EXPECT_LT(last, last_unmasked - 0.01) << "masked " << last << ", unmasked " << last_unmasked;
  for (const char* keys : {"context_parallel_size=2", "tensor_model_parallel_size=2", ""}) {
    Workdir w;
    auto r = run_primus(launch(2, llama_args(w.str(), 10, std::string("eod_mask_loss=true ") + keys)));
    ASSERT_EQ(r.code, 0) << keys << "\n" << r.out;
    const std::string what = std::string("eod_mask_loss ") + (*keys ? keys : "dp2");
    expect_same_losses(want, losses(w.path()), what);
    expect_same_losses(want_val, losses(w.path(), "val_loss"), what + " validation");
  }
}

TEST(MeshTraining, WhatALayoutCannotSplitYetIsRefusedByName) {
  const struct {
    int ranks;
    std::string keys, why;
  } refused[] = {
      {2, "tensor_model_parallel_size=2 optimizer=muon",
       "optimizer: muon with tensor_model_parallel_size > 1 is not implemented yet"},
      {2, "data_parallel_sharding_strategy=optim_grads_params optimizer=muon",
       "optimizer: muon with data_parallel_sharding_strategy optim_grads_params is not implemented yet"},
  };
  for (const auto& [ranks, keys, why] : refused) {
    Workdir w;
    auto r = run_primus(launch(ranks, llama_args(w.str(), 1, keys)));
    EXPECT_NE(r.code, 0) << keys << "\n" << r.out;
    EXPECT_NE(r.out.find(why), std::string::npos) << keys << "\n" << r.out;
    EXPECT_EQ(r.out.find("| loss "), std::string::npos) << keys << ": trained\n" << r.out;
  }
  // The cuda backend runs tp, cp and data parallelism side by side (ZeRO-1 and the sharded
  // strategies over dp x cp): its dry runs accept every combination. (Builds without CUDA, e.g. the
  // sanitizer build, have no cuda backend.)
  const bool have_cuda = run_primus("backends").out.find("cuda ") != std::string::npos;
  if (!have_cuda) std::cout << "this build has no cuda backend: its dry runs are not checked\n";
  auto dry_run = [](std::string keys) {
    std::string env = "RANK=0 WORLD_SIZE=2";
    if (const auto w = keys.find(" WORLD=4"); w != std::string::npos) keys.erase(w), env = "RANK=0 WORLD_SIZE=4";
    return run_primus("train pretrain --config " + std::string(PRIMUS_SOURCE_DIR) + "/examples/cuda/llama3.2-1B.yaml --dry-run " +
                          keys,
                      env);
  };
  for (const char* keys : {"context_parallel_size=2", "data_parallel_sharding_strategy=optim_grads_params",
                           "tensor_model_parallel_size=2 WORLD=4", "context_parallel_size=2 WORLD=4",
                           "context_parallel_size=2 tensor_model_parallel_size=2 WORLD=4",
                           "context_parallel_size=2 data_parallel_sharding_strategy=optim_grads_params WORLD=4",
                           "tensor_model_parallel_size=2 data_parallel_sharding_strategy=optim_grads WORLD=4",
                           "tensor_model_parallel_size=2 use_distributed_optimizer=true WORLD=4",
                           "context_parallel_size=2 data_parallel_sharding_strategy=optim WORLD=4"}) {
    if (!have_cuda) break;
    auto ok = dry_run(keys);
    EXPECT_EQ(ok.code, 0) << keys << "\n" << ok.out;
  }
  // Context parallelism: packed documents are not split over the ring yet.
  Workdir docs;
  auto rd = run_primus(launch(2, llama_args(docs.str(), 1, "context_parallel_size=2 reset_attention_mask=true")));
  EXPECT_NE(rd.code, 0) << rd.out;
  EXPECT_NE(rd.out.find("context_parallel_size 2 with reset_attention_mask"), std::string::npos) << rd.out;
  Workdir moe;
  auto r = run_primus(launch(2, "train pretrain --config " + std::string(PRIMUS_SOURCE_DIR) +
                                    "/examples/reference/moe-shakespeare.yaml seq_length=32 micro_batch_size=2 "
                                    "global_batch_size=2 train_iters=1 sample_tokens=0 tensor_model_parallel_size=2 "
                                    "workspace=" + moe.str()));
  EXPECT_NE(r.code, 0) << r.out;
  EXPECT_NE(r.out.find("with MoE layers (num_experts) is not implemented yet"), std::string::npos) << r.out;
}

}  // namespace
