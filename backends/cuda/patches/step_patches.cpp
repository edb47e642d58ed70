// The training step's optional machinery, each switched on by its config key: CUDA-graph
// capture, launch-ahead, cuBLASLt's algorithm search, activation recomputation and the per-phase
// GPU profile.
// With PRIMUS_PATCHES=none the keys are still validated (adapter.cpp) but the step runs
// eagerly, takes cuBLASLt's heuristic algorithms, keeps every activation and is not profiled.
#include <fmt/format.h>

#include <limits>

#include "backends/cuda/args.h"
#include "backends/cuda/hooks.h"
#include "backends/cuda/profile.h"
#include "backends/cuda/register.h"
#include "backends/cuda/step_graph.h"
#include "core/patches/context.h"
#include "core/patches/registry.h"

namespace primus::backends::cuda {

void register_step_patches(patches::PatchRegistry& reg) {
  using patches::PatchContext;

  reg.add({
      .id = "cuda.step.cuda_graph",
      .description = "captures the whole training step (forward, backward, clip, AdamW) as one CUDA graph after a "
                     "warm-up step and replays it: one launch per step instead of ~400",
      .tags = {"performance", "step"},
      .logic = "rewrites args: cuda_graph = true (the trainer's StepGraph captures step 2 and replays it); from "
               "cuda_graph: auto (the default) also cuda_graph_auto, so that a run that cannot be captured (several "
               "data-parallel ranks) steps eagerly instead of failing",
      .impl = "backends/cuda/step_graph.cpp, backends/cuda/trainer.cpp (train_step / step_body)",
      .porting = "torch.cuda.graphs / CUDAGraph: every per-step input in static device buffers (token batches, the "
                 "learning rate and bias corrections), no host sync inside the step (the non-finite check runs on "
                 "the device and vetoes AdamW through a NaN clip factor), workspaces and plans created in a warm-up",
      .condition =
          [](PatchContext& c) {
            const config::Value* v = c.get("cuda_graph");
            return v && parse_cuda_graph(*v) != GraphMode::Off;
          },
      .apply =
          [](PatchContext& c) {
            auto& a = c.args_as<CudaArgs>();
            a.cuda_graph = true;
            a.cuda_graph_auto = parse_cuda_graph(*c.get("cuda_graph")) == GraphMode::Auto;
          },
  });

  reg.add({
      .id = "cuda.step.launch_ahead",
      .description = "launch-ahead: step s + 1 is staged and queued before step s's loss and grad norm are read, so "
                     "the device runs steps back to back while the host logs and stages the next batches (+1.1% "
                     "tokens/s for GPT-2 124M on tinyshakespeare, +0.3% on mock data, H200); same losses bit for bit",
      .tags = {"performance", "step"},
      .logic = "rewrites args: launch_ahead = true (the trainer gives the step loop launch / finish hooks; "
               "train/step_loop.h does not run ahead where the state after step s is evaluated or saved, and lets "
               "the step in flight finish before a signal's checkpoint). Off with data parallelism or the profiler",
      .impl = "train/step_loop.cpp (run_step_loop), backends/cuda/trainer.cpp (launch_step / finish_step), "
              "backends/cuda/model/host_staging.cpp (two sets of pinned staging buffers, one status copy per ticket)",
      .porting = "the usual asynchronous training loop of PyTorch trainers that do not call .item() every step "
                 "(the loss read one step late); here the loop keeps the host's view exact at evaluations, "
                 "checkpoints, NaN stops and signals",
      .condition = [](PatchContext& c) { return c.flag("launch_ahead"); },
      .apply = [](PatchContext& c) { c.args_as<CudaArgs>().launch_ahead = true; },
  });

  reg.add({
      .id = "cuda.gemm.algo_search",
      .description = "cuBLASLt algorithm search: the top k heuristic candidates of each GEMM shape timed at its "
                     "first call, the fastest kept and saved in a per-machine cache file (cublaslt_algos.json) that "
                     "later runs and resumes reuse instead of timing again (+1.3..2.1% tokens/s for GPT-2 124M on "
                     "an H100)",
      .tags = {"performance", "gemm"},
      .logic = "rewrites args: gemm_algo_search = k (the trainer calls turbo::cublaslt::set_algo_search(k) unless "
               "PRIMUS_TURBO_CUBLASLT_ALGO_SEARCH is set)",
      .impl = "turbo/kernels/cublaslt/gemm_cublaslt.cpp (choose_algo, search_algo), "
              "turbo/kernels/cublaslt/algo_cache.cpp (the file), backends/cuda/trainer.cpp (init)",
      .porting = "torch.backends.cuda.matmul / TORCH_BLAS_PREFER_CUBLASLT with tunable ops "
                 "(PYTORCH_TUNABLEOP_ENABLED=1, results in tunableop_results*.csv): time candidates per shape once, "
                 "keep the winners in a file keyed by device and library version",
      .condition = [](PatchContext& c) { return c.integer("gemm_algo_search") > 1; },
      .apply =
          [](PatchContext& c) {
            c.args_as<CudaArgs>().gemm_algo_search = static_cast<int>(c.integer("gemm_algo_search"));
          },
  });

  reg.add({
      .id = "cuda.memory.recompute",
      .description = "activation recomputation: norms (the two norm outputs recomputed in the backward), selective "
                     "(norms and MLP activation) or full (only each layer's input kept, the layer's forward rerun in "
                     "the backward; recompute_method block with recompute_num_layers N: the first N layers only)",
      .tags = {"memory"},
      .slots = {kRecomputePolicy},
      .impl = "backends/cuda/model/memory_plan.cpp (plan: per-layer buffers vs the shared set), backends/cuda/model/decoder.cpp (recompute_layer)",
      .porting = "Megatron-LM --recompute-granularity / TorchTitan activation checkpointing; here per layer, decided "
                 "when the memory plan is made, so the arenas shrink (no allocation at run time)",
      .condition = [](PatchContext& c) { return c.text("recompute_granularity", "none") != "none"; },
      .apply =
          [](PatchContext& c) {
            const Recompute r = parse_recompute(c.text("recompute_granularity"), "recompute_granularity");
            // recompute_method block N: the first N layers only (Megatron-LM's).
            const int64_t n = recompute_layers([&](const std::string& k) { return c.get(k); });
            c.replace<RecomputePolicyFn>(kRecomputePolicy, [r, n](int64_t layer, int64_t) {
              return n < 0 || layer < n ? r : Recompute::None;
            });
          },
  });

  reg.add({
      .id = "cuda.optimizer.in_backward",
      .description = "the optimizer in the backward: each layer's AdamW runs as soon as its gradients are final, and "
                     "the layers share one gradient buffer of the largest layer's size, so the gradients take a "
                     "layer's memory instead of the model's (olmoe-mini: 2.3 instead of 13.3 GiB); one micro-batch "
                     "per step, no gradient clipping; beside data or context parallelism each layer's gradients are "
                     "averaged over the ranks while the layer below runs its backward (two windows)",
      .tags = {"memory", "optimizer"},
      .logic = "rewrites args: optimizer_in_bwd = true (CudaModelOptions::optimizer_in_backward: the memory plan's "
               "shared gradient window, AdamW per group from the decoder's gradients-ready reports, the non-finite "
               "check per group; beside dp or cp the mean per group over the dp x cp ranks on the group's stream, the "
               "update one group later); the trainer refuses it with clip_grad > 0, grad accumulation, ZeRO-1 or "
               "sharded data parallelism",
      .impl = "backends/cuda/model/optimizer_state.cpp (backward_ready), backends/cuda/model/grad_placement.cpp, "
              "turbo/kernels/cuda/step_check.cu (step_check_group)",
      .porting = "torchtune's optimizer_in_bwd (PyTorch's register_post_accumulate_grad_hook running the optimizer "
                 "per parameter); Megatron-LM has no equivalent",
      .condition = [](PatchContext& c) { return c.flag("optimizer_in_bwd"); },
      .apply = [](PatchContext& c) { c.args_as<CudaArgs>().optimizer_in_bwd = true; },
  });

  reg.add({
      .id = "cuda.moe.bf16_expert_grads",
      .description = "the MoE experts' weight gradients in bf16: the grouped weight-gradient GEMM rounds its f32 sums "
                     "to bf16 once and AdamW reads them widened (what torch's autocast gives its fp32 master weights), "
                     "half the gradient bytes written and read; with the optimizer in the backward only",
      .tags = {"moe", "optimizer"},
      .logic = "rewrites args: bf16_expert_grads = true (CudaModelOptions::bf16_expert_grads: GradPlacement::bf16 marks "
               "the experts' places, the decoder's dweight views and AdamW's tables read them as bf16); the trainer "
               "refuses it without optimizer_in_bwd, with fp8 experts and in host mode",
      .impl = "backends/cuda/model/grad_placement.cpp (grad_view), turbo/kernels/cuda/grouped_gemm_sm90.cu (d_bf16), "
              "turbo/kernels/cuda/optimizer.cu (grad_bf16 per tensor)",
      .porting = "torch.autocast's bf16 weight gradients (the fp32 parameter's grad is the bf16 GEMM output widened); "
                 "Megatron-LM keeps fp32 main_grad",
      .condition = [](PatchContext& c) { return c.text("moe_expert_grad_dtype", "fp32") == "bf16"; },
      .apply = [](PatchContext& c) { c.args_as<CudaArgs>().bf16_expert_grads = true; },
  });

  reg.add({
      .id = "cuda.grad.unfused_accumulation",
      .description = "gradient_accumulation_fusion: false: each linear layer's weight gradient (the transformer "
                     "layers', the MoE experts', the output layer's) is its own product, rounded to the weights' dtype "
                     "and then added to the fp32 gradient, as Megatron-LM computes it without its fused "
                     "weight-gradient kernel",
      .tags = {"precision", "megatron"},
      .logic = "rewrites args: unfused_wgrad = true (CudaModelOptions::unfused_wgrad): the decoder runs each "
               "weight-gradient GEMM (any slot: bf16, FP8, grouped) into f32 scratch with beta 0, then "
               "turbo::add_gradient rounds it to the weights' dtype (bf16; f32 in host mode) and writes or adds it; "
               "the output layer's row blocks sum in the scratch first; the memory plan's scratch grows by the "
               "largest weight in f32; bf16 expert gradients (written once by the GEMM) are unchanged",
      .impl = "backends/cuda/model/decoder.cpp (weight_grad), turbo/ops/cast.cpp (add_gradient), "
              "turbo/kernels/cuda/elementwise.cu (add_gradient_kernel)",
      .porting = "Megatron-LM --no-gradient-accumulation-fusion: the weight gradient in the parameter's dtype, then "
                 "main_grad.add_ in the DDP hook (with fusion, APEX's or Transformer Engine's wgrad GEMM accumulates "
                 "into main_grad in fp32)",
      .condition = [](PatchContext& c) { return !c.flag("gradient_accumulation_fusion", true); },
      .apply = [](PatchContext& c) { c.args_as<CudaArgs>().unfused_wgrad = true; },
  });

  reg.add({
      .id = "cuda.optimizer.split_master",
      .description = "the fp32 master weights held split: the bf16 compute weights are their high halves and a 16-bit "
                     "buffer their low halves, so the master takes 2 bytes a parameter beside the weights instead of 4 "
                     "and AdamW writes no separate bf16 copy (2 of its ~30 bytes a parameter); the same fp32 values, "
                     "the bf16 weights rounded with ties away from zero",
      .tags = {"memory", "optimizer"},
      .logic = "rewrites args: split_master = true (CudaModelOptions::split_master: the memory plan's u16 master "
               "buffer, AdamW's split tables, set_params / get_params splitting and joining on the host); the "
               "trainer refuses it in host mode, with ZeRO-1, sharded data parallelism and Muon",
      .impl = "turbo/kernels/cuda/optimizer.cu (adamw_chunk<kSplit>), turbo/core/dtype.h (split_f32_hi / lo, "
              "join_f32), backends/cuda/model/optimizer_state.cpp",
      .porting = "no Megatron-LM or torch equivalent keeps the fp32 master exactly in 2 extra bytes; Megatron's "
                 "precision-aware optimizer (main_params_dtype: fp16) and bf16 master weights change the values",
      .condition = [](PatchContext& c) { return c.text("master_weights", "fp32") == "split"; },
      .apply = [](PatchContext& c) { c.args_as<CudaArgs>().split_master = true; },
  });

  reg.add({
      .id = "cuda.profile.phase_times",
      .description = "times each phase of the step (embedding, norms, GEMMs, attention, loss, their backward, grad "
                     "norm, AdamW) with CUDA events; table at the end of training and profile.json in the output folder",
      .tags = {"profiling", "debug"},
      .logic = "rewrites args: profile_steps = profile_steps, or every step when PRIMUS_CUDA_PROFILE=1",
      .impl = "backends/cuda/profile.cpp (StepProfiler), marks in backends/cuda/model/decoder.cpp and backends/cuda/model.cpp",
      .porting = "torch.cuda.Event(enable_timing=True) pairs around each region, read after the step's sync; under a "
                 "CUDA graph the events are captured as external event nodes",
      .condition = [](PatchContext& c) { return c.integer("profile_steps") > 0 || profile_env_steps() > 0; },
      .apply =
          [](PatchContext& c) {
            const int64_t n = c.integer("profile_steps");
            c.args_as<CudaArgs>().profile_steps = n > 0 ? n : profile_env_steps();
          },
  });
}

}  // namespace primus::backends::cuda
