// How a model's parameters split over a tensor-parallel group of `tp` ranks, as Megatron splits
// them: the q/k/v and MLP gate/up projections column-parallel (each rank owns whole heads and a
// slice of the FFN width: row ranges of our [out, in] weights), the attention output and MLP down
// projections row-parallel (column ranges of theirs), the embedding and untied output head
// vocabulary-parallel (row ranges), and the norms, position embedding and row-parallel biases
// replicated. MoE layers as Megatron's expert tensor parallelism with the experts whole on every
// rank (expert_tensor_parallel_size = tp, no expert parallelism): every expert's (and the shared
// expert's) gate / up rows and down-projection columns split like the dense MLP's, the router and
// its expert bias replicated (every rank routes the whole batch alike).
//
// A rank's parameters are the model of `local_spec()` (heads / tp, query groups / tp, FFN / tp,
// padded vocabulary / tp, the head dimension pinned): a ModelShardMap (train/shard_map.h).
#pragma once
#include <cstdint>
#include <vector>

#include "train/model_spec.h"
#include "train/param_layout.h"
#include "train/shard_map.h"

namespace primus::train {

// One tensor's replicated key/value rows (tensor_model_parallel_size above num_query_groups): the
// global range [global_begin, global_begin + elems) covering every group's k|v rows, and this
// rank's shared pieces of it. Each rank's gradient of its pieces is the part its query heads give:
// summed over the group through a buffer laid out like the global range (every rank writes its
// pieces, zeros elsewhere; the ranks of one group write the same place), every replica gets the
// whole gradient.
struct TpKvExchange {
  size_t tensor = 0;
  int64_t global_begin = 0, elems = 0;
  std::vector<TpPiece> pieces;
};

class TpShardMap : public ModelShardMap {
 public:
  // ConfigError naming the key when the model cannot be split over `tp` ranks: heads, the FFN width
  // or the padded vocabulary not divisible by tp, query groups neither divisible by tp nor dividing
  // it, an expert's FFN width not divisible by tp, or a part of the model that has no
  // tensor-parallel form yet (a q/k norm over the whole projection).
  TpShardMap(const ModelSpec& global, int tp, int rank, bool sequence_parallel);

  int tp() const { return size_; }
  bool sequence_parallel() const { return sp_; }
  // The first vocabulary row (token id) this rank's embedding and head rows stand for.
  int64_t vocab_begin() const { return vocab_begin_; }

  // Per tensor of the local layout (same order as the global one): the same values on every tp
  // rank (norms, position embedding, row-parallel biases).
  bool replicated(size_t tensor) const { return replicated_.at(tensor); }
  // Per tensor: each rank's gradient is a part of the whole, to be summed over the tp group once
  // per step (the per-head q/k norm weights, shared by heads on every rank; the MoE router, whose
  // logits' gradient comes from each rank's part of the experts' outputs; with sequence
  // parallelism also the norms, each rank seeing its part of the sequence).
  bool partial_grad(size_t tensor) const { return partial_.at(tensor); }

  // Grouped-query attention with fewer key/value groups than ranks (tp a multiple of
  // num_query_groups, as Megatron replicates them): each rank holds one group, shared by
  // kv_replicas() consecutive ranks; 1 when the groups split. The gradient sums and the norm
  // counting those shared rows need (their first replica counts them).
  int kv_replicas() const { return kv_replicas_; }
  bool counts_kv() const { return rank_ % kv_replicas_ == 0; }
  const std::vector<TpKvExchange>& kv_exchanges() const { return kv_exchanges_; }

  // Its own slices, the replicated tensors on rank 0 only and the shared key/value rows on their
  // first replica.
  std::vector<TpPiece> owned_pieces() const override;
  std::vector<TpPiece> owned_pieces_of(int k) const override;

 private:
  bool sp_ = false;
  int64_t vocab_begin_ = 0;
  std::vector<bool> replicated_, partial_;
  int kv_replicas_ = 1;
  std::vector<TpKvExchange> kv_exchanges_;
};

}  // namespace primus::train
