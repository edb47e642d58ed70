// Fuzzes the YAML config loader the way a run uses it: typed scalars, ${VAR} / ${VAR:default}
// interpolation, `extends` chains between files, the experiment layout (modules, presets,
// overrides), merging with provenance, schema validation and `config show --explain`.
//
// Input: up to four files separated by a line "~~~~" (a.yaml, b.yaml, c.yaml, d.yaml, written
// into a scratch folder); a.yaml is loaded. The environment is a fixed table (FUZZ_HOME,
// FUZZ_N, FUZZ_EMPTY), so runs are reproducible.
#include <map>

#include "core/config/experiment.h"
#include "fuzz/fuzz_target.h"
#include "train/training_args.h"

namespace {

using namespace primus::config;

const Schema& schema() {
  static const Schema s = [] {
    Schema x;
    primus::train::add_training_schema(x);
    x.integer("num_layers", 2, "layers", 1, 1024)
        .integer("hidden_size", 64, "hidden size", 1)
        .text("model_type", "gpt2", "family", {"gpt2", "llama"})
        .any("extra", KeyType::Map, "free-form map")
        .any("tags", KeyType::StringList, "words");
    return x;
  }();
  return s;
}

LoadOptions options(std::vector<OverrideNote>* notes) {
  static const std::map<std::string, std::string> env = {
      {"FUZZ_HOME", "/home/fuzz"}, {"FUZZ_N", "42"}, {"FUZZ_EMPTY", ""}};
  LoadOptions o;
  o.env = [](const std::string& name) -> std::optional<std::string> {
    auto it = env.find(name);
    if (it == env.end()) return std::nullopt;
    return it->second;
  };
  o.notes = notes;
  return o;
}

void exercise(const Value& v) {
  (void)v.to_yaml();
  (void)render_yaml(v, true);
  for (auto& [key, leaf] : flatten(v)) (void)leaf->scalar_text();
}

}  // namespace

PRIMUS_FUZZ_TARGET(config_yaml) {
  static const primus::fuzz::Scratch dir("config_yaml");
  dir.clear();
  std::string_view in(reinterpret_cast<const char*>(data), size);
  auto parts = primus::fuzz::split_parts(in, "\n~~~~\n", 4);
  static const char* kNames[] = {"a.yaml", "b.yaml", "c.yaml", "d.yaml"};
  for (size_t i = 0; i < parts.size(); ++i) dir.write(kNames[i], parts[i]);
  const auto entry = dir.path() / "a.yaml";

  std::vector<OverrideNote> notes;
  primus::fuzz::refuse_only_with_primus_errors([&] {
    Value v = load_yaml_file(entry, options(&notes));
    exercise(v);
  });

  // The same files as an experiment, with presets looked up in the scratch folder.
  ConfigPaths paths;
  paths.roots = {dir.path()};
  primus::fuzz::refuse_only_with_primus_errors([&] {
    Experiment exp = load_experiment(entry, {}, options(nullptr), paths);
    (void)exp.output_dir();
    for (const auto& m : exp.modules) {
      primus::fuzz::refuse_only_with_primus_errors([&] {
        ModuleConfig mc = resolve_module(exp, m.name, schema(), options(nullptr), paths);
        exercise(mc.params);
        (void)primus::train::TrainingArgs::from_config(mc.params, exp).describe();
      });
    }
  });
}
