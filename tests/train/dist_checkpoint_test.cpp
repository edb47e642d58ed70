// parallel/dist_checkpoint: a ZeRO-1 checkpoint written by 2 ranks (threads) holds one shard file per
// rank in one atomic checkpoint, reads back at world sizes 1, 2 and 3, and names the file and
// rank of a missing or corrupt shard.
#include "parallel/dist_checkpoint.h"

#include <gtest/gtest.h>

#include <fstream>
#include <numeric>

#include "core/util/fs.h"
#include "tests/core/test_util.h"
#include "tests/parallel/pg_test_util.h"

using namespace primus;
using namespace primus::train;
using namespace primus::parallel;
namespace fsys = std::filesystem;
using Ms = std::chrono::milliseconds;

namespace {

constexpr int64_t kTotal = 11;

float m_at(int64_t i) { return static_cast<float>(i) + 0.5f; }
float v_at(int64_t i) { return static_cast<float>(i * i); }

io::CheckpointData rank0_data(const std::vector<float>* m, const std::vector<float>* v) {
  io::CheckpointData d;
  d.model.emplace("w", io::TensorBlob::from_vector<float>({2}, {1.f, 2.f}));
  if (m) {
    d.optimizer.emplace("exp_avg", io::TensorBlob::from_vector<float>({kTotal}, *m));
    d.optimizer.emplace("exp_avg_sq", io::TensorBlob::from_vector<float>({kTotal}, *v));
  }
  d.state = {{"step", 7}};
  return d;
}

// Saves iteration 7 from `world` threads; with zero1 each rank passes its shard of m and v.
void save(const fsys::path& dir, int world, bool zero1) {
  parallel::TcpStore host("127.0.0.1", 0, true, Ms(5000));
  std::vector<float> m(kTotal), v(kTotal);
  for (int64_t i = 0; i < kTotal; ++i) m[i] = m_at(i), v[i] = v_at(i);
  ShardLayout layout = shard_layout(kTotal, world);
  auto out = parallel::run_ranks(host, world, Ms(5000), [&](parallel::ProcessGroup& pg) {
    io::CheckpointData d = pg.rank() == 0 ? rank0_data(zero1 ? nullptr : &m, zero1 ? nullptr : &v) : io::CheckpointData{};
    std::vector<FlatShard> shards;
    if (zero1) shards = {{"exp_avg", m.data() + layout.begin(pg.rank())}, {"exp_avg_sq", v.data() + layout.begin(pg.rank())}};
    io::SaveOptions so;
    save_data_parallel(pg, dir, 7, d, zero1 ? &layout : nullptr, shards, so);
  });
  for (int r = 0; r < world; ++r) ASSERT_TRUE(out[r].ok) << "rank " << r << ": " << out[r].error;
}

// Reads back what every rank of `world` would own, checking the values.
void expect_reads(const fsys::path& ck, int world) {
  io::CheckpointData data = io::load_checkpoint(ck, false);
  ShardLayout l = shard_layout(kTotal, world);
  for (int r = 0; r < world; ++r) {
    int64_t b = l.begin(r), e = l.valid_end(r);
    std::vector<float> m(e - b, -1.f), v(e - b, -1.f);
    read_flat_states(data, ck, {"exp_avg", "exp_avg_sq"}, kTotal, b, e, {m.data(), v.data()});
    for (int64_t i = b; i < e; ++i) {
      ASSERT_EQ(m[i - b], m_at(i)) << "world " << world << " rank " << r << " i " << i;
      ASSERT_EQ(v[i - b], v_at(i)) << "world " << world << " rank " << r << " i " << i;
    }
  }
}

}  // namespace

TEST(DistCheckpoint, Zero1ShardsInOneAtomicCheckpointReadAtAnyWorldSize) {
  primus::testing::TempDir tmp;
  save(tmp.path(), 2, true);
  fsys::path ck = io::checkpoint_dir(tmp.path(), 7);
  EXPECT_TRUE(fsys::exists(ck / shard_file_name(0, 2)));
  EXPECT_TRUE(fsys::exists(ck / shard_file_name(1, 2)));
  EXPECT_EQ(fs::read_file(tmp.path() / io::kTrackerFile), "7");
  for (auto& e : fsys::directory_iterator(tmp.path())) {
    EXPECT_FALSE(e.path().filename().string().ends_with(".staged")) << e.path();
  }
  io::CheckpointData data = io::load_checkpoint(ck);  // verifies every shard too
  EXPECT_EQ(saved_world_size(data), 2);
  const auto& sh = data.manifest.at("sharding");
  EXPECT_EQ(sh.at("scheme"), "zero1");
  EXPECT_EQ(sh.at("total"), kTotal);
  ASSERT_EQ(sh.at("shards").size(), 2u);
  EXPECT_EQ(sh.at("shards")[1].at("begin"), 6);
  EXPECT_EQ(sh.at("shards")[1].at("end"), 11);
  EXPECT_TRUE(data.optimizer.empty());
  for (int world : {1, 2, 3, 4}) expect_reads(ck, world);
}

TEST(DistCheckpoint, PlainDataParallelIsWrittenByRankZeroAlone) {
  primus::testing::TempDir tmp;
  save(tmp.path(), 2, false);
  fsys::path ck = io::checkpoint_dir(tmp.path(), 7);
  EXPECT_FALSE(fsys::exists(ck / shard_file_name(0, 2)));
  io::CheckpointData data = io::load_checkpoint(ck);
  EXPECT_EQ(saved_world_size(data), 2);
  EXPECT_EQ(data.manifest.at("sharding").at("scheme"), "none");
  for (int world : {1, 2, 3}) expect_reads(ck, world);
}

TEST(DistCheckpoint, MissingOrCorruptShardNamesTheFileAndRank) {
  primus::testing::TempDir tmp;
  save(tmp.path(), 2, true);
  fsys::path ck = io::checkpoint_dir(tmp.path(), 7);
  io::CheckpointData data = io::load_checkpoint(ck, false);
  std::vector<float> m(kTotal), v(kTotal);
  // Rank 0's range of a 2-rank run needs only shard 0: corrupting shard 1 does not matter.
  {
    std::fstream f(ck / shard_file_name(1, 2), std::ios::in | std::ios::out | std::ios::binary);
    f.seekp(-2, std::ios::end);
    f.put('\x7f');
  }
  read_flat_states(data, ck, {"exp_avg", "exp_avg_sq"}, kTotal, 0, 6, {m.data(), v.data()});
  primus::testing::expect_error<FormatError>(
      [&] { read_flat_states(data, ck, {"exp_avg", "exp_avg_sq"}, kTotal, 0, kTotal, {m.data(), v.data()}); },
      {ck.string(), shard_file_name(1, 2), "checksum", "optimizer shard of rank 1 of 2"});
  fsys::remove(ck / shard_file_name(1, 2));
  primus::testing::expect_error<FormatError>(
      [&] { read_flat_states(data, ck, {"exp_avg", "exp_avg_sq"}, kTotal, 4, 8, {m.data(), v.data()}); },
      {ck.string(), shard_file_name(1, 2), "missing", "optimizer shard of rank 1 of 2"});
  primus::testing::expect_error<FormatError>(
      [&] { read_flat_states(data, ck, {"exp_avg"}, kTotal + 1, 0, 1, {m.data()}); },
      {"11 elements", "this model 12"});
}
