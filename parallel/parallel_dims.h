// How a job is laid out over its ranks: one mesh of parallel dimensions, Megatron's order
// (tensor fastest, then context, expert, data, pipeline), so rank r's coordinates are the digits
// of r in that mixed radix and users' mental model of Megatron's groups carries over:
//
//   rank = tp + TP * (cp + CP * (ep + EP * (dp + DP * pp)))
//
// The trainer builds it from the config's sizes and the launch environment (from_launch) and
// hands it to the model and to data parallelism; each dimension's process group (NCCL on GPUs,
// the socket engine on CPUs) is attached by whoever creates that engine (set_group). Only data
// parallelism is implemented: a tensor, context, pipeline or expert size other than 1 is a
// ConfigError naming the key, until the issues that implement them land.
#pragma once
#include <array>
#include <cstdint>
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

struct ParallelSizes {
  std::array<int64_t, kNumDims> size{1, 1, 1, 1, 1};
  int64_t& operator[](Dim d) { return size[static_cast<size_t>(d)]; }
  int64_t operator[](Dim d) const { return size[static_cast<size_t>(d)]; }
  int64_t product() const;
  // The keys add_parallel_schema declares, and data_parallel_size (the training schema's).
  static ParallelSizes from_config(const config::Value& params);
  // ConfigError naming the key when a dimension other than dp is not 1 (not implemented yet).
  void check_implemented() const;
};

// tensor_model_parallel_size, context_parallel_size, pipeline_model_parallel_size,
// expert_model_parallel_size (Megatron's names; each 1 by default).
void add_parallel_schema(config::Schema& s);

class ParallelDims {
 public:
  // Checks the sizes (each >= 1, product = world) and places `rank`. ConfigError with the sizes
  // and the world when they do not fit. Any mesh: the arithmetic is the same for every dimension.
  ParallelDims(const ParallelSizes& sizes, int world, int rank);
  // What a trainer builds: the sizes must also be implemented (check_implemented), the world and
  // rank are the launch environment's (WORLD_SIZE, RANK).
  static ParallelDims from_launch(const ParallelSizes& sizes, const DistEnv& env);

  int world() const { return world_; }
  int rank() const { return rank_; }
  int64_t size(Dim d) const { return sizes_[d]; }
  int64_t coord(Dim d) const { return coords_[static_cast<size_t>(d)]; }
  const ParallelSizes& sizes() const { return sizes_; }
  // The ranks of this rank's group along `d` (the ranks that differ from it in coordinate d
  // only), in coordinate order.
  std::vector<int> group_ranks(Dim d) const;
  // The rank at the given coordinates.
  int rank_of(const std::array<int64_t, kNumDims>& coords) const;

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
