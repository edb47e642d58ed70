// Document tables of packed samples: one block per batch row scans the row's tokens in chunks of
// the block size, a block-wide max-scan (CUB) carrying the start of the current document from
// chunk to chunk. An end-of-document token at t makes t + 1 a document start.
#include <cub/block/block_scan.cuh>

#include "turbo/kernels/cuda/common.cuh"
#include "turbo/kernels/cuda/document_masks.h"

namespace primus::turbo::cuda {
namespace {

constexpr int kThreads = 256;

struct MaxOp {
  __device__ __forceinline__ int operator()(int a, int b) const { return a > b ? a : b; }
};

__global__ void __launch_bounds__(kThreads) document_tables_kernel(const int32_t* tokens, int T, int32_t eod,
                                                                   int32_t* positions, int32_t* cu, int64_t total) {
  using Scan = cub::BlockScan<int, kThreads>;
  __shared__ typename Scan::TempStorage tmp;
  __shared__ int carry_s;
  const int b = blockIdx.x;
  const int64_t row = static_cast<int64_t>(b) * T;
  int carry = 0;  // start of the document the previous chunk ended in
  for (int t0 = 0; t0 < T; t0 += kThreads) {
    const int t = t0 + static_cast<int>(threadIdx.x);
    // A start at t when the token before it ends a document.
    const int start_here = (t < T && t > 0 && tokens[row + t - 1] == eod) ? t : 0;
    int start = 0;
    Scan(tmp).InclusiveScan(start_here, start, MaxOp());
    start = max(start, carry);
    if (t < T) {
      if (positions) positions[row + t] = t - start;
      if (cu) cu[row + t] = static_cast<int32_t>(row + start);
    }
    if (threadIdx.x == kThreads - 1) carry_s = start;
    __syncthreads();
    carry = carry_s;
    __syncthreads();  // TempStorage and carry_s are reused by the next chunk
  }
  if (cu && b == gridDim.x - 1 && threadIdx.x == 0) cu[total] = static_cast<int32_t>(total);
}

}  // namespace

void build_document_tables(const int32_t* tokens, int64_t B, int64_t T, int32_t eod_id, int32_t* positions,
                           int32_t* cu_seqlens, cudaStream_t stream) {
  PRIMUS_CHECK(B > 0 && T > 0 && B * T < (int64_t{1} << 31), "build_document_tables: bad batch {}x{}", B, T);
  if (!positions && !cu_seqlens) return;
  document_tables_kernel<<<static_cast<unsigned>(B), kThreads, 0, stream>>>(tokens, static_cast<int>(T), eod_id,
                                                                            positions, cu_seqlens, B * T);
  CUDA_CHECK_LAST();
}

}  // namespace primus::turbo::cuda
