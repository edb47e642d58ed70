// GlooProcessGroup between real processes (fork()ed ranks, the parent hosts the store): the
// collectives of a 2x2 mesh's sub-groups equal the serial ones, a rank killed with SIGKILL is
// named long before the timeout (in a sub-group too), and a rank stopped with SIGSTOP is named when the timeout passes.
#include <gtest/gtest.h>

#include "parallel/parallel_dims.h"
#include "tests/parallel/pg_fork_util.h"

namespace primus::parallel {
namespace {

class GlooPGProcesses : public ForkedRanksTest {
 protected:
  Forked fork_ranks(int world, Ms timeout, const RankBody& body) {
    return fork_group_ranks(PgEngine::Gloo, world, timeout, body);
  }
  void expect_exit(const Forked& f, int r, int code) {
    const int st = wait_rank(f, r);
    EXPECT_TRUE(WIFEXITED(st) && WEXITSTATUS(st) == code) << "rank " << r << " status " << st << ": " << report(f, r);
  }
};

// 4 processes as tp 2 x dp 2: an all-reduce in the tp group, a reduce-scatter and an all-gather
// in the dp group, a broadcast in the world, each checked exactly.
TEST_F(GlooPGProcesses, MeshSubGroupsBetweenProcesses) {
  auto f = fork_ranks(4, Ms(10000), [](ProcessGroup& world, std::string& report) {
    ParallelSizes s;
    s[Dim::TP] = 2;
    s = s.for_world(4);
    const ParallelDims dims(s, 4, world.rank());
    auto tp = world.new_subgroup(dims.group_ranks(Dim::TP), dims.group_name(Dim::TP));
    auto dp = world.new_subgroup(dims.group_ranks(Dim::DP), dims.group_name(Dim::DP));
    const int me = world.rank();
    std::vector<float> a(1000);
    for (size_t i = 0; i < a.size(); ++i) a[i] = input_value(me, i);
    tp->all_reduce(a.data(), a.size(), DType::F32, ReduceOp::Sum);
    const int peer = me ^ 1;  // the other rank of my tp group
    for (size_t i = 0; i < a.size(); ++i) {
      if (a[i] != input_value(me, i) + input_value(peer, i)) {
        report = fmt::format("tp all_reduce element {}: {}", i, a[i]);
        return 1;
      }
    }
    std::vector<float> send(2 * 3), recv(3);
    for (size_t i = 0; i < send.size(); ++i) send[i] = static_cast<float>(me * 100 + static_cast<int>(i));
    dp->reduce_scatter(send.data(), recv.data(), 3, DType::F32, ReduceOp::Sum);
    const int other = me ^ 2;  // the other rank of my dp group
    for (size_t i = 0; i < 3; ++i) {
      const size_t j = static_cast<size_t>(dp->rank()) * 3 + i;
      const float want = static_cast<float>(me * 100 + other * 100 + 2 * static_cast<int>(j));
      if (recv[i] != want) {
        report = fmt::format("dp reduce_scatter element {}: {} != {}", i, recv[i], want);
        return 1;
      }
    }
    float v = 42.f + static_cast<float>(me);
    world.broadcast(&v, 1, DType::F32, 3);
    if (v != 45.f) {
      report = fmt::format("broadcast: {}", v);
      return 1;
    }
    world.barrier();
    return 0;
  });
  for (int r = 0; r < 4; ++r) expect_exit(f, r, 0);
}

// SIGKILL mid-run: the kernel closes the dead rank's connections, the survivors fail at once
// and their heartbeat check names rank 1, long before the 20 s timeout.
TEST_F(GlooPGProcesses, KilledRankIsNamedLongBeforeTheTimeout) {
  const int world = 3;
  auto t0 = Clock::now();
  auto f = fork_ranks(world, Ms(20000), [&](ProcessGroup& pg, std::string&) {
    std::vector<float> buf(50000, 1.f);
    for (int step = 0; step < 1000; ++step) {
      if (pg.rank() == 1 && step == 3) ::raise(SIGKILL);
      pg.all_reduce(buf.data(), buf.size(), DType::F32, ReduceOp::Avg);
    }
    return 0;
  });
  const int st1 = wait_rank(f, 1);
  EXPECT_TRUE(WIFSIGNALED(st1) && WTERMSIG(st1) == SIGKILL);
  for (int r : {0, 2}) {
    expect_exit(f, r, 3);
    const std::string e = report(f, r);
    EXPECT_NE(e.find("all_reduce of 50000 f32 elements"), std::string::npos) << e;
    // The other survivor may be named too, as having left (it failed first).
    EXPECT_NE(e.find("rank 1 (no heartbeat"), std::string::npos) << e;
  }
  EXPECT_LT(seconds_since(t0), 10.0);
}

// A rank killed while its dp sub-group reduces: its dp peer names it by world rank and by its
// rank in the group; the other dp group finishes untouched.
TEST_F(GlooPGProcesses, KilledRankOfASubGroupIsNamedByWorldAndGroupRank) {
  auto f = fork_ranks(4, Ms(20000), [](ProcessGroup& world, std::string&) {
    ParallelSizes s;
    s[Dim::TP] = 2;
    const ParallelDims dims(s.for_world(4), 4, world.rank());
    auto dp = world.new_subgroup(dims.group_ranks(Dim::DP), dims.group_name(Dim::DP));  // {0,2}, {1,3}
    std::vector<float> buf(1000, 1.f);
    for (int step = 0; step < 200; ++step) {
      if (world.rank() == 3 && step == 3) ::raise(SIGKILL);
      dp->all_reduce(buf.data(), buf.size(), DType::F32, ReduceOp::Avg);
    }
    return 0;
  });
  const int st3 = wait_rank(f, 3);
  EXPECT_TRUE(WIFSIGNALED(st3) && WTERMSIG(st3) == SIGKILL);
  expect_exit(f, 0, 0);
  expect_exit(f, 2, 0);
  expect_exit(f, 1, 3);
  const std::string e = report(f, 1);
  EXPECT_NE(e.find("on rank 0/2 (gloo group 'procpg"), std::string::npos) << e;
  EXPECT_NE(e.find("/dp1-3')"), std::string::npos) << e;
  EXPECT_NE(e.find("missing: rank 3 (rank 1 of the group) (no heartbeat"), std::string::npos) << e;
}

// SIGSTOP: the process is alive and its connections open; Gloo's timeout fires and the
// heartbeat check names the stopped rank.
TEST_F(GlooPGProcesses, StoppedRankIsNamedWithinTheTimeout) {
  auto f = fork_ranks(2, Ms(1000), [&](ProcessGroup& pg, std::string& report) {
    std::vector<float> buf(1000, 1.f);
    for (int step = 0; step < 1000000; ++step) {
      if (pg.rank() == 1 && step == 3) ::raise(SIGSTOP);
      auto t0 = Clock::now();
      try {
        pg.all_reduce(buf.data(), buf.size(), DType::F32, ReduceOp::Avg);
      } catch (const CollectiveError& e) {
        report = fmt::format("{:.2f} {}", seconds_since(t0), e.what());
        return 4;
      }
    }
    return 0;
  });
  const int st0 = wait_rank(f, 0);
  ::kill(f.pids[1], SIGKILL);
  wait_rank(f, 1);
  ASSERT_TRUE(WIFEXITED(st0) && WEXITSTATUS(st0) == 4) << "status " << st0 << ": " << report(f, 0);
  const std::string e = report(f, 0);
  const double waited = std::stod(e);
  EXPECT_GE(waited, 0.95) << e;
  EXPECT_LT(waited, 3.0) << e;  // the timeout, then three heartbeat periods
  EXPECT_NE(e.find("all_reduce of 1000 f32 elements on rank 0/2"), std::string::npos) << e;
  EXPECT_NE(e.find("missing: rank 1 (no heartbeat for"), std::string::npos) << e;
}

}  // namespace
}  // namespace primus::parallel
