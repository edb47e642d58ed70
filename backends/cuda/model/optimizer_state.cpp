#include "backends/cuda/model/optimizer_state.h"

#include <fmt/format.h>

#include <algorithm>
#include <cmath>
#include <vector>

#include "core/util/error.h"
#include "turbo/core/cuda_arena.h"
#include "turbo/core/dtype.h"
#include "turbo/kernels/cuda/cast.h"
#include "turbo/kernels/cuda/dp_norm.h"
#include "turbo/kernels/cuda/optimizer.h"
#include "turbo/kernels/cuda/step_check.h"

namespace primus::backends::cuda {

GradClearing plan_grad_clearing(const train::ParamLayout& layout,
                                const std::function<bool(const std::string& name)>& written_first) {
  std::vector<std::pair<int64_t, int64_t>> ranges;
  for (const auto& t : layout.tensors) {
    if (written_first(t.name)) continue;
    if (!ranges.empty() && ranges.back().first + ranges.back().second == t.offset)
      ranges.back().second += t.numel;
    else
      ranges.emplace_back(t.offset, t.numel);
  }
  GradClearing c;
  for (const auto& r : ranges) (r.second >= GradClearing::kMemsetRange ? c.memset_ranges : c.ranges).push_back(r);
  for (const auto& r : c.ranges) c.ranges_total += r.second;
  return c;
}

OptimizerState::OptimizerState(const train::ParamLayout& layout, const StateBuffers& state, const GradPlacement& place,
                               turbo::Arena& arena, GradClearing clearing, bool keep_state, const ModelStream& stream,
                               const CudaOps& ops, const InBackward* in_backward,
                               const std::vector<train::MuonTensor>& muon, const MuonPieceFn& muon_piece,
                               std::vector<int64_t> sr_keys)
    : layout_(layout), sr_keys_(std::move(sr_keys)), state_(state), place_(place), clearing_(std::move(clearing)),
      stream_(stream), ops_(ops) {
  if (!sr_keys_.empty() && sr_keys_.size() != layout_.tensors.size()) {
    throw RuntimeError(fmt::format("cuda model: {} rounding keys for {} tensors", sr_keys_.size(), layout_.tensors.size()));
  }
  if (!muon.empty() && (in_backward || !keep_state)) {
    throw RuntimeError("cuda model: Muon needs the whole optimizer state on this rank, after the backward (neither "
                       "ZeRO-1 nor the optimizer in the backward)");
  }
  if (in_backward) {
    if (!keep_state) throw RuntimeError("cuda model: the optimizer in the backward needs the optimizer state on this rank");
    build_groups(*in_backward, arena);
    return;
  }
  if (!keep_state) return;
  // Over every tensor: fp32 master and moments, f32 gradients, the bf16 copy it refreshes.
  std::vector<turbo::AdamWTensor> ts;
  for (size_t i = 0; i < layout_.tensors.size(); ++i) ts.push_back(adamw_tensor(i));
  adamw_ = std::make_unique<turbo::MultiTensorAdamW>(std::move(ts), &arena);
  if (muon.empty()) return;
  const std::vector<bool> is_muon = train::muon_mask(muon, layout_);
  std::vector<turbo::AdamWTensor> rest;
  for (size_t i = 0; i < layout_.tensors.size(); ++i)
    if (!is_muon[i]) rest.push_back(adamw_tensor(i));
  if (!rest.empty()) {
    const size_t table = turbo::cuda::multi_tensor_table_bytes(static_cast<int>(rest.size())) + 2 * turbo::Arena::kDefaultAlign;
    rest_table_ = stream_.host ? turbo::make_host_arena(table) : turbo::make_device_arena(table);
    adamw_rest_ = std::make_unique<turbo::MultiTensorAdamW>(std::move(rest), rest_table_.get());
  }
  std::vector<turbo::MuonMatrix> mats;
  for (const train::MuonTensor& mt : muon) {
    const train::ParamTensor& t = layout_.tensors[mt.index];
    for (size_t bi = 0; bi < mt.blocks.size(); ++bi) {
      const train::MuonBlock& b = mt.blocks[bi];
      const int64_t off = b.offset, n = b.rows * b.cols;
      turbo::MuonMatrix mm;
      mm.master = state_.master.slice0(off, off + n);
      if (!stream_.host) mm.model = state_.weights.slice0(off, off + n);
      mm.grad = grad_view(state_.grads, place_, mt.index, b.offset - t.offset, n);
      mm.m = state_.m.slice0(off, off + n);
      mm.rows = b.rows;
      mm.cols = b.cols;
      mm.decay = t.decay;
      if (muon_piece) muon_piece(mt.index, b, bi, mm);
      mats.push_back(mm);
    }
  }
  muon_ = std::make_unique<turbo::MultiMatrixMuon>(std::move(mats));
}

size_t OptimizerState::muon_device_bytes() const {
  return (muon_ ? muon_->device_bytes() : 0) + (rest_table_ && !stream_.host ? rest_table_->capacity() : 0);
}

turbo::AdamWTensor OptimizerState::adamw_slice(size_t i, int64_t off, int64_t n) const {
  const train::ParamTensor& t = layout_.tensors[i];
  turbo::AdamWTensor a;
  a.master = state_.master.slice0(off, off + n);
  if (!stream_.host) a.model = state_.weights.slice0(off, off + n);
  a.grad = grad_view(state_.grads, place_, i, off - t.offset, n);
  a.m = state_.m.slice0(off, off + n);
  a.v = state_.v.slice0(off, off + n);
  a.decay = t.decay;
  a.sr_key = sr_key(i) + (off - t.offset);
  return a;
}

turbo::AdamWTensor OptimizerState::adamw_tensor(size_t i) const {
  const train::ParamTensor& t = layout_.tensors[i];
  turbo::AdamWTensor a;
  a.master = state_.master.slice0(t.offset, t.offset + t.numel);
  if (!stream_.host) a.model = state_.weights.slice0(t.offset, t.offset + t.numel);
  a.grad = grad_view(state_.grads, place_, i, 0, t.numel);
  a.m = state_.m.slice0(t.offset, t.offset + t.numel);
  a.v = state_.v.slice0(t.offset, t.offset + t.numel);
  a.decay = t.decay;
  a.sr_key = sr_key(i);
  return a;
}

void OptimizerState::build_groups(const InBackward& ib, turbo::Arena& arena) {
  if (!place_.shared_window) throw RuntimeError("cuda model: the optimizer in the backward needs the shared gradient window");
  if (!state_.group_norm.defined()) throw RuntimeError("cuda model: the memory plan has no group norm buffer");
  const std::vector<int64_t>& points = ib.points;  // group g: layout offsets [points[g], the point before or the end)
  std::vector<int64_t> group_of(layout_.tensors.size(), -1);
  for (size_t g = 0; g < points.size(); ++g) {
    const int64_t begin = points[g];
    const int64_t end = g == 0 ? layout_.total : points[g - 1];
    Group grp;
    grp.begin = begin;
    std::vector<turbo::AdamWTensor> ts;
    for (size_t i = 0; i < layout_.tensors.size(); ++i) {
      const train::ParamTensor& t = layout_.tensors[i];
      if (t.offset < begin || t.offset >= end) continue;
      ts.push_back(adamw_tensor(i));
      const TensorView& gv = ts.back().grad;
      if (!grp.grads.empty() && grp.grads.back().dtype == gv.dtype &&
          static_cast<const char*>(grp.grads.back().data) + grp.grads.back().nbytes() == gv.data) {
        TensorView& last = grp.grads.back();
        last = TensorView(last.data, last.dtype, last.device, {last.numel() + gv.numel()});
      } else {
        grp.grads.push_back(TensorView(gv.data, gv.dtype, gv.device, {gv.numel()}));
      }
      group_of[i] = static_cast<int64_t>(g);
      grp.window = grp.window || place_.in_window[i];
      if (!ib.clear_all && ib.written_first(t.name)) continue;
      // In the window: cleared before the layer's backward; in another tensor's place: after that
      // one's update; elsewhere: at the step's start.
      const auto reused = std::find_if(place_.reuse.begin(), place_.reuse.end(), [i](const auto& r) { return r.second == i; });
      std::vector<std::pair<int64_t, int64_t>>* into = place_.in_window[i] ? &grp.clear : &step_clear_;
      if (reused != place_.reuse.end()) {
        const int64_t owner = group_of[reused->first];
        if (owner < 0 || owner >= static_cast<int64_t>(groups_.size())) {
          throw RuntimeError(fmt::format("cuda model: the gradient of {} takes the place of {}, whose update does not run "
                                         "before it",
                                         t.name, layout_.tensors[reused->first].name));
        }
        into = &groups_[static_cast<size_t>(owner)].clear_after;
      }
      auto& list = *into;
      const int64_t off = place_.offset[i];
      if (!list.empty() && list.back().first + list.back().second == off)
        list.back().second += t.numel;
      else
        list.emplace_back(off, t.numel);
    }
    if (ts.empty()) throw RuntimeError(fmt::format("cuda model: no parameter tensor from layout offset {}", begin));
    grp.adamw = std::make_unique<turbo::MultiTensorAdamW>(std::move(ts), &arena);
    groups_.push_back(std::move(grp));
  }
}

size_t OptimizerState::group_at(int64_t offset) const {
  size_t g = 0;
  while (g < groups_.size() && groups_[g].begin != offset) ++g;
  if (g == groups_.size()) throw RuntimeError(fmt::format("cuda model: no optimizer group starts at offset {}", offset));
  return g;
}

const std::vector<TensorView>& OptimizerState::group_grads(int64_t offset) const { return groups_[group_at(offset)].grads; }

TensorView OptimizerState::grad_of(size_t i) const {
  return grad_view(state_.grads, place_, i, 0, layout_.tensors.at(i).numel);
}

void OptimizerState::group_norms_over(const std::vector<bool>& counted,
                                      const std::vector<std::pair<int64_t, int64_t>>& excluded,
                                      std::function<void(const TensorView&)> sum_squares) {
  if (groups_.empty()) throw RuntimeError("cuda model: group_norms_over without the optimizer in the backward");
  if (counted.size() != layout_.tensors.size()) throw RuntimeError("cuda model: group_norms_over: one flag per tensor");
  // Per group: the tensors this rank does not count, and the excluded ranges of those it does.
  std::vector<std::vector<turbo::AdamWTensor>> sets(groups_.size());
  size_t tables = 0;
  for (size_t g = 0; g < groups_.size(); ++g) {
    const int64_t begin = groups_[g].begin, end = g == 0 ? layout_.total : groups_[g - 1].begin;
    for (size_t i = 0; i < layout_.tensors.size(); ++i) {
      const train::ParamTensor& t = layout_.tensors[i];
      if (t.offset < begin || t.offset >= end || !t.trainable) continue;
      if (!counted[i]) {
        sets[g].push_back(adamw_tensor(i));
        continue;
      }
      for (const auto& [off, n] : excluded)
        if (off >= t.offset && off + n <= t.offset + t.numel) sets[g].push_back(adamw_slice(i, off, n));
    }
    if (!sets[g].empty()) tables += turbo::cuda::multi_tensor_table_bytes(static_cast<int>(sets[g].size())) +
                                    2 * turbo::Arena::kDefaultAlign;
  }
  uncounted_table_ = stream_.host ? turbo::make_host_arena(tables + 64 + 2 * turbo::Arena::kDefaultAlign)
                                  : turbo::make_device_arena(tables + 64 + 2 * turbo::Arena::kDefaultAlign);
  uncounted_norm_ = uncounted_table_->tensor(turbo::DType::F32, {2}, "uncounted gradient norm");
  for (size_t g = 0; g < groups_.size(); ++g)
    if (!sets[g].empty())
      groups_[g].uncounted = std::make_unique<turbo::MultiTensorAdamW>(std::move(sets[g]), uncounted_table_.get());
  sum_squares_ = std::move(sum_squares);
}

void OptimizerState::backward_ready(int64_t offset, int64_t n_losses, const ExecContext& ctx) {
  const size_t g = group_at(offset);
  Group& grp = groups_[g];
  const int64_t S = state_.loss_slots.numel();
  const bool first = g == 0, last = g + 1 == groups_.size();
  float* status = state_.status.ptr<float>();
  if (first) {  // the loss decides before anything moves
    if (stream_.host)
      turbo::cuda::step_check_begin_apply(status, n_losses, S);
    else
      turbo::cuda::step_check_begin(status, n_losses, S, stream_.stream);
  }
  // The update and the norm of the gradients it read in one pass; the check after it.
  ops_.adamw(*grp.adamw, hp_, state_.norm.slice0(1, 2), stream_.host ? TensorView() : state_.hyper, ctx,
             state_.group_norm);
  if (sum_squares_) {  // tensor parallelism: this rank's counted squares, summed over the group
    float* gn = state_.group_norm.ptr<float>();
    if (grp.uncounted) ops_.grad_norm(*grp.uncounted, uncounted_norm_, 0.0f, ctx);
    if (stream_.host) {
      gn[0] = grp.uncounted ? turbo::cuda::remove_squares_value(gn[0], uncounted_norm_.ptr<float>()[0]) : gn[0] * gn[0];
    } else if (grp.uncounted) {
      turbo::cuda::remove_squares(gn, uncounted_norm_.ptr<const float>(), stream_.stream);
    } else {
      turbo::cuda::square_norm(gn, stream_.stream);
    }
    sum_squares_(state_.group_norm.slice0(0, 1));
    if (stream_.host)
      gn[0] = static_cast<float>(std::sqrt(static_cast<double>(gn[0])));
    else
      turbo::cuda::finish_norm(gn, 0.0f, stream_.stream);
  }
  if (stream_.host)
    turbo::cuda::step_check_group_apply(status, S, state_.group_norm.ptr<float>()[0], last);
  else
    turbo::cuda::step_check_group(status, S, state_.group_norm.ptr<const float>(), last, stream_.stream);
  for (const auto& [off, n] : grp.clear_after) stream_.zero(state_.grads.slice0(off, off + n));
  // The layer that uses this one's window next (the next group, or with two windows the one after
  // it, whose update runs after the next layer's backward): clear what it accumulates into.
  const size_t next = g + static_cast<size_t>(std::max(place_.windows, 1));
  if (grp.window && next < groups_.size() && groups_[next].window)
    for (const auto& [off, n] : groups_[next].clear) stream_.zero(state_.grads.slice0(off, off + n));
}

void OptimizerState::upload_clearing_table() const {
  const TensorView& table = state_.zero_table;
  if (!table.defined()) return;
  std::vector<int64_t> t(static_cast<size_t>(table.numel()));
  const size_t n = clearing_.ranges.size();
  for (size_t r = 0; r < n; ++r) {
    t[r + 1] = t[r] + clearing_.ranges[r].second;
    t[n + 1 + r] = clearing_.ranges[r].first;
  }
  stream_.to_model(table.data, t.data(), t.size() * sizeof(int64_t));
}

void OptimizerState::zero_grad(bool full) const {
  const TensorView& grads = state_.grads;
  if (!groups_.empty()) {  // what lies outside the windows, and the first layers' parts of them (one a window)
    for (const auto& [off, n] : step_clear_) stream_.zero(grads.slice0(off, off + n));
    int left = std::max(place_.windows, 1);
    for (const Group& grp : groups_) {
      if (!grp.window) continue;
      for (const auto& [off, n] : grp.clear) stream_.zero(grads.slice0(off, off + n));
      if (--left == 0) break;
    }
    return;
  }
  if (full) {
    stream_.zero(grads);
    return;
  }
  for (const auto& [off, n] : clearing_.memset_ranges) stream_.zero(grads.slice0(off, off + n));
  if (stream_.host) {
    for (const auto& [off, n] : clearing_.ranges) stream_.zero(grads.slice0(off, off + n));
  } else if (state_.zero_table.defined()) {
    turbo::cuda::zero_ranges_f32(grads.ptr<float>(), state_.zero_table.ptr<const int64_t>(),
                                 static_cast<int>(clearing_.ranges.size()), clearing_.ranges_total, stream_.stream);
  }
}

void OptimizerState::grad_norm(float max_norm, const ExecContext& ctx) {
  need_state("grad_norm");
  need_global("grad_norm");
  ops_.grad_norm(*adamw_, state_.norm, max_norm, ctx);
}

void OptimizerState::norm_over(const std::vector<bool>& counted,
                               const std::vector<std::pair<int64_t, int64_t>>& excluded) {
  need_state("norm_over");
  need_global("norm_over");
  std::vector<std::pair<int64_t, int64_t>> ex = excluded;
  std::sort(ex.begin(), ex.end());
  std::vector<turbo::AdamWTensor> ts;
  for (size_t i = 0; i < layout_.tensors.size(); ++i) {
    if (!counted.at(i)) continue;
    const train::ParamTensor& t = layout_.tensors[i];
    int64_t at = t.offset;
    const int64_t end = t.offset + t.numel;
    for (const auto& [off, n] : ex) {  // the tensor less the excluded ranges inside it
      if (off + n <= at || off >= end) continue;
      if (off > at) ts.push_back(adamw_slice(i, at, off - at));
      at = std::max(at, off + n);
    }
    if (at < end) ts.push_back(at == t.offset ? adamw_tensor(i) : adamw_slice(i, at, end - at));
  }
  if (ts.empty()) throw RuntimeError("cuda model: the gradient norm counts no tensor");
  const size_t table = turbo::cuda::multi_tensor_table_bytes(static_cast<int>(ts.size())) + 2 * turbo::Arena::kDefaultAlign;
  norm_table_ = stream_.host ? turbo::make_host_arena(table) : turbo::make_device_arena(table);
  norm_set_ = std::make_unique<turbo::MultiTensorAdamW>(std::move(ts), norm_table_.get());
}

void OptimizerState::grad_norm_squares(const ExecContext& ctx) {
  if (!norm_set_) throw RuntimeError("cuda model: grad_norm_squares before norm_over");
  ops_.grad_norm(*norm_set_, state_.norm, 0.0f, ctx);
  if (stream_.host) {
    float* n = state_.norm.ptr<float>();
    n[0] *= n[0];
  } else {
    turbo::cuda::square_norm(state_.norm.ptr<float>(), stream_.stream);
  }
}

void OptimizerState::finish_grad_norm(float max_norm) {
  if (stream_.host) {
    float* n = state_.norm.ptr<float>();  // as finish_norm's kernel: the root and the factor in f64
    const double norm = std::sqrt(static_cast<double>(n[0]));
    n[0] = static_cast<float>(norm);
    n[1] = max_norm > 0 ? static_cast<float>(std::min(1.0, max_norm / (norm + 1e-6))) : 1.0f;
  } else {
    turbo::cuda::finish_norm(state_.norm.ptr<float>(), max_norm, stream_.stream);
  }
}

void OptimizerState::check_step(int64_t n, int64_t slots) const {
  need_global("check_step");
  if (n < 1 || n > slots) throw RuntimeError(fmt::format("cuda model: check_step over {} loss slots (1..{})", n, slots));
  if (!stream_.host) {
    turbo::cuda::step_check(state_.status.ptr<float>(), n, slots, stream_.stream);
    return;
  }
  turbo::cuda::step_check_apply(state_.status.ptr<float>(), n, slots);  // host mode: the ops ran synchronously
}

void OptimizerState::update(const ExecContext& ctx) {
  need_state("update");
  need_global("update");
  if (!muon_) {
    ops_.adamw(*adamw_, hp_, state_.norm.slice0(1, 2), stream_.host ? TensorView() : state_.hyper, ctx, TensorView());
    return;
  }
  if (adamw_rest_)
    ops_.adamw(*adamw_rest_, hp_, state_.norm.slice0(1, 2), stream_.host ? TensorView() : state_.hyper, ctx, TensorView());
  // The clip factor (NaN: the step check vetoed the step) and, on the device, the step's lr
  // from the staged scalars, so a graph replay reads this step's values.
  muon_->step(muon_hp_, state_.norm.slice0(1, 2), stream_.host ? TensorView() : state_.hyper.slice0(0, 1), ctx);
}

void OptimizerState::set_params(const float* host) {
  const int64_t n = layout_.total;
  if (!keeps_state()) {  // no master copy: stage the fp32 weights in the gradient buffer
    stream_.to_model(state_.grads.data, host, size_t(n) * 4);
    turbo::cuda::cast_f32_to_bf16(state_.weights.data, state_.grads.ptr<float>(), n, stream_.stream);
    return;
  }
  if (split_master()) {  // split on the host: the high halves are the bf16 weights
    std::vector<uint16_t> hi(static_cast<size_t>(n)), lo(static_cast<size_t>(n));
    for (int64_t i = 0; i < n; ++i) {
      hi[size_t(i)] = turbo::split_f32_hi(host[i]);
      lo[size_t(i)] = turbo::split_f32_lo(host[i]);
    }
    stream_.to_model(state_.weights.data, hi.data(), hi.size() * 2);
    stream_.to_model(state_.master.data, lo.data(), lo.size() * 2);
    stream_.sync();
    return;
  }
  stream_.to_model(state_.master.data, host, state_.master.nbytes());
  if (!stream_.host) turbo::cuda::cast_f32_to_bf16(state_.weights.data, state_.master.ptr<float>(), n, stream_.stream);
  stream_.sync();
}

void OptimizerState::get_params(float* host) const {
  need_state("get_params");
  if (split_master()) {
    const size_t n = static_cast<size_t>(layout_.total);
    std::vector<uint16_t> hi(n), lo(n);
    stream_.from_model(hi.data(), state_.weights.data, n * 2);
    stream_.from_model(lo.data(), state_.master.data, n * 2);
    for (size_t i = 0; i < n; ++i) host[i] = turbo::join_f32(hi[i], lo[i]);
    return;
  }
  stream_.from_model(host, state_.master.data, state_.master.nbytes());
}

void OptimizerState::need_global(const char* what) const {
  if (!groups_.empty()) {
    throw RuntimeError(fmt::format("cuda model: {} after the backward does not exist with the optimizer in the backward "
                                   "(each group's update ran as its gradients were ready)",
                                   what));
  }
}

void OptimizerState::need_state(const char* what) const {
  if (!keeps_state()) {
    throw RuntimeError(fmt::format("cuda model: {} needs the optimizer state, which this model (ZeRO-1) does not keep",
                                   what));
  }
}

void OptimizerState::set_moments(const float* m, const float* v) {
  need_state("set_moments");
  for (auto [dst, src] : {std::pair{&state_.m, m}, std::pair{&state_.v, v}}) {
    if (!src) {
      stream_.zero(*dst);
    } else if (dst->dtype == turbo::DType::BF16) {  // bf16 moments: rounded to nearest on the host
      std::vector<uint16_t> bits(static_cast<size_t>(dst->numel()));
      for (size_t i = 0; i < bits.size(); ++i) bits[i] = turbo::float_to_bf16_bits(src[i]);
      stream_.to_model(dst->data, bits.data(), dst->nbytes());
      stream_.sync();  // before `bits` goes
    } else {
      stream_.to_model(dst->data, src, dst->nbytes());
    }
  }
  stream_.sync();
}

void OptimizerState::get_moments(float* m, float* v) const {
  need_state("get_moments");
  for (auto [dst, src] : {std::pair{m, &state_.m}, std::pair{v, &state_.v}}) {
    if (src->dtype != turbo::DType::BF16) {
      stream_.from_model(dst, src->data, src->nbytes());
      continue;
    }
    std::vector<uint16_t> bits(static_cast<size_t>(src->numel()));  // widened exactly
    stream_.from_model(bits.data(), src->data, src->nbytes());
    for (size_t i = 0; i < bits.size(); ++i) dst[i] = turbo::bf16_bits_to_float(bits[i]);
  }
}

void OptimizerState::get_grads(float* host) const {
  if (place_.shared_window) {
    throw RuntimeError("cuda model: with the optimizer in the backward the full gradients never exist at once (the "
                       "layers share the gradient windows)");
  }
  stream_.from_model(host, state_.grads.data, state_.grads.nbytes());
}

}  // namespace primus::backends::cuda
