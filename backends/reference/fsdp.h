// Sharded data parallelism on the reference backend: Megatron's data_parallel_sharding_strategy
// optim_grads (ZeRO-2) and optim_grads_params (ZeRO-3 / FSDP), over the data-parallel group.
//
// The model's flat buffer is cut into units, FSDP's wrapped modules: unit 0 is everything outside
// the transformer layers (embeddings, final norm, head), unit 1 + l is layer l. Each unit's
// elements are split evenly over the dp ranks; a rank owns one slice of every unit, and for its
// slices only it keeps the fp32 master weights, the averaged gradient and AdamW's moments.
//
// - Gradients (both strategies): when a unit's backward is done (the model's grads_ready), its
//   gradient is reduce-scattered (mean over ranks) into the owners' slices, accumulated over
//   micro-batches, and the unit's full gradient is zeroed and its pages given back.
// - Parameters (optim_grads_params): a unit's weights are all-gathered from the owners right
//   before the unit's forward or backward and given back right after, so a rank holds its slices
//   plus one unit at a time. With optim_grads every rank keeps the whole model, all-gathered once
//   after each optimizer step.
//
// "Given back" is madvise(MADV_DONTNEED) on the whole pages inside the unit: the memory returns to
// the system and reads as zeros until the next gather writes it. The collectives of the CPU
// process groups block, so a gather cannot run ahead of the layer before it (the one-layer
// prefetch belongs to backends whose collectives are asynchronous).
#pragma once
#include <cstdint>
#include <vector>

#include "backends/reference/model.h"
#include "parallel/data_parallel.h"
#include "parallel/process_group.h"

namespace primus::backends::reference {

class ReferenceFsdp final : public GptModel<float>::ShardingHooks {
 public:
  // `shard_params`: optim_grads_params (else optim_grads). The model's weights are not read yet:
  // adopt_params() takes the owned slices once the weights are final (initialised or loaded).
  ReferenceFsdp(GptModel<float>& model, parallel::ProcessGroup& dp, bool shard_params);

  // The local-buffer elements this rank owns, in the order of the shard buffers below; and the
  // same for any rank (checkpoint shard files describe every rank's).
  const std::vector<parallel::FlatSegment>& owned() const { return owned_[static_cast<size_t>(rank_)]; }
  const std::vector<parallel::FlatSegment>& owned(int rank) const { return owned_.at(static_cast<size_t>(rank)); }
  int64_t owned_count() const { return owned_count_; }

  // Master weights and averaged gradient of the owned elements.
  std::vector<float>& param_shard() { return param_shard_; }
  std::vector<float>& grad_shard() { return grad_shard_; }

  // Copies the owned slices out of the model's (whole) weights; with shard_params then gives
  // every unit back.
  void adopt_params();
  // Zeroes the gradient slices (the model's gradients are zero already: each unit's is zeroed
  // once it is reduced).
  void begin_step();
  // After the optimizer updated param_shard(): optim_grads all-gathers every unit into the model.
  void end_step();
  // Every unit's weights into the model (checkpoints, sampling): with shard_params they stay until
  // the next release_all(); optim_grads has them whole already.
  void gather_all();
  void release_all();
  // A whole local buffer from every rank's slices of it (e.g. AdamW's moments), all ranks calling.
  std::vector<float> full(const std::vector<float>& shard);

  void gather(int unit) override;
  void release(int unit) override;
  void grads_ready(int unit) override;

 private:
  struct Unit {
    std::vector<parallel::FlatSegment> segments;  // of the local buffer
    int64_t size = 0, chunk = 0;                  // elements; per rank (the last rank's padded)
    int64_t shard_offset = 0;                     // where this rank's slice starts in the shard buffers
  };
  // Elements [a, b) of the unit (its segments concatenated) as local-buffer segments.
  std::vector<parallel::FlatSegment> unit_range(const Unit& u, int64_t a, int64_t b) const;
  // The unit's (every unit's) weights from every rank's slice into the model.
  void all_gather_unit(int unit);
  void all_gather_units();
  // Elements of the unit this rank owns.
  int64_t my_count(const Unit& u) const;
  // The unit's elements from every rank's slice of `shard` (indexed like param_shard_) into the
  // local-buffer positions of `dst`.
  void gather_unit_into(const std::vector<float>& shard, float* dst, const Unit& u);
  void give_back(float* base, const std::vector<parallel::FlatSegment>& segs) const;

  GptModel<float>& model_;
  parallel::ProcessGroup& pg_;
  bool shard_params_;
  int rank_ = 0, world_ = 1;
  std::vector<Unit> units_;
  std::vector<std::vector<parallel::FlatSegment>> owned_;  // per rank
  int64_t owned_count_ = 0;
  std::vector<float> param_shard_, grad_shard_, staging_, mine_;
};

}  // namespace primus::backends::reference
