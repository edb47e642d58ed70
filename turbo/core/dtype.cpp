#include "turbo/core/dtype.h"

#include <cmath>
#include <cstring>
#include <string>

#include "core/util/error.h"

namespace primus::turbo {

std::string_view dtype_name(DType t) {
  switch (t) {
    case DType::F32: return "f32";
    case DType::BF16: return "bf16";
    case DType::F16: return "f16";
    case DType::F8E4M3: return "f8e4m3";
    case DType::F8E5M2: return "f8e5m2";
    case DType::I32: return "i32";
    case DType::I64: return "i64";
    case DType::U16: return "u16";
  }
  return "?";
}

DType parse_dtype(std::string_view s) {
  struct Alias { std::string_view name; DType t; };
  static constexpr Alias kAliases[] = {
      {"f32", DType::F32},       {"fp32", DType::F32},       {"float32", DType::F32},
      {"bf16", DType::BF16},     {"bfloat16", DType::BF16},  {"f16", DType::F16},
      {"fp16", DType::F16},      {"float16", DType::F16},    {"f8e4m3", DType::F8E4M3},
      {"fp8_e4m3", DType::F8E4M3}, {"f8e5m2", DType::F8E5M2}, {"fp8_e5m2", DType::F8E5M2},
      {"i32", DType::I32},       {"int32", DType::I32},      {"i64", DType::I64},
      {"int64", DType::I64},     {"u16", DType::U16},        {"uint16", DType::U16}};
  for (const auto& a : kAliases)
    if (a.name == s) return a.t;
  throw ConfigError(fmt::format("unknown dtype '{}' (expected one of f32, bf16, f16, f8e4m3, "
                                "f8e5m2, i32, i64, u16)", s));
}

namespace {
uint32_t float_bits(float f) { uint32_t u; std::memcpy(&u, &f, 4); return u; }
float bits_float(uint32_t u) { float f; std::memcpy(&f, &u, 4); return f; }

// A small float format: exponent bits, mantissa bits, bias, and whether the all-ones exponent
// holds infinities (IEEE-like: f16, e5m2) or ordinary numbers with only one NaN code (e4m3).
struct SmallFloat {
  int exp_bits, man_bits, bias;
  bool ieee_specials;
  float max_finite;
};
constexpr SmallFloat kE4M3{4, 3, 7, false, 448.0f};
constexpr SmallFloat kE5M2{5, 2, 15, true, 57344.0f};
constexpr SmallFloat kF16{5, 10, 15, true, 65504.0f};

uint32_t encode_small(float f, const SmallFloat& fmt_, bool saturate) {
  const uint32_t sign = std::signbit(f) ? 1u << (fmt_.exp_bits + fmt_.man_bits) : 0u;
  const uint32_t exp_all = (1u << fmt_.exp_bits) - 1;
  const uint32_t nan_code = fmt_.ieee_specials ? (exp_all << fmt_.man_bits) | (1u << (fmt_.man_bits - 1))
                                               : (exp_all << fmt_.man_bits) | ((1u << fmt_.man_bits) - 1);
  if (std::isnan(f)) return sign | nan_code;
  const uint32_t max_code = fmt_.ieee_specials
                                ? ((exp_all - 1) << fmt_.man_bits) | ((1u << fmt_.man_bits) - 1)
                                : (exp_all << fmt_.man_bits) | ((1u << fmt_.man_bits) - 2);
  const uint32_t inf_code = exp_all << fmt_.man_bits;
  double a = std::fabs(static_cast<double>(f));
  auto overflow = [&] { return sign | (saturate || !fmt_.ieee_specials ? max_code : inf_code); };
  if (std::isinf(f)) return overflow();
  if (a == 0.0) return sign;
  int e2 = 0;
  std::frexp(a, &e2);  // a = m * 2^e2, m in [0.5, 1)
  int e = e2 - 1;      // a = 1.x * 2^e
  const int emin = 1 - fmt_.bias;
  if (e < emin) e = emin;
  const double quantum = std::ldexp(1.0, e - fmt_.man_bits);
  double q = std::nearbyint(a / quantum);  // ties to even under the default rounding mode
  if (q >= std::ldexp(1.0, fmt_.man_bits + 1)) { q /= 2; e += 1; }  // rounded up into the next binade
  const double rounded = q * std::ldexp(1.0, e - fmt_.man_bits);
  if (rounded > fmt_.max_finite) return overflow();
  const uint32_t iq = static_cast<uint32_t>(q);
  if (e == emin && iq < (1u << fmt_.man_bits)) return sign | iq;  // subnormal
  const uint32_t exp_field = static_cast<uint32_t>(e + fmt_.bias);
  return sign | (exp_field << fmt_.man_bits) | (iq - (1u << fmt_.man_bits));
}

float decode_small(uint32_t b, const SmallFloat& fmt_) {
  const uint32_t man_mask = (1u << fmt_.man_bits) - 1;
  const uint32_t exp_all = (1u << fmt_.exp_bits) - 1;
  const bool neg = (b >> (fmt_.exp_bits + fmt_.man_bits)) & 1u;
  const uint32_t ex = (b >> fmt_.man_bits) & exp_all;
  const uint32_t man = b & man_mask;
  double v;
  if (fmt_.ieee_specials && ex == exp_all) {
    v = man ? NAN : INFINITY;
  } else if (!fmt_.ieee_specials && ex == exp_all && man == man_mask) {
    v = NAN;
  } else if (ex == 0) {
    v = std::ldexp(static_cast<double>(man), 1 - fmt_.bias - fmt_.man_bits);
  } else {
    v = std::ldexp(static_cast<double>(man | (1u << fmt_.man_bits)),
                   static_cast<int>(ex) - fmt_.bias - fmt_.man_bits);
  }
  return static_cast<float>(neg ? -v : v);
}
}  // namespace

uint16_t float_to_bf16_bits(float f) {
  uint32_t u = float_bits(f);
  if ((u & 0x7fffffffu) > 0x7f800000u) return static_cast<uint16_t>((u >> 16) | 0x40);  // quiet NaN
  u += 0x7fffu + ((u >> 16) & 1u);
  return static_cast<uint16_t>(u >> 16);
}
float bf16_bits_to_float(uint16_t b) { return bits_float(static_cast<uint32_t>(b) << 16); }

uint16_t float_to_f16_bits(float f) { return static_cast<uint16_t>(encode_small(f, kF16, false)); }
float f16_bits_to_float(uint16_t h) { return decode_small(h, kF16); }
uint8_t float_to_f8e4m3_bits(float f) { return static_cast<uint8_t>(encode_small(f, kE4M3, true)); }
float f8e4m3_bits_to_float(uint8_t b) { return decode_small(b, kE4M3); }
uint8_t float_to_f8e5m2_bits(float f) { return static_cast<uint8_t>(encode_small(f, kE5M2, true)); }
float f8e5m2_bits_to_float(uint8_t b) { return decode_small(b, kE5M2); }

float load_as_float(const void* base, DType t, size_t i) {
  switch (t) {
    case DType::F32: return static_cast<const float*>(base)[i];
    case DType::BF16: return bf16_bits_to_float(static_cast<const uint16_t*>(base)[i]);
    case DType::F16: return f16_bits_to_float(static_cast<const uint16_t*>(base)[i]);
    case DType::F8E4M3: return f8e4m3_bits_to_float(static_cast<const uint8_t*>(base)[i]);
    case DType::F8E5M2: return f8e5m2_bits_to_float(static_cast<const uint8_t*>(base)[i]);
    case DType::I32: return static_cast<float>(static_cast<const int32_t*>(base)[i]);
    case DType::I64: return static_cast<float>(static_cast<const int64_t*>(base)[i]);
    case DType::U16: return static_cast<float>(static_cast<const uint16_t*>(base)[i]);
  }
  return 0.0f;
}

void store_from_float(void* base, DType t, size_t i, float v) {
  switch (t) {
    case DType::F32: static_cast<float*>(base)[i] = v; return;
    case DType::BF16: static_cast<uint16_t*>(base)[i] = float_to_bf16_bits(v); return;
    case DType::F16: static_cast<uint16_t*>(base)[i] = float_to_f16_bits(v); return;
    case DType::F8E4M3: static_cast<uint8_t*>(base)[i] = float_to_f8e4m3_bits(v); return;
    case DType::F8E5M2: static_cast<uint8_t*>(base)[i] = float_to_f8e5m2_bits(v); return;
    case DType::I32: static_cast<int32_t*>(base)[i] = static_cast<int32_t>(v); return;
    case DType::I64: static_cast<int64_t*>(base)[i] = static_cast<int64_t>(v); return;
    case DType::U16: static_cast<uint16_t*>(base)[i] = static_cast<uint16_t>(v); return;
  }
}

}  // namespace primus::turbo
