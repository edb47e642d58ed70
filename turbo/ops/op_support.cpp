#include "turbo/ops/op_support.h"

#include <fmt/format.h>

namespace primus::turbo {

bool turbo_has_cuda() {
#ifdef PRIMUS_TURBO_WITH_CUDA
  return true;
#else
  return false;
#endif
}

namespace detail {

std::string all_on(Device dev, std::initializer_list<std::pair<const char*, const TensorView*>> views) {
  for (const auto& [name, v] : views)
    if (v->defined() && v->device != dev)
      return fmt::format("{} is a {} tensor, this backend needs {}", name, device_name(v->device), device_name(dev));
  return "";
}

std::string all_dtype(DType t, std::initializer_list<std::pair<const char*, const TensorView*>> views) {
  for (const auto& [name, v] : views)
    if (v->defined() && v->dtype != t)
      return fmt::format("{} is {}, expected {}", name, dtype_name(v->dtype), dtype_name(t));
  return "";
}

Arena& scratch_of(const ExecContext& ctx, const char* op) {
  if (!ctx.scratch)
    throw RuntimeError(fmt::format("{}: needs a scratch arena (ExecContext::scratch is null)", op));
  return *ctx.scratch;
}

}  // namespace detail
}  // namespace primus::turbo
