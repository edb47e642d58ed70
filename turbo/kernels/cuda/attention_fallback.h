// Kernels of the fallback attention (turbo/ops/attention_fallback.cpp), llm.c's non-cuDNN
// path: permute q/k/v between token-major [B,T,Hx,D] and head-major [B,Hx,T,D], a causal
// softmax over materialised f32 scores that also writes the log-sum-exp, and its backward.
// bf16 storage, f32 arithmetic. All launches are stream-ordered and checked.
#pragma once
#include <cuda_runtime_api.h>

#include <cstdint>

namespace primus::turbo::cuda {

// dst [B,Hx,T,D] = src [B,T,Hx,D] (to_heads) or the inverse (from_heads); bf16, D % 8 == 0. The
// token-major side's tokens are `row` elements apart (0: Hx*D; a multiple of 8).
void permute_to_heads(void* dst, const void* src, int64_t B, int64_t T, int64_t Hx, int64_t D, cudaStream_t s,
                      int64_t src_row = 0);
void permute_from_heads(void* dst, const void* src, int64_t B, int64_t T, int64_t Hx, int64_t D, cudaStream_t s,
                        int64_t dst_row = 0);

// Rows are (b, h, t) in that order, each holding T scores s[j] (already scaled). Causal: only
// j <= t counts. Writes p (bf16) = exp(s - lse) for j <= t and 0 beyond; with write_lse the
// row's lse is computed and written to lse[(b*H + h)*T + t], otherwise it is read from there.
void causal_softmax_forward(void* p, float* lse, const float* s, int64_t rows, int64_t T, bool write_lse,
                            cudaStream_t stream);

// ds (bf16, may alias nothing else) = scale * p * (dp - sum_j p dp), p recomputed in f32 from
// s and lse; zero for j > t.
void causal_softmax_backward(void* ds, const float* s, const float* lse, const float* dp, int64_t rows, int64_t T,
                             float scale, cudaStream_t stream);

}  // namespace primus::turbo::cuda
