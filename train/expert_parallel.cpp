#include "train/expert_parallel.h"

#include <fmt/format.h>

#include <algorithm>

#include "core/util/error.h"

namespace primus::train {

bool is_routed_expert_tensor(const std::string& name) { return name.find("moe.experts.") != std::string::npos; }

EpShardMap::EpShardMap(const ModelSpec& global, int ep, int rank) : ModelShardMap(global, ep, rank) {
  const int64_t E = global.moe.num_experts;
  if (ep < 1 || rank < 0 || rank >= ep) throw RuntimeError(fmt::format("expert parallelism: rank {} of {}", rank, ep));
  if (!global.moe.enabled() || global.num_moe_layers() == 0) {
    throw ConfigError(fmt::format("expert_model_parallel_size {}: the model has no MoE layers (num_experts, "
                                  "moe_layer_freq); leave it at 1",
                                  ep));
  }
  if (ep > 1 && global.moe.allgather_dispatcher) {
    throw ConfigError(fmt::format("moe_token_dispatcher_type 'allgather' with expert_model_parallel_size {} is not "
                                  "implemented: both backends send each token to its experts' ranks all-to-all; set "
                                  "alltoall (the same result)",
                                  ep));
  }
  if (E % ep != 0) {
    throw ConfigError(fmt::format("expert_model_parallel_size {} does not divide num_experts {}: every rank holds the "
                                  "same number of experts",
                                  ep, E));
  }
  local_.moe.local_experts = E / ep;
  local_.moe.first_expert = int64_t{rank} * (E / ep);
  global_layout_ = make_param_layout(global_);
  local_layout_ = make_param_layout(local_);
  if (local_layout_.tensors.size() != global_layout_.tensors.size())
    throw RuntimeError("expert parallelism: the local layout's tensors differ from the global one's");
  for (size_t i = 0; i < local_layout_.tensors.size(); ++i) {
    const ParamTensor& l = local_layout_.tensors[i];
    const ParamTensor& g = global_layout_.tensors[i];
    const bool expert = is_routed_expert_tensor(l.name);
    expert_.push_back(expert);
    // A stacked [E, ...] tensor: this rank's experts are one run of it.
    const int64_t skip = expert ? local_.moe.first_expert * (g.numel / E) : 0;
    pieces_.push_back({l.offset, g.offset + skip, l.numel, false});
    auto& runs = expert ? expert_runs_ : dense_runs_;
    if (!runs.empty() && runs.back().first + runs.back().second == l.offset) runs.back().second += l.numel;
    else runs.push_back({l.offset, l.numel});
  }
}

std::vector<TpPiece> EpShardMap::owned_pieces() const {
  if (rank_ == 0) return pieces_;
  std::vector<TpPiece> owned;
  for (size_t i = 0; i < pieces_.size(); ++i)
    if (expert_[i]) owned.push_back(pieces_[i]);
  return owned;
}

std::vector<TpPiece> EpShardMap::owned_pieces_of(int k) const {
  return k == rank_ ? owned_pieces() : EpShardMap(global_, size_, k).owned_pieces();
}

}  // namespace primus::train
