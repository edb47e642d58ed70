// A rank's part of a model split over a group of ranks: tensor parallelism (train/tensor_parallel.h)
// or expert parallelism (train/expert_parallel.h). The rank's parameters are the model of
// local_spec(), so its layout is make_param_layout of that spec and the kernels run on it
// unchanged; pieces() say where every element of that local flat buffer lives in the global one
// (the layout a single process and every checkpoint uses). So initial weights are drawn once in the
// global layout and cut, checkpoints are written in the global layout whatever the job's layout,
// and a checkpoint loads under any other. The trainers handle either split through this interface.
#pragma once
#include <cstdint>
#include <vector>

#include "train/model_spec.h"
#include "train/param_layout.h"

namespace primus::train {

// A run of consecutive elements: local buffer [local, local + count) = global [global, ...).
// shared: a key/value group's rows that tp / num_query_groups ranks hold alike (TpShardMap).
struct TpPiece {
  int64_t local = 0, global = 0, count = 0;
  bool shared = false;
};

class ModelShardMap {
 public:
  virtual ~ModelShardMap() = default;

  int rank() const { return rank_; }
  int size() const { return size_; }  // the ranks the model is split over
  const ModelSpec& global_spec() const { return global_; }
  const ModelSpec& local_spec() const { return local_; }
  const ParamLayout& global_layout() const { return global_layout_; }
  const ParamLayout& local_layout() const { return local_layout_; }
  // In local order; together exactly the local buffer.
  const std::vector<TpPiece>& pieces() const { return pieces_; }
  // The pieces this rank writes when the ranks' buffers are put together: its own slices and what
  // several ranks hold alike on one of them (in local order, so also in global order). Every global
  // element is in exactly one rank's owned pieces.
  virtual std::vector<TpPiece> owned_pieces() const = 0;
  // Rank k's owned pieces (the same split for another rank of the group).
  virtual std::vector<TpPiece> owned_pieces_of(int k) const = 0;
  // local[i] = global[where element i lives].
  void to_local(const float* global, float* local) const;
  // Writes this rank's elements into `global`; with owned_only, its owned_pieces() alone, so that
  // summing every rank's result over the group (zeros elsewhere) rebuilds the global buffer.
  void to_global(const float* local, float* global, bool owned_only) const;

 protected:
  ModelShardMap(const ModelSpec& global, int size, int rank) : global_(global), local_(global), size_(size), rank_(rank) {}
  ModelSpec global_, local_;
  ParamLayout global_layout_, local_layout_;
  int size_ = 1, rank_ = 0;
  std::vector<TpPiece> pieces_;
};

}  // namespace primus::train
