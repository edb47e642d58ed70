// One rank of a multi-process run of the cuda trainer in host mode (the model on Turbo's CPU
// kernels), for tests that launch it with `primus launch --exec` and compare with one process:
//   cuda_host_trainer_worker <experiment.yaml> [key=value ...]
// The rank, world and store come from the launcher's variables, as for `primus train`.
//
// PRIMUS_TEST_SIGNAL_RANK=r with PRIMUS_TEST_SIGNAL_AFTER=<file>: rank r alone sends itself SIGUSR1
// (the trainer's stop request) once the file exists, e.g. the first checkpoint's tracker: a stop
// signal that reaches one rank of the job, at a step of its own.
#include <signal.h>
#include <unistd.h>

#include <chrono>
#include <cstdio>
#include <cstdlib>
#include <exception>
#include <filesystem>
#include <string>
#include <thread>
#include <vector>

#include "tests/cuda_gpu/trainer_runs.h"

int main(int argc, char** argv) {
  if (argc < 2) {
    std::fprintf(stderr, "usage: %s <experiment.yaml> [key=value ...]\n", argv[0]);
    return 2;
  }
  const char* signal_rank = std::getenv("PRIMUS_TEST_SIGNAL_RANK");
  const char* signal_after = std::getenv("PRIMUS_TEST_SIGNAL_AFTER");
  const char* rank = std::getenv("RANK");
  if (signal_rank && signal_after && rank && std::string(signal_rank) == rank) {
    std::thread([file = std::string(signal_after)] {
      while (!std::filesystem::exists(file)) std::this_thread::sleep_for(std::chrono::milliseconds(2));
      ::kill(::getpid(), SIGUSR1);
    }).detach();
  }
  try {
    primus::backends::cuda::testing::run_host_trainer(argv[1], std::vector<std::string>(argv + 2, argv + argc));
  } catch (const std::exception& e) {
    std::fprintf(stderr, "cuda_host_trainer_worker: %s\n", e.what());
    return 1;
  }
  return 0;
}
