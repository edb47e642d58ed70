// Hugging Face Hub ids ("org/name") found offline in the Hugging Face cache, as transformers
// finds them without a network: nothing is downloaded here (the GPU machines reach no network).
#pragma once
#include <filesystem>
#include <string>

namespace primus {

// The hub cache: $HF_HUB_CACHE, else $HF_HOME/hub, else ~/.cache/huggingface/hub (empty when
// none of those variables is set).
std::filesystem::path hf_hub_cache();

// "org/name": one slash, neither side empty.
bool is_hub_id(const std::string& s);

// The snapshot folder of Hub id `model` in the cache that holds `file`: the one refs/main names,
// else the first by name that has it; empty when none.
std::filesystem::path hf_cache_snapshot(const std::string& model, const std::string& file);

// What `model` names: an existing path as it is, else a Hub id's snapshot holding `file`. Throws
// ConfigError saying where it looked (`what`, e.g. "load_hf", heads the message) when neither.
std::filesystem::path resolve_hf_path(const std::string& model, const std::string& file, const std::string& what);

}  // namespace primus
