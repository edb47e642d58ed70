// Small elementwise launchers (elementwise.cu) used by the ops layer between larger kernels.
#pragma once
#include <cuda_runtime_api.h>

#include <cstdint>

#include "turbo/core/dtype.h"

namespace primus::turbo::cuda {
// dst[i] += src[i] over n f32 elements (e.g. a bias gradient produced by a GEMM epilogue,
// which overwrites, added into the accumulated gradient).
void add_inplace_f32(float* dst, const float* src, int64_t n, cudaStream_t stream);

// dst[i] = (accumulate ? dst[i] : 0) + r(src[i]) over n f32 elements, r rounding to bf16 (nearest
// even) when round_bf16, else the identity: a weight gradient computed on its own and then added
// to the fp32 gradient (turbo::add_gradient).
void add_gradient_f32(float* dst, const float* src, int64_t n, bool round_bf16, bool accumulate, cudaStream_t stream);

// dst[i] = *src over n f32 elements, src one device f32 read on the device (e.g. a per-tensor FP8
// scale spread into the per-row scale vector a rowwise kernel reads; turbo::broadcast).
void broadcast_f32(float* dst, int64_t n, const float* src, cudaStream_t stream);

// The two results of a weight GEMM over an input with a column of ones (turbo::linear_backward_
// weight_ones): s is f32 [rows, ld] with ld > C; dweight [rows, C] (contiguous) = s[:, :C] (+= when
// accumulate) and dbias [rows] += s[:, C] (dbias may be nullptr).
void split_ones_gradient(float* dweight, float* dbias, const float* s, int64_t rows, int64_t C, int64_t ld,
                         bool accumulate, cudaStream_t stream);

// dst[c] += sum over r of src[r * ld + c] for a row-major [N, C] matrix of f32 or bf16 (a bias
// gradient: the column sums of the layer's output gradient). Two launches, deterministic (no
// atomics; the same bits on every run): blocks sum fixed row chunks of a column strip into
// `partials`, then one pass adds the chunks in order. `partials` holds
// column_sum_partials(N, C) floats (device memory; it may be scratch reused after the call).
void column_sum_accumulate(float* dst, const void* src, DType dtype, int64_t N, int64_t C, int64_t ld,
                           float* partials, cudaStream_t stream);
int64_t column_sum_partials(int64_t N, int64_t C);

// The second stage of every deterministic column sum here (bias_grad, the norm backwards' weight,
// bias and dinp column sums): for up to three (dst, partials) pairs in one launch,
// dst[c] += sum over g of partials[g, c] (row-major [G, C] f32), each column summed in a fixed
// order (32 strided subsets of g, each added in g order, then a fixed pairwise tree of the 32
// subtotals): the same bits on every run.
struct ColumnPartials {
  float* dst = nullptr;
  const float* partials = nullptr;
};
void add_column_partials(const ColumnPartials* pairs, int count, int G, int64_t C, cudaStream_t stream);
}  // namespace primus::turbo::cuda
