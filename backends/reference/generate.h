// Sampling from a reference model: temperature and top-k over the last position's logits.
#pragma once
#include <random>
#include <string>
#include <vector>

#include "backends/reference/model.h"
#include "data/tokenizer/tokenizer.h"

namespace primus::backends::reference {

struct SampleOptions {
  int64_t max_new_tokens = 200;
  double temperature = 1.0;  // 0: greedy
  int64_t top_k = 0;         // 0: the whole vocabulary
  bool stop_at_eod = false;
};

// Appends up to max_new_tokens ids to `ids` (the prompt); the context is the last seq_length ids.
void sample_tokens(GptModel<float>& model, std::vector<int32_t>& ids, const SampleOptions& o, std::mt19937_64& rng);

// Text for people: the byte tokenizer's end-of-document id (0, a NUL byte) is shown as a newline.
std::string printable(std::string text);

// Loads a checkpoint folder (or a save folder's latest) and generates from `prompt`.
std::string generate_from_checkpoint(const std::string& checkpoint, const std::string& prompt,
                                     const SampleOptions& o, uint64_t seed);

// Loads a checkpoint (as above) and returns the mean next-token loss (nats) of `text`'s tokens
// under the fp32 model: tokens[0..n-1] predict tokens[1..n], n <= seq_length (longer texts are cut).
// What an outside framework loading the `export hf` folder must reproduce on the same text.
double score_checkpoint(const std::string& checkpoint, const std::string& text);

}  // namespace primus::backends::reference
