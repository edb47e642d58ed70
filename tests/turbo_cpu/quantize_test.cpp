// FP8 quantisation on the host: the conversions of turbo/core/dtype.h (round to nearest even,
// saturation), the scaling recipe of turbo/kernels/cpu/quantize.h, and the public op
// quantize_fp8 (turbo/ops/quantization.h) on host tensors: exact bytes for hand-made inputs,
// transposes, strided rows, NaN/inf, argument errors, and accuracy on random data.
#include <gtest/gtest.h>

#include <cfloat>
#include <cmath>
#include <cstring>
#include <limits>
#include <string>
#include <vector>

#include "core/util/error.h"
#include "tests/turbo_cpu/op_check.h"
#include "turbo/core/dtype.h"
#include "turbo/kernels/cpu/quantize.h"
#include "turbo/ops/quantization.h"

namespace primus::turbo {
namespace {

using cpu::testing::Rng;

uint8_t encode(DType t, float x) { return t == DType::F8E4M3 ? float_to_f8e4m3_bits(x) : float_to_f8e5m2_bits(x); }
float decode(DType t, uint8_t b) { return t == DType::F8E4M3 ? f8e4m3_bits_to_float(b) : f8e5m2_bits_to_float(b); }
uint32_t bits(float f) {
  uint32_t u;
  std::memcpy(&u, &f, 4);
  return u;
}

class Fp8Format : public ::testing::TestWithParam<DType> {};

// Every finite code decodes and encodes back to itself; each midpoint between neighbours goes to
// the code with the even mantissa (= the even code), and one f32 ulp either side of it goes to
// the nearer neighbour.
TEST_P(Fp8Format, RoundTripAndTiesToEven) {
  const DType t = GetParam();
  int finite = 0;
  for (int b = 0; b < 256; ++b) {
    const float v = decode(t, static_cast<uint8_t>(b));
    if (std::isnan(v) || std::isinf(v)) continue;
    ++finite;
    EXPECT_EQ(encode(t, v), b) << "code " << b << " value " << v;
  }
  EXPECT_EQ(finite, t == DType::F8E4M3 ? 254 : 248);  // e4m3: 2 NaNs; e5m2: 2 infs + 6 NaNs
  for (int sign : {0, 0x80}) {
    for (int b = 0; b < 0x7f; ++b) {
      const uint8_t lo = static_cast<uint8_t>(b | sign), hi = static_cast<uint8_t>((b + 1) | sign);
      const float vlo = decode(t, lo), vhi = decode(t, hi);
      if (!std::isfinite(vlo) || !std::isfinite(vhi)) continue;
      const float mid = (vlo + vhi) / 2;  // exact: both are short binary fractions
      ASSERT_EQ(static_cast<double>(mid), (static_cast<double>(vlo) + vhi) / 2);
      EXPECT_EQ(encode(t, mid), (b % 2 == 0) ? lo : hi) << "tie between codes " << b << " and " << b + 1;
      EXPECT_EQ(encode(t, std::nextafter(mid, vlo)), lo) << "below the midpoint of " << b << ", " << b + 1;
      EXPECT_EQ(encode(t, std::nextafter(mid, vhi)), hi) << "above the midpoint of " << b << ", " << b + 1;
    }
  }
}

// Out-of-range values saturate to +-max (never inf); NaN stays NaN; below half the smallest
// subnormal goes to (signed) zero, exactly half ties to zero (even).
TEST_P(Fp8Format, SaturatesAndUnderflows) {
  const DType t = GetParam();
  const float mx = cpu::fp8_max(t);
  const uint8_t max_code = t == DType::F8E4M3 ? 0x7e : 0x7b;
  EXPECT_EQ(decode(t, max_code), mx);
  for (float big : {mx, mx * 1.0625f, mx * 1.5f, mx * 4.0f, 1e30f, FLT_MAX, std::numeric_limits<float>::infinity()}) {
    EXPECT_EQ(encode(t, big), max_code) << big;
    EXPECT_EQ(encode(t, -big), max_code | 0x80) << -big;
  }
  EXPECT_TRUE(std::isnan(decode(t, encode(t, std::numeric_limits<float>::quiet_NaN()))));
  const float min_sub = decode(t, 0x01);
  EXPECT_EQ(min_sub, t == DType::F8E4M3 ? std::ldexp(1.0f, -9) : std::ldexp(1.0f, -16));
  EXPECT_EQ(encode(t, min_sub / 2), 0x00);
  EXPECT_EQ(encode(t, -min_sub / 2), 0x80);
  EXPECT_EQ(encode(t, std::nextafter(min_sub / 2, 1.0f)), 0x01);
  EXPECT_EQ(encode(t, min_sub * 1.5f), 0x02);  // tie between 1 and 2 subnormal steps: even (2)
  EXPECT_EQ(encode(t, 1e-30f), 0x00);
  EXPECT_EQ(encode(t, 0.0f), 0x00);
  EXPECT_EQ(encode(t, -0.0f), 0x80);
  // The poison byte is a NaN in both formats.
  EXPECT_TRUE(std::isnan(decode(t, cpu::kFp8PoisonByte)));
}

INSTANTIATE_TEST_SUITE_P(Quantize, Fp8Format, ::testing::Values(DType::F8E4M3, DType::F8E5M2),
                         [](const auto& info) { return std::string(dtype_name(info.param)); });

TEST(QuantizeScaling, Recipe) {
  using cpu::fp8_tensorwise_scaling;
  auto s = fp8_tensorwise_scaling(0.0f, DType::F8E4M3);
  EXPECT_EQ(s.scale, 1.0f);
  EXPECT_EQ(s.scale_inv, 1.0f);
  EXPECT_TRUE(s.finite());
  s = fp8_tensorwise_scaling(2.0f, DType::F8E4M3);
  EXPECT_EQ(s.scale, 224.0f);
  EXPECT_EQ(s.scale_inv, 1.0f / 224.0f);
  s = fp8_tensorwise_scaling(3.0f, DType::F8E5M2);
  EXPECT_EQ(s.scale, 57344.0f / 3.0f);
  EXPECT_EQ(s.scale_inv, 1.0f / (57344.0f / 3.0f));
  // 448 / (an f32 subnormal) overflows: the scale is clamped to FLT_MAX, not inf (inf * 0 = NaN).
  s = fp8_tensorwise_scaling(1e-40f, DType::F8E4M3);
  EXPECT_EQ(s.scale, FLT_MAX);
  EXPECT_EQ(s.scale_inv, 1.0f / FLT_MAX);
  for (float bad : {std::numeric_limits<float>::infinity(), std::numeric_limits<float>::quiet_NaN()}) {
    s = fp8_tensorwise_scaling(bad, DType::F8E5M2);
    EXPECT_FALSE(s.finite());
    EXPECT_EQ(bits(s.scale_inv), 0x7fc00000u);
  }
}

// ---- the op on host tensors ---------------------------------------------------------------------

// A host [R, C] input of dtype `in` whose rows are `ld` elements apart; the gaps hold `pad`.
struct HostInput {
  std::vector<float> f32;
  std::vector<uint16_t> bf16;
  TensorView view;
  HostInput(DType in, int64_t R, int64_t C, int64_t ld, const std::vector<float>& values, float pad = 0.0f) {
    const size_t n = static_cast<size_t>(R * ld);
    void* data;
    if (in == DType::BF16) {
      bf16.assign(n, float_to_bf16_bits(pad));
      for (int64_t r = 0; r < R; ++r)
        for (int64_t c = 0; c < C; ++c) bf16[r * ld + c] = float_to_bf16_bits(values[r * C + c]);
      data = bf16.data();
    } else {
      f32.assign(n, pad);
      for (int64_t r = 0; r < R; ++r)
        for (int64_t c = 0; c < C; ++c) f32[r * ld + c] = values[r * C + c];
      data = f32.data();
    }
    view = TensorView(data, in, Device::CPU, {R, ld});
    view.shape[1] = C;  // rows stay ld apart
  }
};

struct Result {
  std::vector<uint8_t> out, out_t;
  float scale_inv = 0;
  BackendType backend{};
};

Result quantize(const TensorView& inp, DType fp8, bool want_out = true, bool want_t = true) {
  const int64_t R = inp.size(0), C = inp.size(1);
  Result r;
  r.out.assign(static_cast<size_t>(R * C), 0xAB);
  r.out_t.assign(static_cast<size_t>(R * C), 0xAB);
  QuantizeFp8Args a;
  a.inp = inp;
  if (want_out) a.out = TensorView(r.out.data(), fp8, Device::CPU, {R, C});
  if (want_t) a.out_t = TensorView(r.out_t.data(), fp8, Device::CPU, {C, R});
  r.scale_inv = NAN;
  a.scale_inv = TensorView(&r.scale_inv, DType::F32, Device::CPU, {1});
  r.backend = quantize_fp8(a);
  return r;
}

class QuantizeCpu : public ::testing::TestWithParam<DType> {};  // parameter: the input dtype

// amax = 448 makes the scale exactly 1, so the bytes are the formats' own roundings.
TEST_P(QuantizeCpu, HandMadeE4M3ScaleOne) {
  const DType in = GetParam();
  const int64_t R = 2, C = 4;
  const std::vector<float> x = {-448.0f, 17.0f, 19.0f, 0.0f,  //
                                -0.0f, 0.001f, 300.0f, 1e-30f};
  // -448 -> -max; 17 ties between 16 and 18 -> 16 (even); 19 ties between 18 and 20 -> 20;
  // +-0 keep their sign; 0.001 (~0.51 of the smallest subnormal 2^-9) -> 2^-9; 300 -> 288;
  // 1e-30 underflows to 0.
  const std::vector<uint8_t> want = {0xfe, 0x58, 0x5a, 0x00, 0x80, 0x01, 0x79, 0x00};
  ASSERT_EQ(f8e4m3_bits_to_float(0x58), 16.0f);
  ASSERT_EQ(f8e4m3_bits_to_float(0x5a), 20.0f);
  ASSERT_EQ(f8e4m3_bits_to_float(0x79), 288.0f);
  HostInput h(in, R, C, C, x);
  const Result r = quantize(h.view, DType::F8E4M3);
  EXPECT_EQ(r.backend, BackendType::CPU);
  EXPECT_EQ(r.scale_inv, 1.0f);
  EXPECT_EQ(r.out, want);
  for (int64_t i = 0; i < R; ++i)
    for (int64_t j = 0; j < C; ++j) EXPECT_EQ(r.out_t[j * R + i], want[i * C + j]) << "out_t[" << j << "," << i << "]";
}

// amax = 2 in e5m2: scale = 57344 / 2 = 28672 = 1.75 * 2^14, so 1 -> 1.75*2^14, -2 -> -max,
// 0.25 -> 1.75*2^12.
TEST_P(QuantizeCpu, HandMadeE5M2) {
  const DType in = GetParam();
  HostInput h(in, 2, 3, 3, {1.0f, -2.0f, 0.25f, 0.0f, -0.5f, 2.0f});
  const Result r = quantize(h.view, DType::F8E5M2);
  EXPECT_EQ(r.scale_inv, 1.0f / 28672.0f);
  EXPECT_EQ(r.out, (std::vector<uint8_t>{0x77, 0xfb, 0x6f, 0x00, 0xf3, 0x7b}));
  EXPECT_EQ(r.out_t, (std::vector<uint8_t>{0x77, 0x00, 0xfb, 0xf3, 0x6f, 0x7b}));
  EXPECT_EQ(f8e5m2_bits_to_float(0x77), 28672.0f);
  EXPECT_EQ(f8e5m2_bits_to_float(0x6f), 7168.0f);
  EXPECT_EQ(f8e5m2_bits_to_float(0xf3), -14336.0f);
}

TEST_P(QuantizeCpu, AllZerosHaveScaleOne) {
  HostInput h(GetParam(), 3, 5, 5, std::vector<float>(15, 0.0f));
  for (DType fp8 : {DType::F8E4M3, DType::F8E5M2}) {
    const Result r = quantize(h.view, fp8);
    EXPECT_EQ(r.scale_inv, 1.0f);
    EXPECT_EQ(r.out, std::vector<uint8_t>(15, 0));
    EXPECT_EQ(r.out_t, std::vector<uint8_t>(15, 0));
  }
}

// Rows ld > C apart: the gaps (holding NaN and a huge value) are neither read into amax nor
// written; only one of the two outputs is requested at a time and the other stays untouched.
TEST_P(QuantizeCpu, StridedRowsAndSingleOutputs) {
  const DType in = GetParam();
  Rng rng;
  const int64_t R = 5, C = 7, ld = 11;
  std::vector<float> x = rng.vec<float>(R * C, -3, 3);
  HostInput dense(in, R, C, C, x), strided_nan(in, R, C, ld, x, NAN), strided_big(in, R, C, ld, x, 1e6f);
  for (DType fp8 : {DType::F8E4M3, DType::F8E5M2}) {
    const Result ref = quantize(dense.view, fp8);
    for (const HostInput* h : {&strided_nan, &strided_big}) {
      const Result both = quantize(h->view, fp8);
      EXPECT_EQ(both.out, ref.out);
      EXPECT_EQ(both.out_t, ref.out_t);
      EXPECT_EQ(bits(both.scale_inv), bits(ref.scale_inv));
      const Result only = quantize(h->view, fp8, true, false);
      EXPECT_EQ(only.out, ref.out);
      EXPECT_EQ(only.out_t, std::vector<uint8_t>(R * C, 0xAB));
      const Result only_t = quantize(h->view, fp8, false, true);
      EXPECT_EQ(only_t.out_t, ref.out_t);
      EXPECT_EQ(only_t.out, std::vector<uint8_t>(R * C, 0xAB));
      EXPECT_EQ(bits(only_t.scale_inv), bits(ref.scale_inv));
    }
  }
}

// A NaN or inf anywhere makes the result visibly non-finite: scale_inv NaN, every byte 0x7f.
TEST_P(QuantizeCpu, NonFiniteInputPoisonsTheResult) {
  const DType in = GetParam();
  for (float bad : {NAN, INFINITY, -INFINITY}) {
    std::vector<float> x = {1.0f, 2.0f, -3.0f, 4.0f, 0.5f, 0.0f};
    x[4] = bad;
    HostInput h(in, 2, 3, 3, x);
    for (DType fp8 : {DType::F8E4M3, DType::F8E5M2}) {
      const Result r = quantize(h.view, fp8);
      EXPECT_TRUE(std::isnan(r.scale_inv)) << bad;
      EXPECT_EQ(bits(r.scale_inv), 0x7fc00000u);
      EXPECT_EQ(r.out, std::vector<uint8_t>(6, cpu::kFp8PoisonByte)) << bad;
      EXPECT_EQ(r.out_t, std::vector<uint8_t>(6, cpu::kFp8PoisonByte)) << bad;
      for (uint8_t b : r.out) EXPECT_TRUE(std::isnan(decode(fp8, b)));
    }
  }
}

// Random data: the bytes are fp8(x * scale) of the recipe, out_t is out transposed, the element
// of largest magnitude lands on +-max, and the dequantised tensor meets DESIGN.md's FP8 gates
// (SNR >= 25 dB e4m3, >= 20 dB e5m2).
TEST_P(QuantizeCpu, RandomMatchesRecipeAndSnrGate) {
  const DType in = GetParam();
  Rng rng;
  ::testing::ScopedTrace seed(__FILE__, __LINE__, "seed " + std::to_string(rng.seed()));
  const int64_t R = 37, C = 100;
  std::vector<float> x(R * C);
  for (float& v : x) v = static_cast<float>(rng.uniform(-1, 1) * std::exp(rng.uniform(-4, 4)));
  HostInput h(in, R, C, C, x);
  std::vector<float> xin(R * C);  // the values the op sees (rounded to bf16 where the input is bf16)
  for (int64_t i = 0; i < R * C; ++i) xin[i] = load_as_float(h.view.data, in, i);
  float amax = 0;
  for (float v : xin) amax = std::max(amax, std::fabs(v));
  for (DType fp8 : {DType::F8E4M3, DType::F8E5M2}) {
    const Result r = quantize(h.view, fp8);
    const float scale = cpu::fp8_max(fp8) / amax;
    EXPECT_EQ(r.scale_inv, 1.0f / scale);
    double sig = 0, err = 0;
    bool hit_max = false;
    for (int64_t i = 0; i < R; ++i)
      for (int64_t j = 0; j < C; ++j) {
        const float v = xin[i * C + j];
        const uint8_t q = r.out[i * C + j];
        ASSERT_EQ(q, encode(fp8, v * scale)) << "element " << i << "," << j;
        ASSERT_EQ(r.out_t[j * R + i], q);
        hit_max = hit_max || std::fabs(decode(fp8, q)) == cpu::fp8_max(fp8);
        const double deq = static_cast<double>(decode(fp8, q)) * r.scale_inv;
        sig += static_cast<double>(v) * v;
        err += (deq - v) * (deq - v);
      }
    EXPECT_TRUE(hit_max);
    const double snr_db = 10 * std::log10(sig / err);
    EXPECT_GE(snr_db, fp8 == DType::F8E4M3 ? 25.0 : 20.0) << dtype_name(fp8);
  }
}

INSTANTIATE_TEST_SUITE_P(Quantize, QuantizeCpu, ::testing::Values(DType::F32, DType::BF16),
                         [](const auto& info) { return std::string(dtype_name(info.param)); });

// ---- argument errors ----------------------------------------------------------------------------

// Runs quantize_fp8 and expects a primus::RuntimeError whose message contains `part`.
void expect_error(const QuantizeFp8Args& a, const std::string& part) {
  try {
    quantize_fp8(a);
    ADD_FAILURE() << "no error; expected one mentioning '" << part << "'";
  } catch (const RuntimeError& e) {
    EXPECT_NE(std::string(e.what()).find(part), std::string::npos) << e.what();
  }
}

TEST(QuantizeCpuErrors, NameTheProblem) {
  std::vector<float> x(6 * 4, 1.0f);
  std::vector<uint8_t> o(64), ot(64);
  std::vector<uint16_t> h(64);
  float si = 0;
  float si2[2] = {0, 0};
  QuantizeFp8Args good;
  good.inp = TensorView(x.data(), DType::F32, Device::CPU, {6, 4});
  good.out = TensorView(o.data(), DType::F8E4M3, Device::CPU, {6, 4});
  good.out_t = TensorView(ot.data(), DType::F8E4M3, Device::CPU, {4, 6});
  good.scale_inv = TensorView(&si, DType::F32, Device::CPU, {1});
  EXPECT_EQ(quantize_fp8(good), BackendType::CPU);

  QuantizeFp8Args a = good;
  a.out = a.out_t = TensorView();
  expect_error(a, "neither out nor out_t");
  a = good;
  a.out.dtype = DType::BF16;
  expect_error(a, "quantize_fp8: out: expected f8e4m3 or f8e5m2 got bf16");
  a = good;
  a.out = TensorView(o.data(), DType::F8E4M3, Device::CPU, {4, 6});
  expect_error(a, "out: expected shape [6, 4]");
  a = good;
  a.out_t = TensorView(ot.data(), DType::F8E4M3, Device::CPU, {6, 4});
  expect_error(a, "out_t: expected shape [4, 6]");
  a = good;
  a.out_t.dtype = DType::F8E5M2;
  expect_error(a, "out is f8e4m3 but out_t is f8e5m2");
  a = good;
  a.out = TensorView(o.data(), DType::F8E4M3, Device::CPU, {4, 6}).transposed();
  expect_error(a, "out: expected a contiguous tensor");
  a = good;
  a.inp = TensorView(h.data(), DType::F16, Device::CPU, {6, 4});
  expect_error(a, "inp: expected f32 or bf16 got f16");
  a = good;
  a.inp = TensorView(x.data(), DType::F32, Device::CPU, {2, 3, 4});
  expect_error(a, "inp: expected a 2-D [R, C] tensor");
  a = good;
  a.inp = TensorView(x.data(), DType::F32, Device::CPU, {4, 6}).transposed();
  expect_error(a, "inp: rows must be contiguous");
  a = good;
  a.inp = TensorView();
  expect_error(a, "inp: tensor is not set");
  a = good;
  a.scale_inv = TensorView();
  expect_error(a, "scale_inv: tensor is not set");
  a = good;
  a.scale_inv = TensorView(h.data(), DType::BF16, Device::CPU, {1});
  expect_error(a, "scale_inv: expected f32 got bf16");
  a = good;
  a.scale_inv = TensorView(si2, DType::F32, Device::CPU, {2});
  expect_error(a, "scale_inv: expected one f32");
  a = good;
  a.out.device = Device::CUDA;
  expect_error(a, "different devices");
}

}  // namespace
}  // namespace primus::turbo
