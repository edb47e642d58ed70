// Turbo's experiment switches in the environment (PRIMUS_TURBO_*: kernel variants and search
// sizes for A/B runs; docs/environment.md lists them). A value outside the accepted ones stops
// the run with an error that names the variable, its value and what it accepts: a typo must not
// silently time the default.
#pragma once
#include <initializer_list>
#include <string>
#include <string_view>

namespace primus::turbo {

// The value of environment variable `name` when it is one of `choices` (compared exactly);
// `fallback` when it is unset or empty. Anything else throws primus::RuntimeError.
std::string env_choice(const char* name, std::initializer_list<std::string_view> choices, std::string_view fallback);

// The value of `name` as a whole number in [lo, hi]; `fallback` when unset or empty. Anything
// else (not a number, trailing characters, out of range) throws primus::RuntimeError.
long env_int(const char* name, long lo, long hi, long fallback);

}  // namespace primus::turbo
