#include "train/common_patches.h"

#include <fmt/format.h>
#include <spdlog/spdlog.h>

#include <cstdlib>

#include "core/patches/context.h"
#include "core/util/error.h"
#include "parallel/launch_env.h"

namespace primus::train {

namespace {
TrainingArgs& training_of(patches::PatchContext& c) {
  auto* t = dynamic_cast<HasTrainingArgs*>(&c.args());
  if (!t) throw RuntimeError("backend args carry no TrainingArgs");
  return t->training();
}
}  // namespace

void register_common_args_patches(patches::PatchRegistry& reg, const std::string& backend) {
  using patches::PatchContext;

  reg.add({
      .id = backend + ".args.data_parallel_size",
      .description = "sets the data-parallel size to the job's world size (WORLD_SIZE from `primus launch`, "
                     "torchrun or Slurm)",
      .priority = 5,  // before grad_accum, which divides by it
      .tags = {"args", "distributed"},
      .logic = "rewrites args: data_parallel_size = WORLD_SIZE / (tp x cp x pp), the ranks reading their own "
               "slice of each batch (expert parallelism is carved from them; a config value other than 1 must agree)",
      .apply =
          [](PatchContext& c) {
            TrainingArgs& t = training_of(c);
            parallel::DistEnv env = parallel::read_dist_env();
            if (env.world_size == 1) return;
            // world / (tp x cp x ep x pp) x ep; ConfigError naming the keys when it does not divide.
            const int64_t dp = t.model_parallel.for_world(env.world_size)[parallel::Dim::DP] *
                               t.model_parallel[parallel::Dim::EP];
            if (t.data_parallel_size != 1 && t.data_parallel_size != dp) {
              throw ConfigError(fmt::format("data_parallel_size {} disagrees with the job's {} processes ({}); "
                                            "leave it unset",
                                            t.data_parallel_size, env.world_size, parallel::describe(env)));
            }
            t.data_parallel_size = dp;
          },
  });

  reg.add({
      .id = backend + ".args.grad_accum",
      .description = "derives gradient accumulation steps from global batch, micro batch and data-parallel size",
      .priority = 10,
      .tags = {"args", "batch"},
      .logic = "rewrites args: grad_accum_steps = global_batch_size / (micro_batch_size x data_parallel_size)",
      .apply =
          [](PatchContext& c) {
            TrainingArgs& t = training_of(c);
            int64_t per_step = t.micro_batch_size * t.data_parallel_size;
            if (t.global_batch_size % per_step != 0) {
              throw ConfigError(fmt::format("global_batch_size {} is not a multiple of micro_batch_size {} x "
                                            "data_parallel_size {}",
                                            t.global_batch_size, t.micro_batch_size, t.data_parallel_size));
            }
            t.grad_accum_steps = t.global_batch_size / per_step;
          },
  });

  reg.add({
      .id = backend + ".args.mock_data",
      .description = "trains on synthetic tokens (no dataset needed): for smoke tests and benchmarks",
      .tags = {"args", "data"},
      .logic = "rewrites args: data.mock_data = true, data paths cleared (no test data)",
      .condition = [](PatchContext& c) { return c.flag("mock_data"); },
      .apply =
          [](PatchContext& c) {
            TrainingArgs& t = training_of(c);
            t.data.mock_data = true;
            t.data.data_path.clear();
            t.data.valid_data_path.clear();
            t.data.test_data_path.clear();
          },
  });

  reg.add({
      .id = backend + ".logging.tensorboard_dir",
      .description = "writes TensorBoard events under <workspace>/<work_group>/<user>/<exp>/tensorboard when no "
                     "folder is set (and disable_tensorboard is not true)",
      .tags = {"args", "logging"},
      .logic = "rewrites args: tensorboard_dir",
      .condition = [](PatchContext& c) { return c.get("tensorboard_dir") == nullptr && !c.flag("disable_tensorboard"); },
      .apply =
          [](PatchContext& c) {
            TrainingArgs& t = training_of(c);
            t.tensorboard_dir = t.output_dir / "tensorboard";
          },
  });

  reg.add({
      .id = backend + ".logging.stderr_sink_level",
      .description = "sets the console's log level from Primus' stderr_sink_level (TRACE ... CRITICAL) unless "
                     "PRIMUS_LOG_LEVEL is set",
      .tags = {"args", "logging"},
      .logic = "sets spdlog's level for the process (the configured level was checked with the config)",
      .condition =
          [](PatchContext& c) {
            const char* env = std::getenv("PRIMUS_LOG_LEVEL");
            return c.get("stderr_sink_level") != nullptr && !(env && *env);
          },
      .apply =
          [](PatchContext& c) {
            const TrainingArgs& t = training_of(c);
            if (auto level = console_log_level(t.stderr_sink_level)) {
              spdlog::set_level(static_cast<spdlog::level::level_enum>(*level));
            }
          },
  });
}

}  // namespace primus::train
