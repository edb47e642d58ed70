// ParallelDims: Megatron's rank order (tp fastest, then cp, ep, dp, pp), each rank's coordinates
// and group ranks on meshes of every dimension, and the config errors a user meets today (a size
// that does not divide the world, a dimension that is not implemented yet).
#include <gtest/gtest.h>

#include <set>

#include "core/util/error.h"
#include "parallel/parallel_dims.h"
#include "parallel/socket_process_group.h"
#include "tests/core/test_util.h"

namespace primus::parallel {
namespace {

using primus::testing::expect_error;

ParallelSizes sizes(int64_t tp, int64_t cp, int64_t ep, int64_t dp, int64_t pp) {
  ParallelSizes s;
  s[Dim::TP] = tp;
  s[Dim::CP] = cp;
  s[Dim::EP] = ep;
  s[Dim::DP] = dp;
  s[Dim::PP] = pp;
  return s;
}

TEST(ParallelDims, RankOrderIsTensorFastestThenContextExpertDataPipeline) {
  const ParallelSizes s = sizes(2, 3, 1, 2, 2);  // 24 ranks
  std::set<std::array<int64_t, kNumDims>> seen;
  for (int r = 0; r < 24; ++r) {
    const ParallelDims d(s, 24, r);
    EXPECT_EQ(d.coord(Dim::TP), r % 2) << r;
    EXPECT_EQ(d.coord(Dim::CP), (r / 2) % 3) << r;
    EXPECT_EQ(d.coord(Dim::EP), 0) << r;
    EXPECT_EQ(d.coord(Dim::DP), (r / 6) % 2) << r;
    EXPECT_EQ(d.coord(Dim::PP), r / 12) << r;
    std::array<int64_t, kNumDims> c{};
    for (Dim x : {Dim::TP, Dim::CP, Dim::EP, Dim::DP, Dim::PP}) c[static_cast<size_t>(x)] = d.coord(x);
    EXPECT_TRUE(seen.insert(c).second) << "rank " << r << " shares its coordinates";
    EXPECT_EQ(d.rank_of(c), r);
  }
}

TEST(ParallelDims, GroupRanksDifferInOneCoordinateOnly) {
  const ParallelSizes s = sizes(2, 2, 2, 2, 1);  // 16 ranks
  const ParallelDims d(s, 16, 11);               // tp 1, cp 1, ep 0, dp 1
  EXPECT_EQ(d.group_ranks(Dim::TP), (std::vector<int>{10, 11}));
  EXPECT_EQ(d.group_ranks(Dim::CP), (std::vector<int>{9, 11}));
  EXPECT_EQ(d.group_ranks(Dim::EP), (std::vector<int>{11, 15}));
  EXPECT_EQ(d.group_ranks(Dim::DP), (std::vector<int>{3, 11}));
  EXPECT_EQ(d.group_ranks(Dim::PP), (std::vector<int>{11}));
  // Every rank of a group agrees on the group.
  for (Dim x : {Dim::TP, Dim::CP, Dim::EP, Dim::DP}) {
    for (int peer : d.group_ranks(x)) EXPECT_EQ(ParallelDims(s, 16, peer).group_ranks(x), d.group_ranks(x));
  }
}

TEST(ParallelDims, DataParallelJobOfFourRanks) {
  DistEnv env;
  env.world_size = 4;
  env.rank = 2;
  const ParallelDims d = ParallelDims::from_launch(sizes(1, 1, 1, 4, 1), env);
  EXPECT_EQ(d.world(), 4);
  EXPECT_EQ(d.coord(Dim::DP), 2);
  EXPECT_EQ(d.group_ranks(Dim::DP), (std::vector<int>{0, 1, 2, 3}));
  EXPECT_EQ(d.group(Dim::DP), nullptr);
  ParallelDims g = d;
  g.set_group(Dim::DP, std::make_shared<SingleProcessGroup>());
  EXPECT_NE(g.group(Dim::DP), nullptr);
  EXPECT_EQ(g.group(Dim::TP), nullptr);
  EXPECT_NE(d.describe().find("dp 4 (coordinate 2)"), std::string::npos) << d.describe();
}

TEST(ParallelDims, LayoutsThatDoNotFitAreConfigErrors) {
  expect_error<ConfigError>([] { ParallelDims(sizes(1, 1, 1, 3, 1), 4, 0); }, {"needs 3 ranks, but the job has 4"});
  expect_error<ConfigError>([] { ParallelDims(sizes(1, 1, 1, 0, 1), 1, 0); }, {"data_parallel_size must be at least 1"});
  expect_error<ConfigError>([] { ParallelDims(sizes(1, 1, 1, 2, 1), 2, 2); }, {"rank 2 is outside"});
}

TEST(ParallelDims, UnimplementedDimensionsAreRefusedByName) {
  DistEnv env;
  env.world_size = 2;
  expect_error<ConfigError>([&] { ParallelDims::from_launch(sizes(2, 1, 1, 1, 1), env); },
                            {"tensor_model_parallel_size: tp is 2, but tensor parallelism is not implemented yet"});
  expect_error<ConfigError>([&] { ParallelDims::from_launch(sizes(1, 2, 1, 1, 1), env); }, {"context_parallel_size"});
  expect_error<ConfigError>([&] { ParallelDims::from_launch(sizes(1, 1, 2, 1, 1), env); }, {"expert_model_parallel_size"});
  expect_error<ConfigError>([&] { ParallelDims::from_launch(sizes(1, 1, 1, 1, 2), env); }, {"pipeline_model_parallel_size"});
}

}  // namespace
}  // namespace primus::parallel
