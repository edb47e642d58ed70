// The expert-parallel split of the tiny MoE families: each rank's local layout holds E / ep of
// every MoE layer's routed experts and everything else whole; its pieces tile the local buffer,
// the ranks' owned pieces tile the global buffer once, a cut global buffer put back is unchanged,
// rank r's experts are [r E/ep, (r+1) E/ep) under their global names, and models that cannot be
// split are ConfigErrors naming expert_model_parallel_size. Also the mesh arithmetic expert
// parallelism adds: data_parallel_size = ep x the mesh's dp, and the ep x dp replica groups.
#include <gtest/gtest.h>

#include <numeric>

#include "core/util/error.h"
#include "parallel/parallel_dims.h"
#include "tests/common/tiny_models.h"
#include "tests/core/test_util.h"
#include "tests/train/shard_map_checks.h"
#include "train/expert_parallel.h"
#include "train/mesh_memory.h"
#include "train/training_args.h"

using namespace primus::train;
using primus::ConfigError;
using primus::testing::expect_error;

namespace {

void expect_tiles(const ModelSpec& m, int ep) {
  const std::string what = m.model_type + " ep" + std::to_string(ep);
  primus::testing::expect_pieces_tile(ep, [&](int r) { return std::make_unique<EpShardMap>(m, ep, r); }, what);
  const ParamLayout G = make_param_layout(m);
  std::vector<float> global(static_cast<size_t>(G.total));
  std::iota(global.begin(), global.end(), 1.f);  // every element distinct
  for (int r = 0; r < ep; ++r) {
    const EpShardMap map(m, ep, r);
    const ParamLayout& L = map.local_layout();
    ASSERT_EQ(L.tensors.size(), G.tensors.size());
    std::vector<float> local(static_cast<size_t>(L.total), 0.f);
    map.to_local(global.data(), local.data());
    // Rank r's experts are the global ones from r E / ep: expert e's first gate row.
    const int64_t E = m.moe.num_experts, El = E / ep, C = m.hidden_size, F = m.moe.ffn_hidden_size;
    EXPECT_EQ(map.local_experts(), El);
    EXPECT_EQ(map.first_expert(), r * El);
    for (size_t i = 0; i < L.tensors.size(); ++i) {
      const ParamTensor& lt = L.tensors[i];
      const ParamTensor& gt = G.tensors[i];
      EXPECT_EQ(lt.name, gt.name);
      EXPECT_EQ(map.expert_tensor(i), lt.name.find("moe.experts.") != std::string::npos) << lt.name;
      if (!map.expert_tensor(i)) {
        EXPECT_EQ(lt.shape, gt.shape) << lt.name;
        EXPECT_EQ(local[static_cast<size_t>(lt.offset)], global[static_cast<size_t>(gt.offset)]) << lt.name;
        continue;
      }
      EXPECT_EQ(lt.shape.at(0), El) << lt.name;
      const int64_t per = gt.numel / E;  // one expert's elements
      for (int64_t e = 0; e < El; ++e) {
        EXPECT_EQ(local[static_cast<size_t>(lt.offset + e * per)], global[static_cast<size_t>(gt.offset + (r * El + e) * per)])
            << lt.name << " local expert " << e;
      }
      // The Hugging Face names are the global experts'.
      if (lt.name.find("fc.weight") != std::string::npos) {
        ASSERT_EQ(lt.hf.size(), static_cast<size_t>(2 * El));
        EXPECT_NE(lt.hf[0].name.find("experts." + std::to_string(r * El) + "."), std::string::npos) << lt.hf[0].name;
        EXPECT_EQ(lt.numel, El * 2 * F * C);
      }
    }
  }
}

TEST(ExpertParallelMap, RanksHoldTheirExpertsAndTileTheGlobalBuffer) {
  expect_tiles(primus::testing::tiny_moe(false), 2);  // 6 experts: 3 a rank, the first layer dense
  expect_tiles(primus::testing::tiny_moe(false), 3);
  expect_tiles(primus::testing::tiny_moe(false), 6);
  expect_tiles(primus::testing::tiny_moe(true), 2);   // DeepSeek style: shared expert, expert bias
  expect_tiles(primus::testing::tiny_moe(true), 4);
}

TEST(ExpertParallelMap, ModelsThatCannotSplitAreRefusedByName) {
  expect_error<ConfigError>([] { EpShardMap(primus::testing::tiny_moe(false), 4, 0); },
                            {"expert_model_parallel_size 4 does not divide num_experts 6"});
  expect_error<ConfigError>([] { EpShardMap(primus::testing::tiny_llama(), 2, 0); },
                            {"expert_model_parallel_size 2: the model has no MoE layers"});
  // Megatron's allgather exchange is not what either backend does: refused once tokens would move.
  ModelSpec allgather = primus::testing::tiny_moe(false);
  allgather.moe.allgather_dispatcher = true;
  expect_error<ConfigError>([&] { EpShardMap(allgather, 2, 0); },
                            {"moe_token_dispatcher_type 'allgather' with expert_model_parallel_size 2", "alltoall"});
  EXPECT_NO_THROW(EpShardMap(allgather, 1, 0));
}

TEST(ExpertParallelMesh, DataParallelSizeCountsTheExpertRanks) {
  TrainingArgs t;
  t.model_parallel[primus::parallel::Dim::EP] = 2;
  t.data_parallel_size = 4;  // 4 replicas of the dense layers, each expert on 2 ranks
  const primus::parallel::ParallelSizes s = t.parallel_sizes();
  EXPECT_EQ(s[primus::parallel::Dim::DP], 2);
  EXPECT_EQ(s.product(), 4);
  t.data_parallel_size = 3;
  expect_error<ConfigError>([&] { (void)t.parallel_sizes(); },
                            {"expert_model_parallel_size 2 must divide data_parallel_size 3"});
  // Rank 5 of tp 2 x ep 2 x dp 2 (rank = tp + 2 (ep + 2 dp)): tp 1, ep 0, dp 1. Its dense
  // replicas differ in ep and dp; its experts' replicas in dp alone.
  primus::parallel::ParallelSizes m;
  m[primus::parallel::Dim::TP] = 2;
  m[primus::parallel::Dim::EP] = 2;
  m[primus::parallel::Dim::DP] = 2;
  const primus::parallel::ParallelDims d(m, 8, 5);
  EXPECT_EQ(d.group_ranks({primus::parallel::Dim::EP, primus::parallel::Dim::DP}), (std::vector<int>{1, 3, 5, 7}));
  EXPECT_EQ(d.group_ranks(primus::parallel::Dim::DP), (std::vector<int>{1, 5}));
  EXPECT_EQ(d.group_ranks(primus::parallel::Dim::EP), (std::vector<int>{5, 7}));
}

// The dry run's analytical memory per rank: under ep the parameters are the local layout's (the
// experts cut, the rest whole), and the weights, gradients and moments follow them.
TEST(ExpertParallelMesh, MemoryPerRankCountsTheRanksExperts) {
  const ModelSpec m = primus::testing::tiny_moe(true);  // 8 experts
  primus::parallel::ParallelSizes one, two;
  one[primus::parallel::Dim::DP] = 2;
  two[primus::parallel::Dim::EP] = 2;
  const MeshMemory a = mesh_memory_per_rank(m, one, 2, 8), b = mesh_memory_per_rank(m, two, 2, 8);
  EXPECT_EQ(a.parameters_per_rank, make_param_layout(m).total);
  EXPECT_EQ(b.parameters_per_rank, EpShardMap(m, 2, 0).local_layout().total);
  EXPECT_LT(b.parameters_per_rank, a.parameters_per_rank);
  EXPECT_DOUBLE_EQ(b.optimizer, 8.0 * static_cast<double>(b.parameters_per_rank));
  EXPECT_NE(describe_mesh_memory(m, two, 2, 8).find("after tp 1 and ep 2"), std::string::npos);
}

}  // namespace
