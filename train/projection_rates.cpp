#include "train/projection_rates.h"

#include <fmt/format.h>

#include <cstdlib>
#include <fstream>
#include <map>
#include <sstream>

#include "core/util/error.h"

namespace primus::train {

namespace fs = std::filesystem;
using nlohmann::json;

json rates_to_json(const DeviceRates& r) {
  return {{"device", r.device},
          {"gemm_tflops", r.gemm_tflops},
          {"grouped_gemm_tflops", r.grouped_gemm_tflops},
          {"attention_tflops", r.attention_tflops},
          {"memory_gbs", r.memory_gbs},
          {"optimizer_gbs", r.optimizer_gbs},
          {"peak_tflops", r.peak_tflops},
          {"hbm_gbs", r.hbm_gbs},
          {"net_gbs", r.net_gbs},
          {"source", r.source},
          {"date", r.date}};
}

DeviceRates rates_from_json(const json& j) {
  DeviceRates r;
  auto num = [&](const char* k) { return j.contains(k) && j[k].is_number() ? j[k].get<double>() : 0.0; };
  auto str = [&](const char* k) { return j.contains(k) && j[k].is_string() ? j[k].get<std::string>() : std::string(); };
  r.device = str("device");
  r.gemm_tflops = num("gemm_tflops");
  r.grouped_gemm_tflops = num("grouped_gemm_tflops");
  r.attention_tflops = num("attention_tflops");
  r.memory_gbs = num("memory_gbs");
  r.optimizer_gbs = num("optimizer_gbs");
  r.peak_tflops = num("peak_tflops");
  r.hbm_gbs = num("hbm_gbs");
  r.net_gbs = num("net_gbs");
  r.source = str("source");
  r.date = str("date");
  return r;
}

namespace {

// A part's cases: per case the fastest backend's time for its work (benchmark lines carry "work"
// in FLOPs or bytes and "ms" per call).
struct RatePartSums {
  std::map<std::string, std::pair<double, double>> best;  // case -> (work, ms)
  void add(const std::string& c, double work, double ms) {
    auto it = best.find(c);
    if (it == best.end() || ms < it->second.second) best[c] = {work, ms};
  }
  // work / time in units of 10^12 per second (TFLOP/s) or 10^9 (GB/s)
  double rate(double unit) const {
    double w = 0, s = 0;
    for (const auto& [c, wm] : best) w += wm.first, s += wm.second * 1e-3;
    return s > 0 ? w / s / unit : 0.0;
  }
};

bool rates_starts_with(const std::string& s, const char* p) { return s.rfind(p, 0) == 0; }

}  // namespace

DeviceRates rates_from_benchmark_lines(std::istream& in, const std::string& device) {
  DeviceRates r;
  r.device = device;
  RatePartSums gemm, grouped, attention, memory, optimizer;
  std::string line, date;
  int64_t n = 0;
  while (std::getline(in, line)) {
    if (line.find_first_not_of(" \t\r") == std::string::npos) continue;
    json j = json::parse(line, nullptr, false);
    if (j.is_discarded() || !j.is_object()) continue;
    const std::string dev = j.value("device", "");
    if (r.device.empty()) r.device = dev;
    if (dev != r.device) continue;
    const std::string c = j.value("case", ""), metric = j.value("metric", ""), backend = j.value("backend", "");
    if (backend == "CPU" && r.device.find("NVIDIA") != std::string::npos) continue;  // the reference kernels
    const double value = j.contains("ours") && j["ours"].is_number() ? j["ours"].get<double>() : 0.0;
    if (c.rfind("ceiling/gemm", 0) == 0) r.peak_tflops = std::max(r.peak_tflops, value);
    if (rates_starts_with(c, "copy/")) r.hbm_gbs = std::max(r.hbm_gbs, value);
    if (!j.contains("ms") || !j["ms"].is_number() || !j.contains("work") || !j["work"].is_number()) continue;
    const double ms = j["ms"].get<double>(), work = j["work"].get<double>();
    if (ms <= 0 || work <= 0) continue;
    ++n;
    date = j.value("date", date);
    const std::string bench = j.value("bench", "");
    const bool flops = metric.find("TFLOP/s") != std::string::npos;
    if (bench == "grouped_gemm") grouped.add(c, work, ms);
    else if (bench == "attention" || rates_starts_with(c, "attention")) attention.add(c, work, ms);
    else if (rates_starts_with(c, "gemm/") && flops) gemm.add(c, work, ms);
    else if (rates_starts_with(c, "adamw")) optimizer.add(c, work, ms);
    else if (!flops && !rates_starts_with(c, "copy/") && !rates_starts_with(c, "grad_norm") && !rates_starts_with(c, "layer"))
      memory.add(c, work, ms);
  }
  r.gemm_tflops = gemm.rate(1e12);
  r.grouped_gemm_tflops = grouped.rate(1e12);
  r.attention_tflops = attention.rate(1e12);
  r.memory_gbs = memory.rate(1e9);
  r.optimizer_gbs = optimizer.rate(1e9);
  r.date = date;
  if (r.gemm_tflops <= 0) {
    throw ConfigError(fmt::format("projection rates: no GEMM measurements{} in the benchmark lines ({} usable lines); "
                                  "run `primus benchmark gemm attention norm activation optimizer grouped_gemm --cache`",
                                  r.device.empty() ? "" : " of " + r.device, n));
  }
  return r;
}

fs::path default_rates_cache() {
  if (const char* e = std::getenv("PRIMUS_RATES_CACHE"); e && *e) return e;
  if (const char* x = std::getenv("XDG_CACHE_HOME"); x && *x) return fs::path(x) / "primus" / "rates.json";
  if (const char* h = std::getenv("HOME"); h && *h) return fs::path(h) / ".cache" / "primus" / "rates.json";
  return {};
}

namespace {
json rates_read_file(const fs::path& file) {
  std::ifstream f(file);
  if (!f) return json::object();
  json j = json::parse(f, nullptr, false);
  if (j.is_discarded() || !j.is_object()) throw ConfigError(fmt::format("rates cache {}: not a JSON object", file.string()));
  return j;
}
}  // namespace

void store_rates(const fs::path& file, const DeviceRates& r) {
  if (file.empty()) throw IoError("rates cache: no file (set PRIMUS_RATES_CACHE or HOME)");
  json j = fs::exists(file) ? rates_read_file(file) : json::object();
  j["devices"][r.device] = rates_to_json(r);
  if (file.has_parent_path()) fs::create_directories(file.parent_path());
  // Written whole and renamed, so a reader never sees half a file.
  const fs::path tmp = file.string() + ".tmp";
  {
    std::ofstream o(tmp);
    if (!o) throw IoError(fmt::format("rates cache: cannot write {}", tmp.string()));
    o << j.dump(2) << "\n";
    if (!o) throw IoError(fmt::format("rates cache: write to {} failed", tmp.string()));
  }
  fs::rename(tmp, file);
}

std::optional<DeviceRates> load_rates(const fs::path& file, const std::string& device) {
  if (file.empty() || !fs::exists(file)) return std::nullopt;
  const json j = rates_read_file(file);
  if (!j.contains("devices") || !j["devices"].contains(device)) return std::nullopt;
  return rates_from_json(j["devices"][device]);
}

std::optional<DeviceRates> only_cached_device(const fs::path& file) {
  if (file.empty() || !fs::exists(file)) return std::nullopt;
  const json j = rates_read_file(file);
  if (!j.contains("devices") || j["devices"].size() != 1) return std::nullopt;
  return rates_from_json(j["devices"].begin().value());
}

std::optional<PeakSpec> peak_of_device(const std::string& device) {
  // Dense bf16 tensor-core peaks (no sparsity) and HBM bandwidth, SXM parts, from NVIDIA's data
  // sheets. Order matters: the first substring found wins ("H100 PCIe" before "H100").
  static const PeakSpec table[] = {
      {"H200", 989.0, 4800.0, 141},          {"H100 PCIe", 756.0, 2000.0, 80},      {"H100 NVL", 835.0, 3900.0, 94},
      {"H100", 989.0, 3350.0, 80},           {"H800", 989.0, 3350.0, 80},           {"GH200", 989.0, 4000.0, 96},
      {"A100-SXM4-40GB", 312.0, 1555.0, 40}, {"A100-PCIE-40GB", 312.0, 1555.0, 40}, {"A100", 312.0, 2039.0, 80},
      {"A800", 312.0, 2039.0, 80},           {"L40S", 362.0, 864.0, 48},            {"B200", 2250.0, 8000.0, 180},
  };
  for (const PeakSpec& p : table)
    if (device.find(p.match) != std::string::npos) return p;
  return std::nullopt;
}

DeviceRates roofline_rates(const std::string& device, double peak_tflops, double hbm_gbs) {
  // Fractions of peak measured by `primus benchmark` on an H100 and an H200 (bench/results/ops.jsonl,
  // attention.jsonl): the GPT-2 and Llama training GEMMs average 0.67-0.73 of the 989 TFLOP/s peak,
  // fused attention 0.42, the memory-bound kernels 0.61-0.73 of the HBM figure; olmoe-mini's
  // profiled step on an H200 (docs/performance.md) has the expert grouped GEMMs at ~600 TFLOP/s
  // (0.60) and AdamW streaming its flat buffers at ~3.9 TB/s (0.80). Cache measured rates
  // (`primus benchmark ... --cache`) to replace all of these.
  DeviceRates r;
  r.device = device;
  r.peak_tflops = peak_tflops;
  r.hbm_gbs = hbm_gbs;
  r.gemm_tflops = 0.70 * peak_tflops;
  r.grouped_gemm_tflops = 0.60 * peak_tflops;
  r.attention_tflops = 0.42 * peak_tflops;
  r.memory_gbs = 0.65 * hbm_gbs;
  r.optimizer_gbs = 0.80 * hbm_gbs;
  return r;
}

double net_gbs_from_preflight(const fs::path& file) {
  std::ifstream f(file);
  if (!f) throw IoError(fmt::format("--preflight {}: cannot read the file", file.string()));
  const json j = json::parse(f, nullptr, false);
  if (j.is_discarded()) throw ConfigError(fmt::format("--preflight {}: not JSON (`primus preflight --json FILE` writes it)", file.string()));
  if (!j.contains("allreduce") || !j["allreduce"].is_array() || j["allreduce"].empty()) {
    throw ConfigError(fmt::format("--preflight {}: no all-reduce results (run `primus preflight --json FILE` with "
                                  "at least 2 GPUs)",
                                  file.string()));
  }
  double bytes = -1, bw = 0;
  for (const json& row : j["allreduce"]) {
    const double b = row.value("bytes", 0.0);
    if (b > bytes) bytes = b, bw = row.value("busbw_gbs", 0.0);
  }
  if (bw <= 0) throw ConfigError(fmt::format("--preflight {}: the all-reduce rows have no busbw_gbs", file.string()));
  return bw;
}

}  // namespace primus::train
