// What a user asks for: one backend, or "autotune", optionally per precision class.
// Text form (environment variables PRIMUS_TURBO_<OP>_BACKEND):
//   TURBO                          every precision uses TURBO
//   AUTOTUNE                       time every capable backend once per shape key, keep the fastest
//   fp8:TURBO,other:CUBLASLT       per precision (fp32, fp16, bf16, fp8); `other` or a bare
//                                  entry covers the precisions not named
// Names are case-insensitive; spaces around entries are ignored.
#pragma once
#include <array>
#include <optional>
#include <string>
#include <string_view>

#include "turbo/dispatch/backend_type.h"

namespace primus::turbo {

struct BackendChoice {
  enum class Kind : uint8_t { Backend, Autotune };
  Kind kind = Kind::Backend;
  BackendType backend = BackendType::TURBO;  // meaningful when kind == Backend

  static BackendChoice of(BackendType b) { return {Kind::Backend, b}; }
  static BackendChoice autotune() { return {Kind::Autotune, BackendType::TURBO}; }
  bool is_autotune() const { return kind == Kind::Autotune; }
  bool operator==(const BackendChoice& o) const {
    return kind == o.kind && (kind == Kind::Autotune || backend == o.backend);
  }
  std::string str() const;  // "CUBLASLT" or "AUTOTUNE"
};

struct BackendSpec {
  std::array<std::optional<BackendChoice>, 4> per_precision{};  // indexed by Precision
  std::optional<BackendChoice> other;                            // bare entry or `other:`

  std::optional<BackendChoice> lookup(Precision p) const {
    const auto& c = per_precision[static_cast<size_t>(p)];
    return c ? c : other;
  }
  bool empty() const;
};

// Parses the text form above. `origin` names where the text came from (an environment
// variable) for error messages. Throws primus::ConfigError naming origin, the bad entry and the
// accepted values for: an unknown backend or precision, an empty entry, a precision given
// twice. Empty text gives an empty spec.
BackendSpec parse_backend_spec(std::string_view text, std::string_view origin);

}  // namespace primus::turbo
