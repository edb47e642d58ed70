#include "data/dataset/blended_dataset.h"

#include <fmt/format.h>

#include <cmath>

#include "core/util/error.h"

namespace primus::data {

BlendedDataset::BlendedDataset(std::vector<std::shared_ptr<const SampleSource>> parts,
                               std::vector<double> weights)
    : parts_(std::move(parts)), weights_(std::move(weights)) {
  if (parts_.empty()) throw ConfigError("a blend needs at least one dataset");
  if (parts_.size() != weights_.size()) {
    throw ConfigError(fmt::format("a blend of {} datasets got {} weights", parts_.size(), weights_.size()));
  }
  if (parts_.size() > 65535) throw ConfigError("a blend holds at most 65535 datasets");
  double total = 0;
  for (size_t d = 0; d < weights_.size(); ++d) {
    if (!(weights_[d] > 0) || !std::isfinite(weights_[d])) {
      throw ConfigError(fmt::format("blend weight {} of dataset {} must be a positive number",
                                    weights_[d], d));
    }
    if (parts_[d]->seq_length() != parts_[0]->seq_length()) {
      throw ConfigError(fmt::format("blended datasets disagree on seq_length ({} vs {})",
                                    parts_[d]->seq_length(), parts_[0]->seq_length()));
    }
    total += weights_[d];
  }
  for (double& w : weights_) w /= total;

  const size_t n = parts_.size();
  part_of_.resize(kPeriod);
  local_.resize(kPeriod);
  per_period_.assign(n, 0);
  for (uint64_t i = 0; i < kPeriod; ++i) {
    size_t best = 0;
    double best_gap = -1e300;
    for (size_t d = 0; d < n; ++d) {
      double gap = weights_[d] * static_cast<double>(i + 1) - static_cast<double>(per_period_[d]);
      if (gap > best_gap) best_gap = gap, best = d;
    }
    part_of_[i] = static_cast<uint16_t>(best);
    local_[i] = static_cast<uint32_t>(per_period_[best]++);
  }
  for (size_t d = 0; d < n; ++d) {
    if (per_period_[d] == 0) {
      throw ConfigError(fmt::format("blend weight {} of dataset {} is too small: it gets no sample in "
                                    "{} samples",
                                    weights_[d], d, kPeriod));
    }
  }
}

std::pair<size_t, uint64_t> BlendedDataset::locate(uint64_t index) const {
  uint64_t q = index / kPeriod, r = index % kPeriod;
  size_t d = part_of_[r];
  return {d, q * per_period_[d] + local_[r]};
}

void BlendedDataset::sample(uint64_t index, int32_t* out) const {
  auto [d, local] = locate(index);
  parts_[d]->sample(local, out);
}

std::vector<uint64_t> BlendedDataset::counts(uint64_t n) const {
  std::vector<uint64_t> c(parts_.size());
  uint64_t q = n / kPeriod, r = n % kPeriod;
  for (size_t d = 0; d < c.size(); ++d) c[d] = q * per_period_[d];
  for (uint64_t i = 0; i < r; ++i) ++c[part_of_[i]];
  return c;
}

nlohmann::json BlendedDataset::describe() const {
  nlohmann::json parts = nlohmann::json::array();
  for (size_t d = 0; d < parts_.size(); ++d) {
    parts.push_back({{"weight", weights_[d]}, {"source", parts_[d]->describe()}});
  }
  return {{"type", "blend"}, {"parts", parts}};
}

}  // namespace primus::data
