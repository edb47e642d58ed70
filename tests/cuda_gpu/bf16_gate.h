// The bf16 gate of the mesh GPU tests (tensor, context and sharded data parallelism on threaded
// ranks against one rank), step by step: each step's loss within 1e-2 relative; the gradient norm
// within 1e-2 for the first 10 steps, and after that within `late_floor` or 4x the distance of one
// rank run with the other attention kernel (same model, other rounding), whichever is larger: by
// then the bf16 trajectories have separated and a gradient spike's norm is sensitive to them. It
// prints each step and returns the worst distances and the later steps' mean ones.
#pragma once
#include <gtest/gtest.h>

#include <algorithm>
#include <cmath>
#include <cstdio>
#include <vector>

#include "cuda_fixture.h"

namespace primus::backends::cuda::testing {

struct Bf16Steps {
  double worst_loss = 0, worst_norm = 0;
  double late_norm = 0, late_other = 0;  // mean norm distance past step 10: the run's, the other kernel's
};

inline Bf16Steps expect_bf16_steps(const char* name, const std::vector<double>& ref_loss,
                                   const std::vector<double>& ref_norm, const std::vector<double>& loss,
                                   const std::vector<double>& norm, const std::vector<double>& other_loss,
                                   const std::vector<double>& other_norm, double late_floor = 2e-2) {
  constexpr size_t kEarly = 10;
  const size_t n = ref_loss.size();
  Bf16Steps r;
  for (size_t s = 0; s < n; ++s) {
    const double dl = std::fabs(loss[s] - ref_loss[s]) / ref_loss[s];
    const double dn = std::fabs(norm[s] - ref_norm[s]) / ref_norm[s];
    const double spread = std::fabs(other_norm[s] - ref_norm[s]) / ref_norm[s];
    std::printf("  step %2zu  loss %.5f %s %.5f (%+.1e) fallback %.5f (%+.1e)  grad norm %.4f %s %.4f (%+.1e) "
                "fallback %.4f (%+.1e)\n",
                s, ref_loss[s], name, loss[s], loss[s] / ref_loss[s] - 1, other_loss[s], other_loss[s] / ref_loss[s] - 1,
                ref_norm[s], name, norm[s], norm[s] / ref_norm[s] - 1, other_norm[s], other_norm[s] / ref_norm[s] - 1);
    r.worst_loss = std::max(r.worst_loss, dl);
    r.worst_norm = std::max(r.worst_norm, dn);
    if (s >= kEarly) {
      r.late_norm += dn / double(n - kEarly);
      r.late_other += spread / double(n - kEarly);
    }
    EXPECT_LT(dl, 1e-2) << name << " step " << s << ": " << loss[s] << " vs " << ref_loss[s];
    EXPECT_LT(dn, s < kEarly ? 1e-2 : std::max(late_floor, 4 * spread))
        << name << " step " << s << ": " << norm[s] << " vs " << ref_norm[s] << " (fallback " << other_norm[s] << ")";
  }
  return r;
}

// The final weights after the run: within 1e-2 relative L2 of one rank's, or within twice the
// distance of the run with the other attention kernel, whichever is larger. Routing is discrete:
// in an MoE model a rounding difference sends a token to another expert, and the experts' weights
// move apart from then on (the tiny DeepSeek-style MoE after 20 steps on an H200: the fallback
// attention's own run 1.7e-2 from the reference). Returns {distance, the other run's distance}.
struct WeightDistance {
  double dw = 0, spread = 0;
};
inline WeightDistance expect_weights_close(const std::vector<float>& params, const std::vector<float>& ref,
                                           const std::vector<float>& other) {
  EXPECT_EQ(params.size(), ref.size());
  EXPECT_EQ(other.size(), ref.size());
  if (params.size() != ref.size() || other.size() != ref.size()) return {};
  const auto n = static_cast<int64_t>(ref.size());
  const WeightDistance w{rel_l2(params.data(), ref.data(), n), rel_l2(other.data(), ref.data(), n)};
  EXPECT_LT(w.dw, std::max(1e-2, 2 * w.spread)) << "final weights (the other attention kernel's run: " << w.spread << ")";
  return w;
}

// The mean over ranks of each step's loss (context and data parallelism: each rank its own tokens).
inline std::vector<double> rank_mean(const std::vector<std::vector<double>>& per_rank) {
  std::vector<double> m(per_rank.at(0).size(), 0.0);
  for (const auto& r : per_rank)
    for (size_t s = 0; s < m.size(); ++s) m[s] += r[s] / double(per_rank.size());
  return m;
}

}  // namespace primus::backends::cuda::testing
