#include "backends/cuda/preflight.h"

#include <cuda_runtime_api.h>
#include <dlfcn.h>
#include <fmt/format.h>

#include <atomic>
#include <chrono>
#include <cstdio>
#include <cstdlib>
#include <thread>

#include "backends/cuda/device.h"
#include "core/util/error.h"
#include "parallel/nccl_library.h"
#include "turbo/core/cuda_check.h"

namespace primus::backends::cuda {

namespace nccl = parallel::nccl;

namespace {

std::string cuda_version_text(int v) { return fmt::format("{}.{}", v / 1000, (v % 1000) / 10); }

void nccl_check(const nccl::Library& lib, nccl::Result r, const char* what) {
  if (r != nccl::Success) throw RuntimeError(fmt::format("preflight: {} failed: {}", what, nccl::describe(lib, r)));
}

// The current SM clock (throttling shows here, not in the CUDA attributes) from NVML, opened
// at run time like NCCL: the driver ships libnvidia-ml.so.1. Absent or failing: no clocks.
class Nvml {
 public:
  Nvml() {
    h_ = dlopen("libnvidia-ml.so.1", RTLD_NOW | RTLD_LOCAL);
    if (!h_) return;
    init_ = reinterpret_cast<int (*)()>(dlsym(h_, "nvmlInit_v2"));
    shutdown_ = reinterpret_cast<int (*)()>(dlsym(h_, "nvmlShutdown"));
    by_pci_ = reinterpret_cast<int (*)(const char*, void**)>(dlsym(h_, "nvmlDeviceGetHandleByPciBusId_v2"));
    clock_ = reinterpret_cast<int (*)(void*, int, unsigned*)>(dlsym(h_, "nvmlDeviceGetClockInfo"));
    ok_ = init_ && shutdown_ && by_pci_ && clock_ && init_() == 0;
  }
  ~Nvml() {
    if (ok_) shutdown_();
    if (h_) dlclose(h_);
  }
  // Current SM clock in MHz of the GPU at `pci_bus_id`, or -1.
  int sm_clock_mhz(const char* pci_bus_id) const {
    void* dev = nullptr;
    unsigned mhz = 0;
    if (!ok_ || by_pci_(pci_bus_id, &dev) != 0 || clock_(dev, /*NVML_CLOCK_SM*/ 1, &mhz) != 0) return -1;
    return static_cast<int>(mhz);
  }

 private:
  void* h_ = nullptr;
  bool ok_ = false;
  int (*init_)() = nullptr;
  int (*shutdown_)() = nullptr;
  int (*by_pci_)(const char*, void**) = nullptr;
  int (*clock_)(void*, int, unsigned*) = nullptr;
};

// Ends the process when the bandwidth test outlives its limit (a hung link or GPU): a blocking
// NCCL call cannot be interrupted from the thread that made it.
class Deadline {
 public:
  explicit Deadline(double seconds) {
    t_ = std::thread([this, seconds] {
      auto end = std::chrono::steady_clock::now() + std::chrono::duration<double>(seconds);
      while (!done_) {
        if (std::chrono::steady_clock::now() > end) {
          std::fprintf(stderr, "error: preflight: the all-reduce test did not finish within %.0f s (a GPU or link hangs)\n",
                       seconds);
          std::fflush(stderr);
          std::_Exit(3);
        }
        std::this_thread::sleep_for(std::chrono::milliseconds(50));
      }
    });
  }
  ~Deadline() {
    done_ = true;
    t_.join();
  }

 private:
  std::atomic<bool> done_{false};
  std::thread t_;
};

nlohmann::json bandwidth_test(const nccl::Library& lib, int n, const PreflightOptions& opt, std::ostream& out) {
  Deadline deadline(opt.timeout_s);
  const auto& api = lib.api;
  std::vector<nccl::comm_t> comms(n, nullptr);
  std::vector<cudaStream_t> streams(n, nullptr);
  std::vector<float*> bufs(n, nullptr);
  size_t max_bytes = 0;
  for (size_t s : opt.sizes) max_bytes = std::max(max_bytes, s);
  // Leave room: never more than a quarter of the smallest GPU's free memory.
  for (int d = 0; d < n; ++d) {
    CUDA_CHECK(cudaSetDevice(d));
    size_t free_b = 0, total_b = 0;
    CUDA_CHECK(cudaMemGetInfo(&free_b, &total_b));
    max_bytes = std::min(max_bytes, free_b / 4);
  }
  max_bytes = max_bytes / 256 * 256;
  if (max_bytes == 0) throw RuntimeError("preflight: no free GPU memory for the all-reduce test");
  nccl::UniqueId id{};
  nccl_check(lib, api.GetUniqueId(&id), "ncclGetUniqueId");
  nccl_check(lib, api.GroupStart(), "ncclGroupStart");
  for (int d = 0; d < n; ++d) {
    CUDA_CHECK(cudaSetDevice(d));
    nccl_check(lib, api.CommInitRank(&comms[d], n, id, d), "ncclCommInitRank");
  }
  nccl_check(lib, api.GroupEnd(), "ncclGroupEnd (communicator setup)");
  for (int d = 0; d < n; ++d) {
    CUDA_CHECK(cudaSetDevice(d));
    CUDA_CHECK(cudaStreamCreateWithFlags(&streams[d], cudaStreamNonBlocking));
    CUDA_CHECK(cudaMalloc(reinterpret_cast<void**>(&bufs[d]), max_bytes));
  }
  auto all_reduce = [&](size_t count) {
    nccl_check(lib, api.GroupStart(), "ncclGroupStart");
    for (int d = 0; d < n; ++d) {
      nccl_check(lib, api.AllReduce(bufs[d], bufs[d], count, nccl::Float32, nccl::Sum, comms[d], streams[d]),
                 "ncclAllReduce");
    }
    nccl_check(lib, api.GroupEnd(), "ncclGroupEnd (all-reduce)");
  };
  auto sync_all = [&] {
    for (int d = 0; d < n; ++d) {
      CUDA_CHECK(cudaSetDevice(d));
      CUDA_CHECK(cudaStreamSynchronize(streams[d]));
    }
  };
  // Correctness: ones everywhere -> n everywhere.
  {
    const size_t count = std::min<size_t>(max_bytes / 4, size_t{1} << 20);
    std::vector<float> ones(count, 1.0f), back(count);
    for (int d = 0; d < n; ++d) {
      CUDA_CHECK(cudaSetDevice(d));
      CUDA_CHECK(cudaMemcpy(bufs[d], ones.data(), count * 4, cudaMemcpyHostToDevice));
    }
    all_reduce(count);
    sync_all();
    for (int d = 0; d < n; ++d) {
      CUDA_CHECK(cudaSetDevice(d));
      CUDA_CHECK(cudaMemcpy(back.data(), bufs[d], count * 4, cudaMemcpyDeviceToHost));
      for (size_t i = 0; i < count; ++i) {
        if (back[i] != static_cast<float>(n)) {
          throw RuntimeError(fmt::format("preflight: all-reduce of ones across {} GPUs gave {} at element {} on GPU {} "
                                         "(expected {})",
                                         n, back[i], i, d, n));
        }
      }
    }
  }
  out << fmt::format("all-reduce (f32 sum, {} GPU{} in one process, {} timed iterations after {} warm-up):\n", n,
                     n > 1 ? "s" : "", opt.iters, opt.warmup);
  out << fmt::format("  {:>12}  {:>10}  {:>12}  {:>12}\n", "bytes", "time us", "algbw GB/s", "busbw GB/s");
  nlohmann::json rows = nlohmann::json::array();
  for (size_t bytes : opt.sizes) {
    bytes = std::min(bytes, max_bytes);
    const size_t count = bytes / 4;
    for (int i = 0; i < opt.warmup; ++i) all_reduce(count);
    sync_all();
    auto t0 = std::chrono::steady_clock::now();
    for (int i = 0; i < opt.iters; ++i) all_reduce(count);
    sync_all();
    const double sec = std::chrono::duration<double>(std::chrono::steady_clock::now() - t0).count() / opt.iters;
    const double algbw = static_cast<double>(count * 4) / sec / 1e9;
    const double busbw = algbw * 2.0 * (n - 1) / n;
    out << fmt::format("  {:>12}  {:>10.1f}  {:>12.2f}  {:>12.2f}\n", count * 4, sec * 1e6, algbw, busbw);
    rows.push_back({{"bytes", count * 4}, {"seconds", sec}, {"algbw_gbs", algbw}, {"busbw_gbs", busbw}});
  }
  if (n == 1) out << "  (one GPU: an all-reduce moves no data between GPUs; bus bandwidth is 0 by definition)\n";
  for (int d = 0; d < n; ++d) {
    cudaSetDevice(d);
    cudaFree(bufs[d]);
    cudaStreamDestroy(streams[d]);
    api.CommDestroy(comms[d]);
  }
  return rows;
}

}  // namespace

nlohmann::json run_preflight(const PreflightOptions& opt, std::ostream& out) {
  nlohmann::json j;
  int driver = 0, runtime = 0;
  cudaDriverGetVersion(&driver);
  cudaRuntimeGetVersion(&runtime);
  j["cuda_driver"] = driver ? cuda_version_text(driver) : "none";
  j["cuda_runtime"] = cuda_version_text(runtime);
  int count = 0;
  cudaError_t e = cudaGetDeviceCount(&count);
  if (e != cudaSuccess || count == 0) {
    out << fmt::format("CUDA driver: {}, runtime: {}\n", driver ? cuda_version_text(driver) : "not installed",
                       cuda_version_text(runtime));
    out.flush();
    throw RuntimeError(fmt::format("preflight: no GPU: the CUDA runtime sees no device ({}); this machine cannot run "
                                   "the cuda backend",
                                   e != cudaSuccess ? cudaGetErrorString(e) : "0 devices"));
  }
  out << fmt::format("CUDA driver {} (supports up to CUDA {}), runtime {}; {} GPU{} visible{}\n", driver,
                     cuda_version_text(driver), cuda_version_text(runtime), count, count > 1 ? "s" : "",
                     std::getenv("CUDA_VISIBLE_DEVICES") ? fmt::format(" (CUDA_VISIBLE_DEVICES={})",
                                                                        std::getenv("CUDA_VISIBLE_DEVICES"))
                                                          : "");
  nlohmann::json gpus = nlohmann::json::array();
  const Nvml nvml;
  for (int d = 0; d < count; ++d) {
    cudaDeviceProp p{};
    CUDA_CHECK(cudaGetDeviceProperties(&p, d));
    int sm_khz = 0, mem_khz = 0, bus_bits = 0;
    cudaDeviceGetAttribute(&sm_khz, cudaDevAttrClockRate, d);
    cudaDeviceGetAttribute(&mem_khz, cudaDevAttrMemoryClockRate, d);
    cudaDeviceGetAttribute(&bus_bits, cudaDevAttrGlobalMemoryBusWidth, d);
    CUDA_CHECK(cudaSetDevice(d));
    size_t free_b = 0, total_b = 0;
    CUDA_CHECK(cudaMemGetInfo(&free_b, &total_b));
    char pci[32] = {0};
    cudaDeviceGetPCIBusId(pci, sizeof(pci), d);
    const int sm_now = nvml.sm_clock_mhz(pci);
    out << fmt::format("GPU {}: {} (sm_{}{}, {} SMs, SM clock {} / max {} MHz, memory clock {} MHz x {} bit), {:.1f} "
                       "GiB ({:.1f} GiB free), PCI {}\n",
                       d, p.name, p.major, p.minor, p.multiProcessorCount,
                       sm_now >= 0 ? std::to_string(sm_now) : std::string("? (no NVML)"), sm_khz / 1000,
                       mem_khz / 1000, bus_bits, gib(total_b), gib(free_b), pci);
    gpus.push_back({{"index", d},
                    {"name", p.name},
                    {"cc", fmt::format("{}.{}", p.major, p.minor)},
                    {"sms", p.multiProcessorCount},
                    {"sm_clock_mhz", sm_now},
                    {"sm_clock_max_mhz", sm_khz / 1000},
                    {"mem_clock_mhz", mem_khz / 1000},
                    {"total_gib", gib(total_b)},
                    {"free_gib", gib(free_b)},
                    {"pci", pci}});
  }
  j["gpus"] = gpus;
  const std::string nvls = nccl::disable_nvls_unless_set();
  const nccl::Library* lib = nullptr;
  try {
    lib = &nccl::library();
  } catch (const RuntimeError& err) {
    out << "NCCL: not available\n";
    out.flush();
    throw RuntimeError(fmt::format("preflight: {}", err.what()));
  }
  out << fmt::format("NCCL {} from {} (found via {}); NCCL_NVLS_ENABLE={}\n", lib->version(), lib->path, lib->how, nvls);
  j["nccl"] = {{"version", lib->version()}, {"path", lib->path}, {"found_via", lib->how}, {"nvls_enable", nvls}};
  if (opt.bandwidth) {
    int n = opt.gpus > 0 ? opt.gpus : count;
    if (n > count) throw ConfigError(fmt::format("preflight: --gpus {} but only {} GPU(s) are visible", n, count));
    j["allreduce"] = bandwidth_test(*lib, n, opt, out);
    j["allreduce_gpus"] = n;
  }
  out.flush();
  return j;
}

}  // namespace primus::backends::cuda
