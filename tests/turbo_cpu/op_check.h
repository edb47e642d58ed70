// The one harness every kernel test of turbo/kernels/cpu goes through.
//
// An op under test is a class template Op<Real> (Real = float or double) built from a config:
//   explicit Op(const Cfg&);
//   std::vector<InputSpec> inputs() const;   // the differentiable inputs, in order
//   size_t out_size() const;
//   void forward(const Inputs<Real>& x, std::vector<Real>& out);   // may save state in *this
//   void backward(const Inputs<Real>& x, const std::vector<Real>& dout, Inputs<Real>& dx);
// backward is called right after forward on the same x. Non-differentiable arguments (token ids,
// targets, offsets) live in the config.
//
// check_gradients: in double, loss = sum(out * w) for random w; every element of every input
// is probed by central differences and compared with backward's dx. dx is pre-filled with random
// values first, so the check also proves "+=" (or, for InputSpec::accumulates = false, that the
// kernel overwrites).
// check_float_vs_double: the float instantiation must agree with the double one (outputs and
// gradients) to the fp32 gate.
// Errors are normwise: max|a - b| / max|b| per tensor.
#pragma once
#include <gtest/gtest.h>

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <cstdlib>
#include <random>
#include <string>
#include <vector>

namespace primus::turbo::cpu::testing {

template <typename Real>
using Inputs = std::vector<std::vector<Real>>;

struct InputSpec {
  std::string name;
  size_t size = 0;
  double lo = -1.0, hi = 1.0;  // range of the random values drawn for it
  bool accumulates = true;     // false: the kernel overwrites this gradient
};

// Fresh random numbers for every test; the seed is printed with any failure and can be pinned
// with PRIMUS_TEST_SEED=<n> to replay one.
class Rng {
 public:
  Rng() : seed_(pick_seed()), gen_(seed_) {}
  uint64_t seed() const { return seed_; }
  double uniform(double lo = -1.0, double hi = 1.0) {
    return std::uniform_real_distribution<double>(lo, hi)(gen_);
  }
  int32_t integer(int32_t lo, int32_t hi_inclusive) {
    return std::uniform_int_distribution<int32_t>(lo, hi_inclusive)(gen_);
  }
  template <typename Real = double>
  std::vector<Real> vec(size_t n, double lo = -1.0, double hi = 1.0) {
    std::vector<Real> v(n);
    for (Real& x : v) x = static_cast<Real>(uniform(lo, hi));
    return v;
  }
  std::vector<int32_t> ints(size_t n, int32_t lo, int32_t hi_inclusive) {
    std::vector<int32_t> v(n);
    for (int32_t& x : v) x = integer(lo, hi_inclusive);
    return v;
  }

 private:
  static uint64_t pick_seed() {
    if (const char* s = std::getenv("PRIMUS_TEST_SEED")) return std::strtoull(s, nullptr, 10);
    return std::random_device{}();
  }
  uint64_t seed_;
  std::mt19937_64 gen_;
};

// Base fixture: owns the Rng and attaches its seed to every failure of the test.
class OpTest : public ::testing::Test {
 protected:
  Rng rng;
  ::testing::ScopedTrace seed_trace{
      __FILE__, __LINE__, "random seed (PRIMUS_TEST_SEED) = " + std::to_string(rng.seed())};
};

template <typename A, typename B>
double max_abs_diff(const std::vector<A>& a, const std::vector<B>& b) {
  double m = 0.0;
  for (size_t i = 0; i < a.size(); ++i)
    m = std::max(m, std::abs(static_cast<double>(a[i]) - static_cast<double>(b[i])));
  return m;
}

template <typename A>
double max_abs(const std::vector<A>& a) {
  double m = 0.0;
  for (const A& x : a) m = std::max(m, std::abs(static_cast<double>(x)));
  return m;
}

// max|a - ref| / max|ref|; +inf when ref is all zeros (a test must compare something non-trivial).
template <typename A, typename B>
double rel_error(const std::vector<A>& a, const std::vector<B>& ref) {
  const double scale = max_abs(ref);
  return scale > 0.0 ? max_abs_diff(a, ref) / scale : INFINITY;
}

template <typename Real>
double dot(const std::vector<Real>& a, const std::vector<double>& w) {
  double s = 0.0;
  for (size_t i = 0; i < a.size(); ++i) s += static_cast<double>(a[i]) * w[i];
  return s;
}

template <template <class> class Op, class Cfg>
void check_gradients(const Cfg& cfg, Rng& rng, double tol = 1e-6, double step = 1e-5) {
  Op<double> op(cfg);
  const std::vector<InputSpec> specs = op.inputs();
  Inputs<double> x;
  for (const InputSpec& s : specs) x.push_back(rng.vec(s.size, s.lo, s.hi));
  std::vector<double> out(op.out_size());
  const std::vector<double> w = rng.vec(op.out_size());

  op.forward(x, out);
  Inputs<double> prefill, dx;
  for (const InputSpec& s : specs) prefill.push_back(rng.vec(s.size));
  dx = prefill;
  op.backward(x, w, dx);

  for (size_t i = 0; i < specs.size(); ++i) {
    std::vector<double> analytic(specs[i].size), numeric(specs[i].size);
    for (size_t e = 0; e < specs[i].size; ++e)
      analytic[e] = specs[i].accumulates ? dx[i][e] - prefill[i][e] : dx[i][e];
    Op<double> probe(cfg);
    std::vector<double> o(op.out_size());
    for (size_t e = 0; e < specs[i].size; ++e) {
      const double saved = x[i][e];
      x[i][e] = saved + step;
      probe.forward(x, o);
      const double up = dot(o, w);
      x[i][e] = saved - step;
      probe.forward(x, o);
      const double down = dot(o, w);
      x[i][e] = saved;
      numeric[e] = (up - down) / (2 * step);
    }
    EXPECT_GT(max_abs(numeric), 0.0) << "gradient of " << specs[i].name << " is all zeros";
    EXPECT_LT(rel_error(analytic, numeric), tol)
        << "d(loss)/d(" << specs[i].name << "): backward vs central differences, max |diff| "
        << max_abs_diff(analytic, numeric) << ", max |grad| " << max_abs(numeric);
  }
}

template <template <class> class Op, class Cfg>
void check_float_vs_double(const Cfg& cfg, Rng& rng, double tol = 1e-4) {
  Op<double> od(cfg);
  Op<float> of(cfg);
  const std::vector<InputSpec> specs = od.inputs();
  Inputs<double> xd;
  Inputs<float> xf;
  for (const InputSpec& s : specs) {
    xd.push_back(rng.vec(s.size, s.lo, s.hi));
    xf.emplace_back(xd.back().begin(), xd.back().end());
  }
  // Compare against the double result computed from the float-rounded inputs, so only the
  // kernel's own rounding is measured.
  for (size_t i = 0; i < xd.size(); ++i) xd[i].assign(xf[i].begin(), xf[i].end());
  std::vector<double> outd(od.out_size());
  std::vector<float> outf(of.out_size());
  od.forward(xd, outd);
  of.forward(xf, outf);
  EXPECT_LT(rel_error(outf, outd), tol) << "forward output, float vs double";

  const std::vector<float> doutf = rng.vec<float>(od.out_size());
  const std::vector<double> doutd(doutf.begin(), doutf.end());
  Inputs<double> dxd;
  Inputs<float> dxf;
  for (const InputSpec& s : specs) {
    dxd.emplace_back(s.size, 0.0);
    dxf.emplace_back(s.size, 0.0f);
  }
  od.backward(xd, doutd, dxd);
  of.backward(xf, doutf, dxf);
  for (size_t i = 0; i < specs.size(); ++i)
    EXPECT_LT(rel_error(dxf[i], dxd[i]), tol)
        << "gradient of " << specs[i].name << ", float vs double";
}

}  // namespace primus::turbo::cpu::testing
