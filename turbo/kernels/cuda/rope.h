// Launchers of rotary position embedding, interleaved-pairs convention (rope.cu), matching
// turbo/kernels/cpu/rope.h: pair i of a head, (x[2i], x[2i+1]), rotates by pos * inv_freq[i].
// x [B,T,H,D], dtype f32 or bf16, D a multiple of 8; in_row / out_row: elements between tokens
// (0: H*D, contiguous; more for q|k column slices of a packed projection; multiples of 8).
#pragma once
#include <cuda_runtime_api.h>

#include <cstddef>
#include <cstdint>

#include "turbo/core/dtype.h"

namespace primus::turbo::cuda {

// Fills table [max_pos, D/2] of float2 {cos, sin}(pos * inv_freq[i]) (computed in double,
// rounded to f32): built once per model, read by every RoPE call. inv_freq: D/2 host values
// (turbo::cpu::rope_inv_freq), at most kRopeMaxPairs of them; they travel as a kernel argument.
// table holds rope_table_bytes(max_pos, D) bytes.
constexpr int64_t kRopeMaxPairs = 256;
void rope_build_table(void* table, int64_t max_pos, int64_t D, const double* inv_freq, cudaStream_t stream);
inline size_t rope_table_bytes(int64_t max_pos, int64_t D) {
  return static_cast<size_t>(max_pos * (D / 2)) * 2 * sizeof(float);
}

// out = RoPE(inp); out may alias inp. positions [B,T] int32 or nullptr (pos = t). A position
// outside [0, max_pos) is not read from the table: its outputs are NaN, so the error shows.
void rope_forward(DType dtype, void* out, const void* inp, const int32_t* positions,
                  const void* table, int64_t B, int64_t T, int64_t H, int64_t D, int64_t max_pos,
                  cudaStream_t stream, int64_t in_row = 0, int64_t out_row = 0);
// dinp = (or += when accumulate) the inverse rotation of dout; dinp may alias dout when !accumulate.
void rope_backward(DType dtype, void* dinp, const void* dout, const int32_t* positions,
                   const void* table, int64_t B, int64_t T, int64_t H, int64_t D, int64_t max_pos,
                   bool accumulate, cudaStream_t stream, int64_t in_row = 0, int64_t out_row = 0);

}  // namespace primus::turbo::cuda
