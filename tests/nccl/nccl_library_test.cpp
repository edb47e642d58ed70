// The NCCL loader's search order and error messages, with fake inputs and a fake dlopen, plus
// real dlopen calls on libraries that are not NCCL. No GPU and no NCCL needed.
#include <gtest/gtest.h>

#include <unistd.h>

#include <cstdio>
#include <cstdlib>
#include <map>
#include <string>
#include <vector>

#include "core/util/error.h"
#include "parallel/nccl_library.h"

namespace primus::parallel::nccl {
namespace {

SearchInputs fake_inputs(std::map<std::string, std::string> env, std::vector<std::string> python,
                         std::map<std::string, std::vector<std::string>> globs) {
  SearchInputs in;
  in.getenv = [env](const std::string& n) -> std::optional<std::string> {
    auto it = env.find(n);
    if (it == env.end()) return std::nullopt;
    return it->second;
  };
  in.python_site_dirs = [python] { return python; };
  in.glob = [globs](const std::string& p) {
    auto it = globs.find(p);
    return it == globs.end() ? std::vector<std::string>{} : it->second;
  };
  return in;
}

std::vector<std::string> files(const std::vector<Candidate>& cs) {
  std::vector<std::string> out;
  for (const auto& c : cs) out.push_back(c.file);
  return out;
}

TEST(NcclSearch, OrderIsLoaderThenCudaThenPythonSiteThenGlobbedFolders) {
  auto cs = search_candidates(fake_inputs(
      {}, {"/venv/lib/python3.12/site-packages", "/root/.local/lib/python3.12/site-packages"},
      {{"/usr/local/lib/python3*/dist-packages", {"/usr/local/lib/python3.12/dist-packages"}},
       // the same folder as python reported: listed once
       {"/usr/lib/python3*/site-packages", {"/venv/lib/python3.12/site-packages"}}}));
  std::vector<std::string> want = {
      "libnccl.so.2",
      "libnccl.so",
      "/usr/local/cuda/lib64/libnccl.so.2",
      "/usr/local/cuda/lib/libnccl.so.2",
      "/venv/lib/python3.12/site-packages/nvidia/nccl/lib/libnccl.so.2",
      "/root/.local/lib/python3.12/site-packages/nvidia/nccl/lib/libnccl.so.2",
      "/usr/local/lib/python3.12/dist-packages/nvidia/nccl/lib/libnccl.so.2",
  };
  EXPECT_EQ(files(cs), want);
  EXPECT_EQ(cs[4].how, "python3's site-packages");
  EXPECT_EQ(cs[6].how, "a python3 packages folder");
}

TEST(NcclSearch, ExplicitLibraryIsTheOnlyPlaceTried) {
  auto cs = search_candidates(fake_inputs({{"PRIMUS_NCCL_LIBRARY", "/opt/nccl/lib/libnccl.so.2.28.9"}}, {"/x"}, {}));
  ASSERT_EQ(cs.size(), 1u);
  EXPECT_EQ(cs[0].file, "/opt/nccl/lib/libnccl.so.2.28.9");
  EXPECT_EQ(cs[0].how, "PRIMUS_NCCL_LIBRARY");
  // A folder gets the soname.
  cs = search_candidates(fake_inputs({{"PRIMUS_NCCL_LIBRARY", "/opt/nccl/lib"}}, {}, {}));
  ASSERT_EQ(cs.size(), 1u);
  EXPECT_EQ(cs[0].file, "/opt/nccl/lib/libnccl.so.2");
  cs = search_candidates(fake_inputs({{"PRIMUS_NCCL_LIBRARY", "/opt/nccl/lib/"}}, {}, {}));
  EXPECT_EQ(cs[0].file, "/opt/nccl/lib/libnccl.so.2");
  // Empty counts as unset.
  cs = search_candidates(fake_inputs({{"PRIMUS_NCCL_LIBRARY", ""}}, {}, {}));
  EXPECT_EQ(cs[0].file, "libnccl.so.2");
}

TEST(NcclSearch, ErrorNamesEveryPlaceTriedAndWhy) {
  Opener o;
  o.open = [](const std::string& f, std::string* err) -> void* {
    *err = "cannot open " + f;
    return nullptr;
  };
  auto cs = search_candidates(fake_inputs({}, {"/site"}, {}));
  try {
    load_library(cs, o);
    FAIL() << "expected an error";
  } catch (const RuntimeError& e) {
    const std::string m = e.what();
    for (const auto& c : cs) {
      EXPECT_NE(m.find(c.file + " (" + c.how + "): cannot open " + c.file), std::string::npos) << m;
    }
    EXPECT_NE(m.find("PRIMUS_NCCL_LIBRARY"), std::string::npos) << m;
    EXPECT_NE(m.find("nvidia-nccl-cu13"), std::string::npos) << m;
  }
}

// A fake NCCL: every symbol resolves to a function of the right shape; the version is settable.
int g_fake_version = 22809;
Result fake_get_version(int* v) {
  *v = g_fake_version;
  return Success;
}
void fake_any() {}

Opener fake_opener(std::vector<std::string> loadable, std::vector<std::string> missing_symbols = {}) {
  Opener o;
  o.open = [loadable](const std::string& f, std::string* err) -> void* {
    for (size_t i = 0; i < loadable.size(); ++i) {
      if (loadable[i] == f) return reinterpret_cast<void*>(i + 1);
    }
    *err = "no such file";
    return nullptr;
  };
  o.symbol = [missing_symbols](void*, const char* name) -> void* {
    for (const auto& m : missing_symbols) {
      if (m == name) return nullptr;
    }
    if (std::string(name) == "ncclGetVersion") return reinterpret_cast<void*>(&fake_get_version);
    return reinterpret_cast<void*>(&fake_any);
  };
  o.resolved_path = [](void*, const std::string& f) { return "/resolved/" + f; };
  o.close = [](void*) {};
  return o;
}

TEST(NcclSearch, FirstCompleteLibraryWinsAndReportsWhereAndVersion) {
  auto cs = search_candidates(fake_inputs({}, {"/site"}, {}));
  g_fake_version = 22809;
  Library lib = load_library(cs, fake_opener({"/site/nvidia/nccl/lib/libnccl.so.2", "/usr/local/cuda/lib/libnccl.so.2"}));
  EXPECT_EQ(lib.path, "/resolved//usr/local/cuda/lib/libnccl.so.2");
  EXPECT_EQ(lib.how, "CUDA toolkit folder");
  EXPECT_EQ(lib.version(), "2.28.9");
  EXPECT_EQ(lib.version_code, 22809);
}

TEST(NcclSearch, LibraryMissingFunctionsOrTooOldIsSkippedWithTheReason) {
  std::vector<Candidate> cs = {{"/a/libnccl.so.2", "first"}, {"/b/libnccl.so.2", "second"}};
  try {
    load_library(cs, fake_opener({"/a/libnccl.so.2"}, {"ncclCommInitRankConfig", "ncclCommGetAsyncError"}));
    FAIL() << "expected an error";
  } catch (const RuntimeError& e) {
    const std::string m = e.what();
    EXPECT_NE(m.find("/a/libnccl.so.2 (first): loaded, but lacks ncclCommInitRankConfig, ncclCommGetAsyncError"),
              std::string::npos)
        << m;
    EXPECT_NE(m.find("/b/libnccl.so.2 (second): no such file"), std::string::npos) << m;
  }
  g_fake_version = 2708;  // NCCL 2.7.8: old encoding, no non-blocking communicators
  try {
    load_library(cs, fake_opener({"/a/libnccl.so.2"}));
    FAIL() << "expected an error";
  } catch (const RuntimeError& e) {
    EXPECT_NE(std::string(e.what()).find("/a/libnccl.so.2 (first): NCCL version code 2708 is older than 2.14"),
              std::string::npos)
        << e.what();
  }
  g_fake_version = 22809;
}

TEST(NcclSearch, RealDlopenOfANonNcclLibraryNamesTheMissingFunctions) {
  // libm is in every glibc system: it loads, and has none of NCCL's functions.
  std::vector<Candidate> cs = {{"libm.so.6", "test"}, {"/nonexistent/libnccl.so.2", "test2"}};
  try {
    load_library(cs, dlopen_opener());
    FAIL() << "expected an error";
  } catch (const RuntimeError& e) {
    const std::string m = e.what();
    EXPECT_NE(m.find("libm.so.6 (test): loaded, but lacks ncclGetVersion"), std::string::npos) << m;
    EXPECT_NE(m.find("/nonexistent/libnccl.so.2 (test2): /nonexistent/libnccl.so.2: cannot open shared object file"),
              std::string::npos)
        << m;
  }
}

TEST(NcclLibrary, VersionFormatsBothEncodings) {
  Library l;
  l.version_code = 22809;
  EXPECT_EQ(l.version(), "2.28.9");
  l.version_code = 21903;
  EXPECT_EQ(l.version(), "2.19.3");
  l.version_code = 2708;
  EXPECT_EQ(l.version(), "2.7.8");
}

TEST(NcclLibrary, NvlsIsTurnedOffUnlessTheUserChose) {
  unsetenv("NCCL_NVLS_ENABLE");
  EXPECT_EQ(disable_nvls_unless_set(), "0");
  EXPECT_STREQ(std::getenv("NCCL_NVLS_ENABLE"), "0");
  setenv("NCCL_NVLS_ENABLE", "1", 1);
  EXPECT_EQ(disable_nvls_unless_set(), "1");
  EXPECT_STREQ(std::getenv("NCCL_NVLS_ENABLE"), "1");
  unsetenv("NCCL_NVLS_ENABLE");
}

TEST(NcclLibrary, ProcessLibraryHonoursAWrongExplicitChoiceWithAnError) {
  setenv("PRIMUS_NCCL_LIBRARY", "/nonexistent/dir", 1);
  try {
    library();
    FAIL() << "expected an error";
  } catch (const RuntimeError& e) {
    const std::string m = e.what();
    EXPECT_NE(m.find("/nonexistent/dir/libnccl.so.2 (PRIMUS_NCCL_LIBRARY)"), std::string::npos) << m;
    // only the explicit place was tried
    EXPECT_EQ(m.find("CUDA toolkit folder"), std::string::npos) << m;
  }
  unsetenv("PRIMUS_NCCL_LIBRARY");
}

}  // namespace
}  // namespace primus::parallel::nccl

namespace primus::parallel::nccl {
namespace {

// Where this machine has an NCCL in one of the searched places, the real search finds it,
// binds every function and reads its version (ncclGetVersion needs no GPU). Skipped elsewhere.
TEST(NcclLibrary, FindsThisMachinesNcclWhenOneIsInstalled) {
  unsetenv("PRIMUS_NCCL_LIBRARY");
  bool present = false;
  for (const auto& c : search_candidates(default_search_inputs())) {
    if (c.file.find('/') != std::string::npos && ::access(c.file.c_str(), R_OK) == 0) present = true;
  }
  if (!present && std::system("ldconfig -p 2>/dev/null | grep -q libnccl.so") != 0) {
    GTEST_SKIP() << "no NCCL installed in the searched places";
  }
  const Library& lib = library();
  EXPECT_GE(lib.version_code, 21400);
  EXPECT_FALSE(lib.path.empty());
  EXPECT_NE(lib.path.find("libnccl"), std::string::npos) << lib.path;
  ASSERT_NE(lib.api.GetErrorString, nullptr);
  EXPECT_NE(describe(lib, RemoteError).find("(NCCL result 6)"), std::string::npos) << describe(lib, RemoteError);
  std::printf("[nccl] %s from %s (%s)\n", lib.version().c_str(), lib.path.c_str(), lib.how.c_str());
}

}  // namespace
}  // namespace primus::parallel::nccl
