// TensorView: a non-owning view of up to 4-D memory on the host or a CUDA device. It is what
// every Turbo op takes and returns; memory is owned elsewhere (an Arena, a model's parameter
// buffer, a std::vector in a test). Shapes and strides count elements, not bytes; a
// dimension's stride may be any non-negative number (0 broadcasts), and `contiguous()` means
// row-major with no gaps.
#pragma once
#include <array>
#include <cstddef>
#include <cstdint>
#include <initializer_list>
#include <string>

#include "turbo/core/dtype.h"

namespace primus::turbo {

enum class Device : uint8_t { CPU, CUDA };
std::string_view device_name(Device d);  // "cpu" | "cuda"

struct TensorView {
  static constexpr int kMaxDims = 4;

  void* data = nullptr;
  DType dtype = DType::F32;
  Device device = Device::CPU;
  int ndim = 0;
  std::array<int64_t, kMaxDims> shape{};    // elements per dimension
  std::array<int64_t, kMaxDims> strides{};  // elements between neighbours along a dimension

  TensorView() = default;
  // A row-major contiguous view over `data`. Throws primus::RuntimeError on >4 dims or a
  // negative size.
  TensorView(void* data, DType dtype, Device device, std::initializer_list<int64_t> shape);
  static TensorView contiguous(void* data, DType dtype, Device device, const int64_t* dims, int ndim);

  bool defined() const { return data != nullptr; }
  int64_t size(int d) const;  // negative d counts from the end, like Python
  int64_t stride(int d) const;
  int64_t numel() const;
  size_t nbytes() const { return static_cast<size_t>(numel()) * dtype_size(dtype); }
  bool is_contiguous() const;
  // Rows x columns view of a contiguous tensor: all leading dims folded into rows.
  int64_t rows() const { return ndim == 0 ? 1 : numel() / size(-1); }
  int64_t cols() const { return ndim == 0 ? 1 : size(-1); }

  template <class T> T* ptr() const { return static_cast<T*>(data); }

  // Same memory, new shape; requires a contiguous view and equal element count.
  TensorView reshape(std::initializer_list<int64_t> new_shape) const;
  // Rows [begin, end) along dimension 0 (keeps strides, so also for non-contiguous views).
  TensorView slice0(int64_t begin, int64_t end) const;
  // Matrix transpose of the last two dims (swaps shape and strides; no data moves).
  TensorView transposed() const;

  std::string describe() const;  // e.g. "bf16[16384, 768] cuda" (+ strides when non-contiguous)
};

// Argument checks for op entry points. Each throws primus::RuntimeError naming the op, the
// argument and what it got, e.g. "layernorm_forward: inp: expected bf16 got f32".
void check_defined(const TensorView& t, const char* op, const char* arg);
void check_dtype(const TensorView& t, DType want, const char* op, const char* arg);
void check_device(const TensorView& t, Device want, const char* op, const char* arg);
void check_contiguous(const TensorView& t, const char* op, const char* arg);
void check_shape(const TensorView& t, std::initializer_list<int64_t> want, const char* op,
                 const char* arg);
void check_same_device(const TensorView& a, const TensorView& b, const char* op);

}  // namespace primus::turbo
