#include "turbo/ops/quantization.h"

#include <fmt/format.h>

#include <algorithm>
#include <climits>
#include <cstdint>
#include <cstring>
#include <vector>

#include "turbo/kernels/cpu/quantize.h"
#include "turbo/ops/activation.h"
#include "turbo/ops/op_support.h"

#ifdef PRIMUS_TURBO_WITH_CUDA
#include "turbo/kernels/cuda/quantize.h"
#endif

namespace primus::turbo {
namespace {

constexpr const char* kOp = "quantize_fp8";

int64_t rows_of(const QuantizeFp8Args& a) { return a.inp.size(0); }
// The quantized tensor's columns: inp's, or the activation's with a prologue.
int64_t cols_of(const QuantizeFp8Args& a) {
  switch (a.prologue) {
    case QuantizePrologue::SwiGLU: return a.inp.size(1) / 2;
    case QuantizePrologue::SwiGLUBackward: return a.inp.size(1) * 2;
    case QuantizePrologue::None: break;
  }
  return a.inp.size(1);
}
const char* prologue_name(QuantizePrologue p) {
  switch (p) {
    case QuantizePrologue::SwiGLU: return "swiglu";
    case QuantizePrologue::SwiGLUBackward: return "swiglu_backward";
    case QuantizePrologue::None: break;
  }
  return "none";
}
// Elements between the starts of two rows of inp (C when there is only one row).
int64_t pitch_of(const QuantizeFp8Args& a) { return rows_of(a) > 1 ? a.inp.stride(0) : cols_of(a); }
DType fp8_of(const QuantizeFp8Args& a) { return a.out.defined() ? a.out.dtype : a.out_t.dtype; }
bool has_row_groups(const QuantizeFp8Args& a) { return a.offsets.defined() || a.group_rows != 0; }
// G, the number of row groups (with row groups).
int64_t groups_of(const QuantizeFp8Args& a) {
  return a.offsets.defined() ? a.offsets.numel() - 1 : rows_of(a) / a.group_rows;
}

void check_fp8_output(const TensorView& t, const TensorView& inp, std::initializer_list<int64_t> shape, const char* arg) {
  if (!dtype_is_fp8(t.dtype))
    throw RuntimeError(fmt::format("{}: {}: expected f8e4m3 or f8e5m2 got {} ({})", kOp, arg, dtype_name(t.dtype),
                                   t.describe()));
  check_shape(t, shape, kOp, arg);
  check_contiguous(t, kOp, arg);
  check_same_device(t, inp, kOp);
}

// Row groups: which combinations make sense (see quantization.h); the offsets' values are checked
// where they are read (the host backend; the device clamps them).
void validate_row_groups(const QuantizeFp8Args& a) {
  const char* arg = a.offsets.defined() ? "offsets" : "group_rows";
  if (a.offsets.defined() && a.group_rows != 0)
    throw RuntimeError(fmt::format("{}: offsets and group_rows = {} are both set (give the row groups one way)", kOp,
                                   a.group_rows));
  if (a.granularity != Fp8Granularity::Row)
    throw RuntimeError(fmt::format("{}: {}: row groups scale out_t per group and column, at row granularity only, "
                                   "got {} granularity",
                                   kOp, arg, fp8_granularity_name(a.granularity)));
  if (!a.out_t.defined())
    throw RuntimeError(fmt::format("{}: {}: row groups give the scales of out_t, which is not set", kOp, arg));
  if (a.scale.defined() || a.amax.defined())
    throw RuntimeError(fmt::format("{}: {}: row groups take current scaling, not with {} (delayed scaling)", kOp, arg,
                                   a.scale.defined() ? "scale" : "amax"));
  const int64_t R = rows_of(a);
  if (R > INT32_MAX)
    throw RuntimeError(fmt::format("{}: {}: row groups count rows in int32, inp has {}", kOp, arg, R));
  if (a.offsets.defined()) {
    check_dtype(a.offsets, DType::I32, kOp, "offsets");
    if (a.offsets.ndim != 1 || a.offsets.numel() < 1 || !a.offsets.is_contiguous())
      throw RuntimeError(fmt::format("{}: offsets: expected a contiguous [G + 1] vector, got {}", kOp,
                                     a.offsets.describe()));
    check_same_device(a.offsets, a.inp, kOp);
  } else if (a.group_rows < 0 || R % a.group_rows != 0) {
    throw RuntimeError(fmt::format("{}: group_rows = {}: expected a positive divisor of the {} rows of inp", kOp,
                                   a.group_rows, R));
  }
}

void validate_prologue(const QuantizeFp8Args& a) {
  const char* name = prologue_name(a.prologue);
  if (a.prologue == QuantizePrologue::None) {
    if (a.gate_up.defined())
      throw RuntimeError(fmt::format("{}: gate_up {} is set without a prologue that reads it", kOp, a.gate_up.describe()));
    return;
  }
  if (a.granularity != Fp8Granularity::Tensor || !a.scale.defined() || a.maxima.defined() || has_row_groups(a))
    throw RuntimeError(fmt::format("{}: prologue {} takes tensor granularity with delayed scaling (scale), no maxima "
                                   "and no row groups; got {} granularity{}{}{}",
                                   kOp, name, fp8_granularity_name(a.granularity), a.scale.defined() ? "" : ", no scale",
                                   a.maxima.defined() ? ", maxima" : "", has_row_groups(a) ? ", row groups" : ""));
  if (!a.inp.is_contiguous())
    throw RuntimeError(fmt::format("{}: prologue {}: inp must be contiguous, got {}", kOp, name, a.inp.describe()));
  if (a.prologue == QuantizePrologue::SwiGLU) {
    if (a.inp.size(1) % 2 != 0)
      throw RuntimeError(fmt::format("{}: prologue swiglu: inp is gate_up [R, 2F], got an odd width {}", kOp,
                                     a.inp.describe()));
    if (a.gate_up.defined())
      throw RuntimeError(fmt::format("{}: prologue swiglu reads gate_up as inp; gate_up {} is set too", kOp,
                                     a.gate_up.describe()));
    return;
  }
  check_defined(a.gate_up, kOp, "gate_up");
  check_shape(a.gate_up, {a.inp.size(0), 2 * a.inp.size(1)}, kOp, "gate_up");
  check_contiguous(a.gate_up, kOp, "gate_up");
  check_same_device(a.gate_up, a.inp, kOp);
  if (a.gate_up.dtype != a.inp.dtype)
    throw RuntimeError(fmt::format("{}: gate_up is {} but inp is {} (one type)", kOp, dtype_name(a.gate_up.dtype),
                                   dtype_name(a.inp.dtype)));
}

void validate(const QuantizeFp8Args& a) {
  check_defined(a.inp, kOp, "inp");
  if (a.inp.ndim != 2)
    throw RuntimeError(fmt::format("{}: inp: expected a 2-D [R, C] tensor got {}", kOp, a.inp.describe()));
  validate_prologue(a);
  if (a.inp.dtype != DType::F32 && a.inp.dtype != DType::BF16)
    throw RuntimeError(fmt::format("{}: inp: expected f32 or bf16 got {} ({})", kOp, dtype_name(a.inp.dtype),
                                   a.inp.describe()));
  const int64_t R = rows_of(a), C = cols_of(a), W = a.inp.size(1);
  if ((W > 1 && a.inp.stride(1) != 1) || (R > 1 && a.inp.stride(0) < W))
    throw RuntimeError(fmt::format("{}: inp: rows must be contiguous (stride(1) == 1, stride(0) >= {}), got {}", kOp,
                                   W, a.inp.describe()));
  if (!a.out.defined() && !a.out_t.defined())
    throw RuntimeError(fmt::format("{}: neither out nor out_t is set (at least one output is needed)", kOp));
  if (a.out.defined()) check_fp8_output(a.out, a.inp, {R, C}, "out");
  if (a.out_t.defined()) check_fp8_output(a.out_t, a.inp, {C, R}, "out_t");
  if (a.out.defined() && a.out_t.defined() && a.out.dtype != a.out_t.dtype)
    throw RuntimeError(fmt::format("{}: out is {} but out_t is {} (one FP8 dtype for both)", kOp,
                                   dtype_name(a.out.dtype), dtype_name(a.out_t.dtype)));
  if (has_row_groups(a)) validate_row_groups(a);
  if (a.maxima.defined()) {
    const bool row = a.granularity == Fp8Granularity::Row, tensor = a.granularity == Fp8Granularity::Tensor;
    if ((!row && !tensor) || (row && !a.out_t.defined()) || has_row_groups(a) || a.scale.defined() || a.amax.defined())
      throw RuntimeError(fmt::format("{}: maxima serve Row granularity with out_t or Tensor granularity, current "
                                     "scaling and no row groups; got {} granularity{}{}{}",
                                     kOp, fp8_granularity_name(a.granularity), a.out_t.defined() ? "" : ", no out_t",
                                     has_row_groups(a) ? ", row groups" : "",
                                     a.scale.defined() || a.amax.defined() ? ", delayed scaling" : ""));
    check_dtype(a.maxima, DType::F32, kOp, "maxima");
    const int64_t want = row ? R + C : 1;
    if (a.maxima.numel() != want || !a.maxima.is_contiguous())
      throw RuntimeError(fmt::format("{}: maxima: {} of a [{}, {}] matrix {} {} contiguous f32, got {}", kOp,
                                     row ? "the row and column maxima" : "the maximum", R, C, row ? "are" : "is", want,
                                     a.maxima.describe()));
    check_same_device(a.maxima, a.inp, kOp);
  }
  if (a.rows_in_use.defined()) {
    if (a.granularity != Fp8Granularity::Tensor || a.maxima.defined() || has_row_groups(a) ||
        a.prologue != QuantizePrologue::None)
      throw RuntimeError(fmt::format("{}: rows_in_use limits the amax of Tensor granularity (no maxima, row groups "
                                     "or prologue); got {} granularity{}{}{}",
                                     kOp, fp8_granularity_name(a.granularity), a.maxima.defined() ? ", maxima" : "",
                                     has_row_groups(a) ? ", row groups" : "",
                                     a.prologue != QuantizePrologue::None ? ", a prologue" : ""));
    check_dtype(a.rows_in_use, DType::I32, kOp, "rows_in_use");
    if (a.rows_in_use.numel() != 1)
      throw RuntimeError(fmt::format("{}: rows_in_use: one i32, got {}", kOp, a.rows_in_use.describe()));
    check_same_device(a.rows_in_use, a.inp, kOp);
  }
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
  if (a.out_t.defined() && g != Fp8Granularity::Tensor && !has_row_groups(a))
    check_scales(a.scale_inv_t, C, R, "scale_inv_t");
  if (has_row_groups(a)) {
    const int64_t G = groups_of(a);
    check_defined(a.scale_inv_t, kOp, "scale_inv_t");
    check_dtype(a.scale_inv_t, DType::F32, kOp, "scale_inv_t");
    if (a.scale_inv_t.numel() != G * C || !a.scale_inv_t.is_contiguous())
      throw RuntimeError(fmt::format("{}: scale_inv_t: the column scales of {} row groups of a [{}, {}] matrix are "
                                     "[G, C] = {} contiguous f32, got {}",
                                     kOp, G, R, C, G * C, a.scale_inv_t.describe()));
    check_same_device(a.scale_inv_t, a.inp, kOp);
  }
}

std::string cpu_check(const QuantizeFp8Args& a) {
  return detail::all_on(Device::CPU, {{"inp", &a.inp}, {"out", &a.out}, {"out_t", &a.out_t}, {"scale_inv", &a.scale_inv},
                                      {"scale_inv_t", &a.scale_inv_t}, {"scale", &a.scale}, {"amax", &a.amax},
                                      {"offsets", &a.offsets}, {"maxima", &a.maxima}, {"gate_up", &a.gate_up},
                                      {"rows_in_use", &a.rows_in_use}});
}
// Host maxima must be inp's own: the device quantizer trusts them, so the reference is where a
// producer that gets them wrong shows.
void cpu_check_maxima(const QuantizeFp8Args& a) {
  const int64_t R = rows_of(a), C = cols_of(a);
  const bool tensor = a.granularity == Fp8Granularity::Tensor;
  std::vector<uint32_t> m(static_cast<size_t>(R + C), 0);
  for (int64_t r = 0; r < R; ++r) {
    const char* row = static_cast<const char*>(a.inp.data) + r * pitch_of(a) * static_cast<int64_t>(dtype_size(a.inp.dtype));
    for (int64_t c = 0; c < C; ++c) {
      uint32_t b;
      if (a.inp.dtype == DType::F32) {
        std::memcpy(&b, row + 4 * c, 4);
      } else {
        uint16_t h;
        std::memcpy(&h, row + 2 * c, 2);
        b = static_cast<uint32_t>(h) << 16;
      }
      b &= 0x7fffffffu;
      m[r] = std::max(m[r], b);
      m[R + c] = std::max(m[R + c], b);
    }
  }
  const uint32_t* given = a.maxima.ptr<const uint32_t>();
  if (tensor) {
    const uint32_t all = R > 0 ? *std::max_element(m.begin(), m.begin() + R) : 0u;
    if (given[0] != all) {
      float want, got;
      std::memcpy(&want, &all, 4);
      std::memcpy(&got, given, 4);
      throw RuntimeError(fmt::format("{}: maxima: inp {} has max |x| {}, maxima say {}", kOp, a.inp.describe(), want, got));
    }
    return;
  }
  for (int64_t i = 0; i < R + C; ++i)
    if (given[i] != m[i]) {
      float want, got;
      std::memcpy(&want, &m[i], 4);
      std::memcpy(&got, &given[i], 4);
      throw RuntimeError(fmt::format("{}: maxima: {} {} of inp {} has max |x| {}, maxima say {}", kOp,
                                     i < R ? "row" : "column", i < R ? i : i - R, a.inp.describe(), want, got));
    }
}
// amax = max(amax, the value with f32 bits m), compared as bits (both >= 0; NaN's bits are the largest).
void fold_amax(const TensorView& amax, uint32_t m) {
  if (!amax.defined()) return;
  uint32_t cur;
  std::memcpy(&cur, amax.data, 4);
  if (m > cur) std::memcpy(amax.data, &m, 4);
}
// Row groups on the host: out (per row, all rows) as without groups, then out_t per group.
void cpu_run_row_groups(const QuantizeFp8Args& a) {
  const int64_t R = rows_of(a), G = groups_of(a);
  std::vector<int32_t> uniform;
  const int32_t* offsets = a.offsets.ptr<const int32_t>();
  if (!a.offsets.defined()) {
    uniform.resize(static_cast<size_t>(G + 1));
    for (int64_t g = 0; g <= G; ++g) uniform[static_cast<size_t>(g)] = static_cast<int32_t>(g * a.group_rows);
    offsets = uniform.data();
  }
  cpu::check_row_groups(offsets, G, R, kOp);
  if (a.out.defined())
    cpu::quantize_fp8_grouped(a.inp.data, a.inp.dtype, R, cols_of(a), pitch_of(a), Fp8Granularity::Row,
                              a.out.ptr<uint8_t>(), a.scale_inv.ptr<float>(), nullptr, nullptr, fp8_of(a));
  cpu::quantize_fp8_row_groups_t(a.inp.data, a.inp.dtype, R, cols_of(a), pitch_of(a), offsets, G,
                                 a.out_t.ptr<uint8_t>(), a.scale_inv_t.ptr<float>(), fp8_of(a));
}
void cpu_run(const QuantizeFp8Args& a);
// The reference of a prologue: the activation written into host memory, then quantized.
void cpu_run_prologue(const QuantizeFp8Args& a) {
  const int64_t R = rows_of(a), C = cols_of(a);
  std::vector<char> buf(static_cast<size_t>(R * C) * dtype_size(a.inp.dtype));
  const TensorView y(buf.data(), a.inp.dtype, Device::CPU, {R, C});
  run_quantize_prologue(a.prologue, y, a.inp, a.gate_up, a.ctx);
  QuantizeFp8Args q = a;
  q.prologue = QuantizePrologue::None;
  q.gate_up = TensorView();
  q.inp = y;
  cpu_run(q);
}
void cpu_run(const QuantizeFp8Args& a) {
  if (a.prologue != QuantizePrologue::None) {
    cpu_run_prologue(a);
    return;
  }
  if (has_row_groups(a)) {
    cpu_run_row_groups(a);
    return;
  }
  if (a.maxima.defined()) cpu_check_maxima(a);
  if (a.granularity != Fp8Granularity::Tensor) {
    cpu::quantize_fp8_grouped(a.inp.data, a.inp.dtype, rows_of(a), cols_of(a), pitch_of(a), a.granularity,
                              a.out.ptr<uint8_t>(), a.scale_inv.ptr<float>(), a.out_t.ptr<uint8_t>(),
                              a.scale_inv_t.ptr<float>(), fp8_of(a));
    return;
  }
  if (a.scale.defined()) {
    const float scale = *a.scale.ptr<float>();
    const int64_t used =
        a.rows_in_use.defined() ? std::clamp<int64_t>(*a.rows_in_use.ptr<const int32_t>(), 0, rows_of(a)) : -1;
    fold_amax(a.amax, cpu::quantize_fp8_with_scale(a.inp.data, a.inp.dtype, rows_of(a), cols_of(a), pitch_of(a), scale,
                                                   a.out.ptr<uint8_t>(), a.out_t.ptr<uint8_t>(), fp8_of(a), used));
    const float inv = 1.0f / scale;
    std::memcpy(a.scale_inv.data, &inv, sizeof(float));
    return;
  }
  const int64_t R = rows_of(a);
  const int64_t used = a.rows_in_use.defined() ? std::clamp<int64_t>(*a.rows_in_use.ptr<const int32_t>(), 0, R) : R;
  const cpu::Fp8Scaling s = cpu::quantize_fp8_tensorwise(a.inp.data, a.inp.dtype, R, cols_of(a), pitch_of(a),
                                                          a.out.ptr<uint8_t>(), a.out_t.ptr<uint8_t>(), fp8_of(a), used);
  std::memcpy(a.scale_inv.data, &s.scale_inv, sizeof(float));
  uint32_t m;
  std::memcpy(&m, &s.amax, 4);
  fold_amax(a.amax, m);
}

#ifdef PRIMUS_TURBO_WITH_CUDA
std::string prologue_unsupported(const QuantizeFp8Args& a) {
  const bool bwd = a.prologue == QuantizePrologue::SwiGLUBackward;
  return cuda::quantize_fp8_swiglu_unsupported_reason(a.inp.dtype, fp8_of(a), bwd ? a.gate_up.data : a.inp.data,
                                                      bwd ? a.inp.data : nullptr, rows_of(a),
                                                      bwd ? a.inp.size(1) : cols_of(a), a.out.data, a.out_t.data);
}
std::string turbo_check(const QuantizeFp8Args& a) {
  if (auto w = detail::all_on(Device::CUDA, {{"inp", &a.inp}, {"out", &a.out}, {"out_t", &a.out_t}, {"scale_inv", &a.scale_inv},
                                             {"scale_inv_t", &a.scale_inv_t}, {"scale", &a.scale}, {"amax", &a.amax},
                                             {"offsets", &a.offsets}, {"maxima", &a.maxima}, {"gate_up", &a.gate_up},
                                             {"rows_in_use", &a.rows_in_use}});
      !w.empty())
    return w;
  if (a.prologue != QuantizePrologue::None) {
    if (auto w = prologue_unsupported(a); !w.empty()) return fmt::format("prologue {}: {}", prologue_name(a.prologue), w);
    return "";
  }
  if (a.ctx.scratch == nullptr) return "ctx.scratch is not set (the amax partials need 4 KiB of device scratch)";
  return "";
}
void turbo_run(const QuantizeFp8Args& a) {
  if (a.prologue != QuantizePrologue::None) {
    const bool bwd = a.prologue == QuantizePrologue::SwiGLUBackward;
    cuda::quantize_fp8_swiglu(bwd, a.inp.dtype, fp8_of(a), bwd ? a.gate_up.data : a.inp.data, bwd ? a.inp.data : nullptr,
                              rows_of(a), bwd ? a.inp.size(1) : cols_of(a), a.out.data, a.out_t.data,
                              a.scale.ptr<float>(), a.scale_inv.ptr<float>(),
                              a.amax.defined() ? a.amax.ptr<float>() : nullptr, static_cast<cudaStream_t>(a.ctx.stream));
    return;
  }
  Arena& arena = detail::scratch_of(a.ctx, kOp);
  ArenaScope scope(arena);
  if (has_row_groups(a)) {
    const int64_t R = rows_of(a), C = cols_of(a), G = groups_of(a);
    void* maxima = arena.allocate(cuda::quantize_fp8_row_groups_scratch_bytes(R, C, G, a.out.defined()),
                                  Arena::kDefaultAlign, "quantize_fp8 row-group maxima");
    cuda::quantize_fp8_row_groups(a.inp.dtype, fp8_of(a), a.inp.data, R, C, pitch_of(a), a.offsets.ptr<const int32_t>(),
                                  a.group_rows, G, a.out.data, a.scale_inv.ptr<float>(), a.out_t.data,
                                  a.scale_inv_t.ptr<float>(), maxima, static_cast<cudaStream_t>(a.ctx.stream));
    return;
  }
  if (a.granularity != Fp8Granularity::Tensor) {
    void* partials = arena.allocate(cuda::quantize_fp8_grouped_scratch_bytes(rows_of(a), cols_of(a), a.granularity),
                                    Arena::kDefaultAlign, "quantize_fp8 group amax");
    cuda::quantize_fp8_grouped(a.inp.dtype, fp8_of(a), a.inp.data, rows_of(a), cols_of(a), pitch_of(a), a.granularity,
                               a.out.data, a.scale_inv.ptr<float>(), a.out_t.data, a.scale_inv_t.ptr<float>(), partials,
                               static_cast<cudaStream_t>(a.ctx.stream),
                               a.maxima.defined() ? a.maxima.ptr<const float>() : nullptr);
    return;
  }
  void* partials = arena.allocate(cuda::quantize_fp8_scratch_bytes(), Arena::kDefaultAlign, "quantize_fp8 amax partials");
  cuda::quantize_fp8_tensorwise(a.inp.dtype, fp8_of(a), a.inp.data, rows_of(a), cols_of(a), pitch_of(a), a.out.data,
                                a.out_t.data, a.scale_inv.ptr<float>(), partials, static_cast<cudaStream_t>(a.ctx.stream),
                                a.scale.defined() ? a.scale.ptr<float>() : nullptr,
                                a.amax.defined() ? a.amax.ptr<float>() : nullptr,
                                a.maxima.defined() ? a.maxima.ptr<const float>() : nullptr,
                                a.rows_in_use.defined() ? a.rows_in_use.ptr<const int32_t>() : nullptr);
}
#endif

}  // namespace

std::string QuantizeFp8Args::key() const {
  const std::string groups = offsets.defined() ? fmt::format(" offsets={}", offsets.describe())
                             : group_rows != 0 ? fmt::format(" group_rows={}", group_rows)
                                               : std::string();
  const std::string pro = prologue == QuantizePrologue::None ? std::string() : fmt::format(" prologue={}", prologue_name(prologue));
  return fmt::format("quantize_fp8 {}{}{}{}{}{} inp={} out={} out_t={}", fp8_granularity_name(granularity),
                     scale.defined() ? " delayed" : "", groups, maxima.defined() ? " maxima" : "",
                     rows_in_use.defined() ? " rows_in_use" : "", pro, inp.describe(), out.defined() ? out.describe() : "-",
                     out_t.defined() ? out_t.describe() : "-");
}

BackendType quantize_fp8(const QuantizeFp8Args& args) {
  validate(args);
  static auto* d = detail::make_turbo_cpu_dispatcher<QuantizeFp8Args>("quantize", PRIMUS_TURBO_FN(turbo_check),
                                                                       PRIMUS_TURBO_FN(turbo_run), cpu_check, cpu_run);
  return d->dispatch(args);
}

void run_quantize_prologue(QuantizePrologue kind, const TensorView& out, const TensorView& inp,
                           const TensorView& gate_up, const ExecContext& ctx) {
  switch (kind) {
    case QuantizePrologue::SwiGLU:
      activation_forward({Activation::SwiGLU, out, inp, ctx});
      return;
    case QuantizePrologue::SwiGLUBackward: {
      ActivationBackwardArgs b;
      b.act = Activation::SwiGLU;
      b.dinp = out;
      b.inp = gate_up;
      b.dout = inp;
      b.ctx = ctx;
      activation_backward(b);
      return;
    }
    case QuantizePrologue::None: break;
  }
  throw RuntimeError(fmt::format("run_quantize_prologue: no prologue to run into {}", out.describe()));
}

bool quantize_fp8_prologue_fits(const QuantizeFp8Args& a) {
  if (a.prologue == QuantizePrologue::None || !a.inp.defined()) return false;
  if (a.inp.device == Device::CPU) return true;
#ifdef PRIMUS_TURBO_WITH_CUDA
  return prologue_unsupported(a).empty();
#else
  return false;
#endif
}

}  // namespace primus::turbo
