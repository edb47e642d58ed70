// GlobalBackendManager: the process-wide record of what the user asked for, per op and
// precision. Dispatchers (dispatcher.h) consult it on every call; the order, high to low, is
//   1. code setter        set_backend("gemm", BackendType::CUBLASLT [, Precision::BF16])
//   2. environment        PRIMUS_TURBO_<OP>_BACKEND=TURBO | AUTOTUNE | fp8:TURBO,other:CUBLASLT
//   3. global autotune    set_auto_tune(true) or PRIMUS_TURBO_AUTO_TUNE=1
//   4. the op's default backend, 5. fallback (decided by the dispatcher).
// The environment is read on each query (it is cheap and lets tests and launchers change it)
// and parsed again only when the text changes. Thread-safe.
#pragma once
#include <functional>
#include <map>
#include <mutex>
#include <optional>
#include <set>
#include <string>
#include <utility>

#include "turbo/dispatch/backend_spec.h"

namespace primus::turbo {

// The user's choice for a call, with where it came from ("set_backend", or the variable name).
struct UserChoice {
  BackendChoice choice;
  std::string source;
};

class GlobalBackendManager {
 public:
  static GlobalBackendManager& instance();

  // Code setters (priority 1). `precision` nullopt: every precision of the op.
  void set_backend(const std::string& op, BackendChoice choice,
                   std::optional<Precision> precision = std::nullopt);
  void set_backend(const std::string& op, BackendType b,
                   std::optional<Precision> precision = std::nullopt) {
    set_backend(op, BackendChoice::of(b), precision);
  }
  void clear_backend(const std::string& op);  // removes the op's code setters
  // Global autotune switch (priority 3); nullopt returns control to PRIMUS_TURBO_AUTO_TUNE.
  void set_auto_tune(std::optional<bool> on);

  // Clears every code setter, the autotune switch, the autotune caches of all dispatchers and
  // the memory of warnings already given.
  void reset();

  // Priority 1 then 2 for (op, precision); nullopt when the user said nothing.
  // Throws primus::ConfigError when the environment variable is malformed.
  std::optional<UserChoice> user_choice(const std::string& op, Precision p);
  // Priority 3: the code switch, else PRIMUS_TURBO_AUTO_TUNE (1/0, true/false, on/off;
  // anything else is a ConfigError).
  bool auto_tune_enabled();

  // CUDA-graph capture in progress (autotune then must not time kernels: nothing would run).
  // The trainer brackets its capture with a CaptureScope; dispatchers may also probe streams.
  bool capturing() const;
  class CaptureScope {
   public:
    CaptureScope();
    ~CaptureScope();
    CaptureScope(const CaptureScope&) = delete;
    CaptureScope& operator=(const CaptureScope&) = delete;
  };

  // Emits `message` through the warning sink the first time `key` is seen (until reset()).
  void warn_once(const std::string& key, const std::string& message);
  // Where warnings go; default spdlog::warn. Tests install a recorder.
  void set_warning_sink(std::function<void(const std::string&)> sink);

  // Dispatchers register a hook that clears their autotune cache on reset().
  int add_reset_hook(std::function<void()> hook);
  void remove_reset_hook(int id);

  static std::string env_var_for(const std::string& op);  // "gemm" -> PRIMUS_TURBO_GEMM_BACKEND

 private:
  GlobalBackendManager() = default;
  struct EnvCache {
    std::string text;
    BackendSpec spec;
  };

  mutable std::mutex mu_;
  std::map<std::string, BackendSpec> code_;  // op -> choices from set_backend
  std::optional<bool> auto_tune_;
  std::map<std::string, EnvCache> env_cache_;  // op -> last parsed environment text
  std::set<std::string> warned_;
  std::function<void(const std::string&)> sink_;
  std::map<int, std::function<void()>> reset_hooks_;
  int next_hook_ = 0;
  int capture_depth_ = 0;
};

}  // namespace primus::turbo
