// Launchers of the vocabulary-parallel cross-entropy's two halves (turbo/ops/loss.h,
// VocabParallelCrossEntropyArgs, whose host loops these kernels mirror). logits [N, ld] in dtype
// (f32 or bf16), one block per row.
#pragma once
#include <cuda_runtime_api.h>

#include <cstdint>

#include "turbo/core/dtype.h"

namespace primus::turbo::cuda {

void vocab_parallel_ce_stats(DType dtype, const void* logits, int64_t N, int64_t ld, int64_t vocab,
                             int64_t vocab_begin, const int32_t* targets, float* stats, cudaStream_t stream);
void vocab_parallel_ce_finish(DType dtype, void* logits, int64_t N, int64_t ld, int64_t vocab, int64_t vocab_begin,
                              int64_t global_vocab, const int32_t* targets, const float* all_stats, int tp,
                              float* losses, float dloss, const float* kept, int32_t ignore_index,
                              cudaStream_t stream);

}  // namespace primus::turbo::cuda
