// Normalizer::apply cuts the text before ASCII characters and sends only the non-ASCII pieces
// to utf8proc; that must equal utf8proc run over the whole text, for every form, on random
// strings built from characters that reorder, compose or decompose across their neighbours
// (combining marks of several classes, Hangul jamo and syllables, Indic two-part vowels,
// singletons, composition exclusions, compatibility characters) next to ASCII bases.
#include <gtest/gtest.h>
#include <utf8proc.h>

#include <cstdlib>
#include <random>
#include <string>

#include "data/tokenizer/normalize.h"
#include "data_test_util.h"

namespace primus::data {
namespace {

std::string whole_text_form(const std::string& s, utf8proc_option_t options) {
  utf8proc_uint8_t* out = nullptr;
  utf8proc_ssize_t n = utf8proc_map(reinterpret_cast<const utf8proc_uint8_t*>(s.data()),
                                    static_cast<utf8proc_ssize_t>(s.size()), &out, options);
  EXPECT_GE(n, 0) << utf8proc_errmsg(n);
  std::string r(reinterpret_cast<const char*>(out), n < 0 ? 0 : static_cast<size_t>(n));
  std::free(out);
  return r;
}

TEST(Normalizer, PiecewiseEqualsWholeTextForEveryForm) {
  const char* atoms[] = {
      "a", "e", "o", "A", "C", "s", "K", " ", "\n", ".", "<", "1",    // ASCII bases and separators
      "\u0301", "\u0323", "\u0302", "\u0308", "\u0327", "\u0307",       // marks of classes 230 / 220 / 202
      "\u0344", "\u0F73", "\u0F71", "\u0F72",                           // non-starter decompositions
      "\u093C", "\u0915", "\u0958",                                     // nukta, composition exclusion
      "\u0B47", "\u0B3E", "\u0B4B",                                     // Oriya two-part vowel (second of class 0)
      "\u1100", "\u1161", "\u11AB", "\uAC00", "\uD55C",                 // Hangul L, V, T, LV, LVT
      "\u30AB", "\u3099", "\u309A", "\u30AC",                           // kana + voiced marks
      "\u212B", "\u2126", "\u212A", "\u037E", "\u1FEF",                 // singletons (two map to ASCII)
      "\uFB01", "\u2460", "\uFF21", "\u00B2", "\u01C6", "\u00BD",       // compatibility characters
      "\u00E9", "\u1E69", "\u00C5", "\u1ED9", "\u4E2D", "\U0001F600"};  // composites, CJK, emoji
  const NormalizerStep::Kind kinds[] = {NormalizerStep::Kind::NFC, NormalizerStep::Kind::NFD,
                                        NormalizerStep::Kind::NFKC, NormalizerStep::Kind::NFKD};
  const utf8proc_option_t options[] = {
      static_cast<utf8proc_option_t>(UTF8PROC_STABLE | UTF8PROC_COMPOSE),
      static_cast<utf8proc_option_t>(UTF8PROC_STABLE | UTF8PROC_DECOMPOSE),
      static_cast<utf8proc_option_t>(UTF8PROC_STABLE | UTF8PROC_COMPOSE | UTF8PROC_COMPAT),
      static_cast<utf8proc_option_t>(UTF8PROC_STABLE | UTF8PROC_DECOMPOSE | UTF8PROC_COMPAT)};
  std::mt19937_64 rng(testing::fresh_seed());
  for (int trial = 0; trial < 2000; ++trial) {
    std::string s;
    for (int n = static_cast<int>(rng() % 14); n > 0; --n) s += atoms[rng() % std::size(atoms)];
    for (int k = 0; k < 4; ++k) {
      Normalizer norm{{{kinds[k], {}, {}}}};
      ASSERT_EQ(norm.apply(s), whole_text_form(s, options[k])) << normalizer_kind_name(kinds[k]) << " of " << s;
    }
  }
  // Pure ASCII comes back as it is.
  EXPECT_EQ((Normalizer{{{NormalizerStep::Kind::NFKC, {}, {}}}}).apply("plain text\n"), "plain text\n");
}

}  // namespace
}  // namespace primus::data
