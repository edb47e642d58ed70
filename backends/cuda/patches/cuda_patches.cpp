// The CUDA backend's patches: the shared args patches (train/common_patches.cpp) under cuda.*
// ids, the MFU peak from the GPU model, the fallback and the deterministic attention, and FP8
// linear layers. The training step's patches are in step_patches.cpp.
#include <spdlog/spdlog.h>

#include "backends/cuda/args.h"
#include "backends/cuda/device.h"
#include "backends/cuda/hooks.h"
#include "backends/cuda/register.h"
#include "core/patches/context.h"
#include "core/patches/registry.h"
#include "core/util/error.h"
#include "train/common_patches.h"
#include "turbo/core/env_switch.h"
#include "turbo/dispatch/backend_manager.h"

namespace primus::backends::cuda {

void register_patches(patches::PatchRegistry& reg) {
  using patches::PatchContext;
  train::register_common_args_patches(reg, kName);

  reg.add({
      .id = "cuda.runtime.peak_flops",
      .description = "fills the MFU denominator (dense bf16 FLOP/s per GPU) from the GPU model when peak_flops is 0",
      .tags = {"runtime", "metrics"},
      .logic = "rewrites args: peak_flops = A100 312e12 | H100 SXM, H200, GH200 989e12 | H100 PCIe 756e12 | B200 2.25e15",
      .impl = "backends/cuda/device.cpp (peak_bf16_flops)",
      .porting = "MFU = model FLOPs per token (6N + attention) x tokens/s / this peak, as in the PaLM paper",
      .condition = [](PatchContext& c) { return c.number("peak_flops") <= 0; },
      .apply =
          [](PatchContext& c) {
            auto& a = c.args_as<CudaArgs>();
            a.peak_flops = peak_bf16_flops(a.device_name);
            // No device name: a plan without a device (a dry run, the projection), not an unknown GPU.
            if (a.peak_flops <= 0 && !a.device_name.empty()) {
              spdlog::warn("[cuda] no bf16 peak known for '{}': MFU is not reported (set peak_flops)", a.device_name);
            }
          },
  });

  reg.add({
      .id = "cuda.moe.sequential_experts",
      .description = "runs the MoE expert GEMMs as one cuBLASLt GEMM per expert instead of Turbo's grouped GEMM "
                     "(Megatron's moe_grouped_gemm: false), for A/B runs against the grouped kernel",
      .tags = {"moe", "debug"},
      .logic = "sets the grouped_gemm op's backend to CUBLASLT (turbo/ops/grouped_gemm.h): each expert's rows are a "
               "separate GEMM after the group offsets are copied to the host",
      .impl = "turbo/ops/grouped_gemm.cpp (the CUBLASLT backend)",
      .porting = "Megatron's SequentialMLP: a loop over the local experts",
      .condition = [](PatchContext& c) { return c.integer("num_experts") > 0 && !c.flag("moe_grouped_gemm", true); },
      .apply =
          [](PatchContext& c) {
            // The host read of the group sizes cannot be captured: the dispatcher would fall back to
            // the grouped kernel inside the graph, and the key would not do what it says.
            if (c.text("cuda_graph", "auto") != "false") {
              throw ConfigError("moe_grouped_gemm: false reads each routing's group sizes on the host, which a "
                                "captured step cannot do: set cuda_graph: false with it");
            }
            turbo::GlobalBackendManager::instance().set_backend("grouped_gemm", turbo::BackendType::CUBLASLT);
          },
  });

  reg.add({
      .id = "cuda.attention.fallback",
      .description = "runs attention as batched cuBLASLt GEMMs + a causal softmax kernel ([T,T] scores in scratch)",
      .tags = {"attention", "debug"},
      .slots = {kAttentionForward, kAttentionBackward},
      .impl = "turbo/ops/attention_fallback.cpp, turbo/kernels/cuda/attention_fallback.cu",
      .porting = "llm.c's non-cuDNN attention: permute to head-major, S = QK^T, softmax, O = PV; the backward "
                 "recomputes P from the saved log-sum-exp",
      .condition = [](PatchContext& c) { return c.text("attention_backend") == "fallback"; },
      .apply =
          [](PatchContext& c) {
            c.replace<AttentionForwardFn>(kAttentionForward, fallback_attention_forward);
            c.replace<AttentionBackwardFn>(kAttentionBackward, fallback_attention_backward);
          },
  });

  reg.add({
      .id = "cuda.attention.deterministic",
      .description = "deterministic attention backward: cuDNN's SDPA backward engine that writes dQ from its own "
                     "dP workspace instead of adding partial dQ tiles into an f32 buffer in a run-dependent order, so "
                     "two runs (and a resumed run) are bit-identical",
      .tags = {"attention", "reproducibility"},
      .slots = {kAttentionBackward},
      .logic = "replaces the attention backward slot with turbo::attention_backward with "
               "AttentionOptions::deterministic (the TURBO kernels decline it) and rewrites args: deterministic (the "
               "model reserves the dP workspace, batch x heads x seq_length^2 x 2 bytes, in its scratch)",
      .impl = "turbo/kernels/cudnn/sdpa_cudnn.cpp (build_backward without the dQ accumulator), backends/cuda/hooks.cpp",
      .porting = "cudnn-frontend's sdpa_backward set_deterministic_algorithm(true) (on Hopper: the dP-workspace "
                 "graph); Transformer Engine NVTE_ALLOW_NONDETERMINISTIC_ALGO=0; Megatron-LM --deterministic-mode",
      .condition =
          [](PatchContext& c) {
            return c.flag("deterministic") && c.text("attention_backend") != "fallback";  // the fallback is deterministic
          },
      .apply =
          [](PatchContext& c) {
            c.args_as<CudaArgs>().deterministic = true;
            c.replace<AttentionBackwardFn>(kAttentionBackward, deterministic_attention_backward());
          },
  });

  reg.add({
      .id = "cuda.linear.fp8",
      .description = "FP8 GEMMs for every linear layer inside the transformer layers (forward, input and weight "
                     "gradients) with current scaling per tensor, per row or per block, or delayed scaling from an "
                     "amax history (fp8_recipe); the output "
                     "layer, attention and norms stay bf16",
      .tags = {"performance", "gemm", "precision"},
      .slots = {kLinearForward, kLinearBackward, kLinearBackwardDGelu},
      .logic = "replaces the linear slots with turbo::linear_*_fp8 for the format in `fp8` (hybrid: E4M3 x and w, "
               "E5M2 dy; e4m3: E4M3 everywhere) and the scaling in `fp8_recipe` (tensorwise: one scale per tensor; "
               "rowwise: per row along K; blockwise: 1x128 activations and gradients, 128x128 weights; delayed: per "
               "tensor from the amax history, whose state the model holds; the first and "
               "last fp8_first_last_bf16_layers layers keep the bf16 slots) and rewrites "
               "args: fp8, fp8_recipe (the model reserves scratch for the quantized copies and their scales and "
               "checks that every linear dimension is a multiple of 16, of 128 for blockwise); with rowwise and "
               "tensorwise the SwiGLU kernels hand the maxima of what they write to the next quantization "
               "(one read instead of two; PRIMUS_CUDA_FP8_MAXIMA=0: off); with delayed the SwiGLU forward and "
               "backward are folded into the quantizers of the MLP linears that read their outputs (never "
               "written; PRIMUS_CUDA_FP8_SWIGLU_FOLD=0: off)",
      .impl = "turbo/ops/gemm_fp8.cpp (recipe, quantize-then-GEMM), turbo/ops/quantization.cpp + "
              "turbo/kernels/cuda/quantize.cu (amax and cast; SwiGLU folded in), turbo/kernels/cuda/activation.cu "
              "(SwiGLU with maxima), turbo/ops/fp8_delayed.cpp (amax histories), "
              "turbo/kernels/cublaslt/gemm_cublaslt.cpp (FP8 "
              "operands, scale pointers)",
      .porting = "Megatron-LM --fp8-format hybrid|e4m3 --fp8-recipe tensorwise|blockwise with Transformer Engine "
                 "(Float8CurrentScaling, Float8BlockScaling, DelayedScaling with --fp8-amax-history-len, "
                 "--fp8-amax-compute-algo, --fp8-margin); torchao float8 tensorwise / rowwise (TorchTitan "
                 "--float8.recipe_name rowwise); DeepSeek-V3's 1x128 / 128x128 blockwise; Primus (AMD) `fp8: hybrid`",
      .condition = [](PatchContext& c) { return c.text("fp8", "none") != "none"; },
      .apply =
          [](PatchContext& c) {
            const std::string name = c.text("fp8"), scaling = c.text("fp8_recipe", "tensorwise");
            const turbo::Fp8Recipe r = configure_fp8(c.args_as<CudaArgs>(), name, scaling);
            Fp8LinearFns f = fp8_linear_fns(r);
            c.replace<LinearForwardFn>(kLinearForward, std::move(f.forward));
            c.replace<LinearBackwardFn>(kLinearBackward, std::move(f.backward));
            c.replace<LinearBackwardDGeluFn>(kLinearBackwardDGelu, std::move(f.backward_dgelu));
          },
  });

  reg.add({
      .id = "cuda.moe.swiglu_epilogue",
      .description = "the MoE experts' SwiGLU in the grouped GEMMs' epilogues: the up projection writes act beside "
                     "gate|up, and the down projection's input gradient is written as d(gate|up), so act's gradient "
                     "is never stored and gate|up is not read again by a separate kernel; the same bits as the "
                     "activation kernels (PRIMUS_CUDA_MOE_SWIGLU_EPILOGUE=0 runs those)",
      .tags = {"performance", "moe"},
      .logic = "rewrites args: moe_swiglu_epilogue = true (CudaModelOptions::moe_swiglu_epilogue); the model uses it "
               "where moe_swiglu_epilogue_applies: bf16 experts (not cuda.moe.fp8), Turbo's grouped GEMM on an "
               "sm_90 device (not cuda.moe.sequential_experts) and moe_ffn_hidden_size a multiple of 128; host mode "
               "composes the product and the activation in the op",
      .impl = "turbo/kernels/cuda/grouped_gemm_sm90.cu (glu_forward_epilogue, glu_backward_epilogue), "
              "turbo/ops/grouped_gemm.cpp (swiglu_out, swiglu_inp), backends/cuda/model/decoder.cpp (moe_forward, "
              "moe_backward)",
      .porting = "Megatron-LM runs the experts' SwiGLU as a separate (bias_swiglu) fusion between its grouped GEMMs; "
                 "torch.compile fuses it with neighbouring pointwise ops, not into torch._grouped_mm",
      .condition =
          [](PatchContext& c) {
            return c.integer("num_experts") > 0 &&
                   turbo::env_choice("PRIMUS_CUDA_MOE_SWIGLU_EPILOGUE", {"0", "1"}, "1") == "1";
          },
      .apply = [](PatchContext& c) { c.args_as<CudaArgs>().moe_swiglu_epilogue = true; },
  });

  reg.add({
      .id = "cuda.moe.fp8",
      .description = "FP8 grouped GEMMs for the MoE experts (forward, input and weight gradients) with current "
                     "tensorwise, rowwise or blockwise scaling or delayed scaling (fp8_recipe), in the format of `fp8`",
      .tags = {"performance", "gemm", "precision", "moe"},
      .slots = {kMoeExperts, kMoeExpertsDgrad, kMoeExpertsWgrad},
      .logic = "replaces the expert slots with turbo::grouped_gemm_*_fp8: each operand quantized right before its "
               "GEMM with one scale per row along the reduction (tokens and expert output features in the forward, "
               "expert input features in the input gradient, features per expert over that expert's tokens in the "
               "weight gradient), or blockwise (DeepSeek-V3: 1x128 tiles of the tokens along the reduction, 128x128 "
               "blocks of the weights, each 128-element k-tile's partial product scaled on its own; groups padded to "
               "128 rows), or tensorwise (Primus-Turbo's tensorwise grouped GEMM: one scale for x, one for dy, both "
               "from the row plan's rows only, one for all experts' weights, run as the rowwise product with the scale "
               "in every entry), or delayed (the tensorwise products with scales from amax histories of each expert "
               "weight's x, w and dy, kept with the linear layers' in cuda.linear.fp8's state), hybrid: E4M3 x and w, "
               "E5M2 dy; under gradient accumulation each expert weight is "
               "quantized once per optimizer step into the step copies of cuda.linear.fp8 (both layouts); the first and "
               "last fp8_first_last_bf16_layers layers keep bf16 experts (the model reserves scratch for the copies "
               "and needs the expert widths to be multiples of 16, blockwise 128)",
      .impl = "turbo/ops/grouped_gemm_fp8.cpp (quantize-then-GEMM), turbo/kernels/cuda/grouped_gemm_sm90.cu (the "
              "grouped kernel on FP8 operands, m64nNk32 wgmma), turbo/kernels/cuda/quantize.cu (row, per-group "
              "column and block scales)",
      .porting = "torchao's rowwise float8 MoE training (_scaled_grouped_mm, TorchTitan --float8.moe_fqns_prototype); "
                 "Megatron-LM --fp8-format with --moe-grouped-gemm (Transformer Engine's grouped linear), "
                 "--fp8-recipe blockwise; DeepGEMM's m-grouped contiguous FP8 GEMM (groups aligned to 128)",
      .condition = [](PatchContext& c) { return c.text("fp8", "none") != "none" && c.integer("num_experts") > 0; },
      .apply =
          [](PatchContext& c) {
            // (fp8 with moe_grouped_gemm false is refused by the cuda adapter's checks)
            turbo::Fp8Recipe r =
                turbo::parse_fp8_recipe(c.text("fp8"), c.text("fp8_recipe", "tensorwise"), "fp8", "fp8_recipe");
            // The step's weight copies and the delayed-scaling histories that cuda.linear.fp8 (applied
            // before) made: the model registers the experts' slots and histories in them.
            r.weights = c.args_as<CudaArgs>().fp8_weights;
            r.delayed = c.args_as<CudaArgs>().fp8_delayed;
            Fp8MoeFns f = fp8_moe_fns(r);
            c.replace<MoeExpertsFn>(kMoeExperts, std::move(f.forward));
            c.replace<MoeExpertsDgradFn>(kMoeExpertsDgrad, std::move(f.dgrad));
            c.replace<MoeExpertsWgradFn>(kMoeExpertsWgrad, std::move(f.wgrad));
          },
  });

  register_step_patches(reg);
}

}  // namespace primus::backends::cuda
