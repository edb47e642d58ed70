// turbo::attention on the host: argument validation, and the CPU backend (f32) through the op
// against the fp64 reference, including that the backward overwrites (not accumulates) its
// gradients. Runs everywhere, GPU or not.
#include <gtest/gtest.h>

#include <random>

#include "core/util/error.h"
#include "tests/attention_gpu/attention_reference.h"
#include "turbo/dispatch/backend_manager.h"
#include "turbo/ops/attention.h"

namespace primus::turbo::testing {
namespace {

struct HostAttn {
  AttnCase c;
  std::vector<float> q, k, v, out, lse, dout, dq, dk, dv;
  std::vector<int32_t> cu;
  TensorView view(std::vector<float>& x, std::initializer_list<int64_t> shape) {
    return TensorView(x.data(), DType::F32, Device::CPU, shape);
  }
  explicit HostAttn(const AttnCase& cs, const AttnTensors& t) : c(cs) {
    auto f = [](const std::vector<double>& d) { return std::vector<float>(d.begin(), d.end()); };
    q = f(t.q), k = f(t.k), v = f(t.v), dout = f(t.dout);
    out.assign(q.size(), 0.0f), dq.assign(q.size(), 7.0f), dk.assign(k.size(), 7.0f), dv.assign(k.size(), 7.0f);
    lse.assign(static_cast<size_t>(c.B * c.H * c.T), 0.0f);
    cu = c.cu_seqlens;
  }
  AttentionOptions opt() {
    AttentionOptions o;
    o.causal = c.causal;
    o.window = c.window;
    if (c.scale) o.softmax_scale = static_cast<float>(*c.scale);
    if (!cu.empty()) o.cu_seqlens = TensorView(cu.data(), DType::I32, Device::CPU, {static_cast<int64_t>(cu.size())});
    return o;
  }
  AttentionForwardArgs fwd() {
    AttentionForwardArgs a;
    a.q = view(q, {c.B, c.T, c.H, c.D}), a.k = view(k, {c.B, c.T, c.KVH, c.D}), a.v = view(v, {c.B, c.T, c.KVH, c.D});
    a.out = view(out, {c.B, c.T, c.H, c.D}), a.lse = view(lse, {c.B, c.H, c.T});
    a.opt = opt();
    return a;
  }
  AttentionBackwardArgs bwd() {
    AttentionBackwardArgs a;
    a.q = view(q, {c.B, c.T, c.H, c.D}), a.k = view(k, {c.B, c.T, c.KVH, c.D}), a.v = view(v, {c.B, c.T, c.KVH, c.D});
    a.out = view(out, {c.B, c.T, c.H, c.D}), a.lse = view(lse, {c.B, c.H, c.T});
    a.dout = view(dout, {c.B, c.T, c.H, c.D});
    a.dq = view(dq, {c.B, c.T, c.H, c.D}), a.dk = view(dk, {c.B, c.T, c.KVH, c.D}), a.dv = view(dv, {c.B, c.T, c.KVH, c.D});
    a.opt = opt();
    return a;
  }
};

class AttnHost : public ::testing::Test {
 protected:
  void SetUp() override {
    seed_ = std::random_device{}();
    rng_.seed(seed_);
  }
  void TearDown() override { GlobalBackendManager::instance().reset(); }
  std::mt19937 rng_;
  unsigned seed_ = 0;
};

void expect_fp32_close(const char* what, const std::vector<float>& got, const std::vector<double>& ref) {
  const ErrorStats e = compare(got, ref);
  EXPECT_LE(e.rel_l2, 1e-4) << what;  // DESIGN.md's fp32 gate
  EXPECT_LE(e.max_rel, 1e-4) << what;
}

TEST_F(AttnHost, CpuBackendMatchesFp64ReferenceAndOverwritesGradients) {
  SCOPED_TRACE(seed_);
  for (int variant = 0; variant < 4; ++variant) {  // dense, packed, windowed, both
    const bool varlen = variant % 2 == 1;
    AttnCase c;
    c.B = 2, c.T = 48, c.H = 4, c.KVH = 2, c.D = 16, c.causal = true, c.scale = 0.3;
    if (varlen) c.cu_seqlens = random_cu_seqlens(rng_, c.B, c.T, 3);
    if (variant >= 2) c.window = 11;
    AttnTensors t;
    t.q = random_values(rng_, static_cast<size_t>(c.B * c.T * c.H * c.D), DType::F32);
    t.k = random_values(rng_, static_cast<size_t>(c.B * c.T * c.KVH * c.D), DType::F32);
    t.v = random_values(rng_, t.k.size(), DType::F32);
    t.dout = random_values(rng_, t.q.size(), DType::F32);
    run_reference(c, t);
    HostAttn h(c, t);  // gradients start at 7: an accumulating backward would be off by 7
    GlobalBackendManager::instance().set_backend("attention", BackendType::CPU);
    EXPECT_EQ(attention_forward(h.fwd()), BackendType::CPU);
    EXPECT_EQ(attention_backward(h.bwd()), BackendType::CPU);
    expect_fp32_close("out", h.out, t.out);
    expect_fp32_close("lse", h.lse, t.lse);
    expect_fp32_close("dq", h.dq, t.dq);
    expect_fp32_close("dk", h.dk, t.dk);
    expect_fp32_close("dv", h.dv, t.dv);
  }
}

TEST_F(AttnHost, ValidationNamesTheArgument) {
  AttnCase c;
  c.B = 1, c.T = 8, c.H = 4, c.KVH = 2, c.D = 8;
  AttnTensors t;
  t.q.assign(static_cast<size_t>(c.T * c.H * c.D), 0.5), t.k.assign(static_cast<size_t>(c.T * c.KVH * c.D), 0.5);
  t.v = t.k, t.dout = t.q;
  HostAttn h(c, t);
  auto expect_msg = [](auto&& fn, const std::string& needle) {
    try {
      fn();
      ADD_FAILURE() << "no error; expected one naming " << needle;
    } catch (const RuntimeError& e) {
      EXPECT_NE(std::string(e.what()).find(needle), std::string::npos) << e.what();
    }
  };
  {
    auto a = h.fwd();
    a.k = h.view(h.k, {c.B, c.T, 3, c.D});  // KVH = 3 does not divide H = 4 (and mismatches v)
    expect_msg([&] { attention_forward(a); }, "attention_forward: v: expected shape");
  }
  {
    auto a = h.fwd();
    a.lse = h.view(h.lse, {c.B, c.T, c.H});  // transposed lse
    expect_msg([&] { attention_forward(a); }, "attention_forward: lse: expected shape");
  }
  {
    auto a = h.bwd();
    a.dk = h.view(h.dk, {c.B, c.T, c.H / 2, c.D * 2});
    expect_msg([&] { attention_backward(a); }, "attention_backward: dk: expected shape");
  }
  {
    auto a = h.fwd();
    std::vector<float> bad_cu{0.0f, 8.0f};
    a.opt.cu_seqlens = TensorView(bad_cu.data(), DType::F32, Device::CPU, {2});
    expect_msg([&] { attention_forward(a); }, "attention_forward: cu_seqlens: expected i32");
  }
  {
    auto a = h.fwd();
    a.opt.window = -2;
    expect_msg([&] { attention_forward(a); }, "attention_forward: window must be >= 0");
    a.opt.window = 4, a.opt.causal = false;
    expect_msg([&] { attention_forward(a); }, "attention_forward: a sliding window (window=4) needs causal attention");
  }
}

// Forcing a backend that cannot take host tensors is an error naming the backend.
TEST_F(AttnHost, ForcedDeviceBackendOnHostTensorsIsAnError) {
  AttnCase c;
  c.B = 1, c.T = 8, c.H = 2, c.KVH = 2, c.D = 8;
  AttnTensors t;
  t.q.assign(static_cast<size_t>(c.T * c.H * c.D), 0.25), t.k = t.q, t.v = t.q, t.dout = t.q;
  HostAttn h(c, t);
  GlobalBackendManager::instance().set_backend("attention", BackendType::TURBO);
  EXPECT_THROW(attention_forward(h.fwd()), RuntimeError);
}

}  // namespace
}  // namespace primus::turbo::testing
