#include "io/crc32c.h"

#include <array>
#include <bit>
#include <cstring>

#if defined(__x86_64__)
#include <nmmintrin.h>
#endif

namespace primus::io {
namespace {

static_assert(std::endian::native == std::endian::little,
              "the slicing-by-8 loop reads words little-endian");

constexpr uint32_t kPoly = 0x82F63B78u;  // Castagnoli, bit-reversed

// kTables[0] is the byte-at-a-time table; kTables[k][b] is the CRC of byte b followed by k
// zero bytes, so eight lookups advance the CRC by eight bytes at once.
constexpr std::array<std::array<uint32_t, 256>, 8> make_tables() {
  std::array<std::array<uint32_t, 256>, 8> t{};
  for (uint32_t i = 0; i < 256; ++i) {
    uint32_t c = i;
    for (int k = 0; k < 8; ++k) c = (c >> 1) ^ ((c & 1u) ? kPoly : 0u);
    t[0][i] = c;
  }
  for (size_t k = 1; k < 8; ++k) {
    for (uint32_t i = 0; i < 256; ++i) t[k][i] = (t[k - 1][i] >> 8) ^ t[0][t[k - 1][i] & 0xffu];
  }
  return t;
}
constexpr auto kTables = make_tables();

inline uint32_t load32(const unsigned char* p) {
  uint32_t v;
  std::memcpy(&v, p, 4);
  return v;
}

#if defined(__x86_64__)
__attribute__((target("sse4.2"))) uint32_t extend_sse42(uint32_t crc, const unsigned char* p,
                                                        size_t n) {
  uint64_t c = ~crc;
  for (; n && (reinterpret_cast<uintptr_t>(p) & 7u); --n) {
    c = _mm_crc32_u8(static_cast<uint32_t>(c), *p++);
  }
  for (; n >= 8; n -= 8, p += 8) {
    uint64_t w;
    std::memcpy(&w, p, 8);
    c = _mm_crc32_u64(c, w);
  }
  for (; n; --n) c = _mm_crc32_u8(static_cast<uint32_t>(c), *p++);
  return ~static_cast<uint32_t>(c);
}

bool cpu_has_sse42() {
  static const bool has = __builtin_cpu_supports("sse4.2");
  return has;
}
#endif

}  // namespace

uint32_t crc32c_extend_portable(uint32_t crc, const void* data, size_t n) {
  const auto* p = static_cast<const unsigned char*>(data);
  uint32_t c = ~crc;
  for (; n && (reinterpret_cast<uintptr_t>(p) & 7u); --n) {
    c = (c >> 8) ^ kTables[0][(c ^ *p++) & 0xffu];
  }
  for (; n >= 8; n -= 8, p += 8) {
    uint32_t lo = load32(p) ^ c;
    uint32_t hi = load32(p + 4);
    c = kTables[7][lo & 0xffu] ^ kTables[6][(lo >> 8) & 0xffu] ^
        kTables[5][(lo >> 16) & 0xffu] ^ kTables[4][lo >> 24] ^ kTables[3][hi & 0xffu] ^
        kTables[2][(hi >> 8) & 0xffu] ^ kTables[1][(hi >> 16) & 0xffu] ^ kTables[0][hi >> 24];
  }
  for (; n; --n) c = (c >> 8) ^ kTables[0][(c ^ *p++) & 0xffu];
  return ~c;
}

bool crc32c_extend_hw(uint32_t crc, const void* data, size_t n, uint32_t* out) {
#if defined(__x86_64__)
  if (cpu_has_sse42()) {
    *out = extend_sse42(crc, static_cast<const unsigned char*>(data), n);
    return true;
  }
#else
  (void)crc, (void)data, (void)n, (void)out;
#endif
  return false;
}

uint32_t crc32c_extend(uint32_t crc, const void* data, size_t n) {
  uint32_t out;
  if (crc32c_extend_hw(crc, data, n, &out)) return out;
  return crc32c_extend_portable(crc, data, n);
}

}  // namespace primus::io
