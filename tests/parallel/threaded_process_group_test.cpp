// The threaded process group on host memory: every collective on 2, 3 and 4 rank threads against
// values computed here (tests/parallel/threaded_pg_checks.h), sub-groups of a 2 x 2 mesh working
// concurrently, 1000 back-to-back all_reduces; and the failures: a rank that never calls is
// named within the timeout, a destroyed rank at once, abort() wakes the waiters, ranks that
// disagree on a collective all throw.
#include <gtest/gtest.h>

#include <chrono>
#include <thread>

#include "tests/parallel/threaded_pg_checks.h"

namespace primus::parallel::threaded_test {
namespace {

HostTestMemory host;

TEST(ThreadedPG, NamesItselfAndItsRanks) {
  auto out = run_ranks(host, 3, Ms(5000), [](ProcessGroup& pg) {
    EXPECT_EQ(pg.backend(), "threads");
    EXPECT_EQ(pg.world_size(), 3);
    EXPECT_EQ(pg.timeout(), Ms(5000));
    pg.barrier();
    pg.synchronize();
  });
  expect_all_ok(out, "names");
}

TEST(ThreadedPG, AllReduceSumAvgAndMaxF32AndBf16) { check_all_reduce(host); }
TEST(ThreadedPG, ReduceScatterInPlaceAndNot) { check_reduce_scatter(host); }
TEST(ThreadedPG, AllGatherInPlaceAndNot) { check_all_gather(host); }
TEST(ThreadedPG, BroadcastFromEveryRoot) { check_broadcast(host); }
TEST(ThreadedPG, AllToAllAndUnevenAllToAllV) { check_all_to_all(host); }
TEST(ThreadedPG, SendRecvRingAndTags) { check_send_recv(host); }
TEST(ThreadedPG, MeshSubGroupsRunConcurrently) { check_mesh_subgroups(host, 200); }
TEST(ThreadedPG, ThousandSmallAllReduces) {
  for (int world : kWorlds) check_many_small_all_reduces(host, world, 1000);
}

TEST(ThreadedPG, WorldOfOneCopiesAndReducesToItself) {
  auto out = run_ranks(host, 1, Ms(1000), [](ProcessGroup& pg) {
    std::vector<float> v = {1.5f, -2.f}, g(2);
    pg.all_reduce(v.data(), 2, DType::F32, ReduceOp::Avg);
    EXPECT_EQ(v, (std::vector<float>{1.5f, -2.f}));
    pg.all_gather(v.data(), g.data(), 2, DType::F32);
    EXPECT_EQ(g, v);
    EXPECT_THROW(pg.broadcast(v.data(), 2, DType::F32, 1), CollectiveError);
    EXPECT_THROW(pg.send(v.data(), 2, DType::F32, 0), CollectiveError);
  });
  expect_all_ok(out, "world 1");
}

// Rank 2 holds its group but never calls: ranks 0 and 1 throw within the timeout plus a margin,
// naming rank 2 and the operation; rank 2's later call fails at once (the group is aborted).
TEST(ThreadedPG, RankThatNeverCallsIsNamedWithinTheTimeout) {
  const Ms timeout(400);
  std::string late_error;
  auto out = run_ranks(host, 3, timeout, [&](ProcessGroup& pg) {
    std::vector<float> v(8, 1.f);
    if (pg.rank() == 2) {
      std::this_thread::sleep_for(timeout * 3);
      try {
        pg.all_reduce(v.data(), 8, DType::F32, ReduceOp::Sum);
      } catch (const CollectiveError& e) {
        late_error = e.what();
      }
      return;
    }
    pg.barrier();  // a first call that rank 2 makes no part of, so it is "behind"
  });
  for (int r = 0; r < 2; ++r) {
    ASSERT_FALSE(out[static_cast<size_t>(r)].ok) << r;
    const std::string& e = out[static_cast<size_t>(r)].error;
    EXPECT_NE(e.find("barrier on rank " + std::to_string(r) + "/3 (threads group 'world')"), std::string::npos) << e;
    EXPECT_NE(e.find("rank 2 (has made no collective call"), std::string::npos) << e;
    EXPECT_NE(e.find("timeout 0.4 s"), std::string::npos) << e;
    EXPECT_GE(out[static_cast<size_t>(r)].seconds, 0.35) << e;
    EXPECT_LT(out[static_cast<size_t>(r)].seconds, 0.4 + 1.5) << e;
  }
  EXPECT_NE(late_error.find("all_reduce of 8 f32 elements on rank 2/3"), std::string::npos) << late_error;
  EXPECT_NE(late_error.find("aborted"), std::string::npos) << late_error;
}

// A rank one collective behind is named with the call it made last.
TEST(ThreadedPG, MissingRankIsNamedWithItsLatestCall) {
  auto out = run_ranks(host, 2, Ms(300), [&](ProcessGroup& pg) {
    std::vector<float> v(4, 1.f);
    pg.broadcast(v.data(), 4, DType::F32, 0);
    if (pg.rank() == 0) pg.all_reduce(v.data(), 4, DType::F32, ReduceOp::Sum);
    if (pg.rank() == 1) std::this_thread::sleep_for(Ms(900));
  });
  ASSERT_FALSE(out[0].ok);
  EXPECT_NE(out[0].error.find("all_reduce of 4 f32 elements on rank 0/2"), std::string::npos) << out[0].error;
  EXPECT_NE(out[0].error.find("missing: rank 1 (has made 1 of these 2 collective calls; its latest call: broadcast "
                              "of 4 f32 elements from rank 0)"),
            std::string::npos)
      << out[0].error;
}

// A sub-group member that stops: the error names its world rank and its rank in the group.
TEST(ThreadedPG, SubGroupNamesTheMissingMemberByWorldAndGroupRank) {
  auto out = run_ranks(host, 4, Ms(300), [&](ProcessGroup& pg) {
    const int r = pg.rank();
    auto dp = pg.new_subgroup({r % 2, r % 2 + 2}, "dp" + std::to_string(r % 2));
    std::vector<float> v(4, 1.f);
    if (r == 3) {
      std::this_thread::sleep_for(Ms(900));
      return;
    }
    dp->all_reduce(v.data(), 4, DType::F32, ReduceOp::Sum);
  });
  EXPECT_TRUE(out[0].ok) << out[0].error;
  EXPECT_TRUE(out[2].ok) << out[2].error;
  ASSERT_FALSE(out[1].ok);
  EXPECT_NE(out[1].error.find("(threads group 'world/dp1')"), std::string::npos) << out[1].error;
  EXPECT_NE(out[1].error.find("missing: rank 3 (rank 1 of the group)"), std::string::npos) << out[1].error;
}

TEST(ThreadedPG, SubGroupMemberThatNeverJoinsIsNamed) {
  auto out = run_ranks(host, 3, Ms(300), [&](ProcessGroup& pg) {
    if (pg.rank() == 2) {
      std::this_thread::sleep_for(Ms(900));
      return;
    }
    pg.new_subgroup({0, 2, 1}, "odd");
  });
  for (int r = 0; r < 2; ++r) {
    ASSERT_FALSE(out[static_cast<size_t>(r)].ok);
    EXPECT_NE(out[static_cast<size_t>(r)].error.find("sub-group 'world/odd' setup"), std::string::npos)
        << out[static_cast<size_t>(r)].error;
    EXPECT_NE(out[static_cast<size_t>(r)].error.find("rank 2 (rank 1 of the group)"), std::string::npos)
        << out[static_cast<size_t>(r)].error;
  }
}

// A rank whose group is destroyed is named at once, not after the timeout.
TEST(ThreadedPG, RankThatLeftIsNamedAtOnce) {
  auto out = run_ranks(host, 3, Ms(20000), [&](ProcessGroup& pg) {
    if (pg.rank() == 1) return;  // its group is destroyed on return
    std::vector<float> v(4, 1.f);
    pg.all_reduce(v.data(), 4, DType::F32, ReduceOp::Sum);
  });
  for (int r : {0, 2}) {
    ASSERT_FALSE(out[static_cast<size_t>(r)].ok);
    EXPECT_NE(out[static_cast<size_t>(r)].error.find("rank 1 (left the group"), std::string::npos)
        << out[static_cast<size_t>(r)].error;
    EXPECT_LT(out[static_cast<size_t>(r)].seconds, 5.0);
  }
}

TEST(ThreadedPG, SendWithoutMatchingRecvNamesThePeer) {
  auto out = run_ranks(host, 2, Ms(300), [&](ProcessGroup& pg) {
    std::vector<float> v(4, 1.f);
    if (pg.rank() == 0) pg.send(v.data(), 4, DType::F32, 1, 9);
    if (pg.rank() == 1) std::this_thread::sleep_for(Ms(900));
  });
  ASSERT_FALSE(out[0].ok);
  EXPECT_NE(out[0].error.find("send of 4 f32 elements to rank 1 (tag 9) on rank 0/2"), std::string::npos)
      << out[0].error;
  EXPECT_NE(out[0].error.find("missing: rank 1 (has not posted the matching recv"), std::string::npos) << out[0].error;
}

TEST(ThreadedPG, SendRecvSizeMismatchFailsBothSides) {
  auto out = run_ranks(host, 2, Ms(5000), [&](ProcessGroup& pg) {
    std::vector<float> v(8, 1.f);
    if (pg.rank() == 0) pg.send(v.data(), 4, DType::F32, 1);
    if (pg.rank() == 1) pg.recv(v.data(), 8, DType::F32, 0);
  });
  for (int r = 0; r < 2; ++r) {
    ASSERT_FALSE(out[static_cast<size_t>(r)].ok);
    EXPECT_NE(out[static_cast<size_t>(r)].error.find("16 bytes"), std::string::npos)
        << out[static_cast<size_t>(r)].error;
    EXPECT_NE(out[static_cast<size_t>(r)].error.find("32 bytes"), std::string::npos)
        << out[static_cast<size_t>(r)].error;
  }
}

// The hub's abort() (a supervisor's) and a rank's abort() both wake every waiter at once.
TEST(ThreadedPG, AbortWakesEveryWaiter) {
  for (bool by_rank : {false, true}) {
    std::shared_ptr<ThreadedGroup> hub;
    auto out = run_ranks(
        host, 3, Ms(30000),
        [&](ProcessGroup& pg) {
          std::vector<float> v(4, 1.f);
          if (pg.rank() == 2) {
            std::this_thread::sleep_for(Ms(200));
            if (by_rank) {
              pg.abort();
              return;
            }
            hub->abort("stopped by the test");
            return;
          }
          if (pg.rank() == 1) {
            std::vector<float> w(4);
            pg.recv(w.data(), 4, DType::F32, 2);  // a point-to-point waiter too
          }
          pg.all_reduce(v.data(), 4, DType::F32, ReduceOp::Sum);
        },
        &hub);
    for (int r = 0; r < 2; ++r) {
      ASSERT_FALSE(out[static_cast<size_t>(r)].ok);
      const std::string& e = out[static_cast<size_t>(r)].error;
      EXPECT_NE(e.find("the process group was aborted"), std::string::npos) << e;
      EXPECT_NE(e.find(by_rank ? "abort() was called on rank 2/3" : "stopped by the test"), std::string::npos) << e;
      EXPECT_LT(out[static_cast<size_t>(r)].seconds, 5.0) << e;
    }
  }
}

TEST(ThreadedPG, AbortReachesSubGroups) {
  std::shared_ptr<ThreadedGroup> hub;
  auto out = run_ranks(
      host, 2, Ms(30000),
      [&](ProcessGroup& pg) {
        auto sub = pg.new_subgroup({0, 1}, "all");
        if (pg.rank() == 1) {
          std::this_thread::sleep_for(Ms(200));
          hub->abort("shutdown");
          return;
        }
        sub->barrier();
      },
      &hub);
  ASSERT_FALSE(out[0].ok);
  EXPECT_NE(out[0].error.find("barrier on rank 0/2 (threads group 'world/all')"), std::string::npos) << out[0].error;
  EXPECT_NE(out[0].error.find("shutdown"), std::string::npos) << out[0].error;
}

// Ranks that call different collectives, or different counts, all throw, listing every call.
TEST(ThreadedPG, RanksThatDisagreeAllThrow) {
  auto out = run_ranks(host, 3, Ms(5000), [&](ProcessGroup& pg) {
    std::vector<float> v(8, 1.f);
    if (pg.rank() == 1) {
      pg.broadcast(v.data(), 8, DType::F32, 0);
    } else {
      pg.all_reduce(v.data(), pg.rank() == 2 ? 7 : 8, DType::F32, ReduceOp::Sum);
    }
  });
  for (int r = 0; r < 3; ++r) {
    ASSERT_FALSE(out[static_cast<size_t>(r)].ok);
    const std::string& e = out[static_cast<size_t>(r)].error;
    EXPECT_NE(e.find("rank 0 called all_reduce of 8 f32 elements, rank 1 called broadcast of 8 f32 elements from rank "
                     "0, rank 2 called all_reduce of 7 f32 elements"),
              std::string::npos)
        << e;
  }
  auto bad_counts = run_ranks(host, 2, Ms(5000), [&](ProcessGroup& pg) {
    std::vector<float> s(4), r(4);
    // rank 0 sends 2 to rank 1, which expects 1
    std::vector<size_t> sc = pg.rank() == 0 ? std::vector<size_t>{2, 2} : std::vector<size_t>{2, 2};
    std::vector<size_t> rc = pg.rank() == 0 ? std::vector<size_t>{2, 2} : std::vector<size_t>{1, 2};
    pg.all_to_all_v(s.data(), sc, r.data(), rc, DType::F32);
  });
  for (int r = 0; r < 2; ++r) {
    ASSERT_FALSE(bad_counts[static_cast<size_t>(r)].ok);
    EXPECT_NE(bad_counts[static_cast<size_t>(r)].error.find("rank 0 sends 2 elements to rank 1, which expects 1"),
              std::string::npos)
        << bad_counts[static_cast<size_t>(r)].error;
  }
}

TEST(ThreadedPG, RankIsTakenOnceAndSubGroupsAreChecked) {
  auto hub = ThreadedGroup::create(2, Ms(1000));
  auto r0 = hub->rank(0);
  EXPECT_THROW(hub->rank(0), CollectiveError);
  EXPECT_THROW(hub->rank(2), CollectiveError);
  EXPECT_THROW(r0->new_subgroup({0, 0}, "dup"), CollectiveError);
  EXPECT_THROW(r0->new_subgroup({1}, "not_me"), CollectiveError);
  EXPECT_THROW(r0->send(nullptr, 1, DType::F32, 0), CollectiveError);  // not a peer: itself
}

}  // namespace
}  // namespace primus::parallel::threaded_test
