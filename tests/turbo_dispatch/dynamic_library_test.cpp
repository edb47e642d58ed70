// turbo/core/dynamic_library: the search order, and what the error says when a library is
// missing or a file of its name is something else. Real files: copies of libm (a library every
// test binary has loaded) stand in for the vendor library.
#include <dlfcn.h>
#include <gtest/gtest.h>

#include <cstdlib>
#include <filesystem>
#include <random>

#include "core/util/error.h"
#include "turbo/core/dynamic_library.h"

namespace fs = std::filesystem;
using primus::turbo::LazyLibrary;
using primus::turbo::LibrarySpec;
using primus::turbo::load_library;

namespace {

constexpr const char* kSoname = "libprimus_test_vendor.so.7";
constexpr const char* kEnv = "PRIMUS_TEST_VENDOR_LIBRARY";

std::string libm_path() {
  void* sym = dlsym(RTLD_DEFAULT, "cos");
  Dl_info info{};
  if (!sym || !dladdr(sym, &info) || !info.dli_fname) return "";
  return info.dli_fname;
}

class DynamicLibraryTest : public ::testing::Test {
 protected:
  void SetUp() override {
    unsetenv(kEnv);
    root_ = fs::temp_directory_path() / ("primus_dl_" + std::to_string(std::random_device{}()));
    fs::create_directories(root_ / "cuda");
    fs::create_directories(root_ / "site");
    spec_ = LibrarySpec{"Vendor", kSoname, kEnv, "cos", {(root_ / "cuda").string()}, {"nvidia/vendor/lib"}};
  }
  void TearDown() override {
    unsetenv(kEnv);
    fs::remove_all(root_);
  }
  // A copy of libm named like the vendor library under `dir`.
  std::string plant(const fs::path& dir) {
    fs::create_directories(dir);
    const auto dst = dir / kSoname;
    fs::copy_file(libm_path(), dst, fs::copy_options::overwrite_existing);
    return dst.string();
  }
  std::function<std::vector<std::string>()> sites(bool* asked = nullptr) {
    return [this, asked] {
      if (asked) *asked = true;
      return std::vector<std::string>{(root_ / "site").string()};
    };
  }
  fs::path root_;
  LibrarySpec spec_;
};

TEST_F(DynamicLibraryTest, MissingEverywhereNamesTheLibraryAndEveryPlaceTriedInOrder) {
  bool asked = false;
  const auto r = load_library(spec_, sites(&asked));
  EXPECT_EQ(r.handle, nullptr);
  EXPECT_TRUE(asked);
  ASSERT_EQ(r.attempts.size(), 3u) << r.error;
  EXPECT_EQ(r.attempts[0].rfind(kSoname, 0), 0u) << r.attempts[0];  // the loader's own search first
  EXPECT_NE(r.attempts[0].find("dynamic loader"), std::string::npos);
  EXPECT_EQ(r.attempts[1].rfind((root_ / "cuda" / kSoname).string(), 0), 0u) << r.attempts[1];
  EXPECT_NE(r.attempts[1].find("no such file"), std::string::npos);
  EXPECT_EQ(r.attempts[2].rfind((root_ / "site" / "nvidia/vendor/lib" / kSoname).string(), 0), 0u) << r.attempts[2];
  for (const char* part : {"Vendor", kSoname, kEnv})
    EXPECT_NE(r.error.find(part), std::string::npos) << "missing '" << part << "' in:\n" << r.error;
  for (const auto& a : r.attempts) EXPECT_NE(r.error.find(a), std::string::npos) << r.error;
}

TEST_F(DynamicLibraryTest, FixedFolderIsTriedBeforePythonAndPythonIsNotAskedThen) {
  const std::string fixed = plant(root_ / "cuda");
  plant(root_ / "site" / "nvidia/vendor/lib");
  bool asked = false;
  const auto r = load_library(spec_, sites(&asked));
  ASSERT_NE(r.handle, nullptr) << r.error;
  EXPECT_EQ(r.path, fixed);
  EXPECT_FALSE(asked);
  EXPECT_TRUE(r.error.empty());
}

TEST_F(DynamicLibraryTest, FoundInAPythonPackage) {
  const std::string wheel = plant(root_ / "site" / "nvidia/vendor/lib");
  const auto r = load_library(spec_, sites());
  ASSERT_NE(r.handle, nullptr) << r.error;
  EXPECT_EQ(r.path, wheel);
  EXPECT_EQ(r.attempts.size(), 2u);  // the loader's search and the fixed folder failed first
}

TEST_F(DynamicLibraryTest, AFileOfTheRightNameWithoutTheProbeSymbolIsReported) {
  spec_.probe_symbol = "cublasLtCreate";
  plant(root_ / "cuda");
  const auto r = load_library(spec_, sites());
  EXPECT_EQ(r.handle, nullptr);
  ASSERT_EQ(r.attempts.size(), 3u) << r.error;
  EXPECT_NE(r.attempts[1].find("does not export cublasLtCreate"), std::string::npos) << r.attempts[1];
}

TEST_F(DynamicLibraryTest, EnvironmentVariableIsTheOnlyPlaceTriedWhenSet) {
  plant(root_ / "cuda");  // would be found by the search, but the user named another file
  const std::string named = (root_ / "elsewhere" / kSoname).string();
  setenv(kEnv, named.c_str(), 1);
  bool asked = false;
  const auto r = load_library(spec_, sites(&asked));
  EXPECT_EQ(r.handle, nullptr);
  EXPECT_FALSE(asked);
  ASSERT_EQ(r.attempts.size(), 1u);
  EXPECT_NE(r.attempts[0].find(named), std::string::npos);
  EXPECT_NE(r.error.find(std::string(kEnv) + "=" + named), std::string::npos) << r.error;

  setenv(kEnv, plant(root_ / "elsewhere").c_str(), 1);
  const auto ok = load_library(spec_, sites());
  ASSERT_NE(ok.handle, nullptr) << ok.error;
  EXPECT_EQ(ok.path, named);
}

TEST_F(DynamicLibraryTest, LazyLibraryThrowsTheSearchErrorAndNamesAMissingSymbol) {
  setenv(kEnv, (root_ / "none" / kSoname).string().c_str(), 1);
  LazyLibrary missing(spec_);
  EXPECT_FALSE(missing.available());
  try {
    missing.symbol("cos");
    FAIL() << "no throw";
  } catch (const primus::RuntimeError& e) {
    EXPECT_EQ(std::string(e.what()), missing.error());
    EXPECT_NE(std::string(e.what()).find(kEnv), std::string::npos);
  }
  setenv(kEnv, plant(root_ / "cuda").c_str(), 1);
  LazyLibrary present(spec_);
  ASSERT_TRUE(present.available()) << present.error();
  EXPECT_NE(present.symbol("cos"), nullptr);
  try {
    present.symbol("primus_no_such_function");
    FAIL() << "no throw";
  } catch (const primus::RuntimeError& e) {
    const std::string w = e.what();
    EXPECT_NE(w.find("primus_no_such_function"), std::string::npos) << w;
    EXPECT_NE(w.find(present.path()), std::string::npos) << w;
  }
}

TEST(PythonSiteDirs, NoPythonMeansNoFoldersAndNoError) {
  setenv("PRIMUS_PYTHON", "/nonexistent/python3", 1);
  EXPECT_TRUE(primus::turbo::python_site_dirs().empty());
  unsetenv("PRIMUS_PYTHON");
}

}  // namespace
