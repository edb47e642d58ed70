// Internal to the TURBO attention kernels: the Hopper (wgmma) forward of attention_fwd_sm90.cu
// and how flash_attention_forward chooses between it and the mma.sync kernel.
#pragma once
#include <cuda_runtime_api.h>

#include "turbo/kernels/cuda/attention_flash.h"

namespace primus::turbo::cuda {

// True on a compute capability 9.0 device (what the sm_90a wgmma code runs on).
bool flash_forward_sm90_available();

// The wgmma forward; same contract as flash_attention_forward (head_dim 64 or 128, bf16/f16).
void flash_forward_sm90(const FlashAttnParams& prm, void* out, float* lse, const void* q, const void* k,
                        const void* v, cudaStream_t stream);

// Which forward flash_attention_forward runs: the wgmma kernel where available, unless
// PRIMUS_TURBO_ATTN_KERNEL=sm80 asks for the mma.sync kernel (benchmarks compare the two).
bool flash_forward_use_sm90();

}  // namespace primus::turbo::cuda
