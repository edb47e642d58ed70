#include "backends/reference/generate.h"

#include <fmt/format.h>

#include <algorithm>
#include <cmath>
#include <filesystem>
#include <memory>

#include "core/util/error.h"
#include "io/checkpoint.h"
#include "train/checkpointing.h"

namespace primus::backends::reference {

void sample_tokens(GptModel<float>& model, std::vector<int32_t>& ids, const SampleOptions& o, std::mt19937_64& rng) {
  const auto& spec = model.spec();
  const int64_t V = spec.vocab_size, Vp = spec.padded_vocab_size;
  std::vector<double> probs(V);
  std::vector<int32_t> order(V);
  for (int64_t n = 0; n < o.max_new_tokens; ++n) {
    int64_t T = std::min<int64_t>(static_cast<int64_t>(ids.size()), spec.seq_length);
    if (T == 0) throw RuntimeError("generation needs a non-empty prompt");
    model.forward(ids.data() + ids.size() - T, nullptr, 1, T);
    const float* logits = model.logits() + (T - 1) * Vp;
    int32_t next = 0;
    if (o.temperature <= 0) {
      next = static_cast<int32_t>(std::max_element(logits, logits + V) - logits);
    } else {
      for (int64_t i = 0; i < V; ++i) order[i] = static_cast<int32_t>(i);
      int64_t k = o.top_k > 0 ? std::min(o.top_k, V) : V;
      if (k < V) {
        std::partial_sort(order.begin(), order.begin() + k, order.end(),
                          [&](int32_t a, int32_t b) { return logits[a] > logits[b]; });
      }
      double mx = -INFINITY;
      for (int64_t i = 0; i < k; ++i) mx = std::max(mx, static_cast<double>(logits[order[i]]));
      double sum = 0;
      for (int64_t i = 0; i < k; ++i) sum += probs[i] = std::exp((logits[order[i]] - mx) / o.temperature);
      std::uniform_real_distribution<double> u(0.0, sum);
      double r = u(rng);
      int64_t i = 0;
      for (; i < k - 1 && r >= probs[i]; ++i) r -= probs[i];
      next = order[i];
    }
    ids.push_back(next);
    if (o.stop_at_eod && next == 0) break;
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
  std::filesystem::path dir = checkpoint;
  if (!std::filesystem::exists(dir / io::kManifestFile)) {
    auto latest = io::find_latest(dir);
    if (!latest) throw IoError(fmt::format("no checkpoint in '{}'", checkpoint));
    dir = latest->dir;
  }
  io::CheckpointData data = io::load_checkpoint(dir);
  if (!data.state.contains("model_spec") || !data.state.contains("tokenizer")) {
    throw FormatError(fmt::format("checkpoint {}: trainer_state.json lacks model_spec/tokenizer", dir.string()));
  }
  Loaded l;
  l.spec = train::spec_from_json(data.state["model_spec"]);
  l.tok = data::make_tokenizer(data.state["tokenizer"].get<std::string>());
  l.model = std::make_unique<GptModel<float>>(l.spec, 1, l.spec.seq_length);
  train::unpack_checkpoint(data, dir, l.spec, l.model->layout(), l.model->params.data(), nullptr, nullptr);
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
                                     const SampleOptions& o, uint64_t seed) {
  Loaded l = load_for_inference(checkpoint);
  GptModel<float>& model = *l.model;
  auto& tok = l.tok;
  std::vector<int32_t> ids = tok->encode(prompt);
  if (ids.empty()) ids.push_back(tok->eod_id() >= 0 ? tok->eod_id() : 0);
  size_t prompt_len = ids.size();
  std::mt19937_64 rng(seed);
  sample_tokens(model, ids, o, rng);
  return printable(prompt + tok->decode(std::span<const int32_t>(ids).subspan(prompt_len)));
}

}  // namespace primus::backends::reference
