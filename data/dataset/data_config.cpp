#include "data/dataset/data_config.h"

#include <fmt/format.h>

#include <charconv>
#include <cmath>
#include <map>
#include <sstream>

#include "core/util/error.h"
#include "data/dataset/blended_dataset.h"
#include "data/dataset/gpt_dataset.h"
#include "data/dataset/mock_dataset.h"

namespace primus::data {
namespace {

bool parse_number(const std::string& s, double* out) {
  const char* end = s.data() + s.size();
  auto [p, ec] = std::from_chars(s.data(), end, *out);
  return ec == std::errc() && p == end;
}

std::vector<std::string> split_words(const std::string& s) {
  std::istringstream in(s);
  std::vector<std::string> words;
  for (std::string w; in >> w;) words.push_back(w);
  return words;
}

std::string join(const std::vector<std::string>& v) {
  std::string s;
  for (auto& x : v) s += (s.empty() ? "" : " ") + x;
  return s;
}

// Opens each prefix once, even when train and valid both use it.
class Opener {
 public:
  std::shared_ptr<const IndexedDataset> open(const std::string& prefix) {
    auto& slot = open_[prefix];
    if (!slot) slot = std::make_shared<const IndexedDataset>(prefix);
    return slot;
  }

 private:
  std::map<std::string, std::shared_ptr<const IndexedDataset>> open_;
};

// One source over the given document fraction [lo, hi) of each dataset of the blend, or null
// when that range is empty for every dataset.
std::shared_ptr<const SampleSource> build_source(Opener& opener,
                                                 const std::vector<std::pair<double, std::string>>& blend,
                                                 double lo, double hi, const DataConfig& c, uint64_t seed) {
  std::vector<std::shared_ptr<const SampleSource>> parts;
  std::vector<double> weights;
  for (size_t i = 0; i < blend.size(); ++i) {
    auto data = opener.open(blend[i].second);
    uint64_t n = data->document_count();
    auto b = static_cast<uint64_t>(std::llround(lo * static_cast<double>(n)));
    auto e = static_cast<uint64_t>(std::llround(hi * static_cast<double>(n)));
    if (b >= e) {
      if (lo == 0.0) {
        throw ConfigError(fmt::format("{}: split {} leaves no training documents out of {}",
                                      blend[i].second, c.split, n));
      }
      continue;  // too small to give this dataset validation documents
    }
    // Each part of a blend shuffles with its own seed, so equal datasets do not move in step.
    parts.push_back(std::make_shared<GptDataset>(data, b, e, c.seq_length, seed + i, c.vocab_size));
    weights.push_back(blend[i].first);
  }
  if (parts.empty()) return nullptr;
  if (parts.size() == 1) return parts[0];
  return std::make_shared<BlendedDataset>(std::move(parts), std::move(weights));
}

}  // namespace

std::vector<std::pair<double, std::string>> parse_blend(const std::vector<std::string>& list) {
  if (list.empty()) throw ConfigError("data path is empty");
  std::vector<std::pair<double, std::string>> out;
  size_t numbers = 0;
  double w = 0;
  for (auto& s : list) numbers += parse_number(s, &w) ? 1 : 0;
  if (numbers == 0) {  // prefixes only: equal weights
    for (auto& s : list) out.emplace_back(1.0 / static_cast<double>(list.size()), s);
    return out;
  }
  if (list.size() % 2 != 0 || numbers != list.size() / 2) {
    throw ConfigError(fmt::format("data path '{}': expected prefixes, or weight prefix pairs "
                                  "like '0.7 a 0.3 b'",
                                  join(list)));
  }
  double total = 0;
  for (size_t i = 0; i < list.size(); i += 2) {
    if (!parse_number(list[i], &w) || !(w > 0) || !std::isfinite(w)) {
      throw ConfigError(fmt::format("data path '{}': weight '{}' must be a positive number",
                                    join(list), list[i]));
    }
    out.emplace_back(w, list[i + 1]);
    total += w;
  }
  for (auto& p : out) p.first /= total;
  return out;
}

DataIterators build_data_iterators(const DataConfig& c, int dp_rank, int dp_size) {
  if (c.seq_length < 1) throw ConfigError(fmt::format("seq_length must be >= 1, got {}", c.seq_length));
  if (c.vocab_size < 0) throw ConfigError(fmt::format("vocab_size must be >= 0, got {}", c.vocab_size));
  DataIterators it;
  auto make = [&](std::shared_ptr<const SampleSource> s) {
    return s ? std::make_unique<BatchIterator>(std::move(s), dp_rank, dp_size) : nullptr;
  };
  if (c.mock_data) {
    it.train = make(std::make_shared<MockDataset>(c.seq_length, c.seed, c.vocab_size));
    it.valid = make(std::make_shared<MockDataset>(c.seq_length, c.seed + 1, c.vocab_size));
    return it;
  }
  Opener opener;
  if (!c.test_data_path.empty()) {
    it.test = make(build_source(opener, parse_blend(split_words(c.test_data_path)), 0, 1, c, c.seed + 1));
  }
  if (!c.train_data_path.empty()) {
    if (!c.data_path.empty()) {
      throw ConfigError("data_path and train_data_path are exclusive: give one of them");
    }
    it.train = make(build_source(opener, parse_blend(split_words(c.train_data_path)), 0, 1, c, c.seed));
    if (!c.valid_data_path.empty()) {
      it.valid = make(build_source(opener, parse_blend(split_words(c.valid_data_path)), 0, 1, c, c.seed + 1));
    }
    return it;
  }
  if (c.data_path.empty()) {
    throw ConfigError("no data: set data_path, train_data_path, or mock_data");
  }
  if (!(c.split > 0.0 && c.split <= 1.0)) {
    throw ConfigError(fmt::format("split must be in (0, 1], got {}", c.split));
  }
  if (!(c.valid_end >= c.split && c.valid_end <= 1.0)) {
    throw ConfigError(fmt::format("the validation documents' end {} must lie in [split {}, 1]", c.valid_end, c.split));
  }
  auto blend = parse_blend(c.data_path);
  if (!c.valid_data_path.empty()) {  // validation comes from elsewhere: train on everything
    it.train = make(build_source(opener, blend, 0, 1, c, c.seed));
    it.valid = make(build_source(opener, parse_blend(split_words(c.valid_data_path)), 0, 1, c, c.seed + 1));
  } else {
    it.train = make(build_source(opener, blend, 0, c.split, c, c.seed));
    if (c.split < c.valid_end) it.valid = make(build_source(opener, blend, c.split, c.valid_end, c, c.seed + 1));
    if (!it.test && c.valid_end < 1.0) it.test = make(build_source(opener, blend, c.valid_end, 1.0, c, c.seed + 1));
  }
  return it;
}

}  // namespace primus::data
