#include "backends/cuda/device.h"

#include <cuda_runtime_api.h>
#include <fmt/format.h>

#include "core/util/error.h"
#include "train/projection_rates.h"
#include "turbo/core/cuda_check.h"

namespace primus::backends::cuda {

DeviceInfo select_device(int index) {
  int count = 0;
  cudaError_t err = cudaGetDeviceCount(&count);
  if (err != cudaSuccess || count == 0) {
    if (err != cudaSuccess) (void)cudaGetLastError();  // clear the sticky error for later callers
    throw RuntimeError(fmt::format(
        "no CUDA device: the cuda backend needs an NVIDIA GPU and its driver ({}); train on the CPU with "
        "`framework: reference`",
        err != cudaSuccess ? std::string(cudaGetErrorString(err)) : std::string("the driver reports 0 devices")));
  }
  if (index < 0 || index >= count) {
    throw ConfigError(fmt::format("device: {} is not a CUDA device index (this machine has {}: 0..{})", index, count,
                                  count - 1));
  }
  CUDA_CHECK(cudaSetDevice(index));
  cudaDeviceProp p{};
  CUDA_CHECK(cudaGetDeviceProperties(&p, index));
  DeviceInfo d;
  d.index = index;
  d.name = p.name;
  d.cc_major = p.major;
  d.cc_minor = p.minor;
  d.sm_count = p.multiProcessorCount;
  d.total_bytes = p.totalGlobalMem;
  if (d.cc_major < 8) {
    throw RuntimeError(fmt::format("CUDA device {} ({}, sm_{}{}) has no bf16 tensor cores; the cuda backend needs "
                                   "sm_80 or newer",
                                   index, d.name, d.cc_major, d.cc_minor));
  }
  return d;
}

double peak_bf16_flops(const std::string& n) {
  const auto p = train::peak_of_device(n);  // one table for MFU and the projection's roofline
  return p ? p->tflops * 1e12 : 0.0;
}

MemoryUse device_memory() {
  size_t free = 0, total = 0;
  CUDA_CHECK(cudaMemGetInfo(&free, &total));
  return {total - free, total};
}

}  // namespace primus::backends::cuda
