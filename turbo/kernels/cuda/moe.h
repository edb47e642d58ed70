// Launchers of the MoE routing kernels (moe.cu): the fused router and its backward, the row plan,
// permute / unpermute and their backwards. Semantics are those of the reference kernels
// (turbo/kernels/cpu/moe.h); shapes as there: N tokens, E experts, K slots per token, C hidden.
//
// Nothing here synchronises with the host or reads a size from device memory on the host: every
// grid and scratch size follows from (N, K, E, C, capacity), the routing itself is read by the
// kernels, so a step that calls these can be captured as one CUDA graph. Scratch buffers come
// from the caller (sizes from the *_scratch_bytes functions), 256-byte aligned.
#pragma once
#include <cuda_runtime_api.h>

#include <cstddef>
#include <cstdint>

#include "turbo/core/dtype.h"
#include "turbo/kernels/cpu/moe.h"

namespace primus::turbo::cuda {

// Limits of these kernels (the ops' can_handle checks them): experts per router row (a warp
// holds a row, 8 experts a lane), slots per token (one lane each), groups (one lane each),
// experts of the plan (per-warp shared-memory tables).
inline constexpr int64_t kMoeMaxRouterExperts = 256;
inline constexpr int64_t kMoeMaxTopK = 32;
inline constexpr int64_t kMoeMaxGroups = 32;
inline constexpr int64_t kMoeMaxPlanExperts = 512;

// The router: logits [N,E] f32, bias [E] or nullptr; outputs as cpu::router_forward (counts,
// prob_sum and z_sum overwritten). The per-token arithmetic runs in fp64, as the reference's
// does, so that both pick the same experts (see moe.cu).
size_t router_forward_scratch_bytes(int64_t N, int64_t E);
void router_forward(int32_t* topk_idx, float* topk_weight, float* probs, int32_t* counts, float* prob_sum,
                    float* z_sum, const float* logits, const float* bias, int64_t N, const cpu::RouterConfig& cfg,
                    void* scratch, cudaStream_t stream);
// dlogits [N,E] (overwritten), as cpu::router_backward; seq.seqs == 0: the switch loss (counts [E]),
// else the sequence-wise loss (counts [seq.seqs, E]); `more` (at most two) as the CPU kernel's.
void router_backward(float* dlogits, const float* dweight, const float* logits, const int32_t* topk_idx,
                     const int32_t* counts, int64_t N, const cpu::RouterConfig& cfg, double aux_coeff,
                     double z_coeff, const cpu::SequenceRuns& seq, cudaStream_t stream,
                     const cpu::AuxTerm* more = nullptr, size_t n_more = 0);

// logits [N,E] <- cpu::moe_random_logit(seed, n, e), bit for bit.
void moe_random_logits(float* logits, int64_t N, int64_t E, uint64_t seed, cudaStream_t stream);

// The sequence-wise aux loss's statistics, as cpu::moe_sequence_stats: counts and prob_sum
// [q.seqs, E] (overwritten); prob_sum in a fixed order (deterministic).
void moe_sequence_stats(int32_t* counts, float* prob_sum, const int32_t* topk_idx, const float* probs, int64_t N,
                        const cpu::SequenceRuns& q, int64_t K, int64_t E, cudaStream_t stream);

// The row plan, as cpu::moe_plan_rows (counts recounted from topk_idx, as the reference does;
// slots whose expert is outside [0, E) are treated as dropped). topk_weight is read only when
// capacity >= 0 and policy is Probs.
size_t moe_plan_scratch_bytes(int64_t N, int64_t K, int64_t E, int64_t capacity, cpu::DropPolicy policy);
void moe_plan_rows(int32_t* row_of_slot, int32_t* offsets, int32_t* kept, const int32_t* topk_idx,
                   const float* topk_weight, int64_t N, int64_t K, int64_t E, int64_t align, int64_t capacity,
                   cpu::DropPolicy policy, void* scratch, cudaStream_t stream);

// Token tensors are `dtype` (f32 or bf16), rows of C elements. `rows` is the row count of the
// permuted buffer: a row index at or past it (a plan that does not fit) is skipped, never written.
// out [rows, C] <- inp [N, C]; padding rows of each group zeroed.
void moe_permute(DType dtype, void* out, const void* inp, const int32_t* row_of_slot, const int32_t* offsets,
                 const int32_t* kept, int64_t N, int64_t K, int64_t E, int64_t C, int64_t rows, cudaStream_t stream);
// dinp [N, C] (+= when accumulate) = sum of the token's kept rows of dout [rows, C].
void moe_permute_backward(DType dtype, void* dinp, const void* dout, const int32_t* row_of_slot, int64_t N,
                          int64_t K, int64_t C, int64_t rows, bool accumulate, cudaStream_t stream);
// out [N, C] (+= when accumulate) = sum_k weight[n,k] * inp[row_of_slot[n,k]], weight f32.
void moe_unpermute(DType dtype, void* out, const void* inp, const float* weight, const int32_t* row_of_slot,
                   int64_t N, int64_t K, int64_t C, int64_t rows, bool accumulate, cudaStream_t stream);
// dinp [rows, C]: weight * dout at each kept slot's row, padding rows zeroed; dweight [N,K] f32 =
// <dout[n], inp[row]> (0 for a dropped slot).
void moe_unpermute_backward(DType dtype, void* dinp, float* dweight, const void* dout, const void* inp,
                            const float* weight, const int32_t* row_of_slot, const int32_t* offsets,
                            const int32_t* kept, int64_t N, int64_t K, int64_t E, int64_t C, int64_t rows,
                            cudaStream_t stream);

}  // namespace primus::turbo::cuda
