#include "turbo/ops/muon.h"

#include <fmt/format.h>

#include <algorithm>
#include <cmath>
#include <utility>

#include "core/util/error.h"
#include "turbo/kernels/cpu/muon.h"
#include "turbo/ops/gemm.h"
#if PRIMUS_TURBO_WITH_CUDA
#include <cuda_runtime_api.h>

#include "turbo/core/cuda_arena.h"
#include "turbo/kernels/cuda/muon.h"
#endif

namespace primus::turbo {

namespace {
void check_matrix(const MuonMatrix& mm, size_t i, Device device) {
  auto fail = [&](const std::string& what) {
    throw RuntimeError(fmt::format("MultiMatrixMuon: matrix {} [{}, {}]: {}", i, mm.rows, mm.cols, what));
  };
  if (mm.rows <= 0 || mm.cols <= 0) fail("empty");
  const int64_t n = mm.rows * mm.cols;
  for (auto [t, name] : {std::pair{&mm.master, "master"}, std::pair{&mm.grad, "grad"}, std::pair{&mm.m, "m"}}) {
    if (!t->defined() || t->numel() != n || t->dtype != DType::F32 || !t->is_contiguous())
      fail(fmt::format("{} must be contiguous f32 of {} elements, got {}", name, n, t->defined() ? t->describe() : "none"));
    if (t->device != device) fail(fmt::format("{} is on another device than matrix 0", name));
  }
  if (mm.model.defined() && (mm.model.numel() != n || mm.model.dtype != DType::BF16 || mm.model.device != device))
    fail(fmt::format("model copy must be bf16 of {} elements, got {}", n, mm.model.describe()));
  if (mm.piece()) {
    const bool rows_cut = mm.cols == mm.full_cols && mm.col0 == 0 && mm.row0 >= 0 && mm.row0 + mm.rows <= mm.full_rows;
    const bool cols_cut = mm.rows == mm.full_rows && mm.row0 == 0 && mm.col0 >= 0 && mm.col0 + mm.cols <= mm.full_cols;
    if (!rows_cut && !cols_cut)
      fail(fmt::format("a piece at ({}, {}) of [{}, {}] must span the whole's rows or its columns", mm.row0, mm.col0,
                       mm.full_rows, mm.full_cols));
  }
}
}  // namespace

namespace {
// The largest matrix's elements and the largest Gram matrix's (min(rows, cols)^2).
std::pair<int64_t, int64_t> working_extent(const std::vector<std::pair<int64_t, int64_t>>& shapes) {
  int64_t big = 0, gram = 0;
  for (auto [rows, cols] : shapes) {
    const int64_t r = std::min(rows, cols);
    big = std::max(big, rows * cols);
    gram = std::max(gram, r * r);
  }
  return {big, gram};
}
constexpr int64_t kMuonPartials = 256;  // turbo/kernels/cuda/muon.h's kMuonMaxParts (also without CUDA)
}  // namespace

size_t MultiMatrixMuon::working_set_bytes(const std::vector<std::pair<int64_t, int64_t>>& shapes, int64_t piece_elems) {
  const auto [big, gram] = working_extent(shapes);
  const size_t al = Arena::kDefaultAlign;
  auto up = [&](size_t b) { return (b + al - 1) / al * al; };
  return up(size_t(big) * 4) + 3 * up(size_t(big) * 2) + 2 * up(size_t(gram) * 2) + up(sizeof(float) * kMuonPartials) +
         (piece_elems > 0 ? up(size_t(piece_elems) * 4) : 0);
}

MultiMatrixMuon::MultiMatrixMuon(std::vector<MuonMatrix> mats) : mats_(std::move(mats)) {
  if (mats_.empty()) throw RuntimeError("MultiMatrixMuon: no matrices");
  device_ = mats_[0].master.device;
  std::vector<std::pair<int64_t, int64_t>> shapes;
  int64_t piece_elems = 0;
  for (size_t i = 0; i < mats_.size(); ++i) {
    check_matrix(mats_[i], i, device_);
    shapes.emplace_back(mats_[i].whole_rows(), mats_[i].whole_cols());
    if (mats_[i].piece()) piece_elems = std::max(piece_elems, mats_[i].rows * mats_[i].cols);
  }
  if (device_ == Device::CPU) return;
  const auto [big, gram] = working_extent(shapes);
#if PRIMUS_TURBO_WITH_CUDA
  static_assert(cuda::kMuonMaxParts == kMuonPartials, "the partial sums' count");
  const size_t al = Arena::kDefaultAlign;
  work_ = make_device_arena(working_set_bytes(shapes, piece_elems));
  if (piece_elems > 0) piece_ = work_->allocate(size_t(piece_elems) * 4, al, "muon u piece");
  u_ = work_->allocate(size_t(big) * 4, al, "muon u");
  x_ = work_->allocate(size_t(big) * 2, al, "muon X");
  y_ = work_->allocate(size_t(big) * 2, al, "muon X'");
  t_ = work_->allocate(size_t(big) * 2, al, "muon B X");
  a_ = work_->allocate(size_t(gram) * 2, al, "muon A");
  b_ = work_->allocate(size_t(gram) * 2, al, "muon B");
  partial_ = work_->allocate(sizeof(float) * cuda::kMuonMaxParts, al, "muon partial sums");
#else
  (void)big;
  (void)gram;
  throw RuntimeError("MultiMatrixMuon: device tensors in a build without CUDA");
#endif
}

MultiMatrixMuon::~MultiMatrixMuon() = default;

size_t MultiMatrixMuon::device_bytes() const { return work_ ? work_->capacity() : 0; }

void MultiMatrixMuon::step(const MuonHyper& hp, const TensorView& grad_scale, const TensorView& device_lr,
                           const ExecContext& ctx) {
  if (hp.ns_steps < 1) throw RuntimeError(fmt::format("MultiMatrixMuon: ns_steps {} must be >= 1", hp.ns_steps));
  if (device_ == Device::CPU) {
    const double gs = grad_scale.defined() ? double(grad_scale.ptr<float>()[0]) : 1.0;
    if (!std::isfinite(gs)) return;  // the step check's veto
    cpu::MuonParams p;
    p.lr = device_lr.defined() ? double(device_lr.ptr<float>()[0]) * hp.lr_scale : hp.lr;
    p.momentum = hp.momentum;
    p.nesterov = hp.nesterov;
    p.ns_steps = hp.ns_steps;
    p.scale_mode = hp.scale_mode;
    p.extra_scale = hp.extra_scale;
    p.grad_scale = gs;
    for (const MuonMatrix& mm : mats_) {
      p.weight_decay = mm.decay ? hp.weight_decay : 0.0;
      if (!mm.piece()) {
        cpu::muon_update(mm.master.ptr<float>(), mm.grad.ptr<const float>(), mm.m.ptr<float>(), mm.rows, mm.cols, p);
        continue;
      }
      // A tensor-parallel piece: cpu::muon_update's halves, Newton-Schulz on the whole put together.
      const int64_t R = mm.full_rows, C = mm.full_cols;
      std::vector<float> u(static_cast<size_t>(mm.rows * mm.cols)), whole(static_cast<size_t>(R * C)), o(whole.size());
      cpu::muon_momentum<float>(mm.grad.ptr<const float>(), mm.m.ptr<float>(), mm.rows * mm.cols, p, u.data());
      mm.gather(TensorView(u.data(), DType::F32, Device::CPU, {mm.rows, mm.cols}),
                TensorView(whole.data(), DType::F32, Device::CPU, {R, C}));
      cpu::newton_schulz<float>(whole.data(), R, C, p.ns_steps, o.data());
      cpu::muon_apply<float>(mm.master.ptr<float>(), o.data(), mm.rows, mm.cols, R, C, mm.row0, mm.col0, p);
    }
    return;
  }
#if PRIMUS_TURBO_WITH_CUDA
  auto stream = static_cast<cudaStream_t>(ctx.stream);
  const float* gs = grad_scale.defined() ? grad_scale.ptr<const float>() : nullptr;
  const float* dlr = device_lr.defined() ? device_lr.ptr<const float>() : nullptr;
  const float ka = float(cpu::kMuonNsA), kb = float(cpu::kMuonNsB), kc = float(cpu::kMuonNsC);
  for (const MuonMatrix& mm : mats_) {
    const int64_t R = mm.whole_rows(), C = mm.whole_cols();
    const int64_t n = mm.rows * mm.cols, r = std::min(R, C), c = std::max(R, C);
    auto* partial = static_cast<float*>(partial_);
    if (!mm.piece()) {
      cuda::muon_momentum(mm.grad.ptr<const float>(), mm.m.ptr<float>(), static_cast<float*>(u_), n, hp.momentum,
                          hp.nesterov, gs, partial, stream);
    } else {  // this rank's u, the whole put together, its squares summed
      cuda::muon_momentum(mm.grad.ptr<const float>(), mm.m.ptr<float>(), static_cast<float*>(piece_), n, hp.momentum,
                          hp.nesterov, gs, partial, stream);
      mm.gather(TensorView(piece_, DType::F32, Device::CUDA, {mm.rows, mm.cols}),
                TensorView(u_, DType::F32, Device::CUDA, {R, C}));
      cuda::muon_sum_squares(static_cast<const float*>(u_), R * C, gs, partial, stream);
    }
    cuda::muon_normalize(static_cast<const float*>(u_), x_, R, C, partial, gs, stream);
    void *x = x_, *y = y_;
    const TensorView A(a_, DType::BF16, Device::CUDA, {r, r}), B(b_, DType::BF16, Device::CUDA, {r, r});
    const TensorView T(t_, DType::BF16, Device::CUDA, {r, c});
    for (int64_t s = 0; s < hp.ns_steps; ++s) {
      const TensorView X(x, DType::BF16, Device::CUDA, {r, c});
      GemmArgs g;
      g.ctx = ctx;
      g.a = X;  // A = X X^T
      g.b = X.transposed();
      g.d = A;
      gemm(g);
      g.a = A;  // B = A A (A is symmetric), then b A + c A A
      g.b = A;
      g.d = B;
      gemm(g);
      cuda::muon_axpby(a_, b_, b_, r * r, kb, kc, gs, stream);
      g.a = B;  // T = B X, then X' = a X + T
      g.b = X;
      g.d = T;
      gemm(g);
      cuda::muon_axpby(x, t_, y, r * c, ka, 1.0f, gs, stream);
      std::swap(x, y);
    }
    const float rms = static_cast<float>(cpu::muon_update_scale(R, C, hp.scale_mode, hp.extra_scale));
    cuda::muon_apply(mm.master.ptr<float>(), mm.model.defined() ? mm.model.data : nullptr, x, mm.rows, mm.cols, R, C,
                     mm.piece() ? mm.row0 : 0, mm.piece() ? mm.col0 : 0, hp.lr, dlr, hp.lr_scale,
                     mm.decay ? hp.weight_decay : 0.0f, rms, gs, stream);
  }
#else
  (void)ctx;
#endif
}

}  // namespace primus::turbo
