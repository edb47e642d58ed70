#include "train/lr_schedule.h"

#include <cmath>

namespace primus::train {

double lr_at(const OptimizerArgs& o, int64_t step) {
  if (o.warmup_iters > 0 && step < o.warmup_iters) {
    return o.lr * static_cast<double>(step + 1) / static_cast<double>(o.warmup_iters);
  }
  if (o.decay_style == "constant") return o.lr;
  if (step >= o.decay_iters) return o.min_lr;
  double span = static_cast<double>(o.decay_iters - o.warmup_iters);
  double ratio = span > 0 ? static_cast<double>(step - o.warmup_iters) / span : 1.0;
  double coeff = o.decay_style == "linear" ? 1.0 - ratio : 0.5 * (1.0 + std::cos(M_PI * ratio));
  return o.min_lr + coeff * (o.lr - o.min_lr);
}

}  // namespace primus::train
