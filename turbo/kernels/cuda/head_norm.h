// Launchers of the per-head RMSNorm (head_norm.cu): Qwen3's query/key norms, in place on the q|k
// columns of the packed qkv projection. x is N tokens of Hx heads of D contiguous elements, a
// token's heads row_stride elements after the previous token's (the packed row: (H + 2KV) * D);
// heads [0, q_heads) use wq [D], the others wk [D]. T = f32 or bf16 storage (`dtype`) for x,
// saved and the weights; rstd and the weight gradients f32. D <= kHeadNormMaxDim.
#pragma once
#include <cuda_runtime_api.h>

#include <cstddef>
#include <cstdint>

#include "turbo/core/dtype.h"

namespace primus::turbo::cuda {

inline constexpr int64_t kHeadNormMaxDim = 256;  // turbo::kHeadNormMaxDim (ops/head_norm.h) says the same

// x = x * rstd * w per (token, head) row, in place. saved [N, Hx, D] (dense) receives the
// pre-norm values and rstd [N * Hx] the row statistics, both for the backward.
void head_norm_forward(DType dtype, void* x, int64_t row_stride, void* saved, float* rstd, const void* wq,
                       const void* wk, int64_t N, int64_t Hx, int64_t q_heads, int64_t D, float eps,
                       cudaStream_t stream);

// In place: x holds d(out) on entry and d(in) on return. dwq, dwk [D] += the weight gradients,
// summed in a fixed order through `scratch` (head_norm_backward_scratch_bytes(N, D) bytes), so
// results are bitwise reproducible.
void head_norm_backward(DType dtype, void* x, int64_t row_stride, const void* saved, const float* rstd,
                        const void* wq, const void* wk, float* dwq, float* dwk, int64_t N, int64_t Hx,
                        int64_t q_heads, int64_t D, void* scratch, cudaStream_t stream);
size_t head_norm_backward_scratch_bytes(int64_t N, int64_t D);

}  // namespace primus::turbo::cuda
