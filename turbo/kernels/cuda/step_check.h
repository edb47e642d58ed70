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
// backward: a group is a layer, or the embeddings, or the final norm and head), after each
// group's gradient norm `group_norm` (f32 [1]) and before its update, which reads the clip factor:
//   first group: the flag and clip factor from the loss sums [0, n_losses) alone (1 and 1, or 0
//                and NaN: no group is applied), the norm slot reset;
//   every group: the norm slot accumulates the group's squared norm; a non-finite group norm
//                after a finite loss sets the clip factor to NaN (this group and those after it
//                are skipped) and the flag to 0 for the first group (nothing was applied) or -1
//                (the groups before it were applied: the step is neither done nor undone);
//   last group:  the norm slot becomes the global norm.
void step_check_group(float* status, int64_t n_losses, int64_t slots, const float* group_norm, bool first, bool last,
                      cudaStream_t stream);

// One thread's work, shared by the kernel and by host mode (which calls it directly).
PRIMUS_STEP_CHECK_HD inline void step_check_group_apply(float* status, int64_t n_losses, int64_t slots, float g,
                                                        bool first, bool last) {
  auto finite = [](float x) { return (x - x) == 0.0f; };  // false for inf and NaN
  float* norm = status + slots;
  float* factor = norm + 1;
  float* flag = norm + 2;
  const uint32_t nan_bits = 0x7fc00000u;  // quiet NaN: AdamW skips
  float nan;
  memcpy(&nan, &nan_bits, sizeof(nan));
  if (first) {
    bool ok = true;
    for (int64_t i = 0; i < n_losses; ++i) ok = ok && finite(status[i]);
    *norm = 0.0f;
    *flag = ok ? 1.0f : 0.0f;
    *factor = ok ? 1.0f : nan;
  }
  if (!finite(g) && *flag != 0.0f) {
    *flag = first ? 0.0f : -1.0f;
    *factor = nan;
  }
  *norm += g * g;
  if (last) *norm = sqrtf(*norm);
}
}  // namespace primus::turbo::cuda
