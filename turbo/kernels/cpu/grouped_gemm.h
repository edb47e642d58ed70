// Grouped GEMM of mixture-of-experts layers on the host: the reference the device kernels of
// turbo/ops/grouped_gemm.h are tested against (fp32 for training, fp64 for checks), on
// matmul.h's OpenBLAS products, one per group.
//
// Groups: offsets [G+1] (offsets[0] = 0, non-decreasing); group g owns rows
// [offsets[g], offsets[g+1]) of the row-major token matrices. Rows from offsets[G] on are neither
// read nor written (the buffers may be sized for the worst routing). Weights follow nn.Linear per
// expert: weight [G,N,K], expert g maps K input features to N outputs.
#pragma once
#include <cstdint>

namespace primus::turbo::cpu {

// out [rows, N] of group g = inp [rows, K] @ weight[g]^T   (overwrites)
template <typename Real>
void grouped_gemm_forward(Real* out, const Real* inp, const Real* weight, const int32_t* offsets, int64_t G,
                          int64_t N, int64_t K);

// dinp [rows, K] of group g = dout [rows, N] @ weight[g]   (overwrites)
template <typename Real>
void grouped_gemm_dgrad(Real* dinp, const Real* dout, const Real* weight, const int32_t* offsets, int64_t G,
                        int64_t N, int64_t K);

// dweight[g] [N, K] = dout_g^T @ inp_g, summed over the group's rows (+= when accumulate, else
// overwritten: a group without rows then gets zeros).
template <typename Real>
void grouped_gemm_wgrad(Real* dweight, const Real* dout, const Real* inp, const int32_t* offsets, int64_t G,
                        int64_t N, int64_t K, bool accumulate);

}  // namespace primus::turbo::cpu
