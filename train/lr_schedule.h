// Learning-rate schedule: linear warmup from 0 to lr over warmup_iters, then cosine, linear or
// constant decay to min_lr at decay_iters, and min_lr after (Megatron's semantics).
#pragma once
#include <cstdint>

#include "train/training_args.h"

namespace primus::train {

// `step` counts from 0 (the first optimizer step uses lr_at(0)).
double lr_at(const OptimizerArgs& o, int64_t step);

}  // namespace primus::train
