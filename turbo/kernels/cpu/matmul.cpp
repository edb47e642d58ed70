// Linear forward/backward on BLAS. The GEMMs are called from outside any OpenMP region so
// OpenBLAS uses its own threads; only the bias work runs under OpenMP.
// Determinism: repeated calls with the same OpenBLAS thread count give the same bits, but
// OpenBLAS's edge tiles depend on how it partitions the matrix, so a different thread count can
// change the last bits of a few percent of the elements (measured with OpenBLAS 0.3.21). The
// kernels of this folder that do not call BLAS are independent of the thread count.
#include "turbo/kernels/cpu/matmul.h"

#include <cblas.h>

#include <type_traits>

#include "turbo/kernels/cpu/parallel.h"

namespace primus::turbo::cpu {
namespace {

// Row-major C[M,N] = alpha * op(A) @ op(B) + beta * C, dispatched on the element type.
template <typename Real>
void gemm(bool trans_a, bool trans_b, int64_t M, int64_t N, int64_t K, Real alpha, const Real* A,
          int64_t lda, const Real* B, int64_t ldb, Real beta, Real* C, int64_t ldc) {
  const CBLAS_TRANSPOSE ta = trans_a ? CblasTrans : CblasNoTrans;
  const CBLAS_TRANSPOSE tb = trans_b ? CblasTrans : CblasNoTrans;
  if constexpr (std::is_same_v<Real, float>) {
    cblas_sgemm(CblasRowMajor, ta, tb, M, N, K, alpha, A, lda, B, ldb, beta, C, ldc);
  } else {
    cblas_dgemm(CblasRowMajor, ta, tb, M, N, K, alpha, A, lda, B, ldb, beta, C, ldc);
  }
}

}  // namespace

template <typename Real>
void matmul_forward(Real* out, const Real* inp, const Real* weight, const Real* bias, int64_t N,
                    int64_t C, int64_t OC) {
  if (N == 0 || OC == 0) return;
  if (bias) {
    // Start from the broadcast bias and let the GEMM add into it (beta = 1): one pass over out.
#pragma omp parallel for schedule(static)
    for (int64_t n = 0; n < N; ++n) {
      Real* o = out + n * OC;
      for (int64_t j = 0; j < OC; ++j) o[j] = bias[j];
    }
  }
  gemm<Real>(false, true, N, OC, C, Real(1), inp, C, weight, C, bias ? Real(1) : Real(0), out, OC);
}

template <typename Real>
void matmul_backward(Real* dinp, Real* dweight, Real* dbias, const Real* dout, const Real* inp,
                     const Real* weight, int64_t N, int64_t C, int64_t OC) {
  if (N == 0) return;
  if (dinp) gemm<Real>(false, false, N, C, OC, Real(1), dout, OC, weight, C, Real(1), dinp, C);
  if (dweight) gemm<Real>(true, false, OC, C, N, Real(1), dout, OC, inp, C, Real(1), dweight, C);
  if (dbias) {
    detail::for_column_blocks(OC, [&](int64_t j0, int64_t j1) {
      for (int64_t n = 0; n < N; ++n) {
        const Real* d = dout + n * OC;
        for (int64_t j = j0; j < j1; ++j) dbias[j] += d[j];
      }
    });
  }
}

#define PRIMUS_INSTANTIATE(Real)                                                                \
  template void matmul_forward<Real>(Real*, const Real*, const Real*, const Real*, int64_t,     \
                                     int64_t, int64_t);                                         \
  template void matmul_backward<Real>(Real*, Real*, Real*, const Real*, const Real*,            \
                                      const Real*, int64_t, int64_t, int64_t);
PRIMUS_INSTANTIATE(float)
PRIMUS_INSTANTIATE(double)
#undef PRIMUS_INSTANTIATE

}  // namespace primus::turbo::cpu
