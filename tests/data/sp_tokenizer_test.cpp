// SentencePiece-style BPE tokenizer.json files (Llama-2, Mistral, Mixtral): a small hand-written
// vocabulary in their form ("▁"-prefixed pieces, <0x00>..<0xFF> byte tokens at ids 3..258 as
// Llama-2 has them, <unk> <s> </s>), with the ids worked out by hand from the merge ranks as the
// Hugging Face tokenizers library applies them (merges over characters, byte fallback for a
// character with no token), for both spellings of the spaces: the older Prepend + Replace
// normalizer and the newer Metaspace pre-tokenizer. tests/data/crosscheck_hf.py checks a
// trained one against the library itself.
#include <gtest/gtest.h>

#include <nlohmann/json.hpp>
#include <random>

#include "core/util/error.h"
#include "data/tokenizer/tokenizer.h"
#include "data_test_util.h"

namespace primus::data {
namespace {

using nlohmann::json;
using Ids = std::vector<int32_t>;

const std::string kMeta = "\xE2\x96\x81";  // ▁, U+2581

int32_t byte_id(unsigned char b) { return 3 + b; }

// The pieces after the byte tokens, and the merges in rank order (see the worked examples).
json sp_vocab() {
  json v = {{"<unk>", 0}, {"<s>", 1}, {"</s>", 2}};
  for (int b = 0; b < 256; ++b) {
    char name[8];
    std::snprintf(name, sizeof name, "<0x%02X>", b);
    v[name] = byte_id(static_cast<unsigned char>(b));
  }
  const std::vector<std::string> pieces = {
      kMeta, "h", "e", "l", "o", "w", "r", "d",                                     // 259..266
      kMeta + "h", "ll", kMeta + "w", "or", kMeta + "he", "llo", kMeta + "hello",  // 267..273
      kMeta + "wor", kMeta + "worl", kMeta + "world", kMeta + kMeta, "\xC3\xA9",  // 274..278
      kMeta + "hey"};                                                               // 279
  for (size_t i = 0; i < pieces.size(); ++i) v[pieces[i]] = 259 + static_cast<int>(i);
  return v;
}

json sp_merges() {
  return json::array({json::array({kMeta, "h"}),                // 0 -> 267
                      json::array({"l", "l"}),                  // 1 -> 268
                      json::array({kMeta, "w"}),                // 2 -> 269
                      json::array({"o", "r"}),                  // 3 -> 270
                      json::array({kMeta + "h", "e"}),          // 4 -> 271
                      json::array({"ll", "o"}),                 // 5 -> 272
                      json::array({kMeta + "he", "llo"}),       // 6 -> 273
                      json::array({kMeta + "w", "or"}),         // 7 -> 274
                      json::array({kMeta + "wor", "l"}),        // 8 -> 275
                      json::array({kMeta + "worl", "d"}),       // 9 -> 276
                      json::array({kMeta, kMeta})});            // 10 -> 277
}

json sp_special(int id, const std::string& content) {
  return {{"id", id},         {"content", content}, {"single_word", false}, {"lstrip", false},
          {"rstrip", false},  {"normalized", false}, {"special", true}};
}

// Llama-2 / Mistral-7B-v0.1 as transformers writes them: Prepend + Replace normalizer, no
// pre-tokenizer. metaspace: the newer form instead (no normalizer, Metaspace pre-tokenizer).
json sp_tokenizer_json(bool metaspace, const std::string& scheme = "first", bool split = false) {
  json j = {{"version", "1.0"},
            {"truncation", nullptr},
            {"padding", nullptr},
            {"added_tokens", json::array({sp_special(0, "<unk>"), sp_special(1, "<s>"), sp_special(2, "</s>")})},
            {"normalizer",
             {{"type", "Sequence"},
              {"normalizers",
               {{{"type", "Prepend"}, {"prepend", kMeta}},
                {{"type", "Replace"}, {"pattern", {{"String", " "}}}, {"content", kMeta}}}}}},
            {"pre_tokenizer", nullptr},
            {"post_processor", nullptr},
            {"decoder",
             {{"type", "Sequence"},
              {"decoders",
               {{{"type", "Replace"}, {"pattern", {{"String", kMeta}}}, {"content", " "}},
                {{"type", "ByteFallback"}},
                {{"type", "Fuse"}},
                {{"type", "Strip"}, {"content", " "}, {"start", 1}, {"stop", 0}}}}}},
            {"model",
             {{"type", "BPE"},
              {"dropout", nullptr},
              {"unk_token", "<unk>"},
              {"continuing_subword_prefix", nullptr},
              {"end_of_word_suffix", nullptr},
              {"fuse_unk", true},
              {"byte_fallback", true},
              {"ignore_merges", false},
              {"vocab", sp_vocab()},
              {"merges", sp_merges()}}}};
  if (metaspace) {
    j["normalizer"] = nullptr;
    j["pre_tokenizer"] = {{"type", "Metaspace"}, {"replacement", kMeta}, {"prepend_scheme", scheme}, {"split", split}};
  }
  return j;
}

std::unique_ptr<Tokenizer> load(const testing::TempDir& dir, const std::string& name, const json& j) {
  std::string path = dir / name;
  testing::write_bytes(path, j.dump());
  return make_tokenizer(path);
}

TEST(SentencePieceBpe, PrependReplaceNormalizer) {
  testing::TempDir dir;
  auto tok = load(dir, "llama2.json", sp_tokenizer_json(false));
  EXPECT_EQ(tok->vocab_size(), 280);
  EXPECT_EQ(tok->eod_id(), 2);  // </s>, by name (no tokenizer_config.json)
  EXPECT_NE(tok->name().find("sentencepiece"), std::string::npos) << tok->name();
  // "▁hello▁world": ▁h (rank 0), ll (1), ▁w (2), or (3), ▁he (4), llo (5), ▁hello (6), ▁wor
  // (7), ▁worl (8), ▁world (9).
  EXPECT_EQ(tok->encode("hello world"), (Ids{273, 276}));
  // Leading and repeated spaces: "▁▁hello" takes ▁h (rank 0) before ▁▁ (rank 10).
  EXPECT_EQ(tok->encode(" hello"), (Ids{259, 273}));
  EXPECT_EQ(tok->encode("hello  world"), (Ids{273, 259, 276}));
  EXPECT_EQ(tok->encode("  "), (Ids{277, 259}));  // "▁▁▁": ▁▁ leftmost, then ▁
  // Characters merge, not bytes: é is one token; "ey" are no tokens: y falls back to <0x79>.
  EXPECT_EQ(tok->encode("h\xC3\xA9"), (Ids{267, 278}));
  EXPECT_EQ(tok->encode("hey"), (Ids{271, byte_id('y')}));
  // An emoji with no token: its four UTF-8 bytes.
  EXPECT_EQ(tok->encode("\xF0\x9F\x98\x80"),
            (Ids{259, byte_id(0xF0), byte_id(0x9F), byte_id(0x98), byte_id(0x80)}));
  // Special tokens are matched in the raw text; each segment after one gets its own "▁".
  EXPECT_EQ(tok->encode("<s>hello</s>"), (Ids{1, 273, 2}));
  EXPECT_EQ(tok->encode("hello</s>world"), (Ids{273, 2, 276}));
  EXPECT_EQ(tok->encode(""), (Ids{}));

  // Decode: ▁ -> space, byte runs fused back, one leading space stripped.
  EXPECT_EQ(tok->decode(Ids{273, 276}), "hello world");
  EXPECT_EQ(tok->decode(Ids{259, 273}), " hello");
  EXPECT_EQ(tok->decode(Ids{259, byte_id(0xF0), byte_id(0x9F), byte_id(0x98), byte_id(0x80)}), "\xF0\x9F\x98\x80");
  EXPECT_EQ(tok->decode(Ids{1, 273, 2}), "<s> hello</s>");  // as the library: the "▁" stays
  EXPECT_THROW(tok->decode(Ids{280}), RuntimeError);

  // Round trip: exact for text without added tokens (and without U+2581 itself), malformed
  // UTF-8 included (its bytes fall back to byte tokens).
  std::mt19937_64 rng(testing::fresh_seed());
  const char* atoms[] = {"h", "e", "llo", " ", "  ", "w", "\xC3\xA9", "\xF0\x9F\x98\x80", "\n", "\xFF", "z", "\xE4\xB8\xAD"};
  for (int i = 0; i < 300; ++i) {
    std::string s;
    for (int n = static_cast<int>(rng() % 20); n > 0; --n) s += atoms[rng() % 12];
    EXPECT_EQ(tok->decode(tok->encode(s)), s);
  }
}

TEST(SentencePieceBpe, MetaspacePreTokenizer) {
  testing::TempDir dir;
  auto first = load(dir, "first.json", sp_tokenizer_json(true, "first"));
  EXPECT_EQ(first->encode("hello world"), (Ids{273, 276}));
  // prepend_scheme "first": text that already starts with a space gets no second "▁" (so that
  // space is lost on decode), and text after a special token gets none.
  EXPECT_EQ(first->encode(" hello"), (Ids{273}));
  EXPECT_EQ(first->decode(first->encode(" hello")), "hello");
  EXPECT_EQ(first->encode("<s>hello</s>"), (Ids{1, 260, 261, 272, 2}));  // h e llo
  EXPECT_EQ(first->decode(Ids{1, 260, 261, 272, 2}), "<s>hello</s>");
  auto always = load(dir, "always.json", sp_tokenizer_json(true, "always"));
  EXPECT_EQ(always->encode("<s>hello"), (Ids{1, 273}));
  // split: pieces start at each "▁", so "▁hello▁▁world" is ▁hello | ▁ | ▁world, and ▁▁ never forms.
  auto split = load(dir, "split.json", sp_tokenizer_json(true, "first", true));
  EXPECT_EQ(split->encode("hello  world"), (Ids{273, 259, 276}));
  EXPECT_EQ(split->encode("  "), (Ids{259, 259}));
  auto nosplit = load(dir, "nosplit.json", sp_tokenizer_json(true, "first", false));
  EXPECT_EQ(nosplit->encode("  "), (Ids{277}));

  // Round trip with "first": exact but for one leading space.
  std::mt19937_64 rng(testing::fresh_seed());
  const char* atoms[] = {"h", "e", "llo", " ", "w", "\xF0\x9F\x98\x80", "\n", "\xFF"};
  for (int i = 0; i < 200; ++i) {
    std::string s;
    for (int n = static_cast<int>(rng() % 20); n > 0; --n) s += atoms[rng() % 8];
    std::string want = !s.empty() && s[0] == ' ' ? s.substr(1) : s;
    EXPECT_EQ(first->decode(first->encode(s)), want);
  }
}

TEST(SentencePieceBpe, UnkFuseUnkIgnoreMergesAndEndOfDocument) {
  testing::TempDir dir;
  json j = sp_tokenizer_json(false);
  j["model"]["byte_fallback"] = false;  // unknown characters become <unk>, fused
  EXPECT_EQ(load(dir, "fuse.json", j)->encode("h\xF0\x9F\x98\x80\xF0\x9F\x98\x80o"), (Ids{267, 0, 263}));
  j["model"]["fuse_unk"] = false;
  EXPECT_EQ(load(dir, "nofuse.json", j)->encode("h\xF0\x9F\x98\x80\xF0\x9F\x98\x80o"), (Ids{267, 0, 0, 263}));

  // ignore_merges: a word that is a token is taken whole, though no merges lead to it.
  json k = sp_tokenizer_json(true, "first", true);
  EXPECT_EQ(load(dir, "merges.json", k)->encode("hey"), (Ids{271, byte_id('y')}));
  k["model"]["ignore_merges"] = true;
  EXPECT_EQ(load(dir, "ignore.json", k)->encode("hey"), (Ids{279}));

  testing::write_bytes(dir / "tokenizer_config.json", json({{"eos_token", "<s>"}}).dump());
  EXPECT_EQ(load(dir, "tokenizer.json", sp_tokenizer_json(false))->eod_id(), 1);
}

TEST(SentencePieceBpe, RefusesWhatItCannotReproduce) {
  struct Case {
    std::string what;
    std::function<void(json&)> edit;
  };
  const std::vector<Case> cases = {
      {"BPE dropout", [](json& j) { j["model"]["dropout"] = 0.1; }},
      {"decoder 'Metaspace' in a SentencePiece-style file", [](json& j) {
         j["decoder"] = {{"type", "Metaspace"}, {"replacement", kMeta}, {"prepend_scheme", "always"}};
       }},
      {"decoder 'null'", [](json& j) { j["decoder"] = nullptr; }},
      {"pre_tokenizer 'ByteLevel' in a SentencePiece-style file",
       [](json& j) { j["pre_tokenizer"] = {{"type", "ByteLevel"}}; }},
      {"Metaspace prepend_scheme 'sometimes'", [](json& j) {
         j["pre_tokenizer"] = {{"type", "Metaspace"}, {"replacement", kMeta}, {"prepend_scheme", "sometimes"}};
       }},
  };
  testing::TempDir dir;
  for (const auto& c : cases) {
    json j = sp_tokenizer_json(false);
    c.edit(j);
    std::string path = dir / "bad.json";
    testing::write_bytes(path, j.dump());
    try {
      make_tokenizer(path);
      ADD_FAILURE() << "accepted: " << c.what;
    } catch (const FormatError& e) {
      std::string msg = e.what();
      EXPECT_NE(msg.find(path), std::string::npos) << msg;
      EXPECT_NE(msg.find(c.what), std::string::npos) << msg;
    }
  }
}

}  // namespace
}  // namespace primus::data
