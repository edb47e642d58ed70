// The initial weights of a GPT-2 / Llama model in a flat buffer (ParamLayout order), shared by the
// backends so that the same seed gives both the same weights bit for bit:
//   N(0, init_method_std) for weights and embeddings, residual output projections (attn.proj,
//   mlp.proj) scaled by 1/sqrt(2 * num_layers), norm weights 1, biases 0, padded vocabulary rows 0.
// The normal draws come in blocks of kInitBlock elements, each from its own generator seeded by
// (seed, tensor index, block index): the result does not depend on the thread count, and the
// blocks are drawn in parallel (OpenMP) -- a 1.5B-parameter model no longer takes ~40 s on one
// core before its first step.
#pragma once
#include <cstdint>

#include "train/model_spec.h"
#include "train/param_layout.h"

namespace primus::train {

inline constexpr int64_t kInitBlock = int64_t{1} << 20;

void init_params(const ModelSpec& spec, const ParamLayout& layout, uint64_t seed, float* params);
void init_params(const ModelSpec& spec, const ParamLayout& layout, uint64_t seed, double* params);

}  // namespace primus::train
