// Per-head RMSNorm in place (Qwen3's and Megatron's qk_layernorm): every head of q and of k
// normalised over its own D features, before RoPE, one weight [D] for the query heads and one
// for the key heads, each shared by its heads.
//
//   x       [B,T,Hx,D], token rows may be strided (detail::token_rows): the q|k columns of the
//           packed qkv projection, Hx = H + KV heads, the first q_heads of them queries.
//   forward:  x = x * rstd * (h < q_heads ? weight : weight_k)   (in place)
//             saved [B,T,Hx,D] (dense, x's dtype) = x before the norm; rstd f32 [B*T*Hx].
//   backward: x holds d(out) on entry, d(in) on return (in place), from saved and rstd;
//             dweight, dweight_k f32 [D] += the weight gradients.
// dtypes: x, saved and the weights f32 or bf16 (one of them for all), rstd and the weight
// gradients f32. Backends: TURBO (device; the backward borrows ctx.scratch), CPU (host f32, the
// reference kernels of turbo/kernels/cpu/normalization.h).
#pragma once
#include <string>

#include "turbo/core/tensor_view.h"
#include "turbo/dispatch/backend_type.h"
#include "turbo/ops/exec_context.h"

namespace primus::turbo {

// The largest head dimension the TURBO kernels serve (a warp holds a row in registers).
inline constexpr int64_t kHeadNormMaxDim = 256;

struct HeadNormArgs {
  bool backward = false;
  TensorView x, saved, rstd;
  TensorView weight, weight_k;     // [D]: the query heads', the key heads'
  TensorView dweight, dweight_k;   // f32 [D], backward only
  int64_t q_heads = 0;
  float eps = 1e-6f;
  ExecContext ctx;
  std::string key() const;
  Precision precision() const { return precision_of(x.dtype); }
};

BackendType head_norm(const HeadNormArgs& args);

// Scratch the TURBO backward borrows for `tokens` tokens of head dim D (0 in CPU-only builds).
size_t head_norm_scratch_bytes(int64_t tokens, int64_t D);

}  // namespace primus::turbo
