// Internal to turbo/ops: reading a GEMM's TensorViews as (stored matrix, leading dimension,
// transposed) triples, shared by the CPU and cuBLASLt backends of gemm.cpp.
#pragma once
#include <string>

#include "turbo/ops/gemm.h"

namespace primus::turbo::detail {

struct MatrixLayout {
  void* ptr = nullptr;
  DType dtype = DType::F32;
  int64_t rows = 0, cols = 0;  // logical
  int64_t ld = 0;              // elements between stored rows
  bool transposed = false;     // logical = stored^T
  int64_t batch = 1, batch_stride = 0;
};

// Empty on success; otherwise why the view is not a matrix a GEMM can read (non-unit inner
// stride in both of the last two dims, more than 3 dims).
std::string matrix_layout(const TensorView& t, MatrixLayout* out);

struct GemmShape {
  int64_t m = 0, n = 0, k = 0, batch = 1;
  MatrixLayout a, b, d;
};
// Checks that A [.,M,K], B [.,K,N], D [.,M,N] fit together, D is row-major, the bias/aux views
// match the epilogue. Empty on success, else the reason with the shapes.
std::string gemm_shape(const GemmArgs& args, GemmShape* out);

}  // namespace primus::turbo::detail
