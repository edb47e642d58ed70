#include "backends/cuda/model/ep_comm.h"

#include <fmt/format.h>

#include <algorithm>
#include <cstring>

#include "backends/cuda/model/ep_kernels.h"
#include "backends/cuda/model/group_order.h"
#include "core/util/error.h"
#include "parallel/cuda/nccl_process_group.h"
#include "turbo/core/cuda_check.h"

namespace primus::backends::cuda {

EpComm::EpComm(parallel::ProcessGroup& group, const ModelStream& stream, int64_t num_experts, int64_t align,
               int64_t moe_layers, int64_t held_rows)
    : group_(group), stream_(stream), rank_(group.rank()), size_(group.world_size()), E_(num_experts),
      align_(std::max<int64_t>(1, align)), held_cap_(held_rows) {
  nccl_ = device_group(group_, stream_, "expert parallelism");
  if (size_ < 1 || E_ % size_ != 0) {
    throw ConfigError(fmt::format("expert_model_parallel_size {} does not divide num_experts {}", size_, E_));
  }
  El_ = E_ / size_;
  plans_.resize(static_cast<size_t>(std::max<int64_t>(moe_layers, 0)));
}

int64_t EpComm::plan(int64_t i, const TensorView& kept, const TensorView& offsets, const TensorView& held_offsets) {
  Plan& p = plans_.at(static_cast<size_t>(i));
  std::vector<int32_t> k(static_cast<size_t>(E_)), o(static_cast<size_t>(E_ + 1));
  stream_.from_model(k.data(), kept.data, k.size() * sizeof(int32_t));
  stream_.from_model(o.data(), offsets.data, o.size() * sizeof(int32_t));
  p.kept.assign(k.begin(), k.end());
  p.off.assign(o.begin(), o.end());
  // Every rank's kept counts (small: E floats a rank), so each knows what it receives.
  std::vector<float> mine(k.begin(), k.end()), all(static_cast<size_t>(size_ * E_));
  if (nccl_ && !stream_.host) {
    nccl_->all_gather_host(mine.data(), all.data(), mine.size() * sizeof(float));
  } else {
    group_.all_gather(mine.data(), all.data(), mine.size(), parallel::DType::F32);
  }
  p.recv.assign(static_cast<size_t>(size_ * El_), 0);
  p.send_rows.assign(static_cast<size_t>(size_), 0);
  p.recv_rows.assign(static_cast<size_t>(size_), 0);
  for (int q = 0; q < size_; ++q) {
    for (int64_t e = 0; e < El_; ++e) {
      const auto n = static_cast<int64_t>(all[static_cast<size_t>(q * E_ + rank_ * El_ + e)]);
      p.recv[static_cast<size_t>(q * El_ + e)] = n;
      p.recv_rows[static_cast<size_t>(q)] += static_cast<size_t>(n);
    }
    for (int64_t e = q * El_; e < (q + 1) * El_; ++e) p.send_rows[static_cast<size_t>(q)] += static_cast<size_t>(p.kept[e]);
  }
  p.held_start.assign(static_cast<size_t>(El_ + 1), 0);
  for (int64_t e = 0; e < El_; ++e) {
    int64_t n = 0;
    for (int q = 0; q < size_; ++q) n += p.recv[static_cast<size_t>(q * El_ + e)];
    p.held_start[e + 1] = p.held_start[e] + (n + align_ - 1) / align_ * align_;
  }
  // Every rank computed every rank's held rows from the same counts: all stop here alike.
  int64_t worst = 0;
  for (int r = 0; r < size_; ++r) {
    int64_t rows = 0;
    for (int64_t e = r * El_; e < (r + 1) * El_; ++e) {
      int64_t n = 0;
      for (int q = 0; q < size_; ++q) n += static_cast<int64_t>(all[static_cast<size_t>(q * E_ + e)]);
      rows += (n + align_ - 1) / align_ * align_;
    }
    worst = std::max(worst, rows);
  }
  if (worst > held_cap_) {
    throw RuntimeError(fmt::format("expert parallelism: MoE layer #{} (counting the MoE layers) routes {} rows to one "
                                   "rank's experts, more than its held buffers' {} rows; raise moe_ep_buffer_factor "
                                   "(the held rows are that factor x one rank's permuted rows, at most "
                                   "expert_model_parallel_size x them) or set moe_expert_capacity_factor",
                                   i, worst, held_cap_));
  }
  std::vector<int32_t> h(p.held_start.begin(), p.held_start.end());
  stream_.to_model(held_offsets.data, h.data(), h.size() * sizeof(int32_t));
  if (!stream_.host) stream_.sync();  // the host vector goes out of scope
  return p.held_start.back();
}

void EpComm::copy_rows(const TensorView& dst, int64_t dst_row, const TensorView& src, int64_t src_row, int64_t n) const {
  if (n <= 0) return;
  const size_t es = turbo::dtype_size(src.dtype), row = static_cast<size_t>(src.size(1)) * es;
  const size_t dpitch = static_cast<size_t>(dst.stride(0)) * es, spitch = static_cast<size_t>(src.stride(0)) * es;
  char* d = static_cast<char*>(dst.data) + static_cast<size_t>(dst_row) * dpitch;
  const char* s = static_cast<const char*>(src.data) + static_cast<size_t>(src_row) * spitch;
  if (stream_.host) {
    for (int64_t r = 0; r < n; ++r) std::memcpy(d + r * dpitch, s + r * spitch, row);
  } else {
    CUDA_CHECK(cudaMemcpy2DAsync(d, dpitch, s, spitch, row, static_cast<size_t>(n), cudaMemcpyDeviceToDevice,
                                 stream_.stream));
  }
}

void EpComm::exchange(const TensorView& send, const std::vector<size_t>& send_rows, const TensorView& recv,
                      const std::vector<size_t>& recv_rows, int64_t W) const {
  const parallel::DType dt = comm_dtype(send, "expert parallelism: the rows");
  std::vector<size_t> out(send_rows.size()), in(recv_rows.size());
  for (size_t q = 0; q < out.size(); ++q) out[q] = send_rows[q] * static_cast<size_t>(W);
  for (size_t q = 0; q < in.size(); ++q) in[q] = recv_rows[q] * static_cast<size_t>(W);
  in_stream_order(nccl_, stream_, [&] { group_.all_to_all_v(send.data, out, recv.data, in, dt); });
}

void EpComm::dispatch(int64_t i, const TensorView& local, const TensorView& held, const TensorView& send_wire,
                      const TensorView& recv_wire) const {
  const Plan& p = plans_.at(static_cast<size_t>(i));
  const int64_t W = local.size(1);
  const TensorView send = send_wire.slice0(0, send_wire.size(0)), recv = recv_wire.slice0(0, recv_wire.size(0));
  auto narrow = [W](const TensorView& t) {
    TensorView v = t;
    v.shape = {t.size(0), W};
    v.strides = {W, 1};  // packed rows of W
    return v;
  };
  const TensorView s = narrow(send), r = narrow(recv);
  int64_t at = 0;  // wire row: rank q's experts in order, each group's kept rows
  for (int64_t e = 0; e < E_; ++e) {
    copy_rows(s, at, local, p.off[e], p.kept[e]);
    at += p.kept[e];
  }
  exchange(s, p.send_rows, r, p.recv_rows, W);
  stream_.zero(held.slice0(0, p.held_start.back()));  // the groups' padding rows
  std::vector<int64_t> filled(static_cast<size_t>(El_), 0);
  at = 0;
  for (int q = 0; q < size_; ++q) {
    for (int64_t e = 0; e < El_; ++e) {
      const int64_t n = p.recv[static_cast<size_t>(q * El_ + e)];
      copy_rows(held, p.held_start[e] + filled[e], r, at, n);
      filled[e] += n;
      at += n;
    }
  }
}

void EpComm::combine(int64_t i, const TensorView& held, const TensorView& local, const TensorView& send_wire,
                     const TensorView& recv_wire) const {
  const Plan& p = plans_.at(static_cast<size_t>(i));
  const int64_t W = held.size(1);
  auto narrow = [W](const TensorView& t) {
    TensorView v = t;
    v.shape = {t.size(0), W};
    v.strides = {W, 1};
    return v;
  };
  const TensorView s = narrow(send_wire), r = narrow(recv_wire);
  std::vector<int64_t> filled(static_cast<size_t>(El_), 0);
  int64_t at = 0;
  for (int q = 0; q < size_; ++q) {
    for (int64_t e = 0; e < El_; ++e) {
      const int64_t n = p.recv[static_cast<size_t>(q * El_ + e)];
      copy_rows(s, at, held, p.held_start[e] + filled[e], n);
      filled[e] += n;
      at += n;
    }
  }
  exchange(s, p.recv_rows, r, p.send_rows, W);
  at = 0;
  for (int64_t e = 0; e < E_; ++e) {
    copy_rows(local, p.off[e], r, at, p.kept[e]);
    at += p.kept[e];
  }
}

void EpComm::sum(const TensorView& t) const {
  in_stream_order(nccl_, stream_,
                  [&] { group_.all_reduce(t.data, size_t(t.numel()), parallel::DType::F32, parallel::ReduceOp::Sum); });
}

void EpComm::mean(parallel::ProcessGroup* group, const TensorView& t) const {
  if (!group || group->world_size() == 1) return;
  parallel::NcclProcessGroup* nccl = device_group(*group, stream_, "expert parallelism's gradient means");
  const parallel::DType dt = comm_dtype(t, "expert parallelism: a gradient's mean");
  in_stream_order(nccl, stream_, [&] { group->all_reduce(t.data, size_t(t.numel()), dt, parallel::ReduceOp::Avg); });
}

void EpComm::scale(const TensorView& t, float s) const {
  if (t.dtype != turbo::DType::F32) throw RuntimeError("expert parallelism: the experts' gradients must be f32");
  if (stream_.host) {
    float* x = t.ptr<float>();
    for (int64_t i = 0; i < t.numel(); ++i) x[i] *= s;
  } else {
    ep::scale_f32(t.ptr<float>(), t.numel(), s, stream_.stream);
  }
}

}  // namespace primus::backends::cuda
