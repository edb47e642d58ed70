// The few Unicode facts the byte-level pre-tokenizers need: UTF-8 decoding that never fails
// (an invalid byte is a one-byte character of class Other, so encode/decode round-trips any
// byte string), and the classes \p{L}, \p{N}, \s of the GPT-2 and Llama-3 regexes.
// \p{L} and \p{N} are the general categories L* and N* (table generated from Unicode data,
// unicode_tables.inc); \s is the White_Space property, as in the regex engines HF uses.
#pragma once
#include <array>
#include <cstddef>
#include <cstdint>

namespace primus::data::unicode {

enum class CharClass : uint8_t { Other = 0, Letter = 1, Number = 2, Space = 3 };

// Class of a code point (any value; above 0x10FFFF is Other).
CharClass classify(uint32_t cp);

// One character at p (p < end): its class and its length in bytes (1..4). Malformed or
// truncated UTF-8 yields {Other, 1}, consuming one byte.
struct Char {
  CharClass cls;
  uint8_t len;
};

namespace detail {
extern const std::array<CharClass, 128> kAsciiClass;
Char decode_non_ascii(const unsigned char* p, const unsigned char* end);
}  // namespace detail

inline Char char_at(const char* p, const char* end) {
  auto b = static_cast<unsigned char>(*p);
  if (b < 0x80) return {detail::kAsciiClass[b], 1};
  return detail::decode_non_ascii(reinterpret_cast<const unsigned char*>(p),
                                  reinterpret_cast<const unsigned char*>(end));
}

// Decodes one well-formed UTF-8 sequence at p; returns its code point and sets *len, or
// returns UINT32_MAX with *len = 1 for a malformed byte. Exposed for tests and tools.
uint32_t decode_utf8(const char* p, const char* end, int* len);

}  // namespace primus::data::unicode
