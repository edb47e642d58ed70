#include "io/dtype.h"

#include <gtest/gtest.h>

#include <cmath>
#include <limits>
#include <random>

#include "core/util/error.h"

namespace {

using namespace primus::io;

uint32_t bits(float f) {
  uint32_t u;
  std::memcpy(&u, &f, 4);
  return u;
}
float from_bits(uint32_t u) {
  float f;
  std::memcpy(&f, &u, 4);
  return f;
}

// An independent reference: pick whichever of the two neighbouring bf16 values is nearer in
// exact (double) arithmetic; on a tie, the one with an even last bit.
uint16_t bf16_reference(float f) {
  uint32_t u = bits(f);
  uint16_t lo = static_cast<uint16_t>(u >> 16), hi = static_cast<uint16_t>(lo + 1);
  double x = f, a = bf16_to_fp32(lo), b = bf16_to_fp32(hi);
  if (std::isinf(b)) b = std::copysign(std::ldexp(1.0, 128), x);  // the value one step past max
  double da = std::fabs(x - a), db = std::fabs(b - x);
  if (da < db) return lo;
  if (db < da) return hi;
  return (lo & 1) ? hi : lo;
}

TEST(DType, NamesRoundTrip) {
  for (DType t : kAllDTypes) {
    auto back = parse_dtype(dtype_name(t));
    ASSERT_TRUE(back.has_value()) << dtype_name(t);
    EXPECT_EQ(*back, t);
  }
  EXPECT_FALSE(parse_dtype("F128").has_value());
  EXPECT_FALSE(parse_dtype("f32").has_value());  // names are case-sensitive in the format
  EXPECT_EQ(dtype_size(DType::BF16), 2u);
  EXPECT_EQ(dtype_size(DType::F8_E4M3), 1u);
  EXPECT_EQ(dtype_size(DType::I64), 8u);
}

TEST(DType, Bf16RoundsToNearestEven) {
  EXPECT_EQ(fp32_to_bf16(1.0f), 0x3F80);
  EXPECT_EQ(fp32_to_bf16(from_bits(0x3F808000)), 0x3F80);  // tie, lower is even
  EXPECT_EQ(fp32_to_bf16(from_bits(0x3F818000)), 0x3F82);  // tie, upper is even
  EXPECT_EQ(fp32_to_bf16(from_bits(0x3F808001)), 0x3F81);  // just above the tie
  EXPECT_EQ(fp32_to_bf16(from_bits(0x3F807FFF)), 0x3F80);  // just below
  EXPECT_EQ(fp32_to_bf16(-0.0f), 0x8000);
  EXPECT_EQ(fp32_to_bf16(std::numeric_limits<float>::max()), 0x7F80);  // rounds up to inf
  EXPECT_EQ(fp32_to_bf16(std::numeric_limits<float>::infinity()), 0x7F80);
  // NaNs stay NaN, including one whose payload sits only in the low half.
  EXPECT_TRUE(std::isnan(bf16_to_fp32(fp32_to_bf16(from_bits(0x7F800001)))));
  EXPECT_TRUE(std::isnan(bf16_to_fp32(fp32_to_bf16(from_bits(0xFFC00000)))));
  EXPECT_EQ(fp32_to_bf16(from_bits(0xFFC00000)) & 0x8000, 0x8000);
}

TEST(DType, Bf16MatchesReferenceOnRandomFloats) {
  std::mt19937 rng(std::random_device{}());
  int checked = 0;
  while (checked < 200000) {
    float f = from_bits(static_cast<uint32_t>(rng()));
    if (!std::isfinite(f)) continue;
    ASSERT_EQ(fp32_to_bf16(f), bf16_reference(f)) << std::hex << bits(f);
    ++checked;
  }
  // Every bf16 value survives fp32 and back exactly.
  for (uint32_t h = 0; h < 65536; ++h) {
    float f = bf16_to_fp32(static_cast<uint16_t>(h));
    if (std::isnan(f)) continue;
    ASSERT_EQ(fp32_to_bf16(f), h);
  }
}

TEST(DType, Fp16ToFp32IsExactForEveryValue) {
  for (uint32_t h = 0; h < 65536; ++h) {
    int sign = (h >> 15) ? -1 : 1, exp = (h >> 10) & 31, man = h & 1023;
    float got = fp16_to_fp32(static_cast<uint16_t>(h));
    if (exp == 31) {
      EXPECT_TRUE(man ? std::isnan(got) : got == sign * std::numeric_limits<float>::infinity());
      continue;
    }
    double want = exp == 0 ? std::ldexp(man, -24) : std::ldexp(1024 + man, exp - 25);
    ASSERT_EQ(got, static_cast<float>(sign * want)) << std::hex << h;
    ASSERT_EQ(std::signbit(got), sign < 0) << std::hex << h;
  }
}

TEST(DType, ToFp32ConvertsEveryFloatTypeAndRefusesOthers) {
  std::mt19937 rng(std::random_device{}());
  std::normal_distribution<double> d;
  std::vector<double> f64(33);
  for (auto& x : f64) x = d(rng);
  std::vector<std::byte> raw(f64.size() * 8 + 1);  // +1: convert from an unaligned address
  std::memcpy(raw.data() + 1, f64.data(), f64.size() * 8);
  std::vector<float> out(f64.size());
  to_fp32(DType::F64, raw.data() + 1, f64.size(), out.data());
  for (size_t i = 0; i < f64.size(); ++i) EXPECT_EQ(out[i], static_cast<float>(f64[i]));
  EXPECT_THROW(to_fp32(DType::I32, raw.data(), 1, out.data()), primus::FormatError);
}

}  // namespace
