#include "turbo/kernels/cpu/residual.h"

namespace primus::turbo::cpu {
namespace {

template <typename Real>
void accumulate(Real* dst, const Real* src, int64_t n) {
#pragma omp parallel for simd schedule(static)
  for (int64_t i = 0; i < n; ++i) dst[i] += src[i];
}

}  // namespace

template <typename Real>
void residual_forward(Real* out, const Real* a, const Real* b, int64_t n) {
#pragma omp parallel for simd schedule(static)
  for (int64_t i = 0; i < n; ++i) out[i] = a[i] + b[i];
}

template <typename Real>
void residual_backward(Real* da, Real* db, const Real* dout, int64_t n) {
  if (da) accumulate(da, dout, n);
  if (db) accumulate(db, dout, n);
}

template void residual_forward<float>(float*, const float*, const float*, int64_t);
template void residual_forward<double>(double*, const double*, const double*, int64_t);
template void residual_backward<float>(float*, float*, const float*, int64_t);
template void residual_backward<double>(double*, double*, const double*, int64_t);

}  // namespace primus::turbo::cpu
