#include "parallel/dist_checkpoint.h"

#include <fmt/format.h>
#include <fmt/ranges.h>
#include <spdlog/spdlog.h>

#include <algorithm>
#include <cstring>
#include <exception>
#include <map>
#include <set>

#include "core/util/error.h"
#include "io/safetensors.h"

namespace primus::parallel {

namespace fsys = std::filesystem;
using nlohmann::json;

std::string shard_file_name(int rank, int world) {
  return fmt::format("optimizer.rank{:05d}-of-{:05d}.safetensors", rank, world);
}

int64_t FlatSharding::count(int rank) const {
  PRIMUS_CHECK(rank >= 0 && rank < world(), "rank {} of a sharding for {}", rank, world());
  int64_t n = 0;
  for (const auto& s : ranks[static_cast<size_t>(rank)]) n += s.size();
  return n;
}

FlatSharding flat_sharding(const ShardLayout& layout) {
  FlatSharding s;
  s.total = layout.total;
  for (int r = 0; r < layout.world; ++r) s.ranks.push_back(layout_segments(layout, r));
  return s;
}

std::string check_flat_sharding(const FlatSharding& s, const std::function<std::string(int)>& file_of) {
  auto who = [&](int r) { return file_of ? fmt::format("rank {} ({})", r, file_of(r)) : fmt::format("rank {}", r); };
  if (s.total < 0) return fmt::format("the flat buffer has {} elements", s.total);
  struct Item {
    FlatSegment seg;
    int rank;
  };
  std::vector<Item> items;
  for (int r = 0; r < s.world(); ++r) {
    for (const auto& seg : s.ranks[static_cast<size_t>(r)]) {
      if (seg.begin < 0 || seg.end > s.total || seg.begin >= seg.end) {
        return fmt::format("segment [{}, {}) of {} is empty or outside [0, {})", seg.begin, seg.end, who(r), s.total);
      }
      items.push_back({seg, r});
    }
  }
  std::sort(items.begin(), items.end(), [](const Item& a, const Item& b) { return a.seg.begin < b.seg.begin; });
  auto seg_of = [&](const Item& i) { return fmt::format("segment [{}, {}) of {}", i.seg.begin, i.seg.end, who(i.rank)); };
  int64_t covered = 0;
  for (size_t i = 0; i < items.size(); ++i) {
    const Item& it = items[i];
    if (it.seg.begin < covered) return fmt::format("{} overlaps {}", seg_of(it), seg_of(items[i - 1]));
    if (it.seg.begin > covered) {
      return fmt::format("no shard holds elements [{}, {}) ({}{})", covered, it.seg.begin,
                         i > 0 ? "between " + seg_of(items[i - 1]) + " and " : "before ", seg_of(it));
    }
    covered = it.seg.end;
  }
  if (covered != s.total) {
    return fmt::format("no shard holds elements [{}, {}){}", covered, s.total,
                       items.empty() ? std::string() : " (after " + seg_of(items.back()) + ")");
  }
  return "";
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

json segments_json(const std::vector<FlatSegment>& segs) {
  json a = json::array();
  for (const auto& s : segs) a.push_back({s.begin, s.end});
  return a;
}

// [[b, e], ...] -> segments; throws (json or runtime) errors the callers turn into FormatError.
std::vector<FlatSegment> parse_segments(const json& a) {
  if (!a.is_array()) throw std::runtime_error("\"segments\" is not an array");
  std::vector<FlatSegment> out;
  for (const auto& p : a) {
    if (!p.is_array() || p.size() != 2 || !p[0].is_number_integer() || !p[1].is_number_integer()) {
      throw std::runtime_error(fmt::format("segment {} is not [begin, end]", p.dump()));
    }
    out.push_back({p[0].get<int64_t>(), p[1].get<int64_t>()});
  }
  return out;
}

// One entry of "shards" in the manifest, as written by this version (segments) or before it
// (begin, end).
struct ShardEntry {
  std::string file;
  std::vector<FlatSegment> segs;
};

std::vector<ShardEntry> parse_shard_entries(const json& sharding, int64_t* total, int* world,
                                            const std::function<void(const std::string&)>& bad) {
  std::vector<ShardEntry> out;
  try {
    *total = sharding.at("total").get<int64_t>();
    *world = sharding.at("world_size").get<int>();
    const json& shards = sharding.at("shards");
    if (!shards.is_array() || static_cast<int>(shards.size()) != *world) {
      throw std::runtime_error(fmt::format("{} shard entries for world_size {}", shards.is_array() ? shards.size() : 0,
                                           *world));
    }
    std::set<std::string> files;
    for (size_t i = 0; i < shards.size(); ++i) {
      const json& s = shards[i];
      ShardEntry e;
      if (!s.is_object() || s.value("rank", -1) != static_cast<int>(i)) {
        throw std::runtime_error(fmt::format("shard entry {} is not rank {}'s: {}", i, i, s.dump()));
      }
      e.file = s.at("file").get<std::string>();
      if (e.file.empty() || e.file.find('/') != std::string::npos || !files.insert(e.file).second) {
        throw std::runtime_error(fmt::format("shard entry {} names file '{}' (empty, a path, or another rank's)", i,
                                             e.file));
      }
      const bool has_range = s.contains("begin") || s.contains("end");
      FlatSegment range;
      if (has_range) {
        range = {s.at("begin").get<int64_t>(), s.at("end").get<int64_t>()};
        if (range.begin < 0 || range.end < range.begin) {
          throw std::runtime_error(fmt::format("shard entry {} ({}) has the range [{}, {})", i, e.file, range.begin,
                                               range.end));
        }
      }
      if (s.contains("segments")) {
        e.segs = parse_segments(s.at("segments"));
        if (has_range && !(e.segs.size() == 1 && e.segs[0] == range) && !(e.segs.empty() && range.size() == 0)) {
          throw std::runtime_error(fmt::format("shard entry {} ({}): begin/end [{}, {}) disagree with its segments {}",
                                               i, e.file, range.begin, range.end, s.at("segments").dump()));
        }
      } else if (has_range) {  // the contiguous form of checkpoints written before segments
        if (range.size() > 0) e.segs.push_back(range);
      } else {
        throw std::runtime_error(fmt::format("shard entry {} ({}) has neither segments nor begin/end", i, e.file));
      }
      if (s.contains("elements")) {
        int64_t n = 0;
        for (const auto& g : e.segs) n += g.size();
        if (s.at("elements").get<int64_t>() != n) {
          throw std::runtime_error(fmt::format("shard entry {} ({}) says {} elements, its segments hold {}", i, e.file,
                                               s.at("elements").get<int64_t>(), n));
        }
      }
      out.push_back(std::move(e));
    }
  } catch (const std::exception& e) {
    bad(fmt::format("{}: \"sharding\" is malformed ({})", io::kManifestFile, e.what()));
  }
  return out;
}

// The shard file's own record of what it holds (metadata) must agree with the manifest.
void check_file_metadata(const fsys::path& dir, const ShardEntry& e, int rank, int world, const std::string& what,
                         const std::function<void(const std::string&)>& bad) {
  const auto meta = io::SafetensorsFile::open(dir / e.file).metadata();
  auto get = [&](const char* k) -> const std::string* {
    auto it = meta.find(k);
    return it == meta.end() ? nullptr : &it->second;
  };
  std::vector<FlatSegment> segs;
  try {
    if (const std::string* r = get("rank"); r && std::stoll(*r) != rank) throw std::runtime_error("rank " + *r);
    if (const std::string* w = get("world_size"); w && std::stoll(*w) != world) {
      throw std::runtime_error("world_size " + *w);
    }
    if (const std::string* s = get("segments")) {
      segs = parse_segments(json::parse(*s));
    } else if (get("begin") && get("end")) {
      FlatSegment g{std::stoll(*get("begin")), std::stoll(*get("end"))};
      if (g.size() > 0) segs.push_back(g);
    } else {
      return;  // nothing recorded: the manifest's word alone
    }
  } catch (const std::exception& x) {
    bad(fmt::format("file {} ({}): its metadata does not match {} ({})", e.file, what, io::kManifestFile, x.what()));
  }
  if (segs != e.segs) {
    bad(fmt::format("file {} ({}) says it holds segments {} but {} lists {}", e.file, what, segments_json(segs).dump(),
                    io::kManifestFile, segments_json(e.segs).dump()));
  }
}

}  // namespace

fsys::path save_data_parallel(parallel::ProcessGroup& pg, const fsys::path& save_dir, int64_t iteration,
                              const io::CheckpointData& data, const FlatSharding* sharding,
                              const std::vector<FlatShard>& shards, io::SaveOptions opts, const HostAllGather& gather) {
  const int rank = pg.rank(), world = pg.world_size();
  json sharding_json = {{"world_size", world}, {"scheme", sharding ? "zero1" : "none"}};
  if (sharding) {
    // Every rank holds the same sharding, so every rank throws here or none does.
    PRIMUS_CHECK(sharding->world() == world, "sharding for {} ranks in a group of {}", sharding->world(), world);
    if (std::string err = check_flat_sharding(*sharding); !err.empty()) {
      throw RuntimeError(fmt::format("ZeRO-1 checkpoint {}: the shards do not partition the flat buffer: {}", iteration,
                                     err));
    }
    const std::string file = shard_file_name(rank, world);
    const fsys::path staged = staged_path(save_dir, iteration, file);
    const int64_t n = sharding->count(rank);
    const auto& mine_segs = sharding->ranks[static_cast<size_t>(rank)];
    WireDigest mine{0, 0, 0};
    std::exception_ptr failure;
    try {
      std::error_code ec;
      fsys::create_directories(save_dir, ec);
      if (ec) throw IoError(fmt::format("cannot create checkpoint folder '{}': {}", save_dir.string(), ec.message()));
      io::SafetensorsWriter w;
      for (const auto& s : shards) {
        w.add(s.name, io::DType::F32, {n}, s.data, sizeof(float) * static_cast<size_t>(n));
      }
      w.set_metadata("rank", std::to_string(rank));
      w.set_metadata("world_size", std::to_string(world));
      w.set_metadata("total", std::to_string(sharding->total));
      w.set_metadata("segments", segments_json(mine_segs).dump());
      if (mine_segs.size() == 1) {
        w.set_metadata("begin", std::to_string(mine_segs[0].begin));
        w.set_metadata("end", std::to_string(mine_segs[0].end));
      }
      io::FileDigest d = w.write(staged);
      mine = {d.size, d.crc32c, 1};
    } catch (...) {
      failure = std::current_exception();
    }
    // Every rank joins the exchange, a rank that failed too: the others must not wait for it.
    std::vector<WireDigest> all(world);
    if (gather) {
      gather(&mine, all.data(), sizeof(WireDigest));
    } else {
      // all_gather moves bytes without interpreting them: 16 bytes are 8 bf16 "elements".
      pg.all_gather(&mine, all.data(), sizeof(WireDigest) / 2, parallel::DType::BF16);
    }
    std::vector<int> failed;
    for (int r = 0; r < world; ++r) {
      if (!all[r].ok) failed.push_back(r);
    }
    if (!failed.empty()) {
      std::error_code ec;
      fsys::remove(staged, ec);
      if (failure) std::rethrow_exception(failure);
      throw IoError(fmt::format("checkpoint {} in '{}' was not saved: rank(s) {} could not write their optimizer "
                                "shard (their own errors say why)",
                                iteration, save_dir.string(), fmt::join(failed, ", ")));
    }
    json list = json::array(), names = json::array();
    for (const auto& s : shards) names.push_back(s.name);
    for (int r = 0; r < world; ++r) {
      const auto& segs = sharding->ranks[static_cast<size_t>(r)];
      json e = {{"rank", r}, {"file", shard_file_name(r, world)}, {"elements", sharding->count(r)},
                {"segments", segments_json(segs)}};
      if (segs.size() == 1) e.update({{"begin", segs[0].begin}, {"end", segs[0].end}});
      list.push_back(std::move(e));
      if (rank == 0) {
        opts.adopt.push_back({shard_file_name(r, world), staged_path(save_dir, iteration, shard_file_name(r, world)),
                              io::FileDigest{all[r].size, all[r].crc32c}});
      }
    }
    sharding_json.update({{"total", sharding->total}, {"tensors", names}, {"shards", list}});
  }
  fsys::path dir = io::checkpoint_dir(save_dir, iteration);
  if (rank == 0) {
    opts.manifest_extra["sharding"] = sharding_json;
    dir = io::save_checkpoint(save_dir, iteration, data, opts);
    if (sharding) remove_old_staged(save_dir, iteration);
  }
  // Nobody goes on (and maybe dies) before the checkpoint is complete: the last one loads.
  pg.barrier();
  return dir;
}

fsys::path save_data_parallel(parallel::ProcessGroup& pg, const fsys::path& save_dir, int64_t iteration,
                              const io::CheckpointData& data, const ShardLayout* layout,
                              const std::vector<FlatShard>& shards, io::SaveOptions opts) {
  if (!layout) return save_data_parallel(pg, save_dir, iteration, data, static_cast<const FlatSharding*>(nullptr),
                                         shards, std::move(opts));
  PRIMUS_CHECK(layout->world == pg.world_size(), "shard layout for {} ranks in a group of {}", layout->world,
               pg.world_size());
  const FlatSharding s = flat_sharding(*layout);
  return save_data_parallel(pg, save_dir, iteration, data, &s, shards, std::move(opts));
}

int saved_world_size(const io::CheckpointData& data) {
  if (!data.manifest.is_object() || !data.manifest.contains("sharding")) return 1;
  return data.manifest["sharding"].value("world_size", 1);
}

void read_flat_states(const io::CheckpointData& data, const fsys::path& dir, const std::vector<std::string>& names,
                      int64_t total, const std::vector<FlatSegment>& windows, const std::vector<float*>& dsts) {
  PRIMUS_CHECK(names.size() == dsts.size(), "read_flat_states: {} names, {} destinations", names.size(), dsts.size());
  for (const auto& w : windows) {
    PRIMUS_CHECK(0 <= w.begin && w.begin <= w.end && w.end <= total, "read_flat_states: window [{}, {}) of {}",
                 w.begin, w.end, total);
  }
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
      const float* src = it->second.as<float>().data();
      int64_t off = 0;
      for (const auto& w : windows) {
        std::memcpy(dsts[i] + off, src + w.begin, sizeof(float) * static_cast<size_t>(w.size()));
        off += w.size();
      }
    }
    return;
  }
  int64_t saved_total = 0;
  int saved_world = 0;
  const std::vector<ShardEntry> entries = parse_shard_entries(sharding, &saved_total, &saved_world, bad);
  if (saved_total != total) {
    bad(fmt::format("its optimizer state has {} elements, this model {}", saved_total, total));
  }
  FlatSharding layout{saved_total, {}};
  for (const auto& e : entries) layout.ranks.push_back(e.segs);
  if (std::string err = check_flat_sharding(layout, [&](int r) { return entries[static_cast<size_t>(r)].file; });
      !err.empty()) {
    bad(fmt::format("{}: \"sharding\": {}", io::kManifestFile, err));
  }
  // Which parts of each file land where: (file offset, destination offset, count).
  struct Copy {
    int64_t src, dst, n;
  };
  for (int r = 0; r < saved_world; ++r) {
    const ShardEntry& e = entries[static_cast<size_t>(r)];
    std::vector<Copy> copies;
    int64_t foff = 0;
    for (const auto& seg : e.segs) {
      int64_t woff = 0;
      for (const auto& w : windows) {
        const int64_t lo = std::max(seg.begin, w.begin), hi = std::min(seg.end, w.end);
        if (lo < hi) copies.push_back({foff + (lo - seg.begin), woff + (lo - w.begin), hi - lo});
        woff += w.size();
      }
      foff += seg.size();
    }
    if (copies.empty()) continue;
    const int64_t count = foff;
    const std::string what = fmt::format("optimizer shard of rank {} of {}", r, saved_world);
    auto tensors = io::load_checkpoint_file(dir, e.file, what);  // verified: size and checksum
    check_file_metadata(dir, e, r, saved_world, what, bad);
    for (size_t i = 0; i < names.size(); ++i) {
      auto it = tensors.find(names[i]);
      if (it == tensors.end() || it->second.dtype() != io::DType::F32 ||
          it->second.numel() != static_cast<uint64_t>(count)) {
        bad(fmt::format("file {} ({}) lacks tensor '{}' as F32 of {} elements (the sum of its {} segment(s))", e.file,
                        what, names[i], count, e.segs.size()));
      }
      const float* src = it->second.as<float>().data();
      for (const auto& c : copies) std::memcpy(dsts[i] + c.dst, src + c.src, sizeof(float) * static_cast<size_t>(c.n));
    }
  }
}

void read_flat_states(const io::CheckpointData& data, const fsys::path& dir, const std::vector<std::string>& names,
                      int64_t total, int64_t begin, int64_t end, const std::vector<float*>& dsts) {
  PRIMUS_CHECK(0 <= begin && begin <= end && end <= total, "read_flat_states: [{}, {}) of {}", begin, end, total);
  read_flat_states(data, dir, names, total, std::vector<FlatSegment>{{begin, end}}, dsts);
}

}  // namespace primus::parallel
