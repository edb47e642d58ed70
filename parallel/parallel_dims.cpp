#include "parallel/parallel_dims.h"

#include <fmt/format.h>

#include "core/util/error.h"

namespace primus::parallel {

namespace {

constexpr Dim kDims[kNumDims] = {Dim::TP, Dim::CP, Dim::EP, Dim::DP, Dim::PP};

// Which issue brings each dimension, for the error a user sees today.
const char* not_yet(Dim d) {
  switch (d) {
    case Dim::TP: return "tensor parallelism is not implemented yet (planned with the [mesh] work)";
    case Dim::CP: return "context parallelism is not implemented yet (planned with the [mesh] work)";
    case Dim::EP: return "expert parallelism is not implemented yet (it needs mixture-of-experts models)";
    case Dim::PP: return "pipeline parallelism is not implemented yet";
    case Dim::DP: break;
  }
  return "";
}

std::string describe_sizes(const ParallelSizes& s) {
  return fmt::format("{} {}, {} {}, {} {}, {} {}, {} {}", dim_config_key(Dim::DP), s[Dim::DP], dim_config_key(Dim::TP),
                     s[Dim::TP], dim_config_key(Dim::CP), s[Dim::CP], dim_config_key(Dim::EP), s[Dim::EP],
                     dim_config_key(Dim::PP), s[Dim::PP]);
}

}  // namespace

const char* dim_name(Dim d) {
  switch (d) {
    case Dim::TP: return "tp";
    case Dim::CP: return "cp";
    case Dim::EP: return "ep";
    case Dim::DP: return "dp";
    case Dim::PP: return "pp";
  }
  return "?";
}

const char* dim_config_key(Dim d) {
  switch (d) {
    case Dim::TP: return "tensor_model_parallel_size";
    case Dim::CP: return "context_parallel_size";
    case Dim::EP: return "expert_model_parallel_size";
    case Dim::DP: return "data_parallel_size";
    case Dim::PP: return "pipeline_model_parallel_size";
  }
  return "?";
}

int64_t ParallelSizes::product() const {
  int64_t p = 1;
  for (int64_t s : size) p *= s;
  return p;
}

ParallelSizes ParallelSizes::from_config(const config::Value& params) {
  ParallelSizes s;
  for (Dim d : kDims) {
    if (const config::Value* v = params.find_path(dim_config_key(d)); v && !v->is_null()) s[d] = v->as_int();
  }
  return s;
}

void ParallelSizes::check_implemented() const {
  for (Dim d : kDims) {
    if (d == Dim::DP) continue;
    if ((*this)[d] != 1) {
      throw ConfigError(fmt::format("{}: {} is {}, but {}; only data parallelism can span ranks today (leave {} at 1)",
                                    dim_config_key(d), dim_name(d), (*this)[d], not_yet(d), dim_config_key(d)));
    }
  }
}

void add_parallel_schema(config::Schema& s) {
  s.integer("tensor_model_parallel_size", 1, "tensor-parallel ranks (only 1 is implemented)", 1)
      .integer("context_parallel_size", 1, "context-parallel ranks (only 1 is implemented)", 1)
      .integer("pipeline_model_parallel_size", 1, "pipeline stages (only 1 is implemented)", 1)
      .integer("expert_model_parallel_size", 1, "expert-parallel ranks (only 1 is implemented)", 1);
}

ParallelDims::ParallelDims(const ParallelSizes& sizes, int world, int rank) : sizes_(sizes), world_(world), rank_(rank) {
  for (Dim d : kDims) {
    if (sizes_[d] < 1) throw ConfigError(fmt::format("{} must be at least 1, got {}", dim_config_key(d), sizes_[d]));
  }
  if (sizes_.product() != world_) {
    throw ConfigError(fmt::format("the parallel layout ({}) needs {} ranks, but the job has {}",
                                  describe_sizes(sizes_), sizes_.product(), world_));
  }
  if (rank_ < 0 || rank_ >= world_) throw ConfigError(fmt::format("rank {} is outside the job's {} ranks", rank_, world_));
  int64_t r = rank_;
  for (Dim d : kDims) {
    coords_[static_cast<size_t>(d)] = r % sizes_[d];
    r /= sizes_[d];
  }
}

ParallelDims ParallelDims::from_launch(const ParallelSizes& sizes, const DistEnv& env) {
  sizes.check_implemented();
  return ParallelDims(sizes, env.world_size, env.rank);
}

int ParallelDims::rank_of(const std::array<int64_t, kNumDims>& coords) const {
  int64_t r = 0;
  for (int i = kNumDims - 1; i >= 0; --i) r = r * sizes_[kDims[i]] + coords[static_cast<size_t>(kDims[i])];
  return static_cast<int>(r);
}

std::vector<int> ParallelDims::group_ranks(Dim d) const {
  std::vector<int> out;
  std::array<int64_t, kNumDims> c = coords_;
  for (int64_t i = 0; i < sizes_[d]; ++i) {
    c[static_cast<size_t>(d)] = i;
    out.push_back(rank_of(c));
  }
  return out;
}

std::string ParallelDims::describe() const {
  std::string s;
  for (Dim d : {Dim::DP, Dim::TP, Dim::CP, Dim::EP, Dim::PP}) {
    if (!s.empty()) s += ", ";
    s += fmt::format("{} {}", dim_name(d), sizes_[d]);
    if (sizes_[d] > 1) s += fmt::format(" (coordinate {})", coords_[static_cast<size_t>(d)]);
  }
  return s;
}

}  // namespace primus::parallel
