// Shared by the data tests: a fresh temporary folder per test, seeded randomness that reports
// its seed on failure, and helpers to read raw files and the test corpus.
#pragma once
#include <gtest/gtest.h>
#include <unistd.h>

#include <atomic>
#include <cstdint>
#include <filesystem>
#include <fstream>
#include <random>
#include <sstream>
#include <string>
#include <vector>

namespace primus::data::testing {

// A folder removed when the test ends.
class TempDir {
 public:
  TempDir() {
    static std::atomic<int> counter{0};
    const auto* info = ::testing::UnitTest::GetInstance()->current_test_info();
    path_ = std::filesystem::temp_directory_path() /
            ("primus_data_" + std::to_string(::getpid()) + "_" + std::to_string(counter++) + "_" +
             (info ? info->name() : "x"));
    std::filesystem::remove_all(path_);
    std::filesystem::create_directories(path_);
  }
  ~TempDir() {
    std::error_code ec;
    std::filesystem::remove_all(path_, ec);
  }
  const std::filesystem::path& path() const { return path_; }
  std::string operator/(const std::string& name) const { return (path_ / name).string(); }

 private:
  std::filesystem::path path_;
};

// A fresh seed per run, printed with every failure of the test that uses it.
inline uint64_t fresh_seed() {
  return (static_cast<uint64_t>(std::random_device{}()) << 32) ^ std::random_device{}();
}

inline std::string read_bytes(const std::string& path) {
  std::ifstream in(path, std::ios::binary);
  std::ostringstream ss;
  ss << in.rdbuf();
  return ss.str();
}

inline void write_bytes(const std::string& path, const std::string& data) {
  std::ofstream out(path, std::ios::binary | std::ios::trunc);
  out.write(data.data(), static_cast<std::streamsize>(data.size()));
}

// The shared corpus: PRIMUS_SOURCE_DIR/../shared/data/tinyshakespeare.txt, or "" if absent.
inline std::string shakespeare_path() {
  auto p = std::filesystem::path(PRIMUS_SOURCE_DIR) / ".." / "shared" / "data" / "tinyshakespeare.txt";
  return std::filesystem::exists(p) ? p.string() : std::string();
}

}  // namespace primus::data::testing
