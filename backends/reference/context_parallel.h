// Context parallelism for the reference backend: every sequence of T tokens is split over the cp
// ranks of a group, and attention, the one layer that mixes tokens, runs as ring attention.
//
// Layout (Megatron-LM's, balanced for the causal mask): the sequence is cut into 2*cp chunks of
// T/(2cp) tokens and rank r holds chunk r followed by chunk 2cp-1-r, T/cp tokens per batch row in
// that order. Under a causal mask a late chunk costs more than an early one; pairing chunk r with
// its mirror gives every rank the same work.
//
// Ring attention: each rank keeps its queries and passes its keys and values to the next rank
// (r -> r+1 mod cp) cp-1 times, so every rank meets every key block once; each block's partial
// attention is folded into the running output by log-sum-exp (turbo::cpu::attention_merge). The
// backward walks the ring again carrying, with each block's keys and values, the dk/dv gathered
// for them so far; after the last step one more shift hands every rank the complete gradient of
// its own keys. Only the final out and lse are needed for that (see attention_backward).
#pragma once
#include <algorithm>
#include <cstdint>
#include <vector>

#include "parallel/process_group.h"
#include "turbo/kernels/cpu/attention.h"

namespace primus::backends::reference {

// The T/cp global positions (0..T-1) that `rank` of `cp` holds, in its local order. Throws
// primus::RuntimeError unless cp >= 1, 0 <= rank < cp and T is a positive multiple of 2*cp.
std::vector<int32_t> cp_chunk_positions(int64_t T, int cp, int rank);
// [cp, T/cp]: row r is cp_chunk_positions(T, cp, r). The table ring attention takes.
std::vector<int32_t> cp_all_positions(int64_t T, int cp);

// local [B, T/cp, inner] = the tokens `rank` holds of full [B, T, inner] (token-major, e.g. inner
// = H*D for q, KVH*D for k, 1 for token ids; for lse [B,H,T] pass B*H as B and inner = 1).
template <typename E>
void cp_split(E* local, const E* full, int64_t B, int64_t T, int64_t inner, int cp, int rank) {
  const std::vector<int32_t> pos = cp_chunk_positions(T, cp, rank);
  const int64_t n = static_cast<int64_t>(pos.size()), chunk = T / (2 * cp);
  for (int64_t b = 0; b < B; ++b)
    for (int64_t c = 0; c < n; c += chunk)  // chunks are contiguous runs of positions
      std::copy_n(full + (b * T + pos[c]) * inner, chunk * inner, local + (b * n + c) * inner);
}
// The inverse: writes local [B, T/cp, inner] into the positions `rank` holds of full [B, T, inner]
// (the other ranks' tokens are left as they are).
template <typename E>
void cp_gather(E* full, const E* local, int64_t B, int64_t T, int64_t inner, int cp, int rank) {
  const std::vector<int32_t> pos = cp_chunk_positions(T, cp, rank);
  const int64_t n = static_cast<int64_t>(pos.size()), chunk = T / (2 * cp);
  for (int64_t b = 0; b < B; ++b)
    for (int64_t c = 0; c < n; c += chunk)
      std::copy_n(local + (b * n + c) * inner, chunk * inner, full + (b * T + pos[c]) * inner);
}

// Ring attention over cp_group (world size cp; this rank is cp_group.rank()), fp32 host buffers:
//   q, out [B,Tl,H,D]   k, v [B,Tl,KVH,D]   lse [B,H,Tl]     Tl = p_local.T, this rank's tokens
// p_local: B, T = Tl, H, KVH, D, causal, window, softmax_scale of the whole attention; Tk,
// q_positions, k_positions and cu_seqlens must be unset (the ring sets the positions; packed
// documents are refused with primus::RuntimeError).
// positions: [cp, Tl] int32, row r the global positions of rank r's tokens, the same on every
// rank (any layout, e.g. cp_all_positions); nullptr means the load-balanced layout above with
// T = Tl * cp. out and lse equal attention_forward over the whole sequence, cut the same way.
// Every rank of the group must call it with the same shapes; a peer that fails or leaves makes
// the call throw parallel::CollectiveError naming it. Blocks that a rank's queries cannot see
// (all keys after every query, or before every window) are passed on without being computed.
void ring_attention_forward(parallel::ProcessGroup& cp_group, float* out, float* lse,
                            const float* q, const float* k, const float* v,
                            const turbo::cpu::AttentionParams& p_local,
                            const int32_t* positions = nullptr);

// Accumulates dq [B,Tl,H,D] +=, dk, dv [B,Tl,KVH,D] += for this rank's tokens, given the
// forward's inputs and its out and lse (from ring_attention_forward); same p_local and positions.
// The result equals attention_backward over the whole sequence, cut the same way.
void ring_attention_backward(parallel::ProcessGroup& cp_group, float* dq, float* dk, float* dv,
                             const float* dout, const float* q, const float* k, const float* v,
                             const float* out, const float* lse,
                             const turbo::cpu::AttentionParams& p_local,
                             const int32_t* positions = nullptr);

}  // namespace primus::backends::reference
