// Launchers of decode attention and the KV-cache append (decode_attention.cu): one new query
// token per sequence against its cached keys and values, as turbo/kernels/cpu/decode_attention.h
// states (shapes, slots, lengths, window). dtype f32 or bf16 for q, out and the caches alike;
// slot and len are int32 device arrays [n]. D at most 256.
#pragma once
#include <cuda_runtime_api.h>

#include <cstdint>

#include "turbo/core/dtype.h"

namespace primus::turbo::cuda {

inline constexpr int64_t kDecodeAttentionMaxDim = 256;

// The key range is split over several blocks whose partial results (fp32) go to `workspace`
// and are merged by a second kernel; the split count depends on (n, H, KVH, cap) only, never on
// the lengths (device data), so a captured CUDA graph stays valid. The workspace needs
// decode_attention_workspace_bytes(n, H, KVH, D, cap) bytes (the most over every batch size up to
// n, so one buffer sized for the largest batch serves all); a smaller one (or none: nullptr, 0)
// means fewer splits, down to one, which needs none. 16-byte aligned device memory.
int64_t decode_attention_workspace_bytes(int64_t n, int64_t H, int64_t KVH, int64_t D, int64_t cap);

void decode_attention_forward(DType dtype, void* out, const void* q, const void* k_cache, const void* v_cache,
                              const int32_t* slot, const int32_t* len, int64_t n, int64_t H, int64_t KVH, int64_t D,
                              int64_t cap, int64_t window, float scale, int64_t q_row, void* workspace,
                              int64_t workspace_bytes, cudaStream_t stream);

// k_cache[slot[i], len[i]-1] = k[i] and v likewise; k, v rows src_row elements apart.
void kv_cache_write(DType dtype, void* k_cache, void* v_cache, const void* k, const void* v, int64_t src_row,
                    const int32_t* slot, const int32_t* len, int64_t n, int64_t KVH, int64_t D, int64_t cap,
                    cudaStream_t stream);

}  // namespace primus::turbo::cuda
