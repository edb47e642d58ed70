// The loader's iterator: walks a SampleSource in global batches and hands each data-parallel
// rank its slice. A call next_batch(batch, out) on every rank consumes one global batch of
// batch * dp_size samples; rank r gets samples [pos + r*batch, pos + (r+1)*batch), so the
// ranks' slices are disjoint and together cover the global batch.
//
// The position counts global samples, so state() saved on any rank restores on every rank,
// also with a different dp_size (as long as the data itself is the same).
#pragma once
#include <cstdint>
#include <memory>
#include <nlohmann/json.hpp>

#include "data/dataset/sample_source.h"

namespace primus::data {

class BatchIterator {
 public:
  // 0 <= dp_rank < dp_size. Throws ConfigError otherwise.
  BatchIterator(std::shared_ptr<const SampleSource> source, int dp_rank = 0, int dp_size = 1);

  int seq_length() const { return source_->seq_length(); }
  int dp_rank() const { return dp_rank_; }
  int dp_size() const { return dp_size_; }
  const SampleSource& source() const { return *source_; }

  // Writes this rank's `batch` samples, row-major int32 [batch][seq_length+1], to out (caller
  // owned, batch*(seq_length+1) elements), and moves past the whole global batch.
  void next_batch(int batch, int32_t* out);

  // For readers that choose their own samples of a global batch (parallel/data_parallel.h): writes
  // the `count` samples starting at position() + offset to out, without moving.
  void read_at(uint64_t offset, int count, int32_t* out) const;
  // Moves past `samples` global samples (one global batch, once per step on every rank).
  void skip(uint64_t samples) { position_ += samples; }

  // Global samples consumed so far (all ranks together).
  uint64_t position() const { return position_; }

  // {"version": 1, "position": N, "source": source().describe()}.
  nlohmann::json state() const;
  // Restores a state() result exactly: the next batches equal those that followed the save.
  // Throws ConfigError when the state is malformed or was saved for other data.
  void load_state(const nlohmann::json& state);

 private:
  std::shared_ptr<const SampleSource> source_;
  int dp_rank_, dp_size_;
  uint64_t position_ = 0;
};

}  // namespace primus::data
