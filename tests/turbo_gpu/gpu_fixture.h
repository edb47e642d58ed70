// Shared fixture of the GPU op tests: skips without a device, hands out device tensors from an
// arena, moves data between host float vectors and device tensors of any dtype, poisons outputs
// with NaN before each run, and measures ||got - ref|| / ||ref||.
// Inputs are drawn fresh from a random seed per test (printed on failure), rounded to the
// tensor's dtype before the reference sees them, so both sides compute on identical values.
#pragma once
#include <fmt/format.h>
#include <gtest/gtest.h>

#include <cmath>
#include <cstring>
#include <random>
#include <string>
#include <vector>

#include "core/util/error.h"
#include "turbo/core/cuda_arena.h"
#include "turbo/core/cuda_check.h"
#include "turbo/ops/exec_context.h"

namespace primus::turbo::testing {

// Relative L2 error; a NaN or inf anywhere in `got` makes it infinite (NaN never passes).
template <class R>
double rel_err(const std::vector<float>& got, const std::vector<R>& ref) {
  EXPECT_EQ(got.size(), ref.size());
  double num = 0.0, den = 0.0;
  for (size_t i = 0; i < got.size() && i < ref.size(); ++i) {
    if (!std::isfinite(got[i])) return INFINITY;
    const double d = static_cast<double>(got[i]) - static_cast<double>(ref[i]);
    num += d * d;
    den += static_cast<double>(ref[i]) * static_cast<double>(ref[i]);
  }
  return std::sqrt(num / std::max(den, 1e-300));
}

// The accuracy gates of DESIGN.md.
inline double gate(DType t) { return t == DType::F32 ? 1e-4 : 1e-2; }

class GpuTest : public ::testing::Test {
 protected:
  void SetUp() override {
    if (cuda_device_count_or_zero() == 0) GTEST_SKIP() << "no CUDA device";
    arena_ = make_device_arena(size_t{1} << 30);
    scratch_ = make_device_arena(size_t{256} << 20);
    ctx.scratch = scratch_.get();
    seed_ = std::random_device{}();
    rng_.seed(seed_);
    trace_ = std::make_unique<::testing::ScopedTrace>(__FILE__, __LINE__, "seed " + std::to_string(seed_));
  }
  void TearDown() override { trace_.reset(); }

  TensorView make(DType dt, std::initializer_list<int64_t> shape) { return arena_->tensor(dt, shape); }
  // The tensors made from here on go back when the scope ends (loops over many cases).
  ArenaScope scoped_tensors() { return ArenaScope(*arena_); }

  // Uploads `values` converted to t's dtype.
  void put(const TensorView& t, const std::vector<float>& values) {
    ASSERT_EQ(static_cast<int64_t>(values.size()), t.numel());
    std::vector<char> host(t.nbytes());
    for (size_t i = 0; i < values.size(); ++i) store_from_float(host.data(), t.dtype, i, values[i]);
    CUDA_CHECK(cudaMemcpy(t.data, host.data(), host.size(), cudaMemcpyHostToDevice));
  }
  void put_i32(const TensorView& t, const std::vector<int32_t>& values) {
    CUDA_CHECK(cudaMemcpy(t.data, values.data(), values.size() * 4, cudaMemcpyHostToDevice));
  }
  std::vector<float> get(const TensorView& t) {
    CUDA_CHECK(cudaDeviceSynchronize());
    std::vector<char> host(t.nbytes());
    CUDA_CHECK(cudaMemcpy(host.data(), t.data, host.size(), cudaMemcpyDeviceToHost));
    std::vector<float> out(static_cast<size_t>(t.numel()));
    for (size_t i = 0; i < out.size(); ++i) out[i] = load_as_float(host.data(), t.dtype, i);
    return out;
  }
  std::vector<uint8_t> bytes(const TensorView& t) {
    CUDA_CHECK(cudaDeviceSynchronize());
    std::vector<uint8_t> host(t.nbytes());
    CUDA_CHECK(cudaMemcpy(host.data(), t.data, host.size(), cudaMemcpyDeviceToHost));
    return host;
  }
  // NaN in every element (0xFF.. is a NaN pattern for f32, bf16 and f16).
  void poison(const TensorView& t) { CUDA_CHECK(cudaMemset(t.data, 0xFF, t.nbytes())); }

  // Normal(0, scale) values rounded to dtype `dt`.
  std::vector<float> randn(int64_t n, float scale = 1.0f, DType dt = DType::F32) {
    std::normal_distribution<float> d(0.0f, scale);
    std::vector<float> v(static_cast<size_t>(n));
    for (auto& x : v) x = round_to(dt, d(rng_));
    return v;
  }
  // A fresh device tensor filled with randn; returns the host copy of its exact values.
  std::vector<float> random_tensor(const TensorView& t, float scale = 1.0f) {
    auto v = randn(t.numel(), scale, t.dtype);
    put(t, v);
    return v;
  }
  std::vector<int32_t> randint(int64_t n, int32_t lo, int32_t hi) {
    std::uniform_int_distribution<int32_t> d(lo, hi - 1);
    std::vector<int32_t> v(static_cast<size_t>(n));
    for (auto& x : v) x = d(rng_);
    return v;
  }
  static float round_to(DType dt, float x) {
    char buf[8];
    store_from_float(buf, dt, 0, x);
    return load_as_float(buf, dt, 0);
  }
  static std::vector<float> round_all(DType dt, std::vector<float> v) {
    for (auto& x : v) x = round_to(dt, x);
    return v;
  }

  ExecContext ctx;
  std::mt19937 rng_;

 private:
  std::unique_ptr<Arena> arena_, scratch_;
  unsigned seed_ = 0;
  std::unique_ptr<::testing::ScopedTrace> trace_;
};

// Parameterised over the activation dtypes the TURBO kernels serve.
class GpuDTypeTest : public GpuTest, public ::testing::WithParamInterface<DType> {};
inline std::string dtype_param_name(const ::testing::TestParamInfo<DType>& info) {
  return std::string(dtype_name(info.param));
}

}  // namespace primus::turbo::testing
