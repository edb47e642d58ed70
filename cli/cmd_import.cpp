// primus import hf HF_DIR OUT [--seq-length N] [--make-vocab-size-divisible-by N] [--tokenizer T]
// A Hugging Face model folder becomes a Primus checkpoint (iteration 0, weights only): what
// `generate`, `export hf` and every backend read. Training starts from an HF folder directly with
// the key `load_hf` (train/hf_import.h).
#include <fmt/format.h>

#include <iostream>

#include "cli/command.h"
#include "core/util/hf_cache.h"
#include "train/hf_import.h"

namespace primus::cli {
namespace {

void setup_import(CLI::App& app) {
  app.require_subcommand(1);
  struct Opts {
    std::string hf_dir, out, tokenizer;
    train::HfImportOptions o;
  };
  auto o = std::make_shared<Opts>();
  CLI::App* hf = app.add_subcommand(
      "hf", "Read a Hugging Face model folder (config.json, model.safetensors or sharded safetensors with "
            "model.safetensors.index.json, tokenizer.json) into a checkpoint");
  hf->add_option("hf_dir", o->hf_dir,
                 "Hugging Face model folder, or a Hub id (org/name) found offline in the Hugging Face cache")
      ->required();
  hf->add_option("out", o->out, "Output folder (the checkpoint is its iter_0000000)")->required();
  hf->add_option("--seq-length", o->o.seq_length,
                 "Context length stored in the model spec (default: n_positions for learned positions, "
                 "min(max_position_embeddings, 4096) for RoPE)")
      ->check(CLI::PositiveNumber);
  hf->add_option("--make-vocab-size-divisible-by", o->o.make_vocab_size_divisible_by,
                 "Pad the embedding rows to a multiple of this (padded rows are zero)")
      ->check(CLI::PositiveNumber);
  hf->add_option("--tokenizer", o->tokenizer,
                 "gpt2, bytes or a tokenizer.json path instead of the folder's tokenizer.json");
  hf->callback([o] {
    auto dir = train::import_hf_checkpoint(resolve_hf_path(o->hf_dir, "config.json", "hf_dir"), o->out, o->o,
                                           o->tokenizer);
    std::cout << dir.string() << "\n";
  });
}

CommandRegistrar reg_import({"import", "Import a model into a checkpoint (hf)", setup_import});

}  // namespace
}  // namespace primus::cli
