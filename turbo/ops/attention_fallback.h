// The fallback attention: llm.c's non-cuDNN path. q, k, v are permuted to head-major, the
// scores S = scale * Q K^T are materialised in f32 by batched GEMMs (turbo::gemm; one batch entry
// per kv head: its query heads are contiguous rows, so grouped-query attention needs no copies
// of K and V), a causal softmax kernel writes P and the log-sum-exp, and O = P V.
// The backward recomputes S and P from the saved lse (nothing [T,T] is kept between the
// passes), then dV = P^T dO, dP = dO V^T, dS = P (dP - rowsum(P dP)), dQ = dS K, dK = dS^T Q.
//
// bf16 device tensors (or f32 host tensors: the same GEMMs on Turbo's CPU backend, with host
// loops for the small kernels, so the orchestration is tested without a GPU). Causal, one
// sequence per row (opt.cu_seqlens undefined); any head_dim that is a multiple of 8; q/k/v may be
// column slices of a packed projection (token rows a multiple of 8 elements apart). Memory
// O(B H T^2) of scratch (ctx.scratch), compute twice the causal minimum. It is the correctness
// baseline the fast kernels are tested against, and what runs where they cannot (a build
// without the Turbo attention op). CUDA builds only (the kernels are turbo/kernels/cuda's).
#pragma once
#include <cstddef>
#include <cstdint>

#include "turbo/ops/attention.h"

namespace primus::turbo {

void attention_fallback_forward(const AttentionForwardArgs& args);
void attention_fallback_backward(const AttentionBackwardArgs& args);

// Scratch bytes (from ctx.scratch) the backward needs (the forward needs less); act_bytes: 2 for
// bf16 device tensors, 4 for f32 host tensors.
size_t attention_fallback_scratch_bytes(int64_t B, int64_t T, int64_t H, int64_t KVH, int64_t D,
                                        size_t act_bytes = 2);

}  // namespace primus::turbo
