#include "core/patches/context.h"

#include <cstdlib>

namespace primus::patches {

const char* phase_name(Phase p) {
  switch (p) {
    case Phase::Setup: return "setup";
    case Phase::BuildArgs: return "build_args";
    case Phase::BeforeTrain: return "before_train";
    case Phase::AfterTrain: return "after_train";
  }
  return "?";
}

const std::vector<Phase>& all_phases() {
  static const std::vector<Phase> p = {Phase::Setup, Phase::BuildArgs, Phase::BeforeTrain,
                                       Phase::AfterTrain};
  return p;
}

PatchContext::PatchContext(const config::Value& params, std::string backend, std::string version,
                           HookTable* hooks)
    : params_(params), backend_(std::move(backend)), version_(std::move(version)), hooks_(hooks) {}

const config::Value* PatchContext::get(const std::string& key) {
  const config::Value* v = params_.find_path(key);
  std::string rec = key + "=" + (v && !v->is_null() ? v->scalar_text() : "<unset>");
  if (std::find(keys_read_.begin(), keys_read_.end(), rec) == keys_read_.end()) {
    keys_read_.push_back(rec);
  }
  return v && !v->is_null() ? v : nullptr;
}

bool PatchContext::flag(const std::string& key, bool def) {
  const config::Value* v = get(key);
  return v ? v->as_bool() : def;
}
int64_t PatchContext::integer(const std::string& key, int64_t def) {
  const config::Value* v = get(key);
  return v ? v->as_int() : def;
}
double PatchContext::number(const std::string& key, double def) {
  const config::Value* v = get(key);
  return v ? v->as_double() : def;
}
std::string PatchContext::text(const std::string& key, const std::string& def) {
  const config::Value* v = get(key);
  return v ? v->scalar_text() : def;
}

BackendArgs& PatchContext::args() {
  if (!args_) {
    throw RuntimeError(fmt::format("patch {}: backend args are not built yet in phase {} "
                                   "(use phase build_args or later)",
                                   patch_, phase_name(phase_)));
  }
  return *args_;
}

void PatchContext::set_env(const std::string& name, const std::string& value) {
  ::setenv(name.c_str(), value.c_str(), 1);
  env_changes_.push_back(fmt::format("{}: {}={}", patch_, name, value));
}

void PatchContext::begin_patch(const Patch& p, Phase phase) {
  patch_ = p.id;
  phase_ = phase;
  declared_slots_ = p.slots;
  keys_read_.clear();
}

void PatchContext::check_slot(const std::string& slot) {
  if (!hooks_) throw RuntimeError(fmt::format("patch {}: this backend has no hook table", patch_));
  if (std::find(declared_slots_.begin(), declared_slots_.end(), slot) == declared_slots_.end()) {
    throw RuntimeError(fmt::format("patch {} changed hook slot '{}' without declaring it in its "
                                   "`slots` (declared: {})",
                                   patch_, slot, fmt::join(declared_slots_, ", ")));
  }
}

}  // namespace primus::patches
