// Random device buffers for the op benchmark (fill.cu).
#pragma once
#include <cstdint>

#include "turbo/core/dtype.h"

namespace primus::bench {
// p[i] = offset + scale * u, u uniform in [-1, 1), for f32 or bf16 buffers of n elements.
void fill_uniform(void* p, turbo::DType dt, int64_t n, uint64_t seed, float scale = 1.0f, float offset = 0.0f);
// p[i] uniform in [0, hi).
void fill_ints(int32_t* p, int64_t n, uint64_t seed, int32_t hi);
}  // namespace primus::bench
