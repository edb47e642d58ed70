// A Qwen-style tokenizer (NFC normalizer, Qwen2 split, chat special tokens) through the binary:
// a tiny Llama trains with it, `export hf` writes a Hugging Face folder with its tokenizer files,
// `import hf` copies the tokenizer into the checkpoint, and after the checkpoint is moved and
// the original folders are deleted, `generate` still tokenizes (decomposed and composed prompts
// give the same ids and the same greedy continuation) and `export hf` still finds the
// end-of-document token of tokenizer_config.json.
#include <gtest/gtest.h>

#include <fstream>
#include <nlohmann/json.hpp>

#include "cli_runner.h"
#include "core/util/fs.h"

using primus::testing::run_primus;
using primus::testing::Workdir;
namespace fsys = std::filesystem;

namespace {

// GPT-2's byte-to-character map of byte-level BPE vocabularies.
std::string hft_byte_level(const std::string& bytes) {
  std::string out;
  for (unsigned char b : bytes) {
    int cp = b;
    const bool printable = (b >= 33 && b <= 126) || (b >= 161 && b <= 172) || (b >= 174);
    if (!printable) {
      int n = 0;
      for (int x = 0; x < b; ++x) {
        if (!((x >= 33 && x <= 126) || (x >= 161 && x <= 172) || x >= 174)) ++n;
      }
      cp = 256 + n;
    }
    if (cp < 0x80) {
      out += static_cast<char>(cp);
    } else {
      out += static_cast<char>(0xC0 | (cp >> 6));
      out += static_cast<char>(0x80 | (cp & 0x3F));
    }
  }
  return out;
}

// Bytes 0..255, "é" (C3 A9) = 256, <|endoftext|> 257, <|im_start|> 258, <|im_end|> 259.
nlohmann::json hft_tokenizer() {
  using nlohmann::json;
  json vocab = json::object();
  for (int b = 0; b < 256; ++b) vocab[hft_byte_level(std::string(1, static_cast<char>(b)))] = b;
  vocab[hft_byte_level("\xC3\xA9")] = 256;
  json added = json::array();
  int id = 257;
  for (const char* t : {"<|endoftext|>", "<|im_start|>", "<|im_end|>"}) {
    added.push_back({{"id", id++}, {"content", t}, {"single_word", false}, {"lstrip", false}, {"rstrip", false},
                     {"normalized", false}, {"special", true}});
  }
  const std::string qwen2 =
      R"((?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+)";
  return {{"version", "1.0"},
          {"added_tokens", added},
          {"normalizer", {{"type", "NFC"}}},
          {"pre_tokenizer",
           {{"type", "Sequence"},
            {"pretokenizers",
             {{{"type", "Split"}, {"pattern", {{"Regex", qwen2}}}, {"behavior", "Isolated"}, {"invert", false}},
              {{"type", "ByteLevel"}, {"add_prefix_space", false}, {"trim_offsets", false}, {"use_regex", false}}}}}},
          {"decoder", {{"type", "ByteLevel"}}},
          {"model",
           {{"type", "BPE"}, {"vocab", vocab},
            {"merges", json::array({hft_byte_level("\xC3") + " " + hft_byte_level("\xA9")})}}}};
}

std::string hft_last_line(const std::string& out) {
  std::string s = out;
  while (!s.empty() && s.back() == '\n') s.pop_back();
  const size_t nl = s.rfind('\n');
  return nl == std::string::npos ? s : s.substr(nl + 1);
}

}  // namespace

TEST(QwenTokenizerE2E, ImportedCheckpointKeepsItsNfcTokenizerWhenMoved) {
  Workdir w;
  const fsys::path tok = w.write("tok/tokenizer.json", hft_tokenizer().dump()).parent_path();
  w.write("tok/tokenizer_config.json", R"({"eos_token": "<|im_end|>"})");
  const std::string ws = (w.path() / "a").string();
  auto a = run_primus("train pretrain --config " + std::string(PRIMUS_SOURCE_DIR) +
                      "/examples/reference/llama-shakespeare.yaml num_layers=1 hidden_size=32 num_attention_heads=4 "
                      "num_query_groups=2 ffn_hidden_size=64 seq_length=32 micro_batch_size=2 global_batch_size=2 "
                      "train_iters=2 eval_interval=0 log_interval=1 sample_tokens=0 save_interval=2 vocab_size=260 "
                      "tokenizer_type=" + tok.string() + " workspace=" + ws);
  ASSERT_EQ(a.code, 0) << a.out;
  const fsys::path hf = w.path() / "hf", imported = w.path() / "imported", moved = w.path() / "elsewhere" / "ckpt";
  auto e = run_primus("export hf " + ws + "/local/local/llama-shakespeare/checkpoints " + hf.string() + " --dtype fp32");
  ASSERT_EQ(e.code, 0) << e.out;
  // export hf writes the run's tokenizer files beside the weights, so the import needs nothing else.
  EXPECT_EQ(primus::fs::read_file(hf / "tokenizer.json"), primus::fs::read_file(tok / "tokenizer.json"));
  EXPECT_EQ(primus::fs::read_file(hf / "tokenizer_config.json"), primus::fs::read_file(tok / "tokenizer_config.json"));
  auto i = run_primus("import hf " + hf.string() + " " + imported.string() + " --seq-length 32");
  ASSERT_EQ(i.code, 0) << i.out;
  fsys::create_directories(moved.parent_path());
  fsys::rename(imported, moved);
  fsys::remove_all(hf);
  fsys::remove_all(tok);
  fsys::remove_all(ws);

  // "e" + U+0301 and "é" are one token (256) after NFC: the same greedy continuation.
  const std::string gen = "generate --backend reference --checkpoint " + moved.string() +
                          " -n 4 --temperature 0 --ignore-eod --print-ids --prompt ";
  auto d = run_primus(gen + "'caf\xC3\xA9<|im_end|>'");
  auto c = run_primus(gen + "'cafe\xCC\x81<|im_end|>'");
  ASSERT_EQ(d.code, 0) << d.out;
  ASSERT_EQ(c.code, 0) << c.out;
  EXPECT_EQ(hft_last_line(d.out), hft_last_line(c.out)) << d.out << c.out;
  const auto ids = nlohmann::json::parse(hft_last_line(d.out), nullptr, false);
  ASSERT_FALSE(ids.is_discarded()) << d.out;
  EXPECT_NE(ids.dump().find(','), std::string::npos) << "expected the 4 new ids: " << d.out;

  // export finds the copied tokenizer_config.json's eos_token (<|im_end|> = 259).
  const fsys::path hf2 = w.path() / "hf2";
  auto x = run_primus("export hf " + moved.string() + " " + hf2.string() + " --dtype fp32");
  ASSERT_EQ(x.code, 0) << x.out;
  EXPECT_EQ(x.out.find("not available"), std::string::npos) << x.out;
  std::ifstream cfg(hf2 / "config.json");
  const auto j = nlohmann::json::parse(cfg);
  EXPECT_EQ(j.at("eos_token_id"), 259) << j.dump();
}
