#include "data/dataset/batch_iterator.h"

#include <fmt/format.h>

#include "core/util/error.h"

namespace primus::data {

BatchIterator::BatchIterator(std::shared_ptr<const SampleSource> source, int dp_rank, int dp_size)
    : source_(std::move(source)), dp_rank_(dp_rank), dp_size_(dp_size) {
  if (!source_) throw ConfigError("BatchIterator needs a sample source");
  if (dp_size_ < 1 || dp_rank_ < 0 || dp_rank_ >= dp_size_) {
    throw ConfigError(fmt::format("data-parallel rank {} of {} is not valid", dp_rank_, dp_size_));
  }
}

void BatchIterator::next_batch(int batch, int32_t* out) {
  if (batch < 1) throw ConfigError(fmt::format("batch size must be >= 1, got {}", batch));
  const auto b = static_cast<uint64_t>(batch);
  const uint64_t first = position_ + static_cast<uint64_t>(dp_rank_) * b;
  const size_t row = static_cast<size_t>(source_->seq_length()) + 1;
  for (uint64_t i = 0; i < b; ++i) source_->sample(first + i, out + i * row);
  position_ += b * static_cast<uint64_t>(dp_size_);
}

void BatchIterator::read_at(uint64_t offset, int count, int32_t* out) const {
  if (count < 1) throw ConfigError(fmt::format("batch size must be >= 1, got {}", count));
  const size_t row = static_cast<size_t>(source_->seq_length()) + 1;
  for (int i = 0; i < count; ++i) source_->sample(position_ + offset + static_cast<uint64_t>(i), out + i * row);
}

nlohmann::json BatchIterator::state() const {
  return {{"version", 1}, {"position", position_}, {"source", source_->describe()}};
}

void BatchIterator::load_state(const nlohmann::json& state) {
  if (!state.is_object() || state.value("version", 0) != 1 || !state.contains("position") ||
      !state["position"].is_number_unsigned() || !state.contains("source")) {
    throw ConfigError(fmt::format("data iterator state is malformed: {}", state.dump()));
  }
  auto here = source_->describe();
  if (state["source"] != here) {
    throw ConfigError(fmt::format("data iterator state was saved for other data: saved {}, now {}",
                                  state["source"].dump(), here.dump()));
  }
  position_ = state["position"].get<uint64_t>();
}

}  // namespace primus::data
