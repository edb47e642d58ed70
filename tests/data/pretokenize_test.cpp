// The hand-written pre-tokenizers against the regexes they stand for. Expected pieces were
// produced by a regex engine with Unicode properties (JavaScript's, with the Llama-3 pattern's
// (?i:...) spelled out), so they check the scanners against the real regex semantics.
#include "data/tokenizer/pretokenize.h"

#include <gtest/gtest.h>

#include <random>

#include "data/tokenizer/unicode.h"
#include "data_test_util.h"

namespace primus::data {
namespace {

std::vector<std::string> split(PreTokenizerKind kind, std::string_view text) {
  std::vector<std::string> out;
  for (size_t pos = 0; pos < text.size();) {
    size_t end = next_piece(kind, text, pos);
    EXPECT_GT(end, pos);
    EXPECT_LE(end, text.size());
    out.emplace_back(text.substr(pos, end - pos));
    pos = end;
  }
  return out;
}

using V = std::vector<std::string>;
struct Case {
  PreTokenizerKind kind;
  std::string text;
  V pieces;
};

TEST(PreTokenize, MatchesTheRegexes) {
  using K = PreTokenizerKind;
  const std::vector<Case> cases = {
      {K::Gpt2, "Hello world", {"Hello", " world"}},
      {K::Gpt2, "I'm HERE'S you'LL", {"I", "'m", " HERE", "'", "S", " you", "'", "LL"}},
      {K::Gpt2, "  leading\n\n\ntrailing   ", {" ", " leading", "\n\n", "\n", "trailing", "   "}},
      {K::Gpt2, "x  \t\n  y", {"x", "  \t\n ", " y"}},
      {K::Gpt2, "(hello) [world]!!\r\n\r\nnext", {"(", "hello", ")", " [", "world", "]!!", "\r\n\r", "\n", "next"}},
      {K::Gpt2, "12345 6789.5", {"12345", " 6789", ".", "5"}},
      {K::Gpt2, "naïve café 中文字 😀 ٣٤٥", {"naïve", " café", " 中文字", " 😀", " ٣٤٥"}},
      {K::Gpt2, "'quoted' 'sup", {"'", "quoted", "'", " '", "sup"}},
      {K::Gpt2, "a\u00a0b\u3000c", {"a", "\u00a0", "b", "\u3000", "c"}},
      {K::Gpt2, "tab\tend\n", {"tab", "\t", "end", "\n"}},
      {K::Llama3, "I'm HERE'S you'LL", {"I", "'m", " HERE", "'S", " you", "'LL"}},
      {K::Llama3, "  leading\n\n\ntrailing   ", {" ", " leading", "\n\n\n", "trailing", "   "}},
      {K::Llama3, "x  \t\n  y", {"x", "  \t\n", " ", " y"}},
      {K::Llama3, "(hello) [world]!!\r\n\r\nnext", {"(hello", ")", " [", "world", "]!!\r\n\r\n", "next"}},
      {K::Llama3, "12345 6789.5", {"123", "45", " ", "678", "9", ".", "5"}},
      {K::Llama3, "naïve café 中文字 😀 ٣٤٥", {"naïve", " café", " 中文字", " 😀", " ", "٣٤٥"}},
      {K::Llama3, "'quoted' 'sup", {"'quoted", "'", " '", "sup"}},
      {K::Llama3, "a\u00a0b\u3000c", {"a", "\u00a0b", "\u3000c"}},
      {K::Llama3, "tab\tend\n", {"tab", "\tend", "\n"}},
      {K::Qwen2, "12345 6789.5", {"1", "2", "3", "4", "5", " ", "6", "7", "8", "9", ".", "5"}},
      {K::Qwen2, "naïve café 中文字 😀 ٣٤٥", {"naïve", " café", " 中文字", " 😀", " ", "٣", "٤", "٥"}},
  };
  for (const auto& c : cases) {
    EXPECT_EQ(split(c.kind, c.text), c.pieces) << pretokenizer_name(c.kind) << ": " << c.text;
  }
}

TEST(PreTokenize, PiecesTileAnyByteString) {
  uint64_t seed = testing::fresh_seed();
  SCOPED_TRACE("seed " + std::to_string(seed));
  std::mt19937_64 rng(seed);
  for (auto kind : {PreTokenizerKind::Gpt2, PreTokenizerKind::Llama3, PreTokenizerKind::Qwen2}) {
    for (int round = 0; round < 200; ++round) {
      std::string s(rng() % 64, '\0');
      for (auto& ch : s) ch = static_cast<char>(rng() % 4 ? "a '1\n\r\t.\xC3\xA9"[rng() % 11] : rng() % 256);
      std::string joined;
      for (auto& p : split(kind, s)) joined += p;
      ASSERT_EQ(joined, s);
    }
  }
}

TEST(Unicode, ClassesAndMalformedInput) {
  using unicode::CharClass;
  EXPECT_EQ(unicode::classify('a'), CharClass::Letter);
  EXPECT_EQ(unicode::classify(0x4E2D), CharClass::Letter);   // 中
  EXPECT_EQ(unicode::classify(0x0663), CharClass::Number);   // Arabic-Indic three
  EXPECT_EQ(unicode::classify(0x2167), CharClass::Number);   // Roman numeral eight (Nl)
  EXPECT_EQ(unicode::classify(0x00BD), CharClass::Number);   // ½ (No)
  EXPECT_EQ(unicode::classify(0x1D518), CharClass::Letter);  // mathematical fraktur U
  EXPECT_EQ(unicode::classify(0x3000), CharClass::Space);
  EXPECT_EQ(unicode::classify(0x0085), CharClass::Space);
  EXPECT_EQ(unicode::classify(0x200B), CharClass::Other);  // zero-width space is not White_Space
  EXPECT_EQ(unicode::classify(0x1F600), CharClass::Other);
  EXPECT_EQ(unicode::classify(0x0301), CharClass::Other);  // combining accent: Mn
  int len = 0;
  const char overlong[] = "\xC0\xAF";
  EXPECT_EQ(unicode::decode_utf8(overlong, overlong + 2, &len), UINT32_MAX);
  EXPECT_EQ(len, 1);
  const char surrogate[] = "\xED\xA0\x80";
  EXPECT_EQ(unicode::decode_utf8(surrogate, surrogate + 3, &len), UINT32_MAX);
  const char emoji[] = "\xF0\x9F\x98\x80";
  EXPECT_EQ(unicode::decode_utf8(emoji, emoji + 4, &len), 0x1F600u);
  EXPECT_EQ(len, 4);
  EXPECT_EQ(unicode::decode_utf8(emoji, emoji + 3, &len), UINT32_MAX);  // truncated
}

}  // namespace
}  // namespace primus::data
