// The reference backend's typed args, built from the validated module config.
#pragma once
#include "core/backend/backend.h"
#include "core/config/value.h"
#include "train/common_patches.h"
#include "parallel/data_parallel.h"
#include "parallel/parallel_dims.h"
#include "train/model_spec.h"
#include "train/training_args.h"

namespace primus::backends::reference {

// The mesh this backend runs: tensor (with sequence) parallelism, context parallelism, every
// data-parallel sharding strategy, and expert parallelism (beside no_shard or ZeRO-1, AdamW); not
// pipeline parallelism.
inline constexpr parallel::MeshSupport kReferenceMesh{"the reference backend", true, true, true, true};

struct ReferenceArgs : BackendArgs, train::HasTrainingArgs {
  train::ModelSpec model;
  train::TrainingArgs train;
  parallel::DataParallelArgs dp;  // use_distributed_optimizer, ddp_bucket_size_mb
  int64_t num_threads = 0;  // applied by the setup patch; 0: all cores
  config::Value params;     // the resolved config, saved with checkpoints
  std::string experiment_file;

  train::TrainingArgs& training() override { return train; }
  std::vector<std::pair<std::string, std::string>> describe() const override;
};

}  // namespace primus::backends::reference
