// FP8 linear layers under the cuda backend's sharded data parallelism (optim_grads,
// optim_grads_params), through the trainer in host mode: two processes against one.
#include <gtest/gtest.h>

#include <string>

#include "tests/cuda_gpu/two_processes.h"

namespace primus::backends::cuda {
namespace {

TEST(CudaHostTrainerFp8, ShardedDataParallelTwoProcessesTrainAsOne) {
  for (const std::string recipe : {"fp8: hybrid\n", "fp8: e4m3\n      fp8_recipe: rowwise\n"}) {
    testing::TwoProcesses t("      " + recipe);
    for (const std::string strategy : {"optim_grads", "optim_grads_params"})
      t.expect_matches("fp8_dp2_" + strategy, "data_parallel_sharding_strategy=" + strategy,
                       "data_parallel_sharding_strategy " + strategy);
  }
}

}  // namespace
}  // namespace primus::backends::cuda
