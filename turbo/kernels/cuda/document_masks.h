// Document tables of packed samples on the device (Megatron's reset_attention_mask /
// reset_position_ids; the host version and the semantics are train/document_masks.h): from a
// micro-batch's tokens, each token's position within its document and a cu_seqlens table for the
// varlen attention, with fixed sizes so that a captured CUDA graph replays them for any batch.
#pragma once
#include <cuda_runtime_api.h>

#include <cstdint>

namespace primus::turbo::cuda {

// tokens [B*T] i32 (the model's inputs). Writes
//   positions [B*T]   t - s, s the first token of t's document within its row (the token after
//                     the last eod_id before t, or 0);
//   cu_seqlens [B*T + 1]  cu[b*T + t] = b*T + s, cu[B*T] = B*T: every token's document start,
//                     a non-decreasing table whose repeated entries are empty documents, which the
//                     attention kernels skip; so num_docs is always B*T, whatever the tokens.
// Either output may be nullptr. One block per batch row.
void build_document_tables(const int32_t* tokens, int64_t B, int64_t T, int32_t eod_id, int32_t* positions,
                           int32_t* cu_seqlens, cudaStream_t stream);

}  // namespace primus::turbo::cuda
