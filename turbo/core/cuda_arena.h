// A device-memory Arena: one cudaMalloc at start, bump allocation afterwards (see arena.h).
// Only CUDA-enabled code includes this header.
#pragma once
#include <memory>

#include "turbo/core/arena.h"

namespace primus::turbo {
// cudaMalloc's `bytes` on the current device; throws primus::RuntimeError (with the CUDA
// error and the size asked) when that fails. The arena cudaFree's the block on destruction.
std::unique_ptr<Arena> make_device_arena(size_t bytes);
}  // namespace primus::turbo
