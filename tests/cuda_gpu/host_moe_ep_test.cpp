// Expert parallelism in the cuda backend, through the trainer in host mode: each rank holds
// num_experts / ep of every MoE layer's experts, reads its own part of every global batch, and
// sends its routed rows to their experts' ranks and back (model/ep_comm.h), against one process
// that holds every expert and accumulates the whole batch. Same losses, validation losses and
// reported loads (fp32 gate, 1e-5 relative); checkpoints in the global layout that resume across
// the layouts; the Mixtral-style tiny MoE under ep2, ep2 x dp2 and ep4, and DeepSeek-style routing
// (sigmoid, expert bias moved by the global load, a shared expert) under ep2. What expert
// parallelism does not run beside yet is refused by name.
#include <gtest/gtest.h>

#include <string>

#include "tests/cuda_gpu/two_processes.h"
#include "tests/parallel/train_e2e_util.h"

namespace primus::backends::cuda {
namespace {

// moe/tiny.yaml (8 experts, top-2, softmax) at the tiny experiment's widths; `extra` adds keys.
std::string ep_overrides(const std::string& extra = "") {
  return "      moe_ffn_hidden_size: 32\n      num_query_groups: 1\n" + extra;
}

void expect_same_ep_metric(const testing::TwoProcesses& t, const std::string& run, const std::string& key) {
  const auto one = primus::testing::losses(t.dir() / "g/u/cuda", key);
  ASSERT_EQ(one.size(), 6u) << key;
  primus::testing::expect_same_losses(one, primus::testing::losses(t.dir() / "g/u" / run, key), run + " " + key);
}

TEST(CudaHostTrainerMoe, ExpertParallelRanksTrainAsOneProcess) {
  // Micro-batches of 2 in a global batch of 8: one process accumulates 4, two 2 each, four 1 each.
  testing::TwoProcesses t(ep_overrides(), "moe/tiny.yaml", 2, 2);
  t.expect_matches("ep2", "expert_model_parallel_size=2", "expert parallel over 2 ranks: experts 0..3 here");
  for (const char* key : {"moe/layer0/load_max", "moe/layer1/load_cv", "moe/layer0/aux_loss"})
    expect_same_ep_metric(t, "ep2", key);
  t.expect_matches("ep2_dp2", "expert_model_parallel_size=2", "the experts over 2 of them (each expert on 2 ranks)", 1e-5,
                   4);
  t.expect_matches("ep4", "expert_model_parallel_size=4", "expert parallel over 4 ranks", 1e-5, 4);
  expect_same_ep_metric(t, "ep4", "moe/layer1/load_max");
  t.expect_checkpoints_move("ep2", "expert_model_parallel_size=2");
}

TEST(CudaHostTrainerMoe, ExpertParallelDeepSeekStyleRouting) {
  testing::TwoProcesses t(ep_overrides("      moe_router_score_function: sigmoid\n"
                                        "      moe_router_topk: 4\n"
                                        "      moe_router_enable_expert_bias: true\n"
                                        "      moe_router_bias_update_rate: 0.05\n"
                                        "      moe_shared_expert_intermediate_size: 48\n"),
                          "moe/tiny.yaml", 2, 2);
  t.expect_matches("ep2", "expert_model_parallel_size=2", "expert parallel over 2 ranks");
  expect_same_ep_metric(t, "ep2", "moe/layer0/load_max");
  t.expect_checkpoints_move("ep2", "expert_model_parallel_size=2");
}

// The optimizer in the backward beside expert parallelism (clip 0, one micro-batch a step on each
// rank): each layer's dense gradients averaged over the ep x dp ranks and its experts' over their
// replicas, divided by ep, just before its update. ep2 and ep2 x dp2 against one process
// accumulating the ranks' micro-batches with AdamW after the backward (the same loss terms).
TEST(CudaHostTrainerMoe, ExpertParallelWithTheOptimizerInTheBackward) {
  testing::TwoProcesses t(ep_overrides("      clip_grad: 0\n"), "moe/tiny.yaml", 2, 4);
  t.expect_matches("ep2", "expert_model_parallel_size=2 optimizer_in_bwd=true", "expert parallel over 2 ranks");
  testing::TwoProcesses f(ep_overrides("      clip_grad: 0\n"), "moe/tiny.yaml", 2, 2);
  f.expect_matches("ep2_dp2", "expert_model_parallel_size=2 optimizer_in_bwd=true", "each expert on 2 ranks", 1e-5, 4);
  f.expect_matches("ep4", "expert_model_parallel_size=4 optimizer_in_bwd=true", "expert parallel over 4 ranks", 1e-5, 4);
}

// Beside context parallelism (four processes, ep2 x cp2): each rank routes its chunks of its
// samples' sequences, the dense gradients averaged over ep x cp and the experts' over cp (divided
// by ep); with AdamW after the backward and in it. Without the switch loss (each cp rank's chunks'
// counts would make a product of per-chunk means), against one process accumulating.
TEST(CudaHostTrainerMoe, ExpertParallelBesideContextParallelism) {
  testing::TwoProcesses t(ep_overrides("      clip_grad: 0\n      moe_aux_loss_coeff: 0.0\n"), "moe/tiny.yaml", 2, 4);
  t.expect_matches("ep2cp2", "expert_model_parallel_size=2 context_parallel_size=2",
                   "context parallel over 2 ranks: each holds chunks r and 3 - r of 4 per sequence (gloo group) x expert "
                   "parallel over 2 ranks",
                   1e-5, 4);
  t.expect_matches("ep2cp2_oib", "expert_model_parallel_size=2 context_parallel_size=2 optimizer_in_bwd=true", "", 1e-5, 4);
  t.expect_checkpoints_move("ep2cp2", "expert_model_parallel_size=2 context_parallel_size=2", 4);
}

// Sharded data parallelism beside expert parallelism (four processes, ep2 x dp2): ZeRO-1,
// optim_grads and optim_grads_params shard over the two ranks holding the same experts, each unit's
// dense gradients averaged over the ep group before its reduce-scatter and the experts' part of the
// reduced chunk divided by ep. One process's losses; the ZeRO-1 checkpoint moves both ways.
TEST(CudaHostTrainerMoe, ExpertParallelBesideShardedDataParallelism) {
  testing::TwoProcesses t(ep_overrides(), "moe/tiny.yaml", 2, 2);
  t.expect_matches("ep2dp2_zero1", "expert_model_parallel_size=2 use_distributed_optimizer=true",
                   "data_parallel_sharding_strategy optim over the 2 ranks holding the same experts", 1e-5, 4);
  t.expect_matches("ep2dp2_zero2", "expert_model_parallel_size=2 data_parallel_sharding_strategy=optim_grads", "", 1e-5, 4);
  t.expect_matches("ep2dp2_fsdp", "expert_model_parallel_size=2 data_parallel_sharding_strategy=optim_grads_params", "",
                   1e-5, 4);
  t.expect_checkpoints_move("ep2dp2_zero1", "expert_model_parallel_size=2 use_distributed_optimizer=true", 4);
}

// FP8 experts beside expert parallelism through the trainer (fp8: hybrid, fp8_recipe: rowwise: the
// linear layers and the experts' grouped GEMMs over the held groups), against one process with the
// same recipe. The column-scaled copies' maxima are over each rank's rows (its micro-batches' tokens,
// its experts' held groups), so the two runs differ by FP8's rounding: 2e-3 relative (the host
// model test measures the distance, ep_host_test.cpp).
TEST(CudaHostTrainerMoe, ExpertParallelWithFp8Experts) {
  testing::TwoProcesses t(ep_overrides("      fp8: hybrid\n      fp8_recipe: rowwise\n"), "moe/tiny.yaml", 2, 2);
  t.expect_matches("ep2_fp8", "expert_model_parallel_size=2", "expert parallel over 2 ranks", 2e-3);
}

// Muon beside expert parallelism (Moonlight's and Kimi K2's recipe: MoE experts trained with Muon):
// each expert's matrices are whole on the rank holding them, so Newton-Schulz runs there on the
// gradient averaged as AdamW's is; the rest (norms, router, embeddings) takes AdamW. One process's
// losses, and checkpoints (Muon's momentum in the global layout) that resume across the layouts.
TEST(CudaHostTrainerMoe, ExpertParallelWithMuon) {
  testing::TwoProcesses t(ep_overrides("      optimizer: muon\n"), "moe/tiny.yaml", 2, 2);
  t.expect_matches("ep2_muon", "expert_model_parallel_size=2", "expert parallel over 2 ranks");
  t.expect_checkpoints_move("ep2_muon", "expert_model_parallel_size=2");
}

TEST(CudaHostTrainerMoe, ExpertParallelRefusesWhatItDoesNotRunBesideYet) {
  testing::TwoProcesses t(ep_overrides(), "moe/tiny.yaml", 2, 2);
  t.expect_refused("ep2_tp2", "expert_model_parallel_size=2 tensor_model_parallel_size=2",
                   "expert_model_parallel_size 2 with tensor_model_parallel_size > 1 is not implemented yet on the cuda "
                   "backend",
                   4);
  t.expect_refused("ep3", "expert_model_parallel_size=3 global_batch_size=6",
                   "expert_model_parallel_size 3 does not divide num_experts 8", 3);
}

}  // namespace
}  // namespace primus::backends::cuda
