#include "turbo/ops/attention_fallback.h"

#include <fmt/format.h>

#include <algorithm>
#include <cmath>

#include "turbo/kernels/cuda/attention_fallback.h"
#include "core/util/error.h"
#include "turbo/ops/gemm.h"

namespace primus::turbo {

namespace k = cuda;

namespace {

struct Dims {
  int64_t B, T, H, KVH, D;
  int64_t rep() const { return H / KVH; }
  int64_t groups() const { return B * KVH; }  // GEMM batch entries
};

Dims dims_of(const TensorView& q, const TensorView& k, const AttentionOptions& opt, const char* op) {
  if (!opt.causal || opt.cu_seqlens.defined() || opt.window > 0) {
    throw RuntimeError(fmt::format("{}: serves causal attention over one sequence per row only (no packed documents, "
                                   "no sliding window)", op));
  }
  if (q.ndim != 4 || k.ndim != 4) throw RuntimeError(fmt::format("{}: q and k must be 4-D, got {} and {}", op, q.describe(), k.describe()));
  Dims d{q.size(0), q.size(1), q.size(2), k.size(2), q.size(3)};
  const bool dtype_ok = q.device == Device::CUDA ? q.dtype == DType::BF16 : q.dtype == DType::F32;
  if (d.D % 8 != 0 || d.KVH <= 0 || d.H % d.KVH != 0 || !dtype_ok) {
    throw RuntimeError(fmt::format("{}: needs bf16 on the device (f32 on the host), head_dim a multiple of 8 and H a "
                                   "multiple of KVH; got q {}, k {}",
                                   op, q.describe(), k.describe()));
  }
  return d;
}

// The three small kernels, on the host for host tensors (f32) and on the device otherwise. The
// host versions let the GEMM orchestration be checked on machines without a GPU.
namespace host {
// `row`: elements between the token-major side's tokens.
void permute(float* dst, const float* src, int64_t B, int64_t T, int64_t Hx, int64_t D, int64_t row, bool to_heads) {
  for (int64_t b = 0; b < B; ++b)
    for (int64_t t = 0; t < T; ++t)
      for (int64_t h = 0; h < Hx; ++h) {
        const int64_t tok = (b * T + t) * row + h * D, head = ((b * Hx + h) * T + t) * D;
        const float* s = src + (to_heads ? tok : head);
        float* o = dst + (to_heads ? head : tok);
        std::copy(s, s + D, o);
      }
}
void softmax_forward(float* p, float* lse, const float* s, int64_t rows, int64_t T, bool write_lse) {
  for (int64_t r = 0; r < rows; ++r) {
    const int64_t t = r % T;
    const float* sr = s + r * T;
    float l = lse[r];
    if (write_lse) {
      double m = -INFINITY, sum = 0;
      for (int64_t j = 0; j <= t; ++j) m = std::max(m, double(sr[j]));
      for (int64_t j = 0; j <= t; ++j) sum += std::exp(double(sr[j]) - m);
      l = static_cast<float>(m + std::log(sum));
      lse[r] = l;
    }
    for (int64_t j = 0; j < T; ++j) p[r * T + j] = j <= t ? std::exp(sr[j] - l) : 0.0f;
  }
}
void softmax_backward(float* ds, const float* s, const float* lse, const float* dp, int64_t rows, int64_t T,
                      float scale) {
  for (int64_t r = 0; r < rows; ++r) {
    const int64_t t = r % T;
    double delta = 0;
    for (int64_t j = 0; j <= t; ++j) delta += std::exp(double(s[r * T + j]) - lse[r]) * dp[r * T + j];
    for (int64_t j = 0; j < T; ++j)
      ds[r * T + j] = j <= t ? static_cast<float>(scale * std::exp(double(s[r * T + j]) - lse[r]) *
                                                  (dp[r * T + j] - delta))
                             : 0.0f;
  }
}
}  // namespace host

// Token-major views may be column slices of a packed q|k|v projection (strided token rows).
int64_t token_row(const TensorView& t, const char* op) {
  const int64_t row = t.strides[1];
  if (t.ndim != 4 || t.strides[3] != 1 || t.strides[2] != t.shape[3] || row % 8 != 0 ||
      (t.shape[0] > 1 && t.strides[0] != t.shape[1] * row))
    throw RuntimeError(fmt::format("{}: {} is not token-major [B,T,H,D] with contiguous heads", op, t.describe()));
  return row;
}
// dst = src permuted token-major -> head-major (to_heads) or back; Hx heads.
void permute_heads(const TensorView& dst, const TensorView& src, const Dims& d, int64_t Hx, bool to_heads,
                   cudaStream_t st) {
  const int64_t row = token_row(to_heads ? src : dst, "fallback attention");
  if (src.device == Device::CPU)
    host::permute(dst.ptr<float>(), src.ptr<const float>(), d.B, d.T, Hx, d.D, row, to_heads);
  else if (to_heads)
    k::permute_to_heads(dst.data, src.data, d.B, d.T, Hx, d.D, st, row);
  else
    k::permute_from_heads(dst.data, src.data, d.B, d.T, Hx, d.D, st, row);
}
void softmax_forward(const TensorView& p, const TensorView& lse, const TensorView& s, int64_t rows, int64_t T,
                     bool write_lse, cudaStream_t st) {
  if (s.device == Device::CPU)
    host::softmax_forward(p.ptr<float>(), lse.ptr<float>(), s.ptr<const float>(), rows, T, write_lse);
  else
    k::causal_softmax_forward(p.data, lse.ptr<float>(), s.ptr<const float>(), rows, T, write_lse, st);
}
void softmax_backward(const TensorView& ds, const TensorView& s, const TensorView& lse, const TensorView& dp,
                      int64_t rows, int64_t T, float scale, cudaStream_t st) {
  if (s.device == Device::CPU)
    host::softmax_backward(ds.ptr<float>(), s.ptr<const float>(), lse.ptr<const float>(), dp.ptr<const float>(), rows,
                           T, scale);
  else
    k::causal_softmax_backward(ds.data, s.ptr<const float>(), lse.ptr<const float>(), dp.ptr<const float>(), rows, T,
                               scale, st);
}

Arena& scratch(const ExecContext& ctx, const char* op) {
  if (!ctx.scratch) throw RuntimeError(fmt::format("{}: needs a scratch arena (ExecContext::scratch)", op));
  return *ctx.scratch;
}

void gemm(const TensorView& a, const TensorView& b, const TensorView& d, float alpha, const ExecContext& ctx) {
  GemmArgs g;
  g.a = a;
  g.b = b;
  g.d = d;
  g.alpha = alpha;
  g.ctx = ctx;
  turbo::gemm(g);
}

}  // namespace

size_t attention_fallback_scratch_bytes(int64_t B, int64_t T, int64_t H, int64_t KVH, int64_t D, size_t act_bytes) {
  const size_t a = Arena::kDefaultAlign;
  auto up = [a](size_t n) { return (n + a - 1) / a * a; };
  const size_t q = up(size_t(B * T * H * D) * act_bytes), kv = up(size_t(B * T * KVH * D) * act_bytes);
  const size_t scores = size_t(B * H) * size_t(T * T);
  // q, dout, dq; k, v, dk, dv; S and dP (f32), P/dS (activation dtype).
  return 3 * q + 4 * kv + 2 * up(scores * 4) + up(scores * act_bytes);
}

namespace {

// What both passes start with, in the scratch arena of the caller's scope: q, k, v permuted to
// head-major, S = scale Q K^T (f32) and P = softmax(S) with the log-sum-exp written (the forward)
// or read (the backward, which recomputes P instead of keeping [T,T] per layer).
struct Scores {
  Dims d;
  float scale;
  TensorView qh, kh, vh, s, p;
};
Scores scores(Arena& arena, const TensorView& q, const TensorView& k, const TensorView& v, const TensorView& lse,
              const AttentionOptions& opt, bool write_lse, const ExecContext& ctx, const char* op) {
  Scores r{dims_of(q, k, opt, op), 0.0f, {}, {}, {}, {}, {}};
  const Dims& d = r.d;
  r.scale = opt.scale(d.D);
  auto st = static_cast<cudaStream_t>(ctx.stream);
  const DType act = q.dtype;
  const int64_t G = d.groups(), R = d.rep() * d.T;
  r.qh = arena.tensor(act, {G, R, d.D}, "attention q (head-major)");
  r.kh = arena.tensor(act, {G, d.T, d.D}, "attention k (head-major)");
  r.vh = arena.tensor(act, {G, d.T, d.D}, "attention v (head-major)");
  r.s = arena.tensor(DType::F32, {G, R, d.T}, "attention scores");
  r.p = arena.tensor(act, {G, R, d.T}, "attention probabilities / dS");
  permute_heads(r.qh, q, d, d.H, true, st);
  permute_heads(r.kh, k, d, d.KVH, true, st);
  permute_heads(r.vh, v, d, d.KVH, true, st);
  gemm(r.qh, r.kh.transposed(), r.s, r.scale, ctx);  // S = scale Q K^T
  softmax_forward(r.p, lse, r.s, G * R, d.T, write_lse, st);
  return r;
}

}  // namespace

void attention_fallback_forward(const AttentionForwardArgs& c) {
  Arena& arena = scratch(c.ctx, "attention_fallback_forward");
  ArenaScope scope(arena);
  const Scores sc = scores(arena, c.q, c.k, c.v, c.lse, c.opt, true, c.ctx, "attention_fallback_forward");
  const Dims& d = sc.d;
  TensorView oh = arena.tensor(c.q.dtype, {d.groups(), d.rep() * d.T, d.D}, "attention out (head-major)");
  gemm(sc.p, sc.vh, oh, 1.0f, c.ctx);  // O = P V
  permute_heads(c.out, oh, d, d.H, false, static_cast<cudaStream_t>(c.ctx.stream));
}

void attention_fallback_backward(const AttentionBackwardArgs& c) {
  Arena& arena = scratch(c.ctx, "attention_fallback_backward");
  ArenaScope scope(arena);
  const Scores sc = scores(arena, c.q, c.k, c.v, c.lse, c.opt, false, c.ctx, "attention_fallback_backward");
  const Dims& d = sc.d;
  auto st = static_cast<cudaStream_t>(c.ctx.stream);
  const DType act = c.q.dtype;
  const int64_t G = d.groups(), R = d.rep() * d.T;
  TensorView doh = arena.tensor(act, {G, R, d.D}, "attention dout (head-major)");
  TensorView dqh = arena.tensor(act, {G, R, d.D}, "attention dq (head-major)");
  TensorView dkh = arena.tensor(act, {G, d.T, d.D}, "attention dk (head-major)");
  TensorView dvh = arena.tensor(act, {G, d.T, d.D}, "attention dv (head-major)");
  TensorView dp = arena.tensor(DType::F32, {G, R, d.T}, "attention dP");
  permute_heads(doh, c.dout, d, d.H, true, st);
  gemm(sc.p.transposed(), doh, dvh, 1.0f, c.ctx);  // dV = P^T dO (sums the group's query heads)
  gemm(doh, sc.vh.transposed(), dp, 1.0f, c.ctx);  // dP = dO V^T
  // dS (gradient of the unscaled Q K^T) overwrites P, which is no longer needed.
  softmax_backward(sc.p, sc.s, c.lse, dp, G * R, d.T, sc.scale, st);
  gemm(sc.p, sc.kh, dqh, 1.0f, c.ctx);               // dQ = dS K
  gemm(sc.p.transposed(), sc.qh, dkh, 1.0f, c.ctx);  // dK = dS^T Q
  permute_heads(c.dq, dqh, d, d.H, false, st);
  permute_heads(c.dk, dkh, d, d.KVH, false, st);
  permute_heads(c.dv, dvh, d, d.KVH, false, st);
}

}  // namespace primus::turbo
