// The tokenizer of an imported checkpoint: a Qwen-style tokenizer.json (NFC normalizer, Qwen2
// split, chat special tokens) and its tokenizer_config.json travel inside the checkpoint, named
// relative to it, so the checkpoint still tokenizes, with the same end-of-document token, after
// both folders are moved or the Hugging Face folder is gone.
#include <gtest/gtest.h>

#include <fmt/format.h>
#include <nlohmann/json.hpp>
#include <unistd.h>

#include <filesystem>
#include <fstream>

#include "backends/reference/export.h"
#include "data/tokenizer/byte_level.h"
#include "data/tokenizer/tokenizer.h"
#include "io/checkpoint.h"
#include "tests/common/tiny_models.h"
#include "train/hf_import.h"
#include "train/inference_checkpoint.h"
#include "train/param_layout.h"

// No using-directives at namespace scope: the tests are compiled as one unity source.
namespace primus::hf_import_tokenizer_test {
namespace {

namespace fs = std::filesystem;
using nlohmann::json;

fs::path fresh_dir(const std::string& name) {
  fs::path p = fs::temp_directory_path() / fmt::format("primus_hf_import_tok_{}_{}", name, ::getpid());
  fs::remove_all(p);
  fs::create_directories(p);
  return p;
}

void write_json(const fs::path& p, const json& j) { std::ofstream(p) << j.dump(); }

// Byte tokens 0..255, "é" (its two bytes merged) = 259, and Qwen's special tokens.
json qwen_style_tokenizer() {
  json vocab = json::object();
  for (int b = 0; b < 256; ++b) vocab[data::byte_level::encode_token(std::string(1, static_cast<char>(b)))] = b;
  vocab[data::byte_level::encode_token("\xC3\xA9")] = 259;
  json added = json::array();
  int id = 256;
  for (const char* t : {"<|endoftext|>", "<|im_start|>", "<|im_end|>"}) {
    added.push_back({{"id", id++}, {"content", t}, {"single_word", false}, {"lstrip", false}, {"rstrip", false},
                     {"normalized", false}, {"special", true}});
  }
  const std::string qwen2_regex =
      R"((?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+)";
  return {{"version", "1.0"},
          {"added_tokens", added},
          {"normalizer", {{"type", "NFC"}}},
          {"pre_tokenizer",
           {{"type", "Sequence"},
            {"pretokenizers",
             {{{"type", "Split"}, {"pattern", {{"Regex", qwen2_regex}}}, {"behavior", "Isolated"}, {"invert", false}},
              {{"type", "ByteLevel"}, {"add_prefix_space", false}, {"trim_offsets", false}, {"use_regex", false}}}}}},
          {"post_processor", nullptr},
          {"decoder", {{"type", "ByteLevel"}}},
          {"model",
           {{"type", "BPE"}, {"dropout", nullptr}, {"unk_token", nullptr}, {"fuse_unk", false}, {"byte_fallback", false},
            {"vocab", vocab}, {"merges", json::array({data::byte_level::encode_token("\xC3") + " " +
                                                      data::byte_level::encode_token("\xA9")})}}}};
}

TEST(HfImportTokenizer, CheckpointKeepsItsTokenizerWhenMoved) {
  const train::ModelSpec spec = testing::tiny_qwen3(300, 304);
  const std::vector<float> params(static_cast<size_t>(train::make_param_layout(spec).total), 0.0f);
  const fs::path root = fresh_dir("root");
  const fs::path hf = root / "hf", out = root / "out", moved = root / "elsewhere" / "ckpt";
  fs::create_directories(hf);
  backends::reference::write_hf_folder(spec, params.data(), 258, hf, "fp32");
  write_json(hf / "tokenizer.json", qwen_style_tokenizer());
  write_json(hf / "tokenizer_config.json", {{"eos_token", "<|im_end|>"}});  // a chat model's
  const auto from_hf = data::make_tokenizer(hf.string());
  EXPECT_EQ(from_hf->eod_id(), 258);

  const fs::path dir = train::import_hf_checkpoint(hf, out, {});
  const fs::path rel = fs::relative(dir, out);
  fs::create_directories(moved.parent_path());
  fs::rename(out, moved);
  fs::remove_all(hf);  // the checkpoint needs nothing from the Hugging Face folder

  const train::InferenceCheckpoint ck = train::load_inference_checkpoint(moved.string());
  EXPECT_EQ(fs::path(ck.tokenizer), moved / rel / "tokenizer.json");
  const auto tok = data::make_tokenizer(ck.tokenizer);
  EXPECT_EQ(tok->eod_id(), 258);  // from the copied tokenizer_config.json, as in the HF folder
  EXPECT_EQ(tok->vocab_size(), 260);
  const std::vector<int32_t> want = {257, 259, 258, 256};  // NFC composes e + U+0301 into é
  EXPECT_EQ(tok->encode("<|im_start|>e\u0301<|im_end|><|endoftext|>"), want);
  EXPECT_EQ(tok->encode("<|im_start|>\u00E9<|im_end|><|endoftext|>"), want);
  fs::remove_all(root);
}

TEST(HfImportTokenizer, RecordedTokenizerResolution) {
  const fs::path dir = fresh_dir("resolve");
  std::ofstream(dir / "tokenizer.json") << "{}";
  EXPECT_EQ(train::checkpoint_tokenizer("tokenizer.json", dir), (dir / "tokenizer.json").string());
  EXPECT_EQ(train::checkpoint_tokenizer("gpt2", dir), "gpt2");    // not a file there
  EXPECT_EQ(train::checkpoint_tokenizer("bytes", dir), "bytes");
  EXPECT_EQ(train::checkpoint_tokenizer("/abs/tokenizer.json", dir), "/abs/tokenizer.json");
  EXPECT_EQ(train::checkpoint_tokenizer("data/other.json", dir), "data/other.json");  // as the run had it
  fs::remove_all(dir);
}

}  // namespace
}  // namespace primus::hf_import_tokenizer_test
