// The collectives of the CUDA model's sharded data parallelism (fsdp.h): a unit's weights gathered
// from the owners' chunks into its place, its gradient reduce-scattered into the owners' averaged
// gradients, in the order of the model's stream.
//
// On NCCL they run on the group's stream, ordered by events, so they overlap the layers' work:
// the gather of layer l + 1, issued as layer l starts, waits for the model's work so far (the
// place it fills was last read by layer l - 1) and layer l + 1 waits for its event; a
// reduce-scatter issued when a layer's backward is done waits for that backward, then adds its
// chunk to the averaged gradient and clears the place on the group's stream, and the layer that
// writes the place next waits for it. Synchronous groups (the threaded group on one GPU, any group
// in host mode) synchronise the model's stream and are done when the call returns (group_order.h).
#pragma once
#include <cuda_runtime_api.h>

#include <array>
#include <functional>
#include <memory>

#include "backends/cuda/model/fsdp.h"
#include "backends/cuda/model/memory_plan.h"
#include "parallel/process_group.h"

namespace primus::parallel {
class NcclProcessGroup;
}

namespace primus::backends::cuda {

class FsdpComm {
 public:
  // `state`: the memory plan's (weights and grads are the units' places, shard_weights the bf16
  // chunks the gathers send, shard_grads the averaged gradient, fsdp_tmp one chunk). Throws
  // ConfigError when the group's size or rank differ from the plan's, or when a device model gets a
  // group that is neither NCCL nor the threaded one.
  FsdpComm(parallel::ProcessGroup& group, std::shared_ptr<const FsdpPlan> plan, const StateBuffers& state,
           const ModelStream& stream);
  ~FsdpComm();
  FsdpComm(const FsdpComm&) = delete;
  FsdpComm& operator=(const FsdpComm&) = delete;

  const FsdpPlan& plan() const { return *plan_; }
  int rank() const { return plan_->rank; }
  int size() const { return plan_->world; }

  // The decoder is about to run layer l (the forward from layer 0 up, the backward from the top
  // down): its weights are made present (gathered unless its place still holds them) and the next
  // layer's gather is issued. In the backward it also waits for the reduction of the place that
  // layer's gradients go to.
  void use_layer(int64_t l, bool backward);
  // Before each micro-batch's backward. optim (the gradients not sharded): `last` arms the
  // reductions, earlier micro-batches accumulate in the places. The other strategies reduce every
  // micro-batch.
  void begin_backward(bool last) { armed_ = last || plan_->shard_grads; }
  // The decoder's "gradients from `offset` up are final" report: the unit starting there is
  // reduce-scattered (mean) into the averaged gradient and its place cleared (optim: on the armed
  // micro-batch, straight into the averaged gradient, which zero_grad cleared; the places are
  // cleared by the next zero_grad).
  void grads_ready(int64_t offset);
  // After the backward: the model's stream waits for every reduction.
  void end_backward();
  // After the shard's weights changed (update, set_params): the resident units (the embeddings
  // and the top with optim_grads_params, every unit with optim_grads) gathered again; the layer
  // places forget what they held.
  void gather_resident();
  // t (f32) summed over the group in place (the gradient norm's squares).
  void all_reduce(const TensorView& t) const;
  // Every rank's `send` [n] into `recv` [world x n] (fp32; host copies of the shard).
  void all_gather(const TensorView& send, const TensorView& recv) const;

  // Expert parallelism beside the sharding (the group is then the ranks holding the same experts):
  // before a unit's reduce-scatter, `dense_mean(place)` averages the dense tensors' part of its
  // place over the ep group (in the model's stream order); after it, `expert_scale(chunk, stream)`
  // divides the experts' part of this rank's reduced chunk by ep, on the stream the reduction ran
  // on (null: the model's, synchronous). Indexed by unit.
  struct ExpertParallel {
    std::function<void(int unit, const TensorView& place)> dense_mean;
    std::function<void(int unit, const TensorView& chunk, cudaStream_t stream)> expert_scale;
  };
  void set_expert_parallel(ExpertParallel ep) { ep_ = std::move(ep); }

 private:
  void gather_unit(int u);
  void wait_event(cudaEvent_t e) const;
  void record(cudaEvent_t e) const;

  parallel::ProcessGroup& group_;
  parallel::NcclProcessGroup* nccl_ = nullptr;
  std::shared_ptr<const FsdpPlan> plan_;
  const StateBuffers& state_;
  ModelStream stream_;
  std::vector<int> layer_unit_;           // per layer: its unit
  std::array<int64_t, 2> held_{-1, -1};   // the layer each weight place holds (-1: none)
  std::array<cudaEvent_t, 2> gathered_{};  // NCCL: per weight place, its last gather
  std::array<cudaEvent_t, 3> reduced_{};   // NCCL: per gradient place (l % 3), its last reduction
  std::array<bool, 2> gather_pending_{false, false};
  std::array<bool, 3> reduce_pending_{false, false, false};
  bool armed_ = true;
  ExpertParallel ep_;
};

}  // namespace primus::backends::cuda
