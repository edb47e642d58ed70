// Scaled dot-product self-attention with grouped-query attention (GQA), causal or not, over
// whole rows or over packed variable-length documents. Forward and backward, flash-attention
// style: the forward saves only the log-sum-exp of each score row; the backward recomputes the
// probabilities from it (no [T,T] matrix is kept between the two).
//
// Shapes (row-major, separate contiguous tensors; Tk = keys per batch row, T unless set):
//   q, dq   [B,T,H,D]      k, v, dk, dv  [B,Tk,KVH,D]     out, dout [B,T,H,D]
//   lse     [B,H,T]        lse[b,h,t] = log(sum_j exp(scale * q[b,t,h]·k[b,j,g])) over the
//                          keys j that query t sees; -infinity when it sees none (out is then 0)
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
  // Queries and keys that are different token sets (one block of ring attention: this rank's
  // queries against another rank's keys). Tk: keys per batch row (0: T). q_positions[T] and
  // k_positions[Tk]: each token's position in the sequence, the same for every batch row
  // (nullptr: 0..T-1 and 0..Tk-1); causality and the window compare positions: a query at pq
  // sees a key at pk iff pk <= pq (and pk > pq - window). Any order is allowed. Not with
  // cu_seqlens (documents need keys = queries): refused with primus::RuntimeError, as is
  // Tk != T with cu_seqlens.
  int64_t Tk = 0;
  const int32_t* q_positions = nullptr;
  const int32_t* k_positions = nullptr;

  double scale() const;
  int64_t keys() const { return Tk > 0 ? Tk : T; }
};

// Overwrites out [B,T,H,D] and lse [B,H,T] (both needed by attention_backward).
template <typename Real>
void attention_forward(Real* out, Real* lse, const Real* q, const Real* k, const Real* v,
                       const AttentionParams& p);

// Accumulates dq [B,T,H,D] +=, dk [B,Tk,KVH,D] +=, dv [B,Tk,KVH,D] += from dout, given the
// forward's inputs q, k, v and its saved out and lse. dk/dv sum over the H/KVH query heads of
// each group, in head order (deterministic). Rows with lse = -infinity contribute nothing.
//
// out and lse need not be this call's own forward: passing the out and lse of attention over a
// larger key set (merged by attention_merge) gives this key block's exact share of the gradient
// (dq summed over the blocks, dk/dv of this block's keys), since the probabilities are
// exp(scale*q·k - lse) and the softmax correction is rowsum(dout*out). That is how ring
// attention runs its backward block by block.
template <typename Real>
void attention_backward(Real* dq, Real* dk, Real* dv, const Real* dout, const Real* q,
                        const Real* k, const Real* v, const Real* out, const Real* lse,
                        const AttentionParams& p);

// Folds the attention of the same queries over another, disjoint key block (out_b [B,T,H,D],
// lse_b [B,H,T]) into the running out and lse (same shapes), exactly: lse becomes
// log(exp(lse) + exp(lse_b)) and out the two outputs weighted by exp(lse - new lse) and
// exp(lse_b - new lse). A side with lse = -infinity (no key seen) adds nothing.
template <typename Real>
void attention_merge(Real* out, Real* lse, const Real* out_b, const Real* lse_b, int64_t B,
                     int64_t T, int64_t H, int64_t D);

}  // namespace primus::turbo::cpu
