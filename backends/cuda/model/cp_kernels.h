// The small kernels of context-parallel attention (cp_attention.h): the merge of partial
// attention outputs by their log-sum-exp, and fp32 accumulation of bf16 rows. Device only (the
// host mode's twins are loops in cp_attention.cpp).
#pragma once
#include <cuda_runtime_api.h>

#include <cstdint>

namespace primus::backends::cuda::cp {

// One partial attention result (out bf16 [B*T, H*D] dense, lse f32 [B,H,T]) into the running one
// (acc_out f32 [B*T, H*D], acc_lse f32 [B,H,T]): first copies it; otherwise per (b,t,h)
// L = logaddexp(L, lse), acc = acc * exp(L_old - L) + out * exp(lse - L).
void merge_partial(float* acc_out, float* acc_lse, const void* out, const float* lse, int64_t B, int64_t T, int64_t H,
                   int64_t D, bool first, cudaStream_t stream);
// dst f32 [rows, cols] (ld_dst apart) += src bf16 [rows, cols] (ld_src apart).
void rows_accumulate(float* dst, int64_t ld_dst, const void* src, int64_t ld_src, int64_t rows, int64_t cols,
                     cudaStream_t stream);
// dst bf16 [rows, cols] (ld_dst apart) = src f32 [rows, cols] (ld_src apart), rounded to nearest even.
void rows_cast(void* dst, int64_t ld_dst, const float* src, int64_t ld_src, int64_t rows, int64_t cols,
               cudaStream_t stream);

}  // namespace primus::backends::cuda::cp
