// The cuda backend's side of `primus projection`: the memory of one rank, read from the memory
// plan's own sizing pass (MemoryPlan::sizes over memory_plan_options: the figures the model will
// allocate, not a second formula), plus what lives outside the model's arenas (the ZeRO-1
// optimizer shard, the data-parallel reducer's staging, the CUDA context and libraries).
#pragma once
#include <cstdint>

#include "backends/cuda/args.h"
#include "backends/cuda/hooks.h"
#include "backends/cuda/model.h"
#include "backends/cuda/model_options.h"
#include "train/projection.h"

namespace primus::backends::cuda {

// What the CUDA context and the libraries (cuBLASLt, cuDNN, NCCL's handles) hold beside the
// arenas: the device peak in use minus the arenas, 0.56 GiB for both GPT-2 (32 x 1024) and
// Llama-3.2-1B on an H100 and an H200 (docs/performance.md "Memory"). `--runtime-gib` states another.
inline constexpr double kRuntimeOverheadGiB = 0.56;

// query_device: a GPU is present, so the scratch's device-dependent borrows are sized exactly
// (MemoryPlanOptions::query_device); runtime_gib < 0: kRuntimeOverheadGiB.
train::MemoryProjection project_cuda_memory(const CudaArgs& args, const CudaOps& ops,
                                            const train::ProjectionLayout& layout, bool query_device,
                                            double runtime_gib = -1);

// The step's byte costs for `a`: `base` (AdamW 28 + the bf16 copy 2 + the grad norm 4 bytes a
// parameter), 2 fewer with split master weights (the bf16 copy is the masters' high halves), 4
// fewer with the optimizer in the backward (the norm summed inside the AdamW pass), and 2 fewer
// for each expert parameter with bf16 expert gradients.
train::StepCostOptions cuda_step_cost(const CudaArgs& a, train::StepCostOptions base);

// Registers project_cuda_memory as the cuda backend's train::MemoryProjector.
void register_cuda_projection();

}  // namespace primus::backends::cuda
