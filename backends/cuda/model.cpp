#include "backends/cuda/model.h"

#include <fmt/format.h>

#include <algorithm>
#include <array>
#include <cmath>
#include <cstring>

#include "backends/cuda/model/group_order.h"
#include "backends/cuda/nvtx.h"
#include "core/util/error.h"
#include "turbo/core/cuda_arena.h"
#include "turbo/core/cuda_check.h"
#include "turbo/ops/fp8_delayed.h"
#include "turbo/ops/grouped_gemm.h"
#include "turbo/ops/head_norm.h"
#include "turbo/ops/moe.h"
#include "turbo/ops/rope.h"

namespace primus::backends::cuda {

using turbo::Device;

namespace {

// The optimizer group (its first layout offset: the gradient-ready point at or below it) that the
// layout offset belongs to; -1 below the first point.
int64_t group_start(const std::vector<int64_t>& points, int64_t offset) {
  int64_t begin = -1;
  for (int64_t p : points)
    if (p <= offset && p > begin) begin = p;
  return begin;
}

// The linear layers of a transformer layer that FP8 serves: q|k|v, attention output, MLP up, MLP down
// (the order of StateBuffers::fp8_weights).
constexpr int64_t kFp8DelayedLinears = 4;
std::array<const TensorView*, kFp8DelayedLinears> fp8_linear_weights(const LayerParams& p) {
  return {&p.qkv_w.w, &p.proj_w.w, &p.fc_w.w, &p.out_w.w};
}
// The weights whose FP8 tensors fp8_recipe delayed keeps histories for, in the histories' order,
// per layer: a dense layer's four linears (fp8_linear_weights); an MoE layer's q|k|v and attention
// output, its experts' two stacked weights, and its shared expert's up and down when it has one.
// Every layer's, the bf16 edge layers' too (their histories stay empty), so that the count is the
// spec's alone: fp8_delayed_tensors.
std::vector<std::pair<const TensorView*, const char*>> fp8_delayed_weights(const LayerParams& p, bool moe, bool shared) {
  std::vector<std::pair<const TensorView*, const char*>> w = {{&p.qkv_w.w, "qkv"}, {&p.proj_w.w, "attention output"}};
  if (!moe) {
    w.insert(w.end(), {{&p.fc_w.w, "mlp up"}, {&p.out_w.w, "mlp down"}});
    return w;
  }
  w.insert(w.end(), {{&p.moe.fc.w, "experts fc"}, {&p.moe.proj.w, "experts proj"}});
  if (shared) w.insert(w.end(), {{&p.moe.shared_fc.w, "shared expert up"}, {&p.moe.shared_proj.w, "shared expert down"}});
  return w;
}
int64_t fp8_delayed_tensors(const train::ModelSpec& spec) {
  int64_t linears = 0;
  for (int64_t l = 0; l < spec.num_layers; ++l)
    linears += spec.is_moe_layer(l) && spec.moe.shared_ffn_hidden_size > 0 ? 6 : 4;
  return linears * turbo::Fp8DelayedScaling::kRoles;
}

// Layer l's linears run the FP8 slots: not a bf16 edge layer (fp8_first_last_bf16_layers).
bool fp8_linear_layer(const train::ModelSpec& spec, const CudaModelOptions& opt, int64_t l) {
  const int64_t e = opt.fp8_bf16_edge_layers;
  return opt.fp8_linear && l >= e && l < spec.num_layers - e;
}
// ... and it is a dense layer (the FP8 inputs saved for the backward serve the dense layers' four
// linears).
bool fp8_layer(const train::ModelSpec& spec, const CudaModelOptions& opt, int64_t l) {
  return fp8_linear_layer(spec, opt, l) && !spec.is_moe_layer(l);
}

// s: the rank's own spec; with tensor parallelism (tp > 1) the split widths are the key / tp.
void check_shapes(const train::ModelSpec& s, int64_t tp) {
  auto need8 = [tp](int64_t v, const char* what) {
    if (v % 8 != 0) {
      throw ConfigError(fmt::format("the cuda backend needs {} to be a multiple of 8 (16-byte bf16 vectors), got {}{}",
                                    what, v, tp > 1 ? fmt::format(" per tensor-parallel rank (the key / {})", tp) : ""));
    }
  };
  need8(s.hidden_size, "hidden_size");
  need8(s.head_dim(), "the head dimension (kv_channels, default hidden_size / num_attention_heads)");
  // Whole-projection q|k norms run on the norm op, whose rows hold at most 8192 bf16 columns.
  if (s.qk_layernorm && s.qk_norm_whole && s.q_dim() > 8192) {
    throw ConfigError(fmt::format("the cuda backend's qk_layernorm_scope: projection serves q widths (heads x head "
                                  "dimension) up to 8192, got {}",
                                  s.q_dim()));
  }
  if (s.qk_layernorm && !s.qk_norm_whole && s.head_dim() > turbo::kHeadNormMaxDim) {
    throw ConfigError(fmt::format("the cuda backend's qk_layernorm serves head dimensions up to {}, got kv_channels {}",
                                  turbo::kHeadNormMaxDim, s.head_dim()));
  }
  need8(s.ffn_hidden_size, "ffn_hidden_size");
  if (s.moe.enabled()) {
    need8(s.moe.ffn_hidden_size, "moe_ffn_hidden_size");
    if (s.moe.shared_ffn_hidden_size > 0) need8(s.moe.shared_ffn_hidden_size, "moe_shared_expert_intermediate_size");
  }
  if (s.padded_vocab_size % 8 != 0) {
    throw ConfigError(fmt::format("the cuda backend needs the padded vocabulary ({}) to be a multiple of 8: set "
                                  "make_vocab_size_divisible_by (128 is usual)",
                                  s.padded_vocab_size));
  }
}

void check_fp8(const train::ModelSpec& spec, const CudaModelOptions& opt) {
  if (!opt.fp8_linear) return;
  if (opt.device == Device::CUDA) {  // FP8 tensor cores: sm_89 (Ada) and sm_90 (Hopper) on
    int dev = 0;
    cudaDeviceProp prop{};
    CUDA_CHECK(cudaGetDevice(&dev));
    CUDA_CHECK(cudaGetDeviceProperties(&prop, dev));
    if (prop.major * 10 + prop.minor < 89) {
      throw ConfigError(fmt::format("fp8: {} (compute capability {}.{}) has no FP8 tensor cores; FP8 GEMMs need "
                                    "compute capability 8.9 or newer (set fp8: none)",
                                    prop.name, prop.major, prop.minor));
    }
  }
  if (const int64_t e = opt.fp8_bf16_edge_layers; e < 0 || 2 * e >= spec.num_layers)
    throw ConfigError(fmt::format("fp8_first_last_bf16_layers: {} at each end of {} layers leaves no layer in FP8 (at "
                                  "most {})",
                                  e, spec.num_layers, (spec.num_layers - 1) / 2));
  // Hopper's FP8 GEMMs want every dimension a multiple of 16; the block scales, of 128.
  const int64_t N = opt.max_batch * opt.max_seq, q = opt.fp8_multiple;
  for (const auto& [what, v] : {std::pair<const char*, int64_t>{"hidden_size", spec.hidden_size},
                                {"ffn_hidden_size", spec.ffn_hidden_size},
                                {"the query width (num_attention_heads x head dim)", spec.q_dim()},
                                {"the kv projection width (num_query_groups x head dim)", spec.kv_dim()},
                                {"micro_batch_size x seq_length", N}}) {
    if (v % q != 0)
      throw ConfigError(fmt::format("fp8: {}FP8 GEMMs need {} to be a multiple of {}, got {}",
                                    q == 128 ? "blockwise " : "", what, q, v));
  }
}

}  // namespace

bool moe_swiglu_epilogue_applies(const CudaModelOptions& opt, const train::ModelSpec& spec) {
  return opt.moe_swiglu_epilogue && spec.moe.enabled() && !opt.fp8_moe &&
         turbo::grouped_gemm_swiglu_available(opt.device, spec.moe.ffn_hidden_size);
}

MemoryPlanOptions memory_plan_options(const train::ModelSpec& spec, const train::ParamLayout& layout,
                                      const CudaModelOptions& opt, const CudaOps& ops) {
  MemoryPlanOptions mp;
  mp.max_batch = opt.max_batch;
  mp.max_seq = opt.max_seq == 0 ? spec.seq_length : opt.max_seq;
  mp.loss_slots = std::max<int64_t>(1, opt.loss_slots);
  mp.flat_elems = opt.flat_elems;
  mp.optimizer_state = opt.optimizer_state;
  mp.host = opt.device == Device::CPU;
  mp.fp8_linear = opt.fp8_linear;
  mp.fp8_moe = opt.fp8_moe && spec.moe.enabled();
  mp.fp8_maxima = opt.fp8_linear && opt.fp8_maxima && spec.swiglu;
  // Both registries below are keyed by the weights' memory, and the sharded strategies gather each
  // layer's weights into buffers the layers take turns with: not there yet. Tensor and context
  // parallelism keep each layer's own (local) weights; every rank saves what its own GEMMs read
  // (the gathered norm output with sequence parallelism, its slice of the activation, its tokens).
  const bool sharded = opt.dp_group && parallel::shards_optimizer(opt.dp_sharding);
  // FP8 inputs saved for the backward in the FP8 layers (the plan saves those inputs their recompute
  // policy keeps); FP8 weight copies in them under gradient accumulation (one micro-batch a step
  // quantizes each weight once, twice with full recompute, anyway).
  const bool save_inputs = opt.fp8_linear && opt.fp8_saved && !sharded;
  const bool cache_weights = opt.fp8_linear && opt.fp8_weights && !sharded && opt.loss_slots > 1;
  if (save_inputs) mp.fp8_saved_granularity = opt.fp8_saved->granularity();
  if (cache_weights) {
    mp.fp8_weight_granularity = opt.fp8_weights->granularity();
    mp.fp8_weight_transpose = opt.fp8_weights->keep_transpose;
  }
  // The FP8 experts' weights too (their layers' experts in FP8: not the bf16 edge layers).
  const bool cache_experts = cache_weights && mp.fp8_moe;
  // The recipe's weight granularity says which scales the expert slots use (fp8_moe_fns).
  mp.fp8_expert_blockwise = cache_experts && opt.fp8_weights->granularity() == turbo::Fp8Granularity::Block128x128;
  for (int64_t l = 0; l < spec.num_layers; ++l) {
    if (save_inputs) mp.fp8_saves.push_back(fp8_layer(spec, opt, l));
    if (cache_weights) mp.fp8_weight_layers.push_back(fp8_linear_layer(spec, opt, l));
    const int64_t e = opt.fp8_bf16_edge_layers;
    if (cache_experts) mp.fp8_expert_weight_layers.push_back(spec.is_moe_layer(l) && l >= e && l < spec.num_layers - e);
  }
  if (opt.fp8_delayed) {  // histories, scales, formats' maxima, and reduce_fp8_amaxes' staging
    mp.fp8_delayed_floats = fp8_delayed_tensors(spec) * (opt.fp8_delayed->options().history_len + 3);
  }
  mp.attention_scratch_bytes = opt.attention_scratch_bytes;
  mp.ones_pad = Decoder::ones_pad_for(spec, opt.bias_grad, opt.fp8_linear);
  mp.moe_align = turbo::kGroupedGemmAlign;
  if (mp.fp8_moe) {  // blockwise experts: groups of whole 128-token scale blocks (CudaModelOptions::fp8_moe)
    mp.moe_rows_multiple = opt.fp8_multiple;
    mp.moe_align = std::max(mp.moe_align, opt.fp8_multiple);
  }
  for (int64_t l = 0; l < spec.num_layers; ++l)
    mp.policy.push_back(ops.recompute_policy ? ops.recompute_policy(l, spec.num_layers) : Recompute::None);
  const GradClearing clearing = plan_grad_clearing(
      layout, [&spec](const std::string& name) { return Decoder::written_by_first_gemm(spec, name); });
  mp.zero_ranges = static_cast<int64_t>(clearing.ranges.size());
  mp.shared_grad_window = opt.optimizer_in_backward;
  const bool cp = opt.cp_group && opt.cp_group->world_size() > 1;
  mp.grad_windows = opt.optimizer_in_backward && (opt.grad_mean || opt.grad_mean_group || cp) ? 2 : 1;
  mp.bf16_expert_grads = opt.bf16_expert_grads;
  mp.unfused_wgrad = opt.unfused_wgrad;
  mp.split_master = opt.split_master;
  mp.exp_avg_bf16 = opt.exp_avg_bf16;
  mp.exp_avg_sq_bf16 = opt.exp_avg_sq_bf16;
  mp.document_masks = opt.document_masking.enabled();
  mp.masked_loss = opt.masked_loss;
  if (opt.tp_map) {
    mp.tp = opt.tp_map->tp();
    mp.sequence_parallel = opt.tp_map->sequence_parallel() && mp.tp > 1;
  }
  if (opt.dp_group && parallel::shards_optimizer(opt.dp_sharding)) {
    mp.fsdp = std::make_shared<FsdpPlan>(
        plan_fsdp(layout, spec.num_layers, opt.dp_group->world_size(), opt.dp_group->rank(), opt.dp_sharding));
    mp.zero_ranges = 0;  // the places and the shard are cleared whole
  }
  if (opt.cp_group && opt.cp_group->world_size() > 1) mp.cp = opt.cp_group->world_size();
  if (opt.ep_group && opt.ep_group->world_size() > 1) mp.ep = opt.ep_group->world_size();
  mp.ep_buffer_factor = opt.ep_buffer_factor;
  return mp;
}

CudaModel::CudaModel(const train::ModelSpec& spec, const CudaModelOptions& opt, CudaOps ops)
    : spec_(spec), layout_(train::make_param_layout(spec)), opt_(opt) {
  if (opt_.max_seq == 0) opt_.max_seq = spec_.seq_length;
  if (opt_.max_seq > spec_.seq_length) {
    throw ConfigError(fmt::format("sequence length {} exceeds the model's seq_length {}", opt_.max_seq, spec_.seq_length));
  }
  check_shapes(spec_, opt_.tp_map ? opt_.tp_map->tp() : 1);
  check_fp8(spec_, opt_);
  if (opt_.fp8_delayed && !opt_.fp8_linear)
    throw RuntimeError("cuda model: fp8_delayed without fp8_linear (the delayed state serves the FP8 linear slots)");
  if (opt_.fp8_moe && !opt_.fp8_linear)
    throw RuntimeError("cuda model: fp8_moe without fp8_linear (the experts follow the linear layers' FP8 format)");
  if (opt_.fp8_moe && spec_.moe.enabled()) {
    for (const auto& [what, v] : {std::pair<const char*, int64_t>{"moe_ffn_hidden_size", spec_.moe.ffn_hidden_size},
                                  {"moe_shared_expert_intermediate_size", spec_.moe.shared_ffn_hidden_size}})
      if (v % opt_.fp8_multiple != 0) {
        const int64_t tp = opt_.tp_map ? opt_.tp_map->tp() : 1;
        throw ConfigError(fmt::format("fp8: the FP8 expert GEMMs need {} to be a multiple of {}, got {}{}", what,
                                      opt_.fp8_multiple, v,
                                      tp > 1 ? fmt::format(" per tensor-parallel rank (the key / {})", tp) : ""));
      }
  }
  opt_.loss_slots = std::max<int64_t>(1, opt_.loss_slots);
  const bool host = opt_.device == Device::CPU;
  if (opt_.optimizer_in_backward && (opt_.loss_slots != 1 || !opt_.optimizer_state || opt_.flat_elems != 0)) {
    throw ConfigError(fmt::format("the optimizer in the backward updates each layer once per backward: it needs one "
                                  "micro-batch per step (got {}) and the whole optimizer state on this GPU (no ZeRO-1)",
                                  opt_.loss_slots));
  }
  if (opt_.bf16_expert_grads) {
    const char* why = !spec_.moe.enabled()        ? "the model has no experts"
                      : !opt_.optimizer_in_backward ? "they are written once, never accumulated: it needs the optimizer in "
                                                      "the backward (one micro-batch a step)"
                      : opt_.fp8_moe                ? "the FP8 experts' weight gradients are f32"
                      : opt_.zero_grad_full         ? "with zero_grad_full every GEMM accumulates into its gradient"
                      : host                        ? "host mode computes in f32"
                                                    : nullptr;
    if (why) throw ConfigError(fmt::format("bf16 expert gradients: {}", why));
  }
  if (opt_.split_master) {
    const char* why = host                                ? "host mode computes on the fp32 master itself"
                      : !opt_.optimizer_state || opt_.flat_elems != 0 ? "ZeRO-1 keeps the master weights in its shards"
                      : opt_.dp_group && parallel::shards_optimizer(opt_.dp_sharding)
                          ? "sharded data parallelism keeps the master weights in its chunks"
                      : !opt_.muon.empty() ? "Muon updates its matrices' fp32 masters"
                                           : nullptr;
    if (why) throw ConfigError(fmt::format("split master weights: {}", why));
  }
  if (opt_.exp_avg_bf16 || opt_.exp_avg_sq_bf16) {
    const char* why = !opt_.optimizer_state || opt_.flat_elems != 0
                          ? "ZeRO-1's bucketed reducer keeps f32 moments in its shards"
                      : !opt_.muon.empty() ? "Muon keeps its momentum in the first-moment buffer"
                                           : nullptr;
    if (why) throw ConfigError(fmt::format("bf16 AdamW moments: {}", why));
  }
  if (host && (!opt_.optimizer_state || opt_.flat_elems != 0)) {
    throw RuntimeError("cuda model: host mode keeps its own optimizer state and unpadded buffers");
  }
  const bool tp = opt_.tp_map && opt_.tp_map->tp() > 1;
  if (tp) {
    const train::TpShardMap& map = *opt_.tp_map;
    const train::ModelSpec& local = map.local_spec();
    if (spec_.num_attention_heads != local.num_attention_heads || spec_.num_query_groups != local.num_query_groups ||
        spec_.ffn_hidden_size != local.ffn_hidden_size || spec_.padded_vocab_size != local.padded_vocab_size ||
        spec_.vocab_size != local.vocab_size || spec_.hidden_size != local.hidden_size) {
      throw RuntimeError("cuda model: under tensor parallelism the spec must be the shard map's local spec");
    }
    if (!opt_.tp_group) throw RuntimeError("cuda model: tensor parallelism needs its process group (tp_group)");
    if (map.sequence_parallel()) {
      const int64_t N = opt_.max_batch * (opt_.max_seq == 0 ? spec_.seq_length : opt_.max_seq);
      if (N % map.tp() != 0)
        throw ConfigError(fmt::format("sequence_parallel: micro_batch_size x seq_length = {} tokens do not split over "
                                      "tensor_model_parallel_size {}",
                                      N, map.tp()));
      // The row-parallel biases' gradients come from the norms' column sums of each rank's rows
      // (BiasGrad Norm / Ones); the other two variants would sum the whole batch on every rank.
      if (opt_.bias_grad == BiasGrad::Separate || opt_.bias_grad == BiasGrad::Gemm)
        throw RuntimeError("cuda model: sequence parallelism takes the bias gradients from the norms (BiasGrad Norm or Ones)");
    }
    if (!opt_.optimizer_state || opt_.flat_elems != 0)
      throw ConfigError("the cuda backend's tensor parallelism with a distributed optimizer is not implemented yet");
  }
  const bool fsdp = opt_.dp_group && parallel::shards_optimizer(opt_.dp_sharding);
  if (fsdp) {
    const std::string what = fmt::format("data_parallel_sharding_strategy {}", parallel::dp_sharding_name(opt_.dp_sharding));
    if (opt_.optimizer_in_backward) throw ConfigError(what + " with optimizer_in_backward is not implemented");
    if (!opt_.muon.empty()) throw ConfigError("optimizer: muon with " + what + " is not implemented");
    if (!opt_.optimizer_state || opt_.flat_elems != 0)
      throw ConfigError(what + " keeps its own shard of the optimizer state (no use_distributed_optimizer buffers)");
  }
  const bool cp = opt_.cp_group && opt_.cp_group->world_size() > 1;
  if (cp) {
    const int64_t n = opt_.cp_group->world_size();
    const std::string what = fmt::format("context_parallel_size {}", n);
    if (opt_.document_masking.enabled())
      throw ConfigError(what + " with reset_attention_mask / reset_position_ids is not implemented yet");
    if (spec_.sliding_window > 0) throw ConfigError(what + " with a sliding window is not implemented yet");
    if (opt_.max_batch % 2 != 0)
      throw RuntimeError(fmt::format("cuda model: {}: max_batch {} counts chunk rows (two per sequence)", what, opt_.max_batch));
  }
  const bool ep = opt_.ep_group && opt_.ep_group->world_size() > 1;
  if (ep) {
    const int64_t n = opt_.ep_group->world_size();
    if (!opt_.ep_map || opt_.ep_map->ep() != n || opt_.ep_map->rank() != opt_.ep_group->rank())
      throw RuntimeError("cuda model: expert parallelism needs the map of its group's size and rank (ep_map)");
    if (spec_.moe.held_experts() != opt_.ep_map->local_experts() || spec_.moe.first_expert != opt_.ep_map->first_expert())
      throw RuntimeError("cuda model: under expert parallelism the spec must be the map's local spec");
    const char* why = tp                             ? "tensor parallelism"
                      : !opt_.optimizer_state || opt_.flat_elems != 0
                          ? "use_distributed_optimizer's bucketed buffers (ZeRO-1 runs in the model beside ep)"
                                                     : nullptr;
    if (why) throw ConfigError(fmt::format("expert_model_parallel_size {} with {} is not implemented yet on the cuda backend", n, why));
    if (opt_.optimizer_in_backward && !opt_.grad_mean_group && opt_.ep_dense_group)
      throw RuntimeError("cuda model: the optimizer in the backward beside expert parallelism needs grad_mean_group (the ep x dp ranks)");
  } else if (opt_.ep_map && opt_.ep_map->ep() > 1) {
    throw RuntimeError("cuda model: an expert-parallel map without its group (ep_group)");
  }
  // Muon's tensors are this model's own matrices: under tp this rank's pieces of the global ones,
  // under ep its experts' (whole), whatever spec the options were made from.
  if (!opt_.muon.empty()) opt_.muon = train::muon_tensors(spec_, layout_);
  stream_.host = host;
  if (!host) CUDA_CHECK(cudaStreamCreateWithFlags(&stream_.stream, cudaStreamNonBlocking));
  if (opt_.optimizer_in_backward) {
    mean_group_ = opt_.grad_mean_group ? opt_.grad_mean_group : cp ? opt_.cp_group : nullptr;
    if (opt_.grad_mean && !mean_group_)
      throw RuntimeError("cuda model: grad_mean without its group (grad_mean_group, or cp_group for cp alone)");
    if (cp && opt_.grad_mean_group && opt_.grad_mean_group->world_size() % opt_.cp_group->world_size() != 0) {
      throw RuntimeError(fmt::format("cuda model: grad_mean_group of {} ranks beside cp {}: it must span the dp x cp ranks",
                                     opt_.grad_mean_group->world_size(), opt_.cp_group->world_size()));
    }
    if (mean_group_) mean_nccl_ = device_group(*mean_group_, stream_, "the optimizer in the backward's gradient mean");
  } else if (opt_.grad_mean || opt_.grad_mean_group) {
    throw RuntimeError("cuda model: grad_mean_group serves the optimizer in the backward (optimizer_in_backward)");
  }
  if (opt_.fp8_delayed) {
    for (parallel::ProcessGroup* g : opt_.fp8_amax_groups) {
      if (!g) throw RuntimeError("cuda model: a null fp8_recipe delayed amax reduction group");
      amax_nccl_.push_back(device_group(*g, stream_, "fp8_recipe delayed's amax reduction"));
    }
  }

  GradClearing clearing = plan_grad_clearing(
      layout_, [this](const std::string& name) { return Decoder::written_by_first_gemm(spec_, name); });
  const MemoryPlanOptions mp = memory_plan_options(spec_, layout_, opt_, ops);
  plan_ = std::make_unique<MemoryPlan>(spec_, layout_, mp);
  InBackward in_backward;
  if (opt_.optimizer_in_backward) {
    in_backward.points = grad_ready_points(layout_);
    in_backward.written_first = [this](const std::string& name) { return Decoder::written_by_first_gemm(spec_, name); };
    in_backward.clear_all = opt_.zero_grad_full;
  }
  if (fsdp) {
    // The optimizer sees the shard as a model of its own: its pieces of the tensors (decay as theirs),
    // the chunks' master weights, moments, averaged gradient and bf16 copy, the model's status.
    fsdp_plan_ = mp.fsdp;
    std::vector<int64_t> origins;  // the pieces' rounding keys: their offsets in the whole layout
    shard_layout_ = shard_layout(*fsdp_plan_, layout_, &origins);
    const StateBuffers& st = plan_->state;
    shard_state_ = st;
    shard_state_.grads = st.shard_grads;
    shard_state_.weights = st.shard_weights;
    shard_state_.zero_table = TensorView();
    shard_place_.elems = fsdp_plan_->shard_elems;
    for (const train::ParamTensor& t : shard_layout_.tensors) shard_place_.offset.push_back(t.offset);
    shard_place_.in_window.assign(shard_layout_.tensors.size(), false);
    GradClearing whole;
    whole.memset_ranges.push_back({0, fsdp_plan_->shard_elems});
    optimizer_ = std::make_unique<OptimizerState>(shard_layout_, shard_state_, shard_place_, plan_->state_arena(),
                                                  std::move(whole), true, stream_, ops, nullptr,
                                                  std::vector<train::MuonTensor>{}, OptimizerState::MuonPieceFn{},
                                                  std::move(origins));
    optimizer_->norm_over(std::vector<bool>(shard_layout_.tensors.size(), true));
    fsdp_ = std::make_unique<FsdpComm>(*opt_.dp_group, fsdp_plan_, plan_->state, stream_);
  } else {
    optimizer_ = std::make_unique<OptimizerState>(
        layout_, plan_->state, plan_->grad_placement(), plan_->state_arena(), std::move(clearing), opt_.optimizer_state,
        stream_, ops, opt_.optimizer_in_backward ? &in_backward : nullptr, opt_.muon,
        tp && !opt_.muon.empty() ? tp_muon_pieces() : OptimizerState::MuonPieceFn());
    if (muon_stage_elems_ > 0) {
      const size_t bytes = size_t(muon_stage_elems_) * sizeof(float) + 2 * turbo::Arena::kDefaultAlign;
      muon_stage_arena_ = host ? turbo::make_host_arena(bytes) : turbo::make_device_arena(bytes);
      muon_stage_ = muon_stage_arena_->tensor(turbo::DType::F32, {muon_stage_elems_}, "Muon's gathered column pieces");
    }
  }
  DecoderOptions dec;
  dec.bias_grad = opt_.bias_grad;
  dec.gelu_unfused_forward = opt_.gelu_unfused_forward;
  dec.gelu_unfused_backward = opt_.gelu_unfused_backward;
  dec.document_masking = opt_.document_masking;
  dec.masked_loss = opt_.masked_loss;
  dec.bf16_edge_layers = opt_.fp8_linear ? opt_.fp8_bf16_edge_layers : 0;
  dec.fp8_maxima = opt_.fp8_linear ? opt_.fp8_maxima.get() : nullptr;
  dec.fp8_producers = opt_.fp8_linear && spec_.swiglu ? opt_.fp8_producers.get() : nullptr;
  dec.moe_swiglu_epilogue = moe_swiglu_epilogue_applies(opt_, spec_);
  dec.unfused_wgrad = opt_.unfused_wgrad;
  if (tp) {
    tp_ = std::make_unique<TpComm>(*opt_.tp_group, opt_.tp_map, stream_);
    dec.tp = tp_.get();
    // The norm counts each rank's own slices, and the replicated tensors once (on rank 0).
    std::vector<bool> counted(layout_.tensors.size());
    for (size_t i = 0; i < counted.size(); ++i) counted[i] = tp_->rank() == 0 || !opt_.tp_map->replicated(i);
    // Gradients each rank holds a part of: the map's (per-head q|k norms; with sequence
    // parallelism the norms), and with sequence parallelism the row-parallel biases too, whose
    // gradients the decoder takes from the norms' column sums over this rank's rows.
    auto ends_with = [](const std::string& s, const std::string& e) {
      return s.size() >= e.size() && s.compare(s.size() - e.size(), e.size(), e) == 0;
    };
    std::vector<bool> partial(layout_.tensors.size());
    for (size_t i = 0; i < partial.size(); ++i) {
      const std::string& name = layout_.tensors[i].name;
      partial[i] = opt_.tp_map->partial_grad(i) ||
                   (opt_.tp_map->sequence_parallel() && (ends_with(name, "attn.proj.bias") || ends_with(name, "mlp.proj.bias")));
    }
    // Sharded, the optimizer's tensors are this rank's pieces (shard_layout) and the averaged
    // gradients its chunks: every tp rank of a dp coordinate owns the same local ranges (the same
    // local layout, the same plan), so the tp sums and exchanges run on the shards' pieces.
    auto pieces = [&](int64_t local, int64_t count) {
      if (!fsdp_plan_) return std::vector<ShardSpan>{{local, local, count}};
      return shard_spans(*fsdp_plan_, local, count);
    };
    for (size_t i = 0; i < partial.size(); ++i) {
      if (!partial[i]) continue;
      for (const ShardSpan& sp : pieces(layout_.tensors[i].offset, layout_.tensors[i].numel)) tp_partial_.push_back({sp.shard, sp.count});
    }
    // Replicated key/value rows (tp above num_query_groups): counted by their first replica.
    std::vector<std::pair<int64_t, int64_t>> excluded;
    int64_t x_elems = 0;
    for (const train::TpKvExchange& x : opt_.tp_map->kv_exchanges()) {
      x_elems = std::max(x_elems, x.elems);
      std::vector<KvCopy>& copies = kv_copies_.emplace_back();
      for (const train::TpPiece& p : x.pieces) {
        for (const ShardSpan& sp : pieces(p.local, p.count)) {
          copies.push_back({p.global - x.global_begin + (sp.local - p.local), sp.shard, sp.count});
          if (!opt_.tp_map->counts_kv()) excluded.push_back({sp.shard, sp.count});
        }
      }
    }
    if (opt_.optimizer_in_backward) {
      // Each group's partial gradients and replicated key/value rows are summed just before its
      // update, and its norm over the group before its check (optimizer_state.h).
      const std::vector<int64_t> points = grad_ready_points(layout_);
      auto group_of = [&](int64_t offset) { return group_start(points, offset); };
      for (size_t i = 0; i < partial.size(); ++i)
        if (partial[i]) tp_group_partial_[group_of(layout_.tensors[i].offset)].push_back(i);
      for (size_t k = 0; k < opt_.tp_map->kv_exchanges().size(); ++k)
        tp_group_kv_[group_of(layout_.tensors[opt_.tp_map->kv_exchanges()[k].tensor].offset)].push_back(k);
      optimizer_->group_norms_over(counted, excluded, [this](const TensorView& t) { tp_->all_reduce(t); });
    } else if (fsdp_plan_) {
      optimizer_->norm_over(shard_counted(counted), excluded);
    } else {
      optimizer_->norm_over(counted, excluded);
    }
    if (x_elems > 0) {
      const size_t bytes = size_t(x_elems) * sizeof(float) + 2 * turbo::Arena::kDefaultAlign;
      kv_arena_ = host ? turbo::make_host_arena(bytes) : turbo::make_device_arena(bytes);
      kv_exchange_ = kv_arena_->tensor(turbo::DType::F32, {x_elems}, "replicated key/value gradient exchange");
    }
  }
  dec.fsdp = fsdp_.get();
  if (spec_.moe.global_aux_loss) {
    for (parallel::ProcessGroup* g : opt_.balance_groups) {
      if (!g || g->world_size() == 1) continue;
      balance_.push_back({g, device_group(*g, stream_, "global_aux_loss: the MoE token counts' sum")});
      dec.balance_ranks *= g->world_size();
    }
    if (!balance_.empty()) {
      dec.balance_sum = [this](const TensorView& t) {
        for (const auto& [g, nccl] : balance_) {
          in_stream_order(nccl, stream_, [&] {
            g->all_reduce(t.data, size_t(t.numel()), parallel::DType::F32, parallel::ReduceOp::Sum);
          });
        }
      };
    }
    balance_ranks_ = dec.balance_ranks;
  }
  if (cp) {
    cp_ = std::make_unique<CpAttention>(*opt_.cp_group, plan_->acts, ops, stream_, spec_.num_attention_heads,
                                        spec_.num_query_groups, spec_.head_dim());
    dec.cp = cp_.get();
  }
  if (ep) {
    ep_ = std::make_unique<EpComm>(*opt_.ep_group, stream_, opt_.ep_map->global_spec().moe.num_experts,
                                   plan_->options().moe_align, spec_.num_moe_layers(), plan_->acts.moe_rows,
                                   plan_->acts.moe_held_rows);
    dec.ep = ep_.get();
    // The norm counts this rank's experts, and the tensors every ep rank holds once (on rank 0).
    std::vector<bool> counted(layout_.tensors.size());
    for (size_t i = 0; i < counted.size(); ++i) counted[i] = ep_->rank() == 0 || opt_.ep_map->expert_tensor(i);
    if (opt_.optimizer_in_backward) {
      optimizer_->group_norms_over(counted, {}, [this](const TensorView& t) { ep_->sum(t); });
      const std::vector<int64_t> points = grad_ready_points(layout_);
      for (size_t i = 0; i < layout_.tensors.size(); ++i)
        ep_group_tensors_[group_start(points, layout_.tensors[i].offset)].push_back(i);
      if (opt_.ep_expert_group && opt_.ep_expert_group->world_size() > 1)
        ep_expert_nccl_ = device_group(*opt_.ep_expert_group, stream_, "expert parallelism's expert gradient means");
    } else if (fsdp_) {
      // Sharded: the optimizer's tensors are this rank's pieces (named as the tensors).
      optimizer_->norm_over(shard_counted(counted));
      set_fsdp_expert_parallel();
    } else {
      optimizer_->norm_over(counted);
    }
  }
  decoder_ = std::make_unique<Decoder>(spec_, layout_, dec, ops, *plan_, ctx());
  if (fsdp_) decoder_->on_grads_ready([this](int64_t offset) { fsdp_->grads_ready(offset); });
  if (opt_.optimizer_in_backward) decoder_->on_grads_ready([this](int64_t offset) { in_backward_ready(offset); });

  const StateBuffers& st = plan_->state;
  if (spec_.rope && !host) turbo::rope_build_table(st.rope_table, spec_.rotary_base, ctx(), spec_.rope_scaling);
  staging_ = std::make_unique<HostStaging>(opt_.loss_slots, opt_.max_batch * opt_.max_seq, st.status, stream_);
  stream_.zero(st.status);
  if (opt_.optimizer_state) optimizer_->set_moments(nullptr, nullptr);
  optimizer_->upload_clearing_table();
  plan_->init_ones(stream_);
  if (opt_.fp8_delayed) init_fp8_delayed();
  if (opt_.fp8_weights) {  // the layers the plan gave FP8 weight copies (memory_plan_options)
    opt_.fp8_weights->clear();
    const auto& copies = plan_->state.fp8_weights;
    for (size_t l = 0; l < copies.size(); ++l) {
      if (!copies[l][0].q.defined()) continue;
      const auto ws = fp8_linear_weights(plan_->params.layers[l]);
      for (size_t k = 0; k < ws.size(); ++k) {
        const StateBuffers::Fp8Weight& c = copies[l][k];
        if (!c.q.defined()) continue;  // an MoE layer: its attention linears only
        opt_.fp8_weights->add(ws[k]->data, {c.q, c.scale, c.q_t, c.scale_t});
      }
    }
    const auto& experts = plan_->state.fp8_expert_weights;
    for (size_t l = 0; l < experts.size(); ++l) {
      if (!experts[l][0].q.defined()) continue;
      const MoeParams& m = plan_->params.layers[l].moe;
      for (const auto& [w, c] : {std::pair{&m.fc.w, &experts[l][0]}, std::pair{&m.proj.w, &experts[l][1]}})
        opt_.fp8_weights->add(w->data, {c->q, c->scale, c->q_t, c->scale_t});
    }
  }
  if (opt_.fp8_saved) {  // the layers the plan gave FP8 input copies (memory_plan_options)
    opt_.fp8_saved->clear();
    const std::vector<bool>& saves = plan_->options().fp8_saves;
    for (size_t l = 0; l < saves.size(); ++l) {
      if (!saves[l]) continue;
      const LayerParams& p = plan_->params.layers[l];
      const LayerActs& a = plan_->acts.layers[l];
      if (a.ln1_q.defined()) opt_.fp8_saved->add(p.qkv_w.w.data, {a.ln1_q, a.ln1_qs});
      if (a.ln2_q.defined()) opt_.fp8_saved->add(p.fc_w.w.data, {a.ln2_q, a.ln2_qs});
      if (a.act_q.defined()) opt_.fp8_saved->add(p.out_w.w.data, {a.act_q, a.act_qs});
    }
  }
  stream_.zero(st.grads);  // once: the padding of a ZeRO-1 buffer and every tensor start at zero
  if (fsdp_) {
    stream_.zero(st.shard_grads);
    stream_.zero(st.weights);
  }
  zero_grad();
  sync();
}

CudaModel::~CudaModel() {
  // No throwing from a destructor; errors surface elsewhere. The stream's copies may still read
  // the pinned staging buffers: wait for them first.
  if (stream_.stream) cudaStreamSynchronize(stream_.stream);
  staging_.reset();
  if (stream_.stream) cudaStreamDestroy(stream_.stream);
}

ExecContext CudaModel::ctx() const {
  ExecContext c;
  c.stream = stream_.stream;
  c.scratch = plan_->scratch();
  return c;
}

void CudaModel::check_batch(int64_t B, int64_t T, int64_t slot, const char* what) const {
  if (B > opt_.max_batch || T > opt_.max_seq || B < 1 || T < 1) {
    throw RuntimeError(fmt::format("cuda model: batch {}x{} exceeds the buffers ({}x{})", B, T, opt_.max_batch,
                                   opt_.max_seq));
  }
  if (slot < 0 || slot >= opt_.loss_slots) {
    throw RuntimeError(fmt::format("cuda model: {} slot {} out of range (0..{})", what, slot, opt_.loss_slots - 1));
  }
}

// ---- host copies ----------------------------------------------------------------------------

void CudaModel::gather_full(const TensorView& shard, float* host) const {
  const FsdpPlan& f = *fsdp_plan_;
  const size_t n = size_t(f.shard_elems) * size_t(f.world);
  std::vector<float> gathered(n);
  // bf16 moments travel as they are held and are widened here (exactly).
  const bool b16 = shard.dtype == turbo::DType::BF16;
  const size_t bytes = n * (b16 ? 2 : 4);
  std::vector<uint16_t> g16(b16 ? n : 0);
  void* const landing = b16 ? static_cast<void*>(g16.data()) : static_cast<void*>(gathered.data());
  if (stream_.host) {
    fsdp_->all_gather(shard, TensorView(landing, shard.dtype, turbo::Device::CPU, {int64_t(n)}));
  } else {
    void* d = nullptr;
    CUDA_CHECK(cudaMalloc(&d, bytes));
    try {
      fsdp_->all_gather(shard, TensorView(d, shard.dtype, turbo::Device::CUDA, {int64_t(n)}));
      stream_.from_model(landing, d, bytes);
    } catch (...) {
      cudaFree(d);
      throw;
    }
    CUDA_CHECK(cudaFree(d));
  }
  for (size_t i = 0; i < g16.size(); ++i) gathered[i] = turbo::bf16_bits_to_float(g16[i]);
  shards_to_full(f, gathered.data(), host);
}

// The expert biases' slots in the flat layout, per MoE layer in order (StateBuffers::expert_bias's rows).
std::vector<const train::ParamTensor*> CudaModel::expert_bias_slots() const {
  std::vector<const train::ParamTensor*> out;
  if (!spec_.moe.expert_bias) return out;
  for (int64_t l = 0; l < spec_.num_layers; ++l)
    if (const train::ParamTensor* b = layout_.find(fmt::format("layers.{}.moe.router.expert_bias", l))) out.push_back(b);
  return out;
}

void CudaModel::set_params(const float* host) {
  const TensorView& eb = plan_->state.expert_bias;
  if (eb.defined()) {
    const std::vector<const train::ParamTensor*> slots = expert_bias_slots();
    std::vector<float> rows;
    for (const train::ParamTensor* b : slots) rows.insert(rows.end(), host + b->offset, host + b->offset + b->numel);
    stream_.to_model(eb.data, rows.data(), rows.size() * sizeof(float));
    stream_.sync();  // `rows` goes out of scope
  }
  if (fsdp_) {
    std::vector<float> shard(size_t(fsdp_plan_->shard_elems));
    full_to_shard(*fsdp_plan_, host, shard.data());
    optimizer_->set_params(shard.data());
    fsdp_->gather_resident();
    sync();
    return;
  }
  optimizer_->set_params(host);
  if (!opt_.optimizer_state) {  // the weights were staged in the gradient buffer
    zero_grad();
    sync();
  }
}
void CudaModel::get_params(float* host) const {
  if (fsdp_) {
    sync();
    gather_full(plan_->state.master, host);
  } else {
    optimizer_->get_params(host);
  }
  put_expert_bias(host);
}
void CudaModel::put_expert_bias(float* flat) const {
  const TensorView& eb = plan_->state.expert_bias;
  if (!eb.defined()) return;
  const std::vector<const train::ParamTensor*> slots = expert_bias_slots();
  std::vector<float> rows(static_cast<size_t>(eb.numel()));
  stream_.from_model(rows.data(), eb.data, eb.nbytes());
  size_t at = 0;
  for (const train::ParamTensor* b : slots) {
    std::copy_n(rows.data() + at, b->numel, flat + b->offset);
    at += static_cast<size_t>(b->numel);
  }
}
void CudaModel::set_moments(const float* m, const float* v) {
  if (fsdp_) {
    auto shard = [this](const float* full) {
      std::vector<float> s;
      if (full) {
        s.resize(size_t(fsdp_plan_->shard_elems));
        full_to_shard(*fsdp_plan_, full, s.data());
      }
      return s;
    };
    const std::vector<float> sm = shard(m), sv = shard(v);
    optimizer_->set_moments(m ? sm.data() : nullptr, v ? sv.data() : nullptr);
    return;
  }
  optimizer_->set_moments(m, v);
}
void CudaModel::get_moments(float* m, float* v) const {
  if (fsdp_) {
    sync();
    gather_full(plan_->state.m, m);
    gather_full(plan_->state.v, v);
    return;
  }
  optimizer_->get_moments(m, v);
}
void CudaModel::get_grads(float* host) const {
  if (fsdp_) {
    sync();
    gather_full(plan_->state.shard_grads, host);
    return;
  }
  optimizer_->get_grads(host);
}

// ---- the step -------------------------------------------------------------------------------

void CudaModel::init_fp8_delayed() {
  turbo::Fp8DelayedScaling& d = *opt_.fp8_delayed;
  d.clear();
  for (int64_t l = 0; l < spec_.num_layers; ++l) {
    const LayerParams& p = plan_->params.layers[static_cast<size_t>(l)];
    const bool shared = spec_.moe.shared_ffn_hidden_size > 0;  // as fp8_delayed_tensors counts
    for (const auto& [w, name] : fp8_delayed_weights(p, spec_.is_moe_layer(l), shared)) {
      if (!w->defined())
        throw RuntimeError(fmt::format("cuda model: layer {} has no {} weight for fp8_recipe delayed", l, name));
      d.add_layer(w->data, fmt::format("layer {} {}", l, name));
    }
  }
  const int64_t T = d.tensors(), len = d.options().history_len;
  const TensorView& buf = plan_->state.fp8_delayed;
  if (buf.numel() != T * (len + 3)) throw RuntimeError("cuda model: the FP8 delayed-scaling buffer is mis-sized");
  d.bind(buf.slice0(0, T * len), buf.slice0(T * len, T * (len + 1)), buf.slice0(T * (len + 1), T * (len + 2)));
  fp8_amax_stage_ = buf.slice0(T * (len + 2), T * (len + 3));
  std::vector<float> init(static_cast<size_t>(T * (len + 3)), 0.0f);  // empty histories
  for (int64_t t = 0; t < T; ++t) {
    init[static_cast<size_t>(T * len + t)] = 1.0f;  // scale 1 until a step is folded in (unused before)
    init[static_cast<size_t>(T * (len + 1) + t)] = d.fp8_max_of_tensor(t);
  }
  stream_.to_model(buf.data, init.data(), init.size() * sizeof(float));
  stream_.sync();  // init is a local
  fp8_pending_ = false;
}

CudaModel::Fp8DelayedState CudaModel::get_fp8_delayed() const {
  Fp8DelayedState st;
  if (!opt_.fp8_delayed) return st;
  const turbo::Fp8DelayedScaling& d = *opt_.fp8_delayed;
  st.tensors = d.tensors();
  st.history_len = d.options().history_len;
  st.history.resize(static_cast<size_t>(st.tensors * st.history_len));
  st.scale.resize(static_cast<size_t>(st.tensors));
  stream_.from_model(st.history.data(), d.history().data, st.history.size() * sizeof(float));
  stream_.from_model(st.scale.data(), d.scale().data, st.scale.size() * sizeof(float));
  st.use_history = d.use_history;
  st.pending = fp8_pending_;
  return st;
}

void CudaModel::set_fp8_delayed(const Fp8DelayedState& in) {
  if (!opt_.fp8_delayed) throw RuntimeError("cuda model: set_fp8_delayed without fp8_recipe delayed");
  turbo::Fp8DelayedScaling& d = *opt_.fp8_delayed;
  const int64_t T = d.tensors(), len = d.options().history_len;
  if (in.tensors != T)
    throw RuntimeError(fmt::format("fp8_recipe delayed: the saved state has amax histories for {} tensors, this model "
                                   "has {} (3 for each FP8 linear of its {} layers: q|k|v, attention output, MLP up and "
                                   "down; an MoE layer's experts and shared expert in place of the MLP)",
                                   in.tensors, T, spec_.num_layers));
  if (in.history_len < 1 || in.history.size() != static_cast<size_t>(T * in.history_len) ||
      in.scale.size() != static_cast<size_t>(T))
    throw RuntimeError(fmt::format("fp8_recipe delayed: the saved state holds {} history and {} scale values for {} "
                                   "tensors of history length {}",
                                   in.history.size(), in.scale.size(), T, in.history_len));
  for (float v : in.history)
    if (!(v >= 0.0f) || !std::isfinite(v))
      throw RuntimeError(fmt::format("fp8_recipe delayed: the saved amax history holds {} (amaxes are finite, >= 0)", v));
  for (float v : in.scale)
    if (!(v > 0.0f) || !std::isfinite(v))
      throw RuntimeError(fmt::format("fp8_recipe delayed: the saved scales hold {} (scales are finite, > 0)", v));
  std::vector<float> hist(static_cast<size_t>(T * len), 0.0f);
  const int64_t keep = std::min(len, in.history_len);  // the newest entries
  for (int64_t t = 0; t < T; ++t)
    std::copy_n(in.history.data() + t * in.history_len, keep, hist.data() + t * len);
  stream_.to_model(d.history().data, hist.data(), hist.size() * sizeof(float));
  stream_.to_model(d.scale().data, in.scale.data(), in.scale.size() * sizeof(float));
  stream_.sync();  // the host vectors are the caller's
  d.use_history = in.use_history;
  fp8_pending_ = in.pending;
}

void CudaModel::reduce_fp8_amaxes() {
  if (!opt_.fp8_delayed || !fp8_pending_) return;
  const auto& groups = opt_.fp8_amax_groups;
  if (std::none_of(groups.begin(), groups.end(), [](parallel::ProcessGroup* g) { return g->world_size() > 1; })) return;
  const turbo::Fp8DelayedScaling& d = *opt_.fp8_delayed;
  const int64_t T = d.tensors(), len = d.options().history_len;
  float* history = d.history().ptr<float>();
  // The newest entries are every len-th float of the histories: with len > 1 they go through the
  // staging floats, so the collective moves T floats rather than every history (the older
  // entries are the same on every rank already). One strided copy each way.
  float* newest = len == 1 ? history : fp8_amax_stage_.ptr<float>();
  auto copy_column = [&](float* dst, int64_t dst_pitch, const float* src, int64_t src_pitch) {
    if (stream_.host) {
      for (int64_t t = 0; t < T; ++t) dst[t * dst_pitch] = src[t * src_pitch];
    } else {
      CUDA_CHECK(cudaMemcpy2DAsync(dst, size_t(dst_pitch) * sizeof(float), src, size_t(src_pitch) * sizeof(float),
                                   sizeof(float), size_t(T), cudaMemcpyDeviceToDevice, stream_.stream));
    }
  };
  if (len > 1) copy_column(newest, 1, history, len);
  // Over a mesh, the max over each of its groups in turn is the max over all of its ranks.
  for (size_t k = 0; k < groups.size(); ++k) {
    parallel::ProcessGroup* group = groups[k];
    if (group->world_size() == 1) continue;
    in_stream_order(amax_nccl_[k], stream_,
                    [&] { group->all_reduce(newest, size_t(T), parallel::DType::F32, parallel::ReduceOp::Max); });
  }
  if (len > 1) copy_column(history, len, newest, 1);
}

void CudaModel::zero_grad() {
  mark(Phase::ZeroGrad);
  if (opt_.fp8_weights) opt_.fp8_weights->invalidate();  // the update changed the weights
  if (opt_.fp8_delayed && fp8_pending_) {
    // The start of a training step: the last step's amaxes become this step's scales. Here, not
    // after the update, so that a captured step holds it and a checkpoint saved between steps
    // holds the amaxes still to fold in (it resumes exactly).
    turbo::fp8_delayed_update(*opt_.fp8_delayed, ctx());
    opt_.fp8_delayed->use_history = true;
    fp8_pending_ = false;
  }
  if (fsdp_) {  // the GEMMs accumulate into the places, which each reduction leaves cleared
    stream_.zero(plan_->state.grads);
    optimizer_->zero_grad(true);
    return;
  }
  if (!opt_.zero_grad_full) decoder_->begin_step();  // the first GEMMs write their gradients
  optimizer_->zero_grad(opt_.zero_grad_full);
}

void CudaModel::stage_batch(const int32_t* tokens, const int32_t* targets, int64_t B, int64_t T, int64_t slot) {
  check_batch(B, T, slot, "batch");
  if (!tokens || !targets) throw RuntimeError("cuda model: stage_batch needs tokens and targets (the loss is fused with the head)");
  staging_->stage_batch(tokens, targets, B * T, slot, plan_->acts.tokens, plan_->acts.targets);
}

void CudaModel::forward_staged(int64_t B, int64_t T, float dloss, int64_t slot) {
  check_batch(B, T, slot, "loss");
  // Delayed FP8 scaling records a training forward's amaxes, not an evaluation's.
  if (opt_.fp8_delayed) opt_.fp8_delayed->record = dloss != 0.0f;
  // The step's FP8 weight copies serve its training micro-batches; an evaluation quantizes afresh.
  if (opt_.fp8_weights) opt_.fp8_weights->enabled = dloss != 0.0f;
  decoder_->forward(B, T, dloss, slot);
}

void CudaModel::begin_backward(bool last) {
  if (fsdp_) fsdp_->begin_backward(last);
}

void CudaModel::backward() {
  // The optimizer in the backward checks the loss before its first group: beside data or context
  // parallelism every rank must see the same one (a rank's own samples' or tokens' loss may alone
  // be non-finite), so the slots are averaged over the ranks first.
  if (mean_group_) {
    in_stream_order(mean_nccl_, stream_, [&] {
      const TensorView& l = plan_->state.loss_slots;
      mean_group_->all_reduce(l.data, size_t(l.numel()), comm_dtype(l, "the loss slots' mean"), parallel::ReduceOp::Avg);
    });
  }
  decoder_->backward();
  update_pending_group();  // the last group's
  if (opt_.fp8_delayed) fp8_pending_ = true;
  if (fsdp_) {
    fsdp_->end_backward();
    fsdp_->begin_backward(true);  // the next backward reduces unless told otherwise
  }
}

void CudaModel::grad_norm(float max_norm) {
  NvtxRange r("grad norm");
  mark(Phase::GradNorm);
  // Sharded: the ranks' chunks are disjoint, the squares summed over the group. With context
  // parallelism that group is dp x cp, whose reduce-scatter (a mean) has already averaged the cp
  // ranks' parts of each gradient.
  if (fsdp_ && !tp_) {
    optimizer_->grad_norm_squares(ctx());
    fsdp_->all_reduce(plan_->state.norm.slice0(0, 1));
    if (ep_) ep_->sum(plan_->state.norm.slice0(0, 1));  // each expert on one rank, the rest counted by rank 0
    optimizer_->finish_grad_norm(max_norm);
    return;
  }
  // Each cp rank's tokens gave a part (beside expert parallelism its groups span the cp ranks).
  if (cp_ && !fsdp_ && !ep_) cp_->all_reduce_mean(plan_->state.grads);
  if (ep_) {
    reduce_expert_parallel_grads();
    optimizer_->grad_norm_squares(ctx());
    ep_->sum(plan_->state.norm.slice0(0, 1));  // each expert on one rank, the rest counted by rank 0
    optimizer_->finish_grad_norm(max_norm);
    return;
  }
  if (!tp_) {
    optimizer_->grad_norm(max_norm, ctx());
    return;
  }
  // The gradients this rank updates: the whole local layout, or sharded its chunks (averaged over
  // the dp group by the reduce-scatter).
  const StateBuffers& st = plan_->state;
  const TensorView& grads = fsdp_ ? st.shard_grads : st.grads;
  // Partial gradients (the per-head q|k norm weights every rank's heads share) summed first, so
  // every rank updates its replicated copy alike.
  for (const auto& [offset, count] : tp_partial_) tp_->all_reduce(grads.slice0(offset, offset + count));
  // Replicated key/value rows: each replica's part summed through the tensor's global k|v range
  // (train/tensor_parallel.h; the ranks of other groups write other places of it).
  for (size_t k = 0; k < kv_copies_.size(); ++k)
    kv_exchange(k, [&](const KvCopy& c) { return grads.ptr<float>() + c.grad; });
  optimizer_->grad_norm_squares(ctx());
  if (fsdp_) fsdp_->all_reduce(st.norm.slice0(0, 1));
  tp_->all_reduce(st.norm.slice0(0, 1));
  optimizer_->finish_grad_norm(max_norm);
}

// A per-tensor flag of the layout as a flag per piece of this rank's shard (the shard's pieces are
// named as the tensors they come from).
std::vector<bool> CudaModel::shard_counted(const std::vector<bool>& counted) const {
  std::vector<bool> out(shard_layout_.tensors.size());
  for (size_t j = 0; j < out.size(); ++j) {
    const train::ParamTensor* t = layout_.find(shard_layout_.tensors[j].name);
    if (!t) throw RuntimeError("cuda model: shard piece of unknown tensor " + shard_layout_.tensors[j].name);
    out[j] = counted[static_cast<size_t>(t - layout_.tensors.data())];
  }
  return out;
}

// Expert parallelism beside sharded data parallelism (over the ranks holding the same experts):
// each unit's reduce-scatter averages it over them, so the dense tensors' part of its place is
// first averaged over the ep group, and the experts' part of this rank's reduced chunk is then
// divided by ep (each expert's gradient being every ep rank's tokens' sum).
void CudaModel::set_fsdp_expert_parallel() {
  const FsdpPlan& plan = *fsdp_plan_;
  // Per unit: the dense runs in its place's coordinates, the experts' runs in this rank's chunk's.
  std::vector<std::vector<std::pair<int64_t, int64_t>>> dense(plan.units.size()), experts(plan.units.size());
  auto cut = [](const std::vector<std::pair<int64_t, int64_t>>& runs, int64_t lo, int64_t hi,
                std::vector<std::pair<int64_t, int64_t>>& out) {
    for (const auto& [off, n] : runs) {
      const int64_t a = std::max(lo, off), b = std::min(hi, off + n);
      if (a < b) out.push_back({a - lo, b - a});
    }
  };
  for (size_t ui = 0; ui < plan.units.size(); ++ui) {
    const FsdpUnit& u = plan.units[ui];
    cut(opt_.ep_map->runs(false), u.begin, u.end, dense[ui]);
    cut(opt_.ep_map->runs(true), plan.owned_begin(u, plan.rank), plan.owned_end(u, plan.rank), experts[ui]);
  }
  FsdpComm::ExpertParallel hooks;
  hooks.dense_mean = [this, dense](int ui, const TensorView& place) {
    for (const auto& [off, n] : dense.at(static_cast<size_t>(ui))) ep_->mean(opt_.ep_group, place.slice0(off, off + n));
  };
  const float inv = 1.0f / static_cast<float>(ep_->size());
  hooks.expert_scale = [this, experts, inv](int ui, const TensorView& chunk, cudaStream_t s) {
    for (const auto& [off, n] : experts.at(static_cast<size_t>(ui))) ep_->scale(chunk.slice0(off, off + n), inv, s);
  };
  fsdp_->set_expert_parallel(std::move(hooks));
}

// Expert parallelism: the dense tensors' gradients averaged over their replicas (every ep x dp
// rank), the experts' over theirs (the dp ranks holding them) and divided by ep, as each is the sum
// of every ep rank's tokens routed to it while the loss is the mean over all ep x dp ranks.
void CudaModel::reduce_expert_parallel_grads() {
  const TensorView& g = plan_->state.grads;
  for (const auto& [off, n] : opt_.ep_map->runs(false)) ep_->mean(opt_.ep_dense_group, g.slice0(off, off + n));
  const float inv = 1.0f / static_cast<float>(ep_->size());
  for (const auto& [off, n] : opt_.ep_map->runs(true)) {
    ep_->mean(opt_.ep_expert_group, g.slice0(off, off + n));
    ep_->scale(g.slice0(off, off + n), inv);
  }
}

void CudaModel::kv_exchange(size_t k, const std::function<float*(const KvCopy&)>& grad) {
  const TensorView buf = kv_exchange_.slice0(0, opt_.tp_map->kv_exchanges()[k].elems);
  stream_.zero(buf);
  auto copy = [&](float* dst, const float* src, int64_t n) {
    if (stream_.host) std::memcpy(dst, src, size_t(n) * sizeof(float));
    else CUDA_CHECK(cudaMemcpyAsync(dst, src, size_t(n) * sizeof(float), cudaMemcpyDeviceToDevice, stream_.stream));
  };
  for (const KvCopy& c : kv_copies_[k]) copy(buf.ptr<float>() + c.buf, grad(c), c.count);
  tp_->all_reduce(buf);
  for (const KvCopy& c : kv_copies_[k]) copy(grad(c), buf.ptr<const float>() + c.buf, c.count);
}

// The optimizer in the backward: the group's tensor-parallel sums where its gradients lie (the
// shared window's places), just before its update.
void CudaModel::tp_reduce_group(int64_t offset) {
  if (auto it = tp_group_partial_.find(offset); it != tp_group_partial_.end())
    for (size_t i : it->second) tp_->all_reduce(optimizer_->grad_of(i));
  auto it = tp_group_kv_.find(offset);
  if (it == tp_group_kv_.end()) return;
  for (size_t k : it->second) {
    const size_t t = opt_.tp_map->kv_exchanges()[k].tensor;
    const TensorView g = optimizer_->grad_of(t);
    if (g.dtype != turbo::DType::F32) throw RuntimeError("cuda model: a replicated key/value gradient that is not f32");
    const int64_t base = layout_.tensors[t].offset;  // the pieces' gradient offsets are layout offsets
    kv_exchange(k, [&](const KvCopy& c) { return g.ptr<float>() + (c.grad - base); });
  }
}

// Muon under tensor parallelism: each rank's block of a Muon matrix (q, k, v, gate, up, an expert's
// part, a projection) is a row range (column-parallel) or a column range (row-parallel) of the
// global block, rank r's at r x its size (k and v replicated over tp / num_query_groups ranks: at
// r / replicas). Newton-Schulz needs the whole: the ranks' momentum updates are gathered over the
// tp group (distinct row ranges in rank order as they lie; otherwise through a staging buffer, each
// distinct piece then put in place), every rank orthogonalises the same whole matrix and applies
// its own piece (Megatron's Muon does the same with its tp shards).
OptimizerState::MuonPieceFn CudaModel::tp_muon_pieces() {
  const train::TpShardMap& map = *opt_.tp_map;
  auto global = std::make_shared<const std::vector<train::MuonTensor>>(
      train::muon_tensors(map.global_spec(), map.global_layout()));
  auto local = std::make_shared<const std::vector<train::MuonTensor>>(opt_.muon);
  return [this, global, local, &map](size_t tensor, const train::MuonBlock& lb, size_t index, turbo::MuonMatrix& mm) {
    const auto it = std::find_if(local->begin(), local->end(), [tensor](const train::MuonTensor& m) { return m.index == tensor; });
    if (it == local->end()) throw RuntimeError(fmt::format("cuda model: tensor {} is not Muon's", tensor));
    const train::MuonTpPiece p = train::muon_tp_piece(map, *global, *it, index);
    if (p.whole) return;
    mm.full_rows = p.full_rows;
    mm.full_cols = p.full_cols;
    mm.row0 = p.row0;
    mm.col0 = p.col0;
    const bool direct = !p.cols && p.rep == 1;  // distinct row ranges in rank order: the whole as gathered
    if (!direct) muon_stage_elems_ = std::max(muon_stage_elems_, lb.rows * lb.cols * map.tp());
    mm.gather = [this, p, direct](const TensorView& piece, const TensorView& whole) {
      const int64_t n = piece.numel(), tp = tp_->size();
      const TensorView flat(piece.data, piece.dtype, piece.device, {n});
      if (direct) {
        tp_->all_gather(flat, TensorView(whole.data, whole.dtype, whole.device, {n * tp}));
        return;
      }
      const TensorView stage = muon_stage_.slice0(0, n * tp);
      tp_->all_gather(flat, stage);
      train::Copy2d on_device;
      if (!stream_.host) {
        on_device = [this](float* dst, int64_t dp, const float* src, int64_t sp, int64_t width, int64_t height) {
          CUDA_CHECK(cudaMemcpy2DAsync(dst, size_t(dp) * 4, src, size_t(sp) * 4, size_t(width) * 4, size_t(height),
                                       cudaMemcpyDeviceToDevice, stream_.stream));
        };
      }
      train::assemble_muon_pieces(p, static_cast<int>(tp), stage.ptr<const float>(), piece.shape[0], piece.shape[1],
                                  whole.ptr<float>(), on_device);
    };
  };
}

// The optimizer in the backward: group `offset`'s gradients are final. Tensor parallelism: its
// partial gradients summed and its replicated k|v rows exchanged, in stream order. Data or context
// parallelism: each rank's samples or tokens gave a part of the gradients, which are averaged over
// the ranks so that every rank updates (and checks) the same values; the mean is issued on the
// group's stream and the update waits for it until the next group is ready (the layer below has
// run its backward, into the other gradient window) or the backward ends.
void CudaModel::in_backward_ready(int64_t offset) {
  NvtxRange r("adamw group");
  if (tp_) tp_reduce_group(offset);
  if (!mean_group_) {
    optimizer_->backward_ready(offset, opt_.loss_slots, ctx());
    return;
  }
  update_pending_group();
  if (ep_) {  // the dense tensors over the ep x dp ranks, the experts over their dp replicas
    auto mean_over = [&](parallel::ProcessGroup* g, parallel::NcclProcessGroup* nccl, bool experts) {
      if (!g || g->world_size() == 1) return;
      issue_in_order(nccl, stream_, [&] {
        for (size_t i : ep_group_tensors_.at(offset)) {
          if (opt_.ep_map->expert_tensor(i) != experts) continue;
          const TensorView t = optimizer_->grad_of(i);
          g->all_reduce(t.data, size_t(t.numel()), comm_dtype(t, "the optimizer in the backward: a gradient's mean"),
                        parallel::ReduceOp::Avg);
        }
      });
    };
    mean_over(mean_group_, mean_nccl_, false);
    mean_over(opt_.ep_expert_group, ep_expert_nccl_, true);
    mean_pending_ = offset;
    return;
  }
  issue_in_order(mean_nccl_, stream_, [&] {
    for (const TensorView& g : optimizer_->group_grads(offset))
      mean_group_->all_reduce(g.data, size_t(g.numel()), comm_dtype(g, "the optimizer in the backward: a gradient's mean"),
                              parallel::ReduceOp::Avg);
  });
  mean_pending_ = offset;
}

void CudaModel::update_pending_group() {
  if (mean_pending_ < 0) return;
  await_group(mean_nccl_, stream_);
  if (ep_) {  // each expert's gradient is every ep rank's tokens' sum: / ep for the mean over all ranks
    await_group(ep_expert_nccl_, stream_);
    const float inv = 1.0f / static_cast<float>(ep_->size());
    for (size_t i : ep_group_tensors_.at(mean_pending_))
      if (opt_.ep_map->expert_tensor(i)) ep_->scale(optimizer_->grad_of(i), inv);
  }
  optimizer_->backward_ready(mean_pending_, opt_.loss_slots, ctx());
  mean_pending_ = -1;
}

void CudaModel::check_step(int64_t n) {
  mark(Phase::StepCheck);
  optimizer_->check_step(n, opt_.loss_slots);
}

void CudaModel::set_hyper(const turbo::AdamWHyper& hp) {
  optimizer_->set_hyper(hp);
  if (stream_.host) return;  // the CPU optimizer takes hp itself
  // The kernel's own host-side formula, so eager and graph steps compute the same bits.
  // The step goes too (exact as a float below 2^24 steps): bf16 moments key their rounding by it.
  const float scalars[4] = {
      hp.lr, static_cast<float>(1.0 - std::pow(static_cast<double>(hp.beta1), static_cast<double>(hp.step))),
      static_cast<float>(1.0 - std::pow(static_cast<double>(hp.beta2), static_cast<double>(hp.step))),
      static_cast<float>(hp.step)};
  staging_->stage_scalars(scalars, plan_->state.hyper);
}

void CudaModel::update() {
  NvtxRange r("adamw");
  mark(Phase::Optimizer);
  optimizer_->update(ctx());
  if (fsdp_) fsdp_->gather_resident();
}

int CudaModel::enqueue_step_status() { return staging_->enqueue_status(); }

CudaModel::StepStatus CudaModel::wait_step_status(int ticket, int64_t n) const {
  const int64_t S = opt_.loss_slots;
  n = std::min(n, S);
  if (ticket < 0 || ticket > 1) throw RuntimeError(fmt::format("cuda model: step status ticket {} (0 or 1)", ticket));
  const float* status = staging_->wait_status(ticket);
  StepStatus st;
  // The training forward's tokens: a graph replay runs no host code, so the decoder's batch may
  // be an evaluation's since (train_tokens is only set by a forward with a gradient).
  const double tokens = static_cast<double>(decoder_->train_tokens());
  for (int64_t i = 0; i < n; ++i) st.loss_sum += static_cast<double>(status[i]) / tokens;
  st.grad_norm = status[S];
  st.finite = status[S + 2] > 0.0f;  // 1: finite; 0: skipped whole; -1: partly applied (step_check_group)
  st.partial = status[S + 2] < 0.0f;
  const ActivationBuffers& a = plan_->acts;
  if (a.moe_counts.defined()) {
    const int64_t per = a.moe_counts.numel() / S, sums = a.moe_sums.numel() / S;
    const float* base = status + S + 3;
    st.moe_counts.resize(static_cast<size_t>(n * per));
    std::memcpy(st.moe_counts.data(), base, st.moe_counts.size() * 4);
    st.moe_sums.assign(base + S * per, base + S * per + n * sums);
    int64_t seq = 0;  // the sequence-wise rows' words a slot, counts and sums each
    if (a.moe_seq_counts.defined()) {
      seq = a.moe_seq_counts.numel() / S;
      const float* sb = base + S * (per + sums);
      st.moe_seq_counts.resize(static_cast<size_t>(n * seq));
      std::memcpy(st.moe_seq_counts.data(), sb, st.moe_seq_counts.size() * 4);
      st.moe_seq_sums.assign(sb + S * seq, sb + S * seq + n * seq);
    }
    if (a.moe_cp_counts.defined()) {  // after the sequence-wise rows
      const int64_t per_cp = a.moe_cp_counts.numel() / S;
      const float* cb = base + S * (per + sums + 2 * seq);
      st.moe_cp_counts.assign(cb, cb + n * per_cp);
    }
  }
  return st;
}

void CudaModel::moe_report(const StepStatus& st, int64_t n, train::MoeStepStats& out) const {
  const ActivationBuffers& a = plan_->acts;
  if (!a.moe_counts.defined()) return;
  const int64_t Lm = a.moe_counts.size(1), E = spec_.moe.num_experts;
  const turbo::RouterConfig& cfg = decoder_->router_config();
  const int64_t N = decoder_->train_tokens();
  n = std::min<int64_t>(n, static_cast<int64_t>(st.moe_counts.size()) / std::max<int64_t>(1, Lm * 2 * E));
  for (int64_t s = 0; s < n; ++s) {
    int64_t m = 0;
    for (int64_t l = 0; l < spec_.num_layers; ++l) {
      if (!spec_.is_moe_layer(l)) continue;
      const int32_t* counts = st.moe_counts.data() + (s * Lm + m) * 2 * E;
      const float* sums = st.moe_sums.data() + (s * Lm + m) * (E + 1);
      int64_t dropped = 0;
      for (int64_t e = 0; e < E; ++e) dropped += counts[e] - counts[E + e];
      // Each listed balancing type's statistic (MoeSpec::Balance order: batch, sequence, global).
      double stat[3] = {0, 0, 0}, z;
      turbo::cpu::router_losses(&stat[0], &z, counts, sums, sums[E], N, cfg);
      const int64_t R = a.moe_cp_counts.defined() ? a.moe_cp_counts.size(2) / E : 0;
      // This rank's share of a switch loss over D ranks' tokens (their counts, summed in row r, its
      // own sums of p over the N D tokens), times D since the trainer logs the mean over the ranks,
      // over `micro` micro-batches' counts (whose mean is the load).
      const auto summed = [&](int64_t r, int64_t D, int64_t micro) {
        const float* g = st.moe_cp_counts.data() + ((s * Lm + m) * R + r) * E;
        std::vector<int32_t> whole(static_cast<size_t>(E));
        for (int64_t e = 0; e < E; ++e) whole[e] = static_cast<int32_t>(g[e]);
        double v, ignored;
        turbo::cpu::router_losses(&v, &ignored, whole.data(), sums, sums[E], N * D, cfg);
        return v * static_cast<double>(D) / static_cast<double>(micro);
      };
      // Context parallelism: the whole sequences' switch loss (the group's counts).
      if (spec_.moe.batch_aux_loss && opt_.cp_group && opt_.cp_group->world_size() > 1)
        stat[0] = summed(decoder_->cp_counts_row(), opt_.cp_group->world_size(), 1);
      if (a.moe_seq_counts.defined()) {  // the mean of each sequence's loss
        const turbo::cpu::SequenceRuns runs = decoder_->seq_runs(N, decoder_->train_seq());
        const int64_t rows = a.moe_seq_counts.size(2), at = (s * Lm + m) * rows * E;
        stat[1] = turbo::cpu::sequence_aux_loss(st.moe_seq_counts.data() + at, st.moe_seq_sums.data() + at, runs.seqs,
                                                runs.seq_len, cfg);
      }
      // global_aux_loss: the D ranks holding other tokens, the counts of micro-batches 1..s + 1.
      if (spec_.moe.global_aux_loss) stat[2] = summed(0, balance_ranks_, s + 1);
      const double aux = stat[static_cast<int>(spec_.moe.primary_balance())];
      std::vector<double> more;
      for (train::MoeSpec::Balance b : spec_.moe.more_balances()) more.push_back(stat[static_cast<int>(b)]);
      out.add(l, counts, dropped, aux, z, more);
      ++m;
    }
  }
}

std::vector<int32_t> CudaModel::read_moe_topk(int64_t layer, int64_t n) const {
  const TensorView& t = plan_->acts.moe.at(static_cast<size_t>(layer)).topk_idx;
  if (!t.defined()) throw RuntimeError(fmt::format("cuda model: layer {} is not a MoE layer", layer));
  std::vector<int32_t> out(static_cast<size_t>(n * spec_.moe.topk));
  stream_.from_model(out.data(), t.data, out.size() * sizeof(int32_t));
  return out;
}

void CudaModel::update_expert_bias(const std::vector<std::vector<int64_t>>& load) {
  if (!spec_.moe.expert_bias) return;
  std::vector<float> bias(static_cast<size_t>(spec_.moe.num_experts));
  for (int64_t l = 0; l < spec_.num_layers; ++l) {
    const TensorView& b = plan_->params.layers[l].moe.expert_bias;
    if (!b.defined()) continue;
    stream_.from_model(bias.data(), b.data, b.nbytes());
    turbo::cpu::router_bias_update(bias.data(), load.at(static_cast<size_t>(l)).data(), spec_.moe.num_experts,
                                   spec_.moe.bias_update_rate);
    stream_.to_model(b.data, bias.data(), b.nbytes());
  }
  sync();
}

void CudaModel::on_grads_ready(std::function<void(int64_t offset)> fn) {
  if (fsdp_) throw RuntimeError("cuda model: sharded data parallelism takes the gradients-ready reports");
  if (opt_.optimizer_in_backward) {
    throw RuntimeError("cuda model: the optimizer in the backward takes the gradients-ready reports (no data "
                       "parallelism with it)");
  }
  decoder_->on_grads_ready(std::move(fn));
}

double CudaModel::read_loss_sum(int64_t n) const {
  n = std::min(n, opt_.loss_slots);
  std::vector<float> sums(static_cast<size_t>(n));
  stream_.from_model(sums.data(), plan_->state.loss_slots.data, size_t(n) * 4);
  const double tokens = static_cast<double>(decoder_->batch() * decoder_->seq());
  double total = 0;
  for (float s : sums) total += static_cast<double>(s) / tokens;
  return total;
}

double CudaModel::read_grad_norm() const {
  float v[2];
  stream_.from_model(v, plan_->state.norm.data, sizeof(v));
  return v[0];
}

}  // namespace primus::backends::cuda
