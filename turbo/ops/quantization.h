// FP8 quantisation for FP8 training: per-tensor ("tensorwise") scaling with current scaling, as
// Transformer Engine's current-scaling recipe and torchao's tensorwise float8 do it:
//   amax      = max |x| over the whole tensor
//   scale     = fp8_max / amax   (448 for f8e4m3, 57344 for f8e5m2); 1 when amax == 0, FLT_MAX
//               when the quotient overflows (amax an f32 subnormal)
//   q         = fp8(x * scale): the product rounded to f32, then to FP8 to nearest even,
//               saturating to +-fp8_max
//   scale_inv = 1 / scale        (what an FP8 GEMM multiplies its product by to undo the scale)
// Non-finite input (an inf or NaN anywhere): the result must not pass for finite numbers, so
// scale_inv is NaN (bits 0x7fc00000) and every output byte is 0x7f (NaN in e4m3 and e5m2).
// Backends: TURBO (device tensors; turbo/kernels/cuda/quantize.h: two launches, deterministic,
// graph-capturable, no allocation) and CPU (host tensors; the reference,
// turbo/kernels/cpu/quantize.h). Both give the same bytes and scale_inv, bit for bit.
#pragma once
#include <string>

#include "turbo/core/tensor_view.h"
#include "turbo/dispatch/backend_type.h"
#include "turbo/ops/exec_context.h"

namespace primus::turbo {

struct QuantizeFp8Args {
  TensorView inp;        // [R, C] bf16 or f32; rows may be strided: stride(1) == 1, stride(0) >= C
  TensorView out;        // [R, C] f8e4m3 or f8e5m2, contiguous row-major; may be undefined
  TensorView out_t;      // [C, R] same FP8 dtype as out, contiguous (inp transposed); may be undefined
  TensorView scale_inv;  // [1] f32 on inp's device, written
  ExecContext ctx;       // device: ctx.stream, and ctx.scratch for the amax partials (4 KiB, taken
                         // and given back inside the call); unused on the host
  std::string key() const;
  Precision precision() const { return Precision::FP8; }
};

// Writes out and/or out_t (at least one must be defined) and scale_inv. Throws
// primus::RuntimeError naming the argument for a wrong shape, dtype, layout or device.
BackendType quantize_fp8(const QuantizeFp8Args& args);

}  // namespace primus::turbo
