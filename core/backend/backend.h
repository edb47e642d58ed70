// The contract between the core and a backend. The core knows no backend by name: backends
// register an adapter factory in the BackendRegistry (one line in cli/builtin_backends.cpp).
#pragma once
#include <functional>
#include <map>
#include <memory>
#include <string>
#include <vector>

#include "core/config/experiment.h"
#include "core/config/schema.h"
#include "core/patches/hook_table.h"
#include "core/trainer/trainer.h"

namespace primus {

// Typed arguments a backend builds from its config; build_args patches may rewrite them.
struct BackendArgs {
  virtual ~BackendArgs() = default;
  // A readable dump for dry runs and logs: key -> value.
  virtual std::vector<std::pair<std::string, std::string>> describe() const = 0;
};

class BackendAdapter {
 public:
  virtual ~BackendAdapter() = default;
  virtual std::string name() const = 0;
  // Known before anything is loaded, so setup-phase patches can be gated on it.
  virtual std::string version() const = 0;
  virtual std::string description() const = 0;
  // Every key the backend accepts (type, default, range, doc).
  virtual const config::Schema& schema() const = 0;
  // Declares the backend's hook slots with their default implementations.
  virtual void define_hooks(patches::HookTable& hooks) const = 0;
  // Loads what the backend needs (libraries, devices) after setup patches ran.
  virtual void prepare(const config::ModuleConfig& cfg) = 0;
  // Builds the typed backend args from the validated module config.
  virtual std::shared_ptr<BackendArgs> convert_config(const config::ModuleConfig& cfg,
                                                      const config::Experiment& exp) = 0;
  // stage: "pretrain" (the stages a backend supports are its own business).
  virtual std::unique_ptr<Trainer> create_trainer(const std::string& stage,
                                                  std::shared_ptr<BackendArgs> args,
                                                  const patches::HookTable& hooks) = 0;
};

using BackendFactory = std::function<std::unique_ptr<BackendAdapter>()>;

class BackendRegistry {
 public:
  static BackendRegistry& global();
  void add(const std::string& name, BackendFactory factory);  // duplicate name -> logic_error
  bool has(const std::string& name) const { return factories_.count(name) > 0; }
  std::vector<std::string> names() const;
  // Unknown name -> ConfigError listing the known backends.
  std::unique_ptr<BackendAdapter> create(const std::string& name) const;

 private:
  std::map<std::string, BackendFactory> factories_;
};

}  // namespace primus
