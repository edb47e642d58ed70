// Checkpoint contents shared by every backend: fp32 weights under Hugging Face names and
// layouts (model.safetensors loads in transformers as is, padded vocabulary rows included),
// the AdamW moments in our flat layout (optimizer.safetensors), and the trainer state
// (step, data positions, RNG, the model spec it was saved for). Writing is atomic and verified
// on load by io/checkpoint.
#pragma once
#include <filesystem>
#include <nlohmann/json.hpp>

#include "io/checkpoint.h"
#include "train/model_spec.h"
#include "train/param_layout.h"

namespace primus::train {

// The weights as HF tensors (copies), and the moments borrowed from m and v (they must outlive
// the save).
io::CheckpointData pack_checkpoint(const ModelSpec& spec, const ParamLayout& layout, const float* params,
                                   const float* m, const float* v, nlohmann::json state);

// What a checkpoint's model must share with the configured one. Run: everything its spec records
// (a resume continues the same run). Weights: the architecture (the weights' shapes, norms,
// activation, heads, routing), so finetuning may change the sequence length (not under learned
// positions, whose table it sizes), the RoPE base and scaling, the window, the init and the MoE's
// balancing and capacity.
enum class SpecMatch { Run, Weights };

// Fills params (and m, v when not null) from a loaded checkpoint; throws FormatError naming the
// checkpoint folder and tensor when it was saved for another model.
void unpack_checkpoint(const io::CheckpointData& data, const std::filesystem::path& dir, const ModelSpec& spec,
                       const ParamLayout& layout, float* params, float* m, float* v,
                       SpecMatch match = SpecMatch::Run);

// A summary of the architecture stored in the state, compared on load.
nlohmann::json spec_json(const ModelSpec& spec);
ModelSpec spec_from_json(const nlohmann::json& j);

}  // namespace primus::train
