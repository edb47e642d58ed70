// What `primus projection` and `primus train --dry-run` share: the config planned as a run would
// plan it (PrimusRuntime::plan_args: the build_args patches applied), the backend's projector,
// and the rates a step-time projection divides by.
#pragma once
#include <cstdint>
#include <string>
#include <vector>

#include "core/config/experiment.h"
#include "train/projection.h"

namespace primus::cli {

struct ProjectionRequest {
  std::string config, module;
  std::vector<std::string> overrides;  // key=value, as `primus train` takes them
  int64_t gpus = 0;                     // data-parallel ranks; 0: the config's data_parallel_size
  bool memory = true, performance = true;
  std::string rates_file;               // empty: train::default_rates_cache()
  std::string device;                   // whose rates; empty: this machine's GPU, else the cache's only device
  double peak_tflops = 0, hbm_gbps = 0;  // roofline stated by the user
  double net_gbps = 0;
  std::string preflight;                // `primus preflight --json` output, for the network rate
  double runtime_gib = -1;
  double device_memory_gib = 0;         // 0: this machine's GPU, when there is one
};

train::Projection run_projection(const ProjectionRequest& req);

// "memory per GPU (projected): ..." for a dry run of `exp`; a line saying why when it cannot be
// projected (the projection is advice: a dry run does not fail on it).
std::string dry_run_memory_line(const config::Experiment& exp, const std::string& module);

}  // namespace primus::cli
