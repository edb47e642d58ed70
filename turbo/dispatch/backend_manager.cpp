#include "turbo/dispatch/backend_manager.h"

#include <fmt/format.h>
#include <spdlog/spdlog.h>

#include <cctype>
#include <cstdlib>
#include <vector>

#include "core/util/error.h"

namespace primus::turbo {

GlobalBackendManager& GlobalBackendManager::instance() {
  static GlobalBackendManager m;
  return m;
}

std::string GlobalBackendManager::env_var_for(const std::string& op) {
  std::string v = "PRIMUS_TURBO_";
  for (char c : op) v += c == '-' ? '_' : static_cast<char>(std::toupper(static_cast<unsigned char>(c)));
  return v + "_BACKEND";
}

void GlobalBackendManager::set_backend(const std::string& op, BackendChoice choice,
                                       std::optional<Precision> precision) {
  std::lock_guard lock(mu_);
  BackendSpec& spec = code_[op];
  if (precision)
    spec.per_precision[static_cast<size_t>(*precision)] = choice;
  else
    spec = BackendSpec{{}, choice};  // a setter for all precisions replaces per-precision ones
}

void GlobalBackendManager::clear_backend(const std::string& op) {
  std::lock_guard lock(mu_);
  code_.erase(op);
}

void GlobalBackendManager::set_auto_tune(std::optional<bool> on) {
  std::lock_guard lock(mu_);
  auto_tune_ = on;
}

void GlobalBackendManager::reset() {
  std::vector<std::function<void()>> hooks;
  {
    std::lock_guard lock(mu_);
    code_.clear();
    auto_tune_.reset();
    env_cache_.clear();
    warned_.clear();
    for (auto& [id, h] : reset_hooks_) hooks.push_back(h);
  }
  for (auto& h : hooks) h();  // outside the lock: hooks take their dispatcher's own lock
}

std::optional<UserChoice> GlobalBackendManager::user_choice(const std::string& op, Precision p) {
  std::lock_guard lock(mu_);
  if (auto it = code_.find(op); it != code_.end()) {
    if (auto c = it->second.lookup(p)) return UserChoice{*c, "set_backend"};
  }
  const std::string var = env_var_for(op);
  const char* raw = std::getenv(var.c_str());
  if (!raw || !*raw) return std::nullopt;
  EnvCache& cache = env_cache_[op];
  if (cache.text != raw || cache.spec.empty()) {
    cache.spec = parse_backend_spec(raw, var);  // throws ConfigError on malformed text
    cache.text = raw;
  }
  if (auto c = cache.spec.lookup(p)) return UserChoice{*c, var};
  return std::nullopt;
}

bool GlobalBackendManager::auto_tune_enabled() {
  {
    std::lock_guard lock(mu_);
    if (auto_tune_) return *auto_tune_;
  }
  const char* raw = std::getenv("PRIMUS_TURBO_AUTO_TUNE");
  if (!raw || !*raw) return false;
  std::string v;
  for (const char* c = raw; *c; ++c) v += static_cast<char>(std::tolower(static_cast<unsigned char>(*c)));
  if (v == "1" || v == "true" || v == "on" || v == "yes") return true;
  if (v == "0" || v == "false" || v == "off" || v == "no") return false;
  throw ConfigError(fmt::format("PRIMUS_TURBO_AUTO_TUNE: '{}' is not a switch (use 1 or 0)", raw));
}

bool GlobalBackendManager::capturing() const {
  std::lock_guard lock(mu_);
  return capture_depth_ > 0;
}

GlobalBackendManager::CaptureScope::CaptureScope() {
  auto& m = instance();
  std::lock_guard lock(m.mu_);
  ++m.capture_depth_;
}

GlobalBackendManager::CaptureScope::~CaptureScope() {
  auto& m = instance();
  std::lock_guard lock(m.mu_);
  --m.capture_depth_;
}

void GlobalBackendManager::warn_once(const std::string& key, const std::string& message) {
  std::function<void(const std::string&)> sink;
  {
    std::lock_guard lock(mu_);
    if (!warned_.insert(key).second) return;
    sink = sink_;
  }
  if (sink)
    sink(message);
  else
    spdlog::warn("{}", message);
}

void GlobalBackendManager::set_warning_sink(std::function<void(const std::string&)> sink) {
  std::lock_guard lock(mu_);
  sink_ = std::move(sink);
}

int GlobalBackendManager::add_reset_hook(std::function<void()> hook) {
  std::lock_guard lock(mu_);
  reset_hooks_[next_hook_] = std::move(hook);
  return next_hook_++;
}

void GlobalBackendManager::remove_reset_hook(int id) {
  std::lock_guard lock(mu_);
  reset_hooks_.erase(id);
}

}  // namespace primus::turbo
