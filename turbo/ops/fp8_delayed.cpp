#include "turbo/ops/fp8_delayed.h"

#include <fmt/format.h>

#include "core/util/error.h"
#include "turbo/kernels/cpu/quantize.h"
#include "turbo/ops/op_support.h"

#ifdef PRIMUS_TURBO_WITH_CUDA
#include "turbo/kernels/cuda/quantize.h"
#endif

namespace primus::turbo {
// Named (not anonymous): a unity build puts this file beside quantization.cpp's kOp and checks.
namespace delayed_impl {

constexpr const char* kOp = "fp8_delayed_update";

TensorView element(const TensorView& t, int64_t i) {
  return TensorView(static_cast<float*>(t.data) + i, DType::F32, t.device, {1});
}

void validate(const Fp8DelayedUpdateArgs& a) {
  check_defined(a.history, kOp, "history");
  check_defined(a.scale, kOp, "scale");
  check_defined(a.fp8_max, kOp, "fp8_max");
  for (const auto& [t, arg] : {std::pair{&a.history, "history"}, std::pair{&a.scale, "scale"},
                               std::pair{&a.fp8_max, "fp8_max"}}) {
    check_dtype(*t, DType::F32, kOp, arg);
    check_contiguous(*t, kOp, arg);
    check_same_device(*t, a.history, kOp);
  }
  if (a.history.ndim != 2)
    throw RuntimeError(fmt::format("{}: history: expected [tensors, length], got {}", kOp, a.history.describe()));
  const int64_t T = a.history.size(0), len = a.history.size(1);
  if (len < 1 || len > kFp8MaxAmaxHistory)
    throw RuntimeError(fmt::format("{}: history length {} (1..{})", kOp, len, kFp8MaxAmaxHistory));
  if (a.scale.numel() != T || a.fp8_max.numel() != T)
    throw RuntimeError(fmt::format("{}: scale and fp8_max need {} entries (one per history row), got {} and {}", kOp, T,
                                   a.scale.numel(), a.fp8_max.numel()));
  if (a.margin < 0 || a.margin > kFp8MaxMargin)
    throw RuntimeError(fmt::format("{}: margin {} (0..{})", kOp, a.margin, kFp8MaxMargin));
}

std::string cpu_check(const Fp8DelayedUpdateArgs& a) {
  return detail::all_on(Device::CPU, {{"history", &a.history}, {"scale", &a.scale}, {"fp8_max", &a.fp8_max}});
}
void cpu_run(const Fp8DelayedUpdateArgs& a) {
  cpu::fp8_delayed_update(a.history.ptr<float>(), a.scale.ptr<float>(), a.fp8_max.ptr<float>(), a.history.size(0),
                          a.history.size(1), a.algo == Fp8AmaxAlgo::Max, a.margin);
}

#ifdef PRIMUS_TURBO_WITH_CUDA
std::string turbo_check(const Fp8DelayedUpdateArgs& a) {
  return detail::all_on(Device::CUDA, {{"history", &a.history}, {"scale", &a.scale}, {"fp8_max", &a.fp8_max}});
}
void turbo_run(const Fp8DelayedUpdateArgs& a) {
  static_assert(kFp8MaxAmaxHistory == cuda::kMaxDelayedHistory);
  cuda::fp8_delayed_update(a.history.ptr<float>(), a.scale.ptr<float>(), a.fp8_max.ptr<float>(), a.history.size(0),
                           a.history.size(1), a.algo == Fp8AmaxAlgo::Max, a.margin,
                           static_cast<cudaStream_t>(a.ctx.stream));
}
#endif

}  // namespace delayed_impl

const char* fp8_amax_algo_name(Fp8AmaxAlgo a) { return a == Fp8AmaxAlgo::Max ? "max" : "most_recent"; }

Fp8DelayedScaling::Fp8DelayedScaling(Fp8DelayedOptions o) : opt_(o) {
  if (o.history_len < 1 || o.history_len > kFp8MaxAmaxHistory)
    throw ConfigError(fmt::format("fp8_amax_history_len: {} (1..{})", o.history_len, kFp8MaxAmaxHistory));
  if (o.margin < 0 || o.margin > kFp8MaxMargin)
    throw ConfigError(fmt::format("fp8_margin: {} (0..{})", o.margin, kFp8MaxMargin));
  if (!dtype_is_fp8(o.fwd) || !dtype_is_fp8(o.grad))
    throw RuntimeError("fp8 delayed scaling: the formats must be f8e4m3 or f8e5m2");
}

void Fp8DelayedScaling::add_layer(const void* weight, std::string name) {
  if (history_.defined()) throw RuntimeError("fp8 delayed scaling: add_layer after bind");
  if (!weight) throw RuntimeError(fmt::format("fp8 delayed scaling: layer {} has no weight", name));
  if (!index_.emplace(weight, layers()).second)
    throw RuntimeError(fmt::format("fp8 delayed scaling: layer {} shares its weight with layer {}", name,
                                   names_[static_cast<size_t>(index_.at(weight))]));
  names_.push_back(std::move(name));
}

float Fp8DelayedScaling::fp8_max_of_tensor(int64_t t) const {
  return cpu::fp8_max(t % kRoles == kGrad ? opt_.grad : opt_.fwd);
}

void Fp8DelayedScaling::clear() {
  names_.clear();
  index_.clear();
  history_ = scale_ = fp8_max_ = TensorView();
  use_history = false;
  record = true;
}

void Fp8DelayedScaling::bind(const TensorView& history, const TensorView& scale, const TensorView& fp8_max) {
  const int64_t T = tensors();
  if (history.numel() != T * opt_.history_len || scale.numel() != T || fp8_max.numel() != T ||
      history.dtype != DType::F32 || scale.dtype != DType::F32 || fp8_max.dtype != DType::F32)
    throw RuntimeError(fmt::format("fp8 delayed scaling: bind needs f32 history [{}, {}], scale [{}] and fp8_max [{}], "
                                   "got {}, {}, {}",
                                   T, opt_.history_len, T, T, history.describe(), scale.describe(), fp8_max.describe()));
  history_ = TensorView(history.data, DType::F32, history.device, {T, opt_.history_len});
  scale_ = scale;
  fp8_max_ = fp8_max;
}

Fp8DelayedScaling::Tensor Fp8DelayedScaling::tensor(const void* weight, Role role, const char* op) const {
  const auto it = index_.find(weight);
  if (it == index_.end())
    throw RuntimeError(fmt::format("{}: fp8_recipe delayed: this linear layer's weight ({}) has no amax history (only "
                                   "the {} registered layers have one)",
                                   op, weight, layers()));
  if (!history_.defined()) throw RuntimeError(fmt::format("{}: fp8_recipe delayed: the state has no memory yet", op));
  const int64_t t = it->second * kRoles + role;
  return {delayed_impl::element(scale_, t), delayed_impl::element(history_, t * opt_.history_len)};
}

Fp8DelayedScaling::Tensor Fp8DelayedScaling::quantizer_views(const void* weight, Role role, const char* op) const {
  const Tensor t = tensor(weight, role, op);
  return {use_history ? t.scale : TensorView(), record ? t.amax : TensorView()};
}

std::string Fp8DelayedUpdateArgs::key() const {
  return fmt::format("fp8_delayed_update {} history={} {}", fp8_amax_algo_name(algo), history.describe(), margin);
}

BackendType fp8_delayed_update(const Fp8DelayedUpdateArgs& args) {
  delayed_impl::validate(args);
  static auto* d = detail::make_turbo_cpu_dispatcher<Fp8DelayedUpdateArgs>(
      "fp8_delayed_update", PRIMUS_TURBO_FN(delayed_impl::turbo_check), PRIMUS_TURBO_FN(delayed_impl::turbo_run),
      delayed_impl::cpu_check, delayed_impl::cpu_run);
  return d->dispatch(args);
}

}  // namespace primus::turbo
