// The reference decoder (GPT-2 and Llama from one ModelSpec) on the CPU kernels of
// turbo/kernels/cpu, llm.c style: parameters and gradients in one flat buffer each (layout from
// train/param_layout.h), activations preallocated for the largest batch, an explicit forward
// that saves what backward needs, and a backward that accumulates into the gradients.
// Real is float for training and double for the finite-difference gradient checks.
#pragma once
#include <cstdint>
#include <memory>
#include <vector>

#include "backends/reference/moe_layer.h"
#include "parallel/process_group.h"
#include "train/tensor_parallel.h"

#include "train/document_masks.h"
#include "train/model_spec.h"
#include "train/param_layout.h"
#include "turbo/kernels/cpu/attention.h"
#include "turbo/kernels/cpu/loss.h"

namespace primus::backends::reference {

template <typename Real>
class GptModel {
 public:
  GptModel(const train::ModelSpec& spec, int64_t max_batch, int64_t max_seq);

  const train::ModelSpec& spec() const { return spec_; }
  const train::ParamLayout& layout() const { return layout_; }
  Real* param(const std::string& name) { return params.data() + layout_.get(name).offset; }

  // GPT-2 init: N(0, std) for weights and embeddings, residual output projections scaled by
  // 1/sqrt(2 * num_layers), norm weights 1, biases 0. Deterministic in `seed`.
  void init_weights(uint64_t seed);

  // tokens [B,T]; targets [B,T] or nullptr. Returns the mean loss over targets (0 without).
  // With dloss != 0 the logits buffer is overwritten by dlogits * dloss, ready for backward();
  // otherwise logits() holds the logits [B*T, padded_vocab].
  double forward(const int32_t* tokens, const int32_t* targets, int64_t B, int64_t T, double dloss = 0);
  // Accumulates into `grads` (call zero_grad() first in each step). Needs forward(..., dloss).
  void backward();
  void zero_grad();
  // Document masking of packed samples (reset_attention_mask / reset_position_ids): every
  // forward builds its attention documents and positions from its tokens.
  void set_document_masking(const train::DocumentMasking& m) { masking_ = m; }
  // eod_mask_loss: of `total` targets of the next training micro-batch (its whole sequences, over
  // the context-parallel group) `kept` have a loss. The loss is their mean, so the cross-entropy's
  // gradient scale is dloss x total / kept; the MoE balancing terms keep dloss (they are the
  // routed tokens', masked or not).
  void set_loss_targets(int64_t kept, int64_t total) {
    kept_targets_ = kept;
    total_targets_ = total;
  }
  // Tensor parallelism (Megatron's): this model holds the rank's slice of the parameters, built
  // from map->local_spec(); `group` is the tp group (map->tp() ranks, this one map->rank()).
  // Column-parallel q/k/v and gate/up, row-parallel output projections summed over the group, the
  // embedding and head split by vocabulary with the cross-entropy computed without gathering the
  // logits. With sequence_parallel the norms and residuals hold 1/tp of the tokens (batch x
  // sequence flattened, rank r the r-th slice) and the sums are reduce-scatters, the gathers
  // all-gathers. float only. The map and group must outlive the model.
  void set_tensor_parallel(const train::TpShardMap* map, parallel::ProcessGroup* group, bool sequence_parallel);
  // Context parallelism: every forward's rows hold this rank's T / cp tokens of each sequence
  // (backends/reference/context_parallel.h's balanced chunks of the model's seq_length), their
  // positions the global ones, attention is ring attention over `group`, and forward() returns
  // the mean loss over the whole group's tokens. float only; the group must outlive the model.
  void set_context_parallel(parallel::ProcessGroup* group);
  // Expert parallelism (train/expert_parallel.h): the model was built from an EpShardMap's local
  // spec (this rank's experts of every MoE layer); each MoE layer sends its routed rows to their
  // experts' ranks of `group` and back. float only; the group must outlive the model.
  void set_expert_parallel(parallel::ProcessGroup* group);
  // moe_router_load_balancing_type global_aux_loss: the ranks whose tokens the MoE layers balance
  // together (MoeLayer::set_balance_group), and the start of each optimizer step (begin_moe_step:
  // the step's first micro-batch comes next).
  void set_balance_group(parallel::ProcessGroup* group);
  void begin_moe_step();
  // Sharded data parallelism (backends/reference/fsdp.h): the model calls these around each unit
  // of its parameters, unit 0 being everything outside the layers (embeddings, final norm, head)
  // and unit 1 + l layer l: gather before the unit's weights are read in a forward or backward,
  // release after; grads_ready once a backward has finished the unit's gradient.
  struct ShardingHooks {
    virtual ~ShardingHooks() = default;
    virtual void gather(int unit) = 0;
    virtual void release(int unit) = 0;
    virtual void grads_ready(int unit) = 0;
  };
  void set_sharding_hooks(ShardingHooks* hooks) { hooks_ = hooks; }
  // Sums over the tp group the gradients that are each rank's part (map->partial_grad): once per
  // optimizer step, after the last backward. No-op without tensor parallelism.
  void reduce_tp_partial_grads();
  // [B*T, padded_vocab]; with tensor parallelism this rank's vocabulary columns only.
  const Real* logits() const { return logits_.data(); }
  int64_t loss_count() const { return count_; }  // targets counted by the last forward

  // MoE layers (null for a dense layer): routing statistics of the last forward.
  const MoeLayer<Real>* moe_layer(int64_t l) const { return moe_.at(static_cast<size_t>(l)).get(); }
  MoeLayer<Real>* moe_layer(int64_t l) { return moe_.at(static_cast<size_t>(l)).get(); }
  // The MoE layers' loss terms of the last forward, sum over layers of aux_coeff * aux + z_coeff *
  // z: part of the objective the backward differentiates, not of the value forward() returns
  // (the language-model loss, which evaluation and logs compare across models). The backward
  // scales them by dloss * B * T (dloss being the per-token scale of the language-model loss).
  double moe_loss() const;
  // Aux-loss-free balancing: every layer's expert bias moves toward balancing `load` [layer][expert]
  // (the slots routed over the step, summed over data-parallel ranks; empty for dense layers).
  void update_expert_bias(const std::vector<std::vector<int64_t>>& load);

  std::vector<Real> params, grads;

 private:
  struct LayerActs {
    std::vector<Real> x_in, ln1, mean1, rstd1, q, k, v, q_rot, k_rot, att, lse, x2, ln2, mean2, rstd2, fc, act;
    // qk_layernorm: q and k before their per-head RMSNorm, and its rstd per (token, head).
    std::vector<Real> q_pre, k_pre, rstd_q, rstd_k;
  };
  void norm_forward(Real* out, Real* mean, Real* rstd, const Real* inp, const std::string& name, int64_t N);
  void norm_backward(Real* dinp, const Real* dout, const Real* inp, const Real* mean, const Real* rstd,
                     const std::string& name, int64_t N);
  Real* grad(const std::string& name) { return grads.data() + layout_.get(name).offset; }
  const Real* weight_or_null(const std::string& name) {
    const train::ParamTensor* t = layout_.find(name);
    return t ? params.data() + t->offset : nullptr;
  }
  Real* grad_or_null(const std::string& name) {
    const train::ParamTensor* t = layout_.find(name);
    return t ? grads.data() + t->offset : nullptr;
  }

  train::ModelSpec spec_;
  train::ParamLayout layout_;
  int64_t max_tokens_;
  std::vector<LayerActs> acts_;
  std::vector<std::unique_ptr<MoeLayer<Real>>> moe_;
  double dloss_ = 0;
  typename MoeLayer<Real>::Weights moe_weights(int64_t l);
  typename MoeLayer<Real>::Grads moe_grads(int64_t l);
  std::vector<Real> x_final_, lnf_, meanf_, rstdf_, logits_, losses_;
  std::vector<Real> dx_, dln_, datt_, dq_, dk_, dv_, dq_rot_, dk_rot_, dq_pre_, dk_pre_, dfc_, dact_;
  std::vector<int32_t> tokens_;
  int64_t B_ = 0, T_ = 0, count_ = 0;
  train::DocumentMasking masking_;
  int64_t kept_targets_ = 0, total_targets_ = 0;  // set_loss_targets (equal: no target masked)
  train::DocumentTables doc_;  // of the last forward (when masking_ is enabled)
  ShardingHooks* hooks_ = nullptr;  // sharded data parallelism (null without)
  parallel::ProcessGroup* cp_group_ = nullptr;  // context parallelism (null without)
  std::vector<int32_t> cp_positions_;  // [B, T / cp] of the last forward
  // forward() and backward() without the sharding hooks of unit 0 around them.
  double forward_body(const int32_t* tokens, const int32_t* targets, int64_t B, int64_t T, double dloss);
  void backward_body();
  // Tensor parallelism: the map and group (null without), the rows [tp_row0_, tp_row0_ + tp_rows_)
  // of the flattened tokens this rank's residual stream holds (all of them without sequence
  // parallelism).
  const train::TpShardMap* tp_map_ = nullptr;
  parallel::ProcessGroup* tp_group_ = nullptr;
  bool tp_sp_ = false;
  int64_t tp_row0_ = 0, tp_rows_ = 0;
  bool tp() const { return tp_group_ != nullptr; }
  // The sum over the group of a [N, C] buffer of parts: in place, or (sequence parallel) this
  // rank's rows of the sum into the same buffer at its rows.
  void tp_reduce_rows(Real* buf, int64_t N, int64_t C);
  // Sequence parallel: every rank's rows of a [N, C] buffer, in place, from each rank's rows at its place.
  void tp_gather_rows(Real* buf, int64_t C);
  void tp_embedding_forward(Real* x, int64_t B, int64_t T);
  void tp_embedding_backward(int64_t B, int64_t T);
  // Vocabulary-parallel cross-entropy over logits_ (this rank's columns), the same on every rank
  // of the group; with dloss != 0 logits_ becomes dlogits * dloss.
  turbo::cpu::CrossEntropyResult tp_cross_entropy(const int32_t* targets, int64_t N, double dloss);
  void add_bias_rows(Real* x, const std::string& bias, int64_t rows);
  // The cross-entropy of one process over logits_ (with dloss != 0 logits_ becomes dlogits).
  turbo::cpu::CrossEntropyResult plain_cross_entropy(const int32_t* targets, int64_t N, double dloss);
  // The attention of the last forward's batch: causal, the model's sliding window, documents.
  turbo::cpu::AttentionParams attention_params() const;
  // Per-token positions of the last forward's batch, or nullptr for 0..T-1 in every row.
  const int32_t* positions() const {
    if (cp_group_) return cp_positions_.data();
    return masking_.reset_position_ids ? doc_.positions.data() : nullptr;
  }
};

extern template class GptModel<float>;
extern template class GptModel<double>;

}  // namespace primus::backends::reference
