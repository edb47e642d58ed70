// Decode attention and the KV-cache append on the device (TURBO) against the CPU reference on
// the same (dtype-rounded) values: several cache slots of different lengths in one call, GQA,
// q read from the packed q|k|v rows, head dims from 32 to 256 (each of the kernel's lane widths,
// and one that is not a multiple of 32), sliding windows; the append copies exactly. Long
// contexts (cap 4096, lengths 1 to 4095 in one batch) with the split-KV workspace: full, short
// (fewer splits) and at batch 1 (the most splits), each query's rows checked on their own (a long
// context's output is an average of thousands of values, far smaller than a short one's).
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

TEST_P(DecodeAttentionTest, SplitsLongContexts) {
  const DType dt = GetParam();
  const int64_t slots = 4, cap = 4096;
  struct Shape {
    int64_t H, KV, D;
  };
  // G = 4 (4 heads a block, D 64: 8 lanes a key), G = 3 (1 a block, D 36: scalar loads for bf16),
  // G = 2 (2 a block, D 256: two vectors a lane for f32), MQA G = 8 at D 128.
  for (const Shape sh : {Shape{8, 2, 64}, Shape{6, 2, 36}, Shape{4, 2, 256}, Shape{8, 1, 128}}) {
    const int64_t H = sh.H, KV = sh.KV, D = sh.D, W = (H + 2 * KV) * D;
    TensorView kc = make(dt, {slots, cap, KV, D}), vc = make(dt, {slots, cap, KV, D});
    const auto kv = random_tensor(kc), vv = random_tensor(vc);
    for (const std::vector<int32_t>& ln : {std::vector<int32_t>{1, 100, 1000, 4095}, std::vector<int32_t>{4095},
                                           std::vector<int32_t>{4096, 65, 64, 63, 2}}) {
      const int64_t n = static_cast<int64_t>(ln.size());
      std::vector<int32_t> sl(static_cast<size_t>(n));
      for (int64_t i = 0; i < n; ++i) sl[i] = static_cast<int32_t>((i * 3 + 2) % slots);
      if (n == 5) sl = {0, 1, 2, 3, 1};  // slot 1 twice: two queries may share a cache slot
      TensorView qkv = make(dt, {n, W}), out = make(dt, {n, H, D});
      TensorView slot = make(DType::I32, {n}), len = make(DType::I32, {n});
      const auto qv = random_tensor(qkv);
      put_i32(slot, sl);
      put_i32(len, ln);
      TensorView q(qkv.data, dt, Device::CUDA, {n, H, D});
      q.strides = {W, D, 1, 0};
      const int64_t full = decode_attention_workspace_bytes(n, H, KV, D, cap);
      EXPECT_GT(full, 0);
      EXPECT_GE(decode_attention_workspace_bytes(n + 3, H, KV, D, cap), full);  // covers every smaller batch
      TensorView ws = make(DType::F32, {full / 4});
      for (const int64_t window : {int64_t{0}, int64_t{7}, int64_t{1000}})
        for (const int64_t ws_bytes : {full, full / 3, int64_t{0}}) {
          SCOPED_TRACE(fmt::format("H {} KV {} D {} n {} window {} workspace {} of {}", H, KV, D, n, window, ws_bytes,
                                   full));
          DecodeAttentionArgs a;
          a.out = out, a.q = q, a.k_cache = kc, a.v_cache = vc, a.slot = slot, a.len = len, a.window = window;
          if (ws_bytes > 0) a.workspace = TensorView(ws.data, DType::F32, Device::CUDA, {ws_bytes / 4});
          a.ctx = ctx;
          poison(out);
          if (ws_bytes > 0) poison(ws);  // partials of empty splits must not be read
          EXPECT_EQ(decode_attention(a), BackendType::TURBO);
          std::vector<float> want(static_cast<size_t>(n * H * D));
          cpu::DecodeAttentionParams p;
          p.n = n, p.H = H, p.KVH = KV, p.D = D, p.slots = slots, p.cap = cap, p.window = window, p.q_row = W;
          cpu::decode_attention_forward(want.data(), qv.data(), kv.data(), vv.data(), sl.data(), ln.data(), p);
          const std::vector<float> got = get(out);
          const size_t row = static_cast<size_t>(H * D);
          for (int64_t i = 0; i < n; ++i) {
            const std::vector<float> g(got.begin() + i * row, got.begin() + (i + 1) * row);
            const std::vector<float> w(want.begin() + i * row, want.begin() + (i + 1) * row);
            EXPECT_LT(rel_err(g, w), gate(dt)) << "query " << i << " of length " << ln[i];
          }
        }
    }
  }
}

TEST(DecodeAttentionWorkspace, SplitsOnlyWhereTheCacheIsLong) {
  EXPECT_EQ(decode_attention_workspace_bytes(1, 32, 8, 64, 64), 0);  // one split of at most 64 keys
  EXPECT_GT(decode_attention_workspace_bytes(1, 32, 8, 64, 8192), 0);
  EXPECT_EQ(decode_attention_workspace_bytes(0, 32, 8, 64, 8192), 0);
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
