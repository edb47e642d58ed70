// How a job is laid out over its ranks: one mesh of parallel dimensions, Megatron's order
// (tensor fastest, then context, expert, data, pipeline), so rank r's coordinates are the digits
// of r in that mixed radix and users' mental model of Megatron's groups carries over:
//
//   rank = tp + TP * (cp + CP * (ep + EP * (dp + DP * pp)))
//
// The trainer builds it from the config's sizes and the launch environment (from_launch) and
// hands it to the model and to data parallelism; each dimension's process group (NCCL on GPUs,
// Gloo on CPUs: ProcessGroup::new_subgroup with group_ranks / group_name) is attached by whoever
// creates that engine (set_group). The data-parallel size is derived: world / (tp x cp x ep x pp).
//
// What each backend implements is its MeshSupport: a dimension a backend does not implement is a
// ConfigError naming the key (check_implemented); `primus train pretrain --dry-run` still prints
// the mesh such a layout would use.
//
// Expert parallelism is carved from the data-parallel ranks, as Megatron's: the dense layers'
// replicas are the ranks that differ in ep or dp (data_parallel_size = ep x dp, each reading its
// own slice of the batch), and each expert's replicas are those that differ in dp alone.
#pragma once
#include <array>
#include <cstdint>
#include <initializer_list>
#include <memory>
#include <string>
#include <vector>

#include "core/config/schema.h"
#include "core/config/value.h"
#include "parallel/launch_env.h"
#include "parallel/process_group.h"

namespace primus::parallel {

// In rank order, fastest first.
enum class Dim : uint8_t { TP, CP, EP, DP, PP };
inline constexpr int kNumDims = 5;
const char* dim_name(Dim d);        // "tp", "cp", "ep", "dp", "pp"
const char* dim_config_key(Dim d);  // tensor_model_parallel_size, ..., data_parallel_size, ...

// data_parallel_sharding_strategy (Megatron's names): what the data-parallel ranks shard.
enum class DpSharding : uint8_t {
  NoShard,           // no_shard: every rank holds everything
  Optim,             // optim: the optimizer state (ZeRO-1; use_distributed_optimizer: true)
  OptimGrads,        // optim_grads: + gradients (ZeRO-2)
  OptimGradsParams,  // optim_grads_params: + parameters (ZeRO-3 / FSDP)
};
const char* dp_sharding_name(DpSharding s);
// optim_grads and optim_grads_params: the gradients are sharded too (ZeRO-2 and beyond).
inline bool shards_gradients(DpSharding s) { return s == DpSharding::OptimGrads || s == DpSharding::OptimGradsParams; }
// Every strategy but no_shard shards the optimizer state.
inline bool shards_optimizer(DpSharding s) { return s != DpSharding::NoShard; }
// The strategy a config asks for: data_parallel_sharding_strategy when set, else optim when
// use_distributed_optimizer is true (its older name), else no_shard. ConfigError naming both keys
// when they disagree, or naming the key for an unknown strategy.
DpSharding dp_sharding_from_config(const config::Value& params);

// The parallel dimensions a backend implements beyond data parallelism with ZeRO-1.
struct MeshSupport {
  const char* backend = "any backend";
  bool tensor = false;      // tensor_model_parallel_size > 1 and sequence_parallel
  bool sharded_dp = false;  // data_parallel_sharding_strategy optim_grads and optim_grads_params
  bool context = false;     // context_parallel_size > 1
  bool expert = false;      // expert_model_parallel_size > 1 (MoE models)
};
// What some backend implements (the check a config passes before its backend is known).
inline constexpr MeshSupport kAnyBackendMesh{"any backend", true, true, true, true};

struct ParallelSizes {
  std::array<int64_t, kNumDims> size{1, 1, 1, 1, 1};
  bool sequence_parallel = false;  // Megatron's sequence_parallel (needs tp > 1)
  DpSharding sharding = DpSharding::NoShard;
  int64_t& operator[](Dim d) { return size[static_cast<size_t>(d)]; }
  int64_t operator[](Dim d) const { return size[static_cast<size_t>(d)]; }
  int64_t product() const;
  // tp x cp x ep x pp: the ranks one data-parallel replica spans.
  int64_t model_parallel_product() const;
  // The keys add_parallel_schema declares, data_parallel_size (the training schema's) and the
  // sharding (dp_sharding_from_config).
  static ParallelSizes from_config(const config::Value& params);
  // These sizes with dp derived from the job's world size. ConfigError naming the keys when the
  // world is not divisible by tp x cp x ep x pp.
  ParallelSizes for_world(int64_t world) const;
  // ConfigError naming the key when the model cannot be split this way: attention heads or kv
  // groups (num_attention_heads, num_query_groups) not divisible by tp, seq_length not divisible
  // by 2 x cp (each context-parallel rank takes two chunks, for balance under the causal mask),
  // sequence_parallel without tp > 1.
  void check_model(int64_t num_attention_heads, int64_t num_query_groups, int64_t seq_length) const;
  // ConfigError naming the key for what `support` does not implement: a dimension other than dp
  // (and tp where supported) not 1, sequence_parallel without tensor support, the optim_grads /
  // optim_grads_params sharding strategies without sharded_dp.
  void check_implemented(const MeshSupport& support) const;
};

// tensor_model_parallel_size, context_parallel_size, pipeline_model_parallel_size,
// expert_model_parallel_size (Megatron's names; each 1 by default), sequence_parallel (false),
// data_parallel_sharding_strategy (unset: use_distributed_optimizer decides).
void add_parallel_schema(config::Schema& s);

// The mesh of a job of `world` ranks laid out as `sizes` (dp derived): the sizes, then one line
// per rank with its coordinates and the ranks of its tp, cp and dp groups. Worlds above
// `max_ranks` show the first and last max_ranks / 2 ranks and say how many were left out.
// ConfigError as for_world.
std::string describe_mesh(const ParallelSizes& sizes, int64_t world, int64_t max_ranks = 32);

class ParallelDims {
 public:
  // Checks the sizes (each >= 1, product = world) and places `rank`. ConfigError with the sizes
  // and the world when they do not fit. Any mesh: the arithmetic is the same for every dimension.
  ParallelDims(const ParallelSizes& sizes, int world, int rank);
  // What a trainer builds: the sizes must also be implemented by the backend (check_implemented),
  // the world and rank are the launch environment's (WORLD_SIZE, RANK).
  static ParallelDims from_launch(const ParallelSizes& sizes, const DistEnv& env, const MeshSupport& support);

  int world() const { return world_; }
  int rank() const { return rank_; }
  int64_t size(Dim d) const { return sizes_[d]; }
  int64_t coord(Dim d) const { return coords_[static_cast<size_t>(d)]; }
  const ParallelSizes& sizes() const { return sizes_; }
  // The ranks of this rank's group along `d` (the ranks that differ from it in coordinate d
  // only), in coordinate order.
  std::vector<int> group_ranks(Dim d) const;
  // The ranks that differ from this one in any of `dims` only, ascending (e.g. {EP, DP}: the
  // data-parallel replicas of the dense layers under expert parallelism).
  std::vector<int> group_ranks(std::initializer_list<Dim> dims) const;
  // The rank at the given coordinates.
  int rank_of(const std::array<int64_t, kNumDims>& coords) const;
  // A name for this rank's group along `d`, the same on every member and different for every
  // other group of the job ("tp0-1", "dp1-3"): the key prefix of the group's rendezvous.
  std::string group_name(Dim d) const;

  // The process group of dimension `d` (null until attached; a dimension of size 1 needs none).
  void set_group(Dim d, std::shared_ptr<ProcessGroup> pg) { groups_[static_cast<size_t>(d)] = std::move(pg); }
  ProcessGroup* group(Dim d) const { return groups_[static_cast<size_t>(d)].get(); }

  // "dp 2 (coordinate 1), tp 1, cp 1, ep 1, pp 1" for logs and errors.
  std::string describe() const;

 private:
  ParallelSizes sizes_;
  int world_ = 1, rank_ = 0;
  std::array<int64_t, kNumDims> coords_{};
  std::array<std::shared_ptr<ProcessGroup>, kNumDims> groups_{};
};

}  // namespace primus::parallel
