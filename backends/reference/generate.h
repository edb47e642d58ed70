// Sampling from a reference model (train/sampling.h: temperature, top-k, top-p over the last
// position's logits), recomputing the whole window for every token: the oracle the cuda
// inference engine (backends/cuda/inference) is tested against.
#pragma once
#include <random>
#include <string>
#include <vector>

#include "backends/reference/model.h"
#include "data/tokenizer/tokenizer.h"
#include "train/sampling.h"

namespace primus::backends::reference {

using SampleOptions = train::SampleOptions;

// Appends up to max_new_tokens ids to `ids` (the prompt); the context is the last seq_length ids.
void sample_tokens(GptModel<float>& model, std::vector<int32_t>& ids, const SampleOptions& o, std::mt19937_64& rng);

// Text for people: the byte tokenizer's end-of-document id (0, a NUL byte) is shown as a newline.
std::string printable(std::string text);

// Loads a checkpoint folder (or a save folder's latest) and generates from `prompt`
// (o.eod_id is set from the checkpoint's tokenizer).
std::string generate_from_checkpoint(const std::string& checkpoint, const std::string& prompt,
                                     const SampleOptions& o, uint64_t seed);

// Loads a checkpoint (as above) and continues each prompt (token ids, non-empty) in turn, drawing
// from one generator seeded with `seed`; returns each prompt's new ids (o.eod_id as given).
std::vector<std::vector<int32_t>> generate_ids(const std::string& checkpoint,
                                               const std::vector<std::vector<int32_t>>& prompts,
                                               const SampleOptions& o, uint64_t seed);

// Loads a checkpoint (as above) and returns the mean next-token loss (nats) of `text`'s tokens
// under the fp32 model: tokens[0..n-1] predict tokens[1..n], n <= seq_length (longer texts are cut).
// What an outside framework loading the `export hf` folder must reproduce on the same text.
double score_checkpoint(const std::string& checkpoint, const std::string& text);

}  // namespace primus::backends::reference
