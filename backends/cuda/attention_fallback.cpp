#include "backends/cuda/attention_fallback.h"

#include <fmt/format.h>

#include "backends/cuda/kernels/attention_fallback.h"
#include "core/util/error.h"
#include "turbo/ops/gemm.h"

namespace primus::backends::cuda {

namespace k = kernels;
using turbo::Arena;
using turbo::ArenaScope;
using turbo::DType;
using turbo::Device;

namespace {

struct Dims {
  int64_t B, T, H, KVH, D;
  int64_t rep() const { return H / KVH; }
  int64_t groups() const { return B * KVH; }  // GEMM batch entries
};

Dims dims_of(const TensorView& q, const TensorView& k, const char* op) {
  if (q.ndim != 4 || k.ndim != 4) throw RuntimeError(fmt::format("{}: q and k must be 4-D, got {} and {}", op, q.describe(), k.describe()));
  Dims d{q.size(0), q.size(1), q.size(2), k.size(2), q.size(3)};
  if (d.D % 8 != 0 || d.KVH <= 0 || d.H % d.KVH != 0 || q.dtype != DType::BF16) {
    throw RuntimeError(fmt::format("{}: needs bf16, head_dim a multiple of 8 and H a multiple of KVH; got q {}, k {}",
                                   op, q.describe(), k.describe()));
  }
  return d;
}

Arena& scratch(const ExecContext& ctx, const char* op) {
  if (!ctx.scratch) throw RuntimeError(fmt::format("{}: needs a scratch arena (ExecContext::scratch)", op));
  return *ctx.scratch;
}

void gemm(const TensorView& a, const TensorView& b, const TensorView& d, float alpha, const ExecContext& ctx) {
  turbo::GemmArgs g;
  g.a = a;
  g.b = b;
  g.d = d;
  g.alpha = alpha;
  g.ctx = ctx;
  turbo::gemm(g);
}

}  // namespace

size_t fallback_attention_scratch_bytes(int64_t B, int64_t T, int64_t H, int64_t KVH, int64_t D) {
  const size_t a = Arena::kDefaultAlign;
  auto up = [a](size_t n) { return (n + a - 1) / a * a; };
  const size_t q = up(size_t(B * T * H * D) * 2), kv = up(size_t(B * T * KVH * D) * 2);
  const size_t scores = size_t(B * H) * size_t(T * T);
  // q, dout, dq; k, v, dk, dv; S and dP (f32), P/dS (bf16).
  return 3 * q + 4 * kv + 2 * up(scores * 4) + up(scores * 2);
}

void fallback_attention_forward(const AttentionCall& c) {
  const char* op = "fallback_attention_forward";
  const Dims d = dims_of(c.q, c.k, op);
  auto stream = static_cast<cudaStream_t>(c.ctx.stream);
  Arena& arena = scratch(c.ctx, op);
  ArenaScope scope(arena);
  const int64_t G = d.groups(), R = d.rep() * d.T;
  TensorView qh = arena.tensor(DType::BF16, {G, R, d.D}, "attention q (head-major)");
  TensorView kh = arena.tensor(DType::BF16, {G, d.T, d.D}, "attention k (head-major)");
  TensorView vh = arena.tensor(DType::BF16, {G, d.T, d.D}, "attention v (head-major)");
  TensorView oh = arena.tensor(DType::BF16, {G, R, d.D}, "attention out (head-major)");
  TensorView s = arena.tensor(DType::F32, {G, R, d.T}, "attention scores");
  TensorView p = arena.tensor(DType::BF16, {G, R, d.T}, "attention probabilities");
  k::permute_to_heads(qh.data, c.q.data, d.B, d.T, d.H, d.D, stream);
  k::permute_to_heads(kh.data, c.k.data, d.B, d.T, d.KVH, d.D, stream);
  k::permute_to_heads(vh.data, c.v.data, d.B, d.T, d.KVH, d.D, stream);
  gemm(qh, kh.transposed(), s, c.scale, c.ctx);                      // S = scale Q K^T
  k::causal_softmax_forward(p.data, c.lse.ptr<float>(), s.ptr<float>(), G * R, d.T, true, stream);
  gemm(p, vh, oh, 1.0f, c.ctx);                                       // O = P V
  k::permute_from_heads(c.out.data, oh.data, d.B, d.T, d.H, d.D, stream);
}

void fallback_attention_backward(const AttentionGradCall& c) {
  const char* op = "fallback_attention_backward";
  const Dims d = dims_of(c.q, c.k, op);
  auto stream = static_cast<cudaStream_t>(c.ctx.stream);
  Arena& arena = scratch(c.ctx, op);
  ArenaScope scope(arena);
  const int64_t G = d.groups(), R = d.rep() * d.T;
  TensorView qh = arena.tensor(DType::BF16, {G, R, d.D}, "attention q (head-major)");
  TensorView doh = arena.tensor(DType::BF16, {G, R, d.D}, "attention dout (head-major)");
  TensorView dqh = arena.tensor(DType::BF16, {G, R, d.D}, "attention dq (head-major)");
  TensorView kh = arena.tensor(DType::BF16, {G, d.T, d.D}, "attention k (head-major)");
  TensorView vh = arena.tensor(DType::BF16, {G, d.T, d.D}, "attention v (head-major)");
  TensorView dkh = arena.tensor(DType::BF16, {G, d.T, d.D}, "attention dk (head-major)");
  TensorView dvh = arena.tensor(DType::BF16, {G, d.T, d.D}, "attention dv (head-major)");
  TensorView s = arena.tensor(DType::F32, {G, R, d.T}, "attention scores");
  TensorView dp = arena.tensor(DType::F32, {G, R, d.T}, "attention dP");
  TensorView p = arena.tensor(DType::BF16, {G, R, d.T}, "attention P / dS");
  k::permute_to_heads(qh.data, c.q.data, d.B, d.T, d.H, d.D, stream);
  k::permute_to_heads(kh.data, c.k.data, d.B, d.T, d.KVH, d.D, stream);
  k::permute_to_heads(vh.data, c.v.data, d.B, d.T, d.KVH, d.D, stream);
  k::permute_to_heads(doh.data, c.dout.data, d.B, d.T, d.H, d.D, stream);
  gemm(qh, kh.transposed(), s, c.scale, c.ctx);  // S again (cheaper than keeping it per layer)
  k::causal_softmax_forward(p.data, c.lse.ptr<float>(), s.ptr<float>(), G * R, d.T, false, stream);
  gemm(p.transposed(), doh, dvh, 1.0f, c.ctx);   // dV = P^T dO (sums the group's query heads)
  gemm(doh, vh.transposed(), dp, 1.0f, c.ctx);   // dP = dO V^T
  // dS (gradient of the unscaled Q K^T) overwrites P, which is no longer needed.
  k::causal_softmax_backward(p.data, s.ptr<float>(), c.lse.ptr<float>(), dp.ptr<float>(), G * R, d.T, c.scale, stream);
  gemm(p, kh, dqh, 1.0f, c.ctx);                 // dQ = dS K
  gemm(p.transposed(), qh, dkh, 1.0f, c.ctx);    // dK = dS^T Q
  k::permute_from_heads(c.dq.data, dqh.data, d.B, d.T, d.H, d.D, stream);
  k::permute_from_heads(c.dk.data, dkh.data, d.B, d.T, d.KVH, d.D, stream);
  k::permute_from_heads(c.dv.data, dvh.data, d.B, d.T, d.KVH, d.D, stream);
}

}  // namespace primus::backends::cuda
