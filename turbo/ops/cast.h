// dst = src converted elementwise: f32 -> bf16 (round to nearest even) on the device; i32 <-> f32
// (f32 -> i32 rounds to nearest; exact for integers below 2^24) on the device and the host; or a
// copy when the dtypes are equal (device or host). Both contiguous, same element count, same
// device. For small tensors between ops whose operand dtypes differ (e.g. the MoE router's f32
// logit gradient into the bf16 router GEMMs, token counts summed by a group that reduces floats).
#pragma once
#include "turbo/core/tensor_view.h"
#include "turbo/ops/exec_context.h"

namespace primus::turbo {

void cast(const TensorView& dst, const TensorView& src, const ExecContext& ctx);

// dst = src for two [N, C] views of one dtype and device whose rows are contiguous but may lie
// further apart than C elements (column slices of a wider buffer), e.g. the q columns of a packed
// q|k|v projection into a dense buffer and back. One strided copy (cudaMemcpy2DAsync on the
// device, ordered on ctx.stream); the two views must not overlap.
// A weight gradient computed on its own, added to the fp32 gradient that accumulates over
// micro-batches (Megatron-LM's gradient_accumulation_fusion: false, where the weight-gradient GEMM
// writes the parameter's dtype and main_grad.add_ follows): dst f32 = (accumulate ? dst : 0) +
// src f32 rounded to `round_to` (BF16: nearest even, as a GEMM writing bf16 rounds its f32 sums;
// F32: unchanged). Both contiguous with one element count, on one device.
void add_gradient(const TensorView& dst, const TensorView& src, DType round_to, bool accumulate, const ExecContext& ctx);

void copy_rows(const TensorView& dst, const TensorView& src, const ExecContext& ctx);

// Every element of dst (f32, contiguous) = the one f32 of src, on one device; on the device src is
// read there (graph-capturable): a per-tensor FP8 scale spread into the scale vector of a kernel
// that takes one scale per row (turbo/ops/grouped_gemm_fp8.h's tensorwise scaling).
void broadcast(const TensorView& dst, const TensorView& src, const ExecContext& ctx);

}  // namespace primus::turbo
