// Element types of stored tensors (the safetensors set) and the float conversions the file
// formats need: bf16 <-> fp32 (round to nearest even) and fp16 -> fp32.
#pragma once
#include <cstddef>
#include <cstdint>
#include <cstring>
#include <optional>
#include <span>
#include <string_view>

namespace primus::io {

// Ordered by element size, then as safetensors lists them. Values are not stored in files
// (files carry the names), so the order may change.
enum class DType : uint8_t {
  BOOL,
  U8,
  I8,
  F8_E5M2,
  F8_E4M3,
  I16,
  U16,
  F16,
  BF16,
  I32,
  U32,
  F32,
  F64,
  I64,
  U64,
};

inline constexpr DType kAllDTypes[] = {
    DType::BOOL, DType::U8,  DType::I8,  DType::F8_E5M2, DType::F8_E4M3,
    DType::I16,  DType::U16, DType::F16, DType::BF16,    DType::I32,
    DType::U32,  DType::F32, DType::F64, DType::I64,     DType::U64,
};

// Bytes per element.
constexpr size_t dtype_size(DType t) {
  switch (t) {
    case DType::BOOL:
    case DType::U8:
    case DType::I8:
    case DType::F8_E5M2:
    case DType::F8_E4M3:
      return 1;
    case DType::I16:
    case DType::U16:
    case DType::F16:
    case DType::BF16:
      return 2;
    case DType::I32:
    case DType::U32:
    case DType::F32:
      return 4;
    case DType::F64:
    case DType::I64:
    case DType::U64:
      return 8;
  }
  return 0;
}

// The safetensors spelling: "F32", "BF16", "F8_E4M3", ...
std::string_view dtype_name(DType t);
// Inverse of dtype_name; nullopt for an unknown name.
std::optional<DType> parse_dtype(std::string_view name);

// The DType stored for a C++ element type. 16-bit floats have no C++ type here: they travel as
// uint16_t bit patterns, so uint16_t maps to U16 and callers name BF16/F16 explicitly. BOOL and
// the FP8 types travel as uint8_t (BOOL: one byte, 0 or 1) for the same reason.
template <class T>
constexpr DType dtype_of();
template <> constexpr DType dtype_of<uint8_t>() { return DType::U8; }
template <> constexpr DType dtype_of<int8_t>() { return DType::I8; }
template <> constexpr DType dtype_of<int16_t>() { return DType::I16; }
template <> constexpr DType dtype_of<uint16_t>() { return DType::U16; }
template <> constexpr DType dtype_of<int32_t>() { return DType::I32; }
template <> constexpr DType dtype_of<uint32_t>() { return DType::U32; }
template <> constexpr DType dtype_of<float>() { return DType::F32; }
template <> constexpr DType dtype_of<double>() { return DType::F64; }
template <> constexpr DType dtype_of<int64_t>() { return DType::I64; }
template <> constexpr DType dtype_of<uint64_t>() { return DType::U64; }

// bf16 is the upper half of an fp32. Rounding is to nearest, ties to even; NaN stays NaN (the
// quiet bit is forced so that rounding cannot turn a NaN payload into infinity).
inline uint16_t fp32_to_bf16(float f) {
  uint32_t u;
  std::memcpy(&u, &f, 4);
  if ((u & 0x7fffffffu) > 0x7f800000u) return static_cast<uint16_t>((u >> 16) | 0x0040u);
  u += 0x7fffu + ((u >> 16) & 1u);
  return static_cast<uint16_t>(u >> 16);
}

inline float bf16_to_fp32(uint16_t h) {
  uint32_t u = static_cast<uint32_t>(h) << 16;
  float f;
  std::memcpy(&f, &u, 4);
  return f;
}

// IEEE binary16 -> fp32, exact (every half is representable), subnormals included.
float fp16_to_fp32(uint16_t h);

// Bulk conversions; `out.size()` must equal `in.size()`.
void fp32_to_bf16(std::span<const float> in, std::span<uint16_t> out);
void bf16_to_fp32(std::span<const uint16_t> in, std::span<float> out);

// Converts `n` elements of a floating type (F32, F64, BF16, F16) at `src` (little-endian, any
// alignment) to fp32. Throws FormatError for any other dtype.
void to_fp32(DType src_type, const std::byte* src, size_t n, float* out);

}  // namespace primus::io
