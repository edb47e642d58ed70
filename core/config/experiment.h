// The Primus experiment layout. An experiment file names modules; each module names a backend
// (`framework`), a module preset (configs/modules/<backend>/<config>) and a model preset
// (configs/models/<model>), plus `overrides`. A module's final parameters are merged, last wins:
//   model preset -> module preset -> experiment overrides -> command line
// (each file with its `extends` chain first). Every key set in two layers is reported.
#pragma once
#include <filesystem>
#include <string>
#include <vector>

#include "core/config/schema.h"
#include "core/config/value.h"
#include "core/config/yaml_loader.h"

namespace primus::config {

// A command-line override: `key=value`, `--key value` or `--key=value`; dotted keys nest.
// Keys that name experiment fields (exp_name, workspace, work_group, user_name) set those;
// `modules.<m>.<key>` targets one module; any other key targets the module being run.
struct CliOverride {
  std::string key;
  Value value;
};
std::vector<CliOverride> parse_cli_overrides(const std::vector<std::string>& args);
Value parse_override_value(const std::string& text, const Origin& origin);

// Where presets are looked up: the experiment file's folder first, then these roots.
struct ConfigPaths {
  std::vector<std::filesystem::path> roots;  // each holds modules/ and models/
  static ConfigPaths defaults();  // $PRIMUS_CONFIG_DIR, then the repo's configs/
};

struct ModuleSpec {
  std::string name;       // e.g. "pre_trainer"
  std::string framework;  // backend name
  std::string config;     // module preset file name
  std::string model;      // model preset file name
  Value overrides = Value::map();
  Origin origin;
};

struct Experiment {
  std::filesystem::path file;
  std::string work_group, user_name, exp_name, workspace;
  std::vector<ModuleSpec> modules;
  std::vector<CliOverride> cli;  // overrides from the command line, kept for every module
  std::vector<OverrideNote> notes;  // experiment-level keys set twice
  std::filesystem::path output_dir() const;  // workspace/work_group/user_name/exp_name
  const ModuleSpec& module(const std::string& name) const;  // throws listing the modules
};

Experiment load_experiment(const std::filesystem::path& file, std::vector<CliOverride> cli,
                           const LoadOptions& opts = {}, const ConfigPaths& paths = ConfigPaths::defaults());

// One module's final parameters: merged, checked against the backend's schema, defaults added.
struct ModuleConfig {
  std::string module;
  std::string framework;
  Value params = Value::map();
  std::vector<std::string> layers;   // files and layers merged, in order
  std::vector<OverrideNote> notes;   // keys set in two layers (both places)
};

ModuleConfig resolve_module(const Experiment& exp, const std::string& module, const Schema& schema,
                            const LoadOptions& opts = {},
                            const ConfigPaths& paths = ConfigPaths::defaults());

// Renders the final config; with `explain`, each key is followed by where it was set and
// which earlier layers it overrode.
std::string render_yaml(const Value& params, bool explain);

}  // namespace primus::config
