// What the batch iterator draws from: an endless, deterministic sequence of GPT samples.
// Sample i is seq_length()+1 token ids (inputs are the first seq_length, targets the last
// seq_length), the same for a given i on every rank, run and machine. Implementations:
// GptDataset (one indexed dataset), BlendedDataset (several, by weight), MockDataset.
#pragma once
#include <cstdint>
#include <nlohmann/json.hpp>

namespace primus::data {

class SampleSource {
 public:
  virtual ~SampleSource() = default;
  virtual int seq_length() const = 0;
  // Writes the seq_length()+1 ids of sample `index` to out. Thread-safe.
  virtual void sample(uint64_t index, int32_t* out) const = 0;
  // What the samples are made from (files, document ranges, seed, weights): a saved iterator
  // state is only valid for an equal description.
  virtual nlohmann::json describe() const = 0;
};

}  // namespace primus::data
