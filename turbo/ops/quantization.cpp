#include "turbo/ops/quantization.h"

#include <fmt/format.h>

#include <cstring>

#include "turbo/kernels/cpu/quantize.h"
#include "turbo/ops/op_support.h"

#ifdef PRIMUS_TURBO_WITH_CUDA
#include "turbo/kernels/cuda/quantize.h"
#endif

namespace primus::turbo {
namespace {

constexpr const char* kOp = "quantize_fp8";

int64_t rows_of(const QuantizeFp8Args& a) { return a.inp.size(0); }
int64_t cols_of(const QuantizeFp8Args& a) { return a.inp.size(1); }
// Elements between the starts of two rows of inp (C when there is only one row).
int64_t pitch_of(const QuantizeFp8Args& a) { return rows_of(a) > 1 ? a.inp.stride(0) : cols_of(a); }
DType fp8_of(const QuantizeFp8Args& a) { return a.out.defined() ? a.out.dtype : a.out_t.dtype; }

void check_fp8_output(const TensorView& t, const TensorView& inp, std::initializer_list<int64_t> shape, const char* arg) {
  if (!dtype_is_fp8(t.dtype))
    throw RuntimeError(fmt::format("{}: {}: expected f8e4m3 or f8e5m2 got {} ({})", kOp, arg, dtype_name(t.dtype),
                                   t.describe()));
  check_shape(t, shape, kOp, arg);
  check_contiguous(t, kOp, arg);
  check_same_device(t, inp, kOp);
}

void validate(const QuantizeFp8Args& a) {
  check_defined(a.inp, kOp, "inp");
  if (a.inp.ndim != 2)
    throw RuntimeError(fmt::format("{}: inp: expected a 2-D [R, C] tensor got {}", kOp, a.inp.describe()));
  if (a.inp.dtype != DType::F32 && a.inp.dtype != DType::BF16)
    throw RuntimeError(fmt::format("{}: inp: expected f32 or bf16 got {} ({})", kOp, dtype_name(a.inp.dtype),
                                   a.inp.describe()));
  const int64_t R = rows_of(a), C = cols_of(a);
  if ((C > 1 && a.inp.stride(1) != 1) || (R > 1 && a.inp.stride(0) < C))
    throw RuntimeError(fmt::format("{}: inp: rows must be contiguous (stride(1) == 1, stride(0) >= {}), got {}", kOp,
                                   C, a.inp.describe()));
  if (!a.out.defined() && !a.out_t.defined())
    throw RuntimeError(fmt::format("{}: neither out nor out_t is set (at least one output is needed)", kOp));
  if (a.out.defined()) check_fp8_output(a.out, a.inp, {R, C}, "out");
  if (a.out_t.defined()) check_fp8_output(a.out_t, a.inp, {C, R}, "out_t");
  if (a.out.defined() && a.out_t.defined() && a.out.dtype != a.out_t.dtype)
    throw RuntimeError(fmt::format("{}: out is {} but out_t is {} (one FP8 dtype for both)", kOp,
                                   dtype_name(a.out.dtype), dtype_name(a.out_t.dtype)));
  const Fp8Granularity g = a.granularity;
  if ((g == Fp8Granularity::Block1x128 || g == Fp8Granularity::Block128x128) &&
      (R % kFp8BlockSize != 0 || C % kFp8BlockSize != 0))
    throw RuntimeError(fmt::format("{}: {} blocks need both dimensions of inp to be multiples of {}, got {}", kOp,
                                   fp8_granularity_name(g), kFp8BlockSize, a.inp.describe()));
  const auto check_scales = [&](const TensorView& t, int64_t rows, int64_t cols, const char* arg) {
    check_defined(t, kOp, arg);
    check_dtype(t, DType::F32, kOp, arg);
    if (t.numel() != fp8_scale_numel(g, rows, cols) || !t.is_contiguous())
      throw RuntimeError(fmt::format("{}: {}: {} scales of a [{}, {}] matrix are {} contiguous f32, got {}", kOp, arg,
                                     fp8_granularity_name(g), rows, cols, fp8_scale_numel(g, rows, cols), t.describe()));
    check_same_device(t, a.inp, kOp);
  };
  for (const auto& [t, arg] : {std::pair{&a.scale, "scale"}, std::pair{&a.amax, "amax"}}) {
    if (!t->defined()) continue;
    check_dtype(*t, DType::F32, kOp, arg);
    if (t->numel() != 1)
      throw RuntimeError(fmt::format("{}: {}: one f32 (delayed scaling), got {}", kOp, arg, t->describe()));
    check_same_device(*t, a.inp, kOp);
  }
  if (a.scale.defined() && g != Fp8Granularity::Tensor)
    throw RuntimeError(fmt::format("{}: scale (delayed scaling) is per tensor, not at {} granularity", kOp,
                                   fp8_granularity_name(g)));
  if (a.amax.defined() && g != Fp8Granularity::Tensor)
    throw RuntimeError(fmt::format("{}: amax is recorded per tensor, not at {} granularity", kOp, fp8_granularity_name(g)));
  if (a.out.defined() || g == Fp8Granularity::Tensor) check_scales(a.scale_inv, R, C, "scale_inv");
  if (a.out_t.defined() && g != Fp8Granularity::Tensor) check_scales(a.scale_inv_t, C, R, "scale_inv_t");
}

std::string cpu_check(const QuantizeFp8Args& a) {
  return detail::all_on(Device::CPU, {{"inp", &a.inp}, {"out", &a.out}, {"out_t", &a.out_t}, {"scale_inv", &a.scale_inv},
                                      {"scale_inv_t", &a.scale_inv_t}, {"scale", &a.scale}, {"amax", &a.amax}});
}
// amax = max(amax, the value with f32 bits m), compared as bits (both >= 0; NaN's bits are the largest).
void fold_amax(const TensorView& amax, uint32_t m) {
  if (!amax.defined()) return;
  uint32_t cur;
  std::memcpy(&cur, amax.data, 4);
  if (m > cur) std::memcpy(amax.data, &m, 4);
}
void cpu_run(const QuantizeFp8Args& a) {
  if (a.granularity != Fp8Granularity::Tensor) {
    cpu::quantize_fp8_grouped(a.inp.data, a.inp.dtype, rows_of(a), cols_of(a), pitch_of(a), a.granularity,
                              a.out.ptr<uint8_t>(), a.scale_inv.ptr<float>(), a.out_t.ptr<uint8_t>(),
                              a.scale_inv_t.ptr<float>(), fp8_of(a));
    return;
  }
  if (a.scale.defined()) {
    const float scale = *a.scale.ptr<float>();
    fold_amax(a.amax, cpu::quantize_fp8_with_scale(a.inp.data, a.inp.dtype, rows_of(a), cols_of(a), pitch_of(a), scale,
                                                   a.out.ptr<uint8_t>(), a.out_t.ptr<uint8_t>(), fp8_of(a)));
    const float inv = 1.0f / scale;
    std::memcpy(a.scale_inv.data, &inv, sizeof(float));
    return;
  }
  const cpu::Fp8Scaling s = cpu::quantize_fp8_tensorwise(a.inp.data, a.inp.dtype, rows_of(a), cols_of(a), pitch_of(a),
                                                          a.out.ptr<uint8_t>(), a.out_t.ptr<uint8_t>(), fp8_of(a));
  std::memcpy(a.scale_inv.data, &s.scale_inv, sizeof(float));
  uint32_t m;
  std::memcpy(&m, &s.amax, 4);
  fold_amax(a.amax, m);
}

#ifdef PRIMUS_TURBO_WITH_CUDA
std::string turbo_check(const QuantizeFp8Args& a) {
  if (auto w = detail::all_on(Device::CUDA, {{"inp", &a.inp}, {"out", &a.out}, {"out_t", &a.out_t}, {"scale_inv", &a.scale_inv},
                                             {"scale_inv_t", &a.scale_inv_t}, {"scale", &a.scale}, {"amax", &a.amax}});
      !w.empty())
    return w;
  if (a.ctx.scratch == nullptr) return "ctx.scratch is not set (the amax partials need 4 KiB of device scratch)";
  return "";
}
void turbo_run(const QuantizeFp8Args& a) {
  Arena& arena = detail::scratch_of(a.ctx, kOp);
  ArenaScope scope(arena);
  if (a.granularity != Fp8Granularity::Tensor) {
    void* partials = arena.allocate(cuda::quantize_fp8_grouped_scratch_bytes(rows_of(a), cols_of(a), a.granularity),
                                    Arena::kDefaultAlign, "quantize_fp8 group amax");
    cuda::quantize_fp8_grouped(a.inp.dtype, fp8_of(a), a.inp.data, rows_of(a), cols_of(a), pitch_of(a), a.granularity,
                               a.out.data, a.scale_inv.ptr<float>(), a.out_t.data, a.scale_inv_t.ptr<float>(), partials,
                               static_cast<cudaStream_t>(a.ctx.stream));
    return;
  }
  void* partials = arena.allocate(cuda::quantize_fp8_scratch_bytes(), Arena::kDefaultAlign, "quantize_fp8 amax partials");
  cuda::quantize_fp8_tensorwise(a.inp.dtype, fp8_of(a), a.inp.data, rows_of(a), cols_of(a), pitch_of(a), a.out.data,
                                a.out_t.data, a.scale_inv.ptr<float>(), partials, static_cast<cudaStream_t>(a.ctx.stream),
                                a.scale.defined() ? a.scale.ptr<float>() : nullptr,
                                a.amax.defined() ? a.amax.ptr<float>() : nullptr);
}
#endif

}  // namespace

std::string QuantizeFp8Args::key() const {
  return fmt::format("quantize_fp8 {}{} inp={} out={} out_t={}", fp8_granularity_name(granularity),
                     scale.defined() ? " delayed" : "", inp.describe(), out.defined() ? out.describe() : "-",
                     out_t.defined() ? out_t.describe() : "-");
}

BackendType quantize_fp8(const QuantizeFp8Args& args) {
  validate(args);
  static auto* d = detail::make_turbo_cpu_dispatcher<QuantizeFp8Args>("quantize", PRIMUS_TURBO_FN(turbo_check),
                                                                       PRIMUS_TURBO_FN(turbo_run), cpu_check, cpu_run);
  return d->dispatch(args);
}

}  // namespace primus::turbo
