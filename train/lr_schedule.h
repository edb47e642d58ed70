// Learning-rate schedule: linear warmup from 0 to lr over warmup_iters, then cosine, linear,
// constant or WSD decay to min_lr at decay_iters, and min_lr after (Megatron's semantics).
// WSD (warmup-stable-decay, MiniCPM; Megatron's lr_decay_style: WSD) holds lr after warmup
// until decay_iters - wsd_decay_iters, then decays over the last wsd_decay_iters steps with
// coefficient c(r), r = (step - anneal_start) / wsd_decay_iters in (0, 1]:
//   linear 1 - r;  cosine (1 + cos(pi r)) / 2;  exponential 2 * 0.5^r - 1;  minus_sqrt 1 - sqrt(r)
// and lr = min_lr + c(r) (lr - min_lr), as Megatron's OptimizerParamScheduler.
#pragma once
#include <cstdint>

#include "train/training_args.h"

namespace primus::train {

// `step` counts from 0 (the first optimizer step uses lr_at(0)).
double lr_at(const OptimizerArgs& o, int64_t step);
// Muon's learning rate: lr_at with peak muon_lr (min_lr scaled by muon_lr / lr), or lr_at itself
// when muon_lr is unset.
double muon_lr_at(const OptimizerArgs& o, int64_t step);

}  // namespace primus::train
