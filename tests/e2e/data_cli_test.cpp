// `primus data encode | prepare | inspect` through the real binary (issue [data], Build 2 and 3):
// the ids printed as JSON, a JSONL input with --json-key, --split and --workers, the written
// .bin/.idx read back by `data inspect`, and bad input named with its exit code.
#include <gtest/gtest.h>

#include <filesystem>

#include "cli_runner.h"

using primus::testing::run_primus;
using primus::testing::Workdir;

namespace {
bool has(const std::string& out, const std::string& part) { return out.find(part) != std::string::npos; }
}  // namespace

TEST(DataCli, EncodePrintsTheIdsAsJson) {
  auto r = run_primus("data encode --tokenizer gpt2 --text 'Hello world'");
  EXPECT_EQ(r.code, 0) << r.out;
  EXPECT_EQ(r.out, "[15496,995]\n");
  auto b = run_primus("data encode --tokenizer bytes --text 'Hi'");
  EXPECT_EQ(b.code, 0) << b.out;
  EXPECT_EQ(b.out, "[72,105]\n");
}

TEST(DataCli, PrepareJsonlWithSplitAndWorkersThenInspect) {
  Workdir w;
  auto in = w.write("docs.jsonl", "{\"body\": \"Hello world\"}\n{\"body\": \"second doc\"}\n{\"body\": \"third\"}\n"
                                  "{\"body\": \"fourth one\"}\n");
  const std::string prefix = w.str() + "/out";
  auto p = run_primus("data prepare --input " + in.string() + " --json-key body --tokenizer gpt2 --output-prefix " +
                      prefix + " --split 0.5 --workers 2");
  ASSERT_EQ(p.code, 0) << p.out;
  EXPECT_TRUE(has(p.out, "out_train.bin/.idx")) << p.out;
  EXPECT_TRUE(has(p.out, "out_valid.bin/.idx")) << p.out;
  for (auto s : {"_train.bin", "_train.idx", "_valid.bin", "_valid.idx"})
    EXPECT_TRUE(std::filesystem::exists(prefix + s)) << s;

  auto i = run_primus("data inspect " + prefix + "_train --tokenizer gpt2");
  ASSERT_EQ(i.code, 0) << i.out;
  EXPECT_TRUE(has(i.out, "dtype      uint16")) << i.out;
  EXPECT_TRUE(has(i.out, "[15496,995,50256]")) << i.out;  // end-of-text appended to each document
  EXPECT_TRUE(has(i.out, "\"Hello world<|endoftext|>\"")) << i.out;
  EXPECT_TRUE(has(i.out, "all below the vocabulary size of 50257")) << i.out;
}

TEST(DataCli, BadInputIsNamedWithItsExitCode) {
  Workdir w;
  auto r = run_primus("data encode --tokenizer nope --text x");
  EXPECT_EQ(r.code, 2) << r.out;
  EXPECT_TRUE(has(r.out, "unknown tokenizer 'nope'")) << r.out;
  auto bad = w.write("bad.jsonl", "{\"text\": \"a\"}\n{\"txt\": \"b\"}\n");
  auto b = run_primus("data prepare --input " + bad.string() + " --tokenizer gpt2 --output-prefix " + w.str() + "/b");
  EXPECT_EQ(b.code, 3) << b.out;
  EXPECT_TRUE(has(b.out, "bad.jsonl:2: record has no key 'text'")) << b.out;
  EXPECT_FALSE(std::filesystem::exists(w.str() + "/b.bin"));
  auto m = run_primus("data inspect " + w.str() + "/missing");
  EXPECT_EQ(m.code, 3) << m.out;
  EXPECT_TRUE(has(m.out, "/missing.idx")) << m.out;
  EXPECT_FALSE(has(m.out, "terminate called")) << m.out;
}
