// parallel/dist_checkpoint with shards made of several segments of the flat buffer, as the cuda
// trainer's ZeRO-1 has them (one chunk of every gradient bucket per rank, the padding of the
// top bucket cut off): saved at world sizes 1, 2 and 3 and read back at 1, 2 and 3, as per-bucket
// shards, as contiguous ones and whole, bit for bit; checkpoints in the contiguous format written
// before segments still load; manifests whose segments overlap, leave a gap, leave the buffer
// or disagree with the shard files are refused naming the checkpoint and the file; a save whose
// shards do not partition the buffer, or where one rank cannot write its shard, fails on every
// rank without a hang and installs nothing.
#include <gtest/gtest.h>

#include <cmath>
#include <cstring>
#include <fstream>

#include "core/util/fs.h"
#include "io/safetensors.h"
#include "tests/core/test_util.h"
#include "tests/parallel/pg_test_util.h"
#include "parallel/dist_checkpoint.h"

using namespace primus;
using namespace primus::train;
using namespace primus::parallel;
namespace fsys = std::filesystem;
using Ms = std::chrono::milliseconds;
using nlohmann::json;

namespace {

constexpr int64_t kSegTotal = 37;
const std::vector<std::string> kNames = {"exp_avg", "exp_avg_sq"};

// Values whose bits are all different: a misplaced element shows.
float seg_m_at(int64_t i) { return 1.0f / static_cast<float>(i + 1) + static_cast<float>(i); }
float seg_v_at(int64_t i) { return std::sqrt(static_cast<float>(i) + 0.25f) * 1e-3f; }

// The cuda trainer's sharding at a small scale (parallel/cuda/grad_reducer.h): the buffer padded
// to a multiple of the granule (4 x world here, 64 x world there), cut top down into 3 buckets
// at granule multiples, each bucket cut into `world` chunks; rank r owns chunk r of each bucket,
// in bucket order, clipped to kSegTotal. For 2 ranks: buckets [16, 40), [8, 16), [0, 8); rank 1 owns
// [28, 37) (3 padding elements cut off), [12, 16), [4, 8). For 3 ranks rank 2's chunk of the top
// bucket is all padding and left out.
FlatSharding cuda_like(int world) {
  const int64_t g = 4 * world, padded = (kSegTotal + g - 1) / g * g, a = g * std::max<int64_t>(1, padded / g / 3);
  const std::vector<FlatSegment> buckets = {{2 * a, padded}, {a, 2 * a}, {0, a}};
  FlatSharding s{kSegTotal, {}};
  for (int r = 0; r < world; ++r) s.ranks.push_back(bucket_chunk_segments(buckets, kSegTotal, r, world));
  return s;
}
FlatSharding contiguous(int world) { return flat_sharding(shard_layout(kSegTotal, world)); }

// The elements of `segs` of seg_m_at / seg_v_at, concatenated: what a rank holding them keeps.
std::vector<float> pack(const std::vector<FlatSegment>& segs, float (*f)(int64_t)) {
  std::vector<float> out;
  for (const auto& s : segs) {
    for (int64_t i = s.begin; i < s.end; ++i) out.push_back(f(i));
  }
  return out;
}

io::CheckpointData rank0_data() {
  io::CheckpointData d;
  d.model.emplace("w", io::TensorBlob::from_vector<float>({2}, {1.f, 2.f}));
  d.state = {{"step", 7}};
  return d;
}

// Saves iteration 7 from sharding.world() threads, each rank passing its own segments' values.
fsys::path save(const fsys::path& dir, const FlatSharding& sharding) {
  parallel::TcpStore host("127.0.0.1", 0, true, Ms(5000));
  auto out = parallel::run_ranks(host, sharding.world(), Ms(5000), [&](parallel::ProcessGroup& pg) {
    const auto& segs = sharding.ranks[static_cast<size_t>(pg.rank())];
    std::vector<float> m = pack(segs, seg_m_at), v = pack(segs, seg_v_at);
    io::CheckpointData d = pg.rank() == 0 ? rank0_data() : io::CheckpointData{};
    save_data_parallel(pg, dir, 7, d, &sharding, {{"exp_avg", m.data()}, {"exp_avg_sq", v.data()}}, {});
  });
  for (int r = 0; r < sharding.world(); ++r) EXPECT_TRUE(out[r].ok) << "rank " << r << ": " << out[r].error;
  return io::checkpoint_dir(dir, 7);
}

// Every rank of `load` reads its segments; put back in place they must be the saved values bit
// for bit.
void expect_bit_identical(const fsys::path& ck, const FlatSharding& load, const std::string& label) {
  io::CheckpointData data = io::load_checkpoint(ck, false);
  std::vector<float> m(kSegTotal, NAN), v(kSegTotal, NAN);
  for (int r = 0; r < load.world(); ++r) {
    const auto& segs = load.ranks[static_cast<size_t>(r)];
    std::vector<float> pm(static_cast<size_t>(load.count(r)), NAN), pv(pm.size(), NAN);
    read_flat_states(data, ck, kNames, kSegTotal, segs, {pm.data(), pv.data()});
    int64_t off = 0;
    for (const auto& s : segs) {
      std::memcpy(&m[s.begin], &pm[off], sizeof(float) * s.size());
      std::memcpy(&v[s.begin], &pv[off], sizeof(float) * s.size());
      off += s.size();
    }
  }
  const std::vector<float> em = pack({{0, kSegTotal}}, seg_m_at), ev = pack({{0, kSegTotal}}, seg_v_at);
  EXPECT_EQ(std::memcmp(m.data(), em.data(), sizeof(float) * kSegTotal), 0) << label;
  EXPECT_EQ(std::memcmp(v.data(), ev.data(), sizeof(float) * kSegTotal), 0) << label;
}

void expect_loads_everywhere(const fsys::path& ck, const std::string& saved) {
  for (int w : {1, 2, 3}) {
    expect_bit_identical(ck, cuda_like(w), saved + " -> per-bucket shards at " + std::to_string(w));
    expect_bit_identical(ck, contiguous(w), saved + " -> contiguous shards at " + std::to_string(w));
  }
  expect_bit_identical(ck, FlatSharding{kSegTotal, {{{0, kSegTotal}}}}, saved + " -> whole");
}

// A checkpoint written by hand (io::save_checkpoint adopting shard files): shard file r holds the
// values of data_segs[r] with metadata meta[r]; the manifest's "sharding" is `sharding` as given.
fsys::path write_by_hand(const fsys::path& save_dir, const std::vector<std::vector<FlatSegment>>& data_segs,
                         const std::vector<std::map<std::string, std::string>>& meta, const json& sharding) {
  fsys::create_directories(save_dir);
  io::SaveOptions so;
  const int world = static_cast<int>(data_segs.size());
  for (int r = 0; r < world; ++r) {
    std::vector<float> m = pack(data_segs[r], seg_m_at), v = pack(data_segs[r], seg_v_at);
    io::SafetensorsWriter w;
    w.add_copy("exp_avg", io::DType::F32, {static_cast<int64_t>(m.size())}, m.data(), m.size() * sizeof(float));
    w.add_copy("exp_avg_sq", io::DType::F32, {static_cast<int64_t>(v.size())}, v.data(), v.size() * sizeof(float));
    for (const auto& [k, val] : meta[r]) w.set_metadata(k, val);
    const fsys::path staged = save_dir / (shard_file_name(r, world) + ".staged");
    so.adopt.push_back({shard_file_name(r, world), staged, w.write(staged)});
  }
  so.manifest_extra["sharding"] = sharding;
  return io::save_checkpoint(save_dir, 7, rank0_data(), so);
}

}  // namespace

TEST(DistCheckpointSegments, BucketChunksOfTheCudaTrainerPartitionTheBuffer) {
  for (int w : {1, 2, 3}) EXPECT_EQ(check_flat_sharding(cuda_like(w)), "") << w;
  const FlatSharding two = cuda_like(2);
  EXPECT_EQ(two.ranks[0], (std::vector<FlatSegment>{{16, 28}, {8, 12}, {0, 4}}));
  EXPECT_EQ(two.ranks[1], (std::vector<FlatSegment>{{28, 37}, {12, 16}, {4, 8}}));
  EXPECT_EQ(cuda_like(3).ranks[2], (std::vector<FlatSegment>{{20, 24}, {8, 12}}));  // its top chunk is padding
}

TEST(DistCheckpointSegments, SavedAtOneTwoThreeRanksLoadsAtOneTwoThreeBitIdentical) {
  for (int w : {1, 2, 3}) {
    primus::testing::TempDir tmp;
    const fsys::path ck = save(tmp.path(), cuda_like(w));
    io::CheckpointData data = io::load_checkpoint(ck);  // verifies every shard file too
    EXPECT_EQ(saved_world_size(data), w);
    const json& sh = data.manifest.at("sharding");
    EXPECT_EQ(sh.at("scheme"), "zero1");
    EXPECT_EQ(sh.at("total"), kSegTotal);
    ASSERT_EQ(sh.at("shards").size(), static_cast<size_t>(w));
    const FlatSharding saved = cuda_like(w);
    for (int r = 0; r < w; ++r) {
      const json& e = sh.at("shards")[r];
      const auto& segs = saved.ranks[r];
      EXPECT_EQ(e.at("file"), shard_file_name(r, w));
      EXPECT_EQ(e.at("elements"), saved.count(r));
      ASSERT_EQ(e.at("segments").size(), segs.size());
      for (size_t k = 0; k < segs.size(); ++k) {
        EXPECT_EQ(e.at("segments")[k], json::array({segs[k].begin, segs[k].end})) << w << " " << r << " " << k;
      }
      EXPECT_FALSE(e.contains("begin"));  // several segments: no single range to give
      // The shard file records the same segments, and holds exactly their elements.
      io::SafetensorsFile f = io::SafetensorsFile::open(ck / shard_file_name(r, w));
      EXPECT_EQ(json::parse(f.metadata().at("segments")), e.at("segments"));
      EXPECT_EQ(f.metadata().at("rank"), std::to_string(r));
      EXPECT_EQ(f.info("exp_avg").shape, std::vector<int64_t>{saved.count(r)});
    }
    EXPECT_TRUE(data.optimizer.empty());
    expect_loads_everywhere(ck, "per-bucket shards of " + std::to_string(w));
  }
  // The reference trainer's contiguous shards, written by this version: one segment each, with
  // begin/end as before, and the same loads.
  primus::testing::TempDir tmp;
  const fsys::path ck = save(tmp.path(), contiguous(2));
  io::CheckpointData data = io::load_checkpoint(ck);
  EXPECT_EQ(data.manifest.at("sharding").at("shards")[1].at("begin"), 19);
  EXPECT_EQ(data.manifest.at("sharding").at("shards")[1].at("end"), 37);
  expect_loads_everywhere(ck, "contiguous shards of 2");
}

TEST(DistCheckpointSegments, ContiguousCheckpointsWrittenBeforeSegmentsStillLoad) {
  // Exactly what save_data_parallel wrote before segments (reference trainer, 2 ranks): each
  // shard entry and file has begin/end only, and "padded"/"shard" are in the manifest.
  primus::testing::TempDir tmp;
  const ShardLayout l = shard_layout(kSegTotal, 2);
  json list = json::array();
  std::vector<std::vector<FlatSegment>> segs;
  std::vector<std::map<std::string, std::string>> meta;
  for (int r = 0; r < 2; ++r) {
    list.push_back({{"rank", r}, {"file", shard_file_name(r, 2)}, {"begin", l.begin(r)}, {"end", l.valid_end(r)}});
    segs.push_back({{l.begin(r), l.valid_end(r)}});
    meta.push_back({{"rank", std::to_string(r)}, {"world_size", "2"}, {"begin", std::to_string(l.begin(r))},
                    {"end", std::to_string(l.valid_end(r))}});
  }
  const json sharding = {{"world_size", 2}, {"scheme", "zero1"}, {"total", kSegTotal}, {"padded", l.padded},
                         {"shard", l.shard}, {"tensors", kNames}, {"shards", list}};
  const fsys::path ck = write_by_hand(tmp.path(), segs, meta, sharding);
  expect_loads_everywhere(ck, "pre-segment contiguous shards of 2");
}

TEST(DistCheckpointSegments, InconsistentShardingsAreRefusedNamingTheFile) {
  primus::testing::TempDir tmp;
  const fsys::path ck = save(tmp.path(), cuda_like(2));
  const io::CheckpointData good = io::load_checkpoint(ck, false);
  const std::string f0 = shard_file_name(0, 2), f1 = shard_file_name(1, 2);
  std::vector<float> m(kSegTotal), v(kSegTotal);
  // read_flat_states on the checkpoint with its manifest's "sharding" edited by `edit`.
  auto read_edited = [&](const std::function<void(json&)>& edit) {
    io::CheckpointData d = io::load_checkpoint(ck, false);
    edit(d.manifest["sharding"]);
    read_flat_states(d, ck, kNames, kSegTotal, 0, kSegTotal, {m.data(), v.data()});
  };
  auto segs_of = [](json& sh, int r) -> json& { return sh["shards"][r]["segments"]; };
  // Rank 1's [4, 8) stretched to [2, 8) overlaps rank 0's [0, 4).
  primus::testing::expect_error<FormatError>(
      [&] { read_edited([&](json& sh) { segs_of(sh, 1)[2] = {2, 8}; sh["shards"][1].erase("elements"); }); },
      {ck.string(), "manifest.json", "segment [2, 8) of rank 1 (" + f1 + ") overlaps segment [0, 4) of rank 0 (" + f0});
  // Rank 1's [12, 16) dropped: nobody holds those elements.
  primus::testing::expect_error<FormatError>(
      [&] { read_edited([&](json& sh) { segs_of(sh, 1).erase(1); sh["shards"][1].erase("elements"); }); },
      {ck.string(), "manifest.json", "no shard holds elements [12, 16)", "between segment [8, 12) of rank 0 (" + f0,
       "and segment [16, 28) of rank 0 (" + f0});
  // Rank 1's [28, 37) reaching into the padding.
  primus::testing::expect_error<FormatError>(
      [&] { read_edited([&](json& sh) { segs_of(sh, 1)[0] = {28, 40}; sh["shards"][1].erase("elements"); }); },
      {ck.string(), "segment [28, 40) of rank 1 (" + f1 + ") is empty or outside [0, 37)"});
  // Not [begin, end] pairs; an "elements" that disagrees with the segments; a missing rank.
  primus::testing::expect_error<FormatError>([&] { read_edited([&](json& sh) { segs_of(sh, 0)[1] = json::array({8}); }); },
                                             {ck.string(), "\"sharding\" is malformed", "[8] is not [begin, end]"});
  primus::testing::expect_error<FormatError>([&] { read_edited([&](json& sh) { sh["shards"][0]["elements"] = 3; }); },
                                             {ck.string(), f0, "says 3 elements, its segments hold 20"});
  primus::testing::expect_error<FormatError>([&] { read_edited([&](json& sh) { sh["shards"].erase(1); }); },
                                             {ck.string(), "\"sharding\" is malformed", "1 shard entries for world_size 2"});
  // A valid partition that is not what the files hold: the ranks' lists swapped. The shard file's
  // own record of its segments disagrees.
  primus::testing::expect_error<FormatError>(
      [&] {
        read_edited([&](json& sh) {
          std::swap(segs_of(sh, 0), segs_of(sh, 1));
          sh["shards"][0].erase("elements");
          sh["shards"][1].erase("elements");
        });
      },
      {ck.string(), f0, "optimizer shard of rank 0 of 2", "says it holds segments [[16,28],[8,12],[0,4]]",
       "manifest.json lists [[28,37],[12,16],[4,8]]"});
  // The untouched checkpoint still reads.
  read_flat_states(good, ck, kNames, kSegTotal, 0, kSegTotal, {m.data(), v.data()});
  EXPECT_EQ(m[30], seg_m_at(30));
}

TEST(DistCheckpointSegments, ShardFileShorterThanItsSegmentsIsRefusedNamingIt) {
  // Manifest and metadata agree on rank 1's segments, but its tensors lack the last element.
  primus::testing::TempDir tmp;
  const FlatSharding s = cuda_like(2);
  json list = json::array();
  std::vector<std::vector<FlatSegment>> data = s.ranks;
  data[1][0].end -= 1;
  std::vector<std::map<std::string, std::string>> meta(2);
  for (int r = 0; r < 2; ++r) {
    json segs = json::array();
    for (const auto& g : s.ranks[r]) segs.push_back({g.begin, g.end});
    list.push_back({{"rank", r}, {"file", shard_file_name(r, 2)}, {"segments", segs}});
    meta[r] = {{"segments", segs.dump()}};
  }
  const fsys::path ck = write_by_hand(
      tmp.path(), data, meta, {{"world_size", 2}, {"scheme", "zero1"}, {"total", kSegTotal}, {"shards", list}});
  io::CheckpointData d = io::load_checkpoint(ck, false);
  std::vector<float> m(kSegTotal), v(kSegTotal);
  read_flat_states(d, ck, kNames, kSegTotal, 16, 28, {m.data(), v.data()});  // rank 0's file alone: fine
  primus::testing::expect_error<FormatError>(
      [&] { read_flat_states(d, ck, kNames, kSegTotal, 0, kSegTotal, {m.data(), v.data()}); },
      {ck.string(), shard_file_name(1, 2), "optimizer shard of rank 1 of 2", "lacks tensor 'exp_avg' as F32 of 17 elements",
       "3 segment(s)"});
}

TEST(DistCheckpointSegments, SaveFailsOnEveryRankWithoutHangingAndInstallsNothing) {
  // Shards that overlap: refused before anything is written, on every rank.
  {
    primus::testing::TempDir tmp;
    FlatSharding s = cuda_like(2);
    s.ranks[1][2] = {2, 8};
    parallel::TcpStore host("127.0.0.1", 0, true, Ms(5000));
    std::vector<float> buf(kSegTotal);
    auto out = parallel::run_ranks(host, 2, Ms(5000), [&](parallel::ProcessGroup& pg) {
      save_data_parallel(pg, tmp.path(), 7, rank0_data(), &s, {{"exp_avg", buf.data()}}, {});
    });
    for (int r = 0; r < 2; ++r) {
      EXPECT_FALSE(out[r].ok);
      EXPECT_NE(out[r].error.find("do not partition the flat buffer: segment [2, 8) of rank 1 overlaps"),
                std::string::npos)
          << out[r].error;
    }
    EXPECT_TRUE(io::list_checkpoints(tmp.path()).empty());
  }
  // Rank 1 cannot write its shard (a folder sits where its staged file goes): rank 1 reports its
  // error, rank 0 names rank 1, neither waits for the timeout, nothing is installed.
  primus::testing::TempDir tmp;
  const FlatSharding s = cuda_like(2);
  fsys::create_directories(tmp.path() / (".iter_0000007." + shard_file_name(1, 2) + ".staged") / "x");
  parallel::TcpStore host("127.0.0.1", 0, true, Ms(5000));
  auto out = parallel::run_ranks(host, 2, Ms(5000), [&](parallel::ProcessGroup& pg) {
    const auto& segs = s.ranks[static_cast<size_t>(pg.rank())];
    std::vector<float> m = pack(segs, seg_m_at), v = pack(segs, seg_v_at);
    save_data_parallel(pg, tmp.path(), 7, rank0_data(), &s, {{"exp_avg", m.data()}, {"exp_avg_sq", v.data()}}, {});
  });
  EXPECT_FALSE(out[0].ok);
  EXPECT_FALSE(out[1].ok);
  EXPECT_NE(out[0].error.find("checkpoint 7 in '" + tmp.path().string() + "' was not saved: rank(s) 1 could not write"),
            std::string::npos)
      << out[0].error;
  EXPECT_NE(out[1].error.find(shard_file_name(1, 2)), std::string::npos) << out[1].error;
  for (int r = 0; r < 2; ++r) EXPECT_LT(out[r].seconds, 4.0) << r;
  EXPECT_TRUE(io::list_checkpoints(tmp.path()).empty());
  EXPECT_FALSE(fsys::exists(tmp.path() / (".iter_0000007." + shard_file_name(0, 2) + ".staged")));
}
