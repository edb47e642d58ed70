// NcclProcessGroup across real processes, one per local GPU (label gpu: skipped without a GPU,
// and the multi-rank cases without two). Each rank is nccl_test_worker with torchrun's
// variables; the output of every rank is collected and checked here.
#include <gtest/gtest.h>

#include <chrono>
#include <cstdio>
#include <cstdlib>
#include <string>

#include "turbo/core/cuda_check.h"

namespace {

struct RankRun {
  int status = 0;
  std::string out;
  double seconds = 0;
};

// Starts `world` workers on local GPUs 0..world-1 (a free port, timeout `timeout_s`), waits for
// all, and returns their interleaved output. A stopped rank is killed once the others are done.
RankRun run_ranks(int world, const std::string& mode, int timeout_s) {
  // PRIMUS_NCCL_TEST_WORKER: where the worker is when the tests run away from their build tree.
  const char* env_worker = std::getenv("PRIMUS_NCCL_TEST_WORKER");
  const std::string worker = env_worker && *env_worker ? env_worker : std::string(PRIMUS_BINARY_DIR) + "/bin/nccl_test_worker";
  const int port = 20000 + (static_cast<int>(::getpid()) % 20000);
  std::string script = "pids=''; ";
  for (int r = 0; r < world; ++r) {
    script += "RANK=" + std::to_string(r) + " WORLD_SIZE=" + std::to_string(world) + " LOCAL_RANK=" + std::to_string(r) +
              " LOCAL_WORLD_SIZE=" + std::to_string(world) + " MASTER_ADDR=127.0.0.1 MASTER_PORT=" +
              std::to_string(port) + " PRIMUS_DIST_TIMEOUT=" + std::to_string(timeout_s) + " " + worker + " " + mode +
              " & pids=\"$pids $!\"; ";
  }
  // rank 0 decides; then everything left (a stopped rank) is killed
  script += "p0=$(echo $pids | cut -d' ' -f1); wait $p0; rc=$?; kill -9 $pids 2>/dev/null; wait 2>/dev/null; exit $rc";
  const std::string cmd = "bash -c '" + [&] {
    std::string s;
    for (char c : script) s += c == '\'' ? std::string("'\\''") : std::string(1, c);
    return s;
  }() + "' 2>&1";
  auto t0 = std::chrono::steady_clock::now();
  RankRun r;
  FILE* f = popen(cmd.c_str(), "r");
  char buf[4096];
  while (f && fgets(buf, sizeof(buf), f)) r.out += buf;
  int st = f ? pclose(f) : -1;
  r.status = WIFEXITED(st) ? WEXITSTATUS(st) : -1;
  r.seconds = std::chrono::duration<double>(std::chrono::steady_clock::now() - t0).count();
  return r;
}

int gpus() { return primus::turbo::cuda_device_count_or_zero(); }

TEST(NcclGpu, CollectivesOnOneGpu) {
  if (gpus() < 1) GTEST_SKIP() << "no CUDA device";
  RankRun r = run_ranks(1, "collectives", 60);
  EXPECT_EQ(r.status, 0) << r.out;
  EXPECT_NE(r.out.find("OK rank 0"), std::string::npos) << r.out;
  EXPECT_NE(r.out.find("NVLS=0"), std::string::npos) << r.out;
}

TEST(NcclGpu, CollectivesOnTwoGpusMatchTheSerialReduction) {
  if (gpus() < 2) GTEST_SKIP() << "needs 2 GPUs, found " << gpus();
  RankRun r = run_ranks(2, "collectives", 60);
  EXPECT_EQ(r.status, 0) << r.out;
  EXPECT_NE(r.out.find("OK rank 0"), std::string::npos) << r.out;
  EXPECT_NE(r.out.find("OK rank 1"), std::string::npos) << r.out;
}

TEST(NcclGpu, StoppedRankIsNamedWithinTheTimeout) {
  if (gpus() < 2) GTEST_SKIP() << "needs 2 GPUs, found " << gpus();
  RankRun r = run_ranks(2, "hang", 5);
  EXPECT_EQ(r.status, 3) << r.out;
  EXPECT_NE(r.out.find("ERROR rank 0: NCCL all_reduce(1024 x f32) #"), std::string::npos) << r.out;
  EXPECT_NE(r.out.find("did not complete within the 5 s timeout"), std::string::npos) << r.out;
  EXPECT_NE(r.out.find("rank 1 (no heartbeat"), std::string::npos) << r.out;
  EXPECT_LT(r.seconds, 5 + 20) << r.out;  // timeout + setup + diagnosis
}

TEST(NcclGpu, RankThatExitsIsNamed) {
  if (gpus() < 2) GTEST_SKIP() << "needs 2 GPUs, found " << gpus();
  RankRun r = run_ranks(2, "leave", 5);
  EXPECT_EQ(r.status, 3) << r.out;
  EXPECT_NE(r.out.find("ERROR rank 0: NCCL all_reduce"), std::string::npos) << r.out;
  EXPECT_NE(r.out.find("rank 1 (no heartbeat"), std::string::npos) << r.out;
  EXPECT_LT(r.seconds, 5 + 20) << r.out;
}

}  // namespace
