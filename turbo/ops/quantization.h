// FP8 quantisation for FP8 training with current scaling (each scale from the amax of the data
// it scales, right before use), per tensor as Transformer Engine's current-scaling recipe and
// torchao's tensorwise float8 do it, or per group (rows, 1x128 tiles, 128x128 blocks; see
// turbo/core/fp8_granularity.h) as torchao's rowwise and DeepSeek-V3's blockwise recipes do. For
// each group (the whole tensor at Tensor granularity):
//   amax      = max |x| over the group
//   scale     = fp8_max / amax   (448 for f8e4m3, 57344 for f8e5m2); 1 when amax == 0, FLT_MAX
//               when the quotient overflows (amax an f32 subnormal)
//   q         = fp8(x * scale): the product rounded to f32, then to FP8 to nearest even,
//               saturating to +-fp8_max
//   scale_inv = 1 / scale        (what an FP8 GEMM multiplies its product by to undo the scale)
// Non-finite input (an inf or NaN in a group): the result must not pass for finite numbers, so
// that group's scale_inv is NaN (bits 0x7fc00000) and every output byte of it is 0x7f (NaN in
// e4m3 and e5m2).
// out_t is the quantisation of inp^T at the same granularity, its groups read along its own rows:
// at Row granularity one scale per column of inp, at Block1x128 one per column of inp and 128
// consecutive rows; at Tensor and Block128x128 the groups are those of out, transposed.
// Row groups (offsets or group_rows; Row granularity, with out_t): the rows of inp are cut into G
// groups of consecutive rows, e.g. the tokens of each expert of an MoE layer, and out_t's scales
// are taken per group and column instead of per column, so that an expert's weight-gradient GEMM
// (out_t's columns of one group as its K dimension) does not take its scale from other experts'
// tokens. Group g is rows [offsets[g], offsets[g+1]) (rows from offsets[G] on belong to none), or
// rows [g * group_rows, (g + 1) * group_rows). Element (c, r) of out_t, r in group g, is
// fp8(x[r, c] * scale[g, c]) with scale[g, c] from max |x| over column c of group g's rows, by the
// recipe above (a non-finite segment: that (g, c)'s scale_inv NaN and its bytes 0x7f);
// scale_inv_t is [G, C]; a group with no rows gets scale_inv_t 1 and writes nothing; out_t's
// columns at rows of no group are left as they were. out, when defined too, keeps its per-row
// scales over all R rows.
// Backends: TURBO (device tensors; turbo/kernels/cuda/quantize.h: a few launches, deterministic,
// graph-capturable, no allocation) and CPU (host tensors; the reference,
// turbo/kernels/cpu/quantize.h). Both give the same bytes and scale_inv, bit for bit.
#pragma once
#include <string>

#include "turbo/core/tensor_view.h"
#include "turbo/dispatch/backend_type.h"
#include "turbo/core/fp8_granularity.h"
#include "turbo/ops/exec_context.h"

namespace primus::turbo {

// A producer folded into the quantizer (QuantizeFp8Args::prologue): the tensor quantized is not
// inp itself but what an activation would have written from it, computed as it is read.
enum class QuantizePrologue : uint8_t {
  None,
  SwiGLU,          // silu(gate) * up of inp = gate_up [R, 2F]: an [R, F] tensor
  SwiGLUBackward,  // [dgate | dup] from inp = dL/dy [R, F] and gate_up [R, 2F]: an [R, 2F] tensor
};

struct QuantizeFp8Args {
  TensorView inp;        // [R, C] bf16 or f32; rows may be strided: stride(1) == 1, stride(0) >= C
  TensorView out;        // [R, C] f8e4m3 or f8e5m2, contiguous row-major; may be undefined
  TensorView out_t;      // [C, R] same FP8 dtype as out, contiguous (inp transposed); may be undefined
  TensorView scale_inv;  // f32 on inp's device, written: the scales of out (fp8_scale_shape(g, R, C));
                         // at Tensor granularity also those of out_t
  TensorView scale_inv_t;  // f32, written: the scales of out_t (fp8_scale_shape(g, C, R); [G, C]
                           // with row groups); needed with out_t at Row / Block granularities,
                           // unused at Tensor
  Fp8Granularity granularity = Fp8Granularity::Tensor;
  // Delayed scaling (Tensor granularity only; turbo/ops/fp8_delayed.h): f32 [1] on inp's device,
  // positive and finite: quantize with this scale instead of the tensor's own amax (one pass; an
  // inf or NaN element becomes the poison byte, its neighbours keep their values). Undefined:
  // current scaling as above.
  TensorView scale;
  // f32 [1] on inp's device, >= 0: max |x| of inp is folded in (kept when larger), under either
  // scaling; a NaN beats inf beats any finite value. Undefined: nothing recorded.
  TensorView amax;
  // Row groups for out_t (see above); at most one of the two, only at Row granularity with out_t
  // and current scaling (no scale / amax). offsets: i32 [G + 1] on inp's device, offsets[0] = 0,
  // non-decreasing, offsets[G] <= R; the device reads it there (no host copy: graph-capturable,
  // a new plan needs no new capture); the host checks it and throws naming the first bad entry,
  // the device clamps a bad one into [0, R] (wrong results, never memory past the tensors).
  // group_rows > 0: G = R / group_rows equal groups (R must be a multiple).
  TensorView offsets;
  int64_t group_rows = 0;
  // The maxima of inp already taken by the op that wrote it (e.g. ActivationBackwardArgs::maxima),
  // f32 on inp's device, under current scaling without row groups: at Row granularity with out_t
  // [R + C], max |x| of each row of inp, then of each column; at Tensor granularity [1], max |x| of
  // inp. The device quantizer then skips its own pass over inp (one read instead of two); the
  // result is the same bytes and scales as without them. They must be exactly inp's maxima: the
  // host backend checks them against its own and throws naming the first that differs; the
  // device trusts them.
  TensorView maxima;
  // Rows in use (Tensor granularity, no maxima): i32 [1] on inp's device, read there
  // (graph-capturable), e.g. offsets[G] of an MoE row plan whose buffer has more rows than the plan
  // fills. The amax (the scale under current scaling, and what amax records under either) is taken
  // over rows [0, min(R, max(0, rows_in_use))) only, so stale rows past it cannot change it; every
  // row is still quantized with the scale, and the bytes of rows past it are not specified (a
  // consumer reads none of them). Undefined: all R rows.
  TensorView rows_in_use;
  // With a prologue (above) the quantized tensor is the activation's output, each value rounded to
  // inp's type as activation_forward / activation_backward write it: the same bytes, scales and
  // amax as that op followed by quantize_fp8, with one read of its inputs and no write of the
  // activation. out / out_t / scale_inv are shaped by that tensor ([R, F] or [R, 2F]). Tensor
  // granularity with delayed scaling (scale) only, no maxima or row groups, inp and gate_up
  // contiguous; on the device bf16 with the alignments of quantize_fp8_prologue_fits.
  QuantizePrologue prologue = QuantizePrologue::None;
  TensorView gate_up;  // SwiGLUBackward: the forward's input [R, 2F]
  ExecContext ctx;       // device: ctx.stream, and ctx.scratch for the amax partials (at most
                         // quantize_fp8_scratch_bytes; with row groups 4 * (G * C + R) bytes,
                         // cuda::quantize_fp8_row_groups_scratch_bytes), taken and given back
                         // inside the call; unused on the host
  std::string key() const;
  Precision precision() const { return Precision::FP8; }
};

// Writes out and/or out_t (at least one must be defined) and scale_inv. Throws
// primus::RuntimeError naming the argument for a wrong shape, dtype, layout or device.
BackendType quantize_fp8(const QuantizeFp8Args& args);

// What prologue `kind` computes, written into `out` by the activation op: activation_forward of
// inp = gate_up (SwiGLU) or activation_backward of inp = dL/dy with gate_up (SwiGLUBackward). The
// host reference of the fold, and what a caller runs instead where the fold does not fit.
void run_quantize_prologue(QuantizePrologue kind, const TensorView& out, const TensorView& inp,
                           const TensorView& gate_up, const ExecContext& ctx);

// Whether quantize_fp8 runs `args` with its prologue: on the host always, on the device when the
// folded kernel takes the dtype, shape and alignment (cuda::quantize_fp8_swiglu_unsupported_reason).
// The argument checks of quantize_fp8 still apply. A caller that gets false writes the activation
// and quantizes it instead.
bool quantize_fp8_prologue_fits(const QuantizeFp8Args& args);

}  // namespace primus::turbo
