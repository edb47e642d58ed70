#include "backends/reference/moe_layer.h"

#include <fmt/format.h>

#include <algorithm>
#include <numeric>
#include <type_traits>

#include "core/util/error.h"

#include "turbo/kernels/cpu/activation.h"
#include "turbo/kernels/cpu/matmul.h"

namespace primus::backends::reference {

namespace k = primus::turbo::cpu;

template <typename Real>
MoeLayer<Real>::MoeLayer(const train::ModelSpec& spec, int64_t max_tokens, int64_t layer)
    : spec_(spec),
      seed_(train::moe_random_seed(layer)),
      C_(spec.hidden_size),
      E_(spec.moe.num_experts),
      K_(spec.moe.topk),
      F_(spec.moe.ffn_hidden_size),
      Fs_(spec.moe.shared_ffn_hidden_size) {
  El_ = spec.moe.held_experts();
  const train::MoeSpec& m = spec.moe;
  cfg_.num_experts = E_;
  cfg_.topk = K_;
  cfg_.score = m.sigmoid ? k::RouterScore::Sigmoid : k::RouterScore::Softmax;
  cfg_.pre_softmax = m.pre_softmax;
  cfg_.num_groups = m.num_groups;
  cfg_.group_topk = m.group_topk;
  cfg_.scaling_factor = m.topk_scaling_factor;
  // The reference computes each expert over its kept rows only, so no padding is needed.
  max_rows_ = k::moe_permuted_rows_max(max_tokens, K_, E_, align_);
  const int64_t N = max_tokens;
  logits_.resize(N * E_);
  probs_.resize(N * E_);
  weight_.resize(N * K_);
  prob_sum_.resize(E_);
  idx_.resize(N * K_);
  counts_.resize(E_);
  rows_.resize(N * K_);
  offsets_.resize(E_ + 1);
  kept_.resize(E_);
  xp_.resize(max_rows_ * C_);
  h_.resize(max_rows_ * 2 * F_);
  a_.resize(max_rows_ * F_);
  yp_.resize(max_rows_ * C_);
  dlogits_.resize(N * E_);
  dweight_.resize(N * K_);
  dyp_.resize(max_rows_ * C_);
  da_.resize(max_rows_ * F_);
  dh_.resize(max_rows_ * 2 * F_);
  dxp_.resize(max_rows_ * C_);
  if (Fs_ > 0) {
    sfc_.resize(N * 2 * Fs_);
    sact_.resize(N * Fs_);
    sout_.resize(N * C_);
    dsact_.resize(N * Fs_);
    dsfc_.resize(N * 2 * Fs_);
  }
  stats_.counts.assign(E_, 0);
  global_counts_.assign(E_, 0);
}

template <typename Real>
void MoeLayer<Real>::forward(Real* out, const Real* inp, const Weights& w, int64_t N, int64_t seq) {
  N_ = N;
  const Real* none = nullptr;
  k::matmul_forward(logits_.data(), inp, w.router, none, N, C_, E_);
  // The draw replaces the logits; the backward passes straight through.
  if (spec_.moe.force_load_balancing) k::moe_random_logits(logits_.data(), N, E_, seed_);
  Real z_sum;
  k::router_forward(idx_.data(), weight_.data(), probs_.data(), counts_.data(), prob_sum_.data(), &z_sum,
                    logits_.data(), w.expert_bias, N, cfg_, forced_.empty() ? nullptr : forced_.data());
  k::router_losses(&stats_.batch_aux, &stats_.z, counts_.data(), prob_sum_.data(), z_sum, N, cfg_);
  stats_.seq_aux = stats_.global_aux = 0;
  if (spec_.moe.global_aux_loss) {
    // The global batch's loads: the group's counts, summed over the step's micro-batches. This
    // rank's share of the loss (its own sums of p) is E / (K (N D)^2) x sum_e count_e psum_e with
    // the mean counts; logged times D, as the trainer logs the ranks' mean.
    const std::vector<int32_t> g = balance_ > 1 ? group_sum(*balance_group_, counts_) : counts_;
    for (int64_t e = 0; e < E_; ++e) global_counts_[e] += g[e];
    ++micro_;
    double ignored;
    k::router_losses(&stats_.global_aux, &ignored, global_counts_.data(), prob_sum_.data(), z_sum, N * balance_, cfg_);
    stats_.global_aux *= static_cast<double>(balance_) / static_cast<double>(micro_);
  }
  if (cp_ > 1 && spec_.moe.batch_aux_loss) {
    // The whole sequences' switch loss: the group's counts. The logged value is this rank's share
    // of it (its own sums of p over the group's tokens) times cp, as the trainer logs the mean.
    cp_counts_ = group_sum(*cp_group_, counts_);
    double ignored;
    k::router_losses(&stats_.batch_aux, &ignored, cp_counts_.data(), prob_sum_.data(), z_sum, N * cp_, cfg_);
    stats_.batch_aux *= static_cast<double>(cp_);
  }
  if (spec_.moe.seq_aux_loss) stats_.seq_aux = sequence_aux(N, seq);
  stats_.aux = stats_.of(spec_.moe.primary_balance());
  stats_.more_aux.clear();
  for (train::MoeSpec::Balance b : spec_.moe.more_balances()) stats_.more_aux.push_back(stats_.of(b));
  const int64_t cap = spec_.moe.capacity(N);
  const auto policy = spec_.moe.drop_by_position ? k::DropPolicy::Position : k::DropPolicy::Probs;
  k::moe_plan_rows(rows_.data(), offsets_.data(), kept_.data(), idx_.data(), weight_.data(), counts_.data(), N, K_,
                   E_, align_, cap, policy);
  stats_.counts.assign(counts_.begin(), counts_.end());
  stats_.dropped = 0;
  for (int64_t e = 0; e < E_; ++e) stats_.dropped += counts_[e] - kept_[e];
  k::moe_permute(xp_.data(), inp, rows_.data(), offsets_.data(), kept_.data(), N, K_, E_, C_);
  if (ep_ > 1) {
    // How many rows each rank sends this rank's experts (the counts first, then the rows).
    std::vector<float> mine(static_cast<size_t>(E_)), theirs(static_cast<size_t>(E_));
    for (int64_t e = 0; e < E_; ++e) mine[e] = static_cast<float>(kept_[e]);
    ep_group_->all_to_all(mine.data(), theirs.data(), static_cast<size_t>(El_), parallel::DType::F32);
    recv_.assign(theirs.begin(), theirs.end());
    send_rows_.assign(ep_, 0);
    for (int q = 0; q < ep_; ++q) {
      for (int64_t e = q * El_; e < (q + 1) * El_; ++e) send_rows_[q] += kept_[e];
      PRIMUS_CHECK(offsets_[q * El_] + send_rows_[q] == offsets_[(q + 1) * El_],
                   "moe: rank {}'s experts' rows are not one run of the permuted rows", q);
    }
    held_count_.assign(El_, 0);
    for (int q = 0; q < ep_; ++q)
      for (int64_t e = 0; e < El_; ++e) held_count_[e] += recv_[q * El_ + e];
    held_start_.assign(El_, 0);
    for (int64_t e = 1; e < El_; ++e) held_start_[e] = held_start_[e - 1] + held_count_[e - 1];
    const int64_t held = held_start_.back() + held_count_.back();
    xh_.resize(held * C_);
    hh_.resize(held * 2 * F_);
    ah_.resize(held * F_);
    yh_.resize(held * C_);
    exchange_rows(xp_.data(), xh_, true);
    experts_forward(xh_.data(), hh_.data(), ah_.data(), yh_.data(), held_start_.data(), held_count_.data(), El_, w);
    exchange_rows(yp_.data(), yh_, false);
  } else {
    local_start_.assign(offsets_.begin(), offsets_.begin() + E_);
    local_count_.assign(kept_.begin(), kept_.end());
    experts_forward(xp_.data(), h_.data(), a_.data(), yp_.data(), local_start_.data(), local_count_.data(), E_, w);
  }
  k::moe_unpermute(out, yp_.data(), weight_.data(), rows_.data(), N, K_, C_, false);
  if (Fs_ > 0) {
    k::matmul_forward(sfc_.data(), inp, w.shared_fc, none, N, C_, 2 * Fs_);
    k::swiglu_forward(sact_.data(), sfc_.data(), N, Fs_);
    k::matmul_forward(sout_.data(), sact_.data(), w.shared_proj, none, N, Fs_, C_);
    for (int64_t i = 0; i < N * C_; ++i) out[i] += sout_[i];
  }
}

template <typename Real>
void MoeLayer<Real>::backward(Real* dinp, const Real* dout, const Real* inp, const Weights& w, const Grads& g,
                              double loss_scale) {
  const int64_t N = N_;
  Real* none = nullptr;
  if (Fs_ > 0) {
    std::fill(dsact_.begin(), dsact_.begin() + N * Fs_, Real(0));
    k::matmul_backward(dsact_.data(), g.shared_proj, none, dout, sact_.data(), w.shared_proj, N, Fs_, C_);
    std::fill(dsfc_.begin(), dsfc_.begin() + N * 2 * Fs_, Real(0));
    k::swiglu_backward(dsfc_.data(), sfc_.data(), dsact_.data(), N, Fs_);
    k::matmul_backward(dinp, g.shared_fc, none, dsfc_.data(), inp, w.shared_fc, N, C_, 2 * Fs_);
  }
  k::moe_unpermute_backward(dyp_.data(), dweight_.data(), dout, yp_.data(), weight_.data(), rows_.data(),
                            offsets_.data(), kept_.data(), N, K_, E_, C_);
  if (ep_ > 1) {
    const int64_t held = static_cast<int64_t>(xh_.size()) / C_;
    dyh_.resize(held * C_);
    dah_.resize(held * F_);
    dhh_.resize(held * 2 * F_);
    dxh_.resize(held * C_);
    exchange_rows(dyp_.data(), dyh_, true);
    experts_backward(dxh_.data(), dah_.data(), dhh_.data(), dyh_.data(), xh_.data(), hh_.data(), ah_.data(),
                     held_start_.data(), held_count_.data(), El_, w, g);
    exchange_rows(dxp_.data(), dxh_, false);
  } else {
    experts_backward(dxp_.data(), da_.data(), dh_.data(), dyp_.data(), xp_.data(), h_.data(), a_.data(),
                     local_start_.data(), local_count_.data(), E_, w, g);
  }
  k::moe_permute_backward(dinp, dxp_.data(), rows_.data(), N, K_, C_, true);
  // Each listed balancing loss is one term of the router's gradient (they add); the z loss is the
  // mean over the N tokens.
  std::vector<k::AuxTerm> terms;
  if (spec_.moe.batch_aux_loss) {
    // Context parallelism: the group's counts over this rank's N, 1 / cp of the coefficient (the
    // sequence-wise loss's reasoning below).
    terms.push_back({cp_ > 1 ? cp_counts_.data() : counts_.data(),
                     spec_.moe.aux_loss_coeff * loss_scale / static_cast<double>(cp_), {}});
  }
  if (spec_.moe.seq_aux_loss) {
    // Each sequence's tokens with its own counts: the mean over the S sequences puts 1/S on each
    // one's aux loss. Under context parallelism the counts are the whole sequence's and T is this
    // rank's part of it: the kernel's E x count / (K T^2) is cp^2 times the sequence's, and the rank
    // passes cp times its tokens' part, so 1 / cp of the coefficient.
    const int64_t S = seqs_, T = N / S;
    terms.push_back({seq_counts_.data(), spec_.moe.seq_aux_loss_coeff * loss_scale / static_cast<double>(S * cp_),
                     k::SequenceRuns{S, T, T}});
  }
  if (spec_.moe.global_aux_loss) {
    // The loss over the global micro-batch (N D tokens) with the mean counts sum / micro_: token
    // n's gradient is E x mean_e / (K (N D)^2), and each rank passes D times it (the router's
    // gradient is averaged over the group): the kernel's E x count_e / (K N^2) with the summed
    // counts, at 1 / (D micro_).
    terms.push_back({global_counts_.data(),
                     spec_.moe.global_aux_loss_coeff * loss_scale / static_cast<double>(balance_ * micro_), {}});
  }
  const k::AuxTerm first = terms.empty() ? k::AuxTerm{} : terms.front();
  k::router_backward(dlogits_.data(), dweight_.data(), logits_.data(), probs_.data(), idx_.data(), first.counts, N,
                     cfg_, first.coeff, spec_.moe.z_loss_coeff * loss_scale,
                     first.seq.seqs > 0 ? &first.seq : nullptr, terms.size() > 1 ? terms.data() + 1 : nullptr,
                     terms.empty() ? 0 : terms.size() - 1);
  k::matmul_backward(dinp, g.router, none, dlogits_.data(), inp, w.router, N, C_, E_);
}

template <typename Real>
double MoeLayer<Real>::sequence_aux(int64_t N, int64_t seq) {
  seqs_ = seq > 0 && N >= seq && N % seq == 0 ? N / seq : 1;
  const int64_t S = seqs_, Ts = N / S;
  seq_counts_.resize(static_cast<size_t>(S * E_));
  std::vector<Real> psum(static_cast<size_t>(S * E_));  // only the counts are read again (backward)
  k::moe_sequence_stats(seq_counts_.data(), psum.data(), idx_.data(), probs_.data(), N, {N / Ts, Ts, Ts}, K_, E_);
  if (cp_ > 1) {  // each sequence's rows here are this rank's part of it: the whole one's is the group's sum
    seq_counts_ = group_sum(*cp_group_, seq_counts_);
    psum = group_sum(*cp_group_, psum);
  }
  return k::sequence_aux_loss(seq_counts_.data(), psum.data(), S, Ts * cp_, cfg_);
}

template <typename Real>
template <typename T>
std::vector<T> MoeLayer<Real>::group_sum(parallel::ProcessGroup& group, const std::vector<T>& v) {
  // Through f32, what the groups reduce: counts are exact below 2^24.
  std::vector<float> f(v.begin(), v.end());
  group.all_reduce(f.data(), f.size(), parallel::DType::F32, parallel::ReduceOp::Sum);
  std::vector<T> out(v.size());
  for (size_t i = 0; i < v.size(); ++i) out[i] = static_cast<T>(f[i]);
  return out;
}

template <typename Real>
void MoeLayer<Real>::set_context_parallel(parallel::ProcessGroup* group) {
  const int n = group ? group->world_size() : 1;
  if (n > 1 && !std::is_same_v<Real, float>) throw RuntimeError("moe: context parallelism runs the float model only");
  cp_group_ = n > 1 ? group : nullptr;
  cp_ = n;
}

template <typename Real>
void MoeLayer<Real>::set_balance_group(parallel::ProcessGroup* group) {
  const int n = group ? group->world_size() : 1;
  if (n > 1 && !std::is_same_v<Real, float>) throw RuntimeError("moe: a balance group runs the float model only");
  balance_group_ = n > 1 ? group : nullptr;
  balance_ = n;
}

template <typename Real>
void MoeLayer<Real>::begin_step() {
  global_counts_.assign(E_, 0);
  micro_ = 0;
}

template <typename Real>
void MoeLayer<Real>::set_expert_parallel(parallel::ProcessGroup* group) {
  const int n = group ? group->world_size() : 1;
  if (n > 1 && !std::is_same_v<Real, float>) throw RuntimeError("moe: expert parallelism moves f32 rows only");
  if (El_ * n != E_) {
    throw RuntimeError(fmt::format("moe: {} held experts x {} expert-parallel ranks is not num_experts {}", El_, n, E_));
  }
  ep_group_ = n > 1 ? group : nullptr;
  ep_ = n;
  ep_rank_ = group ? group->rank() : 0;
  if (n > 1 && spec_.moe.first_expert != ep_rank_ * El_) {
    throw RuntimeError(fmt::format("moe: rank {} of the expert-parallel group holds experts from {}, not {}", ep_rank_,
                                   spec_.moe.first_expert, ep_rank_ * El_));
  }
}

template <typename Real>
void MoeLayer<Real>::experts_forward(const Real* x, Real* h, Real* a, Real* y, const int64_t* start,
                                     const int64_t* count, int64_t groups, const Weights& w) {
  const Real* none = nullptr;
  for (int64_t e = 0; e < groups; ++e) {
    const int64_t r0 = start[e], n = count[e];
    if (n == 0) continue;
    k::matmul_forward(h + r0 * 2 * F_, x + r0 * C_, w.fc + e * 2 * F_ * C_, none, n, C_, 2 * F_);
    k::swiglu_forward(a + r0 * F_, h + r0 * 2 * F_, n, F_);
    k::matmul_forward(y + r0 * C_, a + r0 * F_, w.proj + e * C_ * F_, none, n, F_, C_);
  }
}

template <typename Real>
void MoeLayer<Real>::experts_backward(Real* dx, Real* da, Real* dh, const Real* dy, const Real* x, const Real* h,
                                      const Real* a, const int64_t* start, const int64_t* count, int64_t groups,
                                      const Weights& w, const Grads& g) {
  Real* none = nullptr;
  for (int64_t e = 0; e < groups; ++e) {
    const int64_t r0 = start[e], n = count[e];
    if (n == 0) continue;
    Real* dae = da + r0 * F_;
    Real* dhe = dh + r0 * 2 * F_;
    Real* dxe = dx + r0 * C_;
    std::fill(dae, dae + n * F_, Real(0));
    k::matmul_backward(dae, g.proj + e * C_ * F_, none, dy + r0 * C_, a + r0 * F_, w.proj + e * C_ * F_, n, F_, C_);
    std::fill(dhe, dhe + n * 2 * F_, Real(0));
    k::swiglu_backward(dhe, h + r0 * 2 * F_, dae, n, F_);
    std::fill(dxe, dxe + n * C_, Real(0));
    k::matmul_backward(dxe, g.fc + e * 2 * F_ * C_, none, dhe, x + r0 * C_, w.fc + e * 2 * F_ * C_, n, C_, 2 * F_);
  }
}

template <typename Real>
void MoeLayer<Real>::exchange_rows(Real* local, std::vector<Real>& held, bool send) {
  // On the wire rows are rank-major (rank q's rows for held expert 0, 1, ...); held is
  // expert-major (expert e's rows from rank 0, 1, ...).
  std::vector<size_t> out(ep_), in(ep_);
  int64_t wire_rows = 0;
  for (int q = 0; q < ep_; ++q) {
    out[q] = static_cast<size_t>(send_rows_[q] * C_);
    int64_t r = 0;
    for (int64_t e = 0; e < El_; ++e) r += recv_[q * El_ + e];
    in[q] = static_cast<size_t>(r * C_);
    wire_rows += r;
  }
  wire_.resize(std::max<int64_t>(wire_rows, 1) * C_);
  auto reorder = [&](bool to_held) {
    int64_t at = 0;  // wire row
    std::vector<int64_t> filled(El_, 0);
    for (int q = 0; q < ep_; ++q) {
      for (int64_t e = 0; e < El_; ++e) {
        const int64_t n = recv_[q * El_ + e];
        Real* h = held.data() + (held_start_[e] + filled[e]) * C_;
        Real* wv = wire_.data() + at * C_;
        if (to_held) std::copy_n(wv, n * C_, h);
        else std::copy_n(h, n * C_, wv);
        filled[e] += n;
        at += n;
      }
    }
  };
  if constexpr (std::is_same_v<Real, float>) {
    Real* rows = local + offsets_[0] * C_;
    if (send) {
      ep_group_->all_to_all_v(rows, out, wire_.data(), in, parallel::DType::F32);
      reorder(true);
    } else {
      reorder(false);
      ep_group_->all_to_all_v(wire_.data(), in, rows, out, parallel::DType::F32);
    }
  } else {
    throw RuntimeError("moe: expert parallelism moves f32 rows only");
  }
}

template class MoeLayer<float>;
template class MoeLayer<double>;

}  // namespace primus::backends::reference
