// The kernels of expert parallelism (ep_comm.h) beside the group's collectives: the rows' moves
// by row map, and the experts' averaged gradients divided by ep. Device only (host mode: loops in
// ep_comm.cpp).
#pragma once
#include <cuda_runtime_api.h>

#include <cstdint>

namespace primus::backends::cuda::ep {

// x f32 [n] *= s, on `stream`.
void scale_f32(float* x, int64_t n, float s, cudaStream_t stream);
// x bf16 [n] *= s (the product in f32, rounded to nearest even), on `stream`: the experts'
// gradients in bf16 (moe_expert_grad_dtype: bf16). x 4-byte aligned.
void scale_bf16(void* x, int64_t n, float s, cudaStream_t stream);
// dst row r (ld_dst elements apart) = src row map[r] (ld_src apart), or zeros where map[r] < 0,
// for r < rows; rows of `cols` elements of `esize` bytes (2 or 4). map in device memory.
void gather_rows(void* dst, int64_t ld_dst, const void* src, int64_t ld_src, const int32_t* map, int64_t rows,
                 int64_t cols, int esize, cudaStream_t stream);

}  // namespace primus::backends::cuda::ep
