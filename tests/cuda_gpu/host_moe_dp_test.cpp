// MoE models under the cuda backend's sharded data parallelism (optim_grads, optim_grads_params),
// through the trainer in host mode: two processes, each reading its half of every global batch,
// against one process that accumulates both halves. The routing statistics are summed over the
// ranks before they are reported and before the expert bias moves, so every rank routes with the
// same bias and the two runs give the same losses (fp32 gate, 1e-5 relative), the same reported
// loads, and checkpoints that resume across the two layouts.
#include <gtest/gtest.h>

#include <algorithm>
#include <cmath>
#include <string>

#include "io/checkpoint.h"
#include "tests/cuda_gpu/two_processes.h"
#include "tests/parallel/train_e2e_util.h"

namespace primus::backends::cuda {
namespace {

// moe/tiny.yaml (8 experts, top-2, softmax) at the tiny experiment's widths; `extra` adds keys.
std::string moe_overrides(const std::string& extra = "") {
  return "      moe_ffn_hidden_size: 32\n      num_query_groups: 1\n" + extra;
}

// A metrics.jsonl key (e.g. moe/layer0/load_max) of run `run` against the one-process run's, every
// step within 1e-5 relative (the loads, integers, exactly).
void expect_same_metric(const std::filesystem::path& dir, const std::string& run, const std::string& key) {
  const auto one = primus::testing::losses(dir / "g/u/cuda", key);
  ASSERT_EQ(one.size(), 6u) << key;
  primus::testing::expect_same_losses(one, primus::testing::losses(dir / "g/u" / run, key), run + " " + key);
}

// The tiny MoE experiment with `extra` model keys, two micro-batches of 4 a step, trained by the
// reference backend (run "reference") and the cuda trainer in host mode (run "cuda") in `w`.
// Returns the cuda run's config (for further runs under overrides), or an empty path after a
// failure the test has recorded.
std::filesystem::path run_reference_and_cuda(primus::testing::Workdir& w, const std::string& extra) {
  auto ref_file = w.write("ref.yaml", testing::tiny_trainer_experiment("reference", w.str(), "moe/tiny.yaml", 2, 4) +
                                          moe_overrides(extra));
  auto cuda_file = w.write("cuda.yaml", testing::tiny_trainer_experiment("cuda", w.str(), "moe/tiny.yaml", 2, 4) +
                                            moe_overrides(extra));
  auto r = primus::testing::run_primus("train pretrain --config " + ref_file.string());
  EXPECT_EQ(r.code, 0) << r.out;
  if (r.code != 0) return {};
  run_host_trainer(cuda_file, {});
  return cuda_file;
}

TEST(CudaHostTrainerMoe, ShardedDataParallelTwoProcessesTrainAsOne) {
  testing::TwoProcesses t(moe_overrides(), "moe/tiny.yaml");
  for (const std::string strategy : {"optim_grads", "optim_grads_params"}) {
    const std::string run = "moe_dp2_" + strategy;
    t.expect_matches(run, "data_parallel_sharding_strategy=" + strategy, "data_parallel_sharding_strategy " + strategy);
    // Each rank routes half of the batch: the loads are the global batch's only when summed.
    for (const char* key : {"moe/layer0/load_max", "moe/layer1/load_min", "moe/layer1/load_cv", "moe/layer0/aux_loss"})
      expect_same_metric(t.dir(), run, key);
  }
  t.expect_checkpoints_move("moe_dp2_optim_grads_params", "data_parallel_sharding_strategy=optim_grads_params");
}

// DeepSeek-style routing: sigmoid scores and the aux-loss-free expert bias, moved every step by the
// global load. The bias lives outside the optimizer's shards (every rank holds all of it and moves
// it the same way), and the checkpoints carry its trained values.
TEST(CudaHostTrainerMoe, ExpertBiasMovesByTheGlobalLoadUnderShardedDataParallelism) {
  testing::TwoProcesses t(moe_overrides("      moe_router_score_function: sigmoid\n"
                                        "      moe_router_enable_expert_bias: true\n"
                                        "      moe_router_bias_update_rate: 0.05\n"),
                          "moe/tiny.yaml");
  const std::string run = "bias_dp2";
  t.expect_matches(run, "data_parallel_sharding_strategy=optim_grads_params", "data_parallel_sharding_strategy");
  expect_same_metric(t.dir(), run, "moe/layer0/load_max");
  expect_same_metric(t.dir(), run, "moe/layer1/load_cv");
  // The saved biases: moved (not the zeros they start from) and those of the one-process run.
  const auto one = io::load_checkpoint(t.dir() / "g/u/cuda/checkpoints/iter_0000006");
  const auto two = io::load_checkpoint(t.dir() / "g/u" / run / "checkpoints/iter_0000006");
  for (int l = 0; l < 2; ++l) {  // saved under the Hugging Face name (moe/tiny.yaml is Mixtral-style)
    const std::string name = "model.layers." + std::to_string(l) + ".block_sparse_moe.gate.e_score_correction_bias";
    ASSERT_TRUE(one.model.count(name)) << name;
    ASSERT_TRUE(two.model.count(name)) << name;
    const auto a = one.model.at(name).to_fp32(), b = two.model.at(name).to_fp32();
    ASSERT_EQ(a.size(), 8u);
    ASSERT_EQ(b.size(), a.size());
    float moved = 0;
    for (size_t e = 0; e < a.size(); ++e) {
      EXPECT_NEAR(b[e], a[e], 1e-6) << name << " expert " << e;
      moved = std::max(moved, std::abs(a[e]));
    }
    EXPECT_GT(moved, 0.04f) << name << ": 6 steps of rate 0.05 must move some bias";
  }
  t.expect_checkpoints_move(run, "data_parallel_sharding_strategy=optim_grads_params");
}

// Context parallelism: each rank routes its chunks of every sequence. Without the switch loss
// (aux-loss-free balancing by the expert bias) the step is additive over the chunks, and the
// loads summed over the ranks move the biases as one process's, with data parallelism beside cp
// too.
TEST(CudaHostTrainerMoe, ContextParallelTrainsAsOneWithTheExpertBias) {
  testing::TwoProcesses t(moe_overrides("      moe_aux_loss_coeff: 0\n"
                                        "      moe_router_score_function: sigmoid\n"
                                        "      moe_router_enable_expert_bias: true\n"
                                        "      moe_router_bias_update_rate: 0.05\n"),
                          "moe/tiny.yaml");
  t.expect_matches("bias_cp2", "context_parallel_size=2", "context parallel over 2 ranks");
  // Beside data parallelism (the loads summed over the dp group, then the cp group) and sharded over
  // dp x cp (summed once over that group): four processes, the same losses and loads.
  t.expect_matches("bias_cp2dp2", "context_parallel_size=2", "x data parallel over 2 ranks", 1e-5, 4);
  t.expect_matches("bias_cp2dp2_fsdp", "context_parallel_size=2 data_parallel_sharding_strategy=optim_grads_params",
                   "sharded over dp x cp = 4 ranks", 1e-5, 4);
  for (const char* run : {"bias_cp2", "bias_cp2dp2", "bias_cp2dp2_fsdp"})
    for (const char* key : {"moe/layer0/load_max", "moe/layer1/load_min", "moe/layer1/load_cv"})
      expect_same_metric(t.dir(), run, key);
}

// The switch loss under context parallelism: each MoE layer's token counts summed over the cp group
// before the router's backward (the whole sequences' loss, as Megatron's over tp x cp), so cp2,
// cp2 x dp2 and tp2 x cp2 give one process's losses and validation losses with the tiny Mixtral's
// aux and z losses (softmax top-2; moe_aux_loss_coeff raised from 0.01 to 0.5 so that ranks
// balancing their own chunks would move the losses well beyond the gate).
TEST(CudaHostTrainerMoe, ContextParallelTrainsAsOneWithTheSwitchLoss) {
  testing::TwoProcesses t(moe_overrides("      moe_aux_loss_coeff: 0.5\n"), "moe/tiny.yaml");
  t.expect_matches("aux_cp2", "context_parallel_size=2", "context parallel over 2 ranks");
  t.expect_matches("aux_cp2dp2", "context_parallel_size=2", "x data parallel over 2 ranks", 1e-5, 4);
  t.expect_matches("aux_tp2cp2", "context_parallel_size=2 tensor_model_parallel_size=2", "", 1e-5, 4);
  for (const char* run : {"aux_cp2", "aux_cp2dp2", "aux_tp2cp2"})
    for (const char* key : {"moe/layer1/load_cv", "moe/layer0/aux_loss", "moe/layer1/aux_loss", "moe/layer1/z_loss"})
      expect_same_metric(t.dir(), run, key);
}

// DeepSeek-V3's sequence-wise loss under context parallelism: a rank holds two chunks of each
// sequence, so each sequence's counts and sums of p are summed over the cp group in the forward
// (Megatron sums them over tp x cp). cp2 and cp2 x dp2 then give one process's losses, validation
// losses and logged aux losses (coefficient 0.5, so that chunks balanced on their own would move
// them well beyond the gate).
TEST(CudaHostTrainerMoe, ContextParallelTrainsAsOneWithTheSequenceWiseLoss) {
  testing::TwoProcesses t(moe_overrides("      moe_aux_loss_coeff: 0.5\n"
                                        "      moe_router_load_balancing_type: seq_aux_loss\n"),
                          "moe/tiny.yaml");
  t.expect_matches("seq_cp2", "context_parallel_size=2", "context parallel over 2 ranks");
  t.expect_matches("seq_cp2dp2", "context_parallel_size=2", "x data parallel over 2 ranks", 1e-5, 4);
  for (const char* run : {"seq_cp2", "seq_cp2dp2"})
    for (const char* key : {"moe/layer0/aux_loss", "moe/layer1/aux_loss", "moe/layer1/load_cv"})
      expect_same_metric(t.dir(), run, key);
}

// moe_router_load_balancing_type global_aux_loss (docs/moe.md "Global-batch balance loss"): the
// loads are the global batch's, summed over the ranks holding other tokens and averaged over the
// step's micro-batches so far. One process with two micro-batches a step gives the reference
// backend's losses, validation losses and logged aux losses (the running mean; the micro-batch
// loss is the control and misses). Over ranks, with one micro-batch a step: dp2 (micro-batches of
// 4), cp2 (of 8), cp2 x dp2 and ep2 (the experts over the two data-parallel ranks) give the losses
// and aux losses of one process whose micro-batch of 8 holds the whole global batch under the
// micro-batch loss (coefficient 0.5).
TEST(CudaHostTrainerMoe, GlobalAuxLossIsTheGlobalBatchsOverMicroBatchesAndRanks) {
  const std::string global = "      moe_aux_loss_coeff: 0.5\n      moe_router_load_balancing_type: global_aux_loss\n";
  primus::testing::Workdir w;
  const std::filesystem::path cuda_file = run_reference_and_cuda(w, global);
  if (cuda_file.empty()) return;
  run_host_trainer(cuda_file, {"exp_name=micro", "moe_router_load_balancing_type=aux_loss"});
  testing::expect_same_trainer_runs(w.path(), "reference", "cuda");
  for (const char* key : {"moe/layer0/aux_loss", "moe/layer1/aux_loss"}) {
    const auto want = primus::testing::losses(w.path() / "g/u/reference", key);
    ASSERT_EQ(want.size(), 6u) << key;
    primus::testing::expect_same_losses(want, primus::testing::losses(w.path() / "g/u/cuda", key), key);
    const auto micro = primus::testing::losses(w.path() / "g/u/micro", key);
    double most = 0;
    for (const auto& [step, v] : want) most = std::max(most, std::abs(v - micro.at(step)) / v);
    EXPECT_GT(most, 1e-3) << key << ": the micro-batch loss logged the running mean's (the control failed)";
  }

  testing::TwoProcesses t(moe_overrides("      moe_aux_loss_coeff: 0.5\n"), "moe/tiny.yaml", 2, 8);
  const std::string keys = "moe_router_load_balancing_type=global_aux_loss";
  t.expect_matches("global_dp2", keys + " micro_batch_size=4", "data parallel: 2 ranks", 1e-5, 2, false);
  t.expect_matches("global_cp2", keys + " context_parallel_size=2", "context parallel over 2 ranks");
  t.expect_matches("global_cp2dp2", keys + " context_parallel_size=2 micro_batch_size=4",
                   "x data parallel over 2 ranks", 1e-5, 4, false);
  t.expect_matches("global_ep2", keys + " expert_model_parallel_size=2 micro_batch_size=4",
                   "expert parallel over 2 ranks", 1e-5, 2, false);
  for (const char* run : {"global_dp2", "global_cp2", "global_cp2dp2", "global_ep2"})
    for (const char* key : {"moe/layer0/aux_loss", "moe/layer1/aux_loss", "moe/layer1/load_cv"})
      expect_same_metric(t.dir(), run, key);
}

// Megatron-LM's list form: moe_router_load_balancing_type [aux_loss, seq_aux_loss, global_aux_loss]
// with one coefficient each. One process with two micro-batches a step gives the reference
// backend's losses, validation losses and each type's logged loss (aux_loss the micro-batch's, the
// others under their own names); the micro-batch loss alone at the same coefficient is the control
// and misses. cp2, where the micro-batch loss's and the global loss's counts are both summed over
// the group (two rows), gives one process's run; so do dp2 and ep2 under [seq_aux_loss,
// global_aux_loss], neither of which depends on how the global batch is cut into micro-batches.
TEST(CudaHostTrainerMoe, BalancingTypeListsFollowTheReference) {
  const std::string list =
      "      moe_aux_loss_coeff: [0.3, 0.2, 0.5]\n"
      "      moe_router_load_balancing_type: [aux_loss, seq_aux_loss, global_aux_loss]\n";
  primus::testing::Workdir w;
  const std::filesystem::path cuda_file = run_reference_and_cuda(w, list);
  if (cuda_file.empty()) return;
  run_host_trainer(cuda_file, {"exp_name=micro", "moe_router_load_balancing_type=aux_loss", "moe_aux_loss_coeff=0.3"});
  testing::expect_same_trainer_runs(w.path(), "reference", "cuda");
  for (const char* key : {"moe/layer0/aux_loss", "moe/layer1/seq_aux_loss", "moe/layer1/global_aux_loss"}) {
    const auto want = primus::testing::losses(w.path() / "g/u/reference", key);
    ASSERT_EQ(want.size(), 6u) << key;
    primus::testing::expect_same_losses(want, primus::testing::losses(w.path() / "g/u/cuda", key), key);
  }
  EXPECT_TRUE(primus::testing::losses(w.path() / "g/u/micro", "moe/layer1/seq_aux_loss").empty());
  const auto want = primus::testing::losses(w.path() / "g/u/reference", "loss");
  const auto micro = primus::testing::losses(w.path() / "g/u/micro", "loss");
  ASSERT_EQ(micro.size(), want.size());
  double most = 0;
  for (const auto& [step, v] : want) most = std::max(most, std::abs(v - micro.at(step)) / v);
  EXPECT_GT(most, 1e-4) << "the sequences' and the global batch's terms changed nothing (the control failed)";

  testing::TwoProcesses t(moe_overrides(list), "moe/tiny.yaml", 2, 8);
  t.expect_matches("list_cp2", "context_parallel_size=2", "context parallel over 2 ranks");
  for (const char* key : {"moe/layer0/aux_loss", "moe/layer1/aux_loss", "moe/layer1/seq_aux_loss",
                          "moe/layer1/global_aux_loss", "moe/layer1/load_cv"})
    expect_same_metric(t.dir(), "list_cp2", key);

  // The sequences' and the global batch's losses do not depend on how the global batch is cut:
  // dp2 and ep2 with micro-batches of 4 give one process's run with the whole batch of 8.
  testing::TwoProcesses u(moe_overrides("      moe_aux_loss_coeff: [0.2, 0.5]\n"
                                        "      moe_router_load_balancing_type: [seq_aux_loss, global_aux_loss]\n"),
                          "moe/tiny.yaml", 2, 8);
  u.expect_matches("list_dp2", "micro_batch_size=4", "data parallel: 2 ranks", 1e-5, 2, false);
  u.expect_matches("list_ep2", "expert_model_parallel_size=2 micro_batch_size=4", "expert parallel over 2 ranks", 1e-5,
                   2, false);
  for (const char* run : {"list_dp2", "list_ep2"})
    for (const char* key : {"moe/layer0/aux_loss", "moe/layer1/aux_loss", "moe/layer1/global_aux_loss"})
      expect_same_metric(u.dir(), run, key);
}

// fp8_recipe delayed on an MoE through the trainer (host mode, two micro-batches a step): the
// experts' amax histories go into the checkpoint beside the attention linears' (2 MoE layers x
// q|k|v, attention output, experts fc and proj x x|w|dy = 24), and a resume from step 3 replays
// steps 4-6 bit for bit; the tensorwise run (no histories) parts from it once the scales come from
// them.
TEST(CudaHostTrainerMoe, DelayedFp8ExpertsResumeBitForBit) {
  primus::testing::Workdir w;
  auto file = w.write("cuda.yaml", testing::tiny_trainer_experiment("cuda", w.str(), "moe/tiny.yaml", 2, 4) + moe_overrides());
  const auto [whole, ckpt3] = testing::expect_delayed_fp8_resumes(
      w.path(), file, {"fp8=hybrid", "fp8_recipe=delayed", "fp8_amax_history_len=2"}, 24, 2, 0.2);
  ASSERT_EQ(whole.loss.size(), 6u);
  run_host_trainer(file, {"fp8=hybrid", "exp_name=tensorwise"});
  const auto tw = testing::read_trainer_metrics(w.path() / "g/u/tensorwise/metrics.jsonl");
  ASSERT_EQ(tw.loss.size(), 6u);
  EXPECT_EQ(tw.loss.at(1), whole.loss.at(1)) << "step 1 has no history: current scaling";
  EXPECT_NE(tw.loss.at(3), whole.loss.at(3)) << "the histories' scales left no trace";
}

}  // namespace
}  // namespace primus::backends::cuda
