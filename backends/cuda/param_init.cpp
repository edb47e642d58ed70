#include "backends/cuda/param_init.h"

#include "train/param_init.h"

namespace primus::backends::cuda {

void init_params(const train::ModelSpec& spec, const train::ParamLayout& layout, uint64_t seed, float* params) {
  train::init_params(spec, layout, seed, params);
}

}  // namespace primus::backends::cuda
