// Decode attention: one new query token per sequence against that sequence's key/value cache,
// the step of autoregressive generation after the prompt's prefill. The reference for the CUDA
// kernel (turbo/kernels/cuda/decode_attention.h) and the host path of turbo/ops/decode_attention.h.
//
//   out[i,h] = sum_j softmax_j(scale * q[i,h] · k[s,j,g]) v[s,j,g],  g = h / (H / KVH), s = slot[i],
//   j over [max(0, len[i] - window), len[i])   (window 0: all len[i] cached keys)
//
// Shapes (row-major): q, out [n,H,D] (q's rows may be strided: q_row elements apart, e.g. the q
// columns of a packed qkv projection); k_cache, v_cache [S,cap,KVH,D] (S sequence slots of
// `cap` positions); slot, len [n] (cache slot of query i and how many of its positions hold
// keys, the new token's included: 1 <= len <= cap). Query i is at position len[i] - 1, so this is
// the last row of causal attention over the cached sequence. Accumulation in double.
#pragma once
#include <cstdint>

namespace primus::turbo::cpu {

struct DecodeAttentionParams {
  int64_t n = 0, H = 0, KVH = 0, D = 0;
  int64_t slots = 0, cap = 0;  // cache shape [slots, cap, KVH, D]
  int64_t window = 0;          // attend to the last `window` keys (sliding window); 0: all
  double scale = 0;            // 0: 1/sqrt(D)
  int64_t q_row = 0;           // elements between q's tokens; 0: H*D
};

// Throws primus::RuntimeError naming the query when a slot or length is out of range.
template <typename Real>
void decode_attention_forward(Real* out, const Real* q, const Real* k_cache, const Real* v_cache,
                              const int32_t* slot, const int32_t* len, const DecodeAttentionParams& p);

// Writes the new token's key and value rows into the cache at position len[i] - 1 of slot[i]:
// k_cache[slot[i], len[i]-1] = k[i], v likewise. k, v [n,KVH,D] with rows src_row apart.
template <typename Real>
void kv_cache_write(Real* k_cache, Real* v_cache, const Real* k, const Real* v, int64_t src_row,
                    const int32_t* slot, const int32_t* len, const DecodeAttentionParams& p);

}  // namespace primus::turbo::cpu
