// turbo/core on the host: dtype conversions, TensorView layout helpers, the bump Arena.
#include <gtest/gtest.h>

#include <cmath>
#include <cstdlib>
#include <cstring>
#include <string>
#include <random>

#include "core/util/error.h"
#include "turbo/core/arena.h"
#include "turbo/core/dtype.h"
#include "turbo/core/env_switch.h"
#include "turbo/core/tensor_view.h"

namespace primus::turbo {
namespace {

TEST(DType, SizesNamesAndParse) {
  EXPECT_EQ(dtype_size(DType::BF16), 2u);
  EXPECT_EQ(dtype_size(DType::F8E4M3), 1u);
  EXPECT_EQ(dtype_size(DType::I64), 8u);
  EXPECT_EQ(dtype_size(DType::U16), 2u);
  EXPECT_FALSE(dtype_is_float(DType::U16));
  for (DType t : {DType::F32, DType::BF16, DType::F16, DType::F8E4M3, DType::F8E5M2, DType::I32, DType::I64, DType::U16})
    EXPECT_EQ(parse_dtype(dtype_name(t)), t);
  EXPECT_EQ(parse_dtype("bfloat16"), DType::BF16);
  EXPECT_THROW(parse_dtype("f4"), ConfigError);
}

TEST(DType, Bf16RoundsToNearestEven) {
  EXPECT_EQ(float_to_bf16_bits(1.0f), 0x3f80);
  // 1 + 2^-8 lies exactly halfway between 1 and 1 + 2^-7: ties go to the even mantissa (1.0).
  EXPECT_EQ(float_to_bf16_bits(1.0f + std::ldexp(1.0f, -8)), 0x3f80);
  EXPECT_EQ(float_to_bf16_bits(1.0f + 3 * std::ldexp(1.0f, -8)), 0x3f82);
  EXPECT_TRUE(std::isnan(bf16_bits_to_float(float_to_bf16_bits(NAN))));
  std::mt19937 rng(std::random_device{}());
  std::uniform_real_distribution<float> u(-1e4f, 1e4f);
  for (int i = 0; i < 1000; ++i) {
    const float x = u(rng);
    const float y = bf16_bits_to_float(float_to_bf16_bits(x));
    EXPECT_LE(std::fabs(x - y), std::fabs(x) * std::ldexp(1.0f, -8) * 1.0001f) << x;
  }
}

TEST(DType, F16MatchesIeeeHalf) {
  EXPECT_EQ(float_to_f16_bits(1.0f), 0x3c00);
  EXPECT_EQ(float_to_f16_bits(-2.0f), 0xc000);
  EXPECT_EQ(float_to_f16_bits(65504.0f), 0x7bff);
  EXPECT_EQ(float_to_f16_bits(1e6f), 0x7c00);                      // overflow: inf
  EXPECT_EQ(float_to_f16_bits(std::ldexp(1.0f, -24)), 0x0001);     // smallest subnormal
  EXPECT_FLOAT_EQ(f16_bits_to_float(0x3555), 0.333251953125f);
  for (uint32_t b = 0; b < 0x7c00; b += 7)  // every finite positive code round-trips
    EXPECT_EQ(float_to_f16_bits(f16_bits_to_float(static_cast<uint16_t>(b))), b);
}

TEST(DType, Fp8SaturatesAndRoundTrips) {
  EXPECT_FLOAT_EQ(f8e4m3_bits_to_float(float_to_f8e4m3_bits(448.0f)), 448.0f);
  EXPECT_FLOAT_EQ(f8e4m3_bits_to_float(float_to_f8e4m3_bits(1e6f)), 448.0f);
  EXPECT_FLOAT_EQ(f8e4m3_bits_to_float(float_to_f8e4m3_bits(-1e6f)), -448.0f);
  EXPECT_FLOAT_EQ(f8e5m2_bits_to_float(float_to_f8e5m2_bits(1e9f)), 57344.0f);
  EXPECT_FLOAT_EQ(f8e4m3_bits_to_float(float_to_f8e4m3_bits(0.3125f)), 0.3125f);
  EXPECT_FLOAT_EQ(f8e4m3_bits_to_float(0x01), std::ldexp(1.0f, -9));  // smallest subnormal
  EXPECT_TRUE(std::isnan(f8e4m3_bits_to_float(0x7f)));
  for (int b = 0; b < 0x7f; ++b)
    EXPECT_EQ(float_to_f8e4m3_bits(f8e4m3_bits_to_float(static_cast<uint8_t>(b))), b);
  for (int b = 0; b < 0x7c; ++b)
    EXPECT_EQ(float_to_f8e5m2_bits(f8e5m2_bits_to_float(static_cast<uint8_t>(b))), b);
}

TEST(TensorView, ContiguousStridesReshapeSliceTranspose) {
  std::vector<float> buf(2 * 3 * 4);
  TensorView t(buf.data(), DType::F32, Device::CPU, {2, 3, 4});
  EXPECT_EQ(t.stride(0), 12);
  EXPECT_EQ(t.stride(-1), 1);
  EXPECT_EQ(t.numel(), 24);
  EXPECT_EQ(t.nbytes(), 96u);
  EXPECT_EQ(t.rows(), 6);
  EXPECT_TRUE(t.is_contiguous());
  auto r = t.reshape({6, 4});
  EXPECT_EQ(r.size(0), 6);
  EXPECT_THROW(t.reshape({5, 5}), RuntimeError);
  auto s = t.slice0(1, 2);
  EXPECT_EQ(s.ptr<float>(), buf.data() + 12);
  auto tr = r.transposed();
  EXPECT_EQ(tr.size(0), 4);
  EXPECT_EQ(tr.stride(0), 1);
  EXPECT_FALSE(tr.is_contiguous());
  EXPECT_EQ(tr.describe(), "f32[4, 6] cpu strides(1, 4)");
  EXPECT_THROW(tr.reshape({24}), RuntimeError);
  EXPECT_THROW(t.size(3), RuntimeError);
}

TEST(TensorView, ChecksNameOpArgumentAndShape) {
  std::vector<uint16_t> buf(8);
  TensorView t(buf.data(), DType::BF16, Device::CPU, {2, 4});
  EXPECT_NO_THROW(check_shape(t, {2, -1}, "op", "x"));
  try {
    check_shape(t, {2, 5}, "layernorm_forward", "inp");
    FAIL();
  } catch (const RuntimeError& e) {
    EXPECT_STREQ(e.what(), "layernorm_forward: inp: expected shape [2, 5] got bf16[2, 4] cpu");
  }
  EXPECT_THROW(check_dtype(t, DType::F32, "op", "x"), RuntimeError);
  EXPECT_THROW(check_device(t, Device::CUDA, "op", "x"), RuntimeError);
  EXPECT_THROW(check_defined(TensorView{}, "op", "x"), RuntimeError);
}

TEST(Arena, AlignsRewindsAndReportsExhaustion) {
  auto a = make_host_arena(4096);
  void* p = a->allocate(10, 64, "p");
  void* q = a->allocate(10, 64, "q");
  EXPECT_EQ(reinterpret_cast<uintptr_t>(p) % 64, 0u);
  EXPECT_EQ(reinterpret_cast<uintptr_t>(q) % 64, 0u);
  EXPECT_EQ(static_cast<char*>(q) - static_cast<char*>(p), 64);
  const auto m = a->mark();
  auto t = a->tensor(DType::BF16, {16, 16}, "t");
  EXPECT_EQ(t.nbytes(), 512u);
  std::memset(t.data, 1, t.nbytes());  // the memory is really ours
  a->rewind(m);
  EXPECT_EQ(a->used(), m);
  EXPECT_GE(a->high_water(), m + 512);
  {
    ArenaScope scope(*a);
    a->allocate(1000);
  }
  EXPECT_EQ(a->used(), m);
  try {
    a->allocate(5000, 256, "logits");
    FAIL();
  } catch (const RuntimeError& e) {
    const std::string w = e.what();
    EXPECT_NE(w.find("logits"), std::string::npos) << w;
    EXPECT_NE(w.find("5000"), std::string::npos) << w;
  }
  EXPECT_THROW(a->allocate(1, 3), RuntimeError);
  a->reset();
  EXPECT_EQ(a->used(), 0u);
  EXPECT_THROW(a->rewind(100), RuntimeError);
}

// The experiment switches (PRIMUS_TURBO_* kernel variants): unset or empty gives the default, an
// accepted value itself, anything else an error naming the variable, its value and the choices.
TEST(EnvSwitch, AcceptedValuesDefaultsAndTyposThatStopTheRun) {
  const char* kName = "PRIMUS_TURBO_TEST_SWITCH";
  ::unsetenv(kName);
  EXPECT_EQ(env_choice(kName, {"staged", "legacy"}, "staged"), "staged");
  EXPECT_EQ(env_int(kName, 2, 4, 3), 3);
  ::setenv(kName, "", 1);
  EXPECT_EQ(env_choice(kName, {"staged", "legacy"}, "staged"), "staged");
  EXPECT_EQ(env_int(kName, 2, 4, 3), 3);
  ::setenv(kName, "legacy", 1);
  EXPECT_EQ(env_choice(kName, {"staged", "legacy"}, "staged"), "legacy");
  ::setenv(kName, "4", 1);
  EXPECT_EQ(env_int(kName, 2, 4, 3), 4);
  for (const char* bad : {"Legacy", "legacy ", "stagd"}) {
    ::setenv(kName, bad, 1);
    try {
      (void)env_choice(kName, {"staged", "legacy"}, "staged");
      ADD_FAILURE() << "'" << bad << "' was accepted";
    } catch (const RuntimeError& e) {
      const std::string w = e.what();
      EXPECT_NE(w.find(std::string(kName) + "='" + bad + "'"), std::string::npos) << w;
      EXPECT_NE(w.find("staged, legacy"), std::string::npos) << w;
    }
  }
  for (const char* bad : {"5", "1", "3x", "x", "-", "99999999999999999999"}) {
    ::setenv(kName, bad, 1);
    EXPECT_THROW((void)env_int(kName, 2, 4, 3), RuntimeError) << bad;
  }
  ::unsetenv(kName);
}

}  // namespace
}  // namespace primus::turbo
