#include <gtest/gtest.h>

#include <filesystem>

#include "core/util/error.h"
#include "core/util/fs.h"

namespace fsys = std::filesystem;

TEST(Fs, AtomicWriteReplacesAndReadsBack) {
  auto dir = fsys::temp_directory_path() / "primus_fs_test";
  fsys::remove_all(dir);
  auto p = dir / "a.txt";
  primus::fs::atomic_write_file(p, "first");
  primus::fs::atomic_write_file(p, "second");
  EXPECT_EQ(primus::fs::read_file(p), "second");
  // No temporary files are left behind.
  int n = 0;
  for (auto& e : fsys::directory_iterator(dir)) n += e.is_regular_file();
  EXPECT_EQ(n, 1);
}

TEST(Fs, FailedWriterKeepsPreviousFile) {
  auto dir = fsys::temp_directory_path() / "primus_fs_test2";
  fsys::remove_all(dir);
  auto p = dir / "b.txt";
  primus::fs::atomic_write_file(p, "good");
  EXPECT_THROW(primus::fs::atomic_write_with(p, [](std::FILE* f) {
                 std::fputs("partial", f);
                 throw primus::IoError("simulated");
               }),
               primus::IoError);
  EXPECT_EQ(primus::fs::read_file(p), "good");
}

TEST(Fs, MissingFileNamesPath) {
  try {
    primus::fs::read_file("/nonexistent/primus/x.yaml");
    FAIL();
  } catch (const primus::IoError& e) {
    EXPECT_NE(std::string(e.what()).find("/nonexistent/primus/x.yaml"), std::string::npos);
  }
}
