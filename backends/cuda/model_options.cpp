#include "backends/cuda/model_options.h"

#include <fmt/format.h>

#include <string>

#include "core/util/error.h"
#include "parallel/cuda/grad_reducer.h"
#include "train/muon_layout.h"
#include "train/param_layout.h"
#include "turbo/ops/gemm_fp8.h"

namespace primus::backends::cuda {

bool uses_fallback_attention(const CudaArgs& a) {
  return a.attention_backend == "fallback" || std::string(default_attention_name()) == "fallback";
}

CudaModelOptions model_options_for(const CudaArgs& a, int64_t world) {
  const train::ModelSpec& spec = a.model;
  const train::TrainingArgs& t = a.train;
  CudaModelOptions mo;
  mo.max_batch = t.micro_batch_size;
  mo.max_seq = spec.seq_length;
  // Context parallelism: a micro-batch is this rank's two chunks of each sequence (cp_attention.h).
  if (const int64_t cp = t.model_parallel[parallel::Dim::CP]; cp > 1) {
    mo.max_batch = 2 * t.micro_batch_size;
    mo.max_seq = spec.seq_length / (2 * cp);
  }
  mo.loss_slots = t.grad_accum_steps;
  mo.device = a.host_mode ? turbo::Device::CPU : turbo::Device::CUDA;
  mo.moe_swiglu_epilogue = a.moe_swiglu_epilogue;  // patch cuda.moe.swiglu_epilogue
  mo.unfused_wgrad = a.unfused_wgrad;              // patch cuda.grad.unfused_accumulation
  mo.fp8_linear = a.fp8 != "none";
  if (mo.fp8_linear)
    mo.fp8_multiple = turbo::linear_fp8_multiple(turbo::parse_fp8_recipe(a.fp8, a.fp8_recipe, "fp8", "fp8_recipe"));
  mo.fp8_moe = mo.fp8_linear && spec.moe.enabled();  // patch cuda.moe.fp8
  mo.fp8_bf16_edge_layers = a.fp8_first_last_bf16_layers;
  if (mo.fp8_linear) {
    mo.fp8_delayed = a.fp8_delayed;
    mo.fp8_saved = a.fp8_saved;
    mo.fp8_weights = a.fp8_weights;
    mo.fp8_maxima = a.fp8_maxima;
    mo.fp8_producers = a.fp8_producers;
  }
  // Document masking: the plan holds its tables; the trainer sets the tokenizer's eod id.
  mo.document_masking.reset_attention_mask = t.data.reset_attention_mask;
  mo.document_masking.reset_position_ids = t.data.reset_position_ids;
  mo.masked_loss = t.data.eod_mask_loss;
  // A sliding window and packed documents are masks of Turbo's attention op (TURBO kernels: cuDNN
  // and the fallback serve plain causal attention, and the deterministic backward is cuDNN's).
  const char* mask_key = spec.sliding_window > 0 ? "sliding_window" : t.data.reset_attention_mask ? "reset_attention_mask" : nullptr;
  if (mask_key && uses_fallback_attention(a)) {
    throw ConfigError(fmt::format("{} needs Turbo's attention op; the fallback attention (attention_backend: fallback, "
                                  "or a build without turbo/ops/attention.cpp) serves plain causal attention only",
                                  mask_key));
  }
  if (mask_key && a.deterministic) {
    throw ConfigError(fmt::format("{} with deterministic: true is not supported: the deterministic attention backward "
                                  "is cuDNN's, which serves neither a sliding window nor packed documents",
                                  mask_key));
  }
  if (uses_fallback_attention(a)) {
    mo.attention_scratch_bytes = fallback_attention_scratch_bytes(t.micro_batch_size, spec.seq_length,
                                                                  spec.num_attention_heads, spec.num_query_groups,
                                                                  spec.head_dim(), a.host_mode ? 4 : 2);
  } else if (a.deterministic) {
    mo.attention_scratch_bytes = deterministic_attention_scratch_bytes(t.micro_batch_size, spec.seq_length,
                                                                       spec.num_attention_heads, spec.head_dim());
  }
  // optim_grads / optim_grads_params, and ZeRO-1 beside tp or cp: the model keeps its own shard
  // (model/fsdp.h), not the bucketed reducer's padded buffers.
  const parallel::DpSharding sharding = a.train.model_parallel.sharding;
  const bool sharded = parallel::shards_gradients(sharding) || zero1_in_model(a);
  if (world > 1 && a.use_distributed_optimizer && !sharded) {
    mo.flat_elems = parallel::zero1_padded_total(train::make_param_layout(spec), static_cast<int>(world));
    mo.optimizer_state = false;
  }
  if (a.optimizer_in_bwd) {
    // The global norm is known only after the whole backward, when the layers above have moved.
    if (t.optim.clip_grad > 0) {
      throw ConfigError(fmt::format("optimizer_in_bwd: true needs clip_grad: 0 (got {}): each layer is updated before "
                                    "the layers below have gradients, so there is no global norm to clip by",
                                    t.optim.clip_grad));
    }
    if (t.grad_accum_steps != 1) {
      throw ConfigError(fmt::format("optimizer_in_bwd: true needs one micro-batch per step (global_batch_size = "
                                    "micro_batch_size x data-parallel ranks); got {} micro-batches",
                                    t.grad_accum_steps));
    }
    // Beside data parallelism the model averages each layer's gradients itself, and every rank
    // keeps the whole optimizer state: ZeRO-1 and the sharded strategies would update chunks.
    if (world > 1 && (sharded || a.use_distributed_optimizer)) {
      throw ConfigError(fmt::format("optimizer_in_bwd: true with {} over {} data-parallel ranks is not implemented: the "
                                    "optimizer in the backward keeps the whole optimizer state on every rank (use "
                                    "data_parallel_sharding_strategy: no_shard and use_distributed_optimizer: false)",
                                    a.use_distributed_optimizer ? std::string("use_distributed_optimizer (ZeRO-1)")
                                    : fmt::format("data_parallel_sharding_strategy {}", parallel::dp_sharding_name(sharding)),
                                    world));
    }
    mo.optimizer_in_backward = true;
    mo.grad_mean = world > 1 || t.model_parallel[parallel::Dim::CP] > 1;
  }
  if (a.bf16_expert_grads) {
    if (!spec.moe.enabled()) throw ConfigError("moe_expert_grad_dtype: bf16 needs an MoE model (num_experts > 0)");
    if (!a.optimizer_in_bwd) {
      throw ConfigError("moe_expert_grad_dtype: bf16 needs optimizer_in_bwd: true: a bf16 gradient is written once and "
                        "never accumulated, which only the optimizer in the backward (one micro-batch a step) ensures");
    }
    if (mo.fp8_moe) throw ConfigError("moe_expert_grad_dtype: bf16 with fp8: the FP8 experts' weight gradients are f32");
    if (a.host_mode) throw ConfigError("moe_expert_grad_dtype: bf16 needs the GPU (host mode computes in f32)");
    mo.bf16_expert_grads = true;
  }
  if (a.split_master) {
    const char* why = a.host_mode                  ? "host mode computes on the fp32 master itself"
                      : !mo.optimizer_state        ? "use_distributed_optimizer (ZeRO-1) keeps the master weights in its shards"
                      : sharded && world > 1       ? "sharded data parallelism keeps the master weights in its chunks"
                      : t.optim.optimizer != "adamw" ? "Muon updates its matrices' fp32 masters"
                                                     : nullptr;
    if (why) throw ConfigError(fmt::format("master_weights: split: {}", why));
    mo.split_master = true;
  }
  if (t.optim.exp_avg_bf16 || t.optim.exp_avg_sq_bf16) {
    const char* why = !mo.optimizer_state
                          ? "use_distributed_optimizer (ZeRO-1) over plain data parallelism on GPUs: its bucketed "
                            "reducer keeps f32 moments in its shards (the sharded strategies optim_grads and "
                            "optim_grads_params, and ZeRO-1 beside tp, cp or ep, take bf16 ones)"
                      : t.optim.optimizer != "adamw"
                          ? "optimizer: muon, whose momentum lives in the first-moment buffer (the reference backend "
                            "runs it)"
                          : nullptr;
    if (why) {
      throw ConfigError(fmt::format("{}: bf16 on the cuda backend is not implemented beside {}",
                                    t.optim.exp_avg_bf16 ? "exp_avg_dtype" : "exp_avg_sq_dtype", why));
    }
    mo.exp_avg_bf16 = t.optim.exp_avg_bf16;
    mo.exp_avg_sq_bf16 = t.optim.exp_avg_sq_bf16;
  }
  if (t.optim.optimizer == "muon") {
    if (a.optimizer_in_bwd) {
      throw ConfigError("optimizer: muon with optimizer_in_bwd: true is not supported: Muon orthogonalises whole "
                        "momentum matrices after the backward (set optimizer_in_bwd: false)");
    }
    if (!mo.optimizer_state) {
      throw ConfigError("optimizer: muon with use_distributed_optimizer (ZeRO-1) on several GPUs is not supported by "
                        "the cuda backend yet (Newton-Schulz needs whole matrices, the cuda ZeRO-1 shards are bucket "
                        "chunks); use plain data parallelism, or the reference backend, which shards Muon by matrix");
    }
    mo.muon = train::muon_tensors(spec, train::make_param_layout(spec));
  }
  // Expert parallelism (CudaModel, model/ep_comm.h) beside data parallelism (plain or sharded) and
  // context parallelism, AdamW (also in the backward, with bf16 expert gradients and split masters)
  // or Muon (each expert's matrices are whole on their rank), and bf16 or FP8 experts; tensor
  // parallelism is refused here, before anything is built.
  mo.ep_buffer_factor = a.moe_ep_buffer_factor;
  if (const int64_t ep = t.model_parallel[parallel::Dim::EP]; ep > 1) {
    const char* why = !spec.moe.enabled()                               ? nullptr
                      : t.model_parallel[parallel::Dim::TP] > 1           ? "tensor_model_parallel_size > 1"
                                                                          : nullptr;
    if (why) {
      throw ConfigError(fmt::format("expert_model_parallel_size {} with {} is not implemented yet on the cuda backend "
                                    "(it runs beside data and context parallelism)",
                                    ep, why));
    }
  }
  return mo;
}

}  // namespace primus::backends::cuda
