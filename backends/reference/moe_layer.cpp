#include "backends/reference/moe_layer.h"

#include <algorithm>

#include "turbo/kernels/cpu/activation.h"
#include "turbo/kernels/cpu/matmul.h"

namespace primus::backends::reference {

namespace k = primus::turbo::cpu;

template <typename Real>
MoeLayer<Real>::MoeLayer(const train::ModelSpec& spec, int64_t max_tokens)
    : spec_(spec),
      C_(spec.hidden_size),
      E_(spec.moe.num_experts),
      K_(spec.moe.topk),
      F_(spec.moe.ffn_hidden_size),
      Fs_(spec.moe.shared_ffn_hidden_size) {
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
}

template <typename Real>
void MoeLayer<Real>::forward(Real* out, const Real* inp, const Weights& w, int64_t N) {
  N_ = N;
  const Real* none = nullptr;
  k::matmul_forward(logits_.data(), inp, w.router, none, N, C_, E_);
  Real z_sum;
  k::router_forward(idx_.data(), weight_.data(), probs_.data(), counts_.data(), prob_sum_.data(), &z_sum,
                    logits_.data(), w.expert_bias, N, cfg_, forced_.empty() ? nullptr : forced_.data());
  k::router_losses(&stats_.aux, &stats_.z, counts_.data(), prob_sum_.data(), z_sum, N, cfg_);
  const int64_t cap = spec_.moe.capacity(N);
  const auto policy = spec_.moe.drop_by_position ? k::DropPolicy::Position : k::DropPolicy::Probs;
  k::moe_plan_rows(rows_.data(), offsets_.data(), kept_.data(), idx_.data(), weight_.data(), counts_.data(), N, K_,
                   E_, align_, cap, policy);
  stats_.counts.assign(counts_.begin(), counts_.end());
  stats_.dropped = 0;
  for (int64_t e = 0; e < E_; ++e) stats_.dropped += counts_[e] - kept_[e];
  k::moe_permute(xp_.data(), inp, rows_.data(), offsets_.data(), kept_.data(), N, K_, E_, C_);
  for (int64_t e = 0; e < E_; ++e) {
    const int64_t r0 = offsets_[e], n = kept_[e];
    if (n == 0) continue;
    k::matmul_forward(h_.data() + r0 * 2 * F_, xp_.data() + r0 * C_, w.fc + e * 2 * F_ * C_, none, n, C_, 2 * F_);
    k::swiglu_forward(a_.data() + r0 * F_, h_.data() + r0 * 2 * F_, n, F_);
    k::matmul_forward(yp_.data() + r0 * C_, a_.data() + r0 * F_, w.proj + e * C_ * F_, none, n, F_, C_);
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
  for (int64_t e = 0; e < E_; ++e) {
    const int64_t r0 = offsets_[e], n = kept_[e];
    if (n == 0) continue;
    Real* da = da_.data() + r0 * F_;
    Real* dh = dh_.data() + r0 * 2 * F_;
    Real* dxp = dxp_.data() + r0 * C_;
    std::fill(da, da + n * F_, Real(0));
    k::matmul_backward(da, g.proj + e * C_ * F_, none, dyp_.data() + r0 * C_, a_.data() + r0 * F_,
                       w.proj + e * C_ * F_, n, F_, C_);
    std::fill(dh, dh + n * 2 * F_, Real(0));
    k::swiglu_backward(dh, h_.data() + r0 * 2 * F_, da, n, F_);
    std::fill(dxp, dxp + n * C_, Real(0));
    k::matmul_backward(dxp, g.fc + e * 2 * F_ * C_, none, dh, xp_.data() + r0 * C_, w.fc + e * 2 * F_ * C_, n, C_,
                       2 * F_);
  }
  k::moe_permute_backward(dinp, dxp_.data(), rows_.data(), N, K_, C_, true);
  k::router_backward(dlogits_.data(), dweight_.data(), logits_.data(), probs_.data(), idx_.data(), counts_.data(), N,
                     cfg_, spec_.moe.aux_loss_coeff * loss_scale, spec_.moe.z_loss_coeff * loss_scale);
  k::matmul_backward(dinp, g.router, none, dlogits_.data(), inp, w.router, N, C_, E_);
}

template class MoeLayer<float>;
template class MoeLayer<double>;

}  // namespace primus::backends::reference
