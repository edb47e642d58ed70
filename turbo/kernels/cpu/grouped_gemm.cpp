#include "turbo/kernels/cpu/grouped_gemm.h"

#include <algorithm>

#include "turbo/kernels/cpu/matmul.h"

namespace primus::turbo::cpu {

// Each group is one dense product (matmul.h's, which spreads its rows over OpenMP's threads); the
// groups run in order, so no result depends on how the rows are grouped beyond the products'
// own tiling.
template <typename Real>
void grouped_gemm_forward(Real* out, const Real* inp, const Real* weight, const int32_t* offsets, int64_t G,
                          int64_t N, int64_t K) {
  for (int64_t g = 0; g < G; ++g) {
    const int64_t r0 = offsets[g], rows = offsets[g + 1] - offsets[g];
    if (rows > 0) matmul_forward<Real>(out + r0 * N, inp + r0 * K, weight + g * N * K, nullptr, rows, K, N);
  }
}

template <typename Real>
void grouped_gemm_dgrad(Real* dinp, const Real* dout, const Real* weight, const int32_t* offsets, int64_t G,
                        int64_t N, int64_t K) {
  for (int64_t g = 0; g < G; ++g) {
    const int64_t r0 = offsets[g], rows = offsets[g + 1] - offsets[g];
    if (rows <= 0) continue;
    std::fill(dinp + r0 * K, dinp + (r0 + rows) * K, Real(0));  // matmul_backward adds
    matmul_backward<Real>(dinp + r0 * K, nullptr, nullptr, dout + r0 * N, nullptr, weight + g * N * K, rows, K, N);
  }
}

template <typename Real>
void grouped_gemm_wgrad(Real* dweight, const Real* dout, const Real* inp, const int32_t* offsets, int64_t G,
                        int64_t N, int64_t K, bool accumulate) {
  for (int64_t g = 0; g < G; ++g) {
    Real* dw = dweight + g * N * K;
    if (!accumulate) std::fill(dw, dw + N * K, Real(0));
    const int64_t r0 = offsets[g], rows = offsets[g + 1] - offsets[g];
    if (rows > 0) matmul_backward<Real>(nullptr, dw, nullptr, dout + r0 * N, inp + r0 * K, nullptr, rows, K, N);
  }
}

#define PRIMUS_INSTANTIATE(Real)                                                                                  \
  template void grouped_gemm_forward<Real>(Real*, const Real*, const Real*, const int32_t*, int64_t, int64_t,   \
                                           int64_t);                                                            \
  template void grouped_gemm_dgrad<Real>(Real*, const Real*, const Real*, const int32_t*, int64_t, int64_t,     \
                                         int64_t);                                                              \
  template void grouped_gemm_wgrad<Real>(Real*, const Real*, const Real*, const int32_t*, int64_t, int64_t,     \
                                         int64_t, bool);
PRIMUS_INSTANTIATE(float)
PRIMUS_INSTANTIATE(double)
#undef PRIMUS_INSTANTIATE

}  // namespace primus::turbo::cpu
