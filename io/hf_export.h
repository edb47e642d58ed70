// The model-independent half of a Hugging Face export: given a config, tensors already named
// and laid out as transformers expects (the backend's converter does the renaming and any
// permutation), write a folder that `AutoModelForCausalLM.from_pretrained(OUT)` loads:
//   OUT/config.json              the given config (torch_dtype filled in when absent)
//   OUT/generation_config.json   given, or derived from the config's bos/eos/pad token ids
//   OUT/model.safetensors        the tensors in the requested dtype, __metadata__ {"format": "pt"}
// or, when a shard size is set and exceeded, model-0000K-of-0000N.safetensors plus
// model.safetensors.index.json. Every file is written atomically; files of the other layout
// left by an earlier export are removed so transformers cannot pick up stale weights.
#pragma once
#include <cstdint>
#include <filesystem>
#include <map>
#include <nlohmann/json.hpp>
#include <string>

#include "io/dtype.h"
#include "io/tensor_blob.h"

namespace primus::io {

struct HfExportOptions {
  // Floating tensors (F32, F64, BF16, F16) are written as this: F32 or BF16 (round to nearest
  // even). Other dtypes are written unchanged.
  DType dtype = DType::BF16;
  // Largest shard in bytes; 0 writes a single file. A tensor larger than this gets its own shard.
  uint64_t max_shard_bytes = 0;
  // Written as generation_config.json; when null it is derived from the config.
  nlohmann::json generation_config;
};

// Throws ConfigError for an unsupported dtype, IoError when a write fails.
void export_hf(const std::filesystem::path& out_dir, const nlohmann::json& config,
               const std::map<std::string, TensorBlob>& tensors, const HfExportOptions& opts = {});

}  // namespace primus::io
