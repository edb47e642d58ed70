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

// Per-head RMSNorm (Qwen3's query/key norms): x [N, Hx, D] is N tokens of Hx heads; heads
// [0, q_heads) are normalised with wq [D], the others with wk [D] (the query heads and the key
// heads of one packed projection). Each (token, head) row is an RMSNorm of D: out = x * rstd *
// w, rstd [N*Hx] saved. out may alias inp.
template <typename Real>
void head_rmsnorm_forward(Real* out, Real* rstd, const Real* inp, const Real* wq, const Real* wk, int64_t N,
                          int64_t Hx, int64_t q_heads, int64_t D, double eps);

// Accumulates dinp [N, Hx, D] += and dwq, dwk [D] += from dout, using the forward's inp and rstd.
template <typename Real>
void head_rmsnorm_backward(Real* dinp, Real* dwq, Real* dwk, const Real* dout, const Real* inp, const Real* wq,
                           const Real* wk, const Real* rstd, int64_t N, int64_t Hx, int64_t q_heads, int64_t D);

}  // namespace primus::turbo::cpu
