// Turbo's flash-attention kernels (the TURBO backend of turbo::attention): FlashAttention-2
// style tiling on the tensor cores through mma.sync (m16n8k16, bf16/f16 in, f32 accumulate),
// which runs on sm_80 and sm_90 alike.
//
//   forward:  one block per (query tile, head, batch row); K/V tiles stream through shared
//             memory (cp.async, double-buffered) while an online softmax keeps running row
//             max and sum in registers; writes out and lse.
//   backward: delta = rowsum(dout * out) first; then one block per (key tile, kv head, batch
//             row) keeps its dK/dV in registers and walks the query tiles of every query head
//             of its group (so dK/dV need no atomics and are deterministic), adding dQ into an
//             f32 accumulator with atomics; a last pass casts dQ to the I/O type.
//
// Layout as turbo/ops/attention.h: q/out [B,T,H,D], k/v [B,T,KVH,D], lse [B,H,T] f32.
// Varlen: cu_seqlens (device i32 [num_docs+1], over the flattened B*T axis, documents inside
// batch rows) masks every score whose query and key lie in different documents. A sliding
// window narrows each query's keys to the last `window` positions.
#pragma once
#include <cuda_runtime_api.h>

#include <cstddef>
#include <cstdint>
#include <string>

#include "turbo/core/dtype.h"

namespace primus::turbo::cuda {

struct FlashAttnParams {
  int64_t B = 0, T = 0, H = 0, KVH = 0, D = 0;
  bool causal = true;
  // Sliding window (causal only): query t sees keys j with t - window < j <= t (within its
  // document); 0 means no window. Key tiles wholly outside the window are skipped.
  int64_t window = 0;
  float scale = 0.0f;                  // multiplies q·k
  DType dtype = DType::BF16;           // of q, k, v, out and the gradients
  const int32_t* cu_seqlens = nullptr; // device; nullptr: one sequence per batch row
  int64_t num_docs = 0;
  // Row strides (elements from one token to the next) of q, k, v and of the gradients dq, dk, dv;
  // 0: dense ([B,T,H,D] / [B,T,KVH,D]). Column slices of one packed [B, T, (H + 2 KVH) D] tensor
  // have (H + 2 KVH) D. Only where flash_attention_takes_row_strides says so; out, lse and dout
  // are always dense.
  int64_t q_row = 0, k_row = 0, v_row = 0, dq_row = 0, dk_row = 0, dv_row = 0;
  bool strided() const { return q_row || k_row || v_row || dq_row || dk_row || dv_row; }
};

// Whether the kernels the next forward (backward) call would run take FlashAttnParams' row
// strides: the warp-specialised Hopper kernels (TMA) do; the others need dense tensors. Pointers
// must still start 16-byte aligned and row strides be multiples of 8 elements.
bool flash_attention_takes_row_strides(bool backward);

// "" when the kernels serve (dtype, head_dim), else why not.
std::string flash_attention_unsupported_reason(DType dtype, int64_t head_dim);

// Overwrites out and lse.
void flash_attention_forward(const FlashAttnParams& p, void* out, float* lse, const void* q,
                             const void* k, const void* v, cudaStream_t stream);

// Device scratch of the backward in bytes: the f32 dq accumulator [B,T,H,D], then delta [B,H,T] or
// the Hopper warp-specialised kernel's (lse, delta) rows [B*H][2][T rounded up to 4].
size_t flash_attention_backward_scratch_bytes(const FlashAttnParams& p);

// Overwrites dq, dk, dv. `scratch` holds flash_attention_backward_scratch_bytes(p) bytes,
// 256-byte aligned.
void flash_attention_backward(const FlashAttnParams& p, void* dq, void* dk, void* dv,
                              const void* dout, const void* q, const void* k, const void* v,
                              const void* out, const float* lse, void* scratch,
                              cudaStream_t stream);

}  // namespace primus::turbo::cuda
