// Internal (not part of the public API): what makes the hot loops vectorise.
//
// PRIMUS_CPU_CLONES compiles a function three times, for AVX-512 (x86-64-v4), AVX2+FMA
// (x86-64-v3) and baseline x86-64, and the loader picks the best one for the CPU it runs on: the
// binary stays portable (no -march) yet uses the wide units where they exist. Put it on a function
// that holds a whole hot loop nest, with its helpers inlined (always_inline) into it. A consequence
// to know: the vector width, and so the rounding of vectorised reductions, then depends on the CPU;
// results are reproducible on one machine, not bitwise across machines.
//
// glibc's expf/tanhf are calls, so every loop that uses them stays scalar, and they dominate
// GELU, SwiGLU, the attention softmax and the cross-entropy over a 50k vocabulary. exp_fast is
// Cody-Waite range reduction plus Cephes' degree-5 polynomial (about 1 ulp), written without
// calls or branches so a loop over it vectorises. Only float takes this path: double keeps
// std::exp, since fp64 is what the gradient-check tests run and speed does not matter there.
#pragma once
#include <bit>
#include <cmath>
#include <cstdint>
#include <limits>
#include <type_traits>

#if defined(__GNUC__) && !defined(__clang__) && defined(__x86_64__) && \
    !defined(PRIMUS_NO_CPU_CLONES)
#define PRIMUS_CPU_CLONES \
  __attribute__((target_clones("arch=x86-64-v4", "arch=x86-64-v3", "default")))
#else
#define PRIMUS_CPU_CLONES
#endif
#define PRIMUS_INLINE inline __attribute__((always_inline))

namespace primus::turbo::cpu::detail {

// exp(x) for float: ~1 ulp on [-87.3, 88.7]; exactly 0 below (so exp(-inf) = 0 for masked
// scores; denormal results are flushed), +inf above, NaN for NaN.
PRIMUS_INLINE float exp_fast(float x) {
  constexpr float kLog2e = 1.44269504088896341f;
  constexpr float kLn2Hi = 0.693359375f, kLn2Lo = -2.12194440e-4f;
  constexpr float kRound = 12582912.0f;  // 1.5 * 2^23: adding it rounds to an integer
  constexpr float kMin = -87.33654f, kMax = 88.72283f;
  // NaN fails both comparisons and becomes kMin here (so the float->int cast below stays
  // defined); the last line returns it as NaN.
  const float xc = x >= kMin ? (x <= kMax ? x : kMax) : kMin;
  const float n = (xc * kLog2e + kRound) - kRound;
  const float r = (xc - n * kLn2Hi) - n * kLn2Lo;
  float p = 1.9875691500e-4f;
  p = p * r + 1.3981999507e-3f;
  p = p * r + 8.3334519073e-3f;
  p = p * r + 4.1665795894e-2f;
  p = p * r + 1.6666665459e-1f;
  p = p * r + 5.0000001201e-1f;
  p = p * r * r + r + 1.0f;
  // 2^n in two halves so that n = 128 (x near kMax) does not overflow the exponent field.
  const int32_t ni = static_cast<int32_t>(n);
  const int32_t half = ni >> 1;
  const float s1 = std::bit_cast<float>(static_cast<uint32_t>(half + 127) << 23);
  const float s2 = std::bit_cast<float>(static_cast<uint32_t>(ni - half + 127) << 23);
  float y = p * s1 * s2;
  y = x < kMin ? 0.0f : y;
  y = x > kMax ? std::numeric_limits<float>::infinity() : y;
  return x != x ? x : y;
}

template <typename Real>
PRIMUS_INLINE Real exp_v(Real x) {
  if constexpr (std::is_same_v<Real, float>) {
    return exp_fast(x);
  } else {
    return std::exp(x);
  }
}

// 1 / (1 + exp(-x)), through exp_v.
template <typename Real>
PRIMUS_INLINE Real sigmoid_v(Real x) {
  return Real(1) / (Real(1) + exp_v(-x));
}

}  // namespace primus::turbo::cpu::detail
