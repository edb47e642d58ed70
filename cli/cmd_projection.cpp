// primus projection memory|performance|both --config EXP.yaml [--gpus N] [--json] [key=value ...]
// Per-GPU memory by part and the step time by part, before a job is queued (docs/projection.md).
#include <iostream>

#include "cli/command.h"
#include "cli/projection_driver.h"
#include "core/util/error.h"

namespace primus::cli {
namespace {

void setup_projection(CLI::App& app) {
  struct Opts {
    std::string what;
    ProjectionRequest req;
    bool json = false;
  };
  auto o = std::make_shared<Opts>();
  app.add_option("what", o->what, "memory, performance or both")
      ->required()
      ->check(CLI::IsMember({"memory", "performance", "both"}));
  app.add_option("--config,-c", o->req.config, "Experiment YAML file")->required();
  app.add_option("--module", o->req.module, "Module of the experiment (default: the first)");
  app.add_option("--gpus", o->req.gpus,
                 "GPUs of the job (WORLD_SIZE, what `primus launch` starts): data_parallel_size is gpus / (tp x "
                 "cp), the ep ranks among them. Tensor, context and expert parallelism are projected in memory "
                 "only (cuda backend); pipeline parallelism not yet")
      ->check(CLI::PositiveNumber);
  app.add_flag("--json", o->json, "Print the projection as JSON instead of the table");
  app.add_option("--rates", o->req.rates_file,
                 "Rates cache written by `primus benchmark ... --cache` (default: $PRIMUS_RATES_CACHE, else "
                 "~/.cache/primus/rates.json)");
  app.add_option("--device", o->req.device,
                 "Device whose rates to use, as its name reads (e.g. 'NVIDIA H200'; default: this machine's GPU, "
                 "else the only device in the cache)");
  app.add_option("--peak-tflops", o->req.peak_tflops, "Stated dense bf16 peak per GPU (roofline instead of measured rates)")
      ->check(CLI::PositiveNumber);
  app.add_option("--hbm-gbps", o->req.hbm_gbps, "Stated HBM bandwidth per GPU in GB/s (roofline)")->check(CLI::PositiveNumber);
  app.add_option("--net-gbps", o->req.net_gbps,
                 "Bus bandwidth of the gradient collectives in GB/s (NCCL-tests' busbw), for --gpus > 1")
      ->check(CLI::PositiveNumber);
  app.add_option("--preflight", o->req.preflight, "`primus preflight --json` output: its all-reduce bus bandwidth");
  app.add_option("--runtime-gib", o->req.runtime_gib,
                 "Memory of the CUDA context and libraries beside the model (default: the figure measured on H100/H200)")
      ->check(CLI::NonNegativeNumber);
  app.add_option("--device-memory-gib", o->req.device_memory_gib,
                 "The GPU's memory, to say whether the job fits (default: this machine's GPU, else the data sheet of --device)")
      ->check(CLI::PositiveNumber);
  app.allow_extras();
  app.footer("Overrides: key=value or --key value, as `primus train pretrain` takes them, e.g. micro_batch_size=8 "
             "recompute_granularity=full use_distributed_optimizer=true");
  app.callback([o, &app] {
    o->req.overrides = app.remaining();
    o->req.memory = o->what != "performance";
    o->req.performance = o->what != "memory";
    const train::Projection p = run_projection(o->req);
    if (o->json) std::cout << train::projection_to_json(p).dump(2) << "\n";
    else std::cout << train::format_projection(p);
  });
}

CommandRegistrar reg_projection({"projection",
                                 "Project per-GPU memory and step time of an experiment before running it",
                                 setup_projection});

}  // namespace
}  // namespace primus::cli
