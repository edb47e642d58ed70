#include "turbo/ops/cast.h"

#include <fmt/format.h>

#include <cstring>

#include "core/util/error.h"

#ifdef PRIMUS_TURBO_WITH_CUDA
#include <cuda_runtime_api.h>

#include "turbo/core/cuda_check.h"
#include "turbo/kernels/cuda/cast.h"
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
#ifdef PRIMUS_TURBO_WITH_CUDA
  if (dst.device == Device::CUDA && src.dtype == DType::F32 && dst.dtype == DType::BF16) {
    cuda::cast_f32_to_bf16(dst.data, src.ptr<const float>(), src.numel(), static_cast<cudaStream_t>(ctx.stream));
    return;
  }
#endif
  (void)ctx;
  throw RuntimeError(fmt::format("cast: {} -> {} is not supported", src.describe(), dst.describe()));
}

}  // namespace primus::turbo
