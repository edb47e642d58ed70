#include "turbo/dispatch/backend_spec.h"

#include <fmt/format.h>

#include <algorithm>
#include <cctype>

#include "core/util/error.h"

namespace primus::turbo {
namespace {
std::string_view trim(std::string_view s) {
  while (!s.empty() && std::isspace(static_cast<unsigned char>(s.front()))) s.remove_prefix(1);
  while (!s.empty() && std::isspace(static_cast<unsigned char>(s.back()))) s.remove_suffix(1);
  return s;
}

// Case-insensitive comparison with a lower-case word.
bool is_word(std::string_view s, std::string_view lower) {
  return s.size() == lower.size() &&
         std::equal(s.begin(), s.end(), lower.begin(),
                    [](char a, char b) { return std::tolower(static_cast<unsigned char>(a)) == b; });
}

BackendChoice parse_choice(std::string_view value, std::string_view entry, std::string_view origin) {
  if (is_word(value, "autotune")) return BackendChoice::autotune();
  if (auto b = parse_backend(value)) return BackendChoice::of(*b);
  throw ConfigError(fmt::format(
      "{}: unknown backend '{}' in entry '{}' (expected CPU, CUBLASLT, CUDNN, TURBO or AUTOTUNE)",
      origin, value, entry));
}
}  // namespace

std::string BackendChoice::str() const {
  return is_autotune() ? std::string("AUTOTUNE") : std::string(backend_name(backend));
}

bool BackendSpec::empty() const {
  return !other && std::none_of(per_precision.begin(), per_precision.end(),
                                [](const auto& c) { return c.has_value(); });
}

BackendSpec parse_backend_spec(std::string_view text, std::string_view origin) {
  BackendSpec spec;
  if (trim(text).empty()) return spec;
  size_t pos = 0;
  while (pos <= text.size()) {
    const size_t comma = text.find(',', pos);
    const std::string_view entry =
        trim(text.substr(pos, comma == std::string_view::npos ? std::string_view::npos : comma - pos));
    pos = comma == std::string_view::npos ? text.size() + 1 : comma + 1;
    if (entry.empty())
      throw ConfigError(fmt::format("{}: empty entry in '{}' (entries are separated by single commas)",
                                    origin, text));
    const size_t colon = entry.find(':');
    if (colon == std::string_view::npos) {
      if (spec.other)
        throw ConfigError(fmt::format("{}: two default entries in '{}' ('{}' and '{}')", origin,
                                      text, spec.other->str(), entry));
      spec.other = parse_choice(entry, entry, origin);
      continue;
    }
    const std::string_view key = trim(entry.substr(0, colon));
    const std::string_view value = trim(entry.substr(colon + 1));
    std::optional<BackendChoice>* slot = nullptr;
    if (is_word(key, "other")) {
      slot = &spec.other;
    } else if (auto p = parse_precision(key)) {
      slot = &spec.per_precision[static_cast<size_t>(*p)];
    } else {
      throw ConfigError(fmt::format(
          "{}: unknown precision '{}' in entry '{}' (expected fp32, fp16, bf16, fp8 or other)",
          origin, key, entry));
    }
    if (slot->has_value())
      throw ConfigError(fmt::format("{}: precision '{}' given twice in '{}'", origin, key, text));
    *slot = parse_choice(value, entry, origin);
  }
  return spec;
}

}  // namespace primus::turbo
