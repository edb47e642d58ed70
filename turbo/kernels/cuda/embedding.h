// Launchers of token + learned position embeddings (embedding.cu), matching
// turbo/kernels/cpu/embedding.h. tokens/positions int32 [N = B*T]; wte [V,C], wpe [max_pos,C]
// and out [N,C] in dtype (f32 or bf16); gradient tables dwte/dwpe always f32. C multiple of 8.
#pragma once
#include <cuda_runtime_api.h>

#include <cstddef>
#include <cstdint>

#include "turbo/core/dtype.h"

namespace primus::turbo::cuda {

// out[n,:] = wte[tokens[n],:] + wpe[pos(n),:] with pos(n) = positions[n] or n % T; wpe may be
// nullptr (no learned positions). An id or position out of range writes NaN to its row (a
// device kernel cannot throw; the NaN makes the fault visible at the loss).
// vocab_begin >= 0: a vocabulary-parallel table of the rows of ids [vocab_begin, vocab_begin + V)
// (turbo/kernels/cpu/embedding.h): other ids give a zero token row.
void embedding_forward(DType dtype, void* out, const int32_t* tokens, const int32_t* positions,
                       const void* wte, const void* wpe, int64_t B, int64_t T, int64_t C, int64_t V,
                       int64_t max_pos, cudaStream_t stream, int64_t vocab_begin = -1);

// dwte[V,C] += scatter of dout[N,C] by token; dwpe[max_pos,C] += by position (if dwpe).
// Deterministic: (token, n) pairs are stably sorted, then each distinct token's rows are summed
// in n order by one block and added once. `scratch` holds embedding_backward_scratch_bytes(N).
// vocab_begin >= 0: vocabulary-parallel, ids outside the table's rows add nothing to dwte.
void embedding_backward(DType dtype, float* dwte, float* dwpe, const void* dout,
                        const int32_t* tokens, const int32_t* positions, int64_t B, int64_t T,
                        int64_t C, int64_t V, int64_t max_pos, void* scratch, cudaStream_t stream,
                        int64_t vocab_begin = -1);
size_t embedding_backward_scratch_bytes(int64_t N);

}  // namespace primus::turbo::cuda
