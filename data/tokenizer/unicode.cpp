#include "data/tokenizer/unicode.h"

#include <algorithm>
#include <array>
#include <memory>

namespace primus::data::unicode {
namespace {

struct CodeRange {
  uint32_t lo, hi;
};

#include "data/tokenizer/unicode_tables.inc"

// Unicode's White_Space property (PropList.txt); stable since Unicode 6.3.
constexpr bool is_white_space(uint32_t cp) {
  return (cp >= 0x09 && cp <= 0x0D) || cp == 0x20 || cp == 0x85 || cp == 0xA0 || cp == 0x1680 ||
         (cp >= 0x2000 && cp <= 0x200A) || cp == 0x2028 || cp == 0x2029 || cp == 0x202F ||
         cp == 0x205F || cp == 0x3000;
}

template <size_t N>
constexpr bool in_ranges(const CodeRange (&table)[N], uint32_t cp) {
  auto it = std::upper_bound(std::begin(table), std::end(table), cp,
                             [](uint32_t v, const CodeRange& r) { return v < r.lo; });
  return it != std::begin(table) && cp <= (it - 1)->hi;
}

constexpr CharClass classify_slow(uint32_t cp) {
  if (in_ranges(kLetterRanges, cp)) return CharClass::Letter;
  if (in_ranges(kNumberRanges, cp)) return CharClass::Number;
  if (is_white_space(cp)) return CharClass::Space;
  return CharClass::Other;
}

// The Basic Multilingual Plane holds nearly all text; one byte per code point keeps its
// classification a load instead of two binary searches. Built once, on first use.
const std::array<CharClass, 0x10000>& bmp_table() {
  static const auto table = [] {
    auto t = std::make_unique<std::array<CharClass, 0x10000>>();
    for (uint32_t cp = 0; cp < 0x10000; ++cp) (*t)[cp] = classify_slow(cp);
    return t;
  }();
  return *table;
}

}  // namespace

namespace detail {
// constexpr so that it is ready before any static initializer could tokenize.
constexpr std::array<CharClass, 128> kAsciiClass = [] {
  std::array<CharClass, 128> t{};
  for (uint32_t c = 0; c < 128; ++c) t[c] = classify_slow(c);
  return t;
}();
}  // namespace detail

CharClass classify(uint32_t cp) {
  if (cp < 0x10000) return bmp_table()[cp];
  if (cp > 0x10FFFF) return CharClass::Other;
  return classify_slow(cp);
}

uint32_t decode_utf8(const char* p, const char* end, int* len) {
  auto* s = reinterpret_cast<const unsigned char*>(p);
  auto avail = static_cast<ptrdiff_t>(end - p);
  unsigned char b0 = s[0];
  *len = 1;
  if (b0 < 0x80) return b0;
  int n;
  uint32_t cp, min;
  if (b0 >= 0xC2 && b0 <= 0xDF) {
    n = 2, cp = b0 & 0x1F, min = 0x80;
  } else if (b0 >= 0xE0 && b0 <= 0xEF) {
    n = 3, cp = b0 & 0x0F, min = 0x800;
  } else if (b0 >= 0xF0 && b0 <= 0xF4) {
    n = 4, cp = b0 & 0x07, min = 0x10000;
  } else {
    return UINT32_MAX;
  }
  if (avail < n) return UINT32_MAX;
  for (int i = 1; i < n; ++i) {
    if ((s[i] & 0xC0) != 0x80) return UINT32_MAX;
    cp = (cp << 6) | (s[i] & 0x3F);
  }
  // Overlong forms, UTF-16 surrogates and values past U+10FFFF are not well-formed UTF-8.
  if (cp < min || cp > 0x10FFFF || (cp >= 0xD800 && cp <= 0xDFFF)) return UINT32_MAX;
  *len = n;
  return cp;
}

namespace detail {
Char decode_non_ascii(const unsigned char* p, const unsigned char* end) {
  int len = 1;
  uint32_t cp = decode_utf8(reinterpret_cast<const char*>(p), reinterpret_cast<const char*>(end),
                            &len);
  if (cp == UINT32_MAX) return {CharClass::Other, 1};
  return {classify(cp), static_cast<uint8_t>(len)};
}
}  // namespace detail

}  // namespace primus::data::unicode
