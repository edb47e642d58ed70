// GlooProcessGroup with ranks as threads: every collective gives the exact serial result on 1, 2
// and 3 ranks (small integers, so any summation order is exact), sub-groups of a 2x2 mesh reduce
// over their own ranks only, and setup / a rank that leaves are errors naming the rank.
#include <gtest/gtest.h>

#include <cmath>
#include <random>

#include "parallel/parallel_dims.h"
#include "tests/core/test_util.h"
#include "tests/parallel/pg_test_util.h"

namespace primus::parallel {
namespace {

class GlooPG : public StoreTest {
 protected:
  std::vector<RankOutcome> run(int world, const std::function<void(ProcessGroup&)>& fn, Ms timeout = Ms(5000)) {
    return run_ranks(*server_, world, timeout, fn, PgEngine::Gloo);
  }
  static void expect_all_ok(const std::vector<RankOutcome>& out, int world) {
    for (size_t r = 0; r < out.size(); ++r) EXPECT_TRUE(out[r].ok) << "world " << world << " rank " << r << ": " << out[r].error;
  }
};

const std::vector<size_t> kGlooCounts = {1, 3, 7, 1001, 65537};

TEST_F(GlooPG, PluginLoadsAndNamesItself) {
  std::string why;
  ASSERT_TRUE(gloo_plugin_available(&why)) << why;
  auto out = run(2, [](ProcessGroup& pg) { EXPECT_EQ(pg.backend(), "gloo"); });
  expect_all_ok(out, 2);
}

TEST_F(GlooPG, AllReduceF32AndBf16EqualSerialSumAndAverage) {
  for (int world = 1; world <= 3; ++world) {
    for (ReduceOp rop : {ReduceOp::Sum, ReduceOp::Avg}) {
      std::vector<std::vector<float>> f32(world), bf(world);
      auto out = run(world, [&](ProcessGroup& pg) {
        for (size_t count : kGlooCounts) {
          std::vector<float> buf(count);
          std::vector<uint16_t> b(count);
          for (size_t i = 0; i < count; ++i) {
            buf[i] = input_value(pg.rank(), i);
            b[i] = fp32_to_bf16(buf[i]);
          }
          pg.all_reduce(buf.data(), count, DType::F32, rop);
          pg.all_reduce(b.data(), count, DType::BF16, rop);
          f32[pg.rank()].insert(f32[pg.rank()].end(), buf.begin(), buf.end());
          for (uint16_t x : b) bf[pg.rank()].push_back(bf16_to_fp32(x));
        }
      });
      expect_all_ok(out, world);
      size_t at = 0;
      for (size_t count : kGlooCounts) {
        for (size_t i = 0; i < count; ++i, ++at) {
          float sum = 0;
          for (int r = 0; r < world; ++r) sum += input_value(r, i);
          const float want = rop == ReduceOp::Avg ? sum / static_cast<float>(world) : sum;
          for (int r = 0; r < world; ++r) {
            ASSERT_EQ(f32[r][at], want) << "f32 world " << world << " count " << count << " i " << i << " rank " << r;
            ASSERT_EQ(bf[r][at], bf16_to_fp32(fp32_to_bf16(want))) << "bf16 world " << world << " i " << i;
          }
        }
      }
    }
  }
}

// Max: a gather and the largest value in rank order (the plugin's ring only sums).
TEST_F(GlooPG, MaxGivesEveryRankTheLargestValue) { check_max(*server_, PgEngine::Gloo); }

TEST_F(GlooPG, ReduceScatterGivesEachRankItsChunkInPlaceOrNot) {
  for (int world = 2; world <= 3; ++world) {
    const size_t count = 1001;
    for (ReduceOp rop : {ReduceOp::Sum, ReduceOp::Avg}) {
      std::vector<std::vector<float>> got(world), got_in_place(world), got_bf(world);
      auto out = run(world, [&](ProcessGroup& pg) {
        std::vector<float> send(count * world);
        for (size_t i = 0; i < send.size(); ++i) send[i] = input_value(pg.rank(), i);
        std::vector<float> recv(count);
        pg.reduce_scatter(send.data(), recv.data(), count, DType::F32, rop);
        got[pg.rank()] = recv;
        std::vector<float> inplace = send;
        float* mine = inplace.data() + pg.rank() * count;
        pg.reduce_scatter(inplace.data(), mine, count, DType::F32, rop);
        got_in_place[pg.rank()].assign(mine, mine + count);
        std::vector<uint16_t> sb(send.size()), rb(count);
        for (size_t i = 0; i < send.size(); ++i) sb[i] = fp32_to_bf16(send[i]);
        pg.reduce_scatter(sb.data(), rb.data(), count, DType::BF16, rop);
        for (uint16_t x : rb) got_bf[pg.rank()].push_back(bf16_to_fp32(x));
      });
      expect_all_ok(out, world);
      for (int r = 0; r < world; ++r) {
        for (size_t i = 0; i < count; ++i) {
          float sum = 0;
          for (int q = 0; q < world; ++q) sum += input_value(q, r * count + i);
          const float want = rop == ReduceOp::Avg ? sum / static_cast<float>(world) : sum;
          ASSERT_EQ(got[r][i], want) << "world " << world << " rank " << r << " i " << i;
          ASSERT_EQ(got_in_place[r][i], want) << "in place, world " << world << " rank " << r << " i " << i;
          ASSERT_EQ(got_bf[r][i], bf16_to_fp32(fp32_to_bf16(want))) << "bf16, world " << world << " i " << i;
        }
      }
    }
  }
}

TEST_F(GlooPG, AllGatherInRankOrderInPlaceOrNot) {
  for (int world = 2; world <= 3; ++world) {
    const size_t count = 7;
    std::vector<std::vector<float>> got(world), got_in_place(world);
    auto out = run(world, [&](ProcessGroup& pg) {
      std::vector<float> mine(count), all(count * world);
      for (size_t i = 0; i < count; ++i) mine[i] = static_cast<float>(100 * pg.rank() + static_cast<int>(i));
      pg.all_gather(mine.data(), all.data(), count, DType::F32);
      got[pg.rank()] = all;
      std::vector<float> inplace(count * world, -1.f);
      std::copy(mine.begin(), mine.end(), inplace.begin() + pg.rank() * count);
      pg.all_gather(inplace.data() + pg.rank() * count, inplace.data(), count, DType::F32);
      got_in_place[pg.rank()] = inplace;
    });
    expect_all_ok(out, world);
    for (int r = 0; r < world; ++r) {
      for (size_t j = 0; j < count * world; ++j) {
        const float want = static_cast<float>(100 * static_cast<int>(j / count) + static_cast<int>(j % count));
        ASSERT_EQ(got[r][j], want) << "world " << world << " rank " << r << " j " << j;
        ASSERT_EQ(got_in_place[r][j], want) << "in place, world " << world << " rank " << r << " j " << j;
      }
    }
  }
}

// Element j of the chunk rank s sends to rank d encodes (s, d, j), so a misplaced chunk shows.
float a2a_value(int s, int d, size_t j) { return static_cast<float>(1000 * s + 100 * d + static_cast<int>(j)); }

TEST_F(GlooPG, AllToAllEqualAndVariableSizes) {
  for (int world = 2; world <= 3; ++world) {
    const size_t count = 5;
    std::vector<std::vector<float>> eq(world), var(world);
    // Variable: rank s sends s + d + 1 elements to rank d (so sizes differ both ways), and none
    // from rank 0 to rank 0 would be too easy: the diagonal is included.
    auto n_elems = [](int s, int d) { return static_cast<size_t>(s + 2 * d + (s == d ? 0 : 1)); };
    auto out = run(world, [&](ProcessGroup& pg) {
      const int me = pg.rank();
      std::vector<float> send(count * world), recv(count * world);
      for (int d = 0; d < world; ++d)
        for (size_t j = 0; j < count; ++j) send[d * count + j] = a2a_value(me, d, j);
      pg.all_to_all(send.data(), recv.data(), count, DType::F32);
      eq[me] = recv;
      std::vector<size_t> sc(world), rc(world);
      std::vector<float> vs;
      for (int d = 0; d < world; ++d) {
        sc[d] = n_elems(me, d);
        rc[d] = n_elems(d, me);
        for (size_t j = 0; j < sc[d]; ++j) vs.push_back(a2a_value(me, d, j));
      }
      size_t total = 0;
      for (size_t c : rc) total += c;
      std::vector<float> vr(total, -1.f);
      pg.all_to_all_v(vs.data(), sc, vr.data(), rc, DType::F32);
      var[me] = vr;
    });
    expect_all_ok(out, world);
    for (int d = 0; d < world; ++d) {
      for (int s = 0; s < world; ++s)
        for (size_t j = 0; j < count; ++j) ASSERT_EQ(eq[d][s * count + j], a2a_value(s, d, j)) << world << " " << s << "->" << d;
      size_t at = 0;
      for (int s = 0; s < world; ++s)
        for (size_t j = 0; j < n_elems(s, d); ++j, ++at) ASSERT_EQ(var[d][at], a2a_value(s, d, j)) << "v " << world << " " << s << "->" << d;
      ASSERT_EQ(at, var[d].size());
    }
  }
}

TEST_F(GlooPG, BroadcastFromEveryRoot) {
  for (int world = 2; world <= 3; ++world) {
    std::vector<std::vector<float>> got(world);
    auto out = run(world, [&](ProcessGroup& pg) {
      for (int root = 0; root < world; ++root) {
        std::vector<float> buf(3001, static_cast<float>(-1 - pg.rank()));
        if (pg.rank() == root)
          for (size_t i = 0; i < buf.size(); ++i) buf[i] = static_cast<float>(root * 10000 + static_cast<int>(i));
        pg.broadcast(buf.data(), buf.size(), DType::F32, root);
        got[pg.rank()].insert(got[pg.rank()].end(), buf.begin(), buf.end());
      }
    });
    expect_all_ok(out, world);
    for (int r = 0; r < world; ++r)
      for (int root = 0; root < world; ++root)
        for (size_t i = 0; i < 3001; ++i) ASSERT_EQ(got[r][root * 3001 + i], static_cast<float>(root * 10000 + static_cast<int>(i)));
  }
}

// A token passed around the ring: rank 0 sends first, every other rank receives from its
// predecessor, adds its rank and sends on; rank 0 receives the sum last. Tags keep two messages
// between the same ranks apart.
TEST_F(GlooPG, SendRecvAroundTheRingWithTags) {
  for (int world = 2; world <= 3; ++world) {
    std::vector<float> final_token(world, 0.f), tagged(world, 0.f);
    auto out = run(world, [&](ProcessGroup& pg) {
      const int me = pg.rank(), next = (me + 1) % world, prev = (me + world - 1) % world;
      std::vector<float> tok(4, 0.f), other(4, 0.f);
      if (me == 0) {
        tok.assign(4, 1.f);
        std::vector<float> second(4, 50.f);
        pg.send(tok.data(), 4, DType::F32, next, 7);
        pg.send(second.data(), 4, DType::F32, next, 8);
        pg.recv(tok.data(), 4, DType::F32, prev, 7);
        pg.recv(other.data(), 4, DType::F32, prev, 8);
      } else {
        pg.recv(tok.data(), 4, DType::F32, prev, 7);
        pg.recv(other.data(), 4, DType::F32, prev, 8);
        for (auto& x : tok) x += static_cast<float>(me);
        for (auto& x : other) x += 1.f;
        pg.send(tok.data(), 4, DType::F32, next, 7);
        pg.send(other.data(), 4, DType::F32, next, 8);
      }
      final_token[me] = tok[3];
      tagged[me] = other[0];
    });
    expect_all_ok(out, world);
    EXPECT_EQ(final_token[0], 1.f + static_cast<float>(world * (world - 1) / 2)) << world;
    EXPECT_EQ(tagged[0], 50.f + static_cast<float>(world - 1)) << world;
  }
}

TEST_F(GlooPG, BarrierWaitsForTheLastRank) {
  std::vector<double> left(3, 0);
  auto t0 = Clock::now();
  auto out = run(3, [&](ProcessGroup& pg) {
    if (pg.rank() == 2) std::this_thread::sleep_for(Ms(300));
    pg.barrier();
    left[pg.rank()] = seconds_since(t0);
  });
  expect_all_ok(out, 3);
  for (int r = 0; r < 3; ++r) EXPECT_GE(left[r], 0.29) << r;
}

// 4 ranks as a 2x2 mesh (tp 2 fastest, dp 2): each rank's tp and dp groups come from
// ParallelDims, and a reduction in one group sums over that group's ranks only.
TEST_F(GlooPG, SubGroupsOfATwoByTwoMeshReduceOverTheirOwnRanks) {
  ParallelSizes sizes;
  sizes[Dim::TP] = 2;
  sizes[Dim::DP] = 2;
  std::vector<std::vector<float>> tp_sum(4), dp_sum(4), dp_gather(4);
  std::vector<int> tp_rank(4, -1), dp_rank(4, -1);
  auto out = run(4, [&](ProcessGroup& world) {
    const ParallelDims dims(sizes, 4, world.rank());
    auto tp = world.new_subgroup(dims.group_ranks(Dim::TP), dims.group_name(Dim::TP));
    auto dp = world.new_subgroup(dims.group_ranks(Dim::DP), dims.group_name(Dim::DP));
    const int me = world.rank();
    std::vector<float> a(3, static_cast<float>(1 << me)), b = a;  // rank r contributes 2^r
    tp->all_reduce(a.data(), 3, DType::F32, ReduceOp::Sum);
    dp->all_reduce(b.data(), 3, DType::F32, ReduceOp::Sum);
    tp_sum[me] = a;
    dp_sum[me] = b;
    std::vector<float> g(2);
    float mine = static_cast<float>(me);
    dp->all_gather(&mine, g.data(), 1, DType::F32);
    dp_gather[me] = g;
    tp_rank[me] = tp->rank();
    dp_rank[me] = dp->rank();
    world.barrier();
  });
  expect_all_ok(out, 4);
  // tp groups {0,1}, {2,3}; dp groups {0,2}, {1,3}.
  const float tp_want[4] = {3, 3, 12, 12}, dp_want[4] = {5, 10, 5, 10};
  for (int r = 0; r < 4; ++r) {
    EXPECT_EQ(tp_sum[r], std::vector<float>(3, tp_want[r])) << r;
    EXPECT_EQ(dp_sum[r], std::vector<float>(3, dp_want[r])) << r;
    EXPECT_EQ(dp_gather[r], (std::vector<float>{static_cast<float>(r % 2), static_cast<float>(r % 2 + 2)})) << r;
    EXPECT_EQ(tp_rank[r], r % 2);
    EXPECT_EQ(dp_rank[r], r / 2);
  }
}

TEST_F(GlooPG, SetupNamesTheRanksThatNeverCame) {
  auto t0 = Clock::now();
  primus::testing::expect_error<CollectiveError>(
      [&] { GlooProcessGroup pg(*server_, "127.0.0.1", 0, 3, Ms(500), "gloo_lonely", "127.0.0.1"); },
      {"rank 1, rank 2 did not join", "rank 0/3", "gloo_lonely"});
  EXPECT_LT(seconds_since(t0), 3.0);
}

// Rank 1 destroys its group instead of joining the all-reduce: rank 0 fails long before the
// timeout, names rank 1 as having left, and its group refuses every later call.
TEST_F(GlooPG, RankThatLeavesIsNamedAndTheGroupIsAborted) {
  std::string second_call;
  auto out = run(2, [&](ProcessGroup& pg) {
    if (pg.rank() == 1) return;
    std::vector<float> buf(1000, 1.f);
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
  }, Ms(10000));
  ASSERT_FALSE(out[0].ok);
  EXPECT_NE(out[0].error.find("all_reduce of 1000 f32 elements on rank 0/2"), std::string::npos) << out[0].error;
  EXPECT_NE(out[0].error.find("rank 1 (left the group)"), std::string::npos) << out[0].error;
  EXPECT_LT(out[0].seconds, 2.0);  // long before the 10 s timeout: "left" needs no second look
  EXPECT_NE(second_call.find("aborted earlier"), std::string::npos) << second_call;
}

TEST_F(GlooPG, MakeProcessGroupPicksGlooForAJobOfTwo) {
  std::vector<std::string> engines(2);
  std::vector<std::thread> th;
  for (int r = 0; r < 2; ++r) {
    th.emplace_back([&, r] {
      DistEnv env;
      env.rank = r;
      env.world_size = 2;
      env.master_addr = "127.0.0.1";
      env.timeout_s = 5;
      TcpStore store("127.0.0.1", server_->port(), false, Ms(5000));
      auto pg = make_process_group(env, store);
      float x = static_cast<float>(r + 1);
      pg->all_reduce(&x, 1, DType::F32, ReduceOp::Sum);
      engines[r] = pg->backend() + " " + std::to_string(x);
    });
  }
  for (auto& t : th) t.join();
  EXPECT_EQ(engines[0], "gloo 3.000000");
  EXPECT_EQ(engines[1], "gloo 3.000000");
}

TEST(SingleProcessGroupMore, AllToAllAndSubGroupOfOne) {
  SingleProcessGroup pg;
  std::vector<float> a = {1, 2, 3}, b(3);
  pg.all_to_all(a.data(), b.data(), 3, DType::F32);
  EXPECT_EQ(b, a);
  auto sub = pg.new_subgroup({0}, "tp");
  EXPECT_EQ(sub->world_size(), 1);
  primus::testing::expect_error<CollectiveError>([&] { pg.send(a.data(), 3, DType::F32, 1); }, {"send", "single"});
}

}  // namespace
}  // namespace primus::parallel
