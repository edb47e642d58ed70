#include "backends/cuda/model/tp_comm.h"

#include <fmt/format.h>

#include "backends/cuda/model/group_order.h"
#include "core/util/error.h"
#include "parallel/cuda/nccl_process_group.h"
#include "turbo/core/cuda_check.h"

namespace primus::backends::cuda {
TpComm::TpComm(parallel::ProcessGroup& group, std::shared_ptr<const train::TpShardMap> map, const ModelStream& stream)
    : group_(group), map_(std::move(map)), stream_(stream) {
  if (group_.world_size() != map_->tp() || group_.rank() != map_->rank()) {
    throw ConfigError(fmt::format("tensor parallelism: the group has rank {} of {}, the shard map rank {} of {}",
                                  group_.rank(), group_.world_size(), map_->rank(), map_->tp()));
  }
  nccl_ = device_group(group_, stream_, "tensor parallelism");
}

template <class F>
void TpComm::ordered(F&& call) const {
  in_stream_order(nccl_, stream_, call);
}

void TpComm::all_reduce(const TensorView& t) const {
  const parallel::DType dt = comm_dtype(t, "tensor parallelism: all_reduce");
  ordered([&] { group_.all_reduce(t.data, static_cast<size_t>(t.numel()), dt, parallel::ReduceOp::Sum); });
}

void TpComm::all_gather(const TensorView& send, const TensorView& recv) const {
  const parallel::DType dt = comm_dtype(send, "tensor parallelism: all_gather");
  if (recv.dtype != send.dtype || recv.numel() != send.numel() * size()) {
    throw RuntimeError(fmt::format("tensor parallelism: all_gather of {} into {}", send.describe(), recv.describe()));
  }
  ordered([&] { group_.all_gather(send.data, recv.data, static_cast<size_t>(send.numel()), dt); });
}

namespace {
// Elements from one row to the next, and the rank's block of rows.
struct RowBlock {
  int64_t pitch, rows;
};
RowBlock row_block(const TensorView& t, int size, const char* what) {
  if (t.ndim != 2) throw RuntimeError(fmt::format("tensor parallelism: {} of {} (rows of a 2-D view)", what, t.describe()));
  const int64_t R = t.size(0), pitch = t.stride(0);
  if (R % size != 0 || t.stride(1) != 1)
    throw RuntimeError(fmt::format("tensor parallelism: {} of {} over {} ranks", what, t.describe(), size));
  return {pitch, R / size};
}
}  // namespace

void TpComm::gather_rows(const TensorView& t) const {
  const parallel::DType dt = comm_dtype(t, "tensor parallelism: gather_rows");
  const RowBlock b = row_block(t, size(), "gather_rows");
  const size_t esize = turbo::dtype_size(t.dtype), count = static_cast<size_t>(b.pitch * b.rows);
  char* base = static_cast<char*>(t.data);
  ordered([&] { group_.all_gather(base + rank() * count * esize, base, count, dt); });
}

void TpComm::reduce_scatter_rows(const TensorView& t) const {
  const parallel::DType dt = comm_dtype(t, "tensor parallelism: reduce_scatter_rows");
  const RowBlock b = row_block(t, size(), "reduce_scatter_rows");
  if (b.pitch != t.size(1)) throw RuntimeError("tensor parallelism: reduce_scatter_rows of padded rows");
  const size_t esize = turbo::dtype_size(t.dtype), count = static_cast<size_t>(b.pitch * b.rows);
  char* base = static_cast<char*>(t.data);
  ordered([&] { group_.reduce_scatter(base, base + rank() * count * esize, count, dt, parallel::ReduceOp::Sum); });
}

}  // namespace primus::backends::cuda
