// Multi-tensor AdamW and the global gradient norm on the device against the CPU reference.
#include <gtest/gtest.h>

#include <algorithm>
#include <cmath>
#include <cstring>
#include <tuple>

#include <fmt/format.h>

#include "gpu_fixture.h"
#include "turbo/kernels/cpu/optimizer.h"
#include "turbo/kernels/cpu/reduce.h"
#include "turbo/ops/optimizer.h"

namespace primus::turbo::testing {
namespace {

class OptimizerFixture : public GpuTest {
 protected:
  // The same random moments into both tensors (m normal, v non-negative), for two tables to compare.
  void same_moments(const AdamWTensor& a, const AdamWTensor& b) {
    put(b.m, random_tensor(a.m, 0.1f));
    std::vector<float> v = randn(a.v.numel(), 0.1f);
    for (auto& x : v) x = x * x;
    put(a.v, v), put(b.v, v);
  }
};
class OptimizerTest : public OptimizerFixture, public ::testing::WithParamInterface<DType> {};

TEST_P(OptimizerTest, ClippedAdamWStepsMatchReference) {
  const DType grad_dt = GetParam();
  // Odd sizes: tails that are not whole vectors, a tensor smaller than a vector, several chunks.
  const std::vector<int64_t> sizes = {1000, 4099, 7, 70001, 4096};
  auto table_arena = make_device_arena(1 << 20);
  std::vector<AdamWTensor> ts;
  struct Host {
    std::vector<float> p, g, m, v;
    bool decay;
  };
  std::vector<Host> host;
  for (size_t i = 0; i < sizes.size(); ++i) {
    const int64_t n = sizes[i];
    AdamWTensor t;
    t.master = make(DType::F32, {n});
    t.model = make(DType::BF16, {n});
    t.grad = make(grad_dt, {n});
    t.m = make(DType::F32, {n});
    t.v = make(DType::F32, {n});
    t.decay = i % 2 == 0;
    Host h{random_tensor(t.master), random_tensor(t.grad, 3.0f), random_tensor(t.m, 0.1f), {}, t.decay};
    h.v = randn(n, 0.1f);
    for (auto& x : h.v) x = x * x;  // second moments are non-negative
    put(t.v, h.v);
    poison(t.model);
    ts.push_back(t);
    host.push_back(std::move(h));
  }
  MultiTensorAdamW opt(ts, table_arena.get());
  TensorView norm = make(DType::F32, {2});
  poison(norm);
  const float max_norm = 1.0f;  // far below the norm of these gradients: clipping is active
  EXPECT_EQ(opt.grad_norm(norm, max_norm, ctx), BackendType::TURBO);
  double ss = 0.0;
  for (auto& h : host) ss += cpu::sum_squares(h.g.data(), static_cast<int64_t>(h.g.size()));
  const double rnorm = std::sqrt(ss), rscale = cpu::clip_scale(rnorm, max_norm);
  auto nv = get(norm);
  EXPECT_NEAR(nv[0], rnorm, 1e-5 * rnorm);
  EXPECT_NEAR(nv[1], rscale, 1e-5 * rscale);
  ASSERT_LT(rscale, 1.0);
  auto first = bytes(norm);
  opt.grad_norm(norm, max_norm, ctx);
  EXPECT_EQ(bytes(norm), first) << "grad norm must be deterministic";

  AdamWHyper hp;
  hp.lr = 3e-3f;
  hp.weight_decay = 0.1f;
  for (int64_t step = 1; step <= 3; ++step) {
    hp.step = step;
    EXPECT_EQ(opt.step(hp, norm.slice0(1, 2), {}, ctx), BackendType::TURBO);
    cpu::AdamWParams p;
    p.lr = hp.lr;
    p.beta1 = hp.beta1;
    p.beta2 = hp.beta2;
    p.eps = hp.eps;
    p.step = step;
    p.grad_scale = nv[1];
    for (auto& h : host) {
      p.weight_decay = h.decay ? hp.weight_decay : 0.0;
      cpu::adamw_update(h.p.data(), h.g.data(), h.m.data(), h.v.data(), static_cast<int64_t>(h.p.size()), p);
    }
  }
  for (size_t i = 0; i < ts.size(); ++i) {
    SCOPED_TRACE("tensor " + std::to_string(i));
    EXPECT_LT(rel_err(get(ts[i].master), host[i].p), 1e-5);
    EXPECT_LT(rel_err(get(ts[i].m), host[i].m), 1e-5);
    EXPECT_LT(rel_err(get(ts[i].v), host[i].v), 1e-5);
    EXPECT_LT(rel_err(get(ts[i].model), host[i].p), 1e-2) << "the bf16 copy follows the master";
  }
}

// The update that also reports the norm of the gradients it read (the optimizer in the backward):
// the norm equals grad_norm's, the update equals the plain one, and a vetoed update (NaN scale)
// reports NaN and writes nothing.
TEST_P(OptimizerTest, AdamWWithNormMatchesGradNormAndThePlainUpdate) {
  const DType grad_dt = GetParam();
  const std::vector<int64_t> sizes = {1000, 4099, 7, 70001, 4096, 8 * 4096 + 13};
  auto table_arena = make_device_arena(1 << 20);
  std::vector<AdamWTensor> a, b;
  for (int64_t n : sizes) {
    AdamWTensor t;
    t.master = make(DType::F32, {n});
    t.model = make(DType::BF16, {n});
    t.grad = make(grad_dt, {n});
    t.m = make(DType::F32, {n});
    t.v = make(DType::F32, {n});
    AdamWTensor u{make(DType::F32, {n}), make(DType::BF16, {n}), t.grad, make(DType::F32, {n}), make(DType::F32, {n}),
                  t.decay};
    const auto p = random_tensor(t.master);
    put(u.master, p);
    random_tensor(t.grad, 2.0f);
    for (const TensorView* x : {&t.m, &u.m, &t.v, &u.v}) put(*x, std::vector<float>(size_t(n), 0.0f));
    a.push_back(t);
    b.push_back(u);
  }
  MultiTensorAdamW with_norm(a, table_arena.get()), plain(b, table_arena.get());
  TensorView ref = make(DType::F32, {2}), got = make(DType::F32, {2});
  with_norm.grad_norm(ref, 0.0f, ctx);
  AdamWHyper hp;
  hp.lr = 1e-3f;
  hp.weight_decay = 0.1f;
  for (int64_t step = 1; step <= 2; ++step) {
    hp.step = step;
    poison(got);
    EXPECT_EQ(with_norm.step(hp, {}, {}, ctx, got), BackendType::TURBO);
    plain.step(hp, {}, {}, ctx);
    const auto r = get(ref), g = get(got);
    EXPECT_NEAR(g[0], r[0], 1e-5 * r[0]) << "step " << step;
    EXPECT_EQ(g[1], 1.0f);
  }
  for (size_t i = 0; i < a.size(); ++i) {
    EXPECT_EQ(bytes(a[i].master), bytes(b[i].master)) << "tensor " << i;
    EXPECT_EQ(bytes(a[i].model), bytes(b[i].model)) << "tensor " << i;
  }
  TensorView nan_scale = make(DType::F32, {1});
  put(nan_scale, std::vector<float>{std::nanf("")});
  const auto before = bytes(a[3].master);
  with_norm.step(hp, nan_scale, {}, ctx, got);
  EXPECT_TRUE(std::isnan(get(got)[0])) << "a skipped update reports NaN";
  EXPECT_EQ(bytes(a[3].master), before) << "a skipped update writes nothing";
}

TEST_P(OptimizerTest, DeviceScalarsOverrideHostValues) {
  const DType grad_dt = GetParam();
  auto table_arena = make_device_arena(1 << 16);
  AdamWTensor t;
  const int64_t n = 4000;
  t.master = make(DType::F32, {n});
  t.grad = make(grad_dt, {n});
  t.m = make(DType::F32, {n});
  t.v = make(DType::F32, {n});
  auto p0 = random_tensor(t.master);
  auto g = random_tensor(t.grad);
  put(t.m, std::vector<float>(n, 0.0f));
  put(t.v, std::vector<float>(n, 0.0f));
  MultiTensorAdamW opt({t}, table_arena.get());
  TensorView scalars = make(DType::F32, {3});
  const float lr = 0.01f, bc1 = 1.0f - 0.9f, bc2 = 1.0f - 0.999f;  // step 1
  put(scalars, {lr, bc1, bc2});
  AdamWHyper hp;
  hp.lr = 123.0f;  // ignored: the device values win
  hp.step = 1;
  opt.step(hp, {}, scalars, ctx);
  cpu::AdamWParams p;
  p.lr = lr;
  p.step = 1;
  std::vector<float> m(n, 0.0f), v(n, 0.0f);
  cpu::adamw_update(p0.data(), g.data(), m.data(), v.data(), n, p);
  EXPECT_LT(rel_err(get(t.master), p0), 1e-5);
}

// Split masters (turbo/ops/optimizer.h): the update over the bf16 high halves and u16 low halves
// gives, joined, the bits of the same update over f32 masters (with and without the norm, under a
// clip factor, on vector and scalar paths: one tensor starts at an odd element), m and v the same
// bits, the model copy the masters' high halves; a vetoed step writes nothing.
TEST_P(OptimizerTest, SplitMastersGiveTheF32MastersBits) {
  const DType grad_dt = GetParam();
  const std::vector<int64_t> sizes = {1000, 4099, 7, 70001, 4096, 8 * 4096 + 13};
  auto table_arena = make_device_arena(1 << 20);
  std::vector<AdamWTensor> f32s, splits;
  auto upload16 = [](const TensorView& t, const std::vector<uint16_t>& v) {
    CUDA_CHECK(cudaMemcpy(t.data, v.data(), v.size() * 2, cudaMemcpyHostToDevice));
  };
  for (size_t k = 0; k < sizes.size(); ++k) {
    const int64_t n = sizes[k];
    const int64_t at = k == 2 ? 1 : 0;  // the 7-element tensor at an odd element: the scalar path
    AdamWTensor t{make(DType::F32, {n}), make(DType::BF16, {n}), make(grad_dt, {n}), make(DType::F32, {n}),
                  make(DType::F32, {n}), k % 2 == 0};
    AdamWTensor u{make(DType::U16, {n + at}).slice0(at, n + at), make(DType::BF16, {n + at}).slice0(at, n + at),
                  t.grad, make(DType::F32, {n}), make(DType::F32, {n}), t.decay};
    std::vector<float> p = randn(n, 0.5f);
    for (int64_t i = 0; i < n; i += 61) {  // exact ties: the low half 0x8000 under even and odd high halves
      uint32_t b;
      std::memcpy(&b, &p[size_t(i)], 4);
      b = (b & 0xffff0000u) | 0x8000u;
      std::memcpy(&p[size_t(i)], &b, 4);
    }
    put(t.master, p);
    std::vector<uint16_t> hi, lo;
    for (float x : p) hi.push_back(split_f32_hi(x)), lo.push_back(split_f32_lo(x));
    upload16(u.model, hi);
    upload16(u.master, lo);
    random_tensor(t.grad, 2.0f);
    same_moments(t, u);
    f32s.push_back(t);
    splits.push_back(u);
  }
  MultiTensorAdamW of(f32s, table_arena.get()), os(splits, table_arena.get());
  ASSERT_TRUE(os.split_master());
  TensorView scale = make(DType::F32, {1}), nf = make(DType::F32, {2}), ns = make(DType::F32, {2});
  put(scale, {0.5f});
  AdamWHyper hp;
  hp.lr = 3e-3f;
  hp.weight_decay = 0.1f;
  for (int64_t step = 1; step <= 3; ++step) {
    hp.step = step;
    const bool norm = step != 2;
    EXPECT_EQ(of.step(hp, scale, {}, ctx, norm ? nf : TensorView()), BackendType::TURBO);
    EXPECT_EQ(os.step(hp, scale, {}, ctx, norm ? ns : TensorView()), BackendType::TURBO);
    if (norm) EXPECT_EQ(bytes(nf), bytes(ns)) << "step " << step;
  }
  auto u16s = [this](const TensorView& t) {
    const std::vector<uint8_t> b = bytes(t);
    std::vector<uint16_t> out(b.size() / 2);
    std::memcpy(out.data(), b.data(), b.size());
    return out;
  };
  for (size_t k = 0; k < sizes.size(); ++k) {
    SCOPED_TRACE("tensor " + std::to_string(k));
    const std::vector<float> master = get(f32s[k].master);
    const std::vector<uint16_t> hi = u16s(splits[k].model), lo = u16s(splits[k].master), rne = u16s(f32s[k].model);
    int64_t ties = 0;
    for (size_t i = 0; i < master.size(); ++i) {
      const float joined = join_f32(hi[i], lo[i]);
      ASSERT_EQ(std::memcmp(&joined, &master[i], 4), 0) << "element " << i;
      ASSERT_EQ(hi[i], split_f32_hi(master[i])) << "element " << i;
      if (hi[i] != rne[i]) {  // only where the f32 master's copy rounded an exact tie to even
        ASSERT_EQ(lo[i], 0x8000u) << "element " << i;
        ++ties;
      }
    }
    EXPECT_LE(ties, int64_t(master.size()) / 61 + 1);
    EXPECT_EQ(bytes(splits[k].m), bytes(f32s[k].m));
    EXPECT_EQ(bytes(splits[k].v), bytes(f32s[k].v));
  }
  put(scale, {std::nanf("")});
  const auto before = bytes(splits[3].master), before_hi = bytes(splits[3].model);
  os.step(hp, scale, {}, ctx, ns);
  EXPECT_EQ(bytes(splits[3].master), before) << "a vetoed step writes nothing";
  EXPECT_EQ(bytes(splits[3].model), before_hi);
}

INSTANTIATE_TEST_SUITE_P(Turbo, OptimizerTest, ::testing::Values(DType::F32, DType::BF16), dtype_param_name);

// One table whose tensors differ in gradient dtype (a trainer with bf16 expert gradients beside f32
// ones): each tensor gets exactly the bits of a table of its own dtype, and the norm covers both.
class OptimizerMixedTest : public OptimizerFixture {};
TEST_F(OptimizerMixedTest, AdamWTableWithMixedGradientDtypes) {
  const std::vector<int64_t> sizes = {1000, 4099, 7, 70001, 4096};
  auto table_arena = make_device_arena(1 << 20);
  std::vector<AdamWTensor> mixed, f32s, bf16s;
  std::vector<size_t> home;  // index of tensor i in its uniform table
  double ss = 0.0;
  for (size_t i = 0; i < sizes.size(); ++i) {
    const int64_t n = sizes[i];
    const DType gd = i % 2 == 0 ? DType::BF16 : DType::F32;
    AdamWTensor t{make(DType::F32, {n}), make(DType::BF16, {n}), make(gd, {n}), make(DType::F32, {n}), make(DType::F32, {n}),
                  i % 3 != 0};
    AdamWTensor u{make(DType::F32, {n}), make(DType::BF16, {n}), t.grad, make(DType::F32, {n}), make(DType::F32, {n}), t.decay};
    put(u.master, random_tensor(t.master));
    const std::vector<float> g = random_tensor(t.grad, 2.0f);
    ss += cpu::sum_squares(g.data(), n);
    same_moments(t, u);
    mixed.push_back(t);
    auto& uniform = gd == DType::BF16 ? bf16s : f32s;
    home.push_back(uniform.size());
    uniform.push_back(u);
  }
  MultiTensorAdamW opt(mixed, table_arena.get()), of(f32s, table_arena.get()), ob(bf16s, table_arena.get());
  EXPECT_TRUE(opt.mixed_grads());
  EXPECT_FALSE(of.mixed_grads());
  TensorView norm = make(DType::F32, {2});
  AdamWHyper hp;
  hp.lr = 1e-3f;
  hp.weight_decay = 0.1f;
  for (int64_t step = 1; step <= 2; ++step) {
    hp.step = step;
    poison(norm);
    EXPECT_EQ(opt.step(hp, {}, {}, ctx, norm), BackendType::TURBO);
    of.step(hp, {}, {}, ctx);
    ob.step(hp, {}, {}, ctx);
    EXPECT_NEAR(get(norm)[0], std::sqrt(ss), 1e-5 * std::sqrt(ss)) << "step " << step;
  }
  for (size_t i = 0; i < mixed.size(); ++i) {
    const AdamWTensor& u = (i % 2 == 0 ? bf16s : f32s)[home[i]];
    EXPECT_EQ(bytes(mixed[i].master), bytes(u.master)) << "tensor " << i;
    EXPECT_EQ(bytes(mixed[i].m), bytes(u.m)) << "tensor " << i;
    EXPECT_EQ(bytes(mixed[i].v), bytes(u.v)) << "tensor " << i;
    EXPECT_EQ(bytes(mixed[i].model), bytes(u.model)) << "tensor " << i;
  }
  TensorView out = make(DType::F32, {2});
  EXPECT_EQ(opt.grad_norm(out, 0.0f, ctx), BackendType::TURBO);
  EXPECT_NEAR(get(out)[0], std::sqrt(ss), 1e-5 * std::sqrt(ss));
}

// bf16 moments (each of m and v alone and both; turbo/ops/optimizer.h) against the CPU kernel,
// which rounds with the same keyed bits: the weights within 1e-5, the moments the same bf16 value
// except where the two fp32 results straddle a rounding threshold (a few in 10^4): one ulp apart
// there, or, where b1 m and (1 - b1) g nearly cancel (the two kernels round that sum's terms
// differently), within 1e-5 of the tensor's largest moment; on the vector paths, the scalar path
// (the 7-element tensor at an odd element) and tails.
// Split masters with bf16 moments and the norm (the optimizer in the backward's kernel) give the
// bits of f32 masters with bf16 moments; device scalars {lr, bc1, bc2, step} the bits of host ones,
// and device scalars without the step are refused with bf16 moments.
class OptimizerBf16MomentsTest : public OptimizerFixture {};
TEST_F(OptimizerBf16MomentsTest, MatchTheCpuKernelOnEveryPath) {
  const std::vector<int64_t> sizes = {1000, 4099, 7, 70001, 4096};
  auto table_arena = make_device_arena(1 << 20);
  for (const int combo : {1, 2, 3}) {
    const bool m16 = combo & 1, v16 = combo & 2;
    SCOPED_TRACE(fmt::format("m {} v {}", m16 ? "bf16" : "f32", v16 ? "bf16" : "f32"));
    const DType md = m16 ? DType::BF16 : DType::F32, vd = v16 ? DType::BF16 : DType::F32;
    auto scope = scoped_tensors();
    std::vector<AdamWTensor> ts;
    struct Host {
      std::vector<float> p, g, m, v;
      bool decay;
      int64_t key;
    };
    std::vector<Host> host;
    int64_t key = 0;
    for (size_t k = 0; k < sizes.size(); ++k) {
      const int64_t n = sizes[k], at = k == 2 ? 1 : 0;
      AdamWTensor t;
      t.master = make(DType::F32, {n});
      t.model = make(DType::BF16, {n});
      t.grad = make(k % 2 ? DType::BF16 : DType::F32, {n});
      t.m = make(md, {n + at}).slice0(at, n + at);
      t.v = make(vd, {n + at}).slice0(at, n + at);
      t.decay = k % 2 == 0;
      t.sr_key = key;
      Host h{random_tensor(t.master), random_tensor(t.grad, 2.0f), random_tensor(t.m, 0.1f), {}, t.decay, key};
      h.v = round_all(vd, randn(n, 0.1f));
      for (auto& x : h.v) x = round_to(vd, x * x);
      put(t.v, h.v);
      key += n;
      ts.push_back(t);
      host.push_back(std::move(h));
    }
    MultiTensorAdamW opt(ts, table_arena.get());
    EXPECT_EQ(opt.m_dtype(), md);
    EXPECT_EQ(opt.v_dtype(), vd);
    TensorView scale = make(DType::F32, {1}), norm = make(DType::F32, {2});
    put(scale, {0.5f});
    AdamWHyper hp;
    hp.lr = 3e-3f;
    hp.weight_decay = 0.1f;
    for (int64_t step = 1; step <= 3; ++step) {
      hp.step = step;
      EXPECT_EQ(opt.step(hp, scale, {}, ctx, step != 2 ? norm : TensorView()), BackendType::TURBO);
      cpu::AdamWParams p;
      p.lr = hp.lr, p.beta1 = hp.beta1, p.beta2 = hp.beta2, p.eps = hp.eps, p.step = step, p.grad_scale = 0.5;
      p.m_bf16 = m16, p.v_bf16 = v16;
      for (auto& h : host) {
        p.weight_decay = h.decay ? hp.weight_decay : 0.0;
        p.sr_key = h.key;
        cpu::adamw_update(h.p.data(), h.g.data(), h.m.data(), h.v.data(), static_cast<int64_t>(h.p.size()), p);
      }
    }
    for (size_t k = 0; k < sizes.size(); ++k) {
      SCOPED_TRACE("tensor " + std::to_string(k));
      EXPECT_LT(rel_err(get(ts[k].master), host[k].p), 1e-5);
      for (auto [dev, ref, b16] : {std::tuple{get(ts[k].m), host[k].m, m16}, {get(ts[k].v), host[k].v, v16}}) {
        if (!b16) {
          EXPECT_LT(rel_err(dev, ref), 1e-5);
          continue;
        }
        int64_t off = 0;
        float top = 0.0f;
        for (float x : ref) top = std::max(top, std::fabs(x));
        for (size_t i = 0; i < dev.size(); ++i) {
          if (dev[i] == ref[i]) continue;
          ++off;
          const int d = std::abs(int(float_to_bf16_bits(dev[i])) - int(float_to_bf16_bits(ref[i])));
          if (d != 1) ASSERT_LE(std::fabs(dev[i] - ref[i]), 1e-5f * top) << "element " << i << ": " << dev[i] << " vs " << ref[i];
        }
        EXPECT_LE(off, int64_t(dev.size()) / 500 + 1);
      }
    }
  }
  // The optimizer in the backward's kernel: split masters, bf16 moments, the norm.
  auto scope = scoped_tensors();
  const int64_t n = 70001;
  AdamWTensor f{make(DType::F32, {n}), make(DType::BF16, {n}), make(DType::BF16, {n}), make(DType::BF16, {n}),
                make(DType::BF16, {n}), true, 12345};
  AdamWTensor u{make(DType::U16, {n}), make(DType::BF16, {n}), f.grad, make(DType::BF16, {n}), make(DType::BF16, {n}),
                true, 12345};
  std::vector<float> p = randn(n, 0.5f);
  for (auto& x : p) x = join_f32(split_f32_hi(x), split_f32_lo(x));
  put(f.master, p);
  std::vector<uint16_t> hi, lo;
  for (float x : p) hi.push_back(split_f32_hi(x)), lo.push_back(split_f32_lo(x));
  CUDA_CHECK(cudaMemcpy(u.model.data, hi.data(), hi.size() * 2, cudaMemcpyHostToDevice));
  CUDA_CHECK(cudaMemcpy(u.master.data, lo.data(), lo.size() * 2, cudaMemcpyHostToDevice));
  random_tensor(f.grad, 2.0f);
  const std::vector<float> m0 = random_tensor(f.m, 0.1f);
  put(u.m, m0);
  std::vector<float> v0 = randn(n, 0.1f);
  for (auto& x : v0) x = round_to(DType::BF16, x * x);
  put(f.v, v0), put(u.v, v0);
  MultiTensorAdamW of({f}, table_arena.get()), os({u}, table_arena.get());
  TensorView nf = make(DType::F32, {2}), ns = make(DType::F32, {2}), scalars = make(DType::F32, {4});
  AdamWHyper hp;
  hp.lr = 1e-3f;
  for (int64_t step = 1; step <= 2; ++step) {
    hp.step = step;
    of.step(hp, {}, {}, ctx, nf);
    // The same step from device scalars (what a graph replay reads); the host lr is ignored.
    const float sc[4] = {hp.lr, static_cast<float>(1.0 - std::pow(double(hp.beta1), double(step))),
                         static_cast<float>(1.0 - std::pow(double(hp.beta2), double(step))), static_cast<float>(step)};
    put(scalars, {sc[0], sc[1], sc[2], sc[3]});
    AdamWHyper other = hp;
    other.lr = 99.0f;
    os.step(other, {}, scalars, ctx, ns);
    EXPECT_EQ(bytes(nf), bytes(ns)) << "step " << step;
  }
  const std::vector<float> master = get(f.master);
  std::vector<uint16_t> h2(static_cast<size_t>(n)), l2(static_cast<size_t>(n));
  CUDA_CHECK(cudaMemcpy(h2.data(), u.model.data, h2.size() * 2, cudaMemcpyDeviceToHost));
  CUDA_CHECK(cudaMemcpy(l2.data(), u.master.data, l2.size() * 2, cudaMemcpyDeviceToHost));
  for (size_t i = 0; i < master.size(); ++i) {
    const float joined = join_f32(h2[i], l2[i]);
    ASSERT_EQ(std::memcmp(&joined, &master[i], 4), 0) << "element " << i;
  }
  EXPECT_EQ(bytes(u.m), bytes(f.m));
  EXPECT_EQ(bytes(u.v), bytes(f.v));
  EXPECT_NE(get(u.m), m0) << "the moments moved";
  TensorView three = make(DType::F32, {3});
  put(three, {1e-3f, 0.1f, 0.001f});
  EXPECT_THROW(os.step(hp, {}, three, ctx), RuntimeError) << "bf16 moments need the step among the device scalars";
}

}  // namespace
}  // namespace primus::turbo::testing
