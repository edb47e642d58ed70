// cuTensorMapEncodeTiled (TMA descriptors) through the CUDA runtime's driver entry point, so Turbo's
// Hopper kernels need no link against libcuda. Host code; shared by the sm_90 GEMM and attention.
#pragma once
#include <cuda.h>
#include <cuda_runtime_api.h>

#include <cstdint>

#include "core/util/error.h"
#include "turbo/core/dtype.h"

namespace primus::turbo::cuda {

using EncodeTiledFn = CUresult (*)(CUtensorMap*, CUtensorMapDataType, cuuint32_t, void*, const cuuint64_t*,
                                   const cuuint64_t*, const cuuint32_t*, const cuuint32_t*, CUtensorMapInterleave,
                                   CUtensorMapSwizzle, CUtensorMapL2promotion, CUtensorMapFloatOOBfill);

// The driver's cuTensorMapEncodeTiled, or nullptr when the driver does not provide it.
inline EncodeTiledFn encode_tiled() {
  static const EncodeTiledFn fn = [] {
    void* f = nullptr;
    cudaDriverEntryPointQueryResult q{};
    if (cudaGetDriverEntryPointByVersion("cuTensorMapEncodeTiled", &f, 12000, cudaEnableDefault, &q) != cudaSuccess ||
        q != cudaDriverEntryPointSuccess)
      return static_cast<EncodeTiledFn>(nullptr);
    return reinterpret_cast<EncodeTiledFn>(f);
  }();
  return fn;
}

// A [B][T][heads][D] 16-bit tensor (attention's q / k / v / dout) as TMA sees it: a 4-D tensor
// (d, head, token, batch row) in boxes of 64 head_dim elements x 1 head x `box_rows` tokens x 1 batch
// row, 128-byte swizzled (exactly one [box_rows][64] slab of the attention kernels' shared-memory
// layout). Tokens past T read as zeros, never as the next batch row's first tokens (which, masked
// or not, would turn a neighbour's Inf or NaN into 0 * Inf = NaN here). `what` names the tensor in
// the error. Needs encode_tiled() and a 16-byte aligned base. `row`: elements from one token to the
// next (0: heads * D, dense; a column slice of a packed [B, T, width] tensor has width), a multiple of 8.
inline CUtensorMap attention_map(const void* base, DType dt, int64_t B, int64_t T, int64_t heads, int64_t D, uint32_t box_rows,
                                 const char* what, int64_t row = 0) {
  CUtensorMap m;
  if (row == 0) row = heads * D;
  const cuuint64_t dims[4] = {static_cast<cuuint64_t>(D), static_cast<cuuint64_t>(heads), static_cast<cuuint64_t>(T),
                              static_cast<cuuint64_t>(B)};
  const cuuint64_t strides[3] = {static_cast<cuuint64_t>(D * 2), static_cast<cuuint64_t>(row * 2), static_cast<cuuint64_t>(T * row * 2)};
  const cuuint32_t box[4] = {64, 1, box_rows, 1};
  const cuuint32_t elem[4] = {1, 1, 1, 1};
  const CUresult r = encode_tiled()(&m, dt == DType::F16 ? CU_TENSOR_MAP_DATA_TYPE_FLOAT16 : CU_TENSOR_MAP_DATA_TYPE_BFLOAT16, 4,
                                    const_cast<void*>(base), dims, strides, box, elem, CU_TENSOR_MAP_INTERLEAVE_NONE,
                                    CU_TENSOR_MAP_SWIZZLE_128B, CU_TENSOR_MAP_L2_PROMOTION_L2_128B,
                                    CU_TENSOR_MAP_FLOAT_OOB_FILL_NONE);
  PRIMUS_CHECK(r == CUDA_SUCCESS, "cuTensorMapEncodeTiled failed ({}) for attention's {} [B={}][T={}][heads={}][D={}] at {} (row {})",
               static_cast<int>(r), what, B, T, heads, D, base, row);
  return m;
}

}  // namespace primus::turbo::cuda
