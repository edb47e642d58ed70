// The rates `primus projection performance` divides a step's work by, per device:
//   measured  `primus benchmark ... --cache` distils its JSON lines (one per case and kernel
//             backend) into one rate per part of the step and stores them in a cache file keyed by
//             device name (default ~/.cache/primus/rates.json; PRIMUS_RATES_CACHE or --rates FILE);
//   roofline  without a cache entry: the device's peak dense bf16 FLOP/s and HBM bandwidth from a
//             table keyed by device name (or --peak-tflops / --hbm-gbps), times stated efficiencies.
// The network rate (bus bandwidth of the gradient all-reduce) comes from --net-gbps or from the
// JSON `primus preflight --json FILE` wrote (its largest all-reduce).
#pragma once
#include <filesystem>
#include <istream>
#include <optional>
#include <string>

#include <nlohmann/json.hpp>

namespace primus::train {

struct DeviceRates {
  std::string device;
  double gemm_tflops = 0;          // dense GEMMs of training shapes (forward, dgrad, wgrad)
  double grouped_gemm_tflops = 0;  // the MoE experts' grouped GEMMs
  double attention_tflops = 0;     // fused attention, forward and backward
  double memory_gbs = 0;           // memory-bound kernels (norms, activations, loss, embedding, rope)
  double optimizer_gbs = 0;        // AdamW over the flat buffers
  double peak_tflops = 0;          // the dense bf16 ceiling (MFU's denominator)
  double hbm_gbs = 0;              // the copy ceiling
  double net_gbs = 0;              // bus bandwidth of the data-parallel collectives; 0: unknown
  std::string source;              // e.g. "benchmark cache ~/.cache/primus/rates.json (2026-12-01)"
  std::string date;
};

nlohmann::json rates_to_json(const DeviceRates& r);
DeviceRates rates_from_json(const nlohmann::json& j);

// The rates in `primus benchmark --json` lines of one device (the first device seen when
// `device` is empty): per part, sum(work) / sum(time) over its cases, each case at its fastest
// kernel backend, so a part's rate is what the model's mix of shapes achieves. Throws
// ConfigError when the lines hold no GEMM case (nothing to project compute from).
DeviceRates rates_from_benchmark_lines(std::istream& in, const std::string& device = "");

// The cache file: {"devices": {"<name>": {...rates...}}}.
std::filesystem::path default_rates_cache();  // $PRIMUS_RATES_CACHE, else $XDG_CACHE_HOME/primus/rates.json, else ~/.cache/primus/rates.json
void store_rates(const std::filesystem::path& file, const DeviceRates& r);  // replaces that device's entry
std::optional<DeviceRates> load_rates(const std::filesystem::path& file, const std::string& device);
// The one device of a cache that holds a single device (a laptop sizing a run for the H200 it
// benchmarked); nullopt when there are none or several.
std::optional<DeviceRates> only_cached_device(const std::filesystem::path& file);

// Peak dense bf16 FLOP/s and HBM bandwidth of known datacenter GPUs, by a substring of the
// device name (as cudaGetDeviceProperties and `primus benchmark` spell it): H100, H200, A100,
// ... nullopt for an unknown name.
struct PeakSpec {
  const char* match;
  double tflops, hbm_gbs;
  double memory_gb;  // the data sheet's HBM capacity, 10^9 bytes (whether a projection fits)
};
std::optional<PeakSpec> peak_of_device(const std::string& device);
// Roofline rates from peaks: the fractions of peak that the model's parts reach on Hopper-class
// GPUs in Primus's own benchmarks (docs/projection.md says which); a stated assumption, used
// only when no measured rates are cached.
DeviceRates roofline_rates(const std::string& device, double peak_tflops, double hbm_gbs);

// The bus bandwidth of the largest all-reduce in a `primus preflight --json` report; throws
// IoError / ConfigError naming the file when it cannot be read or has no all-reduce results.
double net_gbs_from_preflight(const std::filesystem::path& file);

}  // namespace primus::train
