// The reference MoE feed-forward layer (train/model_spec.h's MoeSpec) on the CPU kernels of
// turbo/kernels/cpu: router -> row plan -> permute -> per-expert SwiGLU MLPs over each group's
// rows -> weighted unpermute, plus the optional shared expert. It owns the activations its
// backward needs, sized for max_tokens. The oracle the cuda backend's MoE layer is checked
// against, and (Real = double) the subject of the whole-model finite-difference checks.
//
// Expert parallelism (set_expert_parallel): the layer holds experts [first, first + E/ep) of its
// spec's local spec (moe.first_expert, moe.local_experts) and routes every token as before; the
// rows permuted for another rank's experts go there (all-to-all over the group: counts, then rows),
// run through those experts on their rank, and come back before the weighted unpermute. The
// backward sends the output rows' gradients the same way and brings the input rows' gradients
// back; each expert's weight gradient then sums every rank's tokens routed to it.
#pragma once
#include <cstdint>
#include <vector>

#include "parallel/process_group.h"
#include "train/model_spec.h"
#include "turbo/kernels/cpu/moe.h"

namespace primus::backends::reference {

template <typename Real>
class MoeLayer {
 public:
  MoeLayer(const train::ModelSpec& spec, int64_t max_tokens, int64_t layer = 0);

  // Views into the model's flat parameter and gradient buffers (shared_* null without a shared
  // expert, expert_bias null without one).
  struct Weights {
    const Real *router = nullptr, *expert_bias = nullptr, *fc = nullptr, *proj = nullptr;
    const Real *shared_fc = nullptr, *shared_proj = nullptr;
  };
  struct Grads {
    Real *router = nullptr, *fc = nullptr, *proj = nullptr, *shared_fc = nullptr, *shared_proj = nullptr;
  };
  // What the last forward routed: per-expert slots (before dropping), dropped slots, and the
  // unscaled balancing and z losses: each listed balancing type's (batch: the micro-batch's switch
  // loss, also kept when none is listed), aux the primary one's (MoeSpec::primary_balance) and
  // more_aux the others' (MoeSpec::more_balances).
  struct Stats {
    std::vector<int32_t> counts;
    int64_t dropped = 0;
    double aux = 0, z = 0;
    double batch_aux = 0, seq_aux = 0, global_aux = 0;
    std::vector<double> more_aux;
    double of(train::MoeSpec::Balance b) const {
      using B = train::MoeSpec::Balance;
      return b == B::Batch ? batch_aux : b == B::Sequence ? seq_aux : global_aux;
    }
  };

  // out [N,C] = the layer's output for inp [N,C] (overwritten): N tokens in sequences of `seq` each
  // (0, or a length that does not divide N: one sequence), which seq_aux_loss balances one by one.
  void forward(Real* out, const Real* inp, const Weights& w, int64_t N, int64_t seq = 0);
  // dinp [N,C] += the input gradient; parameter gradients +=. loss_scale multiplies the aux and
  // z coefficients (the scale the caller's loss gradient carries, e.g. 1 / accumulation steps).
  void backward(Real* dinp, const Real* dout, const Real* inp, const Weights& w, const Grads& g, double loss_scale);

  const Stats& stats() const { return stats_; }
  // The experts' group of an expert-parallel layout (nullptr or one rank: every expert here). The
  // spec's local_experts x the group's size must be num_experts. f32 only (the groups move f32).
  void set_expert_parallel(parallel::ProcessGroup* group);
  // Context parallelism (nullptr or one rank: off): this rank's tokens are chunks of sequences the
  // group shares, so the balancing losses' counts (and the sequence-wise loss's sums of p) are
  // summed over the group, and each rank passes cp times its tokens' part of their gradient (the
  // trainer averages the weights' gradients over the group), as the cuda backend does.
  void set_context_parallel(parallel::ProcessGroup* group);
  // moe_router_load_balancing_type global_aux_loss: the group whose tokens the loss balances
  // together (every rank holding other tokens: data, context and expert parallel; nullptr or one
  // rank: this process alone). Counts are summed over it and over the step's micro-batches since
  // begin_step(); each rank passes the group's size times its tokens' part of the gradient, as the
  // trainer averages the router's gradient over the group.
  void set_balance_group(parallel::ProcessGroup* group);
  // The optimizer step's first micro-batch comes next: global_aux_loss's counts start again.
  void begin_step();

  const std::vector<int32_t>& topk_idx() const { return idx_; }  // [N*K] of the last forward
  const std::vector<int32_t>& row_of_slot() const { return rows_; }  // [N*K], -1: dropped
  const std::vector<Real>& logits() const { return logits_; }         // [N*E] router logits
  // Tests: the next forwards use these experts [N*K] instead of choosing (see router_forward's
  // forced_idx); nullptr (or an empty vector) chooses again.
  void force_routing(const std::vector<int32_t>* idx) { forced_ = idx && !idx->empty() ? *idx : std::vector<int32_t>{}; }

 private:
  // The held experts' MLPs over their groups of rows x: group e (weights e) is rows
  // [start[e], start[e] + count[e]); h, a, y alike.
  void experts_forward(const Real* x, Real* h, Real* a, Real* y, const int64_t* start, const int64_t* count,
                       int64_t groups, const Weights& w);
  // The backward of experts_forward: dx = (overwritten), weight gradients +=; da, dh scratch.
  void experts_backward(Real* dx, Real* da, Real* dh, const Real* dy, const Real* x, const Real* h, const Real* a,
                        const int64_t* start, const int64_t* count, int64_t groups, const Weights& w, const Grads& g);
  // Expert parallelism: sends the rows of xp-ordered `local` [rows, C] to their experts' ranks and
  // leaves what this rank's experts receive in `held`, expert-major (send), or the inverse (!send).
  void exchange_rows(Real* local, std::vector<Real>& held, bool send);
  // moe_router_load_balancing_type seq_aux_loss: the last forward's sequences (see forward), their
  // slot counts [S*E] (which the backward reads); returns the mean of their aux losses.
  double sequence_aux(int64_t N, int64_t seq);
  // v summed element-wise over `group`.
  template <typename T>
  static std::vector<T> group_sum(parallel::ProcessGroup& group, const std::vector<T>& v);

  const train::ModelSpec& spec_;
  uint64_t seed_;  // moe_router_force_load_balancing: this layer's draw
  turbo::cpu::RouterConfig cfg_;
  parallel::ProcessGroup* ep_group_ = nullptr;
  int ep_ = 1, ep_rank_ = 0;
  int64_t El_;  // experts held
  // Expert parallelism: recv_[q * El_ + e] rows from rank q for held expert e (the last forward),
  // send_rows_[q] rows to rank q; the held rows expert-major (held_start_ / held_count_ per expert).
  std::vector<int64_t> recv_, send_rows_, held_start_, held_count_;
  std::vector<int64_t> local_start_, local_count_;  // without it: the groups of the last forward
  std::vector<Real> xh_, hh_, ah_, yh_, dyh_, dah_, dhh_, dxh_, wire_;
  int64_t N_ = 0, C_, E_, K_, F_, Fs_, align_ = 1, max_rows_;
  std::vector<Real> logits_, probs_, weight_, prob_sum_, xp_, h_, a_, yp_, sfc_, sact_, sout_;
  std::vector<int32_t> idx_, counts_, rows_, offsets_, kept_, forced_;
  // Backward scratch.
  std::vector<Real> dlogits_, dweight_, dyp_, da_, dh_, dxp_, dsact_, dsfc_;
  int64_t seqs_ = 1;
  std::vector<int32_t> seq_counts_;
  parallel::ProcessGroup* cp_group_ = nullptr;
  int cp_ = 1;
  std::vector<int32_t> cp_counts_;  // context parallelism, the switch loss: counts_ summed over the group
  parallel::ProcessGroup* balance_group_ = nullptr;
  int balance_ = 1;
  // global_aux_loss: the counts summed over the balance group and the step's micro-batches so far
  // (micro_ of them): their mean is the load the loss balances.
  std::vector<int32_t> global_counts_;
  int64_t micro_ = 0;
  Stats stats_;
};

extern template class MoeLayer<float>;
extern template class MoeLayer<double>;

}  // namespace primus::backends::reference
