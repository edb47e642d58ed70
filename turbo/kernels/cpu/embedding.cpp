// Embedding gather and its deterministic scatter-add. The backward splits the work by channel
// blocks: each thread owns columns [c0, c1) of every dwte/dwpe row and visits tokens in order, so
// two tokens with the same id never race and the summation order never depends on the schedule.
#include "turbo/kernels/cpu/embedding.h"

#include "core/util/error.h"
#include "turbo/kernels/cpu/parallel.h"

namespace primus::turbo::cpu {
namespace {

int64_t position_of(const int32_t* positions, int64_t bt, int64_t T) {
  return positions ? positions[bt] : bt % T;
}

void check_ids(const int32_t* tokens, const int32_t* positions, int64_t N, int64_t T, int64_t V,
               int64_t max_pos, bool has_wpe, bool check_tokens) {
  for (int64_t i = 0; i < N; ++i) {
    PRIMUS_CHECK(!check_tokens || (tokens[i] >= 0 && tokens[i] < V),
                 "embedding: token {} at flat index {} is outside the vocabulary [0, {})",
                 tokens[i], i, V);
    if (has_wpe) {
      const int64_t pos = position_of(positions, i, T);
      PRIMUS_CHECK(pos >= 0 && pos < max_pos,
                   "embedding: position {} at flat index {} is outside the position table [0, {})",
                   pos, i, max_pos);
    }
  }
}

}  // namespace

template <typename Real>
void embedding_forward(Real* out, const int32_t* tokens, const int32_t* positions, const Real* wte,
                       const Real* wpe, int64_t B, int64_t T, int64_t C, int64_t V,
                       int64_t max_pos, int64_t vocab_begin) {
  const int64_t N = B * T;
  const bool parallel = vocab_begin >= 0;
  check_ids(tokens, positions, N, T, V, max_pos, wpe != nullptr, !parallel);
#pragma omp parallel for schedule(static)
  for (int64_t i = 0; i < N; ++i) {
    Real* o = out + i * C;
    const int64_t id = parallel ? tokens[i] - vocab_begin : tokens[i];
    if (id < 0 || id >= V) {  // vocabulary-parallel: another rank's row
      for (int64_t c = 0; c < C; ++c) o[c] = Real(0);
    } else {
      const Real* w = wte + id * C;
      for (int64_t c = 0; c < C; ++c) o[c] = w[c];
    }
    if (wpe) {
      const Real* p = wpe + position_of(positions, i, T) * C;
      for (int64_t c = 0; c < C; ++c) o[c] += p[c];
    }
  }
}

template <typename Real>
void embedding_backward(Real* dwte, Real* dwpe, const Real* dout, const int32_t* tokens,
                        const int32_t* positions, int64_t B, int64_t T, int64_t C, int64_t V,
                        int64_t max_pos, int64_t vocab_begin) {
  const int64_t N = B * T;
  const bool parallel = vocab_begin >= 0;
  check_ids(tokens, positions, N, T, V, max_pos, dwpe != nullptr, !parallel);
  detail::for_column_blocks(C, [&](int64_t c0, int64_t c1) {
    for (int64_t i = 0; i < N; ++i) {
      const Real* d = dout + i * C;
      const int64_t id = parallel ? tokens[i] - vocab_begin : tokens[i];
      if (id >= 0 && id < V) {
        Real* w = dwte + id * C;
        for (int64_t c = c0; c < c1; ++c) w[c] += d[c];
      }
      if (dwpe) {
        Real* p = dwpe + position_of(positions, i, T) * C;
        for (int64_t c = c0; c < c1; ++c) p[c] += d[c];
      }
    }
  });
}

#define PRIMUS_INSTANTIATE(Real)                                                                   \
  template void embedding_forward<Real>(Real*, const int32_t*, const int32_t*, const Real*,        \
                                        const Real*, int64_t, int64_t, int64_t, int64_t, int64_t,  \
                                        int64_t);                                                  \
  template void embedding_backward<Real>(Real*, Real*, const Real*, const int32_t*,                \
                                         const int32_t*, int64_t, int64_t, int64_t, int64_t,       \
                                         int64_t, int64_t);
PRIMUS_INSTANTIATE(float)
PRIMUS_INSTANTIATE(double)
#undef PRIMUS_INSTANTIATE

}  // namespace primus::turbo::cpu
