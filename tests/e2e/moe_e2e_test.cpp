// MoE training end to end through the binary on the reference backend: the routing statistics
// reach metrics.jsonl, the model learns, a resume is bit-identical (the expert bias is part of the
// checkpoint), and the expert bias moves toward balance.
#include <gtest/gtest.h>

#include <cmath>

#include "cli_runner.h"
#include "core/util/fs.h"
#include "io/metrics.h"
#include "io/safetensors.h"

using primus::testing::run_primus;
using primus::testing::Workdir;
namespace fsys = std::filesystem;

namespace {

std::string moe_args(const std::string& ws, const std::string& extra = "") {
  return "train pretrain --config " + std::string(PRIMUS_SOURCE_DIR) +
         "/examples/reference/moe-shakespeare.yaml num_layers=2 hidden_size=32 num_attention_heads=2 "
         "num_query_groups=1 moe_ffn_hidden_size=32 num_experts=6 seq_length=32 micro_batch_size=4 "
         "global_batch_size=8 train_iters=16 eval_interval=8 eval_iters=2 log_interval=4 sample_tokens=0 "
         "save_interval=8 lr_warmup_iters=2 lr_decay_iters=16 workspace=" + ws + " " + extra;
}
fsys::path moe_out_dir(const Workdir& w) { return w.path() / "local/local/moe-shakespeare"; }

}  // namespace

TEST(MoeE2E, StatisticsLearningAndBitIdenticalResume) {
  Workdir straight, resumed;
  auto a = run_primus(moe_args(straight.str()));
  ASSERT_EQ(a.code, 0) << a.out;
  EXPECT_NE(a.out.find("6 experts top-2 in 2 MoE layers"), std::string::npos) << a.out;
  EXPECT_NE(a.out.find("moe_aux"), std::string::npos) << "the console line carries the aux loss";
  auto rows = primus::io::read_jsonl(moe_out_dir(straight) / "metrics.jsonl");
  std::vector<double> loss;
  for (auto& j : rows) {
    if (!j.contains("loss")) continue;
    loss.push_back(j["loss"].get<double>());
    for (const char* k : {"moe_aux", "moe_load_cv", "moe/layer0/load_min", "moe/layer1/load_max", "moe/layer1/load_cv",
                          "moe/layer0/aux_loss", "moe/layer0/z_loss", "moe/layer1/dropped"})
      ASSERT_TRUE(j.contains(k)) << k;
    // 8 sequences x 32 tokens x top-2 slots per step, dropless: nothing dropped, loads in range.
    EXPECT_EQ(j["moe/layer1/dropped"].get<double>(), 0.0);
    EXPECT_LE(j["moe/layer0/load_max"].get<double>(), 8 * 32);
    // The switch loss is 1 for a uniform router and grows with imbalance (at most E = 6).
    EXPECT_GT(j["moe/layer0/aux_loss"].get<double>(), 0.9);
    EXPECT_LE(j["moe/layer0/aux_loss"].get<double>(), 6.0);
  }
  ASSERT_EQ(loss.size(), 16u);
  EXPECT_LT(loss.back(), loss.front() - 0.3) << "it learns";

  auto b1 = run_primus(moe_args(resumed.str(), "train_iters=8"));
  ASSERT_EQ(b1.code, 0) << b1.out;
  auto b2 = run_primus(moe_args(resumed.str(), "auto_continue_train=true"));
  ASSERT_EQ(b2.code, 0) << b2.out;
  auto ra = primus::io::read_jsonl(moe_out_dir(straight) / "metrics.jsonl");
  auto rb = primus::io::read_jsonl(moe_out_dir(resumed) / "metrics.jsonl");
  std::vector<double> la, lb;
  for (auto& j : ra) if (j.contains("loss")) la.push_back(j["loss"].get<double>());
  for (auto& j : rb) if (j.contains("loss")) lb.push_back(j["loss"].get<double>());
  EXPECT_EQ(la, lb);  // bitwise
  auto wa = primus::fs::read_file(moe_out_dir(straight) / "checkpoints/iter_0000016/model.safetensors");
  auto wb = primus::fs::read_file(moe_out_dir(resumed) / "checkpoints/iter_0000016/model.safetensors");
  EXPECT_TRUE(wa == wb) << "final weights differ";
}

// DeepSeek-style routing with the expert bias: the bias is saved (its HF name in the checkpoint),
// starts at 0 and has moved after training; capacity dropping is reported.
TEST(MoeE2E, ExpertBiasMovesAndCapacityDrops) {
  Workdir w;
  auto r = run_primus(moe_args(w.str(), "moe_router_score_function=sigmoid moe_router_enable_expert_bias=true "
                                        "moe_router_bias_update_rate=0.01 moe_router_topk_scaling_factor=2.5 "
                                        "moe_shared_expert_intermediate_size=32 moe_expert_capacity_factor=1.0 "
                                        "model_type=deepseek_v3 save_interval=16"));
  ASSERT_EQ(r.code, 0) << r.out;
  double dropped = 0;
  for (auto& j : primus::io::read_jsonl(moe_out_dir(w) / "metrics.jsonl"))
    if (j.contains("moe/layer0/dropped")) dropped += j["moe/layer0/dropped"].get<double>();
  EXPECT_GT(dropped, 0.0) << "capacity 1.0 at random init drops some slots";
  auto f = primus::io::SafetensorsFile::open(moe_out_dir(w) / "checkpoints/iter_0000016/model.safetensors");
  for (int l = 0; l < 2; ++l) {
    const std::vector<float> bias = f.read_fp32("model.layers." + std::to_string(l) + ".mlp.gate.e_score_correction_bias");
    ASSERT_EQ(bias.size(), 6u);
    double moved = 0;
    for (float b : bias) moved += std::fabs(b);
    // 16 updates of +-0.01 each (0 only where a load equals the mean exactly).
    EXPECT_GT(moved, 0.01) << "layer " << l;
    EXPECT_LE(moved, 6 * 16 * 0.01 + 1e-6) << "layer " << l;
  }
}
