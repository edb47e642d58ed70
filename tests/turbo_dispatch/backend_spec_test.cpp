// Parsing of PRIMUS_TURBO_<OP>_BACKEND values and the LRU cache behind autotune.
#include <gtest/gtest.h>

#include "core/util/error.h"
#include "turbo/dispatch/backend_spec.h"
#include "turbo/dispatch/lru_cache.h"

namespace primus::turbo {
namespace {

TEST(BackendSpec, SingleBackendCoversEveryPrecision) {
  auto s = parse_backend_spec(" cublaslt ", "V");
  for (Precision p : kAllPrecisions) EXPECT_EQ(s.lookup(p), BackendChoice::of(BackendType::CUBLASLT));
}

TEST(BackendSpec, PerPrecisionWithOther) {
  auto s = parse_backend_spec("fp8:TURBO,other:CUBLASLT", "V");
  EXPECT_EQ(s.lookup(Precision::FP8), BackendChoice::of(BackendType::TURBO));
  EXPECT_EQ(s.lookup(Precision::BF16), BackendChoice::of(BackendType::CUBLASLT));
  EXPECT_EQ(s.lookup(Precision::FP32), BackendChoice::of(BackendType::CUBLASLT));
}

TEST(BackendSpec, BareEntryActsAsOther) {
  auto s = parse_backend_spec("bf16:CPU, Turbo", "V");
  EXPECT_EQ(s.lookup(Precision::BF16), BackendChoice::of(BackendType::CPU));
  EXPECT_EQ(s.lookup(Precision::FP16), BackendChoice::of(BackendType::TURBO));
}

TEST(BackendSpec, AutotuneWord) {
  auto s = parse_backend_spec("AutoTune", "V");
  EXPECT_TRUE(s.lookup(Precision::BF16)->is_autotune());
  auto t = parse_backend_spec("fp8:autotune", "V");
  EXPECT_TRUE(t.lookup(Precision::FP8)->is_autotune());
  EXPECT_FALSE(t.lookup(Precision::BF16).has_value());
}

TEST(BackendSpec, EmptyTextIsEmptySpec) {
  EXPECT_TRUE(parse_backend_spec("", "V").empty());
  EXPECT_TRUE(parse_backend_spec("   ", "V").empty());
}

void expect_config_error(const char* text, const char* must_contain) {
  try {
    parse_backend_spec(text, "PRIMUS_TURBO_GEMM_BACKEND");
    FAIL() << "accepted '" << text << "'";
  } catch (const ConfigError& e) {
    const std::string w = e.what();
    EXPECT_NE(w.find("PRIMUS_TURBO_GEMM_BACKEND"), std::string::npos) << w;
    EXPECT_NE(w.find(must_contain), std::string::npos) << w;
  }
}

TEST(BackendSpec, ErrorsNameVariableAndOffendingEntry) {
  expect_config_error("TRITON", "unknown backend 'TRITON'");
  expect_config_error("fp4:TURBO", "unknown precision 'fp4'");
  expect_config_error("fp8:TURBO,,other:CPU", "empty entry");
  expect_config_error("fp8:TURBO,fp8:CPU", "given twice");
  expect_config_error("TURBO,CPU", "two default entries");
  expect_config_error("fp8:", "unknown backend ''");
  expect_config_error("TURBO,", "empty entry");
}

TEST(BackendNames, RoundTripAndPrecisionOfDType) {
  for (BackendType b : kAllBackends) EXPECT_EQ(parse_backend(backend_name(b)), b);
  for (Precision p : kAllPrecisions) EXPECT_EQ(parse_precision(precision_name(p)), p);
  EXPECT_FALSE(parse_backend("HIPBLASLT").has_value());
  EXPECT_EQ(precision_of(DType::F8E5M2), Precision::FP8);
  EXPECT_EQ(precision_of(DType::BF16), Precision::BF16);
  EXPECT_EQ(precision_of(DType::F16), Precision::FP16);
  EXPECT_EQ(precision_of(DType::F32), Precision::FP32);
}

TEST(LruCache, EvictsLeastRecentlyUsedAndGetRefreshes) {
  LruCache<int, std::string> c(2);
  c.put(1, "a");
  c.put(2, "b");
  EXPECT_EQ(c.get(1), "a");  // 2 is now the oldest
  c.put(3, "c");
  EXPECT_FALSE(c.contains(2));
  EXPECT_TRUE(c.contains(1));
  EXPECT_EQ(c.evictions(), 1u);
  c.put(1, "z");  // replace keeps size
  EXPECT_EQ(c.size(), 2u);
  EXPECT_EQ(c.get(1), "z");
  EXPECT_FALSE(c.get(7).has_value());
  c.clear();
  EXPECT_EQ(c.size(), 0u);
}

}  // namespace
}  // namespace primus::turbo
