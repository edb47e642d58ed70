// Embedding lookup (wte + wpe) forward, and a deterministic backward.
//
// The backward is a scatter-add of N gradient rows into V table rows. Atomics would make the
// summation order (and so the fp32 result) vary between runs; instead the row indices are
// stably sorted by token (CUB radix sort over only the bits a token id can have), and the first
// row of each run of equal tokens owns that token: its block sums the run in original order and
// adds the sum once. Blocks that do not start a run exit at once. The same path serves the
// position table, keyed by position.
#include <algorithm>

#include <cub/cub.cuh>
#include <fmt/format.h>

#include "turbo/kernels/cuda/common.cuh"
#include "turbo/kernels/cuda/embedding.h"

namespace primus::turbo::cuda {
namespace {

template <class T>
__global__ void embedding_forward_kernel(T* out, const int32_t* tokens, const int32_t* positions,
                                         const T* wte, const T* wpe, int64_t N, int T_, int C,
                                         int V, int max_pos, int vocab_begin) {
  constexpr int W = Vec<T>::kSize;
  const int cvec = C / W;
  const int64_t total = N * cvec;
  for (int64_t i = blockIdx.x * static_cast<int64_t>(blockDim.x) + threadIdx.x; i < total;
       i += static_cast<int64_t>(gridDim.x) * blockDim.x) {
    const int64_t n = i / cvec;
    const int c = static_cast<int>(i % cvec) * W;
    const int tok = vocab_begin >= 0 ? tokens[n] - vocab_begin : tokens[n];
    const int pos = positions ? positions[n] : static_cast<int>(n % T_);
    const bool other_rank = vocab_begin >= 0 && (tok < 0 || tok >= V);  // vocabulary-parallel: a zero row
    Vec<T> y;
    if ((!other_rank && (tok < 0 || tok >= V)) || (wpe && (pos < 0 || pos >= max_pos))) {
#pragma unroll
      for (int e = 0; e < W; ++e) y.set(e, __int_as_float(0x7fc00000));
    } else {
      if (other_rank) {
#pragma unroll
        for (int e = 0; e < W; ++e) y.set(e, 0.0f);
      } else {
        y = load_vec(wte + static_cast<int64_t>(tok) * C + c);
      }
      if (wpe) {
        const Vec<T> p = load_vec(wpe + static_cast<int64_t>(pos) * C + c);
#pragma unroll
        for (int e = 0; e < W; ++e) y.set(e, y.get(e) + p.get(e));
      }
    }
    store_vec(out + n * C + c, y);
  }
}

// Vocabulary-parallel sort keys: the table row of each token, or V (no row here; the run sums
// skip keys >= V).
__global__ void local_keys_kernel(int32_t* keys, const int32_t* tokens, int64_t N, int V, int vocab_begin) {
  const int64_t i = blockIdx.x * static_cast<int64_t>(blockDim.x) + threadIdx.x;
  if (i >= N) return;
  const int id = tokens[i] - vocab_begin;
  keys[i] = id >= 0 && id < V ? id : V;
}

__global__ void iota_kernel(int32_t* idx, int32_t* keys_mod, int64_t N, int T_) {
  const int64_t i = blockIdx.x * static_cast<int64_t>(blockDim.x) + threadIdx.x;
  if (i >= N) return;
  idx[i] = static_cast<int32_t>(i);
  if (keys_mod) keys_mod[i] = static_cast<int32_t>(i % T_);
}

// The run sums. A run of equal keys can be long (a frequent token: a newline is ~10% of
// tinyshakespeare's GPT-2 tokens, ~1,600 rows of a 16k-token batch), so runs are split by length:
//   run_sum_short_kernel  block b looks at sorted entry b; if it starts a run of fewer than
//                         kLongRun rows it sums them, kShortUnroll row loads in flight per thread;
//   run_sum_long_kernel   block w looks at the window [w, w + 1) * kLongRun of sorted entries, in
//                         which at most one run of kLongRun or more rows can start; that run's rows
//                         are split over the block's `groups` thread groups (kRunUnroll loads in
//                         flight per thread; group g takes rows
//                         b + g, b + g + groups, ...) and added in group order.
// Each run's sum has a fixed order: the same bits on every run, whatever the runs' lengths.
// (Short runs are mostly one to three rows: fewer loads in flight keep the registers, and so the
// resident blocks of that many-block grid, in check.)
constexpr int kRunUnroll = 8, kShortUnroll = 4, kLongRun = 64;

// First index after b whose key differs from keys[b] == key (or N): an exponential then binary
// search of the sorted keys, one load for a run of one. Every thread of a block may call it (the
// same addresses, the same answer).
__device__ __forceinline__ int64_t run_end(const int32_t* keys, int64_t N, int64_t b, int key) {
  int64_t lo = b, step = 1;  // keys[lo] == key; the run ends in (lo, lo + step]
  while (lo + step < N && keys[lo + step] == key) {
    lo += step;
    step *= 2;
  }
  int64_t hi = lo + step < N ? lo + step : N;  // keys[hi] != key, or hi == N
  while (hi - lo > 1) {
    const int64_t mid = lo + (hi - lo) / 2;
    if (keys[mid] == key) lo = mid;
    else hi = mid;
  }
  return hi;
}

// acc += the rows of [j_begin, end) taken `every` apart, kUnroll loads in flight.
template <class T, int W, int kUnroll>
__device__ __forceinline__ void sum_rows(float (&acc)[W], const T* dout, const int32_t* rows, int64_t j_begin,
                                         int64_t end, int every, int C, int c) {
  const int64_t stride = static_cast<int64_t>(every) * kUnroll;
  for (int64_t j0 = j_begin; j0 < end; j0 += stride) {
    Vec<T> v[kUnroll];
#pragma unroll
    for (int u = 0; u < kUnroll; ++u) {
      const int64_t j = j0 + static_cast<int64_t>(u) * every;
      if (j < end) v[u] = load_vec(dout + static_cast<int64_t>(rows[j]) * C + c);
    }
#pragma unroll
    for (int u = 0; u < kUnroll; ++u) {
      if (j0 + static_cast<int64_t>(u) * every < end) {
#pragma unroll
        for (int e = 0; e < W; ++e) acc[e] += v[u].get(e);
      }
    }
  }
}

template <class T>
__global__ void run_sum_short_kernel(float* dst, const T* dout, const int32_t* keys, const int32_t* rows,
                                     int64_t N, int C, int num_keys) {
  constexpr int W = Vec<T>::kSize;
  const int64_t b = blockIdx.x;
  const int key = keys[b];
  if ((b > 0 && keys[b - 1] == key) || key < 0 || key >= num_keys) return;
  if (b + kLongRun - 1 < N && keys[b + kLongRun - 1] == key) return;  // a long run: the other kernel's
  const int64_t end = run_end(keys, N, b, key);
  for (int c = threadIdx.x * W; c < C; c += blockDim.x * W) {
    float acc[W];
#pragma unroll
    for (int e = 0; e < W; ++e) acc[e] = 0.0f;
    sum_rows<T, W, kShortUnroll>(acc, dout, rows, b, end, 1, C, c);
    float* d = dst + static_cast<int64_t>(key) * C + c;
#pragma unroll
    for (int e = 0; e < W; ++e) d[e] += acc[e];
  }
}

template <class T>
__global__ void __launch_bounds__(512) run_sum_long_kernel(float* dst, const T* dout, const int32_t* keys,
                                                            const int32_t* rows, int64_t N, int C, int num_keys,
                                                            int group_threads, int groups) {
  constexpr int W = Vec<T>::kSize;
  extern __shared__ float run_smem[];  // [groups - 1][C]
  __shared__ int64_t s_start;
  if (threadIdx.x == 0) s_start = -1;
  __syncthreads();
  for (int i = threadIdx.x; i < kLongRun; i += blockDim.x) {
    const int64_t p = static_cast<int64_t>(blockIdx.x) * kLongRun + i;
    if (p + kLongRun - 1 >= N) continue;
    const int k = keys[p];
    if ((p == 0 || keys[p - 1] != k) && k >= 0 && k < num_keys && keys[p + kLongRun - 1] == k) s_start = p;  // one at most
  }
  __syncthreads();
  const int64_t b = s_start;
  if (b < 0) return;  // uniform over the block
  const int key = keys[b];
  const int64_t end = run_end(keys, N, b, key);
  const int g = static_cast<int>(threadIdx.x) / group_threads, t = static_cast<int>(threadIdx.x) % group_threads;
  // Every thread runs the column loop the same number of times (the __syncthreads below).
  for (int c0 = 0; c0 < C; c0 += group_threads * W) {
    const int c = c0 + t * W;
    const bool active = c < C;
    float acc[W];
#pragma unroll
    for (int e = 0; e < W; ++e) acc[e] = 0.0f;
    if (active) sum_rows<T, W, kRunUnroll>(acc, dout, rows, b + g, end, groups, C, c);
    if (g > 0 && active) {
#pragma unroll
      for (int e = 0; e < W; ++e) run_smem[(g - 1) * C + c + e] = acc[e];
    }
    __syncthreads();
    if (g == 0 && active) {
      for (int h = 1; h < groups; ++h)
#pragma unroll
        for (int e = 0; e < W; ++e) acc[e] += run_smem[(h - 1) * C + c + e];
      float* d = dst + static_cast<int64_t>(key) * C + c;
#pragma unroll
      for (int e = 0; e < W; ++e) d[e] += acc[e];
    }
    __syncthreads();  // before the next columns reuse run_smem
  }
}

// Thread groups of run_sum_long_kernel: each covers the row's vectors (a multiple of 32 threads, at
// most 512, looping over wider rows); up to 4 per block of at most 512 threads (128 registers per
// thread: at 64 the unrolled loads spill) while their partial sums fit 48 KiB of shared memory.
struct RunShape {
  int group_threads, groups;
  size_t smem;
};
template <class T>
RunShape run_shape(int C) {
  const int nvec = ceil_div(C, Vec<T>::kSize);
  const int gt = std::min(512, ceil_div(nvec, 32) * 32);
  const int groups = std::max(1, std::min({4, 512 / gt, 1 + (48 * 1024) / (C * 4)}));
  return {gt, groups, static_cast<size_t>(groups - 1) * C * sizeof(float)};
}

// The position table's gradient when positions are implicit (row n of the batch is position
// n % T): dwpe[t] += the sum over b of dout[b * T + t], in b order, which is the order the sorted
// path adds them in (its sort is stable), so the same bits without the sort. One thread per
// vector of a position's row, four rows in flight.
template <class T>
__global__ void position_sum_kernel(float* dwpe, const T* dout, int B, int64_t Tn, int C) {
  constexpr int W = Vec<T>::kSize;
  const int64_t t = blockIdx.x;
  const int c = (blockIdx.y * blockDim.x + threadIdx.x) * W;
  if (c >= C) return;
  float acc[W];
#pragma unroll
  for (int e = 0; e < W; ++e) acc[e] = 0.0f;
  int b = 0;
  for (; b + 4 <= B; b += 4) {
    Vec<T> v[4];
#pragma unroll
    for (int u = 0; u < 4; ++u) v[u] = load_vec(dout + ((b + u) * Tn + t) * C + c);
#pragma unroll
    for (int u = 0; u < 4; ++u)
#pragma unroll
      for (int e = 0; e < W; ++e) acc[e] += v[u].get(e);
  }
  for (; b < B; ++b) {
    const Vec<T> v = load_vec(dout + (b * Tn + t) * C + c);
#pragma unroll
    for (int e = 0; e < W; ++e) acc[e] += v.get(e);
  }
  float* d = dwpe + t * C + c;
#pragma unroll
  for (int e = 0; e < W; ++e) d[e] += acc[e];
}

int bits_for(int64_t n) {
  int b = 1;
  while ((int64_t{1} << b) < n) ++b;
  return b;
}

size_t cub_temp_bytes(int64_t N) {
  size_t bytes = 0;
  CUDA_CHECK(cub::DeviceRadixSort::SortPairs(nullptr, bytes, static_cast<const int32_t*>(nullptr),
                                             static_cast<int32_t*>(nullptr),
                                             static_cast<const int32_t*>(nullptr),
                                             static_cast<int32_t*>(nullptr), static_cast<int>(N)));
  return bytes;
}

size_t align256(size_t b) { return (b + 255) & ~size_t{255}; }

// Sorted (key, row) of N entries into scratch, then the run sums into dst. Without keys_in the
// key of row n is n % mod_T (positions of full rows).
template <class T>
void scatter_rows(float* dst, const T* dout, const int32_t* keys_in, int mod_T, int64_t N, int C,
                  int num_keys, char* scratch, cudaStream_t stream, int key_bound = 0) {
  const size_t slot = align256(static_cast<size_t>(N) * sizeof(int32_t));
  int32_t* rows_in = reinterpret_cast<int32_t*>(scratch);
  int32_t* keys_out = reinterpret_cast<int32_t*>(scratch + slot);
  int32_t* rows_out = reinterpret_cast<int32_t*>(scratch + 2 * slot);
  int32_t* keys_mod = reinterpret_cast<int32_t*>(scratch + 3 * slot);
  void* temp = scratch + 5 * slot;  // slot 4: the vocabulary-parallel keys (embedding_backward)
  size_t temp_bytes = cub_temp_bytes(N);
  iota_kernel<<<ceil_div(N, 256), 256, 0, stream>>>(rows_in, keys_in ? nullptr : keys_mod, N, mod_T);
  CUDA_CHECK_LAST();
  CUDA_CHECK(cub::DeviceRadixSort::SortPairs(temp, temp_bytes, keys_in ? keys_in : keys_mod, keys_out,
                                             rows_in, rows_out, static_cast<int>(N), 0,
                                             bits_for(key_bound > 0 ? key_bound : num_keys), stream));
  const RunShape rs = run_shape<T>(C);
  run_sum_short_kernel<T><<<static_cast<unsigned>(N), rs.group_threads, 0, stream>>>(dst, dout, keys_out, rows_out, N,
                                                                                   C, num_keys);
  CUDA_CHECK_LAST();
  if (N >= kLongRun)
    run_sum_long_kernel<T><<<static_cast<unsigned>(ceil_div(N, int64_t{kLongRun})), rs.group_threads * rs.groups,
                             rs.smem, stream>>>(dst, dout, keys_out, rows_out, N, C, num_keys, rs.group_threads,
                                                rs.groups);
  CUDA_CHECK_LAST();
}

}  // namespace

size_t embedding_backward_scratch_bytes(int64_t N) {
  // sort slots (rows in, keys out, rows out, keys mod T), the vocabulary-parallel keys, CUB's temp
  return 5 * align256(static_cast<size_t>(N) * sizeof(int32_t)) + align256(cub_temp_bytes(N));
}

void embedding_forward(DType dtype, void* out, const int32_t* tokens, const int32_t* positions,
                       const void* wte, const void* wpe, int64_t B, int64_t T, int64_t C, int64_t V,
                       int64_t max_pos, cudaStream_t stream, int64_t vocab_begin) {
  if (C % 8 != 0) throw RuntimeError(fmt::format("embedding_forward: C={} must be a multiple of 8", C));
  const int64_t N = B * T;
  if (N == 0) return;
  PRIMUS_DISPATCH_FLOAT_BF16(dtype, "embedding_forward", [&] {
    const int64_t items = N * (C / Vec<scalar_t>::kSize);
    const int grid = static_cast<int>(std::min<int64_t>(ceil_div(items, 256), static_cast<int64_t>(sm_count()) * 32));
    embedding_forward_kernel<scalar_t><<<grid, 256, 0, stream>>>(
        static_cast<scalar_t*>(out), tokens, positions, static_cast<const scalar_t*>(wte),
        static_cast<const scalar_t*>(wpe), N, static_cast<int>(T), static_cast<int>(C),
        static_cast<int>(V), static_cast<int>(max_pos), static_cast<int>(vocab_begin));
    CUDA_CHECK_LAST();
  });
}

void embedding_backward(DType dtype, float* dwte, float* dwpe, const void* dout,
                        const int32_t* tokens, const int32_t* positions, int64_t B, int64_t T,
                        int64_t C, int64_t V, int64_t max_pos, void* scratch, cudaStream_t stream,
                        int64_t vocab_begin) {
  if (C % 8 != 0) throw RuntimeError(fmt::format("embedding_backward: C={} must be a multiple of 8", C));
  const int64_t N = B * T;
  if (N == 0) return;
  if (N > INT32_MAX) throw RuntimeError("embedding_backward: more than 2^31 tokens");
  PRIMUS_DISPATCH_FLOAT_BF16(dtype, "embedding_backward", [&] {
    const auto* g = static_cast<const scalar_t*>(dout);
    if (vocab_begin >= 0) {  // sort by table row; tokens of other ranks' rows key V and are skipped
      auto* keys = reinterpret_cast<int32_t*>(static_cast<char*>(scratch) +
                                              4 * align256(static_cast<size_t>(N) * sizeof(int32_t)));
      local_keys_kernel<<<ceil_div(N, 256), 256, 0, stream>>>(keys, tokens, N, static_cast<int>(V),
                                                               static_cast<int>(vocab_begin));
      CUDA_CHECK_LAST();
      scatter_rows<scalar_t>(dwte, g, keys, 1, N, static_cast<int>(C), static_cast<int>(V),
                             static_cast<char*>(scratch), stream, static_cast<int>(V) + 1);
    } else {
      scatter_rows<scalar_t>(dwte, g, tokens, 1, N, static_cast<int>(C), static_cast<int>(V),
                             static_cast<char*>(scratch), stream);
    }
    if (dwpe && !positions && T <= max_pos) {  // implicit positions: no sort needed
      const int vecs = static_cast<int>(C / Vec<scalar_t>::kSize), threads = std::min(256, ceil_div(vecs, 32) * 32);
      position_sum_kernel<scalar_t><<<dim3(static_cast<unsigned>(T), static_cast<unsigned>(ceil_div(vecs, threads))),
                                      threads, 0, stream>>>(dwpe, g, static_cast<int>(B), T, static_cast<int>(C));
      CUDA_CHECK_LAST();
    } else if (dwpe) {
      scatter_rows<scalar_t>(dwpe, g, positions, static_cast<int>(T), N, static_cast<int>(C),
                             static_cast<int>(max_pos), static_cast<char*>(scratch), stream);
    }
  });
}

}  // namespace primus::turbo::cuda
