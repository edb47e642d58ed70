// The training step's non-finite check, on the device, so no host decision sits between the
// backward and AdamW (and a CUDA graph can hold the whole step). status f32 [slots + 3] =
// {the micro-batches' loss sums [slots], grad norm, clip factor, finite flag}: the kernel sets
// the flag to 1 when loss sums [0, n_losses) and the norm are finite, else to 0 and the clip
// factor to NaN, which Turbo's AdamW reads as "skip this update" (turbo/ops/optimizer.h). One
// thread; it reads n_losses + 1 floats (n_losses <= slots).
#pragma once
#include <cuda_runtime_api.h>

#include <math.h>
#include <string.h>

#include <cstdint>

#if defined(__CUDACC__)
#define PRIMUS_STEP_CHECK_HD __host__ __device__
#else
#define PRIMUS_STEP_CHECK_HD
#endif

namespace primus::turbo::cuda {
void step_check(float* status, int64_t n_losses, int64_t slots, cudaStream_t stream);

// The same check when AdamW runs group by group inside the backward (the optimizer in the
// backward: a group is a layer, or the embeddings, or the final norm and head), each group's
// update computing the norm of the gradients it applied in the same pass:
//   step_check_begin, before the first group: the flag and clip factor from the loss sums
//                [0, n_losses) alone (1 and 1; or 0 and NaN, which skips every group), the norm
//                slot reset;
//   step_check_group, after each group with its norm `group_norm` (f32 [1]): the norm slot
//                accumulates its square; a non-finite norm after a finite loss means that group
//                was applied with non-finite values: the flag becomes -1 (the step is neither done
//                nor undone, the run must stop) and the clip factor NaN (the groups after it are
//                skipped); after the last group the norm slot becomes the global norm.
void step_check_begin(float* status, int64_t n_losses, int64_t slots, cudaStream_t stream);
void step_check_group(float* status, int64_t slots, const float* group_norm, bool last, cudaStream_t stream);

// One thread's work, shared by the kernels and by host mode (which calls them directly).
PRIMUS_STEP_CHECK_HD inline bool step_check_finite(float x) { return (x - x) == 0.0f; }  // false for inf, NaN
PRIMUS_STEP_CHECK_HD inline float step_check_nan() {
  const uint32_t bits = 0x7fc00000u;  // quiet NaN: AdamW skips
  float nan;
  memcpy(&nan, &bits, sizeof(nan));
  return nan;
}
// step_check's work: the flag from loss sums [0, n_losses) and the norm slot; a non-finite step
// gets a NaN clip factor.
PRIMUS_STEP_CHECK_HD inline void step_check_apply(float* status, int64_t n_losses, int64_t slots) {
  bool ok = step_check_finite(status[slots]);
  for (int64_t i = 0; i < n_losses; ++i) ok = ok && step_check_finite(status[i]);
  status[slots + 2] = ok ? 1.0f : 0.0f;
  if (!ok) status[slots + 1] = step_check_nan();
}
PRIMUS_STEP_CHECK_HD inline void step_check_begin_apply(float* status, int64_t n_losses, int64_t slots) {
  bool ok = true;
  for (int64_t i = 0; i < n_losses; ++i) ok = ok && step_check_finite(status[i]);
  status[slots] = 0.0f;
  status[slots + 1] = ok ? 1.0f : step_check_nan();
  status[slots + 2] = ok ? 1.0f : 0.0f;
}
PRIMUS_STEP_CHECK_HD inline void step_check_group_apply(float* status, int64_t slots, float g, bool last) {
  if (!step_check_finite(g) && status[slots + 2] > 0.0f) {
    status[slots + 2] = -1.0f;
    status[slots + 1] = step_check_nan();
  }
  status[slots] += g * g;
  if (last) status[slots] = sqrtf(status[slots]);
}
}  // namespace primus::turbo::cuda
