// Decode attention over a KV cache: the attention of token-by-token generation, one new query
// per sequence against that sequence's cached keys and values (turbo/kernels/cpu/decode_attention.h
// states the math). The prompt's prefill goes through attention_forward (attention.h); each
// generated token then appends its key and value (kv_cache_write) and attends with this op.
//
//   q        [n,H,D]  (rows may be strided: the q columns of a packed qkv projection)
//   out      [n,H,D]  contiguous
//   k_cache, v_cache [S,cap,KVH,D] contiguous: S sequence slots of `cap` positions
//   slot, len i32 [n]: query i uses cache slot slot[i], whose positions [0, len[i]) hold keys
//            (the new token's at len[i] - 1, its position); 1 <= len[i] <= cap.
//   window   > 0: attend to the last `window` keys only (sliding-window attention); 0: all.
//   workspace (optional, TURBO only) device bytes for the split-KV partials: at least
//            decode_attention_workspace_bytes(n, H, KVH, D, cap) for full speed at long contexts
//            (any dtype; its nbytes() count); undefined or smaller: fewer splits (slower, same result).
// H must be a multiple of KVH (GQA). dtypes: bf16 or f32 on CUDA, f32 on the host.
// Backends: TURBO (turbo/kernels/cuda/decode_attention.cu; D <= 256), CPU (the reference).
#pragma once
#include <optional>
#include <string>

#include "turbo/core/tensor_view.h"
#include "turbo/dispatch/backend_type.h"
#include "turbo/ops/exec_context.h"

namespace primus::turbo {

struct DecodeAttentionArgs {
  TensorView out, q, k_cache, v_cache, slot, len;
  TensorView workspace;  // optional: see above
  int64_t window = 0;
  std::optional<float> softmax_scale;  // unset: 1/sqrt(D)
  ExecContext ctx;
  std::string key() const;
  Precision precision() const { return precision_of(q.dtype); }
};

// k, v [n,KVH,D] (rows may be strided) into k_cache / v_cache at position len[i] - 1 of slot[i].
struct KvCacheWriteArgs {
  TensorView k_cache, v_cache, k, v, slot, len;
  ExecContext ctx;
  std::string key() const;
  Precision precision() const { return precision_of(k.dtype); }
};

// Bytes of DecodeAttentionArgs::workspace that let the TURBO kernel split the key range fully for
// any batch of up to n queries of H heads (KVH kv heads, head dim D) over caches of cap positions;
// 0 without CUDA or when no split is needed.
int64_t decode_attention_workspace_bytes(int64_t n, int64_t H, int64_t KVH, int64_t D, int64_t cap);

// Validate shapes (throwing primus::RuntimeError naming the argument), dispatch, and return the
// backend that ran.
BackendType decode_attention(const DecodeAttentionArgs& args);
BackendType kv_cache_write(const KvCacheWriteArgs& args);

}  // namespace primus::turbo
