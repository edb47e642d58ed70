// primus train pretrain --config exp.yaml [key=value | --key value ...] [--dry-run]
#include <iostream>

#include "cli/builtin_backends.h"
#include "cli/command.h"
#include "cli/projection_driver.h"
#include "core/runtime/runtime.h"
#include "parallel/launch_env.h"
#include "parallel/parallel_dims.h"
#include "train/mesh_memory.h"

namespace primus::cli {
namespace {

struct TrainOptions {
  std::string config;
  std::string module;
  bool dry_run = false;
};

// The mesh a run would use, from the config's parallel keys and the launch environment's world
// size (RANK / WORLD_SIZE or Slurm's, as the ranks read it). Printed before the plan, so that a
// layout refused as not implemented yet (the plan's config conversion) still shows its mesh.
void print_dry_run_mesh(const config::Experiment& exp, const std::string& module, std::ostream& out) {
  const config::ModuleSpec& spec = exp.module(module.empty() ? exp.modules.front().name : module);
  auto adapter = BackendRegistry::global().create(spec.framework);
  const config::ModuleConfig cfg = config::resolve_module(exp, spec.name, adapter->schema());
  const parallel::DistEnv env = parallel::read_dist_env();
  const char* from = env.source == "torchrun" ? "WORLD_SIZE"
                     : env.source == "slurm"  ? "SLURM_NTASKS"
                                              : "no launcher; set RANK=0 WORLD_SIZE=N to plan N ranks";
  const parallel::ParallelSizes sizes = parallel::ParallelSizes::from_config(cfg.params);
  out << "Parallel layout for " << env.world_size << " rank(s) (" << from << ")\n"
      << parallel::describe_mesh(sizes, env.world_size);
  // What the layout implies per rank, also for a layout no backend runs yet (planning ahead).
  try {
    const train::ModelSpec m = train::ModelSpec::from_config(cfg.params);
    const config::Value* mb = cfg.params.find_path("micro_batch_size");
    out << train::describe_mesh_memory(m, sizes.for_world(env.world_size), mb && !mb->is_null() ? mb->as_int() : 1,
                                       m.seq_length);
  } catch (const std::exception& e) {
    out << "  memory per rank: not estimated: " << e.what() << "\n";
  }
}

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
    if (opts->dry_run) print_dry_run_mesh(exp, opts->module, std::cout);
    // The plan ends with the memory the run will take per GPU (train/projection.h).
    ro.dry_run_extra = [&](std::ostream& out) { out << dry_run_memory_line(exp, opts->module); };
    runtime.run(exp, ro, std::cout);
  });
}

CommandRegistrar reg_train({"train", "Train a model (stages: pretrain)", setup_train});

}  // namespace
}  // namespace primus::cli
