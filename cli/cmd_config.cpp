// primus config show --config exp.yaml [--explain] [--format yaml|json] [overrides]
#include <iostream>

#include "cli/builtin_backends.h"
#include "cli/command.h"
#include "core/config/experiment.h"

namespace primus::cli {
namespace {

void setup_config(CLI::App& app) {
  app.require_subcommand(1);
  struct Opts {
    std::string config, module, format = "yaml";
    bool explain = false;
  };
  auto o = std::make_shared<Opts>();
  CLI::App* show = app.add_subcommand("show", "Print a module's final config");
  show->add_option("--config,-c", o->config, "Experiment YAML file")->required();
  show->add_option("--module", o->module, "Module (default: the first)");
  show->add_flag("--explain", o->explain, "Say which file and line set each key");
  show->add_option("--format", o->format, "yaml or json")->check(CLI::IsMember({"yaml", "json"}));
  show->allow_extras();
  show->callback([o, show] {
    register_builtin_backends();
    auto exp = config::load_experiment(o->config, config::parse_cli_overrides(show->remaining()));
    const auto& spec = exp.module(o->module.empty() ? exp.modules.front().name : o->module);
    auto adapter = BackendRegistry::global().create(spec.framework);
    auto cfg = config::resolve_module(exp, spec.name, adapter->schema());
    if (o->format == "json") {
      nlohmann::json j = {{"module", spec.name}, {"framework", spec.framework},
                          {"output_dir", exp.output_dir().string()}, {"params", cfg.params.to_json()}};
      if (o->explain) {
        auto prov = nlohmann::json::object();
        for (auto& [k, v] : config::flatten(cfg.params)) {
          nlohmann::json hist = nlohmann::json::array();
          for (auto& h : v->overridden()) hist.push_back(h.str());
          prov[k] = {{"set_at", v->origin().str()}, {"overrides", hist}};
        }
        j["provenance"] = prov;
      }
      std::cout << j.dump(2) << "\n";
      return;
    }
    std::cout << "# module " << spec.name << " (framework " << spec.framework << "), output "
              << exp.output_dir().string() << "\n";
    if (o->explain) {
      std::cout << "# layers, last wins:\n";
      for (auto& l : cfg.layers) std::cout << "#   " << l << "\n";
    }
    std::cout << config::render_yaml(cfg.params, o->explain);
  });
}

CommandRegistrar reg_config({"config", "Inspect configs (show --explain)", setup_config});

}  // namespace
}  // namespace primus::cli
