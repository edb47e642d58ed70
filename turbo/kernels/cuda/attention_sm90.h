// Internal to the TURBO attention kernels: the Hopper (wgmma) kernels of attention_fwd_sm90.cu and
// attention_bwd_sm90.cu, and how the launchers choose between them and the mma.sync kernels.
#pragma once
#include <cuda_runtime_api.h>

#include "turbo/kernels/cuda/attention_flash.h"

namespace primus::turbo::cuda {

// True on a compute capability 9.0 device (what the sm_90a wgmma code runs on).
bool flash_forward_sm90_available();

// Which forward flash_attention_forward runs:
//   Sm80      the mma.sync kernel (attention_fwd.cu)
//   Sm90      wgmma, cp.async loads, each tile's GEMMs and softmax one after the other
//   Sm90Pipe  wgmma, cp.async loads, softmax of tile j overlapping the P V product of tile j-1
//   Sm90Ws    Sm90Pipe's loop on two consumer warpgroups fed by a TMA producer warp
// Default: Sm90Ws where the device is sm_90 (Sm90Pipe where TMA cannot be set up), else Sm80.
// PRIMUS_TURBO_ATTN_KERNEL=sm80 | sm90 | sm90pipe | sm90ws asks for one (sm90* fall back to sm80
// on other devices); tests and benchmarks use it to cover and compare all of them.
enum class FwdKernel { Sm80, Sm90, Sm90Pipe, Sm90Ws };
FwdKernel flash_forward_kernel();

// The wgmma forwards; same contract as flash_attention_forward (head_dim 64 or 128, bf16/f16).
void flash_forward_sm90(const FlashAttnParams& prm, void* out, float* lse, const void* q, const void* k,
                        const void* v, FwdKernel kind, cudaStream_t stream);

// The backward's main kernel (between the delta pass and the dQ cast of attention_bwd.cu).
struct FlashBwdPointers {
  const void *q, *k, *v, *dout;
  const float *lse, *delta;
  float* dq_acc;  // [B,T,H,D] f32, zeroed
  void *dk, *dv;
  // Set for the warp-specialised kernel only: [B*H][2][ld_stride] f32, per (b, h) the rows' lse
  // times log2(e), then their delta (delta is then not needed).
  const float* ld = nullptr;
  int64_t ld_stride = 0;
};
// The wgmma backward: the warp-specialised kernel when ptrs.ld is set, else the one whose threads
// all load and compute.
void flash_backward_sm90_main(const FlashAttnParams& prm, const FlashBwdPointers& ptrs, cudaStream_t stream);
// Whether the warp-specialised kernel can take these pointers (TMA: 16-byte aligned q, k, v, dout;
// the driver's encoder; dQ by TMA reduce-adds, i.e. not PRIMUS_TURBO_ATTN_BWD_DQ=atomic).
bool flash_backward_sm90_ws_usable(const FlashBwdPointers& ptrs);

// Which backward main kernel runs:
//   Sm80     the mma.sync kernel (attention_bwd.cu)
//   Sm90     wgmma, every thread loads (cp.async) and computes, two block barriers per query tile
//   Sm90Ws   wgmma, a TMA producer warp and two consumer warpgroups (FlashAttention-3 style)
// Default: Sm90Ws where the device is sm_90 (Sm90 where flash_backward_sm90_ws_usable is false),
// else Sm80; PRIMUS_TURBO_ATTN_BWD_KERNEL=sm80 | sm90 | sm90ws asks for one.
enum class BwdKernel { Sm80, Sm90, Sm90Ws };
BwdKernel flash_backward_kernel();

}  // namespace primus::turbo::cuda
