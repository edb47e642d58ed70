// Small elementwise launchers (elementwise.cu) used by the ops layer between larger kernels.
#pragma once
#include <cuda_runtime_api.h>

#include <cstdint>

namespace primus::turbo::cuda {
// dst[i] += src[i] over n f32 elements (e.g. a bias gradient produced by a GEMM epilogue,
// which overwrites, added into the accumulated gradient).
void add_inplace_f32(float* dst, const float* src, int64_t n, cudaStream_t stream);
}  // namespace primus::turbo::cuda
