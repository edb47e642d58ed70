// Fused residual + LayerNorm / RMSNorm, GELU and SwiGLU on the device (TURBO) against the CPU
// reference kernels, in f32 and bf16.
#include <gtest/gtest.h>

#include <fmt/format.h>

#include <algorithm>
#include <cmath>
#include <cstdlib>
#include <cstring>
#include <limits>
#include <string>

#include "gpu_fixture.h"
#include "turbo/kernels/cpu/activation.h"
#include "turbo/kernels/cpu/normalization.h"
#include "turbo/kernels/cpu/residual.h"
#include "turbo/ops/activation.h"
#include "turbo/ops/normalization.h"

namespace primus::turbo::testing {
namespace {

struct NormCase {
  NormType type;
  DType dt;
  int64_t C;
};

// The fused residual + norm forward on the device against the CPU reference: random inputs
// (rounded to dt; `offset` added to x), the reference residual sum, output and statistics, and a
// call into freshly poisoned outputs.
class NormForwardFixture : public GpuTest {
 protected:
  struct Case {
    NormType type;
    DType dt;
    int64_t N, C;
    TensorView x, r, w, b;
    std::vector<float> wv, bv, rres, rout, rmean, rrstd;  // rres: the residual sum as stored (rounded to dt)
    bool ln() const { return type == NormType::LayerNorm; }
  };
  struct Outputs {
    TensorView out, res, mean, rstd;
    BackendType used;
  };
  Case make_case(NormType type, DType dt, int64_t N, int64_t C, float offset = 0.0f) {
    Case c{type, dt, N, C, make(dt, {N, C}), make(dt, {N, C}), make(dt, {C}), make(dt, {C}), {}, {}, {}, {}, {}, {}};
    auto xv = random_tensor(c.x), rv = random_tensor(c.r);
    c.wv = random_tensor(c.w, 0.5f);
    c.bv = random_tensor(c.b, 0.5f);
    if (offset != 0.0f) {
      for (auto& v : xv) v += offset;
      put(c.x, xv);
      xv = get(c.x);  // as rounded to dt
    }
    c.rres.resize(xv.size());
    cpu::residual_forward(c.rres.data(), xv.data(), rv.data(), static_cast<int64_t>(xv.size()));
    c.rres = round_all(dt, c.rres);
    c.rout.resize(xv.size());
    c.rmean.resize(N);
    c.rrstd.resize(N);
    if (c.ln())
      cpu::layernorm_forward(c.rout.data(), c.rmean.data(), c.rrstd.data(), c.rres.data(), c.wv.data(), c.bv.data(), N,
                             C, 1e-5);
    else
      cpu::rmsnorm_forward(c.rout.data(), c.rrstd.data(), c.rres.data(), c.wv.data(), N, C, 1e-5);
    return c;
  }
  Outputs forward(const Case& c) {
    Outputs o{make(c.dt, {c.N, c.C}), make(c.dt, {c.N, c.C}), make(DType::F32, {c.N}), make(DType::F32, {c.N}),
              BackendType::CPU};
    for (auto t : {o.out, o.res, o.mean, o.rstd}) poison(t);
    NormForwardArgs f;
    f.type = c.type;
    f.out = o.out; f.mean = o.mean; f.rstd = o.rstd; f.residual_out = o.res;
    f.inp = c.x; f.residual = c.r; f.weight = c.w;
    if (c.ln()) f.bias = c.b;
    f.ctx = ctx;
    o.used = norm_forward(f);
    return o;
  }
  void check(const Case& c, const Outputs& o, const std::string& what) {
    SCOPED_TRACE(what);
    EXPECT_EQ(o.used, BackendType::TURBO);
    EXPECT_EQ(rel_err(get(o.res), c.rres), 0.0) << "residual_out is the rounded sum";
    EXPECT_LT(rel_err(get(o.out), c.rout), gate(c.dt));
    EXPECT_LT(rel_err(get(o.rstd), c.rrstd), 1e-5);
    if (c.ln()) {
      EXPECT_LT(rel_err(get(o.mean), c.rmean), 1e-5);
    }
  }
};

class NormTest : public NormForwardFixture, public ::testing::WithParamInterface<NormCase> {};

TEST_P(NormTest, FusedResidualForwardAndBackwardMatchReference) {
  const auto [type, dt, C] = GetParam();
  const bool ln = type == NormType::LayerNorm;
  const int64_t N = 257;  // odd, so the last block is partial
  const Case c = make_case(type, dt, N, C);
  const Outputs o = forward(c);
  check(c, o, "forward");
  const TensorView &w = c.w, &res = o.res, &mean = o.mean, &rstd = o.rstd;
  const std::vector<float> &rres = c.rres, &wv = c.wv, &rmean = c.rmean, &rrstd = c.rrstd;

  // Backward: accumulates into dinp (the residual stream's gradient) and the f32 param grads.
  TensorView dout = make(dt, {N, C}), dinp = make(dt, {N, C});
  TensorView dw = make(DType::F32, {C}), db = make(DType::F32, {C});
  auto doutv = random_tensor(dout), dinp0 = random_tensor(dinp), dw0 = random_tensor(dw), db0 = random_tensor(db);
  NormBackwardArgs bw;
  bw.type = type;
  bw.dinp = dinp; bw.dweight = dw;
  if (ln) bw.dbias = db;
  bw.dout = dout; bw.inp = res; bw.weight = w; bw.mean = mean; bw.rstd = rstd;
  bw.ctx = ctx;
  EXPECT_EQ(norm_backward(bw), BackendType::TURBO);
  // The reference uses its own statistics (rmean/rrstd), so stat errors show up here too.
  std::vector<float> rdinp = dinp0, rdw = dw0, rdb = db0;
  if (ln)
    cpu::layernorm_backward(rdinp.data(), rdw.data(), rdb.data(), doutv.data(), rres.data(), wv.data(),
                            rmean.data(), rrstd.data(), N, C);
  else
    cpu::rmsnorm_backward(rdinp.data(), rdw.data(), doutv.data(), rres.data(), wv.data(), rrstd.data(), N, C);
  EXPECT_LT(rel_err(get(dinp), rdinp), gate(dt));
  EXPECT_LT(rel_err(get(dw), rdw), gate(dt));
  if (ln) {
    EXPECT_LT(rel_err(get(db), rdb), gate(dt));
  }

  // Determinism: the same backward from the same state gives the same bits.
  auto dinp1 = bytes(dinp), dw1 = bytes(dw);
  put(dinp, dinp0);
  put(dw, dw0);
  put(db, db0);
  norm_backward(bw);
  EXPECT_EQ(bytes(dinp), dinp1);
  EXPECT_EQ(bytes(dw), dw1);
}

INSTANTIATE_TEST_SUITE_P(
    Turbo, NormTest,
    ::testing::Values(NormCase{NormType::LayerNorm, DType::BF16, 768}, NormCase{NormType::LayerNorm, DType::F32, 768},
                      NormCase{NormType::RMSNorm, DType::BF16, 2048}, NormCase{NormType::RMSNorm, DType::F32, 2048},
                      NormCase{NormType::LayerNorm, DType::BF16, 8192}, NormCase{NormType::RMSNorm, DType::F32, 72}),
    [](const auto& info) {
      return fmt::format("{}_{}_C{}", info.param.type == NormType::LayerNorm ? "ln" : "rms",
                         dtype_name(info.param.dt), info.param.C);
    });

// The forward's other block sizes (PRIMUS_TURBO_NORM_FWD_THREADS: one row per block up to rows of
// several warps), each against the CPU reference, with a residual, on row counts that leave the
// last block partial (257) and many blocks per SM (9001); the statistics within 1e-5 as for the
// default.
struct NormFwdSwitchCase {
  NormType type;
  DType dt;
  int64_t C, N;
};
class NormForwardSwitchTest : public NormForwardFixture, public ::testing::WithParamInterface<NormFwdSwitchCase> {};

TEST_P(NormForwardSwitchTest, SwitchesMatchReference) {
  const auto [type, dt, C, N] = GetParam();
  // A row offset well away from zero (|mean| >> std would expose a naive one-pass variance).
  const Case c = make_case(type, dt, N, C, 3.0f);
  for (const char* threads : {"32", "128", "256", "1024"}) {
    ::setenv("PRIMUS_TURBO_NORM_FWD_THREADS", threads, 1);
    const Outputs o = forward(c);
    ::unsetenv("PRIMUS_TURBO_NORM_FWD_THREADS");
    check(c, o, fmt::format("threads {}", threads));
  }
}

INSTANTIATE_TEST_SUITE_P(
    Turbo, NormForwardSwitchTest,
    ::testing::Values(NormFwdSwitchCase{NormType::LayerNorm, DType::BF16, 768, 257},
                      NormFwdSwitchCase{NormType::LayerNorm, DType::BF16, 768, 9001},
                      NormFwdSwitchCase{NormType::LayerNorm, DType::BF16, 256, 9001},
                      NormFwdSwitchCase{NormType::LayerNorm, DType::F32, 768, 257},
                      NormFwdSwitchCase{NormType::RMSNorm, DType::BF16, 2048, 9001}),
    [](const auto& info) {
      return fmt::format("{}_{}_C{}_N{}", info.param.type == NormType::LayerNorm ? "ln" : "rms",
                         dtype_name(info.param.dt), info.param.C, info.param.N);
    });

// ---- the backward on its own: every kernel shape of the staged and row-group kernels ----------
// Statistics from the CPU forward, uploaded, so the device and the reference see identical
// inputs. Shapes: C = 64 (one vector per lane, most lanes idle), 768 (GPT-2: one warp per row,
// 3 vectors per lane), 1000 (an odd multiple of 8: ragged last vector column), 2048 (Llama),
// 4096 and 8192 (bf16: 8 warps per row); N odd (never a multiple of the rows per block), and
// 9001 for several rows per row group (the grid-stride loop and its prefetch).
struct NormBwdCase {
  NormType type;
  DType dt;
  int64_t C, N;
  bool accumulate;
  bool bias = true;  // LayerNorm only
};

std::string norm_bwd_name(const ::testing::TestParamInfo<NormBwdCase>& info) {
  const auto& p = info.param;
  return fmt::format("{}{}_{}_C{}_N{}_{}", p.type == NormType::LayerNorm ? "ln" : "rms",
                     p.type == NormType::LayerNorm && !p.bias ? "nobias" : "", dtype_name(p.dt), p.C, p.N,
                     p.accumulate ? "acc" : "set");
}

class NormBackwardTest : public GpuTest, public ::testing::WithParamInterface<NormBwdCase> {
 protected:
  struct Run {
    NormBackwardArgs args;
    std::vector<float> dinp0, dw0, db0, cs0;
    std::vector<float> rdinp, rdw, rdb;  // reference
  };
  Run setup(const NormBwdCase& p) {
    const bool ln = p.type == NormType::LayerNorm;
    const int64_t N = p.N, C = p.C;
    Run r;
    TensorView x = make(p.dt, {N, C}), w = make(p.dt, {C}), b = make(p.dt, {C});
    auto xv = random_tensor(x), wv = random_tensor(w, 0.5f), bv = random_tensor(b, 0.5f);
    std::vector<float> out(xv.size()), mean(N), rstd(N);
    if (ln)
      cpu::layernorm_forward(out.data(), mean.data(), rstd.data(), xv.data(), wv.data(), bv.data(), N, C, 1e-5);
    else
      cpu::rmsnorm_forward(out.data(), rstd.data(), xv.data(), wv.data(), N, C, 1e-5);
    TensorView tmean = make(DType::F32, {N}), trstd = make(DType::F32, {N});
    put(tmean, mean);
    put(trstd, rstd);
    TensorView dout = make(p.dt, {N, C}), dinp = make(p.dt, {N, C});
    TensorView dw = make(DType::F32, {C}), db = make(DType::F32, {C}), cs = make(DType::F32, {C});
    auto doutv = random_tensor(dout);
    r.dinp0 = random_tensor(dinp);  // nonzero: the overwrite (accumulate = false) must drop it
    r.dw0 = random_tensor(dw);
    r.db0 = random_tensor(db);
    r.cs0 = random_tensor(cs, 4.0f);  // nonzero: the column sums must be added to it
    NormBackwardArgs& a = r.args;
    a.type = p.type;
    a.dinp = dinp;
    a.dweight = dw;
    if (ln && p.bias) a.dbias = db;
    a.dinp_colsum = cs;
    a.dout = dout;
    a.inp = x;
    a.weight = w;
    if (ln) a.mean = tmean;
    a.rstd = trstd;
    a.accumulate_dinp = p.accumulate;
    a.ctx = ctx;
    r.rdinp = p.accumulate ? r.dinp0 : std::vector<float>(r.dinp0.size(), 0.0f);
    r.rdw = r.dw0;
    r.rdb = r.db0;
    if (ln)
      cpu::layernorm_backward(r.rdinp.data(), r.rdw.data(), r.rdb.data(), doutv.data(), xv.data(), wv.data(),
                              mean.data(), rstd.data(), N, C);
    else
      cpu::rmsnorm_backward(r.rdinp.data(), r.rdw.data(), doutv.data(), xv.data(), wv.data(), rstd.data(), N, C);
    return r;
  }
  void reset(const Run& r) {
    put(r.args.dinp, r.dinp0);
    put(r.args.dweight, r.dw0);
    if (r.args.dbias.defined()) put(r.args.dbias, r.db0);
    put(r.args.dinp_colsum, r.cs0);
  }
  // Checks dinp, the parameter gradients and the column sums of one run against the reference.
  void check(const Run& r, DType dt, const char* what) {
    SCOPED_TRACE(what);
    const int64_t N = r.args.inp.rows(), C = r.args.inp.cols();
    const auto dinp = get(r.args.dinp);
    EXPECT_LT(rel_err(dinp, r.rdinp), gate(dt)) << "dinp";
    EXPECT_LT(rel_err(get(r.args.dweight), r.rdw), gate(dt)) << "dweight";
    if (r.args.dbias.defined()) {
      EXPECT_LT(rel_err(get(r.args.dbias), r.rdb), gate(dt)) << "dbias";
    }
    // The column sums are of the values stored in dinp (as read back), added to the initial ones:
    // f32 summation order is the only difference.
    if (r.args.dinp_colsum.defined()) {
      std::vector<double> ref(r.cs0.begin(), r.cs0.end()), sum(static_cast<size_t>(C), 0.0);
      double mag = 0.0;
      for (int64_t n = 0; n < N; ++n)
        for (int64_t c = 0; c < C; ++c) {
          sum[c] += dinp[n * C + c];
          mag += std::abs(dinp[n * C + c]);
        }
      for (int64_t c = 0; c < C; ++c) ref[c] += sum[c];
      const auto got = get(r.args.dinp_colsum);
      EXPECT_LT(rel_err(got, ref), 1e-5) << "dinp_colsum";
      // Elementwise: within f32 rounding of the sum of magnitudes of its column.
      int bad = 0;
      for (int64_t c = 0; c < C && bad < 5; ++c)
        if (!(std::abs(got[c] - ref[c]) <= 1e-5 * (std::abs(ref[c]) + mag / C) + 1e-6)) {
          ADD_FAILURE() << "dinp_colsum[" << c << "] = " << got[c] << ", want " << ref[c];
          ++bad;
        }
    }
  }
};

TEST_P(NormBackwardTest, MatchesReferenceWithColumnSums) {
  const NormBwdCase p = GetParam();
  Run r = setup(p);
  EXPECT_EQ(norm_backward(r.args), BackendType::TURBO);
  check(r, p.dt, "with dinp_colsum");
  // Without the column sums (the kernel variant without the third partial): same results.
  reset(r);
  NormBackwardArgs plain = r.args;
  plain.dinp_colsum = {};
  norm_backward(plain);
  Run rp = r;
  rp.args = plain;
  check(rp, p.dt, "without dinp_colsum");
  EXPECT_EQ(get(r.args.dinp_colsum), r.cs0) << "an undefined dinp_colsum leaves the tensor alone";
}

TEST_P(NormBackwardTest, BitwiseDeterministic) {
  const NormBwdCase p = GetParam();
  Run r = setup(p);
  norm_backward(r.args);
  const auto dinp1 = bytes(r.args.dinp), dw1 = bytes(r.args.dweight), cs1 = bytes(r.args.dinp_colsum);
  const auto db1 = r.args.dbias.defined() ? bytes(r.args.dbias) : std::vector<uint8_t>{};
  reset(r);
  norm_backward(r.args);
  EXPECT_EQ(bytes(r.args.dinp), dinp1);
  EXPECT_EQ(bytes(r.args.dweight), dw1);
  EXPECT_EQ(bytes(r.args.dinp_colsum), cs1);
  if (r.args.dbias.defined()) {
    EXPECT_EQ(bytes(r.args.dbias), db1);
  }
}

// The legacy kernel stays reachable for A/B timing: same results through the environment switch.
TEST_P(NormBackwardTest, LegacyKernelMatchesReference) {
  const NormBwdCase p = GetParam();
  Run r = setup(p);
  r.args.dinp_colsum = {};  // the legacy kernel has none (such calls take the new kernel)
  ::setenv("PRIMUS_TURBO_NORM_BWD_KERNEL", "legacy", 1);
  norm_backward(r.args);
  ::unsetenv("PRIMUS_TURBO_NORM_BWD_KERNEL");
  check(r, p.dt, "legacy");
}

// The row-group kernel (the default where the staged one does not apply) through its switch, on
// every shape, with the column sums.
TEST_P(NormBackwardTest, RowGroupKernelMatchesReference) {
  const NormBwdCase p = GetParam();
  Run r = setup(p);
  ::setenv("PRIMUS_TURBO_NORM_BWD_KERNEL", "rowgroup", 1);
  norm_backward(r.args);
  ::unsetenv("PRIMUS_TURBO_NORM_BWD_KERNEL");
  check(r, p.dt, "rowgroup");
}

// The staged kernel's other stage counts (2: one row in flight per warp; 4: fewer warps per block
// where 16 do not fit), each deterministic. Shapes the staged kernel does not take run the
// row-group kernel twice more.
TEST_P(NormBackwardTest, StagedKernelStageCounts) {
  const NormBwdCase p = GetParam();
  for (const char* stages : {"2", "4"}) {
    Run r = setup(p);
    ::setenv("PRIMUS_TURBO_NORM_BWD_STAGES", stages, 1);
    norm_backward(r.args);
    const auto dinp1 = bytes(r.args.dinp), dw1 = bytes(r.args.dweight), cs1 = bytes(r.args.dinp_colsum);
    check(r, p.dt, stages);
    reset(r);
    norm_backward(r.args);
    ::unsetenv("PRIMUS_TURBO_NORM_BWD_STAGES");
    EXPECT_EQ(bytes(r.args.dinp), dinp1) << stages;
    EXPECT_EQ(bytes(r.args.dweight), dw1) << stages;
    EXPECT_EQ(bytes(r.args.dinp_colsum), cs1) << stages;
  }
}

std::vector<NormBwdCase> norm_bwd_cases() {
  std::vector<NormBwdCase> v;
  for (NormType t : {NormType::LayerNorm, NormType::RMSNorm})
    for (DType dt : {DType::BF16, DType::F32})
      for (int64_t C : {64, 768, 1000, 2048, 4096})
        for (bool acc : {true, false}) v.push_back({t, dt, C, 257, acc});
  // Several rows per row group, the partial combination over many blocks.
  for (bool acc : {true, false}) {
    v.push_back({NormType::LayerNorm, DType::BF16, 768, 9001, acc});
    v.push_back({NormType::RMSNorm, DType::BF16, 2048, 9001, acc});
    v.push_back({NormType::LayerNorm, DType::F32, 1000, 9001, acc});
    v.push_back({NormType::RMSNorm, DType::F32, 64, 9001, acc});
  }
  v.push_back({NormType::LayerNorm, DType::BF16, 8192, 67, true});   // 8 warps x 4 vectors per lane
  v.push_back({NormType::LayerNorm, DType::BF16, 1000, 257, true, false});  // no dbias
  v.push_back({NormType::LayerNorm, DType::F32, 768, 3, false});     // fewer rows than one block
  // The staged kernel's other shapes (one warp per row, 1-3 vectors per lane): full lanes (bf16
  // 256, f32 384), a ragged last vector column (bf16 520: 65 vectors; f32 200: 50), several rows
  // per warp and stage (N = 20011 > 16 warps x 132 SMs x 4 stages), fewer rows than warps.
  for (bool acc : {true, false}) {
    v.push_back({NormType::LayerNorm, DType::BF16, 520, 20011, acc});
    v.push_back({NormType::RMSNorm, DType::F32, 384, 2049, acc});
  }
  v.push_back({NormType::LayerNorm, DType::BF16, 256, 257, true});
  v.push_back({NormType::RMSNorm, DType::BF16, 768, 20011, true});
  v.push_back({NormType::LayerNorm, DType::F32, 200, 5, true});
  v.push_back({NormType::LayerNorm, DType::BF16, 768, 1, true, false});  // one row, no dbias
  return v;
}

INSTANTIATE_TEST_SUITE_P(Turbo, NormBackwardTest, ::testing::ValuesIn(norm_bwd_cases()), norm_bwd_name);

class ActivationTest : public GpuDTypeTest {};

TEST_P(ActivationTest, GeluForwardBackward) {
  const DType dt = GetParam();
  const int64_t n = 3 * 1024 * 8 + 64;
  TensorView x = make(dt, {n}), y = make(dt, {n}), dy = make(dt, {n}), dx = make(dt, {n});
  auto xv = random_tensor(x, 2.0f), dyv = random_tensor(dy);
  poison(y);
  poison(dx);
  EXPECT_EQ(activation_forward({Activation::Gelu, y, x, ctx}), BackendType::TURBO);
  std::vector<float> ry(xv.size()), rdx(xv.size(), 0.0f);
  cpu::gelu_forward(ry.data(), xv.data(), n);
  EXPECT_LT(rel_err(get(y), ry), gate(dt));
  ActivationBackwardArgs b{Activation::Gelu, dx, x, dy, false, ctx};
  activation_backward(b);
  cpu::gelu_backward(rdx.data(), xv.data(), dyv.data(), n);
  EXPECT_LT(rel_err(get(dx), rdx), gate(dt));
  // accumulate: dx += again
  b.accumulate = true;
  activation_backward(b);
  cpu::gelu_backward(rdx.data(), xv.data(), dyv.data(), n);
  EXPECT_LT(rel_err(get(dx), rdx), gate(dt));
}

TEST_P(ActivationTest, SwigluForwardBackward) {
  const DType dt = GetParam();
  const int64_t N = 130, F = 1024 + 8;
  TensorView gu = make(dt, {N, 2 * F}), y = make(dt, {N, F}), dy = make(dt, {N, F}), dgu = make(dt, {N, 2 * F});
  auto guv = random_tensor(gu, 2.0f), dyv = random_tensor(dy);
  poison(y);
  poison(dgu);
  EXPECT_EQ(activation_forward({Activation::SwiGLU, y, gu, ctx}), BackendType::TURBO);
  std::vector<float> ry(static_cast<size_t>(N * F)), rdgu(guv.size(), 0.0f);
  cpu::swiglu_forward(ry.data(), guv.data(), N, F);
  EXPECT_LT(rel_err(get(y), ry), gate(dt));
  activation_backward({Activation::SwiGLU, dgu, gu, dy, false, ctx});
  cpu::swiglu_backward(rdgu.data(), guv.data(), dyv.data(), N, F);
  EXPECT_LT(rel_err(get(dgu), rdgu), gate(dt));
}

// max |y| per row, per column, then over all of a host copy of y [R, C] as f32 bits (NaN > inf >
// finite).
std::vector<uint32_t> maxima_of(const std::vector<float>& y, int64_t R, int64_t C) {
  std::vector<uint32_t> m(static_cast<size_t>(R + C + 1), 0);
  for (int64_t r = 0; r < R; ++r)
    for (int64_t c = 0; c < C; ++c) {
      uint32_t b;
      std::memcpy(&b, &y[static_cast<size_t>(r * C + c)], 4);
      b &= 0x7fffffffu;
      m[r] = std::max(m[r], b);
      m[R + c] = std::max(m[R + c], b);
      m[R + C] = std::max(m[R + C], b);
    }
  return m;
}

// SwiGLU with maxima (for the FP8 quantizers): the same output bytes as without, and the maxima of
// that output as stored, per row, per column and over all; shapes with partial tiles (rows not a
// multiple of 128, F not one of 32 vectors), accumulation, and a row and a column holding inf and
// NaN (which must win their row and column). The buffer starts poisoned: the op clears it. Each
// choice of PRIMUS_TURBO_SWIGLU_MAXIMA_KERNEL: the flat kernel takes rows of a multiple of 32 vectors
// (2048, 4096, and 1024 with more rows than one grid stride covers) and leaves the others to
// the strips.
TEST_P(ActivationTest, SwigluMaximaAreThoseOfTheOutputAsStored) {
  const DType dt = GetParam();
  struct Shape { int64_t N, F; };
  struct Restore {  // the variable as it was before the test (or its absence)
    const char* name = "PRIMUS_TURBO_SWIGLU_MAXIMA_KERNEL";
    const char* was = std::getenv(name);
    std::string value = was ? was : "";
    ~Restore() {
      if (was) ::setenv(name, value.c_str(), 1);
      else ::unsetenv(name);
    }
  } restore;
  for (const char* kernel : {"auto", "flat", "strips"})
  for (const Shape sh : {Shape{130, 1032}, Shape{300, 264}, Shape{17, 8}, Shape{256, 2048}, Shape{300, 4096},
                         Shape{2000, 1024}})
    for (const bool special : {false, true})
      for (const bool acc : {false, true}) {
        ::setenv("PRIMUS_TURBO_SWIGLU_MAXIMA_KERNEL", kernel, 1);
        const ArenaScope scope = scoped_tensors();  // each case's tensors go back to the arena
        const int64_t N = sh.N, F = sh.F;
        SCOPED_TRACE(fmt::format("{}: N {} F {}{}{}", kernel, N, F, special ? " with inf and NaN" : "",
                                 acc ? " accumulate" : ""));
        TensorView gu = make(dt, {N, 2 * F}), dy = make(dt, {N, F});
        TensorView y0 = make(dt, {N, F}), y1 = make(dt, {N, F}), d0 = make(dt, {N, 2 * F}), d1 = make(dt, {N, 2 * F});
        TensorView mf = make(DType::F32, {N + F + 1}), mb = make(DType::F32, {N + 2 * F + 1});
        auto guv = randn(N * 2 * F, 2.0f, dt), dyv = randn(N * F, 1.0f, dt);
        if (special) {
          guv[static_cast<size_t>((N / 2) * 2 * F + F / 3)] = std::numeric_limits<float>::infinity();
          dyv[static_cast<size_t>((N - 1) * F + F - 1)] = std::numeric_limits<float>::quiet_NaN();
        }
        put(gu, guv);
        put(dy, dyv);
        const auto start = randn(N * 2 * F, 1.0f, dt);
        for (const TensorView* t : {&y0, &y1, &mf, &mb}) poison(*t);
        put(d0, start);
        put(d1, start);
        ASSERT_EQ(activation_forward({Activation::SwiGLU, y0, gu, ctx}), BackendType::TURBO);
        ASSERT_EQ(activation_forward({Activation::SwiGLU, y1, gu, ctx, mf}), BackendType::TURBO);
        EXPECT_EQ(bytes(y0), bytes(y1)) << "forward output";
        const auto yv = get(y1);
        const auto mfv = bytes(mf);
        std::vector<uint32_t> got(static_cast<size_t>(N + F + 1));
        std::memcpy(got.data(), mfv.data(), mfv.size());
        EXPECT_EQ(got, maxima_of(yv, N, F)) << "forward maxima";
        ASSERT_EQ(activation_backward({Activation::SwiGLU, d0, gu, dy, acc, ctx}), BackendType::TURBO);
        ASSERT_EQ(activation_backward({Activation::SwiGLU, d1, gu, dy, acc, ctx, mb}), BackendType::TURBO);
        EXPECT_EQ(bytes(d0), bytes(d1)) << "backward output";
        const auto dv = get(d1);
        const auto mbv = bytes(mb);
        got.assign(static_cast<size_t>(N + 2 * F + 1), 0);
        std::memcpy(got.data(), mbv.data(), mbv.size());
        const auto want = maxima_of(dv, N, 2 * F);
        EXPECT_EQ(got, want) << "backward maxima";
        if (special) {  // the NaN in dy's last row reaches that row's dgate_up, whose maximum is then NaN
          float last;
          std::memcpy(&last, &got[static_cast<size_t>(N - 1)], 4);
          EXPECT_TRUE(std::isnan(last));
        }
      }
  // What the op refuses: gelu, the wrong size, a host buffer.
  TensorView gu = make(dt, {16, 16}), y = make(dt, {16, 8}), m = make(DType::F32, {25}), bad = make(DType::F32, {24});
  EXPECT_THROW(activation_forward({Activation::SwiGLU, y, gu, ctx, bad}), RuntimeError);
  EXPECT_THROW(activation_forward({Activation::Gelu, gu, gu, ctx, m}), RuntimeError);
  std::vector<float> host(25);
  EXPECT_THROW(activation_forward({Activation::SwiGLU, y, gu, ctx, TensorView(host.data(), DType::F32, Device::CPU, {25})}),
               RuntimeError);
}

INSTANTIATE_TEST_SUITE_P(Turbo, ActivationTest, ::testing::Values(DType::F32, DType::BF16), dtype_param_name);

}  // namespace
}  // namespace primus::turbo::testing
