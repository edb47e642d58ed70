// `primus preflight`: is this machine ready for a (multi-)GPU run? It reports the GPUs the CUDA
// runtime sees (name, memory, SM count, current SM clock through NVML where the driver has it,
// maximum SM and memory clocks, PCI bus), the driver and runtime versions,
// which NCCL was loaded and from where, and measures all-reduce bandwidth across the local
// GPUs.
//
// The bandwidth test is one process driving every local GPU: one communicator per GPU, created
// together inside ncclGroupStart/End (what ncclCommInitAll does), each all-reduce issued for
// all GPUs in one group. It needs no launcher, and measures the same NVLink/PCIe paths a job of
// one rank per GPU uses. Bus bandwidth is NCCL-tests' definition: algbw x 2(n-1)/n, comparable
// across GPU counts; the first all-reduce's result is checked (every element = n).
#pragma once
#include <cstddef>
#include <ostream>
#include <string>
#include <vector>

#include <nlohmann/json.hpp>

namespace primus::backends::cuda {

struct PreflightOptions {
  int gpus = 0;                        // GPUs in the bandwidth test; 0: every visible one
  std::vector<size_t> sizes = {size_t{8} << 20, size_t{64} << 20, size_t{256} << 20, size_t{1} << 30};  // bytes
  int warmup = 5, iters = 20;
  bool bandwidth = true;               // false: report only
  double timeout_s = 120;              // the bandwidth test's time limit (a hung GPU or link)
};

// Runs the checks, printing a report to `out`; returns a JSON summary (gpus, versions, nccl,
// allreduce results). Throws RuntimeError when there is no GPU or no usable NCCL (so the CLI
// exits non-zero), naming what is missing; a failed correctness check is an error too.
nlohmann::json run_preflight(const PreflightOptions& opt, std::ostream& out);

}  // namespace primus::backends::cuda
