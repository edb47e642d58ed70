// primus preflight: GPUs, driver/runtime, NCCL and an all-reduce bandwidth test across the
// local GPUs (backends/cuda/preflight.h says how it is measured). Exits non-zero, saying why,
// on a machine without a GPU or without NCCL.
#include <fstream>
#include <iostream>
#include <memory>

#include "cli/command.h"
#include "core/util/error.h"
#ifdef PRIMUS_BACKEND_CUDA
#include "backends/cuda/preflight.h"
#endif

namespace primus::cli {
namespace {

struct PreflightCli {
  int gpus = 0;
  std::vector<double> mib;
  int iters = 20, warmup = 5;
  bool no_bandwidth = false;
  double timeout = 120;
  std::string json;
};

void setup_preflight(CLI::App& sub) {
  auto o = std::make_shared<PreflightCli>();
  sub.add_option("--gpus", o->gpus, "GPUs in the all-reduce test (default: all visible)")->check(CLI::NonNegativeNumber);
  sub.add_option("--size-mib", o->mib, "All-reduce sizes in MiB (default 8 64 256 1024)")->check(CLI::PositiveNumber);
  sub.add_option("--iters", o->iters, "Timed all-reduces per size")->capture_default_str()->check(CLI::PositiveNumber);
  sub.add_option("--warmup", o->warmup, "Untimed all-reduces first")->capture_default_str()->check(CLI::NonNegativeNumber);
  sub.add_option("--timeout", o->timeout, "Seconds before a hung all-reduce test fails")->capture_default_str();
  sub.add_flag("--no-bandwidth", o->no_bandwidth, "Only report the GPUs and NCCL");
  sub.add_option("--json", o->json, "Also write the report as JSON to this file");
  sub.callback([o] {
#ifdef PRIMUS_BACKEND_CUDA
    backends::cuda::PreflightOptions p;
    p.gpus = o->gpus;
    if (!o->mib.empty()) {
      p.sizes.clear();
      for (double m : o->mib) p.sizes.push_back(static_cast<size_t>(m * 1024 * 1024) / 256 * 256);
    }
    p.iters = o->iters;
    p.warmup = o->warmup;
    p.timeout_s = o->timeout;
    p.bandwidth = !o->no_bandwidth;
    nlohmann::json j = backends::cuda::run_preflight(p, std::cout);
    if (!o->json.empty()) {
      std::ofstream f(o->json);
      if (!f) throw IoError("preflight: cannot write " + o->json);
      f << j.dump(2) << "\n";
    }
    std::cout << "preflight: OK\n";
#else
    throw RuntimeError(
        "preflight: this primus was built without CUDA (no nvcc at build time): there is no GPU support to check; "
        "rebuild with PRIMUS_CUDA=ON");
#endif
  });
}

CommandRegistrar reg_preflight({"preflight",
                                "Check the GPUs, NCCL and all-reduce bandwidth before a (multi-)GPU run",
                                setup_preflight});

}  // namespace
}  // namespace primus::cli
