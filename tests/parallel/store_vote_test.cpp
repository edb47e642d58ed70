// The store vote (parallel/store_vote.h) across threads with a client each: every rank gets the OR
// of the round's flags in every round, the rounds' keys do not pile up in the store, and a round
// that a rank never joins ends in an error naming how many voted.
#include <gtest/gtest.h>

#include <random>
#include <thread>
#include <vector>

#include "parallel/store_vote.h"
#include "tests/core/test_util.h"
#include "tests/parallel/store_test_util.h"

namespace primus::parallel {
namespace {

TEST_F(StoreTest, VoteGivesEveryRankTheOrOfTheRound) {
  for (int world : {1, 3}) {
    constexpr int kRounds = 60;
    // flags[round][rank]: mostly all false, some rounds one rank, some several.
    std::vector<std::vector<bool>> flags(kRounds, std::vector<bool>(size_t(world), false));
    for (int n = 0; n < kRounds; ++n)
      for (int r = 0; r < world; ++r) flags[n][r] = rng_() % 7 == 0;
    flags[5].assign(size_t(world), true);
    flags[6][size_t(world - 1)] = true;
    std::vector<std::vector<int>> seen(static_cast<size_t>(world));
    std::vector<std::thread> ranks;
    const std::string name = "stop" + std::to_string(world);
    for (int r = 0; r < world; ++r) {
      ranks.emplace_back([&, r] {
        auto s = client();
        StoreVote vote(*s, name, world, Ms(5000));
        std::mt19937 jitter(static_cast<unsigned>(r));
        for (int n = 0; n < kRounds; ++n) {
          if (jitter() % 4 == 0) std::this_thread::sleep_for(std::chrono::microseconds(jitter() % 3000));
          seen[size_t(r)].push_back(vote.any(flags[n][size_t(r)], "test vote") ? 1 : 0);
        }
      });
    }
    for (auto& t : ranks) t.join();
    for (int n = 0; n < kRounds; ++n) {
      bool any = false;
      for (int r = 0; r < world; ++r) any = any || flags[n][r];
      for (int r = 0; r < world; ++r) EXPECT_EQ(seen[size_t(r)][n], any ? 1 : 0) << "world " << world << " round " << n;
    }
    // Only the last round's two keys remain (each last arriver removed the round before).
    EXPECT_TRUE(server_->check({name + "/" + std::to_string(kRounds - 1) + "/result"}));
    for (int n = 0; n + 1 < kRounds; ++n) {
      EXPECT_FALSE(server_->check({name + "/" + std::to_string(n)})) << "round " << n;
      EXPECT_FALSE(server_->check({name + "/" + std::to_string(n) + "/result"})) << "round " << n;
    }
  }
}

TEST_F(StoreTest, VoteThatARankNeverJoinsNamesTheCount) {
  auto c = client();
  StoreVote vote(*c, "lonely", 3, Ms(300));
  auto other = client();
  StoreVote second(*other, "lonely", 3, Ms(300));
  std::thread t([&] { EXPECT_THROW(second.any(true, "second rank"), RuntimeError); });
  primus::testing::expect_error<RuntimeError>([&] { vote.any(false, "stop agreement after step 7"); },
                                              {"stop agreement after step 7", "of 3 ranks voted in round 0", "within 0.3 s"});
  t.join();
}

}  // namespace
}  // namespace primus::parallel
