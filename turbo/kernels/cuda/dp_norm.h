// The global gradient norm under ZeRO-1 from the ranks' shard norms: each rank's grad_norm gives
// out = {||shard||, factor}; square_norm() turns out[0] into ||shard||^2, the ranks all-reduce
// (sum) it, and finish_norm() writes {sqrt(sum), min(1, max_norm / (norm + 1e-6))} (1 when
// max_norm <= 0): the clip factor of turbo's grad_norm over the whole model.
#pragma once
#include <cuda_runtime_api.h>

#include <cstdint>

namespace primus::turbo::cuda {
void square_norm(float* out, cudaStream_t stream);
void finish_norm(float* out, float max_norm, cudaStream_t stream);
// dst f32 [n] = src bf16 [n] (exact): a gradient bucket reduced in bf16 back into the fp32
// gradients (grad_reduce_in_bf16; the f32 -> bf16 direction is cast.h's).
void bf16_to_f32(float* dst, const void* src, int64_t n, cudaStream_t stream);
}  // namespace primus::turbo::cuda
