// Rotary position embedding on q or k, interleaved pairs (turbo/kernels/cpu/rope.h states the
// convention and how it maps to Hugging Face's half-split one).
//   x [B,T,H,D] (token rows may be strided: detail::token_rows), D a multiple of 8, f32 or bf16; positions [B,T] int32 or undefined
//   (pos = t); forward: out = R(pos) x; backward: dinp = R(pos)^T dout (= or += with accumulate).
// The TURBO backend reads cos/sin from `table` [max_pos, D/2, 2] f32 on the device, built once
// with rope_build_table (in double, like the reference); the CPU backend uses `base` and
// `scaling` directly.
#pragma once
#include <string>

#include "core/util/rope_scaling.h"
#include "turbo/core/tensor_view.h"
#include "turbo/dispatch/backend_type.h"
#include "turbo/ops/exec_context.h"

namespace primus::turbo {

struct RopeArgs {
  bool backward = false;   // true: out = dinp, inp = dout
  TensorView out, inp;     // [B,T,H,D]; out may alias inp unless backward with accumulate
  TensorView positions;    // [B,T] i32, optional
  TensorView table;        // [max_pos, D/2, 2] f32 (device backends)
  double base = 10000.0;
  RopeScaling scaling;     // Llama-3 frequency scaling (CPU backend; device backends: in the table)
  bool accumulate = false;
  ExecContext ctx;
  std::string key() const;
  Precision precision() const { return precision_of(inp.dtype); }
};

BackendType rope(const RopeArgs& args);

// Fills table [max_pos, D/2, 2] (f32, CUDA) with {cos, sin}(pos * inv_freq[i]), the frequencies
// of cpu::rope_inv_freq(D, base, scaling): base^(-2i/D) unless scaling is enabled.
void rope_build_table(const TensorView& table, double base, const ExecContext& ctx, const RopeScaling& scaling = {});

}  // namespace primus::turbo
