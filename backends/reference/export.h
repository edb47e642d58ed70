// `primus export hf CHECKPOINT OUT/`: a checkpoint of any backend (they share the layout) as a
// Hugging Face model folder: config.json, model.safetensors (padded vocabulary rows trimmed),
// generation_config.json.
#pragma once
#include <filesystem>
#include <map>
#include <string>

#include "io/tensor_blob.h"
#include "train/model_spec.h"
#include "train/param_layout.h"

namespace primus::backends::reference {

// dtype: "bf16" or "fp32". Throws FormatError when the architecture has no HF equivalent.
void export_hf_checkpoint(const std::filesystem::path& checkpoint, const std::filesystem::path& out,
                          const std::string& dtype);

// The Hugging Face state dict of flat fp32 parameters laid out as `layout`: every tensor's HF
// parts (renamed, split, permuted), padded vocabulary rows trimmed. Fp32 blobs.
std::map<std::string, io::TensorBlob> hf_state_dict(const train::ModelSpec& spec, const train::ParamLayout& layout,
                                                    const float* params);

// Writes the folder (config.json from train::hf_config_json, which refuses a model transformers
// has no class for; model.safetensors in `dtype`; generation_config.json).
void write_hf_folder(const train::ModelSpec& spec, const float* params, int eos_token_id,
                     const std::filesystem::path& out, const std::string& dtype);

// Writes the tokenizer files transformers loads into `out`: a tokenizer.json (a path, or a folder
// holding one; with its tokenizer_config.json when one is beside it), or GPT-2's vocab.json and
// merges.txt for "gpt2". "bytes" writes nothing; anything else is warned about and skipped.
void export_tokenizer(const std::string& tokenizer, const std::filesystem::path& out);

}  // namespace primus::backends::reference
