// tokenizer.json files: one rebuilt from GPT-2's vocabulary must tokenize exactly like the
// gpt2 tokenizer (both merge spellings, both ways of writing the pre-tokenizer); small
// generated files check the Llama-3 / Qwen2 patterns, ignore_merges, added tokens and the
// end-of-document lookup; unsupported files are refused naming the file.
#include <gtest/gtest.h>

#include <cstdlib>
#include <filesystem>
#include <fstream>
#include <nlohmann/json.hpp>
#include <random>

#include "core/util/error.h"
#include "data/tokenizer/byte_level.h"
#include "data/tokenizer/pretokenize.h"
#include "data/tokenizer/tokenizer.h"
#include "data_test_util.h"

namespace primus::data {
namespace {

using nlohmann::json;
using Ids = std::vector<int32_t>;

json byte_level_pre(bool add_prefix_space = false, bool use_regex = true) {
  return {{"type", "ByteLevel"}, {"add_prefix_space", add_prefix_space}, {"trim_offsets", true},
          {"use_regex", use_regex}};
}

json split_pre(PreTokenizerKind kind) {
  return {{"type", "Sequence"},
          {"pretokenizers",
           {{{"type", "Split"},
             {"pattern", {{"Regex", std::string(pretokenizer_regex(kind))}}},
             {"behavior", "Isolated"},
             {"invert", false}},
            byte_level_pre(false, false)}}};
}

json tokenizer_json(json vocab, json merges, json pre, json added = json::array()) {
  return {{"version", "1.0"},
          {"truncation", nullptr},
          {"padding", nullptr},
          {"added_tokens", added},
          {"normalizer", nullptr},
          {"pre_tokenizer", pre},
          {"post_processor", nullptr},
          {"decoder", {{"type", "ByteLevel"}, {"add_prefix_space", true}, {"trim_offsets", true}}},
          {"model",
           {{"type", "BPE"},
            {"dropout", nullptr},
            {"unk_token", nullptr},
            {"continuing_subword_prefix", ""},
            {"end_of_word_suffix", ""},
            {"fuse_unk", false},
            {"byte_fallback", false},
            {"vocab", vocab},
            {"merges", merges}}}};
}

json added_token(int id, const std::string& content, bool lstrip = false) {
  return {{"id", id},         {"content", content}, {"single_word", false}, {"lstrip", lstrip},
          {"rstrip", false},  {"normalized", false}, {"special", true}};
}

std::string write_json(const testing::TempDir& dir, const std::string& name, const json& j) {
  std::string path = dir / name;
  testing::write_bytes(path, j.dump());
  return path;
}

// GPT-2's vocabulary and merges as tokenizer.json fields.
struct Gpt2Files {
  json vocab;
  std::vector<std::pair<std::string, std::string>> merges;
};
const Gpt2Files& gpt2_files() {
  static const Gpt2Files f = [] {
    Gpt2Files g;
    auto dir = gpt2_vocab_dir();
    g.vocab = json::parse(testing::read_bytes((dir / "encoder.json").string()));
    std::istringstream in(testing::read_bytes((dir / "vocab.bpe").string()));
    std::string line;
    std::getline(in, line);  // #version
    while (std::getline(in, line)) {
      if (line.empty()) continue;
      auto sp = line.find(' ');
      g.merges.emplace_back(line.substr(0, sp), line.substr(sp + 1));
    }
    return g;
  }();
  return f;
}

std::vector<std::string> probe_texts() {
  std::vector<std::string> texts = {"Hello world", " Hello<|endoftext|>again", "I'm can't we'll",
                                    "  leading\n\n\ntrailing   ", "naïve café Ωmega 中文 😀", "1234567 3.14"};
  std::mt19937_64 rng(testing::fresh_seed());
  const char* atoms[] = {"a", "Qu", " ", "\n", "'s", "9", ".", "é", "中", "😀", "\xFF", "\t"};
  for (int i = 0; i < 200; ++i) {
    std::string s;
    for (int n = static_cast<int>(rng() % 30); n > 0; --n) s += atoms[rng() % 12];
    texts.push_back(s);
  }
  if (auto p = testing::shakespeare_path(); !p.empty()) texts.push_back(testing::read_bytes(p).substr(0, 200000));
  return texts;
}

class Gpt2AsTokenizerJson : public ::testing::TestWithParam<int> {};

TEST_P(Gpt2AsTokenizerJson, GivesTheSameIdsAsGpt2) {
  const auto& g = gpt2_files();
  json merges = json::array();
  for (auto& [a, b] : g.merges) {
    if (GetParam() == 0) merges.push_back(a + " " + b);  // tokenizers < 0.20
    else merges.push_back({a, b});                       // tokenizers >= 0.20
  }
  json pre = GetParam() == 0 ? byte_level_pre() : split_pre(PreTokenizerKind::Gpt2);
  testing::TempDir dir;
  write_json(dir, "tokenizer.json",
             tokenizer_json(g.vocab, merges, pre, json::array({added_token(50256, "<|endoftext|>")})));
  auto hf = make_tokenizer(dir.path().string());  // a folder holding tokenizer.json
  auto ref = make_tokenizer("gpt2");
  EXPECT_EQ(hf->vocab_size(), 50257);
  EXPECT_EQ(hf->eod_id(), 50256);
  for (const auto& t : probe_texts()) {
    Ids ids = hf->encode(t);
    ASSERT_EQ(ids, ref->encode(t)) << t.substr(0, 80);
    ASSERT_EQ(hf->decode(ids), t);
  }
}
INSTANTIATE_TEST_SUITE_P(MergeSpellings, Gpt2AsTokenizerJson, ::testing::Values(0, 1));

// A tiny byte-level BPE: ids 0..255 are the bytes, then merged tokens in the order given.
struct Tiny {
  json vocab = json::object();
  json merges = json::array();
  std::map<std::string, int> id;  // raw bytes -> id

  Tiny() {
    for (int b = 0; b < 256; ++b) add(std::string(1, static_cast<char>(b)));
  }
  int add(const std::string& bytes) {
    int i = static_cast<int>(id.size());
    id[bytes] = i;
    vocab[byte_level::encode_token(bytes)] = i;
    return i;
  }
  void merge(const std::string& a, const std::string& b) {
    if (!id.count(a + b)) add(a + b);
    merges.push_back(byte_level::encode_token(a) + " " + byte_level::encode_token(b));
  }
};

TEST(HfTokenizer, Llama3AndQwen2PatternsSplitDigitsAndContractions) {
  Tiny t;
  t.merge("3", "4");  // rank 0: applies only when 3 and 4 share a piece
  t.merge("1", "2");
  t.merge("12", "3");
  t.merge("'", "L");
  t.merge("'L", "L");
  testing::TempDir dir;
  auto gpt2_style = make_tokenizer(write_json(dir, "g.json", tokenizer_json(t.vocab, t.merges, byte_level_pre())));
  auto llama3 = make_tokenizer(write_json(dir, "l.json", tokenizer_json(t.vocab, t.merges, split_pre(PreTokenizerKind::Llama3))));
  auto qwen2 = make_tokenizer(write_json(dir, "q.json", tokenizer_json(t.vocab, t.merges, split_pre(PreTokenizerKind::Qwen2))));
  const int i12 = t.id["12"], i34 = t.id["34"], i123 = t.id["123"];
  // GPT-2 regex: "12345" is one piece, so "3 4" (rank 0) wins; Llama-3: pieces "123" "45".
  EXPECT_EQ(gpt2_style->encode("12345"), (Ids{i12, i34, '5'}));
  EXPECT_EQ(llama3->encode("12345"), (Ids{i123, '4', '5'}));
  EXPECT_EQ(qwen2->encode("12345"), (Ids{'1', '2', '3', '4', '5'}));
  // Case-insensitive contractions in Llama-3 only: "'LL" is a piece there.
  EXPECT_EQ(llama3->encode("'LL"), (Ids{t.id["'LL"]}));
  EXPECT_EQ(gpt2_style->encode("'LL"), (Ids{'\'', 'L', 'L'}));
  EXPECT_NE(llama3->name().find("llama3"), std::string::npos);
  EXPECT_NE(llama3->name().find("l.json"), std::string::npos);
}

// A Hub id names the tokenizer.json of its snapshot in the Hugging Face cache (refs/main), as
// transformers finds it offline; one that is not there is refused naming the cache.
TEST(HfTokenizer, HubIdIsReadFromTheHuggingFaceCache) {
  Tiny t;
  t.merge("1", "2");
  t.merge("12", "3");
  testing::TempDir dir;
  const auto snap = dir.path() / "hub/models--org--tiny/snapshots/abc";
  std::filesystem::create_directories(snap);
  std::filesystem::rename(write_json(dir, "tokenizer.json", tokenizer_json(t.vocab, t.merges,
                                                                            split_pre(PreTokenizerKind::Llama3))),
                          snap / "tokenizer.json");
  std::filesystem::create_directories(dir.path() / "hub/models--org--tiny/refs");
  std::ofstream(dir.path() / "hub/models--org--tiny/refs/main") << "abc";
  const char* before = std::getenv("HF_HUB_CACHE");
  const std::string saved = before ? before : "";
  ::setenv("HF_HUB_CACHE", (dir.path() / "hub").c_str(), 1);
  std::unique_ptr<Tokenizer> tok;
  std::string missing;
  try {
    tok = make_tokenizer("org/tiny");
    make_tokenizer("org/absent");
  } catch (const ConfigError& e) {
    missing = e.what();
  }
  if (before) ::setenv("HF_HUB_CACHE", saved.c_str(), 1); else ::unsetenv("HF_HUB_CACHE");
  ASSERT_TRUE(tok);
  EXPECT_EQ(tok->encode("12345"), (Ids{t.id["123"], '4', '5'}));
  EXPECT_NE(tok->name().find("snapshots/abc/tokenizer.json"), std::string::npos) << tok->name();
  EXPECT_NE(missing.find("unknown tokenizer 'org/absent'"), std::string::npos) << missing;
  EXPECT_NE(missing.find("Hugging Face cache"), std::string::npos) << missing;
}

TEST(HfTokenizer, IgnoreMergesTakesWholePiecesFromTheVocabulary) {
  Tiny t;
  t.add("hello");  // in the vocabulary, but no merges build it
  json j = tokenizer_json(t.vocab, t.merges, split_pre(PreTokenizerKind::Llama3));
  testing::TempDir dir;
  auto plain = make_tokenizer(write_json(dir, "a.json", j));
  j["model"]["ignore_merges"] = true;
  auto whole = make_tokenizer(write_json(dir, "b.json", j));
  EXPECT_EQ(plain->encode("hello"), (Ids{'h', 'e', 'l', 'l', 'o'}));
  EXPECT_EQ(whole->encode("hello"), (Ids{t.id["hello"]}));
  EXPECT_EQ(whole->decode(whole->encode("hello hello")), "hello hello");
}

TEST(HfTokenizer, AddedTokensAndEndOfDocument) {
  Tiny t;
  json added = json::array({added_token(300, "<|begin_of_text|>"), added_token(301, "<|end_of_text|>"),
                            added_token(302, "<|eot_id|>"), added_token(303, "<mask>", /*lstrip=*/true)});
  testing::TempDir dir;
  std::string path = write_json(dir, "tokenizer.json", tokenizer_json(t.vocab, t.merges, split_pre(PreTokenizerKind::Llama3), added));
  {
    auto tok = make_tokenizer(path);
    EXPECT_EQ(tok->vocab_size(), 304);
    EXPECT_EQ(tok->eod_id(), 301);  // the usual name, with no tokenizer_config.json
    EXPECT_EQ(tok->encode("<|begin_of_text|>a<|end_of_text|>"), (Ids{300, 'a', 301}));
    // Longest match wins, and the text between specials is pre-tokenized on its own.
    EXPECT_EQ(tok->encode("x <mask>y"), (Ids{'x', 303, 'y'}));  // lstrip swallows the space
    EXPECT_EQ(tok->decode(Ids{300, 'a'}), "<|begin_of_text|>a");
  }
  // transformers' rule: tokenizer_config.json's eos_token decides.
  testing::write_bytes(dir / "tokenizer_config.json", json({{"eos_token", "<|eot_id|>"}}).dump());
  EXPECT_EQ(make_tokenizer(path)->eod_id(), 302);
  testing::write_bytes(dir / "tokenizer_config.json", json({{"eos_token", {{"content", "<|nope|>"}}}}).dump());
  EXPECT_THROW(make_tokenizer(path), FormatError);
}

TEST(HfTokenizer, AddPrefixSpace) {
  const auto& g = gpt2_files();
  json merges = json::array();
  for (auto& [a, b] : g.merges) merges.push_back(a + " " + b);
  testing::TempDir dir;
  auto tok = make_tokenizer(write_json(dir, "t.json", tokenizer_json(g.vocab, merges, byte_level_pre(true))));
  EXPECT_EQ(tok->encode("Hello"), (Ids{18435}));  // as " Hello"
  EXPECT_EQ(tok->encode(" Hello"), (Ids{18435}));
  EXPECT_EQ(tok->eod_id(), 50256);  // <|endoftext|> found in the vocabulary
}

// Each unsupported or broken file is refused with a FormatError naming the file and the part.
TEST(HfTokenizer, RefusesWhatItCannotReproduce) {
  Tiny t;
  t.merge("a", "b");
  json good = tokenizer_json(t.vocab, t.merges, byte_level_pre());
  struct Case {
    std::string what;
    std::function<void(json&)> edit;
  };
  const std::vector<Case> cases = {
      {"WordPiece", [](json& j) { j["model"]["type"] = "WordPiece"; }},
      {"normalizer 'Lowercase'", [](json& j) {
         j["normalizer"] = {{"type", "Sequence"}, {"normalizers", {{{"type", "NFC"}}, {{"type", "Lowercase"}}}}};
       }},
      {"Replace normalizer with a Regex", [](json& j) {
         j["normalizer"] = {{"type", "Replace"}, {"pattern", {{"Regex", "\\s+"}}}, {"content", " "}};
       }},
      // Whatever marks a file as SentencePiece-style (Llama-2, Mistral) makes it read as one:
      // then the byte-level parts are what is refused.
      {"decoder 'ByteLevel' in a SentencePiece-style file",
       [](json& j) { j["pre_tokenizer"] = {{"type", "Metaspace"}, {"replacement", "\u2581"}}; }},
      {"pre_tokenizer 'ByteLevel' in a SentencePiece-style file", [](json& j) {
         j["normalizer"] = {{"type", "Sequence"},
                            {"normalizers", {{{"type", "Prepend"}, {"prepend", "\u2581"}},
                                             {{"type", "Replace"}, {"pattern", {{"String", " "}}}, {"content", "\u2581"}}}}};
       }},
      {"normalizers Sequence nested deeper than", [](json& j) {
         json n = {{"type", "NFC"}};
         for (int i = 0; i < 200; ++i) n = {{"type", "Sequence"}, {"normalizers", {n}}};
         j["normalizer"] = n;
       }},
      {"pre_tokenizer 'ByteLevel' in a SentencePiece-style file", [](json& j) {
         j["decoder"] = {{"type", "Sequence"}, {"decoders", {{{"type", "ByteFallback"}}, {{"type", "Fuse"}}}}};
       }},
      {"pre_tokenizer 'null'", [](json& j) { j["pre_tokenizer"] = nullptr; }},
      {"Split regex '\\s+'", [](json& j) {
         j["pre_tokenizer"] = split_pre(PreTokenizerKind::Gpt2);
         j["pre_tokenizer"]["pretokenizers"][0]["pattern"]["Regex"] = "\\s+";
       }},
      {"pre_tokenizer 'ByteLevel' in a SentencePiece-style file", [](json& j) { j["model"]["byte_fallback"] = true; }},
      {"decoder 'WordPiece'", [](json& j) { j["decoder"] = {{"type", "WordPiece"}}; }},
      {"merge #1", [](json& j) { j["model"]["merges"].push_back("x Ġzz"); }},
      {"byte-level alphabet", [](json& j) { j["model"]["vocab"]["\xE2\x96\x81the"] = 999; }},
  };
  testing::TempDir dir;
  for (const auto& c : cases) {
    json j = good;
    c.edit(j);
    std::string path = write_json(dir, "bad.json", j);
    try {
      make_tokenizer(path);
      ADD_FAILURE() << "accepted: " << c.what;
    } catch (const FormatError& e) {
      std::string msg = e.what();
      EXPECT_NE(msg.find(path), std::string::npos) << msg;
      EXPECT_NE(msg.find(c.what), std::string::npos) << msg;
    }
  }
  testing::write_bytes(dir / "broken.json", "{\"model\": ");
  try {
    make_tokenizer(dir / "broken.json");
    ADD_FAILURE();
  } catch (const FormatError& e) {
    EXPECT_NE(std::string(e.what()).find("broken.json"), std::string::npos);
  }
}

// A Qwen2-style file: NFC normalizer, Qwen2's Split regex + ByteLevel, <|endoftext|>,
// <|im_start|>, <|im_end|> as added tokens. Composed and decomposed spellings of the same text
// give the same ids (the pairs are written out here, not computed with the normalizer), and
// decode gives the composed (NFC) text back.
TEST(HfTokenizer, NfcNormalizerMakesDecomposedTextTokenizeAsComposed) {
  Tiny t;
  t.merge("\xC3", "\xA9");  // é, U+00E9
  t.merge("\xE1", "\xBB");
  t.merge("\xE1\xBB", "\x99");  // ộ, U+1ED9
  json added = json::array({added_token(400, "<|endoftext|>"), added_token(401, "<|im_start|>"),
                            added_token(402, "<|im_end|>")});
  json j = tokenizer_json(t.vocab, t.merges, split_pre(PreTokenizerKind::Qwen2), added);
  testing::TempDir dir;
  auto plain = make_tokenizer(write_json(dir, "plain.json", j));
  j["normalizer"] = {{"type", "NFC"}};
  std::string path = write_json(dir, "tokenizer.json", j);
  auto qwen = make_tokenizer(path);
  EXPECT_NE(qwen->name().find("qwen2, NFC"), std::string::npos) << qwen->name();
  EXPECT_EQ(qwen->eod_id(), 400);  // no tokenizer_config.json: <|endoftext|>

  // (composed, decomposed): NFC composes, and orders combining marks canonically.
  const std::pair<std::string, std::string> pairs[] = {
      {"\u00E9", "e\u0301"},                  // é
      {"\u00C5", "A\u030A"},                  // Å
      {"\u00C5", "\u212B"},                   // the Angstrom sign is a singleton for Å
      {"\u00F1", "n\u0303"},                  // ñ
      {"\uD55C", "\u1112\u1161\u11AB"},       // 한 from its jamo
      {"\u1ED9", "o\u0323\u0302"},            // ộ: dot below then circumflex
      {"\u1ED9", "o\u0302\u0323"},            // ... or the other order
      {"\u1ED9", "\u00F4\u0323"},             // ... or ô then dot below
      {"a", "a"}, {" ", " "}, {"\n", "\n"}, {"7", "7"}, {"'s", "'s"}, {"<|im_end|>", "<|im_end|>"},
  };
  std::mt19937_64 rng(testing::fresh_seed());
  for (int trial = 0; trial < 200; ++trial) {
    std::string composed, decomposed;
    for (int n = 1 + static_cast<int>(rng() % 12); n > 0; --n) {
      const auto& p = pairs[rng() % std::size(pairs)];
      composed += p.first;
      decomposed += p.second;
    }
    Ids ids = qwen->encode(decomposed);
    ASSERT_EQ(ids, qwen->encode(composed)) << decomposed;
    ASSERT_EQ(ids, plain->encode(composed)) << composed;  // composed text is already NFC
    ASSERT_EQ(qwen->decode(ids), composed);
  }
  EXPECT_EQ(qwen->encode("e\u0301"), (Ids{t.id["\xC3\xA9"]}));
  EXPECT_EQ(plain->encode("e\u0301"), (Ids{'e', 0xCC, 0x81}));  // without the normalizer: bytes
  // Chat markup: the special tokens are found in the raw text, NFC applies between them.
  EXPECT_EQ(qwen->encode("<|im_start|>e\u0301<|im_end|><|endoftext|>"),
            (Ids{401, t.id["\xC3\xA9"], 402, 400}));
  // The normalizer runs on each segment between added tokens (as tokenizers does), so a combining
  // mark right after a special token stays a mark.
  EXPECT_EQ(qwen->encode("<|im_end|>\u0301"), (Ids{402, 0xCC, 0x81}));
  // Malformed UTF-8 passes through byte for byte; the valid runs around it are normalized.
  EXPECT_EQ(qwen->decode(qwen->encode("\xFF" "e\u0301\xC3" "A\u030A")), "\xFF\u00E9\xC3\u00C5");
  // Pure ASCII is untouched.
  EXPECT_EQ(qwen->decode(qwen->encode("Hello, world 123\n")), "Hello, world 123\n");
  // Random bytes (overlong forms, surrogates, truncated sequences, stray marks): ids stay in the
  // vocabulary and normalizing is idempotent, so the decoded text encodes to the same ids.
  const char* bytes_atoms[] = {"\xC0\xAF", "\xED\xA0\x80", "\xE2\x82", "\xF4\x90\x80\x80", "\xFF", "\x80",
                               "\xCC\x81", "e", "\xC3\xA9", " ", "<|im_end|>", "\xE1\xBB\x99", "\xE2\x84\xAB"};
  for (int trial = 0; trial < 300; ++trial) {
    std::string s;
    for (int n = static_cast<int>(rng() % 16); n > 0; --n) s += bytes_atoms[rng() % std::size(bytes_atoms)];
    Ids ids = qwen->encode(s);
    for (int32_t id : ids) ASSERT_TRUE(id >= 0 && id < qwen->vocab_size());
    std::string back = qwen->decode(ids);
    ASSERT_EQ(qwen->encode(back), ids) << s;
  }

  // transformers' rule for the end of document: tokenizer_config.json's eos_token (<|im_end|> in
  // Qwen's chat models, <|endoftext|> in the base ones).
  testing::write_bytes(dir / "tokenizer_config.json", json({{"eos_token", "<|im_end|>"}}).dump());
  EXPECT_EQ(make_tokenizer(path)->eod_id(), 402);
  testing::write_bytes(dir / "tokenizer_config.json", json({{"eos_token", "<|endoftext|>"}}).dump());
  EXPECT_EQ(make_tokenizer(path)->eod_id(), 400);
}

// The compatibility forms, NFD and Replace in a Sequence, and added tokens that tokenizers
// matches in the normalized text ("normalized": true) against those matched in the raw text.
TEST(HfTokenizer, CompatibilityFormsReplaceAndNormalizedAddedTokens) {
  Tiny t;
  auto norm_file = [&](json normalizer, json added = json::array()) {
    json j = tokenizer_json(t.vocab, t.merges, split_pre(PreTokenizerKind::Qwen2), added);
    j["normalizer"] = std::move(normalizer);
    return j;
  };
  testing::TempDir dir;
  auto nfkc = make_tokenizer(write_json(dir, "nfkc.json", norm_file({{"type", "NFKC"}})));
  EXPECT_EQ(nfkc->decode(nfkc->encode("\uFB01 \u2460 \uFF21 x\u00B2")), "fi 1 A x2");  // ﬁ ① Ａ ²
  auto nfc = make_tokenizer(write_json(dir, "nfc.json", norm_file({{"type", "NFC"}})));
  EXPECT_EQ(nfc->decode(nfc->encode("\uFB01 \u2460")), "\uFB01 \u2460");  // canonical only
  auto nfd = make_tokenizer(write_json(dir, "nfd.json", norm_file({{"type", "NFD"}})));
  EXPECT_EQ(nfd->decode(nfd->encode("\u00E9\u1ED9")), "e\u0301o\u0323\u0302");
  auto nfkd = make_tokenizer(write_json(dir, "nfkd.json", norm_file({{"type", "NFKD"}})));
  EXPECT_EQ(nfkd->decode(nfkd->encode("\uFB01\u00E9")), "fie\u0301");
  // Strip accents: NFD, then remove the combining acute; then a literal multi-byte Replace.
  json seq = {{"type", "Sequence"},
              {"normalizers", {{{"type", "NFD"}},
                               {{"type", "Replace"}, {"pattern", {{"String", "\u0301"}}}, {"content", ""}},
                               {{"type", "Replace"}, {"pattern", {{"String", "ab"}}}, {"content", "b\u00E9"}}}}};
  auto strip = make_tokenizer(write_json(dir, "seq.json", norm_file(seq)));
  EXPECT_EQ(strip->decode(strip->encode("caf\u00E9 abab")), "cafe b\u00E9b\u00E9");
  EXPECT_NE(strip->name().find("Sequence[NFD, Replace, Replace]"), std::string::npos) << strip->name();

  // "<x>" is normalized (found after NFKC turns fullwidth ＜x＞ into <x>); "<|eot|>" is special and
  // not normalized, so its fullwidth spelling is ordinary text.
  json x = added_token(300, "<x>");
  x["normalized"] = true;
  x["special"] = false;
  auto tok = make_tokenizer(write_json(dir, "added.json", norm_file({{"type", "NFKC"}}, {x, added_token(301, "<|eot|>")})));
  EXPECT_EQ(tok->encode("\uFF1Cx\uFF1E"), (Ids{300}));
  EXPECT_EQ(tok->encode("<x><|eot|>"), (Ids{300, 301}));
  EXPECT_EQ(tok->decode(tok->encode("\uFF1C|eot|\uFF1E")), "<|eot|>");
  EXPECT_EQ(tok->encode("\uFF1C|eot|\uFF1E").size(), 7u);  // bytes, not the special token
}

}  // namespace
}  // namespace primus::data
