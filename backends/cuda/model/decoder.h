// The CUDA decoder: GPT-2 and Llama from one ModelSpec, llm.c style, as a sequence of op-slot
// calls (CudaOps) over the memory plan's parameter and activation views. It owns no memory: the
// forward (embedding, layers, final norm, LM head and loss in row blocks, with the head's
// backward while each block's logits exist) and the backward (layers top down with their
// recomputation, the embedding last) only enqueue work on the model's stream.
//
// Precision: bf16 activations and weights, fp32 accumulation in every GEMM, norm and loss, fp32
// parameter gradients (accumulated across micro-batches). In host mode the same calls run on
// fp32 host tensors through Turbo's CPU backends.
//
// Gradients ready. The backward finishes the parameter gradients from the top of the flat
// layout down (train/param_layout.h order: embeddings, layers 0..L-1, final norm, untied head):
// after the final norm's backward every gradient from final_norm.weight up is final for the
// micro-batch, after layer l's every gradient from layers.l.norm1.weight up, and after the
// embedding's all of them. The decoder reports each such point to the subscriber of
// on_grads_ready() (data parallelism launches its reductions from there) in the order
// grad_ready_points() lists them.
#pragma once
#include <cstdint>
#include <functional>
#include <string>
#include <vector>

#include "backends/cuda/hooks.h"
#include "backends/cuda/model/cp_attention.h"
#include "backends/cuda/model/ep_comm.h"
#include "backends/cuda/model/fsdp_comm.h"
#include "backends/cuda/model/memory_plan.h"
#include "backends/cuda/model/tp_comm.h"
#include "backends/cuda/profile.h"
#include "turbo/ops/head_norm.h"
#include "turbo/ops/moe.h"
#include "train/document_masks.h"
#include "train/model_spec.h"
#include "train/param_layout.h"

namespace primus::backends::cuda {

// Where the linear layers' bias gradients are computed:
//   Norm      the attention projection's and the MLP down-projection's, whose output gradient is
//             the residual stream's, in the norm backward that produces it
//             (NormBackwardArgs::dinp_colsum); the others by the cuda.linear.bias_grad slot;
//   Separate  all by the cuda.linear.bias_grad slot (a column-sum reduction each);
//   Gemm      all in the weight-gradient GEMM's epilogue (cuBLASLt BGRADB);
//   Ones      (the default; where it applies: linear biases, no FP8) as Norm for the projections
//             that write the residual; q|k|v's and the MLP up-projection's, whose inputs are norm
//             outputs, in their weight GEMM: the norm writes its rows kOnesPad columns apart with a
//             column of ones after them (set once at construction), so dout^T @ [inp | 1] is
//             [weight gradient | bias gradient] (cuda.linear.weight_grad_ones) instead of a pass
//             over dout. Elsewhere it falls back to Norm.
// All four give the same gradients to rounding (the parity tests compare them); Ones was measured
// fastest, the others stay as the references it is checked against.
enum class BiasGrad : uint8_t { Norm, Separate, Gemm, Ones };

// The batch bounds, the ones padding and the recompute policy are the memory plan's.
struct DecoderOptions {
  BiasGrad bias_grad = BiasGrad::Ones;
  // GPT-2's GELU: fused into the MLP up-projection's epilogue (forward) and into its input
  // gradient's GEMM (backward, dGELU), or run as separate ops (measured slower; kept as the
  // reference the fused epilogues are checked against).
  bool gelu_unfused_forward = false, gelu_unfused_backward = false;
  // MoE experts: SwiGLU in the grouped GEMMs' epilogues (CudaModelOptions::moe_swiglu_epilogue).
  bool moe_swiglu_epilogue = false;
  // Weight gradients computed on their own, rounded to the weights' dtype and then added to the
  // gradients (CudaModelOptions::unfused_wgrad; the scratch holds one, MemoryPlanOptions::unfused_wgrad).
  bool unfused_wgrad = false;
  // reset_attention_mask / reset_position_ids (train/document_masks.h): the plan holds the tables
  // (MemoryPlanOptions::document_masks), each forward fills its slot's from its tokens.
  train::DocumentMasking document_masking;
  // Masked targets (eod_mask_loss): each forward counts its targets that keep a loss on the device
  // (ActivationBuffers::kept, summed over the context-parallel group) and the loss is their mean.
  bool masked_loss = false;
  // fp8_first_last_bf16_layers: the first and last this many transformer layers run their linear
  // layers with the bf16 slots (CudaOps::defaults()) instead of the given ones (FP8 under patch
  // cuda.linear.fp8), as Transformer Engine / Megatron keep the edge layers in higher precision.
  int64_t bf16_edge_layers = 0;
  // Tensor parallelism (tp_comm.h; null: none). The spec is this rank's part (TpShardMap's local
  // spec): q|k|v and the MLP up-projection are column-parallel (whole heads, a slice of the FFN),
  // the attention and MLP output projections row-parallel, their partial outputs summed over the
  // group before the residual add (their biases added by rank 0 alone), as are the input
  // gradients of the column-parallel GEMMs before the norm backward; the embedding and the head are
  // vocabulary-parallel (turbo::vocab_parallel_ce_*: the logits are never gathered). The residual
  // stream, the norms and the replicated weights are the same on every rank.
  // With the map's sequence parallelism, each rank holds N / tp rows of the residual stream (rank r
  // the r-th block of the flattened batch) and runs the norms on them: their outputs are
  // all-gathered before the column-parallel GEMMs, the row-parallel outputs reduce-scattered
  // instead of all-reduced; in the backward the residual gradient is all-gathered before the
  // row-parallel GEMMs and the column-parallel input gradients reduce-scattered. The norm weights'
  // and the row-parallel biases' gradients are then each rank's part (summed by the model).
  const TpComm* tp = nullptr;
  // Sharded data parallelism (fsdp_comm.h; null: none): each layer's weights are made present
  // before its forward and its backward (the next layer's gathered meanwhile); the gradients-ready
  // reports are its reductions (the model subscribes them).
  FsdpComm* fsdp = nullptr;
  // Context parallelism (cp_attention.h; null: none): the batch is the rank's chunk slots (2B rows
  // of T / 2cp tokens), the attention runs over every rank's k|v, positions are the chunks' global ones.
  CpAttention* cp = nullptr;
  // Expert parallelism (ep_comm.h; null: none): the spec holds this rank's experts; each MoE
  // layer's permuted rows go to their experts' ranks between the permutation and the expert GEMMs
  // and come back before the weighted combine (the held side's buffers: MoeActs).
  EpComm* ep = nullptr;
  // moe_router_load_balancing_type global_aux_loss: sums a layer's f32 token counts [E] in place
  // over the ranks that hold other tokens (CudaModelOptions::balance_groups), in the model's stream
  // order (unset: this rank alone); balance_ranks is their number.
  std::function<void(const TensorView&)> balance_sum;
  int64_t balance_ranks = 1;
  // Rowwise and tensorwise FP8 (CudaModelOptions::fp8_maxima; null: none): the SwiGLU kernels write their output's
  // maxima into ActivationBuffers::fp8_maxima and put them here for the FP8 linear call after them.
  turbo::Fp8Maxima* fp8_maxima = nullptr;
  // Delayed FP8 (CudaModelOptions::fp8_producers; null: none): the FP8 layers' SwiGLU forward and
  // backward are not run; the decoder puts their inputs here for the linear call that quantizes
  // the activation (or dgate_up) from them.
  turbo::Fp8Producers* fp8_producers = nullptr;
};

class Decoder {
 public:
  static constexpr int64_t kOnesPad = 8;  // 16 bytes of bf16: the norm's vector stores stay aligned
  // The ones columns apply with linear biases and bf16 GEMMs (the FP8 slots quantize their
  // inputs whole, padding included).
  static int64_t ones_pad_for(const train::ModelSpec& spec, BiasGrad mode, bool fp8_linear) {
    return mode == BiasGrad::Ones && spec.bias && !fp8_linear ? kOnesPad : 0;
  }
  // Whether a tensor's gradient is first written by a GEMM with beta 0 in each step (the linear
  // layers' weights and the head's), so that zero_grad() need not clear it.
  static bool written_by_first_gemm(const train::ModelSpec& spec, const std::string& name);

  Decoder(const train::ModelSpec& spec, const train::ParamLayout& layout, const DecoderOptions& opt,
          const CudaOps& ops, const MemoryPlan& plan, const ExecContext& ctx);

  // The start of a step whose gradients zero_grad did not clear everywhere: the first
  // micro-batch's weight-gradient GEMMs write (beta 0) instead of accumulating.
  void begin_step() { fresh_head_ = fresh_layers_ = true; }
  // Forward of the batch staged in `slot`; its mean loss goes to loss slot `slot`. dloss != 0
  // also runs the head's backward block by block (the head weight's gradient is accumulated
  // here, backward() continues from the final norm); dloss == 0 (evaluation) leaves the
  // gradients alone.
  void forward(int64_t B, int64_t T, float dloss, int64_t slot);
  // Accumulates parameter gradients of the last forward (which must have had dloss != 0),
  // recomputing the activations the layers did not keep.
  void backward();

  // The subscriber of the "gradients from this offset up are ready" reports (see above).
  void on_grads_ready(std::function<void(int64_t offset)> fn) { grads_ready_ = std::move(fn); }

  bool bias_grad_from_ones() const { return ones_pad_ != 0; }
  // The MoE layers' routing configuration (turbo/ops/moe.h) and group alignment.
  const turbo::RouterConfig& router_config() const { return router_; }
  int64_t moe_align() const { return moe_align_; }
  Recompute recompute(int64_t layer) const { return policy_.at(static_cast<size_t>(layer)); }
  int64_t batch() const { return B_; }
  int64_t seq() const { return T_; }
  // B * T of the last forward with a gradient (the step status divides by it).
  int64_t train_tokens() const { return train_tokens_; }
  // T of that forward (its B * T tokens are B sequences of T).
  int64_t train_seq() const { return train_seq_; }
  // Where the sequences of a forward of N tokens in rows of T lie (the sequence-wise loss's
  // statistics and gradient): runs of T rows; under context parallelism two chunks of each sequence.
  turbo::cpu::SequenceRuns seq_runs(int64_t N, int64_t T) const;
  // The row of ActivationBuffers::moe_cp_counts that holds the micro-batch switch loss's counts
  // summed over the cp group (after global_aux_loss's, when that is listed).
  int64_t cp_counts_row() const { return spec_.moe.global_aux_loss ? 1 : 0; }
  void set_profiler(StepProfiler* p) { prof_ = p; }
  StepProfiler* profiler() const { return prof_; }

 private:
  // Layer l's forward from its residual input. recompute = false: the step's forward (norm1
  // fused with the residual add of the layer below, unless l == 0); true: the backward's
  // recomputation (norm1 from the stored x_in; the last GEMM, whose output nothing needs, skipped).
  void layer_forward(int64_t l, int64_t B, int64_t T, bool recompute);
  // Document masking (DecoderOptions::document_masking): fills slot_'s tables from its tokens; the
  // views of this micro-batch's positions [B,T] and cu_seqlens [B*T + 1] (undefined when the
  // corresponding reset is off).
  void build_document_tables(int64_t B, int64_t T);
  TensorView doc_positions(int64_t B, int64_t T) const;
  // The token positions of this micro-batch: context parallelism's chunk positions, else the
  // documents' (undefined: 0..T-1 in every row).
  TensorView positions(int64_t B, int64_t T) const { return opt_.cp ? opt_.cp->positions(B, T) : doc_positions(B, T); }
  // [rows, width] view of columns [col, col + width) of a [rows, W] buffer.
  static TensorView columns(const TensorView& buf, int64_t col, int64_t width);
  TensorView doc_cu_seqlens(int64_t B, int64_t T) const;
  void recompute_layer(int64_t l, int64_t B, int64_t T);  // refills what the layer's policy did not keep
  // A MoE layer's feed-forward: a_.tmp [N,C] = moe(ln2); its backward from dres into a_.dln
  // (overwritten) and the layer's MoE gradients.
  void moe_forward(int64_t l, int64_t N);
  void moe_backward(int64_t l, int64_t N);
  // Refills the MoE activations the layer's recompute policy did not keep, on the saved routing
  // (the routing is always kept): the permuted input and the SwiGLU outputs (routed and shared
  // experts), and with `gemms` (full recompute) also gate|up and the expert output (the grouped
  // GEMMs) and the shared expert's gate|up.
  void moe_recompute(int64_t l, int64_t N, bool gemms);
  // Micro-batch slot `slot`'s routing statistics of MoE layer l (views into moe_counts / moe_sums).
  TensorView moe_counts(int64_t slot, int64_t l) const;
  TensorView moe_kept(int64_t slot, int64_t l) const;
  TensorView moe_prob_sum(int64_t slot, int64_t l) const;
  // The sequence-wise aux loss's statistics of slot `slot`, MoE layer l, sequences [b, b + rows):
  // counts i32 and sums of p f32, [rows, E] views into moe_seq_counts / moe_seq_sums (an error
  // past the micro-batch the plan was made for).
  TensorView moe_seq_counts(int64_t slot, int64_t l, int64_t b, int64_t rows) const;
  TensorView moe_seq_sums(int64_t slot, int64_t l, int64_t b, int64_t rows) const;
  TensorView moe_z_sum(int64_t slot, int64_t l) const;
  // A linear layer's gradients from dout: dinp = (skipped if undefined), w.g +=, b.g += (if the
  // layer has a bias: its own column-sum reduction, the GEMM's epilogue with BiasGrad::Gemm, or
  // nothing when `bias_done`: a norm backward already summed dout into b.g).
  void linear_backward(const TensorView& dinp, const Param& w, const Param& b, const TensorView& dout,
                       const TensorView& inp, bool bias_done = false);
  // A weight gradient g (+= when accumulate): product(g, accumulate) computes it, into g itself, or
  // with DecoderOptions::unfused_wgrad into f32 scratch (accumulate false) that is then rounded to
  // weight_dtype and added to g (turbo::add_gradient). bf16 gradients (written once) run as fused.
  template <class Product>
  void weight_grad(const TensorView& g, turbo::DType weight_dtype, bool accumulate, Product&& product);
  // f32 scratch shaped as g (contiguous), borrowed from the scratch arena under the caller's scope.
  TensorView scratch_like(const TensorView& g) const;
  // out = norm(inp (+ residual, stored to res_out)); residual undefined: out = norm(inp).
  void norm_forward(const TensorView& out, const TensorView& mean, const TensorView& rstd, const TensorView& res_out,
                    const TensorView& inp, const TensorView& residual, const NormParams& p, int64_t N);
  // dres (+)= d inp, p's gradients +=; with BiasGrad::Norm also dres_colsum (if defined) += the
  // column sums of the resulting dres (the bias gradient of the linear layer that wrote it).
  void norm_backward(const TensorView& dres, const TensorView& dout, const TensorView& inp, const TensorView& mean,
                     const TensorView& rstd, const NormParams& p, int64_t N, bool accumulate,
                     const TensorView& dres_colsum = {});
  bool norm_colsum() const { return opt_.bias_grad == BiasGrad::Norm || opt_.bias_grad == BiasGrad::Ones; }
  // The [N, C + pad] view (with the column of ones) of a padded [N, C] norm output, or undefined.
  TensorView with_ones(const TensorView& t) const;
  // The per-head q|k norm of layer activations `a` over the q|k columns of `buf` (the packed qkv
  // buffer, or its gradient in the backward), forward arguments; the backward adds its gradients.
  // qk_layernorm_scope: projection: RMSNorm over the whole q and k columns of `buf` (the packed
  // qkv in the forward, dqkv in the backward: in place there too), see decoder.cpp.
  void qk_norm_whole(const LayerActs& a, const LayerParams& p, const TensorView& buf, int64_t N, bool backward);
  turbo::HeadNormArgs qk_norm_args(const LayerActs& a, const LayerParams& p, const TensorView& buf, int64_t B,
                                   int64_t T) const;
  // [B,T,heads,D] view of columns [col, col + heads*D) of a row-major [rows, W] buffer (tokens W apart).
  TensorView heads(const TensorView& buf, int64_t B, int64_t T, int64_t col, int64_t heads) const;
  void mark(Phase p) const {
    if (prof_) prof_->mark(p);
  }
  // Tensor parallelism: t summed over the group in place (nothing without it); a row-parallel
  // layer's bias (rank 0 adds it once to the summed output); the vocabulary-parallel loss of one
  // head block (losses, and with dloss != 0 the block's dlogits in place of its logits).
  void tp_sum(const TensorView& t) const {
    if (opt_.tp) opt_.tp->all_reduce(t);
  }
  // Sequence parallelism (sp_): this rank's rows of a micro-batch of N rows, and its view of a
  // whole-batch buffer; without it, all N rows. row_sum: a row-parallel output (or a
  // column-parallel input gradient) over the whole batch summed over the group (sp: reduce-scattered
  // into this rank's rows); gather: this rank's rows of `full` to every rank (nothing without sp).
  int64_t local_rows(int64_t N) const { return sp_ ? N / opt_.tp->size() : N; }
  TensorView mine(const TensorView& full, int64_t N) const {
    const int64_t n = local_rows(N), r0 = sp_ ? opt_.tp->rank() * n : 0;
    return full.slice0(r0, r0 + n);
  }
  void row_sum(const TensorView& full, int64_t N) const {
    if (sp_) opt_.tp->reduce_scatter_rows(full.slice0(0, N));
    else tp_sum(full.slice0(0, N));
  }
  void gather(const TensorView& full, int64_t N) const {
    if (sp_) opt_.tp->gather_rows(full.slice0(0, N));
  }
  TensorView row_bias(const Param& b) const { return opt_.tp && opt_.tp->rank() != 0 ? TensorView() : b.w; }
  void tp_loss(const TensorView& logits, const TensorView& targets, const TensorView& losses, float dloss,
               const TensorView& kept) const;
  void ready(int64_t offset) const {
    if (grads_ready_) grads_ready_(offset);
  }

  const train::ModelSpec& spec_;
  DecoderOptions opt_;
  int64_t max_batch_, max_seq_, ones_pad_;
  CudaOps ops_;
  CudaOps edge_ops_;             // ops_ with bf16 linear slots (DecoderOptions::bf16_edge_layers)
  const CudaOps* lin_ = &ops_;   // the linear slots of the layer being run
  // The linear slots of layer l (bf16 for the edge layers of an FP8 model).
  const CudaOps* linears_for(int64_t l) const {
    const int64_t e = opt_.bf16_edge_layers;
    return e > 0 && (l < e || l >= spec_.num_layers - e) ? &edge_ops_ : &ops_;
  }
  // Where layer l's SwiGLU kernel writes the maxima of its output y [rows, cols] for the FP8
  // linear call that quantizes y next (DecoderOptions::fp8_maxima), or undefined (no handoff, or
  // the layer's linears are bf16); put_maxima hands them over after the kernel ran.
  TensorView swiglu_maxima(int64_t l, const TensorView& y) const;
  // Whether layer l's SwiGLU is folded into its FP8 quantizations (DecoderOptions::fp8_producers):
  // its linears are the FP8 ones and have no biases. put_swiglu hands the quantizer act's inputs
  // (backward = false) or dgate_up's (true).
  bool folds_swiglu(int64_t l) const;
  void put_swiglu(int64_t l, int64_t N, bool backward) const;
  void put_maxima(const TensorView& y, const TensorView& maxima) const;
  const ModelParams& p_;
  const ActivationBuffers& a_;
  TensorView rope_table_, loss_slots_;
  ExecContext ctx_;
  std::vector<Recompute> policy_;
  int64_t final_norm_ready_ = 0;             // offset of final_norm.weight
  std::vector<int64_t> layer_ready_;         // per layer: offset of layers.l.norm1.weight
  std::function<void(int64_t)> grads_ready_;
  bool fresh_head_ = false, fresh_layers_ = false;
  int64_t B_ = 0, T_ = 0;
  int64_t slot_ = 0;          // the token slot of the last forward (the embedding's backward reads it)
  float dloss_ = 0;           // the last forward's per-token loss scale (the MoE loss terms' scale is dloss * N)
  turbo::RouterConfig router_;
  int64_t moe_align_ = 1;
  std::vector<int64_t> moe_index_;  // layer -> its index among the MoE layers (-1: dense)
  int64_t train_tokens_ = 1, train_seq_ = 1;
  bool have_grad_logits_ = false;
  bool sp_ = false;  // sequence parallelism (DecoderOptions::tp)
  StepProfiler* prof_ = nullptr;
};

// The offsets the decoder reports to on_grads_ready, in order: final_norm.weight's, then
// layers.{L-1..0}.norm1.weight's, then 0.
std::vector<int64_t> grad_ready_points(const train::ParamLayout& layout);

}  // namespace primus::backends::cuda
