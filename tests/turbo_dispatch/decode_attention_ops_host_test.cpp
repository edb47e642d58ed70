// The decode-attention op and the KV-cache append (turbo/ops/decode_attention.h) on host tensors:
// they dispatch to the CPU backend and give what the reference kernel gives (q read from packed
// q|k|v rows), and malformed calls fail naming the op, the argument and what was expected. (The
// device kernels: tests/turbo_gpu/decode_attention_test.cpp.)
#include <gtest/gtest.h>

#include <random>
#include <string>
#include <vector>

#include "core/util/error.h"
#include "turbo/kernels/cpu/decode_attention.h"
#include "turbo/ops/decode_attention.h"

// A namespace of its own: the test binary is a unity build.
namespace primus::turbo::decode_ops_test {

template <class F>
void expect_error(F&& f, const std::vector<std::string>& parts) {
  try {
    f();
    ADD_FAILURE() << "no error; expected one naming " << parts.front();
  } catch (const RuntimeError& e) {
    for (const auto& p : parts) EXPECT_NE(std::string(e.what()).find(p), std::string::npos) << e.what();
  }
}

struct Case {
  static constexpr int64_t n = 2, H = 4, KV = 2, D = 8, S = 3, cap = 6, W = (H + 2 * KV) * D;
  std::vector<float> qkv, kc, vc, out;
  std::vector<int32_t> slot{2, 0}, len{5, 1};
  Case() {
    std::mt19937 rng(std::random_device{}());
    std::normal_distribution<float> d;
    for (auto* v : {&qkv, &kc, &vc}) v->resize(v == &qkv ? n * W : S * cap * KV * D);
    for (auto* v : {&qkv, &kc, &vc})
      for (float& x : *v) x = d(rng);
    out.assign(n * H * D, 0.0f);
  }
  TensorView cols(int64_t col, int64_t heads) {  // [n, heads, D] columns of the packed rows
    TensorView t(qkv.data() + col, DType::F32, Device::CPU, {n, heads, D});
    t.strides = {W, D, 1, 0};
    return t;
  }
  DecodeAttentionArgs args() {
    DecodeAttentionArgs a;
    a.out = TensorView(out.data(), DType::F32, Device::CPU, {n, H, D});
    a.q = cols(0, H);
    a.k_cache = TensorView(kc.data(), DType::F32, Device::CPU, {S, cap, KV, D});
    a.v_cache = TensorView(vc.data(), DType::F32, Device::CPU, {S, cap, KV, D});
    a.slot = TensorView(slot.data(), DType::I32, Device::CPU, {n});
    a.len = TensorView(len.data(), DType::I32, Device::CPU, {n});
    return a;
  }
};

TEST(DecodeAttentionOpHost, DispatchesToTheReference) {
  for (int64_t window : {int64_t{0}, int64_t{3}}) {
    Case c;
    DecodeAttentionArgs a = c.args();
    a.window = window;
    EXPECT_EQ(decode_attention(a), BackendType::CPU);
    std::vector<float> want(c.out.size());
    cpu::DecodeAttentionParams p;
    p.n = c.n, p.H = c.H, p.KVH = c.KV, p.D = c.D, p.slots = c.S, p.cap = c.cap, p.window = window, p.q_row = c.W;
    cpu::decode_attention_forward(want.data(), c.qkv.data(), c.kc.data(), c.vc.data(), c.slot.data(), c.len.data(), p);
    EXPECT_EQ(c.out, want) << "window " << window;
  }
}

TEST(DecodeAttentionOpHost, CacheWriteAppendsAtTheLastPosition) {
  Case c;
  DecodeAttentionArgs a = c.args();
  KvCacheWriteArgs w;
  w.k_cache = a.k_cache, w.v_cache = a.v_cache, w.slot = a.slot, w.len = a.len;
  w.k = c.cols(c.H * c.D, c.KV);
  w.v = c.cols((c.H + c.KV) * c.D, c.KV);
  EXPECT_EQ(kv_cache_write(w), BackendType::CPU);
  for (int64_t i = 0; i < c.n; ++i)
    for (int64_t e = 0; e < c.KV * c.D; ++e) {
      const int64_t at = (c.slot[i] * c.cap + c.len[i] - 1) * c.KV * c.D + e;
      EXPECT_EQ(c.kc[at], c.qkv[i * c.W + c.H * c.D + e]);
      EXPECT_EQ(c.vc[at], c.qkv[i * c.W + (c.H + c.KV) * c.D + e]);
    }
}

TEST(DecodeAttentionOpHost, MalformedCallsAreNamed) {
  Case c;
  {
    DecodeAttentionArgs a = c.args();
    a.out = TensorView(c.out.data(), DType::F32, Device::CPU, {c.n, c.H, c.D / 2});
    expect_error([&] { decode_attention(a); }, {"decode_attention", "out"});
  }
  {
    DecodeAttentionArgs a = c.args();
    a.k_cache = TensorView(c.kc.data(), DType::F32, Device::CPU, {c.S, c.cap, 3, c.D * 2 / 3});
    expect_error([&] { decode_attention(a); }, {"decode_attention", "v_cache"});
  }
  {
    DecodeAttentionArgs a = c.args();
    a.k_cache = TensorView(c.kc.data(), DType::F32, Device::CPU, {c.S, c.cap / 2, 3 * c.KV, c.D});
    a.v_cache = TensorView(c.vc.data(), DType::F32, Device::CPU, {c.S, c.cap / 2, 3 * c.KV, c.D});
    expect_error([&] { decode_attention(a); }, {"decode_attention", "not a multiple of 6 kv heads"});
  }
  {
    DecodeAttentionArgs a = c.args();
    a.slot = TensorView(c.len.data(), DType::F32, Device::CPU, {c.n});
    expect_error([&] { decode_attention(a); }, {"decode_attention", "slot"});
  }
  {
    DecodeAttentionArgs a = c.args();
    a.window = -1;
    expect_error([&] { decode_attention(a); }, {"decode_attention", "window"});
  }
  {
    DecodeAttentionArgs a = c.args();
    c.len[1] = c.cap + 1;  // past the cache: the kernel names the query
    expect_error([&] { decode_attention(a); }, {"decode_attention", "query 1"});
  }
  {
    KvCacheWriteArgs w;
    DecodeAttentionArgs a = c.args();
    w.k_cache = a.k_cache, w.v_cache = a.v_cache, w.slot = a.slot, w.len = a.len;
    w.k = c.cols(c.H * c.D, c.KV);
    w.v = c.cols(0, c.H);  // v of another shape
    expect_error([&] { kv_cache_write(w); }, {"kv_cache_write", "v"});
  }
}

}  // namespace primus::turbo::decode_ops_test
