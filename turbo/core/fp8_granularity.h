// How many elements share one FP8 scale: the granularity of an FP8 recipe (turbo/ops/gemm_fp8.h)
// and of the scale tensors that turbo::quantize_fp8 writes and turbo::gemm reads.
//
// For a quantized [R, C] matrix q (row-major, C the GEMM's contracted dimension K when q is an
// operand) the dequantization factors (scale_inv) are laid out as cuBLASLt reads them on Hopper
// (measured on an H200 by bench/fp8/scale_layout_probe.cu):
//   Tensor        [1]                       one for the whole matrix
//   Row           [R]                       one per row ("rowwise"; cuBLASLt's outer vector)
//   Block1x128    [C/128, R]                one per row and 128 consecutive columns, the row index
//                                           fastest (scale of row r, block kb at kb * R + r)
//   Block128x128  [R/128, pad4(C/128)]      one per 128 x 128 block, the column-block index
//                                           fastest, rows of the scale tensor padded to a
//                                           multiple of 4 entries (the padding is written as 1)
// The block granularities need R and C to be multiples of 128.
#pragma once
#include <cstdint>
#include <vector>

namespace primus::turbo {

enum class Fp8Granularity : uint8_t { Tensor, Row, Block1x128, Block128x128 };

inline const char* fp8_granularity_name(Fp8Granularity g) {
  switch (g) {
    case Fp8Granularity::Tensor: return "tensor";
    case Fp8Granularity::Row: return "row";
    case Fp8Granularity::Block1x128: return "1x128";
    case Fp8Granularity::Block128x128: return "128x128";
  }
  return "?";
}

inline constexpr int64_t kFp8BlockSize = 128;
inline int64_t fp8_pad4(int64_t x) { return (x + 3) / 4 * 4; }

// The shape of the scale tensor of an [R, C] matrix at granularity g (see above).
inline std::vector<int64_t> fp8_scale_shape(Fp8Granularity g, int64_t R, int64_t C) {
  switch (g) {
    case Fp8Granularity::Tensor: return {1};
    case Fp8Granularity::Row: return {R};
    case Fp8Granularity::Block1x128: return {C / kFp8BlockSize, R};
    case Fp8Granularity::Block128x128: return {R / kFp8BlockSize, fp8_pad4(C / kFp8BlockSize)};
  }
  return {1};
}
inline int64_t fp8_scale_numel(Fp8Granularity g, int64_t R, int64_t C) {
  int64_t n = 1;
  for (int64_t d : fp8_scale_shape(g, R, C)) n *= d;
  return n;
}
// Index into that scale tensor of element (r, c) of the matrix.
inline int64_t fp8_scale_index(Fp8Granularity g, int64_t R, int64_t C, int64_t r, int64_t c) {
  switch (g) {
    case Fp8Granularity::Tensor: return 0;
    case Fp8Granularity::Row: return r;
    case Fp8Granularity::Block1x128: return (c / kFp8BlockSize) * R + r;
    case Fp8Granularity::Block128x128: return (r / kFp8BlockSize) * fp8_pad4(C / kFp8BlockSize) + c / kFp8BlockSize;
  }
  return 0;
}
}  // namespace primus::turbo
