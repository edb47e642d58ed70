// The CPU backend of gemm: host f32 tensors, the reference kernels' product (OpenBLAS on OpenMP's
// threads, turbo/kernels/cpu/matmul.h) and plain loops for the epilogues (the GELU math is the
// reference kernels' own, turbo/kernels/cpu/activation.h).

#include <vector>

#include "turbo/core/dtype.h"
#include "turbo/kernels/cpu/activation.h"
#include "turbo/kernels/cpu/matmul.h"
#include "turbo/ops/gemm_cpu.h"

namespace primus::turbo::detail {

void gemm_cpu(const GemmArgs& g, const GemmShape& s) {
  const auto* A = static_cast<const float*>(s.a.ptr);
  const auto* B = static_cast<const float*>(s.b.ptr);
  auto* D = static_cast<float*>(s.d.ptr);
  auto* bias = static_cast<float*>(g.bias.data);
  auto* aux = static_cast<float*>(g.aux.data);
  const int64_t aux_ld = g.aux.defined() ? g.aux.stride(0) : 0;
  const GemmEpilogue e = g.epilogue;
  std::vector<float> row(static_cast<size_t>(s.n)), zero(static_cast<size_t>(s.n));
  for (int64_t b = 0; b < s.batch; ++b) {
    const float* a = A + (s.a.batch > 1 ? b * s.a.batch_stride : 0);
    const float* bb = B + (s.b.batch > 1 ? b * s.b.batch_stride : 0);
    float* d = D + b * s.d.batch_stride;
    cpu::gemm_f32(s.a.transposed, s.b.transposed, s.m, s.n, s.k, g.alpha, a, s.a.ld, bb, s.b.ld, g.beta, d, s.d.ld);
    for (int64_t i = 0; i < s.m; ++i) {
      float* di = d + i * s.d.ld;
      switch (e) {
        case GemmEpilogue::Bias:
          for (int64_t j = 0; j < s.n; ++j) di[j] += bias[j];
          break;
        case GemmEpilogue::Gelu:
        case GemmEpilogue::GeluBias:
        case GemmEpilogue::GeluAux:
        case GemmEpilogue::GeluAuxBias: {
          const bool with_bias = e == GemmEpilogue::GeluBias || e == GemmEpilogue::GeluAuxBias;
          for (int64_t j = 0; j < s.n; ++j) row[j] = di[j] + (with_bias ? bias[j] : 0.0f);
          if (e == GemmEpilogue::GeluAux || e == GemmEpilogue::GeluAuxBias)
            std::copy(row.begin(), row.end(), aux + i * aux_ld);
          cpu::gelu_forward(di, row.data(), s.n);
          break;
        }
        case GemmEpilogue::DGelu:
        case GemmEpilogue::DGeluBGrad:
          // gelu_backward accumulates into its first argument: start from zero.
          std::fill(row.begin(), row.end(), 0.0f);
          cpu::gelu_backward(row.data(), aux + i * aux_ld, di, s.n);
          std::copy(row.begin(), row.end(), di);
          break;
        default:
          break;
      }
    }
    if (e == GemmEpilogue::DGeluBGrad || e == GemmEpilogue::BGradB || e == GemmEpilogue::BGradA) {
      // Bias gradients: column sums of D (DGeluBGrad), of logical B over K, of logical A over K.
      const int64_t len = e == GemmEpilogue::BGradA ? s.m : s.n;
      for (int64_t j = 0; j < len; ++j) {
        double acc = 0.0;
        if (e == GemmEpilogue::DGeluBGrad) {
          for (int64_t i = 0; i < s.m; ++i) acc += d[i * s.d.ld + j];
        } else if (e == GemmEpilogue::BGradB) {
          for (int64_t kk = 0; kk < s.k; ++kk)
            acc += s.b.transposed ? bb[j * s.b.ld + kk] : bb[kk * s.b.ld + j];
        } else {
          for (int64_t kk = 0; kk < s.k; ++kk)
            acc += s.a.transposed ? a[kk * s.a.ld + j] : a[j * s.a.ld + kk];
        }
        bias[j] = static_cast<float>(acc);
      }
    }
  }
}

namespace {
// The stored elements of an FP8 operand (gaps between rows included) as f32.
std::vector<float> dequantize(const MatrixLayout& l) {
  const int64_t stored_rows = l.transposed ? l.cols : l.rows, stored_cols = l.transposed ? l.rows : l.cols;
  const int64_t elems = (l.batch - 1) * l.batch_stride + (stored_rows - 1) * l.ld + stored_cols;
  std::vector<float> out(static_cast<size_t>(elems));
  const auto* q = static_cast<const uint8_t*>(l.ptr);
  for (int64_t i = 0; i < elems; ++i)
    out[static_cast<size_t>(i)] = l.dtype == DType::F8E4M3 ? f8e4m3_bits_to_float(q[i]) : f8e5m2_bits_to_float(q[i]);
  return out;
}
}  // namespace

void gemm_cpu_fp8(const GemmArgs& g, const GemmShape& s) {
  if (g.a_scaling != Fp8Granularity::Tensor || g.b_scaling != Fp8Granularity::Tensor) {
    // Per-group scales (batch 1, validated): dequantize each operand element with its own scale
    // into row-major A [M,K] and B^T [N,K], then one f32 GEMM.
    const std::vector<float> qa = dequantize(s.a), qb = dequantize(s.b);
    const float* sa = g.a_scale.ptr<float>();
    const float* sb = g.b_scale.ptr<float>();
    std::vector<float> a(static_cast<size_t>(s.m * s.k)), bt(static_cast<size_t>(s.n * s.k));
    for (int64_t i = 0; i < s.m; ++i)
      for (int64_t k = 0; k < s.k; ++k)
        a[i * s.k + k] = qa[s.a.transposed ? k * s.a.ld + i : i * s.a.ld + k] *
                         sa[fp8_scale_index(g.a_scaling, s.m, s.k, i, k)];
    for (int64_t j = 0; j < s.n; ++j)
      for (int64_t k = 0; k < s.k; ++k)
        bt[j * s.k + k] = qb[s.b.transposed ? j * s.b.ld + k : k * s.b.ld + j] *
                          sb[fp8_scale_index(g.b_scaling, s.n, s.k, j, k)];
    GemmShape s2 = s;
    s2.a.ptr = a.data();
    s2.a.dtype = DType::F32;
    s2.a.ld = s.k;
    s2.a.transposed = false;
    s2.b.ptr = bt.data();
    s2.b.dtype = DType::F32;
    s2.b.ld = s.k;
    s2.b.transposed = true;
    gemm_cpu(g, s2);
    return;
  }
  std::vector<float> a = dequantize(s.a), b = dequantize(s.b);
  GemmArgs g2 = g;
  GemmShape s2 = s;
  s2.a.ptr = a.data();
  s2.b.ptr = b.data();
  s2.a.dtype = s2.b.dtype = DType::F32;
  g2.alpha = g.alpha * *g.a_scale.ptr<float>() * *g.b_scale.ptr<float>();
  gemm_cpu(g2, s2);
}

}  // namespace primus::turbo::detail
