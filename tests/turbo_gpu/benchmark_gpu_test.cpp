// `primus benchmark` on the GPU (label gpu; skips without a device): the device backends run
// (cuBLASLt and cuDNN found by the lazy loader), the ceilings are the device's (bf16 GEMM 8192^3,
// D2D copy), and each share of a ceiling is plausible (a kernel cannot beat the device's best
// GEMM or copy by much).
#include <gtest/gtest.h>
#include <nlohmann/json.hpp>

#include <cstdio>
#include <cstdlib>
#include <filesystem>
#include <fstream>
#include <map>
#include <set>

#include "tests/e2e/cli_runner.h"
#include "turbo/bench/benchmark.h"
#include "turbo/core/cuda_check.h"

using namespace primus::turbo;

namespace {

std::vector<nlohmann::json> run(const std::string& op, const std::string& shape, const std::filesystem::path& json) {
  bench::BenchConfig cfg;
  cfg.ops = {op};
  cfg.shapes = {shape};
  cfg.iters = 5;
  cfg.memory_gib = 4;
  cfg.json_path = json.string();
  std::filesystem::remove(json);
  EXPECT_GT(bench::run_benchmarks(cfg, stdout), 0);
  std::vector<nlohmann::json> lines;
  std::ifstream f(json);
  std::string l;
  while (std::getline(f, l)) lines.push_back(nlohmann::json::parse(l));
  return lines;
}

}  // namespace

TEST(BenchmarkGpu, DeviceBackendsAgainstTheDeviceCeilings) {
  if (cuda_device_count_or_zero() == 0) GTEST_SKIP() << "no CUDA device";
  const auto json = std::filesystem::temp_directory_path() / "primus_benchmark_gpu_test.jsonl";
  struct Want {
    std::string op, shape;
    std::set<std::string> backends;
    size_t measurements;  // per backend
  };
  for (const Want& w : {Want{"gemm", "4096x4096x4096", {"CUBLASLT", "TURBO"}, 3}, Want{"norm", "16384x2048", {"TURBO"}, 10},
                        Want{"attention", "2x1024x8x8x128", {"CUDNN", "TURBO"}, 2}}) {
    SCOPED_TRACE(w.op);
    std::map<std::string, size_t> per_backend;
    bool gemm_ceiling = false, copy_ceiling = false;
    int same_size_copies = 0;
    for (const auto& j : run(w.op, w.shape, json)) {
      if (j["case"] == "ceiling/gemm_8192") {
        gemm_ceiling = true;
        EXPECT_GT(j["ours"].get<double>(), 50.0) << "bf16 TFLOP/s of an 8192^3 GEMM: " << j.dump();
        continue;
      }
      if (j["case"] == "copy/512MiB") {
        copy_ceiling = true;
        EXPECT_GT(j["ours"].get<double>(), 300.0) << "GB/s of a D2D copy: " << j.dump();
        continue;
      }
      const std::string name = j["case"].get<std::string>();
      if (name.rfind("copy/", 0) == 0) {  // a copy of one bandwidth-bound case's own byte count
        ++same_size_copies;
        EXPECT_GT(j["ours"].get<double>(), 100.0) << "GB/s of a D2D copy: " << j.dump();
        EXPECT_DOUBLE_EQ(j["work"].get<double>(), 2.0 * std::stod(name.substr(5))) << j.dump();
        continue;
      }
      ++per_backend[j["backend"].get<std::string>()];
      EXPECT_EQ(j["dtype"], "bf16");
      const double share = j["ratio"].get<double>();
      EXPECT_GT(share, 0.0) << j.dump();
      EXPECT_LT(share, 1.3) << "faster than the device's ceiling? " << j.dump();
      EXPECT_NEAR(share, j["ours"].get<double>() / j["anchor"].get<double>(), 1e-4 * share) << j.dump();
    }
    EXPECT_TRUE(gemm_ceiling);
    EXPECT_TRUE(copy_ceiling);
    // Bandwidth-bound cases are also timed against copies of their own size; FLOP-bound ones are not.
    if (w.op == "norm") EXPECT_GT(same_size_copies, 0);
    else EXPECT_EQ(same_size_copies, 0);
    for (const auto& b : w.backends) EXPECT_EQ(per_backend[b], w.measurements) << b << " did not run every case";
    EXPECT_EQ(per_backend.size(), w.backends.size());
  }
  std::filesystem::remove(json);
}

// --variants: each TURBO kernel variant runs after TURBO under its own name, and every backend and
// variant after the first (CUDNN) is cross-checked against it on the same inputs: out on the
// forward's line, dq, dk, dv on the backward's, all within the bf16 gate.
TEST(BenchmarkGpu, AttentionVariantsAreTimedAndCrossChecked) {
  if (cuda_device_count_or_zero() == 0) GTEST_SKIP() << "no CUDA device";
  const auto json = std::filesystem::temp_directory_path() / "primus_benchmark_variants_test.jsonl";
  std::filesystem::remove(json);
  bench::BenchConfig cfg;
  cfg.ops = {"attention"};
  cfg.shapes = {"2x512x4x2x64", "1x256x4x4x128:packed"};
  cfg.variants = {"all"};
  cfg.iters = 2;
  cfg.memory_gib = 2;
  cfg.json_path = json.string();
  EXPECT_GT(bench::run_benchmarks(cfg, stdout), 0);
  std::map<std::string, std::set<std::string>> backends;  // case -> backends measured
  std::ifstream f(json);
  std::string l;
  while (std::getline(f, l)) {
    const auto j = nlohmann::json::parse(l);
    const std::string c = j["case"];
    if (c.rfind("attention/", 0) != 0) continue;
    const std::string be = j["backend"];
    backends[c].insert(be);
    if (be == "CUDNN") {
      EXPECT_FALSE(j.contains("xcheck")) << "the reference: " << j.dump();
      continue;
    }
    ASSERT_TRUE(j.contains("xcheck")) << j.dump();
    EXPECT_EQ(j["xcheck"]["vs"], "CUDNN") << j.dump();
    const bool fwd = c.size() > 4 && c.compare(c.size() - 4, 4, "/fwd") == 0;
    for (const char* out : fwd ? std::vector<const char*>{"out"} : std::vector<const char*>{"dq", "dk", "dv"}) {
      ASSERT_TRUE(j["xcheck"]["rel_l2"].contains(out)) << out << ": " << j.dump();
      ASSERT_TRUE(j["xcheck"]["rel_l2"][out].is_number()) << out << ": " << j.dump();
      EXPECT_LT(j["xcheck"]["rel_l2"][out].get<double>(), 1e-2) << out << ": " << j.dump();
    }
  }
  const std::set<std::string> all = {"CUDNN", "TURBO", "TURBO_SM90_PIPE", "TURBO_SM90_SIMPLE", "TURBO_BWD_SM90", "TURBO_SM80"};
  for (const char* c : {"attention/2x512x4x2x64/fwd", "attention/2x512x4x2x64/bwd", "attention/1x256x4x4x128_packed/fwd",
                        "attention/1x256x4x4x128_packed/bwd"})
    EXPECT_EQ(backends[c], all) << c;
  // The variants' switches are put back after each case.
  EXPECT_EQ(std::getenv("PRIMUS_TURBO_ATTN_KERNEL"), nullptr);
  EXPECT_EQ(std::getenv("PRIMUS_TURBO_ATTN_BWD_KERNEL"), nullptr);
  std::filesystem::remove(json);
}

namespace {

// Whether one line of `out` holds every part.
bool has_line(const std::string& out, std::initializer_list<const char*> parts) {
  size_t start = 0;
  while (start < out.size()) {
    size_t end = out.find('\n', start);
    if (end == std::string::npos) end = out.size();
    const std::string line = out.substr(start, end - start);
    bool all = true;
    for (const char* p : parts) all = all && line.find(p) != std::string::npos;
    if (all) return true;
    start = end + 1;
  }
  return false;
}

}  // namespace

// Without cuDNN (the variable names a missing file), the CUDNN backend is skipped with the
// loader's message and TURBO still runs; a forced CUBLASLT without cuBLASLt is an error naming it.
TEST(BenchmarkGpu, MissingVendorLibrariesAreReportedNotFatal) {
  if (cuda_device_count_or_zero() == 0) GTEST_SKIP() << "no CUDA device";
  using primus::testing::primus_binary;
  using primus::testing::run_primus;
  if (!std::filesystem::exists(primus_binary())) GTEST_SKIP() << primus_binary() << " not built (set PRIMUS_BIN)";
  const auto [rc, out] = run_primus("benchmark attention --shapes 1x256x4x4x64 --iters 2 --memory-gib 2",
                                    "PRIMUS_CUDNN_LIBRARY=/nonexistent/libcudnn.so.9");
  EXPECT_EQ(rc, 0) << out;
  EXPECT_TRUE(has_line(out, {"CUDNN", "skipped", "PRIMUS_CUDNN_LIBRARY=/nonexistent/libcudnn.so.9"})) << out;
  EXPECT_TRUE(has_line(out, {"attention/1x256x4x4x64/bwd", "TURBO", "TFLOP/s"})) << out;

  const auto [rc2, out2] = run_primus("benchmark gemm --backend CUBLASLT --shapes 256x256x256 --iters 2 --memory-gib 2",
                                      "PRIMUS_CUBLASLT_LIBRARY=/nonexistent/libcublasLt.so.13");
  EXPECT_EQ(rc2, 3) << out2;
  EXPECT_NE(out2.find("PRIMUS_CUBLASLT_LIBRARY=/nonexistent/libcublasLt.so.13"), std::string::npos) << out2;
  EXPECT_EQ(out2.find("terminate called"), std::string::npos) << out2;
}
