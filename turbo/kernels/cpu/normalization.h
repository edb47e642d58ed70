// LayerNorm (GPT-2) and RMSNorm (Llama) over the last dimension, forward and backward.
// Shapes: inp/out/dout/dinp [N,C] (N = B*T rows), weight/bias [C], saved statistics [N].
// Statistics are accumulated in double; the saved mean/rstd are stored as Real.
#pragma once
#include <cstdint>

namespace primus::turbo::cpu {

// out = (inp - mean) * rstd * weight + bias, with rstd = 1/sqrt(var + eps), var biased (/C).
// Overwrites out, mean[N], rstd[N]; mean and rstd are what layernorm_backward needs.
template <typename Real>
void layernorm_forward(Real* out, Real* mean, Real* rstd, const Real* inp, const Real* weight,
                       const Real* bias, int64_t N, int64_t C, double eps);

// Accumulates dinp[N,C] +=, dweight[C] +=, dbias[C] += from dout[N,C], using the forward's inp,
// weight, mean and rstd. dbias may be nullptr (a LayerNorm without bias).
template <typename Real>
void layernorm_backward(Real* dinp, Real* dweight, Real* dbias, const Real* dout, const Real* inp,
                        const Real* weight, const Real* mean, const Real* rstd, int64_t N,
                        int64_t C);

// out = inp * rstd * weight, with rstd = 1/sqrt(mean(inp^2) + eps). Overwrites out and rstd[N]
// (saved for rmsnorm_backward).
template <typename Real>
void rmsnorm_forward(Real* out, Real* rstd, const Real* inp, const Real* weight, int64_t N,
                     int64_t C, double eps);

// Accumulates dinp[N,C] += and dweight[C] += from dout[N,C], using inp, weight and rstd.
template <typename Real>
void rmsnorm_backward(Real* dinp, Real* dweight, const Real* dout, const Real* inp,
                      const Real* weight, const Real* rstd, int64_t N, int64_t C);

}  // namespace primus::turbo::cpu
