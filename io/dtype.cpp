#include "io/dtype.h"

#include <fmt/format.h>

#include "core/util/error.h"

namespace primus::io {

std::string_view dtype_name(DType t) {
  switch (t) {
    case DType::BOOL: return "BOOL";
    case DType::U8: return "U8";
    case DType::I8: return "I8";
    case DType::F8_E5M2: return "F8_E5M2";
    case DType::F8_E4M3: return "F8_E4M3";
    case DType::I16: return "I16";
    case DType::U16: return "U16";
    case DType::F16: return "F16";
    case DType::BF16: return "BF16";
    case DType::I32: return "I32";
    case DType::U32: return "U32";
    case DType::F32: return "F32";
    case DType::F64: return "F64";
    case DType::I64: return "I64";
    case DType::U64: return "U64";
  }
  return "?";
}

std::optional<DType> parse_dtype(std::string_view name) {
  for (DType t : kAllDTypes) {
    if (dtype_name(t) == name) return t;
  }
  return std::nullopt;
}

float fp16_to_fp32(uint16_t h) {
  uint32_t sign = static_cast<uint32_t>(h & 0x8000u) << 16;
  uint32_t exp = (h >> 10) & 0x1fu;
  uint32_t man = h & 0x3ffu;
  uint32_t u;
  if (exp == 0x1f) {
    u = sign | 0x7f800000u | (man << 13);  // inf / NaN (payload kept)
  } else if (exp != 0) {
    u = sign | ((exp + 112) << 23) | (man << 13);  // rebias 15 -> 127
  } else if (man == 0) {
    u = sign;  // signed zero
  } else {
    // Subnormal half: value = man * 2^-24. Normalise the mantissa into fp32's implicit bit.
    int e = -1;
    do {
      man <<= 1;
      ++e;
    } while ((man & 0x400u) == 0);
    u = sign | (static_cast<uint32_t>(112 - e) << 23) | ((man & 0x3ffu) << 13);
  }
  float f;
  std::memcpy(&f, &u, 4);
  return f;
}

void fp32_to_bf16(std::span<const float> in, std::span<uint16_t> out) {
  PRIMUS_CHECK(in.size() == out.size(), "fp32_to_bf16: {} inputs, {} outputs", in.size(),
               out.size());
  for (size_t i = 0; i < in.size(); ++i) out[i] = fp32_to_bf16(in[i]);
}

void bf16_to_fp32(std::span<const uint16_t> in, std::span<float> out) {
  PRIMUS_CHECK(in.size() == out.size(), "bf16_to_fp32: {} inputs, {} outputs", in.size(),
               out.size());
  for (size_t i = 0; i < in.size(); ++i) out[i] = bf16_to_fp32(in[i]);
}

namespace {
template <class S, class F>
void convert_each(const std::byte* src, size_t n, float* out, F&& f) {
  for (size_t i = 0; i < n; ++i) {
    S v;
    std::memcpy(&v, src + i * sizeof(S), sizeof(S));  // source may be unaligned
    out[i] = f(v);
  }
}
}  // namespace

void to_fp32(DType src_type, const std::byte* src, size_t n, float* out) {
  switch (src_type) {
    case DType::F32:
      if (n) std::memcpy(out, src, n * 4);
      return;
    case DType::F64:
      return convert_each<double>(src, n, out, [](double v) { return static_cast<float>(v); });
    case DType::BF16:
      return convert_each<uint16_t>(src, n, out, [](uint16_t v) { return bf16_to_fp32(v); });
    case DType::F16:
      return convert_each<uint16_t>(src, n, out, [](uint16_t v) { return fp16_to_fp32(v); });
    default:
      throw FormatError(fmt::format("cannot convert {} to F32 (only F32, F64, BF16, F16)",
                                    dtype_name(src_type)));
  }
}

}  // namespace primus::io
