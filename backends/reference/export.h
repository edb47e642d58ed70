// `primus export hf CHECKPOINT OUT/`: a checkpoint of any backend (they share the layout) as a
// Hugging Face model folder: config.json, model.safetensors (padded vocabulary rows trimmed),
// generation_config.json.
#pragma once
#include <filesystem>
#include <string>

namespace primus::backends::reference {

// dtype: "bf16" or "fp32". Throws FormatError when the architecture has no HF equivalent.
void export_hf_checkpoint(const std::filesystem::path& checkpoint, const std::filesystem::path& out,
                          const std::string& dtype);

}  // namespace primus::backends::reference
