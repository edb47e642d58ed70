// primus train pretrain --config exp.yaml [key=value | --key value ...] [--dry-run]
#include <iostream>

#include "cli/builtin_backends.h"
#include "cli/command.h"
#include "cli/projection_driver.h"
#include "core/runtime/runtime.h"

namespace primus::cli {
namespace {

struct TrainOptions {
  std::string config;
  std::string module;
  bool dry_run = false;
};

void setup_train(CLI::App& app) {
  app.require_subcommand(1);
  auto opts = std::make_shared<TrainOptions>();
  CLI::App* pre = app.add_subcommand("pretrain", "Pretrain a model from an experiment file");
  pre->add_option("--config,-c", opts->config, "Experiment YAML file")->required();
  pre->add_option("--module", opts->module, "Module of the experiment to run (default: the first)");
  pre->add_flag("--dry-run", opts->dry_run, "Resolve config and patches, print the plan, run nothing");
  pre->allow_extras();
  pre->footer("Overrides: key=value or --key value (dotted keys nest), e.g. train_iters=100 "
              "--micro_batch_size 8");
  pre->callback([opts, pre] {
    register_builtin_backends();
    auto cli = config::parse_cli_overrides(pre->remaining());
    auto exp = config::load_experiment(opts->config, cli);
    PrimusRuntime runtime;
    RunOptions ro;
    ro.module = opts->module;
    ro.dry_run = opts->dry_run;
    // The plan ends with the memory the run will take per GPU (train/projection.h).
    ro.dry_run_extra = [&](std::ostream& out) { out << dry_run_memory_line(exp, opts->module); };
    runtime.run(exp, ro, std::cout);
  });
}

CommandRegistrar reg_train({"train", "Train a model (stages: pretrain)", setup_train});

}  // namespace
}  // namespace primus::cli
