#include "turbo/ops/gemm_problem.h"

#include <fmt/format.h>

#include <tuple>
#include <utility>

namespace primus::turbo::detail {

std::string matrix_layout(const TensorView& t, MatrixLayout* out) {
  if (!t.defined()) return "tensor not set";
  if (t.ndim != 2 && t.ndim != 3) return fmt::format("expected 2 or 3 dims, got {}", t.describe());
  MatrixLayout l;
  l.ptr = t.data;
  l.dtype = t.dtype;
  l.rows = t.size(-2);
  l.cols = t.size(-1);
  if (t.ndim == 3) {
    l.batch = t.size(0);
    l.batch_stride = t.stride(0);
  }
  const int64_t s_row = t.stride(-2), s_col = t.stride(-1);
  if (s_col == 1 || l.cols == 1) {
    l.transposed = false;
    l.ld = std::max<int64_t>(l.rows == 1 ? l.cols : s_row, l.cols);
  } else if (s_row == 1 || l.rows == 1) {
    l.transposed = true;
    l.ld = std::max<int64_t>(s_col, l.rows);
  } else {
    return fmt::format("neither row- nor column-major (strides {}, {}): {}", s_row, s_col, t.describe());
  }
  *out = l;
  return "";
}

std::string gemm_shape(const GemmArgs& g, GemmShape* out) {
  GemmShape s;
  if (auto w = matrix_layout(g.a, &s.a); !w.empty()) return "A: " + w;
  if (auto w = matrix_layout(g.b, &s.b); !w.empty()) return "B: " + w;
  if (auto w = matrix_layout(g.d, &s.d); !w.empty()) return "D: " + w;
  if (s.d.transposed && s.d.rows > 1 && s.d.cols > 1) return "D must be row-major: " + g.d.describe();
  s.d.transposed = false;
  s.m = s.a.rows;
  s.k = s.a.cols;
  s.n = s.b.cols;
  if (s.b.rows != s.k || s.d.rows != s.m || s.d.cols != s.n)
    return fmt::format("shapes do not chain: A {} @ B {} -> D {}", g.a.describe(), g.b.describe(),
                       g.d.describe());
  s.batch = std::max({s.a.batch, s.b.batch, s.d.batch});
  for (const MatrixLayout* l : {&s.a, &s.b, &s.d})
    if (l->batch != 1 && l->batch != s.batch)
      return fmt::format("batch sizes differ: A {}, B {}, D {}", g.a.describe(), g.b.describe(), g.d.describe());
  if (s.batch > 1 && s.d.batch != s.batch) return "D must carry the batch dimension";
  const bool fp8_a = dtype_is_fp8(g.a.dtype), fp8_b = dtype_is_fp8(g.b.dtype);
  if (fp8_a != fp8_b)
    return fmt::format("A is {} and B is {}: FP8 GEMMs take two FP8 operands", dtype_name(g.a.dtype),
                       dtype_name(g.b.dtype));
  if (fp8_a) {
    if (g.a.dtype == DType::F8E5M2 && g.b.dtype == DType::F8E5M2)
      return "A and B are both f8e5m2 (at least one FP8 operand must be f8e4m3)";
    if (g.d.dtype != DType::BF16 && g.d.dtype != DType::F16 && g.d.dtype != DType::F32)
      return fmt::format("an FP8 GEMM writes bf16, f16 or f32, not {}", dtype_name(g.d.dtype));
    using G = Fp8Granularity;
    const G ga = g.a_scaling, gb = g.b_scaling;
    const bool block_a = ga == G::Block1x128 || ga == G::Block128x128, block_b = gb == G::Block1x128 || gb == G::Block128x128;
    if (block_a || block_b) {
      if (!block_a || !block_b || (ga == G::Block128x128 && gb == G::Block128x128))
        return fmt::format("FP8 scalings {} (A) and {} (B) do not pair: block scaling takes 1x128 with 1x128 or "
                           "with 128x128", fp8_granularity_name(ga), fp8_granularity_name(gb));
      if (g.a.dtype != DType::F8E4M3 || g.b.dtype != DType::F8E4M3) return "block-scaled FP8 GEMMs take f8e4m3 operands";
      if (s.k % kFp8BlockSize != 0 || (ga == G::Block128x128 && s.m % kFp8BlockSize != 0) ||
          (gb == G::Block128x128 && s.n % kFp8BlockSize != 0))
        return fmt::format("block-scaled FP8 GEMM [{} x {} x {}]: K (and the 128x128-scaled operand's rows) must be "
                           "multiples of 128", s.m, s.n, s.k);
      if (g.fp8_fast_accum) return "block-scaled FP8 GEMMs run without fast accumulation";
      if (s.batch != 1) return "block-scaled FP8 GEMMs are not batched";
    } else if (ga != gb) {
      return fmt::format("FP8 scalings {} (A) and {} (B) differ (tensor with tensor, row with row)",
                         fp8_granularity_name(ga), fp8_granularity_name(gb));
    } else if (ga == G::Row && s.batch != 1) {
      return "row-scaled FP8 GEMMs are not batched";
    }
    for (const auto& [name, t, gr, rows] : {std::tuple{"a_scale", &g.a_scale, ga, s.m}, std::tuple{"b_scale", &g.b_scale, gb, s.n}}) {
      const int64_t want = fp8_scale_numel(gr, rows, s.k);
      if (!t->defined() || t->numel() != want || !t->is_contiguous() || t->dtype != DType::F32 || t->device != g.a.device)
        return fmt::format("an FP8 GEMM with {} scaling needs {} as {} contiguous f32 on the operands' device, got {}",
                           fp8_granularity_name(gr), name, want, t->defined() ? t->describe() : "none");
    }
  } else if (g.a_scale.defined() || g.b_scale.defined()) {
    return "a_scale / b_scale are for FP8 operands only";
  }
  const GemmEpilogue e = g.epilogue;
  const bool bias_in = e == GemmEpilogue::Bias || e == GemmEpilogue::GeluBias || e == GemmEpilogue::GeluAuxBias;
  const bool bias_out = e == GemmEpilogue::DGeluBGrad || e == GemmEpilogue::BGradA || e == GemmEpilogue::BGradB;
  if (bias_in || bias_out) {
    const int64_t want = e == GemmEpilogue::BGradA ? s.m : s.n;
    if (!g.bias.defined() || g.bias.numel() != want || !g.bias.is_contiguous())
      return fmt::format("epilogue {} needs a contiguous bias of {} elements, got {}",
                         gemm_epilogue_name(e), want, g.bias.defined() ? g.bias.describe() : "none");
  }
  const bool aux = e == GemmEpilogue::GeluAux || e == GemmEpilogue::GeluAuxBias ||
                   e == GemmEpilogue::DGelu || e == GemmEpilogue::DGeluBGrad;
  if (aux) {
    if (!g.aux.defined() || g.aux.ndim != 2 || g.aux.size(0) != s.m || g.aux.size(1) != s.n ||
        g.aux.stride(1) != 1)
      return fmt::format("epilogue {} needs a row-major aux [{}, {}], got {}", gemm_epilogue_name(e),
                         s.m, s.n, g.aux.defined() ? g.aux.describe() : "none");
    if (g.aux.dtype != g.d.dtype) return "aux must have the dtype of D";
  }
  *out = s;
  return "";
}

}  // namespace primus::turbo::detail
