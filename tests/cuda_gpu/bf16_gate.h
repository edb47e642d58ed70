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

// The mean over ranks of each step's loss (context and data parallelism: each rank its own tokens).
inline std::vector<double> rank_mean(const std::vector<std::vector<double>>& per_rank) {
  std::vector<double> m(per_rank.at(0).size(), 0.0);
  for (const auto& r : per_rank)
    for (size_t s = 0; s < m.size(); ++s) m[s] += r[s] / double(per_rank.size());
  return m;
}

}  // namespace primus::backends::cuda::testing
