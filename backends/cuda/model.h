// The CUDA model: GPT-2 and Llama from one ModelSpec, on the device, assembled from four parts
// with one job each (backends/cuda/model/):
//   memory_plan      every buffer, allocated once from three arenas (state, activations, scratch),
//                    so a training step never calls cudaMalloc;
//   decoder          the layers' forward and backward over the plan's parameter and activation
//                    views, through the op slots (CudaOps), and the "gradients ready" reports;
//   optimizer_state  fp32 master weights and AdamW moments, gradient clearing, grad norm, the
//                    on-device step check and the update;
//   host_staging     the step's only host <-> device copies, through pinned memory.
// This class is their public face: the trainer, data parallelism and the tests use it alone.
//
// One step: stage_batch() for each micro-batch and set_hyper(hp) (the only host -> device
// copies), then zero_grad(); per micro-batch forward_staged(slot) + backward(); grad_norm();
// check_step() (the non-finite check, on the device); update(); and after it one
// read_step_status() (one D2H copy into pinned memory). Everything between set_hyper and
// read_step_status is enqueued on the model's stream with no host decision and no allocation,
// so the trainer can capture it as one CUDA graph and replay it (backends/cuda/step_graph.h).
// forward(tokens, ...) and update(hp) are the one-call forms (stage + forward, set_hyper +
// update) for evaluation and tests.
//
// Activation recomputation (the cuda.recompute.policy slot, hooks.h) decides per layer which
// activations the plan gives their own memory; the rest share one set, refilled by backward().
//
// Host mode (options.device = CPU): the same code on host memory in fp32, every op served by
// Turbo's CPU backends (the reference kernels) and the weights being the master copy. It checks
// the model's wiring against the reference backend on machines without a GPU.
#pragma once
#include <cuda_runtime_api.h>

#include <cstdint>
#include <functional>
#include <map>
#include <memory>
#include <vector>

#include <functional>

#include "backends/cuda/hooks.h"
#include "backends/cuda/model/decoder.h"
#include "backends/cuda/model/ep_comm.h"
#include "backends/cuda/model/fsdp_comm.h"
#include "backends/cuda/model/host_staging.h"
#include "backends/cuda/model/memory_plan.h"
#include "backends/cuda/model/optimizer_state.h"
#include "backends/cuda/model/tp_comm.h"
#include "backends/cuda/profile.h"
#include "parallel/parallel_dims.h"
#include "train/expert_parallel.h"
#include "train/model_spec.h"
#include "train/moe_stats.h"
#include "train/param_layout.h"
#include "turbo/ops/optimizer.h"

namespace primus::backends::cuda {

struct CudaModelOptions {
  int64_t max_batch = 1;
  int64_t max_seq = 0;     // 0: spec.seq_length
  int64_t loss_slots = 1;  // forward() calls whose losses can be pending before read_loss (>= grad accumulation)
  // Scratch the attention slot needs (the fallback: fallback_attention_scratch_bytes). On the
  // device the model reserves at least enough for Turbo's flash kernels and cuDNN.
  size_t attention_scratch_bytes = 0;
  turbo::Device device = turbo::Device::CUDA;  // CPU: host mode (fp32, no GPU needed)
  // Data parallelism (parallel/cuda/grad_reducer.h). flat_elems: the flat gradient and bf16 weight buffers
  // hold this many elements (>= layout().total; ZeRO-1 pads them to equal per-rank chunks, the
  // tail stays zero); 0: layout().total. optimizer_state = false: no fp32 master weights and
  // moments here (the ZeRO-1 shard holds them); set_params() then only refreshes the bf16
  // weights, and get_params(), the moment calls, grad_norm() and update() throw. Device only.
  int64_t flat_elems = 0;
  bool optimizer_state = true;
  // The linear slots run FP8 GEMMs (patch cuda.linear.fp8): scratch holds their quantized
  // copies (turbo::linear_fp8_scratch_bytes) and every linear dimension must be a multiple of 16.
  bool fp8_linear = false;
  // The MoE layers' expert GEMMs run in FP8 too (patch cuda.moe.fp8, tensorwise, rowwise or blockwise,
  // turbo::grouped_gemm_*_fp8): scratch holds their quantized copies, the permuted-token buffers
  // get a multiple of fp8_multiple rows and the expert widths must be multiples of it; blockwise
  // (fp8_multiple 128) also pads every expert's group to 128 rows, so that no 128-token scale
  // block of the weight gradient's copies holds two experts' tokens.
  bool fp8_moe = false;
  int64_t fp8_multiple = 16;  // what every linear dimension must divide by (blockwise FP8: 128)
  // With fp8_linear: the first and last this many layers keep bf16 linear GEMMs
  // (fp8_first_last_bf16_layers; DecoderOptions::bf16_edge_layers).
  int64_t fp8_bf16_edge_layers = 0;
  // fp8_recipe delayed: the amax histories and scales the FP8 linear slots read (the same object
  // their recipe holds; patch cuda.linear.fp8). The model gives it memory in its state arena,
  // registers every transformer layer's four linear layers (x, w, dy each), folds each training
  // step's amaxes into the next scales at the start of the following step (zero_grad) and keeps
  // evaluation forwards from recording.
  std::shared_ptr<turbo::Fp8DelayedScaling> fp8_delayed;
  // fp8_recipe delayed over several ranks (Transformer Engine's reduce_amax over its amax
  // reduction group): every group whose ranks see other parts of the same tensors. Data
  // parallelism (plain, ZeRO-1 or sharded: other samples), context parallelism (other tokens of
  // the same sequences), tensor parallelism (other slices of the weights, and of x or dy). Every
  // history holds a tensor's amax over whole tensors of the global batch, which is the max of the
  // ranks' amaxes; reduce_fp8_amaxes() takes it over each group in turn, which over a mesh is the
  // max over all of its ranks. So every rank keeps the histories and scales of one process, and
  // quantizes its own part with the scale one process would use. On the device NCCL or the
  // threaded group (group_order.h); any group in host mode. Empty: this model's amaxes alone.
  std::vector<parallel::ProcessGroup*> fp8_amax_groups;
  // FP8 linear layers keep their inputs for the backward as FP8 transposed copies (the registry
  // their recipe holds; turbo::Fp8SavedInputs): in every FP8 layer whose recompute policy keeps
  // activations (none), the plan drops bf16 ln1, ln2 and act for 1-byte copies of them, and the
  // weight-gradient GEMMs read those instead of quantizing again. Not with sharded data
  // parallelism (tp and cp: each rank's copies of what its own GEMMs read). Null: off (the inputs
  // kept in bf16, quantized again in the backward).
  std::shared_ptr<turbo::Fp8SavedInputs> fp8_saved;
  // Weights quantized once per optimizer step (the registry their recipe holds;
  // turbo::Fp8WeightCache): with gradient accumulation (loss_slots > 1) every FP8 layer's four
  // weights get persistent FP8 copies in both layouts (2 bytes a weight), made by the step's first
  // forward and read by the later micro-batches and the input-gradient GEMMs. Invalidated at each
  // step's start; evaluation forwards do not use it. Not with sharded data parallelism.
  std::shared_ptr<turbo::Fp8WeightCache> fp8_weights;
  // Rowwise and tensorwise FP8 (the handoff the recipe holds; turbo::Fp8Maxima): the SwiGLU kernels
  // take the maxima of what they write (the MLP activation, and dgate_up in the backward) and hand
  // them to the FP8 linear call that quantizes it next, which then reads the tensor once instead of
  // twice. Rowwise: only where the activation's column-scaled copy is written (its saved FP8 copy,
  // or its weight gradient after a selective or full recomputation). Null: off (the quantizer's
  // own pass).
  std::shared_ptr<turbo::Fp8Maxima> fp8_maxima;
  // Delayed FP8 with SwiGLU (the handoff the recipe holds; turbo::Fp8Producers): the MLP activation
  // and its backward's dgate_up are not written by the activation kernels; the FP8 linear calls that
  // read them quantize them from gate_up (and dact) directly, one read instead of a write and two
  // reads. Null: off (the activation kernels, then the quantizer).
  std::shared_ptr<turbo::Fp8Producers> fp8_producers;
  // Variants of the step that give the same results to rounding, kept as the references the
  // defaults (measured faster) are tested against; no config key sets them.
  BiasGrad bias_grad = BiasGrad::Ones;  // decoder.h
  bool gelu_unfused_forward = false;    // DecoderOptions
  bool gelu_unfused_backward = false;
  bool zero_grad_full = false;          // zero_grad clears every gradient; every GEMM accumulates
  // MoE experts with SwiGLU in the grouped GEMMs' epilogues (turbo/ops/grouped_gemm.h): the up
  // projection writes act beside gate|up, and the down projection's input gradient is written as
  // d(gate|up) (dact never stored); bit for bit the separate activation kernels. Applies where
  // moe_swiglu_epilogue_applies says (bf16 experts, a width the kernel tiles, a device or backend
  // that has the epilogue); the trainer sets it from patch cuda.moe.swiglu_epilogue (PRIMUS_CUDA_MOE_SWIGLU_EPILOGUE=0: off).
  bool moe_swiglu_epilogue = true;
  // AdamW runs inside backward(), one group (a layer, the embeddings, the final norm and head) as
  // soon as its gradients are final, and the layers share one gradient window (grad_placement.h):
  // the gradients take the largest layer's memory instead of the model's. One micro-batch per step
  // (loss_slots 1), no clipping (grad_norm, check_step and update throw: the backward did them),
  // full optimizer state on this GPU (no ZeRO-1 or sharding); get_grads throws (the gradients never
  // exist at once). Beside data or context parallelism see grad_mean_group.
  bool optimizer_in_backward = false;
  // The optimizer in the backward beside data (and context) parallelism: each group's gradients are
  // averaged over grad_mean_group (the dp x cp ranks; with context parallelism alone the cp group
  // when null) before its update, and the loss slots before the first group (every rank checks and
  // updates the same values). The mean of a layer runs on the group's stream while the layer below
  // runs its backward, and the update after that, so the layers alternate between two gradient
  // windows (grad_placement.h). grad_mean says the model will have such a group: model_options_for
  // sets it from the layout, for the memory plan of a projection, which has no groups.
  bool grad_mean = false;
  parallel::ProcessGroup* grad_mean_group = nullptr;
  // The MoE experts' weight gradients in bf16 (GradPlacement::bf16): the grouped weight-gradient
  // GEMM rounds its f32 sums once and AdamW reads bf16, as torch's autocast gives bf16 weight
  // gradients that the fp32 master's update reads widened. Written once, never accumulated: needs
  // optimizer_in_backward (one micro-batch), bf16 experts (not fp8_moe) and the device.
  bool bf16_expert_grads = false;
  // gradient_accumulation_fusion: false (Megatron-LM's unfused path): each linear layer's weight
  // gradient (the transformer layers', the experts', the output layer's) is computed on its own into
  // f32 scratch, rounded to the weights' dtype and then added to the fp32 gradient, instead of the
  // GEMM adding into the gradient (beta 1). The scratch grows by the largest such weight (f32).
  bool unfused_wgrad = false;
  // The fp32 master weights held split (turbo/ops/optimizer.h): the bf16 compute weights are their
  // high halves and a u16 buffer their low halves, so the master costs 2 bytes a parameter beside
  // the weights instead of 4, and AdamW writes no separate bf16 copy; the same fp32 values, the
  // bf16 copy rounded with ties away from zero. Needs the device, the whole optimizer state on this
  // GPU (no ZeRO-1 or sharded data parallelism) and AdamW.
  bool split_master = false;
  // AdamW's moments m (exp_avg) and v (exp_avg_sq) held in bf16, stored stochastically rounded
  // (turbo/ops/optimizer.h): 2 bytes a parameter each instead of 4. Not beside ZeRO-1's bucketed
  // reducer (its shards keep f32 moments) or Muon (its momentum lives in m); the model's sharded
  // data parallelism keeps bf16 chunks.
  bool exp_avg_bf16 = false, exp_avg_sq_bf16 = false;
  // Document masking of packed samples (train/document_masks.h): every forward builds its
  // documents' positions and attention bounds from its tokens on the device.
  train::DocumentMasking document_masking;
  // eod_mask_loss: the trainer masks targets (train::mask_eod_targets); the loss is the mean over
  // the targets that keep one, counted on the device per micro-batch (DecoderOptions::masked_loss).
  bool masked_loss = false;
  // optimizer: muon: the tensors Muon updates after the backward (train/muon_layout.h); AdamW
  // the rest. Needs optimizer_state and no optimizer_in_backward. Empty: AdamW everywhere. The
  // model takes the list from its own spec (the local one under tp or ep): non-empty turns Muon on.
  std::vector<train::MuonTensor> muon;
  // Tensor parallelism (Megatron's; train/tensor_parallel.h, decoder.h): this model is rank
  // tp_map->rank()'s part of the global model and is built from tp_map->local_spec() (the spec
  // given must be that one). Its flat buffers and the host copies (set_params, get_params, the
  // moments, get_grads) are in the local layout; tp_map converts to and from the global one. The
  // collectives run over tp_group (tp_comm.h: NCCL or the threaded group on the device, any group in
  // host mode); grad_norm() sums the per-head q|k norm weights' partial gradients over it and
  // returns the global norm (with the optimizer in the backward, each group's partial gradients are
  // summed just before its update and its norm over the group before its check). Sequence
  // parallelism comes with the map (decoder.h; micro_batch_size x seq_length must divide by tp).
  // Muon's matrices are then this rank's pieces of the global ones, gathered for Newton-Schulz
  // (tp_muon_pieces). Not with ZeRO-1 buffers (ConfigError).
  parallel::ProcessGroup* tp_group = nullptr;
  std::shared_ptr<const train::TpShardMap> tp_map;
  // Sharded data parallelism (model/fsdp.h) over dp_group: Megatron's optim (ZeRO-1, the
  // distributed optimizer), optim_grads (ZeRO-2) or optim_grads_params (ZeRO-3 / FSDP); this rank
  // keeps its chunk of every unit's master weights, moments and averaged gradient, the gradients
  // are reduce-scattered (mean over the ranks) as the backward finishes each unit (optim: on the
  // step's last micro-batch, begin_backward), and with optim_grads_params the layers' weights are
  // gathered one layer ahead. Each rank passes dloss for its own micro-batches (the mean over the
  // ranks is the reduction's). The host copies stay in the full layout and become collective
  // (every rank calls set_params, get_params, the moment calls and get_grads together); get_grads
  // reads the averaged gradient. With context parallelism dp_group is dp x cp (see cp_group); with
  // tensor parallelism each tp rank shards its own slices alike. Not with the optimizer in the
  // backward, Muon or DataParallel's ZeRO-1 buffers (ConfigError). dp_sharding NoShard: no effect.
  parallel::ProcessGroup* dp_group = nullptr;
  parallel::DpSharding dp_sharding = parallel::DpSharding::NoShard;
  // Context parallelism (model/cp_attention.h) over cp_group: the batches given are this rank's
  // chunk slots (train/context_parallel.h: 2B rows of seq_length / 2cp tokens for B sequences, so
  // max_batch counts rows and must be even), the attention covers the whole sequences, and
  // grad_norm() first averages the weights' gradients over the group. Each rank's loss is its own
  // tokens' mean (the sequences' mean is the mean over the ranks). With tensor parallelism each
  // rank's ring carries its tp group's heads. With sharded data parallelism dp_group must span the
  // cp ranks too (dp x cp), whose reduce-scatter then averages their parts instead of grad_norm().
  // With the optimizer in the backward each group's gradients are averaged over the group before
  // its update, and the loss slots before the first (every rank checks the same values). Not with
  // document masking or a sliding window (ConfigError); the attention slots must serve non-causal
  // calls (not the fallback).
  parallel::ProcessGroup* cp_group = nullptr;
  // moe_router_load_balancing_type global_aux_loss: groups whose members together are every rank
  // holding other tokens (the data and context parallel ranks; ep x dp beside expert parallelism),
  // each MoE layer's token counts summed over them in turn in the forward. Empty: this rank alone.
  std::vector<parallel::ProcessGroup*> balance_groups;
  // Expert parallelism (model/ep_comm.h, train/expert_parallel.h) over ep_group: this model is built
  // from ep_map->local_spec() (num_experts / ep of every MoE layer's experts, the rest whole), and
  // each MoE layer's rows go to their experts' ranks and back. Each rank's batches are its own (the
  // ep ranks are data-parallel replicas of the dense layers). grad_norm() first averages the dense
  // tensors' gradients over ep_dense_group (the ep x dp ranks, x cp beside context parallelism;
  // null: this rank alone) and the experts' over ep_expert_group (the dp (x cp) ranks holding the
  // same experts; null: none) divided by ep, then counts each expert once in the norm. With the
  // optimizer in the backward each layer's gradients get the same means before its update
  // (grad_mean_group is then ep_dense_group). Eager only (the host reads each layer's token
  // counts); not with tensor parallelism, Muon, FP8 or bf16 experts, split masters, or a recompute
  // policy that recomputes the experts (ConfigError). Beside sharded data parallelism dp_group is
  // the ranks holding the same experts, and each unit's reduce-scatter gets the two means
  // (set_fsdp_expert_parallel).
  parallel::ProcessGroup* ep_group = nullptr;
  std::shared_ptr<const train::EpShardMap> ep_map;
  parallel::ProcessGroup* ep_dense_group = nullptr;
  parallel::ProcessGroup* ep_expert_group = nullptr;
  // The held side's buffers (this rank's experts' rows from every rank) hold this factor x one
  // rank's permuted-row bound, at most ep x it (every rank's rows to this rank's experts); a routing
  // that sends more is a RuntimeError naming moe_ep_buffer_factor before any row moves.
  double ep_buffer_factor = 2.0;
};

// Whether the MoE layers of `spec` run SwiGLU in the grouped GEMMs' epilogues under `opt`
// (CudaModelOptions::moe_swiglu_epilogue): bf16 experts (not fp8_moe) and
// turbo::grouped_gemm_swiglu_available for opt.device and the expert width.
bool moe_swiglu_epilogue_applies(const CudaModelOptions& opt, const train::ModelSpec& spec);

// The memory plan a CudaModel built with `opt` and `ops` (its recompute policy) makes: the
// constructor plans with exactly this, so MemoryPlan::sizes(spec, layout, memory_plan_options(...))
// is what it allocates (`primus projection` reads it without building the model).
MemoryPlanOptions memory_plan_options(const train::ModelSpec& spec, const train::ParamLayout& layout,
                                      const CudaModelOptions& opt, const CudaOps& ops);

class CudaModel {
 public:
  // Needs a current CUDA device (select_device) unless in host mode. Throws ConfigError for shapes the kernels do
  // not serve (hidden, head and FFN sizes must be multiples of 8, so are padded vocab rows).
  CudaModel(const train::ModelSpec& spec, const CudaModelOptions& opt, CudaOps ops);
  ~CudaModel();
  CudaModel(const CudaModel&) = delete;
  CudaModel& operator=(const CudaModel&) = delete;

  const train::ModelSpec& spec() const { return spec_; }
  const train::ParamLayout& layout() const { return layout_; }
  cudaStream_t stream() const { return stream_.stream; }
  // For data parallelism: the flat fp32 gradients and bf16 weights (flat_elems each), reduced
  // and gathered in place, and the device {grad norm, clip factor} that update() applies.
  const TensorView& grads() const { return plan_->state.grads; }
  const TensorView& weights() const { return plan_->state.weights; }
  const TensorView& grad_norm_buffer() const { return plan_->state.norm; }

  // Host <-> device copies of the flat fp32 buffers (layout().total floats each). They
  // synchronise. set_params also refreshes the bf16 compute copy.
  void set_params(const float* host);
  void get_params(float* host) const;
  void set_moments(const float* m, const float* v);  // nullptr: zeros
  void get_moments(float* m, float* v) const;
  void get_grads(float* host) const;

  void zero_grad();
  // tokens, targets: host int32 [B*T], copied (stream-ordered; the host buffers may be reused at
  // once) into the device token buffers of `slot` (0 .. loss_slots-1, one per micro-batch),
  // through pinned memory (host_staging.h).
  void stage_batch(const int32_t* tokens, const int32_t* targets, int64_t B, int64_t T, int64_t slot);
  // Forward of the batch staged in `slot`; its mean loss goes to loss slot `slot`. dloss != 0
  // (pass 1 / (B*T*accumulation steps)) also runs the head's backward, block by block while each
  // block's dlogits exist: the head weight's gradient is accumulated here, and backward()
  // continues from the final norm. dloss == 0 (evaluation) leaves the gradients alone.
  void forward_staged(int64_t B, int64_t T, float dloss, int64_t slot);
  void forward(const int32_t* tokens, const int32_t* targets, int64_t B, int64_t T, float dloss, int64_t slot = 0) {
    stage_batch(tokens, targets, B, T, slot);
    forward_staged(B, T, dloss, slot);
  }
  // Before each micro-batch's backward: whether it is the step's last. Sharded with optim, the
  // earlier ones accumulate and the last reduces (one reduce-scatter a step); otherwise no effect.
  // Unset, every backward counts as the last.
  void begin_backward(bool last);
  // Accumulates parameter gradients of the last forward (which must have had dloss != 0),
  // recomputing the activations the layers did not keep.
  void backward();
  bool optimizer_in_backward() const { return opt_.optimizer_in_backward; }
  // Global gradient norm and clip factor min(1, max_norm / norm) (1 when max_norm <= 0), on the
  // device; update() scales the gradients by the factor.
  void grad_norm(float max_norm);
  // The step's non-finite check over loss slots [0, n) and the grad norm, on the device: a
  // non-finite step sets the clip factor to NaN, which makes update() leave every weight and
  // moment untouched (turbo/ops/optimizer.h). Runs after grad_norm().
  void check_step(int64_t n);
  // The learning rate and the bias corrections of step hp.step, copied to a device scalar that
  // update() reads (so a captured update follows the schedule); the other fields (betas, eps,
  // weight decay) are fixed per run.
  void set_hyper(const turbo::AdamWHyper& hp);
  // Muon's hyperparameters for the next updates (a model built with opt.muon).
  void set_muon_hyper(const turbo::MuonHyper& hp) { optimizer_->set_muon_hyper(hp); }
  size_t muon_device_bytes() const {  // the working set, and under tp the gathers' staging
    return optimizer_->muon_device_bytes() + (muon_stage_arena_ && !stream_.host ? muon_stage_arena_->capacity() : 0);
  }
  void update();
  void update(const turbo::AdamWHyper& hp) {
    set_hyper(hp);
    update();
  }

  // Synchronising reads: the sum of the mean losses in slots [0, n), and the last grad norm.
  double read_loss_sum(int64_t n) const;
  double read_grad_norm() const;
  // One D2H copy (pinned memory) after a step: the mean loss summed over slots [0, n), the grad
  // norm, and whether check_step() found the step finite (false: update() skipped it).
  struct StepStatus {
    double loss_sum = 0, grad_norm = 0;
    bool finite = true;
    // The optimizer in the backward met a non-finite gradient after a finite loss: the groups
    // before it were updated, the rest not (finite is false too).
    bool partial = false;
    // MoE models: the routing statistics of micro-batch slots [0, n), as laid out in
    // ActivationBuffers::moe_counts / moe_sums (moe_report() reads them).
    std::vector<int32_t> moe_counts;
    std::vector<float> moe_sums;
    // With the sequence-wise aux loss: ActivationBuffers::moe_seq_counts / moe_seq_sums.
    std::vector<int32_t> moe_seq_counts;
    std::vector<float> moe_seq_sums;
    // Context parallelism with the switch loss: ActivationBuffers::moe_cp_counts.
    std::vector<float> moe_cp_counts;
  };
  StepStatus read_step_status(int64_t n) { return wait_step_status(enqueue_step_status(), n); }
  // The same in two halves, so the host can enqueue the next step before reading this one's:
  // enqueue_step_status() queues the D2H copy of the status after everything enqueued so far and
  // returns a ticket; later staging (stage_batch, set_hyper, the next status) uses the other set
  // of pinned buffers. wait_step_status(ticket, n) waits for that copy alone (not for work
  // enqueued after it) and reads it. At most two steps may be outstanding.
  int enqueue_step_status();
  StepStatus wait_step_status(int ticket, int64_t n) const;

  // Phase marks for the step profiler (nullptr: none; the profiler must outlive the model's use).
  void set_profiler(StepProfiler* p) {
    prof_ = p;
    decoder_->set_profiler(p);
  }
  StepProfiler* profiler() const { return prof_; }
  // MoE: adds the step's routing statistics (from its status, micro-batches [0, n)) to `out`.
  void moe_report(const StepStatus& st, int64_t n, train::MoeStepStats& out) const;
  // Aux-loss-free balancing: moves every MoE layer's expert bias (f32, whole on every rank:
  // StateBuffers::expert_bias, which the router reads) toward balancing `load` [layer][expert]
  // (summed over the step and the ranks that split the batch). Synchronises.
  void update_expert_bias(const std::vector<std::vector<int64_t>>& load);
  // Writes the current expert biases into `flat` (the whole model's flat layout) at their slots:
  // get_params does it, and so must a caller that assembles the flat weights from the optimizer's
  // shards itself (ZeRO-1's gathered master copy), whose bias slots are never moved. Synchronises.
  void put_expert_bias(float* flat) const;
  // Tests: the experts MoE layer `layer` chose for the last forward's first n tokens ([n, topk],
  // synchronising).
  std::vector<int32_t> read_moe_topk(int64_t layer, int64_t n) const;
  Recompute recompute(int64_t layer) const { return decoder_->recompute(layer); }
  // Bytes of the activations arena (what recomputation shrinks).
  size_t activation_bytes() const { return plan_->activation_bytes(); }
  // Whether q|k|v's and the MLP up-projection's bias gradients come from their weight GEMMs
  // (BiasGrad::Ones, the default where it applies).
  bool bias_grad_from_ones() const { return decoder_->bias_grad_from_ones(); }

  void sync() const { stream_.sync(); }  // waits for everything enqueued on the model's stream

  // Device bytes held by the memory plan's three arenas.
  size_t reserved_bytes() const { return plan_->reserved_bytes(); }
  size_t scratch_high_water() const { return plan_->scratch_high_water(); }

  // The "gradients from this flat offset up are final" reports of every backward (decoder.h):
  // what data parallelism subscribes to. The points, in report order: grad_ready_points(layout()).
  // Taken by the optimizer in the backward (the call throws then).
  void on_grads_ready(std::function<void(int64_t offset)> fn);

  // fp8_recipe delayed (CudaModelOptions::fp8_delayed): the state as checkpoints keep it, the amax
  // histories [tensors, history_len] and scales [tensors], plus whether the scales are in use
  // (a step has been folded in) and whether the newest entries hold a training step's amaxes
  // still to be folded in. Synchronising. get: empty history without delayed scaling.
  struct Fp8DelayedState {
    std::vector<float> history, scale;
    int64_t tensors = 0, history_len = 0;
    bool use_history = false, pending = false;
  };
  Fp8DelayedState get_fp8_delayed() const;
  // Restores a saved state; a saved history of another length keeps its newest entries (the rest
  // empty). Throws RuntimeError naming what differs when the tensor count is not this model's or
  // a value is negative or not finite.
  void set_fp8_delayed(const Fp8DelayedState& s);
  bool fp8_delayed_on() const { return opt_.fp8_delayed != nullptr; }
  // fp8_recipe delayed with CudaModelOptions::fp8_amax_groups: the amaxes the training step
  // recorded (the histories' newest entries) become their max over the groups. Collective: every rank calls
  // it once per step, after the step's last backward, so that the next zero_grad folds the same
  // amaxes in everywhere and a checkpoint saved between steps holds them. In the model's stream
  // order (NCCL: enqueued, so a captured step holds it). Nothing to do without the group or
  // without a training backward since the last fold.
  void reduce_fp8_amaxes();

 private:
  std::vector<const train::ParamTensor*> expert_bias_slots() const;
  void check_batch(int64_t B, int64_t T, int64_t slot, const char* what) const;
  ExecContext ctx() const;
  void mark(Phase p) const {
    if (prof_) prof_->mark(p);
  }

  train::ModelSpec spec_;
  train::ParamLayout layout_;
  CudaModelOptions opt_;
  ModelStream stream_;
  std::unique_ptr<MemoryPlan> plan_;
  std::unique_ptr<OptimizerState> optimizer_;
  std::unique_ptr<HostStaging> staging_;
  std::unique_ptr<TpComm> tp_;  // tensor parallelism (null without)
  // Tensor parallelism: the gradient ranges summed over the tp group in grad_norm() (offset, count:
  // the tensors whose gradient each rank holds a part of; sharded, this rank's pieces of them in
  // its shard), and the replicated key/value rows' exchanges (per exchange: the buffer offset, the
  // gradient offset and the length of each piece).
  std::vector<std::pair<int64_t, int64_t>> tp_partial_;
  struct KvCopy {
    int64_t buf = 0, grad = 0, count = 0;
  };
  std::vector<std::vector<KvCopy>> kv_copies_;
  // The optimizer in the backward under tensor parallelism: per optimizer group (its first layout
  // offset), the partial tensors (layout indices) and the key/value exchanges (indices into
  // kv_copies_) reduced before its update.
  std::map<int64_t, std::vector<size_t>> tp_group_partial_, tp_group_kv_;
  void tp_reduce_group(int64_t offset);
  // Replicated key/value rows: exchange k's pieces summed over the group; grad(piece) is where a
  // piece's gradient lies.
  void kv_exchange(size_t k, const std::function<float*(const KvCopy&)>& grad);
  // Replicated key/value rows (tp above num_query_groups): the exchange buffer of their gradient sum.
  std::unique_ptr<turbo::Arena> kv_arena_;
  TensorView kv_exchange_;
  // Sharded data parallelism: the plan, the shard as a layout (the optimizer's tensors) with its
  // buffers and placement, and the collectives.
  std::shared_ptr<const FsdpPlan> fsdp_plan_;
  train::ParamLayout shard_layout_;
  StateBuffers shard_state_;
  GradPlacement shard_place_;
  std::unique_ptr<FsdpComm> fsdp_;
  std::unique_ptr<CpAttention> cp_;  // context parallelism (null without)
  std::unique_ptr<EpComm> ep_;       // expert parallelism (null without)
  // Expert parallelism: the dense gradients' and the experts' means (grad_norm()).
  void reduce_expert_parallel_grads();
  void set_fsdp_expert_parallel();  // beside sharded data parallelism: FsdpComm's hooks
  // A flag per layout tensor as a flag per piece of this rank's shard (the sharded strategies).
  std::vector<bool> shard_counted(const std::vector<bool>& counted) const;
  // The optimizer in the backward beside dp or cp (CudaModelOptions::grad_mean_group): the group,
  // as NCCL (null for another kind), and the optimizer group (its first layout offset) whose mean is
  // in flight, updated when the next group is ready or at the backward's end (-1: none).
  parallel::ProcessGroup* mean_group_ = nullptr;
  // global_aux_loss: the groups the MoE token counts are summed over (with NCCL where they are),
  // and the ranks they span together.
  std::vector<std::pair<parallel::ProcessGroup*, parallel::NcclProcessGroup*>> balance_;
  int64_t balance_ranks_ = 1;
  parallel::NcclProcessGroup* mean_nccl_ = nullptr;
  int64_t mean_pending_ = -1;
  // The optimizer in the backward beside expert parallelism: per gradient-ready point, its tensors
  // (their gradients' means differ: the dense over mean_group_, the experts over ep_expert_group,
  // then divided by ep in update_pending_group), and the experts' group as NCCL.
  std::map<int64_t, std::vector<size_t>> ep_group_tensors_;
  parallel::NcclProcessGroup* ep_expert_nccl_ = nullptr;
  void in_backward_ready(int64_t offset);
  void update_pending_group();
  // Muon under tensor parallelism: the blocks as pieces of the global matrices, and the staging of
  // the gathers of column pieces (f32, the largest such whole matrix).
  OptimizerState::MuonPieceFn tp_muon_pieces();
  int64_t muon_stage_elems_ = 0;
  std::unique_ptr<turbo::Arena> muon_stage_arena_;
  TensorView muon_stage_;
  // The full layout-ordered array of a shard buffer from every rank (collective).
  void gather_full(const TensorView& shard, float* host) const;
  std::unique_ptr<Decoder> decoder_;
  StepProfiler* prof_ = nullptr;
  // fp8_recipe delayed: a training step has recorded amaxes that the next zero_grad folds in.
  bool fp8_pending_ = false;
  // reduce_fp8_amaxes: the staging of the newest entries (f32 [tensors]), and the amax groups as
  // NCCL (null for another kind), one per CudaModelOptions::fp8_amax_groups entry.
  TensorView fp8_amax_stage_;
  std::vector<parallel::NcclProcessGroup*> amax_nccl_;
  void init_fp8_delayed();
};

}  // namespace primus::backends::cuda
