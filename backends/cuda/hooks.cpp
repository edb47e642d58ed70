#include "backends/cuda/hooks.h"

#include <fmt/format.h>
#include <spdlog/spdlog.h>

#include <atomic>

#include "backends/cuda/args.h"
#include "core/util/error.h"
#include "turbo/core/env_switch.h"
#include "turbo/ops/attention.h"
#include "turbo/ops/attention_fallback.h"
#include "turbo/ops/fp8_delayed.h"
#include "turbo/ops/gemm.h"
#include "turbo/ops/grouped_gemm_fp8.h"

namespace primus::backends::cuda {

namespace {

// Which Turbo backend served a call, logged the first time (the dispatcher decides per shape).
void log_once(std::atomic<bool>& done, const char* what, turbo::BackendType b) {
  if (!done.exchange(true)) spdlog::info("[cuda] {} served by Turbo backend {}", what, turbo::backend_name(b));
}

// The slots' argument structs as the attention op's (the scale is passed, not derived, so the
// fallback and the Turbo op see the same float).
turbo::AttentionForwardArgs to_turbo(const AttentionCall& c) {
  turbo::AttentionForwardArgs a;
  a.out = c.out;
  a.lse = c.lse;
  a.q = c.q;
  a.k = c.k;
  a.v = c.v;
  a.opt.causal = c.causal;
  a.opt.softmax_scale = c.scale;
  a.opt.window = c.window;
  a.opt.cu_seqlens = c.cu_seqlens;
  a.ctx = c.ctx;
  return a;
}

turbo::AttentionBackwardArgs to_turbo(const AttentionGradCall& c, bool deterministic) {
  turbo::AttentionBackwardArgs a;
  a.dq = c.dq;
  a.dk = c.dk;
  a.dv = c.dv;
  a.dout = c.dout;
  a.q = c.q;
  a.k = c.k;
  a.v = c.v;
  a.out = c.out;
  a.lse = c.lse;
  a.opt.causal = c.causal;
  a.opt.softmax_scale = c.scale;
  a.opt.window = c.window;
  a.opt.cu_seqlens = c.cu_seqlens;
  a.opt.deterministic = deterministic;
  a.ctx = c.ctx;
  return a;
}

#ifdef PRIMUS_CUDA_HAVE_TURBO_ATTENTION
void turbo_attention_forward(const AttentionCall& c) {
  static std::atomic<bool> logged{false};
  log_once(logged, "attention forward", turbo::attention_forward(to_turbo(c)));
}

// The default backward (dQ accumulated in f32 by the fastest engine) or, deterministic, one
// whose results do not depend on the order thread blocks finish in (AttentionOptions).
void run_turbo_attention_backward(const AttentionGradCall& c, bool deterministic) {
  static std::atomic<bool> logged{false}, logged_det{false};
  const turbo::BackendType b = turbo::attention_backward(to_turbo(c, deterministic));
  if (deterministic)
    log_once(logged_det, "attention backward (deterministic)", b);
  else
    log_once(logged, "attention backward", b);
}
void turbo_attention_backward(const AttentionGradCall& c) { run_turbo_attention_backward(c, false); }
void turbo_attention_backward_deterministic(const AttentionGradCall& c) { run_turbo_attention_backward(c, true); }
#endif

}  // namespace

void fallback_attention_forward(const AttentionCall& c) { turbo::attention_fallback_forward(to_turbo(c)); }
void fallback_attention_backward(const AttentionGradCall& c) { turbo::attention_fallback_backward(to_turbo(c, false)); }
size_t fallback_attention_scratch_bytes(int64_t B, int64_t T, int64_t H, int64_t KVH, int64_t D, size_t act_bytes) {
  return turbo::attention_fallback_scratch_bytes(B, T, H, KVH, D, act_bytes);
}

AttentionBackwardFn* deterministic_attention_backward() {
#ifdef PRIMUS_CUDA_HAVE_TURBO_ATTENTION
  return turbo_attention_backward_deterministic;
#else
  return fallback_attention_backward;
#endif
}

size_t deterministic_attention_scratch_bytes(int64_t B, int64_t T, int64_t H, int64_t D) {
  const int64_t Tp = (T + 63) / 64 * 64;
  return size_t(B * H * Tp * Tp) * 2 + size_t(B * H * T) * 4 + size_t(B * T * H * D) * 4 + (size_t{64} << 20);
}

const char* recompute_name(Recompute r) {
  switch (r) {
    case Recompute::None: return "none";
    case Recompute::Norms: return "norms";
    case Recompute::Selective: return "selective";
    case Recompute::Full: return "full";
  }
  return "?";
}

Recompute parse_recompute(const std::string& text, const std::string& where) {
  for (Recompute r : {Recompute::None, Recompute::Norms, Recompute::Selective, Recompute::Full})
    if (text == recompute_name(r)) return r;
  throw ConfigError(
      fmt::format("{}: recompute_granularity '{}' is not one of none, norms, selective, full", where, text));
}

int64_t recompute_layers(const std::function<const config::Value*(const std::string&)>& get) {
  auto set = [&](const char* k) -> const config::Value* {
    const config::Value* v = get(k);
    return v && !v->is_null() ? v : nullptr;
  };
  const config::Value* g = set("recompute_granularity");
  const config::Value* method = set("recompute_method");
  const config::Value* count = set("recompute_num_layers");
  const std::string granularity = g ? g->as_string() : "none";
  if (granularity != "full") {
    if (const config::Value* v = method ? method : count)
      throw ConfigError(fmt::format("{}: recompute_method and recompute_num_layers say which layers recompute_granularity "
                                    "full recomputes (Megatron-LM's); the granularity here is {}",
                                    v->origin().str(), granularity));
    return -1;
  }
  if (!method) {
    if (count)
      throw ConfigError(fmt::format("{}: recompute_num_layers needs recompute_method (block: the first N layers; "
                                    "uniform 1: every layer)",
                                    count->origin().str()));
    return -1;
  }
  const int64_t n = count ? count->as_int() : 1;
  if (method->as_string() == "uniform") {
    if (n == 0)
      throw ConfigError(fmt::format("{}: recompute_method uniform with recompute_num_layers 0: chunks of no layer; "
                                    "uniform 1 recomputes every layer (block 0 none)",
                                    count->origin().str()));
    if (n > 1)
      throw ConfigError(fmt::format("{}: recompute_method uniform with recompute_num_layers {} (chunks of {} layers, "
                                    "only each chunk's input kept) is not implemented; uniform 1 recomputes every "
                                    "layer, block N the first N",
                                    count->origin().str(), n, n));
    return -1;
  }
  const config::Value* layers = get("num_layers");
  const int64_t L = layers && !layers->is_null() ? layers->as_int() : 0;
  return n >= L ? -1 : n;
}

const char* default_attention_name() {
#ifdef PRIMUS_CUDA_HAVE_TURBO_ATTENTION
  return "turbo";
#else
  return "fallback";
#endif
}

CudaOps CudaOps::defaults() {
  CudaOps o;
#ifdef PRIMUS_CUDA_HAVE_TURBO_ATTENTION
  o.attention_forward = turbo_attention_forward;
  o.attention_backward = turbo_attention_backward;
#else
  o.attention_forward = fallback_attention_forward;
  o.attention_backward = fallback_attention_backward;
#endif
  o.linear_forward = [](const TensorView& out, const TensorView& inp, const TensorView& w, const TensorView& b,
                        const TensorView& aux, const ExecContext& ctx) { turbo::linear_forward(out, inp, w, b, aux, ctx); };
  o.linear_backward = turbo::linear_backward;
  o.linear_backward_dgelu = turbo::linear_backward_input_dgelu;
  o.bias_grad = turbo::bias_grad;
  o.linear_weight_grad_ones = turbo::linear_backward_weight_ones;
  o.head_forward = o.linear_forward;
  o.head_backward = turbo::linear_backward;
  o.norm_forward = [](const turbo::NormForwardArgs& a) { turbo::norm_forward(a); };
  o.norm_backward = [](const turbo::NormBackwardArgs& a) { turbo::norm_backward(a); };
  o.cross_entropy = [](const turbo::CrossEntropyArgs& a) { turbo::cross_entropy(a); };
  o.grad_norm = [](turbo::MultiTensorAdamW& opt, const TensorView& out, float max_norm, const ExecContext& ctx) {
    opt.grad_norm(out, max_norm, ctx);
  };
  o.adamw = [](turbo::MultiTensorAdamW& opt, const turbo::AdamWHyper& hp, const TensorView& scale,
               const TensorView& scalars, const ExecContext& ctx,
               const TensorView& norm_out) { opt.step(hp, scale, scalars, ctx, norm_out); };
  o.recompute_policy = [](int64_t, int64_t) { return Recompute::None; };
  o.moe_router = [](const turbo::RouterForwardArgs& a) { turbo::router_forward(a); };
  o.moe_router_backward = [](const turbo::RouterBackwardArgs& a) { turbo::router_backward(a); };
  o.moe_dispatch = [](const MoeDispatchCall& c) {
    turbo::moe_plan_rows(c.plan);
    turbo::moe_permute(c.permute);
  };
  o.moe_dispatch_backward = [](const turbo::MoePermuteBackwardArgs& a) { turbo::moe_permute_backward(a); };
  o.moe_combine = [](const turbo::MoeUnpermuteArgs& a) { turbo::moe_unpermute(a); };
  o.moe_combine_backward = [](const turbo::MoeUnpermuteBackwardArgs& a) { turbo::moe_unpermute_backward(a); };
  o.moe_experts = [](const turbo::GroupedGemmForwardArgs& a) { turbo::grouped_gemm_forward(a); };
  o.moe_experts_dgrad = [](const turbo::GroupedGemmDgradArgs& a) { turbo::grouped_gemm_dgrad(a); };
  o.moe_experts_wgrad = [](const turbo::GroupedGemmWgradArgs& a) { turbo::grouped_gemm_wgrad(a); };
  return o;
}

turbo::Fp8Recipe configure_fp8(CudaArgs& a, const std::string& fp8, const std::string& fp8_recipe) {
  turbo::Fp8Recipe r = turbo::parse_fp8_recipe(fp8, fp8_recipe, "fp8", "fp8_recipe");
  a.fp8 = fp8;
  a.fp8_recipe = fp8_recipe;
  a.fp8_delayed.reset();
  r.saved = std::make_shared<turbo::Fp8SavedInputs>(r.act_granularity());
  a.fp8_saved = r.saved;
  r.weights = std::make_shared<turbo::Fp8WeightCache>(r.weight_granularity());
  r.weights->keep_transpose = !a.no_fp8_weight_transpose_cache;
  a.fp8_weights = r.weights;
  a.fp8_maxima.reset();
  // PRIMUS_CUDA_FP8_MAXIMA=0: the quantizer's own pass (the A/B of the handoff); checked whatever the recipe.
  const bool maxima = turbo::env_choice("PRIMUS_CUDA_FP8_MAXIMA", {"0", "1"}, "1") == "1";
  if (maxima && r.takes_maxima()) {
    r.maxima = std::make_shared<turbo::Fp8Maxima>(r.act_granularity());
    a.fp8_maxima = r.maxima;
  }
  a.fp8_producers.reset();
  // PRIMUS_CUDA_FP8_SWIGLU_FOLD=0: the activation kernels write act and dgate_up, which the delayed
  // quantizer then reads (the A/B of the folding); checked whatever the recipe.
  const bool fold = turbo::env_choice("PRIMUS_CUDA_FP8_SWIGLU_FOLD", {"0", "1"}, "1") == "1";
  if (r.scaling == turbo::Fp8Scaling::Delayed) {
    if (fold) {
      r.producers = std::make_shared<turbo::Fp8Producers>();
      a.fp8_producers = r.producers;
    }
    turbo::Fp8DelayedOptions o;
    o.history_len = a.fp8_amax_history_len;
    o.algo = a.fp8_amax_compute_algo == "max" ? turbo::Fp8AmaxAlgo::Max : turbo::Fp8AmaxAlgo::MostRecent;
    o.margin = static_cast<int>(a.fp8_margin);
    o.fwd = r.fwd;
    o.grad = r.grad;
    r.delayed = std::make_shared<turbo::Fp8DelayedScaling>(o);
    a.fp8_delayed = r.delayed;
  }
  return r;
}

Fp8LinearFns fp8_linear_fns(const turbo::Fp8Recipe& r) {
  Fp8LinearFns f;
  f.forward = [r](const TensorView& out, const TensorView& inp, const TensorView& w, const TensorView& b,
                  const TensorView& aux, const ExecContext& ctx) { turbo::linear_forward_fp8(out, inp, w, b, aux, ctx, r); };
  f.backward = [r](const TensorView& dinp, const TensorView& dw, const TensorView& db, const TensorView& dout,
                   const TensorView& inp, const TensorView& w, bool acc, const ExecContext& ctx, bool acc_w) {
    turbo::linear_backward_fp8(dinp, dw, db, dout, inp, w, acc, ctx, r, acc_w);
  };
  f.backward_dgelu = [r](const TensorView& dpre, const TensorView& db, const TensorView& dout, const TensorView& w,
                         const TensorView& pre, const ExecContext& ctx) {
    turbo::linear_backward_input_dgelu_fp8(dpre, db, dout, w, pre, ctx, r);
  };
  return f;
}

Fp8MoeFns fp8_moe_fns(const turbo::Fp8Recipe& r) {
  Fp8MoeFns f;
  const turbo::DType fwd = r.fwd, grad = r.grad;
  // Delayed scaling keeps one scale per tensor: the tensorwise products with the histories.
  const bool delayed = r.scaling == turbo::Fp8Scaling::Delayed;
  if (delayed && !r.delayed)
    throw RuntimeError("fp8_moe_fns: fp8_recipe delayed without its amax histories (Fp8Recipe::delayed is not set)");
  const turbo::GroupedFp8Scaling s = r.scaling == turbo::Fp8Scaling::Blockwise ? turbo::GroupedFp8Scaling::Block
                                     : r.scaling == turbo::Fp8Scaling::Rowwise ? turbo::GroupedFp8Scaling::Row
                                                                               : turbo::GroupedFp8Scaling::Tensor;
  const std::shared_ptr<turbo::Fp8DelayedScaling> d = delayed ? r.delayed : nullptr;
  // The step's weight copies (gradient accumulation: CudaModelOptions::fp8_weights registers the
  // experts' slots), shared with the linear slots' recipe.
  const std::shared_ptr<turbo::Fp8WeightCache> w = r.weights;
  f.forward = [fwd, s, w, d](const turbo::GroupedGemmForwardArgs& a) {
    turbo::grouped_gemm_forward_fp8(a, fwd, s, w.get(), d.get());
  };
  f.dgrad = [fwd, grad, s, w, d](const turbo::GroupedGemmDgradArgs& a) {
    turbo::grouped_gemm_dgrad_fp8(a, fwd, grad, s, w.get(), d.get());
  };
  f.wgrad = [fwd, grad, s, d](const turbo::GroupedGemmWgradArgs& a) {
    turbo::grouped_gemm_wgrad_fp8(a, fwd, grad, s, d.get());
  };
  return f;
}

void define_cuda_hooks(patches::HookTable& h) {
  const CudaOps d = CudaOps::defaults();
  h.define<AttentionForwardFn>(kAttentionForward, d.attention_forward,
                               std::string("causal self-attention forward (default: ") + default_attention_name() + ")");
  h.define<AttentionBackwardFn>(kAttentionBackward, d.attention_backward,
                                std::string("causal self-attention backward (default: ") + default_attention_name() + ")");
  h.define<LinearForwardFn>(kLinearForward, d.linear_forward, "linear layers: cuBLASLt GEMM with bias/GELU epilogues");
  h.define<LinearBackwardFn>(kLinearBackward, d.linear_backward, "linear layers' input, weight and bias gradients");
  h.define<LinearBackwardDGeluFn>(kLinearBackwardDGelu, d.linear_backward_dgelu,
                                  "GPT-2 MLP: input gradient through GELU fused into the GEMM epilogue");
  h.define<BiasGradFn>(kBiasGrad, d.bias_grad, "linear layers' bias gradients: a deterministic column-sum reduction");
  h.define<LinearWeightGradOnesFn>(kLinearWeightGradOnes, d.linear_weight_grad_ones,
                                   "weight and bias gradients of a linear layer fed by a norm, from one GEMM over the "
                                   "norm output's column of ones");
  h.define<LinearForwardFn>(kHeadForward, d.head_forward, "output layer (logits = final norm output @ wte^T or lm_head^T)");
  h.define<LinearBackwardFn>(kHeadBackward, d.head_backward, "output layer's input and weight gradients");
  h.define<NormForwardFn>(kNormForward, d.norm_forward, "residual add fused with LayerNorm / RMSNorm");
  h.define<NormBackwardFn>(kNormBackward, d.norm_backward, "norm backward accumulating into the residual gradient");
  h.define<CrossEntropyFn>(kCrossEntropy, d.cross_entropy, "fused softmax cross-entropy, gradient in place of the bf16 logits");
  h.define<GradNormFn>(kGradNorm, d.grad_norm, "global gradient norm and clip factor");
  h.define<AdamWStepFn>(kAdamWStep, d.adamw, "multi-tensor AdamW over fp32 master weights (+ bf16 copy)");
  h.define<RecomputePolicyFn>(kRecomputePolicy, d.recompute_policy,
                              "activation recomputation per layer (default: none, every activation kept)");
  h.define<MoeRouterFn>(kMoeRouter, d.moe_router,
                        "MoE router: scores, group-limited top-k, weights, aux/z statistics, loads (one kernel)");
  h.define<MoeRouterBackwardFn>(kMoeRouterBackward, d.moe_router_backward, "MoE router backward (logit gradient)");
  h.define<MoeDispatchFn>(kMoeDispatch, d.moe_dispatch,
                          "MoE dispatch: row plan (capacity, padding) and permute of the tokens into expert groups");
  h.define<MoeDispatchBackwardFn>(kMoeDispatchBackward, d.moe_dispatch_backward,
                                  "MoE dispatch backward: each token's slots summed back");
  h.define<MoeCombineFn>(kMoeCombine, d.moe_combine, "MoE combine: expert outputs weighted and summed per token");
  h.define<MoeCombineBackwardFn>(kMoeCombineBackward, d.moe_combine_backward,
                                 "MoE combine backward: expert output and routing weight gradients");
  h.define<MoeExpertsFn>(kMoeExperts, d.moe_experts, "MoE expert GEMMs (grouped GEMM over the device offsets)");
  h.define<MoeExpertsDgradFn>(kMoeExpertsDgrad, d.moe_experts_dgrad, "MoE expert GEMMs' input gradient");
  h.define<MoeExpertsWgradFn>(kMoeExpertsWgrad, d.moe_experts_wgrad, "MoE expert GEMMs' weight gradient");
}

CudaOps CudaOps::from(const patches::HookTable& h) {
  CudaOps o;
  o.attention_forward = h.get<AttentionForwardFn>(kAttentionForward);
  o.attention_backward = h.get<AttentionBackwardFn>(kAttentionBackward);
  o.linear_forward = h.get<LinearForwardFn>(kLinearForward);
  o.linear_backward = h.get<LinearBackwardFn>(kLinearBackward);
  o.linear_backward_dgelu = h.get<LinearBackwardDGeluFn>(kLinearBackwardDGelu);
  o.bias_grad = h.get<BiasGradFn>(kBiasGrad);
  o.linear_weight_grad_ones = h.get<LinearWeightGradOnesFn>(kLinearWeightGradOnes);
  o.head_forward = h.get<LinearForwardFn>(kHeadForward);
  o.head_backward = h.get<LinearBackwardFn>(kHeadBackward);
  o.norm_forward = h.get<NormForwardFn>(kNormForward);
  o.norm_backward = h.get<NormBackwardFn>(kNormBackward);
  o.cross_entropy = h.get<CrossEntropyFn>(kCrossEntropy);
  o.grad_norm = h.get<GradNormFn>(kGradNorm);
  o.adamw = h.get<AdamWStepFn>(kAdamWStep);
  o.recompute_policy = h.get<RecomputePolicyFn>(kRecomputePolicy);
  o.moe_router = h.get<MoeRouterFn>(kMoeRouter);
  o.moe_router_backward = h.get<MoeRouterBackwardFn>(kMoeRouterBackward);
  o.moe_dispatch = h.get<MoeDispatchFn>(kMoeDispatch);
  o.moe_dispatch_backward = h.get<MoeDispatchBackwardFn>(kMoeDispatchBackward);
  o.moe_combine = h.get<MoeCombineFn>(kMoeCombine);
  o.moe_combine_backward = h.get<MoeCombineBackwardFn>(kMoeCombineBackward);
  o.moe_experts = h.get<MoeExpertsFn>(kMoeExperts);
  o.moe_experts_dgrad = h.get<MoeExpertsDgradFn>(kMoeExpertsDgrad);
  o.moe_experts_wgrad = h.get<MoeExpertsWgradFn>(kMoeExpertsWgrad);
  return o;
}

}  // namespace primus::backends::cuda
