// Random device buffers for the benchmarks (fill.cu): timing on zeros would flatter the kernels
// (zeros move faster through the tensor cores and compress in the memory system). The values
// are the host device's hash_uniform (bench_device.h), so both devices see the same inputs.
#pragma once
#include <cstdint>

#include "turbo/core/dtype.h"

namespace primus::turbo::bench {
// p[i] = offset + scale * u, u uniform in [-1, 1), for f32, bf16 or f16 buffers of n elements.
void fill_uniform_device(void* p, DType dt, int64_t n, uint64_t seed, float scale = 1.0f, float offset = 0.0f);
// p[i] uniform in [0, hi).
void fill_ints_device(int32_t* p, int64_t n, uint64_t seed, int32_t hi);
// One block that spins on the device's global timer for `ms` on the default stream (the host
// returns at once).
void spin_device(double ms);
}  // namespace primus::turbo::bench
