// Element types of Turbo tensors, their sizes and names, and host-side conversions for the
// 16-bit and 8-bit float formats (used by tests, the CPU path and checkpoint I/O; device code
// uses CUDA's own intrinsics). Conversions round to nearest even, like the hardware.
#pragma once
#include <cstddef>
#include <cstdint>
#include <cstring>
#include <string_view>

namespace primus::turbo {

// U16: raw 16-bit words (the low halves of split fp32 master weights, turbo/ops/optimizer.h).
enum class DType : uint8_t { F32, BF16, F16, F8E4M3, F8E5M2, I32, I64, U16 };

// Bytes per element.
constexpr size_t dtype_size(DType t) {
  switch (t) {
    case DType::F32: return 4;
    case DType::BF16: return 2;
    case DType::F16: return 2;
    case DType::F8E4M3: return 1;
    case DType::F8E5M2: return 1;
    case DType::I32: return 4;
    case DType::I64: return 8;
    case DType::U16: return 2;
  }
  return 0;
}

constexpr bool dtype_is_float(DType t) { return t != DType::I32 && t != DType::I64 && t != DType::U16; }
constexpr bool dtype_is_fp8(DType t) { return t == DType::F8E4M3 || t == DType::F8E5M2; }

// "f32", "bf16", "f16", "f8e4m3", "f8e5m2", "i32", "i64", "u16".
std::string_view dtype_name(DType t);
// Inverse of dtype_name (also accepts "fp32", "float32", "bfloat16", "fp16", "float16",
// "fp8_e4m3", "fp8_e5m2"); throws primus::ConfigError naming the unknown string.
DType parse_dtype(std::string_view name);

// Host conversions between float and the narrow float formats (bit patterns as integers).
uint16_t float_to_bf16_bits(float f);
float bf16_bits_to_float(uint16_t b);
uint16_t float_to_f16_bits(float f);
float f16_bits_to_float(uint16_t h);
// FP8 conversions saturate to the largest finite value (OCP "satfinite"), as training recipes do.
uint8_t float_to_f8e4m3_bits(float f);
float f8e4m3_bits_to_float(uint8_t b);
uint8_t float_to_f8e5m2_bits(float f);
float f8e5m2_bits_to_float(uint8_t b);

// An fp32 value held as two 16-bit words (split master weights, turbo/ops/optimizer.h): the high
// word is the value rounded to bf16, to nearest with ties away from zero (so it is the compute
// copy the GEMMs read), the low word is the value's own low 16 bits. The pair gives back the
// exact fp32 bits: bits = (hi << 16) + int16(lo), because rounding the magnitude up happens exactly
// when the low half is >= 0x8000, i.e. when int16(lo) is negative. Round-to-nearest-even cannot
// be split this way: its two tie cases need lo = +0x8000 and -0x8000 beside the same even hi.
inline uint16_t split_f32_hi(float f) {
  uint32_t u;
  std::memcpy(&u, &f, 4);
  return static_cast<uint16_t>((u + 0x8000u) >> 16);
}
inline uint16_t split_f32_lo(float f) {
  uint32_t u;
  std::memcpy(&u, &f, 4);
  return static_cast<uint16_t>(u & 0xffffu);
}
inline float join_f32(uint16_t hi, uint16_t lo) {
  const uint32_t u = (static_cast<uint32_t>(hi) << 16) + static_cast<uint32_t>(static_cast<int32_t>(static_cast<int16_t>(lo)));
  float f;
  std::memcpy(&f, &u, 4);
  return f;
}

// Generic element access for host memory of any float dtype (slow; for tests and tools).
float load_as_float(const void* base, DType t, size_t index);
void store_from_float(void* base, DType t, size_t index, float value);

}  // namespace primus::turbo
