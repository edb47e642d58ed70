// The CUDA model's memory plan: every buffer a training step touches, allocated once, when the
// model is built, from three arenas, so a step never calls cudaMalloc (and can be captured as a
// CUDA graph):
//   state        fp32 master weights, fp32 gradients, fp32 AdamW moments (each one flat buffer in
//                train/param_layout.h order, the reference backend's layout, so checkpoints,
//                export and generate are shared), the bf16 compute copy of the weights (same
//                layout), the RoPE table, the step status and the optimizer's descriptor table;
//   activations  what the backward needs, per layer, for batches up to max_batch x max_seq
//                (bf16; norm statistics and attention log-sum-exp f32), the logits of one head
//                block, and the backward's working gradients, shared by all layers;
//   scratch      what the ops borrow inside a call (ExecContext::scratch), sized for the largest
//                single borrow of any op the model calls.
// The plan runs twice over one description (plan()): once to add up the bytes, once to take the
// buffers from arenas of exactly that size, so the two can never disagree.
#pragma once
#include <cuda_runtime_api.h>

#include <array>
#include <cstdint>
#include <memory>
#include <string>
#include <utility>
#include <vector>

#include "backends/cuda/hooks.h"
#include "backends/cuda/model/fsdp.h"
#include "backends/cuda/model/grad_placement.h"
#include "train/model_spec.h"
#include "train/param_layout.h"
#include "turbo/core/arena.h"

namespace primus::backends::cuda {

// One parameter tensor: its compute weight (bf16; the fp32 master in host mode) and its f32
// gradient, views into the flat buffers; both undefined when the model has no such tensor (e.g.
// biases in Llama).
struct Param {
  TensorView w, g;
};
struct NormParams {
  Param weight, bias;
};
// A MoE layer's tensors: the router [E,C], the stacked experts fc [E,2F,C] (gate | up rows) and
// proj [E,C,F], the shared expert's (undefined without one), and the expert bias: f32 [E], a view
// of the fp32 master copy (the router reads it as it is; undefined without one).
struct MoeParams {
  Param router, fc, proj, shared_fc, shared_proj;
  TensorView expert_bias;
};
struct LayerParams {
  NormParams norm1, norm2;
  Param qkv_w, qkv_b, proj_w, proj_b, fc_w, fc_b, out_w, out_b;  // fc/out undefined in MoE layers
  Param q_norm, k_norm;  // [D] each: qk_layernorm's weights (undefined without it)
  MoeParams moe;
};
struct ModelParams {
  Param wte, wpe, head;  // head is wte when the embedding is tied
  NormParams final_norm;
  std::vector<LayerParams> layers;
};

// One layer's saved activations. qkv [N, QD + 2*KVD] (QD = heads x head dim, hidden_size
// unless kv_channels sets it apart): one GEMM's packed q|k|v columns; the attention reads them
// as strided views; att [N, QD]. With qk_layernorm: qk_pre [N, QD + KVD] the q|k columns before
// their per-head norms and rstd_qk f32 [N * (H + KV)] (undefined without it).
struct LayerActs {
  TensorView x_in, ln1, mean1, rstd1, qkv, qk_pre, rstd_qk, att, lse, x2, ln2, mean2, rstd2, fc, act;
  // FP8 inputs saved for the backward (MemoryPlanOptions::fp8_saves): q(ln1)^T, q(ln2)^T, q(act)^T
  // as flat FP8 bytes [cols * N] and their f32 scales; ln1, ln2 and act then share the work set.
  TensorView ln1_q, ln2_q, act_q, ln1_qs, ln2_qs, act_qs;
};

// One MoE layer's activations, all kept for the backward (the recompute policies apply to the
// attention and norm tensors). Rows: N tokens; M = moe_permuted_rows_max(N, K, E, align), the
// permuted buffers' bound for any routing.
struct MoeActs {
  TensorView logits, probs;    // f32 [N,E]: router GEMM output, the router's saved scores
  TensorView topk_idx;         // i32 [N,K]
  TensorView topk_weight;      // f32 [N,K]
  TensorView rows;             // i32 [N,K]: each slot's permuted row (-1: dropped)
  TensorView offsets;          // i32 [E+1]: the groups' rows
  TensorView xp, h, act, yp;   // [M,C] permuted input, [M,2F] gate|up, [M,F] SwiGLU, [M,C] expert output
  // Expert parallelism (MemoryPlanOptions::ep > 1): xp, h and act are the held side's (this rank's
  // experts' rows from every rank, Mh of them: ActivationBuffers::moe_held_rows), yp stays local;
  // held_offsets i32 [El+1] the held groups' rows.
  TensorView held_offsets;
  TensorView sfc, sact;        // shared expert [N,2Fs], [N,Fs] (undefined without one)
};

// Views into the state arena.
struct StateBuffers {
  // Flat, in layout order. grads and weights hold flat_elems (ZeRO-1 padding stays zero); master,
  // m and v only without ZeRO-1 (MemoryPlanOptions::optimizer_state). In host mode weights is
  // master (fp32 compute on the master copy). Split masters (MemoryPlanOptions::split_master):
  // master is u16, the low words, and weights the high words of the same fp32 values.
  TensorView master, weights, grads, m, v;
  // Sharded data parallelism (MemoryPlanOptions::fsdp): master, m and v hold this rank's chunks
  // (FsdpPlan::shard_elems); weights and grads are the units' places (weight_elems, grad_elems);
  // shard_grads f32 the averaged gradient of the chunks, shard_weights their bf16 copy (device
  // only: what the gathers send), fsdp_tmp f32 one chunk (a reduce-scatter's output; not with
  // optim, which reduces into shard_grads).
  TensorView shard_grads, shard_weights, fsdp_tmp;
  TensorView rope_table;  // f32 [seq_length, head_dim / 2, 2] (device, RoPE models)
  // {loss sums [loss_slots], grad norm, clip factor, finite flag}: loss_slots and norm are views
  // into it, so a step's status is one D2H copy.
  TensorView status, loss_slots, norm;
  TensorView hyper;       // f32 {lr, 1 - beta1^t, 1 - beta2^t, t}, which a captured AdamW reads
  TensorView group_norm;  // f32 {norm, factor} of one AdamW group (the optimizer in the backward)
  TensorView zero_table;  // i64: zero_grad's ranges (prefix sums, offsets); device only
  // fp8_recipe delayed: f32 [tensors * history_len + 3 * tensors], the amax histories, then the
  // scales, then each tensor's FP8 format maximum (turbo/ops/fp8_delayed.h), then where
  // CudaModel::reduce_fp8_amaxes gathers the newest amaxes for their reduction over the ranks.
  TensorView fp8_delayed;
  // FP8 weights quantized once per step (MemoryPlanOptions::fp8_weight_layers; turbo::Fp8WeightCache):
  // per layer, for q|k|v, attention output, MLP up and MLP down (an MoE layer: the first two),
  // q(W) [OC * C] FP8, its scales, q(W)^T and its scales (undefined in the other layers).
  struct Fp8Weight {
    TensorView q, scale, q_t, scale_t;
  };
  std::vector<std::array<Fp8Weight, 4>> fp8_weights;
  // The same for the MoE layers' expert weights (MemoryPlanOptions::fp8_expert_weight_layers): fc
  // [E, 2F, C] and proj [E, C, F], each q(W) [E*N*K] and q(W)^T [K][E*N] with the FP8 grouped
  // GEMM's scales (turbo::grouped_fp8_weight_scales / _t_scales).
  std::vector<std::array<Fp8Weight, 2>> fp8_expert_weights;
  // The MoE routers' expert biases, f32 [MoE layers, experts]: apart from the flat weights (the
  // optimizer never moves them; every rank moves all of them by the global load after each step),
  // so sharded optimizer states leave them whole on every rank. set_params / get_params carry them
  // in and out of the flat layout (CudaModel::put_expert_bias).
  TensorView expert_bias;
};

// Views into the activations arena. Per layer, the tensors its recompute policy keeps have memory
// of their own; the others alias one shared set (work), which the forward and the backward's
// recomputation refill layer by layer.
struct ActivationBuffers {
  LayerActs work;
  std::vector<LayerActs> layers;
  TensorView tmp, x_final, lnf, meanf, rstdf, logits, losses, tokens, targets;
  // Document masking only (MemoryPlanOptions::document_masks): per slot, positions [N] and the
  // fixed-size cu_seqlens [N + 1] built from that slot's tokens (turbo/kernels/cuda/document_masks.h).
  TensorView doc_positions, doc_cu;
  // Masked loss only (MemoryPlanOptions::masked_loss): f32 [1], the current micro-batch's targets
  // that keep a loss (over the context-parallel group).
  TensorView kept;
  // The backward's working gradients. dqkv [N, QD + 2*KVD] packs dq|dk|dv like LayerActs::qkv (one
  // dgrad and one wgrad GEMM); dqk_rot [N, QD + KVD] holds the attention's dq|dk before RoPE's
  // backward rotates them into dqkv; datt [N, QD]. With whole-projection q|k norms
  // (qk_norm_whole) dqk_dense [N * (QD + KVD)] holds dense copies of d(normed q) [N, QD] then
  // d(normed k) [N, KVD] for the norms' backward (dqk_rot's memory when there is RoPE: it is dead
  // by then).
  TensorView dres, dln, datt, dqkv, dqk_rot, dqk_dense, dfc, dact;
  // f32 [N + FC + 1]: the row, column and whole maxima of a SwiGLU output (act [N, F] or dfc
  // [N, FC]) from its kernel to the FP8 quantization that reads it next (MemoryPlanOptions::fp8_maxima).
  TensorView fp8_maxima;
  // The LM head and loss run in blocks of head_rows rows (see kHeadBlockBytes in memory_plan.cpp).
  int64_t head_rows = 0;
  // Tensor parallelism (MemoryPlanOptions::tp > 1): f32 [(tp + 1) * head_rows * 3], a head block's
  // vocabulary-parallel loss statistics, this rank's [rows, 3] then every rank's [tp, rows, 3].
  TensorView tp_stats;
  // Context parallelism (MemoryPlanOptions::cp > 1; cp_attention.h), N = max_batch x max_seq local
  // rows, n = N / 2 (one chunk slot): the ring's two k|v buffers [2N, 2 KVD] (activation dtype);
  // the running merged output f32 [N, QD] and log-sum-exp f32 [N x H]; one pair's output [n, QD] and
  // log-sum-exp; the backward's f32 accumulators dq [N, QD] and the ring's two dk|dv [2N, 2 KVD],
  // one pair's dq [n, QD] and dk|dv [n, 2 KVD]; the chunks' positions i32 [N].
  TensorView cp_kv_all, cp_out, cp_lse, cp_tmp_out, cp_tmp_lse, cp_dq, cp_dkv, cp_dq_tmp, cp_dkv_tmp, cp_positions;
  // The padded norm outputs [N, C + ones_pad] whose extra columns init_ones() fills.
  std::vector<TensorView> ones_buffers;
  // MoE: per layer (undefined for dense layers); per micro-batch slot s and MoE layer m (the m-th
  // MoE layer), the routing statistics the host reads after a step: moe_counts i32 [S, Lm, 2E]
  // (slots per expert | slots kept) and moe_sums f32 [S, Lm, E+1] (sum of the router's p per
  // expert | sum of logsumexp^2), both views into StateBuffers::status (copied with it). The
  // backward's MoE working buffers are shared by all layers.
  std::vector<MoeActs> moe;
  MoeActs moe_work;  // the big per-slot buffers of the layers whose policy does not keep them
  TensorView moe_counts, moe_sums;
  // The sequence-wise aux loss (moe_router_load_balancing_type: seq_aux_loss): per slot and MoE
  // layer, each sequence's statistics, moe_seq_counts i32 [S, Lm, B, E] and moe_seq_sums f32
  // [S, Lm, B, E] (B the micro-batch's sequences), in the status buffer after moe_sums. Under
  // context parallelism they hold the whole sequences' (summed over the group in the forward).
  TensorView moe_seq_counts, moe_seq_sums;
  TensorView moe_cp_seq_counts;  // cp > 1 with seq_aux_loss: f32 [B, E], the counts as the group sums them
  TensorView dyp, dmact, dh, dxp;       // [M,C], [M,F], [M,2F], [M,C]
  TensorView dlogits, dweight;          // f32 [N,E], f32 [N,K]
  TensorView dlogits_act;               // [N,E] in the activation dtype (the router GEMMs' operand)
  // Counts summed over ranks, f32 [S, Lm, R x E] in the status buffer after the sequence-wise rows
  // (summed in the forward), and an i32 [R, E] copy for the router backward. Row 0 is
  // global_aux_loss's (over the ranks holding other tokens and the step's micro-batches so far)
  // when that type is listed; the next, cp > 1 with the micro-batch's switch loss, the counts
  // summed over the cp group (Decoder::cp_counts_row).
  TensorView moe_cp_counts, moe_cp_counts_i;
  TensorView dsact, dsfc;               // shared expert [N,Fs], [N,2Fs]
  int64_t moe_rows = 0;                 // M
  // Expert parallelism: the local permuted input xl [M,C] and the held output yh [Mh,C] (both
  // transient), the held output gradient dyh [Mh,C] (dmact, dh are then [Mh,..]; the held input
  // gradient reuses dyh), and the all-to-all staging ep_send, ep_recv [Mh,C].
  TensorView moe_xl, moe_yh, dyh, ep_send, ep_recv;
  int64_t moe_held_rows = 0;            // Mh
};

// The rows of counts summed over ranks an MoE layer keeps per micro-batch (ActivationBuffers::
// moe_cp_counts): global_aux_loss's, then, under context parallelism (`cp`), the micro-batch switch
// loss's.
inline int64_t moe_summed_rows(const train::ModelSpec& spec, bool cp) {
  return (spec.moe.global_aux_loss ? 1 : 0) + (cp && spec.moe.batch_aux_loss ? 1 : 0);
}

struct MemoryPlanOptions {
  int64_t max_batch = 1, max_seq = 0, loss_slots = 1;
  int64_t flat_elems = 0;        // 0: layout.total
  bool optimizer_state = true;   // false: no master weights and moments (ZeRO-1 holds them)
  bool host = false;             // host memory and fp32 compute (CudaModelOptions::device)
  bool fp8_linear = false;       // scratch for the FP8 linear slots' quantized copies
  bool fp8_moe = false;          // scratch for the FP8 expert GEMMs' copies; permuted rows a multiple of moe_rows_multiple
  int64_t moe_rows_multiple = 16;  // with fp8_moe (CudaModelOptions::fp8_multiple: 16 rowwise, 128 blockwise)
  int64_t fp8_delayed_floats = 0;  // StateBuffers::fp8_delayed's size (0: none)
  // Per layer: its linear layers' inputs ln1, ln2 and act are kept for the backward as FP8
  // transposed copies (LayerActs::*_q, turbo::Fp8SavedInputs) instead of bf16; their scales are
  // fp8_scale_numel(fp8_saved_granularity, cols, N) f32. Empty: none.
  std::vector<bool> fp8_saves;
  turbo::Fp8Granularity fp8_saved_granularity = turbo::Fp8Granularity::Tensor;
  // Per layer: its four linear weights get FP8 copies made once per step (StateBuffers::fp8_weights)
  // at the weight granularity below. Empty: none.
  std::vector<bool> fp8_weight_layers;
  std::vector<bool> fp8_expert_weight_layers;  // MoE layers whose expert weights get step copies
  bool fp8_expert_blockwise = false;           // their scales: blockwise (else rowwise)
  // The weight copies keep their transposed layout too (Fp8WeightCache::keep_transpose; false:
  // q(w) alone, no q_t / scale_t).
  bool fp8_weight_transpose = true;
  turbo::Fp8Granularity fp8_weight_granularity = turbo::Fp8Granularity::Tensor;
  bool fp8_maxima = false;  // ActivationBuffers::fp8_maxima (rowwise or tensorwise FP8 with SwiGLU)
  size_t attention_scratch_bytes = 0;
  int64_t ones_pad = 0;          // columns of ones after ln1/ln2's rows (BiasGrad::Ones), else 0
  int64_t zero_ranges = 0;       // entries of zero_grad's range table
  int64_t moe_align = 1;         // MoE groups padded to a multiple of this many rows
  std::vector<Recompute> policy;  // per layer
  // The optimizer runs in the backward: the layers' gradients share one window (grad_placement.h)
  // and StateBuffers::grads is that compact buffer.
  bool shared_grad_window = false;
  // With shared_grad_window: 2 when each layer's gradients are averaged over the ranks while the
  // layer below runs its backward (the layers alternate between two windows), else 1.
  int grad_windows = 1;
  // The MoE experts' gradients in bf16 (GradPlacement::bf16; CudaModelOptions::bf16_expert_grads).
  bool bf16_expert_grads = false;
  // Scratch for one weight gradient in f32 beside every other borrow (CudaModelOptions::unfused_wgrad).
  bool unfused_wgrad = false;
  // StateBuffers::master holds the fp32 masters' low words (u16); weights are their high words
  // (CudaModelOptions::split_master).
  bool split_master = false;
  // StateBuffers::m (v) is bf16 (CudaModelOptions::exp_avg_bf16, exp_avg_sq_bf16).
  bool exp_avg_bf16 = false, exp_avg_sq_bf16 = false;
  // Whether the scratch size may ask the current CUDA device (its SM count bounds the norm and
  // column-sum partials). false: those device-dependent borrows are left out, so a host without
  // a GPU can size a device plan (MemoryPlan::sizes for `primus projection`); they are far below
  // the attention's reservation that bounds the scratch from below (see scratch_bytes()).
  bool query_device = true;
  // Document masking of packed samples (reset_attention_mask / reset_position_ids): one table of
  // positions and one of cu_seqlens per micro-batch slot (ActivationBuffers::doc_positions, doc_cu).
  bool document_masks = false;
  // Masked targets (eod_mask_loss): the loss is the mean over the targets that keep one, counted
  // on the device into ActivationBuffers::kept.
  bool masked_loss = false;
  int64_t tp = 1;  // tensor-parallel ranks (the spec is one rank's part): the loss statistics buffer
  // Sequence parallelism over the tp ranks: the residual stream (x_in, x2, the final residual) and
  // the norms' statistics hold max_batch x max_seq / tp rows; the norm outputs, the projection
  // output and the gradients stay whole (each rank's rows are its part of them).
  bool sequence_parallel = false;
  // Sharded data parallelism (fsdp.h): the state and the places the plan gives; the gradient
  // placement is the plan's.
  std::shared_ptr<const FsdpPlan> fsdp;
  int64_t cp = 1;  // context-parallel ranks: the chunked attention's buffers (cp_attention.h)
  // Expert-parallel ranks (the spec is one rank's: moe.local_experts of num_experts held): the
  // held side's buffers and the all-to-all staging (ep_comm.h).
  int64_t ep = 1;
  double ep_buffer_factor = 2.0;  // the held rows: min(ep, factor) x the local bound (CudaModelOptions)
};

// What a plan takes, without taking it: the three arenas' capacities exactly as the constructor
// allocates them, and every buffer of the state and activation arenas with the plan's own name
// for it ("fp32 gradients", "MoE expert gate|up", ...), in bytes as the arena rounds them.
struct PlannedBuffer {
  bool state = false;  // false: the activations arena
  std::string what;
  size_t bytes = 0;
};
struct MemoryPlanSizes {
  size_t state_arena = 0, acts_arena = 0, scratch_arena = 0;
  size_t optimizer_table = 0;            // the state arena's AdamW descriptor table
  std::vector<PlannedBuffer> buffers;
  bool scratch_exact = true;             // false: query_device was off on a device plan
  size_t total() const { return state_arena + acts_arena + scratch_arena; }
};

// Copies and clears on the model's stream (or plain host memory in host mode).
struct ModelStream {
  cudaStream_t stream = nullptr;  // null in host mode
  bool host = false;
  void to_model(void* dst, const void* src, size_t bytes) const;    // host -> model memory, stream-ordered
  void from_model(void* dst, const void* src, size_t bytes) const;  // model memory -> host, synchronising
  void zero(const TensorView& t) const;
  void sync() const;
};

class MemoryPlan {
 public:
  // Sizes, allocates and views every buffer. Throws RuntimeError when flat_elems is below the
  // parameter count.
  MemoryPlan(const train::ModelSpec& spec, const train::ParamLayout& layout, const MemoryPlanOptions& opt);
  // The sizes the constructor would allocate, computed by the same pass (no memory taken, no
  // device needed with query_device off): what `primus projection` reports for this backend.
  static MemoryPlanSizes sizes(const train::ModelSpec& spec, const train::ParamLayout& layout,
                               const MemoryPlanOptions& opt);

  StateBuffers state;
  ActivationBuffers acts;
  ModelParams params;

  turbo::DType act_dtype() const { return act_; }  // activations and compute weights
  const std::vector<Recompute>& policy() const { return opt_.policy; }
  const MemoryPlanOptions& options() const { return opt_; }
  turbo::Arena& state_arena() { return *state_; }
  turbo::Arena* scratch() const { return scratch_.get(); }
  // Where each tensor's gradient lives in state.grads.
  const GradPlacement& grad_placement() const { return grad_place_; }
  // The padded norm outputs' extra columns: 1, 0, 0, ... in every row (once, at construction).
  void init_ones(const ModelStream& s) const;

  size_t reserved_bytes() const;    // device bytes held by the three arenas
  size_t activation_bytes() const;  // the activations arena (what recomputation shrinks)
  size_t scratch_high_water() const;

  // Bytes of the LM head's logits block: at least 2 blocks, and as many as keep one block's
  // logits within 1 GiB (the largest single activation otherwise: 1.6 GB bf16 for GPT-2 at
  // B*T = 16k, 4.2 GB for Llama-3's 128k vocabulary at 8 x 2048). Each extra block costs one f32
  // read+write of the head's weight gradient (GPT-2 B32 with 4 blocks instead of 2 measured
  // 1.132x vs 1.133x torch.compile on an H100).
  static constexpr int64_t kMinHeadChunks = 2;
  static constexpr int64_t kHeadBlockBytes = int64_t{1} << 30;

 private:
  template <class Take>
  void plan(Take&& take);  // assigns every buffer; run once to count bytes, once to allocate
  template <class Take>
  void plan_moe(Take&& take, int64_t N);  // the MoE layers' part of plan()
  // The permuted-token buffers' rows for N tokens: the worst routing's, rounded up to 16 with FP8
  // experts (the weight gradient's transposed token copies need 16-byte rows).
  int64_t moe_rows_bound(int64_t N) const;
  // The held side's rows under expert parallelism (moe_rows_bound without it).
  int64_t held_rows_bound(int64_t N) const;
  MemoryPlan(const train::ModelSpec& spec, const train::ParamLayout& layout, const MemoryPlanOptions& opt,
             bool allocate);
  MemoryPlanSizes count();  // the counting pass of plan() and the arenas' sizes
  size_t scratch_bytes() const;
  Param param(const std::string& name, bool required) const;
  void view_params();

  const train::ModelSpec& spec_;
  const train::ParamLayout& layout_;
  MemoryPlanOptions opt_;
  GradPlacement grad_place_;
  turbo::DType act_;
  std::unique_ptr<turbo::Arena> state_, acts_, scratch_;
};

}  // namespace primus::backends::cuda
