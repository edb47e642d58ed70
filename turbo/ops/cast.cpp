#include "turbo/ops/cast.h"

#include <fmt/format.h>

#include <algorithm>
#include <cmath>
#include <cstring>
#include <utility>

#include "core/util/error.h"

#ifdef PRIMUS_TURBO_WITH_CUDA
#include <cuda_runtime_api.h>

#include "turbo/core/cuda_check.h"
#include "turbo/kernels/cuda/cast.h"
#include "turbo/kernels/cuda/elementwise.h"
#endif

namespace primus::turbo {

void cast(const TensorView& dst, const TensorView& src, const ExecContext& ctx) {
  const char* op = "cast";
  check_defined(dst, op, "dst");
  check_defined(src, op, "src");
  check_contiguous(dst, op, "dst");
  check_contiguous(src, op, "src");
  check_same_device(dst, src, op);
  if (dst.numel() != src.numel()) {
    throw RuntimeError(fmt::format("cast: dst {} and src {} differ in size", dst.describe(), src.describe()));
  }
  if (dst.dtype == src.dtype) {
    if (dst.device == Device::CPU) {
      std::memmove(dst.data, src.data, src.nbytes());
      return;
    }
#ifdef PRIMUS_TURBO_WITH_CUDA
    CUDA_CHECK(cudaMemcpyAsync(dst.data, src.data, src.nbytes(), cudaMemcpyDeviceToDevice,
                               static_cast<cudaStream_t>(ctx.stream)));
    return;
#endif
  }
  const bool to_f32 = src.dtype == DType::I32 && dst.dtype == DType::F32;
  const bool to_i32 = src.dtype == DType::F32 && dst.dtype == DType::I32;
  if (dst.device == Device::CPU && (to_f32 || to_i32)) {
    const int64_t n = src.numel();
    if (to_f32) {
      for (int64_t i = 0; i < n; ++i) dst.ptr<float>()[i] = static_cast<float>(src.ptr<const int32_t>()[i]);
    } else {
      for (int64_t i = 0; i < n; ++i) dst.ptr<int32_t>()[i] = static_cast<int32_t>(std::lrint(src.ptr<const float>()[i]));
    }
    return;
  }
#ifdef PRIMUS_TURBO_WITH_CUDA
  if (dst.device == Device::CUDA && to_f32) {
    cuda::cast_i32_to_f32(dst.ptr<float>(), src.ptr<const int32_t>(), src.numel(), static_cast<cudaStream_t>(ctx.stream));
    return;
  }
  if (dst.device == Device::CUDA && to_i32) {
    cuda::cast_f32_to_i32(dst.ptr<int32_t>(), src.ptr<const float>(), src.numel(), static_cast<cudaStream_t>(ctx.stream));
    return;
  }
  if (dst.device == Device::CUDA && src.dtype == DType::F32 && dst.dtype == DType::BF16) {
    cuda::cast_f32_to_bf16(dst.data, src.ptr<const float>(), src.numel(), static_cast<cudaStream_t>(ctx.stream));
    return;
  }
#endif
  (void)ctx;
  throw RuntimeError(fmt::format("cast: {} -> {} is not supported", src.describe(), dst.describe()));
}

void add_gradient(const TensorView& dst, const TensorView& src, DType round_to, bool accumulate, const ExecContext& ctx) {
  const char* op = "add_gradient";
  check_defined(dst, op, "dst");
  check_defined(src, op, "src");
  check_dtype(dst, DType::F32, op, "dst");
  check_dtype(src, DType::F32, op, "src");
  check_contiguous(dst, op, "dst");
  check_contiguous(src, op, "src");
  check_same_device(dst, src, op);
  if (dst.numel() != src.numel())
    throw RuntimeError(fmt::format("add_gradient: dst {} and src {} differ in size", dst.describe(), src.describe()));
  if (round_to != DType::F32 && round_to != DType::BF16)
    throw RuntimeError(fmt::format("add_gradient: round_to must be f32 or bf16, got {}", dtype_name(round_to)));
  const bool round = round_to == DType::BF16;
  if (dst.device == Device::CPU) {
    float* d = dst.ptr<float>();
    const float* s = src.ptr<const float>();
    for (int64_t i = 0, n = src.numel(); i < n; ++i) {
      const float v = round ? bf16_bits_to_float(float_to_bf16_bits(s[i])) : s[i];
      d[i] = accumulate ? d[i] + v : v;
    }
    return;
  }
#ifdef PRIMUS_TURBO_WITH_CUDA
  cuda::add_gradient_f32(dst.ptr<float>(), src.ptr<const float>(), src.numel(), round, accumulate,
                         static_cast<cudaStream_t>(ctx.stream));
#else
  (void)ctx;
  throw RuntimeError("add_gradient: a device tensor in a build without CUDA");
#endif
}

void broadcast(const TensorView& dst, const TensorView& src, const ExecContext& ctx) {
  const char* op = "broadcast";
  check_defined(dst, op, "dst");
  check_defined(src, op, "src");
  check_dtype(dst, DType::F32, op, "dst");
  check_dtype(src, DType::F32, op, "src");
  check_contiguous(dst, op, "dst");
  check_same_device(dst, src, op);
  if (src.numel() != 1) throw RuntimeError(fmt::format("broadcast: src must hold one value, got {}", src.describe()));
  if (dst.device == Device::CPU) {
    std::fill_n(dst.ptr<float>(), dst.numel(), *src.ptr<const float>());
    return;
  }
#ifdef PRIMUS_TURBO_WITH_CUDA
  cuda::broadcast_f32(dst.ptr<float>(), dst.numel(), src.ptr<const float>(), static_cast<cudaStream_t>(ctx.stream));
#else
  (void)ctx;
  throw RuntimeError("broadcast: a device tensor in a build without CUDA");
#endif
}

void copy_rows(const TensorView& dst, const TensorView& src, const ExecContext& ctx) {
  const char* op = "copy_rows";
  check_defined(dst, op, "dst");
  check_defined(src, op, "src");
  check_same_device(dst, src, op);
  for (const auto& [name, t] : {std::pair{"dst", &dst}, std::pair{"src", &src}}) {
    if (t->ndim != 2 || t->stride(1) != 1 || t->stride(0) < t->size(1))
      throw RuntimeError(fmt::format("copy_rows: {} must be [N, C] with contiguous rows, got {}", name, t->describe()));
  }
  if (dst.size(0) != src.size(0) || dst.size(1) != src.size(1) || dst.dtype != src.dtype) {
    throw RuntimeError(fmt::format("copy_rows: dst {} does not match src {}", dst.describe(), src.describe()));
  }
  const size_t es = dtype_size(src.dtype), row = size_t(src.size(1)) * es;
  const size_t dp = size_t(dst.stride(0)) * es, sp = size_t(src.stride(0)) * es;
  const int64_t rows = src.size(0);
  if (dst.device == Device::CPU) {
    for (int64_t r = 0; r < rows; ++r)
      std::memcpy(static_cast<char*>(dst.data) + size_t(r) * dp, static_cast<const char*>(src.data) + size_t(r) * sp, row);
    return;
  }
#ifdef PRIMUS_TURBO_WITH_CUDA
  if (rows > 0)
    CUDA_CHECK(cudaMemcpy2DAsync(dst.data, dp, src.data, sp, row, size_t(rows), cudaMemcpyDeviceToDevice,
                                 static_cast<cudaStream_t>(ctx.stream)));
#else
  (void)ctx;
  throw RuntimeError("copy_rows: a device tensor in a build without CUDA");
#endif
}

}  // namespace primus::turbo
