// Linear forward/backward on BLAS.
//
// Threading: every GEMM is split by rows of its output over OpenMP threads, each running a
// single-threaded BLAS call on its slice. OpenBLAS's own thread pool is switched off (once,
// process-wide) because its threads and OpenMP's both busy-wait between calls and so steal each
// other's cores. Measured on 2 cores (bench/cpu_kernels, GPT-2 layer C=384 T=256 B=8, forward +
// backward): 844 ms with both pools, 406 ms with OpenMP's alone, 836 ms on one thread. One pool,
// OpenMP's, serves every kernel of this folder.
//
// Determinism: the same call gives the same bits run to run. A different thread count splits the
// rows differently, and BLAS's edge tiles can then round a few elements differently in the last
// bit; the kernels of this folder that do not call BLAS are independent of the thread count.
#include "turbo/kernels/cpu/matmul.h"

#include <cblas.h>
#include <omp.h>

#include <algorithm>
#include <mutex>
#include <type_traits>

#include "turbo/kernels/cpu/parallel.h"

namespace primus::turbo::cpu {
namespace {

void use_single_threaded_blas() {
  static std::once_flag once;
  std::call_once(once, [] {
#ifdef OPENBLAS_VERSION
    openblas_set_num_threads(1);
#endif
  });
}

// Row-major C[M,N] = alpha * op(A) @ op(B) + beta * C on the calling thread.
template <typename Real>
void gemm_serial(bool trans_a, bool trans_b, int64_t M, int64_t N, int64_t K, Real alpha,
                 const Real* A, int64_t lda, const Real* B, int64_t ldb, Real beta, Real* C,
                 int64_t ldc) {
  const CBLAS_TRANSPOSE ta = trans_a ? CblasTrans : CblasNoTrans;
  const CBLAS_TRANSPOSE tb = trans_b ? CblasTrans : CblasNoTrans;
  if constexpr (std::is_same_v<Real, float>) {
    cblas_sgemm(CblasRowMajor, ta, tb, M, N, K, alpha, A, lda, B, ldb, beta, C, ldc);
  } else {
    cblas_dgemm(CblasRowMajor, ta, tb, M, N, K, alpha, A, lda, B, ldb, beta, C, ldc);
  }
}

// The same GEMM with the M rows of C split into one contiguous slice per OpenMP thread. Slices
// are multiples of kRowAlign rows so that BLAS's row tiles line up across slices.
template <typename Real>
void gemm(bool trans_a, bool trans_b, int64_t M, int64_t N, int64_t K, Real alpha, const Real* A,
          int64_t lda, const Real* B, int64_t ldb, Real beta, Real* C, int64_t ldc) {
  constexpr int64_t kRowAlign = 16;
  constexpr double kMinFlopsPerThread = 4e6;  // below this a thread costs more than it saves
  use_single_threaded_blas();
  const double flops =
      2.0 * static_cast<double>(M) * static_cast<double>(N) * static_cast<double>(K);
  const int64_t by_size = std::max<int64_t>(1, static_cast<int64_t>(flops / kMinFlopsPerThread));
  const int64_t by_rows = (M + kRowAlign - 1) / kRowAlign;
  const int64_t slices = std::min<int64_t>({omp_get_max_threads(), by_size, by_rows});
  const int64_t rows = (M + slices - 1) / slices;
  const int64_t per = (rows + kRowAlign - 1) / kRowAlign * kRowAlign;
#pragma omp parallel for schedule(static) if (slices > 1)
  for (int64_t s = 0; s < slices; ++s) {
    const int64_t m0 = std::min(M, s * per), m1 = std::min(M, m0 + per);
    if (m1 == m0) continue;
    // Row m of op(A) is row m of A, or column m of A when it is transposed.
    const Real* a = trans_a ? A + m0 : A + m0 * lda;
    gemm_serial<Real>(trans_a, trans_b, m1 - m0, N, K, alpha, a, lda, B, ldb, beta, C + m0 * ldc,
                      ldc);
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

void gemm_f32(bool trans_a, bool trans_b, int64_t M, int64_t N, int64_t K, float alpha, const float* A, int64_t lda,
              const float* B, int64_t ldb, float beta, float* C, int64_t ldc) {
  if (M <= 0 || N <= 0) return;
  gemm<float>(trans_a, trans_b, M, N, K, alpha, A, lda, B, ldb, beta, C, ldc);
}

#define PRIMUS_INSTANTIATE(Real)                                                                  \
  template void matmul_forward<Real>(Real*, const Real*, const Real*, const Real*, int64_t,       \
                                     int64_t, int64_t);                                           \
  template void matmul_backward<Real>(Real*, Real*, Real*, const Real*, const Real*, const Real*, \
                                      int64_t, int64_t, int64_t);
PRIMUS_INSTANTIATE(float)
PRIMUS_INSTANTIATE(double)
#undef PRIMUS_INSTANTIATE

}  // namespace primus::turbo::cpu
