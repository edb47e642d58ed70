// The rendezvous store between real processes: forked ranks exchange an NCCL-sized id through a
// store hosted by the parent, and a host that crashes ends every client's wait at once.
#include <gtest/gtest.h>
#include <sys/wait.h>
#include <unistd.h>

#include <thread>

#include "tests/core/test_util.h"
#include "tests/parallel/store_test_util.h"

namespace primus::parallel {
namespace {

using primus::testing::expect_error;

// Real processes: the parent hosts the store, forked children rendezvous through it the way
// ranks exchange the NCCL id, then report through a counter.
TEST_F(StoreTest, AcrossProcesses) {
  constexpr int kChildren = 3;
  std::string id = random_bytes(rng_, 128);
  std::vector<pid_t> pids;
  for (int r = 1; r <= kChildren; ++r) {
    pid_t pid = ::fork();
    ASSERT_GE(pid, 0);
    if (pid == 0) {
      int rc = 0;
      try {
        TcpStore s("127.0.0.1", server_->port(), false, Ms(5000));
        s.barrier("start", r, kChildren + 1);
        if (s.get("nccl_id") != id) rc = 1;
        s.add("matched", rc == 0 ? 1 : 0);
        s.barrier("end", r, kChildren + 1);
      } catch (const std::exception& e) {
        std::fprintf(stderr, "child %d: %s\n", r, e.what());
        rc = 2;
      }
      ::_exit(rc);
    }
    pids.push_back(pid);
  }
  server_->set("nccl_id", id);
  server_->barrier("start", 0, kChildren + 1);
  server_->barrier("end", 0, kChildren + 1);
  EXPECT_EQ(server_->get("matched"), std::to_string(kChildren));
  for (pid_t pid : pids) {
    int st = 0;
    ASSERT_EQ(::waitpid(pid, &st, 0), pid);
    EXPECT_TRUE(WIFEXITED(st) && WEXITSTATUS(st) == 0) << "status " << st;
  }
}

// Rank 0 crashing (a process that dies without cleaning up) ends every wait on it at once.
TEST(TcpStore, HostCrashIsAnErrorNotAHang) {
  int pipefd[2];
  ASSERT_EQ(::pipe(pipefd), 0);
  pid_t pid = ::fork();
  ASSERT_GE(pid, 0);
  if (pid == 0) {
    TcpStore host("127.0.0.1", 0, true, Ms(5000));
    int port = host.port();
    [[maybe_unused]] ssize_t n = ::write(pipefd[1], &port, sizeof port);
    std::this_thread::sleep_for(Ms(200));
    ::_exit(1);  // no destructors: the server vanishes as in a crash
  }
  int port = 0;
  ASSERT_EQ(::read(pipefd[0], &port, sizeof port), static_cast<ssize_t>(sizeof port));
  TcpStore c("127.0.0.1", port, false, Ms(10000));
  auto t0 = Clock::now();
  expect_error<RuntimeError>([&] { c.get("never", Ms(10000)); }, {"closed the connection", "rank 0"});
  EXPECT_LT(seconds_since(t0), 3.0);
  ::waitpid(pid, nullptr, 0);
  ::close(pipefd[0]);
  ::close(pipefd[1]);
}

}  // namespace
}  // namespace primus::parallel
