#include "train/common_patches.h"

#include <fmt/format.h>

#include "core/patches/context.h"
#include "core/util/error.h"
#include "dist/launch_env.h"

namespace primus::train {

namespace {
TrainingArgs& training_of(patches::PatchContext& c) {
  auto* t = dynamic_cast<HasTrainingArgs*>(&c.args());
  if (!t) throw RuntimeError("backend args carry no TrainingArgs");
  return t->training();
}
}  // namespace

void register_common_args_patches(patches::PatchRegistry& reg, const std::string& backend) {
  using patches::Patch;
  using patches::PatchContext;
  using patches::Phase;

  Patch dp;
  dp.id = backend + ".args.data_parallel_size";
  dp.backend = backend;
  dp.phase = Phase::BuildArgs;
  dp.priority = 5;  // before grad_accum, which divides by it
  dp.description = "sets the data-parallel size to the job's world size (WORLD_SIZE from `primus launch`, "
                   "torchrun or Slurm)";
  dp.logic = "rewrites args: data_parallel_size = WORLD_SIZE (a config value other than 1 must agree)";
  dp.tags = {"args", "distributed"};
  dp.apply = [](PatchContext& c) {
    TrainingArgs& t = training_of(c);
    dist::DistEnv env = dist::read_dist_env();
    if (env.world_size == 1) return;
    if (t.data_parallel_size != 1 && t.data_parallel_size != env.world_size) {
      throw ConfigError(fmt::format("data_parallel_size {} disagrees with the job's {} processes ({}); leave it unset",
                                    t.data_parallel_size, env.world_size, dist::describe(env)));
    }
    t.data_parallel_size = env.world_size;
  };
  reg.add(dp);

  Patch accum;
  accum.id = backend + ".args.grad_accum";
  accum.backend = backend;
  accum.phase = Phase::BuildArgs;
  accum.priority = 10;
  accum.description = "derives gradient accumulation steps from global batch, micro batch and data-parallel size";
  accum.logic = "rewrites args: grad_accum_steps = global_batch_size / (micro_batch_size x data_parallel_size)";
  accum.tags = {"args", "batch"};
  accum.apply = [](PatchContext& c) {
    TrainingArgs& t = training_of(c);
    int64_t per_step = t.micro_batch_size * t.data_parallel_size;
    if (t.global_batch_size % per_step != 0) {
      throw ConfigError(fmt::format("global_batch_size {} is not a multiple of micro_batch_size {} x "
                                    "data_parallel_size {}",
                                    t.global_batch_size, t.micro_batch_size, t.data_parallel_size));
    }
    t.grad_accum_steps = t.global_batch_size / per_step;
  };
  reg.add(accum);

  Patch mock;
  mock.id = backend + ".args.mock_data";
  mock.backend = backend;
  mock.phase = Phase::BuildArgs;
  mock.description = "trains on synthetic tokens (no dataset needed): for smoke tests and benchmarks";
  mock.logic = "rewrites args: data.mock_data = true, data paths cleared";
  mock.tags = {"args", "data"};
  mock.condition = [](PatchContext& c) { return c.flag("mock_data"); };
  mock.apply = [](PatchContext& c) {
    TrainingArgs& t = training_of(c);
    t.data.mock_data = true;
    t.data.data_path.clear();
    t.data.valid_data_path.clear();
  };
  reg.add(mock);

  Patch tb;
  tb.id = backend + ".logging.tensorboard_dir";
  tb.backend = backend;
  tb.phase = Phase::BuildArgs;
  tb.description = "writes TensorBoard events under <workspace>/<work_group>/<user>/<exp>/tensorboard when no folder is set";
  tb.logic = "rewrites args: tensorboard_dir";
  tb.tags = {"args", "logging"};
  tb.condition = [](PatchContext& c) { return c.get("tensorboard_dir") == nullptr; };
  tb.apply = [](PatchContext& c) {
    TrainingArgs& t = training_of(c);
    t.tensorboard_dir = t.output_dir / "tensorboard";
  };
  reg.add(tb);
}

}  // namespace primus::train
