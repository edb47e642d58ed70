// Internal helpers shared by the kernel sources (not part of the public API).
//
// Reductions that cross threads are done in a fixed order over fixed-size chunks, never with
// `omp reduction` (whose combine order libgomp does not fix): every kernel here gives bitwise the
// same result for any OMP_NUM_THREADS, which is what the determinism tests and the CUDA-vs-CPU
// comparisons rely on.
#pragma once
#include <omp.h>

#include <algorithm>
#include <cstdint>
#include <vector>

namespace primus::turbo::cpu::detail {

// Elements per chunk of a flat reduction: large enough to amortise a task, small enough to
// spread 1e5-element arrays over a few cores.
inline constexpr int64_t kReduceChunk = 1 << 14;

// Columns per block when a [rows, cols] reduction over rows is split by columns: each thread owns
// whole column blocks, walks all rows in order, and so never races nor depends on thread count.
inline constexpr int64_t kColumnBlock = 64;

// Sum of partial(begin, end) over [0, n) in chunks of kReduceChunk, combined in chunk order.
template <class Partial>
double chunked_sum(int64_t n, Partial&& partial) {
  const int64_t chunks = (n + kReduceChunk - 1) / kReduceChunk;
  std::vector<double> sums(static_cast<size_t>(std::max<int64_t>(chunks, 1)), 0.0);
#pragma omp parallel for schedule(static) if (chunks > 1)
  for (int64_t c = 0; c < chunks; ++c) {
    const int64_t begin = c * kReduceChunk;
    sums[c] = partial(begin, std::min(n, begin + kReduceChunk));
  }
  double total = 0.0;
  for (double s : sums) total += s;
  return total;
}

// Runs body(col_begin, col_end) over column blocks of [0, cols) in parallel.
template <class Body>
void for_column_blocks(int64_t cols, Body&& body) {
  const int64_t blocks = (cols + kColumnBlock - 1) / kColumnBlock;
#pragma omp parallel for schedule(static) if (blocks > 1)
  for (int64_t blk = 0; blk < blocks; ++blk) {
    const int64_t begin = blk * kColumnBlock;
    body(begin, std::min(cols, begin + kColumnBlock));
  }
}

// Runs body(begin, end) over items [0, n) split into one contiguous range per thread (for
// elementwise loops whose body is a vectorised, CPU-cloned range function). item_size is the
// number of elements per item (1 for a flat array, the row length for rows): work below a few
// thousand elements stays on the calling thread.
template <class Body>
void parallel_ranges(int64_t n, int64_t item_size, Body&& body) {
  constexpr int64_t kMinParallelElements = 1 << 13;
#pragma omp parallel if (n > 1 && n * item_size > kMinParallelElements)
  {
    const int64_t threads = omp_get_num_threads(), t = omp_get_thread_num();
    const int64_t per = (n + threads - 1) / threads;
    const int64_t begin = std::min(n, t * per);
    body(begin, std::min(n, begin + per));
  }
}

}  // namespace primus::turbo::cpu::detail
