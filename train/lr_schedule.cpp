#include "train/lr_schedule.h"

#include <cmath>

#include "core/util/error.h"

namespace primus::train {

namespace {
double wsd_coeff(const OptimizerArgs& o, int64_t step) {
  const int64_t anneal_start = o.decay_iters - o.wsd_decay_iters;
  if (step <= anneal_start || o.wsd_decay_iters <= 0) return 1.0;
  const double r = static_cast<double>(step - anneal_start) / static_cast<double>(o.wsd_decay_iters);
  if (o.wsd_decay_style == "linear") return 1.0 - r;
  if (o.wsd_decay_style == "cosine") return 0.5 * (1.0 + std::cos(M_PI * r));
  if (o.wsd_decay_style == "exponential") return 2.0 * std::pow(0.5, r) - 1.0;
  if (o.wsd_decay_style == "minus_sqrt") return 1.0 - std::sqrt(r);
  throw ConfigError("lr_wsd_decay_style '" + o.wsd_decay_style +
                    "' is not one of linear, cosine, exponential, minus_sqrt");
}
}  // namespace

double lr_at(const OptimizerArgs& o, int64_t step) {
  if (o.warmup_iters > 0 && step < o.warmup_iters) {
    return o.lr * static_cast<double>(step + 1) / static_cast<double>(o.warmup_iters);
  }
  if (o.decay_style == "constant") return o.lr;
  if (step >= o.decay_iters) return o.min_lr;
  if (o.decay_style == "WSD") return o.min_lr + wsd_coeff(o, step) * (o.lr - o.min_lr);
  double span = static_cast<double>(o.decay_iters - o.warmup_iters);
  double ratio = span > 0 ? static_cast<double>(step - o.warmup_iters) / span : 1.0;
  double coeff = o.decay_style == "linear" ? 1.0 - ratio : 0.5 * (1.0 + std::cos(M_PI * ratio));
  return o.min_lr + coeff * (o.lr - o.min_lr);
}

double muon_lr_at(const OptimizerArgs& o, int64_t step) {
  if (o.muon_lr < 0) return lr_at(o, step);
  OptimizerArgs m = o;
  m.lr = o.muon_lr;
  m.min_lr = o.lr > 0 ? o.min_lr * (o.muon_lr / o.lr) : o.min_lr;
  return lr_at(m, step);
}

}  // namespace primus::train
