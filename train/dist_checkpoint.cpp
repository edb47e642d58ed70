#include "train/dist_checkpoint.h"

#include <fmt/format.h>
#include <spdlog/spdlog.h>

#include <algorithm>
#include <cstring>
#include <map>

#include "core/util/error.h"
#include "io/safetensors.h"

namespace primus::train {

namespace fsys = std::filesystem;
using nlohmann::json;

std::string shard_file_name(int rank, int world) {
  return fmt::format("optimizer.rank{:05d}-of-{:05d}.safetensors", rank, world);
}

namespace {

// Staged next to the checkpoints under a name no checkpoint scan matches (not iter_*, not a
// .tmp-/.del- temporary that remove_stale_temporaries would take for a dead process's on
// another host).
fsys::path staged_path(const fsys::path& save_dir, int64_t iteration, const std::string& file) {
  return save_dir / fmt::format(".iter_{:07d}.{}.staged", iteration, file);
}

// Staged shards of other iterations are left by a save that was interrupted.
void remove_old_staged(const fsys::path& save_dir, int64_t iteration) {
  std::error_code ec;
  std::string keep = fmt::format(".iter_{:07d}.", iteration);
  for (const auto& e : fsys::directory_iterator(save_dir, ec)) {
    std::string n = e.path().filename().string();
    if (n.starts_with(".iter_") && n.ends_with(".staged") && !n.starts_with(keep)) {
      std::error_code rec;
      fsys::remove(e.path(), rec);
      if (!rec) spdlog::warn("removed '{}' left by an interrupted save", e.path().string());
    }
  }
}

// What each rank tells rank 0 about its shard file: 16 bytes, moved as raw bytes.
struct WireDigest {
  uint64_t size;
  uint32_t crc32c;
  uint32_t ok;
};
static_assert(sizeof(WireDigest) == 16);

}  // namespace

fsys::path save_data_parallel(dist::ProcessGroup& pg, const fsys::path& save_dir, int64_t iteration,
                              const io::CheckpointData& data, const ShardLayout* layout,
                              const std::vector<FlatShard>& shards, io::SaveOptions opts) {
  const int rank = pg.rank(), world = pg.world_size();
  json sharding = {{"world_size", world}, {"scheme", layout ? "zero1" : "none"}};
  if (layout) {
    PRIMUS_CHECK(layout->world == world, "shard layout for {} ranks in a group of {}", layout->world, world);
    std::error_code ec;
    fsys::create_directories(save_dir, ec);
    if (ec) throw IoError(fmt::format("cannot create checkpoint folder '{}': {}", save_dir.string(), ec.message()));
    const std::string file = shard_file_name(rank, world);
    const int64_t n = layout->valid_count(rank);
    io::SafetensorsWriter w;
    for (const auto& s : shards) w.add(s.name, io::DType::F32, {n}, s.data, sizeof(float) * static_cast<size_t>(n));
    w.set_metadata("rank", std::to_string(rank));
    w.set_metadata("world_size", std::to_string(world));
    w.set_metadata("begin", std::to_string(layout->begin(rank)));
    w.set_metadata("end", std::to_string(layout->valid_end(rank)));
    WireDigest mine{};
    io::FileDigest d = w.write(staged_path(save_dir, iteration, file));
    mine = {d.size, d.crc32c, 1};
    std::vector<WireDigest> all(world);
    // all_gather moves bytes without interpreting them: 16 bytes are 8 bf16 "elements".
    pg.all_gather(&mine, all.data(), sizeof(WireDigest) / 2, dist::DType::BF16);
    json list = json::array(), names = json::array();
    for (const auto& s : shards) names.push_back(s.name);
    for (int r = 0; r < world; ++r) {
      list.push_back({{"rank", r}, {"file", shard_file_name(r, world)}, {"begin", layout->begin(r)},
                      {"end", layout->valid_end(r)}});
      if (rank == 0) {
        opts.adopt.push_back({shard_file_name(r, world), staged_path(save_dir, iteration, shard_file_name(r, world)),
                              io::FileDigest{all[r].size, all[r].crc32c}});
      }
    }
    sharding.update({{"total", layout->total}, {"padded", layout->padded}, {"shard", layout->shard},
                     {"tensors", names}, {"shards", list}});
  }
  fsys::path dir = io::checkpoint_dir(save_dir, iteration);
  if (rank == 0) {
    opts.manifest_extra["sharding"] = sharding;
    dir = io::save_checkpoint(save_dir, iteration, data, opts);
    if (layout) remove_old_staged(save_dir, iteration);
  }
  // Nobody goes on (and maybe dies) before the checkpoint is complete: the last one loads.
  pg.barrier();
  return dir;
}

int saved_world_size(const io::CheckpointData& data) {
  if (!data.manifest.is_object() || !data.manifest.contains("sharding")) return 1;
  return data.manifest["sharding"].value("world_size", 1);
}

void read_flat_states(const io::CheckpointData& data, const fsys::path& dir, const std::vector<std::string>& names,
                      int64_t total, int64_t begin, int64_t end, const std::vector<float*>& dsts) {
  PRIMUS_CHECK(names.size() == dsts.size() && 0 <= begin && begin <= end && end <= total, "read_flat_states");
  auto bad = [&](const std::string& msg) { throw FormatError(fmt::format("checkpoint '{}': {}", dir.string(), msg)); };
  const json sharding = data.manifest.is_object() ? data.manifest.value("sharding", json::object()) : json::object();
  if (sharding.value("scheme", "none") != "zero1") {
    for (size_t i = 0; i < names.size(); ++i) {
      auto it = data.optimizer.find(names[i]);
      if (it == data.optimizer.end() || it->second.dtype() != io::DType::F32 ||
          it->second.numel() != static_cast<uint64_t>(total)) {
        bad(fmt::format("optimizer tensor '{}' is missing from {} or is not F32 of {} elements", names[i],
                        io::kOptimizerFile, total));
      }
      std::memcpy(dsts[i], it->second.as<float>().data() + begin, sizeof(float) * static_cast<size_t>(end - begin));
    }
    return;
  }
  int64_t saved_total = 0;
  int saved_world = 0;
  json shards;
  try {
    saved_total = sharding.at("total").get<int64_t>();
    saved_world = sharding.at("world_size").get<int>();
    shards = sharding.at("shards");
    if (!shards.is_array() || static_cast<int>(shards.size()) != saved_world) throw std::runtime_error("shard count");
  } catch (const std::exception& e) {
    bad(fmt::format("{}: \"sharding\" is malformed ({})", io::kManifestFile, e.what()));
  }
  if (saved_total != total) {
    bad(fmt::format("its optimizer state has {} elements, this model {}", saved_total, total));
  }
  int64_t covered = begin;
  for (const auto& s : shards) {
    int r = s.value("rank", -1);
    int64_t b = s.value("begin", int64_t(-1)), e = s.value("end", int64_t(-1));
    std::string file = s.value("file", "");
    if (r < 0 || b < 0 || e < b || file.empty()) bad(fmt::format("{}: shard entry {} is malformed", io::kManifestFile, s.dump()));
    int64_t lo = std::max(b, begin), hi = std::min(e, end);
    if (lo >= hi) continue;
    if (lo != covered) bad(fmt::format("{}: no shard holds elements [{}, {})", io::kManifestFile, covered, lo));
    std::string what = fmt::format("optimizer shard of rank {} of {}", r, saved_world);
    auto tensors = io::load_checkpoint_file(dir, file, what);
    for (size_t i = 0; i < names.size(); ++i) {
      auto it = tensors.find(names[i]);
      if (it == tensors.end() || it->second.dtype() != io::DType::F32 ||
          it->second.numel() != static_cast<uint64_t>(e - b)) {
        bad(fmt::format("file {} ({}) lacks tensor '{}' as F32 of {} elements", file, what, names[i], e - b));
      }
      std::memcpy(dsts[i] + (lo - begin), it->second.as<float>().data() + (lo - b),
                  sizeof(float) * static_cast<size_t>(hi - lo));
    }
    covered = hi;
  }
  if (covered != end) bad(fmt::format("{}: no shard holds elements [{}, {})", io::kManifestFile, covered, end));
}

}  // namespace primus::train
