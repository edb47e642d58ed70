// Qwen3 end to end through the binary on the reference backend: the tiny Qwen3 example (heads
// apart from the width, per-head query/key norms) learns on tinyshakespeare, resumes from its
// checkpoint bit for bit (kv_channels and qk_layernorm travel in the checkpoint's spec), and
// `export hf` writes a Qwen3ForCausalLM folder with the norms' tensors; the same model with
// Qwen3-MoE experts exports as Qwen3MoeForCausalLM.
#include <gtest/gtest.h>

#include <nlohmann/json.hpp>

#include "cli_runner.h"
#include "core/util/fs.h"
#include "io/metrics.h"
#include "io/safetensors.h"

using primus::testing::run_primus;
using primus::testing::Workdir;
namespace fsys = std::filesystem;

namespace {

std::string qwen3_args(const std::string& ws, const std::string& extra = "") {
  return "train pretrain --config " + std::string(PRIMUS_SOURCE_DIR) +
         "/examples/reference/qwen3-shakespeare.yaml num_layers=2 hidden_size=32 num_attention_heads=4 "
         "num_query_groups=2 kv_channels=16 ffn_hidden_size=64 seq_length=32 micro_batch_size=4 global_batch_size=8 "
         "train_iters=16 eval_interval=8 eval_iters=2 log_interval=4 sample_tokens=0 save_interval=8 "
         "lr_warmup_iters=2 lr_decay_iters=16 workspace=" + ws + " " + extra;
}
fsys::path qwen3_out_dir(const Workdir& w) { return w.path() / "local/local/qwen3-shakespeare"; }

std::vector<double> qwen3_losses(const fsys::path& metrics) {
  std::vector<double> out;
  for (auto& j : primus::io::read_jsonl(metrics))
    if (j.contains("loss")) out.push_back(j["loss"].get<double>());
  return out;
}

}  // namespace

TEST(Qwen3E2E, LearnsResumesBitIdenticalAndExports) {
  Workdir straight, resumed;
  auto a = run_primus(qwen3_args(straight.str()));
  ASSERT_EQ(a.code, 0) << a.out;
  EXPECT_NE(a.out.find("heads 4/2 of 16, qk norm"), std::string::npos) << a.out;
  const auto la = qwen3_losses(qwen3_out_dir(straight) / "metrics.jsonl");
  ASSERT_EQ(la.size(), 16u);
  EXPECT_LT(la.back(), la.front() - 0.3) << "it learns";
  ASSERT_EQ(run_primus(qwen3_args(resumed.str(), "train_iters=8")).code, 0);
  auto b = run_primus(qwen3_args(resumed.str(), "auto_continue_train=true"));
  ASSERT_EQ(b.code, 0) << b.out;
  EXPECT_EQ(qwen3_losses(qwen3_out_dir(resumed) / "metrics.jsonl"), la) << "a resume changed the curve";

  const fsys::path ck = qwen3_out_dir(straight) / "checkpoints", hf = straight.path() / "hf";
  auto e = run_primus("export hf " + ck.string() + " " + hf.string() + " --dtype fp32");
  ASSERT_EQ(e.code, 0) << e.out;
  auto cfg = nlohmann::json::parse(primus::fs::read_file(hf / "config.json"));
  EXPECT_EQ(cfg["architectures"][0], "Qwen3ForCausalLM");
  EXPECT_EQ(cfg["head_dim"], 16);
  auto st = primus::io::SafetensorsFile::open(hf / "model.safetensors");
  EXPECT_EQ(st.info("model.layers.1.self_attn.q_proj.weight").shape, (std::vector<int64_t>{64, 32}));
  EXPECT_EQ(st.info("model.layers.1.self_attn.o_proj.weight").shape, (std::vector<int64_t>{32, 64}));
  const auto qn = st.read_fp32("model.layers.0.self_attn.q_norm.weight");
  ASSERT_EQ(qn.size(), 16u);
  bool moved = false;
  for (float w : qn) moved = moved || w != 1.0f;
  EXPECT_TRUE(moved) << "the query norm's weight never left its init";

  Workdir moe;
  ASSERT_EQ(run_primus(qwen3_args(moe.str(), "train_iters=2 save_interval=2 eval_interval=0 model_type=qwen3_moe "
                                             "num_experts=4 moe_router_topk=2 moe_ffn_hidden_size=32"))
                .code,
            0);
  auto em = run_primus("export hf " + (qwen3_out_dir(moe) / "checkpoints").string() + " " +
                       (moe.path() / "hf").string() + " --dtype bf16");
  ASSERT_EQ(em.code, 0) << em.out;
  auto mc = nlohmann::json::parse(primus::fs::read_file(moe.path() / "hf/config.json"));
  EXPECT_EQ(mc["architectures"][0], "Qwen3MoeForCausalLM");
  EXPECT_EQ(mc["num_experts"], 4);
  EXPECT_TRUE(primus::io::SafetensorsFile::open(moe.path() / "hf/model.safetensors")
                  .contains("model.layers.1.mlp.experts.3.down_proj.weight"));
}

// The families of [hf] item 2 on the same example: Qwen2 (q/k/v biases only) and OLMoE (every
// layer MoE, q/k norms over the whole projection). Each resumes bit for bit (add_qkv_bias and
// qk_layernorm_scope travel in the checkpoint's spec) and exports as its class with its own
// tensors trained away from their init (biases from 0, norm weights from 1).
TEST(FamiliesE2E, Qwen2AndOlmoeResumeBitIdenticalAndExport) {
  struct Family {
    const char* overrides;
    const char* summary;
    const char* cls;
    const char* tensor;  // one of the family's own tensors and its init value
    size_t numel;
    float init;
  };
  const Family families[] = {
      {"model_type=qwen2 qk_layernorm=false kv_channels=8 add_qkv_bias=true", "heads 4/2, qkv bias",
       "Qwen2ForCausalLM", "model.layers.1.self_attn.k_proj.bias", 16, 0.0f},
      {"model_type=olmoe kv_channels=8 qk_layernorm_scope=projection num_experts=4 moe_router_topk=2 "
       "moe_ffn_hidden_size=32 moe_router_pre_softmax=true",
       "heads 4/2, qk norm (projection), 4 experts", "OlmoeForCausalLM", "model.layers.0.self_attn.q_norm.weight",
       32, 1.0f},
  };
  for (const Family& f : families) {
    SCOPED_TRACE(f.cls);
    const std::string common = std::string(f.overrides) + " train_iters=8 save_interval=4 eval_interval=0";
    Workdir straight, resumed;
    auto a = run_primus(qwen3_args(straight.str(), common));
    ASSERT_EQ(a.code, 0) << a.out;
    EXPECT_NE(a.out.find(f.summary), std::string::npos) << a.out;
    const auto la = qwen3_losses(qwen3_out_dir(straight) / "metrics.jsonl");
    ASSERT_EQ(run_primus(qwen3_args(resumed.str(), common + " train_iters=4")).code, 0);
    ASSERT_EQ(run_primus(qwen3_args(resumed.str(), common + " auto_continue_train=true")).code, 0);
    EXPECT_EQ(qwen3_losses(qwen3_out_dir(resumed) / "metrics.jsonl"), la) << "a resume changed the curve";
    const fsys::path hf = straight.path() / "hf";
    auto e = run_primus("export hf " + (qwen3_out_dir(straight) / "checkpoints").string() + " " + hf.string() +
                        " --dtype fp32");
    ASSERT_EQ(e.code, 0) << e.out;
    EXPECT_EQ(nlohmann::json::parse(primus::fs::read_file(hf / "config.json"))["architectures"][0], f.cls);
    const auto v = primus::io::SafetensorsFile::open(hf / "model.safetensors").read_fp32(f.tensor);
    ASSERT_EQ(v.size(), f.numel);
    bool moved = false;
    for (float x : v) moved = moved || x != f.init;
    EXPECT_TRUE(moved) << f.tensor << " never left its init";
  }
}
