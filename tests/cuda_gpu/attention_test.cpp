// The attention slot implementations (the default and the fallback) against the CPU reference
// kernel, on the same bf16-rounded inputs: grouped-query, causal, head_dim 64, a T that is not
// a multiple of 64. Gates (relative L2): out 1e-2 (bf16), lse 1e-3, gradients 2e-2.
#include <gtest/gtest.h>

#include "cuda_fixture.h"
#include "turbo/core/cuda_arena.h"
#include "turbo/kernels/cpu/attention.h"

namespace primus::backends::cuda::testing {
namespace {

using turbo::DType;

class AttentionSlotTest : public CudaGpuTest, public ::testing::WithParamInterface<Attn> {};

TEST_P(AttentionSlotTest, ForwardAndBackwardMatchCpuReference) {
  const int64_t B = 2, T = 96, H = 4, KVH = 2, D = 64;
  const CudaOps ops = ops_for(GetParam());
  auto arena = turbo::make_device_arena(size_t{64} << 20);
  auto scratch = turbo::make_device_arena(fallback_attention_scratch_bytes(B, T, H, KVH, D) + (size_t{256} << 20));
  ExecContext ctx;
  ctx.scratch = scratch.get();
  std::mt19937 rng(std::random_device{}());
  std::normal_distribution<float> nd(0.0f, 1.0f);
  auto host = [&](int64_t n) {
    std::vector<float> v(static_cast<size_t>(n));
    for (auto& x : v) x = round_bf16(nd(rng));
    return v;
  };
  auto upload = [&](const std::vector<float>& v, std::initializer_list<int64_t> shape) {
    TensorView t = arena->tensor(DType::BF16, shape);
    std::vector<uint16_t> bits(v.size());
    for (size_t i = 0; i < v.size(); ++i) bits[i] = turbo::float_to_bf16_bits(v[i]);
    CUDA_CHECK(cudaMemcpy(t.data, bits.data(), bits.size() * 2, cudaMemcpyHostToDevice));
    return t;
  };
  auto download = [&](const TensorView& t) {
    CUDA_CHECK(cudaDeviceSynchronize());
    std::vector<float> out(static_cast<size_t>(t.numel()));
    if (t.dtype == DType::F32) {
      CUDA_CHECK(cudaMemcpy(out.data(), t.data, t.nbytes(), cudaMemcpyDeviceToHost));
      return out;
    }
    std::vector<uint16_t> bits(out.size());
    CUDA_CHECK(cudaMemcpy(bits.data(), t.data, t.nbytes(), cudaMemcpyDeviceToHost));
    for (size_t i = 0; i < out.size(); ++i) out[i] = turbo::bf16_bits_to_float(bits[i]);
    return out;
  };
  auto q = host(B * T * H * D), k = host(B * T * KVH * D), v = host(B * T * KVH * D), dout = host(B * T * H * D);
  AttentionCall f;
  f.q = upload(q, {B, T, H, D});
  f.k = upload(k, {B, T, KVH, D});
  f.v = upload(v, {B, T, KVH, D});
  f.out = arena->tensor(DType::BF16, {B, T, H, D});
  f.lse = arena->tensor(DType::F32, {B, H, T});
  f.scale = 1.0f / 8.0f;
  f.ctx = ctx;
  CUDA_CHECK(cudaMemset(f.out.data, 0xFF, f.out.nbytes()));  // NaN: every element must be written
  ops.attention_forward(f);

  turbo::cpu::AttentionParams p;
  p.B = B, p.T = T, p.H = H, p.KVH = KVH, p.D = D, p.causal = true, p.softmax_scale = 1.0 / 8.0;
  std::vector<float> rout(q.size()), rlse(static_cast<size_t>(B * H * T));
  turbo::cpu::attention_forward<float>(rout.data(), rlse.data(), q.data(), k.data(), v.data(), p);
  auto out = download(f.out);
  EXPECT_LT(rel_l2(out.data(), rout.data(), int64_t(out.size())), 1e-2) << attn_name(GetParam()) << " out";
  auto lse = download(f.lse);
  EXPECT_LT(rel_l2(lse.data(), rlse.data(), int64_t(lse.size())), 1e-3) << attn_name(GetParam()) << " lse";

  AttentionGradCall g;
  g.dq = arena->tensor(DType::BF16, {B, T, H, D});
  g.dk = arena->tensor(DType::BF16, {B, T, KVH, D});
  g.dv = arena->tensor(DType::BF16, {B, T, KVH, D});
  g.dout = upload(dout, {B, T, H, D});
  g.q = f.q, g.k = f.k, g.v = f.v, g.out = f.out, g.lse = f.lse;
  g.scale = f.scale;
  g.ctx = ctx;
  for (auto* t : {&g.dq, &g.dk, &g.dv}) CUDA_CHECK(cudaMemset(t->data, 0xFF, t->nbytes()));
  ops.attention_backward(g);
  // The reference backward reads the out it was given: our out (rounded), as the kernels do.
  std::vector<float> rdq(q.size(), 0.0f), rdk(k.size(), 0.0f), rdv(v.size(), 0.0f);
  turbo::cpu::attention_backward<float>(rdq.data(), rdk.data(), rdv.data(), dout.data(), q.data(), k.data(), v.data(),
                                        out.data(), rlse.data(), p);
  auto dq = download(g.dq), dk = download(g.dk), dv = download(g.dv);
  EXPECT_LT(rel_l2(dq.data(), rdq.data(), int64_t(dq.size())), 2e-2) << attn_name(GetParam()) << " dq";
  EXPECT_LT(rel_l2(dk.data(), rdk.data(), int64_t(dk.size())), 2e-2) << attn_name(GetParam()) << " dk";
  EXPECT_LT(rel_l2(dv.data(), rdv.data(), int64_t(dv.size())), 2e-2) << attn_name(GetParam()) << " dv";
}

INSTANTIATE_TEST_SUITE_P(Cuda, AttentionSlotTest, ::testing::Values(Attn::Default, Attn::Fallback),
                         [](const auto& info) { return info.param == Attn::Default ? "Default" : "Fallback"; });

}  // namespace
}  // namespace primus::backends::cuda::testing
