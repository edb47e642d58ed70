// dst bf16 [n] = src f32 [n], rounding to nearest even: refreshes the bf16 compute copy of the
// fp32 master weights after they are set from the host (init, checkpoint load). The optimizer
// keeps the copy current during training.
#pragma once
#include <cuda_runtime_api.h>

#include <cstdint>

namespace primus::turbo::cuda {
void cast_f32_to_bf16(void* dst, const float* src, int64_t n, cudaStream_t stream);
// Counts between i32 and f32 (exact below 2^24; f32 -> i32 rounds to nearest): a small integer
// vector summed by a process group that reduces floats.
void cast_i32_to_f32(float* dst, const int32_t* src, int64_t n, cudaStream_t stream);
void cast_f32_to_i32(int32_t* dst, const float* src, int64_t n, cudaStream_t stream);
// Zeroes n ranges of base in one launch. table (device, int64): prefix[0..n] (prefix[0] = 0,
// prefix[r + 1] - prefix[r] = the length of range r) then offset[0..n-1] (element offsets into
// base); total = prefix[n].
void zero_ranges_f32(float* base, const int64_t* table, int n, int64_t total, cudaStream_t stream);
}  // namespace primus::turbo::cuda
