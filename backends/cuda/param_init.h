// The cuda backend's initial weights: train/param_init.h's, which the reference backend's
// GptModel::init_weights draws too (tests/cuda_gpu checks the two are bitwise equal).
#pragma once
#include <cstdint>

#include "train/model_spec.h"
#include "train/param_layout.h"

namespace primus::backends::cuda {

void init_params(const train::ModelSpec& spec, const train::ParamLayout& layout, uint64_t seed, float* params);

}  // namespace primus::backends::cuda
