// Linear layer in the nn.Linear convention, on OpenBLAS (cblas_sgemm / cblas_dgemm).
// Shapes: inp [N,C], weight [OC,C] (each output channel is a row), bias [OC], out [N,OC].
// The tied GPT-2 head is the same call with weight = wte [V,C] and no bias.
// Threads: the GEMMs run on OpenMP's threads (OMP_NUM_THREADS), split by output rows; the first
// call sets OpenBLAS's own thread count to 1 for the whole process (see matmul.cpp for why).
#pragma once
#include <cstdint>

namespace primus::turbo::cpu {

// out = inp @ weight^T + bias   (overwrites out; bias may be nullptr).
// Needs nothing saved beyond inp and weight for the backward.
template <typename Real>
void matmul_forward(Real* out, const Real* inp, const Real* weight, const Real* bias, int64_t N,
                    int64_t C, int64_t OC);

// Backward of matmul_forward, from dout [N,OC]:
//   dinp    [N,C]  += dout @ weight        (skipped when dinp is nullptr)
//   dweight [OC,C] += dout^T @ inp         (skipped when dweight is nullptr)
//   dbias   [OC]   += sum over rows of dout (skipped when dbias is nullptr)
template <typename Real>
void matmul_backward(Real* dinp, Real* dweight, Real* dbias, const Real* dout, const Real* inp,
                     const Real* weight, int64_t N, int64_t C, int64_t OC);

// Row-major C[M,N] = alpha * op(A) @ op(B) + beta * C (op: transposed where asked), the product
// the two above run: C's rows split over OpenMP's threads in slices of whole 16-row tiles, BLAS on
// one thread each, so every element is summed the same way for any thread count. Every host GEMM
// goes through it (turbo::gemm's CPU backend too): OpenBLAS's own threads would split the work
// differently, and the process's results would change once the first call here set them to one.
void gemm_f32(bool trans_a, bool trans_b, int64_t M, int64_t N, int64_t K, float alpha, const float* A, int64_t lda,
              const float* B, int64_t ldb, float beta, float* C, int64_t ldc);

}  // namespace primus::turbo::cpu
