#include "turbo/ops/op_support.h"

#include <fmt/format.h>

#include <cstring>

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

int64_t token_rows(const TensorView& t, const char* op, const char* name) {
  if (t.ndim != 4) throw RuntimeError(fmt::format("{}: {} must be [B,T,H,D], got {}", op, name, t.describe()));
  const int64_t T = t.shape[1], Hx = t.shape[2], D = t.shape[3];
  const int64_t row = t.strides[1];
  const bool ok = t.strides[3] == 1 && (Hx == 1 || t.strides[2] == D) && row >= Hx * D &&
                  (t.shape[0] == 1 || t.strides[0] == T * row);
  if (!ok)
    throw RuntimeError(fmt::format(
        "{}: {} must be token-major [B,T,H,D] with contiguous heads (token rows may be strided), got {}", op, name,
        t.describe()));
  return row;
}

void copy_token_rows(const TensorView& dst, const TensorView& src, void* stream) {
  const int64_t rows = src.shape[0] * src.shape[1], cols = src.shape[2] * src.shape[3];
  const size_t es = dtype_size(src.dtype);
  const int64_t sp = token_rows(src, "copy_token_rows", "src"), dp = token_rows(dst, "copy_token_rows", "dst");
  if (src.device == Device::CPU) {
    for (int64_t r = 0; r < rows; ++r)
      std::memcpy(static_cast<char*>(dst.data) + size_t(r * dp) * es,
                  static_cast<const char*>(src.data) + size_t(r * sp) * es, size_t(cols) * es);
    return;
  }
#ifdef PRIMUS_TURBO_WITH_CUDA
  cuda_copy_rows(dst.data, dp * int64_t(es), src.data, sp * int64_t(es), cols * int64_t(es), rows, stream);
#else
  (void)stream;
  throw RuntimeError("copy_token_rows: a device tensor in a build without CUDA");
#endif
}

TensorView DenseRows::in(const TensorView& t) {
  if (t.is_contiguous()) return t;
  TensorView c = alloc(t);
  copy_token_rows(c, t, ctx_.stream);
  return c;
}

TensorView DenseRows::out(const TensorView& t) { return t.is_contiguous() ? t : alloc(t); }

void DenseRows::finish(const TensorView& dst, const TensorView& dense) const {
  if (dense.data != dst.data) copy_token_rows(dst, dense, ctx_.stream);
}

TensorView DenseRows::alloc(const TensorView& t) {
  const auto& s = t.shape;
  if (t.device == Device::CPU) {
    host_.emplace_back(t.nbytes());
    return TensorView(host_.back().data(), t.dtype, Device::CPU, {s[0], s[1], s[2], s[3]});
  }
  if (!scope_) scope_.emplace(scratch_of(ctx_, op_));
  return ctx_.scratch->tensor(t.dtype, {s[0], s[1], s[2], s[3]}, "dense copy of a token-strided view");
}

Arena& scratch_of(const ExecContext& ctx, const char* op) {
  if (!ctx.scratch)
    throw RuntimeError(fmt::format("{}: needs a scratch arena (ExecContext::scratch is null)", op));
  return *ctx.scratch;
}

}  // namespace detail
}  // namespace primus::turbo
