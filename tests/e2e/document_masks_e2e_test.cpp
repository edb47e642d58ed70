// Document masking through the binary on the reference backend: `data prepare` packs short
// documents each ending in the tokenizer's end-of-document id; training with Megatron's
// reset_attention_mask and reset_position_ids over them learns, starts from a different loss than
// the same run without the masks (its first step already sees them), and a Mistral-style sliding
// window over the same data trains and survives a checkpoint round trip (its spec carries it).
#include <gtest/gtest.h>

#include <nlohmann/json.hpp>

#include "cli_runner.h"
#include "core/util/fs.h"
#include "io/metrics.h"

using primus::testing::run_primus;
using primus::testing::Workdir;
namespace fsys = std::filesystem;

namespace {

std::vector<double> losses_of(const fsys::path& metrics) {
  std::vector<double> out;
  for (auto& j : primus::io::read_jsonl(metrics))
    if (j.contains("loss")) out.push_back(j["loss"].get<double>());
  return out;
}

std::string masks_args(const std::string& ws, const std::string& data, const std::string& extra) {
  return "train pretrain --config " + std::string(PRIMUS_SOURCE_DIR) +
         "/examples/reference/llama-shakespeare.yaml num_layers=1 hidden_size=32 num_attention_heads=2 "
         "num_query_groups=1 ffn_hidden_size=64 seq_length=64 micro_batch_size=4 global_batch_size=4 train_iters=12 "
         "eval_interval=0 log_interval=1 sample_tokens=0 save_interval=12 lr_warmup_iters=2 lr_decay_iters=12 "
         "data_path=[" + data + "] split=1 workspace=" + ws + " " + extra;
}

}  // namespace

TEST(DocumentMasksE2E, PackedDocumentsTrainWithMasksAndWindow) {
  Workdir w;
  std::string docs;  // 200 documents of 5 to 40 bytes: several per 64-token sample
  for (int i = 0; i < 200; ++i) {
    std::string body;
    for (int k = 0; k < 5 + (i * 7) % 36; ++k) body += static_cast<char>('a' + (i * 13 + k * 5) % 26);
    docs += "{\"text\": \"" + body + "\"}\n";
  }
  const auto in = w.write("docs.jsonl", docs);
  const std::string prefix = w.str() + "/docs";
  auto p = run_primus("data prepare --input " + in.string() + " --json-key text --tokenizer bytes --output-prefix " +
                      prefix);
  ASSERT_EQ(p.code, 0) << p.out;
  ASSERT_TRUE(fsys::exists(prefix + ".idx")) << p.out;
  const std::string& data_arg = prefix;

  Workdir masked, plain, windowed;
  auto a = run_primus(masks_args(masked.str(), data_arg, "reset_attention_mask=true reset_position_ids=true"));
  ASSERT_EQ(a.code, 0) << a.out;
  auto b = run_primus(masks_args(plain.str(), data_arg, ""));
  ASSERT_EQ(b.code, 0) << b.out;
  const fsys::path out = "local/local/llama-shakespeare";
  const auto la = losses_of(masked.path() / out / "metrics.jsonl"), lb = losses_of(plain.path() / out / "metrics.jsonl");
  ASSERT_EQ(la.size(), 12u);
  ASSERT_EQ(lb.size(), 12u);
  EXPECT_LT(la.back(), la.front() - 0.3) << "it learns with the masks";
  EXPECT_NE(la.front(), lb.front()) << "the masks must change the first step's loss";

  auto c = run_primus(masks_args(windowed.str(), data_arg, "sliding_window=8 reset_attention_mask=true"));
  ASSERT_EQ(c.code, 0) << c.out;
  EXPECT_NE(c.out.find("sliding window 8"), std::string::npos) << c.out;
  const auto lc = losses_of(windowed.path() / out / "metrics.jsonl");
  ASSERT_EQ(lc.size(), 12u);
  EXPECT_LT(lc.back(), lc.front() - 0.3);
  // The checkpoint's spec holds the window; resuming with another window is refused.
  auto r = run_primus(masks_args(windowed.str(), data_arg, "sliding_window=4 train_iters=14 auto_continue_train=true"));
  EXPECT_NE(r.code, 0) << r.out;
}
