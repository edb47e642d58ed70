// The GPT loader: samples are windows of a stream of shuffled documents, the order is fixed by
// the seed, resuming from state() continues exactly, data-parallel ranks split each global
// batch, blends follow their weights, mock data is deterministic and vocab-bounded.
#include <gtest/gtest.h>

#include <algorithm>
#include <map>
#include <numeric>
#include <random>
#include <set>

#include "core/util/error.h"
#include "data/dataset/batch_iterator.h"
#include "data/dataset/blended_dataset.h"
#include "data/dataset/data_config.h"
#include "data/dataset/gpt_dataset.h"
#include "data/dataset/indexed_dataset.h"
#include "data/dataset/mock_dataset.h"
#include "data_test_util.h"

namespace primus::data {
namespace {

// Token = kStride * (base + document) + position: every token says where it came from.
constexpr int32_t kStride = 100;

struct Corpus {
  std::string prefix;
  std::vector<int> lengths;  // tokens per document, 1..60
};

Corpus make_corpus(const testing::TempDir& dir, const std::string& name, int docs, std::mt19937_64& rng,
                   int base = 0) {
  Corpus c{dir / name, {}};
  IndexedDatasetWriter w(c.prefix, DType::Int32);
  for (int d = 0; d < docs; ++d) {
    int len = 1 + static_cast<int>(rng() % 60);
    std::vector<int32_t> toks(static_cast<size_t>(len));
    for (int p = 0; p < len; ++p) toks[static_cast<size_t>(p)] = kStride * (base + d) + p;
    c.lengths.push_back(len);
    w.add_document(toks);
  }
  w.finalize();
  return c;
}

std::vector<int32_t> sample_of(const SampleSource& s, uint64_t i) {
  std::vector<int32_t> out(static_cast<size_t>(s.seq_length()) + 1);
  s.sample(i, out.data());
  return out;
}

class Loader : public ::testing::Test {
 protected:
  void SetUp() override {
    seed_ = testing::fresh_seed();
    rng_.seed(seed_);
    corpus_ = make_corpus(dir_, "corpus", 100, rng_);
    data_ = std::make_shared<const IndexedDataset>(corpus_.prefix);
  }
  std::shared_ptr<GptDataset> gpt(int seq, uint64_t seed) {
    return std::make_shared<GptDataset>(data_, 0, data_->document_count(), seq, seed);
  }
  std::string trace() const { return "seed " + std::to_string(seed_); }

  uint64_t seed_ = 0;
  std::mt19937_64 rng_;
  testing::TempDir dir_;
  Corpus corpus_;
  std::shared_ptr<const IndexedDataset> data_;
};

TEST_F(Loader, SamplesAreWindowsOfAStreamOfShuffledEpochs) {
  SCOPED_TRACE(trace());
  const int L = 16;
  auto ds = gpt(L, 7);
  const uint64_t T = ds->tokens_per_epoch(), B = ds->samples_per_block();
  ASSERT_EQ(B, T / L);
  // Three blocks of samples cover the stream's first two epochs.
  std::map<uint64_t, std::vector<int32_t>> by_start;
  for (uint64_t i = 0; i < 3 * B; ++i) {
    uint64_t start = ds->sample_start(i);
    ASSERT_EQ(start % L, 0u);
    ASSERT_TRUE(by_start.emplace(start, sample_of(*ds, i)).second) << "sample start visited twice";
  }
  ASSERT_EQ(by_start.size(), 3 * B);
  ASSERT_EQ(by_start.rbegin()->first, (3 * B - 1) * L);  // the blocks are permutations
  std::vector<int32_t> stream;
  for (auto& [start, s] : by_start) {
    if (!stream.empty()) {
      ASSERT_EQ(stream.back(), s[0]) << "consecutive samples share one token";
    }
    stream.insert(stream.end(), s.begin() + (stream.empty() ? 0 : 1), s.end());
  }
  ASSERT_GE(stream.size(), 2 * T);
  std::vector<int> order[2];
  for (int e = 0; e < 2; ++e) {
    // Each epoch holds every document once, whole and in order inside, docs back to back.
    size_t at = static_cast<size_t>(e) * T;
    while (at < static_cast<size_t>(e + 1) * T) {
      int doc = stream[at] / kStride;
      ASSERT_EQ(stream[at] % kStride, 0) << "a document starts at its first token";
      for (int p = 0; p < corpus_.lengths[static_cast<size_t>(doc)]; ++p) {
        ASSERT_EQ(stream[at + static_cast<size_t>(p)], doc * kStride + p);
      }
      order[e].push_back(doc);
      at += static_cast<size_t>(corpus_.lengths[static_cast<size_t>(doc)]);
    }
    std::vector<int> sorted = order[e];
    std::sort(sorted.begin(), sorted.end());
    for (int d = 0; d < 100; ++d) ASSERT_EQ(sorted[static_cast<size_t>(d)], d);
  }
  EXPECT_NE(order[0], order[1]) << "each epoch has its own document order";
  std::vector<int> identity(100);
  std::iota(identity.begin(), identity.end(), 0);
  EXPECT_NE(order[0], identity);
  // And the visiting order is shuffled, not the stream order.
  EXPECT_NE(ds->sample_start(1), static_cast<uint64_t>(L));
}

TEST_F(Loader, SeedFixesTheOrder) {
  SCOPED_TRACE(trace());
  auto a = gpt(32, 11), b = gpt(32, 11), c = gpt(32, 12);
  bool differs = false;
  for (uint64_t i = 0; i < 200; ++i) {
    ASSERT_EQ(sample_of(*a, i), sample_of(*b, i));
    differs |= sample_of(*a, i) != sample_of(*c, i);
  }
  EXPECT_TRUE(differs);
}

TEST_F(Loader, ResumeFromStateGivesTheSameNextBatches) {
  SCOPED_TRACE(trace());
  const int L = 24, batch = 3;
  std::vector<int32_t> buf(static_cast<size_t>(batch) * (L + 1));
  BatchIterator it(gpt(L, 5));
  // Run past a few epochs so that the state holds more than a block.
  const int warm = 2 + static_cast<int>(rng_() % 200);
  for (int s = 0; s < warm; ++s) it.next_batch(batch, buf.data());
  std::string saved = it.state().dump();
  std::vector<std::vector<int32_t>> expected;
  for (int s = 0; s < 20; ++s) {
    it.next_batch(batch, buf.data());
    expected.push_back(buf);
  }
  BatchIterator resumed(gpt(L, 5));  // a fresh process: new dataset, new caches
  resumed.load_state(nlohmann::json::parse(saved));
  EXPECT_EQ(resumed.position(), static_cast<uint64_t>(warm * batch));
  for (int s = 0; s < 20; ++s) {
    resumed.next_batch(batch, buf.data());
    ASSERT_EQ(buf, expected[static_cast<size_t>(s)]) << "batch " << s << " after resume";
  }
  // A state from other data is refused.
  BatchIterator other(gpt(L, 6));
  EXPECT_THROW(other.load_state(nlohmann::json::parse(saved)), ConfigError);
  EXPECT_THROW(other.load_state(nlohmann::json{{"position", 3}}), ConfigError);
}

TEST_F(Loader, DataParallelRanksSplitEachGlobalBatch) {
  SCOPED_TRACE(trace());
  const int L = 8, batch = 2, dp = 4;
  auto source = gpt(L, 3);
  BatchIterator global(source, 0, 1);
  std::vector<BatchIterator> ranks;
  for (int r = 0; r < dp; ++r) ranks.emplace_back(source, r, dp);
  const size_t row = L + 1;
  std::vector<int32_t> all(batch * dp * row), mine(batch * row);
  for (int step = 0; step < 10; ++step) {
    global.next_batch(batch * dp, all.data());
    std::set<std::vector<int32_t>> rows_of_ranks, rows_of_global;
    for (int r = 0; r < dp; ++r) {
      ranks[static_cast<size_t>(r)].next_batch(batch, mine.data());
      // Rank r's rows are rows [r*batch, (r+1)*batch) of the global batch.
      ASSERT_TRUE(std::equal(mine.begin(), mine.end(), all.begin() + static_cast<long>(r * batch * row)));
      for (int i = 0; i < batch; ++i) {
        rows_of_ranks.emplace(mine.begin() + static_cast<long>(i * row), mine.begin() + static_cast<long>((i + 1) * row));
      }
    }
    for (int i = 0; i < batch * dp; ++i) {
      rows_of_global.emplace(all.begin() + static_cast<long>(i * row), all.begin() + static_cast<long>((i + 1) * row));
    }
    EXPECT_EQ(rows_of_ranks.size(), static_cast<size_t>(batch * dp)) << "slices are disjoint";
    EXPECT_EQ(rows_of_ranks, rows_of_global) << "and cover the global batch";
    for (auto& r : ranks) ASSERT_EQ(r.position(), global.position());
  }
  // The saved position is global: a run may resume with another dp size.
  BatchIterator two(source, 1, 2);
  two.load_state(ranks[3].state());
  global.next_batch(batch * 2, all.data());
  two.next_batch(batch, mine.data());
  EXPECT_TRUE(std::equal(mine.begin(), mine.end(), all.begin() + static_cast<long>(batch * row)));
  EXPECT_THROW(BatchIterator(source, 2, 2), ConfigError);
}

TEST_F(Loader, BlendFollowsTheWeights) {
  SCOPED_TRACE(trace());
  Corpus other = make_corpus(dir_, "other", 40, rng_, /*base=*/1000);
  auto a = gpt(16, 1);
  auto b = std::make_shared<GptDataset>(std::make_shared<const IndexedDataset>(other.prefix), 0, 40, 16, 2);
  BlendedDataset blend({a, b}, {0.7, 0.3});
  EXPECT_DOUBLE_EQ(blend.weights()[0], 0.7);
  const uint64_t n = 10000;
  auto counts = blend.counts(n);
  EXPECT_NEAR(static_cast<double>(counts[0]), 0.7 * n, 1.0);
  EXPECT_NEAR(static_cast<double>(counts[1]), 0.3 * n, 1.0);
  EXPECT_EQ(counts[0] + counts[1], n);
  // Every prefix of the schedule is close to the weights, and samples come from where
  // locate() says, in each part's own order.
  uint64_t from_b = 0;
  std::vector<uint64_t> next_local(2, 0);
  for (uint64_t i = 0; i < 2000; ++i) {
    auto [part, local] = blend.locate(i);
    ASSERT_EQ(local, next_local[part]++);
    auto s = sample_of(blend, i);
    bool is_b = s[0] / kStride >= 1000;
    ASSERT_EQ(is_b, part == 1);
    ASSERT_EQ(s, sample_of(part == 0 ? static_cast<const SampleSource&>(*a) : *b, local));
    from_b += is_b;
    ASSERT_LE(std::abs(static_cast<double>(from_b) - 0.3 * static_cast<double>(i + 1)), 1.0);
  }
  // Past one period the schedule repeats with the parts' indices running on.
  auto [p0, l0] = blend.locate(5);
  auto [p1, l1] = blend.locate(5 + BlendedDataset::kPeriod);
  EXPECT_EQ(p0, p1);
  EXPECT_EQ(l1, l0 + blend.counts(BlendedDataset::kPeriod)[p0]);
  EXPECT_THROW(BlendedDataset({a, b}, {1.0, 0.0}), ConfigError);
  EXPECT_THROW(BlendedDataset({a, gpt(8, 1)}, {1.0, 1.0}), ConfigError);
}

TEST(MockData, DeterministicAndVocabBounded) {
  uint64_t seed = testing::fresh_seed();
  SCOPED_TRACE("seed " + std::to_string(seed));
  const int vocab = 1000 + static_cast<int>(seed % 50000);
  MockDataset a(64, seed, vocab), b(64, seed, vocab), c(64, seed + 1, vocab);
  std::set<int32_t> distinct;
  size_t drawn = 0;
  for (uint64_t i = 0; i < 50; ++i) {
    auto s = sample_of(a, i);
    ASSERT_EQ(s, sample_of(b, i));
    ASSERT_NE(s, sample_of(c, i));
    for (int32_t t : s) {
      ASSERT_GE(t, 0);
      ASSERT_LT(t, vocab);
      distinct.insert(t);
    }
    drawn += s.size();
  }
  // Spread over the vocabulary, not a constant: uniform draws give about V(1 - e^(-n/V)) distinct
  // tokens (~960 for the smallest vocabulary here, ~3,100 for the largest); half of min(V, n) is a
  // floor no seed comes near. (A fixed 1000 failed for vocabularies under ~1,060.)
  EXPECT_GT(distinct.size(), std::min<size_t>(static_cast<size_t>(vocab), drawn) / 2);
  DataConfig cfg;
  cfg.mock_data = true;
  cfg.seq_length = 64;
  cfg.seed = seed;
  cfg.vocab_size = vocab;
  auto its = build_data_iterators(cfg);
  ASSERT_TRUE(its.train && its.valid);
  std::vector<int32_t> buf(65);
  its.train->next_batch(1, buf.data());
  EXPECT_EQ(buf, sample_of(a, 0));
  cfg.vocab_size = 0;
  EXPECT_THROW(build_data_iterators(cfg), ConfigError);
}

TEST_F(Loader, ConfigSplitsDocumentsBetweenTrainAndValid) {
  SCOPED_TRACE(trace());
  DataConfig cfg;
  cfg.data_path = {corpus_.prefix};
  cfg.split = 0.8;
  cfg.seq_length = 16;
  cfg.seed = 9;
  auto its = build_data_iterators(cfg);
  ASSERT_TRUE(its.train && its.valid);
  std::vector<int32_t> buf(17 * 4);
  std::set<int> train_docs, valid_docs;
  for (int s = 0; s < 200; ++s) {
    its.train->next_batch(4, buf.data());
    for (int32_t t : buf) train_docs.insert(t / kStride);
    its.valid->next_batch(4, buf.data());
    for (int32_t t : buf) valid_docs.insert(t / kStride);
  }
  EXPECT_EQ(*train_docs.rbegin(), 79);  // documents [0, 80) train, [80, 100) validate
  EXPECT_EQ(train_docs.size(), 80u);
  EXPECT_EQ(*valid_docs.begin(), 80);
  EXPECT_EQ(valid_docs.size(), 20u);

  cfg.split = 1.0;
  EXPECT_FALSE(build_data_iterators(cfg).valid);
  // Separate train / valid data, the valid one a weighted blend string.
  DataConfig sep;
  sep.train_data_path = corpus_.prefix;
  sep.valid_data_path = "0.5 " + corpus_.prefix + " 0.5 " + corpus_.prefix;
  sep.seq_length = 16;
  auto its2 = build_data_iterators(sep);
  ASSERT_TRUE(its2.train && its2.valid);
  EXPECT_EQ(its2.valid->source().describe()["type"], "blend");
  // data_path with valid_data_path: split is not used, training takes every document.
  DataConfig both;
  both.data_path = {corpus_.prefix};
  both.valid_data_path = corpus_.prefix;
  both.split = 0.5;
  both.seq_length = 16;
  auto its3 = build_data_iterators(both);
  EXPECT_EQ(its3.train->source().describe()["documents"], nlohmann::json({0, 100}));
  EXPECT_EQ(its.train->source().describe()["documents"], nlohmann::json({0, 80}));
  EXPECT_FALSE(its.test) << "no test part, no test_data_path";
  // Megatron-LM's test part: validation ends before the last documents, which neither side reads;
  // they are the test data.
  cfg.split = 0.8;
  cfg.valid_end = 0.95;
  auto its4 = build_data_iterators(cfg);
  ASSERT_TRUE(its4.train && its4.valid && its4.test);
  EXPECT_EQ(its4.train->source().describe()["documents"], nlohmann::json({0, 80}));
  EXPECT_EQ(its4.valid->source().describe()["documents"], nlohmann::json({80, 95}));
  EXPECT_EQ(its4.test->source().describe()["documents"], nlohmann::json({95, 100}));
  std::set<int> test_docs;
  for (int s = 0; s < 50; ++s) {
    its4.test->next_batch(4, buf.data());
    for (int32_t t : buf) test_docs.insert(t / kStride);
  }
  EXPECT_EQ(test_docs, (std::set<int>{95, 96, 97, 98, 99}));
  // test_data_path wins over the split's test part.
  cfg.test_data_path = "0.5 " + corpus_.prefix + " 0.5 " + corpus_.prefix;
  auto its5 = build_data_iterators(cfg);
  ASSERT_TRUE(its5.test);
  EXPECT_EQ(its5.test->source().describe()["type"], "blend");
  cfg.test_data_path.clear();
  cfg.valid_end = 0.8;  // "80,0,20": no validation documents
  EXPECT_FALSE(build_data_iterators(cfg).valid);
  EXPECT_TRUE(build_data_iterators(cfg).test);
  cfg.valid_end = 0.7;
  EXPECT_THROW(build_data_iterators(cfg), ConfigError);
}

TEST_F(Loader, ConfigErrors) {
  DataConfig cfg;
  cfg.seq_length = 16;
  EXPECT_THROW(build_data_iterators(cfg), ConfigError);  // no data
  cfg.data_path = {corpus_.prefix};
  cfg.train_data_path = corpus_.prefix;
  EXPECT_THROW(build_data_iterators(cfg), ConfigError);  // both
  cfg.train_data_path.clear();
  cfg.split = 1.5;
  EXPECT_THROW(build_data_iterators(cfg), ConfigError);
  cfg.split = 0.001;  // no training document left
  EXPECT_THROW(build_data_iterators(cfg), ConfigError);
  cfg.split = 1.0;
  cfg.data_path = {"0.5", corpus_.prefix, corpus_.prefix};
  EXPECT_THROW(build_data_iterators(cfg), ConfigError);
  cfg.data_path = {dir_ / "missing"};
  EXPECT_THROW(build_data_iterators(cfg), IoError);
  auto blend = parse_blend({"3", "a", "1", "b"});
  ASSERT_EQ(blend.size(), 2u);
  EXPECT_DOUBLE_EQ(blend[0].first, 0.75);
  EXPECT_EQ(blend[1].second, "b");
  auto equal = parse_blend({"a", "b"});
  EXPECT_DOUBLE_EQ(equal[1].first, 0.5);
}

TEST_F(Loader, TokensOutsideTheVocabularyStopTheLoader) {
  DataConfig cfg;
  cfg.data_path = {corpus_.prefix};
  cfg.seq_length = 16;
  cfg.vocab_size = 50 * kStride;  // documents 50 and up hold larger ids
  auto its = build_data_iterators(cfg);
  std::vector<int32_t> buf(17 * 8);
  try {
    for (int s = 0; s < 1000; ++s) its.train->next_batch(8, buf.data());
    FAIL() << "no error";
  } catch (const FormatError& e) {
    std::string msg = e.what();
    EXPECT_NE(msg.find(corpus_.prefix + ".bin"), std::string::npos) << msg;
    EXPECT_NE(msg.find("document"), std::string::npos) << msg;
  }
}

}  // namespace
}  // namespace primus::data
