// The parity runs' recipe, and N ranks of a test as threads of this process over one ThreadedGroup (parallel/
// threaded_process_group.h): each runs rank_main(r, its group) and the first failure is rethrown
// once all have ended. ops: the group's memory operations (DeviceMemoryOps::factory(device) for
// device buffers; empty: host memory). Shared by the tensor-, context- and sharded-data-parallel
// parity runs.
#pragma once
#include <gtest/gtest.h>

#include <algorithm>
#include <chrono>
#include <cmath>
#include <exception>
#include <functional>
#include <memory>
#include <string>
#include <thread>
#include <vector>

#include "parallel/threaded_process_group.h"
#include "turbo/ops/optimizer.h"

namespace primus::backends::cuda::testing {

// The parity runs' AdamW recipe (the trainers' defaults at a small learning rate) for step s.
inline turbo::AdamWHyper parity_hyper(int s) {
  turbo::AdamWHyper hp;
  hp.lr = 1e-3f, hp.beta1 = 0.9f, hp.beta2 = 0.99f, hp.eps = 1e-8f, hp.weight_decay = 0.1f;
  hp.step = s + 1;
  return hp;
}

// The fp32 gate of the host parity runs (DESIGN.md): at every step every rank's gradient norm (and
// with same_loss its loss) equals rank 0's, and rank 0's norm and loss (with same_loss; else the
// ranks' mean loss, each rank its own tokens) are within 1e-5 relative of the reference's. The
// worst relative gaps come back for the test's summary line.
struct Fp32Steps {
  double worst_loss = 0, worst_norm = 0;
};
inline Fp32Steps expect_fp32_steps(const std::vector<double>& ref_loss, const std::vector<double>& ref_norm,
                                   const std::vector<std::vector<double>>& loss,
                                   const std::vector<std::vector<double>>& norm, bool same_loss) {
  Fp32Steps w;
  for (size_t s = 0; s < ref_loss.size(); ++s) {
    double mean = 0;
    for (size_t r = 0; r < loss.size(); ++r) {
      if (same_loss) EXPECT_EQ(loss[r][s], loss[0][s]) << "rank " << r << " step " << s << ": every rank's loss";
      EXPECT_EQ(norm[r][s], norm[0][s]) << "rank " << r << " step " << s << ": one global norm";
      mean += loss[r][s] / static_cast<double>(loss.size());
    }
    const double l = same_loss ? loss[0][s] : mean;
    const double dl = std::fabs(l - ref_loss[s]) / ref_loss[s], dn = std::fabs(norm[0][s] - ref_norm[s]) / ref_norm[s];
    w.worst_loss = std::max(w.worst_loss, dl);
    w.worst_norm = std::max(w.worst_norm, dn);
    EXPECT_LT(dl, 1e-5) << "step " << s << ": loss " << l << " vs " << ref_loss[s];
    EXPECT_LT(dn, 1e-5) << "step " << s << ": grad norm " << norm[0][s] << " vs " << ref_norm[s];
  }
  return w;
}

inline void run_threaded_ranks(int n, const parallel::ThreadedGroup::OpsFactory& ops, const std::string& name,
                               const std::function<void(int, parallel::ProcessGroup*)>& rank_main) {
  auto hub = parallel::ThreadedGroup::create(n, std::chrono::seconds(120), ops, name);
  std::vector<std::exception_ptr> errors(static_cast<size_t>(n));
  std::vector<std::thread> ranks;
  for (int r = 0; r < n; ++r) {
    ranks.emplace_back([&, r] {
      try {
        std::unique_ptr<parallel::ProcessGroup> pg = hub->rank(r);
        rank_main(r, pg.get());
      } catch (...) {
        errors[static_cast<size_t>(r)] = std::current_exception();
      }
    });
  }
  for (auto& t : ranks) t.join();
  for (auto& e : errors)
    if (e) std::rethrow_exception(e);
}

}  // namespace primus::backends::cuda::testing
