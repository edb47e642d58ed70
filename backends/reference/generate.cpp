#include "backends/reference/generate.h"

#include <fmt/format.h>

#include <algorithm>
#include <cmath>
#include <filesystem>
#include <memory>

#include "core/util/error.h"
#include "train/inference_checkpoint.h"

namespace primus::backends::reference {

void sample_tokens(GptModel<float>& model, std::vector<int32_t>& ids, const SampleOptions& o, std::mt19937_64& rng) {
  const auto& spec = model.spec();
  const int64_t V = spec.vocab_size, Vp = spec.padded_vocab_size;
  train::Sampler sampler;
  for (int64_t n = 0; n < o.max_new_tokens; ++n) {
    int64_t T = std::min<int64_t>(static_cast<int64_t>(ids.size()), spec.seq_length);
    if (T == 0) throw RuntimeError("generation needs a non-empty prompt");
    model.forward(ids.data() + ids.size() - T, nullptr, 1, T);
    const int32_t next = sampler(model.logits() + (T - 1) * Vp, V, o, rng);
    ids.push_back(next);
    if (o.stop_at_eod && next == o.eod_id) break;
  }
}

std::string printable(std::string text) {
  for (char& c : text)
    if (c == '\0') c = '\n';
  return text;
}

namespace {
struct Loaded {
  train::ModelSpec spec;
  std::unique_ptr<data::Tokenizer> tok;
  std::unique_ptr<GptModel<float>> model;
};

Loaded load_for_inference(const std::string& checkpoint) {
  train::InferenceCheckpoint c = train::load_inference_checkpoint(checkpoint);
  Loaded l;
  l.spec = c.spec;
  l.tok = data::make_tokenizer(c.tokenizer);
  l.model = std::make_unique<GptModel<float>>(l.spec, 1, l.spec.seq_length);
  std::copy(c.params.begin(), c.params.end(), l.model->params.begin());
  return l;
}
}  // namespace

double score_checkpoint(const std::string& checkpoint, const std::string& text) {
  Loaded l = load_for_inference(checkpoint);
  std::vector<int32_t> ids = l.tok->encode(text);
  if (ids.size() < 2) throw ConfigError(fmt::format("--score: '{}' has fewer than 2 tokens", text));
  const size_t n = std::min(ids.size() - 1, static_cast<size_t>(l.spec.seq_length));
  std::vector<int32_t> in(ids.begin(), ids.begin() + static_cast<std::ptrdiff_t>(n)),
      tg(ids.begin() + 1, ids.begin() + 1 + static_cast<std::ptrdiff_t>(n));
  return l.model->forward(in.data(), tg.data(), 1, static_cast<int64_t>(n));
}

std::string generate_from_checkpoint(const std::string& checkpoint, const std::string& prompt,
                                     const SampleOptions& opts, uint64_t seed) {
  train::check_sample_options(opts);
  Loaded l = load_for_inference(checkpoint);
  GptModel<float>& model = *l.model;
  auto& tok = l.tok;
  std::vector<int32_t> ids = tok->encode(prompt);
  if (ids.empty()) ids.push_back(tok->eod_id() >= 0 ? tok->eod_id() : 0);
  size_t prompt_len = ids.size();
  SampleOptions o = opts;
  if (tok->eod_id() >= 0) o.eod_id = tok->eod_id();
  std::mt19937_64 rng(seed);
  sample_tokens(model, ids, o, rng);
  return printable(prompt + tok->decode(std::span<const int32_t>(ids).subspan(prompt_len)));
}

std::vector<std::vector<int32_t>> generate_ids(const std::string& checkpoint,
                                               const std::vector<std::vector<int32_t>>& prompts,
                                               const SampleOptions& o, uint64_t seed) {
  train::check_sample_options(o);
  Loaded l = load_for_inference(checkpoint);
  std::mt19937_64 rng(seed);
  std::vector<std::vector<int32_t>> out;
  for (size_t i = 0; i < prompts.size(); ++i) {
    if (prompts[i].empty()) throw ConfigError(fmt::format("generate: prompt {} is empty", i));
    for (int32_t t : prompts[i])
      if (t < 0 || t >= l.spec.vocab_size)
        throw ConfigError(fmt::format("generate: prompt {} has token {} outside the vocabulary [0, {})", i, t,
                                      l.spec.vocab_size));
    std::vector<int32_t> ids = prompts[i];
    sample_tokens(*l.model, ids, o, rng);
    out.emplace_back(ids.begin() + static_cast<std::ptrdiff_t>(prompts[i].size()), ids.end());
  }
  return out;
}

}  // namespace primus::backends::reference
