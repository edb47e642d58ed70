#include "turbo/core/tensor_view.h"

#include <fmt/format.h>

#include "core/util/error.h"

namespace primus::turbo {

std::string_view device_name(Device d) { return d == Device::CUDA ? "cuda" : "cpu"; }

TensorView TensorView::contiguous(void* data, DType dtype, Device device, const int64_t* dims,
                                  int ndim) {
  PRIMUS_CHECK(ndim >= 0 && ndim <= kMaxDims, "TensorView: {} dims given, at most {}", ndim,
               kMaxDims);
  TensorView t;
  t.data = data;
  t.dtype = dtype;
  t.device = device;
  t.ndim = ndim;
  int64_t stride = 1;
  for (int d = ndim - 1; d >= 0; --d) {
    PRIMUS_CHECK(dims[d] >= 0, "TensorView: negative size {} in dim {}", dims[d], d);
    t.shape[d] = dims[d];
    t.strides[d] = stride;
    stride *= dims[d];
  }
  return t;
}

TensorView::TensorView(void* d, DType dt, Device dev, std::initializer_list<int64_t> s) {
  *this = contiguous(d, dt, dev, s.begin(), static_cast<int>(s.size()));
}

int64_t TensorView::size(int d) const {
  const int i = d < 0 ? d + ndim : d;
  PRIMUS_CHECK(i >= 0 && i < ndim, "TensorView::size: dim {} out of range for {}", d, describe());
  return shape[i];
}

int64_t TensorView::stride(int d) const {
  const int i = d < 0 ? d + ndim : d;
  PRIMUS_CHECK(i >= 0 && i < ndim, "TensorView::stride: dim {} out of range for {}", d,
               describe());
  return strides[i];
}

int64_t TensorView::numel() const {
  int64_t n = 1;
  for (int d = 0; d < ndim; ++d) n *= shape[d];
  return n;
}

bool TensorView::is_contiguous() const {
  int64_t expect = 1;
  for (int d = ndim - 1; d >= 0; --d) {
    if (shape[d] != 1 && strides[d] != expect) return false;
    expect *= shape[d];
  }
  return true;
}

TensorView TensorView::reshape(std::initializer_list<int64_t> s) const {
  PRIMUS_CHECK(is_contiguous(), "reshape needs a contiguous view, got {}", describe());
  TensorView r = contiguous(data, dtype, device, s.begin(), static_cast<int>(s.size()));
  PRIMUS_CHECK(r.numel() == numel(), "reshape of {} to {} changes the element count", describe(),
               r.describe());
  return r;
}

TensorView TensorView::slice0(int64_t begin, int64_t end) const {
  PRIMUS_CHECK(ndim >= 1 && begin >= 0 && begin <= end && end <= shape[0],
               "slice0 [{}, {}) out of range for {}", begin, end, describe());
  TensorView r = *this;
  r.data = static_cast<char*>(data) + begin * strides[0] * static_cast<int64_t>(dtype_size(dtype));
  r.shape[0] = end - begin;
  return r;
}

TensorView TensorView::transposed() const {
  PRIMUS_CHECK(ndim >= 2, "transposed needs >= 2 dims, got {}", describe());
  TensorView r = *this;
  std::swap(r.shape[ndim - 1], r.shape[ndim - 2]);
  std::swap(r.strides[ndim - 1], r.strides[ndim - 2]);
  return r;
}

std::string TensorView::describe() const {
  std::string s = fmt::format("{}[", dtype_name(dtype));
  for (int d = 0; d < ndim; ++d) s += fmt::format("{}{}", d ? ", " : "", shape[d]);
  s += fmt::format("] {}", device_name(device));
  if (!is_contiguous()) {
    s += " strides(";
    for (int d = 0; d < ndim; ++d) s += fmt::format("{}{}", d ? ", " : "", strides[d]);
    s += ")";
  }
  return s;
}

void check_defined(const TensorView& t, const char* op, const char* arg) {
  if (!t.defined()) throw RuntimeError(fmt::format("{}: {}: tensor is not set (null data)", op, arg));
}

void check_dtype(const TensorView& t, DType want, const char* op, const char* arg) {
  if (t.dtype != want)
    throw RuntimeError(fmt::format("{}: {}: expected {} got {} ({})", op, arg, dtype_name(want),
                                   dtype_name(t.dtype), t.describe()));
}

void check_device(const TensorView& t, Device want, const char* op, const char* arg) {
  if (t.device != want)
    throw RuntimeError(fmt::format("{}: {}: expected a {} tensor got {}", op, arg,
                                   device_name(want), t.describe()));
}

void check_contiguous(const TensorView& t, const char* op, const char* arg) {
  if (!t.is_contiguous())
    throw RuntimeError(fmt::format("{}: {}: expected a contiguous tensor got {}", op, arg,
                                   t.describe()));
}

void check_shape(const TensorView& t, std::initializer_list<int64_t> want, const char* op,
                 const char* arg) {
  bool ok = static_cast<int>(want.size()) == t.ndim;
  int d = 0;
  for (auto w : want) {
    if (ok && w >= 0 && t.shape[d] != w) ok = false;
    ++d;
  }
  if (!ok) {
    std::string w = "[";
    d = 0;
    for (auto x : want) w += fmt::format("{}{}", d++ ? ", " : "", x < 0 ? std::string("*") : std::to_string(x));
    w += "]";
    throw RuntimeError(fmt::format("{}: {}: expected shape {} got {}", op, arg, w, t.describe()));
  }
}

void check_same_device(const TensorView& a, const TensorView& b, const char* op) {
  if (a.device != b.device)
    throw RuntimeError(fmt::format("{}: tensors on different devices: {} and {}", op,
                                   a.describe(), b.describe()));
}

}  // namespace primus::turbo
