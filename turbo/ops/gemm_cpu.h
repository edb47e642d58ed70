// Internal to turbo/ops: the host f32 implementation behind gemm's CPU backend.
#pragma once
#include "turbo/ops/gemm_problem.h"

namespace primus::turbo::detail {
void gemm_cpu(const GemmArgs& args, const GemmShape& shape);
}  // namespace primus::turbo::detail
