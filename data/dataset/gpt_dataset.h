// GPT samples over a range of an indexed dataset's documents, Megatron-style.
//
// The documents form a token stream: epoch 0's documents in a seeded random order, then
// epoch 1's in another, and so on without end. Sample k is the seq_length+1 tokens starting at
// token k*seq_length of that stream, so consecutive samples share one token (the last target
// of one is the first input of the next), samples run across document and epoch boundaries,
// and no token is dropped. The samples are then visited in a shuffled order: block b holds
// samples [b*B, (b+1)*B) with B = samples per epoch, visited in a permutation seeded by b (B capped
// at 2^24 samples to bound memory).
// Everything is computed on demand from (seed, epoch) and (seed, block), so any sample index
// is reachable at once, which is what makes resuming exact.
#pragma once
#include <cstdint>
#include <memory>
#include <mutex>
#include <vector>

#include "data/dataset/indexed_dataset.h"
#include "data/dataset/sample_source.h"

namespace primus::data {

class GptDataset final : public SampleSource {
 public:
  // Documents [doc_begin, doc_end) of `data`. vocab_size > 0 checks every token read against
  // it (FormatError naming the file and document). Throws ConfigError for an empty range or a
  // range without tokens.
  GptDataset(std::shared_ptr<const IndexedDataset> data, uint64_t doc_begin, uint64_t doc_end,
             int seq_length, uint64_t seed, int64_t vocab_size = 0);

  int seq_length() const override { return seq_length_; }
  void sample(uint64_t index, int32_t* out) const override;
  nlohmann::json describe() const override;

  uint64_t tokens_per_epoch() const { return tokens_per_epoch_; }
  uint64_t samples_per_block() const { return block_; }
  // The stream position (token offset) where sample `index` (in visiting order) starts.
  uint64_t sample_start(uint64_t index) const;

 private:
  struct Epoch;  // the document order of one epoch and its cumulative token counts
  std::shared_ptr<const Epoch> epoch(uint64_t e) const;
  std::shared_ptr<const std::vector<uint32_t>> block_order(uint64_t b) const;
  // Copies `count` tokens of document d (absolute index) starting `offset` tokens in.
  void read_document(uint64_t d, uint64_t offset, uint64_t count, int32_t* out) const;

  std::shared_ptr<const IndexedDataset> data_;
  uint64_t doc_begin_, doc_end_;
  int seq_length_;
  uint64_t seed_;
  int64_t vocab_size_;
  uint64_t tokens_per_epoch_ = 0;
  uint64_t block_ = 1;

  // Small caches: a reader moves forward, so the last few epochs and blocks are all it needs.
  mutable std::mutex mu_;
  mutable std::vector<std::pair<uint64_t, std::shared_ptr<const Epoch>>> epochs_;
  mutable std::vector<std::pair<uint64_t, std::shared_ptr<const std::vector<uint32_t>>>> blocks_;
};

}  // namespace primus::data
