#include "data/dataset/mock_dataset.h"

#include <fmt/format.h>

#include "core/util/error.h"
#include "data/dataset/random.h"

namespace primus::data {

MockDataset::MockDataset(int seq_length, uint64_t seed, int vocab_size)
    : seq_length_(seq_length), seed_(seed), vocab_size_(vocab_size) {
  if (seq_length_ < 1) throw ConfigError(fmt::format("seq_length must be >= 1, got {}", seq_length_));
  if (vocab_size_ < 1) {
    throw ConfigError(fmt::format("mock data needs vocab_size >= 1, got {}", vocab_size_));
  }
}

void MockDataset::sample(uint64_t index, int32_t* out) const {
  Rng rng(derive_seed(seed_, {index}));
  for (int t = 0; t <= seq_length_; ++t) out[t] = static_cast<int32_t>(rng.below(static_cast<uint64_t>(vocab_size_)));
}

nlohmann::json MockDataset::describe() const {
  return {{"type", "mock"}, {"seq_length", seq_length_}, {"seed", seed_}, {"vocab_size", vocab_size_}};
}

}  // namespace primus::data
