#include "data/tokenizer/pretokenize.h"

#include "data/tokenizer/unicode.h"

namespace primus::data {
namespace {

using unicode::CharClass;

// A cursor over the text that classifies one character at a time.
struct Scan {
  const char* s;
  size_t n;

  unicode::Char at(size_t i) const { return unicode::char_at(s + i, s + n); }
  bool is(size_t i, CharClass c) const { return i < n && at(i).cls == c; }
  // End of the run of characters of class `c` starting at i.
  size_t run(size_t i, CharClass c) const {
    while (i < n) {
      auto ch = at(i);
      if (ch.cls != c) break;
      i += ch.len;
    }
    return i;
  }
  bool crlf(size_t i) const { return i < n && (s[i] == '\r' || s[i] == '\n'); }
};

char lower(char c) { return (c >= 'A' && c <= 'Z') ? static_cast<char>(c + 32) : c; }

// 's 't 're 've 'm 'll 'd at i (text[i] == '\''); returns the end, or 0 when none matches.
size_t contraction(const Scan& sc, size_t i, bool ignore_case) {
  auto c = [&](size_t k) -> char {
    if (i + k >= sc.n) return 0;
    return ignore_case ? lower(sc.s[i + k]) : sc.s[i + k];
  };
  char a = c(1), b = c(2);
  if (a == 's' || a == 't' || a == 'm' || a == 'd') return i + 2;
  if ((a == 'r' && b == 'e') || (a == 'v' && b == 'e') || (a == 'l' && b == 'l')) return i + 3;
  return 0;
}

// Whitespace run at i: `\s+(?!\S)` gives back the run's last character when a non-space
// follows (so that " word" keeps its space), unless the run is that one character (`\s+`).
size_t whitespace_tail(const Scan& sc, size_t i) {
  size_t last = i, j = i;
  while (j < sc.n) {
    auto ch = sc.at(j);
    if (ch.cls != CharClass::Space) break;
    last = j;
    j += ch.len;
  }
  if (j == sc.n || last == i) return j;
  return last;
}

size_t next_gpt2(const Scan& sc, size_t i) {
  if (sc.s[i] == '\'') {
    if (size_t e = contraction(sc, i, false)) return e;
  }
  auto c = sc.at(i);
  if (c.cls == CharClass::Letter || c.cls == CharClass::Number || c.cls == CharClass::Other) {
    return sc.run(i, c.cls);  // \p{L}+ | \p{N}+ | [^\s\p{L}\p{N}]+
  }
  if (sc.s[i] == ' ' && i + 1 < sc.n) {  // ' ?' followed by a letter, number or other run
    auto d = sc.at(i + 1);
    if (d.cls != CharClass::Space) return sc.run(i + 1, d.cls);
  }
  return whitespace_tail(sc, i);
}

size_t next_llama3(const Scan& sc, size_t i, size_t max_digits) {
  if (sc.s[i] == '\'') {
    if (size_t e = contraction(sc, i, true)) return e;
  }
  auto c = sc.at(i);
  if (c.cls == CharClass::Letter) return sc.run(i, CharClass::Letter);
  // [^\r\n\p{L}\p{N}]?\p{L}+ : one non-letter, non-number, non-newline before a letter run.
  if (c.cls != CharClass::Number && !sc.crlf(i) && sc.is(i + c.len, CharClass::Letter)) {
    return sc.run(i + c.len, CharClass::Letter);
  }
  if (c.cls == CharClass::Number) {  // \p{N}{1,max}
    size_t j = i;
    for (size_t k = 0; k < max_digits && sc.is(j, CharClass::Number); ++k) j += sc.at(j).len;
    return j;
  }
  // ` ?[^\s\p{L}\p{N}]+[\r\n]*`
  size_t other = c.cls == CharClass::Other ? i
                 : (sc.s[i] == ' ' && sc.is(i + 1, CharClass::Other)) ? i + 1
                                                                      : sc.n;
  if (other < sc.n) {
    size_t j = sc.run(other, CharClass::Other);
    while (sc.crlf(j)) ++j;
    return j;
  }
  // `\s*[\r\n]+`: the whitespace run up to and including its last \r or \n.
  size_t j = i, after_newline = 0;
  while (j < sc.n) {
    auto ch = sc.at(j);
    if (ch.cls != CharClass::Space) break;
    if (sc.crlf(j)) after_newline = j + 1;
    j += ch.len;
  }
  if (after_newline) return after_newline;
  return whitespace_tail(sc, i);
}

}  // namespace

size_t next_piece(PreTokenizerKind kind, std::string_view text, size_t pos) {
  Scan sc{text.data(), text.size()};
  switch (kind) {
    case PreTokenizerKind::Gpt2:
      return next_gpt2(sc, pos);
    case PreTokenizerKind::Llama3:
      return next_llama3(sc, pos, 3);
    case PreTokenizerKind::Qwen2:
      return next_llama3(sc, pos, 1);
  }
  return text.size();
}

std::string_view pretokenizer_regex(PreTokenizerKind kind) {
  switch (kind) {
    case PreTokenizerKind::Gpt2:
      return R"('s|'t|'re|'ve|'m|'ll|'d| ?\p{L}+| ?\p{N}+| ?[^\s\p{L}\p{N}]+|\s+(?!\S)|\s+)";
    case PreTokenizerKind::Llama3:
      return R"((?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}{1,3}| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+)";
    case PreTokenizerKind::Qwen2:
      return R"((?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+)";
  }
  return {};
}

const char* pretokenizer_name(PreTokenizerKind kind) {
  switch (kind) {
    case PreTokenizerKind::Gpt2:
      return "gpt2";
    case PreTokenizerKind::Llama3:
      return "llama3";
    case PreTokenizerKind::Qwen2:
      return "qwen2";
  }
  return "?";
}

}  // namespace primus::data
