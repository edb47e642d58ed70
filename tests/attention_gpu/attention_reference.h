// The oracle of the attention tests: turbo/kernels/cpu/attention.h run in double on the very
// values the device sees (inputs rounded to the device dtype first), plus the error metrics.
//
// Metrics (every tensor compared, all must pass):
//   rel_l2   = ||got - ref||_2 / ||ref||_2
//   max_rel  = max_i |got_i - ref_i| / max_i |ref_i|   (worst element against the tensor's scale)
// A NaN or inf anywhere in `got` fails both (outputs are poisoned with NaN before each run, so a
// value the kernel never wrote fails too).
#pragma once
#include <algorithm>
#include <cmath>
#include <cstdint>
#include <limits>
#include <optional>
#include <random>
#include <string>
#include <vector>

#include "turbo/core/dtype.h"
#include "turbo/kernels/cpu/attention.h"

namespace primus::turbo::testing {

struct AttnCase {
  int64_t B = 2, T = 256, H = 4, KVH = 4, D = 64;
  bool causal = true;
  std::optional<double> scale;
  std::vector<int32_t> cu_seqlens;  // empty: dense
  int64_t window = 0;               // sliding window (AttentionOptions::window); 0: none
};

struct AttnTensors {  // host values in the flat layouts of turbo/ops/attention.h
  std::vector<double> q, k, v, dout;
  std::vector<double> out, lse, dq, dk, dv;  // reference results
};

inline cpu::AttentionParams ref_params(const AttnCase& c) {
  cpu::AttentionParams p;
  p.B = c.B, p.T = c.T, p.H = c.H, p.KVH = c.KVH, p.D = c.D;
  p.causal = c.causal;
  p.window = c.window;
  p.softmax_scale = c.scale;
  if (!c.cu_seqlens.empty()) {
    p.cu_seqlens = c.cu_seqlens.data();
    p.num_docs = static_cast<int64_t>(c.cu_seqlens.size()) - 1;
  }
  return p;
}

// Normal(0, 1) values rounded to `dt` (so the reference sees exactly what the device sees).
inline std::vector<double> random_values(std::mt19937& rng, size_t n, DType dt) {
  std::normal_distribution<float> d(0.0f, 1.0f);
  std::vector<double> v(n);
  char buf[8];
  for (auto& x : v) {
    store_from_float(buf, dt, 0, d(rng));
    x = load_as_float(buf, dt, 0);
  }
  return v;
}

inline void run_reference(const AttnCase& c, AttnTensors& t) {
  const size_t nq = static_cast<size_t>(c.B * c.T * c.H * c.D), nk = static_cast<size_t>(c.B * c.T * c.KVH * c.D);
  t.out.assign(nq, 0.0);
  t.lse.assign(static_cast<size_t>(c.B * c.H * c.T), 0.0);
  t.dq.assign(nq, 0.0);
  t.dk.assign(nk, 0.0);
  t.dv.assign(nk, 0.0);
  const cpu::AttentionParams p = ref_params(c);
  cpu::attention_forward<double>(t.out.data(), t.lse.data(), t.q.data(), t.k.data(), t.v.data(), p);
  cpu::attention_backward<double>(t.dq.data(), t.dk.data(), t.dv.data(), t.dout.data(), t.q.data(), t.k.data(),
                                  t.v.data(), t.out.data(), t.lse.data(), p);
}

struct ErrorStats {
  double rel_l2 = 0.0, max_rel = 0.0;
};

inline ErrorStats compare(const std::vector<float>& got, const std::vector<double>& ref) {
  ErrorStats e;
  if (got.size() != ref.size()) return {INFINITY, INFINITY};
  double num = 0.0, den = 0.0, max_err = 0.0, max_ref = 0.0;
  for (size_t i = 0; i < got.size(); ++i) {
    if (!std::isfinite(got[i])) return {INFINITY, INFINITY};
    const double d = static_cast<double>(got[i]) - ref[i];
    num += d * d;
    den += ref[i] * ref[i];
    max_err = std::max(max_err, std::abs(d));
    max_ref = std::max(max_ref, std::abs(ref[i]));
  }
  e.rel_l2 = std::sqrt(num / std::max(den, 1e-300));
  e.max_rel = max_err / std::max(max_ref, 1e-300);
  return e;
}

// Random document lengths (>= 1) that fill each batch row of length T; cumulative offsets over
// B*T. `docs_per_row` documents per row (cut points drawn uniformly).
inline std::vector<int32_t> random_cu_seqlens(std::mt19937& rng, int64_t B, int64_t T, int docs_per_row) {
  std::vector<int32_t> cu{0};
  for (int64_t b = 0; b < B; ++b) {
    std::vector<int32_t> cuts;
    std::uniform_int_distribution<int32_t> d(1, static_cast<int32_t>(T) - 1);
    while (static_cast<int>(cuts.size()) < docs_per_row - 1) {
      const int32_t c = d(rng);
      if (std::find(cuts.begin(), cuts.end(), c) == cuts.end()) cuts.push_back(c);
    }
    std::sort(cuts.begin(), cuts.end());
    for (int32_t c : cuts) cu.push_back(static_cast<int32_t>(b * T) + c);
    cu.push_back(static_cast<int32_t>((b + 1) * T));
  }
  return cu;
}

}  // namespace primus::turbo::testing
