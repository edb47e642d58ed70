// Hugging Face import through the binary on the reference backend: a tiny Llama trains, `export
// hf` writes its folder, `import hf` reads it back into a checkpoint that scores text exactly as
// the trained one, and `train` with `load_hf` (no model preset: the model keys come from
// config.json) starts from those weights: with lr 0 its validation loss is the trained model's,
// bit for bit, and with a learning rate it keeps lowering the loss. A model key that contradicts
// config.json is refused naming the key. A Hub id finds the same folder in a Hugging Face cache.
#include <gtest/gtest.h>

#include <cmath>
#include <fstream>
#include <nlohmann/json.hpp>

#include "cli_runner.h"
#include "io/metrics.h"

using primus::testing::run_primus;
using primus::testing::Workdir;
namespace fsys = std::filesystem;

namespace {

std::vector<double> hfi_column(const fsys::path& metrics, const char* key) {
  std::vector<double> out;
  for (auto& j : primus::io::read_jsonl(metrics))
    if (j.contains(key)) out.push_back(j[key].get<double>());
  return out;
}

// The last line of the output (log lines before it name folders that differ).
std::string hfi_last_line(const std::string& out) {
  std::string s = out;
  while (!s.empty() && s.back() == '\n') s.pop_back();
  const size_t nl = s.rfind('\n');
  return nl == std::string::npos ? s : s.substr(nl + 1);
}

std::string hfi_data_file() { return std::string(PRIMUS_SOURCE_DIR) + "/examples/data/tinyshakespeare.txt"; }

// An experiment with no model preset: load_hf supplies the architecture.
std::string load_hf_experiment(const fsys::path& hf, const std::string& extra) {
  return "work_group: local\nuser_name: local\nexp_name: from-hf\nmodules:\n  pre_trainer:\n    framework: reference\n"
         "    config: pretrain.yaml\n    overrides:\n      load_hf: " + hf.string() +
         "\n      tokenizer_type: bytes\n      seq_length: 32\n      data_path: [" + hfi_data_file() +
         "]\n      split: 0.95\n      micro_batch_size: 4\n      global_batch_size: 4\n      eval_iters: 2\n"
         "      log_interval: 1\n      sample_tokens: 0\n      save_at_end: false\n" + extra;
}

}  // namespace

TEST(HfImportE2E, ImportAndLoadHfStartFromTheExportedModel) {
  Workdir w;
  const std::string ws = (w.path() / "a").string();
  auto a = run_primus("train pretrain --config " + std::string(PRIMUS_SOURCE_DIR) +
                      "/examples/reference/llama-shakespeare.yaml num_layers=2 hidden_size=32 num_attention_heads=4 "
                      "num_query_groups=2 ffn_hidden_size=64 seq_length=32 micro_batch_size=4 global_batch_size=4 "
                      "train_iters=40 eval_interval=40 eval_iters=2 log_interval=1 sample_tokens=0 save_interval=40 "
                      "lr_warmup_iters=1 workspace=" + ws);
  ASSERT_EQ(a.code, 0) << a.out;
  const fsys::path a_dir = fsys::path(ws) / "local/local/llama-shakespeare";
  const auto a_val = hfi_column(a_dir / "metrics.jsonl", "val_loss");
  ASSERT_EQ(a_val.size(), 1u);
  const fsys::path hf = w.path() / "hf", imported = w.path() / "imported";
  auto e = run_primus("export hf " + (a_dir / "checkpoints").string() + " " + hf.string() + " --dtype fp32");
  ASSERT_EQ(e.code, 0) << e.out;

  // import hf: the exported folder has no tokenizer.json, so the tokenizer is named.
  auto i = run_primus("import hf " + hf.string() + " " + imported.string() + " --seq-length 32");
  EXPECT_NE(i.code, 0);
  EXPECT_NE(i.out.find("has no tokenizer.json; pass --tokenizer"), std::string::npos) << i.out;
  i = run_primus("import hf " + hf.string() + " " + imported.string() + " --seq-length 32 --tokenizer bytes");
  ASSERT_EQ(i.code, 0) << i.out;
  const std::string prompt = " --score --prompt 'ROMEO: what light through yonder window breaks'";
  auto s1 = run_primus("generate --checkpoint " + (a_dir / "checkpoints").string() + prompt);
  auto s2 = run_primus("generate --checkpoint " + imported.string() + prompt);
  ASSERT_EQ(s1.code, 0) << s1.out;
  ASSERT_EQ(s2.code, 0) << s2.out;
  EXPECT_EQ(hfi_last_line(s1.out), hfi_last_line(s2.out)) << "the imported checkpoint scores differently:\n" << s1.out << s2.out;

  // load_hf with lr 0: the validation loss after one step is the trained model's, exactly.
  const fsys::path exp0 = w.write("zero.yaml", load_hf_experiment(hf, "      train_iters: 1\n      eval_interval: 1\n"
                                                                    "      lr: 0.0\n      min_lr: 0.0\n"));
  auto b = run_primus("train pretrain --config " + exp0.string() + " workspace=" + (w.path() / "b").string());
  ASSERT_EQ(b.code, 0) << b.out;
  EXPECT_NE(b.out.find("weights from Hugging Face folder"), std::string::npos) << b.out;
  const auto b_val = hfi_column(w.path() / "b/local/local/from-hf/metrics.jsonl", "val_loss");
  ASSERT_EQ(b_val.size(), 1u);
  EXPECT_EQ(b_val[0], a_val[0]);

  // Continued pretraining from the import: far below a fresh model's start, and still learning.
  const auto a_loss = hfi_column(a_dir / "metrics.jsonl", "loss");
  const fsys::path exp1 = w.write("train.yaml", load_hf_experiment(hf, "      train_iters: 10\n      eval_interval: 0\n"
                                                                     "      lr: 2.0e-3\n      lr_warmup_iters: 1\n"));
  auto c = run_primus("train pretrain --config " + exp1.string() + " workspace=" + (w.path() / "c").string());
  ASSERT_EQ(c.code, 0) << c.out;
  const auto c_loss = hfi_column(w.path() / "c/local/local/from-hf/metrics.jsonl", "loss");
  ASSERT_EQ(c_loss.size(), 10u);
  EXPECT_LT(c_loss.front(), a_loss.front() - 0.5) << "load_hf did not start from the trained weights";
  EXPECT_LT((c_loss[8] + c_loss[9]) / 2, (c_loss[0] + c_loss[1]) / 2) << "continued pretraining did not lower the loss";

  // A model key that contradicts config.json is refused, naming it.
  auto bad = run_primus("train pretrain --config " + exp1.string() + " workspace=" + (w.path() / "d").string() +
                        " num_layers=3");
  EXPECT_NE(bad.code, 0);
  EXPECT_NE(bad.out.find("num_layers = 3 conflicts with"), std::string::npos) << bad.out;

  // The same folder as a Hub id's snapshot in a Hugging Face cache: load_hf and import hf find it
  // offline (the snapshot refs/main names), and an id the cache lacks is refused naming the cache.
  const fsys::path repo = w.path() / "hub/models--acme--tiny-llama";
  fsys::create_directories(repo / "refs");
  fsys::create_directories(repo / "snapshots");
  fsys::copy(hf, repo / "snapshots/r1", fsys::copy_options::recursive);
  std::ofstream(repo / "refs/main") << "r1";
  const std::string cache = "HF_HUB_CACHE=" + (w.path() / "hub").string();
  auto h = run_primus("train pretrain --config " + exp0.string() + " workspace=" + (w.path() / "h").string() +
                          " load_hf=acme/tiny-llama",
                      cache);
  ASSERT_EQ(h.code, 0) << h.out;
  const auto h_val = hfi_column(w.path() / "h/local/local/from-hf/metrics.jsonl", "val_loss");
  ASSERT_EQ(h_val.size(), 1u);
  EXPECT_EQ(h_val[0], a_val[0]);
  auto hi = run_primus("import hf acme/tiny-llama " + (w.path() / "imported2").string() + " --seq-length 32 --tokenizer bytes",
                       cache);
  EXPECT_EQ(hi.code, 0) << hi.out;
  auto miss = run_primus("train pretrain --config " + exp0.string() + " workspace=" + (w.path() / "m").string() +
                             " load_hf=acme/absent --dry-run",
                         cache);
  EXPECT_EQ(miss.code, 2) << miss.out;
  EXPECT_NE(miss.out.find("load_hf 'acme/absent': no such folder or file, and no snapshot with config.json"),
            std::string::npos) << miss.out;
  EXPECT_NE(miss.out.find((w.path() / "hub").string()), std::string::npos) << miss.out;
}
