#include "core/backend/backend.h"

#include <fmt/format.h>

#include <stdexcept>

#include "core/util/error.h"

namespace primus {

BackendRegistry& BackendRegistry::global() {
  static BackendRegistry r;
  return r;
}

void BackendRegistry::add(const std::string& name, BackendFactory factory) {
  if (!factories_.emplace(name, std::move(factory)).second) {
    throw std::logic_error("backend registered twice: " + name);
  }
}

std::vector<std::string> BackendRegistry::names() const {
  std::vector<std::string> out;
  for (auto& [n, f] : factories_) out.push_back(n);
  return out;
}

std::unique_ptr<BackendAdapter> BackendRegistry::create(const std::string& name) const {
  auto it = factories_.find(name);
  if (it == factories_.end()) {
    // Primus' frameworks name the project that trains; here the backends do, and take Megatron-LM's keys.
    const bool primus_framework = name == "megatron" || name == "torchtitan" || name == "maxtext";
    throw ConfigError(fmt::format("unknown backend '{}' (known backends: {}){}", name,
                                  names().empty() ? "none" : fmt::format("{}", fmt::join(names(), ", ")),
                                  primus_framework ? "; Primus' framework names the project that trains, here the "
                                                     "backend does: cuda (NVIDIA GPUs) or reference (CPU), both "
                                                     "reading Megatron-LM's keys (docs/config.md)"
                                                   : ""));
  }
  return it->second();
}

}  // namespace primus
