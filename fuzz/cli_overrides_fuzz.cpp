// Fuzzes the command-line override parser (`key=value`, `--key value`, `--key=value`, dotted
// keys, flow lists/maps, quoted strings) and everything an override flows into: the experiment
// keys, `modules.<m>.` targeting, duplicate detection, merging over the presets, schema
// validation (types, ranges, choices) and the training arguments built from the result.
//
// Input: one argument per line.
#include "core/config/experiment.h"
#include "fuzz/fuzz_target.h"
#include "train/training_args.h"

namespace {

using namespace primus::config;

struct Fixture {
  primus::fuzz::Scratch dir{"cli_overrides"};
  Schema schema;
  std::filesystem::path experiment;
  ConfigPaths paths;

  Fixture() {
    primus::train::add_training_schema(schema);
    schema.integer("num_layers", 2, "layers", 1, 1024)
        .integer("hidden_size", 64, "hidden size", 1)
        .text("model_type", "gpt2", "family", {"gpt2", "llama"})
        .any("extra", KeyType::Map, "free-form map");
    dir.write("base.yaml", "train_iters: 10\nmicro_batch_size: 2\nglobal_batch_size: 4\nlr: 1.0e-3\n");
    dir.write("module.yaml", "extends: base.yaml\nmin_lr: 1.0e-4\nextra: {a: 1, b: [x, y]}\n");
    dir.write("model.yaml", "num_layers: 2\nhidden_size: 32\nmodel_type: gpt2\n");
    experiment = dir.write("exp.yaml",
                           "exp_name: fuzz\nworkspace: /tmp/unused\n"
                           "modules:\n"
                           "  pre_trainer:\n    framework: reference\n    config: module.yaml\n"
                           "    model: model.yaml\n    overrides:\n      train_iters: 20\n"
                           "  other:\n    framework: reference\n    config: module.yaml\n");
    paths.roots = {dir.path()};
  }
};

}  // namespace

PRIMUS_FUZZ_TARGET(cli_overrides) {
  static const Fixture fx;
  std::string_view in(reinterpret_cast<const char*>(data), size);
  std::vector<std::string> args;
  for (auto a : primus::fuzz::split_parts(in, "\n", 64)) args.emplace_back(a);

  primus::fuzz::refuse_only_with_primus_errors([&] {
    auto cli = parse_cli_overrides(args);
    LoadOptions opts;
    opts.env = [](const std::string&) -> std::optional<std::string> { return std::nullopt; };
    Experiment exp = load_experiment(fx.experiment, cli, opts, fx.paths);
    (void)exp.output_dir();
    for (const char* m : {"pre_trainer", "other"}) {
      primus::fuzz::refuse_only_with_primus_errors([&] {
        ModuleConfig mc = resolve_module(exp, m, fx.schema, opts, fx.paths);
        (void)render_yaml(mc.params, true);
        auto args = primus::train::TrainingArgs::from_config(mc.params, exp);
        (void)args.describe();
        args.check_batch();
      });
    }
  });
}
