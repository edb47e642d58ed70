// primus patches list [--backend B] [--config F] [--format md|json]; primus patches show ID
#include <iostream>

#include "cli/builtin_backends.h"
#include "cli/command.h"
#include "core/config/experiment.h"
#include "core/patches/inventory.h"
#include "core/util/error.h"

namespace primus::cli {
namespace {

struct Opts {
  std::string backend, config, format = "md", id;
};

// The values conditions are evaluated against: the resolved config, or the schema defaults.
struct Resolved {
  std::string backend, version;
  config::Value params = config::Value::map();
  bool with_config = false;
};

Resolved resolve(const std::string& backend_opt, const std::string& config_file,
                 const std::string& backend_of_patch = "") {
  Resolved r;
  std::string backend = backend_opt.empty() ? backend_of_patch : backend_opt;
  if (!config_file.empty()) {
    auto exp = config::load_experiment(config_file, {});
    const config::ModuleSpec* spec = &exp.modules.front();
    for (auto& m : exp.modules)
      if (!backend.empty() && m.framework == backend) spec = &m;
    if (!backend.empty() && spec->framework != backend) {
      throw ConfigError(fmt::format("{}: no module uses backend '{}'", config_file, backend));
    }
    backend = spec->framework;
    auto adapter = BackendRegistry::global().create(backend);
    r.params = config::resolve_module(exp, spec->name, adapter->schema()).params;
    r.version = adapter->version();
    r.with_config = true;
  } else if (!backend.empty() && backend != "*") {
    auto adapter = BackendRegistry::global().create(backend);
    adapter->schema().apply_defaults(r.params);
    r.version = adapter->version();
  }
  r.backend = backend;
  return r;
}

void setup_patches(CLI::App& app) {
  app.require_subcommand(1);
  auto o = std::make_shared<Opts>();
  CLI::App* list = app.add_subcommand("list", "The patch inventory, from the registry");
  list->add_option("--backend,-b", o->backend, "Only this backend's patches");
  list->add_option("--config,-c", o->config, "Also say whether each patch applies with this experiment");
  list->add_option("--format", o->format, "md or json")->check(CLI::IsMember({"md", "json"}));
  list->callback([o] {
    register_builtin_backends();
    auto& reg = patches::PatchRegistry::global();
    std::vector<std::string> backends;
    if (o->backend.empty() && o->config.empty()) {
      backends = BackendRegistry::global().names();
    } else {
      backends.push_back(o->backend);
    }
    nlohmann::json all = nlohmann::json::array();
    for (auto& b : backends) {
      Resolved r = resolve(b, o->config);
      auto rows = patches::inventory(reg, r.backend, r.version, r.params, r.with_config,
                                     patches::PatchFilter::from_env(reg));
      if (o->format == "json") {
        for (auto& j : patches::inventory_json(rows)) all.push_back(j);
      } else {
        std::cout << patches::inventory_markdown(rows, r.backend, r.with_config) << "\n";
      }
    }
    if (o->format == "json") std::cout << all.dump(2) << "\n";
  });
  CLI::App* show = app.add_subcommand("show", "One patch in depth, with a porting guide");
  show->add_option("id", o->id, "Patch id")->required();
  show->add_option("--config,-c", o->config, "Also evaluate its condition with this experiment");
  show->callback([o] {
    register_builtin_backends();
    auto& reg = patches::PatchRegistry::global();
    const patches::Patch& p = reg.get(o->id);
    Resolved r = resolve("", o->config, p.backend);
    auto rows = patches::inventory(reg, r.backend, r.version, r.params, r.with_config);
    for (auto& row : rows) {
      if (row.patch->id == p.id) std::cout << patches::patch_details(row);
    }
  });
}

CommandRegistrar reg_patches({"patches", "The patch inventory (list, show)", setup_patches});

void setup_backends(CLI::App& app) {
  app.callback([] {
    register_builtin_backends();
    for (auto& name : BackendRegistry::global().names()) {
      auto a = BackendRegistry::global().create(name);
      std::cout << name << " " << a->version() << "  " << a->description() << "\n";
    }
  });
}
CommandRegistrar reg_backends({"backends", "List the backends built into this binary", setup_backends});

}  // namespace
}  // namespace primus::cli
