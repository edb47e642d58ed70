// What a patch sees: the config (every key a condition reads is recorded, so the engine knows
// which keys enable each patch), the backend's typed args (from build_args on), and the
// backend's HookTable (every replace/wrap is recorded against the running patch).
#pragma once
#include <memory>
#include <string>
#include <vector>

#include "core/backend/backend.h"
#include "core/config/value.h"
#include "core/patches/hook_table.h"
#include "core/patches/patch.h"

namespace primus::patches {

class PatchContext {
 public:
  PatchContext(const config::Value& params, std::string backend, std::string version,
               HookTable* hooks = nullptr);

  const std::string& backend() const { return backend_; }
  const std::string& backend_version() const { return version_; }
  Phase phase() const { return phase_; }

  // Config reads, recorded. `get` returns null when no layer set the key.
  const config::Value* get(const std::string& key);
  bool flag(const std::string& key, bool def = false);
  int64_t integer(const std::string& key, int64_t def = 0);
  double number(const std::string& key, double def = 0);
  std::string text(const std::string& key, const std::string& def = "");
  // Keys read since the last reset, as "key=value" (or "key=<unset>").
  const std::vector<std::string>& keys_read() const { return keys_read_; }

  // Backend args: available from the build_args phase on.
  BackendArgs& args();
  template <class T>
  T& args_as() {
    auto* t = dynamic_cast<T*>(&args());
    if (!t) throw RuntimeError("patch " + patch_ + ": backend args have another type");
    return *t;
  }

  // Hook slots, changed on behalf of the running patch.
  template <class Sig>
  void replace(const std::string& slot, std::function<Sig> fn) {
    check_slot(slot);
    hooks_->replace<Sig>(slot, std::move(fn), patch_);
  }
  template <class Sig>
  void wrap(const std::string& slot,
            const std::function<std::function<Sig>(std::function<Sig>)>& wrapper) {
    check_slot(slot);
    hooks_->wrap<Sig>(slot, wrapper, patch_);
  }
  HookTable* hooks() { return hooks_; }

  // Environment changes go through here so runs log them.
  void set_env(const std::string& name, const std::string& value);
  const std::vector<std::string>& env_changes() const { return env_changes_; }

  // Engine side.
  void begin_patch(const Patch& p, Phase phase);
  void set_phase(Phase p) { phase_ = p; }
  void set_args(std::shared_ptr<BackendArgs> a) { args_ = std::move(a); }
  void reset_reads() { keys_read_.clear(); }
  const config::Value& params() const { return params_; }

 private:
  void check_slot(const std::string& slot);
  const config::Value& params_;
  std::string backend_, version_;
  HookTable* hooks_;
  std::shared_ptr<BackendArgs> args_;
  Phase phase_ = Phase::Setup;
  std::string patch_;
  std::vector<std::string> declared_slots_;
  std::vector<std::string> keys_read_;
  std::vector<std::string> env_changes_;
};

}  // namespace primus::patches
