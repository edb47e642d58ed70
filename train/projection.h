// `primus projection`: what a configured run will need per GPU, and how long its step will take,
// before it is queued. Backend-neutral parts live here: the layout read from the resolved
// config, the memory breakdown (each backend supplies its own through a BackendProjector: the
// cuda backend from its memory plan's own sizing pass, the reference backend by an analytical
// count), the step-time model (FLOPs and bytes per part of the step over measured or
// roofline rates, plus the data-parallel collectives over a stated bandwidth), the table and
// the JSON form (projection_to_json / projection_from_json round-trip every field).
//
// Units: bytes, seconds, FLOPs; rates in TFLOP/s and GB/s (10^12, 10^9), as `primus benchmark`
// reports them.
#pragma once
#include <cstdint>
#include <functional>
#include <map>
#include <string>
#include <vector>

#include <nlohmann/json.hpp>

#include "core/backend/backend.h"
#include "core/patches/hook_table.h"
#include "train/model_spec.h"
#include "train/projection_rates.h"
#include "train/training_args.h"

namespace primus::train {

// The run being projected, from the config after the build_args patches (data_parallel_size
// from --gpus, grad_accum_steps derived from the batch sizes).
struct ProjectionLayout {
  int64_t gpus = 1;  // data-parallel ranks (data_parallel_size); the job's GPUs are gpus x tp x cp
  int64_t tp = 1, cp = 1;         // tensor_model_parallel_size, context_parallel_size
  int64_t ep = 1;                 // expert_model_parallel_size (carved from the gpus data-parallel ranks)
  bool sequence_parallel = false;
  std::string sharding = "no_shard";  // data_parallel_sharding_strategy (optim_grads*: over dp x cp)
  int64_t micro_batch = 1, global_batch = 1, grad_accum = 1, seq_length = 0;
  bool zero1 = false;               // use_distributed_optimizer (cuda: ZeRO-1 over the dp ranks)
  bool grad_reduce_in_bf16 = false;
  bool overlap_grad_reduce = true;  // the gradient buckets reduce under the backward
  std::string recompute = "none";   // recompute_granularity (cuda)
  int64_t recompute_layers = -1;    // the first N layers take it (recompute_method block); -1: every layer
  std::string fp8 = "none";         // fp8 recipe (cuda)
  int64_t tokens_per_step() const { return global_batch * seq_length; }
};

// The layout's batch fields from the training keys, common to every backend's projector (which
// then sets its own: ZeRO-1's key, bf16 reduction, overlap, recompute, fp8).
ProjectionLayout batch_layout(const TrainingArgs& t, int64_t seq_length);

// One part of a rank's memory. name is a stable key (the JSON and the tests use it):
// weights, master_weights, gradients, optimizer_state, activations, fp8, comm, workspace, runtime.
struct MemoryPart {
  std::string name;
  std::string detail;  // what it holds, in words
  double bytes = 0;
};

struct MemoryProjection {
  std::string source;  // how the figures were made (exact plan sizes, analytical, ...)
  std::vector<MemoryPart> parts;
  std::vector<std::string> notes;  // caveats printed under the table
  double total() const;
  double bytes(const std::string& name) const;  // sum of the parts of that name; 0 if none
  void add(const std::string& name, const std::string& detail, double bytes);
};

// One part of the step: work (FLOPs or bytes) over a rate.
struct TimePart {
  std::string name;    // gemm, grouped_gemm, attention, elementwise, optimizer, comm
  std::string detail;
  double work = 0;     // FLOPs (unit "flop") or bytes (unit "byte") per step, per rank
  std::string unit;
  double rate = 0;     // TFLOP/s or GB/s
  double seconds = 0;  // work / rate
};

struct TimeProjection {
  std::string rates_source;  // where the rates came from (cache file and device, roofline table, flags)
  DeviceRates rates;         // the rates themselves
  std::vector<TimePart> parts;
  bool comm_overlapped = false;  // the gradient reduction runs under the backward (overlap_grad_reduce)
  double step_seconds = 0;       // compute parts summed, comm added unless overlapped (then the excess)
  double tokens_per_second = 0;  // the whole job's
  double mfu = 0;                // model FLOPs / (step time x peak), 0 without a peak
  std::vector<std::string> notes;
};

// The step-time model for one rank: FLOPs and bytes from the spec and the layout. act_bytes: 2
// for bf16 compute (cuda), 4 for fp32 (reference); optimizer_bytes_per_param: AdamW's traffic.
struct StepCostOptions {
  double act_bytes = 2;
  double weight_bytes = 2;  // the compute copy a ZeRO-1 all-gather sends (bf16 on cuda, fp32 on reference)
  // AdamW reads p, g, m, v and writes p, m, v (28 bytes) and the bf16 copy (2); the grad norm
  // reads g (4).
  double optimizer_bytes_per_param = 34;
};
TimeProjection project_step_time(const ModelSpec& spec, const ProjectionLayout& layout, const DeviceRates& rates,
                                 const StepCostOptions& opt);

struct MemoryProjectionOptions {
  double runtime_gib = -1;  // CUDA context and libraries beside the model's memory; < 0: the backend's own figure
};

// A projection that stopped where the trainer would refuse the config (the backend's own checks
// of its args before it builds anything): `primus train --dry-run` fails with it, as the run
// would, where any other reason to stop only leaves the memory line unprojected.
struct RunRefusal : ConfigError {
  explicit RunRefusal(const std::string& w) : ConfigError(w) {}
};

// What a backend contributes (registered per backend name, from its register_backend): the
// layout its args describe, its memory model for one rank, and its step's byte costs.
struct BackendProjector {
  std::function<const ModelSpec&(const BackendArgs& args)> spec;
  std::function<ProjectionLayout(const BackendArgs& args)> layout;
  std::function<MemoryProjection(const BackendArgs& args, const patches::HookTable& hooks,
                                 const ProjectionLayout& layout, const MemoryProjectionOptions& opt)>
      memory;
  StepCostOptions cost;
  // The costs for one config, where its options change them (unset: `cost`).
  std::function<StepCostOptions(const BackendArgs& args)> cost_of;
  // This machine's accelerator, if the backend has one here: its name and memory in bytes.
  std::function<bool(std::string* name, double* bytes)> local_device;
  // Whether `memory` sizes a rank of a tensor- and context-parallel layout (its tp slice, its chunk
  // slots, the sharding over dp x cp); the step time models data parallelism only.
  bool mesh_memory = false;
};
void register_backend_projector(const std::string& backend, BackendProjector p);
const BackendProjector* find_backend_projector(const std::string& backend);

struct Projection {
  std::string config, backend, model;  // the experiment file, backend name, ModelSpec::summary()
  int64_t parameters = 0, active_parameters = 0;
  ProjectionLayout layout;
  bool has_memory = false, has_time = false;
  MemoryProjection memory;
  TimeProjection time;
  double device_memory_bytes = 0;  // the device's memory, when known (fits or not)
};

nlohmann::json projection_to_json(const Projection& p);
Projection projection_from_json(const nlohmann::json& j);  // throws ConfigError on a missing field
std::string format_projection(const Projection& p);
// One line for `primus train --dry-run`: total per rank ("GPU", or "process" on the CPU) and the
// biggest parts.
std::string memory_summary_line(const MemoryProjection& m, const std::string& rank = "GPU");

std::string format_bytes(double bytes);  // "12.34 GiB", "512.0 MiB"

}  // namespace primus::train
