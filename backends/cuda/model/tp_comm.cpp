#include "backends/cuda/model/tp_comm.h"

#include <fmt/format.h>

#include "core/util/error.h"
#include "parallel/cuda/nccl_process_group.h"
#include "turbo/core/cuda_check.h"

namespace primus::backends::cuda {
namespace {

parallel::DType comm_dtype(const TensorView& t, const char* what) {
  if (t.dtype == turbo::DType::F32) return parallel::DType::F32;
  if (t.dtype == turbo::DType::BF16) return parallel::DType::BF16;
  throw RuntimeError(fmt::format("tensor parallelism: {} of dtype {} (f32 or bf16)", what, turbo::dtype_name(t.dtype)));
}

}  // namespace

TpComm::TpComm(parallel::ProcessGroup& group, std::shared_ptr<const train::TpShardMap> map, const ModelStream& stream)
    : group_(group), map_(std::move(map)), stream_(stream) {
  if (group_.world_size() != map_->tp() || group_.rank() != map_->rank()) {
    throw ConfigError(fmt::format("tensor parallelism: the group has rank {} of {}, the shard map rank {} of {}",
                                  group_.rank(), group_.world_size(), map_->rank(), map_->tp()));
  }
  nccl_ = dynamic_cast<parallel::NcclProcessGroup*>(&group_);
  if (!stream_.host && !nccl_ && group_.backend() != "threads") {
    throw ConfigError(fmt::format("tensor parallelism on the GPU needs a NCCL or threaded process group, got '{}'",
                                  group_.backend()));
  }
}

template <class F>
void TpComm::ordered(F&& call) const {
  if (stream_.host) {
    call();
  } else if (nccl_) {
    nccl_->wait_for(stream_.stream);
    call();
    nccl_->make_wait(stream_.stream);
  } else {
    CUDA_CHECK(cudaStreamSynchronize(stream_.stream));
    call();
  }
}

void TpComm::all_reduce(const TensorView& t) const {
  const parallel::DType dt = comm_dtype(t, "all_reduce");
  ordered([&] { group_.all_reduce(t.data, static_cast<size_t>(t.numel()), dt, parallel::ReduceOp::Sum); });
}

void TpComm::all_gather(const TensorView& send, const TensorView& recv) const {
  const parallel::DType dt = comm_dtype(send, "all_gather");
  if (recv.dtype != send.dtype || recv.numel() != send.numel() * size()) {
    throw RuntimeError(fmt::format("tensor parallelism: all_gather of {} into {}", send.describe(), recv.describe()));
  }
  ordered([&] { group_.all_gather(send.data, recv.data, static_cast<size_t>(send.numel()), dt); });
}

}  // namespace primus::backends::cuda
