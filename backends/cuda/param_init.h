// GPT-2 initialisation of a flat fp32 parameter buffer (ParamLayout order): N(0, std) for
// weights and embeddings, residual output projections scaled by 1/sqrt(2 * num_layers), norm
// weights 1, biases 0, padded vocabulary rows 0. Deterministic in `seed` and the same draw
// sequence as the reference backend's GptModel::init_weights (tests/cuda_gpu checks they are
// bitwise equal), so both backends start from the same weights for the same seed.
// TODO(train/): this belongs in train/ next to ParamLayout, used by both backends.
#pragma once
#include <cstdint>

#include "train/model_spec.h"
#include "train/param_layout.h"

namespace primus::backends::cuda {

void init_params(const train::ModelSpec& spec, const train::ParamLayout& layout, uint64_t seed, float* params);

}  // namespace primus::backends::cuda
