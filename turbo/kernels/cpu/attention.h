// Scaled dot-product self-attention with grouped-query attention (GQA), causal or not, over
// whole rows or over packed variable-length documents. Forward and backward, flash-attention
// style: the forward saves only the log-sum-exp of each score row; the backward recomputes the
// probabilities from it (no [T,T] matrix is kept between the two).
//
// Shapes (row-major, separate contiguous tensors):
//   q, dq   [B,T,H,D]      k, v, dk, dv  [B,T,KVH,D]      out, dout [B,T,H,D]
//   lse     [B,H,T]        lse[b,h,t] = log(sum_j exp(scale * q[b,t,h]·k[b,j,g]))
// Query head h reads key/value head g = h / (H / KVH) (H must be a multiple of KVH; KVH = H is
// ordinary multi-head attention, KVH = 1 multi-query attention).
#pragma once
#include <cstdint>
#include <optional>

namespace primus::turbo::cpu {

struct AttentionParams {
  int64_t B = 0, T = 0, H = 0, KVH = 0, D = 0;
  bool causal = true;  // query t sees keys <= t (within its document)
  // Sliding window (needs causal): query t sees keys j with t - window < j <= t (window keys,
  // itself included; positions within its document), as transformers' Mistral
  // (sliding_window_overlay: kv_idx > q_idx - sliding_window). 0: no window.
  int64_t window = 0;
  // Multiplies q·k before the softmax; unset means 1/sqrt(D).
  std::optional<double> softmax_scale;
  // Packed documents (nullptr: each batch row is one sequence). cu_seqlens[0..num_docs] are
  // cumulative token offsets over the flattened B*T axis, as flash-attention's varlen API:
  // cu_seqlens[0] = 0, non-decreasing, cu_seqlens[num_docs] = B*T, and no document crosses a
  // batch row (so every multiple of T is an offset). For B = 1 these are plain offsets into the
  // packed row. A token attends only to tokens of its own document; positions restart at the
  // document start for causality. Checked; a bad table throws primus::RuntimeError.
  const int32_t* cu_seqlens = nullptr;
  int64_t num_docs = 0;

  double scale() const;
};

// Overwrites out [B,T,H,D] and lse [B,H,T] (both needed by attention_backward).
template <typename Real>
void attention_forward(Real* out, Real* lse, const Real* q, const Real* k, const Real* v,
                       const AttentionParams& p);

// Accumulates dq [B,T,H,D] +=, dk [B,T,KVH,D] +=, dv [B,T,KVH,D] += from dout, given the
// forward's inputs q, k, v and its saved out and lse. dk/dv sum over the H/KVH query heads of
// each group, in head order (deterministic).
template <typename Real>
void attention_backward(Real* dq, Real* dk, Real* dv, const Real* dout, const Real* q,
                        const Real* k, const Real* v, const Real* out, const Real* lse,
                        const AttentionParams& p);

}  // namespace primus::turbo::cpu
