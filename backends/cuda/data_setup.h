// What the trainer needs before its first step that does not depend on the device: the data
// iterators (preparing a .txt/.jsonl input once into <output>/data) and the checkpoint to resume
// from. Same behaviour as the reference backend's trainer, so both read the same batches.
// TODO(train/): the reference trainer has the same logic inline; it belongs in train/ once,
// shared by both (a backend may not include another backend).
#pragma once
#include <filesystem>

#include "data/dataset/data_config.h"
#include "train/model_spec.h"
#include "train/training_args.h"

namespace primus::backends::cuda {

data::DataIterators build_data(const train::TrainingArgs& t, const train::ModelSpec& spec);

// auto_continue_train: the latest checkpoint in `save`; else `load` (a checkpoint folder or a
// save folder's latest). Empty when there is nothing to resume. Throws IoError when `load` is
// set but holds no checkpoint.
std::filesystem::path resume_dir(const train::CheckpointArgs& c);

}  // namespace primus::backends::cuda
