// The .bin/.idx format checked against its own rules by reading raw bytes, and every kind of
// damage refused with a FormatError naming the file and the field.
#include "data/dataset/indexed_dataset.h"

#include <gtest/gtest.h>

#include <cstring>
#include <functional>
#include <random>

#include "core/util/error.h"
#include "data_test_util.h"

namespace primus::data {
namespace {

template <class T>
T get(const std::string& bytes, size_t offset) {
  T v;
  std::memcpy(&v, bytes.data() + offset, sizeof(T));
  return v;
}
template <class T>
void set(std::string& bytes, size_t offset, T v) {
  std::memcpy(bytes.data() + offset, &v, sizeof(T));
}

using Docs = std::vector<std::vector<int32_t>>;

Docs random_docs(std::mt19937_64& rng, int n, int32_t vocab) {
  Docs docs(static_cast<size_t>(n));
  for (auto& d : docs) {
    d.resize(rng() % 50);  // empty documents included
    for (auto& t : d) t = static_cast<int32_t>(rng() % static_cast<uint64_t>(vocab));
  }
  return docs;
}

void write_docs(const std::string& prefix, DType dtype, const Docs& docs) {
  IndexedDatasetWriter w(prefix, dtype);
  for (auto& d : docs) w.add_document(d);
  w.finalize();
}

class IndexedDatasetRoundTrip : public ::testing::TestWithParam<DType> {};

TEST_P(IndexedDatasetRoundTrip, BytesFollowTheFormatAndReadBack) {
  const DType dtype = GetParam();
  uint64_t seed = testing::fresh_seed();
  SCOPED_TRACE("seed " + std::to_string(seed));
  std::mt19937_64 rng(seed);
  const int32_t vocab = dtype == DType::UInt16 ? 50257 : 128256;
  Docs docs = random_docs(rng, 1 + static_cast<int>(rng() % 200), vocab);
  testing::TempDir dir;
  const std::string prefix = dir / "ds";
  write_docs(prefix, dtype, docs);

  const std::string idx = testing::read_bytes(prefix + ".idx");
  const std::string bin = testing::read_bytes(prefix + ".bin");
  const uint64_t S = docs.size();
  const size_t isz = dtype == DType::UInt16 ? 2 : 4;
  ASSERT_EQ(idx.size(), 34 + S * 4 + S * 8 + (S + 1) * 8);
  EXPECT_EQ(idx.substr(0, 9), std::string("MMIDIDX\0\0", 9));
  EXPECT_EQ(get<uint64_t>(idx, 9), 1u);
  EXPECT_EQ(static_cast<uint8_t>(idx[17]), dtype == DType::UInt16 ? 8 : 4);
  EXPECT_EQ(get<uint64_t>(idx, 18), S);
  EXPECT_EQ(get<uint64_t>(idx, 26), S + 1);
  const size_t sizes_at = 34, ptrs_at = 34 + S * 4, docs_at = ptrs_at + S * 8;
  int64_t ptr = 0;
  for (uint64_t i = 0; i < S; ++i) {
    ASSERT_EQ(get<int32_t>(idx, sizes_at + i * 4), static_cast<int32_t>(docs[i].size()));
    ASSERT_EQ(get<int64_t>(idx, ptrs_at + i * 8), ptr);
    for (size_t t = 0; t < docs[i].size(); ++t) {  // little-endian tokens at the pointer
      int64_t v = isz == 2 ? get<uint16_t>(bin, static_cast<size_t>(ptr) + t * 2)
                           : get<int32_t>(bin, static_cast<size_t>(ptr) + t * 4);
      ASSERT_EQ(v, docs[i][t]);
    }
    ptr += static_cast<int64_t>(docs[i].size() * isz);
  }
  EXPECT_EQ(bin.size(), static_cast<size_t>(ptr));
  for (uint64_t d = 0; d <= S; ++d) ASSERT_EQ(get<int64_t>(idx, docs_at + d * 8), static_cast<int64_t>(d));

  IndexedDataset ds(prefix);
  EXPECT_EQ(ds.dtype(), dtype);
  EXPECT_EQ(ds.sequence_count(), S);
  EXPECT_EQ(ds.document_count(), S);
  uint64_t total = 0;
  for (uint64_t i = 0; i < S; ++i) {
    std::vector<int32_t> got(docs[i].size());
    ds.read(i, 0, got.size(), got.data(), vocab);
    ASSERT_EQ(got, docs[i]);
    ASSERT_EQ(ds.document_length(i), docs[i].size());
    total += docs[i].size();
    if (docs[i].size() > 2) {  // a window inside the sequence
      std::vector<int32_t> mid(docs[i].size() - 2);
      ds.read(i, 1, mid.size(), mid.data());
      ASSERT_EQ(mid, std::vector<int32_t>(docs[i].begin() + 1, docs[i].end() - 1));
    }
  }
  EXPECT_EQ(ds.total_tokens(), total);
  ds.check_token_range(vocab);
}
INSTANTIATE_TEST_SUITE_P(Dtypes, IndexedDatasetRoundTrip, ::testing::Values(DType::UInt16, DType::Int32));

TEST(IndexedDataset, DtypeForVocabFollowsMegatron) {
  EXPECT_EQ(dtype_for_vocab(256), DType::UInt16);
  EXPECT_EQ(dtype_for_vocab(50257), DType::UInt16);
  EXPECT_EQ(dtype_for_vocab(65499), DType::UInt16);
  EXPECT_EQ(dtype_for_vocab(65500), DType::Int32);
  EXPECT_EQ(dtype_for_vocab(128256), DType::Int32);
}

TEST(IndexedDataset, WriterRefusesTokensThatDoNotFit) {
  testing::TempDir dir;
  IndexedDatasetWriter w(dir / "ds", DType::UInt16);
  std::vector<int32_t> doc = {1, 70000};
  EXPECT_THROW(w.add_document(doc), RuntimeError);
}

TEST(IndexedDataset, UnfinishedWriterLeavesNothingUnderTheFinalNames) {
  testing::TempDir dir;
  {
    IndexedDatasetWriter w(dir / "ds", DType::UInt16);
    std::vector<int32_t> doc = {1, 2, 3};
    w.add_document(doc);
  }
  EXPECT_FALSE(std::filesystem::exists(dir / "ds.bin"));
  EXPECT_FALSE(std::filesystem::exists(dir / "ds.idx"));
  EXPECT_TRUE(std::filesystem::is_empty(dir.path()));
}

// Megatron allows several sequences per document (sentence splitting); documents span them.
TEST(IndexedDataset, ReadsDocumentsOfSeveralSequences) {
  testing::TempDir dir;
  const std::string prefix = dir / "multi";
  const std::vector<int32_t> lens = {2, 3, 1};
  const std::vector<int64_t> doc_idx = {0, 2, 3};  // document 0 = sequences 0-1, document 1 = 2
  std::string idx("MMIDIDX\0\0", 9);
  auto app = [&](auto v) { idx.append(reinterpret_cast<const char*>(&v), sizeof(v)); };
  app(uint64_t{1});
  app(uint8_t{8});
  app(uint64_t{3});
  app(uint64_t{3});
  for (int32_t l : lens) app(l);
  for (int64_t p : {0, 4, 10}) app(int64_t{p});
  for (int64_t d : doc_idx) app(d);
  testing::write_bytes(prefix + ".idx", idx);
  std::string bin;
  for (uint16_t t : {10, 11, 20, 21, 22, 30}) bin.append(reinterpret_cast<const char*>(&t), 2);
  testing::write_bytes(prefix + ".bin", bin);
  IndexedDataset ds(prefix);
  EXPECT_EQ(ds.document_count(), 2u);
  EXPECT_EQ(ds.sequence_count(), 3u);
  EXPECT_EQ(ds.document_length(0), 5u);
  EXPECT_EQ(ds.document_length(1), 1u);
}

// --- damage -------------------------------------------------------------------------------

struct Damage {
  std::string name;
  bool in_bin;             // the error must name the .bin (else the .idx)
  std::string field;       // and contain this
  std::function<void(std::string& idx, std::string& bin, uint64_t S)> apply;
};

class DamagedDataset : public ::testing::TestWithParam<Damage> {};

TEST_P(DamagedDataset, IsRefusedNamingFileAndField) {
  const Damage& dmg = GetParam();
  std::mt19937_64 rng(testing::fresh_seed());
  Docs docs = random_docs(rng, 20, 1000);
  docs[3] = {5, 6, 7, 8};  // documents 3 and 4 are never empty
  docs[4] = {9, 10};
  testing::TempDir dir;
  const std::string prefix = dir / "ds";
  write_docs(prefix, DType::UInt16, docs);
  std::string idx = testing::read_bytes(prefix + ".idx"), bin = testing::read_bytes(prefix + ".bin");
  dmg.apply(idx, bin, docs.size());
  testing::write_bytes(prefix + ".idx", idx);
  testing::write_bytes(prefix + ".bin", bin);
  try {
    IndexedDataset ds(prefix);
    FAIL() << "damage not detected: " << dmg.name;
  } catch (const FormatError& e) {
    std::string msg = e.what();
    EXPECT_NE(msg.find(prefix + (dmg.in_bin ? ".bin" : ".idx")), std::string::npos) << msg;
    EXPECT_NE(msg.find(dmg.field), std::string::npos) << msg;
  }
}

const size_t kPtrs = 34 + 20 * 4;   // pointer array of the 20-document dataset above
const size_t kDocs = kPtrs + 20 * 8;

INSTANTIATE_TEST_SUITE_P(
    Kinds, DamagedDataset,
    ::testing::Values(
        Damage{"magic", false, "magic", [](std::string& i, std::string&, uint64_t) { i[3] = 'X'; }},
        Damage{"version", false, "version is 2", [](std::string& i, std::string&, uint64_t) { set<uint64_t>(i, 9, 2); }},
        Damage{"dtype", false, "dtype code 9", [](std::string& i, std::string&, uint64_t) { i[17] = 9; }},
        Damage{"float", false, "float32", [](std::string& i, std::string&, uint64_t) { i[17] = 7; }},
        Damage{"short header", false, "truncated header", [](std::string& i, std::string&, uint64_t) { i.resize(20); }},
        Damage{"truncated idx", false, "truncated", [](std::string& i, std::string&, uint64_t) { i.resize(i.size() - 5); }},
        Damage{"count", false, "sequence_count", [](std::string& i, std::string&, uint64_t) { set<uint64_t>(i, 18, 1ull << 62); }},
        Damage{"negative length", false, "sequence_lengths[3]", [](std::string& i, std::string&, uint64_t) { set<int32_t>(i, 34 + 3 * 4, -4); }},
        Damage{"pointer order", false, "sequence_pointers[4]",
               [](std::string& i, std::string&, uint64_t) { set<int64_t>(i, kPtrs + 4 * 8, get<int64_t>(i, kPtrs + 3 * 8)); }},
        Damage{"odd pointer", false, "sequence_pointers[4]",
               [](std::string& i, std::string&, uint64_t) { set<int64_t>(i, kPtrs + 4 * 8, get<int64_t>(i, kPtrs + 4 * 8) + 1); }},
        Damage{"truncated bin", true, "truncated .bin", [](std::string&, std::string& b, uint64_t) { b.resize(b.size() - 1); }},
        Damage{"doc order", false, "document_indices[5]",
               [](std::string& i, std::string&, uint64_t) { set<int64_t>(i, kDocs + 5 * 8, 2); }},
        Damage{"doc start", false, "document_indices[0]", [](std::string& i, std::string&, uint64_t) { set<int64_t>(i, kDocs, 1); }},
        Damage{"doc end", false, "document_indices[20]",
               [](std::string& i, std::string&, uint64_t) { set<int64_t>(i, kDocs + 20 * 8, 19); }}),
    [](const auto& info) {
      std::string n = info.param.name;
      for (auto& c : n) c = std::isalnum(static_cast<unsigned char>(c)) ? c : '_';
      return n;
    });

TEST(IndexedDataset, MissingFilesAreIoErrors) {
  testing::TempDir dir;
  EXPECT_THROW(IndexedDataset(dir / "none"), IoError);
}

TEST(IndexedDataset, TokenOutsideTheVocabularyNamesFileAndDocument) {
  testing::TempDir dir;
  const std::string prefix = dir / "ds";
  Docs docs = {{1, 2}, {3, 4, 5}, {6}, {7, 999, 8}};
  write_docs(prefix, DType::UInt16, docs);
  IndexedDataset ds(prefix);
  std::vector<int32_t> out(3);
  ds.read(3, 0, 3, out.data());  // no vocabulary given: no check
  EXPECT_EQ(out, (std::vector<int32_t>{7, 999, 8}));
  try {
    ds.read(3, 0, 3, out.data(), 500);
    FAIL();
  } catch (const FormatError& e) {
    std::string msg = e.what();
    EXPECT_NE(msg.find(prefix + ".bin"), std::string::npos) << msg;
    EXPECT_NE(msg.find("document 3"), std::string::npos) << msg;
    EXPECT_NE(msg.find("999"), std::string::npos) << msg;
  }
  EXPECT_THROW(ds.check_token_range(500), FormatError);
  EXPECT_NO_THROW(ds.check_token_range(1000));
}

}  // namespace
}  // namespace primus::data
