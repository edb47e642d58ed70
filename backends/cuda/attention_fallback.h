// The fallback attention: llm.c's non-cuDNN path. q, k, v are permuted to head-major, the
// scores S = scale * Q K^T are materialised in f32 by batched cuBLASLt GEMMs (one batch entry
// per kv head: its query heads are contiguous rows, so grouped-query attention needs no copies
// of K and V), a causal softmax kernel writes P (bf16) and the log-sum-exp, and O = P V.
// The backward recomputes S and P from the saved lse (nothing [T,T] is kept between the
// passes), then dV = P^T dO, dP = dO V^T, dS = P (dP - rowsum(P dP)), dQ = dS K, dK = dS^T Q.
//
// bf16 device tensors (or f32 host tensors: the same GEMMs on Turbo's CPU backend, with host
// loops for the small kernels, so the orchestration is tested without a GPU). Any head_dim
// that is a multiple of 8; memory O(B H T^2) of scratch (ctx.scratch), compute twice the
// causal minimum. It is the correctness baseline the fast kernels are tested
// against, and what runs where they cannot (a build without the Turbo attention op).
#pragma once
#include <cstddef>
#include <cstdint>

#include "backends/cuda/hooks.h"

namespace primus::backends::cuda {

void fallback_attention_forward(const AttentionCall& c);
void fallback_attention_backward(const AttentionGradCall& c);

// Scratch bytes (from ctx.scratch) the backward needs (the forward needs less); act_bytes: 2 for
// bf16 device tensors, 4 for f32 host tensors.
size_t fallback_attention_scratch_bytes(int64_t B, int64_t T, int64_t H, int64_t KVH, int64_t D,
                                        size_t act_bytes = 2);

}  // namespace primus::backends::cuda
