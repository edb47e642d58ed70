// The training step's non-finite check, on the device, so no host decision sits between the
// backward and AdamW (and a CUDA graph can hold the whole step). status f32 [slots + 3] =
// {the micro-batches' loss sums [slots], grad norm, clip factor, finite flag}: the kernel sets
// the flag to 1 when loss sums [0, n_losses) and the norm are finite, else to 0 and the clip
// factor to NaN, which Turbo's AdamW reads as "skip this update" (turbo/ops/optimizer.h). One
// thread; it reads n_losses + 1 floats (n_losses <= slots).
#pragma once
#include <cuda_runtime_api.h>

#include <cstdint>

namespace primus::turbo::cuda {
void step_check(float* status, int64_t n_losses, int64_t slots, cudaStream_t stream);
}  // namespace primus::turbo::cuda
