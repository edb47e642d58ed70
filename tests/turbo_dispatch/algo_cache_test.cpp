// The cuBLASLt algorithm cache file (turbo/kernels/cublaslt/algo_cache.h) on the host: path from
// the environment, key contents, round trip, merge with other writers, corrupt and unwritable
// files ignored with a message. The GEMM side (search once, reuse from the file) is in
// tests/turbo_gpu/gemm_test.cpp.
#include <gtest/gtest.h>
#include <unistd.h>

#include <cstdlib>
#include <filesystem>
#include <fstream>
#include <optional>
#include <sstream>

#include <spdlog/sinks/ringbuffer_sink.h>
#include <spdlog/spdlog.h>

#include "turbo/kernels/cublaslt/algo_cache.h"

namespace primus::turbo::cublaslt {
namespace {
namespace fs = std::filesystem;

// Sets (or unsets, with nullptr) an environment variable for the scope.
class ScopedEnv {
 public:
  ScopedEnv(const char* name, const char* value) : name_(name) {
    if (const char* old = std::getenv(name)) old_ = std::string(old);
    if (value) ::setenv(name, value, 1); else ::unsetenv(name);
  }
  ~ScopedEnv() {
    if (old_) ::setenv(name_.c_str(), old_->c_str(), 1); else ::unsetenv(name_.c_str());
  }

 private:
  std::string name_;
  std::optional<std::string> old_;
};

class AlgoCache : public ::testing::Test {
 protected:
  void SetUp() override {
    dir = fs::temp_directory_path() /
          ("primus_algo_cache_" + std::to_string(::getpid()) + "_" +
           ::testing::UnitTest::GetInstance()->current_test_info()->name());
    fs::remove_all(dir);
    fs::create_directories(dir);
  }
  void TearDown() override { fs::remove_all(dir); }
  static CachedAlgo algo(uint64_t seed, double ms) {
    CachedAlgo a;
    for (size_t i = 0; i < a.data.size(); ++i) a.data[i] = seed * 0x9e3779b97f4a7c15ull + i * 0x0123456789abcdefull;
    a.ms = ms;
    return a;
  }
  static std::string slurp(const fs::path& p) {
    std::ifstream in(p);
    std::ostringstream ss;
    ss << in.rdbuf();
    return ss.str();
  }
  fs::path dir;
};

TEST_F(AlgoCache, PathFromTheEnvironment) {
  ScopedEnv a("PRIMUS_TURBO_CUBLASLT_ALGO_CACHE", nullptr), b("PRIMUS_CACHE_DIR", "/pc"),
      c("XDG_CACHE_HOME", "/xdg"), d("HOME", "/home/u");
  EXPECT_EQ(algo_cache_path_from_env(), fs::path("/pc/cublaslt_algos.json"));
  {
    ScopedEnv no_pc("PRIMUS_CACHE_DIR", nullptr);
    EXPECT_EQ(algo_cache_path_from_env(), fs::path("/xdg/primus/cublaslt_algos.json"));
    ScopedEnv no_xdg("XDG_CACHE_HOME", "");
    EXPECT_EQ(algo_cache_path_from_env(), fs::path("/home/u/.cache/primus/cublaslt_algos.json"));
    ScopedEnv no_home("HOME", nullptr);
    EXPECT_TRUE(algo_cache_path_from_env().empty());
  }
  for (const char* off : {"0", "off", "OFF", "false", "no", "none"}) {
    ScopedEnv e("PRIMUS_TURBO_CUBLASLT_ALGO_CACHE", off);
    EXPECT_TRUE(algo_cache_path_from_env().empty()) << off;
  }
  ScopedEnv e("PRIMUS_TURBO_CUBLASLT_ALGO_CACHE", "/some/where/algos.json");
  EXPECT_EQ(algo_cache_path_from_env(), fs::path("/some/where/algos.json"));
}

TEST_F(AlgoCache, KeyNamesDeviceCapabilityAndLibraryVersion) {
  const std::string k = algo_cache_key("gemm m=1 n=2 k=3|al256|ws33554432", "NVIDIA H100 80GB HBM3", 9, 0, 120804);
  EXPECT_EQ(k, "NVIDIA H100 80GB HBM3|sm_90|cublasLt 120804|gemm m=1 n=2 k=3|al256|ws33554432");
  EXPECT_NE(k, algo_cache_key("gemm m=1 n=2 k=3|al256|ws33554432", "NVIDIA H100 80GB HBM3", 9, 0, 120805));
  EXPECT_NE(k, algo_cache_key("gemm m=1 n=2 k=3|al256|ws33554432", "NVIDIA H200", 9, 0, 120804));
  EXPECT_NE(k, algo_cache_key("gemm m=1 n=2 k=3|al256|ws33554432", "NVIDIA H100 80GB HBM3", 8, 0, 120804));
}

TEST_F(AlgoCache, HexRoundTripAndRejects) {
  const CachedAlgo a = algo(7, 0);
  const std::string hex = algo_to_hex(a.data);
  EXPECT_EQ(hex.size(), 128u);
  std::array<uint64_t, 8> back{};
  ASSERT_TRUE(algo_from_hex(hex, &back));
  EXPECT_EQ(back, a.data);
  EXPECT_FALSE(algo_from_hex(hex.substr(1), &back));
  EXPECT_FALSE(algo_from_hex(std::string(127, '0') + "g", &back));
}

TEST_F(AlgoCache, StoreWritesAFileThatANewReaderFinds) {
  const fs::path p = dir / "sub" / "algos.json";  // the folder is created
  {
    AlgoCacheFile f(p);
    f.load();
    EXPECT_TRUE(f.load_error().empty());
    EXPECT_EQ(f.size(), 0u);
    EXPECT_FALSE(f.find("k1").has_value());
    EXPECT_TRUE(f.store("k1", algo(1, 0.25)));
    EXPECT_TRUE(f.store("k2", algo(2, 0.5)));
  }
  ASSERT_TRUE(fs::exists(p));
  for (const auto& e : fs::directory_iterator(p.parent_path()))
    EXPECT_EQ(e.path().filename(), "algos.json") << "a temporary file was left behind";
  AlgoCacheFile g(p);
  g.load();
  EXPECT_TRUE(g.load_error().empty()) << g.load_error();
  ASSERT_EQ(g.size(), 2u);
  EXPECT_EQ(*g.find("k1"), algo(1, 0.25));
  EXPECT_EQ(*g.find("k2"), algo(2, 0.5));
  const std::string text = slurp(p);
  EXPECT_NE(text.find("\"primus-cublaslt-algos\""), std::string::npos) << text;
  EXPECT_NE(text.find(algo_to_hex(algo(1, 0).data)), std::string::npos) << text;
}

TEST_F(AlgoCache, WritersMergeWithWhatIsOnDisk) {
  const fs::path p = dir / "algos.json";
  AlgoCacheFile a(p), b(p);
  a.load();
  b.load();  // both read an empty cache, like two ranks starting together
  ASSERT_TRUE(a.store("ka", algo(1, 1.0)));
  ASSERT_TRUE(b.store("kb", algo(2, 2.0)));
  ASSERT_TRUE(b.store("shared", algo(3, 3.0)));
  ASSERT_TRUE(a.store("shared", algo(4, 4.0)));  // the last writer wins the key both searched
  AlgoCacheFile r(p);
  r.load();
  EXPECT_EQ(r.size(), 3u);
  EXPECT_EQ(*r.find("ka"), algo(1, 1.0));
  EXPECT_EQ(*r.find("kb"), algo(2, 2.0));
  EXPECT_EQ(*r.find("shared"), algo(4, 4.0));
}

TEST_F(AlgoCache, CorruptFileIsIgnoredWithItsPathAndRepairedByTheNextStore) {
  const fs::path p = dir / "algos.json";
  auto sink = std::make_shared<spdlog::sinks::ringbuffer_sink_mt>(64);
  spdlog::default_logger()->sinks().push_back(sink);
  for (const std::string& bad :
       {std::string("{not json"), std::string("[]"), std::string("{\"format\": \"other\"}"),
        std::string(R"({"format": "primus-cublaslt-algos", "version": 99, "entries": {}})"),
        std::string(R"({"format": "primus-cublaslt-algos", "version": 1, "entries": {"k": {"algo": "12", "ms": 1}}})"),
        std::string(R"({"format": "primus-cublaslt-algos", "version": 1, "entries": {"k": {"algo": ")") +
            std::string(128, 'a') + "\"}}}"}) {
    { std::ofstream(p) << bad; }
    AlgoCacheFile f(p);
    f.load();  // never throws
    EXPECT_FALSE(f.load_error().empty()) << bad;
    EXPECT_EQ(f.size(), 0u) << bad;
    EXPECT_TRUE(f.store("k", algo(5, 0.1))) << bad;
    AlgoCacheFile g(p);
    g.load();
    EXPECT_TRUE(g.load_error().empty()) << bad << ": " << g.load_error();
    EXPECT_EQ(g.size(), 1u) << bad;
  }
  spdlog::default_logger()->sinks().pop_back();
  // Logged once for the path, naming it, however often the file is found corrupt.
  int warnings = 0;
  for (const std::string& line : sink->last_formatted())
    if (line.find(p.string()) != std::string::npos && line.find("ignored") != std::string::npos) ++warnings;
  EXPECT_EQ(warnings, 1);
  std::map<std::string, CachedAlgo> out;
  EXPECT_NE(parse_algo_cache("{not json", &out).find("not JSON"), std::string::npos);
}

TEST_F(AlgoCache, UnwritableFolderReturnsFalseAndKeepsTheEntryInMemory) {
  const fs::path blocker = dir / "file";
  { std::ofstream(blocker) << "x"; }
  AlgoCacheFile f(blocker / "algos.json");  // its folder is a file
  f.load();
  EXPECT_TRUE(f.load_error().empty()) << f.load_error();
  EXPECT_FALSE(f.store("k", algo(1, 1.0)));
  EXPECT_EQ(*f.find("k"), algo(1, 1.0));
}

TEST_F(AlgoCache, FormatParseRoundTrip) {
  std::map<std::string, CachedAlgo> in{{"a|b", algo(1, 0.125)}, {"c \"quoted\"", algo(2, 3.5)}}, out;
  ASSERT_EQ(parse_algo_cache(format_algo_cache(in), &out), "");
  EXPECT_EQ(out, in);
  ASSERT_EQ(parse_algo_cache(format_algo_cache({}), &out), "");
  EXPECT_TRUE(out.empty());
}

}  // namespace
}  // namespace primus::turbo::cublaslt
