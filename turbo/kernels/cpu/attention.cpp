// Attention forward/backward on the CPU, flash-attention style.
//
// Work is split into independent items that own their outputs, so nothing races and nothing
// depends on the thread count:
//   forward:  one item per (document, query head); it writes that head's out rows and lse.
//   backward: one item per (document, key/value head); it runs the group's query heads in order,
//             accumulating dk/dv for its kv head in a private buffer, and writes dq of those heads.
// Inside an item, queries are processed in blocks of kQueryBlock rows and every step is a small
// GEMM with a contiguous, vectorisable inner loop (the key matrix is transposed once per item so
// the score GEMM needs no dot-product reductions). Masked scores get probability exactly 0, so the
// few masked entries computed inside a causal diagonal block change no result.
//
// Queries and keys may be different token sets with explicit positions (ring attention's
// blocks); a score row whose every key is masked then gets lse = -inf, out = 0 and, in the
// backward, probability 0 everywhere.
#include "turbo/kernels/cpu/attention.h"

#include <algorithm>
#include <cmath>
#include <limits>
#include <vector>

#include "core/util/error.h"
#include "turbo/kernels/cpu/vec_math.h"

namespace primus::turbo::cpu {
namespace {

constexpr int64_t kQueryBlock = 32;

// One document: queries [q0, q0 + qlen) of batch row b against keys [k0, k0 + klen) of the same
// row (the same tokens, except when positions or Tk set the keys apart).
struct Segment {
  int64_t b, q0, qlen, k0, klen;
};

// Who sees whom inside a segment: query i sits at position qpos ? qpos[i] : i, key j at
// kpos ? kpos[j] : j.
struct Mask {
  bool causal;
  int64_t window;
  const int32_t* qpos;
  const int32_t* kpos;
  int64_t q(int64_t i) const { return qpos ? qpos[i] : i; }
};

Mask mask_of(const AttentionParams& p) {
  return {p.causal, p.window, p.q_positions, p.k_positions};
}

void check_params(const AttentionParams& p) {
  PRIMUS_CHECK(p.B > 0 && p.T > 0 && p.H > 0 && p.KVH > 0 && p.D > 0,
               "attention: shape B={} T={} H={} KVH={} D={} must be positive", p.B, p.T, p.H, p.KVH,
               p.D);
  PRIMUS_CHECK(p.H % p.KVH == 0, "attention: H={} is not a multiple of KVH={}", p.H, p.KVH);
  PRIMUS_CHECK(p.window >= 0, "attention: window={} must be >= 0", p.window);
  PRIMUS_CHECK(p.window == 0 || p.causal, "attention: a sliding window (window={}) needs causal attention", p.window);
  PRIMUS_CHECK(p.Tk >= 0, "attention: Tk={} must be >= 0", p.Tk);
  PRIMUS_CHECK(!p.cu_seqlens || (!p.q_positions && !p.k_positions && p.keys() == p.T),
               "attention: cu_seqlens (packed documents) cannot be combined with q_positions/"
               "k_positions or Tk={} != T={}",
               p.Tk, p.T);
}

std::vector<Segment> segments_of(const AttentionParams& p) {
  std::vector<Segment> segs;
  if (!p.cu_seqlens) {
    for (int64_t b = 0; b < p.B; ++b) segs.push_back({b, 0, p.T, 0, p.keys()});
    return segs;
  }
  const int32_t* cu = p.cu_seqlens;
  PRIMUS_CHECK(p.num_docs > 0, "attention: cu_seqlens given with num_docs={}", p.num_docs);
  PRIMUS_CHECK(cu[0] == 0 && cu[p.num_docs] == p.B * p.T,
               "attention: cu_seqlens must run from 0 to B*T={}, got {}..{}", p.B * p.T, cu[0],
               cu[p.num_docs]);
  for (int64_t d = 0; d < p.num_docs; ++d) {
    const int64_t s = cu[d], e = cu[d + 1];
    PRIMUS_CHECK(e >= s, "attention: cu_seqlens decreases at document {} ({} -> {})", d, s, e);
    if (e == s) continue;
    PRIMUS_CHECK(s / p.T == (e - 1) / p.T,
                 "attention: document {} spans tokens [{}, {}), crossing a batch row of T={}", d, s,
                 e, p.T);
    segs.push_back({s / p.T, s % p.T, e - s, s % p.T, e - s});
  }
  return segs;
}

// C[M,N] += A[M,K] @ B[K,N]   (all row-major with leading dimensions).
template <typename Real>
PRIMUS_INLINE void gemm_nn_acc(int64_t M, int64_t N, int64_t K, const Real* A, int64_t lda,
                               const Real* B, int64_t ldb, Real* C, int64_t ldc) {
  for (int64_t i = 0; i < M; ++i) {
    Real* c = C + i * ldc;
    for (int64_t kk = 0; kk < K; ++kk) {
      const Real a = A[i * lda + kk];
      if (a == Real(0)) continue;  // masked (causal) probabilities: exact zeros add nothing
      const Real* b = B + kk * ldb;
#pragma omp simd
      for (int64_t j = 0; j < N; ++j) c[j] += a * b[j];
    }
  }
}

// C[M,N] += A^T @ B with A stored [K,M] and B [K,N].
template <typename Real>
PRIMUS_INLINE void gemm_tn_acc(int64_t M, int64_t N, int64_t K, const Real* A, int64_t lda,
                               const Real* B, int64_t ldb, Real* C, int64_t ldc) {
  for (int64_t kk = 0; kk < K; ++kk) {
    const Real* b = B + kk * ldb;
    for (int64_t i = 0; i < M; ++i) {
      const Real a = A[kk * lda + i];
      if (a == Real(0)) continue;
      Real* c = C + i * ldc;
#pragma omp simd
      for (int64_t j = 0; j < N; ++j) c[j] += a * b[j];
    }
  }
}

// dst[D, L] = src[L, D] (rows of src `ld` apart): the transposed key/value matrix of one head.
template <typename Real>
PRIMUS_INLINE void transpose_into(Real* dst, const Real* src, int64_t L, int64_t D, int64_t ld) {
  for (int64_t j = 0; j < L; ++j)
    for (int64_t d = 0; d < D; ++d) dst[d * L + j] = src[j * ld + d];
}

// Scores of one query block: S[nq, nk] = scale * Q K^T (rows L apart), masked entries set to
// -inf (keys after the query when causal; before its window when window > 0). Returns nk, the
// number of leading key columns the block needs (0 when every key is after every query).
template <typename Real>
PRIMUS_INLINE int64_t block_scores(Real* S, const Real* q, int64_t ldq, const Real* kt, int64_t L,
                                   int64_t D, int64_t i0, int64_t nq, const Mask& mask,
                                   Real scale) {
  constexpr Real kNegInf = -std::numeric_limits<Real>::infinity();
  int64_t nk = L;
  if (mask.causal) {
    int64_t last_q = mask.q(i0);
    for (int64_t i = 1; i < nq; ++i) last_q = std::max(last_q, mask.q(i0 + i));
    if (mask.kpos) {
      nk = 0;
      for (int64_t j = 0; j < L; ++j)
        if (mask.kpos[j] <= last_q) nk = j + 1;
    } else {
      nk = std::clamp<int64_t>(last_q + 1, 0, L);
    }
  }
  std::fill(S, S + nq * L, Real(0));
  gemm_nn_acc<Real>(nq, nk, D, q, ldq, kt, L, S, L);
  for (int64_t i = 0; i < nq; ++i) {
    Real* s = S + i * L;
    const int64_t pq = mask.q(i0 + i);
    if (mask.kpos) {
      for (int64_t j = 0; j < nk; ++j) {
        const int64_t pk = mask.kpos[j];
        const bool seen = (!mask.causal || pk <= pq) && (mask.window == 0 || pk > pq - mask.window);
        s[j] = seen ? s[j] * scale : kNegInf;
      }
      continue;
    }
    // Keys at 0..L-1: the visible ones are one contiguous range.
    const int64_t visible = mask.causal ? std::clamp<int64_t>(pq + 1, 0, nk) : nk;
    const int64_t first =
        mask.window > 0 ? std::clamp<int64_t>(pq - mask.window + 1, 0, visible) : 0;
    for (int64_t j = 0; j < first; ++j) s[j] = kNegInf;
    for (int64_t j = first; j < visible; ++j) s[j] *= scale;
    for (int64_t j = visible; j < nk; ++j) s[j] = kNegInf;
  }
  return nk;
}

template <typename Real>
struct ForwardScratch {
  std::vector<Real> kt, s, inv_sum;
  explicit ForwardScratch(int64_t L, int64_t D)
      : kt(static_cast<size_t>(L * D)),
        s(static_cast<size_t>(kQueryBlock * L)),
        inv_sum(static_cast<size_t>(kQueryBlock)) {}
};

template <typename Real>
PRIMUS_CPU_CLONES void forward_item(Real* out, Real* lse, const Real* q, const Real* k,
                                    const Real* v, const AttentionParams& p, const Segment& seg,
                                    int64_t h, ForwardScratch<Real>& scratch) {
  constexpr Real kNegInf = -std::numeric_limits<Real>::infinity();
  const int64_t D = p.D, Lq = seg.qlen, L = seg.klen, g = h / (p.H / p.KVH);
  const int64_t ldq = p.H * D, ldk = p.KVH * D;
  const int64_t qrow0 = seg.b * p.T + seg.q0, krow0 = seg.b * p.keys() + seg.k0;
  const Real* qh = q + (qrow0 * p.H + h) * D;
  const Real* kh = k + (krow0 * p.KVH + g) * D;
  const Real* vh = v + (krow0 * p.KVH + g) * D;
  Real* oh = out + (qrow0 * p.H + h) * D;
  Real* lh = lse + (seg.b * p.H + h) * p.T + seg.q0;
  const Mask mask = mask_of(p);
  const Real scale = static_cast<Real>(p.scale());
  Real* kt = scratch.kt.data();
  Real* S = scratch.s.data();
  Real* inv_sum = scratch.inv_sum.data();
  transpose_into(kt, kh, L, D, ldk);

  for (int64_t i0 = 0; i0 < Lq; i0 += kQueryBlock) {
    const int64_t nq = std::min(kQueryBlock, Lq - i0);
    const int64_t nk = block_scores(S, qh + i0 * ldq, ldq, kt, L, D, i0, nq, mask, scale);
    for (int64_t i = 0; i < nq; ++i) {
      Real* s = S + i * L;
      Real* o = oh + (i0 + i) * ldq;
      std::fill(o, o + D, Real(0));
      Real m = kNegInf;
#pragma omp simd reduction(max : m)
      for (int64_t j = 0; j < nk; ++j) m = std::max(m, s[j]);
      if (m == kNegInf) {
        // The max skips NaN scores, so a row whose visible scores are all NaN also lands here:
        // that is a numerical failure upstream and must reach the output (the trainers detect
        // non-finite steps by it), so the row goes on with m = NaN and comes out NaN.
        bool nan = false;
        for (int64_t j = 0; j < nk; ++j) nan = nan || std::isnan(s[j]);
        if (nan) {
          m = std::numeric_limits<Real>::quiet_NaN();
        } else {  // sees no key: out stays 0, and a merge gives this side weight 0
          std::fill(s, s + nk, Real(0));
          lh[i0 + i] = kNegInf;
          inv_sum[i] = Real(0);
          continue;
        }
      }
      double sum = 0.0;
#pragma omp simd reduction(+ : sum)
      for (int64_t j = 0; j < nk; ++j) {
        const Real e = detail::exp_v(s[j] - m);  // exp(-inf) = 0 for masked entries
        s[j] = e;
        sum += e;
      }
      lh[i0 + i] = static_cast<Real>(m + std::log(sum));
      inv_sum[i] = static_cast<Real>(1.0 / sum);
    }
    gemm_nn_acc<Real>(nq, D, nk, S, L, vh, ldk, oh + i0 * ldq, ldq);
    for (int64_t i = 0; i < nq; ++i) {
      Real* o = oh + (i0 + i) * ldq;
      for (int64_t d = 0; d < D; ++d) o[d] *= inv_sum[i];
    }
  }
}

template <typename Real>
struct BackwardScratch {
  std::vector<Real> kt, vt, s, dp, dk, dv, delta;
  explicit BackwardScratch(int64_t L, int64_t D)
      : kt(static_cast<size_t>(L * D)),
        vt(static_cast<size_t>(L * D)),
        s(static_cast<size_t>(kQueryBlock * L)),
        dp(static_cast<size_t>(kQueryBlock * L)),
        dk(static_cast<size_t>(L * D)),
        dv(static_cast<size_t>(L * D)),
        delta(static_cast<size_t>(kQueryBlock)) {}
};

template <typename Real>
PRIMUS_CPU_CLONES void backward_item(Real* dq, Real* dk, Real* dv, const Real* dout, const Real* q,
                                     const Real* k, const Real* v, const Real* out, const Real* lse,
                                     const AttentionParams& p, const Segment& seg, int64_t g,
                                     BackwardScratch<Real>& scratch) {
  constexpr Real kNegInf = -std::numeric_limits<Real>::infinity();
  const int64_t D = p.D, Lq = seg.qlen, L = seg.klen, group = p.H / p.KVH;
  const int64_t ldq = p.H * D, ldk = p.KVH * D;
  const int64_t row0 = seg.b * p.T + seg.q0, krow0 = seg.b * p.keys() + seg.k0;
  const Real* kh = k + (krow0 * p.KVH + g) * D;
  const Real* vh = v + (krow0 * p.KVH + g) * D;
  const Mask mask = mask_of(p);
  const Real scale = static_cast<Real>(p.scale());
  Real* kt = scratch.kt.data();
  Real* vt = scratch.vt.data();
  Real* S = scratch.s.data();
  Real* dP = scratch.dp.data();
  Real* dk_acc = scratch.dk.data();
  Real* dv_acc = scratch.dv.data();
  Real* delta = scratch.delta.data();
  transpose_into(kt, kh, L, D, ldk);
  transpose_into(vt, vh, L, D, ldk);
  std::fill(dk_acc, dk_acc + L * D, Real(0));
  std::fill(dv_acc, dv_acc + L * D, Real(0));

  for (int64_t h = g * group; h < (g + 1) * group; ++h) {
    const Real* qh = q + (row0 * p.H + h) * D;
    const Real* oh = out + (row0 * p.H + h) * D;
    const Real* doh = dout + (row0 * p.H + h) * D;
    Real* dqh = dq + (row0 * p.H + h) * D;
    const Real* lh = lse + (seg.b * p.H + h) * p.T + seg.q0;
    for (int64_t i0 = 0; i0 < Lq; i0 += kQueryBlock) {
      const int64_t nq = std::min(kQueryBlock, Lq - i0);
      const int64_t nk = block_scores(S, qh + i0 * ldq, ldq, kt, L, D, i0, nq, mask, scale);
      // P = exp(S - lse); delta_i = dout_i · out_i (= sum_j P_ij dP_ij).
      for (int64_t i = 0; i < nq; ++i) {
        Real* s = S + i * L;
        const Real l = lh[i0 + i];
        if (l == kNegInf) {
          std::fill(s, s + nk, Real(0));  // a row that saw no key (-inf - -inf would be NaN)
        } else {
          for (int64_t j = 0; j < nk; ++j) s[j] = detail::exp_v(s[j] - l);
        }
        const Real* o = oh + (i0 + i) * ldq;
        const Real* dy = doh + (i0 + i) * ldq;
        double dot = 0.0;
#pragma omp simd reduction(+ : dot)
        for (int64_t d = 0; d < D; ++d) dot += static_cast<double>(dy[d]) * o[d];
        delta[i] = static_cast<Real>(dot);
      }
      // dP = dout @ V^T, then dS = P * (dP - delta) * scale (stored over dP).
      std::fill(dP, dP + nq * L, Real(0));
      gemm_nn_acc<Real>(nq, nk, D, doh + i0 * ldq, ldq, vt, L, dP, L);
      for (int64_t i = 0; i < nq; ++i) {
        const Real* s = S + i * L;
        Real* ds = dP + i * L;
        for (int64_t j = 0; j < nk; ++j) ds[j] = s[j] * (ds[j] - delta[i]) * scale;
      }
      gemm_nn_acc<Real>(nq, D, nk, dP, L, kh, ldk, dqh + i0 * ldq, ldq);   // dq += dS K
      gemm_tn_acc<Real>(nk, D, nq, dP, L, qh + i0 * ldq, ldq, dk_acc, D);  // dk += dS^T Q
      gemm_tn_acc<Real>(nk, D, nq, S, L, doh + i0 * ldq, ldq, dv_acc, D);  // dv += P^T dout
    }
  }
  Real* dkh = dk + (krow0 * p.KVH + g) * D;
  Real* dvh = dv + (krow0 * p.KVH + g) * D;
  for (int64_t j = 0; j < L; ++j) {
    for (int64_t d = 0; d < D; ++d) {
      dkh[j * ldk + d] += dk_acc[j * D + d];
      dvh[j * ldk + d] += dv_acc[j * D + d];
    }
  }
}

// Scratch rows are sized by keys.
int64_t longest(const std::vector<Segment>& segs) {
  int64_t L = 0;
  for (const Segment& s : segs) L = std::max(L, s.klen);
  return L;
}

}  // namespace

double AttentionParams::scale() const {
  return softmax_scale ? *softmax_scale : 1.0 / std::sqrt(static_cast<double>(D));
}

template <typename Real>
void attention_forward(Real* out, Real* lse, const Real* q, const Real* k, const Real* v,
                       const AttentionParams& p) {
  check_params(p);
  const std::vector<Segment> segs = segments_of(p);
  const int64_t items = static_cast<int64_t>(segs.size()) * p.H;
  const int64_t max_len = longest(segs);
#pragma omp parallel
  {
    ForwardScratch<Real> scratch(max_len, p.D);
#pragma omp for schedule(dynamic, 1)
    for (int64_t it = 0; it < items; ++it) {
      forward_item(out, lse, q, k, v, p, segs[it / p.H], it % p.H, scratch);
    }
  }
}

template <typename Real>
void attention_backward(Real* dq, Real* dk, Real* dv, const Real* dout, const Real* q,
                        const Real* k, const Real* v, const Real* out, const Real* lse,
                        const AttentionParams& p) {
  check_params(p);
  const std::vector<Segment> segs = segments_of(p);
  const int64_t items = static_cast<int64_t>(segs.size()) * p.KVH;
  const int64_t max_len = longest(segs);
#pragma omp parallel
  {
    BackwardScratch<Real> scratch(max_len, p.D);
#pragma omp for schedule(dynamic, 1)
    for (int64_t it = 0; it < items; ++it) {
      backward_item(dq, dk, dv, dout, q, k, v, out, lse, p, segs[it / p.KVH], it % p.KVH, scratch);
    }
  }
}

template <typename Real>
void attention_merge(Real* out, Real* lse, const Real* out_b, const Real* lse_b, int64_t B,
                     int64_t T, int64_t H, int64_t D) {
  constexpr double kNegInf = -std::numeric_limits<double>::infinity();
#pragma omp parallel for schedule(static)
  for (int64_t bt = 0; bt < B * T; ++bt) {
    const int64_t b = bt / T, t = bt % T;
    for (int64_t h = 0; h < H; ++h) {
      Real& l = lse[(b * H + h) * T + t];
      const double la = l, lb = lse_b[(b * H + h) * T + t];
      if (lb == kNegInf) continue;
      Real* o = out + (bt * H + h) * D;
      const Real* ob = out_b + (bt * H + h) * D;
      if (la == kNegInf) {
        std::copy(ob, ob + D, o);
        l = static_cast<Real>(lb);
        continue;
      }
      // log(e^la + e^lb) = m + log1p(e^-|la - lb|): no overflow, exact when the two are far apart.
      const double m = std::max(la, lb);
      const double merged = m + std::log1p(std::exp(-std::abs(la - lb)));
      const double wa = std::exp(la - merged), wb = std::exp(lb - merged);
      for (int64_t d = 0; d < D; ++d) o[d] = static_cast<Real>(wa * o[d] + wb * ob[d]);
      l = static_cast<Real>(merged);
    }
  }
}

#define PRIMUS_INSTANTIATE(Real)                                                             \
  template void attention_forward<Real>(Real*, Real*, const Real*, const Real*, const Real*, \
                                        const AttentionParams&);                             \
  template void attention_backward<Real>(Real*, Real*, Real*, const Real*, const Real*,      \
                                         const Real*, const Real*, const Real*, const Real*, \
                                         const AttentionParams&);                            \
  template void attention_merge<Real>(Real*, Real*, const Real*, const Real*, int64_t, int64_t, \
                                      int64_t, int64_t);
PRIMUS_INSTANTIATE(float)
PRIMUS_INSTANTIATE(double)
#undef PRIMUS_INSTANTIATE

}  // namespace primus::turbo::cpu
