#include "backends/cuda/model/memory_plan.h"

#include <fmt/format.h>

#include <algorithm>
#include <cmath>
#include <iterator>
#include <cstring>

#include "core/util/error.h"
#include "turbo/core/cuda_arena.h"
#include "turbo/core/cuda_check.h"
#include "turbo/kernels/cuda/elementwise.h"
#include "turbo/kernels/cuda/embedding.h"
#include "turbo/kernels/cuda/normalization.h"
#include "turbo/kernels/cuda/optimizer.h"
#include "turbo/ops/gemm.h"
#include "turbo/ops/gemm_fp8.h"
#include "turbo/ops/grouped_gemm_fp8.h"
#include "turbo/ops/head_norm.h"
#include "turbo/ops/moe.h"

namespace primus::backends::cuda {

using turbo::Arena;
using turbo::DType;

namespace {

enum class Pool { State, Acts };

size_t round_up(size_t n, size_t a) { return (n + a - 1) / a * a; }

// The first pass of MemoryPlan::plan only adds up sizes; the second takes the buffers from the
// arenas sized by the first.
class BufferPlan {
 public:
  BufferPlan(Arena* state, Arena* acts) : state_(state), acts_(acts) {}
  TensorView operator()(Pool pool, DType t, std::initializer_list<int64_t> shape, const char* what) {
    Arena* a = pool == Pool::State ? state_ : acts_;
    if (a) return a->tensor(t, shape, what);
    int64_t n = 1;
    for (int64_t d : shape) n *= d;
    const size_t bytes = round_up(size_t(n) * turbo::dtype_size(t), Arena::kDefaultAlign);
    (pool == Pool::State ? state_bytes : acts_bytes) += bytes;
    buffers.push_back({pool == Pool::State, what, bytes});
    return TensorView();
  }
  size_t state_bytes = 0, acts_bytes = 0;
  std::vector<PlannedBuffer> buffers;  // the counting pass's record, for MemoryPlan::sizes

 private:
  Arena *state_, *acts_;
};

// Sharded data parallelism: every gradient in its unit's place (fsdp.h).
GradPlacement fsdp_grad_placement(const FsdpPlan& f, const train::ParamLayout& layout) {
  GradPlacement g;
  g.offset = f.grad_offset;
  g.in_window.assign(layout.tensors.size(), false);
  g.elems = f.grad_elems;
  return g;
}

}  // namespace

// ---- ModelStream ----------------------------------------------------------------------------

void ModelStream::to_model(void* dst, const void* src, size_t bytes) const {
  if (host)
    std::memcpy(dst, src, bytes);
  else
    CUDA_CHECK(cudaMemcpyAsync(dst, src, bytes, cudaMemcpyHostToDevice, stream));
}

void ModelStream::from_model(void* dst, const void* src, size_t bytes) const {
  if (host) {
    std::memcpy(dst, src, bytes);
    return;
  }
  CUDA_CHECK(cudaMemcpyAsync(dst, src, bytes, cudaMemcpyDeviceToHost, stream));
  CUDA_CHECK(cudaStreamSynchronize(stream));
}

void ModelStream::zero(const TensorView& t) const {
  if (host)
    std::memset(t.data, 0, t.nbytes());
  else
    CUDA_CHECK(cudaMemsetAsync(t.data, 0, t.nbytes(), stream));
}

void ModelStream::sync() const {
  if (!host) CUDA_CHECK(cudaStreamSynchronize(stream));
}

// ---- MemoryPlan -----------------------------------------------------------------------------

MemoryPlan::MemoryPlan(const train::ModelSpec& spec, const train::ParamLayout& layout, const MemoryPlanOptions& opt)
    : MemoryPlan(spec, layout, opt, true) {}

MemoryPlanSizes MemoryPlan::sizes(const train::ModelSpec& spec, const train::ParamLayout& layout,
                                  const MemoryPlanOptions& opt) {
  MemoryPlan counted(spec, layout, opt, false);
  return counted.count();
}

MemoryPlan::MemoryPlan(const train::ModelSpec& spec, const train::ParamLayout& layout, const MemoryPlanOptions& opt,
                       bool allocate)
    : spec_(spec),
      layout_(layout),
      opt_(opt),
      grad_place_(opt.fsdp ? fsdp_grad_placement(*opt.fsdp, layout)
                           : place_grads(layout, opt.shared_grad_window ? opt.grad_windows : 0,
                                         grad_written_before_layer_backward)),
      act_(opt.host ? DType::F32 : DType::BF16) {
  if (opt_.fsdp && (opt_.shared_grad_window || opt_.flat_elems != 0 || !opt_.optimizer_state))
    throw RuntimeError("cuda model: sharded data parallelism keeps its own shard: no gradient window or ZeRO-1 buffers");
  if (opt_.shared_grad_window && opt_.flat_elems != 0)
    throw RuntimeError("cuda model: a shared gradient window and a padded (ZeRO-1) gradient buffer exclude each other");
  if (opt_.bf16_expert_grads) {
    const char* why = opt_.host                  ? "host mode (f32)"
                      : opt_.fsdp                  ? "sharded data parallelism"
                      : !opt_.shared_grad_window ? "no shared gradient window (the optimizer is not in the backward)"
                                                 : nullptr;
    if (why) throw RuntimeError(fmt::format("cuda model: bf16 expert gradients with {}", why));
    grad_place_.bf16.assign(layout_.tensors.size(), false);
    for (size_t i = 0; i < layout_.tensors.size(); ++i) grad_place_.bf16[i] = is_expert_weight(layout_.tensors[i].name);
  }
  if (opt_.flat_elems != 0 && opt_.flat_elems < layout_.total) {
    throw RuntimeError(fmt::format("cuda model: flat_elems {} is below the parameter count {}", opt_.flat_elems,
                                   layout_.total));
  }
  if (opt_.policy.size() != static_cast<size_t>(spec_.num_layers)) {
    throw RuntimeError(fmt::format("cuda model: {} recompute policies for {} layers", opt_.policy.size(),
                                   spec_.num_layers));
  }
  if (!allocate) return;
  const MemoryPlanSizes sz = count();
  auto make_arena = [this](size_t bytes) {
    return opt_.host ? turbo::make_host_arena(bytes) : turbo::make_device_arena(bytes);
  };
  state_ = make_arena(sz.state_arena);
  acts_ = make_arena(sz.acts_arena);
  scratch_ = make_arena(sz.scratch_arena);
  BufferPlan take(state_.get(), acts_.get());
  plan(take);
  if (opt_.host && !opt_.fsdp) state.weights = state.master;  // fp32 compute on the master weights themselves
  view_params();
}

MemoryPlanSizes MemoryPlan::count() {
  BufferPlan counter(nullptr, nullptr);
  plan(counter);
  MemoryPlanSizes sz;
  // The AdamW descriptor table; with the optimizer in the backward one per group (a layer, the
  // embeddings, the final norm and head), each with its own count slot and alignment.
  const size_t groups = opt_.shared_grad_window ? size_t(spec_.num_layers) + 2 : 1;
  sz.optimizer_table = round_up(turbo::cuda::multi_tensor_table_bytes(static_cast<int>(layout_.tensors.size())),
                                Arena::kDefaultAlign) +
                       (groups - 1) * (sizeof(int64_t) + 256);
  // + one alignment each: an arena's base need not sit on kDefaultAlign.
  sz.state_arena = counter.state_bytes + sz.optimizer_table + Arena::kDefaultAlign;
  sz.acts_arena = counter.acts_bytes + Arena::kDefaultAlign;
  sz.scratch_arena = scratch_bytes();
  sz.scratch_exact = opt_.host || opt_.query_device;
  sz.buffers = std::move(counter.buffers);
  return sz;
}

// Scratch: the largest single borrow of any op, the attention's included (they borrow one at a
// time, in stream order, each within an ArenaScope). On the host only the fallback attention
// and the FP8 linear layers borrow.
size_t MemoryPlan::scratch_bytes() const {
  const int64_t N = opt_.max_batch * opt_.max_seq, C = spec_.hidden_size;
  const int64_t pad = opt_.ones_pad;
  size_t bytes = 0;
  if (!opt_.host) {
    // (the optimizer's chunks hold at least 256 elements each)
    const size_t chunks_bound = size_t(layout_.total / 256) + layout_.tensors.size() + 1;
    bytes = std::max({turbo::cuda::grad_norm_scratch_bytes(int64_t(chunks_bound)),
                      size_t(spec_.qkv_dim() + spec_.fc_dim()) * 4,
                      pad == 0 ? size_t{0}
                               : std::max(turbo::linear_backward_weight_ones_scratch_bytes(spec_.qkv_dim(), C + pad),
                                          turbo::linear_backward_weight_ones_scratch_bytes(spec_.fc_dim(), C + pad))});
    // These ask the device (grids bounded by its SM count and occupancy, CUB's temporary storage).
    if (opt_.query_device) {
      bytes = std::max({bytes, turbo::cuda::norm_backward_scratch_bytes(N, C),
                        turbo::cuda::embedding_backward_scratch_bytes(N),
                        size_t(std::max({turbo::cuda::column_sum_partials(N, spec_.qkv_dim()),
                                         turbo::cuda::column_sum_partials(N, spec_.fc_dim()),
                                         turbo::cuda::column_sum_partials(N, C)})) * 4 + Arena::kDefaultAlign});
    }
  }
  if (opt_.fp8_linear) {  // the linear slots' quantized copies (one layer at a time)
    const int64_t F = spec_.fc_dim(), Fin = spec_.swiglu ? spec_.ffn_hidden_size : spec_.fc_dim();
    bytes = std::max({bytes, turbo::linear_fp8_scratch_bytes(N, C, spec_.qkv_dim()),
                      turbo::linear_fp8_scratch_bytes(N, C, C), turbo::linear_fp8_scratch_bytes(N, spec_.q_dim(), C),
                      turbo::linear_fp8_scratch_bytes(N, C, F),
                      turbo::linear_fp8_scratch_bytes(N, Fin, C)});
  }
  // Attention: what the caller says its implementation needs, and on the device at least room
  // for Turbo's flash backward (f32 dq and row sums) and a cuDNN workspace.
  const int64_t H = spec_.num_attention_heads, QD = spec_.q_dim();
  const size_t turbo_attention = size_t(2 * N * QD) * 4 + size_t(N * H) * 4 + (size_t{256} << 20);
  bytes = std::max(bytes, opt_.host ? opt_.attention_scratch_bytes
                                    : std::max(opt_.attention_scratch_bytes, turbo_attention));
  if (spec_.qk_layernorm && !spec_.qk_norm_whole && !opt_.host)  // the per-head norms' weight-gradient partials
    bytes = std::max(bytes, turbo::head_norm_scratch_bytes(N, spec_.head_dim()));
  if (spec_.qk_layernorm && spec_.qk_norm_whole && !opt_.host && opt_.query_device)  // the whole-width norms' (turbo's norm op)
    bytes = std::max({bytes, turbo::cuda::norm_backward_scratch_bytes(N, QD),
                      turbo::cuda::norm_backward_scratch_bytes(N, spec_.kv_dim())});
  if (opt_.fp8_moe) {  // the FP8 expert GEMMs' quantized copies (one product at a time)
    const train::MoeSpec& e = spec_.moe;
    // Under expert parallelism the GEMMs run over the held rows (this rank's experts' groups, what
    // every rank sent them): as many groups as experts at most, never more rows than
    // held_rows_bound (moe_rows_bound without ep).
    const int64_t M = held_rows_bound(N);
    bytes = std::max({bytes, turbo::grouped_gemm_fp8_scratch_bytes(M, e.num_experts, 2 * e.ffn_hidden_size, C),
                      turbo::grouped_gemm_fp8_scratch_bytes(M, e.num_experts, C, e.ffn_hidden_size)});
  }
  if (spec_.moe.enabled() && !opt_.host) {  // the routing ops' partial sums and plan tables (device only)
    const train::MoeSpec& e = spec_.moe;
    bytes = std::max(bytes, turbo::moe_scratch_bytes(N, e.topk, e.num_experts, e.capacity(N),
                                                     e.drop_by_position ? turbo::DropPolicy::Position
                                                                        : turbo::DropPolicy::Probs));
  }
  if (opt_.unfused_wgrad) {  // one weight's gradient, held while the op that computes it borrows as well
    int64_t largest = 0;
    for (const train::ParamTensor& t : layout_.tensors)
      if (t.shape.size() >= 2) largest = std::max(largest, t.numel);
    bytes += size_t(largest) * 4 + Arena::kDefaultAlign;
  }
  return round_up(bytes, size_t{1} << 20);
}

template <class Take>
void MemoryPlan::plan(Take&& take) {
  const int64_t P = layout_.total, N = opt_.max_batch * opt_.max_seq;
  const int64_t NL = opt_.sequence_parallel ? N / opt_.tp : N;  // the rows of this rank's residual stream
  const int64_t C = spec_.hidden_size, H = spec_.num_attention_heads, KVD = spec_.kv_dim();
  const int64_t F = spec_.ffn_hidden_size, FC = spec_.fc_dim(), V = spec_.padded_vocab_size;
  const int64_t QD = spec_.q_dim(), KV = spec_.num_query_groups;
  const int64_t PF = std::max(P, opt_.flat_elems);  // padded for ZeRO-1
  const bool host = opt_.host;
  StateBuffers& s = state;
  if (const FsdpPlan* f = opt_.fsdp.get()) {
    const int64_t Sh = f->shard_elems;
    s.master = take(Pool::State, DType::F32, {Sh}, "fp32 master weights (this rank's shard)");
    s.shard_grads = take(Pool::State, DType::F32, {Sh}, "fp32 averaged gradients (this rank's shard)");
    s.m = take(Pool::State, opt_.exp_avg_bf16 ? DType::BF16 : DType::F32, {Sh}, "AdamW first moments (this rank's shard)");
    s.v = take(Pool::State, opt_.exp_avg_sq_bf16 ? DType::BF16 : DType::F32, {Sh},
               "AdamW second moments (this rank's shard)");
    if (!host) s.shard_weights = take(Pool::State, DType::BF16, {Sh}, "bf16 weights (this rank's shard)");
    // optim reduce-scatters straight into the averaged gradient (fsdp_comm.cpp): no staging chunk.
    if (f->shard_grads) s.fsdp_tmp = take(Pool::State, DType::F32, {f->max_chunk}, "fp32 reduce-scatter chunk");
    s.grads = take(Pool::State, DType::F32, {f->grad_elems}, "fp32 gradients (the units' places)");
    s.weights = take(Pool::State, host ? DType::F32 : DType::BF16, {f->weight_elems},
                     f->shard_params ? "weights (gathered: embeddings, top and two layer places)"
                                     : "weights (gathered: every unit)");
  } else {
  if (opt_.optimizer_state) {
    s.master = opt_.split_master ? take(Pool::State, DType::U16, {P}, "low halves of the fp32 master weights")
                                 : take(Pool::State, DType::F32, {P}, "fp32 master weights");
  }
  s.grads = take(Pool::State, DType::F32, {opt_.shared_grad_window ? grad_place_.elems : PF},
                 !opt_.shared_grad_window ? "fp32 gradients"
                 : opt_.grad_windows == 2 ? "fp32 gradients (the layers alternate between two windows)"
                                          : "fp32 gradients (the layers share one window)");
  if (opt_.optimizer_state) {
    s.m = take(Pool::State, opt_.exp_avg_bf16 ? DType::BF16 : DType::F32, {P}, "AdamW first moments");
    s.v = take(Pool::State, opt_.exp_avg_sq_bf16 ? DType::BF16 : DType::F32, {P}, "AdamW second moments");
  }
  if (!host) s.weights = take(Pool::State, DType::BF16, {PF}, "bf16 weights");
  }
  if (spec_.rope && !host)
    s.rope_table = take(Pool::State, DType::F32, {spec_.seq_length, spec_.head_dim() / 2, 2}, "RoPE table");
  const int64_t S = opt_.loss_slots;
  // The MoE routing statistics ride in the status buffer, so the one D2H copy of a step's status
  // carries them too (i32 counts as bit patterns, then f32 sums; see ActivationBuffers).
  const int64_t Lm = spec_.num_moe_layers(), E = spec_.moe.num_experts;
  // Context parallelism: a micro-batch is two chunks of each sequence, so half as many sequences.
  const int64_t seq_rows = Lm > 0 && spec_.moe.seq_aux_loss ? (opt_.cp > 1 ? opt_.max_batch / 2 : opt_.max_batch) : 0;
  // global_aux_loss: a row of counts summed over the ranks holding other tokens and over the step's
  // micro-batches so far. Context parallelism with the micro-batch's switch loss: a row of each
  // layer's counts summed over the group (the loss is the whole sequences'; its gradient and the
  // logged value read them).
  const int64_t cp_rows = Lm > 0 ? moe_summed_rows(spec_, opt_.cp > 1) : 0;
  const int64_t moe_words = S * Lm * (3 * E + 1 + 2 * seq_rows * E + cp_rows * E);
  s.status = take(Pool::State, DType::F32, {S + 3 + moe_words},
                  "step status: loss sums, grad norm, clip factor, finite flag, MoE routing statistics");
  if (s.status.defined()) {
    s.loss_slots = s.status.slice0(0, S);
    s.norm = s.status.slice0(S, S + 2);
    if (Lm > 0) {
      float* base = static_cast<float*>(s.status.data) + S + 3;
      acts.moe_counts = TensorView(base, DType::I32, s.status.device, {S, Lm, 2 * E});
      acts.moe_sums = TensorView(base + S * Lm * 2 * E, DType::F32, s.status.device, {S, Lm, E + 1});
      if (seq_rows > 0) {
        float* seq = base + S * Lm * (3 * E + 1);
        acts.moe_seq_counts = TensorView(seq, DType::I32, s.status.device, {S, Lm, seq_rows, E});
        acts.moe_seq_sums = TensorView(seq + S * Lm * seq_rows * E, DType::F32, s.status.device, {S, Lm, seq_rows, E});
      }
      if (cp_rows > 0)
        acts.moe_cp_counts = TensorView(base + S * Lm * (3 * E + 1 + 2 * seq_rows * E), DType::F32, s.status.device,
                                        {S, Lm, cp_rows * E});
    }
  }
  s.hyper = take(Pool::State, DType::F32, {4}, "AdamW lr, bias corrections and step");
  if (spec_.moe.expert_bias && Lm > 0)
    s.expert_bias = take(Pool::State, DType::F32, {Lm * E}, "MoE expert biases (whole on every rank)");
  if (opt_.fp8_delayed_floats > 0)
    s.fp8_delayed = take(Pool::State, DType::F32, {opt_.fp8_delayed_floats}, "FP8 delayed scaling: amax histories, scales");
  s.fp8_weights.assign(opt_.fp8_weight_layers.size(), {});
  for (size_t l = 0; l < opt_.fp8_weight_layers.size(); ++l) {
    if (!opt_.fp8_weight_layers[l]) continue;
    const turbo::Fp8Granularity g = opt_.fp8_weight_granularity;
    const int64_t dims[4][2] = {{QD + 2 * KVD, C}, {C, QD}, {FC, C}, {C, F}};  // [out, in] of q|k|v, proj, fc, out
    // An MoE layer's attention linears only (its experts have their own copies, below).
    const int linears = spec_.is_moe_layer(static_cast<int64_t>(l)) ? 2 : 4;
    for (int k = 0; k < linears; ++k) {
      const int64_t OC = dims[k][0], IC = dims[k][1];
      StateBuffers::Fp8Weight& w = s.fp8_weights[l][static_cast<size_t>(k)];
      w.q = take(Pool::State, DType::F8E4M3, {OC * IC}, "FP8 weights (quantized once per step)");
      w.scale = take(Pool::State, DType::F32, {turbo::fp8_scale_numel(g, OC, IC)}, "FP8 weight scales");
      if (!opt_.fp8_weight_transpose) continue;
      w.q_t = take(Pool::State, DType::F8E4M3, {OC * IC}, "FP8 weights, transposed (quantized once per step)");
      w.scale_t = g == turbo::Fp8Granularity::Tensor
                      ? w.scale
                      : take(Pool::State, DType::F32, {turbo::fp8_scale_numel(g, IC, OC)}, "FP8 weight scales");
    }
  }
  s.fp8_expert_weights.assign(opt_.fp8_expert_weight_layers.size(), {});
  for (size_t l = 0; l < opt_.fp8_expert_weight_layers.size(); ++l) {
    if (!opt_.fp8_expert_weight_layers[l]) continue;
    const train::MoeSpec& e = spec_.moe;
    const turbo::GroupedFp8Scaling sc =
        opt_.fp8_expert_blockwise ? turbo::GroupedFp8Scaling::Block : turbo::GroupedFp8Scaling::Row;
    const int64_t E = e.num_experts, dims[2][2] = {{2 * e.ffn_hidden_size, C}, {C, e.ffn_hidden_size}};  // [N, K]
    for (int k = 0; k < 2; ++k) {
      const int64_t N = dims[k][0], K = dims[k][1];
      StateBuffers::Fp8Weight& w = s.fp8_expert_weights[l][static_cast<size_t>(k)];
      w.q = take(Pool::State, DType::F8E4M3, {E * N * K}, "FP8 weights of the experts (quantized once per step)");
      w.scale = take(Pool::State, DType::F32, {turbo::grouped_fp8_weight_scales(sc, E, N, K)}, "FP8 weight scales of the experts");
      if (!opt_.fp8_weight_transpose) continue;
      w.q_t = take(Pool::State, DType::F8E4M3, {E * N * K}, "FP8 weights of the experts, transposed (quantized once per step)");
      w.scale_t = take(Pool::State, DType::F32, {turbo::grouped_fp8_weight_t_scales(sc, E, N, K)}, "FP8 weight scales of the experts");
    }
  }
  if (opt_.shared_grad_window) s.group_norm = take(Pool::State, DType::F32, {2}, "one AdamW group's gradient norm");
  if (!host && opt_.zero_ranges > 0)  // the kernel's table (host mode clears range by range)
    s.zero_table = take(Pool::State, DType::I64, {2 * opt_.zero_ranges + 1}, "zero_grad ranges (prefix sums, offsets)");

  // `keep` is the coarsest recompute policy that still keeps the tensor.
  struct Field {
    TensorView LayerActs::*member;
    DType dtype;
    int64_t cols;
    bool flat;  // [N * cols] instead of [N, cols]
    Recompute keep;
    const char* what;
    int64_t pad = 0;  // rows `pad` columns longer than the view (the ones column; see BiasGrad)
    bool dense_mlp = false;  // only in dense layers (a MoE layer has its own, MoeActs)
    bool qk_norm = false;    // only with qk_layernorm
    bool local = false;      // sequence parallelism: this rank's rows only
  };
  const DType f32 = DType::F32;
  const int64_t pad = opt_.ones_pad;
  const Field fields[] = {
      {&LayerActs::x_in, act_, C, false, Recompute::Full, "layer input (residual stream)", 0, false, false, true},
      {&LayerActs::ln1, act_, C, false, Recompute::None, "norm1 output", pad},
      {&LayerActs::mean1, f32, 1, true, Recompute::None, "norm1 mean", 0, false, false, true},
      {&LayerActs::rstd1, f32, 1, true, Recompute::None, "norm1 rstd", 0, false, false, true},
      {&LayerActs::qkv, act_, QD + 2 * KVD, false, Recompute::Selective, "q|k|v (packed projection)"},
      // Kept and dropped with qkv: a recomputation runs the projection and the norms again.
      {&LayerActs::qk_pre, act_, QD + KVD, false, Recompute::Selective, "q|k before their per-head norms", 0, false,
       true},
      {&LayerActs::rstd_qk, f32, H + KV, true, Recompute::Selective, "per-head q|k norm rstd", 0, false, true},
      {&LayerActs::att, act_, QD, false, Recompute::Selective, "attention output"},
      {&LayerActs::lse, f32, H, true, Recompute::Selective, "attention log-sum-exp"},
      {&LayerActs::x2, act_, C, false, Recompute::Selective, "residual after attention", 0, false, false, true},
      {&LayerActs::ln2, act_, C, false, Recompute::None, "norm2 output", pad},
      {&LayerActs::mean2, f32, 1, true, Recompute::None, "norm2 mean", 0, false, false, true},
      {&LayerActs::rstd2, f32, 1, true, Recompute::None, "norm2 rstd", 0, false, false, true},
      {&LayerActs::fc, act_, FC, false, Recompute::Selective, "MLP pre-activation", 0, true},
      {&LayerActs::act, act_, F, false, Recompute::Norms, "MLP activation", 0, true},
  };
  ActivationBuffers& a = acts;
  const int64_t L = spec_.num_layers;
  const std::vector<Recompute>& policy = opt_.policy;
  a.layers.assign(static_cast<size_t>(L), LayerActs{});
  a.work = LayerActs{};
  a.ones_buffers.clear();
  for (const Field& f : fields) {
    auto take_field = [&] {
      const int64_t rows = f.local ? NL : N;  // no padded (ones-column) field is local
      if (f.flat) return take(Pool::Acts, f.dtype, {rows * f.cols}, f.what);
      if (f.pad == 0) return take(Pool::Acts, f.dtype, {rows, f.cols}, f.what);
      TensorView t = take(Pool::Acts, f.dtype, {N, f.cols + f.pad}, f.what);
      if (!t.defined()) return t;
      a.ones_buffers.push_back(t);
      TensorView v(t.data, t.dtype, t.device, {N, f.cols});
      v.strides = {f.cols + f.pad, 1};
      return v;
    };
    auto wanted = [&](int64_t l) { return !(f.dense_mlp && spec_.is_moe_layer(l)) && (!f.qk_norm || spec_.qk_layernorm); };
    // A linear layer's input saved in FP8 for the backward need not be kept in bf16.
    const bool fp8_saved_input = f.member == &LayerActs::ln1 || f.member == &LayerActs::ln2 || f.member == &LayerActs::act;
    auto fp8_layer = [&](int64_t l) {
      return l < static_cast<int64_t>(opt_.fp8_saves.size()) && opt_.fp8_saves[static_cast<size_t>(l)];
    };
    auto kept = [&](int64_t l) { return policy[l] <= f.keep && !(fp8_saved_input && fp8_layer(l)); };
    bool shared = false;
    for (int64_t l = 0; l < L; ++l) {
      if (!wanted(l)) continue;
      if (kept(l))
        a.layers[l].*f.member = take_field();
      else
        shared = true;
    }
    if (!shared) continue;
    a.work.*f.member = take_field();
    for (int64_t l = 0; l < L; ++l)
      if (wanted(l) && !kept(l)) a.layers[l].*f.member = a.work.*f.member;
  }
  // The FP8 copies of what the layer's policy would keep (ln1 and ln2 under none, act under none
  // and norms; a policy that recomputes an input recomputes it in bf16 and quantizes it again).
  for (int64_t l = 0; l < L && l < static_cast<int64_t>(opt_.fp8_saves.size()); ++l) {
    if (!opt_.fp8_saves[static_cast<size_t>(l)]) continue;
    LayerActs& la = a.layers[static_cast<size_t>(l)];
    const turbo::Fp8Granularity g = opt_.fp8_saved_granularity;
    auto saved = [&](TensorView& q, TensorView& s, int64_t cols, Recompute keep, const char* what) {
      if (policy[l] > keep) return;
      q = take(Pool::Acts, DType::F8E4M3, {cols * N}, what);
      s = take(Pool::Acts, f32, {turbo::fp8_scale_numel(g, cols, N)}, "FP8 scales of a saved input");
    };
    saved(la.ln1_q, la.ln1_qs, C, Recompute::None, "norm1 output in FP8, transposed (for the backward's q|k|v weight GEMM)");
    saved(la.ln2_q, la.ln2_qs, C, Recompute::None, "norm2 output in FP8, transposed (for the backward's MLP up weight GEMM)");
    saved(la.act_q, la.act_qs, F, Recompute::Norms,
          "MLP activation in FP8, transposed (for the backward's MLP down weight GEMM)");
  }
  plan_moe(take, N);
  a.tmp = take(Pool::Acts, act_, {N, C}, "projection output");
  a.x_final = take(Pool::Acts, act_, {NL, C}, "final residual");
  a.lnf = take(Pool::Acts, act_, {N, C}, "final norm output");
  a.meanf = take(Pool::Acts, DType::F32, {NL}, "final norm mean");
  a.rstdf = take(Pool::Acts, DType::F32, {NL}, "final norm rstd");
  // The head runs in row blocks (the forward does its backward right after the loss; see
  // kHeadBlockBytes), so the logits buffer holds one block of B*T/chunks rows instead of all of them.
  const int64_t logits_bytes = N * V * static_cast<int64_t>(turbo::dtype_size(act_));
  const int64_t chunks = std::max(kMinHeadChunks, (logits_bytes + kHeadBlockBytes - 1) / kHeadBlockBytes);
  a.head_rows = (N + chunks - 1) / chunks;
  a.logits = take(Pool::Acts, act_, {a.head_rows, V}, "logits / dlogits (one head block)");
  a.losses = take(Pool::Acts, DType::F32, {N}, "per-token losses");
  if (opt_.tp > 1)  // this rank's then every rank's {max, sum exp, target logit} per row of a head block
    a.tp_stats = take(Pool::Acts, DType::F32, {(opt_.tp + 1) * a.head_rows * 3}, "vocabulary-parallel loss statistics");
  if (opt_.cp > 1) {
    const int64_t n = N / 2, KVW = 2 * KVD;
    a.cp_kv_all = take(Pool::Acts, act_, {2 * N, KVW}, "context parallel: the ring's two k|v buffers");
    a.cp_out = take(Pool::Acts, DType::F32, {N, QD}, "context parallel: merged attention output (f32)");
    a.cp_lse = take(Pool::Acts, DType::F32, {N * H}, "context parallel: merged log-sum-exp");
    a.cp_tmp_out = take(Pool::Acts, act_, {n, QD}, "context parallel: one chunk pair's output");
    a.cp_tmp_lse = take(Pool::Acts, DType::F32, {n * H}, "context parallel: one chunk pair's log-sum-exp");
    a.cp_dq = take(Pool::Acts, DType::F32, {N, QD}, "context parallel: dq accumulator (f32)");
    a.cp_dkv = take(Pool::Acts, DType::F32, {2 * N, KVW}, "context parallel: the ring's two dk|dv accumulators (f32)");
    a.cp_dq_tmp = take(Pool::Acts, act_, {n, QD}, "context parallel: one chunk pair's dq");
    a.cp_dkv_tmp = take(Pool::Acts, act_, {n, KVW}, "context parallel: one chunk pair's dk|dv");
    a.cp_positions = take(Pool::Acts, DType::I32, {N}, "context parallel: the chunks' positions");
  }
  // One token and target buffer per micro-batch: a step's batches are all staged before it runs.
  a.tokens = take(Pool::Acts, DType::I32, {S * N}, "tokens (one slot per micro-batch)");
  a.targets = take(Pool::Acts, DType::I32, {S * N}, "targets (one slot per micro-batch)");
  if (opt_.document_masks) {
    a.doc_positions = take(Pool::Acts, DType::I32, {S * N}, "document positions (one slot per micro-batch)");
    a.doc_cu = take(Pool::Acts, DType::I32, {S * (N + 1)}, "document cu_seqlens (one slot per micro-batch)");
  }
  if (opt_.masked_loss) a.kept = take(Pool::Acts, DType::F32, {1}, "targets that keep a loss (masked loss)");
  a.dres = take(Pool::Acts, act_, {N, C}, "residual gradient");
  a.dln = take(Pool::Acts, act_, {N, C}, "norm output gradient");
  // One region for the backward's per-layer working gradients: the MLP's (dfc, dact) are dead
  // before the attention's (datt, dq|dk|dv and the rotated dq|dk) are written, and those are
  // dead before the next layer's MLP, so the two sets overlap.
  const bool rope = spec_.rope;
  const int64_t mlp_cols = FC + (spec_.swiglu ? F : 0);
  const bool dense_qk = spec_.qk_layernorm && spec_.qk_norm_whole;
  const int64_t att_cols = 2 * QD + 2 * KVD + (rope || dense_qk ? QD + KVD : 0);
  const TensorView bwd = take(Pool::Acts, act_, {N * std::max(mlp_cols, att_cols)}, "backward working gradients");
  // [N, cols] block starting `col0` columns-worth of N rows into the region.
  auto carve = [&](int64_t col0, int64_t cols) {
    if (!bwd.defined()) return TensorView();
    void* p = static_cast<char*>(bwd.data) + size_t(N * col0) * turbo::dtype_size(act_);
    return TensorView(p, act_, bwd.device, {N, cols});
  };
  a.dfc = carve(0, FC);
  a.dact = spec_.swiglu ? carve(FC, F) : TensorView();
  if (opt_.fp8_maxima && spec_.swiglu)
    a.fp8_maxima = take(Pool::Acts, DType::F32, {N + FC + 1}, "SwiGLU output maxima for the FP8 quantizer");
  a.datt = carve(0, QD);
  a.dqkv = carve(QD, QD + 2 * KVD);
  if (rope) a.dqk_rot = carve(2 * QD + 2 * KVD, QD + KVD);  // RoPE's backward reads these, writes dqkv
  if (dense_qk) {
    const TensorView d = carve(2 * QD + 2 * KVD, QD + KVD);
    if (d.defined()) a.dqk_dense = TensorView(d.data, act_, d.device, {N * (QD + KVD)});
  }
}

int64_t MemoryPlan::moe_rows_bound(int64_t N) const {
  const train::MoeSpec& e = spec_.moe;
  const int64_t M = turbo::moe_permuted_rows_max(N, e.topk, e.num_experts, opt_.moe_align);
  const int64_t r = std::max<int64_t>(1, opt_.moe_rows_multiple);
  return opt_.fp8_moe ? (M + r - 1) / r * r : M;
}

// Expert parallelism: every rank's rows may come to this rank's experts (their groups, each padded
// to the alignment), up to moe_ep_buffer_factor times one rank's own; the FP8 experts' quantizers
// take whole multiples of moe_rows_multiple rows as the local side does.
int64_t MemoryPlan::held_rows_bound(int64_t N) const {
  const int64_t M = moe_rows_bound(N), ep = std::max<int64_t>(1, opt_.ep);
  if (ep == 1) return M;
  const double factor = std::min(static_cast<double>(ep), std::max(1.0, opt_.ep_buffer_factor));
  const int64_t Mh = static_cast<int64_t>(std::ceil(factor * static_cast<double>(M))) +
                     spec_.moe.held_experts() * (std::max<int64_t>(1, opt_.moe_align) - 1);
  const int64_t r = std::max<int64_t>(1, opt_.moe_rows_multiple);
  return opt_.fp8_moe ? (Mh + r - 1) / r * r : Mh;
}

template <class Take>
void MemoryPlan::plan_moe(Take&& take, int64_t N) {
  ActivationBuffers& a = acts;
  a.moe.assign(static_cast<size_t>(spec_.num_layers), MoeActs{});
  const train::MoeSpec& e = spec_.moe;
  const int64_t Lm = spec_.num_moe_layers();
  if (Lm == 0) return;
  const int64_t C = spec_.hidden_size, E = e.num_experts, K = e.topk, F = e.ffn_hidden_size;
  const int64_t Fs = e.shared_ffn_hidden_size;
  const int64_t M = moe_rows_bound(N);
  a.moe_rows = M;
  const int64_t El = e.held_experts(), ep = std::max<int64_t>(1, opt_.ep);
  const int64_t Mh = held_rows_bound(N);
  a.moe_held_rows = Mh;
  const DType f32 = DType::F32, i32 = DType::I32;
  // The routing (small) is always kept. The big per-slot buffers follow the layer's recompute
  // policy: selective recomputes the permuted input (a gather of ln2) and the SwiGLU outputs (from
  // gate|up), full also gate|up and the expert output (the grouped GEMMs, and the shared expert's
  // gate|up GEMM); what a layer does not keep lives in one shared set (moe_work) that the backward
  // refills layer by layer.
  // The shared expert's gate|up and SwiGLU output follow the same rules as the routed experts'
  // (selective recomputes the SwiGLU, full also the GEMM); without a shared expert they are empty.
  struct Big {
    TensorView MoeActs::*member;
    int64_t rows, cols;
    Recompute keep;  // the coarsest policy that still keeps it
    const char* what;
  };
  const Big big[] = {{&MoeActs::xp, Mh, C, Recompute::Norms, "MoE permuted input"},
                     {&MoeActs::h, Mh, 2 * F, Recompute::Selective, "MoE expert gate|up"},
                     {&MoeActs::act, Mh, F, Recompute::Norms, "MoE expert activation"},
                     {&MoeActs::yp, M, C, Recompute::Selective, "MoE expert output"},
                     {&MoeActs::sfc, Fs > 0 ? N : 0, 2 * Fs, Recompute::Selective, "MoE shared expert gate|up"},
                     {&MoeActs::sact, Fs > 0 ? N : 0, Fs, Recompute::Norms, "MoE shared expert activation"}};
  a.moe_work = MoeActs{};
  bool shared_taken[std::size(big)] = {};  // (in the counting pass the views are all undefined)
  for (int64_t l = 0; l < spec_.num_layers; ++l) {
    if (!spec_.is_moe_layer(l)) continue;
    MoeActs& m = a.moe[l];
    m.logits = take(Pool::Acts, f32, {N, E}, "MoE router logits");
    m.probs = take(Pool::Acts, f32, {N, E}, "MoE router scores");
    m.topk_idx = take(Pool::Acts, i32, {N, K}, "MoE chosen experts");
    m.topk_weight = take(Pool::Acts, f32, {N, K}, "MoE routing weights");
    m.rows = take(Pool::Acts, i32, {N, K}, "MoE slot rows");
    m.offsets = take(Pool::Acts, i32, {E + 1}, "MoE group offsets");
    if (ep > 1) m.held_offsets = take(Pool::Acts, i32, {El + 1}, "MoE held group offsets");
    for (const Big& b : big) {
      if (b.rows == 0) continue;
      if (opt_.policy[l] <= b.keep) {
        m.*b.member = take(Pool::Acts, act_, {b.rows, b.cols}, b.what);
        continue;
      }
      bool& taken = shared_taken[&b - big];
      if (!taken) a.moe_work.*b.member = take(Pool::Acts, act_, {b.rows, b.cols}, b.what);
      taken = true;
      m.*b.member = a.moe_work.*b.member;
    }
  }
  a.dyp = take(Pool::Acts, act_, {M, C}, "MoE expert output gradient");
  // Unused when SwiGLU runs in the expert GEMMs' epilogues (DecoderOptions::moe_swiglu_epilogue), but
  // kept: whether it does depends on the device, and a plan sized without one (primus projection on
  // a machine without a GPU) must be what the model allocates.
  a.dmact = take(Pool::Acts, act_, {Mh, F}, "MoE expert activation gradient");
  a.dh = take(Pool::Acts, act_, {Mh, 2 * F}, "MoE expert gate|up gradient");
  if (ep > 1) {
    a.moe_xl = take(Pool::Acts, act_, {M, C}, "MoE permuted input (local, expert parallelism)");
    a.moe_yh = take(Pool::Acts, act_, {Mh, C}, "MoE held expert output (expert parallelism)");
    a.dyh = take(Pool::Acts, act_, {Mh, C}, "MoE held expert output gradient (expert parallelism)");
    a.ep_send = take(Pool::Acts, act_, {Mh, C}, "MoE all-to-all staging, out (expert parallelism)");
    a.ep_recv = take(Pool::Acts, act_, {Mh, C}, "MoE all-to-all staging, in (expert parallelism)");
  }
  // The permuted input's gradient reuses the expert output's: the backward's last read of dyp
  // (the down projection's weight gradient) comes before the up projection's input gradient
  // writes dxp (Decoder::moe_backward).
  a.dxp = a.dyp;
  a.dlogits = take(Pool::Acts, f32, {N, E}, "MoE router logit gradient");
  a.dlogits_act = take(Pool::Acts, act_, {N, E}, "MoE router logit gradient (GEMM operand)");
  a.dweight = take(Pool::Acts, f32, {N, K}, "MoE routing weight gradient");
  if (const int64_t rows = moe_summed_rows(spec_, opt_.cp > 1); rows > 0)  // the switch losses' summed counts
    a.moe_cp_counts_i = take(Pool::Acts, i32, {rows, E}, "MoE token counts summed over the ranks (i32)");
  if (opt_.cp > 1 && spec_.moe.seq_aux_loss)  // the sequence-wise loss's counts on their way through the group's sum
    a.moe_cp_seq_counts =
        take(Pool::Acts, f32, {opt_.max_batch / 2, E}, "MoE sequences' token counts over the cp group");
  if (Fs > 0) {
    a.dsact = take(Pool::Acts, act_, {N, Fs}, "MoE shared expert activation gradient");
    a.dsfc = take(Pool::Acts, act_, {N, 2 * Fs}, "MoE shared expert gate|up gradient");
  }
}

Param MemoryPlan::param(const std::string& name, bool required) const {
  const train::ParamTensor* t = layout_.find(name);
  if (!t) {
    if (required) throw RuntimeError(fmt::format("cuda model: no parameter '{}'", name));
    return {};
  }
  const size_t i = static_cast<size_t>(t - layout_.tensors.data());
  const int64_t grad_offset = grad_place_.offset[i];
  auto shaped = [&](const TensorView& flat, int64_t offset) {
    void* p = static_cast<char*>(flat.data) + size_t(offset) * turbo::dtype_size(flat.dtype);
    if (t->shape.size() == 3) return TensorView(p, flat.dtype, flat.device, {t->shape[0], t->shape[1], t->shape[2]});
    return t->shape.size() == 2 ? TensorView(p, flat.dtype, flat.device, {t->shape[0], t->shape[1]})
                                : TensorView(p, flat.dtype, flat.device, {t->shape[0]});
  };
  const int64_t weight_offset = opt_.fsdp ? opt_.fsdp->weight_offset[i] : t->offset;
  if (i < grad_place_.bf16.size() && grad_place_.bf16[i]) {
    const TensorView g = grad_view(state.grads, grad_place_, i, 0, t->numel);
    const TensorView shaped_g = TensorView::contiguous(g.data, g.dtype, g.device, t->shape.data(), static_cast<int>(t->shape.size()));
    return {shaped(state.weights, weight_offset), shaped_g};
  }
  return {shaped(state.weights, weight_offset), shaped(state.grads, grad_offset)};
}

void MemoryPlan::view_params() {
  ModelParams& p = params;
  p.wte = param("embedding.weight", true);
  p.wpe = param("position_embedding.weight", !spec_.rope);
  p.head = spec_.untied ? param("output_layer.weight", true) : p.wte;
  p.final_norm = {param("final_norm.weight", true), param("final_norm.bias", false)};
  p.layers.resize(spec_.num_layers);
  for (int64_t l = 0; l < spec_.num_layers; ++l) {
    const std::string n = fmt::format("layers.{}.", l);
    LayerParams& lp = p.layers[l];
    lp.norm1 = {param(n + "norm1.weight", true), param(n + "norm1.bias", false)};
    lp.norm2 = {param(n + "norm2.weight", true), param(n + "norm2.bias", false)};
    lp.qkv_w = param(n + "attn.qkv.weight", true);
    lp.qkv_b = param(n + "attn.qkv.bias", false);
    lp.proj_w = param(n + "attn.proj.weight", true);
    lp.proj_b = param(n + "attn.proj.bias", false);
    lp.q_norm = param(n + "attn.q_norm.weight", spec_.qk_layernorm);
    lp.k_norm = param(n + "attn.k_norm.weight", spec_.qk_layernorm);
    if (spec_.is_moe_layer(l)) {
      MoeParams& m = lp.moe;
      m.router = param(n + "moe.router.weight", true);
      m.fc = param(n + "moe.experts.fc.weight", true);
      m.proj = param(n + "moe.experts.proj.weight", true);
      m.shared_fc = param(n + "moe.shared.fc.weight", false);
      m.shared_proj = param(n + "moe.shared.proj.weight", false);
      if (const train::ParamTensor* b = layout_.find(n + "moe.router.expert_bias")) {
        int64_t k = 0;  // this layer's row: the MoE layers below it
        for (int64_t j = 0; j < l; ++j) k += spec_.is_moe_layer(j);
        const int64_t E = b->numel;
        m.expert_bias = state.expert_bias.slice0(k * E, (k + 1) * E);
      }
      continue;
    }
    lp.fc_w = param(n + "mlp.fc.weight", true);
    lp.fc_b = param(n + "mlp.fc.bias", false);
    lp.out_w = param(n + "mlp.proj.weight", true);
    lp.out_b = param(n + "mlp.proj.bias", false);
  }
}

void MemoryPlan::init_ones(const ModelStream& s) const {
  const std::vector<TensorView>& bufs = acts.ones_buffers;
  if (bufs.empty()) return;
  const int64_t pad = opt_.ones_pad;
  const size_t es = turbo::dtype_size(act_);
  std::vector<unsigned char> row(size_t(pad) * es, 0);
  if (act_ == DType::F32) {
    const float one = 1.0f;
    std::memcpy(row.data(), &one, es);
  } else {  // bf16 1.0 = 0x3f80, f16 1.0 = 0x3c00 (little-endian)
    const uint16_t one = act_ == DType::BF16 ? 0x3f80 : 0x3c00;
    std::memcpy(row.data(), &one, es);
  }
  // Every buffer has the same rows: one packed copy of the padding for all of them. From pageable
  // memory an H2D copy has taken the bytes when it returns, so `pattern` may go out of scope.
  const int64_t rows = bufs.front().size(0);
  std::vector<unsigned char> pattern(size_t(rows) * row.size());
  for (int64_t r = 0; r < rows; ++r) std::memcpy(pattern.data() + size_t(r) * row.size(), row.data(), row.size());
  for (const TensorView& t : bufs) {
    const int64_t width = t.size(1), C = width - pad;
    char* dst = static_cast<char*>(t.data) + size_t(C) * es;
    if (s.host) {
      for (int64_t r = 0; r < rows; ++r) std::memcpy(dst + size_t(r * width) * es, row.data(), row.size());
    } else {
      CUDA_CHECK(cudaMemcpy2DAsync(dst, size_t(width) * es, pattern.data(), row.size(), row.size(), size_t(rows),
                                   cudaMemcpyHostToDevice, s.stream));
    }
  }
}

size_t MemoryPlan::reserved_bytes() const { return state_->capacity() + acts_->capacity() + scratch_->capacity(); }
size_t MemoryPlan::activation_bytes() const { return acts_->capacity(); }
size_t MemoryPlan::scratch_high_water() const { return scratch_->high_water(); }

}  // namespace primus::backends::cuda
