// `primus data prepare` end to end: documents from text and JSON inputs, end-of-document ids,
// the train/valid split rule, identical output for any number of workers, errors naming lines.
#include "data/prepare/prepare.h"

#include <gtest/gtest.h>

#include <nlohmann/json.hpp>
#include <random>

#include "core/util/error.h"
#include "data/dataset/indexed_dataset.h"
#include "data/tokenizer/tokenizer.h"
#include "data_test_util.h"

namespace primus::data {
namespace {

std::vector<std::string> read_documents(const std::string& prefix, const Tokenizer& tok) {
  IndexedDataset ds(prefix);
  std::vector<std::string> docs;
  for (uint64_t d = 0; d < ds.document_count(); ++d) {
    std::vector<int32_t> ids(ds.document_length(d));
    ds.read(d, 0, ids.size(), ids.data(), tok.vocab_size());
    EXPECT_FALSE(ids.empty());
    EXPECT_EQ(ids.back(), tok.eod_id()) << "every document ends with end-of-document";
    ids.pop_back();
    docs.push_back(tok.decode(ids));
  }
  return docs;
}

std::string random_word(std::mt19937_64& rng) {
  static const char* parts[] = {"the", "king", "é", "中", " ", "'s", "7", ",", "\t", "Qu"};
  std::string w;
  for (int n = 1 + static_cast<int>(rng() % 8); n > 0; --n) w += parts[rng() % 10];
  return w;
}

TEST(Prepare, TextAndJsonInputsInOrder) {
  uint64_t seed = testing::fresh_seed();
  SCOPED_TRACE("seed " + std::to_string(seed));
  std::mt19937_64 rng(seed);
  testing::TempDir dir;
  std::vector<std::string> expected;
  std::string text;
  for (int i = 0; i < 30; ++i) {
    std::string line = random_word(rng) + "x";
    text += line + (i % 3 == 0 ? "\r\n" : "\n") + (i % 5 == 0 ? "\n" : "");  // CRLF, empty lines
    expected.push_back(line);
  }
  testing::write_bytes(dir / "a.txt", text);
  std::string jsonl;
  for (int i = 0; i < 20; ++i) {
    std::string doc = random_word(rng) + "\nsecond line";  // newlines stay inside a JSON document
    jsonl += nlohmann::json({{"id", i}, {"content", doc}}).dump() + "\n";
    expected.push_back(doc);
  }
  jsonl += "\n" + nlohmann::json({{"content", ""}}).dump() + "\n";  // blank line, empty doc: skipped
  testing::write_bytes(dir / "b.jsonl", jsonl);
  nlohmann::json arr = nlohmann::json::array();
  for (int i = 0; i < 5; ++i) {
    arr.push_back({{"content", "array doc " + std::to_string(i)}});
    expected.push_back("array doc " + std::to_string(i));
  }
  testing::write_bytes(dir / "c.json", arr.dump());

  PrepareOptions o;
  o.inputs = {dir / "a.txt", dir / "b.jsonl", dir / "c.json"};
  o.json_key = "content";
  o.tokenizer = "bytes";
  o.output_prefix = dir / "out/ds";
  o.progress = false;
  auto r = prepare_dataset(o);
  ASSERT_EQ(r.outputs.size(), 1u);
  EXPECT_EQ(r.outputs[0].prefix, dir / "out/ds");
  EXPECT_EQ(r.outputs[0].documents, expected.size());
  EXPECT_EQ(r.dtype, "uint16");
  auto tok = make_tokenizer("bytes");
  EXPECT_EQ(read_documents(dir / "out/ds", *tok), expected);
}

TEST(Prepare, SplitDealsDocumentsByTheRule) {
  testing::TempDir dir;
  std::mt19937_64 rng(testing::fresh_seed());
  const int n = 200 + static_cast<int>(rng() % 100);
  std::string text;
  for (int i = 0; i < n; ++i) text += "doc " + std::to_string(i) + "\n";
  testing::write_bytes(dir / "in.txt", text);
  PrepareOptions o;
  o.inputs = {dir / "in.txt"};
  o.tokenizer = "gpt2";
  o.output_prefix = dir / "ds";
  o.split = 0.9;
  o.progress = false;
  auto r = prepare_dataset(o);
  ASSERT_EQ(r.outputs.size(), 2u);
  auto tok = make_tokenizer("gpt2");
  auto train = read_documents(dir / "ds_train", *tok), valid = read_documents(dir / "ds_valid", *tok);
  std::vector<std::string> want_train, want_valid;
  for (int i = 0; i < n; ++i) {
    (is_validation_document(static_cast<uint64_t>(i), 0.9) ? want_valid : want_train).push_back("doc " + std::to_string(i));
  }
  EXPECT_EQ(train, want_train);
  EXPECT_EQ(valid, want_valid);
  EXPECT_EQ(valid.size(), static_cast<size_t>(n / 10));  // floor(n * 0.1)
  EXPECT_FALSE(is_validation_document(0, 0.9));
  EXPECT_TRUE(is_validation_document(9, 0.9));
}

TEST(Prepare, OutputDoesNotDependOnWorkers) {
  testing::TempDir dir;
  uint64_t seed = testing::fresh_seed();
  SCOPED_TRACE("seed " + std::to_string(seed));
  std::mt19937_64 rng(seed);
  std::string text;
  while (text.size() < (3u << 20)) {  // several 1 MB chunks
    for (int w = 0; w < 12; ++w) text += random_word(rng) + " ";
    text += "\n";
  }
  testing::write_bytes(dir / "in.txt", text);
  std::string bins[2], idxs[2];
  for (int k = 0; k < 2; ++k) {
    PrepareOptions o;
    o.inputs = {dir / "in.txt"};
    o.tokenizer = "gpt2";
    o.output_prefix = dir / ("w" + std::to_string(k));
    o.workers = k == 0 ? 1 : 3;
    o.progress = false;
    prepare_dataset(o);
    bins[k] = testing::read_bytes(o.output_prefix + ".bin");
    idxs[k] = testing::read_bytes(o.output_prefix + ".idx");
  }
  EXPECT_GT(bins[0].size(), text.size() / 4);
  EXPECT_TRUE(bins[0] == bins[1]);
  EXPECT_TRUE(idxs[0] == idxs[1]);
}

TEST(Prepare, BadRecordsNameFileAndLine) {
  testing::TempDir dir;
  testing::write_bytes(dir / "bad.jsonl", "{\"text\": \"ok\"}\n{\"text\": \"ok\"}\n{\"text\": oops}\n");
  testing::write_bytes(dir / "nokey.jsonl", "{\"text\": \"ok\"}\n{\"body\": \"x\"}\n");
  PrepareOptions o;
  o.tokenizer = "bytes";
  o.output_prefix = dir / "ds";
  o.progress = false;
  o.inputs = {dir / "bad.jsonl"};
  try {
    prepare_dataset(o);
    FAIL();
  } catch (const FormatError& e) {
    EXPECT_NE(std::string(e.what()).find(dir / "bad.jsonl:3"), std::string::npos) << e.what();
  }
  o.inputs = {dir / "nokey.jsonl"};
  try {
    prepare_dataset(o);
    FAIL();
  } catch (const FormatError& e) {
    EXPECT_NE(std::string(e.what()).find("nokey.jsonl:2: record has no key 'text'"), std::string::npos) << e.what();
  }
  EXPECT_FALSE(std::filesystem::exists(dir / "ds.bin")) << "a failed run leaves no dataset";
  o.inputs = {dir / "missing.txt"};
  EXPECT_THROW(prepare_dataset(o), IoError);
  o.inputs = {dir / "bad.jsonl"};
  o.split = 1.0;
  EXPECT_THROW(prepare_dataset(o), ConfigError);
}

}  // namespace
}  // namespace primus::data
