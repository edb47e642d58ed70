// Decode attention and the KV-cache append on the device (TURBO) against the CPU reference on
// the same (dtype-rounded) values: several cache slots of different lengths in one call, GQA,
// q read from the packed q|k|v rows, head dims from 32 to 256 (each of the kernel's lane widths,
// and one that is not a multiple of 32), sliding windows; the append copies exactly.
#include <gtest/gtest.h>

#include <vector>

#include "gpu_fixture.h"
#include "turbo/kernels/cpu/decode_attention.h"
#include "turbo/ops/decode_attention.h"

namespace primus::turbo::testing {
namespace {

class DecodeAttentionTest : public GpuDTypeTest {};

TEST_P(DecodeAttentionTest, MatchesTheReference) {
  const DType dt = GetParam();
  for (const int64_t D : {int64_t{32}, int64_t{64}, int64_t{80}, int64_t{128}, int64_t{256}})
    for (const int64_t window : {int64_t{0}, int64_t{7}}) {
      SCOPED_TRACE(fmt::format("D {} window {}", D, window));
      const int64_t H = 8, KV = 2, slots = 4, cap = 300, n = 3, W = (H + 2 * KV) * D;
      TensorView kc = make(dt, {slots, cap, KV, D}), vc = make(dt, {slots, cap, KV, D});
      TensorView qkv = make(dt, {n, W}), out = make(dt, {n, H, D});
      TensorView slot = make(DType::I32, {n}), len = make(DType::I32, {n});
      const auto kv = random_tensor(kc), vv = random_tensor(vc), qv = random_tensor(qkv);
      const std::vector<int32_t> sl = {3, 0, 2}, ln = {300, 1, 129};
      put_i32(slot, sl);
      put_i32(len, ln);
      TensorView q(qkv.data, dt, Device::CUDA, {n, H, D});
      q.strides = {W, D, 1, 0};
      DecodeAttentionArgs a;
      a.out = out, a.q = q, a.k_cache = kc, a.v_cache = vc, a.slot = slot, a.len = len, a.window = window, a.ctx = ctx;
      poison(out);
      EXPECT_EQ(decode_attention(a), BackendType::TURBO);
      std::vector<float> want(static_cast<size_t>(n * H * D));
      cpu::DecodeAttentionParams p;
      p.n = n, p.H = H, p.KVH = KV, p.D = D, p.slots = slots, p.cap = cap, p.window = window, p.q_row = W;
      cpu::decode_attention_forward(want.data(), qv.data(), kv.data(), vv.data(), sl.data(), ln.data(), p);
      EXPECT_LT(rel_err(get(out), want), gate(dt));
    }
}

TEST_P(DecodeAttentionTest, CacheWriteCopiesTheRowsExactly) {
  const DType dt = GetParam();
  const int64_t KV = 2, D = 64, slots = 3, cap = 10, n = 2, W = (8 + 2 * KV) * D, QD = 8 * D;
  TensorView kc = make(dt, {slots, cap, KV, D}), vc = make(dt, {slots, cap, KV, D}), qkv = make(dt, {n, W});
  TensorView slot = make(DType::I32, {n}), len = make(DType::I32, {n});
  auto kv = random_tensor(kc), vv = random_tensor(vc);
  const auto src = random_tensor(qkv);
  const std::vector<int32_t> sl = {2, 0}, ln = {10, 4};
  put_i32(slot, sl);
  put_i32(len, ln);
  auto view = [&](int64_t col) {
    TensorView v(static_cast<char*>(qkv.data) + col * dtype_size(dt), dt, Device::CUDA, {n, KV, D});
    v.strides = {W, D, 1, 0};
    return v;
  };
  KvCacheWriteArgs a;
  a.k_cache = kc, a.v_cache = vc, a.k = view(QD), a.v = view(QD + KV * D), a.slot = slot, a.len = len, a.ctx = ctx;
  EXPECT_EQ(kv_cache_write(a), BackendType::TURBO);
  for (int64_t i = 0; i < n; ++i)
    for (int64_t c = 0; c < KV * D; ++c) {
      const size_t at = static_cast<size_t>((sl[i] * cap + ln[i] - 1) * KV * D + c);
      kv[at] = src[static_cast<size_t>(i * W + QD + c)];
      vv[at] = src[static_cast<size_t>(i * W + QD + KV * D + c)];
    }
  EXPECT_EQ(get(kc), kv);
  EXPECT_EQ(get(vc), vv);
}

INSTANTIATE_TEST_SUITE_P(DTypes, DecodeAttentionTest, ::testing::Values(DType::F32, DType::BF16), dtype_param_name);

}  // namespace
}  // namespace primus::turbo::testing
