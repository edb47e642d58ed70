// Scaled dot-product self-attention (flash attention), forward and backward.
//
//   out[b,t,h] = sum_j softmax_j(scale * q[b,t,h] · k[b,j,g]) v[b,j,g],   g = h / (H / KVH)
//
// Shapes (row-major, contiguous):
//   q, out, dq, dout  [B,T,H,D]      k, v, dk, dv  [B,T,KVH,D]      lse  [B,H,T] f32
// H must be a multiple of KVH: KVH = H is multi-head attention, 1 < KVH < H grouped-query
// attention, KVH = 1 multi-query attention. causal: query t sees keys <= t. softmax_scale
// unset means 1/sqrt(D). lse[b,h,t] = log sum_j exp(scale * q·k) (natural log) is what the
// forward saves for the backward (no [T,T] matrix is kept).
//
// Packed documents (varlen): cu_seqlens i32 [num_docs + 1] holds cumulative token offsets over
// the flattened B*T axis (0 first, B*T last, non-decreasing, no document crossing a batch row),
// on the same device as q. A token attends only to tokens of its own document (and, if causal,
// to earlier ones); positions restart at each document start.
//
// The backward overwrites dq, dk and dv (dk/dv sum the gradients of each kv head's query heads).
//
// dtypes: bf16 or f16 on CUDA (q, k, v, out and the gradients alike; lse f32); f32 on the host.
// Backends:
//   CUDNN  cuDNN 9 fused flash attention (graph API); no varlen. Needs ctx.scratch for its
//          workspace (the backward always; the forward when its plan asks for one).
//   TURBO  Turbo's own flash-attention kernels (turbo/kernels/cuda/attention_*); head_dim 64
//          or 128; varlen. The backward needs ctx.scratch (f32 dq accumulator and row sums).
//   CPU    the reference (turbo/kernels/cpu/attention.h), host f32 tensors.
// Default on the device: CUDNN, falling back to TURBO where cuDNN cannot serve a call (varlen,
// a sliding window, a head_dim its engines refuse). PRIMUS_TURBO_ATTENTION_BACKEND=TURBO|CUDNN|CPU|AUTOTUNE
// overrides (see turbo/dispatch/backend_manager.h).
#pragma once
#include <optional>
#include <string>

#include "turbo/core/tensor_view.h"
#include "turbo/dispatch/backend_type.h"
#include "turbo/ops/exec_context.h"

namespace primus::turbo {

struct AttentionOptions {
  bool causal = true;
  std::optional<float> softmax_scale;  // unset: 1/sqrt(D)
  TensorView cu_seqlens;               // i32 [num_docs + 1]; undefined: one sequence per row
  // Sliding window (causal only; Mistral's sliding_window): query t sees keys j with
  // t - window < j <= t, i.e. itself and the window - 1 keys before it, as transformers'
  // sliding_window_overlay (kv_idx > q_idx - sliding_window) and flash-attention's
  // window_size = (window - 1, 0). Combined with cu_seqlens the window also stops at the
  // document start. 0: no window (full causal attention); a window >= T changes nothing.
  // Served by TURBO and CPU (CUDNN declines).
  int64_t window = 0;
  // Backward: bit-identical results run to run and process to process. CUDNN serves it with its
  // dP-workspace engine (about B*H*T^2*2 bytes more scratch, slower); TURBO declines (its dQ is
  // accumulated with atomics); CPU is deterministic anyway.
  bool deterministic = false;
  float scale(int64_t D) const;
};

struct AttentionForwardArgs {
  TensorView out, lse;  // outputs (overwritten)
  TensorView q, k, v;
  AttentionOptions opt;
  ExecContext ctx;
  std::string key() const;
  Precision precision() const { return precision_of(q.dtype); }
};

struct AttentionBackwardArgs {
  TensorView dq, dk, dv;                   // outputs (overwritten)
  TensorView dout, q, k, v, out, lse;      // out and lse from the forward
  AttentionOptions opt;
  ExecContext ctx;
  std::string key() const;
  Precision precision() const { return precision_of(q.dtype); }
};

// Validate shapes (throwing primus::RuntimeError naming the argument), dispatch, and return
// the backend that ran.
BackendType attention_forward(const AttentionForwardArgs& args);
BackendType attention_backward(const AttentionBackwardArgs& args);

}  // namespace primus::turbo
