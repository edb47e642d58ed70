// Arena: one big block of memory handed out by bump allocation, so that a training step
// allocates nothing from the driver (cudaMalloc synchronises the device and is slow; CUDA
// graphs forbid it). A step calls mark() before its scratch allocations and rewind() after,
// or reset() drops everything. Freeing individual blocks is deliberately impossible.
//
// The Arena owns its block through a release callback: make_host_arena() (here) or
// make_device_arena() (turbo/core/cuda_arena.h, cudaMalloc) build one. Allocation is not
// thread-safe: one arena per thread or stream.
#pragma once
#include <cstddef>
#include <functional>
#include <initializer_list>
#include <memory>
#include <string>

#include "turbo/core/tensor_view.h"

namespace primus::turbo {

class Arena {
 public:
  static constexpr size_t kDefaultAlign = 256;  // cuBLASLt and 128-bit vector loads want >= 16

  // Takes ownership of [base, base + capacity) and calls release(base) on destruction.
  Arena(void* base, size_t capacity, Device device, std::function<void(void*)> release);
  ~Arena();
  Arena(const Arena&) = delete;
  Arena& operator=(const Arena&) = delete;

  // `bytes` from the block, aligned to `align` (a power of two). Throws primus::RuntimeError
  // naming `what`, the request and the remaining space when the block is exhausted.
  void* allocate(size_t bytes, size_t align = kDefaultAlign, const char* what = "buffer");
  // A contiguous tensor view of fresh arena memory (contents undefined).
  TensorView tensor(DType dtype, std::initializer_list<int64_t> shape, const char* what = "tensor");

  using Mark = size_t;
  Mark mark() const { return used_; }
  void rewind(Mark m);  // frees everything allocated after mark m
  void reset() { used_ = 0; }

  size_t used() const { return used_; }
  size_t capacity() const { return capacity_; }
  size_t high_water() const { return high_water_; }  // the most ever in use: size the next run
  Device device() const { return device_; }
  void* base() const { return base_; }

 private:
  char* base_;
  size_t capacity_;
  size_t used_ = 0;
  size_t high_water_ = 0;
  Device device_;
  std::function<void(void*)> release_;
};

// An arena in host memory (aligned operator new); for the CPU path and tests.
std::unique_ptr<Arena> make_host_arena(size_t bytes);

// RAII scope: rewinds the arena to where it stood on entry.
class ArenaScope {
 public:
  explicit ArenaScope(Arena& a) : arena_(a), mark_(a.mark()) {}
  ~ArenaScope() { arena_.rewind(mark_); }
  ArenaScope(const ArenaScope&) = delete;
  ArenaScope& operator=(const ArenaScope&) = delete;

 private:
  Arena& arena_;
  Arena::Mark mark_;
};

}  // namespace primus::turbo
