// Next-token sampling from one row of logits, shared by every backend's generation (the CPU
// reference model's and the cuda inference engine's), so that the same logits and the same
// generator give the same token on both.
//
// Order and semantics are transformers' (TemperatureLogitsWarper, TopKLogitsWarper,
// TopPLogitsWarper): temperature scales the logits, top-k keeps the k largest, top-p keeps the
// smallest set of the most likely remaining tokens whose probability (softmax over what top-k
// left, at that temperature) reaches p; one token is then drawn from the renormalised rest.
// temperature 0 is greedy (argmax, lowest id on ties) and ignores top-k / top-p.
#pragma once
#include <cstdint>
#include <random>
#include <vector>

namespace primus::train {

struct SampleOptions {
  int64_t max_new_tokens = 200;
  double temperature = 1.0;  // 0: greedy
  int64_t top_k = 0;         // 0: the whole vocabulary
  double top_p = 1.0;        // in (0, 1]; 1: no nucleus cut
  bool stop_at_eod = false;  // stop a sequence after it emits the end-of-text id
  int32_t eod_id = 0;        // the tokenizer's end-of-text id (used with stop_at_eod)
};

// Throws ConfigError naming the option when a value is out of range (negative temperature,
// top-p outside (0, 1], negative top-k or max_new_tokens).
void check_sample_options(const SampleOptions& o);

// Picks the next token from logits[0..V) (the real vocabulary; padded columns excluded).
// `scratch` is reused between calls to avoid allocating per token.
class Sampler {
 public:
  int32_t operator()(const float* logits, int64_t V, const SampleOptions& o, std::mt19937_64& rng);
  // The candidates and their probabilities of the last sampled (non-greedy) call, most likely
  // first: what survived top-k and top-p (for tests).
  const std::vector<int32_t>& kept() const { return kept_; }
  const std::vector<double>& kept_probs() const { return kept_probs_; }

 private:
  std::vector<int32_t> order_, kept_;
  std::vector<double> probs_, kept_probs_;
};

}  // namespace primus::train
