// SocketProcessGroup with ranks as threads: every collective equals its serial reduction for
// world sizes 1..4 and counts that do not divide by the world size; a rank that stalls or
// leaves is an error naming it within the timeout.
#include <gtest/gtest.h>

#include <cmath>
#include <random>

#include "tests/core/test_util.h"
#include "tests/parallel/pg_test_util.h"

namespace primus::parallel {
namespace {

class SocketPG : public StoreTest {};

const std::vector<size_t> kCounts = {1, 2, 3, 7, 13, 1001, 65537};

TEST_F(SocketPG, AllReduceF32EqualsSerialSumAndAverage) {
  for (int world = 1; world <= 4; ++world) {
    for (ReduceOp rop : {ReduceOp::Sum, ReduceOp::Avg}) {
      std::vector<std::vector<float>> results(world);
      auto out = run_ranks(*server_, world, Ms(5000), [&](ProcessGroup& pg) {
        for (size_t count : kCounts) {
          std::vector<float> buf(count);
          for (size_t i = 0; i < count; ++i) buf[i] = input_value(pg.rank(), i);
          pg.all_reduce(buf.data(), count, DType::F32, rop);
          results[pg.rank()].insert(results[pg.rank()].end(), buf.begin(), buf.end());
        }
      });
      for (int r = 0; r < world; ++r) ASSERT_TRUE(out[r].ok) << "world " << world << " rank " << r << ": " << out[r].error;
      size_t at = 0;
      for (size_t count : kCounts) {
        for (size_t i = 0; i < count; ++i, ++at) {
          float sum = 0;
          for (int r = 0; r < world; ++r) sum += input_value(r, i);
          float want = rop == ReduceOp::Avg ? sum / static_cast<float>(world) : sum;
          for (int r = 0; r < world; ++r) {
            ASSERT_EQ(results[r][at], want) << "world " << world << " count " << count << " i " << i << " rank " << r;
          }
        }
      }
    }
  }
}

// Arbitrary floats: sums in another order differ only by rounding, and every rank gets the
// same bits (each chunk is reduced once and then copied).
TEST_F(SocketPG, AllReduceRandomFloatsIdenticalOnEveryRank) {
  const int world = 3;
  const size_t count = 10007;
  std::vector<std::vector<float>> in(world, std::vector<float>(count)), res(world);
  std::mt19937 rng(7);
  std::normal_distribution<float> nd;
  for (auto& v : in)
    for (auto& x : v) x = nd(rng);
  auto out = run_ranks(*server_, world, Ms(5000), [&](ProcessGroup& pg) {
    res[pg.rank()] = in[pg.rank()];
    pg.all_reduce(res[pg.rank()].data(), count, DType::F32, ReduceOp::Sum);
  });
  for (int r = 0; r < world; ++r) ASSERT_TRUE(out[r].ok) << out[r].error;
  for (size_t i = 0; i < count; ++i) {
    double want = 0;
    for (int r = 0; r < world; ++r) want += in[r][i];
    ASSERT_NEAR(res[0][i], want, 1e-5 * (1 + std::fabs(want))) << i;
    for (int r = 1; r < world; ++r) ASSERT_EQ(res[r][i], res[0][i]) << "rank " << r << " i " << i;
  }
}

TEST_F(SocketPG, AllReduceBf16AccumulatesExactly) {
  for (int world = 2; world <= 4; ++world) {
    const size_t count = 999;
    std::vector<std::vector<uint16_t>> res(world);
    auto out = run_ranks(*server_, world, Ms(5000), [&](ProcessGroup& pg) {
      std::vector<uint16_t> buf(count);
      for (size_t i = 0; i < count; ++i) buf[i] = fp32_to_bf16(input_value(pg.rank(), i));
      pg.all_reduce(buf.data(), count, DType::BF16, ReduceOp::Sum);
      res[pg.rank()] = buf;
    });
    for (int r = 0; r < world; ++r) ASSERT_TRUE(out[r].ok) << out[r].error;
    for (size_t i = 0; i < count; ++i) {
      float sum = 0;
      for (int r = 0; r < world; ++r) sum += input_value(r, i);
      for (int r = 0; r < world; ++r) ASSERT_EQ(bf16_to_fp32(res[r][i]), sum) << "world " << world << " i " << i;
    }
  }
}

// bf16 partial sums travel as f32: 256 + 1 + 1 + 1 is 259 -> rounds to 260 once, where a bf16
// running sum would stay at 256 (256 + 1 rounds back to 256 at every step).
TEST_F(SocketPG, AllReduceBf16RoundsOnceAtTheEnd) {
  const int world = 4;
  std::vector<float> got(world);
  auto out = run_ranks(*server_, world, Ms(5000), [&](ProcessGroup& pg) {
    uint16_t v = fp32_to_bf16(pg.rank() == 0 ? 256.f : 1.f);
    pg.all_reduce(&v, 1, DType::BF16, ReduceOp::Sum);
    got[pg.rank()] = bf16_to_fp32(v);
  });
  for (int r = 0; r < world; ++r) {
    ASSERT_TRUE(out[r].ok) << out[r].error;
    EXPECT_EQ(got[r], 260.f) << "rank " << r;
  }
}

// Max: the ring keeps the larger value where it adds for Sum.
TEST_F(SocketPG, MaxGivesEveryRankTheLargestValue) { check_max(*server_, PgEngine::Socket); }

TEST_F(SocketPG, ReduceScatterGivesEachRankItsChunk) {
  for (int world = 1; world <= 4; ++world) {
    for (DType dt : {DType::F32, DType::BF16}) {
      for (bool in_place : {false, true}) {
        const size_t count = 37;  // per rank; odd on purpose
        std::vector<std::vector<float>> res(world);
        auto out = run_ranks(*server_, world, Ms(5000), [&](ProcessGroup& pg) {
          const size_t total = count * world;
          std::vector<float> f(total);
          for (size_t i = 0; i < total; ++i) f[i] = input_value(pg.rank(), i);
          std::vector<float> mine(count);
          if (dt == DType::F32) {
            float* recv = in_place ? f.data() + pg.rank() * count : mine.data();
            pg.reduce_scatter(f.data(), recv, count, dt, ReduceOp::Avg);
            std::copy_n(recv, count, mine.data());
          } else {
            std::vector<uint16_t> h(total), r16(count);
            for (size_t i = 0; i < total; ++i) h[i] = fp32_to_bf16(f[i]);
            uint16_t* recv = in_place ? h.data() + pg.rank() * count : r16.data();
            pg.reduce_scatter(h.data(), recv, count, dt, ReduceOp::Sum);
            for (size_t i = 0; i < count; ++i) mine[i] = bf16_to_fp32(recv[i]);
          }
          res[pg.rank()] = mine;
        });
        for (int r = 0; r < world; ++r) {
          ASSERT_TRUE(out[r].ok) << out[r].error;
          for (size_t i = 0; i < count; ++i) {
            float sum = 0;
            for (int q = 0; q < world; ++q) sum += input_value(q, r * count + i);
            float want = dt == DType::F32 ? sum / static_cast<float>(world) : sum;
            ASSERT_EQ(res[r][i], want) << "world " << world << " " << dtype_name(dt) << " rank " << r << " i " << i;
          }
        }
      }
    }
  }
}

TEST_F(SocketPG, AllGatherInRankOrder) {
  for (int world = 1; world <= 4; ++world) {
    for (bool in_place : {false, true}) {
      const size_t count = 5;
      std::vector<std::vector<uint16_t>> res(world);
      auto out = run_ranks(*server_, world, Ms(5000), [&](ProcessGroup& pg) {
        std::vector<uint16_t> all(count * world, 0xffff), mine(count);
        for (size_t i = 0; i < count; ++i) mine[i] = static_cast<uint16_t>(pg.rank() * 100 + i);
        if (in_place) std::copy(mine.begin(), mine.end(), all.begin() + pg.rank() * count);
        pg.all_gather(in_place ? all.data() + pg.rank() * count : mine.data(), all.data(), count, DType::BF16);
        res[pg.rank()] = all;
      });
      for (int r = 0; r < world; ++r) {
        ASSERT_TRUE(out[r].ok) << out[r].error;
        for (int q = 0; q < world; ++q)
          for (size_t i = 0; i < count; ++i) ASSERT_EQ(res[r][q * count + i], q * 100 + i) << "world " << world;
      }
    }
  }
}

TEST_F(SocketPG, BroadcastFromEveryRootAcrossSegments) {
  const int world = 3;
  const size_t count = 300001;  // 1.2 MB: more than one pipeline segment
  for (int root = 0; root < world; ++root) {
    std::vector<bool> good(world, false);
    auto out = run_ranks(*server_, world, Ms(5000), [&](ProcessGroup& pg) {
      std::vector<float> buf(count, -1.f);
      if (pg.rank() == root)
        for (size_t i = 0; i < count; ++i) buf[i] = static_cast<float>(i % 1000 + root);
      pg.broadcast(buf.data(), count, DType::F32, root);
      bool ok = true;
      for (size_t i = 0; i < count; ++i) ok = ok && buf[i] == static_cast<float>(i % 1000 + root);
      good[pg.rank()] = ok;
    });
    for (int r = 0; r < world; ++r) {
      ASSERT_TRUE(out[r].ok) << out[r].error;
      EXPECT_TRUE(good[r]) << "root " << root << " rank " << r;
    }
  }
}

TEST_F(SocketPG, BarrierWaitsForTheLastRank) {
  const int world = 4;
  auto out = run_ranks(*server_, world, Ms(5000), [&](ProcessGroup& pg) {
    if (pg.rank() == 2) std::this_thread::sleep_for(Ms(400));
    pg.barrier();
  });
  for (int r = 0; r < world; ++r) {
    ASSERT_TRUE(out[r].ok) << out[r].error;
    EXPECT_GE(out[r].seconds, 0.39) << "rank " << r << " left the barrier before rank 2 arrived";
  }
}

// A rank that never reaches the collective: its neighbours name it once the timeout passes, and
// the others fail too (never a hang), all within the timeout plus a margin.
TEST_F(SocketPG, StalledRankIsNamedWithinTheTimeout) {
  for (int world : {2, 3}) {
    auto out = run_ranks(*server_, world, Ms(600), [&](ProcessGroup& pg) {
      if (pg.rank() == 1) {
        std::this_thread::sleep_for(Ms(2200));  // past the bound below: only the timeout ends the others' wait
        throw RuntimeError("stalled on purpose");
      }
      std::vector<float> buf(1000, 1.f);
      pg.all_reduce(buf.data(), buf.size(), DType::F32, ReduceOp::Sum);
    });
    for (int r = 0; r < world; ++r) {
      if (r == 1) continue;
      EXPECT_FALSE(out[r].ok) << "world " << world << " rank " << r;
      EXPECT_LT(out[r].seconds, 1.6) << "world " << world << " rank " << r;  // timeout + 1 s
      EXPECT_NE(out[r].error.find("all_reduce"), std::string::npos) << out[r].error;
    }
    // The rank after the stalled one waited on it directly.
    const std::string& e = out[2 % world].error;
    EXPECT_NE(e.find("rank 1 sent nothing for 0.6 s"), std::string::npos) << e;
  }
}

TEST_F(SocketPG, RankThatLeavesIsAnErrorAtOnceAndTheGroupIsAborted) {
  const int world = 2;
  std::string second_call;
  auto out = run_ranks(*server_, world, Ms(5000), [&](ProcessGroup& pg) {
    if (pg.rank() == 1) {
      pg.abort();  // closes its connections, as a process that dies does
      return;
    }
    std::vector<float> buf(100, 1.f);
    try {
      pg.all_reduce(buf.data(), buf.size(), DType::F32, ReduceOp::Sum);
    } catch (const CollectiveError&) {
      try {
        pg.barrier();
      } catch (const CollectiveError& e) {
        second_call = e.what();
      }
      throw;
    }
  });
  ASSERT_FALSE(out[0].ok);
  EXPECT_NE(out[0].error.find("rank 1 closed its connection"), std::string::npos) << out[0].error;
  EXPECT_LT(out[0].seconds, 2.0);  // long before the 5 s timeout
  EXPECT_NE(second_call.find("aborted earlier"), std::string::npos) << second_call;
}

TEST_F(SocketPG, SetupNamesTheRankThatNeverCame) {
  auto t0 = Clock::now();
  primus::testing::expect_error<CollectiveError>(
      [&] { SocketProcessGroup pg(*server_, 0, 3, Ms(500), "lonely", "127.0.0.1"); },
      {"rank 1 did not publish its address", "rank 0/3"});
  EXPECT_LT(seconds_since(t0), 3.0);
}

TEST(SingleProcessGroup, CopiesAndKeeps) {
  SingleProcessGroup pg;
  std::vector<float> a = {1, 2, 3}, b(3);
  pg.all_reduce(a.data(), 3, DType::F32, ReduceOp::Avg);
  EXPECT_EQ(a, (std::vector<float>{1, 2, 3}));
  pg.reduce_scatter(a.data(), b.data(), 3, DType::F32, ReduceOp::Sum);
  EXPECT_EQ(b, a);
  primus::testing::expect_error<CollectiveError>([&] { pg.broadcast(a.data(), 3, DType::F32, 1); }, {"root 1"});
}

// A failing rank 0 must not sit in its store's destructor waiting for a stalled client to hang
// up (that would double the time the failure takes to reach the launcher).
TEST(TcpStoreHost, LeavesWithoutWaitingWhenTheJobFails) {
  auto host = std::make_unique<TcpStore>("127.0.0.1", 0, true, Ms(3000));
  TcpStore stalled("127.0.0.1", host->port(), false, Ms(3000));  // stays connected
  host->leave_without_waiting();
  auto t0 = Clock::now();
  host.reset();
  EXPECT_LT(seconds_since(t0), 1.0);
}

TEST(MakeProcessGroup, WorldOfOneNeedsNoPeers) {
  DistEnv env;
  TcpStore store("127.0.0.1", 0, true, Ms(2000));
  auto pg = make_process_group(env, store);
  EXPECT_EQ(pg->world_size(), 1);
  EXPECT_EQ(pg->backend(), "single");
}

}  // namespace
}  // namespace primus::parallel
