// How an MoE model's parameters split over an expert-parallel group of `ep` ranks, as Megatron's
// expert parallelism places them: rank r holds the routed experts [r E/ep, (r+1) E/ep) of every MoE
// layer (their gate/up and down projections); everything else, the router and its expert bias, the
// shared expert and every dense layer, is on every rank. The tokens a rank routes to another rank's
// experts travel there and back (all-to-all; the reference backend's MoeLayer).
//
// A rank's parameters are the model of `local_spec()` (moe.local_experts = E / ep, moe.first_expert
// its first): a ModelShardMap (train/shard_map.h), so a checkpoint saved under ep loads under any
// other layout.
#pragma once
#include <cstdint>
#include <utility>
#include <vector>

#include "train/model_spec.h"
#include "train/param_layout.h"
#include "train/shard_map.h"

namespace primus::train {

class EpShardMap : public ModelShardMap {
 public:
  // ConfigError naming expert_model_parallel_size when the model has no MoE layers or ep does not
  // divide num_experts.
  EpShardMap(const ModelSpec& global, int ep, int rank);

  int ep() const { return size_; }
  int64_t first_expert() const { return local_.moe.first_expert; }
  int64_t local_experts() const { return local_.moe.local_experts; }

  // Per tensor of the local layout (same order as the global one): a routed experts' tensor, whose
  // slice is this rank's alone (its replicas are the ranks that differ in dp only). The others are
  // the same on every rank of the group.
  bool expert_tensor(size_t tensor) const { return expert_.at(tensor); }
  // The local layout's runs of consecutive routed experts' tensors (experts) or of the others, as
  // (offset, count): what the gradients' two reductions walk.
  const std::vector<std::pair<int64_t, int64_t>>& runs(bool experts) const { return experts ? expert_runs_ : dense_runs_; }
  // Its experts' slices, and the tensors every rank holds on rank 0 only (one piece per tensor).
  std::vector<TpPiece> owned_pieces() const override;
  std::vector<TpPiece> owned_pieces_of(int k) const override;

 private:
  std::vector<bool> expert_;
  std::vector<std::pair<int64_t, int64_t>> expert_runs_, dense_runs_;
};

// Whether a layout tensor's name is a routed experts' stacked weight (moe.experts.*).
bool is_routed_expert_tensor(const std::string& name);

}  // namespace primus::train
