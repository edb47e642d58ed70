// Starting from a Hugging Face model folder: config.json gives the architecture (our model keys,
// so no YAML preset is needed), model.safetensors or the shards named by
// model.safetensors.index.json give the weights (BF16, F16, F32 or F64, converted exactly to
// fp32), and tokenizer.json the tokenizer. Used by `primus import hf` (which writes a
// checkpoint) and by the training key `load_hf` (weights only: fresh optimizer, step 0).
//
// The weights go through the same HF <-> flat-layout mapping as checkpoints and `export hf`
// (train/param_layout.h), so export then import gives back the same tensors. Every problem is
// an error naming what is wrong and where: a config.json key we do not implement, a tensor
// missing, unexpected or of the wrong shape (with the file it is in or should be in).
#pragma once
#include <cstdint>
#include <filesystem>
#include <nlohmann/json.hpp>
#include <string>

#include "core/config/schema.h"
#include "core/config/value.h"
#include "train/model_spec.h"
#include "train/param_layout.h"
#include "train/training_args.h"

namespace primus::train {

// HF_DIR/config.json, parsed. IoError when it cannot be read, FormatError when it is not JSON.
nlohmann::json read_hf_config(const std::filesystem::path& dir);

// Our model keys (Megatron names, as a model preset would set them) for a config.json, each
// with the origin "<dir>/config.json". Throws ConfigError naming the config.json key for what
// Primus does not implement (a model_type, a rope_scaling type other than llama3, hidden_act, a
// bias layout, ...).
// seq_length is not among them unless the family has learned positions (GPT-2: n_positions).
config::Value hf_model_keys(const nlohmann::json& cfg, const std::filesystem::path& dir);

struct HfImportOptions {
  // 0: n_positions for learned positions; for RoPE min(max_position_embeddings, 4096), since
  // the context trained on is a training choice, not the architecture's.
  int64_t seq_length = 0;
  int64_t make_vocab_size_divisible_by = 1;
};

// The ModelSpec of an HF folder (config.json through hf_model_keys and ModelSpec::from_config).
ModelSpec spec_from_hf_dir(const std::filesystem::path& dir, const HfImportOptions& opts = {});

// Reads every tensor of the model into `params` (layout.total floats): padded vocabulary rows
// are zero; a tied model's lm_head.weight, when the file has one, must equal the embedding.
// Throws FormatError naming the tensor and file for a tensor missing, unexpected (beyond
// buffers transformers does not load: rotary inv_freq, GPT-2's attention masks), of another
// shape, or not floating point.
void load_hf_weights(const std::filesystem::path& dir, const ModelSpec& spec, const ParamLayout& layout,
                     float* params);

// The training key `load_hf` (added to a backend's schema).
void add_hf_import_schema(config::Schema& s);

// The folder `load_hf` names (empty when unset).
std::filesystem::path load_hf_dir(const config::Value& params);

// The config a backend converts when `load_hf` is set: the model keys from config.json added
// to `params` (a key the user set to another value is a ConfigError naming both places; keys
// equal to config.json's are fine), seq_length checked against max_position_embeddings, and
// tokenizer_type set to HF_DIR/tokenizer.json unless the experiment file (`experiment_file`) or
// the command line chose one (the module presets' default tokenizer does not count). `load_hf`
// with `load` is refused (resuming and starting from HF weights contradict each other).
// Without `load_hf`, `params` is returned unchanged.
config::Value resolve_load_hf(const config::Value& params, const std::filesystem::path& experiment_file);

// A trainer's start from other weights, called after its initial weights are drawn, when there is
// no checkpoint to resume (`auto_continue_train` finding one in `save` wins, so a restarted job
// continues rather than starting over): with `finetune` the weights of the checkpoint in `load`
// (its standard files verified; a FormatError naming the folder when it holds another model), with
// `load_hf` those of the Hugging Face folder. Fills `weights` (the layout's order) and returns true;
// false when neither applies.
bool load_initial_weights(const config::Value& params, const CheckpointArgs& ckpt, const ModelSpec& spec,
                          const ParamLayout& layout, float* weights);

// True when a checkpoint's trainer_state.json says it holds weights only (`primus import hf`):
// a trainer loading it starts at step 0 with a fresh optimizer and data order.
bool weights_only_checkpoint(const nlohmann::json& state);

// `primus import hf`: writes HF_DIR as a checkpoint (iteration 0, fp32 weights, no optimizer
// state) under out_dir, trainer_state.json carrying the model spec and the tokenizer
// (tokenizer.json, and tokenizer_config.json when there, are copied into the checkpoint and the
// tokenizer is recorded as "tokenizer.json", relative to it: see train::checkpoint_tokenizer;
// `tokenizer` overrides it: gpt2, bytes or a path). Returns the checkpoint's folder.
std::filesystem::path import_hf_checkpoint(const std::filesystem::path& hf_dir, const std::filesystem::path& out_dir,
                                           const HfImportOptions& opts = {}, const std::string& tokenizer = "");

}  // namespace primus::train
