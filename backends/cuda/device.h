// The GPU a CUDA run trains on: selection with clear errors, the facts the trainer logs, and the
// dense bf16 peak used for MFU.
#pragma once
#include <cstddef>
#include <string>

namespace primus::backends::cuda {

// Bytes in GiB (2^30), for log lines and metrics.
inline double gib(size_t bytes) { return static_cast<double>(bytes) / double(size_t{1} << 30); }

struct DeviceInfo {
  int index = 0;
  std::string name;            // e.g. "NVIDIA H100 80GB HBM3"
  int cc_major = 0, cc_minor = 0;
  int sm_count = 0;
  size_t total_bytes = 0;
};

// Makes `index` the current device of this thread. Throws RuntimeError "no CUDA device ..."
// when the driver reports none (or no driver is installed), ConfigError when `index` is out of
// range, and RuntimeError for devices older than sm_80 (bf16 tensor cores).
DeviceInfo select_device(int index);

// Dense bf16 tensor-core peak in FLOP/s from the device name (train::peak_of_device's table:
// A100 312e12, H100 SXM / H200 / GH200 989e12, H100 PCIe 756e12, B200 2.25e15); 0 when the name
// is not in the table.
double peak_bf16_flops(const std::string& device_name);

// Bytes in use on the current device (all processes: total - free) and its capacity.
struct MemoryUse {
  size_t used = 0, total = 0;
};
MemoryUse device_memory();

}  // namespace primus::backends::cuda
