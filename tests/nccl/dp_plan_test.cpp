// The data-parallel reducer's host-side plan (parallel/cuda/grad_reducer.h): where the
// backward's gradients become final, how the flat buffer is cut into buckets, ZeRO-1 padding.
// No GPU needed.
#include <gtest/gtest.h>

#include <algorithm>
#include <cstdlib>

#include "backends/cuda/model/decoder.h"
#include "parallel/cuda/grad_reducer.h"
#include "core/util/error.h"
#include "tests/common/tiny_models.h"
#include "parallel/dist_checkpoint.h"
#include "train/param_layout.h"

namespace primus::backends::cuda {
namespace {

using namespace ::primus::parallel;

// Buckets must tile [0, total) top down without gaps, each launched only once its gradients
// are final (ready_at <= begin), ready_at being one of the ready points.
void expect_tiling(const std::vector<GradBucket>& bs, const std::vector<int64_t>& ready, int64_t total) {
  ASSERT_FALSE(bs.empty());
  EXPECT_EQ(bs.front().end, total);
  EXPECT_EQ(bs.back().begin, 0);
  for (size_t i = 0; i < bs.size(); ++i) {
    EXPECT_LT(bs[i].begin, bs[i].end) << i;
    EXPECT_LE(bs[i].ready_at, bs[i].begin) << i;
    EXPECT_NE(std::find(ready.begin(), ready.end(), bs[i].ready_at), ready.end()) << i;
    if (i > 0) {
      EXPECT_EQ(bs[i].end, bs[i - 1].begin) << i;
    }
  }
}

TEST(DpPlan, ReadyPointsFollowTheBackwardTopDown) {
  for (bool llama : {false, true}) {
    train::ModelSpec spec = llama ? testing::tiny_llama() : testing::tiny_gpt2();
    spec.num_layers = 3;
    const auto layout = train::make_param_layout(spec);
    const auto pts = grad_ready_points(layout);
    ASSERT_EQ(pts.size(), 5u);  // final norm, layers 2, 1, 0, then the embeddings
    EXPECT_EQ(pts[0], layout.get("final_norm.weight").offset);
    EXPECT_EQ(pts[1], layout.get("layers.2.norm1.weight").offset);
    EXPECT_EQ(pts[3], layout.get("layers.0.norm1.weight").offset);
    EXPECT_EQ(pts[4], 0);
    for (size_t i = 1; i < pts.size(); ++i) EXPECT_LT(pts[i], pts[i - 1]);
    // Everything at or above a layer's norm1 belongs to that layer or later ones.
    for (const auto& t : layout.tensors) {
      if (t.name.rfind("layers.1.", 0) == 0) {
        EXPECT_GE(t.offset, pts[2]) << t.name;
        EXPECT_LT(t.offset, pts[1]) << t.name;
      }
    }
  }
}

TEST(DpPlan, SmallBucketsGiveOneBucketPerLayer) {
  const auto layout = train::make_param_layout(testing::tiny_gpt2());
  const auto pts = grad_ready_points(layout);
  const auto bs = plan_buckets(pts, layout.total, 1, 1);
  expect_tiling(bs, pts, layout.total);
  ASSERT_EQ(bs.size(), pts.size());
  for (size_t i = 0; i < bs.size(); ++i) EXPECT_EQ(bs[i].begin, pts[i]);
}

TEST(DpPlan, BigBucketsMergeLayersAndOneBucketHoldsAll) {
  train::ModelSpec spec = testing::tiny_gpt2();
  spec.num_layers = 6;
  const auto layout = train::make_param_layout(spec);
  const auto pts = grad_ready_points(layout);
  const int64_t layer = pts[1] - pts[2];
  auto bs = plan_buckets(pts, layout.total, 1, 2 * layer);
  expect_tiling(bs, pts, layout.total);
  EXPECT_LT(bs.size(), pts.size());
  for (size_t i = 0; i + 1 < bs.size(); ++i) EXPECT_GE(bs[i].end - bs[i].begin, 2 * layer) << i;
  bs = plan_buckets(pts, layout.total, 1, layout.total * 2);
  ASSERT_EQ(bs.size(), 1u);
  EXPECT_EQ(bs[0].begin, 0);
  EXPECT_EQ(bs[0].end, layout.total);
  EXPECT_EQ(bs[0].ready_at, 0);
}

TEST(DpPlan, Zero1BucketsSplitIntoEqualAlignedChunks) {
  for (int world : {2, 3, 8}) {
    train::ModelSpec spec = testing::tiny_llama();
    spec.num_layers = 4;
    const auto layout = train::make_param_layout(spec);
    const int64_t padded = zero1_padded_total(layout, world), g = zero1_granule(world);
    EXPECT_GE(padded, layout.total);
    EXPECT_LT(padded, layout.total + g);
    EXPECT_EQ(padded % g, 0);
    const auto pts = grad_ready_points(layout);
    const auto bs = plan_buckets(pts, padded, g, 1);
    expect_tiling(bs, pts, padded);
    for (const auto& b : bs) {
      EXPECT_EQ(b.begin % g, 0) << world;
      EXPECT_EQ((b.end - b.begin) % world, 0) << world;
      EXPECT_EQ(((b.end - b.begin) / world) % 64, 0) << world;  // each rank's chunk stays 256-byte aligned
    }
  }
}

// The checkpoint segments of the ZeRO-1 shards (DataParallel::shard_segments computes them the
// same way from its buckets): every real element in exactly one rank's segments, none of the
// padding, each segment one rank's chunk of one bucket.
TEST(DpPlan, Zero1ShardSegmentsPartitionTheRealElements) {
  for (int world : {2, 3, 8}) {
    for (int64_t bucket : {int64_t{1}, int64_t{1} << 40}) {
      train::ModelSpec spec = testing::tiny_llama();
      spec.num_layers = 4;
      const auto layout = train::make_param_layout(spec);
      const int64_t padded = zero1_padded_total(layout, world);
      const auto bs = plan_buckets(grad_ready_points(layout), padded, zero1_granule(world), bucket);
      std::vector<parallel::FlatSegment> buckets;
      for (const auto& b : bs) buckets.push_back({b.begin, b.end});
      parallel::FlatSharding s{layout.total, {}};
      for (int r = 0; r < world; ++r) s.ranks.push_back(parallel::bucket_chunk_segments(buckets, layout.total, r, world));
      EXPECT_EQ(parallel::check_flat_sharding(s), "") << world;
      int64_t count = 0;
      for (int r = 0; r < world; ++r) {
        count += s.count(r);
        // In bucket order, each segment rank r's chunk of a bucket (its end clipped to the total).
        size_t k = 0;
        for (const auto& g : s.ranks[r]) {
          while (k < bs.size() && bs[k].begin + r * ((bs[k].end - bs[k].begin) / world) != g.begin) ++k;
          ASSERT_LT(k, bs.size()) << "world " << world << " rank " << r << " segment " << g.begin;
          const int64_t c = (bs[k].end - bs[k].begin) / world;
          EXPECT_EQ(g.end, std::min(g.begin + c, layout.total));
          ++k;
        }
      }
      EXPECT_EQ(count, layout.total);
    }
  }
}

TEST(DpPlan, BadArgumentsAreErrorsSayingWhat) {
  const std::vector<int64_t> pts = {100, 50, 0};
  try {
    plan_buckets(pts, 130, 64, 1);
    FAIL();
  } catch (const RuntimeError& e) {
    EXPECT_NE(std::string(e.what()).find("total 130 must be a positive multiple of the granule 64"), std::string::npos)
        << e.what();
  }
  try {
    plan_buckets({100, 50}, 128, 1, 1);
    FAIL();
  } catch (const RuntimeError& e) {
    EXPECT_NE(std::string(e.what()).find("must end with 0"), std::string::npos) << e.what();
  }
  try {
    plan_buckets({50, 100, 0}, 128, 1, 1);
    FAIL();
  } catch (const RuntimeError& e) {
    EXPECT_NE(std::string(e.what()).find("ready point 1 (100) is out of order"), std::string::npos) << e.what();
  }
  EXPECT_THROW(plan_buckets(pts, 128, 1, 0), RuntimeError);
}

TEST(DpPlan, RankDeviceOutsideALaunchIsTheConfiguredOne) {
  unsetenv("RANK");
  unsetenv("WORLD_SIZE");
  unsetenv("SLURM_PROCID");
  unsetenv("SLURM_NTASKS");
  EXPECT_EQ(rank_device(3), 3);
  setenv("RANK", "1", 1);
  setenv("WORLD_SIZE", "2", 1);
  setenv("LOCAL_RANK", "1", 1);
  try {
    rank_device(3);
    FAIL();
  } catch (const ConfigError& e) {
    EXPECT_NE(std::string(e.what()).find("device: 3 is set, but under a multi-rank launch"), std::string::npos)
        << e.what();
  }
  unsetenv("RANK");
  unsetenv("WORLD_SIZE");
  unsetenv("LOCAL_RANK");
}

}  // namespace
}  // namespace primus::backends::cuda
