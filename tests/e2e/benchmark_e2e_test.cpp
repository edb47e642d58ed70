// `primus benchmark` through the real binary: tiny cases on the CPU kernels (--cpu-only, so the
// result is the same with or without a GPU; the layer family runs on the host anyway), the table,
// and the JSON lines in DESIGN.md's Measurements format; bad input is one clear message with exit
// code 2.
#include <gtest/gtest.h>
#include <nlohmann/json.hpp>

#include <cmath>
#include <fstream>
#include <map>
#include <set>

#include "cli_runner.h"

using primus::testing::run_primus;
using primus::testing::Workdir;

namespace {

std::vector<nlohmann::json> read_lines(const std::filesystem::path& p) {
  std::vector<nlohmann::json> v;
  std::ifstream f(p);
  std::string line;
  while (std::getline(f, line))
    if (!line.empty()) v.push_back(nlohmann::json::parse(line));
  return v;
}

void expect_measurement_format(const nlohmann::json& j) {
  for (const char* k : {"bench", "case", "device", "date", "commit", "metric", "ours", "anchor", "anchor_name", "ratio",
                        "backend", "dtype", "ms", "work"})
    EXPECT_TRUE(j.contains(k)) << "missing " << k << " in " << j.dump();
}

// The measurements of a results file (the run's ceiling and copy lines left out), each checked
// against the Measurements format and timed above zero; their case names.
std::set<std::string> measured_cases(const std::filesystem::path& json) {
  std::set<std::string> cases;
  for (const auto& j : read_lines(json)) {
    const std::string c = j["case"].get<std::string>();
    if (c.rfind("ceiling/", 0) == 0 || c.rfind("copy/", 0) == 0) continue;
    expect_measurement_format(j);
    EXPECT_GT(j["ms"].get<double>(), 0.0) << j.dump();
    cases.insert(c);
  }
  return cases;
}

}  // namespace

TEST(BenchmarkCli, TinyGemmOnTheCpuWritesMeasurementsAgainstTheCeilings) {
  Workdir w;
  const auto json = w.path() / "bench.jsonl";
  const auto r = run_primus("benchmark gemm --cpu-only --shapes 32x16x8,8x8x8 --iters 2 --commit test123 --json " +
                            json.string());
  ASSERT_EQ(r.code, 0) << r.out;
  EXPECT_NE(r.out.find("running the CPU kernels only"), std::string::npos) << r.out;
  EXPECT_NE(r.out.find("ceiling f32 GEMM 512x512x512 (CPU)"), std::string::npos) << r.out;
  EXPECT_NE(r.out.find("ceiling host memcpy of 64 MiB"), std::string::npos) << r.out;
  EXPECT_NE(r.out.find("gemm/32x16x8/wgrad"), std::string::npos) << r.out;

  const auto lines = read_lines(json);
  ASSERT_EQ(lines.size(), 2u + 6u) << r.out;  // two ceilings, then 2 shapes x (fwd, dgrad, wgrad)
  double gemm_ceiling = 0;
  std::set<std::string> cases;
  for (const auto& j : lines) {
    expect_measurement_format(j);
    EXPECT_EQ(j["commit"], "test123");
    EXPECT_EQ(j["bench"], "ops");
    EXPECT_EQ(j["device"].get<std::string>().rfind("CPU: ", 0), 0u) << j.dump();
    EXPECT_GT(j["ours"].get<double>(), 0.0) << j.dump();
    EXPECT_GT(j["ms"].get<double>(), 0.0) << j.dump();
    const std::string c = j["case"];
    if (c == "ceiling/gemm_512") {
      EXPECT_TRUE(j["anchor"].is_null());  // a figure, not a comparison
      EXPECT_NEAR(j["work"].get<double>(), 2.0 * 512 * 512 * 512, 1.0);
      gemm_ceiling = j["ours"];
      continue;
    }
    if (c == "copy/64MiB") continue;
    cases.insert(c);
    EXPECT_EQ(j["backend"], "CPU");
    EXPECT_EQ(j["dtype"], "f32");
    EXPECT_EQ(j["metric"], "TFLOP/s");
    // ours = work / ms; anchor = this run's GEMM ceiling; ratio = ours / anchor.
    // (six significant digits in the file)
    EXPECT_NEAR(j["ours"].get<double>(), j["work"].get<double>() / j["ms"].get<double>() / 1e9, 3e-5 * j["ours"].get<double>());
    EXPECT_DOUBLE_EQ(j["anchor"].get<double>(), gemm_ceiling);
    EXPECT_NEAR(j["ratio"].get<double>(), j["ours"].get<double>() / j["anchor"].get<double>(), 3e-5 * j["ratio"].get<double>());
    EXPECT_NE(j["anchor_name"].get<std::string>().find("ceiling: f32 GEMM 512x512x512 (CPU), same run"),
              std::string::npos);
  }
  EXPECT_GT(gemm_ceiling, 0.0);
  EXPECT_EQ(cases, (std::set<std::string>{"gemm/32x16x8/fwd", "gemm/32x16x8/dgrad", "gemm/32x16x8/wgrad",
                                          "gemm/8x8x8/fwd", "gemm/8x8x8/dgrad", "gemm/8x8x8/wgrad"}));
  const auto first = std::find_if(lines.begin(), lines.end(), [](auto& j) { return j["case"] == "gemm/32x16x8/fwd"; });
  EXPECT_DOUBLE_EQ((*first)["work"].get<double>(), 2.0 * 32 * 16 * 8);
}

TEST(BenchmarkCli, EveryOpFamilyRunsATinyCaseOnTheCpu) {
  Workdir w;
  const auto json = w.path() / "all.jsonl";
  // op -> (shape, the measurements it must produce, their metric)
  const std::map<std::string, std::pair<std::string, std::set<std::string>>> ops = {
      {"norm", {"8x16", {"layernorm_fwd/8x16", "add_layernorm_fwd/8x16", "layernorm_bwd/8x16", "rmsnorm_fwd/8x16",
                         "add_rmsnorm_fwd/8x16", "rmsnorm_bwd/8x16"}}},
      {"activation", {"8x16", {"gelu_fwd/8x16", "gelu_bwd/8x16", "swiglu_fwd/8x16", "swiglu_bwd/8x16",
                               "swiglu_fwd_maxima/8x16", "swiglu_bwd_maxima/8x16"}}},
      {"loss", {"8x32", {"cross_entropy_fwdbwd/8x32"}}},
      {"optimizer", {"1000", {"adamw/1000", "grad_norm/1000"}}},
      {"rope", {"1x8x2x8", {"rope_fwd/1x8x2x8", "rope_bwd/1x8x2x8"}}},
      {"head_norm", {"1x8x2x1x8", {"head_norm_fwd/1x8x2x1x8", "head_norm_bwd/1x8x2x1x8"}}},
      {"embedding", {"2x8x16x32", {"embedding_fwd/2x8x16x32", "embedding_bwd/2x8x16x32"}}},
      {"attention", {"1x16x4x2x8", {"attention/1x16x4x2x8/fwd", "attention/1x16x4x2x8/bwd"}}},
      {"moe", {"64x16x8x2", {"router_fwd/64x16x8x2", "router_bwd/64x16x8x2", "plan/64x16x8x2",
                             "plan_permute/64x16x8x2", "permute_bwd/64x16x8x2", "unpermute_fwd/64x16x8x2",
                             "unpermute_bwd/64x16x8x2"}}},
  };
  for (const auto& [op, want] : ops) {
    const auto r = run_primus("benchmark " + op + " --cpu-only --iters 1 --shapes " + want.first + " --json " + json.string());
    ASSERT_EQ(r.code, 0) << op << ":\n" << r.out;
    for (const auto& c : want.second) EXPECT_NE(r.out.find(c), std::string::npos) << op << " lacks " << c << ":\n" << r.out;
    // Bandwidth-bound families also compare each op with a copy of its own byte count.
    const auto table = r.out.find("bandwidth against a copy of the same bytes");
    if (op == "attention") {
      EXPECT_EQ(table, std::string::npos) << r.out;
    } else {
      ASSERT_NE(table, std::string::npos) << op << ":\n" << r.out;
      for (const auto& c : want.second) EXPECT_NE(r.out.find(c, table), std::string::npos) << op << ": " << c << " not in the copy table";
    }
  }
  std::map<std::string, nlohmann::json> got;
  for (const auto& j : read_lines(json)) got[j["case"]] = j;
  for (const auto& [op, want] : ops)
    for (const auto& c : want.second) {
      ASSERT_TRUE(got.count(c)) << c;
      const auto& j = got[c];
      expect_measurement_format(j);
      EXPECT_EQ(j["bench"], op == "attention" ? "attention" : "ops") << c;
      EXPECT_EQ(j["metric"], op == "attention" ? "TFLOP/s" : "GB/s") << c;
      EXPECT_GT(j["ours"].get<double>(), 0.0) << c;
      EXPECT_TRUE(std::isfinite(j["ratio"].get<double>())) << c;
    }
  // The same-size copies are ceiling rows: bytes moved = 2 x the copy's size, a positive rate.
  int copies = 0;
  for (const auto& [c, j] : got)
    if (c.rfind("copy/", 0) == 0 && c != "copy/64MiB") {
      ++copies;
      EXPECT_EQ(j["metric"], "GB/s") << c;
      EXPECT_GT(j["ours"].get<double>(), 0.0) << c;
      EXPECT_DOUBLE_EQ(j["work"].get<double>(), 2.0 * std::stod(c.substr(5))) << c;
    }
  EXPECT_GT(copies, 0);
  // Attention work: 4*B*H*T^2*D halved for causal; backward 2.5x.
  EXPECT_DOUBLE_EQ(got["attention/1x16x4x2x8/fwd"]["work"].get<double>(), 4.0 * 1 * 4 * 16 * 16 * 8 * 0.5);
  EXPECT_DOUBLE_EQ(got["attention/1x16x4x2x8/bwd"]["work"].get<double>(), 2.5 * 4.0 * 1 * 4 * 16 * 16 * 8 * 0.5);
}

// MxNxK+bias / +gelu / +dgelu: the training step's epilogue products of one layer (forward with
// its bias, and GELU out or GELU's derivative in), measured like the plain products.
TEST(BenchmarkCli, GemmShapeWithAnEpilogueTimesTheTrainingStepProducts) {
  Workdir w;
  const auto json = w.path() / "e.jsonl";
  const auto r = run_primus("benchmark gemm --cpu-only --iters 1 --shapes 32x16x8+bias,32x16x8+gelu,32x24x16+dgelu --json " +
                            json.string());
  ASSERT_EQ(r.code, 0) << r.out;
  std::set<std::string> cases;
  for (const auto& j : read_lines(json)) {
    expect_measurement_format(j);
    cases.insert(j["case"].get<std::string>());
  }
  for (const char* c : {"gemm/32x16x8+bias/fwd+bias", "gemm/32x16x8+gelu/fwd+bias+gelu_aux", "gemm/32x24x16+dgelu/dgrad+dgelu",
                        "gemm/32x24x16+dgelu/wgrad_f32+=+bias_grad"})
    EXPECT_EQ(cases.count(c), 1u) << c << " missing:\n" << r.out;
  EXPECT_EQ(cases.count("gemm/32x16x8+bias/dgrad+dgelu"), 0u) << "only +dgelu times the dgelu product";
}

// :padN places an attention case's tensors N MiB further into the arena (same product, other
// addresses: bench/attention/env_ab.sh's process-mode runs); the name says so, and modes combine.
TEST(BenchmarkCli, AttentionPadModeNamesTheCase) {
  Workdir w;
  const auto json = w.path() / "pad.jsonl";
  const auto r = run_primus("benchmark attention --cpu-only --iters 1 --shapes 1x16x4x2x8:pad3:full,1x16x4x2x8 --json " +
                            json.string());
  ASSERT_EQ(r.code, 0) << r.out;
  const std::set<std::string> cases = measured_cases(json);
  EXPECT_EQ(cases, (std::set<std::string>{"attention/1x16x4x2x8_full_pad3/fwd", "attention/1x16x4x2x8_full_pad3/bwd",
                                          "attention/1x16x4x2x8/fwd", "attention/1x16x4x2x8/bwd"}));
}

// --ab times every product under each value of one environment variable in the same process and
// reports each value as its own measurement, in the table and in the JSON.
TEST(BenchmarkCli, InProcessABReportsEachValue) {
  Workdir w;
  const auto json = w.path() / "ab.jsonl";
  const auto r = run_primus("benchmark gemm --cpu-only --shapes 32x16x8 --iters 1 --ab PRIMUS_BENCH_AB_TEST=one,two "
                            "--ab-rounds 2 --json " + json.string());
  ASSERT_EQ(r.code, 0) << r.out;
  const std::set<std::string> cases = measured_cases(json);
  std::set<std::string> want;
  for (const char* p : {"fwd", "dgrad", "wgrad"})
    for (const char* v : {"one", "two"}) want.insert(std::string("gemm/32x16x8/") + p + " [PRIMUS_BENCH_AB_TEST=" + v + "]");
  EXPECT_EQ(cases, want);
  EXPECT_NE(r.out.find("gemm/32x16x8/fwd [PRIMUS_BENCH_AB_TEST=two]"), std::string::npos) << r.out;
}

// layer: a GPT-2 layer on the CPU reference kernels, forward and backward, then its parts; on the
// host even where a GPU is present.
TEST(BenchmarkCli, LayerTimesAGpt2LayerOnTheHost) {
  Workdir w;
  const auto json = w.path() / "layer.jsonl";
  const auto r = run_primus("benchmark layer --iters 1 --shapes 2x16x32x2 --json " + json.string());
  ASSERT_EQ(r.code, 0) << r.out;
  std::map<std::string, nlohmann::json> got;
  for (const auto& j : read_lines(json)) got[j["case"]] = j;
  const std::map<std::string, std::string> want = {
      {"layer/2x16x32x2/fwd", "TFLOP/s"},           {"layer/2x16x32x2/fwdbwd", "TFLOP/s"},
      {"layer/2x16x32x2/attention_fwd", "TFLOP/s"}, {"layer/2x16x32x2/attention_bwd", "TFLOP/s"},
      {"layer/2x16x32x2/fc_fwd", "TFLOP/s"},        {"layer/2x16x32x2/layernorm_fwdbwd", "GB/s"},
      {"layer/2x16x32x2/gelu_fwdbwd", "GB/s"},      {"layer/2x16x32x2/cross_entropy_fwdbwd", "GB/s"}};
  for (const auto& [c, metric] : want) {
    ASSERT_TRUE(got.count(c)) << c << " missing:\n" << r.out;
    const auto& j = got[c];
    expect_measurement_format(j);
    EXPECT_EQ(j["backend"], "CPU") << c;
    EXPECT_EQ(j["dtype"], "f32") << c;
    EXPECT_EQ(j["metric"], metric) << c;
    EXPECT_EQ(j["device"].get<std::string>().rfind("CPU: ", 0), 0u) << j.dump();
    EXPECT_GT(j["ours"].get<double>(), 0.0) << c;
  }
  // Forward: the four linears (12 C^2 multiply-adds per token) and causal attention; the backward
  // counts twice the forward.
  const double N = 2 * 16, C = 32, attn = 4.0 * 2 * 2 * 16 * 16 * 16 * 0.5;
  EXPECT_DOUBLE_EQ(got["layer/2x16x32x2/fwd"]["work"].get<double>(), 2.0 * N * C * C * 12 + attn);
  EXPECT_DOUBLE_EQ(got["layer/2x16x32x2/fwdbwd"]["work"].get<double>(), 3.0 * (2.0 * N * C * C * 12 + attn));
  EXPECT_DOUBLE_EQ(got["layer/2x16x32x2/cross_entropy_fwdbwd"]["work"].get<double>(), 2.0 * 16 * 50257 * 4);
}

// --variants all names every variant of the ops run; those of a backend the run leaves out (TURBO
// without a GPU) do not run, and the CPU lines carry no cross-check (one backend, nothing to set
// them against).
TEST(BenchmarkCli, VariantsOfABackendThatDoesNotRunAreLeftOut) {
  Workdir w;
  const auto json = w.path() / "v.jsonl";
  const auto r = run_primus("benchmark attention --cpu-only --iters 1 --variants all --shapes 1x16x4x2x8 --json " +
                            json.string());
  ASSERT_EQ(r.code, 0) << r.out;
  EXPECT_EQ(measured_cases(json), (std::set<std::string>{"attention/1x16x4x2x8/fwd", "attention/1x16x4x2x8/bwd"}));
  for (const auto& j : read_lines(json)) {
    EXPECT_FALSE(j.contains("xcheck")) << j.dump();
    const std::string c = j["case"];
    if (c.rfind("attention/", 0) == 0) EXPECT_EQ(j["backend"], "CPU") << j.dump();
  }
  EXPECT_EQ(r.out.find("outputs against the first backend"), std::string::npos) << r.out;
}

TEST(BenchmarkCli, BadInputIsOneClearMessage) {
  struct Bad {
    std::string args;
    std::vector<std::string> parts;
  };
  const std::vector<Bad> bad = {
      {"benchmark gemmm --cpu-only", {"unknown op 'gemmm'", "gemm, norm"}},
      {"benchmark gemm --cpu-only --shapes 32x16", {"gemm: shape '32x16' is not MxNxK"}},
      {"benchmark gemm --cpu-only --shapes 32x0x8", {"shape '32x0x8'", "positive integers"}},
      {"benchmark gemm --cpu-only --shapes 32x16x8+relu", {"unknown epilogue '+relu'", "+bias, +gelu or +dgelu"}},
      {"benchmark gemm --cpu-only --shapes 32x16+bias", {"gemm: shape '32x16' is not MxNxK"}},
      {"benchmark attention --cpu-only --shapes 1x16x4x3x8", {"4 heads is not a multiple of 3 kv heads"}},
      {"benchmark attention --cpu-only --shapes 1x16x4x2x8:sliding", {"unknown mode 'sliding'"}},
      {"benchmark attention --cpu-only --shapes 1x16x4x2x8:pad", {"unknown mode 'pad'"}},
      {"benchmark attention --cpu-only --shapes 1x16x4x2x8:pad-1", {"unknown mode 'pad-1'"}},
      {"benchmark gemm --cpu-only --backend CUDNN", {"op 'gemm' has no backend CUDNN", "CUBLASLT, CPU"}},
      {"benchmark gemm --cpu-only --backend FAST", {"unknown --backend 'FAST'"}},
      {"benchmark norm --cpu-only --backend TURBO", {"--backend TURBO needs a CUDA device", "--cpu-only"}},
      {"benchmark gemm --cpu-only --dtype i32", {"--dtype i32 is not bf16, f16 or f32"}},
      {"benchmark gemm --cpu-only --ab PRIMUS_X", {"--ab 'PRIMUS_X'", "VAR=A,B"}},
      {"benchmark gemm --cpu-only --ab =a,b", {"--ab '=a,b'", "VAR=A,B"}},
      {"benchmark gemm --cpu-only --ab PRIMUS_X=a", {"--ab 'PRIMUS_X=a'", "at least two values"}},
      {"benchmark gemm --cpu-only --ab PRIMUS_X=a,,b", {"--ab 'PRIMUS_X=a,,b'", "an empty value"}},
      {"benchmark attention --cpu-only --variants TURBO_SM81", {"unknown variant 'TURBO_SM81'", "TURBO_SM80"}},
      {"benchmark gemm --cpu-only --variants TURBO_SM80", {"TURBO_SM80 is a variant of op 'attention'", "does not benchmark"}},
      {"benchmark attention --cpu-only --variants TURBO_SM80", {"--variants TURBO_SM80 needs a CUDA device", "--cpu-only"}},
      {"benchmark layer --cpu-only --shapes 1x16x30x4", {"layer: shape '1x16x30x4'", "30 features do not split into 4 heads"}},
      {"benchmark layer --cpu-only --shapes 1x16x32", {"layer: shape '1x16x32' is not BxTxCxH"}},
      {"benchmark layer --backend TURBO", {"op 'layer' has no backend TURBO", "CPU"}},
      {"benchmark grouped_gemm --cpu-only --shapes 64x4x8x16x8", {"grouped_gemm shape '64x4x8x16x8'", "top-k 8 above 4 experts"}},
      {"benchmark grouped_gemm --cpu-only --shapes 64x4x2x16", {"grouped_gemm shape '64x4x2x16'", "TxExKxNxC[xA]"}},
  };
  for (const auto& b : bad) {
    const auto r = run_primus(b.args);
    EXPECT_EQ(r.code, 2) << b.args << ":\n" << r.out;
    for (const auto& p : b.parts) EXPECT_NE(r.out.find(p), std::string::npos) << b.args << " lacks '" << p << "':\n" << r.out;
    EXPECT_EQ(r.out.find("terminate called"), std::string::npos) << r.out;
  }
}

TEST(BenchmarkCli, ACaseTheBackendRefusesIsReportedAndARunWithNothingMeasuredFails) {
  Workdir w;
  // RoPE rotates pairs: an odd head dim is refused by the CPU backend with its reason.
  const auto r = run_primus("benchmark rope --cpu-only --iters 1 --shapes 1x8x2x7,1x8x2x8 --json " +
                            (w.path() / "r.jsonl").string());
  EXPECT_EQ(r.code, 0) << r.out;
  EXPECT_NE(r.out.find("rope/1x8x2x7"), std::string::npos) << r.out;
  EXPECT_NE(r.out.find("skipped: rope_forward: head dim"), std::string::npos) << r.out;
  EXPECT_NE(r.out.find("rope_bwd/1x8x2x8"), std::string::npos) << r.out;

  const auto none = run_primus("benchmark rope --cpu-only --iters 1 --shapes 1x8x2x7");
  EXPECT_EQ(none.code, 3) << none.out;
  EXPECT_NE(none.out.find("no measurements were taken"), std::string::npos) << none.out;
  // Named explicitly, the backend's refusal is the error itself.
  const auto named = run_primus("benchmark rope --cpu-only --backend CPU --iters 1 --shapes 1x8x2x7");
  EXPECT_EQ(named.code, 3) << named.out;
  EXPECT_NE(named.out.find("benchmark rope case 'rope/1x8x2x7' on CPU: rope_forward: head dim"), std::string::npos)
      << named.out;
}

// grouped_gemm on the host: one expert layer's three products under the router's counts, in its
// own results file ("bench": "grouped_gemm"), the work counted over the padded rows, and the groups
// written for the PyTorch side when PRIMUS_BENCH_GROUPED_GEMM_GROUPS names a file.
TEST(BenchmarkCli, GroupedGemmTimesAnExpertLayerAndExportsItsGroups) {
  Workdir w;
  const auto json = w.path() / "gg.jsonl", groups = w.path() / "groups.jsonl";
  const auto r = run_primus("benchmark grouped_gemm --cpu-only --iters 1 --shapes 64x4x2x16x8x8 --json " + json.string(),
                            "PRIMUS_BENCH_GROUPED_GEMM_GROUPS=" + groups.string());
  ASSERT_EQ(r.code, 0) << r.out;
  const auto g = read_lines(groups);
  ASSERT_FALSE(g.empty()) << "no groups written";
  EXPECT_EQ(g[0]["case"], "grouped_gemm/64x4x2x16x8x8");
  const auto offsets = g[0]["offsets"].get<std::vector<int64_t>>();
  ASSERT_EQ(offsets.size(), 5u);
  EXPECT_EQ(offsets[0], 0);
  for (size_t i = 1; i < offsets.size(); ++i) {
    EXPECT_GE(offsets[i], offsets[i - 1]);
    EXPECT_EQ(offsets[i] % 8, 0) << "groups padded to the shape's alignment";
  }
  EXPECT_GE(offsets.back(), 64 * 2);  // every (token, k) slot has a row
  EXPECT_EQ(g[0]["M"].get<int64_t>(), 64 * 2 + 4 * 7);
  std::set<std::string> seen;
  for (const auto& j : read_lines(json)) {
    if (j["bench"] != "grouped_gemm") continue;
    expect_measurement_format(j);
    seen.insert(j["case"].get<std::string>());
    EXPECT_EQ(j["metric"], "TFLOP/s");
    EXPECT_DOUBLE_EQ(j["work"].get<double>(), 2.0 * static_cast<double>(offsets.back()) * 16 * 8) << j["case"];
  }
  EXPECT_EQ(seen, (std::set<std::string>{"grouped_gemm/64x4x2x16x8x8/fwd", "grouped_gemm/64x4x2x16x8x8/dgrad",
                                         "grouped_gemm/64x4x2x16x8x8/wgrad"}));
}
