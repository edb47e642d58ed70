#include "train/sampling.h"

#include <fmt/format.h>

#include <algorithm>
#include <cmath>
#include <numeric>

#include "core/util/error.h"

namespace primus::train {

void check_sample_options(const SampleOptions& o) {
  if (!(o.temperature >= 0) || !std::isfinite(o.temperature))
    throw ConfigError(fmt::format("temperature: {} is not a finite value >= 0", o.temperature));
  if (!(o.top_p > 0 && o.top_p <= 1)) throw ConfigError(fmt::format("top_p: {} is outside (0, 1]", o.top_p));
  if (o.top_k < 0) throw ConfigError(fmt::format("top_k: {} is negative", o.top_k));
  if (o.max_new_tokens < 0) throw ConfigError(fmt::format("max_new_tokens: {} is negative", o.max_new_tokens));
}

int32_t Sampler::operator()(const float* logits, int64_t V, const SampleOptions& o, std::mt19937_64& rng) {
  if (V <= 0) throw RuntimeError("sampling from an empty vocabulary");
  if (o.temperature <= 0) return static_cast<int32_t>(std::max_element(logits, logits + V) - logits);
  order_.resize(static_cast<size_t>(V));
  std::iota(order_.begin(), order_.end(), 0);
  const int64_t k = o.top_k > 0 ? std::min(o.top_k, V) : V;
  // Most likely first; ties by id, so the kept set does not depend on the sort's stability.
  auto before = [&](int32_t a, int32_t b) { return logits[a] > logits[b] || (logits[a] == logits[b] && a < b); };
  if (k < V || o.top_p < 1) std::partial_sort(order_.begin(), order_.begin() + k, order_.end(), before);
  double mx = -INFINITY;
  for (int64_t i = 0; i < k; ++i) mx = std::max(mx, static_cast<double>(logits[order_[i]]));
  probs_.resize(static_cast<size_t>(k));
  double sum = 0;
  for (int64_t i = 0; i < k; ++i) sum += probs_[i] = std::exp((logits[order_[i]] - mx) / o.temperature);
  int64_t n = k;
  if (o.top_p < 1) {
    // Keep token i while the mass of the tokens before it is below p (transformers removes the
    // tokens whose ascending cumulative probability is <= 1 - p): at least one token stays.
    double before_mass = 0;
    for (n = 0; n < k && before_mass < o.top_p * sum; ++n) before_mass += probs_[n];
    sum = before_mass;
  }
  kept_.assign(order_.begin(), order_.begin() + n);
  kept_probs_.resize(static_cast<size_t>(n));
  for (int64_t i = 0; i < n; ++i) kept_probs_[i] = probs_[i] / sum;
  std::uniform_real_distribution<double> u(0.0, sum);
  double r = u(rng);
  int64_t i = 0;
  for (; i < n - 1 && r >= probs_[i]; ++i) r -= probs_[i];
  return order_[i];
}

}  // namespace primus::train
