#include "turbo/core/arena.h"

#include <fmt/format.h>

#include <new>

#include "core/util/error.h"

namespace primus::turbo {

Arena::Arena(void* base, size_t capacity, Device device, std::function<void(void*)> release)
    : base_(static_cast<char*>(base)), capacity_(capacity), device_(device),
      release_(std::move(release)) {
  PRIMUS_CHECK(base != nullptr || capacity == 0, "Arena: null base for {} bytes", capacity);
}

Arena::~Arena() {
  if (release_ && base_) release_(base_);
}

void* Arena::allocate(size_t bytes, size_t align, const char* what) {
  PRIMUS_CHECK(align != 0 && (align & (align - 1)) == 0, "Arena: alignment {} for {} is not a power of two", align, what);
  // Align the address, not just the offset, so a base with weaker alignment still works.
  const uintptr_t base = reinterpret_cast<uintptr_t>(base_);
  const uintptr_t start = (base + used_ + align - 1) & ~(static_cast<uintptr_t>(align) - 1);
  const size_t offset = start - base;
  if (offset > capacity_ || bytes > capacity_ - offset) {
    throw RuntimeError(fmt::format(
        "{} arena exhausted: {} needs {} bytes (align {}), {} of {} bytes in use; raise the "
        "arena size (high water so far {} bytes)",
        device_name(device_), what, bytes, align, used_, capacity_, high_water_));
  }
  used_ = offset + bytes;
  if (used_ > high_water_) high_water_ = used_;
  return base_ + offset;
}

TensorView Arena::tensor(DType dtype, std::initializer_list<int64_t> shape, const char* what) {
  TensorView t = TensorView::contiguous(nullptr, dtype, device_, shape.begin(),
                                        static_cast<int>(shape.size()));
  t.data = allocate(t.nbytes(), kDefaultAlign, what);
  return t;
}

void Arena::rewind(Mark m) {
  PRIMUS_CHECK(m <= used_, "Arena::rewind to {} but only {} bytes are in use (stale mark?)", m, used_);
  used_ = m;
}

std::unique_ptr<Arena> make_host_arena(size_t bytes) {
  constexpr std::align_val_t kAlign{Arena::kDefaultAlign};
  void* p = bytes ? ::operator new(bytes, kAlign) : nullptr;
  return std::make_unique<Arena>(p, bytes, Device::CPU,
                                 [kAlign](void* q) { ::operator delete(q, kAlign); });
}

}  // namespace primus::turbo
