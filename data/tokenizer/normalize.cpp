#include "data/tokenizer/normalize.h"

#include <utf8proc.h>

#include <cstdlib>
#include <memory>

#include "core/util/error.h"

namespace primus::data {
namespace {

utf8proc_option_t options_of(NormalizerStep::Kind kind) {
  switch (kind) {
    case NormalizerStep::Kind::NFC:
      return static_cast<utf8proc_option_t>(UTF8PROC_STABLE | UTF8PROC_COMPOSE);
    case NormalizerStep::Kind::NFD:
      return static_cast<utf8proc_option_t>(UTF8PROC_STABLE | UTF8PROC_DECOMPOSE);
    case NormalizerStep::Kind::NFKC:
      return static_cast<utf8proc_option_t>(UTF8PROC_STABLE | UTF8PROC_COMPOSE | UTF8PROC_COMPAT);
    case NormalizerStep::Kind::NFKD:
      return static_cast<utf8proc_option_t>(UTF8PROC_STABLE | UTF8PROC_DECOMPOSE | UTF8PROC_COMPAT);
    case NormalizerStep::Kind::Replace:
    case NormalizerStep::Kind::Prepend:
      break;
  }
  return static_cast<utf8proc_option_t>(0);
}

// Appends the normalization of `run`, which is valid UTF-8, to `out`.
void append_form(std::string_view run, utf8proc_option_t options, std::string& out) {
  if (run.empty()) return;
  utf8proc_uint8_t* result = nullptr;
  utf8proc_ssize_t n = utf8proc_map(reinterpret_cast<const utf8proc_uint8_t*>(run.data()),
                                    static_cast<utf8proc_ssize_t>(run.size()), &result, options);
  std::unique_ptr<utf8proc_uint8_t, decltype(&std::free)> owned(result, &std::free);
  if (n < 0) {
    throw RuntimeError(std::string("Unicode normalization failed: ") + utf8proc_errmsg(n));
  }
  out.append(reinterpret_cast<const char*>(result), static_cast<size_t>(n));
}

// One Unicode normalization form over text that may hold malformed UTF-8: the valid runs are
// normalized, each malformed byte is kept as it is.
void append_form_lenient(std::string_view text, utf8proc_option_t options, std::string& out) {
  size_t run_start = 0, pos = 0;
  while (pos < text.size()) {
    if (static_cast<unsigned char>(text[pos]) < 0x80) {
      ++pos;
      continue;
    }
    utf8proc_int32_t cp;
    utf8proc_ssize_t len = utf8proc_iterate(reinterpret_cast<const utf8proc_uint8_t*>(text.data() + pos),
                                            static_cast<utf8proc_ssize_t>(text.size() - pos), &cp);
    if (len > 0) {
      pos += static_cast<size_t>(len);
      continue;
    }
    append_form(text.substr(run_start, pos - run_start), options, out);
    out += text[pos];
    run_start = ++pos;
  }
  append_form(text.substr(run_start), options, out);
}

// The text is cut before ASCII characters and only the pieces holding non-ASCII bytes go through
// utf8proc. The cut is exact for all four forms: an ASCII character has combining class 0, no
// decomposition and is never the second character of a composition, so nothing before it
// reorders or composes with anything after it. The ASCII character right before a non-ASCII
// stretch stays with it (it may be the base of following combining marks: "e" + U+0301).
std::string apply_form(std::string_view text, utf8proc_option_t options) {
  std::string out;
  size_t pos = 0;  // text[0, pos) is done
  while (pos < text.size()) {
    size_t i = pos;
    while (i < text.size() && static_cast<unsigned char>(text[i]) < 0x80) ++i;
    if (i == text.size()) break;
    if (pos == 0) out.reserve(text.size() + text.size() / 8);
    const size_t start = i > pos ? i - 1 : i;
    size_t end = i;
    while (end < text.size() && static_cast<unsigned char>(text[end]) >= 0x80) ++end;
    out.append(text.substr(pos, start - pos));
    append_form_lenient(text.substr(start, end - start), options, out);
    pos = end;
  }
  if (pos == 0) return std::string(text);  // all ASCII
  out.append(text.substr(pos));
  return out;
}

std::string replace_all(std::string_view text, const std::string& pattern, const std::string& content) {
  std::string out;
  size_t start = 0;
  for (size_t at; (at = text.find(pattern, start)) != std::string_view::npos; start = at + pattern.size()) {
    out.append(text.substr(start, at - start));
    out += content;
  }
  out.append(text.substr(start));
  return out;
}

}  // namespace

const char* normalizer_kind_name(NormalizerStep::Kind kind) {
  switch (kind) {
    case NormalizerStep::Kind::NFC:
      return "NFC";
    case NormalizerStep::Kind::NFD:
      return "NFD";
    case NormalizerStep::Kind::NFKC:
      return "NFKC";
    case NormalizerStep::Kind::NFKD:
      return "NFKD";
    case NormalizerStep::Kind::Replace:
      return "Replace";
    case NormalizerStep::Kind::Prepend:
      return "Prepend";
  }
  return "?";
}

std::string Normalizer::apply(std::string_view text) const {
  std::string s(text);
  for (const auto& step : steps) {
    if (step.kind == NormalizerStep::Kind::Replace) {
      s = replace_all(s, step.pattern, step.content);
    } else if (step.kind == NormalizerStep::Kind::Prepend) {
      if (!s.empty()) s.insert(0, step.content);  // tokenizers prepends to non-empty text only
    } else {
      s = apply_form(s, options_of(step.kind));
    }
  }
  return s;
}

std::string Normalizer::describe() const {
  if (steps.empty()) return "none";
  if (steps.size() == 1) return normalizer_kind_name(steps[0].kind);
  std::string s = "Sequence[";
  for (size_t i = 0; i < steps.size(); ++i) {
    s += (i ? ", " : "");
    s += normalizer_kind_name(steps[i].kind);
  }
  return s + "]";
}

}  // namespace primus::data
