// The parity runs' recipe, and N ranks of a test as threads of this process over one ThreadedGroup (parallel/
// threaded_process_group.h): each runs rank_main(r, its group) and the first failure is rethrown
// once all have ended. ops: the group's memory operations (DeviceMemoryOps::factory(device) for
// device buffers; empty: host memory). Shared by the tensor-, context- and sharded-data-parallel
// parity runs.
#pragma once
#include <chrono>
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
