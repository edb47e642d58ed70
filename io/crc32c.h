// CRC-32C (Castagnoli; reflected polynomial 0x82F63B78, initial value and final xor
// 0xFFFFFFFF), the checksum of checkpoint manifests and of TensorBoard's record framing.
// crc32c("123456789") == 0xE3069283.
//
// Two implementations give identical results: a portable one (slicing-by-8: eight 256-entry
// tables, eight bytes per step) and one on the x86 SSE4.2 `crc32` instruction, picked at run
// time when the CPU has it. See docs/checkpoints.md for measured speeds.
#pragma once
#include <cstddef>
#include <cstdint>
#include <string_view>

namespace primus::io {

// Extends `crc` (the value returned for the bytes so far; 0 for none) over `n` more bytes, so
// crc32c(a+b) == crc32c_extend(crc32c(a), b).
uint32_t crc32c_extend(uint32_t crc, const void* data, size_t n);

inline uint32_t crc32c(const void* data, size_t n) { return crc32c_extend(0, data, n); }
inline uint32_t crc32c(std::string_view s) { return crc32c_extend(0, s.data(), s.size()); }

// The two implementations, exposed so tests can compare them and benchmarks time them.
uint32_t crc32c_extend_portable(uint32_t crc, const void* data, size_t n);
// Returns false (and leaves *out alone) when the CPU lacks SSE4.2.
bool crc32c_extend_hw(uint32_t crc, const void* data, size_t n, uint32_t* out);

// TFRecord's masked CRC: rotating right by 15 and adding a constant keeps a CRC stored inside
// CRC-covered data from looking like a CRC of itself.
inline uint32_t crc32c_mask(uint32_t crc) { return ((crc >> 15) | (crc << 17)) + 0xa282ead8u; }
inline uint32_t crc32c_unmask(uint32_t masked) {
  uint32_t rot = masked - 0xa282ead8u;
  return (rot >> 17) | (rot << 15);
}

}  // namespace primus::io
