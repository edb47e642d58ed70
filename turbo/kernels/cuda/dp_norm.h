// The global gradient norm under ZeRO-1 from the ranks' shard norms: each rank's grad_norm gives
// out = {||shard||, factor}; square_norm() turns out[0] into ||shard||^2, the ranks all-reduce
// (sum) it, and finish_norm() writes {sqrt(sum), min(1, max_norm / (norm + 1e-6))} (1 when
// max_norm <= 0): the clip factor of turbo's grad_norm over the whole model.
#pragma once
#include <cuda_runtime_api.h>

#include <cstdint>

namespace primus::turbo::cuda {
void square_norm(float* out, cudaStream_t stream);
// out[0] = ||all||^2 - ||part||^2 (out[0] holding ||all||, part[0] ||part||; never below 0, a NaN
// or inf kept): the squares of what a rank counts when part of what it holds is counted by
// another rank (tensor parallelism's replicated tensors). remove_squares_value is the host form.
void remove_squares(float* out, const float* part, cudaStream_t stream);
#if defined(__CUDACC__)
__host__ __device__
#endif
inline float remove_squares_value(float all, float part) {
  const float d = all * all - part * part;
  return d > 0.0f ? d : (d - d == 0.0f ? 0.0f : d);  // 0 below zero; NaN and inf stay
}
void finish_norm(float* out, float max_norm, cudaStream_t stream);
// dst f32 [n] = src bf16 [n] (exact): a gradient bucket reduced in bf16 back into the fp32
// gradients (grad_reduce_in_bf16; the f32 -> bf16 direction is cast.h's).
void bf16_to_f32(float* dst, const void* src, int64_t n, cudaStream_t stream);
}  // namespace primus::turbo::cuda
