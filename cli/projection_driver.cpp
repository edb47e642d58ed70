#include "cli/projection_driver.h"

#include <fmt/format.h>
#include <spdlog/spdlog.h>

#include <cstdlib>

#include "cli/builtin_backends.h"
#include "core/runtime/runtime.h"
#include "core/util/error.h"
#include "parallel/parallel_dims.h"
#include "train/common_patches.h"
#include "train/training_args.h"

namespace primus::cli {

namespace {

// The patches' "applied ..." lines are a run's log, not a projection's output (which may be
// JSON on stdout): quiet unless PRIMUS_LOG_LEVEL asks otherwise.
struct QuietPatchLog {
  spdlog::level::level_enum before = spdlog::get_level();
  QuietPatchLog() {
    const char* lvl = std::getenv("PRIMUS_LOG_LEVEL");
    if (!(lvl && *lvl)) spdlog::set_level(spdlog::level::err);
  }
  ~QuietPatchLog() { spdlog::set_level(before); }
};

const train::BackendProjector& projector_of(const std::string& backend) {
  const train::BackendProjector* p = train::find_backend_projector(backend);
  if (!p) throw ConfigError(fmt::format("projection: backend '{}' has no projection (reference and cuda have)", backend));
  return *p;
}

// Which device's rates, and from where (train/projection_rates.h says the order).
train::DeviceRates resolve_rates(const ProjectionRequest& req, const std::string& local_name) {
  const std::filesystem::path cache =
      req.rates_file.empty() ? train::default_rates_cache() : std::filesystem::path(req.rates_file);
  if (!req.rates_file.empty() && !std::filesystem::exists(cache))
    throw IoError(fmt::format("--rates {}: no such file (`primus benchmark ... --cache` writes it)", req.rates_file));
  std::string device = !req.device.empty() ? req.device : local_name;
  std::optional<train::DeviceRates> cached;
  if (device.empty()) {
    cached = train::only_cached_device(cache);
    if (cached) device = cached->device;
  } else {
    cached = train::load_rates(cache, device);
  }
  train::DeviceRates r;
  if (req.peak_tflops > 0 || req.hbm_gbps > 0) {  // a stated roofline wins over anything measured
    const auto table = train::peak_of_device(device);
    const double tf = req.peak_tflops > 0 ? req.peak_tflops : table ? table->tflops : 0;
    const double bw = req.hbm_gbps > 0 ? req.hbm_gbps : table ? table->hbm_gbs : 0;
    if (tf <= 0 || bw <= 0)
      throw ConfigError("projection: a stated roofline needs both --peak-tflops and --hbm-gbps (the device '" + device +
                        "' is not in the table to fill in the other)");
    r = train::roofline_rates(device.empty() ? "stated device" : device, tf, bw);
    r.source = fmt::format("roofline from --peak-tflops {} / --hbm-gbps {} x the efficiencies in docs/projection.md", tf, bw);
  } else if (cached) {
    r = *cached;
    r.source = fmt::format("measured by `primus benchmark` on {} ({}), cached in {}", r.device, r.date, cache.string());
  } else if (const auto table = train::peak_of_device(device); table && !device.empty()) {
    r = train::roofline_rates(device, table->tflops, table->hbm_gbs);
    r.source = fmt::format("roofline of {} ({} TFLOP/s bf16, {} GB/s HBM, no measured rates cached in {}) x the "
                           "efficiencies in docs/projection.md",
                           device, table->tflops, table->hbm_gbs, cache.string());
  } else {
    throw ConfigError(fmt::format(
        "projection performance: no rates for {}: run `primus benchmark gemm attention norm activation optimizer "
        "grouped_gemm --cache` on that GPU, name a device of the peak table with --device (H100, H200, A100, ...), or "
        "state --peak-tflops and --hbm-gbps",
        device.empty() ? "this machine (no GPU here, none cached)" : "'" + device + "'"));
  }
  if (req.net_gbps > 0) r.net_gbs = req.net_gbps;
  else if (!req.preflight.empty()) r.net_gbs = train::net_gbs_from_preflight(req.preflight);
  return r;
}

// The model-parallel dimensions a config may name. Pipeline parallelism is not modelled; tensor,
// context and expert parallelism only in memory, by a projector that sizes a rank of
// such a layout (BackendProjector::mesh_memory): the step-time model is one replica's with data
// parallelism. A layout beyond what is modelled is refused rather than sized as if it were data
// parallel.
void refuse_unmodelled_dims(const train::TrainingArgs& t, bool mesh_memory, bool performance) {
  using parallel::Dim;
  for (Dim d : {Dim::TP, Dim::CP, Dim::EP, Dim::PP}) {
    if (t.model_parallel[d] <= 1) continue;
    const bool memory_only = d == Dim::TP || d == Dim::CP || d == Dim::EP;
    if (memory_only && mesh_memory && !performance) continue;
    if (memory_only && mesh_memory) {
      throw ConfigError(fmt::format("projection performance: {} = {} is not modelled yet (the step time covers data "
                                    "parallelism, ZeRO-1 and gradient accumulation); `primus projection memory` sizes "
                                    "this layout",
                                    parallel::dim_config_key(d), t.model_parallel[d]));
    }
    throw ConfigError(fmt::format("projection: {} = {} is not modelled yet (the projection covers data parallelism, "
                                  "ZeRO-1 and gradient accumulation{}); project the layout with it at 1",
                                  parallel::dim_config_key(d), t.model_parallel[d],
                                  mesh_memory ? ", and tensor, context and expert parallelism in memory" : ""));
  }
}

}  // namespace

train::Projection run_projection(const ProjectionRequest& req) {
  register_builtin_backends();
  std::vector<std::string> overrides = req.overrides;
  if (req.gpus < 0) throw UsageError(fmt::format("--gpus {}: expected a positive number of GPUs", req.gpus));
  QuietPatchLog quiet;
  PrimusRuntime runtime;
  auto exp = config::load_experiment(req.config, config::parse_cli_overrides(overrides));
  PlannedArgs planned = runtime.plan_args(exp, req.module);
  // --gpus is the job's GPUs, what `primus launch` gives as WORLD_SIZE: data_parallel_size is
  // gpus / (tp x cp), set as the launch's patch sets it, so the batch arithmetic (grad_accum_steps)
  // and its errors are the run's own.
  if (req.gpus > 0) {
    const auto& mp = dynamic_cast<train::HasTrainingArgs&>(*planned.args).training().model_parallel;
    const int64_t split = mp.model_parallel_product();
    if (req.gpus % split != 0)
      throw UsageError(fmt::format("--gpus {} is not a multiple of tensor_model_parallel_size {} x context_parallel_size "
                                   "{} x expert_model_parallel_size {} x pipeline_model_parallel_size {}",
                                   req.gpus, mp[parallel::Dim::TP], mp[parallel::Dim::CP], mp[parallel::Dim::EP],
                                   mp[parallel::Dim::PP]));
    // The ep ranks are data-parallel ranks too (each reads its own samples).
    overrides.push_back(fmt::format("data_parallel_size={}", req.gpus / split * mp[parallel::Dim::EP]));
    exp = config::load_experiment(req.config, config::parse_cli_overrides(overrides));
    planned = runtime.plan_args(exp, req.module);
  }
  const std::string backend = planned.adapter->name();
  const train::BackendProjector& pr = projector_of(backend);
  // The args patch derives grad_accum_steps and refuses a global batch that does not divide.
  const train::TrainingArgs& training = dynamic_cast<train::HasTrainingArgs&>(*planned.args).training();
  training.check_batch();
  refuse_unmodelled_dims(training, pr.mesh_memory, req.performance);

  train::Projection p;
  p.config = req.config;
  p.backend = backend;
  const train::ModelSpec& spec = pr.spec(*planned.args);
  p.model = spec.summary();
  p.parameters = spec.num_parameters();
  p.active_parameters = spec.num_active_parameters();
  p.layout = pr.layout(*planned.args);
  std::string local_name;
  double local_bytes = 0;
  if (pr.local_device) pr.local_device(&local_name, &local_bytes);
  p.device_memory_bytes = req.device_memory_gib > 0 ? req.device_memory_gib * double(size_t{1} << 30) : local_bytes;
  if (p.device_memory_bytes <= 0 && !req.device.empty()) {  // a named device: its data sheet's capacity
    if (const auto table = train::peak_of_device(req.device)) p.device_memory_bytes = table->memory_gb * 1e9;
  }
  if (req.memory) {
    train::MemoryProjectionOptions mo;
    mo.runtime_gib = req.runtime_gib;
    p.memory = pr.memory(*planned.args, *planned.hooks, p.layout, mo);
    p.has_memory = true;
  }
  if (req.performance) {
    p.time = train::project_step_time(spec, p.layout, resolve_rates(req, local_name),
                                      pr.cost_of ? pr.cost_of(*planned.args) : pr.cost);
    p.has_time = true;
  }
  return p;
}

std::string dry_run_memory_line(const config::Experiment& exp, const std::string& module) {
  try {
    QuietPatchLog quiet;
    PrimusRuntime runtime;
    PlannedArgs planned = runtime.plan_args(exp, module);
    const train::BackendProjector* pr = train::find_backend_projector(planned.adapter->name());
    if (!pr) return "  memory:    no projection for backend " + planned.adapter->name() + "\n";
    const train::TrainingArgs& training = dynamic_cast<train::HasTrainingArgs&>(*planned.args).training();
    training.check_batch();
    refuse_unmodelled_dims(training, pr->mesh_memory, /*performance=*/false);
    const train::ProjectionLayout layout = pr->layout(*planned.args);
    const train::MemoryProjection m = pr->memory(*planned.args, *planned.hooks, layout, {});
    // The reference backend's ranks are CPU processes.
    const std::string rank = planned.adapter->name() == "reference" ? "process" : "GPU";
    const int64_t ranks = layout.gpus * layout.tp * layout.cp;
    return fmt::format("  memory:    {} ({} {}{}; `primus projection memory` for the table)\n",
                       train::memory_summary_line(m, rank), ranks, rank, ranks == 1 ? "" : (rank == "GPU" ? "s" : "es"));
  } catch (const train::RunRefusal&) {
    throw;  // the run would stop here too: so does the dry run
  } catch (const std::exception& e) {
    return fmt::format("  memory:    not projected: {}\n", e.what());
  }
}

}  // namespace primus::cli
