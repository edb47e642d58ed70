#include "backends/cuda/model/fsdp_comm.h"

#include <fmt/format.h>

#include <cstring>

#include "backends/cuda/model/group_order.h"
#include "core/util/error.h"
#include "parallel/cuda/nccl_process_group.h"
#include "turbo/core/cuda_check.h"
#include "turbo/kernels/cuda/elementwise.h"

namespace primus::backends::cuda {
FsdpComm::FsdpComm(parallel::ProcessGroup& group, std::shared_ptr<const FsdpPlan> plan, const StateBuffers& state,
                   const ModelStream& stream)
    : group_(group), plan_(std::move(plan)), state_(state), stream_(stream) {
  if (group_.world_size() != plan_->world || group_.rank() != plan_->rank) {
    throw ConfigError(fmt::format("sharded data parallelism: the group has rank {} of {}, the plan rank {} of {}",
                                  group_.rank(), group_.world_size(), plan_->rank, plan_->world));
  }
  nccl_ = device_group(group_, stream_, "sharded data parallelism");
  for (size_t u = 0; u < plan_->units.size(); ++u) {
    const int64_t l = plan_->units[u].layer;
    if (l < 0) continue;
    if (size_t(l) >= layer_unit_.size()) layer_unit_.resize(size_t(l) + 1, -1);
    layer_unit_[size_t(l)] = static_cast<int>(u);
  }
  if (nccl_) {
    for (cudaEvent_t& e : gathered_) CUDA_CHECK(cudaEventCreateWithFlags(&e, cudaEventDisableTiming));
    for (cudaEvent_t& e : reduced_) CUDA_CHECK(cudaEventCreateWithFlags(&e, cudaEventDisableTiming));
  }
}

FsdpComm::~FsdpComm() {
  for (cudaEvent_t e : gathered_)
    if (e) cudaEventDestroy(e);
  for (cudaEvent_t e : reduced_)
    if (e) cudaEventDestroy(e);
}

void FsdpComm::record(cudaEvent_t e) const { CUDA_CHECK(cudaEventRecord(e, nccl_->stream())); }
void FsdpComm::wait_event(cudaEvent_t e) const { CUDA_CHECK(cudaStreamWaitEvent(stream_.stream, e, 0)); }

void FsdpComm::gather_unit(int ui) {
  const FsdpUnit& u = plan_->units[size_t(ui)];
  // The send buffer: the bf16 chunk on the device, the fp32 master chunk in host mode (where the
  // compute weights are fp32).
  const TensorView& src = stream_.host ? state_.master : state_.shard_weights;
  const TensorView send = src.slice0(u.shard, u.shard + u.chunk);
  const TensorView recv = state_.weights.slice0(u.weight_base, u.weight_base + plan_->span(u));
  const parallel::DType dt = comm_dtype(send, "sharded data parallelism: a unit's gather");
  issue_in_order(nccl_, stream_, [&] { group_.all_gather(send.data, recv.data, size_t(u.chunk), dt); });
}

void FsdpComm::use_layer(int64_t l, bool backward) {
  const FsdpPlan& p = *plan_;
  const int w = static_cast<int>(l % 2);
  if (backward && nccl_ && p.shard_grads) {
    // Layer l writes gradient places l % 3 and (l - 1) % 3: the last reductions of them (layers
    // l + 3 and l + 2) are done before it starts.
    const int g = static_cast<int>((l + 2) % 3);
    if (reduce_pending_[size_t(g)]) wait_event(reduced_[size_t(g)]);
  }
  if (!p.shard_params) return;
  if (held_[size_t(w)] != l) {
    gather_unit(layer_unit_.at(size_t(l)));
    held_[size_t(w)] = l;
    if (nccl_) {
      record(gathered_[size_t(w)]);
      gather_pending_[size_t(w)] = true;
    }
  }
  if (nccl_ && gather_pending_[size_t(w)]) {
    wait_event(gathered_[size_t(w)]);
    gather_pending_[size_t(w)] = false;
  }
  // Prefetch: the next layer into the other place (last read by layer l -/+ 1, whose work is on the
  // model's stream already).
  const int64_t next = backward ? l - 1 : l + 1;
  if (next < 0 || next >= int64_t(layer_unit_.size())) return;
  const int nw = 1 - w;
  if (held_[size_t(nw)] == next) return;
  gather_unit(layer_unit_.at(size_t(next)));
  held_[size_t(nw)] = next;
  if (nccl_) {
    record(gathered_[size_t(nw)]);
    gather_pending_[size_t(nw)] = true;
  }
}

void FsdpComm::grads_ready(int64_t offset) {
  const int ui = plan_->unit_at(offset);
  if (ui < 0) throw RuntimeError(fmt::format("fsdp: no unit starts at the ready point {}", offset));
  const FsdpUnit& u = plan_->units[size_t(ui)];
  const TensorView place = state_.grads.slice0(u.grad_base, u.grad_base + plan_->span(u));
  const TensorView acc = state_.shard_grads.slice0(u.shard, u.shard + u.chunk);
  // The reduction's follow-up kernels run where it did: the group's stream, or the model's after a
  // synchronous collective.
  const cudaStream_t s = stream_.host ? cudaStream_t{} : nccl_ ? nccl_->stream() : stream_.stream;
  if (!plan_->shard_grads) {
    if (!armed_) return;
    if (ep_.dense_mean) ep_.dense_mean(ui, place);
    issue_in_order(nccl_, stream_, [&] {
      group_.reduce_scatter(place.data, acc.data, size_t(u.chunk), parallel::DType::F32, parallel::ReduceOp::Avg);
      if (ep_.expert_scale) ep_.expert_scale(ui, acc, s);
    });
    return;
  }
  const TensorView tmp = state_.fsdp_tmp.slice0(0, u.chunk);
  if (ep_.dense_mean) ep_.dense_mean(ui, place);
  issue_in_order(nccl_, stream_, [&] {
    group_.reduce_scatter(place.data, tmp.data, size_t(u.chunk), parallel::DType::F32, parallel::ReduceOp::Avg);
    if (ep_.expert_scale) ep_.expert_scale(ui, tmp, s);
    if (stream_.host) {
      float* a = acc.ptr<float>();
      const float* t = tmp.ptr<float>();
      for (int64_t i = 0; i < u.chunk; ++i) a[i] += t[i];
      std::memset(place.data, 0, place.nbytes());
    } else {
      turbo::cuda::add_inplace_f32(acc.ptr<float>(), tmp.ptr<const float>(), u.chunk, s);
      CUDA_CHECK(cudaMemsetAsync(place.data, 0, place.nbytes(), s));
    }
  });
  if (nccl_ && u.layer >= 0) {
    const size_t g = size_t(u.layer % 3);
    record(reduced_[g]);
    reduce_pending_[g] = true;
  }
}

void FsdpComm::end_backward() {
  await_group(nccl_, stream_);
  reduce_pending_ = {false, false, false};
}

void FsdpComm::gather_resident() {
  held_ = {-1, -1};
  gather_pending_ = {false, false};
  for (size_t u = 0; u < plan_->units.size(); ++u)
    if (!plan_->shard_params || plan_->units[u].layer < 0) gather_unit(static_cast<int>(u));
  await_group(nccl_, stream_);
}

void FsdpComm::all_reduce(const TensorView& t) const {
  const parallel::DType dt = comm_dtype(t, "sharded data parallelism: all_reduce");
  in_stream_order(nccl_, stream_, [&] { group_.all_reduce(t.data, size_t(t.numel()), dt, parallel::ReduceOp::Sum); });
}

void FsdpComm::all_gather(const TensorView& send, const TensorView& recv) const {
  if (recv.numel() != send.numel() * size()) {
    throw RuntimeError(fmt::format("sharded data parallelism: all_gather of {} into {} over {} ranks", send.describe(),
                                   recv.describe(), size()));
  }
  const parallel::DType dt = comm_dtype(send, "sharded data parallelism: all_gather");
  in_stream_order(nccl_, stream_, [&] { group_.all_gather(send.data, recv.data, size_t(send.numel()), dt); });
}

}  // namespace primus::backends::cuda
