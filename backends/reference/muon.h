// Muon on the reference backend: the transformer layers' weight matrices (train/muon_layout.h)
// take Muon's update (turbo/kernels/cpu/muon.h), AdamW the rest (the trainer's loop, which skips
// the tensors for which `is_muon` is true).
//
// With ZeRO-1 the Newton-Schulz work and the momentum are sharded by whole tensors: each rank
// owns the tensors assign_muon_owners gives it (balanced by size), keeps their momentum only,
// orthogonalises them from the all-reduced gradient (Newton-Schulz needs the whole matrix, so the
// gradients of a Muon run are all-reduced, not reduce-scattered), and broadcasts the new weights;
// AdamW's moments stay in the flat ZeRO-1 shards. Without ZeRO-1 every rank updates every tensor.
//
// Checkpoints hold the momentum as one flat state "muon_momentum" of the layout's size (zero
// outside Muon's tensors), sharded like the AdamW moments with ZeRO-1, so any world size loads it.
#pragma once
#include <filesystem>
#include <vector>

#include "io/checkpoint.h"
#include "parallel/process_group.h"
#include "train/muon_layout.h"
#include "train/shard_map.h"
#include "train/training_args.h"

namespace primus::backends::reference {

class MuonOptimizer {
 public:
  // sharded: ZeRO-1 over pg's ranks (whole tensors per rank); else this rank updates them all.
  MuonOptimizer(const train::ModelSpec& spec, const train::ParamLayout& layout, int rank, int world, bool sharded);

  bool is_muon(size_t tensor_index) const { return mask_[tensor_index]; }
  // One Muon step of the tensors this rank owns, from the full averaged gradient.
  void update(float* params, const float* grads, const train::OptimizerArgs& o, double lr, double grad_scale);
  // ZeRO-1: every rank receives every owner's new weights.
  void share(parallel::ProcessGroup& pg, float* params) const;

  // The flat momentum of the whole layout (zeros outside this rank's tensors; with ZeRO-1 summed
  // over the ranks, so every rank has all of it): what a checkpoint saves.
  std::vector<float> flat_momentum(parallel::ProcessGroup& pg) const;
  // Reads this rank's tensors' momentum from a checkpoint (any world size that saved it); with a
  // shard map (expert parallelism) the checkpoint holds the global layout and the tensors are read
  // where the map puts this rank's elements.
  void load(const io::CheckpointData& data, const std::filesystem::path& dir, const train::ModelShardMap* map = nullptr);

  size_t state_bytes() const { return momentum_.capacity() * sizeof(float); }
  const std::vector<train::MuonTensor>& tensors() const { return tensors_; }
  static constexpr const char* kStateName = "muon_momentum";

 private:
  const train::ParamLayout& layout_;
  std::vector<train::MuonTensor> tensors_;
  std::vector<bool> mask_;
  std::vector<size_t> mine_;        // indices into tensors_ this rank updates
  std::vector<int64_t> mine_off_;   // their offsets in momentum_
  std::vector<float> momentum_;     // this rank's tensors, concatenated in layout order
  int rank_ = 0;
  bool sharded_ = false;
};

}  // namespace primus::backends::reference
