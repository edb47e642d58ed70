// Another project's switch between its fused kernel (or its operator library) and another path,
// where the cuda backend has one of the two: accepted at the value that describes the backend, so
// a config written for that project carries over unchanged, and the other value refused by name
// rather than silently ignored. Megatron-LM's fusion switches (adapter.cpp) and Primus-Turbo's
// (turbo_keys.cpp) are tables of these.
#pragma once
#include <fmt/format.h>

#include <span>

#include "core/config/schema.h"
#include "core/config/value.h"
#include "core/util/error.h"

namespace primus::backends::cuda {

struct FixedSwitch {
  const char* key;
  bool value;         // the one the cuda backend implements (its default)
  const char* what;   // what the backend does, for the key's description
  const char* other;  // why the other value is not there
};

// `project` names whose switches they are in the descriptions ("Megatron-LM", "Primus-Turbo").
inline void add_fixed_switches(config::Schema& s, std::span<const FixedSwitch> switches, const char* project) {
  for (const FixedSwitch& m : switches)
    s.flag(m.key, m.value,
           fmt::format("{}'s switch, accepted as {}: {}; {} is refused ({})", project, m.value, m.what, !m.value,
                       m.other));
}

// ConfigError naming the key's origin for a switch set to the value the backend does not have.
inline void check_fixed_switches(const config::Value& p, std::span<const FixedSwitch> switches) {
  for (const FixedSwitch& m : switches)
    if (const config::Value& v = *p.find_path(m.key); v.as_bool() != m.value)
      throw ConfigError(fmt::format("{}: {}: {} is not implemented ({}); remove the key or set it {}: {}",
                                    v.origin().str(), m.key, !m.value, m.other, m.value, m.what));
}

}  // namespace primus::backends::cuda
