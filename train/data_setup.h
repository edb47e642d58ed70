// What every trainer needs before its first step that does not depend on the device: the data
// iterators (preparing a .txt/.jsonl input once into <output>/data) and the checkpoint to resume
// from. Shared by all backends, so they read the same batches from the same config.
#pragma once
#include <filesystem>

#include "data/dataset/data_config.h"
#include "data/tokenizer/tokenizer.h"
#include "train/model_spec.h"
#include "train/training_args.h"

namespace primus::train {

data::DataIterators build_data(const TrainingArgs& t, const ModelSpec& spec);

// eod_mask_loss needs the tokenizer's end-of-document token: a ConfigError naming the tokenizer
// when it has none.
void check_eod_mask_loss(const DataArgs& d, const data::Tokenizer& tokenizer);

// auto_continue_train: the latest checkpoint in `save`; else `load` (a checkpoint folder or a
// save folder's latest) unless finetune takes only its weights. Empty when there is nothing to
// resume. Throws IoError when `load` is set but holds no checkpoint.
std::filesystem::path resume_dir(const CheckpointArgs& c);

// The checkpoint folder `load` names (itself when it holds a manifest, else its latest checkpoint);
// an IoError when there is none.
std::filesystem::path checkpoint_in(const std::filesystem::path& load);

}  // namespace primus::train
