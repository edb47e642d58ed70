// Embedding lookup (wte + wpe) forward, and a deterministic backward.
//
// The backward is a scatter-add of N gradient rows into V table rows. Atomics would make the
// summation order (and so the fp32 result) vary between runs; instead the row indices are
// stably sorted by token (CUB radix sort over only the bits a token id can have), and the first
// row of each run of equal tokens owns that token: its block sums the run in original order and
// adds the sum once. Blocks that do not start a run exit at once. The same path serves the
// position table, keyed by position.
#include <cub/cub.cuh>
#include <fmt/format.h>

#include "turbo/kernels/cuda/common.cuh"
#include "turbo/kernels/cuda/embedding.h"

namespace primus::turbo::cuda {
namespace {

template <class T>
__global__ void embedding_forward_kernel(T* out, const int32_t* tokens, const int32_t* positions,
                                         const T* wte, const T* wpe, int64_t N, int T_, int C,
                                         int V, int max_pos) {
  constexpr int W = Vec<T>::kSize;
  const int cvec = C / W;
  const int64_t total = N * cvec;
  for (int64_t i = blockIdx.x * static_cast<int64_t>(blockDim.x) + threadIdx.x; i < total;
       i += static_cast<int64_t>(gridDim.x) * blockDim.x) {
    const int64_t n = i / cvec;
    const int c = static_cast<int>(i % cvec) * W;
    const int tok = tokens[n];
    const int pos = positions ? positions[n] : static_cast<int>(n % T_);
    Vec<T> y;
    if (tok < 0 || tok >= V || (wpe && (pos < 0 || pos >= max_pos))) {
#pragma unroll
      for (int e = 0; e < W; ++e) y.set(e, __int_as_float(0x7fc00000));
    } else {
      y = load_vec(wte + static_cast<int64_t>(tok) * C + c);
      if (wpe) {
        const Vec<T> p = load_vec(wpe + static_cast<int64_t>(pos) * C + c);
#pragma unroll
        for (int e = 0; e < W; ++e) y.set(e, y.get(e) + p.get(e));
      }
    }
    store_vec(out + n * C + c, y);
  }
}

__global__ void iota_kernel(int32_t* idx, int32_t* keys_mod, int64_t N, int T_) {
  const int64_t i = blockIdx.x * static_cast<int64_t>(blockDim.x) + threadIdx.x;
  if (i >= N) return;
  idx[i] = static_cast<int32_t>(i);
  if (keys_mod) keys_mod[i] = static_cast<int32_t>(i % T_);
}

// Block b looks at sorted entry b; if it starts a run of equal keys it sums the run's rows.
template <class T>
__global__ void run_sum_kernel(float* dst, const T* dout, const int32_t* keys, const int32_t* rows,
                               int64_t N, int C, int num_keys) {
  constexpr int W = Vec<T>::kSize;
  const int64_t b = blockIdx.x;
  const int key = keys[b];
  if ((b > 0 && keys[b - 1] == key) || key < 0 || key >= num_keys) return;
  for (int c = threadIdx.x * W; c < C; c += blockDim.x * W) {
    float acc[W];
#pragma unroll
    for (int e = 0; e < W; ++e) acc[e] = 0.0f;
    for (int64_t j = b; j < N && keys[j] == key; ++j) {
      const Vec<T> g = load_vec(dout + static_cast<int64_t>(rows[j]) * C + c);
#pragma unroll
      for (int e = 0; e < W; ++e) acc[e] += g.get(e);
    }
    float* d = dst + static_cast<int64_t>(key) * C + c;
#pragma unroll
    for (int e = 0; e < W; ++e) d[e] += acc[e];
  }
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
                  int num_keys, char* scratch, cudaStream_t stream) {
  const size_t slot = align256(static_cast<size_t>(N) * sizeof(int32_t));
  int32_t* rows_in = reinterpret_cast<int32_t*>(scratch);
  int32_t* keys_out = reinterpret_cast<int32_t*>(scratch + slot);
  int32_t* rows_out = reinterpret_cast<int32_t*>(scratch + 2 * slot);
  int32_t* keys_mod = reinterpret_cast<int32_t*>(scratch + 3 * slot);
  void* temp = scratch + 4 * slot;
  size_t temp_bytes = cub_temp_bytes(N);
  iota_kernel<<<ceil_div(N, 256), 256, 0, stream>>>(rows_in, keys_in ? nullptr : keys_mod, N, mod_T);
  CUDA_CHECK_LAST();
  CUDA_CHECK(cub::DeviceRadixSort::SortPairs(temp, temp_bytes, keys_in ? keys_in : keys_mod, keys_out,
                                             rows_in, rows_out, static_cast<int>(N), 0,
                                             bits_for(num_keys), stream));
  const int threads = std::min(1024, ceil_div(ceil_div(C, Vec<T>::kSize), 32) * 32);
  run_sum_kernel<T><<<static_cast<unsigned>(N), threads, 0, stream>>>(dst, dout, keys_out, rows_out, N,
                                                                      C, num_keys);
  CUDA_CHECK_LAST();
}

}  // namespace

size_t embedding_backward_scratch_bytes(int64_t N) {
  return 4 * align256(static_cast<size_t>(N) * sizeof(int32_t)) + align256(cub_temp_bytes(N));
}

void embedding_forward(DType dtype, void* out, const int32_t* tokens, const int32_t* positions,
                       const void* wte, const void* wpe, int64_t B, int64_t T, int64_t C, int64_t V,
                       int64_t max_pos, cudaStream_t stream) {
  if (C % 8 != 0) throw RuntimeError(fmt::format("embedding_forward: C={} must be a multiple of 8", C));
  const int64_t N = B * T;
  if (N == 0) return;
  PRIMUS_DISPATCH_FLOAT_BF16(dtype, "embedding_forward", [&] {
    const int64_t items = N * (C / Vec<scalar_t>::kSize);
    const int grid = static_cast<int>(std::min<int64_t>(ceil_div(items, 256), static_cast<int64_t>(sm_count()) * 32));
    embedding_forward_kernel<scalar_t><<<grid, 256, 0, stream>>>(
        static_cast<scalar_t*>(out), tokens, positions, static_cast<const scalar_t*>(wte),
        static_cast<const scalar_t*>(wpe), N, static_cast<int>(T), static_cast<int>(C),
        static_cast<int>(V), static_cast<int>(max_pos));
    CUDA_CHECK_LAST();
  });
}

void embedding_backward(DType dtype, float* dwte, float* dwpe, const void* dout,
                        const int32_t* tokens, const int32_t* positions, int64_t B, int64_t T,
                        int64_t C, int64_t V, int64_t max_pos, void* scratch, cudaStream_t stream) {
  if (C % 8 != 0) throw RuntimeError(fmt::format("embedding_backward: C={} must be a multiple of 8", C));
  const int64_t N = B * T;
  if (N == 0) return;
  if (N > INT32_MAX) throw RuntimeError("embedding_backward: more than 2^31 tokens");
  PRIMUS_DISPATCH_FLOAT_BF16(dtype, "embedding_backward", [&] {
    const auto* g = static_cast<const scalar_t*>(dout);
    scatter_rows<scalar_t>(dwte, g, tokens, 1, N, static_cast<int>(C), static_cast<int>(V),
                           static_cast<char*>(scratch), stream);
    if (dwpe)
      scatter_rows<scalar_t>(dwpe, g, positions, static_cast<int>(T), N, static_cast<int>(C),
                             static_cast<int>(max_pos), static_cast<char*>(scratch), stream);
  });
}

}  // namespace primus::turbo::cuda
