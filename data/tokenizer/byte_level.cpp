#include "data/tokenizer/byte_level.h"

#include <array>

#include "data/tokenizer/unicode.h"

namespace primus::data::byte_level {
namespace {

bool printable(int b) { return (b >= 0x21 && b <= 0x7E) || (b >= 0xA1 && b <= 0xAC) || b >= 0xAE; }

struct Tables {
  std::array<uint32_t, 256> to_cp{};
  std::array<int16_t, 324> to_byte{};  // the alphabet lies in [0, 0x100 + 68)
};

const Tables& tables() {
  static const Tables t = [] {
    Tables x;
    x.to_byte.fill(-1);
    uint32_t next = 0x100;
    for (int b = 0; b < 256; ++b) {
      x.to_cp[b] = printable(b) ? static_cast<uint32_t>(b) : next++;
      x.to_byte[x.to_cp[b]] = static_cast<int16_t>(b);
    }
    return x;
  }();
  return t;
}

void append_utf8(std::string& s, uint32_t cp) {
  if (cp < 0x80) {
    s += static_cast<char>(cp);
  } else if (cp < 0x800) {
    s += static_cast<char>(0xC0 | (cp >> 6));
    s += static_cast<char>(0x80 | (cp & 0x3F));
  } else {
    s += static_cast<char>(0xE0 | (cp >> 12));
    s += static_cast<char>(0x80 | ((cp >> 6) & 0x3F));
    s += static_cast<char>(0x80 | (cp & 0x3F));
  }
}

}  // namespace

uint32_t byte_to_codepoint(uint8_t b) { return tables().to_cp[b]; }

int codepoint_to_byte(uint32_t cp) {
  return cp < tables().to_byte.size() ? tables().to_byte[cp] : -1;
}

bool decode_token(std::string_view token, std::string* out) {
  out->clear();
  const char* p = token.data();
  const char* end = p + token.size();
  while (p < end) {
    int len = 1;
    uint32_t cp = unicode::decode_utf8(p, end, &len);
    int b = cp == UINT32_MAX ? -1 : codepoint_to_byte(cp);
    if (b < 0) return false;
    *out += static_cast<char>(b);
    p += len;
  }
  return true;
}

std::string encode_token(std::string_view bytes) {
  std::string s;
  for (unsigned char b : bytes) append_utf8(s, byte_to_codepoint(b));
  return s;
}

}  // namespace primus::data::byte_level
