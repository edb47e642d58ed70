#include "turbo/core/cuda_arena.h"

#include <fmt/format.h>

#include "core/util/error.h"
#include "turbo/core/cuda_check.h"

namespace primus::turbo {

std::unique_ptr<Arena> make_device_arena(size_t bytes) {
  void* p = nullptr;
  if (bytes) {
    const cudaError_t err = cudaMalloc(&p, bytes);
    if (err != cudaSuccess) {
      (void)cudaGetLastError();
      throw RuntimeError(fmt::format("device arena: cudaMalloc of {} bytes ({:.2f} GiB) failed: {}",
                                     bytes, bytes / 1073741824.0, cudaGetErrorString(err)));
    }
  }
  // cudaFree in a destructor must not throw; at process exit the context may already be gone.
  return std::make_unique<Arena>(p, bytes, Device::CUDA, [](void* q) { (void)cudaFree(q); });
}

}  // namespace primus::turbo
