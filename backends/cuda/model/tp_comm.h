// The CUDA model's tensor-parallel group (Megatron's tensor parallelism, train/tensor_parallel.h):
// the collectives the decoder runs between its rank-local GEMMs, on the model's own buffers and in
// the order of its stream (group_order.h: NCCL through events, a synchronous group after a stream
// synchronisation).
#pragma once
#include <memory>

#include "backends/cuda/model/memory_plan.h"
#include "parallel/process_group.h"
#include "train/tensor_parallel.h"

namespace primus::parallel {
class NcclProcessGroup;
}

namespace primus::backends::cuda {

class TpComm {
 public:
  // Throws ConfigError when the group's size or rank differ from the map's, or when a device
  // model gets a group that is neither NCCL nor the threaded one.
  TpComm(parallel::ProcessGroup& group, std::shared_ptr<const train::TpShardMap> map, const ModelStream& stream);

  int rank() const { return map_->rank(); }
  int size() const { return map_->tp(); }
  const train::TpShardMap& map() const { return *map_; }

  // t (f32 or bf16, contiguous) summed over the group, in place.
  void all_reduce(const TensorView& t) const;
  // recv [size x send] = every rank's send, in rank order.
  void all_gather(const TensorView& send, const TensorView& recv) const;
  // Sequence parallelism. rows: a [R, cols] view, R a multiple of size(), its rows `pitch` elements
  // apart (its stride, which may exceed cols: the padded norm outputs). gather_rows: every rank's
  // R / size() rows at rank x R / size() to every rank, in place; reduce_scatter_rows: the sum over
  // the group of all R rows, rank r's share written over its own rows (the others keep their parts).
  void gather_rows(const TensorView& rows) const;
  void reduce_scatter_rows(const TensorView& rows) const;

 private:
  template <class F>
  void ordered(F&& call) const;

  parallel::ProcessGroup& group_;
  parallel::NcclProcessGroup* nccl_ = nullptr;
  std::shared_ptr<const train::TpShardMap> map_;
  ModelStream stream_;
};

}  // namespace primus::backends::cuda
