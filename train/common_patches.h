// The args patches every training backend shares (data-parallel size, gradient accumulation,
// mock data, the TensorBoard folder). Each backend registers them under its own ids
// (`<backend>.args.*`, `<backend>.logging.*`) from its patches/ folder, so its inventory lists
// them and PRIMUS_PATCHES can pick them per backend; the logic lives here once.
#pragma once
#include <string>

#include "core/backend/backend.h"
#include "core/patches/registry.h"
#include "train/training_args.h"

namespace primus::train {

// Backend args that carry the shared TrainingArgs.
struct HasTrainingArgs {
  virtual ~HasTrainingArgs() = default;
  virtual TrainingArgs& training() = 0;
};

// Registers the shared patches with ids prefixed by `backend`.
void register_common_args_patches(patches::PatchRegistry& reg, const std::string& backend);

}  // namespace primus::train
