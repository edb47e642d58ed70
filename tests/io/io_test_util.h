// Shared by the io tests: a fresh folder per test, random tensors, and a check that an error
// of the expected type names what it should.
#pragma once
#include <gtest/gtest.h>
#include <unistd.h>

#include <cstring>
#include <filesystem>
#include <fstream>
#include <functional>
#include <random>
#include <string>
#include <vector>

#include "core/util/error.h"

namespace primus::io::testing {

namespace fsys = std::filesystem;

// A fixture giving each test an empty folder of its own, removed afterwards.
class TempDirTest : public ::testing::Test {
 protected:
  void SetUp() override {
    const auto* info = ::testing::UnitTest::GetInstance()->current_test_info();
    dir_ = fsys::temp_directory_path() /
           (std::string("primus_io_") + info->test_suite_name() + "_" + info->name() + "_" +
            std::to_string(::getpid()));
    fsys::remove_all(dir_);
    fsys::create_directories(dir_);
  }
  void TearDown() override {
    if (!HasFailure()) fsys::remove_all(dir_);
  }
  const fsys::path& dir() const { return dir_; }

  std::mt19937_64 rng_{std::random_device{}()};

  std::vector<float> random_floats(size_t n) {
    std::normal_distribution<float> d(0.f, 1.f);
    std::vector<float> v(n);
    for (auto& x : v) x = d(rng_);
    return v;
  }
  std::vector<std::byte> random_bytes(size_t n) {
    std::vector<std::byte> v(n);
    for (auto& b : v) b = static_cast<std::byte>(rng_());
    return v;
  }

 private:
  fsys::path dir_;
};

inline void write_bytes(const fsys::path& p, const std::string& bytes) {
  std::ofstream out(p, std::ios::binary | std::ios::trunc);
  out.write(bytes.data(), static_cast<std::streamsize>(bytes.size()));
}

inline std::string read_bytes(const fsys::path& p) {
  std::ifstream in(p, std::ios::binary);
  return std::string(std::istreambuf_iterator<char>(in), {});
}

// Runs `fn`, expecting an exception of type E whose message contains every one of `parts`.
template <class E>
void expect_error(const std::function<void()>& fn, const std::vector<std::string>& parts) {
  try {
    fn();
    ADD_FAILURE() << "no exception thrown; expected one naming: " << ::testing::PrintToString(parts);
  } catch (const E& e) {
    std::string msg = e.what();
    for (const auto& p : parts) {
      EXPECT_NE(msg.find(p), std::string::npos) << "message lacks '" << p << "': " << msg;
    }
  }
}

}  // namespace primus::io::testing
