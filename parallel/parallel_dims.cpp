#include "parallel/parallel_dims.h"

#include <fmt/format.h>

#include <algorithm>
#include <iterator>

#include "core/util/error.h"

namespace primus::parallel {

namespace {

constexpr Dim kDims[kNumDims] = {Dim::TP, Dim::CP, Dim::EP, Dim::DP, Dim::PP};

// Which issue brings each dimension, for the error a user sees today.
const char* not_yet(Dim d) {
  switch (d) {
    case Dim::TP: return "tensor parallelism is not implemented yet";
    case Dim::CP: return "context parallelism is not implemented yet";
    case Dim::EP: return "expert parallelism is not implemented yet";
    case Dim::PP: return "pipeline parallelism is not implemented yet";
    case Dim::DP: break;
  }
  return "";
}

const char* kShardingNames[] = {"no_shard", "optim", "optim_grads", "optim_grads_params"};

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

const char* dp_sharding_name(DpSharding s) { return kShardingNames[static_cast<size_t>(s)]; }

DpSharding dp_sharding_from_config(const config::Value& params) {
  const config::Value* strat = params.find_path("data_parallel_sharding_strategy");
  const config::Value* dist = params.find_path("use_distributed_optimizer");
  const bool zero1 = dist && !dist->is_null() && dist->as_bool();
  // Megatron-LM's use_torch_fsdp2: PyTorch's FSDP2, which shards parameters, gradients and the
  // optimizer state: optim_grads_params here.
  if (const config::Value* f = params.find_path("use_torch_fsdp2"); f && !f->is_null() && f->as_bool()) {
    if (strat && !strat->is_null() && strat->scalar_text() != "optim_grads_params")
      throw ConfigError(fmt::format("{}: use_torch_fsdp2: true shards parameters, gradients and optimizer state "
                                    "(data_parallel_sharding_strategy: optim_grads_params), but {} sets {}: set one "
                                    "of them",
                                    f->origin().str(), strat->origin().str(), strat->scalar_text()));
    return DpSharding::OptimGradsParams;
  }
  if (!strat || strat->is_null()) return zero1 ? DpSharding::Optim : DpSharding::NoShard;
  const std::string name = strat->scalar_text();
  for (size_t i = 0; i < std::size(kShardingNames); ++i) {
    if (name != kShardingNames[i]) continue;
    const auto s = static_cast<DpSharding>(i);
    // use_distributed_optimizer is ZeRO-1's older name: true beside a strategy that shards no
    // optimizer state is a contradiction, not a preference.
    if (zero1 && s == DpSharding::NoShard) {
      throw ConfigError("data_parallel_sharding_strategy is no_shard but use_distributed_optimizer is true (its older "
                        "name for optim): set one of them");
    }
    return s;
  }
  throw ConfigError(fmt::format("data_parallel_sharding_strategy: '{}' is not one of no_shard, optim, optim_grads, "
                                "optim_grads_params",
                                name));
}

int64_t ParallelSizes::model_parallel_product() const {
  return (*this)[Dim::TP] * (*this)[Dim::CP] * (*this)[Dim::EP] * (*this)[Dim::PP];
}

ParallelSizes ParallelSizes::for_world(int64_t world) const {
  for (Dim d : kDims) {
    if (d != Dim::DP && (*this)[d] < 1) {
      throw ConfigError(fmt::format("{} must be at least 1, got {}", dim_config_key(d), (*this)[d]));
    }
  }
  const int64_t m = model_parallel_product();
  if (world < 1 || world % m != 0) {
    throw ConfigError(fmt::format("the world size {} is not divisible by tensor_model_parallel_size {} x "
                                  "context_parallel_size {} x expert_model_parallel_size {} x "
                                  "pipeline_model_parallel_size {} = {}",
                                  world, (*this)[Dim::TP], (*this)[Dim::CP], (*this)[Dim::EP], (*this)[Dim::PP], m));
  }
  ParallelSizes s = *this;
  s[Dim::DP] = world / m;
  return s;
}

void ParallelSizes::check_model(int64_t heads, int64_t kv_groups, int64_t seq_length) const {
  const int64_t tp = (*this)[Dim::TP], cp = (*this)[Dim::CP];
  if (tp > 1 && heads % tp != 0) {
    throw ConfigError(fmt::format("tensor_model_parallel_size {} does not divide num_attention_heads {}: each tp rank "
                                  "takes whole heads",
                                  tp, heads));
  }
  // Fewer groups than ranks: each group replicated on tp / groups ranks (train/tensor_parallel.h).
  if (tp > 1 && kv_groups % tp != 0 && (tp < kv_groups || tp % kv_groups != 0)) {
    throw ConfigError(fmt::format("tensor_model_parallel_size {} neither divides num_query_groups {} (the key/value "
                                  "heads: each tp rank takes whole groups) nor is a multiple of it (each group "
                                  "replicated on tp / num_query_groups ranks)",
                                  tp, kv_groups));
  }
  if (cp > 1 && seq_length % (2 * cp) != 0) {
    throw ConfigError(fmt::format("context_parallel_size {}: seq_length {} is not divisible by 2 x {} (each cp rank "
                                  "takes two chunks of the sequence, balancing the causal mask)",
                                  cp, seq_length, cp));
  }
  if (sequence_parallel && tp == 1) {
    throw ConfigError("sequence_parallel needs tensor_model_parallel_size > 1 (it splits the sequence over the tp group)");
  }
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
  if (const config::Value* v = params.find_path("sequence_parallel"); v && !v->is_null()) s.sequence_parallel = v->as_bool();
  // Over a tp group of one there is no sequence to split: Megatron-LM turns the switch off there too
  // (TrainingArgs logs it), so a config written for any tp size carries over.
  if (s[Dim::TP] == 1) s.sequence_parallel = false;
  s.sharding = dp_sharding_from_config(params);
  return s;
}

void ParallelSizes::check_implemented(const MeshSupport& support) const {
  for (Dim d : kDims) {
    if (d == Dim::DP || (d == Dim::TP && support.tensor) || (d == Dim::CP && support.context) ||
        (d == Dim::EP && support.expert))
      continue;
    if ((*this)[d] != 1) {
      throw ConfigError(fmt::format("{}: {} is {}, but {}{}; leave {} at 1", dim_config_key(d), dim_name(d), (*this)[d],
                                    not_yet(d),
                                    d == Dim::TP || d == Dim::CP || d == Dim::EP ? fmt::format(" on {}", support.backend)
                                                                                 : "",
                                    dim_config_key(d)));
    }
  }
  if (sequence_parallel && !support.tensor) {
    throw ConfigError(fmt::format("sequence_parallel: sequence parallelism is not implemented yet on {} (it goes "
                                  "with tensor parallelism); leave sequence_parallel false",
                                  support.backend));
  }
  if (shards_gradients(sharding) && !support.sharded_dp) {
    throw ConfigError(fmt::format("data_parallel_sharding_strategy: {} ({}) is not implemented yet on {}; no_shard "
                                  "and optim (ZeRO-1) are",
                                  dp_sharding_name(sharding),
                                  sharding == DpSharding::OptimGrads ? "sharded gradients, ZeRO-2"
                                                                     : "sharded parameters, ZeRO-3 / FSDP",
                                  support.backend));
  }
}

void add_parallel_schema(config::Schema& s) {
  s.integer("tensor_model_parallel_size", 1,
            "tensor-parallel ranks (Megatron's column/row-parallel linears; the reference backend)", 1)
      .integer("context_parallel_size", 1,
               "context-parallel ranks: ring attention over sequences split in 2 x cp balanced chunks (the reference "
               "backend)",
               1)
      .flag("sequence_parallel", false,
            "sequence parallelism over the tp group: norms and residuals on a slice of the sequence; with "
            "tensor_model_parallel_size 1 it is turned off (logged), as Megatron-LM does")
      .flag("use_torch_fsdp2", false,
            "Megatron-LM's switch for PyTorch's FSDP2: true shards parameters, gradients and optimizer state over the "
            "data-parallel ranks, as data_parallel_sharding_strategy: optim_grads_params")
      .text("data_parallel_sharding_strategy", std::nullopt,
            "what the data-parallel ranks shard: no_shard, optim (ZeRO-1; unset: use_distributed_optimizer decides), "
            "optim_grads (ZeRO-2), optim_grads_params (ZeRO-3 / FSDP)",
            {"no_shard", "optim", "optim_grads", "optim_grads_params"})
      .integer("pipeline_model_parallel_size", 1, "pipeline stages (only 1 is implemented)", 1)
      .integer("expert_model_parallel_size", 1,
               "expert-parallel ranks: each holds num_experts / ep of every MoE layer's experts, the tokens go to "
               "their experts' ranks and back (all-to-all); carved from the data-parallel ranks, as Megatron's",
               1);
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

ParallelDims ParallelDims::from_launch(const ParallelSizes& sizes, const DistEnv& env, const MeshSupport& support) {
  sizes.check_implemented(support);
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

std::vector<int> ParallelDims::group_ranks(std::initializer_list<Dim> dims) const {
  std::vector<int> out{rank_};
  for (Dim d : dims) {
    std::vector<int> next;
    for (int r : out) {
      ParallelDims at(sizes_, world_, r);
      for (int x : at.group_ranks(d)) next.push_back(x);
    }
    out.swap(next);
  }
  std::sort(out.begin(), out.end());
  out.erase(std::unique(out.begin(), out.end()), out.end());
  return out;
}

std::string ParallelDims::group_name(Dim d) const {
  std::string s = dim_name(d);
  const auto ranks = group_ranks(d);
  // First and last rank plus the stride identify the group (its ranks are an arithmetic series).
  s += std::to_string(ranks.front());
  if (ranks.size() > 1) s += fmt::format("-{}", ranks.back());
  return s;
}

std::string describe_mesh(const ParallelSizes& sizes, int64_t world, int64_t max_ranks) {
  const ParallelSizes s = sizes.for_world(world);
  std::string out = fmt::format("  mesh:      {} ranks = tp {} x cp {} x dp {}", world, s[Dim::TP], s[Dim::CP], s[Dim::DP]);
  if (s[Dim::EP] > 1 || s[Dim::PP] > 1) out += fmt::format(" x ep {} x pp {}", s[Dim::EP], s[Dim::PP]);
  out += fmt::format(" (rank = tp + {} x (cp + {} x {}), tp fastest as Megatron); sequence_parallel {}, "
                     "data_parallel_sharding_strategy {}\n",
                     s[Dim::TP], s[Dim::CP], s[Dim::EP] > 1 ? fmt::format("(ep + {} x dp)", s[Dim::EP]) : "dp",
                     s.sequence_parallel ? "true" : "false", dp_sharding_name(s.sharding));
  if (s[Dim::EP] > 1) {
    out += fmt::format("             expert parallel: each rank holds 1/{} of the experts; the dense layers' replicas are "
                       "the {} ranks of ep x dp (data_parallel_size), each expert's the {} of dp\n",
                       s[Dim::EP], s[Dim::EP] * s[Dim::DP], s[Dim::DP]);
  }
  auto ranks_text = [](const std::vector<int>& r) {
    std::string t = "[";
    for (size_t i = 0; i < r.size(); ++i) t += (i ? "," : "") + std::to_string(r[i]);
    return t + "]";
  };
  const int64_t half = std::max<int64_t>(1, max_ranks / 2);
  for (int64_t r = 0; r < world; ++r) {
    if (world > max_ranks && r == half) {
      out += fmt::format("    ... {} ranks left out ...\n", world - 2 * half);
      r = world - half - 1;
      continue;
    }
    const ParallelDims d(s, static_cast<int>(world), static_cast<int>(r));
    out += fmt::format("    rank {:>4}: tp {} cp {} dp {}", r, d.coord(Dim::TP), d.coord(Dim::CP), d.coord(Dim::DP));
    if (s[Dim::EP] > 1 || s[Dim::PP] > 1) out += fmt::format(" ep {} pp {}", d.coord(Dim::EP), d.coord(Dim::PP));
    out += fmt::format("  tp group {}  cp group {}  dp group {}", ranks_text(d.group_ranks(Dim::TP)),
                       ranks_text(d.group_ranks(Dim::CP)), ranks_text(d.group_ranks(Dim::DP)));
    if (s[Dim::EP] > 1) out += fmt::format("  ep group {}", ranks_text(d.group_ranks(Dim::EP)));
    out += "\n";
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
