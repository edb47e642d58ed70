#include "data/dataset/gpt_dataset.h"

#include <fmt/format.h>

#include <algorithm>
#include <filesystem>
#include <limits>

#include "core/util/error.h"
#include "data/dataset/random.h"

namespace primus::data {
namespace {
constexpr uint64_t kMaxBlock = uint64_t{1} << 24;
constexpr uint64_t kTagDocs = 1, kTagSamples = 2;
// A block of samples spans at most two epochs, so two of each keep a forward reader from
// rebuilding; each epoch costs 12 bytes per document.
constexpr size_t kCacheEntries = 2;

template <class V, class Make>
std::shared_ptr<const V> cached(std::vector<std::pair<uint64_t, std::shared_ptr<const V>>>& cache,
                                uint64_t key, Make make) {
  for (auto& [k, v] : cache) {
    if (k == key) return v;
  }
  auto v = make();
  if (cache.size() >= kCacheEntries) cache.erase(cache.begin());
  cache.emplace_back(key, v);
  return v;
}
}  // namespace

struct GptDataset::Epoch {
  std::vector<uint32_t> order;  // position -> document (relative to doc_begin)
  std::vector<uint64_t> cum;    // cum[j] = tokens of the documents before position j
};

GptDataset::GptDataset(std::shared_ptr<const IndexedDataset> data, uint64_t doc_begin,
                       uint64_t doc_end, int seq_length, uint64_t seed, int64_t vocab_size)
    : data_(std::move(data)),
      doc_begin_(doc_begin),
      doc_end_(doc_end),
      seq_length_(seq_length),
      seed_(seed),
      vocab_size_(vocab_size) {
  const std::string& prefix = data_->prefix();
  if (seq_length_ < 1) throw ConfigError(fmt::format("seq_length must be >= 1, got {}", seq_length_));
  if (doc_begin_ >= doc_end_ || doc_end_ > data_->document_count()) {
    throw ConfigError(fmt::format("{}: document range [{}, {}) is empty or past its {} documents",
                                  prefix, doc_begin_, doc_end_, data_->document_count()));
  }
  if (doc_end_ - doc_begin_ > std::numeric_limits<uint32_t>::max()) {
    throw ConfigError(fmt::format("{}: {} documents in one dataset; at most 2^32-1 are supported",
                                  prefix, doc_end_ - doc_begin_));
  }
  for (uint64_t d = doc_begin_; d < doc_end_; ++d) tokens_per_epoch_ += data_->document_length(d);
  if (tokens_per_epoch_ == 0) {
    throw ConfigError(fmt::format("{}: documents [{}, {}) hold no tokens", prefix, doc_begin_, doc_end_));
  }
  block_ = std::clamp<uint64_t>(tokens_per_epoch_ / static_cast<uint64_t>(seq_length_), 1, kMaxBlock);
}

std::shared_ptr<const GptDataset::Epoch> GptDataset::epoch(uint64_t e) const {
  std::lock_guard lock(mu_);
  return cached(epochs_, e, [&] {
    auto ep = std::make_shared<Epoch>();
    ep->order = random_permutation<uint32_t>(doc_end_ - doc_begin_, derive_seed(seed_, {kTagDocs, e}));
    ep->cum.resize(ep->order.size() + 1);
    for (size_t j = 0; j < ep->order.size(); ++j) {
      ep->cum[j + 1] = ep->cum[j] + data_->document_length(doc_begin_ + ep->order[j]);
    }
    return std::shared_ptr<const Epoch>(std::move(ep));
  });
}

std::shared_ptr<const std::vector<uint32_t>> GptDataset::block_order(uint64_t b) const {
  std::lock_guard lock(mu_);
  return cached(blocks_, b, [&] {
    return std::make_shared<const std::vector<uint32_t>>(
        random_permutation<uint32_t>(block_, derive_seed(seed_, {kTagSamples, b})));
  });
}

uint64_t GptDataset::sample_start(uint64_t index) const {
  uint64_t b = index / block_;
  uint64_t k = b * block_ + (*block_order(b))[index % block_];
  return k * static_cast<uint64_t>(seq_length_);
}

void GptDataset::read_document(uint64_t d, uint64_t offset, uint64_t count, int32_t* out) const {
  auto s = static_cast<uint64_t>(data_->document_index(d));
  for (; count > 0; ++s) {
    auto len = static_cast<uint64_t>(data_->sequence_length(s));
    if (offset >= len) {
      offset -= len;
      continue;
    }
    uint64_t take = std::min(count, len - offset);
    data_->read(s, offset, take, out, vocab_size_);
    out += take;
    count -= take;
    offset = 0;
  }
}

void GptDataset::sample(uint64_t index, int32_t* out) const {
  uint64_t start = sample_start(index);
  uint64_t e = start / tokens_per_epoch_, off = start % tokens_per_epoch_;
  auto ep = epoch(e);
  // The document holding token `off`: the last position whose cumulative count is <= off
  // (empty documents share their cumulative count with the next one and are skipped).
  size_t j = static_cast<size_t>(std::upper_bound(ep->cum.begin(), ep->cum.end(), off) - ep->cum.begin()) - 1;
  uint64_t within = off - ep->cum[j];
  uint64_t need = static_cast<uint64_t>(seq_length_) + 1;
  while (need > 0) {
    if (j == ep->order.size()) {  // the stream runs on into the next epoch
      ep = epoch(++e);
      j = 0;
    }
    uint64_t rel = ep->order[j];
    uint64_t take = std::min(need, ep->cum[j + 1] - ep->cum[j] - within);
    read_document(doc_begin_ + rel, within, take, out);
    out += take;
    need -= take;
    within = 0;
    ++j;
  }
}

nlohmann::json GptDataset::describe() const {
  return {{"type", "gpt"},
          // The file name, not the path: a run may resume with its data mounted elsewhere.
          {"name", std::filesystem::path(data_->prefix()).filename().string()},
          {"documents", {doc_begin_, doc_end_}},
          {"tokens", tokens_per_epoch_},
          {"seq_length", seq_length_},
          {"seed", seed_}};
}

}  // namespace primus::data
