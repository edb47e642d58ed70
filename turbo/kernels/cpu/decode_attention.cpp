#include "turbo/kernels/cpu/decode_attention.h"

#include <fmt/format.h>

#include <algorithm>
#include <cmath>
#include <vector>

#include "core/util/error.h"

namespace primus::turbo::cpu {
namespace {
void check_row(const int32_t* slot, const int32_t* len, int64_t i, const DecodeAttentionParams& p, const char* op) {
  if (slot[i] < 0 || slot[i] >= p.slots || len[i] < 1 || len[i] > p.cap)
    throw RuntimeError(fmt::format("{}: query {} has slot {} (of {}) and length {} (cache of {} positions)", op, i,
                                   slot[i], p.slots, len[i], p.cap));
}
}  // namespace

template <typename Real>
void decode_attention_forward(Real* out, const Real* q, const Real* k_cache, const Real* v_cache,
                              const int32_t* slot, const int32_t* len, const DecodeAttentionParams& p) {
  const int64_t H = p.H, KVH = p.KVH, D = p.D, qrow = p.q_row > 0 ? p.q_row : H * D;
  if (H % KVH != 0) throw RuntimeError(fmt::format("decode_attention: {} heads are not a multiple of {} kv heads", H, KVH));
  const double scale = p.scale > 0 ? p.scale : 1.0 / std::sqrt(static_cast<double>(D));
  std::vector<double> s, acc(static_cast<size_t>(D));
  for (int64_t i = 0; i < p.n; ++i) {
    check_row(slot, len, i, p, "decode_attention");
    const int64_t L = len[i], j0 = p.window > 0 ? std::max<int64_t>(0, L - p.window) : 0;
    const Real* kb = k_cache + slot[i] * p.cap * KVH * D;
    const Real* vb = v_cache + slot[i] * p.cap * KVH * D;
    s.resize(static_cast<size_t>(L - j0));
    for (int64_t h = 0; h < H; ++h) {
      const int64_t g = h / (H / KVH);
      const Real* qh = q + i * qrow + h * D;
      double mx = -INFINITY;
      for (int64_t j = j0; j < L; ++j) {
        const Real* kj = kb + (j * KVH + g) * D;
        double dot = 0;
        for (int64_t d = 0; d < D; ++d) dot += static_cast<double>(qh[d]) * static_cast<double>(kj[d]);
        s[j - j0] = dot * scale;
        mx = std::max(mx, s[j - j0]);
      }
      double sum = 0;
      std::fill(acc.begin(), acc.end(), 0.0);
      for (int64_t j = j0; j < L; ++j) {
        const double e = std::exp(s[j - j0] - mx);
        sum += e;
        const Real* vj = vb + (j * KVH + g) * D;
        for (int64_t d = 0; d < D; ++d) acc[d] += e * static_cast<double>(vj[d]);
      }
      Real* o = out + (i * H + h) * D;
      for (int64_t d = 0; d < D; ++d) o[d] = static_cast<Real>(acc[d] / sum);
    }
  }
}

template <typename Real>
void kv_cache_write(Real* k_cache, Real* v_cache, const Real* k, const Real* v, int64_t src_row,
                    const int32_t* slot, const int32_t* len, const DecodeAttentionParams& p) {
  const int64_t W = p.KVH * p.D;
  for (int64_t i = 0; i < p.n; ++i) {
    check_row(slot, len, i, p, "kv_cache_write");
    const int64_t at = (slot[i] * p.cap + len[i] - 1) * W;
    std::copy(k + i * src_row, k + i * src_row + W, k_cache + at);
    std::copy(v + i * src_row, v + i * src_row + W, v_cache + at);
  }
}

template void decode_attention_forward<float>(float*, const float*, const float*, const float*, const int32_t*,
                                              const int32_t*, const DecodeAttentionParams&);
template void decode_attention_forward<double>(double*, const double*, const double*, const double*, const int32_t*,
                                               const int32_t*, const DecodeAttentionParams&);
template void kv_cache_write<float>(float*, float*, const float*, const float*, int64_t, const int32_t*,
                                    const int32_t*, const DecodeAttentionParams&);
template void kv_cache_write<double>(double*, double*, const double*, const double*, int64_t, const int32_t*,
                                     const int32_t*, const DecodeAttentionParams&);

}  // namespace primus::turbo::cpu
