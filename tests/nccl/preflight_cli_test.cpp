// `primus preflight` through the binary on a machine without a GPU: it must say so and fail
// (exit 3), never print a partial report that looks like success. Skipped where a GPU exists
// (test_nccl_gpu and bench/scaling cover that case).
#include <gtest/gtest.h>

#include <cstdio>
#include <string>
#include <sys/wait.h>

#include "turbo/core/cuda_check.h"

namespace {

TEST(PreflightCli, WithoutAGpuSaysSoAndExitsNonZero) {
  if (primus::turbo::cuda_device_count_or_zero() > 0) GTEST_SKIP() << "a GPU is present";
  const std::string cmd = std::string(PRIMUS_BINARY_DIR) + "/bin/primus preflight 2>&1";
  FILE* f = popen(cmd.c_str(), "r");
  ASSERT_NE(f, nullptr);
  std::string out;
  char buf[4096];
  while (fgets(buf, sizeof(buf), f)) out += buf;
  const int st = pclose(f);
  ASSERT_TRUE(WIFEXITED(st)) << out;
  EXPECT_EQ(WEXITSTATUS(st), 3) << out;
  EXPECT_NE(out.find("preflight: no GPU: the CUDA runtime sees no device"), std::string::npos) << out;
  EXPECT_EQ(out.find("preflight: OK"), std::string::npos) << out;
}

}  // namespace
