// Replays every file of fuzz/corpus/<target>/ (the seeds, and every input that fuzzing found
// to crash, kept as a regression) through the fuzz targets, in every build: a finding fails the
// test naming the file, a crash or sanitizer report fails the binary.
#include <gtest/gtest.h>

#include <algorithm>
#include <fstream>
#include <set>

#include "fuzz/fuzz_target.h"

namespace primus::fuzz {
namespace {

namespace fsys = std::filesystem;

fsys::path corpus_root() { return fsys::path(PRIMUS_SOURCE_DIR) / "fuzz" / "corpus"; }

std::vector<std::string> target_names() {
  std::vector<std::string> n;
  for (auto& t : targets()) n.push_back(t.name);
  std::sort(n.begin(), n.end());
  return n;
}

TEST(FuzzCorpus, EveryTargetHasACorpusAndEveryCorpusATarget) {
  std::set<std::string> dirs;
  for (auto& e : fsys::directory_iterator(corpus_root())) dirs.insert(e.path().filename().string());
  auto names = target_names();
  EXPECT_EQ(std::set<std::string>(names.begin(), names.end()), dirs);
  EXPECT_GE(names.size(), 6u);
}

class FuzzCorpusReplay : public ::testing::TestWithParam<std::string> {};

TEST_P(FuzzCorpusReplay, EveryInputIsHandled) {
  set_throw_findings(true);
  auto& all = targets();
  auto it = std::find_if(all.begin(), all.end(), [&](const Target& t) { return GetParam() == t.name; });
  ASSERT_NE(it, all.end());
  std::vector<fsys::path> files;
  for (auto& e : fsys::directory_iterator(corpus_root() / GetParam())) files.push_back(e.path());
  std::sort(files.begin(), files.end());
  ASSERT_FALSE(files.empty());
  for (auto& f : files) {
    std::ifstream in(f, std::ios::binary);
    std::string bytes((std::istreambuf_iterator<char>(in)), {});
    try {
      it->fn(reinterpret_cast<const uint8_t*>(bytes.data()), bytes.size());
    } catch (const Finding& e) {
      ADD_FAILURE() << f << ": " << e.what();
    }
  }
}

INSTANTIATE_TEST_SUITE_P(Targets, FuzzCorpusReplay, ::testing::ValuesIn(target_names()),
                         [](const auto& info) { return info.param; });

}  // namespace
}  // namespace primus::fuzz
