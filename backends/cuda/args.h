// The CUDA backend's typed args, built from the validated module config; build_args patches
// (backends/cuda/patches/) rewrite them before the trainer is created.
#pragma once
#include <memory>
#include <string>

#include "backends/cuda/profile_window.h"
#include "backends/cuda/turbo_keys.h"
#include "core/backend/backend.h"
#include "core/config/schema.h"
#include "core/config/value.h"
#include "parallel/parallel_dims.h"
#include "train/common_patches.h"
#include "train/model_spec.h"
#include "train/training_args.h"

namespace primus::turbo {
class Fp8DelayedScaling;  // turbo/ops/fp8_delayed.h
class Fp8SavedInputs;     // turbo/ops/gemm_fp8.h
class Fp8WeightCache;     // turbo/ops/gemm_fp8.h
class Fp8Maxima;          // turbo/ops/gemm_fp8.h
class Fp8Producers;       // turbo/ops/gemm_fp8.h
}

namespace primus::backends::cuda {

// The mesh this backend runs: tensor (and sequence) parallelism, context parallelism and data
// parallelism (plain, ZeRO-1, optim_grads, optim_grads_params), in any combination; expert
// parallelism beside data parallelism (any strategy) and context parallelism (model/ep_comm.h).
inline constexpr parallel::MeshSupport kCudaMesh{"the cuda backend", true, true, true, true};

struct CudaArgs : BackendArgs, train::HasTrainingArgs {
  train::ModelSpec model;
  train::TrainingArgs train;
  int device = 0;                          // CUDA device index
  std::string attention_backend = "auto";  // auto | turbo | fallback (which slot default; see hooks.h)
  int64_t recompute_layers = -1;           // recompute_method block: the first N layers (hooks.h); -1: every layer
  TurboSelection turbo;                    // Primus-Turbo's backend keys (turbo_keys.h), applied at init
  double peak_flops = 0;                   // dense bf16 FLOP/s per GPU for MFU; 0: unknown (no MFU)
  std::string device_name;                 // filled by prepare()
  // Data parallelism (data_parallel.h), across the ranks of a launched job.
  bool use_distributed_optimizer = false;  // ZeRO-1
  int64_t ddp_bucket_size = 6'553'600;     // gradient elements per reduction bucket (ddp_bucket_size_mb)
  bool overlap_grad_reduce = true;         // launch buckets during the backward
  bool grad_reduce_in_bf16 = false;        // reduce buckets in bf16 instead of fp32
  // Set by the patches of the same names' keys (backends/cuda/patches/step_patches.cpp).
  bool cuda_graph = false;                 // capture the step after a warm-up step (step_graph.h)
  bool cuda_graph_auto = false;            // cuda_graph came from `auto`: check_graph_config runs such a
                                           // step eagerly where it cannot be captured instead of failing
  int gemm_algo_search = 1;                // cuBLASLt candidates timed per GEMM shape; 1: heuristic
                                           // (turbo/kernels/cublaslt/gemm_cublaslt.h, set_algo_search)
  bool deterministic = false;              // bit-identical runs: the attention backward without atomics
                                           // (patch cuda.attention.deterministic)
  std::string fp8 = "none";                // FP8 format of the transformer layers' linear GEMMs (none |
                                           // hybrid | e4m3; patch cuda.linear.fp8, turbo/ops/gemm_fp8.h)
  std::string fp8_recipe = "tensorwise";   // its scaling: tensorwise | rowwise | blockwise | delayed (same patch)
  // fp8_recipe delayed: the amax history (turbo/ops/fp8_delayed.h), and the state the patch makes
  // for the FP8 linear slots and the model to share (null otherwise).
  int64_t fp8_amax_history_len = 1;
  std::string fp8_amax_compute_algo = "most_recent";
  int64_t fp8_margin = 0;
  std::shared_ptr<turbo::Fp8DelayedScaling> fp8_delayed;
  // With fp8: the registry of the linear inputs kept in FP8 for the backward (CudaModelOptions::fp8_saved).
  std::shared_ptr<turbo::Fp8SavedInputs> fp8_saved;
  // With fp8: the registry of the weights quantized once per step (CudaModelOptions::fp8_weights).
  std::shared_ptr<turbo::Fp8WeightCache> fp8_weights;
  // With fp8_recipe rowwise or tensorwise: the SwiGLU kernels' maxima for the next quantization
  // (CudaModelOptions::fp8_maxima).
  std::shared_ptr<turbo::Fp8Maxima> fp8_maxima;
  // With fp8_recipe delayed: the SwiGLU activation folded into its quantizations
  // (CudaModelOptions::fp8_producers).
  std::shared_ptr<turbo::Fp8Producers> fp8_producers;
  int64_t fp8_first_last_bf16_layers = 0;  // with fp8: edge layers kept in bf16 (DecoderOptions)
  ProfileWindowArgs profile_window;       // profile, profile_step_start / _end, profile_ranks (profile_window.h)
  int64_t profile_steps = 0;               // steps of per-phase GPU timing after the warm-up (profile.h)
  bool launch_ahead = false;               // queue step s + 1 before reading step s (patch cuda.step.launch_ahead)
  bool optimizer_in_bwd = false;           // AdamW per layer inside the backward (patch cuda.optimizer.in_backward)
  bool bf16_expert_grads = false;          // moe_expert_grad_dtype: bf16 (patch cuda.moe.bf16_expert_grads)
  bool unfused_wgrad = false;              // gradient_accumulation_fusion: false (patch cuda.grad.unfused_accumulation)
  bool no_fp8_weight_transpose_cache = false;  // Primus' switch: FP8 weight copies without their transposes
  bool moe_swiglu_epilogue = false;        // the experts' SwiGLU in the GEMM epilogues (patch cuda.moe.swiglu_epilogue)
  double moe_ep_buffer_factor = 2.0;       // expert parallelism's held buffers (CudaModelOptions::ep_buffer_factor)
  bool split_master = false;               // master_weights: split (patch cuda.optimizer.split_master)
  bool host_mode = false;                  // not a config key: tests run the trainer on Turbo's CPU
                                           // backends (fp32, no GPU; see CudaModelOptions::device)
  config::Value params;                    // the resolved config, saved with checkpoints
  std::string experiment_file;

  train::TrainingArgs& training() override { return train; }
  std::vector<std::pair<std::string, std::string>> describe() const override;
};

// The keys this backend adds to the shared model and training keys.
void add_cuda_schema(config::Schema& s);

// Where ZeRO-1 (use_distributed_optimizer / data_parallel_sharding_strategy optim) runs. Plain data
// parallelism on GPUs: the bucketed reducer (parallel/cuda/grad_reducer.h), which shards flat
// buckets of the whole replica. Beside tensor, context or expert parallelism, and in host mode: the
// model's sharded data parallelism (model/fsdp.h) with the gradients whole, over dp x cp, where the
// tp ranks' partial gradients, replicated rows and norm (and the ep means) are already handled.
// True for the latter.
bool zero1_in_model(const CudaArgs& a);

}  // namespace primus::backends::cuda
