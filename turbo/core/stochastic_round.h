// Stochastic rounding of fp32 values to bf16, keyed by position and step, the same bits on the
// host and on the device (AdamW's bf16 moments: turbo/ops/optimizer.h).
//
// Why stochastic: an AdamW moment moves by a fraction (1 - beta) of its distance to the new
// gradient term each step. bf16 keeps 8 significant bits, so with round to nearest any move
// smaller than half an ulp (2^-9 = 0.2% of the value) is lost: with beta2 = 0.999 the second
// moment can then only grow, never decay (v * 0.999 rounds back to v). Rounding the magnitude up
// with probability (low 16 bits) / 2^16 makes the stored value exact in expectation, so small moves
// accumulate on average.
//
// The random bits are a hash of the element's key (its offset in the flat parameter layout, so a
// tensor's elements get the same bits however the optimizer's tables cut them) and the step:
// a pure function, so a step replayed from a checkpoint, an eager step and a graph replay store
// the same bits, and the CPU reference reproduces the device's.
#pragma once
#include <cstdint>
#include <cstring>

#if defined(__CUDACC__)
#define PRIMUS_SR_HD __host__ __device__ __forceinline__
#else
#define PRIMUS_SR_HD inline
#endif

namespace primus::turbo {

// 32 pseudo-random bits of (key, step): a 64-bit key folded to 32, then Wellons' lowbias32 mixer.
PRIMUS_SR_HD uint32_t sr_hash(uint64_t key, uint32_t step) {
  uint32_t x = static_cast<uint32_t>(key) ^ (static_cast<uint32_t>(key >> 32) * 0x27d4eb2du);
  x = x * 0x9e3779b1u + step * 0x85ebca77u + 0x165667b1u;
  x ^= x >> 16;
  x *= 0x7feb352du;
  x ^= x >> 15;
  x *= 0x846ca68bu;
  x ^= x >> 16;
  return x;
}

// The bf16 bits of x rounded stochastically with the 16 random bits r (the low half of r is
// used): the magnitude rounds up exactly when low16(x) + r >= 2^16. Infinities and NaN keep
// their class (round to nearest even there).
PRIMUS_SR_HD uint16_t bf16_bits_stochastic(float x, uint32_t r) {
  uint32_t b;
#if defined(__CUDA_ARCH__)
  b = __float_as_uint(x);
#else
  std::memcpy(&b, &x, 4);
#endif
  if ((b & 0x7f800000u) == 0x7f800000u) {
    if (b & 0x007fffffu) return static_cast<uint16_t>((b >> 16) | 0x40u);  // a quiet NaN
    return static_cast<uint16_t>(b >> 16);                                 // +-inf
  }
  return static_cast<uint16_t>((b + (r & 0xffffu)) >> 16);
}

// The float a bf16 bit pattern stands for.
PRIMUS_SR_HD float bf16_bits_value(uint16_t h) {
  const uint32_t b = static_cast<uint32_t>(h) << 16;
#if defined(__CUDA_ARCH__)
  return __uint_as_float(b);
#else
  float f;
  std::memcpy(&f, &b, 4);
  return f;
#endif
}

// AdamW's moments draw their bits from one hash per element: the low 16 for m, the high 16 for v.
PRIMUS_SR_HD float sr_round_m(float m, uint32_t h) { return bf16_bits_value(bf16_bits_stochastic(m, h)); }
PRIMUS_SR_HD float sr_round_v(float v, uint32_t h) { return bf16_bits_value(bf16_bits_stochastic(v, h >> 16)); }

}  // namespace primus::turbo
