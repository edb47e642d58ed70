// The reference MoE feed-forward layer (train/model_spec.h's MoeSpec) on the CPU kernels of
// turbo/kernels/cpu: router -> row plan -> permute -> per-expert SwiGLU MLPs over each group's
// rows -> weighted unpermute, plus the optional shared expert. It owns the activations its
// backward needs, sized for max_tokens. The oracle the cuda backend's MoE layer is checked
// against, and (Real = double) the subject of the whole-model finite-difference checks.
#pragma once
#include <cstdint>
#include <vector>

#include "train/model_spec.h"
#include "turbo/kernels/cpu/moe.h"

namespace primus::backends::reference {

template <typename Real>
class MoeLayer {
 public:
  MoeLayer(const train::ModelSpec& spec, int64_t max_tokens);

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
  // unscaled aux and z losses.
  struct Stats {
    std::vector<int32_t> counts;
    int64_t dropped = 0;
    double aux = 0, z = 0;
  };

  // out [N,C] = the layer's output for inp [N,C] (overwritten).
  void forward(Real* out, const Real* inp, const Weights& w, int64_t N);
  // dinp [N,C] += the input gradient; parameter gradients +=. loss_scale multiplies the aux and
  // z coefficients (the scale the caller's loss gradient carries, e.g. 1 / accumulation steps).
  void backward(Real* dinp, const Real* dout, const Real* inp, const Weights& w, const Grads& g, double loss_scale);

  const Stats& stats() const { return stats_; }
  const std::vector<int32_t>& topk_idx() const { return idx_; }  // [N*K] of the last forward
  const std::vector<int32_t>& row_of_slot() const { return rows_; }  // [N*K], -1: dropped
  const std::vector<Real>& logits() const { return logits_; }         // [N*E] router logits
  // Tests: the next forwards use these experts [N*K] instead of choosing (see router_forward's
  // forced_idx); nullptr (or an empty vector) chooses again.
  void force_routing(const std::vector<int32_t>* idx) { forced_ = idx && !idx->empty() ? *idx : std::vector<int32_t>{}; }

 private:
  const train::ModelSpec& spec_;
  turbo::cpu::RouterConfig cfg_;
  int64_t N_ = 0, C_, E_, K_, F_, Fs_, align_ = 1, max_rows_;
  std::vector<Real> logits_, probs_, weight_, prob_sum_, xp_, h_, a_, yp_, sfc_, sact_, sout_;
  std::vector<int32_t> idx_, counts_, rows_, offsets_, kept_, forced_;
  // Backward scratch.
  std::vector<Real> dlogits_, dweight_, dyp_, da_, dh_, dxp_, dsact_, dsfc_;
  Stats stats_;
};

extern template class MoeLayer<float>;
extern template class MoeLayer<double>;

}  // namespace primus::backends::reference
