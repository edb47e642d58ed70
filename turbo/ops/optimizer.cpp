#include "turbo/ops/optimizer.h"

#include <fmt/format.h>

#include <cmath>
#include <tuple>
#include <vector>

#include "turbo/kernels/cpu/optimizer.h"
#include "turbo/kernels/cpu/reduce.h"
#include "turbo/ops/op_support.h"

#ifdef PRIMUS_TURBO_WITH_CUDA
#include "turbo/kernels/cuda/optimizer.h"
#endif

namespace primus::turbo {
namespace {

std::string cpu_check(const OptimizerArgs& a) {
  if (a.opt->device() != Device::CPU) return "parameters are on the device";
  if (a.opt->grad_dtype() != DType::F32 || a.opt->mixed_grads()) return "the reference takes f32 gradients";
  if (a.kind == OptimizerArgs::Kind::AdamW && a.device_scalars.defined()) return "device_scalars are a device feature";
  return "";
}

double grad_sum_squares(const MultiTensorAdamW& opt) {
  double ss = 0.0;
  for (const auto& t : opt.tensors()) ss += cpu::sum_squares(t.grad.ptr<const float>(), t.grad.numel());
  return ss;
}

void cpu_run(const OptimizerArgs& a) {
  if (a.kind == OptimizerArgs::Kind::GradNorm) {
    const double norm = std::sqrt(grad_sum_squares(*a.opt));
    a.out.ptr<float>()[0] = static_cast<float>(norm);
    a.out.ptr<float>()[1] = a.max_norm > 0.0f ? static_cast<float>(cpu::clip_scale(norm, a.max_norm)) : 1.0f;
    return;
  }
  cpu::AdamWParams p;
  p.lr = a.hp.lr;
  p.beta1 = a.hp.beta1;
  p.beta2 = a.hp.beta2;
  p.eps = a.hp.eps;
  p.step = a.hp.step;
  p.grad_scale = a.grad_scale.defined() ? a.grad_scale.ptr<const float>()[0] : 1.0;
  if (a.out.defined()) {  // the norm of what this update reads; NaN when it is skipped
    a.out.ptr<float>()[0] =
        std::isfinite(p.grad_scale) ? static_cast<float>(std::sqrt(grad_sum_squares(*a.opt))) : std::nanf("");
    a.out.ptr<float>()[1] = 1.0f;
  }
  if (!std::isfinite(p.grad_scale)) return;  // a vetoed (non-finite) step: nothing changes
  p.m_bf16 = a.opt->m_dtype() == DType::BF16;
  p.v_bf16 = a.opt->v_dtype() == DType::BF16;
  std::vector<float> m16, v16;  // bf16 moments widened (their values exact in f32), narrowed after
  const auto moment = [](const TensorView& x, std::vector<float>& wide) {
    if (x.dtype == DType::F32) return x.ptr<float>();
    wide.resize(size_t(x.numel()));
    for (size_t i = 0; i < wide.size(); ++i) wide[i] = load_as_float(x.data, DType::BF16, i);
    return wide.data();
  };
  const auto narrow = [](const TensorView& x, const std::vector<float>& wide) {
    if (x.dtype == DType::F32) return;
    for (size_t i = 0; i < wide.size(); ++i) store_from_float(x.data, DType::BF16, i, wide[i]);
  };
  for (const auto& t : a.opt->tensors()) {
    p.weight_decay = t.decay ? a.hp.weight_decay : 0.0;
    p.sr_key = t.sr_key;
    const int64_t n = t.master.numel();
    float* const tm = moment(t.m, m16);
    float* const tv = moment(t.v, v16);
    if (a.opt->split_master()) {  // the fp32 values joined, updated as an f32 master, split again
      auto* hi = static_cast<uint16_t*>(t.model.data);
      auto* lo = t.master.ptr<uint16_t>();
      std::vector<float> master(static_cast<size_t>(n));
      for (int64_t i = 0; i < n; ++i) master[size_t(i)] = join_f32(hi[i], lo[i]);
      cpu::adamw_update(master.data(), t.grad.ptr<const float>(), tm, tv, n, p);
      for (int64_t i = 0; i < n; ++i) {
        hi[i] = split_f32_hi(master[size_t(i)]);
        lo[i] = split_f32_lo(master[size_t(i)]);
      }
    } else {
      cpu::adamw_update(t.master.ptr<float>(), t.grad.ptr<const float>(), tm, tv, n, p);
    }
    narrow(t.m, m16);
    narrow(t.v, v16);
    if (!a.opt->split_master() && t.model.defined())
      for (int64_t i = 0; i < n; ++i)
        store_from_float(t.model.data, DType::BF16, static_cast<size_t>(i), t.master.ptr<const float>()[i]);
  }
}

#ifdef PRIMUS_TURBO_WITH_CUDA
std::string turbo_check(const OptimizerArgs& a) {
  if (a.opt->device() != Device::CUDA) return "parameters are on the host";
  if (!a.opt->device_table()) return "no device table";
  if ((a.kind == OptimizerArgs::Kind::GradNorm || a.out.defined()) && !a.ctx.scratch)
    return "needs ExecContext::scratch for partial sums";
  return "";
}

void turbo_run(const OptimizerArgs& a) {
  auto s = static_cast<cudaStream_t>(a.ctx.stream);
  const int n = static_cast<int>(a.opt->tensors().size());
  if (a.kind == OptimizerArgs::Kind::GradNorm) {
    Arena& arena = detail::scratch_of(a.ctx, "grad_norm");
    ArenaScope scope(arena);
    void* partial = arena.allocate(cuda::grad_norm_scratch_bytes(a.opt->num_chunks()), 256, "grad_norm partials");
    cuda::grad_norm_multi_tensor(a.out.ptr<float>(), a.opt->device_table(), n, a.opt->num_chunks(), a.max_norm, partial, s);
    return;
  }
  cuda::AdamWStep hp{a.hp.lr, a.hp.beta1, a.hp.beta2, a.hp.eps, a.hp.weight_decay, a.hp.step};
  const cuda::AdamWStorage storage{a.opt->split_master(), a.opt->m_dtype() == DType::BF16,
                                   a.opt->v_dtype() == DType::BF16};
  if (!a.out.defined()) {
    cuda::adamw_multi_tensor(a.opt->device_table(), n, a.opt->num_chunks(), hp, a.grad_scale.ptr<const float>(),
                             a.device_scalars.ptr<const float>(), s, nullptr, nullptr, storage);
    return;
  }
  Arena& arena = detail::scratch_of(a.ctx, "adamw");
  ArenaScope scope(arena);
  void* partial = arena.allocate(cuda::grad_norm_scratch_bytes(a.opt->num_chunks()), 256, "adamw norm partials");
  cuda::adamw_multi_tensor(a.opt->device_table(), n, a.opt->num_chunks(), hp, a.grad_scale.ptr<const float>(),
                           a.device_scalars.ptr<const float>(), s, a.out.ptr<float>(), partial, storage);
}
#endif

OpDispatcher<OptimizerArgs>& dispatcher() {
  static auto* d = detail::make_turbo_cpu_dispatcher<OptimizerArgs>("optimizer", PRIMUS_TURBO_FN(turbo_check),
                                                                    PRIMUS_TURBO_FN(turbo_run), cpu_check, cpu_run);
  return *d;
}

}  // namespace

std::string OptimizerArgs::key() const {
  return fmt::format("{} tensors={} numel={} grad={} master={} m={} v={} {}",
                     kind == Kind::GradNorm ? "grad_norm" : out.defined() ? "adamw+norm" : "adamw",
                     opt->tensors().size(), opt->total_numel(),
                     opt->mixed_grads() ? std::string_view("mixed") : dtype_name(opt->grad_dtype()),
                     opt->split_master() ? "split" : "f32", dtype_name(opt->m_dtype()), dtype_name(opt->v_dtype()),
                     device_name(opt->device()));
}

MultiTensorAdamW::MultiTensorAdamW(std::vector<AdamWTensor> tensors, Arena* arena) : tensors_(std::move(tensors)) {
  if (tensors_.empty()) throw RuntimeError("MultiTensorAdamW: no tensors");
  device_ = tensors_[0].master.device;
  grad_dtype_ = tensors_[0].grad.dtype;
  split_master_ = tensors_[0].master.dtype == DType::U16;
  m_dtype_ = tensors_[0].m.dtype;
  v_dtype_ = tensors_[0].v.dtype;
  for (const AdamWTensor& t : tensors_) {
    if (t.grad.dtype != grad_dtype_) mixed_grads_ = true;
    if (t.grad.dtype == DType::BF16) grad_dtype_ = DType::BF16;
  }
  for (size_t i = 0; i < tensors_.size(); ++i) {
    const AdamWTensor& t = tensors_[i];
    const std::string op = fmt::format("MultiTensorAdamW tensor {}", i);
    for (auto [name, v] : {std::pair{"master", &t.master}, {"grad", &t.grad}, {"m", &t.m}, {"v", &t.v}}) {
      check_defined(*v, op.c_str(), name);
      check_contiguous(*v, op.c_str(), name);
      check_device(*v, device_, op.c_str(), name);
      if (v->numel() != t.master.numel())
        throw RuntimeError(fmt::format("{}: {} {} differs in size from master {}", op, name, v->describe(), t.master.describe()));
    }
    check_dtype(t.master, split_master_ ? DType::U16 : DType::F32, op.c_str(), "master");
    if (split_master_ && !t.model.defined())
      throw RuntimeError(fmt::format("{}: a split master (u16 low words) needs its bf16 model copy (the high words)", op));
    for (auto [name, v, want] : {std::tuple{"m", &t.m, m_dtype_}, {"v", &t.v, v_dtype_}}) {
      if (want != DType::F32 && want != DType::BF16)
        throw RuntimeError(fmt::format("{}: {} is {}, expected f32 or bf16", op, name, dtype_name(v->dtype)));
      check_dtype(*v, want, op.c_str(), name);  // uniform over the table (tensor 0's)
    }
    if (t.sr_key < 0) throw RuntimeError(fmt::format("{}: sr_key {} < 0", op, t.sr_key));
    if (t.grad.dtype != DType::F32 && t.grad.dtype != DType::BF16)
      throw RuntimeError(fmt::format("{}: grad is {}, expected f32 or bf16", op, dtype_name(t.grad.dtype)));
    if (t.model.defined()) {
      check_dtype(t.model, DType::BF16, op.c_str(), "model");
      check_device(t.model, device_, op.c_str(), "model");
      if (t.model.numel() != t.master.numel()) throw RuntimeError(fmt::format("{}: model size differs from master", op));
    }
    total_numel_ += t.master.numel();
  }
  if (device_ == Device::CUDA) {
#ifdef PRIMUS_TURBO_WITH_CUDA
    if (!arena) throw RuntimeError("MultiTensorAdamW: device tensors need an arena for the descriptor table");
    std::vector<cuda::MultiTensorEntry> entries(tensors_.size());
    for (size_t i = 0; i < tensors_.size(); ++i) {
      const AdamWTensor& t = tensors_[i];
      entries[i] = {split_master_ ? nullptr : t.master.ptr<float>(),
                    t.model.data,
                    t.grad.data,
                    t.m.data,
                    t.v.data,
                    t.master.numel(),
                    t.decay ? 1 : 0,
                    t.grad.dtype == DType::BF16 ? 1 : 0,
                    split_master_ ? t.master.ptr<uint16_t>() : nullptr,
                    t.sr_key};
    }
    const int n = static_cast<int>(entries.size());
    table_ = arena->allocate(cuda::multi_tensor_table_bytes(n), 256, "AdamW descriptor table");
    chunks_ = cuda::multi_tensor_table_build(table_, entries.data(), n);
#else
    throw RuntimeError("MultiTensorAdamW: this build has no CUDA");
#endif
  }
}

BackendType MultiTensorAdamW::step(const AdamWHyper& hp, const TensorView& grad_scale,
                                   const TensorView& device_scalars, const ExecContext& ctx,
                                   const TensorView& norm_out) {
  if (norm_out.defined()) {
    check_shape(norm_out, {2}, "adamw", "norm_out");
    check_dtype(norm_out, DType::F32, "adamw", "norm_out");
    check_device(norm_out, device_, "adamw", "norm_out");
  }
  if (grad_scale.defined()) {
    check_dtype(grad_scale, DType::F32, "adamw", "grad_scale");
    check_device(grad_scale, device_, "adamw", "grad_scale");
  }
  if (device_scalars.defined()) {
    // {lr, bc1, bc2} or {lr, bc1, bc2, step}; bf16 moments need the step (their rounding's key).
    const bool bf16_moments = m_dtype_ == DType::BF16 || v_dtype_ == DType::BF16;
    check_shape(device_scalars, {bf16_moments || device_scalars.numel() == 4 ? 4 : 3}, "adamw", "device_scalars");
    check_dtype(device_scalars, DType::F32, "adamw", "device_scalars");
  }
  OptimizerArgs a;
  a.kind = OptimizerArgs::Kind::AdamW;
  a.opt = this;
  a.hp = hp;
  a.grad_scale = grad_scale;
  a.device_scalars = device_scalars;
  a.out = norm_out;
  a.ctx = ctx;
  return dispatcher().dispatch(a);
}

BackendType MultiTensorAdamW::grad_norm(const TensorView& out, float max_norm, const ExecContext& ctx) {
  check_shape(out, {2}, "grad_norm", "out");
  check_dtype(out, DType::F32, "grad_norm", "out");
  check_device(out, device_, "grad_norm", "out");
  OptimizerArgs a;
  a.kind = OptimizerArgs::Kind::GradNorm;
  a.opt = this;
  a.out = out;
  a.max_norm = max_norm;
  a.ctx = ctx;
  return dispatcher().dispatch(a);
}

}  // namespace primus::turbo
