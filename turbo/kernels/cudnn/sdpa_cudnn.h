// Scaled dot-product attention through cuDNN 9's fused flash-attention engines (the CUDNN
// backend of turbo::attention). The forward and backward are each one operation graph of
// matmul / pointwise / reduction nodes in the pattern those engines recognise; the engine
// fuses the whole graph into one flash-attention kernel.
//
// Layout (row-major, on the current CUDA device):
//   q, out, dq, dout  [B,T,H,D]    k, v, dk, dv  [B,T,KVH,D]    lse  [B,H,T] f32 (natural log)
// out, dout and lse are dense; q, k, v, dq, dk, dv may have token rows further apart than heads*D
// (SdpaShape's *_row, e.g. column slices of one packed [B,T,(H+2*KVH)*D] projection).
// dtype bf16 or f16 (all of q/k/v/out/grads alike). H must be a multiple of KVH.
// Plans are built once per shape key (B,T,H,KVH,D,causal,dtype,device) and cached for the life
// of the process; the softmax scale is a by-value scalar, so it does not split the cache.
// Packed variable-length documents are not handled here (the op's TURBO backend serves them).
#pragma once
#include <cuda_runtime_api.h>

#include <cstddef>
#include <cstdint>
#include <string>

#include "turbo/core/dtype.h"

namespace primus::turbo::cudnn {

struct SdpaShape {
  int64_t B = 0, T = 0, H = 0, KVH = 0, D = 0;
  bool causal = true;
  DType dtype = DType::BF16;
  // Backward: dQ written by its matmul directly (no f32 accumulator that the engine's
  // thread blocks add into in a run-dependent order). cuDNN then runs its dP-workspace engine
  // (as cudnn-frontend does for set_deterministic_algorithm on Hopper): bit-identical results
  // run to run, with about B*H*T^2*2 bytes of workspace (T rounded up to 64) and more time.
  // Both directions: no engine search (set_sdpa_search), so every process runs the same engine.
  bool deterministic = false;
  // Elements between consecutive tokens of each tensor; 0: dense (heads * D).
  int64_t q_row = 0, k_row = 0, v_row = 0, dq_row = 0, dk_row = 0, dv_row = 0;
  std::string key() const;
};

// "" when cuDNN can run the shape (the plan is then built and cached), else why not. Never
// throws: a plan that fails to build is a "no" with cuDNN's message.
std::string sdpa_forward_unsupported(const SdpaShape& s) noexcept;
std::string sdpa_backward_unsupported(const SdpaShape& s) noexcept;

// Device scratch the call needs, in bytes (the caller allocates; 256-byte aligned).
size_t sdpa_forward_workspace(const SdpaShape& s);
size_t sdpa_backward_workspace(const SdpaShape& s);

// Overwrites out and lse.
void sdpa_forward(const SdpaShape& s, void* out, float* lse, const void* q, const void* k,
                  const void* v, float scale, void* workspace, cudaStream_t stream);
// Overwrites dq, dk, dv (dk/dv summed over each kv head's query heads).
void sdpa_backward(const SdpaShape& s, void* dq, void* dk, void* dv, const void* dout,
                   const void* q, const void* k, const void* v, const void* out, const float* lse,
                   float scale, void* workspace, cudaStream_t stream);

// cuDNN's version at run time, e.g. 91900 (for logs and benchmark records).
size_t cudnn_runtime_version();

// Engine search: with k > 1, a shape's first forward / backward outside stream capture times up
// to k of the engine configurations cuDNN's heuristics offer (PRIMUS_TURBO_CUDNN_SDPA_KNOBS=1
// adds knob variants of the first) on the call's own buffers and keeps the fastest whose outputs
// agree with the first's; the result is logged. The workspace queries then cover every
// candidate. Deterministic backward graphs are never searched (the same engine in every
// process). k = 0 (the default) defers to PRIMUS_TURBO_CUDNN_SDPA_SEARCH (unset: 1, no search).
// Takes effect for shapes whose plans are built afterwards.
void set_sdpa_search(int candidates);
int sdpa_search();  // what applies now

// The plans built for a shape: how many candidates, which one runs (its engine, as logged), and
// whether the search has run. candidates == 0: no plan built for the shape (yet, or it failed).
struct SdpaPlanInfo {
  int candidates = 0, chosen = 0;
  bool searched = false;
  std::string engine;
};
SdpaPlanInfo sdpa_plan_info(const SdpaShape& s, bool backward);

}  // namespace primus::turbo::cudnn
