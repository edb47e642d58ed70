// RoPE. cos/sin depend only on (position, pair), so they are computed once per token and shared
// by its H heads; forward and backward are one kernel with the sign of the angle flipped.
#include "turbo/kernels/cpu/rope.h"

#include <cmath>
#include <vector>

#include "core/util/error.h"

namespace primus::turbo::cpu {
namespace {

// sign = +1 rotates (forward), -1 rotates back (backward). accumulate: out += R x, else out = R x.
template <typename Real>
void rotate(Real* out, const Real* inp, const int32_t* positions, int64_t B, int64_t T, int64_t H,
            int64_t D, double base, const RopeScaling& scaling, double sign, bool accumulate) {
  PRIMUS_CHECK(D % 2 == 0, "rope: head dimension D={} must be even", D);
  const int64_t pairs = D / 2;
  std::vector<double> inv_freq(static_cast<size_t>(pairs));
  rope_inv_freq(inv_freq.data(), D, base, scaling);
#pragma omp parallel
  {
    std::vector<Real> cs(static_cast<size_t>(pairs)), sn(static_cast<size_t>(pairs));
#pragma omp for schedule(static)
    for (int64_t bt = 0; bt < B * T; ++bt) {
      const double pos = positions ? positions[bt] : static_cast<double>(bt % T);
      for (int64_t i = 0; i < pairs; ++i) {
        const double angle = pos * inv_freq[i];
        cs[i] = static_cast<Real>(std::cos(angle));
        sn[i] = static_cast<Real>(sign * std::sin(angle));
      }
      for (int64_t h = 0; h < H; ++h) {
        const Real* x = inp + (bt * H + h) * D;
        Real* y = out + (bt * H + h) * D;
        for (int64_t i = 0; i < pairs; ++i) {
          const Real x0 = x[2 * i], x1 = x[2 * i + 1];
          const Real y0 = x0 * cs[i] - x1 * sn[i];
          const Real y1 = x0 * sn[i] + x1 * cs[i];
          if (accumulate) {
            y[2 * i] += y0;
            y[2 * i + 1] += y1;
          } else {
            y[2 * i] = y0;
            y[2 * i + 1] = y1;
          }
        }
      }
    }
  }
}

}  // namespace

void rope_inv_freq(double* inv_freq, int64_t D, double base, const RopeScaling& s) {
  PRIMUS_CHECK(D % 2 == 0, "rope: head dimension D={} must be even", D);
  PRIMUS_CHECK(base > 0, "rope: base {} must be positive", base);
  if (s.enabled) {
    PRIMUS_CHECK(s.factor > 0, "rope scaling: factor {} must be positive", s.factor);
    PRIMUS_CHECK(s.low_freq_factor > 0 && s.high_freq_factor > s.low_freq_factor,
                 "rope scaling: needs 0 < low_freq_factor ({}) < high_freq_factor ({})", s.low_freq_factor,
                 s.high_freq_factor);
    PRIMUS_CHECK(s.original_max_position > 0, "rope scaling: original_max_position_embeddings {} must be positive",
                 s.original_max_position);
  }
  const double low_wavelen = s.original_max_position / s.low_freq_factor;
  const double high_wavelen = s.original_max_position / s.high_freq_factor;
  constexpr double kPi = 3.14159265358979323846;
  for (int64_t i = 0; i < D / 2; ++i) {
    const double f = std::pow(base, -2.0 * static_cast<double>(i) / static_cast<double>(D));
    if (!s.enabled) {
      inv_freq[i] = f;
      continue;
    }
    const double wavelen = 2.0 * kPi / f;
    if (wavelen < high_wavelen) {
      inv_freq[i] = f;
    } else if (wavelen > low_wavelen) {
      inv_freq[i] = f / s.factor;
    } else {
      const double smooth =
          (s.original_max_position / wavelen - s.low_freq_factor) / (s.high_freq_factor - s.low_freq_factor);
      inv_freq[i] = (1.0 - smooth) * f / s.factor + smooth * f;
    }
  }
}

template <typename Real>
void rope_forward(Real* out, const Real* inp, const int32_t* positions, int64_t B, int64_t T,
                  int64_t H, int64_t D, double base, const RopeScaling& scaling) {
  rotate(out, inp, positions, B, T, H, D, base, scaling, +1.0, false);
}

template <typename Real>
void rope_backward(Real* dinp, const Real* dout, const int32_t* positions, int64_t B, int64_t T,
                   int64_t H, int64_t D, double base, const RopeScaling& scaling) {
  rotate(dinp, dout, positions, B, T, H, D, base, scaling, -1.0, true);
}

void rope_half_split_permutation(int64_t* perm, int64_t D) {
  PRIMUS_CHECK(D % 2 == 0, "rope: head dimension D={} must be even", D);
  for (int64_t i = 0; i < D / 2; ++i) {
    perm[2 * i] = i;
    perm[2 * i + 1] = i + D / 2;
  }
}

template <typename Real>
void rope_permute_rows(Real* out, const Real* w, int64_t n_heads, int64_t D, int64_t cols,
                       bool to_interleaved) {
  std::vector<int64_t> perm(static_cast<size_t>(D));
  rope_half_split_permutation(perm.data(), D);
  for (int64_t h = 0; h < n_heads; ++h) {
    for (int64_t j = 0; j < D; ++j) {
      const int64_t ours = h * D + j, theirs = h * D + perm[j];
      const int64_t dst = to_interleaved ? ours : theirs, src = to_interleaved ? theirs : ours;
      for (int64_t c = 0; c < cols; ++c) out[dst * cols + c] = w[src * cols + c];
    }
  }
}

#define PRIMUS_INSTANTIATE(Real)                                                                   \
  template void rope_forward<Real>(Real*, const Real*, const int32_t*, int64_t, int64_t, int64_t,  \
                                   int64_t, double, const RopeScaling&);                           \
  template void rope_backward<Real>(Real*, const Real*, const int32_t*, int64_t, int64_t, int64_t, \
                                    int64_t, double, const RopeScaling&);                          \
  template void rope_permute_rows<Real>(Real*, const Real*, int64_t, int64_t, int64_t, bool);
PRIMUS_INSTANTIATE(float)
PRIMUS_INSTANTIATE(double)
#undef PRIMUS_INSTANTIATE

}  // namespace primus::turbo::cpu
