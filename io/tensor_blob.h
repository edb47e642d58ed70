// TensorBlob: a tensor's bytes with its dtype and shape, as the file formats move them.
//
// A blob never copies on its own. It either
//   - owns its bytes (copy_of / from_vector: the bytes live in a shared buffer), or
//   - views bytes kept alive by an owner it shares (a mapped safetensors file: loading a
//     checkpoint hands out such views, so a trainer copies each tensor once, straight from the
//     page cache into its own buffer), or
//   - borrows bytes the caller keeps alive (borrow: how a trainer saves its fp32 weights
//     without a staging copy; the caller's buffer must outlive every use of the blob).
// Copying a blob copies the reference, not the bytes. Bytes are row-major, little-endian.
#pragma once
#include <cstddef>
#include <cstdint>
#include <memory>
#include <cstring>
#include <span>
#include <type_traits>
#include <vector>

#include "core/util/error.h"
#include "io/dtype.h"

namespace primus::io {

// Elements of `shape`; throws FormatError for a negative dimension or when the count or its
// byte size (count * dtype_size) overflows 64 bits.
uint64_t checked_numel(std::span<const int64_t> shape);
uint64_t checked_nbytes(DType dtype, std::span<const int64_t> shape);

// Whether elements of `dtype` may be read as T: T's own dtype; uint16_t also for BF16 and F16;
// uint8_t for every 1-byte dtype (BOOL, I8, FP8 as raw bytes).
template <class T>
constexpr bool element_type_matches(DType dtype) {
  if (dtype == dtype_of<T>()) return true;
  if constexpr (std::is_same_v<T, uint16_t>) return dtype == DType::BF16 || dtype == DType::F16;
  if constexpr (std::is_same_v<T, uint8_t>) return dtype_size(dtype) == 1;
  return false;
}

class TensorBlob {
 public:
  TensorBlob() = default;

  // Copies `nbytes` from `data`; nbytes must equal numel(shape) * dtype_size(dtype).
  static TensorBlob copy_of(DType dtype, std::vector<int64_t> shape, const void* data,
                            size_t nbytes);
  // Takes ownership of `values` without copying them.
  template <class T>
  static TensorBlob from_vector(std::vector<int64_t> shape, std::vector<T> values,
                                DType dtype = dtype_of<T>());
  // Refers to `data` without owning it (see the header comment for the lifetime rule).
  static TensorBlob borrow(DType dtype, std::vector<int64_t> shape, const void* data,
                           size_t nbytes);
  // Refers to `bytes`, which `owner` keeps alive.
  static TensorBlob view(DType dtype, std::vector<int64_t> shape, std::span<const std::byte> bytes,
                         std::shared_ptr<const void> owner);

  DType dtype() const { return dtype_; }
  const std::vector<int64_t>& shape() const { return shape_; }
  uint64_t numel() const { return nbytes_ / dtype_size(dtype_); }
  size_t nbytes() const { return nbytes_; }
  std::span<const std::byte> bytes() const { return {data_, nbytes_}; }
  const void* data() const { return data_; }

  // The elements in place. Throws RuntimeError when T does not match the dtype (16-bit floats:
  // pass uint16_t; it is accepted for U16, BF16 and F16) or the bytes are misaligned for T.
  template <class T>
  std::span<const T> as() const;
  // The elements copied out (any alignment); same dtype rule as as().
  template <class T>
  std::vector<T> to_vector() const;
  // The elements converted to fp32 from F32, F64, BF16 or F16.
  std::vector<float> to_fp32() const;

 private:
  TensorBlob(DType dtype, std::vector<int64_t> shape, const void* data, size_t nbytes,
             std::shared_ptr<const void> owner);
  template <class T>
  void check_type() const;

  DType dtype_ = DType::F32;
  std::vector<int64_t> shape_;
  const std::byte* data_ = nullptr;
  size_t nbytes_ = 0;
  std::shared_ptr<const void> owner_;
};

template <class T>
TensorBlob TensorBlob::from_vector(std::vector<int64_t> shape, std::vector<T> values,
                                   DType dtype) {
  auto owned = std::make_shared<const std::vector<T>>(std::move(values));
  const void* p = owned->data();
  size_t n = owned->size() * sizeof(T);
  return TensorBlob(dtype, std::move(shape), p, n, std::move(owned));
}

template <class T>
void TensorBlob::check_type() const {
  PRIMUS_CHECK(element_type_matches<T>(dtype_),
               "tensor of dtype {} read as a {}-byte element type of dtype {}",
               dtype_name(dtype_), sizeof(T), dtype_name(dtype_of<T>()));
}

template <class T>
std::span<const T> TensorBlob::as() const {
  check_type<T>();
  PRIMUS_CHECK(reinterpret_cast<uintptr_t>(data_) % alignof(T) == 0,
               "tensor data at {} is not aligned for {}-byte elements; use to_vector()",
               static_cast<const void*>(data_), alignof(T));
  return {reinterpret_cast<const T*>(data_), nbytes_ / sizeof(T)};
}

template <class T>
std::vector<T> TensorBlob::to_vector() const {
  check_type<T>();
  std::vector<T> out(nbytes_ / sizeof(T));
  if (nbytes_) std::memcpy(out.data(), data_, nbytes_);
  return out;
}

}  // namespace primus::io
