// Random device buffers for the attention benchmark (fill_random.cu).
#pragma once
#include <cstdint>

#include "turbo/core/dtype.h"

namespace primus::bench {
// p[i] uniform in [-scale, scale) for bf16 or f16 buffers of n elements.
void fill_random(void* p, turbo::DType dt, int64_t n, uint64_t seed, float scale = 1.0f);
}  // namespace primus::bench
