// turbo::attention on the GPU (CUDNN and TURBO backends) against the fp64 CPU reference:
// out, lse, dq, dk, dv over causal / non-causal, MHA / GQA / MQA, head_dim 64 / 128, bf16 / f16,
// ragged sequence lengths, packed documents; plus the independence of packed documents and the
// dispatcher's choice. Skips itself without a CUDA device.
#include <cuda_runtime_api.h>
#include <fmt/format.h>
#include <gtest/gtest.h>

#include <algorithm>
#include <cmath>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <memory>
#include <random>
#include <tuple>

#include "core/util/error.h"
#include "tests/attention_gpu/attention_reference.h"
#include "turbo/core/cuda_arena.h"
#include "turbo/core/cuda_check.h"
#include "turbo/dispatch/backend_manager.h"
#include "turbo/kernels/cuda/attention_flash.h"
#include "turbo/ops/attention.h"
#if defined(PRIMUS_TURBO_WITH_CUDNN)
#include "turbo/kernels/cudnn/sdpa_cudnn.h"
#endif

namespace primus::turbo::testing {
namespace {

constexpr double kGateRelL2 = 1e-2;   // DESIGN.md's bf16 gate, on norms
constexpr double kGateMaxRel = 2e-2;  // worst element against the reference's scale

struct Param {
  BackendType backend;
  const char* kernel;  // TURBO kernels: "" (default on sm_90: TMA warp-specialised wgmma forward and
                       // backward), "sm90pipe" (cp.async-fed pipelined wgmma forward), "sm90"
                       // (unpipelined wgmma forward), "bwdsm90" (default forward, the wgmma backward
                       // whose threads all load) or "sm80" (mma.sync both ways)
  DType dtype;
  bool causal;
  int64_t KVH;  // with H = 4
  int64_t D;
  int64_t T;
};

std::string param_name(const ::testing::TestParamInfo<Param>& info) {
  const Param& p = info.param;
  return fmt::format("{}{}_{}_{}_kvh{}_d{}_t{}", backend_name(p.backend), *p.kernel ? std::string("_") + p.kernel : "", dtype_name(p.dtype),
                     p.causal ? "causal" : "full", p.KVH, p.D, p.T);
}

class AttnGpu : public ::testing::Test {
 protected:
  void SetUp() override {
    if (cuda_device_count_or_zero() == 0) GTEST_SKIP() << "no CUDA device";
    arena_ = make_device_arena(size_t{512} << 20);
    scratch_ = make_device_arena(size_t{256} << 20);
    ctx_.scratch = scratch_.get();
    seed_ = std::random_device{}();
    rng_.seed(seed_);
    trace_ = std::make_unique<::testing::ScopedTrace>(__FILE__, __LINE__, fmt::format("seed {}", seed_));
  }
  void TearDown() override {
    GlobalBackendManager::instance().reset();
    set_kernel("");
    unsetenv("PRIMUS_TURBO_ATTN_SM90_VDESC");
    trace_.reset();
  }

  TensorView make(DType dt, std::initializer_list<int64_t> shape) { return arena_->tensor(dt, shape); }
  // Selects the TURBO kernels (see Param::kernel) through their environment switches.
  static void set_kernel(const char* kernel) {
    unsetenv("PRIMUS_TURBO_ATTN_KERNEL");
    unsetenv("PRIMUS_TURBO_ATTN_BWD_KERNEL");
    if (std::strcmp(kernel, "bwdsm90") == 0) {
      setenv("PRIMUS_TURBO_ATTN_BWD_KERNEL", "sm90", 1);
      return;
    }
    if (*kernel) setenv("PRIMUS_TURBO_ATTN_KERNEL", kernel, 1);
    if (std::strcmp(kernel, "sm80") == 0) setenv("PRIMUS_TURBO_ATTN_BWD_KERNEL", "sm80", 1);
  }
  void put(const TensorView& t, const std::vector<double>& v) {
    std::vector<char> host(t.nbytes());
    for (size_t i = 0; i < v.size(); ++i) store_from_float(host.data(), t.dtype, i, static_cast<float>(v[i]));
    CUDA_CHECK(cudaMemcpy(t.data, host.data(), host.size(), cudaMemcpyHostToDevice));
  }
  std::vector<float> get(const TensorView& t) {
    CUDA_CHECK(cudaDeviceSynchronize());
    std::vector<char> host(t.nbytes());
    CUDA_CHECK(cudaMemcpy(host.data(), t.data, host.size(), cudaMemcpyDeviceToHost));
    std::vector<float> out(static_cast<size_t>(t.numel()));
    for (size_t i = 0; i < out.size(); ++i) out[i] = load_as_float(host.data(), t.dtype, i);
    return out;
  }
  void poison(const TensorView& t) { CUDA_CHECK(cudaMemset(t.data, 0xFF, t.nbytes())); }
  // NaN bytes over the first half of the scratch arena, where the next call's buffers go.
  void poison_scratch() {
    ArenaScope s(*scratch_);
    const size_t n = scratch_->capacity() / 2;
    CUDA_CHECK(cudaMemset(scratch_->allocate(n, 256, "poison"), 0xFF, n));
  }

  // Device tensors of one case.
  struct Dev {
    TensorView q, k, v, out, lse, dout, dq, dk, dv, cu;
  };
  Dev upload(const AttnCase& c, DType dt, const AttnTensors& t) {
    Dev d;
    d.q = make(dt, {c.B, c.T, c.H, c.D});
    d.k = make(dt, {c.B, c.T, c.KVH, c.D});
    d.v = make(dt, {c.B, c.T, c.KVH, c.D});
    d.out = make(dt, {c.B, c.T, c.H, c.D});
    d.lse = make(DType::F32, {c.B, c.H, c.T});
    d.dout = make(dt, {c.B, c.T, c.H, c.D});
    d.dq = make(dt, {c.B, c.T, c.H, c.D});
    d.dk = make(dt, {c.B, c.T, c.KVH, c.D});
    d.dv = make(dt, {c.B, c.T, c.KVH, c.D});
    put(d.q, t.q), put(d.k, t.k), put(d.v, t.v), put(d.dout, t.dout);
    if (!c.cu_seqlens.empty()) {
      d.cu = make(DType::I32, {static_cast<int64_t>(c.cu_seqlens.size())});
      CUDA_CHECK(cudaMemcpy(d.cu.data, c.cu_seqlens.data(), c.cu_seqlens.size() * 4, cudaMemcpyHostToDevice));
    }
    return d;
  }
  AttnTensors random_inputs(const AttnCase& c, DType dt) {
    AttnTensors t;
    const size_t nq = static_cast<size_t>(c.B * c.T * c.H * c.D), nk = static_cast<size_t>(c.B * c.T * c.KVH * c.D);
    t.q = random_values(rng_, nq, dt);
    t.k = random_values(rng_, nk, dt);
    t.v = random_values(rng_, nk, dt);
    t.dout = random_values(rng_, nq, dt);
    return t;
  }
  AttentionOptions options(const AttnCase& c, const Dev& d) {
    AttentionOptions o;
    o.causal = c.causal;
    o.deterministic = deterministic_;
    if (c.scale) o.softmax_scale = static_cast<float>(*c.scale);
    o.cu_seqlens = d.cu;
    o.window = c.window;
    return o;
  }
  // Runs forward then backward (outputs poisoned first); returns the backends that ran.
  std::pair<BackendType, BackendType> run(const AttnCase& c, Dev& d) {
    for (const TensorView* t : {&d.out, &d.lse, &d.dq, &d.dk, &d.dv}) poison(*t);
    AttentionForwardArgs f;
    f.out = d.out, f.lse = d.lse, f.q = d.q, f.k = d.k, f.v = d.v;
    f.opt = options(c, d);
    f.ctx = ctx_;
    const BackendType fb = attention_forward(f);
    AttentionBackwardArgs b;
    b.dq = d.dq, b.dk = d.dk, b.dv = d.dv, b.dout = d.dout, b.q = d.q, b.k = d.k, b.v = d.v, b.out = d.out, b.lse = d.lse;
    b.opt = f.opt;
    b.ctx = ctx_;
    const BackendType bb = attention_backward(b);
    CUDA_CHECK(cudaDeviceSynchronize());
    return {fb, bb};
  }
  void expect_close(const char* what, const std::vector<float>& got, const std::vector<double>& ref) {
    const ErrorStats e = compare(got, ref);
    EXPECT_LE(e.rel_l2, kGateRelL2) << what << ": rel_l2 " << e.rel_l2 << " max_rel " << e.max_rel;
    EXPECT_LE(e.max_rel, kGateMaxRel) << what << ": rel_l2 " << e.rel_l2 << " max_rel " << e.max_rel;
  }
  void check_all(const AttnTensors& ref, Dev& d) {
    expect_close("out", get(d.out), ref.out);
    expect_close("lse", get(d.lse), ref.lse);
    expect_close("dq", get(d.dq), ref.dq);
    expect_close("dk", get(d.dk), ref.dk);
    expect_close("dv", get(d.dv), ref.dv);
  }

  std::mt19937 rng_;
  ExecContext ctx_;
  bool deterministic_ = false;  // AttentionOptions::deterministic for run()

 private:
  std::unique_ptr<Arena> arena_, scratch_;
  unsigned seed_ = 0;
  std::unique_ptr<::testing::ScopedTrace> trace_;
};

class AttnGpuCases : public AttnGpu, public ::testing::WithParamInterface<Param> {};

TEST_P(AttnGpuCases, MatchesFp64Reference) {
  const Param& p = GetParam();
  AttnCase c;
  c.B = 2, c.T = p.T, c.H = 4, c.KVH = p.KVH, c.D = p.D, c.causal = p.causal;
  AttnTensors t = random_inputs(c, p.dtype);
  run_reference(c, t);
  Dev d = upload(c, p.dtype, t);
  GlobalBackendManager::instance().set_backend("attention", p.backend);
  set_kernel(p.kernel);
  const auto [fb, bb] = run(c, d);
  EXPECT_EQ(fb, p.backend);
  EXPECT_EQ(bb, p.backend);
  check_all(t, d);
}

std::vector<Param> dense_params() {
  struct Be {
    BackendType type;
    const char* kernel;
  };
  const Be backends[] = {{BackendType::CUDNN, ""},
                         {BackendType::TURBO, ""},
                         {BackendType::TURBO, "sm90pipe"},
                         {BackendType::TURBO, "sm90"},
                         {BackendType::TURBO, "bwdsm90"},
                         {BackendType::TURBO, "sm80"}};
  std::vector<Param> ps;
  for (const Be& be : backends)
    for (DType dt : {DType::BF16, DType::F16})
      for (bool causal : {true, false})
        for (int64_t kvh : {int64_t{4}, int64_t{2}, int64_t{1}})
          for (int64_t D : {int64_t{64}, int64_t{128}}) {
            if (dt == DType::F16 && kvh == 2) continue;  // f16 needs no full cross product
            ps.push_back({be.type, be.kernel, dt, causal, kvh, D, 256});
          }
  // Lengths that are no multiple of any tile: partial tiles on both axes.
  for (const Be& be : backends)
    for (bool causal : {true, false}) {
      ps.push_back({be.type, be.kernel, DType::BF16, causal, 2, 128, 200});
      ps.push_back({be.type, be.kernel, DType::BF16, causal, 1, 64, 77});
    }
  return ps;
}
INSTANTIATE_TEST_SUITE_P(Dense, AttnGpuCases, ::testing::ValuesIn(dense_params()), param_name);

// A softmax scale other than 1/sqrt(D) reaches every backend.
TEST_F(AttnGpu, CustomScale) {
  for (BackendType be : {BackendType::CUDNN, BackendType::TURBO}) {
    SCOPED_TRACE(std::string(backend_name(be)));
    AttnCase c;
    c.T = 128, c.D = 64, c.KVH = 2, c.scale = 0.37;
    AttnTensors t = random_inputs(c, DType::BF16);
    run_reference(c, t);
    Dev d = upload(c, DType::BF16, t);
    GlobalBackendManager::instance().set_backend("attention", be);
    run(c, d);
    check_all(t, d);
  }
}

// The A/B switches of the warp-specialised kernels (not the defaults, so no other test runs them):
// the forward without ping-pong turns, without the scale fused into exp2 and with one block per
// tile instead of persistent blocks, a negative softmax scale (which takes the unfused forward by
// itself), the backward with one block per key tile (its order then group2) and every other causal
// order of the persistent backward (default keyfast).
// T = 1000 over two batch rows, GQA: ragged last tiles, several key-tile groups, a short tail group.
TEST_F(AttnGpu, Sm90WsSwitchesMatchReference) {
  struct Variant {
    const char* var;
    const char* value;
    double scale;  // 0: 1/sqrt(D)
  };
  const Variant variants[] = {{"PRIMUS_TURBO_ATTN_FWD_PINGPONG", "0", 0.0},    {"PRIMUS_TURBO_ATTN_FWD_FUSED_SCALE", "0", 0.0},
                              {"PRIMUS_TURBO_ATTN_FWD_PERSISTENT", "0", 0.0},   {"PRIMUS_TURBO_ATTN_BWD_PERSISTENT", "0", 0.0},
                              {"PRIMUS_TURBO_ATTN_BWD_ORDER", "group2", 0.0},
                              {"PRIMUS_TURBO_ATTN_FWD_FUSED_SCALE", "1", -0.09}, {"PRIMUS_TURBO_ATTN_BWD_ORDER", "heavy", 0.0},
                              {"PRIMUS_TURBO_ATTN_BWD_ORDER", "group4", 0.0},
                              {"PRIMUS_TURBO_ATTN_BWD_ORDER", "group8", 0.0},    {"PRIMUS_TURBO_ATTN_BWD_BM", "64", 0.0},
                              {"PRIMUS_TURBO_ATTN_BWD_BM", "128", 0.0},          {"PRIMUS_TURBO_ATTN_BWD_DS_FIRST", "0", 0.0},
                              {"PRIMUS_TURBO_ATTN_BWD_DS_FIRST", "1", 0.0},      {"PRIMUS_TURBO_ATTN_BWD_DS_FIRST", "2", 0.0}};
  for (const Variant& v : variants)
    for (int64_t D : {int64_t{64}, int64_t{128}}) {
      SCOPED_TRACE(fmt::format("{}={} scale={} D={}", v.var, v.value, v.scale, D));
      AttnCase c;
      c.B = 2, c.T = 1000, c.H = 4, c.KVH = 2, c.D = D, c.causal = true;
      if (v.scale != 0.0) c.scale = v.scale;
      AttnTensors t = random_inputs(c, DType::BF16);
      run_reference(c, t);
      Dev d = upload(c, DType::BF16, t);
      GlobalBackendManager::instance().set_backend("attention", BackendType::TURBO);
      setenv(v.var, v.value, 1);
      run(c, d);
      unsetenv(v.var);
      check_all(t, d);
    }
}

// The persistent warp-specialised kernels with more work than the device has SMs, so blocks walk
// several: 9 query tiles (forward) or key tiles (backward) x 8 heads x 4 batch rows = 288 (on a
// 132-SM H100 / H200 the first 24 blocks take 3, so each Q buffer of the forward and the backward's
// K/V buffer are reused and both rings' phases run on across works), T = 1100 (a ragged last tile),
// head_dim 64 (the forward's two Q buffers) and 128 (one), causal, full, and packed documents.
TEST_F(AttnGpu, Sm90WsPersistentKernelsWalkManyTiles) {
  for (int64_t D : {int64_t{64}, int64_t{128}})
    for (int mode = 0; mode < 3; ++mode) {
      SCOPED_TRACE(fmt::format("D={} {}", D, mode == 0 ? "causal" : mode == 1 ? "full" : "packed causal"));
      AttnCase c;
      c.B = 4, c.T = 1100, c.H = 8, c.KVH = 8, c.D = D, c.causal = mode != 1;
      if (mode == 2) c.cu_seqlens = random_cu_seqlens(rng_, c.B, c.T, 3);
      AttnTensors t = random_inputs(c, DType::BF16);
      run_reference(c, t);
      Dev d = upload(c, DType::BF16, t);
      GlobalBackendManager::instance().set_backend("attention", BackendType::TURBO);
      run(c, d);
      check_all(t, d);
    }
}

// The Hopper backward whose threads all load (PRIMUS_TURBO_ATTN_BWD_KERNEL=sm90) adds dQ with TMA
// reduce-adds from shared memory by default and with the threads' f32 atomics under
// PRIMUS_TURBO_ATTN_BWD_DQ=atomic:
// both are at the gate against the reference, dK and dV do not depend on the choice (bitwise),
// and dQ differs only by the order of its f32 additions: at most one bf16 unit in the last place
// per element, or 2^-12 of the largest |dq| for elements made small by cancellation (the unit
// bound alone failed once in about 30 runs on an H200).
// T = 200 over two batch rows: the last query tile's rows past T are clipped, not added to the
// next row's first tokens.
TEST_F(AttnGpu, Sm90BackwardDqReduceMatchesAtomics) {
  for (int64_t D : {int64_t{64}, int64_t{128}})
    for (bool causal : {true, false}) {
      SCOPED_TRACE(fmt::format("D={} causal={}", D, causal));
      AttnCase c;
      c.B = 2, c.T = 200, c.H = 4, c.KVH = 2, c.D = D, c.causal = causal;
      AttnTensors t = random_inputs(c, DType::BF16);
      run_reference(c, t);
      Dev d = upload(c, DType::BF16, t);
      GlobalBackendManager::instance().set_backend("attention", BackendType::TURBO);
      std::vector<float> dq[2], dk[2], dv[2];
      for (int atomic : {0, 1}) {
        SCOPED_TRACE(atomic ? "atomics" : "TMA reduce");
        setenv("PRIMUS_TURBO_ATTN_BWD_KERNEL", "sm90", 1);
        if (atomic) setenv("PRIMUS_TURBO_ATTN_BWD_DQ", "atomic", 1);
        run(c, d);
        unsetenv("PRIMUS_TURBO_ATTN_BWD_DQ");
        unsetenv("PRIMUS_TURBO_ATTN_BWD_KERNEL");
        check_all(t, d);
        dq[atomic] = get(d.dq), dk[atomic] = get(d.dk), dv[atomic] = get(d.dv);
      }
      EXPECT_EQ(dk[0], dk[1]);
      EXPECT_EQ(dv[0], dv[1]);
      // One bf16 unit of the larger value, or (elements that are small by cancellation, whose f32
      // sums differ by more than their own size in the two orders) 2^-12 of the tensor's largest.
      float dq_max = 0.0f;
      for (float x : dq[0]) dq_max = std::max(dq_max, std::fabs(x));
      int64_t beyond_ulp = 0;
      for (size_t i = 0; i < dq[0].size(); ++i) {
        const float a = dq[0][i], b = dq[1][i];
        const float bound = std::max(std::ldexp(std::max(std::fabs(a), std::fabs(b)), -7), std::ldexp(dq_max, -12));
        beyond_ulp += std::fabs(a - b) > bound;
      }
      EXPECT_EQ(beyond_ulp, 0) << "dq elements differing by more than one bf16 unit (largest |dq| " << dq_max << ")";
    }
}

// The warp-specialised backward (TMA producer, two-stage Q/dO ring, double-buffered dS^T, one
// dQ reduce per warpgroup) against the fp64 reference and against the kernel whose threads all load
// (PRIMUS_TURBO_ATTN_BWD_KERNEL=sm90) on a walk long enough to reuse every ring slot many times:
// T = 1000 (a ragged last tile), 4 query heads on one kv head (16 query tiles x 4 heads per block).
// The two differ only in rounding (lse enters in base 2 precomputed), so their dq, dk, dv agree to
// well below the gate.
TEST_F(AttnGpu, Sm90WsBackwardMatchesSm90) {
  // Both kernels exist on compute capability 9.0 only (elsewhere both runs would take the mma.sync
  // kernel and the comparison would prove nothing); the test never sets PRIMUS_TURBO_ATTN_BWD_DQ,
  // and CUDA 13's runtime has the TMA encoder, so sm90ws does run here.
  int dev = 0, major = 0, minor = 0;
  CUDA_CHECK(cudaGetDevice(&dev));
  CUDA_CHECK(cudaDeviceGetAttribute(&major, cudaDevAttrComputeCapabilityMajor, dev));
  CUDA_CHECK(cudaDeviceGetAttribute(&minor, cudaDevAttrComputeCapabilityMinor, dev));
  if (major * 10 + minor != 90) GTEST_SKIP() << "the wgmma backwards need compute capability 9.0, this is " << major << "." << minor;
  ASSERT_EQ(getenv("PRIMUS_TURBO_ATTN_BWD_DQ"), nullptr) << "PRIMUS_TURBO_ATTN_BWD_DQ would make sm90ws fall back to sm90";
  for (int64_t D : {int64_t{64}, int64_t{128}})
    for (bool causal : {true, false}) {
      SCOPED_TRACE(fmt::format("D={} causal={}", D, causal));
      AttnCase c;
      c.B = 1, c.T = 1000, c.H = 4, c.KVH = 1, c.D = D, c.causal = causal;
      AttnTensors t = random_inputs(c, DType::BF16);
      run_reference(c, t);
      Dev d = upload(c, DType::BF16, t);
      GlobalBackendManager::instance().set_backend("attention", BackendType::TURBO);
      std::vector<float> got[2][3];
      for (int ws : {0, 1}) {
        SCOPED_TRACE(ws ? "sm90ws" : "sm90");
        setenv("PRIMUS_TURBO_ATTN_BWD_KERNEL", ws ? "sm90ws" : "sm90", 1);
        poison(d.dq), poison(d.dk), poison(d.dv);
        run(c, d);
        unsetenv("PRIMUS_TURBO_ATTN_BWD_KERNEL");
        check_all(t, d);
        got[ws][0] = get(d.dq), got[ws][1] = get(d.dk), got[ws][2] = get(d.dv);
      }
      for (int i = 0; i < 3; ++i) {
        const std::vector<double> other(got[0][i].begin(), got[0][i].end());
        const ErrorStats e = compare(got[1][i], other);
        EXPECT_LE(e.rel_l2, 2e-3) << "dq/dk/dv #" << i << " ws vs sm90: max_rel " << e.max_rel;
      }
    }
}

// Packed documents (TURBO): random document lengths per row, causal and not, GQA; one test per
// TURBO kernel choice (names carry it, so a run can select or skip one).
class AttnGpuVarlen : public AttnGpu, public ::testing::WithParamInterface<const char*> {
 protected:
  void check() {
    set_kernel(GetParam());
    for (int64_t D : {int64_t{64}, int64_t{128}})
      for (bool causal : {true, false}) {
        SCOPED_TRACE(fmt::format("D={} causal={}", D, causal));
        AttnCase c;
        c.B = 2, c.T = 384, c.H = 4, c.KVH = 2, c.D = D, c.causal = causal;
        c.cu_seqlens = random_cu_seqlens(rng_, c.B, c.T, 5);
        AttnTensors t = random_inputs(c, DType::BF16);
        run_reference(c, t);
        Dev d = upload(c, DType::BF16, t);
        const auto [fb, bb] = run(c, d);  // no backend forced: cuDNN declines varlen
        EXPECT_EQ(fb, BackendType::TURBO);
        EXPECT_EQ(bb, BackendType::TURBO);
        check_all(t, d);
      }
  }
};
TEST_P(AttnGpuVarlen, MatchesReference) { check(); }
INSTANTIATE_TEST_SUITE_P(Kernels, AttnGpuVarlen, ::testing::Values("", "sm90pipe", "bwdsm90", "sm80"),
                         [](const ::testing::TestParamInfo<const char*>& i) {
                           return std::string(*i.param ? i.param : "default");
                         });

// Changing one document changes nothing in the others: out, lse, dk, dv of every other document
// stay bitwise equal (their kernels' sums do not depend on the other documents' values), dq equal
// up to the order of its f32 atomic additions (one bf16 unit in the last place: the f32 sums may
// round to neighbouring bf16 values; the 1e-5 bound alone failed once in five runs on an H200); the
// changed document's results do change.
TEST_F(AttnGpu, VarlenDocumentsAreIndependent) {
  AttnCase c;
  c.B = 2, c.T = 256, c.H = 4, c.KVH = 2, c.D = 64, c.causal = true;
  c.cu_seqlens = random_cu_seqlens(rng_, c.B, c.T, 4);
  AttnTensors t = random_inputs(c, DType::BF16);
  Dev d = upload(c, DType::BF16, t);
  GlobalBackendManager::instance().set_backend("attention", BackendType::TURBO);
  run(c, d);
  const auto out0 = get(d.out), lse0 = get(d.lse), dq0 = get(d.dq), dk0 = get(d.dk), dv0 = get(d.dv);

  const size_t victim = std::uniform_int_distribution<size_t>(0, c.cu_seqlens.size() - 2)(rng_);
  const int64_t s = c.cu_seqlens[victim], e = c.cu_seqlens[victim + 1];
  auto fresh = random_inputs(c, DType::BF16);
  for (int64_t tok = s; tok < e; ++tok) {
    for (int64_t i = 0; i < c.H * c.D; ++i) t.q[tok * c.H * c.D + i] = fresh.q[tok * c.H * c.D + i];
    for (int64_t i = 0; i < c.KVH * c.D; ++i) {
      t.k[tok * c.KVH * c.D + i] = fresh.k[tok * c.KVH * c.D + i];
      t.v[tok * c.KVH * c.D + i] = fresh.v[tok * c.KVH * c.D + i];
    }
  }
  put(d.q, t.q), put(d.k, t.k), put(d.v, t.v);
  run(c, d);
  const auto out1 = get(d.out), lse1 = get(d.lse), dq1 = get(d.dq), dk1 = get(d.dk), dv1 = get(d.dv);

  auto in_victim = [&](int64_t token) { return token >= s && token < e; };
  int64_t changed = 0, dq_moved = 0;
  for (int64_t tok = 0; tok < c.B * c.T; ++tok) {
    const int64_t b = tok / c.T, tt = tok % c.T;
    for (int64_t i = 0; i < c.H * c.D; ++i) {
      const size_t at = static_cast<size_t>(tok * c.H * c.D + i);
      if (in_victim(tok)) {
        changed += out0[at] != out1[at];
        continue;
      }
      ASSERT_EQ(out0[at], out1[at]) << "out of token " << tok << " changed";
      // dq is summed in f32 by atomics in a run-dependent order, then rounded to bf16: two runs may
      // land on neighbouring bf16 values (one unit in the last place), never further apart.
      const double ulp = dq0[at] == 0.0f ? 1e-30 : std::ldexp(1.0, std::ilogb(dq0[at]) - 7);
      if (dq0[at] != dq1[at]) ++dq_moved;
      ASSERT_LE(std::abs(double(dq0[at]) - double(dq1[at])), std::max(ulp, 1e-5 * (std::abs(dq0[at]) + 1e-3)))
          << "dq of token " << tok << " changed";
    }
    for (int64_t i = 0; i < c.KVH * c.D; ++i) {
      const size_t at = static_cast<size_t>(tok * c.KVH * c.D + i);
      if (in_victim(tok)) continue;
      ASSERT_EQ(dk0[at], dk1[at]) << "dk of token " << tok << " changed";
      ASSERT_EQ(dv0[at], dv1[at]) << "dv of token " << tok << " changed";
    }
    for (int64_t h = 0; h < c.H; ++h) {
      const size_t at = static_cast<size_t>((b * c.H + h) * c.T + tt);
      if (!in_victim(tok)) {
        ASSERT_EQ(lse0[at], lse1[at]) << "lse of token " << tok << " changed";
      }
    }
  }
  EXPECT_GT(changed, 0) << "the changed document's output did not change";
  std::printf("[ varlen ] dq elements of the other documents that moved by one bf16 ulp: %ld\n",
              static_cast<long>(dq_moved));
}

// A batch row never reads its neighbour's tokens: with every q, k, v, dout value of batch row 1
// set to NaN, batch row 0's out, lse, dq, dk, dv are still those of row 0 alone (the fp64 reference
// with B = 1), for every backend and TURBO kernel. T = 200 and 77 are no multiple of any tile, so
// row 0's last query and key tiles reach past T, where a flattened [B*T] tensor would give them row
// 1's first tokens (masked, but 0 * NaN = NaN in dV, dK and dQ).
TEST_F(AttnGpu, BatchRowsIgnoreNonFiniteNeighbours) {
  struct Be {
    BackendType type;
    const char* kernel;
  };
  const Be backends[] = {{BackendType::CUDNN, ""}, {BackendType::TURBO, ""},        {BackendType::TURBO, "sm90pipe"},
                         {BackendType::TURBO, "sm90"}, {BackendType::TURBO, "bwdsm90"}, {BackendType::TURBO, "sm80"}};
  for (const Be& be : backends)
    for (auto [D, T] : {std::pair<int64_t, int64_t>{64, 77}, {128, 200}})
      for (bool causal : {true, false}) {
        SCOPED_TRACE(fmt::format("{} {} D={} T={} causal={}", backend_name(be.type), be.kernel, D, T, causal));
        AttnCase c;
        c.B = 2, c.T = T, c.H = 4, c.KVH = 2, c.D = D, c.causal = causal;
        AttnTensors t = random_inputs(c, DType::BF16);
        // Row 0 alone, for the reference.
        AttnCase c0 = c;
        c0.B = 1;
        AttnTensors t0;
        auto first_row = [](const std::vector<double>& v) { return std::vector<double>(v.begin(), v.begin() + v.size() / 2); };
        t0.q = first_row(t.q), t0.k = first_row(t.k), t0.v = first_row(t.v), t0.dout = first_row(t.dout);
        run_reference(c0, t0);
        for (std::vector<double>* v : {&t.q, &t.k, &t.v, &t.dout})
          std::fill(v->begin() + static_cast<std::ptrdiff_t>(v->size() / 2), v->end(), std::nan(""));
        Dev d = upload(c, DType::BF16, t);
        GlobalBackendManager::instance().set_backend("attention", be.type);
        set_kernel(be.kernel);
        run(c, d);
        auto row0 = [&](const TensorView& tv) {
          std::vector<float> all = get(tv);
          all.resize(all.size() / 2);
          return all;
        };
        expect_close("out", row0(d.out), t0.out);
        expect_close("lse", row0(d.lse), t0.lse);
        expect_close("dq", row0(d.dq), t0.dq);
        expect_close("dk", row0(d.dk), t0.dk);
        expect_close("dv", row0(d.dv), t0.dv);
      }
}

// Without a forced backend, dense calls go to cuDNN (the default) and every output is right.
TEST_F(AttnGpu, DefaultDispatchIsCudnnForDense) {
  AttnCase c;
  c.T = 128, c.D = 128, c.KVH = 1;
  AttnTensors t = random_inputs(c, DType::BF16);
  run_reference(c, t);
  Dev d = upload(c, DType::BF16, t);
  const auto [fb, bb] = run(c, d);
  EXPECT_EQ(fb, BackendType::CUDNN);
  EXPECT_EQ(bb, BackendType::CUDNN);
  check_all(t, d);
}

// The Hopper forward reads V through an MN-major wgmma descriptor. This reports the error of the
// default descriptor and of the swapped one (PRIMUS_TURBO_ATTN_SM90_VDESC=swap), so one device run
// says which convention holds; the test requires the default to be right.
TEST_F(AttnGpu, Sm90ForwardDescriptorDiagnostic) {
  AttnCase c;
  c.T = 256, c.D = 128, c.KVH = 4, c.causal = false;
  AttnTensors t = random_inputs(c, DType::BF16);
  run_reference(c, t);
  Dev d = upload(c, DType::BF16, t);
  GlobalBackendManager::instance().set_backend("attention", BackendType::TURBO);
  ErrorStats e[2];
  for (int swap = 0; swap < 2; ++swap) {
    if (swap) setenv("PRIMUS_TURBO_ATTN_SM90_VDESC", "swap", 1);
    run(c, d);
    e[swap] = compare(get(d.out), t.out);
    std::printf("sm90 forward, V descriptor %s: out rel_l2 %.3g max_rel %.3g\n", swap ? "swapped" : "default",
                e[swap].rel_l2, e[swap].max_rel);
  }
  EXPECT_LE(e[0].rel_l2, kGateRelL2);
}

// q, k, v as column slices of one packed [B,T,(H+2*KVH)*D] projection (what the CUDA model's fused
// QKV GEMM writes) and dq, dk, dv into one packed gradient buffer: each backend reads and writes
// the strided views (CUDNN natively, TURBO through dense copies) and matches the reference; the
// packed inputs are left as they were and every packed gradient column is written.
TEST_F(AttnGpu, PackedQkvViewsMatchReference) {
  struct Be {
    BackendType type;
    const char* kernel;
  };
  // TURBO's default (warp-specialised) kernels read q/k/v and write dq/dk/dv in place through their
  // row strides; the others get dense copies.
  const Be backends[] = {{BackendType::CUDNN, ""}, {BackendType::TURBO, ""}, {BackendType::TURBO, "bwdsm90"},
                         {BackendType::TURBO, "sm80"}};
  for (int64_t D : {int64_t{64}, int64_t{128}}) {
    AttnCase c;
    c.T = 192, c.D = D, c.KVH = 2;  // H = 4: grouped-query, so q and k/v slices differ in width
    const DType dt = DType::BF16;
    AttnTensors t = random_inputs(c, dt);
    run_reference(c, t);
    const Dev dense = upload(c, dt, t);
    const int64_t W = (c.H + 2 * c.KVH) * c.D, es = 2;
    auto slice = [&](const TensorView& packed, int64_t col, int64_t heads) {
      TensorView v(static_cast<char*>(packed.data) + col * es, dt, Device::CUDA, {c.B, c.T, heads, c.D});
      v.strides = {c.T * W, W, c.D, 1};
      return v;
    };
    auto copy_rows = [&](const TensorView& dst, const TensorView& src) {  // between dense / strided views
      CUDA_CHECK(cudaMemcpy2D(dst.data, size_t(dst.strides[1] * es), src.data, size_t(src.strides[1] * es),
                              size_t(src.shape[2] * c.D * es), size_t(c.B * c.T), cudaMemcpyDeviceToDevice));
    };
    for (const Be& be : backends) {
      SCOPED_TRACE(fmt::format("{} '{}' D={}", backend_name(be.type), be.kernel, D));
      GlobalBackendManager::instance().set_backend("attention", be.type);
      set_kernel(be.kernel);
      TensorView qkv = make(dt, {c.B, c.T, W}), dqkv = make(dt, {c.B, c.T, W});
      Dev d = dense;
      d.q = slice(qkv, 0, c.H), d.k = slice(qkv, c.H * c.D, c.KVH), d.v = slice(qkv, (c.H + c.KVH) * c.D, c.KVH);
      copy_rows(d.q, dense.q), copy_rows(d.k, dense.k), copy_rows(d.v, dense.v);
      const std::vector<float> packed_in = get(qkv);
      poison(dqkv);
      d.dq = slice(dqkv, 0, c.H), d.dk = slice(dqkv, c.H * c.D, c.KVH), d.dv = slice(dqkv, (c.H + c.KVH) * c.D, c.KVH);
      // A fresh scratch arena, to see what the call put there.
      std::unique_ptr<Arena> scratch = make_device_arena(size_t{64} << 20);
      ExecContext saved = ctx_;
      ctx_.scratch = scratch.get();
      const auto [fb, bb] = run(c, d);  // poisons out, lse (dense) and writes the packed gradients
      ctx_ = saved;
      EXPECT_EQ(fb, be.type);
      EXPECT_EQ(bb, be.type);
      if (be.type == BackendType::TURBO && !*be.kernel && cuda::flash_attention_takes_row_strides(false) && cuda::flash_attention_takes_row_strides(true)) {
        // In place: only the backward's f32 dQ accumulator and its (lse, delta) rows, no copies
        // of q/k/v (3 x 2 bytes an element of q's size at least) or of the gradients.
        const size_t acc = static_cast<size_t>(c.B * c.T * c.H * c.D) * 4, rows = static_cast<size_t>(c.B * c.H * 2 * (c.T + 4)) * 4;
        EXPECT_LE(scratch->high_water(), acc + rows + 1024) << "dense copies of the packed views were made";
      }
      expect_close("out", get(d.out), t.out);
      expect_close("lse", get(d.lse), t.lse);
      Dev back = dense;  // the packed gradients, copied out to dense tensors
      copy_rows(back.dq, d.dq), copy_rows(back.dk, d.dk), copy_rows(back.dv, d.dv);
      expect_close("dq", get(back.dq), t.dq);
      expect_close("dk", get(back.dk), t.dk);
      expect_close("dv", get(back.dv), t.dv);
      EXPECT_TRUE(get(qkv) == packed_in) << "the packed q|k|v input changed";
      int64_t non_finite = 0;
      for (float x : get(dqkv)) non_finite += !std::isfinite(x);
      EXPECT_EQ(non_finite, 0) << "packed gradient elements left unwritten (still poisoned)";
    }
    set_kernel("");
  }
}

// AttentionOptions::deterministic: cuDNN's backward without the f32 dQ accumulator matches the
// fp64 reference at the bf16 gate and gives the same bits on every run (GPT-2's head shape and a
// GQA one, at lengths where the default engine's thread blocks add partial dQ tiles into a shared
// f32 buffer); the TURBO kernels decline it, by name when forced.
TEST_F(AttnGpu, DeterministicCudnnBackwardIsBitIdenticalAndAccurate) {
  deterministic_ = true;
  for (const auto& [kvh, T, D] : {std::tuple<int64_t, int64_t, int64_t>{12, 1024, 64}, {4, 512, 128}}) {
    SCOPED_TRACE(fmt::format("KVH {} T {} D {}", kvh, T, D));
    AttnCase c;
    c.B = 2, c.T = T, c.H = 12, c.KVH = kvh, c.D = D;
    AttnTensors t = random_inputs(c, DType::BF16);
    run_reference(c, t);
    Dev d = upload(c, DType::BF16, t);
    const auto [fb, bb] = run(c, d);
    EXPECT_EQ(bb, BackendType::CUDNN);
    check_all(t, d);
    const auto dq = get(d.dq), dk = get(d.dk), dv = get(d.dv);
    for (int rep = 0; rep < 3; ++rep) {
      run(c, d);
      EXPECT_TRUE(get(d.dq) == dq) << "dq differs on run " << rep + 2;
      EXPECT_TRUE(get(d.dk) == dk) << "dk differs on run " << rep + 2;
      EXPECT_TRUE(get(d.dv) == dv) << "dv differs on run " << rep + 2;
    }
  }
  AttnCase c;
  AttnTensors t = random_inputs(c, DType::BF16);
  Dev d = upload(c, DType::BF16, t);
  GlobalBackendManager::instance().set_backend("attention", BackendType::TURBO);
  try {
    run(c, d);
    ADD_FAILURE() << "forced TURBO accepted a deterministic backward";
  } catch (const RuntimeError& e) {
    EXPECT_NE(std::string(e.what()).find("deterministic"), std::string::npos) << e.what();
  }
}

#if defined(PRIMUS_TURBO_WITH_CUDNN)
// The cuDNN engine search (set_sdpa_search, knob variants included): a shape's first call times
// several engine configurations and keeps one; what it then runs matches the fp64 reference at
// the bf16 gate, in the searched call and after it. Deterministic shapes are never searched.
TEST_F(AttnGpu, CudnnEngineSearchKeepsResultsAtTheGate) {
  auto shape_of = [this](const AttnCase& c) {  // the key the op's cuDNN backend builds its plans under
    cudnn::SdpaShape s;
    s.B = c.B, s.T = c.T, s.H = c.H, s.KVH = c.KVH, s.D = c.D, s.causal = c.causal, s.dtype = DType::BF16;
    s.deterministic = deterministic_;
    return s;
  };
  // Random inputs, the fp64 reference, one forward + backward checked against it.
  auto run_checked = [this](const AttnCase& c, AttnTensors& t) {
    t = random_inputs(c, DType::BF16);
    run_reference(c, t);
    Dev d = upload(c, DType::BF16, t);
    run(c, d);
    check_all(t, d);
    return d;
  };
  cudnn::set_sdpa_search(16);
  setenv("PRIMUS_TURBO_CUDNN_SDPA_KNOBS", "1", 1);
  GlobalBackendManager::instance().set_backend("attention", BackendType::CUDNN);
  for (const auto& [kvh, T, D, causal] : {std::tuple<int64_t, int64_t, int64_t, bool>{2, 320, 64, true}, {6, 192, 128, false}}) {
    SCOPED_TRACE(fmt::format("KVH {} T {} D {} causal {}", kvh, T, D, causal));
    AttnCase c;  // shapes no other test uses, so their plans are built (and searched) here
    c.B = 3, c.T = T, c.H = 6, c.KVH = kvh, c.D = D, c.causal = causal;
    AttnTensors t;
    Dev d = run_checked(c, t);
    const cudnn::SdpaShape s = shape_of(c);
    for (bool bwd : {false, true}) {
      const cudnn::SdpaPlanInfo info = cudnn::sdpa_plan_info(s, bwd);
      EXPECT_GE(info.candidates, 2) << (bwd ? "backward" : "forward") << ": nothing to search among";
      EXPECT_TRUE(info.searched);
      EXPECT_LT(info.chosen, info.candidates);
    }
    run(c, d);  // the chosen plans, without a search
    check_all(t, d);
  }
  // A deterministic backward has one candidate only: every process runs the same engine.
  deterministic_ = true;
  AttnCase c;
  c.B = 3, c.T = 256, c.H = 6, c.KVH = 6, c.D = 64;
  AttnTensors t;
  run_checked(c, t);
  const cudnn::SdpaShape s = shape_of(c);
  EXPECT_EQ(cudnn::sdpa_plan_info(s, true).candidates, 1);
  EXPECT_EQ(cudnn::sdpa_plan_info(s, false).candidates, 1);
  cudnn::set_sdpa_search(0);
  unsetenv("PRIMUS_TURBO_CUDNN_SDPA_KNOBS");
}
#endif

// A backend forced by the user that cannot serve the call is an error, not a silent fallback.
// The TURBO backward's first pass zeroes its own f32 dQ accumulator (the scratch holds NaN bytes
// before each call; without the zeroing dq is NaN) beside computing delta, for every backward kernel
// (the warp-specialised one reads the (lse, delta) rows, the others delta), D 64 / 128; and a tensor
// that does not start 16-byte aligned is refused by name, not run.
TEST_F(AttnGpu, TurboBackwardZeroesItsAccumulatorAndRefusesMisalignedTensors) {
  for (const char* kernel : {"", "bwdsm90", "sm80"})
    for (int64_t D : {int64_t{64}, int64_t{128}}) {
      SCOPED_TRACE(fmt::format("kernel '{}' D={}", kernel, D));
      AttnCase c;
      c.B = 2, c.T = 333, c.H = 4, c.KVH = 2, c.D = D, c.causal = true;
      AttnTensors t = random_inputs(c, DType::BF16);
      run_reference(c, t);
      Dev d = upload(c, DType::BF16, t);
      GlobalBackendManager::instance().set_backend("attention", BackendType::TURBO);
      set_kernel(kernel);
      for (int rep = 0; rep < 2; ++rep) {  // the second call over the first's accumulator, poisoned again
        poison_scratch();
        run(c, d);
        check_all(t, d);
      }
    }
  set_kernel("");
  AttnCase c;
  c.B = 1, c.T = 128, c.H = 4, c.KVH = 4, c.D = 64;
  AttnTensors t = random_inputs(c, DType::BF16);
  Dev d = upload(c, DType::BF16, t);
  run(c, d);  // out and lse for the backward below
  TensorView wide = make(DType::BF16, {c.B * c.T * c.H * c.D + 8});
  TensorView dout = d.dout;
  dout.data = static_cast<char*>(wide.data) + 8;  // 8 bytes in: 4-byte aligned, not 16
  CUDA_CHECK(cudaMemcpy(dout.data, d.dout.data, d.dout.nbytes(), cudaMemcpyDeviceToDevice));
  AttentionBackwardArgs b;
  b.dq = d.dq, b.dk = d.dk, b.dv = d.dv, b.dout = dout, b.q = d.q, b.k = d.k, b.v = d.v, b.out = d.out, b.lse = d.lse;
  b.opt = options(c, d);
  b.ctx = ctx_;
  GlobalBackendManager::instance().set_backend("attention", BackendType::TURBO);
  try {
    attention_backward(b);
    ADD_FAILURE() << "a misaligned dout ran on the TURBO backward";
  } catch (const RuntimeError& e) {
    EXPECT_NE(std::string(e.what()).find("dout does not start 16-byte aligned"), std::string::npos) << e.what();
  }
}

// Sliding window (TURBO serves it; cuDNN declines): windows of one key, shorter than a tile,
// crossing tile edges, equal to T and larger than T; MHA and GQA; head_dim 64 and 128; dense at
// T = 320 (a partial tile on both axes) and packed documents. One test per TURBO kernel choice.
class AttnGpuWindow : public AttnGpu, public ::testing::WithParamInterface<const char*> {
 protected:
  void check() {
    set_kernel(GetParam());
    for (int64_t D : {int64_t{64}, int64_t{128}})
      for (int64_t KVH : {int64_t{4}, int64_t{2}})
        for (int64_t window : {1, 37, 64, 128, 129, 320, 1000}) {
          SCOPED_TRACE(fmt::format("D={} KVH={} window={} (T=320)", D, KVH, window));
          AttnCase c;
          c.B = 2, c.T = 320, c.H = 4, c.KVH = KVH, c.D = D, c.causal = true, c.window = window;
          check_case(c);
        }
    for (int64_t D : {int64_t{64}, int64_t{128}})
      for (int64_t window : {9, 100}) {
        SCOPED_TRACE(fmt::format("packed D={} window={}", D, window));
        AttnCase c;
        c.B = 2, c.T = 384, c.H = 4, c.KVH = 2, c.D = D, c.causal = true, c.window = window;
        c.cu_seqlens = random_cu_seqlens(rng_, c.B, c.T, 5);
        check_case(c);
      }
  }
  void check_case(const AttnCase& c) {
    AttnTensors t = random_inputs(c, DType::BF16);
    run_reference(c, t);
    Dev d = upload(c, DType::BF16, t);
    const auto [fb, bb] = run(c, d);  // no backend forced: cuDNN declines a window
    EXPECT_EQ(fb, BackendType::TURBO);
    EXPECT_EQ(bb, BackendType::TURBO);
    if (c.window != 1) {
      check_all(t, d);
      return;
    }
    // A window of one key: each query sees itself only, the softmax is constant, and the exact dq
    // and dk are zero, so a relative error against them is undefined. Theirs must be rounding
    // noise (dP - rowsum(dO * O) of bf16 operands), far below the other gradients.
    expect_close("out", get(d.out), t.out);
    expect_close("lse", get(d.lse), t.lse);
    expect_close("dv", get(d.dv), t.dv);
    for (const auto* name : {"dq", "dk"}) {
      const std::vector<float> g = get(std::string(name) == "dq" ? d.dq : d.dk);
      float worst = 0;
      for (float x : g) worst = std::max(worst, std::isfinite(x) ? std::abs(x) : INFINITY);
      EXPECT_LE(worst, 1e-3f) << name << " should be zero with a one-key window";
    }
  }
};
TEST_P(AttnGpuWindow, MatchesReference) { check(); }
INSTANTIATE_TEST_SUITE_P(Kernels, AttnGpuWindow, ::testing::Values("", "sm90pipe", "sm90", "bwdsm90", "sm80"),
                         [](const ::testing::TestParamInfo<const char*>& i) {
                           return std::string(*i.param ? i.param : "default");
                         });

// A window that reaches past T is no window: the same bits as window 0 (both TURBO).
TEST_F(AttnGpu, WindowAtLeastTEqualsNoWindow) {
  AttnCase c;
  c.B = 2, c.T = 200, c.H = 4, c.KVH = 2, c.D = 64;
  AttnTensors t = random_inputs(c, DType::BF16);
  Dev d = upload(c, DType::BF16, t);
  GlobalBackendManager::instance().set_backend("attention", BackendType::TURBO);
  run(c, d);
  const std::vector<float> out0 = get(d.out), dk0 = get(d.dk), dv0 = get(d.dv);
  c.window = 200;
  run(c, d);
  EXPECT_EQ(get(d.out), out0);
  EXPECT_EQ(get(d.dk), dk0);
  EXPECT_EQ(get(d.dv), dv0);
}

TEST_F(AttnGpu, ForcedCudnnRefusesWindow) {
  AttnCase c;
  c.T = 64, c.window = 16;
  AttnTensors t = random_inputs(c, DType::BF16);
  Dev d = upload(c, DType::BF16, t);
  GlobalBackendManager::instance().set_backend("attention", BackendType::CUDNN);
  EXPECT_THROW(run(c, d), RuntimeError);
}

TEST_F(AttnGpu, ForcedCudnnRefusesVarlen) {
  AttnCase c;
  c.T = 64, c.cu_seqlens = {0, 30, 64, 100, 128};
  AttnTensors t = random_inputs(c, DType::BF16);
  Dev d = upload(c, DType::BF16, t);
  GlobalBackendManager::instance().set_backend("attention", BackendType::CUDNN);
  EXPECT_THROW(run(c, d), RuntimeError);
}

}  // namespace
}  // namespace primus::turbo::testing
