#include "turbo/core/env_switch.h"

#include <fmt/format.h>

#include <cerrno>
#include <cstdlib>

#include "core/util/error.h"

namespace primus::turbo {

std::string env_choice(const char* name, std::initializer_list<std::string_view> choices, std::string_view fallback) {
  const char* e = std::getenv(name);
  if (!e || !*e) return std::string(fallback);
  for (std::string_view c : choices)
    if (c == e) return std::string(c);
  std::string accepted;
  for (std::string_view c : choices) accepted += fmt::format("{}{}", accepted.empty() ? "" : ", ", c);
  throw RuntimeError(fmt::format("{}='{}': expected one of {} (or unset: {})", name, e, accepted, fallback));
}

long env_int(const char* name, long lo, long hi, long fallback) {
  const char* e = std::getenv(name);
  if (!e || !*e) return fallback;
  char* end = nullptr;
  errno = 0;
  const long v = std::strtol(e, &end, 10);
  if (errno != 0 || end == e || *end != '\0' || v < lo || v > hi)
    throw RuntimeError(fmt::format("{}='{}': expected a whole number in {}..{} (or unset: {})", name, e, lo, hi, fallback));
  return v;
}

}  // namespace primus::turbo
