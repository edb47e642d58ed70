// FP8 quantisation on the host: the conversions of turbo/core/dtype.h (round to nearest even,
// saturation), the scaling recipe of turbo/kernels/cpu/quantize.h, and the public op
// quantize_fp8 (turbo/ops/quantization.h) on host tensors: exact bytes for hand-made inputs,
// transposes, strided rows, NaN/inf, argument errors, and accuracy on random data; per-group
// scaling (rows, 1x128 tiles, 128x128 blocks): the scale layouts of turbo/core/fp8_granularity.h;
// row groups for out_t (per group and column scales) against the recipe written out in the test.
// Also add_gradient (turbo/ops/cast.h), the bf16 rounding of a weight gradient before it is added.
#include <gtest/gtest.h>

#include <algorithm>
#include <cfloat>
#include <cmath>
#include <cstring>
#include <limits>
#include <random>
#include <string>
#include <utility>
#include <vector>

#include "core/util/error.h"
#include "tests/turbo_cpu/op_check.h"
#include "turbo/core/dtype.h"
#include "turbo/kernels/cpu/quantize.h"
#include "turbo/ops/activation.h"
#include "turbo/ops/cast.h"
#include "turbo/ops/fp8_delayed.h"
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
  // Past the largest value, up to and including the values that round up into the next binade
  // (E5M2: 61440 is the tie between 57344 and 65536; E4M3: 480..511 round to 512): all saturate.
  for (int k = 1; k < 64; ++k) {
    const float big = mx * (1.0f + static_cast<float>(k) / 64.0f);
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
  expect_error(a, "scale_inv: tensor scales of a [6, 4] matrix are 1 contiguous f32");
  a = good;
  a.out.device = Device::CUDA;
  expect_error(a, "different devices");
}

}  // namespace

// ---- per-group scaling (rows, 1x128 tiles, 128x128 blocks) -------------------------------------
// Helpers in a named namespace: the CPU test binaries are unity builds.
namespace fp8_group_test {

using G = Fp8Granularity;

float round_bf16(float x) { return bf16_bits_to_float(float_to_bf16_bits(x)); }

// The scale index of element (r, c) of an [R, C] matrix as fp8_granularity.h documents it,
// written out here instead of calling fp8_scale_index (which the tests check it against).
int64_t documented_index(G g, int64_t R, int64_t C, int64_t r, int64_t c) {
  switch (g) {
    case G::Tensor: return 0;
    case G::Row: return r;
    case G::Block1x128: return (c / 128) * R + r;
    case G::Block128x128: return (r / 128) * ((C / 128 + 3) / 4 * 4) + c / 128;
  }
  return -1;
}
int64_t documented_numel(G g, int64_t R, int64_t C) {
  switch (g) {
    case G::Tensor: return 1;
    case G::Row: return R;
    case G::Block1x128: return (C / 128) * R;
    case G::Block128x128: return (R / 128) * ((C / 128 + 3) / 4 * 4);
  }
  return -1;
}

constexpr float kUnwritten = -7.0f;  // what the scale tensors hold before the op runs

struct GroupedResult {
  std::vector<uint8_t> out, out_t;
  std::vector<float> scale_inv, scale_inv_t;
};

// turbo::quantize_fp8 on a host [R, C] input at granularity g, both outputs (or one of them).
GroupedResult quantize_grouped(const TensorView& inp, G g, DType fp8, bool want_out = true, bool want_t = true) {
  const int64_t R = inp.size(0), C = inp.size(1);
  GroupedResult r;
  r.out.assign(static_cast<size_t>(R * C), 0xAB);
  r.out_t.assign(static_cast<size_t>(R * C), 0xAB);
  r.scale_inv.assign(static_cast<size_t>(documented_numel(g, R, C)), kUnwritten);
  r.scale_inv_t.assign(static_cast<size_t>(documented_numel(g, C, R)), kUnwritten);
  QuantizeFp8Args a;
  a.inp = inp;
  a.granularity = g;
  if (want_out) a.out = TensorView(r.out.data(), fp8, Device::CPU, {R, C});
  if (want_t) a.out_t = TensorView(r.out_t.data(), fp8, Device::CPU, {C, R});
  a.scale_inv = TensorView(r.scale_inv.data(), DType::F32, Device::CPU, {static_cast<int64_t>(r.scale_inv.size())});
  if (g != G::Tensor)
    a.scale_inv_t =
        TensorView(r.scale_inv_t.data(), DType::F32, Device::CPU, {static_cast<int64_t>(r.scale_inv_t.size())});
  EXPECT_EQ(quantize_fp8(a), BackendType::CPU);
  return r;
}

struct Dims {
  G g;
  int64_t R, C;
};
void PrintTo(const Dims& d, std::ostream* os) { *os << fp8_granularity_name(d.g) << " [" << d.R << ", " << d.C << "]"; }
std::string dims_name(const ::testing::TestParamInfo<Dims>& info) {
  const char* n = info.param.g == G::Row ? "Row" : info.param.g == G::Block1x128 ? "Block1x128" : "Block128x128";
  return std::string(n) + "_" + std::to_string(info.param.R) + "x" + std::to_string(info.param.C);
}

// Small values (|x| < 0.02, never zero) everywhere.
std::vector<float> small_values(int64_t R, int64_t C) {
  std::vector<float> x(static_cast<size_t>(R * C));
  for (int64_t i = 0; i < R * C; ++i) x[i] = 0.019f * std::sin(0.37f * static_cast<float>(i) + 0.1f);
  return x;
}

// The planted amax of group k: a power of two times a factor distinct per group (3, 4, 5, ...),
// always above the small values, so each group's scale is different.
float planted_amax(int64_t k) { return std::ldexp(3.0f + static_cast<float>(k), static_cast<int>(k % 5) - 4); }

class QuantizeGrouped : public ::testing::TestWithParam<Dims> {};

// Each group holds one planted element of known magnitude (alternating sign) among small values:
// the op's scale_inv at the documented index is exactly the recipe's 1 / (448 / amax), padding
// entries are 1, the planted element lands on +-448 (0x7e / 0xfe), every byte is fp8(x * scale)
// and decodes back to x within e4m3 rounding.
TEST_P(QuantizeGrouped, PlantedAmaxPerGroup) {
  const auto [g, R, C] = GetParam();
  const int64_t groups = documented_numel(g, R, C);
  ASSERT_EQ(fp8_scale_numel(g, R, C), groups);
  std::vector<float> x = small_values(R, C);
  // The members of each group in row-major order, by the documented index.
  std::vector<std::vector<int64_t>> members(static_cast<size_t>(groups));
  for (int64_t r = 0; r < R; ++r)
    for (int64_t c = 0; c < C; ++c) {
      const int64_t k = documented_index(g, R, C, r, c);
      ASSERT_EQ(fp8_scale_index(g, R, C, r, c), k) << r << "," << c;
      members[static_cast<size_t>(k)].push_back(r * C + c);
    }
  std::vector<int64_t> planted(static_cast<size_t>(groups), -1);
  for (int64_t k = 0; k < groups; ++k) {
    const auto& m = members[static_cast<size_t>(k)];
    if (m.empty()) continue;  // a padding entry
    const int64_t at = m[static_cast<size_t>((k * 37 + 11) % static_cast<int64_t>(m.size()))];
    planted[static_cast<size_t>(k)] = at;
    x[at] = (k % 2 ? -1.0f : 1.0f) * planted_amax(k);
  }
  HostInput h(DType::F32, R, C, C, x);
  const GroupedResult res = quantize_grouped(h.view, g, DType::F8E4M3, true, false);
  int padding = 0;
  for (int64_t k = 0; k < groups; ++k) {
    const float got = res.scale_inv[static_cast<size_t>(k)];
    if (planted[static_cast<size_t>(k)] < 0) {
      EXPECT_EQ(got, 1.0f) << "padding entry " << k;
      ++padding;
      continue;
    }
    const float amax = planted_amax(k);
    EXPECT_EQ(got, 1.0f / (448.0f / amax)) << "group " << k << " amax " << amax;
    EXPECT_EQ(res.out[static_cast<size_t>(planted[static_cast<size_t>(k)])], k % 2 ? 0xfe : 0x7e) << "group " << k;
  }
  // Block128x128 of 256 x 384: 3 column blocks padded to 4, one padding entry per block row.
  EXPECT_EQ(padding, g == G::Block128x128 ? (R / 128) * ((C / 128 + 3) / 4 * 4 - C / 128) : 0);
  for (int64_t r = 0; r < R; ++r)
    for (int64_t c = 0; c < C; ++c) {
      const int64_t k = documented_index(g, R, C, r, c);
      const float amax = planted_amax(k), v = x[r * C + c];
      const uint8_t q = res.out[r * C + c];
      ASSERT_EQ(q, float_to_f8e4m3_bits(v * (448.0f / amax))) << r << "," << c;
      const float sinv = res.scale_inv[static_cast<size_t>(k)];
      const double back = static_cast<double>(f8e4m3_bits_to_float(q)) * sinv;
      // e4m3 keeps 3 mantissa bits: half an ulp is at most 2^-4 of |x| for normals, and half the
      // smallest subnormal (2^-10 in the scaled domain) below.
      const double tol = std::fabs(v) * 0x1.01p-4 + 0x1.01p-10 * sinv;
      ASSERT_NEAR(back, v, tol) << r << "," << c;
    }
}

// out_t is the quantisation of inp^T at the same granularity: the same bytes and scales as
// quantizing an explicitly transposed copy (requested with out_t alone, and with both).
TEST_P(QuantizeGrouped, TransposedOutputEqualsQuantizedTranspose) {
  const auto [g, R, C] = GetParam();
  Rng rng;
  ::testing::ScopedTrace seed(__FILE__, __LINE__, "seed " + std::to_string(rng.seed()));
  std::vector<float> x(static_cast<size_t>(R * C)), xt(static_cast<size_t>(R * C));
  for (float& v : x) v = static_cast<float>(rng.uniform(-1, 1) * std::exp(rng.uniform(-3, 3)));
  for (int64_t r = 0; r < R; ++r)
    for (int64_t c = 0; c < C; ++c) xt[c * R + r] = x[r * C + c];
  HostInput h(DType::F32, R, C, C, x), ht(DType::F32, C, R, R, xt);
  for (DType fp8 : {DType::F8E4M3, DType::F8E5M2}) {
    const GroupedResult ref = quantize_grouped(ht.view, g, fp8, true, false);  // inp^T as a matrix of its own
    const GroupedResult both = quantize_grouped(h.view, g, fp8);
    const GroupedResult only_t = quantize_grouped(h.view, g, fp8, false, true);
    EXPECT_EQ(both.out_t, ref.out) << dtype_name(fp8);
    EXPECT_EQ(both.scale_inv_t, ref.scale_inv) << dtype_name(fp8);
    EXPECT_EQ(only_t.out_t, ref.out) << dtype_name(fp8);
    EXPECT_EQ(only_t.scale_inv_t, ref.scale_inv) << dtype_name(fp8);
    // out alone is untouched by the out_t-only call, and its scale tensor too.
    EXPECT_EQ(only_t.out, std::vector<uint8_t>(static_cast<size_t>(R * C), 0xAB));
    EXPECT_EQ(only_t.scale_inv, std::vector<float>(only_t.scale_inv.size(), kUnwritten));
  }
}

// A NaN in one group poisons that group only: its scale_inv is NaN (0x7fc00000) and all its bytes
// 0x7f; every other group's bytes and scales equal those of the clean input. Same for out_t,
// whose group holding the NaN is found by the documented index of the transposed matrix.
TEST_P(QuantizeGrouped, NanPoisonsOnlyItsGroup) {
  const auto [g, R, C] = GetParam();
  Rng rng;
  ::testing::ScopedTrace seed(__FILE__, __LINE__, "seed " + std::to_string(rng.seed()));
  std::vector<float> x = rng.vec<float>(static_cast<size_t>(R * C), -2, 2);
  const int64_t r0 = R - 2, c0 = C / 2 + 1;
  HostInput clean_in(DType::F32, R, C, C, x);
  x[r0 * C + c0] = NAN;
  HostInput bad_in(DType::F32, R, C, C, x);
  const GroupedResult clean = quantize_grouped(clean_in.view, g, DType::F8E4M3);
  const GroupedResult bad = quantize_grouped(bad_in.view, g, DType::F8E4M3);
  const int64_t k0 = documented_index(g, R, C, r0, c0), kt0 = documented_index(g, C, R, c0, r0);
  int poisoned = 0, poisoned_t = 0;
  for (int64_t r = 0; r < R; ++r)
    for (int64_t c = 0; c < C; ++c) {
      const uint8_t q = bad.out[r * C + c], qt = bad.out_t[c * R + r];
      if (documented_index(g, R, C, r, c) == k0) {
        ASSERT_EQ(q, cpu::kFp8PoisonByte) << r << "," << c;
        ++poisoned;
      } else {
        ASSERT_EQ(q, clean.out[r * C + c]) << r << "," << c;
      }
      if (documented_index(g, C, R, c, r) == kt0) {
        ASSERT_EQ(qt, cpu::kFp8PoisonByte) << "out_t " << c << "," << r;
        ++poisoned_t;
      } else {
        ASSERT_EQ(qt, clean.out_t[c * R + r]) << "out_t " << c << "," << r;
      }
    }
  // The group sizes: a row of C (Row), 128 (1x128), 128 * 128 (128x128); out_t's rows are R long.
  const int64_t want = g == G::Row ? C : g == G::Block1x128 ? 128 : 128 * 128;
  const int64_t want_t = g == G::Row ? R : g == G::Block1x128 ? 128 : 128 * 128;
  EXPECT_EQ(poisoned, want);
  EXPECT_EQ(poisoned_t, want_t);
  for (size_t k = 0; k < bad.scale_inv.size(); ++k) {
    if (static_cast<int64_t>(k) == k0)
      EXPECT_EQ(bits(bad.scale_inv[k]), 0x7fc00000u);
    else
      EXPECT_EQ(bits(bad.scale_inv[k]), bits(clean.scale_inv[k])) << "scale " << k;
  }
  for (size_t k = 0; k < bad.scale_inv_t.size(); ++k) {
    if (static_cast<int64_t>(k) == kt0)
      EXPECT_EQ(bits(bad.scale_inv_t[k]), 0x7fc00000u);
    else
      EXPECT_EQ(bits(bad.scale_inv_t[k]), bits(clean.scale_inv_t[k])) << "scale_t " << k;
  }
}

// bf16 input: the same bytes and scales as the f32 input holding the bf16-rounded values, and the
// scales are those of the rounded group maxima.
TEST_P(QuantizeGrouped, Bf16InputMatchesRoundedF32) {
  const auto [g, R, C] = GetParam();
  Rng rng;
  ::testing::ScopedTrace seed(__FILE__, __LINE__, "seed " + std::to_string(rng.seed()));
  std::vector<float> x(static_cast<size_t>(R * C)), xr(static_cast<size_t>(R * C));
  for (size_t i = 0; i < x.size(); ++i) {
    x[i] = static_cast<float>(rng.uniform(-1, 1) * std::exp(rng.uniform(-3, 3)));
    xr[i] = round_bf16(x[i]);
  }
  HostInput hb(DType::BF16, R, C, C, x), hf(DType::F32, R, C, C, xr);
  for (DType fp8 : {DType::F8E4M3, DType::F8E5M2}) {
    const GroupedResult b = quantize_grouped(hb.view, g, fp8), f = quantize_grouped(hf.view, g, fp8);
    EXPECT_EQ(b.out, f.out) << dtype_name(fp8);
    EXPECT_EQ(b.out_t, f.out_t) << dtype_name(fp8);
    EXPECT_EQ(b.scale_inv, f.scale_inv) << dtype_name(fp8);
    EXPECT_EQ(b.scale_inv_t, f.scale_inv_t) << dtype_name(fp8);
    std::vector<float> amax(b.scale_inv.size(), 0.0f);
    for (int64_t r = 0; r < R; ++r)
      for (int64_t c = 0; c < C; ++c) {
        float& m = amax[static_cast<size_t>(documented_index(g, R, C, r, c))];
        m = std::max(m, std::fabs(xr[r * C + c]));
      }
    for (size_t k = 0; k < amax.size(); ++k)
      EXPECT_EQ(b.scale_inv[k], amax[k] == 0.0f ? 1.0f : 1.0f / (cpu::fp8_max(fp8) / amax[k])) << k;
  }
}

INSTANTIATE_TEST_SUITE_P(Quantize, QuantizeGrouped,
                         ::testing::Values(Dims{G::Row, 4, 32}, Dims{G::Block1x128, 256, 384},
                                           Dims{G::Block128x128, 256, 384}),
                         dims_name);

// 128x128 blocks of inp^T are the blocks of inp transposed: out_t's bytes are out's bytes
// transposed and scale_inv_t holds the same values at the transposed block positions (the
// [3, pad4(2)] layout of a 384 x 256 matrix, padding 1).
TEST(QuantizeGrouped128, TransposeIsTheSameBlocksTransposed) {
  const int64_t R = 256, C = 384;
  Rng rng;
  ::testing::ScopedTrace seed(__FILE__, __LINE__, "seed " + std::to_string(rng.seed()));
  std::vector<float> x(static_cast<size_t>(R * C));
  for (size_t i = 0; i < x.size(); ++i) x[i] = static_cast<float>(rng.uniform(-1, 1) * std::exp(rng.uniform(-3, 3)));
  HostInput h(DType::F32, R, C, C, x);
  const GroupedResult res = quantize_grouped(h.view, G::Block128x128, DType::F8E4M3);
  ASSERT_EQ(res.scale_inv.size(), 2u * 4u);
  ASSERT_EQ(res.scale_inv_t.size(), 3u * 4u);
  for (int64_t r = 0; r < R; ++r)
    for (int64_t c = 0; c < C; ++c) ASSERT_EQ(res.out_t[c * R + r], res.out[r * C + c]) << r << "," << c;
  for (int64_t rb = 0; rb < 2; ++rb)
    for (int64_t cb = 0; cb < 3; ++cb) {
      EXPECT_EQ(res.scale_inv_t[cb * 4 + rb], res.scale_inv[rb * 4 + cb]) << rb << "," << cb;
      EXPECT_NE(res.scale_inv[rb * 4 + cb], 1.0f);  // random data: a real scale, not the padding value
    }
  for (int64_t cb = 0; cb < 3; ++cb)
    for (int64_t pad : {2, 3}) EXPECT_EQ(res.scale_inv_t[cb * 4 + pad], 1.0f) << cb << "," << pad;
  for (int64_t rb = 0; rb < 2; ++rb) EXPECT_EQ(res.scale_inv[rb * 4 + 3], 1.0f) << rb;
}

// Argument errors of the grouped form name the tensor and the expected size.
TEST(QuantizeGroupedErrors, NameTheProblem) {
  std::vector<float> x(256 * 384, 1.0f), s(4096);
  std::vector<uint8_t> o(256 * 384), ot(256 * 384);
  QuantizeFp8Args good;
  good.granularity = G::Row;
  good.inp = TensorView(x.data(), DType::F32, Device::CPU, {4, 32});
  good.out = TensorView(o.data(), DType::F8E4M3, Device::CPU, {4, 32});
  good.out_t = TensorView(ot.data(), DType::F8E4M3, Device::CPU, {32, 4});
  good.scale_inv = TensorView(s.data(), DType::F32, Device::CPU, {4});
  good.scale_inv_t = TensorView(s.data() + 64, DType::F32, Device::CPU, {32});
  EXPECT_EQ(quantize_fp8(good), BackendType::CPU);

  QuantizeFp8Args a = good;
  a.scale_inv = TensorView(s.data(), DType::F32, Device::CPU, {1});  // a tensorwise scale at Row granularity
  expect_error(a, "scale_inv: row scales of a [4, 32] matrix are 4 contiguous f32");
  a = good;
  a.scale_inv_t = TensorView(s.data() + 64, DType::F32, Device::CPU, {4});  // out's size, not out_t's
  expect_error(a, "scale_inv_t: row scales of a [32, 4] matrix are 32 contiguous f32");
  a = good;
  a.scale_inv_t = TensorView();
  expect_error(a, "scale_inv_t: tensor is not set");
  // The block granularities: the dims must be multiples of 128 (here R = 100).
  for (G g : {G::Block1x128, G::Block128x128}) {
    a = QuantizeFp8Args();
    a.granularity = g;
    a.inp = TensorView(x.data(), DType::F32, Device::CPU, {100, 128});
    a.out = TensorView(o.data(), DType::F8E4M3, Device::CPU, {100, 128});
    a.scale_inv = TensorView(s.data(), DType::F32, Device::CPU, {100});
    expect_error(a, std::string(fp8_granularity_name(g)) + " blocks need both dimensions of inp to be multiples of 128");
    try {
      cpu::quantize_fp8_grouped(x.data(), DType::F32, 100, 128, 128, g, o.data(), s.data(), nullptr, nullptr,
                                DType::F8E4M3);
      ADD_FAILURE() << "cpu::quantize_fp8_grouped accepted 100 x 128 at " << fp8_granularity_name(g);
    } catch (const RuntimeError& e) {
      EXPECT_NE(std::string(e.what()).find("multiples of 128, got [100, 128]"), std::string::npos) << e.what();
    }
  }
  // 128x128 of a 256 x 384 matrix: [2, pad4(3)] = 8 scales; out_t's [3, pad4(2)] = 12.
  a = QuantizeFp8Args();
  a.granularity = G::Block128x128;
  a.inp = TensorView(x.data(), DType::F32, Device::CPU, {256, 384});
  a.out = TensorView(o.data(), DType::F8E4M3, Device::CPU, {256, 384});
  a.out_t = TensorView(ot.data(), DType::F8E4M3, Device::CPU, {384, 256});
  a.scale_inv = TensorView(s.data(), DType::F32, Device::CPU, {8});
  a.scale_inv_t = TensorView(s.data() + 64, DType::F32, Device::CPU, {12});
  EXPECT_EQ(quantize_fp8(a), BackendType::CPU);
  a.scale_inv = TensorView(s.data(), DType::F32, Device::CPU, {6});  // unpadded 2 x 3
  expect_error(a, "scale_inv: 128x128 scales of a [256, 384] matrix are 8 contiguous f32");
  a.scale_inv = TensorView(s.data(), DType::F32, Device::CPU, {8});
  a.scale_inv_t = TensorView(s.data() + 64, DType::F32, Device::CPU, {8});
  expect_error(a, "scale_inv_t: 128x128 scales of a [384, 256] matrix are 12 contiguous f32");
}

// Row and tensor scaling with the producer's maxima (QuantizeFp8Args::maxima): the SwiGLU
// backward's maxima of dgate_up give the same bytes and scales as the quantizer's own pass; maxima
// that are not inp's are refused by the host backend naming the row or column; the arguments they
// need.
TEST(QuantizeRowMaxima, TheProducersMaximaGiveTheSameResultAndWrongOnesAreNamed) {
  constexpr int64_t N = 24, F = 40;  // dgate_up [24, 80]
  std::mt19937 rng(7);
  std::normal_distribution<float> nd(0.0f, 1.5f);
  std::vector<float> gu(N * 2 * F), dy(N * F), dgu(N * 2 * F), mx(N + 2 * F + 1, -1.0f);
  for (auto& v : gu) v = nd(rng);
  for (auto& v : dy) v = nd(rng);
  ActivationBackwardArgs b;
  b.act = Activation::SwiGLU;
  b.dinp = TensorView(dgu.data(), DType::F32, Device::CPU, {N, 2 * F});
  b.inp = TensorView(gu.data(), DType::F32, Device::CPU, {N, 2 * F});
  b.dout = TensorView(dy.data(), DType::F32, Device::CPU, {N, F});
  b.maxima = TensorView(mx.data(), DType::F32, Device::CPU, {N + 2 * F + 1});
  ASSERT_EQ(activation_backward(b), BackendType::CPU);
  float all = 0;
  for (float v : dgu) all = std::max(all, std::fabs(v));
  ASSERT_EQ(mx[N + 2 * F], all) << "the whole tensor's";
  const TensorView rows_cols(mx.data(), DType::F32, Device::CPU, {N + 2 * F}),
      whole(mx.data() + N + 2 * F, DType::F32, Device::CPU, {1});
  for (int64_t r = 0; r < N; ++r) {
    float m = 0;
    for (int64_t c = 0; c < 2 * F; ++c) m = std::max(m, std::fabs(dgu[r * 2 * F + c]));
    ASSERT_EQ(mx[r], m) << "row " << r;
  }
  for (int64_t c = 0; c < 2 * F; ++c) {
    float m = 0;
    for (int64_t r = 0; r < N; ++r) m = std::max(m, std::fabs(dgu[r * 2 * F + c]));
    ASSERT_EQ(mx[N + c], m) << "column " << c;
  }
  struct Out {
    std::vector<uint8_t> q, qt;
    std::vector<float> s, st;
  };
  const auto run = [&](const TensorView& maxima, Out* o) {
    o->q.assign(N * 2 * F, 0);
    o->qt.assign(N * 2 * F, 0);
    o->s.assign(N, 0.0f);
    o->st.assign(2 * F, 0.0f);
    QuantizeFp8Args a;
    a.granularity = G::Row;
    a.inp = b.dinp;
    a.out = TensorView(o->q.data(), DType::F8E5M2, Device::CPU, {N, 2 * F});
    a.out_t = TensorView(o->qt.data(), DType::F8E5M2, Device::CPU, {2 * F, N});
    a.scale_inv = TensorView(o->s.data(), DType::F32, Device::CPU, {N});
    a.scale_inv_t = TensorView(o->st.data(), DType::F32, Device::CPU, {2 * F});
    a.maxima = maxima;
    return a;
  };
  Out plain, fed;
  EXPECT_EQ(quantize_fp8(run({}, &plain)), BackendType::CPU);
  EXPECT_EQ(quantize_fp8(run(rows_cols, &fed)), BackendType::CPU);
  EXPECT_EQ(plain.q, fed.q);
  EXPECT_EQ(plain.qt, fed.qt);
  EXPECT_EQ(plain.s, fed.s);
  EXPECT_EQ(plain.st, fed.st);
  // Tensor granularity takes the whole tensor's maximum.
  const auto tensorwise = [&](const TensorView& maxima, Out* o) {
    QuantizeFp8Args a = run(maxima, o);
    a.granularity = G::Tensor;
    a.scale_inv = TensorView(o->s.data(), DType::F32, Device::CPU, {1});
    a.scale_inv_t = TensorView();
    return a;
  };
  EXPECT_EQ(quantize_fp8(tensorwise({}, &plain)), BackendType::CPU);
  EXPECT_EQ(quantize_fp8(tensorwise(whole, &fed)), BackendType::CPU);
  EXPECT_EQ(plain.q, fed.q);
  EXPECT_EQ(plain.qt, fed.qt);
  EXPECT_EQ(plain.s[0], fed.s[0]);
  float wrong_all = all * 0.5f;
  expect_error(tensorwise(TensorView(&wrong_all, DType::F32, Device::CPU, {1}), &fed), "maxima: inp");
  // A producer that got one maximum wrong is named by the reference.
  std::vector<float> wrong = mx;
  wrong[3] *= 2.0f;
  expect_error(run(TensorView(wrong.data(), DType::F32, Device::CPU, {N + 2 * F}), &fed), "maxima: row 3 of inp");
  wrong = mx;
  wrong[N + 5] = 0.0f;
  expect_error(run(TensorView(wrong.data(), DType::F32, Device::CPU, {N + 2 * F}), &fed), "maxima: column 5 of inp");
  // What they serve: Row granularity with out_t, the right size.
  QuantizeFp8Args a = run(TensorView(mx.data(), DType::F32, Device::CPU, {N + 2 * F - 1}), &fed);
  expect_error(a, "maxima: the row and column maxima of a [24, 80] matrix are 104 contiguous f32");
  a = run(rows_cols, &fed);
  a.out_t = TensorView();
  a.scale_inv_t = TensorView();
  expect_error(a, "maxima serve Row granularity with out_t or Tensor granularity");
  expect_error(tensorwise(rows_cols, &fed), "maxima: the maximum of a [24, 80] matrix is 1 contiguous f32");
  a = run(rows_cols, &fed);
  a.granularity = G::Block1x128;
  expect_error(a, "got 1x128 granularity");
  // The activation refuses maxima of the wrong size.
  b.maxima = TensorView(mx.data(), DType::F32, Device::CPU, {N + 2 * F});
  EXPECT_THROW(activation_backward(b), RuntimeError);
}

}  // namespace fp8_group_test

// ---- row groups for out_t (the weight-gradient operands of MoE grouped GEMMs) -------------------
namespace fp8_row_groups_test {

using cpu::testing::Rng;

constexpr uint8_t kSentinel = 0xAB;  // what out / out_t hold before the op runs
constexpr float kUnset = -7.0f;      // what the scale tensors hold before the op runs

uint32_t bits_of(float f) {
  uint32_t u;
  std::memcpy(&u, &f, 4);
  return u;
}
uint8_t enc(DType t, float x) { return t == DType::F8E4M3 ? float_to_f8e4m3_bits(x) : float_to_f8e5m2_bits(x); }
float as_bf16(float x) { return bf16_bits_to_float(float_to_bf16_bits(x)); }

struct Quantized {
  std::vector<uint8_t> out, out_t;
  std::vector<float> scale_inv, scale_inv_t;
};

// out_t and scale_inv_t as quantization.h states them, computed here straight from the recipe:
// per group and column, amax = max |x| over the group's rows, scale = fp8_max / amax (1 for
// amax 0, FLT_MAX when that overflows), bytes fp8(x * scale), scale_inv 1 / scale; an inf or NaN
// in the segment: scale_inv NaN and bytes 0x7f. x: the values as the op reads them, [R, C].
Quantized expected(const std::vector<float>& x, int64_t R, int64_t C, const std::vector<int32_t>& offsets, DType fp8) {
  const int64_t G = static_cast<int64_t>(offsets.size()) - 1;
  const float fp8_max = fp8 == DType::F8E4M3 ? 448.0f : 57344.0f;
  Quantized e;
  e.out_t.assign(static_cast<size_t>(R * C), kSentinel);
  e.scale_inv_t.assign(static_cast<size_t>(G * C), kUnset);
  for (int64_t g = 0; g < G; ++g)
    for (int64_t c = 0; c < C; ++c) {
      float amax = 0.0f;
      bool finite = true;
      for (int64_t r = offsets[g]; r < offsets[g + 1]; ++r) {
        const float v = x[r * C + c];
        finite = finite && std::isfinite(v);
        amax = std::max(amax, std::fabs(v));
      }
      float& inv = e.scale_inv_t[g * C + c];
      if (!finite) {
        inv = std::numeric_limits<float>::quiet_NaN();
        for (int64_t r = offsets[g]; r < offsets[g + 1]; ++r) e.out_t[c * R + r] = 0x7f;
        continue;
      }
      float scale = amax == 0.0f ? 1.0f : fp8_max / amax;
      if (std::isinf(scale)) scale = FLT_MAX;
      inv = 1.0f / scale;
      for (int64_t r = offsets[g]; r < offsets[g + 1]; ++r) e.out_t[c * R + r] = enc(fp8, x[r * C + c] * scale);
    }
  return e;
}

// quantize_fp8 at Row granularity with row groups (offsets, or group_rows when offsets is null),
// out_t and, with_out, out; every output pre-filled.
Quantized run(const TensorView& inp, DType fp8, const std::vector<int32_t>* offsets, int64_t group_rows,
              bool with_out) {
  const int64_t R = inp.size(0), C = inp.size(1);
  const int64_t G = offsets ? static_cast<int64_t>(offsets->size()) - 1 : R / group_rows;
  Quantized q;
  q.out.assign(static_cast<size_t>(R * C), kSentinel);
  q.out_t.assign(static_cast<size_t>(R * C), kSentinel);
  q.scale_inv.assign(static_cast<size_t>(R), kUnset);
  q.scale_inv_t.assign(static_cast<size_t>(G * C), kUnset);
  QuantizeFp8Args a;
  a.inp = inp;
  a.granularity = Fp8Granularity::Row;
  a.out_t = TensorView(q.out_t.data(), fp8, Device::CPU, {C, R});
  a.scale_inv_t = TensorView(q.scale_inv_t.data(), DType::F32, Device::CPU, {G, C});
  if (offsets)
    a.offsets = TensorView(const_cast<int32_t*>(offsets->data()), DType::I32, Device::CPU, {G + 1});
  else
    a.group_rows = group_rows;
  if (with_out) {
    a.out = TensorView(q.out.data(), fp8, Device::CPU, {R, C});
    a.scale_inv = TensorView(q.scale_inv.data(), DType::F32, Device::CPU, {R});
  }
  EXPECT_EQ(quantize_fp8(a), BackendType::CPU);
  return q;
}

// out and scale_inv of the plain Row granularity call (no groups): what out must be with groups.
Quantized rowwise(const TensorView& inp, DType fp8) {
  const int64_t R = inp.size(0), C = inp.size(1);
  Quantized q;
  q.out.assign(static_cast<size_t>(R * C), kSentinel);
  q.scale_inv.assign(static_cast<size_t>(R), kUnset);
  QuantizeFp8Args a;
  a.inp = inp;
  a.granularity = Fp8Granularity::Row;
  a.out = TensorView(q.out.data(), fp8, Device::CPU, {R, C});
  a.scale_inv = TensorView(q.scale_inv.data(), DType::F32, Device::CPU, {R});
  EXPECT_EQ(quantize_fp8(a), BackendType::CPU);
  return q;
}

void expect_same_bits(const std::vector<float>& got, const std::vector<float>& want, const char* what) {
  ASSERT_EQ(got.size(), want.size()) << what;
  for (size_t k = 0; k < got.size(); ++k)
    ASSERT_EQ(bits_of(got[k]), bits_of(want[k])) << what << "[" << k << "] " << got[k] << " vs " << want[k];
}

class QuantizeRowGroups : public ::testing::TestWithParam<DType> {};  // parameter: the input dtype

// Groups of every awkward size (empty first and middle groups, one row, sizes that are not
// multiples of 16, rows past offsets[G]), strided rows, a column of zeros in one group (scale 1)
// and one of f32 subnormals in another (scale FLT_MAX): out_t and scale_inv_t equal the recipe
// computed here, out_t's bytes at rows of no group keep the sentinel, and out / scale_inv (when
// requested) equal the plain per-row call's.
TEST_P(QuantizeRowGroups, MatchesTheRecipePerGroupAndColumn) {
  const DType in = GetParam();
  Rng rng;
  ::testing::ScopedTrace seed(__FILE__, __LINE__, "seed " + std::to_string(rng.seed()));
  struct Layout {
    int64_t R, C, ld;
    std::vector<int32_t> offsets;
  };
  std::vector<Layout> layouts = {{50, 24, 24, {0, 0, 1, 17, 17, 40}}, {33, 16, 20, {0, 33}}};
  for (int k = 0; k < 3; ++k) {  // random sizes, some of them 0, and a random tail of no group
    Layout l{0, rng.integer(1, 40), 0, {0}};
    const int G = rng.integer(1, 9);
    for (int g = 0; g < G; ++g) {
      const int32_t rows = rng.integer(0, 3) == 0 ? 0 : rng.integer(1, 21);  // a quarter of them empty
      l.offsets.push_back(l.offsets.back() + rows);
    }
    l.R = std::max(1, l.offsets.back() + rng.integer(0, 5));
    l.ld = l.C + rng.integer(0, 3);
    layouts.push_back(l);
  }
  for (const Layout& l : layouts) {
    const int64_t G = static_cast<int64_t>(l.offsets.size()) - 1;
    SCOPED_TRACE(::testing::Message() << "[" << l.R << ", " << l.C << "] ld " << l.ld << ", " << G
                                      << " groups ending at " << l.offsets.back());
    std::vector<float> x(static_cast<size_t>(l.R * l.C));
    for (float& v : x) v = static_cast<float>(rng.uniform(-1, 1) * std::exp(rng.uniform(-4, 4)));
    // The first group with at least two rows gets a column of zeros; the last one with rows a
    // column of f32 subnormals.
    for (int64_t g = 0; g < G; ++g)
      if (l.offsets[g + 1] - l.offsets[g] >= 2) {
        for (int64_t r = l.offsets[g]; r < l.offsets[g + 1]; ++r) x[r * l.C + l.C / 2] = 0.0f;
        break;
      }
    for (int64_t g = G - 1; g >= 0; --g)
      if (l.offsets[g + 1] > l.offsets[g]) {
        for (int64_t r = l.offsets[g]; r < l.offsets[g + 1]; ++r) x[r * l.C] = (r % 2 ? 3e-39f : -1e-40f);
        break;
      }
    if (in == DType::BF16)
      for (float& v : x) v = as_bf16(v);
    HostInput h(in, l.R, l.C, l.ld, x, NAN);  // the gaps between rows must not be read
    for (DType fp8 : {DType::F8E4M3, DType::F8E5M2}) {
      SCOPED_TRACE(std::string(dtype_name(fp8)));
      const Quantized want = expected(x, l.R, l.C, l.offsets, fp8);
      const Quantized plain = rowwise(h.view, fp8);
      for (const bool with_out : {false, true}) {
        SCOPED_TRACE(with_out ? "with out" : "out_t alone");
        const Quantized got = run(h.view, fp8, &l.offsets, 0, with_out);
        EXPECT_EQ(got.out_t, want.out_t);
        expect_same_bits(got.scale_inv_t, want.scale_inv_t, "scale_inv_t");
        for (int64_t r = l.offsets.back(); r < l.R; ++r)
          for (int64_t c = 0; c < l.C; ++c) ASSERT_EQ(got.out_t[c * l.R + r], kSentinel) << "row of no group " << r;
        for (int64_t g = 0; g < G; ++g) {
          if (l.offsets[g] != l.offsets[g + 1]) continue;
          for (int64_t c = 0; c < l.C; ++c) ASSERT_EQ(got.scale_inv_t[g * l.C + c], 1.0f) << "empty group " << g;
        }
        if (with_out) {
          EXPECT_EQ(got.out, plain.out);
          expect_same_bits(got.scale_inv, plain.scale_inv, "scale_inv");
        } else {
          EXPECT_EQ(got.out, std::vector<uint8_t>(got.out.size(), kSentinel));
          EXPECT_EQ(got.scale_inv, std::vector<float>(got.scale_inv.size(), kUnset));
        }
      }
    }
  }
}

INSTANTIATE_TEST_SUITE_P(Quantize, QuantizeRowGroups, ::testing::Values(DType::F32, DType::BF16),
                         [](const auto& info) { return std::string(dtype_name(info.param)); });

// A NaN in one group's column and an inf in a row of no group: only that (group, column)
// segment of out_t is poisoned (scale_inv_t NaN, bytes 0x7f); every other byte and scale equals
// the clean input's; out is poisoned in the two rows holding them.
TEST(QuantizeRowGroupsNonFinite, PoisonsOnlyItsSegment) {
  const int64_t R = 22, C = 8;
  const std::vector<int32_t> offsets = {0, 5, 12, 20};  // rows 20, 21 in no group
  Rng rng;
  ::testing::ScopedTrace seed(__FILE__, __LINE__, "seed " + std::to_string(rng.seed()));
  std::vector<float> x = rng.vec<float>(static_cast<size_t>(R * C), -3, 3);
  HostInput clean_in(DType::F32, R, C, C, x);
  x[7 * C + 3] = NAN;
  x[21 * C + 5] = INFINITY;
  HostInput bad_in(DType::F32, R, C, C, x);
  const Quantized clean = run(clean_in.view, DType::F8E4M3, &offsets, 0, true);
  const Quantized bad = run(bad_in.view, DType::F8E4M3, &offsets, 0, true);
  const Quantized want = expected(x, R, C, offsets, DType::F8E4M3);
  EXPECT_EQ(bad.out_t, want.out_t);
  expect_same_bits(bad.scale_inv_t, want.scale_inv_t, "scale_inv_t");
  for (int64_t g = 0; g < 3; ++g)
    for (int64_t c = 0; c < C; ++c) {
      const size_t k = static_cast<size_t>(g * C + c);
      if (g == 1 && c == 3) EXPECT_EQ(bits_of(bad.scale_inv_t[k]), 0x7fc00000u);
      else EXPECT_EQ(bits_of(bad.scale_inv_t[k]), bits_of(clean.scale_inv_t[k])) << g << "," << c;
    }
  for (int64_t c = 0; c < C; ++c)
    for (int64_t r = 0; r < R; ++r) {
      const size_t k = static_cast<size_t>(c * R + r);
      if (c == 3 && r >= 5 && r < 12) EXPECT_EQ(bad.out_t[k], cpu::kFp8PoisonByte) << c << "," << r;
      else EXPECT_EQ(bad.out_t[k], clean.out_t[k]) << c << "," << r;
    }
  for (int64_t r = 0; r < R; ++r) {
    const bool poisoned = r == 7 || r == 21;
    EXPECT_EQ(bits_of(bad.scale_inv[r]), poisoned ? 0x7fc00000u : bits_of(clean.scale_inv[r])) << r;
    for (int64_t c = 0; c < C; ++c)
      EXPECT_EQ(bad.out[r * C + c], poisoned ? cpu::kFp8PoisonByte : clean.out[r * C + c]) << r << "," << c;
  }
}

// group_rows = n is the offsets 0, n, 2n, ..., R.
TEST(QuantizeRowGroupsUniform, GroupRowsAreEqualGroups) {
  const int64_t R = 48, C = 20, n = 16;
  Rng rng;
  ::testing::ScopedTrace seed(__FILE__, __LINE__, "seed " + std::to_string(rng.seed()));
  std::vector<float> x(static_cast<size_t>(R * C));
  for (float& v : x) v = as_bf16(static_cast<float>(rng.uniform(-1, 1) * std::exp(rng.uniform(-4, 4))));
  HostInput h(DType::BF16, R, C, C, x);
  const std::vector<int32_t> offsets = {0, 16, 32, 48};
  for (DType fp8 : {DType::F8E4M3, DType::F8E5M2}) {
    const Quantized got = run(h.view, fp8, nullptr, n, true), by_offsets = run(h.view, fp8, &offsets, 0, true);
    const Quantized want = expected(x, R, C, offsets, fp8);
    EXPECT_EQ(got.out_t, want.out_t) << dtype_name(fp8);
    expect_same_bits(got.scale_inv_t, want.scale_inv_t, "scale_inv_t");
    EXPECT_EQ(got.out, by_offsets.out) << dtype_name(fp8);
    expect_same_bits(got.scale_inv, by_offsets.scale_inv, "scale_inv");
  }
}

// Every refused combination names the argument; a bad offsets array names its first bad entry.
TEST(QuantizeRowGroupsErrors, NameTheProblem) {
  const int64_t R = 12, C = 4;
  std::vector<float> x(static_cast<size_t>(R * C), 1.0f), s(256, 0.0f), one(1, 1.0f);
  std::vector<uint8_t> o(static_cast<size_t>(R * C)), ot(static_cast<size_t>(R * C));
  std::vector<int32_t> off = {0, 5, 5, 12};
  std::vector<int64_t> off64 = {0, 5, 5, 12};
  QuantizeFp8Args good;
  good.granularity = Fp8Granularity::Row;
  good.inp = TensorView(x.data(), DType::F32, Device::CPU, {R, C});
  good.out = TensorView(o.data(), DType::F8E4M3, Device::CPU, {R, C});
  good.scale_inv = TensorView(s.data(), DType::F32, Device::CPU, {R});
  good.out_t = TensorView(ot.data(), DType::F8E4M3, Device::CPU, {C, R});
  good.scale_inv_t = TensorView(s.data() + 64, DType::F32, Device::CPU, {3, C});
  good.offsets = TensorView(off.data(), DType::I32, Device::CPU, {4});
  EXPECT_EQ(quantize_fp8(good), BackendType::CPU);

  const auto with_offsets = [&](std::vector<int32_t> v, const std::string& part) {
    std::vector<int32_t> bad = std::move(v);
    QuantizeFp8Args a = good;
    a.offsets = TensorView(bad.data(), DType::I32, Device::CPU, {static_cast<int64_t>(bad.size())});
    expect_error(a, part);
  };
  with_offsets({1, 5, 5, 12}, "quantize_fp8: offsets[0] = 1, expected 0");
  with_offsets({0, 5, 3, 12}, "quantize_fp8: offsets[2] = 3 after offsets[1] = 5 (non-decreasing, at most R = 12)");
  with_offsets({0, 5, 5, 13}, "quantize_fp8: offsets[3] = 13 after offsets[2] = 5");
  with_offsets({0, -1, 5, 12}, "quantize_fp8: offsets[1] = -1 after offsets[0] = 0");
  // Wrong length: 4 groups, but scale_inv_t holds 3 x C.
  with_offsets({0, 5, 5, 6, 12}, "quantize_fp8: scale_inv_t: the column scales of 4 row groups of a [12, 4] matrix are "
                                 "[G, C] = 16 contiguous f32");
  QuantizeFp8Args a = good;
  a.offsets = TensorView(off.data(), DType::I32, Device::CPU, {2, 2});
  expect_error(a, "quantize_fp8: offsets: expected a contiguous [G + 1] vector");
  a = good;
  a.offsets = TensorView(off64.data(), DType::I64, Device::CPU, {4});
  expect_error(a, "quantize_fp8: offsets: expected i32 got i64");
  a = good;
  a.offsets.device = Device::CUDA;
  expect_error(a, "different devices");
  a = good;
  a.granularity = Fp8Granularity::Tensor;
  a.scale_inv = TensorView(s.data(), DType::F32, Device::CPU, {1});
  expect_error(a, "quantize_fp8: offsets: row groups scale out_t per group and column, at row granularity only, got "
                  "tensor granularity");
  a = good;
  a.group_rows = 4;
  expect_error(a, "quantize_fp8: offsets and group_rows = 4 are both set");
  a = good;
  a.offsets = TensorView();
  a.group_rows = 5;
  expect_error(a, "quantize_fp8: group_rows = 5: expected a positive divisor of the 12 rows of inp");
  a.group_rows = -4;
  expect_error(a, "quantize_fp8: group_rows = -4: expected a positive divisor");
  a.group_rows = 4;  // 3 groups: fits scale_inv_t
  EXPECT_EQ(quantize_fp8(a), BackendType::CPU);
  a.granularity = Fp8Granularity::Block1x128;
  expect_error(a, "quantize_fp8: group_rows: row groups scale out_t per group and column, at row granularity only, "
                  "got 1x128 granularity");
  a = good;
  a.out_t = TensorView();
  expect_error(a, "quantize_fp8: offsets: row groups give the scales of out_t, which is not set");
  a = good;
  a.scale = TensorView(one.data(), DType::F32, Device::CPU, {1});
  expect_error(a, "quantize_fp8: offsets: row groups take current scaling, not with scale (delayed scaling)");
  a = good;
  a.amax = TensorView(one.data(), DType::F32, Device::CPU, {1});
  expect_error(a, "quantize_fp8: offsets: row groups take current scaling, not with amax");
  a = good;
  a.scale_inv_t = TensorView(s.data() + 64, DType::F32, Device::CPU, {C});  // the plain per-column size
  expect_error(a, "scale_inv_t: the column scales of 3 row groups of a [12, 4] matrix are [G, C] = 12 contiguous f32");
  // The reference kernel checks its offsets itself.
  const std::vector<int32_t> bad = {0, 7, 6};
  try {
    cpu::quantize_fp8_row_groups_t(x.data(), DType::F32, R, C, C, bad.data(), 2, ot.data(), s.data(), DType::F8E4M3);
    ADD_FAILURE() << "cpu::quantize_fp8_row_groups_t accepted decreasing offsets";
  } catch (const RuntimeError& e) {
    EXPECT_NE(std::string(e.what()).find("quantize_fp8_row_groups_t: offsets[2] = 6 after offsets[1] = 7"),
              std::string::npos)
        << e.what();
  }
}

}  // namespace fp8_row_groups_test

// ---- delayed scaling (turbo/ops/fp8_delayed.h) -------------------------------------------------
namespace fp8_delayed_test {

using cpu::testing::Rng;

uint32_t bits_of(float f) {
  uint32_t u;
  std::memcpy(&u, &f, 4);
  return u;
}
uint8_t enc(DType t, float x) { return t == DType::F8E4M3 ? float_to_f8e4m3_bits(x) : float_to_f8e5m2_bits(x); }

struct Delayed {
  std::vector<uint8_t> out, out_t;
  float scale_inv = NAN;
};
// quantize_fp8 on host tensors with a given scale, folding max |x| into *amax (when not null).
Delayed quantize_with(const std::vector<float>& x, int64_t R, int64_t C, DType in, DType fp8, float scale,
                      float* amax) {
  std::vector<float> f32 = x;
  std::vector<uint16_t> b16(x.size());
  for (size_t i = 0; i < x.size(); ++i) b16[i] = float_to_bf16_bits(x[i]);
  Delayed d;
  d.out.assign(x.size(), 0xAB);
  d.out_t.assign(x.size(), 0xAB);
  QuantizeFp8Args a;
  a.inp = TensorView(in == DType::BF16 ? static_cast<void*>(b16.data()) : f32.data(), in, Device::CPU, {R, C});
  a.out = TensorView(d.out.data(), fp8, Device::CPU, {R, C});
  a.out_t = TensorView(d.out_t.data(), fp8, Device::CPU, {C, R});
  a.scale_inv = TensorView(&d.scale_inv, DType::F32, Device::CPU, {1});
  a.scale = TensorView(&scale, DType::F32, Device::CPU, {1});
  if (amax) a.amax = TensorView(amax, DType::F32, Device::CPU, {1});
  EXPECT_EQ(quantize_fp8(a), BackendType::CPU);
  return d;
}

class QuantizeDelayed : public ::testing::TestWithParam<DType> {};  // the input dtype

// The given scale, not the tensor's own: bytes fp8(x * scale) (values past fp8_max / scale
// saturate), scale_inv = 1 / scale, out_t the transpose; max |x| is folded into amax (kept when
// the entry already holds more), without changing the bytes.
TEST_P(QuantizeDelayed, QuantizesWithTheGivenScaleAndRecordsTheAmax) {
  const DType in = GetParam();
  Rng rng;
  ::testing::ScopedTrace seed(__FILE__, __LINE__, "seed " + std::to_string(rng.seed()));
  const int64_t R = 24, C = 40;
  std::vector<float> x = rng.vec<float>(static_cast<size_t>(R * C), -3.0, 3.0);
  if (in == DType::BF16)
    for (float& v : x) v = bf16_bits_to_float(float_to_bf16_bits(v));
  float true_amax = 0;
  for (float v : x) true_amax = std::max(true_amax, std::fabs(v));
  for (DType fp8 : {DType::F8E4M3, DType::F8E5M2}) {
    // Half the scale current scaling would take, then twice it: the second saturates the largest values.
    const float current = cpu::fp8_max(fp8) / true_amax;
    for (float scale : {0.5f * current, 2.0f * current}) {
      float amax = 0.25f;
      const Delayed d = quantize_with(x, R, C, in, fp8, scale, &amax);
      EXPECT_EQ(d.scale_inv, 1.0f / scale);
      EXPECT_EQ(bits_of(amax), bits_of(true_amax));
      int saturated = 0;
      for (int64_t r = 0; r < R; ++r)
        for (int64_t c = 0; c < C; ++c) {
          const uint8_t want = enc(fp8, x[r * C + c] * scale);
          ASSERT_EQ(d.out[r * C + c], want) << r << "," << c;
          ASSERT_EQ(d.out_t[c * R + r], want) << r << "," << c;
          saturated += std::fabs(x[r * C + c] * scale) > cpu::fp8_max(fp8);
        }
      EXPECT_EQ(saturated > 0, scale > current) << "only the larger scale overflows the format";
      float bigger = 100.0f;
      (void)quantize_with(x, R, C, in, fp8, scale, &bigger);
      EXPECT_EQ(bigger, 100.0f) << "a larger recorded amax is kept";
      const Delayed again = quantize_with(x, R, C, in, fp8, scale, nullptr);
      EXPECT_EQ(again.out, d.out) << "recording does not change the bytes";
    }
  }
}

// An inf or NaN element becomes the poison byte (NaN in both formats) and only it: the scale is
// not the tensor's own, so its neighbours are real values; the recorded amax is inf or NaN, which
// the update then drops.
TEST_P(QuantizeDelayed, NonFiniteElementsArePoisonedOneByOne) {
  const DType in = GetParam();
  for (float bad : {INFINITY, -INFINITY, NAN}) {
    std::vector<float> x = {1.0f, -2.0f, 0.5f, 3.0f, 0.0f, -0.25f};
    x[3] = bad;
    float amax = 0;
    const Delayed d = quantize_with(x, 2, 3, in, DType::F8E4M3, 64.0f, &amax);
    for (size_t i = 0; i < x.size(); ++i) {
      const uint8_t want = i == 3 ? cpu::kFp8PoisonByte : enc(DType::F8E4M3, x[i] * 64.0f);
      EXPECT_EQ(d.out[i], want) << bad << " element " << i;
    }
    EXPECT_TRUE(std::isnan(amax) ? std::isnan(bad) : std::isinf(amax)) << bad;
  }
}

// Current scaling (no given scale) with an amax entry records the tensor's amax too: what the
// steps before a history exists do.
TEST_P(QuantizeDelayed, CurrentScalingRecordsItsAmax) {
  const DType in = GetParam();
  std::vector<float> x = {1.0f, -6.5f, 0.5f, 3.0f};
  std::vector<float> f32 = x;
  std::vector<uint16_t> b16(4);
  for (size_t i = 0; i < 4; ++i) b16[i] = float_to_bf16_bits(x[i]);
  std::vector<uint8_t> out(4);
  float scale_inv = 0, amax = 1.0f;
  QuantizeFp8Args a;
  a.inp = TensorView(in == DType::BF16 ? static_cast<void*>(b16.data()) : f32.data(), in, Device::CPU, {2, 2});
  a.out = TensorView(out.data(), DType::F8E4M3, Device::CPU, {2, 2});
  a.scale_inv = TensorView(&scale_inv, DType::F32, Device::CPU, {1});
  a.amax = TensorView(&amax, DType::F32, Device::CPU, {1});
  quantize_fp8(a);
  EXPECT_EQ(amax, 6.5f);
  EXPECT_EQ(scale_inv, 1.0f / (448.0f / 6.5f));
}

INSTANTIATE_TEST_SUITE_P(Quantize, QuantizeDelayed, ::testing::Values(DType::F32, DType::BF16),
                         [](const auto& info) { return std::string(dtype_name(info.param)); });

TEST(QuantizeDelayedErrors, NameTheProblem) {
  std::vector<float> x(256 * 128, 1.0f), scales(4096, 1.0f);
  std::vector<uint8_t> o(x.size());
  float scale = 2.0f, amax = 0.0f, inv = 0.0f;
  QuantizeFp8Args a;
  a.inp = TensorView(x.data(), DType::F32, Device::CPU, {256, 128});
  a.out = TensorView(o.data(), DType::F8E4M3, Device::CPU, {256, 128});
  a.scale_inv = TensorView(&inv, DType::F32, Device::CPU, {1});
  a.scale = TensorView(scales.data(), DType::F32, Device::CPU, {2});
  expect_error(a, "scale: one f32");
  a.scale = TensorView(&scale, DType::F32, Device::CPU, {1});
  a.amax = TensorView(o.data(), DType::F8E4M3, Device::CPU, {1});
  expect_error(a, "amax");
  a.amax = TensorView(&amax, DType::F32, Device::CPU, {1});
  a.granularity = Fp8Granularity::Row;
  a.scale_inv = TensorView(scales.data(), DType::F32, Device::CPU, {256});
  expect_error(a, "scale (delayed scaling) is per tensor, not at row granularity");
}

// The history bookkeeping, by hand: most_recent takes entry 0, max the largest entry; the scale
// is fp8_max / amax / 2^margin; a tensor with nothing recorded keeps its scale; a non-finite
// newest entry is dropped (a skipped step); the history moves one entry along with entry 0
// cleared; an amax whose quotient overflows gives FLT_MAX.
TEST(Fp8DelayedUpdate, HistoriesBecomeScalesAndMoveAlong) {
  for (const bool use_max : {false, true}) {
    SCOPED_TRACE(use_max ? "max" : "most_recent");
    const int64_t T = 5, len = 3;
    std::vector<float> h = {2.0f, 8.0f, 4.0f,       // t0
                            0.0f, 0.0f, 0.0f,       // t1: nothing yet
                            INFINITY, 1.0f, 3.0f,   // t2: a non-finite step
                            NAN, 0.0f, 0.0f,        // t3: a NaN step, nothing before
                            1e-40f, 0.0f, 0.0f};    // t4: subnormal amax
    std::vector<float> scale = {7.0f, 7.0f, 7.0f, 7.0f, 7.0f};
    const std::vector<float> fmax = {448.0f, 57344.0f, 448.0f, 448.0f, 448.0f};
    for (int margin : {0, 2}) {
      std::vector<float> hh = h, ss = scale;
      Fp8DelayedUpdateArgs a;
      a.history = TensorView(hh.data(), DType::F32, Device::CPU, {T, len});
      a.scale = TensorView(ss.data(), DType::F32, Device::CPU, {T});
      a.fp8_max = TensorView(const_cast<float*>(fmax.data()), DType::F32, Device::CPU, {T});
      a.algo = use_max ? Fp8AmaxAlgo::Max : Fp8AmaxAlgo::MostRecent;
      a.margin = margin;
      EXPECT_EQ(fp8_delayed_update(a), BackendType::CPU);
      const float f = std::ldexp(1.0f, -margin);
      EXPECT_EQ(ss[0], (448.0f / (use_max ? 8.0f : 2.0f)) * f);
      EXPECT_EQ(ss[1], 7.0f) << "nothing recorded: the scale is kept";
      if (use_max) EXPECT_EQ(ss[2], (448.0f / 3.0f) * f);
      else EXPECT_EQ(ss[2], 7.0f) << "the inf entry is dropped, most_recent sees 0";
      EXPECT_EQ(ss[3], 7.0f);
      EXPECT_EQ(ss[4], FLT_MAX * f);
      const std::vector<float> moved = {0.0f, 2.0f, 8.0f, 0.0f, 0.0f, 0.0f, 0.0f, 0.0f, 1.0f,
                                        0.0f, 0.0f, 0.0f, 0.0f, 1e-40f, 0.0f};
      EXPECT_EQ(hh, moved);
    }
  }
}

TEST(Fp8DelayedUpdate, ErrorsNameTheProblem) {
  std::vector<float> h(6, 0.0f), s(2, 1.0f), m(2, 448.0f);
  Fp8DelayedUpdateArgs a;
  a.history = TensorView(h.data(), DType::F32, Device::CPU, {2, 3});
  a.scale = TensorView(s.data(), DType::F32, Device::CPU, {1});
  a.fp8_max = TensorView(m.data(), DType::F32, Device::CPU, {2});
  try {
    fp8_delayed_update(a);
    ADD_FAILURE() << "a scale tensor of the wrong size was accepted";
  } catch (const RuntimeError& e) {
    EXPECT_NE(std::string(e.what()).find("scale and fp8_max need 2 entries"), std::string::npos) << e.what();
  }
}

// The registry: each registered weight has its three tensors at their places in history and
// scale; an unknown weight, a weight registered twice and a wrong-sized binding are errors
// that say what.
TEST(Fp8DelayedScaling, FindsEachLayersTensorsByItsWeight) {
  Fp8DelayedOptions o;
  o.history_len = 4;
  Fp8DelayedScaling d(o);
  float w0 = 0, w1 = 0, other = 0;
  d.add_layer(&w0, "layer 0 qkv");
  d.add_layer(&w1, "layer 0 mlp up");
  EXPECT_THROW(d.add_layer(&w0, "again"), RuntimeError);
  EXPECT_EQ(d.tensors(), 6);
  EXPECT_EQ(d.fp8_max_of_tensor(0), 448.0f);
  EXPECT_EQ(d.fp8_max_of_tensor(2), 57344.0f);  // dy: E5M2 by default (hybrid)
  std::vector<float> h(24), s(6), m(6);
  EXPECT_THROW(d.bind(TensorView(h.data(), DType::F32, Device::CPU, {20}), TensorView(s.data(), DType::F32, Device::CPU, {6}),
                      TensorView(m.data(), DType::F32, Device::CPU, {6})),
               RuntimeError);
  d.bind(TensorView(h.data(), DType::F32, Device::CPU, {24}), TensorView(s.data(), DType::F32, Device::CPU, {6}),
         TensorView(m.data(), DType::F32, Device::CPU, {6}));
  const auto t = d.tensor(&w1, Fp8DelayedScaling::kGrad, "op");
  EXPECT_EQ(t.scale.data, s.data() + 5);
  EXPECT_EQ(t.amax.data, h.data() + 5 * 4);
  try {
    (void)d.tensor(&other, Fp8DelayedScaling::kInput, "linear_forward_fp8");
    ADD_FAILURE() << "an unregistered weight was found";
  } catch (const RuntimeError& e) {
    EXPECT_NE(std::string(e.what()).find("linear_forward_fp8: fp8_recipe delayed"), std::string::npos) << e.what();
  }
  EXPECT_THROW(Fp8DelayedScaling(Fp8DelayedOptions{0}), ConfigError);
}

}  // namespace fp8_delayed_test
namespace add_gradient_test {

// turbo::add_gradient on the host (gradient_accumulation_fusion: false): the product rounded to
// bf16's nearest even (ties to even, both directions) or kept, then written or added; sizes and
// dtypes checked.
TEST(AddGradient, RoundsToBf16ThenWritesOrAdds) {
  // 1 + 2^-8 is a tie between 1 and 1 + 2^-7 (to even: 1); 1 + 3 * 2^-8 ties up to 1 + 2^-6.
  std::vector<float> src = {1.0f + 0x1p-8f, 1.0f + 3 * 0x1p-8f, -2.5f, 1.0f + 0x1p-9f};
  const std::vector<float> bf16 = {1.0f, 1.0f + 0x1p-6f, -2.5f, 1.0f};
  const std::vector<float> start = {0.5f, -1.0f, 2.0f, 0x1p-20f};
  const int64_t n = static_cast<int64_t>(src.size());
  for (const bool accumulate : {false, true}) {
    for (const DType rt : {DType::BF16, DType::F32}) {
      std::vector<float> dst = start;
      add_gradient(TensorView(dst.data(), DType::F32, Device::CPU, {n}),
                   TensorView(src.data(), DType::F32, Device::CPU, {n}), rt, accumulate, ExecContext{});
      for (size_t i = 0; i < src.size(); ++i) {
        const float r = rt == DType::BF16 ? bf16[i] : src[i];
        EXPECT_EQ(dst[i], accumulate ? start[i] + r : r) << i << " accumulate " << accumulate;
      }
    }
  }
  std::vector<float> small(3);
  EXPECT_THROW(add_gradient(TensorView(small.data(), DType::F32, Device::CPU, {3}),
                            TensorView(src.data(), DType::F32, Device::CPU, {n}), DType::BF16, true, ExecContext{}),
               primus::RuntimeError);
  EXPECT_THROW(add_gradient(TensorView(src.data(), DType::F32, Device::CPU, {n}),
                            TensorView(src.data(), DType::F32, Device::CPU, {n}), DType::F8E4M3, true, ExecContext{}),
               primus::RuntimeError);
}

}  // namespace add_gradient_test
namespace rows_in_use_test {

// QuantizeFp8Args::rows_in_use (an MoE row plan's offsets[G]): the scale comes from the rows in use
// only, so NaN and huge values in the rows past them change nothing there; the used rows' bytes
// are those of quantizing the used rows alone; a count past R reads all rows, a negative one none;
// what it does not combine with is named. Both outputs, bf16 and f32 inputs.
TEST(QuantizeRowsInUse, TheScaleComesFromTheRowsInUseOnly) {
  const int64_t R = 24, C = 32, used_rows = 13;
  Rng rng;
  SCOPED_TRACE("seed " + std::to_string(rng.seed()));
  for (const DType in : {DType::F32, DType::BF16}) {
    for (const DType fp8 : {DType::F8E4M3, DType::F8E5M2}) {
      SCOPED_TRACE(std::string(dtype_name(in)) + " -> " + std::string(dtype_name(fp8)));
      std::vector<float> x(static_cast<size_t>(R * C));
      for (auto& v : x) v = static_cast<float>(rng.uniform(-3.0, 3.0));
      for (int64_t i = used_rows * C; i < R * C; ++i) x[i] = (i % 3 == 0) ? NAN : 1e30f;  // stale rows
      std::vector<uint16_t> xb(x.size());
      for (size_t i = 0; i < x.size(); ++i) xb[i] = float_to_bf16_bits(x[i]);
      const TensorView inp(in == DType::F32 ? static_cast<void*>(x.data()) : xb.data(), in, Device::CPU, {R, C});
      const auto run = [&](const TensorView& t, int32_t rows, bool limited) {
        const int64_t r = t.size(0);
        Result res;
        res.out.assign(static_cast<size_t>(r * C), 0xAB);
        res.out_t.assign(static_cast<size_t>(r * C), 0xAB);
        QuantizeFp8Args a;
        a.inp = t;
        a.out = TensorView(res.out.data(), fp8, Device::CPU, {r, C});
        a.out_t = TensorView(res.out_t.data(), fp8, Device::CPU, {C, r});
        a.scale_inv = TensorView(&res.scale_inv, DType::F32, Device::CPU, {1});
        if (limited) a.rows_in_use = TensorView(&rows, DType::I32, Device::CPU, {1});
        res.backend = quantize_fp8(a);
        return res;
      };
      const Result got = run(inp, static_cast<int32_t>(used_rows), true);
      const Result alone = run(inp.slice0(0, used_rows), 0, false);
      EXPECT_EQ(got.backend, BackendType::CPU);
      EXPECT_TRUE(std::isfinite(got.scale_inv));
      EXPECT_EQ(bits(got.scale_inv), bits(alone.scale_inv));
      for (int64_t r = 0; r < used_rows; ++r)
        for (int64_t c = 0; c < C; ++c) {
          ASSERT_EQ(got.out[r * C + c], alone.out[r * C + c]) << r << "," << c;
          ASSERT_EQ(got.out_t[c * R + r], alone.out[r * C + c]) << "out_t " << r << "," << c;
        }
      const Result all = run(inp, 0, false);  // the stale rows' NaN poisons the whole tensor
      EXPECT_TRUE(std::isnan(all.scale_inv));
      EXPECT_EQ(bits(run(inp, 1000, true).scale_inv), bits(all.scale_inv)) << "a count past R reads every row";
      EXPECT_EQ(run(inp, -5, true).scale_inv, 1.0f) << "no rows in use: the empty tensor's scale";
    }
  }
  std::vector<float> x(64, 1.0f), s(8, 0.0f);
  std::vector<uint8_t> q(64);
  int32_t rows = 4, wrong[2] = {4, 4};
  QuantizeFp8Args a;
  a.inp = TensorView(x.data(), DType::F32, Device::CPU, {8, 8});
  a.out = TensorView(q.data(), DType::F8E4M3, Device::CPU, {8, 8});
  a.scale_inv = TensorView(s.data(), DType::F32, Device::CPU, {8});
  a.granularity = Fp8Granularity::Row;
  a.rows_in_use = TensorView(&rows, DType::I32, Device::CPU, {1});
  expect_error(a, "rows_in_use limits the amax of Tensor granularity");
  a.granularity = Fp8Granularity::Tensor;
  a.scale_inv = TensorView(s.data(), DType::F32, Device::CPU, {1});
  a.maxima = TensorView(s.data() + 1, DType::F32, Device::CPU, {1});
  expect_error(a, "rows_in_use limits the amax");
  a.maxima = TensorView();
  a.rows_in_use = TensorView(wrong, DType::I32, Device::CPU, {2});
  expect_error(a, "rows_in_use: one i32");
  a.rows_in_use = TensorView(s.data(), DType::F32, Device::CPU, {1});
  expect_error(a, "rows_in_use");
}

// Delayed scaling with rows_in_use: the given scale quantizes every row, the recorded amax is the
// rows in use's alone (NaN and 1e30 past them), folded into what amax held.
TEST(QuantizeRowsInUse, DelayedScalingRecordsTheAmaxOfTheRowsInUse) {
  const int64_t R = 12, C = 16, used_rows = 7;
  Rng rng;
  SCOPED_TRACE("seed " + std::to_string(rng.seed()));
  std::vector<float> x(static_cast<size_t>(R * C));
  for (auto& v : x) v = static_cast<float>(rng.uniform(-2.0, 2.0));
  x[3 * C + 5] = -6.5f;  // the used rows' amax
  for (int64_t i = used_rows * C; i < R * C; ++i) x[i] = (i % 2) ? NAN : 1e30f;
  std::vector<uint8_t> q(static_cast<size_t>(R * C)), want(q.size());
  float scale = 40.0f, inv = 0.0f, amax = 0.5f;
  int32_t rows = static_cast<int32_t>(used_rows);
  QuantizeFp8Args a;
  a.inp = TensorView(x.data(), DType::F32, Device::CPU, {R, C});
  a.out = TensorView(q.data(), DType::F8E4M3, Device::CPU, {R, C});
  a.scale_inv = TensorView(&inv, DType::F32, Device::CPU, {1});
  a.scale = TensorView(&scale, DType::F32, Device::CPU, {1});
  a.amax = TensorView(&amax, DType::F32, Device::CPU, {1});
  a.rows_in_use = TensorView(&rows, DType::I32, Device::CPU, {1});
  quantize_fp8(a);
  (void)cpu::quantize_fp8_with_scale(x.data(), DType::F32, used_rows, C, C, scale, want.data(), nullptr, DType::F8E4M3);
  for (int64_t i = 0; i < used_rows * C; ++i) ASSERT_EQ(q[i], want[i]) << i;
  EXPECT_EQ(amax, 6.5f);
  EXPECT_EQ(inv, 1.0f / 40.0f);
}

// turbo::broadcast: every element takes the one value; sizes and dtypes checked.
TEST(Broadcast, FillsEveryElementWithTheOneValue) {
  std::vector<float> dst(7, -1.0f);
  float one = 0.375f;
  broadcast(TensorView(dst.data(), DType::F32, Device::CPU, {7}), TensorView(&one, DType::F32, Device::CPU, {1}), {});
  for (float v : dst) EXPECT_EQ(v, 0.375f);
  std::vector<float> two(2, 1.0f);
  EXPECT_THROW(broadcast(TensorView(dst.data(), DType::F32, Device::CPU, {7}), TensorView(two.data(), DType::F32, Device::CPU, {2}),
                         {}),
               primus::RuntimeError);
  int32_t i = 3;
  EXPECT_THROW(broadcast(TensorView(dst.data(), DType::F32, Device::CPU, {7}), TensorView(&i, DType::I32, Device::CPU, {1}), {}),
               primus::RuntimeError);
}

}  // namespace rows_in_use_test
}  // namespace primus::turbo
