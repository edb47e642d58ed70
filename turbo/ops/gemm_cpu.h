// Internal to turbo/ops: the host f32 implementation behind gemm's CPU backend.
#pragma once
#include "turbo/ops/gemm_problem.h"

namespace primus::turbo::detail {
void gemm_cpu(const GemmArgs& args, const GemmShape& shape);
// FP8 operands (host bytes): dequantized to f32, the scales folded into alpha, then gemm_cpu.
void gemm_cpu_fp8(const GemmArgs& args, const GemmShape& shape);
}  // namespace primus::turbo::detail
