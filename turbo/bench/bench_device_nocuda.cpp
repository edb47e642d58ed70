// make_cuda_bench_device in a build without CUDA.
#include "turbo/bench/bench_device.h"

namespace primus::turbo::bench {
std::unique_ptr<BenchDevice> make_cuda_bench_device(size_t, std::string* why) {
  if (why) *why = "this build of primus has no CUDA parts (configured with PRIMUS_CUDA=OFF or without nvcc)";
  return nullptr;
}
}  // namespace primus::turbo::bench
