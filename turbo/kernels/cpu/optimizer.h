// AdamW (torch.optim.AdamW semantics) over one flat parameter array.
#pragma once
#include <cstdint>

namespace primus::turbo::cpu {

struct AdamWParams {
  double lr = 1e-3;
  double beta1 = 0.9;
  double beta2 = 0.999;
  double eps = 1e-8;
  double weight_decay = 0.0;  // decoupled; call once per range to decay some ranges and not others
  int64_t step = 1;           // 1-based count of updates including this one (bias correction)
  double grad_scale = 1.0;    // multiplies every gradient first (e.g. the grad-norm clip factor)
  // bf16 moments (exp_avg_dtype / exp_avg_sq_dtype: bf16): m (v) is stored rounded to a bf16
  // value, stochastically with the bits of sr_hash(sr_key + i, step) (turbo/core/stochastic_round.h);
  // this update still uses the unrounded fp32 value. The arrays stay Real.
  bool m_bf16 = false, v_bf16 = false;
  int64_t sr_key = 0;  // key of element 0: its offset in the flat parameter layout
};

// For each i in [0, n), with g = grad_scale * grads[i]:
//   params[i] -= lr * weight_decay * params[i]            (decoupled decay, on the old value)
//   m[i] = beta1 m[i] + (1 - beta1) g;   v[i] = beta2 v[i] + (1 - beta2) g^2
//   params[i] -= lr * (m[i] / (1 - beta1^step)) / (sqrt(v[i] / (1 - beta2^step)) + eps)
// Updates params, m, v in place (m and v start at zero; bf16 moments then rounded as stored, see
// AdamWParams); grads are read only. Norm and bias
// parameters are usually updated in a separate call with weight_decay = 0.
template <typename Real>
void adamw_update(Real* params, const Real* grads, Real* m, Real* v, int64_t n,
                  const AdamWParams& hp);

}  // namespace primus::turbo::cpu
