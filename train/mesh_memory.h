// The memory per rank a mesh layout implies, for planning a job before any backend can run it
// (the dry run prints it under the mesh). Analytical, by Megatron-LM's accounting, for mixed
// precision training as the cuda backend does it: bf16 weights for compute, fp32 master weights,
// fp32 gradients and AdamW's two fp32 moments (18 bytes a parameter unsharded), and bf16
// activations kept for the backward with flash attention (no score matrix).
//
// - Tensor parallelism divides every split tensor by tp (train/tensor_parallel.h's split; norms
//   replicated); without sequence parallelism the hidden-sized activations (layer input, norm
//   outputs, residual) stay whole on every tp rank, with it they are divided by tp too.
// - Context parallelism divides every activation by cp (each rank holds seq_length / cp tokens).
// - Expert parallelism divides the routed experts' weights by ep (each rank holds num_experts / ep
//   of every MoE layer's); the activations of the experts a rank runs are counted as its own
//   tokens' (balanced routing).
// - The sharding strategy divides, over the dp x cp ranks (Megatron's distributed optimizer
//   shards over the data-parallel group with context parallelism folded in): optim the master
//   weights and moments; optim_grads also the gradients (plus one layer's whole gradient, reduced
//   as its backward ends); optim_grads_params also the bf16 weights (plus one layer gathered).
//
// What it leaves out: the CUDA context, workspaces, communication buffers, fragmentation, and the
// transient buffers of one layer's forward; `primus projection memory` sizes a one-GPU plan
// exactly.
#pragma once
#include <cstdint>
#include <string>

#include "parallel/parallel_dims.h"
#include "train/model_spec.h"

namespace primus::train {

struct MeshMemory {
  int64_t parameters_per_rank = 0;  // after tensor parallelism (before data-parallel sharding)
  double weights = 0, master = 0, gradients = 0, optimizer = 0, activations = 0, logits = 0;  // bytes
  double total() const { return weights + master + gradients + optimizer + activations + logits; }
};

// `sizes` with dp set (ParallelSizes::for_world); micro_batch sequences of seq_length tokens.
MeshMemory mesh_memory_per_rank(const ModelSpec& m, const parallel::ParallelSizes& sizes, int64_t micro_batch,
                                int64_t seq_length);

// "  memory per rank (analytical: ...): weights 1.88 GiB, ..., total 19.4 GiB\n"
std::string describe_mesh_memory(const ModelSpec& m, const parallel::ParallelSizes& sizes, int64_t micro_batch,
                                 int64_t seq_length);

}  // namespace primus::train
