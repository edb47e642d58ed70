// What generation needs from a checkpoint, whichever backend runs it: the architecture, the
// tokenizer's name and the fp32 weights in the flat layout of train::make_param_layout.
#pragma once
#include <filesystem>
#include <string>
#include <vector>

#include "train/model_spec.h"

namespace primus::train {

struct InferenceCheckpoint {
  std::filesystem::path dir;  // the checkpoint folder read
  ModelSpec spec;
  std::string tokenizer;      // data::make_tokenizer's argument
  std::vector<float> params;  // make_param_layout(spec).total floats
};

// `checkpoint` is a checkpoint folder or a save folder (its latest). Throws IoError when there is
// none, FormatError when trainer_state.json lacks the model spec or tokenizer or a tensor does
// not fit the spec (naming the folder and tensor).
InferenceCheckpoint load_inference_checkpoint(const std::string& checkpoint);

// The tokenizer a checkpoint's trainer_state.json records ("tokenizer"), as data::make_tokenizer
// takes it: a relative path that names a file inside the checkpoint folder `dir` (an import's
// copy of tokenizer.json is recorded as "tokenizer.json", so the folder can be moved) becomes that
// file's path; anything else ("gpt2", "bytes", a path the run was given) is returned unchanged.
std::string checkpoint_tokenizer(const std::string& recorded, const std::filesystem::path& dir);

}  // namespace primus::train
