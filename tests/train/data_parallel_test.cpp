// parallel/data_parallel: W ranks read exactly the samples one rank reads, ZeRO-1 shards cover a
// buffer once, step statistics agree on every rank, and only rank 0 writes progress files.
#include "parallel/data_parallel.h"

#include <gtest/gtest.h>

#include <filesystem>
#include <memory>

#include "core/config/schema.h"
#include "core/config/yaml_loader.h"
#include "core/util/error.h"
#include "data/dataset/mock_dataset.h"
#include "parallel/socket_process_group.h"
#include "tests/core/test_util.h"
#include "tests/parallel/pg_test_util.h"
#include "train/progress.h"

using namespace primus;
using namespace primus::train;
using namespace primus::parallel;

namespace {

std::unique_ptr<data::BatchIterator> mock_iterator(int T) {
  return std::make_unique<data::BatchIterator>(std::make_shared<data::MockDataset>(T, 42, 1000));
}

}  // namespace

TEST(RankBatchSlice, SlicesInRankOrderAreTheGlobalBatch) {
  for (int world : {1, 2, 3, 4, 6}) {
    int64_t next = 0;
    for (int r = 0; r < world; ++r) {
      BatchSlice s = rank_batch_slice(12, r, world);
      EXPECT_EQ(s.first, next) << "world " << world << " rank " << r;
      EXPECT_EQ(s.count, 12 / world);
      next = s.first + s.count;
    }
    EXPECT_EQ(next, 12);
  }
  primus::testing::expect_error<ConfigError>([] { rank_batch_slice(10, 0, 4); },
                                     {"global_batch_size 10", "data-parallel size 4"});
  primus::testing::expect_error<ConfigError>([] { rank_batch_slice(8, 2, 2); }, {"rank 2 of 2"});
  primus::testing::expect_error<ConfigError>([] { RankBatchReader(12, 4, 0, 2); },
                                     {"global_batch_size 12", "micro_batch_size 4", "size 2"});
}

// One rank with global batch G reading G samples per step, versus W ranks with micro-batches:
// the ranks' micro-batches, in rank order then micro order, are the same samples in the same
// order, for every step.
TEST(RankBatchReader, RanksTogetherReadWhatOneRankReads) {
  const int T = 8, G = 12, steps = 3;
  const size_t row = T + 1;
  auto single = mock_iterator(T);
  std::vector<int32_t> want(G * row * steps);
  for (int s = 0; s < steps; ++s) single->next_batch(G, want.data() + s * G * row);
  for (int world : {1, 2, 3}) {
    for (int64_t micro : {int64_t(1), int64_t(2)}) {
      if ((G / world) % micro) continue;
      std::vector<int32_t> got;
      std::vector<std::unique_ptr<data::BatchIterator>> its;
      std::vector<RankBatchReader> readers;
      for (int r = 0; r < world; ++r) {
        its.push_back(mock_iterator(T));
        readers.emplace_back(G, micro, r, world);
      }
      for (int s = 0; s < steps; ++s) {
        for (int r = 0; r < world; ++r) {
          std::vector<int32_t> buf(micro * row);
          for (int64_t m = 0; m < readers[r].micro_batches(); ++m) {
            readers[r].read(*its[r], m, buf.data());
            got.insert(got.end(), buf.begin(), buf.end());
          }
          readers[r].finish_step(*its[r]);
          EXPECT_EQ(its[r]->position(), static_cast<uint64_t>((s + 1) * G));  // global samples: resumable anywhere
        }
      }
      EXPECT_EQ(got, want) << "world " << world << " micro " << micro;
    }
  }
}

TEST(ShardLayout, ShardsCoverTheBufferOncePaddedAtTheEnd) {
  for (int64_t total : {0, 1, 10, 12, 1001}) {
    for (int world : {1, 2, 3, 4}) {
      for (int64_t align : {1, 16}) {
        ShardLayout l = shard_layout(total, world, align);
        EXPECT_EQ(l.padded % (world * align), 0);
        EXPECT_GE(l.padded, total);
        EXPECT_LT(l.padded - total, world * align);
        int64_t covered = 0;
        for (int r = 0; r < world; ++r) {
          EXPECT_EQ(l.begin(r), covered);
          EXPECT_EQ(l.end(r) - l.begin(r), l.shard);
          EXPECT_LE(l.valid_end(r), std::min(l.end(r), std::max(total, l.begin(r))));
          EXPECT_GE(l.valid_count(r), 0);
          covered = l.end(r);
        }
        int64_t valid = 0;
        for (int r = 0; r < world; ++r) valid += l.valid_count(r);
        EXPECT_EQ(valid, total) << "total " << total << " world " << world;
      }
    }
  }
  ShardLayout l = shard_layout(10, 3);
  EXPECT_EQ(l.padded, 12);
  EXPECT_EQ(l.shard, 4);
  EXPECT_EQ(l.valid_end(2), 10);
}

TEST(ShardLayout, SegmentsOfContiguousAndPerBucketShards) {
  ShardLayout l = shard_layout(10, 3);
  EXPECT_EQ(layout_segments(l, 0), (std::vector<FlatSegment>{{0, 4}}));
  EXPECT_EQ(layout_segments(l, 2), (std::vector<FlatSegment>{{8, 10}}));
  EXPECT_TRUE(layout_segments(shard_layout(1, 3), 2).empty());  // owns only padding
  // Buckets top down over a buffer of 10 padded to 12, 2 ranks: chunk r of each bucket, clipped.
  const std::vector<FlatSegment> buckets = {{8, 12}, {4, 8}, {0, 4}};
  EXPECT_EQ(bucket_chunk_segments(buckets, 10, 0, 2), (std::vector<FlatSegment>{{8, 10}, {4, 6}, {0, 2}}));
  EXPECT_EQ(bucket_chunk_segments(buckets, 10, 1, 2), (std::vector<FlatSegment>{{6, 8}, {2, 4}}));  // [10, 12) is padding
  EXPECT_EQ(bucket_chunk_segments(buckets, 11, 1, 2), (std::vector<FlatSegment>{{10, 11}, {6, 8}, {2, 4}}));
  try {
    bucket_chunk_segments({{0, 5}}, 5, 0, 2);
    FAIL();
  } catch (const RuntimeError& e) {
    EXPECT_NE(std::string(e.what()).find("bucket [0, 5) cannot be cut into 2 equal chunks"), std::string::npos)
        << e.what();
  }
}

TEST(GlobalStats, SumMeanAndNormAgreeOnEveryRank) {
  parallel::SingleProcessGroup one;
  EXPECT_EQ(global_sum(one, 0.1), 0.1);
  EXPECT_EQ(global_norm(one, 9.0), 3.0);

  parallel::TcpStore host("127.0.0.1", 0, true, std::chrono::milliseconds(5000));
  const int world = 3;
  // Values a float cannot hold exactly: the sum is still the double sum in rank order.
  const double vals[world] = {1.0 / 3.0, 2.718281828459045, 1e-9 + 4.0};
  std::vector<double> sums(world), means(world), norms(world);
  auto out = parallel::run_ranks(host, world, std::chrono::milliseconds(5000), [&](parallel::ProcessGroup& pg) {
    sums[pg.rank()] = global_sum(pg, vals[pg.rank()]);
    means[pg.rank()] = global_mean(pg, vals[pg.rank()]);
    norms[pg.rank()] = global_norm(pg, vals[pg.rank()] * vals[pg.rank()]);
  });
  double want = (vals[0] + vals[1]) + vals[2];
  double want_norm = std::sqrt((vals[0] * vals[0] + vals[1] * vals[1]) + vals[2] * vals[2]);
  for (int r = 0; r < world; ++r) {
    ASSERT_TRUE(out[r].ok) << out[r].error;
    EXPECT_NEAR(sums[r], want, 1e-13) << r;
    EXPECT_EQ(sums[r], sums[0]);
    EXPECT_NEAR(means[r], want / 3, 1e-13);
    EXPECT_NEAR(norms[r], want_norm, 1e-12);
  }
}

TEST(DataParallelArgs, DefaultsWhenTheSchemaLacksTheKeys) {
  config::Value empty;
  DataParallelArgs a = DataParallelArgs::from_config(empty);
  EXPECT_FALSE(a.distributed_optimizer);
  EXPECT_EQ(a.bucket_size_mb, 160);
  a.bucket_size_mb = 1;
  EXPECT_EQ(a.bucket_elems(4), 262144);
  a.bucket_size_mb = 1e-9;
  EXPECT_EQ(a.bucket_elems(4), 1);
}

// Megatron-LM's ddp_bucket_size counts gradient elements and replaces the MiB key, refused beside a
// ddp_bucket_size_mb a layer sets.
TEST(DataParallelArgs, MegatronBucketSizeInElements) {
  config::Schema s;
  add_data_parallel_schema(s);
  auto args = [&](const std::string& yaml) {
    config::Value v = config::parse_yaml_text(yaml, "exp.yaml");
    s.validate(v);
    s.apply_defaults(v);
    return DataParallelArgs::from_config(v);
  };
  EXPECT_EQ(args("ddp_bucket_size: 1000000\n").bucket_elems(4), 1000000);
  EXPECT_EQ(args("ddp_bucket_size: 1000000\n").bucket_elems(2), 1000000);  // elements whatever their dtype
  EXPECT_EQ(args("ddp_bucket_size_mb: 1\n").bucket_elems(4), 262144);
  try {
    args("ddp_bucket_size: 1000\nddp_bucket_size_mb: 1\n");
    ADD_FAILURE() << "both bucket sizes were accepted";
  } catch (const ConfigError& e) {
    EXPECT_NE(std::string(e.what()).find("exp.yaml:1:18: ddp_bucket_size (elements"), std::string::npos) << e.what();
  }
}

TEST(ProgressReporter, DisabledOnOtherRanksWritesNothing) {
  primus::testing::TempDir dir;
  {
    ProgressReporter off(dir.path() / "out", dir.path() / "tb", 10, 1, 0, /*enabled=*/false);
    StepStats s;
    s.step = 1;
    s.loss = 2;
    off.step(s);
    off.eval(1, 2.0);
    off.flush();
    EXPECT_TRUE(off.metrics_path().empty());
  }
  EXPECT_FALSE(std::filesystem::exists(dir.path() / "out"));
  EXPECT_FALSE(std::filesystem::exists(dir.path() / "tb"));
  {
    ProgressReporter on(dir.path() / "out", "", 10, 1, 0);
    StepStats s;
    s.step = 1;
    on.step(s);
  }
  EXPECT_TRUE(std::filesystem::exists(dir.path() / "out" / "metrics.jsonl"));
}
