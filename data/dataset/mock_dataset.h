// Mock data (Megatron's --mock-data): pseudo-random token ids in [0, vocab_size), a pure
// function of (seed, sample index, position), for running and timing the trainer without a
// dataset. Same interface and determinism as the real loader.
#pragma once
#include "data/dataset/sample_source.h"

namespace primus::data {

class MockDataset final : public SampleSource {
 public:
  MockDataset(int seq_length, uint64_t seed, int vocab_size);
  int seq_length() const override { return seq_length_; }
  void sample(uint64_t index, int32_t* out) const override;
  nlohmann::json describe() const override;

 private:
  int seq_length_;
  uint64_t seed_;
  int vocab_size_;
};

}  // namespace primus::data
