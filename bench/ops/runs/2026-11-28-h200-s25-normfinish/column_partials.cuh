// (Session 25, not kept; goes with fused_finish.diff as turbo/kernels/cuda/column_partials.cuh.)
// The deterministic second stage of the column sums (elementwise.h, add_column_partials) as a
// device function, so that a kernel which wrote the partials can also add them up after a grid
// barrier (the staged norm backward's fused finish) with the same bits as the separate launch.
#pragma once
#include "turbo/kernels/cuda/common.cuh"

namespace primus::turbo::cuda {

constexpr int kPartCols = 8, kPartLanes = 32, kPartBatch = 8;
constexpr int kPartThreads = kPartCols * kPartLanes;  // 256 threads per column group
using PartialTree = float[kPartLanes][kPartCols + 1];

// dst[c] += sum over g < G of part[g * C + c] for the columns c0 .. c0 + kPartCols - 1 (< C), by
// the 256 threads t = 0..255 of a group: thread (lane g0 = t / 8, column t % 8) sums partial rows
// g0, g0 + 32, ... in order, loading kPartBatch rows before adding any, and the 32 subtotals of a
// column are added as a fixed pairwise tree in `tree`. The same bits on every run.
// Every thread of the block calls it (it synchronises the block); threads with `work` false
// (no group this round, or beyond the block's groups) only take part in the barriers.
__device__ __forceinline__ void column_group_sum(float* dst, const float* part, int G, int C, int c0, int t,
                                                 bool work, PartialTree& tree) {
  const int col = t % kPartCols, g0 = t / kPartCols;
  const int c = c0 + col;
  const bool ok = work && c < C;
  const float d0 = ok && g0 == 0 ? dst[c] : 0.0f;
  float v = 0.0f;
  if (ok) {
    for (int base = g0; base < G; base += kPartBatch * kPartLanes) {
      float x[kPartBatch];
#pragma unroll
      for (int k = 0; k < kPartBatch; ++k) {
        const int g = base + k * kPartLanes;
        x[k] = g < G ? part[static_cast<int64_t>(g) * C + c] : 0.0f;
      }
#pragma unroll
      for (int k = 0; k < kPartBatch; ++k) v += x[k];
    }
  }
  if (work) tree[g0][col] = v;
  __syncthreads();
#pragma unroll
  for (int s = kPartLanes / 2; s >= 1; s /= 2) {
    if (work && g0 < s) tree[g0][col] += tree[g0 + s][col];
    __syncthreads();
  }
  if (ok && g0 == 0) dst[c] = d0 + tree[0][col];
}

struct PartialPairs {
  float* dst[3];
  const float* part[3];
};

}  // namespace primus::turbo::cuda
