#include "io/checkpoint.h"

#include <fcntl.h>
#include <fmt/format.h>
#include <signal.h>
#include <spdlog/spdlog.h>
#include <unistd.h>

#include <algorithm>
#include <cerrno>
#include <charconv>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <set>

#include "core/util/error.h"
#include "core/util/fs.h"
#include "io/crc32c.h"
#include "io/mapped_file.h"
#include "io/safetensors.h"

namespace primus::io {
namespace fsys = std::filesystem;
using nlohmann::json;

namespace {

constexpr const char* kManifestFormat = "primus.checkpoint";
constexpr int kManifestVersion = 1;

void crash_point(const char* point) {
  const char* want = std::getenv(kCrashHookEnv);
  if (want && std::strcmp(want, point) == 0) {
    std::fprintf(stderr, "%s=%s: exiting mid-save\n", kCrashHookEnv, point);
    ::_exit(77);
  }
}

std::optional<int64_t> parse_int(std::string_view s) {
  int64_t v = 0;
  if (s.empty() || s.front() == '-' || s.front() == '+') return std::nullopt;
  auto [p, ec] = std::from_chars(s.data(), s.data() + s.size(), v);
  if (ec != std::errc() || p != s.data() + s.size()) return std::nullopt;
  return v;
}

// "iter_0000100" -> 100
std::optional<int64_t> iteration_of(const std::string& name) {
  if (name.rfind("iter_", 0) != 0) return std::nullopt;
  return parse_int(std::string_view(name).substr(5));
}

std::string hex32(uint32_t v) { return fmt::format("{:08x}", v); }

FileDigest write_text(const fsys::path& path, std::string_view text) {
  FileDigest d;
  fs::atomic_write_with(path, [&](std::FILE* f) {
    DigestWriter w(f, path.string());
    w.write(text);
    d = w.digest();
  });
  return d;
}

FileDigest write_tensors(const fsys::path& path, const std::map<std::string, TensorBlob>& tensors,
                         const SaveOptions& opts) {
  SafetensorsWriter w;
  for (const auto& [name, blob] : tensors) w.add(name, blob);
  for (const auto& [k, v] : opts.metadata) w.set_metadata(k, v);
  return w.write(path);
}

void fsync_dir(const fsys::path& dir) {
  int fd = ::open(dir.c_str(), O_RDONLY | O_DIRECTORY | O_CLOEXEC);
  if (fd >= 0) {
    ::fsync(fd);
    ::close(fd);
  }
}

bool process_alive(long pid) {
  if (pid <= 0) return false;
  return ::kill(static_cast<pid_t>(pid), 0) == 0 || errno == EPERM;
}

// Atomically puts `tmp` at `final`; when `final` exists the two are exchanged (renameat2), so
// there is no moment without a complete checkpoint under `final`, and the old one is removed.
void install_dir(const fsys::path& tmp, const fsys::path& final) {
  std::error_code ec;
  if (!fsys::exists(final, ec)) {
    fs::atomic_rename(tmp, final);
    return;
  }
  if (::renameat2(AT_FDCWD, tmp.c_str(), AT_FDCWD, final.c_str(), RENAME_EXCHANGE) != 0) {
    throw IoError(fmt::format("cannot replace checkpoint '{}' with '{}': {}", final.string(),
                              tmp.string(), std::strerror(errno)));
  }
  fsync_dir(final.parent_path());
  fsys::remove_all(tmp, ec);    // now holds the replaced checkpoint
}

// ---- manifest ----

struct Manifest {
  int64_t iteration = 0;
  std::map<std::string, FileDigest> files;
};

[[noreturn]] void bad_checkpoint(const fsys::path& dir, const std::string& msg) {
  throw FormatError(fmt::format("checkpoint '{}': {}", dir.string(), msg));
}

Manifest read_manifest(const fsys::path& dir) {
  auto path = dir / kManifestFile;
  std::error_code ec;
  if (!fsys::is_regular_file(path, ec)) {
    bad_checkpoint(dir, fmt::format("{} is missing (the save did not complete)", kManifestFile));
  }
  json j;
  try {
    j = json::parse(fs::read_file(path));
  } catch (const json::exception& e) {
    bad_checkpoint(dir, fmt::format("{} is not valid JSON: {}", kManifestFile, e.what()));
  }
  Manifest m;
  try {
    if (j.at("format").get<std::string>() != kManifestFormat) {
      bad_checkpoint(dir, fmt::format("{} has format {}, expected \"{}\"", kManifestFile,
                                      j.at("format").dump(), kManifestFormat));
    }
    if (j.at("version").get<int>() > kManifestVersion) {
      bad_checkpoint(dir, fmt::format("{} has version {}; this build reads up to {}",
                                      kManifestFile, j.at("version").get<int>(),
                                      kManifestVersion));
    }
    m.iteration = j.at("iteration").get<int64_t>();
    for (const auto& [name, e] : j.at("files").items()) {
      FileDigest d;
      d.size = e.at("size").get<uint64_t>();
      const auto& hex = e.at("crc32c").get_ref<const std::string&>();
      auto [p, perr] = std::from_chars(hex.data(), hex.data() + hex.size(), d.crc32c, 16);
      if (hex.size() != 8 || perr != std::errc() || p != hex.data() + hex.size()) {
        bad_checkpoint(dir, fmt::format("{}: crc32c of '{}' is not 8 hex digits: \"{}\"",
                                        kManifestFile, name, hex));
      }
      if (name.find('/') != std::string::npos || name.starts_with('.')) {
        bad_checkpoint(dir, fmt::format("{} lists an invalid file name '{}'", kManifestFile, name));
      }
      m.files[name] = d;
    }
  } catch (const json::exception& e) {
    bad_checkpoint(dir, fmt::format("{} is malformed: {}", kManifestFile, e.what()));
  }
  for (const char* required : {kModelFile, kOptimizerFile, kStateFile}) {
    if (!m.files.count(required)) {
      bad_checkpoint(dir, fmt::format("{} does not list {}", kManifestFile, required));
    }
  }
  return m;
}

void check_size(const fsys::path& dir, const std::string& name, const FileDigest& want) {
  std::error_code ec;
  auto path = dir / name;
  if (!fsys::is_regular_file(path, ec)) bad_checkpoint(dir, fmt::format("file {} is missing", name));
  uint64_t size = fsys::file_size(path, ec);
  if (ec) bad_checkpoint(dir, fmt::format("file {}: cannot read its size: {}", name, ec.message()));
  if (size != want.size) {
    bad_checkpoint(dir, fmt::format("file {} has {} bytes but the manifest says {} ({})", name,
                                    size, want.size, size < want.size ? "truncated" : "altered"));
  }
}

void check_crc(const fsys::path& dir, const std::string& name, const FileDigest& want,
               std::span<const std::byte> bytes) {
  uint32_t crc = crc32c(bytes.data(), bytes.size());
  if (bytes.size() != want.size) {
    bad_checkpoint(dir, fmt::format("file {} has {} bytes but the manifest says {} (changed while "
                                    "being read?)", name, bytes.size(), want.size));
  }
  if (crc != want.crc32c) {
    bad_checkpoint(dir, fmt::format("file {} fails its checksum: crc32c {} but the manifest says "
                                    "{} (altered or corrupted)", name, hex32(crc),
                                    hex32(want.crc32c)));
  }
}

// Maps `name`, checks its size and checksum against the manifest, and returns the mapping.
std::shared_ptr<const MappedFile> map_verified(const fsys::path& dir, const Manifest& m,
                                               const std::string& name) {
  const FileDigest& want = m.files.at(name);
  check_size(dir, name, want);
  auto mapped = MappedFile::open(dir / name);
  check_crc(dir, name, want, mapped->bytes());
  return mapped;
}

std::map<std::string, TensorBlob> load_tensors(const fsys::path& dir, const Manifest& m,
                                               const std::string& name) {
  auto mapped = map_verified(dir, m, name);
  auto bytes = mapped->bytes();
  auto file = SafetensorsFile::parse(bytes, mapped, (dir / name).string());
  std::map<std::string, TensorBlob> out;
  for (const auto& info : file.tensors()) out.emplace(info.name, file.blob(info.name));
  return out;
}

std::optional<int64_t> read_tracker(const fsys::path& save_dir) {
  auto path = save_dir / kTrackerFile;
  std::error_code ec;
  if (!fsys::exists(path, ec)) return std::nullopt;
  std::string text = fs::read_file(path);
  auto b = text.find_first_not_of(" \t\r\n");
  auto e = text.find_last_not_of(" \t\r\n");
  auto it = b == std::string::npos ? std::nullopt : parse_int(text.substr(b, e - b + 1));
  if (!it) spdlog::warn("checkpoint tracker '{}' does not hold an iteration: \"{}\"", path.string(), text);
  return it;
}

void prune(const fsys::path& save_dir, int keep_last, int64_t just_saved) {
  if (keep_last <= 0) return;
  auto its = list_checkpoints(save_dir);
  if (its.size() <= static_cast<size_t>(keep_last)) return;
  std::set<int64_t> keep(its.end() - keep_last, its.end());
  keep.insert(just_saved);
  if (auto t = read_tracker(save_dir)) keep.insert(*t);
  for (int64_t it : its) {
    if (keep.count(it)) continue;
    auto dir = checkpoint_dir(save_dir, it);
    // Renamed first, so a crash halfway through the removal leaves no half checkpoint under an
    // iter_ name; the leftover is a stale temporary for the next save to clean.
    auto doomed = save_dir / fmt::format(".{}.del-{}", dir.filename().string(), ::getpid());
    std::error_code ec;
    fsys::rename(dir, doomed, ec);
    if (ec) {
      spdlog::warn("cannot remove old checkpoint '{}': {}", dir.string(), ec.message());
      continue;
    }
    fsys::remove_all(doomed, ec);
    spdlog::info("removed old checkpoint '{}' (keeping the last {})", dir.string(), keep_last);
  }
}

}  // namespace

fsys::path checkpoint_dir(const fsys::path& save_dir, int64_t iteration) {
  PRIMUS_CHECK(iteration >= 0, "checkpoint iteration {} is negative", iteration);
  return save_dir / fmt::format("iter_{:07d}", iteration);
}

fsys::path save_checkpoint(const fsys::path& save_dir, int64_t iteration,
                           const CheckpointData& data, const SaveOptions& opts) {
  auto final = checkpoint_dir(save_dir, iteration);
  std::error_code ec;
  fsys::create_directories(save_dir, ec);
  if (ec) {
    throw IoError(fmt::format("cannot create checkpoint folder '{}': {}", save_dir.string(),
                              ec.message()));
  }
  remove_stale_temporaries(save_dir);

  auto tmp = save_dir / fmt::format(".{}.tmp-{}", final.filename().string(), ::getpid());
  fsys::remove_all(tmp, ec);
  fsys::create_directory(tmp, ec);
  if (ec) throw IoError(fmt::format("cannot create '{}': {}", tmp.string(), ec.message()));

  try {
    std::map<std::string, FileDigest> files;
    files[kModelFile] = write_tensors(tmp / kModelFile, data.model, opts);
    crash_point("after_model");
    files[kOptimizerFile] = write_tensors(tmp / kOptimizerFile, data.optimizer, opts);
    crash_point("after_optimizer");
    std::string state;
    try {
      state = data.state.dump(2) + "\n";
    } catch (const json::exception& e) {
      throw RuntimeError(fmt::format("trainer state cannot be written as JSON: {}", e.what()));
    }
    files[kStateFile] = write_text(tmp / kStateFile, state);
    crash_point("after_state");
    for (const auto& a : opts.adopt) {
      if (a.name.empty() || a.name.find('/') != std::string::npos || a.name.starts_with('.') || files.count(a.name) ||
          a.name == kManifestFile) {
        throw RuntimeError(fmt::format("checkpoint '{}': cannot adopt a file named '{}'", final.string(), a.name));
      }
      std::error_code rec;
      fsys::rename(a.path, tmp / a.name, rec);
      if (rec) {
        throw IoError(fmt::format("checkpoint '{}': cannot move '{}' into it: {}", final.string(), a.path.string(),
                                  rec.message()));
      }
      files[a.name] = a.digest;
    }
    if (!opts.adopt.empty()) fsync_dir(tmp);

    json manifest = {{"format", kManifestFormat},
                     {"version", kManifestVersion},
                     {"iteration", iteration},
                     {"checksum", "crc32c"},
                     {"files", json::object()}};
    for (const auto& [k, v] : opts.manifest_extra.items()) {
      if (!manifest.contains(k)) manifest[k] = v;
    }
    for (const auto& [name, d] : files) {
      manifest["files"][name] = {{"size", d.size}, {"crc32c", hex32(d.crc32c)}};
    }
    // Last, so a directory with a manifest is a directory whose files were all written.
    write_text(tmp / kManifestFile, manifest.dump(2) + "\n");
    crash_point("before_rename");
    install_dir(tmp, final);
  } catch (...) {
    fsys::remove_all(tmp, ec);
    throw;
  }
  crash_point("before_tracker");
  fs::atomic_write_file(save_dir / kTrackerFile, std::to_string(iteration));
  spdlog::info("saved checkpoint '{}'", final.string());
  prune(save_dir, opts.keep_last, iteration);
  return final;
}

int remove_stale_temporaries(const fsys::path& save_dir) {
  int removed = 0;
  std::error_code ec;
  for (const auto& entry : fsys::directory_iterator(save_dir, ec)) {
    std::string name = entry.path().filename().string();
    if (!name.starts_with(".iter_")) continue;
    auto dash = name.rfind('-');
    bool tmp = name.find(".tmp-") != std::string::npos, del = name.find(".del-") != std::string::npos;
    if ((!tmp && !del) || dash == std::string::npos) continue;
    auto pid = parse_int(std::string_view(name).substr(dash + 1));
    if (!pid) continue;
    // Our own pid may be a save under way on another thread; a live pid may be another
    // process saving into the same folder.
    if (*pid == ::getpid() || process_alive(*pid)) continue;
    std::error_code rec;
    fsys::remove_all(entry.path(), rec);
    if (rec) {
      spdlog::warn("cannot remove '{}' left by an interrupted {} (pid {}): {}",
                   entry.path().string(), tmp ? "save" : "prune", *pid, rec.message());
    } else {
      spdlog::warn("removed '{}' left by an interrupted {} (pid {})", entry.path().string(),
                   tmp ? "save" : "prune", *pid);
      ++removed;
    }
  }
  return removed;
}

std::vector<int64_t> list_checkpoints(const fsys::path& save_dir) {
  std::vector<int64_t> out;
  std::error_code ec;
  for (const auto& entry : fsys::directory_iterator(save_dir, ec)) {
    auto it = iteration_of(entry.path().filename().string());
    std::error_code mec;
    if (it && entry.is_directory(mec) && fsys::exists(entry.path() / kManifestFile, mec)) {
      out.push_back(*it);
    }
  }
  std::sort(out.begin(), out.end());
  return out;
}

void verify_checkpoint(const fsys::path& dir, bool sizes_only) {
  Manifest m = read_manifest(dir);
  for (const auto& [name, want] : m.files) {
    if (sizes_only) {
      check_size(dir, name, want);
    } else {
      map_verified(dir, m, name);
    }
  }
}

std::optional<CheckpointRef> find_latest(const fsys::path& save_dir) {
  if (auto it = read_tracker(save_dir)) {
    auto dir = checkpoint_dir(save_dir, *it);
    try {
      verify_checkpoint(dir, /*sizes_only=*/true);
      return CheckpointRef{*it, dir};
    } catch (const Error& e) {
      spdlog::warn("checkpoint tracker names iteration {}, but {}; looking for the newest "
                   "complete checkpoint instead", *it, e.what());
    }
  }
  auto its = list_checkpoints(save_dir);
  for (auto i = its.rbegin(); i != its.rend(); ++i) {
    auto dir = checkpoint_dir(save_dir, *i);
    try {
      verify_checkpoint(dir);
      return CheckpointRef{*i, dir};
    } catch (const Error& e) {
      spdlog::warn("skipping checkpoint: {}", e.what());
    }
  }
  return std::nullopt;
}

CheckpointData load_checkpoint(const fsys::path& dir, bool verify_other_files) {
  Manifest m = read_manifest(dir);
  CheckpointData out;
  out.manifest = json::parse(fs::read_file(dir / kManifestFile));  // read_manifest checked it
  out.model = load_tensors(dir, m, kModelFile);
  out.optimizer = load_tensors(dir, m, kOptimizerFile);
  {
    const FileDigest& want = m.files.at(kStateFile);
    check_size(dir, kStateFile, want);
    std::string text = fs::read_file(dir / kStateFile);
    check_crc(dir, kStateFile, want, std::as_bytes(std::span(text)));
    try {
      out.state = json::parse(text);
    } catch (const json::exception& e) {
      bad_checkpoint(dir, fmt::format("file {} is not valid JSON: {}", kStateFile, e.what()));
    }
  }
  // Files the manifest lists beyond the three above are verified too.
  for (const auto& [name, want] : m.files) {
    if (!verify_other_files) break;
    if (name != kModelFile && name != kOptimizerFile && name != kStateFile) map_verified(dir, m, name);
  }
  return out;
}

std::map<std::string, TensorBlob> load_checkpoint_file(const fsys::path& dir, const std::string& name,
                                                       const std::string& what) {
  Manifest m = read_manifest(dir);
  std::string label = what.empty() ? name : fmt::format("{} ({})", name, what);
  if (!m.files.count(name)) bad_checkpoint(dir, fmt::format("{} does not list {}", kManifestFile, label));
  std::error_code ec;
  if (!fsys::is_regular_file(dir / name, ec)) bad_checkpoint(dir, fmt::format("file {} is missing", label));
  try {
    return load_tensors(dir, m, name);
  } catch (const FormatError& e) {
    if (what.empty()) throw;
    throw FormatError(fmt::format("{} [{}]", e.what(), what));
  }
}

}  // namespace primus::io
