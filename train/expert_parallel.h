// How an MoE model's parameters split over an expert-parallel group of `ep` ranks, as Megatron's
// expert parallelism places them: rank r holds the routed experts [r E/ep, (r+1) E/ep) of every MoE
// layer (their gate/up and down projections); everything else, the router and its expert bias, the
// shared expert and every dense layer, is on every rank. The tokens a rank routes to another rank's
// experts travel there and back (all-to-all; the reference backend's MoeLayer).
//
// A rank's parameters are the model of `local_spec()` (moe.local_experts = E / ep, moe.first_expert
// its first), so its layout is make_param_layout of that spec. EpShardMap says where every element
// of that local buffer lives in the global one (the layout a single process and every checkpoint
// uses): initial weights are drawn once in the global layout and cut, and checkpoints are written
// in the global layout whatever the job's layout, so one saved under ep loads under any other.
#pragma once
#include <cstdint>
#include <vector>

#include "train/model_spec.h"
#include "train/param_layout.h"
#include "train/tensor_parallel.h"

namespace primus::train {

class EpShardMap {
 public:
  // ConfigError naming expert_model_parallel_size when the model has no MoE layers or ep does not
  // divide num_experts.
  EpShardMap(const ModelSpec& global, int ep, int rank);

  int ep() const { return ep_; }
  int rank() const { return rank_; }
  const ModelSpec& global_spec() const { return global_; }
  const ModelSpec& local_spec() const { return local_; }
  const ParamLayout& global_layout() const { return global_layout_; }
  const ParamLayout& local_layout() const { return local_layout_; }
  int64_t first_expert() const { return local_.moe.first_expert; }
  int64_t local_experts() const { return local_.moe.local_experts; }

  // Per tensor of the local layout (same order as the global one): a routed experts' tensor, whose
  // slice is this rank's alone (its replicas are the ranks that differ in dp only). The others are
  // the same on every rank of the group.
  bool expert_tensor(size_t tensor) const { return expert_.at(tensor); }
  // In local order; together exactly the local buffer (one piece per tensor).
  const std::vector<TpPiece>& pieces() const { return pieces_; }
  // The pieces this rank writes when the ranks' buffers are put together: its experts' slices, and
  // the tensors every rank holds on rank 0 only. Every global element is in one rank's owned pieces.
  std::vector<TpPiece> owned_pieces() const;
  // local[i] = global[where element i lives].
  void to_local(const float* global, float* local) const;
  // Writes this rank's elements into `global`; with owned_only, its owned_pieces() alone, so that
  // summing every rank's result over the group (zeros elsewhere) rebuilds the global buffer.
  void to_global(const float* local, float* global, bool owned_only) const;

 private:
  ModelSpec global_, local_;
  ParamLayout global_layout_, local_layout_;
  int ep_ = 1, rank_ = 0;
  std::vector<TpPiece> pieces_;
  std::vector<bool> expert_;
};

// Whether a layout tensor's name is a routed experts' stacked weight (moe.experts.*).
bool is_routed_expert_tensor(const std::string& name);

}  // namespace primus::train
