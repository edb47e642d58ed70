// `primus benchmark --ab`'s timing (turbo/bench/benchmark.h, time_ab) on the host device: the
// product runs under each value in turn, round after round, and the variable comes back as it was;
// and the host device's read of a strided view, which the cross-check of backends compares.
#include <gtest/gtest.h>

#include <cstdlib>
#include <stdexcept>
#include <string>
#include <vector>

#include "core/util/error.h"
#include "turbo/bench/bench_device.h"
#include "turbo/bench/benchmark.h"
#include "turbo/bench/harness.h"

namespace primus::turbo::bench {
namespace {

constexpr const char* kVar = "PRIMUS_BENCH_AB_UNIT_TEST";

// The values the product saw, consecutive repeats (warm-up and timed calls of one value) merged.
std::vector<std::string> runs_of(const std::vector<std::string>& seen) {
  std::vector<std::string> out;
  for (const auto& s : seen)
    if (out.empty() || out.back() != s) out.push_back(s);
  return out;
}

TEST(BenchAB, TimesEachValueInTurnAndRestoresTheVariable) {
  auto dev = make_host_bench_device(size_t{1} << 20);
  BenchConfig cfg;
  parse_ab(std::string(kVar) + "=a,b,c", cfg);
  cfg.ab_rounds = 2;
  std::vector<std::string> seen;
  const Timed t{"op/x", Metric::Flops, 1.0, [&] {
                  const char* v = std::getenv(kVar);
                  seen.push_back(v ? v : "<unset>");
                },
                ""};
  for (const char* before : {"prior", static_cast<const char*>(nullptr)}) {
    SCOPED_TRACE(before ? before : "unset before");
    if (before) setenv(kVar, before, 1);
    else unsetenv(kVar);
    seen.clear();
    const auto out = time_ab(cfg, *dev, t, 3);
    EXPECT_EQ(runs_of(seen), (std::vector<std::string>{"a", "b", "c", "a", "b", "c"}));
    ASSERT_EQ(out.size(), 3u);
    EXPECT_EQ(out[0].first, std::string("op/x [") + kVar + "=a]");
    EXPECT_EQ(out[2].first, std::string("op/x [") + kVar + "=c]");
    for (const auto& [name, ms] : out) EXPECT_GE(ms, 0.0) << name;
    const char* after = std::getenv(kVar);
    if (before) {
      ASSERT_NE(after, nullptr);
      EXPECT_STREQ(after, before);
    } else {
      EXPECT_EQ(after, nullptr) << after;
    }
  }
}

TEST(BenchAB, RestoresTheVariableWhenAValueFails) {
  auto dev = make_host_bench_device(size_t{1} << 20);
  BenchConfig cfg;
  parse_ab(std::string(kVar) + "=ok,bad", cfg);
  setenv(kVar, "prior", 1);
  const Timed t{"op/x", Metric::Flops, 1.0, [] {
                  if (std::string(std::getenv(kVar)) == "bad") throw std::runtime_error("refused");
                },
                ""};
  EXPECT_THROW(time_ab(cfg, *dev, t, 1), std::runtime_error);
  ASSERT_NE(std::getenv(kVar), nullptr);
  EXPECT_STREQ(std::getenv(kVar), "prior");
  unsetenv(kVar);
}

TEST(BenchAB, ParseNamesWhatIsWrong) {
  BenchConfig cfg;
  parse_ab("V=x,y", cfg);
  EXPECT_EQ(cfg.ab_var, "V");
  EXPECT_EQ(cfg.ab_values, (std::vector<std::string>{"x", "y"}));
  for (const char* bad : {"V", "=x,y", "V=x", "V=x,", "V=,y"}) EXPECT_THROW(parse_ab(bad, cfg), UsageError) << bad;
}

// BenchDevice::read, what the cross-check compares: a strided view (two heads of a packed
// [B, T, 4 x D] tensor, as the attention cases' q, k, v) comes back row-major by its own shape.
TEST(BenchDeviceRead, GathersAStridedViewInRowMajorOrder) {
  auto dev = make_host_bench_device(size_t{1} << 20);
  const int64_t B = 2, T = 3, D = 2, width = 4 * D;
  TensorView packed = dev->arena().tensor(DType::F32, {B, T, width}, "packed");
  for (int64_t i = 0; i < packed.numel(); ++i) packed.ptr<float>()[i] = static_cast<float>(i);
  TensorView heads = packed;  // heads 1 and 2: [B, T, 2, D]
  heads.data = packed.ptr<float>() + D;
  heads.ndim = 4;
  heads.shape = {B, T, 2, D};
  heads.strides = {T * width, width, D, 1};
  EXPECT_EQ(span_bytes(heads), static_cast<size_t>((B - 1) * T * width + (T - 1) * width + D + D) * sizeof(float));
  const std::vector<float> got = dev->read(heads);
  ASSERT_EQ(got.size(), static_cast<size_t>(B * T * 2 * D));
  size_t i = 0;
  for (int64_t b = 0; b < B; ++b)
    for (int64_t t = 0; t < T; ++t)
      for (int64_t h = 0; h < 2; ++h)
        for (int64_t d = 0; d < D; ++d, ++i)
          EXPECT_EQ(got[i], static_cast<float>(b * T * width + t * width + (1 + h) * D + d)) << b << " " << t << " " << h << " " << d;
  // A transposed matrix reads as its own rows.
  TensorView m = dev->arena().tensor(DType::F32, {2, 3}, "m");
  for (int i2 = 0; i2 < 6; ++i2) m.ptr<float>()[i2] = static_cast<float>(i2);
  EXPECT_EQ(dev->read(m.transposed()), (std::vector<float>{0, 3, 1, 4, 2, 5}));
}

}  // namespace
}  // namespace primus::turbo::bench
