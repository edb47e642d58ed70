// ParallelDims: Megatron's rank order (tp fastest, then cp, ep, dp, pp), each rank's coordinates
// and group ranks on meshes of every dimension, dp derived from the world, the mesh the dry run
// prints, and the config errors a user meets today (a size that does not divide the world or the
// model, a dimension, sequence parallelism or a sharding strategy that is not implemented yet).
#include <gtest/gtest.h>

#include <set>

#include "core/config/yaml_loader.h"
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
  const ParallelDims d = ParallelDims::from_launch(sizes(1, 1, 1, 4, 1), env, {"the cuda backend", false});
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
  const MeshSupport cuda{"the cuda backend", false, false, false}, reference{"the reference backend", true, true, true};
  expect_error<ConfigError>([&] { ParallelDims::from_launch(sizes(2, 1, 1, 1, 1), env, cuda); },
                            {"tensor_model_parallel_size: tp is 2, but tensor parallelism is not implemented yet on "
                             "the cuda backend"});
  EXPECT_EQ(ParallelDims::from_launch(sizes(2, 1, 1, 1, 1), env, reference).size(Dim::TP), 2);
  expect_error<ConfigError>([&] { ParallelDims::from_launch(sizes(1, 2, 1, 1, 1), env, cuda); },
                            {"context_parallel_size", "not implemented yet on the cuda backend"});
  EXPECT_EQ(ParallelDims::from_launch(sizes(1, 2, 1, 1, 1), env, reference).size(Dim::CP), 2);
  for (const MeshSupport& s : {cuda, reference}) {
    expect_error<ConfigError>([&] { ParallelDims::from_launch(sizes(1, 1, 2, 1, 1), env, s); }, {"expert_model_parallel_size"});
    expect_error<ConfigError>([&] { ParallelDims::from_launch(sizes(1, 1, 1, 1, 2), env, s); }, {"pipeline_model_parallel_size"});
  }
}

// Megatron's layouts, rank by rank: coordinates and the ranks of each group.
TEST(ParallelDims, MeshCoordinatesOfMegatronLayouts) {
  // 16 GPUs, tp 2, cp 2: dp derived as 4. rank = tp + 2 * (cp + 2 * dp).
  ParallelSizes s = sizes(2, 2, 1, 1, 1).for_world(16);
  EXPECT_EQ(s[Dim::DP], 4);
  for (int r = 0; r < 16; ++r) {
    const ParallelDims d(s, 16, r);
    EXPECT_EQ(d.coord(Dim::TP), r % 2) << r;
    EXPECT_EQ(d.coord(Dim::CP), (r / 2) % 2) << r;
    EXPECT_EQ(d.coord(Dim::DP), r / 4) << r;
  }
  const ParallelDims r13(s, 16, 13);  // tp 1, cp 0, dp 3
  EXPECT_EQ(r13.group_ranks(Dim::TP), (std::vector<int>{12, 13}));
  EXPECT_EQ(r13.group_ranks(Dim::CP), (std::vector<int>{13, 15}));
  EXPECT_EQ(r13.group_ranks(Dim::DP), (std::vector<int>{1, 5, 9, 13}));
  EXPECT_EQ(r13.group_name(Dim::DP), "dp1-13");
  // tp 4 over 8: two tp groups, dp 2.
  const ParallelDims t4(sizes(4, 1, 1, 1, 1).for_world(8), 8, 6);
  EXPECT_EQ(t4.group_ranks(Dim::TP), (std::vector<int>{4, 5, 6, 7}));
  EXPECT_EQ(t4.group_ranks(Dim::DP), (std::vector<int>{2, 6}));
  // cp 3 alone over 6: cp groups of consecutive ranks.
  const ParallelDims c3(sizes(1, 3, 1, 1, 1).for_world(6), 6, 4);
  EXPECT_EQ(c3.group_ranks(Dim::CP), (std::vector<int>{3, 4, 5}));
  EXPECT_EQ(c3.group_ranks(Dim::DP), (std::vector<int>{1, 4}));
  // Every group name is shared by its members only.
  std::set<std::string> names;
  for (int r = 0; r < 16; ++r) names.insert(ParallelDims(s, 16, r).group_name(Dim::TP));
  EXPECT_EQ(names.size(), 8u);
}

TEST(ParallelDims, MeshTextNamesEveryRankAndAbridgesBigWorlds) {
  const std::string m = describe_mesh(sizes(2, 2, 1, 1, 1), 16);
  EXPECT_NE(m.find("16 ranks = tp 2 x cp 2 x dp 4"), std::string::npos) << m;
  EXPECT_NE(m.find("rank   13: tp 1 cp 0 dp 3  tp group [12,13]  cp group [13,15]  dp group [1,5,9,13]"),
            std::string::npos)
      << m;
  const std::string big = describe_mesh(sizes(8, 1, 1, 1, 1), 1024, 16);
  EXPECT_NE(big.find("1024 ranks = tp 8 x cp 1 x dp 128"), std::string::npos);
  EXPECT_NE(big.find("... 1008 ranks left out ..."), std::string::npos) << big;
  EXPECT_NE(big.find("rank 1023:"), std::string::npos) << big;
  EXPECT_EQ(big.find("rank  100:"), std::string::npos);
}

TEST(ParallelDims, WorldAndModelThatDoNotFitNameTheKey) {
  expect_error<ConfigError>([] { sizes(2, 2, 1, 1, 1).for_world(6); },
                            {"world size 6 is not divisible by tensor_model_parallel_size 2 x context_parallel_size 2"});
  // Llama-3-8B: 32 heads, 8 kv groups, 8192 tokens.
  sizes(2, 2, 1, 1, 1).check_model(32, 8, 8192);
  expect_error<ConfigError>([] { sizes(3, 1, 1, 1, 1).check_model(32, 8, 8192); },
                            {"tensor_model_parallel_size 3 does not divide num_attention_heads 32"});
  // More ranks than kv groups: each group replicated on tp / groups ranks, when that divides.
  sizes(16, 1, 1, 1, 1).check_model(32, 8, 8192);
  expect_error<ConfigError>([] { sizes(4, 1, 1, 1, 1).check_model(12, 3, 8192); },
                            {"tensor_model_parallel_size 4 neither divides num_query_groups 3"});
  expect_error<ConfigError>([] { sizes(4, 1, 1, 1, 1).check_model(24, 6, 8192); },
                            {"tensor_model_parallel_size 4 neither divides num_query_groups 6"});
  expect_error<ConfigError>([] { sizes(1, 3, 1, 1, 1).check_model(32, 8, 8192); },
                            {"context_parallel_size 3: seq_length 8192 is not divisible by 2 x 3"});
  ParallelSizes sp = sizes(1, 1, 1, 1, 1);
  sp.sequence_parallel = true;
  expect_error<ConfigError>([&] { sp.check_model(32, 8, 8192); }, {"sequence_parallel needs tensor_model_parallel_size > 1"});
}

config::Value parallel_yaml(const std::string& text) { return config::parse_yaml_text(text, "test.yaml"); }

TEST(ParallelDims, ShardingStrategyAndItsOlderName) {
  EXPECT_EQ(ParallelSizes::from_config(parallel_yaml("a: 1")).sharding, DpSharding::NoShard);
  EXPECT_EQ(ParallelSizes::from_config(parallel_yaml("use_distributed_optimizer: true")).sharding, DpSharding::Optim);
  EXPECT_EQ(ParallelSizes::from_config(parallel_yaml("data_parallel_sharding_strategy: optim")).sharding,
            DpSharding::Optim);
  EXPECT_EQ(ParallelSizes::from_config(
                parallel_yaml("data_parallel_sharding_strategy: optim\nuse_distributed_optimizer: true"))
                .sharding,
            DpSharding::Optim);
  expect_error<ConfigError>(
      [] { ParallelSizes::from_config(parallel_yaml("data_parallel_sharding_strategy: no_shard\nuse_distributed_optimizer: true")); },
      {"data_parallel_sharding_strategy is no_shard but use_distributed_optimizer is true"});
  const ParallelSizes all = ParallelSizes::from_config(parallel_yaml(
      "tensor_model_parallel_size: 2\ncontext_parallel_size: 2\nsequence_parallel: true\n"
      "data_parallel_sharding_strategy: optim_grads_params"));
  EXPECT_EQ(all[Dim::TP], 2);
  EXPECT_EQ(all[Dim::CP], 2);
  EXPECT_TRUE(all.sequence_parallel);
  EXPECT_EQ(all.sharding, DpSharding::OptimGradsParams);
  // Over a tp group of one, sequence parallelism is turned off (Megatron-LM's rule).
  EXPECT_FALSE(ParallelSizes::from_config(parallel_yaml("sequence_parallel: true")).sequence_parallel);
  // Megatron-LM's use_torch_fsdp2 is the strategy that shards parameters too.
  EXPECT_EQ(ParallelSizes::from_config(parallel_yaml("use_torch_fsdp2: true")).sharding, DpSharding::OptimGradsParams);
  EXPECT_EQ(ParallelSizes::from_config(parallel_yaml("use_torch_fsdp2: true\nuse_distributed_optimizer: false")).sharding,
            DpSharding::OptimGradsParams);
  EXPECT_EQ(ParallelSizes::from_config(parallel_yaml("use_torch_fsdp2: false\nuse_distributed_optimizer: true")).sharding,
            DpSharding::Optim);
  expect_error<ConfigError>(
      [] { ParallelSizes::from_config(parallel_yaml("use_torch_fsdp2: true\ndata_parallel_sharding_strategy: optim")); },
      {"test.yaml:1:18: use_torch_fsdp2: true shards parameters", "test.yaml:2:34 sets optim"});
}

TEST(ParallelDims, WhatABackendDoesNotImplementIsRefusedByName) {
  ParallelSizes sp = sizes(1, 1, 1, 1, 1);
  sp.sequence_parallel = true;
  expect_error<ConfigError>([&] { sp.check_implemented({"the cuda backend", false}); },
                            {"sequence_parallel", "not implemented yet on the cuda backend"});
  // A backend with tensor parallelism takes tp and sequence_parallel; one without refuses tp by name.
  ParallelSizes tp = sizes(2, 1, 1, 1, 1);
  tp.sequence_parallel = true;
  tp.check_implemented({"the reference backend", true});
  tp.check_implemented(kAnyBackendMesh);
  expect_error<ConfigError>([&] { tp.check_implemented({"the cuda backend", false}); },
                            {"tensor_model_parallel_size", "tensor parallelism is not implemented yet on the cuda backend"});
  expect_error<ConfigError>([&] { sizes(1, 2, 1, 1, 1).check_implemented({"a backend without cp", true, true}); },
                            {"context_parallel_size", "not implemented yet on a backend without cp"});
  for (DpSharding st : {DpSharding::OptimGrads, DpSharding::OptimGradsParams}) {
    ParallelSizes s = sizes(1, 1, 1, 1, 1);
    s.sharding = st;
    s.check_implemented(kAnyBackendMesh);
    s.check_implemented({"the reference backend", true, true});
    expect_error<ConfigError>([&] { s.check_implemented({"the cuda backend", false, false}); },
                              {"data_parallel_sharding_strategy", dp_sharding_name(st), "not implemented yet"});
  }
  ParallelSizes z1 = sizes(1, 1, 1, 1, 1);
  z1.sharding = DpSharding::Optim;
  z1.check_implemented({"the cuda backend", false});  // ZeRO-1 is implemented everywhere
}

}  // namespace
}  // namespace primus::parallel
