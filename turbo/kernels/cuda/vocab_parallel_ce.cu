// The vocabulary-parallel cross-entropy's halves (turbo/ops/loss.h): one block per row. The row
// is read twice in the stats (maximum, then the sum of exponentials, which an L2-resident row of
// one rank's slice of the vocabulary serves) and twice in the finish (when it writes the gradient).
// A NaN logit reaches the sum of exponentials and so the loss (the maximum's fmaxf would drop it).
#include <fmt/format.h>

#include "turbo/kernels/cuda/common.cuh"
#include "turbo/kernels/cuda/vocab_parallel_ce.h"

namespace primus::turbo::cuda {
namespace {

constexpr int kThreads = 256;

template <class T>
__global__ void __launch_bounds__(kThreads) stats_kernel(const T* logits, int64_t ld, int vocab, int vocab_begin,
                                                         const int32_t* targets, float* stats) {
  __shared__ float smem[32];
  const int64_t n = blockIdx.x;
  const T* row = logits + n * ld;
  float m = -INFINITY;
  for (int j = threadIdx.x; j < vocab; j += blockDim.x) m = fmaxf(m, to_f32(row[j]));
  m = block_max(m, smem);
  float s = 0.0f;
  for (int j = threadIdx.x; j < vocab; j += blockDim.x) s += __expf(to_f32(row[j]) - m);
  s = block_sum(s, smem);
  if (threadIdx.x == 0) {
    const int t = targets[n] - vocab_begin;
    stats[3 * n] = m;
    stats[3 * n + 1] = s;
    stats[3 * n + 2] = t >= 0 && t < vocab ? to_f32(row[t]) : 0.0f;
  }
}

template <class T>
__global__ void __launch_bounds__(kThreads) finish_kernel(T* logits, int64_t N, int64_t ld, int vocab, int vocab_begin,
                                                          int global_vocab, const int32_t* targets,
                                                          const float* all_stats, int tp, float* losses,
                                                          float dloss_in, const float* kept, int32_t ignore_index) {
  const int64_t n = blockIdx.x;
  const float dloss = kept ? dloss_in / fmaxf(*kept, 1.0f) : dloss_in;
  const int32_t target = targets[n];
  const bool ignored = target == ignore_index;
  // The whole row's log-sum-exp from the ranks' {max, sum} pairs, in rank order.
  float M = -INFINITY, z = 0.0f;
  for (int r = 0; r < tp; ++r) {
    const float* st = all_stats + (static_cast<int64_t>(r) * N + n) * 3;
    M = fmaxf(M, st[0]);
    z += st[2];
  }
  float S = 0.0f;
  for (int r = 0; r < tp; ++r) {
    const float* st = all_stats + (static_cast<int64_t>(r) * N + n) * 3;
    S += st[1] * __expf(st[0] - M);  // a rank without real columns has {-inf, 0}: adds 0
  }
  const float lse = M + __logf(S);
  if (threadIdx.x == 0) {
    float loss = ignored ? 0.0f : lse - z;
    if (!ignored && (target < 0 || target >= global_vocab)) loss = __int_as_float(0x7fc00000);
    losses[n] = loss;
  }
  if (dloss == 0.0f) return;
  T* row = logits + n * ld;
  const int t = ignored ? -1 : target - vocab_begin;
  for (int64_t j = threadIdx.x; j < ld; j += blockDim.x) {
    float g = 0.0f;
    if (!ignored && j < vocab) g = __expf(to_f32(row[j]) - lse) * dloss - (j == t ? dloss : 0.0f);
    row[j] = from_f32<T>(g);
  }
}

}  // namespace

void vocab_parallel_ce_stats(DType dtype, const void* logits, int64_t N, int64_t ld, int64_t vocab,
                             int64_t vocab_begin, const int32_t* targets, float* stats, cudaStream_t stream) {
  if (N == 0) return;
  PRIMUS_DISPATCH_FLOAT_BF16(dtype, "vocab_parallel_ce_stats", [&] {
    stats_kernel<scalar_t><<<static_cast<unsigned>(N), kThreads, 0, stream>>>(
        static_cast<const scalar_t*>(logits), ld, static_cast<int>(vocab), static_cast<int>(vocab_begin), targets,
        stats);
    CUDA_CHECK_LAST();
  });
}

void vocab_parallel_ce_finish(DType dtype, void* logits, int64_t N, int64_t ld, int64_t vocab, int64_t vocab_begin,
                              int64_t global_vocab, const int32_t* targets, const float* all_stats, int tp,
                              float* losses, float dloss, const float* kept, int32_t ignore_index,
                              cudaStream_t stream) {
  if (N == 0) return;
  PRIMUS_DISPATCH_FLOAT_BF16(dtype, "vocab_parallel_ce_finish", [&] {
    finish_kernel<scalar_t><<<static_cast<unsigned>(N), kThreads, 0, stream>>>(
        static_cast<scalar_t*>(logits), N, ld, static_cast<int>(vocab), static_cast<int>(vocab_begin),
        static_cast<int>(global_vocab), targets, all_stats, tp, losses, dloss, kept, ignore_index);
    CUDA_CHECK_LAST();
  });
}

}  // namespace primus::turbo::cuda
