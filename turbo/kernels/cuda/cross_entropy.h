// Launchers of the fused softmax cross-entropy over the vocabulary (cross_entropy.cu), matching
// turbo/kernels/cpu/loss.h. logits [N, Vp] rows (Vp >= V: the padded row stride, columns >= V
// are ignored), dtype f32 or bf16, Vp a multiple of 8; targets int32 [N]; losses/lse f32 [N].
#pragma once
#include <cuda_runtime_api.h>

#include <cstdint>

#include "turbo/core/dtype.h"

namespace primus::turbo::cuda {

enum class CrossEntropyKernel {
  Auto,    // the on-chip kernel where it applies (sm_90, bf16, row <= ~900 KB), else the legacy one;
           // rows that need a cluster of CTAs (Llama-3's 128k columns) run its streamed form
           // (persistent clusters, two row buffers per CTA: the next row loads while this one is
           // computed); env PRIMUS_TURBO_CE_KERNEL=legacy | onchip makes Auto mean Legacy |
           // OneRowPerCluster (A/B in one binary); env PRIMUS_TURBO_CE_CLUSTER=2|4|8: at least
           // that many CTAs per row (smaller slices; for measuring against the default)
  Legacy,  // the two-read kernel (each row read twice: the second read hoped to hit L2)
  OneRowPerCluster,  // the on-chip kernel with one cluster per row also where Auto streams
};

// losses[n] = lse[n] - logits[n, target[n]] (0 for target == ignore_index; NaN for a target
// outside [0, V)); lse[n] = log sum_v exp(logits[n, v]) (lse may be nullptr).
// When dlogits is not nullptr it is OVERWRITTEN with dloss * (softmax - onehot) for v < V, 0 for
// the padding columns and for ignored rows; dlogits may be logits itself (in place: the fp32
// probabilities never exist in memory). With kept (device f32 [1], e.g. count_kept's) the scale is
// dloss / max(kept[0], 1): a mean over the rows that keep a loss, counted on the device.
void cross_entropy_forward_backward(DType dtype, void* dlogits, float* losses, float* lse,
                                    const void* logits, const int32_t* targets, int64_t N,
                                    int64_t V, int64_t Vp, float dloss, const float* kept, int32_t ignore_index,
                                    cudaStream_t stream, CrossEntropyKernel kernel = CrossEntropyKernel::Auto);

// The cluster size (CTAs per row: 1, 2, 4 or 8) with which Auto would run the on-chip kernel on
// the current device for bf16 rows of Vp columns, or 0 when it would run the legacy kernel
// (dtype, device below sm_90, row too large). Ignores the environment (PRIMUS_TURBO_CE_*).
int cross_entropy_onchip_cluster(DType dtype, int64_t Vp);

// out[0] = sum of x[0..n) in a fixed order (one block): the loss sum from per-row losses; with kept
// (device f32 [1]) times numerator / max(kept[0], 1).
void sum_f32(float* out, const float* x, int64_t n, const float* kept, float numerator, cudaStream_t stream);

// out[0] = the number of targets[0..n) other than ignore_index, as a float (one block).
void count_kept(float* out, const int32_t* targets, int64_t n, int32_t ignore_index, cudaStream_t stream);

}  // namespace primus::turbo::cuda
