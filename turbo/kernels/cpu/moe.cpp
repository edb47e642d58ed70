#include "turbo/kernels/cpu/moe.h"

#include <algorithm>
#include <cmath>
#include <cstring>
#include <limits>
#include <numeric>
#include <stdexcept>
#include <vector>

namespace primus::turbo::cpu {
namespace {

// Indices of the k largest of v[0..n), largest first; ties go to the lower index.
void top_indices(std::vector<int64_t>& out, const double* v, int64_t n, int64_t k) {
  out.resize(static_cast<size_t>(n));
  std::iota(out.begin(), out.end(), int64_t{0});
  std::partial_sort(out.begin(), out.begin() + k, out.end(), [v](int64_t a, int64_t b) {
    return v[a] > v[b] || (v[a] == v[b] && a < b);
  });
  out.resize(static_cast<size_t>(k));
}

double sigmoid(double x) { return 1.0 / (1.0 + std::exp(-x)); }

// The router's per-token quantities, in double whatever Real is.
struct TokenScores {
  std::vector<double> logit, soft, sig;  // logits, softmax(logits), sigmoid(logits)
  double lse = 0;
  template <typename Real>
  void compute(const Real* l, int64_t E, RouterScore score) {
    logit.assign(l, l + E);
    const double mx = *std::max_element(logit.begin(), logit.end());
    double sum = 0;
    soft.resize(static_cast<size_t>(E));
    for (int64_t e = 0; e < E; ++e) sum += soft[e] = std::exp(logit[e] - mx);
    for (auto& s : soft) s /= sum;
    lse = mx + std::log(sum);
    if (score == RouterScore::Sigmoid) {
      sig.resize(static_cast<size_t>(E));
      for (int64_t e = 0; e < E; ++e) sig[e] = sigmoid(logit[e]);
    }
  }
};

// Megatron's epsilon in the sigmoid router's normalisations.
constexpr double kNormEps = 1e-20;

}  // namespace

template <typename Real>
void router_forward(int32_t* topk_idx, Real* topk_weight, Real* probs, int32_t* counts, Real* prob_sum,
                    Real* z_sum, const Real* logits, const Real* bias, int64_t N, const RouterConfig& cfg,
                    const int32_t* forced_idx) {
  const int64_t E = cfg.num_experts, K = cfg.topk;
  const bool grouped = cfg.num_groups > 1;
  const int64_t per_group = grouped ? E / cfg.num_groups : E;
  const int64_t group_k = grouped ? K / cfg.group_topk : 0;
  std::fill(counts, counts + E, 0);
  std::vector<double> psum(static_cast<size_t>(E), 0.0), sel(static_cast<size_t>(E)), gscore, tmp;
  std::vector<int64_t> top, gtop;
  double zs = 0;
  TokenScores ts;
  for (int64_t n = 0; n < N; ++n) {
    ts.compute(logits + n * E, E, cfg.score);
    zs += ts.lse * ts.lse;
    // The aux loss's p.
    Real* p = probs + n * E;
    if (cfg.score == RouterScore::Softmax) {
      for (int64_t e = 0; e < E; ++e) p[e] = static_cast<Real>(ts.soft[e]);
      for (int64_t e = 0; e < E; ++e) psum[e] += ts.soft[e];
    } else {
      const double s = std::accumulate(ts.sig.begin(), ts.sig.end(), 0.0) + kNormEps;
      for (int64_t e = 0; e < E; ++e) {
        p[e] = static_cast<Real>(ts.sig[e] / s);
        psum[e] += ts.sig[e] / s;
      }
    }
    // Selection scores.
    for (int64_t e = 0; e < E; ++e) {
      double v = cfg.score == RouterScore::Sigmoid ? ts.sig[e] : cfg.pre_softmax ? ts.soft[e] : ts.logit[e];
      sel[e] = v + (bias ? static_cast<double>(bias[e]) : 0.0);
    }
    if (grouped) {
      gscore.assign(static_cast<size_t>(cfg.num_groups), 0.0);
      for (int64_t g = 0; g < cfg.num_groups; ++g) {
        top_indices(gtop, sel.data() + g * per_group, per_group, group_k);
        for (int64_t i : gtop) gscore[g] += sel[g * per_group + i];
      }
      top_indices(gtop, gscore.data(), cfg.num_groups, cfg.group_topk);
      std::vector<bool> allowed(static_cast<size_t>(cfg.num_groups), false);
      for (int64_t g : gtop) allowed[g] = true;
      for (int64_t e = 0; e < E; ++e)
        if (!allowed[e / per_group]) sel[e] = -std::numeric_limits<double>::infinity();
    }
    top_indices(top, sel.data(), E, K);
    if (forced_idx) top.assign(forced_idx + n * K, forced_idx + (n + 1) * K);
    // Weights.
    tmp.resize(static_cast<size_t>(K));
    if (cfg.score == RouterScore::Softmax && !cfg.pre_softmax) {
      double mx = -std::numeric_limits<double>::infinity(), s = 0;
      for (int64_t k = 0; k < K; ++k) mx = std::max(mx, ts.logit[top[k]]);
      for (int64_t k = 0; k < K; ++k) s += tmp[k] = std::exp(ts.logit[top[k]] - mx);
      for (auto& t : tmp) t /= s;
    } else if (cfg.score == RouterScore::Softmax) {
      for (int64_t k = 0; k < K; ++k) tmp[k] = ts.soft[top[k]];
    } else {
      double s = 0;
      for (int64_t k = 0; k < K; ++k) s += tmp[k] = ts.sig[top[k]];
      if (K > 1)
        for (auto& t : tmp) t /= s + kNormEps;
    }
    for (int64_t k = 0; k < K; ++k) {
      topk_idx[n * K + k] = static_cast<int32_t>(top[k]);
      topk_weight[n * K + k] = static_cast<Real>(tmp[k] * cfg.scaling_factor);
      ++counts[top[k]];
    }
  }
  for (int64_t e = 0; e < E; ++e) prob_sum[e] = static_cast<Real>(psum[e]);
  *z_sum = static_cast<Real>(zs);
}

template <typename Real>
void router_losses(double* aux, double* z, const int32_t* counts, const Real* prob_sum, Real z_sum, int64_t N,
                   const RouterConfig& cfg) {
  const int64_t E = cfg.num_experts, K = cfg.topk;
  double s = 0;
  for (int64_t e = 0; e < E; ++e) s += static_cast<double>(counts[e]) * static_cast<double>(prob_sum[e]);
  *aux = N > 0 ? static_cast<double>(E) * s / (static_cast<double>(N) * K * N) : 0.0;
  *z = N > 0 ? static_cast<double>(z_sum) / N : 0.0;
}

template <typename Real>
void moe_random_logits(Real* logits, int64_t N, int64_t E, uint64_t seed) {
  for (int64_t n = 0; n < N; ++n)
    for (int64_t e = 0; e < E; ++e) logits[n * E + e] = static_cast<Real>(moe_random_logit(seed, n, e));
}

template <typename Real>
void moe_sequence_stats(int32_t* counts, Real* prob_sum, const int32_t* topk_idx, const Real* probs, int64_t N,
                        const SequenceRuns& q, int64_t K, int64_t E) {
  check_sequence_runs("moe_sequence_stats", {q.seqs, q.run, 1}, N);
  const int64_t S = q.seqs, R = N / q.run;
  std::fill(counts, counts + S * E, 0);
  std::vector<double> sum(static_cast<size_t>(E));
  for (int64_t s = 0; s < S; ++s) {
    int32_t* c = counts + s * E;
    std::fill(sum.begin(), sum.end(), 0.0);
    for (int64_t r = s; r < R; r += S)
      for (int64_t n = r * q.run; n < (r + 1) * q.run; ++n) {
        for (int64_t k = 0; k < K; ++k) {
          const int32_t e = topk_idx[n * K + k];
          if (e >= 0 && e < E) ++c[e];
        }
        for (int64_t e = 0; e < E; ++e) sum[e] += static_cast<double>(probs[n * E + e]);
      }
    for (int64_t e = 0; e < E; ++e) prob_sum[s * E + e] = static_cast<Real>(sum[e]);
  }
}

template <typename Real>
double sequence_aux_loss(const int32_t* counts, const Real* prob_sum, int64_t S, int64_t T, const RouterConfig& cfg) {
  if (S < 1) return 0.0;
  const int64_t E = cfg.num_experts;
  double total = 0;
  for (int64_t s = 0; s < S; ++s) {
    double aux = 0, z = 0;
    router_losses(&aux, &z, counts + s * E, prob_sum + s * E, Real(0), T, cfg);
    total += aux;
  }
  return total / static_cast<double>(S);
}

template <typename Real>
void router_backward(Real* dlogits, const Real* dweight, const Real* logits, const Real* probs,
                     const int32_t* topk_idx, const int32_t* counts, int64_t N, const RouterConfig& cfg,
                     double aux_coeff, double z_coeff, const SequenceRuns* seq, const AuxTerm* more,
                     size_t n_more) {
  (void)probs;  // recomputed in double from the logits: the gradient checks need fp64 throughout
  const int64_t E = cfg.num_experts, K = cfg.topk;
  std::vector<AuxTerm> terms{{counts, aux_coeff, seq ? *seq : SequenceRuns{}}};
  terms.insert(terms.end(), more, more + n_more);
  // d aux / d p_ne: per term, the same for every token of a sequence (of the batch without runs).
  std::vector<std::vector<double>> gaux_all;
  bool any_aux = false;
  for (const AuxTerm& t : terms) {
    if (t.seq.seqs > 0) check_sequence_runs("router_backward", t.seq, N);
    const int64_t S = t.seq.seqs > 0 ? t.seq.seqs : 1;
    const double len = t.seq.seqs > 0 ? static_cast<double>(t.seq.seq_len) : static_cast<double>(N);
    std::vector<double> g(static_cast<size_t>(S * E), 0.0);
    if (t.coeff != 0 && N > 0) {
      for (int64_t i = 0; i < S * E; ++i) g[i] = t.coeff * E * t.counts[i] / (len * K * len);
      any_aux = true;
    }
    gaux_all.push_back(std::move(g));
  }
  std::vector<double> dl(static_cast<size_t>(E)), dsel(static_cast<size_t>(K)), w(static_cast<size_t>(K));
  std::vector<double> gaux(static_cast<size_t>(E));
  TokenScores ts;
  for (int64_t n = 0; n < N; ++n) {
    std::fill(gaux.begin(), gaux.end(), 0.0);
    for (size_t t = 0; t < terms.size(); ++t) {
      const double* g = gaux_all[t].data() + (terms[t].seq.seqs > 0 ? terms[t].seq.of(n) : 0) * E;
      for (int64_t e = 0; e < E; ++e) gaux[e] += g[e];
    }
    ts.compute(logits + n * E, E, cfg.score);
    std::fill(dl.begin(), dl.end(), 0.0);
    const int32_t* idx = topk_idx + n * K;
    const Real* dw = dweight + n * K;
    // Through the weights.
    if (cfg.score == RouterScore::Softmax && !cfg.pre_softmax) {
      double mx = -std::numeric_limits<double>::infinity(), s = 0, dot = 0;
      for (int64_t k = 0; k < K; ++k) mx = std::max(mx, ts.logit[idx[k]]);
      for (int64_t k = 0; k < K; ++k) s += w[k] = std::exp(ts.logit[idx[k]] - mx);
      for (int64_t k = 0; k < K; ++k) dot += (w[k] /= s) * dw[k];
      for (int64_t k = 0; k < K; ++k) dl[idx[k]] += cfg.scaling_factor * w[k] * (dw[k] - dot);
    } else if (cfg.score == RouterScore::Softmax) {
      // w_k = scale * softmax_e at e = idx_k: a gradient g on the softmax output, then its Jacobian.
      double dot = 0;
      for (int64_t k = 0; k < K; ++k) dot += ts.soft[idx[k]] * cfg.scaling_factor * dw[k];
      for (int64_t e = 0; e < E; ++e) dl[e] -= ts.soft[e] * dot;
      for (int64_t k = 0; k < K; ++k) dl[idx[k]] += ts.soft[idx[k]] * cfg.scaling_factor * dw[k];
    } else {
      double s = 0, dot = 0;
      for (int64_t k = 0; k < K; ++k) s += ts.sig[idx[k]];
      for (int64_t k = 0; k < K; ++k) dot += dw[k] * ts.sig[idx[k]];
      for (int64_t k = 0; k < K; ++k) {
        const double u = ts.sig[idx[k]];
        const double du = K > 1 ? cfg.scaling_factor * (dw[k] / (s + kNormEps) - dot / ((s + kNormEps) * (s + kNormEps)))
                                : cfg.scaling_factor * dw[k];
        dl[idx[k]] += du * u * (1 - u);
      }
    }
    // Through the aux losses' p.
    if (any_aux) {
      if (cfg.score == RouterScore::Softmax) {
        double dot = 0;
        for (int64_t e = 0; e < E; ++e) dot += gaux[e] * ts.soft[e];
        for (int64_t e = 0; e < E; ++e) dl[e] += ts.soft[e] * (gaux[e] - dot);
      } else {
        const double T = std::accumulate(ts.sig.begin(), ts.sig.end(), 0.0) + kNormEps;
        double dot = 0;
        for (int64_t e = 0; e < E; ++e) dot += gaux[e] * ts.sig[e];
        for (int64_t e = 0; e < E; ++e) dl[e] += (gaux[e] / T - dot / (T * T)) * ts.sig[e] * (1 - ts.sig[e]);
      }
    }
    // Through the z loss.
    if (z_coeff != 0)
      for (int64_t e = 0; e < E; ++e) dl[e] += z_coeff / N * 2 * ts.lse * ts.soft[e];
    for (int64_t e = 0; e < E; ++e) dlogits[n * E + e] = static_cast<Real>(dl[e]);
  }
}

template <typename Real>
int64_t moe_plan_rows(int32_t* row_of_slot, int32_t* offsets, int32_t* kept, const int32_t* topk_idx,
                      const Real* topk_weight, const int32_t* counts, int64_t N, int64_t K, int64_t E,
                      int64_t align, int64_t capacity, DropPolicy policy) {
  (void)counts;  // recounted here: the plan must not trust a count that disagrees with the indices
  // Each expert's slots in token order (a token picks an expert at most once, so slot order is
  // token order).
  std::vector<std::vector<int64_t>> slots(static_cast<size_t>(E));
  for (int64_t s = 0; s < N * K; ++s) slots[topk_idx[s]].push_back(s);
  std::fill(row_of_slot, row_of_slot + N * K, -1);
  offsets[0] = 0;
  for (int64_t e = 0; e < E; ++e) {
    std::vector<int64_t>& v = slots[e];
    if (capacity >= 0 && static_cast<int64_t>(v.size()) > capacity) {
      if (policy == DropPolicy::Probs) {
        std::stable_sort(v.begin(), v.end(), [topk_weight](int64_t a, int64_t b) { return topk_weight[a] > topk_weight[b]; });
      }
      v.resize(static_cast<size_t>(capacity));
      std::sort(v.begin(), v.end());  // kept slots in token order
    }
    const int64_t n = static_cast<int64_t>(v.size());
    kept[e] = static_cast<int32_t>(n);
    for (int64_t i = 0; i < n; ++i) row_of_slot[v[i]] = static_cast<int32_t>(offsets[e] + i);
    offsets[e + 1] = static_cast<int32_t>(offsets[e] + (n + align - 1) / align * align);
  }
  return offsets[E];
}

template <typename Real>
void moe_permute(Real* out, const Real* inp, const int32_t* row_of_slot, const int32_t* offsets,
                 const int32_t* kept, int64_t N, int64_t K, int64_t E, int64_t C) {
  for (int64_t e = 0; e < E; ++e)
    for (int64_t r = offsets[e] + kept[e]; r < offsets[e + 1]; ++r) std::fill(out + r * C, out + (r + 1) * C, Real(0));
  for (int64_t s = 0; s < N * K; ++s)
    if (row_of_slot[s] >= 0) std::memcpy(out + int64_t{row_of_slot[s]} * C, inp + (s / K) * C, sizeof(Real) * C);
}

template <typename Real>
void moe_permute_backward(Real* dinp, const Real* dout, const int32_t* row_of_slot, int64_t N, int64_t K,
                          int64_t C, bool accumulate) {
  for (int64_t n = 0; n < N; ++n) {
    Real* d = dinp + n * C;
    if (!accumulate) std::fill(d, d + C, Real(0));
    for (int64_t k = 0; k < K; ++k) {
      const int32_t r = row_of_slot[n * K + k];
      if (r < 0) continue;
      const Real* src = dout + int64_t{r} * C;
      for (int64_t c = 0; c < C; ++c) d[c] += src[c];
    }
  }
}

template <typename Real>
void moe_unpermute(Real* out, const Real* inp, const Real* weight, const int32_t* row_of_slot, int64_t N,
                   int64_t K, int64_t C, bool accumulate) {
  for (int64_t n = 0; n < N; ++n) {
    Real* o = out + n * C;
    if (!accumulate) std::fill(o, o + C, Real(0));
    for (int64_t k = 0; k < K; ++k) {
      const int32_t r = row_of_slot[n * K + k];
      if (r < 0) continue;
      const Real w = weight[n * K + k];
      const Real* src = inp + int64_t{r} * C;
      for (int64_t c = 0; c < C; ++c) o[c] += w * src[c];
    }
  }
}

template <typename Real>
void moe_unpermute_backward(Real* dinp, Real* dweight, const Real* dout, const Real* inp, const Real* weight,
                            const int32_t* row_of_slot, const int32_t* offsets, const int32_t* kept, int64_t N,
                            int64_t K, int64_t E, int64_t C) {
  for (int64_t e = 0; e < E; ++e)
    for (int64_t r = offsets[e] + kept[e]; r < offsets[e + 1]; ++r) std::fill(dinp + r * C, dinp + (r + 1) * C, Real(0));
  for (int64_t s = 0; s < N * K; ++s) {
    const int32_t r = row_of_slot[s];
    if (r < 0) {
      dweight[s] = Real(0);
      continue;
    }
    const Real* d = dout + (s / K) * C;
    const Real* x = inp + int64_t{r} * C;
    Real* di = dinp + int64_t{r} * C;
    double dot = 0;
    for (int64_t c = 0; c < C; ++c) {
      di[c] = weight[s] * d[c];
      dot += static_cast<double>(d[c]) * static_cast<double>(x[c]);
    }
    dweight[s] = static_cast<Real>(dot);
  }
}

void router_bias_update(float* bias, const int64_t* load, int64_t E, double rate) {
  double mean = 0;
  for (int64_t e = 0; e < E; ++e) mean += static_cast<double>(load[e]);
  mean /= static_cast<double>(E);
  for (int64_t e = 0; e < E; ++e) {
    const double d = mean - static_cast<double>(load[e]);
    bias[e] += static_cast<float>(rate * (d > 0 ? 1.0 : d < 0 ? -1.0 : 0.0));
  }
}

#define PRIMUS_MOE_INSTANTIATE(Real)                                                                                   \
  template void router_forward<Real>(int32_t*, Real*, Real*, int32_t*, Real*, Real*, const Real*, const Real*,        \
                                     int64_t, const RouterConfig&, const int32_t*);                                   \
  template void router_losses<Real>(double*, double*, const int32_t*, const Real*, Real, int64_t,                     \
                                    const RouterConfig&);                                                             \
  template void moe_random_logits<Real>(Real*, int64_t, int64_t, uint64_t);                                           \
  template void moe_sequence_stats<Real>(int32_t*, Real*, const int32_t*, const Real*, int64_t, const SequenceRuns&,  \
                                         int64_t, int64_t);                                                           \
  template double sequence_aux_loss<Real>(const int32_t*, const Real*, int64_t, int64_t, const RouterConfig&);        \
  template void router_backward<Real>(Real*, const Real*, const Real*, const Real*, const int32_t*, const int32_t*,   \
                                      int64_t, const RouterConfig&, double, double, const SequenceRuns*,             \
                                      const AuxTerm*, size_t);                                                        \
  template int64_t moe_plan_rows<Real>(int32_t*, int32_t*, int32_t*, const int32_t*, const Real*, const int32_t*,     \
                                       int64_t, int64_t, int64_t, int64_t, int64_t, DropPolicy);                      \
  template void moe_permute<Real>(Real*, const Real*, const int32_t*, const int32_t*, const int32_t*, int64_t,        \
                                  int64_t, int64_t, int64_t);                                                         \
  template void moe_permute_backward<Real>(Real*, const Real*, const int32_t*, int64_t, int64_t, int64_t, bool);      \
  template void moe_unpermute<Real>(Real*, const Real*, const Real*, const int32_t*, int64_t, int64_t, int64_t,       \
                                    bool);                                                                            \
  template void moe_unpermute_backward<Real>(Real*, Real*, const Real*, const Real*, const Real*, const int32_t*,     \
                                             const int32_t*, const int32_t*, int64_t, int64_t, int64_t, int64_t);
PRIMUS_MOE_INSTANTIATE(float)
PRIMUS_MOE_INSTANTIATE(double)
#undef PRIMUS_MOE_INSTANTIATE

}  // namespace primus::turbo::cpu
