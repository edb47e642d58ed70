// FP8 linear layers under the cuda backend's sharded data parallelism (optim in host mode,
// optim_grads, optim_grads_params), and delayed scaling under tensor, context and sharded data parallelism,
// through the trainer in host mode: two processes against one.
#include <gtest/gtest.h>

#include <string>
#include <tuple>

#include "tests/cuda_gpu/two_processes.h"

namespace primus::backends::cuda {
namespace {

// The gate is 1e-4 relative, not fp32's 1e-5: the two runs' sums are not in the same order (the
// loss over ranks against over micro-batches, which already parts step 1's loss by an ulp; the
// gradients summed over ranks after their GEMMs against a second micro-batch's GEMM accumulating
// into the first's), and FP8's scales turn such last-bit differences into a flipped quantized
// value here and there. Rowwise, whose scales follow each row, parted by 1.3e-5 relative at step
// 6 on an AMD EPYC host (OpenBLAS picks its kernels by CPU; 2.4e-7 absolute at steps 1-3, before
// a flipped value grew); tensorwise by at most 2.4e-7 absolute.
TEST(CudaHostTrainerFp8, ShardedDataParallelTwoProcessesTrainAsOne) {
  for (const std::string recipe : {"fp8: hybrid\n", "fp8: e4m3\n      fp8_recipe: rowwise\n"}) {
    testing::TwoProcesses t("      " + recipe);
    for (const std::string strategy : {"optim", "optim_grads", "optim_grads_params"})
      t.expect_matches("fp8_dp2_" + strategy, "data_parallel_sharding_strategy=" + strategy,
                       "data_parallel_sharding_strategy " + strategy, 1e-4);
  }
}

// fp8_recipe delayed: each rank records the amaxes of its own part of the tensors: its samples
// (sharded data parallelism), its tokens (context), its slices of the weights and of x or dy
// (tensor). Their max over the group is one process's amax, so every rank keeps one process's
// histories and quantizes its part with one process's scale.
// - Sharded: each rank's micro-batch is one of one process's, so the losses are one process's.
// - Tensor and context: the first step has no history yet and runs current scaling over each
//   rank's own part, as tensorwise does under these layouts, so the runs part from one process's
//   by FP8's rounding (at worst 2.2e-4 relative for tp2, 7.5e-5 for cp2 here; tensorwise's are of
//   the same size); the gate is 3e-3. What the
//   reduction guarantees is shown by a resume: both ranks continue from rank 0's saved histories
//   and give the uninterrupted run's losses bit for bit. Without the reduction rank 1's histories
//   are its own and the resumed run parts from it (as it does when tp2 checkpoints leave the
//   histories out).
TEST(CudaHostTrainerFp8, DelayedScalingOverTensorContextAndShardedRanks) {
  testing::TwoProcesses t("      fp8: hybrid\n      fp8_recipe: delayed\n      fp8_amax_history_len: 4\n"
                          "      fp8_amax_compute_algo: max\n");
  t.expect_matches("delayed_fsdp2", "data_parallel_sharding_strategy=optim_grads_params",
                   "data_parallel_sharding_strategy optim_grads_params");
  for (const auto& [name, keys, banner] :
       {std::tuple<std::string, std::string, std::string>{"delayed_tp2", "tensor_model_parallel_size=2", "tensor parallel over 2 ranks"},
        {"delayed_tp2sp", "tensor_model_parallel_size=2 sequence_parallel=true", "tensor parallel over 2 ranks"},
        {"delayed_cp2", "context_parallel_size=2", "context parallel over 2 ranks"}}) {
    t.expect_matches(name, keys, banner, 3e-3);
    t.expect_resumes_exactly(name, keys);
  }
}

}  // namespace
}  // namespace primus::backends::cuda
