// The model options a run's args give (micro-batch buffers, one loss slot per accumulation step,
// FP8 scratch, the attention's scratch, ZeRO-1's padded flat buffers without local optimizer
// state, the optimizer in the backward): the trainer builds its CudaModel with them and
// `primus projection` sizes the memory plan with them (projection.h), so the two cannot disagree.
#pragma once
#include <cstdint>

#include "backends/cuda/args.h"
#include "backends/cuda/model.h"

namespace primus::backends::cuda {

// `world`: data-parallel ranks of the job. Throws ConfigError for what the model cannot run
// (the optimizer in the backward with clipping, accumulation or several ranks).
CudaModelOptions model_options_for(const CudaArgs& args, int64_t world);

// Whether the attention slots' default is the fallback (GEMMs + softmax) for these args.
bool uses_fallback_attention(const CudaArgs& args);

}  // namespace primus::backends::cuda
