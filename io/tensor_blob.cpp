#include "io/tensor_blob.h"

#include <fmt/ranges.h>

#include <cstring>

namespace primus::io {

uint64_t checked_numel(std::span<const int64_t> shape) {
  uint64_t n = 1;
  for (int64_t d : shape) {
    if (d < 0) throw FormatError(fmt::format("negative dimension {} in shape [{}]", d,
                                             fmt::join(shape, ", ")));
    if (__builtin_mul_overflow(n, static_cast<uint64_t>(d), &n)) {
      throw FormatError(fmt::format("shape [{}] has more than 2^64 elements",
                                    fmt::join(shape, ", ")));
    }
  }
  return n;
}

uint64_t checked_nbytes(DType dtype, std::span<const int64_t> shape) {
  uint64_t bytes;
  if (__builtin_mul_overflow(checked_numel(shape), dtype_size(dtype), &bytes)) {
    throw FormatError(fmt::format("shape [{}] of {} is more than 2^64 bytes",
                                  fmt::join(shape, ", "), dtype_name(dtype)));
  }
  return bytes;
}

TensorBlob::TensorBlob(DType dtype, std::vector<int64_t> shape, const void* data, size_t nbytes,
                       std::shared_ptr<const void> owner)
    : dtype_(dtype),
      shape_(std::move(shape)),
      data_(static_cast<const std::byte*>(data)),
      nbytes_(nbytes),
      owner_(std::move(owner)) {
  uint64_t want = checked_nbytes(dtype_, shape_);
  if (want != nbytes_) {
    throw RuntimeError(fmt::format("tensor of shape [{}] and dtype {} needs {} bytes, got {}",
                                   fmt::join(shape_, ", "), dtype_name(dtype_), want, nbytes_));
  }
  PRIMUS_CHECK(data_ != nullptr || nbytes_ == 0, "tensor of {} bytes has no data", nbytes_);
}

TensorBlob TensorBlob::copy_of(DType dtype, std::vector<int64_t> shape, const void* data,
                               size_t nbytes) {
  auto owned = std::make_shared<std::vector<std::byte>>(nbytes);
  if (nbytes) std::memcpy(owned->data(), data, nbytes);
  const void* p = owned->data();
  return TensorBlob(dtype, std::move(shape), p, nbytes, std::move(owned));
}

TensorBlob TensorBlob::borrow(DType dtype, std::vector<int64_t> shape, const void* data,
                              size_t nbytes) {
  return TensorBlob(dtype, std::move(shape), data, nbytes, nullptr);
}

TensorBlob TensorBlob::view(DType dtype, std::vector<int64_t> shape,
                            std::span<const std::byte> bytes, std::shared_ptr<const void> owner) {
  return TensorBlob(dtype, std::move(shape), bytes.data(), bytes.size(), std::move(owner));
}

std::vector<float> TensorBlob::to_fp32() const {
  std::vector<float> out(numel());
  io::to_fp32(dtype_, data_, out.size(), out.data());
  return out;
}

}  // namespace primus::io
