// One rank of a multi-process run of the cuda trainer in host mode (the model on Turbo's CPU
// kernels), for tests that launch it with `primus launch --exec` and compare with one process:
//   cuda_host_trainer_worker <experiment.yaml> [key=value ...]
// The rank, world and store come from the launcher's variables, as for `primus train`.
#include <cstdio>
#include <exception>
#include <string>
#include <vector>

#include "tests/cuda_gpu/trainer_runs.h"

int main(int argc, char** argv) {
  if (argc < 2) {
    std::fprintf(stderr, "usage: %s <experiment.yaml> [key=value ...]\n", argv[0]);
    return 2;
  }
  try {
    primus::backends::cuda::testing::run_host_trainer(argv[1], std::vector<std::string>(argv + 2, argv + argc));
  } catch (const std::exception& e) {
    std::fprintf(stderr, "cuda_host_trainer_worker: %s\n", e.what());
    return 1;
  }
  return 0;
}
