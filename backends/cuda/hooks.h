// The CUDA backend's replaceable parts: one HookTable slot per op family the model calls, with
// Turbo's ops as defaults. Patches (backends/cuda/patches/) replace or wrap a slot; the model
// reads the slots once, when the trainer is created, into a CudaOps (plain std::functions).
//
// Every tensor is a device TensorView (turbo/core/tensor_view.h); activations and weights are
// bf16, statistics, losses and parameter gradients f32. Shapes are those of the Turbo op each
// default forwards to (turbo/ops/*.h), restated where the slot has its own argument struct.
#pragma once
#include <functional>
#include <string>

#include "core/config/value.h"
#include "core/patches/hook_table.h"
#include "turbo/core/tensor_view.h"
#include "turbo/ops/exec_context.h"
#include "turbo/ops/gemm_fp8.h"
#include "turbo/ops/grouped_gemm.h"
#include "turbo/ops/loss.h"
#include "turbo/ops/moe.h"
#include "turbo/ops/normalization.h"
#include "turbo/ops/optimizer.h"

namespace primus::backends::cuda {

using turbo::ExecContext;
using turbo::TensorView;

// Causal self-attention. q/out [B,T,H,D], k/v [B,T,KVH,D] (H a multiple of KVH), lse [B,H,T]
// f32 = log-sum-exp of each query's scaled scores (natural log), saved for the backward.
struct AttentionCall {
  TensorView out, lse, q, k, v;
  float scale = 0.0f;  // multiplies q.k (1/sqrt(D))
  // false: every query sees every key (context parallelism's earlier key chunks); the fallback
  // slots serve causal calls only.
  bool causal = true;
  // turbo::AttentionOptions' sliding window (0: none) and packed documents (undefined: none).
  int64_t window = 0;
  TensorView cu_seqlens;
  ExecContext ctx;
};
// The backward overwrites dq, dk, dv (dk/dv sum over each kv head's query heads).
struct AttentionGradCall {
  TensorView dq, dk, dv, dout, q, k, v, out, lse;
  float scale = 0.0f;
  bool causal = true;  // as AttentionCall's
  int64_t window = 0;      // as AttentionCall's
  TensorView cu_seqlens;
  ExecContext ctx;
};

using AttentionForwardFn = void(const AttentionCall&);
using AttentionBackwardFn = void(const AttentionGradCall&);
// turbo::linear_forward: out [N,OC] = inp [N,C] @ weight [OC,C]^T (+ bias), GELU with aux.
using LinearForwardFn = void(const TensorView& out, const TensorView& inp, const TensorView& weight,
                             const TensorView& bias, const TensorView& aux, const ExecContext& ctx);
// turbo::linear_backward: dinp (=, or += with accumulate_dinp), dweight += (= without
// accumulate_dweight: the first micro-batch of a step, whose gradients were not zeroed), dbias += (f32).
using LinearBackwardFn = void(const TensorView& dinp, const TensorView& dweight, const TensorView& dbias,
                              const TensorView& dout, const TensorView& inp, const TensorView& weight,
                              bool accumulate_dinp, const ExecContext& ctx, bool accumulate_dweight);
// turbo::linear_backward_input_dgelu: dpre = (dout @ weight) * gelu'(pre_aux) (dbias optional).
using LinearBackwardDGeluFn = void(const TensorView& dpre, const TensorView& dbias, const TensorView& dout,
                                   const TensorView& weight, const TensorView& pre_aux, const ExecContext& ctx);
// turbo::bias_grad: dbias [OC] f32 += column sums of dout [N,OC] (a linear layer's bias gradient,
// kept out of the weight-gradient GEMM, whose cuBLASLt bias-gradient epilogue is slow).
using BiasGradFn = void(const TensorView& dbias, const TensorView& dout, const ExecContext& ctx);
// turbo::linear_backward_weight_ones: dweight [OC,C] += (= without accumulate_dweight) and dbias [OC]
// += from one GEMM over inp_ones [N, C + pad], the layer input with a column of ones after it.
using LinearWeightGradOnesFn = void(const TensorView& dweight, const TensorView& dbias, const TensorView& dout,
                                    const TensorView& inp_ones, const ExecContext& ctx, bool accumulate_dweight);
using NormForwardFn = void(const turbo::NormForwardArgs&);
using NormBackwardFn = void(const turbo::NormBackwardArgs&);
using CrossEntropyFn = void(const turbo::CrossEntropyArgs&);
// out f32 [2] = {global L2 norm of the gradients, clip factor}; see turbo/ops/optimizer.h.
using GradNormFn = void(turbo::MultiTensorAdamW& opt, const TensorView& out, float max_norm, const ExecContext& ctx);
// One AdamW update of every tensor; grad_scale f32 [1] on the device (the clip factor; NaN: skip
// the step), device_scalars f32 [3] = {lr, 1 - beta1^t, 1 - beta2^t} on the device overriding
// hp's (undefined in host mode), norm_out (optional) f32 [2] = {norm of the gradients it read, 1};
// see turbo::MultiTensorAdamW::step.
using AdamWStepFn = void(turbo::MultiTensorAdamW& opt, const turbo::AdamWHyper& hp, const TensorView& grad_scale,
                         const TensorView& device_scalars, const ExecContext& ctx, const TensorView& norm_out);

// Activation recomputation, per layer: what the forward keeps for the backward.
//   None       every activation (the fastest backward, the most memory);
//   Selective  the layer input, q/k/v, the attention output and log-sum-exp, the residual after
//              attention and the MLP pre-activation; the backward recomputes both norms' outputs
//              and the MLP activation (GELU / SwiGLU): cheap elementwise work for ~40% less;
//   Full       only the layer input; the backward reruns the layer's forward (all but its last
//              GEMM) before the layer's backward.
// The model asks once per layer, when it plans its memory; recomputed tensors share one buffer
// set across layers. Gradients are those of None (bit for bit where the recomputation reruns
// the same kernels; see docs/cuda.md).
// Each keeps less than the one before: norms drops the two norm outputs (recomputed from the kept
// residuals: cheap, memory-bound); selective also the MLP activation; full keeps only the layer input.
// Mixture of experts: the router, the dispatch (row plan + permute into expert groups) and the
// combine (weighted unpermute), each with its backward, and the expert GEMMs. Dispatch and
// combine are the calls expert parallelism replaces with all-to-alls over a process group.
struct MoeDispatchCall {
  turbo::MoePlanArgs plan;
  turbo::MoePermuteArgs permute;
};
using MoeRouterFn = void(const turbo::RouterForwardArgs&);
using MoeRouterBackwardFn = void(const turbo::RouterBackwardArgs&);
using MoeDispatchFn = void(const MoeDispatchCall&);
using MoeDispatchBackwardFn = void(const turbo::MoePermuteBackwardArgs&);
using MoeCombineFn = void(const turbo::MoeUnpermuteArgs&);
using MoeCombineBackwardFn = void(const turbo::MoeUnpermuteBackwardArgs&);
using MoeExpertsFn = void(const turbo::GroupedGemmForwardArgs&);
using MoeExpertsDgradFn = void(const turbo::GroupedGemmDgradArgs&);
using MoeExpertsWgradFn = void(const turbo::GroupedGemmWgradArgs&);

enum class Recompute : uint8_t { None, Norms, Selective, Full };
using RecomputePolicyFn = Recompute(int64_t layer, int64_t num_layers);
const char* recompute_name(Recompute r);
// "none" | "norms" | "selective" | "full"; anything else throws ConfigError naming `where`.
Recompute parse_recompute(const std::string& text, const std::string& where);
// Megatron-LM's recompute_method (uniform | block) and recompute_num_layers beside
// recompute_granularity: full: how many layers, from the first, are recomputed; -1 for every layer.
// block N: layers [0, N) (Megatron-LM's default N is 1; N >= num_layers is every layer); uniform 1
// (or unset): every layer on its own, as full alone. `get` reads a key (null: not set). A
// ConfigError naming the key's origin for: either key beside another granularity, a count without a
// method, uniform over chunks of more than one layer (only each chunk's input kept: not implemented).
int64_t recompute_layers(const std::function<const config::Value*(const std::string&)>& get);

inline constexpr const char* kAttentionForward = "cuda.attention.forward";
inline constexpr const char* kAttentionBackward = "cuda.attention.backward";
inline constexpr const char* kLinearForward = "cuda.linear.forward";
inline constexpr const char* kLinearBackward = "cuda.linear.backward";
inline constexpr const char* kLinearBackwardDGelu = "cuda.linear.backward_dgelu";
inline constexpr const char* kBiasGrad = "cuda.linear.bias_grad";
inline constexpr const char* kLinearWeightGradOnes = "cuda.linear.weight_grad_ones";
// The output layer (lm_head) has slots of its own: FP8 recipes keep it in bf16, as Transformer
// Engine and torchao leave the first and last layers in higher precision.
inline constexpr const char* kHeadForward = "cuda.head.forward";
inline constexpr const char* kHeadBackward = "cuda.head.backward";
inline constexpr const char* kNormForward = "cuda.norm.forward";
inline constexpr const char* kNormBackward = "cuda.norm.backward";
inline constexpr const char* kCrossEntropy = "cuda.loss.cross_entropy";
inline constexpr const char* kGradNorm = "cuda.optimizer.grad_norm";
inline constexpr const char* kAdamWStep = "cuda.optimizer.adamw";
inline constexpr const char* kRecomputePolicy = "cuda.recompute.policy";
inline constexpr const char* kMoeRouter = "cuda.moe.router";
inline constexpr const char* kMoeRouterBackward = "cuda.moe.router_backward";
inline constexpr const char* kMoeDispatch = "cuda.moe.dispatch";
inline constexpr const char* kMoeDispatchBackward = "cuda.moe.dispatch_backward";
inline constexpr const char* kMoeCombine = "cuda.moe.combine";
inline constexpr const char* kMoeCombineBackward = "cuda.moe.combine_backward";
inline constexpr const char* kMoeExperts = "cuda.moe.experts";
inline constexpr const char* kMoeExpertsDgrad = "cuda.moe.experts_dgrad";
inline constexpr const char* kMoeExpertsWgrad = "cuda.moe.experts_wgrad";

// What the model calls, read from the slots.
struct CudaOps {
  std::function<AttentionForwardFn> attention_forward;
  std::function<AttentionBackwardFn> attention_backward;
  std::function<LinearForwardFn> linear_forward;
  std::function<LinearBackwardFn> linear_backward;
  std::function<LinearBackwardDGeluFn> linear_backward_dgelu;
  std::function<BiasGradFn> bias_grad;
  std::function<LinearWeightGradOnesFn> linear_weight_grad_ones;
  std::function<LinearForwardFn> head_forward;
  std::function<LinearBackwardFn> head_backward;
  std::function<NormForwardFn> norm_forward;
  std::function<NormBackwardFn> norm_backward;
  std::function<CrossEntropyFn> cross_entropy;
  std::function<GradNormFn> grad_norm;
  std::function<AdamWStepFn> adamw;
  std::function<RecomputePolicyFn> recompute_policy;
  std::function<MoeRouterFn> moe_router;
  std::function<MoeRouterBackwardFn> moe_router_backward;
  std::function<MoeDispatchFn> moe_dispatch;
  std::function<MoeDispatchBackwardFn> moe_dispatch_backward;
  std::function<MoeCombineFn> moe_combine;
  std::function<MoeCombineBackwardFn> moe_combine_backward;
  std::function<MoeExpertsFn> moe_experts;
  std::function<MoeExpertsDgradFn> moe_experts_dgrad;
  std::function<MoeExpertsWgradFn> moe_experts_wgrad;

  static CudaOps defaults();                               // the slots' defaults
  static CudaOps from(const patches::HookTable& hooks);    // after the patches ran
};

// The fallback attention (turbo/ops/attention_fallback.h: batched GEMMs and a causal softmax,
// [T,T] scores in scratch) behind the attention slots (patch cuda.attention.fallback), and the
// scratch its backward needs; act_bytes: 2 for bf16 device tensors, 4 for f32 host tensors.
void fallback_attention_forward(const AttentionCall& c);
void fallback_attention_backward(const AttentionGradCall& c);
size_t fallback_attention_scratch_bytes(int64_t B, int64_t T, int64_t H, int64_t KVH, int64_t D,
                                        size_t act_bytes = 2);

// The default attention backward with AttentionOptions::deterministic set (patch
// cuda.attention.deterministic): cuDNN's engine without run-dependent dQ accumulation. Builds
// without Turbo's attention op return the fallback backward (deterministic already).
AttentionBackwardFn* deterministic_attention_backward();
// Scratch that backward needs beyond the default's: cuDNN's dP workspace, B*H*T^2*2 bytes (T
// rounded up to 64), its f32 row sums, an f32 [B,T,H,D] buffer the engine also asks for (128 MiB
// at Llama-3.2-1B's 8 x 2048 x 32 heads x 64, which a fixed margin did not cover) and a margin for
// the rest of its workspace.
size_t deterministic_attention_scratch_bytes(int64_t B, int64_t T, int64_t H, int64_t D);

// The FP8 versions of the three linear slots (turbo/ops/gemm_fp8.h) for `recipe`: what patch
// cuda.linear.fp8 puts in kLinearForward / kLinearBackward / kLinearBackwardDGelu (the model must
// then be built with CudaModelOptions::fp8_linear for their scratch).
struct Fp8LinearFns {
  std::function<LinearForwardFn> forward;
  std::function<LinearBackwardFn> backward;
  std::function<LinearBackwardDGeluFn> backward_dgelu;
};
Fp8LinearFns fp8_linear_fns(const turbo::Fp8Recipe& recipe);
inline void use_fp8_linear(CudaOps& ops, const turbo::Fp8Recipe& recipe) {
  Fp8LinearFns f = fp8_linear_fns(recipe);
  ops.linear_forward = std::move(f.forward);
  ops.linear_backward = std::move(f.backward);
  ops.linear_backward_dgelu = std::move(f.backward_dgelu);
}

// The FP8 versions of the three MoE expert slots (turbo/ops/grouped_gemm_fp8.h: current tensorwise,
// rowwise or blockwise scaling as the recipe says, or delayed scaling as tensorwise products with the
// recipe's amax histories; x and W in the recipe's forward format, dy in its gradient format): what
// patch cuda.moe.fp8 puts in kMoeExperts / kMoeExpertsDgrad / kMoeExpertsWgrad (the model must then
// be built with CudaModelOptions::fp8_moe and the recipe's fp8_multiple, and with fp8_delayed its
// histories hold the experts' weights too).
struct Fp8MoeFns {
  std::function<MoeExpertsFn> forward;
  std::function<MoeExpertsDgradFn> dgrad;
  std::function<MoeExpertsWgradFn> wgrad;
};
Fp8MoeFns fp8_moe_fns(const turbo::Fp8Recipe& recipe);
inline void use_fp8_moe(CudaOps& ops, const turbo::Fp8Recipe& recipe) {
  Fp8MoeFns f = fp8_moe_fns(recipe);
  ops.moe_experts = std::move(f.forward);
  ops.moe_experts_dgrad = std::move(f.dgrad);
  ops.moe_experts_wgrad = std::move(f.wgrad);
}

struct CudaArgs;
// What patch cuda.linear.fp8 does to the args: the recipe of `fp8` (format) and `fp8_recipe`
// (scaling) written into them, with fp8_recipe delayed a new delayed-scaling state made from the
// fp8_amax_* keys, the registry of inputs saved in FP8 and that of the weights quantized once per
// step, with rowwise and tensorwise scaling the handoff of the SwiGLU kernels' maxima, each held by both the
// recipe (for the slots) and the args (fp8_delayed, fp8_saved, fp8_weights, fp8_maxima: for the
// model).
// Throws ConfigError as parse_fp8_recipe does.
turbo::Fp8Recipe configure_fp8(CudaArgs& args, const std::string& fp8, const std::string& fp8_recipe);

// Declares every slot above with its default (BackendAdapter::define_hooks).
void define_cuda_hooks(patches::HookTable& hooks);

// The default attention: "turbo" (turbo::attention_forward / _backward, which dispatch to
// cuDNN or Turbo's flash kernels) when this build has the Turbo attention op, else "fallback".
const char* default_attention_name();

}  // namespace primus::backends::cuda
