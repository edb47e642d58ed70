// Several sample sources mixed by weight, as Megatron's BlendedDataset does with a data_path
// of "0.7 A 0.3 B". The blend is a fixed, seed-free schedule: position i of each period of
// kPeriod samples goes to the part that is furthest below its share so far (ties to the
// lower index), so every prefix of the schedule matches the weights to within one sample per
// part and period. Part d's own samples are taken in order 0, 1, 2, ...; each part shuffles
// its own samples.
#pragma once
#include <memory>
#include <utility>
#include <vector>

#include "data/dataset/sample_source.h"

namespace primus::data {

class BlendedDataset final : public SampleSource {
 public:
  static constexpr uint64_t kPeriod = uint64_t{1} << 20;

  // weights > 0, one per part, normalised here; parts must share seq_length. Throws
  // ConfigError otherwise, or when a weight is too small to get one sample per period.
  BlendedDataset(std::vector<std::shared_ptr<const SampleSource>> parts, std::vector<double> weights);

  int seq_length() const override { return parts_[0]->seq_length(); }
  void sample(uint64_t index, int32_t* out) const override;
  nlohmann::json describe() const override;

  // The part global sample `index` comes from, and the index of the sample within that part.
  std::pair<size_t, uint64_t> locate(uint64_t index) const;
  // How many of the first n samples each part gives (Megatron's per-dataset sample counts).
  std::vector<uint64_t> counts(uint64_t n) const;
  const std::vector<double>& weights() const { return weights_; }

 private:
  std::vector<std::shared_ptr<const SampleSource>> parts_;
  std::vector<double> weights_;
  std::vector<uint16_t> part_of_;     // period position -> part
  std::vector<uint32_t> local_;       // period position -> sample index within the part's share
  std::vector<uint64_t> per_period_;  // samples per part in one period
};

}  // namespace primus::data
