// `primus projection`'s backend-neutral parts (train/projection.h, projection_rates.h): the step
// time is the sum of its parts, recomputation and MoE add what they should, a multi-GPU layout
// without a bandwidth is refused, benchmark lines distil into the work-weighted rate of the
// fastest backend per case, the rates cache and the projection JSON round-trip every field.
#include <gtest/gtest.h>

#include <cstdlib>
#include <filesystem>
#include <fstream>
#include <sstream>

#include <unistd.h>

#include "core/util/error.h"
#include "train/projection.h"
#include "train/projection_rates.h"

namespace primus::train {
namespace {

ModelSpec projection_gpt2_spec() {
  ModelSpec s;
  s.model_type = "gpt2";
  s.vocab_size = 50257;
  s.padded_vocab_size = 50304;
  s.seq_length = 1024;
  s.num_layers = 12;
  s.hidden_size = 768;
  s.num_attention_heads = 12;
  s.num_query_groups = 12;
  s.ffn_hidden_size = 3072;
  return s;
}

ModelSpec projection_moe_spec() {
  ModelSpec s = projection_gpt2_spec();
  s.model_type = "mixtral";
  s.layernorm = false, s.swiglu = true, s.rope = true, s.untied = true, s.bias = false;
  s.num_query_groups = 4;
  s.moe.num_experts = 8;
  s.moe.topk = 2;
  s.moe.ffn_hidden_size = 1024;
  s.moe.moe_layers.assign(size_t(s.num_layers), true);
  return s;
}

ProjectionLayout projection_layout(int64_t gpus, int64_t mb, int64_t accum) {
  ProjectionLayout l;
  l.gpus = gpus;
  l.micro_batch = mb;
  l.grad_accum = accum;
  l.global_batch = mb * accum * gpus;
  l.seq_length = 1024;
  return l;
}

DeviceRates projection_rates() { return roofline_rates("NVIDIA H200", 989, 4800); }

double sum_seconds(const TimeProjection& t) {
  double s = 0;
  for (const TimePart& p : t.parts) s += p.seconds;
  return s;
}

TEST(ProjectionTime, OneGpuIsTheSumOfItsPartsEachWorkOverRate) {
  const TimeProjection t = project_step_time(projection_gpt2_spec(), projection_layout(1, 16, 2), projection_rates(), {});
  ASSERT_GE(t.parts.size(), 4u);
  EXPECT_NEAR(t.step_seconds, sum_seconds(t), 1e-12);
  for (const TimePart& p : t.parts) {
    const double unit = p.unit == "flop" ? 1e12 : 1e9;
    EXPECT_NEAR(p.seconds, p.work / (p.rate * unit), 1e-12 * p.seconds) << p.name;
  }
  // The dense GEMMs: 6 FLOPs per matmul parameter per token over 32768 tokens.
  const ModelSpec s = projection_gpt2_spec();
  const double per_layer = 768.0 * (3 * 768) + 768.0 * 768 + 2 * 768.0 * 3072;
  const double expect = 6 * 32768.0 * (12 * per_layer + 768.0 * 50304);
  EXPECT_NEAR(t.parts.at(0).work, expect, 1e-9 * expect);
  EXPECT_NEAR(t.tokens_per_second, 32768 / t.step_seconds, 1e-6);
  EXPECT_GT(t.mfu, 0.0);
  EXPECT_LT(t.mfu, 1.0);
}

TEST(ProjectionTime, RecomputationAddsForwardWork) {
  ProjectionLayout l = projection_layout(1, 16, 1);
  const TimeProjection none = project_step_time(projection_gpt2_spec(), l, projection_rates(), {});
  l.recompute = "selective";
  const TimeProjection sel = project_step_time(projection_gpt2_spec(), l, projection_rates(), {});
  l.recompute = "full";
  const TimeProjection full = project_step_time(projection_gpt2_spec(), l, projection_rates(), {});
  EXPECT_LT(none.parts[0].work, sel.parts[0].work);
  EXPECT_LT(sel.parts[0].work, full.parts[0].work);
  // Full recompute: one more forward of every layer's matmuls, 2 of the 6 FLOPs per parameter.
  const double layers = 12 * (768.0 * (3 * 768) + 768.0 * 768 + 2 * 768.0 * 3072);
  EXPECT_NEAR(full.parts[0].work - none.parts[0].work, 2 * 16384.0 * layers, 1e-6 * layers);
  l.recompute = "sometimes";
  EXPECT_THROW(project_step_time(projection_gpt2_spec(), l, projection_rates(), {}), ConfigError);
}

TEST(ProjectionTime, MoeExpertsAreGroupedGemmsOfTheChosenExperts) {
  const TimeProjection t = project_step_time(projection_moe_spec(), projection_layout(1, 4, 1), projection_rates(), {});
  const TimePart* g = nullptr;
  for (const TimePart& p : t.parts)
    if (p.name == "grouped_gemm") g = &p;
  ASSERT_NE(g, nullptr);
  // top-2 of width 1024, gate|up and down: 3 * F * C parameters each, 6 FLOPs, 4096 tokens, 12 layers.
  EXPECT_NEAR(g->work, 6 * 4096.0 * 12 * 2 * 3 * 1024.0 * 768, 1.0);
  EXPECT_NEAR(t.step_seconds, sum_seconds(t), 1e-12);
}

TEST(ProjectionTime, DataParallelNeedsABandwidthAndAddsItsCollectives) {
  const ProjectionLayout l = projection_layout(8, 16, 1);
  try {
    project_step_time(projection_gpt2_spec(), l, projection_rates(), {});
    FAIL() << "8 GPUs without a bandwidth were projected";
  } catch (const ConfigError& e) {
    EXPECT_NE(std::string(e.what()).find("--net-gbps"), std::string::npos) << e.what();
  }
  DeviceRates r = projection_rates();
  r.net_gbs = 100;
  ProjectionLayout plain = l;
  plain.overlap_grad_reduce = false;
  const TimeProjection t = project_step_time(projection_gpt2_spec(), plain, r, {});
  const double P = double(projection_gpt2_spec().num_parameters());
  // Not overlapped: the all-reduce of fp32 gradients adds 2 (W-1)/W x 4P bytes at 100 GB/s.
  const double ar = 4 * P * 2 * 7.0 / 8 / 100e9;
  EXPECT_NEAR(t.step_seconds, sum_seconds(t), 1e-9);
  EXPECT_NEAR(t.parts.back().seconds, ar, 1e-12);
  ProjectionLayout zero = plain;
  zero.zero1 = true;
  const TimeProjection z = project_step_time(projection_gpt2_spec(), zero, r, {});
  // Reduce-scatter of fp32 gradients and all-gather of bf16 weights; the optimizer works on 1/8.
  EXPECT_NEAR(z.step_seconds - t.step_seconds, (4 * P * 7.0 / 8 + 2 * P * 7.0 / 8) / 100e9 - ar -
                                                   (t.parts[3].seconds - z.parts[3].seconds),
              1e-9);
  EXPECT_NEAR(z.parts[3].work * 8, t.parts[3].work, 1e-6 * t.parts[3].work);
  // Overlapped: what the last backward hides is not added.
  const TimeProjection o = project_step_time(projection_gpt2_spec(), l, r, {});
  EXPECT_TRUE(o.comm_overlapped);
  EXPECT_LT(o.step_seconds, t.step_seconds);
}

TEST(ProjectionRates, BenchmarkLinesGiveTheFastestBackendPerCaseWorkWeighted) {
  const std::string dev = "NVIDIA H200";
  auto line = [&](const std::string& bench, const std::string& c, const std::string& backend, const std::string& metric,
                  double work, double ms) {
    return "{\"bench\": \"" + bench + "\", \"case\": \"" + c + "\", \"device\": \"" + dev +
           "\", \"date\": \"2026-12-01\", \"metric\": \"" + metric + "\", \"ours\": 1, \"backend\": \"" + backend +
           "\", \"ms\": " + std::to_string(ms) + ", \"work\": " + std::to_string(work) + "}\n";
  };
  std::stringstream in;
  in << "{\"bench\": \"ops\", \"case\": \"ceiling/gemm_8192\", \"device\": \"" << dev
     << "\", \"metric\": \"TFLOP/s\", \"ours\": 800.5}\n"
     << "{\"bench\": \"ops\", \"case\": \"copy/512MiB\", \"device\": \"" << dev << "\", \"metric\": \"GB/s\", \"ours\": 4200}\n"
     << line("ops", "gemm/a/fwd", "CUBLASLT", "TFLOP/s", 6e12, 10)   // 600 TFLOP/s
     << line("ops", "gemm/a/fwd", "TURBO", "TFLOP/s", 6e12, 20)      // slower backend: ignored
     << line("ops", "gemm/b/fwd", "CUBLASLT", "TFLOP/s", 2e12, 10)   // 200 TFLOP/s
     << line("attention", "causal/fwd", "CUDNN", "TFLOP/s", 4e12, 10)
     << line("grouped_gemm", "moe/fc", "TURBO", "TFLOP/s", 5e12, 10)
     << line("ops", "rmsnorm_fwd/llama", "TURBO", "GB/s", 3e9, 1)
     << line("ops", "adamw/1B", "TURBO", "GB/s", 28e9, 10)
     << line("ops", "gemm/c/fwd", "CPU", "TFLOP/s", 1e9, 1000)       // the reference kernels: ignored
     << "not json\n"
     << "{\"bench\": \"ops\", \"case\": \"gemm/x/fwd\", \"device\": \"other\", \"metric\": \"TFLOP/s\", \"ms\": 1, \"work\": 1e15}\n";
  const DeviceRates r = rates_from_benchmark_lines(in);
  EXPECT_EQ(r.device, dev);
  EXPECT_NEAR(r.gemm_tflops, 8e12 / 0.020 / 1e12, 1e-9);  // (6 + 2) TFLOP over 20 ms
  EXPECT_NEAR(r.attention_tflops, 400, 1e-9);
  EXPECT_NEAR(r.grouped_gemm_tflops, 500, 1e-9);
  EXPECT_NEAR(r.memory_gbs, 3000, 1e-9);
  EXPECT_NEAR(r.optimizer_gbs, 2800, 1e-9);
  EXPECT_DOUBLE_EQ(r.peak_tflops, 800.5);
  EXPECT_DOUBLE_EQ(r.hbm_gbs, 4200);
  EXPECT_EQ(r.date, "2026-12-01");
  std::stringstream none("{\"bench\": \"ops\", \"case\": \"copy/1\", \"device\": \"d\", \"ms\": 1, \"work\": 1}\n");
  EXPECT_THROW(rates_from_benchmark_lines(none), ConfigError);
}

TEST(ProjectionRates, CacheKeepsOneEntryPerDeviceAndPreflightGivesTheBusBandwidth) {
  const auto dir = std::filesystem::temp_directory_path() / ("primus-rates-" + std::to_string(::getpid()));
  std::filesystem::remove_all(dir);
  const auto file = dir / "sub" / "rates.json";
  DeviceRates a = roofline_rates("GPU A", 100, 1000);
  a.date = "2026-12-01";
  DeviceRates b = roofline_rates("GPU B", 200, 2000);
  EXPECT_FALSE(load_rates(file, "GPU A"));
  store_rates(file, a);
  ASSERT_TRUE(only_cached_device(file));
  EXPECT_EQ(only_cached_device(file)->device, "GPU A");
  store_rates(file, b);
  EXPECT_FALSE(only_cached_device(file));  // two devices: the user must name one
  a.gemm_tflops = 77;
  store_rates(file, a);  // replaces A's entry
  const auto got = load_rates(file, "GPU A");
  ASSERT_TRUE(got);
  EXPECT_EQ(rates_to_json(*got), rates_to_json(a));
  EXPECT_EQ(load_rates(file, "GPU B")->peak_tflops, 200);
  EXPECT_FALSE(load_rates(file, "GPU C"));

  const auto pre = dir / "preflight.json";
  std::ofstream(pre) << R"({"allreduce": [{"bytes": 8388608, "busbw_gbs": 100.0}, {"bytes": 1073741824, "busbw_gbs": 360.5}]})";
  EXPECT_DOUBLE_EQ(net_gbs_from_preflight(pre), 360.5);
  std::ofstream(pre) << R"({"gpus": []})";
  EXPECT_THROW(net_gbs_from_preflight(pre), ConfigError);
  EXPECT_THROW(net_gbs_from_preflight(dir / "missing.json"), IoError);
  std::filesystem::remove_all(dir);
  ASSERT_TRUE(peak_of_device("NVIDIA H100 PCIe"));
  EXPECT_EQ(peak_of_device("NVIDIA H100 PCIe")->tflops, 756);
  EXPECT_EQ(peak_of_device("NVIDIA H200")->hbm_gbs, 4800);
  EXPECT_FALSE(peak_of_device("NVIDIA GeForce RTX 4090"));
}

TEST(ProjectionJson, RoundTripsEveryField) {
  Projection p;
  p.config = "exp.yaml";
  p.backend = "cuda";
  p.model = "gpt2 12 layers";
  p.parameters = 124475904;
  p.active_parameters = 85056000;
  p.layout = projection_layout(4, 8, 2);
  p.layout.zero1 = true;
  p.layout.grad_reduce_in_bf16 = true;
  p.layout.overlap_grad_reduce = false;
  p.layout.recompute = "selective";
  p.layout.fp8 = "hybrid";
  p.device_memory_bytes = 150e9;
  p.has_memory = true;
  p.memory.source = "plan";
  p.memory.add("weights", "bf16", 1000);
  p.memory.add("activations", "layers", 2500.5);
  p.memory.add("activations", "head", 10);
  p.memory.add("comm", "nothing", 0);  // empty parts are left out
  p.memory.notes = {"a note"};
  DeviceRates r = projection_rates();
  r.net_gbs = 50;
  r.source = "table";
  p.time = project_step_time(projection_gpt2_spec(), p.layout, r, {});
  p.time.notes = {"time note"};
  p.has_time = true;
  EXPECT_EQ(p.memory.parts.size(), 3u);
  EXPECT_DOUBLE_EQ(p.memory.total(), 3510.5);
  EXPECT_DOUBLE_EQ(p.memory.bytes("activations"), 2510.5);

  const nlohmann::json j = projection_to_json(p);
  EXPECT_DOUBLE_EQ(j["memory"]["total_bytes"].get<double>(), 3510.5);
  const Projection q = projection_from_json(nlohmann::json::parse(j.dump()));
  EXPECT_EQ(projection_to_json(q), j);
  EXPECT_EQ(q.layout.fp8, "hybrid");
  EXPECT_EQ(q.time.parts.size(), p.time.parts.size());
  EXPECT_DOUBLE_EQ(q.time.step_seconds, p.time.step_seconds);
  nlohmann::json broken = j;
  broken["layout"].erase("gpus");
  EXPECT_THROW(projection_from_json(broken), ConfigError);
  // The text forms name every part and the total.
  const std::string table = format_projection(p);
  for (const char* w : {"weights", "activations", "total", "gemm", "comm", "step", "a note"})
    EXPECT_NE(table.find(w), std::string::npos) << w << "\n" << table;
  EXPECT_EQ(memory_summary_line(p.memory), "3.4 KiB per GPU: activations 2.5 KiB, weights 1.0 KiB");
}

}  // namespace
}  // namespace primus::train
