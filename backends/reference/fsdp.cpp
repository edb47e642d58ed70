#include "backends/reference/fsdp.h"

#include <sys/mman.h>
#include <unistd.h>

#include <algorithm>
#include <cstdint>

namespace primus::backends::reference {

namespace {

// Appends [b, e) to segs, merging with the last segment when they touch.
void push_segment(std::vector<parallel::FlatSegment>& segs, int64_t b, int64_t e) {
  if (b >= e) return;
  if (!segs.empty() && segs.back().end == b) {
    segs.back().end = e;
  } else {
    segs.push_back({b, e});
  }
}

}  // namespace

ReferenceFsdp::ReferenceFsdp(GptModel<float>& model, parallel::ProcessGroup& dp, bool shard_params)
    : model_(model), pg_(dp), shard_params_(shard_params), rank_(dp.rank()), world_(dp.world_size()) {
  const train::ParamLayout& L = model.layout();
  const int64_t layers = model.spec().num_layers;
  units_.resize(static_cast<size_t>(1 + layers));
  for (const train::ParamTensor& t : L.tensors) {
    size_t u = 0;
    if (t.name.rfind("layers.", 0) == 0) u = 1 + static_cast<size_t>(std::stoll(t.name.substr(7)));
    push_segment(units_.at(u).segments, t.offset, t.offset + t.numel);
  }
  owned_.resize(static_cast<size_t>(world_));
  for (Unit& u : units_) {
    for (const auto& s : u.segments) u.size += s.size();
    u.chunk = (u.size + world_ - 1) / world_;
    u.shard_offset = owned_count_;
    for (int r = 0; r < world_; ++r) {
      const int64_t a = std::min(u.size, r * u.chunk), b = std::min(u.size, (r + 1) * u.chunk);
      for (const auto& s : unit_range(u, a, b)) push_segment(owned_[static_cast<size_t>(r)], s.begin, s.end);
      if (r == rank_) owned_count_ += b - a;
    }
  }
  param_shard_.assign(static_cast<size_t>(owned_count_), 0.f);
  grad_shard_.assign(static_cast<size_t>(owned_count_), 0.f);
}

std::vector<parallel::FlatSegment> ReferenceFsdp::unit_range(const Unit& u, int64_t a, int64_t b) const {
  std::vector<parallel::FlatSegment> out;
  int64_t at = 0;  // unit coordinate of the segment's first element
  for (const auto& s : u.segments) {
    const int64_t lo = std::max(a, at), hi = std::min(b, at + s.size());
    if (lo < hi) out.push_back({s.begin + (lo - at), s.begin + (hi - at)});
    at += s.size();
  }
  return out;
}

void ReferenceFsdp::give_back(float* base, const std::vector<parallel::FlatSegment>& segs) const {
  static const uintptr_t page = static_cast<uintptr_t>(::sysconf(_SC_PAGESIZE));
  for (const auto& s : segs) {
    // Only whole pages inside the segment: the pages at its ends may hold a neighbour's elements.
    const uintptr_t lo = (reinterpret_cast<uintptr_t>(base + s.begin) + page - 1) / page * page;
    const uintptr_t hi = reinterpret_cast<uintptr_t>(base + s.end) / page * page;
    if (hi > lo) ::madvise(reinterpret_cast<void*>(lo), hi - lo, MADV_DONTNEED);
  }
}

void ReferenceFsdp::adopt_params() {
  const float* p = model_.params.data();
  int64_t at = 0;
  for (const auto& s : owned()) {
    std::copy(p + s.begin, p + s.end, param_shard_.begin() + at);
    at += s.size();
  }
  if (shard_params_) release_all();
}

void ReferenceFsdp::begin_step() { std::fill(grad_shard_.begin(), grad_shard_.end(), 0.f); }

void ReferenceFsdp::end_step() {
  if (!shard_params_) all_gather_units();  // with sharded parameters the next forward gathers
}

void ReferenceFsdp::gather_all() {
  if (shard_params_) all_gather_units();  // optim_grads keeps them whole
}

void ReferenceFsdp::all_gather_units() {
  for (int u = 0; u < static_cast<int>(units_.size()); ++u) all_gather_unit(u);
}

int64_t ReferenceFsdp::my_count(const Unit& u) const {
  return std::min(u.size, (rank_ + 1) * u.chunk) - std::min(u.size, rank_ * u.chunk);
}

void ReferenceFsdp::release_all() {
  for (int u = 0; u < static_cast<int>(units_.size()); ++u) release(u);
}

void ReferenceFsdp::gather(int unit) {
  if (shard_params_) all_gather_unit(unit);
}

void ReferenceFsdp::all_gather_unit(int unit) {
  gather_unit_into(param_shard_, model_.params.data(), units_.at(static_cast<size_t>(unit)));
}

void ReferenceFsdp::gather_unit_into(const std::vector<float>& shard, float* dst, const Unit& u) {
  if (u.size == 0) return;
  const int64_t C = u.chunk;
  // This rank's slice, padded to the chunk, then every rank's chunk in rank order.
  mine_.assign(static_cast<size_t>(C), 0.f);
  std::copy_n(shard.begin() + u.shard_offset, my_count(u), mine_.begin());
  staging_.resize(static_cast<size_t>(C * world_));
  pg_.all_gather(mine_.data(), staging_.data(), static_cast<size_t>(C), parallel::DType::F32);
  const float* src = staging_.data();
  for (const auto& s : unit_range(u, 0, u.size)) {
    std::copy_n(src, s.size(), dst + s.begin);
    src += s.size();
  }
}

void ReferenceFsdp::release(int unit) {
  if (!shard_params_) return;
  give_back(model_.params.data(), units_.at(static_cast<size_t>(unit)).segments);
}

void ReferenceFsdp::grads_ready(int unit) {
  const Unit& u = units_.at(static_cast<size_t>(unit));
  if (u.size == 0) return;
  const int64_t C = u.chunk;
  staging_.assign(static_cast<size_t>(C * world_), 0.f);  // zeros pad the last chunk
  float* g = model_.grads.data();
  float* dst = staging_.data();
  for (const auto& s : unit_range(u, 0, u.size)) {
    std::copy(g + s.begin, g + s.end, dst);
    std::fill(g + s.begin, g + s.end, 0.f);  // ready for the next micro-batch
    dst += s.size();
  }
  give_back(g, u.segments);
  mine_.resize(static_cast<size_t>(C));
  pg_.reduce_scatter(staging_.data(), mine_.data(), static_cast<size_t>(C), parallel::DType::F32,
                     parallel::ReduceOp::Avg);
  float* acc = grad_shard_.data() + u.shard_offset;
  for (int64_t i = 0, n = my_count(u); i < n; ++i) acc[i] += mine_[static_cast<size_t>(i)];
}

std::vector<float> ReferenceFsdp::full(const std::vector<float>& shard) {
  std::vector<float> out(model_.params.size(), 0.f);
  for (const Unit& u : units_) gather_unit_into(shard, out.data(), u);
  return out;
}

}  // namespace primus::backends::reference
