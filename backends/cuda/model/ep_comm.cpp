#include "backends/cuda/model/ep_comm.h"

#include <fmt/format.h>

#include <algorithm>
#include <cstdint>
#include <cstring>

#include "backends/cuda/model/ep_kernels.h"
#include "backends/cuda/model/group_order.h"
#include "core/util/error.h"
#include "parallel/cuda/nccl_process_group.h"
#include "turbo/core/cuda_arena.h"
#include "turbo/core/cuda_check.h"

namespace primus::backends::cuda {

EpComm::EpComm(parallel::ProcessGroup& group, const ModelStream& stream, int64_t num_experts, int64_t align,
               int64_t moe_layers, int64_t local_rows, int64_t held_rows)
    : group_(group), stream_(stream), rank_(group.rank()), size_(group.world_size()), E_(num_experts),
      align_(std::max<int64_t>(1, align)), local_cap_(local_rows), held_cap_(held_rows) {
  nccl_ = device_group(group_, stream_, "expert parallelism");
  if (size_ < 1 || E_ % size_ != 0) {
    throw ConfigError(fmt::format("expert_model_parallel_size {} does not divide num_experts {}", size_, E_));
  }
  El_ = E_ / size_;
  const int64_t layers = std::max<int64_t>(moe_layers, 1);
  plans_.resize(static_cast<size_t>(layers));
  const size_t bytes = static_cast<size_t>(layers * 2 * (local_cap_ + held_cap_)) * sizeof(int32_t) + 2 * turbo::Arena::kDefaultAlign;
  map_arena_ = stream_.host ? turbo::make_host_arena(bytes) : turbo::make_device_arena(bytes);
  maps_ = map_arena_->tensor(turbo::DType::I32, {layers, 2 * (local_cap_ + held_cap_)}, "expert parallelism's row maps");
}

TensorView EpComm::map(int64_t i, int which) const {
  // pack [local_cap], unpack [held_cap], back [held_cap], home [local_cap]
  const int64_t starts[5] = {0, local_cap_, local_cap_ + held_cap_, local_cap_ + 2 * held_cap_,
                             2 * (local_cap_ + held_cap_)};
  const int64_t width = 2 * (local_cap_ + held_cap_);
  return TensorView(static_cast<int32_t*>(maps_.data) + i * width + starts[which], turbo::DType::I32, maps_.device,
                    {starts[which + 1] - starts[which]});
}

int64_t EpComm::plan(int64_t i, const TensorView& kept, const TensorView& held_offsets) {
  Plan& p = plans_.at(static_cast<size_t>(i));
  std::vector<int32_t> k(static_cast<size_t>(E_)), off(static_cast<size_t>(E_ + 1), 0);
  stream_.from_model(k.data(), kept.data, k.size() * sizeof(int32_t));  // the one host read of the layer
  // The local groups' offsets as the row plan lays them (turbo/ops/moe.h: each padded to the alignment).
  for (int64_t e = 0; e < E_; ++e) off[e + 1] = static_cast<int32_t>(off[e] + (k[e] + align_ - 1) / align_ * align_);
  // Every rank's kept counts (small: E floats a rank), so each knows what it receives.
  std::vector<float> mine(k.begin(), k.end()), all(static_cast<size_t>(size_ * E_));
  if (nccl_ && !stream_.host) {
    nccl_->all_gather_host(mine.data(), all.data(), mine.size() * sizeof(float));
  } else {
    group_.all_gather(mine.data(), all.data(), mine.size(), parallel::DType::F32);
  }
  auto count = [&](int q, int64_t e) { return static_cast<int64_t>(all[static_cast<size_t>(q * E_ + e)]); };
  // Every rank computes every rank's held rows from the same counts: all stop here alike.
  int64_t worst = 0;
  for (int r = 0; r < size_; ++r) {
    int64_t rows = 0;
    for (int64_t e = r * El_; e < (r + 1) * El_; ++e) {
      int64_t n = 0;
      for (int q = 0; q < size_; ++q) n += count(q, e);
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
  if (off[E_] > local_cap_) {
    throw RuntimeError(fmt::format("expert parallelism: MoE layer #{} has {} permuted rows, above the memory plan's "
                                   "bound of {}",
                                   i, off[E_], local_cap_));
  }
  // The held groups: this rank's expert e's rows from rank 0, 1, ..., padded to the alignment.
  std::vector<int32_t> held(static_cast<size_t>(El_ + 1), 0);
  for (int64_t e = 0; e < El_; ++e) {
    int64_t n = 0;
    for (int q = 0; q < size_; ++q) n += count(q, rank_ * El_ + e);
    held[e + 1] = static_cast<int32_t>(held[e] + (n + align_ - 1) / align_ * align_);
  }
  p.local_rows = off[E_];
  p.held_rows = held[El_];
  p.send_rows.assign(static_cast<size_t>(size_), 0);
  p.recv_rows.assign(static_cast<size_t>(size_), 0);
  // On the wire rows go rank by rank: to rank q its experts' kept rows in expert order; from rank
  // q this rank's experts' rows in expert order.
  std::vector<int32_t> pack, unpack(static_cast<size_t>(p.held_rows), -1), back, home(static_cast<size_t>(p.local_rows), -1);
  for (int q = 0; q < size_; ++q) {
    for (int64_t e = q * El_; e < (q + 1) * El_; ++e) {
      for (int32_t r = 0; r < k[e]; ++r) {
        home[static_cast<size_t>(off[e] + r)] = static_cast<int32_t>(pack.size());
        pack.push_back(off[e] + r);
      }
      p.send_rows[static_cast<size_t>(q)] += static_cast<size_t>(k[e]);
    }
  }
  std::vector<int64_t> filled(static_cast<size_t>(El_), 0);
  for (int q = 0; q < size_; ++q) {
    for (int64_t e = 0; e < El_; ++e) {
      const int64_t n = count(q, rank_ * El_ + e);
      for (int64_t r = 0; r < n; ++r) {
        const int64_t h = held[e] + filled[e] + r;
        unpack[static_cast<size_t>(h)] = static_cast<int32_t>(back.size());
        back.push_back(static_cast<int32_t>(h));
      }
      filled[e] += n;
      p.recv_rows[static_cast<size_t>(q)] += static_cast<size_t>(n);
    }
  }
  p.sent = static_cast<int64_t>(pack.size());
  p.received = static_cast<int64_t>(back.size());
  const std::vector<int32_t>* maps[4] = {&pack, &unpack, &back, &home};
  for (int w = 0; w < 4; ++w) {
    if (!maps[w]->empty()) stream_.to_model(map(i, w).data, maps[w]->data(), maps[w]->size() * sizeof(int32_t));
  }
  stream_.to_model(held_offsets.data, held.data(), held.size() * sizeof(int32_t));
  if (!stream_.host) stream_.sync();  // the host vectors go out of scope
  return p.held_rows;
}

void EpComm::gather(const TensorView& dst, const TensorView& src, const TensorView& m, int64_t rows) const {
  if (rows <= 0) return;
  const int64_t W = dst.size(1);
  const size_t es = turbo::dtype_size(dst.dtype);
  if (stream_.host) {
    const int32_t* mp = m.ptr<const int32_t>();
    for (int64_t r = 0; r < rows; ++r) {
      char* d = static_cast<char*>(dst.data) + static_cast<size_t>(r * dst.stride(0)) * es;
      if (mp[r] < 0) {
        std::memset(d, 0, static_cast<size_t>(W) * es);
      } else {
        std::memcpy(d, static_cast<const char*>(src.data) + static_cast<size_t>(mp[r] * src.stride(0)) * es,
                    static_cast<size_t>(W) * es);
      }
    }
  } else {
    ep::gather_rows(dst.data, dst.stride(0), src.data, src.stride(0), m.ptr<const int32_t>(), rows, W,
                    static_cast<int>(es), stream_.stream);
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

namespace {
// The wire buffer as packed rows of W.
TensorView packed(const TensorView& wire, int64_t W) {
  TensorView v = wire;
  v.shape = {wire.size(0), W};
  v.strides = {W, 1};
  return v;
}
}  // namespace

void EpComm::route(int64_t i, const TensorView& src, const TensorView& dst, const TensorView& send_wire,
                   const TensorView& recv_wire, bool to_experts) const {
  const Plan& p = plans_.at(static_cast<size_t>(i));
  const int64_t W = src.size(1);
  const TensorView s = packed(send_wire, W), r = packed(recv_wire, W);
  const int first = to_experts ? 0 : 2;  // pack + unpack, or back + home
  gather(s, src, map(i, first), to_experts ? p.sent : p.received);
  exchange(s, to_experts ? p.send_rows : p.recv_rows, r, to_experts ? p.recv_rows : p.send_rows, W);
  gather(dst, r, map(i, first + 1), to_experts ? p.held_rows : p.local_rows);  // the groups' padding rows zeroed
}

void EpComm::dispatch(int64_t i, const TensorView& local, const TensorView& held, const TensorView& send_wire,
                      const TensorView& recv_wire) const {
  route(i, local, held, send_wire, recv_wire, true);
}

void EpComm::combine(int64_t i, const TensorView& held, const TensorView& local, const TensorView& send_wire,
                     const TensorView& recv_wire) const {
  route(i, held, local, send_wire, recv_wire, false);
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

void EpComm::scale(const TensorView& t, float s, cudaStream_t stream) const {
  if (t.dtype == turbo::DType::BF16 && !stream_.host) {  // moe_expert_grad_dtype: bf16 (the device only)
    if (reinterpret_cast<uintptr_t>(t.data) % 4 != 0)
      throw RuntimeError("expert parallelism: a bf16 expert gradient that does not start on a 4-byte boundary");
    ep::scale_bf16(t.data, t.numel(), s, stream ? stream : stream_.stream);
    return;
  }
  if (t.dtype != turbo::DType::F32)
    throw RuntimeError(fmt::format("expert parallelism: an expert gradient of {} ({}; f32, or bf16 on the device)",
                                   turbo::dtype_name(t.dtype), t.describe()));
  if (stream_.host) {
    float* x = t.ptr<float>();
    for (int64_t i = 0; i < t.numel(); ++i) x[i] *= s;
  } else {
    ep::scale_f32(t.ptr<float>(), t.numel(), s, stream ? stream : stream_.stream);
  }
}

}  // namespace primus::backends::cuda
