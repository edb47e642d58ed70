// primus generate through the binary on the CPU reference backend: token ids in and out, a batch
// of prompts (each one's tokens as when run alone), text prompts equal to their byte ids, top-p
// sampling reproducible from its seed, prompts from a file, and bad input refused naming it.
// (The cuda engine's own tests: tests/cuda_gpu/generate_*; docs/generate.md.)
#include <gtest/gtest.h>

#include <fstream>
#include <nlohmann/json.hpp>
#include <sstream>

#include "cli_runner.h"

using primus::testing::run_primus;
using primus::testing::tiny_run_args;
using primus::testing::Workdir;

namespace {

// The "ids" of each JSON line of --print-ids output, in order.
std::vector<std::vector<int>> ids_of(const std::string& out) {
  std::vector<std::vector<int>> r;
  std::istringstream in(out);
  for (std::string line; std::getline(in, line);)
    if (!line.empty() && line[0] == '{') r.push_back(nlohmann::json::parse(line)["ids"].get<std::vector<int>>());
  return r;
}

TEST(GenerateE2E, PromptsIdsBatchesTopPAndErrors) {
  Workdir w;
  ASSERT_EQ(run_primus(tiny_run_args(w.str()) + " train_iters=4 save_interval=4").code, 0);
  const std::string ck = (w.path() / "local/local/shakespeare/checkpoints").string();
  const std::string gen = "generate -c " + ck + " --backend reference ";
  // Greedy: a batch of two id prompts gives each the tokens it gets alone; text "RO" is bytes 82,79.
  auto batch = run_primus(gen + "--prompt-ids 82,79 --prompt-ids 65 -n 6 -t 0 --ignore-eod --print-ids");
  ASSERT_EQ(batch.code, 0) << batch.out;
  const auto b = ids_of(batch.out);
  ASSERT_EQ(b.size(), 2u) << batch.out;
  EXPECT_EQ(b[0].size(), 6u);
  auto alone = run_primus(gen + "--prompt-ids 65 -n 6 -t 0 --ignore-eod --print-ids");
  ASSERT_EQ(ids_of(alone.out), std::vector<std::vector<int>>{b[1]}) << alone.out;
  auto text = run_primus(gen + "--prompt RO -n 6 -t 0 --ignore-eod --print-ids");
  ASSERT_EQ(ids_of(text.out), std::vector<std::vector<int>>{b[0]}) << text.out;
  // Top-p sampling: the same seed gives the same tokens.
  const std::string sampled = gen + "--prompt-ids 82,79 -n 12 -t 0.9 --top-k 20 --top-p 0.8 --ignore-eod --print-ids --seed 5";
  auto s1 = run_primus(sampled), s2 = run_primus(sampled);
  ASSERT_EQ(s1.code, 0) << s1.out;
  EXPECT_EQ(ids_of(s1.out), ids_of(s2.out));
  EXPECT_EQ(ids_of(s1.out).at(0).size(), 12u);
  // Prompts from a file, one per line: one text per prompt, numbered.
  {
    std::ofstream f(w.path() / "prompts.txt");
    f << "ROMEO:\n\nJULIET:\n";
  }
  auto file = run_primus(gen + "--prompts-file " + (w.path() / "prompts.txt").string() + " -n 4 -t 0");
  ASSERT_EQ(file.code, 0) << file.out;
  EXPECT_NE(file.out.find("[0] ROMEO:"), std::string::npos) << file.out;
  EXPECT_NE(file.out.find("[1] JULIET:"), std::string::npos) << file.out;
  // Bad input: named.
  auto bad_id = run_primus(gen + "--prompt-ids 82,x");
  EXPECT_NE(bad_id.code, 0);
  EXPECT_NE(bad_id.out.find("'x'"), std::string::npos) << bad_id.out;
  auto vocab = run_primus(gen + "--prompt-ids 82,999");
  EXPECT_NE(vocab.code, 0);
  EXPECT_NE(vocab.out.find("999"), std::string::npos) << vocab.out;
  auto top_p = run_primus(gen + "--prompt RO --top-p 0");
  EXPECT_NE(top_p.code, 0);
  EXPECT_NE(top_p.out.find("top_p"), std::string::npos) << top_p.out;
  auto none = run_primus(gen + "-n 3");
  EXPECT_NE(none.code, 0);
  EXPECT_NE(none.out.find("--prompt"), std::string::npos) << none.out;
}

}  // namespace
