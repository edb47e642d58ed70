// dst = src converted elementwise: f32 -> bf16 (round to nearest even) on the device, or a copy
// when the dtypes are equal (device or host). Both contiguous, same element count, same device.
// For small tensors between ops whose operand dtypes differ (e.g. the MoE router's f32 logit
// gradient into the bf16 router GEMMs).
#pragma once
#include "turbo/core/tensor_view.h"
#include "turbo/ops/exec_context.h"

namespace primus::turbo {

void cast(const TensorView& dst, const TensorView& src, const ExecContext& ctx);

}  // namespace primus::turbo
