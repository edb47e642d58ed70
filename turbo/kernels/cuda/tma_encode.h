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

// A [rows][heads][D] 16-bit tensor (attention's q / k / v / dout with rows = B*T) as TMA sees it:
// boxes of 64 head_dim elements x 1 head x `box_rows` tokens, 128-byte swizzled (exactly one
// [box_rows][64] slab of the attention kernels' shared-memory layout); rows past `rows` read as
// zeros. Needs encode_tiled() and a 16-byte aligned base.
inline CUtensorMap attention_rows_map(const void* base, DType dt, int64_t rows, int64_t heads, int64_t D, uint32_t box_rows) {
  CUtensorMap m;
  const cuuint64_t dims[3] = {static_cast<cuuint64_t>(D), static_cast<cuuint64_t>(heads), static_cast<cuuint64_t>(rows)};
  const cuuint64_t strides[2] = {static_cast<cuuint64_t>(D * 2), static_cast<cuuint64_t>(heads * D * 2)};
  const cuuint32_t box[3] = {64, 1, box_rows};
  const cuuint32_t elem[3] = {1, 1, 1};
  const CUresult r = encode_tiled()(&m, dt == DType::F16 ? CU_TENSOR_MAP_DATA_TYPE_FLOAT16 : CU_TENSOR_MAP_DATA_TYPE_BFLOAT16, 3,
                                    const_cast<void*>(base), dims, strides, box, elem, CU_TENSOR_MAP_INTERLEAVE_NONE,
                                    CU_TENSOR_MAP_SWIZZLE_128B, CU_TENSOR_MAP_L2_PROMOTION_L2_128B,
                                    CU_TENSOR_MAP_FLOAT_OOB_FILL_NONE);
  PRIMUS_CHECK(r == CUDA_SUCCESS, "cuTensorMapEncodeTiled failed ({}) for rows={} heads={} D={}", static_cast<int>(r), rows,
               heads, D);
  return m;
}

}  // namespace primus::turbo::cuda
